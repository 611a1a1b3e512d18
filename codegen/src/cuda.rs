//! CUDA C emission from the kernel IR through a small C syntax tree: f32,
//! bf16 or f16 storage with f32 arithmetic, 16-byte vector access along the
//! contiguous axis, a warp per narrow row (a block per wide one) with
//! warp-shuffle reductions, and rows that are columns in memory read side
//! by side.

use crate::kernel::{Cond, Elem, Expr, Idx, Kernel, RowReduce, Size, Store};
use dplc_ir::{BinaryOp, DType, UnaryOp};
use std::collections::BTreeSet;

/// Threads per block of a row kernel (the kernel's `__launch_bounds__`).
pub const ROW_BLOCK: u32 = 256;

/// How the runtime launches a kernel (both kinds stride over their grid, so
/// any grid size is correct).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LaunchShape {
    /// One thread per `vector` consecutive points of the iteration space.
    Elementwise { vector: u32 },
    /// One block of `block` threads per row.
    Rows { block: u32 },
    /// One warp per row, `block / 32` rows a block: a narrow row (a model
    /// width of at most [`WARP_ROW_VECTORS`] vectors) keeps a warp busy
    /// and reduces with shuffles alone, where a block would leave most of
    /// its threads idle and meet at barriers twice a reduction.
    WarpRows { block: u32 },
    /// A block's threads across [`COLUMN_TILE`] neighbouring rows, each
    /// row walked by `block / COLUMN_TILE` threads: for a row kernel whose
    /// rows are columns in memory (a column sum: row `c` reads
    /// `x[r * n + c]`), a warp then reads whole 32-byte sectors where a
    /// block per row read one float from each of 32 sectors.
    Columns { block: u32 },
}

/// Neighbouring rows a [`LaunchShape::Columns`] block reads side by side:
/// eight `f32` columns are one 32-byte sector.
pub const COLUMN_TILE: u32 = 8;

/// Threads of a [`LaunchShape::Columns`] block: a model's width makes few
/// tiles (96 at 768 columns), so each is a whole block of 128 threads a
/// column, each with several loads in flight — the H200 measured a
/// 256-thread block, one load in flight a thread, at 468 µs for a
/// 32768 × 768 sum, latency-bound.
pub const COLUMN_BLOCK: u32 = 1024;

/// The widest row, in vector accesses, a row kernel gives a warp rather
/// than a block: eight accesses a lane (768 bf16 columns are 96 accesses).
pub const WARP_ROW_VECTORS: i64 = 256;

/// Generated CUDA C for one kernel.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CudaSource {
    /// `{op}_{dtype}_{hash8}`, also the `extern "C"` symbol.
    pub name: String,
    pub source: String,
    pub launch: LaunchShape,
}

// ---- a small C syntax tree -------------------------------------------------

