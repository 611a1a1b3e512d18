//! The `Plan`: what the planner decided and what it expects, as plain data.
//! The planner writes it (RON on disk, JSON on request); explain, viz and the runtime read it.

use crate::strategy::*;
use crate::validate::{self as rules, PlanInvalid};
use serde::{Deserialize, Serialize};

/// Bytes one rank holds, by kind.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct MemoryBreakdown {
    pub weights: u64,
    pub gradients: u64,
    pub optimizer: u64,
    /// Activations kept for backward by all micro-batches in flight.
    pub activations: u64,
    /// Embedding, logits and loss tensors of the first and last stages.
    pub embedding_and_loss: u64,
    /// Point-to-point buffers, the gathered layers under ZeRO-3, a layer's
    /// whole gradients before their reduce-scatter under ZeRO-2/3, the
    /// transient activations of the layer being recomputed, the backward's
    /// working set (the loss's input gradient, or a layer's two largest
    /// gradients), and the runtime's own share (CUDA context, library
    /// workspaces, NCCL buffers).
    pub buffers: u64,
    /// The part of `buffers` a GPU process holds outside its tensor
    /// allocator (the CUDA context, library workspaces, fragmentation): the
    /// allocator's measured peak is to be compared with the total less this.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub reserve: u64,
    /// Host memory this rank's offloaded state takes (not in the device's
    /// total): optimizer state, weights or activations under `offload`.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub host: u64,
}

impl MemoryBreakdown {
    /// The sum, `u64::MAX` where it would overflow: a total never wraps
    /// round to look small.
    pub fn total(&self) -> u64 {
        self.checked_total().unwrap_or(u64::MAX)
    }

    /// The sum, `None` where it overflows a `u64`.
    pub fn checked_total(&self) -> Option<u64> {
        [
            self.gradients,
            self.optimizer,
            self.activations,
            self.embedding_and_loss,
            self.buffers,
        ]
        .iter()
        .try_fold(self.weights, |acc, &b| acc.checked_add(b))
    }
}

/// One pipeline stage: its layers and the memory of one of its ranks.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct StagePlan {
    pub stage: u64,
    /// Layers `first_layer .. first_layer + layers` (all chunks together when interleaved).
    pub first_layer: u64,
    pub layers: u64,
    pub embedding: bool,
    pub head: bool,
    /// Micro-batches (of whole stages) whose activations are in flight at the peak.
    pub micro_batches_in_flight: f64,
    pub memory: MemoryBreakdown,
    /// Seconds of one micro-batch's forward on this stage (all its chunks),
    /// exposed tensor/context/expert communication included.
    #[serde(default)]
    pub forward_s: f64,
    /// The same for the backward, recomputation included.
    #[serde(default)]
    pub backward_s: f64,
}

/// How one parameter (or group) is split.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ParamSharding {
    pub name: String,
    /// Elements across all iterations of its `repeat`.
    pub elements: u64,
    /// `(axis, tensor dimension)` pairs: the dimension split over that mesh axis.
    pub splits: Vec<(MeshAxis, usize)>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub enum CollectiveKind {
    AllReduce,
    AllGather,
    ReduceScatter,
    AllToAll,
    SendRecv,
}

impl CollectiveKind {
    pub fn name(self) -> &'static str {
        match self {
            CollectiveKind::AllReduce => "all-reduce",
            CollectiveKind::AllGather => "all-gather",
            CollectiveKind::ReduceScatter => "reduce-scatter",
            CollectiveKind::AllToAll => "all-to-all",
            CollectiveKind::SendRecv => "send/recv",
        }
    }
}

/// Where in the step a collective runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub enum StepPhase {
    Forward,
    Backward,
    /// Forward collectives repeated by activation recomputation.
    Recompute,
    /// After (or overlapped with) the last backward: gradient synchronisation.
    GradientSync,
    /// Around the optimizer step (ZeRO parameter all-gather).
    Optimizer,
}

