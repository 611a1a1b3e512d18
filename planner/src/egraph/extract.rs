//! DAG-aware extraction: per-rank step time where every e-class counts once.
//! A tree-cost fixpoint seeds the choice; single-class switches evaluated on
//! the whole DAG then improve it until none helps.

use super::analysis::{Data, Part, ShardGraph};
use super::lang::{MeshAxis, ShardLang};
use super::{LinkCost, ShardOptions};
use dplc_ir::{Dim, Op};
use egg::{Id, Language};
use fxhash::{FxHashMap as HashMap, FxHashSet as HashSet};
use std::collections::BTreeMap;

/// Cost of the e-nodes: compute, memory traffic and communication of one
/// training step (forward and backward) on one rank.
pub struct CostModel<'a> {
    pub opts: &'a ShardOptions,
    /// Classes that feed a contraction split: Megatron splits a contraction
    /// only when an earlier op already split its input, so these may not be
    /// slices of a replicated activation.
    pub computed_split: HashSet<Id>,
}

fn eval(d: &Dim, opts: &ShardOptions, eg: &ShardGraph) -> f64 {
    let ctx = &eg.analysis.ctx;
    let bind = |s: dplc_ir::SymId| {
        if Some(s) == ctx.seq_sym {
            opts.seq as i64
        } else if Some(s) == ctx.batch_sym {
            opts.batch as i64
        } else {
            1
        }
    };
    d.eval(&bind) as f64
}

pub fn numel(shape: &[Dim], opts: &ShardOptions, eg: &ShardGraph) -> f64 {
    shape.iter().map(|d| eval(d, opts, eg)).product()
}

/// Elements one rank holds: the global count over the split mesh axes. An
/// expert shard of an activation holds its experts' slots for every rank's
/// tokens, so the expert axis does not shrink activations.
pub fn local_numel(data: &Data, opts: &ShardOptions, eg: &ShardGraph) -> f64 {
    let mut n = numel(data.shape(), opts, eg);
    if let Some(l) = data.layout() {
        for m in MeshAxis::ALL {
            if let Part::Sharded(_) = l.get(m) {
                if m != MeshAxis::Ep || data.flags().weight {
                    n /= eg.analysis.ctx.degree(m) as f64;
                }
            }
        }
    }
    n
}

