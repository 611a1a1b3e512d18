//! Tensor-, sequence- and expert-parallel execution: the plan's per-tensor
//! layouts indexed for the interpreter, local shapes, and the conversions
//! (all-reduce, all-gather, reduce-scatter, slice, all-to-all) between layouts.
//!
//! One table serves both passes: the gradient of a conversion is the
//! conversion between the gradients' layouts (an all-gather's gradient is a
//! slice of a whole gradient, or a reduce-scatter of summands).

use crate::comm::{Communicator, Group};
use crate::error::{kernel_err, Result, RuntimeError};
use crate::tensor::Tensor;
use dplc_ir::TensorLayout::{self, Context, Experts, Partial, Replicated, Split};
use dplc_ir::{Graph, ModelLayout, NodeId, NodeLayout, ParamId, RegionId, SplitAxis, TensorId};
use std::collections::HashMap;

/// The layouts of one model, looked up by tensor and node.
#[derive(Debug)]
pub(crate) struct Layouts {
    pub tp: usize,
    pub ep: usize,
    produced: HashMap<TensorId, TensorLayout>,
    nodes: HashMap<NodeId, NodeLayout>,
    results: HashMap<RegionId, Vec<TensorLayout>>,
    params: HashMap<ParamId, SplitAxis>,
}

impl Layouts {
    /// Index `model`, which `ModelLayout::check` has found to fit `graph`.
    pub fn new(graph: &Graph, model: &ModelLayout) -> Result<Layouts> {
        model.check(graph)?;
        let mut produced = HashMap::new();
        let mut nodes = HashMap::new();
        let mut results = HashMap::new();
        for r in &model.regions {
            let reg = graph.region(r.region);
            for (&a, &l) in reg.args.iter().zip(&r.args) {
                produced.insert(a, l);
            }
            for nl in &r.nodes {
                for (&t, &l) in graph.node(nl.node).outputs.iter().zip(&nl.outputs) {
                    produced.insert(t, l);
                }
                nodes.insert(nl.node, nl.clone());
            }
            results.insert(r.region, r.results.clone());
        }
        Ok(Layouts {
            tp: model.tp.max(1) as usize,
            ep: model.ep.max(1) as usize,
            produced,
            nodes,
            results,
            params: model.params.iter().map(|s| (s.param, s.split)).collect(),
        })
    }

    pub fn produced(&self, t: TensorId) -> TensorLayout {
        self.produced.get(&t).copied().unwrap_or(Replicated)
    }

    /// The layout node `n` reads input `i` in.
    pub fn consumed(&self, n: NodeId, i: usize) -> TensorLayout {
        self.nodes
            .get(&n)
            .and_then(|l| l.inputs.get(i).copied())
            .unwrap_or(Replicated)
    }

    pub fn output(&self, n: NodeId, i: usize) -> TensorLayout {
        self.nodes
            .get(&n)
            .and_then(|l| l.outputs.get(i).copied())
            .unwrap_or(Replicated)
    }

    pub fn result(&self, r: RegionId, i: usize) -> TensorLayout {
        self.results
            .get(&r)
            .and_then(|l| l.get(i).copied())
            .unwrap_or(Replicated)
    }

    /// The vocabulary-parallel op node `n` runs as ([`NodeLayout::vocab_op`]).
    pub fn vocab_op(&self, graph: &Graph, n: NodeId) -> Option<dplc_ir::VocabOp> {
        self.nodes.get(&n)?.vocab_op(&graph.node(n).op)
    }

    pub fn param(&self, p: ParamId) -> Option<SplitAxis> {
        self.params.get(&p).copied()
    }

    /// The layout of the gradient that node `n` hands back for input `i`: a
    /// whole input read by a computation split over the group gets only this
    /// rank's share of its gradient (Megatron's `f`). A repeat hands back its
    /// body's argument gradients, already whole.
    pub fn grad_contribution(&self, graph: &Graph, n: NodeId, i: usize) -> TensorLayout {
        self.nodes
            .get(&n)
            .map_or(Replicated, |nl| nl.grad_contribution(&graph.node(n).op, i))
    }

    /// The shape this rank holds of a tensor of shape `dims` in layout `l`.
    pub fn local_dims(&self, mut dims: Vec<usize>, l: TensorLayout) -> Result<Vec<usize>> {
        match l {
            Split { axis } => {
                let d = dims
                    .get_mut(axis)
                    .ok_or_else(|| kernel_err("layout", format!("no axis {axis} to split")))?;
                if !d.is_multiple_of(self.tp) {
                    return Err(RuntimeError::Config(format!(
                        "a dimension of {d} does not split over tp {}",
                        self.tp
                    )));
                }
                *d /= self.tp;
            }
            Experts => {
                if dims.len() < 2 || !dims[0].is_multiple_of(self.ep) {
                    return Err(RuntimeError::Config(format!(
                        "{:?} experts do not split over ep {}",
                        dims.first(),
                        self.ep
                    )));
                }
                dims[0] /= self.ep;
                dims[1] *= self.ep;
            }
            Replicated | Partial => {}
            Context { .. } => {
                return Err(RuntimeError::Config(
                    "a plan's layout names a context-parallel layout, which only a rank's program holds".into(),
                ))
            }
        }
        Ok(dims)
    }
}

