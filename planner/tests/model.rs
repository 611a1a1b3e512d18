//! The planner on Megatron GPTs built with the IR builder: FLOPs against
//! Megatron's formula, Korthikanti et al. 2022 Fig. 1 memory, determinism and
//! the errors for impossible requests. (The zoo versions live in the root's
//! tests/planner_*.rs.)

mod common;

use common::*;
use dplc_planner::{compile, parse_cluster, parse_strategy, Compiled, PlanError, PlanRequest};

const GIB: f64 = (1u64 << 30) as f64;

/// A plan with the 2021–2022 Megatron stack the published rows ran:
/// attention unfused, tensor-parallel collectives exposed, the model's
/// ends split along the sequence under sequence parallelism.
fn plan(cfg: Gpt, cluster: &str, batch: u64, strategy: &str, ignore_memory: bool) -> Compiled {
    let g = gpt("gpt", cfg);
    let mut req = PlanRequest::new(&g, train(2048, batch), parse_cluster(cluster).unwrap());
    let strategy = if strategy.is_empty() {
        "attention=unfused,tp_overlap=none,loss=unfused,tp_impl=megatron".to_string()
    } else {
        format!("{strategy},attention=unfused,tp_overlap=none,loss=unfused,tp_impl=megatron")
    };
    req.pinned = parse_strategy(&strategy).unwrap();
    req.ignore_memory = ignore_memory;
    compile(&req).unwrap()
}

fn error(cfg: Gpt, cluster: &str, batch: u64, strategy: &str) -> PlanError {
    let g = gpt("gpt", cfg);
    let mut req = PlanRequest::new(&g, train(2048, batch), parse_cluster(cluster).unwrap());
    req.pinned = parse_strategy(strategy).unwrap();
    match compile(&req) {
        Ok(_) => panic!("`{strategy}` on {cluster} was accepted"),
        Err(e) => e,
    }
}

fn within(got: f64, want: f64, tol: f64, what: &str) {
    let rel = got / want - 1.0;
    assert!(
        rel.abs() <= tol,
        "{what}: predicted {got:.3}, published {want:.3} ({:+.1}%, tolerance {:.0}%)",
        rel * 100.0,
        tol * 100.0
    );
}

/// Korthikanti Fig. 1: (weights + grads + optimizer, activations) per GPU, GiB.
fn memory_row(cfg: Gpt, cluster: &str, batch: u64, strategy: &str) -> (f64, f64) {
    let c = plan(cfg, cluster, batch, strategy, true);
    let m = &c.plan.stages[0].memory;
    let states = (m.weights + m.gradients + m.optimizer) as f64 / GIB;
    let acts = (m.activations + m.embedding_and_loss) as f64 / GIB;
    (states, acts)
}

#[test]
fn korthikanti_fig1_gpt_22b() {
    let base = "tp=8,pp=1,dp=1,mb=4,zero=0";
    let (states, none) = memory_row(
        GPT_22B,
        "8xA100",
        4,
        &format!("{base},recompute=none,sp=off"),
    );
    // The states rows keep their tolerance: they read +1.6% (IR-built,
    // tied output layer) to +3.0% (the zoo's untied one), above the 3% the
    // activation rows now meet; the gap is in the parameters counted, which
    // no communication or activation mechanism touches.
    within(states, 45.56, 0.05, "22B weights+grads+optimizer");
    within(none, 59.25, 0.03, "22B activations, no recompute");
    let (_, sel) = memory_row(
        GPT_22B,
        "8xA100",
        4,
        &format!("{base},recompute=selective,sp=on"),
    );
    within(sel, 9.56, 0.03, "22B activations, sp + selective");
}

#[test]
fn korthikanti_fig1_gpt_175b_first_stage() {
    // Korthikanti et al. train 175B with the interleaved schedule, 3 chunks per device.
    let base = "tp=8,pp=8,dp=1,mb=1,zero=0,schedule=interleaved,v=3";
    let (states, none) = memory_row(
        GPT_175B,
        "8x8xA100",
        64,
        &format!("{base},recompute=none,sp=off"),
    );
    // +3.1%, as the 22B states row: the tolerance stays.
    within(states, 45.56, 0.10, "175B weights+grads+optimizer");
    within(none, 66.84, 0.03, "175B activations, no recompute");
    let (_, sel) = memory_row(
        GPT_175B,
        "8x8xA100",
        64,
        &format!("{base},recompute=selective,sp=on"),
    );
    within(sel, 12.35, 0.03, "175B activations, sp + selective");
}

/// Model FLOPs count a causal attention over the pairs its mask keeps
/// (Megatron-LM's `num_floating_point_operations` from core_v0.16.0 halves
/// it: "causal mask (only half of the mask is non-zero)"); with the masked
/// pairs added back they are Megatron's earlier count over every pair. What
/// the kernels execute: an unfused attention computes every score, a fused
/// kernel skips the masked tiles.
#[test]
fn model_flops_are_megatrons_formula_exactly() {
    for cfg in [GPT_1_7B, GPT_22B, GPT_1T] {
        let c = plan(cfg, "8xA100", 8, "tp=8,pp=1,dp=1,recompute=none", true);
        let (b, s, l, h, v) = (
            8.0,
            2048.0,
            cfg.layers as f64,
            cfg.hidden as f64,
            cfg.vocab as f64,
        );
        // Every pair: 72·B·s·l·h²·(1 + s/6h + V/12lh) per step, no recomputation.
        let every_pair = 72.0 * b * s * l * h * h * (1.0 + s / (6.0 * h) + v / (12.0 * l * h));
        // The causal mask keeps s(s + 1)/2 of the s² pairs.
        let kept = (s + 1.0) / (2.0 * s);
        let causal = 72.0 * b * s * l * h * h * (1.0 + kept * s / (6.0 * h) + v / (12.0 * l * h));
        let e = &c.plan.estimate;
        let got = e.model_flops_per_step;
        assert!((got / causal - 1.0).abs() < 1e-12, "{got} vs {causal}");
        let all = e.model_flops_per_step + e.masked_attention_flops_per_step;
        assert!(
            (all / every_pair - 1.0).abs() < 1e-12,
            "{all} vs {every_pair}"
        );
        // Unfused, every score is computed: Megatron's count over every pair.
        let got = e.hardware_flops_per_step;
        assert!(
            (got / every_pair - 1.0).abs() < 1e-12,
            "{got} vs {every_pair}"
        );
        // Full recomputation adds one forward of the layers: Narayanan's 96·B·s·l·h²(…).
        let c = plan(cfg, "8xA100", 8, "tp=8,pp=1,dp=1,recompute=full", true);
        let hw = 96.0 * b * s * l * h * h * (1.0 + s / (6.0 * h) + v / (16.0 * l * h));
        let got = c.plan.estimate.hardware_flops_per_step;
        assert!((got / hw - 1.0).abs() < 1e-12, "{got} vs {hw}");
        // A fused kernel skips the masked pairs, in the recomputed forward too.
        let c = plan_as_pinned(
            cfg,
            "8xA100",
            8,
            "tp=8,pp=1,dp=1,recompute=full,attention=fused,tp_overlap=none,loss=unfused",
        );
        let hw = 96.0 * b * s * l * h * h * (1.0 + kept * s / (6.0 * h) + v / (16.0 * l * h));
        let got = c.plan.estimate.hardware_flops_per_step;
        assert!((got / hw - 1.0).abs() < 1e-12, "{got} vs {hw}");
        assert!(c.plan.estimate.mfu < 1.0);
    }
}

/// MFU cannot pass 1 where a causal attention dominates: a fused kernel's
/// rate is measured with the masked half skipped, and the model FLOPs leave
/// that half out too (counted over every pair, this 1.7B model's read 1.11
/// of the V100's peak at 32,768 tokens).
#[test]
fn mfu_stays_below_one_at_long_sequences() {
    let cfg = Gpt {
        ctx: 32768,
        ..GPT_1_7B
    };
    let g = gpt("gpt", cfg);
    let mut req = PlanRequest::new(&g, train(32768, 8), parse_cluster("8xV100").unwrap());
    req.pinned = parse_strategy("attention=fused").unwrap();
    req.ignore_memory = true;
    let e = compile(&req).unwrap().plan.estimate;
    assert!(e.mfu < 1.0, "MFU {}", e.mfu);
    assert!(e.hardware_flops_per_step >= e.model_flops_per_step);
    assert!(e.masked_attention_flops_per_step > 0.3 * e.model_flops_per_step);
}

