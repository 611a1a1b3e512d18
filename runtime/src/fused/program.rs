//! Forward and backward of a graph as codegen planned them: each region's
//! fused kernels and matmuls in order, `repeat` bodies once per layer, then the fused backward kernels (with their column
//! sums) and the two gradient matmuls per forward matmul, in reverse.
//!
//! Every tensor is keyed by its *base*: the in-memory tensor a reshape view
//! reads, which is also what fused kernels and matmul operands name.
//!
//! A region's forward keeps only what its backward reads (and its results):
//! every other value is freed after the last step that reads it, and a layer's
//! activations are freed once its backward has run. Under full recomputation
//! a layer keeps only its arguments and runs forward again before backward. So peak memory is the
//! saved activations plus one region's transients, which is what the planner's
//! memory model counts.

use super::backend::{Backend, MatMul};
use crate::error::{kernel_err, Result, RuntimeError};
use crate::interp::ParamKey;
use dplc_codegen::{
    add_kernel, backward_plan, column_sum_kernel, convert_kernel, fuse, Args, BackwardStep, Elem,
    FusedKernel, FusionPlan, GradBinding, KeySize, Operand, Step,
};
use dplc_ir::{DType, GradPlan, Graph, NodeId, Op, RegionId, TensorId};
use std::collections::{BTreeMap, HashMap, HashSet};

/// A value on the device: its buffer, element type and element count.
pub struct Val<B: Backend> {
    pub buf: B::Buf,
    pub elem: Elem,
    pub len: usize,
}

impl<B: Backend> Clone for Val<B> {
    fn clone(&self) -> Self {
        Val {
            buf: self.buf.clone(),
            elem: self.elem,
            len: self.len,
        }
    }
}

/// Every region's fusion plan and backward steps, made once per graph.
pub struct FusedGraph {
    regions: HashMap<RegionId, (FusionPlan, Vec<BackwardStep>)>,
    lifetimes: HashMap<RegionId, Lifetimes>,
    grad: GradPlan,
}

/// When a region's forward may free its values.
struct Lifetimes {
    /// Per forward step, the bases no later step and no backward step reads.
    free_after: Vec<Vec<TensorId>>,
}

/// The in-memory tensor behind `t` (through reshapes).
fn base_of(graph: &Graph, mut t: TensorId) -> TensorId {
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
    ) -> Lifetimes {
        let base = |t: TensorId| base_of(graph, t);
        // What the backward reads, what the caller reads, and the loss.
        let region = graph.region(r);
        let mut keep: HashSet<TensorId> = region.results.iter().map(|&t| base(t)).collect();
        if r == graph.root() {
            keep.extend(graph.outputs().iter().map(|&t| base(t)));
        }
        for b in back {
            match b {
                BackwardStep::Kernel { step, backward } => {
                    if let Step::Kernel(k) = &plan.steps[*step] {
                        for bind in &backward.bindings {
                            if let GradBinding::Forward(j) = *bind {
                                keep.insert(base(k.buffers[j]));
                            }
                        }
                    }
                }
                BackwardStep::MatMul { step } => {
                    if let Step::MatMul { node, a, b } = &plan.steps[*step] {
                        let n = graph.node(*node);
                        if grad.needs_grad(n.inputs[0]) {
                            keep.insert(base(b.tensor));
                        }
                        if grad.needs_grad(n.inputs[1]) {
                            keep.insert(base(a.tensor));
                        }
                    }
                }
                BackwardStep::Extern { .. } => {}
            }
        }
        // The last forward step that writes or reads each base.
        let mut last: HashMap<TensorId, usize> = HashMap::new();
        for (i, step) in plan.steps.iter().enumerate() {
            let touched: Vec<TensorId> = match step {
                Step::Kernel(k) => k.buffers.clone(),
                Step::MatMul { node, a, b } => {
                    vec![a.tensor, b.tensor, graph.node(*node).outputs[0]]
                }
                Step::Extern { node, .. } => {
                    let n = graph.node(*node);
                    n.inputs.iter().chain(&n.outputs).copied().collect()
                }
            };
            for t in touched {
                last.insert(base(t), i);
            }
        }
        let mut free_after = vec![Vec::new(); plan.steps.len()];
        for (t, i) in last {
            if !keep.contains(&t) {
                free_after[i].push(t);
            }
        }
        Lifetimes { free_after }
    }
}

