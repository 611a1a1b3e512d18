//! dplc's runtime: CPU reference kernels and their VJPs, an interpreter of the
//! IR, in-process ranks with a deterministic communicator, and one schedule
//! executor (data parallel, ZeRO-1/2/3, pipeline schedules, recompute,
//! tensor/sequence/expert parallelism from per-tensor layouts) whose stages
//! are computed by the interpreter or by codegen's fused kernels (`fused`).
//!
//! Architecture invariant: the runtime never needs the planner; a rank's work
//! is a list of forward/backward units with collectives between them, and how
//! tensors are split arrives as data (`dplc_ir::ModelLayout`).

mod checkpoint;
mod comm;
mod data;
mod error;
pub mod fused;
pub mod gpu;
#[cfg(test)]
mod gradcheck;
mod gradsync;
mod interp;
mod kernels;
mod schedule;
// Without the `mpi` feature only the tests use the wire format.
#[cfg_attr(not(feature = "mpi"), allow(dead_code))]
mod mpi_world;
mod params;
mod partition;
mod rng;
mod shard;
mod tcp_world;
mod tensor;
mod vjp;
mod vocab;

pub use checkpoint::{Checkpoint, CheckpointConfig, CheckpointKill, KillPoint};
pub use comm::{Communicator, Group, Message, World};
pub use data::{Corpus, TokenFormat};
pub use error::{Result, RuntimeError};
pub use gradsync::Traffic;
pub use interp::ParamKey;
pub use kernels::{forward, DropoutKey, OpCtx};
pub use mpi_world::MpiProcess;
pub use params::ZeroStage;
pub use partition::Schedule;
pub use schedule::{
    train, train_process, AttentionUse, Collectives, Compute, Device, DeviceUse, Faults,
    Parameters, Process, RunConfig, StepStats, StopFlag, TraceSink, TraceSpan, TrainReport,
};
pub use tcp_world::TcpProcess;
pub use tensor::{Data, Tensor};
pub use vjp::backward;
