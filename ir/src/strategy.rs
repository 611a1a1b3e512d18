//! What a plan chose, as plain data: the device mesh, the parallel axes
//! mapping onto the cluster's links, and the strategy's every knob (schedule,
//! recomputation, ZeRO, gradient synchronisation and compression, offload,
//! attention, overlap), with their names as `--strategy` spells them. The
//! `Plan` (`plan.rs`) holds one beside what the planner expects of it.

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
    /// The device as its cluster section described it (`accelerator(…)`),
    /// where it is not the catalog's: what a loaded plan's `device` and
    /// `memory_bytes` are checked against. Absent for a catalog device.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub custom_device: Option<crate::DeviceSpec>,
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

/// What a stage keeps of each layer for its backward: the policy, and
/// under `Full` how many layers of each chunk it covers (Megatron's
/// `--recompute-method block --recompute-num-layers N`: the first N layers
/// of each model chunk rerun their forward, the others keep everything).
/// A chunk is a stage's run of one stack's layers — each virtual stage's
/// when interleaved. The one place that says which layers are recomputed:
/// the runtime asks [`LayerRecompute::at`], the planner
/// [`LayerRecompute::recomputed`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct LayerRecompute {
    pub policy: Recompute,
    /// Under `Full`, the layers of each chunk recomputed; 0: every layer.
    pub layers: u64,
}

impl LayerRecompute {
    pub fn of(s: &Strategy) -> LayerRecompute {
        LayerRecompute {
            policy: s.recompute,
            layers: s.recompute_layers,
        }
    }

    /// Whether only some layers of a chunk are recomputed.
    pub fn is_partial(self) -> bool {
        self.policy == Recompute::Full && self.layers > 0
    }

    /// What the layer at `position` of its chunk (0: the chunk's first) does.
    pub fn at(self, position: u64) -> Recompute {
        if self.is_partial() && position >= self.layers {
            Recompute::None
        } else {
            self.policy
        }
    }

    /// How many of a chunk's `len` layers rerun their forward under `Full`.
    pub fn recomputed(self, len: u64) -> u64 {
        match self.policy {
            Recompute::Full if self.layers > 0 => self.layers.min(len),
            Recompute::Full => len,
            _ => 0,
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
    /// Under `recompute = full`, the layers of each model chunk recomputed
    /// ([`LayerRecompute`]); 0: every layer. Plans written before this field
    /// existed recomputed every layer.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub recompute_layers: u64,
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
    /// The precision of the main gradients and of their data-parallel
    /// reduction. Plans written before this field existed kept them in fp32
    /// (and are written without it while they do).
    #[serde(default, skip_serializing_if = "GradReduce::is_fp32")]
    pub grad_reduce: GradReduce,
    /// How an MoE layer's tokens reach their experts' ranks. Plans written
    /// before this field existed sent one all-to-all (and are written
    /// without it while they do).
    #[serde(default, skip_serializing_if = "Dispatch::is_all_to_all")]
    pub dispatch: Dispatch,
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
    /// PyTorch's automatic mixed precision (`torch.autocast` over fp32
    /// weights): GEMMs in the training precision, norms, softmax and the
    /// loss in fp32, an elementwise op in the wider of its operands' types,
    /// each weight cast for the forward. Prices another engine's run (dplc's
    /// runtime keeps activations in the training precision). Plans written
    /// before this field existed had none.
    #[serde(default, skip_serializing_if = "is_off")]
    pub autocast: bool,
    /// How the elementwise ops run. Plans written before this field existed
    /// fused them.
    #[serde(default, skip_serializing_if = "Elementwise::is_fused")]
    pub elementwise: Elementwise,
    /// How the cross-entropy loss runs. Plans written before this field
    /// existed fused it.
    #[serde(default, skip_serializing_if = "Loss::is_fused")]
    pub loss: Loss,
    /// Where ZeRO-3 keeps what it gathers and reduces. Plans written before
    /// this field existed kept flat buffers.
    #[serde(default, skip_serializing_if = "ShardLayout::is_flat")]
    pub shards: ShardLayout,
    /// How tensor parallelism lays out and moves activations. Plans
    /// written before this field existed priced Megatron's layers with the
    /// model's ends sequence-split under sequence parallelism, and read now
    /// as dplc's runtime's (the ends whole).
    #[serde(default, skip_serializing_if = "TpImpl::is_default")]
    pub tp_impl: TpImpl,
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

/// The precision the main gradients are accumulated and reduced in under
/// mixed precision.
#[derive(
    Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize,
)]
pub enum GradReduce {
    /// fp32 main gradients, reduced in fp32 (Megatron-LM with bf16, which
    /// forces `--accumulate-allreduce-grads-in-fp32`; torchtitan's
    /// `mixed_precision_reduce = "float32"`; FSDP's `reduce_dtype`).
    #[default]
    Fp32,
    /// Main gradients in bf16, accumulated and reduced in bf16
    /// (Megatron-Core's `grad_reduce_in_fp32=False`, as Megatron-Bridge's
    /// performance recipes set it; Megatron-LM's `--grad-reduce-in-bf16`).
    Bf16,
    /// The same in fp16, for fp16 training.
    Fp16,
}

impl GradReduce {
    pub fn name(self) -> &'static str {
        match self {
            GradReduce::Fp32 => "fp32",
            GradReduce::Bf16 => "bf16",
            GradReduce::Fp16 => "fp16",
        }
    }