impl FusedGraph {
    /// Plan `graph`; fails on a step the executor cannot run (MoE routing).
    pub fn new(graph: &Graph) -> Result<FusedGraph> {
        let mut regions = HashMap::new();
        for (r, _) in graph.regions() {
            let plan = fuse(graph, r);
            for step in &plan.steps {
                if let Step::Extern { node, reason } = step {
                    if !matches!(graph.node(*node).op, Op::Repeat { .. }) {
                        return Err(RuntimeError::Unsupported(format!(
                            "the fused executor cannot run {} ({reason}); train this model on \
                             CPU ranks (--cluster Nxcpu)",
                            graph.node(*node).op.name()
                        )));
                    }
                }
            }
            let back = backward_plan(graph, &plan);
            regions.insert(r, (plan, back));
        }
        let grad = GradPlan::new(graph);
        let lifetimes = regions
            .iter()
            .map(|(&r, (plan, back))| (r, Lifetimes::new(graph, r, plan, back, &grad)))
            .collect();
        Ok(FusedGraph {
            regions,
            lifetimes,
            grad,
        })
    }

    /// Every distinct kernel the executor may launch for this graph in
    /// storage type `dtype` (for compiling ahead of the first step).
    pub fn kernels(&self) -> Vec<dplc_codegen::Kernel> {
        let mut out = super::train::step_kernels();
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

/// What one run of a region keeps for its backward.
pub struct RegionRun<B: Backend> {
    values: HashMap<TensorId, Val<B>>,
    /// Per repeat node, the runs of its body, first layer first.
    repeats: HashMap<NodeId, Vec<LayerRun<B>>>,
}

impl<B: Backend> RegionRun<B> {
    fn new() -> Self {
        RegionRun {
            values: HashMap::new(),
            repeats: HashMap::new(),
        }
    }
}

/// One layer of a `repeat`: its activations, or under full recomputation only
/// its arguments, from which backward runs the layer's forward again.
enum LayerRun<B: Backend> {
    Kept(RegionRun<B>),
    Checkpoint(Vec<Val<B>>),
}

/// Runs one micro-batch forward and backward on a backend.
pub struct Executor<'a> {
    pub graph: &'a Graph,
    pub fused: &'a FusedGraph,
    /// Values of the symbolic dims, by `SymId`.
    pub syms: Vec<i64>,
    /// The dropout key's state after the run's seed and the step: every
    /// kernel's `seed` argument (see `dplc_codegen::DrawKey`).
    pub seed: u64,
    /// Global index of this micro-batch's first sample, and its samples: the
    /// rest of the key, with which the kernels draw the CPU reference's masks.
    pub first_sample: u64,
    pub micro_batch: usize,
    /// Full recomputation: keep each layer's arguments only and run its
    /// forward again just before its backward (the same masks: a draw depends
    /// on the step, node, layer and sample, not on when it runs).
    pub recompute: bool,
}

/// Parameters the forward reads and where the backward leaves their gradients.
pub struct ParamBufs<B: Backend> {
    pub values: BTreeMap<ParamKey, Val<B>>,
    /// `f32` gradients, accumulated over micro-batches.
    pub grads: BTreeMap<ParamKey, Val<B>>,
}

impl<'a> Executor<'a> {
    fn dims(&self, t: TensorId) -> Vec<usize> {
        self.graph
            .tensor(t)
            .shape
            .dims()
            .iter()
            .map(|d| d.eval(&|s| self.syms[s.index()]).max(0) as usize)
            .collect()
    }

    fn numel(&self, t: TensorId) -> usize {
        self.dims(t).iter().product()
    }

