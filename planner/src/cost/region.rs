//! What one layer (or the embedding, a stack's lead-in, the head) costs a
//! rank for one micro-batch: its GEMMs at the device's sustained rate with
//! tile and wave quantisation, its memory-bound passes, its attention as
//! the configured kernel runs it, its tensor-, context- and
//! expert-parallel collectives, and what it keeps for backward under each
//! recompute policy.

use super::comm::{collective_time, dispatch_time, exposed_tp, TpExposure};
use super::{Config, CostModel, Part, PassCost, KERNEL_OVERHEAD_S, MEMORY_EFFICIENCY};
use crate::cluster::FLASH2_OVER_FLASH1;
use crate::profile::{Bind, RegionProfile, Work};
use crate::sharding::{GemmSplit, Pass, TpCollectiveKind};
use dplc_ir::{AttentionKind, CollectiveKind, Elementwise, Loss, MeshAxis, Recompute, TpImpl};
use fxhash::FxHashMap as HashMap;

/// Whether a row of `len` elements of `elt` bytes is a whole number of
/// 16-byte pieces, the alignment a GEMM's fast kernels load (Hopper's
/// tensor memory accelerator needs 16-byte strides).
fn whole_pieces(len: f64, elt: f64) -> bool {
    let per = 16.0 / elt;
    len.fract() == 0.0 && (len / per).fract() == 0.0
}

/// The copies DTensor's tensor parallelism (`TpImpl::DTensor`) makes of a
/// sequence-parallel collective's whole tensor to move its rank's sequence
/// shard into place: NCCL gathers and scatters along dimension 0, and a
/// batch-first activation holds a rank's positions of every sequence in
/// as many pieces. A reduce-scatter's input is copied into rank order
/// before it (`chunk` + `cat`, at one sequence too); an all-gather's output
/// is copied out after it, unless the micro-batch holds one sequence and
/// the pieces are already in place (`_maybe_view_chunk_cat` returns a
/// view). A reduction under sequence parallelism is a reduce-scatter and an
/// all-gather. torchtitan's async TP (`tp_overlap=ring`) fuses each
/// collective with its GEMM, which reads and writes the shards where they
/// lie: no copy.
fn dtensor_layout_copies(col: &crate::profile::CollectiveCost, c: &Config) -> f64 {
    if !c.sp || c.tp <= 1 || c.tp_overlap == dplc_ir::TpOverlap::Ring {
        return 0.0;
    }
    let gather = if c.micro_batch > 1 { 1.0 } else { 0.0 };
    match col.kind {
        TpCollectiveKind::AllReduce => 1.0 + gather,
        TpCollectiveKind::AllGather if col.sequence_parallel_only => gather,
        TpCollectiveKind::AllGather | TpCollectiveKind::RowStats => 0.0,
    }
}

/// Output tiles cuBLAS uses for large bf16/fp16 GEMMs on sm80/sm90; it picks
/// the one that wastes least (NVIDIA, "Matrix Multiplication Background User's
/// Guide": tile and wave quantization).
const GEMM_TILES: [(f64, f64); 2] = [(256.0, 128.0), (128.0, 128.0)];

/// The fraction of the machine a GEMM with an `m × n` output keeps busy: tiles
/// are rounded up to whole tiles (tile quantization) and run in waves of one
/// tile per multiprocessor (wave quantization).
pub(crate) fn wave_efficiency(m: f64, n: f64, multiprocessors: u64) -> f64 {
    if multiprocessors == 0 || m <= 0.0 || n <= 0.0 {
        return 1.0;
    }
    let sms = multiprocessors as f64;
    GEMM_TILES
        .iter()
        .map(|&(tm, tn)| {
            let tiles = (m / tm).ceil() * (n / tn).ceil();
            let waves = (tiles / sms).ceil();
            (m * n) / (waves * sms * tm * tn)
        })
        .fold(0.0, f64::max)
}

/// Seconds a GEMM of `flops` with an `m × n` output tile grid takes on
/// `dev` at the tensor-core rate `rate`, moving `bytes`: its waves of
/// tiles at that rate or its bytes at the sustained bandwidth, whichever is
/// longer, and a launch.
pub(crate) fn gemm_seconds(
    dev: &crate::cluster::Device,
    rate: f64,
    m: f64,
    n: f64,
    flops: f64,
    bytes: f64,
) -> f64 {
    let waves = wave_efficiency(m, n, dev.multiprocessors);
    let compute = flops / (rate * waves);
    let memory = bytes / (dev.memory_bandwidth * MEMORY_EFFICIENCY);
    compute.max(memory) + KERNEL_OVERHEAD_S
}

/// The query × key tile a fused attention kernel computes at once, for
/// head dimension 128 (the Llama and Mistral shape): FlashAttention-2 on
/// sm80 runs 128 × 64 (Dao-AILab/flash-attention
/// `csrc/flash_attn/src/flash_fwd_launch_template.h`, `run_mha_fwd_hdim128`),
/// FlashAttention-3 on sm90 128 × 128 when causal or windowed
/// (`hopper/tile_size.h`, `tile_size_fwd_sm90`), FlashAttention's Triton
/// port 128 × 128 (`flash_attn/flash_attn_triton.py`, `BLOCK = 128`).
fn fused_tile(kind: AttentionKind) -> (u64, u64) {
    match kind {
        AttentionKind::Flash2 => (128, 64),
        AttentionKind::Fused | AttentionKind::Flash1 | AttentionKind::Unfused => (128, 128),
    }
}