#[test]
fn the_same_request_gives_a_byte_identical_plan_that_round_trips() {
    let a = plan(GPT_175B, "16x8xA100", 256, "", false);
    let b = plan(GPT_175B, "16x8xA100", 256, "", false);
    let ra = ron::ser::to_string_pretty(&a.plan, ron::ser::PrettyConfig::default()).unwrap();
    let rb = ron::ser::to_string_pretty(&b.plan, ron::ser::PrettyConfig::default()).unwrap();
    assert_eq!(ra, rb);
    let back: dplc_ir::Plan = ron::from_str(&ra).unwrap();
    assert_eq!(back, a.plan);
    let json = dplc_planner::to_json(&a);
    for key in ["dp", "tp", "pp", "cp", "ep"] {
        assert!(json["mesh"][key].is_u64(), "mesh.{key}");
    }
    for key in [
        "micro_batch",
        "num_micro_batches",
        "schedule",
        "virtual_stages",
        "zero_stage",
        "recompute",
        "sequence_parallel",
        "overlap_grad_reduce",
        "attention",
        "tp_overlap",
        "grad_accum",
        "grad_reduce",
        "dispatch",
        "root",
        "fp8",
        "offload",
        "autocast",
        "elementwise",
        "loss",
        "shards",
        "compress",
        "description",
    ] {
        assert!(!json["strategy"][key].is_null(), "strategy.{key}");
    }
    for key in [
        "step_time_s",
        "tokens_per_s",
        "model_tflops_per_gpu",
        "hardware_tflops_per_gpu",
        "mfu",
        "peak_memory_bytes",
        "memory_by_stage",
    ] {
        assert!(!json["estimate"][key].is_null(), "estimate.{key}");
    }
    for key in ["configs_evaluated", "feasible", "time_ms"] {
        assert!(json["search"][key].is_number(), "search.{key}");
    }
}

#[test]
fn gradient_reduction_after_backward_is_wholly_exposed_and_kept_in_the_plan() {
    let base = "tp=8,pp=8,dp=24,mb=2,v=2,zero=0,recompute=full,sp=off";
    let on = plan(GPT_145_6B, "192x8xA100", 2304, base, false);
    let off = plan(
        GPT_145_6B,
        "192x8xA100",
        2304,
        &format!("{base},overlap=off"),
        false,
    );
    let (t_on, t_off) = (&on.plan.estimate.breakdown, &off.plan.estimate.breakdown);
    // Everything but the data-parallel term is the same plan, and what
    // the reduction hidden behind backward costs the compute beside it: the
    // slowdown, and its share of each fill and drain slot of the bubble
    // ((p − 1)/(v·m) of it, p 8, v 2, m 48).
    assert_eq!(t_on.compute_s, t_off.compute_s);
    let slower = t_on.overlap_slowdown_s - t_off.overlap_slowdown_s;
    assert!(slower > 0.0, "{slower}");
    within(
        t_on.bubble_s - t_off.bubble_s,
        slower * 7.0 / (2.0 * 48.0),
        1e-9,
        "the bubble's share of the slowdown, s",
    );
    assert!(
        t_off.exposed_dp_comm_s > t_on.exposed_dp_comm_s,
        "{} vs {}",
        t_off.exposed_dp_comm_s,
        t_on.exposed_dp_comm_s
    );
    // Not overlapped, the whole all-reduce of the fp32 gradients is exposed:
    // 2·(n−1)/n of them over one NIC per rank (the dp group spans nodes).
    let stage0 = &off.plan.stages[0].memory;
    let ring = 2.0 * 23.0 / 24.0 * stage0.gradients as f64 / (25e9 * 0.8);
    within(t_off.exposed_dp_comm_s, ring, 0.01, "exposed all-reduce, s");

    // `explain` prices turning the overlap on.
    let w = off
        .plan
        .what_if
        .iter()
        .find(|w| w.change == "overlap off → on")
        .expect("a what-if for the overlap");
    let faster = w.step_time_s.expect("priced");
    assert!((faster - on.plan.estimate.step_time_s).abs() < 1e-9 * faster);
    assert!(!on
        .plan
        .what_if
        .iter()
        .any(|w| w.change.starts_with("overlap")));

    assert!(on.plan.strategy.overlap_grad_reduce);
    assert!(!off.plan.strategy.overlap_grad_reduce);
    assert!(off
        .plan
        .strategy
        .to_string()
        .contains("gradient reduction after backward"));
    // The field is written only when it is off, so older plans read as overlapped.
    let ron_on = ron::ser::to_string(&on.plan).unwrap();
    let ron_off = ron::ser::to_string(&off.plan).unwrap();
    assert!(!ron_on.contains("overlap_grad_reduce"));
    assert!(ron_off.contains("overlap_grad_reduce:false"));
    let back: dplc_ir::Plan = ron::from_str(&ron_off).unwrap();
    assert_eq!(back, off.plan);
}

#[test]
fn a_model_that_fits_nowhere_says_how_close_it_came_and_what_would_fit() {
    let msg = error(GPT_1T, "8xA100", 8, "").to_string();
    for needle in [
        "does not fit on 8xA100-80GB",
        "smallest per-rank memory",
        "optimizer",
        "activations",
        "holds 80.00 GiB",
        "devices",
        "H200",
    ] {
        assert!(msg.contains(needle), "`{needle}` missing from: {msg}");
    }
    assert!(matches!(
        error(GPT_1T, "8xA100", 8, ""),
        PlanError::Infeasible(_)
    ));
}

#[test]
fn impossible_strategies_are_refused_with_the_reason() {
    let cases = [
        ("tp=3", "does not divide the 64 devices"),
        (
            "tp=8,pp=2,dp=2,cp=1",
            "= 32 devices, but the cluster has 64",
        ),
        ("tp=128", "does not divide the 64 devices"),
        ("pp=64", "more stages than the model's 48 layers"),
        ("ep=2", "no experts"),
        ("tp=1,sp=on", "needs tp > 1"),
        ("dp=64,mb=3", "does not divide"),
    ];
    for (strategy, needle) in cases {
        let msg = error(GPT_22B, "8x8xA100", 256, strategy).to_string();
        assert!(
            msg.contains(needle),
            "{strategy}: `{needle}` missing from: {msg}"
        );
    }
}

/// 24 heads do not split over 16 ranks, but the MLP does: the e-graph finds
/// the layout that keeps attention whole on every rank and splits the rest,
/// rather than refusing the degree.
#[test]
fn a_degree_that_splits_no_head_replicates_attention() {
    let c = plan(GPT_1_7B, "4x8xA100", 512, "tp=16", true);
    let splits = |name: &str| {
        c.plan
            .param_sharding
            .iter()
            .find(|s| s.name == name)
            .unwrap_or_else(|| panic!("{name} is listed"))
            .splits
            .clone()
    };
    use dplc_ir::MeshAxis::Tp;
    assert_eq!(splits("layers.qkv.w"), vec![]);
    assert_eq!(splits("layers.proj.w"), vec![]);
    assert_eq!(splits("layers.fc1.w"), vec![(Tp, 1)]);
    assert_eq!(splits("layers.fc2.w"), vec![(Tp, 0)]);
}

#[test]
fn megatron_layout_comes_out_of_the_graph() {
    let c = plan(
        GPT_22B,
        "8xA100",
        4,
        "tp=8,pp=1,dp=1,mb=4,recompute=none,sp=off",
        true,
    );
    let p = &c.plan;
    let split = |name: &str| {
        p.param_sharding
            .iter()
            .find(|s| s.name == name)
            .unwrap_or_else(|| panic!("{name} is listed"))
            .splits
            .clone()
    };
    use dplc_ir::MeshAxis::Tp;
    // Column-parallel QKV and fc1 (and their biases), row-parallel projections,
    // vocab-parallel embedding, replicated norms.
    assert_eq!(split("layers.qkv.w"), vec![(Tp, 1)]);
    assert_eq!(split("layers.qkv.b"), vec![(Tp, 0)]);
    assert_eq!(split("layers.proj.w"), vec![(Tp, 0)]);
    assert_eq!(split("layers.proj.b"), vec![]);
    assert_eq!(split("layers.fc1.w"), vec![(Tp, 1)]);
    assert_eq!(split("layers.fc2.w"), vec![(Tp, 0)]);
    assert_eq!(split("layers.ln1.w"), vec![]);
    assert_eq!(split("wte"), vec![(Tp, 0)]);
    // Two all-reduces of b·s·h in forward and two in backward per layer.
    let sbh = 4 * 2048 * 6144 * 2;
    let layer: Vec<_> = p
        .collectives
        .iter()
        .filter(|c| c.axis == Tp && c.what.starts_with("layer"))
        .map(|c| (c.kind, c.phase, c.bytes, c.count_per_step))
        .collect();
    use dplc_ir::{CollectiveKind::AllReduce, StepPhase::*};
    assert_eq!(
        layer,
        vec![
            (AllReduce, Forward, sbh, 48),
            (AllReduce, Forward, sbh, 48),
            (AllReduce, Backward, sbh, 48),
            (AllReduce, Backward, sbh, 48),
        ]
    );
}

/// A plan on the stack as pinned (no `attention=unfused` added).
fn plan_as_pinned(cfg: Gpt, cluster: &str, batch: u64, strategy: &str) -> Compiled {
    let g = gpt("gpt", cfg);
    let mut req = PlanRequest::new(&g, train(2048, batch), parse_cluster(cluster).unwrap());
    req.pinned = parse_strategy(strategy).unwrap();
    req.ignore_memory = true;
    compile(&req).unwrap()
}