    /// The half-width main gradients a model training in `precision` may
    /// keep (its own precision); none for an fp32 model.
    pub fn half_for(precision: crate::Precision) -> Option<GradReduce> {
        match precision {
            crate::Precision::Bf16 => Some(GradReduce::Bf16),
            crate::Precision::Fp16 => Some(GradReduce::Fp16),
            crate::Precision::Fp32 => None,
        }
    }

    /// Bytes of a main gradient element: what it keeps and sends.
    pub fn bytes(self) -> u64 {
        match self {
            GradReduce::Fp32 => 4,
            GradReduce::Bf16 | GradReduce::Fp16 => 2,
        }
    }

    fn is_fp32(&self) -> bool {
        *self == GradReduce::Fp32
    }
}

/// How an MoE layer's token dispatcher moves each token to the ranks of
/// its `top_k` experts (and the combine brings the outputs back).
#[derive(
    Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize,
)]
pub enum Dispatch {
    /// One all-to-all of every (token, expert) pair: a token routed to two
    /// experts on one rank, or to several on another node, travels once per
    /// expert (Megatron-Core's `alltoall` dispatcher, NCCL's all-to-all;
    /// what dplc's ranks run).
    #[default]
    AllToAll,
    /// Each token crosses to every other node holding one of its experts
    /// once, over RDMA, and is forwarded inside that node over NVLink to
    /// each rank holding one, once per rank; the combine sums on the node
    /// before sending back (DeepEP's normal kernels and HybridEP,
    /// Megatron-Core's `flex` dispatcher).
    Hierarchical,
}

impl Dispatch {
    pub fn name(self) -> &'static str {
        match self {
            Dispatch::AllToAll => "alltoall",
            Dispatch::Hierarchical => "hierarchical",
        }
    }

    fn is_all_to_all(&self) -> bool {
        *self == Dispatch::AllToAll
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

/// How the cross-entropy loss over the logits runs.
#[derive(
    Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize,
)]
pub enum Loss {
    /// One kernel reads the logits and writes the losses, its backward
    /// reads them again and writes their gradient; the log-probabilities
    /// never reach memory and the logits, in the training precision, are
    /// what backward keeps (dplc's `log_softmax_take_along`, torch.compile's
    /// loss, Liger's and Apex's fused cross-entropy).
    #[default]
    Fused,
    /// The loss in fp32, one pass over the logits at a time, as Megatron's
    /// `vocab_parallel_cross_entropy` runs it (its default until
    /// `--cross-entropy-loss-fusion`): the logits cast to fp32, then their
    /// row maximum, subtracted in place, exponentiated in place, summed, and
    /// divided in place; the fp32 softmax is what backward keeps, and the
    /// backward scales it in place and casts it back.
    Unfused,
    /// PyTorch's `F.cross_entropy` over the logits cast to fp32, eagerly,
    /// as torchtitan's train step ran it until it compiled the loss
    /// (`pred.flatten(0, 1).float()`, train.py @ 9dec370; the model's own
    /// `.float()` before it): the cast, one log-softmax kernel whose fp32
    /// output backward keeps, the target gather; backward writes the
    /// log-softmax's gradient into zeros, the log-softmax backward reads it
    /// and the kept output into a third fp32 tensor, and autograd casts
    /// that back. The logits' working set at the start of backward is three
    /// fp32 tensors of them, where a fused loss holds the logits and their
    /// gradient.
    Eager,
}

