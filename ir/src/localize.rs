//! A rank's local program: the model at the shapes one rank of the tensor-
//! and expert-parallel groups holds, with every layout change its
//! [`ModelLayout`] implies spelled out as an [`Op::Relayout`] node.
//!
//! The reference interpreter runs the global graph and converts a value
//! wherever a node reads it in another layout. Codegen needs the same
//! program with the collectives explicit and every shape local, so that each
//! rank's kernels are fused at the sizes they run at. The two read the same
//! layout through the same rules ([`NodeLayout::grad_contribution`]), so
//! they compute the same function.
//!
//! The model's node and tensor ids are kept (dropout masks are keyed by
//! node); the layout changes get new ids after them. A node that reads the
//! axis it indexes or normalises split over the group becomes an
//! [`Op::VocabParallel`], which, like a layout change, runs over the group.

use crate::{
    GradPlan, Graph, IrError, ModelLayout, NodeLayout, Op, ParamId, Ratio, Result, Shape,
    SplitAxis, TensorId, TensorLayout,
};
use std::collections::HashMap;

/// `graph` as one rank of `layout`'s groups runs it. A graph whose regions
/// the layout leaves out runs those replicated, as the interpreter does.
pub fn localize(graph: &Graph, layout: &ModelLayout) -> Result<Graph> {
    layout.check(graph).map_err(|m| IrError::Invalid {
        op: "localize",
        detail: m.0,
    })?;
    let parts = Parts {
        tp: layout.tp.max(1),
        ep: layout.ep.max(1),
    };
    let mut produced: HashMap<TensorId, TensorLayout> = HashMap::new();
    for r in &layout.regions {
        let reg = graph.region(r.region);
        produced.extend(reg.args.iter().copied().zip(r.args.iter().copied()));
        for nl in &r.nodes {
            let outs = &graph.node(nl.node).outputs;
            produced.extend(outs.iter().copied().zip(nl.outputs.iter().copied()));
        }
    }
    let grads = GradPlan::new(graph);
    let mut local = graph.clone();
    for (&t, &l) in &produced {
        let shape = match graph.producer(t).map(|n| &n.op) {
            Some(Op::Param(p)) => parts.param(graph, layout, *p)?,
            _ => parts.shape(&graph.tensor(t).shape, l)?,
        };
        local.tensor_mut(t).shape = shape;
    }
    for r in &layout.regions {
        let reg = graph.region(r.region);
        let mut order = Vec::with_capacity(reg.nodes.len());
        // One layout change per value, target and gradient layout between
        // two repeats: none crosses a repeat, where a pipeline may cut.
        type Made = HashMap<(TensorId, TensorLayout, TensorLayout), TensorId>;
        let mut made = Made::new();
        for (nl, &n) in r.nodes.iter().zip(&reg.nodes) {
            let node = graph.node(n);
            if matches!(node.op, Op::Repeat { .. }) {
                made.clear();
            }
            // The reshapes and broadcasts name the shape they make.
            match node.op {
                Op::Reshape { .. } => {
                    let shape = local.tensor(node.outputs[0]).shape.clone();
                    local.node_mut(n).op = Op::Reshape { shape };
                }
                Op::Expand { .. } => {
                    let shape = local.tensor(node.outputs[0]).shape.clone();
                    local.node_mut(n).op = Op::Expand { shape };
                }
                // A dropout of this rank's part draws at the whole tensor's
                // places, so the masks are the serial run's.
                Op::Dropout { p, context, .. } => {
                    local.node_mut(n).op = Op::Dropout {
                        p,
                        context,
                        split: nl.outputs[0].split_axis(),
                    };
                }
                _ => {}
            }
            // An op over a split vocabulary needs its group, as a layout
            // change does: it says so in its op.
            if let Some(v) = nl.vocab_op(&node.op) {
                local.node_mut(n).op = Op::VocabParallel(v);
            }
            if !matches!(node.op, Op::Param(_)) {
                for (i, &t) in node.inputs.iter().enumerate() {
                    let have = produced
                        .get(&t)
                        .copied()
                        .unwrap_or(TensorLayout::Replicated);
                    let want = nl.inputs[i];
                    let grad = NodeLayout::grad_contribution(nl, &node.op, i);
                    // A gradient-only change (Megatron's `f`) of a value
                    // without a gradient is no change.
                    let moves_grad = grad != have.grad() && grads.needs_grad(t);
                    if have == want && !moves_grad {
                        continue;
                    }
                    let key = (t, want, grad);
                    let moved = match made.get(&key) {
                        Some(&m) => m,
                        None => {
                            let m = relayout(&mut local, graph, &parts, t, have, want, grad)?;
                            order.push(m.0);
                            made.insert(key, m.1);
                            m.1
                        }
                    };
                    local.node_mut(n).inputs[i] = moved;
                }
            }
            order.push(n);
        }
        let mut results = reg.results.clone();
        for (j, res) in results.iter_mut().enumerate() {
            let have = produced
                .get(res)
                .copied()
                .unwrap_or(TensorLayout::Replicated);
            let want = r.results[j];
            if have != want {
                let (n, moved) =
                    relayout(&mut local, graph, &parts, *res, have, want, want.grad())?;
                order.push(n);
                *res = moved;
            }
        }
        local.region_mut(r.region).nodes = order;
        local.region_mut(r.region).results = results;
    }
    Ok(local)
}

