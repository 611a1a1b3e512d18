//! Opening GPUs (the `CudaUnavailable` seam) and the storage type of a
//! training precision. Training on GPUs is the schedule executor's, with
//! `RunConfig::device` set to `Device::Cuda`.

use super::device::GpuDevice;
use super::error::{GpuError, GpuResult};
use dplc_ir::{DType, Precision};
use std::sync::Arc;

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
