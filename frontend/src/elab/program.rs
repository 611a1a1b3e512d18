//! The parsed program (std and user files, blocks, models, variants and
//! sections) and how a model name resolves through its variants.

use super::*;

/// Everything parsed: std and user files, indexed by name.
pub struct Program {
    pub sources: Vec<Source>,
    /// Files with an id below this are the standard library.
    pub std_files: u16,
    pub std_blocks: HashMap<String, FnDef>,
    pub user_blocks: HashMap<String, FnDef>,
    pub models: Vec<FnDef>,
    pub variants: Vec<Variant>,
    pub trains: Vec<Section>,
    pub clusters: Vec<Section>,
}

impl Program {
    pub fn is_std(&self, file: FileId) -> bool {
        file.0 < self.std_files
    }

    pub fn text(&self, span: Span) -> &str {
        self.sources
            .get(span.file.0 as usize)
            .and_then(|s| s.text.get(span.start..span.end))
            .unwrap_or("")
    }

    /// `line:column` of the start of `span`, as a diagnostic's header shows it.
    pub fn line_col(&self, span: Span) -> String {
        let text = self
            .sources
            .get(span.file.0 as usize)
            .map_or("", |s| s.text.as_str());
        crate::diag::line_col(text, span.start)
    }

    /// Model and variant names in source order.
    pub fn model_names(&self) -> Vec<String> {
        let mut named: Vec<(usize, String)> = self
            .models
            .iter()
            .map(|m| (m.span.start, m.name.name.clone()))
            .chain(
                self.variants
                    .iter()
                    .map(|v| (v.span.start, v.name.name.clone())),
            )
            .collect();
        named.sort();
        named.into_iter().map(|(_, n)| n).collect()
    }

    /// The model definition behind `name` and the variant arguments on the way,
    /// innermost variant first (later arguments win).
    pub fn resolve_model<'p>(&'p self, name: &str, at: Span) -> Res<(&'p FnDef, Vec<&'p Arg>)> {
        let (model, chain) = self.variant_chain(name, at)?;
        let overrides = chain.iter().rev().flat_map(|v| &v.args).collect();
        Ok((model, overrides))
    }

    /// The variants from `name` down to the model they are based on,
    /// outermost first: the one walk that variant lookups share.
    fn variant_chain<'p>(&'p self, name: &str, at: Span) -> Res<(&'p FnDef, Vec<&'p Variant>)> {
        let mut chain: Vec<&Variant> = Vec::new();
        let (mut current, mut at) = (name, at);
        loop {
            if let Some(m) = self.models.iter().find(|m| m.name.name == current) {
                return Ok((m, chain));
            }
            let Some(v) = self.variants.iter().find(|v| v.name.name == current) else {
                return Err(self.unknown_model(current, at));
            };
            if let Some(first) = chain.iter().position(|c| c.name.name == current) {
                let cycle: Vec<String> = chain[first..]
                    .iter()
                    .map(|c| format!("`{}`", c.name.name))
                    .chain([format!("`{current}`")])
                    .collect();
                return Err(Diag::new(
                    "dpl::variant-cycle",
                    at,
                    format!(
                        "model `{current}` is a variant of itself: {}",
                        cycle.join(" → ")
                    ),
                )
                .label(format!("back to `{current}`: this chain of variants loops"))
                .help("base the first variant of the loop on a model defined with a body"));
            }
            if chain.len() == MAX_VARIANT_DEPTH {
                return Err(Diag::new(
                    "dpl::variant-depth",
                    at,
                    format!(
                        "variant chain deeper than {MAX_VARIANT_DEPTH}: `{name}` → `{}` → … → `{current}` → …",
                        chain[1].name.name
                    ),
                )
                .label(format!("variant {} of the chain", MAX_VARIANT_DEPTH + 1))
                .help(format!(
                    "base a variant directly on the model: at most {MAX_VARIANT_DEPTH} variants may stand between a name and its model"
                )));
            }
            chain.push(v);
            current = &v.base.name;
            at = v.base.span;
        }
    }

    pub fn unknown_model(&self, name: &str, at: Span) -> Box<Diag> {
        let names = self.model_names();
        let mut d = Diag::new("dpl::unknown-model", at, format!("unknown model `{name}`"))
            .label("no model has this name");
        let list = if names.is_empty() {
            "this file defines no models".to_string()
        } else {
            format!("models in this file: {}", names.join(", "))
        };
        d = match did_you_mean(name, names.iter().map(String::as_str)) {
            Some(s) => d.help(format!("{s} {list}")),
            None => d.help(list),
        };
        d
    }

    /// The `train` section for `model`, looked up through its variant chain:
    /// its own, else the nearest base's.
    pub fn train_for(&self, model: &str) -> Option<&Section> {
        let anywhere = Span {
            file: FileId(self.std_files),
            start: 0,
            end: 0,
        };
        let bases = match self.variant_chain(model, anywhere) {
            Ok((_, chain)) => chain.iter().map(|v| v.base.name.as_str()).collect(),
            Err(_) => Vec::new(),
        };
        std::iter::once(model)
            .chain(bases)
            .find_map(|n| self.trains.iter().find(|t| t.name.name == n))
    }
}

/// A model lowered to a graph, with its resolved arguments.
pub struct LoweredModel {
    pub graph: Graph,
    pub args: Vec<(String, Value)>,
}
