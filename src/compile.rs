//! `dplc compile`: plan a model on a cluster and write the `Plan`; also the
//! planning flags and cluster resolution that `run` and `build` share.

use crate::load;
use dplc_ir::{ModelSource, Plan};
use dplc_planner::{Cluster, Compiled, PlanRequest};
use miette::{miette, IntoDiagnostic, Result, WrapErr};
use std::path::{Path, PathBuf};

/// What every planning command reads: the model, the cluster and the pinned choices.
#[derive(clap::Args, Clone, Debug)]
pub struct PlanArgs {
    /// The .dpl file.
    pub file: PathBuf,
    /// The model to plan (needed when the file defines several).
    #[arg(long)]
    pub model: Option<String>,
    /// The cluster: a shorthand (`8xA100`, `4x8xH100`, `16xcpu`), the name of
    /// a `cluster` section in FILE or in `clusters/` beside it, or a .dpl file
    /// holding one cluster section.
    #[arg(long)]
    pub cluster: String,
    /// Pin choices, e.g. `tp=8,pp=8,dp=24,mb=1,zero=1,schedule=1f1b,recompute=selective,sp=on`;
    /// the search fills in the rest. Keys: tp pp dp cp ep mb m schedule v zero recompute sp
    /// overlap (`overlap=off`: the data-parallel gradient reduction waits for backward),
    /// sync (allreduce|ps|async) ps_shards ps_ranks (colocated|dedicated) staleness compress
    /// (none|bf16|fp16|powersgd:R[:W]|topk:F[:W], W warm-up steps: the schedule's by default);
    /// an engine's stack: attention tp_overlap grad_accum grad_reduce (fp32|bf16|fp16: the main
    /// gradients' precision) dispatch (alltoall|hierarchical: DeepEP's
    /// token dispatch) root order stages fp8 fp8_gather
    /// (on: ZeRO gathers the weights' FP8 casts) offload elementwise loss (fused|unfused|eager:
    /// Megatron's default fp32 cross-entropy, pass by pass; PyTorch's `F.cross_entropy`
    /// over fp32 logits, torchtitan's in 2024) shards (flat|per_param:
    /// FSDP2's per-parameter copies under ZeRO-3) tp_impl (dplc|megatron|dtensor: dplc's
    /// runtime runs the model's ends whole along the sequence, Megatron splits them;
    /// torchtitan's batch-first tensor parallelism, its collectives' copies and kept
    /// gathered inputs).
    #[arg(long, default_value = "")]
    pub strategy: String,
    /// Let the search choose what changes the training dynamics: `sync`
    /// (a parameter server or async updates instead of the all-reduce),
    /// `compress` (bf16, PowerSGD or top-k gradients), `grad_reduce` (main
    /// gradients kept and reduced in the training precision), or several
    /// (`sync,compress`). Without it the search all-reduces fp32 gradients;
    /// `--strategy` pins any of them whatever this says.
    #[arg(long, default_value = "")]
    pub allow: String,
    /// Samples per step (default: the model's train section).
    #[arg(long)]
    pub global_batch: Option<u64>,
    /// Sequence length (default: the model's train section).
    #[arg(long)]
    pub seq: Option<u64>,
}

impl PlanArgs {
    /// The files this command reads: outputs may not be written over them
    /// (the cluster's too when `--cluster` names a section in `clusters/`).
    pub fn inputs(&self) -> Vec<PathBuf> {
        let mut inputs = vec![self.file.clone(), PathBuf::from(&self.cluster)];
        inputs.extend(zoo_cluster_file(&self.cluster, &self.file));
        inputs
    }
}

#[derive(clap::Args)]
pub struct Args {
    #[command(flatten)]
    pub plan: PlanArgs,
    /// Also list the K best runners-up and why each lost.
    #[arg(long, default_value_t = 3)]
    top: usize,
    /// Write the plan (RON) to this file.
    #[arg(short, long)]
    output: Option<PathBuf>,
    /// Print a JSON object instead of the summary.
    #[arg(long)]
    json: bool,
    /// Also print how the layouts were found (e-graph size, iterations, stop reason, time).
    #[arg(long, short)]
    verbose: bool,
}

/// `paths` borrowed, as the output rule takes them.
pub fn as_paths(paths: &[PathBuf]) -> Vec<&Path> {
    paths.iter().map(PathBuf::as_path).collect()
}

/// A planner error as the command line shows it.
pub fn plan_error(e: dplc_planner::PlanError) -> miette::Report {
    use dplc_planner::PlanError::*;
    let code = match &e {
        Cluster { .. } | UnknownDevice { .. } => "dplc::cluster",
        StrategySyntax { .. } | Strategy(_) => "dplc::strategy",
        Request(_) => "dplc::input",
        Model(_) => "dplc::model",
        Infeasible(_) => "dplc::does-not-fit",
    };
    miette!(code = code, "{e}")
}