impl StepPhase {
    pub fn name(self) -> &'static str {
        match self {
            StepPhase::Forward => "forward",
            StepPhase::Backward => "backward",
            StepPhase::Recompute => "recompute",
            StepPhase::GradientSync => "grad-sync",
            StepPhase::Optimizer => "optimizer",
        }
    }
}

/// One collective of the step, as every rank of the axis runs it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Collective {
    pub kind: CollectiveKind,
    pub axis: MeshAxis,
    /// What it moves, e.g. `layer output (row-parallel)`.
    pub what: String,
    /// Bytes of the full tensor per call (before the algorithm's 2(n−1)/n).
    pub bytes: u64,
    pub phase: StepPhase,
    /// Calls per step per rank.
    pub count_per_step: u64,
    /// Estimated seconds of one call.
    pub time_s: f64,
    /// The ranks of one call and the link they meet over: the axis's own,
    /// except where a collective spans more than its axis (the gradient
    /// reduction over the data- and context-parallel ranks). `None` in
    /// plans written before it was recorded: the axis's.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub group: Option<(u64, LinkLevel)>,
}

/// Where the time of a step goes (seconds, on the critical path).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct TimeBreakdown {
    /// Forward and backward compute of all micro-batches on the slowest stage.
    pub compute_s: f64,
    /// The part of `compute_s` spent recomputing activations.
    pub recompute_s: f64,
    /// Tensor-, context- and expert-parallel collectives (not overlapped).
    pub exposed_comm_s: f64,
    /// Sends and receives between pipeline stages.
    pub pipeline_p2p_s: f64,
    /// Idle time of the pipeline fill and drain.
    pub bubble_s: f64,
    /// Gradient reduction and ZeRO gathers not hidden behind compute.
    pub exposed_dp_comm_s: f64,
    pub optimizer_s: f64,
    /// Tensor-parallel communication hidden behind GEMMs by the plan's
    /// `tp_overlap` (not part of the step time; plans written before this
    /// field existed hid none).
    #[serde(default)]
    pub overlapped_comm_s: f64,
    /// What compute loses to the communication overlapped with it (the
    /// collectives' kernels take SMs and memory bandwidth from the kernels
    /// beside them): part of the step time. Plans written before this field
    /// existed priced overlapped communication as free.
    #[serde(default, skip_serializing_if = "is_zero_s")]
    pub overlap_slowdown_s: f64,
    /// Offloaded state crossing the host link where compute does not hide
    /// it: gradients down and weights up around the CPU's optimizer step,
    /// weight shards fetched and activations sent out and back per
    /// micro-batch. Plans written before this field existed offloaded nothing.
    #[serde(default, skip_serializing_if = "is_zero_s")]
    pub offload_s: f64,
    /// Bytes that cross the host link per step for the offloaded state
    /// (`offload_s` is the part of their time compute does not hide).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub offload_bytes: u64,
    /// Bytes the busiest rank's link carries (one direction) per step for the
    /// data-parallel gradient reduction and, under a parameter server, the
    /// weights' return. Plans written before this field existed left it out.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub dp_link_bytes: u64,
    /// Each mesh axis's communication per step: what stays on the critical
    /// path and what overlap hides. Plans written before this field existed
    /// have none (`dplc explain` then prints the totals before overlap).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub comm_by_axis: Vec<AxisComm>,
}

/// One mesh axis's communication per step, on the slowest stage.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct AxisComm {
    pub axis: MeshAxis,
    /// Seconds on the critical path (part of the step time).
    pub exposed_s: f64,
    /// Seconds hidden behind compute: tensor-parallel collectives beside
    /// GEMMs, the context-parallel ring beside attention, data-parallel
    /// reduction and ZeRO gathers beside backward and forward.
    pub hidden_s: f64,
}

fn is_zero_s(t: &f64) -> bool {
    *t == 0.0
}

