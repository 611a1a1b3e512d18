//! Typed `train` and `cluster` sections: what the frontend reads from a .dpl
//! file and what plans record. Units are SI base units (bytes/s, seconds).

use serde::{Deserialize, Serialize};

/// Precision of weights and activations in training (mixed precision keeps
/// fp32 master weights and optimizer states whatever this says).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum Precision {
    Fp32,
    Bf16,
    Fp16,
}

impl Precision {
    pub fn name(self) -> &'static str {
        match self {
            Precision::Fp32 => "fp32",
            Precision::Bf16 => "bf16",
            Precision::Fp16 => "fp16",
        }
    }

    pub fn from_name(name: &str) -> Option<Precision> {
        match name {
            "fp32" | "f32" => Some(Precision::Fp32),
            "bf16" => Some(Precision::Bf16),
            "fp16" | "f16" => Some(Precision::Fp16),
            _ => None,
        }
    }

    /// Bytes of one activation element.
    pub fn bytes(self) -> u64 {
        match self {
            Precision::Fp32 => 4,
            Precision::Bf16 | Precision::Fp16 => 2,
        }
    }
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub enum Optimizer {
    /// AdamW with decoupled weight decay (Loshchilov & Hutter).
    AdamW {
        lr: f64,
        beta1: f64,
        beta2: f64,
        eps: f64,
        weight_decay: f64,
    },
    Sgd {
        lr: f64,
        momentum: f64,
    },
}

impl Optimizer {
    pub fn lr(&self) -> f64 {
        match self {
            Optimizer::AdamW { lr, .. } | Optimizer::Sgd { lr, .. } => *lr,
        }
    }
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub enum LrSchedule {
    Constant,
    /// Linear warmup over `warmup` steps, then cosine decay to
    /// `min_ratio × lr` at step `total`, flat after.
    WarmupCosine {
        warmup: u64,
        total: u64,
        min_ratio: f64,
    },
}

impl LrSchedule {
    /// The multiplier of the base learning rate at `step` (0-based).
    pub fn factor(&self, step: u64) -> f64 {
        match *self {
            LrSchedule::Constant => 1.0,
            LrSchedule::WarmupCosine {
                warmup,
                total,
                min_ratio,
            } => {
                if step < warmup {
                    (step + 1) as f64 / warmup as f64
                } else if step >= total {
                    min_ratio
                } else {
                    let progress = (step - warmup) as f64 / (total - warmup).max(1) as f64;
                    let cosine = 0.5 * (1.0 + (std::f64::consts::PI * progress).cos());
                    min_ratio + (1.0 - min_ratio) * cosine
                }
            }
        }
    }
}

/// The `train` section of a model: its published training configuration.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TrainSpec {
    pub seq: u64,
    pub global_batch: u64,
    pub precision: Precision,
    pub optimizer: Optimizer,
    pub schedule: LrSchedule,
    /// Clip gradients to this global L2 norm.
    pub grad_clip: Option<f64>,
    pub steps: Option<u64>,
}

impl Default for TrainSpec {
    fn default() -> Self {
        TrainSpec {
            seq: 1024,
            global_batch: 8,
            precision: Precision::Bf16,
            optimizer: Optimizer::AdamW {
                lr: 3e-4,
                beta1: 0.9,
                beta2: 0.95,
                eps: 1e-8,
                weight_decay: 0.1,
            },
            schedule: LrSchedule::Constant,
            grad_clip: Some(1.0),
            steps: None,
        }
    }
}

/// One kind of link: its bandwidth per device per direction and its latency.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct LinkSpec {
    /// `nvswitch`, `nvlink`, `pcie`, `infiniband`, `ethernet`, `shm`.
    pub kind: String,
    pub bandwidth_bytes_per_s: f64,
    pub latency_s: f64,
}

