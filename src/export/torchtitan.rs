//! The plan as a torchtitan job TOML (torchtitan v0.2.0's `JobConfig`,
//! `torchtitan/config/job_config.py`): the llama3 model (a named flavour,
//! or the `TransformerModelArgs` to register for another shape), FSDP2 /
//! DDP, tensor, context and pipeline degrees, the pipeline's model parts.

use super::arch::{Ffn, Norm, Positions, Transformer};
use super::megatron::number;
use super::{Gap, Job};
use dplc_ir::{
    AttentionKind, GradAccum, LrSchedule, Optimizer, PipelineSchedule, Plan, Precision, Recompute,
    RootSplit, TpOverlap,
};
use dplc_planner::AxisOrder;
use std::fmt::Write;

/// Why torchtitan's llama3 cannot build the model.
pub fn model_fits(t: &Transformer) -> Result<(), String> {
    let why = if t.norm != Norm::RmsNorm {
        "its norms are LayerNorm; torchtitan's llama3 uses RMSNorm"
    } else if !matches!(t.positions, Positions::Rotary { .. }) {
        "it has no rotary positions; torchtitan's llama3 uses RoPE"
    } else if matches!(t.ffn, Ffn::Moe { .. }) {
        "it is a mixture of experts; torchtitan's llama3 is dense (its MoE models route differently)"
    } else if t.ffn != Ffn::SwiGlu {
        "its FFN is not SwiGLU; torchtitan's llama3 uses SwiGLU"
    } else if t.bias.qkv || t.bias.out {
        "its attention has biases; torchtitan's llama3 has none"
    } else if t.tied {
        "its output layer is tied to the embedding; torchtitan's llama3 has its own"
    } else if t.attention_dropout != 0.0 {
        "it uses dropout; torchtitan's llama3 has none"
    } else {
        return Ok(());
    };
    Err(why.into())
}

