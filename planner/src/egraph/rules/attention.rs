//! Views (reshape, transpose, expand, slice, concat) carry a split to the
//! axis it came from; together with the batch-parallel matmul this splits
//! attention by heads. GQA: a KV reshape whose KV heads do not divide the
//! degree has no rule, so its only layout is a slice of replicated K and V.

use super::super::analysis::ShardGraph;
use super::{axis, op_axis, op_of, when, PushPartial, PushShard, Rule};
use egg::{rewrite as rw, Id, Subst};

/// The split axis is not the one a slice or concat cuts along.
fn off_cut_axis(eg: &mut ShardGraph, _: Id, s: &Subst) -> bool {
    match (op_of(eg, s), axis(eg, s)) {
        (Some(op), Some(a)) => op_axis(&op) != Some(a),
        _ => false,
    }
}

pub fn rules() -> Vec<Rule> {
    vec![
        rw!("shard-through-reshape"; "(shard ?m ?a (reshape ?n ?x))" => { PushShard { op: "reshape", operands: &["?x"] } }),
        rw!("shard-through-transpose"; "(shard ?m ?a (transpose ?n ?x))" => { PushShard { op: "transpose", operands: &["?x"] } }),
        rw!("shard-through-expand"; "(shard ?m ?a (expand ?n ?x))" => { PushShard { op: "expand", operands: &["?x"] } }),
        rw!("shard-through-slice"; "(shard ?m ?a (slice ?n ?x))" => { PushShard { op: "slice", operands: &["?x"] } } if when(off_cut_axis)),
        rw!("shard-through-concat"; "(shard ?m ?a (concat ?n ?x ?y))" => { PushShard { op: "concat", operands: &["?x", "?y"] } } if when(off_cut_axis)),
        rw!("partial-through-reshape"; "(partial ?m (reshape ?n ?x))" => { PushPartial { op: "reshape", operands: &["?x"] } }),
    ]
}
