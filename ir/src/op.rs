//! The closed set of primitive operations, matched exhaustively everywhere.
//! Blocks (attention, mlp, norms, moe…) are written in .dpl over these.

use crate::{DType, Dim, InputId, ParamId, RegionId, Shape, TensorLayout};
use serde::{Deserialize, Serialize};
use std::fmt;

/// An elementwise function of one tensor.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum UnaryOp {
    Neg,
    Exp,
    Log,
    Sqrt,
    Rsqrt,
    Recip,
    Tanh,
    Sigmoid,
    Relu,
    /// GELU with the exact erf (BERT).
    Gelu,
    /// GELU with the tanh approximation (GPT-2, Megatron).
    GeluTanh,
    Silu,
    Sin,
    Cos,
    /// `|x|`; its derivative is the sign (0 at 0).
    Abs,
    /// The largest integer not above `x`; its derivative is 0.
    Floor,
}

impl UnaryOp {
    pub const ALL: [UnaryOp; 16] = [
        UnaryOp::Neg,
        UnaryOp::Exp,
        UnaryOp::Log,
        UnaryOp::Sqrt,
        UnaryOp::Rsqrt,
        UnaryOp::Recip,
        UnaryOp::Tanh,
        UnaryOp::Sigmoid,
        UnaryOp::Relu,
        UnaryOp::Gelu,
        UnaryOp::GeluTanh,
        UnaryOp::Silu,
        UnaryOp::Sin,
        UnaryOp::Cos,
        UnaryOp::Abs,
        UnaryOp::Floor,
    ];

    pub fn name(self) -> &'static str {
        match self {
            UnaryOp::Neg => "neg",
            UnaryOp::Exp => "exp",
            UnaryOp::Log => "log",
            UnaryOp::Sqrt => "sqrt",
            UnaryOp::Rsqrt => "rsqrt",
            UnaryOp::Recip => "recip",
            UnaryOp::Tanh => "tanh",
            UnaryOp::Sigmoid => "sigmoid",
            UnaryOp::Relu => "relu",
            UnaryOp::Gelu => "gelu",
            UnaryOp::GeluTanh => "gelu_tanh",
            UnaryOp::Silu => "silu",
            UnaryOp::Sin => "sin",
            UnaryOp::Cos => "cos",
            UnaryOp::Abs => "abs",
            UnaryOp::Floor => "floor",
        }
    }
}

/// An elementwise function of two tensors, broadcasting numpy-style.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum BinaryOp {
    Add,
    Sub,
    Mul,
    Div,
    Max,
    Min,
    Pow,
    /// Comparisons: 1 where it holds, else 0, in the operands' float type.
    /// No gradient flows through them.
    Lt,
    Le,
    Gt,
    Ge,
    Eq,
    Ne,
}

impl BinaryOp {
    pub const ALL: [BinaryOp; 13] = [
        BinaryOp::Add,
        BinaryOp::Sub,
        BinaryOp::Mul,
        BinaryOp::Div,
        BinaryOp::Max,
        BinaryOp::Min,
        BinaryOp::Pow,
        BinaryOp::Lt,
        BinaryOp::Le,
        BinaryOp::Gt,
        BinaryOp::Ge,
        BinaryOp::Eq,
        BinaryOp::Ne,
    ];

    /// Whether it compares (a 0/1 result, no gradient).
    pub fn is_comparison(self) -> bool {
        matches!(
            self,
            BinaryOp::Lt | BinaryOp::Le | BinaryOp::Gt | BinaryOp::Ge | BinaryOp::Eq | BinaryOp::Ne
        )
    }

    /// The comparison's value on two numbers (1 or 0); `None` for an arithmetic op.
    pub fn compare(self, a: f64, b: f64) -> Option<f64> {
        let holds = match self {
            BinaryOp::Lt => a < b,
            BinaryOp::Le => a <= b,
            BinaryOp::Gt => a > b,
            BinaryOp::Ge => a >= b,
            BinaryOp::Eq => a == b,
            BinaryOp::Ne => a != b,
            _ => return None,
        };
        Some(if holds { 1.0 } else { 0.0 })
    }

    pub fn name(self) -> &'static str {
        match self {
            BinaryOp::Add => "add",
            BinaryOp::Sub => "sub",
            BinaryOp::Mul => "mul",
            BinaryOp::Div => "div",
            BinaryOp::Max => "max",
            BinaryOp::Min => "min",
            BinaryOp::Pow => "pow",
            BinaryOp::Lt => "lt",
            BinaryOp::Le => "le",
            BinaryOp::Gt => "gt",
            BinaryOp::Ge => "ge",
            BinaryOp::Eq => "eq",
            BinaryOp::Ne => "ne",
        }
    }
}

