//! Vocabulary parallelism: the embedding table split by rows gives partial
//! lookups; the loss's softmax runs on vocabulary shards exchanging row
//! statistics, and picking the target's log-probability is a partial sum.

use super::super::analysis::ShardGraph;
use super::super::lang::MeshAxis;
use super::{axis, op_axis, op_of, var, when, PushPartial, PushShard, Rule};
use egg::{rewrite as rw, Id, Subst};

/// The split axis is the softmax's own (the vocabulary).
fn on_softmax_axis(eg: &mut ShardGraph, _: Id, s: &Subst) -> bool {
    match (op_of(eg, s), axis(eg, s)) {
        (Some(op), Some(a)) => op_axis(&op) == Some(a),
        _ => false,
    }
}

/// A weight table whose rows split over the tensor-parallel group.
fn table_rows_split(eg: &mut ShardGraph, id: Id, s: &Subst) -> bool {
    if !super::whole_over(eg, id, MeshAxis::Tp) {
        return false;
    }
    let t = &eg[s[var("?t")]].data;
    t.flags().weight && eg.analysis.ctx.splits(t.shape(), 0, MeshAxis::Tp)
}

/// The gathered (last) axis of an activation splits over the group.
fn gathered_axis_splits(eg: &mut ShardGraph, id: Id, s: &Subst) -> bool {
    if !super::whole_over(eg, id, MeshAxis::Tp) {
        return false;
    }
    let x = &eg[s[var("?x")]].data;
    let last = x.shape().len().saturating_sub(1);
    !x.flags().weight && eg.analysis.ctx.splits(x.shape(), last, MeshAxis::Tp)
}

pub fn rules() -> Vec<Rule> {
    vec![
        rw!("vocab-parallel-embedding"; "(embedding ?n ?t ?i)" => "(all-reduce tp (partial tp (embedding ?n ?t ?i)))" if when(table_rows_split)),
        rw!("partial-through-embedding"; "(partial ?m (embedding ?n ?t ?i))" => { PushPartial { op: "embedding", operands: &["?t", "?i"] } }),
        rw!("vocab-parallel-softmax"; "(shard ?m ?a (softmax ?n ?x))" => { PushShard { op: "softmax", operands: &["?x"] } } if when(on_softmax_axis)),
        rw!("vocab-parallel-take-along"; "(take-along ?n ?x ?i)" => "(all-reduce tp (partial tp (take-along ?n ?x ?i)))" if when(gathered_axis_splits)),
        rw!("partial-through-take-along"; "(partial ?m (take-along ?n ?x ?i))" => { PushPartial { op: "take-along", operands: &["?x", "?i"] } }),
    ]
}
