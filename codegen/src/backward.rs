//! Backward kernels: reverse-mode differentiation of a fused kernel's IR, so
//! every forward kernel gets one fused backward kernel that recomputes the
//! forward values it needs from the forward inputs and writes input gradients.
//!
//! How an input's gradient is written depends on how the forward kernel read it:
//! - *direct*: each point of the space read its own element, or the points
//!   read a permutation of the elements (splitting heads), plus possibly a row
//!   kernel's gather of one more element of the same row (the cross-entropy's
//!   target logit): a plain store of every element;
//! - *broadcast*: only the trailing axes of the space index it (biases, norm
//!   weights): each point stores its share into an `f32` partial buffer and a
//!   [`ColumnSum`] kernel adds the shares up, deterministically;
//! - anything else (rotary's half-rotation, embedding gathers): atomic adds
//!   into an `f32` buffer the caller zeroes (summation order not fixed).

use crate::fuse::{FusionPlan, Step};
use crate::kernel::{
    Buffer, Builder, Cond, Elem, Expr, Idx, Kernel, RowReduce, Size, Space, Store, ValueId,
};
use dplc_ir::{BinaryOp, GradPlan, Graph, NodeId, UnaryOp};
use std::collections::{BTreeMap, BTreeSet};

/// What a buffer of a backward kernel is, in terms of the forward kernel's buffers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GradBinding {
    /// Forward buffer `k`, read again: an input, to recompute forward values
    /// from, or an output the backward reads instead of recomputing it (a
    /// stored softmax: its backward needs only its output, as the activation
    /// rule `dplc_ir::saved_values` says).
    Forward(usize),
    /// The gradient of forward output `k` (read).
    OutputGrad(usize),
    /// The gradient of forward input `k`: every element written. It is this
    /// kernel's part only: when the tensor has other readers, the executor
    /// adds their parts.
    InputGrad(usize),
    /// The gradient of forward input `k` in `f32`, added to atomically: the
    /// caller zeroes it first (or passes the gradient accumulated so far).
    InputGradAccumulate(usize),
    /// Per-point shares of the gradient of forward input `k` (`f32`), summed by
    /// the [`ColumnSum`] of that input.
    Partial(usize),
    /// The row statistics the forward kernel kept (its last buffer, `f32`;
    /// see [`with_row_stats`]): each row's reductions, read instead of
    /// walking the row once more to recompute them.
    RowStats,
}

/// Sums a partial buffer over its leading axes into an input's gradient.
#[derive(Clone, Debug, PartialEq)]
pub struct ColumnSum {
    /// The forward input whose gradient this is.
    pub input: usize,
    /// The axes of the partial buffer (sizes of the forward kernel), and how
    /// many leading ones are summed away.
    pub axes: Vec<Size>,
    pub split: usize,
    /// `column_sum`: `b1[c] = Σ_r b0[r * n1 + c]` with `n0` rows and `n1` columns.
    pub kernel: Kernel,
}

impl ColumnSum {
    /// The size arguments `[rows, columns]` of the column sum, given the
    /// forward kernel's size arguments.
    pub fn sizes(&self, forward_sizes: &[i64]) -> Vec<i64> {
        let value = |s: &Size| match s {
            Size::Const(c) => *c,
            Size::Param(k) => forward_sizes[*k],
        };
        let rows = self.axes[..self.split].iter().map(value).product();
        let cols = self.axes[self.split..].iter().map(value).product();
        vec![rows, cols]
    }
}

/// The backward of one fused kernel.
#[derive(Clone, Debug, PartialEq)]
pub struct Backward {
    /// Same size and scalar arguments (and `seed`) as the forward kernel.
    pub kernel: Kernel,
    /// One per buffer of `kernel`.
    pub bindings: Vec<GradBinding>,
    /// Run after `kernel`, one per broadcast input.
    pub column_sums: Vec<ColumnSum>,
}

impl Backward {
    /// The row statistics that `forward` (the kernel that keeps them, see
    /// [`with_row_stats`]) writes for this backward's arguments `bufs`:
    /// what a caller running the backward alone binds to
    /// [`GradBinding::RowStats`] (forward inputs the backward does not read
    /// taken as zeros). `None` when it reads none.
    pub fn row_stats(
        &self,
        forward: &Kernel,
        args: &crate::Args,
        bufs: &[crate::Data],
    ) -> Result<Option<crate::Data>, crate::CodegenError> {
        if !self.bindings.contains(&GradBinding::RowStats) {
            return Ok(None);
        }
        let mut fwd: Vec<crate::Data> = forward
            .buffers
            .iter()
            .enumerate()
            .map(|(j, b)| {
                let bound = self
                    .bindings
                    .iter()
                    .position(|x| *x == GradBinding::Forward(j));
                match (bound, b.output, b.elem) {
                    (Some(p), false, _) => bufs[p].clone(),
                    (_, true, _) => crate::Data::F32(vec![]),
                    (None, false, Elem::I32) => {
                        crate::Data::I32(vec![0; args.buffer_len(forward, j)])
                    }
                    (None, false, _) => crate::Data::F32(vec![0.0; args.buffer_len(forward, j)]),
                }
            })
            .collect();
        crate::interpret(forward, args, &mut fwd)?;
        Ok(fwd.pop())
    }
}

