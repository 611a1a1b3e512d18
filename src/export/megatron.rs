//! The plan as Megatron-LM's `pretrain_gpt.py` arguments (Megatron-Core
//! release core_v0.12.0; `tests/data/megatron-core_v0.12.0-arguments.tsv`
//! holds its argument names, and a test checks every flag written here
//! against them): a runnable `torchrun` line, one flag per line.

use super::arch::{Ffn, Norm, Positions, Transformer};
use super::{Gap, Job};
use dplc_ir::{
    AttentionKind, GradAccum, LrSchedule, Optimizer, PipelineSchedule, Plan, Precision, Recompute,
    RootSplit, TpOverlap,
};
use dplc_planner::AxisOrder;

/// Why Megatron's GPT cannot build the model.
pub fn model_fits(t: &Transformer) -> Result<(), String> {
    if let Ffn::Mlp { act } = t.ffn {
        if !matches!(act, "gelu" | "gelu_tanh") {
            return Err(format!(
                "its MLP activation is `{act}`; Megatron's plain MLP is GeLU (or SwiGLU with --swiglu)"
            ));
        }
    }
    if let Positions::Rotary { theta } = t.positions {
        if theta.fract() != 0.0 || !(1.0..=u64::MAX as f64).contains(&theta) {
            return Err(format!(
                "its rotary base {theta} is not a whole number; Megatron's --rotary-base is an integer"
            ));
        }
    }
    let b = t.bias;
    let mlp_bias = matches!(t.ffn, Ffn::Mlp { .. }) && b.mlp;
    // `--disable-bias-linear` drops every linear's bias (a gated FFN has
    // none in dplc, so it needs it too); `--add-qkv-bias` brings back QKV's.
    let all_or_none = b.qkv == b.out && b.out == mlp_bias;
    let qkv_only = b.qkv && !b.out && !mlp_bias;
    if !(all_or_none || qkv_only) {
        return Err(format!(
            "its linears carry biases as qkv {} / output {} / MLP {}; Megatron has all, none, or \
             only the QKV bias (--add-qkv-bias)",
            b.qkv, b.out, b.mlp
        ));
    }
    Ok(())
}

