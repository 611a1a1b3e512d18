//! The `Plan`: what the planner decided and what it expects, as plain data.
//! The planner writes it (RON on disk, JSON on request); explain, viz and the runtime read it.

use crate::validate::{self as rules, PlanInvalid};
use serde::{Deserialize, Serialize};
use std::fmt;

/// A parallelism axis of the device mesh.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub enum MeshAxis {
    /// Tensor parallelism (Megatron column/row splits inside a layer).
    Tp,
    /// Context parallelism: the sequence split over ranks, attention by ring.
    Cp,
    /// Expert parallelism, carved out of the data-parallel group.
    Ep,
    /// Data parallelism (replicas, sharded by ZeRO when asked).
    Dp,
    /// Pipeline parallelism: consecutive layers on consecutive stages.
    Pp,
}

impl MeshAxis {
    pub fn name(self) -> &'static str {
        match self {
            MeshAxis::Tp => "tp",
            MeshAxis::Cp => "cp",
            MeshAxis::Ep => "ep",
            MeshAxis::Dp => "dp",
            MeshAxis::Pp => "pp",
        }
    }
}

/// The kind of link a mesh axis's groups talk over.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum LinkLevel {
    /// Every group lies inside one node (NVLink/NVSwitch, shared memory).
    IntraNode,
    /// Groups cross nodes (InfiniBand, Ethernet).
    InterNode,
    /// The axis has size 1: no communication.
    None,
}

/// One axis of the mesh and where its groups land on the hardware.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct AxisMapping {
    pub axis: MeshAxis,
    pub size: u64,
    /// Distance in global rank between neighbours of a group.
    pub stride: u64,
    pub link: LinkLevel,
    /// Bandwidth per device per direction of that link, bytes/s.
    pub bandwidth_bytes_per_s: f64,
}

/// The device mesh: `dp × tp × pp × cp` ranks (`ep` divides `dp`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Mesh {
    pub dp: u64,
    pub tp: u64,
    pub pp: u64,
    pub cp: u64,
    pub ep: u64,
    /// Innermost (consecutive ranks) first.
    pub axes: Vec<AxisMapping>,
}

impl fmt::Display for Mesh {
    /// `dp 8 × tp 4 × pp 2 × cp 1 (ep 1)`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "dp {} × tp {} × pp {} × cp {} (ep {})",
            self.dp, self.tp, self.pp, self.cp, self.ep
        )
    }
}

/// The hardware a plan was made for.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ClusterSummary {
    pub name: String,
    pub nodes: u64,
    pub devices_per_node: u64,
    pub device: String,
    pub memory_bytes: u64,
    pub peak_flops: f64,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub enum PipelineSchedule {
    /// All forwards, then all backwards (Huang et al. 2019).
    GPipe,
    /// One forward, one backward (PipeDream-Flush, Narayanan et al. 2021).
    OneFOneB,
    /// 1F1B over `virtual_stages` model chunks per device (Narayanan et al. 2021).
    Interleaved,
}

