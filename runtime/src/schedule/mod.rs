//! The schedule executor: ranks as threads (or processes) over a dp × pp ×
//! tp grid, each running its pipeline order of forward and backward work on
//! micro-batches, then the gradient synchronisation of its ZeRO stage,
//! clipping and the optimizer step. What computes a chunk's forward or
//! backward is a compute backend ([`compute::StageCompute`]): the reference
//! interpreter or the fused kernels; everything else is decided here, once,
//! for both.

mod checks;
mod compute;
mod config;
mod fused;
mod held;
mod report;

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
            stage: (rank / cfg.tp) % cfg.pp,
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
    mut on_step: impl FnMut(&StepStats),
) -> Result<TrainReport> {
    if cfg.dp == 0
        || cfg.cp == 0
        || cfg.pp == 0
        || cfg.tp == 0
        || cfg.ep == 0
        || cfg.micro_batch == 0
        || cfg.num_micro_batches == 0
    {
        return Err(RuntimeError::Config(
            "dp, cp, pp, tp, ep, micro_batch and num_micro_batches must be positive".into(),
        ));
    }
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
    if !cfg.dp.is_multiple_of(cfg.ep) {
        return Err(RuntimeError::Config(format!(
            "expert parallelism splits the data-parallel replicas: ep {} must divide dp {}",
            cfg.ep, cfg.dp
        )));
    }
    // Under cp each rank splits its own `seq / cp` positions over tp.
    if cfg.sequence_parallel && !(spec.seq as usize / cfg.cp).is_multiple_of(cfg.tp) {
        return Err(RuntimeError::Config(format!(
            "sequence parallelism splits the sequence: tp {} must divide seq {}{}",
            cfg.tp,
            spec.seq,
            if cfg.cp > 1 {
                format!(" / cp {}", cfg.cp)
            } else {
                String::new()
            }
        )));
    }
    let layouts = if cfg.tp > 1 || cfg.ep > 1 {
        let model = cfg.layout.as_ref().ok_or_else(|| {
            RuntimeError::Config(format!(
                "tp {} ep {} splits tensors, but the run carries no layout: the planner writes one into every split plan (compile it again)",
                cfg.tp, cfg.ep
            ))
        })?;
        if model.tp != cfg.tp as u64 || model.ep != cfg.ep as u64 {
            return Err(RuntimeError::Config(format!(
                "the layout is for tp {} ep {}, the run has tp {} ep {}",
                model.tp, model.ep, cfg.tp, cfg.ep
            )));
        }
        Some(Layouts::new(graph, model)?)
    } else {
        None
    };
    if cfg.global_batch() as u64 != spec.global_batch {
        return Err(RuntimeError::Config(format!(
            "dp {} × micro_batch {} × micro-batches {} = {} samples, but the global batch is {}",
            cfg.dp,
            cfg.micro_batch,
            cfg.num_micro_batches,
            cfg.global_batch(),
            spec.global_batch
        )));
    }
    checks::check_dp_sync(cfg)?;
    let v = cfg.schedule.chunks();
    if v > 1 && !cfg.num_micro_batches.is_multiple_of(cfg.pp) {
        return Err(RuntimeError::Config(format!(
            "the interleaved schedule needs the micro-batches ({}) to be a multiple of pp ({})",
            cfg.num_micro_batches, cfg.pp
        )));
    }
    let seq = spec.seq as usize;
    let mut syms = Vec::new();
    for name in graph.sym_names() {
        syms.push(match name.as_str() {
            "batch" => cfg.micro_batch as i64,
            "seq" => seq as i64,
            other => {
                return Err(RuntimeError::Unsupported(format!(
                    "the symbolic dimension `{other}` has no value"
                )))
            }
        });
    }
    let loss = *graph
        .outputs()
        .first()
        .ok_or_else(|| RuntimeError::Config("the model returns nothing".into()))?;
    if !graph.tensor(loss).shape.dims().is_empty() || !graph.tensor(loss).dtype.is_float() {
        return Err(RuntimeError::Config(
            "the model's first result must be a scalar float loss".into(),
        ));
    }
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
    let part = Partition::new(graph, cfg.pp, v, cfg.stage_layers.as_deref())?;
    let mut tied: BTreeMap<ParamKey, Vec<usize>> = BTreeMap::new();
    for (c, chunk) in part.chunks.iter().enumerate() {
        for &n in &chunk.nodes {
            if let Op::Param(p) = graph.node(n).op {
                let stages = tied.entry(ParamKey { param: p, layer: 0 }).or_default();
                if !stages.contains(&(c % cfg.pp)) {
                    stages.push(c % cfg.pp);
                }
            }
        }
    }
    tied.retain(|_, s| s.len() > 1);
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
    };
    if cfg.compute == Compute::Fused {
        shared.fused = Some(fused::plan(&shared)?);
    }
    if let Device::Cuda { gpus, .. } = cfg.device {
        if cfg.compute != Compute::Fused {
            return Err(RuntimeError::Config(
                "GPUs run the fused kernels: a GPU run needs Compute::Fused".into(),
            ));
        }
        // "No CUDA driver found", or which GPU is missing, before any rank
        // starts; a process opens only its own ranks' GPUs.
        let gpus = gpus.max(1);
        let ranks: Vec<usize> = match process {
            Some(p) => vec![p.rank()],
            None => (0..cfg.world_size()).collect(),
        };
        shared.gpus = vec![None; gpus];
        for r in ranks {
            let i = r % gpus;
            if shared.gpus[i].is_none() {
                shared.gpus[i] = Some(Arc::new(crate::gpu::GpuDevice::new(i)?));
            }
        }
        // NCCL needs a GPU per rank (a process holds one rank). A parameter
        // server's dedicated ranks hold their shards on the host, so its
        // groups stage through the host too.
        let own_gpu = process.is_some() || cfg.world_size() <= gpus;
        if own_gpu
            && cfg.world_size() > 1
            && cfg.sync.ps_shards().is_none()
            && crate::gpu::nccl_present()
        {
            shared.collectives = Collectives::Nccl;
        }
    }
    // Every (parameter, layer) some rank holds: what a checkpoint must cover.
    let all_keys: BTreeSet<ParamKey> = (0..cfg.pp)
        .flat_map(|stage| held::rank_stage_keys(&shared, stage))
        .map(|(k, _, _)| k)
        .collect();
    if cfg.checkpoint.is_some() || cfg.resume_from.is_some() {
        let mut names = HashSet::new();
        if let Some(k) = all_keys
            .iter()
            .find(|k| k.layer == 0 && !names.insert(&graph.param(k.param).name))
        {
            return Err(RuntimeError::Unsupported(format!(
                "two parameters are named `{}`: checkpoints key parameters by name",
                graph.param(k.param).name
            )));
        }
        shared.signature = checkpoint::signature(graph, &all_keys);
    }
    if let Some(path) = &cfg.resume_from {
        // Everything is read and checked before any rank starts: a bad
        // checkpoint stops the run here, with nothing half loaded.
        let ck = checkpoint::Checkpoint::open(path)?;
        let resume = checkpoint::load(&ck, graph, &spec.optimizer, seed, &all_keys)?;
        if resume.step > steps {
            return Err(RuntimeError::Config(format!(
                "the checkpoint {} is at step {}, past the {steps} steps asked for",
                ck.dir().display(),
                resume.step
            )));
        }
        shared.start_step = resume.step;
        shared.sample_base = resume.next_sample;
        shared.resume = Some(resume);
    }
    cfg.faults.check(cfg.ranks(), shared.start_step, steps)?;
    if let Some(ck) = &cfg.checkpoint {
        if process.is_none_or(|p| p.rank() == 0) {
            shared.lock = Some(checkpoint::lock_dir(&ck.dir)?);
        }
    }
    let shared = shared;
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
                let (shared, world) = (&shared, &world);
                std::thread::Builder::new()
                    .name(format!("rank{rank}"))
                    .spawn_scoped(s, move || {
                        let run = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                            run_rank(shared, comm, steps, &tx)
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
    let checkpoints = std::mem::take(
        &mut *shared
            .saved
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner()),
    );
    // Reassemble split parameters from their parts, in part order.
    let mut parts: BTreeMap<ParamKey, BTreeMap<usize, (usize, Tensor)>> = BTreeMap::new();
    let mut stage_layers = vec![0; cfg.pp];
    let mut peak_activation_bytes = 0;
    let mut device_peak = None;
    let mut dp_traffic = vec![Traffic::default(); cfg.ranks()];
    for r in results {
        let out = r?;
        dp_traffic[out.rank] = out.traffic;
        if out.rank < cfg.world_size() {
            stage_layers[out.stage] = out.layers_run;
        }
        peak_activation_bytes = peak_activation_bytes.max(out.peak_activation_bytes);
        device_peak = device_peak.max(out.device_peak_bytes);
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
        device: shared.gpus.iter().flatten().next().map(|g| DeviceUse {
            name: g.name().to_string(),
            peak_bytes: device_peak.unwrap_or(0),
            kernels: shared.fused.as_ref().map_or(0, |f| f.kernel_count()),
            collectives: shared.collectives,
        }),
        attention: shared.fused.as_ref().map(|f| f.attentions()),
    })
}

