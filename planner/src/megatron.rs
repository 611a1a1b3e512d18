//! Megatron's layout of a model, from the graph alone: column- then
//! row-parallel linears, heads split in attention, sequence-parallel norms and
//! residuals, experts over the expert-parallel group. The planner writes it
//! into a plan where the sharding e-graph's own layout cannot be run.

use dplc_ir::{
    Dim, Graph, IrError, ModelLayout, NodeId, NodeLayout, Op, ParamId, ParamSplit, RegionId,
    RegionLayout, Result, SplitAxis, SymId, TensorId, TensorLayout,
};
use std::collections::{HashMap, HashSet};

/// Megatron's layout of `graph` for `tp`-way tensor parallelism (with
/// sequence parallelism when `sequence_parallel`) and `ep`-way expert
/// parallelism. The root region (embedding, head, loss) stays replicated over
/// the tensor-parallel group; every top-level `repeat` body is split.
pub fn derive_layout(
    graph: &Graph,
    tp: u64,
    ep: u64,
    sequence_parallel: bool,
) -> Result<ModelLayout> {
    if tp == 0 || ep == 0 {
        return Err(IrError::Invalid {
            op: "layout",
            detail: "tensor- and expert-parallel degrees must be positive".into(),
        });
    }
    let sp = sequence_parallel && tp > 1;
    let mut d = Derive {
        g: graph,
        tp,
        ep,
        seq: graph.sym_by_name("seq"),
        sp,
        produced: HashMap::new(),
        consumed: HashSet::new(),
        params: Vec::new(),
        nodes: Vec::new(),
    };
    let root = graph.root();
    let mut regions = Vec::new();
    let mut root_nodes = Vec::new();
    for &n in &graph.region(root).nodes {
        let node = graph.node(n);
        let rep = |k| vec![TensorLayout::Replicated; k];
        if let Op::Repeat { body, carried, .. } = node.op {
            let reg = graph.region(body);
            let args: Vec<TensorLayout> = reg
                .args
                .iter()
                .enumerate()
                .map(|(i, &a)| {
                    if i < carried && d.home_is_split(a) {
                        TensorLayout::Split { axis: 1 }
                    } else {
                        TensorLayout::Replicated
                    }
                })
                .collect();
            let body_layout = d.region(body, args.clone())?;
            root_nodes.push(NodeLayout {
                node: n,
                inputs: args.clone(),
                outputs: body_layout.results.clone(),
            });
            regions.push(body_layout);
        } else {
            root_nodes.push(NodeLayout {
                node: n,
                inputs: rep(node.inputs.len()),
                outputs: rep(node.outputs.len()),
            });
        }
    }
    regions.insert(
        0,
        RegionLayout {
            region: root,
            args: Vec::new(),
            nodes: root_nodes,
            results: vec![TensorLayout::Replicated; graph.region(root).results.len()],
        },
    );
    Ok(ModelLayout {
        tp,
        ep,
        sequence_parallel: sp,
        regions,
        params: d.params,
    })
}

struct Derive<'g> {
    g: &'g Graph,
    tp: u64,
    ep: u64,
    seq: Option<SymId>,
    sp: bool,
    produced: HashMap<TensorId, TensorLayout>,
    /// Tensors some node already reads: a parameter's storage is fixed then.
    consumed: HashSet<TensorId>,
    params: Vec<ParamSplit>,
    nodes: Vec<NodeLayout>,
}

use TensorLayout::{Experts, Partial, Replicated, Split};

