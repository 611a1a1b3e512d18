//! The seam between the schedule executor and what computes: one pipeline
//! chunk's forward or backward of one micro-batch, on the compute backend's
//! own buffers. The executor owns everything else (the order of work, the
//! point-to-point sends, the parameter state and its collectives), so every
//! backend runs the same schedule, ZeRO stage and recomputation.
//!
//! [`Reference`] is the interpreter of the IR, op by op in `f32`: the ground
//! truth. `super::fused::Fused` runs codegen's fused kernels.

use super::Shared;
use crate::comm::Message;
use crate::error::{kernel_err, Result, RuntimeError};
use crate::interp::{add_grad, Frame, Grads, Interp, Value};
use crate::kernels::DropoutKey;
use crate::params::{HostStorage, ParamStore, Storage};
use crate::tensor::Tensor;
use dplc_ir::{TensorId, TensorLayout};
use std::collections::{HashMap, HashSet};
use std::sync::Arc;

/// Which backend computes a run's stages.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Compute {
    /// The IR interpreter, op by op in `f32`.
    #[default]
    Reference,
    /// Codegen's fused kernels, as a GPU runs them; on CPU ranks through the
    /// kernel interpreter (`HostBackend`).
    Fused,
}

impl Compute {
    pub fn name(self) -> &'static str {
        match self {
            Compute::Reference => "reference",
            Compute::Fused => "fused",
        }
    }
}

/// Where one unit of work sits: its micro-batch and chunk, the step, the
/// global index of its first sample and the rank's place in its
/// context-parallel group (the dropout key's words).
#[derive(Clone, Copy, Debug)]
pub(super) struct Pass {
    pub micro: usize,
    pub chunk: usize,
    pub step: u64,
    pub first_sample: u64,
    pub cp_rank: usize,
    /// The rank's place in its tensor-parallel group.
    pub tp_rank: usize,
}

/// What a chunk's forward hands on.
pub(super) enum Forwarded<M> {
    /// The last chunk: this micro-batch's mean loss.
    Loss(f64),
    /// The next chunk's activations: the layers' carried values, then the
    /// partition's extras (held where the store's compute holds values).
    Send(M),
}

/// One rank's compute backend, over a store whose state lives in `S`.
pub(super) trait StageCompute<S: Storage> {
    /// Chunk `pass.chunk`'s forward: `received` is what the previous chunk
    /// sent (empty on the first). Root parameters are gathered around it.
    fn forward(
        &mut self,
        pass: &Pass,
        inputs: &HashMap<TensorId, Value>,
        received: S::Msg,
        store: &mut ParamStore<S>,
    ) -> Result<Forwarded<S::Msg>>;

    /// Chunk `pass.chunk`'s backward after its forward: `received` is the
    /// next chunk's gradients (`None` on the last chunk, which seeds the
    /// loss). Parameter gradients go to `store`; returns what the previous
    /// chunk gets (nothing on the first).
    fn backward(
        &mut self,
        pass: &Pass,
        received: Option<S::Msg>,
        store: &mut ParamStore<S>,
    ) -> Result<S::Msg>;

    /// Bytes of activations the live micro-batches hold.
    fn activation_bytes(&self) -> u64;
}

/// The forward state a backend kept for `pass`'s backward.
pub(super) fn take_live<T>(live: &mut HashMap<(usize, usize), T>, pass: &Pass) -> Result<T> {
    live.remove(&(pass.micro, pass.chunk))
        .ok_or_else(|| RuntimeError::Kernel {
            op: "schedule",
            detail: format!("backward of micro-batch {} before its forward", pass.micro),
        })
}

/// The values repeat node `n` carries from layer to layer.
pub(super) fn carried_of(g: &dplc_ir::Graph, n: dplc_ir::NodeId) -> usize {
    match g.node(n).op {
        dplc_ir::Op::Repeat { carried, .. } => carried,
        _ => 0,
    }
}

fn short(what: &str) -> RuntimeError {
    RuntimeError::Kernel {
        op: "recv",
        detail: format!("short message: {what} missing"),
    }
}

