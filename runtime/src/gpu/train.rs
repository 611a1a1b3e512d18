//! The entry point `dplc run --cluster NxH100` calls: open the GPUs (the
//! `CudaUnavailable` seam), compile the graph's kernels for them, and run.
//!
//! The executor that runs a rank's forward/backward steps on these pieces is
//! not written yet; [`train_on_gpus`] says so plainly after everything before
//! it has been checked, instead of pretending to train.

use super::compile::{compile_graph, CompiledGraph};
use super::device::GpuDevice;
use super::error::{GpuError, GpuResult};
use dplc_codegen::Nvrtc;
use dplc_ir::{DType, Graph, Precision, TrainSpec};
use std::sync::Arc;

/// How to run on GPUs.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GpuRunConfig {
    /// GPUs to use (`--cluster NxH100`): device ordinals `0..gpus`.
    pub gpus: usize,
    /// Ranks per GPU (> 1: several in-process ranks share each GPU through the
    /// host-staged communicator, for testing schedules without several GPUs).
    pub ranks_per_gpu: usize,
}

impl Default for GpuRunConfig {
    fn default() -> Self {
        GpuRunConfig {
            gpus: 1,
            ranks_per_gpu: 1,
        }
    }
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

/// Train `graph` on `cfg.gpus` GPUs. Today: [`prepare`], then an explicit
/// `Unsupported` error naming what is missing (the step executor).
pub fn train_on_gpus(graph: &Graph, spec: &TrainSpec, cfg: &GpuRunConfig) -> GpuResult<()> {
    let (devices, compiled) = prepare(graph, spec, cfg)?;
    Err(GpuError::Unsupported(format!(
        "{} kernels compiled for {} ({} GPU(s): {}), but the step executor that runs a rank's \
         forward/backward on them with cuBLAS and NCCL is not written yet; train on CPU ranks \
         with --cluster Nxcpu",
        compiled.kernels.len(),
        compiled.arch.name(),
        devices.len(),
        devices[0].name()
    )))
}
