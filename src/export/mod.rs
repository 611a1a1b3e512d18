//! `dplc export PLAN --to megatron|torchtitan|deepspeed`: a plan in the
//! terms of the engine a person already runs. Each engine says which of the
//! plan's choices it cannot express ([`Gap`]); then the export names the
//! closest plan it can, priced by the planner with everything else pinned,
//! and stops unless `--closest` asks for that plan instead.

mod arch;
mod deepspeed;
mod megatron;
mod torchtitan;

use crate::compile;
use arch::Transformer;
use dplc_ir::{Plan, TrainSpec};
use dplc_planner::{PlanRequest, StrategyConstraints};
use miette::{miette, Result};
use std::path::PathBuf;

#[derive(clap::Args)]
pub struct Args {
    /// The plan file (`dplc compile … -o plan.ron`).
    plan: PathBuf,
    /// The engine: `megatron` (a torchrun line of Megatron-LM's
    /// pretrain_gpt.py), `torchtitan` (a job TOML) or `deepspeed` (a
    /// ds_config.json; the Megatron-DeepSpeed launch line goes to stderr).
    #[arg(long = "to", value_enum)]
    to: Engine,
    /// Write to this file instead of standard output.
    #[arg(short, long)]
    output: Option<PathBuf>,
    /// When the engine cannot run the plan as planned, export the closest
    /// plan it can run instead of stopping.
    #[arg(long)]
    closest: bool,
    /// Report errors as a JSON object on stdout (for scripts).
    #[arg(long)]
    json: bool,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Engine {
    Megatron,
    Torchtitan,
    Deepspeed,
}

impl Engine {
    fn name(self) -> &'static str {
        match self {
            Engine::Megatron => "Megatron-LM",
            Engine::Torchtitan => "torchtitan",
            Engine::Deepspeed => "DeepSpeed",
        }
    }

    /// Why the engine cannot build this model at all (no plan change helps).
    fn model_fits(self, t: &Transformer) -> Result<(), String> {
        match self {
            Engine::Megatron => megatron::model_fits(t),
            Engine::Torchtitan => torchtitan::model_fits(t),
            Engine::Deepspeed => deepspeed::model_fits(t),
        }
    }

    /// The plan's choices the engine cannot express.
    fn gaps(self, plan: &Plan, t: &Transformer) -> Vec<Gap> {
        let mut gaps = match self {
            Engine::Megatron => megatron::gaps(plan, t),
            Engine::Torchtitan => torchtitan::gaps(plan, t),
            Engine::Deepspeed => deepspeed::gaps(plan, t),
        };
        // None of the three runs a parameter server or dplc's compressed
        // all-reduces (DeepSpeed's 1-bit Adam compresses the optimizer's
        // momentum, another algorithm).
        let s = &plan.strategy;
        if !s.sync.is_all_reduce() {
            gaps.push(Gap::new(
                format!("{}: the engine all-reduces gradients", s.sync.keys()),
                |c| {
                    c.sync = Some(dplc_planner::SyncMode::AllReduce);
                    c.ps_shards = None;
                    c.staleness = None;
                },
            ));
        }
        if !s.compress.is_none() {
            gaps.push(Gap::new(
                format!(
                    "compress={}: the engine reduces uncompressed gradients",
                    s.compress.name()
                ),
                |c| c.compress = Some(dplc_ir::Compression::None),
            ));
        }
        gaps
    }
}

/// A choice of the plan an engine cannot express, and the pin that moves
/// the plan to the nearest one it can.
pub struct Gap {
    /// What the plan does that the engine cannot, in the engine's terms.
    pub what: String,
    pub pin: Box<dyn Fn(&mut StrategyConstraints)>,
}

impl Gap {
    fn new(what: impl Into<String>, pin: impl Fn(&mut StrategyConstraints) + 'static) -> Gap {
        Gap {
            what: what.into(),
            pin: Box::new(pin),
        }
    }
}

/// PyTorch's autocast over fp32 weights, which none of the engines runs as
/// dplc prices it: each keeps its activations in the training precision
/// (Megatron's `--bf16`, DeepSpeed's bf16 mode, FSDP2's parameter casts).
fn autocast_gap(plan: &Plan, engine: &str) -> Option<Gap> {
    plan.strategy.autocast.then(|| {
        Gap::new(
            format!(
                "autocast over fp32 weights ({engine} keeps activations in the training precision)"
            ),
            |p| p.autocast = None,
        )
    })
}

