//! The cluster model: a device catalog with cited numbers, the two link levels
//! (inside a node, between nodes) and the `8xA100` / `4x8xH100` shorthands.

use crate::PlanError;
use dplc_ir::validate as rules;
use dplc_ir::{ClusterSpec, Plan, PlanInvalid, Precision};

const GIB: u64 = 1 << 30;
const TERA: f64 = 1e12;
const GB: f64 = 1e9;

/// One accelerator model: its peak rates, memory and default links.
#[derive(Clone, Debug, PartialEq)]
pub struct Device {
    /// Catalog name, e.g. `A100-80GB`, or a cluster section's own device.
    pub name: String,
    /// Dense tensor-core peak, FLOP/s, by precision.
    pub peak_bf16: f64,
    pub peak_fp16: f64,
    pub peak_fp32: f64,
    /// Dense FP8 tensor-core peak (Transformer Engine's GEMMs); 0: none.
    pub peak_fp8: f64,
    /// The host's memory per device (its share of the node's), bytes; 0: none.
    pub host_memory_bytes: u64,
    /// The device–host link per direction, bytes/s.
    pub host_link_bandwidth: f64,
    /// The host's memory bandwidth per device (its share), bytes/s.
    pub host_memory_bandwidth: f64,
    pub memory_bytes: u64,
    /// HBM (or DRAM) bandwidth, bytes/s.
    pub memory_bandwidth: f64,
    /// The fraction of peak that large matmuls sustain in training: the
    /// power-saturated rate where one was measured ("maximum sustainable
    /// matmul FLOPS"), else the best burst of a tuned cuBLAS GEMM ("maximum
    /// achievable"). See the catalog's sources.
    pub matmul_efficiency: f64,
    /// The same for FP8 GEMMs (`fp8=on`), as a fraction of the FP8 peak.
    pub fp8_matmul_efficiency: f64,
    /// The fraction of peak FlashAttention-2's fused attention reaches in
    /// its forward pass (`attention=flash2`, PyTorch SDPA's flash backend),
    /// causal FLOPs counted as computed.
    pub flash2_efficiency: f64,
    /// The same for its backward pass (five block matmuls to the forward's two).
    pub flash2_backward_efficiency: f64,
    /// The fraction of peak the device's best fused attention kernel
    /// reaches in its forward pass (`attention=fused`: FlashAttention-3 on
    /// Hopper, FlashAttention-2 on Ampere), causal FLOPs counted as computed.
    pub fused_attention_efficiency: f64,
    /// The same for its backward pass.
    pub fused_attention_backward_efficiency: f64,
    /// The fraction of peak a GEMM sustains when a row of an operand or of
    /// its output is not a whole number of 16-byte pieces (GPT-2's 50,257
    /// logits) and the stack does not pad it: eager PyTorch
    /// (`elementwise=eager`); Inductor pads such GEMMs, Megatron pads the
    /// vocabulary. Where none was measured, the large-GEMM efficiency.
    pub unaligned_matmul_efficiency: f64,
    /// Seconds a FlashAttention-2 kernel spends, forward and backward, on
    /// the dropout of each attended score (its counter-based draw and
    /// mask), beyond the kernel without dropout. FlashAttention-3 has no
    /// dropout, so an attention with dropout runs at FlashAttention-2's
    /// rate plus this. 0 where none was measured.
    pub attention_dropout_s: (f64, f64),
    pub intra_node: Link,
    pub inter_node: Link,
    /// Devices in the usual node (DGX/HGX have 8).
    pub devices_per_node: u64,
    /// Streaming multiprocessors, for GEMM wave quantization (0: no waves).
    pub multiprocessors: u64,
}

impl Device {
    /// Dense peak FLOP/s for matmuls in `precision`.
    pub fn peak_flops(&self, precision: Precision) -> f64 {
        match precision {
            Precision::Bf16 => self.peak_bf16,
            Precision::Fp16 => self.peak_fp16,
            Precision::Fp32 => self.peak_fp32,
        }
    }
}

/// A link level: bandwidth per device per direction and one-hop latency.
#[derive(Clone, Debug, PartialEq)]
pub struct Link {
    pub kind: String,
    pub bandwidth: f64,
    pub latency_s: f64,
}

fn link(kind: &str, bandwidth: f64, latency_s: f64) -> Link {
    Link {
        kind: kind.to_string(),
        bandwidth,
        latency_s,
    }
}

