//! What the cost model needs from a graph, computed once per model: per-op
//! work (GEMM shapes, memory traffic), stored activations and collectives, each
//! tagged with how tensor parallelism divides it.

use crate::sharding::{GemmSplit, Pass, RegionSharding, TpCollectiveKind};
use crate::PlanError;
use dplc_ir::{
    Analysis, DType, Dim, Graph, NodeId, Op, ParamId, Poly, Precision, Ratio, RegionId, SymId,
    TensorDef, TensorId,
};
use std::collections::{BTreeMap, BTreeSet};

/// The symbolic sizes a cost is evaluated at, per rank.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Bind {
    pub batch_sym: Option<SymId>,
    pub seq_sym: Option<SymId>,
    pub micro_batch: f64,
    pub seq: f64,
    /// Context-parallel degree: each rank holds `seq / cp` queries but
    /// attends to all `seq` keys.
    pub cp: f64,
}

impl Bind {
    /// The value of `p` on one context-parallel rank: the first `seq` factor
    /// of each term is local (`seq / cp`), further ones (attention's keys) are whole.
    pub fn eval(&self, p: &Poly) -> f64 {
        p.terms()
            .map(|(syms, c)| {
                let mut v = c.to_f64();
                let mut seen_seq = false;
                for &s in syms {
                    if Some(s) == self.batch_sym {
                        v *= self.micro_batch;
                    } else if Some(s) == self.seq_sym {
                        v *= if seen_seq {
                            self.seq
                        } else {
                            self.seq / self.cp
                        };
                        seen_seq = true;
                    }
                }
                v
            })
            .sum()
    }

    /// A GEMM's `m`, `n` and `k` on one context-parallel rank. Its rows
    /// (`m`) hold the rank's queries; once they do, a sequence in `n` or `k`
    /// is the keys', which every rank attends to whole (Q·Kᵀ's `n`, P·V's `k`).
    pub fn eval_gemm(&self, m: &Poly, n: &Poly, k: &Poly) -> (f64, f64, f64) {
        let rows_hold_seq = self
            .seq_sym
            .is_some_and(|s| m.terms().any(|(syms, _)| syms.contains(&s)));
        let keys = Bind { cp: 1.0, ..*self };
        let other = if rows_hold_seq { &keys } else { self };
        (self.eval(m), other.eval(n), other.eval(k))
    }
}

/// The work of one node, per iteration of its region.
#[derive(Clone, Debug)]
pub(crate) enum Work {
    /// `2·m·n·k` FLOPs; `m` includes the batch dims.
    Gemm {
        m: Poly,
        n: Poly,
        k: Poly,
        split: GemmSplit,
        /// Backward GEMMs: one per operand that needs a gradient.
        backward_gemms: u32,
        /// Under autocast, the eager cast of each fp32 activation operand to
        /// the training precision before the GEMM reads it (read 4 bytes,
        /// write the training precision's); torch.compile fuses it into
        /// the producer.
        autocast_casts: Traffic,
    },
    /// A memory-bound kernel: bytes read and written, split by whether the
    /// tensors are sharded over tensor parallelism. `sharded`/`replicated`
    /// count what a fused chain moves (a tensor that one elementwise op
    /// hands to the next stays in registers); `eager` counts every input
    /// and output of the op, as its own kernel moves them.
    Memory {
        sharded: Poly,
        replicated: Poly,
        eager: Traffic,
        /// The same two, fused and eager, with each tensor at its width
        /// under autocast ([`RegionBuilder::autocast_bytes`]).
        autocast: [Traffic; 2],
    },
}

/// Bytes an op's kernel reads and writes when nothing around it is fused.
#[derive(Clone, Debug, Default)]
pub(crate) struct Traffic {
    pub sharded: Poly,
    pub replicated: Poly,
}

#[derive(Clone, Debug)]
pub(crate) struct OpCost {
    pub node: NodeId,
    pub work: Work,
    /// Part of the core attention: recomputed under selective recomputation.
    pub attention_core: bool,
    /// Run on the whole sequence by every context-parallel rank
    /// (`dplc_ir::context_traffic`): MoE routing, the loss's mean, the
    /// tables built from positions.
    pub whole_sequence: bool,
    /// Writes a tensor of the experts layout: whole on every tensor-parallel
    /// rank, where sequence parallelism splits the other unsharded ones.
    pub experts: bool,
}

/// One tensor kept for backward.
#[derive(Clone, Debug)]
pub(crate) struct Saved {
    pub bytes: Poly,
    /// Under autocast: an activation at its autocast width.
    pub autocast_bytes: Poly,
    pub sharded: bool,
    /// In the experts layout: whole on every tensor-parallel rank, where
    /// sequence parallelism splits the other unsharded tensors.
    pub experts: bool,
    pub attention_core: bool,
    /// Read only by linear layers' GEMMs (through views): under FP8 the
    /// one-byte copy those GEMMs read is what backward keeps.
    pub gemm_input: bool,
}

#[derive(Clone, Debug)]
pub(crate) struct CollectiveCost {
    pub kind: TpCollectiveKind,
    pub pass: Pass,
    pub bytes: Poly,
    /// Repeated when the forward is recomputed.
    pub what: String,
    /// The GEMMs it can hide behind: for a column-parallel input gradient or
    /// an all-gather, the tensor-parallel GEMMs that read the tensor; for a
    /// row-parallel output, the GEMM that writes it.
    pub beside: Vec<NodeId>,
    /// Exists only under sequence parallelism: the backward all-gather of a
    /// column-parallel GEMM's saved input shard for its weight gradient.
    pub sequence_parallel_only: bool,
}