/// Key positions, summed over a sequence of `seq` queries, that a fused
/// kernel with `(queries, keys)` tiles computes: each block of queries
/// visits the key tiles from the first its window reaches (from 0 without
/// one) to the one holding its last query (the last key without a causal
/// mask), every visited tile whole.
fn visited_pairs(seq: u64, causal: bool, window: Option<u64>, tile: (u64, u64)) -> f64 {
    let (tq, tk) = (tile.0.max(1), tile.1.max(1));
    let mut pairs = 0.0;
    let mut q0 = 0;
    while q0 < seq {
        let q1 = (q0 + tq).min(seq);
        let begin = window.map_or(0, |w| (q0 + 1).saturating_sub(w) / tk * tk);
        let end = if causal {
            ((q1).div_ceil(tk) * tk).min(seq)
        } else {
            seq
        };
        pairs += (q1 - q0) as f64 * end.saturating_sub(begin) as f64;
        q0 = q1;
    }
    pairs
}

/// The share of the `seq × seq` query-key pairs a causal mask and a
/// sliding window keep: the attention the model's function needs, which
/// model FLOPs count (`report::step_flops`). A causal mask keeps
/// `seq (seq + 1) / 2` pairs, a hair over half.
pub(crate) fn kept_share(seq: u64, causal: bool, window: Option<u64>) -> f64 {
    if seq == 0 {
        return 1.0;
    }
    visited_pairs(seq, causal, window, (1, 1)) / (seq as f64 * seq as f64)
}

/// The share of the `seq × seq` scores a fused attention kernel's time
/// follows: 1 unmasked, ½ causal (its block matmuls' rates are measured
/// with the causal half counted, FlashAttention's benchmark convention, so
/// the diagonal tiles' waste is inside the rate), and under a sliding
/// window the causal share scaled by the tiles the kernel visits with the
/// window against without it: it skips the key tiles wholly behind the
/// window as it skips those above the diagonal (FlashAttention's local
/// attention, dplc's own kernel: `key_range` in codegen).
pub(crate) fn attended_share(seq: u64, causal: bool, window: Option<u64>, tile: (u64, u64)) -> f64 {
    let base = if causal { 0.5 } else { 1.0 };
    match window {
        Some(w) if w < seq => {
            let all = visited_pairs(seq, causal, None, tile);
            if all <= 0.0 {
                return base;
            }
            base * visited_pairs(seq, causal, Some(w), tile) / all
        }
        _ => base,
    }
}

/// Bytes per logit of each kernel an unfused cross-entropy runs, forward
/// and backward, over logits of `e` bytes: Megatron's
/// `vocab_parallel_cross_entropy` (megatron/core/tensor_parallel/cross_entropy.py,
/// core_r0.8.0 to core_v0.12.0), pass by pass. Forward: the cast to fp32
/// (read `e`, write 4; none when the logits are fp32), the row maximum
/// (read 4), the maximum subtracted in place (read and write 4), `exp` in
/// place (4 + 4), the row sum (4), the division by it in place (4 + 4):
/// 36 + `e` bytes at bf16's 2. Backward: the kept softmax scaled by the
/// loss's gradient in place (4 + 4) and autograd's cast of the fp32
/// gradient back to the logits' type (read 4, write `e`). The gather of
/// the target logits and the row statistics are a row's few bytes.
/// [`unfused_loss_passes`] for PyTorch's eager `F.cross_entropy` over the
/// logits cast to fp32 (`Loss::Eager`, torchtitan's): forward the cast
/// (read `e`, write 4; none for fp32 logits) and ATen's log-softmax, one
/// kernel over each row (read 4, write 4) — the target gather is a row's
/// few bytes; backward `nll_loss`'s gradient written into zeros (4), the
/// log-softmax backward reading it and the kept output and writing the
/// logits' fp32 gradient (4 + 4 + 4), and the cast back (read 4, write
/// `e`): 36 bytes a logit in bf16, against the fused loss's 6 and
/// Megatron's unfused 52. Counted from what each kernel must move, a
/// lower bound: ATen's softmax may read a long row more than once.
///
/// Over a vocabulary split by tensor parallelism (`vocab_parallel`)
/// PyTorch runs the same call through DTensor's `loss_parallel` handlers
/// (torch/distributed/tensor/parallel/loss.py; torchtitan enables them
/// under TP unless `disable_loss_parallel`), written op by op: forward the
/// cast, the row maximum (4), `x − max` (4 + 4), `exp` (4 + 4) and its sum
/// (4), `shifted − logsumexp` (4 + 4); backward `zeros_like` (4), `exp` of
/// the kept output (4 + 4), their sum (4 + 4 + 4), the product with the
/// loss's gradient (4 + 4) and the cast back: 76 bytes a bf16 logit.
fn eager_loss_passes(e: f64, vocab_parallel: bool) -> (Vec<f64>, Vec<f64>) {
    let cast = e < 4.0;
    let mut forward = Vec::new();
    if cast {
        forward.push(e + 4.0);
    }
    let mut backward = if vocab_parallel {
        forward.extend([4.0, 8.0, 8.0, 4.0, 8.0]);
        vec![4.0, 8.0, 12.0, 8.0]
    } else {
        forward.push(8.0);
        vec![4.0, 12.0]
    };
    if cast {
        backward.push(4.0 + e);
    }
    (forward, backward)
}

