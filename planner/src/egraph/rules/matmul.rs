//! Matmul splits: a split of the output's columns is the weight's column
//! split (Megatron's column-parallel linear); a split of the contraction is a
//! partial sum (row-parallel); batch axes (attention heads) split both operands.

use super::super::analysis::ShardGraph;
use super::{axis, when, PushPartial, PushShard, Rule};
use egg::{rewrite as rw, Id, Subst};

/// The split axis is the output's last (its columns).
fn output_columns(eg: &mut ShardGraph, id: Id, s: &Subst) -> bool {
    axis(eg, s).is_some_and(|a| a + 1 == eg[id].data.shape().len())
}

fn not_output_columns(eg: &mut ShardGraph, id: Id, s: &Subst) -> bool {
    !output_columns(eg, id, s)
}

/// The right operand is a weight: contracting it is Megatron's row split.
pub(crate) fn contracts_weight(eg: &mut ShardGraph, _: Id, s: &Subst) -> bool {
    eg[s[super::var("?w")]].data.flags().weight
}

pub fn rules() -> Vec<Rule> {
    vec![
        rw!("column-parallel-matmul"; "(shard ?m ?a (matmul ?n ?x ?w))" => { PushShard { op: "matmul", operands: &["?x", "?w"] } } if when(output_columns)),
        rw!("batch-parallel-matmul"; "(shard ?m ?a (matmul ?n ?x ?w))" => { PushShard { op: "matmul", operands: &["?x", "?w"] } } if when(not_output_columns)),
        rw!("row-parallel-matmul"; "(partial ?m (matmul ?n ?x ?w))" => { PushPartial { op: "matmul", operands: &["?x", "?w"] } } if when(contracts_weight)),
    ]
}
