//! Codegen's fused kernels as a compute backend: each chunk's forward and
//! backward run as `fused::Executor` planned them, on any [`Backend`]
//! (`HostBackend` interprets the GPU's kernels on a CPU).
//!
//! The parameter state is the schedule executor's `ParamStore`, resident on
//! the same device (`DeviceStorage`; the compute runs on its own handle of
//! the backend): a chunk reads the store's parameter buffers and adds its
//! gradients to the store's accumulators there, so every ZeRO stage, the
//! gradient sync and the optimizer rule are the reference's, run where the
//! kernels run. Under ZeRO-2 and 3 the host's layer hook hands the pass
//! each layer's gathered weights and accumulators as it reaches the layer,
//! and reduce-scatters them after its backward, as the reference's layer
//! hooks do. What crosses a pipeline cut goes through the host as the
//! reference's messages do.
//!
//! Under tensor and expert parallelism each rank runs its local program
//! (`dplc_ir::localize`): the model at the rank's shapes, with the plan's
//! layout changes as explicit steps. Those, and MoE routing, run on the host
//! ([`Host`]) with the reference's collectives and kernels.

use super::compute::{take_live, Forwarded, Pass, StageCompute};
use super::Shared;
use crate::error::{kernel_err, Result, RuntimeError};
use crate::fused::{
    as_elem, tensor_dims, to_backend, Backend, ChunkSpan, Executor, FusedGraph, HostSteps,
    ParamBufs, RegionRun, Shaped, Val, VocabGroup,
};
use crate::interp::{ParamKey, Value};
use crate::kernels::{self, DropoutKey, OpCtx};
use crate::params::{DeviceStorage, Links, ParamStore, Unit};
use crate::tensor::Tensor;
use dplc_codegen::Elem;
use dplc_ir::{GradPlan, Graph, NodeId, Op, TensorId, TensorLayout};
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

/// The store a fused compute runs over: its state on the same backend.
type Store<B, L> = ParamStore<DeviceStorage<B, L>>;

pub(super) struct Fused<'a, 'b, B: Backend> {
    sh: &'a Shared<'b>,
    prog: &'a FusedProgram,
    /// This compute's handle on the backend the store's state lives on (the
    /// same device), so that the pass can ask the store for a layer's
    /// weights while it runs.
    be: B,
    /// Each pipeline chunk's part of the root.
    spans: Vec<ChunkSpan>,
    /// Each live (micro-batch, chunk)'s forward, kept for its backward.
    live: HashMap<(usize, usize), RegionRun<B>>,
}

/// The fused executor of one pass: its plan, the dropout key's words, and
/// the host steps' runner (the store's groups and links, for layout
/// changes and the split vocabulary's exchanges).
fn executor<'x, B: Backend>(
    sh: &'x Shared,
    prog: &'x FusedProgram,
    pass: &Pass,
    host: &'x mut dyn HostSteps<B>,
) -> Executor<'x, B> {
    Executor {
        graph: &prog.graph,
        fused: &prog.fused,
        syms: sh.syms.clone(),
        seed: crate::rng::hash(&[sh.seed, pass.step]),
        place: dplc_codegen::KeyPlace {
            layer: 0,
            first_sample: pass.first_sample,
            micro_batch: sh.cfg.micro_batch,
            cp_rank: pass.cp_rank,
            cp: sh.cfg.cp,
            tp_rank: pass.tp_rank,
            tp: sh.cfg.tp,
        },
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
    let fused = FusedGraph::for_run(
        &graph,
        cfg.layer_recompute(),
        cfg.attention,
        &sh.part.extras,
    )?;
    let grad = GradPlan::new(&graph);
    Ok(FusedProgram { graph, fused, grad })
}

/// The host steps of one rank: layout changes over its mesh groups by the
/// store's links (on the device; indices through the communicator), what
/// no kernel runs by the reference kernels; and its layer hook, which hands the pass each layer's sharded weights and
/// gradient accumulators when it reaches the layer (ZeRO-2 and 3, as the
/// reference's layer hooks do).
struct Host<'s, B: Backend, L: Links<B>> {
    prog: &'s FusedProgram,
    syms: &'s [i64],
    /// Where each layer stack's layers sit in the model's numbering (the
    /// store's units).
    part: &'s crate::partition::Partition,
    store: &'s mut Store<B, L>,
    params: &'s ParamBufs<B>,
}