/// Parameters of a region by how they are split.
#[derive(Clone, Debug, Default)]
pub(crate) struct ParamCounts {
    pub tp_split: f64,
    pub replicated: f64,
    pub expert_tp_split: f64,
    pub expert_replicated: f64,
}

impl ParamCounts {
    /// Elements one rank holds.
    pub fn per_rank(&self, tp: f64, ep: f64) -> f64 {
        self.tp_split / tp
            + self.replicated
            + self.expert_tp_split / (tp * ep)
            + self.expert_replicated / ep
    }
    pub fn total(&self) -> f64 {
        self.tp_split + self.replicated + self.expert_tp_split + self.expert_replicated
    }
    /// Elements whose data-parallel group is the expert-data group (`dp / ep`).
    pub fn expert_per_rank(&self, tp: f64, ep: f64) -> f64 {
        self.expert_tp_split / (tp * ep) + self.expert_replicated / ep
    }
}

/// A region's costs: a layer body, or the part of the model before or after the layers.
#[derive(Clone, Debug, Default)]
pub(crate) struct RegionProfile {
    pub ops: Vec<OpCost>,
    pub saved: Vec<Saved>,
    pub collectives: Vec<CollectiveCost>,
    /// Bytes all-gathered along the sequence under context parallelism,
    /// per rank's share (`dplc_ir::context_traffic`), of values the layout
    /// splits over tp (each tp rank gathers its share): the operands of
    /// attention's two matmuls that carry the keys (K and V, by heads).
    pub cp_gather_bytes: Poly,
    /// Of those, the ones whose gradients are reduce-scattered back.
    pub cp_reduce_scatter_bytes: Poly,
    /// The same of values every tp rank holds whole: the per-token losses
    /// before their mean, an MoE layer's tokens before routing.
    pub cp_gather_whole_bytes: Poly,
    pub cp_reduce_scatter_whole_bytes: Poly,
    pub all_to_all_bytes: Poly,
    pub params: ParamCounts,
    pub forward_flops: Poly,
    /// The region masks its attention causally: a fused kernel skips the
    /// blocks above the diagonal.
    pub causal: bool,
    /// Keys a query sees under a sliding-window mask (`dplc_ir::window_mask`):
    /// a fused kernel skips the key tiles behind the window too.
    pub window: Option<u64>,
}

impl RegionProfile {
    /// Bytes one rank all-gathers along the sequence in a run of the
    /// region under `bind.cp` (each all-gather's whole tensor, as the
    /// collectives are priced), and reduce-scatters back in backward, with
    /// `tp` ranks per cp rank.
    pub fn cp_traffic(&self, bind: &Bind, tp: f64) -> (f64, f64) {
        let bytes =
            |split: &Poly, whole: &Poly| (bind.eval(split) / tp + bind.eval(whole)) * bind.cp;
        (
            bytes(&self.cp_gather_bytes, &self.cp_gather_whole_bytes),
            bytes(
                &self.cp_reduce_scatter_bytes,
                &self.cp_reduce_scatter_whole_bytes,
            ),
        )
    }
}

/// One layer stack (a top-level `repeat`) as the cost model sees it.
#[derive(Clone, Debug)]
pub(crate) struct StackProfile {
    /// The model's number of the stack's first layer: stacks number their
    /// layers one after the other, and a pipeline stage may cut anywhere.
    pub first: u64,
    pub layers: u64,
    /// One layer of the stack, under the stack's own layout.
    pub layer: RegionProfile,
    /// The root's nodes between the previous stack and this one (a
    /// decoder's embedding, an encoder's final norm); they run on the stage
    /// that runs this stack's first layer. The first stack's are `pre`.
    pub lead_in: RegionProfile,
    /// Bytes that cross a pipeline cut inside the stack, per micro-batch:
    /// the values carried from layer to layer (also the full-recompute
    /// checkpoint) and what every layer reads besides them (an encoder's
    /// output that a decoder's cross-attention reads).
    pub input_bytes: Poly,
    /// Bytes carried from layer to layer: what full recomputation keeps.
    pub carried_bytes: Poly,
    /// Forward FLOPs of the core attention of one layer.
    pub attention_core_flops: Poly,
    /// Forward FLOPs of one layer's weight GEMMs that op-level
    /// checkpointing recomputes (the 2nd, 4th, … in the layer's order).
    pub op_recompute_flops: Poly,
}

/// The model as the cost model sees it.
#[derive(Clone, Debug)]
pub(crate) struct ModelProfile {
    pub name: String,
    /// Layers of every stack.
    pub layers: u64,
    /// The layer stacks in program order (at least one).
    pub stacks: Vec<StackProfile>,
    pub pre: RegionProfile,
    pub post: RegionProfile,
    /// Parameters used both before and after the layers (tied embeddings),
    /// split as the root's layout holds them: `pre` and `post` each count
    /// them, a stage holding both ends stores them once.
    pub tied_params: ParamCounts,
    pub precision: Precision,
    pub batch_sym: Option<SymId>,
    pub seq_sym: Option<SymId>,
    pub experts: Option<u64>,
    /// Why context parallelism cannot run the model, if it cannot.
    pub context_refusal: Option<String>,
    pub total_params: u128,
    /// Forward FLOPs of the whole model per step's worth of `batch`/`seq`.
    pub forward_flops: Poly,
    /// Per parameter: name, elements (all iterations), splits.
    pub param_layout: Vec<(String, u128, Option<usize>, bool)>,
    /// The matrix parameters as PowerSGD and top-k see them (rows = the
    /// first dimension, columns the rest, as the runtime reshapes them):
    /// `(shape, copies)`, copies over the layers of a stack. Everything
    /// else goes uncompressed.
    pub matrices: Vec<(Vec<u64>, f64)>,
}

