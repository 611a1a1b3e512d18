//! The steps handed to the caller's [`HostSteps`]: a layout change, on
//! the device through [`HostSteps::relayout`] (indices on the host), and
//! the rest — what no kernel runs — on the host, their values crossing as
//! tensors at the local program's shapes, forward and backward.

use super::*;

impl<'a, B: Backend> Executor<'a, B> {
    pub(super) fn host(
        &self,
        node: NodeId,
    ) -> Result<std::cell::RefMut<'_, &'a mut dyn HostSteps<B>>> {
        self.host.as_ref().map(RefCell::borrow_mut).ok_or_else(|| {
            RuntimeError::Unsupported(format!(
                "`{}` runs on the host, which this fused run does not provide; run it on the \
                 schedule executor (dplc run --compute fused) or with --compute reference",
                self.graph.node(node).op.name()
            ))
        })
    }

    pub(super) fn to_host(&self, be: &mut B, t: TensorId, v: &Val<B>) -> Result<Tensor> {
        to_host(be, self.graph, &self.syms, t, v)
    }

    /// A layout change of tensor `t`'s value `x` on the device
    /// ([`HostSteps::relayout`]), as a float value of tensor `out`'s shape;
    /// `None` for indices, which change layout on the host.
    fn relayout(
        &self,
        be: &mut B,
        node: NodeId,
        (t, x): (TensorId, Val<B>),
        out: TensorId,
        (from, to): (TensorLayout, TensorLayout),
    ) -> Result<Option<Val<B>>> {
        if x.elem == Elem::I32 {
            return Ok(None);
        }
        let v = Shaped {
            val: x,
            dims: self.dims(t),
        };
        let got = self.host(node)?.relayout(be, v, from, to)?;
        if got.dims != self.dims(out) {
            return Err(kernel_err(
                "relayout",
                format!(
                    "{from:?} → {to:?} made {:?} where {out} is {:?}",
                    got.dims,
                    self.dims(out)
                ),
            ));
        }
        self.as_elem(be, &got.val, Elem::Float).map(Some)
    }

    /// A host step forward: its inputs down, its outputs up. A layout
    /// change of floats stays on the device ([`Self::relayout`]).
    pub(super) fn host_forward(
        &self,
        be: &mut B,
        run: &mut RegionRun<B>,
        node: NodeId,
    ) -> Result<()> {
        let n = self.graph.node(node);
        if let (Op::Relayout { from, to, .. }, [t], [out]) =
            (&n.op, n.inputs.as_slice(), n.outputs.as_slice())
        {
            let x = self.get(run, *t)?;
            if let Some(v) = self.relayout(be, node, (*t, x), *out, (*from, *to))? {
                run.values.insert(*out, v);
                return Ok(());
            }
        }
        let ins = n
            .inputs
            .iter()
            .map(|&t| self.to_host(be, t, &self.get(run, t)?))
            .collect::<Result<_>>()?;
        let outs = self.host(node)?.forward(node, ins)?;
        for (&t, v) in n.outputs.iter().zip(&outs) {
            let v = to_backend(be, v)?;
            run.values.insert(t, v);
        }
        Ok(())
    }

    /// A host step backward: the gradients of its outputs in `grads` become
    /// those of its inputs.
    pub(super) fn host_backward(
        &self,
        be: &mut B,
        run: &RegionRun<B>,
        grads: &mut HashMap<TensorId, Val<B>>,
        node: NodeId,
    ) -> Result<()> {
        let n = self.graph.node(node);
        // A layout change's gradient changes layout on the device.
        if let (Op::Relayout { from, to, grad }, [t], [out]) =
            (&n.op, n.inputs.as_slice(), n.outputs.as_slice())
        {
            let Some(g) = grads.get(&self.base(*out)).cloned() else {
                return Ok(());
            };
            let target = dplc_ir::TensorLayout::relayout_grad_target(*from, *to);
            if let Some(gin) = self.relayout(be, node, (*out, g), *t, (*grad, target))? {
                grads.remove(&self.base(*out));
                if self.fused.grad.needs_grad(*t) {
                    self.add_grad(be, grads, *t, gin)?;
                }
                return Ok(());
            }
        }
        let mut gouts = Vec::with_capacity(n.outputs.len());
        for &t in &n.outputs {
            gouts.push(match grads.remove(&self.base(t)) {
                Some(g) => Some(self.to_host(be, t, &g)?),
                None => None,
            });
        }
        if gouts.iter().all(Option::is_none) {
            return Ok(());
        }
        // A layout change moves the gradient only; the others read what
        // their forward kept (the activation rule's values). Where the VJP
        // reads only a value's shape (top-k's input), it gets zeros.
        let (ins, outs) = if matches!(n.op, Op::Relayout { .. }) {
            (Vec::new(), Vec::new())
        } else {
            let saved = &self
                .fused
                .lifetimes
                .get(&n.region)
                .ok_or_else(|| kernel_err("fused", format!("region {} has no plan", n.region)))?
                .saved;
            let mut host = |ts: &[TensorId]| -> Result<Vec<Tensor>> {
                ts.iter()
                    .map(|&t| {
                        if saved.contains(&self.base(t)) {
                            return self.to_host(be, t, &self.get(run, t)?);
                        }
                        let dims = self.dims(t);
                        Ok(if self.graph.tensor(t).dtype.is_float() {
                            Tensor::zeros(&dims)
                        } else {
                            let len = dims.iter().product();
                            Tensor::i32(dims, vec![0; len])
                        })
                    })
                    .collect()
            };
            (host(&n.inputs)?, host(&n.outputs)?)
        };
        let gins = self.host(node)?.backward(node, ins, outs, gouts)?;
        for (&t, g) in n.inputs.iter().zip(gins) {
            if let Some(g) = g {
                if self.fused.grad.needs_grad(t) {
                    let g = to_backend(be, &g)?;
                    self.add_grad(be, grads, t, g)?;
                }
            }
        }
        Ok(())
    }
}
