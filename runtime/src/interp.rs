//! The interpreter: runs the nodes of a region forward, keeping per-iteration
//! tapes of `repeat` bodies, and walks them back through the VJPs in the order
//! `dplc_ir::GradPlan` gives. Parameters come from, and gradients go to, a
//! [`ParamAccess`], whose layer hooks are where ZeRO-3 gathers and scatters.

use crate::error::{kernel_err, Result, RuntimeError};
use crate::kernels::{self, DropoutKey, OpCtx};
use crate::shard::Layouts;
use crate::tensor::Tensor;
use crate::vjp;
use dplc_ir::{
    GradPlan, Graph, LayerRecompute, NodeId, Op, ParamId, Recompute, RegionId, Shape, TensorId,
    TensorLayout, VocabOp,
};
use std::collections::{HashMap, HashSet};
use std::ops::Range;
use std::sync::Arc;

pub(crate) type Value = Arc<Tensor>;

/// One parameter tensor: a parameter of the graph at one flat `repeat`
/// iteration (0 outside any repeat; `outer·count + inner` when nested).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct ParamKey {
    pub param: ParamId,
    pub layer: u64,
}

/// Where the interpreter reads parameters and leaves their gradients.
pub(crate) trait ParamAccess {
    fn param(&mut self, key: ParamKey) -> Result<Value>;
    fn add_grad(&mut self, key: ParamKey, grad: Tensor) -> Result<()>;
    /// Called around the forward (`backward == false`) or backward of one
    /// iteration of the top-level repeat: before it with `enter`, after without.
    fn layer_hook(&mut self, layer: u64, backward: bool, enter: bool) -> Result<()>;
    /// `v`, held in layout `from`, in layout `to` (a collective over the
    /// tensor- or expert-parallel group).
    fn convert(&mut self, v: &Tensor, from: TensorLayout, to: TensorLayout) -> Result<Tensor>;
    /// `op` over a vocabulary split over the tensor-parallel group
    /// ([`crate::vocab::forward`]).
    fn vocab_forward(&mut self, op: VocabOp, ins: &[&Tensor]) -> Result<Vec<Tensor>>;
    /// Its input gradients ([`crate::vocab::backward`]).
    fn vocab_backward(
        &mut self,
        op: VocabOp,
        saved: (&[&Tensor], &[&Tensor]),
        gout: &Tensor,
        need: &[bool],
    ) -> Result<Vec<Option<Tensor>>>;
}

/// The values of one run of a region, and the tapes of its repeats.
#[derive(Default)]
pub(crate) struct Frame {
    pub values: HashMap<TensorId, Value>,
    pub tapes: HashMap<NodeId, Vec<Tape>>,
    /// Values read in a layout other than their own, converted once.
    pub converted: HashMap<(TensorId, TensorLayout), Value>,
    /// Gradient contributions not yet in their tensor's gradient layout, summed
    /// per layout (in arrival order, the same on every rank) and converted
    /// once when the tensor's producer needs the gradient.
    pub pending: HashMap<TensorId, Vec<(TensorLayout, Tensor)>>,
}

impl Frame {
    /// Bytes of the activations this frame and its tapes hold: every value
    /// but the parameters', a tensor shared by several frames counted once
    /// (`seen`). What the activation memory of a rank is made of.
    pub fn activation_bytes(&self, graph: &Graph, seen: &mut HashSet<*const Tensor>) -> usize {
        let is_param = |t: TensorId| match graph.tensor(t).def {
            dplc_ir::TensorDef::Node { node, .. } => matches!(graph.node(node).op, Op::Param(_)),
            dplc_ir::TensorDef::Arg { .. } => false,
        };
        // Every element is 4 bytes (f32 values, i32 token ids).
        let count = |v: &Value, seen: &mut HashSet<*const Tensor>| {
            if seen.insert(Arc::as_ptr(v)) {
                v.numel() * 4
            } else {
                0
            }
        };
        let mut bytes = 0;
        for (&t, v) in &self.values {
            if !is_param(t) {
                bytes += count(v, seen);
            }
        }
        for ((t, _), v) in &self.converted {
            if !is_param(*t) {
                bytes += count(v, seen);
            }
        }
        for tape in self.tapes.values().flatten() {
            bytes += match tape {
                Tape::Kept(f) => f.activation_bytes(graph, seen),
                Tape::Recompute(args) => args.iter().map(|a| count(a, seen)).sum(),
            };
        }
        bytes
    }
}

