//! The plan as a DeepSpeed `ds_config.json` (batch, accumulation, ZeRO
//! stage, precision, optimizer, schedule), and for tensor or pipeline
//! parallelism the Megatron-DeepSpeed flags that set those degrees.

use super::arch::{Ffn, Transformer};
use super::{Gap, Job};
use dplc_ir::{LrSchedule, Optimizer, PipelineSchedule, Plan, Precision, Recompute, RootSplit};
use dplc_planner::AxisOrder;
use serde_json::json;

/// Why DeepSpeed (with Megatron-DeepSpeed's GPT) cannot build the model.
pub fn model_fits(t: &Transformer) -> Result<(), String> {
    if matches!(t.ffn, Ffn::Moe { .. }) {
        return Err(
            "it is a mixture of experts; DeepSpeed-MoE's gate and capacity rules differ from dplc's".into(),
        );
    }
    super::megatron::model_fits(t)
}

/// The plan's choices DeepSpeed's engines cannot express.
pub fn gaps(plan: &Plan, _t: &Transformer) -> Vec<Gap> {
    let s = &plan.strategy;
    let m = &plan.mesh;
    let mut gaps = Vec::new();
    gaps.extend(super::autocast_gap(plan, "DeepSpeed"));
    if s.recompute == dplc_ir::Recompute::Op {
        gaps.push(Gap::new(
            "op-level selective checkpointing (torchtitan's; Megatron-DeepSpeed recomputes the attention core or whole layers)",
            |p| p.recompute = Some(dplc_ir::Recompute::Selective),
        ));
    }
    if m.pp > 1 {
        if s.zero_stage >= 2 {
            gaps.push(Gap::new(
                format!(
                    "ZeRO-{} with a pipeline (DeepSpeed's pipeline engine takes ZeRO-1 at most)",
                    s.zero_stage
                ),
                |p| p.zero = Some(1),
            ));
        }
        if s.schedule != PipelineSchedule::OneFOneB {
            gaps.push(Gap::new(
                format!(
                    "the {} schedule (DeepSpeed's pipeline runs 1F1B)",
                    s.schedule.name()
                ),
                |p| {
                    p.schedule = Some(PipelineSchedule::OneFOneB);
                    p.virtual_stages = Some(1);
                },
            ));
        }
        if plan.stage_layers() != dplc_ir::even_split(plan.layers, m.pp) {
            gaps.push(Gap::new(
                format!(
                    "the stage split {:?} (DeepSpeed's uniform partition splits the layers evenly)",
                    plan.stage_layers()
                ),
                |p| p.even_stages = Some(true),
            ));
        }
        if AxisOrder::of(m) == AxisOrder::PipelineInner {
            gaps.push(Gap::new(
                "pipeline stages inside a replica's nodes (DeepSpeed's topology is pipe, data, model, outermost first)",
                |p| p.order = Some(AxisOrder::DataInner),
            ));
        }
    }
    if s.zero_stage >= 2 && s.grad_accum == dplc_ir::GradAccum::Fused {
        gaps.push(Gap::new(
            format!(
                "ZeRO-{} with gradient accumulation fused into the GEMM (DeepSpeed accumulates \
                 into its partitioned gradients itself)",
                s.zero_stage
            ),
            |p| p.grad_accum = Some(dplc_ir::GradAccum::Separate),
        ));
    }
    if s.offload.activations {
        // Pinned, or the search, free again, offloads them again.
        let planned = s.offload;
        gaps.push(Gap::new(
            "activations offloaded without recomputation (DeepSpeed offloads only checkpointed activations)",
            move |p| {
                p.offload = Some(dplc_ir::Offload {
                    activations: false,
                    ..p.offload.unwrap_or(planned)
                })
            },
        ));
    }
    if (s.offload.optimizer || s.offload.params) && s.zero_stage == 0 {
        // ds_config's `offload_optimizer` and `offload_param` are ZeRO's
        // (DeepSpeed's docs: valid for stages 1–3 and 3).
        gaps.push(Gap::new(
            "offloaded state without ZeRO (DeepSpeed offloads the optimizer at ZeRO 1–3 and parameters at ZeRO-3)",
            |p| p.zero = Some(if p.offload.is_some_and(|o| o.params) { 3 } else { 1 }),
        ));
    }
    if s.shards == dplc_ir::ShardLayout::PerParam {
        gaps.push(Gap::new(
            "ZeRO-3 per parameter (FSDP2's copies; DeepSpeed gathers into flat buffers)",
            |p| p.shards = None,
        ));
    }
    if s.tp_impl == dplc_ir::TpImpl::DTensor && m.tp > 1 {
        gaps.push(Gap::new(
            "DTensor's tensor parallelism (torchtitan's batch-first layout; DeepSpeed's runs Megatron's layers)",
            |p| p.tp_impl = Some(dplc_ir::TpImpl::Megatron),
        ));
    }
    // dplc's runtime runs the model's ends whole along the sequence where
    // Megatron's layers split them (`TpImpl::Dplc`): not a gap, the plan
    // runs there in no more memory and time than it was priced at.
    if s.fp8 {
        gaps.push(Gap::new(
            "FP8 GEMMs (a ds_config has no FP8; Transformer Engine runs them in Megatron-LM)",
            |p| {
                p.fp8 = None;
                p.fp8_gather = None;
                p.fp8_bf16_ends = None;
            },
        ));
    }
    if m.cp > 1 {
        gaps.push(Gap::new(
            "context parallelism (DeepSpeed splits sequences with Ulysses all-to-alls, not ring attention)",
            |p| {
                p.cp = Some(1);
                p.dp = None;
            },
        ));
    }
    if m.tp > 1 && s.root == RootSplit::Replicated {
        gaps.push(Gap::new(
            "a replicated embedding and loss (Megatron-DeepSpeed splits them over the vocabulary)",
            |p| p.root = None,
        ));
    }
    gaps
}

