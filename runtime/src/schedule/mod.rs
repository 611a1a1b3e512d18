//! The schedule executor: ranks as threads (or processes) over a dp × pp ×
//! tp grid, each running its pipeline order of forward and backward work on
//! micro-batches, then the gradient synchronisation of its ZeRO stage,
//! clipping and the optimizer step. What computes a chunk's forward or
//! backward is a compute backend ([`compute::StageCompute`]): the reference
//! interpreter or the fused kernels; everything else is decided here, once,
//! for both. This module checks a run (`checks`), sets it up (`setup`:
//! layouts, GPUs, the checkpoint it resumes), starts its ranks and puts
//! their outcomes together into the report; what each rank does is `rank`.

mod checks;
mod compute;
mod config;
mod fused;
mod held;
mod rank;
mod report;
mod setup;

pub use config::{Device, Faults, Process, RunConfig, StopFlag, TraceSink, TraceSpan};
pub use report::{AttentionUse, Collectives, DeviceUse, Parameters, StepStats, TrainReport};

use crate::checkpoint::{self, Resume};
use crate::comm::{Communicator, Group, World};
use crate::data::{feeds, Corpus, Feed};
use crate::error::{Result, RuntimeError};
use crate::fused::HostBackend;
use crate::gradsync::Traffic;
use crate::interp::{ParamKey, Value};
use crate::params::{
    DeviceStorage, DpState, HeldParam, HostStaged, HostStorage, ParamStore, Storage, StoreInit,
    Unit, ZeroStage,
};
use crate::partition::{schedule, Partition, Work};
use crate::shard::{concat_along, Layouts, MeshGroups};
use crate::tensor::Tensor;
pub use compute::Compute;
use compute::{Forwarded, Pass, Reference, StageCompute};
use dplc_ir::{GradPlan, Graph, Op, RegionId, SplitAxis, TrainSpec};
use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::path::PathBuf;
use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};

/// Everything the ranks share, read-only.
struct Shared<'a> {
    graph: &'a Graph,
    plan: GradPlan,
    part: Partition,
    spec: &'a TrainSpec,
    cfg: &'a RunConfig,
    data: &'a Corpus,
    /// What feeds each model input.
    feeds: Vec<(dplc_ir::TensorId, Feed)>,
    seed: u64,
    syms: Vec<i64>,
    seq: usize,
    /// Root parameters used on more than one stage (tied weights), by key.
    tied: BTreeMap<ParamKey, Vec<usize>>,
    layouts: Option<Layouts>,
    /// When the run started: trace spans count from here.
    started: Instant,
    /// Whether the other ranks live in other processes (their trace spans
    /// are gathered to rank 0 at the end).
    remote: bool,
    /// The checkpoint the run starts from, verified and unsharded.
    resume: Option<Resume>,
    /// Completed steps before this run (the checkpoint's step, else 0).
    start_step: u64,
    /// The global index of the first sample of step `start_step`.
    sample_base: u64,
    /// The model's parameters, as checkpoints record them.
    signature: Vec<checkpoint::SavedParam>,
    /// Step directories rank 0 completed.
    saved: std::sync::Mutex<Vec<PathBuf>>,
    /// The checkpoint directory, held while this run saves into it (by the
    /// process of rank 0, which writes the manifests).
    lock: Option<checkpoint::DirLock>,
    /// The fused kernels' plan, made once for every rank (`Compute::Fused`).
    fused: Option<fused::FusedProgram>,
    /// The GPUs of a `Device::Cuda` run by ordinal, opened once: those of
    /// this process's ranks only.
    gpus: Vec<Option<Arc<crate::gpu::GpuDevice>>>,
    /// How GPU ranks sum their state ([`Shared::collectives`]).
    collectives: Collectives,
    /// Where CPU ranks of this process hand each other the fused compute's
    /// buffers (`crate::params::SharedDevice` over the host's memory).
    shelf: crate::fused::Shelf,
}

impl Shared<'_> {
    /// The loss gradient each micro-batch starts its backward from: each
    /// micro-batch's loss is a mean over its tokens, the step's loss the mean
    /// over all micro-batches of all replicas.
    fn loss_scale(&self) -> f32 {
        1.0 / (self.cfg.replicas() * self.cfg.num_micro_batches) as f32
    }
}

