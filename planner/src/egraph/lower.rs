//! IR region → e-graph: one tagged e-node per op output, `(arg i)` for the
//! region's arguments, and the context (shapes, ops) the analysis reads.

use super::analysis::{Context, OpInfo, ShardGraph};
use super::lang::{OpTag, ShardLang};
use super::ShardError;
use dplc_ir::{Graph, Op, RegionId, TensorId};
use egg::Id;
use std::collections::{BTreeMap, HashMap};

pub fn op_table(g: &Graph, region: RegionId) -> BTreeMap<dplc_ir::NodeId, OpInfo> {
    let shape = |t: &TensorId| g.tensor(*t).shape.dims().to_vec();
    g.region(region)
        .nodes
        .iter()
        .map(|&n| {
            let node = g.node(n);
            let info = OpInfo {
                op: node.op.clone(),
                inputs: node.inputs.clone(),
                outputs: node.outputs.clone(),
                in_shapes: node.inputs.iter().map(shape).collect(),
                out_shapes: node.outputs.iter().map(shape).collect(),
            };
            (n, info)
        })
        .collect()
}

/// Add the region's ops to `eg`; returns the e-class of every tensor.
pub fn lower(
    g: &Graph,
    region: RegionId,
    ctx: &Context,
    eg: &mut ShardGraph,
) -> Result<HashMap<TensorId, Id>, ShardError> {
    let mut class: HashMap<TensorId, Id> = HashMap::new();
    for (i, &a) in g.region(region).args.iter().enumerate() {
        let k = eg.add(ShardLang::Num(i as i64));
        class.insert(a, eg.add(ShardLang::Arg(k)));
    }
    for (&n, info) in &ctx.ops {
        let mut operands = Vec::with_capacity(info.inputs.len());
        for t in &info.inputs {
            let id = class.get(t).copied().ok_or_else(|| {
                ShardError::Lowering(format!(
                    "{n} reads {t}, which is neither an argument nor computed in the region"
                ))
            })?;
            operands.push(id);
        }
        for (k, &out) in info.outputs.iter().enumerate() {
            let tag = eg.add(ShardLang::Tag(OpTag {
                node: n,
                output: k as u8,
            }));
            let mut ch = vec![tag];
            ch.extend(&operands);
            let arr = |ch: &[Id]| -> Vec<Id> { ch.to_vec() };
            let node = match &info.op {
                Op::Input(_) | Op::Constant(_) | Op::Iota { .. } => ShardLang::Leaf(tag),
                Op::Param(_) => ShardLang::Param(tag),
                Op::Unary(_) | Op::Cast(_) | Op::Dropout { .. } | Op::CausalMask => {
                    ShardLang::Unary([ch[0], ch[1]])
                }
                Op::Binary(_) => ShardLang::Binary([ch[0], ch[1], ch[2]]),
                Op::MatMul => ShardLang::MatMul([ch[0], ch[1], ch[2]]),
                Op::LayerNorm { .. } | Op::RmsNorm { .. } => ShardLang::Norm(arr(&ch).into()),
                Op::Softmax { .. } | Op::LogSoftmax { .. } => ShardLang::Softmax([ch[0], ch[1]]),
                Op::Reshape { .. } => ShardLang::Reshape([ch[0], ch[1]]),
                Op::Transpose { .. } => ShardLang::Transpose([ch[0], ch[1]]),
                Op::Expand { .. } => ShardLang::Expand([ch[0], ch[1]]),
                // A pad or a running sum along an axis is pushed through as a
                // slice is: any split but of its own axis.
                Op::Slice { .. } | Op::Pad { .. } | Op::CumSum { .. } => {
                    ShardLang::Slice([ch[0], ch[1]])
                }
                Op::Concat { .. } => ShardLang::Concat(arr(&ch).into()),
                Op::Reduce { .. } => ShardLang::Reduce([ch[0], ch[1]]),
                Op::Embedding => ShardLang::Embedding([ch[0], ch[1], ch[2]]),
                Op::TakeAlong => ShardLang::TakeAlong([ch[0], ch[1], ch[2]]),
                Op::TopK { .. } => ShardLang::TopK([ch[0], ch[1]]),
                Op::MoeDispatch { .. } => ShardLang::MoeDispatch([ch[0], ch[1], ch[2]]),
                Op::MoeCombine => ShardLang::MoeCombine([ch[0], ch[1], ch[2], ch[3]]),
                // A select runs whole on every rank (its operands gathered).
                Op::Select | Op::Repeat { .. } | Op::Relayout { .. } | Op::VocabParallel(_) => {
                    ShardLang::Opaque(arr(&ch).into())
                }
            };
            class.insert(out, eg.add(node));
        }
    }
    eg.rebuild();
    Ok(class)
}
