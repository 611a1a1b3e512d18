//! Context parallelism as a rank's program: the model at the sequence
//! positions one rank of the cp group holds, with the K/V all-gathers, the
//! global positions and the causal mask's offsets spelled out.
//!
//! With Megatron's and torchtitan's causal load balancing the sequence is
//! cut into `2·cp` equal chunks and cp rank `r` holds chunks `r` and
//! `2·cp−1−r` ([`TensorLayout::Context`]), so every rank has as many early
//! (cheap) as late (costly) queries under a causal mask. Every per-token op
//! runs on the rank's positions unchanged. The ops that mix positions are
//! rewritten here, in one place, so the reference interpreter and the fused
//! kernels run the same program:
//!
//! - an operand whose sequence axis meets another sequence axis (the keys of
//!   the score matmul, the values of the P·V matmul, a cross-attention's
//!   keys and values from the split sequence) is all-gathered over the
//!   group into position order ([`Op::Relayout`] `context(a) -> replicated`;
//!   its gradient, a summand on each rank, is reduce-scattered back);
//! - `positions(seq)` stays whole: what is built from positions alone
//!   (rotary angles, a window mask, T5's relative position bias
//!   `[heads, q, k]`) is computed whole on every rank, as the serial run
//!   does, and sliced to the rank's positions where it meets a split value
//!   — a bias along its query axis, its key axis whole as the gathered
//!   keys are;
//! - `causal_mask` becomes a mask of the rank's global query positions
//!   against the global key positions;
//! - a dropout of the rank's positions draws each element at its global
//!   position (`Op::Dropout::context`, [`context_position`]), so the masks
//!   are the serial run's;
//! - a reduction or normalisation over the sequence axis, and a reshape that
//!   merges it with another axis (MoE token routing), reads the whole axis
//!   (all-gathered); a whole value meeting a split one is sliced to the
//!   rank's positions (its gradient, this rank's summand, zero elsewhere).
//!
//! Each rank's loss is then the whole loss, so the objective summed over
//! the group is `cp` times the serial one: the runtime averages gradients
//! over `dp × cp` replicas, which the planner prices as the data-parallel
//! group with context parallelism.

use crate::{
    Dim, Graph, IrError, ModelLayout, NodeId, NodeLayout, Op, Ratio, RegionId, Result, Shape,
    SymId, TensorDef, TensorId, TensorLayout,
};
use std::collections::{HashMap, HashSet};

/// `graph` as one rank of a context-parallel group of `cp` runs it: tensors
/// along the sequence hold this rank's positions, the rank-dependent
/// pieces are [`Op::Relayout`]s to and from [`TensorLayout::Context`].
/// The same program serves every cp rank.
pub fn split_context(graph: &Graph, cp: u64) -> Result<Graph> {
    let seq = graph
        .sym_by_name("seq")
        .ok_or_else(|| invalid("the model has no `seq` dimension to split".into()))?;
    if cp < 2 {
        return Err(invalid(format!("cp {cp} splits nothing")));
    }
    let pass = Split::run(graph, cp, seq)?;
    for &t in graph.outputs() {
        if pass.axis.contains_key(&t) {
            return Err(invalid(format!(
                "the model's output {t} keeps the sequence axis split"
            )));
        }
    }
    Ok(pass.local)
}

/// What a rank's program under context parallelism runs beyond its share
/// of the per-token work, as the planner prices it: the same rewrite
/// ([`split_context`]) decides both.
#[derive(Clone, Debug, Default)]
pub struct ContextTraffic {
    /// Every all-gather along the sequence, per run of its region.
    pub gathers: Vec<ContextGather>,
    /// Nodes of the model every cp rank runs on the whole sequence: what a
    /// gather feeds that is not split again (MoE routing, the loss's mean),
    /// and what is built from positions alone (rotary tables, masks, a
    /// relative position bias).
    pub whole: HashSet<NodeId>,
}

/// One all-gather of [`ContextTraffic`].
#[derive(Clone, Debug)]
pub struct ContextGather {
    /// The node of the model that reads the gathered value.
    pub reader: NodeId,
    /// The model's value gathered (`None` for one the rewrite made): a
    /// layout that splits it over tp gathers each tp rank's share.
    pub value: Option<TensorId>,
    /// Elements of the whole (gathered) tensor.
    pub elements: Dim,
    /// Whether its gradient is reduce-scattered back (a value with a gradient).
    pub grad: bool,
}

