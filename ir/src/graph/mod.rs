//! The model graph: arenas of tensors, nodes, regions, scopes and parameters,
//! and the builder that checks shapes and element types as nodes are added.

use crate::error::{IrError, Result};
use crate::{
    BinaryOp, DType, Dim, Init, InputId, NodeId, Op, ParamId, Ratio, RegionId, ScopeId, Shape,
    SymId, TensorId,
};
use serde::{Deserialize, Serialize};
use std::collections::HashMap;

mod infer;

pub use infer::broadcast;

/// A value in the graph.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Tensor {
    pub dtype: DType,
    pub shape: Shape,
    pub def: TensorDef,
}

/// Where a tensor is defined.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum TensorDef {
    /// Output `output` of `node`.
    Node { node: NodeId, output: usize },
    /// Argument `index` of `region`.
    Arg { region: RegionId, index: usize },
}

/// One operation: inputs and outputs are tensors of the node's region.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Node {
    pub op: Op,
    pub inputs: Vec<TensorId>,
    pub outputs: Vec<TensorId>,
    pub region: RegionId,
    /// The block instance (or repeat, or model) this node came from.
    pub scope: ScopeId,
}

/// A straight-line list of nodes. The root region is the model body; every
/// other region is the body of exactly one `repeat` node and stands for all of
/// its iterations at once.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Region {
    pub parent: Option<RegionId>,
    pub args: Vec<TensorId>,
    pub nodes: Vec<NodeId>,
    pub results: Vec<TensorId>,
    /// The `repeat` node whose body this is.
    pub repeat: Option<NodeId>,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum ScopeKind {
    Model,
    /// An instance of the named block.
    Block {
        block: String,
    },
    /// A `repeat`; nodes below it exist once per iteration.
    Repeat {
        count: u64,
    },
}

/// A node of the tree of provenance that tags every node and parameter.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Scope {
    pub name: String,
    pub parent: Option<ScopeId>,
    pub kind: ScopeKind,
    /// A block instance's scalar arguments as the call resolved them
    /// (defaults included), in the block's order: what `dplc export` reads
    /// to name a model's shape (heads, activation, biases) in another
    /// engine's terms, where the lowered ops alone would leave it guessing.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub args: Vec<(String, ScalarArg)>,
}

/// A scalar argument of a block call (tensors and lists are not recorded).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub enum ScalarArg {
    Int(i64),
    Float(f64),
    Bool(bool),
    Str(String),
}

impl Scope {
    /// The argument called `name`, if the call had a scalar one.
    pub fn arg(&self, name: &str) -> Option<&ScalarArg> {
        self.args.iter().find(|(n, _)| n == name).map(|(_, v)| v)
    }
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ParamInfo {
    /// Dotted path from the model scope, e.g. `layers.attention.wq`.
    pub name: String,
    pub dtype: DType,
    pub shape: Shape,
    pub init: Init,
    pub scope: ScopeId,
    pub tensor: TensorId,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct InputInfo {
    pub name: String,
    pub dtype: DType,
    pub shape: Shape,
    pub tensor: TensorId,
}

/// A model lowered to primitive ops, with its `repeat` structure kept.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Graph {
    pub name: String,
    syms: Vec<String>,
    tensors: Vec<Tensor>,
    nodes: Vec<Node>,
    regions: Vec<Region>,
    scopes: Vec<Scope>,
    params: Vec<ParamInfo>,
    inputs: Vec<InputInfo>,
    #[serde(skip)]
    scope_names: HashMap<(ScopeId, String), u32>,
}

/// The symbolic dimensions dplc gives values: the micro-batch and the
/// sequence length.
pub const BOUND_DIMS: [&str; 2] = ["batch", "seq"];

impl Graph {
    /// An empty graph with a root region and a model scope called `name`.
    pub fn new(name: &str) -> Graph {
        Graph {
            name: name.to_string(),
            syms: Vec::new(),
            tensors: Vec::new(),
            nodes: Vec::new(),
            regions: vec![Region {
                parent: None,
                args: Vec::new(),
                nodes: Vec::new(),
                results: Vec::new(),
                repeat: None,
            }],
            scopes: vec![Scope {
                name: name.to_string(),
                parent: None,
                kind: ScopeKind::Model,
                args: Vec::new(),
            }],
            params: Vec::new(),
            inputs: Vec::new(),
            scope_names: HashMap::new(),
        }
    }

    pub fn root(&self) -> RegionId {
        RegionId::new(0)
    }

    pub fn root_scope(&self) -> ScopeId {
        ScopeId::new(0)
    }

    // ---- lookups -------------------------------------------------------

    pub fn tensor(&self, t: TensorId) -> &Tensor {
        &self.tensors[t.index()]
    }