/// The column-sum kernel: `n0` rows of `n1` columns of `f32` shares.
pub fn column_sum_kernel() -> Kernel {
    let (rows, cols) = (Size::Param(0), Size::Param(1));
    let mut b = Builder::default();
    let at = Idx::add(Idx::mul(Idx::Inner, Idx::Size(cols)), Idx::Var(0));
    let x = b.push(Expr::Load { buf: 0, index: at });
    let s = b.reduce(RowReduce::Sum, x);
    Kernel {
        op: "column_sum".into(),
        sizes: 2,
        scalars: 0,
        buffers: vec![
            Buffer {
                label: "shares".into(),
                elem: Elem::F32,
                output: false,
                len: vec![rows, cols],
            },
            Buffer {
                label: "grad".into(),
                elem: Elem::Float,
                output: true,
                len: vec![cols],
            },
        ],
        space: Space {
            outer: vec![cols],
            inner: Some(rows),
        },
        values: b.values,
        stores: vec![Store {
            buf: 1,
            index: Idx::Var(0),
            value: s,
            accumulate: false,
        }],
    }
}

/// One step of a region's backward pass, in execution order (the reverse of forward).
#[derive(Clone, Debug, PartialEq)]
pub enum BackwardStep {
    /// The backward of forward step `step` (a kernel).
    Kernel { step: usize, backward: Backward },
    /// The two gradient matmuls of forward step `step`, for cuBLAS.
    MatMul { step: usize },
    /// The backward passes of the fused attention of forward step `step`.
    Attention { step: usize },
    /// A forward step whose VJP the runtime runs itself, with the reason.
    Extern {
        step: usize,
        node: Option<NodeId>,
        reason: String,
    },
}

/// The backward pass of a fused region: the forward steps in reverse, each
/// kernel with its fused backward. Only inputs that need a gradient get one.
/// A row kernel whose backward would recompute its row reductions keeps them
/// instead (its kernel gains the statistics buffer and
/// [`FusedKernel::keeps_row_stats`](crate::FusedKernel) is set), as a fused
/// attention keeps its log-sum-exp: the backward then reads each row once
/// less — for the cross-entropy over a vocabulary, a third of its traffic.
pub fn backward_plan(g: &Graph, plan: &mut FusionPlan) -> Vec<BackwardStep> {
    let grads = GradPlan::new(g);
    let mut out = Vec::new();
    for (i, step) in plan.steps.iter_mut().enumerate().rev() {
        match step {
            Step::MatMul { .. } => out.push(BackwardStep::MatMul { step: i }),
            Step::Attention(at) => {
                if at.inputs().into_iter().any(|t| grads.needs_grad(t)) {
                    out.push(BackwardStep::Attention { step: i });
                }
            }
            Step::Extern { node, .. } => out.push(BackwardStep::Extern {
                step: i,
                node: Some(*node),
                reason: format!("`{}` runs in the runtime", g.node(*node).op.name()),
            }),
            Step::Kernel(k) => {
                let needs: Vec<bool> = k.buffers.iter().map(|&t| grads.needs_grad(t)).collect();
                if !k
                    .kernel
                    .buffers
                    .iter()
                    .zip(&needs)
                    .any(|(b, &n)| !b.output && n)
                {
                    continue;
                }
                match backward_keeping_row_stats(&k.kernel, &needs) {
                    Ok((backward, kept)) => {
                        if let Some(kernel) = kept {
                            k.kernel = kernel;
                            k.keeps_row_stats = true;
                        }
                        out.push(BackwardStep::Kernel { step: i, backward })
                    }
                    Err(reason) => out.push(BackwardStep::Extern {
                        step: i,
                        node: k.nodes.last().copied(),
                        reason,
                    }),
                }
            }
        }
    }
    out
}

/// `fwd` keeping its row statistics: a last output buffer (`f32`, one row
/// of `n` per point of the outer space) that every row reduction of the
/// forward is stored to, in the order of the values. `None` for a kernel
/// without a row, without reductions, or with running sums (whose walk the
/// statistics would not save).
pub fn with_row_stats(fwd: &Kernel) -> Option<Kernel> {
    if !fwd.is_row_kernel() || fwd.values.iter().any(|e| matches!(e, Expr::Scan { .. })) {
        return None;
    }
    let reduced: Vec<ValueId> = (0..fwd.values.len())
        .filter(|&i| matches!(fwd.values[i], Expr::Reduce { .. }))
        .map(|i| ValueId(i as u32))
        .collect();
    if reduced.is_empty() {
        return None;
    }
    let n = reduced.len() as i64;
    let mut kernel = fwd.clone();
    let buf = kernel.buffers.len();
    let mut len = fwd.space.outer.clone();
    len.push(Size::Const(n));
    kernel.buffers.push(Buffer {
        label: "row_stats".into(),
        elem: Elem::F32,
        output: true,
        len,
    });
    let row = flat_index(&fwd.space.outer, false);
    for (j, &value) in reduced.iter().enumerate() {
        kernel.stores.push(Store {
            buf,
            index: Idx::add(Idx::mul(row.clone(), Idx::Const(n)), Idx::Const(j as i64)),
            value,
            accumulate: false,
        });
    }
    Some(kernel)
}

/// The fused backward of `fwd` reading the row statistics the forward
/// keeps, when it reads them (it recomputed a reduction): the backward and
/// the forward kernel that keeps them ([`with_row_stats`]); else the
/// backward of `fwd` as it is and `None`.
pub fn backward_keeping_row_stats(
    fwd: &Kernel,
    needs_grad: &[bool],
) -> Result<(Backward, Option<Kernel>), String> {
    if let Some(kept) = with_row_stats(fwd) {
        let stats = kept.buffers.len() - 1;
        if let Ok(b) = backward_of(&kept, needs_grad, Some(stats)) {
            if b.bindings.contains(&GradBinding::RowStats) {
                return Ok((b, Some(kept)));
            }
        }
    }
    Ok((backward(fwd, needs_grad)?, None))
}

