//! The cost model: per-rank memory by kind and step time by phase for one
//! configuration, from the model profile and the cluster's links. This
//! module prices a stage's passes and the step; `region` one layer's pass
//! (its GEMMs, attention, collectives and what it keeps), `comm` the links,
//! the collectives and the data-parallel reduction; what a rank holds is
//! `memory`'s, how the layers split over stages `stages`'.
//!
//! Every constant here is stated with its source; the same constants serve
//! every model and cluster (no per-row calibration).

mod comm;
mod region;

pub use comm::overlap_slowdown;
pub(crate) use comm::{collective_time, dispatch_time, group_link, server_rate, GroupLink};
pub(crate) use region::kept_share;

use crate::cluster::Cluster;
use crate::profile::{Bind, ModelProfile, StackShare};
use dplc_ir::{
    AttentionKind, AxisComm, CollectiveKind, Compression, Elementwise, GradAccum, GradSync, Loss,
    MeshAxis, Offload, PipelineSchedule, Precision, Recompute, ShardLayout, TimeBreakdown, TpImpl,
    TpOverlap,
};
use std::rc::Rc;

/// Streaming kernels reach about 80% of HBM bandwidth (BabelStream-class
/// measurements on A100/H100 land at 80–90% of the datasheet figure).
pub(crate) const MEMORY_EFFICIENCY: f64 = 0.8;

/// CUDA kernel launch and framework dispatch, per kernel (a few microseconds).
pub(crate) const KERNEL_OVERHEAD_S: f64 = 4e-6;
/// Optimizer step traffic per parameter, as the stack runs it: AdamW reads
/// the fp32 gradient (4) and reads and writes master weight, m and v (3 × 8);
/// the global gradient norm reads the gradients again (4) and zeroing them
/// for the next step writes them (4) — 36 bytes in fp32, where the master is
/// the weight. Mixed precision also writes the working copy (2); fp16's loss
/// scaling first unscales the gradients and checks them for inf/NaN (one
/// more read and write, 8). Main gradients of `grad` bytes below fp32's
/// (`grad_reduce=bf16`) are read by the norm and zeroed at that size, and
/// cast into an fp32 copy the step reads (Megatron's distributed optimizer
/// copies its shard: read `grad`, write 4).
fn optimizer_step_bytes(precision: Precision, grad: f64) -> f64 {
    let fp32_grads = match precision {
        Precision::Fp32 => 36.0,
        Precision::Bf16 => 38.0,
        Precision::Fp16 => 46.0,
    };
    if grad < 4.0 {
        fp32_grads - 8.0 + 3.0 * grad + 4.0
    } else {
        fp32_grads
    }
}
/// What is left, after the step's last backward, of a data-parallel
/// reduction of `reduce` seconds on one link, when each model chunk's
/// reduction starts as its last micro-batch's backward ends (Megatron-Core's
/// `grad_sync_func`, `schedules.py`: launched per chunk at its last
/// micro-batch, at the same slot across the pipeline) and its buckets as its
/// layers finish. Stage 0 ends the step (`backward`: one micro-batch's
/// backward of its `layers`, in `chunks` chunks of `pp`-micro-batch groups):
/// the interleaved cooldown runs the last group's chunk v−1 first and chunk
/// 0 last, so chunk j's reduction has j·pp backward slots still to hide
/// behind. The chunks' reductions queue on the link, each its share. One
/// chunk (1F1B, GPipe) hides all but the last layer's bucket behind the last
/// backward, as before.
fn reduction_after_backward(
    reduce: f64,
    backward: f64,
    layers: f64,
    (chunks, pp): (u64, u64),
) -> f64 {
    let v = chunks.max(1) as f64;
    let slot = backward / v;
    let per_chunk = reduce / v;
    // A chunk's first buckets are ready one of its layers into its last slot.
    let within = slot * (1.0 - v / layers.max(v));
    // When the link frees, with the step's last backward ending at 0.
    let mut free = f64::NEG_INFINITY;
    for j in (0..chunks.max(1)).rev() {
        let ready = -(j as f64) * pp as f64 * slot - within;
        free = free.max(ready) + per_chunk;
    }
    free.max(0.0)
}

