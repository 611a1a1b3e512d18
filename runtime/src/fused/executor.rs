//! The fused executor: forward and backward of a rank's program as its
//! [`FusedGraph`] planned them — each region's fused kernels and matmuls in
//! order, `repeat` bodies once per layer, then the fused backward kernels
//! (with their column sums) and the two gradient matmuls per forward matmul,
//! in reverse — on any [`Backend`], with the steps no kernel runs handed to
//! the caller's [`HostSteps`].
//!
//! A region's forward keeps only what its backward reads (and its results):
//! every other value is freed after the last step that reads it. Its
//! backward frees as it goes, as autograd does: each step's output
//! gradients once the step has read them, each saved value after the last
//! backward step that reads it. Under full recomputation a layer keeps only
//! its arguments and runs forward again before its backward. So peak memory
//! is the saved activations plus one step's gradients and temporaries; the
//! planner's memory model counts the first (README: measured against it).
//! The backward lives in [`backward`], the hand-off to the caller's
//! [`HostSteps`] (layout changes, steps no kernel runs) in [`host`], the
//! ops over a split vocabulary in [`vocab`] and MoE routing in [`moe`];
//! this file has the forward and the bindings both passes share.

use super::backend::{Backend, MatMul};
use super::plan::{base_of, is_host_step, step_outputs, FusedGraph};
use crate::error::{kernel_err, Result, RuntimeError};
use crate::interp::ParamKey;
use crate::tensor::{Data, Tensor};
use dplc_codegen::{
    add_kernel, attention_backward, column_sum_kernel, convert_kernel, Args, AttentionBuffer,
    AttentionPass, BackwardStep, Elem, FusedAttention, FusedKernel, FusionPlan, GradBinding,
    KeyPlace, KeySize, Operand, Step,
};
use dplc_ir::{DType, Graph, NodeId, Op, ParamId, Recompute, RegionId, TensorId, TensorLayout};
use std::cell::RefCell;
use std::collections::{BTreeMap, HashMap, HashSet};

mod backward;
mod host;
mod moe;
mod vocab;

/// The steps no kernel runs, done on the host by the executor's caller
/// (values cross as host tensors at the local program's shapes), and the
/// group exchanges of those the device runs: a layout change over the
/// mesh's groups ([`HostSteps::relayout`], on the device), an op over a
/// split vocabulary ([`HostSteps::vocab`]). MoE routing runs on the device
/// but for the routing tables, made by the executor itself.
pub trait HostSteps<B: Backend> {
    /// Node `node`'s outputs from its inputs.
    fn forward(&mut self, node: NodeId, ins: Vec<Tensor>) -> Result<Vec<Tensor>>;
    /// The gradients of node `node`'s inputs (`None` where none flows) from
    /// its inputs, outputs and output gradients, as its forward left them.
    fn backward(
        &mut self,
        node: NodeId,
        ins: Vec<Tensor>,
        outs: Vec<Tensor>,
        gouts: Vec<Option<Tensor>>,
    ) -> Result<Vec<Option<Tensor>>>;
    /// Layer `layer` (its iteration of repeat node `stack`) is about to
    /// read its parameters (`enter`), or the pass is done with them, in the
    /// forward or the backward: where they are sharded, the caller puts the
    /// layer's entries into the pass's [`ParamBufs`] (gathered weights; in
    /// the backward, the gradient accumulators) and takes them out again,
    /// reducing the gradients.
    fn layer(&mut self, _stack: NodeId, _layer: u64, _backward: bool, _enter: bool) -> Result<()> {
        Ok(())
    }
    /// Whether a layer's weights leave the pass after its forward, to be
    /// gathered again for its backward (FSDP's reshard after forward).
    fn reshards(&self) -> bool {
        false
    }
    /// The tensor-parallel group's side of an op over a split vocabulary,
    /// which the fused compute runs on the device between these exchanges.
    fn vocab(&mut self) -> &mut dyn VocabGroup;
    /// A layout change on the device: `v`, held in layout `from`, as this
    /// rank holds it in layout `to`, over the rank's mesh groups
    /// (`crate::shard::convert`'s rules, on `be`'s buffers).
    fn relayout(
        &mut self,
        be: &mut B,
        v: Shaped<B>,
        from: TensorLayout,
        to: TensorLayout,
    ) -> Result<Shaped<B>>;
}

