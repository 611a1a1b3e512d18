//! The fused executor: a rank's training step as codegen planned it — fused
//! kernels, library matmuls and the AdamW kernel — over a [`Backend`]. On a
//! GPU the backend is `gpu::CudaBackend` (NVRTC's PTX, cuBLAS); everywhere,
//! [`HostBackend`] runs the same step through the kernel interpreter, which
//! is how the executor is tested against the CPU reference without a GPU.

mod backend;
mod program;

pub use backend::{matmul_cpu, Backend, HostBackend, HostBuf, MatMul};
pub use program::{
    flat_args, ChunkSpan, Executor, FusedGraph, HostSteps, ParamBufs, RegionRun, Val,
};
pub(crate) use program::{tensor_dims, to_backend, to_host};
