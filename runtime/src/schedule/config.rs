//! What a run is asked to do: the split and its schedule, the device, the
//! process layout, faults to inject, the stop flag and the trace sink.

use super::Compute;
use crate::checkpoint::{CheckpointConfig, CheckpointKill};
use crate::error::{Result, RuntimeError};
use crate::mpi_world::MpiProcess;
use crate::params::ZeroStage;
use crate::partition::Schedule;
use crate::tcp_world::TcpProcess;
use dplc_ir::{ModelLayout, Recompute};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

/// Faults to inject, so that tests can show the checks catch them.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Faults {
    /// This rank fails (returns an error) at the start of this step.
    pub fail_rank_at: Option<(usize, u64)>,
    /// This rank panics at the start of this step.
    pub panic_rank_at: Option<(usize, u64)>,
    /// This rank's process exits at the start of this step, as a killed
    /// process would (for ranks in separate processes).
    pub exit_rank_at: Option<(usize, u64)>,
    /// This rank stops answering at the start of this step (a hung process):
    /// the others must notice within the timeout and name it.
    pub stall_rank_at: Option<(usize, u64)>,
    /// Leave out the data-parallel gradient all-reduce: a wrong plan.
    pub skip_grad_sync: bool,
    /// Take each rank's summand for the whole (the all-reduce after a
    /// row-parallel matmul, or the sum of a context-parallel reduce-scatter
    /// of K/V gradients, left out): a wrong plan.
    pub skip_tp_sum: bool,
    /// A rank dies while writing a checkpoint.
    pub kill_in_checkpoint: Option<CheckpointKill>,
    /// This rank's gradient becomes NaN in this step (as an overflow
    /// would): the run must stop there, or skip the step.
    pub nan_grad_at: Option<(usize, u64)>,
}

impl Faults {
    /// Refuse a fault that could never fire: a rank outside the world or a
    /// step outside `start..steps` would make a fault test pass vacuously.
    pub(super) fn check(&self, world: usize, start: u64, steps: u64) -> Result<()> {
        let at = [
            ("fail", self.fail_rank_at),
            ("panic", self.panic_rank_at),
            ("exit", self.exit_rank_at),
            ("stall", self.stall_rank_at),
            ("nan", self.nan_grad_at),
            (
                "checkpoint-kill",
                self.kill_in_checkpoint.map(|k| (k.rank, k.step)),
            ),
        ];
        for (kind, at) in at {
            let Some((rank, step)) = at else { continue };
            if rank >= world {
                return Err(RuntimeError::Config(format!(
                    "the {kind} fault names rank {rank}, but the run has ranks 0 to {}",
                    world - 1
                )));
            }
            // A checkpoint is saved after its step: `steps` itself is one.
            let (first, end) = if kind == "checkpoint-kill" {
                (start + 1, steps + 1)
            } else {
                (start, steps)
            };
            if !(first..end).contains(&step) {
                return Err(RuntimeError::Config(format!(
                    "the {kind} fault is at step {step}, but the run has steps {first} to {}",
                    end.saturating_sub(1)
                )));
            }
        }
        Ok(())
    }
}

/// Set from outside (Ctrl-C) to make every rank stop after the step it is in.
#[derive(Clone, Debug, Default)]
pub struct StopFlag(pub Arc<AtomicBool>);

impl StopFlag {
    pub fn stop(&self) {
        self.0.store(true, Ordering::SeqCst);
    }
    pub fn is_set(&self) -> bool {
        self.0.load(Ordering::SeqCst)
    }
}

impl PartialEq for StopFlag {
    fn eq(&self, other: &StopFlag) -> bool {
        Arc::ptr_eq(&self.0, &other.0)
    }
}

/// What one rank spent a span of wall time on, for `dplc run --trace`.
#[derive(Clone, Debug, PartialEq)]
pub struct TraceSpan {
    pub rank: usize,
    pub stage: usize,
    pub dp_index: usize,
    pub tp_index: usize,
    pub step: u64,
    /// `forward`, `backward` or `step` (gradient sync, clipping, optimizer).
    pub kind: &'static str,
    pub micro_batch: usize,
    pub chunk: usize,
    /// Microseconds since the run started.
    pub start_us: f64,
    pub duration_us: f64,
}