/// A [`Builder`] that also tracks which values vary along the row.
struct Body {
    b: Builder,
    along: Vec<bool>,
}

impl Body {
    fn push(&mut self, e: Expr) -> ValueId {
        let along = crate::kernel::varies_along(&e, &self.along);
        let v = self.b.push(e);
        if v.0 as usize == self.along.len() {
            self.along.push(along);
        }
        v
    }
    fn konst(&mut self, c: f64) -> ValueId {
        self.push(Expr::Const(c))
    }
    fn bin(&mut self, op: BinaryOp, a: ValueId, b: ValueId) -> ValueId {
        self.push(Expr::Binary(op, a, b))
    }
    fn neg(&mut self, a: ValueId) -> ValueId {
        self.push(Expr::Unary(UnaryOp::Neg, a))
    }
    /// `cond ? x : 0`, or `cond ? 0 : x` when `!when`.
    fn gate(&mut self, cond: Cond, x: ValueId, when: bool) -> ValueId {
        let zero = self.konst(0.0);
        let (then, otherwise) = if when { (x, zero) } else { (zero, x) };
        self.push(Expr::Select {
            cond,
            then,
            otherwise,
        })
    }
    fn sum(&mut self, vs: &[ValueId]) -> Option<ValueId> {
        let mut it = vs.iter().copied();
        let first = it.next()?;
        Some(it.fold(first, |acc, v| self.bin(BinaryOp::Add, acc, v)))
    }
}

fn remap_idx(i: &Idx, bufs: &[Option<usize>]) -> Idx {
    let r = |x: &Idx| Box::new(remap_idx(x, bufs));
    match i {
        Idx::Var(_) | Idx::Inner | Idx::Const(_) | Idx::Size(_) => i.clone(),
        Idx::Add(a, b) => Idx::Add(r(a), r(b)),
        Idx::Sub(a, b) => Idx::Sub(r(a), r(b)),
        Idx::Mul(a, b) => Idx::Mul(r(a), r(b)),
        Idx::Div(a, b) => Idx::Div(r(a), r(b)),
        Idx::Rem(a, b) => Idx::Rem(r(a), r(b)),
        Idx::Min(a, b) => Idx::Min(r(a), r(b)),
        Idx::Max(a, b) => Idx::Max(r(a), r(b)),
        Idx::Load(buf, x) => Idx::Load(bufs[*buf].expect("index buffers are kept"), r(x)),
    }
}

fn remap_cond(c: &Cond, vals: &[ValueId], bufs: &[Option<usize>]) -> Cond {
    match c {
        Cond::IdxLt(a, b) => Cond::IdxLt(remap_idx(a, bufs), remap_idx(b, bufs)),
        Cond::ValLt(a, b) => Cond::ValLt(vals[a.0 as usize], vals[b.0 as usize]),
    }
}

fn remap_expr(e: &Expr, vals: &[ValueId], bufs: &[Option<usize>]) -> Expr {
    let v = |x: &ValueId| vals[x.0 as usize];
    match e {
        Expr::Load { buf, index } => Expr::Load {
            buf: bufs[*buf].expect("loaded buffers are kept"),
            index: remap_idx(index, bufs),
        },
        Expr::Const(c) => Expr::Const(*c),
        Expr::Scalar(k) => Expr::Scalar(*k),
        Expr::FromIndex(i) => Expr::FromIndex(remap_idx(i, bufs)),
        Expr::Unary(op, a) => Expr::Unary(*op, v(a)),
        Expr::UnaryGrad(op, a) => Expr::UnaryGrad(*op, v(a)),
        Expr::Binary(op, a, b) => Expr::Binary(*op, v(a), v(b)),
        Expr::Select {
            cond,
            then,
            otherwise,
        } => Expr::Select {
            cond: remap_cond(cond, vals, bufs),
            then: v(then),
            otherwise: v(otherwise),
        },
        Expr::Reduce { kind, value } => Expr::Reduce {
            kind: *kind,
            value: v(value),
        },
        Expr::Scan { value, reverse } => Expr::Scan {
            value: v(value),
            reverse: *reverse,
        },
        Expr::Random { key, index } => Expr::Random {
            key: *key,
            index: remap_idx(index, bufs),
        },
    }
}

/// The value of an index at a point, with the probe's sizes; `None` for gathers.
fn eval_idx(i: &Idx, vars: &[i64], j: i64, sizes: &dyn Fn(Size) -> i64) -> Option<i64> {
    let e = |x: &Idx| eval_idx(x, vars, j, sizes);
    Some(match i {
        Idx::Var(a) => vars[*a],
        Idx::Inner => j,
        Idx::Const(c) => *c,
        Idx::Size(s) => sizes(*s),
        Idx::Add(a, b) => e(a)? + e(b)?,
        Idx::Sub(a, b) => e(a)? - e(b)?,
        Idx::Mul(a, b) => e(a)? * e(b)?,
        Idx::Div(a, b) => e(a)?.div_euclid(e(b)?.max(1)),
        Idx::Rem(a, b) => e(a)?.rem_euclid(e(b)?.max(1)),
        Idx::Min(a, b) => e(a)?.min(e(b)?),
        Idx::Max(a, b) => e(a)?.max(e(b)?),
        Idx::Load(..) => return None,
    })
}

