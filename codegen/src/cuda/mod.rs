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
    /// One block of `block` threads per `items` consecutive points: a pass
    /// whose blocks each take several of the items its launch counts (a
    /// wider fused-attention forward, [`crate::emit_attention_forward`]).
    Tiles { block: u32, items: u32 },
}

impl LaunchShape {
    /// The blocks and threads a block of a launch over `outer` points (rows,
    /// items) on a device of `multiprocessors`: an elementwise launch at
    /// most 32 blocks a multiprocessor, striding over the rest; the others
    /// a block per row, item or tile, up to 65,536 blocks (or 32 a
    /// multiprocessor where that is more), their blocks striding past it.
    pub fn grid(self, outer: u64, multiprocessors: u32) -> (u64, u32) {
        let cap = u64::from(multiprocessors.max(1)) * 32;
        let per_block = |blocks: u64| blocks.clamp(1, cap.max(1 << 16));
        match self {
            LaunchShape::Elementwise { vector } => {
                let threads = outer.div_ceil(u64::from(vector.max(1)));
                (threads.div_ceil(256).clamp(1, cap), 256)
            }
            LaunchShape::Rows { block } => (per_block(outer), block),
            LaunchShape::Tiles { block, items } => {
                (per_block(outer.div_ceil(u64::from(items.max(1)))), block)
            }
            LaunchShape::Columns { block } => {
                (per_block(outer.div_ceil(u64::from(COLUMN_TILE))), block)
            }
            LaunchShape::WarpRows { block } => (
                per_block(outer.div_ceil(u64::from(block / 32).max(1))),
                block,
            ),
        }
    }
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
    /// Dynamic shared memory each block takes, in bytes (0: the kernel's
    /// shared arrays, if any, are static). Past 48 KB the launcher must
    /// first raise the function's limit, as CUDA requires.
    pub shared_bytes: u32,
}

mod prelude;
mod rows;
mod syntax;

use prelude::{COLUMNS, GRADS, REDUCE, SCAN};
pub(crate) use syntax::{at, bin, call, decl, grid_thread, id, var, Writer, C, S};

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

/// What a walk along the row folds into its accumulators.
#[derive(Clone, Copy, Debug)]
pub(super) enum Fold {
    /// `acc` combines value `v` by the reduction.
    Row(RowReduce, usize),
    /// `acc` runs the maximum of value `x` and `accs` the sum of
    /// `exp(x − acc)` beside it, rescaled as the maximum grows: a softmax's
    /// two statistics in one walk of the row instead of two.
    MaxSum(usize),
}

/// The varying index of a vectorised section and its lane count.
struct Lanes {
    /// `Idx::Var(a)` or `Idx::Inner`.
    var: Idx,
    count: usize,
    /// A row whose length is no multiple of `count`: every access along it
    /// starts at this same base, and the walk starts `dplc_head` elements
    /// in, where `base + dplc_head` is aligned (`rows::row_kernel`).
    phased: Option<Idx>,
}

#[derive(Clone, Copy)]
struct Emit<'k> {
    k: &'k Kernel,
    dtype: DType,
    /// A row kernel: a draw whose index runs along the row with `j` reads
    /// its sample's key state and position from the row's preamble
    /// ([`Emit::row_draws`]) instead of the per-element `dplc_random`.
    rows: bool,
    /// Threads of a block that walks one row ([`LaunchShape::Rows`]).
    row_block: u32,
}

