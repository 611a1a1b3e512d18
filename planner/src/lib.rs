//! dplc's planner: the cluster model and device catalog, the cost model
//! (memory per rank, step time), tensor-parallel layout and the strategy search.
//!
//! Architecture invariant: the planner is deterministic: the same request gives
//! a byte-identical `Plan`. Search wall time lives in [`Compiled`], not in the plan.

mod cluster;
mod cost;
mod deal;
pub mod egraph;
mod error;
mod layouts;
mod megatron;
mod memory;
mod profile;
mod report;
mod search;
mod sharding;
mod stages;
mod strategy;
mod timeline;
mod what_if;

pub use cluster::{
    catalog, check_plan_cluster, cluster_from_spec, device, parse_cluster, Cluster, Device, Link,
};
pub use cost::overlap_slowdown;
pub use error::PlanError;
pub use layouts::LayoutStats;
pub use megatron::derive_layout;
pub use report::{layouts_summary, memory_table, summary, throughput, to_json};
pub use strategy::{parse_strategy, Allow, AxisOrder, StrategyConstraints, SyncMode};
pub use timeline::{timeline, Span, SpanKind, Timeline};

use dplc_ir::validate as rules;
use dplc_ir::{Graph, MemoryBreakdown, Plan, Recompute, TrainSpec};
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

/// A plan, how long the search took to find it and how its layouts were found.
#[derive(Clone, Debug, PartialEq)]
pub struct Compiled {
    pub plan: Plan,
    pub search_time_ms: f64,
    /// Every e-graph the search ran (one per region and distinct degrees),
    /// then those of the chosen plan's programs.
    pub layouts: Vec<LayoutStats>,
    /// What the runtime cannot run of the priced layout, where the plan's
    /// layout fell back to Megatron's rule or a whole root.
    unrun: Option<Unrun>,
}

impl Compiled {
    /// Why the plan would run another layout than it was priced on, where a
    /// pinned choice keeps `compile` from planning it away.
    pub fn caveat(&self) -> Option<String> {
        let (choice, instead, pin) = match self.unrun? {
            Unrun::SequenceParallelStacks => (
                "its layer stacks split along the sequence as priced",
                "Megatron's rule for them",
                "sp=on",
            ),
            Unrun::VocabRoot => (
                "its embedding, head and loss split over the vocabulary as priced",
                "them whole on every rank",
                "root=vocab",
            ),
        };
        Some(format!(
            "dplc's runtime cannot run {choice}; it runs {instead} instead, whose memory and \
             step time may differ from these estimates; unpin {pin} for a plan that runs as priced"
        ))
    }
}

/// A part of the priced layout the runtime's layouts cannot say, so the
/// plan would run another than it was priced on.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Unrun {
    /// A layer stack's layout under sequence parallelism.
    SequenceParallelStacks,
    /// The root split over the vocabulary.
    VocabRoot,
}

/// Find the fastest plan that fits in memory, and price its neighbours
/// (one choice changed) for `explain`'s what-if lines.
pub fn compile(req: &PlanRequest) -> Result<Compiled, PlanError> {
    let cache = layouts::LayoutCache::default();
    let mut compiled = compile_one(req, &cache)?;
    // Architecture invariant: what runs is what was priced. Where the plan's
    // layout cannot be run as the search priced it, plan again without the
    // choice the runtime cannot run (unless the user pinned it).
    let mut pinned = req.pinned.clone();
    while let Some(unrun) = compiled.unrun {
        match unrun {
            Unrun::SequenceParallelStacks if pinned.sequence_parallel.is_none() => {
                pinned.sequence_parallel = Some(false);
            }
            Unrun::VocabRoot if pinned.root.is_none() => {
                pinned.root = Some(dplc_ir::RootSplit::Replicated);
            }
            _ => break,
        }
        let again = PlanRequest {
            pinned: pinned.clone(),
            ..req.clone()
        };
        let search_time_ms = compiled.search_time_ms;
        compiled = compile_one(&again, &cache)?;
        compiled.search_time_ms += search_time_ms;
        compiled.plan.search.pinned = req.pinned.to_string();
    }
    // compile_one priced the gradient synchronisations on the plan itself.
    let dp_alternatives = std::mem::take(&mut compiled.plan.what_if);
    compiled.plan.what_if = what_if::neighbours(req, &compiled.plan, &cache);
    compiled.plan.what_if.extend(dp_alternatives);
    // Architecture invariant: the planner writes only plans that load.
    compiled.plan.validate().map_err(|e| {
        PlanError::Model(format!(
            "the planner made a plan it would refuse to load ({e}); this is a bug in dplc"
        ))
    })?;
    Ok(compiled)
}

