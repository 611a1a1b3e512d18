//! Forward f32 kernels for every primitive op of the IR, on dense row-major
//! tensors. Matmuls go through `matrixmultiply`'s packed sgemm.

use crate::error::{kernel_err, Result};
use crate::rng;
use crate::tensor::{
    broadcast_data, broadcast_shape, broadcast_strides, gather, split_axis, strided_offsets,
    strides, Data, Tensor,
};
use dplc_ir::{BinaryOp, DType, Op, ReduceKind, UnaryOp};

/// Where a dropout mask comes from: the element's key is this plus its sample
/// and position, so the mask is the same however the batch is split.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DropoutKey {
    pub seed: u64,
    pub step: u64,
    pub node: u64,
    /// Flat repeat iteration (0 outside a repeat).
    pub layer: u64,
    /// Global index of this micro-batch's first sample.
    pub first_sample: u64,
    /// Samples in this micro-batch.
    pub batch: usize,
}

impl DropoutKey {
    /// Keep (true) or drop each of `n` elements. Elements are laid out sample
    /// after sample when `n` divides by the batch (the batch axis is outermost);
    /// otherwise the tensor does not depend on the sample and all share one key.
    pub fn mask(&self, p: f64, n: usize) -> Vec<bool> {
        let per_sample = if self.batch > 0 && n.is_multiple_of(self.batch) {
            n / self.batch
        } else {
            n
        };
        (0..n)
            .map(|i| {
                let (sample, pos) = if per_sample == n && self.batch != 1 {
                    (u64::MAX, i as u64)
                } else {
                    (
                        self.first_sample + (i / per_sample) as u64,
                        (i % per_sample) as u64,
                    )
                };
                let u = rng::uniform(&[self.seed, self.step, self.node, self.layer, sample, pos]);
                f64::from(u) >= p
            })
            .collect()
    }
}

/// What a kernel needs besides its inputs.
pub struct OpCtx<'a> {
    /// The output shapes, with symbolic dims bound.
    pub out_shapes: &'a [Vec<usize>],
    pub dropout: DropoutKey,
}

// ---- matmul ---------------------------------------------------------------

/// A matrix view into a slice: `rows × cols` with row and column strides.
#[derive(Clone, Copy)]
pub(crate) struct Mat<'a> {
    pub data: &'a [f32],
    pub offset: usize,
    pub rs: usize,
    pub cs: usize,
}

/// `c[off..] = a(m×k) · b(k×n) + beta · c`, c row-major with row stride n.
#[allow(clippy::too_many_arguments)]
pub(crate) fn gemm(
    m: usize,
    k: usize,
    n: usize,
    a: Mat,
    b: Mat,
    c: &mut [f32],
    c_off: usize,
    beta: f32,
) {
    if m == 0 || n == 0 {
        return;
    }
    let last = |x: Mat, r: usize, cc: usize| x.offset + (r - 1) * x.rs + (cc - 1) * x.cs;
    if k == 0 {
        for v in &mut c[c_off..c_off + m * n] {
            *v *= beta;
        }
        return;
    }
    // The bounds sgemm will touch, checked so that the raw-pointer call below is sound.
    assert!(last(a, m, k) < a.data.len(), "gemm: a is too short");
    assert!(last(b, k, n) < b.data.len(), "gemm: b is too short");
    assert!(c_off + m * n <= c.len(), "gemm: c is too short");
    // SAFETY: the asserts above show that every element sgemm reads from `a`
    // and `b` (offset + i·rs + j·cs for i < rows, j < cols) and every element it
    // writes in `c` (c_off + i·n + j) lies inside the slices; `c` is borrowed
    // mutably, so it cannot alias `a` or `b`.
    unsafe {
        matrixmultiply::sgemm(
            m,
            k,
            n,
            1.0,
            a.data.as_ptr().add(a.offset),
            a.rs as isize,
            a.cs as isize,
            b.data.as_ptr().add(b.offset),
            b.rs as isize,
            b.cs as isize,
            beta,
            c.as_mut_ptr().add(c_off),
            n as isize,
            1,
        );
    }
}

/// Batch offsets of a matmul operand read under the output's batch shape.
pub(crate) fn batch_offsets(shape: &[usize], out_batch: &[usize]) -> Vec<usize> {
    let r = shape.len();
    let mat = shape[r - 2] * shape[r - 1];
    let batch = &shape[..r - 2];
    let s = broadcast_strides(batch, out_batch);
    strided_offsets(out_batch, &s, 0)
        .into_iter()
        .map(|o| o * mat)
        .collect()
}