/// A new node of `t`'s region turning `t` from `from` into `to`, unplaced.
fn relayout(
    local: &mut Graph,
    graph: &Graph,
    parts: &Parts,
    t: TensorId,
    from: TensorLayout,
    to: TensorLayout,
    grad: TensorLayout,
) -> Result<(crate::NodeId, TensorId)> {
    let whole = graph.tensor(t);
    let shape = parts.shape(&whole.shape, to)?;
    let region = graph.tensor_region(t);
    let scope = graph
        .producer(t)
        .map_or_else(|| graph.root_scope(), |n| n.scope);
    let (n, outs) = local.push_node_unplaced(
        region,
        scope,
        Op::Relayout { from, to, grad },
        vec![t],
        vec![(whole.dtype, shape)],
    );
    Ok((n, outs[0]))
}

/// The group sizes a layout splits over.
struct Parts {
    tp: u64,
    ep: u64,
}

impl Parts {
    /// `d` scaled by `num / den`, which must stay a whole multiple of its symbols.
    fn scale(d: &crate::Dim, num: u64, den: u64) -> Result<crate::Dim> {
        Ratio::new(num as i128, den as i128)
            .and_then(|r| d.checked_scale(r))
            .ok_or_else(|| IrError::Invalid {
                op: "localize",
                detail: format!("a dimension cannot be scaled by {num}/{den}"),
            })
    }

    /// The share of a tensor of `shape` one rank holds in layout `l`.
    fn shape(&self, shape: &Shape, l: TensorLayout) -> Result<Shape> {
        let mut dims = shape.dims().to_vec();
        let missing = |what: &str| IrError::Invalid {
            op: "localize",
            detail: format!("a tensor of rank {} has no {what}", dims.len()),
        };
        match l {
            TensorLayout::Split { axis } => {
                let d = dims.get(axis).ok_or_else(|| missing("axis to split"))?;
                dims[axis] = Self::scale(d, 1, self.tp)?;
            }
            TensorLayout::Experts => {
                if dims.len() < 2 {
                    return Err(missing("experts and capacity axes"));
                }
                dims[0] = Self::scale(&dims[0], 1, self.ep)?;
                dims[1] = Self::scale(&dims[1], self.ep, 1)?;
            }
            TensorLayout::Replicated | TensorLayout::Partial => {}
            TensorLayout::Context { .. } => {
                return Err(IrError::Invalid {
                    op: "localize",
                    detail: "a context-parallel layout is not a plan's".into(),
                })
            }
        }
        Ok(Shape(dims))
    }

    /// The shard of parameter `p` a rank stores: a tensor-parallel split
    /// like an activation's, an expert split its leading axis only.
    fn param(&self, graph: &Graph, layout: &ModelLayout, p: ParamId) -> Result<Shape> {
        let shape = &graph.param(p).shape;
        match layout.param_split(p) {
            None => Ok(shape.clone()),
            Some(SplitAxis::Tensor { axis }) => self.shape(shape, TensorLayout::Split { axis }),
            Some(SplitAxis::Expert) => {
                let mut dims = shape.dims().to_vec();
                let d = dims.first().ok_or_else(|| IrError::Invalid {
                    op: "localize",
                    detail: format!("expert parameter `{}` has no axes", graph.param(p).name),
                })?;
                dims[0] = Self::scale(d, 1, self.ep)?;
                Ok(Shape(dims))
            }
        }
    }
}
