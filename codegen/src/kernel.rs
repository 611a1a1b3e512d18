//! The kernel IR: one fused kernel as SSA scalar arithmetic over a row-major
//! iteration space, with loads, stores, index arithmetic and row reductions.
//!
//! A kernel runs its body once per point of `space.outer`; when `space.inner`
//! is set it is a *row kernel*: values that depend on the inner index `j` are
//! vectors over the row, and [`Expr::Reduce`] folds one back to a scalar. The
//! printed form ([`Kernel::text`]) is stable: names hash it and goldens show it.

use dplc_ir::{BinaryOp, UnaryOp};
use std::fmt::{self, Write as _};

/// A dimension of the iteration space or of a buffer: fixed, or a run-time
/// size argument `n{k}` of the kernel (a symbolic dimension such as `batch*seq`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Size {
    Const(i64),
    Param(usize),
}

impl fmt::Display for Size {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Size::Const(n) => write!(f, "{n}"),
            Size::Param(k) => write!(f, "n{k}"),
        }
    }
}

/// What a buffer holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Elem {
    /// Floating point in the kernel's storage type (f32, bf16 or f16), read
    /// and written through `f32` arithmetic.
    Float,
    /// Always `f32`, whatever the storage type (optimizer state, master weights).
    F32,
    /// `i32` indices (tokens, targets).
    I32,
}

/// A kernel argument pointing at device memory.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Buffer {
    /// What the buffer is in the graph (`%15`, `p`, `m`): for people, not hashed.
    pub label: String,
    pub elem: Elem,
    /// Written by the kernel (every other buffer is only read).
    pub output: bool,
    /// Elements in the buffer, as a product of sizes.
    pub len: Vec<Size>,
}

/// An `i64` index expression. `Var(a)` is the index along outer axis `a` of
/// the iteration space, `Inner` the index along the row of a row kernel.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum Idx {
    Var(usize),
    Inner,
    Const(i64),
    Size(Size),
    Add(Box<Idx>, Box<Idx>),
    Sub(Box<Idx>, Box<Idx>),
    Mul(Box<Idx>, Box<Idx>),
    /// Floor division of non-negative operands.
    Div(Box<Idx>, Box<Idx>),
    Rem(Box<Idx>, Box<Idx>),
    Min(Box<Idx>, Box<Idx>),
    Max(Box<Idx>, Box<Idx>),
    /// An `i32` read from an index buffer (gathers: embeddings, take-along).
    Load(usize, Box<Idx>),
}

#[allow(clippy::should_implement_trait)]
impl Idx {
    /// A size argument as an index, a constant one folded.
    pub fn size(s: Size) -> Idx {
        match s {
            Size::Const(c) => Idx::Const(c),
            s => Idx::Size(s),
        }
    }

    pub fn add(a: Idx, b: Idx) -> Idx {
        match (a, b) {
            (Idx::Const(0), x) | (x, Idx::Const(0)) => x,
            (Idx::Const(x), Idx::Const(y)) => Idx::Const(x + y),
            (x, y) => Idx::Add(Box::new(x), Box::new(y)),
        }
    }

    pub fn sub(a: Idx, b: Idx) -> Idx {
        match (a, b) {
            (x, Idx::Const(0)) => x,
            (Idx::Const(x), Idx::Const(y)) => Idx::Const(x - y),
            (x, y) => Idx::Sub(Box::new(x), Box::new(y)),
        }
    }

    pub fn mul(a: Idx, b: Idx) -> Idx {
        match (a, b) {
            (Idx::Const(0), _) | (_, Idx::Const(0)) => Idx::Const(0),
            (Idx::Const(1), x) | (x, Idx::Const(1)) => x,
            (Idx::Const(x), Idx::Const(y)) => Idx::Const(x * y),
            (x, y) => Idx::Mul(Box::new(x), Box::new(y)),
        }
    }

    /// `a / b`, simplifying `(x * b + y) / b` to `x` when `0 <= y < b` is known.
    pub fn div(a: Idx, b: Idx) -> Idx {
        if let Some((hi, _)) = split_multiple(&a, &b) {
            return hi;
        }
        match (a, b) {
            (x, Idx::Const(1)) => x,
            (Idx::Const(x), Idx::Const(y)) => Idx::Const(x / y),
            (x, y) => Idx::Div(Box::new(x), Box::new(y)),
        }
    }

