//! Sequence parallelism: norms, dropout and residual adds run on sequence
//! shards; the replicated input of the next column-parallel matmul is an
//! all-gather of the norm's sequence shards, and an all-reduce is a
//! reduce-scatter followed by an all-gather of the same total volume.

use super::super::analysis::{Part, ShardAnalysis, ShardGraph};
use super::super::lang::{MeshAxis, ShardLang};
use super::Rule;
use egg::{rewrite as rw, Applier, Id, PatternAst, Subst, Symbol};

/// Adds `(all-gather tp s (inner tp s X))` to class `X`, `s` its sequence
/// axis, `inner` a shard of `X` (after a norm) or a reduce-scatter of `X`'s
/// partial summand (for an all-reduce).
pub struct SequenceGather {
    pub reduce_scatter: bool,
}

/// Sequence parallelism is on.
fn sequence_parallel(eg: &mut ShardGraph, _: Id, _: &Subst) -> bool {
    eg.analysis.ctx.sequence_parallel && eg.analysis.ctx.degree(MeshAxis::Tp) > 1
}

impl Applier<ShardLang, ShardAnalysis> for SequenceGather {
    fn apply_one(
        &self,
        eg: &mut ShardGraph,
        eclass: Id,
        subst: &Subst,
        _: Option<&PatternAst<ShardLang>>,
        _: Symbol,
    ) -> Vec<Id> {
        let ctx = eg.analysis.ctx.clone();
        let shape = eg[eclass].data.shape().to_vec();
        let Some(s) = ctx.seq_axis(&shape) else {
            return vec![];
        };
        if !ctx.splits(&shape, s, MeshAxis::Tp)
            || eg[eclass].data.layout().map(|l| l.get(MeshAxis::Tp)) != Some(Part::Replicated)
        {
            return vec![];
        }
        let m = eg.add(ShardLang::Mesh(MeshAxis::Tp));
        let a = eg.add(ShardLang::Num(s as i64));
        let inner = if self.reduce_scatter {
            let p = subst[super::var("?p")];
            eg.add(ShardLang::ReduceScatter([m, a, p]))
        } else {
            eg.add(ShardLang::Shard([m, a, eclass]))
        };
        let gathered = eg.add(ShardLang::AllGather([m, a, inner]));
        if eg.union(eclass, gathered) {
            vec![eclass]
        } else {
            vec![]
        }
    }
}

pub fn rules() -> Vec<Rule> {
    vec![
        rw!("sequence-gather-after-layernorm"; "(norm ?n ?x ?w ?b)" => { SequenceGather { reduce_scatter: false } } if sequence_parallel),
        rw!("sequence-gather-after-rmsnorm"; "(norm ?n ?x ?w)" => { SequenceGather { reduce_scatter: false } } if sequence_parallel),
        rw!("all-reduce-is-reduce-scatter-all-gather"; "(all-reduce tp ?p)" => { SequenceGather { reduce_scatter: true } } if sequence_parallel),
    ]
}
