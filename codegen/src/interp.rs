//! A CPU interpreter of the kernel IR in `f32`: the reference every fused
//! kernel is tested against without a GPU, and the semantics CUDA emission keeps.

use crate::kernel::{
    draw_state, dropout_draw, Buffer, Cond, Elem, Expr, Idx, Kernel, RowReduce, Size,
};
use crate::CodegenError;
use dplc_ir::{BinaryOp, UnaryOp};

mod math;
pub use math::{binary, erf, erf_f64, unary, unary_grad};

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
    /// The dropout key's state after the run's seed and the step
    /// ([`crate::draw_seed`]); see [`crate::DrawKey`].
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
        self.len_of(&kernel.buffers[b])
    }

    /// Elements of a buffer of this launch's sizes.
    pub fn len_of(&self, buffer: &Buffer) -> usize {
        buffer
            .len
            .iter()
            .map(|&s| self.size(s))
            .product::<i64>()
            .max(0) as usize
    }
}

/// A kernel buffer as [`interpret_refs`] sees it.
pub enum BufferRef<'a> {
    /// Read only.
    Input(&'a Data),
    /// Written: its first elements (as many as the kernel's buffer has) are
    /// zeroed and then stored to; it must already hold that many elements of
    /// the buffer's type. Longer buffers keep their tail (a gradient padded to
    /// whole ZeRO parts).
    Output(&'a mut Data),
}

impl BufferRef<'_> {
    fn data(&self) -> &Data {
        match self {
            BufferRef::Input(d) => d,
            BufferRef::Output(d) => d,
        }
    }
}

/// Run `kernel` on the CPU. `buffers` holds one entry per kernel buffer; output
/// buffers are (re)sized to their length and filled.
pub fn interpret(kernel: &Kernel, args: &Args, buffers: &mut [Data]) -> Result<(), CodegenError> {
    check_arity(kernel, args, buffers.len())?;
    for (b, buf) in kernel.buffers.iter().enumerate() {
        if buf.output {
            let len = args.buffer_len(kernel, b);
            buffers[b] = match buf.elem {
                Elem::Float | Elem::F32 => Data::F32(vec![0.0; len]),
                Elem::I32 => Data::I32(vec![0; len]),
            };
        }
    }
    let mut refs: Vec<BufferRef> = buffers
        .iter_mut()
        .zip(&kernel.buffers)
        .map(|(d, b)| {
            if b.output {
                BufferRef::Output(d)
            } else {
                BufferRef::Input(d)
            }
        })
        .collect();
    interpret_refs(kernel, args, &mut refs)
}

/// Run `kernel` on the CPU over borrowed buffers, one per kernel buffer, so a
/// caller holding device-like buffers copies nothing (see [`BufferRef`]).
pub fn interpret_refs(
    kernel: &Kernel,
    args: &Args,
    buffers: &mut [BufferRef],
) -> Result<(), CodegenError> {
    check_arity(kernel, args, buffers.len())?;
    let program = Program::compile(kernel, args, buffers)?;
    for (b, buf) in kernel.buffers.iter().enumerate() {
        let len = args.buffer_len(kernel, b);
        match (&mut buffers[b], buf.output) {
            (BufferRef::Output(d), true) => {
                let ok = match (&mut **d, buf.elem) {
                    (Data::F32(v), Elem::Float | Elem::F32) if v.len() >= len => {
                        v[..len].fill(0.0);
                        true
                    }
                    (Data::I32(v), Elem::I32) if v.len() >= len => {
                        v[..len].fill(0);
                        true
                    }
                    _ => false,
                };
                if !ok {
                    return Err(program.err(format!(
                        "output b{b} ({}) needs {len} elements of its type, the buffer has {}",
                        buf.label,
                        d.len()
                    )));
                }
            }
            (BufferRef::Input(_), false) => {}
            _ => {
                return Err(program.err(format!(
                    "b{b} ({}) is bound as the wrong direction",
                    buf.label
                )))
            }
        }
    }
    program.run(buffers)
}

