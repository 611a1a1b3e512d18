//! `dplc verify`: run a plan's split on CPU ranks at reduced size (fewer
//! layers, one sample per micro-batch, a short sequence, the same mesh) and
//! check that it computes what the serial run computes.
//!
//! Two runs of each: with the model's optimizer the losses must agree within
//! 1e-5; with SGD (momentum 0.9), whose update is linear in the gradient, the
//! losses and every parameter within 1e-6 normwise relative. Reassociated f32
//! sums move results by a few ulps (≤ 4e-7 on the zoo's tiny models); a
//! dropped or misplaced collective moves them by 1e-3 or more.

use crate::load;
use dplc_ir::Plan;
use dplc_runtime::{Corpus, Faults, RunConfig, TrainReport};
use miette::{miette, Result};
use std::path::{Path, PathBuf};

const LOSS_TOL: f64 = 1e-5;
const SGD_TOL: f64 = 1e-6;

#[derive(clap::Args)]
pub struct Args {
    /// The plan file (RON, as `dplc compile` writes it).
    pub plan: PathBuf,
    /// The .dpl file defining the plan's model (default: the copy of the
    /// source the plan carries; for older plans, the first file in `models/`
    /// that defines it).
    #[arg(long)]
    pub source: Option<PathBuf>,
    /// Steps of each run.
    #[arg(long, default_value_t = 5)]
    pub steps: u64,
    /// Break the plan on purpose to see the check fail: `grad-sync` leaves out
    /// the data-parallel gradient all-reduce, `tp-sum` the tensor-parallel one.
    #[arg(long)]
    pub inject: Option<String>,
    /// Print a JSON object instead of text.
    #[arg(long)]
    pub json: bool,
    /// What computes the split run's stages: the reference interpreter, or
    /// the fused kernels a GPU runs (interpreted on the CPU). The serial run
    /// it is checked against is always the reference.
    #[arg(long, value_enum, default_value_t = crate::run::ComputeArg::Reference)]
    pub compute: crate::run::ComputeArg,
}

fn read(path: &Path) -> Result<String> {
    load::read_text(path)
}

/// What a plan pins that changes what training computes — compressed
/// gradients, asynchronous updates (the keys `--allow` governs) — by
/// design: no split can equal the serial run with them, so the check sets
/// them aside (an async server becomes a synchronous one over the same
/// shards) and says which. A synchronous server sums as the all-reduce
/// does and is checked as planned.
fn set_dynamics_aside(split: &mut RunConfig) -> Vec<String> {
    let mut aside = Vec::new();
    if !split.compress.is_none() {
        aside.push(format!("compress={}", split.compress.name()));
        split.compress = dplc_ir::Compression::None;
    }
    if let dplc_ir::GradSync::Async {
        shards,
        staleness,
        servers,
    } = split.sync
    {
        if staleness > 0 {
            aside.push(format!("sync=async (staleness {staleness})"));
            split.sync = dplc_ir::GradSync::ps(shards).with_servers(servers);
        }
    }
    aside
}

fn find_source(model: &str) -> Result<PathBuf> {
    let dir = Path::new("models");
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
        .map_err(|e| miette!(help = "pass --source FILE", "cannot list models/: {e}"))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "dpl"))
        .collect();
    files.sort();
    for f in files {
        if let Ok(unit) = load::parse(&f) {
            if unit.model_names().iter().any(|m| m == model) {
                return Ok(f);
            }
        }
    }
    Err(miette!(
        help = "pass the model's file with --source FILE",
        "no file in models/ defines `{model}`"
    ))
}

/// The plan's model with just enough layers for its pipeline, from the .dpl
/// `text` (shown as `name` in diagnostics).
fn reduced_model(
    name: &str,
    text: &str,
    model: &str,
    layers: u64,
) -> Result<dplc_frontend::Lowered> {
    let variant = format!("{text}\nmodel dplc_verify_reduced = {model}(layers = {layers})\n");
    if let Ok(unit) = dplc_frontend::parse(name, &variant) {
        if let Ok(l) = unit.lower("dplc_verify_reduced") {
            return Ok(l);
        }
    }
    // A model without a `layers` argument runs at full depth.
    Ok(dplc_frontend::parse(name, text)?.lower(model)?)
}

