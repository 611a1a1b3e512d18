//! The entry point `dplc run --cluster NxH100` calls: open the GPUs (the
//! `CudaUnavailable` seam), then train data-parallel replicas on them with
//! the fused executor, one thread per rank: several ranks on one GPU sum
//! their gradients through the host, ranks on separate GPUs through NCCL.
//!
//! What the GPU path does not run yet (the CPU executor does): tensor,
//! pipeline and expert parallelism, ZeRO sharding, activation recompute,
//! MoE routing, checkpoints. Those are refused or stated, never faked.

use super::backend::{CudaBackend, DeviceSync};
use super::comm::{nccl_present, HostStagedCommunicator, NcclCommunicator};
use super::compile::{compile_graph, CompiledGraph};
use super::device::GpuDevice;
use super::error::{GpuError, GpuResult};
use crate::comm::{Group, World};
use crate::data::Corpus;
use crate::fused::{train_fused, Alone, FusedGraph, FusedReport, FusedRun, GradSync};
use crate::schedule::StepStats;
use dplc_codegen::Nvrtc;
use dplc_ir::{DType, Graph, Precision, TrainSpec};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// How to run on GPUs.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GpuRunConfig {
    /// GPUs to use (`--cluster NxH100`): device ordinals `0..gpus`.
    pub gpus: usize,
    /// Ranks per GPU (> 1: several in-process ranks share each GPU through the
    /// host-staged communicator, for testing schedules without several GPUs).
    pub ranks_per_gpu: usize,
    /// Samples per micro-batch on one rank.
    pub micro_batch: usize,
    /// Micro-batches per step on one rank (gradient accumulation).
    pub num_micro_batches: usize,
    /// Seconds a rank waits for the others in a host-staged sum.
    pub timeout: Duration,
    /// Full recomputation of every layer in backward.
    pub recompute: bool,
    /// ZeRO-1 over the replicas (see [`FusedRun::shard_optimizer`]).
    pub shard_optimizer: bool,
}

impl Default for GpuRunConfig {
    fn default() -> Self {
        GpuRunConfig {
            gpus: 1,
            ranks_per_gpu: 1,
            micro_batch: 1,
            num_micro_batches: 1,
            timeout: Duration::from_secs(60),
            recompute: false,
            shard_optimizer: false,
        }
    }
}

impl GpuRunConfig {
    /// Data-parallel replicas: every rank is one.
    pub fn world_size(&self) -> usize {
        self.gpus * self.ranks_per_gpu
    }
}

/// What a GPU run did, from rank 0.
#[derive(Debug)]
pub struct GpuReport {
    pub report: FusedReport,
    /// The device, e.g. "NVIDIA H100 80GB HBM3".
    pub device: String,
    /// Distinct kernels compiled and loaded.
    pub kernels: usize,
    /// Peak bytes the caching allocator handed out on GPU 0.
    pub peak_bytes: usize,
}

/// Open devices `0..n`, or fail with the reason (no driver, too few devices).
pub fn open_devices(n: usize) -> GpuResult<Vec<Arc<GpuDevice>>> {
    if n == 0 {
        return Err(GpuError::Invalid("a GPU run needs at least one GPU".into()));
    }
    (0..n).map(|i| GpuDevice::new(i).map(Arc::new)).collect()
}

/// The storage type of float tensors for a training precision.
pub fn storage_dtype(p: Precision) -> DType {
    match p {
        Precision::Fp32 => DType::F32,
        Precision::Bf16 => DType::BF16,
        Precision::Fp16 => DType::F16,
    }
}

/// Prepare a GPU training run of `graph`: open the devices and compile every
/// kernel for their architecture (NVRTC, with the PTX cache).
pub fn prepare(
    graph: &Graph,
    spec: &TrainSpec,
    cfg: &GpuRunConfig,
) -> GpuResult<(Vec<Arc<GpuDevice>>, CompiledGraph)> {
    if cfg.ranks_per_gpu == 0 {
        return Err(GpuError::Invalid("ranks_per_gpu must be positive".into()));
    }
    let devices = open_devices(cfg.gpus)?;
    let nvrtc = Nvrtc::load()?;
    let compiled = compile_graph(
        graph,
        storage_dtype(spec.precision),
        devices[0].arch(),
        &nvrtc,
    )?;
    Ok((devices, compiled))
}