/// What the first stage waits, at the start of a step, for the updated
/// weights' all-gather (`gather` seconds on one link) overlapped with the
/// forward (`forward`: one micro-batch's forward of the stage's layers, in
/// `chunks` chunks of `pp`-micro-batch groups). Megatron-Core
/// (`schedules.py` @ d98e8a6, `param_sync_func`) launches the first two
/// chunks' gathers at the step's start and chunk j's (j ≥ 2) when chunk
/// j − 1's first forward begins; chunk j's first forward begins after j·pp
/// forward slots, and a chunk's gather may finish during its first forward
/// (layer by layer). The gathers queue on the link; each wait delays what
/// follows. One chunk: the gather hides behind the first forward, as before.
fn gather_before_forward(gather: f64, forward: f64, (chunks, pp): (u64, u64)) -> f64 {
    let v = chunks.max(1);
    let slot = forward / v as f64;
    let per_chunk = gather / v as f64;
    let pp = pp as f64;
    let (mut free, mut waited) = (0.0f64, 0.0f64);
    for j in 0..v {
        let launch = if j <= 1 {
            0.0
        } else {
            (j - 1) as f64 * pp * slot + waited
        };
        free = free.max(launch) + per_chunk;
        let needed = (j as f64 * pp + 1.0) * slot + waited;
        waited += (free - needed).max(0.0);
    }
    waited
}

/// Accumulating a micro-batch's weight gradient outside its GEMM
/// (`GradAccum::Separate`), per parameter: read the new gradient in the
/// training precision, read and write the main gradient (`grad` bytes).
fn separate_accum_bytes(precision: Precision, grad: f64) -> f64 {
    precision.bytes() as f64 + 2.0 * grad
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
    /// The main gradients' precision (`grad_reduce=`).
    pub grad_reduce: dplc_ir::GradReduce,
    /// How MoE tokens reach their experts' ranks (`dispatch=`).
    pub dispatch: dplc_ir::Dispatch,
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
    /// PyTorch's automatic mixed precision over fp32 weights (`autocast=on`).
    pub autocast: bool,
    /// Elementwise ops fused into chains, or one kernel each (`elementwise=eager`).
    pub elementwise: Elementwise,
    /// The cross-entropy as one kernel, or in fp32 pass by pass (`loss=unfused`).
    pub loss: Loss,
    /// Where ZeRO-3 keeps what it gathers and reduces (`shards=per_param`: FSDP2's copies).
    pub shards: ShardLayout,
    /// How tensor parallelism lays out sequence shards (`tp_impl=`).
    pub tp_impl: TpImpl,
    /// How replicas combine gradients (`sync=`); priced by [`CostModel::dp_reduction`].
    pub sync: GradSync,
    /// What the data-parallel reduction sends (`compress=`).
    pub compress: Compression,
}

/// Where a region sits, for what sequence parallelism does in it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Place {
    /// A transformer layer of a stack.
    Layer,
    /// The root's ops between stacks, run as the layers run.
    LeadIn,
    /// The model's ends: the embedding, the head and the loss.
    End,
}

impl Config {
    /// Whether sequence parallelism splits the activations tensor
    /// parallelism leaves whole along the sequence at `place`: in the
    /// layers always, in the model's ends where the implementation does
    /// ([`TpImpl::splits_ends`]: not dplc's runtime, whose root program
    /// runs them over every token).
    pub fn splits_sequence(&self, place: Place) -> bool {
        self.sp && (place != Place::End || self.tp_impl.splits_ends())
    }

    /// Whether a column-parallel GEMM's backward all-gathers its input
    /// again under sequence parallelism (the `sequence_parallel_only`
    /// collectives) at `place`: only where the input is sequence-split
    /// ([`Config::splits_sequence`]; dplc's ends hold it whole). Megatron's
    /// linear layer keeps the input's shard and always does; DTensor's
    /// autograd keeps the gathered input, gathered again only where
    /// op-level checkpointing, which torchtitan applies to the layers,
    /// recomputes the gather (its policy keeps no all-gather); a fully
    /// recomputed layer's forward has gathered it.
    pub fn regathers(&self, place: Place) -> bool {
        self.splits_sequence(place)
            && (self.tp_impl != TpImpl::DTensor
                || (place == Place::Layer && self.recompute == Recompute::Op))
    }

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