/// Large-GEMM efficiency from Stas Bekman's matmul measurements
/// (stas00/ml-engineering, compute/accelerator/README.md). The A100 has its
/// "maximum achievable matmul FLOPS" (MAMF, the best burst over a sweep of
/// shapes): bf16 267.9 of 312 TFLOP/s (85.9%). A GPU at its power limit
/// cannot hold the boost clock a burst runs at: a dense training step keeps
/// every SM busy and "lives at the settled clock, not the boost clock".
/// Where that sustained rate was measured ("maximum sustainable matmul
/// FLOPS", MSMF: the GPU soaked at its TDP, branch `fast-mamf` @
/// 082816f9be8aeb6b65b074c33cb354a7ca1e7087, 2026-08-10) it is what the
/// device runs at: H200 SXM (700 W) bf16 708.5 of 989 TFLOP/s at 1465 MHz
/// (71.6%; its MAMF is 841.9 at the 1980 MHz boost), FP8 1288.7 of 1979
/// (65.1%), which serve the H100 SXM, the same die at the same 700 W; B200
/// (1000 W) bf16 1456.3 of 2250 (64.7%), FP8 2795.7 of 4500 (62.1%). The
/// GH200 (a 900 W module) keeps the H100's burst figure of the same table's
/// earlier version, 792.1 of 989 (80.1%), and its FP8 MAMF, 1535.0 of 1979
/// (77.6%; HEAD 744d01e18b79512572f64a6bbd8b5f4a725203a7): no sustained
/// figure is at hand for it, nor for the A100.
const A100_MAMF: f64 = 267.9 / 312.0;
const H100_MAMF: f64 = 792.1 / 989.4;
const H100_MSMF: f64 = 708.5 / 989.4;
const H100_FP8_MSMF: f64 = 1288.7 / 1978.9;
const GH200_FP8_MAMF: f64 = 1535.0 / 1978.9;
const B200_MSMF: f64 = 1456.3 / 2250.0;
const B200_FP8_MSMF: f64 = 2795.7 / 4500.0;
/// V100, MI300X and CPUs: no measurement taken here; the usual 80% of peak
/// for tuned BLAS.
const DEFAULT_MAMF: f64 = 0.8;
/// FlashAttention-2's fraction of peak, forward and backward, for causal
/// attention with head dimension 128 (the Llama shape), causal FLOPs counted
/// as computed. A100: Dao 2023 (arXiv:2307.08691) Figs. 5 and 6, A100 80GB
/// SXM4, causal, head dimension 128, 16K tokens: 197 TFLOP/s forward, 186
/// backward, as read off the bar charts (63.1% and 59.6% of 312; the text
/// states only the range, "50-73%", 73% being the forward without the
/// causal mask). H100 die:
/// Dao-AILab/flash-attention pull request #1791 (2025-07-31),
/// `hopper/benchmark_attn.py` on an H100, head dimension 128, causal,
/// sequence 8192: "Fav2 fwd: 1.935ms, 284.1 TFLOPS", "Fav2 bwd: 4.788ms,
/// 287.1 TFLOPS" (28.7% and 29.0% of 989.4; FlashAttention-3's paper puts
/// FlashAttention-2 at "only 35%" of the H100, its best setting). Elsewhere
/// no figure is at hand: the device's large-GEMM efficiency.
const A100_FLASH2: (f64, f64) = (197.0 / 312.0, 186.0 / 312.0);
const H100_FLASH2: (f64, f64) = (284.1 / 989.4, 287.1 / 989.4);
/// How much faster FlashAttention-2 runs than FlashAttention (v1) and its
/// Triton port (`attention=flash1`): Dao 2023 (arXiv:2307.08691) §4.1, on
/// the A100 80GB: "FlashAttention-2 is around 2× faster than
/// FlashAttention", and against the Triton port "around 1.3-1.5× faster
/// ... in the forward pass and around 2× faster in the backward pass"
/// (the port's own header, `flash_attn/flash_attn_triton.py` @
/// 00583fb14af7b84c4dca7531dc23126870eb0d35: "Overall Triton forward +
/// backward is slightly slower than CUDA forward + backward"). One factor
/// for both passes and both kernels; on devices other than the A100 it is
/// applied to the device's FlashAttention-2 rate, no other measurement
/// being at hand.
pub(crate) const FLASH2_OVER_FLASH1: f64 = 2.0;
/// The fused attention a Hopper stack runs (FlashAttention-3; Transformer
/// Engine's cuDNN kernel is of its class), from the same benchmark as
/// FlashAttention-2's H100 figures (pull request #1791, `main`, head
/// dimension 128, causal, sequence 8192): "Fav3 fwd: 0.873ms, 630.0 TFLOPS",
/// "Fav3 bwd: 2.585ms, 531.6 TFLOPS" (63.7% and 53.7% of 989.4) — below the
/// GEMM rate, the backward most (its five block matmuls share the SMs with
/// the softmax's recomputation and dQ's atomic accumulation). Ampere has
/// nothing faster than FlashAttention-2, so there `fused` is FlashAttention-2.
const H100_FLASH3: (f64, f64) = (630.0 / 989.4, 531.6 / 989.4);
/// A GEMM whose rows are not whole 16-byte pieces on the H100 die, measured
/// by this project on an H200 (bench/RESULTS.md, "The second H200 session",
/// run E: cuBLAS 13, bf16, median of three steps): GPT-2's logits and their
/// two gradients, 32,768 × 50,257 × 768 each (7.589 TFLOP), in 26.69 +
/// 17.95 + 16.66 ms = 123.8 TFLOP/s, 12.5% of 989.4, where the same run's
/// aligned GEMMs of the same model ran at 525–728 TFLOP/s: Hopper's tensor
/// memory accelerator needs 16-byte strides, and without it cuBLAS falls
/// back to kernels that load two bytes at a time.
const H100_UNALIGNED: f64 =
    (2.0 * 32768.0 * 50257.0 * 768.0 * 3.0 / (26.69 + 17.95 + 16.66) / 1e-3) / (989.4 * TERA);