struct Rank<'a, 'b, S: Storage> {
    sh: &'a Shared<'b>,
    at: Coords,
    stage: usize,
    dp_index: usize,
    store: ParamStore<S>,
    pp_group: Group,
    compute: Box<dyn StageCompute<S> + 'a>,
    losses: Vec<f64>,
    step: u64,
    /// Layers the forwards of micro-batch 0 ran in the run's first step.
    layers_run: u64,
    peak_activation_bytes: u64,
    /// Steps skipped so far for a non-finite loss or gradient norm.
    skipped_nonfinite: u64,
}

fn tag(micro: usize, chunk: usize, chunks: usize, backward: bool) -> u64 {
    ((micro * chunks + chunk) as u64) * 2 + u64::from(backward)
}

fn run_rank(
    sh: &Shared,
    comm: Communicator,
    steps: u64,
    tx: &mpsc::Sender<StepStats>,
) -> Result<RankOut> {
    let cfg = sh.cfg;
    let rank = comm.rank();
    let at = Coords::of(rank, cfg);
    let dp_index = at.dp_index;
    // A dedicated parameter server: it joins the step's collectives (the
    // pushes it sums, the norm, the loss, the pulls it sends) and runs no
    // model compute.
    let server = dp_index >= cfg.replicas();
    let group_of = |f: &dyn Fn(usize) -> Coords, n: usize| {
        Group::new((0..n).map(|i| f(i).rank(cfg)).collect())
    };
    let tp_group = group_of(&|t| Coords { tp_index: t, ..at }, cfg.tp);
    let first = at.dp_index - at.dp_index % cfg.ep;
    let ep_group = group_of(
        &|e| Coords {
            dp_index: first + e,
            ..at
        },
        cfg.ep,
    );
    let held = held::rank_keys(sh, at);
    // Top-k and PowerSGD carry their error feedback over a checkpoint.
    let feedback = match &sh.resume {
        Some(resume) if cfg.compress.has_feedback() => Some(checkpoint::read_feedback(
            &resume.dir,
            rank,
            sh.graph,
            held.iter().map(|h| h.key),
        )?),
        _ => None,
    };
    // Async carries the older weight versions its stale workers read.
    let versions = match &sh.resume {
        Some(resume) if cfg.sync.staleness() > 0 && !server => {
            let keys: Vec<_> = held.iter().map(|h| h.key).collect();
            Some(checkpoint::read_versions(
                &resume.dir,
                rank,
                sh.graph,
                &keys,
            )?)
        }
        _ => None,
    };
    let first_cp = at.dp_index - at.dp_index % cfg.cp;
    let cp_group = group_of(
        &|c| Coords {
            dp_index: first_cp + c,
            ..at
        },
        cfg.cp,
    );
    let init = StoreInit {
        graph: sh.graph,
        keys: held,
        comm,
        mesh: MeshGroups {
            tp: tp_group,
            ep: ep_group,
            cp: cp_group,
            skip_partial_sum: cfg.faults.skip_tp_sum,
        },
        seed: sh.seed,
        resume: sh.resume.as_ref().map(|r| &r.params),
        dp_sync: DpState {
            zero: cfg.zero,
            sync: cfg.sync,
            compress: cfg.compress,
            compress_warmup: cfg.compress.warmup_steps(&sh.spec.schedule),
            feedback: feedback.as_ref(),
            versions,
            server,
            hold: dplc_ir::zero3_holds_the_step(cfg.zero.stage(), cfg.pp as u64),
        },
    };
    // The reference keeps the state on the host; the fused compute keeps it
    // where its kernels run, in its backend's buffers. A dedicated server
    // computes nothing, so it holds its shards on the host.
    let fused_plan = || {
        sh.fused
            .as_ref()
            .ok_or_else(|| RuntimeError::Config("a fused run without its fused plan".into()))
    };
    match cfg.compute {
        Compute::Fused if !server => match cfg.device {
            Device::Host => {
                let be = HostBackend::new();
                let compute = fused::Fused::new(sh, fused_plan()?, be.handle());
                let store = ParamStore::new(init, DeviceStorage::new(be, HostStaged))?;
                drive(sh, at, server, store, Box::new(compute), steps, tx)
            }
            Device::Cuda { dtype, .. } => {
                let dev = sh.gpus[rank % sh.gpus.len().max(1)]
                    .clone()
                    .ok_or_else(|| RuntimeError::Config(format!("rank {rank} has no GPU")))?;
                // Two handles on the one device: the compute's and the
                // store's (its allocator and stream are the device's).
                let be = crate::gpu::CudaBackend::new(dev.clone(), dtype)?;
                let handle = crate::gpu::CudaBackend::new(dev.clone(), dtype)?;
                let compute = Box::new(fused::Fused::new(sh, fused_plan()?, handle));
                match sh.collectives {
                    Collectives::Nccl => {
                        let links = crate::gpu::NcclLinks::new(dev);
                        let store = ParamStore::new(init, DeviceStorage::new(be, links))?;
                        drive(sh, at, server, store, compute, steps, tx)
                    }
                    Collectives::HostStaged => {
                        let store = ParamStore::new(init, DeviceStorage::new(be, HostStaged))?;
                        drive(sh, at, server, store, compute, steps, tx)
                    }
                }
            }
        },
        _ => {
            let store = ParamStore::new(init, HostStorage)?;
            drive(
                sh,
                at,
                server,
                store,
                Box::new(Reference::new(sh)),
                steps,
                tx,
            )
        }
    }
}

