//! What a builtin needs from whoever lowers it: the graph, the source text,
//! new nodes, and the conversions of argument values (with their errors).

use crate::ast::Span;
use crate::diag::{Diag, DiagExt, Res};
use crate::value::Value;
use dplc_ir::{Dim, Graph, Op, Shape, TensorId};

/// Dimensions above this are refused: they are typos, and products of a few
/// of them would overflow the analyses' integers.
pub const MAX_DIM: i64 = 1 << 40;

/// The lowering context of a builtin call. The elaborator implements the
/// four required methods; the argument conversions are written once here.
pub trait Lowering {
    fn graph(&self) -> &Graph;

    /// The source text of `span`, for labels.
    fn text(&self, span: Span) -> &str;

    /// `t` brought into the region being lowered (captured from outer ones).
    fn localize(&mut self, t: TensorId) -> TensorId;

    /// A node of `op` on `inputs` in the current region and scope.
    fn node(&mut self, op: Op, inputs: &[TensorId], span: Span) -> Res<Vec<TensorId>>;

    fn node1(&mut self, op: Op, inputs: &[TensorId], span: Span) -> Res<TensorId> {
        let outs = self.node(op, inputs, span)?;
        outs.first().copied().ok_or_else(|| {
            Diag::new(
                "dpl::internal",
                span,
                "internal error: an op produced no output",
            )
        })
    }

    /// A shape from a list of values, with `-1` (inferred) allowed.
    fn dims_of(&self, items: &[Value], span: Span) -> Res<Vec<Option<Dim>>> {
        let mut out = Vec::new();
        for v in items {
            out.push(match v {
                Value::Int(-1) => None,
                v => Some(self.dim_arg(v, span)?),
            });
        }
        Ok(out)
    }

    fn expected(&self, v: &Value, span: Span, what: &str) -> Box<Diag> {
        let code = if matches!(v, Value::Tensor(_)) {
            "dpl::tensor-not-number"
        } else {
            "dpl::arg-type"
        };
        let code = if what.contains("tensor") {
            "dpl::arg-type"
        } else {
            code
        };
        Diag::new(
            code,
            span,
            format!("expected {what}, found {}", v.describe(self.graph())),
        )
        .label(format!(
            "`{}`",
            self.text(span).chars().take(60).collect::<String>()
        ))
    }

    fn tensor_arg(&mut self, v: &Value, span: Span, op: &str) -> Res<TensorId> {
        match v {
            Value::Tensor(t) => Ok(self.localize(*t)),
            other => Err(self.expected(other, span, &format!("a tensor for `{op}`"))),
        }
    }

    /// A tensor, or a number as a scalar f32 constant that broadcasts.
    fn tensor_or_const(&mut self, v: &Value, span: Span) -> Res<TensorId> {
        match v {
            Value::Tensor(t) => Ok(self.localize(*t)),
            Value::Int(_) | Value::Float(_) => {
                let x = v.as_f64().unwrap_or(0.0);
                self.node1(Op::Constant(x), &[], span)
            }
            other => Err(self.expected(other, span, "a tensor or a number")),
        }
    }

    fn number_arg(&self, v: &Value, span: Span) -> Res<f64> {
        v.as_f64().ok_or_else(|| self.expected(v, span, "a number"))
    }

    fn int_arg(&self, v: &Value, span: Span) -> Res<i64> {
        match v {
            Value::Int(n) => Ok(*n),
            other => Err(self.expected(other, span, "an integer")),
        }
    }

    fn bool_arg(&self, v: &Value, span: Span) -> Res<bool> {
        match v {
            Value::Bool(b) => Ok(*b),
            other => Err(self.expected(other, span, "a bool")),
        }
    }

    fn list_arg(&self, v: &Value, span: Span) -> Res<Vec<Value>> {
        match v {
            Value::List(xs) | Value::Tuple(xs) => Ok(xs.clone()),
            other => Err(self.expected(other, span, "a list")),
        }
    }