/// An accelerator described in a cluster section instead of named from the
/// catalog (`device = accelerator(name = "MI355X", bf16 = 2300 TFLOP/s, …)`):
/// hardware as data, for devices the catalog does not know.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct DeviceSpec {
    pub name: String,
    /// Dense peak FLOP/s for matmuls, by precision.
    pub peak_bf16: f64,
    pub peak_fp16: f64,
    pub peak_fp32: f64,
    /// Dense FP8 peak for matmuls; 0: no FP8 tensor cores.
    #[serde(default)]
    pub peak_fp8: f64,
    /// Host memory per device (its share of the node's), bytes; 0: none to offload to.
    #[serde(default)]
    pub host_memory_bytes: u64,
    /// The device–host link per direction, bytes/s (PCIe, NVLink-C2C).
    #[serde(default)]
    pub host_link_bandwidth: f64,
    /// Host memory bandwidth per device (its share), bytes/s: what an
    /// offloaded optimizer step on the CPU runs at.
    #[serde(default)]
    pub host_memory_bandwidth: f64,
    pub memory_bytes: u64,
    /// Device memory bandwidth, bytes/s.
    pub memory_bandwidth: f64,
    /// The fraction of peak large matmuls sustain; `None` takes the planner's default.
    pub matmul_efficiency: Option<f64>,
    /// The fraction of the FP8 peak FP8 matmuls sustain (`fp8=on`); `None`
    /// takes the matmul efficiency.
    #[serde(default)]
    pub fp8_matmul_efficiency: Option<f64>,
    /// The fraction of peak FlashAttention-2's forward reaches
    /// (`attention=flash2`); `None` takes the matmul efficiency.
    #[serde(default)]
    pub flash2_efficiency: Option<f64>,
    /// The same for its backward; `None` takes the forward's.
    #[serde(default)]
    pub flash2_backward_efficiency: Option<f64>,
    /// The fraction of peak the device's fused attention forward reaches
    /// (`attention=fused`); `None` takes the matmul efficiency.
    #[serde(default)]
    pub fused_attention_efficiency: Option<f64>,
    /// The same for its backward; `None` takes the forward's.
    #[serde(default)]
    pub fused_attention_backward_efficiency: Option<f64>,
    /// The fraction of peak a GEMM sustains when a row of an operand or of
    /// its output is not a whole number of 16-byte pieces and the stack
    /// does not pad it (`elementwise=eager`); `None` takes the matmul
    /// efficiency (no penalty).
    #[serde(default)]
    pub unaligned_matmul_efficiency: Option<f64>,
    /// Picoseconds a FlashAttention-2 kernel's forward spends on the
    /// dropout of each attended score; `None`: not priced.
    #[serde(default)]
    pub attention_dropout_forward_ps: Option<f64>,
    /// The same for its backward; `None` takes the forward's.
    #[serde(default)]
    pub attention_dropout_backward_ps: Option<f64>,
    /// Streaming multiprocessors (compute units) for wave quantization; 0: none.
    pub multiprocessors: u64,
}

/// A `cluster` section: nodes of identical devices joined by two kinds of link.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ClusterSpec {
    pub name: String,
    pub nodes: u64,
    pub devices_per_node: u64,
    /// A device name for the planner's catalog, e.g. `A100_80GB` (with
    /// `custom_device`, that device's own name).
    pub device: String,
    /// The device described in the section rather than named.
    #[serde(default)]
    pub custom_device: Option<DeviceSpec>,
    /// Links inside a node; `None` takes the device's default.
    pub intra_node: Option<LinkSpec>,
    /// Links between nodes; `None` takes the device's default.
    pub inter_node: Option<LinkSpec>,
}

impl ClusterSpec {
    pub fn world_size(&self) -> u64 {
        self.nodes * self.devices_per_node
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn warmup_cosine_reaches_the_minimum_ratio() {
        let s = LrSchedule::WarmupCosine {
            warmup: 10,
            total: 110,
            min_ratio: 0.1,
        };
        assert_eq!(s.factor(0), 0.1);
        assert_eq!(s.factor(9), 1.0);
        assert!((s.factor(10) - 1.0).abs() < 1e-12);
        assert!((s.factor(60) - 0.55).abs() < 1e-12);
        assert!((s.factor(110) - 0.1).abs() < 1e-12);
        assert_eq!(s.factor(500), 0.1);
    }
}
