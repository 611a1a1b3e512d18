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
use std::ops::Range;

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
    let n = *t
        .shape
        .get(axis)
        .ok_or_else(|| kernel_err("layout", format!("no axis {axis} to split")))?;
    (0..parts)
        .map(|p| take_ranges(t, axis, &[even_piece(n, parts, p)?]))
        .collect()
}

/// The positions cp rank `pos` of `cp` holds of `t` along `axis` (any
/// element type): [`dplc_ir::context_chunks`].
pub(crate) fn take_chunks(t: &Tensor, axis: usize, cp: usize, pos: usize) -> Result<Tensor> {
    let n = *t
        .shape
        .get(axis)
        .ok_or_else(|| kernel_err("context", format!("no axis {axis} to split")))?;
    take_ranges(t, axis, &context_ranges(n, cp, pos)?)
}

/// The length of axis `axis` of `dims`, checked to hold `ranges`: what
/// every [`Moves::cut`] checks first.
pub(crate) fn cut_axis(dims: &[usize], axis: usize, ranges: &[Range<usize>]) -> Result<usize> {
    let n = *dims
        .get(axis)
        .ok_or_else(|| kernel_err("layout", format!("no axis {axis} to cut")))?;
    if ranges.iter().any(|r| r.end > n) {
        return Err(kernel_err(
            "layout",
            format!("positions {ranges:?} of an axis of {n}"),
        ));
    }
    Ok(n)
}

