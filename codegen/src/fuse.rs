//! Fusion: splits a region into cuBLAS matmul calls, opaque steps the runtime
//! runs itself, and maximal fused kernels of elementwise ops and row reductions.
//!
//! The plan picks which tensors are *materialized* (written to memory); every
//! other fusible tensor is recomputed inside the kernel of each materialized
//! tensor that needs it, views included (they become index arithmetic). A kernel
//! holds at most one row operation (softmax, norm, reduce): its *anchor*.

use crate::attention::{
    AttentionBuffer, AttentionDropout, AttentionKernel, AttentionOperand, Strided,
};
use crate::attention_match::{match_attention, AttentionMatch, Region as MatchRegion, View};
use crate::kernel::{
    drop_threshold, Buffer, Builder, Cond, DrawKey, Elem, Expr, Idx, Kernel, RowReduce, Size,
    Space, Store, ValueId,
};
use dplc_ir::{
    AttentionKind, BinaryOp, DType, Dim, Graph, NodeId, Op, ReduceKind, RegionId, Shape, TensorId,
    UnaryOp,
};
use std::collections::{BTreeSet, HashMap, HashSet};

/// A matmul operand: the materialized tensor it reads, possibly with the last two axes swapped.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Operand {
    /// The tensor in memory (a reshape of it is the operand).
    pub tensor: TensorId,
    /// The operand is this tensor with its last two axes swapped (a cuBLAS transpose flag).
    pub transposed: bool,
}

/// One fused kernel and how to bind it.
#[derive(Clone, Debug, PartialEq)]
pub struct FusedKernel {
    pub kernel: Kernel,
    /// The graph tensor behind each kernel buffer.
    pub buffers: Vec<TensorId>,
    /// The symbolic dimension behind each size argument `n{k}`; for the
    /// arguments in `key_sizes` a placeholder 0 (a launch may leave them 0:
    /// the draws are then still a pure function of the key).
    pub sizes: Vec<Dim>,
    /// The size arguments that carry the run-time words of a dropout key
    /// ([`DrawKey`]), set by the executor at each launch.
    pub key_sizes: Vec<(usize, KeySize)>,
    /// The graph nodes computed (or recomputed) inside the kernel.
    pub nodes: Vec<NodeId>,
}

/// A size argument that is a word of the dropout key rather than a dimension.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KeySize {
    /// The flat `repeat` iteration (0 outside a `repeat`).
    Layer,
    /// Global index of the micro-batch's first sample.
    FirstSample,
    /// Elements per sample of this tensor (a dropout's output) in the
    /// micro-batch, as the CPU reference splits it: `numel / micro_batch`
    /// when that divides and is below `numel` or the micro-batch is one
    /// sample, else 0 (one key shared by every sample).
    PerSample(TensorId),
    /// [`KeySize::PerSample`] of the whole tensor of which this tensor (a
    /// dropout's output in a rank's program) is the rank's part: its
    /// elements times `tp` when it is split over the tensor-parallel group
    /// (`split`), times `cp` when it holds the rank's sequence chunks
    /// (`context`).
    WholePerSample {
        tensor: TensorId,
        split: bool,
        context: bool,
    },
    /// The rank's place in its context-parallel group (0 without one).
    ContextRank,
    /// The size of the context-parallel group (1 without one).
    ContextRanks,
    /// The rank's place in its tensor-parallel group (0 without one).
    SplitPart,
    /// The size of the tensor-parallel group (1 without one).
    SplitParts,
}

/// Where a launch runs: what the dropout key's size arguments
/// ([`KeySize`]) read besides the tensors' sizes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KeyPlace {
    /// The flat `repeat` iteration (0 outside a `repeat`).
    pub layer: u64,
    /// Global index of the micro-batch's first sample.
    pub first_sample: u64,
    /// Samples in the micro-batch.
    pub micro_batch: usize,
    /// The rank's place in its context-parallel group and the group's size.
    pub cp_rank: usize,
    pub cp: usize,
    /// The rank's place in its tensor-parallel group and the group's size.
    pub tp_rank: usize,
    pub tp: usize,
}

impl KeyPlace {
    /// Micro-batch `micro_batch` samples from `first_sample`, at `layer`,
    /// on a rank with no tensor or context split.
    pub fn unsplit(layer: u64, first_sample: u64, micro_batch: usize) -> KeyPlace {
        KeyPlace {
            layer,
            first_sample,
            micro_batch,
            cp_rank: 0,
            cp: 1,
            tp_rank: 0,
            tp: 1,
        }
    }

    /// Bind every dropout key argument `keys` names in `sizes` (a launch's
    /// size arguments) at this place; `numel` counts a tensor's elements.
    pub fn bind_keys(
        &self,
        sizes: &mut [i64],
        keys: &[(usize, KeySize)],
        numel: impl Fn(TensorId) -> usize,
    ) {
        for &(i, key) in keys {
            sizes[i] = key.bind(self, &numel);
        }
    }
}

impl KeySize {
    /// The size argument's value at `at`, with `numel` counting a tensor's
    /// elements in the rank's program: the one binding every launcher
    /// (the fused executor, the kernels' tests) shares.
    pub fn bind(self, at: &KeyPlace, numel: impl Fn(TensorId) -> usize) -> i64 {
        match self {
            KeySize::Layer => at.layer as i64,
            KeySize::FirstSample => at.first_sample as i64,
            KeySize::PerSample(t) => elements_per_sample(numel(t), at.micro_batch) as i64,
            KeySize::WholePerSample {
                tensor,
                split,
                context,
            } => {
                let tp = if split { at.tp } else { 1 };
                let cp = if context { at.cp } else { 1 };
                elements_per_sample(numel(tensor) * tp * cp, at.micro_batch) as i64
            }
            KeySize::ContextRank => at.cp_rank as i64,
            KeySize::ContextRanks => at.cp as i64,
            KeySize::SplitPart => at.tp_rank as i64,
            KeySize::SplitParts => at.tp as i64,
        }
    }
}

/// Elements per sample of a dropout's output of `numel` elements (of the
/// whole tensor) in a micro-batch of `micro_batch` samples: `numel /
/// micro_batch` when that divides (the batch axis is outermost, so each
/// sample's elements are contiguous), or 0 where the tensor does not
/// depend on the sample and every element is keyed with the one shared
/// sample (see [`crate::DrawKey`]). The CPU reference's masks and the
/// kernels' draws both split by this rule.
pub fn elements_per_sample(numel: usize, micro_batch: usize) -> usize {
    let per = if micro_batch > 0 && numel.is_multiple_of(micro_batch) {
        numel / micro_batch
    } else {
        numel
    };
    if per == numel && micro_batch != 1 {
        0
    } else {
        per
    }
}

/// One fused attention and how to bind it.
#[derive(Clone, Debug, PartialEq)]
pub struct FusedAttention {
    pub kernel: AttentionKernel,
    /// The graph tensors whose buffers the operands read (the output's is
    /// written): each a tensor in memory, read through the views the
    /// kernel's strides spell out.
    pub q: TensorId,
    pub k: TensorId,
    pub v: TensorId,
    pub bias: Option<TensorId>,
    pub out: TensorId,
    /// The symbolic dimension behind each size argument `n{k}` (as
    /// [`FusedKernel::sizes`], the dropout key's words in `key_sizes`).
    pub sizes: Vec<Dim>,
    pub key_sizes: Vec<(usize, KeySize)>,
    /// The graph nodes the kernel computes: the score matmul … the `P·V`
    /// matmul and the views of its product it writes.
    pub nodes: Vec<NodeId>,
}