impl PipelineSchedule {
    pub fn name(self) -> &'static str {
        match self {
            PipelineSchedule::GPipe => "gpipe",
            PipelineSchedule::OneFOneB => "1f1b",
            PipelineSchedule::Interleaved => "interleaved",
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub enum Recompute {
    /// Keep every activation the backward needs.
    None,
    /// Recompute the core attention (the tensors quadratic in the sequence),
    /// Korthikanti et al. 2022.
    Selective,
    /// Keep only each layer's input and rerun its forward in backward.
    Full,
    /// torchtitan's op-level selective checkpointing (`selective_ac_option
    /// = "op"`): keep the outputs of the attention kernel and of every
    /// other weight GEMM (the 1st, 3rd, … in the layer's order), recompute
    /// the GEMMs between them and every other op from the layer's input.
    Op,
}

impl Recompute {
    pub fn name(self) -> &'static str {
        match self {
            Recompute::None => "none",
            Recompute::Selective => "selective",
            Recompute::Full => "full",
            Recompute::Op => "op",
        }
    }
}

/// The choices besides the mesh.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Strategy {
    pub global_batch: u64,
    pub seq: u64,
    pub micro_batch: u64,
    /// Micro-batches per step per data-parallel replica.
    pub num_micro_batches: u64,
    pub schedule: PipelineSchedule,
    /// Model chunks per device (1 unless interleaved).
    pub virtual_stages: u64,
    /// 0: replicated; 1: optimizer states sharded over dp; 2: + gradients; 3: + weights.
    pub zero_stage: u8,
    pub recompute: Recompute,
    pub sequence_parallel: bool,
    /// Data-parallel gradient reduction starts bucket by bucket while the last
    /// micro-batch's backward runs (`true`), or only once backward is done:
    /// Megatron without `--overlap-grad-reduce`, as its 2021 local DDP ran.
    /// Plans written before this field existed overlapped.
    #[serde(default = "overlapped", skip_serializing_if = "is_overlapped")]
    pub overlap_grad_reduce: bool,
    /// How the attention core runs. Plans written before this field existed
    /// priced it unfused.
    #[serde(default = "unfused")]
    pub attention: AttentionKind,
    /// Which tensor-parallel collectives hide behind GEMMs. Plans written
    /// before this field existed exposed them all.
    #[serde(default = "no_tp_overlap")]
    pub tp_overlap: TpOverlap,
    /// How each micro-batch's weight gradients reach the fp32 main
    /// gradient. Plans written before this field existed fused it (and are
    /// written without it while they do).
    #[serde(default, skip_serializing_if = "GradAccum::is_fused")]
    pub grad_accum: GradAccum,
    /// How the model's ends (embedding, head, loss) split under tensor
    /// parallelism. Plans written before this field existed were vocabulary-parallel.
    #[serde(default, skip_serializing_if = "RootSplit::is_vocab")]
    pub root: RootSplit,
    /// The layers' linear GEMMs in FP8 (Transformer Engine's recipe: E4M3
    /// forward, E5M2 gradients, scales from amax), everything else in the
    /// training precision. Plans written before this field existed had none.
    #[serde(default, skip_serializing_if = "is_off")]
    pub fp8: bool,
    /// The data-parallel weight all-gathers move the layers' FP8 weights,
    /// one byte each, cast from the shard before the gather (torchao's
    /// `enable_fsdp_float8_all_gather` under FSDP2, Megatron's
    /// `--fp8-param-gather`). Needs `fp8` and a sharded ZeRO stage. Plans
    /// written before this field existed gathered in the training precision.
    #[serde(default, skip_serializing_if = "is_off")]
    pub fp8_gather: bool,
    /// Under `fp8`, the first and the last this many layers run their
    /// GEMMs in bf16 (Megatron's `--first-last-layers-bf16`). Plans written
    /// before this field existed ran every layer in FP8.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub fp8_bf16_ends: u64,
    /// State kept in host memory and moved over the host link (ZeRO-Offload
    /// and ZeRO-Infinity). Plans written before this field existed offloaded nothing.
    #[serde(default, skip_serializing_if = "Offload::is_none")]
    pub offload: Offload,
    /// How the elementwise ops run. Plans written before this field existed
    /// fused them.
    #[serde(default, skip_serializing_if = "Elementwise::is_fused")]
    pub elementwise: Elementwise,
    /// Where ZeRO-3 keeps what it gathers and reduces. Plans written before
    /// this field existed kept flat buffers.
    #[serde(default, skip_serializing_if = "ShardLayout::is_flat")]
    pub shards: ShardLayout,
    /// How data-parallel replicas combine their gradients: all-reduce, a
    /// parameter server, or an asynchronous one with bounded staleness.
    /// Plans written before this field existed all-reduced.
    #[serde(default, skip_serializing_if = "GradSync::is_all_reduce")]
    pub sync: GradSync,
    /// How the data-parallel gradient reduction compresses what it sends.
    /// Plans written before this field existed sent fp32 gradients.
    #[serde(default, skip_serializing_if = "Compression::is_none")]
    pub compress: Compression,
}

