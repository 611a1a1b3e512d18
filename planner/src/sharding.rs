//! Tensor-parallel layout derived from the graph: Megatron's column/row rule
//! propagated forward over a region, giving split params, sharded tensors and collectives.
//!
//! This is the one place that decides layouts; the rest of the planner reads
//! only [`RegionSharding`]. A later issue replaces the propagation with an
//! e-graph search behind the same result type.

use dplc_ir::{Analysis, BinaryOp, Dim, Graph, NodeId, Op, ParamId, RegionId, Shape, TensorId};
use std::collections::{BTreeMap, BTreeSet};

/// How one matmul's work is divided over the tensor-parallel group.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GemmSplit {
    /// Weight split on its output dim; input replicated, output sharded.
    Column,
    /// Weight split on its input dim; input sharded, output a partial sum.
    Row,
    /// Both operands sharded on a batch axis (attention heads).
    Batch,
    /// Every rank does the whole matmul.
    Replicated,
}

/// The tensor-parallel collective kinds the rule inserts.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum TpCollectiveKind {
    /// Sum of partial results (row-parallel output, or the input gradient of a
    /// column-parallel matmul). Under sequence parallelism: reduce-scatter + all-gather.
    AllReduce,
    /// A sharded tensor needed whole.
    AllGather,
    /// Per-row statistics of a softmax over a sharded axis (vocab-parallel loss).
    RowStats,
}

/// Whether a collective runs in the forward or the backward pass.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Pass {
    Forward,
    Backward,
}

/// One collective per iteration of the region.
#[derive(Clone, Debug, PartialEq)]
pub struct TpCollective {
    pub kind: TpCollectiveKind,
    pub pass: Pass,
    /// The tensor it moves (its full, unsharded size).
    pub tensor: TensorId,
    pub elements: Dim,
    /// Bytes per element on the wire: activations travel in the training
    /// precision, row statistics in fp32.
    pub fp32: bool,
}

/// The layout of one region (a layer body, or the model's root for embedding and head).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct RegionSharding {
    /// Tensors split over the tensor-parallel group (by storage root).
    pub sharded: BTreeSet<TensorId>,
    /// How each matmul is split.
    pub gemms: BTreeMap<NodeId, GemmSplit>,
    /// Parameters split over tensor parallelism, with the split dimension.
    pub split_params: BTreeMap<ParamId, usize>,
    /// Parameters with a leading experts dimension: split over expert parallelism.
    pub expert_params: BTreeSet<ParamId>,
    pub collectives: Vec<TpCollective>,
    /// Elements each MoE all-to-all moves (dispatch and combine, per pass).
    pub all_to_all: Vec<Dim>,
    /// The largest tensor-parallel degree the layout allows: the gcd of every
    /// split dimension (heads, KV heads, hidden widths).
    pub max_tp: u64,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Layout {
    Replicated,
    Sharded(usize),
    Partial,
}

struct Propagation<'a> {
    g: &'a Graph,
    an: &'a Analysis<'a>,
    layout: BTreeMap<TensorId, Layout>,
    out: RegionSharding,
    /// Replicated inputs of column-parallel matmuls: their gradient is all-reduced once.
    column_inputs: BTreeSet<TensorId>,
    split_sizes: Vec<i64>,
    count_split_sizes: bool,
}

/// Propagate Megatron's rule over `region`. `count_limits` says whether the
/// split dims bound the tensor-parallel degree (not for the vocabulary, which
/// Megatron pads to a multiple of the degree).
pub fn propagate(g: &Graph, an: &Analysis, region: RegionId, count_limits: bool) -> RegionSharding {
    let mut p = Propagation {
        g,
        an,
        layout: BTreeMap::new(),
        out: RegionSharding::default(),
        column_inputs: BTreeSet::new(),
        split_sizes: Vec::new(),
        count_split_sizes: count_limits,
    };
    for &n in &g.region(region).nodes {
        p.node(n);
    }
    for &t in &p.column_inputs.clone() {
        if an.requires_grad(t) {
            p.out.collectives.push(TpCollective {
                kind: TpCollectiveKind::AllReduce,
                pass: Pass::Backward,
                tensor: t,
                elements: numel(&g.tensor(t).shape),
                fp32: false,
            });
        }
    }
    for (&t, &l) in &p.layout {
        if matches!(l, Layout::Sharded(_)) {
            p.out.sharded.insert(an.storage_root(t));
        }
    }
    p.out.max_tp = p.split_sizes.iter().fold(0i64, |a, &b| gcd(a, b)).max(1) as u64;
    p.out
}