impl<'s, B: Backend, L: Links<B>> Host<'s, B, L> {
    fn new(
        sh: &'s Shared<'_>,
        prog: &'s FusedProgram,
        store: &'s mut Store<B, L>,
        params: &'s ParamBufs<B>,
    ) -> Self {
        Host {
            prog,
            syms: &sh.syms,
            part: &sh.part,
            store,
            params,
        }
    }

    fn out_shapes(&self, node: NodeId) -> Vec<Vec<usize>> {
        let g = &self.prog.graph;
        g.node(node)
            .outputs
            .iter()
            .map(|&t| tensor_dims(g, self.syms, t))
            .collect()
    }
}

impl FusedProgram {
    /// Kernels its forward and backward launch with floats stored as
    /// `dtype` (the fused attentions' passes included).
    pub fn kernel_count(&self, dtype: dplc_ir::DType) -> usize {
        self.fused.kernels().len() + self.fused.attention_passes(dtype).len()
    }

    /// How fusion took the program's attentions.
    pub fn attentions(&self) -> crate::AttentionUse {
        self.fused.attentions(&self.graph)
    }
}

impl<B: Backend, L: Links<B>> HostSteps<B> for Host<'_, B, L> {
    fn forward(&mut self, node: NodeId, ins: Vec<Tensor>) -> Result<Vec<Tensor>> {
        match self.prog.graph.node(node).op {
            Op::Relayout { from, to, .. } => {
                let x = ins
                    .first()
                    .ok_or_else(|| kernel_err("relayout", "no input"))?;
                let store = &mut *self.store;
                Ok(vec![crate::shard::convert(
                    &mut store.comm,
                    &store.mesh,
                    x,
                    from,
                    to,
                )?])
            }
            Op::VocabParallel(v) => {
                let refs: Vec<&Tensor> = ins.iter().collect();
                let store = &mut *self.store;
                crate::vocab::forward(&mut store.comm, &store.mesh, v, &refs)
            }
            ref op => {
                let shapes = self.out_shapes(node);
                let refs: Vec<&Tensor> = ins.iter().collect();
                let ctx = OpCtx {
                    out_shapes: &shapes,
                    // Routing draws nothing: its kernels read no dropout key.
                    dropout: DropoutKey::NONE,
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
                let store = &mut *self.store;
                Ok(vec![Some(crate::shard::convert(
                    &mut store.comm,
                    &store.mesh,
                    &gout,
                    grad,
                    target,
                )?)])
            }
            Op::VocabParallel(v) => {
                let need = self.prog.grad.input_grads(g, node);
                let ins: Vec<&Tensor> = ins.iter().collect();
                let outs: Vec<&Tensor> = outs.iter().collect();
                let store = &mut *self.store;
                crate::vocab::backward(&mut store.comm, &store.mesh, v, (&ins, &outs), &gout, &need)
            }
            ref op => {
                let need = self.prog.grad.input_grads(g, node);
                let shapes = self.out_shapes(node);
                let ins: Vec<&Tensor> = ins.iter().collect();
                let outs: Vec<&Tensor> = outs.iter().collect();
                let ctx = OpCtx {
                    out_shapes: &shapes,
                    dropout: DropoutKey::NONE,
                    split: None,
                };
                crate::vjp::backward(op, &ins, &outs, &gout, &need, &ctx)
            }
        }
    }

    fn layer(&mut self, stack: NodeId, layer: u64, backward: bool, enter: bool) -> Result<()> {
        let zero = self.store.zero;
        let first = self
            .part
            .stack(stack)
            .ok_or_else(|| kernel_err("fused", format!("{stack} is not a layer stack")))?
            .first;
        let unit = Unit::Layer(first + layer);
        let keys = self.store.keys_of(unit);
        if enter {
            if zero.shards_weights() {
                self.store.gather(unit)?;
                let mut values = self.params.values.borrow_mut();
                for &key in &keys {
                    values.insert(key, self.store.value(key)?);
                }
            }
            if backward && zero.shards_grads() {
                let mut grads = self.params.grads.borrow_mut();
                for &key in &keys {
                    grads.insert(key, accumulator(self.store, key)?);
                }
            }
            return Ok(());
        }
        if zero.shards_weights() {
            let mut values = self.params.values.borrow_mut();
            for key in &keys {
                values.remove(key);
            }
        }
        if backward && zero.shards_grads() {
            let mut grads = self.params.grads.borrow_mut();
            for key in &keys {
                grads.remove(key);
            }
        }
        // ZeRO-2 and 3: the layer's gradients are reduce-scattered once its
        // backward is done (last layer first, as the reference does);
        // ZeRO-3 frees its gathered weights.
        self.store.release(unit, backward)
    }

    fn reshards(&self) -> bool {
        self.store.zero.shards_weights()
    }

    fn vocab(&mut self) -> &mut dyn VocabGroup {
        self
    }

    fn relayout(
        &mut self,
        be: &mut B,
        v: Shaped<B>,
        from: TensorLayout,
        to: TensorLayout,
    ) -> Result<Shaped<B>> {
        let store = &mut *self.store;
        let mut moves = store.storage.moves(be, &mut store.comm);
        crate::shard::convert_with(&mut moves, &store.mesh, &v, from, to)
    }
}