    /// `a % b`, simplifying `(x * b + y) % b` to `y` when `0 <= y < b` is known.
    pub fn rem(a: Idx, b: Idx) -> Idx {
        if let Some((_, lo)) = split_multiple(&a, &b) {
            return lo;
        }
        match (a, b) {
            (_, Idx::Const(1)) => Idx::Const(0),
            (Idx::Const(x), Idx::Const(y)) => Idx::Const(x % y),
            (x, y) => Idx::Rem(Box::new(x), Box::new(y)),
        }
    }

    pub fn min(a: Idx, b: Idx) -> Idx {
        match (a, b) {
            (Idx::Const(x), Idx::Const(y)) => Idx::Const(x.min(y)),
            (x, y) => Idx::Min(Box::new(x), Box::new(y)),
        }
    }

    pub fn max(a: Idx, b: Idx) -> Idx {
        match (a, b) {
            (Idx::Const(x), Idx::Const(y)) => Idx::Const(x.max(y)),
            (x, y) => Idx::Max(Box::new(x), Box::new(y)),
        }
    }

    /// Whether the expression reads the inner (row) index.
    pub fn uses_inner(&self) -> bool {
        match self {
            Idx::Inner => true,
            Idx::Var(_) | Idx::Const(_) | Idx::Size(_) => false,
            Idx::Load(_, i) => i.uses_inner(),
            Idx::Add(a, b)
            | Idx::Sub(a, b)
            | Idx::Mul(a, b)
            | Idx::Div(a, b)
            | Idx::Rem(a, b)
            | Idx::Min(a, b)
            | Idx::Max(a, b) => a.uses_inner() || b.uses_inner(),
        }
    }

    /// Whether the expression reads the outer index of `axis`.
    pub fn uses_var(&self, axis: usize) -> bool {
        match self {
            Idx::Var(a) => *a == axis,
            Idx::Inner | Idx::Const(_) | Idx::Size(_) => false,
            Idx::Load(_, i) => i.uses_var(axis),
            Idx::Add(a, b)
            | Idx::Sub(a, b)
            | Idx::Mul(a, b)
            | Idx::Div(a, b)
            | Idx::Rem(a, b)
            | Idx::Min(a, b)
            | Idx::Max(a, b) => a.uses_var(axis) || b.uses_var(axis),
        }
    }

    /// `Some(base)` when `self == base + v` with `base` free of `v`, where `v`
    /// is the variable `var` (so consecutive `v` read consecutive elements).
    pub fn contiguous_in(&self, var: &Idx) -> Option<Idx> {
        if self == var {
            return Some(Idx::Const(0));
        }
        match self {
            Idx::Add(a, b) if **b == *var && !a.mentions(var) => Some((**a).clone()),
            Idx::Add(a, b) if **a == *var && !b.mentions(var) => Some((**b).clone()),
            Idx::Add(a, b) if !b.mentions(var) => a
                .contiguous_in(var)
                .map(|base| Idx::add(base, (**b).clone())),
            _ => None,
        }
    }

    pub(crate) fn mentions(&self, var: &Idx) -> bool {
        match var {
            Idx::Inner => self.uses_inner(),
            Idx::Var(a) => self.uses_var(*a),
            _ => true,
        }
    }

    /// The value at outer indices `vars` and size arguments `size`: the
    /// fused attention's host reference evaluates its whole-tensor places
    /// with it. `None` for what needs more than these (a row's `Inner`, a
    /// buffer read).
    pub fn eval(&self, vars: &[i64], size: &dyn Fn(Size) -> i64) -> Option<i64> {
        let two = |a: &Idx, b: &Idx| Some((a.eval(vars, size)?, b.eval(vars, size)?));
        Some(match self {
            Idx::Var(a) => *vars.get(*a)?,
            Idx::Inner | Idx::Load(..) => return None,
            Idx::Const(c) => *c,
            Idx::Size(s) => size(*s),
            Idx::Add(a, b) => two(a, b).map(|(x, y)| x + y)?,
            Idx::Sub(a, b) => two(a, b).map(|(x, y)| x - y)?,
            Idx::Mul(a, b) => two(a, b).map(|(x, y)| x * y)?,
            Idx::Div(a, b) => two(a, b).and_then(|(x, y)| x.checked_div(y))?,
            Idx::Rem(a, b) => two(a, b).and_then(|(x, y)| x.checked_rem(y))?,
            Idx::Min(a, b) => two(a, b).map(|(x, y)| x.min(y))?,
            Idx::Max(a, b) => two(a, b).map(|(x, y)| x.max(y))?,
        })
    }

