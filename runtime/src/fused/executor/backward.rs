//! The fused executor's backward: a region's backward steps in reverse —
//! fused backward kernels with their column sums, the two gradient matmuls
//! of each forward matmul, the attention kernel's backward, host steps'
//! backward — freeing each gradient and saved value after its last reader.

use super::*;
use dplc_codegen::{column_chunk_kernel, column_chunks, COLUMN_CHUNK};

impl<'a, B: Backend> Executor<'a, B> {
    /// A fused attention backward: the passes whose gradients are wanted,
    /// each writing its gradients whole into zeroed buffers of its operands'.
    fn attention_backward(
        &self,
        be: &mut B,
        run: &RegionRun<B>,
        grads: &mut HashMap<TensorId, Val<B>>,
        at: &FusedAttention,
        layer: u64,
    ) -> Result<()> {
        let Some(dout) = grads.get(&self.base(at.out)).cloned() else {
            return Ok(());
        };
        let k = &at.kernel;
        let args = self.sized_args(&at.sizes, &at.key_sizes, layer);
        let wants = [
            AttentionBuffer::Q,
            AttentionBuffer::K,
            AttentionBuffer::V,
            AttentionBuffer::Bias,
        ]
        .map(|r| at.tensor(r).is_some_and(|t| self.fused.grad.needs_grad(t)));
        let lse =
            run.side.get(&at.out).cloned().ok_or_else(|| {
                kernel_err("fused backward", "an attention without its log-sum-exp")
            })?;
        // The passes' own values, made by the first pass that binds each:
        // δ of every query row (the dQ or δ pass writes it, the passes by
        // key tiles read it) and the one-pass backward's sum of dQ (zeroed:
        // its pass adds into it).
        let mut scratch: HashMap<AttentionBuffer, B::Buf> = HashMap::new();
        let backward = attention_backward(k, be.dtype());
        for pass in k.passes(backward) {
            if pass == AttentionPass::Forward || !k.runs(pass, wants) {
                continue;
            }
            let mut bufs = Vec::new();
            let mut made = Vec::new();
            for (role, spec) in k.roles(pass).into_iter().zip(k.buffers(pass)) {
                let len = args.len_of(&spec);
                let v = match role {
                    AttentionBuffer::LogSumExp => lse.clone(),
                    AttentionBuffer::Delta | AttentionBuffer::QGradSum => {
                        let buf = match scratch.get(&role) {
                            Some(b) => b.clone(),
                            None if k.written_whole(role, &args, len) => {
                                be.alloc(spec.elem, len)?
                            }
                            None => be.zeros(spec.elem, len)?,
                        };
                        scratch.insert(role, buf.clone());
                        Val {
                            buf,
                            elem: spec.elem,
                            len,
                        }
                    }
                    AttentionBuffer::OutGrad => self.as_elem(be, &dout, Elem::Float)?,
                    AttentionBuffer::QGrad
                    | AttentionBuffer::KGrad
                    | AttentionBuffer::VGrad
                    | AttentionBuffer::BiasGrad => {
                        // Zeros unless the pass writes the whole buffer.
                        let v: Val<B> = Val {
                            buf: if k.written_whole(role, &args, len) {
                                be.alloc(spec.elem, len)?
                            } else {
                                be.zeros(spec.elem, len)?
                            },
                            elem: spec.elem,
                            len,
                        };
                        made.push((at.tensor(role).expect("an operand's gradient"), v.clone()));
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
            for (t, g) in made {
                if self.fused.grad.needs_grad(t) {
                    self.add_grad(be, grads, t, g)?;
                }
            }
        }
        Ok(())
    }

    /// Forget what a backward step was the last to read: the gradients of
    /// `step`'s outputs (no other step reads them; a view's gradient is its
    /// base's, which the base's own step reads) and the saved values no
    /// later backward step reads (`free`). Holding them kept every
    /// intermediate gradient and activation of a region alive to the
    /// region's end; autograd frees both as it goes.
    fn done_with(
        &self,
        run: &mut RegionRun<B>,
        grads: &mut HashMap<TensorId, Val<B>>,
        step: &Step,
        free: &[TensorId],
    ) {
        for t in step_outputs(self.graph, step) {
            if self.base(t) == t {
                grads.remove(&t);
            }
        }
        for t in free {
            run.values.remove(t);
        }
    }

    /// Add `g` to the gradient of `t` (it becomes the gradient when there is none).
    pub(super) fn add_grad(
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
    pub fn backward(
        &self,
        be: &mut B,
        r: RegionId,
        run: &mut RegionRun<B>,
        grads: &mut HashMap<TensorId, Val<B>>,
        layer: u64,
        params: &ParamBufs<B>,
    ) -> Result<()> {
        self.backward_steps(be, r, run, grads, layer, params, None)?;
        Ok(())
    }

    /// One pipeline chunk of the root backward, after [`Executor::forward_chunk`].
    /// `received` are the gradients the next chunk sent back (those of what
    /// this chunk sent, in its order), or `None` on the last chunk, whose
    /// loss is seeded with `loss_scale`. Returns what this chunk sends back
    /// for what it received (nothing on the first chunk).
    #[allow(clippy::too_many_arguments)]
    pub fn backward_chunk(
        &self,
        be: &mut B,
        span: &ChunkSpan,
        run: &mut RegionRun<B>,
        received: Option<Vec<Option<Val<B>>>>,
        extras: &[TensorId],
        loss_scale: f32,
        params: &ParamBufs<B>,
    ) -> Result<Vec<Option<Val<B>>>> {
        let r = self.graph.root();
        let mut grads: HashMap<TensorId, Val<B>> = HashMap::new();
        match received {
            None => {
                let loss_t = *self
                    .graph
                    .outputs()
                    .first()
                    .ok_or_else(|| kernel_err("fused", "the model returns nothing"))?;
                let elem = dplc_codegen::tensor_elem(self.graph.tensor(loss_t));
                let seed = Val {
                    buf: be.upload(elem, &[loss_scale])?,
                    elem,
                    len: 1,
                };
                grads.insert(self.base(loss_t), seed);
            }
            Some(msg) => {
                let rep = span
                    .sends
                    .ok_or_else(|| kernel_err("fused", "gradients reached the last chunk"))?;
                let outs = &self.graph.node(rep).outputs;
                if msg.len() != outs.len() + extras.len() {
                    return Err(kernel_err(
                        "recv",
                        format!(
                            "{} gradients arrived for {}",
                            msg.len(),
                            outs.len() + extras.len()
                        ),
                    ));
                }
                for (&t, g) in outs.iter().chain(extras).zip(msg) {
                    if let Some(g) = g {
                        self.add_grad(be, &mut grads, t, g)?;
                    }
                }
            }
        }
        let carried = self.backward_steps(be, r, run, &mut grads, 0, params, Some(span))?;
        let Some((rep, continues)) = span.receives else {
            return Ok(Vec::new());
        };
        let outs = &self.graph.node(rep).outputs;
        let mut out = if continues {
            carried
        } else {
            outs.iter().map(|&t| grads.remove(&self.base(t))).collect()
        };
        for t in extras {
            out.push(if outs.contains(t) {
                None
            } else {
                grads.remove(&self.base(*t))
            });
        }
        Ok(out)
    }

    /// The backward of region `r`'s steps; on the root of a pipeline chunk
    /// (`span`), those it runs only, returning the gradients of the carried
    /// values of the stack it continues from the previous chunk.
    #[allow(clippy::too_many_arguments)]
    fn backward_steps(
        &self,
        be: &mut B,
        r: RegionId,
        run: &mut RegionRun<B>,
        grads: &mut HashMap<TensorId, Val<B>>,
        layer: u64,
        params: &ParamBufs<B>,
        span: Option<&ChunkSpan>,
    ) -> Result<Vec<Option<Val<B>>>> {
        let (plan, back) = self.plan(r)?;
        self.recompute_dropped(be, r, run, layer)?;
        let lifetimes = self
            .fused
            .lifetimes
            .get(&r)
            .ok_or_else(|| kernel_err("fused", format!("region {r} has no plan")))?;
        let free_after = &lifetimes.free_after_backward;
        let mut carried_out = Vec::new();
        for (bi, bstep) in back.iter().enumerate() {
            let at = match bstep {
                BackwardStep::Kernel { step, .. }
                | BackwardStep::MatMul { step }
                | BackwardStep::Attention { step }
                | BackwardStep::Extern { step, .. } => *step,
            };
            if let Some(span) = span {
                if !self.runs_step(span, &plan.steps[at])? {
                    continue;
                }
            }
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
                            GradBinding::RowStats => {
                                run.side.get(&side_key(k)?).cloned().ok_or_else(|| {
                                    kernel_err(
                                        "fused backward",
                                        format!(
                                            "kernel {} without its row statistics",
                                            k.kernel.op
                                        ),
                                    )
                                })?
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
                            // Every element written: a plain gradient, or
                            // each point's share for a column sum (one plain
                            // store a point of the forward's iteration space).
                            GradBinding::InputGrad(_) | GradBinding::Partial(_) => Val {
                                buf: be.alloc(kb.elem, len)?,
                                elem: kb.elem,
                                len,
                            },
                            GradBinding::InputGradAccumulate(_) => Val {
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
                                let (rows, cols) = match cs.sizes(&args.sizes)[..] {
                                    [rows, cols] => (rows, cols),
                                    _ => {
                                        return Err(kernel_err(
                                            "fused backward",
                                            "a column sum of other than rows and columns",
                                        ))
                                    }
                                };
                                let len = cols.max(0) as usize;
                                let out: Val<B> = Val {
                                    buf: be.alloc(Elem::Float, len)?,
                                    elem: Elem::Float,
                                    len,
                                };
                                column_sum(be, &cs.kernel, v.buf, (rows, cols), &out.buf)?;
                                self.add_grad(be, grads, k.buffers[j], out)?;
                            }
                            GradBinding::Forward(_)
                            | GradBinding::OutputGrad(_)
                            | GradBinding::RowStats => {}
                        }
                    }
                }
                BackwardStep::Attention { step } => {
                    let Step::Attention(at) = &plan.steps[*step] else {
                        return Err(kernel_err(
                            "fused backward",
                            "an attention step that is not one",
                        ));
                    };
                    self.attention_backward(be, run, grads, at, layer)?;
                }
                BackwardStep::MatMul { step } => {
                    let Step::MatMul { node, a, b } = &plan.steps[*step] else {
                        return Err(kernel_err(
                            "fused backward",
                            "a matmul step that is not one",
                        ));
                    };
                    // A gathered input the forward let go: gathered again
                    // from the shard it kept (the first of its readers).
                    for t in [self.base(a.tensor), self.base(b.tensor)] {
                        if let Some(&gather) = lifetimes.regather.get(&t) {
                            if !run.values.contains_key(&t) {
                                self.host_forward(be, run, gather)?;
                            }
                        }
                    }
                    self.matmul_backward(be, run, grads, *node, a, b)?;
                }
                BackwardStep::Extern { step, .. } => {
                    let Step::Extern { node, .. } = &plan.steps[*step] else {
                        return Err(kernel_err(
                            "fused backward",
                            "an extern step that is not one",
                        ));
                    };
                    if !matches!(self.graph.node(*node).op, Op::Repeat { .. }) {
                        match self.vocab_on_device(*node) {
                            Some(v) => self.vocab_backward(be, run, grads, *node, v)?,
                            None if self.moe_on_device(*node) => {
                                self.moe_backward(be, run, grads, *node)?
                            }
                            None => self.host_backward(be, run, grads, *node)?,
                        }
                        self.done_with(run, grads, &plan.steps[at], &free_after[bi]);
                        continue;
                    }
                    let (count, _, _) = self.repeat_parts(*node)?;
                    let (layers, continued) = match span {
                        Some(span) if span.nodes.is_some() => (
                            span.stacks[node].clone(),
                            span.receives == Some((*node, true)),
                        ),
                        _ => (0..count, false),
                    };
                    let carried = self.backward_repeat(be, run, grads, *node, layers, params)?;
                    if !continued {
                        let inputs = &self.graph.node(*node).inputs;
                        for (&t, g) in inputs.iter().zip(carried) {
                            if let Some(g) = g {
                                self.add_grad(be, grads, t, g)?;
                            }
                        }
                    } else {
                        carried_out = carried;
                    }
                }
            }
            self.done_with(run, grads, &plan.steps[at], &free_after[bi]);
        }
        for (p, t) in self.param_nodes(r) {
            if let Some(g) = grads.remove(&t) {
                let key = ParamKey { param: p, layer };
                let acc = params.grads.borrow().get(&key).cloned().ok_or_else(|| {
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
        Ok(carried_out)
    }

    fn matmul_backward(
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
    fn reduced_matmul(
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
        column_sum(
            be,
            &column_sum_kernel(),
            shares.buf,
            (g.batch as i64, per as i64),
            &out,
        )?;
        Ok(Val {
            buf: out,
            elem: Elem::Float,
            len: per,
        })
    }

    /// The backward of layers `layers` of repeat `n` (as its forward ran
    /// them), from the gradients of its outputs in `grads`; adds its captured
    /// inputs' gradients to `grads` and returns its carried inputs'.
    fn backward_repeat(
        &self,
        be: &mut B,
        run: &mut RegionRun<B>,
        grads: &mut HashMap<TensorId, Val<B>>,
        n: NodeId,
        layers: std::ops::Range<u64>,
        params: &ParamBufs<B>,
    ) -> Result<Vec<Option<Val<B>>>> {
        let (_, body, n_carried) = self.repeat_parts(n)?;
        let node = self.graph.node(n);
        // Taken out of the run: each layer's activations are freed after its backward.
        let mut runs = run
            .repeats
            .remove(&n)
            .ok_or_else(|| kernel_err("fused backward", "a repeat without its forward"))?;
        if runs.len() as u64 != layers.end - layers.start {
            return Err(kernel_err(
                "fused backward",
                format!("{} layers ran forward, {layers:?} go back", runs.len()),
            ));
        }
        let mut carried: Vec<Option<Val<B>>> = node
            .outputs
            .iter()
            .map(|&t| grads.remove(&self.base(t)))
            .collect();
        let region = self.graph.region(body);
        while let Some(layer_run) = runs.pop() {
            let layer = layers.start + runs.len() as u64;
            self.layer_hook(n, layer, true, true)?;
            let mut body_run = match layer_run {
                LayerRun::Kept(mut r) => {
                    self.bind_params(body, &mut r, layer, params);
                    r
                }
                LayerRun::Checkpoint(args) => {
                    self.forward(be, body, args, &HashMap::new(), layer, params)?
                }
            };
            let mut body_grads: HashMap<TensorId, Val<B>> = HashMap::new();
            for (&t, g) in region.results.iter().zip(carried.iter_mut()) {
                if let Some(g) = g.take() {
                    self.add_grad(be, &mut body_grads, t, g)?;
                }
            }
            self.backward(be, body, &mut body_run, &mut body_grads, layer, params)?;
            for (j, &a) in region.args.iter().enumerate() {
                let g = body_grads.remove(&a);
                if j < n_carried {
                    carried[j] = g;
                } else if let Some(g) = g {
                    self.add_grad(be, grads, node.inputs[j], g)?;
                }
            }
            // Its weights and gradients leave before the next layer's come.
            drop(body_run);
            self.layer_hook(n, layer, true, false)?;
        }
        carried.truncate(n_carried);
        Ok(carried)
    }
}

/// The column sums of `rows × cols` f32 `shares` into `out` by `sum` (a
/// column-sum kernel, whose output type is its own): in two passes where
/// the rows are many ([`column_chunks`]), each chunk's sums first.
fn column_sum<B: Backend>(
    be: &mut B,
    sum: &dplc_codegen::Kernel,
    shares: B::Buf,
    (rows, cols): (i64, i64),
    out: &B::Buf,
) -> Result<()> {
    let (shares, rows) = match column_chunks(rows) {
        Some(chunks) => {
            let part = be.alloc(Elem::F32, (chunks * cols).max(0) as usize)?;
            be.launch(
                &column_chunk_kernel(),
                &Args {
                    sizes: vec![rows, cols, COLUMN_CHUNK, chunks],
                    ..Args::default()
                },
                &[shares, part.clone()],
            )?;
            (part, chunks)
        }
        None => (shares, rows),
    };
    be.launch(
        sum,
        &Args {
            sizes: vec![rows, cols],
            ..Args::default()
        },
        &[shares, out.clone()],
    )
}

#[cfg(test)]
mod tests {
    use super::column_sum;
    use crate::fused::{Backend, HostBackend};
    use dplc_codegen::{column_sum_kernel, Elem};

    /// A column sum over more rows than a chunk (two passes: each chunk's
    /// sums, then theirs) equals the sum in f64, the last chunk short.
    #[test]
    fn a_long_column_sum_takes_two_passes_to_the_same_sums() {
        let (rows, cols) = (2 * dplc_codegen::COLUMN_CHUNK + 37, 5);
        let shares: Vec<f32> = (0..rows * cols)
            .map(|i| ((i * 7919) % 13) as f32 - 6.0 + 0.25 * (i % 3) as f32)
            .collect();
        let mut be = HostBackend::new();
        let buf = be.upload(Elem::F32, &shares).unwrap();
        let out = be.alloc(Elem::F32, cols as usize).unwrap();
        let mut sum = column_sum_kernel();
        sum.buffers[1].elem = Elem::F32;
        column_sum(&mut be, &sum, buf, (rows, cols), &out).unwrap();
        let got = be.download(&out, Elem::F32, cols as usize).unwrap();
        for c in 0..cols as usize {
            let want: f64 = (0..rows as usize)
                .map(|r| f64::from(shares[r * cols as usize + c]))
                .sum();
            assert!(
                (f64::from(got[c]) - want).abs() <= 1e-6 * want.abs().max(1.0),
                "column {c}: {} against {want}",
                got[c]
            );
        }
    }
}
