//! Type inference: the element type and shape of each output of an op
//! from its inputs', checked as the builder adds the node (numpy
//! broadcasting, matmul and attention shapes, reductions, the structural
//! ops), with an error that names the op and what does not fit.

use super::*;

impl Graph {
    pub(super) fn infer(&self, op: &Op, inputs: &[TensorId]) -> Result<Vec<(DType, Shape)>> {
        let name = op.name();
        let arity = |expected: &'static str, ok: bool| -> Result<()> {
            if ok {
                Ok(())
            } else {
                Err(IrError::Arity {
                    op: name,
                    expected,
                    got: inputs.len(),
                })
            }
        };
        let t = |i: usize| self.tensor(inputs[i]);
        let float = |i: usize| -> Result<()> {
            if t(i).dtype.is_float() {
                Ok(())
            } else {
                Err(IrError::DType {
                    op: name,
                    detail: format!("input {} is {}, a float type is needed", i + 1, t(i).dtype),
                })
            }
        };
        let int = |i: usize| -> Result<()> {
            if t(i).dtype == DType::I32 {
                Ok(())
            } else {
                Err(IrError::DType {
                    op: name,
                    detail: format!("input {} is {}, indices must be i32", i + 1, t(i).dtype),
                })
            }
        };
        let same_dtype = |i: usize, j: usize| -> Result<()> {
            if t(i).dtype == t(j).dtype {
                Ok(())
            } else {
                Err(IrError::DType {
                    op: name,
                    detail: format!("{} and {}", t(i).dtype, t(j).dtype),
                })
            }
        };
        let shape_err = |detail: String| IrError::Shape { op: name, detail };
        let s = |i: usize| self.shape_str(&t(i).shape);

