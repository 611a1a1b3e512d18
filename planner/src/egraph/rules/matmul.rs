//! Matmul splits: a split of the output's columns is the weight's column
//! split (Megatron's column-parallel linear); a split of the contraction is a
//! partial sum (row-parallel); batch axes (attention heads) split both operands.
//!
//! Under expert parallelism an expert stays whole on its expert-parallel rank
//! (Megatron's `--expert-tensor-parallel-size 1`): the runtime's layouts have
//! no word for experts split over ep and tp at once, so the search does not
//! price an expert's matmul split over tp (DESIGN: where the runtime cannot
//! run a choice, the planner does not make it).

use super::super::analysis::{mesh_of, ShardGraph};
use super::super::lang::MeshAxis;
use super::{axis, var, when, PushPartial, PushShard, Rule};
use egg::{rewrite as rw, Id, Subst};

/// An expert's matmul (a weight with a leading experts dim) under expert
/// parallelism, split over tp: what the runtime does not run.
fn splits_an_expert_over_tp(eg: &ShardGraph, s: &Subst) -> bool {
    let w = &eg[s[var("?w")]].data;
    mesh_of(eg, s[var("?m")]) == Some(MeshAxis::Tp)
        && eg.analysis.ctx.degree(MeshAxis::Ep) > 1
        && w.flags().weight
        && w.shape().len() == 3
}

/// Whether the split axis is the output's last (its columns).
fn splits_columns(eg: &ShardGraph, id: Id, s: &Subst) -> bool {
    axis(eg, s).is_some_and(|a| a + 1 == eg[id].data.shape().len())
}

fn output_columns(eg: &mut ShardGraph, id: Id, s: &Subst) -> bool {
    !splits_an_expert_over_tp(eg, s) && splits_columns(eg, id, s)
}

fn not_output_columns(eg: &mut ShardGraph, id: Id, s: &Subst) -> bool {
    !(splits_an_expert_over_tp(eg, s) || splits_columns(eg, id, s))
}

/// The right operand is a weight: contracting it is Megatron's row split.
pub(crate) fn contracts_weight(eg: &mut ShardGraph, _: Id, s: &Subst) -> bool {
    !splits_an_expert_over_tp(eg, s) && eg[s[var("?w")]].data.flags().weight
}

pub fn rules() -> Vec<Rule> {
    vec![
        rw!("column-parallel-matmul"; "(shard ?m ?a (matmul ?n ?x ?w))" => { PushShard { op: "matmul", operands: &["?x", "?w"] } } if when(output_columns)),
        rw!("batch-parallel-matmul"; "(shard ?m ?a (matmul ?n ?x ?w))" => { PushShard { op: "matmul", operands: &["?x", "?w"] } } if when(not_output_columns)),
        rw!("row-parallel-matmul"; "(partial ?m (matmul ?n ?x ?w))" => { PushPartial { op: "matmul", operands: &["?x", "?w"] } } if when(contracts_weight)),
    ]
}
