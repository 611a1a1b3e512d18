//! The cost model: per-rank memory by kind and step time by phase for one
//! configuration, from the model profile and the cluster's links. This
//! module prices the passes, the collectives and the step; what a rank holds
//! is `memory`'s, how the layers split over stages `stages`'.
//!
//! Every constant here is stated with its source; the same constants serve
//! every model and cluster (no per-row calibration).

use crate::cluster::{Cluster, Link};
use crate::profile::{Bind, ModelProfile, RegionProfile, StackShare, Work};
use crate::sharding::{GemmSplit, Pass, TpCollectiveKind};
use dplc_ir::{
    AttentionKind, AxisComm, CollectiveKind, Compression, Elementwise, GradAccum, GradSync,
    LinkLevel, MeshAxis, Offload, PipelineSchedule, Precision, Recompute, ShardLayout,
    TimeBreakdown, TpOverlap,
};
use std::collections::HashMap;
use std::rc::Rc;

/// NCCL reaches about 80% of the link's line rate: "with the protocol overhead
/// (~20%) NCCL can get an effective NVLink bandwidth of 370GB/s" of 450
/// (S. Jeaugey, NVIDIA/nccl-tests#212); the same holds over InfiniBand.
pub(crate) const NCCL_EFFICIENCY: f64 = 0.8;
/// Streaming kernels reach about 80% of HBM bandwidth (BabelStream-class
/// measurements on A100/H100 land at 80–90% of the datasheet figure).
pub(crate) const MEMORY_EFFICIENCY: f64 = 0.8;
/// Compute runs slower while collectives run beside it: their kernels take
/// SMs and memory bandwidth from the kernels they overlap. Lee et al. 2025
/// ("Characterizing Compute-Communication Overlap in GPU-Accelerated
/// Distributed Deep Learning: Performance and Power Implications",
/// arXiv:2507.03114), training GPT and Llama models on A100, H100, MI250
/// and MI210: "overlapping computation and communication can result in an
/// average computational slowdown of 18.9%, with a maximum of 40.0%",
/// against the same compute with no communication beside it.
const OVERLAP_COMPUTE_SLOWDOWN: f64 = 0.189;

/// What `hidden_s` seconds of communication overlapped with compute add to
/// the step: while they run compute advances at 1/(1 + s) of its pace, so
/// over them it does `hidden_s/(1 + s)` seconds of work and the rest waits.
pub fn overlap_slowdown(hidden_s: f64) -> f64 {
    hidden_s * OVERLAP_COMPUTE_SLOWDOWN / (1.0 + OVERLAP_COMPUTE_SLOWDOWN)
}
/// CUDA kernel launch and framework dispatch, per kernel (a few microseconds).
pub(crate) const KERNEL_OVERHEAD_S: f64 = 4e-6;
/// Megatron keeps fp32 main gradients (`accumulate_allreduce_grads_in_fp32`
/// with bf16) and reduces them in fp32.
pub(crate) const GRAD_BYTES: f64 = 4.0;
/// Optimizer step traffic per parameter, as the stack runs it: AdamW reads
/// the fp32 gradient (4) and reads and writes master weight, m and v (3 × 8);
/// the global gradient norm reads the gradients again (4) and zeroing them
/// for the next step writes them (4) — 36 bytes in fp32, where the master is
/// the weight. Mixed precision also writes the working copy (2); fp16's loss
/// scaling first unscales the gradients and checks them for inf/NaN (one
/// more read and write, 8).
fn optimizer_step_bytes(precision: Precision) -> f64 {
    match precision {
        Precision::Fp32 => 36.0,
        Precision::Bf16 => 38.0,
        Precision::Fp16 => 46.0,
    }
}
/// Accumulating a micro-batch's weight gradient outside its GEMM
/// (`GradAccum::Separate`), per parameter: read the new gradient in the
/// training precision, read and write the fp32 main gradient (4 + 4).
fn separate_accum_bytes(precision: Precision) -> f64 {
    precision.bytes() as f64 + 8.0
}

/// Whether a row of `len` elements of `elt` bytes is a whole number of
/// 16-byte pieces, the alignment a GEMM's fast kernels load (Hopper's
/// tensor memory accelerator needs 16-byte strides).
fn whole_pieces(len: f64, elt: f64) -> bool {
    let per = 16.0 / elt;
    len.fract() == 0.0 && (len / per).fract() == 0.0
}

/// Output tiles cuBLAS uses for large bf16/fp16 GEMMs on sm80/sm90; it picks
/// the one that wastes least (NVIDIA, "Matrix Multiplication Background User's
/// Guide": tile and wave quantization).
const GEMM_TILES: [(f64, f64); 2] = [(256.0, 128.0), (128.0, 128.0)];

/// The fraction of the machine a GEMM with an `m × n` output keeps busy: tiles
/// are rounded up to whole tiles (tile quantization) and run in waves of one
/// tile per multiprocessor (wave quantization).
pub(crate) fn wave_efficiency(m: f64, n: f64, multiprocessors: u64) -> f64 {
    if multiprocessors == 0 || m <= 0.0 || n <= 0.0 {
        return 1.0;
    }
    let sms = multiprocessors as f64;
    GEMM_TILES
        .iter()
        .map(|&(tm, tn)| {
            let tiles = (m / tm).ceil() * (n / tn).ceil();
            let waves = (tiles / sms).ceil();
            (m * n) / (waves * sms * tm * tn)
        })
        .fold(0.0, f64::max)
}

/// The query × key tile a fused attention kernel computes at once, for
/// head dimension 128 (the Llama and Mistral shape): FlashAttention-2 on
/// sm80 runs 128 × 64 (Dao-AILab/flash-attention
/// `csrc/flash_attn/src/flash_fwd_launch_template.h`, `run_mha_fwd_hdim128`),
/// FlashAttention-3 on sm90 128 × 128 when causal or windowed
/// (`hopper/tile_size.h`, `tile_size_fwd_sm90`).
fn fused_tile(kind: AttentionKind) -> (u64, u64) {
    match kind {
        AttentionKind::Flash2 => (128, 64),
        AttentionKind::Fused | AttentionKind::Unfused => (128, 128),
    }
}

/// Key positions, summed over a sequence of `seq` queries, that a fused
/// kernel with `(queries, keys)` tiles computes: each block of queries
/// visits the key tiles from the first its window reaches (from 0 without
/// one) to the one holding its last query (the last key without a causal
/// mask), every visited tile whole.
fn visited_pairs(seq: u64, causal: bool, window: Option<u64>, tile: (u64, u64)) -> f64 {
    let (tq, tk) = (tile.0.max(1), tile.1.max(1));
    let mut pairs = 0.0;
    let mut q0 = 0;
    while q0 < seq {
        let q1 = (q0 + tq).min(seq);
        let begin = window.map_or(0, |w| (q0 + 1).saturating_sub(w) / tk * tk);
        let end = if causal {
            ((q1).div_ceil(tk) * tk).min(seq)
        } else {
            seq
        };
        pairs += (q1 - q0) as f64 * end.saturating_sub(begin) as f64;
        q0 = q1;
    }
    pairs
}

/// The share of the `seq × seq` scores a fused attention kernel's time
/// follows: 1 unmasked, ½ causal (its block matmuls' rates are measured
/// with the causal half counted, FlashAttention's benchmark convention, so
/// the diagonal tiles' waste is inside the rate), and under a sliding
/// window the causal share scaled by the tiles the kernel visits with the
/// window against without it: it skips the key tiles wholly behind the
/// window as it skips those above the diagonal (FlashAttention's local
/// attention, dplc's own kernel: `key_range` in codegen).
pub(crate) fn attended_share(seq: u64, causal: bool, window: Option<u64>, tile: (u64, u64)) -> f64 {
    let base = if causal { 0.5 } else { 1.0 };
    match window {
        Some(w) if w < seq => {
            let all = visited_pairs(seq, causal, None, tile);
            if all <= 0.0 {
                return base;
            }
            base * visited_pairs(seq, causal, Some(w), tile) / all
        }
        _ => base,
    }
}

pub use crate::strategy::AxisOrder;

