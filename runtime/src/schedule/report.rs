//! What a run reports: each step, the parameters it ends with, and the
//! device it ran on.

use crate::interp::ParamKey;
use crate::tensor::Tensor;
use std::collections::BTreeMap;
use std::path::PathBuf;

/// What one step did.
#[derive(Clone, Debug, PartialEq)]
pub struct StepStats {
    pub step: u64,
    /// Mean loss over the global batch.
    pub loss: f64,
    pub lr: f64,
    /// Global gradient L2 norm before clipping.
    pub grad_norm: f64,
    pub samples_per_s: f64,
    /// Samples/s × `seq`, for a model with a sequence.
    pub tokens_per_s: Option<f64>,
    /// The loss or the gradient norm was not finite and the optimizer step
    /// was skipped (`RunConfig::skip_nonfinite`).
    pub skipped: bool,
}

/// Parameter values by (parameter, layer), with names for reports.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Parameters {
    pub values: BTreeMap<ParamKey, (String, Tensor)>,
}

impl Parameters {
    /// The largest difference relative to its tensor's scale,
    /// `max_i |a_i − b_i| / max(max_j |a_j|, floor)`, and where it is. Normwise,
    /// because an element that happens to cross zero has no relative precision
    /// of its own: its rounding error is that of the tensor's large elements.
    pub fn max_rel_diff(&self, other: &Parameters, floor: f32) -> (f32, String) {
        let mut worst = (0.0f32, String::new());
        for (k, (name, a)) in &self.values {
            let Some((_, b)) = other.values.get(k) else {
                return (f32::INFINITY, format!("{name}[layer {}] missing", k.layer));
            };
            let (Ok(a), Ok(b)) = (a.f(), b.f()) else {
                continue;
            };
            let scale = a.iter().fold(floor, |m, x| m.max(x.abs()));
            for (x, y) in a.iter().zip(b) {
                let d = (x - y).abs() / scale;
                if d > worst.0 || d.is_nan() {
                    worst = (d, format!("{name}[layer {}]", k.layer));
                }
            }
        }
        worst
    }
}

#[derive(Clone, Debug, PartialEq)]
pub struct TrainReport {
    pub steps: Vec<StepStats>,
    pub params: Parameters,
    /// The run was stopped through [`RunConfig::stop`](crate::RunConfig::stop) before its last step.
    pub interrupted: bool,
    /// The step directories of the checkpoints it saved, in order.
    pub checkpoints: Vec<PathBuf>,
    /// Layers each pipeline stage ran forward for one micro-batch (all its
    /// chunks together), counted as they ran in the first step: the plan's
    /// partition, read back from the run. Zero for a stage whose ranks run
    /// in another process, or when no step ran.
    pub stage_layers: Vec<u64>,
    /// The most activation bytes any rank held at once (every live
    /// micro-batch's kept values, measured after each forward of the run's
    /// first step; later steps repeat it): what recomputation trades for
    /// compute.
    pub peak_activation_bytes: u64,
    /// Bytes each rank moved for the data-parallel gradient reduction and
    /// the weights' return over the whole run, by rank (see
    /// [`crate::Traffic`]); zero for ranks in other processes.
    pub dp_traffic: Vec<crate::Traffic>,
    /// The most bytes any rank's compute memory held at once — training
    /// state, activations and temporaries — where its backend counts them:
    /// the fused compute, on a GPU's allocator or the host backend's
    /// buffers (`None` on the reference compute).
    pub memory_peak_bytes: Option<u64>,
    /// The most copies between host and device any rank's fused compute
    /// made over the run (uploads and downloads, its training state's
    /// included; `None` on the reference compute). Past the first step a
    /// one-rank step crosses only for its inputs, its losses and its
    /// gradient norm.
    pub host_crossings: Option<u64>,
    /// What a GPU run used of its devices (`None` on CPU ranks).
    pub device: Option<DeviceUse>,
    /// How the fused compute ran the model's attentions (`None` on the
    /// reference compute).
    pub attention: Option<AttentionUse>,
}

/// How the fused compute ran the attentions of a rank's program.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct AttentionUse {
    /// Attentions run as one fused kernel (a `repeat` body's counts once).
    pub fused: usize,
    /// Why each other attention runs op by op.
    pub unfused: Vec<String>,
}

/// What a GPU run used of its devices.
#[derive(Clone, Debug, PartialEq)]
pub struct DeviceUse {
    /// The first GPU's name, e.g. "NVIDIA H100 80GB HBM3".
    pub name: String,
    /// The most bytes any GPU's caching allocator handed out at once.
    pub peak_bytes: u64,
    /// Distinct fused kernels the program launches.
    pub kernels: usize,
    /// How the ranks summed their device-resident state.
    pub collectives: Collectives,
}

/// How GPU ranks run the collectives on their device-resident state.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Collectives {
    /// NCCL on the device buffers: every rank has a GPU of its own.
    Nccl,
    /// Copied through the host and summed by the CPU communicator: a
    /// parameter server's groups, or no NCCL library.
    HostStaged,
    /// Ranks of one process sharing a GPU: layout changes device to device
    /// on its one stream, the gradient sums through the host
    /// (`crate::params::SharedDevice`).
    SharedDevice,
}

impl Collectives {
    pub fn name(self) -> &'static str {
        match self {
            Collectives::Nccl => "nccl",
            Collectives::HostStaged => "host-staged",
            Collectives::SharedDevice => "shared-device",
        }
    }
}