/// The positions `ranges` of `t` along `axis`, in order (any element type).
fn take_ranges(t: &Tensor, axis: usize, ranges: &[Range<usize>]) -> Result<Tensor> {
    let n = cut_axis(&t.shape, axis, ranges)?;
    let outer: usize = t.shape[..axis].iter().product();
    let inner: usize = t.shape[axis + 1..].iter().product();
    fn pick<T: Copy>(x: &[T], outer: usize, n: usize, inner: usize, r: &[Range<usize>]) -> Vec<T> {
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
        crate::Data::F32(x) => crate::Data::F32(pick(x, outer, n, inner, ranges)),
        crate::Data::I32(x) => crate::Data::I32(pick(x, outer, n, inner, ranges)),
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

/// What a layout change does to values, wherever they live: cut pieces
/// along an axis, join them, sum a group's parts, and move pieces over a
/// group. The host's tensors ([`HostMoves`]) and a backend's buffers
/// (`crate::fused::relayout`) implement it, so that one [`convert_with`]
/// says how each layout becomes each other, for the reference and for the
/// fused compute alike.
pub(crate) trait Moves {
    type V: Clone;
    /// This rank in the run.
    fn rank(&self) -> usize;
    fn dims<'v>(&self, v: &'v Self::V) -> &'v [usize];
    /// The positions `ranges` of `v` along `axis`, in order, as one value.
    fn cut(&mut self, v: &Self::V, axis: usize, ranges: &[Range<usize>]) -> Result<Self::V>;
    /// `parts` (equal shapes) joined along `axis`.
    fn join(&mut self, parts: &[Self::V], axis: usize) -> Result<Self::V>;
    /// A value of zeros of `v`'s element type.
    fn zeros(&mut self, like: &Self::V, dims: &[usize]) -> Result<Self::V>;
    /// The sum of `parts` from zero, in order (the CPU communicator's).
    fn sum(&mut self, parts: &[Self::V]) -> Result<Self::V>;
    /// Piece `j` to the member at position `j`; what each member sent
    /// here, in group order.
    fn all_to_all(&mut self, group: &Group, pieces: Vec<Self::V>) -> Result<Vec<Self::V>>;
    /// Every member's `v`, in group order.
    fn all_gather(&mut self, group: &Group, v: &Self::V) -> Result<Vec<Self::V>> {
        let n = group.size();
        self.all_to_all(group, vec![v.clone(); n])
    }
    /// Every member's `v` summed: by default gathered and summed from zero
    /// in group order (the same bits on every member).
    fn all_reduce(&mut self, group: &Group, v: &Self::V) -> Result<Self::V> {
        let all = self.all_gather(group, v)?;
        self.sum(&all)
    }
    /// Piece `j` summed over the members, at member `j`: by default the
    /// pieces exchanged and summed from zero in group order.
    fn reduce_scatter(&mut self, group: &Group, pieces: Vec<Self::V>) -> Result<Self::V> {
        let got = self.all_to_all(group, pieces)?;
        self.sum(&got)
    }
}

/// Piece `p` of `parts` equal pieces of an axis of `n`.
fn even_piece(n: usize, parts: usize, p: usize) -> Result<Range<usize>> {
    if parts == 0 || !n.is_multiple_of(parts) {
        return Err(kernel_err(
            "layout",
            format!("an axis of {n} does not split into {parts}"),
        ));
    }
    let len = n / parts;
    Ok(p * len..(p + 1) * len)
}

fn axis_len<M: Moves>(m: &M, v: &M::V, axis: usize) -> Result<usize> {
    m.dims(v)
        .get(axis)
        .copied()
        .ok_or_else(|| kernel_err("layout", format!("no axis {axis} to split")))
}

/// `parts` equal pieces of `v` along `axis`.
fn split<M: Moves>(m: &mut M, v: &M::V, axis: usize, parts: usize) -> Result<Vec<M::V>> {
    let n = axis_len(m, v, axis)?;
    (0..parts)
        .map(|p| m.cut(v, axis, &[even_piece(n, parts, p)?]))
        .collect()
}

/// The positions cp rank `pos` of `cp` holds along `axis`:
/// [`dplc_ir::context_chunks`].
fn context_ranges(n: usize, cp: usize, pos: usize) -> Result<[Range<usize>; 2]> {
    dplc_ir::context_chunks(n, cp, pos).ok_or_else(|| {
        RuntimeError::Config(format!(
            "context parallelism cuts the sequence into 2·cp = {} chunks: it must divide {n}",
            2 * cp
        ))
    })
}

/// `v`, held in layout `from`, as this rank holds it in layout `to`, by
/// `m`'s moves over `groups`.
pub(crate) fn convert_with<M: Moves>(
    m: &mut M,
    groups: &MeshGroups,
    v: &M::V,
    from: TensorLayout,
    to: TensorLayout,
) -> Result<M::V> {
    if from == to {
        return Ok(v.clone());
    }
    let (tp, ep, cp) = (&groups.tp, &groups.ep, &groups.cp);
    let tp_pos = tp.position(m.rank()).unwrap_or(0);
    let cp_pos = cp.position(m.rank()).unwrap_or(0);
    if from == Partial && groups.skip_partial_sum {
        return convert_with(m, groups, v, Replicated, to);
    }
    match (from, to) {
        (Partial, Replicated) => m.all_reduce(tp, v),
        (Partial, Split { axis }) => {
            // A reduce-scatter along `axis`.
            let pieces = split(m, v, axis, tp.size())?;
            m.reduce_scatter(tp, pieces)
        }
        (Split { axis }, Replicated) => {
            let parts = m.all_gather(tp, v)?;
            m.join(&parts, axis)
        }
        (Replicated, Split { axis }) => {
            let n = axis_len(m, v, axis)?;
            m.cut(v, axis, &[even_piece(n, tp.size(), tp_pos)?])
        }
        (Split { .. }, Split { .. }) => {
            let whole = convert_with(m, groups, v, from, Replicated)?;
            convert_with(m, groups, &whole, Replicated, to)
        }
        // Context parallelism: the sequence in load-balanced chunks over cp
        // (rank q holds chunks q and 2·cp − 1 − q).
        (Context { axis }, Replicated) => {
            let n = cp.size();
            let mut chunks: Vec<Option<M::V>> = vec![None; 2 * n];
            for (q, x) in m.all_gather(cp, v)?.into_iter().enumerate() {
                let mut halves = split(m, &x, axis, 2)?;
                chunks[2 * n - 1 - q] = halves.pop();
                chunks[q] = halves.pop();
            }
            let chunks: Vec<M::V> = chunks.into_iter().flatten().collect();
            m.join(&chunks, axis)
        }
        (Replicated, Context { axis }) => {
            let n = axis_len(m, v, axis)?;
            m.cut(v, axis, &context_ranges(n, cp.size(), cp_pos)?)
        }
        (Partial, Context { axis }) => {
            // A reduce-scatter: each rank's summand of every rank's chunks.
            let n = axis_len(m, v, axis)?;
            let pieces = (0..cp.size())
                .map(|q| m.cut(v, axis, &context_ranges(n, cp.size(), q)?))
                .collect::<Result<Vec<_>>>()?;
            m.reduce_scatter(cp, pieces)
        }
        (Context { axis }, Partial) => {
            // This rank's summand of a whole gradient: zero elsewhere.
            let n = cp.size();
            let mut halves = split(m, v, axis, 2)?;
            let zero = m.zeros(v, m.dims(&halves[0]))?;
            let mut chunks = vec![zero; 2 * n];
            chunks[2 * n - 1 - cp_pos] = halves.pop().expect("two halves");
            chunks[cp_pos] = halves.pop().expect("two halves");
            m.join(&chunks, axis)
        }
        // Tokens to the ranks that own their experts, and back.
        (Replicated, Experts) => {
            let pieces = split(m, v, 0, ep.size())?;
            let got = m.all_to_all(ep, pieces)?;
            m.join(&got, 1)
        }
        (Experts, Replicated) => {
            let pieces = split(m, v, 1, ep.size())?;
            let got = m.all_to_all(ep, pieces)?;
            m.join(&got, 0)
        }
        _ => Err(RuntimeError::Unsupported(format!(
            "no conversion from {from:?} to {to:?}"
        ))),
    }
}

/// [`Moves`] on host tensors, over the CPU communicator.
pub(crate) struct HostMoves<'c> {
    pub comm: &'c mut Communicator,
}

