//! Expressions: literals, names, arithmetic and comparisons on values.

use super::*;

impl<'p> Elab<'p> {
    pub fn eval(&mut self, e: &Expr) -> Res<Value> {
        match &e.kind {
            ExprKind::Int(n) => Ok(Value::Int(*n)),
            ExprKind::Float(x) => Ok(Value::Float(*x)),
            ExprKind::Bool(b) => Ok(Value::Bool(*b)),
            ExprKind::Str(s) => Ok(Value::Str(s.clone())),
            ExprKind::Quantity {
                value,
                unit,
                per_device,
            } => Ok(Value::Quantity {
                value: *value,
                unit: *unit,
                per_device: *per_device,
            }),
            ExprKind::Name(n) => {
                if let Some(v) = self.lookup(n) {
                    return Ok(self.localize_value(v));
                }
                if self.section_mode {
                    return Ok(Value::Name(n.clone()));
                }
                if let Some(v) = global(n) {
                    return Ok(v);
                }
                Err(self.unknown_name(n, e.span, "is not defined here"))
            }
            ExprKind::Tuple(xs) | ExprKind::List(xs) => {
                let mut vs = Vec::new();
                for x in xs {
                    vs.push(self.eval(x)?);
                }
                Ok(if matches!(e.kind, ExprKind::Tuple(_)) {
                    Value::Tuple(vs)
                } else {
                    Value::List(vs)
                })
            }
            ExprKind::Unary(op, x) => {
                let v = self.eval(x)?;
                match (op, &v) {
                    (UnOp::Not, Value::Bool(b)) => Ok(Value::Bool(!b)),
                    (UnOp::Neg, Value::Int(n)) => {
                        n.checked_neg().map(Value::Int).ok_or_else(|| {
                            Diag::new("dpl::overflow", e.span, "integer overflow in `-`")
                                .label("here")
                        })
                    }
                    (UnOp::Neg, Value::Float(x)) => Ok(Value::Float(-x)),
                    // Negative only to be refused by name where a quantity is read.
                    (
                        UnOp::Neg,
                        Value::Quantity {
                            value,
                            unit,
                            per_device,
                        },
                    ) => Ok(Value::Quantity {
                        value: -value,
                        unit: *unit,
                        per_device: *per_device,
                    }),
                    (UnOp::Neg, Value::Tensor(t)) => self
                        .node1(Op::Unary(dplc_ir::UnaryOp::Neg), &[*t], e.span)
                        .map(Value::Tensor),
                    (UnOp::Not, _) => Err(self.expected(&v, x.span, "a bool")),
                    (UnOp::Neg, _) => Err(self.expected(&v, x.span, "a number or a tensor")),
                }
            }
            ExprKind::Binary(op, a, b) => self.binary(*op, a, b, e.span),
            ExprKind::Call { callee, args } => self.call(callee, args, e.span),
        }
    }

    pub(super) fn binary(&mut self, op: BinOp, a: &Expr, b: &Expr, span: Span) -> Res<Value> {
        let x = self.eval(a)?;
        // `and` and `or` short-circuit, so `kv < heads and heads % kv == 0` is safe.
        if matches!(op, BinOp::And | BinOp::Or) {
            match x {
                Value::Bool(v) if (op == BinOp::And) != v => return Ok(Value::Bool(v)),
                Value::Bool(_) => {}
                other => return Err(self.expected(&other, a.span, "a bool")),
            }
            let y = self.eval(b)?;
            return match y {
                Value::Bool(v) => Ok(Value::Bool(v)),
                other => Err(self.expected(&other, b.span, "a bool")),
            };
        }
        let y = self.eval(b)?;
        let tensors = matches!(x, Value::Tensor(_)) || matches!(y, Value::Tensor(_));
        if !tensors {
            return arith(op, &x, &y, &self.g).map_err(|(code, msg)| {
                let d = Diag::new(code, span, msg);
                match code {
                    "dpl::division-by-zero" => {
                        d.label(format!("`{}` is zero", self.prog.text(b.span)))
                    }
                    _ => d.label("here"),
                }
            });
        }
        let bin = match op {
            BinOp::Add => dplc_ir::BinaryOp::Add,
            BinOp::Sub => dplc_ir::BinaryOp::Sub,
            BinOp::Mul => dplc_ir::BinaryOp::Mul,
            BinOp::Div => dplc_ir::BinaryOp::Div,
            BinOp::Pow => dplc_ir::BinaryOp::Pow,
            BinOp::MatMul => {
                let (ta, tb) = (
                    self.tensor_arg(&x, a.span, "@")?,
                    self.tensor_arg(&y, b.span, "@")?,
                );
                return self.node1(Op::MatMul, &[ta, tb], span).map(Value::Tensor);
            }
            _ => {
                return Err(Diag::new(
                    "dpl::type",
                    span,
                    format!("`{}` does not apply to tensors", op.symbol()),
                )
                .label(format!(
                    "{} {} {}",
                    x.describe(&self.g),
                    op.symbol(),
                    y.describe(&self.g)
                )))
            }
        };
        let ta = self.tensor_or_const(&x, a.span)?;
        let tb = self.tensor_or_const(&y, b.span)?;
        self.node1(Op::Binary(bin), &[ta, tb], span)
            .map(Value::Tensor)
    }

    pub(super) fn unknown_name(&self, name: &str, span: Span, label: &str) -> Box<Diag> {
        let names = self.visible_names();
        let d = Diag::new("dpl::unknown-name", span, format!("unknown name `{name}`")).label(label);
        match did_you_mean(name, names.iter().map(String::as_str)) {
            Some(s) => d.help(s),
            None => d.help(
                "names must be defined before use: a formal, an assignment, a param or an input",
            ),
        }
    }
}
