//! The pinned choices that price another engine's stack: `dplc compile`
//! prices them and `dplc export` hands them on, but dplc's own ranks do not
//! run them, so `dplc run` and `dplc build` refuse them before any rank
//! starts. The list is here once; each command words the refusal its way.

use dplc_planner::StrategyConstraints;

/// A pinned choice dplc's runtime does not run.
pub struct Elsewhere {
    /// The pin as written, `key=value`.
    pub pin: String,
    /// What dplc's runtime does instead, after "dplc's runtime".
    pub runtime: &'static str,
    /// What to pin instead.
    pub instead: String,
    /// The engines `dplc export` hands it to, where one runs it.
    pub export: Option<&'static str>,
}

/// The first choice of `pinned` that only another engine runs.
pub fn elsewhere(pinned: &StrategyConstraints) -> Option<Elsewhere> {
    let drop = |key: &str| format!("drop {key} from --strategy");
    let found = |pin: String, runtime, instead, export| {
        Some(Elsewhere {
            pin,
            runtime,
            instead,
            export,
        })
    };
    if let Some(o) = pinned.offload.filter(|o| !o.is_none()) {
        return found(
            format!("offload={}", o.name()),
            "does not offload to host memory",
            drop("offload"),
            Some("DeepSpeed, Megatron-LM or torchtitan"),
        );
    }
    if pinned.fp8 == Some(true) {
        return found(
            "fp8=on".into(),
            "does not run FP8 GEMMs",
            drop("fp8"),
            Some("Megatron-LM or torchtitan"),
        );
    }
    if pinned.recompute == Some(dplc_ir::Recompute::Op) {
        return found(
            "recompute=op".into(),
            "does not run torchtitan's op-level checkpointing",
            "pin recompute=none, selective or full".into(),
            Some("torchtitan"),
        );
    }
    if pinned.elementwise == Some(dplc_ir::Elementwise::Eager) {
        return found(
            "elementwise=eager".into(),
            "fuses elementwise ops",
            drop("elementwise"),
            Some("torchtitan"),
        );
    }
    match pinned.loss {
        Some(dplc_ir::Loss::Unfused) => {
            return found(
                "loss=unfused".into(),
                "fuses the cross-entropy",
                drop("loss"),
                Some("Megatron-LM"),
            );
        }
        Some(dplc_ir::Loss::Eager) => {
            return found(
                "loss=eager".into(),
                "fuses the cross-entropy",
                drop("loss"),
                Some("torchtitan"),
            );
        }
        Some(dplc_ir::Loss::Fused) | None => {}
    }
    if pinned.autocast == Some(true) {
        // Every export names it as a gap: the engines keep their own
        // precision policies.
        return found(
            "autocast=on".into(),
            "keeps activations in the training precision",
            drop("autocast"),
            None,
        );
    }
    if pinned.shards == Some(dplc_ir::ShardLayout::PerParam) {
        return found(
            "shards=per_param".into(),
            "gathers ZeRO-3's weights into flat buffers",
            drop("shards"),
            Some("torchtitan"),
        );
    }
    if let Some(t) = pinned.tp_impl.filter(|&t| t != dplc_ir::TpImpl::Dplc) {
        let (runtime, export) = match t {
            dplc_ir::TpImpl::DTensor => (
                "runs Megatron's sequence-first tensor parallelism",
                "torchtitan",
            ),
            _ => (
                "runs the model's ends whole along the sequence",
                "Megatron-LM or DeepSpeed",
            ),
        };
        return found(
            format!("tp_impl={}", t.name()),
            runtime,
            drop("tp_impl"),
            Some(export),
        );
    }
    if let Some(g) = pinned
        .grad_reduce
        .filter(|&g| g != dplc_ir::GradReduce::Fp32)
    {
        return found(
            format!("grad_reduce={}", g.name()),
            "accumulates and reduces gradients in fp32",
            drop("grad_reduce"),
            Some("Megatron-LM"),
        );
    }
    if pinned.dispatch == Some(dplc_ir::Dispatch::Hierarchical) {
        // Megatron's flex dispatcher cannot drop tokens: every export
        // names it as a gap.
        return found(
            "dispatch=hierarchical".into(),
            "dispatches MoE tokens with one all-to-all",
            drop("dispatch"),
            None,
        );
    }
    None
}