/// Bytes a logit an eager loss holds beside its kept fp32 log-probabilities
/// at its peak, the start of backward: ATen's `nll_loss` gradient and the
/// log-softmax backward's output (two fp32 tensors); DTensor's
/// `loss_parallel` backward the zeros, `exp` of the output and their sum
/// (three), more than its forward's temporaries (the cast, `x − max` and
/// `exp` beside the logits: `e` + 8 beyond the output).
fn eager_loss_working_set(vocab_parallel: bool) -> f64 {
    if vocab_parallel {
        12.0
    } else {
        8.0
    }
}

fn unfused_loss_passes(e: f64) -> (Vec<f64>, Vec<f64>) {
    let cast = e < 4.0;
    let mut forward = Vec::new();
    if cast {
        forward.push(e + 4.0);
    }
    forward.extend([4.0, 8.0, 8.0, 4.0, 8.0]);
    let mut backward = vec![8.0];
    if cast {
        backward.push(4.0 + e);
    }
    (forward, backward)
}

impl CostModel<'_> {
    fn gemm_time(&self, m: f64, n: f64, flops: f64, bytes: f64) -> f64 {
        let rate = self.peak_flops * self.cluster.device.matmul_efficiency;
        self.gemm_time_at(rate, m, n, flops, bytes)
    }

    /// A GEMM's time at the sustained tensor-core rate `rate` (the training
    /// precision's, or FP8's).
    fn gemm_time_at(&self, rate: f64, m: f64, n: f64, flops: f64, bytes: f64) -> f64 {
        gemm_seconds(&self.cluster.device, rate, m, n, flops, bytes)
    }

    fn memory_time(&self, bytes: f64) -> f64 {
        bytes / (self.cluster.device.memory_bandwidth * MEMORY_EFFICIENCY) + KERNEL_OVERHEAD_S
    }

    fn region(&self, part: Part) -> &RegionProfile {
        match part {
            Part::Layer(i) => &self.profile.stacks[i].layer,
            Part::LeadIn(i) => &self.profile.stacks[i].lead_in,
            Part::Pre => &self.profile.pre,
            Part::Post => &self.profile.post,
        }
    }

    pub(super) fn region_cost(&self, c: &Config, part: Part) -> PassCost {
        let r = self.region(part);
        let bind = self.bind(c);
        let tp = c.tp as f64;
        // What sequence parallelism splits here (`Config::splits_sequence`).
        let rep_div = if c.splits_sequence(part.place()) {
            tp
        } else {
            1.0
        };
        let elt = self.profile.precision.bytes() as f64;
        let mut pc = PassCost::default();
        let mut core_forward = 0.0;
        let fused = c.attention.is_fused();
        // FP8 covers the layers' linear GEMMs only: the embedding, the output
        // layer and the attention core stay in the training precision, as
        // Transformer Engine's layers run them.
        let fp8 = c.fp8 && matches!(part, Part::Layer(_));
        let fp8_rate = self.cluster.device.peak_fp8 * self.cluster.device.fp8_matmul_efficiency;
        let (mut attention_flops, mut attention_bytes) = (0.0, 0.0);
        // Scores the kernel draws a dropout for; FlashAttention-3 has no
        // dropout, so with one the stack runs FlashAttention-2.
        let dropped = if fused {
            bind.eval(&r.attention_dropout.sharded) / tp
                + bind.eval(&r.attention_dropout.replicated) / rep_div
        } else {
            0.0
        };
        let kind = match c.attention {
            AttentionKind::Fused if dropped > 0.0 => AttentionKind::Flash2,
            kind => kind,
        };
        // The attention FLOPs a fused kernel's time follows: each matmul's
        // share of the pairs its mask lets the kernel visit.
        let mut attended_flops = 0.0;
        // Each GEMM's forward time: what tensor-parallel collectives hide behind.
        let mut gemm_times: HashMap<dplc_ir::NodeId, f64> = HashMap::default();
        // Op-level checkpointing (torchtitan's `op`): the forward it redoes,
        // the GEMM outputs and the attention output it keeps instead.
        let (mut weight_gemms, mut op_recompute, mut op_saved) = (0u32, 0.0, 0.0);
        let whole_bind = Bind { cp: 1.0, ..bind };
        // A loss in fp32 pass by pass replaces the fused loss's two ops.
        let pass_by_pass_loss = c.loss != Loss::Fused;
        for op in &r.ops {
            if pass_by_pass_loss && op.cross_entropy {
                // Priced below, pass by pass.
                continue;
            }
            // What every cp rank runs on the whole sequence costs it whole.
            let bind = if op.whole_sequence { whole_bind } else { bind };
            if fused && op.attention_core {
                // One fused kernel does the core: its two matmuls' work, and
                // traffic of Q, K, V and the output only; the scale, mask,
                // softmax and dropout happen in registers.
                if let Work::Gemm { m, n, k, split, .. } = &op.work {
                    let div = if *split == GemmSplit::Replicated {
                        1.0
                    } else {
                        tp
                    };
                    let (m, n, k) = bind.eval_gemm(m, n, k);
                    let flops = 2.0 * m * n * k / div;
                    attention_flops += flops;
                    let mask = op.mask;
                    let length = mask.length(self.seq);
                    attended_flops +=
                        flops * attended_share(length, mask.causal, mask.window, fused_tile(kind));
                    // Q·Kᵀ reads Q and K, P·V reads V and writes O: each of
                    // them rows × head width, the smaller of the two sides.
                    attention_bytes += 2.0 * m * n.min(k) * elt / div;
                    if n <= k {
                        // P·V: its output is the kernel's, which op-level
                        // checkpointing keeps.
                        op_saved += m * n * elt / div;
                    }
                }
                continue;
            }
            // Op-level checkpointing keeps the output of every other weight
            // GEMM (the 1st, 3rd, …: torchtitan counts `mm`s and saves all
            // but every second one) and recomputes everything else.
            let mut kept_by_op = false;
            if let Work::Gemm { m, n, split, .. } = &op.work {
                if !op.attention_core {
                    weight_gemms += 1;
                    if weight_gemms % 2 == 1 {
                        kept_by_op = true;
                        // The output as the GEMM writes it: a column (or
                        // batch) split writes its shard, a row split the
                        // whole partial sum.
                        let out_div = match split {
                            GemmSplit::Column | GemmSplit::Batch => tp,
                            GemmSplit::Row | GemmSplit::Replicated => 1.0,
                        };
                        op_saved += bind.eval(m) * bind.eval(n) * elt / out_div;
                    }
                }
            }
            let (fwd, bwd) = match &op.work {
                Work::Gemm {
                    m,
                    n,
                    k,
                    split,
                    backward_gemms,
                    autocast_casts,
                } => {
                    // Eager autocast casts an fp32 operand before the GEMM,
                    // and its gradient back in backward.
                    let casts = if c.autocast && c.elementwise == Elementwise::Eager {
                        let whole_div = if op.experts { 1.0 } else { rep_div };
                        let bytes = bind.eval(&autocast_casts.sharded) / tp
                            + bind.eval(&autocast_casts.replicated) / whole_div;
                        if bytes > 0.0 {
                            self.memory_time(bytes)
                        } else {
                            0.0
                        }
                    } else {
                        0.0
                    };
                    let div = if *split == GemmSplit::Replicated {
                        1.0
                    } else {
                        tp
                    };
                    let (m, n, k) = bind.eval_gemm(m, n, k);
                    let flops = 2.0 * m * n * k / div;
                    // The output tile grid each rank computes: column and batch
                    // splits narrow `n` or the batch (in `m`); a row split narrows `k`.
                    let (mt, nt) = match split {
                        GemmSplit::Column => (m, n / tp),
                        GemmSplit::Batch => (m / tp, n),
                        GemmSplit::Row | GemmSplit::Replicated => (m, n),
                    };
                    if fp8 && !op.attention_core {
                        // Transformer Engine: the operands cast to FP8 (one
                        // byte), the GEMMs at the FP8 rate, forward and both
                        // backward ones. Each cast reads the bf16 tensor and
                        // writes the FP8 one, its amax taken on the way: the
                        // input in forward; in backward the output gradient,
                        // once more transposed for the weight gradient.
                        let bytes = (m * k + k * n) / div + m * n * elt / div;
                        let t = self.gemm_time_at(fp8_rate, mt, nt, flops, bytes);
                        let cast_in = self.memory_time(m * k * (elt + 1.0) / div);
                        let cast_grad = self.memory_time(m * n * (elt + 2.0) / div);
                        gemm_times.insert(op.node, t);
                        (
                            t + cast_in + casts,
                            t * *backward_gemms as f64 + cast_grad + casts,
                        )
                    } else {
                        let bytes = (m * k + k * n + m * n) * elt / div;
                        // The rows each rank's GEMMs read and write: `n`
                        // (output, B) and `k` (A), as split.
                        let kt = if *split == GemmSplit::Row { k / tp } else { k };
                        let t = if c.elementwise == Elementwise::Eager
                            && !(whole_pieces(nt, elt) && whole_pieces(kt, elt))
                        {
                            // Nothing pads it: the unaligned kernels' rate.
                            let dev = &self.cluster.device;
                            let rate = self.peak_flops * dev.unaligned_matmul_efficiency;
                            self.gemm_time_at(rate, mt, nt, flops, bytes)
                        } else {
                            self.gemm_time(mt, nt, flops, bytes)
                        };
                        gemm_times.insert(op.node, t);
                        (t + casts, t * *backward_gemms as f64 + casts)
                    }
                }
                Work::Memory {
                    sharded,
                    replicated,
                    eager,
                    autocast,
                } => {
                    // Fused, a chain moves only what enters and leaves it;
                    // eager, every op is a kernel moving all its operands
                    // (an op inside a fused chain moves nothing of its own);
                    // under autocast, each tensor at its autocast width.
                    let (sharded, replicated) = match (c.elementwise, c.autocast) {
                        (Elementwise::Fused, false) => (sharded, replicated),
                        (Elementwise::Eager, false) => (&eager.sharded, &eager.replicated),
                        (Elementwise::Fused, true) => {
                            (&autocast[0].sharded, &autocast[0].replicated)
                        }
                        (Elementwise::Eager, true) => {
                            (&autocast[1].sharded, &autocast[1].replicated)
                        }
                    };
                    if sharded.is_zero() && replicated.is_zero() {
                        continue;
                    }
                    let whole_div = if op.experts { 1.0 } else { rep_div };
                    let bytes = bind.eval(sharded) / tp + bind.eval(replicated) / whole_div;
                    // Backward reads the output gradient and the saved inputs and
                    // writes the input gradient: about twice the forward traffic.
                    let t = self.memory_time(bytes);
                    (t, 2.0 * t)
                }
            };
            pc.forward += fwd;
            pc.backward += bwd;
            if op.attention_core {
                core_forward += fwd;
            }
            if !kept_by_op {
                op_recompute += fwd;
            }
        }
        // An unfused or eager loss's passes over the rank's logits (its
        // share of the vocabulary when tp splits it).
        let (vocab_split, logits) = if pass_by_pass_loss {
            let split = bind.eval(&r.cross_entropy.sharded) / tp;
            (
                split,
                split + bind.eval(&r.cross_entropy.replicated) / rep_div,
            )
        } else {
            (0.0, 0.0)
        };
        let vocab_parallel = tp > 1.0 && vocab_split > 0.0;
        if pass_by_pass_loss && logits > 0.0 {
            let (forward, backward) = match c.loss {
                Loss::Eager => eager_loss_passes(elt, vocab_parallel),
                _ => unfused_loss_passes(elt),
            };
            let passes =
                |bytes: &[f64]| -> f64 { bytes.iter().map(|b| self.memory_time(b * logits)).sum() };
            pc.forward += passes(&forward);
            pc.backward += passes(&backward);
        }
        // Selective recomputation redoes the unfused core; a fused kernel
        // keeps no core tensor to drop, and recomputes inside its backward.
        let mut selective = core_forward;
        if attention_flops > 0.0 {
            let dev = &self.cluster.device;
            let attended = attended_flops / attention_flops;
            let (forward, backward) = match kind {
                AttentionKind::Flash2 => (dev.flash2_efficiency, dev.flash2_backward_efficiency),
                AttentionKind::Flash1 => (
                    dev.flash2_efficiency / FLASH2_OVER_FLASH1,
                    dev.flash2_backward_efficiency / FLASH2_OVER_FLASH1,
                ),
                AttentionKind::Fused => (
                    dev.fused_attention_efficiency,
                    dev.fused_attention_backward_efficiency,
                ),
                AttentionKind::Unfused => (dev.matmul_efficiency, dev.matmul_efficiency),
            };
            let pass = |efficiency: f64| {
                (attended * attention_flops / (self.peak_flops * efficiency))
                    .max(attention_bytes / (dev.memory_bandwidth * MEMORY_EFFICIENCY))
                    + KERNEL_OVERHEAD_S
            };
            // The dropout's draws, per attended score.
            let (draw_forward, draw_backward) = dev.attention_dropout_s;
            let t = pass(forward) + attended * dropped * draw_forward;
            pc.forward += t;
            // The backward's block matmuls: Q·Kᵀ again, dV, dP, dQ and dK —
            // five to the forward's two, at the backward kernel's own rate.
            pc.backward += 2.5 * pass(backward) + attended * dropped * draw_backward;
            selective = 0.0;
        }
        let layer = matches!(part, Part::Layer(_));
        pc.recompute = match (c.recompute, layer) {
            (Recompute::Selective, true) => selective,
            (Recompute::Full, true) => pc.forward,
            (Recompute::Op, true) => op_recompute,
            _ => 0.0,
        };
        // Tensor-parallel collectives are on the critical path except where
        // `c.tp_overlap` hides them behind GEMMs (see `exposed_tp`);
        // recomputing the forward repeats the forward ones.
        let tp_link = self.link(c, MeshAxis::Tp);
        let dtensor = c.tp_impl == TpImpl::DTensor;
        for col in &r.collectives {
            if col.sequence_parallel_only && !c.sp {
                continue;
            }
            let bytes = bind.eval(&col.bytes);
            // DTensor's copies into place, each reading and writing the
            // whole tensor.
            let copies = if dtensor {
                dtensor_layout_copies(col, c) * self.memory_time(2.0 * bytes)
            } else {
                0.0
            };
            if col.sequence_parallel_only {
                if dtensor {
                    // Autograd keeps the gathered input whole beside its
                    // shard: while the layer's backward runs, and between
                    // forward and backward where nothing recomputes it.
                    let gathered = bytes * (1.0 - 1.0 / tp);
                    pc.full_saved_bytes += gathered;
                    pc.saved_bytes += gathered;
                    if !c.regathers(part.place()) {
                        continue;
                    }
                    // Recomputed, and copied into place, before the GEMMs'
                    // backward.
                    pc.recompute += copies;
                } else if !c.regathers(part.place()) {
                    // Held whole (dplc's ends): nothing to gather again.
                    continue;
                } else if c.tp > 1 {
                    pc.gather_buffer_bytes = pc.gather_buffer_bytes.max(bytes);
                }
            } else {
                match col.pass {
                    Pass::Forward => {
                        pc.forward += copies;
                        if layer && c.recompute == Recompute::Full {
                            pc.recompute += copies;
                        }
                    }
                    Pass::Backward => pc.backward += copies,
                }
            }
            let kind = match col.kind {
                TpCollectiveKind::AllReduce | TpCollectiveKind::RowStats => {
                    CollectiveKind::AllReduce
                }
                TpCollectiveKind::AllGather => CollectiveKind::AllGather,
            };
            let beside: f64 = col.beside.iter().filter_map(|n| gemm_times.get(n)).sum();
            let whole = collective_time(kind, bytes, &tp_link);
            let exposure = TpExposure {
                kind: col.kind,
                pass: col.pass,
                regather: col.sequence_parallel_only,
            };
            let t = exposed_tp(c, exposure, whole, beside);
            // Op-level checkpointing keeps the row-parallel reductions'
            // outputs (torchtitan saves `reduce_scatter`) and redoes the
            // gathers feeding the GEMMs it recomputes.
            let recomputed = match c.recompute {
                Recompute::Full => true,
                Recompute::Op => col.kind == TpCollectiveKind::AllGather,
                Recompute::None | Recompute::Selective => false,
            };
            let repeats = if col.pass == Pass::Forward && layer && recomputed {
                2.0
            } else {
                1.0
            };
            pc.comm += t * repeats;
            pc.hidden_comm += (whole - t) * repeats;
        }
        // Context parallelism: what the rank's program all-gathers along the
        // sequence in forward (K and V, above all), the gradients of those
        // with one reduce-scattered in backward, all exposed: the runtime
        // gathers K and V before the score matmul and waits, and the
        // attention that follows needs every key (a ring that overlaps
        // blocks of keys with the attention over the previous ones is not
        // what it runs).
        if c.cp > 1 {
            let cp_link = self.link(c, MeshAxis::Cp);
            let (gathered, scattered) = r.cp_traffic(&bind, tp);
            // A layer run again under full recomputation gathers again.
            let again = if layer && c.recompute == Recompute::Full {
                2.0
            } else {
                1.0
            };
            let t = again * collective_time(CollectiveKind::AllGather, gathered, &cp_link)
                + collective_time(CollectiveKind::ReduceScatter, scattered, &cp_link);
            pc.comm += t;
            pc.cp_comm += t;
        }
        if c.ep > 1 {
            let ep_link = self.link(c, MeshAxis::Ep);
            let bytes = bind.eval(&r.all_to_all_bytes) / rep_div;
            // Dispatch and combine in forward, their transposes in backward.
            let t = 2.0 * dispatch_time(c.dispatch, bytes, &ep_link, r.routing);
            pc.comm += t;
            pc.ep_comm += t;
        }
        let mut largest_core = 0.0f64;
        for s in &r.saved {
            let bytes = if c.autocast {
                &s.autocast_bytes
            } else {
                &s.bytes
            };
            let b = bind.eval(bytes)
                / match (s.sharded, s.experts) {
                    (true, _) => tp,
                    (false, true) => 1.0,
                    (false, false) => rep_div,
                };
            if fused && s.attention_core {
                largest_core = largest_core.max(b);
                continue;
            }
            // A linear layer's input is kept as the FP8 copy its GEMM read.
            let b = if fp8 && s.gemm_input { b / elt } else { b };
            // The gradient written beside the largest kept tensor is its
            // size; an unfused loss keeps the logits' fp32 softmax in their
            // place and scales it in place, but the gradient it writes
            // beside it is in the logits' type, the same as a fused loss's
            // (an eager loss's fp32 working set is counted below). The
            // eager loss keeps its fp32 log-probabilities there too.
            pc.largest_saved_bytes = pc.largest_saved_bytes.max(b);
            let b = if pass_by_pass_loss && s.logits {
                b * 4.0 / elt
            } else {
                b
            };
            pc.full_saved_bytes += b;
            if !(c.recompute == Recompute::Selective && s.attention_core) {
                pc.saved_bytes += b;
            }
        }
        if c.loss == Loss::Eager {
            pc.largest_saved_bytes = pc
                .largest_saved_bytes
                .max(eager_loss_working_set(vocab_parallel) * logits);
        }
        // A fused kernel keeps the fp32 log-sum-exp of each score row: the
        // scores' elements over the key length.
        let lse = largest_core / self.seq.max(1) as f64 * (4.0 / elt);
        pc.full_saved_bytes += lse;
        pc.saved_bytes += lse;
        if let Part::Layer(i) = part {
            let input = bind.eval(&self.profile.stacks[i].carried_bytes) / rep_div;
            match c.recompute {
                Recompute::Full => pc.saved_bytes = input,
                Recompute::Op => pc.saved_bytes = input + op_saved + lse,
                Recompute::None | Recompute::Selective => {}
            }
        }
        pc
    }
}

