//! What the runtime refuses of a configuration before any rank starts:
//! gradient synchronisations and compressions it does not run, and context
//! parallelism a model or sequence cannot take.

use super::*;

/// What this runtime runs of the gradient synchronisations and
/// compressions: a parameter server or a compressed all-reduce over
/// replicated state (ZeRO-0), compression over the all-reduce only.
pub(super) fn check_dp_sync(cfg: &RunConfig) -> Result<()> {
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