/// How data-parallel replicas combine their gradients (`sync=`). Every mode
/// but `AllReduce` changes the training dynamics or the network's shape, so
/// the search takes one only when the user allows it (`--allow sync`).
#[derive(
    Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize,
)]
pub enum GradSync {
    /// A ring all-reduce (NCCL, Megatron, DeepSpeed).
    #[default]
    AllReduce,
    /// Parameters sharded over `shards` server roles: workers push gradient
    /// shards to their server, which sums them in a fixed order, steps the
    /// optimizer and sends the weights back. The servers live on the first
    /// `shards` data-parallel workers (BytePS's co-located servers) or on
    /// ranks of their own (`servers`).
    Ps {
        shards: u64,
        /// Plans written before this field existed co-located them.
        #[serde(default)]
        servers: ServerRanks,
    },
    /// A parameter server without a barrier: a worker computes on weights
    /// up to `staleness` versions old (bounded staleness, SSP).
    Async {
        shards: u64,
        staleness: u64,
        #[serde(default)]
        servers: ServerRanks,
    },
}

/// Where a parameter server's shards live (`ps_ranks=`).
#[derive(
    Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize,
)]
pub enum ServerRanks {
    /// On the first `shards` data-parallel workers, beside their compute
    /// (BytePS's co-located servers): no devices beyond the workers'.
    #[default]
    CoLocated,
    /// On `shards` ranks of their own beyond the workers — extra devices
    /// (BytePS's server machines) that hold the shards and the optimizer
    /// state and run no model compute; each server replica is laid out over
    /// the pipeline stages and tensor-parallel parts as a worker replica is,
    /// so the world grows by `shards · pp · tp` ranks.
    Dedicated,
}

impl ServerRanks {
    pub fn name(self) -> &'static str {
        match self {
            ServerRanks::CoLocated => "colocated",
            ServerRanks::Dedicated => "dedicated",
        }
    }

    pub fn parse(s: &str) -> Option<ServerRanks> {
        match s.trim().to_ascii_lowercase().as_str() {
            "colocated" | "co-located" => Some(ServerRanks::CoLocated),
            "dedicated" => Some(ServerRanks::Dedicated),
            _ => None,
        }
    }
}

impl GradSync {
    /// A synchronous parameter server with `shards` co-located servers.
    pub fn ps(shards: u64) -> GradSync {
        GradSync::Ps {
            shards,
            servers: ServerRanks::CoLocated,
        }
    }

    /// An asynchronous parameter server with `shards` co-located servers.
    pub fn async_ps(shards: u64, staleness: u64) -> GradSync {
        GradSync::Async {
            shards,
            staleness,
            servers: ServerRanks::CoLocated,
        }
    }

    /// The same mode with its servers on `servers` (the all-reduce has none).
    pub fn with_servers(self, servers: ServerRanks) -> GradSync {
        match self {
            GradSync::AllReduce => GradSync::AllReduce,
            GradSync::Ps { shards, .. } => GradSync::Ps { shards, servers },
            GradSync::Async {
                shards, staleness, ..
            } => GradSync::Async {
                shards,
                staleness,
                servers,
            },
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            GradSync::AllReduce => "allreduce",
            GradSync::Ps { .. } => "ps",
            GradSync::Async { .. } => "async",
        }
    }

    /// Server shards of a parameter-server mode.
    pub fn ps_shards(self) -> Option<u64> {
        match self {
            GradSync::AllReduce => None,
            GradSync::Ps { shards, .. } | GradSync::Async { shards, .. } => Some(shards),
        }
    }

    /// Where a parameter server's shards live.
    pub fn servers(self) -> Option<ServerRanks> {
        match self {
            GradSync::AllReduce => None,
            GradSync::Ps { servers, .. } | GradSync::Async { servers, .. } => Some(servers),
        }
    }