/// Where one rank sits in the grid: rank = (dp_index · pp + stage) · tp + tp_index,
/// `dp_index` counting weight replicas (`cp` consecutive ones share a sample:
/// a context-parallel group).
#[derive(Clone, Copy, Debug)]
struct Coords {
    dp_index: usize,
    stage: usize,
    tp_index: usize,
}

impl Coords {
    fn of(rank: usize, cfg: &RunConfig) -> Coords {
        Coords {
            dp_index: rank / (cfg.pp * cfg.tp),
            stage: cfg.stage_of(rank),
            tp_index: rank % cfg.tp,
        }
    }

    fn rank(self, cfg: &RunConfig) -> usize {
        (self.dp_index * cfg.pp + self.stage) * cfg.tp + self.tp_index
    }
}

/// What a rank hands back at the end.
struct RankOut {
    stage: usize,
    peak_activation_bytes: u64,
    device_peak_bytes: Option<u64>,
    /// Host–device copies its store's device counted (the compute's too).
    host_crossings: Option<u64>,
    /// Layers its forwards ran for micro-batch 0 of the first step.
    layers_run: u64,
    exported: Vec<Exported>,
    rank: usize,
    traffic: Traffic,
}

/// A rank's part of one parameter it holds.
struct Exported {
    key: ParamKey,
    value: Tensor,
    /// `(axis, index)` of a tensor- or expert-parallel part.
    part: Option<(usize, usize)>,
}

/// Train `graph` for `steps` steps on `cfg.dp × cfg.pp` rank threads.
#[allow(clippy::too_many_arguments)]
pub fn train(
    graph: &Graph,
    spec: &TrainSpec,
    cfg: &RunConfig,
    data: &Corpus,
    steps: u64,
    seed: u64,
    on_step: impl FnMut(&StepStats),
) -> Result<TrainReport> {
    train_on(graph, spec, cfg, data, steps, seed, None, on_step)
}

/// Train as the one rank `process.rank()` of a world of processes (mpirun,
/// or a launcher whose ranks meet over TCP), the other ranks reached
/// through its transport. The collectives sum the same
/// contributions in the same group order as the threaded run, so the losses
/// equal `train`'s bit for bit. `on_step` sees every step on rank 0 only; the
/// report's parameters are the parts this rank holds. Checkpoints work as in
/// one process — every rank writes its own shard file and rank 0 the
/// manifest — so `cfg.checkpoint.dir` must be one directory every process
/// sees (one machine, or a shared filesystem). A recording `cfg.trace` ends
/// up holding every rank's spans in rank 0's process.
#[allow(clippy::too_many_arguments)]
pub fn train_process(
    graph: &Graph,
    spec: &TrainSpec,
    cfg: &RunConfig,
    data: &Corpus,
    steps: u64,
    seed: u64,
    process: Process<'_>,
    on_step: impl FnMut(&StepStats),
) -> Result<TrainReport> {
    if process.size() != cfg.ranks() {
        return Err(RuntimeError::Config(format!(
            "the split needs {} ranks, but {} processes were started",
            cfg.ranks(),
            process.size()
        )));
    }
    train_on(graph, spec, cfg, data, steps, seed, Some(process), on_step)
}

