//! What each e-class knows: the logical (global) shape, the layout over each
//! mesh axis, and whether it is a weight, a constant or an activation.
//! The layout of an op e-node follows from its operands' by [`operand_options`].

use super::lang::{MeshAxis, OpTag, ShardLang};
use dplc_ir::{BinaryOp, Dim, Op, ReduceKind, TensorId, UnaryOp};
use egg::{DidMerge, EGraph, Id};
use std::collections::BTreeMap;
use std::sync::Arc;

/// How one mesh axis divides a tensor.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Part {
    Replicated,
    Sharded(usize),
    /// Each rank holds a summand.
    Partial,
}

/// A tensor's part over every mesh axis.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Layout(pub [Part; 3]);

impl Layout {
    pub const REPLICATED: Layout = Layout([Part::Replicated; 3]);

    pub fn get(&self, m: MeshAxis) -> Part {
        self.0[m.index()]
    }

    pub fn with(mut self, m: MeshAxis, p: Part) -> Layout {
        self.0[m.index()] = p;
        self
    }

    pub fn is_replicated(&self) -> bool {
        *self == Layout::REPLICATED
    }
}

/// One IR op of the region, as the analysis and the rules see it.
#[derive(Clone, Debug)]
pub struct OpInfo {
    pub op: Op,
    pub inputs: Vec<TensorId>,
    pub outputs: Vec<TensorId>,
    /// Shapes of the inputs and the outputs.
    pub in_shapes: Vec<Vec<Dim>>,
    pub out_shapes: Vec<Vec<Dim>>,
}

/// Everything about the region and the mesh the e-graph needs, shared by the
/// analysis, the rules' conditions and the cost.
#[derive(Clone, Debug)]
pub struct Context {
    pub ops: BTreeMap<dplc_ir::NodeId, OpInfo>,
    /// Shapes of the region's arguments.
    pub args: Vec<Vec<Dim>>,
    /// Whether each argument's gradient is needed (or it carries data).
    pub arg_grad: Vec<bool>,
    /// The sequence axis each argument arrives split along (sequence parallelism).
    pub local_args: Vec<Option<usize>>,
    /// Degree of each mesh axis (1 = not used).
    pub degree: [u64; 3],
    pub sequence_parallel: bool,
    /// The symbol of the sequence length, if the model has one.
    pub seq_sym: Option<dplc_ir::SymId>,
    pub batch_sym: Option<dplc_ir::SymId>,
}

impl Context {
    pub fn degree(&self, m: MeshAxis) -> u64 {
        self.degree[m.index()]
    }

    pub fn op(&self, tag: OpTag) -> &OpInfo {
        self.ops
            .get(&tag.node)
            .expect("every tag names an op of the region")
    }

    /// Whether axis `axis` of a dimension list splits evenly `degree` ways:
    /// symbolic dims (batch, sequence) are taken to split.
    pub fn splits(&self, shape: &[Dim], axis: usize, m: MeshAxis) -> bool {
        let d = self.degree(m) as i64;
        match shape.get(axis) {
            Some(dim) => match dim.as_const() {
                Some(n) => d > 1 && n % d == 0 && n >= d,
                None => d > 1,
            },
            None => false,
        }
    }

    /// Whether the dim is a token dim (holds the batch or sequence symbol).
    pub fn is_token_dim(&self, shape: &[Dim], axis: usize) -> bool {
        shape.get(axis).is_some_and(|d| d.as_const().is_none())
    }

    /// The sequence axis of a shape: the first dim that holds `seq`.
    pub fn seq_axis(&self, shape: &[Dim]) -> Option<usize> {
        let s = self.seq_sym?;
        shape.iter().position(|d| d.syms().contains(&s))
    }
}

/// What a tensor class is made of.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Flags {
    /// Computed from parameters only (a weight or a view of one).
    pub weight: bool,
    /// Computed from neither parameters nor data (iota, constants).
    pub constant: bool,
    /// Depends on a parameter: its gradient is needed.
    pub grad: bool,
}

/// The analysis data of an e-class.
#[derive(Clone, Debug, PartialEq)]
pub enum Data {
    Tensor {
        shape: Vec<Dim>,
        layout: Option<Layout>,
        flags: Flags,
    },
    Mesh(MeshAxis),
    Tag(OpTag),
    Num(i64),
}

impl Data {
    pub fn shape(&self) -> &[Dim] {
        match self {
            Data::Tensor { shape, .. } => shape,
            _ => &[],
        }
    }

    /// The layout; `None` for a class no valid local program computes.
    pub fn layout(&self) -> Option<Layout> {
        match self {
            Data::Tensor { layout, .. } => *layout,
            _ => None,
        }
    }

