//! A CPU interpreter of the kernel IR in `f32`: the reference every fused
//! kernel is tested against without a GPU, and the semantics CUDA emission keeps.

use crate::kernel::{random_uniform, Cond, Elem, Expr, Idx, Kernel, RowReduce, Size};
use crate::CodegenError;
use dplc_ir::{BinaryOp, UnaryOp};

/// The contents of one kernel buffer.
#[derive(Clone, Debug, PartialEq)]
pub enum Data {
    F32(Vec<f32>),
    I32(Vec<i32>),
}

impl Data {
    pub fn f32(&self) -> &[f32] {
        match self {
            Data::F32(v) => v,
            Data::I32(_) => &[],
        }
    }

    pub fn len(&self) -> usize {
        match self {
            Data::F32(v) => v.len(),
            Data::I32(v) => v.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// The run-time arguments of a launch besides the buffers.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Args {
    /// Values of the size arguments `n0..`.
    pub sizes: Vec<i64>,
    /// Values of the scalar arguments `s0..`.
    pub scalars: Vec<f32>,
    pub seed: u64,
}

impl Args {
    pub fn size(&self, s: Size) -> i64 {
        match s {
            Size::Const(n) => n,
            Size::Param(k) => self.sizes[k],
        }
    }

    /// Elements of buffer `b` of `kernel`.
    pub fn buffer_len(&self, kernel: &Kernel, b: usize) -> usize {
        kernel.buffers[b]
            .len
            .iter()
            .map(|&s| self.size(s))
            .product::<i64>()
            .max(0) as usize
    }
}

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
    }
}

/// `d op(x) / dx` in `f32` (the backward kernels' [`Expr::UnaryGrad`]).
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
    }
}

/// `f32` semantics of a binary op.
pub fn binary(op: BinaryOp, a: f32, b: f32) -> f32 {
    match op {
        BinaryOp::Add => a + b,
        BinaryOp::Sub => a - b,
        BinaryOp::Mul => a * b,
        BinaryOp::Div => a / b,
        BinaryOp::Max => a.max(b),
        BinaryOp::Min => a.min(b),
        BinaryOp::Pow => a.powf(b),
    }
}

/// The error function (Abramowitz & Stegun 7.1.26 refined; |error| < 1.2e-7),
/// computed in f64.
pub fn erf(x: f32) -> f32 {
    let x = f64::from(x);
    let t = 1.0 / (1.0 + 0.5 * x.abs());
    let y = 1.0
        - t * (-x * x - 1.265_512_23
            + t * (1.000_023_68
                + t * (0.374_091_96
                    + t * (0.096_784_18
                        + t * (-0.186_288_06
                            + t * (0.278_868_07
                                + t * (-1.135_203_98
                                    + t * (1.488_515_87
                                        + t * (-0.822_152_23 + t * 0.170_872_77)))))))))
            .exp();
    (if x >= 0.0 { y } else { -y }) as f32
}

#[derive(Clone)]
enum Val {
    One(f32),
    Row(Vec<f32>),
}

impl Val {
    fn at(&self, j: usize) -> f32 {
        match self {
            Val::One(x) => *x,
            Val::Row(v) => v[j],
        }
    }
}

struct Ctx<'a> {
    kernel: &'a Kernel,
    args: &'a Args,
    buffers: &'a [Data],
    vars: Vec<i64>,
}

impl Ctx<'_> {
    fn index(&self, idx: &Idx, j: i64) -> Result<i64, CodegenError> {
        let bin = |a: &Idx, b: &Idx| -> Result<(i64, i64), CodegenError> {
            Ok((self.index(a, j)?, self.index(b, j)?))
        };
        Ok(match idx {
            Idx::Var(a) => self.vars[*a],
            Idx::Inner => j,
            Idx::Const(c) => *c,
            Idx::Size(s) => self.args.size(*s),
            Idx::Add(a, b) => bin(a, b).map(|(a, b)| a + b)?,
            Idx::Sub(a, b) => bin(a, b).map(|(a, b)| a - b)?,
            Idx::Mul(a, b) => bin(a, b).map(|(a, b)| a * b)?,
            Idx::Div(a, b) => bin(a, b).map(|(a, b)| a.div_euclid(b))?,
            Idx::Rem(a, b) => bin(a, b).map(|(a, b)| a.rem_euclid(b))?,
            Idx::Min(a, b) => bin(a, b).map(|(a, b)| a.min(b))?,
            Idx::Max(a, b) => bin(a, b).map(|(a, b)| a.max(b))?,
            Idx::Load(buf, i) => {
                let at = self.index(i, j)?;
                match &self.buffers[*buf] {
                    Data::I32(v) => i64::from(*self.get(v, *buf, at)?),
                    Data::F32(_) => {
                        return Err(self.err(format!("b{buf} holds floats, not indices")))
                    }
                }
            }
        })
    }

    fn get<'v, T>(&self, v: &'v [T], buf: usize, at: i64) -> Result<&'v T, CodegenError> {
        usize::try_from(at)
            .ok()
            .and_then(|i| v.get(i))
            .ok_or_else(|| self.err(format!("b{buf}[{at}] is outside its {} elements", v.len())))
    }

    fn err(&self, detail: String) -> CodegenError {
        CodegenError::Interpret {
            kernel: self.kernel.op.clone(),
            detail,
        }
    }

    fn eval(&self, e: &Expr, vals: &[Val], j: i64) -> Result<f32, CodegenError> {
        let v = |id: crate::kernel::ValueId| vals[id.0 as usize].at(j.max(0) as usize);
        Ok(match e {
            Expr::Load { buf, index } => {
                let at = self.index(index, j)?;
                match &self.buffers[*buf] {
                    Data::F32(d) => *self.get(d, *buf, at)?,
                    Data::I32(d) => *self.get(d, *buf, at)? as f32,
                }
            }
            Expr::Const(c) => *c as f32,
            Expr::Scalar(k) => self.args.scalars[*k],
            Expr::FromIndex(i) => self.index(i, j)? as f32,
            Expr::Unary(op, a) => unary(*op, v(*a)),
            Expr::UnaryGrad(op, a) => unary_grad(*op, v(*a)),
            Expr::Binary(op, a, b) => binary(*op, v(*a), v(*b)),
            Expr::Select {
                cond,
                then,
                otherwise,
            } => {
                let c = match cond {
                    Cond::IdxLt(a, b) => self.index(a, j)? < self.index(b, j)?,
                    Cond::ValLt(a, b) => v(*a) < v(*b),
                };
                if c {
                    v(*then)
                } else {
                    v(*otherwise)
                }
            }
            Expr::Random { stream, index } => {
                random_uniform(self.args.seed, *stream, self.index(index, j)?)
            }
            Expr::Reduce { .. } => unreachable!("reductions are evaluated per row"),
        })
    }
}