impl FusedAttention {
    /// The graph tensor a buffer role stands for (its gradient, for a
    /// gradient's role); `None` for the log-sum-exp and δ, which the graph
    /// lacks.
    pub fn tensor(&self, role: AttentionBuffer) -> Option<TensorId> {
        use AttentionBuffer::*;
        match role {
            Q | QGrad => Some(self.q),
            K | KGrad => Some(self.k),
            V | VGrad => Some(self.v),
            Bias | BiasGrad => self.bias,
            Out | OutGrad => Some(self.out),
            LogSumExp | Delta => None,
        }
    }

    /// The tensors it reads.
    pub fn inputs(&self) -> Vec<TensorId> {
        let mut v = vec![self.q, self.k, self.v];
        v.extend(self.bias);
        v
    }
}

/// One step of a region, in execution order.
#[derive(Clone, Debug, PartialEq)]
// A plan holds a few dozen steps, built once per graph and read in place:
// boxing the kernel would only add an indirection to every read.
#[allow(clippy::large_enum_variant)]
pub enum Step {
    /// A generated kernel.
    Kernel(FusedKernel),
    /// A (batched) matmul for cuBLAS / cuBLASLt.
    MatMul {
        node: NodeId,
        a: Operand,
        b: Operand,
    },
    /// One attention's core, `Q·Kᵀ` to `P·V`, as one kernel (FlashAttention-2 style).
    Attention(FusedAttention),
    /// A node the runtime executes itself (top-k, MoE routing, `repeat`), or
    /// one codegen cannot lower yet, with the reason.
    Extern { node: NodeId, reason: String },
}

/// How one region runs.
#[derive(Clone, Debug, PartialEq)]
pub struct FusionPlan {
    pub region: RegionId,
    pub steps: Vec<Step>,
    /// Each attention left to the unfused path (its score matmul) and why
    /// the fused kernel cannot take it.
    pub unfused_attention: Vec<(NodeId, String)>,
}

/// What fusion does beyond its fixed rules.
#[derive(Clone, Copy, Debug)]
pub struct FuseConfig<'a> {
    /// Root values kept in memory: they cross a pipeline cut, so they are
    /// sent from where they are computed and no kernel on the far side may
    /// recompute them inline.
    pub cut: &'a [TensorId],
    /// How attention runs: each one the fused kernel takes as one
    /// [`Step::Attention`] (`Fused`, `Flash2`), or op by op (`Unfused`).
    pub attention: AttentionKind,
}

impl Default for FuseConfig<'_> {
    fn default() -> Self {
        FuseConfig {
            cut: &[],
            attention: AttentionKind::Fused,
        }
    }
}

impl FusionPlan {
    pub fn kernels(&self) -> impl Iterator<Item = &FusedKernel> {
        self.steps.iter().filter_map(|s| match s {
            Step::Kernel(k) => Some(k),
            _ => None,
        })
    }
}

/// Fuse every region of `graph` (the root and each `repeat` body).
pub fn fuse_graph(graph: &Graph) -> Vec<FusionPlan> {
    graph.regions().map(|(r, _)| fuse(graph, r)).collect()
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Role {
    /// Already in memory: parameters, inputs, region arguments.
    Source,
    /// Computed by a library call or the runtime.
    Library,
    /// Index or value arithmetic that is always recomputed where it is needed.
    Inline,
    Fusible,
    Row,
}

fn role(op: &Op) -> Role {
    match op {
        Op::Input(_) | Op::Param(_) => Role::Source,
        Op::MatMul
        | Op::TopK { .. }
        | Op::MoeDispatch { .. }
        | Op::MoeCombine
        | Op::Repeat { .. }
        | Op::Relayout { .. }
        | Op::VocabParallel(_) => Role::Library,
        Op::Constant(_)
        | Op::Iota { .. }
        | Op::Transpose { .. }
        | Op::Reshape { .. }
        | Op::Expand { .. }
        | Op::Slice { .. } => Role::Inline,
        Op::Unary(_)
        | Op::Binary(_)
        | Op::Cast(_)
        | Op::Concat { .. }
        | Op::Pad { .. }
        | Op::Dropout { .. }
        | Op::CausalMask
        | Op::Select
        | Op::Embedding
        | Op::TakeAlong => Role::Fusible,
        Op::Reduce { .. }
        | Op::Softmax { .. }
        | Op::LogSoftmax { .. }
        | Op::LayerNorm { .. }
        | Op::RmsNorm { .. }
        // A running sum: each element reads its row's prefix, a scan along
        // the row (`Expr::Scan`).
        | Op::CumSum { .. } => Role::Row,
    }
}

/// The axis a row operation reduces over.
fn row_axis(g: &Graph, node: NodeId) -> usize {
    let n = g.node(node);
    match n.op {
        Op::Reduce { axis, .. }
        | Op::Softmax { axis }
        | Op::LogSoftmax { axis }
        | Op::CumSum { axis, .. } => axis,
        _ => g.tensor(n.inputs[0]).shape.rank() - 1,
    }
}

fn is_last_two_swap(perm: &[usize]) -> bool {
    let r = perm.len();
    r >= 2 && perm[r - 1] == r - 2 && perm[r - 2] == r - 1 && (0..r - 2).all(|i| perm[i] == i)
}

struct Analysis<'g> {
    g: &'g Graph,
    region: RegionId,
    /// Position of each node of the region.
    pos: HashMap<NodeId, usize>,
    consumers: HashMap<TensorId, Vec<NodeId>>,
    materialized: HashSet<TensorId>,
    /// Outputs of fused attention steps.
    attention_out: HashSet<TensorId>,
}

impl<'g> Analysis<'g> {
    fn producer_role(&self, t: TensorId) -> Role {
        match self.g.producer(t) {
            Some(n) if self.g.tensor_region(t) == self.region => role(&n.op),
            _ => Role::Source,
        }
    }

    fn in_memory(&self, t: TensorId) -> bool {
        matches!(self.producer_role(t), Role::Source | Role::Library)
            || self.materialized.contains(&t)
            || self.attention_out.contains(&t)
    }

    /// Mark what a library operand reads: through reshapes, and one swap of the last two axes.
    fn operand(&mut self, x: TensorId, allow_transpose: bool) -> Operand {
        let mut t = x;
        let mut transposed = false;
        if allow_transpose {
            if let Some(n) = self.g.producer(t) {
                if let Op::Transpose { perm } = &n.op {
                    if is_last_two_swap(perm) {
                        transposed = true;
                        t = n.inputs[0];
                    }
                }
            }
        }
        while let Some(n) = self.g.producer(t) {
            match n.op {
                Op::Reshape { .. } => t = n.inputs[0],
                _ => break,
            }
        }
        if !self.in_memory(t) {
            self.materialized.insert(t);
        }
        Operand {
            tensor: t,
            transposed,
        }
    }

    /// Whether `t`'s recomputed ancestry holds a row operation.
    fn has_row_ancestor(&self, t: TensorId) -> bool {
        let mut stack = vec![t];
        let mut seen = HashSet::new();
        while let Some(t) = stack.pop() {
            if !seen.insert(t) || self.in_memory(t) {
                continue;
            }
            let n = self
                .g
                .producer(t)
                .expect("not in memory, so produced by a node");
            if role(&n.op) == Role::Row {
                return true;
            }
            stack.extend(n.inputs.iter().copied());
        }
        false
    }

