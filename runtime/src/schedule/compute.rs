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
use crate::error::{Result, RuntimeError};
use crate::interp::{add_grad, Frame, Grads, Interp, Value};
use crate::kernels::DropoutKey;
use crate::params::ParamStore;
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

/// Where one unit of work sits: its micro-batch and chunk, the step, and the
/// global index of its first sample (the dropout key's words).
#[derive(Clone, Copy, Debug)]
pub(super) struct Pass {
    pub micro: usize,
    pub chunk: usize,
    pub step: u64,
    pub first_sample: u64,
}

/// What a chunk's forward hands on.
pub(super) enum Forwarded {
    /// The last chunk: this micro-batch's mean loss.
    Loss(f64),
    /// The next chunk's activations: the layers' carried values, then the
    /// partition's extras.
    Send(Message),
}

/// One rank's compute backend.
pub(super) trait StageCompute {
    /// Chunk `pass.chunk`'s forward: `received` is what the previous chunk
    /// sent (empty on the first). Root parameters are gathered around it.
    fn forward(
        &mut self,
        pass: &Pass,
        inputs: &HashMap<TensorId, Value>,
        received: Message,
        store: &mut ParamStore,
    ) -> Result<Forwarded>;

    /// Chunk `pass.chunk`'s backward after its forward: `received` is the
    /// next chunk's gradients (`None` on the last chunk, which seeds the
    /// loss). Parameter gradients go to `store`; returns what the previous
    /// chunk gets (nothing on the first).
    fn backward(
        &mut self,
        pass: &Pass,
        received: Option<Message>,
        store: &mut ParamStore,
    ) -> Result<Message>;

    /// Bytes of activations the live micro-batches hold.
    fn activation_bytes(&self) -> u64;

    /// The device allocator's peak so far, where the compute has a device.
    fn device_peak_bytes(&self) -> Option<u64> {
        None
    }
}

/// The forward state a backend kept for `pass`'s backward.
pub(super) fn take_live<T>(live: &mut HashMap<(usize, usize), T>, pass: &Pass) -> Result<T> {
    live.remove(&(pass.micro, pass.chunk))
        .ok_or_else(|| RuntimeError::Kernel {
            op: "schedule",
            detail: format!("backward of micro-batch {} before its forward", pass.micro),
        })
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
            },
            recompute: sh.cfg.recompute,
            layouts: sh.layouts.as_ref(),
        }
    }
}

impl StageCompute for Reference<'_, '_> {
    fn forward(
        &mut self,
        pass: &Pass,
        inputs: &HashMap<TensorId, Value>,
        received: Message,
        store: &mut ParamStore,
    ) -> Result<Forwarded> {
        let sh = self.sh;
        let g = sh.graph;
        let c = pass.chunk;
        let last = c + 1 == sh.part.chunks.len();
        let n_carried = sh.repeat_carried();
        let interp = self.interp(pass);
        let mut frame = Frame {
            values: inputs.clone(),
            ..Frame::default()
        };
        let mut carried: Vec<Value> = Vec::new();
        if c > 0 {
            let mut vals = received.into_iter();
            for _ in 0..n_carried {
                carried.push(Arc::new(
                    vals.next().flatten().ok_or_else(|| short("activation"))?,
                ));
            }
            for &t in &sh.part.extras {
                let v = vals.next().flatten().ok_or_else(|| short("extra"))?;
                frame.values.insert(t, Arc::new(v));
            }
        }
        let chunk = &sh.part.chunks[c];
        for &n in &chunk.nodes {
            if Some(n) == sh.part.repeat {
                let node = g.node(n);
                let init = if c == 0 {
                    let mut init = Vec::with_capacity(n_carried);
                    for (j, &t) in node.inputs[..n_carried].iter().enumerate() {
                        let want = sh
                            .layouts
                            .as_ref()
                            .map_or(TensorLayout::Replicated, |l| l.consumed(n, j));
                        init.push(interp.read_as(&mut frame, t, want, store)?);
                    }
                    init
                } else {
                    std::mem::take(&mut carried)
                };
                let out = interp.forward_repeat(
                    &mut frame,
                    n,
                    chunk.layers.clone(),
                    init,
                    0,
                    Some(0),
                    store,
                )?;
                if last {
                    for (t, v) in node.outputs.iter().zip(out) {
                        frame.values.insert(*t, v);
                    }
                } else {
                    carried = out;
                }
            } else if let Some(stack) = sh.part.stack(n) {
                // One of several stacks: the whole of it (no pipeline cuts it).
                let node = g.node(n);
                let carried = match node.op {
                    dplc_ir::Op::Repeat { carried, .. } => carried,
                    _ => 0,
                };
                let mut init = Vec::with_capacity(carried);
                for (j, &t) in node.inputs[..carried].iter().enumerate() {
                    let want = sh
                        .layouts
                        .as_ref()
                        .map_or(TensorLayout::Replicated, |l| l.consumed(n, j));
                    init.push(interp.read_as(&mut frame, t, want, store)?);
                }
                let out = interp.forward_repeat(
                    &mut frame,
                    n,
                    0..stack.count,
                    init,
                    0,
                    Some(stack.first),
                    store,
                )?;
                for (t, v) in node.outputs.iter().zip(out) {
                    frame.values.insert(*t, v);
                }
            } else {
                interp.eval_node(&mut frame, n, 0, store)?;
            }
        }
        let out = if last {
            Forwarded::Loss(f64::from(frame.values[&g.outputs()[0]].f()?[0]))
        } else {
            let mut msg: Message = carried.iter().map(|v| Some((**v).clone())).collect();
            msg.extend(
                sh.part
                    .extras
                    .iter()
                    .map(|t| Some((*frame.values[t]).clone())),
            );
            Forwarded::Send(msg)
        };
        self.live.insert((pass.micro, c), frame);
        Ok(out)
    }