    /// Whether the value is certainly a multiple of `m` (for aligned vector access).
    pub fn multiple_of(&self, m: i64) -> bool {
        match self {
            Idx::Const(c) => c % m == 0,
            Idx::Size(Size::Const(c)) => c % m == 0,
            Idx::Mul(a, b) => a.multiple_of(m) || b.multiple_of(m),
            Idx::Add(a, b) | Idx::Sub(a, b) => a.multiple_of(m) && b.multiple_of(m),
            _ => false,
        }
    }
}

/// `Some((x, y))` when `a == x * b + y` syntactically with `y` a sum of
/// products whose bound is below `b` (the linearised index of a row-major shape).
fn split_multiple(a: &Idx, b: &Idx) -> Option<(Idx, Idx)> {
    if let Idx::Add(hi, lo) = a {
        if let Idx::Mul(x, m) = &**hi {
            if **m == *b {
                return Some(((**x).clone(), (**lo).clone()));
            }
        }
    }
    if let Idx::Mul(x, m) = a {
        if **m == *b {
            return Some(((**x).clone(), Idx::Const(0)));
        }
    }
    None
}

impl fmt::Display for Idx {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Idx::Var(a) => write!(f, "i{a}"),
            Idx::Inner => f.write_str("j"),
            Idx::Const(c) => write!(f, "{c}"),
            Idx::Size(s) => write!(f, "{s}"),
            Idx::Add(a, b) => write!(f, "({a} + {b})"),
            Idx::Sub(a, b) => write!(f, "({a} - {b})"),
            Idx::Mul(a, b) => write!(f, "{a}*{b}"),
            Idx::Div(a, b) => write!(f, "({a} / {b})"),
            Idx::Rem(a, b) => write!(f, "({a} % {b})"),
            Idx::Min(a, b) => write!(f, "min({a}, {b})"),
            Idx::Max(a, b) => write!(f, "max({a}, {b})"),
            Idx::Load(buf, i) => write!(f, "b{buf}[{i}]"),
        }
    }
}

/// An SSA value of the kernel body.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ValueId(pub u32);

impl fmt::Display for ValueId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "v{}", self.0)
    }
}

/// How a row reduction combines.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum RowReduce {
    Sum,
    Max,
}

/// A comparison that picks one of two values.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum Cond {
    /// `a < b` on indices.
    IdxLt(Idx, Idx),
    /// `a < b` on values.
    ValLt(ValueId, ValueId),
}

/// An `f32` scalar expression. Operands are earlier values.
#[derive(Clone, Debug, PartialEq)]
pub enum Expr {
    Load {
        buf: usize,
        index: Idx,
    },
    Const(f64),
    /// Run-time scalar argument `s{k}` (learning rate, step, …).
    Scalar(usize),
    /// An index as a float (`cast(iota)`).
    FromIndex(Idx),
    Unary(UnaryOp, ValueId),
    Binary(BinaryOp, ValueId, ValueId),
    Select {
        cond: Cond,
        then: ValueId,
        otherwise: ValueId,
    },
    /// Fold a value over the whole row (row kernels only): a per-row scalar.
    Reduce {
        kind: RowReduce,
        value: ValueId,
    },
    /// A uniform number in `[0, 1)`: the CPU reference's dropout draw for
    /// element `index` of a dropout's output in this micro-batch (see
    /// [`DrawKey`] and [`dropout_draw`]). A pure function of the key, so
    /// backward replays the forward's mask.
    Random {
        key: DrawKey,
        index: Idx,
    },
    /// The derivative of a unary op at a point: `d op(x) / dx`. Backward
    /// kernels need it for ops (GELU's `erf`) whose derivative has no closed
    /// form in the other expressions.
    UnaryGrad(UnaryOp, ValueId),
    /// The running sum of `value` along the row (row kernels only): at `j`,
    /// the sum over `k <= j` (over `k >= j` when `reverse`). A value along
    /// the row, as every `j` reads its own prefix. A kernel holds scans of
    /// one direction only (the GPU walks the row once, carrying the sum).
    Scan {
        value: ValueId,
        reverse: bool,
    },
}