fn matmul(a: &Tensor, b: &Tensor, out_shape: &[usize]) -> Result<Tensor> {
    let (ad, bd) = (a.f()?, b.f()?);
    let (ra, rb) = (a.shape.len(), b.shape.len());
    let (m, k, n) = (a.shape[ra - 2], a.shape[ra - 1], b.shape[rb - 1]);
    let out_batch = &out_shape[..out_shape.len() - 2];
    let mut c = vec![0.0f32; out_shape.iter().product()];
    let (ao, bo) = (
        batch_offsets(&a.shape, out_batch),
        batch_offsets(&b.shape, out_batch),
    );
    for (i, (&oa, &ob)) in ao.iter().zip(&bo).enumerate() {
        gemm(
            m,
            k,
            n,
            Mat {
                data: ad,
                offset: oa,
                rs: k,
                cs: 1,
            },
            Mat {
                data: bd,
                offset: ob,
                rs: n,
                cs: 1,
            },
            &mut c,
            i * m * n,
            0.0,
        );
    }
    Ok(Tensor::f32(out_shape.to_vec(), c))
}

// ---- elementwise ----------------------------------------------------------

/// erf to about 1e-7 (W. J. Cody's rational approximations via erfc), in f64.
pub(crate) fn erf(x: f64) -> f64 {
    // Numerical Recipes' erfc Chebyshev fit, fractional error below 1.2e-7.
    let z = x.abs();
    let t = 1.0 / (1.0 + 0.5 * z);
    let r = t
        * (-z * z - 1.265_512_23
            + t * (1.000_023_68
                + t * (0.374_091_96
                    + t * (0.096_784_18
                        + t * (-0.186_288_06
                            + t * (0.278_868_07
                                + t * (-1.135_203_98
                                    + t * (1.488_515_87
                                        + t * (-0.822_152_23 + t * 0.170_872_77)))))))))
            .exp();
    if x >= 0.0 {
        1.0 - r
    } else {
        r - 1.0
    }
}

const SQRT_2_OVER_PI: f64 = 0.797_884_560_802_865_4;

pub(crate) fn unary(u: UnaryOp, x: f32) -> f32 {
    let xd = f64::from(x);
    match u {
        UnaryOp::Neg => -x,
        UnaryOp::Exp => x.exp(),
        UnaryOp::Log => x.ln(),
        UnaryOp::Sqrt => x.sqrt(),
        UnaryOp::Rsqrt => 1.0 / x.sqrt(),
        UnaryOp::Recip => 1.0 / x,
        UnaryOp::Tanh => x.tanh(),
        UnaryOp::Sigmoid => 1.0 / (1.0 + (-x).exp()),
        UnaryOp::Relu => x.max(0.0),
        UnaryOp::Gelu => (0.5 * xd * (1.0 + erf(xd / std::f64::consts::SQRT_2))) as f32,
        UnaryOp::GeluTanh => {
            (0.5 * xd * (1.0 + (SQRT_2_OVER_PI * (xd + 0.044715 * xd * xd * xd)).tanh())) as f32
        }
        UnaryOp::Silu => x / (1.0 + (-x).exp()),
        UnaryOp::Sin => x.sin(),
        UnaryOp::Cos => x.cos(),
    }
}

pub(crate) fn binary_f(b: BinaryOp, x: f32, y: f32) -> f32 {
    match b {
        BinaryOp::Add => x + y,
        BinaryOp::Sub => x - y,
        BinaryOp::Mul => x * y,
        BinaryOp::Div => x / y,
        BinaryOp::Max => x.max(y),
        BinaryOp::Min => x.min(y),
        BinaryOp::Pow => x.powf(y),
    }
}

fn binary(b: BinaryOp, x: &Tensor, y: &Tensor) -> Result<Tensor> {
    let shape = broadcast_shape(&x.shape, &y.shape)
        .ok_or_else(|| kernel_err("binary", "operands do not broadcast"))?;
    Ok(match (&x.data, &y.data) {
        (Data::F32(xs), Data::F32(ys)) => {
            let xs = broadcast_data(xs, &x.shape, &shape);
            let ys = broadcast_data(ys, &y.shape, &shape);
            let v = xs
                .iter()
                .zip(&ys)
                .map(|(&p, &q)| binary_f(b, p, q))
                .collect();
            Tensor::f32(shape, v)
        }
        (Data::I32(xs), Data::I32(ys)) => {
            let xs = broadcast_data(xs, &x.shape, &shape);
            let ys = broadcast_data(ys, &y.shape, &shape);
            let f = |p: i32, q: i32| match b {
                BinaryOp::Add => Ok(p.wrapping_add(q)),
                BinaryOp::Sub => Ok(p.wrapping_sub(q)),
                BinaryOp::Mul => Ok(p.wrapping_mul(q)),
                BinaryOp::Max => Ok(p.max(q)),
                BinaryOp::Min => Ok(p.min(q)),
                _ => Err(kernel_err("binary", format!("{} on i32", b.name()))),
            };
            let v = xs
                .iter()
                .zip(&ys)
                .map(|(&p, &q)| f(p, q))
                .collect::<Result<_>>()?;
            Tensor::i32(shape, v)
        }
        _ => return Err(kernel_err("binary", "operands of different element types")),
    })
}

