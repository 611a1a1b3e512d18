//! Forward f32 kernels for every primitive op of the IR, on dense row-major
//! tensors. Matmuls go through `matrixmultiply`'s packed sgemm.

use crate::error::{kernel_err, Result};
use crate::tensor::{
    broadcast_data, broadcast_shape, broadcast_strides, gather_strided, split_axis, strides, Data,
    Tensor, Walk,
};
use dplc_ir::{BinaryOp, DType, Op, ReduceKind, UnaryOp};

/// Where a dropout mask comes from: the element's key is this plus its sample
/// and position, so the mask is the same however the batch or the sequence
/// is split.
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
    /// This rank's place in its context-parallel group and the group's
    /// size (0 of 1 without context parallelism): where the positions a
    /// dropout of the rank's chunks holds lie in the whole sequence.
    pub cp_rank: usize,
    pub cp: usize,
    /// This rank's place in its tensor-parallel group and the group's size
    /// (0 of 1 without): where a dropout of the rank's part of a split
    /// value (tensor or sequence parallelism) lies in the whole value.
    pub tp_rank: usize,
    pub tp: usize,
}

impl DropoutKey {
    /// The key of ops that draw nothing (routing, a test's top-k): every
    /// word zero, one rank of one in each group.
    pub const NONE: DropoutKey = DropoutKey {
        seed: 0,
        step: 0,
        node: 0,
        layer: 0,
        first_sample: 0,
        batch: 0,
        cp_rank: 0,
        cp: 1,
        tp_rank: 0,
        tp: 1,
    };