/// One point of the search space.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub(crate) struct Config {
    pub tp: u64,
    pub cp: u64,
    pub pp: u64,
    pub dp: u64,
    pub ep: u64,
    pub micro_batch: u64,
    pub num_micro_batches: u64,
    pub schedule: PipelineSchedule,
    pub virtual_stages: u64,
    pub zero: u8,
    pub recompute: Recompute,
    /// Under `Recompute::Full`, the layers of each chunk recomputed; 0: every
    /// layer ([`dplc_ir::LayerRecompute`]).
    pub recompute_layers: u64,
    pub sp: bool,
    /// Data-parallel gradient reduction overlapped with the last backward.
    pub overlap: bool,
    pub attention: AttentionKind,
    pub tp_overlap: TpOverlap,
    pub grad_accum: GradAccum,
    pub root: dplc_ir::RootSplit,
    pub order: AxisOrder,
    /// Layers split evenly over the stages (`stages=even`, what Megatron's
    /// and DeepSpeed's pipelines take) instead of balanced by time.
    pub even_stages: bool,
    /// The layers' linear GEMMs in FP8 (`fp8=on`).
    pub fp8: bool,
    /// ZeRO's weight all-gathers move the FP8 casts (`fp8_gather=on`).
    pub fp8_gather: bool,
    /// Layers at each end whose GEMMs stay bf16 under FP8 (`fp8_bf16_ends`).
    pub fp8_bf16_ends: u64,
    /// State kept in host memory (`offload=`).
    pub offload: Offload,
    /// Elementwise ops fused into chains, or one kernel each (`elementwise=eager`).
    pub elementwise: Elementwise,
    /// Where ZeRO-3 keeps what it gathers and reduces (`shards=per_param`: FSDP2's copies).
    pub shards: ShardLayout,
    /// How replicas combine gradients (`sync=`); priced by [`CostModel::dp_reduction`].
    pub sync: GradSync,
    /// What the data-parallel reduction sends (`compress=`).
    pub compress: Compression,
}

impl Config {
    /// What a stage keeps of each layer for its backward.
    pub fn layer_recompute(&self) -> dplc_ir::LayerRecompute {
        dplc_ir::LayerRecompute {
            policy: self.recompute,
            layers: self.recompute_layers,
        }
    }

    /// This configuration with nothing recomputed: what the layers that
    /// partial recomputation keeps cost.
    pub fn keeping_every_layer(&self) -> Config {
        Config {
            recompute: Recompute::None,
            recompute_layers: 0,
            ..*self
        }
    }

    /// Whether ZeRO-3 keeps the stage's gathered weights and whole
    /// gradients through the step (under a pipeline; one all-gather and one
    /// reduce-scatter a step, [`dplc_ir::zero3_holds_the_step`]).
    pub fn holds_the_step(&self) -> bool {
        dplc_ir::zero3_holds_the_step(self.zero, self.pp)
    }

    /// Whether ZeRO-3 gathers each layer's weights as a pass reaches it and
    /// frees them after (FSDP's resharding, every micro-batch).
    pub fn gathers_per_layer(&self) -> bool {
        self.zero >= 3 && !self.holds_the_step()
    }

    /// Whether ZeRO's weight all-gathers move FP8 casts: pinned, with FP8
    /// GEMMs to read them and a sharded stage to gather.
    pub fn gathers_fp8(&self) -> bool {
        self.fp8_gather && self.fp8 && self.zero >= 1
    }

    pub fn axes(&self) -> Vec<(MeshAxis, u64)> {
        let mut v = vec![(MeshAxis::Tp, self.tp), (MeshAxis::Cp, self.cp)];
        match self.order {
            AxisOrder::DataInner => {
                v.push((MeshAxis::Dp, self.dp));
                v.push((MeshAxis::Pp, self.pp));
            }
            AxisOrder::PipelineInner => {
                v.push((MeshAxis::Pp, self.pp));
                v.push((MeshAxis::Dp, self.dp));
            }
        }
        v
    }

    /// `(stride, size)` of an axis in global rank order. The expert axis is the
    /// innermost part of the data-parallel axis.
    pub fn stride_size(&self, axis: MeshAxis) -> (u64, u64) {
        let mut stride = 1;
        for (a, n) in self.axes() {
            if a == axis || (axis == MeshAxis::Ep && a == MeshAxis::Dp) {
                return (stride, if axis == MeshAxis::Ep { self.ep } else { n });
            }
            stride *= n;
        }
        (stride, 1)
    }
}

/// PowerSGD's GEMMs are skinny (`rows × cols` by `cols × R`, R a few):
/// memory-bound, so they reach a small part of the tensor cores' peak.
/// 10% is what a bf16 GEMV-like GEMM of rank ≤ 8 reaches on A100/H100.
pub(crate) const GEMM_EFFICIENCY_SKINNY: f64 = 0.1;

/// What one data-parallel gradient reduction costs ([`CostModel::dp_reduction`]).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub(crate) struct DpReduction {
    /// Seconds on the wire.
    pub wire_s: f64,
    /// Seconds of compression kernels.
    pub compute_s: f64,
    /// Bytes the busiest rank's link carries in one direction.
    pub link_bytes: f64,
}

/// The bandwidth and latency a group of `size` ranks spaced `stride` apart sees.
#[derive(Clone, Copy, Debug)]
pub(crate) struct GroupLink {
    pub size: u64,
    pub level: LinkLevel,
    pub bandwidth: f64,
    pub latency: f64,
}

pub(crate) fn group_link(cluster: &Cluster, stride: u64, size: u64) -> GroupLink {
    let dpn = cluster.devices_per_node;
    if size <= 1 {
        return GroupLink {
            size: 1,
            level: LinkLevel::None,
            bandwidth: f64::INFINITY,
            latency: 0.0,
        };
    }
    let eff = |l: &Link| l.bandwidth * NCCL_EFFICIENCY;
    if stride * size <= dpn {
        GroupLink {
            size,
            level: LinkLevel::IntraNode,
            bandwidth: eff(&cluster.intra_node),
            latency: cluster.intra_node.latency_s,
        }
    } else {
        // Members of the group that share a node send over their own NICs in
        // parallel (NCCL runs one ring per NIC), up to the intra-node rate.
        let per_node = (dpn / stride.max(1)).clamp(1, size) as f64;
        GroupLink {
            size,
            level: LinkLevel::InterNode,
            bandwidth: (eff(&cluster.inter_node) * per_node).min(eff(&cluster.intra_node)),
            latency: cluster.inter_node.latency_s,
        }
    }
}

/// Seconds for one collective of `bytes` (the full tensor) on `link`:
/// alpha–beta cost of the ring, or of a tree when latency dominates.
pub(crate) fn collective_time(kind: CollectiveKind, bytes: f64, link: &GroupLink) -> f64 {
    let n = link.size as f64;
    if link.size <= 1 || bytes <= 0.0 {
        return 0.0;
    }
    let (a, bw) = (link.latency, link.bandwidth);
    match kind {
        CollectiveKind::AllReduce => {
            let ring = 2.0 * (n - 1.0) / n * bytes / bw + 2.0 * (n - 1.0) * a;
            let tree = 2.0 * n.log2().ceil() * a + 2.0 * bytes / bw;
            ring.min(tree)
        }
        CollectiveKind::AllGather | CollectiveKind::ReduceScatter | CollectiveKind::AllToAll => {
            (n - 1.0) / n * bytes / bw + (n - 1.0) * a
        }
        CollectiveKind::SendRecv => bytes / bw + a,
    }
}