/// The plan's choices torchtitan cannot express.
pub fn gaps(plan: &Plan, _t: &Transformer) -> Vec<Gap> {
    let s = &plan.strategy;
    let m = &plan.mesh;
    let mut gaps = Vec::new();
    gaps.extend(super::autocast_gap(plan, "torchtitan"));
    gaps.extend(super::flash1_gap(plan, "torchtitan"));
    let o = s.offload;
    // FSDP2's CPU offload: all of a ZeRO-3 rank's state, or nothing.
    let fsdp_offload = o.optimizer && o.params && !o.activations && s.zero_stage == 3;
    if !(o.is_none() || fsdp_offload) {
        gaps.push(Gap::new(
            format!(
                "offload={} (torchtitan's CPU offload moves FSDP2's parameters, gradients and \
                 optimizer state together: offload=optimizer+params with ZeRO-3)",
                o.name()
            ),
            |p| {
                p.offload = Some(dplc_ir::Offload {
                    optimizer: true,
                    params: true,
                    activations: false,
                });
                p.zero = Some(3);
            },
        ));
    }
    let chunks = dplc_ir::virtual_stage_layers(&plan.stage_layers(), plan.chunks());
    let partial = s.recompute == Recompute::Full
        && s.recompute_layers > 0
        && chunks.iter().any(|&n| n > s.recompute_layers);
    if partial && layer_ac_every(plan).is_none() {
        gaps.push(Gap::new(
            format!(
                "the first {} layers of each chunk recomputed (torchtitan's layer checkpointing \
                 reruns every N-th layer: as many only where every chunk holds N × {} layers)",
                s.recompute_layers, s.recompute_layers
            ),
            |p| p.recompute_layers = Some(0),
        ));
    }
    if m.dp > 1 && s.zero_stage == 1 {
        // Under a pipeline FSDP2 holds a stage's gathered weights and whole
        // gradients through the step (ZeRO-3 as dplc runs it there, the
        // traffic of ZeRO-1); without one, FSDP2 without resharding after
        // forward is ZeRO-2.
        let zero = if m.pp > 1 { 3 } else { 2 };
        gaps.push(Gap::new(
            "ZeRO-1 (torchtitan shards with FSDP2: gradients and optimizer state together)",
            move |p| p.zero = Some(zero),
        ));
    }
    if m.dp > 1 && m.pp > 1 && s.zero_stage == 2 {
        gaps.push(Gap::new(
            "ZeRO-2 under a pipeline (FSDP2 under pipelining keeps the gradients whole until the \
             stage's last backward: ZeRO-3 holding the step)",
            |p| p.zero = Some(3),
        ));
    }
    if s.zero_stage == 3 && s.shards == dplc_ir::ShardLayout::Flat {
        gaps.push(Gap::new(
            "ZeRO-3 in flat buffers (FSDP2 shards each parameter: it copies every all-gather out \
             into the parameters and the gradients into each reduce-scatter)",
            |p| p.shards = Some(dplc_ir::ShardLayout::PerParam),
        ));
    }
    if m.tp > 1 && s.tp_impl != dplc_ir::TpImpl::DTensor {
        gaps.push(Gap::new(
            "Megatron's tensor parallelism (torchtitan's DTensor runs batch-first: each sequence-parallel \
             collective copied into place, the gathered inputs kept)",
            |p| p.tp_impl = Some(dplc_ir::TpImpl::DTensor),
        ));
    }
    if m.dp > 1 && !s.overlap_grad_reduce {
        gaps.push(Gap::new(
            "the gradient reduction after backward (FSDP2 and DDP overlap it)",
            |p| p.overlap_grad_reduce = None,
        ));
    }
    if s.grad_reduce != dplc_ir::GradReduce::Fp32 {
        gaps.push(Gap::new(
            format!(
                "main gradients reduced in {} (torchtitan's `mixed_precision_reduce` is float32 only)",
                s.grad_reduce.name()
            ),
            |p| p.grad_reduce = None,
        ));
    }
    if s.num_micro_batches > 1 && s.grad_accum == GradAccum::Fused {
        gaps.push(Gap::new(
            "gradient accumulation fused into the GEMM (torchtitan accumulates separately)",
            |p| p.grad_accum = Some(GradAccum::Separate),
        ));
    }
    if s.attention == AttentionKind::Unfused {
        gaps.push(Gap::new(
            "unfused attention (torchtitan runs SDPA's fused kernels)",
            |p| p.attention = Some(AttentionKind::Fused),
        ));
    }
    if m.tp > 1 {
        if !s.sequence_parallel {
            gaps.push(Gap::new(
                "tensor parallelism without sequence parallelism (torchtitan shards the norms over the sequence)",
                |p| p.sequence_parallel = Some(true),
            ));
        }
        if s.tp_overlap == TpOverlap::Async {
            gaps.push(Gap::new(
                "Megatron's overlap of the input-gradient all-reduce (torchtitan exposes it, or \
                 pipelines every collective with async TP)",
                |p| p.tp_overlap = Some(TpOverlap::None),
            ));
        }
    }
    if AxisOrder::of(m) == AxisOrder::PipelineInner {
        gaps.push(Gap::new(
            "pipeline stages inside a data-parallel replica's nodes (torchtitan's mesh is pp, dp, cp, tp, outermost first)",
            |p| p.order = Some(AxisOrder::DataInner),
        ));
    }
    gaps
}

/// A llama3 flavour of torchtitan v0.2.0 (`llama3_args` in
/// `torchtitan/models/llama3/__init__.py`).
struct Flavour {
    name: &'static str,
    dim: u64,
    layers: u64,
    heads: u64,
    kv_heads: u64,
    ffn_multiplier: f64,
    multiple_of: u64,
    rope_theta: f64,
}

const FLAVOURS: &[Flavour] = &[
    Flavour {
        name: "8B",
        dim: 4096,
        layers: 32,
        heads: 32,
        kv_heads: 8,
        ffn_multiplier: 1.3,
        multiple_of: 1024,
        rope_theta: 500000.0,
    },
    Flavour {
        name: "70B",
        dim: 8192,
        layers: 80,
        heads: 64,
        kv_heads: 8,
        ffn_multiplier: 1.3,
        multiple_of: 4096,
        rope_theta: 500000.0,
    },
    Flavour {
        name: "405B",
        dim: 16384,
        layers: 126,
        heads: 128,
        kv_heads: 8,
        ffn_multiplier: 1.2,
        multiple_of: 4096,
        rope_theta: 500000.0,
    },
];

/// llama3's SwiGLU width from its arguments (`FeedForward.__init__`).
fn ffn_width(dim: u64, multiplier: f64, multiple_of: u64) -> u64 {
    let hidden = (2 * 4 * dim) / 3;
    let hidden = (multiplier * hidden as f64) as u64;
    multiple_of * hidden.div_ceil(multiple_of)
}