impl ModelProfile {
    /// The share of the parameters in matrices (what top-k sparsifies).
    pub fn matrix_share(&self) -> f64 {
        let elems: f64 = self
            .matrices
            .iter()
            .map(|(shape, copies)| shape.iter().product::<u64>() as f64 * copies)
            .sum();
        share(elems, self.total_params)
    }

    /// PowerSGD rank `rank`'s view: the share of the parameters it
    /// compresses ([`dplc_ir::powersgd_factors`]), and what its factors
    /// send of those elements.
    pub fn powersgd_shares(&self, rank: u64) -> (f64, f64) {
        let (mut compressed, mut factors) = (0.0, 0.0);
        for (shape, copies) in &self.matrices {
            if let Some((rows, cols, r)) = dplc_ir::powersgd_factors(shape, rank) {
                compressed += (rows * cols) as f64 * copies;
                factors += ((rows + cols) * r) as f64 * copies;
            }
        }
        let sent = if compressed > 0.0 {
            factors / compressed
        } else {
            1.0
        };
        (share(compressed, self.total_params), sent)
    }
}

fn share(elems: f64, total: u128) -> f64 {
    if total > 0 {
        (elems / total as f64).min(1.0)
    } else {
        0.0
    }
}

/// Layers of one stack that a pipeline stage runs.
#[derive(Clone, Copy, Debug)]
pub(crate) struct StackShare {
    pub stack: usize,
    pub layers: u64,
    /// The stage runs the stack's first layer, and so its lead-in.
    pub first: bool,
}

impl ModelProfile {
    /// The stacks' shares of the model's layers `range` (a stage's), in order.
    pub fn shares(&self, range: std::ops::Range<u64>) -> impl Iterator<Item = StackShare> + '_ {
        self.stacks.iter().enumerate().filter_map(move |(i, s)| {
            let (from, to) = (range.start.max(s.first), range.end.min(s.first + s.layers));
            (from < to).then(|| StackShare {
                stack: i,
                layers: to - from,
                first: from == s.first,
            })
        })
    }
}

fn poly(d: &Dim) -> Poly {
    Poly::from_dim(d)
}

fn scaled(d: &Dim, r: u64) -> Poly {
    let mut p = Poly::zero();
    p.add_dim(d, Ratio::int(r as i64));
    p
}

fn elt_bytes(dtype: DType, precision: Precision) -> u64 {
    if dtype.is_float() {
        precision.bytes()
    } else {
        4
    }
}

/// Bytes per element eager PyTorch moves for RMSNorm, which it runs as its
/// composed ops (the Llama reference code, torchtitan's and Hugging Face's
/// `RMSNorm`): `x.float()` reads `e` and writes 4, `pow(2)` reads and writes
/// 4, `mean(-1)` reads 4, `x * rsqrt(…)` reads and writes 4, `type_as(x)`
/// reads 4 and writes `e`, `* weight` reads and writes `e` (`e`: the
/// training precision's bytes; the row statistics are negligible).
fn eager_rms_norm_bytes(e: u64) -> u64 {
    (e + 4) + (4 + 4) + 4 + (4 + 4) + (4 + e) + (e + e)
}

fn fusible(op: &Op) -> bool {
    matches!(
        op,
        Op::Unary(_)
            | Op::Binary(_)
            | Op::Cast(_)
            | Op::Dropout { .. }
            | Op::CausalMask
            | Op::Select
            | Op::Pad { .. }
    )
}

struct RegionBuilder<'a> {
    g: &'a Graph,
    an: &'a Analysis<'a>,
    precision: Precision,
    /// Bytes per element of each float tensor under autocast.
    autocast: BTreeMap<TensorId, u64>,
    seq: Option<SymId>,
    sharding: &'a RegionSharding,
    consumers: BTreeMap<TensorId, Vec<NodeId>>,
    escapes: BTreeSet<TensorId>,
    saved_roots: BTreeSet<TensorId>,
}

