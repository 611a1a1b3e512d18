//! The sharding e-graph: one region (a layer body, or the model's root) as an
//! e-graph of layouts and collectives; rewrite rules discover the tensor-,
//! sequence-, vocabulary- and expert-parallel layouts, and a DAG-aware
//! extraction picks the fastest per-rank program. [`shard_region`] returns it
//! as the `sharding::RegionSharding` the rest of the planner reads,
//! and in the runtime's terms ([`RuntimeLayout`], module `runtime`).

pub mod analysis;
pub mod backward;
pub mod extract;
pub mod lang;
pub mod lower;
pub mod rules;
mod runtime;

pub use runtime::RuntimeLayout;

use crate::sharding::{GemmSplit, RegionSharding, TpCollective, TpCollectiveKind};
use analysis::{mesh_of, num_of, tag_of, Context, Data, Part, ShardAnalysis, ShardGraph};
use dplc_ir::{Analysis, Dim, Graph, Op, ParamId, RegionId, TensorId};
use egg::{Id, Language, Runner, SimpleScheduler, StopReason};
use extract::{CostModel, Program};
use fxhash::FxHashMap as HashMap;
pub use lang::{MeshAxis, OpTag, ShardLang};
use std::collections::{BTreeMap, BTreeSet};
use std::fmt::Write as _;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Latency and bandwidth of the links a mesh axis runs over.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LinkCost {
    pub alpha_s: f64,
    pub bytes_per_s: f64,
}

/// How far saturation may go.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Limits {
    pub nodes: usize,
    pub iterations: usize,
    pub time: Duration,
}

/// What to shard for: the degrees of the mesh axes, sequence parallelism, the
/// values of the symbolic dims used for costing, and the machine's rates.
#[derive(Clone, Debug, PartialEq)]
pub struct ShardOptions {
    pub tp: u64,
    pub ep: u64,
    pub cp: u64,
    pub sequence_parallel: bool,
    /// Micro-batch and sequence length the costs are evaluated at.
    pub batch: u64,
    pub seq: u64,
    /// Bytes per activation and weight element (2 for bf16/fp16).
    pub element_bytes: u64,
    pub flops_per_s: f64,
    pub memory_bytes_per_s: f64,
    /// Links of the tp, ep and cp axes, in [`MeshAxis`] order.
    pub links: [LinkCost; 3],
    /// What keeping one byte of weight on every rank instead of split costs:
    /// the memory a tensor-parallel degree exists to save, as time (its
    /// optimizer update and data-parallel gradient traffic, and headroom).
    pub replicated_weight_s_per_byte: f64,
    pub limits: Limits,
}

impl Default for ShardOptions {
    fn default() -> Self {
        let nvlink = LinkCost {
            alpha_s: 2e-6,
            bytes_per_s: 300e9,
        };
        ShardOptions {
            tp: 1,
            ep: 1,
            cp: 1,
            sequence_parallel: false,
            batch: 1,
            seq: 2048,
            element_bytes: 2,
            flops_per_s: 312e12,
            memory_bytes_per_s: 2.0e12,
            links: [
                nvlink,
                LinkCost {
                    alpha_s: 5e-6,
                    bytes_per_s: 25e9,
                },
                nvlink,
            ],
            replicated_weight_s_per_byte: 1e-9,
            limits: Limits {
                nodes: 20_000,
                iterations: 60,
                time: Duration::from_secs(5),
            },
        }
    }
}