/// FlashAttention (v1)'s kernel, which neither Megatron's `flash` backend
/// nor torchtitan's SDPA runs any more: both run FlashAttention-2 or newer,
/// twice its speed, so the plan would be priced slower than it runs.
fn flash1_gap(plan: &Plan, engine: &str) -> Option<Gap> {
    (plan.strategy.attention == dplc_ir::AttentionKind::Flash1).then(|| {
        Gap::new(
            format!("FlashAttention (v1)'s kernel ({engine} runs FlashAttention-2 or newer)"),
            |p| p.attention = Some(dplc_ir::AttentionKind::Flash2),
        )
    })
}

/// What every renderer reads: the plan, the model's shape and its training setup.
pub struct Job<'a> {
    pub plan: &'a Plan,
    pub model: &'a Transformer,
    pub train: &'a TrainSpec,
}

impl Job<'_> {
    /// Optimizer steps to train for: the train section's, else its schedule's length.
    pub fn steps(&self) -> u64 {
        self.train.steps.unwrap_or(match self.train.schedule {
            dplc_ir::LrSchedule::WarmupCosine { total, .. } => total,
            dplc_ir::LrSchedule::Constant => 1000,
        })
    }
}

pub fn run(args: &Args) -> Result<()> {
    let plan = compile::read_plan(&args.plan)?;
    if plan.source.text.is_empty() {
        return Err(miette!(
            code = "dplc::export",
            help = "compile the plan again with `dplc compile … -o plan.ron`",
            "{} carries no model source, so its model cannot be described to {}",
            args.plan.display(),
            args.to.name()
        ));
    }
    let unit = dplc_frontend::parse(&plan.source.file, &plan.source.text)?;
    let lowered = unit.lower(&plan.source.model)?;
    let model = arch::recognise(&lowered.graph).map_err(|why| {
        miette!(
            code = "dplc::export-model",
            help = "the engines build decoder-only transformers from standard blocks \
                    (attention, mlp/swiglu/moe, layer_norm/rms_norm, one repeat stack); \
                    dplc's own runtime runs this plan: `dplc run` or `dplc build`",
            "`{}` is not a model {} can build: {why}",
            plan.model,
            args.to.name()
        )
    })?;
    args.to.model_fits(&model).map_err(|why| {
        miette!(
            code = "dplc::export-model",
            help = "dplc's own runtime runs this plan: `dplc run` or `dplc build`",
            "{} cannot build `{}`: {why}",
            args.to.name(),
            plan.model
        )
    })?;
    if args.to == Engine::Torchtitan {
        torchtitan::train_fits(&lowered.train).map_err(|why| {
            miette!(
                code = "dplc::export-model",
                help = "change the model's train section, or run the plan with `dplc run`",
                "torchtitan cannot train `{}` as its train section says: {why}",
                plan.model
            )
        })?;
    }
    let gaps = args.to.gaps(&plan, &model);
    let plan = if gaps.is_empty() {
        plan
    } else {
        let closest = closest(args.to, &plan, &model, &lowered, &unit, &gaps)?;
        let list: Vec<String> = gaps.iter().map(|g| format!("  - {}", g.what)).collect();
        let pins = StrategyConstraints::of_plan(&closest);
        let price = format!(
            "{:.3} s per step ({:+.1}%), {:.1} GiB peak per device",
            closest.estimate.step_time_s,
            100.0 * (closest.estimate.step_time_s / plan.estimate.step_time_s - 1.0),
            closest.estimate.peak_memory_bytes as f64 / (1u64 << 30) as f64
        );
        if !args.closest {
            return Err(miette!(
                code = "dplc::export-gap",
                help = format!(
                    "pass --closest to export the closest plan {} can run, or compile it with \
                     --strategy {pins}",
                    args.to.name()
                ),
                "{} cannot run this plan as planned:\n{}\nthe closest plan it can run: {pins}\n  \
                 predicted {price} (this plan: {:.3} s)",
                args.to.name(),
                list.join("\n"),
                plan.estimate.step_time_s
            ));
        }
        note!(
            "{} cannot run this plan as planned:\n{}\nexporting the closest plan it can run: {pins}\n  predicted {price}",
            args.to.name(),
            list.join("\n")
        );
        closest
    };
    let mut train = lowered.train.clone();
    train.global_batch = plan.strategy.global_batch;
    train.seq = plan.strategy.seq;
    let job = Job {
        plan: &plan,
        model: &model,
        train: &train,
    };
    let text = match args.to {
        Engine::Megatron => megatron::render(&job),
        Engine::Torchtitan => torchtitan::render(&job),
        Engine::Deepspeed => {
            // A ds_config alone neither splits a layer nor recomputes one
            // (its `activation_checkpointing` configures what the model's
            // code checkpoints): Megatron-DeepSpeed's flags do both.
            let recomputes = plan.strategy.recompute != dplc_ir::Recompute::None;
            if plan.mesh.tp > 1 || plan.mesh.pp > 1 || recomputes {
                let config = args
                    .output
                    .as_ref()
                    .map_or("ds_config.json".into(), |p| p.display().to_string());
                note!(
                    "launch with Megatron-DeepSpeed's pretrain_gpt.py and the model's flags:\n{}",
                    deepspeed::launch(&job, &config)
                );
            }
            deepspeed::render(&job)
        }
    };
    match &args.output {
        Some(path) => {
            crate::output::write(path, text.as_bytes(), &[&args.plan])?;
            note!("wrote {}", path.display());
        }
        None => out!("{text}"),
    }
    Ok(())
}