/// Run rank `at`'s steps over its store and compute, and hand back what
/// it exported.
fn drive<'a, S: Storage>(
    sh: &'a Shared,
    at: Coords,
    server: bool,
    store: ParamStore<S>,
    compute: Box<dyn StageCompute<S> + 'a>,
    steps: u64,
    tx: &mpsc::Sender<StepStats>,
) -> Result<RankOut> {
    let cfg = sh.cfg;
    let rank = store.comm.rank();
    let (dp_index, stage) = (at.dp_index, at.stage);
    let pp_group = Group::new(
        (0..cfg.pp)
            .map(|s| Coords { stage: s, ..at }.rank(cfg))
            .collect(),
    );
    let mut r = Rank {
        sh,
        at,
        stage,
        dp_index,
        store,
        pp_group,
        compute,
        losses: Vec::new(),
        step: sh.start_step,
        layers_run: 0,
        peak_activation_bytes: 0,
        skipped_nonfinite: 0,
    };
    let work = if server {
        Vec::new()
    } else {
        schedule(cfg.schedule, stage, cfg.pp, cfg.num_micro_batches)
    };
    let world = Group::new((0..cfg.ranks()).collect());
    // Each process has its own clock: traced ranks in separate processes
    // count from a barrier they leave together (to within one message).
    let t0 = if sh.remote && cfg.trace.is_on() {
        r.store.comm.all_reduce(&world, &mut [0.0])?;
        Instant::now()
    } else {
        sh.started
    };
    let mut done = sh.start_step;
    let mut saved = None;
    for step in sh.start_step..steps {
        let start = Instant::now();
        r.step = step;
        r.store.comm.set_step(step);
        // Every rank stops at the same step boundary, or none does.
        let mut stop = vec![if cfg.stop.is_set() { 1.0 } else { 0.0 }];
        if cfg.ranks() > 1 {
            r.store.comm.all_reduce(&world, &mut stop)?;
        }
        if stop[0] > 0.0 {
            break;
        }
        if cfg.faults.fail_rank_at == Some((rank, step)) {
            return Err(RuntimeError::Kernel {
                op: "rank",
                detail: format!("injected failure at step {step}"),
            });
        }
        if cfg.faults.exit_rank_at == Some((rank, step)) {
            eprintln!("rank {rank} failed at step {step}: its process exits (DPLC_FAULT)");
            std::process::exit(1);
        }
        if cfg.faults.panic_rank_at == Some((rank, step)) {
            panic!("injected panic at step {step}");
        }
        if cfg.faults.stall_rank_at == Some((rank, step)) {
            // Hang until a peer gives up on this rank, then leave quietly:
            // the peer's timeout is the error the run reports.
            let world = r.store.comm.world().clone();
            while world.failure().is_none() {
                std::thread::sleep(Duration::from_millis(20));
            }
            let (failed, reason) = world.failure().expect("just seen");
            return Err(RuntimeError::RankFailed {
                rank: failed,
                reason,
            });
        }
        let span = |kind, micro, chunk, from: Instant| TraceSpan {
            rank,
            stage,
            dp_index,
            tp_index: at.tp_index,
            step,
            kind,
            micro_batch: micro,
            chunk,
            start_us: from.duration_since(t0).as_secs_f64() * 1e6,
            duration_us: from.elapsed().as_secs_f64() * 1e6,
        };
        // Async with staleness K: replica d computes on the weights
        // d mod (K+1) versions old, so the replicas spread over every lag
        // the bound allows, the same way every run.
        let staleness = cfg.sync.staleness() as usize;
        if staleness > 0 && !server {
            r.store.use_version(dp_index % (staleness + 1));
        }
        for &w in &work {
            let from = Instant::now();
            match w {
                Work::Forward { micro, chunk } => {
                    r.forward(micro, chunk)?;
                    if cfg.trace.is_on() {
                        cfg.trace.push(span("forward", micro, chunk, from));
                    }
                }
                Work::Backward { micro, chunk } => {
                    r.backward(micro, chunk)?;
                    if cfg.trace.is_on() {
                        cfg.trace.push(span("backward", micro, chunk, from));
                    }
                }
            }
        }
        let from = Instant::now();
        let stats = r.finish_step(start)?;
        if cfg.trace.is_on() {
            cfg.trace.push(span("step", 0, 0, from));
        }
        if rank == 0 {
            // The receiver only goes away when the run is over; nothing to do then.
            let _ = tx.send(stats);
        }
        done = step + 1;
        if let Some(ck) = &cfg.checkpoint {
            if ck.every > 0 && done.is_multiple_of(ck.every) {
                r.save(done)?;
                saved = Some(done);
            }
        }
    }
    // The end of a run, finished or stopped, is saved too.
    if cfg.checkpoint.is_some() && done > sh.start_step && saved != Some(done) {
        r.save(done)?;
    }
    if sh.remote && cfg.trace.is_on() {
        gather_trace(&mut r.store.comm, cfg)?;
    }
    let exported = r.store.export()?;
    let traffic = r.store.traffic;
    let out = |exported| RankOut {
        rank,
        traffic,
        stage,
        peak_activation_bytes: r.peak_activation_bytes,
        device_peak_bytes: r.store.storage.peak_bytes(),
        layers_run: r.layers_run,
        exported,
    };
    // The first expert-parallel group holds every part once.
    if r.dp_index >= cfg.ep {
        return Ok(out(Vec::new()));
    }
    Ok(out(exported
        .into_iter()
        .map(|(key, value)| {
            let part = match sh.layouts.as_ref().and_then(|l| l.param(key.param)) {
                None => None,
                Some(SplitAxis::Tensor { axis }) => Some((axis, r.at.tp_index)),
                Some(SplitAxis::Expert) => Some((0, r.dp_index % cfg.ep)),
            };
            Exported { key, value, part }
        })
        .collect()))
}