/// The plan's choices Megatron-LM cannot express.
pub fn gaps(plan: &Plan, _t: &Transformer) -> Vec<Gap> {
    let s = &plan.strategy;
    let m = &plan.mesh;
    let mut gaps = Vec::new();
    gaps.extend(super::autocast_gap(plan, "Megatron"));
    gaps.extend(super::flash1_gap(plan, "Megatron"));
    if m.pp > 1 && s.schedule == PipelineSchedule::GPipe {
        gaps.push(Gap::new(
            "the GPipe schedule (Megatron runs 1F1B or interleaved 1F1B)",
            |p| p.schedule = Some(PipelineSchedule::OneFOneB),
        ));
    }
    if s.schedule == PipelineSchedule::Interleaved && interleave_flags(plan).is_none() {
        let v = s.virtual_stages.max(1);
        let even = dplc_ir::even_split(plan.layers, m.pp);
        let even_fits = accounted_split(plan.layers, m.pp, v)
            .any(|(_, chunks)| chunks == dplc_ir::virtual_stage_layers(&even, v));
        gaps.push(Gap::new(
            format!(
                "interleaving the stage split {:?} in {} chunks (Megatron's chunks are equal, but for one \
                 short beside the embedding or the loss)",
                plan.stage_layers(),
                v
            ),
            move |p| {
                if even_fits {
                    p.even_stages = Some(true);
                } else {
                    p.schedule = Some(PipelineSchedule::OneFOneB);
                    p.virtual_stages = Some(1);
                }
            },
        ));
    }
    if s.schedule != PipelineSchedule::Interleaved && stage_flags(plan).is_none() {
        gaps.push(Gap::new(
            format!(
                "the stage split {:?} (Megatron splits evenly, except a different first and last stage)",
                plan.stage_layers()
            ),
            |p| p.even_stages = Some(true),
        ));
    }
    if s.zero_stage >= 2 && s.grad_accum == GradAccum::Fused {
        gaps.push(Gap::new(
            format!(
                "ZeRO-{} with gradient accumulation fused into the GEMM (Megatron's FSDP \
                 needs --no-gradient-accumulation-fusion)",
                s.zero_stage
            ),
            |p| p.grad_accum = Some(GradAccum::Separate),
        ));
    }
    if s.shards == dplc_ir::ShardLayout::PerParam {
        gaps.push(Gap::new(
            "ZeRO-3 per parameter (FSDP2's copies; Megatron's FSDP gathers into flat buffers)",
            |p| p.shards = None,
        ));
    }
    if s.tp_impl == dplc_ir::TpImpl::DTensor && m.tp > 1 {
        gaps.push(Gap::new(
            "DTensor's tensor parallelism (torchtitan's batch-first layout; Megatron's layers run sequence-first)",
            |p| p.tp_impl = Some(dplc_ir::TpImpl::Megatron),
        ));
    }
    // dplc's runtime runs the model's ends whole along the sequence where
    // Megatron splits them (`TpImpl::Dplc`): not a gap, since Megatron runs
    // the same plan in no more memory and time than it was priced at.
    if s.recompute == Recompute::Op {
        gaps.push(Gap::new(
            "op-level selective checkpointing (torchtitan's; Megatron recomputes the attention core or whole layers)",
            |p| p.recompute = Some(Recompute::Selective),
        ));
    }
    if s.offload.params || s.offload.activations {
        // Pinned, or the search, free again, offloads them again.
        let planned = s.offload;
        gaps.push(Gap::new(
            format!(
                "offload={} (Megatron offloads the optimizer only, with --optimizer-cpu-offload)",
                s.offload.name()
            ),
            move |p| {
                p.offload = Some(dplc_ir::Offload {
                    params: false,
                    activations: false,
                    ..p.offload.unwrap_or(planned)
                });
                p.zero = None;
            },
        ));
    }
    if s.offload.optimizer && s.zero_stage == 0 && m.dp > 1 {
        gaps.push(Gap::new(
            "optimizer offload without the distributed optimizer (Megatron's needs it)",
            |p| p.zero = Some(1),
        ));
    }
    // TransformerConfig.__post_init__: "moe_expert_capacity_factor only works
    // with alltoall token dispatcher", and dplc's experts always have one.
    if m.ep > 1 && s.dispatch == dplc_ir::Dispatch::Hierarchical {
        gaps.push(Gap::new(
            "DeepEP's hierarchical token dispatch (Megatron's flex dispatcher cannot drop tokens \
             at a capacity factor, which dplc's experts do)",
            |p| p.dispatch = Some(dplc_ir::Dispatch::AllToAll),
        ));
    }
    if m.tp > 1 {
        if s.root == RootSplit::Replicated {
            gaps.push(Gap::new(
                "a replicated embedding and loss (Megatron splits them over the vocabulary)",
                |p| p.root = None,
            ));
        }
        if s.tp_overlap == TpOverlap::None {
            gaps.push(Gap::new(
                "exposed tensor-parallel all-reduces (Megatron always overlaps the input-gradient all-reduce)",
                |p| p.tp_overlap = Some(TpOverlap::Async),
            ));
        }
        // ModelParallelConfig.__post_init__ raises without it.
        if m.ep > 1 && !s.sequence_parallel {
            gaps.push(Gap::new(
                "expert and tensor parallelism without sequence parallelism (Megatron requires it)",
                |p| p.sequence_parallel = Some(true),
            ));
        }
        if s.tp_overlap == TpOverlap::Ring && !s.sequence_parallel {
            gaps.push(Gap::new(
                "ring tensor-parallel overlap without sequence parallelism (--tp-comm-overlap needs --sequence-parallel)",
                |p| p.sequence_parallel = Some(true),
            ));
        }
    }
    gaps
}