    fn base(&self, t: TensorId) -> TensorId {
        base_of(self.graph, t)
    }

    fn get<B: Backend>(&self, run: &RegionRun<B>, t: TensorId) -> Result<Val<B>> {
        run.values
            .get(&self.base(t))
            .cloned()
            .ok_or_else(|| kernel_err("fused", format!("{t} is used before it is computed")))
    }

    fn plan(&self, r: RegionId) -> Result<&'a (FusionPlan, Vec<BackwardStep>)> {
        self.fused
            .regions
            .get(&r)
            .ok_or_else(|| kernel_err("fused", format!("region {r} has no plan")))
    }

    /// Launch arguments of a fused kernel at `layer`; its backward takes the same.
    fn args(&self, k: &FusedKernel, layer: u64) -> Args {
        let mut sizes: Vec<i64> = k
            .sizes
            .iter()
            .map(|d| d.eval(&|s| self.syms[s.index()]))
            .collect();
        for &(i, key) in &k.key_sizes {
            sizes[i] = match key {
                KeySize::Layer => layer as i64,
                KeySize::FirstSample => self.first_sample as i64,
                KeySize::PerSample(t) => per_sample(self.numel(t), self.micro_batch) as i64,
            };
        }
        Args {
            sizes,
            scalars: Vec::new(),
            seed: self.seed,
        }
    }

    fn matmul_of(&self, node: NodeId, a: &Operand, b: &Operand, dtype: DType) -> Result<MatMul> {
        let n = self.graph.node(node);
        let (sa, sb, so) = (
            self.dims(n.inputs[0]),
            self.dims(n.inputs[1]),
            self.dims(n.outputs[0]),
        );
        if sa.len() < 2 || sb.len() < 2 || so.len() < 2 {
            return Err(RuntimeError::Unsupported(format!(
                "matmul {node}: operands of rank below 2"
            )));
        }
        let batch: usize = so[..so.len() - 2].iter().product();
        let batched = |s: &[usize], what: &str| -> Result<bool> {
            let count: usize = s[..s.len() - 2].iter().product();
            if count == batch && batch > 1 {
                Ok(true)
            } else if count == 1 {
                Ok(false)
            } else {
                Err(RuntimeError::Unsupported(format!(
                    "matmul {node}: {what} broadcasts over part of the batch"
                )))
            }
        };
        let mut mm = MatMul {
            m: sa[sa.len() - 2],
            k: sa[sa.len() - 1],
            n: sb[sb.len() - 1],
            batch,
            a_transposed: a.transposed,
            b_transposed: b.transposed,
            a_batched: batched(&sa, "A")?,
            b_batched: batched(&sb, "B")?,
            dtype,
        };
        // A batch of rows times one weight is one taller matmul.
        if mm.a_batched && !mm.b_batched && !mm.a_transposed {
            mm.m *= mm.batch;
            mm.batch = 1;
            mm.a_batched = false;
        }
        Ok(mm)
    }

