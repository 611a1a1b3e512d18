//! The ops over a vocabulary split across the tensor-parallel group
//! (`Op::VocabParallel`: Megatron's vocabulary-parallel embedding and
//! cross-entropy) on the device: each rank's slice by the kernels of
//! `dplc_codegen::vocab_*`, the group's exchanges in between (a few bytes
//! a row) through [`VocabGroup`]. The math is `crate::vocab`'s, which the
//! reference executor runs on the host; there the fused compute ran too,
//! downloading every rank's slice of the logits each step.

use super::*;
use dplc_codegen::{
    vocab_embedding_backward_kernel, vocab_embedding_kernel, vocab_normalize_backward_kernel,
    vocab_normalize_kernel, vocab_row_stats_kernel, vocab_row_sum_kernel,
    vocab_take_backward_kernel, vocab_take_kernel,
};
use dplc_ir::VocabOp;

fn sized(sizes: &[usize]) -> Args {
    Args {
        sizes: sizes.iter().map(|&s| s as i64).collect(),
        ..Args::default()
    }
}

impl<'a, B: Backend> Executor<'a, B> {
    /// Whether node `node`, an op over a split vocabulary, runs on the
    /// device: all do but a softmax over another axis than the last (the
    /// vocabulary is the last axis wherever the zoo splits it).
    pub(super) fn vocab_on_device(&self, node: NodeId) -> Option<VocabOp> {
        let n = self.graph.node(node);
        match n.op {
            Op::VocabParallel(v @ (VocabOp::Softmax { axis } | VocabOp::LogSoftmax { axis })) => {
                (axis + 1 == self.dims(n.inputs[0]).len()).then_some(v)
            }
            Op::VocabParallel(v) => Some(v),
            _ => None,
        }
    }

    /// The ids of pick or embedding node `node` (input `dims`) and this
    /// rank's first index along the split axis — the table's rows, or the
    /// pick's last axis — checked to be one id a row, as the kernels index.
    fn picks(
        &self,
        run: &RegionRun<B>,
        node: NodeId,
        v: VocabOp,
        dims: &[usize],
    ) -> Result<(Val<B>, usize)> {
        let n = self.graph.node(node);
        let ids = self.get(run, n.inputs[1])?;
        let values: usize = dims.iter().product();
        let (split, fits) = match (v, dims) {
            (VocabOp::Embedding, &[rows, _]) => (rows, true),
            (VocabOp::TakeAlong, &[.., last]) => (last, ids.len * last == values),
            _ => (0, false),
        };
        if !fits {
            return Err(kernel_err(
                "vocab_parallel",
                format!(
                    "{v:?} of shape {dims:?} with {} ids: not one id a row",
                    ids.len
                ),
            ));
        }
        let (lo, _) = self.host(node)?.vocab().slice(split);
        Ok((ids, lo))
    }

    fn float(&self, be: &mut B, len: usize) -> Result<Val<B>> {
        Ok(Val {
            buf: be.alloc(Elem::Float, len)?,
            elem: Elem::Float,
            len,
        })
    }

    /// Node `node`'s output (`v`, this rank's share) from its inputs.
    pub(super) fn vocab_forward(
        &self,
        be: &mut B,
        run: &mut RegionRun<B>,
        node: NodeId,
        v: VocabOp,
    ) -> Result<()> {
        let n = self.graph.node(node);
        let x = self.as_elem(be, &self.get(run, n.inputs[0])?, Elem::Float)?;
        let dims = self.dims(n.inputs[0]);
        let last = *dims
            .last()
            .ok_or_else(|| kernel_err("vocab_parallel", "an input without axes"))?;
        let y = match v {
            VocabOp::Embedding => {
                let (vocab, width) = (dims[0], last);
                let (ids, lo) = self.picks(run, node, v, &dims)?;
                let y = self.float(be, ids.len * width)?;
                be.launch(
                    &vocab_embedding_kernel(),
                    &sized(&[ids.len, vocab, lo, width]),
                    &[x.buf, ids.buf, y.buf.clone()],
                )?;
                y
            }
            VocabOp::TakeAlong => {
                let (ids, lo) = self.picks(run, node, v, &dims)?;
                let y = self.float(be, ids.len)?;
                be.launch(
                    &vocab_take_kernel(),
                    &sized(&[ids.len, last, lo]),
                    &[x.buf, ids.buf, y.buf.clone()],
                )?;
                y
            }
            VocabOp::Softmax { .. } | VocabOp::LogSoftmax { .. } => {
                let log = matches!(v, VocabOp::LogSoftmax { .. });
                let rows = x.len / last.max(1);
                let args = sized(&[rows, last]);
                let stats = be.alloc(Elem::F32, 2 * rows)?;
                be.launch(
                    &vocab_row_stats_kernel(),
                    &args,
                    &[x.buf.clone(), stats.clone()],
                )?;
                let mine = be.download(&stats, Elem::F32, 2 * rows)?;
                let all = self.host(node)?.vocab().row_stats(&mine)?;
                let stats = be.upload(Elem::F32, &all)?;
                let y = self.float(be, x.len)?;
                be.launch(
                    &vocab_normalize_kernel(log),
                    &args,
                    &[x.buf, stats, y.buf.clone()],
                )?;
                y
            }
        };
        run.values.insert(n.outputs[0], y);
        Ok(())
    }