/// Pins of the gradient synchronisation that no configuration can satisfy,
/// said as what to change (the runtime runs a parameter server and the
/// compressions over replicated state, and compression over the all-reduce).
fn check_dp_sync_pins(pins: &StrategyConstraints, world: u64) -> Result<(), PlanError> {
    let changed = pins.sync.is_some_and(|s| s != SyncMode::AllReduce)
        || pins.compress.is_some_and(|c| !c.is_none());
    if changed && pins.zero.is_some_and(|z| z > 0) {
        return Err(PlanError::Strategy(
            "sync=ps|async and compress= run over replicated state (a parameter server shards \
             the optimizer state over its servers itself): pin zero=0 or leave zero out"
                .into(),
        ));
    }
    if pins.sync.is_some_and(|s| s != SyncMode::AllReduce)
        && pins.compress.is_some_and(|c| !c.is_none())
    {
        return Err(PlanError::Strategy(
            "compress= compresses the all-reduce; a parameter server pushes fp32 gradients: \
             drop compress or pin sync=allreduce"
                .into(),
        ));
    }
    if pins.ps_ranks == Some(dplc_ir::ServerRanks::Dedicated)
        && (pins.cp.is_some_and(|x| x > 1) || pins.ep.is_some_and(|x| x > 1))
    {
        return Err(PlanError::Strategy(
            "ps_ranks=dedicated runs beside data, pipeline and tensor parallelism: drop cp and \
             ep, or ps_ranks"
                .into(),
        ));
    }
    pins.grad_sync(pins.dp.unwrap_or(world)).map(|_| ())
}

/// Why a model with the free dimension `dim` cannot be planned, and what to do.
pub fn unbound_dim_message(dim: &str) -> String {
    format!(
        "the dimension `{dim}` has no value: dplc gives values to `batch` (the micro-batch) and `seq` (--seq or the train section) only; \
         make `{dim}` a model argument (e.g. `model m({dim} = 512)`) or use `seq`"
    )
}