    /// Server replicas beyond the workers: `shards` on dedicated ranks, else 0.
    pub fn dedicated_servers(self) -> u64 {
        match (self.servers(), self.ps_shards()) {
            (Some(ServerRanks::Dedicated), Some(shards)) => shards,
            _ => 0,
        }
    }

    /// Versions a worker's weights may lag behind the newest (0 unless async).
    pub fn staleness(self) -> u64 {
        match self {
            GradSync::Async { staleness, .. } => staleness,
            GradSync::AllReduce | GradSync::Ps { .. } => 0,
        }
    }

    /// The mode as `--strategy` keys write it.
    pub fn keys(self) -> String {
        let ranks = match self.servers() {
            Some(ServerRanks::Dedicated) => ",ps_ranks=dedicated",
            _ => "",
        };
        match self {
            GradSync::AllReduce => "sync=allreduce".into(),
            GradSync::Ps { shards, .. } => format!("sync=ps,ps_shards={shards}{ranks}"),
            GradSync::Async {
                shards, staleness, ..
            } => {
                format!("sync=async,ps_shards={shards},staleness={staleness}{ranks}")
            }
        }
    }

    pub fn is_all_reduce(&self) -> bool {
        *self == GradSync::AllReduce
    }
}

/// How the data-parallel gradient reduction compresses what it sends
/// (`compress=`). Lossy, so the search takes one only when the user
/// allows it (`--allow compress`).
///
/// PowerSGD and top-k compress matrices only (a parameter with two or more
/// axes, rows = the first): vectors — biases and norm gains, a sliver of
/// the bytes — are all-reduced whole, as PyTorch's `powerSGD_hook` and
/// Deep Gradient Compression's reference code do. Both start after a
/// warm-up (`warmup`, else the learning-rate schedule's warm-up steps):
/// PowerSGD all-reduces plain fp32 gradients until then (PyTorch's
/// `start_powerSGD_iter`), top-k raises its sparsity exponentially to `F`
/// over it (DGC's warm-up training).
#[derive(
    Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize,
)]
pub enum Compression {
    /// fp32 gradients.
    #[default]
    None,
    /// Gradients rounded to bfloat16 before they are sent.
    Bf16,
    /// Gradients rounded to IEEE half before they are sent.
    Fp16,
    /// PowerSGD (Vogels et al. 2019): each matrix gradient sent as two
    /// rank-`rank` factors, with error feedback; vectors and matrices it
    /// would not shrink twofold go uncompressed ([`powersgd_factors`]).
    PowerSgd {
        rank: u64,
        /// Steps of plain all-reduce first (`powersgd:R:W`); `None`: the
        /// learning-rate schedule's warm-up. Plans written before this
        /// field existed had none.
        #[serde(default)]
        warmup: Option<u64>,
    },
    /// Top-k with error feedback: each rank sends the `per_million`/10⁶
    /// largest-magnitude elements of each matrix gradient as (index,
    /// value) pairs.
    TopK {
        per_million: u64,
        /// Steps over which the kept fraction falls to its value
        /// (`topk:F:W`); `None`: the learning-rate schedule's warm-up.
        #[serde(default)]
        warmup: Option<u64>,
    },
}

/// PowerSGD's smallest saving: a matrix is compressed only when its
/// factors are at most half its size (PyTorch's and the authors'
/// `min_compression_rate` default): below that the two extra all-reduces
/// and GEMMs buy too little.
pub const POWERSGD_MIN_COMPRESSION_RATE: u64 = 2;

/// How PowerSGD treats a gradient of `shape`: `(rows, cols, rank)` when it
/// compresses it (rows = the first axis, columns the rest; rank capped by
/// both), else `None`: vectors, and matrices that the rank-`rank` factors
/// would not shrink [`POWERSGD_MIN_COMPRESSION_RATE`]-fold, go whole. The
/// one rule the runtime runs and the planner prices.
pub fn powersgd_factors(shape: &[u64], rank: u64) -> Option<(u64, u64, u64)> {
    let (&rows, rest) = shape.split_first()?;
    if rest.is_empty() {
        return None;
    }
    let cols: u64 = rest.iter().product();
    let r = rank.min(rows).min(cols);
    ((rows + cols) * r * POWERSGD_MIN_COMPRESSION_RATE < rows * cols).then_some((rows, cols, r))
}