    pub fn node(&self, n: NodeId) -> &Node {
        &self.nodes[n.index()]
    }

    pub fn region(&self, r: RegionId) -> &Region {
        &self.regions[r.index()]
    }

    /// The ids integer tensor `t` may hold: the smallest axis it indexes
    /// (an embedding table's rows, a pick's last axis), followed through
    /// views, casts and into `repeat` bodies.
    /// `None` when nothing indexes with it.
    pub fn index_bound(&self, t: TensorId) -> Option<u64> {
        let mut bound: Option<u64> = None;
        let mut stack = vec![t];
        let mut seen = std::collections::HashSet::new();
        while let Some(t) = stack.pop() {
            if !seen.insert(t) {
                continue;
            }
            for (_, node) in self.nodes() {
                for (i, _) in node.inputs.iter().enumerate().filter(|(_, &x)| x == t) {
                    let axis = match (&node.op, i) {
                        (Op::Embedding, 1) => self.tensor(node.inputs[0]).shape.dims().first(),
                        (Op::TakeAlong, 1) => self.tensor(node.inputs[0]).shape.dims().last(),
                        (
                            Op::Reshape { .. }
                            | Op::Expand { .. }
                            | Op::Transpose { .. }
                            | Op::Slice { .. }
                            | Op::Pad { .. }
                            | Op::Cast(DType::I32),
                            _,
                        ) => {
                            stack.extend(node.outputs.iter().copied());
                            None
                        }
                        (Op::Repeat { body, .. }, i) => {
                            stack.extend(self.region(*body).args.get(i).copied());
                            None
                        }
                        _ => None,
                    };
                    if let Some(n) = axis.and_then(|d| d.as_const()) {
                        let n = n.max(0) as u64;
                        bound = Some(bound.map_or(n, |b| b.min(n)));
                    }
                }
            }
        }
        bound
    }

    pub fn scope(&self, s: ScopeId) -> &Scope {
        &self.scopes[s.index()]
    }

    pub fn param(&self, p: ParamId) -> &ParamInfo {
        &self.params[p.index()]
    }

    pub fn params(&self) -> impl ExactSizeIterator<Item = (ParamId, &ParamInfo)> {
        self.params
            .iter()
            .enumerate()
            .map(|(i, p)| (ParamId::new(i), p))
    }

    pub fn inputs(&self) -> impl ExactSizeIterator<Item = (InputId, &InputInfo)> {
        self.inputs
            .iter()
            .enumerate()
            .map(|(i, p)| (InputId::new(i), p))
    }

    pub fn input(&self, i: InputId) -> &InputInfo {
        &self.inputs[i.index()]
    }

    pub fn nodes(&self) -> impl ExactSizeIterator<Item = (NodeId, &Node)> {
        self.nodes
            .iter()
            .enumerate()
            .map(|(i, n)| (NodeId::new(i), n))
    }

    pub fn regions(&self) -> impl ExactSizeIterator<Item = (RegionId, &Region)> {
        self.regions
            .iter()
            .enumerate()
            .map(|(i, r)| (RegionId::new(i), r))
    }

    pub fn scopes(&self) -> impl ExactSizeIterator<Item = (ScopeId, &Scope)> {
        self.scopes
            .iter()
            .enumerate()
            .map(|(i, s)| (ScopeId::new(i), s))
    }

    /// Names of the symbolic dimensions, indexed by `SymId`.
    pub fn sym_names(&self) -> &[String] {
        &self.syms
    }

    /// Symbolic dimensions nothing gives a value: dplc binds `batch` (the
    /// micro-batch) and `seq` (the sequence length) and nothing else, so any
    /// other free name (a T5's `src`, `tgt`) must be refused, never guessed.
    pub fn unbound_dims(&self) -> Vec<&str> {
        self.syms
            .iter()
            .map(String::as_str)
            .filter(|s| !BOUND_DIMS.contains(s))
            .collect()
    }

    pub fn sym_by_name(&self, name: &str) -> Option<SymId> {
        self.syms.iter().position(|s| s == name).map(SymId::new)
    }

    /// The model's results (the root region's results).
    pub fn outputs(&self) -> &[TensorId] {
        &self.regions[0].results
    }

    /// The region a tensor belongs to.
    pub fn tensor_region(&self, t: TensorId) -> RegionId {
        match self.tensor(t).def {
            TensorDef::Node { node, .. } => self.node(node).region,
            TensorDef::Arg { region, .. } => region,
        }
    }

    /// The node defining `t`, if it is not a region argument.
    pub fn producer(&self, t: TensorId) -> Option<&Node> {
        match self.tensor(t).def {
            TensorDef::Node { node, .. } => Some(self.node(node)),
            TensorDef::Arg { .. } => None,
        }
    }