fn flavour(t: &Transformer) -> Option<&'static str> {
    let Positions::Rotary { theta } = t.positions else {
        return None;
    };
    FLAVOURS
        .iter()
        .find(|f| {
            (f.dim, f.layers, f.heads, f.kv_heads) == (t.d, t.layers, t.heads, t.kv_heads)
                && ffn_width(f.dim, f.ffn_multiplier, f.multiple_of) == t.ffn_hidden
                && f.rope_theta == theta
                && t.vocab == 128256
                && t.norm_eps == 1e-5
        })
        .map(|f| f.name)
}

/// `TransformerModelArgs(...)` for a shape no flavour has: a multiplier
/// that lands `ffn_width` exactly on the model's hidden width.
fn model_args(t: &Transformer) -> String {
    let base = (2 * 4 * t.d) / 3;
    let multiplier = (t.ffn_hidden as f64 + 0.5) / base as f64;
    let theta = match t.positions {
        Positions::Rotary { theta } => theta,
        _ => 10000.0,
    };
    format!(
        "TransformerModelArgs(dim={}, n_layers={}, n_heads={}, n_kv_heads={}, vocab_size={}, \
         multiple_of=1, ffn_dim_multiplier={multiplier:?}, norm_eps={}, rope_theta={})",
        t.d,
        t.layers,
        t.heads,
        t.kv_heads,
        t.vocab,
        number(t.norm_eps),
        number(theta)
    )
}

/// The N of torchtitan's layer checkpointing (`selective_ac_option = "N"`,
/// every N-th layer rerun) that recomputes as many layers as the plan's
/// partial recomputation, the first `recompute_layers` of each chunk: where
/// every chunk holds N times that many. `None` when the plan recomputes
/// every layer, or no N does.
fn layer_ac_every(plan: &Plan) -> Option<u64> {
    let k = plan.strategy.recompute_layers;
    let counts = dplc_ir::virtual_stage_layers(&plan.stage_layers(), plan.chunks());
    let n = *counts.first()?;
    (k > 0 && k < n && counts.iter().all(|&c| c == n) && n % k == 0).then(|| n / k)
}

/// The modules of each model part: the embedding with the first, the
/// final norm and output with the last, the layers as the plan splits them
/// (chunk `c` of stage `s` is part `c·pp + s`, as torchtitan loops them).
fn model_parts(plan: &Plan) -> Vec<Vec<String>> {
    let counts = dplc_ir::virtual_stage_layers(&plan.stage_layers(), plan.chunks());
    let mut parts = Vec::new();
    let mut next = 0;
    for (i, n) in counts.iter().enumerate() {
        let mut part = Vec::new();
        if i == 0 {
            part.push("tok_embeddings".to_string());
        }
        part.extend((next..next + n).map(|l| format!("layers.{l}")));
        next += n;
        if i + 1 == counts.len() {
            part.push("norm".to_string());
            part.push("output".to_string());
        }
        parts.push(part);
    }
    parts
}

/// The modules float8 leaves in bf16, as `filter_fqns` names them (a
/// linear whose name contains one is skipped): the output layer, and the
/// end layers the plan keeps in bf16 (`layers.0.` matches layer 0's
/// linears, not layer 10's).
fn bf16_modules(plan: &Plan) -> Vec<String> {
    let n = plan.strategy.fp8_bf16_ends.min(plan.layers);
    let ends = (0..n).chain(plan.layers - n..plan.layers);
    let mut layers: Vec<u64> = ends.collect();
    layers.sort_unstable();
    layers.dedup();
    std::iter::once(toml_str("output"))
        .chain(
            layers
                .into_iter()
                .map(|l| toml_str(&format!("layers.{l}."))),
        )
        .collect()
}

fn toml_str(s: &str) -> String {
    format!("\"{}\"", s.replace('\\', "\\\\").replace('"', "\\\""))
}