/// The part of a tensor-parallel collective taking `t` seconds that stays on
/// the critical path beside GEMMs taking `beside` seconds (forward time of
/// the GEMMs it overlaps; a weight- or input-gradient GEMM takes the same).
///
/// - A column-parallel input gradient (backward): Megatron launches the
///   all-reduce once the input-gradient GEMM is done and computes the weight
///   gradient meanwhile. With sequence parallelism the all-reduce is a
///   reduce-scatter of the input gradient, beside the weight-gradient GEMM,
///   and the all-gather of the output gradient that the row-parallel layer's
///   backward starts with (`_ReduceScatterToSequenceParallelRegion.backward`),
///   half the time each; `async` runs that all-gather synchronously, the
///   userbuffers overlap of `ring` exchanges it beside the row-parallel
///   input-gradient GEMM (priced as one of the GEMMs beside it).
/// - The sequence-parallel re-gather of a column-parallel input (backward,
///   `regather`): launched before the input-gradient GEMM and awaited after
///   it, under `async` and `ring` alike.
/// - With `Ring` the forward all-gathers and row-parallel reductions too: the
///   GEMM is cut into `tp` chunks and each chunk's transfer runs beside the
///   next chunk's compute, leaving the longer of the two plus one chunk.
fn exposed_tp(c: &Config, col: TpExposure, t: f64, beside: f64) -> f64 {
    let TpExposure {
        kind,
        pass,
        regather,
    } = col;
    if beside <= 0.0 || c.tp_overlap == TpOverlap::None || kind == TpCollectiveKind::RowStats {
        return t;
    }
    match pass {
        Pass::Backward if regather => (t - beside).max(0.0),
        Pass::Backward if kind == TpCollectiveKind::AllReduce => {
            if !c.sp {
                (t - beside).max(0.0)
            } else if c.tp_overlap == TpOverlap::Ring {
                2.0 * (t / 2.0 - beside).max(0.0)
            } else {
                (t / 2.0 - beside).max(0.0) + t / 2.0
            }
        }
        Pass::Forward if c.tp_overlap == TpOverlap::Ring => {
            (t - beside).max(0.0) + t.min(beside) / c.tp as f64
        }
        _ => t,
    }
}

/// What decides how much of a tensor-parallel collective overlap can hide.
#[derive(Clone, Copy, Debug)]
struct TpExposure {
    kind: TpCollectiveKind,
    pass: Pass,
    /// The sequence-parallel re-gather of a saved input shard.
    regather: bool,
}

/// Per-micro-batch costs of one layer (or of the embedding / head) on one rank.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct PassCost {
    /// Forward compute, seconds.
    pub forward: f64,
    /// Backward compute, seconds (without recomputation).
    pub backward: f64,
    /// Forward work repeated in backward by recomputation.
    pub recompute: f64,
    /// Exposed tensor/context/expert-parallel communication, seconds, all passes.
    pub comm: f64,
    /// The part of `comm` on the context- and expert-parallel axes (the rest
    /// is tensor-parallel).
    pub cp_comm: f64,
    pub ep_comm: f64,
    /// Tensor-parallel communication hidden behind GEMMs, seconds.
    pub hidden_comm: f64,
    /// Bytes kept for backward per micro-batch.
    pub saved_bytes: f64,
    /// Bytes of the whole activation set of one micro-batch (the transient
    /// working set while a fully recomputed layer runs its backward).
    pub full_saved_bytes: f64,
    /// The largest tensor a sequence-parallel all-gather assembles whole
    /// (Megatron's reused global "mpu" buffer, forward and backward).
    pub gather_buffer_bytes: f64,
    /// The largest one tensor kept for backward (after the loss: the
    /// logits), whose gradient the backward writes beside it.
    pub largest_saved_bytes: f64,
}

impl PassCost {
    pub fn total(&self) -> f64 {
        self.forward + self.backward + self.recompute + self.comm
    }

    /// Add `n` times `o`'s time terms (its memory terms are per part).
    fn add(&mut self, o: &PassCost, n: f64) {
        self.forward += n * o.forward;
        self.backward += n * o.backward;
        self.recompute += n * o.recompute;
        self.comm += n * o.comm;
        self.cp_comm += n * o.cp_comm;
        self.ep_comm += n * o.ep_comm;
        self.hidden_comm += n * o.hidden_comm;
    }
}

/// What the per-micro-batch costs of a layer depend on: tp, cp, ep,
/// micro-batch, sequence parallelism, recomputation, attention kind,
/// tensor-parallel overlap, FP8 and the elementwise kernels — and the expert group's stride, which the rank
/// order and the pipeline degree move (the links of the groups follow).
type LayerKey = (
    (u64, u64, u64),
    u64,
    bool,
    Recompute,
    AttentionKind,
    (TpOverlap, bool, Elementwise),
    u64,
);

/// Evaluates configurations against one model and cluster, memoising layer costs.
pub(crate) struct CostModel<'a> {
    pub profile: &'a ModelProfile,
    pub cluster: &'a Cluster,
    pub seq: u64,
    pub peak_flops: f64,
    /// Fx-hashed: the key is looked up once per configuration evaluated,
    /// and SipHash's keyed rounds were a tenth of a search.
    layer_memo: fxhash::FxHashMap<LayerKey, Rc<Parts>>,
}

/// Which part of the model a cost is for.
#[derive(Clone, Copy)]
enum Part {
    /// One layer of a stack.
    Layer(usize),
    /// The root's nodes before a stack (after the one before it).
    LeadIn(usize),
    Pre,
    Post,
}

/// Per-micro-batch costs of the model's parts under one configuration.
#[derive(Clone, Debug, Default)]
pub(crate) struct Parts {
    /// Per stack: one of its layers, and its lead-in.
    pub stacks: Vec<(PassCost, PassCost)>,
    pub pre: PassCost,
    pub post: PassCost,
}

impl Parts {
    /// The cost of `shares` of the layers: their layers, and the lead-in
    /// of each stack whose first layer they hold.
    fn of(&self, shares: &[StackShare]) -> PassCost {
        let mut s = PassCost::default();
        for sh in shares {
            let (layer, lead_in) = &self.stacks[sh.stack];
            s.add(layer, sh.layers as f64);
            if sh.first {
                s.add(lead_in, 1.0);
            }
        }
        s
    }
}