/// The gathers and whole-sequence nodes of `graph` under context
/// parallelism; `None` when it has no sequence to split or cannot split it.
pub fn context_traffic(graph: &Graph) -> Option<ContextTraffic> {
    let seq = graph.sym_by_name("seq")?;
    let pass = Split::run(graph, 2, seq).ok()?;
    let local = &pass.local;
    let grads = crate::GradPlan::new(local);
    let model_nodes = graph.nodes().len();
    let model_tensors: HashSet<TensorId> = graph
        .nodes()
        .flat_map(|(_, n)| n.outputs.iter().copied())
        .chain(graph.regions().flat_map(|(_, r)| r.args.iter().copied()))
        .collect();
    let mut out = ContextTraffic::default();
    let has_seq = |t: TensorId| {
        local
            .tensor(t)
            .shape
            .dims()
            .iter()
            .any(|d| d.syms().contains(&seq))
    };
    // Nodes rewritten away (a causal mask become a `select`) run no more.
    let placed: HashSet<NodeId> = local
        .regions()
        .flat_map(|(_, r)| r.nodes.iter().copied())
        .collect();
    for (n, node) in local.nodes() {
        if !placed.contains(&n) {
            continue;
        }
        if let Op::Relayout {
            from: TensorLayout::Context { axis },
            to: TensorLayout::Replicated,
            ..
        } = node.op
        {
            let t = node.inputs[0];
            let out_t = node.outputs[0];
            // The model's node that reads it (the gather sits just before it).
            let Some(reader) = local
                .nodes()
                .take(model_nodes)
                .find(|(_, m)| m.inputs.contains(&out_t))
                .map(|(m, _)| m)
                .or_else(|| {
                    local
                        .region(node.region)
                        .results
                        .contains(&out_t)
                        .then(|| local.region(node.region).repeat)
                        .flatten()
                })
            else {
                continue;
            };
            let Ok(whole) = pass.whole_shape(t, axis) else {
                continue;
            };
            let elements = whole
                .dims()
                .iter()
                .try_fold(Dim::konst(1), |acc, d| acc.checked_mul(d));
            if let Some(elements) = elements {
                out.gathers.push(ContextGather {
                    reader,
                    value: model_tensors.contains(&t).then_some(t),
                    elements,
                    grad: grads.needs_grad(t),
                });
            }
            continue;
        }
        if n.index() >= model_nodes || matches!(node.op, Op::Repeat { .. }) {
            continue;
        }
        let split_out = node.outputs.iter().any(|t| pass.axis.contains_key(t));
        let whole_seq = node
            .outputs
            .iter()
            .chain(&node.inputs)
            .any(|&t| !pass.axis.contains_key(&t) && has_seq(t));
        if !split_out && whole_seq {
            out.whole.insert(n);
        }
    }
    Some(out)
}