/// The kinds of span a trace records, by their index on the wire.
const SPAN_KINDS: [&str; 3] = ["forward", "backward", "step"];

/// Send every rank's trace spans to rank 0 (each process's sink holds only
/// its own rank's), which adds them to its sink. A span travels as eight
/// f32s; its times as two each (the value and what `f32` rounding left), so
/// microseconds survive hours of run.
fn gather_trace(comm: &mut Communicator, cfg: &RunConfig) -> Result<()> {
    let split = |x: f64| {
        let hi = x as f32;
        [hi, (x - f64::from(hi)) as f32]
    };
    let mine: Vec<f32> = cfg
        .trace
        .spans()
        .iter()
        .filter(|s| s.rank == comm.rank())
        .flat_map(|s| {
            let kind = SPAN_KINDS.iter().position(|k| *k == s.kind).unwrap_or(0);
            let [s0, s1] = split(s.start_us);
            let [d0, d1] = split(s.duration_us);
            [
                s.step as f32,
                kind as f32,
                s.micro_batch as f32,
                s.chunk as f32,
                s0,
                s1,
                d0,
                d1,
            ]
        })
        .collect();
    let world = Group::new((0..cfg.ranks()).collect());
    let all = comm.all_gather(&world, &mine)?;
    if comm.rank() != 0 {
        return Ok(());
    }
    for (rank, spans) in all.iter().enumerate().skip(1) {
        let at = Coords::of(rank, cfg);
        for s in spans.chunks_exact(8) {
            cfg.trace.push(TraceSpan {
                rank,
                stage: at.stage,
                dp_index: at.dp_index,
                tp_index: at.tp_index,
                step: s[0] as u64,
                kind: SPAN_KINDS[(s[1] as usize).min(SPAN_KINDS.len() - 1)],
                micro_batch: s[2] as usize,
                chunk: s[3] as usize,
                start_us: f64::from(s[4]) + f64::from(s[5]),
                duration_us: f64::from(s[6]) + f64::from(s[7]),
            });
        }
    }
    Ok(())
}

