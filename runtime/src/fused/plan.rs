//! The fused plan of a rank's program: codegen's fusion of each region,
//! its backward plan, and when each tensor can be freed — made once and shared
//! by every rank that runs the program ([`super::executor`] runs it).
//!
//! Every tensor is keyed by its *base*: the in-memory tensor a reshape view
//! reads, which is also what fused kernels and matmul operands name.

use crate::error::{Result, RuntimeError};
use dplc_codegen::{
    add_kernel, backward_plan, column_sum_kernel, convert_kernel, fuse_with, AttentionPass,
    BackwardStep, Elem, FuseConfig, FusionPlan, GradBinding, Step,
};
use dplc_ir::{
    AttentionKind, GradPlan, Graph, LayerRecompute, NodeId, Op, Recompute, RegionId, SavedAt,
    TensorId,
};
use std::collections::{HashMap, HashSet};

/// Whether `op` runs as a host step (the others a library call or kernel).
/// A running sum is a scan kernel; it runs here only where fusion could not
/// write one (read at another position of its row).
pub(crate) fn is_host_step(op: &Op) -> bool {
    matches!(
        op,
        Op::Relayout { .. }
            | Op::VocabParallel(_)
            | Op::TopK { .. }
            | Op::MoeDispatch { .. }
            | Op::MoeCombine
            | Op::CumSum { .. }
    )
}

/// Every region's fusion plan and backward steps, made once per graph.
pub struct FusedGraph {
    pub(super) regions: HashMap<RegionId, (FusionPlan, Vec<BackwardStep>)>,
    pub(super) lifetimes: HashMap<RegionId, Lifetimes>,
    pub(super) grad: GradPlan,
    /// What a layer keeps for its backward. Recomputed values are the same
    /// values: a dropout draw depends on the step, node, layer and sample,
    /// not on when it runs.
    pub(super) recompute: LayerRecompute,
    /// Per region, the forward steps that write a core-attention tensor:
    /// what selective recomputation drops after a layer's forward and runs
    /// again before its backward.
    pub(super) core_steps: HashMap<RegionId, Vec<usize>>,
}

/// When a region's forward may free its values.
pub(super) struct Lifetimes {
    /// Per forward step, the bases no later step and no backward step reads.
    pub(super) free_after: Vec<Vec<TensorId>>,
    /// A layer's results its own backward does not read: handed on to the
    /// next layer (or the root) after the forward, not kept by this one.
    pub(super) handed_on: Vec<TensorId>,
    /// Every base the backward reads.
    pub(super) saved: HashSet<TensorId>,
    /// Per backward step (in backward order), the saved bases no later
    /// backward step reads: freed once it has run, as autograd frees a
    /// node's saved tensors after its backward.
    pub(super) free_after_backward: Vec<Vec<TensorId>>,
    /// Gathered matmul inputs the forward does not keep, with the relayout
    /// that makes them: the backward runs it again, from the shard it keeps
    /// instead, before the first matmul backward that reads the value
    /// ([`regathered`]).
    pub(super) regather: HashMap<TensorId, NodeId>,
}

/// The relayout that makes `t` when the backward may make it again rather
/// than keep it: an all-gather of a sequence- or tensor-parallel shard into
/// the whole value (Megatron's sequence parallelism keeps the shard of a
/// column-parallel linear's input and gathers it again for the weight
/// gradient, which is what the planner prices), or Megatron's `f`, whose
/// forward is a copy.
fn regathered(graph: &Graph, t: TensorId) -> Option<NodeId> {
    use dplc_ir::TensorLayout::{Replicated, Split};
    let dplc_ir::TensorDef::Node { node, .. } = graph.tensor(t).def else {
        return None;
    };
    match graph.node(node).op {
        Op::Relayout {
            from: Split { .. } | Replicated,
            to: Replicated,
            ..
        } => Some(node),
        _ => None,
    }
}

/// The in-memory tensor behind `t` (through reshapes).
pub(super) fn base_of(graph: &Graph, mut t: TensorId) -> TensorId {
    while let Some(n) = graph.producer(t) {
        match n.op {
            Op::Reshape { .. } => t = n.inputs[0],
            _ => break,
        }
    }
    t
}