    fn backward(
        &mut self,
        pass: &Pass,
        received: Option<Message>,
        store: &mut ParamStore,
    ) -> Result<Message> {
        let sh = self.sh;
        let g = sh.graph;
        let c = pass.chunk;
        let n_carried = sh.repeat_carried();
        let interp = self.interp(pass);
        let mut frame = take_live(&mut self.live, pass)?;
        let mut grads = Grads::new();
        let mut carried_grads: Vec<Option<Tensor>> = vec![None; n_carried];
        let last = match received {
            None => {
                grads.insert(g.outputs()[0], Tensor::f32(vec![], vec![sh.loss_scale()]));
                true
            }
            Some(msg) => {
                let mut it = msg.into_iter();
                for cg in carried_grads.iter_mut() {
                    *cg = it.next().flatten();
                }
                for &t in &sh.part.extras {
                    if let Some(gr) = it.next().flatten() {
                        add_grad(&mut grads, t, gr)?;
                    }
                }
                false
            }
        };
        let chunk = &sh.part.chunks[c];
        let mut carried_in: Vec<Option<Tensor>> = vec![None; n_carried];
        for &n in chunk.nodes.iter().rev() {
            if Some(n) == sh.part.repeat {
                let node = g.node(n);
                let gout = if last {
                    let mut gout = Vec::new();
                    for &t in &node.outputs {
                        gout.push(interp.take_grad(&mut frame, &mut grads, t, store)?);
                    }
                    gout
                } else {
                    std::mem::take(&mut carried_grads)
                };
                let gin = interp.backward_repeat(
                    &mut frame,
                    n,
                    chunk.layers.clone(),
                    gout,
                    &mut grads,
                    0,
                    Some(0),
                    store,
                )?;
                if c == 0 {
                    let need = sh.plan.input_grads(g, n);
                    for (j, gr) in gin.into_iter().enumerate() {
                        if let (Some(gr), true) = (gr, need[j]) {
                            interp.contribute_input(&mut frame, &mut grads, n, j, gr)?;
                        }
                    }
                } else {
                    carried_in = gin;
                }
            } else if let Some(stack) = sh.part.stack(n) {
                let node = g.node(n);
                let mut gout = Vec::new();
                for &t in &node.outputs {
                    gout.push(interp.take_grad(&mut frame, &mut grads, t, store)?);
                }
                let gin = interp.backward_repeat(
                    &mut frame,
                    n,
                    0..stack.count,
                    gout,
                    &mut grads,
                    0,
                    Some(stack.first),
                    store,
                )?;
                let need = sh.plan.input_grads(g, n);
                for (j, gr) in gin.into_iter().enumerate() {
                    if let (Some(gr), true) = (gr, need[j]) {
                        interp.contribute_input(&mut frame, &mut grads, n, j, gr)?;
                    }
                }
            } else if sh.plan.input_grads(g, n).iter().any(|&x| x) {
                interp.backward_node(&mut frame, n, &mut grads, 0, store)?;
            }
        }
        interp.flush_param_grads(g.root(), &mut frame, &mut grads, 0, store)?;
        if c == 0 {
            return Ok(Vec::new());
        }
        let mut msg: Message = carried_in;
        for &t in &sh.part.extras {
            msg.push(interp.take_grad(&mut frame, &mut grads, t, store)?);
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