    /// Run region `r` forward with its arguments bound to `args` at `layer`.
    pub fn forward<B: Backend>(
        &self,
        be: &mut B,
        r: RegionId,
        args: Vec<Val<B>>,
        inputs: &HashMap<TensorId, Val<B>>,
        layer: u64,
        params: &ParamBufs<B>,
    ) -> Result<RegionRun<B>> {
        let (plan, _) = self.plan(r)?;
        let region = self.graph.region(r);
        let mut run = RegionRun::new();
        for (&a, v) in region.args.iter().zip(args) {
            run.values.insert(a, v);
        }
        for &n in &region.nodes {
            let node = self.graph.node(n);
            match node.op {
                Op::Param(p) => {
                    let key = ParamKey { param: p, layer };
                    let v = params.values.get(&key).ok_or_else(|| {
                        kernel_err(
                            "fused",
                            format!("parameter {p} of layer {layer} is not held"),
                        )
                    })?;
                    run.values.insert(node.outputs[0], v.clone());
                }
                Op::Input(_) => {
                    let v = inputs.get(&node.outputs[0]).ok_or_else(|| {
                        kernel_err("fused", format!("input {} is not fed", node.outputs[0]))
                    })?;
                    run.values.insert(node.outputs[0], v.clone());
                }
                _ => {}
            }
        }
        let free_after = &self
            .fused
            .lifetimes
            .get(&r)
            .ok_or_else(|| kernel_err("fused", format!("region {r} has no plan")))?
            .free_after;
        for (step, dead) in plan.steps.iter().zip(free_after) {
            match step {
                Step::Kernel(k) => {
                    let args = self.args(k, layer);
                    let mut bufs = Vec::with_capacity(k.buffers.len());
                    let mut outs = Vec::new();
                    for (i, (&t, kb)) in k.buffers.iter().zip(&k.kernel.buffers).enumerate() {
                        if kb.output {
                            let len = args.buffer_len(&k.kernel, i);
                            let v: Val<B> = Val {
                                buf: be.alloc(kb.elem, len)?,
                                elem: kb.elem,
                                len,
                            };
                            bufs.push(v.buf.clone());
                            outs.push((t, v));
                        } else {
                            bufs.push(self.get(&run, t)?.buf);
                        }
                    }
                    be.launch(&k.kernel, &args, &bufs)?;
                    run.values.extend(outs);
                }
                Step::MatMul { node, a, b } => {
                    let mm = self.matmul_of(*node, a, b, be.dtype())?;
                    let (x, y) = (self.get(&run, a.tensor)?, self.get(&run, b.tensor)?);
                    let len = mm.batch * mm.m * mm.n;
                    let c = Val {
                        buf: be.alloc(Elem::Float, len)?,
                        elem: Elem::Float,
                        len,
                    };
                    be.matmul(&mm, &x.buf, &y.buf, &c.buf)?;
                    run.values.insert(self.graph.node(*node).outputs[0], c);
                }
                Step::Extern { node, .. } => self.forward_repeat(be, &mut run, *node, params)?,
            }
            for t in dead {
                run.values.remove(t);
            }
        }
        Ok(run)
    }

    fn repeat_parts(&self, n: NodeId) -> Result<(u64, RegionId, usize)> {
        match self.graph.node(n).op {
            Op::Repeat {
                count,
                body,
                carried,
            } => Ok((count, body, carried)),
            ref op => Err(RuntimeError::Unsupported(format!(
                "the fused executor runs `{}` nowhere",
                op.name()
            ))),
        }
    }

    fn forward_repeat<B: Backend>(
        &self,
        be: &mut B,
        run: &mut RegionRun<B>,
        n: NodeId,
        params: &ParamBufs<B>,
    ) -> Result<()> {
        let (count, body, n_carried) = self.repeat_parts(n)?;
        let node = self.graph.node(n);
        let inputs: Vec<Val<B>> = node
            .inputs
            .iter()
            .map(|&t| self.get(run, t))
            .collect::<Result<_>>()?;
        let (mut carried, captured) = (inputs[..n_carried].to_vec(), &inputs[n_carried..]);
        let results = self.graph.region(body).results.clone();
        let mut runs = Vec::with_capacity(count as usize);
        for layer in 0..count {
            let args: Vec<Val<B>> = carried.iter().chain(captured).cloned().collect();
            let body_run = self.forward(be, body, args.clone(), &HashMap::new(), layer, params)?;
            carried = results
                .iter()
                .map(|&t| self.get(&body_run, t))
                .collect::<Result<_>>()?;
            runs.push(if self.recompute {
                LayerRun::Checkpoint(args)
            } else {
                LayerRun::Kept(body_run)
            });
        }
        for (&t, v) in node.outputs.iter().zip(carried) {
            run.values.insert(t, v);
        }
        run.repeats.insert(n, runs);
        Ok(())
    }