/// Size arguments of the probe: distinct primes, so that a reading that only
/// agrees with a row-major layout by accident is unlikely.
fn probe_size(s: Size) -> i64 {
    const PRIMES: [i64; 8] = [3, 5, 7, 11, 13, 17, 19, 23];
    match s {
        Size::Const(c) => c,
        Size::Param(k) => PRIMES[k % PRIMES.len()],
    }
}

/// A few values along an axis of extent `n`: both ends, the middle, and some between.
fn samples(n: i64) -> Vec<i64> {
    let mut v: BTreeSet<i64> = [0, 1, 2, n / 3, n / 2, n - 2, n - 1]
        .into_iter()
        .filter(|&x| x >= 0 && x < n)
        .collect();
    if n <= 8 {
        v.extend(0..n);
    }
    v.into_iter().collect()
}

/// `Some(k)` when `index(p)` equals the row-major offset of `p` over `axes[k..]`
/// (and the buffer holds exactly those elements) at every probe point.
fn broadcast_split(index: &Idx, axes: &[Size], has_inner: bool, len: &[Size]) -> Option<usize> {
    let ext: Vec<i64> = axes.iter().map(|&s| probe_size(s)).collect();
    let buf_len: i64 = len.iter().map(|&s| probe_size(s)).product();
    let mut points: Vec<Vec<i64>> = vec![vec![]];
    for &n in &ext {
        points = points
            .into_iter()
            .flat_map(|p| {
                samples(n).into_iter().map(move |x| {
                    let mut q = p.clone();
                    q.push(x);
                    q
                })
            })
            .collect();
    }
    'split: for k in 0..axes.len().max(1) {
        if ext[k.min(ext.len())..].iter().product::<i64>() != buf_len {
            continue;
        }
        for p in &points {
            let (vars, j) = if has_inner {
                (&p[..p.len() - 1], p[p.len() - 1])
            } else {
                (&p[..], 0)
            };
            let got = eval_idx(index, vars, j, &probe_size)?;
            let want = p[k..]
                .iter()
                .zip(&ext[k..])
                .fold(0, |acc, (&x, &n)| acc * n + x);
            if got != want {
                continue 'split;
            }
        }
        return Some(k);
    }
    None
}

/// Whether `index` maps the points of `axes` one-to-one onto the buffer's
/// elements (a permuted read, such as splitting heads), checked on every point
/// of the probe; large probes are not checked and count as not one-to-one.
fn bijective(index: &Idx, axes: &[Size], has_inner: bool, len: &[Size]) -> bool {
    let ext: Vec<i64> = axes.iter().map(|&s| probe_size(s)).collect();
    let count: i64 = ext.iter().product();
    let buf_len: i64 = len.iter().map(|&s| probe_size(s)).product();
    if count != buf_len || count > 1 << 18 {
        return false;
    }
    let mut seen = vec![false; count as usize];
    for flat in 0..count {
        let mut p = vec![0; ext.len()];
        let mut rest = flat;
        for a in (0..ext.len()).rev() {
            p[a] = rest % ext[a];
            rest /= ext[a];
        }
        let (vars, j) = if has_inner {
            (&p[..p.len() - 1], p[p.len() - 1])
        } else {
            (&p[..], 0)
        };
        match eval_idx(index, vars, j, &probe_size) {
            Some(at) if (0..count).contains(&at) && !seen[at as usize] => seen[at as usize] = true,
            _ => return false,
        }
    }
    true
}

/// `Some(c)` when `other` is `pattern` with its one `Inner` replaced by `c`
/// (free of `Inner`): `other` reads column `c` of the row `pattern` walks.
fn inner_replaced(pattern: &Idx, other: &Idx) -> Option<Idx> {
    fn walk(p: &Idx, o: &Idx, found: &mut Option<Idx>) -> bool {
        if *p == Idx::Inner {
            if o.uses_inner() {
                return false;
            }
            if let Some(f) = found {
                return f == o;
            }
            *found = Some(o.clone());
            return true;
        }
        match (p, o) {
            (Idx::Add(a, b), Idx::Add(c, d))
            | (Idx::Sub(a, b), Idx::Sub(c, d))
            | (Idx::Mul(a, b), Idx::Mul(c, d))
            | (Idx::Div(a, b), Idx::Div(c, d))
            | (Idx::Rem(a, b), Idx::Rem(c, d))
            | (Idx::Min(a, b), Idx::Min(c, d))
            | (Idx::Max(a, b), Idx::Max(c, d)) => walk(a, c, found) && walk(b, d, found),
            (Idx::Load(x, a), Idx::Load(y, b)) => x == y && walk(a, b, found),
            _ => p == o,
        }
    }
    let mut found = None;
    (walk(pattern, other, &mut found) && found.is_some()).then_some(found?)
}

/// The row-major offset of the point over `axes` (outer variables, then `j`).
fn flat_index(axes: &[Size], has_inner: bool) -> Idx {
    let mut acc = Idx::Const(0);
    for (a, &s) in axes.iter().enumerate() {
        let var = if has_inner && a + 1 == axes.len() {
            Idx::Inner
        } else {
            Idx::Var(a)
        };
        acc = Idx::add(Idx::mul(acc, Idx::Size(s)), var);
    }
    acc
}