/// What the plan is expected to achieve.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Estimate {
    pub step_time_s: f64,
    pub breakdown: TimeBreakdown,
    pub tokens_per_s: f64,
    /// Samples per second, for a model without a `seq` dimension (an image
    /// classifier), whose throughput is counted in samples; absent otherwise.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub samples_per_s: Option<f64>,
    /// `3 × forward FLOPs` per step (no recomputation), each attention
    /// counted over the query-key pairs its mask keeps: a causal one half,
    /// as Megatron-LM counts it from core_v0.16.0 and FlashAttention's
    /// benchmarks do.
    pub model_flops_per_step: f64,
    /// What the kernels execute: model FLOPs, the recomputed forward, and
    /// the masked scores an unfused attention computes (a fused kernel
    /// skips them).
    pub hardware_flops_per_step: f64,
    /// The attention FLOPs the masks remove (`3 ×` forward): add them to
    /// compare with a count over every pair (PaLM's `6N + 12LHQT`,
    /// Megatron-LM before core_v0.16.0, torchtitan's MFU). 0 in plans
    /// written before it was counted.
    #[serde(default)]
    pub masked_attention_flops_per_step: f64,
    pub model_tflops_per_gpu: f64,
    pub hardware_tflops_per_gpu: f64,
    /// Model FLOP/s over the devices' peak.
    pub mfu: f64,
    /// The largest per-rank memory over all stages, bytes.
    pub peak_memory_bytes: u64,
}

/// Counts of the search that produced the plan (no wall time: plans are deterministic).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct SearchStats {
    pub configs_evaluated: u64,
    /// Configurations the knobs span: the evaluated ones times the choices
    /// of every knob the search settles analytically instead of enumerating
    /// (each has a choice that is never worse). 0 in plans written before.
    #[serde(default)]
    pub space: u64,
    pub feasible: u64,
    /// The keys fixed by `--strategy`, as given.
    pub pinned: String,
    /// Tensor/expert degrees the cluster allows but the model's layers
    /// cannot split by, each with why: the search leaves them out.
    #[serde(default)]
    pub skipped: Vec<SkippedDegree>,
}

/// A tensor/expert degree the search left out, and why.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct SkippedDegree {
    pub tp: u64,
    pub ep: u64,
    pub reason: String,
}

/// A runner-up and why it lost to the chosen plan.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Alternative {
    pub rank: u64,
    pub mesh: Mesh,
    pub strategy: Strategy,
    pub step_time_s: f64,
    pub peak_memory_bytes: u64,
    pub reason: String,
}

/// A neighbouring plan, one choice changed, and what it would do.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct WhatIf {
    /// The change, e.g. `tp 8 → 16` or `recompute selective → full`.
    pub change: String,
    /// `None` when the change is impossible (see `note`).
    pub step_time_s: Option<f64>,
    pub peak_memory_bytes: Option<u64>,
    pub fits: bool,
    /// Why it is impossible, or what else had to change with it.
    pub note: String,
}

/// What one rank holds of a tensor along one mesh axis.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum AxisPart {
    /// The slice along this dimension of the tensor.
    Shard(usize),
    /// A summand: the group's values add up to the tensor.
    Partial,
}

/// One value of a region's per-rank program, as the sharding e-graph extracted it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ProgramValue {
    /// `v12`, the name the other values use.
    pub name: String,
    /// The e-node, operands by value name: `(matmul n12 v3 v4)`, `(all-reduce tp v32)`.
    pub expr: String,
    /// The whole (unsplit) tensor's shape, e.g. `[batch, seq, 768]`.
    pub shape: String,
    /// What a rank holds, per mesh axis; empty: replicated.
    pub layout: Vec<(MeshAxis, AxisPart)>,
    /// The IR tensor (index of `%t`) this value is a layout of, when there is one.
    pub tensor: Option<u32>,
    /// Set when the value is a collective the forward pass performs.
    pub collective: Option<CollectiveKind>,
    /// Names of the values it reads.
    pub inputs: Vec<String>,
}