impl ShardOptions {
    pub fn tensor_parallel(tp: u64) -> ShardOptions {
        ShardOptions {
            tp,
            ..ShardOptions::default()
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum ShardError {
    #[error("cannot lower the region to the sharding e-graph: {0}")]
    Lowering(String),
    #[error("no layout of the region is computable: {0}")]
    NoLayout(String),
}

/// The collectives the extracted program performs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum CollectiveKind {
    AllReduce,
    AllGather,
    ReduceScatter,
    AllToAll,
    /// Row max and sum of a softmax over a split axis (fp32 all-reduce).
    RowStats,
}

impl CollectiveKind {
    pub fn name(self) -> &'static str {
        match self {
            CollectiveKind::AllReduce => "all-reduce",
            CollectiveKind::AllGather => "all-gather",
            CollectiveKind::ReduceScatter => "reduce-scatter",
            CollectiveKind::AllToAll => "all-to-all",
            CollectiveKind::RowStats => "row-stats",
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Pass {
    Forward,
    Backward,
}

/// One collective per iteration of the region.
#[derive(Clone, Debug, PartialEq)]
pub struct Collective {
    pub kind: CollectiveKind,
    pub pass: Pass,
    pub mesh: MeshAxis,
    /// Elements of the whole (unsplit) tensor it moves.
    pub elements: Dim,
    /// The IR tensor it moves (or the gradient of).
    pub tensor: Option<TensorId>,
}

/// How the saturation went.
#[derive(Clone, Debug, PartialEq)]
pub struct EgraphStats {
    pub nodes: usize,
    pub classes: usize,
    pub iterations: usize,
    pub stop_reason: String,
    pub time: Duration,
    /// Per-rank step time of the extracted program under the options' rates.
    pub cost_s: f64,
}

/// The extracted layout of a region.
#[derive(Clone, Debug)]
pub struct ShardResult {
    /// The layout in the form the planner reads (as `sharding::propagate` fills it).
    pub sharding: RegionSharding,
    /// The extracted per-rank program, one value per line.
    pub program: String,
    /// The same program as plan data (what `explain`, `viz` and the runtime read).
    pub region_program: dplc_ir::RegionProgram,
    /// The program as the runtime's per-node layouts, when the runtime can
    /// express it (tensor and sequence parallelism, no expert or context axis).
    /// The root's leaves its layer stacks replicated: the bodies' layouts say
    /// how they run.
    pub runtime_layout: Option<RuntimeLayout>,
    pub collectives: Vec<Collective>,
    pub stats: EgraphStats,
}

impl ShardResult {
    /// The collective list, one per line, with symbolic element counts.
    pub fn collectives_text(&self, g: &Graph) -> String {
        let mut s = String::new();
        for c in &self.collectives {
            let pass = match c.pass {
                Pass::Forward => "forward",
                Pass::Backward => "backward",
            };
            let t = c.tensor.map(|t| format!(" ({t})")).unwrap_or_default();
            let _ = writeln!(
                s,
                "{pass} {} {} {}{t}",
                c.kind.name(),
                c.mesh,
                g.dim_str(&c.elements)
            );
        }
        s
    }
}

/// Discover the layout of `region` for the options' mesh and return the
/// fastest program's layout, collectives and the e-graph's statistics.
pub fn shard_region(
    g: &Graph,
    an: &Analysis,
    region: RegionId,
    opts: &ShardOptions,
) -> Result<ShardResult, ShardError> {
    let start = Instant::now();
    let reg = g.region(region);
    let seq_sym = g.sym_by_name("seq");
    let mut ctx = Context {
        ops: lower::op_table(g, region),
        args: reg
            .args
            .iter()
            .map(|a| g.tensor(*a).shape.dims().to_vec())
            .collect(),
        arg_grad: reg
            .args
            .iter()
            .map(|a| an.requires_grad(*a) || an.is_activation(*a))
            .collect(),
        local_args: vec![None; reg.args.len()],
        degree: [opts.tp.max(1), opts.ep.max(1), opts.cp.max(1)],
        sequence_parallel: opts.sequence_parallel && opts.tp > 1,
        seq_sym,
        batch_sym: g.sym_by_name("batch"),
    };
    let sp = ctx.sequence_parallel;
    if sp {
        for (i, shape) in ctx.args.clone().iter().enumerate() {
            ctx.local_args[i] = ctx
                .seq_axis(shape)
                .filter(|&s| ctx.splits(shape, s, MeshAxis::Tp));
        }
    }
    let ctx = Arc::new(ctx);
    let mut eg = ShardGraph::new(ShardAnalysis {
        ctx: ctx.clone(),
        conflicts: 0,
    });
    let classes = lower::lower(g, region, &ctx, &mut eg)?;
    let tp = eg.add(ShardLang::Mesh(MeshAxis::Tp));
    // Under sequence parallelism the residual stream enters and leaves split
    // along the sequence: the argument's whole value is a gather of its shards.
    for (i, &a) in reg.args.iter().enumerate() {
        if let Some(s) = ctx.local_args[i] {
            let axis = eg.add(ShardLang::Num(s as i64));
            let arg = classes[&a];
            let shard = eg.add(ShardLang::Shard([tp, axis, arg]));
            let whole = eg.add(ShardLang::AllGather([tp, axis, shard]));
            eg.union(arg, whole);
        }
    }
    let mut roots = Vec::new();
    for &r in &reg.results {
        let id = classes[&r];
        let s = ctx
            .seq_axis(g.tensor(r).shape.dims())
            .filter(|&s| sp && ctx.splits(g.tensor(r).shape.dims(), s, MeshAxis::Tp));
        roots.push(match s {
            Some(s) => {
                let axis = eg.add(ShardLang::Num(s as i64));
                eg.add(ShardLang::Shard([tp, axis, id]))
            }
            None => id,
        });
    }
    eg.rebuild();
    let runner: Runner<ShardLang, ShardAnalysis, ()> = Runner::new(ShardAnalysis {
        ctx: ctx.clone(),
        conflicts: 0,
    })
    .with_egraph(eg)
    .with_node_limit(opts.limits.nodes)
    .with_iter_limit(opts.limits.iterations)
    .with_time_limit(opts.limits.time)
    .with_scheduler(SimpleScheduler)
    .run(&rules::all_rules());
    let stop_reason = match &runner.stop_reason {
        Some(StopReason::Saturated) => "saturated".to_string(),
        Some(StopReason::IterationLimit(n)) => format!("iteration limit ({n})"),
        Some(StopReason::NodeLimit(n)) => format!("node limit ({n})"),
        Some(StopReason::TimeLimit(t)) => format!("time limit ({t:.2} s)"),
        Some(StopReason::Other(s)) => s.clone(),
        None => "not run".to_string(),
    };
    let eg = &runner.egraph;
    if eg.analysis.conflicts > 0 {
        return Err(ShardError::NoLayout(format!(
            "{} merges of classes with different layouts (a rule is unsound)",
            eg.analysis.conflicts
        )));
    }
    let cost = CostModel::new(opts, eg);
    let program = extract::extract(eg, &roots, &cost);
    if !program.cost.is_finite() {
        return Err(ShardError::NoLayout(format!(
            "every program of region {region} needs a value no rank holds (tp {}, ep {}, sp {})",
            opts.tp, opts.ep, sp
        )));
    }
    let back = backward::derive(eg, &program);
    let names = Names::new(eg, &program);
    let collectives = collect(g, eg, &program, &back, &names);
    let sharding = region_sharding(g, an, region, eg, &program, &collectives, &names, opts);
    let stats = EgraphStats {
        nodes: eg.total_number_of_nodes(),
        classes: eg.number_of_classes(),
        iterations: runner.iterations.len(),
        stop_reason,
        time: start.elapsed(),
        cost_s: program.cost,
    };
    let region_program = region_program(g, eg, &program, &back, &names, opts, &stats);
    let runtime_layout = runtime::runtime_layout(g, region, eg, &program);
    Ok(ShardResult {
        sharding,
        program: print_program(g, eg, &program, &names),
        region_program,
        runtime_layout,
        collectives,
        stats,
    })
}

/// The IR tensor behind each class of the program, and its printed name.
struct Names {
    tensor: HashMap<Id, Option<TensorId>>,
    value: HashMap<Id, String>,
}

impl Names {
    fn new(eg: &ShardGraph, p: &Program) -> Names {
        let mut tensor = HashMap::default();
        let mut value = HashMap::default();
        for (i, &c) in p.order.iter().enumerate() {
            value.insert(c, format!("v{i}"));
            let t = tensor_behind(eg, &p.choice[&c], &tensor);
            tensor.insert(c, t);
        }
        Names { tensor, value }
    }
}

fn tensor_behind(
    eg: &ShardGraph,
    n: &ShardLang,
    known: &HashMap<Id, Option<TensorId>>,
) -> Option<TensorId> {
    let ctx = &eg.analysis.ctx;
    if let Some((tag, _)) = n.tagged() {
        let tag = tag_of(eg, tag)?;
        return Some(ctx.op(tag).outputs[tag.output as usize]);
    }
    let x = *n.children().last()?;
    match known.get(&eg.find(x)) {
        Some(t) => *t,
        None => eg[x].nodes.iter().find_map(|xn| {
            xn.tagged()
                .and_then(|(tag, _)| tag_of(eg, tag))
                .map(|tag| ctx.op(tag).outputs[tag.output as usize])
        }),
    }
}

fn numel_of(data: &Data) -> Dim {
    dplc_ir::Shape(data.shape().to_vec())
        .numel()
        .unwrap_or_else(|| Dim::konst(0))
}

fn collect(
    _g: &Graph,
    eg: &ShardGraph,
    p: &Program,
    back: &[backward::BackwardCollective],
    names: &Names,
) -> Vec<Collective> {
    let mut out = Vec::new();
    for &c in &p.order {
        let n = &p.choice[&c];
        let (kind, m) = match n {
            ShardLang::AllReduce([m, _]) => (CollectiveKind::AllReduce, *m),
            ShardLang::AllGather([m, _, _]) => (CollectiveKind::AllGather, *m),
            ShardLang::ReduceScatter([m, _, _]) => (CollectiveKind::ReduceScatter, *m),
            ShardLang::AllToAll([m, _, _]) => (CollectiveKind::AllToAll, *m),
            ShardLang::Softmax([tag, x]) => {
                let (Some(tag), Some(l)) = (tag_of(eg, *tag), eg[*x].data.layout()) else {
                    continue;
                };
                let axis = match eg.analysis.ctx.op(tag).op {
                    Op::Softmax { axis } | Op::LogSoftmax { axis } => axis,
                    _ => continue,
                };
                for m in MeshAxis::ALL {
                    if l.get(m) == Part::Sharded(axis) {
                        let shape = eg[*x].data.shape();
                        let rows = numel_of(&eg[*x].data)
                            .checked_div(&shape[axis])
                            .and_then(|r| r.checked_scale(dplc_ir::Ratio::int(2)))
                            .unwrap_or_else(|| Dim::konst(0));
                        out.push(Collective {
                            kind: CollectiveKind::RowStats,
                            pass: Pass::Forward,
                            mesh: m,
                            elements: rows,
                            tensor: names.tensor[&c],
                        });
                    }
                }
                continue;
            }
            _ => continue,
        };
        out.push(Collective {
            kind,
            pass: Pass::Forward,
            mesh: mesh_of(eg, m).expect("a collective names its mesh axis"),
            elements: numel_of(&eg[c].data),
            tensor: names.tensor[&c],
        });
    }
    for b in back {
        out.push(Collective {
            kind: b.kind,
            pass: Pass::Backward,
            mesh: b.mesh,
            elements: numel_of(&eg[b.class].data),
            tensor: names.tensor[&b.class],
        });
    }
    out
}

fn layout_str(data: &Data) -> String {
    let Some(l) = data.layout() else {
        return "invalid".into();
    };
    let parts: Vec<String> = MeshAxis::ALL
        .iter()
        .filter_map(|&m| match l.get(m) {
            Part::Replicated => None,
            Part::Sharded(a) => Some(format!("{m}:shard({a})")),
            Part::Partial => Some(format!("{m}:partial")),
        })
        .collect();
    if parts.is_empty() {
        "replicated".into()
    } else {
        parts.join(" ")
    }
}

/// A class outside the program (a stored shard's full tensor), written inline.
fn inline(eg: &ShardGraph, id: Id, depth: usize) -> String {
    let class = &eg[id];
    let pick = class
        .nodes
        .iter()
        .find(|n| {
            matches!(
                n,
                ShardLang::Param(_) | ShardLang::Leaf(_) | ShardLang::Arg(_)
            )
        })
        .or_else(|| class.nodes.iter().find(|n| n.tagged().is_some()))
        .unwrap_or(&class.nodes[0]);
    node_str(eg, pick, &|c| {
        if depth > 4 {
            "…".into()
        } else {
            inline(eg, c, depth + 1)
        }
    })
}

fn node_str(eg: &ShardGraph, n: &ShardLang, child: &dyn Fn(Id) -> String) -> String {
    let mut s = format!("({n}");
    for &c in n.children() {
        s.push(' ');
        match &eg[c].data {
            Data::Mesh(m) => s.push_str(m.name()),
            Data::Num(k) => s.push_str(&k.to_string()),
            Data::Tag(t) => s.push_str(&t.to_string()),
            Data::Tensor { .. } => s.push_str(&child(c)),
        }
    }
    s.push(')');
    s
}

fn ir_axis(m: MeshAxis) -> dplc_ir::MeshAxis {
    match m {
        MeshAxis::Tp => dplc_ir::MeshAxis::Tp,
        MeshAxis::Ep => dplc_ir::MeshAxis::Ep,
        MeshAxis::Cp => dplc_ir::MeshAxis::Cp,
    }
}

fn ir_collective(k: CollectiveKind) -> dplc_ir::CollectiveKind {
    match k {
        CollectiveKind::AllReduce | CollectiveKind::RowStats => dplc_ir::CollectiveKind::AllReduce,
        CollectiveKind::AllGather => dplc_ir::CollectiveKind::AllGather,
        CollectiveKind::ReduceScatter => dplc_ir::CollectiveKind::ReduceScatter,
        CollectiveKind::AllToAll => dplc_ir::CollectiveKind::AllToAll,
    }
}

/// The extracted program as plan data: one value per class, operands by name.
fn region_program(
    g: &Graph,
    eg: &ShardGraph,
    p: &Program,
    back: &[backward::BackwardCollective],
    names: &Names,
    opts: &ShardOptions,
    stats: &EgraphStats,
) -> dplc_ir::RegionProgram {
    let mut values = Vec::new();
    for &c in &p.order {
        let n = &p.choice[&c];
        let stored = CostModel::stored_shard(eg, n);
        let expr = if stored {
            node_str(eg, n, &|x| inline(eg, x, 0))
        } else {
            node_str(eg, n, &|x| names.value[&eg.find(x)].clone())
        };
        let inputs = CostModel::inputs(eg, n)
            .into_iter()
            .map(|x| names.value[&eg.find(x)].clone())
            .collect();
        let data = &eg[c].data;
        let layout = data
            .layout()
            .map(|l| {
                MeshAxis::ALL
                    .iter()
                    .filter_map(|&m| match l.get(m) {
                        Part::Replicated => None,
                        Part::Sharded(a) => Some((ir_axis(m), dplc_ir::AxisPart::Shard(a))),
                        Part::Partial => Some((ir_axis(m), dplc_ir::AxisPart::Partial)),
                    })
                    .collect()
            })
            .unwrap_or_default();
        let collective = match n {
            ShardLang::AllReduce(_) => Some(dplc_ir::CollectiveKind::AllReduce),
            ShardLang::AllGather(_) => Some(dplc_ir::CollectiveKind::AllGather),
            ShardLang::ReduceScatter(_) => Some(dplc_ir::CollectiveKind::ReduceScatter),
            ShardLang::AllToAll(_) => Some(dplc_ir::CollectiveKind::AllToAll),
            _ => None,
        };
        values.push(dplc_ir::ProgramValue {
            name: names.value[&c].clone(),
            expr,
            shape: g.shape_str(&dplc_ir::Shape(data.shape().to_vec())),
            layout,
            tensor: names.tensor[&c].map(|t| t.index() as u32),
            collective,
            inputs,
        });
    }
    let backward = back
        .iter()
        .map(|b| dplc_ir::BackwardCollective {
            kind: ir_collective(b.kind),
            axis: ir_axis(b.mesh),
            of: names
                .value
                .get(&eg.find(b.class))
                .cloned()
                .unwrap_or_else(|| inline(eg, b.class, 0)),
            elements: g.dim_str(&numel_of(&eg[b.class].data)),
        })
        .collect();
    dplc_ir::RegionProgram {
        region: String::new(),
        tp: opts.tp.max(1),
        ep: opts.ep.max(1),
        sequence_parallel: eg.analysis.ctx.sequence_parallel,
        values,
        outputs: p.roots.iter().map(|r| names.value[r].clone()).collect(),
        backward,
        egraph_nodes: stats.nodes as u64,
        egraph_iterations: stats.iterations as u64,
        stop_reason: stats.stop_reason.clone(),
    }
}

fn print_program(g: &Graph, eg: &ShardGraph, p: &Program, names: &Names) -> String {
    let mut s = String::new();
    for &c in &p.order {
        let n = &p.choice[&c];
        let body = if CostModel::stored_shard(eg, n) {
            node_str(eg, n, &|x| inline(eg, x, 0))
        } else {
            node_str(eg, n, &|x| names.value[&eg.find(x)].clone())
        };
        let data = &eg[c].data;
        let shape = g.shape_str(&dplc_ir::Shape(data.shape().to_vec()));
        let _ = writeln!(
            s,
            "{} = {body} : {shape} {}",
            names.value[&c],
            layout_str(data)
        );
    }
    let roots: Vec<&str> = p.roots.iter().map(|r| names.value[r].as_str()).collect();
    let _ = writeln!(s, "yield {}", roots.join(", "));
    s
}

/// The parameter a weight class holds, with `axis` of the class mapped to the
/// parameter's own dim through transposes.
fn param_behind(eg: &ShardGraph, id: Id, axis: usize) -> Option<(ParamId, usize)> {
    let ctx = &eg.analysis.ctx;
    for n in &eg[id].nodes {
        if let ShardLang::Param(tag) = n {
            if let Op::Param(p) = ctx.op(tag_of(eg, *tag)?).op {
                return Some((p, axis));
            }
        }
    }
    // A weight split over two axes (experts over ep, then columns over tp) is
    // a shard of a shard: the dims keep their places, so look through it.
    for n in &eg[id].nodes {
        if let ShardLang::Shard([_, _, inner]) = n {
            if let Some(found) = param_behind(eg, *inner, axis) {
                return Some(found);
            }
        }
    }
    for n in &eg[id].nodes {
        let Some((tag, ops)) = n.tagged() else {
            continue;
        };
        let info = ctx.op(tag_of(eg, tag)?);
        let a = match &info.op {
            Op::Transpose { perm } => perm[axis],
            Op::Cast(_) => axis,
            _ => continue,
        };
        return param_behind(eg, ops[0], a);
    }
    None
}

#[allow(clippy::too_many_arguments)]
fn region_sharding(
    g: &Graph,
    an: &Analysis,
    region: RegionId,
    eg: &ShardGraph,
    p: &Program,
    collectives: &[Collective],
    names: &Names,
    opts: &ShardOptions,
) -> RegionSharding {
    let ctx = &eg.analysis.ctx;
    let tp = MeshAxis::Tp;
    let mut out = RegionSharding::default();
    let mut split_sizes: Vec<i64> = Vec::new();
    // Sharded tensors: every computed copy is split over tp.
    let mut copies: BTreeMap<TensorId, (bool, bool)> = BTreeMap::new();
    for &c in &p.order {
        let (Some(t), Some(l)) = (names.tensor[&c], eg[c].data.layout()) else {
            continue;
        };
        if l.get(MeshAxis::Ep) == Part::Sharded(0) {
            out.experts.insert(an.storage_root(t));
        }
        let e = copies.entry(an.storage_root(t)).or_insert((false, false));
        match l.get(tp) {
            Part::Sharded(a) => {
                e.0 = true;
                if let Some(n) = eg[c].data.shape().get(a).and_then(|d| d.as_const()) {
                    split_sizes.push(n);
                }
            }
            _ => e.1 = true,
        }
    }
    out.sharded = copies
        .into_iter()
        .filter(|(_, (sharded, whole))| *sharded && !whole)
        .map(|(t, _)| t)
        .collect();
    // How each matmul ran; split parameters from the stored shards.
    for &c in &p.order {
        match &p.choice[&c] {
            ShardLang::MatMul([tag, a, b]) => {
                let Some(tag) = tag_of(eg, *tag) else {
                    continue;
                };
                let (la, lb) = (eg[*a].data.layout(), eg[*b].data.layout());
                let (pa, pb) = (
                    la.map_or(Part::Replicated, |l| l.get(tp)),
                    lb.map_or(Part::Replicated, |l| l.get(tp)),
                );
                let (ra, rb) = (eg[*a].data.shape().len(), eg[*b].data.shape().len());
                let split = match (pa, pb) {
                    (Part::Replicated, Part::Sharded(y)) if y + 1 == rb => GemmSplit::Column,
                    (Part::Sharded(x), Part::Sharded(y)) if x + 1 == ra && y + 2 == rb => {
                        GemmSplit::Row
                    }
                    (Part::Sharded(_), _) | (_, Part::Sharded(_)) => GemmSplit::Batch,
                    _ => GemmSplit::Replicated,
                };
                let e = out.gemms.entry(tag.node).or_insert(split);
                if *e == GemmSplit::Replicated {
                    *e = split;
                }
            }
            ShardLang::Shard([m, a, x]) if eg[*x].data.flags().weight => {
                let (Some(m), Some(a)) = (mesh_of(eg, *m), num_of(eg, *a)) else {
                    continue;
                };
                if let Some((param, dim)) = param_behind(eg, *x, a as usize) {
                    match m {
                        MeshAxis::Tp => {
                            out.split_params.entry(param).or_insert(dim);
                            if let Some(n) = g.param(param).shape.dims()[dim].as_const() {
                                split_sizes.push(n);
                            }
                        }
                        MeshAxis::Ep => {
                            out.expert_params.insert(param);
                        }
                        MeshAxis::Cp => {}
                    }
                }
            }
            _ => {}
        }
    }
    // Matmuls that only ever ran whole, and expert weights (a leading experts
    // dim) as `propagate` reports them whatever the expert degree.
    for (&n, info) in &ctx.ops {
        if let Op::MatMul = info.op {
            out.gemms.entry(n).or_insert(GemmSplit::Replicated);
            let (a, b) = (info.inputs[0], info.inputs[1]);
            if info.in_shapes[1].len() == 3 && !an.is_activation(b) && an.is_activation(a) {
                let mut t = b;
                while let Some(node) = g.producer(t) {
                    match &node.op {
                        Op::Param(p) => {
                            out.expert_params.insert(*p);
                            break;
                        }
                        op if op.is_view() || matches!(op, Op::Cast(_)) => t = node.inputs[0],
                        _ => break,
                    }
                }
            }
        }
    }
    // Collectives in the planner's terms: a reduce-scatter and its all-gather
    // are one all-reduce split in two (sequence parallelism).
    let elements = |c: &Collective| c.elements.clone();
    let mut gathers_left: BTreeMap<(Pass, Dim), usize> = BTreeMap::new();
    for c in collectives
        .iter()
        .filter(|c| c.mesh == tp && c.kind == CollectiveKind::ReduceScatter)
    {
        *gathers_left.entry((c.pass, elements(c))).or_default() += 1;
    }
    for c in collectives {
        let tensor = c.tensor.unwrap_or_else(|| TensorId::new(0));
        let kind = match (c.mesh, c.kind) {
            (MeshAxis::Tp, CollectiveKind::AllReduce | CollectiveKind::ReduceScatter) => {
                TpCollectiveKind::AllReduce
            }
            (MeshAxis::Tp, CollectiveKind::AllGather) => {
                match gathers_left.get_mut(&(c.pass, elements(c))) {
                    Some(k) if *k > 0 => {
                        *k -= 1;
                        continue;
                    }
                    _ => TpCollectiveKind::AllGather,
                }
            }
            (MeshAxis::Tp, CollectiveKind::RowStats) => TpCollectiveKind::RowStats,
            (MeshAxis::Ep, CollectiveKind::AllToAll) => {
                if c.pass == Pass::Forward {
                    out.all_to_all.push(c.elements.clone());
                }
                continue;
            }
            _ => continue,
        };
        out.collectives.push(TpCollective {
            kind,
            pass: match c.pass {
                Pass::Forward => crate::sharding::Pass::Forward,
                Pass::Backward => crate::sharding::Pass::Backward,
            },
            tensor,
            elements: c.elements.clone(),
            fp32: c.kind == CollectiveKind::RowStats,
        });
    }
    let _ = region;
    out.max_tp = if opts.tp > 1 {
        split_sizes.iter().fold(0i64, |a, &b| gcd(a, b)).max(1) as u64
    } else {
        1
    };
    out
}

fn gcd(a: i64, b: i64) -> i64 {
    if b == 0 {
        a
    } else {
        gcd(b, a % b)
    }
}

/// Parameters split over `mesh` in a result, by name: for tests and reports.
pub fn split_param_names(g: &Graph, r: &ShardResult) -> BTreeSet<String> {
    r.sharding
        .split_params
        .iter()
        .map(|(p, d)| format!("{}/{d}", g.param(*p).name))
        .collect()
}

/// Saturate `start` (an expression over `region`'s ops) with `rules` and say
/// whether `goal` landed in its class: the `egg::test_fn!` check, with this
/// e-graph's analysis context. For the rule families' "start => goal" tests.
pub fn proves(
    g: &Graph,
    an: &Analysis,
    region: RegionId,
    opts: &ShardOptions,
    rules: &[rules::Rule],
    start: &str,
    goal: &str,
) -> Result<bool, ShardError> {
    let reg = g.region(region);
    let ctx = Arc::new(Context {
        ops: lower::op_table(g, region),
        args: reg
            .args
            .iter()
            .map(|a| g.tensor(*a).shape.dims().to_vec())
            .collect(),
        arg_grad: reg
            .args
            .iter()
            .map(|a| an.requires_grad(*a) || an.is_activation(*a))
            .collect(),
        local_args: vec![None; reg.args.len()],
        degree: [opts.tp.max(1), opts.ep.max(1), opts.cp.max(1)],
        sequence_parallel: opts.sequence_parallel && opts.tp > 1,
        seq_sym: g.sym_by_name("seq"),
        batch_sym: g.sym_by_name("batch"),
    });
    let start: egg::RecExpr<ShardLang> = start
        .parse()
        .map_err(|e| ShardError::Lowering(format!("bad start expression: {e}")))?;
    let goal: egg::Pattern<ShardLang> = goal
        .parse()
        .map_err(|e| ShardError::Lowering(format!("bad goal pattern: {e}")))?;
    let analysis = ShardAnalysis { ctx, conflicts: 0 };
    let runner: Runner<ShardLang, ShardAnalysis, ()> = Runner::new(analysis)
        .with_expr(&start)
        .with_node_limit(opts.limits.nodes)
        .with_iter_limit(opts.limits.iterations)
        .with_time_limit(opts.limits.time)
        .with_scheduler(SimpleScheduler)
        .run(rules);
    let root = runner.egraph.find(runner.roots[0]);
    Ok(egg::Searcher::search_eclass(&goal, &runner.egraph, root).is_some())
}