    /// How many times a region runs per model step (product of enclosing repeat counts).
    pub fn trip_count(&self, r: RegionId) -> u64 {
        let mut trips = 1u64;
        let mut cur = Some(r);
        while let Some(region) = cur {
            let reg = self.region(region);
            if let Some(n) = reg.repeat {
                if let Op::Repeat { count, .. } = self.node(n).op {
                    trips = trips.saturating_mul(count);
                }
            }
            cur = reg.parent;
        }
        trips
    }

    /// Dotted path of a scope below the model, e.g. `layers.attention`; empty for the model.
    pub fn scope_path(&self, s: ScopeId) -> String {
        let mut parts = Vec::new();
        let mut cur = Some(s);
        while let Some(id) = cur {
            let scope = self.scope(id);
            if scope.parent.is_some() {
                parts.push(scope.name.as_str());
            }
            cur = scope.parent;
        }
        parts.reverse();
        parts.join(".")
    }

    pub fn shape_str(&self, shape: &Shape) -> String {
        shape.display(&self.syms).to_string()
    }

    pub fn dim_str(&self, dim: &Dim) -> String {
        dim.display(&self.syms).to_string()
    }

    /// Elements of one parameter tensor times the iterations of its region.
    pub fn param_elements(&self, p: ParamId) -> u128 {
        let info = self.param(p);
        // Saturating: a count past 2^128 is nonsense the frontend already rejects,
        // and must not panic here.
        let per_iteration = info.shape.dims().iter().fold(1u128, |acc, d| {
            acc.saturating_mul(d.as_const().expect("parameter dims are checked constant") as u128)
        });
        per_iteration.saturating_mul(self.trip_count(self.tensor_region(info.tensor)) as u128)
    }

    /// Total trainable parameters, counting every iteration of every `repeat`.
    pub fn param_count(&self) -> u128 {
        (0..self.params.len())
            .map(|i| self.param_elements(ParamId::new(i)))
            .fold(0u128, u128::saturating_add)
    }

    // ---- building ------------------------------------------------------

    /// The symbol called `name`, created on first use.
    pub fn intern_sym(&mut self, name: &str) -> SymId {
        match self.sym_by_name(name) {
            Some(s) => s,
            None => {
                self.syms.push(name.to_string());
                SymId::new(self.syms.len() - 1)
            }
        }
    }

    /// A child scope of `parent`. A second child with the same name becomes
    /// `name_1`, the third `name_2`, so every path is unique.
    pub fn add_scope(&mut self, parent: ScopeId, name: &str, kind: ScopeKind) -> ScopeId {
        let seen = self
            .scope_names
            .entry((parent, name.to_string()))
            .or_insert(0);
        let unique = if *seen == 0 {
            name.to_string()
        } else {
            format!("{name}_{seen}")
        };
        *seen += 1;
        self.scopes.push(Scope {
            name: unique,
            parent: Some(parent),
            kind,
            args: Vec::new(),
        });
        ScopeId::new(self.scopes.len() - 1)
    }

    /// Record a scalar argument of the block call that opened `scope`.
    pub fn add_scope_arg(&mut self, scope: ScopeId, name: &str, value: ScalarArg) {
        self.scopes[scope.index()]
            .args
            .push((name.to_string(), value));
    }

    /// A new region nested in `parent`, to become the body of a `repeat`.
    pub fn add_region(&mut self, parent: RegionId) -> RegionId {
        self.regions.push(Region {
            parent: Some(parent),
            args: Vec::new(),
            nodes: Vec::new(),
            results: Vec::new(),
            repeat: None,
        });
        RegionId::new(self.regions.len() - 1)
    }

    /// Append an argument to `region`.
    pub fn add_region_arg(&mut self, region: RegionId, dtype: DType, shape: Shape) -> TensorId {
        let index = self.regions[region.index()].args.len();
        let t = self.push_tensor(dtype, shape, TensorDef::Arg { region, index });
        self.regions[region.index()].args.push(t);
        t
    }

    /// Set what `region` yields. For the root region these are the model's outputs.
    pub fn set_region_results(&mut self, region: RegionId, results: Vec<TensorId>) -> Result<()> {
        for &t in &results {
            self.check_visible("yield", region, t)?;
        }
        self.regions[region.index()].results = results;
        Ok(())
    }

    /// Declare a model input in the root region.
    pub fn add_input(&mut self, name: &str, dtype: DType, shape: Shape) -> Result<TensorId> {
        if self.inputs.iter().any(|i| i.name == name) {
            return Err(IrError::DuplicateInput(name.to_string()));
        }
        let id = InputId::new(self.inputs.len());
        // The placeholder tensor is replaced right below, once the node exists.
        self.inputs.push(InputInfo {
            name: name.to_string(),
            dtype,
            shape,
            tensor: TensorId::new(0),
        });
        let t = self.add_node1(self.root(), self.root_scope(), Op::Input(id), &[])?;
        self.inputs[id.index()].tensor = t;
        Ok(t)
    }

