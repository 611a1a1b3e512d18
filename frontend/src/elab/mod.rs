//! Elaboration: runs a model's body at compile time, inlining block calls and
//! lowering each `repeat` body once into its own region, to build a `Graph`.
//! This module holds the elaborator's state (regions, frames, scopes) and
//! its node building; statements, expressions, calls, models and the parsed
//! program each have a module of their own.

mod call;
mod expr;
mod model;
mod program;
mod stmt;

pub use model::check_model_defaults;
pub use program::{LoweredModel, Program};

use crate::ast::*;
use crate::builtins;
use crate::diag::{did_you_mean, Diag, DiagExt, Res, Source};
use crate::lowering::Lowering;
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
pub const MAX_REPEAT: i64 = 1_000_000;
/// The most elements one parameter may have.
const MAX_PARAM_ELEMENTS: u128 = 1 << 50;
/// `repeat` nested deeper than this is refused.
const MAX_REPEAT_NESTING: usize = 16;
/// Variants based on variants more than this deep are refused. Cycles are
/// found by name whatever the depth; this bounds the work of a file with very
/// many variants, which `Unit::check` resolves one by one.
const MAX_VARIANT_DEPTH: usize = 256;

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
}

impl Lowering for Elab<'_> {
    fn graph(&self) -> &Graph {
        &self.g
    }

    fn text(&self, span: Span) -> &str {
        self.prog.text(span)
    }

    fn localize(&mut self, t: TensorId) -> TensorId {
        Elab::localize(self, t)
    }

    fn node(&mut self, op: Op, inputs: &[TensorId], span: Span) -> Res<Vec<TensorId>> {
        self.check_budget(span)?;
        let region = self.region();
        self.g
            .add_node(region, self.scope, op, inputs)
            .map_err(|e| self.ir_error(e, span))
    }
}
