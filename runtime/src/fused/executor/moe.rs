//! Mixture-of-experts routing on the device: top-k over the experts,
//! dispatch of tokens to the experts' slots and their combination back,
//! forward and backward, by the kernels of `dplc_codegen::moe_*`. Which
//! slot each choice takes is the reference's own routing
//! (`crate::kernels::moe_slots`, first come first served up to the
//! capacity), made on the host from the choices (4 bytes a choice) and
//! handed to the kernels as two tables, made once a layer (kept in the
//! run for the layer's other routing steps and backwards); the tokens and
//! the experts' outputs stay on the device. Before, each MoE layer downloaded its router
//! scores, tokens and experts' outputs and ran the reference kernels.

use super::*;
use dplc_codegen::{
    moe_combine_backward_kernel, moe_combine_kernel, moe_combine_weights_backward_kernel,
    moe_dispatch_backward_kernel, moe_dispatch_kernel, moe_top_k_backward_kernel, moe_top_k_kernel,
};

fn sized(sizes: &[usize]) -> Args {
    Args {
        sizes: sizes.iter().map(|&s| s as i64).collect(),
        ..Args::default()
    }
}

/// A routing's tables on the device: each choice's slot (`e·capacity + c`,
/// or −1 when dropped) and each slot's choice (or −1 when empty).
pub(super) struct Routing<B: Backend> {
    slot_of: Val<B>,
    token_of: Val<B>,
}

impl<B: Backend> Clone for Routing<B> {
    fn clone(&self) -> Self {
        Routing {
            slot_of: self.slot_of.clone(),
            token_of: self.token_of.clone(),
        }
    }
}

impl<'a, B: Backend> Executor<'a, B> {
    /// Whether node `node` is routing the device runs (all of it).
    pub(super) fn moe_on_device(&self, node: NodeId) -> bool {
        matches!(
            self.graph.node(node).op,
            Op::TopK { .. } | Op::MoeDispatch { .. } | Op::MoeCombine
        )
    }

    /// The routing of choices tensor `t` (`[tokens, k]`) over the experts'
    /// slots (`slots` dims `[experts, capacity, d]`): the one `run` made
    /// from it, else made now.
    fn routing(
        &self,
        be: &mut B,
        run: &RegionRun<B>,
        t: TensorId,
        slots: &[usize],
    ) -> Result<Routing<B>> {
        if let Some(r) = run.routes.get(&self.base(t)) {
            return Ok(r.clone());
        }
        let &[experts, capacity, _] = slots else {
            return Err(kernel_err(
                "moe",
                format!("expert slots of shape {slots:?}"),
            ));
        };
        let idx = self.get(run, t)?;
        let choices = be.download_i32(&idx.buf, idx.len)?;
        let mut slot_of = vec![-1i32; choices.len()];
        let mut token_of = vec![-1i32; experts * capacity];
        let routed = crate::kernels::moe_slots(&choices, experts, capacity)?;
        for (j, slot) in routed.into_iter().enumerate() {
            if let Some((e, c)) = slot {
                let s = e * capacity + c;
                slot_of[j] = s as i32;
                token_of[s] = j as i32;
            }
        }
        let up = |be: &mut B, v: &[i32]| -> Result<Val<B>> {
            Ok(Val {
                buf: be.upload_i32(v)?,
                elem: Elem::I32,
                len: v.len(),
            })
        };
        Ok(Routing {
            slot_of: up(be, &slot_of)?,
            token_of: up(be, &token_of)?,
        })
    }

    fn alloc_of(&self, be: &mut B, elem: Elem, len: usize) -> Result<Val<B>> {
        Ok(Val {
            buf: be.alloc(elem, len)?,
            elem,
            len,
        })
    }