/// FlashAttention-2's dropout on the H100 die, measured by this project on
/// an H200 (bench/RESULTS.md, "The GPU check on an NVIDIA H200", run 3:
/// PyTorch 2.11's flash SDPA, GPT-2's shape b 8, h 12, d 64, s 1024,
/// causal): forward 0.093 → 0.133 ms and backward 0.342 → 0.364 ms with
/// dropout 0.1, over the 56.6 M scores its 128 × 64 tiles attend (96 heads
/// × 589,824): 0.71 ps and 0.39 ps a score (the same run's whole step,
/// fwd + bwd, +14.5%; another run's +12%). A per-score cost, so a wider head
/// pays a smaller share of its time.
const H100_FLASH2_DROPOUT_S: (f64, f64) = (0.040e-3 / 56_623_104.0, 0.022e-3 / 56_623_104.0);

/// NVLink/NVSwitch and NCCL-over-InfiniBand latencies per hop: a few microseconds
/// (NCCL's own tuning model uses ~1–2 µs per NVLink step and ~5 µs over the network).
const NVLINK_LATENCY_S: f64 = 2e-6;
const IB_LATENCY_S: f64 = 5e-6;

/// The catalog. Sources: NVIDIA A100 datasheet (2021): 312 TFLOP/s dense
/// bf16/fp16, 19.5 fp32, 1.555 TB/s (40GB) / 2.039 TB/s (80GB SXM), NVLink 3
/// 600 GB/s total = 300 GB/s per direction; DGX A100: 8× HDR 200 Gb/s HCAs =
/// 25 GB/s per GPU. H100 SXM datasheet: 989.4 TFLOP/s dense bf16, 67 fp32,
/// 3.35 TB/s, NVLink 4 900 GB/s = 450 per direction; DGX H100: 8× NDR 400 Gb/s
/// = 50 GB/s per GPU; 108 SMs (A100) and 132 (H100 SXM, H200). H200 datasheet: the H100 die, 141 GB at 4.8 TB/s.
/// V100 SXM2 datasheet: 125 TFLOP/s fp16 tensor (no bf16: it runs at the fp32
/// rate, 15.7), 900 GB/s, NVLink 2 300 GB/s = 150 per direction; DGX-1V: 4×
/// EDR 100 Gb/s for 8 GPUs = 6.25 GB/s per GPU. `cpu` is one rank of a CPU run:
/// a few AVX2 cores (~100 GFLOP/s fp32), 20 GB/s of DRAM, shared-memory links.
/// GH200 (NVIDIA Grace Hopper Superchip datasheet): the H100 die at its
/// rates with 96 GB HBM3 at 4 TB/s or 144 GB HBM3e at 4.9 TB/s, NVLink 4 (450
/// GB/s per direction), one 400 Gb/s adapter each. B200 (NVIDIA DGX/HGX B200
/// datasheets, 2024): 72 PFLOP/s FP8 for 8 GPUs with sparsity = 2.25 PFLOP/s
/// dense bf16 each, 600 TFLOP/s FP32 for 8 = 75 each, 1,440 GB HBM3e for 8 =
/// 180 each at 62 TB/s for 8 ≈ 7.7 each, NVLink 5 1.8 TB/s = 900 per
/// direction, 8× ConnectX-7 400 Gb/s = 50 GB/s each; 148 SMs. MI300X (AMD
/// Instinct MI300X datasheet): 1,307.4 TFLOP/s dense bf16/fp16, 163.4 fp32
/// matrix, 192 GB HBM3 at 5.3 TB/s, 7 Infinity Fabric links × 64 GB/s = 448
/// per direction, 304 CUs; one 400 Gb/s adapter per GPU. No large-GEMM
/// efficiency measurement is taken for MI300X: the default 80% (a cluster
/// section's `accelerator(…, matmul_efficiency = …)` sets it).
/// Dense FP8 (the datasheets' sparse figures halved): H100 SXM, H200 and
/// GH200 1,978.9 TFLOP/s; B200 72 PFLOP/s sparse for 8 = 4.5 PFLOP/s dense
/// each; MI300X 2,614.9. A100 and V100 have no FP8 tensor cores.
/// The host, per GPU (a node's share, for offloading): DGX A100 1 TB of
/// DDR4-3200 on 2 EPYC 7742 (2 × 204.8 GB/s), PCIe 4.0 x16 (31.5 GB/s a
/// direction); DGX H100/H200 2 TB of DDR5-4800 on 2 Xeon 8480C (2 × 307.2
/// GB/s), PCIe 5.0 x16 (63 GB/s); GH200 480 GB LPDDR5X at 512 GB/s behind
/// NVLink-C2C (900 GB/s = 450 a direction); DGX B200 2 TB of DDR5-5600 on 2
/// Xeon 8570 (2 × 358.4 GB/s), PCIe 5.0; MI300X platforms 2 TB of DDR5-4800
/// on 2 EPYC 9654 (2 × 460.8 GB/s), PCIe 5.0; DGX-1V 512 GB of DDR4-2400 on 2
/// Xeon E5-2698 v4 (2 × 76.8 GB/s), PCIe 3.0 x16 (15.75 GB/s). `cpu` ranks
/// have no separate host.
pub fn catalog() -> Vec<Device> {
    let a100 = |name: &str, memory_gib: u64, bw| Device {
        name: name.into(),
        peak_bf16: 312.0 * TERA,
        peak_fp16: 312.0 * TERA,
        peak_fp32: 19.5 * TERA,
        peak_fp8: 0.0,
        host_memory_bytes: 128 * GIB,
        host_link_bandwidth: 31.5 * GB,
        host_memory_bandwidth: 51.2 * GB,
        memory_bytes: memory_gib * GIB,
        memory_bandwidth: bw,
        matmul_efficiency: A100_MAMF,
        // No FP8 tensor cores: `fp8=on` is refused before this is read.
        fp8_matmul_efficiency: A100_MAMF,
        flash2_efficiency: A100_FLASH2.0,
        flash2_backward_efficiency: A100_FLASH2.1,
        fused_attention_efficiency: A100_FLASH2.0,
        fused_attention_backward_efficiency: A100_FLASH2.1,
        unaligned_matmul_efficiency: A100_MAMF,
        // No dropout measurement on the A100.
        attention_dropout_s: (0.0, 0.0),
        intra_node: link("nvswitch", 300.0 * GB, NVLINK_LATENCY_S),
        inter_node: link("infiniband", 25.0 * GB, IB_LATENCY_S),
        devices_per_node: 8,
        multiprocessors: 108,
    };
    let h100 = |name: &str,
                memory_bytes,
                bw,
                (host_memory_bytes, host_link_bandwidth, host_memory_bandwidth),
                (matmul_efficiency, fp8_matmul_efficiency)| Device {
        name: name.into(),
        peak_bf16: 989.4 * TERA,
        peak_fp16: 989.4 * TERA,
        peak_fp32: 66.9 * TERA,
        peak_fp8: 1978.9 * TERA,
        host_memory_bytes,
        host_link_bandwidth,
        host_memory_bandwidth,
        memory_bytes,
        memory_bandwidth: bw,
        matmul_efficiency,
        fp8_matmul_efficiency,
        flash2_efficiency: H100_FLASH2.0,
        flash2_backward_efficiency: H100_FLASH2.1,
        fused_attention_efficiency: H100_FLASH3.0,
        fused_attention_backward_efficiency: H100_FLASH3.1,
        unaligned_matmul_efficiency: H100_UNALIGNED,
        attention_dropout_s: H100_FLASH2_DROPOUT_S,
        intra_node: link("nvswitch", 450.0 * GB, NVLINK_LATENCY_S),
        inter_node: link("infiniband", 50.0 * GB, IB_LATENCY_S),
        devices_per_node: 8,
        multiprocessors: 132,
    };
    // (host memory, host link, host memory bandwidth) per GPU.
    let dgx_h100 = (256 * GIB, 63.0 * GB, 76.8 * GB);
    let grace = (480 * GIB, 450.0 * GB, 512.0 * GB);
    // (large-GEMM efficiency, FP8 large-GEMM efficiency): sustained at 700 W,
    // or the GH200's bursts.
    let at_700_w = (H100_MSMF, H100_FP8_MSMF);
    let gh200 = (H100_MAMF, GH200_FP8_MAMF);
    vec![
        a100("A100-40GB", 40, 1555.0 * GB),
        a100("A100-80GB", 80, 2039.0 * GB),
        h100("H100-SXM-80GB", 80 * GIB, 3350.0 * GB, dgx_h100, at_700_w),
        h100("H200", 141_000_000_000, 4800.0 * GB, dgx_h100, at_700_w),
        h100("GH200", 96 * GIB, 4000.0 * GB, grace, gh200),
        h100("GH200-144GB", 144 * GIB, 4900.0 * GB, grace, gh200),
        Device {
            name: "B200".into(),
            peak_bf16: 2250.0 * TERA,
            peak_fp16: 2250.0 * TERA,
            peak_fp32: 75.0 * TERA,
            peak_fp8: 4500.0 * TERA,
            host_memory_bytes: 256 * GIB,
            host_link_bandwidth: 63.0 * GB,
            host_memory_bandwidth: 89.6 * GB,
            memory_bytes: 180 * GIB,
            memory_bandwidth: 7700.0 * GB,
            matmul_efficiency: B200_MSMF,
            fp8_matmul_efficiency: B200_FP8_MSMF,
            flash2_efficiency: B200_MSMF,
            flash2_backward_efficiency: B200_MSMF,
            fused_attention_efficiency: B200_MSMF,
            fused_attention_backward_efficiency: B200_MSMF,
            unaligned_matmul_efficiency: B200_MSMF,
            attention_dropout_s: (0.0, 0.0),
            intra_node: link("nvswitch", 900.0 * GB, NVLINK_LATENCY_S),
            inter_node: link("infiniband", 50.0 * GB, IB_LATENCY_S),
            devices_per_node: 8,
            multiprocessors: 148,
        },
        Device {
            name: "MI300X".into(),
            peak_bf16: 1307.4 * TERA,
            peak_fp16: 1307.4 * TERA,
            peak_fp32: 163.4 * TERA,
            peak_fp8: 2614.9 * TERA,
            host_memory_bytes: 256 * GIB,
            host_link_bandwidth: 63.0 * GB,
            host_memory_bandwidth: 115.2 * GB,
            memory_bytes: 192 * GIB,
            memory_bandwidth: 5300.0 * GB,
            matmul_efficiency: DEFAULT_MAMF,
            fp8_matmul_efficiency: DEFAULT_MAMF,
            flash2_efficiency: DEFAULT_MAMF,
            flash2_backward_efficiency: DEFAULT_MAMF,
            fused_attention_efficiency: DEFAULT_MAMF,
            fused_attention_backward_efficiency: DEFAULT_MAMF,
            unaligned_matmul_efficiency: DEFAULT_MAMF,
            attention_dropout_s: (0.0, 0.0),
            intra_node: link("infinity-fabric", 448.0 * GB, NVLINK_LATENCY_S),
            inter_node: link("infiniband", 50.0 * GB, IB_LATENCY_S),
            devices_per_node: 8,
            multiprocessors: 304,
        },
        Device {
            name: "V100-32GB".into(),
            peak_bf16: 15.7 * TERA,
            peak_fp16: 125.0 * TERA,
            peak_fp32: 15.7 * TERA,
            peak_fp8: 0.0,
            host_memory_bytes: 64 * GIB,
            host_link_bandwidth: 15.75 * GB,
            host_memory_bandwidth: 19.2 * GB,
            memory_bytes: 32 * GIB,
            memory_bandwidth: 900.0 * GB,
            matmul_efficiency: DEFAULT_MAMF,
            fp8_matmul_efficiency: DEFAULT_MAMF,
            flash2_efficiency: DEFAULT_MAMF,
            flash2_backward_efficiency: DEFAULT_MAMF,
            fused_attention_efficiency: DEFAULT_MAMF,
            fused_attention_backward_efficiency: DEFAULT_MAMF,
            unaligned_matmul_efficiency: DEFAULT_MAMF,
            attention_dropout_s: (0.0, 0.0),
            intra_node: link("nvlink", 150.0 * GB, NVLINK_LATENCY_S),
            inter_node: link("infiniband", 6.25 * GB, IB_LATENCY_S),
            devices_per_node: 8,
            multiprocessors: 80,
        },
        Device {
            name: "cpu".into(),
            peak_bf16: 0.1 * TERA,
            peak_fp16: 0.1 * TERA,
            peak_fp32: 0.1 * TERA,
            peak_fp8: 0.0,
            host_memory_bytes: 0,
            host_link_bandwidth: 0.0,
            host_memory_bandwidth: 0.0,
            memory_bytes: 16 * GIB,
            memory_bandwidth: 20.0 * GB,
            matmul_efficiency: DEFAULT_MAMF,
            fp8_matmul_efficiency: DEFAULT_MAMF,
            flash2_efficiency: DEFAULT_MAMF,
            flash2_backward_efficiency: DEFAULT_MAMF,
            fused_attention_efficiency: DEFAULT_MAMF,
            fused_attention_backward_efficiency: DEFAULT_MAMF,
            unaligned_matmul_efficiency: DEFAULT_MAMF,
            attention_dropout_s: (0.0, 0.0),
            intra_node: link("shm", 10.0 * GB, 1e-6),
            inter_node: link("ethernet", 1.25 * GB, 20e-6),
            devices_per_node: 1024,
            multiprocessors: 0,
        },
    ]
}

