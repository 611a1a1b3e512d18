//! The primitive functions a .dpl file can call: their signatures (for binding
//! arguments and for error hints) and how each lowers to IR ops.

use crate::ast::Span;
use crate::diag::{Diag, DiagExt, Res};
use crate::lowering::Lowering;
use crate::value::{ratio_of, Value};
use dplc_ir::{BinaryOp, DType, Op, ReduceKind, UnaryOp};

/// A default value of a builtin's parameter.
#[derive(Clone, Copy, Debug)]
pub enum ArgDefault {
    Required,
    Int(i64),
    Float(f64),
    Bool(bool),
}

pub struct Builtin {
    pub name: &'static str,
    pub params: &'static [(&'static str, ArgDefault)],
    pub doc: &'static str,
}

use ArgDefault::{Bool as B, Float as F, Int as I, Required as R};

const X: &[(&str, ArgDefault)] = &[("x", R)];
const REDUCE: &[(&str, ArgDefault)] = &[("x", R), ("axis", I(-1)), ("keep_dim", B(false))];
const AXIS: &[(&str, ArgDefault)] = &[("x", R), ("axis", I(-1))];
const AB: &[(&str, ArgDefault)] = &[("a", R), ("b", R)];

pub const BUILTINS: &[Builtin] = &[
    Builtin {
        name: "matmul",
        params: AB,
        doc: "`a @ b`: [.., m, k] × [.., k, n]",
    },
    Builtin {
        name: "max",
        params: AB,
        doc: "elementwise maximum (numbers too)",
    },
    Builtin {
        name: "min",
        params: AB,
        doc: "elementwise minimum (numbers too)",
    },
    Builtin {
        name: "pow",
        params: AB,
        doc: "`a ** b` elementwise",
    },
    Builtin {
        name: "exp",
        params: X,
        doc: "eˣ (numbers too)",
    },
    Builtin {
        name: "log",
        params: X,
        doc: "natural log (numbers too)",
    },
    Builtin {
        name: "sqrt",
        params: X,
        doc: "square root (numbers too, giving a float)",
    },
    Builtin {
        name: "rsqrt",
        params: X,
        doc: "1/√x",
    },
    Builtin {
        name: "recip",
        params: X,
        doc: "1/x",
    },
    Builtin {
        name: "tanh",
        params: X,
        doc: "hyperbolic tangent (numbers too)",
    },
    Builtin {
        name: "sigmoid",
        params: X,
        doc: "1/(1+e⁻ˣ)",
    },
    Builtin {
        name: "relu",
        params: X,
        doc: "max(x, 0)",
    },
    Builtin {
        name: "gelu",
        params: X,
        doc: "GELU with erf (BERT)",
    },
    Builtin {
        name: "gelu_tanh",
        params: X,
        doc: "GELU, tanh approximation (GPT-2)",
    },
    Builtin {
        name: "silu",
        params: X,
        doc: "x·sigmoid(x)",
    },
    Builtin {
        name: "sin",
        params: X,
        doc: "sine (numbers too)",
    },
    Builtin {
        name: "cos",
        params: X,
        doc: "cosine (numbers too)",
    },
    Builtin {
        name: "neg",
        params: X,
        doc: "−x",
    },
    Builtin {
        name: "abs",
        params: X,
        doc: "|x| (numbers too)",
    },
    Builtin {
        name: "floor",
        params: X,
        doc: "largest integer ≤ x, as a float (numbers too); no gradient",
    },
    Builtin {
        name: "where",
        params: &[("cond", R), ("a", R), ("b", R)],
        doc: "`a` where `cond` is non-zero, else `b`, broadcasting; no gradient to `cond`",
    },
    Builtin {
        name: "lt",
        params: AB,
        doc: "a < b elementwise: 1 where it holds, else 0; no gradient",
    },
    Builtin {
        name: "le",
        params: AB,
        doc: "a ≤ b elementwise (1 or 0)",
    },
    Builtin {
        name: "gt",
        params: AB,
        doc: "a > b elementwise (1 or 0)",
    },
    Builtin {
        name: "ge",
        params: AB,
        doc: "a ≥ b elementwise (1 or 0)",
    },
    Builtin {
        name: "eq",
        params: AB,
        doc: "a = b elementwise (1 or 0)",
    },
    Builtin {
        name: "ne",
        params: AB,
        doc: "a ≠ b elementwise (1 or 0)",
    },
    Builtin {
        name: "cast",
        params: &[("x", R), ("dtype", R)],
        doc: "convert to f32, bf16, f16 or i32; a number becomes a scalar tensor",
    },
    Builtin {
        name: "sum",
        params: REDUCE,
        doc: "sum over one axis",
    },
    Builtin {
        name: "mean",
        params: REDUCE,
        doc: "mean over one axis",
    },
    Builtin {
        name: "amax",
        params: REDUCE,
        doc: "maximum over one axis",
    },
    Builtin {
        name: "softmax",
        params: AXIS,
        doc: "numerically stable softmax",
    },
    Builtin {
        name: "log_softmax",
        params: AXIS,
        doc: "numerically stable log-softmax",
    },
    Builtin {
        name: "layernorm",
        params: &[("x", R), ("w", R), ("b", R), ("eps", F(1e-5))],
        doc: "layer norm over the last axis, scale w, shift b",
    },
    Builtin {
        name: "rmsnorm",
        params: &[("x", R), ("w", R), ("eps", F(1e-6))],
        doc: "RMS norm over the last axis, scale w",
    },
    Builtin {
        name: "dropout",
        params: &[("x", R), ("p", R)],
        doc: "dropout with probability p; p = 0 emits nothing",
    },
    Builtin {
        name: "causal_mask",
        params: X,
        doc: "−∞ above the diagonal of the last two axes",
    },
    Builtin {
        name: "reshape",
        params: &[("x", R), ("dims", R)],
        doc: "same elements, new shape; one dim may be -1",
    },
    Builtin {
        name: "transpose",
        params: &[("x", R), ("a", I(-2)), ("b", I(-1))],
        doc: "swap two axes",
    },
    Builtin {
        name: "permute",
        params: &[("x", R), ("perm", R)],
        doc: "output axis i is input axis perm[i]",
    },
    Builtin {
        name: "expand",
        params: &[("x", R), ("dims", R)],
        doc: "broadcast size-1 axes to dims",
    },
    Builtin {
        name: "slice",
        params: &[("x", R), ("axis", R), ("start", R), ("len", R)],
        doc: "len elements from start along a fixed-size axis",
    },
    Builtin {
        name: "pad",
        params: &[
            ("x", R),
            ("axis", R),
            ("before", R),
            ("after", R),
            ("value", F(0.0)),
        ],
        doc: "`before`/`after` elements of `value` at the two ends of an axis \
              (negative: drop that many); a symbolic axis only keeps its length",
    },
    Builtin {
        name: "shift",
        params: &[("x", R), ("axis", R), ("by", R), ("fill", F(0.0))],
        doc: "move elements `by` places along an axis (symbolic too), `fill` in the gap",
    },
    Builtin {
        name: "cumsum",
        params: &[("x", R), ("axis", I(-1)), ("reverse", B(false))],
        doc: "running sum along an axis (from the end when reverse)",
    },
    Builtin {
        name: "concat",
        params: &[("xs", R), ("axis", I(-1))],
        doc: "join a list of tensors along axis",
    },
    Builtin {
        name: "embedding",
        params: &[("table", R), ("indices", R)],
        doc: "rows of table [n, d] at i32 indices: [.., d]",
    },
    Builtin {
        name: "take_along",
        params: &[("x", R), ("indices", R)],
        doc: "x[.., n] at i32 indices [..] along the last axis",
    },
    Builtin {
        name: "topk",
        params: &[("x", R), ("k", R)],
        doc: "(values, indices) of the k largest along the last axis",
    },
    Builtin {
        name: "moe_dispatch",
        params: &[
            ("x", R),
            ("indices", R),
            ("experts", R),
            ("capacity_factor", F(1.0)),
        ],
        doc: "route tokens [t, d] to [experts, capacity, d]",
    },
    Builtin {
        name: "moe_combine",
        params: &[("y", R), ("weights", R), ("indices", R)],
        doc: "gather expert outputs back to [t, d], weighted",
    },
    Builtin {
        name: "positions",
        params: &[("n", R)],
        doc: "i32 [0, 1, …, n-1]",
    },
    Builtin {
        name: "is_tensor",
        params: &[("v", R)],
        doc: "whether a value is a tensor: for optional tensor arguments (`bias = false`)",
    },
    Builtin {
        name: "dim",
        params: &[("x", R), ("axis", R)],
        doc: "the size of one axis, as a number or symbolic dim",
    },
    Builtin {
        name: "shape",
        params: X,
        doc: "the list of a tensor's dims",
    },
    Builtin {
        name: "rank",
        params: X,
        doc: "the number of axes",
    },
    Builtin {
        name: "len",
        params: &[("xs", R)],
        doc: "the length of a list or tuple",
    },
    Builtin {
        name: "int",
        params: &[("v", R)],
        doc: "a number or constant dim as an integer (floats truncate)",
    },
    Builtin {
        name: "float",
        params: &[("v", R)],
        doc: "a number as a float",
    },
    Builtin {
        name: "floordiv",
        params: AB,
        doc: "integer division rounding down (`//` is a comment)",
    },
    Builtin {
        name: "error",
        params: &[("message", R)],
        doc: "stop with an error: for checks in blocks",
    },
];

