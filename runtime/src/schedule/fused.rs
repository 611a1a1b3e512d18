//! Codegen's fused kernels as a compute backend: each chunk's forward and
//! backward run as `fused::Executor` planned them, on any [`Backend`]
//! (`HostBackend` interprets the GPU's kernels on a CPU).
//!
//! The parameter state stays with the schedule executor's `ParamStore`, so
//! every ZeRO stage, the gradient sync and the optimizer are the reference's:
//! a chunk uploads the values it reads (once per step below ZeRO-3, at each
//! use under ZeRO-3, where the store gathers them per layer), and hands its
//! gradients back after its backward. What crosses a pipeline cut goes
//! through the host as the reference's messages do.
//!
//! Under tensor and expert parallelism each rank runs its local program
//! (`dplc_ir::localize`): the model at the rank's shapes, with the plan's
//! layout changes as explicit steps. Those, and MoE routing, run on the host
//! ([`Host`]) with the reference's collectives and kernels.

use super::compute::{take_live, Forwarded, Pass, StageCompute};
use super::Shared;
use crate::comm::Message;
use crate::error::{kernel_err, Result, RuntimeError};
use crate::fused::{
    tensor_dims, to_backend, to_host, Backend, ChunkSpan, Executor, FusedGraph, HostSteps,
    ParamBufs, RegionRun, Val,
};
use crate::interp::{ParamAccess, ParamKey, Value};
use crate::kernels::{self, DropoutKey, OpCtx};
use crate::params::{ParamStore, Unit, ZeroStage};
use crate::tensor::Tensor;
use dplc_codegen::Elem;
use dplc_ir::{GradPlan, Graph, NodeId, Op, TensorId};
use std::cell::RefCell;
use std::collections::{BTreeMap, HashMap, HashSet};

/// What every rank of a fused run runs, made once: its local program (the
/// model itself without tensor or expert parallelism) and that program's
/// fused plan.
pub(crate) struct FusedProgram {
    graph: Graph,
    fused: FusedGraph,
    grad: GradPlan,
}

pub(super) struct Fused<'a, 'b, B: Backend> {
    sh: &'a Shared<'b>,
    be: B,
    prog: &'a FusedProgram,
    /// Each pipeline chunk's part of the root.
    spans: Vec<ChunkSpan>,
    /// Each live (micro-batch, chunk)'s forward, kept for its backward.
    live: HashMap<(usize, usize), RegionRun<B>>,
    /// The parameter values uploaded in this step (below ZeRO-3: they change
    /// only at the optimizer step).
    uploaded: Option<(u64, BTreeMap<ParamKey, Val<B>>)>,
}

/// The fused executor of one pass: its plan, the dropout key's words, and
/// the host that runs its layout changes and routing.
fn executor<'x>(
    sh: &'x Shared,
    prog: &'x FusedProgram,
    pass: &Pass,
    host: &'x mut dyn HostSteps,
) -> Executor<'x> {
    Executor {
        graph: &prog.graph,
        fused: &prog.fused,
        syms: sh.syms.clone(),
        seed: crate::rng::hash(&[sh.seed, pass.step]),
        first_sample: pass.first_sample,
        micro_batch: sh.cfg.micro_batch,
        cp_rank: pass.cp_rank,
        cp: sh.cfg.cp,
        tp_rank: pass.tp_rank,
        tp: sh.cfg.tp,
        host: Some(RefCell::new(host)),
    }
}

/// Check that the fused kernels can run `sh`'s split, and plan them once
/// for every rank: the local program, each region fused, with the
/// pipeline's cut values kept.
pub(super) fn plan(sh: &Shared) -> Result<FusedProgram> {
    let cfg = sh.cfg;
    let g = sh.graph;
    for (r, region) in g.regions() {
        if r != g.root()
            && region
                .nodes
                .iter()
                .any(|&n| matches!(g.node(n).op, Op::Repeat { .. }))
        {
            return Err(RuntimeError::Unsupported(
                "the fused executor runs one level of `repeat`; run this model with \
                 --compute reference"
                    .into(),
            ));
        }
    }
    let graph = match (&sh.layouts, &cfg.layout) {
        (Some(layouts), Some(model)) => {
            // The local shapes are exact: every split dimension divides.
            for (_, node) in g.nodes() {
                for &t in &node.outputs {
                    let dims = tensor_dims(g, &sh.syms, t);
                    layouts.local_dims(dims, layouts.produced(t))?;
                }
            }
            dplc_ir::localize(g, model).map_err(|e| RuntimeError::Config(e.to_string()))?
        }
        _ => g.clone(),
    };
    let fused = FusedGraph::for_run(&graph, cfg.recompute, cfg.attention, &sh.part.extras)?;
    let grad = GradPlan::new(&graph);
    Ok(FusedProgram { graph, fused, grad })
}