#[cfg(test)]
mod tests {
    use super::{attended_share, eager_loss_passes, gemm_seconds, unfused_loss_passes};
    use crate::cluster::device;

    /// XLA's measured bf16 GEMM rates on an sm_90 GPU (the H100), TFLOP/s,
    /// as `(batch, m, n, k, rate)`: openxla's default matmul performance
    /// table, `kDefaultMatmulPTable`, its `sm_90` entries
    /// (tensorflow/tensorflow third_party/xla/xla/service/gpu/model/
    /// matmul_interpolator_data.h @ 372d578bb861cc5804e56d37d93aec931a59762c),
    /// the first 72 as stored, rounded to 0.01.
    const XLA_SM90_BF16: [(u64, u64, u64, u64, f64); 72] = [
        (1, 1024, 2048, 256, 139.52),
        (2, 256, 2048, 2048, 332.25),
        (1, 256, 2048, 256, 41.84),
        (4, 512, 256, 256, 42.37),
        (1, 4096, 512, 512, 238.82),
        (4, 4096, 256, 2048, 588.67),
        (1, 512, 256, 512, 21.79),
        (2, 2048, 256, 512, 139.23),
        (2, 1024, 2048, 1024, 493.45),
        (1, 256, 2048, 4096, 285.87),
        (2, 512, 2048, 2048, 525.31),
        (4, 1024, 2048, 2048, 712.74),
        (1, 4096, 1024, 512, 343.71),
        (1, 2048, 2048, 2048, 631.98),
        (4, 256, 256, 256, 22.55),
        (2, 256, 256, 1024, 36.95),
        (1, 256, 512, 4096, 91.68),
        (1, 256, 1024, 256, 22.67),
        (1, 4096, 4096, 256, 392.16),
        (2, 256, 1024, 2048, 216.13),
        (2, 2048, 4096, 1024, 678.72),
        (2, 4096, 512, 256, 211.03),
        (2, 4096, 4096, 2048, 763.01),
        (4, 512, 2048, 1024, 487.18),
        (4, 1024, 512, 2048, 514.24),
        (1, 2048, 512, 2048, 347.71),
        (2, 512, 512, 2048, 216.48),
        (4, 4096, 512, 1024, 589.00),
        (2, 1024, 256, 256, 43.69),
        (1, 4096, 4096, 4096, 783.33),
        (1, 512, 4096, 1024, 373.35),
        (2, 256, 512, 2048, 119.62),
        (1, 512, 256, 4096, 91.06),
        (2, 2048, 256, 4096, 378.63),
        (1, 256, 1024, 4096, 172.29),
        (1, 4096, 2048, 512, 447.02),
        (1, 2048, 256, 1024, 135.85),
        (2, 512, 1024, 2048, 349.53),
        (4, 1024, 1024, 2048, 626.09),
        (4, 4096, 1024, 1024, 673.84),
        (4, 1024, 256, 1024, 218.24),
        (2, 512, 256, 1024, 66.58),
        (4, 4096, 4096, 512, 619.86),
        (1, 2048, 1024, 2048, 523.27),
        (4, 256, 2048, 1024, 358.87),
        (2, 4096, 1024, 4096, 750.61),
        (2, 1024, 256, 4096, 306.43),
        (2, 2048, 256, 256, 78.77),
        (1, 512, 256, 256, 11.46),
        (4, 512, 256, 512, 77.85),
        (1, 1024, 256, 1024, 68.34),
        (1, 4096, 256, 2048, 304.69),
        (1, 1024, 1024, 2048, 349.98),
        (4, 4096, 512, 512, 441.51),
        (2, 4096, 1024, 256, 301.61),
        (1, 256, 512, 256, 11.46),
        (2, 4096, 512, 4096, 729.69),
        (2, 1024, 4096, 1024, 596.52),
        (4, 256, 256, 512, 41.22),
        (1, 256, 4096, 2048, 324.59),
        (4, 2048, 2048, 2048, 725.75),
        (1, 1024, 512, 2048, 220.03),
        (2, 4096, 2048, 4096, 783.19),
        (4, 4096, 1024, 512, 542.04),
        (4, 4096, 4096, 256, 503.87),
        (4, 2048, 512, 2048, 621.38),
        (1, 512, 2048, 1024, 232.61),
        (1, 4096, 512, 1024, 370.77),
        (4, 512, 4096, 1024, 592.25),
        (4, 256, 256, 4096, 171.63),
        (1, 1024, 2048, 2048, 524.29),
        (2, 2048, 2048, 1024, 600.19),
    ];

