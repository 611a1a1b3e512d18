//! Analyses derived from the graph, never from per-model formulas: parameters
//! by block, forward FLOPs, and the activations each layer stores for backward.

use crate::autodiff::{input_grads, saved_values, SavedAt, SavedKind};
use crate::{
    Dim, Graph, NodeId, Op, Poly, Precision, Ratio, RegionId, ScopeId, ScopeKind, TensorDef,
    TensorId,
};
use std::collections::HashSet;

/// Whether a tensor of `elements` grows with the square of the sequence (or
/// faster): the core-attention tensors — scores, their softmax and dropout —
/// that selective recomputation recomputes instead of keeping (Korthikanti
/// et al. 2022). The planner prices recomputation by this rule and the
/// runtime drops and recomputes by it.
pub fn attention_core(elements: &Dim, seq: Option<crate::SymId>) -> bool {
    seq.is_some_and(|seq| elements.syms().iter().filter(|&&s| s == seq).count() >= 2)
}

/// [`attention_core`] for tensor `t` of `graph`, the sequence being the
/// symbolic dimension `seq`: what the runtime's backends drop under selective
/// recomputation.
pub fn attention_core_tensor(graph: &crate::Graph, t: crate::TensorId) -> bool {
    let seq = graph.sym_by_name("seq");
    graph
        .tensor(t)
        .shape
        .numel()
        .is_some_and(|e| attention_core(&e, seq))
}

/// One tensor kept from the forward pass for the backward pass.
#[derive(Clone, Debug, PartialEq)]
pub struct SavedTensor {
    /// The storage that is kept: views are traced back to the tensor they alias.
    pub tensor: TensorId,
    pub kind: SavedKind,
    /// Elements for one iteration of the region.
    pub elements: Dim,
    /// The first node whose backward needs it.
    pub saved_by: NodeId,
}

/// The activations one iteration of a region keeps for backward.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct ActivationProfile {
    pub saved: Vec<SavedTensor>,
}

impl ActivationProfile {
    /// Bytes kept, as a polynomial in the symbolic dims.
    pub fn bytes(&self, precision: Precision) -> Poly {
        let mut p = Poly::zero();
        for s in &self.saved {
            p.add_dim(&s.elements, Ratio::int(s.kind.bytes(precision) as i64));
        }
        p
    }
}

/// Per-tensor facts that the analyses share, computed once.
pub struct Analysis<'g> {
    graph: &'g Graph,
    /// The tensor depends on a parameter: its gradient is needed.
    requires_grad: Vec<bool>,
    /// The tensor depends on a model input: it is an activation, not a constant.
    data_dependent: Vec<bool>,
}

