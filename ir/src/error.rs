//! The IR's error type: what the builder rejects, rendered with symbol names.

use thiserror::Error;

/// Why the builder refused a node. Messages name the op and print shapes in
/// the IR's notation; the frontend adds the source location.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum IrError {
    #[error("{op}: shapes do not fit: {detail}")]
    Shape { op: &'static str, detail: String },
    #[error("{op}: element types do not fit: {detail}")]
    DType { op: &'static str, detail: String },
    #[error("{op} takes {expected} inputs, got {got}")]
    Arity {
        op: &'static str,
        expected: &'static str,
        got: usize,
    },
    #[error("{op}: axis {axis} is out of range for a tensor of rank {rank}")]
    Axis {
        op: &'static str,
        axis: i64,
        rank: usize,
    },
    #[error("parameter `{0}` is declared twice in the same scope")]
    DuplicateParam(String),
    #[error("input `{0}` is declared twice")]
    DuplicateInput(String),
    #[error("{op}: {detail}")]
    Invalid { op: &'static str, detail: String },
    #[error("a dimension or count overflows: {0}")]
    Overflow(String),
}

pub type Result<T, E = IrError> = std::result::Result<T, E>;

/// A plan (its mesh, stages or layouts) that does not describe the model it
/// is run with: plans are files, checked when they are loaded.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
#[error("the plan does not fit the model: {0}")]
pub struct PlanMismatch(pub String);