/// Fused attention keeps no `s × s` tensor: of Korthikanti's per-layer
/// activations with sequence parallelism, `sbh(34 + 5as/h)/t`, the `5as/h`
/// term (scores, softmax, dropout mask) goes, and only the fp32 log-sum-exp
/// (`4as·b/t` bytes, `4a/h` in those units) comes in its place.
#[test]
fn fused_attention_stores_no_score_matrix() {
    let base = "tp=8,pp=1,dp=1,mb=4,zero=0,recompute=none,sp=on";
    let acts = |attention: &str| {
        let c = plan_as_pinned(
            GPT_22B,
            "8xA100",
            4,
            &format!("{base},attention={attention}"),
        );
        c.plan.stages[0].memory.activations as f64
    };
    let (fused, unfused) = (acts("fused"), acts("unfused"));
    let (a, s, h) = (GPT_22B.heads as f64, 2048.0, GPT_22B.hidden as f64);
    let want = (34.0 + 4.0 * a / h) / (34.0 + 5.0 * a * s / h);
    within(
        fused / unfused,
        want,
        0.10,
        "fused / unfused layer activations",
    );
}

/// Under fused attention selective recomputation has nothing to drop: the
/// same step time and memory as none, and the search never needs it.
#[test]
fn selective_recomputation_is_no_recomputation_under_fused_attention() {
    let base = "tp=8,pp=1,dp=1,mb=4,zero=0,sp=on,attention=fused";
    let none = plan_as_pinned(GPT_22B, "8xA100", 4, &format!("{base},recompute=none"));
    let sel = plan_as_pinned(GPT_22B, "8xA100", 4, &format!("{base},recompute=selective"));
    assert_eq!(none.plan.stages[0].memory, sel.plan.stages[0].memory);
    assert_eq!(
        none.plan.estimate.step_time_s,
        sel.plan.estimate.step_time_s
    );
    assert_eq!(
        none.plan.estimate.hardware_flops_per_step,
        sel.plan.estimate.hardware_flops_per_step
    );
    // Unfused, selective trades the score tensors for their recomputation.
    let base = "tp=8,pp=1,dp=1,mb=4,zero=0,sp=on,attention=unfused";
    let none = plan_as_pinned(GPT_22B, "8xA100", 4, &format!("{base},recompute=none"));
    let sel = plan_as_pinned(GPT_22B, "8xA100", 4, &format!("{base},recompute=selective"));
    assert!(sel.plan.stages[0].memory.activations < none.plan.stages[0].memory.activations);
    assert!(sel.plan.estimate.step_time_s > none.plan.estimate.step_time_s);
}

/// The search prices today's stack (fused attention) unless told otherwise,
/// and a plan file written before the key existed reads back as unfused,
/// which is how it was priced.
#[test]
fn attention_defaults_to_fused_and_old_plans_read_as_unfused() {
    let c = plan_as_pinned(GPT_1_7B, "8xA100", 8, "tp=1,pp=1,dp=8");
    assert_eq!(c.plan.strategy.attention, dplc_ir::AttentionKind::Fused);
    let json = serde_json::to_value(&c.plan).unwrap();
    let mut old = json.clone();
    old["strategy"]
        .as_object_mut()
        .unwrap()
        .remove("attention")
        .expect("the field is written");
    let back: dplc_ir::Plan = serde_json::from_value(old).unwrap();
    assert_eq!(back.strategy.attention, dplc_ir::AttentionKind::Unfused);
}

/// Tensor-parallel communication hides behind the GEMMs next to it: with
/// Megatron's asynchronous backward the input-gradient collectives of the
/// column-parallel layers run beside their weight-gradient GEMMs, and with
/// `ring` the forward ones are pipelined with their GEMMs too. Compute is
/// the same in all three; only the exposed communication shrinks, never
/// below zero, and by no more than the backward's share under `async`.
#[test]
fn tensor_parallel_overlap_hides_communication_behind_gemms() {
    for sp in ["on", "off"] {
        let base = format!("tp=8,pp=1,dp=1,mb=4,zero=0,recompute=none,sp={sp},attention=fused");
        let time = |o: &str| {
            let c = plan_as_pinned(GPT_22B, "8xA100", 4, &format!("{base},tp_overlap={o}"));
            c.plan.estimate.breakdown
        };
        let (none, asynchronous, ring) = (time("none"), time("async"), time("ring"));
        assert_eq!(none.compute_s, asynchronous.compute_s);
        assert_eq!(none.compute_s, ring.compute_s);
        assert!(
            none.exposed_comm_s > asynchronous.exposed_comm_s
                && asynchronous.exposed_comm_s > ring.exposed_comm_s
                && ring.exposed_comm_s >= 0.0,
            "sp {sp}: exposed none {} async {} ring {}",
            none.exposed_comm_s,
            asynchronous.exposed_comm_s,
            ring.exposed_comm_s
        );
        // What is hidden is accounted for: exposed plus hidden is the whole.
        assert_eq!(none.overlapped_comm_s, 0.0);
        for b in [&asynchronous, &ring] {
            let whole = b.exposed_comm_s + b.overlapped_comm_s;
            assert!(
                (whole / none.exposed_comm_s - 1.0).abs() < 1e-9,
                "sp {sp}: {whole} vs {}",
                none.exposed_comm_s
            );
        }
        // The backward collectives are the forward ones' transposes (plus,
        // under sequence parallelism, the input re-gathers): async hides
        // none of the forward ones, at least half of the whole.
        assert!(
            asynchronous.exposed_comm_s >= none.exposed_comm_s / 2.0 - 1e-9,
            "sp {sp}: async exposes {} of {}",
            asynchronous.exposed_comm_s,
            none.exposed_comm_s
        );
    }
}

/// Sequence parallelism keeps only the sequence shard of a column-parallel
/// GEMM's input, so its backward all-gathers the shard again for the weight
/// gradient (Megatron's `LinearWithGradAccumulationAndAsyncCommunication`).
/// Under `tp_overlap=none` that re-gather is the whole difference sequence
/// parallelism makes to the exposed communication (its reduce-scatter and
/// all-gather pairs cost what the all-reduces did); under `async` it hides
/// behind the input-gradient GEMM, while the all-gather of the output
/// gradient that opens the row-parallel backward stays exposed. Memory
/// gains one full-size gather buffer in a layer's backward, nothing else.
#[test]
fn sequence_parallelism_gathers_the_saved_input_again_in_backward() {
    let base = "tp=8,pp=1,dp=1,mb=4,zero=0,recompute=none,attention=fused";
    let plan = |sp: &str, o: &str| {
        plan_as_pinned(
            GPT_22B,
            "8xA100",
            4,
            &format!("{base},sp={sp},tp_overlap={o}"),
        )
        .plan
    };
    let per_step = |p: &dplc_ir::Plan, what: &str, kind: dplc_ir::CollectiveKind| -> f64 {
        p.collectives
            .iter()
            .filter(|c| c.what.ends_with(what) && c.kind == kind)
            .map(|c| c.time_s * c.count_per_step as f64)
            .sum()
    };
    let regather = "sequence-parallel input re-gather (weight gradient)";
    let (on, off) = (plan("on", "none"), plan("off", "none"));
    let gathers = per_step(&on, regather, dplc_ir::CollectiveKind::AllGather);
    assert!(gathers > 0.0, "no re-gather under sp");
    assert_eq!(
        per_step(&off, regather, dplc_ir::CollectiveKind::AllGather),
        0.0
    );
    let extra = on.estimate.breakdown.exposed_comm_s - off.estimate.breakdown.exposed_comm_s;
    assert!(
        (extra / gathers - 1.0).abs() < 1e-9,
        "sp adds {extra} s of exposed tp communication, the re-gathers take {gathers}"
    );

    // async: the re-gathers hide; the output-gradient all-gathers (the
    // all-gather half of each input-gradient all-reduce) do not.
    let (on, off) = (plan("on", "async"), plan("off", "async"));
    let grad_gathers = per_step(
        &on,
        "column-parallel input gradient",
        dplc_ir::CollectiveKind::AllGather,
    );
    let extra = on.estimate.breakdown.exposed_comm_s - off.estimate.breakdown.exposed_comm_s;
    assert!(
        (extra / grad_gathers - 1.0).abs() < 1e-9,
        "async: sp adds {extra} s exposed, the output-gradient gathers take {grad_gathers}"
    );
    let tp = |p: &dplc_ir::Plan| {
        p.estimate
            .breakdown
            .comm_by_axis
            .iter()
            .find(|a| a.axis == dplc_ir::MeshAxis::Tp)
            .cloned()
            .expect("tp communication")
    };
    assert!(tp(&on).hidden_s >= gathers, "{:?}", tp(&on));
    assert!((tp(&on).exposed_s / on.estimate.breakdown.exposed_comm_s - 1.0).abs() < 1e-12);

    // Memory: the saved activations are the shards already; the gathers
    // assemble one micro-batch's hidden states (s·b·h in bf16) in one
    // buffer, live in a layer's backward beside its gradients. This stage
    // holds the loss, whose working set (before any layer gathers again)
    // is its peak here: the buffer adds at most its size, and nothing else
    // grows. (`tests/fused_runs.rs` holds the fused run's measured peak to
    // the plan's under sequence parallelism.)
    let (s, b, h) = (2048i64, 4i64, GPT_22B.hidden);
    let buffers = |p: &dplc_ir::Plan| p.stages[0].memory.buffers as i64;
    let grown = buffers(&on) - buffers(&off);
    assert!((0..=s * b * h * 2 + 1).contains(&grown), "{grown}");
}