/// What one iteration of a repeat keeps for its backward.
pub(crate) enum Tape {
    Kept(Frame),
    /// Activation recompute: only the body's arguments; the backward runs the
    /// forward of the iteration again (dropout masks are keyed, so identical).
    Recompute(Vec<Value>),
}

pub(crate) type Grads = HashMap<TensorId, Tensor>;

pub(crate) fn add_grad(grads: &mut Grads, t: TensorId, g: Tensor) -> Result<()> {
    match grads.get_mut(&t) {
        None => {
            grads.insert(t, g);
        }
        Some(acc) => {
            let (a, b) = match (&mut acc.data, &g.data) {
                (crate::Data::F32(a), crate::Data::F32(b)) if a.len() == b.len() => (a, b),
                _ => return Err(kernel_err("backward", "gradients of different shapes meet")),
            };
            a.iter_mut().zip(b).for_each(|(x, y)| *x += y);
        }
    }
    Ok(())
}

pub(crate) struct Interp<'g> {
    pub graph: &'g Graph,
    pub plan: &'g GradPlan,
    /// Values of the symbolic dims, by `SymId`.
    pub syms: Vec<i64>,
    /// Seed, step and samples of this micro-batch; node and layer are set per op.
    pub key: DropoutKey,
    /// What a layer keeps for its backward: everything, everything but the
    /// core-attention tensors (`dplc_ir::attention_core`), or its arguments
    /// — by its place in the chunk under partial recomputation.
    pub recompute: LayerRecompute,
    /// Tensor- and expert-parallel layouts; `None` runs everything whole.
    pub layouts: Option<&'g Layouts>,
}

impl<'g> Interp<'g> {
    pub fn dims(&self, shape: &Shape) -> Vec<usize> {
        shape
            .dims()
            .iter()
            .map(|d| d.eval(&|s| self.syms[s.index()]).max(0) as usize)
            .collect()
    }