impl RegionBuilder<'_> {
    fn numel(&self, t: TensorId) -> Dim {
        self.g
            .tensor(t)
            .shape
            .numel()
            .unwrap_or_else(|| Dim::konst(0))
    }

    fn sharded(&self, t: TensorId) -> bool {
        self.sharding.sharded.contains(&self.an.storage_root(t))
    }

    /// Whether `t` is held in the experts layout.
    fn experts(&self, t: TensorId) -> bool {
        self.sharding.experts.contains(&self.an.storage_root(t))
    }

    /// A tensor reaches memory unless an elementwise op produces it and one
    /// elementwise op (or norm/softmax prologue) consumes it, and backward does not keep it.
    fn materialized(&self, t: TensorId) -> bool {
        let producer_fuses = self.g.producer(t).is_some_and(|p| fusible(&p.op));
        if !producer_fuses || self.escapes.contains(&t) || self.saved_roots.contains(&t) {
            return true;
        }
        match self.consumers.get(&t).map(Vec::as_slice) {
            Some([only]) => {
                let op = &self.g.node(*only).op;
                !(fusible(op)
                    || matches!(
                        op,
                        Op::Softmax { .. }
                            | Op::LogSoftmax { .. }
                            | Op::LayerNorm { .. }
                            | Op::RmsNorm { .. }
                    ))
            }
            _ => true,
        }
    }

    /// Whether `t` is the log-probabilities of a cross-entropy: a
    /// log-softmax's output read only by the loss's gather, and not kept
    /// (the backward recomputes it from the logits). Fused, the two are one
    /// kernel — dplc's `log_softmax_take_along`, torch.compile's and
    /// Megatron's fused losses: it reads the logits and writes the losses,
    /// and the log-probabilities never reach memory.
    fn fused_loss(&self, t: TensorId) -> bool {
        let from_log_softmax = self
            .g
            .producer(t)
            .is_some_and(|p| matches!(p.op, Op::LogSoftmax { .. }));
        from_log_softmax
            && !self.escapes.contains(&t)
            && !self.saved_roots.contains(&t)
            && matches!(
                self.consumers.get(&t).map(Vec::as_slice),
                Some([only]) if matches!(self.g.node(*only).op, Op::TakeAlong)
            )
    }

    /// Whether every reader of `t` in the region, through reshapes and
    /// transposes, is a GEMM, and one is.
    fn gemm_input(&self, t: TensorId) -> bool {
        self.gemm_readers(t, false)
    }

    /// Whether every reader of `t` in the region, through reshapes and
    /// transposes, is a GEMM against a weight (a linear layer), and one is.
    fn weight_gemm_input(&self, t: TensorId) -> bool {
        self.gemm_readers(t, true)
    }

    /// Whether every reader of `t` in the region, through reshapes and
    /// transposes, is a GEMM (against a weight, if `weight`), and one is.
    fn gemm_readers(&self, t: TensorId, weight: bool) -> bool {
        let mut stack = vec![t];
        let mut gemms = 0;
        while let Some(t) = stack.pop() {
            for &n in self.consumers.get(&t).map_or(&[][..], Vec::as_slice) {
                let node = self.g.node(n);
                match node.op {
                    Op::Reshape { .. } | Op::Transpose { .. } => {
                        stack.extend(node.outputs.iter().copied())
                    }
                    Op::MatMul
                        if !weight
                            || node
                                .inputs
                                .iter()
                                .any(|&i| i != t && !self.an.is_activation(i)) =>
                    {
                        gemms += 1
                    }
                    _ => return false,
                }
            }
        }
        gemms > 0
    }

    fn add_bytes(&self, t: TensorId, bytes: u64, sharded: &mut Poly, replicated: &mut Poly) {
        if !self.an.is_activation(t) {
            return;
        }
        let target = if self.sharded(t) { sharded } else { replicated };
        target.add_dim(&self.numel(t), Ratio::int(bytes as i64));
    }

    /// Bytes per element of `t` under PyTorch's autocast over fp32 weights
    /// (its op lists, `torch/csrc/autograd/autocast_mode.cpp`): GEMMs
    /// write the training precision; norms, softmax, reductions, the loss
    /// and the embedding (an fp32 table) write fp32; any other op writes
    /// the widest of its activation operands (type promotion; a weight
    /// operand — a bias, a norm's gain — is fused into its op as PyTorch's
    /// modules run it and does not widen). A region's arguments are fp32:
    /// the residual stream a layer carries is the embedding's output and
    /// residual sums of it.
    fn autocast_bytes(&self, t: TensorId) -> u64 {
        // Not written in the region: an argument (the fp32 stream), a
        // weight (fp32), or an integer (4 bytes).
        self.autocast.get(&t).copied().unwrap_or(4)
    }

    /// What node `n`'s memory-bound kernel moves, `(fused, eager)`, with
    /// each tensor at `fused_bytes` / `bytes_of` bytes per element: fused, a
    /// chain moves what enters and leaves it; eager, every operand. A
    /// dropout also writes its mask (a byte an element); eager RMSNorm runs
    /// as its composed ops (`eager_rms_norm_bytes` for its input's width).
    fn memory_traffic(
        &self,
        n: NodeId,
        fused_bytes: impl Fn(TensorId) -> u64,
        bytes_of: impl Fn(TensorId) -> u64,
    ) -> (Traffic, Traffic) {
        let node = self.g.node(n);
        let (mut fused, mut eager) = (Traffic::default(), Traffic::default());
        for &t in &node.inputs {
            let chained = (self.g.producer(t).is_some_and(|p| fusible(&p.op))
                && fusible(&node.op)
                && !self.materialized(t))
                || self.fused_loss(t);
            if !chained {
                self.add_bytes(t, fused_bytes(t), &mut fused.sharded, &mut fused.replicated);
            }
            self.add_bytes(t, bytes_of(t), &mut eager.sharded, &mut eager.replicated);
        }
        for &o in &node.outputs {
            if (!fusible(&node.op) || self.materialized(o)) && !self.fused_loss(o) {
                self.add_bytes(o, fused_bytes(o), &mut fused.sharded, &mut fused.replicated);
            }
            self.add_bytes(o, bytes_of(o), &mut eager.sharded, &mut eager.replicated);
        }
        if matches!(node.op, Op::Dropout { .. }) {
            // The mask is written too, one byte per element.
            let o = node.outputs[0];
            for traffic in [&mut fused, &mut eager] {
                let target = if self.sharded(o) {
                    &mut traffic.sharded
                } else {
                    &mut traffic.replicated
                };
                target.add_dim(&self.numel(o), Ratio::ONE);
            }
        }
        if let (Op::RmsNorm { .. }, Some(&x), Some(&o)) =
            (&node.op, node.inputs.first(), node.outputs.first())
        {
            if self.an.is_activation(x) {
                let bytes = eager_rms_norm_bytes(bytes_of(x));
                eager = Traffic::default();
                let target = if self.sharded(o) {
                    &mut eager.sharded
                } else {
                    &mut eager.replicated
                };
                target.add_dim(&self.numel(x), Ratio::int(bytes as i64));
            }
        }
        (fused, eager)
    }

    fn op_cost(&self, n: NodeId) -> Option<OpCost> {
        let g = self.g;
        let node = g.node(n);
        let out = node.outputs.first().copied();
        let quadratic = out.is_some_and(|o| dplc_ir::attention_core(&self.numel(o), self.seq));
        match &node.op {
            Op::Input(_)
            | Op::Param(_)
            | Op::Constant(_)
            | Op::Iota { .. }
            | Op::Repeat { .. }
            | Op::Reshape { .. }
            | Op::Transpose { .. }
            | Op::Expand { .. }
            | Op::Slice { .. } => None,
            Op::MatMul => {
                let (a, b) = (node.inputs[0], node.inputs[1]);
                let o = out.expect("matmul has an output");
                let shape = &g.tensor(o).shape;
                let nd = shape.last().cloned().unwrap_or_else(|| Dim::konst(1));
                let kd = g
                    .tensor(a)
                    .shape
                    .last()
                    .cloned()
                    .unwrap_or_else(|| Dim::konst(1));
                let md = self.numel(o).checked_div(&nd)?;
                let split = self
                    .sharding
                    .gemms
                    .get(&n)
                    .copied()
                    .unwrap_or(GemmSplit::Replicated);
                let backward_gemms =
                    self.an.requires_grad(a) as u32 + self.an.requires_grad(b) as u32;
                let e = self.precision.bytes();
                let mut autocast_casts = Traffic::default();
                for t in [a, b] {
                    if g.tensor(t).dtype.is_float() && self.autocast_bytes(t) > e {
                        let c = &mut autocast_casts;
                        self.add_bytes(t, 4 + e, &mut c.sharded, &mut c.replicated);
                    }
                }
                let both_activations = self.an.is_activation(a) && self.an.is_activation(b);
                Some(OpCost {
                    node: n,
                    work: Work::Gemm {
                        m: poly(&md),
                        n: poly(&nd),
                        k: poly(&kd),
                        split,
                        backward_gemms,
                        autocast_casts,
                    },
                    attention_core: both_activations,
                    whole_sequence: false,
                    experts: node.outputs.iter().any(|&o| self.experts(o)),
                })
            }
            _ => {
                let uniform = |t: TensorId| elt_bytes(g.tensor(t).dtype, self.precision);
                let (fused, eager) = self.memory_traffic(n, uniform, uniform);
                // Fused, a tensor only GEMMs read is written in the GEMMs'
                // precision: torch.compile folds autocast's cast into the
                // kernel that produces it.
                let e = self.precision.bytes();
                let (autocast_fused, autocast_eager) = self.memory_traffic(
                    n,
                    |t| {
                        let wide = self.autocast_bytes(t);
                        if self.gemm_input(t) {
                            wide.min(e)
                        } else {
                            wide
                        }
                    },
                    |t| self.autocast_bytes(t),
                );
                let Traffic {
                    sharded,
                    replicated,
                } = fused;
                if eager.sharded.is_zero() && eager.replicated.is_zero() {
                    return None;
                }
                Some(OpCost {
                    node: n,
                    work: Work::Memory {
                        sharded,
                        replicated,
                        eager,
                        autocast: [autocast_fused, autocast_eager],
                    },
                    attention_core: quadratic,
                    whole_sequence: false,
                    experts: node.outputs.iter().any(|&o| self.experts(o)),
                })
            }
        }
    }
}