/// `layout`, a tensor-parallel layout of the model, for its context-parallel
/// program `program` ([`split_context`]): the model's nodes keep theirs, a
/// node the rewrite added reads its inputs as they are produced, a layout
/// change along the sequence and a causal mask's `where` hand on their
/// (split) value's layout, and the positions and masks built from `iota`
/// are whole. Under sequence parallelism, which splits the rank's
/// positions over tp as well, a layout change along the sequence reads its
/// value whole over tp first.
pub fn context_layout(program: &Graph, layout: &ModelLayout) -> Result<ModelLayout> {
    let by_node: HashMap<NodeId, NodeLayout> = layout
        .regions
        .iter()
        .flat_map(|r| r.nodes.iter().map(|nl| (nl.node, nl.clone())))
        .collect();
    let mut out = layout.clone();
    for r in &mut out.regions {
        // A plan file is read from disk: its regions are checked here too.
        if r.region.index() >= program.regions().len() {
            return Err(invalid(format!(
                "the layout names region {}, which the model does not have",
                r.region
            )));
        }
        let reg = program.region(r.region);
        let mut produced: HashMap<TensorId, TensorLayout> = reg
            .args
            .iter()
            .copied()
            .zip(r.args.iter().copied())
            .collect();
        let mut nodes = Vec::with_capacity(reg.nodes.len());
        for &n in &reg.nodes {
            let node = program.node(n);
            let nl = match by_node.get(&n) {
                Some(nl) => nl.clone(),
                None => {
                    let mut inputs: Vec<TensorLayout> = node
                        .inputs
                        .iter()
                        .map(|t| produced.get(t).copied().unwrap_or(TensorLayout::Replicated))
                        .collect();
                    // A value split along the sequence over tp too
                    // (sequence parallelism) is made whole over tp before
                    // its cp chunks are gathered or cut: the chunks are of
                    // the rank's positions, not of a tp share of them.
                    if let Op::Relayout {
                        from: TensorLayout::Context { axis },
                        ..
                    }
                    | Op::Relayout {
                        to: TensorLayout::Context { axis },
                        ..
                    } = node.op
                    {
                        if inputs[0] == (TensorLayout::Split { axis }) {
                            inputs[0] = TensorLayout::Replicated;
                        }
                    }
                    let out = match node.op {
                        Op::Relayout { .. } => inputs[0],
                        Op::Select => inputs[2],
                        _ => TensorLayout::Replicated,
                    };
                    NodeLayout {
                        node: n,
                        inputs,
                        outputs: vec![out; node.outputs.len()],
                    }
                }
            };
            produced.extend(node.outputs.iter().copied().zip(nl.outputs.iter().copied()));
            nodes.push(nl);
        }
        r.nodes = nodes;
    }
    Ok(out)
}

/// The positions cp rank `rank` of `cp` holds of a sequence of `len`
/// ([`TensorLayout::Context`]): chunks `rank` and `2·cp−1−rank` of `2·cp`,
/// in that order; `None` unless `2·cp` divides `len`.
pub fn context_chunks(len: usize, cp: usize, rank: usize) -> Option<[std::ops::Range<usize>; 2]> {
    let parts = 2 * cp;
    if cp == 0 || rank >= cp || !len.is_multiple_of(parts) {
        return None;
    }
    let c = len / parts;
    let late = parts - 1 - rank;
    Some([rank * c..(rank + 1) * c, late * c..(late + 1) * c])
}

/// The global position of position `i` of the `len = seq / cp` that cp
/// rank `rank` of `cp` holds ([`context_chunks`]): chunk `rank` then chunk
/// `2·cp−1−rank`, each `len / 2` long. Codegen's dropout draws write the
/// same arithmetic as a kernel index.
pub fn context_position(len: usize, cp: usize, rank: usize, i: usize) -> usize {
    let chunk = (len / 2).max(1);
    i + rank * chunk + (i / chunk) * cp.saturating_sub(rank + 1) * len
}

fn invalid(detail: String) -> IrError {
    IrError::Invalid {
        op: "context parallelism",
        detail,
    }
}

/// What one node needs before and after it runs.
#[derive(Default)]
struct Decision {
    /// Inputs read whole: all-gathered along their split axis first.
    gather: Vec<usize>,
    /// Inputs read at this rank's positions: `(input, axis)` sliced first.
    slice: Vec<(usize, usize)>,
    /// Each output's split axis.
    out: Vec<Option<usize>>,
}

struct Split<'g> {
    graph: &'g Graph,
    local: Graph,
    cp: u64,
    seq: SymId,
    /// The axis of each tensor (of `local`) that holds this rank's positions.
    axis: HashMap<TensorId, usize>,
    /// Values of the model gathered where their one reader reads them: the
    /// start of a chain of views (reshape, expand, transpose) that ends in
    /// an operand read whole, so that a grouped-query attention's K and V
    /// are gathered at `kv_heads`, before their heads are repeated.
    early: HashSet<TensorId>,
}

