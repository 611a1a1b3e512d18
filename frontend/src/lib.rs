//! The .dpl frontend: grammar, diagnostics, and lowering of models to the IR.

mod ast;
mod diag;
mod syntax;

pub use diag::{Diagnostic, Diagnostics};