/// How the gradient of one forward input is written.
enum Write {
    Direct {
        primary: ValueId,
        gathers: Vec<(ValueId, Idx)>,
    },
    Broadcast {
        load: ValueId,
        axes: Vec<Size>,
        split: usize,
    },
    Accumulate,
}

/// The fused backward of `fwd`. `needs_grad[k]` says whether forward input
/// `k` needs a gradient (outputs and index buffers are ignored). Every float
/// output is taken to have a gradient; pass zeros for one that has none.
pub fn backward(fwd: &Kernel, needs_grad: &[bool]) -> Result<Backward, String> {
    backward_of(fwd, needs_grad, None)
}

/// [`backward`], reading the row reductions from forward buffer `stats`
/// (the statistics [`with_row_stats`] stores) instead of recomputing them
/// when it is given.
fn backward_of(
    fwd: &Kernel,
    needs_grad: &[bool],
    stats: Option<usize>,
) -> Result<Backward, String> {
    if fwd.stores.iter().any(|s| s.accumulate) {
        return Err("a kernel with accumulating stores has no backward".into());
    }
    let row_kernel = fwd.is_row_kernel();
    let mut bindings = Vec::new();
    let mut buffers = Vec::new();
    // Forward inputs first, at new positions.
    let mut in_map: Vec<Option<usize>> = vec![None; fwd.buffers.len()];
    for (k, buf) in fwd.buffers.iter().enumerate() {
        if !buf.output {
            in_map[k] = Some(buffers.len());
            buffers.push(buf.clone());
            bindings.push(GradBinding::Forward(k));
        }
    }
    let stats_at = stats.map(|sb| {
        buffers.push(Buffer {
            output: false,
            ..fwd.buffers[sb].clone()
        });
        bindings.push(GradBinding::RowStats);
        buffers.len() - 1
    });
    let kept_stat = |st: &&Store| Some(st.buf) == stats;
    let mut body = Body {
        b: Builder::default(),
        along: Vec::new(),
    };
    // Recompute the forward values; a kept reduction is read instead, and
    // remembered (its gradient flows as the reduction's).
    let mut vals: Vec<ValueId> = Vec::with_capacity(fwd.values.len());
    let mut kept_reductions: BTreeMap<ValueId, (RowReduce, ValueId)> = BTreeMap::new();
    for (i, e) in fwd.values.iter().enumerate() {
        let kept = stats_at.zip(
            fwd.stores
                .iter()
                .find(|st| kept_stat(st) && st.value.0 as usize == i),
        );
        let v = match (e, kept) {
            (Expr::Reduce { kind, value }, Some((at, st))) => {
                let l = body.push(Expr::Load {
                    buf: at,
                    index: st.index.clone(),
                });
                kept_reductions.insert(l, (*kind, vals[value.0 as usize]));
                l
            }
            _ => body.push(remap_expr(e, &vals, &in_map)),
        };
        vals.push(v);
    }
    // A softmax whose output the forward stores: its backward reads the
    // stored rows, not the scores (the scores need not be kept).
    let mut softmax_out: BTreeMap<usize, (ValueId, ValueId)> = BTreeMap::new();
    for st in fwd.stores.iter().filter(|st| !kept_stat(st)) {
        let out = &fwd.buffers[st.buf];
        let i = st.value.0 as usize;
        if out.elem == Elem::I32 || !row_kernel || softmax_out.contains_key(&i) {
            continue;
        }
        if let Some(x) = softmax_input(fwd, st.value) {
            let at = buffers.len();
            buffers.push(out.clone());
            buffers[at].output = false;
            bindings.push(GradBinding::Forward(st.buf));
            let index = remap_idx(&st.index, &in_map);
            let y = body.push(Expr::Load { buf: at, index });
            softmax_out.insert(i, (vals[x.0 as usize], y));
        }
    }
    // Seed the adjoints from the output gradients.
    let mut contrib: BTreeMap<ValueId, Vec<ValueId>> = BTreeMap::new();
    for st in fwd.stores.iter().filter(|st| !kept_stat(st)) {
        let out = &fwd.buffers[st.buf];
        if out.elem == Elem::I32 {
            continue;
        }
        let g = buffers.len();
        buffers.push(Buffer {
            label: format!("d{}", out.label),
            elem: out.elem,
            output: false,
            len: out.len.clone(),
        });
        bindings.push(GradBinding::OutputGrad(st.buf));
        let index = remap_idx(&st.index, &in_map);
        let gv = body.push(Expr::Load { buf: g, index });
        contrib
            .entry(vals[st.value.0 as usize])
            .or_default()
            .push(gv);
    }
    // Reverse sweep over the recomputed forward values.
    let mut adj: BTreeMap<ValueId, ValueId> = BTreeMap::new();
    for i in (0..fwd.values.len()).rev() {
        let v = vals[i];
        let Some(cs) = contrib.remove(&v) else {
            continue;
        };
        let (vecs, scal): (Vec<ValueId>, Vec<ValueId>) =
            cs.iter().partition(|c| body.along[c.0 as usize]);
        let a = if row_kernel && !body.along[v.0 as usize] && !vecs.is_empty() {
            let s = body.sum(&vecs).expect("non-empty");
            let r = body.push(Expr::Reduce {
                kind: RowReduce::Sum,
                value: s,
            });
            let mut all = vec![r];
            all.extend(scal);
            body.sum(&all).expect("non-empty")
        } else {
            body.sum(&cs).expect("non-empty")
        };
        adj.insert(v, a);
        if let Some(&(x, y)) = softmax_out.get(&i) {
            // dx = y ⊙ (dy − Σ_row dy ⊙ y)
            let ay = body.bin(BinaryOp::Mul, a, y);
            let r = body.push(Expr::Reduce {
                kind: RowReduce::Sum,
                value: ay,
            });
            let d = body.bin(BinaryOp::Sub, a, r);
            let dx = body.bin(BinaryOp::Mul, y, d);
            give(x, dx, &mut contrib);
            continue;
        }
        if let Some(x) = log_sum_exp(fwd, ValueId(i as u32)) {
            // d lse / dx = exp(x − lse), the softmax: the row maximum is a
            // shift that cancels, so nothing flows back through it (through
            // `max` it would be a row-long select adding a rounding error,
            // and one more walk of the row).
            let d = body.bin(BinaryOp::Sub, vals[x.0 as usize], v);
            let p = body.push(Expr::Unary(UnaryOp::Exp, d));
            let dx = body.bin(BinaryOp::Mul, a, p);
            give(x, dx, &mut contrib);
            continue;
        }
        if let Some(&(kind, value)) = kept_reductions.get(&v) {
            let c = reduction_grad(&mut body, kind, value, v, a);
            give(value, c, &mut contrib);
            continue;
        }
        match body.b.values[v.0 as usize].clone() {
            Expr::Load { .. }
            | Expr::Const(_)
            | Expr::Scalar(_)
            | Expr::FromIndex(_)
            | Expr::Random { .. } => {}
            Expr::UnaryGrad(..) => return Err("a backward kernel has no backward".into()),
            Expr::Unary(op, x) => {
                let c = match op {
                    UnaryOp::Neg => body.neg(a),
                    _ => {
                        let d = body.push(Expr::UnaryGrad(op, x));
                        body.bin(BinaryOp::Mul, a, d)
                    }
                };
                give(x, c, &mut contrib);
            }
            Expr::Binary(op, x, y) => match op {
                BinaryOp::Add => {
                    give(x, a, &mut contrib);
                    give(y, a, &mut contrib);
                }
                BinaryOp::Sub => {
                    give(x, a, &mut contrib);
                    let n = body.neg(a);
                    give(y, n, &mut contrib);
                }
                BinaryOp::Mul => {
                    let cx = body.bin(BinaryOp::Mul, a, y);
                    let cy = body.bin(BinaryOp::Mul, a, x);
                    give(x, cx, &mut contrib);
                    give(y, cy, &mut contrib);
                }
                BinaryOp::Div => {
                    // d(x/y) = dx / y - (x/y) dy / y
                    let cx = body.bin(BinaryOp::Div, a, y);
                    let t = body.bin(BinaryOp::Mul, cx, v);
                    let cy = body.neg(t);
                    give(x, cx, &mut contrib);
                    give(y, cy, &mut contrib);
                }
                // Ties send the gradient to the first operand, as the CPU runtime does.
                BinaryOp::Max => {
                    let cx = body.gate(Cond::ValLt(x, y), a, false);
                    let cy = body.gate(Cond::ValLt(x, y), a, true);
                    give(x, cx, &mut contrib);
                    give(y, cy, &mut contrib);
                }
                BinaryOp::Min => {
                    let cx = body.gate(Cond::ValLt(y, x), a, false);
                    let cy = body.gate(Cond::ValLt(y, x), a, true);
                    give(x, cx, &mut contrib);
                    give(y, cy, &mut contrib);
                }
                BinaryOp::Pow => {
                    let one = body.konst(1.0);
                    let ym1 = body.bin(BinaryOp::Sub, y, one);
                    let p = body.bin(BinaryOp::Pow, x, ym1);
                    let yp = body.bin(BinaryOp::Mul, y, p);
                    let cx = body.bin(BinaryOp::Mul, a, yp);
                    let lx = body.push(Expr::Unary(UnaryOp::Log, x));
                    let vl = body.bin(BinaryOp::Mul, v, lx);
                    let avl = body.bin(BinaryOp::Mul, a, vl);
                    let zero = body.konst(0.0);
                    let cy = body.gate(Cond::ValLt(zero, x), avl, true);
                    give(x, cx, &mut contrib);
                    give(y, cy, &mut contrib);
                }
                // A comparison is flat: nothing flows back.
                BinaryOp::Lt
                | BinaryOp::Le
                | BinaryOp::Gt
                | BinaryOp::Ge
                | BinaryOp::Eq
                | BinaryOp::Ne => {}
            },
            Expr::Select {
                cond,
                then,
                otherwise,
            } => {
                let ct = body.gate(cond.clone(), a, true);
                let co = body.gate(cond, a, false);
                give(then, ct, &mut contrib);
                give(otherwise, co, &mut contrib);
            }
            Expr::Reduce { kind, value } => {
                let c = reduction_grad(&mut body, kind, value, v, a);
                give(value, c, &mut contrib);
            }
            // Each element of a running sum reaches every later one: its
            // gradient is the running sum the other way.
            Expr::Scan { value, reverse } => {
                let c = body.push(Expr::Scan {
                    value: a,
                    reverse: !reverse,
                });
                give(value, c, &mut contrib);
            }
        }
    }
    // Input gradients, from the adjoints of the loads.
    let mut stores = Vec::new();
    let mut column_sums = Vec::new();
    for (k, buf) in fwd.buffers.iter().enumerate() {
        if buf.output || buf.elem == Elem::I32 || !needs_grad.get(k).copied().unwrap_or(false) {
            continue;
        }
        let nb = in_map[k].expect("inputs are kept");
        let mut loads: Vec<(ValueId, Idx)> = vals
            .iter()
            .filter_map(|&v| match &body.b.values[v.0 as usize] {
                Expr::Load { buf, index } if *buf == nb => Some((v, index.clone())),
                _ => None,
            })
            .collect();
        loads.sort_by_key(|(v, _)| *v);
        loads.dedup_by_key(|(v, _)| *v);
        if loads.is_empty() {
            // Not read (a dead input): its gradient is zero.
            continue;
        }
        let axes_of = |index: &Idx| -> (Vec<Size>, bool) {
            let mut axes = fwd.space.outer.clone();
            let inner = row_kernel && index.uses_inner();
            if inner {
                axes.push(fwd.space.inner.expect("row kernel"));
            }
            (axes, inner)
        };
        let write = {
            let direct: Vec<&(ValueId, Idx)> = loads
                .iter()
                .filter(|(_, ix)| {
                    let (axes, inner) = axes_of(ix);
                    broadcast_split(ix, &axes, inner, &buf.len) == Some(0)
                })
                .collect();
            if let [primary] = direct.as_slice() {
                let gathers: Option<Vec<(ValueId, Idx)>> = loads
                    .iter()
                    .filter(|(v, _)| *v != primary.0)
                    .map(|(v, ix)| {
                        let c = (primary.1.uses_inner())
                            .then(|| inner_replaced(&primary.1, ix))
                            .flatten()?;
                        Some((*v, c))
                    })
                    .collect();
                match gathers {
                    Some(gathers) => Write::Direct {
                        primary: primary.0,
                        gathers,
                    },
                    None => Write::Accumulate,
                }
            } else if let [(load, ix)] = loads.as_slice() {
                let (axes, inner) = axes_of(ix);
                match broadcast_split(ix, &axes, inner, &buf.len) {
                    Some(split) => Write::Broadcast {
                        load: *load,
                        axes,
                        split,
                    },
                    None if bijective(ix, &axes, inner, &buf.len) => Write::Direct {
                        primary: *load,
                        gathers: vec![],
                    },
                    None => Write::Accumulate,
                }
            } else {
                Write::Accumulate
            }
        };
        let grad_buf = buffers.len();
        match write {
            Write::Direct { primary, gathers } => {
                let mut parts: Vec<ValueId> = adj.get(&primary).copied().into_iter().collect();
                for (g, col) in gathers {
                    if let Some(&a) = adj.get(&g) {
                        // Column `col` of this row: the one point where j == col.
                        let below = body.gate(Cond::IdxLt(Idx::Inner, col.clone()), a, false);
                        parts.push(body.gate(Cond::IdxLt(col, Idx::Inner), below, false));
                    }
                }
                let value = match body.sum(&parts) {
                    Some(v) => v,
                    None => body.konst(0.0),
                };
                let index = loads
                    .iter()
                    .find(|(v, _)| *v == primary)
                    .expect("primary is a load")
                    .1
                    .clone();
                buffers.push(Buffer {
                    label: format!("d{}", buf.label),
                    elem: buf.elem,
                    output: true,
                    len: buf.len.clone(),
                });
                bindings.push(GradBinding::InputGrad(k));
                stores.push(Store {
                    buf: grad_buf,
                    index,
                    value,
                    accumulate: false,
                });
            }
            Write::Broadcast { load, axes, split } => {
                let value = match adj.get(&load) {
                    Some(&v) => v,
                    None => body.konst(0.0),
                };
                let inner = row_kernel && loads[0].1.uses_inner();
                buffers.push(Buffer {
                    label: format!("d{}.shares", buf.label),
                    elem: Elem::F32,
                    output: true,
                    len: axes.clone(),
                });
                bindings.push(GradBinding::Partial(k));
                stores.push(Store {
                    buf: grad_buf,
                    index: flat_index(&axes, inner),
                    value,
                    accumulate: false,
                });
                let mut kernel = column_sum_kernel();
                kernel.buffers[1].elem = buf.elem;
                column_sums.push(ColumnSum {
                    input: k,
                    axes,
                    split,
                    kernel,
                });
            }
            Write::Accumulate => {
                buffers.push(Buffer {
                    label: format!("d{}", buf.label),
                    elem: Elem::F32,
                    output: true,
                    len: buf.len.clone(),
                });
                bindings.push(GradBinding::InputGradAccumulate(k));
                for (v, index) in &loads {
                    if let Some(&a) = adj.get(v) {
                        stores.push(Store {
                            buf: grad_buf,
                            index: index.clone(),
                            value: a,
                            accumulate: true,
                        });
                    }
                }
            }
        }
    }
    if stores.is_empty() {
        return Err("no input of the kernel needs a gradient".into());
    }
    let kernel = Kernel {
        op: format!("{}_backward", fwd.op),
        sizes: fwd.sizes,
        scalars: fwd.scalars,
        buffers,
        space: fwd.space.clone(),
        values: body.b.values,
        stores,
    };
    let (kernel, kept) = compact(kernel);
    // A forward running sum that the gradient needs again beside the
    // gradient's own reverse sum: no one walk along the row computes both.
    kernel.scan_direction()?;
    let bindings = kept.into_iter().map(|k| bindings[k]).collect();
    Ok(Backward {
        kernel,
        bindings,
        column_sums,
    })
}

