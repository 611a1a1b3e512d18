//! Per-tensor layouts of a model split over tensor, sequence and expert
//! parallelism: what each rank holds of every value, as data in the `Plan`.
//!
//! The planner writes a [`ModelLayout`] into every plan that splits a layer
//! (from its sharding e-graph, or Megatron's rule where the e-graph's cannot
//! be run); [`ModelLayout::check`] tells whether one fits a graph. The runtime
//! only reads the layout: a conversion runs wherever a value is consumed in a
//! layout other than the one it was produced in.

use crate::{Graph, NodeId, Op, ParamId, PlanMismatch, RegionId, VocabOp};
use serde::{Deserialize, Serialize};
use std::collections::HashSet;

/// What one rank holds of a tensor.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum TensorLayout {
    /// The whole tensor, identical on every rank of the tensor-parallel group.
    Replicated,
    /// The `i`-th of `tp` equal contiguous parts along `axis`.
    Split { axis: usize },
    /// A summand: the tensor is the sum of every tensor-parallel rank's value.
    Partial,
    /// An expert tensor `[experts, capacity, …]` after the all-to-all: this
    /// rank's `experts / ep` experts, with the capacity slots of every rank of
    /// the expert-parallel group one after the other (`[experts/ep, ep·capacity, …]`).
    Experts,
    /// Context parallelism: this rank's positions along the sequence axis
    /// `axis`, cut into `2·cp` equal chunks of which cp rank `r` holds
    /// chunks `r` and `2·cp−1−r`, in that order (the causal load balancing
    /// of Megatron-LM and torchtitan). Only in a rank's program
    /// ([`crate::split_context`]), never in a plan's layout.
    Context { axis: usize },
}

impl std::fmt::Display for TensorLayout {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            TensorLayout::Replicated => f.write_str("replicated"),
            TensorLayout::Split { axis } => write!(f, "split({axis})"),
            TensorLayout::Partial => f.write_str("partial"),
            TensorLayout::Experts => f.write_str("experts"),
            TensorLayout::Context { axis } => write!(f, "context({axis})"),
        }
    }
}

impl TensorLayout {
    /// The layout the gradient of a value in this layout lives in: a summand's
    /// gradient is the whole gradient on every rank.
    pub fn grad(self) -> TensorLayout {
        match self {
            TensorLayout::Partial => TensorLayout::Replicated,
            l => l,
        }
    }

    /// The layout the gradient of a layout change `from -> to` is handed
    /// back in. Each rank's gradient of a whole value sliced to its context
    /// positions is its own summand (zero at the other ranks' positions);
    /// every other change hands back the gradient of `from`.
    pub fn relayout_grad_target(from: TensorLayout, to: TensorLayout) -> TensorLayout {
        match (from, to) {
            (TensorLayout::Replicated, TensorLayout::Context { .. }) => TensorLayout::Partial,
            _ => from.grad(),
        }
    }

    /// Whether this rank's value differs from the other tensor-parallel ranks'.
    pub fn is_tp_split(self) -> bool {
        matches!(self, TensorLayout::Split { .. } | TensorLayout::Partial)
    }
}

/// How one node runs: the layout it reads each input in (a conversion runs
/// where that differs from how the input was produced) and its outputs' layouts.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct NodeLayout {
    pub node: NodeId,
    pub inputs: Vec<TensorLayout>,
    pub outputs: Vec<TensorLayout>,
}

impl NodeLayout {
    /// The layout of the gradient node `op` hands back for input `i`: a
    /// whole input read by a computation split over the group gets only this
    /// rank's share of its gradient (Megatron's `f`). A repeat hands back its
    /// body's argument gradients, already whole.
    pub fn grad_contribution(&self, op: &Op, i: usize) -> TensorLayout {
        let c = self
            .inputs
            .get(i)
            .copied()
            .unwrap_or(TensorLayout::Replicated);
        let split_op = !matches!(op, Op::Repeat { .. })
            && self
                .inputs
                .iter()
                .chain(&self.outputs)
                .any(|l| l.is_tp_split());
        if split_op && c == TensorLayout::Replicated {
            TensorLayout::Partial
        } else {
            c.grad()
        }
    }