fn check_arity(kernel: &Kernel, args: &Args, buffers: usize) -> Result<(), CodegenError> {
    if buffers != kernel.buffers.len()
        || args.sizes.len() < kernel.sizes
        || args.scalars.len() < kernel.scalars
    {
        return Err(CodegenError::Interpret {
            kernel: kernel.op.clone(),
            detail: format!(
                "{buffers} buffers, {} sizes and {} scalars given, the kernel takes {}, {} and {}",
                args.sizes.len(),
                args.scalars.len(),
                kernel.buffers.len(),
                kernel.sizes,
                kernel.scalars
            ),
        });
    }
    Ok(())
}

// ---- the compiled form -------------------------------------------------------
//
// A launch compiles the kernel once into two flat register programs (indices
// in `i64`, values in `f32`) with sizes and scalars folded in, and runs them
// over *groups* of points: one row at a time in a row kernel (the lanes are
// the row's `j`), a chunk of consecutive points in an elementwise kernel (the
// lanes are the points). Each instruction then loops over its lanes, so the
// interpretive overhead is paid once per group instead of once per element,
// and a register that does not vary over the lanes holds one value. The
// arithmetic, the order of each row reduction and the order of the stores are
// the tree-walking definition's, so results are the same bits.

/// Points per group of an elementwise kernel.
const CHUNK: usize = 256;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum IBin {
    Add,
    Sub,
    Mul,
    Div,
    Rem,
    Min,
    Max,
}

/// An index instruction; operands are earlier index registers.
#[derive(Clone, Copy, Debug)]
enum IOp {
    /// Outer axis `a`: per lane in an elementwise kernel, per row in a row kernel.
    Var(usize),
    /// The row's `j` (lanes of a row kernel).
    Inner,
    Const(i64),
    Bin(IBin, u32, u32),
    /// An `i32` read from an index buffer.
    Load(usize, u32),
}

/// A value instruction; `Idx` operands are index registers, the others value
/// registers (value `v{k}` lives in register `k`).
#[derive(Clone, Copy, Debug)]
enum VOp {
    Load(usize, u32),
    Const(f32),
    FromIndex(u32),
    Unary(UnaryOp, u32),
    UnaryGrad(UnaryOp, u32),
    Binary(BinaryOp, u32, u32),
    SelectIdx(u32, u32, u32, u32),
    SelectVal(u32, u32, u32, u32),
    Reduce(RowReduce, u32),
    /// A running sum along the row (`true`: from its end).
    Scan(bool, u32),
    /// A dropout draw: its key in [`Program::draws`], then the index.
    Random(u32, u32),
}

/// A dropout key resolved for a launch: the state after seed, step, node and
/// layer, the first sample and the elements per sample.
#[derive(Clone, Copy, Debug)]
struct Draw {
    state: u64,
    first_sample: i64,
    per_sample: i64,
}

/// Where an instruction's result varies.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Varies {
    /// The same for the whole launch: computed once.
    Never,
    /// The same for every lane of a group.
    PerGroup,
    /// One value per lane.
    PerLane,
}

struct CStore {
    buf: usize,
    index: u32,
    value: u32,
    accumulate: bool,
}

struct Program<'k> {
    kernel: &'k Kernel,
    draws: Vec<Draw>,
    outer: Vec<i64>,
    /// Row length of a row kernel.
    inner: Option<usize>,
    iops: Vec<(IOp, Varies)>,
    vops: Vec<(VOp, Varies)>,
    stores: Vec<CStore>,
    /// Some load reads an output buffer: run one point per group, so each
    /// point sees the stores of every earlier point, as the definition says.
    reads_outputs: bool,
}

struct Compiler<'a, 'k> {
    kernel: &'k Kernel,
    args: &'a Args,
    outputs: Vec<bool>,
    row: bool,
    iops: Vec<(IOp, Varies)>,
    memo: std::collections::HashMap<Idx, u32>,
    reads_outputs: bool,
}

impl Compiler<'_, '_> {
    fn push(&mut self, op: IOp, varies: Varies) -> u32 {
        self.iops.push((op, varies));
        self.iops.len() as u32 - 1
    }

