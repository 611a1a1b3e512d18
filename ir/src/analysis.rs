//! Analyses derived from the graph, never from per-model formulas: parameters
//! by block, forward FLOPs, and the activations each layer stores for backward.

use crate::{
    BinaryOp, Dim, Graph, NodeId, Op, Poly, Precision, Ratio, ReduceKind, RegionId, ScopeId,
    ScopeKind, TensorDef, TensorId, UnaryOp,
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

/// What a stored tensor holds, which fixes its bytes per element.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum SavedKind {
    /// An activation in the training precision.
    Float,
    /// A dropout mask, one byte per element.
    Mask,
    /// Integer indices (token ids, top-k choices), four bytes per element.
    Index,
    /// Per-row statistics of a norm (mean and/or rstd), fp32.
    Stats,
}

impl SavedKind {
    pub fn bytes(self, precision: Precision) -> u64 {
        match self {
            SavedKind::Float => precision.bytes(),
            SavedKind::Mask => 1,
            SavedKind::Index | SavedKind::Stats => 4,
        }
    }
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

    /// What one iteration of `region` stores for backward. Nested repeats are
    /// not included: analyse their bodies separately.
    ///
    /// A tensor counts when the backward of some node needs it, it depends on
    /// the data (parameters are counted elsewhere), and its storage belongs to
    /// this iteration (the region's nodes or its carried arguments). Views are
    /// traced to the tensor they alias and each storage counts once.
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
                let shape = &g.tensor(root).shape;
                let elements = match kind {
                    SavedKind::Stats => {
                        let per_row = if matches!(g.node(n).op, Op::LayerNorm { .. }) {
                            2
                        } else {
                            1
                        };
                        let rows = shape.numel().and_then(|e| e.checked_div(shape.last()?));
                        match rows.and_then(|r| r.checked_scale(Ratio::int(per_row))) {
                            Some(r) => r,
                            None => continue,
                        }
                    }
                    _ => match shape.numel() {
                        Some(e) => e,
                        None => continue,
                    },
                };
                profile.saved.push(SavedTensor {
                    tensor: root,
                    kind,
                    elements,
                    saved_by: n,
                });
            }
        }
        profile
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

    /// The tensors node `n`'s backward reads, given which inputs need gradients.
    fn saved_by(&self, n: NodeId) -> Vec<(TensorId, SavedKind)> {
        use SavedKind::*;
        let node = self.graph.node(n);
        let ins = &node.inputs;
        let rg = |i: usize| self.requires_grad(ins[i]);
        let out = node.outputs.first().copied();
        let mut saved = Vec::new();
        let mut save = |cond: bool, t: TensorId, kind: SavedKind| {
            if cond {
                saved.push((t, kind));
            }
        };
        match &node.op {
            Op::Input(_) | Op::Param(_) | Op::Constant(_) | Op::Iota { .. } | Op::Repeat { .. } => {
            }
            // A layout change's backward is another collective: nothing kept.
            Op::Relayout { .. } => {}
            Op::Cast(_)
            | Op::Transpose { .. }
            | Op::Reshape { .. }
            | Op::Expand { .. }
            | Op::Slice { .. }
            | Op::Concat { .. }
            | Op::CausalMask => {}
            Op::Unary(u) => {
                let out = out.expect("unary ops have one output");
                match u {
                    UnaryOp::Neg => {}
                    UnaryOp::Exp
                    | UnaryOp::Sqrt
                    | UnaryOp::Rsqrt
                    | UnaryOp::Recip
                    | UnaryOp::Tanh
                    | UnaryOp::Sigmoid
                    | UnaryOp::Relu => save(rg(0), out, Float),
                    UnaryOp::Log
                    | UnaryOp::Gelu
                    | UnaryOp::GeluTanh
                    | UnaryOp::Silu
                    | UnaryOp::Sin
                    | UnaryOp::Cos => save(rg(0), ins[0], Float),
                }
            }
            Op::Binary(b) => match b {
                BinaryOp::Add | BinaryOp::Sub => {}
                BinaryOp::Mul => {
                    save(rg(0), ins[1], Float);
                    save(rg(1), ins[0], Float);
                }
                BinaryOp::Div => {
                    save(rg(0) || rg(1), ins[1], Float);
                    save(rg(1), ins[0], Float);
                }
                BinaryOp::Max | BinaryOp::Min | BinaryOp::Pow => {
                    save(rg(0) || rg(1), ins[0], Float);
                    save(rg(0) || rg(1), ins[1], Float);
                }
            },
            Op::MatMul => {
                save(rg(1), ins[0], Float);
                save(rg(0), ins[1], Float);
            }
            Op::Reduce { kind, .. } => {
                if *kind == ReduceKind::Max {
                    save(rg(0), ins[0], Float);
                    save(rg(0), out.expect("reductions have one output"), Float);
                }
            }
            Op::Softmax { .. } | Op::LogSoftmax { .. } => {
                save(rg(0), out.expect("softmax has one output"), Float)
            }
            Op::LayerNorm { .. } | Op::RmsNorm { .. } => {
                let any = ins.iter().enumerate().any(|(i, _)| rg(i));
                save(any, ins[0], Float);
                save(any, ins[0], Stats);
            }
            Op::Dropout { .. } => save(rg(0), ins[0], Mask),
            Op::Embedding => save(rg(0), ins[1], Index),
            Op::TakeAlong => save(rg(0), ins[1], Index),
            Op::TopK { .. } => save(rg(0), node.outputs[1], Index),
            Op::MoeDispatch { .. } => save(rg(0), ins[1], Index),
            Op::MoeCombine => {
                save(rg(1), ins[0], Float);
                save(rg(0), ins[1], Float);
                save(rg(0) || rg(1), ins[2], Index);
            }
            // What the whole op keeps, at the rank's share.
            Op::VocabParallel(v) => match v {
                crate::VocabOp::Embedding | crate::VocabOp::TakeAlong => save(rg(0), ins[1], Index),
                crate::VocabOp::Softmax { .. } | crate::VocabOp::LogSoftmax { .. } => {
                    save(rg(0), out.expect("softmax has one output"), Float)
                }
            },
        }
        saved
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