fn gcd(a: i64, b: i64) -> i64 {
    if b == 0 {
        a
    } else {
        gcd(b, a % b)
    }
}

fn numel(s: &Shape) -> Dim {
    s.numel().unwrap_or_else(|| Dim::konst(0))
}

impl Propagation<'_> {
    fn get(&self, t: TensorId) -> Layout {
        self.layout.get(&t).copied().unwrap_or(Layout::Replicated)
    }

    fn set(&mut self, t: TensorId, l: Layout) {
        if let Layout::Sharded(axis) = l {
            if self.count_split_sizes {
                if let Some(n) = self.g.tensor(t).shape.dims()[axis].as_const() {
                    self.split_sizes.push(n);
                }
            }
        }
        self.layout.insert(t, l);
    }

    fn collective(&mut self, kind: TpCollectiveKind, t: TensorId) {
        self.out.collectives.push(TpCollective {
            kind,
            pass: Pass::Forward,
            tensor: t,
            elements: numel(&self.g.tensor(t).shape),
            fp32: false,
        });
    }

    /// Make `t` whole on every rank: all-reduce a partial sum, all-gather a shard.
    fn replicate(&mut self, t: TensorId) {
        match self.get(t) {
            Layout::Replicated => {}
            Layout::Partial => self.collective(TpCollectiveKind::AllReduce, t),
            Layout::Sharded(_) => self.collective(TpCollectiveKind::AllGather, t),
        }
        self.layout.insert(t, Layout::Replicated);
    }

    fn resolve_partial(&mut self, t: TensorId) {
        if self.get(t) == Layout::Partial {
            self.replicate(t);
        }
    }

    /// The parameter behind `t` (through views), with the view chain's transposes
    /// applied to `axis` so that the recorded split names the parameter's own dim.
    fn param_behind(&self, mut t: TensorId, mut axis: usize) -> Option<(ParamId, usize)> {
        loop {
            let node = self.g.producer(t)?;
            match &node.op {
                Op::Param(p) => return Some((*p, axis)),
                Op::Transpose { perm } => axis = perm[axis],
                Op::Cast(_) => {}
                Op::Reshape { .. } | Op::Expand { .. } | Op::Slice { .. } => {}
                _ => return None,
            }
            t = node.inputs[0];
        }
    }

    fn split_param(&mut self, t: TensorId, axis: usize) {
        if let Some((p, dim)) = self.param_behind(t, axis) {
            let dims = self.g.param(p).shape.dims();
            let dim = dim.min(dims.len().saturating_sub(1));
            self.out.split_params.entry(p).or_insert(dim);
            if self.count_split_sizes {
                if let Some(n) = dims[dim].as_const() {
                    self.split_sizes.push(n);
                }
            }
        }
    }

    fn is_weight(&self, t: TensorId) -> bool {
        !self.an.is_activation(t) && self.param_behind(t, 0).is_some()
    }

    fn node(&mut self, n: NodeId) {
        let g = self.g;
        let node = g.node(n);
        let ins = node.inputs.clone();
        let outs = node.outputs.clone();
        let rank = |t: TensorId| g.tensor(t).shape.rank();
        match &node.op {
            Op::Input(_) | Op::Param(_) | Op::Constant(_) | Op::Iota { .. } | Op::Repeat { .. } => {
                for o in outs {
                    self.set(o, Layout::Replicated);
                }
            }
            Op::Cast(_) | Op::Dropout { .. } | Op::CausalMask => {
                if !matches!(node.op, Op::Cast(_)) {
                    self.resolve_partial(ins[0]);
                }
                let l = self.get(ins[0]);
                self.set(outs[0], l);
            }
            Op::Unary(u) => {
                if *u != dplc_ir::UnaryOp::Neg {
                    self.resolve_partial(ins[0]);
                }
                let l = self.get(ins[0]);
                self.set(outs[0], l);
            }
            Op::Binary(b) => self.binary(*b, &ins, outs[0]),
            Op::Transpose { perm } => {
                let l = match self.get(ins[0]) {
                    Layout::Sharded(a) => Layout::Sharded(
                        perm.iter()
                            .position(|&p| p == a)
                            .expect("perm is a permutation"),
                    ),
                    l => l,
                };
                self.set(outs[0], l);
            }
            Op::Reshape { shape } => {
                let l = match self.get(ins[0]) {
                    Layout::Sharded(a) => {
                        let from = g.tensor(ins[0]).shape.dims();
                        let prefix = Shape(from[..a].to_vec()).numel();
                        let to = (0..shape.rank())
                            .find(|&j| Shape(shape.dims()[..j].to_vec()).numel() == prefix);
                        match to {
                            Some(j) => Layout::Sharded(j),
                            None => {
                                self.replicate(ins[0]);
                                Layout::Replicated
                            }
                        }
                    }
                    l => l,
                };
                self.set(outs[0], l);
            }
            Op::Expand { .. } => {
                let l = match self.get(ins[0]) {
                    Layout::Sharded(a) => Layout::Sharded(a + rank(outs[0]) - rank(ins[0])),
                    l => l,
                };
                self.set(outs[0], l);
            }
            Op::Slice { .. } => {
                // A slice of the sharded axis stays sharded: the fused QKV
                // weight is laid out so that each rank holds its heads' q, k and v.
                let l = self.get(ins[0]);
                self.set(outs[0], l);
            }
            Op::Concat { axis } => {
                let first = self.get(ins[0]);
                let same = ins.iter().all(|&t| self.get(t) == first);
                let l = match first {
                    Layout::Sharded(a) if same && a != *axis => first,
                    Layout::Partial if same => first,
                    _ => {
                        for &t in &ins {
                            self.replicate(t);
                        }
                        Layout::Replicated
                    }
                };
                self.set(outs[0], l);
            }
            Op::MatMul => self.matmul(n, ins[0], ins[1], outs[0]),
            Op::Reduce {
                kind,
                axis,
                keep_dim,
            } => {
                let l = match self.get(ins[0]) {
                    Layout::Sharded(a) if a == *axis => {
                        if *kind == dplc_ir::ReduceKind::Max {
                            self.replicate(ins[0]);
                            Layout::Replicated
                        } else {
                            Layout::Partial
                        }
                    }
                    Layout::Sharded(a) => {
                        Layout::Sharded(if a > *axis && !keep_dim { a - 1 } else { a })
                    }
                    Layout::Partial if *kind == dplc_ir::ReduceKind::Max => {
                        self.replicate(ins[0]);
                        Layout::Replicated
                    }
                    l => l,
                };
                self.set(outs[0], l);
            }
            Op::Softmax { axis } | Op::LogSoftmax { axis } => {
                self.resolve_partial(ins[0]);
                let l = self.get(ins[0]);
                if l == Layout::Sharded(*axis) {
                    // Megatron's vocab-parallel cross-entropy: all-reduce the row max and sum.
                    let shape = &g.tensor(ins[0]).shape;
                    let rows = numel(shape)
                        .checked_div(&shape.dims()[*axis])
                        .and_then(|r| r.checked_scale(dplc_ir::Ratio::int(2)))
                        .unwrap_or_else(|| Dim::konst(0));
                    self.out.collectives.push(TpCollective {
                        kind: TpCollectiveKind::RowStats,
                        pass: Pass::Forward,
                        tensor: ins[0],
                        elements: rows,
                        fp32: true,
                    });
                }
                self.set(outs[0], l);
            }
            Op::LayerNorm { .. } | Op::RmsNorm { .. } => {
                self.replicate(ins[0]);
                self.set(outs[0], Layout::Replicated);
            }
            Op::Embedding => {
                // Vocab-parallel embedding: each rank holds a slice of the rows
                // and the partial lookups are summed.
                if self.is_weight(ins[0]) && !matches!(self.get(ins[1]), Layout::Sharded(_)) {
                    self.split_param(ins[0], 0);
                    self.set(outs[0], Layout::Partial);
                } else {
                    self.replicate(ins[0]);
                    self.set(outs[0], self.get(ins[1]));
                }
            }
            Op::TakeAlong => {
                let l = match self.get(ins[0]) {
                    Layout::Sharded(a) if a + 1 == rank(ins[0]) => Layout::Partial,
                    Layout::Sharded(a) => Layout::Sharded(a),
                    Layout::Partial => {
                        self.replicate(ins[0]);
                        Layout::Replicated
                    }
                    Layout::Replicated => Layout::Replicated,
                };
                self.set(outs[0], l);
            }
            Op::TopK { .. } => {
                self.replicate(ins[0]);
                for o in outs {
                    self.set(o, Layout::Replicated);
                }
            }
            Op::MoeDispatch { .. } => {
                self.replicate(ins[0]);
                self.out.all_to_all.push(numel(&g.tensor(outs[0]).shape));
                self.set(outs[0], Layout::Replicated);
            }
            Op::MoeCombine => {
                for &t in &ins {
                    self.replicate(t);
                }
                self.out.all_to_all.push(numel(&g.tensor(ins[0]).shape));
                self.set(outs[0], Layout::Replicated);
            }
        }
    }

    fn binary(&mut self, op: BinaryOp, ins: &[TensorId], out: TensorId) {
        let g = self.g;
        let (a, b) = (ins[0], ins[1]);
        let (la, lb) = (self.get(a), self.get(b));
        let constant = |t: TensorId| !self.an.is_activation(t) && !self.an.requires_grad(t);
        let linear_partial = match op {
            BinaryOp::Add | BinaryOp::Sub => la == Layout::Partial && lb == Layout::Partial,
            BinaryOp::Mul => {
                (la == Layout::Partial && constant(b)) || (lb == Layout::Partial && constant(a))
            }
            BinaryOp::Div => la == Layout::Partial && constant(b),
            _ => false,
        };
        if linear_partial {
            self.set(out, Layout::Partial);
            return;
        }
        self.resolve_partial(a);
        self.resolve_partial(b);
        let r_out = g.tensor(out).shape.rank();
        let aligned = |t: TensorId, l: Layout| match l {
            Layout::Sharded(x) => Some(x + r_out - g.tensor(t).shape.rank()),
            _ => None,
        };
        let (sa, sb) = (aligned(a, self.get(a)), aligned(b, self.get(b)));
        let l = match (sa, sb) {
            (Some(x), Some(y)) if x == y => Layout::Sharded(x),
            (Some(x), Some(_)) => {
                self.replicate(b);
                self.replicate(a);
                let _ = x;
                Layout::Replicated
            }
            (Some(x), None) | (None, Some(x)) => {
                // The replicated operand is sliced locally; a weight (a bias)
                // along the split axis is split with it.
                let other = if sa.is_some() { b } else { a };
                let orank = g.tensor(other).shape.rank();
                if let Some(ax) = (x + orank).checked_sub(r_out) {
                    let broadcast = g.tensor(other).shape.dims()[ax].is_one();
                    if !broadcast && self.is_weight(other) {
                        self.split_param(other, ax);
                    }
                }
                Layout::Sharded(x)
            }
            (None, None) => Layout::Replicated,
        };
        self.set(out, l);
    }

    fn matmul(&mut self, n: NodeId, a: TensorId, b: TensorId, out: TensorId) {
        let g = self.g;
        let (ra, rb, ro) = (
            g.tensor(a).shape.rank(),
            g.tensor(b).shape.rank(),
            g.tensor(out).shape.rank(),
        );
        if self.is_weight(b) && !self.is_weight(a) {
            if rb == 3 {
                // An expert weight [experts, k, n]: split over expert parallelism too.
                if let Some((p, _)) = self.param_behind(b, 0) {
                    self.out.expert_params.insert(p);
                }
            }
            self.resolve_partial(a);
            let split = match self.get(a) {
                Layout::Replicated => {
                    self.split_param(b, rb - 1);
                    self.column_inputs.insert(a);
                    self.set(out, Layout::Sharded(ro - 1));
                    GemmSplit::Column
                }
                Layout::Sharded(x) if x == ra - 1 => {
                    self.split_param(b, rb - 2);
                    self.set(out, Layout::Partial);
                    GemmSplit::Row
                }
                Layout::Sharded(x) => {
                    self.set(out, Layout::Sharded(x + ro - ra));
                    GemmSplit::Batch
                }
                Layout::Partial => unreachable!("resolved above"),
            };
            self.out.gemms.insert(n, split);
            return;
        }
        self.resolve_partial(a);
        self.resolve_partial(b);
        let (la, lb) = (self.get(a), self.get(b));
        let batch_a = matches!(la, Layout::Sharded(x) if x + 2 < ra);
        let batch_b = matches!(lb, Layout::Sharded(x) if x + 2 < rb);
        let align = |l: Layout, r: usize| match l {
            Layout::Sharded(x) => Some(x + ro - r),
            _ => None,
        };
        let split = match (la, lb) {
            _ if batch_a
                && (batch_b && align(la, ra) == align(lb, rb) || lb == Layout::Replicated) =>
            {
                self.set(out, Layout::Sharded(align(la, ra).expect("sharded")));
                GemmSplit::Batch
            }
            _ if batch_b && la == Layout::Replicated => {
                self.set(out, Layout::Sharded(align(lb, rb).expect("sharded")));
                GemmSplit::Batch
            }
            (Layout::Sharded(x), Layout::Sharded(y)) if x == ra - 1 && y == rb - 2 => {
                self.set(out, Layout::Partial);
                GemmSplit::Row
            }
            (Layout::Replicated, Layout::Replicated) => {
                self.set(out, Layout::Replicated);
                GemmSplit::Replicated
            }
            _ => {
                self.replicate(a);
                self.replicate(b);
                self.set(out, Layout::Replicated);
                GemmSplit::Replicated
            }
        };
        self.out.gemms.insert(n, split);
    }
}