/// Where ranks record their spans when a trace is asked for; the default
/// records nothing (and costs one branch per span).
#[derive(Clone, Debug, Default)]
pub struct TraceSink(Option<Arc<std::sync::Mutex<Vec<TraceSpan>>>>);

impl TraceSink {
    pub fn recording() -> TraceSink {
        TraceSink(Some(Arc::default()))
    }

    pub(super) fn push(&self, span: TraceSpan) {
        if let Some(spans) = &self.0 {
            // A rank that panicked mid-push poisons the lock; the spans
            // already there are still whole.
            spans
                .lock()
                .unwrap_or_else(|poisoned| poisoned.into_inner())
                .push(span);
        }
    }

    pub(super) fn is_on(&self) -> bool {
        self.0.is_some()
    }

    /// Everything recorded so far, in start order.
    pub fn spans(&self) -> Vec<TraceSpan> {
        let mut v = match &self.0 {
            Some(spans) => spans
                .lock()
                .unwrap_or_else(|poisoned| poisoned.into_inner())
                .clone(),
            None => Vec::new(),
        };
        v.sort_by(|a, b| a.start_us.total_cmp(&b.start_us).then(a.rank.cmp(&b.rank)));
        v
    }
}

impl PartialEq for TraceSink {
    fn eq(&self, other: &TraceSink) -> bool {
        match (&self.0, &other.0) {
            (Some(a), Some(b)) => Arc::ptr_eq(a, b),
            (None, None) => true,
            _ => false,
        }
    }
}

/// Where the fused kernels of a run's ranks execute.
#[derive(Clone, Debug, Default, PartialEq)]
pub enum Device {
    /// Interpreted on the host by `HostBackend` (CPU ranks).
    #[default]
    Host,
    /// On GPUs `0..gpus`, floats stored as `dtype`: rank `r` on GPU
    /// `r mod gpus`, so several ranks may share one (pipelines and tensor
    /// parallelism on a machine with one GPU). Parameters, optimizer state
    /// and collectives stay with the executor on the host.
    Cuda { gpus: usize, dtype: dplc_ir::DType },
}

/// This process's place in a world of processes: started by mpirun, or by
/// a launcher whose ranks meet over TCP (torchrun, srun, an artifact).
#[derive(Clone, Copy, Debug)]
pub enum Process<'a> {
    Mpi(&'a MpiProcess),
    Tcp(&'a TcpProcess),
}

impl Process<'_> {
    pub fn rank(&self) -> usize {
        match self {
            Process::Mpi(p) => p.rank(),
            Process::Tcp(p) => p.rank(),
        }
    }

    pub fn size(&self) -> usize {
        match self {
            Process::Mpi(p) => p.size(),
            Process::Tcp(p) => p.size(),
        }
    }

    pub(super) fn transport(&self) -> Result<Box<dyn crate::comm::Transport>> {
        match self {
            Process::Mpi(p) => Ok(p.transport()),
            Process::Tcp(p) => p.transport(),
        }
    }
}