#[allow(clippy::too_many_arguments)]
fn train_on(
    graph: &Graph,
    spec: &TrainSpec,
    cfg: &RunConfig,
    data: &Corpus,
    steps: u64,
    seed: u64,
    process: Option<Process<'_>>,
    on_step: impl FnMut(&StepStats),
) -> Result<TrainReport> {
    checks::positive_degrees(cfg)?;
    // Context parallelism runs each rank's program: the model at its
    // sequence positions, with the K/V all-gathers made explicit.
    let (cp_graph, cp_cfg);
    let (graph, cfg) = if cfg.cp > 1 {
        checks::context_checks(graph, spec, cfg)?;
        let config = |e: dplc_ir::IrError| RuntimeError::Config(e.to_string());
        cp_graph = dplc_ir::split_context(graph, cfg.cp as u64).map_err(config)?;
        // The plan's tensor-parallel layout, with the program's new nodes.
        let layout = match &cfg.layout {
            Some(l) => Some(dplc_ir::context_layout(&cp_graph, l).map_err(config)?),
            None => None,
        };
        cp_cfg = RunConfig {
            layout,
            ..cfg.clone()
        };
        (&cp_graph, &cp_cfg)
    } else {
        (graph, cfg)
    };
    checks::mesh_fits(spec, cfg)?;
    let layouts = setup::layouts(graph, cfg)?;
    let seq = spec.seq as usize;
    let syms = setup::symbols(graph, cfg, seq)?;
    checks::scalar_loss(graph)?;
    let feeds = feeds(graph, data, &syms)?;
    if feeds
        .iter()
        .any(|(_, f)| matches!(f, Feed::Tokens | Feed::Targets))
    {
        // The stream's ids index whatever the tokens and targets index.
        let vocab = feeds
            .iter()
            .filter(|(_, f)| matches!(f, Feed::Tokens | Feed::Targets))
            .filter_map(|&(t, _)| graph.index_bound(t))
            .min();
        data.check(seq, vocab.map(|v| v as usize))?;
    }
    let part = Partition::new(
        graph,
        cfg.pp,
        cfg.schedule.chunks(),
        cfg.stage_layers.as_deref(),
    )?;
    let tied = setup::tied_params(graph, &part, cfg.pp);
    let mut shared = Shared {
        graph,
        plan: GradPlan::new(graph),
        part,
        spec,
        cfg,
        data,
        feeds,
        seed,
        syms,
        seq,
        tied,
        layouts,
        started: Instant::now(),
        remote: process.is_some(),
        resume: None,
        start_step: 0,
        sample_base: 0,
        signature: Vec::new(),
        saved: std::sync::Mutex::default(),
        lock: None,
        fused: None,
        gpus: Vec::new(),
        collectives: Collectives::HostStaged,
        shelf: crate::fused::Shelf::default(),
    };
    if cfg.compute == Compute::Fused {
        shared.fused = Some(fused::plan(&shared)?);
    }
    setup::attach_gpus(&mut shared, process)?;
    setup::resume(&mut shared, steps)?;
    cfg.faults.check(cfg.ranks(), shared.start_step, steps)?;
    // The process that writes the checkpoints holds their directory.
    if let Some(ck) = &cfg.checkpoint {
        if process.is_none_or(|p| p.rank() == 0) {
            let writes = shared.start_step + 1..=steps;
            shared.lock = Some(checkpoint::lock_dir(&ck.dir, writes)?);
        }
    }
    let shared = shared;
    let (stats, results) = spawn_ranks(&shared, process, steps, on_step)?;
    assemble(&shared, stats, results, steps)
}