// ---- layout ---------------------------------------------------------------

fn map_data(t: &Tensor, shape: Vec<usize>, offsets: &[usize]) -> Tensor {
    let data = match &t.data {
        Data::F32(v) => Data::F32(gather(v, offsets)),
        Data::I32(v) => Data::I32(gather(v, offsets)),
    };
    Tensor { shape, data }
}

pub(crate) fn transpose(t: &Tensor, perm: &[usize]) -> Tensor {
    let s = strides(&t.shape);
    let shape: Vec<usize> = perm.iter().map(|&p| t.shape[p]).collect();
    let ps: Vec<usize> = perm.iter().map(|&p| s[p]).collect();
    let offs = strided_offsets(&shape, &ps, 0);
    map_data(t, shape, &offs)
}

fn slice(t: &Tensor, axis: usize, start: usize, len: usize) -> Tensor {
    let s = strides(&t.shape);
    let mut shape = t.shape.clone();
    shape[axis] = len;
    let offs = strided_offsets(&shape, &s, start * s[axis]);
    map_data(t, shape, &offs)
}

fn concat(ins: &[&Tensor], axis: usize, out_shape: &[usize]) -> Result<Tensor> {
    let (outer, _, inner) = split_axis(out_shape, axis);
    macro_rules! join {
        ($variant:ident, $get:ident) => {{
            let mut out = Vec::with_capacity(out_shape.iter().product());
            let parts = ins.iter().map(|t| t.$get()).collect::<Result<Vec<_>>>()?;
            for o in 0..outer {
                for (t, p) in ins.iter().zip(&parts) {
                    let chunk = t.shape[axis] * inner;
                    out.extend_from_slice(&p[o * chunk..(o + 1) * chunk]);
                }
            }
            Tensor {
                shape: out_shape.to_vec(),
                data: Data::$variant(out),
            }
        }};
    }
    Ok(if ins[0].is_float() {
        join!(F32, f)
    } else {
        join!(I32, i)
    })
}

fn expand(t: &Tensor, shape: &[usize]) -> Tensor {
    let offs = strided_offsets(shape, &broadcast_strides(&t.shape, shape), 0);
    map_data(t, shape.to_vec(), &offs)
}

// ---- reductions and normalisations -----------------------------------------

fn reduce(kind: ReduceKind, x: &Tensor, axis: usize, out_shape: &[usize]) -> Result<Tensor> {
    let xs = x.f()?;
    let (outer, n, inner) = split_axis(&x.shape, axis);
    let mut out = vec![0.0f32; outer * inner];
    for o in 0..outer {
        for i in 0..inner {
            let at = |j: usize| xs[(o * n + j) * inner + i];
            out[o * inner + i] = match kind {
                ReduceKind::Sum => (0..n).map(at).sum(),
                ReduceKind::Mean => (0..n).map(at).sum::<f32>() / n as f32,
                ReduceKind::Max => (0..n).map(at).fold(f32::NEG_INFINITY, f32::max),
            };
        }
    }
    Ok(Tensor::f32(out_shape.to_vec(), out))
}

fn softmax(x: &Tensor, axis: usize, log: bool) -> Result<Tensor> {
    let xs = x.f()?;
    let (outer, n, inner) = split_axis(&x.shape, axis);
    let mut out = vec![0.0f32; xs.len()];
    for o in 0..outer {
        for i in 0..inner {
            let idx = |j: usize| (o * n + j) * inner + i;
            let max = (0..n).map(|j| xs[idx(j)]).fold(f32::NEG_INFINITY, f32::max);
            let sum: f32 = (0..n).map(|j| (xs[idx(j)] - max).exp()).sum();
            for j in 0..n {
                let z = xs[idx(j)] - max;
                out[idx(j)] = if log { z - sum.ln() } else { z.exp() / sum };
            }
        }
    }
    Ok(Tensor::f32(x.shape.clone(), out))
}