impl<S: Storage> Rank<'_, '_, S> {
    fn chunks(&self) -> usize {
        self.sh.part.chunks.len()
    }

    fn peer(&self, chunk: usize) -> usize {
        Coords {
            stage: chunk % self.sh.cfg.pp,
            ..self.at
        }
        .rank(self.sh.cfg)
    }

    /// The global index of this rank's first sample of micro-batch `micro`
    /// in the current step: the data position carries over a checkpoint.
    fn first_sample(&self, micro: usize) -> u64 {
        let sh = self.sh;
        let cfg = sh.cfg;
        sh.sample_base
            + (self.step - sh.start_step) * cfg.global_batch() as u64
            + ((micro * cfg.dp + self.dp_index / cfg.cp) * cfg.micro_batch) as u64
    }

    /// Save the checkpoint after `done` steps: rank 0 readies the step
    /// directory, every rank writes its shards, and once all are in place
    /// rank 0 writes the manifest.
    fn save(&mut self, done: u64) -> Result<()> {
        let sh = self.sh;
        let cfg = sh.cfg;
        let Some(ck) = &cfg.checkpoint else {
            return Ok(());
        };
        let rank = self.store.comm.rank();
        let dir = checkpoint::step_dir(&ck.dir, done);
        let kill = cfg
            .faults
            .kill_in_checkpoint
            .filter(|k| k.rank == rank && k.step == done)
            .map(|k| k.at);
        let world = Group::new((0..cfg.ranks()).collect());
        let barrier = |store: &mut ParamStore<S>| -> Result<()> {
            if cfg.ranks() > 1 {
                store.comm.all_reduce(&world, &mut [0.0])?;
            }
            Ok(())
        };
        if rank == 0 {
            checkpoint::prepare_step_dir(&dir)?;
        }
        barrier(&mut self.store)?;
        checkpoint::write_shards(&dir, rank, sh.graph, self.store.owned_shards()?, kill)?;
        checkpoint::write_feedback(&dir, rank, sh.graph, &self.store.feedback)?;
        if cfg.sync.staleness() > 0 && self.dp_index < cfg.replicas() {
            let older = self.store.older_versions()?;
            checkpoint::write_versions(&dir, rank, sh.graph, &older)?;
        }
        barrier(&mut self.store)?;
        if rank == 0 {
            let gb = cfg.global_batch() as u64;
            let info = checkpoint::ManifestInfo {
                step: done,
                seed: sh.seed,
                data: checkpoint::DataPosition {
                    next_sample: sh.sample_base + (done - sh.start_step) * gb,
                    global_batch: gb,
                    seq: sh.seq as u64,
                },
                optimizer: &sh.spec.optimizer,
                split: checkpoint::SavedSplit {
                    dp: cfg.dp,
                    cp: cfg.cp,
                    tp: cfg.tp,
                    pp: cfg.pp,
                    ep: cfg.ep,
                    zero: cfg.zero.stage(),
                    micro_batch: cfg.micro_batch,
                    num_micro_batches: cfg.num_micro_batches,
                    sequence_parallel: cfg.sequence_parallel,
                },
                model: &sh.signature,
                world: cfg.ranks(),
                run: &sh
                    .lock
                    .as_ref()
                    .ok_or_else(|| {
                        RuntimeError::Config("rank 0 saves without holding the directory".into())
                    })?
                    .run,
            };
            let dir = checkpoint::write_manifest(&dir, info, kill)?;
            sh.saved
                .lock()
                .unwrap_or_else(|poisoned| poisoned.into_inner())
                .push(dir);
        }
        Ok(())
    }