impl<B: Backend, L: Links<B>> VocabGroup for Host<'_, B, L> {
    fn slice(&self, n: usize) -> (usize, usize) {
        crate::vocab::slice(&self.store.comm, &self.store.mesh, n)
    }

    fn row_stats(&mut self, mine: &[f32]) -> Result<Vec<f32>> {
        let store = &mut *self.store;
        crate::vocab::combine_row_stats(&mut store.comm, &store.mesh, mine)
    }

    fn row_sums(&mut self, sums: &mut [f32]) -> Result<()> {
        let store = &mut *self.store;
        store.comm.all_reduce(&store.mesh.tp, sums)
    }
}

/// `key`'s gradient accumulator in the store, as the kernels add into it.
fn accumulator<B: Backend, L: Links<B>>(store: &mut Store<B, L>, key: ParamKey) -> Result<Val<B>> {
    let acc = store.accumulator(key)?;
    Ok(Val {
        buf: acc.get()?.clone(),
        elem: Elem::F32,
        len: acc.len,
    })
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

/// The model's inputs (tokens, targets, …) that `nodes` of `g` read.
fn inputs_read(g: &Graph, nodes: &HashSet<NodeId>) -> HashSet<TensorId> {
    nodes
        .iter()
        .flat_map(|&n| g.node(n).inputs.iter().copied())
        .filter(|&t| g.producer(t).is_some_and(|p| matches!(p.op, Op::Input(_))))
        .collect()
}

impl<'a, 'b, B: Backend> Fused<'a, 'b, B> {
    /// The fused compute of one rank, running the plan [`plan`] made on its
    /// handle `be` of the backend the rank's store keeps its state on.
    pub fn new(sh: &'a Shared<'b>, prog: &'a FusedProgram, be: B) -> Self {
        let part = &sh.part;
        let whole = part.chunks.len() == 1;
        let spans = part
            .chunks
            .iter()
            .enumerate()
            .map(|(c, chunk)| {
                let nodes = (!whole).then(|| local_nodes(&prog.graph, sh, c));
                let inputs = nodes.as_ref().map(|n| inputs_read(&prog.graph, n));
                ChunkSpan {
                    nodes,
                    inputs,
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
                }
            })
            .collect();
        Fused {
            sh,
            prog,
            be,
            spans,
            live: HashMap::new(),
        }
    }

    /// A hop's values with every float in the storage type, as the next
    /// chunk's kernels read them.
    fn in_storage_type(&mut self, vals: Vec<Option<Val<B>>>) -> Result<Vec<Option<Val<B>>>> {
        vals.into_iter()
            .map(|v| match v {
                Some(v) if v.elem == Elem::F32 => as_elem(&mut self.be, &v, Elem::Float).map(Some),
                v => Ok(v),
            })
            .collect()
    }

    /// The parameters chunk `pass.chunk` reads from the start, as the store
    /// holds them on the backend: the root's this rank holds and, where
    /// they are whole, those of the chunk's layers. ZeRO-3's sharded layers
    /// come one at a time, through the host's layer hook.
    fn params<L: Links<B>>(&self, pass: &Pass, store: &mut Store<B, L>) -> Result<ParamBufs<B>> {
        let sharded = store.zero.shards_weights();
        let layers = self.spans[pass.chunk].layers.clone();
        let mut values = BTreeMap::new();
        for (&key, slot) in &store.slots {
            let wanted = match slot.unit {
                Unit::Root => true,
                Unit::Layer(l) => !sharded && layers.contains(&l),
            };
            if wanted {
                values.insert(key, store.value(key)?);
            }
        }
        Ok(ParamBufs::new(values))
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

    /// Check that a message across the cut after chunk `c` holds its
    /// tensors' element counts (what arrives from another rank is read by
    /// kernels as sized).
    fn check_message(&self, c: usize, vals: &[Option<Val<B>>]) -> Result<()> {
        let tensors = self.message_tensors(c);
        if vals.len() > tensors.len() {
            return Err(kernel_err(
                "recv",
                format!("{} values across a cut of {}", vals.len(), tensors.len()),
            ));
        }
        for (&t, v) in tensors.iter().zip(vals) {
            let want: usize = tensor_dims(&self.prog.graph, &self.sh.syms, t)
                .iter()
                .product();
            if let Some(v) = v.as_ref().filter(|v| v.len != want) {
                return Err(kernel_err(
                    "recv",
                    format!(
                        "{t} arrived with {} elements, its shape holds {want}",
                        v.len
                    ),
                ));
            }
        }
        Ok(())
    }
}

impl<B: Backend, L: Links<B>> StageCompute<DeviceStorage<B, L>> for Fused<'_, '_, B> {
    fn forward(
        &mut self,
        pass: &Pass,
        inputs: &HashMap<TensorId, Value>,
        received: Vec<Option<Val<B>>>,
        store: &mut Store<B, L>,
    ) -> Result<Forwarded<Vec<Option<Val<B>>>>> {
        let params = self.params(pass, store)?;
        let mut fed = HashMap::new();
        let read = self.spans[pass.chunk].inputs.as_ref();
        for (&t, v) in inputs {
            if read.is_none_or(|read| read.contains(&t)) {
                fed.insert(t, to_backend(&mut self.be, v)?);
            }
        }
        if pass.chunk > 0 {
            self.check_message(pass.chunk - 1, &received)?;
        }
        let got = received;
        let span = self.spans[pass.chunk].clone();
        let (run, sent, loss) = {
            let mut host = Host::new(self.sh, self.prog, store, &params);
            let exec = executor(self.sh, self.prog, pass, &mut host);
            let extras = &self.sh.part.extras;
            let (run, sent) =
                exec.forward_chunk(&mut self.be, &span, got, extras, &fed, &params)?;
            // The last chunk reads its loss while the pass is at hand.
            let loss = match sent {
                None => {
                    let loss = exec.read(&mut self.be, &run, self.prog.graph.outputs()[0])?;
                    let first = loss.first().ok_or_else(|| kernel_err("fused", "no loss"))?;
                    Some(f64::from(*first))
                }
                Some(_) => None,
            };
            (run, sent, loss)
        };
        let out = match (sent, loss) {
            (Some(vals), _) => Forwarded::Send(self.in_storage_type(vals)?),
            (None, loss) => Forwarded::Loss(loss.ok_or_else(|| kernel_err("fused", "no loss"))?),
        };
        self.live.insert((pass.micro, pass.chunk), run);
        Ok(out)
    }

    fn backward(
        &mut self,
        pass: &Pass,
        received: Option<Vec<Option<Val<B>>>>,
        store: &mut Store<B, L>,
    ) -> Result<Vec<Option<Val<B>>>> {
        let mut run = take_live(&mut self.live, pass)?;
        let params = self.params(pass, store)?;
        // The kernels add each gradient into the store's own accumulator;
        // a sharded layer's come with its weights, through the layer hook.
        let keys: Vec<ParamKey> = params.values.borrow().keys().copied().collect();
        for key in keys {
            let sharded = store.zero.shards_grads()
                && store.slots.get(&key).is_some_and(|s| s.unit != Unit::Root);
            if !sharded {
                params
                    .grads
                    .borrow_mut()
                    .insert(key, accumulator(store, key)?);
            }
        }
        if let Some(msg) = &received {
            self.check_message(pass.chunk, msg)?;
        }
        let got = received;
        let span = self.spans[pass.chunk].clone();
        let sent = {
            let mut host = Host::new(self.sh, self.prog, store, &params);
            let exec = executor(self.sh, self.prog, pass, &mut host);
            exec.backward_chunk(
                &mut self.be,
                &span,
                &mut run,
                got,
                &self.sh.part.extras,
                self.sh.loss_scale(),
                &params,
            )?
        };
        if span.receives.is_none() {
            return Ok(Vec::new());
        }
        self.in_storage_type(sent)
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