fn region_consumers(g: &Graph, nodes: &[NodeId]) -> BTreeMap<TensorId, Vec<NodeId>> {
    let mut map: BTreeMap<TensorId, Vec<NodeId>> = BTreeMap::new();
    for &n in nodes {
        for &t in &g.node(n).inputs {
            map.entry(t).or_default().push(n);
        }
    }
    map
}

/// Bytes per element of each float tensor of `region` under autocast (the
/// rules of [`RegionBuilder::autocast_bytes`]), in the region's order.
fn autocast_widths(
    g: &Graph,
    an: &Analysis,
    region: RegionId,
    precision: Precision,
) -> BTreeMap<TensorId, u64> {
    let e = precision.bytes();
    let mut widths: BTreeMap<TensorId, u64> = BTreeMap::new();
    for &n in &g.region(region).nodes {
        let node = g.node(n);
        let width = match &node.op {
            Op::MatMul => e,
            Op::LayerNorm { .. }
            | Op::RmsNorm { .. }
            | Op::Softmax { .. }
            | Op::LogSoftmax { .. }
            | Op::Reduce { .. }
            | Op::CumSum { .. }
            | Op::TakeAlong
            | Op::Embedding
            | Op::Input(_)
            | Op::Param(_)
            | Op::Constant(_) => 4,
            Op::Cast(dtype) => elt_bytes(*dtype, precision),
            _ => node
                .inputs
                .iter()
                .filter(|&&t| an.is_activation(t) && g.tensor(t).dtype.is_float())
                // An argument of the region: the fp32 residual stream.
                .map(|t| widths.get(t).copied().unwrap_or(4))
                .max()
                .unwrap_or(e),
        };
        for &o in &node.outputs {
            if g.tensor(o).dtype.is_float() {
                widths.insert(o, width);
            }
        }
    }
    widths
}