    /// The one row operation in `t`'s recomputed ancestry, if any.
    fn anchor_of(&self, t: TensorId) -> Result<Option<NodeId>, String> {
        let mut stack = vec![t];
        let mut seen = HashSet::new();
        let mut found = None;
        let mut first = true;
        while let Some(t) = stack.pop() {
            if !seen.insert(t) || (!first && self.in_memory(t)) {
                continue;
            }
            first = false;
            let Some(n) = self.g.producer(t) else {
                continue;
            };
            if role(&n.op) == Role::Row {
                let id = node_of(self.g, t);
                if found.is_some_and(|f| f != id) {
                    return Err("two row operations would share one kernel".into());
                }
                found = Some(id);
            }
            stack.extend(n.inputs.iter().copied());
        }
        Ok(found)
    }
}

fn node_of(g: &Graph, t: TensorId) -> NodeId {
    match g.tensor(t).def {
        dplc_ir::TensorDef::Node { node, .. } => node,
        dplc_ir::TensorDef::Arg { .. } => unreachable!("arguments have no producer"),
    }
}

/// Plan one region: which tensors are materialized, and the steps that make them.
pub fn fuse(g: &Graph, region: RegionId) -> FusionPlan {
    fuse_with(g, region, &FuseConfig::default())
}

/// [`fuse`], with the tensors of `cut` (through their reshapes) kept in
/// memory too: values that cross a pipeline cut are sent from where they are
/// computed, so no kernel on the far side may recompute them inline.
pub fn fuse_cut(g: &Graph, region: RegionId, cut: &[TensorId]) -> FusionPlan {
    fuse_with(
        g,
        region,
        &FuseConfig {
            cut,
            ..FuseConfig::default()
        },
    )
}

/// [`fuse`] as `config` says.
pub fn fuse_with(g: &Graph, region: RegionId, config: &FuseConfig) -> FusionPlan {
    let cut = config.cut;
    let reg = g.region(region);
    let mut a = Analysis {
        g,
        region,
        pos: reg.nodes.iter().enumerate().map(|(i, &n)| (n, i)).collect(),
        consumers: HashMap::new(),
        materialized: HashSet::new(),
        attention_out: HashSet::new(),
    };
    for &n in &reg.nodes {
        let node = g.node(n);
        let mut seen = HashSet::new();
        for &t in &node.inputs {
            if seen.insert(t) {
                a.consumers.entry(t).or_default().push(n);
            }
        }
    }
    let (attentions, unfused_attention) = if config.attention.is_fused() {
        find_attention(&a, cut)
    } else {
        (Vec::new(), Vec::new())
    };
    // What the attention kernels compute runs nowhere else; their outputs
    // are in memory, their operands must be.
    let in_attention: HashSet<NodeId> = attentions
        .iter()
        .flat_map(|m| m.nodes.iter().copied())
        .collect();
    for m in &attentions {
        a.attention_out.insert(m.out.tensor);
    }
    for m in &attentions {
        for view in [&m.q, &m.k, &m.v].into_iter().chain(&m.bias) {
            if !a.in_memory(view.tensor) {
                a.materialized.insert(view.tensor);
            }
        }
    }
    let mut uses: HashMap<TensorId, usize> =
        a.consumers.iter().map(|(t, c)| (*t, c.len())).collect();
    for &t in &reg.results {
        *uses.entry(t).or_default() += 1;
        if !a.in_memory(t) {
            a.materialized.insert(t);
        }
    }
    for &t in cut {
        let mut t = t;
        while let Some(n) = g.producer(t) {
            match n.op {
                Op::Reshape { .. } => t = n.inputs[0],
                _ => break,
            }
        }
        if g.tensor_region(t) == region && !a.in_memory(t) {
            a.materialized.insert(t);
        }
    }
    // Library operands, and whatever more than one consumer reads.
    let mut matmuls = HashMap::new();
    for &n in &reg.nodes {
        if in_attention.contains(&n) {
            continue;
        }
        let node = g.node(n);
        match node.op {
            Op::MatMul => {
                let x = a.operand(node.inputs[0], true);
                let y = a.operand(node.inputs[1], true);
                matmuls.insert(n, (x, y));
            }
            _ if role(&node.op) == Role::Library => {
                for &t in &node.inputs {
                    let allow = false;
                    a.operand(t, allow);
                }
            }
            _ => {}
        }
        for &t in &node.outputs {
            let r = role(&node.op);
            if matches!(r, Role::Fusible | Role::Row)
                && uses.get(&t).copied().unwrap_or(0) != 1
                && g.tensor(t).dtype.is_float()
            {
                a.materialized.insert(t);
            }
        }
    }
    // Each row operation's output flows on through single-consumer elementwise
    // ops; the chain ends (is materialized) where it cannot go further.
    for &n in &reg.nodes {
        let node = g.node(n);
        if role(&node.op) != Role::Row || in_attention.contains(&n) {
            continue;
        }
        let axis_last = row_axis(g, n) + 1 == g.tensor(node.inputs[0]).shape.rank();
        let mut cur = node.outputs[0];
        let mut along_row = !matches!(node.op, Op::Reduce { .. });
        // A running sum's kernel ends with it: a consumer that needed its
        // value again in the backward would need the sum in both directions
        // in one kernel (the forward's and the gradient's).
        if matches!(node.op, Op::CumSum { .. }) {
            if !a.in_memory(cur) {
                a.materialized.insert(cur);
            }
            continue;
        }
        loop {
            if a.in_memory(cur) {
                break;
            }
            let next = a
                .consumers
                .get(&cur)
                .and_then(|c| (c.len() == 1).then(|| c[0]));
            let ok = next.and_then(|c| {
                let cn = g.node(c);
                let out = cn.outputs[0];
                let same_shape = g.tensor(out).shape == g.tensor(cur).shape;
                let go = match &cn.op {
                    Op::Unary(_) | Op::Dropout { .. } => true,
                    Op::CausalMask => along_row,
                    Op::Cast(to) => to.is_float(),
                    Op::Binary(_) | Op::Select => {
                        same_shape
                            && g.tensor(out).dtype.is_float()
                            && cn
                                .inputs
                                .iter()
                                .all(|&i| i == cur || !a.has_row_ancestor(i))
                    }
                    Op::TakeAlong if along_row && axis_last && cn.inputs[0] == cur => {
                        along_row = false;
                        true
                    }
                    _ => false,
                };
                go.then_some(out)
            });
            match ok {
                Some(out) => cur = out,
                None => {
                    a.materialized.insert(cur);
                    break;
                }
            }
        }
    }

    // Lower row kernels first: they may absorb elementwise roots of their row
    // shape (residual add + norm) as extra outputs.
    let mut absorbed: HashSet<TensorId> = HashSet::new();
    let mut lowered: HashMap<TensorId, Result<FusedKernel, String>> = HashMap::new();
    let roots: Vec<TensorId> = reg
        .nodes
        .iter()
        .flat_map(|&n| g.node(n).outputs.iter().copied())
        .filter(|t| {
            a.materialized.contains(t)
                && matches!(
                    a.producer_role(*t),
                    Role::Fusible | Role::Row | Role::Inline
                )
        })
        .collect();
    let anchors: HashMap<TensorId, Result<Option<NodeId>, String>> =
        roots.iter().map(|&t| (t, a.anchor_of(t))).collect();
    for pass_rows in [true, false] {
        for &t in &roots {
            let anchor = match &anchors[&t] {
                Err(e) => {
                    if pass_rows {
                        lowered.insert(t, Err(e.clone()));
                    }
                    continue;
                }
                Ok(anchor) => *anchor,
            };
            if anchor.is_some() != pass_rows || absorbed.contains(&t) {
                continue;
            }
            let candidates: HashSet<TensorId> = if pass_rows {
                roots
                    .iter()
                    .copied()
                    .filter(|r| matches!(anchors[r], Ok(None)) && !absorbed.contains(r))
                    .collect()
            } else {
                HashSet::new()
            };
            let result = lower_root(&a, t, anchor, &candidates);
            if let Ok((_, took)) = &result {
                absorbed.extend(took.iter().copied());
            }
            lowered.insert(t, result.map(|(k, _)| k));
        }
    }

    let mut steps = Vec::new();
    let mut attentions: HashMap<NodeId, AttentionMatch> =
        attentions.into_iter().map(|m| (m.pv, m)).collect();
    for &n in &reg.nodes {
        let node = g.node(n);
        if let Some(m) = attentions.remove(&n) {
            steps.push(Step::Attention(lower_attention(g, &m)));
            continue;
        }
        if in_attention.contains(&n) {
            continue;
        }
        if let Some((x, y)) = matmuls.remove(&n) {
            steps.push(Step::MatMul {
                node: n,
                a: x,
                b: y,
            });
            continue;
        }
        if role(&node.op) == Role::Library {
            steps.push(Step::Extern {
                node: n,
                reason: format!("`{}` runs in the runtime", node.op.name()),
            });
            continue;
        }
        for t in &node.outputs {
            match lowered.remove(t) {
                Some(Ok(k)) => steps.push(Step::Kernel(k)),
                Some(Err(reason)) => steps.push(Step::Extern { node: n, reason }),
                None => {}
            }
        }
    }
    FusionPlan {
        region,
        steps,
        unfused_attention,
    }
}

