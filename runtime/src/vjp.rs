//! Vector-Jacobian products for every primitive op, keyed by the forward `Op`:
//! given the forward inputs and outputs and the gradient of the outputs, the
//! gradient of each input that `dplc_ir::GradPlan` asks for.

use crate::error::{kernel_err, Result};
use crate::kernels::{
    self, batch_offsets, binary_f, gemm, moe_slots, norm_stats, zip_broadcast, Mat, OpCtx,
};
use crate::tensor::{reduce_to, split_axis, strides, Tensor, Walk};
use dplc_ir::{BinaryOp, Op, ReduceKind, UnaryOp};

/// d unary(x) / dx, from the input `x` and the output `y`.
fn unary_grad(u: UnaryOp, x: f32, y: f32) -> f32 {
    let xd = f64::from(x);
    match u {
        UnaryOp::Neg => -1.0,
        UnaryOp::Exp => y,
        UnaryOp::Log => 1.0 / x,
        UnaryOp::Sqrt => 0.5 / y,
        UnaryOp::Rsqrt => -0.5 * y * y * y,
        UnaryOp::Recip => -y * y,
        UnaryOp::Tanh => 1.0 - y * y,
        UnaryOp::Sigmoid => y * (1.0 - y),
        UnaryOp::Relu => {
            if x > 0.0 {
                1.0
            } else {
                0.0
            }
        }
        UnaryOp::Gelu => {
            let cdf = 0.5 * (1.0 + kernels::erf(xd / std::f64::consts::SQRT_2));
            let pdf = (-0.5 * xd * xd).exp() / (2.0 * std::f64::consts::PI).sqrt();
            (cdf + xd * pdf) as f32
        }
        UnaryOp::GeluTanh => kernels::gelu_tanh_grad(x),
        UnaryOp::Silu => {
            let s = 1.0 / (1.0 + (-x).exp());
            s * (1.0 + x * (1.0 - s))
        }
        UnaryOp::Sin => x.cos(),
        UnaryOp::Cos => -x.sin(),
        UnaryOp::Abs => {
            if x > 0.0 {
                1.0
            } else if x < 0.0 {
                -1.0
            } else {
                0.0
            }
        }
        UnaryOp::Floor => 0.0,
    }
}

/// The partial derivatives of `x ∘ y` with respect to x and y.
fn binary_grad(b: BinaryOp, x: f32, y: f32) -> (f32, f32) {
    match b {
        BinaryOp::Add => (1.0, 1.0),
        BinaryOp::Sub => (1.0, -1.0),
        BinaryOp::Mul => (y, x),
        BinaryOp::Div => (1.0 / y, -x / (y * y)),
        // Ties send the gradient to the first operand, as the forward picks it.
        BinaryOp::Max => {
            if x >= y {
                (1.0, 0.0)
            } else {
                (0.0, 1.0)
            }
        }
        BinaryOp::Min => {
            if x <= y {
                (1.0, 0.0)
            } else {
                (0.0, 1.0)
            }
        }
        BinaryOp::Pow => {
            let p = binary_f(b, x, y);
            let dy = if x > 0.0 { p * x.ln() } else { 0.0 };
            (y * x.powf(y - 1.0), dy)
        }
        BinaryOp::Lt | BinaryOp::Le | BinaryOp::Gt | BinaryOp::Ge | BinaryOp::Eq | BinaryOp::Ne => {
            (0.0, 0.0)
        }
    }
}

fn f(shape: &[usize], v: Vec<f32>) -> Option<Tensor> {
    Some(Tensor::f32(shape.to_vec(), v))
}