/// A backward-pass collective the forward layout implies.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct BackwardCollective {
    pub kind: CollectiveKind,
    pub axis: MeshAxis,
    /// The value whose gradient it moves.
    pub of: String,
    /// Elements of the whole tensor, as a formula in the symbolic dims.
    pub elements: String,
}

/// The extracted per-rank program of one region (a layer body, or the model's
/// embedding and head) at the plan's tensor/expert/sequence-parallel degrees.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct RegionProgram {
    /// `layer` (one iteration of the repeat) or `model` (embedding, head and loss).
    pub region: String,
    pub tp: u64,
    pub ep: u64,
    pub sequence_parallel: bool,
    /// Operands before users.
    pub values: Vec<ProgramValue>,
    /// The values the region yields.
    pub outputs: Vec<String>,
    pub backward: Vec<BackwardCollective>,
    /// The e-graph's size and why saturation stopped, for `explain`.
    pub egraph_nodes: u64,
    pub egraph_iterations: u64,
    pub stop_reason: String,
}

/// Where a plan's model came from: enough to lower it again, so that a plan
/// file alone suffices for `verify`, `build` and `run --plan`.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct ModelSource {
    /// The path the model was read from, as given (for messages only).
    pub file: String,
    /// The model's name in that file.
    pub model: String,
    /// The whole `.dpl` text, so the plan does not depend on the file staying put.
    pub text: String,
}

/// A complete parallelisation plan for one model on one cluster.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Plan {
    pub model: String,
    pub params: u64,
    pub layers: u64,
    pub cluster: ClusterSummary,
    pub mesh: Mesh,
    pub strategy: Strategy,
    pub stages: Vec<StagePlan>,
    pub param_sharding: Vec<ParamSharding>,
    pub collectives: Vec<Collective>,
    pub estimate: Estimate,
    pub search: SearchStats,
    pub alternatives: Vec<Alternative>,
    /// Neighbouring plans (one choice changed) with their time and memory.
    #[serde(default)]
    pub what_if: Vec<WhatIf>,
    /// The per-rank programs of the layer and of the model's ends, from the
    /// sharding e-graph; empty when no axis splits a layer (tp = ep = 1).
    #[serde(default)]
    pub programs: Vec<RegionProgram>,
    /// The model's source; empty when the plan was made from a graph alone.
    #[serde(default)]
    pub source: ModelSource,
    /// Per-tensor layouts under tensor, sequence and expert parallelism, for
    /// the runtime. `None`: the runtime derives Megatron's layout itself.
    #[serde(default)]
    pub layout: Option<crate::layout::ModelLayout>,
}

impl Plan {
    /// Model chunks each pipeline stage runs: the virtual stages of the
    /// interleaved schedule, else 1.
    pub fn chunks(&self) -> u64 {
        match self.strategy.schedule {
            PipelineSchedule::Interleaved => self.strategy.virtual_stages.max(1),
            _ => 1,
        }
    }

    /// Layers each pipeline stage runs, all its chunks together, as planned.
    pub fn stage_layers(&self) -> Vec<u64> {
        self.stages.iter().map(|s| s.layers).collect()
    }