/// The groups a rank converts layouts over.
pub(crate) struct MeshGroups {
    pub tp: Group,
    pub ep: Group,
    /// The context-parallel group, in cp-rank order.
    pub cp: Group,
    /// Fault injection: a summand passes for the whole.
    pub skip_partial_sum: bool,
}

/// `parts` equal pieces of `t` along `axis`, each contiguous.
pub(crate) fn split_along(t: &Tensor, axis: usize, parts: usize) -> Result<Vec<Tensor>> {
    let x = t.f()?;
    let n = *t
        .shape
        .get(axis)
        .ok_or_else(|| kernel_err("layout", format!("no axis {axis} to split")))?;
    if parts == 0 || !n.is_multiple_of(parts) {
        return Err(kernel_err(
            "layout",
            format!("an axis of {n} does not split into {parts}"),
        ));
    }
    let outer: usize = t.shape[..axis].iter().product();
    let inner: usize = t.shape[axis + 1..].iter().product();
    let len = n / parts;
    let mut shape = t.shape.clone();
    shape[axis] = len;
    Ok((0..parts)
        .map(|p| {
            let mut v = Vec::with_capacity(outer * len * inner);
            for o in 0..outer {
                let at = (o * n + p * len) * inner;
                v.extend_from_slice(&x[at..at + len * inner]);
            }
            Tensor::f32(shape.clone(), v)
        })
        .collect())
}

/// The positions cp rank `pos` of `cp` holds of `t` along `axis` (any
/// element type): [`dplc_ir::context_chunks`].
pub(crate) fn take_chunks(t: &Tensor, axis: usize, cp: usize, pos: usize) -> Result<Tensor> {
    let n = *t
        .shape
        .get(axis)
        .ok_or_else(|| kernel_err("context", format!("no axis {axis} to split")))?;
    let ranges = dplc_ir::context_chunks(n, cp, pos).ok_or_else(|| {
        RuntimeError::Config(format!(
            "context parallelism cuts the sequence into 2·cp = {} chunks: it must divide {n}",
            2 * cp
        ))
    })?;
    let outer: usize = t.shape[..axis].iter().product();
    let inner: usize = t.shape[axis + 1..].iter().product();
    fn pick<T: Copy>(
        x: &[T],
        outer: usize,
        n: usize,
        inner: usize,
        r: &[std::ops::Range<usize>],
    ) -> Vec<T> {
        let mut v = Vec::with_capacity(outer * inner * r.iter().map(|r| r.len()).sum::<usize>());
        for o in 0..outer {
            for r in r {
                v.extend_from_slice(&x[(o * n + r.start) * inner..(o * n + r.end) * inner]);
            }
        }
        v
    }
    let mut shape = t.shape.clone();
    shape[axis] = ranges.iter().map(|r| r.len()).sum();
    let data = match &t.data {
        crate::Data::F32(x) => crate::Data::F32(pick(x, outer, n, inner, &ranges)),
        crate::Data::I32(x) => crate::Data::I32(pick(x, outer, n, inner, &ranges)),
    };
    Ok(Tensor { shape, data })
}

/// Join `parts` (equal shapes) along `axis`.
pub(crate) fn concat_along(parts: &[Tensor], axis: usize) -> Result<Tensor> {
    let first = parts
        .first()
        .ok_or_else(|| kernel_err("layout", "nothing to join"))?;
    let outer: usize = first.shape[..axis].iter().product();
    let inner: usize = first.shape[axis + 1..].iter().product();
    let len = first.shape[axis];
    let mut out = Vec::with_capacity(first.numel() * parts.len());
    for o in 0..outer {
        for p in parts {
            let x = p.f()?;
            if p.shape != first.shape {
                return Err(kernel_err("layout", "parts of different shapes"));
            }
            out.extend_from_slice(&x[o * len * inner..(o + 1) * len * inner]);
        }
    }
    let mut shape = first.shape.clone();
    shape[axis] = len * parts.len();
    Ok(Tensor::f32(shape, out))
}

fn exchange(comm: &mut Communicator, group: &Group, pieces: Vec<Tensor>) -> Result<Vec<Tensor>> {
    let shape = pieces[0].shape.clone();
    let flat = pieces
        .into_iter()
        .map(Tensor::into_f)
        .collect::<Result<Vec<_>>>()?;
    Ok(comm
        .all_to_all(group, flat)?
        .into_iter()
        .map(|v| Tensor::f32(shape.clone(), v))
        .collect())
}