/// Whether top-k sparsifies a gradient of `shape`: matrices only.
pub fn topk_sparsifies(shape: &[u64]) -> bool {
    shape.len() >= 2
}

impl Compression {
    /// The value as `compress=` writes it.
    pub fn name(self) -> String {
        let warmup = |w: Option<u64>| w.map(|w| format!(":{w}")).unwrap_or_default();
        match self {
            Compression::None => "none".into(),
            Compression::Bf16 => "bf16".into(),
            Compression::Fp16 => "fp16".into(),
            Compression::PowerSgd { rank, warmup: w } => format!("powersgd:{rank}{}", warmup(w)),
            Compression::TopK {
                per_million,
                warmup: w,
            } => {
                format!("topk:{}{}", per_million as f64 / 1e6, warmup(w))
            }
        }
    }

    /// The inverse of [`Compression::name`]; `None` for anything else.
    pub fn parse(s: &str) -> Option<Compression> {
        let s = s.trim().to_ascii_lowercase();
        let mut parts = s.split(':');
        let kind = parts.next()?;
        let value = parts.next();
        let warmup = match parts.next() {
            None => None,
            Some(w) => Some(w.parse::<u64>().ok()?),
        };
        if parts.next().is_some() {
            return None;
        }
        Some(match (kind, value) {
            ("none" | "off", None) => Compression::None,
            ("bf16", None) => Compression::Bf16,
            ("fp16", None) => Compression::Fp16,
            ("powersgd", Some(r)) => {
                let rank = r.parse::<u64>().ok().filter(|&r| r > 0)?;
                Compression::PowerSgd { rank, warmup }
            }
            ("topk", Some(f)) => {
                let f = f.parse::<f64>().ok().filter(|f| *f > 0.0 && *f <= 1.0)?;
                let per_million = (f * 1e6).round() as u64;
                (per_million > 0).then_some(Compression::TopK {
                    per_million,
                    warmup,
                })?
            }
            _ => return None,
        })
    }

    /// The fraction of elements top-k keeps once warmed up.
    pub fn topk_fraction(self) -> Option<f64> {
        match self {
            Compression::TopK { per_million, .. } => Some(per_million as f64 / 1e6),
            _ => None,
        }
    }

    /// PowerSGD's rank.
    pub fn powersgd_rank(self) -> Option<u64> {
        match self {
            Compression::PowerSgd { rank, .. } => Some(rank),
            _ => None,
        }
    }

    /// Whether each rank keeps an error-feedback state (top-k, PowerSGD).
    pub fn has_feedback(self) -> bool {
        matches!(
            self,
            Compression::PowerSgd { .. } | Compression::TopK { .. }
        )
    }

    /// Steps before the compression reaches its steady state: the explicit
    /// warm-up, else the learning-rate schedule's (the early steps, which
    /// both PyTorch's PowerSGD hook and DGC spare the compression, are the
    /// ones the schedule already treats as fragile). 0 for bf16/fp16.
    pub fn warmup_steps(self, schedule: &crate::LrSchedule) -> u64 {
        match self {
            Compression::PowerSgd { warmup, .. } | Compression::TopK { warmup, .. } => warmup
                .unwrap_or(match *schedule {
                    crate::LrSchedule::Constant => 0,
                    crate::LrSchedule::WarmupCosine { warmup, .. } => warmup,
                }),
            Compression::None | Compression::Bf16 | Compression::Fp16 => 0,
        }
    }

    /// Top-k's kept fraction at `step` of a run whose warm-up lasts
    /// `warmup` steps: `F^((step+1)/(warmup+1))` during it — DGC's
    /// exponential warm-up, from nearly dense to `F` — then `F`.
    pub fn topk_fraction_at(self, step: u64, warmup: u64) -> Option<f64> {
        let f = self.topk_fraction()?;
        Some(if step < warmup {
            f.powf((step + 1) as f64 / (warmup + 1) as f64)
        } else {
            f
        })
    }

