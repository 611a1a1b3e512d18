//! Expert parallelism: experts split over the expert axis; tokens reach their
//! experts by an all-to-all after dispatch and return by one before combine.

use super::super::analysis::{mesh_of, ShardGraph};
use super::super::lang::MeshAxis;
use super::{axis, var, when, PushPartial, Rule};
use egg::{rewrite as rw, Id, Subst};

/// A split of the experts axis over the expert mesh axis.
fn experts_axis(eg: &mut ShardGraph, _: Id, s: &Subst) -> bool {
    mesh_of(eg, s[var("?m")]) == Some(MeshAxis::Ep) && axis(eg, s) == Some(0)
}

/// Expert parallelism is on, the experts divide over it, and the expert
/// outputs are an op's (not already an all-to-all's).
fn experts_split(eg: &mut ShardGraph, id: Id, s: &Subst) -> bool {
    if !super::whole_over(eg, id, MeshAxis::Ep) {
        return false;
    }
    let y = &eg[s[var("?y")]];
    let computed = y.nodes.iter().any(|n| n.tagged().is_some());
    computed && eg.analysis.ctx.splits(y.data.shape(), 0, MeshAxis::Ep)
}

pub fn rules() -> Vec<Rule> {
    vec![
        rw!("expert-dispatch-all-to-all"; "(shard ?m ?a (moe-dispatch ?n ?x ?i))" => "(all-to-all ?m ?a (moe-dispatch ?n ?x ?i))" if when(experts_axis)),
        rw!("expert-combine-all-to-all"; "(moe-combine ?n ?y ?w ?i)" => "(moe-combine ?n (all-to-all ep 0 (shard ep 0 ?y)) ?w ?i)" if when(experts_split)),
        rw!("partial-through-combine"; "(partial ?m (moe-combine ?n ?y ?w ?i))" => { PushPartial { op: "moe-combine", operands: &["?y", "?w", "?i"] } }),
    ]
}