/// The file in `clusters/` beside `file` that defines the cluster section
/// `spec` (the zoo keeps its clusters beside the models), if one does.
fn zoo_cluster_file(spec: &str, file: &Path) -> Option<PathBuf> {
    let dir = file.parent()?.join("clusters");
    let mut paths: Vec<PathBuf> = std::fs::read_dir(&dir)
        .into_iter()
        .flatten()
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "dpl"))
        .collect();
    paths.sort();
    paths.into_iter().find(|path| {
        load::parse(path)
            .ok()
            .and_then(|unit| unit.clusters().ok())
            .is_some_and(|cs| cs.iter().any(|c| c.name == spec))
    })
}

/// The cluster `spec` names, looked up as a shorthand, a section of `unit`,
/// or a file of its own.
pub fn resolve_cluster(spec: &str, unit: &dplc_frontend::Unit, file: &Path) -> Result<Cluster> {
    let in_file = unit.clusters()?;
    if let Some(c) = in_file.iter().find(|c| c.name == spec) {
        return dplc_planner::cluster_from_spec(c).map_err(plan_error);
    }
    let as_path = Path::new(spec);
    if spec.ends_with(".dpl") || as_path.is_file() {
        let other = load::parse(as_path)?;
        let clusters = other.clusters()?;
        return match clusters.as_slice() {
            [one] => dplc_planner::cluster_from_spec(one).map_err(plan_error),
            [] => Err(miette!("{spec} defines no cluster section")),
            many => Err(miette!(
                "{spec} defines {} clusters ({}); name one with --cluster NAME from inside FILE, \
                 or keep one cluster per file",
                many.len(),
                many.iter()
                    .map(|c| c.name.as_str())
                    .collect::<Vec<_>>()
                    .join(", ")
            )),
        };
    }
    if let Some(path) = zoo_cluster_file(spec, file) {
        let other = load::parse(&path)?;
        if let Some(c) = other.clusters()?.iter().find(|c| c.name == spec) {
            return dplc_planner::cluster_from_spec(c).map_err(plan_error);
        }
    }
    // A count too large for a u64 is still a shorthand: parse_cluster names the overflow.
    let shorthand = spec.split(['x', 'X', '*']).next().is_some_and(|n| {
        let n = n.trim();
        !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit())
    });
    if !shorthand {
        return Err(miette!(
            help = "write COUNTxDEVICE or NODESxCOUNTxDEVICE (e.g. 8xA100, 4x8xH100, 16xcpu), \
                    the name of a cluster section in FILE or in clusters/ beside it, or a .dpl file with one",
            "no cluster `{spec}`: it is not a shorthand, and neither {} nor {} defines it",
            file.display(),
            file.parent()
                .map(|d| d.join("clusters").display().to_string())
                .unwrap_or_else(|| "clusters/".into())
        ));
    }
    dplc_planner::parse_cluster(spec).map_err(|e| {
        let names: Vec<&str> = in_file.iter().map(|c| c.name.as_str()).collect();
        let sections = if names.is_empty() {
            String::new()
        } else {
            format!("; {} defines {}", file.display(), names.join(", "))
        };
        miette!(
            help = format!(
                "write COUNTxDEVICE or NODESxCOUNTxDEVICE (e.g. 8xA100, 4x8xH100, 16xcpu), \
                 a cluster section's name, or a .dpl file with one{sections}"
            ),
            "{e}"
        )
    })
}

/// Lower the model and search for its plan; the lowered model comes back too
/// (`run` trains it). `restrict` may tighten the pinned choices to what the
/// caller can execute.
pub fn plan(
    args: &PlanArgs,
    top_k: usize,
    restrict: impl FnOnce(&mut dplc_planner::StrategyConstraints, &dplc_ir::Graph) -> Result<()>,
) -> Result<(Compiled, dplc_frontend::Lowered)> {
    check_sizes(args)?;
    let unit = load::parse(&args.file)?;
    let name = load::choose_model(&unit, &args.file, args.model.as_deref())?;
    let lowered = unit.lower_to_train(&name)?;
    let cluster = resolve_cluster(&args.cluster, &unit, &args.file)?;
    let mut req = PlanRequest::new(&lowered.graph, lowered.train.clone(), cluster.clone());
    req.global_batch = args.global_batch;
    // A model without a sequence axis (an image classifier) has no use for
    // one: a `--seq` given to it would be silently ignored.
    if args.seq.is_some() && lowered.graph.sym_by_name("seq").is_none() {
        return Err(miette!(
            help = "leave out --seq: this model's inputs have no `seq` dimension",
            "--seq given, but `{name}` has no sequence axis"
        ));
    }
    req.seq = args.seq;
    req.pinned = dplc_planner::parse_strategy(&args.strategy).map_err(plan_error)?;
    req.pinned.allow = dplc_planner::Allow::parse(&args.allow).map_err(plan_error)?;
    restrict(&mut req.pinned, &lowered.graph)?;
    req.top_k = top_k;
    let mut compiled = dplc_planner::compile(&req).map_err(plan_error)?;
    let text = load::read_text(&args.file)?;
    compiled.plan.source = ModelSource {
        file: args.file.display().to_string(),
        model: name,
        text,
    };
    Ok((compiled, lowered))
}