/// Build the profile of the nodes `nodes` of `region`.
#[allow(clippy::too_many_arguments)]
fn region_profile(
    g: &Graph,
    an: &Analysis,
    region: RegionId,
    nodes: &[NodeId],
    saved: &[dplc_ir::SavedTensor],
    sharding: &RegionSharding,
    precision: Precision,
    seq: Option<SymId>,
    context: Option<&dplc_ir::ContextTraffic>,
) -> RegionProfile {
    let reg = g.region(region);
    let mut escapes: BTreeSet<TensorId> = reg.results.iter().copied().collect();
    for &n in &reg.nodes {
        if let Op::Repeat { .. } = g.node(n).op {
            escapes.extend(g.node(n).inputs.iter().copied());
        }
    }
    let b = RegionBuilder {
        g,
        an,
        precision,
        autocast: autocast_widths(g, an, region, precision),
        seq,
        sharding,
        consumers: region_consumers(g, &reg.nodes),
        escapes,
        saved_roots: saved.iter().map(|s| s.tensor).collect(),
    };
    let node_set: BTreeSet<NodeId> = nodes.iter().copied().collect();
    let mut p = RegionProfile {
        ops: nodes.iter().filter_map(|&n| b.op_cost(n)).collect(),
        causal: nodes
            .iter()
            .any(|&n| matches!(g.node(n).op, Op::CausalMask)),
        window: nodes
            .iter()
            .filter_map(|&n| g.node(n).outputs.first())
            .find_map(|&t| dplc_ir::window_mask(g, t))
            .map(|m| m.window),
        ..RegionProfile::default()
    };
    for s in saved {
        let mut bytes = Poly::zero();
        bytes.add_dim(&s.elements, Ratio::int(s.kind.bytes(precision) as i64));
        let mut autocast_bytes = Poly::zero();
        let wide = match s.kind {
            dplc_ir::SavedKind::Float => b.autocast_bytes(s.tensor),
            kind => kind.bytes(precision),
        };
        autocast_bytes.add_dim(&s.elements, Ratio::int(wide as i64));
        p.saved.push(Saved {
            bytes,
            autocast_bytes,
            sharded: b.sharded(s.tensor),
            experts: b.experts(s.tensor),
            attention_core: dplc_ir::attention_core(&s.elements, seq),
            gemm_input: b.weight_gemm_input(s.tensor),
        });
    }
    for c in &sharding.collectives {
        let node_ok = match g.tensor(c.tensor).def {
            TensorDef::Node { node, .. } => node_set.contains(&node),
            TensorDef::Arg { .. } => true,
        };
        if !node_ok {
            continue;
        }
        let bytes = if c.fp32 { 4 } else { precision.bytes() };
        let what = match c.kind {
            TpCollectiveKind::AllReduce if c.pass == Pass::Forward => "row-parallel output",
            TpCollectiveKind::AllReduce => "column-parallel input gradient",
            TpCollectiveKind::AllGather => "gather of a sharded tensor",
            TpCollectiveKind::RowStats => "softmax row statistics (vocab-parallel loss)",
        };
        let split_gemm = |n: NodeId| {
            matches!(g.node(n).op, Op::MatMul)
                && sharding
                    .gemms
                    .get(&n)
                    .is_some_and(|s| *s != GemmSplit::Replicated)
        };
        let beside = if c.kind == TpCollectiveKind::AllReduce && c.pass == Pass::Forward {
            // The row-parallel GEMM writing the partial sums, through views.
            let mut t = c.tensor;
            loop {
                let TensorDef::Node { node, .. } = g.tensor(t).def else {
                    break Vec::new();
                };
                if g.node(node).op.is_view() {
                    t = g.node(node).inputs[0];
                } else {
                    break if split_gemm(node) {
                        vec![node]
                    } else {
                        Vec::new()
                    };
                }
            }
        } else {
            // The split GEMMs reading the tensor, directly or through views.
            let mut out = Vec::new();
            let mut frontier = vec![c.tensor];
            while let Some(t) = frontier.pop() {
                for &n in b.consumers.get(&t).map(Vec::as_slice).unwrap_or(&[]) {
                    let op = &g.node(n).op;
                    if op.is_view() {
                        frontier.push(g.node(n).outputs[0]);
                    } else if split_gemm(n) && g.node(n).inputs[0] == t {
                        out.push(n);
                    }
                }
            }
            out
        };
        // Under sequence parallelism a column-parallel GEMM keeps only the
        // sequence shard of its input (the forward all-gathered it), so its
        // backward all-gathers the shard again for the weight-gradient GEMM
        // (Megatron's `LinearWithGradAccumulationAndAsyncCommunication.backward`).
        // Its input gradient's all-reduce names exactly those GEMMs: the twin
        // moves the same tensor beside the same GEMMs' input-gradient halves.
        if c.kind == TpCollectiveKind::AllReduce && c.pass == Pass::Backward && !beside.is_empty() {
            p.collectives.push(CollectiveCost {
                kind: TpCollectiveKind::AllGather,
                pass: Pass::Backward,
                bytes: scaled(&c.elements, bytes),
                what: "sequence-parallel input re-gather (weight gradient)".to_string(),
                beside: beside.clone(),
                sequence_parallel_only: true,
            });
        }
        p.collectives.push(CollectiveCost {
            kind: c.kind,
            pass: c.pass,
            bytes: scaled(&c.elements, bytes),
            what: what.to_string(),
            beside,
            sequence_parallel_only: false,
        });
    }
    for &n in nodes {
        let node = g.node(n);
        match node.op {
            Op::MatMul => {
                let a = node.inputs[0];
                let o = node.outputs[0];
                let k = g.tensor(a).shape.last().cloned().unwrap_or(Dim::konst(1));
                if let Some(macs) = b.numel(o).checked_mul(&k) {
                    p.forward_flops.add_dim(&macs, Ratio::int(2));
                }
            }
            Op::MoeDispatch { .. } | Op::MoeCombine => {}
            _ => {}
        }
    }
    if let Some(ctx) = context {
        // The whole tensor's elements: `Bind::eval` takes one rank's share
        // (its `seq / cp` positions), as every rank sends its own.
        for gather in ctx.gathers.iter().filter(|g| node_set.contains(&g.reader)) {
            let bytes = Ratio::int(precision.bytes() as i64);
            let (forward, backward) = if gather.value.is_some_and(|t| b.sharded(t)) {
                (&mut p.cp_gather_bytes, &mut p.cp_reduce_scatter_bytes)
            } else {
                (
                    &mut p.cp_gather_whole_bytes,
                    &mut p.cp_reduce_scatter_whole_bytes,
                )
            };
            forward.add_dim(&gather.elements, bytes);
            if gather.grad {
                backward.add_dim(&gather.elements, bytes);
            }
        }
        for op in &mut p.ops {
            op.whole_sequence = ctx.whole.contains(&op.node);
        }
    }
    for e in &sharding.all_to_all {
        p.all_to_all_bytes
            .add_dim(e, Ratio::int(precision.bytes() as i64));
    }
    p
}