    pub fn is_none(&self) -> bool {
        *self == Compression::None
    }
}

/// What lives in host memory instead of the device's: the optimizer state
/// (and its step, on the CPU), the weights (fetched per layer, under
/// ZeRO-3), the activations kept for backward (sent out in forward, back in
/// backward).
#[derive(
    Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize,
)]
pub struct Offload {
    pub optimizer: bool,
    pub params: bool,
    pub activations: bool,
}

impl Offload {
    pub const NONE: Offload = Offload {
        optimizer: false,
        params: false,
        activations: false,
    };

    pub fn is_none(&self) -> bool {
        *self == Offload::NONE
    }

    /// `none`, or the parts joined by `+` (`optimizer+activations`), as the
    /// `offload=` key writes them.
    pub fn name(&self) -> String {
        let parts: Vec<&str> = [
            (self.optimizer, "optimizer"),
            (self.params, "params"),
            (self.activations, "activations"),
        ]
        .iter()
        .filter(|(on, _)| *on)
        .map(|(_, n)| *n)
        .collect();
        if parts.is_empty() {
            "none".into()
        } else {
            parts.join("+")
        }
    }

    /// The inverse of [`Offload::name`].
    pub fn parse(s: &str) -> Option<Offload> {
        let mut o = Offload::NONE;
        if s == "none" {
            return Some(o);
        }
        for part in s.split('+') {
            match part {
                "optimizer" => o.optimizer = true,
                "params" => o.params = true,
                "activations" => o.activations = true,
                _ => return None,
            }
        }
        Some(o)
    }
}

fn is_off(on: &bool) -> bool {
    !*on
}

/// How the embedding, head and loss run under tensor parallelism.
#[derive(
    Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize,
)]
pub enum RootSplit {
    /// Split along the vocabulary, as the sharding e-graph finds (Megatron's
    /// vocabulary-parallel embedding and cross-entropy).
    #[default]
    Vocab,
    /// Whole on every tensor-parallel rank: what dplc's own runtime runs.
    Replicated,
}

impl RootSplit {
    pub fn name(self) -> &'static str {
        match self {
            RootSplit::Vocab => "vocab",
            RootSplit::Replicated => "replicated",
        }
    }

    fn is_vocab(&self) -> bool {
        *self == RootSplit::Vocab
    }
}

/// How weight gradients accumulate over a step's micro-batches.
#[derive(
    Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize,
)]
pub enum GradAccum {
    /// The weight-gradient GEMM accumulates into the fp32 main gradient
    /// itself (Megatron's `--gradient-accumulation-fusion`, its default).
    #[default]
    Fused,
    /// The GEMM writes a gradient in the training precision, and a separate
    /// pass adds it into the main gradient (eager PyTorch `.grad += …`, or
    /// Megatron with `--no-gradient-accumulation-fusion`): per micro-batch
    /// and parameter, read the new gradient and read and write the fp32 main one.
    Separate,
}

impl GradAccum {
    pub fn name(self) -> &'static str {
        match self {
            GradAccum::Fused => "fused",
            GradAccum::Separate => "separate",
        }
    }

    fn is_fused(&self) -> bool {
        *self == GradAccum::Fused
    }
}

/// How the elementwise ops between the GEMMs run.
#[derive(
    Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize,
)]
pub enum Elementwise {
    /// Chains of elementwise ops fused into one kernel that reads the
    /// chain's inputs and writes what leaves it (dplc's codegen,
    /// torch.compile, Megatron's fused kernels).
    #[default]
    Fused,
    /// Every elementwise op its own kernel (eager PyTorch: torchtitan
    /// without `compile`): each reads its inputs from memory and writes its
    /// outputs back.
    Eager,
}

