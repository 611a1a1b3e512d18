//! `dplc run`: plan (or take the pinned strategy), then train on CPU ranks —
//! threads of this process — with a progress line or one JSON object per step.

use crate::compile::{self, PlanArgs};
use dplc_runtime::{Corpus, RunConfig, StepStats, StopFlag, TokenFormat};
use miette::{miette, Result, WrapErr};
use serde_json::json;
use std::io::{IsTerminal, Write};
use std::path::{Path, PathBuf};
use std::time::Instant;

#[derive(clap::Args)]
pub struct Args {
    #[command(flatten)]
    pub plan: PlanArgs,
    #[command(flatten)]
    pub train: TrainOpts,
    /// Also write the plan it trains with (RON), e.g. for `dplc verify`.
    #[arg(long)]
    pub save_plan: Option<PathBuf>,
    /// GPU clusters: run the plan's ranks on this machine's first N GPUs,
    /// rank r on GPU r mod N (ranks sharing a GPU hand each other their
    /// values on it), e.g. a tp=2 plan of a 2xH100 cluster on one GPU.
    /// Default: one GPU per rank.
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u32).range(1..))]
    pub gpus: Option<u32>,
}

/// How to train a planned model: what `run` and `launch` share.
#[derive(clap::Args, Clone, Debug)]
pub struct TrainOpts {
    /// Optimizer steps (default: the train section's `steps`, else 100).
    #[arg(long)]
    pub steps: Option<u64>,
    /// Seed of the parameters, the synthetic corpus and dropout (default 0,
    /// or the checkpoint's with --resume).
    #[arg(long)]
    pub seed: Option<u64>,
    /// Train on data instead of synthetic samples (repeatable): a token file
    /// for `tokens`/`targets` (raw bytes, one token each, or little-endian
    /// u16 ids when it ends in `.u16` or `.bin`); `NAME=FILE.npy`, a NumPy
    /// array for input NAME; or `FILE.safetensors`, whose tensors feed the
    /// inputs they are named after. Axis 0 of an array indexes the samples.
    #[arg(long)]
    pub data: Vec<PathBuf>,
    /// One JSON object per step and a final summary on stdout.
    #[arg(long)]
    pub json: bool,
    /// Seconds a rank waits for a peer before declaring it lost and stopping
    /// the run with an error that names it and the step.
    #[arg(long, default_value_t = 60.0)]
    pub timeout: f64,
    /// Write the measured timeline (Chrome trace-event JSON: every rank's
    /// forward, backward and step spans), to compare with `dplc viz --format trace`.
    #[arg(long)]
    pub trace: Option<PathBuf>,
    /// Save checkpoints into DIR (one `step-N` directory each): when the run
    /// ends or is stopped, and every --checkpoint-every steps.
    #[arg(long, value_name = "DIR")]
    pub checkpoint_dir: Option<PathBuf>,
    /// Also save a checkpoint every N steps.
    #[arg(long, value_name = "N", requires = "checkpoint_dir")]
    pub checkpoint_every: Option<u64>,
    /// Continue from a checkpoint: DIR's latest complete step (DIR defaults
    /// to --checkpoint-dir), or one `step-N` directory; any split can load
    /// it. --steps counts from the start of training.
    #[arg(long, value_name = "DIR", num_args = 0..=1)]
    pub resume: Option<Option<PathBuf>>,
    /// What computes each rank's stages on CPU ranks: the reference
    /// interpreter, or the fused kernels a GPU runs (interpreted on the CPU),
    /// to check on a laptop that they train the same. Default: reference on
    /// CPU ranks; GPUs always run fused.
    #[arg(long, value_enum)]
    pub compute: Option<ComputeArg>,
    /// CPU ranks' fused compute: store float tensors as a GPU of this
    /// precision does — rounded, counted at their width in the measured
    /// peak memory, a kernel reading a buffer as the wrong float type
    /// refused — to reproduce a bf16 GPU run's numbers on a CPU. Default
    /// f32, exact against the reference.
    #[arg(long, value_enum, requires = "compute")]
    pub storage: Option<StorageArg>,
    /// Skip up to N steps whose loss or gradient norm is NaN or infinite
    /// (their gradients dropped, as Megatron does); one more stops the run.
    /// By default the first such step stops it, naming the step.
    #[arg(long, value_name = "N", default_value_t = 0)]
    pub skip_nonfinite: u64,
}