fn param_counts(
    g: &Graph,
    params: &[ParamId],
    sharding: &RegionSharding,
    per_iteration: bool,
) -> ParamCounts {
    let mut c = ParamCounts::default();
    for &p in params {
        let info = g.param(p);
        let n = if per_iteration {
            info.shape
                .dims()
                .iter()
                .map(|d| d.as_const().unwrap_or(0) as f64)
                .product::<f64>()
        } else {
            g.param_elements(p) as f64
        };
        let split = sharding.split_params.contains_key(&p);
        let expert = sharding.expert_params.contains(&p);
        match (split, expert) {
            (true, false) => c.tp_split += n,
            (false, false) => c.replicated += n,
            (true, true) => c.expert_tp_split += n,
            (false, true) => c.expert_replicated += n,
        }
    }
    c
}

/// The layer body the planner splits by, or why the model cannot be planned.
pub(crate) fn layer_body(g: &Graph, an: &Analysis) -> Result<RegionId, PlanError> {
    an.layer_body().ok_or_else(|| {
        PlanError::Model(format!(
            "model `{}` has no `repeat` of layers; the planner splits models by layer",
            g.name
        ))
    })
}

impl ModelProfile {
    /// The profile of `g` under the layouts of its layer stacks' bodies
    /// (`stack_sh`, one per stack in program order) and of the root's
    /// embedding and head (`root_sh`).
    pub fn new(
        g: &Graph,
        an: &Analysis,
        precision: Precision,
        stack_sh: &[&RegionSharding],
        root_sh: &RegionSharding,
    ) -> Result<ModelProfile, PlanError> {
        layer_body(g, an)?;
        let bodies = an.stacks();
        assert_eq!(bodies.len(), stack_sh.len(), "one layout per layer stack");
        let seq_sym = g.sym_by_name("seq");
        let batch_sym = g.sym_by_name("batch");
        let context = dplc_ir::context_traffic(g);
        let context = context.as_ref();

        // The root: nodes before the first repeat feed the first stage,
        // nodes between two repeats run with the later stack's first layer,
        // nodes after the last belong to the last stage.
        let root = g.root();
        let root_nodes = &g.region(root).nodes;
        let mut segments: Vec<&[NodeId]> = Vec::new();
        let mut from = 0;
        for (i, &n) in root_nodes.iter().enumerate() {
            if matches!(g.node(n).op, Op::Repeat { .. }) {
                segments.push(&root_nodes[from..i]);
                from = i + 1;
            }
        }
        let post_nodes = &root_nodes[from..];
        let segment_of: BTreeMap<NodeId, usize> = segments
            .iter()
            .enumerate()
            .flat_map(|(i, seg)| seg.iter().map(move |&n| (n, i)))
            .collect();
        let mut seg_saved: Vec<Vec<dplc_ir::SavedTensor>> = vec![Vec::new(); segments.len()];
        let mut post_saved = Vec::new();
        for s in an.activations(root).saved {
            match segment_of.get(&s.saved_by) {
                Some(&i) => seg_saved[i].push(s),
                None => post_saved.push(s),
            }
        }
        let root_profile = |nodes: &[NodeId], saved: &[dplc_ir::SavedTensor]| {
            region_profile(
                g, an, root, nodes, saved, root_sh, precision, seq_sym, context,
            )
        };
        let pre = root_profile(segments[0], &seg_saved[0]);
        let post = root_profile(post_nodes, &post_saved);

        // Parameters: a stack's are declared in its body (counted per
        // iteration); the root's belong to the part that uses them.
        let body_index: BTreeMap<RegionId, usize> = bodies
            .iter()
            .enumerate()
            .map(|(i, &(_, body, _))| (body, i))
            .collect();
        let mut stack_params: Vec<Vec<ParamId>> = vec![Vec::new(); bodies.len()];
        let (mut pre_params, mut post_params) = (Vec::new(), Vec::new());
        let pre_set: BTreeSet<NodeId> = segments[0].iter().copied().collect();
        let consumers = region_consumers(g, root_nodes);
        let mut tied = Vec::new();
        let mut param_layout = Vec::new();
        let mut matrices = Vec::new();
        for (p, info) in g.params() {
            let region = g.tensor_region(info.tensor);
            let split = stack_sh
                .iter()
                .find_map(|sh| sh.split_params.get(&p))
                .or_else(|| root_sh.split_params.get(&p))
                .copied();
            let expert = stack_sh.iter().any(|sh| sh.expert_params.contains(&p));
            param_layout.push((info.name.clone(), g.param_elements(p), split, expert));
            let dims: Vec<u64> = info
                .shape
                .dims()
                .iter()
                .map(|d| d.as_const().unwrap_or(0).max(0) as u64)
                .collect();
            let numel: u64 = dims.iter().product();
            if dplc_ir::topk_sparsifies(&dims) && numel > 0 {
                matrices.push((dims, g.param_elements(p) as f64 / numel as f64));
            }
            if region != root {
                // A parameter of a region nested in a body counts with the
                // first stack (nested repeats are not layer stacks).
                stack_params[body_index.get(&region).copied().unwrap_or(0)].push(p);
                continue;
            }
            let users = root_uses(g, an, info.tensor, &consumers);
            let before = users.iter().any(|n| pre_set.contains(n));
            let after = users.iter().any(|n| !pre_set.contains(n));
            if before {
                pre_params.push(p);
            }
            if after || !before {
                post_params.push(p);
            }
            if before && after {
                tied.push(p);
            }
        }
        let mut pre = pre;
        pre.params = param_counts(g, &pre_params, root_sh, false);
        let mut post = post;
        post.params = param_counts(g, &post_params, root_sh, false);

        let mut stacks = Vec::with_capacity(bodies.len());
        let mut first = 0;
        for (i, &(repeat, body, count)) in bodies.iter().enumerate() {
            let body_nodes = &g.region(body).nodes;
            let mut layer = region_profile(
                g,
                an,
                body,
                body_nodes,
                &an.activations(body).saved,
                stack_sh[i],
                precision,
                seq_sym,
                context,
            );
            layer.params = param_counts(g, &stack_params[i], stack_sh[i], true);
            let lead_in = if i == 0 {
                RegionProfile::default()
            } else {
                root_profile(segments[i], &seg_saved[i])
            };
            let carried = match g.node(repeat).op {
                Op::Repeat { carried, .. } => carried,
                _ => 0,
            };
            let (mut carried_bytes, mut input_bytes) = (Poly::zero(), Poly::zero());
            for (j, &a) in g.region(body).args.iter().enumerate() {
                let t = g.tensor(a);
                let Some(e) = t.shape.numel() else { continue };
                let outer = g.node(repeat).inputs.get(j).copied();
                if j >= carried && !outer.is_some_and(|t| an.is_activation(t)) {
                    continue;
                }
                let b = Ratio::int(elt_bytes(t.dtype, precision) as i64);
                input_bytes.add_dim(&e, b);
                if j < carried {
                    carried_bytes.add_dim(&e, b);
                }
            }
            let (attention_core_flops, op_recompute_flops) = layer_flops(g, an, body_nodes);
            stacks.push(StackProfile {
                first,
                layers: count,
                layer,
                lead_in,
                input_bytes,
                carried_bytes,
                attention_core_flops,
                op_recompute_flops,
            });
            first += count;
        }
        Ok(ModelProfile {
            name: g.name.clone(),
            layers: first,
            stacks,
            pre,
            post,
            tied_params: param_counts(g, &tied, root_sh, false),
            precision,
            batch_sym,
            seq_sym,
            experts: dplc_ir::validate::model_experts(g),
            context_refusal: dplc_ir::validate::context_refusal(g),
            total_params: g.param_count(),
            forward_flops: an.forward_flops(),
            param_layout,
            matrices,
        })
    }
}