    fn index(&mut self, idx: &Idx) -> u32 {
        if let Some(&r) = self.memo.get(idx) {
            return r;
        }
        let r = match idx {
            Idx::Var(a) => {
                let v = if self.row {
                    Varies::PerGroup
                } else {
                    Varies::PerLane
                };
                self.push(IOp::Var(*a), v)
            }
            Idx::Inner if self.row => self.push(IOp::Inner, Varies::PerLane),
            // Outside a row kernel the row index is 0.
            Idx::Inner => self.push(IOp::Const(0), Varies::Never),
            Idx::Const(c) => self.push(IOp::Const(*c), Varies::Never),
            Idx::Size(s) => self.push(IOp::Const(self.args.size(*s)), Varies::Never),
            Idx::Add(a, b) => self.bin(IBin::Add, a, b),
            Idx::Sub(a, b) => self.bin(IBin::Sub, a, b),
            Idx::Mul(a, b) => self.bin(IBin::Mul, a, b),
            Idx::Div(a, b) => self.bin(IBin::Div, a, b),
            Idx::Rem(a, b) => self.bin(IBin::Rem, a, b),
            Idx::Min(a, b) => self.bin(IBin::Min, a, b),
            Idx::Max(a, b) => self.bin(IBin::Max, a, b),
            Idx::Load(buf, i) => {
                let i = self.index(i);
                let v = self.load_varies(*buf, self.iops[i as usize].1);
                self.push(IOp::Load(*buf, i), v)
            }
        };
        self.memo.insert(idx.clone(), r);
        r
    }

    fn bin(&mut self, op: IBin, a: &Idx, b: &Idx) -> u32 {
        let (a, b) = (self.index(a), self.index(b));
        let (ia, ib) = (self.iops[a as usize], self.iops[b as usize]);
        // Fold constants, except a division by zero, which errors if it runs.
        if let ((IOp::Const(x), _), (IOp::Const(y), _)) = (ia, ib) {
            if !(matches!(op, IBin::Div | IBin::Rem) && y == 0) {
                return self.push(IOp::Const(ibin(op, x, y)), Varies::Never);
            }
        }
        self.push(IOp::Bin(op, a, b), ia.1.max(ib.1))
    }

    /// A load is launch-invariant only from an input at an invariant index.
    fn load_varies(&mut self, buf: usize, index: Varies) -> Varies {
        if self.outputs.get(buf).copied().unwrap_or(false) {
            self.reads_outputs = true;
            return index.max(Varies::PerGroup);
        }
        index
    }
}

fn ibin(op: IBin, a: i64, b: i64) -> i64 {
    match op {
        IBin::Add => a + b,
        IBin::Sub => a - b,
        IBin::Mul => a * b,
        IBin::Div => a.div_euclid(b),
        IBin::Rem => a.rem_euclid(b),
        IBin::Min => a.min(b),
        IBin::Max => a.max(b),
    }
}

