//! The fused executor: a rank's training step as codegen planned it — fused
//! kernels, library matmuls and the AdamW kernel — over a [`Backend`]. On a
//! GPU the backend is `gpu::CudaBackend` (NVRTC's PTX, cuBLAS); everywhere,
//! [`HostBackend`] runs the same step through the kernel interpreter, which
//! is how the executor is tested against the CPU reference without a GPU.

mod backend;
mod executor;
mod plan;
pub(crate) mod relayout;

pub use backend::{matmul_cpu, Backend, HostBackend, HostBuf, MatMul, Shelf};
pub(crate) use executor::{as_elem, tensor_dims, to_backend};
pub use executor::{
    flat_args, ChunkSpan, Executor, HostSteps, ParamBufs, RegionRun, Shaped, Val, VocabGroup,
};
pub use plan::FusedGraph;