/// Accumulating gradients outside the GEMM costs, per micro-batch, one
/// memory-bound pass over the rank's weight gradients: read the new one
/// (2 bytes in bf16), read and write the fp32 main one (8). Only compute
/// changes, by exactly that; the default is Megatron's fused accumulation,
/// and plans written before the key read as fused.
#[test]
fn separate_gradient_accumulation_adds_one_pass_per_micro_batch() {
    let base = "tp=1,pp=1,dp=8,mb=1,zero=1,recompute=none,attention=fused";
    let fused = plan_as_pinned(GPT_1_7B, "8xA100", 32, &format!("{base},grad_accum=fused"));
    let separate = plan_as_pinned(
        GPT_1_7B,
        "8xA100",
        32,
        &format!("{base},grad_accum=separate"),
    );
    assert_eq!(
        plan_as_pinned(GPT_1_7B, "8xA100", 32, base)
            .plan
            .strategy
            .grad_accum,
        dplc_ir::GradAccum::Fused
    );
    let (f, s) = (
        &fused.plan.estimate.breakdown,
        &separate.plan.estimate.breakdown,
    );
    let m = separate.plan.strategy.num_micro_batches as f64;
    assert_eq!(m, 4.0);
    let params = separate.plan.params as f64;
    let bw = 2039e9 * 0.8;
    let want = m * params * 10.0 / bw;
    within(
        s.compute_s - f.compute_s,
        want,
        0.02,
        "the accumulation passes",
    );
    assert_eq!(f.exposed_comm_s, s.exposed_comm_s);
    let json = serde_json::to_value(&fused.plan).unwrap();
    assert!(
        json["strategy"].get("grad_accum").is_none(),
        "fused is not written"
    );
    let sep = serde_json::to_value(&separate.plan).unwrap();
    assert_eq!(sep["strategy"]["grad_accum"], "Separate");
}

/// FSDP2's per-parameter shards (`shards=per_param`) cost, per micro-batch,
/// the copies it makes on the compute stream: each all-gather's output
/// copied out into the parameters, in forward and again in backward (read
/// and write 2 bytes each in bf16), and the gradients copied into the
/// reduce-scatter's fp32 input (read 2, write 4): 14 bytes a gathered
/// parameter. Only compute moves, by exactly that; below ZeRO-3 nothing is
/// gathered and the key changes nothing; plans written before it read as flat.
#[test]
fn per_parameter_shards_add_fsdp2_copies_per_micro_batch() {
    let base = "tp=1,pp=1,dp=8,mb=1,recompute=none,attention=fused";
    let at = |zero: u8, shards: &str| {
        plan_as_pinned(
            GPT_1_7B,
            "8xA100",
            32,
            &format!("{base},zero={zero},shards={shards}"),
        )
    };
    let (flat, per_param) = (at(3, "flat"), at(3, "per_param"));
    let (f, p) = (
        &flat.plan.estimate.breakdown,
        &per_param.plan.estimate.breakdown,
    );
    let m = per_param.plan.strategy.num_micro_batches as f64;
    assert_eq!(m, 4.0);
    let want = m * per_param.plan.params as f64 * 14.0 / (2039e9 * 0.8);
    within(p.compute_s - f.compute_s, want, 0.01, "FSDP2's copies, s");
    assert_eq!(f.exposed_comm_s, p.exposed_comm_s);
    assert_eq!(
        at(1, "flat").plan.estimate.step_time_s,
        at(1, "per_param").plan.estimate.step_time_s
    );
    let json = serde_json::to_value(&flat.plan).unwrap();
    assert!(
        json["strategy"].get("shards").is_none(),
        "flat is not written"
    );
    let json = serde_json::to_value(&per_param.plan).unwrap();
    assert_eq!(json["strategy"]["shards"], "PerParam");
}

/// Communication hidden behind compute slows the compute beside it by
/// 18.9% (Lee et al. 2025, the average they measured): the step grows by
/// 0.189/1.189 of the hidden seconds, which `overlap_slowdown` prices and
/// the breakdown keeps; with nothing hidden (replicated state reduced after
/// backward, no tensor-parallel overlap) nothing is added.
#[test]
fn hidden_communication_slows_the_compute_beside_it() {
    let base = "tp=2,pp=1,dp=4,mb=1,recompute=none,attention=fused";
    let hidden = |p: &dplc_ir::Plan| -> f64 {
        p.estimate
            .breakdown
            .comm_by_axis
            .iter()
            .map(|a| a.hidden_s)
            .sum()
    };
    let overlapped = plan_as_pinned(
        GPT_1_7B,
        "8xA100",
        32,
        &format!("{base},zero=1,tp_overlap=async"),
    );
    let b = &overlapped.plan.estimate.breakdown;
    assert!(hidden(&overlapped.plan) > 0.0);
    within(
        b.overlap_slowdown_s,
        hidden(&overlapped.plan) * 0.189 / 1.189,
        1e-9,
        "the slowdown, s",
    );
    let exposed = plan_as_pinned(
        GPT_1_7B,
        "8xA100",
        32,
        &format!("{base},zero=0,tp_overlap=none,overlap=off"),
    );
    assert_eq!(hidden(&exposed.plan), 0.0);
    assert_eq!(exposed.plan.estimate.breakdown.overlap_slowdown_s, 0.0);
}

/// `root=replicated` prices the embedding, head and loss whole on every
/// tensor-parallel rank (what dplc's runtime runs): at tp 8 the head's GEMM
/// and the vocabulary tables cost 8× per rank, so the step is slower and the
/// optimizer holds more; at tp 1 the two are the same plan. Plans written
/// before the key read as vocabulary-parallel.
#[test]
fn a_replicated_root_is_priced_whole_on_every_rank() {
    let at = |strategy: &str| plan_as_pinned(GPT_1_7B, "8xA100", 8, strategy).plan;
    let base = "pp=1,dp=1,mb=1,zero=0,recompute=none,sp=off,attention=fused";
    let vocab = at(&format!("tp=8,{base},root=vocab"));
    let whole = at(&format!("tp=8,{base},root=replicated"));
    assert_eq!(whole.strategy.root, dplc_ir::RootSplit::Replicated);
    assert!(
        whole.estimate.breakdown.compute_s > vocab.estimate.breakdown.compute_s,
        "replicated {} vs vocab {}",
        whole.estimate.breakdown.compute_s,
        vocab.estimate.breakdown.compute_s
    );
    assert!(whole.stages[0].memory.weights > vocab.stages[0].memory.weights);
    let one = |root: &str| {
        at(&format!(
            "tp=1,pp=1,dp=8,mb=1,zero=0,recompute=none,root={root}"
        ))
        .estimate
        .step_time_s
    };
    assert_eq!(one("vocab"), one("replicated"));
    let json = serde_json::to_value(&vocab).unwrap();
    assert!(
        json["strategy"].get("root").is_none(),
        "vocab is not written"
    );
}

/// The optimizer step's memory traffic follows the precision: 36 bytes a
/// parameter in fp32 (the master is the weight), 38 in bf16 (plus the
/// working copy), 46 in fp16 (plus loss scaling's unscale and inf check).
#[test]
fn the_optimizer_step_moves_the_bytes_its_precision_needs() {
    let g = gpt("gpt", GPT_1_7B);
    let step = |precision: dplc_ir::Precision| {
        let mut spec = train(2048, 8);
        spec.precision = precision;
        let mut req = PlanRequest::new(&g, spec, parse_cluster("8xA100").unwrap());
        req.pinned = parse_strategy("tp=1,pp=1,dp=8,mb=1,zero=0,recompute=none").unwrap();
        req.ignore_memory = true;
        compile(&req).unwrap().plan.estimate.breakdown.optimizer_s
    };
    let (fp32, bf16, fp16) = (
        step(dplc_ir::Precision::Fp32),
        step(dplc_ir::Precision::Bf16),
        step(dplc_ir::Precision::Fp16),
    );
    within(bf16 / fp32, 38.0 / 36.0, 1e-9, "bf16 over fp32");
    within(fp16 / fp32, 46.0 / 36.0, 1e-9, "fp16 over fp32");
}

/// The same pinned plan with the layers' linear GEMMs in FP8 and without.
fn fp8_pair(cluster: &str, strategy: &str) -> (dplc_ir::Plan, dplc_ir::Plan) {
    let g = gpt("gpt", GPT_22B);
    let at = |fp8: &str| {
        let mut req = PlanRequest::new(&g, train(2048, 64), parse_cluster(cluster).unwrap());
        req.pinned = parse_strategy(&format!("{strategy},fp8={fp8}")).unwrap();
        compile(&req).unwrap().plan
    };
    (at("off"), at("on"))
}