/// The tensor-parallel group's exchanges of the ops over a split vocabulary
/// (`dplc_ir::VocabOp`): a few bytes a row through the host.
pub trait VocabGroup {
    /// This rank's slice of an axis of `n` local entries: its first index
    /// and the whole axis's length.
    fn slice(&self, n: usize) -> (usize, usize);
    /// The whole axis's row statistics from this rank's slice's (per row
    /// maximum and sum of exponentials relative to it, interleaved),
    /// combined in group order: the same bits on every rank.
    fn row_stats(&mut self, mine: &[f32]) -> Result<Vec<f32>>;
    /// The group's sum of each row's parts.
    fn row_sums(&mut self, sums: &mut [f32]) -> Result<()>;
}

/// A value on the device with its shape (a layout change cuts and joins
/// along its axes).
pub struct Shaped<B: Backend> {
    pub val: Val<B>,
    pub dims: Vec<usize>,
}

impl<B: Backend> Clone for Shaped<B> {
    fn clone(&self) -> Self {
        Shaped {
            val: self.val.clone(),
            dims: self.dims.clone(),
        }
    }
}

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

/// What one run of a region keeps for its backward.
pub struct RegionRun<B: Backend> {
    values: HashMap<TensorId, Val<B>>,
    /// Values of a step that the graph does not have, kept for its
    /// backward, by the step's (first) output: a fused attention's
    /// log-sum-exp (`f32` per score row), a row kernel's statistics
    /// ([`FusedKernel::keeps_row_stats`]).
    side: HashMap<TensorId, Val<B>>,
    /// MoE routing tables by the choices they were made from: made once a
    /// layer (dispatch, then combine and both backwards read them), so the
    /// choices cross to the host once.
    routes: HashMap<TensorId, moe::Routing<B>>,
    /// Per repeat node, the runs of its body, first layer first.
    repeats: HashMap<NodeId, Vec<LayerRun<B>>>,
    /// Selective recomputation dropped the core-attention values: their
    /// steps run again before the backward.
    dropped: bool,
}

impl<B: Backend> RegionRun<B> {
    fn new() -> Self {
        RegionRun {
            values: HashMap::new(),
            side: HashMap::new(),
            routes: HashMap::new(),
            repeats: HashMap::new(),
            dropped: false,
        }
    }

    /// Bytes of the activations held (parameters and inputs not counted;
    /// a buffer bound to several tensors counted once, by `seen`).
    pub fn activation_bytes(
        &self,
        graph: &Graph,
        float_bytes: usize,
        seen: &mut HashSet<TensorId>,
    ) -> usize {
        let size = |v: &Val<B>| {
            v.len
                * match v.elem {
                    Elem::Float => float_bytes,
                    Elem::F32 | Elem::I32 => 4,
                }
        };
        let mut bytes = 0;
        for (&t, v) in &self.values {
            let leaf = graph
                .producer(t)
                .is_some_and(|n| matches!(n.op, Op::Param(_) | Op::Input(_)));
            if !leaf && seen.insert(t) {
                bytes += size(v);
            }
        }
        bytes += self.side.values().map(size).sum::<usize>();
        for layer in self.repeats.values().flatten() {
            bytes += match layer {
                LayerRun::Kept(r) => r.activation_bytes(graph, float_bytes, &mut HashSet::new()),
                LayerRun::Checkpoint(args) => args.iter().map(size).sum(),
            };
        }
        bytes
    }
}

/// The tensor a fused kernel's own values are kept by: its first output.
pub(super) fn side_key(k: &FusedKernel) -> Result<TensorId> {
    k.buffers
        .iter()
        .zip(&k.kernel.buffers)
        .find(|(_, b)| b.output)
        .map(|(&t, _)| t)
        .ok_or_else(|| kernel_err("fused", format!("kernel {} writes nothing", k.kernel.op)))
}

