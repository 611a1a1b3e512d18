//! The .dpl frontend: parses a file together with the standard library,
//! reports problems as source-pointing diagnostics, and lowers models to the IR.
//!
//! ```text
//! let unit = dplc_frontend::parse("gpt2.dpl", &text)?;
//! let lowered = unit.lower("gpt2")?;   // Graph + TrainSpec + resolved args
//! ```

mod ast;
mod builtins;
mod diag;
mod elab;
mod lowering;
mod section;
mod syntax;
mod value;

pub use diag::{Diagnostic, Diagnostics};
pub use elab::MAX_REPEAT;
pub use syntax::is_name;

use ast::{FileId, Item, Span};
use diag::{Diag, DiagExt, Res, Source};
use elab::{Elab, Program};
use std::collections::HashMap;
use std::sync::Arc;

/// The standard library, loaded before every user file.
const STD: &[(&str, &str)] = &[
    ("std/layers.dpl", include_str!("../std/layers.dpl")),
    ("std/attention.dpl", include_str!("../std/attention.dpl")),
    ("std/moe.dpl", include_str!("../std/moe.dpl")),
    ("std/loss.dpl", include_str!("../std/loss.dpl")),
];

/// A parsed user file with the standard library, ready to lower.
pub struct Unit {
    prog: Program,
}

/// A model lowered to the IR.
#[derive(Debug)]
pub struct Lowered {
    pub graph: dplc_ir::Graph,
    pub train: dplc_ir::TrainSpec,
    /// The model's arguments after defaults and variant overrides, printable.
    pub args: Vec<(String, String)>,
}

/// Parse `text` (shown as `file_name` in diagnostics) together with the std library.
pub fn parse(file_name: &str, text: &str) -> Result<Unit, Diagnostics> {
    let mut sources: Vec<Source> = STD
        .iter()
        .map(|(n, t)| Source {
            name: n.to_string(),
            text: Arc::new(t.to_string()),
        })
        .collect();
    sources.push(Source {
        name: file_name.to_string(),
        text: Arc::new(text.to_string()),
    });
    let std_files = STD.len() as u16;
    let mut prog = Program {
        sources,
        std_files,
        std_blocks: HashMap::new(),
        user_blocks: HashMap::new(),
        models: Vec::new(),
        variants: Vec::new(),
        trains: Vec::new(),
        clusters: Vec::new(),
    };
    let mut errors = Vec::new();
    for i in 0..prog.sources.len() {
        let file = FileId(i as u16);
        let text = prog.sources[i].text.clone();
        match syntax::parse_file(file, &text) {
            Ok(items) => {
                if let Err(e) = register(&mut prog, file, items) {
                    errors.push(e);
                }
            }
            Err(e) => errors.push(e),
        }
    }
    if !errors.is_empty() {
        return Err(Diagnostics::new(&prog.sources, errors));
    }
    Ok(Unit { prog })
}

/// File the items of one file into the program, refusing duplicates.
fn register(prog: &mut Program, file: FileId, items: Vec<Item>) -> Res<()> {
    let is_std = prog.is_std(file);
    for item in items {
        match item {
            Item::Block(b) => {
                if builtins::find(&b.name.name).is_some() {
                    return Err(Diag::new(
                        "dpl::shadows-builtin",
                        b.name.span,
                        format!("`{}` is a builtin and cannot be redefined", b.name.name),
                    )
                    .label("choose another name"));
                }
                check_formals(&b, true)?;
                let table = if is_std {
                    &mut prog.std_blocks
                } else {
                    &mut prog.user_blocks
                };
                if let Some(prev) = table.get(&b.name.name) {
                    return Err(duplicate(
                        "block",
                        &b.name.name,
                        b.name.span,
                        prev.name.span,
                    ));
                }
                table.insert(b.name.name.clone(), b);
            }
            Item::Model(m) if !is_std => {
                check_formals(&m, false)?;
                elab::check_model_defaults(&m)?;
                if let Some(prev) = model_span(prog, &m.name.name) {
                    return Err(duplicate("model", &m.name.name, m.name.span, prev));
                }
                prog.models.push(m);
            }
            Item::Variant(v) if !is_std => {
                if let Some(prev) = model_span(prog, &v.name.name) {
                    return Err(duplicate("model", &v.name.name, v.name.span, prev));
                }
                prog.variants.push(v);
            }
            Item::Train(t) if !is_std => {
                if let Some(prev) = prog.trains.iter().find(|p| p.name.name == t.name.name) {
                    return Err(duplicate(
                        "train section for",
                        &t.name.name,
                        t.name.span,
                        prev.name.span,
                    ));
                }
                prog.trains.push(t);
            }
            Item::Cluster(c) if !is_std => {
                if let Some(prev) = prog.clusters.iter().find(|p| p.name.name == c.name.name) {
                    return Err(duplicate(
                        "cluster",
                        &c.name.name,
                        c.name.span,
                        prev.name.span,
                    ));
                }
                prog.clusters.push(c);
            }
            Item::Model(_) | Item::Variant(_) | Item::Train(_) | Item::Cluster(_) => {}
        }
    }
    Ok(())
}