    /// Node `node`'s outputs from its inputs.
    pub(super) fn moe_forward(
        &self,
        be: &mut B,
        run: &mut RegionRun<B>,
        node: NodeId,
    ) -> Result<()> {
        let n = self.graph.node(node);
        let input = |i: usize| -> Result<(Val<B>, Vec<usize>)> {
            Ok((self.get(run, n.inputs[i])?, self.dims(n.inputs[i])))
        };
        match n.op {
            Op::TopK { k } => {
                let (x, dims) = input(0)?;
                let (k, width) = (k as usize, dims.last().copied().unwrap_or(1).max(1));
                let rows = x.len / width;
                let values = self.alloc_of(be, Elem::Float, rows * k)?;
                let indices = self.alloc_of(be, Elem::I32, rows * k)?;
                be.launch(
                    &moe_top_k_kernel(k),
                    &sized(&[rows, width]),
                    &[x.buf, values.buf.clone(), indices.buf.clone()],
                )?;
                run.values.insert(n.outputs[0], values);
                run.values.insert(n.outputs[1], indices);
            }
            Op::MoeDispatch { .. } => {
                let (x, x_dims) = input(0)?;
                let idx_dims = self.dims(n.inputs[1]);
                let slots = self.dims(n.outputs[0]);
                let (tokens, k, width) = (x_dims[0], idx_dims[1], slots[2]);
                let routing = self.routing(be, run, n.inputs[1], &slots)?;
                run.routes.insert(self.base(n.inputs[1]), routing.clone());
                let out = self.alloc_of(be, Elem::Float, slots.iter().product())?;
                be.launch(
                    &moe_dispatch_kernel(k),
                    &sized(&[slots[0] * slots[1], width, tokens]),
                    &[x.buf, routing.token_of.buf, out.buf.clone()],
                )?;
                run.values.insert(n.outputs[0], out);
            }
            Op::MoeCombine => {
                let ((y, slots), (w, w_dims)) = (input(0)?, input(1)?);
                let (tokens, k, width) = (w_dims[0], w_dims[1], slots[2]);
                let routing = self.routing(be, run, n.inputs[2], &slots)?;
                run.routes.insert(self.base(n.inputs[2]), routing.clone());
                let out = self.alloc_of(be, Elem::Float, tokens * width)?;
                be.launch(
                    &moe_combine_kernel(k),
                    &sized(&[tokens, width, slots[0] * slots[1]]),
                    &[y.buf, w.buf, routing.slot_of.buf, out.buf.clone()],
                )?;
                run.values.insert(n.outputs[0], out);
            }
            ref op => return Err(kernel_err("moe", format!("{} is not routing", op.name()))),
        }
        Ok(())
    }