/// The ranks this process runs, each on its own thread until the last step
/// or the first failure (a panic becomes an error, and any error but a
/// peer's failure or a non-finite step poisons the world so the others
/// stop): the steps' statistics as rank 0 reported them, and each rank's
/// outcome.
fn spawn_ranks(
    shared: &Shared<'_>,
    process: Option<Process<'_>>,
    steps: u64,
    mut on_step: impl FnMut(&StepStats),
) -> Result<(Vec<StepStats>, Vec<Result<RankOut>>)> {
    let cfg = shared.cfg;
    let (world, here) = match process {
        None => (World::new(cfg.ranks(), cfg.timeout), 0..cfg.ranks()),
        Some(p) => (
            World::remote(cfg.ranks(), p.rank(), cfg.timeout, p.transport()?),
            p.rank()..p.rank() + 1,
        ),
    };
    let (tx, rx) = mpsc::channel::<StepStats>();
    let mut stats = Vec::new();
    let results: Vec<Result<RankOut>> = std::thread::scope(|s| {
        let handles: Vec<_> = here
            .map(|rank| {
                let comm = world.communicator(rank);
                let tx = tx.clone();
                let world = &world;
                std::thread::Builder::new()
                    .name(format!("rank{rank}"))
                    .spawn_scoped(s, move || {
                        let run = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                            rank::run_rank(shared, comm, steps, &tx)
                        }));
                        let result = match run {
                            Ok(r) => r,
                            Err(panic) => {
                                let msg = panic
                                    .downcast_ref::<String>()
                                    .cloned()
                                    .or_else(|| panic.downcast_ref::<&str>().map(|s| s.to_string()))
                                    .unwrap_or_else(|| "unknown panic".into());
                                Err(RuntimeError::Kernel {
                                    op: "rank",
                                    detail: format!("panicked: {msg}"),
                                })
                            }
                        };
                        if let Err(e) = &result {
                            // Every rank stops at a non-finite step by itself.
                            if !matches!(
                                e,
                                RuntimeError::RankFailed { .. } | RuntimeError::NonFinite { .. }
                            ) {
                                world.poison(rank, e.to_string());
                            }
                        }
                        result
                    })
                    .expect("the OS starts a rank thread")
            })
            .collect();
        drop(tx);
        for st in rx {
            on_step(&st);
            stats.push(st);
        }
        handles
            .into_iter()
            .map(|h| {
                h.join().unwrap_or_else(|_| {
                    Err(RuntimeError::Kernel {
                        op: "rank",
                        detail: "panicked".into(),
                    })
                })
            })
            .collect()
    });
    if let Some((rank, reason)) = world.failure() {
        return Err(RuntimeError::RankFailed { rank, reason });
    }
    Ok((stats, results))
}

/// The run's report from its ranks' outcomes: split parameters put back
/// together from their parts (in part order), the checkpoints written,
/// each stage's layers, the peaks and the data-parallel traffic.
fn assemble(
    shared: &Shared<'_>,
    stats: Vec<StepStats>,
    results: Vec<Result<RankOut>>,
    steps: u64,
) -> Result<TrainReport> {
    let (graph, cfg) = (shared.graph, shared.cfg);
    let checkpoints = std::mem::take(
        &mut *shared
            .saved
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner()),
    );
    let mut parts: BTreeMap<ParamKey, BTreeMap<usize, (usize, Tensor)>> = BTreeMap::new();
    let mut stage_layers = vec![0; cfg.pp];
    let mut peak_activation_bytes = 0;
    let mut device_peak = None;
    let mut host_crossings = None;
    let mut dp_traffic = vec![Traffic::default(); cfg.ranks()];
    for r in results {
        let out = r?;
        dp_traffic[out.rank] = out.traffic;
        if out.rank < cfg.world_size() {
            stage_layers[out.stage] = out.layers_run;
        }
        peak_activation_bytes = peak_activation_bytes.max(out.peak_activation_bytes);
        device_peak = device_peak.max(out.device_peak_bytes);
        host_crossings = host_crossings.max(out.host_crossings);
        for e in out.exported {
            let (axis, index) = e.part.unwrap_or((0, 0));
            parts
                .entry(e.key)
                .or_default()
                .entry(index)
                .or_insert((axis, e.value));
        }
    }
    let mut params = Parameters::default();
    for (k, ps) in parts {
        let axis = ps.values().next().map_or(0, |p| p.0);
        let pieces: Vec<Tensor> = ps.into_values().map(|p| p.1).collect();
        let whole = if pieces.len() == 1 {
            pieces.into_iter().next().expect("one piece")
        } else {
            concat_along(&pieces, axis)?
        };
        params
            .values
            .insert(k, (graph.param(k.param).name.clone(), whole));
    }
    Ok(TrainReport {
        interrupted: (stats.len() as u64) < steps - shared.start_step,
        steps: stats,
        params,
        checkpoints,
        stage_layers,
        peak_activation_bytes,
        dp_traffic,
        memory_peak_bytes: device_peak,
        host_crossings,
        device: shared.gpus.iter().flatten().next().map(|g| DeviceUse {
            name: g.name().to_string(),
            peak_bytes: device_peak.unwrap_or(0),
            kernels: match (&shared.fused, &shared.cfg.device) {
                (Some(f), Device::Cuda { dtype, .. }) => f.kernel_count(*dtype),
                _ => 0,
            },
            collectives: shared.collectives,
        }),
        attention: shared.fused.as_ref().map(|f| f.attentions()),
    })
}