    /// The GEMM model's shape terms — tile and wave quantization, the
    /// memory bound, the launch — against XLA's measured H100 GEMMs, both
    /// taken relative to the 4096³ GEMM (XLA's short runs are at boost
    /// clocks where dplc prices the sustained rate; the ratio keeps the
    /// shape's share). Training-sized GEMMs (≥ 17 GFLOP, k ≥ 1024) fall
    /// within 15% (0.87 to 1.10 of the measured rate); a short inner
    /// dimension (k ≤ 512: 1.12 to 1.26) and launch-bound shapes under
    /// 2 GFLOP are where the model is optimistic, which training's GEMMs
    /// (k the hidden width, its tp share or the tokens) seldom are.
    #[test]
    fn the_gemm_model_follows_xlas_measured_h100_shapes() {
        let dev = device("H100").unwrap();
        let top = XLA_SM90_BF16
            .iter()
            .find(|r| (r.0, r.1, r.2, r.3) == (1, 4096, 4096, 4096))
            .unwrap()
            .4
            * 1e12;
        let mut worst: f64 = 0.0;
        for &(b, m, n, k, measured) in &XLA_SM90_BF16 {
            let (rows, n, k) = ((b * m) as f64, n as f64, k as f64);
            let flops = 2.0 * rows * n * k;
            let bytes = 2.0 * (rows * k + b as f64 * k * n + rows * n);
            let predicted = flops / gemm_seconds(&dev, top, rows, n, flops, bytes) / 1e12;
            let ratio = predicted / measured;
            eprintln!("{b} × {m} × {n} × {k}: XLA {measured:6.1} TFLOP/s, dplc {predicted:6.1} ({ratio:.2})");
            if flops >= 17e9 && k >= 1024.0 {
                worst = worst.max((ratio - 1.0).abs());
            }
        }
        assert!(
            worst <= 0.15,
            "training-sized GEMMs off by {:.0}%",
            worst * 100.0
        );
    }