/// One layer of a `repeat`: its activations, or under full recomputation only
/// its arguments, from which backward runs the layer's forward again.
enum LayerRun<B: Backend> {
    Kept(RegionRun<B>),
    Checkpoint(Vec<Val<B>>),
}

/// A chunk's forward: its run, kept for the backward, and what it sends on
/// (nothing from the last chunk; an extra not made yet is `None`).
pub type ChunkForward<B> = (RegionRun<B>, Option<Vec<Option<Val<B>>>>);

/// The part of the root region one pipeline chunk runs: its root nodes, the
/// iterations of each layer stack it runs, and what crosses the cuts on its
/// sides. A run without pipeline stages is one span of the whole root.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ChunkSpan {
    /// The root nodes it runs (`None`: every one).
    pub nodes: Option<HashSet<NodeId>>,
    /// The model's inputs those nodes read (`None`: every one): only these
    /// are fed to the chunk, so a stage's chunks upload a micro-batch's
    /// tokens and targets once between them, where the chunks read them.
    pub inputs: Option<HashSet<TensorId>>,
    /// The iterations it runs of each layer stack (repeat node) it runs.
    pub stacks: BTreeMap<NodeId, std::ops::Range<u64>>,
    /// The model's layers it runs, numbered across the stacks.
    pub layers: std::ops::Range<u64>,
    /// The stack whose carried values arrive from the previous chunk, and
    /// whether this chunk continues it (else they are its outputs).
    pub receives: Option<(NodeId, bool)>,
    /// The stack whose outputs, as this chunk leaves them, go to the next.
    pub sends: Option<NodeId>,
}
/// Runs one micro-batch forward and backward on a backend.
pub struct Executor<'a, B: Backend> {
    pub graph: &'a Graph,
    pub fused: &'a FusedGraph,
    /// Values of the symbolic dims, by `SymId`.
    pub syms: Vec<i64>,
    /// The dropout key's state after the run's seed and the step: every
    /// kernel's `seed` argument (see `dplc_codegen::DrawKey`).
    pub seed: u64,
    /// The rest of the key, with which the kernels draw the CPU reference's
    /// masks: the micro-batch's first sample and its samples, the rank's
    /// places in its context- and tensor-parallel groups (the positions a
    /// dropout of the rank's chunk or part of a split value draws at). Each
    /// launch sets its own layer.
    pub place: KeyPlace,
    /// Who runs the host steps; `None` where the graph has none.
    pub host: Option<RefCell<&'a mut dyn HostSteps<B>>>,
}

/// Parameters the forward reads and where the backward leaves their
/// gradients. Shared with the host steps' [`HostSteps::layer`] hook, which
/// fills a layer's entries when the pass reaches it where they are sharded.
pub struct ParamBufs<B: Backend> {
    pub values: RefCell<BTreeMap<ParamKey, Val<B>>>,
    /// `f32` gradients, accumulated over micro-batches.
    pub grads: RefCell<BTreeMap<ParamKey, Val<B>>>,
}

impl<B: Backend> ParamBufs<B> {
    pub fn new(values: BTreeMap<ParamKey, Val<B>>) -> Self {
        ParamBufs {
            values: RefCell::new(values),
            grads: RefCell::new(BTreeMap::new()),
        }
    }
}

/// A backend value of tensor `t` of `graph` as a host tensor of its shape
/// (`syms` binds the symbolic dims).
pub(crate) fn to_host<B: Backend>(
    be: &mut B,
    graph: &Graph,
    syms: &[i64],
    t: TensorId,
    v: &Val<B>,
) -> Result<Tensor> {
    let dims = tensor_dims(graph, syms, t);
    if dims.iter().product::<usize>() != v.len {
        return Err(kernel_err(
            "fused",
            format!("{t} holds {} values for shape {dims:?}", v.len),
        ));
    }
    Ok(match v.elem {
        Elem::I32 => Tensor::i32(dims, be.download_i32(&v.buf, v.len)?),
        Elem::Float | Elem::F32 => Tensor::f32(dims, be.download(&v.buf, v.elem, v.len)?),
    })
}

