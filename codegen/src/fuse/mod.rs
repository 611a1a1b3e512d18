//! Fusion: splits a region into cuBLAS matmul calls, opaque steps the runtime
//! runs itself, and maximal fused kernels of elementwise ops and row reductions.
//!
//! The plan picks which tensors are *materialized* (written to memory); every
//! other fusible tensor is recomputed inside the kernel of each materialized
//! tensor that needs it, views included (they become index arithmetic). A kernel
//! holds at most one row operation (softmax, norm, reduce): its *anchor*.
//! `lower` builds each kernel; `attention` the fused attentions.

mod attention;
mod lower;

pub(crate) use attention::whole_index;
use attention::{draw_per_sample, find_attention, lower_attention};
use lower::lower_root;

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
    /// The kernel's last buffer, beyond `buffers`, holds its row statistics
    /// for its backward ([`crate::with_row_stats`]): a value of the step
    /// that the graph does not have, kept as a fused attention keeps its
    /// log-sum-exp. Set by [`crate::backward_plan`].
    pub keeps_row_stats: bool,
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
    /// gradient's role); `None` for the log-sum-exp, δ and `dQ`'s sum,
    /// which the graph lacks.
    pub fn tensor(&self, role: AttentionBuffer) -> Option<TensorId> {
        use AttentionBuffer::*;
        match role {
            Q | QGrad => Some(self.q),
            K | KGrad => Some(self.k),
            V | VGrad => Some(self.v),
            Bias | BiasGrad => self.bias,
            Out | OutGrad => Some(self.out),
            LogSumExp | Delta | QGradSum => None,
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