/// `--seq` and `--global-batch` within what dplc plans for, named as given.
fn check_sizes(args: &PlanArgs) -> Result<()> {
    use dplc_ir::validate as rules;
    for (flag, value, rule) in [
        (
            "--seq",
            args.seq,
            rules::seq as fn(u64) -> Result<(), String>,
        ),
        ("--global-batch", args.global_batch, rules::global_batch),
    ] {
        if let Some(v) = value {
            rule(v).map_err(|why| {
                miette!(
                    code = "dplc::input",
                    help = "pass a positive value within the limit, or leave the flag out to use the model's train section",
                    "{flag} {v}: {why}"
                )
            })?;
        }
    }
    Ok(())
}

/// Write `plan` as RON under dplc's output rule (`output::write`: atomic,
/// never over one of `inputs`).
pub fn write_plan(plan: &Plan, path: &Path, inputs: &[&Path]) -> Result<()> {
    let text = ron::ser::to_string_pretty(plan, ron::ser::PrettyConfig::default())
        .into_diagnostic()
        .wrap_err("cannot serialise the plan")?;
    crate::output::write(path, (text + "\n").as_bytes(), inputs)
}

/// Read a plan file written by `dplc compile -o`, and refuse it unless it is
/// one dplc can run: [`Plan::validate`], and, when the plan carries its
/// model's source, [`Plan::check_against`] that model. Every command that
/// reads a plan comes through here, so none explains, draws or verifies an
/// impossible one.
pub fn read_plan(path: &Path) -> Result<Plan> {
    let text = load::read_text(path)?;
    let plan: Plan = ron::from_str(&text).map_err(|e| {
        miette!(
            code = "dplc::plan",
            help = "a plan file is what `dplc compile -o plan.ron` writes; compile it again",
            "{} is not a dplc plan: {e}",
            path.display()
        )
    })?;
    check_plan(&plan).map_err(|e| {
        miette!(
            code = "dplc::invalid-plan",
            help = "the file was edited or damaged; compile the plan again with `dplc compile … -o plan.ron`",
            "{} is not a plan dplc can use: {e}",
            path.display()
        )
    })?;
    Ok(plan)
}

/// Why `plan` cannot be used, as one line: its own consistency, then its
/// fit to the model it carries.
pub fn check_plan(plan: &Plan) -> std::result::Result<(), String> {
    plan.validate().map_err(|e| e.to_string())?;
    dplc_planner::check_plan_cluster(plan).map_err(|e| e.to_string())?;
    if plan.source.text.is_empty() {
        return Ok(());
    }
    let name = &plan.source.file;
    let unit = dplc_frontend::parse(name, &plan.source.text)
        .map_err(|e| format!("source: the model source it carries does not parse: {e}"))?;
    let lowered = unit
        .lower(&plan.source.model)
        .map_err(|e| format!("source: cannot lower `{}`: {e}", plan.source.model))?;
    if lowered.graph.name != plan.model {
        return Err(format!(
            "model: the plan is for `{}`, but its source lowers `{}`",
            plan.model, lowered.graph.name
        ));
    }
    // A plan without layouts gets the planner's (as `run` completes it),
    // and the reason when there is none.
    let mut with_layout = plan.clone();
    let m = &plan.mesh;
    if plan.layout.is_none() && (m.tp > 1 || m.ep > 1) {
        let sp = plan.strategy.sequence_parallel;
        let layout = dplc_planner::derive_layout(&lowered.graph, m.tp, m.ep, sp).map_err(|e| {
            format!(
                "layout: the plan has none, and tp {} ep {} cannot split `{}`: {e}",
                m.tp, m.ep, plan.model
            )
        })?;
        with_layout.layout = Some(layout);
    }
    with_layout
        .check_against(&lowered.graph)
        .map_err(|e| e.to_string())
}

pub fn run(args: &Args) -> Result<()> {
    let (compiled, _) = plan(&args.plan, args.top, |_, _| Ok(()))?;
    let compiled = &compiled;
    if let Some(path) = &args.output {
        let inputs = args.plan.inputs();
        write_plan(&compiled.plan, path, &as_paths(&inputs))?;
    }
    if args.json {
        let mut v = dplc_planner::to_json(compiled);
        if args.verbose {
            v["layouts"] = serde_json::to_value(&compiled.layouts).into_diagnostic()?;
        }
        outln!(
            "{}",
            serde_json::to_string_pretty(&v).expect("JSON values serialise")
        );
        return Ok(());
    }
    out!("{}", dplc_planner::summary(compiled));
    if args.verbose {
        out!("{}", dplc_planner::layouts_summary(compiled));
    }
    match &args.output {
        Some(path) => outln!("  wrote     {}", path.display()),
        None => outln!("  (add -o plan.ron to write the plan for explain, viz and run)"),
    }
    Ok(())
}