impl Derive<'_> {
    fn dims(&self, t: TensorId) -> &[Dim] {
        self.g.tensor(t).shape.dims()
    }

    fn rank(&self, t: TensorId) -> usize {
        self.dims(t).len()
    }

    fn prod(&self, t: TensorId) -> TensorLayout {
        self.produced.get(&t).copied().unwrap_or(Replicated)
    }

    fn is_seq(&self, d: &Dim) -> bool {
        self.seq.is_some_and(|s| *d == Dim::sym(s))
    }

    /// Whether `dim` splits evenly over the tensor-parallel group. The
    /// sequence length is checked when the run binds it.
    fn divides(&self, dim: &Dim) -> bool {
        match dim.as_const() {
            Some(n) => n > 0 && (n as u64).is_multiple_of(self.tp),
            None => self.is_seq(dim),
        }
    }

    /// Under sequence parallelism, `[batch, seq, …]` activations live split
    /// along the sequence outside the tensor-parallel matmuls.
    fn home_is_split(&self, t: TensorId) -> bool {
        let dims = self.dims(t);
        self.sp && dims.len() >= 2 && self.is_seq(&dims[1])
    }

    /// The layout to read `t` in when the op has no preference: a summand
    /// is reduced (scattered along the sequence under sequence parallelism).
    fn resolve(&self, t: TensorId) -> TensorLayout {
        match self.prod(t) {
            Partial if self.home_is_split(t) => Split { axis: 1 },
            Partial => Replicated,
            l => l,
        }
    }

    /// A parameter read for the first time can be stored split.
    fn splittable_param(&self, t: TensorId) -> Option<ParamId> {
        match self.g.producer(t).map(|n| &n.op) {
            Some(Op::Param(p)) if !self.consumed.contains(&t) => Some(*p),
            _ => None,
        }
    }

    fn split_param(&mut self, t: TensorId, p: ParamId, split: SplitAxis) -> TensorLayout {
        let l = match split {
            SplitAxis::Tensor { axis } => Split { axis },
            SplitAxis::Expert => Experts,
        };
        self.produced.insert(t, l);
        self.params.push(ParamSplit { param: p, split });
        l
    }

    fn unsupported(&self, n: NodeId, why: &str) -> IrError {
        IrError::Invalid {
            op: "layout",
            detail: format!(
                "{n} ({}): {why} under tp {} ep {}",
                self.g.node(n).op.name(),
                self.tp,
                self.ep
            ),
        }
    }

    fn region(&mut self, r: RegionId, args: Vec<TensorLayout>) -> Result<RegionLayout> {
        let reg = self.g.region(r);
        for (&a, &l) in reg.args.iter().zip(&args) {
            self.produced.insert(a, l);
        }
        let outer = std::mem::take(&mut self.nodes);
        for &n in &reg.nodes {
            self.node(n)?;
        }
        let mut nodes = std::mem::replace(&mut self.nodes, outer);
        // A parameter's storage is decided by its first reader, after its node.
        for nl in &mut nodes {
            let node = self.g.node(nl.node);
            if matches!(node.op, Op::Param(_)) {
                nl.outputs = vec![self.prod(node.outputs[0])];
            }
        }
        // Each result goes back in its carried argument's layout.
        let results = reg
            .results
            .iter()
            .enumerate()
            .map(|(i, _)| args.get(i).copied().unwrap_or(Replicated))
            .collect();
        Ok(RegionLayout {
            region: r,
            args,
            nodes,
            results,
        })
    }

    fn node(&mut self, n: NodeId) -> Result<()> {
        let g = self.g;
        let node = g.node(n);
        let ins = node.inputs.clone();
        let (inputs, outputs) = self.rule(n)?;
        for (&t, &l) in node.outputs.iter().zip(&outputs) {
            self.produced.insert(t, l);
        }
        self.consumed.extend(ins.iter().copied());
        // The all-to-all moves whole tokens: a tensor-parallel part cannot take it.
        if inputs
            .iter()
            .zip(&ins)
            .any(|(&l, &t)| l == Experts && !matches!(self.prod(t), Experts | Replicated))
        {
            return Err(self.unsupported(n, "an expert tensor meets a tensor-parallel split"));
        }
        self.nodes.push(NodeLayout {
            node: n,
            inputs,
            outputs,
        });
        Ok(())
    }

    /// The layouts node `n` reads its inputs in and gives its outputs.
    fn rule(&mut self, n: NodeId) -> Result<(Vec<TensorLayout>, Vec<TensorLayout>)> {
        let g = self.g;
        let node = g.node(n);
        let ins = &node.inputs;
        let n_out = node.outputs.len();
        let all = |l: TensorLayout, k: usize| vec![l; k];
        let one = |i: Vec<TensorLayout>, o: TensorLayout| Ok((i, vec![o]));
        if self.tp == 1 && self.ep == 1 {
            return Ok((all(Replicated, ins.len()), all(Replicated, n_out)));
        }
        match &node.op {
            Op::Input(_) | Op::Param(_) | Op::Constant(_) | Op::Iota { .. } => {
                Ok((Vec::new(), all(Replicated, n_out)))
            }
            // A nested repeat runs replicated, and so does a select.
            Op::Repeat { .. } | Op::Select => {
                Ok((all(Replicated, ins.len()), all(Replicated, n_out)))
            }
            Op::Relayout { .. } | Op::VocabParallel(_) => {
                Err(self.unsupported(n, "a local program is laid out again"))
            }
            Op::Cast(_) | Op::Unary(_) | Op::CausalMask | Op::Dropout { .. } => {
                let mut c = self.resolve(ins[0]);
                let r = self.rank(ins[0]);
                match (&node.op, c) {
                    // The mask compares positions along the last two axes.
                    (Op::CausalMask, Split { axis }) if axis + 2 >= r => c = Replicated,
                    // Dropout draws each element at its place in the whole
                    // tensor (`dplc_ir::Placement`): a split or partial
                    // value keeps its layout, but an expert tensor's slots
                    // (per source rank) have no place in the serial run's.
                    (Op::Dropout { p, .. }, Experts) if *p > 0.0 => c = Replicated,
                    _ => {}
                }
                one(vec![c], c)
            }
            Op::Binary(b) => self.binary(n, *b),
            Op::Transpose { perm } => {
                let c = self.resolve(ins[0]);
                let o = match c {
                    Split { axis } => Split {
                        axis: perm.iter().position(|&p| p == axis).unwrap_or(axis),
                    },
                    Experts if perm.len() >= 2 && perm[0] == 0 && perm[1] == 1 => Experts,
                    Experts => return Err(self.unsupported(n, "an expert tensor is transposed")),
                    l => l,
                };
                one(vec![c], o)
            }
            Op::Reshape { shape } => {
                let c = self.resolve(ins[0]);
                let from = self.dims(ins[0]).to_vec();
                let to = shape.dims();
                match c {
                    Split { axis } => {
                        let prefix = dplc_ir::Shape(from[..axis].to_vec()).numel();
                        let j = (0..to.len())
                            .find(|&j| dplc_ir::Shape(to[..j].to_vec()).numel() == prefix);
                        match j {
                            Some(j) if self.divides(&to[j]) => one(vec![c], Split { axis: j }),
                            // Splitting a width into heads that do not divide.
                            Some(j) => Err(self.unsupported(
                                n,
                                &format!(
                                    "tp {} does not divide the {} heads (axis {j} of the reshape)",
                                    self.tp,
                                    self.g.dim_str(&to[j])
                                ),
                            )),
                            None => one(vec![Replicated], Replicated),
                        }
                    }
                    Experts if to.len() >= 2 && from.len() >= 2 && to[..2] == from[..2] => {
                        one(vec![c], Experts)
                    }
                    Experts => Err(self.unsupported(n, "an expert tensor is reshaped")),
                    l => one(vec![l], l),
                }
            }
            Op::Expand { .. } => {
                let c = self.resolve(ins[0]);
                let o = match c {
                    Split { axis } => Split {
                        axis: axis + self.rank(node.outputs[0]) - self.rank(ins[0]),
                    },
                    Experts if self.rank(node.outputs[0]) == self.rank(ins[0]) => Experts,
                    Experts => return Err(self.unsupported(n, "an expert tensor is expanded")),
                    l => l,
                };
                one(vec![c], o)
            }
            // A pad or running sum along a split axis (the sequence under
            // sequence parallelism) needs the whole axis: it runs replicated.
            Op::Slice { axis, .. } | Op::Pad { axis, .. } | Op::CumSum { axis, .. } => {
                let c = match self.resolve(ins[0]) {
                    Split { axis: a } if a == *axis => Replicated,
                    // Summands would each add a pad's non-zero value.
                    Partial if matches!(node.op, Op::Pad { value, .. } if value != 0.0) => {
                        Replicated
                    }
                    Experts if *axis < 2 => {
                        return Err(self.unsupported(n, "an expert tensor is sliced"))
                    }
                    l => l,
                };
                one(vec![c], c)
            }
            Op::Concat { axis } => {
                let cs: Vec<TensorLayout> = ins.iter().map(|&t| self.resolve(t)).collect();
                let same = cs.iter().all(|&l| l == cs[0]);
                match cs[0] {
                    Split { axis: a } if same && a != *axis => one(cs.clone(), cs[0]),
                    Experts if same && *axis >= 2 => one(cs.clone(), Experts),
                    _ => one(all(Replicated, ins.len()), Replicated),
                }
            }
            Op::Reduce {
                kind,
                axis,
                keep_dim,
            } => {
                let c = self.resolve(ins[0]);
                match c {
                    Split { axis: a } if a == *axis => {
                        if *kind == dplc_ir::ReduceKind::Sum {
                            one(vec![c], Partial)
                        } else {
                            // A mean or max needs the whole axis.
                            one(vec![Replicated], Replicated)
                        }
                    }
                    Split { axis: a } => one(
                        vec![c],
                        Split {
                            axis: if a > *axis && !keep_dim { a - 1 } else { a },
                        },
                    ),
                    Experts if *axis >= 2 => one(vec![c], Experts),
                    Experts => Err(self.unsupported(n, "an expert tensor is reduced over experts")),
                    l => one(vec![l], l),
                }
            }
            Op::Softmax { axis } | Op::LogSoftmax { axis } => {
                let c = match self.resolve(ins[0]) {
                    Split { axis: a } if a == *axis => Replicated,
                    l => l,
                };
                one(vec![c], c)
            }
            Op::LayerNorm { .. } | Op::RmsNorm { .. } => {
                let r = self.rank(ins[0]);
                let c = match self.resolve(ins[0]) {
                    Split { axis } if axis + 1 == r => Replicated,
                    Experts => Replicated,
                    l => l,
                };
                let mut cs = vec![c];
                cs.extend(all(Replicated, ins.len() - 1));
                one(cs, c)
            }
            Op::Embedding => {
                let c = match self.resolve(ins[1]) {
                    Experts => Replicated,
                    l => l,
                };
                one(vec![Replicated, c], c)
            }
            Op::TakeAlong => {
                let r = self.rank(ins[0]);
                let c = match self.resolve(ins[0]) {
                    Split { axis } if axis + 1 < r => Split { axis },
                    _ => Replicated,
                };
                one(vec![c, c], c)
            }
            Op::TopK { .. } | Op::MoeDispatch { .. } | Op::MoeCombine => {
                Ok((all(Replicated, ins.len()), all(Replicated, n_out)))
            }
            Op::MatMul => self.matmul(n),
        }
    }

    fn binary(
        &mut self,
        n: NodeId,
        op: dplc_ir::BinaryOp,
    ) -> Result<(Vec<TensorLayout>, Vec<TensorLayout>)> {
        let node = self.g.node(n);
        let (a, b) = (node.inputs[0], node.inputs[1]);
        let out = node.outputs[0];
        let ro = self.rank(out);
        if matches!(op, dplc_ir::BinaryOp::Add | dplc_ir::BinaryOp::Sub)
            && self.prod(a) == Partial
            && self.prod(b) == Partial
        {
            return Ok((vec![Partial, Partial], vec![Partial]));
        }
        let (ca, cb) = (self.resolve(a), self.resolve(b));
        if ca == Experts || cb == Experts {
            let scalar = |t: TensorId| self.rank(t) == 0;
            let ok = |c: TensorLayout, t| c == Experts || (c == Replicated && scalar(t));
            if ok(ca, a) && ok(cb, b) {
                return Ok((vec![ca, cb], vec![Experts]));
            }
            return Err(self.unsupported(n, "an expert tensor meets a non-expert one"));
        }
        let aligned = |t: TensorId, l: TensorLayout| match l {
            Split { axis } => Some(axis + ro - self.rank(t)),
            _ => None,
        };
        let (sa, sb) = (aligned(a, ca), aligned(b, cb));
        let (mut ca, mut cb) = (ca, cb);
        let o = match (sa, sb) {
            (Some(x), Some(y)) if x == y => Split { axis: x },
            (Some(_), Some(_)) => {
                ca = Replicated;
                cb = Replicated;
                Replicated
            }
            (Some(x), None) | (None, Some(x)) => {
                // The other operand is read along the split axis unless it
                // broadcasts there; a parameter (a bias) is then stored split.
                let other = if sa.is_some() { b } else { a };
                let orank = self.rank(other);
                let c = match (x + orank).checked_sub(ro) {
                    Some(ax) if !self.dims(other)[ax].is_one() => {
                        match self.splittable_param(other) {
                            Some(p) => self.split_param(other, p, SplitAxis::Tensor { axis: ax }),
                            None => Split { axis: ax },
                        }
                    }
                    _ => Replicated,
                };
                if sa.is_some() {
                    cb = c;
                } else {
                    ca = c;
                }
                Split { axis: x }
            }
            (None, None) => Replicated,
        };
        Ok((vec![ca, cb], vec![o]))
    }

    fn matmul(&mut self, n: NodeId) -> Result<(Vec<TensorLayout>, Vec<TensorLayout>)> {
        let node = self.g.node(n);
        let (a, b) = (node.inputs[0], node.inputs[1]);
        let (ra, rb) = (self.rank(a), self.rank(b));
        let ro = self.rank(node.outputs[0]);
        let (la, lb) = (self.resolve(a), self.resolve(b));
        let weight = self.splittable_param(b);
        // Expert weights `[experts, k, n]` live on the expert-parallel ranks
        // that own those experts; the tokens travel to them by all-to-all.
        if self.ep > 1 && rb == 3 && (lb == Experts || weight.is_some()) && la != Partial {
            let experts = &self.dims(b)[0];
            let fits = experts
                .as_const()
                .is_some_and(|e| e > 0 && (e as u64).is_multiple_of(self.ep));
            if fits && matches!(la, Replicated | Experts) {
                let cb = match weight {
                    Some(p) => self.split_param(b, p, SplitAxis::Expert),
                    None => Experts,
                };
                return Ok((vec![Experts, cb], vec![Experts]));
            }
        }
        if la == Experts || lb == Experts {
            if la == Experts && lb == Experts {
                return Ok((vec![Experts, Experts], vec![Experts]));
            }
            return Err(self.unsupported(n, "an expert tensor meets a non-expert one"));
        }
        if self.tp > 1 && rb == 2 {
            if let Some(p) = weight {
                let w = self.dims(b).to_vec();
                // Row parallel: the input arrives split along its features.
                if la == (Split { axis: ra - 1 }) && self.divides(&w[0]) {
                    let cb = self.split_param(b, p, SplitAxis::Tensor { axis: 0 });
                    return Ok((vec![la, cb], vec![Partial]));
                }
                // Column parallel: the whole input (gathered along the sequence
                // under sequence parallelism), the output split along features.
                if matches!(la, Replicated | Split { .. }) && self.divides(&w[1]) {
                    let cb = self.split_param(b, p, SplitAxis::Tensor { axis: 1 });
                    return Ok((vec![Replicated, cb], vec![Split { axis: ro - 1 }]));
                }
                return Err(self.unsupported(
                    n,
                    &format!(
                        "tp {} divides neither dimension of `{}` ({})",
                        self.tp,
                        self.g.param(p).name,
                        self.g.shape_str(&self.g.param(p).shape)
                    ),
                ));
            }
        }
        // Both operands computed (or a weight already placed): batch, row and
        // column splits pass through; a contraction split gives a summand.
        let out_axis = |l: TensorLayout, r: usize, contracted: usize| match l {
            Split { axis } if axis != contracted => Some(axis + ro - r),
            _ => None,
        };
        let (xa, xb) = (out_axis(la, ra, ra - 1), out_axis(lb, rb, rb - 2));
        let col_a = ro - 1;
        let row_b = ro - 2;
        let ok_a = |x: usize| x != col_a;
        let ok_b = |x: usize| x != row_b;
        let reading = |this: &Self, t: TensorId, r: usize, x: usize| -> TensorLayout {
            // The other operand at output axis `x`: split with it unless it broadcasts.
            match (x + r).checked_sub(ro) {
                Some(ax) if ax + 2 < r && !this.dims(t)[ax].is_one() => Split { axis: ax },
                _ => Replicated,
            }
        };
        match (xa, xb) {
            (Some(x), Some(y)) if x == y && x + 2 < ro => {
                Ok((vec![la, lb], vec![Split { axis: x }]))
            }
            (Some(x), None) if ok_a(x) && lb == Replicated => {
                let cb = if x + 2 < ro {
                    reading(self, b, rb, x)
                } else {
                    Replicated
                };
                Ok((vec![la, cb], vec![Split { axis: x }]))
            }
            (None, Some(y)) if ok_b(y) && la == Replicated => {
                let ca = if y + 2 < ro {
                    reading(self, a, ra, y)
                } else {
                    Replicated
                };
                Ok((vec![ca, lb], vec![Split { axis: y }]))
            }
            _ if la == (Split { axis: ra - 1 }) && lb == (Split { axis: rb - 2 }) => {
                Ok((vec![la, lb], vec![Partial]))
            }
            _ => Ok((vec![Replicated, Replicated], vec![Replicated])),
        }
    }
}
