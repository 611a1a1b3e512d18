//! Elaboration: runs a model's body at compile time, inlining block calls and
//! lowering each `repeat` body once into its own region, to build a `Graph`.

use crate::ast::*;
use crate::builtins::{self, MAX_DIM};
use crate::diag::{did_you_mean, Diag, DiagExt, Res, Source};
use crate::value::{arith, Value};
use dplc_ir::{
    DType, Dim, Graph, Init, IrError, Op, RegionId, ScalarArg, ScopeId, ScopeKind, Shape, TensorId,
};
use std::collections::HashMap;

/// Block calls nested deeper than this are refused (blocks are inlined).
const MAX_CALL_DEPTH: usize = 64;
/// Graphs with more nodes than this are refused: a runaway elaboration.
const MAX_NODES: usize = 500_000;
/// The most iterations a `repeat` may declare.
const MAX_REPEAT: i64 = 1_000_000;
/// The most elements one parameter may have.
const MAX_PARAM_ELEMENTS: u128 = 1 << 50;
/// `repeat` nested deeper than this is refused.
const MAX_REPEAT_NESTING: usize = 16;
/// Variants based on variants more than this deep are refused. Cycles are
/// found by name whatever the depth; this bounds the work of a file with very
/// many variants, which `Unit::check` resolves one by one.
const MAX_VARIANT_DEPTH: usize = 256;

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

/// One level of region nesting: the root region or a `repeat` body.
struct Level {
    region: RegionId,
    /// Outer tensor (as seen one level up) → this region's argument.
    captured: HashMap<TensorId, TensorId>,
    /// The outer tensors captured, in argument order.
    capture_inputs: Vec<TensorId>,
}

/// The variables of one block or model invocation.
struct Frame {
    scopes: Vec<HashMap<String, Value>>,
    /// The region depth at entry: `return` is only allowed at this depth.
    level_base: usize,
    file: FileId,
}

enum Flow {
    Next,
    Return(Value),
}

pub struct Elab<'p> {
    prog: &'p Program,
    g: Graph,
    levels: Vec<Level>,
    frames: Vec<Frame>,
    scope: ScopeId,
    /// Blocks being called, innermost last: recursion shows here.
    calls: Vec<String>,
    /// In `train` and `cluster` sections unknown names are names and calls are records.
    section_mode: bool,
    /// Where each scope name under a parent scope came from: a `name = "…"`
    /// argument, or the call or `repeat` that was named after its block.
    scope_origins: HashMap<(ScopeId, String), Span>,
    /// Where each parameter of a scope was declared, to name the first of two.
    param_origins: HashMap<(ScopeId, String), Span>,
    /// Inside a call with `share = "path"`: the call's scope, the path whose
    /// parameters it uses instead of declaring its own, and where it was said.
    sharing: Option<(ScopeId, String, Span)>,
}

/// Names every file can use: the element types.
fn global(name: &str) -> Option<Value> {
    DType::from_name(name).map(Value::DType)
}