#[test]
fn fp8_runs_the_layers_linear_gemms_at_the_fp8_rate_and_keeps_their_casts() {
    let strategy = "tp=8,pp=1,dp=1,mb=1,zero=0,recompute=none,sp=on";
    let (bf16, fp8) = fp8_pair("8xH100", strategy);
    assert!(!bf16.strategy.fp8 && fp8.strategy.fp8);
    let (b, f) = (&bf16.estimate.breakdown, &fp8.estimate.breakdown);
    // The linear GEMMs are most of a 22B layer's compute at seq 2048: FP8's
    // doubled rate less its casts lands between 1.3× and 2× faster; nothing
    // but compute and the per-step weight cast moves.
    let speedup = b.compute_s / f.compute_s;
    assert!(
        (1.3..2.0).contains(&speedup),
        "compute {speedup:.2}× faster"
    );
    let comm = |t: &dplc_ir::TimeBreakdown| t.exposed_comm_s + t.overlapped_comm_s;
    assert!(
        (comm(b) / comm(f) - 1.0).abs() < 1e-9,
        "the same collectives"
    );
    assert!(
        f.optimizer_s > b.optimizer_s,
        "the weights are cast once a step"
    );
    // Memory: a byte each for a layer weight's cast and its transpose; the
    // linear layers' inputs kept as their one-byte copies.
    let (mb, mf) = (&bf16.stages[0].memory, &fp8.stages[0].memory);
    let layer_params = 48.0 * 12.0 * 6144.0 * 6144.0 / 8.0;
    let extra = (mf.weights - mb.weights) as f64;
    assert!(
        (extra / (2.0 * layer_params) - 1.0).abs() < 0.01,
        "{extra} B of casts"
    );
    assert!(mf.activations < mb.activations);
    assert!(mf.activations as f64 > 0.5 * mb.activations as f64);
}

/// NVIDIA's FP8 current-scaling recipes keep the first and last layers'
/// GEMMs in bf16 (`--first-last-layers-bf16`): with `fp8_bf16_ends=N` the
/// two end stages each run N layers at the bf16 rate, so the step grows by
/// what N layers cost in bf16 over FP8 on the slowest stage, and nothing else
/// moves; without FP8 it is refused.
#[test]
fn fp8_bf16_ends_run_the_end_layers_at_the_bf16_rate() {
    let strategy = "tp=8,pp=1,dp=1,mb=1,zero=0,recompute=none,sp=on";
    let (bf16, fp8) = fp8_pair("8xH100", strategy);
    let g = gpt("gpt", GPT_22B);
    let mut req = PlanRequest::new(&g, train(2048, 64), parse_cluster("8xH100").unwrap());
    req.pinned = parse_strategy(&format!("{strategy},fp8=on,fp8_bf16_ends=2")).unwrap();
    let ends = compile(&req).unwrap().plan;
    assert_eq!(ends.strategy.fp8_bf16_ends, 2);
    // One stage holds both ends: four of the 48 layers in bf16.
    let layer = |p: &dplc_ir::Plan| p.estimate.breakdown.compute_s / 48.0;
    let expected = fp8.estimate.breakdown.compute_s + 4.0 * (layer(&bf16) - layer(&fp8));
    // The embedding and head run at the same rate either way; the layers'
    // share of compute makes the per-layer estimate a close bound.
    let got = ends.estimate.breakdown.compute_s;
    assert!(
        got > fp8.estimate.breakdown.compute_s && (got / expected - 1.0).abs() < 0.01,
        "{got} s, expected about {expected} s"
    );
    assert!(ends
        .strategy
        .to_string()
        .contains("the first and last 2 layers in bf16"));
    let e = error(GPT_22B, "8xH100", 64, "fp8_bf16_ends=1");
    assert!(e.to_string().contains("needs fp8=on"), "{e}");
}

#[test]
fn fp8_is_refused_where_no_tensor_core_runs_it_and_never_chosen_unasked() {
    let e = error(GPT_1_7B, "8xA100", 64, "fp8=on");
    assert!(e.to_string().contains("FP8 tensor cores"), "{e}");
    let g = gpt("gpt", GPT_1_7B);
    let req = PlanRequest::new(&g, train(2048, 64), parse_cluster("8xH100").unwrap());
    assert!(!compile(&req).unwrap().plan.strategy.fp8);
}

/// A 6.7B GPT (GPT-3 6.7B's shape): 120 GB of weights, gradients and Adam
/// state, more than one 80 GB device holds, less than its host's share.
const GPT_6_7B: Gpt = Gpt {
    hidden: 4096,
    heads: 32,
    layers: 32,
    vocab: 51200,
    ctx: 2048,
};

fn one_device(cfg: Gpt, cluster: &str, strategy: &str) -> Result<dplc_ir::Plan, PlanError> {
    let g = gpt("gpt", cfg);
    let mut req = PlanRequest::new(&g, train(2048, 8), parse_cluster(cluster).unwrap());
    req.pinned = parse_strategy(strategy).unwrap();
    compile(&req).map(|c| c.plan)
}

#[test]
fn a_model_too_big_for_its_device_offloads_its_optimizer_to_the_host() {
    // Without offload nothing fits one A100: the search offloads by itself.
    let e = one_device(GPT_6_7B, "1xA100", "offload=none").unwrap_err();
    assert!(e.to_string().contains("does not fit"), "{e}");
    let p = one_device(GPT_6_7B, "1xA100", "").unwrap();
    let o = p.strategy.offload;
    assert!(o.optimizer, "{}", p.strategy);
    let m = &p.stages[0].memory;
    assert_eq!(m.optimizer, 0);
    assert!(m.total() <= p.cluster.memory_bytes);
    // Host: Adam's 12 bytes a parameter plus fp32 gradients for the CPU step.
    let params = p.params as f64;
    assert!(
        m.host as f64 >= 16.0 * params * 0.99,
        "{} GiB",
        m.host as f64 / GIB
    );
    // The step pays the CPU's Adam at the host's memory bandwidth and the
    // gradients and weights across PCIe: slower than the device's own step.
    let b = &p.estimate.breakdown;
    assert!(b.offload_s > 0.0);
    let host_adam = params * (16.0 + 4.0) / (51.2e9 * 0.8);
    assert!(b.optimizer_s >= 0.9 * host_adam, "{} s", b.optimizer_s);
    // A model that fits never offloads.
    let small = one_device(GPT_1_7B, "1xA100", "").unwrap();
    assert!(small.strategy.offload.is_none());
}

#[test]
fn offload_needs_a_host_and_params_need_zero_3() {
    let e = one_device(GPT_1_7B, "4xcpu", "offload=optimizer").unwrap_err();
    assert!(e.to_string().contains("needs a host"), "{e}");
    let e = one_device(GPT_1_7B, "8xA100", "offload=optimizer+params,zero=1").unwrap_err();
    assert!(e.to_string().contains("zero=3"), "{e}");
    // Pinned, weights and activations go to the host too, and cost link time.
    let p = one_device(GPT_6_7B, "1xA100", "offload=optimizer+params+activations").unwrap();
    let m = &p.stages[0].memory;
    assert_eq!((p.strategy.zero_stage, m.weights), (3, 0));
    assert!(p.estimate.breakdown.offload_s > 0.0);
    assert!(parse_strategy("offload=disk").is_err());
}

/// `elementwise=eager` (PyTorch without torch.compile) moves every
/// operand of every elementwise op: more memory time, the same FLOPs and
/// communication; fused is the default and is not written into the plan.
#[test]
fn eager_elementwise_ops_only_add_memory_time() {
    let base = "tp=1,pp=1,dp=8,mb=1,zero=1,recompute=none,attention=fused";
    let fused = plan_as_pinned(GPT_1_7B, "8xA100", 32, base);
    let eager = plan_as_pinned(GPT_1_7B, "8xA100", 32, &format!("{base},elementwise=eager"));
    let (f, e) = (&fused.plan.estimate, &eager.plan.estimate);
    assert!(
        e.breakdown.compute_s > f.breakdown.compute_s * 1.01,
        "{e:?} vs {f:?}"
    );
    assert_eq!(e.model_flops_per_step, f.model_flops_per_step);
    assert_eq!(e.breakdown.exposed_comm_s, f.breakdown.exposed_comm_s);
    let json = serde_json::to_value(&fused.plan).unwrap();
    assert!(json["strategy"].get("elementwise").is_none());
    let json = serde_json::to_value(&eager.plan).unwrap();
    assert_eq!(json["strategy"]["elementwise"], "Eager");
}