impl Lifetimes {
    fn new(
        graph: &Graph,
        r: RegionId,
        plan: &FusionPlan,
        back: &[BackwardStep],
        grad: &GradPlan,
        rerun: &[usize],
    ) -> Lifetimes {
        let base = |t: TensorId| base_of(graph, t);
        let region = graph.region(r);
        // What the backward reads: the activation rule's values
        // (`dplc_ir::saved_values`) for matmuls and host steps, and for a
        // fused kernel the buffers its backward binds — the rule's values, or
        // the kernel inputs it recomputes them from.
        let mut saved: HashSet<TensorId> = HashSet::new();
        let rule = |node: NodeId, ins: &[TensorId], outs: &[TensorId]| -> Vec<TensorId> {
            grad.saved(graph, node)
                .into_iter()
                .map(|s| match s.at {
                    SavedAt::Input(i) => ins[i],
                    SavedAt::Output(i) => outs[i],
                })
                .collect()
        };
        // What each backward step reads.
        let mut reads: Vec<Vec<TensorId>> = vec![Vec::new(); back.len()];
        for (b, reads) in back.iter().zip(&mut reads) {
            match b {
                BackwardStep::Kernel { step, backward } => {
                    if let Step::Kernel(k) = &plan.steps[*step] {
                        for bind in &backward.bindings {
                            if let GradBinding::Forward(j) = *bind {
                                reads.push(k.buffers[j]);
                            }
                        }
                    }
                }
                BackwardStep::MatMul { step } => {
                    if let Step::MatMul { node, a, b } = &plan.steps[*step] {
                        let outs = &graph.node(*node).outputs;
                        reads.extend(rule(*node, &[a.tensor, b.tensor], outs));
                    }
                }
                BackwardStep::Attention { step } => {
                    // Q, K, V, the bias and the output (the log-sum-exp is
                    // the step's own, outside the graph).
                    if let Step::Attention(at) = &plan.steps[*step] {
                        reads.extend(at.inputs());
                        reads.push(at.out);
                    }
                }
                BackwardStep::Extern { step, .. } => {
                    if let Step::Extern { node, .. } = &plan.steps[*step] {
                        let n = graph.node(*node);
                        if is_host_step(&n.op) {
                            reads.extend(rule(*node, &n.inputs, &n.outputs));
                        }
                    }
                }
            }
        }
        // A gathered value only matmul backwards read is gathered again from
        // its shard, which is what they read instead: kept from its last
        // forward reader until its first backward one, it is not in memory.
        let is_matmul = |b: &BackwardStep| matches!(b, BackwardStep::MatMul { .. });
        let only_matmuls_read = |t: TensorId| {
            back.iter()
                .zip(&reads)
                .all(|(b, r)| is_matmul(b) || !r.iter().any(|&x| base(x) == t))
                && !region.results.iter().any(|&x| base(x) == t)
        };
        let regather: HashMap<TensorId, NodeId> = back
            .iter()
            .zip(&reads)
            .filter(|(b, _)| is_matmul(b))
            .flat_map(|(_, r)| r.iter().map(|&x| base(x)))
            .filter_map(|t| {
                regathered(graph, t)
                    .filter(|_| only_matmuls_read(t))
                    .map(|n| (t, n))
            })
            .collect();
        for (b, r) in back.iter().zip(&mut reads) {
            if is_matmul(b) {
                for x in r.iter_mut() {
                    if let Some(&node) = regather.get(&base(*x)) {
                        *x = graph.node(node).inputs[0];
                    }
                }
            }
        }
        // The last backward step that reads each base; a regathered value
        // lives from its first matmul reader to its last.
        let mut last_read: HashMap<TensorId, usize> = HashMap::new();
        let mut last_regather: HashMap<TensorId, usize> = HashMap::new();
        for (bi, (b, r)) in back.iter().zip(&reads).enumerate() {
            for &t in r {
                saved.insert(base(t));
                last_read.insert(base(t), bi);
            }
            if let BackwardStep::MatMul { step } = b {
                if let Step::MatMul { a, b, .. } = &plan.steps[*step] {
                    for t in [base(a.tensor), base(b.tensor)] {
                        if regather.contains_key(&t) {
                            last_regather.insert(t, bi);
                        }
                    }
                }
            }
        }
        // A host step's backward reads each of its inputs and outputs that
        // any backward step keeps (the executor hands it what is saved).
        for (bi, b) in back.iter().enumerate() {
            if let BackwardStep::Extern { step, .. } = b {
                if let Step::Extern { node, .. } = &plan.steps[*step] {
                    let n = graph.node(*node);
                    if is_host_step(&n.op) {
                        for t in n.inputs.iter().chain(&n.outputs).map(|&t| base(t)) {
                            if saved.contains(&t) {
                                let last = last_read.entry(t).or_insert(bi);
                                *last = (*last).max(bi);
                            }
                        }
                    }
                }
            }
        }
        // What the caller reads after the forward: a layer's results (the
        // next layer's arguments, kept there if its backward reads them),
        // the root's outputs (the loss).
        let mut keep = saved.clone();
        keep.extend(region.results.iter().map(|&t| base(t)));
        if r == graph.root() {
            keep.extend(graph.outputs().iter().map(|&t| base(t)));
        }
        // Selective recomputation runs these steps again: what they read stays.
        for &i in rerun {
            let read = step_tensors(graph, &plan.steps[i]).into_iter().map(base);
            saved.extend(read.clone());
            keep.extend(read);
        }
        let handed_on = if r == graph.root() {
            Vec::new()
        } else {
            region
                .results
                .iter()
                .map(|&t| base(t))
                .filter(|t| !saved.contains(t))
                .collect()
        };
        // The last forward step that writes or reads each base.
        let mut last: HashMap<TensorId, usize> = HashMap::new();
        for (i, step) in plan.steps.iter().enumerate() {
            for t in step_tensors(graph, step) {
                last.insert(base(t), i);
            }
        }
        let mut free_after = vec![Vec::new(); plan.steps.len()];
        for (t, i) in last {
            if !keep.contains(&t) {
                free_after[i].push(t);
            }
        }
        let mut free_after_backward = vec![Vec::new(); back.len()];
        for (t, bi) in last_read.into_iter().chain(last_regather) {
            free_after_backward[bi].push(t);
        }
        Lifetimes {
            free_after,
            handed_on,
            saved,
            free_after_backward,
            regather,
        }
    }
}

