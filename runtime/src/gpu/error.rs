//! The GPU backend's errors, with cudarc's driver, cuBLAS and NCCL errors
//! wrapped here at the boundary; `RuntimeError::Gpu` carries them whole, so
//! an out-of-memory stays one across the executor.

#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum GpuError {
    /// No CUDA driver library on this machine (or no device behind it): the
    /// seam every GPU path goes through first, so nothing deeper panics.
    #[error("no CUDA driver found: {0}")]
    CudaUnavailable(String),
    /// NCCL's library is absent (multi-process GPU runs need it).
    #[error("NCCL is unavailable: {0}")]
    NcclUnavailable(String),
    /// A CUDA driver call failed.
    #[error("CUDA driver: {what}: {detail}")]
    Driver { what: String, detail: String },
    /// A cuBLAS call failed.
    #[error("cuBLAS: {what}: {detail}")]
    Blas { what: String, detail: String },
    /// An NCCL call failed.
    #[error("NCCL: {what}: {detail}")]
    Nccl { what: String, detail: String },
    /// Generating or compiling a kernel failed (carries NVRTC's log and the source).
    #[error(transparent)]
    Codegen(#[from] CodegenErrorText),
    /// The launcher environment (RANK, WORLD_SIZE, … or Slurm's) is incomplete or inconsistent.
    #[error("launcher environment: {0}")]
    LaunchEnv(String),
    /// Exchanging the NCCL id between ranks failed.
    #[error("rendezvous at {addr}: {detail}")]
    Rendezvous { addr: String, detail: String },
    /// Device memory ran out even after the allocator emptied its cache.
    #[error(
        "out of device memory allocating {bytes} bytes ({in_use} in use, {reserved} reserved)"
    )]
    OutOfMemory {
        bytes: usize,
        in_use: usize,
        reserved: usize,
    },
    /// Arguments that do not fit the kernel or call.
    #[error("{0}")]
    Invalid(String),
    /// Something this backend does not do yet, said plainly.
    #[error("not supported on the GPU backend yet: {0}")]
    Unsupported(String),
}

/// A codegen error as text: `CodegenError` is not `Clone`, and the runtime's
/// errors are (ranks share them).
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("{0}")]
pub struct CodegenErrorText(pub String);

impl From<dplc_codegen::CodegenError> for GpuError {
    fn from(e: dplc_codegen::CodegenError) -> GpuError {
        GpuError::Codegen(CodegenErrorText(e.to_string()))
    }
}

pub(crate) fn driver(what: &str, e: cudarc::driver::DriverError) -> GpuError {
    GpuError::Driver {
        what: what.to_string(),
        detail: format!("{e:?}"),
    }
}

pub(crate) fn blas(what: &str, e: cudarc::cublas::result::CublasError) -> GpuError {
    GpuError::Blas {
        what: what.to_string(),
        detail: format!("{e:?}"),
    }
}

pub(crate) fn nccl(what: &str, e: cudarc::nccl::result::NcclError) -> GpuError {
    GpuError::Nccl {
        what: what.to_string(),
        detail: format!("{e:?}"),
    }
}

pub type GpuResult<T> = std::result::Result<T, GpuError>;