pub fn render(job: &Job) -> String {
    let (plan, t, train) = (job.plan, job.model, job.train);
    let s = &plan.strategy;
    let m = &plan.mesh;
    let mut o = String::new();
    let w = &mut o;
    let flavour_name = flavour(t);
    let _ = writeln!(
        w,
        "# {} on {}: a torchtitan (v0.2.0) job of the plan dplc chose.\n\
         # dplc predicts {:.3} s per step, {:.1} GiB peak per device.\n\
         # Run: NGPU={} CONFIG_FILE=this.toml ./run_train.sh (on each of {} node(s) with torchrun's rendezvous).",
        plan.model,
        plan.cluster.name,
        plan.estimate.step_time_s,
        plan.estimate.peak_memory_bytes as f64 / (1u64 << 30) as f64,
        plan.cluster.devices_per_node,
        plan.cluster.nodes,
    );
    if flavour_name.is_none() {
        let _ = writeln!(
            w,
            "# No llama3 flavour has this shape: add it to llama3_args in\n\
             # torchtitan/models/llama3/__init__.py as\n#   \"{}\": {},",
            plan.model,
            model_args(t)
        );
    }
    let _ = writeln!(
        w,
        "\n[job]\ndescription = {}\n",
        toml_str(&format!("{} planned by dplc", plan.model))
    );
    let _ = writeln!(
        w,
        "[model]\nname = \"llama3\"\nflavor = {}",
        toml_str(flavour_name.unwrap_or(&plan.model))
    );
    if s.fp8 {
        // torchao's Float8Linear on the layers' linears, the output layer
        // kept in the training precision.
        let _ = writeln!(w, "converters = [\"quantize.linear.float8\"]");
    }
    w.push('\n');
    // Each data-parallel rank's batch per optimizer step is local × (1, or
    // the pipeline's micro-batches); without a pipeline, torchtitan
    // accumulates gradients over global / (local · dp) steps.
    let local = if m.pp > 1 {
        s.micro_batch * s.num_micro_batches
    } else {
        s.micro_batch
    };
    let _ = writeln!(
        w,
        "[training]\nlocal_batch_size = {local}\nglobal_batch_size = {}\nseq_len = {}\n\
         max_norm = {}\nsteps = {}\nmixed_precision_param = {}\nenable_cpu_offload = {}\n\
         dataset = \"c4_test\"  # synthetic-scale test data; point at your dataset\n",
        s.global_batch,
        s.seq,
        // No clipping: a bound no norm reaches (0 would zero the gradients).
        train.grad_clip.map_or("1e30".to_string(), number),
        job.steps(),
        match train.precision {
            Precision::Fp32 => "\"float32\"",
            _ => "\"bfloat16\"",
        },
        !s.offload.is_none()
    );
    let (replicate, shard) = if s.zero_stage >= 2 {
        (1, m.dp)
    } else {
        (m.dp, 1)
    };
    let _ = writeln!(
        w,
        "[parallelism]\ndata_parallel_replicate_degree = {replicate}\n\
         data_parallel_shard_degree = {shard}\ntensor_parallel_degree = {}\n\
         context_parallel_degree = {}\npipeline_parallel_degree = {}",
        m.tp, m.cp, m.pp
    );
    if shard > 1 {
        let _ = writeln!(
            w,
            "fsdp_reshard_after_forward = {}",
            // ZeRO-3 gathers per layer and micro-batch but under a
            // pipeline, where it holds the step (`zero3_holds_the_step`).
            if s.zero_stage >= 3 && !dplc_ir::zero3_holds_the_step(s.zero_stage, m.pp) {
                "\"always\""
            } else {
                "\"never\""
            }
        );
    }
    if m.tp > 1 {
        let _ = writeln!(
            w,
            "enable_async_tensor_parallel = {}\ndisable_loss_parallel = {}",
            s.tp_overlap == TpOverlap::Ring,
            s.root == RootSplit::Replicated
        );
    }
    if m.pp > 1 {
        let schedule = match s.schedule {
            PipelineSchedule::GPipe => "GPipe",
            PipelineSchedule::OneFOneB => "1F1B",
            PipelineSchedule::Interleaved => "Interleaved1F1B",
        };
        let parts: Vec<String> = model_parts(plan)
            .iter()
            .map(|p| {
                let names: Vec<String> = p.iter().map(|n| toml_str(n)).collect();
                format!("  [{}]", names.join(", "))
            })
            .collect();
        let _ = writeln!(
            w,
            "pipeline_parallel_schedule = \"{schedule}\"\npipeline_parallel_microbatch_size = {}\n\
             module_fqns_per_model_part = [\n{},\n]",
            s.micro_batch,
            parts.join(",\n")
        );
    }
    if s.fp8 {
        let _ = writeln!(
            w,
            "\n[quantize.linear.float8]\nrecipe_name = \"tensorwise\"\nfilter_fqns = [{}]",
            bf16_modules(plan).join(", ")
        );
        if s.fp8_gather {
            // FSDP2 gathers the float8 casts, their scales from one amax
            // all-reduce after the optimizer step.
            let _ = writeln!(
                w,
                "enable_fsdp_float8_all_gather = true\nprecompute_float8_dynamic_scale_for_fsdp = true"
            );
        }
    }
    let every = layer_ac_every(plan);
    let _ = writeln!(
        w,
        "\n[activation_checkpoint]\nmode = {}",
        match s.recompute {
            Recompute::None => "\"none\"",
            Recompute::Selective | Recompute::Op => "\"selective\"",
            Recompute::Full if every.is_some() => "\"selective\"",
            Recompute::Full => "\"full\"",
        }
    );
    if let (Recompute::Full, Some(n)) = (s.recompute, every) {
        let _ = writeln!(
            w,
            "selective_ac_option = \"{n}\"  # every {n}th layer: as many as dplc's first {} of each chunk, the same price",
            s.recompute_layers
        );
    }
    if matches!(s.recompute, Recompute::Selective | Recompute::Op) {
        let _ = writeln!(
            w,
            "selective_ac_option = \"op\"  # torchtitan's op-level choice, not Megatron's attention-core rule"
        );
    }
    // torch.compile runs what the plan prices fused: the model's
    // elementwise chains, and the loss (compiled, one pass over the logits;
    // eager, PyTorch's `F.cross_entropy` over fp32 logits).
    let compiled_model = if m.tp > 1 && s.tp_overlap == TpOverlap::Ring {
        let _ = writeln!(
            w,
            "\n[compile]\nenable = true  # async tensor parallelism needs torch.compile"
        );
        true
    } else if s.elementwise == dplc_ir::Elementwise::Fused {
        let _ = writeln!(
            w,
            "\n[compile]\nenable = true  # the plan prices elementwise chains fused, as torch.compile runs them"
        );
        true
    } else {
        false
    };
    match (compiled_model, s.loss == dplc_ir::Loss::Fused) {
        (true, false) => {
            let _ = writeln!(
                w,
                "components = [\"model\"]  # the plan prices the loss {}, not compiled",
                s.loss.name()
            );
        }
        (false, true) => {
            let _ = writeln!(
                w,
                "\n[compile]\nenable = true\ncomponents = [\"loss\"]  # the plan prices the loss fused, as torch.compile runs it"
            );
        }
        _ => {}
    }
    match train.optimizer {
        Optimizer::AdamW {
            lr,
            beta1,
            beta2,
            eps,
            weight_decay,
        } => {
            let _ = writeln!(
                w,
                "\n[optimizer]\nname = \"AdamW\"\nlr = {}\nbeta1 = {}\nbeta2 = {}\neps = {}\nweight_decay = {}",
                number(lr),
                number(beta1),
                number(beta2),
                number(eps),
                number(weight_decay)
            );
        }
        Optimizer::Sgd { .. } => {}
    }
    match train.schedule {
        LrSchedule::WarmupCosine {
            warmup, min_ratio, ..
        } => {
            let _ = writeln!(
                w,
                "\n[lr_scheduler]\nwarmup_steps = {warmup}\ndecay_type = \"cosine\"\nmin_lr_factor = {}",
                number(min_ratio)
            );
        }
        LrSchedule::Constant => {
            let _ = writeln!(w, "\n[lr_scheduler]\nwarmup_steps = 0\ndecay_ratio = 0.0");
        }
    }
    o
}

/// Why torchtitan cannot train with the train section as written.
pub fn train_fits(train: &dplc_ir::TrainSpec) -> Result<(), String> {
    if train.precision == Precision::Fp16 {
        return Err("its precision is fp16; torchtitan trains in bf16 or fp32".into());
    }
    if matches!(train.optimizer, Optimizer::Sgd { .. }) {
        return Err("its optimizer is SGD; torchtitan's are Adam and AdamW".into());
    }
    Ok(())
}