/// Every attention of the region the fused kernel takes, and each one it
/// does not (its score matmul) with the reason.
fn find_attention(
    a: &Analysis<'_>,
    cut: &[TensorId],
) -> (Vec<AttentionMatch>, Vec<(NodeId, String)>) {
    let g = a.g;
    let reg = g.region(a.region);
    let mut pinned: HashSet<TensorId> = reg.results.iter().copied().collect();
    for &t in cut {
        let mut t = t;
        pinned.insert(t);
        while let Some(n) = g.producer(t) {
            match n.op {
                Op::Reshape { .. } => t = n.inputs[0],
                _ => break,
            }
            pinned.insert(t);
        }
    }
    let pinned = |t: TensorId| pinned.contains(&t);
    let region = MatchRegion {
        consumers: &a.consumers,
        pinned: &pinned,
    };
    let (mut found, mut refused) = (Vec::new(), Vec::new());
    let mut taken: HashSet<NodeId> = HashSet::new();
    for &n in &reg.nodes {
        if taken.contains(&n) {
            continue;
        }
        match match_attention(g, &region, n) {
            None => {}
            Some(Ok(m)) if m.nodes.iter().all(|x| !taken.contains(x)) => {
                taken.extend(m.nodes.iter().copied());
                found.push(m);
            }
            Some(Ok(_)) => refused.push((n, "its nodes overlap another attention".into())),
            Some(Err(reason)) => refused.push((n, reason)),
        }
    }
    (found, refused)
}

/// The step of one matched attention: its description in size arguments.
fn lower_attention(g: &Graph, m: &AttentionMatch) -> FusedAttention {
    let mut sizes: Vec<Dim> = Vec::new();
    let mut key_sizes: Vec<(usize, KeySize)> = Vec::new();
    // Only what shapes the code is fixed in it: the widths (register tiles),
    // zero strides (broadcasts) and unit strides (contiguous features).
    // Every other size is an argument of its own, in a fixed order, so
    // attentions that differ in head count, lengths or layout share one
    // kernel whatever sizes happen to coincide.
    let mut size = |d: &Dim| -> Size {
        if let Some(c @ (0 | 1)) = d.as_const() {
            return Size::Const(c);
        }
        sizes.push(d.clone());
        Size::Param(sizes.len() - 1)
    };
    // The shape's sizes first: they print as `n0..` in a readable order.
    let (batch, heads, kv_heads, q_len, k_len) = (
        size(&m.batch),
        size(&m.heads),
        size(&m.kv_heads),
        size(&m.q_len),
        size(&m.k_len),
    );
    let mut operand = |v: &View| -> AttentionOperand {
        let strides = [0, 1, 2, 3].map(|a| size(&v.axes[a].stride));
        AttentionOperand {
            label: v.tensor.to_string(),
            len: g
                .tensor(v.tensor)
                .shape
                .dims()
                .iter()
                .map(&mut size)
                .collect(),
            at: Strided {
                offset: size(&v.offset),
                strides,
            },
        }
    };
    let (q, k, v, out) = (operand(&m.q), operand(&m.k), operand(&m.v), operand(&m.out));
    let bias = m.bias.as_ref().map(&mut operand);
    // The words of the rank's place and of the dropout key, each one
    // argument however often it is read.
    let mut key_size = |k: KeySize| -> Size {
        if let Some(&(i, _)) = key_sizes.iter().find(|(_, x)| *x == k) {
            return Size::Param(i);
        }
        sizes.push(Dim::konst(0));
        key_sizes.push((sizes.len() - 1, k));
        Size::Param(sizes.len() - 1)
    };
    let query_position = whole_position(
        Idx::Var(2),
        Idx::size(q_len),
        false,
        m.query_context,
        &mut key_size,
    )
    .0;
    let dropout = m.dropout.map(|d| {
        let axes = [0, 1, 2, 3].map(Idx::Var);
        let lens = [batch, heads, q_len, k_len].map(Idx::size);
        AttentionDropout {
            p: d.p,
            index: whole_index(&axes, &lens, d.split, d.context, &mut key_size),
            key: DrawKey {
                node: d.node.index() as u64,
                layer: key_size(KeySize::Layer),
                first_sample: key_size(KeySize::FirstSample),
                per_sample: key_size(draw_per_sample(d.out, d.split, d.context)),
            },
        }
    });
    let kernel = AttentionKernel {
        sizes: sizes.len(),
        batch,
        heads,
        kv_heads,
        group: m.group,
        q_len,
        k_len,
        head_dim: m.head_dim,
        value_dim: m.value_dim,
        scale: m.scale,
        causal: m.causal,
        window: m.window,
        query_position,
        q,
        k,
        v,
        bias,
        out,
        dropout,
    };
    FusedAttention {
        kernel,
        q: m.q.tensor,
        k: m.k.tensor,
        v: m.v.tensor,
        bias: m.bias.as_ref().map(|b| b.tensor),
        out: m.out.tensor,
        sizes,
        key_sizes,
        nodes: m.nodes.clone(),
    }
}

/// The flat index in the whole tensor of element `index` of a tensor of
/// local lengths `lens` that is this rank's part, as `dplc_ir::Placement`
/// computes it on the host: a dropout's draw, in a fused kernel or the
/// fused attention, is keyed by it so every split draws the serial run's
/// mask. `key` gives the size argument of a word of the rank's place.
pub(crate) fn whole_index(
    index: &[Idx],
    lens: &[Idx],
    split: Option<usize>,
    context: Option<usize>,
    key: &mut dyn FnMut(KeySize) -> Size,
) -> Idx {
    let mut acc = Idx::Const(0);
    for (k, (i, len)) in index.iter().zip(lens).enumerate() {
        let (i, len) = whole_position(
            i.clone(),
            len.clone(),
            split == Some(k),
            context == Some(k),
            key,
        );
        acc = Idx::add(Idx::mul(acc, len), i);
    }
    acc
}