/// `--decoder-first/last-pipeline-num-layers` for the plan's stages: `Some`
/// of the flags (empty for an even split) when Megatron can express them.
fn stage_flags(plan: &Plan) -> Option<Vec<(&'static str, u64)>> {
    let counts = plan.stage_layers();
    let [first, middle @ .., last] = counts.as_slice() else {
        return Some(Vec::new());
    };
    if counts.iter().all(|&c| c == *first) {
        return Some(Vec::new());
    }
    match middle {
        // Two stages: the last takes what the first leaves (Megatron-Core
        // 0.12.0 divides the middle layers by the middle stages, none here,
        // when both are given).
        [] => Some(vec![("--decoder-first-pipeline-num-layers", *first)]),
        [m, rest @ ..] if rest.iter().all(|c| c == m) => {
            let mut flags = Vec::new();
            if first != m {
                flags.push(("--decoder-first-pipeline-num-layers", *first));
            }
            if last != m {
                flags.push(("--decoder-last-pipeline-num-layers", *last));
            }
            Some(flags)
        }
        _ => None,
    }
}

/// Megatron's chunks, in pipeline order, for `layers` over `pp × v` with
/// each pair of `--account-for-embedding-in-pipeline-split` and
/// `--account-for-loss-in-pipeline-split`.
fn accounted_split(layers: u64, pp: u64, v: u64) -> impl Iterator<Item = ((bool, bool), Vec<u64>)> {
    [(false, false), (true, false), (false, true), (true, true)]
        .into_iter()
        .filter_map(move |(embedding, loss)| {
            let stages = dplc_ir::accounted_stage_layers(layers, pp, v, embedding, loss)?;
            Some(((embedding, loss), dplc_ir::virtual_stage_layers(&stages, v)))
        })
}

/// The interleaved schedule's flags for the plan's chunks, when Megatron
/// builds the same ones.
fn interleave_flags(plan: &Plan) -> Option<Vec<Flag>> {
    let v = plan.strategy.virtual_stages.max(1);
    let chunks = dplc_ir::virtual_stage_layers(&plan.stage_layers(), v);
    let ((embedding, loss), _) =
        accounted_split(plan.layers, plan.mesh.pp, v).find(|(_, split)| *split == chunks)?;
    let mut f = vec![arg("--num-virtual-stages-per-pipeline-rank", v)];
    if embedding {
        f.push(flag("--account-for-embedding-in-pipeline-split"));
    }
    if loss {
        f.push(flag("--account-for-loss-in-pipeline-split"));
    }
    Some(f)
}