#[derive(Clone, Debug)]
pub(crate) enum C {
    Id(String),
    Lit(String),
    Call(String, Vec<C>),
    Bin(&'static str, Box<C>, Box<C>),
    Neg(Box<C>),
    At(Box<C>, Box<C>),
    Cond(Box<C>, Box<C>, Box<C>),
    Cast(&'static str, Box<C>),
    /// `&x`: the address of an element (atomic adds).
    Ref(Box<C>),
}

pub(crate) fn id(s: impl Into<String>) -> C {
    C::Id(s.into())
}

pub(crate) fn call(f: &str, args: Vec<C>) -> C {
    C::Call(f.to_string(), args)
}

pub(crate) fn bin(op: &'static str, a: C, b: C) -> C {
    C::Bin(op, Box::new(a), Box::new(b))
}

pub(crate) fn at(a: C, i: C) -> C {
    C::At(Box::new(a), Box::new(i))
}

impl C {
    pub(crate) fn render(&self) -> String {
        match self {
            C::Id(s) | C::Lit(s) => s.clone(),
            C::Call(f, args) => {
                let args: Vec<String> = args.iter().map(C::render).collect();
                format!("{f}({})", args.join(", "))
            }
            C::Bin(op, a, b) => format!("({} {op} {})", a.render(), b.render()),
            C::Neg(a) => format!("(-{})", a.render()),
            C::At(a, i) => format!("{}[{}]", a.render(), i.render()),
            C::Cond(c, a, b) => format!("({} ? {} : {})", c.render(), a.render(), b.render()),
            C::Cast(t, a) => format!("(({t}){})", a.render()),
            C::Ref(a) => format!("(&{})", a.render()),
        }
    }
}

#[derive(Clone, Debug)]
pub(crate) enum S {
    /// `[const] ty name[ = init];`
    Decl {
        ty: String,
        name: String,
        init: Option<C>,
        konst: bool,
    },
    Assign(C, C),
    For {
        var: String,
        from: C,
        to: C,
        step: C,
        body: Vec<S>,
    },
    If(C, Vec<S>),
    Block(Vec<S>),
    Line(String),
    /// An expression evaluated for its effect: `f(x);`.
    Expr(C),
    /// `[__shared__ __align__(16)] ty name[len];`: a per-thread or a block's array.
    Array {
        ty: &'static str,
        name: String,
        len: usize,
        shared: bool,
    },
    /// `#pragma unroll` for the loop that follows.
    Unroll,
}

pub(crate) fn decl(ty: &str, name: impl Into<String>, init: C) -> S {
    S::Decl {
        ty: ty.to_string(),
        name: name.into(),
        init: Some(init),
        konst: true,
    }
}

pub(crate) fn var(ty: &str, name: impl Into<String>, init: Option<C>) -> S {
    S::Decl {
        ty: ty.to_string(),
        name: name.into(),
        init,
        konst: false,
    }
}

pub(crate) struct Writer {
    pub(crate) out: String,
    pub(crate) depth: usize,
}

impl Writer {
    /// A translation unit's start: the fixed helpers and the storage type's
    /// load/store helpers for `dtype`, shared by every generated kernel.
    pub(crate) fn with_prelude(dtype: DType) -> Writer {
        let mut w = Writer {
            out: String::new(),
            depth: 0,
        };
        w.out.push_str(PRELUDE);
        w.out.push_str(match dtype {
            DType::BF16 => STORAGE_BF16,
            DType::F16 => STORAGE_F16,
            DType::F32 | DType::I32 => STORAGE_F32,
        });
        w
    }

    pub(crate) fn line(&mut self, s: &str) {
        for _ in 0..self.depth {
            self.out.push_str("    ");
        }
        self.out.push_str(s);
        self.out.push('\n');
    }

    pub(crate) fn stmts(&mut self, body: &[S]) {
        for s in body {
            self.stmt(s);
        }
    }

    fn stmt(&mut self, s: &S) {
        match s {
            S::Decl {
                ty,
                name,
                init,
                konst,
            } => {
                let k = if *konst { "const " } else { "" };
                match init {
                    Some(i) => self.line(&format!("{k}{ty} {name} = {};", i.render())),
                    None => self.line(&format!("{ty} {name};")),
                }
            }
            S::Assign(l, r) => self.line(&format!("{} = {};", l.render(), r.render())),
            S::For {
                var,
                from,
                to,
                step,
                body,
            } => {
                self.line(&format!(
                    "for (long long {var} = {}; {var} < {}; {var} += {}) {{",
                    from.render(),
                    to.render(),
                    step.render()
                ));
                self.depth += 1;
                self.stmts(body);
                self.depth -= 1;
                self.line("}");
            }
            S::If(c, body) => {
                self.line(&format!("if ({}) {{", c.render()));
                self.depth += 1;
                self.stmts(body);
                self.depth -= 1;
                self.line("}");
            }
            S::Block(body) => {
                self.line("{");
                self.depth += 1;
                self.stmts(body);
                self.depth -= 1;
                self.line("}");
            }
            S::Line(l) => self.line(l),
            S::Expr(c) => self.line(&format!("{};", c.render())),
            S::Array {
                ty,
                name,
                len,
                shared,
            } => {
                let q = if *shared {
                    "__shared__ __align__(16) "
                } else {
                    ""
                };
                self.line(&format!("{q}{ty} {name}[{len}];"))
            }
            S::Unroll => self.line("#pragma unroll"),
        }
    }
}

// ---- fixed helpers ---------------------------------------------------------

// Each helper block is include-guarded so that several kernels of one storage
// type can share a translation unit (the NVRTC test compiles them in batches).
pub(crate) const PRELUDE: &str = r#"// Generated by dplc-codegen. Launch contract: buffers are 16-byte aligned;
// row kernels run with blockDim.x a multiple of 32 (at most 1024).
#ifndef DPLC_PRELUDE
#define DPLC_PRELUDE
__device__ __forceinline__ long long dplc_imin(long long a, long long b) { return a < b ? a : b; }
__device__ __forceinline__ long long dplc_imax(long long a, long long b) { return a > b ? a : b; }
__device__ __forceinline__ float dplc_sigmoid(float x) { return 1.0f / (1.0f + expf(-x)); }
__device__ __forceinline__ float dplc_silu(float x) { return x / (1.0f + expf(-x)); }
__device__ __forceinline__ float dplc_gelu(float x) { return 0.5f * x * (1.0f + erff(x * 0.70710678118654752f)); }
__device__ __forceinline__ float dplc_gelu_tanh(float x) {
    return 0.5f * x * (1.0f + tanhf(0.7978845608028654f * (x + 0.044715f * x * x * x)));
}
// The CPU reference's dropout draw (runtime/src/rng.rs; codegen's
// `dropout_draw`): SplitMix64's finaliser folded over the key words.
__device__ __forceinline__ unsigned long long dplc_mix(unsigned long long z) {
    z += 0x9e3779b97f4a7c15ULL;
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    return z ^ (z >> 31);
}
__device__ __forceinline__ unsigned long long dplc_absorb(unsigned long long h, unsigned long long w) {
    return dplc_mix(h ^ dplc_mix(w));
}
// `seed` is the key after the run's seed and the step; element `index` is
// position index % per of sample first + index / per (per 0: position index
// of the shared sample ~0).
__device__ __forceinline__ float dplc_random(unsigned long long seed, unsigned long long node,
                                             long long layer, long long first, long long per,
                                             long long index) {
    unsigned long long sample = ~0ULL, pos = (unsigned long long)index;
    if (per > 0) {
        // index / per without a 64-bit division (tens of instructions an
        // element; the H200 ran dropout attention 2x slower with the split
        // than without): the quotient from the double reciprocal, which
        // the caller's loops hoist with `per`, is off by at most one below
        // 2^50 and corrected there, so the split is the reference's.
        long long q, r;
        if (index < (1LL << 50)) {
            q = (long long)((double)index * (1.0 / (double)per));
            r = index - q * per;
            if (r < 0) { q -= 1; r += per; } else if (r >= per) { q += 1; r -= per; }
        } else {
            q = index / per;
            r = index % per;
        }
        sample = (unsigned long long)(first + q);
        pos = (unsigned long long)r;
    }
    unsigned long long h = dplc_absorb(dplc_absorb(seed, node), (unsigned long long)layer);
    h = dplc_absorb(dplc_absorb(h, sample), pos);
    return (float)(h >> 40) * (1.0f / 16777216.0f);
}
#endif
"#;

const REDUCE: &str = r#"#ifndef DPLC_REDUCE
#define DPLC_REDUCE
__device__ __forceinline__ float dplc_warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}
__device__ __forceinline__ float dplc_warp_max(float v) {
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}
// Every thread of the block gets the result; `red` holds 32 floats.
__device__ float dplc_block_sum(float v, float* red) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    v = dplc_warp_sum(v);
    __syncthreads();
    if (lane == 0) red[warp] = v;
    __syncthreads();
    v = (lane < warps) ? red[lane] : 0.0f;
    return dplc_warp_sum(v);
}
__device__ float dplc_block_max(float v, float* red) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    v = dplc_warp_max(v);
    __syncthreads();
    if (lane == 0) red[warp] = v;
    __syncthreads();
    v = (lane < warps) ? red[lane] : __int_as_float(0xff800000);
    return dplc_warp_max(v);
}
#endif
"#;