/// The reference interpreter as a compute backend.
pub(super) struct Reference<'a, 'b> {
    sh: &'a Shared<'b>,
    /// Each live (micro-batch, chunk)'s forward state, kept for its backward.
    live: HashMap<(usize, usize), Frame>,
}

impl<'a, 'b> Reference<'a, 'b> {
    pub fn new(sh: &'a Shared<'b>) -> Self {
        Reference {
            sh,
            live: HashMap::new(),
        }
    }

    fn interp(&self, pass: &Pass) -> Interp<'a> {
        let sh: &'a Shared<'b> = self.sh;
        Interp {
            graph: sh.graph,
            plan: &sh.plan,
            syms: sh.syms.clone(),
            key: DropoutKey {
                seed: sh.seed,
                step: pass.step,
                node: 0,
                layer: 0,
                first_sample: pass.first_sample,
                batch: sh.cfg.micro_batch,
                cp_rank: pass.cp_rank,
                cp: sh.cfg.cp,
                tp_rank: pass.tp_rank,
                tp: sh.cfg.tp,
            },
            recompute: sh.cfg.layer_recompute(),
            layouts: sh.layouts.as_ref(),
        }
    }
}

impl StageCompute<HostStorage> for Reference<'_, '_> {
    fn forward(
        &mut self,
        pass: &Pass,
        inputs: &HashMap<TensorId, Value>,
        received: Message,
        store: &mut ParamStore<HostStorage>,
    ) -> Result<Forwarded<Message>> {
        let sh = self.sh;
        let g = sh.graph;
        let c = pass.chunk;
        let last = c + 1 == sh.part.chunks.len();
        let interp = self.interp(pass);
        let mut frame = Frame {
            values: inputs.clone(),
            ..Frame::default()
        };
        // The previous chunk's stack: its carried values go on here, or
        // are its outputs when its last layer was the previous chunk's.
        let cut_in = c.checked_sub(1).and_then(|p| sh.part.cut(p));
        let mut state: Vec<Value> = Vec::new();
        if let Some(cut) = cut_in {
            let mut vals = received.into_iter();
            for _ in 0..carried_of(g, cut.stack.node) {
                state.push(Arc::new(
                    vals.next().flatten().ok_or_else(|| short("activation"))?,
                ));
            }
            for &t in &sh.part.extras {
                if let Some(v) = vals.next().flatten() {
                    frame.values.insert(t, Arc::new(v));
                }
            }
            if !cut.continues {
                for (&t, v) in g.node(cut.stack.node).outputs.iter().zip(state.drain(..)) {
                    frame.values.insert(t, v);
                }
            }
        }
        let chunk = &sh.part.chunks[c];
        for &n in &chunk.nodes {
            let Some(stack) = sh.part.stack(n) else {
                interp.eval_node(&mut frame, n, 0, store)?;
                continue;
            };
            let node = g.node(n);
            let init = match cut_in {
                Some(cut) if cut.continues && cut.stack.node == n => std::mem::take(&mut state),
                _ => {
                    let carried = carried_of(g, n);
                    let mut init = Vec::with_capacity(carried);
                    for (j, &t) in node.inputs[..carried].iter().enumerate() {
                        let want = sh
                            .layouts
                            .as_ref()
                            .map_or(TensorLayout::Replicated, |l| l.consumed(n, j));
                        init.push(interp.read_as(&mut frame, t, want, store)?);
                    }
                    init
                }
            };
            // A chunk that ends inside the stack leaves its carried values
            // as the stack's outputs: what it sends.
            let out = interp.forward_repeat(
                &mut frame,
                n,
                sh.part.stack_layers(c, stack),
                init,
                0,
                Some(stack.first),
                store,
            )?;
            for (t, v) in node.outputs.iter().zip(out) {
                frame.values.insert(*t, v);
            }
        }
        let out = if last {
            Forwarded::Loss(f64::from(frame.values[&g.outputs()[0]].f()?[0]))
        } else {
            let cut = sh
                .part
                .cut(c)
                .ok_or_else(|| kernel_err("pipeline", "a chunk before the last cuts no stack"))?;
            let sent = &g.node(cut.stack.node).outputs;
            let mut msg: Message = Vec::with_capacity(sent.len() + sh.part.extras.len());
            for t in sent {
                let v = frame
                    .values
                    .get(t)
                    .ok_or_else(|| kernel_err("pipeline", format!("{t} is not computed")))?;
                msg.push(Some((**v).clone()));
            }
            msg.extend(sh.part.extras.iter().map(|t| {
                if sent.contains(t) {
                    None
                } else {
                    frame.values.get(t).map(|v| (**v).clone())
                }
            }));
            Forwarded::Send(msg)
        };
        self.live.insert((pass.micro, c), frame);
        Ok(out)
    }