impl<'k> Program<'k> {
    fn compile(
        kernel: &'k Kernel,
        args: &Args,
        buffers: &[BufferRef],
    ) -> Result<Program<'k>, CodegenError> {
        let row = kernel.is_row_kernel();
        let mut c = Compiler {
            kernel,
            args,
            outputs: kernel.buffers.iter().map(|b| b.output).collect(),
            row,
            iops: Vec::new(),
            memo: Default::default(),
            reads_outputs: false,
        };
        let err = |detail: String| CodegenError::Interpret {
            kernel: c.kernel.op.clone(),
            detail,
        };
        let buf_ok = |buf: usize| -> Result<(), CodegenError> {
            if buf < buffers.len() {
                Ok(())
            } else {
                Err(err(format!("b{buf} is not a buffer of the kernel")))
            }
        };
        let mut vops: Vec<(VOp, Varies)> = Vec::with_capacity(kernel.values.len());
        let mut draws: Vec<Draw> = Vec::new();
        for (k, e) in kernel.values.iter().enumerate() {
            let operand = |v: crate::kernel::ValueId| -> Result<(u32, Varies), CodegenError> {
                vops.get(v.0 as usize)
                    .map(|&(_, w)| (v.0, w))
                    .ok_or_else(|| err(format!("v{k} reads v{}, not an earlier value", v.0)))
            };
            let op = match e {
                Expr::Load { buf, index } => {
                    buf_ok(*buf)?;
                    let i = c.index(index);
                    let w = c.load_varies(*buf, c.iops[i as usize].1);
                    (VOp::Load(*buf, i), w)
                }
                Expr::Const(x) => (VOp::Const(*x as f32), Varies::Never),
                Expr::Scalar(s) => {
                    let x = args
                        .scalars
                        .get(*s)
                        .ok_or_else(|| err(format!("scalar s{s} is not given")))?;
                    (VOp::Const(*x), Varies::Never)
                }
                Expr::FromIndex(i) => {
                    let i = c.index(i);
                    (VOp::FromIndex(i), c.iops[i as usize].1)
                }
                Expr::Unary(op, a) => {
                    let (a, w) = operand(*a)?;
                    (VOp::Unary(*op, a), w)
                }
                Expr::UnaryGrad(op, a) => {
                    let (a, w) = operand(*a)?;
                    (VOp::UnaryGrad(*op, a), w)
                }
                Expr::Binary(op, a, b) => {
                    let ((a, wa), (b, wb)) = (operand(*a)?, operand(*b)?);
                    (VOp::Binary(*op, a, b), wa.max(wb))
                }
                Expr::Select {
                    cond,
                    then,
                    otherwise,
                } => {
                    let ((t, wt), (o, wo)) = (operand(*then)?, operand(*otherwise)?);
                    let (op, wc) = match cond {
                        Cond::IdxLt(a, b) => {
                            let (a, b) = (c.index(a), c.index(b));
                            let w = c.iops[a as usize].1.max(c.iops[b as usize].1);
                            (VOp::SelectIdx(a, b, t, o), w)
                        }
                        Cond::ValLt(a, b) => {
                            let ((a, wa), (b, wb)) = (operand(*a)?, operand(*b)?);
                            (VOp::SelectVal(a, b, t, o), wa.max(wb))
                        }
                    };
                    (op, wc.max(wt).max(wo))
                }
                Expr::Reduce { kind, value } => {
                    if !row {
                        return Err(err("a row reduction outside a row kernel".into()));
                    }
                    let (a, w) = operand(*value)?;
                    (VOp::Reduce(*kind, a), w.min(Varies::PerGroup))
                }
                Expr::Scan { value, reverse } => {
                    if !row {
                        return Err(err("a running sum outside a row kernel".into()));
                    }
                    let (a, _) = operand(*value)?;
                    (VOp::Scan(*reverse, a), Varies::PerLane)
                }
                Expr::Random { key, index } => {
                    let i = c.index(index);
                    draws.push(Draw {
                        state: draw_state(args.seed, key.node, args.size(key.layer)),
                        first_sample: args.size(key.first_sample),
                        per_sample: args.size(key.per_sample),
                    });
                    (VOp::Random(draws.len() as u32 - 1, i), c.iops[i as usize].1)
                }
            };
            vops.push(op);
        }
        let mut stores = Vec::with_capacity(kernel.stores.len());
        for st in &kernel.stores {
            buf_ok(st.buf)?;
            if vops.get(st.value.0 as usize).is_none() {
                return Err(err(format!(
                    "a store of {}, which is not a value",
                    st.value
                )));
            }
            stores.push(CStore {
                buf: st.buf,
                index: c.index(&st.index),
                value: st.value.0,
                accumulate: st.accumulate,
            });
        }
        for &(op, _) in &c.iops {
            if let IOp::Load(buf, _) = op {
                buf_ok(buf)?;
            }
        }
        Ok(Program {
            kernel,
            draws,
            outer: kernel.space.outer.iter().map(|&s| args.size(s)).collect(),
            inner: kernel.space.inner.map(|s| args.size(s).max(0) as usize),
            iops: c.iops,
            vops,
            stores,
            reads_outputs: c.reads_outputs,
        })
    }

    fn err(&self, detail: String) -> CodegenError {
        CodegenError::Interpret {
            kernel: self.kernel.op.clone(),
            detail,
        }
    }

    fn run(&self, buffers: &mut [BufferRef]) -> Result<(), CodegenError> {
        let points: i64 = self.outer.iter().product();
        if points <= 0 {
            return Ok(());
        }
        let group = match self.inner {
            Some(n) => n,
            None if self.reads_outputs => 1,
            None => CHUNK.min(points as usize),
        };
        let mut regs = Regs {
            idx: vec![Reg::default(); self.iops.len()],
            val: vec![Reg::default(); self.vops.len()],
            vars: vec![Reg::default(); self.outer.len()],
            lanes: group,
        };
        // Launch invariants first, once.
        self.eval_index(&mut regs, buffers, Some(Varies::Never))?;
        self.eval_values(&mut regs, buffers, Some(Varies::Never))?;
        let step = if self.inner.is_some() {
            1
        } else {
            group as i64
        };
        let mut first = 0i64;
        while first < points {
            let count = if self.inner.is_some() {
                1
            } else {
                (points - first).min(step) as usize
            };
            if self.inner.is_none() {
                regs.lanes = count;
            }
            self.set_vars(&mut regs, first, count);
            self.eval_index(&mut regs, buffers, None)?;
            self.eval_values(&mut regs, buffers, None)?;
            self.store(&regs, buffers, count)?;
            first += count as i64;
        }
        Ok(())
    }

    /// The outer indices of points `first..first + count`: per lane in an
    /// elementwise kernel, one row's in a row kernel.
    fn set_vars(&self, regs: &mut Regs, first: i64, count: usize) {
        let per_lane = self.inner.is_none();
        for a in 0..self.outer.len() {
            let r = &mut regs.vars[a];
            r.data.clear();
            r.lanes = per_lane;
            // The stride of axis `a` in the row-major flat index.
            let inner: i64 = self.outer[a + 1..].iter().product();
            let extent = self.outer[a];
            r.data
                .extend((0..count as i64).map(|l| ((first + l) / inner) % extent));
        }
    }

    fn eval_index(
        &self,
        regs: &mut Regs,
        buffers: &[BufferRef],
        only: Option<Varies>,
    ) -> Result<(), CodegenError> {
        let n = regs.lanes;
        for (k, &(op, varies)) in self.iops.iter().enumerate() {
            if !runs(varies, only) {
                continue;
            }
            let mut out = std::mem::take(&mut regs.idx[k]);
            out.data.clear();
            out.lanes = varies == Varies::PerLane;
            match op {
                IOp::Var(a) => {
                    let v = &regs.vars[a];
                    out.lanes = v.lanes;
                    out.data.extend_from_slice(&v.data);
                }
                IOp::Inner => out.data.extend(0..n as i64),
                IOp::Const(c) => out.data.push(c),
                IOp::Bin(op, a, b) => {
                    let (a, b) = (&regs.idx[a as usize], &regs.idx[b as usize]);
                    if matches!(op, IBin::Div | IBin::Rem) && b.data.contains(&0) {
                        return Err(self.err("an index divides by zero".into()));
                    }
                    match op {
                        IBin::Add => map2(a, b, n, &mut out, |x, y| x + y),
                        IBin::Sub => map2(a, b, n, &mut out, |x, y| x - y),
                        IBin::Mul => map2(a, b, n, &mut out, |x, y| x * y),
                        IBin::Div => map2(a, b, n, &mut out, i64::div_euclid),
                        IBin::Rem => map2(a, b, n, &mut out, i64::rem_euclid),
                        IBin::Min => map2(a, b, n, &mut out, i64::min),
                        IBin::Max => map2(a, b, n, &mut out, i64::max),
                    }
                }
                IOp::Load(buf, i) => {
                    let i = &regs.idx[i as usize];
                    match buffers[buf].data() {
                        Data::I32(v) => {
                            self.check(buf, &i.data, v.len())?;
                            out.data
                                .extend(i.data.iter().map(|&x| i64::from(v[x as usize])));
                        }
                        Data::F32(_) => {
                            return Err(self.err(format!("b{buf} holds floats, not indices")))
                        }
                    }
                }
            }
            regs.idx[k] = out;
        }
        Ok(())
    }

    /// Every index in `at` within `len` elements of `buf`.
    fn check(&self, buf: usize, at: &[i64], len: usize) -> Result<(), CodegenError> {
        match at.iter().find(|&&x| x < 0 || x as u64 >= len as u64) {
            Some(x) => Err(self.err(format!("b{buf}[{x}] is outside its {len} elements"))),
            None => Ok(()),
        }
    }

    fn eval_values(
        &self,
        regs: &mut Regs,
        buffers: &[BufferRef],
        only: Option<Varies>,
    ) -> Result<(), CodegenError> {
        let n = regs.lanes;
        for (k, &(op, varies)) in self.vops.iter().enumerate() {
            if !runs(varies, only) {
                continue;
            }
            let mut out = std::mem::take(&mut regs.val[k]);
            out.data.clear();
            out.lanes = varies == Varies::PerLane;
            let v = |r: u32| &regs.val[r as usize];
            match op {
                VOp::Load(buf, i) => {
                    let i = &regs.idx[i as usize];
                    match buffers[buf].data() {
                        Data::F32(d) => {
                            self.check(buf, &i.data, d.len())?;
                            out.data.extend(i.data.iter().map(|&x| d[x as usize]));
                        }
                        Data::I32(d) => {
                            self.check(buf, &i.data, d.len())?;
                            out.data
                                .extend(i.data.iter().map(|&x| d[x as usize] as f32));
                        }
                    }
                }
                VOp::Const(c) => out.data.push(c),
                VOp::FromIndex(i) => {
                    let i = &regs.idx[i as usize];
                    out.data.extend(i.data.iter().map(|&x| x as f32));
                }
                VOp::Unary(op, a) => out.data.extend(v(a).data.iter().map(|&x| unary(op, x))),
                VOp::UnaryGrad(op, a) => out
                    .data
                    .extend(v(a).data.iter().map(|&x| unary_grad(op, x))),
                VOp::Binary(op, a, b) => {
                    let (a, b) = (v(a), v(b));
                    match op {
                        BinaryOp::Add => map2(a, b, n, &mut out, |x, y| x + y),
                        BinaryOp::Sub => map2(a, b, n, &mut out, |x, y| x - y),
                        BinaryOp::Mul => map2(a, b, n, &mut out, |x, y| x * y),
                        BinaryOp::Div => map2(a, b, n, &mut out, |x, y| x / y),
                        op => map2(a, b, n, &mut out, |x, y| binary(op, x, y)),
                    }
                }
                VOp::SelectIdx(a, b, t, o) => {
                    let (a, b) = (&regs.idx[a as usize], &regs.idx[b as usize]);
                    let (t, o) = (v(t), v(o));
                    out.data.extend((0..lanes(&out, n)).map(|l| {
                        if a.at(l) < b.at(l) {
                            t.at(l)
                        } else {
                            o.at(l)
                        }
                    }));
                }
                VOp::SelectVal(a, b, t, o) => {
                    let (a, b, t, o) = (v(a), v(b), v(t), v(o));
                    out.data.extend((0..lanes(&out, n)).map(|l| {
                        if a.at(l) < b.at(l) {
                            t.at(l)
                        } else {
                            o.at(l)
                        }
                    }));
                }
                VOp::Reduce(kind, a) => {
                    let a = v(a);
                    // A value that does not vary along the row is the same at every `j`.
                    let xs = (0..n).map(|j| a.at(j));
                    out.data.push(match kind {
                        // Accumulated in f64 and rounded once, as the
                        // reference's sums are: a GPU's tree of partial sums
                        // is near that, a running f32 sum over thousands of
                        // elements is not (a gradient norm off by 1e-6 moves
                        // every clipped parameter by as much).
                        RowReduce::Sum => xs.fold(0.0f64, |acc, x| acc + f64::from(x)) as f32,
                        RowReduce::Max => xs.fold(f32::NEG_INFINITY, f32::max),
                    });
                }
                VOp::Scan(reverse, a) => {
                    // In f32, in order along the row, as the reference sums.
                    let a = v(a);
                    out.data.resize(n, 0.0);
                    let mut acc = 0.0f32;
                    let mut add = |j: usize| {
                        acc += a.at(j);
                        out.data[j] = acc;
                    };
                    if reverse {
                        (0..n).rev().for_each(&mut add);
                    } else {
                        (0..n).for_each(&mut add);
                    }
                }
                VOp::Random(d, i) => {
                    let d = self.draws[d as usize];
                    let i = &regs.idx[i as usize];
                    out.data.extend(
                        i.data
                            .iter()
                            .map(|&x| dropout_draw(d.state, d.first_sample, d.per_sample, x)),
                    );
                }
            }
            regs.val[k] = out;
        }
        Ok(())
    }

    /// The group's stores, point by point and in kernel order within a point,
    /// as the definition lands them.
    fn store(
        &self,
        regs: &Regs,
        buffers: &mut [BufferRef],
        count: usize,
    ) -> Result<(), CodegenError> {
        let row = self.inner;
        let points = if row.is_some() { 1 } else { count };
        for p in 0..points {
            for st in &self.stores {
                let (at, x) = (&regs.idx[st.index as usize], &regs.val[st.value as usize]);
                let js = match row {
                    Some(n) if at.lanes || x.lanes => n,
                    _ => 1,
                };
                let BufferRef::Output(d) = &mut buffers[st.buf] else {
                    return Err(self.err(format!("a store to b{}, an input", st.buf)));
                };
                for j in 0..js {
                    let l = if row.is_some() { j } else { p };
                    let (at, x) = (at.at(l), x.at(l));
                    let len = d.len();
                    let slot = usize::try_from(at)
                        .ok()
                        .filter(|&i| i < len)
                        .ok_or_else(|| {
                            self.err(format!(
                                "store to b{}[{at}] is outside its {len} elements",
                                st.buf
                            ))
                        })?;
                    match &mut **d {
                        Data::F32(v) if st.accumulate => v[slot] += x,
                        Data::F32(v) => v[slot] = x,
                        Data::I32(v) => v[slot] = x as i32,
                    }
                }
            }
        }
        Ok(())
    }
}