/// Find a device by catalog name or alias (`A100`, `a100_80gb`, `H100`, `h100-sxm`…).
pub fn device(name: &str) -> Result<Device, PlanError> {
    let key = name.to_ascii_lowercase().replace('_', "-");
    let canonical = match key.as_str() {
        "a100" | "a100-80gb" | "a100-80g" | "a100-sxm" | "a100-sxm-80gb" | "a100-sxm4-80gb" => {
            "A100-80GB"
        }
        "a100-40gb" | "a100-40g" | "a100-sxm4-40gb" => "A100-40GB",
        "h100" | "h100-sxm" | "h100-80gb" | "h100-sxm-80gb" | "h100-sxm5-80gb" => "H100-SXM-80GB",
        "h200" | "h200-sxm" | "h200-141gb" => "H200",
        "v100" | "v100-32gb" | "v100-sxm2-32gb" => "V100-32GB",
        "gh200" | "gh200-96gb" => "GH200",
        "gh200-144gb" => "GH200-144GB",
        "b200" | "b200-sxm" | "b200-180gb" => "B200",
        "mi300x" | "mi300" => "MI300X",
        "cpu" => "cpu",
        _ => "",
    };
    let all = catalog();
    all.iter()
        .find(|d| d.name == canonical)
        .cloned()
        .ok_or_else(|| PlanError::UnknownDevice {
            name: name.to_string(),
            known: all
                .iter()
                .map(|d| d.name.as_str())
                .collect::<Vec<_>>()
                .join(", "),
        })
}