    /// Whether the plan is one dplc can run, draw and explain, whatever model
    /// it is for: the mesh fills the cluster, every degree divides what it
    /// splits, the batch splits into whole micro-batches, the stages cover
    /// the layers in order, and every size and time is a finite number ≥ 0.
    /// The rules are the planner's own ([`crate::validate`]); a plan file may
    /// have been edited by hand, so every field is checked and nothing panics.
    /// [`Plan::check_against`] adds what needs the model.
    pub fn validate(&self) -> Result<(), PlanInvalid> {
        let c = &self.cluster;
        let world = rules::world(c.nodes, c.devices_per_node)
            .map_err(|e| PlanInvalid::new("cluster", e))?;
        if c.memory_bytes == 0 {
            return Err(PlanInvalid::new(
                "cluster.memory_bytes",
                "0 bytes; a device holds some memory",
            ));
        }
        positive("cluster.peak_flops", c.peak_flops)?;
        if self.layers == 0 {
            return Err(PlanInvalid::new("layers", "0; a plan splits layers"));
        }
        if self.params == 0 {
            return Err(PlanInvalid::new("params", "0; a model has parameters"));
        }

        let m = &self.mesh;
        let mesh = |e: String| PlanInvalid::new("mesh", e);
        rules::degrees_positive(&[
            ("dp", m.dp),
            ("tp", m.tp),
            ("pp", m.pp),
            ("cp", m.cp),
            ("ep", m.ep),
        ])
        .map_err(mesh)?;
        rules::mesh_fills(m.dp, m.tp, m.pp, m.cp, world).map_err(mesh)?;
        rules::expert_groups(m.ep, m.dp).map_err(mesh)?;
        rules::pipeline_depth(m.pp, self.layers).map_err(mesh)?;
        for (i, a) in m.axes.iter().enumerate() {
            let degree = match a.axis {
                MeshAxis::Dp => m.dp,
                MeshAxis::Tp => m.tp,
                MeshAxis::Pp => m.pp,
                MeshAxis::Cp => m.cp,
                MeshAxis::Ep => m.ep,
            };
            let field = format!("mesh.axes[{i}]");
            if a.size != degree {
                return Err(PlanInvalid::new(
                    field,
                    format!(
                        "the {} axis has size {}, but the mesh has {} {degree}",
                        a.axis.name(),
                        a.size,
                        a.axis.name()
                    ),
                ));
            }
            if a.stride == 0 {
                return Err(PlanInvalid::new(
                    field,
                    "stride 0; ranks are at least 1 apart",
                ));
            }
            non_negative(
                &format!("{field}.bandwidth_bytes_per_s"),
                a.bandwidth_bytes_per_s,
            )?;
        }

        let s = &self.strategy;
        rules::global_batch(s.global_batch)
            .map_err(|e| PlanInvalid::new("strategy.global_batch", e))?;
        rules::seq(s.seq).map_err(|e| PlanInvalid::new("strategy.seq", e))?;
        rules::batch_split(s.global_batch, m.dp, s.micro_batch, s.num_micro_batches)
            .map_err(|e| PlanInvalid::new("strategy.micro_batch", e))?;
        rules::zero_stage(s.zero_stage).map_err(|e| PlanInvalid::new("strategy.zero_stage", e))?;
        // The plan alone: which ops read the sequence whole is the model's
        // to say (the planner refused cp for them).
        rules::context(m.cp, s.seq, None).map_err(mesh)?;
        rules::sequence_parallel(s.sequence_parallel, m.tp, m.cp, s.seq)
            .map_err(|e| PlanInvalid::new("strategy.sequence_parallel", e))?;
        if s.fp8_bf16_ends > 0 && (!s.fp8 || s.fp8_bf16_ends.saturating_mul(2) > self.layers) {
            return Err(PlanInvalid::new(
                "strategy.fp8_bf16_ends",
                format!(
                    "{}: the first and last layers kept in bf16 need fp8 and at most half of the {} layers at each end",
                    s.fp8_bf16_ends, self.layers
                ),
            ));
        }
        if s.recompute_layers > 0
            && (s.recompute != Recompute::Full || s.recompute_layers > self.layers)
        {
            return Err(PlanInvalid::new(
                "strategy.recompute_layers",
                format!(
                    "{}: recomputing some layers of each chunk needs recompute = full and at most the model's {} layers",
                    s.recompute_layers, self.layers
                ),
            ));
        }
        let v = s.virtual_stages;
        match s.schedule {
            PipelineSchedule::Interleaved if v < 2 => {
                return Err(PlanInvalid::new(
                    "strategy.virtual_stages",
                    format!("{v}; the interleaved schedule runs at least 2 chunks per stage"),
                ))
            }
            PipelineSchedule::GPipe | PipelineSchedule::OneFOneB if v != 1 => {
                return Err(PlanInvalid::new(
                    "strategy.virtual_stages",
                    format!(
                        "{v} needs the interleaved schedule, not {}",
                        s.schedule.name()
                    ),
                ))
            }
            _ => {}
        }
        rules::interleaving(self.layers, m.pp, v, s.num_micro_batches)
            .map_err(|e| PlanInvalid::new("strategy.virtual_stages", e))?;
        rules::pipeline_passes(s.num_micro_batches, v, m.pp)
            .map_err(|e| PlanInvalid::new("strategy.num_micro_batches", e))?;

        self.validate_stages()?;

        let e = &self.estimate;
        positive("estimate.step_time_s", e.step_time_s)?;
        let b = &e.breakdown;
        for (name, x) in [
            ("tokens_per_s", e.tokens_per_s),
            ("model_flops_per_step", e.model_flops_per_step),
            ("hardware_flops_per_step", e.hardware_flops_per_step),
            ("model_tflops_per_gpu", e.model_tflops_per_gpu),
            ("hardware_tflops_per_gpu", e.hardware_tflops_per_gpu),
            ("mfu", e.mfu),
            ("breakdown.compute_s", b.compute_s),
            ("breakdown.recompute_s", b.recompute_s),
            ("breakdown.exposed_comm_s", b.exposed_comm_s),
            ("breakdown.pipeline_p2p_s", b.pipeline_p2p_s),
            ("breakdown.bubble_s", b.bubble_s),
            ("breakdown.exposed_dp_comm_s", b.exposed_dp_comm_s),
            ("breakdown.optimizer_s", b.optimizer_s),
            ("breakdown.overlapped_comm_s", b.overlapped_comm_s),
            ("breakdown.overlap_slowdown_s", b.overlap_slowdown_s),
            ("breakdown.offload_s", b.offload_s),
        ] {
            non_negative(&format!("estimate.{name}"), x)?;
        }
        // The peak is the largest stage's (whether it fits the device is
        // the loader's to ask: the library prices plans that do not, with
        // `ignore_memory`).
        let e = &self.estimate;
        let largest = self.stages.iter().map(|st| st.memory.total()).max();
        if e.peak_memory_bytes == 0 || largest != Some(e.peak_memory_bytes) {
            return Err(PlanInvalid::new(
                "estimate.peak_memory_bytes",
                format!(
                    "{} bytes, but the largest stage holds {} bytes",
                    e.peak_memory_bytes,
                    largest.unwrap_or(0)
                ),
            ));
        }
        for (i, c) in self.collectives.iter().enumerate() {
            non_negative(&format!("collectives[{i}].time_s"), c.time_s)?;
            if let Some((size, _)) = c.group {
                if size == 0 || size > world {
                    return Err(PlanInvalid::new(
                        format!("collectives[{i}].group"),
                        format!("{size} ranks; a group holds 1 to the cluster's {world}"),
                    ));
                }
            }
        }
        for (i, a) in self.alternatives.iter().enumerate() {
            non_negative(&format!("alternatives[{i}].step_time_s"), a.step_time_s)?;
        }
        for (i, w) in self.what_if.iter().enumerate() {
            if let Some(t) = w.step_time_s {
                non_negative(&format!("what_if[{i}].step_time_s"), t)?;
            }
        }
        if let Some(layout) = &self.layout {
            if (layout.tp, layout.ep, layout.sequence_parallel) != (m.tp, m.ep, s.sequence_parallel)
            {
                return Err(PlanInvalid::new(
                    "layout",
                    format!(
                        "for tp {} ep {} sequence parallel {}, but the plan runs tp {} ep {} sequence parallel {}",
                        layout.tp, layout.ep, layout.sequence_parallel, m.tp, m.ep, s.sequence_parallel
                    ),
                ));
            }
        }
        Ok(())
    }