    /// Megatron's unfused loss over bf16 logits: six forward kernels
    /// moving 38 bytes a logit and two backward ones moving 14 (52 in all,
    /// where a fused loss moves 6); over fp32 logits no cast either way.
    #[test]
    fn the_unfused_loss_makes_megatrons_passes() {
        let total = |v: &[f64]| v.iter().sum::<f64>();
        let (forward, backward) = unfused_loss_passes(2.0);
        assert_eq!((forward.len(), total(&forward)), (6, 38.0));
        assert_eq!((backward.len(), total(&backward)), (2, 14.0));
        let (forward, backward) = unfused_loss_passes(4.0);
        assert_eq!((forward.len(), total(&forward)), (5, 32.0));
        assert_eq!((backward.len(), total(&backward)), (1, 8.0));
    }

    /// PyTorch's eager loss over bf16 logits cast to fp32: two forward
    /// kernels moving 14 bytes a logit and three backward ones moving 22
    /// (36 in all); over fp32 logits no cast either way; over a vocabulary
    /// split by tp, DTensor's op-by-op `loss_parallel` (76 in all).
    #[test]
    fn the_eager_loss_makes_pytorchs_passes() {
        let total = |v: &[f64]| v.iter().sum::<f64>();
        let (forward, backward) = eager_loss_passes(2.0, false);
        assert_eq!((forward.len(), total(&forward)), (2, 14.0));
        assert_eq!((backward.len(), total(&backward)), (3, 22.0));
        let (forward, backward) = eager_loss_passes(4.0, false);
        assert_eq!((forward.len(), total(&forward)), (1, 8.0));
        assert_eq!((backward.len(), total(&backward)), (2, 16.0));
        // DTensor's `loss_parallel`, op by op: 38 bytes each way.
        let (forward, backward) = eager_loss_passes(2.0, true);
        assert_eq!((forward.len(), total(&forward)), (6, 38.0));
        assert_eq!((backward.len(), total(&backward)), (5, 38.0));
    }