/// Nodes of identical devices joined by an intra-node and an inter-node link.
#[derive(Clone, Debug, PartialEq)]
pub struct Cluster {
    pub name: String,
    pub nodes: u64,
    pub devices_per_node: u64,
    pub device: Device,
    pub intra_node: Link,
    pub inter_node: Link,
    /// The cluster section's `accelerator(…)`, where the device is not the
    /// catalog's; plans record it ([`check_plan_cluster`]).
    pub custom_device: Option<dplc_ir::DeviceSpec>,
}

impl Cluster {
    /// Devices in all; `u64::MAX` past it (the planner refuses more than
    /// [`dplc_ir::validate::MAX_DEVICES`] before it searches).
    pub fn world_size(&self) -> u64 {
        self.nodes.saturating_mul(self.devices_per_node)
    }

    /// A cluster of `nodes × devices_per_node` devices with the device's default links.
    pub fn new(nodes: u64, devices_per_node: u64, device: Device) -> Cluster {
        let name = if nodes == 1 {
            format!("{devices_per_node}x{}", device.name)
        } else {
            format!("{nodes}x{devices_per_node}x{}", device.name)
        };
        Cluster {
            name,
            nodes,
            devices_per_node,
            intra_node: device.intra_node.clone(),
            inter_node: device.inter_node.clone(),
            device,
            custom_device: None,
        }
    }
}