impl<'a> CostModel<'a> {
    pub fn new(opts: &'a ShardOptions, eg: &ShardGraph) -> CostModel<'a> {
        let mut computed_split = HashSet::default();
        for class in eg.classes() {
            for n in &class.nodes {
                if let ShardLang::MatMul([_, a, _]) = n {
                    let k = eg[*a].data.shape().len().saturating_sub(1);
                    if eg[*a]
                        .data
                        .layout()
                        .is_some_and(|l| l.0.contains(&Part::Sharded(k)))
                    {
                        computed_split.insert(eg.find(*a));
                    }
                }
            }
        }
        CostModel {
            opts,
            computed_split,
        }
    }

    fn link(&self, m: MeshAxis) -> &LinkCost {
        &self.opts.links[m.index()]
    }

    /// One collective of `bytes` (the whole tensor) over `m`: ring algorithm.
    pub fn collective(&self, m: MeshAxis, bytes: f64, all_reduce: bool, eg: &ShardGraph) -> f64 {
        let d = eg.analysis.ctx.degree(m) as f64;
        let link = self.link(m);
        let factor = if all_reduce { 2.0 } else { 1.0 };
        link.alpha_s + factor * (d - 1.0) / d * bytes / link.bytes_per_s
    }

    /// Whether `(shard m a x)` is a stored shard rather than a slice:
    /// weights and constants are kept split, and a sequence-parallel
    /// argument arrives split.
    pub fn stored_shard(eg: &ShardGraph, n: &ShardLang) -> bool {
        match n {
            ShardLang::Shard([m, a, x]) => {
                let f = eg[*x].data.flags();
                if f.weight || f.constant {
                    return true;
                }
                let arg_split = eg[*x].nodes.iter().any(|xn| match xn {
                    ShardLang::Arg(i) => {
                        let i = super::analysis::num_of(eg, *i).unwrap_or(-1) as usize;
                        let local = eg.analysis.ctx.local_args.get(i).copied().flatten();
                        super::analysis::mesh_of(eg, *m) == Some(MeshAxis::Tp)
                            && local.map(|s| s as i64) == super::analysis::num_of(eg, *a)
                    }
                    _ => false,
                });
                arg_split
            }
            _ => false,
        }
    }

    /// The classes whose values `n` reads (tags, axes and stored shards' full tensors excluded).
    pub fn inputs(eg: &ShardGraph, n: &ShardLang) -> Vec<Id> {
        if Self::stored_shard(eg, n) {
            return vec![];
        }
        n.children()
            .iter()
            .copied()
            .filter(|c| matches!(eg[*c].data, Data::Tensor { .. }))
            .collect()
    }

    pub fn node_cost(&self, eg: &ShardGraph, class: Id, n: &ShardLang) -> f64 {
        use ShardLang::*;
        let o = self.opts;
        let ctx = &eg.analysis.ctx;
        let data = &eg[class].data;
        if data.layout().is_none() {
            return f64::INFINITY;
        }
        let eb = o.element_bytes as f64;
        let eps = 1e-12;
        let mem = |elements: f64| 3.0 * elements * eb / o.memory_bytes_per_s;
        let full_bytes = |id: &Id| numel(eg[*id].data.shape(), o, eg) * eb;
        let mesh = |id: &Id| super::analysis::mesh_of(eg, *id).unwrap_or(MeshAxis::Tp);
        eps + match n {
            Mesh(_) | Tag(_) | Num(_) | Partial(_) | Leaf(_) => 0.0,
            Arg(i) => {
                let i = super::analysis::num_of(eg, *i).unwrap_or(-1) as usize;
                if ctx.local_args.get(i).copied().flatten().is_some() {
                    f64::INFINITY
                } else {
                    0.0
                }
            }
            Param(_) => {
                let shape = data.shape();
                let expert = shape.len() == 3 && ctx.splits(shape, 0, MeshAxis::Ep);
                if expert {
                    f64::INFINITY
                } else {
                    o.replicated_weight_s_per_byte * full_bytes(&class)
                }
            }
            Shard([m, _, x]) => {
                let local = local_numel(data, o, eg);
                if eg[*x].data.flags().weight {
                    o.replicated_weight_s_per_byte * local * eb
                } else if Self::stored_shard(eg, n) {
                    0.0
                } else if mesh(m) == MeshAxis::Ep || self.computed_split.contains(&eg.find(class)) {
                    // An expert shard of an activation holds other ranks'
                    // tokens: only an all-to-all makes it.
                    f64::INFINITY
                } else {
                    local * eb / o.memory_bytes_per_s
                }
            }
            AllReduce([m, x]) => 2.0 * self.collective(mesh(m), full_bytes(x), true, eg),
            AllGather([m, _, x]) | ReduceScatter([m, _, x]) | AllToAll([m, _, x]) => {
                2.0 * self.collective(mesh(m), full_bytes(x), false, eg)
            }
            Reshape(_) | Transpose(_) | Expand(_) | Slice(_) | Opaque(_) => 0.0,
            MatMul([tag, a, _]) => {
                let tag = super::analysis::tag_of(eg, *tag).expect("tagged");
                let info = ctx.op(tag);
                let mut k = info.in_shapes[0]
                    .last()
                    .map(|d| eval(d, o, eg))
                    .unwrap_or(1.0);
                if let Some(l) = eg[*a].data.layout() {
                    for m in MeshAxis::ALL {
                        if l.get(m) == Part::Sharded(info.in_shapes[0].len() - 1) {
                            k /= ctx.degree(m) as f64;
                        }
                    }
                }
                3.0 * 2.0 * local_numel(data, o, eg) * k / o.flops_per_s
            }
            _ => {
                let mut elements = local_numel(data, o, eg);
                for c in Self::inputs(eg, n) {
                    elements += local_numel(&eg[c].data, o, eg);
                }
                let mut t = mem(elements);
                if let (Softmax([tag, x]), Some(l)) = (n, eg[n.children()[1]].data.layout()) {
                    let (tag, x) = (*tag, *x);
                    let tag = super::analysis::tag_of(eg, tag).expect("tagged");
                    if let Op::Softmax { axis } | Op::LogSoftmax { axis } = ctx.op(tag).op {
                        for m in MeshAxis::ALL {
                            if l.get(m) == Part::Sharded(axis) {
                                let shape = eg[x].data.shape();
                                let rows = numel(shape, o, eg) / eval(&shape[axis], o, eg);
                                t += self.collective(m, 2.0 * rows * 4.0, true, eg);
                            }
                        }
                    }
                }
                t
            }
        }
    }
}

/// The extracted program: one chosen e-node per reachable class.
#[derive(Clone, Debug)]
pub struct Program {
    pub roots: Vec<Id>,
    pub choice: BTreeMap<Id, ShardLang>,
    /// Reachable classes, operands before users.
    pub order: Vec<Id>,
    pub cost: f64,
}

pub fn extract(eg: &ShardGraph, roots: &[Id], cost: &CostModel) -> Program {
    let roots: Vec<Id> = roots.iter().map(|r| eg.find(*r)).collect();
    let mut classes: Vec<Id> = eg.classes().map(|c| c.id).collect();
    classes.sort();
    let mut node_costs: HashMap<(Id, usize), f64> = HashMap::default();
    for &c in &classes {
        for (i, n) in eg[c].nodes.iter().enumerate() {
            node_costs.insert((c, i), cost.node_cost(eg, c, n));
        }
    }
    // Tree-cost fixpoint (shared operands counted per use): a starting choice.
    let mut best: HashMap<Id, (f64, usize)> = HashMap::default();
    loop {
        let mut changed = false;
        for &c in &classes {
            for (i, n) in eg[c].nodes.iter().enumerate() {
                let mut total = node_costs[&(c, i)];
                for ch in CostModel::inputs(eg, n) {
                    match best.get(&eg.find(ch)) {
                        Some((x, _)) => total += x,
                        None => total = f64::INFINITY,
                    }
                }
                let better = match best.get(&c) {
                    Some((old, _)) => total < *old * (1.0 - 1e-12),
                    None => total.is_finite(),
                };
                if better {
                    best.insert(c, (total, i));
                    changed = true;
                }
            }
        }
        if !changed {
            break;
        }
    }
    let mut choice: HashMap<Id, usize> = best.iter().map(|(c, (_, i))| (*c, *i)).collect();
    let mut current = dag_cost(eg, &roots, &choice, &node_costs).unwrap_or(f64::INFINITY);
    // Local improvement on the DAG cost.
    for _sweep in 0..6 {
        let mut improved = false;
        let order = match topo(eg, &roots, &choice) {
            Some(o) => o,
            None => break,
        };
        for &c in order.iter().rev() {
            let keep = choice[&c];
            for i in 0..eg[c].nodes.len() {
                if i == keep || !node_costs[&(c, i)].is_finite() {
                    continue;
                }
                choice.insert(c, i);
                match dag_cost(eg, &roots, &choice, &node_costs) {
                    Some(total) if total < current * (1.0 - 1e-9) => {
                        current = total;
                        improved = true;
                        break;
                    }
                    _ => {
                        choice.insert(c, keep);
                    }
                }
            }
        }
        if !improved {
            break;
        }
    }
    let order = topo(eg, &roots, &choice).unwrap_or_default();
    Program {
        choice: order
            .iter()
            .map(|c| (*c, eg[*c].nodes[choice[c]].clone()))
            .collect(),
        order,
        roots,
        cost: current,
    }
}

/// Classes reachable from `roots` under `choice`, operands first; `None` on a cycle.
fn topo(eg: &ShardGraph, roots: &[Id], choice: &HashMap<Id, usize>) -> Option<Vec<Id>> {
    let mut state: HashMap<Id, u8> = HashMap::default();
    let mut order = Vec::new();
    fn visit(
        eg: &ShardGraph,
        c: Id,
        choice: &HashMap<Id, usize>,
        state: &mut HashMap<Id, u8>,
        order: &mut Vec<Id>,
    ) -> Option<()> {
        match state.get(&c) {
            Some(1) => return None,
            Some(_) => return Some(()),
            None => {}
        }
        state.insert(c, 1);
        let n = &eg[c].nodes[*choice.get(&c)?];
        for ch in CostModel::inputs(eg, n) {
            visit(eg, eg.find(ch), choice, state, order)?;
        }
        state.insert(c, 2);
        order.push(c);
        Some(())
    }
    for &r in roots {
        visit(eg, r, choice, &mut state, &mut order)?;
    }
    Some(order)
}

fn dag_cost(
    eg: &ShardGraph,
    roots: &[Id],
    choice: &HashMap<Id, usize>,
    node_costs: &HashMap<(Id, usize), f64>,
) -> Option<f64> {
    let order = topo(eg, roots, choice)?;
    Some(order.iter().map(|c| node_costs[&(*c, choice[c])]).sum())
}