/// The key of a dropout draw besides the element: a draw hashes (seed, step,
/// node, layer, sample, position) ([`dropout_draw`], which the CPU reference
/// calls too), and a kernel gets the state after seed and step as its
/// `seed` argument, the node here and the rest as size arguments, so one
/// kernel serves every layer and micro-batch.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct DrawKey {
    /// The dropout node's index in the graph.
    pub node: u64,
    /// The flat `repeat` iteration the kernel runs for.
    pub layer: Size,
    /// Global index of the micro-batch's first sample.
    pub first_sample: Size,
    /// Elements per sample of the dropout's output: element `i` is position
    /// `i % per_sample` of sample `first_sample + i / per_sample`. 0 when the
    /// output is not laid out sample after sample: then every element is
    /// position `i` of the shared sample `u64::MAX`.
    pub per_sample: Size,
}

/// A write of `value` to `buf[index]`.
#[derive(Clone, Debug, PartialEq)]
pub struct Store {
    pub buf: usize,
    pub index: Idx,
    pub value: ValueId,
    /// Add to the element instead of overwriting it (an atomic add on the
    /// GPU, into an `f32` buffer the caller zeroes): the gradient of a read
    /// that several points of the space make (gathers, permuted reads).
    pub accumulate: bool,
}

/// The iteration space: one point per element of `outer` (row-major), and for
/// a row kernel a row of `inner` elements at each point.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Space {
    pub outer: Vec<Size>,
    pub inner: Option<Size>,
}

/// One fused kernel.
#[derive(Clone, Debug, PartialEq)]
pub struct Kernel {
    /// What it computes, e.g. `add_layernorm`: the first part of its name.
    pub op: String,
    /// Run-time size arguments `n0..`.
    pub sizes: usize,
    /// Run-time `f32` arguments `s0..`.
    pub scalars: usize,
    pub buffers: Vec<Buffer>,
    pub space: Space,
    pub values: Vec<Expr>,
    pub stores: Vec<Store>,
}

impl Kernel {
    pub fn is_row_kernel(&self) -> bool {
        self.space.inner.is_some()
    }

    /// The direction of the kernel's running sums (`Some(reverse)`), if it
    /// has any; `Err` when it has both, which no walk along the row computes.
    pub fn scan_direction(&self) -> Result<Option<bool>, String> {
        let mut dirs = self.values.iter().filter_map(|e| match e {
            Expr::Scan { reverse, .. } => Some(*reverse),
            _ => None,
        });
        let first = dirs.next();
        match first {
            Some(d) if dirs.any(|o| o != d) => {
                Err("running sums in both directions in one kernel".into())
            }
            _ => Ok(first),
        }
    }

    /// `(x, m)` when value `s` is a softmax's denominator as fusion lowers
    /// it: the row sum of `exp(x − m)`, `m` the row maximum of that same
    /// `x`. The CUDA walks the pair once; backward differentiates the
    /// softmax and log-sum-exp built on it whole.
    pub(crate) fn exp_sum_of_max(&self, s: ValueId) -> Option<(ValueId, ValueId)> {
        let at = |v: ValueId| &self.values[v.0 as usize];
        let Expr::Reduce {
            kind: RowReduce::Sum,
            value: e,
        } = at(s)
        else {
            return None;
        };
        let Expr::Unary(UnaryOp::Exp, d) = at(*e) else {
            return None;
        };
        let Expr::Binary(BinaryOp::Sub, x, m) = at(*d) else {
            return None;
        };
        matches!(at(*m), Expr::Reduce { kind: RowReduce::Max, value } if value == x)
            .then_some((*x, *m))
    }

    /// Whether the kernel draws random numbers (and so takes a `seed`).
    pub fn uses_random(&self) -> bool {
        self.values.iter().any(|e| matches!(e, Expr::Random { .. }))
    }

    /// Per value: whether it varies along the row (depends on `j`).
    pub fn along_row(&self) -> Vec<bool> {
        let mut along = Vec::with_capacity(self.values.len());
        for e in &self.values {
            let v = varies_along(e, &along);
            along.push(v);
        }
        along
    }