    /// Bytes of a main-gradient element, as kept and reduced: the stack's
    /// choice under mixed precision (fp32 unless `grad_reduce` says
    /// otherwise), fp32 for an fp32 model.
    pub fn grad_bytes(&self, precision: Precision) -> f64 {
        match precision {
            Precision::Fp32 => 4.0,
            _ => self.grad_reduce.bytes() as f64,
        }
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
    /// The largest gradient the backward writes beside what is kept: that
    /// of the largest one tensor kept for backward (after the loss: the
    /// logits', in their type, whatever the loss keeps of them).
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
/// tensor-parallel overlap, FP8, the elementwise kernels, the loss, autocast and the
/// token dispatcher — and the expert group's stride, which the rank
/// order and the pipeline degree move (the links of the groups follow).
type LayerKey = (
    (u64, u64, u64),
    u64,
    bool,
    Recompute,
    AttentionKind,
    (TpOverlap, bool, Elementwise, Loss, bool, dplc_ir::Dispatch),
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

impl Part {
    fn place(self) -> Place {
        match self {
            Part::Layer(_) => Place::Layer,
            Part::LeadIn(_) => Place::LeadIn,
            Part::Pre | Part::Post => Place::End,
        }
    }
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

    /// The ranks holding the same experts: the data-parallel replicas
    /// outside the expert group (`dp / ep` of them, strided past it), over
    /// which the expert gradients are reduced and their shards gathered.
    pub fn expert_replica_link(&self, c: &Config) -> GroupLink {
        let (stride, _) = c.stride_size(MeshAxis::Dp);
        group_link(self.cluster, stride * c.ep, (c.dp / c.ep).max(1))
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

    /// Costs of each stack's layer and lead-in, the embedding part and the
    /// head part for `c`.
    pub fn parts(&mut self, c: &Config) -> Rc<Parts> {
        let key = (
            (c.tp, c.cp, c.ep),
            c.micro_batch,
            c.sp,
            c.recompute,
            c.attention,
            (
                c.tp_overlap,
                c.fp8,
                c.elementwise,
                c.loss,
                c.autocast,
                c.dispatch,
            ),
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
            let grad = c.grad_bytes(self.profile.precision);
            s.backward += params * separate_accum_bytes(self.profile.precision, grad) / bandwidth;
        }
        if c.autocast && self.profile.precision != Precision::Fp32 {
            // Autocast casts each fp32 weight to the training precision the
            // first time a forward's GEMM reads it (read 4 bytes, write 2),
            // and the weight's gradient back to fp32 for its accumulation.
            let (params, _) = self.stage_params(c, i as u64, &shares);
            let cast = params * (4.0 + self.profile.precision.bytes() as f64) / bandwidth;
            s.forward += cast;
            s.backward += cast;
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
            let (w, grad) = (
                self.profile.precision.bytes() as f64,
                c.grad_bytes(self.profile.precision),
            );
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
        let edp_link = self.expert_replica_link(c);
        let grad_bytes = c.grad_bytes(self.profile.precision);
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
            // One gather a layer, each paying its own latency.
            let g = collective_time(CollectiveKind::AllGather, gathered_bytes / l, &dp_link);
            let f = stages[0].forward / l;
            (
                g + (l - 1.0) * (g - f).max(0.0) + dp_reduce,
                l * g + dp_reduce,
            )
        } else if c.zero >= 3 {
            // ZeRO-3 (FSDP) works layer by layer, every micro-batch: the
            // forward gathers a layer's weights while the layer before it
            // computes (the first gather waits), the backward gathers them
            // again and reduce-scatters the gradients, one after the other
            // on the same link, beside the layer's backward (the last
            // reduce-scatter waits; without overlap all of them do). The
            // expert gradients reduce as under ZeRO-2.
            // Each layer's gather and reduce-scatter is a collective of its
            // own, paying its latency (at 64 ranks over nodes, 63 hops).
            let l = layers0;
            let g = collective_time(CollectiveKind::AllGather, gathered_bytes / l, &dp_link);
            let r = self.dp_reduction(c, dense / l, grad_bytes, &dp_link).wire_s;
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
                m * (l * (2.0 * g + r) + expert_reduce),
            )
        } else if c.zero >= 2 {
            // ZeRO-2 reduce-scatters every micro-batch's gradients during its backward.
            (m * (dp_reduce - hidden).max(0.0), m * dp_reduce)
        } else if c.overlap && c.sync.staleness() == 0 {
            let exposed = reduction_after_backward(
                dp_reduce,
                stages[0].backward + stages[0].recompute,
                layers0,
                (crate::stages::chunks(c), c.pp),
            );
            (exposed, dp_reduce)
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
            exposed_dp +=
                gather_before_forward(gather, stages[0].forward, (crate::stages::chunks(c), c.pp));
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
            opt_params
                * (optimizer_step_bytes(
                    self.profile.precision,
                    c.grad_bytes(self.profile.precision),
                ) + 4.0)
                / (dev.host_memory_bandwidth * MEMORY_EFFICIENCY)
        } else {
            opt_params
                * optimizer_step_bytes(self.profile.precision, c.grad_bytes(self.profile.precision))
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
    use super::{gather_before_forward, reduction_after_backward};

    #[test]
    fn one_chunk_hides_all_but_the_last_layers_bucket() {
        // 1 s of reduction behind a 0.8 s backward of 8 layers: 0.7 s hides.
        let left = reduction_after_backward(1.0, 0.8, 8.0, (1, 4));
        assert!((left - 0.3).abs() < 1e-12, "{left}");
        assert_eq!(reduction_after_backward(0.5, 0.8, 8.0, (1, 4)), 0.0);
    }

    #[test]
    fn one_chunk_gathers_behind_the_first_forward() {
        assert!((gather_before_forward(1.0, 0.8, (1, 4)) - 0.2).abs() < 1e-12);
        assert_eq!(gather_before_forward(0.5, 0.8, (1, 4)), 0.0);
    }

    #[test]
    fn interleaved_chunks_gather_during_the_warm_up() {
        // Two chunks of a 0.8 s forward (0.4 s slots), pp 4, 1 s of gather:
        // both launched at the start; chunk 0 is done at 0.5 s, needed by
        // 0.4 (waits 0.1); chunk 1 at 1.0 s, needed by 5 slots + 0.1 = 2.1.
        let waited = gather_before_forward(1.0, 0.8, (2, 4));
        assert!((waited - 0.1).abs() < 1e-12, "{waited}");
        // Four chunks, 4 s (1 s each), 0.2 s slots: chunk 0 done at 1
        // (needed 0.2: waits 0.8); chunk 1 at 2 (needed 5 × 0.2 + 0.8 = 1.8:
        // 0.2 more); chunk 2 launched at chunk 1's first forward (4 slots +
        // 1.0 waited = 1.8 s), queued to 3.0, needed 9 × 0.2 + 1.0 = 2.8:
        // 0.2 more; chunk 3 launched at 8 × 0.2 + 1.2 = 2.8, queued to 4.0,
        // needed 13 × 0.2 + 1.2 = 3.8: 0.2 more. 1.4 s in all.
        let waited = gather_before_forward(4.0, 0.8, (4, 4));
        assert!((waited - 1.4).abs() < 1e-12, "{waited}");
    }

    #[test]
    fn interleaved_chunks_reduce_during_the_cooldown() {
        // 2 chunks of 4 layers, pp 4: a slot is 0.4 s; chunk 1's reduction
        // (0.5 s) is ready 4 slots and 3/4 of one before the end (1.9 s),
        // chunk 0's 0.3 s before it; the link is free by then, so 0.2 s
        // is left — where one chunk would leave 0.3.
        let left = reduction_after_backward(1.0, 0.8, 8.0, (2, 4));
        assert!((left - 0.2).abs() < 1e-12, "{left}");
        // A reduction longer than the cooldown queues: 4 s in two halves,
        // the first from −1.9 s to 0.1 s, the second after it: 2.1 s left.
        let left = reduction_after_backward(4.0, 0.8, 8.0, (2, 4));
        assert!((left - 2.1).abs() < 1e-12, "{left}");
    }
}