    /// `v` as a buffer of `elem` (a conversion kernel when the types differ).
    fn as_elem<B: Backend>(&self, be: &mut B, v: &Val<B>, elem: Elem) -> Result<Val<B>> {
        let same = v.elem == elem
            || (be.dtype() == DType::F32 && v.elem != Elem::I32 && elem != Elem::I32);
        if same {
            return Ok(v.clone());
        }
        let out = be.alloc(elem, v.len)?;
        be.launch(
            &convert_kernel(elem, v.elem),
            &flat_args(v.len),
            &[out.clone(), v.buf.clone()],
        )?;
        Ok(Val {
            buf: out,
            elem,
            len: v.len,
        })
    }

    /// Add `g` to the gradient of `t` (it becomes the gradient when there is none).
    fn add_grad<B: Backend>(
        &self,
        be: &mut B,
        grads: &mut HashMap<TensorId, Val<B>>,
        t: TensorId,
        g: Val<B>,
    ) -> Result<()> {
        let t = self.base(t);
        match grads.get(&t) {
            None => {
                grads.insert(t, g);
            }
            Some(acc) => {
                if acc.len != g.len {
                    return Err(kernel_err(
                        "fused backward",
                        format!(
                            "gradients of {t} with {} and {} elements meet",
                            acc.len, g.len
                        ),
                    ));
                }
                // A fresh sum: `acc` may be another tensor's gradient too (a
                // buffer handed through unchanged).
                let out = be.alloc(acc.elem, acc.len)?;
                be.launch(
                    &add_kernel(acc.elem, acc.elem, g.elem),
                    &flat_args(acc.len),
                    &[out.clone(), acc.buf.clone(), g.buf.clone()],
                )?;
                let elem = acc.elem;
                grads.insert(
                    t,
                    Val {
                        buf: out,
                        elem,
                        len: g.len,
                    },
                );
            }
        }
        Ok(())
    }

