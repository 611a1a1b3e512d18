//! `dplc build` writes what a user takes to the cluster: the executable, the
//! plan, the PTX of the generated kernels, a manifest of their hashes and a
//! RUN.md with the launch lines. `dplc launch DIR` is what every rank runs:
//! it checks the hashes, finds its role from the launcher's environment and
//! refuses a world that does not match the plan.

use crate::compile::{self, read_plan, PlanArgs};
use crate::run::{self, Prepared, TrainOpts};
use dplc_codegen::{fnv1a, Arch, Nvrtc};
use dplc_ir::Plan;
use dplc_runtime::gpu::{compile_graph, storage_dtype, LaunchEnv};
use miette::{miette, IntoDiagnostic, Result, WrapErr};
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};

#[derive(clap::Args)]
pub struct BuildArgs {
    #[command(flatten)]
    pub plan: PlanArgs,
    /// The directory to write (created; files in it are replaced).
    #[arg(short, long)]
    pub output: PathBuf,
    /// Report errors as a JSON object on stdout (for scripts).
    #[arg(long)]
    pub json: bool,
}

#[derive(clap::Args)]
pub struct LaunchArgs {
    /// A directory written by `dplc build`.
    pub dir: PathBuf,
    #[command(flatten)]
    pub train: TrainOpts,
}