/// Drop values no store needs and input buffers nothing reads; returns the
/// kernel and, per kept buffer, its old position.
fn compact(k: Kernel) -> (Kernel, Vec<usize>) {
    let mut live = vec![false; k.values.len()];
    let mut bufs_used: BTreeSet<usize> = BTreeSet::new();
    fn idx_bufs(i: &Idx, out: &mut BTreeSet<usize>) {
        match i {
            Idx::Var(_) | Idx::Inner | Idx::Const(_) | Idx::Size(_) => {}
            Idx::Add(a, b)
            | Idx::Sub(a, b)
            | Idx::Mul(a, b)
            | Idx::Div(a, b)
            | Idx::Rem(a, b)
            | Idx::Min(a, b)
            | Idx::Max(a, b) => {
                idx_bufs(a, out);
                idx_bufs(b, out);
            }
            Idx::Load(b, x) => {
                out.insert(*b);
                idx_bufs(x, out);
            }
        }
    }
    for st in &k.stores {
        live[st.value.0 as usize] = true;
        bufs_used.insert(st.buf);
        idx_bufs(&st.index, &mut bufs_used);
    }
    for i in (0..k.values.len()).rev() {
        if !live[i] {
            continue;
        }
        let e = &k.values[i];
        let mut mark = |v: &ValueId| live[v.0 as usize] = true;
        match e {
            Expr::Load { buf, index } => {
                bufs_used.insert(*buf);
                idx_bufs(index, &mut bufs_used);
            }
            Expr::FromIndex(index) | Expr::Random { index, .. } => idx_bufs(index, &mut bufs_used),
            Expr::Const(_) | Expr::Scalar(_) => {}
            Expr::Unary(_, a) | Expr::UnaryGrad(_, a) => mark(a),
            Expr::Binary(_, a, b) => {
                mark(a);
                mark(b);
            }
            Expr::Select {
                cond,
                then,
                otherwise,
            } => {
                mark(then);
                mark(otherwise);
                match cond {
                    Cond::ValLt(a, b) => {
                        mark(a);
                        mark(b);
                    }
                    Cond::IdxLt(a, b) => {
                        idx_bufs(a, &mut bufs_used);
                        idx_bufs(b, &mut bufs_used);
                    }
                }
            }
            Expr::Reduce { value, .. } | Expr::Scan { value, .. } => mark(value),
        }
    }
    let kept: Vec<usize> = (0..k.buffers.len())
        .filter(|b| bufs_used.contains(b))
        .collect();
    let mut buf_map = vec![None; k.buffers.len()];
    for (new, &old) in kept.iter().enumerate() {
        buf_map[old] = Some(new);
    }
    let mut vals: Vec<ValueId> = Vec::with_capacity(k.values.len());
    let mut values = Vec::new();
    for (i, e) in k.values.iter().enumerate() {
        if live[i] {
            values.push(remap_expr(e, &vals, &buf_map));
            vals.push(ValueId(values.len() as u32 - 1));
        } else {
            // Never read: any id will do.
            vals.push(ValueId(u32::MAX));
        }
    }
    let stores = k
        .stores
        .iter()
        .map(|st| Store {
            buf: buf_map[st.buf].expect("stored buffers are kept"),
            index: remap_idx(&st.index, &buf_map),
            value: vals[st.value.0 as usize],
            accumulate: st.accumulate,
        })
        .collect();
    let buffers = kept.iter().map(|&b| k.buffers[b].clone()).collect();
    (
        Kernel {
            buffers,
            values,
            stores,
            ..k
        },
        kept,
    )
}