    pub fn flags(&self) -> Flags {
        match self {
            Data::Tensor { flags, .. } => *flags,
            _ => Flags {
                weight: false,
                constant: true,
                grad: false,
            },
        }
    }
}

/// The e-graph analysis: holds the region's context.
#[derive(Clone, Debug)]
pub struct ShardAnalysis {
    pub ctx: Arc<Context>,
    /// Merges of classes with different layouts (a rule bug if non-zero).
    pub conflicts: usize,
}

pub type ShardGraph = EGraph<ShardLang, ShardAnalysis>;

pub fn mesh_of(eg: &ShardGraph, id: Id) -> Option<MeshAxis> {
    match eg[id].data {
        Data::Mesh(m) => Some(m),
        _ => None,
    }
}

pub fn num_of(eg: &ShardGraph, id: Id) -> Option<i64> {
    match eg[id].data {
        Data::Num(n) => Some(n),
        _ => None,
    }
}

pub fn tag_of(eg: &ShardGraph, id: Id) -> Option<OpTag> {
    match eg[id].data {
        Data::Tag(t) => Some(t),
        _ => None,
    }
}

impl egg::Analysis<ShardLang> for ShardAnalysis {
    type Data = Data;

    fn make(eg: &ShardGraph, n: &ShardLang) -> Data {
        use ShardLang::*;
        let ctx = &eg.analysis.ctx;
        let d = |id: &Id| &eg[*id].data;
        let wrap = |child: &Id, f: &dyn Fn(Layout) -> Option<Layout>| {
            let c = d(child);
            Data::Tensor {
                shape: c.shape().to_vec(),
                layout: c.layout().and_then(f),
                flags: c.flags(),
            }
        };
        match n {
            Mesh(m) => Data::Mesh(*m),
            Tag(t) => Data::Tag(*t),
            Num(k) => Data::Num(*k),
            Shard([m, a, x]) => {
                let (m, a) = (mesh_of(eg, *m), num_of(eg, *a));
                wrap(x, &|l| match (m, a) {
                    (Some(m), Some(a)) if l.get(m) == Part::Replicated => {
                        Some(l.with(m, Part::Sharded(a as usize)))
                    }
                    _ => None,
                })
            }
            Partial([m, x]) => {
                let m = mesh_of(eg, *m);
                wrap(x, &|l| match m {
                    Some(m) if l.get(m) == Part::Replicated => Some(l.with(m, Part::Partial)),
                    _ => None,
                })
            }
            AllReduce([m, x]) => {
                let m = mesh_of(eg, *m);
                wrap(x, &|l| match m {
                    Some(m) if l.get(m) == Part::Partial => Some(l.with(m, Part::Replicated)),
                    _ => None,
                })
            }
            AllGather([m, a, x]) => {
                let (m, a) = (mesh_of(eg, *m), num_of(eg, *a));
                wrap(x, &|l| match (m, a) {
                    (Some(m), Some(a)) if l.get(m) == Part::Sharded(a as usize) => {
                        Some(l.with(m, Part::Replicated))
                    }
                    _ => None,
                })
            }
            ReduceScatter([m, a, x]) => {
                let (m, a) = (mesh_of(eg, *m), num_of(eg, *a));
                wrap(x, &|l| match (m, a) {
                    (Some(m), Some(a)) if l.get(m) == Part::Partial => {
                        Some(l.with(m, Part::Sharded(a as usize)))
                    }
                    _ => None,
                })
            }
            AllToAll([m, a, x]) => {
                let (m, a) = (mesh_of(eg, *m), num_of(eg, *a));
                wrap(x, &|l| match (m, a) {
                    (Some(m), Some(a)) => match l.get(m) {
                        Part::Replicated => Some(l.with(m, Part::Sharded(a as usize))),
                        Part::Sharded(b) if b == a as usize => Some(l.with(m, Part::Replicated)),
                        _ => None,
                    },
                    _ => None,
                })
            }
            Arg(i) => {
                let i = num_of(eg, *i).unwrap_or(0) as usize;
                Data::Tensor {
                    shape: ctx.args.get(i).cloned().unwrap_or_default(),
                    layout: Some(Layout::REPLICATED),
                    flags: Flags {
                        weight: false,
                        constant: false,
                        grad: ctx.arg_grad.get(i).copied().unwrap_or(true),
                    },
                }
            }
            _ => {
                let (tag, operands) = n.tagged().expect("every other node is an IR op");
                let tag = tag_of(eg, tag).expect("an op's first child is its tag");
                let info = ctx.op(tag);
                let shape = info.out_shapes[tag.output as usize].clone();
                let ins: Vec<&Data> = operands.iter().map(d).collect();
                let flags = match info.op {
                    Op::Param(_) => Flags {
                        weight: true,
                        constant: false,
                        grad: true,
                    },
                    Op::Input(_) => Flags {
                        weight: false,
                        constant: false,
                        grad: false,
                    },
                    Op::Constant(_) | Op::Iota { .. } => Flags {
                        weight: false,
                        constant: true,
                        grad: false,
                    },
                    _ => {
                        let float = info.out_shapes.len() == 1 || tag.output == 0;
                        Flags {
                            weight: ins.iter().all(|c| c.flags().weight || c.flags().constant)
                                && ins.iter().any(|c| c.flags().weight),
                            constant: ins.iter().all(|c| c.flags().constant),
                            grad: float && ins.iter().any(|c| c.flags().grad),
                        }
                    }
                };
                let layout = infer_layout(ctx, tag, &ins);
                Data::Tensor {
                    shape,
                    layout,
                    flags,
                }
            }
        }
    }