/// One command-line flag, with its value if it takes one.
pub struct Flag(pub &'static str, pub Option<String>);

fn flag(name: &'static str) -> Flag {
    Flag(name, None)
}

fn arg(name: &'static str, value: impl ToString) -> Flag {
    Flag(name, Some(value.to_string()))
}

/// Megatron's model arguments for the transformer.
pub fn model_flags(job: &Job) -> Vec<Flag> {
    let t = job.model;
    let mut f = vec![
        arg("--num-layers", t.layers),
        arg("--hidden-size", t.d),
        arg("--ffn-hidden-size", t.ffn_hidden),
        arg("--num-attention-heads", t.heads),
    ];
    if t.kv_heads != t.heads {
        f.push(flag("--group-query-attention"));
        f.push(arg("--num-query-groups", t.kv_heads));
    }
    f.push(arg("--seq-length", job.plan.strategy.seq));
    match t.positions {
        Positions::Learned { ctx } => {
            f.push(arg("--max-position-embeddings", ctx));
            f.push(arg("--position-embedding-type", "learned_absolute"));
        }
        Positions::Rotary { theta } => {
            f.push(arg("--max-position-embeddings", job.plan.strategy.seq));
            f.push(arg("--position-embedding-type", "rope"));
            // Megatron reads the base as an integer (model_fits checked it is one).
            f.push(arg("--rotary-base", theta as u64));
        }
        Positions::None => {
            f.push(arg("--max-position-embeddings", job.plan.strategy.seq));
            f.push(arg("--position-embedding-type", "none"));
        }
    }
    f.push(arg(
        "--normalization",
        match t.norm {
            Norm::LayerNorm => "LayerNorm",
            Norm::RmsNorm => "RMSNorm",
        },
    ));
    f.push(arg("--norm-epsilon", number(t.norm_eps)));
    match t.ffn {
        // Megatron's GeLU is erf's unless its bias-GeLU fusion (tanh's) runs.
        Ffn::Mlp { act: "gelu_tanh" } => f.push(flag("--openai-gelu")),
        Ffn::Mlp { .. } => f.push(flag("--no-bias-gelu-fusion")),
        Ffn::SwiGlu => f.push(flag("--swiglu")),
        Ffn::Moe {
            experts,
            top_k,
            capacity_factor,
        } => {
            f.push(flag("--swiglu"));
            f.push(arg("--num-experts", experts));
            f.push(arg("--moe-router-topk", top_k));
            f.push(arg("--moe-expert-capacity-factor", number(capacity_factor)));
            // dplc's router has no auxiliary loss.
            f.push(arg("--moe-router-load-balancing-type", "none"));
        }
    }
    let mlp_bias = matches!(t.ffn, Ffn::Mlp { .. }) && t.bias.mlp;
    if !t.bias.out && !mlp_bias {
        f.push(flag("--disable-bias-linear"));
        if t.bias.qkv {
            f.push(flag("--add-qkv-bias"));
        }
    }
    if !t.tied {
        f.push(flag("--untie-embeddings-and-output-weights"));
    }
    f.push(arg("--attention-dropout", number(t.attention_dropout)));
    f.push(arg("--hidden-dropout", number(t.hidden_dropout)));
    // NullTokenizer adds an end-of-document id: V − 1 ids + 1 = V.
    f.push(arg("--tokenizer-type", "NullTokenizer"));
    f.push(arg("--vocab-size", t.vocab - 1));
    f.push(arg("--make-vocab-size-divisible-by", 1));
    f
}

/// The parallel layout, batch and memory choices of the plan.
pub fn parallel_flags(plan: &Plan) -> Vec<Flag> {
    let s = &plan.strategy;
    let m = &plan.mesh;
    let mut f = vec![
        arg("--tensor-model-parallel-size", m.tp),
        arg("--pipeline-model-parallel-size", m.pp),
        arg("--context-parallel-size", m.cp),
        arg("--expert-model-parallel-size", m.ep),
    ];
    // dplc keeps each expert whole on its expert-parallel rank (the plan
    // prices it so); Megatron would split the experts over tp by default.
    if m.ep > 1 && m.tp > 1 {
        f.push(arg("--expert-tensor-parallel-size", 1));
    }
    // The dispatcher the plan priced (Megatron's default gathers every token
    // to every expert rank instead); a hierarchical one is a gap.
    if m.ep > 1 {
        f.push(arg("--moe-token-dispatcher-type", "alltoall"));
    }
    if s.sequence_parallel && m.tp > 1 {
        f.push(flag("--sequence-parallel"));
    }
    if AxisOrder::of(m) == AxisOrder::PipelineInner {
        f.push(flag("--use-tp-pp-dp-mapping"));
    }
    if s.schedule == PipelineSchedule::Interleaved && s.virtual_stages > 1 {
        f.extend(interleave_flags(plan).unwrap_or_default());
    } else if let Some(flags) = stage_flags(plan) {
        f.extend(flags.into_iter().map(|(k, v)| arg(k, v)));
    }
    f.push(arg("--micro-batch-size", s.micro_batch));
    f.push(arg("--global-batch-size", s.global_batch));
    match s.zero_stage {
        0 => {}
        1 => f.push(flag("--use-distributed-optimizer")),
        z => {
            f.push(flag("--use-distributed-optimizer"));
            f.push(flag("--use-custom-fsdp"));
            f.push(arg(
                "--data-parallel-sharding-strategy",
                if z == 2 {
                    "optim_grads"
                } else {
                    "optim_grads_params"
                },
            ));
        }
    }
    if s.overlap_grad_reduce && m.dp > 1 {
        f.push(flag("--overlap-grad-reduce"));
        if s.zero_stage >= 1 {
            f.push(flag("--overlap-param-gather"));
        }
    }
    if s.offload.optimizer {
        if s.zero_stage == 0 {
            // Megatron's CPU offload lives in its distributed optimizer.
            f.push(flag("--use-distributed-optimizer"));
        }
        f.push(flag("--optimizer-cpu-offload"));
        // Its hybrid CPU optimizer runs on the precision-aware code path.
        f.push(flag("--use-precision-aware-optimizer"));
    }
    if s.grad_accum == GradAccum::Separate {
        f.push(flag("--no-gradient-accumulation-fusion"));
    }
    if m.tp > 1 && s.tp_overlap == TpOverlap::Ring {
        f.push(flag("--tp-comm-overlap"));
    }
    match s.recompute {
        Recompute::None => {}
        Recompute::Selective => f.push(arg("--recompute-granularity", "selective")),
        // Named as a gap; the closest plan recomputes selectively.
        Recompute::Op => f.push(arg("--recompute-granularity", "selective")),
        // Every layer: `uniform` over groups of one. Some: `block`, the
        // first N layers of each model chunk, as dplc recomputes them.
        Recompute::Full if s.recompute_layers == 0 => {
            f.push(arg("--recompute-granularity", "full"));
            f.push(arg("--recompute-method", "uniform"));
            f.push(arg("--recompute-num-layers", 1));
        }
        Recompute::Full => {
            f.push(arg("--recompute-granularity", "full"));
            f.push(arg("--recompute-method", "block"));
            f.push(arg("--recompute-num-layers", s.recompute_layers));
        }
    }
    f.push(arg(
        "--attention-backend",
        match s.attention {
            AttentionKind::Fused | AttentionKind::Flash2 | AttentionKind::Flash1 => "flash",
            AttentionKind::Unfused => "unfused",
        },
    ));
    if s.loss == dplc_ir::Loss::Fused {
        // Transformer Engine's cross-entropy: one pass over the logits
        // writing their gradient in place, as dplc prices a fused loss.
        // Megatron's `native` fusion still keeps the fp32 softmax, and its
        // default (no flag) is the unfused loss.
        f.push(flag("--cross-entropy-loss-fusion"));
        f.push(arg("--cross-entropy-fusion-impl", "te"));
    }
    f
}

/// Precision, optimizer and learning-rate schedule.
pub fn training_flags(job: &Job) -> Vec<Flag> {
    let t = job.train;
    let mut f = Vec::new();
    match t.precision {
        Precision::Bf16 => f.push(flag("--bf16")),
        Precision::Fp16 => f.push(flag("--fp16")),
        Precision::Fp32 => {}
    }
    // The main gradients' precision: Megatron-LM keeps bf16 training's in
    // fp32 unless told otherwise, and fp16 training's in fp16 unless told
    // otherwise (arguments.py); the compile refused any other pairing.
    match (t.precision, job.plan.strategy.grad_reduce) {
        (Precision::Bf16, dplc_ir::GradReduce::Bf16) => f.push(flag("--grad-reduce-in-bf16")),
        (Precision::Fp16, dplc_ir::GradReduce::Fp32) => {
            f.push(flag("--accumulate-allreduce-grads-in-fp32"))
        }
        _ => {}
    }
    if job.plan.strategy.fp8 {
        // Transformer Engine's hybrid recipe: E4M3 forward, E5M2 gradients.
        f.push(arg("--fp8-format", "hybrid"));
        if job.plan.strategy.fp8_gather {
            // The distributed optimizer (or FSDP) gathers the FP8 params.
            f.push(flag("--fp8-param-gather"));
        }
        let ends = job.plan.strategy.fp8_bf16_ends;
        if ends > 0 {
            f.push(flag("--first-last-layers-bf16"));
            f.push(arg("--num-layers-at-start-in-bf16", ends));
            f.push(arg("--num-layers-at-end-in-bf16", ends));
        }
    }
    let lr = match t.optimizer {
        Optimizer::AdamW {
            lr,
            beta1,
            beta2,
            eps,
            weight_decay,
        } => {
            // Megatron's `adam` is AdamW: decoupled weight decay.
            f.push(arg("--optimizer", "adam"));
            f.push(arg("--adam-beta1", number(beta1)));
            f.push(arg("--adam-beta2", number(beta2)));
            f.push(arg("--adam-eps", number(eps)));
            f.push(arg("--weight-decay", number(weight_decay)));
            lr
        }
        Optimizer::Sgd { lr, momentum } => {
            f.push(arg("--optimizer", "sgd"));
            f.push(arg("--sgd-momentum", number(momentum)));
            f.push(arg("--weight-decay", 0));
            lr
        }
    };
    f.push(arg("--lr", number(lr)));
    match t.schedule {
        LrSchedule::Constant => f.push(arg("--lr-decay-style", "constant")),
        LrSchedule::WarmupCosine {
            warmup,
            total,
            min_ratio,
        } => {
            f.push(arg("--lr-decay-style", "cosine"));
            f.push(arg("--lr-warmup-iters", warmup));
            f.push(arg("--lr-decay-iters", total));
            f.push(arg("--min-lr", number(lr * min_ratio)));
        }
    }
    f.push(arg("--clip-grad", number(t.grad_clip.unwrap_or(0.0))));
    f.push(arg("--train-iters", job.steps()));
    f
}

/// A number as Python reads it back exactly (`6e-4`, `1.0`, `500000.0`).
pub fn number(x: f64) -> String {
    // Twelve significant digits drop the tail a product leaves (6e-4 × 0.1
    // is 5.9999999999999995e-5) and keep every value a person writes.
    let x: f64 = format!("{x:.11e}").parse().unwrap_or(x);
    let s = format!("{x:?}");
    if s.contains(['.', 'e', 'E']) || s.contains("inf") || s.contains("NaN") {
        s
    } else {
        format!("{s}.0")
    }
}

/// `torchrun` launching `pretrain_gpt.py` on every node of the plan's cluster.
pub fn render(job: &Job) -> String {
    let plan = job.plan;
    let c = &plan.cluster;
    let mut out = format!(
        "#!/bin/sh\n\
         # {model} on {cluster}: Megatron-LM (Megatron-Core core_v0.12.0) arguments of the plan\n\
         # dplc predicts {step:.3} s per step, {mem:.1} GiB peak per device.\n\
         # Run on each of the {nodes} node(s) with NODE_RANK and MASTER_ADDR set, from a\n\
         # Megatron-LM checkout. --mock-data trains on synthetic tokens: replace it with\n\
         # --data-path for real data. NullTokenizer's end-of-document id makes the\n\
         # vocabulary {vocab}.\n\
         torchrun \\\n  --nnodes {nodes} \\\n  --nproc-per-node {gpus} \\\n  --node-rank \"${{NODE_RANK:-0}}\" \\\n  \
         --master-addr \"${{MASTER_ADDR:-localhost}}\" \\\n  --master-port \"${{MASTER_PORT:-6000}}\" \\\n  \
         pretrain_gpt.py",
        model = plan.model,
        cluster = c.name,
        step = plan.estimate.step_time_s,
        mem = plan.estimate.peak_memory_bytes as f64 / (1u64 << 30) as f64,
        nodes = c.nodes,
        gpus = c.devices_per_node,
        vocab = job.model.vocab,
    );
    let mut flags = model_flags(job);
    flags.extend(parallel_flags(plan));
    flags.extend(training_flags(job));
    flags.push(flag("--mock-data"));
    for Flag(name, value) in flags {
        out.push_str(" \\\n  ");
        out.push_str(name);
        if let Some(v) = value {
            out.push(' ');
            out.push_str(&v);
        }
    }
    out.push('\n');
    out
}