    /// The stable textual form: hashed for the name, shown in goldens.
    pub fn text(&self) -> String {
        let mut s = String::new();
        let outer: Vec<String> = self.space.outer.iter().map(|d| d.to_string()).collect();
        let _ = write!(s, "kernel {} [{}]", self.op, outer.join(", "));
        if let Some(inner) = self.space.inner {
            let _ = write!(s, " rows of {inner}");
        }
        let _ = writeln!(s, " sizes={} scalars={}", self.sizes, self.scalars);
        for (i, b) in self.buffers.iter().enumerate() {
            let len: Vec<String> = b.len.iter().map(|d| d.to_string()).collect();
            let _ = writeln!(
                s,
                "  b{i}: {} {}[{}]  // {}",
                if b.output { "out" } else { "in" },
                match b.elem {
                    Elem::Float => "float",
                    Elem::F32 => "f32",
                    Elem::I32 => "i32",
                },
                len.join("*"),
                b.label
            );
        }
        for (i, e) in self.values.iter().enumerate() {
            let _ = write!(s, "  v{i} = ");
            let _ = match e {
                Expr::Load { buf, index } => write!(s, "load b{buf}[{index}]"),
                Expr::Const(c) => write!(s, "const {c:?}"),
                Expr::Scalar(k) => write!(s, "scalar s{k}"),
                Expr::FromIndex(i) => write!(s, "index {i}"),
                Expr::Unary(op, a) => write!(s, "{} {a}", op.name()),
                Expr::Binary(op, a, b) => write!(s, "{} {a}, {b}", op.name()),
                Expr::Select {
                    cond,
                    then,
                    otherwise,
                } => match cond {
                    Cond::IdxLt(a, b) => write!(s, "select {a} < {b} ? {then} : {otherwise}"),
                    Cond::ValLt(a, b) => write!(s, "select {a} < {b} ? {then} : {otherwise}"),
                },
                Expr::Reduce { kind, value } => write!(
                    s,
                    "row_{} {value}",
                    match kind {
                        RowReduce::Sum => "sum",
                        RowReduce::Max => "max",
                    }
                ),
                Expr::Random { key, index } => write!(
                    s,
                    "random node {} layer {} samples {} + / {} @ {index}",
                    key.node, key.layer, key.first_sample, key.per_sample
                ),
                Expr::UnaryGrad(op, a) => write!(s, "d_{} {a}", op.name()),
                Expr::Scan { value, reverse } => write!(
                    s,
                    "row_{} {value}",
                    if *reverse { "cumsum_rev" } else { "cumsum" }
                ),
            };
            s.push('\n');
        }
        for st in &self.stores {
            let op = if st.accumulate { "+=" } else { "=" };
            let _ = writeln!(s, "  store b{}[{}] {op} {}", st.buf, st.index, st.value);
        }
        s
    }

    /// A stable 64-bit FNV-1a hash of the printed kernel (not std's seeded hasher).
    pub fn hash64(&self) -> u64 {
        fnv1a(self.text().as_bytes())
    }
}

