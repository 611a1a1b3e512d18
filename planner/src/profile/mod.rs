//! What the cost model needs from a graph, computed once per model: per-op
//! work (GEMM shapes, memory traffic), stored activations and collectives, each
//! tagged with how tensor parallelism divides it. This module holds the
//! profile's types and puts the model together (its stacks, the root's
//! segments, the parameter counts); `region` profiles one region's ops.

use crate::sharding::{GemmSplit, Pass, RegionSharding, TpCollectiveKind};
use crate::PlanError;
use dplc_ir::{
    Analysis, Dim, Graph, NodeId, Op, ParamId, Poly, Precision, Ratio, RegionId, SymId, TensorId,
};
use std::collections::{BTreeMap, BTreeSet};

mod region;
use region::{elt_bytes, region_consumers, region_profile};

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
    /// The log-softmax or the gather of a cross-entropy: priced with the
    /// region's [`RegionProfile::cross_entropy`] when the loss is unfused.
    pub cross_entropy: bool,
    /// For an attention's two matmuls, the mask on its scores: a fused
    /// kernel skips the key tiles it removes, and model FLOPs leave out the
    /// pairs. Each attention its own: a decoder layer's causal
    /// self-attention beside its unmasked cross-attention.
    pub mask: AttentionMask,
}

/// The mask on one attention's scores.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct AttentionMask {
    /// Keys after the query weigh nothing.
    pub causal: bool,
    /// Keys a query sees under a sliding window (`dplc_ir::window_mask`).
    pub window: Option<u64>,
    /// The keys' length where it is fixed (a T5 decoder's targets); `None`
    /// where it is the sequence's.
    pub keys: Option<u64>,
}

impl AttentionMask {
    /// The length the mask's shares are taken over: its own, or `seq`.
    pub fn length(&self, seq: u64) -> u64 {
        self.keys.unwrap_or(seq)
    }
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
    /// The logits of a cross-entropy: kept for a fused loss's backward,
    /// where an unfused loss keeps their fp32 softmax instead.
    pub logits: bool,
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

/// An MoE layer's routing: each token goes to `top_k` of `experts`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct Routing {
    pub experts: u64,
    pub top_k: u64,
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
    /// Both ways of the region's token dispatch and combine, every
    /// (token, expert) pair counted: what one all-to-all moves.
    pub all_to_all_bytes: Poly,
    /// The region's MoE routing, where it has one: what decides how much of
    /// `all_to_all_bytes` a hierarchical dispatcher sends.
    pub routing: Option<Routing>,
    /// Scores the attention's dropout draws for (elements of the dropouts
    /// on attention-core tensors, by how they split over tp): what a fused
    /// kernel pays for beyond its matmuls (`Device::attention_dropout_s`).
    pub attention_dropout: Traffic,
    pub params: ParamCounts,
    pub forward_flops: Poly,
    /// Elements of the logits of the region's cross-entropy losses, by how
    /// they split over tp: what an unfused loss passes over again and again.
    pub cross_entropy: Traffic,
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