/// A host tensor on the backend: floats in its storage type, indices as i32.
pub(crate) fn to_backend<B: Backend>(be: &mut B, t: &Tensor) -> Result<Val<B>> {
    Ok(match &t.data {
        Data::F32(v) => Val {
            buf: be.upload(Elem::Float, v)?,
            elem: Elem::Float,
            len: v.len(),
        },
        Data::I32(v) => Val {
            buf: be.upload_i32(v)?,
            elem: Elem::I32,
            len: v.len(),
        },
    })
}

/// `v` as a buffer of `elem`: itself where the types store alike, else
/// converted by a kernel.
pub(crate) fn as_elem<B: Backend>(be: &mut B, v: &Val<B>, elem: Elem) -> Result<Val<B>> {
    let same =
        v.elem == elem || (be.dtype() == DType::F32 && v.elem != Elem::I32 && elem != Elem::I32);
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

/// The dimensions of tensor `t` with the symbolic dims bound to `syms` (by `SymId`).
pub(crate) fn tensor_dims(graph: &Graph, syms: &[i64], t: TensorId) -> Vec<usize> {
    graph
        .tensor(t)
        .shape
        .dims()
        .iter()
        .map(|d| d.eval(&|s| syms[s.index()]).max(0) as usize)
        .collect()
}

impl<'a, B: Backend> Executor<'a, B> {
    fn dims(&self, t: TensorId) -> Vec<usize> {
        tensor_dims(self.graph, &self.syms, t)
    }

    fn numel(&self, t: TensorId) -> usize {
        self.dims(t).iter().product()
    }

    fn base(&self, t: TensorId) -> TensorId {
        base_of(self.graph, t)
    }

    fn get(&self, run: &RegionRun<B>, t: TensorId) -> Result<Val<B>> {
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
        self.sized_args(&k.sizes, &k.key_sizes, layer)
    }

    /// Launch arguments of size arguments `sizes`, those of `key_sizes`
    /// the dropout key's words at `layer`.
    fn sized_args(
        &self,
        sizes: &[dplc_ir::Dim],
        key_sizes: &[(usize, KeySize)],
        layer: u64,
    ) -> Args {
        let mut sizes: Vec<i64> = sizes
            .iter()
            .map(|d| d.eval(&|s| self.syms[s.index()]))
            .collect();
        let at = KeyPlace {
            layer,
            ..self.place
        };
        at.bind_keys(&mut sizes, key_sizes, |t| self.numel(t));
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
    pub fn forward(
        &self,
        be: &mut B,
        r: RegionId,
        args: Vec<Val<B>>,
        inputs: &HashMap<TensorId, Val<B>>,
        layer: u64,
        params: &ParamBufs<B>,
    ) -> Result<RegionRun<B>> {
        let (plan, _) = self.plan(r)?;
        let mut run = self.bind(r, args, (inputs, None), layer, params)?;
        let free_after = self.free_after(r)?;
        for (step, dead) in plan.steps.iter().zip(free_after) {
            match step {
                Step::Extern { node, .. }
                    if matches!(self.graph.node(*node).op, Op::Repeat { .. }) =>
                {
                    let (count, _, _) = self.repeat_parts(*node)?;
                    self.forward_repeat(be, &mut run, *node, 0..count, None, params)?;
                }
                _ => self.run_step(be, &mut run, step, layer)?,
            }
            for t in dead {
                run.values.remove(t);
            }
        }
        Ok(run)
    }

    /// Whether chunk `span` runs root step `step`: a layer stack's when it
    /// runs some of its layers, another step when its nodes are the chunk's.
    /// A kernel whose nodes two chunks own cannot be cut.
    fn runs_step(&self, span: &ChunkSpan, step: &Step) -> Result<bool> {
        let Some(own) = &span.nodes else {
            return Ok(true);
        };
        let nodes: Vec<NodeId> = match step {
            Step::Extern { node, .. } if matches!(self.graph.node(*node).op, Op::Repeat { .. }) => {
                return Ok(span.stacks.contains_key(node));
            }
            Step::Kernel(k) => k.nodes.to_vec(),
            Step::Attention(at) => at.nodes.to_vec(),
            Step::MatMul { node, .. } | Step::Extern { node, .. } => vec![*node],
        };
        // Leaves (parameters, constants, positions) are computed wherever
        // they are read, so a step of leaves alone runs on every chunk.
        let placed: Vec<bool> = nodes
            .iter()
            .filter(|&&n| {
                !matches!(
                    self.graph.node(n).op,
                    Op::Param(_) | Op::Constant(_) | Op::Iota { .. } | Op::Input(_)
                )
            })
            .map(|n| own.contains(n))
            .collect();
        let mine = placed.iter().filter(|&&x| x).count();
        if mine > 0 && mine < placed.len() {
            return Err(RuntimeError::Unsupported(
                "a fused kernel of this model's root spans two pipeline chunks, so the fused \
                 executor cannot cut it there"
                    .into(),
            ));
        }
        Ok(placed.is_empty() || mine > 0)
    }

    /// One pipeline chunk of the root forward. `received` are the values the
    /// previous chunk sent: its stack's carried values, then `extras` (root
    /// values a later chunk reads; `None` where not made yet). Returns the
    /// run and, for a chunk before the last, what it sends on in the same
    /// order.
    #[allow(clippy::too_many_arguments)]
    pub fn forward_chunk(
        &self,
        be: &mut B,
        span: &ChunkSpan,
        received: Vec<Option<Val<B>>>,
        extras: &[TensorId],
        inputs: &HashMap<TensorId, Val<B>>,
        params: &ParamBufs<B>,
    ) -> Result<ChunkForward<B>> {
        let r = self.graph.root();
        let (plan, _) = self.plan(r)?;
        let mut run = self.bind(r, Vec::new(), (inputs, span.inputs.as_ref()), 0, params)?;
        let mut state: Option<(NodeId, Vec<Val<B>>)> = None;
        if let Some((rep, continues)) = span.receives {
            let outs = &self.graph.node(rep).outputs;
            if received.len() != outs.len() + extras.len() {
                return Err(kernel_err(
                    "recv",
                    format!(
                        "{} activations arrived, the chunk takes {}",
                        received.len(),
                        outs.len() + extras.len()
                    ),
                ));
            }
            let mut it = received.into_iter();
            let carried = it
                .by_ref()
                .take(outs.len())
                .map(|v| v.ok_or_else(|| kernel_err("recv", "an empty activation")))
                .collect::<Result<Vec<_>>>()?;
            for (&t, v) in extras.iter().zip(it) {
                if let Some(v) = v {
                    run.values.insert(self.base(t), v);
                }
            }
            if continues {
                state = Some((rep, carried));
            } else {
                for (&t, v) in outs.iter().zip(carried) {
                    run.values.insert(self.base(t), v);
                }
            }
        }
        let free_after = self.free_after(r)?;
        for (step, dead) in plan.steps.iter().zip(free_after) {
            if !self.runs_step(span, step)? {
                continue;
            }
            match step {
                Step::Extern { node, .. }
                    if matches!(self.graph.node(*node).op, Op::Repeat { .. }) =>
                {
                    let layers = match &span.nodes {
                        None => 0..self.repeat_parts(*node)?.0,
                        Some(_) => span.stacks[node].clone(),
                    };
                    let init = match state.take() {
                        Some((rep, v)) if rep == *node => Some(v),
                        other => {
                            state = other;
                            None
                        }
                    };
                    self.forward_repeat(be, &mut run, *node, layers, init, params)?;
                }
                _ => self.run_step(be, &mut run, step, 0)?,
            }
            // What later chunks read travels on, whoever reads it last here.
            for t in dead.iter().filter(|t| !extras.contains(t)) {
                run.values.remove(t);
            }
        }
        let Some(rep) = span.sends else {
            return Ok((run, None));
        };
        let outs = &self.graph.node(rep).outputs;
        let mut sent: Vec<Option<Val<B>>> = Vec::with_capacity(outs.len() + extras.len());
        for &t in outs {
            sent.push(Some(self.get(&run, t)?));
        }
        for t in extras {
            sent.push(if outs.contains(t) {
                None
            } else {
                run.values.get(&self.base(*t)).cloned()
            });
        }
        Ok((run, Some(sent)))
    }

    fn free_after(&self, r: RegionId) -> Result<&'a [Vec<TensorId>]> {
        Ok(&self
            .fused
            .lifetimes
            .get(&r)
            .ok_or_else(|| kernel_err("fused", format!("region {r} has no plan")))?
            .free_after)
    }

    /// A run of region `r` with its arguments, parameters (those held) and
    /// inputs bound: every input must be fed, or those `read` names where given.
    fn bind(
        &self,
        r: RegionId,
        args: Vec<Val<B>>,
        (inputs, read): (&HashMap<TensorId, Val<B>>, Option<&HashSet<TensorId>>),
        layer: u64,
        params: &ParamBufs<B>,
    ) -> Result<RegionRun<B>> {
        let region = self.graph.region(r);
        let mut run = RegionRun::new();
        for (&a, v) in region.args.iter().zip(args) {
            run.values.insert(a, v);
        }
        self.bind_params(r, &mut run, layer, params);
        for &n in &region.nodes {
            let node = self.graph.node(n);
            if let Op::Input(_) = node.op {
                let t = node.outputs[0];
                match inputs.get(&t) {
                    Some(v) => {
                        run.values.insert(t, v.clone());
                    }
                    None if read.is_none_or(|read| read.contains(&t)) => {
                        return Err(kernel_err("fused", format!("input {t} is not fed")));
                    }
                    None => {}
                }
            }
        }
        Ok(run)
    }

    /// One kernel or matmul step of a forward.
    fn run_step(&self, be: &mut B, run: &mut RegionRun<B>, step: &Step, layer: u64) -> Result<()> {
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
                        bufs.push(self.get(run, t)?.buf);
                    }
                }
                let stats = if k.keeps_row_stats {
                    let i = k.buffers.len();
                    let len = args.buffer_len(&k.kernel, i);
                    let v: Val<B> = Val {
                        buf: be.alloc(Elem::F32, len)?,
                        elem: Elem::F32,
                        len,
                    };
                    bufs.push(v.buf.clone());
                    Some(v)
                } else {
                    None
                };
                be.launch(&k.kernel, &args, &bufs)?;
                if let Some(v) = stats {
                    run.side.insert(side_key(k)?, v);
                }
                run.values.extend(outs);
            }
            Step::MatMul { node, a, b } => {
                let mm = self.matmul_of(*node, a, b, be.dtype())?;
                let (x, y) = (self.get(run, a.tensor)?, self.get(run, b.tensor)?);
                let len = mm.batch * mm.m * mm.n;
                let c = Val {
                    buf: be.alloc(Elem::Float, len)?,
                    elem: Elem::Float,
                    len,
                };
                be.matmul(&mm, &x.buf, &y.buf, &c.buf)?;
                run.values.insert(self.graph.node(*node).outputs[0], c);
            }
            Step::Attention(at) => self.attention_forward(be, run, at, layer)?,
            Step::Extern { node, .. } => {
                if !is_host_step(&self.graph.node(*node).op) {
                    return Err(kernel_err(
                        "fused",
                        format!(
                            "{} runs nested in a layer",
                            self.graph.node(*node).op.name()
                        ),
                    ));
                }
                match self.vocab_on_device(*node) {
                    Some(v) => self.vocab_forward(be, run, *node, v)?,
                    None if self.moe_on_device(*node) => self.moe_forward(be, run, *node)?,
                    None => self.host_forward(be, run, *node)?,
                }
            }
        }
        Ok(())
    }

    /// A fused attention forward: its output (the graph's tensor) and its
    /// log-sum-exp, kept where a backward will read it.
    fn attention_forward(
        &self,
        be: &mut B,
        run: &mut RegionRun<B>,
        at: &FusedAttention,
        layer: u64,
    ) -> Result<()> {
        let k = &at.kernel;
        let args = self.sized_args(&at.sizes, &at.key_sizes, layer);
        let pass = AttentionPass::Forward;
        let mut bufs = Vec::new();
        let (mut out, mut lse) = (None, None);
        for (role, spec) in k.roles(pass).into_iter().zip(k.buffers(pass)) {
            let len = args.len_of(&spec);
            let v = match role {
                AttentionBuffer::Out | AttentionBuffer::LogSumExp => {
                    let v: Val<B> = Val {
                        buf: be.alloc(spec.elem, len)?,
                        elem: spec.elem,
                        len,
                    };
                    if role == AttentionBuffer::Out {
                        out = Some(v.clone());
                    } else {
                        lse = Some(v.clone());
                    }
                    v
                }
                _ => {
                    let t = at.tensor(role).expect("an operand's role");
                    self.as_elem(be, &self.get(run, t)?, Elem::Float)?
                }
            };
            bufs.push(v.buf);
        }
        be.attention(k, pass, &args, &bufs)?;
        run.values
            .insert(at.out, out.expect("the forward writes the output"));
        if at
            .inputs()
            .into_iter()
            .any(|t| self.fused.grad.needs_grad(t))
        {
            run.side
                .insert(at.out, lse.expect("the forward writes the log-sum-exp"));
        }
        Ok(())
    }

    /// Tell the host steps' owner that layer `layer` of repeat node
    /// `stack` needs its parameters or is done with them
    /// ([`HostSteps::layer`]).
    fn layer_hook(&self, stack: NodeId, layer: u64, backward: bool, enter: bool) -> Result<()> {
        match &self.host {
            Some(h) => h.borrow_mut().layer(stack, layer, backward, enter),
            None => Ok(()),
        }
    }

    /// Whether a layer's weights leave the pass after its forward.
    fn reshards(&self) -> bool {
        self.host.as_ref().is_some_and(|h| h.borrow().reshards())
    }

    /// Region `r`'s parameter nodes: each parameter and the tensor it is.
    fn param_nodes(&self, r: RegionId) -> impl Iterator<Item = (ParamId, TensorId)> + '_ {
        self.graph.region(r).nodes.iter().filter_map(|&n| {
            let node = self.graph.node(n);
            match node.op {
                Op::Param(p) => Some((p, node.outputs[0])),
                _ => None,
            }
        })
    }

    /// Bind `layer`'s parameters in `run` where not bound yet: at the run's
    /// start, and again before its backward where its forward dropped them
    /// (see [`HostSteps::reshards`]). A pipeline stage holds the parameters
    /// of its own chunks: one it does not hold is an error where it is read.
    fn bind_params(&self, r: RegionId, run: &mut RegionRun<B>, layer: u64, params: &ParamBufs<B>) {
        let values = params.values.borrow();
        for (p, t) in self.param_nodes(r) {
            if let Some(v) = values.get(&ParamKey { param: p, layer }) {
                run.values.entry(t).or_insert_with(|| v.clone());
            }
        }
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

    /// Layers `layers` of repeat `n`, from `init` (else the node's carried
    /// inputs in `run`); the repeat's outputs are left in `run`.
    fn forward_repeat(
        &self,
        be: &mut B,
        run: &mut RegionRun<B>,
        n: NodeId,
        layers: std::ops::Range<u64>,
        init: Option<Vec<Val<B>>>,
        params: &ParamBufs<B>,
    ) -> Result<()> {
        let (_, body, n_carried) = self.repeat_parts(n)?;
        let node = self.graph.node(n);
        let captured: Vec<Val<B>> = node.inputs[n_carried..]
            .iter()
            .map(|&t| self.get(run, t))
            .collect::<Result<_>>()?;
        let mut carried = match init {
            Some(v) => v,
            None => node.inputs[..n_carried]
                .iter()
                .map(|&t| self.get(run, t))
                .collect::<Result<_>>()?,
        };
        let results = self.graph.region(body).results.clone();
        let core = &self.fused.core_steps[&body];
        let mut runs = Vec::with_capacity((layers.end - layers.start) as usize);
        let reshards = self.reshards();
        let first = layers.start;
        for layer in layers {
            let args: Vec<Val<B>> = carried.iter().chain(&captured).cloned().collect();
            self.layer_hook(n, layer, false, true)?;
            let mut body_run =
                self.forward(be, body, args.clone(), &HashMap::new(), layer, params)?;
            if reshards {
                // Its weights are gathered again for its backward.
                for (_, t) in self.param_nodes(body) {
                    body_run.values.remove(&t);
                }
            }
            self.layer_hook(n, layer, false, false)?;
            carried = results
                .iter()
                .map(|&t| self.get(&body_run, t))
                .collect::<Result<_>>()?;
            // The next layer holds what it reads; this one keeps only what
            // its own backward reads.
            if let Some(l) = self.fused.lifetimes.get(&body) {
                for t in &l.handed_on {
                    body_run.values.remove(t);
                }
            }
            runs.push(match self.fused.recompute.at(layer - first) {
                // `dplc run` and `build` refuse op-level checkpointing (an
                // engine's policy dplc prices, not runs); a layer checkpoint
                // computes the same values.
                Recompute::Full | Recompute::Op => LayerRun::Checkpoint(args),
                Recompute::Selective => {
                    let (plan, _) = self.plan(body)?;
                    for &i in core {
                        for t in step_outputs(self.graph, &plan.steps[i]) {
                            body_run.values.remove(&t);
                        }
                    }
                    body_run.dropped = !core.is_empty();
                    LayerRun::Kept(body_run)
                }
                Recompute::None => LayerRun::Kept(body_run),
            });
        }
        for (&t, v) in node.outputs.iter().zip(carried) {
            run.values.insert(t, v);
        }
        run.repeats.insert(n, runs);
        Ok(())
    }

    /// Selective recomputation: run again, in order, the steps whose values
    /// the layer's forward dropped.
    fn recompute_dropped(
        &self,
        be: &mut B,
        body: RegionId,
        run: &mut RegionRun<B>,
        layer: u64,
    ) -> Result<()> {
        if !run.dropped {
            return Ok(());
        }
        let (plan, _) = self.plan(body)?;
        for &i in &self.fused.core_steps[&body] {
            self.run_step(be, run, &plan.steps[i], layer)?;
        }
        run.dropped = false;
        Ok(())
    }

    /// `v` as a buffer of `elem` ([`as_elem`]).
    fn as_elem(&self, be: &mut B, v: &Val<B>, elem: Elem) -> Result<Val<B>> {
        as_elem(be, v, elem)
    }

    /// The `f32` value of a float tensor of a run (the loss, for a report).
    pub fn read(&self, be: &mut B, run: &RegionRun<B>, t: TensorId) -> Result<Vec<f32>> {
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

#[cfg(test)]
mod tests {
    use crate::kernels::DropoutKey;
    use dplc_codegen::{draw_seed, draw_state, drop_threshold, dropout_draw};

    /// The fused kernels' draws, from the kernel `seed` and size arguments
    /// the executor passes, drop exactly the CPU reference's elements:
    /// several samples, one sample, and a tensor not split by sample.
    #[test]
    fn kernel_draws_are_the_reference_masks() {
        let (seed, step, node, layer, first) = (11u64, 3u64, 41u64, 2u64, 6u64);
        for (numel, batch) in [(24usize, 4usize), (10, 1), (10, 4), (7, 3)] {
            for p in [0.1, 0.5, 0.3333] {
                let key = DropoutKey {
                    seed,
                    step,
                    node,
                    layer,
                    first_sample: first,
                    batch,
                    cp_rank: 0,
                    cp: 1,
                    tp_rank: 0,
                    tp: 1,
                };
                let keep = key.mask(p, &[numel], None, None);
                let state = draw_state(draw_seed(seed, step), node, layer as i64);
                let per = dplc_codegen::elements_per_sample(numel, batch) as i64;
                let threshold = drop_threshold(p) as f32;
                let fused: Vec<bool> = (0..numel as i64)
                    .map(|i| dropout_draw(state, first as i64, per, i) >= threshold)
                    .collect();
                assert_eq!(fused, keep, "{numel} elements, {batch} samples, p {p}");
            }
        }
    }
}
