//! The model graph: arenas of tensors, nodes, regions, scopes and parameters,
//! and the builder that checks shapes and element types as nodes are added.

use crate::error::{IrError, Result};
use crate::{
    BinaryOp, DType, Dim, Init, InputId, NodeId, Op, ParamId, Ratio, RegionId, ScopeId, Shape,
    SymId, TensorId,
};
use serde::{Deserialize, Serialize};
use std::collections::HashMap;

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

    // ---- type inference ------------------------------------------------

    fn infer(&self, op: &Op, inputs: &[TensorId]) -> Result<Vec<(DType, Shape)>> {
        let name = op.name();
        let arity = |expected: &'static str, ok: bool| -> Result<()> {
            if ok {
                Ok(())
            } else {
                Err(IrError::Arity {
                    op: name,
                    expected,
                    got: inputs.len(),
                })
            }
        };
        let t = |i: usize| self.tensor(inputs[i]);
        let float = |i: usize| -> Result<()> {
            if t(i).dtype.is_float() {
                Ok(())
            } else {
                Err(IrError::DType {
                    op: name,
                    detail: format!("input {} is {}, a float type is needed", i + 1, t(i).dtype),
                })
            }
        };
        let int = |i: usize| -> Result<()> {
            if t(i).dtype == DType::I32 {
                Ok(())
            } else {
                Err(IrError::DType {
                    op: name,
                    detail: format!("input {} is {}, indices must be i32", i + 1, t(i).dtype),
                })
            }
        };
        let same_dtype = |i: usize, j: usize| -> Result<()> {
            if t(i).dtype == t(j).dtype {
                Ok(())
            } else {
                Err(IrError::DType {
                    op: name,
                    detail: format!("{} and {}", t(i).dtype, t(j).dtype),
                })
            }
        };
        let shape_err = |detail: String| IrError::Shape { op: name, detail };
        let s = |i: usize| self.shape_str(&t(i).shape);

        Ok(match op {
            Op::Input(id) => {
                arity("no", inputs.is_empty())?;
                let info = self.input(*id);
                vec![(info.dtype, info.shape.clone())]
            }
            Op::Param(p) => {
                arity("no", inputs.is_empty())?;
                let info = self.param(*p);
                vec![(info.dtype, info.shape.clone())]
            }
            Op::Constant(_) => {
                arity("no", inputs.is_empty())?;
                vec![(DType::F32, Shape::scalar())]
            }
            Op::Iota { len } => {
                arity("no", inputs.is_empty())?;
                vec![(DType::I32, Shape(vec![len.clone()]))]
            }
            Op::Unary(_) => {
                arity("1", inputs.len() == 1)?;
                float(0)?;
                vec![(t(0).dtype, t(0).shape.clone())]
            }
            Op::Binary(b) => {
                arity("2", inputs.len() == 2)?;
                same_dtype(0, 1)?;
                if *b != BinaryOp::Add && *b != BinaryOp::Sub && *b != BinaryOp::Mul {
                    float(0)?;
                }
                let shape = broadcast(&t(0).shape, &t(1).shape)
                    .ok_or_else(|| shape_err(format!("{} and {} do not broadcast", s(0), s(1))))?;
                vec![(t(0).dtype, shape)]
            }
            Op::Cast(to) => {
                arity("1", inputs.len() == 1)?;
                vec![(*to, t(0).shape.clone())]
            }
            Op::MatMul => {
                arity("2", inputs.len() == 2)?;
                float(0)?;
                float(1)?;
                same_dtype(0, 1)?;
                let (a, b) = (t(0).shape.dims(), t(1).shape.dims());
                if a.len() < 2 || b.len() < 2 {
                    return Err(shape_err(format!(
                        "{} × {}: both operands need at least two dimensions",
                        s(0),
                        s(1)
                    )));
                }
                let (m, k1) = (&a[a.len() - 2], &a[a.len() - 1]);
                let (k2, n) = (&b[b.len() - 2], &b[b.len() - 1]);
                if k1 != k2 {
                    return Err(shape_err(format!(
                        "{} × {}: inner dimensions {} and {} differ",
                        s(0),
                        s(1),
                        self.dim_str(k1),
                        self.dim_str(k2)
                    )));
                }
                let batch = broadcast(
                    &Shape(a[..a.len() - 2].to_vec()),
                    &Shape(b[..b.len() - 2].to_vec()),
                )
                .ok_or_else(|| {
                    shape_err(format!(
                        "{} × {}: batch dimensions do not broadcast",
                        s(0),
                        s(1)
                    ))
                })?;
                let mut dims = batch.0;
                dims.push(m.clone());
                dims.push(n.clone());
                vec![(t(0).dtype, Shape(dims))]
            }
            Op::Transpose { perm } => {
                arity("1", inputs.len() == 1)?;
                let dims = t(0).shape.dims();
                let mut seen = vec![false; dims.len()];
                let valid = perm.len() == dims.len()
                    && perm
                        .iter()
                        .all(|&p| p < dims.len() && !std::mem::replace(&mut seen[p], true));
                if !valid {
                    return Err(shape_err(format!(
                        "{perm:?} is not a permutation of the {} axes of {}",
                        dims.len(),
                        s(0)
                    )));
                }
                vec![(
                    t(0).dtype,
                    Shape(perm.iter().map(|&p| dims[p].clone()).collect()),
                )]
            }
            Op::Reshape { shape } => {
                arity("1", inputs.len() == 1)?;
                let from = t(0).shape.numel();
                let to = shape.numel();
                if from.is_none() || from != to {
                    return Err(shape_err(format!(
                        "cannot reshape {} to {}: the element counts differ",
                        s(0),
                        self.shape_str(shape)
                    )));
                }
                vec![(t(0).dtype, shape.clone())]
            }
            Op::Expand { shape } => {
                arity("1", inputs.len() == 1)?;
                if broadcast(&t(0).shape, shape).as_ref() != Some(shape) {
                    return Err(shape_err(format!(
                        "cannot expand {} to {}",
                        s(0),
                        self.shape_str(shape)
                    )));
                }
                vec![(t(0).dtype, shape.clone())]
            }
            Op::Slice { axis, start, len } => {
                arity("1", inputs.len() == 1)?;
                let dims = t(0).shape.dims();
                let d = dims.get(*axis).ok_or(IrError::Axis {
                    op: name,
                    axis: *axis as i64,
                    rank: dims.len(),
                })?;
                // A symbolic axis (e.g. `seq`) is sliced with fixed bounds that
                // the runtime checks once the symbol is bound.
                let size = d.as_const().unwrap_or(i64::MAX);
                if *start < 0 || *len <= 0 || start.saturating_add(*len) > size {
                    return Err(shape_err(format!(
                        "[{start}, {}) is outside axis {axis} of {}",
                        start + len,
                        s(0)
                    )));
                }
                let mut out = dims.to_vec();
                out[*axis] = Dim::konst(*len);
                vec![(t(0).dtype, Shape(out))]
            }
            Op::Concat { axis } => {
                arity("at least 1", !inputs.is_empty())?;
                let first = &t(0).shape;
                if *axis >= first.rank() {
                    return Err(IrError::Axis {
                        op: name,
                        axis: *axis as i64,
                        rank: first.rank(),
                    });
                }
                let mut total = first.dims()[*axis].clone();
                for i in 1..inputs.len() {
                    same_dtype(0, i)?;
                    let other = &t(i).shape;
                    let fits = other.rank() == first.rank()
                        && (0..first.rank()).all(|a| a == *axis || first.0[a] == other.0[a]);
                    total = match (fits, total.checked_add(&other.0[*axis])) {
                        (true, Some(sum)) => sum,
                        _ => {
                            return Err(shape_err(format!(
                                "{} and {} differ outside axis {axis}",
                                s(0),
                                s(i)
                            )))
                        }
                    };
                }
                let mut out = first.0.clone();
                out[*axis] = total;
                vec![(t(0).dtype, Shape(out))]
            }
            Op::Pad {
                axis,
                before,
                after,
                ..
            } => {
                arity("1", inputs.len() == 1)?;
                let dims = t(0).shape.dims();
                let d = dims.get(*axis).ok_or(IrError::Axis {
                    op: name,
                    axis: *axis as i64,
                    rank: dims.len(),
                })?;
                // A shift keeps the length, symbolic or not; any other pad
                // needs a number, since `seq + 2` is not a dimension.
                let len = if before.saturating_add(*after) == 0 {
                    let size = d.as_const().unwrap_or(i64::MAX);
                    if before.saturating_abs() >= size {
                        return Err(shape_err(format!(
                            "a shift by {before} leaves nothing of axis {axis} of {}",
                            s(0)
                        )));
                    }
                    d.clone()
                } else {
                    let n = d.as_const().ok_or_else(|| {
                        shape_err(format!(
                            "axis {axis} of {} is symbolic: only a shift (before = -after) \
                             keeps a symbolic length",
                            s(0)
                        ))
                    })?;
                    let len = n.saturating_add(*before).saturating_add(*after);
                    if len <= 0 || before.saturating_neg() >= n || after.saturating_neg() >= n {
                        return Err(shape_err(format!(
                            "padding axis {axis} of {} by {before} and {after} leaves nothing",
                            s(0)
                        )));
                    }
                    Dim::konst(len)
                };
                let mut out = dims.to_vec();
                out[*axis] = len;
                vec![(t(0).dtype, Shape(out))]
            }
            Op::Reduce { axis, keep_dim, .. } => {
                arity("1", inputs.len() == 1)?;
                float(0)?;
                let mut dims = t(0).shape.0.clone();
                if *axis >= dims.len() {
                    return Err(IrError::Axis {
                        op: name,
                        axis: *axis as i64,
                        rank: dims.len(),
                    });
                }
                if *keep_dim {
                    dims[*axis] = Dim::konst(1);
                } else {
                    dims.remove(*axis);
                }
                vec![(t(0).dtype, Shape(dims))]
            }
            // A float of the same shape, along one of its axes.
            Op::Softmax { axis } | Op::LogSoftmax { axis } | Op::CumSum { axis, .. } => {
                arity("1", inputs.len() == 1)?;
                float(0)?;
                if *axis >= t(0).shape.rank() {
                    return Err(IrError::Axis {
                        op: name,
                        axis: *axis as i64,
                        rank: t(0).shape.rank(),
                    });
                }
                vec![(t(0).dtype, t(0).shape.clone())]
            }
            Op::LayerNorm { .. } | Op::RmsNorm { .. } => {
                let n = if matches!(op, Op::LayerNorm { .. }) {
                    3
                } else {
                    2
                };
                arity(
                    if n == 3 {
                        "3 (x, weight, bias)"
                    } else {
                        "2 (x, weight)"
                    },
                    inputs.len() == n,
                )?;
                float(0)?;
                let last = t(0).shape.last().cloned().ok_or_else(|| {
                    shape_err("normalising a scalar: the input needs an axis".to_string())
                })?;
                for i in 1..n {
                    same_dtype(0, i)?;
                    if t(i).shape.dims() != [last.clone()] {
                        return Err(shape_err(format!(
                            "input {} is {}, it must be [{}] to match the last axis of {}",
                            i + 1,
                            s(i),
                            self.dim_str(&last),
                            s(0)
                        )));
                    }
                }
                vec![(t(0).dtype, t(0).shape.clone())]
            }
            Op::Dropout { p, .. } => {
                arity("1", inputs.len() == 1)?;
                float(0)?;
                if !(0.0..1.0).contains(p) {
                    return Err(IrError::Invalid {
                        op: name,
                        detail: format!("probability {p} is outside [0, 1)"),
                    });
                }
                vec![(t(0).dtype, t(0).shape.clone())]
            }
            Op::Select => {
                arity("3", inputs.len() == 3)?;
                float(0)?;
                same_dtype(1, 2)?;
                let shape = broadcast(&t(0).shape, &t(1).shape)
                    .and_then(|s| broadcast(&s, &t(2).shape))
                    .ok_or_else(|| {
                        shape_err(format!("{}, {} and {} do not broadcast", s(0), s(1), s(2)))
                    })?;
                vec![(t(1).dtype, shape)]
            }
            Op::CausalMask => {
                arity("1", inputs.len() == 1)?;
                float(0)?;
                let d = t(0).shape.dims();
                if d.len() < 2 || d[d.len() - 1] != d[d.len() - 2] {
                    return Err(shape_err(format!(
                        "{} must end in two equal axes (queries × keys)",
                        s(0)
                    )));
                }
                vec![(t(0).dtype, t(0).shape.clone())]
            }
            Op::Embedding => {
                arity("2 (table, indices)", inputs.len() == 2)?;
                float(0)?;
                int(1)?;
                let table = t(0).shape.dims();
                if table.len() != 2 {
                    return Err(shape_err(format!(
                        "the table {} must be [rows, width]",
                        s(0)
                    )));
                }
                let mut dims = t(1).shape.0.clone();
                dims.push(table[1].clone());
                vec![(t(0).dtype, Shape(dims))]
            }
            Op::TakeAlong => {
                arity("2 (x, indices)", inputs.len() == 2)?;
                float(0)?;
                int(1)?;
                let x = t(0).shape.dims();
                if x.is_empty() || x[..x.len() - 1] != *t(1).shape.dims() {
                    return Err(shape_err(format!(
                        "indices {} must match {} without its last axis",
                        s(1),
                        s(0)
                    )));
                }
                vec![(t(0).dtype, t(1).shape.clone())]
            }
            Op::TopK { k } => {
                arity("1", inputs.len() == 1)?;
                float(0)?;
                let mut dims = t(0).shape.0.clone();
                let n = dims.last().and_then(Dim::as_const).ok_or_else(|| {
                    shape_err(format!("top-k needs a fixed last axis, got {}", s(0)))
                })?;
                if *k < 1 || *k > n {
                    return Err(IrError::Invalid {
                        op: name,
                        detail: format!("k = {k} must be between 1 and the last axis ({n})"),
                    });
                }
                *dims.last_mut().expect("checked non-empty above") = Dim::konst(*k);
                vec![(t(0).dtype, Shape(dims.clone())), (DType::I32, Shape(dims))]
            }
            Op::MoeDispatch {
                experts,
                capacity_factor,
            } => {
                arity("2 (x, indices)", inputs.len() == 2)?;
                float(0)?;
                int(1)?;
                let (x, idx) = (t(0).shape.dims(), t(1).shape.dims());
                if x.len() != 2 || idx.len() != 2 || x[0] != idx[0] {
                    return Err(shape_err(format!(
                        "tokens {} and indices {} must be [t, d] and [t, k]",
                        s(0),
                        s(1)
                    )));
                }
                let k = idx[1]
                    .as_const()
                    .ok_or_else(|| shape_err("k must be fixed".into()))?;
                let capacity = Ratio::new(k as i128, *experts as i128)
                    .and_then(|r| r.checked_mul(*capacity_factor))
                    .and_then(|r| x[0].checked_scale(r))
                    .ok_or_else(|| IrError::Overflow(format!("capacity of {experts} experts")))?;
                vec![(
                    t(0).dtype,
                    Shape(vec![Dim::konst(*experts), capacity, x[1].clone()]),
                )]
            }
            Op::MoeCombine => {
                arity("3 (expert outputs, weights, indices)", inputs.len() == 3)?;
                float(0)?;
                float(1)?;
                int(2)?;
                let (y, w, idx) = (t(0).shape.dims(), t(1).shape.dims(), t(2).shape.dims());
                if y.len() != 3 || w.len() != 2 || w != idx {
                    return Err(shape_err(format!(
                        "expert outputs {}, weights {} and indices {} must be [e, c, d], [t, k], [t, k]",
                        s(0),
                        s(1),
                        s(2)
                    )));
                }
                vec![(t(0).dtype, Shape(vec![w[0].clone(), y[2].clone()]))]
            }
            // Its output shape is a rank's share, which only the layout
            // knows: `localize` builds these nodes whole.
            Op::Relayout { .. } | Op::VocabParallel(_) => {
                return Err(IrError::Invalid {
                    op: name,
                    detail: "a layout change or a vocabulary-parallel op exists only in a rank's local program".into(),
                })
            }
            Op::Repeat {
                count,
                body,
                carried,
            } => {
                let _ = count;
                let reg = self.region(*body);
                if reg.args.len() != inputs.len() || *carried > inputs.len() {
                    return Err(IrError::Invalid {
                        op: name,
                        detail: format!(
                            "the body takes {} arguments but the repeat passes {}",
                            reg.args.len(),
                            inputs.len()
                        ),
                    });
                }
                for (i, (&arg, &input)) in reg.args.iter().zip(inputs).enumerate() {
                    let (a, b) = (self.tensor(arg), self.tensor(input));
                    if a.dtype != b.dtype || a.shape != b.shape {
                        return Err(shape_err(format!(
                            "argument {} of the body is {}{} but {}{} is passed",
                            i + 1,
                            a.dtype,
                            self.shape_str(&a.shape),
                            b.dtype,
                            self.shape_str(&b.shape)
                        )));
                    }
                }
                if reg.results.len() != *carried {
                    return Err(IrError::Invalid {
                        op: name,
                        detail: format!(
                            "the body yields {} values but carries {carried}",
                            reg.results.len()
                        ),
                    });
                }
                let mut outs = Vec::new();
                for (i, &r) in reg.results.iter().enumerate() {
                    let (res, arg) = (self.tensor(r), self.tensor(reg.args[i]));
                    if res.dtype != arg.dtype || res.shape != arg.shape {
                        return Err(shape_err(format!(
                            "carried value {} enters as {}{} but leaves as {}{}",
                            i + 1,
                            arg.dtype,
                            self.shape_str(&arg.shape),
                            res.dtype,
                            self.shape_str(&res.shape)
                        )));
                    }
                    outs.push((res.dtype, res.shape.clone()));
                }
                outs
            }
        })
    }
}

/// Numpy broadcasting of two shapes, aligned at the last axis.
pub fn broadcast(a: &Shape, b: &Shape) -> Option<Shape> {
    let rank = a.rank().max(b.rank());
    let one = Dim::konst(1);
    let mut out = Vec::with_capacity(rank);
    for i in 0..rank {
        let da = (i + a.rank()).checked_sub(rank).map_or(&one, |j| &a.0[j]);
        let db = (i + b.rank()).checked_sub(rank).map_or(&one, |j| &b.0[j]);
        out.push(if da == db || db.is_one() {
            da.clone()
        } else if da.is_one() {
            db.clone()
        } else {
            return None;
        });
    }
    Some(Shape(out))
}
