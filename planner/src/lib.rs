//! dplc's planner: the cluster model and device catalog, the cost model
//! (memory per rank, step time), tensor-parallel layout and the strategy search.
//!
//! Architecture invariant: the planner is deterministic: the same request gives
//! a byte-identical `Plan`. Search wall time lives in [`Compiled`], not in the plan.

mod cluster;
mod cost;
pub mod egraph;
mod error;
mod profile;
mod report;
mod search;
mod sharding;
mod strategy;

pub use cluster::{catalog, cluster_from_spec, device, parse_cluster, Cluster, Device, Link};
pub use error::PlanError;
pub use report::{summary, to_json};
pub use strategy::{parse_strategy, StrategyConstraints};

use dplc_ir::{Graph, MemoryBreakdown, Plan, TrainSpec};
use std::time::Instant;

/// What to plan: a lowered model, its training setup and the cluster.
#[derive(Clone, Debug)]
pub struct PlanRequest<'a> {
    pub graph: &'a Graph,
    pub train: TrainSpec,
    pub cluster: Cluster,
    /// Overrides `train.global_batch`.
    pub global_batch: Option<u64>,
    /// Overrides `train.seq`.
    pub seq: Option<u64>,
    pub pinned: StrategyConstraints,
    /// Runners-up to report with the reason each lost.
    pub top_k: usize,
    /// Plan even when nothing fits (for what-if questions such as "how much
    /// memory would this configuration need"); the plan's memory says by how much.
    pub ignore_memory: bool,
}

impl<'a> PlanRequest<'a> {
    pub fn new(graph: &'a Graph, train: TrainSpec, cluster: Cluster) -> PlanRequest<'a> {
        PlanRequest {
            graph,
            train,
            cluster,
            global_batch: None,
            seq: None,
            pinned: StrategyConstraints::default(),
            top_k: 0,
            ignore_memory: false,
        }
    }
}

/// A plan and how long the search took to find it.
#[derive(Clone, Debug, PartialEq)]
pub struct Compiled {
    pub plan: Plan,
    pub search_time_ms: f64,
}

/// Find the fastest plan that fits in memory.
pub fn compile(req: &PlanRequest) -> Result<Compiled, PlanError> {
    let start = Instant::now();
    let profile = profile::ModelProfile::new(req.graph, req.train.precision)?;
    let global_batch = req.global_batch.unwrap_or(req.train.global_batch);
    let seq = req.seq.unwrap_or(req.train.seq);
    if global_batch == 0 || seq == 0 {
        return Err(PlanError::Strategy(
            "the global batch and the sequence length must be positive".into(),
        ));
    }
    let world = req.cluster.world_size();
    search::validate(&req.pinned, &profile, world, global_batch, seq)?;
    let out = search::search(
        &profile,
        &req.cluster,
        global_batch,
        seq,
        &req.pinned,
        req.top_k,
        req.ignore_memory,
    );
    if out.best.is_empty() {
        return Err(infeasible(req, &out, world));
    }
    let plan = report::build_plan(
        &profile,
        &req.cluster,
        global_batch,
        seq,
        &out.best,
        out.evaluated,
        out.feasible,
        req.pinned.to_string(),
    );
    Ok(Compiled {
        plan,
        search_time_ms: start.elapsed().as_secs_f64() * 1e3,
    })
}

fn gib(b: u64) -> String {
    format!("{:.2} GiB", b as f64 / (1u64 << 30) as f64)
}

fn breakdown(m: &MemoryBreakdown) -> String {
    format!(
        "weights {}, gradients {}, optimizer {}, activations {}, embedding and loss {}, buffers {}",
        gib(m.weights),
        gib(m.gradients),
        gib(m.optimizer),
        gib(m.activations),
        gib(m.embedding_and_loss),
        gib(m.buffers)
    )
}

fn infeasible(req: &PlanRequest, out: &search::Outcome, world: u64) -> PlanError {
    let cap = req.cluster.device.memory_bytes;
    let Some(s) = &out.smallest else {
        return PlanError::Strategy(format!(
            "no configuration satisfies `{}` on {} devices (check that the global batch splits over dp × mb)",
            req.pinned, world
        ));
    };
    let total = s.memory.total();
    let c = &s.config;
    let mut fixes = Vec::new();
    let ratio = total as f64 / cap as f64;
    let more = ((ratio * world as f64) / req.cluster.devices_per_node as f64).ceil() as u64
        * req.cluster.devices_per_node;
    fixes.push(format!(
        "about {}× the devices (≈ {more}) so that weights and optimizer states shard further",
        ratio.ceil() as u64
    ));
    if c.recompute != dplc_ir::Recompute::Full {
        fixes.push("full activation recomputation (`recompute=full`)".into());
    }
    if req.pinned != StrategyConstraints::default() {
        fixes.push(format!("fewer pinned choices than `{}`", req.pinned));
    }
    let bigger: Vec<&str> = catalog()
        .into_iter()
        .filter(|d| d.memory_bytes > cap && d.name != "cpu")
        .map(|d| d.name)
        .collect();
    if !bigger.is_empty() {
        fixes.push(format!("a device with more memory ({})", bigger.join(", ")));
    }
    PlanError::Infeasible(format!(
        "{} does not fit on {}: the smallest per-rank memory any plan reaches is {} \
         (stage {} of dp {} × tp {} × pp {} × cp {}, micro-batch {}, ZeRO-{}, recompute {}: {}), \
         but a {} holds {}. To make it fit, try {}.",
        req.graph.name,
        req.cluster.name,
        gib(total),
        s.stage,
        c.dp,
        c.tp,
        c.pp,
        c.cp,
        c.micro_batch,
        c.zero,
        c.recompute.name(),
        breakdown(&s.memory),
        req.cluster.device.name,
        gib(cap),
        fixes.join("; or ")
    ))
}