/// Per-row mean (zero for RMSNorm) and reciprocal standard deviation over the last axis.
pub(crate) fn norm_stats(xs: &[f32], d: usize, eps: f64, centre: bool) -> Vec<(f32, f32)> {
    xs.chunks(d)
        .map(|row| {
            let mean = if centre {
                row.iter().map(|&v| f64::from(v)).sum::<f64>() / d as f64
            } else {
                0.0
            };
            let var = row
                .iter()
                .map(|&v| (f64::from(v) - mean).powi(2))
                .sum::<f64>()
                / d as f64;
            (mean as f32, (1.0 / (var + eps).sqrt()) as f32)
        })
        .collect()
}

fn norm(x: &Tensor, w: &Tensor, b: Option<&Tensor>, eps: f64) -> Result<Tensor> {
    let (xs, ws) = (x.f()?, w.f()?);
    let bs = b.map(|b| b.f()).transpose()?;
    let d = ws.len();
    let stats = norm_stats(xs, d, eps, b.is_some());
    let mut out = Vec::with_capacity(xs.len());
    for (row, &(mean, rstd)) in xs.chunks(d).zip(&stats) {
        for j in 0..d {
            let v = (row[j] - mean) * rstd * ws[j];
            out.push(bs.map_or(v, |bs| v + bs[j]));
        }
    }
    Ok(Tensor::f32(x.shape.clone(), out))
}

// ---- indexing ---------------------------------------------------------------

pub(crate) fn check_index(op: &'static str, i: i32, n: usize) -> Result<usize> {
    usize::try_from(i)
        .ok()
        .filter(|&u| u < n)
        .ok_or_else(|| kernel_err(op, format!("index {i} is outside [0, {n})")))
}

/// The slot of each (token, choice) in its expert's buffer, in token order;
/// `None` when the expert is full and the token is dropped. Dispatch and
/// combine both derive it from the indices, so it need not be stored.
pub(crate) fn moe_slots(
    idx: &[i32],
    experts: usize,
    capacity: usize,
) -> Result<Vec<Option<(usize, usize)>>> {
    let mut fill = vec![0usize; experts];
    idx.iter()
        .map(|&e| {
            let e = check_index("moe", e, experts)?;
            let slot = fill[e];
            fill[e] += 1;
            Ok((slot < capacity).then_some((e, slot)))
        })
        .collect()
}