/// GPT 1.7B on 8 A100s, one sequence a rank, fused and with `loss`
/// pinned, and that sequence's logits: the extra bytes `loss` moves a bf16
/// logit beyond the fused loss's 6, at the device's full bandwidth, bound
/// its extra time from below, the sustained fraction and its kernel
/// launches from above; the model FLOPs are the same, and the loss keeps
/// fp32 tensors of the logits where the fused loss keeps them in bf16.
fn a_loss_against_the_fused_one(loss: &str, bytes_a_logit: f64) -> (Compiled, Compiled, f64) {
    let base = "tp=1,pp=1,dp=8,mb=1,zero=1,recompute=none,attention=fused";
    let fused = plan_as_pinned(GPT_1_7B, "8xA100", 8, base);
    let other = plan_as_pinned(GPT_1_7B, "8xA100", 8, &format!("{base},loss={loss}"));
    let (f, o) = (&fused.plan.estimate, &other.plan.estimate);
    let logits = 2048.0 * GPT_1_7B.vocab as f64;
    let bandwidth = parse_cluster("8xA100").unwrap().device.memory_bandwidth;
    let extra = (bytes_a_logit - 6.0) * logits / bandwidth;
    let slower = o.breakdown.compute_s - f.breakdown.compute_s;
    assert!(
        slower > extra && slower < 1.5 * extra,
        "the {loss} loss adds {slower:.6} s, its bytes {extra:.6} s"
    );
    assert_eq!(o.model_flops_per_step, f.model_flops_per_step);
    let (fm, om) = (&fused.plan.stages[0].memory, &other.plan.stages[0].memory);
    assert_eq!(
        om.embedding_and_loss - fm.embedding_and_loss,
        (2.0 * logits) as u64,
        "the {loss} loss's fp32 tensor in the bf16 logits' place"
    );
    (fused, other, logits)
}

/// `loss=unfused` (Megatron's default `vocab_parallel_cross_entropy`)
/// passes over the logits eight times in fp32 where the fused loss reads
/// them once each way: 52 bytes a bf16 logit against 6, the rest of the
/// step untouched; and it keeps the fp32 softmax (4 bytes a logit) where
/// the fused loss keeps the bf16 logits (2), the gradient written beside
/// it the same. Fused is the default and is not written into the plan.
#[test]
fn an_unfused_loss_makes_its_passes_and_keeps_an_fp32_softmax() {
    let (fused, unfused, _) = a_loss_against_the_fused_one("unfused", 52.0);
    let (f, u) = (&fused.plan.estimate, &unfused.plan.estimate);
    assert_eq!(u.breakdown.exposed_comm_s, f.breakdown.exposed_comm_s);
    let (fm, um) = (&fused.plan.stages[0].memory, &unfused.plan.stages[0].memory);
    assert_eq!((um.activations, um.buffers), (fm.activations, fm.buffers));
    let json = serde_json::to_value(&fused.plan).unwrap();
    assert!(json["strategy"].get("loss").is_none());
    let json = serde_json::to_value(&unfused.plan).unwrap();
    assert_eq!(json["strategy"]["loss"], "Unfused");
    assert!(unfused.plan.strategy.to_string().contains("loss unfused"));
}

/// `loss=eager` (PyTorch's `F.cross_entropy` over the logits cast to fp32,
/// torchtitan's 2024 loss) moves 36 bytes a bf16 logit in five kernels
/// where the fused loss moves 6, keeps the fp32 log-probabilities (4 bytes
/// a logit, as Megatron's unfused loss keeps its softmax), and starts its
/// backward with two more fp32 tensors of the logits beside them: 8 bytes
/// a logit of working set where the fused loss writes the logits' bf16
/// gradient (2).
#[test]
fn an_eager_loss_keeps_fp32_log_probabilities_and_works_beside_them() {
    let (fused, eager, logits) = a_loss_against_the_fused_one("eager", 36.0);
    let (fm, em) = (&fused.plan.stages[0].memory, &eager.plan.stages[0].memory);
    assert_eq!(em.activations, fm.activations);
    let working = em.buffers as f64 - fm.buffers as f64;
    assert!(
        (working - 6.0 * logits).abs() <= 2.0,
        "backward's working set grows by {working} bytes, not 6 a logit"
    );
    let json = serde_json::to_value(&eager.plan).unwrap();
    assert_eq!(json["strategy"]["loss"], "Eager");
    assert!(eager.plan.strategy.to_string().contains("loss eager"));
    // What compiling the loss would buy, beside the plan.
    assert!(eager
        .plan
        .what_if
        .iter()
        .any(|w| w.change == "loss eager → fused"));

    // Over a vocabulary split by tp, DTensor's `loss_parallel` backward
    // holds three fp32 tensors of each rank's logits beside the kept ones.
    let base = "tp=2,pp=1,dp=4,mb=1,zero=1,recompute=none,attention=fused,sp=off";
    let fused = plan_as_pinned(GPT_1_7B, "8xA100", 8, base);
    let eager = plan_as_pinned(GPT_1_7B, "8xA100", 8, &format!("{base},loss=eager"));
    let (fm, em) = (&fused.plan.stages[0].memory, &eager.plan.stages[0].memory);
    let shard = logits / 2.0;
    let working = em.buffers as f64 - fm.buffers as f64;
    assert!(
        (working - 10.0 * shard).abs() <= 2.0,
        "backward's working set grows by {working} bytes, not 10 a logit of the shard"
    );
}

/// torchtitan's op-level checkpointing keeps more than a layer's input and
/// less than everything, and recomputes less than the whole forward.
#[test]
fn op_level_checkpointing_sits_between_none_and_full() {
    let base = "tp=1,pp=1,dp=8,mb=2,zero=1,attention=fused";
    let run =
        |r: &str| plan_as_pinned(GPT_1_7B, "8xA100", 32, &format!("{base},recompute={r}")).plan;
    let (none, op, full) = (run("none"), run("op"), run("full"));
    let acts = |p: &dplc_ir::Plan| p.stages[0].memory.activations;
    assert!(acts(&none) > acts(&op) && acts(&op) > acts(&full));
    let recompute = |p: &dplc_ir::Plan| p.estimate.breakdown.recompute_s;
    assert_eq!(recompute(&none), 0.0);
    assert!(recompute(&op) > 0.0 && recompute(&op) < recompute(&full));
    let hw = |p: &dplc_ir::Plan| p.estimate.hardware_flops_per_step;
    assert!(hw(&none) < hw(&op) && hw(&op) < hw(&full));
    // Never chosen unasked.
    assert_ne!(
        plan_as_pinned(GPT_1_7B, "8xA100", 32, "dp=8")
            .plan
            .strategy
            .recompute,
        dplc_ir::Recompute::Op
    );
}

/// `attention=flash2` runs the same kernel at FlashAttention-2's fraction
/// of peak: slower than the GEMM rate on an H100 (35%), the same memory;
/// `attention=flash1` at half that.
#[test]
fn flash2_and_flash1_price_attention_at_their_measured_fractions_of_peak() {
    // Without dropout: with it, FlashAttention-3 (which has none) is not an
    // option and `fused` is FlashAttention-2 on Hopper too.
    let as_pinned = |strategy: &str| {
        let g = gpt_with_dropout("gpt", GPT_1_7B, 0.0);
        let mut req = PlanRequest::new(&g, train(2048, 32), parse_cluster("8xH100").unwrap());
        req.pinned = parse_strategy(strategy).unwrap();
        req.ignore_memory = true;
        compile(&req).unwrap().plan
    };
    let base = "tp=1,pp=1,dp=8,mb=1,zero=1,recompute=none";
    let fused = as_pinned(&format!("{base},attention=fused"));
    let flash2 = as_pinned(&format!("{base},attention=flash2"));
    assert!(flash2.estimate.step_time_s > fused.estimate.step_time_s * 1.02);
    // With dropout the two are one kernel.
    let dropout = |kind: &str| {
        plan_as_pinned(GPT_1_7B, "8xH100", 32, &format!("{base},attention={kind}"))
            .plan
            .estimate
            .step_time_s
    };
    assert_eq!(dropout("fused"), dropout("flash2"));
    assert_eq!(flash2.stages[0].memory, fused.stages[0].memory);
    assert_eq!(
        flash2.estimate.model_flops_per_step,
        fused.estimate.model_flops_per_step
    );
    // FlashAttention (v1) and its Triton port: the same kernel's shape at
    // half FlashAttention-2's rate, so attention's time doubles: the step
    // grows by at least as much as flash2's exceeds the fused kernel's.
    let flash1 = as_pinned(&format!("{base},attention=flash1"));
    assert!(
        flash1.estimate.step_time_s - flash2.estimate.step_time_s
            > flash2.estimate.step_time_s - fused.estimate.step_time_s
    );
    assert_eq!(flash1.stages[0].memory, flash2.stages[0].memory);
    assert_eq!(
        flash1.estimate.model_flops_per_step,
        flash2.estimate.model_flops_per_step
    );
}