    /// Walk region `r` back from `grads` (seeded at its results); leaves the
    /// gradients of its arguments in `grads` and adds its parameters'
    /// gradients to `params.grads`.
    pub fn backward<B: Backend>(
        &self,
        be: &mut B,
        r: RegionId,
        run: &mut RegionRun<B>,
        grads: &mut HashMap<TensorId, Val<B>>,
        layer: u64,
        params: &mut ParamBufs<B>,
    ) -> Result<()> {
        let (plan, back) = self.plan(r)?;
        for bstep in back {
            match bstep {
                BackwardStep::Kernel { step, backward } => {
                    let Step::Kernel(k) = &plan.steps[*step] else {
                        return Err(kernel_err(
                            "fused backward",
                            "a kernel step that is not one",
                        ));
                    };
                    let has_grad = k
                        .buffers
                        .iter()
                        .zip(&k.kernel.buffers)
                        .any(|(&t, b)| b.output && grads.contains_key(&self.base(t)));
                    if !has_grad {
                        continue;
                    }
                    let args = self.args(k, layer);
                    let mut bufs = Vec::new();
                    let mut made: Vec<(GradBinding, Val<B>)> = Vec::new();
                    for (i, (bind, kb)) in backward
                        .bindings
                        .iter()
                        .zip(&backward.kernel.buffers)
                        .enumerate()
                    {
                        let len = args.buffer_len(&backward.kernel, i);
                        let v = match *bind {
                            GradBinding::Forward(j) => {
                                self.as_elem(be, &self.get(run, k.buffers[j])?, kb.elem)?
                            }
                            GradBinding::OutputGrad(j) => match grads.get(&self.base(k.buffers[j]))
                            {
                                Some(g) => self.as_elem(be, &g.clone(), kb.elem)?,
                                None => Val {
                                    buf: be.zeros(kb.elem, len)?,
                                    elem: kb.elem,
                                    len,
                                },
                            },
                            GradBinding::InputGrad(_) => Val {
                                buf: be.alloc(kb.elem, len)?,
                                elem: kb.elem,
                                len,
                            },
                            GradBinding::InputGradAccumulate(_) | GradBinding::Partial(_) => Val {
                                buf: be.zeros(kb.elem, len)?,
                                elem: kb.elem,
                                len,
                            },
                        };
                        bufs.push(v.buf.clone());
                        if kb.output {
                            made.push((*bind, v));
                        }
                    }
                    be.launch(&backward.kernel, &args, &bufs)?;
                    for (bind, v) in made {
                        match bind {
                            GradBinding::InputGrad(j) | GradBinding::InputGradAccumulate(j) => {
                                self.add_grad(be, grads, k.buffers[j], v)?;
                            }
                            GradBinding::Partial(j) => {
                                let cs = backward
                                    .column_sums
                                    .iter()
                                    .find(|c| c.input == j)
                                    .ok_or_else(|| {
                                        kernel_err("fused backward", "a partial without its sum")
                                    })?;
                                let cargs = Args {
                                    sizes: cs.sizes(&args.sizes),
                                    ..Args::default()
                                };
                                let len = cargs.sizes[1].max(0) as usize;
                                let out: Val<B> = Val {
                                    buf: be.alloc(Elem::Float, len)?,
                                    elem: Elem::Float,
                                    len,
                                };
                                be.launch(&cs.kernel, &cargs, &[v.buf, out.buf.clone()])?;
                                self.add_grad(be, grads, k.buffers[j], out)?;
                            }
                            GradBinding::Forward(_) | GradBinding::OutputGrad(_) => {}
                        }
                    }
                }
                BackwardStep::MatMul { step } => {
                    let Step::MatMul { node, a, b } = &plan.steps[*step] else {
                        return Err(kernel_err(
                            "fused backward",
                            "a matmul step that is not one",
                        ));
                    };
                    self.matmul_backward(be, run, grads, *node, a, b)?;
                }
                BackwardStep::Extern { step, .. } => {
                    let Step::Extern { node, .. } = &plan.steps[*step] else {
                        return Err(kernel_err(
                            "fused backward",
                            "an extern step that is not one",
                        ));
                    };
                    self.backward_repeat(be, run, grads, *node, params)?;
                }
            }
        }
        for &n in &self.graph.region(r).nodes {
            if let Op::Param(p) = self.graph.node(n).op {
                let t = self.graph.node(n).outputs[0];
                if let Some(g) = grads.remove(&t) {
                    let key = ParamKey { param: p, layer };
                    let acc = params.grads.get(&key).cloned().ok_or_else(|| {
                        kernel_err("fused backward", format!("no gradient buffer for {p}"))
                    })?;
                    // Accumulate into the f32 gradient in place.
                    be.launch(
                        &add_kernel(Elem::F32, Elem::F32, g.elem),
                        &flat_args(acc.len),
                        &[acc.buf.clone(), acc.buf.clone(), g.buf],
                    )?;
                }
            }
        }
        Ok(())
    }

