//! The planner's error type: bad cluster or strategy input, and models that
//! fit nowhere, with what to change.

use thiserror::Error;

/// Why the planner produced no plan. Every message says what is wrong and
/// what to do about it.
#[derive(Debug, Clone, PartialEq, Error)]
pub enum PlanError {
    #[error("cannot read cluster `{spec}`: {detail}")]
    Cluster { spec: String, detail: String },
    #[error("unknown device `{name}`; known devices: {known}")]
    UnknownDevice { name: String, known: String },
    #[error("cannot read strategy `{spec}`: {detail}")]
    StrategySyntax { spec: String, detail: String },
    /// A size dplc refuses before searching: zero, or past a limit of
    /// [`dplc_ir::validate`].
    #[error("cannot plan: {0}")]
    Request(String),
    #[error("impossible strategy: {0}")]
    Strategy(String),
    #[error("the model cannot be planned: {0}")]
    Model(String),
    #[error("{0}")]
    Infeasible(String),
}
