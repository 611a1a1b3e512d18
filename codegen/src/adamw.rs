//! The optimizer updates over a flat parameter shard, as kernels: AdamW with
//! decoupled weight decay and bias-corrected moments (Loshchilov & Hutter;
//! PyTorch's AdamW), and SGD with momentum.

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

/// One AdamW step over `n0` elements. Buffers: `b0..b2` the new parameter,
/// first and second moment (f32); `b3..b6` the parameter, gradient (storage
/// type), first and second moment. Each element is read before it is written
/// by the same thread, so a caller may pass `b0 = b3`, `b1 = b5`, `b2 = b6`
/// to update in place.
pub fn adamw_kernel() -> Kernel {
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
    elementwise(
        "adamw".to_string(),
        7,
        &[
            ("p_out", Elem::F32, true),
            ("m_out", Elem::F32, true),
            ("v_out", Elem::F32, true),
            ("p", Elem::F32, false),
            ("g", Elem::Float, false),
            ("m", Elem::F32, false),
            ("v", Elem::F32, false),
        ],
        b,
        &[(0, p2v), (1, m2), (2, v2)],
    )
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

/// One SGD-with-momentum step over `n0` elements (PyTorch's form:
/// `m' = μ m + g`, `p' = p − lr m'`). Buffers: `b0, b1` the new parameter and
/// momentum (f32); `b2..b4` the parameter, gradient (storage type) and
/// momentum. In place as [`adamw_kernel`] is.
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
            ("g", Elem::Float, false),
            ("m", Elem::F32, false),
        ],
        b,
        &[(0, p2), (1, m2)],
    )
}
