//! The optimizer updates over a flat parameter shard, as kernels: AdamW with
//! decoupled weight decay and bias-corrected moments (Loshchilov & Hutter;
//! PyTorch's AdamW), and SGD with momentum.
//!
//! Each rule also has its scalar form ([`AdamwScalars::apply`],
//! [`SgdScalars::apply`]): the kernel's `f32` operations in the kernel's
//! order, which is how a host-resident optimizer takes the very step the
//! kernels take (the tests below hold the two to the same bits).

use crate::flat::{elementwise, load};
use crate::interp::Args;
use crate::kernel::{Builder, Elem, Expr, Kernel};
use dplc_ir::{BinaryOp, UnaryOp};

/// The scalar arguments of [`adamw_kernel`], in argument order `s0..s6`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AdamwScalars {
    pub lr: f32,
    pub beta1: f32,
    pub beta2: f32,
    pub eps: f32,
    pub weight_decay: f32,
    /// The step being taken, from 1.
    pub step: u64,
    /// Multiplies the gradient before it enters the moments: gradient
    /// clipping's `max_norm / norm`, or 1.
    pub grad_scale: f32,
}

impl AdamwScalars {
    /// Launch arguments for a shard of `len` elements.
    pub fn args(&self, len: i64) -> Args {
        Args {
            sizes: vec![len],
            scalars: vec![
                self.lr,
                self.beta1,
                self.beta2,
                self.eps,
                self.weight_decay,
                self.step as f32,
                self.grad_scale,
            ],
            seed: 0,
        }
    }
}

impl AdamwScalars {
    /// One element's step, as [`adamw_kernel`] computes it.
    pub fn apply(&self, p: &mut f32, m: &mut f32, v: &mut f32, g: f32) {
        let g = g * self.grad_scale;
        let m2 = self.beta1 * *m + (1.0 - self.beta1) * g;
        let v2 = self.beta2 * *v + (1.0 - self.beta2) * (g * g);
        let t = self.step as f32;
        let bc1 = 1.0 - self.beta1.powf(t);
        let bc2 = 1.0 - self.beta2.powf(t);
        let update = (m2 / bc1) / ((v2 / bc2).sqrt() + self.eps);
        *p -= self.lr * (update + self.weight_decay * *p);
        *m = m2;
        *v = v2;
    }
}

/// One AdamW step over `n0` elements. Buffers: `b0..b2` the new parameter,
/// first and second moment; `b3..b6` the parameter, gradient, first and
/// second moment — all `f32`, whatever the storage type: the optimizer's
/// gradient is the store's `f32` accumulator (read as bf16, its bytes were
/// garbage on the first GPU run in bf16). Each element is read before it is written
/// by the same thread, so a caller may pass `b0 = b3`, `b1 = b5`, `b2 = b6`
/// to update in place.
pub fn adamw_kernel() -> Kernel {
    adamw(false)
}

/// [`adamw_kernel`] that also writes the new parameter in the storage type
/// into `b7` (`value`): the compute's copy of the weights, which a
/// separate conversion would make with a second launch and a second read
/// of the parameter (a step of gpt2 runs one per parameter tensor, 196).
pub fn adamw_value_kernel() -> Kernel {
    adamw(true)
}

fn adamw(value: bool) -> Kernel {
    let mut b = Builder::default();
    let p = load(&mut b, 3);
    let g_raw = load(&mut b, 4);
    let m = load(&mut b, 5);
    let v = load(&mut b, 6);
    let lr = b.push(Expr::Scalar(0));
    let b1 = b.push(Expr::Scalar(1));
    let b2 = b.push(Expr::Scalar(2));
    let eps = b.push(Expr::Scalar(3));
    let wd = b.push(Expr::Scalar(4));
    let step = b.push(Expr::Scalar(5));
    let scale = b.push(Expr::Scalar(6));
    let one = b.konst(1.0);
    use BinaryOp::{Add, Div, Mul, Pow, Sub};
    let g = b.binary(Mul, g_raw, scale);
    // m' = b1 m + (1 - b1) g ;  v' = b2 v + (1 - b2) g²
    let c1 = b.binary(Sub, one, b1);
    let bm = b.binary(Mul, b1, m);
    let cg = b.binary(Mul, c1, g);
    let m2 = b.binary(Add, bm, cg);
    let c2 = b.binary(Sub, one, b2);
    let bv = b.binary(Mul, b2, v);
    let gg = b.binary(Mul, g, g);
    let cgg = b.binary(Mul, c2, gg);
    let v2 = b.binary(Add, bv, cgg);
    // Bias corrections 1 - β^t.
    let p1 = b.binary(Pow, b1, step);
    let bc1 = b.binary(Sub, one, p1);
    let p2 = b.binary(Pow, b2, step);
    let bc2 = b.binary(Sub, one, p2);
    let mhat = b.binary(Div, m2, bc1);
    let vhat = b.binary(Div, v2, bc2);
    let root = b.unary(UnaryOp::Sqrt, vhat);
    let den = b.binary(Add, root, eps);
    let upd = b.binary(Div, mhat, den);
    // p' = p - lr (update + wd p): the decay does not pass through the moments.
    let decay = b.binary(Mul, wd, p);
    let total = b.binary(Add, upd, decay);
    let delta = b.binary(Mul, lr, total);
    let p2v = b.binary(Sub, p, delta);
    let mut buffers = vec![
        ("p_out", Elem::F32, true),
        ("m_out", Elem::F32, true),
        ("v_out", Elem::F32, true),
        ("p", Elem::F32, false),
        ("g", Elem::F32, false),
        ("m", Elem::F32, false),
        ("v", Elem::F32, false),
    ];
    let mut stores = vec![(0, p2v), (1, m2), (2, v2)];
    let op = if value {
        buffers.push(("value", Elem::Float, true));
        stores.push((7, p2v));
        "adamw_value"
    } else {
        "adamw"
    };
    elementwise(op.to_string(), 7, &buffers, b, &stores)
}