/// The host steps of one rank: layout changes over its groups through the
/// parameter store's communicator, MoE routing by the reference kernels.
struct Host<'s> {
    prog: &'s FusedProgram,
    syms: &'s [i64],
    store: &'s mut ParamStore,
}

impl Host<'_> {
    fn out_shapes(&self, node: NodeId) -> Vec<Vec<usize>> {
        let g = &self.prog.graph;
        g.node(node)
            .outputs
            .iter()
            .map(|&t| tensor_dims(g, self.syms, t))
            .collect()
    }
}

/// Routing draws nothing: its kernels read no dropout key.
const NO_DRAWS: DropoutKey = DropoutKey {
    seed: 0,
    step: 0,
    node: 0,
    layer: 0,
    first_sample: 0,
    batch: 0,
    cp_rank: 0,
    cp: 1,
    tp_rank: 0,
    tp: 1,
};

impl FusedProgram {
    /// Kernels its forward and backward launch (the fused attentions' passes included).
    pub fn kernel_count(&self) -> usize {
        self.fused.kernels().len() + self.fused.attention_passes().len()
    }

    /// How fusion took the program's attentions.
    pub fn attentions(&self) -> crate::AttentionUse {
        self.fused.attentions(&self.graph)
    }
}

impl HostSteps for Host<'_> {
    fn forward(&mut self, node: NodeId, ins: Vec<Tensor>) -> Result<Vec<Tensor>> {
        match self.prog.graph.node(node).op {
            Op::Relayout { from, to, .. } => {
                let x = ins
                    .first()
                    .ok_or_else(|| kernel_err("relayout", "no input"))?;
                Ok(vec![self.store.convert(x, from, to)?])
            }
            Op::VocabParallel(v) => {
                let refs: Vec<&Tensor> = ins.iter().collect();
                self.store.vocab_forward(v, &refs)
            }
            ref op => {
                let shapes = self.out_shapes(node);
                let refs: Vec<&Tensor> = ins.iter().collect();
                let ctx = OpCtx {
                    out_shapes: &shapes,
                    dropout: NO_DRAWS,
                    split: None,
                };
                kernels::forward(op, &refs, &ctx)
            }
        }
    }

    fn backward(
        &mut self,
        node: NodeId,
        ins: Vec<Tensor>,
        outs: Vec<Tensor>,
        gouts: Vec<Option<Tensor>>,
    ) -> Result<Vec<Option<Tensor>>> {
        let g = &self.prog.graph;
        let n_in = g.node(node).inputs.len();
        let Some(Some(gout)) = gouts.into_iter().next() else {
            return Ok(vec![None; n_in]);
        };
        match g.node(node).op {
            Op::Relayout { from, to, grad } => {
                let target = dplc_ir::TensorLayout::relayout_grad_target(from, to);
                Ok(vec![Some(self.store.convert(&gout, grad, target)?)])
            }
            Op::VocabParallel(v) => {
                let need = self.prog.grad.input_grads(g, node);
                let ins: Vec<&Tensor> = ins.iter().collect();
                let outs: Vec<&Tensor> = outs.iter().collect();
                self.store.vocab_backward(v, (&ins, &outs), &gout, &need)
            }
            ref op => {
                let need = self.prog.grad.input_grads(g, node);
                let shapes = self.out_shapes(node);
                let ins: Vec<&Tensor> = ins.iter().collect();
                let outs: Vec<&Tensor> = outs.iter().collect();
                let ctx = OpCtx {
                    out_shapes: &shapes,
                    dropout: NO_DRAWS,
                    split: None,
                };
                crate::vjp::backward(op, &ins, &outs, &gout, &need, &ctx)
            }
        }
    }
}

