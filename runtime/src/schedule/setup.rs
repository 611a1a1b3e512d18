//! What a run sets up once, before any rank starts: the tensor- and
//! expert-parallel layouts, the symbolic dimensions' values, the weights
//! several stages hold, the GPUs this process opens, and the checkpoint a
//! run resumes from or writes to.

use super::*;

/// The plan's layouts for a run that splits tensors (tp or ep above 1);
/// none otherwise.
pub(super) fn layouts(graph: &Graph, cfg: &RunConfig) -> Result<Option<Layouts>> {
    if cfg.tp == 1 && cfg.ep == 1 {
        return Ok(None);
    }
    let model = cfg.layout.as_ref().ok_or_else(|| {
        RuntimeError::Config(format!(
            "tp {} ep {} splits tensors, but the run carries no layout: the planner writes one into every split plan (compile it again)",
            cfg.tp, cfg.ep
        ))
    })?;
    if model.tp != cfg.tp as u64 || model.ep != cfg.ep as u64 {
        return Err(RuntimeError::Config(format!(
            "the layout is for tp {} ep {}, the run has tp {} ep {}",
            model.tp, model.ep, cfg.tp, cfg.ep
        )));
    }
    Ok(Some(Layouts::new(graph, model)?))
}

/// The value of each of the graph's symbolic dimensions, in its order:
/// `batch` is the micro-batch, `seq` the sequence.
pub(super) fn symbols(graph: &Graph, cfg: &RunConfig, seq: usize) -> Result<Vec<i64>> {
    graph
        .sym_names()
        .iter()
        .map(|name| match name.as_str() {
            "batch" => Ok(cfg.micro_batch as i64),
            "seq" => Ok(seq as i64),
            other => Err(RuntimeError::Unsupported(format!(
                "the symbolic dimension `{other}` has no value"
            ))),
        })
        .collect()
}

/// The weights more than one pipeline stage holds (an embedding the head
/// reads on another stage), with the stages that hold each.
pub(super) fn tied_params(
    graph: &Graph,
    part: &Partition,
    pp: usize,
) -> BTreeMap<ParamKey, Vec<usize>> {
    let mut tied: BTreeMap<ParamKey, Vec<usize>> = BTreeMap::new();
    for (c, chunk) in part.chunks.iter().enumerate() {
        for &n in &chunk.nodes {
            if let Op::Param(p) = graph.node(n).op {
                let stages = tied.entry(ParamKey { param: p, layer: 0 }).or_default();
                if !stages.contains(&(c % pp)) {
                    stages.push(c % pp);
                }
            }
        }
    }
    tied.retain(|_, s| s.len() > 1);
    tied
}

/// A GPU run opens the GPUs this process's ranks use ("no CUDA driver
/// found", or which GPU is missing, before any rank starts) and takes NCCL
/// for its collectives where each rank has a GPU of its own.
pub(super) fn attach_gpus(shared: &mut Shared<'_>, process: Option<Process<'_>>) -> Result<()> {
    let cfg = shared.cfg;
    let Device::Cuda { gpus, .. } = cfg.device else {
        return Ok(());
    };
    if cfg.compute != Compute::Fused {
        return Err(RuntimeError::Config(
            "GPUs run the fused kernels: a GPU run needs Compute::Fused".into(),
        ));
    }
    let gpus = gpus.max(1);
    let ranks: Vec<usize> = match process {
        Some(p) => vec![p.rank()],
        None => (0..cfg.world_size()).collect(),
    };
    shared.gpus = vec![None; gpus];
    for r in ranks {
        let i = cfg.gpu_of(r).unwrap_or(0);
        if shared.gpus[i].is_none() {
            shared.gpus[i] = Some(Arc::new(crate::gpu::GpuDevice::new(i)?));
        }
    }
    // NCCL needs a GPU per rank (a process holds one rank). A parameter
    // server's dedicated ranks hold their shards on the host, so its groups
    // stage through the host too.
    let own_gpu = process.is_some() || cfg.world_size() <= gpus;
    if own_gpu
        && cfg.world_size() > 1
        && cfg.sync.ps_shards().is_none()
        && crate::gpu::nccl_present()
    {
        shared.collectives = Collectives::Nccl;
    } else if !own_gpu {
        // Rank threads of this process dealt over fewer GPUs: a group on
        // one GPU moves its layout changes' pieces device to device.
        shared.collectives = Collectives::SharedDevice;
    }
    Ok(())
}