    /// Declare a parameter called `name` in `scope`, defined in `region`.
    pub fn add_param(
        &mut self,
        region: RegionId,
        scope: ScopeId,
        name: &str,
        dtype: DType,
        shape: Shape,
        init: Init,
    ) -> Result<TensorId> {
        let path = self.scope_path(scope);
        let full = if path.is_empty() {
            name.to_string()
        } else {
            format!("{path}.{name}")
        };
        if self.params.iter().any(|p| p.name == full) {
            return Err(IrError::DuplicateParam(full));
        }
        if let Some(d) = shape
            .dims()
            .iter()
            .find(|d| d.as_const().is_none_or(|n| n <= 0))
        {
            return Err(IrError::Invalid {
                op: "param",
                detail: format!(
                    "parameter `{full}` needs positive whole dimensions, got {}",
                    self.dim_str(d)
                ),
            });
        }
        let id = ParamId::new(self.params.len());
        // The placeholder tensor is replaced right below, once the node exists.
        self.params.push(ParamInfo {
            name: full,
            dtype,
            shape,
            init,
            scope,
            tensor: TensorId::new(0),
        });
        let t = self.add_node1(region, scope, Op::Param(id), &[])?;
        self.params[id.index()].tensor = t;
        Ok(t)
    }

    /// Add a node with a single output.
    pub fn add_node1(
        &mut self,
        region: RegionId,
        scope: ScopeId,
        op: Op,
        inputs: &[TensorId],
    ) -> Result<TensorId> {
        let outs = self.add_node(region, scope, op, inputs)?;
        Ok(outs[0])
    }

    /// Add a node, inferring its output shapes and types; refuse it with an
    /// error naming both shapes when they do not fit.
    pub fn add_node(
        &mut self,
        region: RegionId,
        scope: ScopeId,
        op: Op,
        inputs: &[TensorId],
    ) -> Result<Vec<TensorId>> {
        for &t in inputs {
            self.check_visible(op.name(), region, t)?;
        }
        let out_types = self.infer(&op, inputs)?;
        let node = NodeId::new(self.nodes.len());
        if let Op::Repeat { body, .. } = op {
            self.regions[body.index()].repeat = Some(node);
        }
        let outputs = out_types
            .into_iter()
            .enumerate()
            .map(|(output, (dtype, shape))| {
                self.push_tensor(dtype, shape, TensorDef::Node { node, output })
            })
            .collect::<Vec<_>>();
        self.nodes.push(Node {
            op,
            inputs: inputs.to_vec(),
            outputs: outputs.clone(),
            region,
            scope,
        });
        self.regions[region.index()].nodes.push(node);
        Ok(outputs)
    }

    // ---- rewriting a copy into a rank's local program (`localize`) -------

    pub(crate) fn tensor_mut(&mut self, t: TensorId) -> &mut Tensor {
        &mut self.tensors[t.index()]
    }

    pub(crate) fn node_mut(&mut self, n: NodeId) -> &mut Node {
        &mut self.nodes[n.index()]
    }

    pub(crate) fn region_mut(&mut self, r: RegionId) -> &mut Region {
        &mut self.regions[r.index()]
    }

    /// A node with outputs of the given types, not yet in its region's
    /// order: the caller places it.
    pub(crate) fn push_node_unplaced(
        &mut self,
        region: RegionId,
        scope: ScopeId,
        op: Op,
        inputs: Vec<TensorId>,
        outputs: Vec<(DType, Shape)>,
    ) -> (NodeId, Vec<TensorId>) {
        let node = NodeId::new(self.nodes.len());
        let outputs: Vec<TensorId> = outputs
            .into_iter()
            .enumerate()
            .map(|(output, (dtype, shape))| {
                self.push_tensor(dtype, shape, TensorDef::Node { node, output })
            })
            .collect();
        self.nodes.push(Node {
            op,
            inputs,
            outputs: outputs.clone(),
            region,
            scope,
        });
        (node, outputs)
    }

    fn push_tensor(&mut self, dtype: DType, shape: Shape, def: TensorDef) -> TensorId {
        self.tensors.push(Tensor { dtype, shape, def });
        TensorId::new(self.tensors.len() - 1)
    }

    fn check_visible(&self, op: &'static str, region: RegionId, t: TensorId) -> Result<()> {
        if t.index() >= self.tensors.len() || self.tensor_region(t) != region {
            return Err(IrError::Invalid {
                op,
                detail: format!("{t} is not defined in region {region}"),
            });
        }
        Ok(())
    }
}