// Reductions of a `Columns` kernel.
const COLUMNS: &str = r#"#ifndef DPLC_COLUMNS
#define DPLC_COLUMNS
// A `Columns` block: thread t walks row t % 8 of the tile; every thread of
// the row gets its sum (max). `red` holds one float a thread.
__device__ float dplc_column_sum(float v, float* red) {
    const int col = threadIdx.x & 7, groups = blockDim.x >> 3;
    __syncthreads();
    red[threadIdx.x] = v;
    __syncthreads();
    v = 0.0f;
    for (int g = 0; g < groups; ++g) v += red[g * 8 + col];
    return v;
}
__device__ float dplc_column_max(float v, float* red) {
    const int col = threadIdx.x & 7, groups = blockDim.x >> 3;
    __syncthreads();
    red[threadIdx.x] = v;
    __syncthreads();
    v = __int_as_float(0xff800000);
    for (int g = 0; g < groups; ++g) v = fmaxf(v, red[g * 8 + col]);
    return v;
}
#endif
"#;

// Running sums (`Expr::Scan`), for the kernels that have one.
const SCAN: &str = r#"#ifndef DPLC_SCAN
#define DPLC_SCAN
// Inclusive running sum over the block's threads in order, plus `*carry`
// (the earlier tiles' total), which then grows by this tile's total.
__device__ float dplc_block_scan(float v, float* red, float* carry) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    for (int o = 1; o < 32; o <<= 1) {
        const float up = __shfl_up_sync(0xffffffffu, v, o);
        if (lane >= o) v += up;
    }
    __syncthreads();
    if (lane == 31) red[warp] = v;
    __syncthreads();
    float before = 0.0f, total = 0.0f;
    for (int w = 0; w < warps; ++w) {
        if (w < warp) before += red[w];
        total += red[w];
    }
    const float out = *carry + before + v;
    *carry += total;
    return out;
}
#endif
"#;

// Derivatives of the unary ops, for backward kernels (`Expr::UnaryGrad`).
const GRADS: &str = r#"#ifndef DPLC_GRADS
#define DPLC_GRADS
__device__ __forceinline__ float dplc_d_neg(float x) { return -1.0f; }
__device__ __forceinline__ float dplc_d_exp(float x) { return expf(x); }
__device__ __forceinline__ float dplc_d_log(float x) { return 1.0f / x; }
__device__ __forceinline__ float dplc_d_sqrt(float x) { return 0.5f / sqrtf(x); }
__device__ __forceinline__ float dplc_d_rsqrt(float x) { float r = rsqrtf(x); return -0.5f * r * r * r; }
__device__ __forceinline__ float dplc_d_recip(float x) { return -1.0f / (x * x); }
__device__ __forceinline__ float dplc_d_tanh(float x) { float t = tanhf(x); return 1.0f - t * t; }
__device__ __forceinline__ float dplc_d_sigmoid(float x) { float s = 1.0f / (1.0f + expf(-x)); return s * (1.0f - s); }
__device__ __forceinline__ float dplc_d_relu(float x) { return x > 0.0f ? 1.0f : 0.0f; }
__device__ __forceinline__ float dplc_d_gelu(float x) {
    return 0.5f * (1.0f + erff(x * 0.70710678118654752f)) + x * expf(-0.5f * x * x) * 0.3989422804014327f;
}
__device__ __forceinline__ float dplc_d_gelu_tanh(float x) {
    const float c = 0.7978845608028654f;
    float t = tanhf(c * (x + 0.044715f * x * x * x));
    return 0.5f * (1.0f + t) + 0.5f * x * (1.0f - t * t) * c * (1.0f + 3.0f * 0.044715f * x * x);
}
__device__ __forceinline__ float dplc_d_silu(float x) { float s = 1.0f / (1.0f + expf(-x)); return s * (1.0f + x * (1.0f - s)); }
__device__ __forceinline__ float dplc_d_sin(float x) { return cosf(x); }
__device__ __forceinline__ float dplc_d_cos(float x) { return -sinf(x); }
__device__ __forceinline__ float dplc_d_abs(float x) { return x > 0.0f ? 1.0f : (x < 0.0f ? -1.0f : 0.0f); }
__device__ __forceinline__ float dplc_d_floor(float x) { return 0.0f; }
#endif
"#;

pub(crate) const STORAGE_F32: &str = r#"#ifndef DPLC_STORAGE
#define DPLC_STORAGE
typedef float dplc_t;
__device__ __forceinline__ float dplc_ld(float x) { return x; }
__device__ __forceinline__ float dplc_st(float x) { return x; }
#endif
"#;

pub(crate) const STORAGE_BF16: &str = r#"#ifndef DPLC_STORAGE
#define DPLC_STORAGE
typedef unsigned short dplc_t;  // bf16 bits
__device__ __forceinline__ float dplc_ld(unsigned short h) { return __uint_as_float(((unsigned int)h) << 16); }
__device__ __forceinline__ unsigned short dplc_st(float f) {
    unsigned short h; asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(f)); return h;
}
#endif
"#;

pub(crate) const STORAGE_F16: &str = r#"#ifndef DPLC_STORAGE
#define DPLC_STORAGE
typedef unsigned short dplc_t;  // f16 bits
__device__ __forceinline__ float dplc_ld(unsigned short h) {
    float f; asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h)); return f;
}
__device__ __forceinline__ unsigned short dplc_st(float f) {
    unsigned short h; asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f)); return h;
}
#endif
"#;

// ---- emission --------------------------------------------------------------

fn storage_bytes(elem: Elem, dtype: DType) -> usize {
    match elem {
        Elem::Float => dtype.size_bytes() as usize,
        Elem::F32 | Elem::I32 => 4,
    }
}

fn vector_type(bytes: usize) -> &'static str {
    match bytes {
        16 => "uint4",
        8 => "uint2",
        4 => "unsigned int",
        _ => "unsigned short",
    }
}

fn elem_type(elem: Elem) -> &'static str {
    match elem {
        Elem::Float => "dplc_t",
        Elem::F32 => "float",
        Elem::I32 => "int",
    }
}