/// One file of the artifact and its FNV-1a 64 hash (a corrupted or swapped
/// file is caught before anything runs; not a defence against tampering).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
struct FileEntry {
    path: String,
    bytes: u64,
    fnv1a64: String,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
struct Manifest {
    format: u32,
    model: String,
    cluster: String,
    /// Ranks the plan needs.
    world_size: u64,
    /// `cpu`: every rank is a thread of one process; `gpu`: one process per GPU.
    backend: String,
    files: Vec<FileEntry>,
}

const MANIFEST: &str = "manifest.json";

fn write(dir: &Path, rel: &str, bytes: &[u8], files: &mut Vec<FileEntry>) -> Result<()> {
    let path = dir.join(rel);
    if let Some(parent) = path.parent() {
        std::fs::create_dir_all(parent)
            .into_diagnostic()
            .wrap_err_with(|| format!("cannot create {}", parent.display()))?;
    }
    crate::output::write(&path, bytes, &[])?;
    files.push(FileEntry {
        path: rel.to_string(),
        bytes: bytes.len() as u64,
        fnv1a64: format!("{:016x}", fnv1a(bytes)),
    });
    Ok(())
}

/// `build -o DIR` writes into DIR only if it is new, empty, or an earlier
/// artifact (it has a manifest): a directory of other files — `/`, a home,
/// the models — is never written into.
fn check_output_dir(dir: &Path, inputs: &[&Path]) -> Result<()> {
    let meta = match std::fs::metadata(dir) {
        Ok(m) => m,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
        Err(e) => {
            return Err(e)
                .into_diagnostic()
                .wrap_err_with(|| format!("cannot use {} for the artifact", dir.display()))
        }
    };
    if !meta.is_dir() {
        return Err(miette!(
            help = "name a new directory for the artifact",
            "{} exists and is not a directory",
            dir.display()
        ));
    }
    let mut entries = std::fs::read_dir(dir)
        .into_diagnostic()
        .wrap_err_with(|| format!("cannot read {}", dir.display()))?;
    // A directory of other things is never written into: an earlier
    // artifact is recognised by its manifest, which must be dplc's (a web
    // app's `manifest.json` is not).
    if entries.next().is_some() {
        let ours = std::fs::read_to_string(dir.join(MANIFEST))
            .ok()
            .and_then(|text| serde_json::from_str::<Manifest>(&text).ok())
            .is_some_and(|m| m.format == 1);
        if !ours {
            return Err(miette!(
                help = "name a new or empty directory, or an artifact `dplc build` wrote before",
                "{} is not empty and is not a dplc artifact (it has no dplc build {MANIFEST}); dplc will not write into it",
                dir.display()
            ));
        }
    }
    for input in inputs {
        if input
            .parent()
            .is_some_and(|p| crate::output::same_file(p, dir))
        {
            return Err(miette!(
                help = "name a new directory for the artifact",
                "{} holds {}, an input of this build",
                dir.display(),
                input.display()
            ));
        }
    }
    Ok(())
}

fn is_cpu(plan: &Plan) -> bool {
    plan.cluster.device == "cpu"
}

fn arch_of(device: &str) -> Result<Arch> {
    match device {
        d if d.starts_with("A100") => Ok(Arch::Sm80),
        d if d.starts_with("H100") || d.starts_with("H200") => Ok(Arch::Sm90),
        d => Err(miette!(
            "dplc generates kernels for sm_80 (A100) and sm_90 (H100, H200), not for {d}"
        )),
    }
}

fn world_size(plan: &Plan) -> u64 {
    plan.cluster.nodes * plan.cluster.devices_per_node
}

pub fn build(args: &BuildArgs) -> Result<()> {
    let (compiled, lowered) = compile::plan(&args.plan, 0, |pinned, _| {
        // What prices another engine's stack: dplc's runtime would not run
        // what the plan priced (crate::stack holds the list).
        if let Some(e) = crate::stack::elsewhere(pinned) {
            let export = e
                .export
                .map(|to| format!(", or `dplc export` the plan to {to}"))
                .unwrap_or_default();
            return Err(miette::miette!(
                help = format!("{}{export}", e.instead),
                "dplc's runtime {}, so an artifact cannot run {}",
                e.runtime,
                e.pin
            ));
        }
        if pinned.ps_ranks == Some(dplc_ir::ServerRanks::Dedicated) {
            return Err(miette::miette!(
                help = "pin ps_ranks=colocated, or train it with `dplc run` on CPU ranks",
                "an artifact runs one process per device of the cluster; dedicated parameter \
                 servers are ranks beyond them"
            ));
        }
        pinned.offload = Some(dplc_ir::Offload::NONE);
        Ok(())
    })?;
    let plan = compiled.plan;
    let dir = &args.output;
    check_output_dir(dir, &crate::compile::as_paths(&args.plan.inputs()))?;
    // Everything that can fail for a reason other than the disk — reading
    // the executable, NVRTC, the kernels — runs before the directory is
    // touched: a failed build leaves no half-written artifact behind (one
    // that a second build would then refuse to write into), nor a broken
    // earlier one.
    let exe = std::env::current_exe()
        .and_then(std::fs::read)
        .into_diagnostic()
        .wrap_err("cannot read the dplc executable to copy it")?;
    let text =
        ron::ser::to_string_pretty(&plan, ron::ser::PrettyConfig::default()).into_diagnostic()?;
    let ptx = if is_cpu(&plan) {
        Vec::new()
    } else {
        gpu_kernels(&plan, &lowered)?
    };
    std::fs::create_dir_all(dir)
        .into_diagnostic()
        .wrap_err_with(|| format!("cannot create {}", dir.display()))?;
    // An earlier artifact stops being one while its files are replaced: the
    // new manifest, written last, makes the directory whole again.
    match std::fs::remove_file(dir.join(MANIFEST)) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
            return Err(e)
                .into_diagnostic()
                .wrap_err_with(|| format!("cannot replace the artifact in {}", dir.display()))
        }
        _ => {}
    }
    let mut files = Vec::new();
    write(dir, "dplc", &exe, &mut files)?;
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(dir.join("dplc"), std::fs::Permissions::from_mode(0o755))
            .into_diagnostic()?;
    }
    write(dir, "plan.ron", text.as_bytes(), &mut files)?;
    for (name, ptx) in &ptx {
        write(
            dir,
            &format!("kernels/{name}.ptx"),
            ptx.as_bytes(),
            &mut files,
        )?;
    }
    let kernels = ptx.len();
    let world = world_size(&plan);
    let manifest = Manifest {
        format: 1,
        model: plan.model.clone(),
        cluster: plan.cluster.name.clone(),
        world_size: world,
        backend: if is_cpu(&plan) { "cpu" } else { "gpu" }.into(),
        files,
    };
    let run_md = run_md(&plan, &manifest, dir);
    // RUN.md is documentation, not checked; the manifest goes last so that a
    // directory with a manifest is a complete artifact.
    crate::output::write(&dir.join("RUN.md"), run_md.as_bytes(), &[])?;
    let json = serde_json::to_string_pretty(&manifest).expect("the manifest serialises");
    crate::output::write(&dir.join(MANIFEST), (json + "\n").as_bytes(), &[])?;
    outln!(
        "built {} for {} in {}: the executable, plan.ron{}, {MANIFEST}, RUN.md",
        plan.model,
        plan.cluster.name,
        dir.display(),
        if kernels > 0 {
            format!(", {kernels} kernels (PTX)")
        } else {
            String::new()
        }
    );
    Ok(())
}