/// Whether a plan's device is one dplc knows, as the plan describes it (a
/// catalog device with the catalog's memory, or the `accelerator(…)` the
/// plan recorded from its cluster section, by name and memory), and the
/// plan fits it. `compile` writes only plans that fit; the library's
/// `ignore_memory` prices others, which do not load.
pub fn check_plan_cluster(plan: &Plan) -> Result<(), PlanInvalid> {
    let c = &plan.cluster;
    let peak = plan.estimate.peak_memory_bytes;
    if peak > c.memory_bytes {
        return Err(PlanInvalid::new(
            "estimate.peak_memory_bytes",
            format!(
                "{peak} bytes a rank, more than the device's {} (cluster.memory_bytes): \
                 the plan does not fit the cluster it names",
                c.memory_bytes
            ),
        ));
    }
    let (known, memory_bytes) = match &c.custom_device {
        Some(d) => {
            if d.name != c.device {
                return Err(PlanInvalid::new(
                    "cluster.device",
                    format!(
                        "`{}`, but the plan's accelerator(…) is named `{}`",
                        c.device, d.name
                    ),
                ));
            }
            (format!("its accelerator(…) `{}`", d.name), d.memory_bytes)
        }
        None => {
            let d = device(&c.device).map_err(|_| {
                let names: Vec<String> = catalog().into_iter().map(|d| d.name).collect();
                PlanInvalid::new(
                    "cluster.device",
                    format!(
                        "`{}` is not in dplc's catalog ({}), and the plan describes no \
                         accelerator(…) of that name",
                        c.device,
                        names.join(", ")
                    ),
                )
            })?;
            (format!("the catalog's `{}`", d.name), d.memory_bytes)
        }
    };
    if c.memory_bytes != memory_bytes {
        return Err(PlanInvalid::new(
            "cluster.memory_bytes",
            format!("{} bytes, but {known} has {memory_bytes}", c.memory_bytes),
        ));
    }
    Ok(())
}