    fn pass(&self, micro: usize, chunk: usize) -> Pass {
        Pass {
            micro,
            chunk,
            step: self.step,
            first_sample: self.first_sample(micro),
            cp_rank: self.dp_index % self.sh.cfg.cp,
            tp_rank: self.at.tp_index,
        }
    }

    /// Every input of micro-batch `micro`, as [`feeds`] says: `seq`-token
    /// windows of the stream for `tokens` and `targets`, the samples of
    /// each other input.
    fn inputs(&self, micro: usize) -> HashMap<dplc_ir::TensorId, Value> {
        let sh = self.sh;
        let first = self.first_sample(micro);
        let samples = first..first + sh.cfg.micro_batch as u64;
        let windows: Vec<(Vec<i32>, Vec<i32>)> = if sh.feeds.iter().any(|(_, f)| f.is_stream()) {
            samples.clone().map(|i| sh.data.sample(i, sh.seq)).collect()
        } else {
            Vec::new()
        };
        let mut out = HashMap::new();
        for (t, feed) in sh.feeds.iter() {
            let shape = |per: &[usize]| {
                let mut s = vec![sh.cfg.micro_batch];
                s.extend(per);
                s
            };
            let v = match feed {
                Feed::Tokens => Tensor::i32(
                    shape(&[sh.seq]),
                    windows.iter().flat_map(|w| w.0.clone()).collect(),
                ),
                Feed::Targets => Tensor::i32(
                    shape(&[sh.seq]),
                    windows.iter().flat_map(|w| w.1.clone()).collect(),
                ),
                &Feed::Samples {
                    ref name,
                    int,
                    shape: ref per,
                    bound,
                } => {
                    let numel = per.iter().product();
                    let draws = samples
                        .clone()
                        .map(|i| sh.data.input_sample(name, int, numel, bound, i));
                    let mut data = if int {
                        crate::Data::I32(Vec::new())
                    } else {
                        crate::Data::F32(Vec::new())
                    };
                    for d in draws {
                        match (&mut data, d) {
                            (crate::Data::I32(a), crate::Data::I32(b)) => a.extend(b),
                            (crate::Data::F32(a), crate::Data::F32(b)) => a.extend(b),
                            _ => unreachable!("input_sample returns the input's kind"),
                        }
                    }
                    Tensor {
                        shape: shape(per),
                        data,
                    }
                }
            };
            out.insert(*t, Arc::new(v));
        }
        out
    }

