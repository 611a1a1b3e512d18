//! Which parameters each rank holds: their ZeRO-3 unit, the norm's owner,
//! the data-parallel (or expert-data) group they sync over, and the part of
//! a tensor- or expert-parallel split the plan's layout gives the rank.

use super::*;

/// The parameter tensors rank `at` holds: their ZeRO-3 unit, whether it counts
/// them in the gradient norm, the data-parallel group they sync over, and the
/// part it holds of a tensor- or expert-parallel split.
pub(super) fn rank_keys(sh: &Shared, at: Coords) -> Vec<HeldParam> {
    let cfg = sh.cfg;
    let stage = at.stage;
    // Dedicated servers of the stage and part follow its workers.
    let dp_group = Group::new(
        (0..cfg.replicas() + cfg.server_replicas())
            .map(|d| Coords { dp_index: d, ..at }.rank(cfg))
            .collect(),
    );
    let expert_group = Group::new(
        (0..cfg.replicas())
            .filter(|d| d % cfg.ep == at.dp_index % cfg.ep)
            .map(|d| Coords { dp_index: d, ..at }.rank(cfg))
            .collect(),
    );
    let held = |(key, unit, owner): (ParamKey, Unit, bool)| {
        let split = sh.layouts.as_ref().and_then(|l| l.param(key.param));
        let (group, part, owner) = match split {
            None => (dp_group.clone(), None, owner && at.tp_index == 0),
            Some(SplitAxis::Tensor { axis }) => {
                (dp_group.clone(), Some((axis, cfg.tp, at.tp_index)), owner)
            }
            Some(SplitAxis::Expert) => (
                expert_group.clone(),
                Some((0, cfg.ep, at.dp_index % cfg.ep)),
                owner && at.tp_index == 0,
            ),
        };
        HeldParam {
            key,
            unit,
            norm_owner: owner,
            group,
            part,
        }
    };
    rank_stage_keys(sh, stage).into_iter().map(held).collect()
}

pub(super) fn rank_stage_keys(sh: &Shared, stage: usize) -> Vec<(ParamKey, Unit, bool)> {
    let g = sh.graph;
    let pp = sh.cfg.pp;
    let mut keys = Vec::new();
    let mut seen = HashSet::new();
    for (c, chunk) in sh
        .part
        .chunks
        .iter()
        .enumerate()
        .filter(|(c, _)| c % pp == stage)
    {
        let _ = c;
        for &n in &chunk.nodes {
            if let Op::Param(p) = g.node(n).op {
                let key = ParamKey { param: p, layer: 0 };
                if seen.insert(key) {
                    let owner = sh.tied.get(&key).is_none_or(|st| st[0] == stage);
                    keys.push((key, Unit::Root, owner));
                }
            }
        }
        // Each stack's layers this chunk runs: a parameter is keyed by its
        // stack's iteration, held with the model's number of the layer.
        for stack in &sh.part.stacks {
            let Op::Repeat { count, body, .. } = g.node(stack.node).op else {
                continue;
            };
            let from = chunk.layers.start.max(stack.first);
            let to = chunk.layers.end.min(stack.first + count);
            for (p, info) in g.params() {
                let region = g.tensor_region(info.tensor);
                if !region_within(g, region, body) {
                    continue;
                }
                let inner = g.trip_count(region) / count.max(1);
                for global in from..to {
                    let i = global - stack.first;
                    for j in 0..inner {
                        keys.push((
                            ParamKey {
                                param: p,
                                layer: i * inner + j,
                            },
                            Unit::Layer(global),
                            true,
                        ));
                    }
                }
            }
        }
    }
    keys
}

pub(super) fn region_within(g: &Graph, mut r: RegionId, outer: RegionId) -> bool {
    loop {
        if r == outer {
            return true;
        }
        match g.region(r).parent {
            Some(p) => r = p,
            None => return false,
        }
    }
}
