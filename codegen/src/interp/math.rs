//! The `f32` semantics of the elementwise ops — each unary op, its
//! derivative, each binary op and the error function — that the
//! interpreter computes and the CUDA emission keeps.

use dplc_ir::{BinaryOp, UnaryOp};

/// `f32` semantics of a unary op, shared by the interpreter and tests.
pub fn unary(op: UnaryOp, x: f32) -> f32 {
    match op {
        UnaryOp::Neg => -x,
        UnaryOp::Exp => x.exp(),
        UnaryOp::Log => x.ln(),
        UnaryOp::Sqrt => x.sqrt(),
        UnaryOp::Rsqrt => 1.0 / x.sqrt(),
        UnaryOp::Recip => 1.0 / x,
        UnaryOp::Tanh => x.tanh(),
        UnaryOp::Sigmoid => 1.0 / (1.0 + (-x).exp()),
        UnaryOp::Relu => x.max(0.0),
        UnaryOp::Gelu => 0.5 * x * (1.0 + erf(x / std::f32::consts::SQRT_2)),
        UnaryOp::GeluTanh => 0.5 * x * (1.0 + (0.797_884_6 * (x + 0.044_715 * x * x * x)).tanh()),
        UnaryOp::Silu => x / (1.0 + (-x).exp()),
        UnaryOp::Sin => x.sin(),
        UnaryOp::Cos => x.cos(),
        UnaryOp::Abs => x.abs(),
        UnaryOp::Floor => x.floor(),
    }
}

/// `d op(x) / dx` in `f32` (the backward kernels' [`crate::Expr::UnaryGrad`]).
pub fn unary_grad(op: UnaryOp, x: f32) -> f32 {
    match op {
        UnaryOp::Neg => -1.0,
        UnaryOp::Exp => x.exp(),
        UnaryOp::Log => 1.0 / x,
        UnaryOp::Sqrt => 0.5 / x.sqrt(),
        UnaryOp::Rsqrt => {
            let r = 1.0 / x.sqrt();
            -0.5 * r * r * r
        }
        UnaryOp::Recip => -1.0 / (x * x),
        UnaryOp::Tanh => {
            let t = x.tanh();
            1.0 - t * t
        }
        UnaryOp::Sigmoid => {
            let s = 1.0 / (1.0 + (-x).exp());
            s * (1.0 - s)
        }
        UnaryOp::Relu => {
            if x > 0.0 {
                1.0
            } else {
                0.0
            }
        }
        UnaryOp::Gelu => {
            let cdf = 0.5 * (1.0 + erf(x * std::f32::consts::FRAC_1_SQRT_2));
            let pdf = (-0.5 * x * x).exp() * 0.398_942_3;
            cdf + x * pdf
        }
        UnaryOp::GeluTanh => {
            let c = 0.797_884_6;
            let t = (c * (x + 0.044_715 * x * x * x)).tanh();
            let dinner = c * (1.0 + 3.0 * 0.044_715 * x * x);
            0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * dinner
        }
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

/// `f32` semantics of a binary op (inlined: the CPU reference calls it per element).
#[inline]
pub fn binary(op: BinaryOp, a: f32, b: f32) -> f32 {
    match op {
        BinaryOp::Add => a + b,
        BinaryOp::Sub => a - b,
        BinaryOp::Mul => a * b,
        BinaryOp::Div => a / b,
        BinaryOp::Max => a.max(b),
        BinaryOp::Min => a.min(b),
        BinaryOp::Pow => a.powf(b),
        cmp => cmp
            .compare(f64::from(a), f64::from(b))
            .map_or(f32::NAN, |v| v as f32),
    }
}

/// The error function in f64 (Numerical Recipes' erfc Chebyshev fit,
/// fractional error below 1.2e-7): the one both the kernel interpreter and
/// the CPU reference use.
pub fn erf_f64(x: f64) -> f64 {
    let t = 1.0 / (1.0 + 0.5 * x.abs());
    // Horner's rule from the innermost coefficient out: the same operations
    // in the same order as the nested expression (a loop, because rustfmt
    // takes minutes over ten levels of nested parentheses).
    const C: [f64; 8] = [
        -0.822_152_23,
        1.488_515_87,
        -1.135_203_98,
        0.278_868_07,
        -0.186_288_06,
        0.096_784_18,
        0.374_091_96,
        1.000_023_68,
    ];
    let poly = C.iter().fold(0.170_872_77, |acc, &c| c + t * acc);
    let r = t * (-x * x - 1.265_512_23 + t * poly).exp();
    if x >= 0.0 {
        1.0 - r
    } else {
        r - 1.0
    }
}

/// [`erf_f64`] of an f32, rounded to f32.
pub fn erf(x: f32) -> f32 {
    erf_f64(f64::from(x)) as f32
}