    fn matmul_backward<B: Backend>(
        &self,
        be: &mut B,
        run: &RegionRun<B>,
        grads: &mut HashMap<TensorId, Val<B>>,
        node: NodeId,
        a: &Operand,
        b: &Operand,
    ) -> Result<()> {
        let n = self.graph.node(node);
        let Some(dc) = grads.get(&self.base(n.outputs[0])).cloned() else {
            return Ok(());
        };
        let dc = self.as_elem(be, &dc, Elem::Float)?;
        let mm = self.matmul_of(node, a, b, be.dtype())?;
        // Each gradient reads the other operand only; the forward kept just that.
        if self.fused.grad.needs_grad(n.inputs[0]) {
            let y = self.get(run, b.tensor)?;
            let y = self.as_elem(be, &y, Elem::Float)?;
            // dA = dC·op(B)ᵀ, stored as A is: transposed, dAᵀ = op(B)·dCᵀ.
            let g = if mm.a_transposed {
                MatMul {
                    m: mm.k,
                    n: mm.m,
                    k: mm.n,
                    a_transposed: mm.b_transposed,
                    b_transposed: true,
                    a_batched: mm.b_batched,
                    b_batched: mm.batch > 1,
                    ..mm
                }
            } else {
                MatMul {
                    m: mm.m,
                    n: mm.k,
                    k: mm.n,
                    a_transposed: false,
                    b_transposed: !mm.b_transposed,
                    a_batched: mm.batch > 1,
                    b_batched: mm.b_batched,
                    ..mm
                }
            };
            let (l, r) = if mm.a_transposed {
                (&y, &dc)
            } else {
                (&dc, &y)
            };
            let d = self.reduced_matmul(be, &g, l, r, mm.a_batched)?;
            self.add_grad(be, grads, a.tensor, d)?;
        }
        if self.fused.grad.needs_grad(n.inputs[1]) {
            let x = self.get(run, a.tensor)?;
            let x = self.as_elem(be, &x, Elem::Float)?;
            // dB = op(A)ᵀ·dC; stored transposed, dBᵀ = dCᵀ·op(A).
            let g = if mm.b_transposed {
                MatMul {
                    m: mm.n,
                    n: mm.k,
                    k: mm.m,
                    a_transposed: true,
                    b_transposed: mm.a_transposed,
                    a_batched: mm.batch > 1,
                    b_batched: mm.a_batched,
                    ..mm
                }
            } else {
                MatMul {
                    m: mm.k,
                    n: mm.n,
                    k: mm.m,
                    a_transposed: !mm.a_transposed,
                    b_transposed: false,
                    a_batched: mm.a_batched,
                    b_batched: mm.batch > 1,
                    ..mm
                }
            };
            let (l, r) = if mm.b_transposed {
                (&dc, &x)
            } else {
                (&x, &dc)
            };
            let d = self.reduced_matmul(be, &g, l, r, mm.b_batched)?;
            self.add_grad(be, grads, b.tensor, d)?;
        }
        Ok(())
    }

    /// Run `g`; when the operand it differentiates is shared over the batch
    /// (`batched` false with a batch above 1), sum the per-batch results.
    fn reduced_matmul<B: Backend>(
        &self,
        be: &mut B,
        g: &MatMul,
        l: &Val<B>,
        r: &Val<B>,
        batched: bool,
    ) -> Result<Val<B>> {
        let per = g.m * g.n;
        let all = be.alloc(Elem::Float, per * g.batch)?;
        be.matmul(g, &l.buf, &r.buf, &all)?;
        if batched || g.batch == 1 {
            return Ok(Val {
                buf: all,
                elem: Elem::Float,
                len: per * g.batch,
            });
        }
        // The column sum reads f32 shares.
        let shares = self.as_elem(
            be,
            &Val {
                buf: all,
                elem: Elem::Float,
                len: per * g.batch,
            },
            Elem::F32,
        )?;
        let out = be.alloc(Elem::Float, per)?;
        be.launch(
            &column_sum_kernel(),
            &Args {
                sizes: vec![g.batch as i64, per as i64],
                ..Args::default()
            },
            &[shares.buf, out.clone()],
        )?;
        Ok(Val {
            buf: out,
            elem: Elem::Float,
            len: per,
        })
    }