/// The gradients of `op`'s inputs (`None` where not needed or not defined).
pub fn backward(
    op: &Op,
    ins: &[&Tensor],
    outs: &[&Tensor],
    gout: &Tensor,
    need: &[bool],
    ctx: &OpCtx,
) -> Result<Vec<Option<Tensor>>> {
    let g = gout.f()?;
    let x = ins[0];
    let mut grads: Vec<Option<Tensor>> = vec![None; ins.len()];
    match op {
        Op::Input(_) | Op::Param(_) | Op::Constant(_) | Op::Iota { .. } | Op::Repeat { .. } => {}
        // A collective over the rank's group: the executor runs it both ways.
        Op::Relayout { .. } | Op::VocabParallel(_) => {
            return Err(kernel_err(
                "backward",
                "a layout change is not a kernel; the executor runs it over its group",
            ))
        }
        Op::Unary(u) => {
            let (xs, ys) = (x.f()?, outs[0].f()?);
            // One loop per op, so that the common ones vectorise.
            fn each(g: &[f32], xs: &[f32], ys: &[f32], d: impl Fn(f32, f32) -> f32) -> Vec<f32> {
                g.iter()
                    .zip(xs.iter().zip(ys))
                    .map(|(&g, (&x, &y))| g * d(x, y))
                    .collect()
            }
            let v = match u {
                UnaryOp::GeluTanh => each(g, xs, ys, |x, _| kernels::gelu_tanh_grad(x)),
                UnaryOp::Neg => each(g, xs, ys, |_, _| -1.0),
                UnaryOp::Exp => each(g, xs, ys, |_, y| y),
                u => each(g, xs, ys, |x, y| unary_grad(*u, x, y)),
            };
            grads[0] = f(&x.shape, v);
        }
        Op::Binary(b) => {
            let shape = &gout.shape;
            let (xa, ya) = ((x.f()?, &x.shape[..]), (ins[1].f()?, &ins[1].shape[..]));
            // g · ∂(x ∘ y)/∂x (or ∂y) over the whole output, then summed down to
            // the operand's shape; an add passes the gradient through as it is.
            let part = |which: usize| -> Vec<f32> {
                let gs = (g, &shape[..]);
                let pick = move |(dx, dy): (f32, f32)| if which == 0 { dx } else { dy };
                match b {
                    BinaryOp::Add => g.to_vec(),
                    BinaryOp::Sub if which == 0 => g.to_vec(),
                    BinaryOp::Mul => {
                        let other = if which == 0 { ya } else { xa };
                        zip_broadcast(gs, other, shape, |g, o| g * o)
                    }
                    b => {
                        let d = zip_broadcast(xa, ya, shape, |p, q| pick(binary_grad(*b, p, q)));
                        d.iter().zip(g).map(|(&d, &g)| g * d).collect()
                    }
                }
            };
            if need[0] {
                grads[0] = f(&x.shape, reduce_to(&part(0), shape, &x.shape));
            }
            if need[1] {
                grads[1] = f(&ins[1].shape, reduce_to(&part(1), shape, &ins[1].shape));
            }
        }
        Op::Cast(_) => grads[0] = x.is_float().then(|| gout.clone().reshaped(x.shape.clone())),
        Op::MatMul => {
            let (a, b) = (x, ins[1]);
            let (ad, bd) = (a.f()?, b.f()?);
            let (ra, rb) = (a.shape.len(), b.shape.len());
            let (m, k, n) = (a.shape[ra - 2], a.shape[ra - 1], b.shape[rb - 1]);
            let out_batch = &gout.shape[..gout.shape.len() - 2];
            let (ao, bo) = (
                batch_offsets(&a.shape, out_batch),
                batch_offsets(&b.shape, out_batch),
            );
            if need[0] {
                // dA = G · Bᵀ, summed over the batch entries that broadcast A.
                let mut da = vec![0.0f32; ad.len()];
                for (i, (&oa, &ob)) in ao.iter().zip(&bo).enumerate() {
                    let gm = Mat {
                        data: g,
                        offset: i * m * n,
                        rs: n,
                        cs: 1,
                    };
                    let bt = Mat {
                        data: bd,
                        offset: ob,
                        rs: 1,
                        cs: n,
                    };
                    gemm(m, n, k, gm, bt, &mut da, oa, 1.0);
                }
                grads[0] = f(&a.shape, da);
            }
            if need[1] {
                // dB = Aᵀ · G, summed over the batch entries that broadcast B.
                let mut db = vec![0.0f32; bd.len()];
                for (i, (&oa, &ob)) in ao.iter().zip(&bo).enumerate() {
                    let at = Mat {
                        data: ad,
                        offset: oa,
                        rs: 1,
                        cs: k,
                    };
                    let gm = Mat {
                        data: g,
                        offset: i * m * n,
                        rs: n,
                        cs: 1,
                    };
                    gemm(k, m, n, at, gm, &mut db, ob, 1.0);
                }
                grads[1] = f(&b.shape, db);
            }
        }
        Op::Transpose { perm } => {
            let mut inv = vec![0; perm.len()];
            for (i, &p) in perm.iter().enumerate() {
                inv[p] = i;
            }
            grads[0] = Some(kernels::transpose(gout, &inv));
        }
        Op::Reshape { .. } => grads[0] = Some(gout.clone().reshaped(x.shape.clone())),
        Op::Expand { .. } => grads[0] = f(&x.shape, reduce_to(g, &gout.shape, &x.shape)),
        Op::Slice { axis, start, .. } => {
            let mut dx = vec![0.0f32; x.numel()];
            let s = strides(&x.shape);
            let walk = Walk::new(&gout.shape, [&strides(&gout.shape), &s]);
            let (len, [_, step]) = walk.run();
            walk.for_each([0, *start as usize * s[*axis]], |[o, d]| {
                (0..len).for_each(|j| dx[d + j * step] = g[o + j]);
            });
            grads[0] = f(&x.shape, dx);
        }
        Op::Concat { axis } => {
            let (outer, total, inner) = split_axis(&gout.shape, *axis);
            let mut at = 0;
            for (i, t) in ins.iter().enumerate() {
                let len = t.shape[*axis];
                if need[i] {
                    let mut v = Vec::with_capacity(t.numel());
                    for o in 0..outer {
                        v.extend_from_slice(&g[(o * total + at) * inner..][..len * inner]);
                    }
                    grads[i] = f(&t.shape, v);
                }
                at += len;
            }
        }
        // What was padded is dropped and what was dropped gets zeros: the
        // opposite pad (a shift's gradient shifts back).
        Op::Pad {
            axis,
            before,
            after,
            ..
        } => grads[0] = Some(kernels::pad(gout, *axis, -before, -after, 0.0)?),
        // Each input adds to every running sum from its place on.
        Op::CumSum { axis, reverse } => grads[0] = Some(kernels::cumsum(gout, *axis, !reverse)?),
        Op::Reduce { kind, axis, .. } => {
            let (outer, n, inner) = split_axis(&x.shape, *axis);
            let mut dx = vec![0.0f32; x.numel()];
            let xs = x.f()?;
            for o in 0..outer {
                for i in 0..inner {
                    let gv = g[o * inner + i];
                    let idx = |j: usize| (o * n + j) * inner + i;
                    match kind {
                        ReduceKind::Sum => (0..n).for_each(|j| dx[idx(j)] = gv),
                        ReduceKind::Mean => (0..n).for_each(|j| dx[idx(j)] = gv / n as f32),
                        ReduceKind::Max => {
                            // The first maximum takes the gradient, as one kernel would pick it.
                            let best = (0..n)
                                .max_by(|&a, &b| xs[idx(a)].total_cmp(&xs[idx(b)]).then(b.cmp(&a)))
                                .expect("reduced axes are not empty");
                            dx[idx(best)] = gv;
                        }
                    }
                }
            }
            grads[0] = f(&x.shape, dx);
        }
        Op::Softmax { axis } | Op::LogSoftmax { axis } => {
            let log = matches!(op, Op::LogSoftmax { .. });
            // A log-softmax keeps its input (`dplc_ir::saved_values`): its
            // output is computed again, bit for bit the forward's.
            let again;
            let ys = if log {
                again = kernels::softmax(x, *axis, true)?;
                again.f()?
            } else {
                outs[0].f()?
            };
            let (outer, n, inner) = split_axis(&x.shape, *axis);
            let mut dx = vec![0.0f32; x.numel()];
            for o in 0..outer {
                for i in 0..inner {
                    let idx = |j: usize| (o * n + j) * inner + i;
                    if log {
                        let sum: f32 = (0..n).map(|j| g[idx(j)]).sum();
                        (0..n).for_each(|j| dx[idx(j)] = g[idx(j)] - ys[idx(j)].exp() * sum);
                    } else {
                        let dot: f32 = (0..n).map(|j| g[idx(j)] * ys[idx(j)]).sum();
                        (0..n).for_each(|j| dx[idx(j)] = ys[idx(j)] * (g[idx(j)] - dot));
                    }
                }
            }
            grads[0] = f(&x.shape, dx);
        }
        Op::LayerNorm { eps } | Op::RmsNorm { eps } => {
            let centre = matches!(op, Op::LayerNorm { .. });
            let (xs, ws) = (x.f()?, ins[1].f()?);
            let d = ws.len();
            let stats = norm_stats(xs, d, *eps, centre);
            let (mut dx, mut dw, mut db) =
                (vec![0.0f32; xs.len()], vec![0.0f32; d], vec![0.0f32; d]);
            for (r, &(mean, rstd)) in stats.iter().enumerate() {
                let row = &xs[r * d..][..d];
                let gr = &g[r * d..][..d];
                let xhat: Vec<f32> = row.iter().map(|&v| (v - mean) * rstd).collect();
                let dxhat: Vec<f32> = gr.iter().zip(ws).map(|(&g, &w)| g * w).collect();
                let mean_d = if centre {
                    dxhat.iter().sum::<f32>() / d as f32
                } else {
                    0.0
                };
                let mean_dx = dxhat.iter().zip(&xhat).map(|(a, b)| a * b).sum::<f32>() / d as f32;
                for j in 0..d {
                    dx[r * d + j] = rstd * (dxhat[j] - mean_d - xhat[j] * mean_dx);
                    dw[j] += gr[j] * xhat[j];
                    db[j] += gr[j];
                }
            }
            grads[0] = f(&x.shape, dx);
            grads[1] = f(&ins[1].shape, dw);
            if centre {
                grads[2] = f(&ins[2].shape, db);
            }
        }
        Op::Dropout { p, context, split } => {
            if *p == 0.0 {
                grads[0] = Some(gout.clone());
            } else {
                let keep = ctx
                    .dropout
                    .mask(*p, &gout.shape, *context, split.or(ctx.split));
                let scale = (1.0 / (1.0 - p)) as f32;
                let v = g
                    .iter()
                    .zip(keep)
                    .map(|(&g, k)| if k { g * scale } else { 0.0 })
                    .collect();
                grads[0] = f(&x.shape, v);
            }
        }
        Op::Select => {
            let shape = &gout.shape;
            let c = kernels::expand_to(ins[0], shape)?;
            for (i, taken) in [(1, true), (2, false)] {
                if need[i] {
                    let v: Vec<f32> = c
                        .iter()
                        .zip(g)
                        .map(|(&c, &g)| if (c != 0.0) == taken { g } else { 0.0 })
                        .collect();
                    grads[i] = f(&ins[i].shape, reduce_to(&v, shape, &ins[i].shape));
                }
            }
        }
        Op::CausalMask => {
            let r = x.shape.len();
            let (q, k) = (x.shape[r - 2], x.shape[r - 1]);
            let v = g
                .iter()
                .enumerate()
                .map(|(i, &g)| if i % k > (i / k) % q { 0.0 } else { g })
                .collect();
            grads[0] = f(&x.shape, v);
        }
        Op::Embedding => {
            let idx = ins[1].i()?;
            let (n, d) = (x.shape[0], x.shape[1]);
            let mut dt = vec![0.0f32; n * d];
            for (r, &i) in idx.iter().enumerate() {
                let row = kernels::check_index("embedding", i, n)?;
                for (t, &v) in dt[row * d..][..d].iter_mut().zip(&g[r * d..][..d]) {
                    *t += v;
                }
            }
            grads[0] = f(&x.shape, dt);
        }
        Op::TakeAlong => {
            let idx = ins[1].i()?;
            let n = *x.shape.last().expect("take_along input has an axis");
            let mut dx = vec![0.0f32; x.numel()];
            for (r, (&i, &gv)) in idx.iter().zip(g).enumerate() {
                dx[r * n + kernels::check_index("take_along", i, n)?] += gv;
            }
            grads[0] = f(&x.shape, dx);
        }
        Op::TopK { k } => {
            let idx = outs[1].i()?;
            let n = *x.shape.last().expect("top-k input has an axis");
            let k = *k as usize;
            let mut dx = vec![0.0f32; x.numel()];
            for (j, (&i, &gv)) in idx.iter().zip(g).enumerate() {
                dx[(j / k) * n + i as usize] += gv;
            }
            grads[0] = f(&x.shape, dx);
        }
        Op::MoeDispatch { .. } => {
            let idx = ins[1].i()?;
            let (experts, capacity, d) = (gout.shape[0], gout.shape[1], gout.shape[2]);
            let k = ins[1].shape[1];
            let mut dx = vec![0.0f32; x.numel()];
            for (j, slot) in moe_slots(idx, experts, capacity)?.into_iter().enumerate() {
                if let Some((e, c)) = slot {
                    for (o, &v) in dx[(j / k) * d..][..d]
                        .iter_mut()
                        .zip(&g[(e * capacity + c) * d..][..d])
                    {
                        *o += v;
                    }
                }
            }
            grads[0] = f(&x.shape, dx);
        }
        Op::MoeCombine => {
            let (y, w, idx) = (x.f()?, ins[1].f()?, ins[2].i()?);
            let (experts, capacity, d) = (x.shape[0], x.shape[1], x.shape[2]);
            let k = ins[1].shape[1];
            let (mut dy, mut dw) = (vec![0.0f32; y.len()], vec![0.0f32; w.len()]);
            for (j, slot) in moe_slots(idx, experts, capacity)?.into_iter().enumerate() {
                if let Some((e, c)) = slot {
                    let at = (e * capacity + c) * d;
                    let gr = &g[(j / k) * d..][..d];
                    let mut dot = 0.0f32;
                    for ((o, &gv), &yv) in dy[at..at + d].iter_mut().zip(gr).zip(&y[at..at + d]) {
                        *o += w[j] * gv;
                        dot += gv * yv;
                    }
                    dw[j] = dot;
                }
            }
            grads[0] = f(&x.shape, dy);
            grads[1] = f(&ins[1].shape, dw);
        }
    }
    if grads.iter().zip(need).any(|(g, &n)| n && g.is_none()) && !matches!(op, Op::Cast(_)) {
        return Err(kernel_err(
            "backward",
            format!("{} gave no gradient for a needed input", op.name()),
        ));
    }
    Ok(grads
        .into_iter()
        .zip(need)
        .map(|(g, &n)| if n { g } else { None })
        .collect())
}
