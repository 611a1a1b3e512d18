//! The stable textual form of a graph, read by golden tests.
//! One line per node: `%out = op[attrs](%inputs) : type   @scope`; repeat bodies nest.

use crate::{Graph, Op, RegionId, TensorId};
use std::fmt::Write;

/// Column where the `@scope` tag starts, so diffs of golden files stay aligned.
const SCOPE_COLUMN: usize = 78;

/// Print `graph` in the textual IR.
pub fn print_graph(graph: &Graph) -> String {
    let mut out = String::new();
    let syms = graph.sym_names().join(", ");
    writeln!(out, "model {} ({} params)", graph.name, graph.param_count()).unwrap();
    if !syms.is_empty() {
        writeln!(out, "  syms {syms}").unwrap();
    }
    print_region(graph, graph.root(), 1, &mut out);
    out
}

fn print_region(graph: &Graph, region: RegionId, depth: usize, out: &mut String) {
    let indent = "  ".repeat(depth);
    let reg = graph.region(region);
    if !reg.args.is_empty() {
        let args: Vec<String> = reg.args.iter().map(|&t| typed(graph, t)).collect();
        writeln!(out, "{indent}^({})", args.join(", ")).unwrap();
    }
    for &n in &reg.nodes {
        let node = graph.node(n);
        let outs: Vec<String> = node.outputs.iter().map(|t| t.to_string()).collect();
        let ins: Vec<String> = node.inputs.iter().map(|t| t.to_string()).collect();
        let types: Vec<String> = node.outputs.iter().map(|&t| type_str(graph, t)).collect();
        let mut line = format!("{indent}{} = {}", outs.join(", "), op_str(graph, &node.op));
        if !ins.is_empty() {
            write!(line, "({})", ins.join(", ")).unwrap();
        }
        write!(line, " : {}", types.join(", ")).unwrap();
        if let Op::Param(p) = node.op {
            write!(line, " = {}", graph.param(p).init).unwrap();
        }
        let path = graph.scope_path(node.scope);
        if !path.is_empty() {
            let pad = SCOPE_COLUMN.saturating_sub(line.chars().count()).max(2);
            write!(line, "{}@{path}", " ".repeat(pad)).unwrap();
        }
        if let Op::Repeat { body, .. } = node.op {
            writeln!(out, "{line} {{").unwrap();
            print_region(graph, body, depth + 1, out);
            writeln!(out, "{indent}}}").unwrap();
        } else {
            writeln!(out, "{line}").unwrap();
        }
    }
    let results: Vec<String> = reg.results.iter().map(|t| t.to_string()).collect();
    let keyword = if reg.parent.is_none() {
        "return"
    } else {
        "yield"
    };
    writeln!(out, "{indent}{keyword} {}", results.join(", ")).unwrap();
}

fn type_str(graph: &Graph, t: TensorId) -> String {
    let tensor = graph.tensor(t);
    format!("{}{}", tensor.dtype, graph.shape_str(&tensor.shape))
}

fn typed(graph: &Graph, t: TensorId) -> String {
    format!("{t}: {}", type_str(graph, t))
}

fn op_str(graph: &Graph, op: &Op) -> String {
    let name = op.name();
    match op {
        Op::Input(i) => format!("input {}", graph.input(*i).name),
        Op::Param(p) => format!("param {}", graph.param(*p).name),
        Op::Constant(v) => format!("const {v}"),
        Op::Iota { len } => format!("iota[{}]", graph.dim_str(len)),
        Op::Cast(to) => format!("cast[{to}]"),
        Op::Transpose { perm } => {
            let p: Vec<String> = perm.iter().map(|a| a.to_string()).collect();
            format!("transpose[{}]", p.join(", "))
        }
        Op::Slice { axis, start, len } => format!(
            "slice[axis={axis}, {start}..{}]",
            start.saturating_add(*len)
        ),
        Op::Pad {
            axis,
            before,
            after,
            value,
        } => format!("{name}[axis={axis}, {before}, {after}, value={value}]"),
        Op::CumSum { axis, reverse } => format!(
            "{name}[axis={axis}{}]",
            if *reverse { ", reverse" } else { "" }
        ),
        Op::Concat { axis } | Op::Softmax { axis } | Op::LogSoftmax { axis } => {
            format!("{name}[axis={axis}]")
        }
        Op::Reduce { axis, keep_dim, .. } => {
            format!(
                "{name}[axis={axis}{}]",
                if *keep_dim { ", keep" } else { "" }
            )
        }
        Op::LayerNorm { eps } | Op::RmsNorm { eps } => format!("{name}[eps={eps:e}]"),
        Op::Dropout { p, context, split } => {
            let mut s = format!("{name}[p={p}");
            if let Some(axis) = context {
                s += &format!(", context={axis}");
            }
            if let Some(axis) = split {
                s += &format!(", split={axis}");
            }
            s + "]"
        }
        Op::TopK { k } => format!("{name}[k={k}]"),
        Op::MoeDispatch {
            experts,
            capacity_factor,
        } => {
            format!("{name}[experts={experts}, capacity_factor={capacity_factor}]")
        }
        Op::Repeat { count, carried, .. } => format!("{name}[count={count}, carried={carried}]"),
        Op::Relayout { from, to, grad } => format!("{name}[{from} -> {to}, grad {grad}]"),
        Op::VocabParallel(v) => format!("{name}[{}]", op_str(graph, &v.whole())),
        Op::Unary(_)
        | Op::Binary(_)
        | Op::MatMul
        | Op::Reshape { .. }
        | Op::Expand { .. }
        | Op::CausalMask
        | Op::Select
        | Op::Embedding
        | Op::TakeAlong
        | Op::MoeCombine => name.to_string(),
    }
}
