//! Kernel generation (filled by the codegen issue).