impl Emit<'_> {
    /// A row kernel's preamble for each draw whose index runs along the row
    /// (`base + j`): the row's sample key state `dplc_ds{i}`, the position
    /// of its first element `dplc_dp{i}`, and whether the whole row lies in
    /// that sample `dplc_dok{i}`; and `dplc_rows_ok`, all of them, which
    /// the caller tests once a row (`None` without such a draw): where it
    /// holds the draws read the preamble, one division a row where each
    /// element had divided and no branch along the row, so a thread's
    /// draws overlap; where it does not (a row spanning two samples) each
    /// element splits its own index (`dplc_random`).
    fn row_draws(&self, row_len: Size) -> (Vec<S>, Option<C>) {
        let mut out = Vec::new();
        let mut oks = Vec::new();
        for (i, v) in self.k.values.iter().enumerate() {
            let Expr::Random { key, index: ix } = v else {
                continue;
            };
            let Some(base) = ix.contiguous_in(&Idx::Inner) else {
                continue;
            };
            let n = |what: &str| format!("dplc_{what}{i}");
            let per = size(key.per_sample);
            let split = bin(">", id(n("per")), C::Lit("0LL".into()));
            out.extend([
                decl("long long", n("per"), per),
                decl("long long", n("base"), index(&base)),
                decl(
                    "long long",
                    n("q"),
                    C::Cond(
                        Box::new(split.clone()),
                        Box::new(bin("/", id(n("base")), id(n("per")))),
                        Box::new(C::Lit("0LL".into())),
                    ),
                ),
                decl(
                    "long long",
                    n("r"),
                    bin("-", id(n("base")), bin("*", id(n("q")), id(n("per")))),
                ),
                decl(
                    "bool",
                    n("dok"),
                    bin(
                        "||",
                        bin("<=", id(n("per")), C::Lit("0LL".into())),
                        bin("<=", bin("+", id(n("r")), size(row_len)), id(n("per"))),
                    ),
                ),
                decl(
                    "unsigned long long",
                    n("ds"),
                    call(
                        "dplc_sample_state",
                        vec![
                            id("seed"),
                            C::Lit(format!("{}ULL", key.node)),
                            size(key.layer),
                            C::Cond(
                                Box::new(split),
                                Box::new(C::Cast(
                                    "unsigned long long",
                                    Box::new(bin("+", size(key.first_sample), id(n("q")))),
                                )),
                                Box::new(C::Lit("~0ULL".into())),
                            ),
                        ],
                    ),
                ),
                decl(
                    "unsigned long long",
                    n("dp"),
                    C::Cast("unsigned long long", Box::new(id(n("r")))),
                ),
            ]);
            oks.push(id(n("dok")));
        }
        let all = oks.into_iter().reduce(|a, b| bin("&&", a, b));
        let ok = all.map(|all| {
            out.push(decl("bool", "dplc_rows_ok", all));
            id("dplc_rows_ok")
        });
        (out, ok)
    }

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
            Expr::Random { key, index: ix } => {
                if let Some(drawn) = loaded(i) {
                    return drawn;
                }
                let any = call(
                    "dplc_random",
                    vec![
                        id(draws_memo(i)),
                        id("seed"),
                        C::Lit(format!("{}ULL", key.node)),
                        size(key.layer),
                        size(key.first_sample),
                        size(key.per_sample),
                        index(ix),
                    ],
                );
                if !self.rows || ix.contiguous_in(&Idx::Inner).is_none() {
                    return any;
                }
                // The row's sample and position (the row lies in one sample).
                call(
                    "dplc_sample_draw",
                    vec![
                        id(format!("dplc_ds{i}")),
                        bin(
                            "+",
                            id(format!("dplc_dp{i}")),
                            C::Cast("unsigned long long", Box::new(id("j"))),
                        ),
                    ],
                )
            }
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
        match &lanes.phased {
            Some(phased) => (base == *phased).then_some(base),
            None => base.multiple_of(lanes.count as i64).then_some(base),
        }
    }

    /// Compute `values` (in order) and do `stores` for each lane of one step of
    /// the lane variable, optionally folding value `fold` into accumulator `acc`.
    fn section(
        &self,
        values: &[usize],
        stores: &[&Store],
        fold: Option<Fold>,
        lanes: Option<&Lanes>,
    ) -> Vec<S> {
        let mut pre = Vec::new();
        let mut body = Vec::new();
        let mut post = Vec::new();
        let mut vector_loads: BTreeSet<usize> = BTreeSet::new();
        // The lane variable at lane 0: a vector access reads from `base + first`.
        let first = lanes.map(|l| match l.var {
            Idx::Inner if l.phased.is_some() => bin(
                "+",
                id("dplc_head"),
                bin("*", id("jv"), C::Lit(format!("{}LL", l.count))),
            ),
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
        // A vector's dropout draws, where the row's sample is hoisted: the
        // lanes' neighbouring positions drawn two at a time (one mix for a
        // pair whose first position is even; `dplc_sample_draw2`).
        let mut vector_draws: BTreeSet<usize> = BTreeSet::new();
        if let Some(l) = lanes.filter(|l| self.rows && l.var == Idx::Inner && l.count % 2 == 0) {
            for &i in values {
                let Expr::Random { index: ix, .. } = &self.k.values[i] else {
                    continue;
                };
                if ix.contiguous_in(&Idx::Inner).is_none() {
                    continue;
                }
                pre.push(S::Line(format!("float dplc_u{i}[{}];", l.count)));
                for p in (0..l.count).step_by(2) {
                    let pos = bin(
                        "+",
                        id(format!("dplc_dp{i}")),
                        C::Cast(
                            "unsigned long long",
                            Box::new(bin(
                                "+",
                                first.clone().expect("lanes"),
                                C::Lit(format!("{p}LL")),
                            )),
                        ),
                    );
                    pre.push(S::Line(format!(
                        "dplc_sample_draw2(dplc_ds{i}, {}, dplc_u{i}[{p}], dplc_u{i}[{}]);",
                        pos.render(),
                        p + 1
                    )));
                }
                vector_draws.insert(i);
            }
        }
        let loaded = |i: usize| -> Option<C> {
            if vector_draws.contains(&i) {
                return Some(at(id(format!("dplc_u{i}")), id("lane")));
            }
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
        match fold {
            Some(Fold::Row(kind, v)) => {
                let next = match kind {
                    RowReduce::Sum => bin("+", id("acc"), id(format!("v{v}"))),
                    RowReduce::Max => call("fmaxf", vec![id("acc"), id(format!("v{v}"))]),
                };
                body.push(S::Assign(id("acc"), next));
            }
            // A vector's elements fold together (`post`), one at a time else.
            Some(Fold::MaxSum(x)) => match lanes {
                Some(l) => {
                    pre.push(S::Line(format!("float dplc_xs[{}];", l.count)));
                    body.push(S::Assign(
                        at(id("dplc_xs"), id("lane")),
                        id(format!("v{x}")),
                    ));
                    post.push(S::Line("dplc_max_sum(acc, accs, dplc_xs);".into()));
                }
                None => body.push(S::Line(format!("dplc_max_sum(acc, accs, v{x});"))),
            },
            None => {}
        }
        for (n, st) in stores.iter().enumerate() {
            let elem = self.k.buffers[st.buf].elem;
            let conv = |v: C| match elem {
                Elem::Float => call("dplc_st", vec![v]),
                Elem::F32 => v,
                Elem::I32 => C::Cast("int", Box::new(v)),
            };
            let vector = lanes.and_then(|l| self.vector_base(st.buf, &st.index, l).map(|b| (l, b)));
            match vector {
                // Accumulating stores are atomic adds: four `f32` at a time
                // where the GPU has the vector form (sm_90), else one at a
                // time. On the H200 the vector form took GPT-2's embedding
                // backward from 272.7 to 106.6 µs.
                Some((l, base)) if st.accumulate && elem == Elem::F32 && l.count % 4 == 0 => {
                    pre.push(S::Line(format!("float o{n}[{}];", l.count)));
                    body.push(S::Assign(
                        at(id(format!("o{n}")), id("lane")),
                        vname(st.value),
                    ));
                    let at_lane = |lane: String| {
                        format!(
                            "b{} + {} + {lane}",
                            st.buf,
                            bin("+", index(&base), first.clone().expect("lanes")).render()
                        )
                    };
                    post.push(S::Line("#if __CUDA_ARCH__ >= 900".into()));
                    for q in (0..l.count).step_by(4) {
                        post.push(S::Line(format!(
                            "atomicAdd(reinterpret_cast<float4*>({}), make_float4(o{n}[{q}], o{n}[{}], o{n}[{}], o{n}[{}]));",
                            at_lane(format!("{q}")),
                            q + 1,
                            q + 2,
                            q + 3
                        )));
                    }
                    post.push(S::Line("#else".into()));
                    post.push(S::Line(format!(
                        "for (int q = 0; q < {}; q++) atomicAdd({}, o{n}[q]);",
                        l.count,
                        at_lane("q".into())
                    )));
                    post.push(S::Line("#endif".into()));
                }
                None | Some(_) if st.accumulate => {
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

    /// Storage bytes of the widest float buffer read or written along the
    /// axis `along`: the one a 16-byte vector of lanes is sized by (a
    /// buffer indexed by the row alone, such as row statistics, does not
    /// narrow the row's vectors).
    fn widest_along(&self, along: &Idx) -> Option<usize> {
        let k = self.k;
        let walks =
            |b: usize| {
                k.values.iter().any(
                |e| matches!(e, Expr::Load { buf, index } if *buf == b && index.mentions(along)),
            ) || k.stores.iter().any(|st| st.buf == b && st.index.mentions(along))
            };
        k.buffers
            .iter()
            .enumerate()
            .filter(|&(i, b)| b.elem != Elem::I32 && walks(i))
            .map(|(_, b)| storage_bytes(b.elem, self.dtype))
            .max()
    }

    /// How many lanes a thread handles along `extent`, the axis `along`
    /// (1 when not divisible): a 16-byte vector of [`Self::widest_along`].
    fn lane_count(&self, extent: Option<Size>, along: &Idx) -> usize {
        let widest = self.widest_along(along).unwrap_or(4);
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

/// The name of draw site `i`'s memo (a `dplc_draws` a thread).
fn draws_memo(i: usize) -> String {
    format!("dplc_rng{i}")
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
    emit_cuda_rows_of(kernel, dtype, ROW_BLOCK)
}

/// [`emit_cuda`] with `row_block` threads to a block that walks one row
/// (a wide row's kernel; the others as `emit_cuda` makes them). The H200
/// run of 2026-11-27 timed every such kernel at 512 and 1,024 threads too:
/// none was faster than at [`ROW_BLOCK`] (bench/RESULTS.md), so fewer rows
/// in flight do not bring a row's second walk into L2; the walk went
/// instead ([`crate::with_row_stats`]).
fn emit_cuda_rows_of(kernel: &Kernel, dtype: DType, row_block: u32) -> CudaSource {
    let name = kernel_name(kernel, dtype);
    let e = Emit {
        k: kernel,
        dtype,
        rows: kernel.space.inner.is_some(),
        row_block,
    };
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
    // Each draw site's memo of its key, per thread (`dplc_random`).
    for (i, v) in kernel.values.iter().enumerate() {
        if matches!(v, Expr::Random { .. }) {
            body.push(S::Line(format!("dplc_draws {} = {{}};", draws_memo(i))));
        }
    }
    let launch;
    match kernel.space.inner {
        None => {
            let outer = &kernel.space.outer;
            let along = Idx::Var(outer.len().saturating_sub(1));
            let lanes = e.lane_count(outer.last().copied(), &along);
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
                phased: None,
            };
            inner.extend(e.section(&values, &stores, None, (lanes > 1).then_some(&l)));
            body.push(S::For {
                var: "flat".into(),
                from: grid_thread(),
                to: id("total"),
                step: id("stride"),
                body: inner,
            });
        }
        Some(inner_size) => {
            let (rows, shape) = rows::row_kernel(&e, &along, scan, inner_size);
            body.extend(rows);
            launch = shape;
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
            LaunchShape::Columns { block }
            | LaunchShape::Rows { block }
            | LaunchShape::WarpRows { block }
            | LaunchShape::Tiles { block, .. } => block,
            LaunchShape::Elementwise { .. } => ROW_BLOCK,
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
        shared_bytes: 0,
    }
}