/// Context-parallel ranks hold the same weights: ZeRO shards their states
/// over dp × cp, so dp 2 × cp 2 keeps the optimizer state of dp 4.
#[test]
fn zero_shards_over_the_context_parallel_ranks_too() {
    let g = gpt_with_dropout("gpt", GPT_1_7B, 0.0);
    let run = |s: &str| {
        let mut req = PlanRequest::new(&g, train(2048, 8), parse_cluster("4xA100").unwrap());
        req.pinned = parse_strategy(s).unwrap();
        req.ignore_memory = true;
        compile(&req).unwrap().plan
    };
    let dp4 = run("tp=1,pp=1,dp=4,cp=1,mb=1,zero=1,recompute=none");
    let cp2 = run("tp=1,pp=1,dp=2,cp=2,mb=1,zero=1,recompute=none");
    let opt = |p: &dplc_ir::Plan| p.stages[0].memory.optimizer as f64;
    within(
        opt(&cp2),
        opt(&dp4),
        1e-9,
        "optimizer bytes, dp 2 × cp 2 against dp 4",
    );
}

/// A context-parallel rank attends its queries to every key: twice the
/// sequence over twice the ranks keeps the GEMMs per rank and doubles the
/// attention, so the step grows.
#[test]
fn context_parallel_attention_sees_the_whole_key_length() {
    let g = gpt_with_dropout("gpt", GPT_1_7B, 0.0);
    let step = |seq: u64, cp: u64| {
        let mut req = PlanRequest::new(&g, train(seq, 8 / cp), parse_cluster("8xA100").unwrap());
        req.pinned = parse_strategy(&format!(
            "tp=1,pp=1,dp={},cp={cp},mb=1,zero=1,recompute=none,attention=fused",
            8 / cp
        ))
        .unwrap();
        req.ignore_memory = true;
        compile(&req).unwrap().plan.estimate.breakdown.compute_s
    };
    assert!(step(2048, 2) > step(1024, 1) * 1.02);
}

/// ZeRO-3 hides its gathers and reduce-scatters behind compute, never more
/// traffic than there is compute to hide it behind.
#[test]
fn zero_3_hides_no_more_traffic_than_there_is_compute() {
    let p = plan_as_pinned(
        GPT_1_7B,
        "4x8xA100",
        64,
        "tp=1,pp=1,dp=32,mb=1,zero=3,recompute=none",
    )
    .plan;
    let b = &p.estimate.breakdown;
    let dp = b
        .comm_by_axis
        .iter()
        .find(|a| a.axis == dplc_ir::MeshAxis::Dp)
        .expect("dp traffic");
    assert!(
        dp.hidden_s <= b.compute_s,
        "{dp:?} hidden behind {} s",
        b.compute_s
    );
    assert!(
        b.exposed_dp_comm_s > 0.0,
        "the first gather and the last reduce-scatter wait"
    );
}

/// A four-layer model whose layers add `extra` (an expression of `x`).
fn axis_op_model(extra: &str) -> dplc_ir::Graph {
    let src = format!(
        "model m(d = 1024, layers = 4) {{\n  input tokens: i32[batch, seq]\n  \
         input targets: i32[batch, seq]\n  param embed: [32000, d]\n  h = embedding(embed, tokens)\n  \
         repeat layers {{\n    x = rms_norm(h, d)\n    h = h + swiglu(x, d, 4 * d){extra}\n  }}\n  \
         return cross_entropy(h @ transpose(embed), targets)\n}}\n"
    );
    let unit = dplc_frontend::parse("m.dpl", &src).unwrap_or_else(|d| panic!("{d}"));
    unit.lower("m").unwrap_or_else(|d| panic!("{d}")).graph
}

/// The ops along an axis are priced as the memory they move: a running sum
/// (a step of its own, reading and writing the activation) adds step time,
/// and so does a shift, less (fused into the kernel that adds it).
#[test]
fn shifts_and_running_sums_are_priced_as_memory_traffic() {
    let step = |extra: &str| {
        let g = axis_op_model(extra);
        let mut req = PlanRequest::new(&g, train(2048, 8), parse_cluster("1xA100").unwrap());
        req.pinned = parse_strategy("dp=1,mb=8,recompute=none").unwrap();
        compile(&req).unwrap().plan.estimate.step_time_s
    };
    let (plain, shifted, summed) = (step(""), step(" + shift(x, 1, 1)"), step(" + cumsum(x, 1)"));
    assert!(shifted > plain, "{shifted} vs {plain}");
    assert!(summed > shifted, "{summed} vs {shifted}");
}

/// Context parallelism would split the sequence a shift reads whole: a
/// pinned cp is refused with the op named, and the search (at a sequence
/// long enough to try cp) leaves it at 1; a shift along the features does
/// not stand in its way.
#[test]
fn a_shift_along_the_sequence_keeps_context_parallelism_off() {
    let g = axis_op_model(" + shift(x, 1, 1)");
    let mut req = PlanRequest::new(&g, train(16384, 64), parse_cluster("8xH100").unwrap());
    req.pinned = parse_strategy("cp=2").unwrap();
    let err = compile(&req).unwrap_err().to_string();
    assert!(
        err.contains("cp 2 splits the sequence, which `pad` in `layers` reads whole"),
        "{err}"
    );
    req.pinned = Default::default();
    req.ignore_memory = true;
    let plan = compile(&req).unwrap().plan;
    assert_eq!(plan.mesh.cp, 1);
    let g = axis_op_model(" + shift(x, 2, 1)");
    let mut req = PlanRequest::new(&g, train(16384, 64), parse_cluster("8xH100").unwrap());
    req.pinned = parse_strategy("cp=2").unwrap();
    req.ignore_memory = true;
    compile(&req).unwrap();
}

/// FSDP's float8 all-gather (`fp8_gather=on`: torchao's
/// `enable_fsdp_float8_all_gather`, Megatron's `--fp8-param-gather`): under
/// ZeRO-3 the layers' weights cross the wire as one byte instead of two, so
/// the data-parallel traffic shrinks (the embedding and output layer still
/// gather in bf16) and the gathered layers take half the room; below fp8 or
/// at ZeRO-0 it is refused, and a plan without it does not write the key.
#[test]
fn fp8_gather_halves_the_layers_fsdp_gathers() {
    let g = gpt("gpt", GPT_22B);
    let at = |gather: &str| {
        let mut req = PlanRequest::new(&g, train(2048, 64), parse_cluster("2x8xH100").unwrap());
        req.pinned = parse_strategy(&format!(
            "tp=1,pp=1,dp=16,mb=1,zero=3,recompute=full,fp8=on,fp8_gather={gather}"
        ))
        .unwrap();
        req.ignore_memory = true;
        compile(&req).unwrap().plan
    };
    let (bf16, fp8) = (at("off"), at("on"));
    assert!(fp8.strategy.fp8_gather && !bf16.strategy.fp8_gather);
    let dp = |p: &dplc_ir::Plan| {
        let a = p
            .estimate
            .breakdown
            .comm_by_axis
            .iter()
            .find(|a| a.axis == dplc_ir::MeshAxis::Dp)
            .expect("a data-parallel axis");
        a.exposed_s + a.hidden_s
    };
    // Per micro-batch: two gathers of the weights and one fp32 reduce-scatter
    // of the gradients, 2 + 2 + 4 bytes a weight in bf16, 1 + 1 + 4 in FP8.
    let ratio = dp(&fp8) / dp(&bf16);
    assert!(
        (0.74..0.78).contains(&ratio),
        "data-parallel seconds {ratio:.3} of bf16's (6/8 with the ends in bf16)"
    );
    assert!(fp8.stages[0].memory.buffers < bf16.stages[0].memory.buffers);
    assert!(fp8.estimate.step_time_s < bf16.estimate.step_time_s);
    assert!(serde_json::to_value(&bf16).unwrap()["strategy"]
        .get("fp8_gather")
        .is_none());
    let e = error(GPT_1_7B, "8xH100", 64, "zero=3,fp8_gather=on");
    assert!(e.to_string().contains("needs fp8=on"), "{e}");
    let e = error(GPT_1_7B, "8xH100", 64, "zero=0,fp8=on,fp8_gather=on");
    assert!(e.to_string().contains("zero ≥ 1"), "{e}");
}

/// A GPU stage's buffers include what the process holds outside its tensor
/// allocator, stated apart so a measured allocator peak can be compared
/// with the rest (the GPU check reads 0.97–1.00×); a CPU stage has none.
#[test]
fn the_runtime_reserve_is_stated_as_part_of_the_buffers() {
    let gpu = plan(GPT_1_7B, "1x8xA100", 64, "tp=8,pp=1,dp=1,mb=1", true);
    for st in &gpu.plan.stages {
        assert_eq!(st.memory.reserve, 3 << 29, "stage {}: 1.5 GiB", st.stage);
        assert!(st.memory.reserve < st.memory.buffers, "stage {}", st.stage);
    }
    let cpu = plan(GPT_1_7B, "8xcpu", 64, "tp=8,pp=1,dp=1,mb=1", true);
    assert!(cpu.plan.stages.iter().all(|st| st.memory.reserve == 0));
}