/// Refuse a reduced run this machine cannot hold, before it starts: every
/// rank thread keeps its parameters, gradients and two optimizer moments in
/// fp32 (16 bytes a parameter; less under ZeRO, so this bounds from above),
/// and the reduced model keeps the plan's width. Without this a wide model
/// verified on a large mesh runs for minutes and is then killed for memory.
fn check_memory(graph: &dplc_ir::Graph, ranks: usize) -> Result<()> {
    let Some(available) = available_memory() else {
        return Ok(());
    };
    let params = graph.param_count() as f64;
    let need = params * 16.0 * ranks.max(1) as f64 * 1.25;
    if need > 0.8 * available as f64 {
        let gib = |b: f64| b / (1u64 << 30) as f64;
        return Err(miette!(
            help = "verify needs a rank thread per device of the plan: verify the plan of a smaller cluster \
                    (the same strategy on fewer data-parallel replicas), or run on a machine with more memory",
            "verify would hold about {:.1} GiB ({} ranks × {:.0}M parameters at reduced depth, 16 bytes each), \
             but this machine has {:.1} GiB available",
            gib(need),
            ranks,
            params / 1e6,
            gib(available as f64)
        ));
    }
    Ok(())
}

/// `MemAvailable` from /proc/meminfo, in bytes (None where there is none).
fn available_memory() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = text.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

struct Outcome {
    loss_dev: f64,
    sgd_loss_dev: f64,
    param_dev: f64,
    param_at: String,
}

fn max_loss_dev(a: &TrainReport, b: &TrainReport) -> f64 {
    a.steps
        .iter()
        .zip(&b.steps)
        .map(|(x, y)| ((x.loss - y.loss) / x.loss.abs().max(1e-12)).abs())
        .fold(0.0, f64::max)
}

