//! Reverse-mode autodiff over the IR: which values need a gradient, the order
//! the backward pass visits nodes in, and the activation rule — what each
//! op's backward reads from its forward ([`saved_values`]).
//!
//! The vector-Jacobian products themselves are computed by each backend, keyed
//! by the forward `Op`: several of them (scatter-add for `Embedding`, the
//! fused softmax and norm backwards, MoE routing) have no forward primitive to
//! be written in, and adding backward-only variants to the closed `Op` enum is
//! a change of the IR's contract. This module is the backend-independent half:
//! every backend walks the same [`GradPlan`], and [`saved_values`] is the one
//! definition of what is kept — the activation analysis (and so the planner)
//! counts it, and the fused executor keeps it.

use crate::{Analysis, BinaryOp, DType, Graph, NodeId, Op, Precision, ReduceKind, RegionId};
use crate::{TensorId, UnaryOp, VocabOp};

/// What a kept value holds, which fixes its bytes per element.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum SavedKind {
    /// An activation in the training precision.
    Float,
    /// A dropout mask, one byte per element (Megatron's accounting, which
    /// the published memory rows assume; dplc's fused kernels draw the mask
    /// again from the counter-based key instead of keeping it).
    Mask,
    /// Integer indices (token ids, top-k choices), four bytes per element.
    Index,
}

impl SavedKind {
    pub fn bytes(self, precision: Precision) -> u64 {
        match self {
            SavedKind::Float => precision.bytes(),
            SavedKind::Mask => 1,
            SavedKind::Index => 4,
        }
    }
}

/// Where a kept value sits on its node.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum SavedAt {
    Input(usize),
    Output(usize),
}

/// One value a node's backward reads from its forward.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct SavedValue {
    /// The value kept (for a mask: the value whose shape it has).
    pub at: SavedAt,
    pub kind: SavedKind,
}

/// The activation rule: the values the backward of `op` reads, given which
/// of its inputs need a gradient (`grads`, as [`GradPlan::input_grads`]
/// gives it). A matmul keeps the operand whose partner needs a gradient,
/// softmax its output, a norm its input (the fused kernels also keep each
/// row's statistics, 4 bytes a reduction a row, which this rule does not
/// count: a few bytes beside a row of the input), dropout a
/// one-byte mask, gathers and routing their indices; sums, views, layout
/// changes and casts keep nothing. What a fused kernel recomputes from a
/// kept value is not kept again: see [`Analysis::activations`].
pub fn saved_values(op: &Op, grads: &[bool]) -> Vec<SavedValue> {
    use SavedAt::{Input, Output};
    use SavedKind::{Float, Index, Mask};
    let g = |i: usize| grads.get(i).copied().unwrap_or(false);
    let any = grads.iter().any(|&x| x);
    let mut saved = Vec::new();
    let mut save = |cond: bool, at: SavedAt, kind: SavedKind| {
        if cond {
            saved.push(SavedValue { at, kind });
        }
    };
    match op {
        Op::Input(_) | Op::Param(_) | Op::Constant(_) | Op::Iota { .. } | Op::Repeat { .. } => {}
        // A layout change's backward is another collective: nothing kept.
        Op::Relayout { .. } => {}
        Op::Cast(_)
        | Op::Transpose { .. }
        | Op::Reshape { .. }
        | Op::Expand { .. }
        | Op::Slice { .. }
        | Op::Concat { .. }
        | Op::Pad { .. }
        | Op::CumSum { .. }
        | Op::CausalMask => {}
        // Which operand each element came from.
        Op::Select => save(g(1) || g(2), Input(0), Float),
        Op::Unary(u) => match u {
            UnaryOp::Neg => {}
            UnaryOp::Exp
            | UnaryOp::Sqrt
            | UnaryOp::Rsqrt
            | UnaryOp::Recip
            | UnaryOp::Tanh
            | UnaryOp::Sigmoid
            | UnaryOp::Relu => save(g(0), Output(0), Float),
            UnaryOp::Log
            | UnaryOp::Gelu
            | UnaryOp::GeluTanh
            | UnaryOp::Silu
            | UnaryOp::Sin
            | UnaryOp::Cos
            | UnaryOp::Abs => save(g(0), Input(0), Float),
            UnaryOp::Floor => {}
        },
        Op::Binary(b) => match b {
            BinaryOp::Add | BinaryOp::Sub => {}
            BinaryOp::Mul => {
                save(g(0), Input(1), Float);
                save(g(1), Input(0), Float);
            }
            BinaryOp::Div => {
                save(any, Input(1), Float);
                save(g(1), Input(0), Float);
            }
            BinaryOp::Max | BinaryOp::Min | BinaryOp::Pow => {
                save(any, Input(0), Float);
                save(any, Input(1), Float);
            }
            BinaryOp::Lt
            | BinaryOp::Le
            | BinaryOp::Gt
            | BinaryOp::Ge
            | BinaryOp::Eq
            | BinaryOp::Ne => {}
        },
        Op::MatMul => {
            save(g(1), Input(0), Float);
            save(g(0), Input(1), Float);
        }
        Op::Reduce { kind, .. } => {
            if *kind == ReduceKind::Max {
                save(g(0), Input(0), Float);
                save(g(0), Output(0), Float);
            }
        }
        Op::Softmax { .. } => save(g(0), Output(0), Float),
        // The logits, not the log-probabilities: the backward recomputes
        // the softmax from them, as dplc's fused cross-entropy kernels do
        // (and torch.compile's and Megatron's fused losses); the
        // log-probabilities never reach memory. Under autocast the logits
        // are the GEMM's bf16 where the log-probabilities are fp32.
        Op::LogSoftmax { .. } => save(g(0), Input(0), Float),
        Op::LayerNorm { .. } | Op::RmsNorm { .. } => save(any, Input(0), Float),
        Op::Dropout { .. } => save(g(0), Input(0), Mask),
        Op::Embedding | Op::TakeAlong => save(g(0), Input(1), Index),
        Op::TopK { .. } => save(g(0), Output(1), Index),
        Op::MoeDispatch { .. } => save(g(0), Input(1), Index),
        Op::MoeCombine => {
            save(g(1), Input(0), Float);
            save(g(0), Input(1), Float);
            save(g(0) || g(1), Input(2), Index);
        }
        // What the whole op keeps, at the rank's share.
        Op::VocabParallel(v) => match v {
            VocabOp::Embedding | VocabOp::TakeAlong => save(g(0), Input(1), Index),
            VocabOp::Softmax { .. } | VocabOp::LogSoftmax { .. } => save(g(0), Output(0), Float),
        },
    }
    saved
}

