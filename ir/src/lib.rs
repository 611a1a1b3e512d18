//! dplc's tensor IR: the model graph with its `repeat` structure, symbolic
//! shapes, a closed set of primitive ops, analyses and the textual printer.

mod analysis;
mod autodiff;
mod config;
mod context;
mod dtype;
mod error;
mod graph;
mod id;
mod layout;
mod localize;
mod mask;
mod op;
mod pipeline;
mod plan;
mod print;
mod shape;
mod strategy;
pub mod validate;

pub use analysis::{
    attention_core, attention_core_tensor, ActivationProfile, Analysis, SavedTensor,
};
pub use autodiff::{differentiable_inputs, saved_values, GradPlan, SavedAt, SavedKind, SavedValue};
pub use config::{ClusterSpec, DeviceSpec, LinkSpec, LrSchedule, Optimizer, Precision, TrainSpec};
pub use context::{
    context_chunks, context_layout, context_position, context_traffic, split_context,
    ContextGather, ContextTraffic,
};
pub use dtype::DType;
pub use error::{IrError, PlanMismatch, Result};
pub use graph::{
    broadcast, Graph, InputInfo, Node, ParamInfo, Region, ScalarArg, Scope, ScopeKind, Tensor,
    TensorDef, BOUND_DIMS,
};
pub use id::{InputId, NodeId, ParamId, RegionId, ScopeId, SymId, TensorId};
pub use layout::{
    ModelLayout, NodeLayout, ParamSplit, Placement, RegionLayout, SplitAxis, TensorLayout,
};
pub use localize::localize;
pub use mask::{scalar_constant, window_mask, WindowMask};
pub use op::{BinaryOp, Init, Op, ReduceKind, UnaryOp, VocabOp};
pub use pipeline::{
    accounted_stage_layers, even_split, pipeline_order, virtual_stage_layers, zero3_holds_the_step,
    PipelineWork,
};
pub use plan::{
    Alternative, AxisComm, AxisPart, BackwardCollective, Collective, CollectiveKind, Estimate,
    MemoryBreakdown, ModelSource, ParamSharding, Plan, ProgramValue, RegionProgram, SearchStats,
    SkippedDegree, StagePlan, StepPhase, TimeBreakdown, WhatIf,
};
pub use strategy::{powersgd_factors, topk_sparsifies, POWERSGD_MIN_COMPRESSION_RATE};
pub use strategy::{
    AttentionKind, AxisMapping, ClusterSummary, Compression, Dispatch, Elementwise, GradAccum,
    GradReduce, GradSync, LayerRecompute, LinkLevel, Loss, Mesh, MeshAxis, Offload,
    PipelineSchedule, Recompute, RootSplit, ServerRanks, ShardLayout, Strategy, TpImpl, TpOverlap,
};

pub use print::print_graph;
pub use shape::{Dim, Poly, Ratio, Shape};
pub use validate::PlanInvalid;