impl Elementwise {
    pub fn name(self) -> &'static str {
        match self {
            Elementwise::Fused => "fused",
            Elementwise::Eager => "eager",
        }
    }

    fn is_fused(&self) -> bool {
        *self == Elementwise::Fused
    }
}

/// Where ZeRO-3 puts the weights it gathers and the gradients it reduces.
#[derive(
    Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize,
)]
pub enum ShardLayout {
    /// In flat buffers the parameters and gradients are views of, which the
    /// collectives read and write in place (Megatron's and DeepSpeed's
    /// buffers, FSDP1's flat parameters, dplc's runtime).
    #[default]
    Flat,
    /// Per parameter (FSDP2's DTensor parameters, torchtitan): each
    /// all-gather lands in one buffer that is then copied out into every
    /// parameter, and the gradients are copied into one buffer, cast to the
    /// reduction's precision, before each reduce-scatter. Both copies run on
    /// the compute stream.
    PerParam,
}

impl ShardLayout {
    pub fn name(self) -> &'static str {
        match self {
            ShardLayout::Flat => "flat",
            ShardLayout::PerParam => "per_param",
        }
    }

    fn is_flat(&self) -> bool {
        *self == ShardLayout::Flat
    }
}

/// How tensor-parallel communication overlaps with the GEMMs around it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub enum TpOverlap {
    /// Every collective on the critical path (Megatron 2021).
    None,
    /// Megatron's asynchronous backward: a column-parallel layer's
    /// input-gradient all-reduce runs beside its weight-gradient GEMM; with
    /// sequence parallelism the all-gather of the saved input shard beside
    /// the input-gradient GEMM and the reduce-scatter beside the weight one
    /// (the row-parallel backward's output-gradient all-gather stays exposed).
    Async,
    /// Megatron-Core's `--tp-comm-overlap` (and torchtitan's async TP) as
    /// well: forward all-gathers and row-parallel reductions are cut into
    /// `tp` chunks pipelined with their GEMM. `tp_overlap=pipe` reads as this
    /// too: Transformer Engine's chunked `pipeline` and `ring_exchange`
    /// methods differ in how they cut the GEMM, not in what the cost model
    /// prices (one chunk's transfer exposed).
    Ring,
}

impl TpOverlap {
    pub fn name(self) -> &'static str {
        match self {
            TpOverlap::None => "none",
            TpOverlap::Async => "async",
            TpOverlap::Ring => "ring",
        }
    }
}

fn no_tp_overlap() -> TpOverlap {
    TpOverlap::None
}

/// How attention's core (scores, mask, softmax, dropout, weighted sum) runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub enum AttentionKind {
    /// One kernel over blocks of queries and keys (FlashAttention-2/3): no
    /// `s × s` tensor is stored, only the output and the row log-sum-exp, and
    /// the backward recomputes the scores inside its kernel; the causal
    /// half of the blocks is skipped. Its block matmuls run at the rate the
    /// device's best fused kernel reaches (`Device::fused_attention_efficiency`:
    /// FlashAttention-3's measured forward and backward on Hopper,
    /// FlashAttention-2's on Ampere).
    Fused,
    /// The same kernel as FlashAttention-2 runs it (PyTorch SDPA's flash
    /// backend): its block matmuls at the fraction of peak FlashAttention-2
    /// reaches on the device (`Device::flash2_efficiency`), which on Hopper
    /// is well below the GEMM rate (it uses none of Hopper's asynchronous
    /// tensor-core and copy instructions).
    Flash2,
    /// The scores, softmax and dropout materialised op by op, as Megatron ran
    /// in 2021–2022 (the published rows of that time).
    Unfused,
}

impl AttentionKind {
    pub fn name(self) -> &'static str {
        match self {
            AttentionKind::Fused => "fused",
            AttentionKind::Flash2 => "flash2",
            AttentionKind::Unfused => "unfused",
        }
    }

    /// One kernel for the core (no score matrix stored), at whatever rate.
    pub fn is_fused(self) -> bool {
        matches!(self, AttentionKind::Fused | AttentionKind::Flash2)
    }
}