pub(crate) fn float_lit(c: f64) -> C {
    let f = c as f32;
    if f.is_nan() {
        call("__int_as_float", vec![C::Lit("0x7fffffff".into())])
    } else if f.is_infinite() {
        let bits = if f > 0.0 { "0x7f800000" } else { "0xff800000" };
        call("__int_as_float", vec![C::Lit(bits.into())])
    } else {
        let s = format!("{f:?}");
        let s = if s.contains(['.', 'e']) {
            s
        } else {
            format!("{s}.0")
        };
        if f < 0.0 {
            C::Neg(Box::new(C::Lit(format!("{}f", &s[1..]))))
        } else {
            C::Lit(format!("{s}f"))
        }
    }
}

pub(crate) fn size(s: Size) -> C {
    match s {
        Size::Const(n) => C::Lit(format!("{n}LL")),
        Size::Param(k) => id(format!("n{k}")),
    }
}

fn index(i: &Idx) -> C {
    index_with(i, &|a| id(format!("i{a}")))
}

/// `i` as C, outer index `Var(a)` written as `var(a)`: the fused
/// attention's whole-tensor places name their axes `b`, `hh`, `i`, `j`.
pub(crate) fn index_with(i: &Idx, var: &dyn Fn(usize) -> C) -> C {
    let ix = |x: &Idx| index_with(x, var);
    match i {
        Idx::Var(a) => var(*a),
        Idx::Inner => id("j"),
        Idx::Const(c) => C::Lit(format!("{c}LL")),
        Idx::Size(s) => size(*s),
        Idx::Add(a, b) => bin("+", ix(a), ix(b)),
        Idx::Sub(a, b) => bin("-", ix(a), ix(b)),
        Idx::Mul(a, b) => bin("*", ix(a), ix(b)),
        Idx::Div(a, b) => bin("/", ix(a), ix(b)),
        Idx::Rem(a, b) => bin("%", ix(a), ix(b)),
        Idx::Min(a, b) => call("dplc_imin", vec![ix(a), ix(b)]),
        Idx::Max(a, b) => call("dplc_imax", vec![ix(a), ix(b)]),
        Idx::Load(buf, i) => C::Cast("long long", Box::new(at(id(format!("b{buf}")), ix(i)))),
    }
}

fn vname(v: crate::kernel::ValueId) -> C {
    id(format!("v{}", v.0))
}

/// The varying index of a vectorised section and its lane count.
struct Lanes {
    /// `Idx::Var(a)` or `Idx::Inner`.
    var: Idx,
    count: usize,
}

struct Emit<'k> {
    k: &'k Kernel,
    dtype: DType,
}