/// DTensor's tensor parallelism (`tp_impl=dtensor`, torchtitan's) against
/// Megatron's on the same plan. Every sequence-parallel reduce-scatter
/// copies its input into rank order, and with two sequences a micro-batch
/// every all-gather copies its output into place (with one, the pieces lie
/// in place): a read and a write of the whole tensor each, a memory-bound
/// pass (at 80% of the device's bandwidth, plus a launch). Backward gathers
/// no input again where the layer's recomputed forward has, or where it was
/// kept: without recomputation the gathered inputs stay beside their
/// shards until backward. Op-level checkpointing keeps no all-gather, so
/// its backward gathers again, as recomputation.
#[test]
fn dtensor_tp_copies_each_sequence_collective_and_keeps_what_it_gathered() {
    use dplc_ir::{Collective, CollectiveKind, MeshAxis, Plan, StepPhase};
    let g = gpt("gpt", GPT_1_7B);
    let cluster = parse_cluster("8xH100").unwrap();
    let bandwidth = cluster.device.memory_bandwidth;
    let run = |mb: u64, pins: &str| {
        let mut req = PlanRequest::new(&g, train(2048, mb), cluster.clone());
        req.pinned = parse_strategy(&format!(
            "tp=8,pp=1,dp=1,mb={mb},sp=on,tp_overlap=none,{pins}"
        ))
        .unwrap();
        compile(&req).unwrap().plan
    };
    let tp = |p: &Plan| -> Vec<Collective> {
        p.collectives
            .iter()
            .filter(|c| c.axis == MeshAxis::Tp)
            .cloned()
            .collect()
    };
    let regather = |c: &Collective| c.what.contains("re-gather");
    for mb in [1, 2] {
        let megatron = run(mb, "recompute=full,tp_impl=megatron");
        let dtensor = run(mb, "recompute=full,tp_impl=dtensor");
        let copies: f64 = tp(&megatron)
            .iter()
            .filter(|c| !regather(c))
            .map(|c| {
                let n = match c.kind {
                    CollectiveKind::ReduceScatter => 1.0,
                    CollectiveKind::AllGather if mb > 1 => 1.0,
                    _ => 0.0,
                };
                n * c.count_per_step as f64 * (2.0 * c.bytes as f64 / (bandwidth * 0.8) + 4e-6)
            })
            .sum();
        let regathers: f64 = tp(&megatron)
            .iter()
            .filter(|c| regather(c))
            .map(|c| c.count_per_step as f64 * c.time_s)
            .sum();
        assert!(copies > 0.0 && regathers > 0.0, "mb {mb}");
        assert!(!tp(&dtensor).iter().any(regather), "mb {mb}");
        // What Megatron's layout would buy, beside the plan.
        assert!(
            dtensor
                .what_if
                .iter()
                .any(|w| w.change == "tp_impl dtensor → megatron"),
            "mb {mb}"
        );
        let (m, d) = (&megatron.estimate.breakdown, &dtensor.estimate.breakdown);
        let close = |got: f64, want: f64, what: &str| {
            assert!(
                (got / want - 1.0).abs() < 1e-6,
                "mb {mb}, {what}: {got} s against {want} s"
            )
        };
        close(d.compute_s - m.compute_s, copies, "the copies");
        close(
            m.exposed_comm_s - d.exposed_comm_s,
            regathers,
            "the gathers again",
        );
    }

    // Kept between forward and backward without recomputation: each
    // gathered input beside its shard, 7/8 more of it at tp 8.
    let megatron = run(2, "recompute=none,tp_impl=megatron");
    let dtensor = run(2, "recompute=none,tp_impl=dtensor");
    let kept: f64 = tp(&megatron)
        .iter()
        .filter(|c| regather(c))
        .map(|c| c.count_per_step as f64 * c.bytes as f64 * 7.0 / 8.0)
        .sum();
    let held = |p: &Plan| {
        let m = &p.stages[0].memory;
        (m.activations + m.embedding_and_loss) as f64
    };
    let got = held(&dtensor) - held(&megatron);
    assert!(
        (got - kept).abs() <= 2.0,
        "kept {got} bytes more, want {kept}"
    );

    // Op-level checkpointing gathers again, as recomputation, in the
    // layers it checkpoints; the head, which it does not, keeps its input.
    let op = run(2, "recompute=op,tp_impl=dtensor");
    let again: Vec<(StepPhase, bool)> = tp(&op)
        .iter()
        .filter(|c| regather(c))
        .map(|c| (c.phase, c.what.starts_with("head")))
        .collect();
    assert!(!again.is_empty(), "the layers gather again");
    assert!(
        tp(&run(2, "recompute=op,tp_impl=megatron"))
            .iter()
            .any(|c| regather(c) && c.what.starts_with("head")),
        "Megatron's head gathers its input again"
    );
    assert!(
        again
            .iter()
            .all(|&(p, head)| p == StepPhase::Recompute && !head),
        "{again:?}"
    );
}

/// ZeRO-3 gathers each layer's weights for forward and again for backward
/// and reduce-scatters each layer's gradients, every micro-batch: a
/// collective a layer, each paying its own latency (63 hops at 64 ranks).
/// The plan lists them so, and their time is the step's data-parallel
/// traffic, exposed and hidden.
#[test]
fn zero3_moves_a_layer_at_a_time_each_paying_its_latency() {
    use dplc_ir::{CollectiveKind, MeshAxis, StepPhase};
    let cfg = GPT_1_7B;
    let g = gpt("gpt", cfg);
    let mut req = PlanRequest::new(&g, train(2048, 128), parse_cluster("8x8xA100").unwrap());
    req.pinned = parse_strategy("tp=1,pp=1,dp=64,mb=1,zero=3,recompute=full").unwrap();
    let plan = compile(&req).unwrap().plan;
    let m = plan.strategy.num_micro_batches;
    let dp: Vec<_> = plan
        .collectives
        .iter()
        .filter(|c| c.axis == MeshAxis::Dp)
        .collect();
    let layers = cfg.layers;
    for (kind, phase) in [
        (CollectiveKind::AllGather, StepPhase::Forward),
        (CollectiveKind::AllGather, StepPhase::Backward),
        (CollectiveKind::ReduceScatter, StepPhase::GradientSync),
    ] {
        let c = dp
            .iter()
            .find(|c| c.kind == kind && c.phase == phase)
            .unwrap_or_else(|| panic!("{kind:?} in {phase:?}"));
        assert_eq!(c.count_per_step, m * layers, "{kind:?} in {phase:?}");
    }
    let listed: f64 = dp.iter().map(|c| c.count_per_step as f64 * c.time_s).sum();
    let axis = plan
        .estimate
        .breakdown
        .comm_by_axis
        .iter()
        .find(|a| a.axis == MeshAxis::Dp)
        .expect("data-parallel traffic");
    let priced = axis.exposed_s + axis.hidden_s;
    assert!(
        (listed / priced - 1.0).abs() < 1e-9,
        "listed {listed} s, priced {priced} s"
    );
    // The latency is paid a layer at a time: the same bytes in one
    // collective each pass would cost less.
    let gather = dp
        .iter()
        .find(|c| c.kind == CollectiveKind::AllGather)
        .unwrap();
    let latency = 63.0 * parse_cluster("8x8xA100").unwrap().inter_node.latency_s;
    assert!(gather.time_s > latency, "{} s a layer", gather.time_s);
}

/// Sequence parallelism and the model's ends: Megatron's (and DTensor's)
/// split them along the sequence as they split a layer's activations, so
/// the ends' memory falls with sequence parallelism as the layers' does;
/// dplc's runtime runs them over every token (its root program all-reduces
/// the embedding's sum whole), so there sequence parallelism saves nothing
/// and the plan prices the ends as with it off. The layers price the same
/// under both.
#[test]
fn sequence_parallelism_splits_the_ends_only_where_the_implementation_does() {
    let g = gpt("gpt", GPT_1_7B);
    let cluster = parse_cluster("8xH100").unwrap();
    let run = |pins: &str| {
        let mut req = PlanRequest::new(&g, train(2048, 8), cluster.clone());
        req.pinned = parse_strategy(&format!("tp=8,pp=1,dp=1,mb=8,recompute=none,{pins}")).unwrap();
        compile(&req).unwrap().plan.stages[0].memory.clone()
    };
    let off = run("sp=off");
    let dplc = run("sp=on");
    let megatron = run("sp=on,tp_impl=megatron");
    let dtensor = run("sp=on,tp_impl=dtensor");
    assert!(off.embedding_and_loss > 0);
    // dplc's runtime: the ends as without sequence parallelism.
    assert_eq!(dplc.embedding_and_loss, off.embedding_and_loss);
    // Megatron's and DTensor's: what the ends keep whole, split over tp.
    assert!(
        megatron.embedding_and_loss < dplc.embedding_and_loss,
        "{} against {}",
        megatron.embedding_and_loss,
        dplc.embedding_and_loss
    );
    // DTensor's split them too; it keeps the head's gathered input beside.
    assert!(dtensor.embedding_and_loss < dplc.embedding_and_loss);
    // The layers' activations are the same under dplc's and Megatron's.
    assert_eq!(dplc.activations, megatron.activations);
    assert!(dplc.activations < off.activations);
}
