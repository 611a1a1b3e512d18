//! The crate's one error type; cudarc's errors are wrapped here, at the boundary.

use std::path::PathBuf;

#[derive(Debug, thiserror::Error)]
pub enum CodegenError {
    /// NVRTC's shared library could not be found or opened.
    #[error("NVRTC is unavailable: {reason} (run scripts/install-nvrtc.sh and set DPLC_NVRTC_LIB to the path it prints)")]
    NvrtcUnavailable { reason: String },
    /// NVRTC rejected a generated kernel.
    #[error(
        "NVRTC could not compile `{kernel}` for {arch}:\n{log}\n--- generated source ---\n{code}"
    )]
    Compile {
        kernel: String,
        arch: String,
        log: String,
        /// The generated CUDA C.
        code: String,
    },
    /// NVRTC failed outside compilation proper (creating the program, reading PTX).
    #[error("NVRTC failed on `{kernel}`: {detail}")]
    Nvrtc { kernel: String, detail: String },
    /// The PTX cache could not be read or written.
    #[error("PTX cache at {path}: {detail}")]
    Cache { path: PathBuf, detail: String },
    /// The CPU interpreter met a kernel or arguments that do not fit.
    #[error("interpreting `{kernel}`: {detail}")]
    Interpret { kernel: String, detail: String },
}
