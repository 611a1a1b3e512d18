//! Attention masks written as arithmetic on the scores, recognised once:
//! the sliding window `ge(i − j, window) · big` that the standard
//! `attention` block subtracts. Codegen's fused kernel and the planner's
//! cost model both read a window through [`window_mask`].

use crate::{BinaryOp, Graph, NodeId, Op, TensorDef, TensorId};

/// A window mask: keys `window` or more positions behind the query weigh
/// nothing (Mistral's sliding window).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct WindowMask {
    /// How many keys a query sees, itself included.
    pub window: u64,
    /// The nodes that make the term: the distance `i − j`, the comparison
    /// and the product with `big`.
    pub nodes: [NodeId; 3],
}

/// A constant scalar's value.
pub fn scalar_constant(g: &Graph, t: TensorId) -> Option<f64> {
    match g.producer(t).map(|n| &n.op) {
        Some(Op::Constant(c)) => Some(*c),
        _ => None,
    }
}

fn producer_id(g: &Graph, t: TensorId) -> Option<NodeId> {
    match g.tensor(t).def {
        TensorDef::Node { node, .. } => Some(node),
        TensorDef::Arg { .. } => None,
    }
}

/// Whether `d` is `i − j` over `[s, 1]` and `[1, s]` positions (`reshape(t,
/// [s, 1]) − reshape(t, [1, s])` with `t` the positions, as floats).
fn is_distance(g: &Graph, d: TensorId) -> bool {
    let Some(n) = g.producer(d) else { return false };
    if n.op != Op::Binary(BinaryOp::Sub) {
        return false;
    }
    let positions = |t: TensorId, col: bool| -> bool {
        let Some(r) = g.producer(t) else { return false };
        if !matches!(r.op, Op::Reshape { .. }) {
            return false;
        }
        let dims = g.tensor(t).shape.dims();
        if dims.len() != 2 || !dims[if col { 1 } else { 0 }].is_one() {
            return false;
        }
        let mut x = r.inputs[0];
        if let Some(Op::Cast(_)) = g.producer(x).map(|p| &p.op) {
            x = g.producer(x).expect("a cast's producer").inputs[0];
        }
        matches!(g.producer(x).map(|p| &p.op), Some(Op::Iota { .. }))
    };
    positions(n.inputs[0], true) && positions(n.inputs[1], false)
}

/// `t` as `ge(i − j, window) · big`, with `big` large enough that the
/// masked scores weigh exactly nothing; `None` when it is anything else.
pub fn window_mask(g: &Graph, t: TensorId) -> Option<WindowMask> {
    let m = g.producer(t)?;
    if m.op != Op::Binary(BinaryOp::Mul) {
        return None;
    }
    let (ge, big) = match (
        scalar_constant(g, m.inputs[0]),
        scalar_constant(g, m.inputs[1]),
    ) {
        (None, Some(c)) => (m.inputs[0], c),
        (Some(c), None) => (m.inputs[1], c),
        _ => return None,
    };
    if big < 1e30 {
        return None;
    }
    let gn = g.producer(ge)?;
    if gn.op != Op::Binary(BinaryOp::Ge) || !is_distance(g, gn.inputs[0]) {
        return None;
    }
    let w = scalar_constant(g, gn.inputs[1])?;
    if w.fract() != 0.0 || w < 1.0 {
        return None;
    }
    Some(WindowMask {
        window: w as u64,
        nodes: [
            producer_id(g, gn.inputs[0])?,
            producer_id(g, ge)?,
            producer_id(g, t)?,
        ],
    })
}