/// The root nodes of the local program `g` that pipeline chunk `c` runs:
/// the model's nodes the partition gave it, and each layout change one of
/// them reads, which runs where its reader does — on every chunk of a layer
/// stack that reads it, but only on the stack's first for its carried input.
fn local_nodes(g: &Graph, sh: &Shared, c: usize) -> HashSet<NodeId> {
    let part = &sh.part;
    let mut own: HashSet<NodeId> = part.chunks[c].nodes.iter().copied().collect();
    let root = g.region(g.root());
    let last = c + 1 == part.chunks.len();
    for &n in &root.nodes {
        if !matches!(g.node(n).op, Op::Relayout { .. }) {
            continue;
        }
        let out = g.node(n).outputs[0];
        let read_here = root.nodes.iter().any(|&m| {
            let node = g.node(m);
            let Some(i) = node.inputs.iter().position(|&t| t == out) else {
                return false;
            };
            if !own.contains(&m) {
                return false;
            }
            match (part.stack(m), node.op.clone()) {
                (Some(st), Op::Repeat { carried, .. }) if i < carried => {
                    part.stack_layers(c, st).start == 0
                }
                _ => true,
            }
        }) || (last && root.results.contains(&out));
        if read_here {
            own.insert(n);
        }
    }
    own
}

impl<'a, 'b, B: Backend> Fused<'a, 'b, B> {
    /// The fused compute of one rank, on its own backend `be`, running the
    /// plan [`plan`] made.
    pub fn new(sh: &'a Shared<'b>, prog: &'a FusedProgram, be: B) -> Self {
        let part = &sh.part;
        let whole = part.chunks.len() == 1;
        let spans = part
            .chunks
            .iter()
            .enumerate()
            .map(|(c, chunk)| ChunkSpan {
                nodes: (!whole).then(|| local_nodes(&prog.graph, sh, c)),
                stacks: part
                    .stacks
                    .iter()
                    .map(|st| (st.node, part.stack_layers(c, st)))
                    .filter(|(_, l)| !l.is_empty())
                    .collect(),
                layers: chunk.layers.clone(),
                receives: c
                    .checked_sub(1)
                    .and_then(|p| part.cut(p))
                    .map(|cut| (cut.stack.node, cut.continues)),
                sends: part.cut(c).map(|cut| cut.stack.node),
            })
            .collect();
        Fused {
            sh,
            be,
            prog,
            spans,
            live: HashMap::new(),
            uploaded: None,
        }
    }

    /// The parameters chunk `c` reads, on the backend: the root's this rank
    /// holds and those of the chunk's layers.
    fn params(&mut self, pass: &Pass, store: &mut ParamStore) -> Result<ParamBufs<B>> {
        // Below ZeRO-3 a value changes only at the optimizer step.
        let cache = store.zero != ZeroStage::Three;
        if cache && self.uploaded.as_ref().is_none_or(|(s, _)| *s != pass.step) {
            self.uploaded = Some((pass.step, BTreeMap::new()));
        }
        let mut values = BTreeMap::new();
        let layers = self.spans[pass.chunk].layers.clone();
        for unit in std::iter::once(Unit::Root).chain(layers.map(Unit::Layer)) {
            // The root's parameters are gathered by the executor around the
            // whole chunk; a layer's here, just for the upload.
            let layer = unit != Unit::Root;
            if layer {
                store.gather(unit)?;
            }
            let keys: Vec<ParamKey> = store
                .slots
                .iter()
                .filter(|(_, s)| s.unit == unit)
                .map(|(&k, _)| k)
                .collect();
            for key in keys {
                let cached = match &self.uploaded {
                    Some((_, c)) if cache => c.get(&key).cloned(),
                    _ => None,
                };
                let v = match cached {
                    Some(v) => v,
                    None => {
                        let v = self.upload(&*store.param(key)?)?;
                        if let (true, Some((_, c))) = (cache, &mut self.uploaded) {
                            c.insert(key, v.clone());
                        }
                        v
                    }
                };
                values.insert(key, v);
            }
            if layer {
                store.release(unit, false)?;
            }
        }
        Ok(ParamBufs {
            values,
            grads: BTreeMap::new(),
        })
    }

    /// A host tensor of `t`'s local shape from a backend value.
    fn download(&mut self, t: TensorId, v: &Val<B>) -> Result<Tensor> {
        to_host(&mut self.be, &self.prog.graph, &self.sh.syms, t, v)
    }

    fn upload(&mut self, t: &Tensor) -> Result<Val<B>> {
        to_backend(&mut self.be, t)
    }

    /// The tensors a message across the cut after chunk `c` carries, in
    /// order: the stack's carried values, then the extras.
    fn message_tensors(&self, c: usize) -> Vec<TensorId> {
        let g = &self.prog.graph;
        let mut out: Vec<TensorId> = self
            .sh
            .part
            .cut(c)
            .map(|cut| g.node(cut.stack.node).outputs.clone())
            .unwrap_or_default();
        out.extend(&self.sh.part.extras);
        out
    }
}