    fn axis_arg(&self, t: TensorId, v: &Value, span: Span) -> Res<usize> {
        let a = self.int_arg(v, span)?;
        let shape = &self.graph().tensor(t).shape;
        shape.axis(a).ok_or_else(|| {
            Diag::new(
                "dpl::axis",
                span,
                format!(
                    "axis {a} is out of range for a tensor of shape {}",
                    self.graph().shape_str(shape)
                ),
            )
            .label("no such axis")
            .help(format!(
                "axes run from 0 to {} (or -1 from the end)",
                shape.rank().saturating_sub(1)
            ))
        })
    }

    /// A positive whole dimension, constant or symbolic.
    fn dim_arg(&self, v: &Value, span: Span) -> Res<Dim> {
        let text = self.text(span).chars().take(60).collect::<String>();
        let bad = |why: String| {
            Diag::new(
                "dpl::bad-dim",
                span,
                format!("`{text}` is not a valid dimension: {why}"),
            )
            .label("used as a dimension")
        };
        match v {
            Value::Int(n) if *n <= 0 => Err(bad(format!("it is {n}, dimensions must be positive"))),
            Value::Int(n) if *n > MAX_DIM => Err(bad(format!("{n} is larger than 2^40"))
                .help("dimensions above 2^40 elements are refused")),
            Value::Int(n) => Ok(Dim::konst(*n)),
            Value::Float(x) => Err(bad(format!("it is {}, not an integer", crate::value::fmt_float(*x)))
                .help("`/` is exact or fractional: `768 / 12` is 64 but `10 / 4` is 2.5; floordiv(a, b) rounds down")),
            Value::Dim(d) if d.coeff().numer() > 0 => Ok(d.clone()),
            Value::Dim(d) => Err(bad(format!("{} is not positive", self.graph().dim_str(d)))),
            other => Err(self.expected(other, span, "a dimension (a positive integer or a symbolic size)")),
        }
    }

    fn shape_arg(&self, v: &Value, span: Span, _infer: bool) -> Res<Shape> {
        let items = self.list_arg(v, span)?;
        let mut dims = Vec::new();
        for x in &items {
            dims.push(self.dim_arg(x, span)?);
        }
        Ok(Shape(dims))
    }

    /// The target shape of a reshape; one `-1` is inferred from the element count.
    fn reshape_dims(&self, x: TensorId, v: &Value, span: Span) -> Res<Shape> {
        let items = self.list_arg(v, span)?;
        let dims = self.dims_of(&items, span)?;
        let unknown = dims.iter().filter(|d| d.is_none()).count();
        if unknown > 1 {
            return Err(Diag::new(
                "dpl::bad-dim",
                span,
                "only one dimension of a reshape can be -1",
            )
            .label("two -1s"));
        }
        let known = dims
            .iter()
            .flatten()
            .try_fold(Dim::konst(1), |acc, d| acc.checked_mul(d));
        let numel = self.graph().tensor(x).shape.numel();
        let fill = match (unknown, known, numel) {
            (0, _, _) => None,
            (_, Some(k), Some(n)) => match n.checked_div(&k) {
                Some(d) if d.coeff().denom() == 1 && d.coeff().numer() > 0 => Some(d),
                _ => {
                    return Err(Diag::new(
                        "dpl::shape",
                        span,
                        format!(
                            "cannot infer -1: {} elements do not divide by {}",
                            self.graph().dim_str(&n),
                            self.graph().dim_str(&k)
                        ),
                    )
                    .label("in this shape"))
                }
            },
            _ => {
                return Err(
                    Diag::new("dpl::overflow", span, "the shape's size overflows").label("here"),
                )
            }
        };
        Ok(Shape(
            dims.into_iter()
                .map(|d| d.unwrap_or_else(|| fill.clone().unwrap_or_else(|| Dim::konst(1))))
                .collect(),
        ))
    }
}