fn unfused() -> AttentionKind {
    AttentionKind::Unfused
}

fn overlapped() -> bool {
    true
}

fn is_overlapped(overlap: &bool) -> bool {
    *overlap
}

impl fmt::Display for Strategy {
    /// `micro-batch 1 × 256 (global batch 512, seq 8192), schedule 1f1b, ZeRO-1, …`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "micro-batch {} × {} (global batch {}, seq {}), schedule {}",
            self.micro_batch,
            self.num_micro_batches,
            self.global_batch,
            self.seq,
            self.schedule.name()
        )?;
        if self.virtual_stages > 1 {
            write!(f, " v={}", self.virtual_stages)?;
        }
        write!(
            f,
            ", ZeRO-{}, recompute {}, sequence parallel {}",
            self.zero_stage,
            self.recompute.name(),
            if self.sequence_parallel { "on" } else { "off" }
        )?;
        if !self.overlap_grad_reduce {
            f.write_str(", gradient reduction after backward")?;
        }
        write!(f, ", attention {}", self.attention.name())?;
        if self.root != RootSplit::Vocab {
            write!(f, ", root {}", self.root.name())?;
        }
        if self.grad_accum != GradAccum::Fused {
            write!(f, ", grad accumulation {}", self.grad_accum.name())?;
        }
        if self.tp_overlap != TpOverlap::None {
            write!(f, ", tp overlap {}", self.tp_overlap.name())?;
        }
        if self.fp8 {
            f.write_str(", fp8 GEMMs")?;
        }
        if self.fp8_gather {
            f.write_str(", fp8 weight gathers")?;
        }
        if self.fp8_bf16_ends > 0 {
            write!(
                f,
                ", the first and last {} layer{} in bf16",
                self.fp8_bf16_ends,
                if self.fp8_bf16_ends == 1 { "" } else { "s" }
            )?;
        }
        if !self.offload.is_none() {
            write!(f, ", offload {}", self.offload.name())?;
        }
        if self.elementwise != Elementwise::Fused {
            write!(f, ", elementwise {}", self.elementwise.name())?;
        }
        if self.shards != ShardLayout::Flat {
            write!(f, ", shards {}", self.shards.name())?;
        }
        let where_ = match self.sync.servers() {
            Some(ServerRanks::Dedicated) => " on dedicated ranks",
            _ => "",
        };
        match self.sync {
            GradSync::AllReduce => {}
            GradSync::Ps { shards, .. } => {
                write!(f, ", parameter server ({shards} shards{})", where_)?
            }
            GradSync::Async {
                shards, staleness, ..
            } => write!(
                f,
                ", async parameter server ({shards} shards{}, staleness {staleness})",
                where_
            )?,
        }
        if !self.compress.is_none() {
            write!(f, ", gradients compressed {}", self.compress.name())?;
        }
        Ok(())
    }
}

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

fn is_zero(n: &u64) -> bool {
    *n == 0
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
    #[serde(default, skip_serializing_if = "is_zero_bytes")]
    pub offload_bytes: u64,
    /// Bytes the busiest rank's link carries (one direction) per step for the
    /// data-parallel gradient reduction and, under a parameter server, the
    /// weights' return. Plans written before this field existed left it out.
    #[serde(default, skip_serializing_if = "is_zero_bytes")]
    pub dp_link_bytes: u64,
    /// Each mesh axis's communication per step: what stays on the critical
    /// path and what overlap hides. Plans written before this field existed
    /// have none (`dplc explain` then prints the totals before overlap).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub comm_by_axis: Vec<AxisComm>,
}

fn is_zero_bytes(b: &u64) -> bool {
    *b == 0
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
    /// `3 × forward FLOPs` per step (no recomputation).
    pub model_flops_per_step: f64,
    /// Model FLOPs plus the recomputed forward.
    pub hardware_flops_per_step: f64,
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
        rules::sequence_parallel(s.sequence_parallel, m.tp)
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