impl TrainOpts {
    /// `--timeout` as a duration. A day is longer than any wait for a live
    /// peer; past it the deadline arithmetic would overflow.
    pub fn timeout(&self) -> Result<std::time::Duration> {
        if !(self.timeout.is_finite() && self.timeout > 0.0 && self.timeout <= 86_400.0) {
            return Err(miette!(
                "--timeout must be a positive number of seconds, at most 86400 (a day); got {}",
                self.timeout
            ));
        }
        Ok(std::time::Duration::from_secs_f64(self.timeout))
    }
}

/// `--storage`: how the fused compute on CPU ranks stores float tensors.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum StorageArg {
    F32,
    Bf16,
    F16,
}

impl From<StorageArg> for dplc_ir::DType {
    fn from(s: StorageArg) -> Self {
        match s {
            StorageArg::F32 => dplc_ir::DType::F32,
            StorageArg::Bf16 => dplc_ir::DType::BF16,
            StorageArg::F16 => dplc_ir::DType::F16,
        }
    }
}

/// `--compute`: which compute backend runs the stages.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum ComputeArg {
    Reference,
    Fused,
}

impl From<ComputeArg> for dplc_runtime::Compute {
    fn from(c: ComputeArg) -> Self {
        match c {
            ComputeArg::Reference => dplc_runtime::Compute::Reference,
            ComputeArg::Fused => dplc_runtime::Compute::Fused,
        }
    }
}

/// A model lowered, planned for CPU ranks and turned into a run.
pub struct Prepared {
    pub graph: dplc_ir::Graph,
    pub train: dplc_ir::TrainSpec,
    pub plan: dplc_ir::Plan,
    pub cfg: RunConfig,
}

/// Lower the model and plan it for CPU ranks. Context parallelism runs
/// when `--strategy` pins it (with every other split); left free, the CPU
/// plan keeps cp 1, as the tokens of a CPU run are few.
pub fn prepare(args: &PlanArgs) -> Result<Prepared> {
    let (compiled, lowered) = compile::plan(args, 0, |pinned, _| {
        if pinned.cp.is_none() {
            pinned.cp = Some(1);
        }
        // What prices another engine's stack is refused before any rank
        // starts (crate::stack holds the list).
        if let Some(e) = crate::stack::elsewhere(pinned) {
            let export = e
                .export
                .map(|to| format!(" and `dplc export` hands it to {to}"))
                .unwrap_or_default();
            return Err(miette!(
                help = format!(
                    "{} to train here; `dplc compile` prices it{export}",
                    e.instead
                ),
                "dplc's runtime {}; {} prices another engine",
                e.runtime,
                e.pin
            ));
        }
        // Its ranks keep every state in their own memory.
        pinned.offload = Some(dplc_ir::Offload::NONE);
        // Attention runs as the plan prices it: one fused kernel per
        // attention codegen takes (the default, `attention=fused`), or op
        // by op when `attention=unfused` is pinned (RunConfig::attention).
        // Its ranks run each tensor-parallel collective between kernels.
        if pinned.tp_overlap.is_none() {
            pinned.tp_overlap = Some(dplc_ir::TpOverlap::None);
        }
        // The root (embedding, head, loss) runs as the plan splits it:
        // over the vocabulary (the default) or whole (`root=replicated`).
        Ok(())
    })?;
    Prepared::new(lowered, compiled.plan)
}

impl Prepared {
    /// The run of `plan` on the lowered model: its batch and sequence, its split.
    fn new(lowered: dplc_frontend::Lowered, mut plan: dplc_ir::Plan) -> Result<Prepared> {
        complete_layout(&mut plan, &lowered.graph);
        plan.check_against(&lowered.graph).map_err(|e| {
            miette!(
                help = "compile the plan again from this model with `dplc compile … -o plan.ron`",
                "{e}"
            )
        })?;
        let mut train = lowered.train;
        train.global_batch = plan.strategy.global_batch;
        train.seq = plan.strategy.seq;
        let cfg = RunConfig::from_plan(&plan).map_err(|e| miette!("{e}"))?;
        Ok(Prepared {
            graph: lowered.graph,
            train,
            plan,
            cfg,
        })
    }

    /// A plan file's model, lowered from the source the plan carries.
    pub fn from_plan(plan: dplc_ir::Plan) -> Result<Prepared> {
        if plan.source.text.is_empty() {
            return Err(miette!(
                help = "compile the plan again with `dplc compile … -o plan.ron`",
                "the plan carries no model source (it predates dplc compile -o)"
            ));
        }
        let unit = dplc_frontend::parse(&plan.source.file, &plan.source.text)?;
        let lowered = unit.lower(&plan.source.model)?;
        Prepared::new(lowered, plan)
    }
}