    fn backward(
        &mut self,
        pass: &Pass,
        received: Option<Message>,
        store: &mut ParamStore<HostStorage>,
    ) -> Result<Message> {
        let sh = self.sh;
        let g = sh.graph;
        let c = pass.chunk;
        let interp = self.interp(pass);
        let mut frame = take_live(&mut self.live, pass)?;
        let mut grads = Grads::new();
        match received {
            None => {
                grads.insert(g.outputs()[0], Tensor::f32(vec![], vec![sh.loss_scale()]));
            }
            Some(msg) => {
                // The gradients of what this chunk sent: its stack's
                // outputs as it left them, then the extras.
                let cut = sh
                    .part
                    .cut(c)
                    .ok_or_else(|| kernel_err("pipeline", "gradients reached the last chunk"))?;
                let mut it = msg.into_iter();
                for &t in &g.node(cut.stack.node).outputs {
                    if let Some(gr) = it.next().flatten() {
                        add_grad(&mut grads, t, gr)?;
                    }
                }
                for &t in &sh.part.extras {
                    if let Some(gr) = it.next().flatten() {
                        add_grad(&mut grads, t, gr)?;
                    }
                }
            }
        }
        let cut_in = c.checked_sub(1).and_then(|p| sh.part.cut(p));
        let chunk = &sh.part.chunks[c];
        let mut state_grads: Vec<Option<Tensor>> = Vec::new();
        for &n in chunk.nodes.iter().rev() {
            let Some(stack) = sh.part.stack(n) else {
                if sh.plan.input_grads(g, n).iter().any(|&x| x) {
                    interp.backward_node(&mut frame, n, &mut grads, 0, store)?;
                }
                continue;
            };
            let node = g.node(n);
            let mut gout = Vec::new();
            for &t in &node.outputs {
                gout.push(interp.take_grad(&mut frame, &mut grads, t, store)?);
            }
            let gin = interp.backward_repeat(
                &mut frame,
                n,
                sh.part.stack_layers(c, stack),
                gout,
                &mut grads,
                0,
                Some(stack.first),
                store,
            )?;
            let need = sh.plan.input_grads(g, n);
            let carried = carried_of(g, n);
            for (j, gr) in gin.into_iter().enumerate() {
                match cut_in {
                    // The carried values came from the previous chunk.
                    Some(cut) if cut.continues && cut.stack.node == n && j < carried => {
                        state_grads.push(gr);
                    }
                    _ => {
                        if let (Some(gr), true) = (gr, need[j]) {
                            interp.contribute_input(&mut frame, &mut grads, n, j, gr)?;
                        }
                    }
                }
            }
        }
        interp.flush_param_grads(g.root(), &mut frame, &mut grads, 0, store)?;
        let Some(cut) = cut_in else {
            return Ok(Vec::new());
        };
        let sent = &g.node(cut.stack.node).outputs;
        let mut msg: Message = if cut.continues {
            state_grads
        } else {
            let mut m = Vec::with_capacity(sent.len());
            for &t in sent {
                m.push(interp.take_grad(&mut frame, &mut grads, t, store)?);
            }
            m
        };
        for &t in &sh.part.extras {
            msg.push(if sent.contains(&t) {
                None
            } else {
                interp.take_grad(&mut frame, &mut grads, t, store)?
            });
        }
        Ok(msg)
    }

    fn activation_bytes(&self) -> u64 {
        let mut seen = HashSet::new();
        self.live
            .values()
            .map(|f| f.activation_bytes(self.sh.graph, &mut seen) as u64)
            .sum()
    }
}