/// The PTX of a GPU plan's kernels, by name: what NVRTC makes of the
/// fused program for the plan's device.
fn gpu_kernels(plan: &Plan, lowered: &dplc_frontend::Lowered) -> Result<Vec<(String, String)>> {
    let arch = arch_of(&plan.cluster.device)?;
    let nvrtc = Nvrtc::load().map_err(|e| {
        miette!(
            help = "install it with scripts/install-nvrtc.sh and export DPLC_NVRTC_LIB=<the path it prints>",
            "a GPU plan needs NVRTC to generate its kernels: {e}"
        )
    })?;
    let graph = compile_graph(
        &lowered.graph,
        storage_dtype(lowered.train.precision),
        arch,
        plan.strategy.attention,
        &nvrtc,
    )
    .map_err(|e| miette!("{e}"))?;
    Ok(graph
        .kernels
        .iter()
        .map(|(name, k)| (name.clone(), k.ptx.text.clone()))
        .chain(
            graph
                .attention
                .iter()
                .map(|(name, a)| (name.clone(), a.ptx.text.clone())),
        )
        .collect())
}

fn run_md(plan: &Plan, m: &Manifest, dir: &Path) -> String {
    let d = dir.display();
    let mut s = format!(
        "# {} on {}\n\nBuilt by `dplc build`: `dplc` (this executable), `plan.ron`, `{MANIFEST}` \
         (the hash of every file, checked before anything runs){}.\n\n\
         Mesh: dp {} × tp {} × pp {} × cp {} (ep {}); {} ranks.\n\n## Launch\n\n",
        plan.model,
        plan.cluster.name,
        if m.backend == "gpu" {
            " and `kernels/*.ptx`"
        } else {
            ""
        },
        plan.mesh.dp,
        plan.mesh.tp,
        plan.mesh.pp,
        plan.mesh.cp,
        plan.mesh.ep,
        m.world_size
    );
    if m.backend == "cpu" {
        s.push_str(&format!(
            "The CPU backend runs every rank as a thread of one process:\n\n    {d}/dplc launch {d} --steps 100\n\n\
             or each rank in a process of its own, joined by MPI (a dplc built with the `mpi` \
             feature):\n\n    mpirun -np {} {d}/dplc launch {d} --steps 100\n\n\
             Both train bit for bit alike.\n",
            m.world_size
        ));
    } else {
        let (nodes, per) = (plan.cluster.nodes, plan.cluster.devices_per_node);
        s.push_str(&format!(
            "One process per GPU; every rank runs the same command and finds its role in the \
             launcher's environment (RANK/WORLD_SIZE/LOCAL_RANK/MASTER_ADDR/MASTER_PORT, Slurm's \
             SLURM_PROCID/SLURM_NTASKS/SLURM_LOCALID, or Open MPI's).\n\n\
             torchrun (on each node):\n\n    torchrun --no-python --nnodes={nodes} --nproc-per-node={per} \
             --rdzv-backend=c10d --rdzv-endpoint=$MASTER_ADDR:$MASTER_PORT {d}/dplc launch {d}\n\n\
             Slurm:\n\n    srun --nodes={nodes} --ntasks-per-node={per} --gpus-per-node={per} {d}/dplc launch {d}\n\n\
             Open MPI:\n\n    mpirun -np {} --map-by ppr:{per}:node {d}/dplc launch {d}\n\n\
             A world of another size than {} is refused.\n",
            m.world_size, m.world_size
        ));
    }
    s
}

/// Read the manifest and check every file's size and hash; name the first
/// that does not match.
fn check(dir: &Path) -> Result<Manifest> {
    let path = dir.join(MANIFEST);
    let text = std::fs::read_to_string(&path).map_err(|e| {
        miette!(
            help = "a directory written by `dplc build -o DIR` has one",
            "cannot read {}: {e}",
            path.display()
        )
    })?;
    let m: Manifest = serde_json::from_str(&text)
        .map_err(|e| miette!("{} is not a dplc build manifest: {e}", path.display()))?;
    for f in &m.files {
        let p = dir.join(&f.path);
        let bytes = std::fs::read(&p).map_err(|e| {
            miette!(
                help = "rebuild the artifact with `dplc build`",
                "{} is missing: {e}",
                p.display()
            )
        })?;
        let hash = format!("{:016x}", fnv1a(&bytes));
        if bytes.len() as u64 != f.bytes || hash != f.fnv1a64 {
            return Err(miette!(
                help = "the file changed since `dplc build`; rebuild the artifact",
                "{} is corrupted: {} bytes with hash {hash}, the manifest says {} bytes with hash {}",
                p.display(),
                bytes.len(),
                f.bytes,
                f.fnv1a64
            ));
        }
    }
    Ok(m)
}