/// Run `kernel` on the CPU. `buffers` holds one entry per kernel buffer; output
/// buffers are (re)sized to their length and filled.
pub fn interpret(kernel: &Kernel, args: &Args, buffers: &mut [Data]) -> Result<(), CodegenError> {
    if buffers.len() != kernel.buffers.len() || args.sizes.len() < kernel.sizes {
        return Err(CodegenError::Interpret {
            kernel: kernel.op.clone(),
            detail: format!(
                "{} buffers and {} sizes given, the kernel takes {} and {}",
                buffers.len(),
                args.sizes.len(),
                kernel.buffers.len(),
                kernel.sizes
            ),
        });
    }
    for (b, buf) in kernel.buffers.iter().enumerate() {
        if buf.output {
            let len = args.buffer_len(kernel, b);
            buffers[b] = match buf.elem {
                Elem::Float | Elem::F32 => Data::F32(vec![0.0; len]),
                Elem::I32 => Data::I32(vec![0; len]),
            };
        }
    }
    let along = kernel.along_row();
    let outer: Vec<i64> = kernel.space.outer.iter().map(|&s| args.size(s)).collect();
    let inner = kernel.space.inner.map(|s| args.size(s) as usize);
    let points: i64 = outer.iter().product();
    let mut writes: Vec<(usize, i64, f32, bool)> = Vec::new();
    for flat in 0..points {
        let mut vars = vec![0i64; outer.len()];
        let mut rem = flat;
        for a in (0..outer.len()).rev() {
            vars[a] = rem % outer[a];
            rem /= outer[a];
        }
        let ctx = Ctx {
            kernel,
            args,
            buffers,
            vars,
        };
        let mut vals: Vec<Val> = Vec::with_capacity(kernel.values.len());
        for (i, e) in kernel.values.iter().enumerate() {
            let val = match (e, inner) {
                (Expr::Reduce { kind, value }, Some(n)) => {
                    let row = &vals[value.0 as usize];
                    let mut acc = match kind {
                        RowReduce::Sum => 0.0f32,
                        RowReduce::Max => f32::NEG_INFINITY,
                    };
                    for j in 0..n {
                        let x = row.at(j);
                        acc = match kind {
                            RowReduce::Sum => acc + x,
                            RowReduce::Max => acc.max(x),
                        };
                    }
                    Val::One(acc)
                }
                (Expr::Reduce { .. }, None) => {
                    return Err(ctx.err("a row reduction outside a row kernel".into()))
                }
                (e, Some(n)) if along[i] => Val::Row(
                    (0..n)
                        .map(|j| ctx.eval(e, &vals, j as i64))
                        .collect::<Result<_, _>>()?,
                ),
                (e, _) => Val::One(ctx.eval(e, &vals, 0)?),
            };
            vals.push(val);
        }
        for st in &kernel.stores {
            let js = match (inner, along[st.value.0 as usize] || st.index.uses_inner()) {
                (Some(n), true) => n,
                _ => 1,
            };
            for j in 0..js {
                let at = ctx.index(&st.index, j as i64)?;
                writes.push((st.buf, at, vals[st.value.0 as usize].at(j), st.accumulate));
            }
        }
        // Stores land after each point so a later point never reads them:
        // kernels never read what they write.
        for (buf, at, x, accumulate) in writes.drain(..) {
            let len = buffers[buf].len();
            let slot = usize::try_from(at)
                .ok()
                .filter(|&i| i < len)
                .ok_or_else(|| CodegenError::Interpret {
                    kernel: kernel.op.clone(),
                    detail: format!("store to b{buf}[{at}] is outside its {len} elements"),
                })?;
            match &mut buffers[buf] {
                Data::F32(v) if accumulate => v[slot] += x,
                Data::F32(v) => v[slot] = x,
                Data::I32(v) => v[slot] = x as i32,
            }
        }
    }
    Ok(())
}
