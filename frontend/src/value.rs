//! Elaboration-time values (numbers, dims, tensors, tuples, names, records)
//! and the arithmetic on the ones that are not tensors.

use crate::ast::{BinOp, Span, UnitKind};
use dplc_ir::{DType, Dim, Graph, Ratio, TensorId};

#[derive(Clone, Debug, PartialEq)]
pub enum Value {
    Int(i64),
    Float(f64),
    Bool(bool),
    Str(String),
    /// A symbolic dimension such as `seq` or `batch*seq`; constants are `Int`.
    Dim(Dim),
    DType(DType),
    Tensor(TensorId),
    Tuple(Vec<Value>),
    List(Vec<Value>),
    /// A bare name in a `train` or `cluster` section (`bf16`, `A100_80GB`).
    Name(String),
    Quantity {
        value: f64,
        unit: UnitKind,
        per_device: bool,
    },
    /// `adamw(lr = …)` in a section: the kind and its keyword fields.
    Record {
        kind: String,
        fields: Vec<(String, Value, Span)>,
    },
}

/// Why a non-tensor operation failed: an error code and a message.
pub type OpError = (&'static str, String);

impl Value {
    /// A symbolic dimension, or an `Int` when it is a whole constant.
    pub fn from_dim(d: Dim) -> Value {
        match d.as_const() {
            Some(n) => Value::Int(n),
            None => Value::Dim(d),
        }
    }

    /// How the value reads in an error message.
    pub fn describe(&self, g: &Graph) -> String {
        match self {
            Value::Int(n) => format!("the integer {n}"),
            Value::Float(x) => format!("the number {}", fmt_float(*x)),
            Value::Bool(b) => format!("the bool {b}"),
            Value::Str(s) => format!("the string \"{s}\""),
            Value::Dim(d) => format!("the dimension {}", g.dim_str(d)),
            Value::DType(d) => format!("the type {d}"),
            Value::Tensor(t) => {
                let t = g.tensor(*t);
                format!("a tensor {}{}", t.dtype, g.shape_str(&t.shape))
            }
            Value::Tuple(xs) => format!("a tuple of {} values", xs.len()),
            Value::List(xs) => format!("a list of {} values", xs.len()),
            Value::Name(n) => format!("the name `{n}`"),
            Value::Quantity { unit, .. } => unit.name().to_string(),
            Value::Record { kind, .. } => format!("`{kind}(…)`"),
        }
    }

    /// The value as printed in `dplc` summaries (model arguments).
    pub fn show(&self, g: &Graph) -> String {
        match self {
            Value::Int(n) => n.to_string(),
            Value::Float(x) => fmt_float(*x),
            Value::Bool(b) => b.to_string(),
            Value::Str(s) => format!("\"{s}\""),
            Value::Dim(d) => g.dim_str(d),
            Value::DType(d) => d.to_string(),
            Value::Name(n) => n.clone(),
            Value::Tuple(xs) | Value::List(xs) => {
                let inner: Vec<_> = xs.iter().map(|x| x.show(g)).collect();
                if matches!(self, Value::List(_)) {
                    format!("[{}]", inner.join(", "))
                } else {
                    format!("({})", inner.join(", "))
                }
            }
            other => other.describe(g),
        }
    }

    pub fn as_f64(&self) -> Option<f64> {
        match self {
            Value::Int(n) => Some(*n as f64),
            Value::Float(x) => Some(*x),
            _ => None,
        }
    }
}

pub fn fmt_float(x: f64) -> String {
    let s = format!("{x}");
    if s.contains(['.', 'e', 'i', 'N']) {
        s
    } else {
        format!("{s}.0")
    }
}

fn overflow(op: BinOp) -> OpError {
    (
        "dpl::overflow",
        format!("integer overflow in `{}`", op.symbol()),
    )
}

fn div_zero() -> OpError {
    ("dpl::division-by-zero", "division by zero".to_string())
}

fn dim_of(v: &Value) -> Option<Dim> {
    match v {
        Value::Int(n) => Some(Dim::konst(*n)),
        Value::Dim(d) => Some(d.clone()),
        _ => None,
    }
}

/// `a op b` for values that are not tensors. `names` prints symbols.
pub fn arith(op: BinOp, a: &Value, b: &Value, g: &Graph) -> Result<Value, OpError> {
    use Value::*;
    let mismatch = || {
        (
            "dpl::type",
            format!(
                "`{}` does not apply to {} and {}",
                op.symbol(),
                a.describe(g),
                b.describe(g)
            ),
        )
    };
    match (op, a, b) {
        (BinOp::Eq | BinOp::Ne, _, _) => {
            let eq = match (a, b) {
                (Int(_) | Float(_), Int(_) | Float(_)) => {
                    if let (Int(x), Int(y)) = (a, b) {
                        x == y
                    } else {
                        a.as_f64() == b.as_f64()
                    }
                }
                (Dim(_), Int(_)) | (Int(_), Dim(_)) => false,
                (Tensor(_), _) | (_, Tensor(_)) => return Err(mismatch()),
                _ if std::mem::discriminant(a) == std::mem::discriminant(b) => a == b,
                _ => return Err(mismatch()),
            };
            Ok(Bool(eq == (op == BinOp::Eq)))
        }
        (BinOp::Lt | BinOp::Le | BinOp::Gt | BinOp::Ge, _, _) => {
            let (x, y) = match (a, b) {
                (Int(x), Int(y)) => (*x as f64, *y as f64),
                _ => match (a.as_f64(), b.as_f64()) {
                    (Some(x), Some(y)) => (x, y),
                    _ => return Err(mismatch()),
                },
            };
            let r = match (a, b) {
                (Int(x), Int(y)) => match op {
                    BinOp::Lt => x < y,
                    BinOp::Le => x <= y,
                    BinOp::Gt => x > y,
                    _ => x >= y,
                },
                _ => match op {
                    BinOp::Lt => x < y,
                    BinOp::Le => x <= y,
                    BinOp::Gt => x > y,
                    _ => x >= y,
                },
            };
            Ok(Bool(r))
        }
        (BinOp::And | BinOp::Or, Bool(x), Bool(y)) => {
            Ok(Bool(if op == BinOp::And { *x && *y } else { *x || *y }))
        }
        (_, Int(x), Int(y)) => {
            let (x, y) = (*x, *y);
            match op {
                BinOp::Add => x.checked_add(y).map(Int).ok_or_else(|| overflow(op)),
                BinOp::Sub => x.checked_sub(y).map(Int).ok_or_else(|| overflow(op)),
                BinOp::Mul => x.checked_mul(y).map(Int).ok_or_else(|| overflow(op)),
                BinOp::Div => {
                    if y == 0 {
                        Err(div_zero())
                    } else if x.checked_rem(y) == Some(0) {
                        x.checked_div(y).map(Int).ok_or_else(|| overflow(op))
                    } else {
                        Ok(Float(x as f64 / y as f64))
                    }
                }
                BinOp::Mod => {
                    if y == 0 {
                        Err(div_zero())
                    } else {
                        x.checked_rem_euclid(y).map(Int).ok_or_else(|| overflow(op))
                    }
                }
                BinOp::Pow => {
                    if y < 0 {
                        Ok(Float((x as f64).powf(y as f64)))
                    } else {
                        u32::try_from(y)
                            .ok()
                            .and_then(|e| x.checked_pow(e))
                            .map(Int)
                            .ok_or_else(|| overflow(op))
                    }
                }
                _ => Err(mismatch()),
            }
        }
        (_, Int(_) | Float(_), Int(_) | Float(_)) => {
            let (x, y) = (a.as_f64().unwrap_or(0.0), b.as_f64().unwrap_or(0.0));
            let r = match op {
                BinOp::Add => x + y,
                BinOp::Sub => x - y,
                BinOp::Mul => x * y,
                BinOp::Div | BinOp::Mod if y == 0.0 => return Err(div_zero()),
                BinOp::Div => x / y,
                BinOp::Mod => x.rem_euclid(y),
                BinOp::Pow => x.powf(y),
                _ => return Err(mismatch()),
            };
            if r.is_finite() {
                Ok(Float(r))
            } else {
                Err((
                    "dpl::overflow",
                    format!("`{}` gives a number that is not finite", op.symbol()),
                ))
            }
        }
        (BinOp::Mul | BinOp::Div | BinOp::Add, Dim(_), _)
        | (BinOp::Mul | BinOp::Add, _, Dim(_)) => {
            let (x, y) = match (dim_of(a), dim_of(b)) {
                (Some(x), Some(y)) => (x, y),
                _ => return Err(mismatch()),
            };
            let r = match op {
                BinOp::Mul => x.checked_mul(&y),
                BinOp::Add => x.checked_add(&y),
                _ => {
                    if y.as_const() == Some(0) {
                        return Err(div_zero());
                    }
                    x.checked_div(&y)
                }
            };
            r.map(Value::from_dim).ok_or_else(|| {
                (
                    "dpl::dim",
                    format!(
                        "{} {} {} is not a product of symbols",
                        g.dim_str(&x),
                        op.symbol(),
                        g.dim_str(&y)
                    ),
                )
            })
        }
        (
            BinOp::Mul | BinOp::Div,
            Quantity {
                value,
                unit,
                per_device,
            },
            Int(_) | Float(_),
        ) => {
            let k = b.as_f64().unwrap_or(1.0);
            if op == BinOp::Div && k == 0.0 {
                return Err(div_zero());
            }
            Ok(Quantity {
                value: if op == BinOp::Mul {
                    value * k
                } else {
                    value / k
                },
                unit: *unit,
                per_device: *per_device,
            })
        }
        (BinOp::Add, Str(x), Str(y)) => Ok(Str(format!("{x}{y}"))),
        _ => Err(mismatch()),
    }
}

/// A rational close to `x`, for attributes such as the MoE capacity factor.
pub fn ratio_of(x: f64) -> Option<Ratio> {
    if !x.is_finite() || x <= 0.0 || x > 1e6 {
        return None;
    }
    Ratio::new((x * 1e6).round() as i128, 1_000_000)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ar(op: BinOp, a: Value, b: Value) -> Result<Value, OpError> {
        arith(op, &a, &b, &Graph::new("t"))
    }

    #[test]
    fn int_division_is_exact_or_float() {
        assert_eq!(
            ar(BinOp::Div, Value::Int(768), Value::Int(12)),
            Ok(Value::Int(64))
        );
        assert_eq!(
            ar(BinOp::Div, Value::Int(10), Value::Int(4)),
            Ok(Value::Float(2.5))
        );
        assert_eq!(
            ar(BinOp::Div, Value::Int(1), Value::Int(0)).unwrap_err().0,
            "dpl::division-by-zero"
        );
    }

    #[test]
    fn integer_overflow_is_an_error() {
        let e = ar(BinOp::Mul, Value::Int(i64::MAX), Value::Int(2)).unwrap_err();
        assert_eq!(e.0, "dpl::overflow");
        assert_eq!(
            ar(BinOp::Pow, Value::Int(2), Value::Int(10)),
            Ok(Value::Int(1024))
        );
    }

    #[test]
    fn dims_multiply_with_ints_and_fold_to_constants() {
        let mut g = Graph::new("t");
        let s = Value::Dim(Dim::sym(g.intern_sym("seq")));
        let twice = arith(BinOp::Mul, &s, &Value::Int(2), &g).unwrap();
        assert_eq!(
            g.dim_str(&match &twice {
                Value::Dim(d) => d.clone(),
                _ => panic!(),
            }),
            "2*seq"
        );
        assert_eq!(arith(BinOp::Div, &twice, &s, &g), Ok(Value::Int(2)));
        assert_eq!(
            arith(BinOp::Sub, &s, &Value::Int(1), &g).unwrap_err().0,
            "dpl::type"
        );
    }

    #[test]
    fn comparisons_mix_ints_and_floats() {
        assert_eq!(
            ar(BinOp::Lt, Value::Int(1), Value::Float(1.5)),
            Ok(Value::Bool(true))
        );
        assert_eq!(
            ar(BinOp::Eq, Value::Int(2), Value::Float(2.0)),
            Ok(Value::Bool(true))
        );
        assert_eq!(
            ar(
                BinOp::Eq,
                Value::Str("gelu".into()),
                Value::Str("gelu".into())
            ),
            Ok(Value::Bool(true))
        );
    }
}
