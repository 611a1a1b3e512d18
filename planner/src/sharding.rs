//! A region's layout as the cost model reads it: split parameters, sharded
//! tensors, how each matmul is divided and the collectives per iteration.
//!
//! The sharding e-graph ([`crate::egraph::shard_region`]) is the one place that
//! decides layouts; the rest of the planner reads only [`RegionSharding`].

use dplc_ir::{Dim, NodeId, ParamId, TensorId};
use std::collections::{BTreeMap, BTreeSet};

/// How one matmul's work is divided over the tensor-parallel group.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GemmSplit {
    /// Weight split on its output dim; input replicated, output sharded.
    Column,
    /// Weight split on its input dim; input sharded, output a partial sum.
    Row,
    /// Both operands sharded on a batch axis (attention heads).
    Batch,
    /// Every rank does the whole matmul.
    Replicated,
}

/// The tensor-parallel collective kinds the rule inserts.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum TpCollectiveKind {
    /// Sum of partial results (row-parallel output, or the input gradient of a
    /// column-parallel matmul). Under sequence parallelism: reduce-scatter + all-gather.
    AllReduce,
    /// A sharded tensor needed whole.
    AllGather,
    /// Per-row statistics of a softmax over a sharded axis (vocab-parallel loss).
    RowStats,
}

/// Whether a collective runs in the forward or the backward pass.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Pass {
    Forward,
    Backward,
}

/// One collective per iteration of the region.
#[derive(Clone, Debug, PartialEq)]
pub struct TpCollective {
    pub kind: TpCollectiveKind,
    pub pass: Pass,
    /// The tensor it moves (its full, unsharded size).
    pub tensor: TensorId,
    pub elements: Dim,
    /// Bytes per element on the wire: activations travel in the training
    /// precision, row statistics in fp32.
    pub fp32: bool,
}

/// The layout of one region (a layer body, or the model's root for embedding and head).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct RegionSharding {
    /// Tensors split over the tensor-parallel group (by storage root).
    pub sharded: BTreeSet<TensorId>,
    /// How each matmul is split.
    pub gemms: BTreeMap<NodeId, GemmSplit>,
    /// Parameters split over tensor parallelism, with the split dimension.
    pub split_params: BTreeMap<ParamId, usize>,
    /// Parameters with a leading experts dimension: split over expert parallelism.
    pub expert_params: BTreeSet<ParamId>,
    /// Tensors held in the experts layout (a rank's experts, with the slots
    /// of every expert-parallel rank), by storage root: whole on every
    /// tensor-parallel rank, under sequence parallelism too.
    pub experts: BTreeSet<TensorId>,
    pub collectives: Vec<TpCollective>,
    /// Elements each MoE all-to-all moves (dispatch and combine, per pass).
    pub all_to_all: Vec<Dim>,
    /// The largest tensor-parallel degree the layout allows: the gcd of every
    /// split dimension (heads, KV heads, hidden widths).
    pub max_tp: u64,
}
