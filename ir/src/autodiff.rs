//! Reverse-mode autodiff over the IR: which values need a gradient, the order
//! the backward pass visits nodes in, and what each op's VJP reads from forward.
//!
//! The vector-Jacobian products themselves are computed by each backend, keyed
//! by the forward `Op`: several of them (scatter-add for `Embedding`, the
//! fused softmax and norm backwards, MoE routing) have no forward primitive to
//! be written in, and adding backward-only variants to the closed `Op` enum is
//! a change of the IR's contract. This module is the backend-independent half:
//! every backend walks the same [`GradPlan`] and keeps what [`saved_for_backward`]
//! names, so the activation analysis and the executors agree on what is stored.

use crate::{Analysis, DType, Graph, NodeId, Op, RegionId, TensorId};

/// Which forward values of a node its VJP reads.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SavedForBackward {
    /// Positions among the node's inputs.
    pub inputs: Vec<usize>,
    /// Positions among the node's outputs.
    pub outputs: Vec<usize>,
}

/// What the backward pass of `op` needs from its forward pass (for `n` inputs).
/// Dropout regenerates its mask from the counter-based RNG, so it keeps nothing.
pub fn saved_for_backward(op: &Op, n: usize) -> SavedForBackward {
    let (inputs, outputs): (Vec<usize>, Vec<usize>) = match op {
        Op::Input(_) | Op::Param(_) | Op::Constant(_) | Op::Iota { .. } => (vec![], vec![]),
        Op::Unary(u) => {
            use crate::UnaryOp::*;
            match u {
                Neg => (vec![], vec![]),
                Exp | Sqrt | Rsqrt | Recip | Tanh | Sigmoid => (vec![], vec![0]),
                Log | Relu | Gelu | GeluTanh | Silu | Sin | Cos => (vec![0], vec![]),
            }
        }
        Op::Binary(b) => {
            use crate::BinaryOp::*;
            match b {
                Add | Sub => (vec![], vec![]),
                Mul | Div | Max | Min => (vec![0, 1], vec![]),
                Pow => (vec![0, 1], vec![0]),
            }
        }
        Op::Cast(_) | Op::Transpose { .. } | Op::Reshape { .. } | Op::Expand { .. } => {
            (vec![], vec![])
        }
        Op::Slice { .. } | Op::Concat { .. } | Op::CausalMask | Op::Dropout { .. } => {
            (vec![], vec![])
        }
        Op::MatMul => (vec![0, 1], vec![]),
        Op::Reduce { kind, .. } => match kind {
            crate::ReduceKind::Max => (vec![0], vec![0]),
            _ => (vec![], vec![]),
        },
        Op::Softmax { .. } | Op::LogSoftmax { .. } => (vec![], vec![0]),
        Op::LayerNorm { .. } | Op::RmsNorm { .. } => ((0..n).collect(), vec![]),
        Op::Embedding | Op::TakeAlong => (vec![0, 1], vec![]),
        Op::TopK { .. } => (vec![0], vec![1]),
        Op::MoeDispatch { .. } => (vec![1], vec![]),
        Op::MoeCombine => (vec![0, 1, 2], vec![]),
        // A repeat keeps what its body's nodes keep, per iteration.
        Op::Repeat { .. } => (vec![], vec![]),
        Op::Relayout { .. } => (vec![], vec![]),
        Op::VocabParallel(v) => return saved_for_backward(&v.whole(), n),
    };
    SavedForBackward { inputs, outputs }
}

/// Input positions of `op` through which a gradient can flow: index inputs
/// (token ids, top-k choices, routing) and integer casts carry none.
pub fn differentiable_inputs(op: &Op, n: usize) -> Vec<bool> {
    match op {
        Op::Embedding => vec![true, false],
        Op::TakeAlong | Op::MoeDispatch { .. } => vec![true, false],
        Op::MoeCombine => vec![true, true, false],
        Op::Cast(to) => vec![*to != DType::I32],
        _ => vec![true; n],
    }
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
        let n = graph.node(node);
        let output_needs = n.outputs.iter().any(|&t| self.needs_grad(t));
        differentiable_inputs(&n.op, n.inputs.len())
            .into_iter()
            .zip(&n.inputs)
            .map(|(d, &t)| d && output_needs && self.needs_grad(t))
            .collect()
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