/// Input positions of `op` through which a gradient can flow: index inputs
/// (token ids, top-k choices, routing) and integer casts carry none.
pub fn differentiable_inputs(op: &Op, n: usize) -> Vec<bool> {
    match op {
        Op::Embedding => vec![true, false],
        Op::TakeAlong | Op::MoeDispatch { .. } => vec![true, false],
        Op::MoeCombine => vec![true, true, false],
        Op::Cast(to) => vec![*to != DType::I32],
        // A comparison's value is flat wherever it is defined; floor's too.
        Op::Binary(b) if b.is_comparison() => vec![false, false],
        Op::Unary(crate::UnaryOp::Floor) => vec![false],
        Op::Select => vec![false, true, true],
        _ => vec![true; n],
    }
}

/// For each input of `node`, whether a gradient flows to it: through a
/// differentiable position, from an output that needs one, to an input that
/// needs one (`needs`: depends on a parameter through float values).
pub(crate) fn input_grads(
    graph: &Graph,
    node: NodeId,
    needs: &dyn Fn(TensorId) -> bool,
) -> Vec<bool> {
    let n = graph.node(node);
    let output_needs = n.outputs.iter().any(|&t| needs(t));
    differentiable_inputs(&n.op, n.inputs.len())
        .into_iter()
        .zip(&n.inputs)
        .map(|(d, &t)| d && output_needs && needs(t))
        .collect()
}

/// The backward pass of a graph: which tensors get a gradient and which nodes
/// run a VJP, in reverse order per region.
pub struct GradPlan {
    needs_grad: Vec<bool>,
}

impl GradPlan {
    pub fn new(graph: &Graph) -> GradPlan {
        let analysis = Analysis::new(graph);
        let count = graph
            .nodes()
            .flat_map(|(_, n)| n.outputs.iter().copied())
            .chain(graph.regions().flat_map(|(_, r)| r.args.iter().copied()))
            .map(|t| t.index() + 1)
            .max()
            .unwrap_or(0);
        let needs_grad = (0..count)
            .map(|i| {
                let t = TensorId::new(i);
                graph.tensor(t).dtype.is_float() && analysis.requires_grad(t)
            })
            .collect();
        GradPlan { needs_grad }
    }

    /// Whether `t` depends on a parameter through float values.
    pub fn needs_grad(&self, t: TensorId) -> bool {
        self.needs_grad.get(t.index()).copied().unwrap_or(false)
    }

    /// For each input of `node`, whether its VJP must produce a gradient.
    pub fn input_grads(&self, graph: &Graph, node: NodeId) -> Vec<bool> {
        input_grads(graph, node, &|t| self.needs_grad(t))
    }

    /// What `node`'s backward reads from its forward ([`saved_values`]).
    pub fn saved(&self, graph: &Graph, node: NodeId) -> Vec<SavedValue> {
        saved_values(&graph.node(node).op, &self.input_grads(graph, node))
    }

    /// The nodes of `region` whose VJP runs, last first.
    pub fn backward_order<'g>(
        &'g self,
        graph: &'g Graph,
        region: RegionId,
    ) -> impl Iterator<Item = NodeId> + 'g {
        graph
            .region(region)
            .nodes
            .iter()
            .rev()
            .copied()
            .filter(move |&n| self.input_grads(graph, n).iter().any(|&g| g))
    }
}