/// Position `i` of an axis of local length `len` in the whole axis, and the
/// whole axis's length: along a `split` axis the rank's `1/tp` piece (`i +
/// part·len` of an axis `tp` times as long); then along a `context` axis its
/// sequence chunks (`dplc_ir::context_position`: `i + rank·len/2 + (i /
/// (len/2))·(cp−1−rank)·len` of an axis `cp` times as long). The fused
/// attention's causal and window masks read a query's place here too.
pub(crate) fn whole_position(
    i: Idx,
    len: Idx,
    split: bool,
    context: bool,
    key: &mut dyn FnMut(KeySize) -> Size,
) -> (Idx, Idx) {
    let (mut i, mut len) = (i, len);
    if split {
        let part = Idx::Size(key(KeySize::SplitPart));
        let parts = Idx::Size(key(KeySize::SplitParts));
        i = Idx::add(i, Idx::mul(part, len.clone()));
        len = Idx::mul(len, parts);
    }
    if context {
        let rank = Idx::Size(key(KeySize::ContextRank));
        let cp = Idx::Size(key(KeySize::ContextRanks));
        let chunk = Idx::div(len.clone(), Idx::Const(2));
        let later = Idx::mul(
            Idx::sub(Idx::sub(cp.clone(), Idx::Const(1)), rank.clone()),
            len.clone(),
        );
        i = Idx::add(
            Idx::add(i.clone(), Idx::mul(rank, chunk.clone())),
            Idx::mul(Idx::div(i, chunk), later),
        );
        len = Idx::mul(len, cp);
    }
    (i, len)
}

/// How many elements of a dropout's output `t` a sample holds, as its key
/// reads it: of `t` itself, or of the whole tensor whose part along
/// `split` (tp) or `context` (cp) it is.
fn draw_per_sample(t: TensorId, split: Option<usize>, context: Option<usize>) -> KeySize {
    match (split, context) {
        (None, None) => KeySize::PerSample(t),
        (split, context) => KeySize::WholePerSample {
            tensor: t,
            split: split.is_some(),
            context: context.is_some(),
        },
    }
}

/// Where a row kernel is: its anchor, the axis it reduces, the anchor's input shape.
struct Anchor {
    node: NodeId,
    axis: usize,
    shape: Shape,
}

struct Lower<'a, 'g> {
    a: &'a Analysis<'g>,
    b: Builder,
    buffers: Vec<Buffer>,
    tensors: Vec<TensorId>,
    sizes: Vec<Dim>,
    key_sizes: Vec<(usize, KeySize)>,
    nodes: BTreeSet<NodeId>,
    anchor: Option<Anchor>,
    stores: Vec<Store>,
    memo: HashMap<(TensorId, Vec<Idx>), ValueId>,
    /// Flat indices that delinearised into these multi-indices over these dims.
    flat_of: HashMap<(Vec<Idx>, Vec<Dim>), Idx>,
    row_stats: HashMap<NodeId, Vec<ValueId>>,
    candidates: &'a HashSet<TensorId>,
    absorbed: Vec<TensorId>,
    root: TensorId,
}

type Res<T> = Result<T, String>;

fn lower_root(
    a: &Analysis<'_>,
    root: TensorId,
    anchor: Option<NodeId>,
    candidates: &HashSet<TensorId>,
) -> Res<(FusedKernel, Vec<TensorId>)> {
    let g = a.g;
    let mut l = Lower {
        a,
        b: Builder::default(),
        buffers: Vec::new(),
        tensors: Vec::new(),
        sizes: Vec::new(),
        key_sizes: Vec::new(),
        nodes: BTreeSet::new(),
        anchor: None,
        stores: Vec::new(),
        memo: HashMap::new(),
        flat_of: HashMap::new(),
        row_stats: HashMap::new(),
        candidates,
        absorbed: Vec::new(),
        root,
    };
    let shape = g.tensor(root).shape.clone();
    let space;
    let index: Vec<Idx>;
    match anchor {
        None => {
            space = Space {
                outer: shape.dims().iter().map(|d| l.size(d)).collect(),
                inner: None,
            };
            index = (0..shape.rank()).map(Idx::Var).collect();
        }
        Some(n) => {
            let node = g.node(n);
            let axis = row_axis(g, n);
            let in_shape = g.tensor(node.inputs[0]).shape.clone();
            let rank = in_shape.rank();
            let rows: Vec<Idx> = (0..rank - 1).map(Idx::Var).collect();
            let outer = in_shape
                .dims()
                .iter()
                .enumerate()
                .filter(|(i, _)| *i != axis)
                .map(|(_, d)| d.clone())
                .collect::<Vec<_>>();
            space = Space {
                outer: outer.iter().map(|d| l.size(d)).collect(),
                inner: Some(l.size(&in_shape.dims()[axis])),
            };
            // A keep-dim reduction has a 1 where the row was.
            let keeps_dim = shape.rank() == rank
                && shape.dims()[axis].is_one()
                && !in_shape.dims()[axis].is_one();
            let along_row = shape.rank() == rank && !keeps_dim;
            index = if shape.rank() == rank - 1 {
                rows
            } else {
                let mut i = rows;
                i.insert(axis, if along_row { Idx::Inner } else { Idx::Const(0) });
                i
            };
            l.anchor = Some(Anchor {
                node: n,
                axis,
                shape: in_shape,
            });
        }
    }
    let out = l.buffer(root, true);
    let value = l.compute(root, &index)?;
    let at = l.linearize(&index, shape.dims());
    l.stores.insert(
        0,
        Store {
            buf: out,
            index: at,
            value,
            accumulate: false,
        },
    );
    let nodes: Vec<NodeId> = l.nodes.iter().copied().collect();
    let mut names: Vec<&'static str> = Vec::new();
    for &n in &nodes {
        let op = &g.node(n).op;
        if role(op) == Role::Inline || matches!(op, Op::Cast(_)) {
            continue;
        }
        if names.last() != Some(&op.name()) && names.len() < 4 {
            names.push(op.name());
        }
    }
    let op = if names.is_empty() {
        "copy".to_string()
    } else {
        names.join("_")
    };
    let kernel = Kernel {
        op,
        sizes: l.sizes.len(),
        scalars: 0,
        buffers: l.buffers,
        space,
        values: l.b.values,
        stores: l.stores,
    };
    Ok((
        FusedKernel {
            kernel,
            buffers: l.tensors,
            sizes: l.sizes,
            key_sizes: l.key_sizes,
            nodes,
        },
        l.absorbed,
    ))
}

impl Lower<'_, '_> {
    fn g(&self) -> &Graph {
        self.a.g
    }

    fn size(&mut self, d: &Dim) -> Size {
        if let Some(c) = d.as_const() {
            return Size::Const(c);
        }
        let k = match self.sizes.iter().position(|x| x == d) {
            Some(k) => k,
            None => {
                self.sizes.push(d.clone());
                self.sizes.len() - 1
            }
        };
        Size::Param(k)
    }

    /// The size argument carrying a word of the dropout key.
    fn key_size(&mut self, k: KeySize) -> Size {
        if let Some(&(i, _)) = self.key_sizes.iter().find(|(_, x)| *x == k) {
            return Size::Param(i);
        }
        self.sizes.push(Dim::konst(0));
        let i = self.sizes.len() - 1;
        self.key_sizes.push((i, k));
        Size::Param(i)
    }