/// Read `8xA100` (one node of 8), `4x8xH100` (4 nodes of 8) or `16xcpu`.
/// `64xA100` is read as nodes of the device's usual size (8 nodes of 8).
pub fn parse_cluster(spec: &str) -> Result<Cluster, PlanError> {
    let err = |detail: &str| PlanError::Cluster {
        spec: spec.to_string(),
        detail: detail.to_string(),
    };
    // Leading counts, each followed by `x`; the rest names the device
    // (which may itself hold an `x`: MI300X).
    let mut counts = Vec::new();
    let mut name = spec.trim();
    while let Some(at) = name.find(['x', 'X', '*']) {
        let count = name[..at].trim();
        if count.is_empty() || !count.bytes().all(|b| b.is_ascii_digit()) {
            break;
        }
        counts.push(count);
        name = &name[at + 1..];
    }
    let name = name.trim();
    if name.is_empty() {
        return Err(err(
            "expected COUNTxDEVICE or NODESxCOUNTxDEVICE, e.g. 8xA100 or 4x8xH100",
        ));
    }
    let device = device(name)?;
    let nums = counts
        .iter()
        .map(|&c| match c.parse::<u64>() {
            Ok(n) if n > 0 => Ok(n),
            _ if !c.is_empty()
                && c.bytes().all(|b| b.is_ascii_digit())
                && !c.trim_start_matches('0').is_empty() =>
            {
                Err(err(&format!(
                    "the count {c} overflows a 64-bit number; dplc plans for at most {} devices",
                    rules::MAX_DEVICES
                )))
            }
            _ => Err(err("counts must be positive whole numbers, e.g. 4x8xH100")),
        })
        .collect::<Result<Vec<u64>, PlanError>>()?;
    let (nodes, per_node) = match nums.as_slice() {
        [] => (1, 1),
        [n] if *n <= device.devices_per_node => (1, *n),
        [n] if n % device.devices_per_node == 0 => {
            (n / device.devices_per_node, device.devices_per_node)
        }
        [n] => {
            return Err(err(&format!(
                "{n} {} devices do not fill whole nodes of {}; write NODESxPER_NODEx{}",
                device.name, device.devices_per_node, device.name
            )))
        }
        [nodes, per] => (*nodes, *per),
        _ => return Err(err("at most two counts: NODESxPER_NODExDEVICE")),
    };
    rules::world(nodes, per_node).map_err(|e| err(&e))?;
    Ok(Cluster::new(nodes, per_node, device))
}

/// The cluster a `.dpl` `cluster` section describes; its links override the device's.
/// A device described in the cluster section. It has no default links: the
/// section must give the links its devices use.
fn custom_device(d: &dplc_ir::DeviceSpec, spec: &ClusterSpec) -> Result<Device, PlanError> {
    let missing = if spec.intra_node.is_none() && spec.devices_per_node > 1 {
        Some("intra_node")
    } else if spec.inter_node.is_none() && spec.nodes > 1 {
        Some("inter_node")
    } else {
        None
    };
    if let Some(key) = missing {
        return Err(PlanError::Cluster {
            spec: spec.name.clone(),
            detail: format!(
                "its device `{}` is described, not from the catalog, so the section must give `{key}` \
                 (e.g. `{key} = nvswitch(bandwidth = 450 GB/s, latency = 2 us)`)",
                d.name
            ),
        });
    }
    // A link nobody uses (one device a node, one node) is never priced.
    let unused = || link("none", 1.0, 0.0);
    Ok(Device {
        name: d.name.clone(),
        peak_bf16: d.peak_bf16,
        peak_fp16: d.peak_fp16,
        peak_fp32: d.peak_fp32,
        peak_fp8: d.peak_fp8,
        host_memory_bytes: d.host_memory_bytes,
        host_link_bandwidth: d.host_link_bandwidth,
        host_memory_bandwidth: d.host_memory_bandwidth,
        memory_bytes: d.memory_bytes,
        memory_bandwidth: d.memory_bandwidth,
        matmul_efficiency: d.matmul_efficiency.unwrap_or(DEFAULT_MAMF),
        fp8_matmul_efficiency: d
            .fp8_matmul_efficiency
            .or(d.matmul_efficiency)
            .unwrap_or(DEFAULT_MAMF),
        flash2_efficiency: d
            .flash2_efficiency
            .or(d.matmul_efficiency)
            .unwrap_or(DEFAULT_MAMF),
        flash2_backward_efficiency: d
            .flash2_backward_efficiency
            .or(d.flash2_efficiency)
            .or(d.matmul_efficiency)
            .unwrap_or(DEFAULT_MAMF),
        fused_attention_efficiency: d
            .fused_attention_efficiency
            .or(d.matmul_efficiency)
            .unwrap_or(DEFAULT_MAMF),
        fused_attention_backward_efficiency: d
            .fused_attention_backward_efficiency
            .or(d.fused_attention_efficiency)
            .or(d.matmul_efficiency)
            .unwrap_or(DEFAULT_MAMF),
        unaligned_matmul_efficiency: d
            .unaligned_matmul_efficiency
            .or(d.matmul_efficiency)
            .unwrap_or(DEFAULT_MAMF),
        attention_dropout_s: (
            d.attention_dropout_forward_ps.unwrap_or(0.0) * 1e-12,
            d.attention_dropout_backward_ps
                .or(d.attention_dropout_forward_ps)
                .unwrap_or(0.0)
                * 1e-12,
        ),
        intra_node: unused(),
        inter_node: unused(),
        devices_per_node: spec.devices_per_node,
        multiprocessors: d.multiprocessors,
    })
}