    fn merge(&mut self, a: &mut Data, b: Data) -> DidMerge {
        if let (Some(la), Some(lb)) = (a.layout(), b.layout()) {
            if la != lb {
                self.conflicts += 1;
            }
        }
        match (a, b) {
            (
                Data::Tensor {
                    layout: la @ None, ..
                },
                Data::Tensor {
                    layout: Some(l), ..
                },
            ) => {
                *la = Some(l);
                DidMerge(true, false)
            }
            (
                Data::Tensor {
                    layout: Some(_), ..
                },
                Data::Tensor { layout: None, .. },
            ) => DidMerge(false, true),
            _ => DidMerge(false, false),
        }
    }
}

/// The layout an op e-node's output has, given its operands': the output part
/// on each mesh axis whose operand options match the operands' parts.
fn infer_layout(ctx: &Context, tag: OpTag, ins: &[&Data]) -> Option<Layout> {
    let mut out = Layout::REPLICATED;
    let info = ctx.op(tag);
    let rank = info.out_shapes[tag.output as usize].len();
    for m in MeshAxis::ALL {
        let have: Vec<Part> = ins
            .iter()
            .map(|c| c.layout().map(|l| l.get(m)))
            .collect::<Option<_>>()?;
        if have.iter().all(|p| *p == Part::Replicated) {
            continue;
        }
        let candidates = std::iter::once(Part::Partial).chain((0..rank).map(Part::Sharded));
        let found = candidates
            .into_iter()
            .find(|&p| operand_options(ctx, tag, p).contains(&have))?;
        out = out.with(m, found);
    }
    Some(out)
}

fn all(n: usize, p: Part) -> Vec<Part> {
    vec![p; n]
}