/// A plan written before plans carried layouts gets the one the planner
/// would write now: the runtime never derives a layout itself.
pub fn complete_layout(plan: &mut dplc_ir::Plan, graph: &dplc_ir::Graph) {
    let m = &plan.mesh;
    if plan.layout.is_none() && (m.tp > 1 || m.ep > 1) {
        plan.layout =
            dplc_planner::derive_layout(graph, m.tp, m.ep, plan.strategy.sequence_parallel).ok();
    }
}

/// The vocabulary the model's token embedding has, if it has one.
pub fn vocab_of(graph: &dplc_ir::Graph) -> usize {
    graph
        .nodes()
        .find_map(|(_, n)| match n.op {
            dplc_ir::Op::Embedding => graph.tensor(n.inputs[0]).shape.dims()[0].as_const(),
            _ => None,
        })
        .map_or(256, |v| v.max(1) as usize)
}

/// One `--data` argument: a token file, `NAME=FILE.npy`, or `FILE.safetensors`.
enum DataArg<'a> {
    Tokens(&'a Path),
    Array(&'a str, &'a Path),
    Tensors(&'a Path),
}

impl<'a> DataArg<'a> {
    fn of(arg: &'a Path) -> DataArg<'a> {
        let text = arg.to_str().unwrap_or("");
        if let Some((name, file)) = text.split_once('=') {
            let ident =
                !name.is_empty() && name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_');
            if ident && !arg.exists() {
                return DataArg::Array(name, Path::new(file));
            }
        }
        match arg.extension().and_then(|e| e.to_str()) {
            Some("safetensors") => DataArg::Tensors(arg),
            _ => DataArg::Tokens(arg),
        }
    }

    fn path(&self) -> &'a Path {
        match *self {
            DataArg::Tokens(p) | DataArg::Array(_, p) | DataArg::Tensors(p) => p,
        }
    }
}

/// The files `--data` names (inputs of the command: never written over).
pub fn data_paths(data: &[PathBuf]) -> Vec<&Path> {
    data.iter().map(|d| DataArg::of(d).path()).collect()
}

/// The training data: the token stream of a file or the synthetic corpus of
/// `seed`, with the arrays `--data` names for other inputs.
pub fn corpus(data: &[PathBuf], graph: &dplc_ir::Graph, seed: u64) -> Result<Corpus> {
    let args: Vec<DataArg> = data.iter().map(|d| DataArg::of(d)).collect();
    let tokens: Vec<&Path> = args
        .iter()
        .filter_map(|a| match *a {
            DataArg::Tokens(p) => Some(p),
            _ => None,
        })
        .collect();
    let mut c = match tokens[..] {
        [] => Corpus::synthetic(seed, vocab_of(graph), 1 << 16),
        [path] => {
            let ext = path.extension().and_then(|e| e.to_str()).unwrap_or("");
            let format = if matches!(ext, "u16" | "bin") {
                TokenFormat::U16
            } else {
                TokenFormat::Bytes
            };
            Corpus::from_file(path, format, seed).map_err(|e| miette!("{e}"))?
        }
        _ => {
            return Err(miette!(
                help = "give one token file, and arrays as NAME=FILE.npy or FILE.safetensors",
                "--data names {} token files",
                tokens.len()
            ))
        }
    };
    for a in &args {
        let added = match *a {
            DataArg::Array(name, path) => c.add_npy(name, path),
            DataArg::Tensors(path) => c.add_safetensors(path),
            DataArg::Tokens(_) => Ok(()),
        };
        added.map_err(|e| miette!("{e}"))?;
    }
    Ok(c)
}

/// The fault `DPLC_FAULT` asks for: `kill:RANK:STEP` (the rank dies with an
/// error), `panic:RANK:STEP` or `stall:RANK:STEP` (it stops answering). For
/// testing that a run stops, names the rank and never hangs.
fn fault_from_env(spec: &str, processes: bool) -> Result<dplc_runtime::Faults> {
    let bad = || {
        miette!(
            help = "write kill:RANK:STEP, panic:RANK:STEP, stall:RANK:STEP, nan:RANK:STEP or \
                    checkpoint-kill:RANK:STEP, e.g. DPLC_FAULT=stall:1:3",
            "cannot read DPLC_FAULT=`{spec}`"
        )
    };
    let parts: Vec<&str> = spec.split(':').collect();
    let [kind, rank, step] = parts.as_slice() else {
        return Err(bad());
    };
    let (rank, step) = (
        rank.parse::<usize>().map_err(|_| bad())?,
        step.parse::<u64>().map_err(|_| bad())?,
    );
    let at = Some((rank, step));
    let mut f = dplc_runtime::Faults::default();
    match *kind {
        // A rank with a process of its own dies with it; a rank thread fails.
        "kill" if processes => f.exit_rank_at = at,
        "kill" => f.fail_rank_at = at,
        "panic" => f.panic_rank_at = at,
        "stall" => f.stall_rank_at = at,
        "nan" => f.nan_grad_at = at,
        // Dies after writing its shard of step STEP's checkpoint, before the
        // manifest: the previous checkpoint must stay the latest.
        "checkpoint-kill" => {
            f.kill_in_checkpoint = Some(dplc_runtime::CheckpointKill {
                rank,
                step,
                at: dplc_runtime::KillPoint::AfterShard,
            });
        }
        _ => return Err(bad()),
    }
    Ok(f)
}

/// Ctrl-C, SIGTERM (a scheduler's stop, `kill`) and SIGHUP (a closed
/// terminal) all stop every rank at the step boundary, which saves a
/// checkpoint and says where; the same signal again ends the process as
/// usual. A reader that goes away (`| head`) is an error on the next write,
/// not SIGPIPE's silent death, so the run still stops and saves.
#[cfg(unix)]
fn install_interrupt(flag: &StopFlag) {
    use std::sync::OnceLock;
    static FLAG: OnceLock<StopFlag> = OnceLock::new();
    const STOPS: [libc::c_int; 3] = [libc::SIGINT, libc::SIGTERM, libc::SIGHUP];
    extern "C" fn on_stop(sig: libc::c_int) {
        if let Some(f) = FLAG.get() {
            f.stop();
        }
        // SAFETY: restoring the default disposition is async-signal-safe.
        unsafe {
            libc::signal(sig, libc::SIG_DFL);
        }
    }
    if FLAG.set(flag.clone()).is_ok() {
        // SAFETY: the handler only stores to an atomic and calls `signal`,
        // both async-signal-safe; SIG_IGN is a valid disposition for SIGPIPE.
        unsafe {
            for sig in STOPS {
                libc::signal(sig, on_stop as *const () as libc::sighandler_t);
            }
            libc::signal(libc::SIGPIPE, libc::SIG_IGN);
        }
    }
}

#[cfg(not(unix))]
fn install_interrupt(_flag: &StopFlag) {}

fn describe(plan: &dplc_ir::Plan) -> String {
    let (m, s) = (&plan.mesh, &plan.strategy);
    let mut parts = vec![format!("dp {} × tp {} × pp {}", m.dp, m.tp, m.pp)];
    if m.cp > 1 {
        parts.push(format!("cp {} (load-balanced sequence chunks)", m.cp));
    }
    if m.ep > 1 {
        parts.push(format!("ep {}", m.ep));
    }
    if s.zero_stage > 0 {
        parts.push(format!("ZeRO-{}", s.zero_stage));
    }
    if m.pp > 1 {
        parts.push(s.schedule.name().to_string());
    }
    if s.sequence_parallel {
        parts.push("sp".into());
    }
    match s.recompute_layers {
        _ if s.recompute == dplc_ir::Recompute::None => {}
        0 => parts.push(format!("recompute {}", s.recompute.name())),
        n => parts.push(format!(
            "recompute {} (the first {n} layer{} of each chunk)",
            s.recompute.name(),
            if n == 1 { "" } else { "s" }
        )),
    }
    parts.push(format!(
        "micro-batch {} × {}",
        s.micro_batch, s.num_micro_batches
    ));
    parts.join(", ")
}

/// What the busiest device's allocator is to be compared with: each
/// worker's stage peak less the reserve its process holds outside the
/// allocator (the CUDA context, library workspaces), summed over the ranks
/// that share a GPU — the plan prices a device a rank, and a GPU that two
/// ranks share holds both ranks' memory. A rank of its own (a GPU each, or
/// CPU ranks, whose backends count their own buffers) is its stage's peak.
fn predicted_allocator_peak(plan: &dplc_ir::Plan, cfg: &RunConfig) -> u64 {
    let mut per_device = std::collections::BTreeMap::<usize, u64>::new();
    for rank in 0..cfg.world_size() {
        let stage = plan.stages.get(cfg.stage_of(rank));
        let peak = stage.map_or(0, |s| s.memory.total().saturating_sub(s.memory.reserve));
        let device = cfg.gpu_of(rank).unwrap_or(rank);
        let held = per_device.entry(device).or_default();
        *held = held.saturating_add(peak);
    }
    per_device.into_values().max().unwrap_or(0)
}

/// One step as the JSON line `--json` prints, on CPU ranks and GPUs alike.
fn step_json(st: &StepStats) -> serde_json::Value {
    let mut v = json!({
        "step": st.step,
        "loss": st.loss,
        "lr": st.lr,
        "grad_norm": st.grad_norm,
        "samples_per_s": st.samples_per_s,
    });
    if let Some(t) = st.tokens_per_s {
        v["tokens_per_s"] = json!(t);
    }
    if st.skipped {
        v["skipped"] = json!(true);
    }
    v
}

fn progress(st: &StepStats, steps: u64, from: u64, started: Instant, tty: bool) {
    let done = st.step + 1;
    let elapsed = started.elapsed().as_secs_f64();
    let eta = elapsed / (done - from).max(1) as f64 * (steps - done) as f64;
    let width = 24usize;
    let filled = (width as u64 * done / steps.max(1)) as usize;
    let bar = format!("{}{}", "=".repeat(filled), " ".repeat(width - filled));
    let speed = match st.tokens_per_s {
        Some(t) => format!("{t:.0} tok/s"),
        None => format!("{:.1} samples/s", st.samples_per_s),
    };
    let line = format!(
        "step {done:>5}/{steps} [{bar}] loss {:.4}  lr {:.2e}  {speed}  ETA {eta:.0}s",
        st.loss, st.lr
    );
    let mut err = std::io::stderr();
    if tty {
        let _ = write!(err, "\r{line}");
        if done == steps {
            let _ = writeln!(err);
        }
    } else if done == from + 1 || done == steps || done.is_multiple_of(10) {
        let _ = writeln!(err, "{line}");
    }
}

pub fn run(args: &Args) -> Result<()> {
    check_outputs(&args.train, args.save_plan.as_deref())?;
    let p = prepare(&args.plan)?;
    if let Some(path) = &args.save_plan {
        let inputs = args.plan.inputs();
        compile::write_plan(&p.plan, path, &compile::as_paths(&inputs))?;
    }
    if p.plan.cluster.device != "cpu" {
        // GPUs: the CUDA backend (cudarc, cuBLAS, NCCL); without a driver this
        // is where the run stops, with "no CUDA driver found".
        return train_on_gpus(&p, &args.train, args.gpus.map(|n| n as usize));
    }
    if args.gpus.is_some() {
        return Err(miette!(
            help = "--gpus is for GPU clusters (e.g. --cluster 2xH100)",
            "--gpus given for a CPU cluster ({})",
            p.plan.cluster.name
        ));
    }
    train_prepared(&p, &args.train)
}

/// A run's outputs (`--save-plan`, `--trace`) are distinct files outside
/// the checkpoint directories it saves into and resumes from
/// ([`crate::output::check_outputs`]), checked before anything is written.
fn check_outputs(args: &TrainOpts, save_plan: Option<&Path>) -> Result<()> {
    use crate::output::{KeptDir, Output};
    let mut outputs = Vec::new();
    if let Some(path) = save_plan {
        outputs.push(Output {
            flag: "--save-plan",
            path,
        });
    }
    if let Some(path) = &args.trace {
        outputs.push(Output {
            flag: "--trace",
            path,
        });
    }
    let mut kept = Vec::new();
    if let Some(path) = &args.checkpoint_dir {
        kept.push(KeptDir {
            flag: "--checkpoint-dir",
            path,
            holds: "checkpoints",
        });
    }
    if let Some(Some(path)) = &args.resume {
        kept.push(KeptDir {
            flag: "--resume",
            path,
            holds: "checkpoints",
        });
    }
    crate::output::check_outputs(&outputs, &kept)
}

/// GPUs always run the fused kernels: `--compute reference` there is a mistake.
pub fn refuse_reference_on_gpus(args: &TrainOpts) -> Result<()> {
    if args.compute == Some(ComputeArg::Reference) {
        return Err(miette!(
            help =
                "leave out --compute, or plan for CPU ranks (--cluster Nxcpu) to run the reference",
            "a GPU cluster always runs the fused kernels; --compute reference is for CPU ranks"
        ));
    }
    Ok(())
}

/// Train a prepared model on GPUs: the same schedule executor as CPU ranks,
/// its stages on the fused kernels of the CUDA backend, one rank per GPU of
/// the plan's cluster, or on this machine's first `gpus` (every strategy,
/// checkpoints, `--trace`, faults).
pub fn train_on_gpus(p: &Prepared, args: &TrainOpts, gpus: Option<usize>) -> Result<()> {
    let cluster = (p.plan.cluster.nodes * p.plan.cluster.devices_per_node) as usize;
    let gpus = gpus.unwrap_or(cluster).min(p.cfg.world_size()).max(1);
    // Say "no CUDA driver found" (or which GPU is missing) before anything else.
    refuse_reference_on_gpus(args)?;
    dplc_runtime::gpu::open_devices(gpus).map_err(|e| miette!("{e}"))?;
    train_on_gpus_as(p, args, gpus, None)
}

/// Train on GPUs as `process` (one rank of a launcher's world, on GPU
/// `rank mod gpus`) or, without one, as every rank of the plan in threads.
pub fn train_on_gpus_as(
    p: &Prepared,
    args: &TrainOpts,
    gpus: usize,
    process: Option<dplc_runtime::Process<'_>>,
) -> Result<()> {
    refuse_reference_on_gpus(args)?;
    let device = dplc_runtime::Device::Cuda {
        gpus,
        dtype: dplc_runtime::gpu::storage_dtype(p.train.precision),
    };
    train_prepared_on(p, args, process, device)
}

/// Train a prepared model on CPU ranks, reporting as `opts` says.
pub fn train_prepared(p: &Prepared, args: &TrainOpts) -> Result<()> {
    train_prepared_on(p, args, None, dplc_runtime::Device::Host)
}

/// Train as `dplc run` does; with `process`, as that one rank of a world of
/// processes, where only rank 0 prints.
pub fn train_prepared_on(
    p: &Prepared,
    args: &TrainOpts,
    process: Option<dplc_runtime::Process<'_>>,
    device: dplc_runtime::Device,
) -> Result<()> {
    check_outputs(args, None)?;
    // Only rank 0 speaks for a world of processes.
    let quiet = process.is_some_and(|p| p.rank() != 0);
    let steps = args.steps.or(p.train.steps).unwrap_or(100);
    if steps == 0 {
        return Err(miette!("--steps must be positive"));
    }
    let resume = match &args.resume {
        None => None,
        Some(dir) => {
            let dir = match (dir, &args.checkpoint_dir) {
                (Some(d), _) | (None, Some(d)) => d.clone(),
                (None, None) => {
                    return Err(miette!(
                    help =
                        "pass --resume DIR, or --checkpoint-dir DIR to resume from and save into",
                    "--resume needs a directory"
                ))
                }
            };
            let ck = dplc_runtime::Checkpoint::open(&dir).map_err(|e| {
                miette!(
                    help = "a checkpoint directory is what `dplc run --checkpoint-dir` wrote",
                    "{e}"
                )
            })?;
            Some(ck)
        }
    };
    let seed = match (&resume, args.seed) {
        (_, Some(seed)) => seed,
        (Some(ck), None) => ck.seed(),
        (None, None) => 0,
    };
    // Each input is checked against its data when the ranks start.
    let data = corpus(&args.data, &p.graph, seed)?;
    let mut cfg = p.cfg.clone();
    cfg.timeout = args.timeout()?;
    cfg.skip_nonfinite = args.skip_nonfinite;
    // GPUs always run the fused kernels; CPU ranks what `--compute` says.
    cfg.compute = match device {
        dplc_runtime::Device::Host => args.compute.unwrap_or(ComputeArg::Reference).into(),
        dplc_runtime::Device::Cuda { .. } => dplc_runtime::Compute::Fused,
    };
    if let Some(storage) = args.storage {
        if cfg.compute != dplc_runtime::Compute::Fused
            || !matches!(device, dplc_runtime::Device::Host)
        {
            return Err(miette!(
                help = "add --compute fused on CPU ranks; a GPU run stores its precision's type",
                "--storage is for the fused compute on CPU ranks"
            ));
        }
        cfg.host_storage = storage.into();
    }
    cfg.device = device;
    if let Ok(spec) = std::env::var("DPLC_FAULT") {
        cfg.faults = fault_from_env(&spec, process.is_some())?;
    }
    if let Some(path) = &args.trace {
        let mut inputs = vec![Path::new(&p.plan.source.file)];
        inputs.extend(data_paths(&args.data));
        crate::output::check(path, &inputs).wrap_err("cannot write the trace")?;
        cfg.trace = dplc_runtime::TraceSink::recording();
    }
    if let Some(dir) = &args.checkpoint_dir {
        cfg.checkpoint = Some(dplc_runtime::CheckpointConfig {
            dir: dir.clone(),
            every: args.checkpoint_every.unwrap_or(0),
        });
    }
    if args.checkpoint_every == Some(0) {
        return Err(miette!("--checkpoint-every must be positive"));
    }
    let from = resume.as_ref().map_or(0, |ck| ck.step());
    if from >= steps {
        return Err(miette!(
            help = "--steps counts from the start of training: raise it past the checkpoint's step",
            "the checkpoint is at step {from} and --steps is {steps}: nothing left to train"
        ));
    }
    if let Some(ck) = &resume {
        cfg.resume_from = Some(ck.dir().to_path_buf());
        if !args.json {
            note!(
                "resuming from {} at step {} (saved under {}, seed {}{})",
                ck.dir().display(),
                ck.step(),
                ck.split(),
                ck.seed(),
                ck.run_id()
                    .map(|r| format!(", run {r}"))
                    .unwrap_or_default()
            );
            // Allowed (a run may go on at another length or batch), but said:
            // the samples after the checkpoint are then cut differently.
            let (seq, batch) = ck.seq_and_batch();
            let has_seq = p.graph.sym_by_name("seq").is_some();
            if (has_seq && seq != p.train.seq) || batch != p.train.global_batch {
                note!(
                    "the checkpoint trained at {}global batch {batch}; this run goes on at {}global batch {}",
                    if has_seq { format!("seq {seq}, ") } else { String::new() },
                    if has_seq { format!("seq {}, ", p.train.seq) } else { String::new() },
                    p.train.global_batch
                );
            }
        }
    }
    install_interrupt(&cfg.stop);
    let servers = match cfg.ranks() - cfg.world_size() {
        0 => String::new(),
        n => format!(" and {n} dedicated parameter-server ranks"),
    };
    let ranks = match cfg.device {
        dplc_runtime::Device::Host => format!("{} CPU ranks{servers}", cfg.world_size()),
        dplc_runtime::Device::Cuda { gpus, dtype } => {
            format!(
                "{} ranks on {gpus} GPU(s){servers}, {dtype}",
                cfg.world_size()
            )
        }
    };
    let has_seq = p.graph.sym_by_name("seq").is_some();
    if !args.json && !quiet {
        let seq = if has_seq {
            format!("seq {}, ", p.train.seq)
        } else {
            String::new()
        };
        note!(
            "training {} on {ranks}: {}; {seq}global batch {}, {steps} steps",
            p.plan.model,
            describe(&p.plan),
            p.train.global_batch
        );
    }
    let started = Instant::now();
    let tty = std::io::stderr().is_terminal();
    let json = args.json;
    let on_step = |st: &StepStats| {
        if json {
            let line = step_json(st);
            // Nobody reads the stream any more (`| head`): stop as for Ctrl-C.
            if writeln!(std::io::stdout(), "{line}").is_err() {
                cfg.stop.stop();
            }
        } else {
            if st.skipped {
                note!(
                    "\nstep {}: the loss is {} and the gradient norm {}: step skipped (--skip-nonfinite)",
                    st.step,
                    st.loss,
                    st.grad_norm
                );
            }
            progress(st, steps, from, started, tty);
        }
    };
    let report = match process {
        None => dplc_runtime::train(&p.graph, &p.train, &cfg, &data, steps, seed, on_step),
        Some(process) => dplc_runtime::train_process(
            &p.graph, &p.train, &cfg, &data, steps, seed, process, on_step,
        ),
    }
    .map_err(|e| miette!("{e}"))?;
    if quiet {
        return Ok(());
    }
    let elapsed = started.elapsed().as_secs_f64();
    if let Some(path) = &args.trace {
        let trace = crate::viz::measured_trace(&p.plan, &cfg.trace.spans());
        let mut inputs = vec![Path::new(&p.plan.source.file)];
        inputs.extend(data_paths(&args.data));
        crate::output::write(path, trace.to_string().as_bytes(), &inputs)
            .wrap_err("cannot write the trace")?;
    }
    let done = report.steps.len() as u64;
    let first = report.steps.first().map_or(f64::NAN, |s| s.loss);
    let last = report.steps.last().map_or(f64::NAN, |s| s.loss);
    let samples = (done * p.train.global_batch) as f64;
    if json {
        let mut summary = json!({
                "summary": true,
                "model": p.plan.model,
                "ranks": cfg.ranks(),
                "server_ranks": cfg.ranks() - cfg.world_size(),
                "compute": cfg.compute.name(),
                "gpus": match cfg.device {
                    dplc_runtime::Device::Host => 0,
                    dplc_runtime::Device::Cuda { gpus, .. } => gpus,
                },
                "steps": done,
                "start_step": from,
                "interrupted": report.interrupted,
                "checkpoints": report.checkpoints,
                "first_loss": first,
                "final_loss": last,
                "seconds": elapsed,
                "samples_per_s": samples / elapsed.max(1e-9),
        });
        // The step as planned, so a peer can take the same one
        // (bench/torch_gpt2_step.py under scripts/gpu-check.sh).
        let st = &p.plan.strategy;
        summary["global_batch"] = json!(p.train.global_batch);
        summary["micro_batch"] = json!(st.micro_batch);
        summary["num_micro_batches"] = json!(st.num_micro_batches);
        if has_seq {
            summary["seq"] = json!(p.train.seq);
            summary["tokens_per_s"] = json!(samples * p.train.seq as f64 / elapsed.max(1e-9));
        }
        // The data-parallel reduction as it ran and as the plan priced it:
        // the busiest rank's bytes sent per step, and the whole loss curve,
        // for `dplc viz --runs` to draw beside other runs.
        let s = &p.plan.strategy;
        summary["sync"] = json!(s.sync.keys());
        summary["compress"] = json!(s.compress.name());
        // Per step of the steady state: a compression's warm-up steps are
        // not counted (`Traffic::steps`), as the plan does not price them.
        summary["dp_bytes_sent_per_step"] = json!(report
            .dp_traffic
            .iter()
            .map(|t| t.sent as f64 / t.steps.max(1) as f64)
            .fold(0.0, f64::max));
        summary["compress_warmup_steps"] = json!(s.compress.warmup_steps(&p.train.schedule));
        summary["predicted_dp_bytes_per_step"] = json!(p.plan.estimate.breakdown.dp_link_bytes);
        summary["predicted_step_time_s"] = json!(p.plan.estimate.step_time_s);
        summary["losses"] = json!(report.steps.iter().map(|s| s.loss).collect::<Vec<_>>());
        // What the fused compute ran fused, so a run shows its attention
        // kernels were the fused ones (and why not, where not).
        if let Some(a) = &report.attention {
            summary["fused_attentions"] = json!(a.fused);
            summary["unfused_attentions"] = json!(a.unfused);
        }
        if let Some(d) = &report.device {
            summary["device"] = json!(d.name);
            summary["kernels"] = json!(d.kernels);
            summary["collectives"] = json!(d.collectives.name());
        }
        if let Some(n) = report.host_crossings {
            summary["host_crossings"] = json!(n);
        }
        // The fused compute counts its memory (a GPU's allocator, or the
        // host backend's buffers on CPU ranks): beside what the plan said.
        if let Some(peak) = report.memory_peak_bytes {
            summary["peak_memory_bytes"] = json!(peak);
            summary["predicted_peak_memory_bytes"] = json!(p.plan.estimate.peak_memory_bytes);
            // What the allocator's peak compares with: the busiest GPU's
            // share of the plan, less what a process holds outside its
            // allocator.
            summary["predicted_allocator_peak_bytes"] =
                json!(predicted_allocator_peak(&p.plan, &cfg));
            // By kind: `buffers` holds the CUDA context and library
            // workspaces, which the allocator's peak does not count.
            summary["predicted_memory"] = json!(p.plan.stages.first().map(|s| &s.memory));
        }
        outln!("{summary}");
    } else {
        if tty && report.interrupted {
            note!("");
        }
        let rate = samples / elapsed.max(1e-9);
        let speed = if has_seq {
            format!("{:.0} tok/s", rate * p.train.seq as f64)
        } else {
            format!("{rate:.1} samples/s")
        };
        note!("{done} steps in {elapsed:.1}s ({speed}): loss {first:.4} → {last:.4}");
        if let Some(d) = &report.device {
            let gib = |b: u64| b as f64 / (1u64 << 30) as f64;
            note!(
                "on {}: peak device memory {:.2} GiB (the plan predicted {:.2} GiB); {} kernels; \
                 collectives {}",
                d.name,
                gib(d.peak_bytes),
                gib(p.plan.estimate.peak_memory_bytes),
                d.kernels,
                d.collectives.name()
            );
        }
        if let Some(last) = report.checkpoints.last() {
            note!("checkpoint saved: {}", last.display());
        }
    }
    if report.interrupted {
        return Err(Interrupted {
            step: from + done,
            steps,
            loss: last,
        }
        .into());
    }
    Ok(())
}

/// A run a signal stopped: every rank at the same step boundary, the
/// checkpoint saved. The command fails (it did not train the steps asked
/// for), but no rank did: a world of processes ends as each process does,
/// not by aborting the job.
#[derive(Debug)]
pub struct Interrupted {
    step: u64,
    steps: u64,
    loss: f64,
}

impl std::fmt::Display for Interrupted {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "interrupted: stopped cleanly after step {} of {} (loss {:.4})",
            self.step, self.steps, self.loss
        )
    }
}

impl std::error::Error for Interrupted {}

impl miette::Diagnostic for Interrupted {}