impl<'p> Elab<'p> {
    pub fn new(prog: &'p Program, name: &str) -> Elab<'p> {
        let g = Graph::new(name);
        let (root, scope) = (g.root(), g.root_scope());
        Elab {
            prog,
            g,
            levels: vec![Level {
                region: root,
                captured: HashMap::new(),
                capture_inputs: Vec::new(),
            }],
            frames: Vec::new(),
            scope,
            calls: Vec::new(),
            section_mode: false,
            scope_origins: HashMap::new(),
            param_origins: HashMap::new(),
            sharing: None,
        }
    }

    /// An evaluator for `train` and `cluster` sections.
    pub fn for_sections(prog: &'p Program) -> Elab<'p> {
        let mut e = Elab::new(prog, "sections");
        e.section_mode = true;
        e.frames.push(Frame {
            scopes: vec![HashMap::new()],
            level_base: 1,
            file: FileId(prog.std_files),
        });
        e
    }

    pub fn graph(&self) -> &Graph {
        &self.g
    }

    // ---- models -----------------------------------------------------------

    /// Lower model `name` (a model or a variant) with its default arguments.
    pub fn lower_model(prog: &'p Program, name: &str, at: Span) -> Res<LoweredModel> {
        let (def, overrides) = prog.resolve_model(name, at)?;
        let mut e = Elab::new(prog, name);
        e.frames.push(Frame {
            scopes: vec![HashMap::new()],
            level_base: 1,
            file: def.name.span.file,
        });
        let mut args = Vec::new();
        for a in &overrides {
            let key = a.name.as_ref().ok_or_else(|| {
                Diag::new(
                    "dpl::variant-positional",
                    a.value.span,
                    "a variant takes keyword arguments only",
                )
                .label("give this argument a name")
                .help(format!("the base model is {}", e.signature(def)))
            })?;
            if !def.formals.iter().any(|f| f.name.name == key.name) {
                return Err(e.unknown_keyword(&key.name, key.span, def));
            }
        }
        for f in &def.formals {
            let expr = match overrides
                .iter()
                .rev()
                .find(|a| a.name.as_ref().is_some_and(|n| n.name == f.name.name))
            {
                Some(a) => &a.value,
                None => f.default.as_ref().ok_or_else(|| missing_default(f))?,
            };
            let v = e.eval(expr)?;
            if !matches!(
                v,
                Value::Int(_) | Value::Float(_) | Value::Bool(_) | Value::Str(_)
            ) {
                return Err(e.expected(&v, expr.span, "a number, a bool or a string"));
            }
            args.push((f.name.name.clone(), v.clone()));
            e.bind(&f.name.name, v);
        }
        let flow = e.exec(&def.body)?;
        let Flow::Return(result) = flow else {
            return Err(Diag::new(
                "dpl::missing-return",
                def.name.span,
                format!("model `{}` ends without `return`", def.name.name),
            )
            .label("this model returns nothing")
            .help("end the model with `return loss`"));
        };
        let values = match result {
            Value::Tuple(xs) => xs,
            v => vec![v],
        };
        let mut outs = Vec::new();
        for v in &values {
            match v {
                Value::Tensor(t) => outs.push(*t),
                other => {
                    return Err(Diag::new(
                        "dpl::type",
                        def.name.span,
                        format!(
                            "model `{}` must return tensors, not {}",
                            def.name.name,
                            other.describe(&e.g)
                        ),
                    )
                    .label("in this model"))
                }
            }
        }
        let root = e.g.root();
        e.g.set_region_results(root, outs)
            .map_err(|err| e.ir_error(err, def.name.span))?;
        Ok(LoweredModel { graph: e.g, args })
    }

    // ---- environment ------------------------------------------------------

    fn frame(&self) -> Option<&Frame> {
        self.frames.last()
    }

    fn lookup(&self, name: &str) -> Option<Value> {
        self.frame()
            .and_then(|f| f.scopes.iter().rev().find_map(|s| s.get(name)).cloned())
    }

    /// Assign where the name already lives, else in the innermost scope.
    fn bind(&mut self, name: &str, v: Value) {
        if let Some(f) = self.frames.last_mut() {
            if let Some(s) = f.scopes.iter_mut().rev().find(|s| s.contains_key(name)) {
                s.insert(name.to_string(), v);
            } else if let Some(s) = f.scopes.last_mut() {
                s.insert(name.to_string(), v);
            }
        }
    }

    fn visible_names(&self) -> Vec<String> {
        let mut names: Vec<String> = self
            .frame()
            .map(|f| f.scopes.iter().flat_map(|s| s.keys().cloned()).collect())
            .unwrap_or_default();
        names.extend(builtins::BUILTINS.iter().map(|b| b.name.to_string()));
        names.extend(self.prog.std_blocks.keys().cloned());
        if self.in_user_file() {
            names.extend(self.prog.user_blocks.keys().cloned());
        }
        names.extend(builtins::dtype_names().map(String::from));
        names.sort();
        names.dedup();
        names
    }

    fn in_user_file(&self) -> bool {
        self.frame().is_some_and(|f| !self.prog.is_std(f.file))
    }

    // ---- statements -------------------------------------------------------

    fn exec(&mut self, stmts: &[Stmt]) -> Res<Flow> {
        for s in stmts {
            if let Flow::Return(v) = self.stmt(s)? {
                return Ok(Flow::Return(v));
            }
        }
        Ok(Flow::Next)
    }

    fn stmt(&mut self, s: &Stmt) -> Res<Flow> {
        match &s.kind {
            StmtKind::Assign { targets, value } => {
                let v = self.eval(value)?;
                if targets.len() == 1 {
                    self.bind(&targets[0].name, v);
                    return Ok(Flow::Next);
                }
                let items = match v {
                    Value::Tuple(xs) | Value::List(xs) if xs.len() == targets.len() => xs,
                    other => {
                        return Err(Diag::new(
                            "dpl::destructure",
                            value.span,
                            format!(
                                "{} names on the left but the right side is {}",
                                targets.len(),
                                other.describe(&self.g)
                            ),
                        )
                        .label(format!("needs a tuple of {} values", targets.len())))
                    }
                };
                for (t, v) in targets.iter().zip(items) {
                    self.bind(&t.name, v);
                }
                Ok(Flow::Next)
            }
            StmtKind::Param { name, dims, init } => {
                self.param(name, dims, init.as_ref(), s.span)?;
                Ok(Flow::Next)
            }
            StmtKind::Input { name, dtype, dims } => {
                self.input(name, dtype, dims, s.span)?;
                Ok(Flow::Next)
            }
            StmtKind::If { arms, otherwise } => {
                for (cond, body) in arms {
                    let c = self.eval(cond)?;
                    match c {
                        Value::Bool(true) => return self.exec(body),
                        Value::Bool(false) => {}
                        other => {
                            return Err(self.expected(
                                &other,
                                cond.span,
                                "a bool (conditions are decided while compiling)",
                            ))
                        }
                    }
                }
                match otherwise {
                    Some(body) => self.exec(body),
                    None => Ok(Flow::Next),
                }
            }
            StmtKind::Repeat { count, body } => {
                self.repeat(count, body, s.span)?;
                Ok(Flow::Next)
            }
            StmtKind::Call(call) => {
                self.eval(call)?;
                Ok(Flow::Next)
            }
            StmtKind::Return(values) => {
                let base = self.frame().map_or(1, |f| f.level_base);
                if self.levels.len() != base {
                    return Err(Diag::new(
                        "dpl::return-in-repeat",
                        s.span,
                        "`return` inside a `repeat` body",
                    )
                    .label("a repeat body cannot return")
                    .help("assign to a variable in the body and return after the repeat"));
                }
                let mut vs = Vec::new();
                for v in values {
                    vs.push(self.eval(v)?);
                }
                Ok(Flow::Return(if vs.len() == 1 {
                    vs.pop().unwrap_or(Value::Tuple(Vec::new()))
                } else {
                    Value::Tuple(vs)
                }))
            }
        }
    }

    fn param(&mut self, name: &Ident, dims: &[Expr], init: Option<&Expr>, span: Span) -> Res<()> {
        let mut shape = Vec::new();
        let mut elements: u128 = 1;
        for d in dims {
            let v = self.eval(d)?;
            let dim = self.dim_arg(&v, d.span)?;
            match dim.as_const() {
                Some(n) => elements = elements.saturating_mul(n as u128),
                None => {
                    return Err(Diag::new(
                        "dpl::symbolic-param",
                        d.span,
                        format!(
                            "a parameter's dimensions must be constants, `{}` is {}",
                            self.prog.text(d.span),
                            self.g.dim_str(&dim)
                        ),
                    )
                    .label("depends on the input size"))
                }
            }
            shape.push(dim);
        }
        if elements > MAX_PARAM_ELEMENTS {
            return Err(Diag::new(
                "dpl::too-large",
                name.span,
                format!("parameter `{}` would have {elements} elements", name.name),
            )
            .label("too large")
            .help("a parameter may have at most 2^50 elements"));
        }
        let init = match init {
            None => Init::Normal { std: 0.02 },
            Some(e) => self.init(e)?,
        };
        let key = (self.scope, name.name.clone());
        if self.sharing.is_some() && !self.param_origins.contains_key(&key) {
            self.param_origins.insert(key, name.span);
            let t = self.shared_param(name, &shape)?;
            self.bind(&name.name, Value::Tensor(t));
            return Ok(());
        }
        if let Some(first) = self.param_origins.get(&key) {
            return Err(Diag::new(
                "dpl::duplicate-param",
                name.span,
                format!(
                    "parameter `{}` is already declared in this scope at {}",
                    name.name,
                    self.prog.line_col(*first)
                ),
            )
            .label("declared again here")
            .note(*first, format!("`{}` first declared here", name.name))
            .help("give each parameter of a block its own name"));
        }
        self.param_origins.insert(key, name.span);
        self.check_budget(span)?;
        let region = self.region();
        let t = self
            .g
            .add_param(
                region,
                self.scope,
                &name.name,
                DType::F32,
                Shape(shape),
                init,
            )
            .map_err(|err| self.ir_error(err, name.span))?;
        self.bind(&name.name, Value::Tensor(t));
        Ok(())
    }

    /// The parameter a `share = "path"` call uses for its `param name`: the
    /// one at the same place under `path`, with the same shape, brought into
    /// the current region (one parameter read twice: its gradients add up
    /// and it is counted once).
    fn shared_param(&mut self, name: &Ident, shape: &[Dim]) -> Res<TensorId> {
        let (call_scope, prefix, said) = self.sharing.clone().expect("called while sharing");
        let here = self.g.scope_path(self.scope);
        let base = self.g.scope_path(call_scope);
        let rel = here.strip_prefix(base.as_str()).unwrap_or("");
        let target = format!("{prefix}{rel}.{}", name.name);
        let Some(p) = self
            .g
            .params()
            .find(|(_, p)| p.name == target)
            .map(|(_, p)| p.clone())
        else {
            let near = self
                .g
                .params()
                .filter(|(_, p)| p.name.starts_with(&format!("{prefix}.")))
                .map(|(_, p)| p.name.clone())
                .collect::<Vec<_>>();
            return Err(Diag::new(
                "dpl::unknown-share",
                name.span,
                format!("`share = \"{prefix}\"` has no parameter `{target}` for `{}`", name.name),
            )
            .label("declared here, to be shared")
            .note(said, "shared from here")
            .help(if near.is_empty() {
                format!("no parameter is declared under `{prefix}` before this call: call the block once without `share` first (parameter paths look like `layers.attention.q.w`)")
            } else {
                format!("parameters under `{prefix}`: {}", near.join(", "))
            }));
        };
        if p.shape.dims() != shape {
            return Err(Diag::new(
                "dpl::shape",
                name.span,
                format!(
                    "`{}` is {} here but the shared `{target}` is {}",
                    name.name,
                    self.g.shape_str(&Shape(shape.to_vec())),
                    self.g.shape_str(&p.shape)
                ),
            )
            .label("shape differs")
            .note(said, "shared from here")
            .help("a shared block must be called with the sizes of the call it shares"));
        }
        let region = self.g.tensor_region(p.tensor);
        if !self.levels.iter().any(|l| l.region == region) {
            return Err(Diag::new(
                "dpl::unknown-share",
                said,
                format!("`{target}` belongs to a `repeat` body this call is not in"),
            )
            .label("cannot share from here")
            .help("share parameters declared outside any `repeat`, or inside the same body"));
        }
        Ok(self.localize(p.tensor))
    }

    fn init(&mut self, e: &Expr) -> Res<Init> {
        let bad = || {
            Diag::new("dpl::bad-init", e.span, "unknown initialiser")
                .label("not an initialiser")
                .help("use `zeros`, `ones` or `normal(std = 0.02)`")
        };
        match &e.kind {
            ExprKind::Name(n) if n == "zeros" => Ok(Init::Zeros),
            ExprKind::Name(n) if n == "ones" => Ok(Init::Ones),
            ExprKind::Call { callee, args } if callee.name == "normal" && args.len() == 1 => {
                if args[0].name.as_ref().is_some_and(|n| n.name != "std") {
                    return Err(bad());
                }
                let v = self.eval(&args[0].value)?;
                match v.as_f64() {
                    Some(std) if std.is_finite() && std >= 0.0 => Ok(Init::Normal { std }),
                    _ => Err(self.expected(&v, args[0].value.span, "a non-negative number")),
                }
            }
            _ => Err(bad()),
        }
    }

    fn input(&mut self, name: &Ident, dtype: &Ident, dims: &[Expr], span: Span) -> Res<()> {
        if self.frames.len() != 1 || self.levels.len() != 1 {
            return Err(Diag::new(
                "dpl::misplaced-input",
                span,
                "`input` is only allowed at the top level of a model",
            )
            .label("inside a block or repeat"));
        }
        let ty = DType::from_name(&dtype.name).ok_or_else(|| {
            let mut d = Diag::new(
                "dpl::unknown-dtype",
                dtype.span,
                format!("unknown element type `{}`", dtype.name),
            )
            .label("not a type");
            d = d.help(match did_you_mean(&dtype.name, builtins::dtype_names()) {
                Some(s) => format!("{s} types are f32, bf16, f16 and i32"),
                None => "types are f32, bf16, f16 and i32".to_string(),
            });
            d
        })?;
        let mut shape = Vec::new();
        for d in dims {
            // An unbound name in an input's dims declares a symbolic dimension.
            if let ExprKind::Name(n) = &d.kind {
                if self.lookup(n).is_none() && global(n).is_none() {
                    let sym = self.g.intern_sym(n);
                    self.bind(n, Value::Dim(Dim::sym(sym)));
                    shape.push(Dim::sym(sym));
                    continue;
                }
            }
            let v = self.eval(d)?;
            shape.push(self.dim_arg(&v, d.span)?);
        }
        let t = self
            .g
            .add_input(&name.name, ty, Shape(shape))
            .map_err(|err| self.ir_error(err, name.span))?;
        self.bind(&name.name, Value::Tensor(t));
        Ok(())
    }

    /// Lower `repeat count { body }` once into a new region.
    fn repeat(&mut self, count_expr: &Expr, body: &[Stmt], span: Span) -> Res<()> {
        let count = match self.eval(count_expr)? {
            Value::Int(n) if (1..=MAX_REPEAT).contains(&n) => n as u64,
            Value::Int(n) => {
                return Err(Diag::new(
                    "dpl::repeat-count",
                    count_expr.span,
                    format!(
                        "a repeat count must be between 1 and {MAX_REPEAT}, `{}` is {n}",
                        self.prog.text(count_expr.span)
                    ),
                )
                .label("not a valid count"))
            }
            other => {
                return Err(self.expected(&other, count_expr.span, "a positive integer count"))
            }
        };
        if self.levels.len() > MAX_REPEAT_NESTING {
            return Err(Diag::new(
                "dpl::too-deep",
                span,
                format!("repeats are nested more than {MAX_REPEAT_NESTING} deep"),
            )
            .label("too deep"));
        }
        let scope_name = match &count_expr.kind {
            ExprKind::Name(n) => n.clone(),
            _ => "repeat".to_string(),
        };
        // Variables defined before the repeat and assigned inside it are carried.
        let mut assigned = Vec::new();
        assigned_names(body, &mut assigned);
        let mut carried: Vec<(String, Value)> = Vec::new();
        for n in assigned {
            if let Some(v) = self.lookup(&n) {
                let v = self.localize_value(v);
                carried.push((n, v));
            }
        }
        let outer_scope = self.scope;
        let body_scope = self.open_scope(&scope_name, ScopeKind::Repeat { count }, span, false)?;
        let parent_region = self.region();
        let body_region = self.g.add_region(parent_region);
        self.levels.push(Level {
            region: body_region,
            captured: HashMap::new(),
            capture_inputs: Vec::new(),
        });
        let mut scope_vars = HashMap::new();
        let mut initial = Vec::new();
        for (n, v) in &carried {
            if let Value::Tensor(t) = v {
                let info = self.g.tensor(*t).clone();
                let arg = self.g.add_region_arg(body_region, info.dtype, info.shape);
                initial.push(*t);
                scope_vars.insert(n.clone(), Value::Tensor(arg));
            } else {
                scope_vars.insert(n.clone(), v.clone());
            }
        }
        if let Some(f) = self.frames.last_mut() {
            f.scopes.push(scope_vars);
        }
        self.scope = body_scope;
        let flow = self.exec(body);
        self.scope = outer_scope;
        let finals = self
            .frames
            .last_mut()
            .and_then(|f| f.scopes.pop())
            .unwrap_or_default();
        let level = self.levels.pop();
        flow?;
        let level = level.ok_or_else(|| {
            Diag::new(
                "dpl::internal",
                span,
                "internal error: region stack is empty",
            )
        })?;
        let mut results = Vec::new();
        for (n, before) in &carried {
            let after = finals.get(n).cloned().unwrap_or_else(|| before.clone());
            match before {
                Value::Tensor(t) => {
                    let Value::Tensor(out) = after else {
                        return Err(Diag::new(
                            "dpl::repeat-carried",
                            span,
                            format!(
                                "`{n}` enters the repeat as a tensor but leaves as {}",
                                after.describe(&self.g)
                            ),
                        )
                        .label("in this repeat"));
                    };
                    let (a, b) = (self.g.tensor(*t), self.g.tensor(out));
                    if a.dtype != b.dtype || a.shape != b.shape {
                        return Err(Diag::new(
                            "dpl::repeat-carried",
                            span,
                            format!(
                                "`{n}` enters the repeat as {}{} but leaves as {}{}",
                                a.dtype,
                                self.g.shape_str(&a.shape),
                                b.dtype,
                                self.g.shape_str(&b.shape)
                            ),
                        )
                        .label("each iteration must keep the shape of what it carries"));
                    }
                    // A body that only passes the value through still yields a body value.
                    results.push(out);
                }
                other if *other != after => {
                    return Err(Diag::new(
                        "dpl::repeat-carried",
                        span,
                        format!("`{n}` is not a tensor and changes inside the repeat"),
                    )
                    .label("the body is lowered once, so only tensors may change per iteration")
                    .help("compute the value before the repeat"));
                }
                _ => {}
            }
        }
        self.g
            .set_region_results(body_region, results)
            .map_err(|err| self.ir_error(err, span))?;
        let carried_count = initial.len();
        let mut inputs = initial;
        inputs.extend(level.capture_inputs);
        let outs = self.node(
            Op::Repeat {
                count,
                body: body_region,
                carried: carried_count,
            },
            &inputs,
            span,
        )?;
        let mut outs = outs.into_iter();
        for (n, before) in &carried {
            if matches!(before, Value::Tensor(_)) {
                if let Some(o) = outs.next() {
                    self.bind(n, Value::Tensor(o));
                }
            }
        }
        Ok(())
    }

    // ---- regions and captures ---------------------------------------------

    fn region(&self) -> RegionId {
        self.levels.last().map_or(self.g.root(), |l| l.region)
    }

    /// Bring an outer tensor into the current region, capturing it as a region
    /// argument at every level between (once per level).
    fn localize(&mut self, t: TensorId) -> TensorId {
        let r = self.g.tensor_region(t);
        let top = self.levels.len() - 1;
        if self.levels[top].region == r {
            return t;
        }
        let Some(k) = self.levels.iter().rposition(|l| l.region == r) else {
            return t;
        };
        let mut cur = t;
        for j in k + 1..=top {
            if let Some(&a) = self.levels[j].captured.get(&cur) {
                cur = a;
                continue;
            }
            let info = self.g.tensor(cur).clone();
            let arg = self
                .g
                .add_region_arg(self.levels[j].region, info.dtype, info.shape);
            self.levels[j].captured.insert(cur, arg);
            self.levels[j].capture_inputs.push(cur);
            cur = arg;
        }
        cur
    }

    fn localize_value(&mut self, v: Value) -> Value {
        match v {
            Value::Tensor(t) => Value::Tensor(self.localize(t)),
            Value::Tuple(xs) => {
                Value::Tuple(xs.into_iter().map(|x| self.localize_value(x)).collect())
            }
            Value::List(xs) => {
                Value::List(xs.into_iter().map(|x| self.localize_value(x)).collect())
            }
            other => other,
        }
    }

    // ---- nodes ------------------------------------------------------------

    fn check_budget(&self, span: Span) -> Res<()> {
        if self.g.nodes().len() >= MAX_NODES {
            return Err(Diag::new(
                "dpl::too-large",
                span,
                format!("the model needs more than {MAX_NODES} operations"),
            )
            .label("while lowering this")
            .help("blocks are inlined: a block calling others many times multiplies"));
        }
        Ok(())
    }

    pub fn node(&mut self, op: Op, inputs: &[TensorId], span: Span) -> Res<Vec<TensorId>> {
        self.check_budget(span)?;
        let region = self.region();
        self.g
            .add_node(region, self.scope, op, inputs)
            .map_err(|e| self.ir_error(e, span))
    }

    pub fn node1(&mut self, op: Op, inputs: &[TensorId], span: Span) -> Res<TensorId> {
        let outs = self.node(op, inputs, span)?;
        outs.first().copied().ok_or_else(|| {
            Diag::new(
                "dpl::internal",
                span,
                "internal error: an op produced no output",
            )
        })
    }

    fn ir_error(&self, e: IrError, span: Span) -> Box<Diag> {
        let code = match &e {
            IrError::Shape { .. } => "dpl::shape",
            IrError::DType { .. } => "dpl::dtype",
            IrError::Arity { .. } => "dpl::arg-count",
            IrError::Axis { .. } => "dpl::axis",
            IrError::DuplicateParam(_) => "dpl::duplicate-param",
            IrError::DuplicateInput(_) => "dpl::duplicate",
            IrError::Invalid { .. } => "dpl::invalid",
            IrError::Overflow(_) => "dpl::overflow",
        };
        let mut text: String = self.prog.text(span).chars().take(60).collect();
        if text.contains('\n') {
            text = text.lines().next().unwrap_or("").to_string() + " …";
        }
        let d = Diag::new(code, span, e.to_string()).label(format!("in `{text}`"));
        match e {
            IrError::DuplicateParam(_) => d.help("give each parameter of a block its own name"),
            IrError::Shape { .. } => d.help(
                "shapes are [outermost, …, innermost]; check the sizes passed to the block or op",
            ),
            _ => d,
        }
    }

    // ---- expressions ------------------------------------------------------

    pub fn eval(&mut self, e: &Expr) -> Res<Value> {
        match &e.kind {
            ExprKind::Int(n) => Ok(Value::Int(*n)),
            ExprKind::Float(x) => Ok(Value::Float(*x)),
            ExprKind::Bool(b) => Ok(Value::Bool(*b)),
            ExprKind::Str(s) => Ok(Value::Str(s.clone())),
            ExprKind::Quantity {
                value,
                unit,
                per_device,
            } => Ok(Value::Quantity {
                value: *value,
                unit: *unit,
                per_device: *per_device,
            }),
            ExprKind::Name(n) => {
                if let Some(v) = self.lookup(n) {
                    return Ok(self.localize_value(v));
                }
                if self.section_mode {
                    return Ok(Value::Name(n.clone()));
                }
                if let Some(v) = global(n) {
                    return Ok(v);
                }
                Err(self.unknown_name(n, e.span, "is not defined here"))
            }
            ExprKind::Tuple(xs) | ExprKind::List(xs) => {
                let mut vs = Vec::new();
                for x in xs {
                    vs.push(self.eval(x)?);
                }
                Ok(if matches!(e.kind, ExprKind::Tuple(_)) {
                    Value::Tuple(vs)
                } else {
                    Value::List(vs)
                })
            }
            ExprKind::Unary(op, x) => {
                let v = self.eval(x)?;
                match (op, &v) {
                    (UnOp::Not, Value::Bool(b)) => Ok(Value::Bool(!b)),
                    (UnOp::Neg, Value::Int(n)) => {
                        n.checked_neg().map(Value::Int).ok_or_else(|| {
                            Diag::new("dpl::overflow", e.span, "integer overflow in `-`")
                                .label("here")
                        })
                    }
                    (UnOp::Neg, Value::Float(x)) => Ok(Value::Float(-x)),
                    (UnOp::Neg, Value::Tensor(t)) => self
                        .node1(Op::Unary(dplc_ir::UnaryOp::Neg), &[*t], e.span)
                        .map(Value::Tensor),
                    (UnOp::Not, _) => Err(self.expected(&v, x.span, "a bool")),
                    (UnOp::Neg, _) => Err(self.expected(&v, x.span, "a number or a tensor")),
                }
            }
            ExprKind::Binary(op, a, b) => self.binary(*op, a, b, e.span),
            ExprKind::Call { callee, args } => self.call(callee, args, e.span),
        }
    }

    fn binary(&mut self, op: BinOp, a: &Expr, b: &Expr, span: Span) -> Res<Value> {
        let x = self.eval(a)?;
        // `and` and `or` short-circuit, so `kv < heads and heads % kv == 0` is safe.
        if matches!(op, BinOp::And | BinOp::Or) {
            match x {
                Value::Bool(v) if (op == BinOp::And) != v => return Ok(Value::Bool(v)),
                Value::Bool(_) => {}
                other => return Err(self.expected(&other, a.span, "a bool")),
            }
            let y = self.eval(b)?;
            return match y {
                Value::Bool(v) => Ok(Value::Bool(v)),
                other => Err(self.expected(&other, b.span, "a bool")),
            };
        }
        let y = self.eval(b)?;
        let tensors = matches!(x, Value::Tensor(_)) || matches!(y, Value::Tensor(_));
        if !tensors {
            return arith(op, &x, &y, &self.g).map_err(|(code, msg)| {
                let d = Diag::new(code, span, msg);
                match code {
                    "dpl::division-by-zero" => {
                        d.label(format!("`{}` is zero", self.prog.text(b.span)))
                    }
                    _ => d.label("here"),
                }
            });
        }
        let bin = match op {
            BinOp::Add => dplc_ir::BinaryOp::Add,
            BinOp::Sub => dplc_ir::BinaryOp::Sub,
            BinOp::Mul => dplc_ir::BinaryOp::Mul,
            BinOp::Div => dplc_ir::BinaryOp::Div,
            BinOp::Pow => dplc_ir::BinaryOp::Pow,
            BinOp::MatMul => {
                let (ta, tb) = (
                    self.tensor_arg(&x, a.span, "@")?,
                    self.tensor_arg(&y, b.span, "@")?,
                );
                return self.node1(Op::MatMul, &[ta, tb], span).map(Value::Tensor);
            }
            _ => {
                return Err(Diag::new(
                    "dpl::type",
                    span,
                    format!("`{}` does not apply to tensors", op.symbol()),
                )
                .label(format!(
                    "{} {} {}",
                    x.describe(&self.g),
                    op.symbol(),
                    y.describe(&self.g)
                )))
            }
        };
        let ta = self.tensor_or_const(&x, a.span)?;
        let tb = self.tensor_or_const(&y, b.span)?;
        self.node1(Op::Binary(bin), &[ta, tb], span)
            .map(Value::Tensor)
    }

    fn unknown_name(&self, name: &str, span: Span, label: &str) -> Box<Diag> {
        let names = self.visible_names();
        let d = Diag::new("dpl::unknown-name", span, format!("unknown name `{name}`")).label(label);
        match did_you_mean(name, names.iter().map(String::as_str)) {
            Some(s) => d.help(s),
            None => d.help(
                "names must be defined before use: a formal, an assignment, a param or an input",
            ),
        }
    }

    // ---- calls ------------------------------------------------------------

    fn find_block(&self, name: &str) -> Option<&'p FnDef> {
        if self.in_user_file() {
            if let Some(b) = self.prog.user_blocks.get(name) {
                return Some(b);
            }
        }
        self.prog.std_blocks.get(name)
    }

    fn call(&mut self, callee: &Ident, args: &[Arg], span: Span) -> Res<Value> {
        if self.section_mode {
            let mut fields = Vec::new();
            for a in args {
                let Some(n) = &a.name else {
                    return Err(Diag::new(
                        "dpl::record-positional",
                        a.value.span,
                        format!("the fields of `{}(…)` need names", callee.name),
                    )
                    .label("write `key = value`"));
                };
                if fields
                    .iter()
                    .any(|(k, _, _): &(String, Value, Span)| *k == n.name)
                {
                    return Err(Diag::new(
                        "dpl::duplicate-keyword",
                        n.span,
                        format!("field `{}` is given twice", n.name),
                    )
                    .label("given again here"));
                }
                let v = self.eval(&a.value)?;
                fields.push((n.name.clone(), v, a.value.span));
            }
            return Ok(Value::Record {
                kind: callee.name.clone(),
                fields,
            });
        }
        let mut values = Vec::new();
        for a in args {
            values.push((a.name.clone(), self.eval(&a.value)?, a.value.span));
        }
        if let Some(def) = self.find_block(&callee.name) {
            return self.call_block(def, values, callee, span);
        }
        if let Some(b) = builtins::find(&callee.name) {
            let names: Vec<&str> = b.params.iter().map(|(n, _)| *n).collect();
            let bound = self.bind_args(&names, &b.signature(), values, callee, span)?;
            let mut full = Vec::new();
            for ((pname, default), slot) in b.params.iter().zip(bound) {
                full.push(match (slot, default) {
                    (Some(v), _) => v,
                    (None, builtins::ArgDefault::Int(i)) => (Value::Int(*i), span),
                    (None, builtins::ArgDefault::Float(x)) => (Value::Float(*x), span),
                    (None, builtins::ArgDefault::Bool(x)) => (Value::Bool(*x), span),
                    (None, builtins::ArgDefault::Required) => {
                        return Err(self.missing_arg(pname, &b.signature(), span));
                    }
                });
            }
            return builtins::call(self, b, full, span);
        }
        if self.prog.models.iter().any(|m| m.name.name == callee.name) {
            return Err(Diag::new(
                "dpl::call-model",
                callee.span,
                format!(
                    "`{}` is a model; only blocks and builtins can be called",
                    callee.name
                ),
            )
            .label("a model"));
        }
        let mut names: Vec<String> = builtins::BUILTINS
            .iter()
            .map(|b| b.name.to_string())
            .collect();
        names.extend(self.prog.std_blocks.keys().cloned());
        if self.in_user_file() {
            names.extend(self.prog.user_blocks.keys().cloned());
        }
        let d = Diag::new(
            "dpl::unknown-block",
            callee.span,
            format!("unknown block or builtin `{}`", callee.name),
        )
        .label("not a block or builtin");
        Err(match did_you_mean(&callee.name, names.iter().map(String::as_str)) {
            Some(s) => d.help(s),
            None => d.help("blocks are declared with `block name(…) { … }`; docs/language.md lists the builtins"),
        })
    }

    fn missing_arg(&self, name: &str, signature: &str, span: Span) -> Box<Diag> {
        Diag::new("dpl::arg-count", span, format!("missing argument `{name}`"))
            .label(format!("`{name}` is not given"))
            .help(format!("the signature is {signature}"))
    }

    /// Match positional then keyword arguments to formals.
    fn bind_args(
        &self,
        formals: &[&str],
        signature: &str,
        args: Vec<(Option<Ident>, Value, Span)>,
        callee: &Ident,
        span: Span,
    ) -> Res<Vec<Option<(Value, Span)>>> {
        let mut slots: Vec<Option<(Value, Span)>> = vec![None; formals.len()];
        let mut positional = 0;
        let mut seen_keyword = false;
        for (name, v, at) in args {
            match name {
                None => {
                    if seen_keyword {
                        return Err(Diag::new(
                            "dpl::arg-order",
                            at,
                            "a positional argument after a keyword argument",
                        )
                        .label("move this before the keyword arguments")
                        .help(format!("the signature is {signature}")));
                    }
                    if positional >= formals.len() {
                        return Err(Diag::new(
                            "dpl::arg-count",
                            span,
                            format!(
                                "`{}` takes {} argument{}, but {} or more were given",
                                callee.name,
                                formals.len(),
                                if formals.len() == 1 { "" } else { "s" },
                                positional + 1
                            ),
                        )
                        .label("too many arguments")
                        .help(format!("the signature is {signature}")));
                    }
                    slots[positional] = Some((v, at));
                    positional += 1;
                }
                Some(n) => {
                    seen_keyword = true;
                    let Some(i) = formals.iter().position(|f| *f == n.name) else {
                        let d = Diag::new(
                            "dpl::unknown-keyword",
                            n.span,
                            format!("`{}` has no parameter `{}`", callee.name, n.name),
                        )
                        .label("unknown keyword");
                        let hint = did_you_mean(&n.name, formals.iter().copied());
                        return Err(d.help(match hint {
                            Some(h) => format!("{h} the signature is {signature}"),
                            None => format!("the signature is {signature}"),
                        }));
                    };
                    if slots[i].is_some() {
                        return Err(Diag::new(
                            "dpl::duplicate-keyword",
                            n.span,
                            format!("argument `{}` is given twice", n.name),
                        )
                        .label("given again here")
                        .help(format!("the signature is {signature}")));
                    }
                    slots[i] = Some((v, at));
                }
            }
        }
        Ok(slots)
    }

    pub fn signature(&self, def: &FnDef) -> String {
        let params: Vec<String> = def
            .formals
            .iter()
            .map(|f| match &f.default {
                Some(d) => format!("{} = {}", f.name.name, self.prog.text(d.span)),
                None => f.name.name.clone(),
            })
            .collect();
        format!("{}({})", def.name.name, params.join(", "))
    }

    fn unknown_keyword(&self, key: &str, span: Span, def: &FnDef) -> Box<Diag> {
        let names: Vec<&str> = def.formals.iter().map(|f| f.name.name.as_str()).collect();
        let d = Diag::new(
            "dpl::unknown-keyword",
            span,
            format!("`{}` has no parameter `{key}`", def.name.name),
        )
        .label("unknown keyword");
        let sig = self.signature(def);
        d.help(match did_you_mean(key, names) {
            Some(h) => format!("{h} the signature is {sig}"),
            None => format!("the signature is {sig}"),
        })
    }

    fn call_block(
        &mut self,
        def: &'p FnDef,
        mut args: Vec<(Option<Ident>, Value, Span)>,
        callee: &Ident,
        span: Span,
    ) -> Res<Value> {
        let name = &def.name.name;
        if self.calls.iter().any(|c| c == name) || self.calls.len() >= MAX_CALL_DEPTH {
            return Err(Diag::new(
                "dpl::recursive-block",
                callee.span,
                format!("block `{name}` calls itself"),
            )
            .label("recursive call")
            .help(format!(
                "blocks are inlined while compiling, so they cannot recurse; call chain: {} → {name}",
                self.calls.join(" → ")
            )));
        }
        // `name = "q"` names the block instance's scope (and so its parameters).
        let mut scope_name = name.clone();
        let mut named_at = None;
        if let Some(i) = args
            .iter()
            .position(|(n, _, _)| n.as_ref().is_some_and(|n| n.name == "name"))
        {
            let (key, v, at) = args.remove(i);
            match v {
                Value::Str(s) if is_scope_name(&s) => {
                    scope_name = s;
                    named_at = Some(key.map_or(at, |k| k.span.to(at)));
                }
                other => {
                    return Err(self.expected(
                        &other,
                        at,
                        "a name string such as \"q\" (letters, digits, _)",
                    ))
                }
            }
        }
        // `share = "enc.embed"`: the parameters of an earlier call, not new ones.
        let mut share = None;
        if let Some(i) = args
            .iter()
            .position(|(n, _, _)| n.as_ref().is_some_and(|n| n.name == "share"))
        {
            let (key, v, at) = args.remove(i);
            match v {
                Value::Str(s) if !s.is_empty() && s.split('.').all(is_scope_name) => {
                    share = Some((s, key.map_or(at, |k| k.span.to(at))));
                }
                other => {
                    return Err(self.expected(
                        &other,
                        at,
                        "a parameter path string such as \"enc.embed\" (names joined by .)",
                    ))
                }
            }
        }
        let formals: Vec<&str> = def.formals.iter().map(|f| f.name.name.as_str()).collect();
        let sig = self.signature(def);
        let bound = self.bind_args(&formals, &sig, args, callee, span)?;
        let outer_scope = self.scope;
        let block_scope = self.open_scope(
            &scope_name,
            ScopeKind::Block {
                block: name.clone(),
            },
            named_at.unwrap_or(span),
            named_at.is_some(),
        )?;
        self.calls.push(name.clone());
        self.frames.push(Frame {
            scopes: vec![HashMap::new()],
            level_base: self.levels.len(),
            file: def.name.span.file,
        });
        self.scope = block_scope;
        let outer_sharing = match share {
            Some((path, at)) => self.sharing.replace((block_scope, path, at)),
            None => self.sharing.clone(),
        };
        let result = self.run_block(def, bound, span, &sig);
        self.sharing = outer_sharing;
        self.scope = outer_scope;
        self.frames.pop();
        self.calls.pop();
        result.map_err(|mut d| {
            if self.prog.is_std(d.span.file) && !self.prog.is_std(span.file) && d.notes.is_empty() {
                d.notes
                    .push((span, format!("the error is inside this call of `{name}`")));
            }
            d
        })
    }

    /// A new scope under the current one, named `base` or, when a sibling has
    /// that name already, numbered by the graph (`linear_1`). A name given
    /// with `name = "…"` is never numbered: reusing one is an error, as is a
    /// numbered name that a `name =` took before (both would be one path).
    fn open_scope(
        &mut self,
        base: &str,
        kind: ScopeKind,
        origin: Span,
        explicit: bool,
    ) -> Res<ScopeId> {
        let parent = self.scope;
        let taken = |e: &Self, name: &str, message: String| -> Option<Box<Diag>> {
            let first = *e.scope_origins.get(&(parent, name.to_string()))?;
            Some(
                Diag::new(
                    "dpl::duplicate-name",
                    origin,
                    format!(
                        "{message} is already used in this scope at {}",
                        e.prog.line_col(first)
                    ),
                )
                .label("used again here")
                .note(first, format!("`{name}` first named here"))
                .help("give each block call in a scope its own `name = \"…\"`"),
            )
        };
        if explicit {
            if let Some(d) = taken(self, base, format!("the name `{base}`")) {
                return Err(d);
            }
        }
        let id = self.g.add_scope(parent, base, kind);
        let unique = self.g.scope(id).name.clone();
        if let Some(d) = taken(
            self,
            &unique,
            format!("this `{base}` would be named `{unique}`, which"),
        ) {
            return Err(d);
        }
        self.scope_origins.insert((parent, unique), origin);
        Ok(id)
    }

    fn run_block(
        &mut self,
        def: &'p FnDef,
        bound: Vec<Option<(Value, Span)>>,
        span: Span,
        sig: &str,
    ) -> Res<Value> {
        for (f, slot) in def.formals.iter().zip(bound) {
            let v = match (slot, &f.default) {
                (Some((v, _)), _) => v,
                (None, Some(d)) => self.eval(d)?,
                (None, None) => return Err(self.missing_arg(&f.name.name, sig, span)),
            };
            let scalar = match &v {
                Value::Int(i) => Some(ScalarArg::Int(*i)),
                Value::Float(x) => Some(ScalarArg::Float(*x)),
                Value::Bool(b) => Some(ScalarArg::Bool(*b)),
                Value::Str(s) => Some(ScalarArg::Str(s.clone())),
                _ => None,
            };
            if let Some(scalar) = scalar {
                self.g.add_scope_arg(self.scope, &f.name.name, scalar);
            }
            if let Some(frame) = self.frames.last_mut() {
                if let Some(s) = frame.scopes.first_mut() {
                    s.insert(f.name.name.clone(), v);
                }
            }
        }
        match self.exec(&def.body)? {
            Flow::Return(v) => Ok(v),
            Flow::Next => Err(Diag::new(
                "dpl::missing-return",
                def.name.span,
                format!("block `{}` ends without `return`", def.name.name),
            )
            .label("no `return` on this path")
            .help("every path through a block must end in `return value`")
            .note(span, "called here")),
        }
    }

    // ---- argument conversions (used by builtins) --------------------------

    pub fn expected(&self, v: &Value, span: Span, what: &str) -> Box<Diag> {
        let code = if matches!(v, Value::Tensor(_)) {
            "dpl::tensor-not-number"
        } else {
            "dpl::arg-type"
        };
        let code = if what.contains("tensor") {
            "dpl::arg-type"
        } else {
            code
        };
        Diag::new(
            code,
            span,
            format!("expected {what}, found {}", v.describe(&self.g)),
        )
        .label(format!(
            "`{}`",
            self.prog.text(span).chars().take(60).collect::<String>()
        ))
    }

    pub fn tensor_arg(&mut self, v: &Value, span: Span, op: &str) -> Res<TensorId> {
        match v {
            Value::Tensor(t) => Ok(self.localize(*t)),
            other => Err(self.expected(other, span, &format!("a tensor for `{op}`"))),
        }
    }

    /// A tensor, or a number as a scalar f32 constant that broadcasts.
    pub fn tensor_or_const(&mut self, v: &Value, span: Span) -> Res<TensorId> {
        match v {
            Value::Tensor(t) => Ok(self.localize(*t)),
            Value::Int(_) | Value::Float(_) => {
                let x = v.as_f64().unwrap_or(0.0);
                self.node1(Op::Constant(x), &[], span)
            }
            other => Err(self.expected(other, span, "a tensor or a number")),
        }
    }

    pub fn number_arg(&self, v: &Value, span: Span) -> Res<f64> {
        v.as_f64().ok_or_else(|| self.expected(v, span, "a number"))
    }

    pub fn int_arg(&self, v: &Value, span: Span) -> Res<i64> {
        match v {
            Value::Int(n) => Ok(*n),
            other => Err(self.expected(other, span, "an integer")),
        }
    }

    pub fn bool_arg(&self, v: &Value, span: Span) -> Res<bool> {
        match v {
            Value::Bool(b) => Ok(*b),
            other => Err(self.expected(other, span, "a bool")),
        }
    }

    pub fn list_arg(&self, v: &Value, span: Span) -> Res<Vec<Value>> {
        match v {
            Value::List(xs) | Value::Tuple(xs) => Ok(xs.clone()),
            other => Err(self.expected(other, span, "a list")),
        }
    }

    pub fn axis_arg(&self, t: TensorId, v: &Value, span: Span) -> Res<usize> {
        let a = self.int_arg(v, span)?;
        let shape = &self.g.tensor(t).shape;
        shape.axis(a).ok_or_else(|| {
            Diag::new(
                "dpl::axis",
                span,
                format!(
                    "axis {a} is out of range for a tensor of shape {}",
                    self.g.shape_str(shape)
                ),
            )
            .label("no such axis")
            .help(format!(
                "axes run from 0 to {} (or -1 from the end)",
                shape.rank().saturating_sub(1)
            ))
        })
    }

    /// A positive whole dimension, constant or symbolic.
    pub fn dim_arg(&self, v: &Value, span: Span) -> Res<Dim> {
        let text = self.prog.text(span).chars().take(60).collect::<String>();
        let bad = |why: String| {
            Diag::new(
                "dpl::bad-dim",
                span,
                format!("`{text}` is not a valid dimension: {why}"),
            )
            .label("used as a dimension")
        };
        match v {
            Value::Int(n) if *n <= 0 => Err(bad(format!("it is {n}, dimensions must be positive"))),
            Value::Int(n) if *n > MAX_DIM => Err(bad(format!("{n} is larger than 2^40"))
                .help("dimensions above 2^40 elements are refused")),
            Value::Int(n) => Ok(Dim::konst(*n)),
            Value::Float(x) => Err(bad(format!("it is {}, not an integer", crate::value::fmt_float(*x)))
                .help("`/` is exact or fractional: `768 / 12` is 64 but `10 / 4` is 2.5; floordiv(a, b) rounds down")),
            Value::Dim(d) if d.coeff().numer() > 0 => Ok(d.clone()),
            Value::Dim(d) => Err(bad(format!("{} is not positive", self.g.dim_str(d)))),
            other => Err(self.expected(other, span, "a dimension (a positive integer or a symbolic size)")),
        }
    }

    pub fn shape_arg(&self, v: &Value, span: Span, _infer: bool) -> Res<Shape> {
        let items = self.list_arg(v, span)?;
        let mut dims = Vec::new();
        for x in &items {
            dims.push(self.dim_arg(x, span)?);
        }
        Ok(Shape(dims))
    }

    /// The target shape of a reshape; one `-1` is inferred from the element count.
    pub fn reshape_dims(&self, x: TensorId, v: &Value, span: Span) -> Res<Shape> {
        let items = self.list_arg(v, span)?;
        let dims = builtins::dims_of(self, &items, span)?;
        let unknown = dims.iter().filter(|d| d.is_none()).count();
        if unknown > 1 {
            return Err(Diag::new(
                "dpl::bad-dim",
                span,
                "only one dimension of a reshape can be -1",
            )
            .label("two -1s"));
        }
        let known = dims
            .iter()
            .flatten()
            .try_fold(Dim::konst(1), |acc, d| acc.checked_mul(d));
        let numel = self.g.tensor(x).shape.numel();
        let fill = match (unknown, known, numel) {
            (0, _, _) => None,
            (_, Some(k), Some(n)) => match n.checked_div(&k) {
                Some(d) if d.coeff().denom() == 1 && d.coeff().numer() > 0 => Some(d),
                _ => {
                    return Err(Diag::new(
                        "dpl::shape",
                        span,
                        format!(
                            "cannot infer -1: {} elements do not divide by {}",
                            self.g.dim_str(&n),
                            self.g.dim_str(&k)
                        ),
                    )
                    .label("in this shape"))
                }
            },
            _ => {
                return Err(
                    Diag::new("dpl::overflow", span, "the shape's size overflows").label("here"),
                )
            }
        };
        Ok(Shape(
            dims.into_iter()
                .map(|d| d.unwrap_or_else(|| fill.clone().unwrap_or_else(|| Dim::konst(1))))
                .collect(),
        ))
    }
}

fn is_scope_name(s: &str) -> bool {
    !s.is_empty()
        && s.chars().all(|c| c.is_ascii_alphanumeric() || c == '_')
        && !s.starts_with(|c: char| c.is_ascii_digit())
}

fn missing_default(f: &Formal) -> Box<Diag> {
    Diag::new(
        "dpl::missing-default",
        f.name.span,
        format!("model parameter `{}` has no default", f.name.name),
    )
    .label("needs `= value`")
    .help("every model parameter needs a default so that the model can be lowered on its own")
}

pub fn check_model_defaults(def: &FnDef) -> Res<()> {
    match def.formals.iter().find(|f| f.default.is_none()) {
        Some(f) => Err(missing_default(f)),
        None => Ok(()),
    }
}

/// Names assigned anywhere in `body` (through `if`s and nested `repeat`s), in order.
fn assigned_names(body: &[Stmt], out: &mut Vec<String>) {
    for s in body {
        match &s.kind {
            StmtKind::Assign { targets, .. } => {
                for t in targets {
                    if !out.contains(&t.name) {
                        out.push(t.name.clone());
                    }
                }
            }
            StmtKind::Param { name, .. } => {
                if !out.contains(&name.name) {
                    out.push(name.name.clone());
                }
            }
            StmtKind::If { arms, otherwise } => {
                for (_, b) in arms {
                    assigned_names(b, out);
                }
                if let Some(b) = otherwise {
                    assigned_names(b, out);
                }
            }
            StmtKind::Repeat { body, .. } => assigned_names(body, out),
            StmtKind::Input { .. } | StmtKind::Return(_) | StmtKind::Call(_) => {}
        }
    }
}