/// One layer's forward FLOPs of its core attention and of the weight GEMMs
/// op-level checkpointing recomputes (the 2nd, 4th, … in the layer's order).
fn layer_flops(g: &Graph, an: &Analysis, body_nodes: &[NodeId]) -> (Poly, Poly) {
    let mut attention_core_flops = Poly::zero();
    let mut op_recompute_flops = Poly::zero();
    let mut weight_gemms = 0;
    for &n in body_nodes {
        let node = g.node(n);
        if !matches!(node.op, Op::MatMul) {
            continue;
        }
        // Multiply-accumulates of the matmul: output elements × k.
        let k = g
            .tensor(node.inputs[0])
            .shape
            .last()
            .cloned()
            .unwrap_or(Dim::konst(1));
        let macs = g
            .tensor(node.outputs[0])
            .shape
            .numel()
            .and_then(|e| e.checked_mul(&k));
        if node.inputs.iter().all(|&t| an.is_activation(t)) {
            if let Some(macs) = macs {
                attention_core_flops.add_dim(&macs, Ratio::int(2));
            }
        } else {
            weight_gemms += 1;
            if weight_gemms % 2 == 0 {
                if let Some(macs) = macs {
                    op_recompute_flops.add_dim(&macs, Ratio::int(2));
                }
            }
        }
    }
    (attention_core_flops, op_recompute_flops)
}

/// The root nodes that use parameter tensor `t`, looking through views and casts.
fn root_uses(
    g: &Graph,
    an: &Analysis,
    t: TensorId,
    consumers: &BTreeMap<TensorId, Vec<NodeId>>,
) -> Vec<NodeId> {
    let mut out = Vec::new();
    let mut stack = vec![t];
    while let Some(t) = stack.pop() {
        for &n in consumers.get(&t).map(Vec::as_slice).unwrap_or(&[]) {
            let node = g.node(n);
            if (node.op.is_view() || matches!(node.op, Op::Cast(_))) && !an.is_activation(t) {
                stack.extend(node.outputs.iter().copied());
            } else {
                out.push(n);
            }
        }
    }
    out
}