fn compile_one(req: &PlanRequest, cache: &layouts::LayoutCache) -> Result<Compiled, PlanError> {
    let start = Instant::now();
    let global_batch = req.global_batch.unwrap_or(req.train.global_batch);
    let seq = req.seq.unwrap_or(req.train.seq);
    let request = PlanError::Request;
    rules::global_batch(global_batch).map_err(request)?;
    rules::seq(seq).map_err(request)?;
    rules::fits_context(seq, req.graph).map_err(request)?;
    if let Some(dim) = req.graph.unbound_dims().first() {
        return Err(PlanError::Model(unbound_dim_message(dim)));
    }
    rules::trainable(req.graph).map_err(|e| PlanError::Model(e.to_string()))?;
    let world = rules::world(req.cluster.nodes, req.cluster.devices_per_node).map_err(request)?;
    if let Some(o) = req.pinned.offload.filter(|o| !o.is_none()) {
        if req.cluster.device.host_memory_bytes == 0
            || req.cluster.device.host_link_bandwidth <= 0.0
        {
            return Err(PlanError::Strategy(format!(
                "offload={} needs a host to offload to, and {} has none in the catalog \
                 (a cluster section's accelerator(…, host_memory = …, host_link = …, \
                 host_memory_bandwidth = …) describes one)",
                o.name(),
                req.cluster.device.name
            )));
        }
        if o.params && req.pinned.zero.is_some_and(|z| z != 3) {
            return Err(PlanError::Strategy(
                "offload=params offloads ZeRO-3's weight shards: it needs zero=3".into(),
            ));
        }
    }
    check_dp_sync_pins(&req.pinned, world)?;
    if req.pinned.fp8 == Some(true) && req.cluster.device.peak_fp8 <= 0.0 {
        return Err(PlanError::Strategy(format!(
            "fp8=on needs FP8 tensor cores, and {} has none (H100, H200, GH200, B200 and \
             MI300X have them; a cluster section's accelerator(…, fp8 = … TFLOP/s) gives a \
             device its FP8 rate)",
            req.cluster.device.name
        )));
    }
    if let Some(g) = req.pinned.grad_reduce {
        let training = req.train.precision;
        let matches =
            g == dplc_ir::GradReduce::Fp32 || Some(g) == dplc_ir::GradReduce::half_for(training);
        if !matches {
            let instead = match training {
                dplc_ir::Precision::Fp32 => "an fp32 model's gradients are fp32 (`compress=bf16` \
                                             rounds them for the reduction only)"
                    .to_string(),
                p => format!("grad_reduce={} keeps them in it", p.name()),
            };
            return Err(PlanError::Strategy(format!(
                "grad_reduce={} keeps the main gradients in the training precision, and this \
                 model trains in {}: {instead}",
                g.name(),
                training.name()
            )));
        }
    }
    if let Some(n) = req.pinned.fp8_bf16_ends.filter(|&n| n > 0) {
        if req.pinned.fp8 != Some(true) {
            return Err(PlanError::Strategy(
                "fp8_bf16_ends keeps the end layers' GEMMs in bf16 under FP8: it needs fp8=on"
                    .into(),
            ));
        }
        let layers = dplc_ir::Analysis::new(req.graph).layers();
        if n.saturating_mul(2) > layers {
            return Err(PlanError::Strategy(format!(
                "fp8_bf16_ends={n} keeps {n} layers at each end in bf16, but the model has {layers}"
            )));
        }
    }
    if let Some(n) = req.pinned.recompute_layers {
        if req.pinned.recompute.is_some_and(|r| r != Recompute::Full) {
            let what = match n {
                0 => "all".to_string(),
                n => n.to_string(),
            };
            return Err(PlanError::Strategy(format!(
                "recompute_layers={what} says which layers recompute fully: it needs recompute=full (or no recompute pinned)"
            )));
        }
        let layers = dplc_ir::Analysis::new(req.graph).layers();
        if n > layers {
            return Err(PlanError::Strategy(format!(
                "recompute_layers={n} recomputes {n} layers of each chunk, but the model has {layers}"
            )));
        }
    }
    if req.pinned.fp8_gather == Some(true) {
        if req.pinned.fp8 != Some(true) {
            return Err(PlanError::Strategy(
                "fp8_gather=on gathers the weights' FP8 casts: it needs fp8=on".into(),
            ));
        }
        if req.pinned.zero == Some(0) {
            return Err(PlanError::Strategy(
                "fp8_gather=on changes what ZeRO's weight all-gathers move: it needs zero ≥ 1"
                    .into(),
            ));
        }
    }
    let precision = req.train.precision;
    let layouts = layouts::Layouts::new(
        req.graph,
        precision,
        &req.cluster,
        seq,
        degrees(req, world),
        cache,
    )?;
    let profile = match layouts.get((1, 1)) {
        Some(l) => &l.profile,
        None => {
            let why = match layouts.by_degrees.get(&(1, 1)).map(|l| &**l) {
                Some(Err(why)) => why.as_str(),
                _ => "no layout",
            };
            return Err(PlanError::Model(format!(
                "`{}` has no single-rank layout: {why}",
                req.graph.name
            )));
        }
    };
    search::validate(&req.pinned, &layouts, profile, world, global_batch, seq)?;
    let search = |offloads: &[dplc_ir::Offload]| {
        search::search(
            &layouts,
            &req.cluster,
            (global_batch, seq),
            &req.pinned,
            offloads,
            req.top_k,
            req.ignore_memory,
        )
    };
    let mut out = search(&[req.pinned.offload.unwrap_or_default()]);
    // Offloading trades step time for memory: tried only when nothing fits
    // on the devices alone, and only where there is a host to offload to.
    if out.best.is_empty()
        && req.pinned.offload.is_none()
        && req.cluster.device.host_memory_bytes > 0
    {
        let o = |params, activations| dplc_ir::Offload {
            optimizer: true,
            params,
            activations,
        };
        let offloaded = search(&[
            o(false, false),
            o(false, true),
            o(true, false),
            o(true, true),
        ]);
        if !offloaded.best.is_empty() {
            out = offloaded;
        }
    }
    let Some(best) = out.best.first() else {
        return Err(infeasible(req, &out, world));
    };
    let c = &best.config;
    let layout = layouts
        .get((c.tp, c.ep))
        .expect("the search only prices degrees with a layout");
    let mut stats: Vec<LayoutStats> = layouts
        .by_degrees
        .values()
        .filter_map(|l| (**l).as_ref().ok())
        .flat_map(|l| {
            let n = l.stacks.len();
            l.stacks
                .iter()
                .enumerate()
                .map(move |(i, s)| LayoutStats::of(&layouts::stack_name(i, n), s))
                .chain([LayoutStats::of("model", &l.root)])
        })
        .collect();
    // The plan's programs at its own degrees; under sequence parallelism the
    // e-graph runs again with the residual stream split along the sequence.
    let (stacks, root) = if c.sp {
        let programs =
            cache.sequence_parallel(req.graph, &req.cluster, precision, seq, (c.tp, c.ep));
        let (l, r) = (*programs).clone().map_err(PlanError::Model)?;
        let n = l.len();
        for (i, s) in l.iter().enumerate() {
            stats.push(LayoutStats::of(&layouts::stack_name(i, n), s));
        }
        stats.push(LayoutStats::of("model", &r));
        (l, r)
    } else {
        (layout.stacks.clone(), layout.root.clone())
    };
    let programs: Vec<dplc_ir::RegionProgram> =
        stacks.iter().map(|s| s.region_program.clone()).collect();
    let runtime: Option<Vec<_>> = stacks.into_iter().map(|s| s.runtime_layout).collect();
    let (root, root_runtime) = (root.region_program, root.runtime_layout);
    let mut plan = report::build_plan(
        layout.profile_for(c.root),
        &req.cluster,
        global_batch,
        seq,
        &out.best,
        out.evaluated,
        out.evaluated * analytic_choices(req),
        out.feasible,
        req.pinned.to_string(),
    );
    plan.what_if = what_if::dp_sync(
        layout.profile_for(c.root),
        &req.cluster,
        seq,
        best,
        req.cluster.device.memory_bytes,
    );
    plan.search.skipped = layouts
        .by_degrees
        .iter()
        .filter_map(|(&(tp, ep), l)| {
            (**l).as_ref().err().map(|why| dplc_ir::SkippedDegree {
                tp,
                ep,
                reason: why.clone(),
            })
        })
        .collect();
    // A replicated root runs the single-rank program of the model's ends.
    let root = match (c.root, layouts.get((1, c.ep))) {
        (dplc_ir::RootSplit::Replicated, Some(whole)) => whole.root.region_program.clone(),
        _ => root,
    };
    let mut unrun = None;
    if c.tp > 1 || c.ep > 1 {
        plan.programs = programs;
        plan.programs.push(root);
        // The runtime executes the e-graph's layouts of the layer stacks
        // where its layouts can say them, else the Megatron derivation
        // (which `compile` plans away from where it can).
        let model =
            match runtime.and_then(|l| layouts::model_layout(req.graph, l, (c.tp, c.ep), c.sp)) {
                Some(m) => Some(m),
                None => {
                    if c.sp {
                        unrun = Some(Unrun::SequenceParallelStacks);
                    }
                    derive_layout(req.graph, c.tp, c.ep, c.sp).ok()
                }
            };
        // The root runs as priced: split over the vocabulary as the root's
        // e-graph split it, or whole on every rank.
        plan.layout = match (c.root, model, root_runtime) {
            (dplc_ir::RootSplit::Vocab, Some(m), r) if c.tp > 1 => {
                let with = r.and_then(|r| layouts::with_root(req.graph, m.clone(), &r));
                if with.is_none() {
                    unrun = unrun.or(Some(Unrun::VocabRoot));
                }
                with.or(Some(m))
            }
            (_, m, _) => m,
        };
    }
    Ok(Compiled {
        plan,
        search_time_ms: start.elapsed().as_secs_f64() * 1e3,
        layouts: stats,
        unrun,
    })
}

