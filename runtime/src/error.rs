//! The runtime's one error type: what can go wrong running a graph on CPU ranks,
//! from a bad configuration or data file to a peer rank that failed.

use thiserror::Error;

#[derive(Debug, Clone, PartialEq, Error)]
pub enum RuntimeError {
    /// The run configuration does not fit the graph or the training spec.
    #[error("invalid run configuration: {0}")]
    Config(String),
    /// The plan (its stages or layouts) does not describe the model.
    #[error(transparent)]
    Plan(#[from] dplc_ir::PlanMismatch),
    /// The graph uses something the CPU reference cannot run.
    #[error("unsupported: {0}")]
    Unsupported(String),
    /// A kernel got values it cannot compute with (e.g. a token id past the table).
    #[error("{op}: {detail}")]
    Kernel { op: &'static str, detail: String },
    /// The training data cannot be read or is too short.
    #[error("data: {0}")]
    Data(String),
    /// Another rank failed first; this rank stopped because of it.
    #[error("rank {rank} failed: {reason}")]
    RankFailed { rank: usize, reason: String },
    /// A checkpoint cannot be written, or cannot be loaded as it is on disk.
    #[error("checkpoint {}: {detail}", path.display())]
    Checkpoint {
        path: std::path::PathBuf,
        detail: String,
    },
    /// The GPU backend failed (no driver, out of device memory, a CUDA,
    /// cuBLAS, NCCL or NVRTC call), with its own cause.
    #[error(transparent)]
    Gpu(#[from] crate::gpu::GpuError),
    /// The loss or the gradient norm stopped being a finite number.
    #[error(
        "step {step}: the loss is {loss} and the gradient norm {grad_norm}; training stopped before the optimizer step{}",
        if *skipped > 0 { format!(" ({skipped} such steps were skipped before)") } else { String::new() }
    )]
    NonFinite {
        step: u64,
        loss: f64,
        grad_norm: f64,
        /// Non-finite steps skipped earlier in the run.
        skipped: u64,
    },
    /// A collective or receive waited past the deadline: a rank is missing.
    #[error(
        "{} stopped answering at step {step}: rank {rank} waited {seconds:.1}s for it in {what}",
        silent_ranks(silent)
    )]
    Timeout {
        /// The rank that waited.
        rank: usize,
        what: String,
        seconds: f64,
        step: u64,
        /// The ranks it waited for.
        silent: Vec<usize>,
    },
}

fn silent_ranks(silent: &[usize]) -> String {
    match silent {
        [] => "a peer".to_string(),
        [one] => format!("rank {one}"),
        many => format!(
            "ranks {}",
            many.iter()
                .map(|r| r.to_string())
                .collect::<Vec<_>>()
                .join(", ")
        ),
    }
}

pub type Result<T, E = RuntimeError> = std::result::Result<T, E>;

pub(crate) fn kernel_err(op: &'static str, detail: impl Into<String>) -> RuntimeError {
    RuntimeError::Kernel {
        op,
        detail: detail.into(),
    }
}