    /// `(seq, causal, window, tile, share of seq² the kernel's time follows)`.
    type Case = (u64, bool, Option<u64>, (u64, u64), f64);

    #[test]
    fn attended_share_counts_visited_tiles() {
        let cases: [Case; 7] = [
            (8192, false, None, (128, 128), 1.0),
            (8192, true, None, (128, 64), 0.5),
            // A window as long as the sequence masks nothing more.
            (8192, true, Some(8192), (128, 128), 0.5),
            // Pair by pair: 1 + 2 + 2 + 2 of the causal 1 + 2 + 3 + 4 keys.
            (4, true, Some(2), (1, 1), 0.5 * 7.0 / 10.0),
            // Whole tiles: the second block of queries reaches back into the
            // first key tile, so nothing is skipped.
            (4, true, Some(2), (2, 2), 0.5),
            // Mistral at seq 8192 under FlashAttention-3's tiles: 0.75 of the
            // causal pairs, 33 of a block's 128-key tiles once the window
            // trails it (1584 of the causal 2080 tiles).
            (8192, true, Some(4096), (128, 128), 0.5 * 1584.0 / 2080.0),
            // Without the causal mask a query sees every key ahead too.
            (8192, false, Some(4096), (128, 128), 0.87890625),
        ];
        for (seq, causal, window, tile, want) in cases {
            let got = attended_share(seq, causal, window, tile);
            assert!(
                (got - want).abs() < 1e-6,
                "seq {seq} causal {causal} window {window:?} tile {tile:?}: {got} != {want}"
            );
        }
    }
}
