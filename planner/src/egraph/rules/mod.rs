//! The rewrite rules, one family per file, one rule per line; the conditions
//! and the two appliers that push a layout from an op's output to its operands.

pub mod attention;
pub mod context;
pub mod elementwise;
pub mod matmul;
pub mod moe;
pub mod partial;
pub mod vocab;

use super::analysis::{mesh_of, num_of, operand_options, tag_of, Part, ShardAnalysis, ShardGraph};
use super::lang::{MeshAxis, ShardLang};
use dplc_ir::Op;
use egg::{Applier, Id, PatternAst, Subst, Symbol, Var};

pub type Rule = egg::Rewrite<ShardLang, ShardAnalysis>;

/// Every rule of every family.
pub fn all_rules() -> Vec<Rule> {
    let mut rules = Vec::new();
    rules.extend(elementwise::rules());
    rules.extend(matmul::rules());
    rules.extend(partial::rules());
    rules.extend(attention::rules());
    rules.extend(vocab::rules());
    rules.extend(moe::rules());
    rules.extend(context::rules());
    rules
}

pub(crate) fn var(s: &str) -> Var {
    s.parse().expect("pattern variables are written `?name`")
}

/// Push `(shard ?m ?a (op ?n operands…))` into the operands: build the op on
/// the operand parts [`operand_options`] asks for. Splits that do not divide,
/// and token-dim splits outside sequence parallelism, are not written.
pub struct PushShard {
    pub op: &'static str,
    pub operands: &'static [&'static str],
}

/// Push `(partial ?m (op ?n operands…))` into the operands the same way.
pub struct PushPartial {
    pub op: &'static str,
    pub operands: &'static [&'static str],
}

fn push(
    eg: &mut ShardGraph,
    eclass: Id,
    subst: &Subst,
    op: &str,
    operands: &[&str],
    m: MeshAxis,
    want: Part,
) -> Vec<Id> {
    let ctx = eg.analysis.ctx.clone();
    if eg[eclass].data.layout().is_none() {
        return vec![];
    }
    let tag_id = subst[var("?n")];
    let Some(tag) = tag_of(eg, tag_id) else {
        return vec![];
    };
    if ctx.degree(m) < 2 {
        return vec![];
    }
    let info = ctx.op(tag);
    let Some(parts) = operand_options(&ctx, tag, want).into_iter().next() else {
        return vec![];
    };
    if parts.len() != operands.len() {
        return vec![];
    }
    let cheap = matches!(
        info.op,
        Op::Unary(_)
            | Op::Binary(_)
            | Op::Cast(_)
            | Op::Dropout { .. }
            | Op::LayerNorm { .. }
            | Op::RmsNorm { .. }
    );
    let mut children = vec![tag_id];
    for (v, part) in operands.iter().zip(parts) {
        let x = subst[var(v)];
        let whole = eg[x]
            .data
            .layout()
            .is_some_and(|l| l.get(m) == Part::Replicated);
        if part != Part::Replicated && !whole {
            return vec![];
        }
        let child = match part {
            Part::Replicated => x,
            Part::Partial => {
                let mesh = eg.add(ShardLang::Mesh(m));
                eg.add(ShardLang::Partial([mesh, x]))
            }
            Part::Sharded(a) => {
                let shape = eg[x].data.shape().to_vec();
                if !ctx.splits(&shape, a, m) {
                    return vec![];
                }
                let token = ctx.is_token_dim(&shape, a);
                if token
                    && !(m == MeshAxis::Tp && ctx.sequence_parallel && cheap)
                    && m != MeshAxis::Cp
                {
                    return vec![];
                }
                let mesh = eg.add(ShardLang::Mesh(m));
                let axis = eg.add(ShardLang::Num(a as i64));
                eg.add(ShardLang::Shard([mesh, axis, x]))
            }
        };
        children.push(child);
    }
    let Ok(node) = <ShardLang as egg::FromOp>::from_op(op, children) else {
        return vec![];
    };
    let id = eg.add(node);
    if eg.union(eclass, id) {
        vec![eclass]
    } else {
        vec![]
    }
}

impl Applier<ShardLang, ShardAnalysis> for PushShard {
    fn apply_one(
        &self,
        eg: &mut ShardGraph,
        eclass: Id,
        subst: &Subst,
        _: Option<&PatternAst<ShardLang>>,
        _: Symbol,
    ) -> Vec<Id> {
        let (Some(m), Some(a)) = (mesh_of(eg, subst[var("?m")]), num_of(eg, subst[var("?a")]))
        else {
            return vec![];
        };
        push(
            eg,
            eclass,
            subst,
            self.op,
            self.operands,
            m,
            Part::Sharded(a as usize),
        )
    }
}

impl Applier<ShardLang, ShardAnalysis> for PushPartial {
    fn apply_one(
        &self,
        eg: &mut ShardGraph,
        eclass: Id,
        subst: &Subst,
        _: Option<&PatternAst<ShardLang>>,
        _: Symbol,
    ) -> Vec<Id> {
        let Some(m) = mesh_of(eg, subst[var("?m")]) else {
            return vec![];
        };
        push(eg, eclass, subst, self.op, self.operands, m, Part::Partial)
    }
}

type Cond = fn(&mut ShardGraph, Id, &Subst) -> bool;

/// A named condition: `when(fn)` keeps rule lines short.
pub fn when(f: Cond) -> Cond {
    f
}

/// The matched class is computable and whole over `m` (a seed's precondition).
pub(crate) fn whole_over(eg: &ShardGraph, id: Id, m: MeshAxis) -> bool {
    eg[id]
        .data
        .layout()
        .is_some_and(|l| l.get(m) == Part::Replicated)
}

pub(crate) fn op_of(eg: &ShardGraph, subst: &Subst) -> Option<Op> {
    let tag = tag_of(eg, subst[var("?n")])?;
    Some(eg.analysis.ctx.op(tag).op.clone())
}

pub(crate) fn axis(eg: &ShardGraph, subst: &Subst) -> Option<usize> {
    num_of(eg, subst[var("?a")]).map(|a| a as usize)
}

/// The op's own axis (softmax, reduce, concat, slice), if it has one.
pub(crate) fn op_axis(op: &Op) -> Option<usize> {
    match op {
        Op::Softmax { axis } | Op::LogSoftmax { axis } | Op::Concat { axis } => Some(*axis),
        Op::Reduce { axis, .. }
        | Op::Slice { axis, .. }
        | Op::Pad { axis, .. }
        | Op::CumSum { axis, .. } => Some(*axis),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_rule_set_builds() {
        let families: [(&str, Vec<Rule>); 7] = [
            ("elementwise", elementwise::rules()),
            ("matmul", matmul::rules()),
            ("partial", partial::rules()),
            ("attention", attention::rules()),
            ("vocab", vocab::rules()),
            ("moe", moe::rules()),
            ("context", context::rules()),
        ];
        let mut names = std::collections::BTreeSet::new();
        for (family, rules) in &families {
            assert!(!rules.is_empty(), "family {family} has rules");
            for r in rules {
                let name = r.name.to_string();
                assert!(
                    name.chars()
                        .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-'),
                    "rule names are kebab-case: {name}"
                );
                assert!(names.insert(name.clone()), "rule {name} is defined once");
            }
        }
        assert_eq!(all_rules().len(), names.len());
    }
}
