//! Backward collectives, derived from the forward program rather than listed:
//! each forward collective has a transpose, and a replicated value read by a
//! split computation gets a partial gradient that must be summed.

use super::analysis::{mesh_of, Part, ShardGraph};
use super::extract::{CostModel, Program};
use super::lang::{MeshAxis, ShardLang};
use super::CollectiveKind;
use egg::Id;
use std::collections::BTreeMap;

/// One backward collective: its kind, mesh axis and the class whose (full) size it moves.
#[derive(Clone, Debug, PartialEq)]
pub struct BackwardCollective {
    pub kind: CollectiveKind,
    pub mesh: MeshAxis,
    pub class: Id,
}

pub fn derive(eg: &ShardGraph, p: &Program) -> Vec<BackwardCollective> {
    let mut consumers: BTreeMap<Id, Vec<Id>> = BTreeMap::new();
    for &c in &p.order {
        for ch in CostModel::inputs(eg, &p.choice[&c]) {
            consumers.entry(eg.find(ch)).or_default().push(c);
        }
    }
    let mut out = Vec::new();
    for &c in &p.order {
        let node = &p.choice[&c];
        let data = &eg[c].data;
        // Transposes of the forward collectives.
        match node {
            ShardLang::ReduceScatter([m, _, _]) => out.push(BackwardCollective {
                kind: CollectiveKind::AllGather,
                mesh: mesh_of(eg, *m).expect("mesh"),
                class: c,
            }),
            ShardLang::AllToAll([m, _, _]) => out.push(BackwardCollective {
                kind: CollectiveKind::AllToAll,
                mesh: mesh_of(eg, *m).expect("mesh"),
                class: c,
            }),
            _ => {}
        }
        // A replicated value read by a split computation: every rank holds a
        // summand of its gradient. The transpose of an all-gather sums it into
        // shards (reduce-scatter); anything else needs the whole sum.
        let Some(layout) = data.layout() else {
            continue;
        };
        if !data.flags().grad {
            continue;
        }
        for m in MeshAxis::ALL {
            if layout.get(m) != Part::Replicated {
                continue;
            }
            let split_reader = consumers.get(&c).into_iter().flatten().any(|u| {
                let collective = matches!(
                    p.choice[u],
                    ShardLang::AllReduce(_)
                        | ShardLang::AllGather(_)
                        | ShardLang::ReduceScatter(_)
                        | ShardLang::AllToAll(_)
                );
                !collective
                    && eg[*u]
                        .data
                        .layout()
                        .is_some_and(|l| l.get(m) != Part::Replicated)
            });
            if !split_reader {
                continue;
            }
            let kind = match node {
                ShardLang::AllGather([gm, _, _]) if mesh_of(eg, *gm) == Some(m) => {
                    CollectiveKind::ReduceScatter
                }
                _ => CollectiveKind::AllReduce,
            };
            out.push(BackwardCollective {
                kind,
                mesh: m,
                class: c,
            });
        }
    }
    out
}