impl Emit<'_> {
    fn value(&self, i: usize, loaded: &dyn Fn(usize) -> Option<C>) -> C {
        let v = |x: crate::kernel::ValueId| vname(x);
        match &self.k.values[i] {
            Expr::Load { buf, index: ix } => match loaded(i) {
                Some(c) => c,
                None => {
                    let raw = at(id(format!("b{buf}")), index(ix));
                    match self.k.buffers[*buf].elem {
                        Elem::Float => call("dplc_ld", vec![raw]),
                        Elem::F32 => raw,
                        Elem::I32 => C::Cast("float", Box::new(raw)),
                    }
                }
            },
            Expr::Const(c) => float_lit(*c),
            Expr::Scalar(k) => id(format!("s{k}")),
            Expr::FromIndex(ix) => C::Cast("float", Box::new(index(ix))),
            Expr::Unary(op, a) => {
                let f = match op {
                    UnaryOp::Neg => return C::Neg(Box::new(v(*a))),
                    UnaryOp::Exp => "expf",
                    UnaryOp::Log => "logf",
                    UnaryOp::Sqrt => "sqrtf",
                    UnaryOp::Rsqrt => "rsqrtf",
                    UnaryOp::Recip => return bin("/", C::Lit("1.0f".into()), v(*a)),
                    UnaryOp::Tanh => "tanhf",
                    UnaryOp::Sigmoid => "dplc_sigmoid",
                    UnaryOp::Relu => return call("fmaxf", vec![v(*a), C::Lit("0.0f".into())]),
                    UnaryOp::Gelu => "dplc_gelu",
                    UnaryOp::GeluTanh => "dplc_gelu_tanh",
                    UnaryOp::Silu => "dplc_silu",
                    UnaryOp::Sin => "sinf",
                    UnaryOp::Cos => "cosf",
                    UnaryOp::Abs => "fabsf",
                    UnaryOp::Floor => "floorf",
                };
                call(f, vec![v(*a)])
            }
            Expr::Binary(op, a, b) => match op {
                BinaryOp::Add => bin("+", v(*a), v(*b)),
                BinaryOp::Sub => bin("-", v(*a), v(*b)),
                BinaryOp::Mul => bin("*", v(*a), v(*b)),
                BinaryOp::Div => bin("/", v(*a), v(*b)),
                BinaryOp::Max => call("fmaxf", vec![v(*a), v(*b)]),
                BinaryOp::Min => call("fminf", vec![v(*a), v(*b)]),
                BinaryOp::Pow => call("powf", vec![v(*a), v(*b)]),
                cmp => {
                    let sym = match cmp {
                        BinaryOp::Lt => "<",
                        BinaryOp::Le => "<=",
                        BinaryOp::Gt => ">",
                        BinaryOp::Ge => ">=",
                        BinaryOp::Eq => "==",
                        _ => "!=",
                    };
                    C::Cond(
                        Box::new(bin(sym, v(*a), v(*b))),
                        Box::new(C::Lit("1.0f".into())),
                        Box::new(C::Lit("0.0f".into())),
                    )
                }
            },
            Expr::Select {
                cond,
                then,
                otherwise,
            } => {
                let c = match cond {
                    Cond::IdxLt(a, b) => bin("<", index(a), index(b)),
                    Cond::ValLt(a, b) => bin("<", v(*a), v(*b)),
                };
                C::Cond(Box::new(c), Box::new(v(*then)), Box::new(v(*otherwise)))
            }
            Expr::Random { key, index: ix } => call(
                "dplc_random",
                vec![
                    id("seed"),
                    C::Lit(format!("{}ULL", key.node)),
                    size(key.layer),
                    size(key.first_sample),
                    size(key.per_sample),
                    index(ix),
                ],
            ),
            Expr::UnaryGrad(op, a) => call(&format!("dplc_d_{}", op.name()), vec![v(*a)]),
            Expr::Reduce { .. } => unreachable!("reductions are emitted as block reductions"),
            // A thread past the row's end (the last tile's) adds nothing.
            Expr::Scan { value, .. } => call(
                "dplc_block_scan",
                vec![
                    C::Cond(
                        Box::new(id("in_row")),
                        Box::new(v(*value)),
                        Box::new(C::Lit("0.0f".into())),
                    ),
                    id("red"),
                    C::Ref(Box::new(id(format!("carry{i}")))),
                ],
            ),
        }
    }

    /// Base of a load or store that is contiguous in the lane variable and aligned.
    fn vector_base(&self, buf: usize, ix: &Idx, lanes: &Lanes) -> Option<Idx> {
        if self.k.buffers[buf].elem == Elem::I32 {
            return None;
        }
        let base = ix.contiguous_in(&lanes.var)?;
        base.multiple_of(lanes.count as i64).then_some(base)
    }

    /// Compute `values` (in order) and do `stores` for each lane of one step of
    /// the lane variable, optionally folding value `fold` into accumulator `acc`.
    fn section(
        &self,
        values: &[usize],
        stores: &[&Store],
        fold: Option<(RowReduce, usize)>,
        lanes: Option<&Lanes>,
    ) -> Vec<S> {
        let mut pre = Vec::new();
        let mut body = Vec::new();
        let mut post = Vec::new();
        let mut vector_loads: BTreeSet<usize> = BTreeSet::new();
        // The lane variable at lane 0: a vector access reads from `base + first`.
        let first = lanes.map(|l| match l.var {
            Idx::Inner => bin("*", id("jv"), C::Lit(format!("{}LL", l.count))),
            _ => id(format!("{}v", lanes_var_name(l))),
        });
        if let Some(l) = lanes {
            for &i in values {
                if let Expr::Load { buf, index: ix } = &self.k.values[i] {
                    if let Some(base) = self.vector_base(*buf, ix, l) {
                        let elem = self.k.buffers[*buf].elem;
                        let vt = vector_type(storage_bytes(elem, self.dtype) * l.count);
                        pre.push(S::Line(format!(
                            "__align__(16) {} l{i}[{}];",
                            elem_type(elem),
                            l.count
                        )));
                        pre.push(S::Line(format!(
                            "*reinterpret_cast<{vt}*>(l{i}) = *reinterpret_cast<const {vt}*>(b{buf} + {});",
                            bin("+", index(&base), first.clone().expect("lanes")).render()
                        )));
                        vector_loads.insert(i);
                    }
                }
            }
            body.push(decl(
                "long long",
                lanes_var_name(l),
                bin("+", first.clone().expect("lanes"), id("lane")),
            ));
        }
        let loaded = |i: usize| -> Option<C> {
            vector_loads.contains(&i).then(|| {
                let raw = at(id(format!("l{i}")), id("lane"));
                match self.k.values[i] {
                    Expr::Load { buf, .. } if self.k.buffers[buf].elem == Elem::Float => {
                        call("dplc_ld", vec![raw])
                    }
                    _ => raw,
                }
            })
        };
        for &i in values {
            body.push(decl("float", format!("v{i}"), self.value(i, &loaded)));
        }
        let computed = body.len();
        if let Some((kind, v)) = fold {
            let next = match kind {
                RowReduce::Sum => bin("+", id("acc"), id(format!("v{v}"))),
                RowReduce::Max => call("fmaxf", vec![id("acc"), id(format!("v{v}"))]),
            };
            body.push(S::Assign(id("acc"), next));
        }
        for (n, st) in stores.iter().enumerate() {
            let elem = self.k.buffers[st.buf].elem;
            let conv = |v: C| match elem {
                Elem::Float => call("dplc_st", vec![v]),
                Elem::F32 => v,
                Elem::I32 => C::Cast("int", Box::new(v)),
            };
            // Accumulating stores are atomic adds, one element at a time.
            let vector = lanes
                .filter(|_| !st.accumulate)
                .and_then(|l| self.vector_base(st.buf, &st.index, l).map(|b| (l, b)));
            match vector {
                None if st.accumulate => {
                    let target = C::Ref(Box::new(at(id(format!("b{}", st.buf)), index(&st.index))));
                    let add = call("atomicAdd", vec![target, vname(st.value)]);
                    body.push(S::Line(format!("{};", add.render())));
                }
                Some((l, base)) => {
                    let vt = vector_type(storage_bytes(elem, self.dtype) * l.count);
                    pre.push(S::Line(format!(
                        "__align__(16) {} o{n}[{}];",
                        elem_type(elem),
                        l.count
                    )));
                    body.push(S::Assign(
                        at(id(format!("o{n}")), id("lane")),
                        conv(vname(st.value)),
                    ));
                    post.push(S::Line(format!(
                        "*reinterpret_cast<{vt}*>(b{} + {}) = *reinterpret_cast<const {vt}*>(o{n});",
                        st.buf,
                        bin("+", index(&base), first.clone().expect("lanes")).render()
                    )));
                }
                None => body.push(S::Assign(
                    at(id(format!("b{}", st.buf)), index(&st.index)),
                    conv(vname(st.value)),
                )),
            }
        }
        // In a running sum's tile loop every thread computes (its scan needs
        // the whole block), but only those on the row fold and store.
        if values
            .iter()
            .any(|&i| matches!(self.k.values[i], Expr::Scan { .. }))
        {
            let tail = body.split_off(computed);
            body.push(S::If(id("in_row"), tail));
        }
        match lanes {
            Some(l) => {
                let mut out = pre;
                out.push(S::Line("#pragma unroll".into()));
                out.push(S::For {
                    var: "lane".into(),
                    from: C::Lit("0".into()),
                    to: C::Lit(format!("{}", l.count)),
                    step: C::Lit("1".into()),
                    body,
                });
                out.extend(post);
                out
            }
            None => body,
        }
    }

    /// Values (in SSA order) that `roots` need and that vary along the row.
    fn along_deps(&self, roots: &[usize], along: &[bool]) -> Vec<usize> {
        let mut need = BTreeSet::new();
        let mut stack: Vec<usize> = roots.iter().copied().filter(|&r| along[r]).collect();
        while let Some(i) = stack.pop() {
            if !need.insert(i) {
                continue;
            }
            for d in operands(&self.k.values[i]) {
                if along[d] {
                    stack.push(d);
                }
            }
        }
        need.into_iter().collect()
    }

    /// Whether this row kernel's rows are columns in memory: it stores only
    /// per row, and every load along its rows steps by one from row to
    /// neighbouring row (the last outer axis) and not along the row. A
    /// column sum is one; it runs as [`LaunchShape::Columns`].
    fn reads_columns(&self, along: &[bool]) -> bool {
        let k = self.k;
        let Some(last) = k.space.outer.len().checked_sub(1) else {
            return false;
        };
        if k.stores
            .iter()
            .any(|s| along[s.value.0 as usize] || s.index.uses_inner())
        {
            return false;
        }
        let mut loads = k.values.iter().enumerate().filter_map(|(i, v)| match v {
            Expr::Load { index, .. } if along[i] => Some(index),
            _ => None,
        });
        let across = |ix: &Idx| {
            ix.contiguous_in(&Idx::Inner).is_none() && ix.contiguous_in(&Idx::Var(last)).is_some()
        };
        let mut any = false;
        loads.all(|ix| {
            any = true;
            across(ix)
        }) && any
    }

    /// How many lanes a thread handles along `extent` (1 when not divisible).
    fn lane_count(&self, extent: Option<Size>) -> usize {
        let widest = self
            .k
            .buffers
            .iter()
            .filter(|b| b.elem != Elem::I32)
            .map(|b| storage_bytes(b.elem, self.dtype))
            .max()
            .unwrap_or(4);
        let lanes = 16 / widest;
        match extent {
            Some(Size::Const(n)) if n % lanes as i64 == 0 && lanes > 1 => lanes,
            _ => 1,
        }
    }
}