    /// One stage per pipeline rank, numbered in order, each holding the
    /// next run of layers (at least one per chunk), together all of them.
    fn validate_stages(&self) -> Result<(), PlanInvalid> {
        let pp = self.mesh.pp;
        if self.stages.len() as u64 != pp {
            return Err(PlanInvalid::new(
                "stages",
                format!(
                    "{} stages for a pipeline of pp {pp}; there is one per pipeline stage",
                    self.stages.len()
                ),
            ));
        }
        let v = self.chunks();
        let mut next_layer = 0u64;
        for (i, st) in self.stages.iter().enumerate() {
            let field = format!("stages[{i}]");
            let bad = |detail: String| Err(PlanInvalid::new(&field, detail));
            if st.stage != i as u64 {
                return bad(format!("numbered {}, but it is stage {i}", st.stage));
            }
            if st.layers < v {
                return bad(format!(
                    "{} layers, fewer than its {v} chunk{}; every stage runs at least one layer per chunk",
                    st.layers,
                    if v == 1 { "" } else { "s" }
                ));
            }
            if st.first_layer != next_layer {
                return bad(format!(
                    "starts at layer {}, but the stages before it end at layer {next_layer}; stages hold consecutive layers in order",
                    st.first_layer
                ));
            }
            next_layer = match next_layer.checked_add(st.layers) {
                Some(n) if n <= self.layers => n,
                _ => {
                    return bad(format!(
                        "layers {}..{}+{} run past the model's {} layers",
                        st.first_layer, st.first_layer, st.layers, self.layers
                    ))
                }
            };
            if st.embedding != (i == 0) || st.head != (i as u64 == pp - 1) {
                return bad(
                    "the embedding is on the first stage and the head on the last, and only there"
                        .into(),
                );
            }
            if st.memory.checked_total().is_none() {
                return bad("its memory adds up to more than 2^64 bytes".into());
            }
            if st.memory.reserve > st.memory.buffers {
                return bad(format!(
                    "its runtime reserve ({} bytes) is part of its buffers ({} bytes) and cannot exceed them",
                    st.memory.reserve, st.memory.buffers
                ));
            }
            non_negative(
                &format!("{field}.micro_batches_in_flight"),
                st.micro_batches_in_flight,
            )?;
            non_negative(&format!("{field}.forward_s"), st.forward_s)?;
            non_negative(&format!("{field}.backward_s"), st.backward_s)?;
        }
        if next_layer != self.layers {
            return Err(PlanInvalid::new(
                "stages",
                format!(
                    "the stages hold {next_layer} layers, the model has {}",
                    self.layers
                ),
            ));
        }
        Ok(())
    }