/// Every tensor a forward step reads or writes.
pub(super) fn step_tensors(graph: &Graph, step: &Step) -> Vec<TensorId> {
    match step {
        Step::Kernel(k) => k.buffers.clone(),
        Step::MatMul { node, a, b } => vec![a.tensor, b.tensor, graph.node(*node).outputs[0]],
        Step::Attention(at) => {
            let mut v = at.inputs();
            v.push(at.out);
            v
        }
        Step::Extern { node, .. } => {
            let n = graph.node(*node);
            n.inputs.iter().chain(&n.outputs).copied().collect()
        }
    }
}

/// The tensors a forward step writes.
pub(super) fn step_outputs(graph: &Graph, step: &Step) -> Vec<TensorId> {
    match step {
        Step::Kernel(k) => k
            .buffers
            .iter()
            .zip(&k.kernel.buffers)
            .filter(|(_, b)| b.output)
            .map(|(&t, _)| t)
            .collect(),
        Step::MatMul { node, .. } | Step::Extern { node, .. } => graph.node(*node).outputs.clone(),
        Step::Attention(at) => vec![at.out],
    }
}

impl FusedGraph {
    /// Plan `graph` for a run without recomputation or pipeline cuts, each
    /// attention the fused kernel takes as one step.
    pub fn new(graph: &Graph) -> Result<FusedGraph> {
        let none = LayerRecompute {
            policy: Recompute::None,
            layers: 0,
        };
        FusedGraph::for_run(graph, none, AttentionKind::Fused, &[])
    }

    /// Plan `graph` for a run that recomputes as `recompute` says and runs
    /// attention as `attention` says, with the root values of `cut` (those
    /// crossing pipeline stages) kept in memory; fails on a step the
    /// executor cannot run (MoE routing).
    pub fn for_run(
        graph: &Graph,
        recompute: LayerRecompute,
        attention: AttentionKind,
        cut: &[TensorId],
    ) -> Result<FusedGraph> {
        let mut regions = HashMap::new();
        for (r, _) in graph.regions() {
            let config = FuseConfig {
                cut: if r == graph.root() { cut } else { &[] },
                attention,
            };
            let mut plan = fuse_with(graph, r, &config);
            for step in &plan.steps {
                if let Step::Extern { node, reason } = step {
                    let op = &graph.node(*node).op;
                    if !matches!(op, Op::Repeat { .. }) && !is_host_step(op) {
                        return Err(RuntimeError::Unsupported(format!(
                            "the fused executor cannot run {} ({reason}); run this model with \
                             --compute reference on CPU ranks (--cluster Nxcpu)",
                            graph.node(*node).op.name()
                        )));
                    }
                }
            }
            let back = backward_plan(graph, &mut plan);
            regions.insert(r, (plan, back));
        }
        let grad = GradPlan::new(graph);
        let core_steps: HashMap<RegionId, Vec<usize>> = regions
            .iter()
            .map(
                |(&r, (plan, _)): (&RegionId, &(FusionPlan, Vec<BackwardStep>))| {
                    let steps = if recompute.policy == Recompute::Selective && r != graph.root() {
                        plan.steps
                            .iter()
                            .enumerate()
                            .filter(|(_, st)| {
                                !matches!(st, Step::Extern { .. })
                                    && step_outputs(graph, st)
                                        .into_iter()
                                        .any(|t| dplc_ir::attention_core_tensor(graph, t))
                            })
                            .map(|(i, _)| i)
                            .collect()
                    } else {
                        Vec::new()
                    };
                    (r, steps)
                },
            )
            .collect();
        let lifetimes = regions
            .iter()
            .map(|(&r, (plan, back))| {
                (
                    r,
                    Lifetimes::new(graph, r, plan, back, &grad, &core_steps[&r]),
                )
            })
            .collect();
        Ok(FusedGraph {
            regions,
            lifetimes,
            grad,
            recompute,
            core_steps,
        })
    }