/// How one training run is split over ranks.
#[derive(Clone, Debug, PartialEq)]
pub struct RunConfig {
    /// Data-parallel replicas.
    pub dp: usize,
    /// Pipeline stages.
    pub pp: usize,
    /// Context-parallel ranks per data-parallel replica: each holds its
    /// load-balanced chunks of every sample's sequence (`dplc_ir::split_context`);
    /// they are weight replicas, their gradients reduced over `dp × cp`.
    pub cp: usize,
    /// Tensor-parallel ranks per stage.
    pub tp: usize,
    /// Expert-parallel ranks: experts split over groups of `ep` consecutive
    /// data-parallel replicas (`ep` divides `dp`).
    pub ep: usize,
    /// Norms, dropout and residuals split along the sequence between the
    /// tensor-parallel matmuls (Korthikanti et al. 2022).
    pub sequence_parallel: bool,
    /// The plan's per-tensor layouts: needed whenever tp or ep is above 1
    /// (the runtime never derives a layout of its own).
    pub layout: Option<ModelLayout>,
    /// Layers each pipeline stage runs (all its chunks together), as the plan
    /// balanced them; `None` (a run not made from a plan) splits evenly.
    pub stage_layers: Option<Vec<u64>>,
    /// Samples per micro-batch on one rank.
    pub micro_batch: usize,
    /// Micro-batches per step on one replica (gradient accumulation).
    pub num_micro_batches: usize,
    pub zero: ZeroStage,
    /// How replicas combine their gradients: all-reduce, a parameter
    /// server, or asynchronous updates with bounded staleness.
    pub sync: dplc_ir::GradSync,
    /// What the all-reduce sends: fp32, bf16/fp16, PowerSGD or top-k factors.
    pub compress: dplc_ir::Compression,
    pub schedule: Schedule,
    /// What each layer keeps for backward: everything (`None`), everything
    /// but the core-attention tensors, recomputed before its backward
    /// (`Selective`), or only its inputs, its forward run again (`Full`).
    pub recompute: Recompute,
    /// Under `Full`, the layers of each chunk recomputed (the first ones);
    /// 0: every layer ([`dplc_ir::LayerRecompute`]).
    pub recompute_layers: u64,
    /// How the fused compute runs each attention's core: one fused kernel
    /// (`Fused`, `Flash2`: the same kernels; the two differ in the planner's
    /// rate only) where codegen takes it, or op by op (`Unfused`), as the
    /// plan priced it.
    pub attention: dplc_ir::AttentionKind,
    /// What computes each chunk: the reference interpreter or the fused kernels.
    pub compute: Compute,
    /// Where the fused kernels run (GPUs need `Compute::Fused`).
    pub device: Device,
    /// How CPU ranks' fused compute stores float tensors: `F32` (exact, to
    /// check the kernels against the reference), or `BF16`/`F16` as a GPU
    /// run of that precision stores them (rounded, counted at their width,
    /// a kernel reading a buffer as the wrong float type refused). A GPU
    /// run's storage is its `Device::Cuda` dtype.
    pub host_storage: dplc_ir::DType,
    /// Elements per all-reduce bucket of data-parallel gradient sync.
    pub bucket_elems: usize,
    /// A rank waiting longer than this for a peer fails the run.
    pub timeout: Duration,
    /// Steps whose loss or gradient norm is not finite that may be skipped
    /// (Megatron's skip-and-continue); one more stops the run. Default 0.
    pub skip_nonfinite: u64,
    pub faults: Faults,
    pub stop: StopFlag,
    /// Records each rank's forward, backward and step spans when on.
    pub trace: TraceSink,
    /// Save checkpoints while training.
    pub checkpoint: Option<CheckpointConfig>,
    /// Start from this checkpoint (a step directory, or a checkpoint
    /// directory's latest complete step), resharded to this split; the run
    /// goes on from its step up to `steps`.
    pub resume_from: Option<PathBuf>,
}

impl Default for RunConfig {
    fn default() -> Self {
        RunConfig {
            dp: 1,
            pp: 1,
            cp: 1,
            tp: 1,
            ep: 1,
            sequence_parallel: false,
            layout: None,
            stage_layers: None,
            micro_batch: 1,
            num_micro_batches: 1,
            zero: ZeroStage::None,
            sync: dplc_ir::GradSync::AllReduce,
            compress: dplc_ir::Compression::None,
            schedule: Schedule::OneFOneB,
            recompute: Recompute::None,
            recompute_layers: 0,
            attention: dplc_ir::AttentionKind::Fused,
            compute: Compute::Reference,
            device: Device::Host,
            host_storage: dplc_ir::DType::F32,
            bucket_elems: 1 << 16,
            timeout: Duration::from_secs(60),
            skip_nonfinite: 0,
            faults: Faults::default(),
            stop: StopFlag::default(),
            trace: TraceSink::default(),
            checkpoint: None,
            resume_from: None,
        }
    }
}