    /// The vocabulary-parallel op node `op` is under this layout, if it reads
    /// the axis it indexes or normalises split over the group: an embedding
    /// of a table split by rows, a pick along a split last axis (each a
    /// summand), a softmax over its split axis. Both executors ask this one
    /// question, so they split the same nodes.
    pub fn vocab_op(&self, op: &Op) -> Option<VocabOp> {
        let first = self.inputs.first().copied()?;
        let out = self.outputs.first().copied()?;
        match (op, first, out) {
            (Op::Embedding, TensorLayout::Split { axis: 0 }, TensorLayout::Partial) => {
                Some(VocabOp::Embedding)
            }
            (Op::TakeAlong, TensorLayout::Split { .. }, TensorLayout::Partial) => {
                Some(VocabOp::TakeAlong)
            }
            (Op::Softmax { axis }, TensorLayout::Split { axis: a }, _) if a == *axis => {
                Some(VocabOp::Softmax { axis: *axis })
            }
            (Op::LogSoftmax { axis }, TensorLayout::Split { axis: a }, _) if a == *axis => {
                Some(VocabOp::LogSoftmax { axis: *axis })
            }
            _ => None,
        }
    }
}

/// The layouts of one region (the root, or a `repeat` body).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct RegionLayout {
    pub region: RegionId,
    /// Layouts the arguments arrive in (carried values first).
    pub args: Vec<TensorLayout>,
    pub nodes: Vec<NodeLayout>,
    /// Layouts the results are handed back in (those of the carried arguments).
    pub results: Vec<TensorLayout>,
}

/// The mesh axis a parameter is split over.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum SplitAxis {
    /// Tensor parallel: `axis` of the parameter split over the tp group.
    Tensor { axis: usize },
    /// Expert parallel: the leading experts axis split over the ep group.
    Expert,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ParamSplit {
    pub param: ParamId,
    pub split: SplitAxis,
}

/// The layout of a whole model for one tensor-, expert-parallel degree.
/// Regions without an entry run replicated.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ModelLayout {
    pub tp: u64,
    pub ep: u64,
    pub sequence_parallel: bool,
    pub regions: Vec<RegionLayout>,
    pub params: Vec<ParamSplit>,
}

impl ModelLayout {
    pub fn region(&self, r: RegionId) -> Option<&RegionLayout> {
        self.regions.iter().find(|l| l.region == r)
    }

    pub fn param_split(&self, p: ParamId) -> Option<SplitAxis> {
        self.params.iter().find(|s| s.param == p).map(|s| s.split)
    }

    /// Whether this layout describes `graph`: every region and node it names
    /// exists and in the graph's order, every node has a layout per input and
    /// output, and every split parameter's axis divides over its degree. A
    /// plan file is read from disk, so nothing here may be taken on trust.
    pub fn check(&self, graph: &Graph) -> Result<(), PlanMismatch> {
        let bad = |what: String| Err(PlanMismatch(what));
        if self.tp == 0 || self.ep == 0 {
            return bad(format!("a layout for tp {} ep {}", self.tp, self.ep));
        }
        let mut seen = HashSet::new();
        for r in &self.regions {
            if r.region.index() >= graph.regions().len() || !seen.insert(r.region) {
                return bad(format!(
                    "the layout names region {} twice or out of range",
                    r.region
                ));
            }
            let reg = graph.region(r.region);
            if r.args.len() != reg.args.len()
                || r.nodes.len() != reg.nodes.len()
                || r.results.len() != reg.results.len()
            {
                return bad(format!(
                    "the layout of region {} has {} arguments, {} nodes and {} results; the model's has {}, {} and {}",
                    r.region,
                    r.args.len(),
                    r.nodes.len(),
                    r.results.len(),
                    reg.args.len(),
                    reg.nodes.len(),
                    reg.results.len()
                ));
            }
            let context = r
                .args
                .iter()
                .chain(&r.results)
                .chain(
                    r.nodes
                        .iter()
                        .flat_map(|nl| nl.inputs.iter().chain(&nl.outputs)),
                )
                .any(|l| matches!(l, TensorLayout::Context { .. }));
            if context {
                return bad(format!(
                    "the layout of region {} names a context-parallel layout, which only a rank's program holds",
                    r.region
                ));
            }
            for (nl, &n) in r.nodes.iter().zip(&reg.nodes) {
                let node = graph.node(n);
                // A parameter's layout may leave out its (initialiser) inputs.
                let inputs_fit =
                    nl.inputs.len() == node.inputs.len() || matches!(node.op, Op::Param(_));
                if nl.node != n || !inputs_fit || nl.outputs.len() != node.outputs.len() {
                    return bad(format!(
                        "the layout of {} (in region {}) does not match the model's {n}",
                        nl.node, r.region
                    ));
                }
            }
        }
        let mut split = HashSet::new();
        for s in &self.params {
            if s.param.index() >= graph.params().len() || !split.insert(s.param) {
                return bad(format!(
                    "the layout splits parameter {} twice or out of range",
                    s.param
                ));
            }
            let info = graph.param(s.param);
            let (axis, parts, what) = match s.split {
                SplitAxis::Tensor { axis } => (axis, self.tp, "tp"),
                SplitAxis::Expert => (0, self.ep, "ep"),
            };
            let n = info.shape.dims().get(axis).and_then(|d| d.as_const());
            if !n.is_some_and(|n| n > 0 && (n as u64).is_multiple_of(parts)) {
                return bad(format!(
                    "parameter `{}` cannot split axis {axis} over {what} {parts}",
                    info.name
                ));
            }
        }
        Ok(())
    }
}