        Ok(match op {
            Op::Input(id) => {
                arity("no", inputs.is_empty())?;
                let info = self.input(*id);
                vec![(info.dtype, info.shape.clone())]
            }
            Op::Param(p) => {
                arity("no", inputs.is_empty())?;
                let info = self.param(*p);
                vec![(info.dtype, info.shape.clone())]
            }
            Op::Constant(_) => {
                arity("no", inputs.is_empty())?;
                vec![(DType::F32, Shape::scalar())]
            }
            Op::Iota { len } => {
                arity("no", inputs.is_empty())?;
                vec![(DType::I32, Shape(vec![len.clone()]))]
            }
            Op::Unary(_) => {
                arity("1", inputs.len() == 1)?;
                float(0)?;
                vec![(t(0).dtype, t(0).shape.clone())]
            }
            Op::Binary(b) => {
                arity("2", inputs.len() == 2)?;
                same_dtype(0, 1)?;
                if *b != BinaryOp::Add && *b != BinaryOp::Sub && *b != BinaryOp::Mul {
                    float(0)?;
                }
                let shape = broadcast(&t(0).shape, &t(1).shape)
                    .ok_or_else(|| shape_err(format!("{} and {} do not broadcast", s(0), s(1))))?;
                vec![(t(0).dtype, shape)]
            }
            Op::Cast(to) => {
                arity("1", inputs.len() == 1)?;
                vec![(*to, t(0).shape.clone())]
            }
            Op::MatMul => {
                arity("2", inputs.len() == 2)?;
                float(0)?;
                float(1)?;
                same_dtype(0, 1)?;
                let (a, b) = (t(0).shape.dims(), t(1).shape.dims());
                if a.len() < 2 || b.len() < 2 {
                    return Err(shape_err(format!(
                        "{} × {}: both operands need at least two dimensions",
                        s(0),
                        s(1)
                    )));
                }
                let (m, k1) = (&a[a.len() - 2], &a[a.len() - 1]);
                let (k2, n) = (&b[b.len() - 2], &b[b.len() - 1]);
                if k1 != k2 {
                    return Err(shape_err(format!(
                        "{} × {}: inner dimensions {} and {} differ",
                        s(0),
                        s(1),
                        self.dim_str(k1),
                        self.dim_str(k2)
                    )));
                }
                let batch = broadcast(
                    &Shape(a[..a.len() - 2].to_vec()),
                    &Shape(b[..b.len() - 2].to_vec()),
                )
                .ok_or_else(|| {
                    shape_err(format!(
                        "{} × {}: batch dimensions do not broadcast",
                        s(0),
                        s(1)
                    ))
                })?;
                let mut dims = batch.0;
                dims.push(m.clone());
                dims.push(n.clone());
                vec![(t(0).dtype, Shape(dims))]
            }
            Op::Transpose { perm } => {
                arity("1", inputs.len() == 1)?;
                let dims = t(0).shape.dims();
                let mut seen = vec![false; dims.len()];
                let valid = perm.len() == dims.len()
                    && perm
                        .iter()
                        .all(|&p| p < dims.len() && !std::mem::replace(&mut seen[p], true));
                if !valid {
                    return Err(shape_err(format!(
                        "{perm:?} is not a permutation of the {} axes of {}",
                        dims.len(),
                        s(0)
                    )));
                }
                vec![(
                    t(0).dtype,
                    Shape(perm.iter().map(|&p| dims[p].clone()).collect()),
                )]
            }
            Op::Reshape { shape } => {
                arity("1", inputs.len() == 1)?;
                let from = t(0).shape.numel();
                let to = shape.numel();
                if from.is_none() || from != to {
                    return Err(shape_err(format!(
                        "cannot reshape {} to {}: the element counts differ",
                        s(0),
                        self.shape_str(shape)
                    )));
                }
                vec![(t(0).dtype, shape.clone())]
            }
            Op::Expand { shape } => {
                arity("1", inputs.len() == 1)?;
                if broadcast(&t(0).shape, shape).as_ref() != Some(shape) {
                    return Err(shape_err(format!(
                        "cannot expand {} to {}",
                        s(0),
                        self.shape_str(shape)
                    )));
                }
                vec![(t(0).dtype, shape.clone())]
            }
            Op::Slice { axis, start, len } => {
                arity("1", inputs.len() == 1)?;
                let dims = t(0).shape.dims();
                let d = dims.get(*axis).ok_or(IrError::Axis {
                    op: name,
                    axis: *axis as i64,
                    rank: dims.len(),
                })?;
                // A symbolic axis (e.g. `seq`) is sliced with fixed bounds that
                // the runtime checks once the symbol is bound.
                let size = d.as_const().unwrap_or(i64::MAX);
                if *start < 0 || *len <= 0 || start.saturating_add(*len) > size {
                    return Err(shape_err(format!(
                        "[{start}, {}) is outside axis {axis} of {}",
                        start + len,
                        s(0)
                    )));
                }
                let mut out = dims.to_vec();
                out[*axis] = Dim::konst(*len);
                vec![(t(0).dtype, Shape(out))]
            }
            Op::Concat { axis } => {
                arity("at least 1", !inputs.is_empty())?;
                let first = &t(0).shape;
                if *axis >= first.rank() {
                    return Err(IrError::Axis {
                        op: name,
                        axis: *axis as i64,
                        rank: first.rank(),
                    });
                }
                let mut total = first.dims()[*axis].clone();
                for i in 1..inputs.len() {
                    same_dtype(0, i)?;
                    let other = &t(i).shape;
                    let fits = other.rank() == first.rank()
                        && (0..first.rank()).all(|a| a == *axis || first.0[a] == other.0[a]);
                    total = match (fits, total.checked_add(&other.0[*axis])) {
                        (true, Some(sum)) => sum,
                        _ => {
                            return Err(shape_err(format!(
                                "{} and {} differ outside axis {axis}",
                                s(0),
                                s(i)
                            )))
                        }
                    };
                }
                let mut out = first.0.clone();
                out[*axis] = total;
                vec![(t(0).dtype, Shape(out))]
            }
            Op::Pad {
                axis,
                before,
                after,
                ..
            } => {
                arity("1", inputs.len() == 1)?;
                let dims = t(0).shape.dims();
                let d = dims.get(*axis).ok_or(IrError::Axis {
                    op: name,
                    axis: *axis as i64,
                    rank: dims.len(),
                })?;
                // A shift keeps the length, symbolic or not; any other pad
                // needs a number, since `seq + 2` is not a dimension.
                let len = if before.saturating_add(*after) == 0 {
                    let size = d.as_const().unwrap_or(i64::MAX);
                    if before.saturating_abs() >= size {
                        return Err(shape_err(format!(
                            "a shift by {before} leaves nothing of axis {axis} of {}",
                            s(0)
                        )));
                    }
                    d.clone()
                } else {
                    let n = d.as_const().ok_or_else(|| {
                        shape_err(format!(
                            "axis {axis} of {} is symbolic: only a shift (before = -after) \
                             keeps a symbolic length",
                            s(0)
                        ))
                    })?;
                    let len = n.saturating_add(*before).saturating_add(*after);
                    if len <= 0 || before.saturating_neg() >= n || after.saturating_neg() >= n {
                        return Err(shape_err(format!(
                            "padding axis {axis} of {} by {before} and {after} leaves nothing",
                            s(0)
                        )));
                    }
                    Dim::konst(len)
                };
                let mut out = dims.to_vec();
                out[*axis] = len;
                vec![(t(0).dtype, Shape(out))]
            }
            Op::Reduce { axis, keep_dim, .. } => {
                arity("1", inputs.len() == 1)?;
                float(0)?;
                let mut dims = t(0).shape.0.clone();
                if *axis >= dims.len() {
                    return Err(IrError::Axis {
                        op: name,
                        axis: *axis as i64,
                        rank: dims.len(),
                    });
                }
                if *keep_dim {
                    dims[*axis] = Dim::konst(1);
                } else {
                    dims.remove(*axis);
                }
                vec![(t(0).dtype, Shape(dims))]
            }
            // A float of the same shape, along one of its axes.
            Op::Softmax { axis } | Op::LogSoftmax { axis } | Op::CumSum { axis, .. } => {
                arity("1", inputs.len() == 1)?;
                float(0)?;
                if *axis >= t(0).shape.rank() {
                    return Err(IrError::Axis {
                        op: name,
                        axis: *axis as i64,
                        rank: t(0).shape.rank(),
                    });
                }
                vec![(t(0).dtype, t(0).shape.clone())]
            }
            Op::LayerNorm { .. } | Op::RmsNorm { .. } => {
                let n = if matches!(op, Op::LayerNorm { .. }) {
                    3
                } else {
                    2
                };
                arity(
                    if n == 3 {
                        "3 (x, weight, bias)"
                    } else {
                        "2 (x, weight)"
                    },
                    inputs.len() == n,
                )?;
                float(0)?;
                let last = t(0).shape.last().cloned().ok_or_else(|| {
                    shape_err("normalising a scalar: the input needs an axis".to_string())
                })?;
                for i in 1..n {
                    same_dtype(0, i)?;
                    if t(i).shape.dims() != [last.clone()] {
                        return Err(shape_err(format!(
                            "input {} is {}, it must be [{}] to match the last axis of {}",
                            i + 1,
                            s(i),
                            self.dim_str(&last),
                            s(0)
                        )));
                    }
                }
                vec![(t(0).dtype, t(0).shape.clone())]
            }
            Op::Dropout { p, .. } => {
                arity("1", inputs.len() == 1)?;
                float(0)?;
                if !(0.0..1.0).contains(p) {
                    return Err(IrError::Invalid {
                        op: name,
                        detail: format!("probability {p} is outside [0, 1)"),
                    });
                }
                vec![(t(0).dtype, t(0).shape.clone())]
            }
            Op::Select => {
                arity("3", inputs.len() == 3)?;
                float(0)?;
                same_dtype(1, 2)?;
                let shape = broadcast(&t(0).shape, &t(1).shape)
                    .and_then(|s| broadcast(&s, &t(2).shape))
                    .ok_or_else(|| {
                        shape_err(format!("{}, {} and {} do not broadcast", s(0), s(1), s(2)))
                    })?;
                vec![(t(1).dtype, shape)]
            }
            Op::CausalMask => {
                arity("1", inputs.len() == 1)?;
                float(0)?;
                let d = t(0).shape.dims();
                if d.len() < 2 || d[d.len() - 1] != d[d.len() - 2] {
                    return Err(shape_err(format!(
                        "{} must end in two equal axes (queries × keys)",
                        s(0)
                    )));
                }
                vec![(t(0).dtype, t(0).shape.clone())]
            }
            Op::Embedding => {
                arity("2 (table, indices)", inputs.len() == 2)?;
                float(0)?;
                int(1)?;
                let table = t(0).shape.dims();
                if table.len() != 2 {
                    return Err(shape_err(format!(
                        "the table {} must be [rows, width]",
                        s(0)
                    )));
                }
                let mut dims = t(1).shape.0.clone();
                dims.push(table[1].clone());
                vec![(t(0).dtype, Shape(dims))]
            }
            Op::TakeAlong => {
                arity("2 (x, indices)", inputs.len() == 2)?;
                float(0)?;
                int(1)?;
                let x = t(0).shape.dims();
                if x.is_empty() || x[..x.len() - 1] != *t(1).shape.dims() {
                    return Err(shape_err(format!(
                        "indices {} must match {} without its last axis",
                        s(1),
                        s(0)
                    )));
                }
                vec![(t(0).dtype, t(1).shape.clone())]
            }
            Op::TopK { k } => {
                arity("1", inputs.len() == 1)?;
                float(0)?;
                let mut dims = t(0).shape.0.clone();
                let n = dims.last().and_then(Dim::as_const).ok_or_else(|| {
                    shape_err(format!("top-k needs a fixed last axis, got {}", s(0)))
                })?;
                if *k < 1 || *k > n {
                    return Err(IrError::Invalid {
                        op: name,
                        detail: format!("k = {k} must be between 1 and the last axis ({n})"),
                    });
                }
                *dims.last_mut().expect("checked non-empty above") = Dim::konst(*k);
                vec![(t(0).dtype, Shape(dims.clone())), (DType::I32, Shape(dims))]
            }
            Op::MoeDispatch {
                experts,
                capacity_factor,
            } => {
                arity("2 (x, indices)", inputs.len() == 2)?;
                float(0)?;
                int(1)?;
                let (x, idx) = (t(0).shape.dims(), t(1).shape.dims());
                if x.len() != 2 || idx.len() != 2 || x[0] != idx[0] {
                    return Err(shape_err(format!(
                        "tokens {} and indices {} must be [t, d] and [t, k]",
                        s(0),
                        s(1)
                    )));
                }
                let k = idx[1]
                    .as_const()
                    .ok_or_else(|| shape_err("k must be fixed".into()))?;
                let capacity = Ratio::new(k as i128, *experts as i128)
                    .and_then(|r| r.checked_mul(*capacity_factor))
                    .and_then(|r| x[0].checked_scale(r))
                    .ok_or_else(|| IrError::Overflow(format!("capacity of {experts} experts")))?;
                vec![(
                    t(0).dtype,
                    Shape(vec![Dim::konst(*experts), capacity, x[1].clone()]),
                )]
            }
            Op::MoeCombine => {
                arity("3 (expert outputs, weights, indices)", inputs.len() == 3)?;
                float(0)?;
                float(1)?;
                int(2)?;
                let (y, w, idx) = (t(0).shape.dims(), t(1).shape.dims(), t(2).shape.dims());
                if y.len() != 3 || w.len() != 2 || w != idx {
                    return Err(shape_err(format!(
                        "expert outputs {}, weights {} and indices {} must be [e, c, d], [t, k], [t, k]",
                        s(0),
                        s(1),
                        s(2)
                    )));
                }
                vec![(t(0).dtype, Shape(vec![w[0].clone(), y[2].clone()]))]
            }
            // Its output shape is a rank's share, which only the layout
            // knows: `localize` builds these nodes whole.
            Op::Relayout { .. } | Op::VocabParallel(_) => {
                return Err(IrError::Invalid {
                    op: name,
                    detail: "a layout change or a vocabulary-parallel op exists only in a rank's local program".into(),
                })
            }
            Op::Repeat {
                count,
                body,
                carried,
            } => {
                let _ = count;
                let reg = self.region(*body);
                if reg.args.len() != inputs.len() || *carried > inputs.len() {
                    return Err(IrError::Invalid {
                        op: name,
                        detail: format!(
                            "the body takes {} arguments but the repeat passes {}",
                            reg.args.len(),
                            inputs.len()
                        ),
                    });
                }
                for (i, (&arg, &input)) in reg.args.iter().zip(inputs).enumerate() {
                    let (a, b) = (self.tensor(arg), self.tensor(input));
                    if a.dtype != b.dtype || a.shape != b.shape {
                        return Err(shape_err(format!(
                            "argument {} of the body is {}{} but {}{} is passed",
                            i + 1,
                            a.dtype,
                            self.shape_str(&a.shape),
                            b.dtype,
                            self.shape_str(&b.shape)
                        )));
                    }
                }
                if reg.results.len() != *carried {
                    return Err(IrError::Invalid {
                        op: name,
                        detail: format!(
                            "the body yields {} values but carries {carried}",
                            reg.results.len()
                        ),
                    });
                }
                let mut outs = Vec::new();
                for (i, &r) in reg.results.iter().enumerate() {
                    let (res, arg) = (self.tensor(r), self.tensor(reg.args[i]));
                    if res.dtype != arg.dtype || res.shape != arg.shape {
                        return Err(shape_err(format!(
                            "carried value {} enters as {}{} but leaves as {}{}",
                            i + 1,
                            arg.dtype,
                            self.shape_str(&arg.shape),
                            res.dtype,
                            self.shape_str(&res.shape)
                        )));
                    }
                    outs.push((res.dtype, res.shape.clone()));
                }
                outs
            }
        })
    }
}

/// Numpy broadcasting of two shapes, aligned at the last axis.
pub fn broadcast(a: &Shape, b: &Shape) -> Option<Shape> {
    let rank = a.rank().max(b.rank());
    let one = Dim::konst(1);
    let mut out = Vec::with_capacity(rank);
    for i in 0..rank {
        let da = (i + a.rank()).checked_sub(rank).map_or(&one, |j| &a.0[j]);
        let db = (i + b.rank()).checked_sub(rank).map_or(&one, |j| &b.0[j]);
        out.push(if da == db || db.is_one() {
            da.clone()
        } else if da.is_one() {
            db.clone()
        } else {
            return None;
        });
    }
    Some(Shape(out))
}
