//! What the runtime refuses of a configuration before any rank starts: a
//! mesh the model, batch or schedule cannot take, gradient
//! synchronisations and compressions it does not run, context parallelism
//! a model or sequence cannot take, and a model without a scalar loss or
//! parameters.

use super::*;

/// Every degree and the micro-batching at least one.
pub(super) fn positive_degrees(cfg: &RunConfig) -> Result<()> {
    if cfg.dp == 0
        || cfg.cp == 0
        || cfg.pp == 0
        || cfg.tp == 0
        || cfg.ep == 0
        || cfg.micro_batch == 0
        || cfg.num_micro_batches == 0
    {
        return Err(RuntimeError::Config(
            "dp, cp, pp, tp, ep, micro_batch and num_micro_batches must be positive".into(),
        ));
    }
    Ok(())
}

/// The mesh against the batch, the sequence and the schedule: experts
/// split the replicas, sequence parallelism each rank's positions, the
/// replicas' micro-batches the global batch, interleaving whole rounds of
/// micro-batches; and the gradient synchronisation it runs.
pub(super) fn mesh_fits(spec: &TrainSpec, cfg: &RunConfig) -> Result<()> {
    if !cfg.dp.is_multiple_of(cfg.ep) {
        return Err(RuntimeError::Config(format!(
            "expert parallelism splits the data-parallel replicas: ep {} must divide dp {}",
            cfg.ep, cfg.dp
        )));
    }
    dplc_ir::validate::sequence_parallel(
        cfg.sequence_parallel,
        cfg.tp as u64,
        cfg.cp as u64,
        spec.seq,
    )
    .map_err(RuntimeError::Config)?;
    if cfg.global_batch() as u64 != spec.global_batch {
        return Err(RuntimeError::Config(format!(
            "dp {} × micro_batch {} × micro-batches {} = {} samples, but the global batch is {}",
            cfg.dp,
            cfg.micro_batch,
            cfg.num_micro_batches,
            cfg.global_batch(),
            spec.global_batch
        )));
    }
    check_dp_sync(cfg)?;
    if cfg.schedule.chunks() > 1 && !cfg.num_micro_batches.is_multiple_of(cfg.pp) {
        return Err(RuntimeError::Config(format!(
            "the interleaved schedule needs the micro-batches ({}) to be a multiple of pp ({})",
            cfg.num_micro_batches, cfg.pp
        )));
    }
    Ok(())
}

/// The model's first result is what the backward starts from: a scalar
/// float loss, and there are parameters to update ([`dplc_ir::validate::trainable`]).
pub(super) fn scalar_loss(graph: &Graph) -> Result<()> {
    dplc_ir::validate::trainable(graph).map_err(|e| RuntimeError::Config(e.to_string()))
}

/// What this runtime runs of the gradient synchronisations and
/// compressions: a parameter server or a compressed all-reduce over
/// replicated state (ZeRO-0), compression over the all-reduce only.
fn check_dp_sync(cfg: &RunConfig) -> Result<()> {
    use dplc_ir::{Compression, GradSync};
    let changed = cfg.sync != GradSync::AllReduce || cfg.compress != Compression::None;
    if changed && cfg.zero != ZeroStage::None {
        return Err(RuntimeError::Config(format!(
            "{} with compress={} runs over replicated optimizer state: use zero=0 with it \
             (a parameter server shards the state over its servers itself)",
            cfg.sync.keys(),
            cfg.compress.name()
        )));
    }
    if cfg.sync != GradSync::AllReduce && cfg.compress != Compression::None {
        return Err(RuntimeError::Config(format!(
            "compress={} compresses the all-reduce; a parameter server pushes fp32 gradients: \
             drop compress or use sync=allreduce",
            cfg.compress.name()
        )));
    }
    if let Some(shards) = cfg.sync.ps_shards() {
        if shards == 0 {
            return Err(RuntimeError::Config(
                "ps_shards=0: a parameter server needs at least one shard".into(),
            ));
        }
        if cfg.server_replicas() == 0 && shards as usize > cfg.dp {
            return Err(RuntimeError::Config(format!(
                "ps_shards={shards}: the servers live on the {} data-parallel workers; give 1 to {} \
                 (or ps_ranks=dedicated)",
                cfg.dp, cfg.dp
            )));
        }
    }
    if cfg.server_replicas() > 0 && (cfg.cp > 1 || cfg.ep > 1) {
        return Err(RuntimeError::Config(format!(
            "ps_ranks=dedicated runs beside data, pipeline and tensor parallelism, not cp {} or \
             ep {}: drop cp and ep, or ps_ranks",
            cfg.cp, cfg.ep
        )));
    }
    Ok(())
}

/// What context parallelism runs here, refused before any rank starts:
/// every rank of a cp group reads its positions of the same sample.
pub(super) fn context_checks(graph: &Graph, spec: &TrainSpec, cfg: &RunConfig) -> Result<()> {
    let refuse = |what: &str| {
        Err(RuntimeError::Unsupported(format!(
            "context parallelism (cp {}) {what}",
            cfg.cp
        )))
    };
    if let Some(why) = dplc_ir::validate::context_refusal(graph) {
        return refuse(&format!("{why}: run without cp"));
    }
    if !(spec.seq as usize).is_multiple_of(2 * cfg.cp) {
        return refuse(&format!(
            "cuts the sequence into 2·cp = {} load-balanced chunks: it must divide seq {}",
            2 * cfg.cp,
            spec.seq
        ));
    }
    Ok(())
}