/// Whether an instruction that varies as `varies` runs in this pass: the
/// launch-invariant pass runs only those, each group every other one.
fn runs(varies: Varies, only: Option<Varies>) -> bool {
    match only {
        Some(v) => varies == v,
        None => varies != Varies::Never,
    }
}

/// A register: one value, or one per lane.
#[derive(Clone, Default)]
struct Reg<T> {
    lanes: bool,
    data: Vec<T>,
}

impl<T: Copy> Reg<T> {
    #[inline]
    fn at(&self, l: usize) -> T {
        if self.lanes {
            self.data[l]
        } else {
            self.data[0]
        }
    }
}

struct Regs {
    idx: Vec<Reg<i64>>,
    val: Vec<Reg<f32>>,
    vars: Vec<Reg<i64>>,
    /// Lanes of the current group.
    lanes: usize,
}

fn lanes<T>(out: &Reg<T>, n: usize) -> usize {
    if out.lanes {
        n
    } else {
        1
    }
}

/// `out = f(a, b)` lane by lane, a register with one value standing for all.
#[inline]
fn map2<T: Copy, U>(a: &Reg<T>, b: &Reg<T>, n: usize, out: &mut Reg<U>, f: impl Fn(T, T) -> U) {
    match (a.lanes, b.lanes) {
        (true, true) => out
            .data
            .extend(a.data[..n].iter().zip(&b.data[..n]).map(|(&x, &y)| f(x, y))),
        (true, false) => {
            let y = b.data[0];
            out.data.extend(a.data[..n].iter().map(|&x| f(x, y)));
        }
        (false, true) => {
            let x = a.data[0];
            out.data.extend(b.data[..n].iter().map(|&y| f(x, y)));
        }
        (false, false) => out.data.push(f(a.data[0], b.data[0])),
    }
    out.lanes = a.lanes || b.lanes;
}

#[cfg(test)]
mod tests {
    use super::*;

    /// erf against tabulated values (Abramowitz & Stegun Table 7.1) within
    /// the fit's 1.2e-7, odd, and saturating.
    #[test]
    fn erf_matches_the_table() {
        for (x, want) in [
            (0.1, 0.112_462_916_0),
            (0.5, 0.520_499_877_8),
            (1.0, 0.842_700_792_9),
            (2.0, 0.995_322_265_0),
        ] {
            assert!(
                (erf_f64(x) - want).abs() < 1.2e-7,
                "erf({x}) = {}",
                erf_f64(x)
            );
            assert_eq!(erf_f64(-x), -erf_f64(x));
        }
        assert!(erf_f64(0.0).abs() < 1.2e-7);
        assert!((erf_f64(6.0) - 1.0).abs() < 1e-12);
        assert_eq!(erf(0.5), erf_f64(0.5) as f32);
    }
}