/// How a reduction combines the elements along its axis.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum ReduceKind {
    Sum,
    Mean,
    Max,
}

impl ReduceKind {
    pub fn name(self) -> &'static str {
        match self {
            ReduceKind::Sum => "sum",
            ReduceKind::Mean => "mean",
            ReduceKind::Max => "max",
        }
    }
}

/// A primitive operation. Inputs are listed in the node; attributes live here.
///
/// Softmax, log-softmax and the two norms are primitives rather than
/// compositions: their numerically stable forms need a max or a mean/variance
/// per row, their backward saves one tensor (the output, or the input plus two
/// row statistics), and each is one fused kernel. Keeping them whole lets the
/// activation analysis count what a real implementation stores.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub enum Op {
    /// A model input, fed by the data loader. No inputs.
    Input(InputId),
    /// A trainable parameter. No inputs.
    Param(ParamId),
    /// A scalar `f32` constant. No inputs.
    Constant(f64),
    /// `[0, 1, …, len-1]` as `i32`. No inputs.
    Iota {
        len: Dim,
    },
    Unary(UnaryOp),
    Binary(BinaryOp),
    Cast(DType),
    /// `[…, m, k] × [k, n]` or `[…, m, k] × […, k, n]` with broadcast batch dims.
    MatMul,
    /// Permute the axes: output axis `i` is input axis `perm[i]`.
    Transpose {
        perm: Vec<usize>,
    },
    /// Same elements, new shape (row-major).
    Reshape {
        shape: Shape,
    },
    /// Broadcast size-1 axes (and new leading axes) to `shape`.
    Expand {
        shape: Shape,
    },
    /// `len` elements from `start` along `axis`.
    Slice {
        axis: usize,
        start: i64,
        len: i64,
    },
    /// Join the inputs along `axis`.
    Concat {
        axis: usize,
    },
    /// `before` elements of `value` in front of the input along `axis` and
    /// `after` behind it; a negative count drops that many elements from
    /// that end instead. `before = k, after = -k` is a shift by `k` (the
    /// length kept, so a symbolic axis such as `seq` may be shifted: a T5
    /// decoder's shift-right); the length must otherwise be a number.
    Pad {
        axis: usize,
        before: i64,
        after: i64,
        value: f64,
    },
    /// Running sum along `axis` (from the last element back when `reverse`:
    /// the backward of the forward sum).
    CumSum {
        axis: usize,
        reverse: bool,
    },
    Reduce {
        kind: ReduceKind,
        axis: usize,
        keep_dim: bool,
    },
    Softmax {
        axis: usize,
    },
    LogSoftmax {
        axis: usize,
    },
    /// Normalise over the last axis, then scale and shift: inputs `(x, weight, bias)`.
    LayerNorm {
        eps: f64,
    },
    /// Normalise by the root mean square over the last axis, then scale: `(x, weight)`.
    RmsNorm {
        eps: f64,
    },
    /// Zero elements with probability `p` and scale the rest by `1/(1-p)`.
    /// Each element's draw is keyed by its position in the whole tensor.
    Dropout {
        p: f64,
        /// In a rank's program under context parallelism
        /// ([`crate::split_context`]): the axis along which the input holds
        /// this rank's sequence positions ([`TensorLayout::Context`]), so
        /// each element is drawn at its global position
        /// ([`crate::context_position`]) and the masks are the serial run's.
        /// `None` in a model.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        context: Option<usize>,
        /// In a rank's local program under tensor or sequence parallelism
        /// ([`crate::localize`]): the axis along which the input holds this
        /// rank's `1/tp` part ([`TensorLayout::Split`]), so each element is
        /// drawn at its place in the whole tensor ([`crate::Placement`]).
        /// `None` in a model; the reference compute, which runs the model's
        /// graph over layouts, reads the same axis from the node's layout.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        split: Option<usize>,
    },
    /// Set entries above the diagonal of the last two axes to −∞.
    CausalMask,
    /// `(cond, a, b)`, broadcasting: `a` where `cond` is non-zero, else `b`.
    /// No gradient flows to `cond`.
    Select,
    /// Rows of `table [n, d]` picked by integer `indices […]`: `[…, d]`.
    Embedding,
    /// `x […, n]` at integer `indices […]` along the last axis: `[…]`.
    TakeAlong,
    /// The `k` largest values of the last axis and their indices: two outputs.
    TopK {
        k: i64,
    },
    /// Route tokens `x [t, d]` by `indices [t, k]` to `[experts, capacity, d]`,
    /// `capacity = t·k·capacity_factor / experts`.
    MoeDispatch {
        experts: i64,
        capacity_factor: crate::Ratio,
    },
    /// Gather expert outputs `[experts, capacity, d]` back to `[t, d]`, weighted
    /// by `weights [t, k]` at `indices [t, k]`.
    MoeCombine,
    /// Run `body` `count` times. Inputs: the `carried` initial values, then the
    /// captured ones; outputs: the carried values after the last iteration.
    Repeat {
        count: u64,
        body: RegionId,
        carried: usize,
    },
    /// Only in a rank's local program ([`crate::localize`]), never in a
    /// model: the value held in layout `from` as this rank holds it in `to`,
    /// a collective over the tensor- or expert-parallel group. Its backward
    /// turns the gradient, which arrives in layout `grad`, into `from.grad()`
    /// (`from == to` with a `Partial` gradient is Megatron's `f`: the
    /// identity forward, an all-reduce backward).
    Relayout {
        from: TensorLayout,
        to: TensorLayout,
        grad: TensorLayout,
    },
    /// Only in a rank's local program ([`crate::localize`]): `op` on a
    /// tensor split over the tensor-parallel group along the axis it indexes
    /// or normalises (the vocabulary), its picks or row statistics exchanged
    /// over the group (Megatron's vocabulary-parallel embedding and
    /// cross-entropy). [`crate::NodeLayout::vocab_op`] says which nodes.
    VocabParallel(VocabOp),
}