    fn backward_repeat<B: Backend>(
        &self,
        be: &mut B,
        run: &mut RegionRun<B>,
        grads: &mut HashMap<TensorId, Val<B>>,
        n: NodeId,
        params: &mut ParamBufs<B>,
    ) -> Result<()> {
        let (_, body, n_carried) = self.repeat_parts(n)?;
        let node = self.graph.node(n);
        // Taken out of the run: each layer's activations are freed after its backward.
        let mut runs = run
            .repeats
            .remove(&n)
            .ok_or_else(|| kernel_err("fused backward", "a repeat without its forward"))?;
        let mut carried: Vec<Option<Val<B>>> = node
            .outputs
            .iter()
            .map(|&t| grads.remove(&self.base(t)))
            .collect();
        let region = self.graph.region(body);
        while let Some(layer_run) = runs.pop() {
            let layer = runs.len();
            let mut body_run = match layer_run {
                LayerRun::Kept(r) => r,
                LayerRun::Checkpoint(args) => {
                    self.forward(be, body, args, &HashMap::new(), layer as u64, params)?
                }
            };
            let mut body_grads: HashMap<TensorId, Val<B>> = HashMap::new();
            for (&t, g) in region.results.iter().zip(carried.iter_mut()) {
                if let Some(g) = g.take() {
                    self.add_grad(be, &mut body_grads, t, g)?;
                }
            }
            self.backward(
                be,
                body,
                &mut body_run,
                &mut body_grads,
                layer as u64,
                params,
            )?;
            for (j, &a) in region.args.iter().enumerate() {
                let g = body_grads.remove(&a);
                if j < n_carried {
                    carried[j] = g;
                } else if let Some(g) = g {
                    self.add_grad(be, grads, node.inputs[j], g)?;
                }
            }
        }
        for (j, g) in carried.into_iter().enumerate() {
            if let Some(g) = g {
                self.add_grad(be, grads, node.inputs[j], g)?;
            }
        }
        Ok(())
    }

    /// The `f32` value of a float tensor of a run (the loss, for a report).
    pub fn read<B: Backend>(
        &self,
        be: &mut B,
        run: &RegionRun<B>,
        t: TensorId,
    ) -> Result<Vec<f32>> {
        let v = self.get(run, t)?;
        be.download(&v.buf, v.elem, self.numel(t))
    }
}

/// Launch arguments of a flat kernel over `len` elements.
pub fn flat_args(len: usize) -> Args {
    Args {
        sizes: vec![len as i64],
        ..Args::default()
    }
}

/// Elements per sample of a dropout's output of `numel` elements in a
/// micro-batch of `micro_batch` samples, as the CPU reference splits it
/// (`kernels::DropoutKey::mask`), or 0 where the reference keys every element
/// with the shared sample `u64::MAX` (see `dplc_codegen::DrawKey`).
fn per_sample(numel: usize, micro_batch: usize) -> usize {
    let per = if micro_batch > 0 && numel.is_multiple_of(micro_batch) {
        numel / micro_batch
    } else {
        numel
    };
    if per == numel && micro_batch != 1 {
        0
    } else {
        per
    }
}

#[cfg(test)]
mod tests {
    use super::per_sample;
    use crate::kernels::DropoutKey;
    use dplc_codegen::{draw_seed, draw_state, drop_threshold, dropout_draw};

    /// The fused kernels' draws, from the kernel `seed` and size arguments
    /// the executor passes, drop exactly the CPU reference's elements:
    /// several samples, one sample, and a tensor not split by sample.
    #[test]
    fn kernel_draws_are_the_reference_masks() {
        let (seed, step, node, layer, first) = (11u64, 3u64, 41u64, 2u64, 6u64);
        assert_eq!(draw_seed(seed, step), crate::rng::hash(&[seed, step]));
        for (numel, batch) in [(24usize, 4usize), (10, 1), (10, 4), (7, 3)] {
            for p in [0.1, 0.5, 0.3333] {
                let key = DropoutKey {
                    seed,
                    step,
                    node,
                    layer,
                    first_sample: first,
                    batch,
                };
                let keep = key.mask(p, numel);
                let state = draw_state(draw_seed(seed, step), node, layer as i64);
                let per = per_sample(numel, batch) as i64;
                let threshold = drop_threshold(p) as f32;
                let fused: Vec<bool> = (0..numel as i64)
                    .map(|i| dropout_draw(state, first as i64, per, i) >= threshold)
                    .collect();
                assert_eq!(fused, keep, "{numel} elements, {batch} samples, p {p}");
            }
        }
        // The draws themselves are the reference's uniforms.
        let state = draw_state(draw_seed(seed, step), node, layer as i64);
        for i in 0..16i64 {
            let want = crate::rng::uniform(&[seed, step, node, layer, first + 1, i as u64]);
            assert_eq!(dropout_draw(state, first as i64, 16, 16 + i), want);
        }
    }
}