/// Run one forward op on its inputs.
pub fn forward(op: &Op, ins: &[&Tensor], ctx: &OpCtx) -> Result<Vec<Tensor>> {
    let out0 = || ctx.out_shapes[0].clone();
    let one = |t: Tensor| Ok(vec![t]);
    match op {
        Op::Input(_) | Op::Param(_) | Op::Repeat { .. } => Err(kernel_err(
            "forward",
            format!("{} is not a kernel; the executor supplies it", op.name()),
        )),
        Op::Constant(c) => one(Tensor::f32(vec![], vec![*c as f32])),
        Op::Iota { .. } => {
            let n = ctx.out_shapes[0][0];
            one(Tensor::i32(vec![n], (0..n as i32).collect()))
        }
        Op::Unary(u) => one(Tensor::f32(
            ins[0].shape.clone(),
            ins[0].f()?.iter().map(|&x| unary(*u, x)).collect(),
        )),
        Op::Binary(b) => one(binary(*b, ins[0], ins[1])?),
        Op::Cast(to) => one(match (&ins[0].data, *to) {
            (Data::F32(v), DType::I32) => {
                Tensor::i32(ins[0].shape.clone(), v.iter().map(|&x| x as i32).collect())
            }
            (Data::I32(v), DType::F32 | DType::BF16 | DType::F16) => {
                Tensor::f32(ins[0].shape.clone(), v.iter().map(|&x| x as f32).collect())
            }
            _ => ins[0].clone(),
        }),
        Op::MatMul => one(matmul(ins[0], ins[1], &ctx.out_shapes[0])?),
        Op::Transpose { perm } => one(transpose(ins[0], perm)),
        Op::Reshape { .. } => one(ins[0].clone().reshaped(out0())),
        Op::Expand { .. } => one(expand(ins[0], &ctx.out_shapes[0])),
        Op::Slice { axis, start, len } => one(slice(ins[0], *axis, *start as usize, *len as usize)),
        Op::Concat { axis } => one(concat(ins, *axis, &ctx.out_shapes[0])?),
        Op::Reduce { kind, axis, .. } => one(reduce(*kind, ins[0], *axis, &ctx.out_shapes[0])?),
        Op::Softmax { axis } => one(softmax(ins[0], *axis, false)?),
        Op::LogSoftmax { axis } => one(softmax(ins[0], *axis, true)?),
        Op::LayerNorm { eps } => one(norm(ins[0], ins[1], Some(ins[2]), *eps)?),
        Op::RmsNorm { eps } => one(norm(ins[0], ins[1], None, *eps)?),
        Op::Dropout { p } => {
            let xs = ins[0].f()?;
            if *p == 0.0 {
                return one(ins[0].clone());
            }
            let keep = ctx.dropout.mask(*p, xs.len());
            let scale = (1.0 / (1.0 - p)) as f32;
            one(Tensor::f32(
                ins[0].shape.clone(),
                xs.iter()
                    .zip(keep)
                    .map(|(&x, k)| if k { x * scale } else { 0.0 })
                    .collect(),
            ))
        }
        Op::CausalMask => {
            let r = ins[0].shape.len();
            let (q, k) = (ins[0].shape[r - 2], ins[0].shape[r - 1]);
            let mut v = ins[0].f()?.to_vec();
            for (i, x) in v.iter_mut().enumerate() {
                if i % k > (i / k) % q {
                    *x = f32::NEG_INFINITY;
                }
            }
            one(Tensor::f32(ins[0].shape.clone(), v))
        }
        Op::Embedding => {
            let (table, idx) = (ins[0].f()?, ins[1].i()?);
            let (n, d) = (ins[0].shape[0], ins[0].shape[1]);
            let mut out = Vec::with_capacity(idx.len() * d);
            for &i in idx {
                let r = check_index("embedding", i, n)?;
                out.extend_from_slice(&table[r * d..(r + 1) * d]);
            }
            one(Tensor::f32(out0(), out))
        }
        Op::TakeAlong => {
            let (x, idx) = (ins[0].f()?, ins[1].i()?);
            let n = *ins[0].shape.last().expect("take_along input has an axis");
            let out = idx
                .iter()
                .enumerate()
                .map(|(r, &i)| Ok(x[r * n + check_index("take_along", i, n)?]))
                .collect::<Result<_>>()?;
            one(Tensor::f32(out0(), out))
        }
        Op::TopK { k } => {
            let x = ins[0].f()?;
            let n = *ins[0].shape.last().expect("top-k input has an axis");
            let k = *k as usize;
            let (mut vals, mut idxs) = (Vec::new(), Vec::new());
            for row in x.chunks(n) {
                let mut order: Vec<usize> = (0..n).collect();
                // Stable: equal values keep index order, so ties break the same way everywhere.
                order.sort_by(|&a, &b| row[b].total_cmp(&row[a]));
                for &j in &order[..k] {
                    vals.push(row[j]);
                    idxs.push(j as i32);
                }
            }
            Ok(vec![
                Tensor::f32(out0(), vals),
                Tensor::i32(ctx.out_shapes[1].clone(), idxs),
            ])
        }
        Op::MoeDispatch { .. } => {
            let (x, idx) = (ins[0].f()?, ins[1].i()?);
            let s = &ctx.out_shapes[0];
            let (experts, capacity, d) = (s[0], s[1], s[2]);
            let k = ins[1].shape[1];
            let mut out = vec![0.0f32; experts * capacity * d];
            for (j, slot) in moe_slots(idx, experts, capacity)?.into_iter().enumerate() {
                if let Some((e, c)) = slot {
                    let t = j / k;
                    out[(e * capacity + c) * d..][..d].copy_from_slice(&x[t * d..(t + 1) * d]);
                }
            }
            one(Tensor::f32(s.clone(), out))
        }
        Op::MoeCombine => {
            let (y, w, idx) = (ins[0].f()?, ins[1].f()?, ins[2].i()?);
            let (experts, capacity, d) = (ins[0].shape[0], ins[0].shape[1], ins[0].shape[2]);
            let (t, k) = (ins[1].shape[0], ins[1].shape[1]);
            let mut out = vec![0.0f32; t * d];
            for (j, slot) in moe_slots(idx, experts, capacity)?.into_iter().enumerate() {
                if let Some((e, c)) = slot {
                    let row = &y[(e * capacity + c) * d..][..d];
                    for (o, &v) in out[(j / k) * d..][..d].iter_mut().zip(row) {
                        *o += w[j] * v;
                    }
                }
            }
            one(Tensor::f32(vec![t, d], out))
        }
    }
}