/// `v`, held in layout `from`, as this rank holds it in layout `to`.
pub(crate) fn convert(
    comm: &mut Communicator,
    groups: &MeshGroups,
    v: &Tensor,
    from: TensorLayout,
    to: TensorLayout,
) -> Result<Tensor> {
    if from == to {
        return Ok(v.clone());
    }
    let (tp, ep, cp) = (&groups.tp, &groups.ep, &groups.cp);
    let tp_pos = tp.position(comm.rank()).unwrap_or(0);
    let cp_pos = cp.position(comm.rank()).unwrap_or(0);
    if from == Partial && groups.skip_partial_sum {
        return convert(comm, groups, v, Replicated, to);
    }
    match (from, to) {
        (Partial, Replicated) => {
            let mut x = v.f()?.to_vec();
            comm.all_reduce(tp, &mut x)?;
            Ok(Tensor::f32(v.shape.clone(), x))
        }
        (Partial, Split { axis }) => {
            // A reduce-scatter along `axis`, summed in group order everywhere.
            let got = exchange(comm, tp, split_along(v, axis, tp.size())?)?;
            let mut out = vec![0.0f32; got[0].numel()];
            for g in &got {
                out.iter_mut().zip(g.f()?).for_each(|(o, &x)| *o += x);
            }
            Ok(Tensor::f32(got[0].shape.clone(), out))
        }
        (Split { axis }, Replicated) => {
            let parts: Vec<Tensor> = comm
                .all_gather(tp, v.f()?)?
                .into_iter()
                .map(|x| Tensor::f32(v.shape.clone(), x))
                .collect();
            concat_along(&parts, axis)
        }
        (Replicated, Split { axis }) => Ok(split_along(v, axis, tp.size())?.swap_remove(tp_pos)),
        (Split { .. }, Split { .. }) => {
            let whole = convert(comm, groups, v, from, Replicated)?;
            convert(comm, groups, &whole, Replicated, to)
        }
        // Tokens to the ranks that own their experts, and back.
        // Context parallelism: the sequence in load-balanced chunks over cp.
        (Context { axis }, Replicated) => {
            let n = cp.size();
            let mut chunks: Vec<Option<Tensor>> = vec![None; 2 * n];
            for (q, x) in comm.all_gather(cp, v.f()?)?.into_iter().enumerate() {
                let mut halves = split_along(&Tensor::f32(v.shape.clone(), x), axis, 2)?;
                chunks[2 * n - 1 - q] = halves.pop();
                chunks[q] = halves.pop();
            }
            let chunks: Vec<Tensor> = chunks.into_iter().flatten().collect();
            concat_along(&chunks, axis)
        }
        (Replicated, Context { axis }) => take_chunks(v, axis, cp.size(), cp_pos),
        (Partial, Context { axis }) => {
            // A reduce-scatter: each rank's summand of every rank's chunks,
            // summed in group order everywhere.
            let pieces = (0..cp.size())
                .map(|q| take_chunks(v, axis, cp.size(), q))
                .collect::<Result<Vec<_>>>()?;
            let got = exchange(comm, cp, pieces)?;
            let mut out = vec![0.0f32; got[0].numel()];
            for g in &got {
                out.iter_mut().zip(g.f()?).for_each(|(o, &x)| *o += x);
            }
            Ok(Tensor::f32(got[0].shape.clone(), out))
        }
        (Context { axis }, Partial) => {
            // This rank's summand of a whole gradient: zero elsewhere.
            let n = cp.size();
            let mut halves = split_along(v, axis, 2)?;
            let zero = Tensor::zeros(&halves[0].shape);
            let mut chunks = vec![zero; 2 * n];
            chunks[2 * n - 1 - cp_pos] = halves.pop().expect("two halves");
            chunks[cp_pos] = halves.pop().expect("two halves");
            concat_along(&chunks, axis)
        }
        (Replicated, Experts) => {
            concat_along(&exchange(comm, ep, split_along(v, 0, ep.size())?)?, 1)
        }
        (Experts, Replicated) => {
            concat_along(&exchange(comm, ep, split_along(v, 1, ep.size())?)?, 0)
        }
        _ => Err(RuntimeError::Unsupported(format!(
            "no conversion from {from:?} to {to:?}"
        ))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn split_then_concat_is_the_identity() {
        let t = Tensor::f32(vec![2, 4, 3], (0..24).map(|x| x as f32).collect());
        for axis in 0..3 {
            let n = t.shape[axis];
            let parts = split_along(&t, axis, if n.is_multiple_of(2) { 2 } else { 3 }).unwrap();
            assert_eq!(concat_along(&parts, axis).unwrap(), t);
        }
        let parts = split_along(&t, 1, 2).unwrap();
        assert_eq!(parts[1].f().unwrap()[..3], [6.0, 7.0, 8.0]);
    }
}