    /// Node `node`'s input gradients from its output gradient in `grads`,
    /// reading what its forward kept (the activation rule's values).
    pub(super) fn moe_backward(
        &self,
        be: &mut B,
        run: &RegionRun<B>,
        grads: &mut HashMap<TensorId, Val<B>>,
        node: NodeId,
    ) -> Result<()> {
        let n = self.graph.node(node);
        // Only the first output carries a gradient (top-k's indices none).
        for &t in &n.outputs[1..] {
            grads.remove(&self.base(t));
        }
        let Some(g) = grads.remove(&self.base(n.outputs[0])) else {
            return Ok(());
        };
        let g = self.as_elem(be, &g, Elem::Float)?;
        let needs = |i: usize| self.fused.grad.needs_grad(n.inputs[i]);
        match n.op {
            Op::TopK { k } if needs(0) => {
                let dims = self.dims(n.inputs[0]);
                let (k, width) = (k as usize, dims.last().copied().unwrap_or(1).max(1));
                let idx = self.get(run, n.outputs[1])?;
                let rows = idx.len / k.max(1);
                let dx = self.alloc_of(be, Elem::Float, rows * width)?;
                be.launch(
                    &moe_top_k_backward_kernel(k),
                    &sized(&[rows, width]),
                    &[idx.buf, g.buf, dx.buf.clone()],
                )?;
                self.add_grad(be, grads, n.inputs[0], dx)?;
            }
            Op::MoeDispatch { .. } if needs(0) => {
                let slots = self.dims(n.outputs[0]);
                let idx_dims = self.dims(n.inputs[1]);
                let (tokens, k, width) = (idx_dims[0], idx_dims[1], slots[2]);
                let routing = self.routing(be, run, n.inputs[1], &slots)?;
                let dx = self.alloc_of(be, Elem::Float, tokens * width)?;
                be.launch(
                    &moe_dispatch_backward_kernel(k),
                    &sized(&[tokens, width, slots[0] * slots[1]]),
                    &[routing.slot_of.buf, g.buf, dx.buf.clone()],
                )?;
                self.add_grad(be, grads, n.inputs[0], dx)?;
            }
            Op::MoeCombine if needs(0) || needs(1) => {
                let slots = self.dims(n.inputs[0]);
                let w_dims = self.dims(n.inputs[1]);
                let (tokens, k, width) = (w_dims[0], w_dims[1], slots[2]);
                let n_slots = slots[0] * slots[1];
                let routing = self.routing(be, run, n.inputs[2], &slots)?;
                if needs(0) {
                    let w = self.get(run, n.inputs[1])?;
                    let dy = self.alloc_of(be, Elem::Float, n_slots * width)?;
                    be.launch(
                        &moe_combine_backward_kernel(k),
                        &sized(&[n_slots, width, tokens]),
                        &[routing.token_of.buf, w.buf, g.buf.clone(), dy.buf.clone()],
                    )?;
                    self.add_grad(be, grads, n.inputs[0], dy)?;
                }
                if needs(1) {
                    let y = self.get(run, n.inputs[0])?;
                    let dw = self.alloc_of(be, Elem::Float, tokens * k)?;
                    be.launch(
                        &moe_combine_weights_backward_kernel(k),
                        &sized(&[tokens * k, width, n_slots, tokens]),
                        &[routing.slot_of.buf, g.buf, y.buf, dw.buf.clone()],
                    )?;
                    self.add_grad(be, grads, n.inputs[1], dw)?;
                }
            }
            _ => {}
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fused::HostBackend;
    use crate::kernels::{DropoutKey, OpCtx};

    /// The top-k kernel picks what the reference's stable sort picks,
    /// equal scores by lower index first — except that the reference puts
    /// `+0` before `−0`, which the kernel counts as equal (the README says
    /// so; this pins both).
    #[test]
    fn top_k_breaks_ties_as_the_reference_does_but_for_signed_zeros() {
        let rows: [[f32; 5]; 4] = [
            [0.5, 2.0, 2.0, -1.0, 2.0],
            [3.0, 1.0, 3.0, 3.0, 0.0],
            [-1.0, -1.0, -1.0, -1.0, -1.0],
            [-0.0, 0.0, -2.0, -3.0, -4.0],
        ];
        let x: Vec<f32> = rows.iter().flatten().copied().collect();
        let mut be = HostBackend::new();
        let buf = be.upload(Elem::Float, &x).unwrap();
        let values = be.alloc(Elem::Float, 8).unwrap();
        let indices = be.alloc(Elem::I32, 8).unwrap();
        be.launch(
            &moe_top_k_kernel(2),
            &sized(&[4, 5]),
            &[buf, values.clone(), indices.clone()],
        )
        .unwrap();
        let got = be.download_i32(&indices, 8).unwrap();

        let input = crate::tensor::Tensor::f32(vec![4, 5], x);
        let shapes = [vec![4, 2], vec![4, 2]];
        let ctx = OpCtx {
            out_shapes: &shapes,
            dropout: DropoutKey::NONE,
            split: None,
        };
        let want = crate::kernels::forward(&Op::TopK { k: 2 }, &[&input], &ctx).unwrap();
        let want = want[1].i().unwrap();
        // Every row with the reference, but the signed zeros' order.
        assert_eq!(got[..6], want[..6]);
        assert_eq!(got[6..], [0, 1]);
        assert_eq!(want[6..], [1, 0]);
        assert_eq!(
            be.download(&values, Elem::Float, 6).unwrap(),
            [2.0, 2.0, 3.0, 3.0, -1.0, -1.0]
        );
    }
}
