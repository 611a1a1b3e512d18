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
    /// overlap (`overlap=off`: the data-parallel gradient reduction waits for backward).
    #[arg(long, default_value = "")]
    pub strategy: String,
    /// Samples per step (default: the model's train section).
    #[arg(long)]
    pub global_batch: Option<u64>,
    /// Sequence length (default: the model's train section).
    #[arg(long)]
    pub seq: Option<u64>,
}

impl PlanArgs {
    /// The files this command reads: outputs may not be written over them.
    pub fn inputs(&self) -> Vec<&Path> {
        vec![self.file.as_path(), Path::new(&self.cluster)]
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

/// A planner error as the command line shows it.
pub fn plan_error(e: dplc_planner::PlanError) -> miette::Report {
    use dplc_planner::PlanError::*;
    let code = match &e {
        Cluster { .. } | UnknownDevice { .. } => "dplc::cluster",
        StrategySyntax { .. } | Strategy(_) => "dplc::strategy",
        Model(_) => "dplc::model",
        Infeasible(_) => "dplc::does-not-fit",
    };
    miette!(code = code, "{e}")
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
    // The zoo keeps its clusters beside the models, in `clusters/`.
    if let Some(dir) = file.parent().map(|d| d.join("clusters")) {
        let mut paths: Vec<PathBuf> = std::fs::read_dir(&dir)
            .into_iter()
            .flatten()
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.extension().is_some_and(|x| x == "dpl"))
            .collect();
        paths.sort();
        for path in paths {
            let Ok(other) = load::parse(&path) else {
                continue;
            };
            if let Some(c) = other.clusters()?.iter().find(|c| c.name == spec) {
                return dplc_planner::cluster_from_spec(c).map_err(plan_error);
            }
        }
    }
    let shorthand = spec
        .split(['x', 'X', '*'])
        .next()
        .is_some_and(|n| n.trim().parse::<u64>().is_ok());
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
    restrict: impl FnOnce(&mut dplc_planner::StrategyConstraints) -> Result<()>,
) -> Result<(Compiled, dplc_frontend::Lowered)> {
    let unit = load::parse(&args.file)?;
    let name = load::choose_model(&unit, &args.file, args.model.as_deref())?;
    let lowered = unit.lower(&name)?;
    let cluster = resolve_cluster(&args.cluster, &unit, &args.file)?;
    let mut req = PlanRequest::new(&lowered.graph, lowered.train.clone(), cluster.clone());
    req.global_batch = args.global_batch;
    req.seq = args.seq;
    req.pinned = dplc_planner::parse_strategy(&args.strategy).map_err(plan_error)?;
    restrict(&mut req.pinned)?;
    req.top_k = top_k;
    let mut compiled = dplc_planner::compile(&req).map_err(plan_error)?;
    let text = std::fs::read_to_string(&args.file)
        .into_diagnostic()
        .wrap_err_with(|| format!("cannot read {}", args.file.display()))?;
    compiled.plan.source = ModelSource {
        file: args.file.display().to_string(),
        model: name,
        text,
    };
    Ok((compiled, lowered))
}

/// Write `plan` as RON under dplc's output rule (`output::write`: atomic,
/// never over one of `inputs`).
pub fn write_plan(plan: &Plan, path: &Path, inputs: &[&Path]) -> Result<()> {
    let text = ron::ser::to_string_pretty(plan, ron::ser::PrettyConfig::default())
        .into_diagnostic()
        .wrap_err("cannot serialise the plan")?;
    crate::output::write(path, (text + "\n").as_bytes(), inputs)
}

/// Read a plan file written by `dplc compile -o`.
pub fn read_plan(path: &Path) -> Result<Plan> {
    let text = std::fs::read_to_string(path)
        .into_diagnostic()
        .wrap_err_with(|| format!("cannot read {}", path.display()))?;
    ron::from_str(&text).map_err(|e| {
        miette!(
            help = "a plan file is what `dplc compile -o plan.ron` writes; compile it again",
            "{} is not a dplc plan: {e}",
            path.display()
        )
    })
}

pub fn run(args: &Args) -> Result<()> {
    let (compiled, _) = plan(&args.plan, args.top, |_| Ok(()))?;
    let compiled = &compiled;
    if let Some(path) = &args.output {
        write_plan(&compiled.plan, path, &args.plan.inputs())?;
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