impl<'g> Analysis<'g> {
    pub fn new(graph: &'g Graph) -> Analysis<'g> {
        let n = graph_tensor_count(graph);
        let mut a = Analysis {
            graph,
            requires_grad: vec![false; n],
            data_dependent: vec![false; n],
        };
        a.propagate(graph.root());
        a
    }

    pub fn requires_grad(&self, t: TensorId) -> bool {
        self.requires_grad[t.index()]
    }

    pub fn is_activation(&self, t: TensorId) -> bool {
        self.data_dependent[t.index()]
    }

    fn propagate(&mut self, region: RegionId) {
        let g = self.graph;
        for &n in &g.region(region).nodes {
            let node = g.node(n);
            let any = |flags: &[bool]| node.inputs.iter().any(|t| flags[t.index()]);
            let (rg, dd) = match &node.op {
                Op::Param(_) => (true, false),
                Op::Input(_) => (false, true),
                Op::Constant(_) | Op::Iota { .. } => (false, false),
                Op::Repeat { body, carried, .. } => {
                    self.propagate_repeat(node.inputs.clone(), *body, *carried);
                    let results = g.region(*body).results.clone();
                    for (&out, &res) in node.outputs.iter().zip(&results) {
                        self.requires_grad[out.index()] = self.requires_grad[res.index()];
                        self.data_dependent[out.index()] = self.data_dependent[res.index()];
                    }
                    continue;
                }
                _ => (any(&self.requires_grad), any(&self.data_dependent)),
            };
            for &out in &node.outputs {
                // Integer outputs (indices) carry no gradient.
                let float = g.tensor(out).dtype.is_float();
                self.requires_grad[out.index()] = rg && float;
                self.data_dependent[out.index()] = dd;
            }
        }
    }

    /// Flags of a repeat body: carried values start from the initial values and
    /// widen to what the body yields, until nothing changes (the lattice is two
    /// booleans per argument, so this ends after at most two passes each).
    fn propagate_repeat(&mut self, inputs: Vec<TensorId>, body: RegionId, carried: usize) {
        let args = self.graph.region(body).args.clone();
        let results = self.graph.region(body).results.clone();
        for (&arg, &input) in args.iter().zip(&inputs) {
            self.requires_grad[arg.index()] = self.requires_grad[input.index()];
            self.data_dependent[arg.index()] = self.data_dependent[input.index()];
        }
        loop {
            self.propagate(body);
            let mut changed = false;
            for (&arg, &res) in args.iter().zip(&results).take(carried) {
                for flags in [&mut self.requires_grad, &mut self.data_dependent] {
                    if flags[res.index()] && !flags[arg.index()] {
                        flags[arg.index()] = true;
                        changed = true;
                    }
                }
            }
            if !changed {
                break;
            }
        }
    }

    /// Forward FLOPs of one iteration of `region` (nested repeats included,
    /// times their counts): matmuls and attention, `2·m·n·k` each.
    pub fn region_flops(&self, region: RegionId) -> Poly {
        self.flops_where(region, &|_| true)
    }

    /// Forward FLOPs of the whole model for one step.
    pub fn forward_flops(&self) -> Poly {
        self.region_flops(self.graph.root())
    }

    /// The part of [`Self::forward_flops`] in matmuls between two activations
    /// (attention scores and their product with values).
    pub fn attention_flops(&self) -> Poly {
        let g = self.graph;
        self.flops_where(g.root(), &|n| {
            g.node(n).inputs.iter().all(|&t| self.is_activation(t))
        })
    }

    fn flops_where(&self, region: RegionId, keep: &dyn Fn(NodeId) -> bool) -> Poly {
        let g = self.graph;
        let mut total = Poly::zero();
        for &n in &g.region(region).nodes {
            let node = g.node(n);
            match &node.op {
                Op::MatMul if keep(n) => {
                    let a = &g.tensor(node.inputs[0]).shape;
                    let out = &g.tensor(node.outputs[0]).shape;
                    let k = a.last().expect("matmul operands have rank >= 2");
                    if let Some(macs) = out.numel().and_then(|e| e.checked_mul(k)) {
                        total.add_dim(&macs, Ratio::int(2));
                    }
                }
                Op::Repeat { body, count, .. } => {
                    let inner = self.flops_where(*body, keep);
                    total.add_poly(&inner, Ratio::int(*count as i64));
                }
                _ => {}
            }
        }
        total
    }

    /// What one iteration of `region` stores for backward: the values
    /// [`saved_values`] names for each node.
    ///
    /// A tensor counts when the backward of some node needs it, it depends on
    /// the data (parameters are counted elsewhere), and its storage belongs to
    /// this iteration (the region's nodes or its carried arguments). Views are
    /// traced to the tensor they alias and each storage counts once.
    ///
    /// Fusion: a value computed by a unary elementwise op from a kept value,
    /// and read by nothing but one elementwise op, is never written to memory
    /// — the fused kernel of its reader recomputes it, forward and backward,
    /// from the kept value (SwiGLU's `silu(gate)`) — so it is not kept either.
    /// A matmul operand is always in memory, so it stays (GPT's GeLU output).
    pub fn activations(&self, region: RegionId) -> ActivationProfile {
        let g = self.graph;
        let reg = g.region(region);
        let carried = match reg.repeat.map(|n| &g.node(n).op) {
            Some(Op::Repeat { carried, .. }) => *carried,
            _ => 0,
        };
        let local = |t: TensorId| match g.tensor(t).def {
            TensorDef::Node { node, .. } => g.node(node).region == region,
            TensorDef::Arg { region: r, index } => r == region && index < carried,
        };
        let mut seen = HashSet::new();
        let mut profile = ActivationProfile::default();
        for &n in &reg.nodes {
            for (t, kind) in self.saved_by(n) {
                let root = self.storage_root(t);
                if !self.is_activation(root) || !local(root) || !seen.insert((root, kind)) {
                    continue;
                }
                let Some(elements) = g.tensor(root).shape.numel() else {
                    continue;
                };
                profile.saved.push(SavedTensor {
                    tensor: root,
                    kind,
                    elements,
                    saved_by: n,
                });
            }
        }
        let floats: HashSet<TensorId> = profile
            .saved
            .iter()
            .filter(|s| s.kind == SavedKind::Float)
            .map(|s| s.tensor)
            .collect();
        profile.saved.retain(|s| {
            s.kind != SavedKind::Float || !self.recomputed_in_kernel(region, s.tensor, &floats)
        });
        profile
    }

    /// Whether fusion recomputes `t` from a kept value instead of keeping it
    /// (see [`Self::activations`]).
    fn recomputed_in_kernel(
        &self,
        region: RegionId,
        t: TensorId,
        kept: &HashSet<TensorId>,
    ) -> bool {
        let g = self.graph;
        let Some(node) = g.producer(t) else {
            return false;
        };
        if node.region != region || !matches!(node.op, Op::Unary(_)) {
            return false;
        }
        if !kept.contains(&self.storage_root(node.inputs[0])) {
            return false;
        }
        let reg = g.region(region);
        if reg.results.contains(&t) {
            return false;
        }
        let mut readers = reg.nodes.iter().filter(|&&n| g.node(n).inputs.contains(&t));
        matches!(
            (readers.next(), readers.next()),
            (Some(&r), None) if matches!(g.node(r).op, Op::Unary(_) | Op::Binary(_))
        )
    }

    /// For each input of node `n`, whether its backward produces a gradient
    /// for it: the input depends on a parameter through float values, a
    /// gradient can flow through that position, and some output needs one
    /// (as [`crate::GradPlan::input_grads`]).
    pub fn input_grads(&self, n: NodeId) -> Vec<bool> {
        let g = self.graph;
        input_grads(g, n, &|t| {
            g.tensor(t).dtype.is_float() && self.requires_grad(t)
        })
    }

    /// The tensor whose storage `t` aliases.
    pub fn storage_root(&self, mut t: TensorId) -> TensorId {
        while let Some(node) = self.graph.producer(t) {
            if !node.op.is_view() {
                break;
            }
            t = node.inputs[0];
        }
        t
    }

    /// The tensors node `n`'s backward reads ([`saved_values`]).
    fn saved_by(&self, n: NodeId) -> Vec<(TensorId, SavedKind)> {
        let node = self.graph.node(n);
        saved_values(&node.op, &self.input_grads(n))
            .into_iter()
            .map(|s| {
                let t = match s.at {
                    SavedAt::Input(i) => node.inputs[i],
                    SavedAt::Output(i) => node.outputs[i],
                };
                (t, s.kind)
            })
            .collect()
    }

    /// Parameters grouped by the outermost block they were declared in (a
    /// parameter declared directly in the model is its own group), in order of
    /// first appearance.
    pub fn params_by_block(&self) -> Vec<(String, u128)> {
        let g = self.graph;
        let mut groups: Vec<(String, u128)> = Vec::new();
        for (id, info) in g.params() {
            let key = self
                .outermost_block(info.scope)
                .unwrap_or_else(|| info.name.clone());
            let n = g.param_elements(id);
            match groups.iter_mut().find(|(k, _)| *k == key) {
                Some((_, total)) => *total += n,
                None => groups.push((key, n)),
            }
        }
        groups
    }

    fn outermost_block(&self, scope: ScopeId) -> Option<String> {
        let g = self.graph;
        let mut found = None;
        let mut cur = Some(scope);
        while let Some(s) = cur {
            if let ScopeKind::Block { block } = &g.scope(s).kind {
                found = Some(block.clone());
            }
            cur = g.scope(s).parent;
        }
        found
    }

    /// Iterations of the model's top-level `repeat`s: its number of layers.
    pub fn layers(&self) -> u64 {
        let g = self.graph;
        g.region(g.root())
            .nodes
            .iter()
            .filter_map(|&n| match g.node(n).op {
                Op::Repeat { count, .. } => Some(count),
                _ => None,
            })
            .sum()
    }

    /// The model's layer stacks, its top-level `repeat`s in program order:
    /// each repeat node, its body and its number of layers.
    pub fn stacks(&self) -> Vec<(NodeId, RegionId, u64)> {
        let g = self.graph;
        g.region(g.root())
            .nodes
            .iter()
            .filter_map(|&n| match g.node(n).op {
                Op::Repeat { body, count, .. } => Some((n, body, count)),
                _ => None,
            })
            .collect()
    }

    /// The body of the first top-level `repeat`: the model's layer.
    pub fn layer_body(&self) -> Option<RegionId> {
        let g = self.graph;
        g.region(g.root())
            .nodes
            .iter()
            .find_map(|&n| match g.node(n).op {
                Op::Repeat { body, .. } => Some(body),
                _ => None,
            })
    }
}

fn graph_tensor_count(graph: &Graph) -> usize {
    graph.nodes().map(|(_, n)| n.outputs.len()).sum::<usize>()
        + graph.regions().map(|(_, r)| r.args.len()).sum::<usize>()
}