impl<'a> CostModel<'a> {
    pub fn new(profile: &'a ModelProfile, cluster: &'a Cluster, seq: u64) -> CostModel<'a> {
        CostModel {
            profile,
            cluster,
            seq,
            peak_flops: cluster.device.peak_flops(profile.precision),
            layer_memo: fxhash::FxHashMap::default(),
        }
    }

    fn bind(&self, c: &Config) -> Bind {
        Bind {
            batch_sym: self.profile.batch_sym,
            seq_sym: self.profile.seq_sym,
            micro_batch: c.micro_batch as f64,
            seq: self.seq as f64,
            cp: c.cp as f64,
        }
    }

    pub fn link(&self, c: &Config, axis: MeshAxis) -> GroupLink {
        let (stride, size) = c.stride_size(axis);
        group_link(self.cluster, stride, size)
    }

    /// The ranks holding the same dense weights: the data-parallel replicas
    /// and, within each, the context-parallel ranks (each holds the whole
    /// layer and sees a part of the sequence). Their gradients are reduced,
    /// and ZeRO shards the states, over all `dp × cp` of them (Megatron's
    /// `data_parallel_group_with_cp`, torchtitan's `dp_shard_cp` mesh).
    pub fn replica_link(&self, c: &Config) -> GroupLink {
        if c.cp == 1 {
            return self.link(c, MeshAxis::Dp);
        }
        match c.order {
            // tp, cp, dp: the cp and dp ranks are one strided group.
            AxisOrder::DataInner => group_link(self.cluster, c.tp, c.cp * c.dp),
            // tp, cp, pp, dp: the replicas lie beyond the pipeline; the
            // group runs at the pace of its outer (dp) hops.
            AxisOrder::PipelineInner if c.dp > 1 => GroupLink {
                size: c.cp * c.dp,
                ..self.link(c, MeshAxis::Dp)
            },
            AxisOrder::PipelineInner => self.link(c, MeshAxis::Cp),
        }
    }

    fn gemm_time(&self, m: f64, n: f64, flops: f64, bytes: f64) -> f64 {
        let rate = self.peak_flops * self.cluster.device.matmul_efficiency;
        self.gemm_time_at(rate, m, n, flops, bytes)
    }

    /// A GEMM's time at the sustained tensor-core rate `rate` (the training
    /// precision's, or FP8's).
    fn gemm_time_at(&self, rate: f64, m: f64, n: f64, flops: f64, bytes: f64) -> f64 {
        let dev = &self.cluster.device;
        let waves = wave_efficiency(m, n, dev.multiprocessors);
        let compute = flops / (rate * waves);
        let memory = bytes / (dev.memory_bandwidth * MEMORY_EFFICIENCY);
        compute.max(memory) + KERNEL_OVERHEAD_S
    }

    fn memory_time(&self, bytes: f64) -> f64 {
        bytes / (self.cluster.device.memory_bandwidth * MEMORY_EFFICIENCY) + KERNEL_OVERHEAD_S
    }

    /// Costs of each stack's layer and lead-in, the embedding part and the
    /// head part for `c`.
    pub fn parts(&mut self, c: &Config) -> Rc<Parts> {
        let key = (
            (c.tp, c.cp, c.ep),
            c.micro_batch,
            c.sp,
            c.recompute,
            c.attention,
            (c.tp_overlap, c.fp8, c.elementwise),
            // The tp and cp groups are the innermost axes (their links follow
            // from tp and cp); the expert group is the innermost part of dp,
            // which sits beyond pp when the pipeline is inner.
            if c.ep > 1 {
                c.stride_size(MeshAxis::Ep).0
            } else {
                0
            },
        );
        if let Some(v) = self.layer_memo.get(&key) {
            return v.clone();
        }
        let v = Rc::new(Parts {
            stacks: (0..self.profile.stacks.len())
                .map(|i| {
                    (
                        self.region_cost(c, Part::Layer(i)),
                        self.region_cost(c, Part::LeadIn(i)),
                    )
                })
                .collect(),
            pre: self.region_cost(c, Part::Pre),
            post: self.region_cost(c, Part::Post),
        });
        self.layer_memo.insert(key, v.clone());
        v
    }

    fn region(&self, part: Part) -> &RegionProfile {
        match part {
            Part::Layer(i) => &self.profile.stacks[i].layer,
            Part::LeadIn(i) => &self.profile.stacks[i].lead_in,
            Part::Pre => &self.profile.pre,
            Part::Post => &self.profile.post,
        }
    }

    fn region_cost(&self, c: &Config, part: Part) -> PassCost {
        let r = self.region(part);
        let bind = self.bind(c);
        let tp = c.tp as f64;
        let rep_div = if c.sp { tp } else { 1.0 };
        let elt = self.profile.precision.bytes() as f64;
        let mut pc = PassCost::default();
        let mut core_forward = 0.0;
        let fused = c.attention.is_fused();
        // FP8 covers the layers' linear GEMMs only: the embedding, the output
        // layer and the attention core stay in the training precision, as
        // Transformer Engine's layers run them.
        let fp8 = c.fp8 && matches!(part, Part::Layer(_));
        let fp8_rate = self.cluster.device.peak_fp8 * self.cluster.device.fp8_matmul_efficiency;
        let (mut attention_flops, mut attention_bytes) = (0.0, 0.0);
        // Each GEMM's forward time: what tensor-parallel collectives hide behind.
        let mut gemm_times: HashMap<dplc_ir::NodeId, f64> = HashMap::new();
        // Op-level checkpointing (torchtitan's `op`): the forward it redoes,
        // the GEMM outputs and the attention output it keeps instead.
        let (mut weight_gemms, mut op_recompute, mut op_saved) = (0u32, 0.0, 0.0);
        let whole_bind = Bind { cp: 1.0, ..bind };
        for op in &r.ops {
            // What every cp rank runs on the whole sequence costs it whole.
            let bind = if op.whole_sequence { whole_bind } else { bind };
            if fused && op.attention_core {
                // One fused kernel does the core: its two matmuls' work, and
                // traffic of Q, K, V and the output only; the scale, mask,
                // softmax and dropout happen in registers.
                if let Work::Gemm { m, n, k, split, .. } = &op.work {
                    let div = if *split == GemmSplit::Replicated {
                        1.0
                    } else {
                        tp
                    };
                    let (m, n, k) = bind.eval_gemm(m, n, k);
                    attention_flops += 2.0 * m * n * k / div;
                    // Q·Kᵀ reads Q and K, P·V reads V and writes O: each of
                    // them rows × head width, the smaller of the two sides.
                    attention_bytes += 2.0 * m * n.min(k) * elt / div;
                    if n <= k {
                        // P·V: its output is the kernel's, which op-level
                        // checkpointing keeps.
                        op_saved += m * n * elt / div;
                    }
                }
                continue;
            }
            // Op-level checkpointing keeps the output of every other weight
            // GEMM (the 1st, 3rd, …: torchtitan counts `mm`s and saves all
            // but every second one) and recomputes everything else.
            let mut kept_by_op = false;
            if let Work::Gemm { m, n, split, .. } = &op.work {
                if !op.attention_core {
                    weight_gemms += 1;
                    if weight_gemms % 2 == 1 {
                        kept_by_op = true;
                        // The output as the GEMM writes it: a column (or
                        // batch) split writes its shard, a row split the
                        // whole partial sum.
                        let out_div = match split {
                            GemmSplit::Column | GemmSplit::Batch => tp,
                            GemmSplit::Row | GemmSplit::Replicated => 1.0,
                        };
                        op_saved += bind.eval(m) * bind.eval(n) * elt / out_div;
                    }
                }
            }
            let (fwd, bwd) = match &op.work {
                Work::Gemm {
                    m,
                    n,
                    k,
                    split,
                    backward_gemms,
                } => {
                    let div = if *split == GemmSplit::Replicated {
                        1.0
                    } else {
                        tp
                    };
                    let (m, n, k) = bind.eval_gemm(m, n, k);
                    let flops = 2.0 * m * n * k / div;
                    // The output tile grid each rank computes: column and batch
                    // splits narrow `n` or the batch (in `m`); a row split narrows `k`.
                    let (mt, nt) = match split {
                        GemmSplit::Column => (m, n / tp),
                        GemmSplit::Batch => (m / tp, n),
                        GemmSplit::Row | GemmSplit::Replicated => (m, n),
                    };
                    if fp8 && !op.attention_core {
                        // Transformer Engine: the operands cast to FP8 (one
                        // byte), the GEMMs at the FP8 rate, forward and both
                        // backward ones. Each cast reads the bf16 tensor and
                        // writes the FP8 one, its amax taken on the way: the
                        // input in forward; in backward the output gradient,
                        // once more transposed for the weight gradient.
                        let bytes = (m * k + k * n) / div + m * n * elt / div;
                        let t = self.gemm_time_at(fp8_rate, mt, nt, flops, bytes);
                        let cast_in = self.memory_time(m * k * (elt + 1.0) / div);
                        let cast_grad = self.memory_time(m * n * (elt + 2.0) / div);
                        gemm_times.insert(op.node, t);
                        (t + cast_in, t * *backward_gemms as f64 + cast_grad)
                    } else {
                        let bytes = (m * k + k * n + m * n) * elt / div;
                        // The rows each rank's GEMMs read and write: `n`
                        // (output, B) and `k` (A), as split.
                        let kt = if *split == GemmSplit::Row { k / tp } else { k };
                        let t = if c.elementwise == Elementwise::Eager
                            && !(whole_pieces(nt, elt) && whole_pieces(kt, elt))
                        {
                            // Nothing pads it: the unaligned kernels' rate.
                            let dev = &self.cluster.device;
                            let rate = self.peak_flops * dev.unaligned_matmul_efficiency;
                            self.gemm_time_at(rate, mt, nt, flops, bytes)
                        } else {
                            self.gemm_time(mt, nt, flops, bytes)
                        };
                        gemm_times.insert(op.node, t);
                        (t, t * *backward_gemms as f64)
                    }
                }
                Work::Memory {
                    sharded,
                    replicated,
                    eager,
                } => {
                    // Fused, a chain moves only what enters and leaves it;
                    // eager, every op is a kernel moving all its operands
                    // (an op inside a fused chain moves nothing of its own).
                    let (sharded, replicated) = match c.elementwise {
                        Elementwise::Fused => (sharded, replicated),
                        Elementwise::Eager => (&eager.sharded, &eager.replicated),
                    };
                    if sharded.is_zero() && replicated.is_zero() {
                        continue;
                    }
                    let whole_div = if op.experts { 1.0 } else { rep_div };
                    let bytes = bind.eval(sharded) / tp + bind.eval(replicated) / whole_div;
                    // Backward reads the output gradient and the saved inputs and
                    // writes the input gradient: about twice the forward traffic.
                    let t = self.memory_time(bytes);
                    (t, 2.0 * t)
                }
            };
            pc.forward += fwd;
            pc.backward += bwd;
            if op.attention_core {
                core_forward += fwd;
            }
            if !kept_by_op {
                op_recompute += fwd;
            }
        }
        // Selective recomputation redoes the unfused core; a fused kernel
        // keeps no core tensor to drop, and recomputes inside its backward.
        let mut selective = core_forward;
        if attention_flops > 0.0 {
            let dev = &self.cluster.device;
            let causal = attended_share(self.seq, r.causal, r.window, fused_tile(c.attention));
            let (forward, backward) = match c.attention {
                AttentionKind::Flash2 => (dev.flash2_efficiency, dev.flash2_backward_efficiency),
                AttentionKind::Fused => (
                    dev.fused_attention_efficiency,
                    dev.fused_attention_backward_efficiency,
                ),
                AttentionKind::Unfused => (dev.matmul_efficiency, dev.matmul_efficiency),
            };
            let pass = |efficiency: f64| {
                (causal * attention_flops / (self.peak_flops * efficiency))
                    .max(attention_bytes / (dev.memory_bandwidth * MEMORY_EFFICIENCY))
                    + KERNEL_OVERHEAD_S
            };
            let t = pass(forward);
            pc.forward += t;
            // The backward's block matmuls: Q·Kᵀ again, dV, dP, dQ and dK —
            // five to the forward's two, at the backward kernel's own rate.
            pc.backward += 2.5 * pass(backward);
            selective = 0.0;
        }
        let layer = matches!(part, Part::Layer(_));
        pc.recompute = match (c.recompute, layer) {
            (Recompute::Selective, true) => selective,
            (Recompute::Full, true) => pc.forward,
            (Recompute::Op, true) => op_recompute,
            _ => 0.0,
        };
        // Tensor-parallel collectives are on the critical path except where
        // `c.tp_overlap` hides them behind GEMMs (see `exposed_tp`);
        // recomputing the forward repeats the forward ones.
        let tp_link = self.link(c, MeshAxis::Tp);
        for col in &r.collectives {
            if col.sequence_parallel_only && !c.sp {
                continue;
            }
            let bytes = bind.eval(&col.bytes);
            if c.sp && c.tp > 1 && col.sequence_parallel_only {
                pc.gather_buffer_bytes = pc.gather_buffer_bytes.max(bytes);
            }
            let kind = match col.kind {
                TpCollectiveKind::AllReduce | TpCollectiveKind::RowStats => {
                    CollectiveKind::AllReduce
                }
                TpCollectiveKind::AllGather => CollectiveKind::AllGather,
            };
            let beside: f64 = col.beside.iter().filter_map(|n| gemm_times.get(n)).sum();
            let whole = collective_time(kind, bytes, &tp_link);
            let exposure = TpExposure {
                kind: col.kind,
                pass: col.pass,
                regather: col.sequence_parallel_only,
            };
            let t = exposed_tp(c, exposure, whole, beside);
            // Op-level checkpointing keeps the row-parallel reductions'
            // outputs (torchtitan saves `reduce_scatter`) and redoes the
            // gathers feeding the GEMMs it recomputes.
            let recomputed = match c.recompute {
                Recompute::Full => true,
                Recompute::Op => col.kind == TpCollectiveKind::AllGather,
                Recompute::None | Recompute::Selective => false,
            };
            let repeats = if col.pass == Pass::Forward && layer && recomputed {
                2.0
            } else {
                1.0
            };
            pc.comm += t * repeats;
            pc.hidden_comm += (whole - t) * repeats;
        }
        // Context parallelism: what the rank's program all-gathers along the
        // sequence in forward (K and V, above all), the gradients of those
        // with one reduce-scattered in backward, all exposed: the runtime
        // gathers K and V before the score matmul and waits, and the
        // attention that follows needs every key (a ring that overlaps
        // blocks of keys with the attention over the previous ones is not
        // what it runs).
        if c.cp > 1 {
            let cp_link = self.link(c, MeshAxis::Cp);
            let (gathered, scattered) = r.cp_traffic(&bind, tp);
            // A layer run again under full recomputation gathers again.
            let again = if layer && c.recompute == Recompute::Full {
                2.0
            } else {
                1.0
            };
            let t = again * collective_time(CollectiveKind::AllGather, gathered, &cp_link)
                + collective_time(CollectiveKind::ReduceScatter, scattered, &cp_link);
            pc.comm += t;
            pc.cp_comm += t;
        }
        if c.ep > 1 {
            let ep_link = self.link(c, MeshAxis::Ep);
            let bytes = bind.eval(&r.all_to_all_bytes) / rep_div;
            // Dispatch and combine in forward, their transposes in backward.
            let t = 2.0 * collective_time(CollectiveKind::AllToAll, bytes, &ep_link);
            pc.comm += t;
            pc.ep_comm += t;
        }
        let mut largest_core = 0.0f64;
        for s in &r.saved {
            let b = bind.eval(&s.bytes)
                / match (s.sharded, s.experts) {
                    (true, _) => tp,
                    (false, true) => 1.0,
                    (false, false) => rep_div,
                };
            if fused && s.attention_core {
                largest_core = largest_core.max(b);
                continue;
            }
            // A linear layer's input is kept as the FP8 copy its GEMM read.
            let b = if fp8 && s.gemm_input { b / elt } else { b };
            pc.full_saved_bytes += b;
            pc.largest_saved_bytes = pc.largest_saved_bytes.max(b);
            if !(c.recompute == Recompute::Selective && s.attention_core) {
                pc.saved_bytes += b;
            }
        }
        // A fused kernel keeps the fp32 log-sum-exp of each score row: the
        // scores' elements over the key length.
        let lse = largest_core / self.seq.max(1) as f64 * (4.0 / elt);
        pc.full_saved_bytes += lse;
        pc.saved_bytes += lse;
        if let Part::Layer(i) = part {
            let input = bind.eval(&self.profile.stacks[i].carried_bytes) / rep_div;
            match c.recompute {
                Recompute::Full => pc.saved_bytes = input,
                Recompute::Op => pc.saved_bytes = input + op_saved + lse,
                Recompute::None | Recompute::Selective => {}
            }
        }
        pc
    }

    /// Parameters on one rank of stage `i` running `shares` of the layers:
    /// `(all, expert)` elements.
    pub(crate) fn stage_params(&self, c: &Config, i: u64, shares: &[StackShare]) -> (f64, f64) {
        let prof = self.profile;
        let (tp, ep) = (c.tp as f64, c.ep as f64);
        let (mut all, mut expert) = (0.0, 0.0);
        for sh in shares {
            let params = &prof.stacks[sh.stack].layer.params;
            all += sh.layers as f64 * params.per_rank(tp, ep);
            expert += sh.layers as f64 * params.expert_per_rank(tp, ep);
        }
        if i == 0 {
            all += prof.pre.params.per_rank(tp, ep);
        }
        if i == c.pp - 1 && (c.pp > 1 || i != 0 || prof.pre.params.total() == 0.0) {
            all += prof.post.params.per_rank(tp, ep);
        } else if i == c.pp - 1 {
            // One stage holds both ends: a tied embedding is stored once.
            all += prof.post.params.per_rank(tp, ep) - prof.tied_params.per_rank(tp, ep);
        }
        (all, expert)
    }

    /// The layers' dense (non-expert) parameters on one rank running
    /// `shares`: the weights FP8 GEMMs read (norm gains among them, a
    /// negligible share).
    pub(crate) fn layer_dense_params(&self, c: &Config, shares: &[StackShare]) -> f64 {
        let (tp, ep) = (c.tp as f64, c.ep as f64);
        shares
            .iter()
            .map(|sh| {
                let p = &self.profile.stacks[sh.stack].layer.params;
                sh.layers as f64 * (p.per_rank(tp, ep) - p.expert_per_rank(tp, ep))
            })
            .sum()
    }

    /// Bytes of `dense` gathered weights of which `layer` are the layers':
    /// those one byte each when the gathers move FP8 casts
    /// ([`Config::gathers_fp8`]; the embedding and the output layer stay in
    /// the training precision, as their GEMMs do), all in the training
    /// precision otherwise.
    pub(crate) fn gathered_weight_bytes(&self, c: &Config, dense: f64, layer: f64) -> f64 {
        let w = self.profile.precision.bytes() as f64;
        if c.gathers_fp8() {
            (dense - layer) * w + layer
        } else {
            dense * w
        }
    }

    /// The largest of `f` over the stacks `shares` run layers of.
    pub(crate) fn largest(shares: &[StackShare], f: impl Fn(usize) -> f64) -> f64 {
        shares.iter().map(|sh| f(sh.stack)).fold(0.0, f64::max)
    }

    /// What FP8's bf16 end layers (`fp8_bf16_ends`) add to stage `i`'s
    /// pass: the first stage's first layers and the last stage's last run
    /// their GEMMs at the bf16 rate instead of FP8's. (The FP8 casts those
    /// layers do not keep, a byte or two a weight of a few layers, stay in
    /// the memory.)
    pub(crate) fn bf16_ends(&mut self, c: &Config, counts: &[u64], i: usize) -> PassCost {
        let mut extra = PassCost::default();
        let ends = c.fp8_bf16_ends as f64;
        let (first, last) = (i == 0, i as u64 + 1 == c.pp);
        if !c.fp8 || ends == 0.0 || !(first || last) {
            return extra;
        }
        let fp8 = self.parts(c);
        let bf16 = self.parts(&Config { fp8: false, ..*c });
        let stacks = self.profile.stacks.len();
        // Never more than the stage holds.
        let held = counts.get(i).copied().unwrap_or(0) as f64;
        for (at_end, stack) in [(first, 0), (last, stacks - 1)] {
            if at_end {
                let n = ends.min(held);
                extra.add(&bf16.stacks[stack].0, n);
                extra.add(&fp8.stacks[stack].0, -n);
            }
        }
        extra
    }

    /// The work of stage `i`'s layers (and lead-ins) for one micro-batch:
    /// under partial recomputation the layers it recomputes at the cost of
    /// full recomputation, the others at the cost of none.
    pub(crate) fn layers_pass(&mut self, c: &Config, counts: &[u64], i: usize) -> PassCost {
        let (rerun, kept) = self.recompute_split(c, counts, i);
        let mut s = self.parts(c).of(&rerun);
        if !kept.is_empty() {
            s.add(&self.parts(&c.keeping_every_layer()).of(&kept), 1.0);
        }
        s
    }

    /// The work of one micro-batch on stage `i` (all its chunks) holding `counts[i]` layers.
    pub fn stage_pass(&mut self, c: &Config, counts: &[u64], i: usize) -> PassCost {
        let parts = self.parts(c);
        let shares = self.stage_shares(c, counts, i);
        let mut s = if c.layer_recompute().is_partial() {
            self.layers_pass(c, counts, i)
        } else {
            parts.of(&shares)
        };
        if i == 0 {
            s.add(&parts.pre, 1.0);
        }
        if i as u64 == c.pp - 1 {
            s.add(&parts.post, 1.0);
        }
        s.add(&self.bf16_ends(c, counts, i), 1.0);
        let bandwidth = self.cluster.device.memory_bandwidth * MEMORY_EFFICIENCY;
        if c.grad_accum == GradAccum::Separate {
            // A memory-bound pass over the stage's weight gradients after
            // each micro-batch's backward.
            let (params, _) = self.stage_params(c, i as u64, &shares);
            s.backward += params * separate_accum_bytes(self.profile.precision) / bandwidth;
        }
        if c.zero >= 3 && c.shards == ShardLayout::PerParam {
            // FSDP2 (pytorch/pytorch torch/distributed/fsdp/_fully_shard/
            // _fsdp_collectives.py @ 010ae4a89516fa3be548ab16dff711414ec12d0b):
            // on the compute stream, `foreach_all_gather_copy_out` copies
            // each all-gather's output into the parameters
            // (`split_with_sizes_copy`: read and write the gathered weights),
            // in forward and again in backward, and `foreach_reduce` copies
            // the gradients into the reduce-scatter's input cast to the
            // reduction's precision (`_chunk_cat`: read the gradient, write
            // it as the fp32 one the reduce-scatter sends).
            let (params, expert) = self.stage_params(c, i as u64, &shares);
            let dense = params - expert;
            let (w, grad) = match self.profile.precision {
                Precision::Fp32 => (4.0, 4.0),
                p => (p.bytes() as f64, GRAD_BYTES),
            };
            let layer = self.layer_dense_params(c, &shares);
            let gathered = self.gathered_weight_bytes(c, dense, layer);
            s.forward += 2.0 * gathered / bandwidth;
            s.backward += (2.0 * gathered + dense * (w + grad)) / bandwidth;
        }
        if c.zero >= 3 && c.gathers_fp8() {
            // torchao's `WeightWithDynamicFloat8CastTensor.fsdp_pre_all_gather`
            // (pytorch/ao torchao/float8/fsdp_utils.py): before each gather,
            // forward and backward, the rank casts its fp32 shard of each
            // layer weight to FP8 with the scale computed once a step (read
            // 4 bytes, write 1).
            let shard = self.layer_dense_params(c, &shares) / (c.dp * c.cp) as f64;
            s.forward += shard * 5.0 / bandwidth;
            s.backward += shard * 5.0 / bandwidth;
        }
        s
    }

    /// The one place a data-parallel gradient reduction is priced: `params`
    /// gradients of `grad_bytes` each over `link`, as `c.sync` combines
    /// them and `c.compress` shrinks them.
    ///
    /// - all-reduce: the ring (or tree), `2(n−1)/n` of the bytes on each
    ///   rank's link; ZeRO ≥ 1 reduce-scatters, `(n−1)/n`;
    /// - bf16/fp16: the same collective on 2-byte elements, plus a cast
    ///   pass each way (read 4 write 2, read 2 write 4 bytes per element);
    /// - PowerSGD rank R: two all-reduces of the factors, `R·(rows + cols)`
    ///   per compressed matrix instead of `rows·cols` (vectors, and
    ///   matrices the factors would not halve, uncompressed:
    ///   `dplc_ir::powersgd_factors`), plus its GEMMs (`M·Q` and `Mᵀ·P`,
    ///   4·R flops per element) and four passes over the fp32 gradient and
    ///   error (add, two GEMM reads, error write);
    /// - top-k fraction F: an all-gather of every rank's `F·matrix params`
    ///   (index, value) pairs, 8 bytes each — each link carries `(n−1)·k·8`
    ///   — plus a ring all-reduce of the vectors, and four memory passes
    ///   (error add, selection, error write, scatter-add of the `n·k`
    ///   received pairs);
    ///
    /// A compression's warm-up steps (plain or denser) are not priced: the
    /// estimate is the steady state.
    /// - parameter server with N shards on the first N workers: each server
    ///   receives `(n−1)/N` of every worker's gradient and sends as many
    ///   weights back, on top of its own worker's push, so its link carries
    ///   `max(1, (n+N−2)/N)` × the gradient bytes each way: N = n is the
    ///   ring's `2(n−1)/n` (BytePS), N = 1 is `n−1` (the bottleneck at the
    ///   server). On N dedicated server ranks (`ps_ranks=dedicated`, each
    ///   with a link of the data-parallel group's kind) a server carries
    ///   `n/N` × the gradient each way and a worker 1×: `max(1, n/N)`, half
    ///   the ring's bytes at N = n — what BytePS's extra machines buy.
    ///   Async costs the same bytes; `step_time` hides them behind the next
    ///   step instead of waiting at a barrier.
    pub(crate) fn dp_reduction(
        &self,
        c: &Config,
        params: f64,
        grad_bytes: f64,
        link: &GroupLink,
    ) -> DpReduction {
        let n = link.size as f64;
        if link.size <= 1 || params <= 0.0 {
            return DpReduction::default();
        }
        let bytes = params * grad_bytes;
        let mem = |b: f64| b / (self.cluster.device.memory_bandwidth * MEMORY_EFFICIENCY);
        if let Some(shards) = c.sync.ps_shards() {
            let link_bytes = if c.sync.dedicated_servers() > 0 {
                // A server takes 1/N of each of the n workers' gradients in
                // and sends as many weights out; a worker pushes its whole
                // gradient and pulls the whole weights: the busier of the two.
                bytes * (n / (shards as f64).max(1.0)).max(1.0)
            } else {
                let shards = (shards as f64).clamp(1.0, n);
                bytes * ((n + shards - 2.0) / shards).max(1.0)
            };
            return DpReduction {
                wire_s: link_bytes / link.bandwidth + 2.0 * link.latency,
                compute_s: 0.0,
                link_bytes,
            };
        }
        if c.zero >= 1 {
            return DpReduction {
                wire_s: collective_time(CollectiveKind::ReduceScatter, bytes, link),
                compute_s: 0.0,
                link_bytes: (n - 1.0) / n * bytes,
            };
        }
        let all_reduce = |b: f64, compute_s: f64| DpReduction {
            wire_s: collective_time(CollectiveKind::AllReduce, b, link),
            compute_s,
            link_bytes: 2.0 * (n - 1.0) / n * b,
        };
        match c.compress {
            Compression::None => all_reduce(bytes, 0.0),
            Compression::Bf16 | Compression::Fp16 => {
                all_reduce(params * 2.0, mem(params * 12.0) + 2.0 * KERNEL_OVERHEAD_S)
            }
            Compression::PowerSgd { rank, .. } => {
                let (compressed, factors) = self.profile.powersgd_shares(rank);
                let sent = params * ((1.0 - compressed) + compressed * factors);
                let flops = 4.0 * rank as f64 * params * compressed;
                let gemm = flops
                    / (self.cluster.device.peak_flops(self.profile.precision)
                        * GEMM_EFFICIENCY_SKINNY);
                all_reduce(
                    sent * 4.0,
                    gemm + mem(params * 16.0) + 4.0 * KERNEL_OVERHEAD_S,
                )
            }
            Compression::TopK { per_million, .. } => {
                let sparse = params * self.profile.matrix_share();
                let k = sparse * per_million as f64 / 1e6;
                let gathered = n * k * 8.0;
                let vectors = all_reduce((params - sparse) * 4.0, 0.0);
                DpReduction {
                    wire_s: collective_time(CollectiveKind::AllGather, gathered, link)
                        + vectors.wire_s,
                    compute_s: mem(sparse * 16.0 + n * k * 12.0) + 4.0 * KERNEL_OVERHEAD_S,
                    link_bytes: (n - 1.0) * k * 8.0 + vectors.link_bytes,
                }
            }
        }
    }

    /// Bytes one rank sends across a pipeline cut per micro-batch: what
    /// crosses a cut inside the stack that moves the most (sequence-sharded
    /// under sequence parallelism).
    pub(crate) fn boundary_bytes(&self, c: &Config) -> f64 {
        let bind = self.bind(c);
        let rep_div = if c.sp { c.tp as f64 } else { 1.0 };
        self.profile
            .stacks
            .iter()
            .map(|st| bind.eval(&st.input_bytes))
            .fold(0.0, f64::max)
            / rep_div
    }

    /// Step time of `c` with stages holding `counts` layers.
    pub fn step_time(&mut self, c: &Config, counts: &[u64]) -> TimeBreakdown {
        let (p, m, v) = (c.pp, c.num_micro_batches as f64, c.virtual_stages as f64);
        let stages: Vec<PassCost> = (0..p as usize)
            .map(|i| self.stage_pass(c, counts, i))
            .collect();
        let slowest = stages
            .iter()
            .copied()
            .max_by(|a, b| a.total().total_cmp(&b.total()))
            .expect("at least one stage");
        let boundary = self.boundary_bytes(c);
        let pp_link = self.link(c, MeshAxis::Pp);
        // Megatron's scatter/gather optimisation sends 1/tp of the boundary
        // tensor per rank when it is not already sequence-sharded, and the
        // receiver all-gathers the pieces over the tensor-parallel group
        // before the stage can start (`gather_split_1d_tensor`).
        let hop = if c.sp || c.tp == 1 {
            collective_time(CollectiveKind::SendRecv, boundary, &pp_link)
        } else {
            collective_time(CollectiveKind::SendRecv, boundary / c.tp as f64, &pp_link)
                + collective_time(
                    CollectiveKind::AllGather,
                    boundary,
                    &self.link(c, MeshAxis::Tp),
                )
        };
        // 1F1B blocks on two hops per micro-batch (activation forward,
        // gradient back), plus the p − 1 of the fill.
        let p2p = if p > 1 {
            2.0 * hop * (m * v + p as f64 - 1.0)
        } else {
            0.0
        };

        // Data-parallel gradient reduction, started bucket by bucket as the last
        // micro-batch's backward produces gradients (the last bucket is
        // exposed), or wholly after backward when not overlapped.
        let shares0 = self.stage_shares(c, counts, 0);
        let (params, expert) = self.stage_params(c, 0, &shares0);
        let dense = params - expert;
        let dp_link = self.replica_link(c);
        let replicas = (c.dp * c.cp) as f64;
        let edp = (c.dp / c.ep).max(1);
        let (edp_stride, _) = c.stride_size(MeshAxis::Dp);
        let edp_link = group_link(self.cluster, edp_stride * c.ep, edp);
        let grad_bytes = if self.profile.precision == Precision::Fp32 {
            4.0
        } else {
            GRAD_BYTES
        };
        let w_bytes = self.profile.precision.bytes() as f64;
        let dense_cut = self.dp_reduction(c, dense, grad_bytes, &dp_link);
        let layer_dense = self.layer_dense_params(c, &shares0);
        let gathered_bytes = self.gathered_weight_bytes(c, dense, layer_dense);
        let expert_cut = self.dp_reduction(c, expert, grad_bytes, &edp_link);
        let dense_reduce = dense_cut.wire_s;
        let expert_reduce = expert_cut.wire_s;
        let dp_reduce = dense_reduce + expert_reduce;
        // Compression's own kernels (casts, factor GEMMs, top-k selection)
        // run once the gradients are whole, on the critical path.
        let compress_s = dense_cut.compute_s + expert_cut.compute_s;
        let layers0 = counts[0].max(1) as f64;
        let hidden = if c.sync.staleness() > 0 {
            // No barrier: the push and pull of step t run while the worker
            // computes step t + 1 on weights one version old, so the whole
            // step's compute hides them.
            m * (stages[0].forward + stages[0].backward + stages[0].recompute)
        } else if c.overlap {
            (stages[0].backward + stages[0].recompute) * (1.0 - 1.0 / layers0)
        } else {
            0.0
        };
        let (mut exposed_dp, mut whole_dp) = if c.holds_the_step() {
            // Held through the step: the weights are gathered once, layer by
            // layer ahead of the first micro-batch's forward (the first
            // waits), and the whole gradients reduce-scattered once after
            // the last backward, with no compute left to hide them behind.
            let l = layers0;
            let gather = collective_time(CollectiveKind::AllGather, gathered_bytes, &dp_link);
            let (g, f) = (gather / l, stages[0].forward / l);
            (
                g + (l - 1.0) * (g - f).max(0.0) + dp_reduce,
                gather + dp_reduce,
            )
        } else if c.zero >= 3 {
            // ZeRO-3 (FSDP) works layer by layer, every micro-batch: the
            // forward gathers a layer's weights while the layer before it
            // computes (the first gather waits), the backward gathers them
            // again and reduce-scatters the gradients, one after the other
            // on the same link, beside the layer's backward (the last
            // reduce-scatter waits; without overlap all of them do). The
            // expert gradients reduce as under ZeRO-2.
            let l = layers0;
            let gather = collective_time(CollectiveKind::AllGather, gathered_bytes, &dp_link);
            let (g, r) = (gather / l, dense_reduce / l);
            let f = stages[0].forward / l;
            let b = (stages[0].backward + stages[0].recompute) / l;
            let forward = g + (l - 1.0) * (g - f).max(0.0);
            let backward = if c.overlap {
                (l - 1.0) * (g + r - b).max(0.0) + r
            } else {
                (l - 1.0) * (g - b).max(0.0) + l * r
            };
            (
                m * (forward + backward + (expert_reduce - hidden).max(0.0)),
                m * (2.0 * gather + dp_reduce),
            )
        } else if c.zero >= 2 {
            // ZeRO-2 reduce-scatters every micro-batch's gradients during its backward.
            (m * (dp_reduce - hidden).max(0.0), m * dp_reduce)
        } else {
            ((dp_reduce - hidden).max(0.0), dp_reduce)
        };
        exposed_dp += compress_s;
        whole_dp += compress_s;
        if c.zero >= 1 {
            // The updated shards are all-gathered, overlapped with the next
            // forward (ZeRO-3 gathers its dense weights per layer instead).
            let dense_gather = if c.zero >= 3 {
                0.0
            } else {
                collective_time(CollectiveKind::AllGather, gathered_bytes, &dp_link)
            };
            let gather = dense_gather
                + collective_time(CollectiveKind::AllGather, expert * w_bytes, &edp_link);
            exposed_dp += (gather - stages[0].forward).max(0.0);
            whole_dp += gather;
        }
        let opt_params = if c.zero >= 1 {
            dense / replicas + expert / edp as f64
        } else {
            params
        };
        let dev = &self.cluster.device;
        let mut offload = 0.0;
        let mut offload_bytes = 0.0;
        let mut optimizer = if c.offload.optimizer {
            // The gradient shard goes down as its backward finishes (hidden
            // behind it but for the last bucket), the CPU steps at the host's
            // memory bandwidth (reading the fp32 gradients too), the updated
            // weights come back up.
            let link = dev.host_link_bandwidth * MEMORY_EFFICIENCY;
            let down = opt_params * w_bytes / link;
            let up = opt_params * w_bytes / link;
            offload_bytes += 2.0 * opt_params * w_bytes;
            offload += (down - stages[0].backward * (1.0 - 1.0 / layers0)).max(down / layers0) + up;
            opt_params * (optimizer_step_bytes(self.profile.precision) + 4.0)
                / (dev.host_memory_bandwidth * MEMORY_EFFICIENCY)
        } else {
            opt_params * optimizer_step_bytes(self.profile.precision)
                / (dev.memory_bandwidth * MEMORY_EFFICIENCY)
        };
        if c.offload.params || c.offload.activations {
            // Per micro-batch, the stage's weight shards come up for forward
            // and again for backward, and its saved activations go down in
            // forward and up in backward, each behind that pass's compute.
            let link = dev.host_link_bandwidth * MEMORY_EFFICIENCY;
            let (fwd, bwd) = (slowest.forward, slowest.backward + slowest.recompute);
            let weights = if c.offload.params {
                params / replicas * w_bytes
            } else {
                0.0
            };
            let acts = if c.offload.activations {
                let parts = self.parts(c);
                shares0
                    .iter()
                    .map(|sh| sh.layers as f64 * parts.stacks[sh.stack].0.saved_bytes)
                    .sum()
            } else {
                0.0
            };
            offload_bytes += m * 2.0 * (weights + acts);
            let (weights, acts) = (weights / link, acts / link);
            offload += m * ((weights + acts - fwd).max(0.0) + (weights + acts - bwd).max(0.0));
        }
        if c.gathers_fp8() {
            // The scales once a step from the updated shards' amax (torchao's
            // `precompute_float8_dynamic_scale_for_fsdp`: a `_foreach_norm`
            // over the fp32 shards and one all-reduce of the amaxes); ZeRO-1
            // and -2 cast the shard once, for the one gather (ZeRO-3 casts
            // before every gather: `stage_pass`).
            let shard = layer_dense / replicas;
            let cast = if c.zero >= 3 { 0.0 } else { 5.0 };
            optimizer +=
                shard * (4.0 + cast) / (self.cluster.device.memory_bandwidth * MEMORY_EFFICIENCY);
        } else if c.fp8 {
            // The updated weights cast to FP8 once a step (Transformer Engine
            // keeps the cast for every micro-batch): read, write it and its
            // transpose, the amax on the way.
            let layer_params: f64 = shares0
                .iter()
                .map(|sh| {
                    sh.layers as f64
                        * self.profile.stacks[sh.stack]
                            .layer
                            .params
                            .per_rank(c.tp as f64, c.ep as f64)
                })
                .sum();
            optimizer += layer_params * (w_bytes + 2.0)
                / (self.cluster.device.memory_bandwidth * MEMORY_EFFICIENCY);
        }

        let tp_comm = slowest.comm - slowest.cp_comm - slowest.ep_comm;
        let comm_by_axis = [
            (MeshAxis::Tp, c.tp, m * tp_comm, m * slowest.hidden_comm),
            (MeshAxis::Cp, c.cp, m * slowest.cp_comm, 0.0),
            (MeshAxis::Ep, c.ep, m * slowest.ep_comm, 0.0),
            (MeshAxis::Pp, c.pp, p2p, 0.0),
            (
                MeshAxis::Dp,
                c.dp * c.cp,
                exposed_dp,
                (whole_dp - exposed_dp).max(0.0),
            ),
        ]
        .into_iter()
        .filter(|&(_, size, exposed, hidden)| size > 1 && exposed + hidden > 0.0)
        .map(|(axis, _, exposed_s, hidden_s)| AxisComm {
            axis,
            exposed_s,
            hidden_s,
        })
        .collect::<Vec<_>>();
        let overlap_slowdown = overlap_slowdown(comm_by_axis.iter().map(|a| a.hidden_s).sum());
        // Every stage runs at the slowest stage's pace, so fill and drain cost
        // p − 1 slots of it (of 1/v of it under interleaving): the bubble
        // (p − 1)/(v·m) of Narayanan et al. 2021, and exactly the makespan of
        // the schedule `timeline` lays out. A slot is a micro-batch's pass
        // with its share of the overlap slowdown.
        // Under interleaving a slot is a chunk's time: a stage whose layers
        // do not split evenly over its chunks is paced by its largest chunk.
        let stretch = overlap_slowdown / m;
        let bubble = (p - 1) as f64
            * stages
                .iter()
                .zip(counts)
                .map(|(s, &n)| {
                    let chunks = c.virtual_stages.max(1);
                    let slot = s.total() + stretch;
                    if n.is_multiple_of(chunks) {
                        slot / v
                    } else {
                        slot * n.div_ceil(chunks) as f64 / n as f64
                    }
                })
                .fold(0.0, f64::max);

        TimeBreakdown {
            compute_s: m * (slowest.forward + slowest.backward + slowest.recompute),
            recompute_s: m * slowest.recompute,
            exposed_comm_s: m * slowest.comm,
            overlapped_comm_s: m * slowest.hidden_comm,
            pipeline_p2p_s: p2p,
            bubble_s: bubble,
            exposed_dp_comm_s: exposed_dp,
            optimizer_s: optimizer,
            overlap_slowdown_s: overlap_slowdown,
            offload_s: offload,
            offload_bytes: offload_bytes as u64,
            dp_link_bytes: ((dense_cut.link_bytes + expert_cut.link_bytes)
                * if c.zero >= 2 && !c.holds_the_step() {
                    m
                } else {
                    1.0
                }) as u64,
            comm_by_axis,
        }
    }
}