pub fn find(name: &str) -> Option<&'static Builtin> {
    BUILTINS.iter().find(|b| b.name == name)
}

impl Builtin {
    /// `sum(x, axis = -1, keep_dim = false)`.
    pub fn signature(&self) -> String {
        let params: Vec<String> = self
            .params
            .iter()
            .map(|(n, d)| match d {
                ArgDefault::Required => n.to_string(),
                ArgDefault::Int(i) => format!("{n} = {i}"),
                ArgDefault::Float(x) => format!("{n} = {}", crate::value::fmt_float(*x)),
                ArgDefault::Bool(b) => format!("{n} = {b}"),
            })
            .collect();
        format!("{}({}) ({})", self.name, params.join(", "), self.doc)
    }
}

fn unary_op(name: &str) -> Option<UnaryOp> {
    UnaryOp::ALL.into_iter().find(|u| u.name() == name)
}

/// Call builtin `b` with its bound arguments (defaults filled in).
pub fn call(e: &mut dyn Lowering, b: &Builtin, args: Vec<(Value, Span)>, span: Span) -> Res<Value> {
    let arg = |i: usize| &args[i].0;
    let at = |i: usize| args[i].1;
    let name = b.name;
    if let Some(u) = unary_op(name) {
        if let Some(x) = arg(0).as_f64() {
            let r = match u {
                UnaryOp::Exp => Some(x.exp()),
                UnaryOp::Log if x > 0.0 => Some(x.ln()),
                UnaryOp::Sqrt if x >= 0.0 => Some(x.sqrt()),
                UnaryOp::Tanh => Some(x.tanh()),
                UnaryOp::Sin => Some(x.sin()),
                UnaryOp::Cos => Some(x.cos()),
                UnaryOp::Neg => Some(-x),
                UnaryOp::Abs => Some(x.abs()),
                UnaryOp::Floor => Some(x.floor()),
                UnaryOp::Log | UnaryOp::Sqrt => {
                    return Err(Diag::new(
                        "dpl::domain",
                        span,
                        format!(
                            "`{name}` of {} is not a real number",
                            crate::value::fmt_float(x)
                        ),
                    )
                    .label("out of domain"))
                }
                _ => None,
            };
            if let Some(r) = r {
                return Ok(Value::Float(r));
            }
        }
        let t = e.tensor_arg(arg(0), at(0), name)?;
        return e.node1(Op::Unary(u), &[t], span).map(Value::Tensor);
    }
    match name {
        "matmul" => {
            let (a, c) = (
                e.tensor_arg(arg(0), at(0), name)?,
                e.tensor_arg(arg(1), at(1), name)?,
            );
            e.node1(Op::MatMul, &[a, c], span).map(Value::Tensor)
        }
        "max" | "min" | "pow" => {
            let op = match name {
                "max" => BinaryOp::Max,
                "min" => BinaryOp::Min,
                _ => BinaryOp::Pow,
            };
            if let (Some(x), Some(y)) = (arg(0).as_f64(), arg(1).as_f64()) {
                if let (Value::Int(x), Value::Int(y), false) = (arg(0), arg(1), name == "pow") {
                    return Ok(Value::Int(if name == "max" {
                        *x.max(y)
                    } else {
                        *x.min(y)
                    }));
                }
                let r = match op {
                    BinaryOp::Max => x.max(y),
                    BinaryOp::Min => x.min(y),
                    _ => x.powf(y),
                };
                return Ok(Value::Float(r));
            }
            let (a, c) = (
                e.tensor_or_const(arg(0), at(0))?,
                e.tensor_or_const(arg(1), at(1))?,
            );
            e.node1(Op::Binary(op), &[a, c], span).map(Value::Tensor)
        }
        "where" => {
            // A number for a condition picks one side outright.
            if let Some(c) = arg(0).as_f64() {
                return Ok(if c != 0.0 {
                    arg(1).clone()
                } else {
                    arg(2).clone()
                });
            }
            let c = e.tensor_arg(arg(0), at(0), name)?;
            let (a, b) = (
                e.tensor_or_const(arg(1), at(1))?,
                e.tensor_or_const(arg(2), at(2))?,
            );
            e.node1(Op::Select, &[c, a, b], span).map(Value::Tensor)
        }
        "lt" | "le" | "gt" | "ge" | "eq" | "ne" => {
            let op = BinaryOp::ALL
                .into_iter()
                .find(|b| b.name() == name)
                .expect("every comparison is a binary op");
            if let (Some(x), Some(y)) = (arg(0).as_f64(), arg(1).as_f64()) {
                return Ok(Value::Float(op.compare(x, y).expect("a comparison")));
            }
            let (a, c) = (
                e.tensor_or_const(arg(0), at(0))?,
                e.tensor_or_const(arg(1), at(1))?,
            );
            e.node1(Op::Binary(op), &[a, c], span).map(Value::Tensor)
        }
        "cast" => {
            let Value::DType(to) = arg(1) else {
                return Err(e.expected(arg(1), at(1), "a type: f32, bf16, f16 or i32"));
            };
            let t = e.tensor_or_const(arg(0), at(0))?;
            e.node1(Op::Cast(*to), &[t], span).map(Value::Tensor)
        }
        "sum" | "mean" | "amax" => {
            let kind = match name {
                "sum" => ReduceKind::Sum,
                "mean" => ReduceKind::Mean,
                _ => ReduceKind::Max,
            };
            let t = e.tensor_arg(arg(0), at(0), name)?;
            let axis = e.axis_arg(t, arg(1), at(1))?;
            let keep_dim = e.bool_arg(arg(2), at(2))?;
            e.node1(
                Op::Reduce {
                    kind,
                    axis,
                    keep_dim,
                },
                &[t],
                span,
            )
            .map(Value::Tensor)
        }
        "softmax" | "log_softmax" => {
            let t = e.tensor_arg(arg(0), at(0), name)?;
            let axis = e.axis_arg(t, arg(1), at(1))?;
            let op = if name == "softmax" {
                Op::Softmax { axis }
            } else {
                Op::LogSoftmax { axis }
            };
            e.node1(op, &[t], span).map(Value::Tensor)
        }
        "layernorm" => {
            let x = e.tensor_arg(arg(0), at(0), name)?;
            let w = e.tensor_arg(arg(1), at(1), name)?;
            let bias = e.tensor_arg(arg(2), at(2), name)?;
            let eps = e.number_arg(arg(3), at(3))?;
            e.node1(Op::LayerNorm { eps }, &[x, w, bias], span)
                .map(Value::Tensor)
        }
        "rmsnorm" => {
            let x = e.tensor_arg(arg(0), at(0), name)?;
            let w = e.tensor_arg(arg(1), at(1), name)?;
            let eps = e.number_arg(arg(2), at(2))?;
            e.node1(Op::RmsNorm { eps }, &[x, w], span)
                .map(Value::Tensor)
        }
        "dropout" => {
            let x = e.tensor_arg(arg(0), at(0), name)?;
            let p = e.number_arg(arg(1), at(1))?;
            if p == 0.0 {
                return Ok(Value::Tensor(x));
            }
            e.node1(
                Op::Dropout {
                    p,
                    context: None,
                    split: None,
                },
                &[x],
                span,
            )
            .map(Value::Tensor)
        }
        "causal_mask" => {
            let x = e.tensor_arg(arg(0), at(0), name)?;
            e.node1(Op::CausalMask, &[x], span).map(Value::Tensor)
        }
        "reshape" | "expand" => {
            let x = e.tensor_arg(arg(0), at(0), name)?;
            let shape = if name == "reshape" {
                e.reshape_dims(x, arg(1), at(1))?
            } else {
                e.shape_arg(arg(1), at(1), false)?
            };
            let op = if name == "reshape" {
                Op::Reshape { shape }
            } else {
                Op::Expand { shape }
            };
            e.node1(op, &[x], span).map(Value::Tensor)
        }
        "transpose" => {
            let x = e.tensor_arg(arg(0), at(0), name)?;
            let a = e.axis_arg(x, arg(1), at(1))?;
            let c = e.axis_arg(x, arg(2), at(2))?;
            let mut perm: Vec<usize> = (0..e.graph().tensor(x).shape.rank()).collect();
            perm.swap(a, c);
            e.node1(Op::Transpose { perm }, &[x], span)
                .map(Value::Tensor)
        }
        "permute" => {
            let x = e.tensor_arg(arg(0), at(0), name)?;
            let items = e.list_arg(arg(1), at(1))?;
            let mut perm = Vec::new();
            for v in items {
                perm.push(e.axis_arg(x, &v, at(1))?);
            }
            e.node1(Op::Transpose { perm }, &[x], span)
                .map(Value::Tensor)
        }
        "slice" => {
            let x = e.tensor_arg(arg(0), at(0), name)?;
            let axis = e.axis_arg(x, arg(1), at(1))?;
            let start = e.int_arg(arg(2), at(2))?;
            let len = e.int_arg(arg(3), at(3))?;
            e.node1(Op::Slice { axis, start, len }, &[x], span)
                .map(Value::Tensor)
        }
        "pad" | "shift" => {
            let x = e.tensor_arg(arg(0), at(0), name)?;
            let axis = e.axis_arg(x, arg(1), at(1))?;
            let (before, after, value) = if name == "pad" {
                let (b, a) = (e.int_arg(arg(2), at(2))?, e.int_arg(arg(3), at(3))?);
                (b, a, e.number_arg(arg(4), at(4))?)
            } else {
                let by = e.int_arg(arg(2), at(2))?;
                (
                    by,
                    by.checked_neg().unwrap_or(i64::MAX),
                    e.number_arg(arg(3), at(3))?,
                )
            };
            e.node1(
                Op::Pad {
                    axis,
                    before,
                    after,
                    value,
                },
                &[x],
                span,
            )
            .map(Value::Tensor)
        }
        "cumsum" => {
            let x = e.tensor_arg(arg(0), at(0), name)?;
            let axis = e.axis_arg(x, arg(1), at(1))?;
            let reverse = e.bool_arg(arg(2), at(2))?;
            e.node1(Op::CumSum { axis, reverse }, &[x], span)
                .map(Value::Tensor)
        }
        "concat" => {
            let items = e.list_arg(arg(0), at(0))?;
            let mut ts = Vec::new();
            for v in &items {
                ts.push(e.tensor_arg(v, at(0), name)?);
            }
            let first = *ts.first().ok_or_else(|| {
                Diag::new("dpl::arg-type", at(0), "`concat` needs at least one tensor")
                    .label("empty list")
            })?;
            let axis = e.axis_arg(first, arg(1), at(1))?;
            e.node1(Op::Concat { axis }, &ts, span).map(Value::Tensor)
        }
        "embedding" | "take_along" => {
            let a = e.tensor_arg(arg(0), at(0), name)?;
            let c = e.tensor_arg(arg(1), at(1), name)?;
            let op = if name == "embedding" {
                Op::Embedding
            } else {
                Op::TakeAlong
            };
            e.node1(op, &[a, c], span).map(Value::Tensor)
        }
        "topk" => {
            let x = e.tensor_arg(arg(0), at(0), name)?;
            let k = e.int_arg(arg(1), at(1))?;
            let outs = e.node(Op::TopK { k }, &[x], span)?;
            Ok(Value::Tuple(outs.into_iter().map(Value::Tensor).collect()))
        }
        "moe_dispatch" => {
            let x = e.tensor_arg(arg(0), at(0), name)?;
            let idx = e.tensor_arg(arg(1), at(1), name)?;
            let experts = e.int_arg(arg(2), at(2))?;
            if experts < 1 {
                return Err(Diag::new(
                    "dpl::arg-type",
                    at(2),
                    "the number of experts must be positive",
                )
                .label(format!("is {experts}")));
            }
            let cf = e.number_arg(arg(3), at(3))?;
            let capacity_factor = ratio_of(cf).ok_or_else(|| {
                Diag::new(
                    "dpl::arg-type",
                    at(3),
                    "the capacity factor must be a positive number",
                )
                .label("out of range")
            })?;
            e.node1(
                Op::MoeDispatch {
                    experts,
                    capacity_factor,
                },
                &[x, idx],
                span,
            )
            .map(Value::Tensor)
        }
        "moe_combine" => {
            let y = e.tensor_arg(arg(0), at(0), name)?;
            let w = e.tensor_arg(arg(1), at(1), name)?;
            let idx = e.tensor_arg(arg(2), at(2), name)?;
            e.node1(Op::MoeCombine, &[y, w, idx], span)
                .map(Value::Tensor)
        }
        "positions" => {
            let len = e.dim_arg(arg(0), at(0))?;
            e.node1(Op::Iota { len }, &[], span).map(Value::Tensor)
        }
        "is_tensor" => Ok(Value::Bool(matches!(arg(0), Value::Tensor(_)))),
        "dim" => {
            let x = e.tensor_arg(arg(0), at(0), name)?;
            let axis = e.axis_arg(x, arg(1), at(1))?;
            Ok(Value::from_dim(e.graph().tensor(x).shape.0[axis].clone()))
        }
        "shape" => {
            let x = e.tensor_arg(arg(0), at(0), name)?;
            let dims = e.graph().tensor(x).shape.0.clone();
            Ok(Value::List(dims.into_iter().map(Value::from_dim).collect()))
        }
        "rank" => {
            let x = e.tensor_arg(arg(0), at(0), name)?;
            Ok(Value::Int(e.graph().tensor(x).shape.rank() as i64))
        }
        "len" => {
            let items = e.list_arg(arg(0), at(0))?;
            Ok(Value::Int(items.len() as i64))
        }
        "int" => match arg(0) {
            Value::Int(n) => Ok(Value::Int(*n)),
            Value::Float(x) if x.is_finite() && x.abs() < 9.2e18 => {
                Ok(Value::Int(x.trunc() as i64))
            }
            v => Err(e.expected(v, at(0), "a finite number")),
        },
        "float" => match arg(0).as_f64() {
            Some(x) => Ok(Value::Float(x)),
            None => Err(e.expected(arg(0), at(0), "a number")),
        },
        "floordiv" => {
            let (a, c) = (e.int_arg(arg(0), at(0))?, e.int_arg(arg(1), at(1))?);
            if c == 0 {
                return Err(
                    Diag::new("dpl::division-by-zero", at(1), "division by zero")
                        .label("this is zero"),
                );
            }
            let q = a.checked_div(c).ok_or_else(|| {
                Diag::new("dpl::overflow", span, "integer overflow in `floordiv`")
            })?;
            // Round toward −∞ like Python's `//`, not toward zero like Rust's `/`.
            Ok(Value::Int(if a % c != 0 && ((a < 0) != (c < 0)) {
                q - 1
            } else {
                q
            }))
        }
        "error" => {
            let msg = match arg(0) {
                Value::Str(s) => s.clone(),
                v => v.show(e.graph()),
            };
            Err(Diag::new("dpl::user-error", span, msg).label("raised here"))
        }
        _ => Err(Diag::new(
            "dpl::internal",
            span,
            format!("internal error: builtin `{name}` has no lowering"),
        )),
    }
}

pub fn dtype_names() -> impl Iterator<Item = &'static str> {
    DType::ALL.into_iter().map(|d| d.name())
}
