//! Partial recomputation (Megatron's `--recompute-method block
//! --recompute-num-layers N`, `recompute_layers=N`): the first N layers of
//! each model chunk rerun their forward and the others keep everything. The
//! search recomputes only as many as memory needs; the price of a partial
//! plan is the full plan's recomputation in proportion to the layers rerun.

mod common;

use common::*;
use dplc_ir::Recompute;
use dplc_planner::{compile, parse_cluster, parse_strategy, Compiled, PlanError, PlanRequest};

/// GPT 22B (48 layers) on 8 A100s, tp 8 with sequence parallelism and fused
/// attention, micro-batch 16 at seq 2048: without recomputation its
/// activations (~58 GiB) and states (~46 GiB) do not fit in 80 GiB; with
/// every layer recomputed they take ~2 GiB.
const BASE: &str = "tp=8,pp=1,dp=1,mb=16,zero=0,sp=on,attention=fused,offload=none";

fn request(strategy: &str, ignore_memory: bool) -> Result<Compiled, PlanError> {
    let g = gpt("gpt", GPT_22B);
    let mut req = PlanRequest::new(&g, train(2048, 16), parse_cluster("8xA100").unwrap());
    req.pinned = parse_strategy(strategy)?;
    req.ignore_memory = ignore_memory;
    compile(&req)
}

fn plan(strategy: &str) -> Compiled {
    request(strategy, false).unwrap_or_else(|e| panic!("`{strategy}`: {e}"))
}

/// Recomputation's share of the step's hardware FLOPs.
fn rerun_flops(c: &Compiled) -> f64 {
    c.plan.estimate.hardware_flops_per_step - c.plan.estimate.model_flops_per_step
}

#[test]
fn the_search_recomputes_only_the_layers_memory_needs() {
    let none = request(&format!("{BASE},recompute=none"), false);
    assert!(
        matches!(none, Err(PlanError::Infeasible(_))),
        "the test needs a plan that does not fit without recomputation: {none:?}"
    );
    let searched = plan(BASE);
    let s = &searched.plan.strategy;
    assert_eq!(s.recompute, Recompute::Full);
    let k = s.recompute_layers;
    assert!(0 < k && k < 48, "recomputes {k} of 48 layers");
    // One layer fewer does not fit.
    let fewer = request(&format!("{BASE},recompute_layers={}", k - 1), false);
    assert!(
        matches!(fewer, Err(PlanError::Infeasible(_))),
        "{} layers recomputed fit too: {fewer:?}",
        k - 1
    );
    // Pinned, `recompute=full` is every layer: slower, and recomputing 48/k
    // times the FLOPs and the time.
    let all = plan(&format!("{BASE},recompute=full"));
    assert_eq!(all.plan.strategy.recompute_layers, 0);
    let (t, t_all) = (
        &searched.plan.estimate.breakdown,
        &all.plan.estimate.breakdown,
    );
    assert!(searched.plan.estimate.step_time_s < all.plan.estimate.step_time_s);
    let share = k as f64 / 48.0;
    assert!((t.recompute_s / t_all.recompute_s - share).abs() < 1e-9);
    assert!((rerun_flops(&searched) / rerun_flops(&all) - share).abs() < 1e-9);
    // Less recomputed, more kept.
    let (m, m_all) = (&searched.plan.stages[0].memory, &all.plan.stages[0].memory);
    assert!(m.activations > m_all.activations);
    // The plan says so, and pinning it back gives the same plan.
    assert!(
        s.to_string().contains(&format!(
            "recompute full (the first {k} layers of each chunk)"
        )),
        "{s}"
    );
    let again = plan(&format!("{BASE},recompute_layers={k}"));
    assert_eq!(again.plan.strategy, searched.plan.strategy);
    assert_eq!(
        again.plan.estimate.step_time_s,
        searched.plan.estimate.step_time_s
    );
}

/// Under an interleaved pipeline each model chunk recomputes its first N:
/// pp 2 × v 2 cuts 48 layers into chunks of 12, and `recompute_layers=3`
/// reruns 3 of each, a quarter of the model.
#[test]
fn each_chunk_recomputes_its_first_layers() {
    let pipe =
        "tp=4,pp=2,dp=1,mb=1,zero=0,sp=on,attention=fused,schedule=interleaved,v=2,stages=even";
    let all = request(&format!("{pipe},recompute=full"), true).unwrap();
    let some = request(&format!("{pipe},recompute_layers=3"), true).unwrap();
    let none = request(&format!("{pipe},recompute=none"), true).unwrap();
    assert_eq!(some.plan.stage_layers(), vec![24, 24]);
    assert!((rerun_flops(&some) / rerun_flops(&all) - 0.25).abs() < 1e-9);
    let acts = |c: &Compiled| c.plan.stages[0].memory.activations as f64;
    // Each stage keeps 18 of its 24 layers whole and the inputs of 6.
    let want = 0.75 * acts(&none) + 0.25 * acts(&all);
    assert!(
        (acts(&some) / want - 1.0).abs() < 1e-6,
        "activations {} against {want}",
        acts(&some)
    );
}

#[test]
fn partial_recomputation_is_refused_where_it_means_nothing() {
    for (strategy, says) in [
        (
            "recompute=selective,recompute_layers=2",
            "needs recompute=full",
        ),
        (
            "recompute=none,recompute_layers=all",
            "needs recompute=full",
        ),
        ("recompute_layers=49", "the model has 48"),
    ] {
        let e = request(&format!("{BASE},{strategy}"), true)
            .err()
            .unwrap_or_else(|| panic!("`{strategy}` was accepted"));
        assert!(e.to_string().contains(says), "`{strategy}`: {e}");
    }
    let e = parse_strategy("recompute_layers=0").unwrap_err();
    assert!(e.to_string().contains("at least 1"), "{e}");
}
