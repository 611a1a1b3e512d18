//! Opening GPUs (the `CudaUnavailable` seam) and the one GPU path not yet on
//! the schedule executor: a process of a launcher's world (torchrun, srun,
//! mpirun, as `dplc build`'s artifact starts it), training data-parallel
//! replicas with the older fused loop and summing gradients over NCCL.
//! `dplc run` on GPUs goes through the schedule executor
//! (`RunConfig::device`), with every strategy.

use super::backend::{CudaBackend, DeviceSync};
use super::comm::NcclCommunicator;
use super::device::GpuDevice;
use super::error::{GpuError, GpuResult};
use crate::data::Corpus;
use crate::fused::{train_fused, FusedGraph, FusedReport, FusedRun};
use crate::schedule::StepStats;
use dplc_ir::{DType, Graph, Precision, TrainSpec};
use std::sync::Arc;
use std::time::Duration;

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