pub(crate) fn step_total(t: &TimeBreakdown) -> f64 {
    t.compute_s
        + t.exposed_comm_s
        + t.pipeline_p2p_s
        + t.bubble_s
        + t.exposed_dp_comm_s
        + t.optimizer_s
        + t.overlap_slowdown_s
        + t.offload_s
}

#[cfg(test)]
mod tests {
    use super::attended_share;

    /// `(seq, causal, window, tile, share of seq² the kernel's time follows)`.
    type Case = (u64, bool, Option<u64>, (u64, u64), f64);

    #[test]
    fn attended_share_counts_visited_tiles() {
        let cases: [Case; 7] = [
            (8192, false, None, (128, 128), 1.0),
            (8192, true, None, (128, 64), 0.5),
            // A window as long as the sequence masks nothing more.
            (8192, true, Some(8192), (128, 128), 0.5),
            // Pair by pair: 1 + 2 + 2 + 2 of the causal 1 + 2 + 3 + 4 keys.
            (4, true, Some(2), (1, 1), 0.5 * 7.0 / 10.0),
            // Whole tiles: the second block of queries reaches back into the
            // first key tile, so nothing is skipped.
            (4, true, Some(2), (2, 2), 0.5),
            // Mistral at seq 8192 under FlashAttention-3's tiles: 0.75 of the
            // causal pairs, 33 of a block's 128-key tiles once the window
            // trails it (1584 of the causal 2080 tiles).
            (8192, true, Some(4096), (128, 128), 0.5 * 1584.0 / 2080.0),
            // Without the causal mask a query sees every key ahead too.
            (8192, false, Some(4096), (128, 128), 0.87890625),
        ];
        for (seq, causal, window, tile, want) in cases {
            let got = attended_share(seq, causal, window, tile);
            assert!(
                (got - want).abs() < 1e-6,
                "seq {seq} causal {causal} window {window:?} tile {tile:?}: {got} != {want}"
            );
        }
    }
}