impl Moves for HostMoves<'_> {
    type V = Tensor;

    fn rank(&self) -> usize {
        self.comm.rank()
    }

    fn dims<'v>(&self, v: &'v Tensor) -> &'v [usize] {
        &v.shape
    }

    fn cut(&mut self, v: &Tensor, axis: usize, ranges: &[Range<usize>]) -> Result<Tensor> {
        take_ranges(v, axis, ranges)
    }

    fn join(&mut self, parts: &[Tensor], axis: usize) -> Result<Tensor> {
        concat_along(parts, axis)
    }

    fn zeros(&mut self, _like: &Tensor, dims: &[usize]) -> Result<Tensor> {
        Ok(Tensor::zeros(dims))
    }

    fn sum(&mut self, parts: &[Tensor]) -> Result<Tensor> {
        let first = parts
            .first()
            .ok_or_else(|| kernel_err("layout", "nothing to sum"))?;
        let mut out = vec![0.0f32; first.numel()];
        for p in parts {
            out.iter_mut().zip(p.f()?).for_each(|(o, &x)| *o += x);
        }
        Ok(Tensor::f32(first.shape.clone(), out))
    }

    fn all_to_all(&mut self, group: &Group, pieces: Vec<Tensor>) -> Result<Vec<Tensor>> {
        let shapes: Vec<Vec<usize>> = pieces.iter().map(|p| p.shape.clone()).collect();
        let flat = pieces
            .into_iter()
            .map(Tensor::into_f)
            .collect::<Result<Vec<_>>>()?;
        // Every member cuts the same shapes: what arrives has this rank's.
        let pos = group.position(self.comm.rank()).unwrap_or(0);
        let shape = shapes.get(pos).cloned().unwrap_or_default();
        Ok(self
            .comm
            .all_to_all(group, flat)?
            .into_iter()
            .map(|v| Tensor::f32(shape.clone(), v))
            .collect())
    }

    fn all_gather(&mut self, group: &Group, v: &Tensor) -> Result<Vec<Tensor>> {
        Ok(self
            .comm
            .all_gather(group, v.f()?)?
            .into_iter()
            .map(|x| Tensor::f32(v.shape.clone(), x))
            .collect())
    }
}

/// `v`, held in layout `from`, as this rank holds it in layout `to` (on
/// the host).
pub(crate) fn convert(
    comm: &mut Communicator,
    groups: &MeshGroups,
    v: &Tensor,
    from: TensorLayout,
    to: TensorLayout,
) -> Result<Tensor> {
    convert_with(&mut HostMoves { comm }, groups, v, from, to)
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