pub fn cluster_from_spec(spec: &ClusterSpec) -> Result<Cluster, PlanError> {
    rules::world(spec.nodes, spec.devices_per_node).map_err(|detail| PlanError::Cluster {
        spec: spec.name.clone(),
        detail,
    })?;
    let dev = match &spec.custom_device {
        Some(d) => custom_device(d, spec)?,
        None => device(&spec.device)?,
    };
    let mut c = Cluster::new(spec.nodes, spec.devices_per_node, dev);
    c.name = spec.name.clone();
    c.custom_device = spec.custom_device.clone();
    for (name, ours, theirs) in [
        ("intra_node", &mut c.intra_node, &spec.intra_node),
        ("inter_node", &mut c.inter_node, &spec.inter_node),
    ] {
        if let Some(l) = theirs {
            // The frontend refuses these with the line; a spec built in code
            // is held to the same ranges.
            for (what, bounds, x) in [
                ("bandwidth", &rules::BANDWIDTH, l.bandwidth_bytes_per_s),
                ("latency", &rules::LATENCY, l.latency_s),
            ] {
                bounds.check(x).map_err(|why| PlanError::Cluster {
                    spec: spec.name.clone(),
                    detail: format!("{name} {what} {why}"),
                })?;
            }
            *ours = link(&l.kind, l.bandwidth_bytes_per_s, l.latency_s);
        }
    }
    Ok(c)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shorthands_read_nodes_and_devices() {
        let c = parse_cluster("8xA100").unwrap();
        assert_eq!((c.nodes, c.devices_per_node), (1, 8));
        assert_eq!(c.device.name, "A100-80GB");
        let c = parse_cluster("4x8xH100").unwrap();
        assert_eq!((c.nodes, c.devices_per_node, c.world_size()), (4, 8, 32));
        let c = parse_cluster("64xa100_40gb").unwrap();
        assert_eq!((c.nodes, c.devices_per_node), (8, 8));
        let c = parse_cluster("16xcpu").unwrap();
        assert_eq!((c.nodes, c.devices_per_node), (1, 16));
        assert!(matches!(
            parse_cluster("8xTPU"),
            Err(PlanError::UnknownDevice { .. })
        ));
        assert!(parse_cluster("0xA100").is_err());
        assert!(parse_cluster("12xA100").is_err());
    }

    #[test]
    fn a_link_outside_the_cost_models_range_is_refused() {
        let spec = |bandwidth_bytes_per_s, latency_s| ClusterSpec {
            name: "c".into(),
            nodes: 1,
            devices_per_node: 4,
            device: "cpu".into(),
            custom_device: None,
            intra_node: Some(dplc_ir::LinkSpec {
                kind: "shm".into(),
                bandwidth_bytes_per_s,
                latency_s,
            }),
            inter_node: None,
        };
        assert!(cluster_from_spec(&spec(10e9, 1e-6)).is_ok());
        for (bandwidth, latency, what) in [
            (0.0, 1e-6, "intra_node bandwidth"),
            (-1e9, 1e-6, "intra_node bandwidth"),
            (f64::INFINITY, 1e-6, "intra_node bandwidth"),
            (10e9, 1e308, "intra_node latency"),
            (10e9, f64::NAN, "intra_node latency"),
        ] {
            let e = cluster_from_spec(&spec(bandwidth, latency))
                .unwrap_err()
                .to_string();
            assert!(
                e.contains(&format!("{what} must be in the range")),
                "{bandwidth} {latency}: {e}"
            );
        }
    }

    #[test]
    fn every_catalog_device_is_found_by_the_name_plans_record() {
        // `check_plan_cluster` looks a plan's `cluster.device` up by name.
        for d in catalog() {
            let found = device(&d.name).unwrap_or_else(|e| panic!("{}: {e}", d.name));
            assert_eq!(found.memory_bytes, d.memory_bytes, "{}", d.name);
        }
    }

    #[test]
    fn overflowing_and_huge_counts_are_named() {
        let e = parse_cluster("99999999999999999999xH100")
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("the count 99999999999999999999 overflows a 64-bit number"),
            "{e}"
        );
        let e = parse_cluster("65536x65536xH100").unwrap_err().to_string();
        assert_eq!(
            e,
            "cannot read cluster `65536x65536xH100`: 65536 nodes × 65536 devices = 4294967296 is too large: dplc plans for at most 1048576 (2^20 devices)"
        );
        let e = parse_cluster("4294967296x4294967296xH100")
            .unwrap_err()
            .to_string();
        assert!(e.contains("overflows a 64-bit count"), "{e}");
    }
}
