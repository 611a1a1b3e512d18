//! Layout propagation through elementwise, norm, softmax and reduction ops:
//! a split along an axis the op does not mix passes to its operands.

use super::{axis, op_axis, op_of, when, PushShard, Rule};
use egg::{rewrite as rw, Id, Subst};

use super::super::analysis::ShardGraph;

/// The split axis is not the one the op normalises or reduces over.
fn off_op_axis(eg: &mut ShardGraph, _: Id, s: &Subst) -> bool {
    match (op_of(eg, s), axis(eg, s)) {
        (Some(op), Some(a)) => op_axis(&op) != Some(a),
        _ => false,
    }
}

pub fn rules() -> Vec<Rule> {
    vec![
        rw!("shard-through-unary"; "(shard ?m ?a (unary ?n ?x))" => { PushShard { op: "unary", operands: &["?x"] } }),
        rw!("shard-through-binary"; "(shard ?m ?a (binary ?n ?x ?y))" => { PushShard { op: "binary", operands: &["?x", "?y"] } }),
        rw!("shard-through-layernorm"; "(shard ?m ?a (norm ?n ?x ?w ?b))" => { PushShard { op: "norm", operands: &["?x", "?w", "?b"] } }),
        rw!("shard-through-rmsnorm"; "(shard ?m ?a (norm ?n ?x ?w))" => { PushShard { op: "norm", operands: &["?x", "?w"] } }),
        rw!("shard-through-softmax"; "(shard ?m ?a (softmax ?n ?x))" => { PushShard { op: "softmax", operands: &["?x"] } } if when(off_op_axis)),
        rw!("shard-through-reduce"; "(shard ?m ?a (reduce ?n ?x))" => { PushShard { op: "reduce", operands: &["?x"] } } if when(off_op_axis)),
    ]
}