/// How many configurations each evaluated one stands for: the choices of
/// the knobs the search settles per mesh without enumerating them, because
/// one choice is never worse in the cost model — fused attention, Megatron's
/// async tensor-parallel overlap (of none, async, ring: ring needs sequence
/// parallelism and TE's userbuffers, so it is pinned, not searched), fused
/// gradient accumulation, the overlapped gradient reduction, the
/// vocabulary-split root, time-balanced stages — or that changes the
/// numerics and is never chosen unasked (FP8, where the device has it) —
/// or, for a model with experts, the token dispatcher (hierarchical is never
/// slower, but the search keeps the all-to-all dplc's ranks run).
/// A pinned knob has one choice.
fn analytic_choices(req: &PlanRequest) -> u64 {
    let (pins, cluster) = (&req.pinned, &req.cluster);
    let knob = |pinned: bool, choices: u64| if pinned { 1 } else { choices };
    knob(pins.attention.is_some(), 2)
        * knob(pins.tp_overlap.is_some(), 3)
        * knob(pins.grad_accum.is_some(), 2)
        * knob(pins.overlap_grad_reduce.is_some(), 2)
        * knob(pins.root.is_some(), 2)
        * knob(pins.even_stages.is_some(), 2)
        * knob(pins.fp8.is_some() || cluster.device.peak_fp8 <= 0.0, 2)
        * knob(
            pins.dispatch.is_some() || rules::model_experts(req.graph).is_none(),
            2,
        )
}