    fn size_idx(&mut self, d: &Dim) -> Idx {
        match self.size(d) {
            Size::Const(c) => Idx::Const(c),
            s => Idx::Size(s),
        }
    }

    fn buffer(&mut self, t: TensorId, output: bool) -> usize {
        if let Some(i) = self.tensors.iter().position(|&x| x == t) {
            return i;
        }
        let tensor = self.g().tensor(t).clone();
        let len = tensor.shape.dims().iter().map(|d| self.size(d)).collect();
        self.buffers.push(Buffer {
            label: t.to_string(),
            elem: tensor_elem(&tensor),
            output,
            len,
        });
        self.tensors.push(t);
        self.tensors.len() - 1
    }

    fn linearize(&mut self, index: &[Idx], dims: &[Dim]) -> Idx {
        if let Some(flat) = self.flat_of.get(&(index.to_vec(), dims.to_vec())) {
            return flat.clone();
        }
        let mut acc = Idx::Const(0);
        for (i, d) in index.iter().zip(dims) {
            let s = self.size_idx(d);
            acc = Idx::add(Idx::mul(acc, s), i.clone());
        }
        acc
    }

    /// The flat index in the whole tensor of element `index` of a tensor of
    /// `dims` that is this rank's part: [`whole_index`] over this kernel's
    /// size arguments.
    fn whole_index(
        &mut self,
        index: &[Idx],
        dims: &[Dim],
        split: Option<usize>,
        context: Option<usize>,
    ) -> Idx {
        let lens: Vec<Idx> = dims.iter().map(|d| self.size_idx(d)).collect();
        whole_index(index, &lens, split, context, &mut |k| self.key_size(k))
    }

    fn delinearize(&mut self, flat: Idx, dims: &[Dim]) -> Vec<Idx> {
        let mut out = vec![Idx::Const(0); dims.len()];
        let mut stride = Idx::Const(1);
        for k in (0..dims.len()).rev() {
            let d = self.size_idx(&dims[k]);
            let q = Idx::div(flat.clone(), stride.clone());
            out[k] = if k == 0 { q } else { Idx::rem(q, d.clone()) };
            stride = Idx::mul(stride, d);
        }
        self.flat_of.insert((out.clone(), dims.to_vec()), flat);
        out
    }

    /// The index into an input of shape `from` of a broadcasting elementwise op at `index`.
    fn broadcast(&self, index: &[Idx], from: &Shape, out: &Shape) -> Vec<Idx> {
        let off = out.rank() - from.rank();
        (0..from.rank())
            .map(|k| {
                if from.dims()[k].is_one() && !out.dims()[k + off].is_one() {
                    Idx::Const(0)
                } else {
                    index[k + off].clone()
                }
            })
            .collect()
    }

    fn value(&mut self, t: TensorId, index: &[Idx]) -> Res<ValueId> {
        let g = self.a.g;
        if g.tensor(t).dtype == DType::I32 {
            let i = self.index(t, index)?;
            return Ok(self.b.push(Expr::FromIndex(i)));
        }
        if self.absorbed.contains(&t) && self.memo.contains_key(&(t, index.to_vec())) {
            return self.compute(t, index);
        }
        if t != self.root && self.a.in_memory(t) {
            if self.absorbable(t, index) {
                self.absorbed.push(t);
                let v = self.compute(t, index)?;
                let buf = self.buffer(t, true);
                let at = self.linearize(index, g.tensor(t).shape.dims());
                self.stores.push(Store {
                    buf,
                    index: at,
                    value: v,
                    accumulate: false,
                });
                return Ok(v);
            }
            let buf = self.buffer(t, false);
            let at = self.linearize(index, g.tensor(t).shape.dims());
            return Ok(self.b.push(Expr::Load { buf, index: at }));
        }
        self.compute(t, index)
    }

    /// Whether materialized `t` can be computed and stored here instead of in its own kernel.
    fn absorbable(&self, t: TensorId, index: &[Idx]) -> bool {
        let Some(anchor) = &self.anchor else {
            return false;
        };
        if !self.candidates.contains(&t)
            || self.absorbed.contains(&t)
            || !self.a.materialized.contains(&t)
        {
            return false;
        }
        let g = self.a.g;
        let rank = anchor.shape.rank();
        if g.tensor(t).shape != anchor.shape || anchor.axis + 1 != rank {
            return false;
        }
        let mut want: Vec<Idx> = (0..rank - 1).map(Idx::Var).collect();
        want.push(Idx::Inner);
        if index != want.as_slice() {
            return false;
        }
        // Every other reader of `t` must run after this kernel.
        let root_pos = self.a.pos[&node_of(g, self.root)];
        self.a.consumers.get(&t).is_some_and(|cs| {
            cs.iter()
                .all(|c| self.a.pos[c] > root_pos || self.is_fused_here(*c))
        })
    }

    fn is_fused_here(&self, c: NodeId) -> bool {
        // The anchor chain: the readers this kernel recomputes are before its root.
        let g = self.a.g;
        let anchor = self.anchor.as_ref().map(|a| a.node);
        Some(c) == anchor
            || g.node(c)
                .outputs
                .iter()
                .any(|o| !self.a.in_memory(*o) && self.memo.keys().any(|(t, _)| t == o))
    }

    fn index(&mut self, t: TensorId, index: &[Idx]) -> Res<Idx> {
        let g = self.a.g;
        if self.a.in_memory(t) && t != self.root {
            let buf = self.buffer(t, false);
            let at = self.linearize(index, g.tensor(t).shape.dims());
            return Ok(Idx::Load(buf, Box::new(at)));
        }
        let node = g.producer(t).expect("computed tensors have producers");
        self.nodes.insert(node_of(g, t));
        let out = &g.tensor(t).shape;
        Ok(match &node.op {
            Op::Iota { .. } => index[0].clone(),
            Op::Cast(_) => {
                let x = node.inputs[0];
                match g.producer(x).map(|n| &n.op) {
                    _ if g.tensor(x).dtype == DType::I32 => self.index(x, index)?,
                    Some(Op::Constant(c)) if c.fract() == 0.0 => Idx::Const(*c as i64),
                    _ => return Err("a float cast to an index inside a kernel".into()),
                }
            }
            Op::Binary(op @ (BinaryOp::Add | BinaryOp::Sub | BinaryOp::Mul)) => {
                let (x, y) = (node.inputs[0], node.inputs[1]);
                let ix = self.broadcast(index, &g.tensor(x).shape, out);
                let iy = self.broadcast(index, &g.tensor(y).shape, out);
                let (x, y) = (self.index(x, &ix)?, self.index(y, &iy)?);
                match op {
                    BinaryOp::Add => Idx::add(x, y),
                    BinaryOp::Sub => Idx::sub(x, y),
                    _ => Idx::mul(x, y),
                }
            }
            Op::Transpose { .. } | Op::Reshape { .. } | Op::Expand { .. } | Op::Slice { .. } => {
                let inner = self.view_index(node_of(g, t), index);
                self.index(node.inputs[0], &inner)?
            }
            Op::Pad { value, .. } => {
                let (ix, (from, len)) = self.pad_source(node_of(g, t), index);
                let x = self.index(node.inputs[0], &ix)?;
                // No select on indices: `inside` is 1 or 0 by clamping,
                // `[0 <= from] * [from < len]`, and the id is mixed by it.
                let one = || Idx::Const(1);
                let clamp01 = |i: Idx| Idx::min(Idx::max(i, Idx::Const(0)), one());
                let lo = clamp01(Idx::add(from.clone(), one()));
                let hi = clamp01(Idx::sub(len, from));
                let inside = Idx::mul(lo, hi);
                let fill = Idx::mul(Idx::sub(one(), inside.clone()), Idx::Const(*value as i64));
                Idx::add(Idx::mul(inside, x), fill)
            }
            op => return Err(format!("`{}` on indices inside a kernel", op.name())),
        })
    }