pub fn run(args: &Args) -> Result<()> {
    // Zero steps compare nothing, and would pass whatever the plan does.
    if args.steps == 0 {
        return Err(miette!(
            help = "give --steps 1 or more (the default is 5)",
            "--steps must be positive: a check of zero steps compares nothing"
        ));
    }
    let mut plan: Plan = crate::compile::read_plan(&args.plan)?;
    // The model's text: --source, else the copy the plan carries, else the zoo.
    let (source_name, source_text) = match &args.source {
        Some(s) => (s.display().to_string(), read(s)?),
        None if !plan.source.text.is_empty() => {
            (plan.source.file.clone(), plan.source.text.clone())
        }
        None => {
            let s = find_source(&plan.model)?;
            (s.display().to_string(), read(&s)?)
        }
    };
    // Fewer layers change only the repeat's count, not its body: the plan's
    // layouts name the same nodes and are checked as they are.
    let layout_source = if plan.layout.is_some() {
        "the plan's"
    } else {
        "the planner's"
    };
    let full = dplc_frontend::parse(&source_name, &source_text)?.lower(&plan.model)?;
    crate::run::complete_layout(&mut plan, &full.graph);
    plan.check_against(&full.graph).map_err(|e| {
        miette!(
            help = "compile the plan again from this model with `dplc compile … -o plan.ron`",
            "{e}"
        )
    })?;
    // The plan's partition at reduced depth: every stage gives up as many
    // layers as leaves the lightest with one per chunk, so an uneven plan
    // runs uneven, as it was balanced.
    let v = plan.chunks();
    let planned = plan.stage_layers();
    let spare = planned.iter().min().map_or(0, |&l| l.saturating_sub(v));
    let reduced: Vec<u64> = planned.iter().map(|&l| l.saturating_sub(spare)).collect();
    let layers = reduced.iter().sum::<u64>().max(2);
    let depth_of = |l: &dplc_frontend::Lowered| dplc_ir::Analysis::new(&l.graph).layers();
    let mut lowered = reduced_model(&source_name, &source_text, &plan.model, layers)?;
    // A `layers` argument that is not the repeat's count (Gemma 2 repeats
    // `layers / 2` pairs): scale it to the depth wanted, once.
    let first = depth_of(&lowered);
    if first > 0 && first < layers {
        let scaled = reduced_model(
            &source_name,
            &source_text,
            &plan.model,
            layers * layers / first,
        )?;
        if depth_of(&scaled) == layers {
            lowered = scaled;
        }
    }
    let mut split = RunConfig::from_plan(&plan).map_err(|e| miette!("{e}"))?;
    let aside = set_dynamics_aside(&mut split);
    // A model without a `layers` argument runs at full depth, as planned.
    let depth = depth_of(&lowered);
    if split.pp > 1 {
        split.stage_layers = Some(if depth == layers { reduced } else { planned });
    }
    let layers = depth;
    // One sample per micro-batch; enough micro-batches for the schedule.
    split.compute = args.compute.into();
    split.micro_batch = 1;
    split.num_micro_batches = if split.pp > 1 { split.pp } else { 2 };
    split.faults = match args.inject.as_deref() {
        None => Faults::default(),
        Some("grad-sync") => Faults {
            skip_grad_sync: true,
            ..Faults::default()
        },
        Some("tp-sum") => Faults {
            skip_tp_sum: true,
            ..Faults::default()
        },
        Some(other) => {
            return Err(miette!(
                help = "use grad-sync or tp-sum",
                "unknown fault `{other}`"
            ))
        }
    };
    let global = split.global_batch();
    // The sequence splits over tp (sequence parallel) and into 2·cp
    // load-balanced chunks.
    let unit = split.tp as u64 * if split.cp > 1 { 2 * split.cp as u64 } else { 1 };
    let seq = (plan.strategy.seq.min(32) / unit).max(1) * unit;
    let serial = RunConfig {
        micro_batch: 1,
        num_micro_batches: global,
        ..RunConfig::default()
    };
    let mut spec = lowered.train.clone();
    spec.seq = seq;
    spec.global_batch = global as u64;
    let vocab = crate::run::vocab_of(&lowered.graph);
    let data = Corpus::synthetic(1, vocab, 1 << 14);
    let graph = &lowered.graph;
    check_memory(graph, split.world_size())?;
    let started = std::time::Instant::now();
    let go = |what: &str, cfg: &RunConfig, spec: &dplc_ir::TrainSpec| {
        // Four runs of a reduced but real model: say what is running.
        if !args.json {
            note!(
                "verify: {what} on {} rank(s), {} steps ({:.1}s so far)",
                cfg.world_size(),
                args.steps,
                started.elapsed().as_secs_f64()
            );
        }
        dplc_runtime::train(graph, spec, cfg, &data, args.steps, 7, |_| {})
            .map_err(|e| miette!("{e}"))
    };
    let base = go("the serial run, the model's optimizer", &serial, &spec)?;
    let got = go("the plan's split, the model's optimizer", &split, &spec)?;
    let mut sgd = spec.clone();
    sgd.optimizer = dplc_ir::Optimizer::Sgd {
        lr: 0.1,
        momentum: 0.9,
    };
    let base_sgd = go("the serial run, SGD", &serial, &sgd)?;
    let got_sgd = go("the plan's split, SGD", &split, &sgd)?;
    let (param_dev, param_at) = base_sgd.params.max_rel_diff(&got_sgd.params, 1e-3);
    let o = Outcome {
        loss_dev: max_loss_dev(&base, &got),
        sgd_loss_dev: max_loss_dev(&base_sgd, &got_sgd),
        param_dev: f64::from(param_dev),
        param_at,
    };
    let pass = o.loss_dev < LOSS_TOL && o.sgd_loss_dev < SGD_TOL && o.param_dev < SGD_TOL;
    if args.json {
        outln!(
            "{}",
            serde_json::json!({
                "pass": pass,
                "model": plan.model,
                "ranks": split.world_size(),
                "layers": layers,
                "seq": seq,
                "global_batch": global,
                "steps": args.steps,
                "loss_deviation": o.loss_dev,
                "sgd_loss_deviation": o.sgd_loss_dev,
                "param_deviation": o.param_dev,
                "param_deviation_at": o.param_at,
                "layout": layout_source,
                "compute": split.compute.name(),
                "set_aside": aside,
            })
        );
    } else {
        outln!(
            "verify {} on {} CPU ranks (dp {} × tp {} × pp {} × cp {}, ep {}), reduced to {layers} layers, seq {seq}, global batch {global}, {} steps, {layout_source} layout, {} compute",
            plan.model,
            split.world_size(),
            split.dp,
            split.tp,
            split.pp,
            split.cp,
            split.ep,
            args.steps,
            split.compute.name()
        );
        if !aside.is_empty() {
            outln!(
                "  {} change{} what training computes by design (the --allow keys); the split is checked without {}",
                aside.join(", "),
                if aside.len() == 1 { "s" } else { "" },
                if aside.len() == 1 { "it" } else { "them" }
            );
        }
        outln!(
            "  loss, model's optimizer   max relative deviation {:.2e}  (tolerance {LOSS_TOL:.0e})",
            o.loss_dev
        );
        outln!(
            "  loss, SGD                 max relative deviation {:.2e}  (tolerance {SGD_TOL:.0e})",
            o.sgd_loss_dev
        );
        outln!(
            "  parameters, SGD           max relative deviation {:.2e}  (tolerance {SGD_TOL:.0e}) at {}",
            o.param_dev, o.param_at
        );
        outln!("{}", if pass { "pass" } else { "FAIL" });
    }
    if pass {
        Ok(())
    } else {
        Err(miette!(
            "the plan does not compute what the serial run computes (largest deviation {:.2e})",
            o.loss_dev.max(o.sgd_loss_dev).max(o.param_dev)
        ))
    }
}