/// The scalar arguments of [`sgd_kernel`], in argument order `s0..s2`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SgdScalars {
    pub lr: f32,
    pub momentum: f32,
    /// Multiplies the gradient (clipping's `max_norm / norm`, or 1).
    pub grad_scale: f32,
}

impl SgdScalars {
    /// Launch arguments for a shard of `len` elements.
    pub fn args(&self, len: i64) -> Args {
        Args {
            sizes: vec![len],
            scalars: vec![self.lr, self.momentum, self.grad_scale],
            seed: 0,
        }
    }
}

impl SgdScalars {
    /// One element's step, as [`sgd_kernel`] computes it.
    pub fn apply(&self, p: &mut f32, m: &mut f32, g: f32) {
        let m2 = self.momentum * *m + g * self.grad_scale;
        *p -= self.lr * m2;
        *m = m2;
    }
}

/// One SGD-with-momentum step over `n0` elements (PyTorch's form:
/// `m' = μ m + g`, `p' = p − lr m'`). Buffers: `b0, b1` the new parameter and
/// momentum; `b2..b4` the parameter, gradient and momentum, all `f32` as
/// [`adamw_kernel`]'s. In place as [`adamw_kernel`] is.
pub fn sgd_kernel() -> Kernel {
    let mut b = Builder::default();
    let p = load(&mut b, 2);
    let g_raw = load(&mut b, 3);
    let m = load(&mut b, 4);
    let lr = b.push(Expr::Scalar(0));
    let mu = b.push(Expr::Scalar(1));
    let scale = b.push(Expr::Scalar(2));
    let g = b.binary(BinaryOp::Mul, g_raw, scale);
    let mm = b.binary(BinaryOp::Mul, mu, m);
    let m2 = b.binary(BinaryOp::Add, mm, g);
    let step = b.binary(BinaryOp::Mul, lr, m2);
    let p2 = b.binary(BinaryOp::Sub, p, step);
    elementwise(
        "sgd".to_string(),
        3,
        &[
            ("p_out", Elem::F32, true),
            ("m_out", Elem::F32, true),
            ("p", Elem::F32, false),
            ("g", Elem::F32, false),
            ("m", Elem::F32, false),
        ],
        b,
        &[(0, p2), (1, m2)],
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::interp::{interpret, Data};

    fn inputs(n: usize) -> [Vec<f32>; 4] {
        let f = |k: f32| (0..n).map(move |i| ((i as f32 + k) * 0.731).sin());
        [
            f(0.0).collect(),
            f(1.0).map(|x| x * 3.0).collect(),
            f(2.0).map(|x| x * 0.1).collect(),
            f(3.0).map(|x| x * x * 0.01).collect(),
        ]
    }

    /// The scalar forms are the kernels' arithmetic, to the bit.
    #[test]
    fn scalar_steps_are_the_kernels_bits() {
        let n = 257;
        let [p, g, m, v] = inputs(n);
        let s = AdamwScalars {
            lr: 6e-4,
            beta1: 0.9,
            beta2: 0.95,
            eps: 1e-8,
            weight_decay: 0.1,
            step: 7,
            grad_scale: 0.25,
        };
        let mut bufs = vec![
            Data::F32(vec![]),
            Data::F32(vec![]),
            Data::F32(vec![]),
            Data::F32(p.clone()),
            Data::F32(g.clone()),
            Data::F32(m.clone()),
            Data::F32(v.clone()),
        ];
        interpret(&adamw_kernel(), &s.args(n as i64), &mut bufs).unwrap();
        // The variant that also writes the compute's copy: the same step.
        let mut with_value = bufs[3..].to_vec();
        with_value.splice(
            0..0,
            [Data::F32(vec![]), Data::F32(vec![]), Data::F32(vec![])],
        );
        with_value.push(Data::F32(vec![]));
        interpret(&adamw_value_kernel(), &s.args(n as i64), &mut with_value).unwrap();
        for i in 0..n {
            let (mut pi, mut mi, mut vi) = (p[i], m[i], v[i]);
            s.apply(&mut pi, &mut mi, &mut vi, g[i]);
            let bits = |b: usize| bufs[b].f32()[i].to_bits();
            assert_eq!(
                (bits(0), bits(1), bits(2)),
                (pi.to_bits(), mi.to_bits(), vi.to_bits()),
                "adamw element {i}"
            );
            let value_bits = |b: usize| with_value[b].f32()[i].to_bits();
            assert_eq!(
                (value_bits(0), value_bits(1), value_bits(2), value_bits(7)),
                (pi.to_bits(), mi.to_bits(), vi.to_bits(), pi.to_bits()),
                "adamw_value element {i}"
            );
        }
        let s = SgdScalars {
            lr: 0.1,
            momentum: 0.9,
            grad_scale: 0.5,
        };
        let mut bufs = vec![
            Data::F32(vec![]),
            Data::F32(vec![]),
            Data::F32(p.clone()),
            Data::F32(g.clone()),
            Data::F32(m.clone()),
        ];
        interpret(&sgd_kernel(), &s.args(n as i64), &mut bufs).unwrap();
        for i in 0..n {
            let (mut pi, mut mi) = (p[i], m[i]);
            s.apply(&mut pi, &mut mi, g[i]);
            assert_eq!(
                (bufs[0].f32()[i].to_bits(), bufs[1].f32()[i].to_bits()),
                (pi.to_bits(), mi.to_bits()),
                "sgd element {i}"
            );
        }
    }
}
