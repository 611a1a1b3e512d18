//! The CUDA backend: devices, memory with a caching allocator, kernels loaded
//! from NVRTC's PTX, cuBLAS matmuls, NCCL (and host-staged) collectives, and
//! the launcher bootstrap. Builds everywhere; without a driver every entry
//! point returns `GpuError::CudaUnavailable` ("no CUDA driver found").

mod alloc;
mod backend;
mod blas;
mod comm;
mod compile;
mod convert;
mod device;
mod error;
mod launch_env;
mod links;
mod open;
mod rendezvous;
mod staging;

pub use alloc::{size_class, Allocation, CachingAllocator, MemoryStats, RawMemory};
pub use backend::CudaBackend;
pub use blas::{matmul_cpu, Blas, MatMul};
pub use comm::{nccl_present, DeviceCollectives, NcclCommunicator};
pub use compile::{compile_graph, CompiledAttention, CompiledGraph, CompiledKernel};
pub use convert::{bf16_to_f32, f16_to_f32, f32_to_bf16, f32_to_f16};
pub use device::{decode, driver_present, encode, DeviceBuffer, GpuDevice, GpuKernel, Program};
pub use error::{CodegenErrorText, GpuError, GpuResult};
pub use launch_env::{first_slurm_host, LaunchEnv, Launcher, DEFAULT_MASTER_PORT};
pub(crate) use links::NcclLinks;
pub use open::{open_devices, storage_dtype};
pub use rendezvous::{share_id, ID_BYTES};