/// The operand parts under which op `tag` computes output part `out` locally,
/// most natural first. This single table is Megatron's rule read backwards
/// (what each operand must be for the output to be split this way); the
/// analysis reads it forwards and the rules' appliers use its first option.
pub fn operand_options(ctx: &Context, tag: OpTag, out: Part) -> Vec<Vec<Part>> {
    use Part::*;
    let info = ctx.op(tag);
    let n = info.inputs.len();
    let r = info.out_shapes[tag.output as usize].len();
    let rank_in = |i: usize| info.in_shapes[i].len();
    if out == Replicated {
        return vec![all(n, Replicated)];
    }
    let mut opts: Vec<Vec<Part>> = Vec::new();
    match (&info.op, out) {
        (Op::Unary(_) | Op::Cast(_) | Op::Dropout { .. }, Sharded(a)) => {
            opts.push(vec![Sharded(a)])
        }
        (Op::CausalMask, Sharded(a)) if a + 2 < r => opts.push(vec![Sharded(a)]),
        (Op::Unary(UnaryOp::Neg) | Op::Cast(_) | Op::Dropout { .. }, Partial) => {
            opts.push(vec![Partial])
        }
        (Op::Binary(_), Sharded(a)) => {
            let parts = (0..n)
                .map(|i| {
                    let off = r - rank_in(i);
                    match a.checked_sub(off) {
                        Some(ai) if !info.in_shapes[i][ai].is_one() => Sharded(ai),
                        _ => Replicated,
                    }
                })
                .collect();
            opts.push(parts);
        }
        (Op::Binary(b), Partial) => match b {
            BinaryOp::Add | BinaryOp::Sub => opts.push(all(2, Partial)),
            BinaryOp::Mul => {
                opts.push(vec![Partial, Replicated]);
                opts.push(vec![Replicated, Partial]);
            }
            BinaryOp::Div => opts.push(vec![Partial, Replicated]),
            _ => {}
        },
        (Op::LayerNorm { .. } | Op::RmsNorm { .. }, Sharded(a)) if a + 1 < r => {
            let mut v = all(n, Replicated);
            v[0] = Sharded(a);
            opts.push(v);
        }
        (Op::Softmax { .. } | Op::LogSoftmax { .. }, Sharded(a)) => opts.push(vec![Sharded(a)]),
        (Op::Reduce { axis, keep_dim, .. }, Sharded(a)) => {
            let ai = if !keep_dim && a >= *axis { a + 1 } else { a };
            if ai != *axis {
                opts.push(vec![Sharded(ai)]);
            }
        }
        (Op::Reduce { kind, axis, .. }, Partial) if *kind != ReduceKind::Max => {
            opts.push(vec![Partial]);
            opts.push(vec![Sharded(*axis)]);
        }
        (Op::MatMul, Sharded(a)) => {
            let (ra, rb) = (rank_in(0), rank_in(1));
            if a + 1 == r {
                opts.push(vec![Replicated, Sharded(rb - 1)]);
            } else if a + 2 == r {
                opts.push(vec![Sharded(ra - 2), Replicated]);
            } else {
                let side = |i: usize, ri: usize| match a.checked_sub(r - ri) {
                    Some(ai) if ai + 2 < ri && !info.in_shapes[i][ai].is_one() => Sharded(ai),
                    _ => Replicated,
                };
                opts.push(vec![side(0, ra), side(1, rb)]);
            }
        }
        (Op::MatMul, Partial) => opts.push(vec![Sharded(rank_in(0) - 1), Sharded(rank_in(1) - 2)]),
        (Op::Reshape { .. }, Sharded(a)) => {
            if let Some(i) = reshape_axis(ctx, &info.in_shapes[0], &info.out_shapes[0], a) {
                opts.push(vec![Sharded(i)]);
            }
        }
        (Op::Transpose { perm }, Sharded(a)) => opts.push(vec![Sharded(perm[a])]),
        // A split of an axis the input has: the same split of the input. A
        // split of a broadcast axis has no operand part that makes *this*
        // e-node sharded: from a replicated input the analysis reads the
        // output as replicated, so offering it would merge a sharded class
        // with a replicated one (multi-query attention's one KV head
        // broadcast to the heads did). The program takes a slice of the
        // replicated expansion instead.
        (Op::Expand { .. }, Sharded(a)) => {
            let off = r - rank_in(0);
            if let Some(ai) = a
                .checked_sub(off)
                .filter(|&ai| !info.in_shapes[0][ai].is_one())
            {
                opts.push(vec![Sharded(ai)]);
            }
        }
        (Op::Slice { axis, .. } | Op::Pad { axis, .. } | Op::CumSum { axis, .. }, Sharded(a))
            if a != *axis =>
        {
            opts.push(vec![Sharded(a)])
        }
        (Op::Concat { axis }, Sharded(a)) if a != *axis => opts.push(all(n, Sharded(a))),
        (
            Op::Reshape { .. }
            | Op::Transpose { .. }
            | Op::Expand { .. }
            | Op::Slice { .. }
            | Op::CumSum { .. },
            Partial,
        ) => opts.push(vec![Partial]),
        // Padding with zeros is linear; with another value the summands would
        // each add it.
        (Op::Pad { value, .. }, Partial) if *value == 0.0 => opts.push(vec![Partial]),
        (Op::Concat { .. }, Partial) => opts.push(all(n, Partial)),
        (Op::Embedding, Sharded(a)) if a + 1 == r => opts.push(vec![Sharded(1), Replicated]),
        (Op::Embedding, Sharded(a)) => opts.push(vec![Replicated, Sharded(a)]),
        (Op::Embedding, Partial) => opts.push(vec![Sharded(0), Replicated]),
        (Op::TakeAlong, Sharded(a)) => opts.push(vec![Sharded(a), Sharded(a)]),
        (Op::TakeAlong, Partial) => opts.push(vec![Sharded(rank_in(0) - 1), Replicated]),
        (Op::TopK { .. }, Sharded(a)) if a + 1 < r => opts.push(vec![Sharded(a)]),
        (Op::MoeCombine, Partial) => opts.push(vec![Partial, Replicated, Replicated]),
        (Op::MoeCombine, Sharded(1)) => opts.push(vec![Sharded(2), Replicated, Replicated]),
        _ => {}
    }
    opts
}

/// The input axis of a reshape whose even split is the output axis `a`'s:
/// both start at the same flat offset and both split `degree` ways.
fn reshape_axis(ctx: &Context, from: &[Dim], to: &[Dim], a: usize) -> Option<usize> {
    let prefix = |s: &[Dim], k: usize| dplc_ir::Shape(s[..k].to_vec()).numel();
    let want = prefix(to, a)?;
    let i =
        (0..from.len()).find(|&i| prefix(from, i).as_ref() == Some(&want) && !from[i].is_one())?;
    let ok = MeshAxis::ALL
        .iter()
        .filter(|m| ctx.degree(**m) > 1)
        .all(|&m| ctx.splits(from, i, m) && ctx.splits(to, a, m));
    ok.then_some(i)
}
