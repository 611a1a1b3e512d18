//! Published throughput of today's stacks (torchtitan's FSDP2 benchmarks,
//! NVIDIA NeMo and Megatron-Bridge on DGX-H100 and DGX-B200, torchtitan on H200,
//! Megatron-Core's weak scaling on H100, Meta's Llama 3 405B pre-training) as test data: each row pins the configuration
//! its source states, and the prediction of tokens/s per GPU (model TFLOP/s
//! per GPU where that is what the source gives) is compared with the
//! published one.
//!
//! Rows within 10% are asserted. The others stay here as data with the ratio
//! measured on 2026-11-25 (re-taken after the sustained GEMM rates, FP8's
//! own rate, FlashAttention-2's forward and backward rates, the overlap
//! slowdown and FSDP2's copies; then after FSDP's float8 all-gather,
//! `fp8_gather=on`, which the 405B float8 and H200 rows pin as their
//! configs state; and on 2026-11-26 after `attention=fused` took
//! FlashAttention-3's measured rates on Hopper and interleaved pipelines
//! their time-balanced stage split; and after torchtitan's layer-level
//! checkpointing was priced as partial recomputation, `recompute_layers`,
//! instead of full) and the reason they are not asserted (a
//! stack mechanism dplc does not model yet, a device whose peak the source
//! does not know, a schedule dplc cannot express); bench/RESULTS.md has the
//! table.
//! Nothing here is fitted: the same cost-model constants serve every row.
//!
//! Conventions (from the sources, see each row): torchtitan's tokens/s per
//! GPU is the local `labels.numel()` per step over step time, i.e. global
//! batch × seq / step / GPUs, as dplc's `tokens_per_s / world`. NVIDIA's
//! "Tokens/sec/GPU" is the same quantity. Where a source does not print the
//! sequence length, the row takes it from the default train config at the
//! benchmarked commit and says so.

use dplc_planner::{
    cluster_from_spec, compile, parse_cluster, parse_strategy, Cluster, PlanRequest,
};

/// The stack torchtitan runs without torch.compile (its default in April
/// 2024): FSDP2 is ZeRO-3 with the reduction overlapped and each parameter
/// sharded on its own (`shards=per_param`: every all-gather copied out into
/// the parameters, every reduce-scatter's input copied in), SDPA runs
/// FlashAttention-2 (PyTorch's flash backend; the sources do not name the
/// backend), every elementwise op runs as its own kernel, and so does the
/// loss: PyTorch's `F.cross_entropy` over the logits cast to fp32
/// (`loss=eager`; train.py @ 157a12c and 3faaa1a, the model's own
/// `self.output(h).float()`; @ 9dec370 `pred.flatten(0, 1).float()`).
const TORCHTITAN_EAGER_2024: &str =
    "zero=3,shards=per_param,tp_impl=dtensor,attention=flash2,elementwise=eager,offload=none,loss=eager";
/// torchtitan with torch.compile as its 2024 tables ran it: Inductor fuses
/// the model's elementwise chains, as dplc prices by default; SDPA is still
/// FlashAttention-2; the loss stays eager (train.py @ 9dec370: "compiling
/// loss function causes CUDA errors, turning off for now").
const TORCHTITAN_COMPILED_2024: &str =
    "zero=3,shards=per_param,tp_impl=dtensor,attention=flash2,elementwise=fused,offload=none,loss=eager";
/// torchtitan with torch.compile from 2025: the loss compiled too
/// (torchtitan/components/loss.py @ 820504e, `build_cross_entropy_loss`),
/// fused, as dplc prices by default.
const TORCHTITAN_COMPILED: &str =
    "zero=3,shards=per_param,tp_impl=dtensor,attention=flash2,elementwise=fused,offload=none";

/// What a row's source publishes per GPU.
#[derive(Clone, Copy, PartialEq, Debug)]
enum Metric {
    /// Tokens/s per GPU (torchtitan's and NVIDIA's tables).
    Tokens,
    /// Model TFLOP/s per GPU (the Llama 3 paper's, Megatron-Core's): every
    /// matmul of the unsplit model, attention's scores over the whole
    /// sequence (Megatron-LM's count before core_v0.16.0): dplc's model
    /// FLOPs and the attention its causal mask removes, which dplc's count
    /// leaves out.
    ModelTflops,
}