fn model_span(prog: &Program, name: &str) -> Option<Span> {
    prog.models
        .iter()
        .map(|m| &m.name)
        .chain(prog.variants.iter().map(|v| &v.name))
        .find(|n| n.name == name)
        .map(|n| n.span)
}

fn duplicate(what: &str, name: &str, at: Span, prev: Span) -> Box<Diag> {
    Diag::new(
        "dpl::duplicate",
        at,
        format!("{what} `{name}` is defined twice"),
    )
    .label("defined again here")
    .note(prev, "first defined here")
}

fn check_formals(def: &ast::FnDef, block: bool) -> Res<()> {
    for (i, f) in def.formals.iter().enumerate() {
        if def.formals[..i].iter().any(|g| g.name.name == f.name.name) {
            return Err(Diag::new(
                "dpl::duplicate",
                f.name.span,
                format!("parameter `{}` is listed twice", f.name.name),
            )
            .label("listed again here"));
        }
        if block && f.name.name == "name" {
            return Err(Diag::new(
                "dpl::reserved",
                f.name.span,
                "`name` is reserved: every block call accepts `name = \"…\"` to name its scope",
            )
            .label("reserved parameter name"));
        }
    }
    Ok(())
}

/// A span standing for "no particular place": the start of the user file.
fn nowhere(prog: &Program) -> Span {
    Span {
        file: FileId(prog.std_files),
        start: 0,
        end: 0,
    }
}

impl Unit {
    /// Models and variants of the user file, in source order.
    pub fn model_names(&self) -> Vec<String> {
        self.prog.model_names()
    }

    /// Lower `model` with its default arguments (and its variant's overrides).
    pub fn lower(&self, model: &str) -> Result<Lowered, Diagnostics> {
        self.lower_inner(model)
            .map_err(|d| Diagnostics::one(&self.prog.sources, d))
    }

    /// Lower `model` for a training step, as `compile` plans one: it must
    /// have parameters and return a scalar float loss first
    /// ([`dplc_ir::validate::trainable`]). The error points at the model's
    /// `return` where the loss is wrong, else at its name.
    pub fn lower_to_train(&self, model: &str) -> Result<Lowered, Diagnostics> {
        let lowered = self.lower(model)?;
        // A dimension without a value comes first: the planner names it and
        // says how to bind it, and a loss's shape cannot be judged without it.
        if lowered.graph.unbound_dims().is_empty() {
            dplc_ir::validate::trainable(&lowered.graph).map_err(|why| {
                Diagnostics::one(&self.prog.sources, self.untrainable(model, why))
            })?;
        }
        Ok(lowered)
    }

    fn untrainable(&self, model: &str, why: dplc_ir::validate::Untrainable) -> Box<Diag> {
        use dplc_ir::validate::Untrainable;
        let name = model_span(&self.prog, model).unwrap_or_else(|| nowhere(&self.prog));
        let (at, label) = match why {
            Untrainable::NoParams { .. } => (name, "has no parameters"),
            Untrainable::NoResult { .. } | Untrainable::NotALoss { .. } => {
                let ret = self
                    .prog
                    .resolve_model(model, name)
                    .ok()
                    .and_then(|(def, _)| {
                        def.body
                            .iter()
                            .rev()
                            .find(|s| matches!(s.kind, ast::StmtKind::Return(_)))
                            .map(|s| s.span)
                    });
                (ret.unwrap_or(name), "not a scalar float loss")
            }
        };
        Diag::new("dpl::not-trainable", at, why.to_string()).label(label)
    }