    /// Keep (true) or drop each element of a tensor of `shape`, keyed by
    /// its flat index in the whole tensor, the serial run's index of the
    /// same element: under context parallelism `context` is the axis of the
    /// rank's sequence chunks, under tensor or sequence parallelism `split`
    /// the axis of its part (see `Op::Dropout`). Samples are keyed as
    /// `dplc_codegen::elements_per_sample` splits the whole tensor, the
    /// rule the fused kernels' draws follow too.
    pub fn mask(
        &self,
        p: f64,
        shape: &[usize],
        context: Option<usize>,
        split: Option<usize>,
    ) -> Vec<bool> {
        let n: usize = shape.iter().product();
        let at = dplc_ir::Placement {
            split: split
                .filter(|_| self.tp > 1)
                .map(|axis| (axis, self.tp_rank, self.tp)),
            context: context
                .filter(|_| self.cp > 1)
                .map(|axis| (axis, self.cp_rank, self.cp)),
        };
        let whole: usize = at.whole_shape(shape).iter().product();
        let per_sample = dplc_codegen::elements_per_sample(whole, self.batch);
        // The key's words fold once; the sample's and the position's are
        // the element's (the draw is the fused kernels' very function).
        let state = dplc_codegen::draw_state(
            dplc_codegen::draw_seed(self.seed, self.step),
            self.node,
            self.layer as i64,
        );
        (0..n)
            .map(|i| {
                let i = at.whole_index(shape, i);
                let (sample, pos) = match i.checked_div(per_sample) {
                    Some(s) => (self.first_sample + s as u64, (i % per_sample) as u64),
                    None => (u64::MAX, i as u64),
                };
                let u = dplc_codegen::sample_draw(dplc_codegen::key_absorb(state, sample), pos);
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
    /// The axis along which the output holds this rank's tensor-parallel
    /// part, where the graph run is the model's over layouts (the reference
    /// compute; a rank's local program says it in its op instead).
    pub split: Option<usize>,
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
    let s: Vec<usize> = broadcast_strides(batch, out_batch)
        .into_iter()
        .map(|st| st * mat)
        .collect();
    gather_offsets(out_batch, &s)
}

/// The offsets `Σ index_i·strides_i` of every index of `shape`, row-major.
fn gather_offsets(shape: &[usize], strides: &[usize]) -> Vec<usize> {
    let n: usize = shape.iter().product();
    let mut out = Vec::with_capacity(n);
    let walk = Walk::new(shape, [strides]);
    let (len, [step]) = walk.run();
    walk.for_each([0], |[o]| out.extend((0..len).map(|j| o + j * step)));
    out
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

/// erf to about 1e-7, in f64: codegen's, so the reference and the fused
/// kernels' interpreter share it.
pub(crate) fn erf(x: f64) -> f64 {
    dplc_codegen::erf_f64(x)
}

const GELU_C: f32 = 0.797_884_6;
const GELU_A: f32 = 0.044_715;

/// e^x in f32 to about 1 ulp (Cephes' expf: x = n·ln2 + r, a degree-6
/// polynomial for e^r, 2^n put into the exponent), written without branches
/// or calls so that a loop over it vectorises; libm's expf does not.
#[inline(always)]
pub(crate) fn exp_f32(x: f32) -> f32 {
    // Past these bounds e^x is 0 or overflows; clamped, the exponent stays normal.
    let x = x.clamp(-87.0, 88.0);
    // Round x·log2(e) to the nearest integer by adding 1.5·2^23.
    const SHIFTER: f32 = 12_582_912.0;
    let t = x * std::f32::consts::LOG2_E + SHIFTER;
    let n = t - SHIFTER;
    let r = x - n * 0.693_359_4 - n * -2.121_944_4e-4;
    let p = ((((1.987_569_1e-4 * r + 1.398_199_9e-3) * r + 8.333_452e-3) * r + 4.166_579_6e-2) * r
        + 1.666_666_5e-1)
        * r
        + 0.5;
    let er = p * r * r + r + 1.0;
    let bits = ((t.to_bits() as i32 - SHIFTER.to_bits() as i32 + 127) as u32) << 23;
    er * f32::from_bits(bits)
}

/// tanh in f32 to a few ulp (Cephes' tanhf: an odd polynomial below 0.625,
/// 1 − 2/(e^{2|x|} + 1) above), branch-free so that loops over it vectorise.
#[inline(always)]
pub(crate) fn tanh_f32(x: f32) -> f32 {
    let a = x.abs();
    let z = x * x;
    let small =
        ((((-5.704_988_7e-3 * z + 2.063_909e-2) * z - 5.373_971_6e-2) * z + 1.333_144_2e-1) * z
            - 3.333_328e-1)
            * z
            * x
            + x;
    let large = (1.0 - 2.0 / (exp_f32(2.0 * a) + 1.0)).copysign(x);
    if a < 0.625 {
        small
    } else {
        large
    }
}

/// GPT-2's tanh GELU, `0.5·x·(1 + tanh(√(2/π)·(x + 0.044715·x³)))`, in f32.
#[inline(always)]
pub(crate) fn gelu_tanh(x: f32) -> f32 {
    0.5 * x * (1.0 + tanh_f32(GELU_C * (x + GELU_A * x * x * x)))
}

/// d gelu_tanh(x) / dx.
#[inline(always)]
pub(crate) fn gelu_tanh_grad(x: f32) -> f32 {
    let t = tanh_f32(GELU_C * (x + GELU_A * x * x * x));
    let dinner = GELU_C * (1.0 + 3.0 * GELU_A * x * x);
    0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * dinner
}

/// `f` applied to every element, monomorphised per op so that the loop vectorises.
fn map_unary(u: UnaryOp, xs: &[f32]) -> Vec<f32> {
    fn each(xs: &[f32], f: impl Fn(f32) -> f32) -> Vec<f32> {
        xs.iter().map(|&x| f(x)).collect()
    }
    match u {
        UnaryOp::Neg => each(xs, |x| -x),
        UnaryOp::Relu => each(xs, |x| x.max(0.0)),
        UnaryOp::GeluTanh => each(xs, gelu_tanh),
        u => each(xs, |x| unary(u, x)),
    }
}

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
        UnaryOp::GeluTanh => gelu_tanh(x),
        UnaryOp::Silu => x / (1.0 + (-x).exp()),
        UnaryOp::Sin => x.sin(),
        UnaryOp::Cos => x.cos(),
        UnaryOp::Abs => x.abs(),
        UnaryOp::Floor => x.floor(),
    }
}

/// A binary op's `f32` semantics: the fused kernels' (`dplc_codegen::binary`).
pub(crate) fn binary_f(b: BinaryOp, x: f32, y: f32) -> f32 {
    dplc_codegen::binary(b, x, y)
}

/// The shape `where(c, a, b)` broadcasts its three operands to.
pub(crate) fn select_shape(ins: &[&Tensor]) -> Result<Vec<usize>> {
    broadcast_shape(&ins[0].shape, &ins[1].shape)
        .and_then(|s| broadcast_shape(&s, &ins[2].shape))
        .ok_or_else(|| kernel_err("where", "operands do not broadcast"))
}

/// `t`'s elements broadcast to `shape`.
pub(crate) fn expand_to(t: &Tensor, shape: &[usize]) -> Result<Vec<f32>> {
    Ok(zip_broadcast(
        (t.f()?, &t.shape),
        (&[0.0], &[]),
        shape,
        |p, _| p,
    ))
}

/// `f(x, y)` over the broadcast of `x` and `y` to `shape`, one innermost run
/// at a time (a bias add reads rows of the bias, a scalar is read once).
pub(crate) fn zip_broadcast(
    (xs, xshape): (&[f32], &[usize]),
    (ys, yshape): (&[f32], &[usize]),
    shape: &[usize],
    f: impl Fn(f32, f32) -> f32,
) -> Vec<f32> {
    let mut out = vec![0.0f32; shape.iter().product()];
    let walk = Walk::new(
        shape,
        [
            &strides(shape),
            &broadcast_strides(xshape, shape),
            &broadcast_strides(yshape, shape),
        ],
    );
    let (len, [_, sx, sy]) = walk.run();
    walk.for_each([0, 0, 0], |[o, x, y]| {
        let out = &mut out[o..o + len];
        match (sx, sy) {
            (1, 1) => out
                .iter_mut()
                .zip(xs[x..x + len].iter().zip(&ys[y..y + len]))
                .for_each(|(o, (&p, &q))| *o = f(p, q)),
            (1, 0) => {
                let q = ys[y];
                out.iter_mut()
                    .zip(&xs[x..x + len])
                    .for_each(|(o, &p)| *o = f(p, q));
            }
            (0, 1) => {
                let p = xs[x];
                out.iter_mut()
                    .zip(&ys[y..y + len])
                    .for_each(|(o, &q)| *o = f(p, q));
            }
            _ => out
                .iter_mut()
                .enumerate()
                .for_each(|(j, o)| *o = f(xs[x + j * sx], ys[y + j * sy])),
        }
    });
    out
}

fn binary(b: BinaryOp, x: &Tensor, y: &Tensor) -> Result<Tensor> {
    let shape = broadcast_shape(&x.shape, &y.shape)
        .ok_or_else(|| kernel_err("binary", "operands do not broadcast"))?;
    Ok(match (&x.data, &y.data) {
        (Data::F32(xs), Data::F32(ys)) => {
            let (xa, ya) = ((&xs[..], &x.shape[..]), (&ys[..], &y.shape[..]));
            let v = match b {
                BinaryOp::Add => zip_broadcast(xa, ya, &shape, |p, q| p + q),
                BinaryOp::Sub => zip_broadcast(xa, ya, &shape, |p, q| p - q),
                BinaryOp::Mul => zip_broadcast(xa, ya, &shape, |p, q| p * q),
                BinaryOp::Div => zip_broadcast(xa, ya, &shape, |p, q| p / q),
                b => zip_broadcast(xa, ya, &shape, |p, q| binary_f(b, p, q)),
            };
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

/// `t`'s elements read through `strides` from `offset`, as a tensor of `shape`.
fn map_data(t: &Tensor, shape: Vec<usize>, strides: &[usize], offset: usize) -> Tensor {
    let data = match &t.data {
        Data::F32(v) => Data::F32(gather_strided(v, &shape, strides, offset)),
        Data::I32(v) => Data::I32(gather_strided(v, &shape, strides, offset)),
    };
    Tensor { shape, data }
}

pub(crate) fn transpose(t: &Tensor, perm: &[usize]) -> Tensor {
    let s = strides(&t.shape);
    let shape: Vec<usize> = perm.iter().map(|&p| t.shape[p]).collect();
    let ps: Vec<usize> = perm.iter().map(|&p| s[p]).collect();
    map_data(t, shape, &ps, 0)
}

fn slice(t: &Tensor, axis: usize, start: usize, len: usize) -> Tensor {
    let s = strides(&t.shape);
    let mut shape = t.shape.clone();
    shape[axis] = len;
    map_data(t, shape, &s, start * s[axis])
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

/// `t` with `before` elements of `value` in front along `axis` and `after`
/// behind (a negative count drops elements from that end): `Op::Pad`, and its
/// own backward with the counts negated.
pub(crate) fn pad(t: &Tensor, axis: usize, before: i64, after: i64, value: f64) -> Result<Tensor> {
    let (outer, n, inner) = split_axis(&t.shape, axis);
    let len = n as i64 + before + after;
    if len <= 0 {
        return Err(kernel_err("pad", "the padded axis would be empty"));
    }
    let len = len as usize;
    let mut shape = t.shape.clone();
    shape[axis] = len;
    macro_rules! fill {
        ($variant:ident, $get:ident, $fill:expr) => {{
            let src = t.$get()?;
            let mut out = vec![$fill; outer * len * inner];
            for o in 0..outer {
                for j in 0..len {
                    // The source element this output position holds, if any.
                    let from = j as i64 - before;
                    if (0..n as i64).contains(&from) {
                        let (d, s) = ((o * len + j) * inner, (o * n + from as usize) * inner);
                        out[d..d + inner].copy_from_slice(&src[s..s + inner]);
                    }
                }
            }
            Tensor {
                shape,
                data: Data::$variant(out),
            }
        }};
    }
    Ok(if t.is_float() {
        fill!(F32, f, value as f32)
    } else {
        fill!(I32, i, value as i32)
    })
}

/// The running sum of `t` along `axis`, from the back when `reverse`.
pub(crate) fn cumsum(t: &Tensor, axis: usize, reverse: bool) -> Result<Tensor> {
    let (outer, n, inner) = split_axis(&t.shape, axis);
    let src = t.f()?;
    let mut out = vec![0.0f32; src.len()];
    for o in 0..outer {
        for i in 0..inner {
            let mut acc = 0.0f32;
            for k in 0..n {
                let j = if reverse { n - 1 - k } else { k };
                let at = (o * n + j) * inner + i;
                acc += src[at];
                out[at] = acc;
            }
        }
    }
    Ok(Tensor::f32(t.shape.clone(), out))
}

fn expand(t: &Tensor, shape: &[usize]) -> Tensor {
    map_data(t, shape.to_vec(), &broadcast_strides(&t.shape, shape), 0)
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

pub(crate) fn softmax(x: &Tensor, axis: usize, log: bool) -> Result<Tensor> {
    let xs = x.f()?;
    let (outer, n, inner) = split_axis(&x.shape, axis);
    let mut out = vec![0.0f32; xs.len()];
    if inner == 1 {
        // The usual case, the last axis: rows are contiguous, and each
        // exponential is computed once and kept.
        for (row, o) in xs.chunks(n.max(1)).zip(out.chunks_mut(n.max(1))) {
            let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            for (o, &v) in o.iter_mut().zip(row) {
                *o = (v - max).exp();
            }
            let sum: f32 = o.iter().sum();
            if log {
                let ln = sum.ln();
                o.iter_mut()
                    .zip(row)
                    .for_each(|(o, &v)| *o = (v - max) - ln);
            } else {
                o.iter_mut().for_each(|o| *o /= sum);
            }
        }
        return Ok(Tensor::f32(x.shape.clone(), out));
    }
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
        Op::Input(_)
        | Op::Param(_)
        | Op::Repeat { .. }
        | Op::Relayout { .. }
        | Op::VocabParallel(_) => Err(kernel_err(
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
            map_unary(*u, ins[0].f()?),
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
        Op::Pad {
            axis,
            before,
            after,
            value,
        } => one(pad(ins[0], *axis, *before, *after, *value)?),
        Op::CumSum { axis, reverse } => one(cumsum(ins[0], *axis, *reverse)?),
        Op::Reduce { kind, axis, .. } => one(reduce(*kind, ins[0], *axis, &ctx.out_shapes[0])?),
        Op::Softmax { axis } => one(softmax(ins[0], *axis, false)?),
        Op::LogSoftmax { axis } => one(softmax(ins[0], *axis, true)?),
        Op::LayerNorm { eps } => one(norm(ins[0], ins[1], Some(ins[2]), *eps)?),
        Op::RmsNorm { eps } => one(norm(ins[0], ins[1], None, *eps)?),
        Op::Dropout { p, context, split } => {
            let xs = ins[0].f()?;
            if *p == 0.0 {
                return one(ins[0].clone());
            }
            let keep = ctx
                .dropout
                .mask(*p, &ins[0].shape, *context, split.or(ctx.split));
            let scale = (1.0 / (1.0 - p)) as f32;
            one(Tensor::f32(
                ins[0].shape.clone(),
                xs.iter()
                    .zip(keep)
                    .map(|(&x, k)| if k { x * scale } else { 0.0 })
                    .collect(),
            ))
        }
        Op::Select => {
            let shape = select_shape(ins)?;
            let (c, a, b) = (
                expand_to(ins[0], &shape)?,
                expand_to(ins[1], &shape)?,
                expand_to(ins[2], &shape)?,
            );
            let v = c
                .iter()
                .zip(a.iter().zip(&b))
                .map(|(&c, (&a, &b))| if c != 0.0 { a } else { b })
                .collect();
            one(Tensor::f32(shape, v))
        }
        Op::CausalMask => {
            let r = ins[0].shape.len();
            let (q, k) = (ins[0].shape[r - 2], ins[0].shape[r - 1]);
            let mut v = ins[0].f()?.to_vec();
            // Row i of every [q, k] matrix keeps its first i + 1 columns.
            for (r, row) in v.chunks_mut(k.max(1)).enumerate() {
                let keep = (r % q.max(1) + 1).min(row.len());
                row[keep..].fill(f32::NEG_INFINITY);
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

#[cfg(test)]
mod tests {
    use super::*;

    /// The f32 GELU and its derivative against the f64 formulas they replace.
    #[test]
    fn f32_gelu_tanh_matches_f64() {
        let c = 0.797_884_560_802_865_4f64;
        let (mut worst_y, mut worst_d) = (0.0f64, 0.0f64);
        for i in -20_000..=20_000 {
            let x = i as f32 * 1e-3;
            let xd = f64::from(x);
            let t = (c * (xd + 0.044715 * xd * xd * xd)).tanh();
            let y = 0.5 * xd * (1.0 + t);
            let d =
                0.5 * (1.0 + t) + 0.5 * xd * (1.0 - t * t) * c * (1.0 + 3.0 * 0.044715 * xd * xd);
            worst_y = worst_y.max((f64::from(gelu_tanh(x)) - y).abs() / y.abs().max(1.0));
            worst_d = worst_d.max((f64::from(gelu_tanh_grad(x)) - d).abs() / d.abs().max(1.0));
        }
        assert!(worst_y < 1e-6, "gelu_tanh off by {worst_y:e}");
        assert!(worst_d < 1e-6, "gelu_tanh_grad off by {worst_d:e}");
        assert!(gelu_tanh(f32::NAN).is_nan());
        assert_eq!(gelu_tanh(f32::INFINITY), f32::INFINITY);
        assert_eq!(gelu_tanh(-100.0), 0.0);
    }

    #[test]
    fn f32_exp_is_close_to_libm() {
        for i in -8_700..=8_800 {
            let x = i as f32 * 1e-2;
            let (got, want) = (exp_f32(x), x.exp());
            assert!(
                (got - want).abs() <= want * 4.0 * f32::EPSILON,
                "exp({x}) = {got}, libm {want}"
            );
        }
    }
}