impl<'g> Split<'g> {
    /// The rewrite of `graph`: once to find what is read whole, and again
    /// with those gathers moved up their chains of views.
    fn run(graph: &'g Graph, cp: u64, seq: SymId) -> Result<Split<'g>> {
        let new = |early| Split {
            graph,
            local: graph.clone(),
            cp,
            seq,
            axis: HashMap::new(),
            early,
        };
        let mut first = new(HashSet::new());
        first.region(graph.root(), &[])?;
        let mut readers: HashMap<TensorId, usize> = HashMap::new();
        for (_, node) in graph.nodes() {
            for &t in &node.inputs {
                *readers.entry(t).or_default() += 1;
            }
        }
        for (_, r) in graph.regions() {
            for &t in &r.results {
                *readers.entry(t).or_default() += 1;
            }
        }
        for &t in graph.outputs() {
            *readers.entry(t).or_default() += 1;
        }
        let mut early = HashSet::new();
        let model_tensors: HashSet<TensorId> = graph
            .nodes()
            .flat_map(|(_, n)| n.outputs.iter().copied())
            .chain(graph.regions().flat_map(|(_, r)| r.args.iter().copied()))
            .collect();
        for (_, node) in first.local.nodes() {
            let Op::Relayout {
                from: TensorLayout::Context { .. },
                to: TensorLayout::Replicated,
                ..
            } = node.op
            else {
                continue;
            };
            let mut t = node.inputs[0];
            if !model_tensors.contains(&t) || readers.get(&t) != Some(&1) {
                continue;
            }
            while let Some(p) = graph.producer(t) {
                let view = matches!(
                    p.op,
                    Op::Reshape { .. } | Op::Expand { .. } | Op::Transpose { .. }
                );
                // (A model input, read as the keys themselves, has no input.)
                let Some(&x) = p.inputs.first().filter(|_| view) else {
                    break;
                };
                if readers.get(&x) != Some(&1) || !first.axis.contains_key(&x) {
                    break;
                }
                t = x;
            }
            early.insert(t);
        }
        let mut pass = new(early);
        pass.region(graph.root(), &[])?;
        Ok(pass)
    }

    fn is_seq(&self, d: &Dim) -> bool {
        *d == Dim::sym(self.seq)
    }

    fn split_axis(&self, t: TensorId) -> Option<usize> {
        self.axis.get(&t).copied()
    }

    /// Mark `t` as split along `axis`: its local shape holds `1/cp` of it.
    fn set_split(&mut self, t: TensorId, axis: usize) -> Result<()> {
        let mut dims = self.local.tensor(t).shape.dims().to_vec();
        let d = dims
            .get(axis)
            .ok_or_else(|| invalid(format!("{t} has no axis {axis}")))?;
        dims[axis] = Ratio::new(1, self.cp as i128)
            .and_then(|r| d.checked_scale(r))
            .ok_or_else(|| invalid(format!("axis {axis} of {t} cannot split over cp")))?;
        self.local.tensor_mut(t).shape = Shape(dims);
        self.axis.insert(t, axis);
        Ok(())
    }

    /// The whole shape of `t`, split along `axis` here.
    fn whole_shape(&self, t: TensorId, axis: usize) -> Result<Shape> {
        let mut dims = self.local.tensor(t).shape.dims().to_vec();
        let d = dims
            .get(axis)
            .ok_or_else(|| invalid(format!("{t} has no axis {axis}")))?;
        dims[axis] = Ratio::new(self.cp as i128, 1)
            .and_then(|r| d.checked_scale(r))
            .ok_or_else(|| invalid(format!("axis {axis} of {t} overflows")))?;
        Ok(Shape(dims))
    }

    /// A layout change `(from, to)` of `t` placed in `order`; returns its output.
    fn relayout(
        &mut self,
        order: &mut Vec<NodeId>,
        region: RegionId,
        at: NodeId,
        t: TensorId,
        (from, to): (TensorLayout, TensorLayout),
        shape: Shape,
    ) -> TensorId {
        // A whole value's gradient is each rank's summand (`Partial`); a
        // split one's is the rank's own positions.
        let grad = match to {
            TensorLayout::Context { .. } => to,
            _ => TensorLayout::Partial,
        };
        let scope = self.local.node(at).scope;
        let dtype = self.local.tensor(t).dtype;
        let (n, outs) = self.local.push_node_unplaced(
            region,
            scope,
            Op::Relayout { from, to, grad },
            vec![t],
            vec![(dtype, shape)],
        );
        order.push(n);
        outs[0]
    }

    fn gather(
        &mut self,
        order: &mut Vec<NodeId>,
        region: RegionId,
        at: NodeId,
        t: TensorId,
    ) -> Result<TensorId> {
        let Some(axis) = self.split_axis(t) else {
            return Ok(t);
        };
        let shape = self.whole_shape(t, axis)?;
        Ok(self.relayout(
            order,
            region,
            at,
            t,
            (TensorLayout::Context { axis }, TensorLayout::Replicated),
            shape,
        ))
    }

    fn slice(
        &mut self,
        order: &mut Vec<NodeId>,
        region: RegionId,
        at: NodeId,
        t: TensorId,
        axis: usize,
    ) -> Result<TensorId> {
        let shape = self.local.tensor(t).shape.clone();
        let out = self.relayout(
            order,
            region,
            at,
            t,
            (TensorLayout::Replicated, TensorLayout::Context { axis }),
            shape,
        );
        self.set_split(out, axis)?;
        Ok(out)
    }

    /// A new node with inferred output types, placed in `order`.
    fn add(
        &mut self,
        order: &mut Vec<NodeId>,
        region: RegionId,
        at: NodeId,
        op: Op,
        inputs: &[TensorId],
    ) -> Result<TensorId> {
        let scope = self.local.node(at).scope;
        let t = self.local.add_node1(region, scope, op, inputs)?;
        if let TensorDef::Node { node, .. } = self.local.tensor(t).def {
            order.push(node);
        }
        Ok(t)
    }

    /// Rewrite `region`, whose arguments arrive split along `args`.
    fn region(&mut self, region: RegionId, args: &[Option<usize>]) -> Result<()> {
        let reg = self.graph.region(region).clone();
        for (&a, &l) in reg.args.iter().zip(args) {
            if let Some(axis) = l {
                self.set_split(a, axis)?;
            }
        }
        let mut order = Vec::with_capacity(reg.nodes.len());
        // Values replaced by a rewritten one (`iota` by the rank's positions).
        let mut subst: HashMap<TensorId, TensorId> = HashMap::new();
        for &n in &reg.nodes {
            let node = self.graph.node(n).clone();
            let mut inputs: Vec<TensorId> = node
                .inputs
                .iter()
                .map(|t| subst.get(t).copied().unwrap_or(*t))
                .collect();
            if let Op::Repeat { body, carried, .. } = node.op {
                let splits: Vec<Option<usize>> =
                    inputs.iter().map(|&t| self.split_axis(t)).collect();
                self.local.node_mut(n).inputs = inputs.clone();
                self.region(body, &splits)?;
                self.carried_results(body, &splits[..carried])?;
                for (&o, l) in node.outputs.iter().zip(&splits[..carried]) {
                    if let Some(axis) = *l {
                        self.set_split(o, axis)?;
                    }
                }
                order.push(n);
                continue;
            }
            for (i, t) in node.inputs.iter().enumerate() {
                if self.early.contains(t) {
                    inputs[i] = self.gather(&mut order, region, n, inputs[i])?;
                }
            }
            if node.op == Op::CausalMask {
                let x = inputs[0];
                let r = self.local.tensor(x).shape.rank();
                if r >= 2 && self.split_axis(x) == Some(r - 2) {
                    let masked = self.causal_mask(&mut order, region, n, x)?;
                    subst.insert(node.outputs[0], masked);
                    continue;
                }
            }
            let d = self.decide(&node.op, &inputs, &node.outputs)?;
            for &i in &d.gather {
                inputs[i] = self.gather(&mut order, region, n, inputs[i])?;
            }
            for &(i, axis) in &d.slice {
                inputs[i] = self.slice(&mut order, region, n, inputs[i], axis)?;
            }
            self.local.node_mut(n).inputs = inputs;
            for (&o, l) in node.outputs.iter().zip(&d.out) {
                if let Some(axis) = *l {
                    self.set_split(o, axis)?;
                }
            }
            // The reshapes and broadcasts name the shape they make; a
            // dropout of this rank's positions draws at the global ones.
            match node.op {
                Op::Reshape { .. } => {
                    let shape = self.local.tensor(node.outputs[0]).shape.clone();
                    self.local.node_mut(n).op = Op::Reshape { shape };
                }
                Op::Expand { .. } => {
                    let shape = self.local.tensor(node.outputs[0]).shape.clone();
                    self.local.node_mut(n).op = Op::Expand { shape };
                }
                Op::Dropout { p, split, .. } => {
                    self.local.node_mut(n).op = Op::Dropout {
                        p,
                        context: d.out[0],
                        split,
                    };
                }
                _ => {}
            }
            order.push(n);
        }
        // A carried value leaves a layer as it came in: `carried_results`.
        self.local.region_mut(region).results = reg
            .results
            .iter()
            .map(|t| subst.get(t).copied().unwrap_or(*t))
            .collect();
        self.local.region_mut(region).nodes = order;
        Ok(())
    }

    /// Make each carried result of `body` leave split as its argument came.
    fn carried_results(&mut self, body: RegionId, want: &[Option<usize>]) -> Result<()> {
        let results = self.local.region(body).results.clone();
        let mut order = self.local.region(body).nodes.clone();
        let at = *order
            .last()
            .ok_or_else(|| invalid(format!("region {body} is empty")))?;
        let mut new = results.clone();
        for (j, &w) in want.iter().enumerate() {
            let t = results[j];
            let have = self.split_axis(t);
            new[j] = match (have, w) {
                (None, None) => t,
                (Some(h), Some(w)) if h == w => t,
                (Some(_), None) => self.gather(&mut order, body, at, t)?,
                (None, Some(axis)) => self.slice(&mut order, body, at, t, axis)?,
                (Some(h), Some(w)) => {
                    return Err(invalid(format!(
                        "a layer's carried value {t} leaves split along axis {h}, but came in split along {w}"
                    )))
                }
            };
        }
        self.local.region_mut(body).results = new;
        self.local.region_mut(body).nodes = order;
        Ok(())
    }

    /// `causal_mask(x)` for `x [.., q, k]` with the rank's queries along `q`
    /// and every key along `k`: keys after the query's global position are −∞.
    fn causal_mask(
        &mut self,
        order: &mut Vec<NodeId>,
        region: RegionId,
        at: NodeId,
        x: TensorId,
    ) -> Result<TensorId> {
        let s = Dim::sym(self.seq);
        let iota = self.add(order, region, at, Op::Iota { len: s.clone() }, &[])?;
        let q = self.slice(order, region, at, iota, 0)?;
        let qf = self.add(order, region, at, Op::Cast(crate::DType::F32), &[q])?;
        let q_local = self.local.tensor(q).shape.dims()[0].clone();
        let qcol = self.add(
            order,
            region,
            at,
            Op::Reshape {
                shape: Shape(vec![q_local, Dim::konst(1)]),
            },
            &[qf],
        )?;
        let kf = self.add(order, region, at, Op::Cast(crate::DType::F32), &[iota])?;
        let krow = self.add(
            order,
            region,
            at,
            Op::Reshape {
                shape: Shape(vec![Dim::konst(1), s]),
            },
            &[kf],
        )?;
        let after = self.add(
            order,
            region,
            at,
            Op::Binary(crate::BinaryOp::Gt),
            &[krow, qcol],
        )?;
        let neg = self.add(order, region, at, Op::Constant(f64::NEG_INFINITY), &[])?;
        let out = self.add(order, region, at, Op::Select, &[after, neg, x])?;
        let r = self.local.tensor(out).shape.rank();
        self.axis.insert(out, r - 2);
        Ok(out)
    }

    /// How node `op` runs on inputs split as they are.
    fn decide(&self, op: &Op, inputs: &[TensorId], outputs: &[TensorId]) -> Result<Decision> {
        let splits: Vec<Option<usize>> = inputs.iter().map(|&t| self.split_axis(t)).collect();
        let rank = |t: TensorId| self.local.tensor(t).shape.rank();
        let mut d = Decision {
            out: vec![None; outputs.len()],
            ..Decision::default()
        };
        let first = splits.first().copied().flatten();
        match op {
            Op::Input(_) => {
                d.out[0] = self
                    .graph
                    .tensor(outputs[0])
                    .shape
                    .dims()
                    .iter()
                    .position(|x| self.is_seq(x));
            }
            Op::Param(_) | Op::Constant(_) | Op::Iota { .. } => {}
            Op::Unary(_) | Op::Cast(_) | Op::Dropout { .. } => d.out[0] = first,
            Op::Binary(_) | Op::Select | Op::Concat { .. } => {
                let r_out = rank(outputs[0]);
                if let Op::Concat { axis } = op {
                    for (i, l) in splits.iter().enumerate() {
                        if *l == Some(*axis) {
                            d.gather.push(i);
                        }
                    }
                }
                self.broadcast(inputs, &splits, r_out, outputs[0], &mut d)?;
            }
            Op::MatMul => {
                let (ra, rb) = (rank(inputs[0]), rank(inputs[1]));
                let r_out = rank(outputs[0]);
                let mut out = None;
                match splits[0] {
                    // The contraction runs over every position.
                    Some(a) if a + 1 == ra => d.gather.push(0),
                    Some(a) => out = Some(a + r_out - ra),
                    None => {}
                }
                if let Some(b) = splits[1] {
                    // The keys (along `n`, meeting the queries along `m`) or
                    // the values (along the contraction): every position.
                    // Keys are gathered even against whole queries (a
                    // cross-attention from another sequence): the scores
                    // split along the keys would be gathered for the
                    // softmax anyway, and they outweigh the keys.
                    let at_out = if b + 2 >= rb {
                        None
                    } else {
                        Some(b + r_out - rb)
                    };
                    match (at_out, out) {
                        (Some(o), None) => out = Some(o),
                        (Some(o), Some(x)) if o == x => {}
                        _ => d.gather.push(1),
                    }
                }
                d.out[0] = out;
            }
            Op::Transpose { perm } => {
                d.out[0] = first.and_then(|a| perm.iter().position(|&p| p == a));
            }
            Op::Reshape { .. } => {
                if let Some(a) = first {
                    match self.reshape_axis(inputs[0], a, outputs[0]) {
                        Some(b) => d.out[0] = Some(b),
                        None => d.gather.push(0),
                    }
                }
            }
            Op::Expand { .. } => {
                let r_in = rank(inputs[0]);
                let r_out = rank(outputs[0]);
                d.out[0] = match first {
                    Some(a) => Some(a + r_out - r_in),
                    // A value the same at every position, broadcast along
                    // the sequence: this rank's positions of it.
                    None => {
                        let in_dims = self.local.tensor(inputs[0]).shape.clone();
                        let out_dims = self.graph.tensor(outputs[0]).shape.clone();
                        out_dims.dims().iter().enumerate().position(|(i, x)| {
                            let j = (i + r_in).checked_sub(r_out);
                            self.is_seq(x) && j.is_none_or(|j| in_dims.dims()[j].is_one())
                        })
                    }
                };
            }
            // Along the sequence each reads its neighbours' positions: the
            // whole of it (the planner keeps cp off for such models, so this
            // only runs when a pad or running sum is along another axis).
            Op::Slice { axis, .. } | Op::Pad { axis, .. } | Op::CumSum { axis, .. } => {
                match first {
                    Some(a) if a == *axis => d.gather.push(0),
                    l => d.out[0] = l,
                }
            }
            Op::Reduce { axis, keep_dim, .. } => match first {
                Some(a) if a == *axis => d.gather.push(0),
                Some(a) => d.out[0] = Some(if !keep_dim && *axis < a { a - 1 } else { a }),
                None => {}
            },
            Op::Softmax { axis } | Op::LogSoftmax { axis } => match first {
                Some(a) if a == *axis => d.gather.push(0),
                l => d.out[0] = l,
            },
            Op::LayerNorm { .. } | Op::RmsNorm { .. } => {
                match first {
                    Some(a) if a + 1 == rank(inputs[0]) => d.gather.push(0),
                    l => d.out[0] = l,
                }
                for (i, l) in splits.iter().enumerate().skip(1) {
                    if l.is_some() {
                        d.gather.push(i);
                    }
                }
            }
            Op::CausalMask => match first {
                Some(a) if a + 1 == rank(inputs[0]) => d.gather.push(0),
                l => d.out[0] = l,
            },
            Op::Embedding => {
                if splits[0].is_some() {
                    d.gather.push(0);
                }
                d.out[0] = splits[1];
            }
            Op::TakeAlong => {
                let r = rank(inputs[0]);
                match (splits[0], splits[1]) {
                    (Some(a), _) if a + 1 == r => {
                        d.gather.push(0);
                        d.gather.push(1);
                    }
                    (a, b) if a == b => d.out[0] = a,
                    _ => {
                        d.gather.push(0);
                        d.gather.push(1);
                    }
                }
            }
            Op::TopK { .. } => match first {
                Some(a) if a + 1 == rank(inputs[0]) => d.gather.push(0),
                l => d.out = vec![l; outputs.len()],
            },
            // Routing fills capacity in token order: it sees every token.
            Op::MoeDispatch { .. } | Op::MoeCombine => {
                for (i, l) in splits.iter().enumerate() {
                    if l.is_some() {
                        d.gather.push(i);
                    }
                }
            }
            Op::Repeat { .. } | Op::Relayout { .. } | Op::VocabParallel(_) => {
                return Err(invalid(format!(
                    "{} is not rewritten here: a repeat by its body, a layout change is never in a model",
                    op.name()
                )))
            }
        }
        Ok(d)
    }

    /// Elementwise inputs broadcast together: the first split input decides
    /// the output's split axis; other split inputs are gathered, and whole
    /// inputs that run along that axis are sliced to this rank's positions.
    fn broadcast(
        &self,
        inputs: &[TensorId],
        splits: &[Option<usize>],
        r_out: usize,
        out: TensorId,
        d: &mut Decision,
    ) -> Result<()> {
        let rank = |i: usize| self.local.tensor(inputs[i]).shape.rank();
        let mut target = None;
        for (i, l) in splits.iter().enumerate() {
            if d.gather.contains(&i) {
                continue;
            }
            if let Some(a) = *l {
                let o = a + r_out - rank(i);
                match target {
                    None => target = Some(o),
                    Some(t) if t == o => {}
                    Some(_) => d.gather.push(i),
                }
            }
        }
        let Some(target) = target else {
            return Ok(());
        };
        let out_len = &self.graph.tensor(out).shape.dims()[target];
        for (i, l) in splits.iter().enumerate() {
            let r = rank(i);
            let split_here = l.is_some() && !d.gather.contains(&i);
            if split_here || target + r < r_out {
                continue;
            }
            let j = target + r - r_out;
            let len = &self.local.tensor(inputs[i]).shape.dims()[j];
            if len.is_one() {
                continue;
            }
            if len != out_len {
                return Err(invalid(format!(
                    "{} broadcasts {} of another length along the sequence",
                    out, inputs[i]
                )));
            }
            // A whole value, or one gathered here along its other sequence
            // axis, read at this rank's positions along this one.
            d.slice.push((i, j));
        }
        d.out[0] = Some(target);
        Ok(())
    }

    /// The axis of reshape output `out` that holds input `x`'s split axis
    /// `a` unchanged (the same dimension after the same leading elements).
    fn reshape_axis(&self, x: TensorId, a: usize, out: TensorId) -> Option<usize> {
        let in_dims = self.whole_dims(x, a)?;
        let out_dims = self.graph.tensor(out).shape.dims();
        let prefix = |dims: &[Dim], upto: usize| -> Option<Dim> {
            dims[..upto]
                .iter()
                .try_fold(Dim::konst(1), |acc, d| acc.checked_mul(d))
        };
        let want = prefix(&in_dims, a)?;
        (0..out_dims.len())
            .find(|&b| out_dims[b] == in_dims[a] && prefix(out_dims, b).is_some_and(|p| p == want))
    }

    /// The whole dims of `x`, split along `a`.
    fn whole_dims(&self, x: TensorId, a: usize) -> Option<Vec<Dim>> {
        self.whole_shape(x, a).ok().map(|s| s.dims().to_vec())
    }
}

#[cfg(test)]
mod tests {
    use super::{context_chunks, context_position};

    /// A rank's positions, mapped one by one, are its two chunks in order.
    #[test]
    fn positions_are_the_ranks_chunks() {
        for cp in 1..=4 {
            let seq = 2 * cp * 3;
            for rank in 0..cp {
                let want: Vec<usize> = context_chunks(seq, cp, rank)
                    .expect("2·cp divides seq")
                    .into_iter()
                    .flatten()
                    .collect();
                let len = seq / cp;
                let got: Vec<usize> = (0..len)
                    .map(|i| context_position(len, cp, rank, i))
                    .collect();
                assert_eq!(got, want, "cp {cp} rank {rank}");
            }
        }
    }
}