/// Where a rank's part of a tensor sits in the whole tensor of the serial
/// run: what keys a per-element draw (dropout) so that every split draws
/// the serial run's mask. Tensor (or sequence) parallelism takes a
/// contiguous `1/parts` along one axis of the tensor the rank's context
/// chunks make; context parallelism holds two chunks of the sequence axis
/// ([`crate::context_position`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Placement {
    /// `(axis, part, parts)`: piece `part` of `parts` along `axis`.
    pub split: Option<(usize, usize, usize)>,
    /// `(axis, rank, cp)`: cp rank `rank`'s chunks along `axis`.
    pub context: Option<(usize, usize, usize)>,
}

impl Placement {
    /// The whole tensor's shape, of which `shape` is this part.
    pub fn whole_shape(&self, shape: &[usize]) -> Vec<usize> {
        let mut whole = shape.to_vec();
        if let Some((axis, _, parts)) = self.split {
            if let Some(d) = whole.get_mut(axis) {
                *d *= parts;
            }
        }
        if let Some((axis, _, cp)) = self.context {
            if let Some(d) = whole.get_mut(axis) {
                *d *= cp;
            }
        }
        whole
    }

    /// The flat index in the whole tensor of element `i` (row-major) of
    /// this part of `shape`. Digit by digit from the last axis, without
    /// allocating: a dropout mask asks it once per element.
    pub fn whole_index(&self, shape: &[usize], i: usize) -> usize {
        if self.split.is_none() && self.context.is_none() {
            return i;
        }
        let (mut rest, mut whole, mut stride) = (i, 0, 1);
        for (k, &d) in shape.iter().enumerate().rev() {
            let d = d.max(1);
            let (mut at, mut len) = (rest % d, d);
            rest /= d;
            if let Some((_, part, parts)) = self.split.filter(|s| s.0 == k) {
                at += part * len;
                len *= parts;
            }
            if let Some((_, rank, cp)) = self.context.filter(|c| c.0 == k) {
                at = crate::context_position(len, cp, rank, at);
                len *= cp;
            }
            whole += at * stride;
            stride *= len;
        }
        whole
    }
}

impl TensorLayout {
    /// The axis along which a value in this layout holds the rank's `1/tp`
    /// part, if it does.
    pub fn split_axis(self) -> Option<usize> {
        match self {
            TensorLayout::Split { axis } => Some(axis),
            _ => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::Placement;

    /// Each rank's part of a whole `[2, 8, 6]` tensor — its context chunks
    /// along axis 1 (`context_chunks`), then its `1/tp` of those along
    /// axis 1 or 2 — maps every local element to the whole tensor's index
    /// of the same element, and the parts together cover it once.
    #[test]
    fn whole_index_finds_each_ranks_elements_in_the_whole_tensor() {
        let whole = [2usize, 8, 6];
        let flat = |a: [usize; 3]| (a[0] * whole[1] + a[1]) * whole[2] + a[2];
        for (cp, tp, split_axis) in [(1, 2, 2), (2, 1, 1), (2, 2, 1), (2, 2, 2), (2, 3, 2)] {
            let mut seen = vec![0; whole.iter().product()];
            for cp_rank in 0..cp {
                // The cp rank's sequence positions, in the order it holds them.
                let positions: Vec<usize> = match crate::context_chunks(whole[1], cp, cp_rank) {
                    Some([a, b]) if cp > 1 => a.chain(b).collect(),
                    _ => (0..whole[1]).collect(),
                };
                for part in 0..tp {
                    let mut local = [whole[0], positions.len(), whole[2]];
                    local[split_axis] /= tp;
                    let at = Placement {
                        split: (tp > 1).then_some((split_axis, part, tp)),
                        context: (cp > 1).then_some((1, cp_rank, cp)),
                    };
                    assert_eq!(at.whole_shape(&local), whole.to_vec());
                    let mut i = 0;
                    for a in 0..local[0] {
                        for b in 0..local[1] {
                            for c in 0..local[2] {
                                let mut g = [a, b, c];
                                g[split_axis] += part * local[split_axis];
                                g[1] = positions[g[1]];
                                assert_eq!(at.whole_index(&local, i), flat(g));
                                seen[flat(g)] += 1;
                                i += 1;
                            }
                        }
                    }
                }
            }
            assert!(seen.iter().all(|&n| n == 1), "cp {cp} tp {tp}: {seen:?}");
        }
    }
}