/// Train `graph` for `steps` steps as `cfg.world_size()` data-parallel
/// replicas on `cfg.gpus` GPUs. `on_step` sees rank 0's steps.
pub fn train_on_gpus(
    graph: &Graph,
    spec: &TrainSpec,
    cfg: &GpuRunConfig,
    data: &Corpus,
    steps: u64,
    seed: u64,
    on_step: impl FnMut(&StepStats) + Send,
) -> GpuResult<GpuReport> {
    if cfg.ranks_per_gpu == 0 || cfg.micro_batch == 0 || cfg.num_micro_batches == 0 {
        return Err(GpuError::Invalid(
            "ranks per GPU, micro-batch and micro-batch count must be positive".into(),
        ));
    }
    let devices = open_devices(cfg.gpus)?;
    let fused = FusedGraph::new(graph).map_err(|e| GpuError::Unsupported(e.to_string()))?;
    let dtype = storage_dtype(spec.precision);
    let world = cfg.world_size();
    let nccl = cfg.gpus > 1 && cfg.ranks_per_gpu == 1 && nccl_present();
    let nccl_id = if nccl {
        Some(NcclCommunicator::unique_id()?)
    } else {
        None
    };
    let cpu_world = World::new(world, cfg.timeout);
    let on_step = Mutex::new(on_step);
    let results: Vec<GpuResult<GpuReport>> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..world)
            .map(|rank| {
                let dev = devices[rank / cfg.ranks_per_gpu].clone();
                let (fused, on_step, cpu_world) = (&fused, &on_step, cpu_world.clone());
                s.spawn(move || -> GpuResult<GpuReport> {
                    let mut be = CudaBackend::new(dev.clone(), dtype)?;
                    let kernels = be.preload(&fused.kernels())?;
                    let run = FusedRun {
                        micro_batch: cfg.micro_batch,
                        num_micro_batches: cfg.num_micro_batches,
                        dp: world,
                        dp_index: rank,
                        steps,
                        seed,
                        recompute: cfg.recompute,
                        shard_optimizer: cfg.shard_optimizer,
                    };
                    let mut sync: Box<dyn GradSync<CudaBackend>> = if world == 1 {
                        Box::new(Alone)
                    } else if let Some(id) = nccl_id {
                        Box::new(DeviceSync {
                            collectives: NcclCommunicator::new(dev.clone(), rank, world, id)?,
                            dev: dev.clone(),
                        })
                    } else {
                        Box::new(DeviceSync {
                            collectives: HostStagedCommunicator::new(
                                dev.clone(),
                                cpu_world.communicator(rank),
                                Group::new((0..world).collect()),
                            ),
                            dev: dev.clone(),
                        })
                    };
                    let report = train_fused(&mut be, graph, spec, data, &run, &mut *sync, |st| {
                        if rank == 0 {
                            if let Ok(mut f) = on_step.lock() {
                                (*f)(st);
                            }
                        }
                    });
                    let report = match report {
                        Ok(r) => r,
                        Err(e) => {
                            // The others would wait for this rank's sums: stop them.
                            cpu_world.poison(rank, e.to_string());
                            return Err(GpuError::Unsupported(e.to_string()));
                        }
                    };
                    Ok(GpuReport {
                        report,
                        device: dev.name().to_string(),
                        kernels,
                        peak_bytes: dev.memory_stats().peak_requested,
                    })
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| {
                h.join()
                    .unwrap_or_else(|_| Err(GpuError::Invalid("a GPU rank panicked".into())))
            })
            .collect()
    });
    let mut first = None;
    for r in results {
        let r = r?;
        first.get_or_insert(r);
    }
    first.ok_or_else(|| GpuError::Invalid("no ranks ran".into()))
}

/// Train as one process of a launcher's world (torchrun, srun, mpirun): this
/// process's GPU is `env.local_rank`, and gradients are summed over NCCL,
/// bootstrapped from MASTER_ADDR/MASTER_PORT. `on_step` sees every step on
/// rank 0 only.
#[allow(clippy::too_many_arguments)]
pub fn train_gpu_process(
    graph: &Graph,
    spec: &TrainSpec,
    env: &super::LaunchEnv,
    micro_batch: usize,
    num_micro_batches: usize,
    recompute: bool,
    shard_optimizer: bool,
    data: &Corpus,
    steps: u64,
    seed: u64,
    timeout: Duration,
    mut on_step: impl FnMut(&StepStats),
) -> GpuResult<GpuReport> {
    let fused = FusedGraph::new(graph).map_err(|e| GpuError::Unsupported(e.to_string()))?;
    let nccl = NcclCommunicator::from_env(env, timeout)?;
    let dev = nccl.device().clone();
    let mut be = CudaBackend::new(dev.clone(), storage_dtype(spec.precision))?;
    let kernels = be.preload(&fused.kernels())?;
    let run = FusedRun {
        micro_batch,
        num_micro_batches,
        dp: env.world_size,
        dp_index: env.rank,
        steps,
        seed,
        recompute,
        shard_optimizer,
    };
    let mut sync = DeviceSync {
        collectives: nccl,
        dev: dev.clone(),
    };
    let rank = env.rank;
    let report = train_fused(&mut be, graph, spec, data, &run, &mut sync, |st| {
        if rank == 0 {
            on_step(st);
        }
    })
    .map_err(|e| GpuError::Unsupported(e.to_string()))?;
    Ok(GpuReport {
        report,
        device: dev.name().to_string(),
        kernels,
        peak_bytes: dev.memory_stats().peak_requested,
    })
}