#[derive(Clone, Copy, PartialEq, Debug)]
enum Verdict {
    /// Within 10% of the published number: asserted.
    Asserted,
    /// On a part whose peak its source bounds but does not know (the Grand
    /// Teton H100: between the NVL's and the SXM's): asserted within 10%
    /// at some peak inside the bounds, that is read at most 10% fast at the
    /// lower bound (`low`, the ratio recorded there, on
    /// [`LOWER_BOUND`]'s section) and at most 10% slow at the upper
    /// (`measured`).
    Bracketed { low: f64 },
    /// Kept as data; the reason is printed and in bench/RESULTS.md.
    NotAsserted(&'static str),
}

/// The Grand Teton section at its source's upper bound on the peak, and
/// the one at its lower bound (models/clusters/).
const UPPER_BOUND: &str = "grand_teton_h100";
const LOWER_BOUND: &str = "grand_teton_h100_nvl_peak";

/// `row` on the lower bound of its part's peak, where its source bounds it.
fn at_lower_bound(row: &Row) -> Option<Row> {
    let (nodes, section) = row.cluster.split_once(" x ")?;
    (section == UPPER_BOUND).then(|| Row {
        // A few short names, held for the test's life.
        cluster: Box::leak(format!("{nodes} x {LOWER_BOUND}").into_boxed_str()),
        ..*row
    })
}

struct Row {
    name: &'static str,
    /// Repository, path and commit of the published number.
    source: &'static str,
    file: &'static str,
    model: &'static str,
    /// A catalog shorthand (`8x8xA100`) or `NODES x SECTION` for a cluster
    /// section in `models/clusters/`.
    cluster: &'static str,
    seq: u64,
    global_batch: u64,
    strategy: &'static str,
    stack: &'static str,
    /// Published tokens/s per GPU, or model TFLOP/s per GPU (`metric`).
    published: f64,
    metric: Metric,
    /// Predicted / published as last recorded (0.0: dplc cannot plan the
    /// row); checked to its three decimals, so a change to the cost model
    /// that moves a row says so here, where README and RESULTS quote it.
    measured: f64,
    verdict: Verdict,
}

const TT_PERF_A100: &str = "pytorch/torchtitan docs/performance.md @ 157a12c562288b3bccb077003a97f18a4ca657aa (2024-04-24), 64 A100 80GB, FSDP 64";
const TT_PERF_A100_L2: &str = "pytorch/torchtitan docs/performance.md @ 395a526276eed4000c038a37d9b4859d0813af7c and @ 157a12c562288b3bccb077003a97f18a4ca657aa, 64 A100 80GB, FSDP 64, seq 4096";
const TT_H100_202412: &str = "pytorch/torchtitan benchmarks/llama3_h100_202412_torchtitan.md @ b5bcd76c66d0acb1a08b176d9639425bc55e0b2a (content of d4c86e3758a84cf23e2e879ab3c995cba9d5e410), torchtitan 9dec370, seq 8192 from llama3_8b.toml";
const TT_ASYNC_TP: &str = "pytorch/torchtitan benchmarks/asyncTP_llama3_h100_2025-06_torchtitan.md @ 2887250bbd9103d0bc997ea2efb3a525b5e5dbc0, seq 8192 from the toml @ 820504e";
const TT_405B: &str = "pytorch/torchtitan docs/performance.md @ 3faaa1a0dee68ce028400e3dafd1735d152cb4f8 (2024-08-23), 128 H100 (94GB), FSDP 16 x TP 8, full AC, local batch 2";
const TT_H200: &str = "pytorch/torchtitan benchmarks/llama3-8b_h200_202506_trainy-whitefiber.md @ cbccb387871a5e1f522c1e222c51ab88b03c0392, llama3_8b.toml @ e7c0cae: seq 8192, selective op AC, float8 tensorwise";
const NEMO_2407: &str = "NVIDIA/NeMo docs/source/performance/performance_summary.md @ 070a0bb168d405d653b9734c0017cf5078e77c0d (NeMo 24.07, DGX-H100, FP8)";
/// NeMo 24.07's stack: Megatron-Core's default loss, `vocab_parallel_cross_entropy`
/// in fp32 pass by pass (`loss=unfused`): `cross_entropy_loss_fusion` is
/// False in Megatron-Core's `ModelParallelConfig` (core_r0.8.0 and
/// core_r0.9.0, megatron/core/model_parallel_config.py), and NeMo at the
/// table's commit never sets it (no `cross_entropy_loss_fusion` anywhere in
/// NVIDIA/NeMo @ 070a0bb; its GPT model hands the labels to Megatron-Core's
/// `compute_language_model_loss`).
const NEMO_2407_STACK: &str = "offload=none,loss=unfused";
const MBRIDGE: &str = "NVIDIA-NeMo/Megatron-Bridge docs/performance-summary.md @ df0289c180dd20ff26933455c7a0a11084f6a36f (DGX-H100, FP8)";
const MBRIDGE_2509: &str = "NVIDIA-NeMo/Megatron-Bridge docs/performance-summary.md @ fa0315ae2684693a666be9d247adf9baf1e30028 (25.09 container, DGX-H100; FP8 per tensor, the table's parentheses being the blockwise recipe), run by scripts/performance/run_script.py and configs/qwen3/qwen3_30b_a3b_llm_pretrain.yaml at that commit: fp8_cs at micro-batch 2 (first and last layers not kept in bf16, FP8 parameter gathers), no recomputation, token drop at capacity factor 1.0 padded to capacity with the alltoall dispatcher (apply_moe_token_drop): dplc's `moe` exactly";
const MBRIDGE_2604: &str = "NVIDIA-NeMo/Megatron-Bridge docs/performance-summary-archive.md @ 067f987df03b8355b03192d88d70f1709fedf51a, \"26.04.01 NeMo Container\", DGX-H100, FP8; the 16-GPU recipe (src/megatron/bridge/recipes/qwen/h100/qwen3_moe.py, same commit, qwen3_30b_a3b_pretrain_16gpu_h100_bf16_config): TP 1, PP 1, EP 16, no recomputation, the HybridEP dispatcher";
const MBRIDGE_B200: &str = "NVIDIA-NeMo/Megatron-Bridge docs/performance-summary.md @ df0289c180dd20ff26933455c7a0a11084f6a36f, 25.11 NeMo container, System: DGX-B200, FP8-CS (the FP8-MX figures in parentheses not taken)";

const LLAMA3: &str = "Grattafiori et al. 2024, The Llama 3 Herd of Models (arXiv:2407.21783), §3.3.2 Table 4: Llama 3 405B pre-training on 700 W H100 80GB HBM3 in Grand Teton servers, 400 Gbps RoCE per GPU; TP 8, PP 16, seq 8192 (131072 with CP 16), 16M tokens a batch, BF16; the interleaved schedule with the first and last stage a layer short (§3.3.2), chunks per stage, attention kernel and recomputation not stated (the search chooses)";
const MCORE: &str = "NVIDIA/Megatron-LM README.md, \"Performance Benchmarking\" and images/model_table.png @ f2e5db402c (2024-07-15, \"New scaling figures on H100 GPUs\"; Megatron-Core r0.8.0, the strong-scaling figure's legend): GPT models of vocabulary 131,072 at sequence 4,096 on H100s, DP 48, per-GPU model TFLOP/s by Megatron's num_floating_point_operations (megatron/training/training.py @ core_r0.8.0, dplc's count), `--overlap-grad-reduce` and `--overlap-param-gather` (the distributed optimizer: zero=1), `--tp-comm-overlap` (with sequence parallelism); `--cross-entropy-loss-fusion` not stated: Megatron's default loss pinned (loss=unfused: `vocab_parallel_cross_entropy`, fp32 pass by pass); precision, micro-batch, schedule, recomputation and dropout not stated: bf16 (the MFU column is against the bf16 peak), Megatron's default dropout 0.1, the rest the search's";
const DPLC_H200: &str = "dplc bench/RESULTS.md, \"The GPU check on an NVIDIA H200\" (2026-11-26, run 3): bench/torch_gpt2_step.py --micro-batch 32 --micro-batches 1 --seq 1024 --warmup 1 --steps 3, PyTorch 2.11.0+cu130 on one NVIDIA H200 (driver 580.159.04): models/gpt2.dpl's GPT-2 small (dropout 0.1, tied head), bf16 autocast over fp32 master weights, SDPA (flash), AdamW, clipping";

const FSDP_PP: &str = "FSDP (ZeRO-3) under a pipeline plans and runs as torchtitan runs it: each stage's weights gathered once a step and its gradients reduce-scattered once after its last backward (FSDP2 does not reshard after forward when pipelining, and PyTorch's pipeline stage defers the reduce-scatter); it reads 1.32 and 1.31 at the SXM peak, 1.17 and 1.16 at the NVL's (the bounds its source puts on the 500 W part's peak), with the async TP these rows ran priced as `tp_overlap=ring`: priced without it (`tp_overlap=none`) they read 1.061 and 1.059 at the SXM peak, 0.953 and 0.952 at the NVL's, inside the bracket, so the excess is the one the async TP rows show (see ASYNC_TP); what interleaving gains is checked against the source instead (interleaving_gains_what_torchtitan_measured)";
const ASYNC_TP: &str = "torchtitan's async TP (symmetric-memory micro-pipelining of each collective with its GEMM) gains 6-16% over its vanilla TP on the same part and plan (published), where dplc's `tp_overlap=ring` gains 26-33%: priced as Megatron's userbuffers ring, each chunk's transfer behind the next chunk's GEMM, with none of DTensor's layout copies left; the vanilla rows on the part fall inside the bracket of its peak, these read 1.11-1.31 at its lower bound, and priced without the overlap (`tp_overlap=none`) each would read inside it (0.88-1.08); see bench/RESULTS.md";
const A100_GAP: &str = "dplc reads torchtitan's eager A100 runs 11-19% fast after every mechanism priced here; every knob its source states is priced (FSDP2 with bf16 gathers and fp32 reduce-scatters, resharding after forward, eager kernels, op-level checkpointing, layer-level checkpointing of every second layer as half of each chunk's layers recomputed (`recompute_layers`: the same count, the same price), SDPA's FlashAttention-2), except the 8B and 13B configs' Triton fused RMSNorm, which dplc prices as eager PyTorch's five passes, making those rows read slow by a few percent; the rest is not explained (no sustained matmul rate is measured for the A100, the cluster's network is not stated); see bench/RESULTS.md";
const H200_FAST: &str = "10.8% fast at 32 GPUs, 12.5% at 64, with FSDP's float8 all-gather its command line turns on priced (1.087 and 1.107 before it): torchtitan loses 1.7% from 32 to 64 GPUs, dplc 0.1% (each layer's gathers and reduce-scatters paying their own latency); see bench/RESULTS.md";
const GPT3_20B: &str = "18% slow: with the stated knobs dplc's ZeRO-1 plan needs 83 GiB (bf16 weights beside their FP8 casts and fp32 gradients) and the search takes ZeRO-2, whose per-micro-batch reduce-scatters cost 0.23 s exposed; with FP8 parameter gathers (`zero=1,fp8_gather=on`, as NeMo's later FP8 recipes set, not stated for 24.07) it fits and reads 0.988 (0.993 with the fused loss); see bench/RESULTS.md";
const LLAMA3_CP: &str = "23% fast at 131,072 tokens; the paper reports TFLOP/s per GPU, not tokens/s, and at this length attention is 57% of dplc's model FLOPs counted over the whole sequence (Megatron's convention) and 40% counted causally, and the source does not say which it counts (the 8K rows move by 4% between the two); with FlashAttention-2's rate instead of the fused (FlashAttention-3) one dplc reads 0.889; see bench/RESULTS.md";
const B200_8B: &str = "12.0% fast; no fused-attention rate is measured for the B200, so its attention runs at the device's GEMM rate (with the H100 die's ratios of FlashAttention-3's forward and backward to its GEMM rate it read 1.068 before the recipe's bf16 main gradients were pinned, not asserted: that ratio is the H100's); the 405B row on the same system reads 1.097; see bench/RESULTS.md";
const MBRIDGE_405B_2511: &str = "12.8% fast with the recipe's bf16 main gradients pinned and each chunk's gradient reduction and weight gather overlapped as Megatron-Core's interleaved schedule launches them (1.084 with none of these: an fp32 reduce-scatter across nodes left at the end of the step); the same configuration on the next container (26.02, the next row) published 6.5% more and reads 1.076, asserted: what separates the two containers is software dplc does not see; see bench/RESULTS.md";
const NEMOTRON_340B: &str = "recompute n/s: with the stated knobs dplc's plan needs recomputation to fit (its bf16 weights beside their FP8 casts, fp32 gradients, and the MLP's 73,728-wide activations), and the search recomputes every layer; not explained further; see bench/RESULTS.md";
const QWEN3_MOE: &str = "2.5x fast: this run is dropless (the page: \"all benchmarks are token-dropless\"), where dplc's `moe` drops at a capacity factor (static shapes: every expert padded to capacity); the same configuration with token dropping (25.09, the row below) published 10,494 tokens/s, 2.0x this row, and dplc reads that 1.27; later containers run the dropless model 1.7x faster on the same 16 H100s (26.02 5,113 in the archive @ 067f987, which corrects the 2,557 this commit printed; 26.02.01 9,058; 26.04.01 8,960); see bench/RESULTS.md";
const QWEN3_TOKENDROP: &str = "27% fast, priced as run: the recipe's plan without recomputation fits (79.5 GiB on the last stage, 99% of the H100; it needed 81.8 while the head's activations were counted once per micro-batch the stage's 24 chunks hold in flight, where the pipeline's last chunk holds one), and the search takes it; not explained (1.06 when the search recomputed every layer to fit); see bench/RESULTS.md";
const QWEN3_MOE_HOST: &str = "1.58x fast with the recipe's HybridEP dispatcher priced (pinned to one all-to-all it reads 0.86; 1.60 before an all-to-all across nodes was priced through each rank's NIC): at micro-batch 1 a layer's forward and backward take 9.5 ms of the published step against dplc's 6.0 (4.2 of compute, 1.8 of dispatch and combine); Megatron-Core's MoE report (arXiv:2603.07685) names the rest, host-boundedness from many small kernels and the dispatcher's synchronisation, which dplc does not price (no host time is in its model); see bench/RESULTS.md";
const MCORE_SCHEDULE: &str = "the pipeline schedule is not stated, and it sets the bubble: the search's interleaving (7 to 23 chunks a stage) reads 1.10-1.15, Megatron's plain 1F1B 0.86-0.95, two chunks a stage 0.98-1.07; the published number lies between the first two on every such row; see bench/RESULTS.md";
const CP_RING: &str = "500 W Grand Teton part (an upper bound), and torchtitan's 4- and 8-way context parallelism runs SDPA once per ring step (load balancing n/s), which dplc prices as one overlapped ring; see bench/RESULTS.md";

fn rows() -> Vec<Row> {
    let r = |name,
             source,
             (file, model): (&'static str, &'static str),
             cluster,
             (seq, global_batch): (u64, u64),
             strategy,
             stack,
             published,
             measured,
             verdict| Row {
        name,
        source,
        file,
        model,
        cluster,
        seq,
        global_batch,
        strategy,
        stack,
        published,
        metric: Metric::Tokens,
        measured,
        verdict,
    };
    let tflops = |row: Row| Row {
        metric: Metric::ModelTflops,
        ..row
    };
    use Verdict::*;
    const L3: &str = "llama3.dpl";
    const L2: &str = "llama2.dpl";
    const GPT: &str = "megatron_gpt.dpl";
    const GPT2: &str = "gpt2.dpl";
    const NEMOTRON: &str = "nemotron.dpl";
    const QWEN3: &str = "qwen3.dpl";
    vec![
        // ---- PyTorch on one H200, measured by dplc's own GPU check (its peer for the gpt2 step).
        r("PyTorch 2.11 GPT-2 small, 1 H200, torch.compile", DPLC_H200, (GPT2, "gpt2"), "1xH200", (1024, 32),
          "tp=1,pp=1,cp=1,dp=1,mb=32,recompute=none,zero=0", "attention=flash2,elementwise=fused,offload=none,autocast=on", 458281.0, 0.978, Asserted),
        r("PyTorch 2.11 GPT-2 small, 1 H200, eager", DPLC_H200, (GPT2, "gpt2"), "1xH200", (1024, 32),
          "tp=1,pp=1,cp=1,dp=1,mb=32,recompute=none,zero=0", "attention=flash2,elementwise=eager,offload=none,autocast=on", 223945.0, 1.036, Asserted),
        // ---- torchtitan, 64 A100 80GB (host size n/s: DGX A100 assumed), eager, seq 8192 / 4096 (cfg).
        r("TT A100 Llama3 8B, selective layer AC", TT_PERF_A100, (L3, "llama3_8b"), "8x8xA100", (8192, 64),
          "tp=1,pp=1,cp=1,dp=64,mb=1,recompute_layers=16", TORCHTITAN_EAGER_2024, 2904.0, 1.133, NotAsserted(A100_GAP)),
        r("TT A100 Llama3 8B, selective op AC", TT_PERF_A100, (L3, "llama3_8b"), "8x8xA100", (8192, 64),
          "tp=1,pp=1,cp=1,dp=64,mb=1,recompute=op", TORCHTITAN_EAGER_2024, 2973.0, 1.132, NotAsserted(A100_GAP)),
        r("TT A100 Llama3 70B, full AC", TT_PERF_A100, (L3, "llama3_70b"), "8x8xA100", (8192, 64),
          "tp=1,pp=1,cp=1,dp=64,mb=1,recompute=full", TORCHTITAN_EAGER_2024, 331.0, 1.114, NotAsserted(A100_GAP)),
        r("TT A100 Llama2 13B, no AC", TT_PERF_A100_L2, (L2, "llama2_13b"), "8x8xA100", (4096, 128),
          "tp=1,pp=1,cp=1,dp=64,mb=2,recompute=none", TORCHTITAN_EAGER_2024, 2162.0, 1.131, NotAsserted(A100_GAP)),
        r("TT A100 Llama2 13B, selective layer AC", TT_PERF_A100_L2, (L2, "llama2_13b"), "8x8xA100", (4096, 128),
          "tp=1,pp=1,cp=1,dp=64,mb=2,recompute_layers=20", TORCHTITAN_EAGER_2024, 1914.0, 1.110, NotAsserted(A100_GAP)),
        r("TT A100 Llama2 13B, selective op AC", TT_PERF_A100_L2, (L2, "llama2_13b"), "8x8xA100", (4096, 128),
          "tp=1,pp=1,cp=1,dp=64,mb=2,recompute=op", TORCHTITAN_EAGER_2024, 1904.0, 1.129, NotAsserted(A100_GAP)),
        r("TT A100 Llama2 70B, selective op AC, local batch 1", TT_PERF_A100_L2, (L2, "llama2_70b"), "8x8xA100", (4096, 64),
          "tp=1,pp=1,cp=1,dp=64,mb=1,recompute=op", TORCHTITAN_EAGER_2024, 355.0, 1.188, NotAsserted(A100_GAP)),
        r("TT A100 Llama2 70B, full AC, local batch 2", TT_PERF_A100_L2, (L2, "llama2_70b"), "8x8xA100", (4096, 128),
          "tp=1,pp=1,cp=1,dp=64,mb=2,recompute=full", TORCHTITAN_EAGER_2024, 353.0, 1.106, NotAsserted(A100_GAP)),
        // ---- torchtitan, Grand Teton H100 (Dec 2024), Table 1 (1 host) and Table 3 (16 hosts).
        r("TT H100 Llama3.1 8B, FSDP 8, eager", TT_H100_202412, (L3, "llama3_8b"), "1 x grand_teton_h100", (8192, 16),
          "tp=1,pp=1,cp=1,dp=8,mb=2,recompute=op", TORCHTITAN_EAGER_2024, 5762.0, 1.179, Bracketed { low: 1.050 }),
        r("TT H100 Llama3.1 8B, FSDP 8, compile", TT_H100_202412, (L3, "llama3_8b"), "1 x grand_teton_h100", (8192, 16),
          "tp=1,pp=1,cp=1,dp=8,mb=2,recompute=op", TORCHTITAN_COMPILED_2024, 6667.0, 1.219, Bracketed { low: 1.063 }),
        r("TT H100 Llama3.1 8B, FSDP 8, compile + float8", TT_H100_202412, (L3, "llama3_8b"), "1 x grand_teton_h100", (8192, 16),
          "tp=1,pp=1,cp=1,dp=8,mb=2,recompute=op,fp8=on", TORCHTITAN_COMPILED_2024, 8532.0, 1.182, Bracketed { low: 1.050 }),
        r("TT H100 Llama3.1 8B, FSDP 128, eager", TT_H100_202412, (L3, "llama3_8b"), "16 x grand_teton_h100", (8192, 256),
          "tp=1,pp=1,cp=1,dp=128,mb=2,recompute=op", TORCHTITAN_EAGER_2024, 5605.0, 1.212, Bracketed { low: 1.079 }),
        r("TT H100 Llama3.1 8B, FSDP 128, compile", TT_H100_202412, (L3, "llama3_8b"), "16 x grand_teton_h100", (8192, 256),
          "tp=1,pp=1,cp=1,dp=128,mb=2,recompute=op", TORCHTITAN_COMPILED_2024, 6514.0, 1.248, Bracketed { low: 1.088 }),
        r("TT H100 Llama3.1 8B, FSDP 128, compile + float8", TT_H100_202412, (L3, "llama3_8b"), "16 x grand_teton_h100", (8192, 256),
          "tp=1,pp=1,cp=1,dp=128,mb=2,recompute=op,fp8=on", TORCHTITAN_COMPILED_2024, 8380.0, 1.204, Bracketed { low: 1.069 }),
        // Table 2: FSDP + CP, compile + float8, full AC, local batch 1.
        r("TT H100 Llama3.1 8B, FSDP 8 CP 1, seq 32768", TT_H100_202412, (L3, "llama3_8b"), "1 x grand_teton_h100", (32768, 8),
          "tp=1,pp=1,cp=1,dp=8,mb=1,recompute=full,fp8=on", TORCHTITAN_COMPILED_2024, 3890.0, 1.212, Bracketed { low: 1.045 }),
        r("TT H100 Llama3.1 8B, FSDP 4 CP 2, seq 65536", TT_H100_202412, (L3, "llama3_8b"), "1 x grand_teton_h100", (65536, 4),
          "tp=1,pp=1,cp=2,dp=4,mb=1,recompute=full,fp8=on", TORCHTITAN_COMPILED_2024, 2540.0, 1.130, Bracketed { low: 0.967 }),
        r("TT H100 Llama3.1 8B, FSDP 2 CP 4, seq 131072", TT_H100_202412, (L3, "llama3_8b"), "1 x grand_teton_h100", (131072, 2),
          "tp=1,pp=1,cp=4,dp=2,mb=1,recompute=full,fp8=on", TORCHTITAN_COMPILED_2024, 1071.0, 1.503, NotAsserted(CP_RING)),
        r("TT H100 Llama3.1 8B, FSDP 1 CP 8, seq 262144", TT_H100_202412, (L3, "llama3_8b"), "1 x grand_teton_h100", (262144, 1),
          "tp=1,pp=1,cp=8,dp=1,mb=1,recompute=full,fp8=on", TORCHTITAN_COMPILED_2024, 548.0, 1.564, NotAsserted(CP_RING)),
        // Table 4: 2D, Llama 3.1 70B on 256 GPUs, FSDP 32 x TP 8, local batch 16, full AC, compile + float8.
        r("TT H100 Llama3.1 70B, FSDP 32 TP 8", TT_H100_202412, (L3, "llama3_70b"), "32 x grand_teton_h100", (8192, 512),
          "tp=8,pp=1,cp=1,dp=32,mb=16,recompute=full,sp=on,tp_overlap=none,fp8=on", TORCHTITAN_COMPILED_2024, 829.0, 1.020, Bracketed { low: 0.932 }),
        r("TT H100 Llama3.1 70B, FSDP 32 TP 8, async TP", TT_H100_202412, (L3, "llama3_70b"), "32 x grand_teton_h100", (8192, 512),
          "tp=8,pp=1,cp=1,dp=32,mb=16,recompute=full,sp=on,tp_overlap=ring,fp8=on", TORCHTITAN_COMPILED_2024, 876.0, 1.222, NotAsserted(ASYNC_TP)),
        // Table 5: 3D, Llama 3.1 405B on 512 GPUs, FSDP 8 x TP 8 x PP 8, local batch 32, 1F1B, 8 micro-batches (code default).
        r("TT H100 Llama3.1 405B, FSDP 8 TP 8 PP 8, 1F1B", TT_H100_202412, (L3, "llama3_405b"), "64 x grand_teton_h100", (8192, 256),
          "tp=8,pp=8,cp=1,dp=8,mb=4,m=8,schedule=1f1b,recompute=full,sp=on,tp_overlap=ring,fp8=on", TORCHTITAN_COMPILED_2024, 100.0, 1.319, NotAsserted(FSDP_PP)),
        // The interleaved row: chunks per rank not stated (bench/published_rows.md note 7); v=2 assumed,
        // 126 layers in 8 x 2 chunks of 8 and 7.
        r("TT H100 Llama3.1 405B, FSDP 8 TP 8 PP 8, interleaved 1F1B", TT_H100_202412, (L3, "llama3_405b"), "64 x grand_teton_h100", (8192, 256),
          "tp=8,pp=8,cp=1,dp=8,mb=4,m=8,schedule=interleaved,v=2,recompute=full,sp=on,tp_overlap=ring,fp8=on", TORCHTITAN_COMPILED_2024, 128.0, 1.311, NotAsserted(FSDP_PP)),
        // asyncTP benchmark (June 2025): 70B on 256, FSDP 32 x TP 8, local batch 16, full AC; 8B on 64, FSDP 8 x TP 8, local batch 12, op SAC.
        r("TT H100 Llama3 70B, TP 8 bf16", TT_ASYNC_TP, (L3, "llama3_70b"), "32 x grand_teton_h100", (8192, 512),
          "tp=8,pp=1,cp=1,dp=32,mb=16,recompute=full,sp=on,tp_overlap=none", TORCHTITAN_COMPILED, 597.3, 1.122, Bracketed { low: 1.003 }),
        r("TT H100 Llama3 70B, async TP 8 bf16", TT_ASYNC_TP, (L3, "llama3_70b"), "32 x grand_teton_h100", (8192, 512),
          "tp=8,pp=1,cp=1,dp=32,mb=16,recompute=full,sp=on,tp_overlap=ring", TORCHTITAN_COMPILED, 652.4, 1.291, NotAsserted(ASYNC_TP)),
        r("TT H100 Llama3 70B, TP 8 float8 tensorwise", TT_ASYNC_TP, (L3, "llama3_70b"), "32 x grand_teton_h100", (8192, 512),
          "tp=8,pp=1,cp=1,dp=32,mb=16,recompute=full,sp=on,tp_overlap=none,fp8=on", TORCHTITAN_COMPILED, 809.8, 1.048, Bracketed { low: 0.957 }),
        r("TT H100 Llama3 70B, async TP 8 float8 tensorwise", TT_ASYNC_TP, (L3, "llama3_70b"), "32 x grand_teton_h100", (8192, 512),
          "tp=8,pp=1,cp=1,dp=32,mb=16,recompute=full,sp=on,tp_overlap=ring,fp8=on", TORCHTITAN_COMPILED, 942.4, 1.141, Bracketed { low: 1.032 }),
        r("TT H100 Llama3 8B, TP 8 bf16", TT_ASYNC_TP, (L3, "llama3_8b"), "8 x grand_teton_h100", (8192, 96),
          "tp=8,pp=1,cp=1,dp=8,mb=12,recompute=op,sp=on,tp_overlap=none", TORCHTITAN_COMPILED, 4378.0, 1.189, Bracketed { low: 1.087 }),
        r("TT H100 Llama3 8B, async TP 8 bf16", TT_ASYNC_TP, (L3, "llama3_8b"), "8 x grand_teton_h100", (8192, 96),
          "tp=8,pp=1,cp=1,dp=8,mb=12,recompute=op,sp=on,tp_overlap=ring", TORCHTITAN_COMPILED, 4809.4, 1.430, NotAsserted(ASYNC_TP)),
        r("TT H100 Llama3 8B, TP 8 float8 tensorwise", TT_ASYNC_TP, (L3, "llama3_8b"), "8 x grand_teton_h100", (8192, 96),
          "tp=8,pp=1,cp=1,dp=8,mb=12,recompute=op,sp=on,tp_overlap=none,fp8=on", TORCHTITAN_COMPILED, 5078.1, 1.174, Bracketed { low: 1.093 }),
        r("TT H100 Llama3 8B, async TP 8 float8 tensorwise", TT_ASYNC_TP, (L3, "llama3_8b"), "8 x grand_teton_h100", (8192, 96),
          "tp=8,pp=1,cp=1,dp=8,mb=12,recompute=op,sp=on,tp_overlap=ring,fp8=on", TORCHTITAN_COMPILED, 5570.1, 1.425, NotAsserted(ASYNC_TP)),
        // Aug 2024: 405B on 128 H100 (94/95 GB; the same unknown peak), FSDP 16 x TP 8, compile n/s per row (cfg on).
        r("TT H100 Llama3.1 405B, FSDP 16 TP 8", TT_405B, (L3, "llama3_405b"), "16 x grand_teton_h100", (8192, 32),
          "tp=8,pp=1,cp=1,dp=16,mb=2,recompute=full,sp=on,tp_overlap=none", TORCHTITAN_COMPILED_2024, 109.0, 1.182, Bracketed { low: 1.054 }),
        r("TT H100 Llama3.1 405B, FSDP 16 TP 8, float8", TT_405B, (L3, "llama3_405b"), "16 x grand_teton_h100", (8192, 32),
          "tp=8,pp=1,cp=1,dp=16,mb=2,recompute=full,sp=on,tp_overlap=none,fp8=on,fp8_gather=on", TORCHTITAN_COMPILED_2024, 177.0, 1.013, Bracketed { low: 0.920 }),
        r("TT H100 Llama3.1 405B, FSDP 16 TP 8, float8 + async TP", TT_405B, (L3, "llama3_405b"), "16 x grand_teton_h100", (8192, 32),
          "tp=8,pp=1,cp=1,dp=16,mb=2,recompute=full,sp=on,tp_overlap=ring,fp8=on,fp8_gather=on", TORCHTITAN_COMPILED_2024, 185.0, 1.128, Bracketed { low: 1.053 }),
        // ---- torchtitan on H200 (catalog H200; power and memory size n/s), compile + float8 (FSDP float8 all-gather), op SAC.
        r("TT H200 Llama3 8B, FSDP 32", TT_H200, (L3, "llama3_8b"), "4x8xH200", (8192, 64),
          "tp=1,pp=1,cp=1,dp=32,mb=2,recompute=op,fp8=on,fp8_gather=on", TORCHTITAN_COMPILED, 10938.0, 1.108, NotAsserted(H200_FAST)),
        r("TT H200 Llama3 8B, FSDP 64", TT_H200, (L3, "llama3_8b"), "8x8xH200", (8192, 128),
          "tp=1,pp=1,cp=1,dp=64,mb=2,recompute=op,fp8=on,fp8_gather=on", TORCHTITAN_COMPILED, 10753.0, 1.125, NotAsserted(H200_FAST)),
        // ---- NVIDIA NeMo 24.07 on DGX-H100, FP8; distributed optimizer (zero=1) and recompute n/s: the search picks recompute.
        r("NeMo Llama2 7B, 8 GPUs", NEMO_2407, (L2, "llama2_7b"), "8xH100", (4096, 128),
          "tp=1,pp=1,cp=1,dp=8,mb=1,zero=1,fp8=on", NEMO_2407_STACK, 16847.0, 1.085, Asserted),
        r("NeMo Llama2 13B, 16 GPUs, PP 4 VP 10", NEMO_2407, (L2, "llama2_13b"), "2x8xH100", (4096, 128),
          "tp=1,pp=4,cp=1,dp=4,mb=1,schedule=interleaved,v=10,zero=1,fp8=on", NEMO_2407_STACK, 8646.0, 1.079, Asserted),
        r("NeMo Llama2 70B, 64 GPUs, TP 4 PP 4 VP 20", NEMO_2407, (L2, "llama2_70b"), "8x8xH100", (4096, 128),
          "tp=4,pp=4,cp=1,dp=4,mb=1,schedule=interleaved,v=20,zero=1,sp=on,fp8=on", NEMO_2407_STACK, 1707.0, 0.946, Asserted),
        r("NeMo Llama3 8B, 8 GPUs, CP 2", NEMO_2407, (L3, "llama3_8b"), "8xH100", (8192, 128),
          "tp=1,pp=1,cp=2,dp=4,mb=1,zero=1,fp8=on", NEMO_2407_STACK, 12036.0, 1.013, Asserted),
        r("NeMo Llama3 70B, 64 GPUs, TP 4 PP 4 CP 2 VP 5", NEMO_2407, (L3, "llama3_70b"), "8x8xH100", (8192, 128),
          "tp=4,pp=4,cp=2,dp=2,mb=1,schedule=interleaved,v=5,zero=1,sp=on,fp8=on", NEMO_2407_STACK, 1533.0, 1.020, Asserted),
        r("NeMo GPT3 175B, 128 GPUs, TP 4 PP 8 VP 6", NEMO_2407, (GPT, "nemo_gpt3_175b"), "16x8xH100", (2048, 256),
          "tp=4,pp=8,cp=1,dp=4,mb=1,schedule=interleaved,v=6,zero=1,sp=on,fp8=on", NEMO_2407_STACK, 726.0, 1.033, Asserted),
        r("NeMo GPT3 175B, 512 GPUs, TP 4 PP 8 VP 6", NEMO_2407, (GPT, "nemo_gpt3_175b"), "64x8xH100", (2048, 2048),
          "tp=4,pp=8,cp=1,dp=16,mb=2,schedule=interleaved,v=6,zero=1,sp=on,fp8=on", NEMO_2407_STACK, 782.0, 0.993, Asserted),
        r("NeMo GPT3 5B, 64 GPUs", NEMO_2407, (GPT, "nemo_gpt3_5b"), "8x8xH100", (2048, 2048),
          "tp=1,pp=1,cp=1,dp=64,mb=4,fp8=on", NEMO_2407_STACK, 22521.0, 1.024, Asserted),
        r("NeMo GPT3 20B, 64 GPUs, TP 2", NEMO_2407, (GPT, "nemo_gpt3_20b"), "8x8xH100", (2048, 256),
          "tp=2,pp=1,cp=1,dp=32,mb=2,sp=on,fp8=on", NEMO_2407_STACK, 5851.0, 0.822, NotAsserted(GPT3_20B)),
        // Nemotron (models/nemotron.dpl: NeMo's NemotronConfig, squared ReLU,
        // rotary on half of each head); the table's 22B has no config in NeMo.
        r("NeMo Nemotron3 8B, 64 GPUs, TP 2", NEMO_2407, (NEMOTRON, "nemotron3_8b"), "8x8xH100", (4096, 256),
          "tp=2,pp=1,cp=1,dp=32,mb=4,sp=on,fp8=on", NEMO_2407_STACK, 12701.0, 1.057, Asserted),
        r("NeMo Nemotron4 340B, 128 GPUs, TP 8 PP 8 VP 12", NEMO_2407, (NEMOTRON, "nemotron4_340b"), "16x8xH100", (4096, 32),
          "tp=8,pp=8,cp=1,dp=2,mb=1,schedule=interleaved,v=12,sp=on,fp8=on", NEMO_2407_STACK, 322.0, 0.736, NotAsserted(NEMOTRON_340B)),
        // ---- NVIDIA Megatron-Bridge on DGX-H100, FP8 current scaling: the
        // recipe's `bf16_with_fp8_current_scaling_mixed` (Megatron-Bridge
        // src/megatron/bridge/training/mixed_precision.py) gathers the FP8
        // params (`fp8_param_gather`) and keeps the first and last layer in
        // bf16 (`first_last_layers_bf16`, one at each end), pinned as
        // `fp8_gather=on,fp8_bf16_ends=1`.
        // The recipes (src/megatron/bridge/recipes/llama/llama3.py, same
        // commit: llama3_70b_pretrain_config, llama31_405b_pretrain_config)
        // overlap tensor-parallel communication with Transformer Engine's
        // userbuffers (`tp_comm_overlap=True`): `tp_overlap=ring`. Every
        // performance config keeps the main gradients in bf16
        // (scripts/performance/configs/llama/llama3_llm_pretrain.py and
        // llama31_llm_pretrain.py, same commit: `cfg.ddp.grad_reduce_in_fp32 =
        // False`; qwen3_llm_pretrain.py, the 25.09 YAMLs and the 26.04.01
        // Qwen3 recipe alike): `grad_reduce=bf16`.
        r("Megatron-Bridge 25.11 Llama3 8B, 8 GPUs, FSDP", MBRIDGE, (L3, "llama3_8b"), "8xH100", (8192, 128),
          "tp=1,pp=1,cp=1,dp=8,mb=1,zero=3,fp8=on,fp8_gather=on,fp8_bf16_ends=1,grad_reduce=bf16", "offload=none", 14451.0, 1.013, Asserted),
        r("Megatron-Bridge 25.11 Llama3 70B, 64 GPUs, TP 4 PP 8 VP 5", MBRIDGE, (L3, "llama3_70b"), "8x8xH100", (8192, 128),
          "tp=4,pp=8,cp=1,dp=2,mb=1,schedule=interleaved,v=5,zero=1,sp=on,tp_overlap=ring,fp8=on,fp8_gather=on,fp8_bf16_ends=1,grad_reduce=bf16", "offload=none", 1602.0, 0.960, Asserted),
        r("Megatron-Bridge 26.02 Llama3 70B, 64 GPUs, TP 4 PP 8 VP 5", MBRIDGE, (L3, "llama3_70b"), "8x8xH100", (8192, 256),
          "tp=4,pp=8,cp=1,dp=2,mb=1,schedule=interleaved,v=5,zero=1,sp=on,tp_overlap=ring,fp8=on,fp8_gather=on,fp8_bf16_ends=1,grad_reduce=bf16", "offload=none", 1621.0, 0.960, Asserted),
        // 126 layers in 8 stages of 8 chunks, the embedding and the loss
        // counted as layers (the recipe's account_for_*_in_pipeline_split).
        r("Megatron-Bridge 25.11 Llama3.1 405B, 1024 GPUs, TP 8 PP 8 CP 2 VP 8", MBRIDGE, (L3, "llama3_405b"), "128x8xH100", (8192, 512),
          "tp=8,pp=8,cp=2,dp=8,mb=1,schedule=interleaved,v=8,zero=1,sp=on,tp_overlap=ring,recompute=none,fp8=on,fp8_gather=on,fp8_bf16_ends=1,grad_reduce=bf16", "offload=none", 292.0, 1.128, NotAsserted(MBRIDGE_405B_2511)),
        r("Megatron-Bridge 26.02 Llama3.1 405B, 1024 GPUs, TP 8 PP 8 CP 2 VP 8", MBRIDGE, (L3, "llama3_405b"), "128x8xH100", (8192, 1536),
          "tp=8,pp=8,cp=2,dp=8,mb=1,schedule=interleaved,v=8,zero=1,sp=on,tp_overlap=ring,recompute=none,fp8=on,fp8_gather=on,fp8_bf16_ends=1,grad_reduce=bf16", "offload=none", 311.0, 1.076, Asserted),
        // Fine-grained MoE (models/qwen3.dpl): EP 8 within the data-parallel ranks, one layer a chunk.
        r("Megatron-Bridge 25.11 Qwen3 30B-A3B, 16 GPUs, PP 2 VP 24 EP 8", MBRIDGE, (QWEN3, "qwen3_30b_a3b"), "2x8xH100", (4096, 512),
          "tp=1,pp=2,cp=1,dp=8,ep=8,mb=2,schedule=interleaved,v=24,zero=1,recompute=none,fp8=on,fp8_gather=on,fp8_bf16_ends=1,grad_reduce=bf16", "offload=none", 5275.0, 2.522, NotAsserted(QWEN3_MOE)),
        // The same configuration in 25.09 with token dropping (capacity 1.0, padded): dplc's MoE.
        r("Megatron-Bridge 25.09 Qwen3 30B-A3B (tokendrop), 16 GPUs, PP 2 VP 24 EP 8", MBRIDGE_2509, (QWEN3, "qwen3_30b_a3b"), "2x8xH100", (4096, 512),
          "tp=1,pp=2,cp=1,dp=8,ep=8,mb=2,schedule=interleaved,v=24,zero=1,recompute=none,fp8=on,fp8_gather=on,dispatch=alltoall,grad_reduce=bf16", "offload=none", 10494.0, 1.271, NotAsserted(QWEN3_TOKENDROP)),
        // The same model on the archive's later container: 16 ranks of EP over two nodes, HybridEP.
        r("Megatron-Bridge 26.04.01 Qwen3 30B-A3B, 16 GPUs, EP 16, HybridEP", MBRIDGE_2604, (QWEN3, "qwen3_30b_a3b"), "2x8xH100", (4096, 1024),
          "tp=1,pp=1,cp=1,dp=16,ep=16,mb=1,zero=1,recompute=none,dispatch=hierarchical,fp8=on,fp8_gather=on,fp8_bf16_ends=1,grad_reduce=bf16", "offload=none", 8960.0, 1.579, NotAsserted(QWEN3_MOE_HOST)),
        // ---- The same source on DGX-B200 (25.11, FP8 current scaling, the recipe as on H100).
        r("Megatron-Bridge 25.11 Llama3 8B, 8 B200", MBRIDGE_B200, (L3, "llama3_8b"), "8xB200", (8192, 128),
          "tp=1,pp=1,cp=1,dp=8,mb=2,zero=1,fp8=on,fp8_gather=on,fp8_bf16_ends=1,grad_reduce=bf16", "offload=none", 30624.0, 1.120, NotAsserted(B200_8B)),
        r("Megatron-Bridge 25.11 Llama3.1 405B, 128 B200, TP 4 PP 8 CP 2 VP 8", MBRIDGE_B200, (L3, "llama3_405b"), "16x8xB200", (8192, 64),
          "tp=4,pp=8,cp=2,dp=2,mb=1,schedule=interleaved,v=8,zero=1,sp=on,tp_overlap=ring,recompute=none,fp8=on,fp8_gather=on,fp8_bf16_ends=1,grad_reduce=bf16", "offload=none", 661.0, 1.097, Asserted),
        // ---- Megatron-Core's weak scaling on H100 (model TFLOP/s per GPU), DP 48 throughout.
        tflops(r("Megatron-Core GPT 1.7B, 48 H100", MCORE, (GPT, "mcore_gpt_1_7b"), "6x8xH100", (4096, 192),
          "tp=1,pp=1,cp=1,dp=48,zero=1", "loss=unfused", 408.8, 1.064, Asserted)),
        tflops(r("Megatron-Core GPT 7.1B, 96 H100, TP 2", MCORE, (GPT, "mcore_gpt_7_1b"), "12x8xH100", (4096, 192),
          "tp=2,pp=1,cp=1,dp=48,zero=1,sp=on,tp_overlap=ring", "loss=unfused", 465.9, 1.083, Asserted)),
        tflops(r("Megatron-Core GPT 16B, 192 H100, TP 4", MCORE, (GPT, "mcore_gpt_16b"), "24x8xH100", (4096, 192),
          "tp=4,pp=1,cp=1,dp=48,zero=1,sp=on,tp_overlap=ring", "loss=unfused", 489.1, 1.050, Asserted)),
        tflops(r("Megatron-Core GPT 32B, 384 H100, TP 8", MCORE, (GPT, "mcore_gpt_32b"), "48x8xH100", (4096, 192),
          "tp=8,pp=1,cp=1,dp=48,zero=1,sp=on,tp_overlap=ring", "loss=unfused", 459.6, 1.011, Asserted)),
        tflops(r("Megatron-Core GPT 70B, 768 H100, TP 8 PP 2", MCORE, (GPT, "mcore_gpt_70b"), "96x8xH100", (4096, 384),
          "tp=8,pp=2,cp=1,dp=48,zero=1,sp=on,tp_overlap=ring", "loss=unfused", 419.7, 1.118, NotAsserted(MCORE_SCHEDULE))),
        tflops(r("Megatron-Core GPT 119B, 1536 H100, TP 8 PP 4", MCORE, (GPT, "mcore_gpt_119b"), "192x8xH100", (4096, 768),
          "tp=8,pp=4,cp=1,dp=48,zero=1,sp=on,tp_overlap=ring", "loss=unfused", 420.5, 1.147, NotAsserted(MCORE_SCHEDULE))),
        tflops(r("Megatron-Core GPT 177B, 2304 H100, TP 8 PP 6", MCORE, (GPT, "mcore_gpt_177b"), "288x8xH100", (4096, 1152),
          "tp=8,pp=6,cp=1,dp=48,zero=1,sp=on,tp_overlap=ring", "loss=unfused", 432.8, 1.154, NotAsserted(MCORE_SCHEDULE))),
        tflops(r("Megatron-Core GPT 314B, 3072 H100, TP 8 PP 8", MCORE, (GPT, "mcore_gpt_314b"), "384x8xH100", (4096, 1536),
          "tp=8,pp=8,cp=1,dp=48,zero=1,sp=on,tp_overlap=ring", "loss=unfused", 474.4, 1.105, NotAsserted(MCORE_SCHEDULE))),
        tflops(r("Megatron-Core GPT 462B, 6144 H100, TP 8 PP 16", MCORE, (GPT, "mcore_gpt_462b"), "768x8xH100", (4096, 3072),
          "tp=8,pp=16,cp=1,dp=48,zero=1,sp=on,tp_overlap=ring", "loss=unfused", 459.9, 1.112, NotAsserted(MCORE_SCHEDULE))),
        // ---- The Llama 3 paper, Meta's 405B pre-training (model TFLOP/s per GPU).
        tflops(r("Llama 3 405B, 8,192 H100, TP 8 PP 16 DP 64", LLAMA3, (L3, "llama3_405b"), "1024x8xH100", (8192, 2048),
          "tp=8,pp=16,cp=1,dp=64,mb=1,schedule=interleaved", "", 430.0, 0.986, Asserted)),
        tflops(r("Llama 3 405B, 16,384 H100, TP 8 PP 16 DP 128", LLAMA3, (L3, "llama3_405b"), "2048x8xH100", (8192, 2048),
          "tp=8,pp=16,cp=1,dp=128,mb=1,schedule=interleaved", "", 400.0, 0.942, Asserted)),
        tflops(r("Llama 3 405B, 16,384 H100, TP 8 CP 16 PP 16 DP 8, seq 131072", LLAMA3, (L3, "llama3_405b"), "2048x8xH100", (131072, 128),
          "tp=8,pp=16,cp=16,dp=8,mb=1,schedule=interleaved", "", 380.0, 1.233, NotAsserted(LLAMA3_CP))),
    ]
}

fn zoo(file: &str) -> dplc_frontend::Unit {
    let path = format!("{}/models/{file}", env!("CARGO_MANIFEST_DIR"));
    let text = std::fs::read_to_string(&path).expect("the zoo file exists");
    dplc_frontend::parse(file, &text).expect("the zoo file parses")
}

/// `8x8xA100`, or `NODES x SECTION` for `models/clusters/SECTION.dpl`.
fn cluster(spec: &str) -> Cluster {
    match spec.split_once(" x ") {
        None => parse_cluster(spec).expect("a catalog shorthand"),
        Some((nodes, section)) => {
            let unit = zoo(&format!("clusters/{section}.dpl"));
            let specs = unit.clusters().expect("the cluster section reads");
            let mut c = cluster_from_spec(&specs[0]).expect("the cluster is valid");
            c.nodes = nodes.parse().expect("a node count");
            c.name = format!("{nodes}x{}", c.name);
            c
        }
    }
}

/// Asserted rows within 10%, and every row at the ratio recorded beside it
/// (update the recorded ratio, and what quotes it, when the model moves it).
fn held_as_recorded(failures: &[String], stale: &[String]) {
    assert!(
        failures.is_empty(),
        "rows outside 10%:\n{}",
        failures.join("\n")
    );
    assert!(
        stale.is_empty(),
        "rows whose ratio moved from the one recorded (update it and what quotes it):\n{}",
        stale.join("\n")
    );
}

/// `row`'s plan with its configuration pinned, or why dplc cannot plan it.
fn plan(row: &Row) -> Result<dplc_ir::Plan, String> {
    let unit = zoo(row.file);
    let l = unit.lower(row.model).map_err(|e| e.to_string())?;
    let mut req = PlanRequest::new(&l.graph, l.train.clone(), cluster(row.cluster));
    req.global_batch = Some(row.global_batch);
    req.seq = Some(row.seq);
    let pinned = match row.stack {
        "" => row.strategy.to_string(),
        stack => format!("{},{stack}", row.strategy),
    };
    // Every published row ran another engine's tensor parallelism, which
    // splits the model's ends along the sequence under sequence
    // parallelism: Megatron's unless the stack names DTensor's.
    let pinned = if pinned.contains("tp_impl=") {
        pinned
    } else {
        format!("{pinned},tp_impl=megatron")
    };
    req.pinned = parse_strategy(&pinned).map_err(|e| e.to_string())?;
    Ok(compile(&req).map_err(|e| e.to_string())?.plan)
}

/// Predicted tokens/s (or model TFLOP/s) per GPU for `row`, or why dplc cannot plan it.
fn predict(row: &Row) -> Result<f64, String> {
    let p = plan(row)?;
    let world = (p.cluster.nodes * p.cluster.devices_per_node) as f64;
    Ok(match row.metric {
        Metric::Tokens => p.estimate.tokens_per_s / world,
        Metric::ModelTflops => {
            let e = &p.estimate;
            (e.model_flops_per_step + e.masked_attention_flops_per_step)
                / e.step_time_s
                / world
                / 1e12
        }
    })
}

#[test]
fn modern_rows_within_ten_percent_where_asserted() {
    let (mut failures, mut stale) = (Vec::new(), Vec::new());
    eprintln!("| row | predicted tok/s/GPU | published | ratio | recorded | verdict |");
    for row in rows() {
        let got = predict(&row);
        let line = match &got {
            Ok(p) => format!(
                "| {} | {:.1} | {:.1} | {:.3} | {:.3} | {:?} |",
                row.name,
                p,
                row.published,
                p / row.published,
                row.measured,
                row.verdict
            ),
            Err(e) => format!(
                "| {} | cannot plan: {e} | {} | | | {:?} |",
                row.name, row.published, row.verdict
            ),
        };
        eprintln!("{line}");
        assert!(
            !row.source.is_empty(),
            "{}: every row cites its source",
            row.name
        );
        if let Ok(p) = got {
            if (p / row.published - row.measured).abs() > 0.0015 {
                stale.push(line.clone());
            }
        }
        let low = at_lower_bound(&row).map(|low| {
            let got = predict(&low).map(|p| p / row.published);
            match &got {
                Ok(r) => eprintln!(
                    "|   at the lower bound of its peak ({LOWER_BOUND}) | | | {r:.3} | | |"
                ),
                Err(e) => {
                    eprintln!("|   at the lower bound of its peak: cannot plan: {e} | | | | | |")
                }
            }
            got
        });
        match row.verdict {
            Verdict::Asserted => match got {
                Ok(p) if (p / row.published - 1.0).abs() <= 0.10 => {}
                _ => failures.push(line),
            },
            Verdict::Bracketed { low: recorded } => match (got, low) {
                (Ok(p), Some(Ok(low))) => {
                    if (low - recorded).abs() > 0.0015 {
                        stale.push(format!(
                            "{line} (at the lower bound {low:.3}, recorded {recorded:.3})"
                        ));
                    }
                    if low > 1.10 || p / row.published < 0.90 {
                        failures.push(format!("{line} (at the lower bound {low:.3})"));
                    }
                }
                _ => failures.push(format!("{line} (no lower bound: {UPPER_BOUND} rows only)")),
            },
            Verdict::NotAsserted(_) => {}
        }
    }
    held_as_recorded(&failures, &stale);
}

/// Within one source and machine the Grand Teton offset cancels: the 405B
/// FSDP × TP × PP rows (torchtitan, Dec 2024, Table 5) gain 1.28× from
/// interleaving (128 against 100 tokens/s/GPU), with 126 layers in chunks
/// of 8 and 7; dplc's bubble and send terms predict that gain within 5%.
#[test]
fn interleaving_gains_what_torchtitan_measured() {
    let all = rows();
    let find = |name: &str| {
        all.iter()
            .find(|r| r.name == name)
            .unwrap_or_else(|| panic!("row {name}"))
    };
    let one = find("TT H100 Llama3.1 405B, FSDP 8 TP 8 PP 8, 1F1B");
    let inter = find("TT H100 Llama3.1 405B, FSDP 8 TP 8 PP 8, interleaved 1F1B");
    let predicted = predict(inter).unwrap() / predict(one).unwrap();
    let published = inter.published / one.published;
    assert!(
        (predicted / published - 1.0).abs() <= 0.05,
        "interleaving gains {predicted:.3}x in dplc, {published:.3}x published"
    );
}

/// Eager PyTorch pads nothing: GPT-2's logits GEMMs (50,257 columns, no
/// whole number of 16-byte pieces) run at the device's unaligned rate, and
/// padding the vocabulary to 50,304 (nanoGPT's fix) wins that time back; a
/// compiled stack (Inductor pads such GEMMs) pays nothing for it.
#[test]
fn an_eager_stack_pays_for_unaligned_gemms_a_compiled_one_does_not() {
    let step = |vocab: u64, elementwise: &str| -> f64 {
        let path = format!("{}/models/gpt2.dpl", env!("CARGO_MANIFEST_DIR"));
        let text = std::fs::read_to_string(path)
            .expect("the zoo file exists")
            .replacen("vocab = 50257", &format!("vocab = {vocab}"), 1);
        let l = dplc_frontend::parse("gpt2.dpl", &text)
            .expect("parses")
            .lower("gpt2")
            .expect("lowers");
        let mut req = PlanRequest::new(&l.graph, l.train.clone(), cluster("1xH200"));
        req.global_batch = Some(32);
        req.seq = Some(1024);
        req.pinned = parse_strategy(&format!(
            "tp=1,pp=1,cp=1,dp=1,mb=32,recompute=none,zero=0,attention=flash2,\
             elementwise={elementwise},offload=none"
        ))
        .expect("a strategy");
        compile(&req).expect("plans").plan.estimate.step_time_s
    };
    let (eager, eager_padded) = (step(50257, "eager"), step(50304, "eager"));
    let (fused, fused_padded) = (step(50257, "fused"), step(50304, "fused"));
    // The three GEMMs' 7.6 TFLOP at 12.5% of the H200's peak rather than
    // at its sustained 71.6%: about 50 ms.
    let saved = eager - eager_padded;
    assert!(
        (0.040..0.060).contains(&saved),
        "padding saves eager {:.1} ms ({:.1} → {:.1})",
        saved * 1e3,
        eager * 1e3,
        eager_padded * 1e3
    );
    assert!(
        (fused - fused_padded).abs() / fused < 0.01,
        "fused: {:.1} ms unpadded, {:.1} padded",
        fused * 1e3,
        fused_padded * 1e3
    );
}

/// Megatron builds interleaved chunks either equal or with the first and
/// the last stage a layer short, counting the embedding and the loss as
/// layers; the Llama 3 paper splits Llama 3.1 405B's 126 layers over 16
/// stages so. The search takes such chunks unasked: before, it tried only
/// equal ones, none exists for 126 layers on 16 stages, and it ran 1F1B
/// with a 47% bubble (385.7 model TFLOP/s per GPU against the paper's 430).
#[test]
fn the_search_interleaves_the_chunks_megatron_builds() {
    let unit = zoo("llama3.dpl");
    let l = unit.lower("llama3_405b").unwrap();
    let mut req = PlanRequest::new(&l.graph, l.train.clone(), cluster("1024x8xH100"));
    req.global_batch = Some(2048);
    req.seq = Some(8192);
    req.pinned = parse_strategy("tp=8,pp=16,cp=1,dp=64,mb=1").unwrap();
    let plan = compile(&req).unwrap().plan;
    assert_eq!(
        plan.strategy.schedule,
        dplc_ir::PipelineSchedule::Interleaved
    );
    let mut split = vec![8; 16];
    (split[0], split[15]) = (7, 7);
    assert_eq!(plan.stage_layers(), split);
    let e = &plan.estimate;
    let over_every_pair = (e.model_flops_per_step + e.masked_attention_flops_per_step)
        / e.step_time_s
        / (1024.0 * 8.0)
        / 1e12;
    assert!(over_every_pair > 400.0, "{over_every_pair}");
}

/// PyTorch's autocast over fp32 weights (`autocast=on`): the GEMMs stay in
/// bf16, what is not a GEMM is written in fp32 (the residual stream, the
/// norms, the loss), eager casts each fp32 operand before its GEMM and
/// every weight each forward. GPT-2 small on one H200 at the row's size:
/// slower and holding more activations than bf16 throughout, but less than
/// twice (the GEMMs' outputs stay bf16); the eager step pays more for it
/// than the compiled one (its casts); in fp32 it changes nothing.
#[test]
fn autocast_runs_what_is_not_a_gemm_in_fp32() {
    let unit = zoo("gpt2.dpl");
    let l = unit.lower("gpt2").unwrap();
    let plan = |elementwise: &str, autocast: &str, precision| {
        let mut train = l.train.clone();
        train.precision = precision;
        let mut req = PlanRequest::new(&l.graph, train, cluster("1xH200"));
        req.global_batch = Some(32);
        req.seq = Some(1024);
        req.pinned = parse_strategy(&format!(
            "tp=1,pp=1,cp=1,dp=1,mb=32,recompute=none,zero=0,attention=flash2,offload=none,elementwise={elementwise},autocast={autocast}"
        ))
        .unwrap();
        compile(&req).unwrap().plan
    };
    use dplc_ir::Precision::{Bf16, Fp32};
    let mut slower = Vec::new();
    for elementwise in ["eager", "fused"] {
        let (bf16, amp) = (
            plan(elementwise, "off", Bf16),
            plan(elementwise, "on", Bf16),
        );
        assert!(amp.strategy.autocast && !bf16.strategy.autocast);
        let (t, t_amp) = (bf16.estimate.step_time_s, amp.estimate.step_time_s);
        let acts = |p: &dplc_ir::Plan| p.stages[0].memory.activations as f64;
        let grow = acts(&amp) / acts(&bf16);
        assert!(t_amp > t, "{elementwise}: {t_amp} s against {t} s");
        assert!(
            1.0 < grow && grow < 2.0,
            "{elementwise}: activations ×{grow}"
        );
        slower.push(t_amp - t);
        let (f32, f32_amp) = (
            plan(elementwise, "off", Fp32),
            plan(elementwise, "on", Fp32),
        );
        assert_eq!(f32.estimate.step_time_s, f32_amp.estimate.step_time_s);
        assert_eq!(f32.stages[0].memory, f32_amp.stages[0].memory);
    }
    assert!(
        slower[0] > slower[1],
        "eager pays for its casts: {slower:?}"
    );
}

/// torchtitan's December 2024 tables publish each run's memory beside its
/// throughput (`Memory(GiB)`: "memory readings are stable across the whole
/// training process", the maximum across GPUs of torchtitan's
/// `max_reserved_gib`, what PyTorch's caching allocator holds; bench/
/// published_rows.md §3), and so does Trainy's H200 run of June 2025
/// (`Memory(GiB)` "arbitrarily sampled at the 100th iteration", torchtitan's
/// logged memory). dplc's peak is the busiest rank's allocated peak,
/// which the reserve can only exceed. Rows within 10% are asserted; the
/// recorded ratio catches any change.
#[test]
fn torchtitan_memory_within_ten_percent_where_asserted() {
    const INTERLEAVED: &str = "14% over: the chunks a stage holds are not stated (v = 2 assumed, as the throughput row); the published memory falls 9.8 GiB from 1F1B to the interleaved schedule where dplc's rises 2.0 GiB with two chunks' micro-batches in flight";
    let published: [(&str, f64, f64, Verdict); 16] = [
        (
            "TT H100 Llama3.1 8B, FSDP 8, eager",
            82.4,
            0.933,
            Verdict::Asserted,
        ),
        (
            "TT H100 Llama3.1 8B, FSDP 8, compile",
            77.0,
            0.998,
            Verdict::Asserted,
        ),
        (
            "TT H100 Llama3.1 8B, FSDP 8, compile + float8",
            76.8,
            1.027,
            Verdict::Asserted,
        ),
        (
            "TT H100 Llama3.1 8B, FSDP 128, eager",
            67.0,
            0.912,
            Verdict::Asserted,
        ),
        (
            "TT H100 Llama3.1 8B, FSDP 128, compile",
            62.0,
            0.985,
            Verdict::Asserted,
        ),
        (
            "TT H100 Llama3.1 8B, FSDP 128, compile + float8",
            61.8,
            0.997,
            Verdict::Asserted,
        ),
        (
            "TT H100 Llama3.1 8B, FSDP 8 CP 1, seq 32768",
            83.9,
            0.969,
            Verdict::Asserted,
        ),
        (
            "TT H100 Llama3.1 8B, FSDP 4 CP 2, seq 65536",
            84.2,
            0.966,
            Verdict::Asserted,
        ),
        (
            "TT H100 Llama3.1 8B, FSDP 2 CP 4, seq 131072",
            84.0,
            0.968,
            Verdict::Asserted,
        ),
        (
            "TT H100 Llama3.1 8B, FSDP 1 CP 8, seq 262144",
            84.5,
            0.962,
            Verdict::Asserted,
        ),
        (
            "TT H100 Llama3.1 70B, FSDP 32 TP 8",
            71.9,
            0.949,
            Verdict::Asserted,
        ),
        (
            "TT H100 Llama3.1 70B, FSDP 32 TP 8, async TP",
            67.6,
            1.010,
            Verdict::Asserted,
        ),
        (
            "TT H100 Llama3.1 405B, FSDP 8 TP 8 PP 8, 1F1B",
            82.5,
            0.979,
            Verdict::Asserted,
        ),
        (
            "TT H100 Llama3.1 405B, FSDP 8 TP 8 PP 8, interleaved 1F1B",
            72.7,
            1.139,
            Verdict::NotAsserted(INTERLEAVED),
        ),
        (
            "TT H200 Llama3 8B, FSDP 32",
            47.96,
            1.005,
            Verdict::Asserted,
        ),
        (
            "TT H200 Llama3 8B, FSDP 64",
            46.97,
            0.981,
            Verdict::Asserted,
        ),
    ];
    let rows = rows();
    let (mut failures, mut stale) = (Vec::new(), Vec::new());
    eprintln!("| row | predicted peak GiB | published GiB | ratio | recorded | verdict |");
    for (name, gib, recorded, verdict) in published {
        let row = rows
            .iter()
            .find(|r| r.name == name)
            .unwrap_or_else(|| panic!("no throughput row `{name}`"));
        assert!(
            [TT_H100_202412, TT_H200].contains(&row.source),
            "{name}: a table that publishes memory"
        );
        let p = plan(row).unwrap_or_else(|e| panic!("{name}: {e}"));
        let got = p.estimate.peak_memory_bytes as f64 / (1u64 << 30) as f64;
        let ratio = got / gib;
        let line =
            format!("| {name} | {got:.1} | {gib:.1} | {ratio:.3} | {recorded:.3} | {verdict:?} |");
        eprintln!("{line}");
        if (ratio - recorded).abs() > 0.0015 {
            stale.push(line.clone());
        }
        if verdict == Verdict::Asserted && (ratio - 1.0).abs() > 0.10 {
            failures.push(line);
        }
    }
    held_as_recorded(&failures, &stale);
}