    fn ctx_for<'a>(&self, node: NodeId, layer: u64, shapes: &'a [Vec<usize>]) -> OpCtx<'a> {
        OpCtx {
            out_shapes: shapes,
            dropout: DropoutKey {
                node: node.index() as u64,
                layer,
                ..self.key
            },
            split: self
                .layouts
                .and_then(|l| l.produced(self.graph.node(node).outputs[0]).split_axis()),
        }
    }

    fn value(frame: &Frame, t: TensorId) -> Result<&Value> {
        frame
            .values
            .get(&t)
            .ok_or_else(|| kernel_err("interpreter", format!("{t} is used before it is computed")))
    }

    /// The vocabulary-parallel op node `n` runs as, if its layout splits
    /// the axis it indexes or normalises.
    fn vocab_op(&self, n: NodeId) -> Option<VocabOp> {
        self.layouts?.vocab_op(self.graph, n)
    }

    fn produced(&self, t: TensorId) -> TensorLayout {
        self.layouts
            .map_or(TensorLayout::Replicated, |l| l.produced(t))
    }

    /// `t` as this rank holds it in layout `want`.
    pub fn read_as(
        &self,
        frame: &mut Frame,
        t: TensorId,
        want: TensorLayout,
        access: &mut dyn ParamAccess,
    ) -> Result<Value> {
        let have = self.produced(t);
        let v = Self::value(frame, t)?.clone();
        if have == want {
            return Ok(v);
        }
        if let Some(c) = frame.converted.get(&(t, want)) {
            return Ok(c.clone());
        }
        let c = Arc::new(access.convert(&v, have, want)?);
        frame.converted.insert((t, want), c.clone());
        Ok(c)
    }

    /// The local shapes of node `n`'s outputs.
    fn out_shapes(&self, n: NodeId) -> Result<Vec<Vec<usize>>> {
        let node = self.graph.node(n);
        node.outputs
            .iter()
            .enumerate()
            .map(|(i, &t)| {
                let dims = self.dims(&self.graph.tensor(t).shape);
                match self.layouts {
                    Some(l) => l.local_dims(dims, l.output(n, i)),
                    None => Ok(dims),
                }
            })
            .collect()
    }

    /// Add gradient `g`, in layout `layout`, to the gradient of `t`.
    pub fn contribute(
        &self,
        frame: &mut Frame,
        grads: &mut Grads,
        t: TensorId,
        layout: TensorLayout,
        g: Tensor,
    ) -> Result<()> {
        if layout == self.produced(t).grad() {
            return add_grad(grads, t, g);
        }
        let list = frame.pending.entry(t).or_default();
        match list.iter_mut().find(|(l, _)| *l == layout) {
            Some((_, acc)) => {
                let mut tmp = Grads::new();
                tmp.insert(t, std::mem::replace(acc, Tensor::zeros(&[])));
                add_grad(&mut tmp, t, g)?;
                *acc = tmp.remove(&t).expect("inserted above");
            }
            None => list.push((layout, g)),
        }
        Ok(())
    }

    /// The whole gradient of `t` in its gradient layout, once every consumer
    /// has contributed; `None` when nothing reached it.
    pub fn take_grad(
        &self,
        frame: &mut Frame,
        grads: &mut Grads,
        t: TensorId,
        access: &mut dyn ParamAccess,
    ) -> Result<Option<Tensor>> {
        let target = self.produced(t).grad();
        if let Some(list) = frame.pending.remove(&t) {
            for (layout, g) in list {
                let c = access.convert(&g, layout, target)?;
                add_grad(grads, t, c)?;
            }
        }
        Ok(grads.remove(&t))
    }

    /// Run one node that is not a repeat; its outputs land in `frame`.
    pub fn eval_node(
        &self,
        frame: &mut Frame,
        n: NodeId,
        layer: u64,
        access: &mut dyn ParamAccess,
    ) -> Result<()> {
        let node = self.graph.node(n);
        let outs: Vec<Tensor> = match &node.op {
            Op::Param(p) => {
                let v = access.param(ParamKey { param: *p, layer })?;
                frame.values.insert(node.outputs[0], v);
                return Ok(());
            }
            Op::Input(_) => {
                return Self::value(frame, node.outputs[0]).map(|_| ());
            }
            Op::Repeat { count, .. } => {
                let carried = self.repeat_carried(node)?;
                let ins = node.inputs.clone();
                let init = ins[..carried]
                    .iter()
                    .map(|&t| Self::value(frame, t).cloned())
                    .collect::<Result<_>>()?;
                let out = self.forward_repeat(frame, n, 0..*count, init, layer, None, access)?;
                for (t, v) in node.outputs.iter().zip(out) {
                    frame.values.insert(*t, v);
                }
                return Ok(());
            }
            op => {
                let ins = self.inputs_as_read(frame, n, access)?;
                let ins: Vec<&Tensor> = ins.iter().map(|v| &**v).collect();
                // A layout change in a rank's program (context parallelism
                // rewrites the graph itself): a collective over its group.
                if let Op::Relayout { from, to, .. } = *op {
                    let x = ins
                        .first()
                        .ok_or_else(|| kernel_err("relayout", "no input"))?;
                    let out = access.convert(x, from, to)?;
                    frame.values.insert(node.outputs[0], Arc::new(out));
                    return Ok(());
                }
                if let Some(v) = self.vocab_op(n) {
                    let outs = access.vocab_forward(v, &ins)?;
                    for (t, v) in node.outputs.iter().zip(outs) {
                        frame.values.insert(*t, Arc::new(v));
                    }
                    return Ok(());
                }
                let shapes = self.out_shapes(n)?;
                kernels::forward(op, &ins, &self.ctx_for(n, layer, &shapes)).map_err(
                    |e| match e {
                        RuntimeError::Kernel { op, detail } => RuntimeError::Kernel {
                            op,
                            detail: format!(
                                "{detail} (at {n}, inputs {:?})",
                                ins.iter().map(|t| &t.shape).collect::<Vec<_>>()
                            ),
                        },
                        e => e,
                    },
                )?
            }
        };
        for (t, v) in node.outputs.iter().zip(outs) {
            frame.values.insert(*t, Arc::new(v));
        }
        Ok(())
    }

    /// Node `n`'s inputs in the layouts it reads them in.
    fn inputs_as_read(
        &self,
        frame: &mut Frame,
        n: NodeId,
        access: &mut dyn ParamAccess,
    ) -> Result<Vec<Value>> {
        let node = self.graph.node(n);
        node.inputs
            .iter()
            .enumerate()
            .map(|(i, &t)| match self.layouts {
                Some(l) => self.read_as(frame, t, l.consumed(n, i), access),
                None => Self::value(frame, t).cloned(),
            })
            .collect()
    }

    fn repeat_carried(&self, node: &dplc_ir::Node) -> Result<usize> {
        match node.op {
            Op::Repeat { carried, .. } => Ok(carried),
            _ => Err(kernel_err("interpreter", "not a repeat")),
        }
    }

    /// Run every node of `region` with its arguments bound to `args`.
    pub fn forward_region(
        &self,
        region: RegionId,
        args: Vec<Value>,
        layer: u64,
        access: &mut dyn ParamAccess,
    ) -> Result<Frame> {
        let mut frame = Frame::default();
        for (&a, v) in self.graph.region(region).args.iter().zip(args) {
            frame.values.insert(a, v);
        }
        for &n in &self.graph.region(region).nodes {
            self.eval_node(&mut frame, n, layer, access)?;
        }
        Ok(frame)
    }

    /// Selective recomputation: forget the values of `region`'s nodes that
    /// grow with the square of the sequence (and their converted copies);
    /// [`Interp::recompute_dropped`] computes them again before the backward.
    /// Nested repeats keep theirs: their tapes are already in the frame.
    fn drop_attention_core(&self, region: RegionId, frame: &mut Frame) {
        let g = self.graph;
        let mut dropped = HashSet::new();
        for &n in &g.region(region).nodes {
            let node = g.node(n);
            if matches!(node.op, Op::Repeat { .. }) {
                continue;
            }
            for &t in &node.outputs {
                if dplc_ir::attention_core_tensor(g, t) && frame.values.remove(&t).is_some() {
                    dropped.insert(t);
                }
            }
        }
        frame.converted.retain(|(t, _), _| !dropped.contains(t));
    }

    /// Compute again, in program order, every node of `region` whose value
    /// the forward dropped: the same op on the same inputs under the same
    /// dropout key, so the same values.
    fn recompute_dropped(
        &self,
        region: RegionId,
        frame: &mut Frame,
        layer: u64,
        access: &mut dyn ParamAccess,
    ) -> Result<()> {
        if self.recompute.policy != Recompute::Selective {
            return Ok(());
        }
        for &n in &self.graph.region(region).nodes {
            let node = self.graph.node(n);
            if !matches!(node.op, Op::Repeat { .. })
                && node.outputs.iter().any(|t| !frame.values.contains_key(t))
            {
                self.eval_node(frame, n, layer, access)?;
            }
        }
        Ok(())
    }

    /// Iterations `range` of repeat `n`, whose captured inputs are in `frame`,
    /// starting from carried values `carried`. The tapes are appended to
    /// `frame.tapes[n]`; returns the carried values after the last iteration.
    /// A top-level layer stack (`top`: the model's number of its first
    /// layer) calls the access's layer hooks with each layer's number.
    #[allow(clippy::too_many_arguments)]
    pub fn forward_repeat(
        &self,
        frame: &mut Frame,
        n: NodeId,
        range: Range<u64>,
        mut carried: Vec<Value>,
        outer_layer: u64,
        top: Option<u64>,
        access: &mut dyn ParamAccess,
    ) -> Result<Vec<Value>> {
        let node = self.graph.node(n);
        let (count, body, n_carried) = match node.op {
            Op::Repeat {
                count,
                body,
                carried,
            } => (count, body, carried),
            _ => return Err(kernel_err("interpreter", "not a repeat")),
        };
        let captured = node.inputs[n_carried..]
            .iter()
            .map(|&t| Self::value(frame, t).cloned())
            .collect::<Result<Vec<_>>>()?;
        let results = self.graph.region(body).results.clone();
        let first = range.start;
        for i in range {
            let layer = outer_layer * count + i;
            let args: Vec<Value> = carried.iter().chain(&captured).cloned().collect();
            if let Some(first) = top {
                access.layer_hook(first + i, false, true)?;
            }
            let body_frame = self.forward_region(body, args.clone(), layer, access)?;
            if let Some(first) = top {
                access.layer_hook(first + i, false, false)?;
            }
            let mut body_frame = body_frame;
            carried = results
                .iter()
                .enumerate()
                .map(|(j, &t)| {
                    let want = self
                        .layouts
                        .map_or(TensorLayout::Replicated, |l| l.result(body, j));
                    self.read_as(&mut body_frame, t, want, access)
                })
                .collect::<Result<_>>()?;
            let tape = match self.recompute.at(i - first) {
                // Op-level checkpointing is refused before a run (see
                // `dplc run`); a layer checkpoint computes the same values.
                Recompute::Full | Recompute::Op => Tape::Recompute(args),
                Recompute::Selective => {
                    self.drop_attention_core(body, &mut body_frame);
                    Tape::Kept(body_frame)
                }
                Recompute::None => Tape::Kept(body_frame),
            };
            frame.tapes.entry(n).or_default().push(tape);
        }
        Ok(carried)
    }

    /// Walk `region` back from the gradients in `grads` (seeded at its results);
    /// leaves the gradients of its arguments in `grads`, sends parameter
    /// gradients to `access`.
    pub fn backward_region(
        &self,
        region: RegionId,
        frame: &mut Frame,
        grads: &mut Grads,
        layer: u64,
        access: &mut dyn ParamAccess,
    ) -> Result<()> {
        let order: Vec<NodeId> = self.plan.backward_order(self.graph, region).collect();
        for n in order {
            self.backward_node(frame, n, grads, layer, access)?;
        }
        self.flush_param_grads(region, frame, grads, layer, access)
    }

    /// Send the gradients that reached parameter nodes of `region` to `access`.
    pub fn flush_param_grads(
        &self,
        region: RegionId,
        frame: &mut Frame,
        grads: &mut Grads,
        layer: u64,
        access: &mut dyn ParamAccess,
    ) -> Result<()> {
        for &n in &self.graph.region(region).nodes {
            let node = self.graph.node(n);
            if let Op::Param(p) = node.op {
                if let Some(g) = self.take_grad(frame, grads, node.outputs[0], access)? {
                    access.add_grad(ParamKey { param: p, layer }, g)?;
                }
            }
        }
        Ok(())
    }

    /// The VJP of one node (a repeat runs all its iterations back).
    pub fn backward_node(
        &self,
        frame: &mut Frame,
        n: NodeId,
        grads: &mut Grads,
        layer: u64,
        access: &mut dyn ParamAccess,
    ) -> Result<()> {
        let node = self.graph.node(n);
        let need = self.plan.input_grads(self.graph, n);
        if let Op::Repeat { count, carried, .. } = node.op {
            let mut gout = Vec::new();
            for &t in &node.outputs {
                gout.push(self.take_grad(frame, grads, t, access)?);
            }
            let gin = self.backward_repeat(frame, n, 0..count, gout, grads, layer, None, access)?;
            for (j, g) in gin.into_iter().enumerate().take(carried) {
                if let (Some(g), true) = (g, need[j]) {
                    self.contribute_input(frame, grads, n, j, g)?;
                }
            }
            return Ok(());
        }
        let Some(gout) = self.take_grad(frame, grads, node.outputs[0], access)? else {
            return Ok(());
        };
        let ins = self.inputs_as_read(frame, n, access)?;
        let ins: Vec<&Tensor> = ins.iter().map(|v| &**v).collect();
        let outs = node
            .outputs
            .iter()
            .map(|&t| Self::value(frame, t).cloned())
            .collect::<Result<Vec<_>>>()?;
        let outs: Vec<&Tensor> = outs.iter().map(|v| &**v).collect();
        let shapes: Vec<Vec<usize>> = outs.iter().map(|t| t.shape.clone()).collect();
        let gin = if let Op::Relayout { from, to, grad } = node.op {
            let target = TensorLayout::relayout_grad_target(from, to);
            vec![need
                .first()
                .is_some_and(|&x| x)
                .then(|| access.convert(&gout, grad, target))
                .transpose()?]
        } else if let Some(v) = self.vocab_op(n) {
            access.vocab_backward(v, (&ins, &outs), &gout, &need)?
        } else {
            vjp::backward(
                &node.op,
                &ins,
                &outs,
                &gout,
                &need,
                &self.ctx_for(n, layer, &shapes),
            )?
        };
        for (j, g) in gin.into_iter().enumerate() {
            if let Some(g) = g {
                self.contribute_input(frame, grads, n, j, g)?;
            }
        }
        Ok(())
    }

    /// Add the gradient node `n` gives its input `j`.
    pub fn contribute_input(
        &self,
        frame: &mut Frame,
        grads: &mut Grads,
        n: NodeId,
        j: usize,
        g: Tensor,
    ) -> Result<()> {
        let t = self.graph.node(n).inputs[j];
        let layout = self.layouts.map_or(TensorLayout::Replicated, |l| {
            l.grad_contribution(self.graph, n, j)
        });
        self.contribute(frame, grads, t, layout, g)
    }

    /// Iterations `range` of repeat `n` back, last first, from the gradients of
    /// the carried values after `range.end`. Captured inputs' gradients are
    /// summed into `grads`; returns the carried gradients before `range.start`.
    #[allow(clippy::too_many_arguments)]
    pub fn backward_repeat(
        &self,
        frame: &mut Frame,
        n: NodeId,
        range: Range<u64>,
        mut carried: Vec<Option<Tensor>>,
        grads: &mut Grads,
        outer_layer: u64,
        top: Option<u64>,
        access: &mut dyn ParamAccess,
    ) -> Result<Vec<Option<Tensor>>> {
        let node = self.graph.node(n);
        let (count, body, n_carried) = match node.op {
            Op::Repeat {
                count,
                body,
                carried,
            } => (count, body, carried),
            _ => return Err(kernel_err("interpreter", "not a repeat")),
        };
        let need = self.plan.input_grads(self.graph, n);
        let mut tapes = frame.tapes.remove(&n).unwrap_or_default();
        if tapes.len() as u64 != range.end - range.start {
            return Err(RuntimeError::Kernel {
                op: "repeat",
                detail: format!(
                    "{} tapes for {} iterations",
                    tapes.len(),
                    range.end - range.start
                ),
            });
        }
        let reg = self.graph.region(body);
        for i in range.rev() {
            let layer = outer_layer * count + i;
            if let Some(first) = top {
                access.layer_hook(first + i, true, true)?;
            }
            let tape = tapes.pop().expect("one tape per iteration, counted above");
            let mut body_frame = match tape {
                Tape::Kept(mut f) => {
                    self.recompute_dropped(body, &mut f, layer, access)?;
                    f
                }
                Tape::Recompute(args) => self.forward_region(body, args, layer, access)?,
            };
            let mut body_grads = Grads::new();
            for (j, (&r, g)) in reg.results.iter().zip(carried.drain(..)).enumerate() {
                if let Some(g) = g {
                    let layout = self
                        .layouts
                        .map_or(TensorLayout::Replicated, |l| l.result(body, j).grad());
                    self.contribute(&mut body_frame, &mut body_grads, r, layout, g)?;
                }
            }
            self.backward_region(body, &mut body_frame, &mut body_grads, layer, access)?;
            carried = Vec::with_capacity(n_carried);
            for &a in &reg.args[..n_carried] {
                carried.push(self.take_grad(&mut body_frame, &mut body_grads, a, access)?);
            }
            for (j, &a) in reg.args.iter().enumerate().skip(n_carried) {
                let g = self.take_grad(&mut body_frame, &mut body_grads, a, access)?;
                if let (Some(g), true) = (g, need[j]) {
                    self.contribute_input(frame, grads, n, j, g)?;
                }
            }
            if let Some(first) = top {
                access.layer_hook(first + i, true, false)?;
            }
        }
        Ok(carried)
    }
}