    /// For a pad node at output `index`: the input index it reads (its
    /// padded axis clamped into the input), and that axis's unclamped source
    /// position with the input's length, to test whether it is inside.
    fn pad_source(&mut self, n: NodeId, index: &[Idx]) -> (Vec<Idx>, (Idx, Idx)) {
        let g = self.a.g;
        let node = g.node(n);
        let Op::Pad { axis, before, .. } = node.op else {
            unreachable!("only pads")
        };
        let len = g.tensor(node.inputs[0]).shape.dims()[axis].clone();
        let len = self.size_idx(&len);
        let from = Idx::sub(index[axis].clone(), Idx::Const(before));
        let mut ix = index.to_vec();
        ix[axis] = Idx::min(
            Idx::max(from.clone(), Idx::Const(0)),
            Idx::sub(len.clone(), Idx::Const(1)),
        );
        (ix, (from, len))
    }

    /// The input index of a view node at output `index`.
    fn view_index(&mut self, n: NodeId, index: &[Idx]) -> Vec<Idx> {
        let g = self.a.g;
        let node = g.node(n);
        let input = g.tensor(node.inputs[0]).shape.clone();
        let out = g.tensor(node.outputs[0]).shape.clone();
        match &node.op {
            Op::Transpose { perm } => {
                let mut inner = vec![Idx::Const(0); perm.len()];
                for (i, &p) in perm.iter().enumerate() {
                    inner[p] = index[i].clone();
                }
                inner
            }
            Op::Reshape { .. } => {
                let flat = self.linearize(index, out.dims());
                self.delinearize(flat, input.dims())
            }
            Op::Expand { .. } => self.broadcast(index, &input, &out),
            Op::Slice { axis, start, .. } => {
                let mut inner = index.to_vec();
                inner[*axis] = Idx::add(inner[*axis].clone(), Idx::Const(*start));
                inner
            }
            _ => unreachable!("only views"),
        }
    }

    /// Lower the node producing `t` at `index`, whether or not `t` is materialized.
    fn compute(&mut self, t: TensorId, index: &[Idx]) -> Res<ValueId> {
        let key = (t, index.to_vec());
        if let Some(&v) = self.memo.get(&key) {
            return Ok(v);
        }
        let v = self.compute_inner(t, index)?;
        self.memo.insert(key, v);
        Ok(v)
    }

    fn compute_inner(&mut self, t: TensorId, index: &[Idx]) -> Res<ValueId> {
        let g = self.a.g;
        // Integer arithmetic (positions, shifted ids) stored for a reader
        // that is not a kernel (a vocabulary-parallel lookup): its index
        // expression, written as a value.
        if g.tensor(t).dtype == DType::I32 {
            let i = self.index(t, index)?;
            return Ok(self.b.push(Expr::FromIndex(i)));
        }
        let n = node_of(g, t);
        let node = g.node(n);
        self.nodes.insert(n);
        let out = g.tensor(t).shape.clone();
        let input = |i: usize| node.inputs[i];
        Ok(match &node.op {
            Op::Constant(c) => self.b.konst(*c),
            Op::Unary(op) => {
                let x = self.value(input(0), index)?;
                self.b.unary(*op, x)
            }
            Op::Binary(op) => {
                let ix = self.broadcast(index, &g.tensor(input(0)).shape, &out);
                let iy = self.broadcast(index, &g.tensor(input(1)).shape, &out);
                let x = self.value(input(0), &ix)?;
                let y = self.value(input(1), &iy)?;
                self.b.binary(*op, x, y)
            }
            Op::Cast(_) => self.value(input(0), index)?,
            Op::Transpose { .. } | Op::Reshape { .. } | Op::Expand { .. } | Op::Slice { .. } => {
                let inner = self.view_index(n, index);
                self.value(input(0), &inner)?
            }
            Op::Concat { axis } => {
                let mut parts = Vec::new();
                let mut offset = Idx::Const(0);
                for &x in &node.inputs {
                    let len = g.tensor(x).shape.dims()[*axis].clone();
                    let len = self.size_idx(&len);
                    let mut ix = index.to_vec();
                    let local = Idx::sub(index[*axis].clone(), offset.clone());
                    ix[*axis] = Idx::min(
                        Idx::max(local, Idx::Const(0)),
                        Idx::sub(len.clone(), Idx::Const(1)),
                    );
                    let v = self.value(x, &ix)?;
                    offset = Idx::add(offset, len);
                    parts.push((v, offset.clone()));
                }
                let (mut acc, _) = parts.pop().expect("concat has inputs");
                while let Some((v, end)) = parts.pop() {
                    acc = self.b.push(Expr::Select {
                        cond: Cond::IdxLt(index[*axis].clone(), end),
                        then: v,
                        otherwise: acc,
                    });
                }
                acc
            }
            Op::Pad {
                before,
                after,
                value,
                ..
            } => {
                let (ix, inside) = self.pad_source(n, index);
                let x = self.value(input(0), &ix)?;
                let fill = self.b.konst(*value);
                let (from, len) = inside;
                // Only the ends that grew need a test: a cropped end reads inside.
                let mut v = x;
                if *after > 0 {
                    v = self.b.push(Expr::Select {
                        cond: Cond::IdxLt(from.clone(), len),
                        then: v,
                        otherwise: fill,
                    });
                }
                if *before > 0 {
                    v = self.b.push(Expr::Select {
                        cond: Cond::IdxLt(from, Idx::Const(0)),
                        then: fill,
                        otherwise: v,
                    });
                }
                v
            }
            Op::Select => {
                let ix =
                    |i: usize, me: &mut Self| me.broadcast(index, &g.tensor(input(i)).shape, &out);
                let (ic, ia, ib) = (ix(0, self), ix(1, self), ix(2, self));
                let c = self.value(input(0), &ic)?;
                let then = self.value(input(1), &ia)?;
                let otherwise = self.value(input(2), &ib)?;
                // Non-zero: 0 < |c|.
                let zero = self.b.konst(0.0);
                let mag = self.b.unary(UnaryOp::Abs, c);
                self.b.push(Expr::Select {
                    cond: Cond::ValLt(zero, mag),
                    then,
                    otherwise,
                })
            }
            Op::CausalMask => {
                let x = self.value(input(0), index)?;
                let r = index.len();
                let neg_inf = self.b.konst(f64::NEG_INFINITY);
                self.b.push(Expr::Select {
                    cond: Cond::IdxLt(index[r - 2].clone(), index[r - 1].clone()),
                    then: neg_inf,
                    otherwise: x,
                })
            }
            Op::Dropout { p, context, split } => {
                let x = self.value(input(0), index)?;
                if *p == 0.0 {
                    x
                } else {
                    let t = node.outputs[0];
                    let at = match (*split, *context) {
                        (None, None) => self.linearize(index, out.dims()),
                        (split, context) => self.whole_index(index, out.dims(), split, context),
                    };
                    let per_sample = draw_per_sample(t, *split, *context);
                    let key = DrawKey {
                        node: n.index() as u64,
                        layer: self.key_size(KeySize::Layer),
                        first_sample: self.key_size(KeySize::FirstSample),
                        per_sample: self.key_size(per_sample),
                    };
                    let r = self.b.push(Expr::Random { key, index: at });
                    let pv = self.b.konst(drop_threshold(*p));
                    let zero = self.b.konst(0.0);
                    let scale = self.b.konst(1.0 / (1.0 - *p));
                    let kept = self.b.binary(BinaryOp::Mul, x, scale);
                    self.b.push(Expr::Select {
                        cond: Cond::ValLt(r, pv),
                        then: zero,
                        otherwise: kept,
                    })
                }
            }
            Op::Embedding => {
                let r = index.len();
                let row = self.index(input(1), &index[..r - 1])?;
                self.value(input(0), &[row, index[r - 1].clone()])?
            }
            Op::TakeAlong => {
                let col = self.index(input(1), index)?;
                let mut ix = index.to_vec();
                ix.push(col);
                self.value(input(0), &ix)?
            }
            Op::Reduce { .. }
            | Op::Softmax { .. }
            | Op::LogSoftmax { .. }
            | Op::LayerNorm { .. }
            | Op::RmsNorm { .. }
            | Op::CumSum { .. } => self.row_op(n, index)?,
            op => return Err(format!("`{}` inside a kernel", op.name())),
        })
    }