    /// [`Rank::inputs`] at this rank's sequence positions under context
    /// parallelism (`dplc_ir::context_chunks`): every input along `seq`.
    fn local_inputs(&self, micro: usize) -> Result<HashMap<dplc_ir::TensorId, Value>> {
        let sh = self.sh;
        let mut out = self.inputs(micro);
        let seq = sh.graph.sym_by_name("seq");
        if sh.cfg.cp > 1 {
            let pos = self.dp_index % sh.cfg.cp;
            for (_, input) in sh.graph.inputs() {
                let along = input
                    .shape
                    .dims()
                    .iter()
                    .position(|d| seq.is_some_and(|s| *d == dplc_ir::Dim::sym(s)));
                if let (Some(axis), Some(v)) = (along, out.get_mut(&input.tensor)) {
                    *v = Arc::new(crate::shard::take_chunks(v, axis, sh.cfg.cp, pos)?);
                }
            }
        }
        Ok(out)
    }

    fn forward(&mut self, micro: usize, c: usize) -> Result<()> {
        let sh = self.sh;
        let received = if c > 0 {
            self.store
                .comm
                .recv(self.peer(c - 1), tag(micro, c, self.chunks(), false))?
        } else {
            Vec::new()
        };
        if micro == 0 && self.step == sh.start_step {
            let layers = &sh.part.chunks[c].layers;
            self.layers_run += layers.end - layers.start;
        }
        let pass = self.pass(micro, c);
        let inputs = self.local_inputs(micro)?;
        self.store.gather(Unit::Root)?;
        let out = self
            .compute
            .forward(&pass, &inputs, received, &mut self.store)?;
        self.store.release(Unit::Root, false)?;
        match out {
            Forwarded::Loss(loss) => self.losses.push(loss),
            Forwarded::Send(msg) => self.store.comm.send(
                self.peer(c + 1),
                tag(micro, c + 1, self.chunks(), false),
                msg,
            )?,
        }
        // Every step runs the same schedule on the same shapes, so the first
        // step's peak is every step's: the walk over the live values stays
        // off the later steps' path.
        if self.step == sh.start_step {
            self.peak_activation_bytes = self
                .peak_activation_bytes
                .max(self.compute.activation_bytes());
        }
        Ok(())
    }

