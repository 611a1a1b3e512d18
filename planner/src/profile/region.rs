//! One region's profile: what each op of a layer body (or of the root's
//! embedding and head) costs — its GEMM shapes, the bytes its memory-bound
//! kernel moves fused and eager, at the training precision and under
//! autocast's per-tensor widths — what the region keeps for backward, and
//! the collectives its layout inserts.

use super::{AttentionMask, CollectiveCost, OpCost, RegionProfile, Routing, Saved, Traffic, Work};
use crate::sharding::{GemmSplit, Pass, RegionSharding, TpCollectiveKind};
use dplc_ir::{
    Analysis, DType, Dim, Graph, NodeId, Op, Poly, Precision, Ratio, RegionId, SymId, TensorDef,
    TensorId,
};
use std::collections::{BTreeMap, BTreeSet};

fn poly(d: &Dim) -> Poly {
    Poly::from_dim(d)
}

fn scaled(d: &Dim, r: u64) -> Poly {
    let mut p = Poly::zero();
    p.add_dim(d, Ratio::int(r as i64));
    p
}

pub(super) fn elt_bytes(dtype: DType, precision: Precision) -> u64 {
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
                    cross_entropy: false,
                    mask: AttentionMask::default(),
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
                    cross_entropy: false,
                    mask: AttentionMask::default(),
                })
            }
        }
    }
}

/// The mask on each attention's scores, for its two matmuls (the scores'
/// `Q·Kᵀ` and the probabilities' product with the values): walking back
/// from a matmul of two activations through the tensors of its operand's
/// `[queries, keys]` shape, reaching another such matmul makes the pair an
/// attention, a `causal_mask` on the way makes it causal and a subtracted
/// `dplc_ir::window_mask` windowed. By shape, not by the sequence: a T5
/// decoder's self-attention over its fixed-length targets is causal, its
/// cross-attention to the encoder not.
fn attention_masks(g: &Graph, an: &Analysis, nodes: &[NodeId]) -> BTreeMap<NodeId, AttentionMask> {
    let in_region: BTreeSet<NodeId> = nodes.iter().copied().collect();
    let of_activations = |n: NodeId| {
        let node = g.node(n);
        node.op == Op::MatMul && node.inputs.iter().all(|&t| an.is_activation(t))
    };
    let last_two = |t: TensorId| {
        let dims = g.tensor(t).shape.dims();
        dims[dims.len().saturating_sub(2)..].to_vec()
    };
    let mut masks = BTreeMap::new();
    for &n in nodes {
        if !of_activations(n) {
            continue;
        }
        for &operand in &g.node(n).inputs {
            let shape = last_two(operand);
            let keys = shape
                .last()
                .and_then(|d| d.as_const())
                .and_then(|k| u64::try_from(k).ok());
            let (mut mask, mut qk) = (
                AttentionMask {
                    keys,
                    ..AttentionMask::default()
                },
                Vec::new(),
            );
            let (mut stack, mut seen) = (vec![operand], BTreeSet::new());
            while let Some(t) = stack.pop() {
                if !seen.insert(t) {
                    continue;
                }
                if let Some(w) = dplc_ir::window_mask(g, t) {
                    mask.window = Some(w.window);
                    continue;
                }
                let TensorDef::Node { node: p, .. } = g.tensor(t).def else {
                    continue;
                };
                if !in_region.contains(&p) {
                    continue;
                }
                if of_activations(p) {
                    // The scores' own matmul: where the walk stops.
                    qk.push(p);
                    continue;
                }
                let node = g.node(p);
                if node.op == Op::MatMul {
                    continue;
                }
                mask.causal |= node.op == Op::CausalMask;
                stack.extend(
                    node.inputs
                        .iter()
                        .copied()
                        .filter(|&u| last_two(u) == shape),
                );
            }
            if !qk.is_empty() {
                for m in qk.into_iter().chain([n]) {
                    masks.insert(m, mask);
                }
            }
        }
    }
    masks
}

pub(super) fn region_consumers(g: &Graph, nodes: &[NodeId]) -> BTreeMap<TensorId, Vec<NodeId>> {
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
pub(super) fn region_profile(
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
    let masks = attention_masks(g, an, nodes);
    let mut p = RegionProfile {
        ops: nodes
            .iter()
            .filter_map(|&n| b.op_cost(n))
            .map(|mut op| {
                op.mask = masks.get(&op.node).copied().unwrap_or_default();
                op
            })
            .collect(),
        ..RegionProfile::default()
    };
    // The cross-entropies: a log-softmax whose output only the loss's
    // gather reads. Their logits, and the two ops that an unfused loss
    // replaces with its passes.
    let mut logits = BTreeSet::new();
    for &n in nodes {
        let node = g.node(n);
        let (Op::LogSoftmax { .. }, [x], [o]) = (&node.op, &node.inputs[..], &node.outputs[..])
        else {
            continue;
        };
        if !b.fused_loss(*o) || !an.is_activation(*x) {
            continue;
        }
        logits.insert(*x);
        let ce = &mut p.cross_entropy;
        b.add_bytes(*x, 1, &mut ce.sharded, &mut ce.replicated);
        let gather = b.consumers.get(o).and_then(|c| c.first()).copied();
        for op in &mut p.ops {
            if op.node == n || Some(op.node) == gather {
                op.cross_entropy = true;
            }
        }
    }
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
            logits: logits.contains(&s.tensor),
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
            // A zero probability draws nothing (the kernels skip it).
            Op::Dropout { p: rate, .. }
                if rate > 0.0 && dplc_ir::attention_core_tensor(g, node.outputs[0]) =>
            {
                let scores = &mut p.attention_dropout;
                b.add_bytes(
                    node.outputs[0],
                    1,
                    &mut scores.sharded,
                    &mut scores.replicated,
                );
            }
            Op::MoeDispatch { experts, .. } => {
                let top_k = g
                    .tensor(node.inputs[1])
                    .shape
                    .last()
                    .and_then(Dim::as_const);
                p.routing = top_k.map(|k| Routing {
                    experts: experts as u64,
                    top_k: k as u64,
                });
            }
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