    fn row_op(&mut self, n: NodeId, index: &[Idx]) -> Res<ValueId> {
        let g = self.a.g;
        let node = g.node(n);
        let Some(anchor) = &self.anchor else {
            return Err("a row operation in an elementwise kernel".into());
        };
        if anchor.node != n {
            return Err("a second row operation in one kernel".into());
        }
        let axis = anchor.axis;
        let rank = anchor.shape.rank();
        let inner_len = anchor.shape.dims()[axis].clone();
        // The point asked for: its row must be this kernel's row.
        let (rows, col): (Vec<Idx>, Option<Idx>) = match &node.op {
            Op::Reduce { keep_dim, .. } => {
                let mut r = index.to_vec();
                if *keep_dim {
                    r.remove(axis);
                }
                (r, None)
            }
            _ => {
                let mut r = index.to_vec();
                let c = r.remove(axis);
                (r, Some(c))
            }
        };
        if rows != (0..rank - 1).map(Idx::Var).collect::<Vec<_>>() {
            return Err("a row operation read at another row".into());
        }
        let at = |c: Idx| {
            let mut i = rows.clone();
            i.insert(axis, c);
            i
        };
        let x = node.inputs[0];
        if let Op::CumSum { reverse, .. } = node.op {
            // The scan gives element `j` of the row: read at the point's own `j`.
            if col != Some(Idx::Inner) {
                return Err("a running sum read at another position of its row".into());
            }
            let xj = self.value(x, &at(Idx::Inner))?;
            return Ok(self.b.scan(xj, reverse));
        }
        let stats = match self.row_stats.get(&n) {
            Some(s) => s.clone(),
            None => {
                let xj = self.value(x, &at(Idx::Inner))?;
                let len = self.size_idx(&inner_len);
                let len = match len {
                    Idx::Const(c) => self.b.konst(c as f64),
                    i => self.b.push(Expr::FromIndex(i)),
                };
                let s = match &node.op {
                    Op::Reduce { kind, .. } => {
                        let r = self.b.reduce(
                            if *kind == ReduceKind::Max {
                                RowReduce::Max
                            } else {
                                RowReduce::Sum
                            },
                            xj,
                        );
                        if *kind == ReduceKind::Mean {
                            vec![self.b.binary(BinaryOp::Div, r, len)]
                        } else {
                            vec![r]
                        }
                    }
                    Op::Softmax { .. } | Op::LogSoftmax { .. } => {
                        let m = self.b.reduce(RowReduce::Max, xj);
                        let d = self.b.binary(BinaryOp::Sub, xj, m);
                        let e = self.b.unary(UnaryOp::Exp, d);
                        let s = self.b.reduce(RowReduce::Sum, e);
                        vec![m, s]
                    }
                    Op::LayerNorm { eps } => {
                        let sum = self.b.reduce(RowReduce::Sum, xj);
                        let mean = self.b.binary(BinaryOp::Div, sum, len);
                        let d = self.b.binary(BinaryOp::Sub, xj, mean);
                        let d2 = self.b.binary(BinaryOp::Mul, d, d);
                        let ss = self.b.reduce(RowReduce::Sum, d2);
                        let var = self.b.binary(BinaryOp::Div, ss, len);
                        let eps = self.b.konst(*eps);
                        let ve = self.b.binary(BinaryOp::Add, var, eps);
                        let rstd = self.b.unary(UnaryOp::Rsqrt, ve);
                        vec![mean, rstd]
                    }
                    Op::RmsNorm { eps } => {
                        let x2 = self.b.binary(BinaryOp::Mul, xj, xj);
                        let ss = self.b.reduce(RowReduce::Sum, x2);
                        let ms = self.b.binary(BinaryOp::Div, ss, len);
                        let eps = self.b.konst(*eps);
                        let me = self.b.binary(BinaryOp::Add, ms, eps);
                        vec![self.b.unary(UnaryOp::Rsqrt, me)]
                    }
                    _ => unreachable!("row operations only"),
                };
                self.row_stats.insert(n, s.clone());
                s
            }
        };
        let Some(col) = col else { return Ok(stats[0]) };
        let xi = self.value(x, &at(col.clone()))?;
        Ok(match &node.op {
            Op::Softmax { .. } => {
                let d = self.b.binary(BinaryOp::Sub, xi, stats[0]);
                let e = self.b.unary(UnaryOp::Exp, d);
                self.b.binary(BinaryOp::Div, e, stats[1])
            }
            Op::LogSoftmax { .. } => {
                let ls = self.b.unary(UnaryOp::Log, stats[1]);
                let lse = self.b.binary(BinaryOp::Add, stats[0], ls);
                self.b.binary(BinaryOp::Sub, xi, lse)
            }
            Op::LayerNorm { .. } => {
                let d = self.b.binary(BinaryOp::Sub, xi, stats[0]);
                let nrm = self.b.binary(BinaryOp::Mul, d, stats[1]);
                let w = self.value(node.inputs[1], std::slice::from_ref(&col))?;
                let bias = self.value(node.inputs[2], &[col])?;
                let y = self.b.binary(BinaryOp::Mul, nrm, w);
                self.b.binary(BinaryOp::Add, y, bias)
            }
            Op::RmsNorm { .. } => {
                let nrm = self.b.binary(BinaryOp::Mul, xi, stats[0]);
                let w = self.value(node.inputs[1], &[col])?;
                self.b.binary(BinaryOp::Mul, nrm, w)
            }
            _ => unreachable!("reductions return above"),
        })
    }
}

/// How a kernel stores graph tensor `t`: indices as `i32`; a float scalar
/// (the loss, a mean) in `f32`, as mixed precision keeps its loss — it
/// costs nothing, and in bf16 a loss near 11 moves in steps of 0.0625; every
/// other float in the storage type. The executor's loss seed reads it too.
pub fn tensor_elem(t: &dplc_ir::Tensor) -> Elem {
    if t.dtype == DType::I32 {
        Elem::I32
    } else if t.shape.dims().is_empty() {
        Elem::F32
    } else {
        Elem::Float
    }
}