impl<B: Backend> StageCompute for Fused<'_, '_, B> {
    fn forward(
        &mut self,
        pass: &Pass,
        inputs: &HashMap<TensorId, Value>,
        received: Message,
        store: &mut ParamStore,
    ) -> Result<Forwarded> {
        let params = self.params(pass, store)?;
        let mut fed = HashMap::new();
        for (&t, v) in inputs {
            fed.insert(t, self.upload(v)?);
        }
        let mut got = Vec::with_capacity(received.len());
        for v in &received {
            got.push(match v {
                Some(v) => Some(self.upload(v)?),
                None => None,
            });
        }
        let span = self.spans[pass.chunk].clone();
        let extras = &self.sh.part.extras;
        let mut host = Host {
            prog: self.prog,
            syms: &self.sh.syms,
            store,
        };
        let exec = executor(self.sh, self.prog, pass, &mut host);
        let (run, sent) = exec.forward_chunk(&mut self.be, &span, got, extras, &fed, &params)?;
        let out = match sent {
            None => {
                let loss_t = self.prog.graph.outputs()[0];
                let loss = exec.read(&mut self.be, &run, loss_t)?;
                Forwarded::Loss(f64::from(
                    *loss.first().ok_or_else(|| kernel_err("fused", "no loss"))?,
                ))
            }
            Some(vals) => {
                let mut msg = Message::with_capacity(vals.len());
                for (t, v) in self.message_tensors(pass.chunk).into_iter().zip(&vals) {
                    msg.push(match v {
                        Some(v) => Some(self.download(t, v)?),
                        None => None,
                    });
                }
                Forwarded::Send(msg)
            }
        };
        self.live.insert((pass.micro, pass.chunk), run);
        Ok(out)
    }

    fn backward(
        &mut self,
        pass: &Pass,
        received: Option<Message>,
        store: &mut ParamStore,
    ) -> Result<Message> {
        let mut run = take_live(&mut self.live, pass)?;
        let mut params = self.params(pass, store)?;
        for (&key, v) in &params.values {
            let zeros = self.be.zeros(Elem::F32, v.len)?;
            params.grads.insert(
                key,
                Val {
                    buf: zeros,
                    elem: Elem::F32,
                    len: v.len,
                },
            );
        }
        let got = match received {
            None => None,
            Some(msg) => {
                let mut got = Vec::with_capacity(msg.len());
                for g in &msg {
                    got.push(match g {
                        Some(g) => Some(self.upload(g)?),
                        None => None,
                    });
                }
                Some(got)
            }
        };
        let span = self.spans[pass.chunk].clone();
        let sent = {
            let mut host = Host {
                prog: self.prog,
                syms: &self.sh.syms,
                store: &mut *store,
            };
            let exec = executor(self.sh, self.prog, pass, &mut host);
            exec.backward_chunk(
                &mut self.be,
                &span,
                &mut run,
                got,
                &self.sh.part.extras,
                self.sh.loss_scale(),
                &mut params,
            )?
        };
        for (key, g) in std::mem::take(&mut params.grads) {
            let shape = store
                .slots
                .get(&key)
                .map(|s| s.shape.clone())
                .ok_or_else(|| kernel_err("fused", format!("{key:?} is not held")))?;
            let data = self.be.download(&g.buf, g.elem, g.len)?;
            store.add_grad(key, Tensor::f32(shape, data))?;
        }
        // ZeRO-2 and 3: each layer's gradients are reduce-scattered once its
        // backward is done, last layer first as the reference does.
        for l in span.layers.clone().rev() {
            store.release(Unit::Layer(l), true)?;
        }
        if span.receives.is_none() {
            return Ok(Vec::new());
        }
        let mut msg = Message::with_capacity(sent.len());
        for (t, g) in self
            .message_tensors(pass.chunk.saturating_sub(1))
            .into_iter()
            .zip(&sent)
        {
            msg.push(match g {
                Some(g) => Some(self.download(t, g)?),
                None => None,
            });
        }
        Ok(msg)
    }

    fn device_peak_bytes(&self) -> Option<u64> {
        self.be.peak_bytes().map(|b| b as u64)
    }

    fn activation_bytes(&self) -> u64 {
        let float_bytes = self.be.dtype().size_bytes() as usize;
        let mut seen = HashSet::new();
        self.live
            .values()
            .map(|r| r.activation_bytes(&self.prog.graph, float_bytes, &mut seen) as u64)
            .sum()
    }
}