/// The manifest and the plan must describe the same run: hashes only say
/// the files are as the manifest lists them, and a manifest rewritten over
/// another plan would otherwise train another model or another world.
fn agree(m: &Manifest, plan: &Plan, dir: &Path) -> Result<()> {
    let backend = if is_cpu(plan) { "cpu" } else { "gpu" };
    let mismatch = [
        ("model", m.model.clone(), plan.model.clone()),
        ("cluster", m.cluster.clone(), plan.cluster.name.clone()),
        (
            "world size",
            m.world_size.to_string(),
            world_size(plan).to_string(),
        ),
        ("backend", m.backend.clone(), backend.to_string()),
    ]
    .into_iter()
    .find(|(_, a, b)| a != b);
    if let Some((what, manifest, planned)) = mismatch {
        return Err(miette!(
            help = "rebuild the artifact with `dplc build`",
            "{}: the manifest's {what} is {manifest}, but plan.ron's is {planned}",
            dir.display()
        ));
    }
    if m.format != 1 {
        return Err(miette!(
            help = "rebuild the artifact with this dplc",
            "{}: manifest format {} (this dplc reads format 1)",
            dir.display(),
            m.format
        ));
    }
    Ok(())
}

pub fn launch(args: &LaunchArgs) -> Result<()> {
    // The artifact is this command's input, whole: no trace over its
    // executable or plan, no checkpoints among its files.
    let mut outputs = Vec::new();
    if let Some(path) = &args.train.trace {
        outputs.push(crate::output::Output {
            flag: "--trace",
            path,
        });
    }
    if let Some(path) = &args.train.checkpoint_dir {
        outputs.push(crate::output::Output {
            flag: "--checkpoint-dir",
            path,
        });
    }
    let artifact = crate::output::KeptDir {
        flag: "the artifact",
        path: &args.dir,
        holds: "the executable, its plan and its kernels",
    };
    crate::output::check_outputs(&outputs, &[artifact])?;
    let m = check(&args.dir)?;
    let plan = read_plan(&args.dir.join("plan.ron"))?;
    agree(&m, &plan, &args.dir)?;
    let env = if m.backend == "cpu" {
        // CPU ranks meet through MPI, not through a rendezvous at MASTER_ADDR.
        LaunchEnv::from_vars(|k| {
            std::env::var(k)
                .ok()
                .filter(|v| !v.is_empty())
                .or_else(|| (k == "MASTER_ADDR").then(|| "127.0.0.1".to_string()))
        })
    } else {
        LaunchEnv::from_env()
    }
    .map_err(|e| miette!("{e}"))?;
    let processes = env.world_size as u64;
    if m.backend == "cpu" {
        if processes == 1 {
            let p = Prepared::from_plan(plan)?;
            return run::train_prepared(&p, &args.train);
        }
        if processes != m.world_size {
            return Err(miette!(
                help = format!(
                    "start one process (its ranks run as threads) or {} under mpirun",
                    m.world_size
                ),
                "the plan needs {} CPU ranks ({}), but the launcher started {processes} processes",
                m.world_size,
                m.cluster
            ));
        }
        return launch_cpu_processes(plan, &args.train, env.rank, processes);
    }
    if processes != m.world_size {
        return Err(miette!(
            help = "launch one process per GPU of the plan's cluster; RUN.md has the lines",
            "the plan needs {} ranks ({}), but the launcher started {processes}",
            m.world_size,
            m.cluster
        ));
    }
    let p = Prepared::from_plan(plan)?;
    if processes == 1 {
        return run::train_on_gpus(&p, &args.train, None);
    }
    // One process per GPU, each rank of the plan on its node's GPU
    // `local_rank`, meeting the others over TCP at the launcher's
    // MASTER_ADDR:MASTER_PORT: the schedule executor, every split.
    let per_node = p.plan.cluster.devices_per_node.max(1) as usize;
    if env.rank % per_node != env.local_rank {
        return Err(miette!(
            help = "launch ranks node by node (torchrun and srun do): rank = node × GPUs per node + local rank",
            "rank {} is local rank {} of a node with {per_node} GPUs",
            env.rank,
            env.local_rank
        ));
    }
    let timeout = args.train.timeout()?.max(std::time::Duration::from_secs(1));
    let process = dplc_runtime::TcpProcess::join(
        env.rank,
        env.world_size,
        &env.master_addr,
        env.master_port,
        timeout,
    )
    .map_err(|e| miette!("{e}"))?;
    run::train_on_gpus_as(
        &p,
        &args.train,
        per_node,
        Some(dplc_runtime::Process::Tcp(&process)),
    )?;
    Ok(())
}