    fn backward(&mut self, micro: usize, c: usize) -> Result<()> {
        let received = if c + 1 == self.chunks() {
            None
        } else {
            Some(
                self.store
                    .comm
                    .recv(self.peer(c + 1), tag(micro, c, self.chunks(), true))?,
            )
        };
        let pass = self.pass(micro, c);
        self.store.gather(Unit::Root)?;
        let msg = self.compute.backward(&pass, received, &mut self.store)?;
        self.store.release(Unit::Root, true)?;
        if c > 0 {
            self.store.comm.send(
                self.peer(c - 1),
                tag(micro, c - 1, self.chunks(), true),
                msg,
            )?;
        }
        Ok(())
    }

    /// Gradient sync, norm, clipping, optimizer step and the step's statistics.
    fn finish_step(&mut self, start: Instant) -> Result<StepStats> {
        let sh = self.sh;
        let cfg = sh.cfg;
        // ZeRO-3 under a pipeline reduce-scatters the step's gradients now,
        // after the stage's last backward.
        self.store.release_held()?;
        // Tied weights (an embedding reused by the head on another stage):
        // every copy gets the sum of the copies' gradients.
        for (key, stages) in &sh.tied {
            if !stages.contains(&self.stage) {
                continue;
            }
            let group = Group::new(
                stages
                    .iter()
                    .map(|&s| {
                        Coords {
                            stage: s,
                            ..self.at
                        }
                        .rank(cfg)
                    })
                    .collect(),
            );
            self.store.all_reduce_grad(*key, &group)?;
        }
        if !cfg.faults.skip_grad_sync {
            self.store.reduce_grads(cfg.bucket_elems, self.step)?;
        }
        // Every gradient element is counted by exactly one rank of the world.
        let mut sq = vec![self.store.local_sq_norm()? as f32];
        if cfg.faults.nan_grad_at == Some((self.store.comm.rank(), self.step)) {
            sq[0] = f32::NAN;
        }
        let world = Group::new((0..cfg.ranks()).collect());
        self.store.comm.all_reduce(&world, &mut sq)?;
        // The loss reaches the dedicated servers too (they add nothing to
        // it): every rank takes the same skip decision.
        let dp_group = Group::new(
            (0..cfg.replicas() + cfg.server_replicas())
                .map(|d| {
                    Coords {
                        dp_index: d,
                        ..self.at
                    }
                    .rank(cfg)
                })
                .collect(),
        );
        let grad_norm = f64::from(sq[0]).sqrt();
        let clip = match sh.spec.grad_clip {
            Some(max) if grad_norm > max => max / (grad_norm + 1e-6),
            _ => 1.0,
        };
        // The loss lives on the last stage: sum it over replicas, then hand it to every stage.
        let mut loss = vec![self.losses.drain(..).sum::<f64>() as f32];
        self.store.comm.all_reduce(&dp_group, &mut loss)?;
        let mut loss_v = loss.clone();
        self.store
            .comm
            .broadcast(&self.pp_group, cfg.pp - 1, &mut loss_v)?;
        let loss = f64::from(loss_v[0]) / (cfg.replicas() * cfg.num_micro_batches) as f64;
        let lr = sh.spec.optimizer.lr() * sh.spec.schedule.factor(self.step);
        // Every rank sees the same loss and norm, so all decide alike: a
        // non-finite step is skipped (its gradients dropped, the parameters
        // and moments untouched) while the allowance lasts, else the run
        // stops here, before the step can poison the state.
        let skipped = !(loss.is_finite() && grad_norm.is_finite());
        if skipped {
            if self.skipped_nonfinite >= cfg.skip_nonfinite {
                return Err(RuntimeError::NonFinite {
                    step: self.step,
                    loss,
                    grad_norm,
                    skipped: self.skipped_nonfinite,
                });
            }
            self.skipped_nonfinite += 1;
            self.store.discard_grads()?;
        } else {
            self.store
                .step(&sh.spec.optimizer, lr, clip, self.step + 1)?;
        }
        let seconds = start.elapsed().as_secs_f64().max(1e-9);
        let samples_per_s = cfg.global_batch() as f64 / seconds;
        Ok(StepStats {
            step: self.step,
            loss,
            lr,
            grad_norm,
            samples_per_s,
            tokens_per_s: sh
                .graph
                .sym_by_name("seq")
                .map(|_| samples_per_s * sh.seq as f64),
            skipped,
        })
    }
}