    /// The gradient of node `node`'s first input (the only one that has
    /// one), added into `grads`, from what its forward kept.
    pub(super) fn vocab_backward(
        &self,
        be: &mut B,
        run: &RegionRun<B>,
        grads: &mut HashMap<TensorId, Val<B>>,
        node: NodeId,
        v: VocabOp,
    ) -> Result<()> {
        let n = self.graph.node(node);
        let Some(g) = grads.remove(&self.base(n.outputs[0])) else {
            return Ok(());
        };
        if !self.fused.grad.needs_grad(n.inputs[0]) {
            return Ok(());
        }
        // The gradient as floats, its other handle let go.
        let g = {
            let taken = g;
            self.as_elem(be, &taken, Elem::Float)?
        };
        let dims = self.dims(n.inputs[0]);
        let last = *dims
            .last()
            .ok_or_else(|| kernel_err("vocab_parallel", "an input without axes"))?;
        let dx = match v {
            VocabOp::Embedding => {
                let (vocab, width) = (dims[0], last);
                let (ids, lo) = self.picks(run, node, v, &dims)?;
                let len = vocab * width;
                let dt: Val<B> = Val {
                    buf: be.zeros(Elem::F32, len)?,
                    elem: Elem::F32,
                    len,
                };
                be.launch(
                    &vocab_embedding_backward_kernel(),
                    &sized(&[ids.len, vocab, lo, width]),
                    &[ids.buf, g.buf, dt.buf.clone()],
                )?;
                dt
            }
            VocabOp::TakeAlong => {
                let (ids, lo) = self.picks(run, node, v, &dims)?;
                let dx = self.float(be, ids.len * last)?;
                be.launch(
                    &vocab_take_backward_kernel(),
                    &sized(&[ids.len, last, lo]),
                    &[ids.buf, g.buf, dx.buf.clone()],
                )?;
                dx
            }
            VocabOp::Softmax { .. } | VocabOp::LogSoftmax { .. } => {
                let log = matches!(v, VocabOp::LogSoftmax { .. });
                let y = self.as_elem(be, &self.get(run, n.outputs[0])?, Elem::Float)?;
                let rows = y.len / last.max(1);
                let args = sized(&[rows, last]);
                let sums = be.alloc(Elem::F32, rows)?;
                let reads = if log {
                    vec![g.buf.clone(), sums.clone()]
                } else {
                    vec![g.buf.clone(), y.buf.clone(), sums.clone()]
                };
                be.launch(&vocab_row_sum_kernel(log), &args, &reads)?;
                drop(reads);
                let mut all = be.download(&sums, Elem::F32, rows)?;
                self.host(node)?.vocab().row_sums(&mut all)?;
                let sums = be.upload(Elem::F32, &all)?;
                // Written over the output gradient where no other value
                // holds it (each element read and written by one thread):
                // the backward then holds two tensors of the slice's
                // logits, the kept output and this, as the plan prices the
                // loss's working set — not three.
                let dx = if B::unique(&g.buf) {
                    g.clone()
                } else {
                    self.float(be, y.len)?
                };
                be.launch(
                    &vocab_normalize_backward_kernel(log),
                    &args,
                    &[g.buf, y.buf, sums, dx.buf.clone()],
                )?;
                dx
            }
        };
        self.add_grad(be, grads, n.inputs[0], dx)
    }
}