/// A run that writes or resumes checkpoints: the signature its files carry
/// (parameters keyed by name, so two of one name are refused), and the
/// resumed state, read and checked whole before any rank starts (a bad
/// checkpoint stops the run here, with nothing half loaded).
pub(super) fn resume(shared: &mut Shared<'_>, steps: u64) -> Result<()> {
    let (graph, cfg) = (shared.graph, shared.cfg);
    // Every (parameter, layer) some rank holds: what a checkpoint must cover.
    let all_keys: BTreeSet<ParamKey> = (0..cfg.pp)
        .flat_map(|stage| held::rank_stage_keys(shared, stage))
        .map(|(k, _, _)| k)
        .collect();
    if cfg.checkpoint.is_some() || cfg.resume_from.is_some() {
        let mut names = HashSet::new();
        if let Some(k) = all_keys
            .iter()
            .find(|k| k.layer == 0 && !names.insert(&graph.param(k.param).name))
        {
            return Err(RuntimeError::Unsupported(format!(
                "two parameters are named `{}`: checkpoints key parameters by name",
                graph.param(k.param).name
            )));
        }
        shared.signature = checkpoint::signature(graph, &all_keys);
    }
    if let Some(path) = &cfg.resume_from {
        let ck = checkpoint::Checkpoint::open(path)?;
        side_state_resumes(&ck, cfg)?;
        let resume = checkpoint::load(&ck, graph, &shared.spec.optimizer, shared.seed, &all_keys)?;
        if resume.step > steps {
            return Err(RuntimeError::Config(format!(
                "the checkpoint {} is at step {}, past the {steps} steps asked for",
                ck.dir().display(),
                resume.step
            )));
        }
        shared.start_step = resume.step;
        shared.sample_base = resume.next_sample;
        shared.resume = Some(resume);
    }
    Ok(())
}

/// Per-rank state beyond the parameters — top-k's and PowerSGD's error
/// feedback, an async rank's older weight versions — is each rank's own,
/// written under the split (and staleness) it ran: a resume that needs it
/// must run that split, checked here before any rank starts rather than
/// found missing (or silently dropped) by one of them.
fn side_state_resumes(ck: &checkpoint::Checkpoint, cfg: &RunConfig) -> Result<()> {
    let what = match (cfg.compress.has_feedback(), cfg.sync.staleness()) {
        (true, _) => "error feedback",
        (false, 0) => return Ok(()),
        (false, _) => "older weight versions",
    };
    let planned = [cfg.dp, cfg.cp, cfg.tp, cfg.pp, cfg.ep];
    if ck.degrees() != planned {
        return Err(RuntimeError::Config(format!(
            "the checkpoint {} keeps each rank's {what}, saved under {}; this run is dp {} × \
             tp {} × pp {}{}{}: resume with the split it was saved with, or without {}",
            ck.dir().display(),
            ck.split(),
            cfg.dp,
            cfg.tp,
            cfg.pp,
            if cfg.cp > 1 {
                format!(", cp {}", cfg.cp)
            } else {
                String::new()
            },
            if cfg.ep > 1 {
                format!(", ep {}", cfg.ep)
            } else {
                String::new()
            },
            if cfg.compress.has_feedback() {
                "compress"
            } else {
                "sync=async"
            }
        )));
    }
    let staleness = cfg.sync.staleness() as usize;
    if staleness > 0 {
        if let Some(saved) = checkpoint::saved_versions(ck.dir()) {
            if saved != staleness {
                return Err(RuntimeError::Config(format!(
                    "the checkpoint {} keeps {saved} older weight version(s) a rank \
                     (staleness {saved}); this run asks for staleness {staleness}: resume with \
                     staleness={saved}",
                    ck.dir().display()
                )));
            }
        }
    }
    Ok(())
}