/// The row walked in tiles of one element a thread, every thread of the
/// block in every tile (the scan is a block-wide exchange): tile `jb`'s
/// thread `t` is at `j = jb + t` (from the row's end when `reverse`), its
/// scans add the running `carry{i}` of the earlier tiles, and a thread past
/// the end computes at `j = 0` but adds nothing and stores nothing.
fn scan_tiles(scans: &[usize], reverse: bool, len: Size, section: Vec<S>) -> S {
    let mut block: Vec<S> = scans
        .iter()
        .map(|i| var("float", format!("carry{i}"), Some(C::Lit("0.0f".into()))))
        .collect();
    let at = if reverse {
        bin("-", bin("-", size(len), C::Lit("1LL".into())), id("jt"))
    } else {
        id("jt")
    };
    let mut body = vec![
        decl(
            "long long",
            "jt",
            bin(
                "+",
                id("jb"),
                C::Cast("long long", Box::new(id("threadIdx.x"))),
            ),
        ),
        decl("bool", "in_row", bin("<", id("jt"), size(len))),
        decl(
            "long long",
            "j",
            C::Cond(
                Box::new(id("in_row")),
                Box::new(at),
                Box::new(C::Lit("0LL".into())),
            ),
        ),
    ];
    body.extend(section);
    block.push(S::For {
        var: "jb".into(),
        from: C::Lit("0LL".into()),
        to: size(len),
        step: C::Cast("long long", Box::new(id("blockDim.x"))),
        body,
    });
    S::Block(block)
}

fn lanes_var_name(l: &Lanes) -> String {
    match l.var {
        Idx::Inner => "j".into(),
        Idx::Var(a) => format!("i{a}"),
        _ => unreachable!("lanes run along an index variable"),
    }
}

fn operands(e: &Expr) -> Vec<usize> {
    match e {
        Expr::Unary(_, a) => vec![a.0 as usize],
        Expr::Binary(_, a, b) => vec![a.0 as usize, b.0 as usize],
        Expr::Select {
            cond,
            then,
            otherwise,
        } => {
            let mut v = vec![then.0 as usize, otherwise.0 as usize];
            if let Cond::ValLt(a, b) = cond {
                v.extend([a.0 as usize, b.0 as usize]);
            }
            v
        }
        Expr::Reduce { value, .. } | Expr::Scan { value, .. } => vec![value.0 as usize],
        Expr::UnaryGrad(_, a) => vec![a.0 as usize],
        _ => vec![],
    }
}

/// `{op}_{dtype}_{hash8}`: the hash covers the kernel IR and the storage type.
pub fn kernel_name(k: &Kernel, dtype: DType) -> String {
    let h = crate::kernel::fnv1a(format!("{}\n{}", dtype.name(), k.text()).as_bytes());
    format!(
        "{}_{}_{:08x}",
        k.op,
        dtype.name(),
        (h >> 32) as u32 ^ h as u32
    )
}

/// Decompose `flat` into the outer variables `i0..` (row-major over `outer`).
/// With `lanes`, the last variable steps by that many: `i{last}v` is the first
/// of the thread's lanes and the lane loop declares `i{last}` itself.
fn decompose(flat: &str, outer: &[Size], lanes: Option<usize>) -> Vec<S> {
    let mut out = Vec::new();
    if outer.is_empty() {
        return out;
    }
    out.push(var("long long", "rest", Some(id(flat))));
    let last = outer.len() - 1;
    for a in (0..outer.len()).rev() {
        let scaled = lanes.filter(|_| a == last);
        let extent = match (scaled, outer[a]) {
            (Some(l), Size::Const(n)) => C::Lit(format!("{}LL", n / l as i64)),
            (_, s) => size(s),
        };
        let mut value = if a == 0 {
            id("rest")
        } else {
            bin("%", id("rest"), extent.clone())
        };
        let mut name = format!("i{a}");
        if let Some(l) = scaled {
            value = bin("*", value, C::Lit(format!("{l}LL")));
            name.push('v');
        }
        out.push(decl("long long", name, value));
        if a != 0 {
            out.push(S::Assign(id("rest"), bin("/", id("rest"), extent)));
        }
    }
    out
}