/// `ds_config.json`.
pub fn render(job: &Job) -> String {
    let (plan, train) = (job.plan, job.train);
    let s = &plan.strategy;
    let mut config = json!({
        "train_batch_size": s.global_batch,
        "train_micro_batch_size_per_gpu": s.micro_batch,
        "gradient_accumulation_steps": s.num_micro_batches,
        "steps_per_print": 10,
        "zero_optimization": {
            "stage": s.zero_stage,
            "overlap_comm": s.overlap_grad_reduce,
            "contiguous_gradients": true,
            "reduce_scatter": true,
        },
        "wall_clock_breakdown": false,
    });
    if s.offload.optimizer {
        config["zero_optimization"]["offload_optimizer"] =
            json!({ "device": "cpu", "pin_memory": true });
    }
    if s.offload.params {
        config["zero_optimization"]["offload_param"] =
            json!({ "device": "cpu", "pin_memory": true });
    }
    if let Some(clip) = train.grad_clip {
        config["gradient_clipping"] = json!(clip);
    }
    if plan.strategy.grad_reduce != dplc_ir::GradReduce::Fp32 {
        // Half-precision main gradients: accumulated and reduced as such.
        let dtype = plan.strategy.grad_reduce.name();
        config["communication_data_type"] = json!(dtype);
        config["data_types"] = json!({ "grad_accum_dtype": dtype });
    }
    match train.precision {
        Precision::Bf16 => config["bf16"] = json!({ "enabled": true }),
        // Dynamic loss scaling, as dplc prices fp16 (unscale and inf check).
        Precision::Fp16 => {
            config["fp16"] = json!({
                "enabled": true,
                "loss_scale": 0,
                "initial_scale_power": 16,
                "loss_scale_window": 1000,
                "hysteresis": 2,
                "min_loss_scale": 1,
            })
        }
        Precision::Fp32 => {}
    }
    if let Optimizer::AdamW {
        lr,
        beta1,
        beta2,
        eps,
        weight_decay,
    } = train.optimizer
    {
        config["optimizer"] = json!({
            "type": "AdamW",
            "params": { "lr": lr, "betas": [beta1, beta2], "eps": eps, "weight_decay": weight_decay },
        });
    }
    if let LrSchedule::WarmupCosine {
        warmup,
        total,
        min_ratio,
    } = train.schedule
    {
        config["scheduler"] = json!({
            "type": "WarmupCosineLR",
            "params": {
                "total_num_steps": total,
                "warmup_num_steps": warmup,
                "warmup_min_ratio": 0.0,
                "cos_min_ratio": min_ratio,
            },
        });
    }
    if s.recompute != Recompute::None {
        config["activation_checkpointing"] = json!({
            "partition_activations": false,
            "contiguous_memory_optimization": false,
            "cpu_checkpointing": false,
        });
    }
    serde_json::to_string_pretty(&config).expect("JSON values serialise") + "\n"
}

/// The Megatron-DeepSpeed `deepspeed` launch with the plan's degrees.
pub fn launch(job: &Job, config: &str) -> String {
    let plan = job.plan;
    let (s, m, c) = (&plan.strategy, &plan.mesh, &plan.cluster);
    let mut flags = vec![
        format!("--tensor-model-parallel-size {}", m.tp),
        format!("--pipeline-model-parallel-size {}", m.pp),
    ];
    if m.pp == 1 {
        flags.push("--no-pipeline-parallel".into());
    }
    if m.tp > 1 && s.sequence_parallel {
        flags.push("--sequence-parallel".into());
    }
    flags.push(format!("--micro-batch-size {}", s.micro_batch));
    flags.push(format!("--global-batch-size {}", s.global_batch));
    match s.recompute {
        Recompute::None => {}
        Recompute::Selective | Recompute::Op => {
            flags.push("--recompute-granularity selective".into())
        }
        // Megatron's full granularity needs a method: every layer, one at
        // a time, as dplc recomputes them.
        Recompute::Full if s.recompute_layers == 0 => {
            flags.push("--recompute-granularity full".into());
            flags.push("--recompute-method uniform".into());
            flags.push("--recompute-num-layers 1".into());
        }
        Recompute::Full => {
            flags.push("--recompute-granularity full".into());
            flags.push("--recompute-method block".into());
            flags.push(format!("--recompute-num-layers {}", s.recompute_layers));
        }
    }
    flags.push("--deepspeed".into());
    flags.push(format!("--deepspeed_config {config}"));
    flags.push(format!("--zero-stage {}", s.zero_stage));
    format!(
        "deepspeed --num_nodes {} --num_gpus {} pretrain_gpt.py \\\n  {}",
        c.nodes,
        c.devices_per_node,
        flags.join(" \\\n  ")
    )
}