/// The tensor- and expert-parallel degrees the search may try: divisors of the
/// world, inside a node unless pinned, and the expert counts' divisors.
fn degrees(req: &PlanRequest, world: u64) -> Vec<(u64, u64)> {
    let divisors = |n: u64| rules::divisors(n).into_iter();
    let pins = &req.pinned;
    let tps: Vec<u64> = divisors(world)
        .filter(|&t| match pins.tp {
            Some(p) => p == t,
            None => t <= req.cluster.devices_per_node,
        })
        .collect();
    let eps: Vec<u64> = match rules::model_experts(req.graph) {
        Some(e) => divisors(world)
            .filter(|&x| e.is_multiple_of(x) && pins.ep.is_none_or(|p| p == x))
            .collect(),
        None => vec![1],
    };
    let mut out = Vec::new();
    for &t in &tps {
        for &e in &eps {
            if world.is_multiple_of(t * e) {
                out.push((t, e));
            }
        }
    }
    // One rank's layout is always there: validation and the degree-free parts
    // of the profile (layers, experts, FLOPs) read it.
    if !out.contains(&(1, 1)) {
        out.insert(0, (1, 1));
    }
    out
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

/// Why nothing satisfies the pins, as precisely as the pins allow: pinned
/// mesh degrees that leave devices over for one free degree say which, and
/// only otherwise is the batch the likely cause.
fn no_configuration(pins: &StrategyConstraints, world: u64) -> String {
    let degrees = [
        ("dp", pins.dp),
        ("tp", pins.tp),
        ("pp", pins.pp),
        ("cp", pins.cp),
    ];
    let pinned: Vec<(&str, u64)> = degrees
        .iter()
        .filter_map(|(n, d)| d.map(|d| (*n, d)))
        .collect();
    let free: Vec<&str> = degrees
        .iter()
        .filter(|(_, d)| d.is_none())
        .map(|(n, _)| *n)
        .collect();
    let product: u64 = pinned.iter().map(|(_, d)| d).product();
    // ZeRO shards over the data- and context-parallel ranks; pinned tp and
    // pp that fill the cluster leave it one (so does a pinned dp=1 cp=1).
    let sharding = world / (pins.tp.unwrap_or(1) * pins.pp.unwrap_or(1)).max(1);
    let single = sharding <= 1 || (pins.dp == Some(1) && pins.cp == Some(1));
    let offloads = pins.offload.is_some_and(|o| o.optimizer || o.params);
    if let (Some(zero @ 1..), true, false) = (pins.zero, single, offloads) {
        return format!(
            "no configuration satisfies `{pins}` on {world} devices: zero={zero} shards state \
             over the data-parallel ranks and this split leaves one; pin zero=0, or leave \
             devices to dp (smaller tp or pp)"
        );
    }
    // A free dp is bound by the batch (dp × mb must divide it); a free tp,
    // pp or cp by the model (heads, layers, sequence).
    if let [only] = free.as_slice() {
        if product < world && *only != "dp" {
            let mesh = pinned
                .iter()
                .map(|(n, d)| format!("{n} {d}"))
                .collect::<Vec<_>>()
                .join(" × ");
            return format!(
                "no configuration satisfies `{pins}` on {world} devices: {mesh} leave {only}={} to fill the cluster, and {only}={} is not possible for this model and batch; pin {only} or change the others",
                world / product.max(1),
                world / product.max(1)
            );
        }
    }
    if *pins == StrategyConstraints::default() {
        // Nothing pinned: the batch and the model bound every degree.
        return format!(
            "no split of this model and batch fills {world} devices: dp × micro-batch must \
             divide the global batch and tp, pp and cp the model (its heads, layers, sequence); \
             plan for fewer devices or a larger --global-batch"
        );
    }
    format!(
        "no configuration satisfies `{pins}` on {world} devices (check that the global batch splits over dp × mb)"
    )
}

fn infeasible(req: &PlanRequest, out: &search::Outcome, world: u64) -> PlanError {
    let cap = req.cluster.device.memory_bytes;
    // Plans that fit the device but not the host: host memory is what is short.
    if let Some(h) = &out.host_short {
        let c = &h.config;
        let host_cap = req.cluster.device.host_memory_bytes;
        return PlanError::Infeasible(format!(
            "{} does not fit on {}: plans that fit the {} memory offload more than the host \
             holds — the least any needs is {} of host memory a rank (stage {} of dp {} × tp {} \
             × pp {} × cp {}, ZeRO-{}, offload {}: {}), and a rank's share of the host is {}. \
             To make it fit, try more nodes (each brings its host memory), offloading less than \
             `{}`, or a cluster section whose `host_memory` is larger.",
            req.graph.name,
            req.cluster.name,
            req.cluster.device.name,
            gib(h.memory.host),
            h.stage,
            c.dp,
            c.tp,
            c.pp,
            c.cp,
            c.zero,
            c.offload.name(),
            breakdown(&h.memory),
            gib(host_cap),
            c.offload.name()
        ));
    }
    let Some(s) = &out.smallest else {
        return PlanError::Strategy(no_configuration(&req.pinned, world));
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
    let bigger: Vec<String> = catalog()
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