    /// Whether this plan describes `graph`: one stage per pipeline rank whose
    /// layers add up to the model's and fill every chunk, and, when a layer
    /// is split, a layout of the mesh's degrees that fits the graph. Plans
    /// are files a person may have edited: everything is checked, nothing
    /// panics.
    pub fn check_against(&self, graph: &crate::Graph) -> Result<(), crate::PlanMismatch> {
        let bad = |what: String| Err(crate::PlanMismatch(what));
        let m = &self.mesh;
        if [m.dp, m.tp, m.pp, m.cp, m.ep].contains(&0) {
            return bad(format!("the mesh {m} has an empty axis"));
        }
        if self.stages.len() as u64 != m.pp {
            return bad(format!(
                "{} stages for a pipeline of {}",
                self.stages.len(),
                m.pp
            ));
        }
        let repeats: Vec<u64> = graph
            .region(graph.root())
            .nodes
            .iter()
            .filter_map(|&n| match graph.node(n).op {
                crate::Op::Repeat { count, .. } => Some(count),
                _ => None,
            })
            .collect();
        let layers: u64 = repeats.iter().sum();
        if self.layers != layers {
            return bad(format!(
                "the plan is for {} layers, `{}` has {layers}",
                self.layers, graph.name
            ));
        }
        // The parameters the plan shards are the model's: a source edited
        // after planning (a wider `d`) lowers to others.
        let params = graph.param_count();
        if u128::from(self.params) != params {
            return bad(format!(
                "params: the plan records {} parameters, but its source lowers `{}` to {params}",
                self.params, graph.name
            ));
        }
        if self.param_sharding.len() != graph.params().len() {
            return bad(format!(
                "param_sharding: {} entries, but `{}` has {} parameters",
                self.param_sharding.len(),
                graph.name,
                graph.params().len()
            ));
        }
        for (i, ps) in self.param_sharding.iter().enumerate() {
            let Some((id, _)) = graph.params().find(|(_, p)| p.name == ps.name) else {
                return bad(format!(
                    "param_sharding[{i}]: `{}` is not a parameter of `{}`",
                    ps.name, graph.name
                ));
            };
            let elements = graph.param_elements(id);
            if u128::from(ps.elements) != elements {
                return bad(format!(
                    "param_sharding[{i}]: `{}` has {} elements in the plan, {elements} in its source",
                    ps.name, ps.elements
                ));
            }
            let rank = graph.param(id).shape.rank();
            if let Some((axis, dim)) = ps.splits.iter().find(|(_, d)| *d >= rank) {
                return bad(format!(
                    "param_sharding[{i}]: `{}` is split over {axis:?} along dimension {dim}, \
                     but it has {rank}",
                    ps.name
                ));
            }
        }
        rules::expert_count(m.ep, rules::model_experts(graph)).map_err(crate::PlanMismatch)?;
        rules::fits_context(self.strategy.seq, graph).map_err(crate::PlanMismatch)?;
        if m.pp > 1 {
            // Several stacks number their layers one after the other.
            if repeats.is_empty() {
                return bad(format!(
                    "a pipeline cuts the model at its layers, and `{}` has no `repeat`",
                    graph.name
                ));
            }
            let planned: u64 = self.stage_layers().iter().sum();
            if planned != layers {
                return bad(format!(
                    "the stages hold {planned} layers, the model has {layers}"
                ));
            }
            let v = self.chunks();
            if let Some(s) = self.stages.iter().find(|s| s.layers < v) {
                return bad(format!(
                    "stage {} holds {} layers, fewer than its {v} chunks",
                    s.stage, s.layers
                ));
            }
        }
        if m.tp > 1 || m.ep > 1 {
            let Some(layout) = &self.layout else {
                return bad(format!(
                    "a plan with tp {} ep {} needs the layout of every tensor; this one has none",
                    m.tp, m.ep
                ));
            };
            if (layout.tp, layout.ep, layout.sequence_parallel)
                != (m.tp, m.ep, self.strategy.sequence_parallel)
            {
                return bad(format!(
                    "the layout is for tp {} ep {} sequence parallel {}, the plan runs tp {} ep {} sequence parallel {}",
                    layout.tp,
                    layout.ep,
                    layout.sequence_parallel,
                    m.tp,
                    m.ep,
                    self.strategy.sequence_parallel
                ));
            }
            layout.check(graph)?;
        }
        Ok(())
    }
}

fn non_negative(field: &str, x: f64) -> Result<(), PlanInvalid> {
    if x.is_finite() && x >= 0.0 {
        Ok(())
    } else {
        Err(PlanInvalid::new(
            field,
            format!("{x}; it is a finite number ≥ 0"),
        ))
    }
}

fn positive(field: &str, x: f64) -> Result<(), PlanInvalid> {
    if x.is_finite() && x > 0.0 {
        Ok(())
    } else {
        Err(PlanInvalid::new(
            field,
            format!("{x}; it is a finite number > 0"),
        ))
    }
}