/// The first process whose plan or training options differ from rank 0's,
/// found before any rank starts: the processes of one job train one run,
/// and a mismatch (another artifact, another `--seed`) would train a
/// different one without a word.
fn disagreeing(
    process: &dplc_runtime::MpiProcess,
    plan: &Plan,
    train: &run::TrainOpts,
) -> Option<usize> {
    // An empty text on every process would hide the mismatch this is for.
    let plan_text = ron::to_string(plan).expect("a plan read from RON writes back as RON");
    let options = format!(
        "{:?} {:?} {:?} {:?} {:?} {:?} {:?} {:?}",
        train.steps,
        train.seed,
        train.data,
        train.resume,
        train.compute,
        train.storage,
        train.checkpoint_dir,
        train.skip_nonfinite
    );
    let fingerprint = fnv1a(format!("{plan_text}\n{options}").as_bytes());
    let all = process.fingerprints(fingerprint);
    all.iter().position(|&f| f != all[0])
}

/// One CPU rank per process, the processes joined by MPI: every process
/// trains its rank and rank 0 prints. A rank that fails ends the whole job
/// (MPI_Abort) after printing its error, so no process is left waiting.
fn launch_cpu_processes(
    plan: Plan,
    train: &run::TrainOpts,
    env_rank: usize,
    processes: u64,
) -> Result<()> {
    let process = dplc_runtime::MpiProcess::init().map_err(|e| {
        miette!(
            help = "launch one process, whose ranks run as threads",
            "{e}"
        )
    })?;
    // Past MPI_Init every failure ends the job (below): a process that just
    // returned would wait in MPI_Finalize for peers that wait for it.
    let result = if process.size() as u64 != processes {
        Err(miette!(
            help = "start the processes with mpirun (RUN.md has the line)",
            "the launcher started {processes} processes, but MPI sees {}: CPU ranks in \
             separate processes meet through MPI",
            process.size()
        ))
    } else if process.rank() != env_rank {
        Err(miette!(
            help = "let mpirun number the processes: leave RANK and WORLD_SIZE unset",
            "MPI says this is rank {}, but the launcher's environment says {env_rank}",
            process.rank()
        ))
    } else if let Some(rank) = disagreeing(&process, &plan, train) {
        Err(miette!(
            help = "start every process of the job from one artifact with the same options",
            "rank {rank} was started with another plan or other options than rank 0 \
             (the artifact, --steps, --seed, --data, --resume, --compute, --storage or \
             --checkpoint-dir differ)"
        ))
    } else {
        Prepared::from_plan(plan).and_then(|p| {
            run::train_prepared_on(
                &p,
                train,
                Some(dplc_runtime::Process::Mpi(&process)),
                dplc_runtime::Device::Host,
            )
        })
    };
    match result {
        Ok(()) => Ok(()),
        // Every process got the signal (mpirun passes it on) and stopped at
        // the same step: each ends as a failed command does, MPI finalised
        // — an abort here left mpirun hanging in its own teardown.
        Err(report) if report.downcast_ref::<run::Interrupted>().is_some() => Err(report),
        Err(report) => {
            // Rank 0 speaks for the job, on stdout under --json as a single
            // process would; the others give it a moment to, since the
            // first abort ends every process.
            if process.rank() == 0 {
                if train.json {
                    crate::json_error(&report);
                }
            } else {
                // Rank 0's abort usually ends this process in the meantime;
                // if rank 0 is not failing too, this rank says why.
                std::thread::sleep(std::time::Duration::from_secs(2));
                note!("rank {}: {report:?}", process.rank());
                process.abort(1);
            }
            note!("{report:?}");
            process.abort(1);
        }
    }
}
