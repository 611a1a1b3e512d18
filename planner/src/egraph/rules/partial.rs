//! Partial sums: where they come from (a contraction over a split weight),
//! how they pass through linear ops, and how they resolve: an all-reduce, or a
//! reduce-scatter when the consumer wants a shard (sequence parallelism).

use super::super::analysis::ShardGraph;
use super::super::lang::MeshAxis;
use super::{var, when, PushPartial, Rule};
use egg::{rewrite as rw, Id, Subst};

/// The contraction of a weight matmul splits over the tensor-parallel group.
fn weight_contraction_splits(eg: &mut ShardGraph, id: Id, s: &Subst) -> bool {
    if !super::whole_over(eg, id, MeshAxis::Tp) {
        return false;
    }
    let x = &eg[s[var("?x")]].data;
    let w = &eg[s[var("?w")]].data;
    let k = x.shape().len().saturating_sub(1);
    w.flags().weight && !x.flags().weight && eg.analysis.ctx.splits(x.shape(), k, MeshAxis::Tp)
}

pub fn rules() -> Vec<Rule> {
    vec![
        rw!("all-reduce-partial-matmul"; "(matmul ?n ?x ?w)" => "(all-reduce tp (partial tp (matmul ?n ?x ?w)))" if when(weight_contraction_splits)),
        rw!("reduce-scatter-is-sharded-all-reduce"; "(shard ?m ?a (all-reduce ?m ?p))" => "(reduce-scatter ?m ?a ?p)"),
        rw!("shard-of-all-gather-cancels"; "(shard ?m ?a (all-gather ?m ?a ?x))" => "?x"),
        rw!("partial-through-unary"; "(partial ?m (unary ?n ?x))" => { PushPartial { op: "unary", operands: &["?x"] } }),
        rw!("partial-through-reduce"; "(partial ?m (reduce ?n ?x))" => { PushPartial { op: "reduce", operands: &["?x"] } }),
    ]
}