/// 64-bit FNV-1a: stable across runs, platforms and compiler versions.
pub fn fnv1a(bytes: &[u8]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for &b in bytes {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    h
}

/// Builds a kernel body value by value.
#[derive(Default)]
pub struct Builder {
    pub values: Vec<Expr>,
}

impl Builder {
    pub fn push(&mut self, e: Expr) -> ValueId {
        // Reuse an identical earlier value (loads of the same element, shared
        // constants, the same draw).
        if let Some(i) = self.values.iter().position(|x| *x == e) {
            return ValueId(i as u32);
        }
        self.values.push(e);
        ValueId(self.values.len() as u32 - 1)
    }

    pub fn konst(&mut self, c: f64) -> ValueId {
        self.push(Expr::Const(c))
    }

    pub fn unary(&mut self, op: UnaryOp, a: ValueId) -> ValueId {
        self.push(Expr::Unary(op, a))
    }

    pub fn binary(&mut self, op: BinaryOp, a: ValueId, b: ValueId) -> ValueId {
        self.push(Expr::Binary(op, a, b))
    }

    pub fn reduce(&mut self, kind: RowReduce, value: ValueId) -> ValueId {
        self.push(Expr::Reduce { kind, value })
    }

    pub fn scan(&mut self, value: ValueId, reverse: bool) -> ValueId {
        self.push(Expr::Scan { value, reverse })
    }
}

/// The dropout key's starting state (π's fraction, as `runtime/src/rng.rs`'s
/// hash of key words starts: [`draw_seed`] is that hash of seed and step).
const KEY_START: u64 = 0x243F_6A88_85A3_08D3;

/// SplitMix64's finaliser: the mixing function of the dropout key.
fn key_mix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// The key state after one more word: the reference hashes a key of words
/// as `fold(KEY_START, |h, w| mix(h ^ mix(w)))`.
pub fn key_absorb(state: u64, word: u64) -> u64 {
    key_mix(state ^ key_mix(word))
}

/// A kernel's `seed` argument for a run's `seed` at `step`: the key state
/// after those two words.
pub fn draw_seed(seed: u64, step: u64) -> u64 {
    key_absorb(key_absorb(KEY_START, seed), step)
}

/// The key state after the node and the layer: the same for a whole launch.
pub fn draw_state(seed: u64, node: u64, layer: i64) -> u64 {
    key_absorb(key_absorb(seed, node), layer as u64)
}

/// The draw of [`Expr::Random`] for element `index`, from [`draw_state`]
/// and the key's `first_sample` and `per_sample` (see [`DrawKey`]): the
/// index split into its sample and its position there, then
/// [`sample_draw`]. CUDA's `dplc_random` is the same integer arithmetic (C's
/// `/` and `%` truncate as Rust's do).
pub fn dropout_draw(state: u64, first_sample: i64, per_sample: i64, index: i64) -> f32 {
    let (sample, pos) = if per_sample > 0 {
        (
            (first_sample + index / per_sample) as u64,
            (index % per_sample) as u64,
        )
    } else {
        (u64::MAX, index as u64)
    };
    sample_draw(key_absorb(state, sample), pos)
}

/// [`dropout_draw`] of an element of sample `b` of the micro-batch, the
/// split into sample and position by `b` instead of a division: the two are
/// equal where the tensor lays its samples out one after another (`index`
/// in `[b·per, (b + 1)·per)`), as a fused attention's whole probabilities
/// do with the batch leading. The attention kernels draw this way (CUDA's
/// `keep` in `attention_cuda.rs`), their interpreter too.
pub fn batch_draw(state: u64, first_sample: i64, per_sample: i64, b: i64, index: i64) -> f32 {
    if per_sample > 0 {
        sample_draw(
            key_absorb(state, (first_sample + b) as u64),
            (index - b * per_sample) as u64,
        )
    } else {
        sample_draw(key_absorb(state, u64::MAX), index as u64)
    }
}

/// A 32-bit integer hash (Wellons' "lowbias32": two multiplies, three
/// xor-shifts): the draw's mixing function, fewer than half the 32-bit
/// integer instructions of a 64-bit SplitMix64 mix and its 64-bit offset.
fn hash32(mut x: u32) -> u32 {
    x ^= x >> 16;
    x = x.wrapping_mul(0x7FEB_352D);
    x ^= x >> 15;
    x = x.wrapping_mul(0x846C_A68B);
    x ^ (x >> 16)
}

/// The 32 bits pair `pair` of a sample draws from, under the sample's key
/// state: the pair's number, its low word xor the state's high word, times
/// the golden ratio's 32-bit fraction (a bijection of the pair's low word)
/// plus the state's low word, the pair's high word folded in, then
/// [`hash32`]. The state's high word goes in before the multiply so two
/// samples' sequences are not shifted copies of each other.
fn pair_bits(sample_state: u64, pair: u64) -> u32 {
    let (lo, hi) = (sample_state as u32, (sample_state >> 32) as u32);
    let x = ((pair as u32) ^ hi)
        .wrapping_mul(0x9E37_79B9)
        .wrapping_add(lo)
        ^ ((pair >> 32) as u32).wrapping_mul(0x85EB_CA6B);
    hash32(x)
}

/// The draw at position `pos` of a sample whose key state (after
/// [`draw_state`]'s words and the sample) is `sample_state`: a uniform in
/// `[0, 1)` with 16 bits, exactly representable in f32. Positions `2g` and
/// `2g + 1` share one 32-bit hash (`pair_bits`), its high and low halves,
/// so a GPU thread that holds neighbouring elements (a tensor-core fragment
/// holds scores in column pairs; a vector lane holds eight) hashes once for
/// two. On the H200 the draw was most of fused attention's time under
/// dropout (GPT-2's shape: 0.497 ms forward and backward without, 0.853
/// with): the integer pipe, not the tensor cores, bound it, so the draw is
/// a 32-bit hash of a pair where it had been a 64-bit mix, and a 16-bit
/// field that converts to f32 by its bits where a 24-bit one took a 64-bit
/// integer conversion (run O: 0.853 → 0.702 ms). The CPU reference's mask
/// (`runtime::kernels::DropoutKey::mask`) calls this very function.
pub fn sample_draw(sample_state: u64, pos: u64) -> f32 {
    let bits = pair_bits(sample_state, pos >> 1);
    let field = if pos & 1 == 0 {
        bits >> 16
    } else {
        bits & 0xFFFF
    };
    field as f32 * (1.0 / 65_536.0)
}

/// The `f32` threshold a draw is compared with to drop with probability `p`:
/// a draw is `k / 2^16`, so `u < ceil(p·2^16) / 2^16` (exact in f32) drops
/// with probability `p` rounded up to the next multiple of 2^-16 (0.1
/// drops 6,554 of 65,536: 0.100006).
pub fn drop_threshold(p: f64) -> f64 {
    (p * 65_536.0).ceil() / 65_536.0
}

/// Whether `e` varies along the row (depends on `j`), given whether each
/// earlier value does: a load, index or draw at an index that reads `j`, a
/// running sum, or an op on such a value.
pub(crate) fn varies_along(e: &Expr, along: &[bool]) -> bool {
    let a = |v: &ValueId| along[v.0 as usize];
    match e {
        Expr::Load { index, .. } | Expr::FromIndex(index) | Expr::Random { index, .. } => {
            index.uses_inner()
        }
        Expr::Const(_) | Expr::Scalar(_) | Expr::Reduce { .. } => false,
        Expr::Scan { .. } => true,
        Expr::Unary(_, x) | Expr::UnaryGrad(_, x) => a(x),
        Expr::Binary(_, x, y) => a(x) || a(y),
        Expr::Select {
            cond,
            then,
            otherwise,
        } => {
            let c = match cond {
                Cond::IdxLt(x, y) => x.uses_inner() || y.uses_inner(),
                Cond::ValLt(x, y) => a(x) || a(y),
            };
            c || a(then) || a(otherwise)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The pair-sharing draw is a uniform one: mean and variance of
    /// U[0, 1), a drop rate of `p`, and no correlation between the two
    /// draws of a pair, between neighbouring pairs, or between samples.
    #[test]
    fn draws_are_uniform_and_independent() {
        let n = 1 << 18;
        let state = draw_state(draw_seed(7, 3), 41, 2);
        let (a, b) = (key_absorb(state, 0), key_absorb(state, 1));
        let xs: Vec<f64> = (0..n).map(|i| f64::from(sample_draw(a, i))).collect();
        let ys: Vec<f64> = (0..n).map(|i| f64::from(sample_draw(b, i))).collect();
        let mean = |v: &[f64]| v.iter().sum::<f64>() / v.len() as f64;
        let corr = |u: &[f64], v: &[f64]| {
            let (mu, mv) = (mean(u), mean(v));
            let cov: f64 = u.iter().zip(v).map(|(x, y)| (x - mu) * (y - mv)).sum();
            let su: f64 = u.iter().map(|x| (x - mu).powi(2)).sum::<f64>().sqrt();
            let sv: f64 = v.iter().map(|y| (y - mv).powi(2)).sum::<f64>().sqrt();
            cov / (su * sv)
        };
        let m = mean(&xs);
        let var = xs.iter().map(|x| (x - m).powi(2)).sum::<f64>() / n as f64;
        assert!((m - 0.5).abs() < 0.003, "mean {m}");
        assert!((var - 1.0 / 12.0).abs() < 0.001, "variance {var}");
        let dropped = xs.iter().filter(|&&x| x < drop_threshold(0.1)).count() as f64 / n as f64;
        assert!((dropped - 0.1).abs() < 0.003, "drop rate {dropped}");
        let even: Vec<f64> = xs.iter().step_by(2).copied().collect();
        let odd: Vec<f64> = xs.iter().skip(1).step_by(2).copied().collect();
        let next_pair: Vec<f64> = xs.iter().skip(2).step_by(2).copied().collect();
        for (what, r) in [
            ("within a pair", corr(&even, &odd)),
            ("across pairs", corr(&even[..next_pair.len()], &next_pair)),
            ("across samples", corr(&xs, &ys)),
        ] {
            assert!(r.abs() < 0.01, "correlation {what}: {r}");
        }
        // The split into sample and position is the draw's key.
        assert_eq!(
            dropout_draw(state, 5, 16, 16 + 3),
            sample_draw(key_absorb(state, 6), 3)
        );
        assert_eq!(
            dropout_draw(state, 5, 0, 3),
            sample_draw(key_absorb(state, u64::MAX), 3)
        );
    }
}