/// An op whose indexed or normalised axis is split over the tensor-parallel
/// group, so no rank can compute its part alone.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum VocabOp {
    /// `Embedding` of a table split by rows: this rank's rows picked, zeros
    /// for the ids other ranks hold (a summand over the group).
    Embedding,
    /// `TakeAlong` of a tensor split along its last axis: a summand.
    TakeAlong,
    /// `Softmax` over a split axis: normalised by every rank's row statistics.
    Softmax { axis: usize },
    /// `LogSoftmax` over a split axis, likewise.
    LogSoftmax { axis: usize },
}

impl VocabOp {
    /// The same op over the whole tensor.
    pub fn whole(self) -> Op {
        match self {
            VocabOp::Embedding => Op::Embedding,
            VocabOp::TakeAlong => Op::TakeAlong,
            VocabOp::Softmax { axis } => Op::Softmax { axis },
            VocabOp::LogSoftmax { axis } => Op::LogSoftmax { axis },
        }
    }
}

impl Op {
    /// The mnemonic the textual IR prints.
    pub fn name(&self) -> &'static str {
        match self {
            Op::Input(_) => "input",
            Op::Param(_) => "param",
            Op::Constant(_) => "const",
            Op::Iota { .. } => "iota",
            Op::Unary(u) => u.name(),
            Op::Binary(b) => b.name(),
            Op::Cast(_) => "cast",
            Op::MatMul => "matmul",
            Op::Transpose { .. } => "transpose",
            Op::Reshape { .. } => "reshape",
            Op::Expand { .. } => "expand",
            Op::Slice { .. } => "slice",
            Op::Concat { .. } => "concat",
            Op::Pad { .. } => "pad",
            Op::CumSum { .. } => "cumsum",
            Op::Reduce { kind, .. } => match kind {
                ReduceKind::Sum => "reduce_sum",
                ReduceKind::Mean => "reduce_mean",
                ReduceKind::Max => "reduce_max",
            },
            Op::Softmax { .. } => "softmax",
            Op::LogSoftmax { .. } => "log_softmax",
            Op::LayerNorm { .. } => "layernorm",
            Op::RmsNorm { .. } => "rmsnorm",
            Op::Dropout { .. } => "dropout",
            Op::CausalMask => "causal_mask",
            Op::Select => "where",
            Op::Embedding => "embedding",
            Op::TakeAlong => "take_along",
            Op::TopK { .. } => "topk",
            Op::MoeDispatch { .. } => "moe_dispatch",
            Op::MoeCombine => "moe_combine",
            Op::Repeat { .. } => "repeat",
            Op::Relayout { .. } => "relayout",
            Op::VocabParallel(_) => "vocab_parallel",
        }
    }

    /// Ops whose output aliases their input's storage (no new memory).
    pub fn is_view(&self) -> bool {
        matches!(
            self,
            Op::Reshape { .. } | Op::Transpose { .. } | Op::Expand { .. } | Op::Slice { .. }
        )
    }
}

/// How a parameter starts before training.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub enum Init {
    Zeros,
    Ones,
    Normal { std: f64 },
}

impl fmt::Display for Init {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Init::Zeros => f.write_str("zeros"),
            Init::Ones => f.write_str("ones"),
            Init::Normal { std } => write!(f, "normal({std})"),
        }
    }
}