    fn lower_inner(&self, model: &str) -> Res<Lowered> {
        let at = nowhere(&self.prog);
        let lowered = Elab::lower_model(&self.prog, model, at)?;
        let ctx = lowered
            .args
            .iter()
            .find_map(|(k, v)| match (k.as_str(), v) {
                ("ctx", value::Value::Int(n)) => Some(*n),
                _ => None,
            });
        let train = section::train_spec(&self.prog, self.prog.train_for(model), ctx)?;
        let args = lowered
            .args
            .iter()
            .map(|(k, v)| (k.clone(), v.show(&lowered.graph)))
            .collect();
        Ok(Lowered {
            graph: lowered.graph,
            train,
            args,
        })
    }

    /// The cluster sections of the user file, validated.
    pub fn clusters(&self) -> Result<Vec<dplc_ir::ClusterSpec>, Diagnostics> {
        self.prog
            .clusters
            .iter()
            .map(|c| section::cluster_spec(&self.prog, c))
            .collect::<Res<Vec<_>>>()
            .map_err(|d| Diagnostics::one(&self.prog.sources, d))
    }

    /// Lower every model and validate every train and cluster section; report
    /// the first problem of each.
    pub fn check(&self) -> Result<(), Diagnostics> {
        let mut errors = Vec::new();
        for v in &self.prog.variants {
            if let Err(e) = self.prog.resolve_model(&v.base.name, v.base.span) {
                errors.push(e);
            }
        }
        for t in &self.prog.trains {
            if model_span(&self.prog, &t.name.name).is_none() {
                errors.push(self.prog.unknown_model(&t.name.name, t.name.span));
            }
        }
        if !errors.is_empty() {
            return Err(Diagnostics::new(&self.prog.sources, errors));
        }
        for name in self.model_names() {
            if let Err(e) = self.lower_inner(&name) {
                errors.push(e);
            }
        }
        for c in &self.prog.clusters {
            if let Err(e) = section::cluster_spec(&self.prog, c) {
                errors.push(e);
            }
        }
        if errors.is_empty() {
            Ok(())
        } else {
            Err(Diagnostics::new(&self.prog.sources, errors))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lower(src: &str) -> Lowered {
        let unit = parse("t.dpl", src).unwrap_or_else(|d| panic!("{}", d.render_plain()));
        let name = unit.model_names()[0].clone();
        unit.lower(&name)
            .unwrap_or_else(|d| panic!("{}", d.render_plain()))
    }

    #[test]
    fn nested_repeats_capture_through_every_level() {
        let l = lower(
            "model m() { input x: f32[b, 4]  param w: [4, 4]
               repeat 3 { repeat 2 { x = x @ w } }  return x }",
        );
        let g = &l.graph;
        assert_eq!(g.regions().len(), 3);
        // Outer body: x carried + w captured; inner body the same.
        for (_, r) in g.regions().skip(1) {
            assert_eq!(r.args.len(), 2);
            assert_eq!(r.results.len(), 1);
        }
        assert_eq!(g.scope_path(g.scopes().last().unwrap().0), "repeat.repeat");
    }

    #[test]
    fn params_in_repeats_get_dotted_names_and_count_every_iteration() {
        let l = lower(
            "model m(layers = 2) { input x: f32[b, 4]
               repeat layers { x = linear(x, 4, 4, name = \"q\") }  return x }",
        );
        let names: Vec<_> = l.graph.params().map(|(_, p)| p.name.clone()).collect();
        assert_eq!(names, ["layers.q.w", "layers.q.b"]);
        assert_eq!(l.graph.param_count(), 2 * (16 + 4));
    }

    #[test]
    fn user_blocks_shadow_std_blocks_only_in_user_code() {
        let l = lower(
            "block linear(x, a, b) { return x }
             model m() { input x: f32[s, 4]  return linear(x, 4, 4) + attention(reshape(x, [1, s, 4]), 4, 2) }",
        );
        // attention's own q/k/v/o linears still come from std.
        assert_eq!(l.graph.param_count(), 4 * (16 + 4));
    }

    #[test]
    fn nesting_up_to_the_limit_parses_on_a_test_thread() {
        let depth = syntax::MAX_NESTING - 2;
        let src = format!(
            "model m() {{ x = {}1{}  param w: [x] return w }}",
            "(".repeat(depth),
            ")".repeat(depth)
        );
        assert_eq!(lower(&src).graph.param_count(), 1);
    }
}
