//! The memory side of the cost model: what one rank of a pipeline stage
//! holds at its peak (weights, gradients, optimizer state, kept
//! activations, the embedding and loss, and the working buffers) and which
//! stage peaks. The step time is `cost`'s; the constants here are stated
//! with their sources, the same for every model and cluster.

use crate::cost::{Config, CostModel, Parts};
use crate::profile::StackShare;
use dplc_ir::{MemoryBreakdown, PipelineSchedule, Precision, Recompute};

/// What a GPU process holds besides the plan's tensors: the CUDA context
/// (~0.5 GiB), cuBLAS workspaces and NCCL's channel buffers (tens of MiB per
/// communicator), and allocator fragmentation. Counted in `buffers`, and
/// stated as `reserve`. Measured on an H200 (bench/RESULTS.md, "The GPU check
/// on an NVIDIA H200"), the allocator's peak read 0.97–1.00× the prediction
/// less this for gpt2 and a Llama-shaped model.
const RUNTIME_RESERVE_BYTES: f64 = 1.5 * (1u64 << 30) as f64;
/// fp32 master weights and two fp32 Adam moments (Megatron; the ZeRO paper
/// counts the same 12 bytes, with 2-byte gradients, for 16 in all).
const OPTIMIZER_BYTES_MIXED: f64 = 12.0;
/// fp32 training keeps no master copy where the weights it updates are its
/// own (unsharded, or ZeRO-3's shards): two moments.
const OPTIMIZER_BYTES_FP32: f64 = 8.0;
/// Under ZeRO-1/2 an fp32 run still holds the whole weights for the compute,
/// and its optimizer updates its shard of them as a master of its own (the
/// runtime's store, as DeepSpeed's fp32 partition is a copy of the flat
/// weights), then gathers the shards back into the weights.
const OPTIMIZER_BYTES_FP32_SHARDED: f64 = 12.0;
impl CostModel<'_> {
    /// Memory of one rank of stage `i` when the stages hold `counts` layers.
    pub fn stage_memory(&mut self, c: &Config, counts: &[u64], i: u64) -> MemoryBreakdown {
        let parts = self.parts(c);
        let (pre, post) = (&parts.pre, &parts.post);
        let shares = self.stage_shares(c, counts, i as usize);
        let layers: u64 = shares.iter().map(|sh| sh.layers).sum();
        let (params, expert) = self.stage_params(c, i, &shares);
        let dense = params - expert;
        let dp = (c.dp * c.cp) as f64;
        let edp = (c.dp / c.ep).max(1) as f64;
        let shard = |stage: u8| {
            if c.zero >= stage {
                dense / dp + expert / edp
            } else {
                params
            }
        };
        let mixed = self.profile.precision != Precision::Fp32;
        let w_bytes = self.profile.precision.bytes() as f64;
        let opt_bytes = match (mixed, c.zero) {
            (true, _) => OPTIMIZER_BYTES_MIXED,
            (false, 1 | 2) => OPTIMIZER_BYTES_FP32_SHARDED,
            (false, _) => OPTIMIZER_BYTES_FP32,
        };
        let grad_bytes = c.grad_bytes(self.profile.precision);
        let flight = Self::in_flight(c, i);
        let mut embedding_and_loss = 0.0;
        if i == 0 {
            embedding_and_loss += pre.saved_bytes * flight;
        }
        if i == c.pp - 1 {
            // The head and the loss run in the pipeline's last chunk, whose
            // backward follows each micro-batch's forward at once but under
            // GPipe: one micro-batch's worth, however many the stage's
            // earlier chunks hold (interleaving).
            let last_chunk = match c.schedule {
                PipelineSchedule::GPipe => flight,
                PipelineSchedule::OneFOneB | PipelineSchedule::Interleaved => 1.0,
            };
            embedding_and_loss += post.saved_bytes * last_chunk;
        }
        let (tp, ep) = (c.tp as f64, c.ep as f64);
        let layer_weights = |k: usize| self.profile.stacks[k].layer.params.per_rank(tp, ep);
        let boundary = self.boundary_bytes(c);
        let mut buffers = 2.0 * boundary * f64::from(c.pp > 1);
        // The backward's working set beyond what is kept, at its largest
        // while the kept activations are all still held: a layer's backward
        // holds the gradient of its largest intermediate and that of the
        // op's input at once (twice its largest kept tensor). The last stage
        // starts with the loss's input gradient (the logits') beside the
        // logits it reads — dplc's kernels, as PyTorch's cross-entropy, do
        // not write it over the softmax in place as Megatron's
        // vocabulary-parallel one does — and reaches its layers' backward
        // having let go of what the loss and the head kept.
        //
        // Under sequence parallelism a backward gathers a column-parallel
        // input again into one reused buffer of the largest
        // (`Config::regathers`): live in a layer's backward beside its
        // gradients, and in the head's beside the logits' gradient — not at
        // the loss before either (added to both, the plan read gpt_tiny's
        // tp2 run on CPU ranks 2% over its peak).
        let layer_gather = Self::largest(&shares, |k| parts.stacks[k].0.gather_buffer_bytes)
            .max(pre.gather_buffer_bytes);
        let layer_backward =
            2.0 * Self::largest(&shares, |k| parts.stacks[k].0.largest_saved_bytes) + layer_gather;
        buffers += if i == c.pp - 1 {
            (post.largest_saved_bytes + post.gather_buffer_bytes)
                .max(layer_backward - post.saved_bytes)
        } else {
            layer_backward
        };
        let reserve = if self.cluster.device.multiprocessors > 0 {
            RUNTIME_RESERVE_BYTES
        } else {
            0.0
        };
        buffers += reserve;
        if matches!(c.recompute, Recompute::Full | Recompute::Op) {
            // The layer being recomputed holds its whole working set.
            buffers += Self::largest(&shares, |k| parts.stacks[k].0.full_saved_bytes);
        }
        let largest_layer = Self::largest(&shares, layer_weights);
        if c.gathers_per_layer() {
            // The gathered weights of the layer running and the next one
            // prefetched (their FP8 casts when those are what is gathered).
            let gathered = if c.gathers_fp8() { 1.0 } else { w_bytes };
            buffers += 2.0 * largest_layer * gathered;
        }
        if c.zero >= 2 && !c.holds_the_step() {
            // A layer's whole gradients, written by its backward before they
            // are reduce-scattered to the shard this rank keeps (FSDP's
            // unsharded gradients of one unit; DeepSpeed's reduce bucket).
            buffers += largest_layer * grad_bytes;
        }
        // FP8 keeps each layer weight's cast and its transpose, a byte each;
        // under ZeRO-3 a rank casts only what it holds: its shard, and the
        // gathered layers in flight (two, as the bf16 ones in `buffers`).
        let stage_weights: f64 = shares
            .iter()
            .map(|sh| sh.layers as f64 * layer_weights(sh.stack))
            .sum();
        let fp8_weights = match (c.fp8, c.gathers_per_layer()) {
            (false, _) => 0.0,
            // Gathering the casts, a rank keeps no cast of its own: the FP8
            // weights are the gathered ones (ZeRO-3, counted in `buffers`)
            // or the compute weights themselves (ZeRO-1/2, Megatron's
            // `--fp8-param-gather`, counted below); only the transposes the
            // backward reads are extra.
            _ if c.gathers_fp8() && c.gathers_per_layer() => 2.0 * largest_layer,
            _ if c.gathers_fp8() => stage_weights,
            (true, false) => 2.0 * stage_weights,
            (true, true) => 2.0 * (stage_weights / dp + 2.0 * largest_layer),
        };
        // ZeRO-1/2 gathering FP8 keeps the layers' compute weights in FP8
        // only (one byte instead of the training precision's).
        let fp8_compute_saving = if c.gathers_fp8() && !c.gathers_per_layer() {
            stage_weights * (w_bytes - 1.0)
        } else {
            0.0
        };
        // Under partial recomputation the layers it keeps hold everything.
        let kept_by = |shares: &[StackShare], parts: &Parts| -> f64 {
            shares
                .iter()
                .map(|sh| sh.layers as f64 * parts.stacks[sh.stack].0.saved_bytes)
                .sum()
        };
        let (saved, every) = if c.layer_recompute().is_partial() {
            let (rerun, kept) = self.recompute_split(c, counts, i as usize);
            let every = self.parts(&c.keeping_every_layer());
            (kept_by(&rerun, &parts) + kept_by(&kept, &every), every)
        } else {
            (kept_by(&shares, &parts), parts.clone())
        };
        // Held through the step, the whole weights and gradients sit beside
        // the shards they are gathered from and reduced into.
        let held = if c.holds_the_step() { params } else { 0.0 };
        let mut m = MemoryBreakdown {
            weights: ((shard(3) + held) * w_bytes + fp8_weights - fp8_compute_saving) as u64,
            gradients: ((shard(2) + held) * grad_bytes) as u64,
            optimizer: (shard(1) * opt_bytes) as u64,
            activations: (saved * flight) as u64,
            embedding_and_loss: embedding_and_loss as u64,
            buffers: buffers as u64,
            reserve: reserve as u64,
            host: 0,
        };
        // What the gradient synchronisation keeps, as the runtime keeps it:
        // a server holds the optimizer state of its 1/N of the parameters
        // (the busiest rank is a server; dedicated servers are not workers,
        // whose memory this is), async keeps K older weight
        // versions, top-k and PowerSGD an fp32 error per gradient element.
        if let Some(servers) = c.sync.ps_shards() {
            m.optimizer = if c.sync.dedicated_servers() > 0 {
                // The servers hold it, on their own devices: a worker none.
                0
            } else {
                (params / (servers as f64).clamp(1.0, dp) * opt_bytes) as u64
            };
        }
        m.weights += (c.sync.staleness() as f64 * params * w_bytes) as u64;
        if c.compress.has_feedback() {
            m.gradients += (params * 4.0) as u64;
        }
        let o = c.offload;
        if o.optimizer {
            // ZeRO-Offload: the fp32 master weights and moments live on the
            // host beside an fp32 copy of the gradients the CPU step reads.
            m.host += m.optimizer + (shard(1) * 4.0) as u64;
            m.optimizer = 0;
        }
        if o.params {
            // ZeRO-Infinity: the weight shards too; the device keeps only the
            // gathered layers (in `buffers`, or held through the step).
            // Never more than the rank holds: where the FP8 compute
            // weights already stand in for the training-precision ones
            // (ZeRO-1/2 gathering FP8), nothing is left to offload.
            let on_device = ((fp8_weights + held * w_bytes) as u64).min(m.weights);
            m.host += m.weights - on_device;
            m.weights = on_device;
        }
        if o.activations {
            // Each layer's saved tensors go out in forward and come back in
            // backward: the device holds the layer at work and the next.
            let on_device = Self::largest(&shares, |k| {
                parts.stacks[k]
                    .0
                    .saved_bytes
                    .max(every.stacks[k].0.saved_bytes)
            }) * (layers.min(2) as f64)
                * flight;
            m.host += m.activations.saturating_sub(on_device as u64);
            m.activations = on_device as u64;
        }
        m
    }

    /// The largest per-rank memory over the stages, and the stage it is on.
    pub fn peak_memory(&mut self, c: &Config, counts: &[u64]) -> (u64, u64) {
        let p = c.pp;
        let mut best = (0, 0);
        // Middle stages differ only in layers and in-flight micro-batches, both
        // largest nearest the start: stage 1 bounds them; check it and the ends.
        let mut idx = vec![0, p - 1];
        if p > 2 {
            idx.push(1);
            let heaviest = (1..p - 1)
                .max_by_key(|&i| (counts[i as usize], std::cmp::Reverse(i)))
                .expect("p > 2");
            idx.push(heaviest);
        }
        for i in idx {
            let m = self.stage_memory(c, counts, i).total();
            if m > best.0 {
                best = (m, i);
            }
        }
        best
    }
}