/// Emit CUDA C for `kernel` with float buffers stored as `dtype`.
pub fn emit_cuda(kernel: &Kernel, dtype: DType) -> CudaSource {
    let name = kernel_name(kernel, dtype);
    let e = Emit { k: kernel, dtype };
    let along = kernel.along_row();
    let mut params = Vec::new();
    for (i, b) in kernel.buffers.iter().enumerate() {
        let c = if b.output { "" } else { "const " };
        params.push(format!("{c}{}* __restrict__ b{i}", elem_type(b.elem)));
    }
    params.extend((0..kernel.sizes).map(|k| format!("long long n{k}")));
    params.extend((0..kernel.scalars).map(|k| format!("float s{k}")));
    if kernel.uses_random() {
        params.push("unsigned long long seed".into());
    }
    // Fusion and backward write running sums of one direction only
    // (`backward` refuses a kernel that would need both).
    let scan = kernel
        .scan_direction()
        .expect("generated kernels scan in one direction");
    let mut body = Vec::new();
    let launch;
    match kernel.space.inner {
        None => {
            let outer = &kernel.space.outer;
            let lanes = e.lane_count(outer.last().copied());
            launch = LaunchShape::Elementwise {
                vector: lanes as u32,
            };
            let mut total = C::Lit("1LL".into());
            for (a, &s) in outer.iter().enumerate() {
                let s = match (a + 1 == outer.len(), s) {
                    (true, Size::Const(n)) if lanes > 1 => {
                        C::Lit(format!("{}LL", n / lanes as i64))
                    }
                    (_, s) => size(s),
                };
                total = if a == 0 { s } else { bin("*", total, s) };
            }
            body.push(decl("long long", "total", total));
            body.push(decl(
                "long long",
                "stride",
                bin(
                    "*",
                    C::Cast("long long", Box::new(id("gridDim.x"))),
                    id("blockDim.x"),
                ),
            ));
            let mut inner = decompose("flat", outer, (lanes > 1).then_some(lanes));
            let values: Vec<usize> = (0..kernel.values.len()).collect();
            let stores: Vec<&Store> = kernel.stores.iter().collect();
            let l = Lanes {
                var: Idx::Var(outer.len().saturating_sub(1)),
                count: lanes,
            };
            inner.extend(e.section(&values, &stores, None, (lanes > 1).then_some(&l)));
            body.push(S::For {
                var: "flat".into(),
                from: bin(
                    "+",
                    bin(
                        "*",
                        C::Cast("long long", Box::new(id("blockIdx.x"))),
                        id("blockDim.x"),
                    ),
                    id("threadIdx.x"),
                ),
                to: id("total"),
                step: id("stride"),
                body: inner,
            });
        }
        Some(inner_size) => {
            // A running sum walks the row in tiles of one element a thread.
            let lanes = match scan {
                Some(_) => 1,
                None => e.lane_count(Some(inner_size)),
            };
            // Rows that are columns in memory go side by side; a narrow row
            // of a fixed width is a warp's; a wide one, or one with a
            // running sum (a block-wide exchange), a block's.
            let columns = scan.is_none() && e.reads_columns(&along);
            let lanes = if columns { 1 } else { lanes };
            let warp_row = !columns
                && scan.is_none()
                && matches!(inner_size, Size::Const(c) if c / lanes as i64 <= WARP_ROW_VECTORS);
            launch = if columns {
                LaunchShape::Columns {
                    block: COLUMN_BLOCK,
                }
            } else if warp_row {
                LaunchShape::WarpRows { block: ROW_BLOCK }
            } else {
                LaunchShape::Rows { block: ROW_BLOCK }
            };
            // Who walks a row: a warp's lanes, a column's group of threads,
            // or the block's threads.
            let (in_row, row_threads) = if warp_row {
                (id("dplc_lane"), C::Lit("32LL".into()))
            } else if columns {
                (id("dplc_first"), id("dplc_groups"))
            } else {
                (
                    C::Cast("long long", Box::new(id("threadIdx.x"))),
                    C::Cast("long long", Box::new(id("blockDim.x"))),
                )
            };
            let l = Lanes {
                var: Idx::Inner,
                count: lanes,
            };
            let outer = &kernel.space.outer;
            let mut rows = C::Lit("1LL".into());
            for (a, &s) in outer.iter().enumerate() {
                rows = if a == 0 {
                    size(s)
                } else {
                    bin("*", rows, size(s))
                };
            }
            if warp_row {
                body.push(S::Line(
                    "const long long dplc_lane = threadIdx.x & 31;".into(),
                ));
                body.push(S::Line(
                    "const long long dplc_warps = blockDim.x >> 5, dplc_warp = threadIdx.x >> 5;"
                        .into(),
                ));
            } else if columns {
                body.push(S::Line(format!("__shared__ float red[{COLUMN_BLOCK}];")));
                body.push(S::Line(format!(
                    "const long long dplc_col = threadIdx.x % {COLUMN_TILE}, \
                     dplc_group = threadIdx.x / {COLUMN_TILE}, \
                     dplc_groups = blockDim.x / {COLUMN_TILE};"
                )));
            } else {
                body.push(S::Line("__shared__ float red[32];".into()));
            }
            body.push(decl("long long", "rows", rows));
            let mut row = Vec::new();
            if columns {
                // Every thread goes through every reduction's barriers: one
                // past the last row computes the last row's values and
                // walks and stores nothing.
                row.push(S::Line(format!(
                    "const long long dplc_row = tile * {COLUMN_TILE} + dplc_col;"
                )));
                row.push(S::Line("const bool dplc_live = dplc_row < rows;".into()));
                row.push(S::Line(
                    "const long long row = dplc_live ? dplc_row : rows - 1;".into(),
                ));
                row.push(decl(
                    "long long",
                    "dplc_first",
                    C::Cond(
                        Box::new(id("dplc_live")),
                        Box::new(id("dplc_group")),
                        Box::new(size(inner_size)),
                    ),
                ));
            }
            row.extend(decompose("row", outer, None));
            let mut done = vec![false; kernel.values.len()];
            let j_loop = |deps: &[usize], section: Vec<S>| {
                let scans: Vec<usize> = deps
                    .iter()
                    .copied()
                    .filter(|&i| matches!(kernel.values[i], Expr::Scan { .. }))
                    .collect();
                if let (false, Some(reverse)) = (scans.is_empty(), scan) {
                    return scan_tiles(&scans, reverse, inner_size, section);
                }
                let to = match (lanes, inner_size) {
                    (1, s) => size(s),
                    (n, Size::Const(c)) => C::Lit(format!("{}LL", c / n as i64)),
                    _ => unreachable!("lanes need a fixed row"),
                };
                let walk = S::For {
                    var: if lanes > 1 { "jv".into() } else { "j".into() },
                    from: in_row.clone(),
                    to,
                    step: row_threads.clone(),
                    body: section,
                };
                // Unrolled, a thread's loads along the row are in flight
                // together: a load feeding the running reduction otherwise
                // waits out its latency before the next is issued. Not
                // where the row draws dropout: four draws at once (64-bit
                // hashing) cost more than they hide. On the H200 unrolling
                // took a column sum from 468 to 62 µs and the layernorms
                // 3–8% faster, and the dropout layernorm backward from 804
                // to 1,391 µs.
                if columns || !kernel.uses_random() {
                    S::Block(vec![S::Line("#pragma unroll 4".into()), walk])
                } else {
                    walk
                }
            };
            let lanes_ref = (lanes > 1).then_some(&l);
            let row_values = |upto: usize, done: &mut Vec<bool>, out: &mut Vec<S>| {
                for i in 0..upto {
                    if !done[i] && !along[i] && !matches!(kernel.values[i], Expr::Reduce { .. }) {
                        done[i] = true;
                        out.push(decl("float", format!("v{i}"), e.value(i, &|_| None)));
                    }
                }
            };
            for (i, v) in kernel.values.iter().enumerate() {
                let Expr::Reduce { kind, value } = v else {
                    continue;
                };
                row_values(i, &mut done, &mut row);
                let deps = e.along_deps(&[value.0 as usize], &along);
                let init = match kind {
                    RowReduce::Sum => C::Lit("0.0f".into()),
                    RowReduce::Max => float_lit(f64::NEG_INFINITY),
                };
                let mut block = vec![var("float", "acc", Some(init))];
                block.push(j_loop(
                    &deps,
                    e.section(&deps, &[], Some((*kind, value.0 as usize)), lanes_ref),
                ));
                let reduced = match (kind, warp_row, columns) {
                    (RowReduce::Sum, true, _) => call("dplc_warp_sum", vec![id("acc")]),
                    (RowReduce::Max, true, _) => call("dplc_warp_max", vec![id("acc")]),
                    (RowReduce::Sum, _, true) => {
                        call("dplc_column_sum", vec![id("acc"), id("red")])
                    }
                    (RowReduce::Max, _, true) => {
                        call("dplc_column_max", vec![id("acc"), id("red")])
                    }
                    (RowReduce::Sum, ..) => call("dplc_block_sum", vec![id("acc"), id("red")]),
                    (RowReduce::Max, ..) => call("dplc_block_max", vec![id("acc"), id("red")]),
                };
                block.push(S::Assign(id(format!("v{i}")), reduced));
                row.push(var("float", format!("v{i}"), None));
                row.push(S::Block(block));
                done[i] = true;
            }
            row_values(kernel.values.len(), &mut done, &mut row);
            let (elem_stores, row_stores): (Vec<&Store>, Vec<&Store>) = kernel
                .stores
                .iter()
                .partition(|s| along[s.value.0 as usize] || s.index.uses_inner());
            if !elem_stores.is_empty() {
                let roots: Vec<usize> = elem_stores.iter().map(|s| s.value.0 as usize).collect();
                let deps = e.along_deps(&roots, &along);
                row.push(j_loop(
                    &deps,
                    e.section(&deps, &elem_stores, None, lanes_ref),
                ));
            }
            if !row_stores.is_empty() {
                let stores = e.section(&[], &row_stores, None, None);
                let first_of_row = if columns {
                    bin(
                        "&&",
                        id("dplc_live"),
                        bin("==", id("dplc_group"), C::Lit("0".into())),
                    )
                } else {
                    bin("==", in_row.clone(), C::Lit("0".into()))
                };
                row.push(S::If(first_of_row, stores));
            }
            let block_index = C::Cast("long long", Box::new(id("blockIdx.x")));
            let blocks = C::Cast("long long", Box::new(id("gridDim.x")));
            if columns {
                body.push(decl(
                    "long long",
                    "tiles",
                    C::Lit(format!("(rows + {}) / {COLUMN_TILE}", COLUMN_TILE - 1)),
                ));
                body.push(S::For {
                    var: "tile".into(),
                    from: block_index,
                    to: id("tiles"),
                    step: blocks,
                    body: row,
                });
            } else {
                let (first, step) = if warp_row {
                    (
                        bin(
                            "+",
                            bin("*", block_index, id("dplc_warps")),
                            id("dplc_warp"),
                        ),
                        bin("*", blocks, id("dplc_warps")),
                    )
                } else {
                    (block_index, blocks)
                };
                body.push(S::For {
                    var: "row".into(),
                    from: first,
                    to: id("rows"),
                    step,
                    body: row,
                });
            }
        }
    }
    let mut w = Writer::with_prelude(dtype);
    if kernel.is_row_kernel() {
        w.out.push_str(REDUCE);
    }
    if matches!(launch, LaunchShape::Columns { .. }) {
        w.out.push_str(COLUMNS);
    }
    if scan.is_some() {
        w.out.push_str(SCAN);
    }
    if kernel
        .values
        .iter()
        .any(|e| matches!(e, Expr::UnaryGrad(..)))
    {
        w.out.push_str(GRADS);
    }
    w.line("");
    for l in kernel.text().lines() {
        w.line(&format!("// {l}"));
    }
    let bounds = if kernel.is_row_kernel() {
        let block = match launch {
            LaunchShape::Columns { block } => block,
            _ => ROW_BLOCK,
        };
        format!("__launch_bounds__({block}) ")
    } else {
        String::new()
    };
    w.line(&format!("extern \"C\" __global__ void {bounds}{name}("));
    w.depth += 1;
    for (i, p) in params.iter().enumerate() {
        let sep = if i + 1 == params.len() { ") {" } else { "," };
        w.line(&format!("{p}{sep}"));
    }
    w.stmts(&body);
    w.depth -= 1;
    w.line("}");
    CudaSource {
        name,
        source: w.out,
        launch,
    }
}