impl Loss {
    pub fn name(self) -> &'static str {
        match self {
            Loss::Fused => "fused",
            Loss::Unfused => "unfused",
            Loss::Eager => "eager",
        }
    }

    fn is_fused(&self) -> bool {
        *self == Loss::Fused
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

/// How tensor parallelism lays out the activations it shards on the
/// sequence (sequence parallelism), what its linear layers keep, and
/// whether the model's ends split along the sequence too.
#[derive(
    Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize,
)]
pub enum TpImpl {
    /// dplc's runtime: Megatron's layers (below), and the model's ends
    /// whole along the sequence on every rank — its root program
    /// all-reduces the embedding's partial sums whole and runs the final
    /// norm (and a tied head) over every token (a plan's `model` program).
    #[default]
    Dplc,
    /// Megatron's: activations sequence-first (`[s, b, h]`), so a rank's
    /// sequence shard is one contiguous block the collectives read and
    /// write in place; a column-parallel layer keeps its input's shard and
    /// gathers it again in backward for the weight gradient
    /// (`LinearWithGradAccumulationAndAsyncCommunication`). The model's
    /// ends split along the sequence as the layers do: the embedding's
    /// output reduce-scattered to sequence shards
    /// (`scatter_to_sequence_parallel_region`), the final norm on a shard,
    /// the output layer gathering its input.
    Megatron,
    /// PyTorch DTensor's (torchtitan): activations batch-first
    /// (`[b, s, h]`) sharded on dimension 1. NCCL gathers and scatters
    /// along dimension 0, so with more than one sequence in the
    /// micro-batch every all-gather is copied into place after it and
    /// every reduce-scatter's input copied into rank order before it
    /// (`all_gather_tensor`'s `_maybe_view_chunk_cat` and
    /// `reduce_scatter_tensor`'s `chunk` + `cat`, torch/distributed/
    /// _functional_collectives.py; a reduce-scatter copies at one
    /// sequence too). Autograd keeps the gathered input of a
    /// column-parallel GEMM: backward gathers nothing again unless
    /// op-level checkpointing recomputed the gather. The model's ends
    /// split along the sequence (torchtitan's plan: the embedding's output
    /// `Shard(1)`, the final norm `SequenceParallel`).
    DTensor,
}

impl TpImpl {
    pub fn name(self) -> &'static str {
        match self {
            TpImpl::Dplc => "dplc",
            TpImpl::Megatron => "megatron",
            TpImpl::DTensor => "dtensor",
        }
    }

    /// Whether sequence parallelism splits the model's ends (embedding
    /// output, final norm, loss inputs) along the sequence, as it splits a
    /// layer's activations.
    pub fn splits_ends(self) -> bool {
        self != TpImpl::Dplc
    }

    fn is_default(&self) -> bool {
        *self == TpImpl::default()
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
    /// The same kernel as FlashAttention (v1) or its Triton port runs it
    /// (what stacks of 2022–2023 ran: llm-foundry's `attn_impl: triton`,
    /// Megatron's first `--use-flash-attn`): its block matmuls at half of
    /// FlashAttention-2's rate on the device, the factor FlashAttention-2's
    /// paper measured between the two.
    Flash1,
    /// The scores, softmax and dropout materialised op by op, as Megatron ran
    /// in 2021–2022 (the published rows of that time).
    Unfused,
}

impl AttentionKind {
    pub fn name(self) -> &'static str {
        match self {
            AttentionKind::Fused => "fused",
            AttentionKind::Flash2 => "flash2",
            AttentionKind::Flash1 => "flash1",
            AttentionKind::Unfused => "unfused",
        }
    }

    /// One kernel for the core (no score matrix stored), at whatever rate.
    pub fn is_fused(self) -> bool {
        matches!(
            self,
            AttentionKind::Fused | AttentionKind::Flash2 | AttentionKind::Flash1
        )
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
            ", ZeRO-{}, recompute {}",
            self.zero_stage,
            self.recompute.name()
        )?;
        if self.recompute_layers > 0 {
            write!(
                f,
                " (the first {} layer{} of each chunk)",
                self.recompute_layers,
                if self.recompute_layers == 1 { "" } else { "s" }
            )?;
        }
        write!(
            f,
            ", sequence parallel {}",
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
        if self.grad_reduce != GradReduce::Fp32 {
            write!(f, ", gradients in {}", self.grad_reduce.name())?;
        }
        if self.dispatch != Dispatch::AllToAll {
            write!(f, ", token dispatch {}", self.dispatch.name())?;
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
        if self.autocast {
            f.write_str(", autocast")?;
        }
        if self.elementwise != Elementwise::Fused {
            write!(f, ", elementwise {}", self.elementwise.name())?;
        }
        if self.loss != Loss::Fused {
            write!(f, ", loss {}", self.loss.name())?;
        }
        if self.shards != ShardLayout::Flat {
            write!(f, ", shards {}", self.shards.name())?;
        }
        if self.tp_impl != TpImpl::default() {
            write!(f, ", tp_impl {}", self.tp_impl.name())?;
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

/// Serde's test for a count left out of a plan file when zero.
pub(crate) fn is_zero(n: &u64) -> bool {
    *n == 0
}