/// The plan the engine can run nearest to `plan`, priced by the planner:
/// first every choice pinned as planned except those the gaps move; if that
/// does not fit, the mesh kept and the rest searched; then everything
/// searched. A move can open another gap (a new schedule may change the
/// stages), so each try repeats until the engine has nothing to say.
fn closest(
    engine: Engine,
    plan: &Plan,
    model: &Transformer,
    lowered: &dplc_frontend::Lowered,
    unit: &dplc_frontend::Unit,
    gaps: &[Gap],
) -> Result<Plan> {
    let source = std::path::Path::new(&plan.source.file);
    let cluster = compile::resolve_cluster(&plan.cluster.name, unit, source)?;
    let all = StrategyConstraints::of_plan(plan);
    let mesh = StrategyConstraints {
        tp: all.tp,
        pp: all.pp,
        dp: all.dp,
        cp: all.cp,
        ep: all.ep,
        ..StrategyConstraints::default()
    };
    // What changes the numbers training computes (FP8 and the layers kept
    // out of it, the main gradients' precision, how replicas combine
    // gradients) the search never takes unasked, so it is kept while the
    // rest is searched again: a closest plan does not quietly train in
    // another precision.
    let numerics = StrategyConstraints {
        fp8: all.fp8,
        fp8_gather: all.fp8_gather,
        fp8_bf16_ends: all.fp8_bf16_ends,
        grad_reduce: all.grad_reduce,
        sync: all.sync,
        ps_shards: all.ps_shards,
        ps_ranks: all.ps_ranks,
        staleness: all.staleness,
        compress: all.compress,
        ..mesh.clone()
    };
    let mut why = String::new();
    for base in [all, numerics, mesh, StrategyConstraints::default()] {
        let mut pins = base;
        for g in gaps {
            (g.pin)(&mut pins);
        }
        for _ in 0..4 {
            let mut req = PlanRequest::new(&lowered.graph, lowered.train.clone(), cluster.clone());
            req.global_batch = Some(plan.strategy.global_batch);
            req.seq = Some(plan.strategy.seq);
            req.pinned = pins.clone();
            let found = match dplc_planner::compile(&req) {
                Ok(found) => found,
                Err(e) => {
                    why = format!("{pins}: {e}");
                    break;
                }
            };
            let more = engine.gaps(&found.plan, model);
            if more.is_empty() {
                let mut p = found.plan;
                p.source = plan.source.clone();
                return Ok(p);
            }
            for g in &more {
                (g.pin)(&mut pins);
            }
            let tried = match pins.to_string() {
                s if s.is_empty() => "the search's own choice".to_string(),
                s => format!("`{s}`"),
            };
            why = format!("{tried} still has choices {} cannot express", engine.name());
        }
    }
    Err(miette!(
        code = "dplc::export-gap",
        help = "dplc's own runtime runs the plan as planned: `dplc run` or `dplc build`",
        "{} cannot run this plan as planned, and no plan it can run fits this model and \
         cluster (the last try, {why})",
        engine.name()
    ))
}
