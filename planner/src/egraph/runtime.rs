//! The extracted program in the runtime's terms: each IR node's layout and
//! the parameters stored split (`dplc_ir::RegionLayout`), or `None` where the
//! program needs a layout the runtime has no word for. The planner prices
//! only programs that translate (DESIGN's layout invariant).

use super::*;

/// A region's layout in the runtime's terms, and the parameters stored split.
#[derive(Clone, Debug, PartialEq)]
pub struct RuntimeLayout {
    pub region: dplc_ir::RegionLayout,
    pub params: Vec<dplc_ir::ParamSplit>,
}

/// What one rank holds of a class, as the runtime says it; `None` where the
/// runtime has no word for it (a context split, experts split over tp too,
/// or a split over ep of another axis than the experts').
fn runtime_part(data: &Data) -> Option<dplc_ir::TensorLayout> {
    use dplc_ir::TensorLayout as L;
    let l = data.layout()?;
    if l.get(MeshAxis::Cp) != Part::Replicated {
        return None;
    }
    match (l.get(MeshAxis::Ep), l.get(MeshAxis::Tp)) {
        (Part::Replicated, Part::Replicated) => Some(L::Replicated),
        (Part::Replicated, Part::Sharded(axis)) => Some(L::Split { axis }),
        (Part::Replicated, Part::Partial) => Some(L::Partial),
        (Part::Sharded(0), Part::Replicated) => Some(L::Experts),
        _ => None,
    }
}

/// Translate the extracted program into per-node layouts: every IR node the
/// program computes reads its operands in the layouts of the operand values
/// and yields its value's layout; the runtime converts wherever a value is
/// read in another layout than it was made in, so nodes the program does not
/// mention run whole. `None` when the program needs what the runtime cannot
/// express: an expert or context split, a node computed in two layouts, a
/// nested `repeat`.
pub(super) fn runtime_layout(
    g: &Graph,
    region: RegionId,
    eg: &ShardGraph,
    p: &Program,
) -> Option<RuntimeLayout> {
    use dplc_ir::{NodeLayout, ParamSplit, SplitAxis, TensorLayout as L};
    let ctx = &eg.analysis.ctx;
    let reg = g.region(region);
    let mut nodes: BTreeMap<dplc_ir::NodeId, (Vec<L>, Vec<Option<L>>)> = BTreeMap::new();
    let mut params: BTreeMap<ParamId, SplitAxis> = BTreeMap::new();
    for &c in &p.order {
        let n = &p.choice[&c];
        if let ShardLang::Shard([m, a, x]) = n {
            if CostModel::stored_shard(eg, n) && eg[*x].data.flags().weight {
                let split = match (mesh_of(eg, *m), num_of(eg, *a)) {
                    (Some(MeshAxis::Tp), Some(a)) => SplitAxis::Tensor { axis: a as usize },
                    // Experts over ep: the leading axis, the weight whole over tp.
                    (Some(MeshAxis::Ep), Some(0)) if runtime_part(&eg[c].data)? == L::Experts => {
                        SplitAxis::Expert
                    }
                    _ => return None,
                };
                // Only a parameter stored split as it is (no view between).
                let direct = eg[*x].nodes.iter().find_map(|xn| match xn {
                    ShardLang::Param(tag) => match ctx.op(tag_of(eg, *tag)?).op {
                        Op::Param(p) => Some(p),
                        _ => None,
                    },
                    _ => None,
                });
                let p = direct?;
                if params.insert(p, split).is_some_and(|old| old != split) {
                    return None;
                }
            }
            continue;
        }
        let Some((tag, operands)) = n.tagged() else {
            continue;
        };
        let tag = tag_of(eg, tag)?;
        let info = ctx.op(tag);
        // The root's layer stack: the body's layout says how it runs
        // (`layouts::model_layout`); a nested repeat the runtime cannot split.
        if matches!(info.op, Op::Repeat { .. }) {
            if region == g.root() {
                continue;
            }
            return None;
        }
        let inputs: Vec<L> = operands
            .iter()
            .map(|&o| runtime_part(&eg[o].data))
            .collect::<Option<_>>()?;
        let out = runtime_part(&eg[c].data)?;
        let node = g.node(tag.node);
        if inputs.len() != node.inputs.len() {
            return None;
        }
        let entry = nodes
            .entry(tag.node)
            .or_insert_with(|| (inputs.clone(), vec![None; node.outputs.len()]));
        if matches!(info.op, Op::Param(_)) {
            continue;
        }
        if entry.0 != inputs {
            // A node the program computes in two layouts runs once, whole,
            // where one of the two is: its other readers take their part of
            // the whole value (a slice, no communication), which costs no
            // more than the second computation the search priced.
            let whole = |ls: &[L]| ls.iter().all(|&l| l == L::Replicated);
            if whole(&inputs) && out == L::Replicated {
                *entry = (inputs, vec![None; node.outputs.len()]);
            } else if whole(&entry.0) {
                continue;
            } else {
                return None;
            }
        }
        match entry.1.get_mut(tag.output as usize) {
            Some(slot @ None) => *slot = Some(out),
            Some(Some(prev)) if *prev == out => {}
            _ => return None,
        }
    }
    let rep = |k: usize| vec![L::Replicated; k];
    let node_layouts = reg
        .nodes
        .iter()
        .map(|&n| {
            let node = g.node(n);
            match (&node.op, nodes.get(&n)) {
                (Op::Param(p), _) => NodeLayout {
                    node: n,
                    inputs: Vec::new(),
                    outputs: vec![match params.get(p) {
                        None => L::Replicated,
                        Some(&SplitAxis::Tensor { axis }) => L::Split { axis },
                        Some(SplitAxis::Expert) => L::Experts,
                    }],
                },
                (_, Some((inputs, outs))) => NodeLayout {
                    node: n,
                    inputs: inputs.clone(),
                    outputs: outs.iter().map(|o| o.unwrap_or(L::Replicated)).collect(),
                },
                (_, None) => NodeLayout {
                    node: n,
                    inputs: rep(node.inputs.len()),
                    outputs: rep(node.outputs.len()),
                },
            }
        })
        .collect();
    let args: Vec<L> = ctx
        .local_args
        .iter()
        .map(|s| s.map_or(L::Replicated, |axis| L::Split { axis }))
        .collect();
    let results = p
        .roots
        .iter()
        .map(|&r| runtime_part(&eg[r].data))
        .collect::<Option<Vec<L>>>()?;
    Some(RuntimeLayout {
        region: dplc_ir::RegionLayout {
            region,
            args,
            nodes: node_layouts,
            results,
        },
        params: params
            .into_iter()
            .map(|(param, split)| ParamSplit { param, split })
            .collect(),
    })
}