    /// What one run of region `r` keeps for its backward, by base: the
    /// activation rule's values, through fusion (parameters and inputs
    /// included where the backward reads them).
    pub fn saved(&self, r: RegionId) -> Vec<TensorId> {
        let mut v: Vec<TensorId> = self
            .lifetimes
            .get(&r)
            .map(|l| l.saved.iter().copied().collect())
            .unwrap_or_default();
        v.sort();
        v
    }

    /// The op of a step that runs on the host, if the graph has one.
    pub fn host_step_op(&self, graph: &Graph) -> Option<&'static str> {
        self.regions.values().find_map(|(plan, _)| {
            plan.steps.iter().find_map(|st| match st {
                Step::Extern { node, .. } if is_host_step(&graph.node(*node).op) => {
                    Some(graph.node(*node).op.name())
                }
                _ => None,
            })
        })
    }

    /// The graph's attentions as fusion took them: how many run as one
    /// fused kernel, and why each other one runs op by op.
    pub fn attentions(&self, graph: &Graph) -> crate::AttentionUse {
        let mut usage = crate::AttentionUse::default();
        let mut regions: Vec<_> = self.regions.iter().collect();
        regions.sort_by_key(|(r, _)| **r);
        for (_, (plan, _)) in regions {
            usage.fused += plan
                .steps
                .iter()
                .filter(|s| matches!(s, Step::Attention(_)))
                .count();
            usage
                .unfused
                .extend(plan.unfused_attention.iter().map(|(n, reason)| {
                    format!("the attention at {}: {reason}", graph.node(*n).outputs[0])
                }));
        }
        usage
    }

    /// Every pass of every fused attention the executor may launch with
    /// floats stored as `dtype`.
    pub fn attention_passes(
        &self,
        dtype: dplc_ir::DType,
    ) -> Vec<(dplc_codegen::AttentionKernel, AttentionPass)> {
        let mut out = Vec::new();
        for (plan, _) in self.regions.values() {
            for step in &plan.steps {
                if let Step::Attention(at) = step {
                    let backward = dplc_codegen::attention_backward(&at.kernel, dtype);
                    for pass in at.kernel.passes(backward) {
                        if at.kernel.runs(pass, [true; 4]) {
                            out.push((at.kernel.clone(), pass));
                        }
                    }
                }
            }
        }
        out
    }

    /// Every distinct kernel the executor may launch for this graph in
    /// storage type `dtype` (for compiling ahead of the first step).
    pub fn kernels(&self) -> Vec<dplc_codegen::Kernel> {
        // The executor's own: gradient sums and element-type conversions.
        let mut out = vec![
            column_sum_kernel(),
            dplc_codegen::column_chunk_kernel(),
            add_kernel(Elem::F32, Elem::F32, Elem::Float),
            add_kernel(Elem::F32, Elem::F32, Elem::F32),
            add_kernel(Elem::Float, Elem::Float, Elem::Float),
            add_kernel(Elem::Float, Elem::Float, Elem::F32),
            convert_kernel(Elem::Float, Elem::F32),
            convert_kernel(Elem::F32, Elem::Float),
        ];
        for (plan, back) in self.regions.values() {
            out.extend(plan.kernels().map(|k| k.kernel.clone()));
            for b in back {
                if let BackwardStep::Kernel { backward, .. } = b {
                    out.push(backward.kernel.clone());
                    out.extend(backward.column_sums.iter().map(|c| c.kernel.clone()));
                }
            }
        }
        out
    }
}