impl RunConfig {
    /// The workers: ranks that run the model.
    pub fn world_size(&self) -> usize {
        self.replicas() * self.pp * self.tp
    }
    /// Every rank: the workers, then the dedicated parameter servers
    /// (`ps_ranks=dedicated`), which hold shards and the optimizer state
    /// and run no model compute. A server replica is laid out as a worker
    /// replica is — a rank per pipeline stage and tensor-parallel part, at
    /// data-parallel index `replicas() + s` — so rank numbering and a
    /// stage's data-parallel group extend past the workers unchanged.
    pub fn ranks(&self) -> usize {
        (self.replicas() + self.server_replicas()) * self.pp * self.tp
    }
    /// The pipeline stage `rank` runs: ranks are laid out as
    /// `(dp_index · pp + stage) · tp + tp_index`.
    pub fn stage_of(&self, rank: usize) -> usize {
        (rank / self.tp.max(1)) % self.pp.max(1)
    }
    /// The GPU `rank` runs on (`None` on the host): ranks go round the
    /// GPUs, so with fewer GPUs than ranks several share one.
    pub fn gpu_of(&self, rank: usize) -> Option<usize> {
        match self.device {
            Device::Host => None,
            Device::Cuda { gpus, .. } => Some(rank % gpus.max(1)),
        }
    }
    /// Dedicated server replicas (0 unless `ps_ranks=dedicated`).
    pub fn server_replicas(&self) -> usize {
        self.sync.dedicated_servers() as usize
    }
    /// Weight replicas: every data- and context-parallel rank of a stage,
    /// over which gradients are reduced and ZeRO shards the states.
    /// What each layer keeps for its backward.
    pub fn layer_recompute(&self) -> dplc_ir::LayerRecompute {
        dplc_ir::LayerRecompute {
            policy: self.recompute,
            layers: self.recompute_layers,
        }
    }

    pub fn replicas(&self) -> usize {
        self.dp * self.cp
    }
    pub fn global_batch(&self) -> usize {
        self.dp * self.micro_batch * self.num_micro_batches
    }

    /// The split a plan describes: its mesh, ZeRO stage, micro-batches,
    /// pipeline schedule, recompute, sequence parallelism and layouts.
    pub fn from_plan(plan: &dplc_ir::Plan) -> Result<RunConfig> {
        let (m, s) = (&plan.mesh, &plan.strategy);
        let zero = match s.zero_stage {
            0 => ZeroStage::None,
            1 => ZeroStage::One,
            2 => ZeroStage::Two,
            3 => ZeroStage::Three,
            z => {
                return Err(RuntimeError::Config(format!(
                    "ZeRO stage {z} does not exist"
                )))
            }
        };
        let schedule = match s.schedule {
            dplc_ir::PipelineSchedule::GPipe => Schedule::GPipe,
            dplc_ir::PipelineSchedule::OneFOneB => Schedule::OneFOneB,
            dplc_ir::PipelineSchedule::Interleaved => Schedule::Interleaved {
                chunks: s.virtual_stages.max(1) as usize,
            },
        };
        Ok(RunConfig {
            dp: m.dp as usize,
            pp: m.pp as usize,
            cp: m.cp as usize,
            tp: m.tp as usize,
            ep: m.ep as usize,
            sequence_parallel: s.sequence_parallel,
            layout: plan.layout.clone(),
            stage_layers: (m.pp > 1).then(|| plan.stage_layers()),
            micro_batch: s.micro_batch as usize,
            num_micro_batches: s.num_micro_batches as usize,
            zero,
            sync: s.sync,
            compress: s.compress,
            schedule,
            recompute: s.recompute,
            recompute_layers: s.recompute_layers,
            attention: s.attention,
            ..RunConfig::default()
        })
    }
}