/// The scores `x` when forward value `v` is `softmax(x)` as fusion lowers it:
/// `exp(x − m) / Σ exp(x − m)` with `m` the row maximum.
fn softmax_input(fwd: &Kernel, v: ValueId) -> Option<ValueId> {
    let at = |v: ValueId| &fwd.values[v.0 as usize];
    let Expr::Binary(BinaryOp::Div, e, s) = at(v) else {
        return None;
    };
    let Expr::Unary(UnaryOp::Exp, d) = at(*e) else {
        return None;
    };
    let Expr::Binary(BinaryOp::Sub, x, m) = at(*d) else {
        return None;
    };
    let (_, m2) = fwd.exp_sum_of_max(*s)?;
    (m2 == *m).then_some(*x)
}

/// `x` when forward value `v` is the log-sum-exp of its row as fusion
/// lowers it: `m + log Σ exp(x − m)` with `m` the row maximum of `x`.
fn log_sum_exp(fwd: &Kernel, v: ValueId) -> Option<ValueId> {
    let at = |v: ValueId| &fwd.values[v.0 as usize];
    let Expr::Binary(BinaryOp::Add, m, l) = at(v) else {
        return None;
    };
    let Expr::Unary(UnaryOp::Log, s) = at(*l) else {
        return None;
    };
    let (x, m2) = fwd.exp_sum_of_max(*s)?;
    (m2 == *m).then_some(x)
}

/// What row reduction `v` of `value` gives back to each element, its
/// adjoint being `a`.
fn reduction_grad(
    body: &mut Body,
    kind: RowReduce,
    value: ValueId,
    v: ValueId,
    a: ValueId,
) -> ValueId {
    match kind {
        RowReduce::Sum => a,
        // Every element equal to the maximum gets the gradient.
        RowReduce::Max => body.gate(Cond::ValLt(value, v), a, false),
    }
}

fn give(to: ValueId, c: ValueId, contrib: &mut BTreeMap<ValueId, Vec<ValueId>>) {
    contrib.entry(to).or_default().push(c);
}
