//! The planner on the model zoo through the frontend: golden plan summaries,
//! the published rows on the zoo's Megatron models, determinism and errors.

use dplc_planner::{compile, parse_cluster, parse_strategy, summary, Compiled, PlanRequest};

fn lowered(file: &str, model: &str) -> dplc_frontend::Lowered {
    let path = format!("{}/models/{file}", env!("CARGO_MANIFEST_DIR"));
    let text = std::fs::read_to_string(&path).expect("zoo file exists");
    let unit = dplc_frontend::parse(file, &text).expect("zoo file parses");
    unit.lower(model).expect("zoo model lowers")
}

fn plan(file: &str, model: &str, cluster: &str, strategy: &str, top_k: usize) -> Compiled {
    let l = lowered(file, model);
    let mut req = PlanRequest::new(&l.graph, l.train.clone(), parse_cluster(cluster).unwrap());
    req.pinned = parse_strategy(strategy).unwrap();
    req.top_k = top_k;
    compile(&req).unwrap_or_else(|e| panic!("{model} on {cluster}: {e}"))
}

/// The step time `c`'s plan prices for its what-if `change`.
fn what_if(c: &Compiled, change: &str) -> f64 {
    let w = c.plan.what_if.iter().find(|w| w.change == change);
    w.and_then(|w| w.step_time_s)
        .unwrap_or_else(|| panic!("no `{change}` in {:?}", c.plan.what_if))
}

/// The summary without the search's wall time, which varies run to run.
fn golden(c: &Compiled) -> String {
    let s = summary(c);
    let mut out = String::new();
    for line in s.lines() {
        match line.find(" fit, ") {
            Some(at) if line.trim_start().starts_with("search") => {
                let rest = &line[at + 6..];
                let after_ms = rest.find(" ms").map_or("", |i| &rest[i + 3..]);
                out.push_str(&format!("{} fit, <time> ms{after_ms}\n", &line[..at]));
            }
            _ => {
                out.push_str(line);
                out.push('\n');
            }
        }
    }
    out
}

fn plan_batch(file: &str, model: &str, cluster: &str, batch: Option<u64>) -> Compiled {
    let l = lowered(file, model);
    let mut req = PlanRequest::new(&l.graph, l.train.clone(), parse_cluster(cluster).unwrap());
    req.global_batch = batch;
    req.top_k = 3;
    compile(&req).unwrap_or_else(|e| panic!("{model} on {cluster}: {e}"))
}

// Golden plan summaries: a change to a plan is a reviewed diff
// (`cargo insta review`, or INSTA_UPDATE=always to re-bless).

#[test]
fn golden_gpt2_on_8xa100() {
    insta::assert_snapshot!(golden(&plan_batch("gpt2.dpl", "gpt2", "8xA100", None)));
}

#[test]
fn golden_llama3_70b_on_8x8xh100() {
    insta::assert_snapshot!(golden(&plan_batch(
        "llama3.dpl",
        "llama3_70b",
        "8x8xH100",
        None
    )));
}

#[test]
fn golden_gpt_1t_on_384x8xa100() {
    // Narayanan et al. 2021's batch for the 1T model on 3072 GPUs.
    insta::assert_snapshot!(golden(&plan_batch(
        "megatron_gpt.dpl",
        "gpt_1t",
        "384x8xA100",
        Some(3072)
    )));
}

#[test]
fn golden_mixtral_8x7b_on_2x8xh100() {
    insta::assert_snapshot!(golden(&plan_batch(
        "mixtral.dpl",
        "mixtral_8x7b",
        "2x8xH100",
        None
    )));
}

/// The encoder-decoder plans on one node, searched and with tensor and
/// pipeline splits pinned (each stack split by the Megatron rule; the
/// stages cut across the two stacks).
#[test]
fn t5_small_plans_on_one_node() {
    for strategy in ["", "tp=2,pp=2", "tp=4", "pp=4"] {
        let c = plan("t5.dpl", "t5_small", "8xA100", strategy, 1);
        assert_eq!(
            c.plan.mesh.dp * c.plan.mesh.tp * c.plan.mesh.pp,
            8,
            "{strategy}"
        );
        assert!(c.plan.estimate.step_time_s > 0.0, "{strategy}");
    }
}

/// Each attention carries its own mask, found from the graph: model FLOPs
/// leave out exactly the pairs the masks remove. T5's decoder masks its
/// self-attention over the 512 targets causally and not its cross-attention
/// to the encoder (both were priced causal when a layer's attentions shared
/// one flag), over its own 512 keys whatever the encoder's length; the
/// encoder masks nothing; Mistral's window keeps, at 8,192
/// tokens, the causal pairs of its first 4,096 keys and 4,096 a query after.
#[test]
fn each_attention_is_counted_by_its_own_mask() {
    let masked = |c: &Compiled| c.plan.estimate.masked_attention_flops_per_step;
    // Forward FLOPs of one attention's two matmuls over every pair.
    let attention =
        |b: f64, heads: f64, q: f64, k: f64, dh: f64| 2.0 * 2.0 * b * heads * q * k * dh;

    // At 2,048 encoder tokens: the decoder's mask is over its own 512.
    let l = lowered("t5.dpl", "t5_small");
    let mut req = PlanRequest::new(&l.graph, l.train.clone(), parse_cluster("8xA100").unwrap());
    req.seq = Some(2048);
    let t5 = compile(&req).unwrap();
    let (b, tgt) = (t5.plan.strategy.global_batch as f64, 512.0);
    let causal_removed = 1.0 - (tgt + 1.0) / (2.0 * tgt);
    let want = 3.0 * 6.0 * attention(b, 8.0, tgt, tgt, 64.0) * causal_removed;
    assert!(
        (masked(&t5) / want - 1.0).abs() < 1e-12,
        "{} vs {want}",
        masked(&t5)
    );

    let mistral = plan("mistral.dpl", "mistral_7b", "8x8xH100", "", 1);
    let (b, s, w) = (mistral.plan.strategy.global_batch as f64, 8192.0, 4096.0);
    assert_eq!(mistral.plan.strategy.seq, 8192);
    let kept = (w * (w + 1.0) / 2.0 + (s - w) * w) / (s * s);
    let want = 3.0 * 32.0 * attention(b, 32.0, s, s, 128.0) * (1.0 - kept);
    let got = masked(&mistral);
    assert!((got / want - 1.0).abs() < 1e-12, "{got} vs {want}");
}

#[test]
fn pinned_keys_are_kept_and_the_rest_searched() {
    let c = plan(
        "megatron_gpt.dpl",
        "gpt_175b",
        "16x8xA100",
        "tp=8,pp=8,recompute=selective,sp=on",
        0,
    );
    let p = &c.plan;
    assert_eq!((p.mesh.tp, p.mesh.pp, p.mesh.dp), (8, 8, 2));
    assert_eq!(p.strategy.recompute, dplc_ir::Recompute::Selective);
    assert!(p.strategy.sequence_parallel);
    assert_eq!(p.search.pinned, "tp=8,pp=8,recompute=selective,sp=on");
}

#[test]
fn llama3_405b_on_one_node_is_infeasible_with_advice() {
    let l = lowered("llama3.dpl", "llama3_405b");
    let req = PlanRequest::new(&l.graph, l.train.clone(), parse_cluster("8xH100").unwrap());
    let err = compile(&req).unwrap_err().to_string();
    assert!(err.contains("smallest per-rank memory"), "{err}");
    assert!(err.contains("the devices"), "{err}");
}

#[test]
fn tensor_parallelism_beyond_the_kv_heads_replicates_them() {
    // Llama 3 70B has 8 KV heads: at tp = 16 the query heads split and the
    // K and V projections are kept whole on every rank (issue: sharding e-graph).
    let l = lowered("llama3.dpl", "llama3_70b");
    let mut req = PlanRequest::new(
        &l.graph,
        l.train.clone(),
        parse_cluster("4x8xH100").unwrap(),
    );
    req.pinned = parse_strategy("tp=16").unwrap();
    let p = compile(&req).unwrap().plan;
    let splits = |name: &str| {
        p.param_sharding
            .iter()
            .find(|s| s.name == name)
            .unwrap_or_else(|| panic!("{name} is listed"))
            .splits
            .clone()
    };
    use dplc_ir::MeshAxis::Tp;
    assert_eq!(splits("layers.attention.q.w"), vec![(Tp, 1)]);
    assert_eq!(splits("layers.attention.k.w"), vec![]);
    assert_eq!(splits("layers.attention.v.w"), vec![]);
    assert_eq!(splits("layers.attention.o.w"), vec![(Tp, 0)]);
    // A degree that divides nothing at all is still refused.
    req.pinned = parse_strategy("tp=3").unwrap();
    let err = compile(&req).unwrap_err().to_string();
    assert!(err.contains("tp=3") && err.contains("divide"), "{err}");
}

#[test]
fn a_plan_pinned_as_it_chose_plans_the_same() {
    // What `dplc export` relies on to price the closest plan an engine can
    // run: every choice pinned gives the plan back, order and stages included.
    for (file, model, cluster, strategy) in [
        ("gpt2.dpl", "gpt2", "8xA100", "pp=4,dp=2"),
        ("llama3.dpl", "llama3_70b", "8x8xH100", ""),
        ("mixtral.dpl", "mixtral_8x7b", "2x8xH100", ""),
    ] {
        let first = plan(file, model, cluster, strategy, 0).plan;
        let pins = dplc_planner::StrategyConstraints::of_plan(&first);
        let again = plan(file, model, cluster, &pins.to_string(), 0).plan;
        assert_eq!(first.strategy, again.strategy, "{model}: {pins}");
        assert_eq!(first.mesh, again.mesh, "{model}: {pins}");
        assert_eq!(first.stage_layers(), again.stage_layers(), "{model}");
        assert_eq!(
            first.estimate.step_time_s, again.estimate.step_time_s,
            "{model}: {pins}"
        );
    }
}

#[test]
fn even_stages_and_the_rank_order_can_be_pinned() {
    let balanced = plan("gpt2.dpl", "gpt2", "8xA100", "pp=4,dp=2", 0).plan;
    assert_ne!(balanced.stage_layers(), vec![3, 3, 3, 3]);
    let even = plan("gpt2.dpl", "gpt2", "8xA100", "pp=4,dp=2,stages=even", 0).plan;
    assert_eq!(even.stage_layers(), vec![3, 3, 3, 3]);
    assert!(even.estimate.step_time_s >= balanced.estimate.step_time_s);
    for order in [
        dplc_planner::AxisOrder::DataInner,
        dplc_planner::AxisOrder::PipelineInner,
    ] {
        let p = plan(
            "gpt2.dpl",
            "gpt2",
            "2x8xA100",
            &format!("pp=2,dp=8,order={}", order.name()),
            0,
        )
        .plan;
        assert_eq!(dplc_planner::AxisOrder::of(&p.mesh), order);
    }
    assert!(parse_strategy("order=dp-first").is_err());
    assert!(parse_strategy("stages=uneven").is_err());
}

/// Every zoo model compiles on a cluster of its size with tensor
/// parallelism in the plan (each pinned at a degree its layers split by),
/// and its layers laid out by the sharding e-graph.
#[test]
fn every_zoo_model_plans_with_tensor_parallelism() {
    for (file, model, cluster, tp) in [
        ("gpt2.dpl", "gpt2", "8xA100", 2),
        ("bert.dpl", "bert_large", "8xA100", 4),
        ("vit.dpl", "vit_l16", "8xA100", 2),
        ("llama2.dpl", "llama2_13b", "2x8xA100", 8),
        ("llama3.dpl", "llama3_8b", "8xH100", 8),
        ("mistral.dpl", "mistral_7b", "8xH100", 8),
        ("gemma.dpl", "gemma_2b", "8xH100", 4),
        ("mixtral.dpl", "mixtral_8x7b", "2x8xH100", 4),
        ("deepseek.dpl", "deepseek_v2_lite", "4x8xH100", 4),
        ("t5.dpl", "t5_large", "8xA100", 4),
        ("megatron_gpt.dpl", "gpt_22b", "8x8xA100", 8),
    ] {
        let c = plan(file, model, cluster, &format!("tp={tp}"), 1);
        assert_eq!(c.plan.mesh.tp, tp, "{model}");
        assert!(
            c.plan.layout.is_some() && !c.plan.programs.is_empty(),
            "{model}: a tensor-parallel plan carries its layouts"
        );
    }
}

/// Under a pipeline the search keeps to ZeRO-1 unasked, and plans ZeRO-3
/// (FSDP + PP) when it is pinned.
#[test]
fn fsdp_under_a_pipeline_plans_when_pinned() {
    let searched = plan("llama3.dpl", "llama3_8b", "2x8xH100", "pp=2", 1);
    assert!(searched.plan.strategy.zero_stage <= 1);
    let pinned = plan("llama3.dpl", "llama3_8b", "2x8xH100", "pp=2,zero=3", 1);
    assert_eq!(
        (pinned.plan.mesh.pp, pinned.plan.strategy.zero_stage),
        (2, 3)
    );
}

/// A fused attention kernel skips the key tiles wholly behind a sliding
/// window as it skips those above the diagonal: Mistral 7B at seq 8192
/// (window 4096) spends less on attention than the same model with the
/// window switched off, and a window as long as the sequence costs nothing
/// more. Unfused attention computes every score whatever the mask.
#[test]
fn a_sliding_window_skips_attention_tiles_in_fused_kernels() {
    let path = format!("{}/models/mistral.dpl", env!("CARGO_MANIFEST_DIR"));
    let text = std::fs::read_to_string(&path).expect("zoo file exists")
        + "\nmodel mistral_no_window = mistral_7b(window = 0)\n\
           model mistral_whole_window = mistral_7b(window = 8192)\n";
    let unit = dplc_frontend::parse("mistral.dpl", &text).expect("parses");
    let step = |model: &str, attention: &str| {
        let l = unit.lower(model).expect("lowers");
        let mut req = PlanRequest::new(&l.graph, l.train.clone(), parse_cluster("8xH100").unwrap());
        req.seq = Some(8192);
        req.global_batch = Some(64);
        req.pinned = parse_strategy(&format!(
            "tp=1,pp=1,dp=8,mb=1,zero=1,recompute=full,attention={attention}"
        ))
        .unwrap();
        req.ignore_memory = true;
        let c = compile(&req).unwrap_or_else(|e| panic!("{model}: {e}"));
        c.plan.estimate.breakdown.compute_s
    };
    for attention in ["fused", "flash2"] {
        let (windowed, causal) = (
            step("mistral_7b", attention),
            step("mistral_no_window", attention),
        );
        let whole = step("mistral_whole_window", attention);
        eprintln!("{attention}: compute {windowed:.3} s with the window, {causal:.3} s without");
        assert!(
            (whole / causal - 1.0).abs() < 1e-9,
            "{attention}: a window of the whole sequence changes the compute ({whole} vs {causal})"
        );
        assert!(
            windowed < causal * 0.99,
            "{attention}: the window saves nothing ({windowed} vs {causal})"
        );
    }
    let (windowed, causal) = (
        step("mistral_7b", "unfused"),
        step("mistral_no_window", "unfused"),
    );
    assert!(windowed >= causal, "unfused: {windowed} vs {causal}");
}

/// The token dispatcher is priced from the routing: Qwen3-30B-A3B's eight
/// of 128 experts over 16 ranks on two nodes cross the network once per
/// token under a hierarchical dispatcher (DeepEP, HybridEP) where one
/// all-to-all sends four of the eight copies across, so the expert traffic
/// takes under a third of the time; Mixtral's two of eight experts, one a
/// rank inside a node, have no copy to save (across nodes they would: two
/// experts on the other node cross once). The pinned dispatcher is kept
/// in the plan and shown in its summary.
#[test]
fn a_hierarchical_dispatcher_sends_a_token_once_to_each_node() {
    let ep_comm = |c: &Compiled| -> f64 {
        let ep = c.plan.collectives.iter();
        ep.filter(|x| x.axis == dplc_ir::MeshAxis::Ep)
            .map(|x| x.time_s * x.count_per_step as f64)
            .sum()
    };
    let qwen = |d: &str| {
        plan(
            "qwen3.dpl",
            "qwen3_30b_a3b",
            "2x8xH100",
            &format!("tp=1,pp=1,cp=1,dp=16,ep=16,mb=1,zero=1,recompute=full,dispatch={d}"),
            0,
        )
    };
    let (flat, hier) = (qwen("alltoall"), qwen("deepep"));
    assert_eq!(hier.plan.strategy.dispatch, dplc_ir::Dispatch::Hierarchical);
    assert!(summary(&hier).contains("token dispatch hierarchical"));
    // Each call's latency (fifteen peers), the same either way, keeps the
    // ratio under the bytes' four (comm::tests has the exact bytes).
    let ratio = ep_comm(&flat) / ep_comm(&hier);
    assert!((3.3..4.0).contains(&ratio), "{ratio}");
    assert!(hier.plan.estimate.step_time_s < flat.plan.estimate.step_time_s);
    // Each plan prices the other dispatcher as a what-if.
    let to_hier = what_if(&flat, "dispatch alltoall → hierarchical");
    assert!((to_hier - hier.plan.estimate.step_time_s).abs() < 1e-9 * to_hier);
    let to_flat = what_if(&hier, "dispatch hierarchical → alltoall");
    assert!((to_flat - flat.plan.estimate.step_time_s).abs() < 1e-9 * to_flat);

    let mixtral = |d: &str| {
        plan(
            "mixtral.dpl",
            "mixtral_8x7b",
            "8xH100",
            &format!("tp=1,ep=8,dispatch={d}"),
            0,
        )
    };
    let (flat, hier) = (mixtral("alltoall"), mixtral("hierarchical"));
    assert_eq!(flat.plan.strategy.dispatch, dplc_ir::Dispatch::AllToAll);
    assert!(ep_comm(&flat) > 0.0);
    assert!((ep_comm(&flat) - ep_comm(&hier)).abs() < 1e-9 * ep_comm(&flat));
    let l = lowered("gpt2.dpl", "gpt2");
    let mut req = PlanRequest::new(&l.graph, l.train.clone(), parse_cluster("8xA100").unwrap());
    req.pinned = parse_strategy("dispatch=hierarchical").unwrap();
    let err = compile(&req).unwrap_err().to_string();
    assert!(err.contains("the model has no experts"), "{err}");
    assert!(parse_strategy("dispatch=broadcast")
        .unwrap_err()
        .to_string()
        .contains("dispatch is alltoall or hierarchical"));
}

/// Half-precision main gradients (`grad_reduce=bf16`): the gradients a
/// rank keeps and the bytes their reduction sends are halved, exactly, and
/// the plan carries the choice; the search never makes it unasked; a
/// precision the model does not train in is refused.
#[test]
fn half_precision_main_gradients_halve_what_is_kept_and_sent() {
    let llama = |extra: &str| {
        plan(
            "llama3.dpl",
            "llama3_8b",
            "2x8xH100",
            &format!("tp=2,pp=2,cp=1,dp=4,mb=1,zero=1,recompute=none{extra}"),
            0,
        )
    };
    let (fp32, bf16) = (llama(""), llama(",grad_reduce=bf16"));
    assert_eq!(fp32.plan.strategy.grad_reduce, dplc_ir::GradReduce::Fp32);
    assert_eq!(bf16.plan.strategy.grad_reduce, dplc_ir::GradReduce::Bf16);
    assert!(summary(&bf16).contains("gradients in bf16"));
    for (a, b) in fp32.plan.stages.iter().zip(&bf16.plan.stages) {
        assert_eq!(a.memory.gradients, 2 * b.memory.gradients);
        assert_eq!(a.memory.weights, b.memory.weights);
        assert_eq!(a.memory.optimizer, b.memory.optimizer);
    }
    let reduced = |c: &Compiled| {
        let x = c.plan.collectives.iter();
        x.filter(|x| x.phase == dplc_ir::StepPhase::GradientSync)
            .map(|x| (x.what.clone(), x.bytes))
            .collect::<Vec<_>>()
    };
    let (a, b) = (reduced(&fp32), reduced(&bf16));
    assert_eq!(a.len(), 1);
    assert_eq!(a[0], ("gradients (fp32)".to_string(), 2 * b[0].1));
    assert_eq!(b[0].0, "gradients (bf16)");
    // Each plan prices the other precision as a what-if, every other choice kept.
    let to_bf16 = what_if(&fp32, "grad_reduce=bf16");
    assert!((to_bf16 - bf16.plan.estimate.step_time_s).abs() < 1e-9 * to_bf16);
    let to_fp32 = what_if(&bf16, "grad_reduce=fp32");
    assert!((to_fp32 - fp32.plan.estimate.step_time_s).abs() < 1e-9 * to_fp32);
    // Round-trips through the plan's pins; the search keeps fp32 unasked.
    let again = dplc_planner::StrategyConstraints::of_plan(&bf16.plan);
    assert_eq!(again.grad_reduce, Some(dplc_ir::GradReduce::Bf16));
    assert!(again.to_string().contains("grad_reduce=bf16"));
    let free = plan("llama3.dpl", "llama3_8b", "2x8xH100", "", 0);
    assert_eq!(free.plan.strategy.grad_reduce, dplc_ir::GradReduce::Fp32);
    // `--allow grad_reduce` lets the search take them where they pay:
    // llama3_8b on 64 A100s reduce-scatters across nodes every step.
    let l = lowered("llama3.dpl", "llama3_8b");
    let mut req = PlanRequest::new(
        &l.graph,
        l.train.clone(),
        parse_cluster("8x8xA100").unwrap(),
    );
    (req.seq, req.global_batch) = (Some(8192), Some(64));
    let kept = compile(&req).unwrap();
    assert_eq!(kept.plan.strategy.grad_reduce, dplc_ir::GradReduce::Fp32);
    req.pinned.allow = dplc_planner::Allow::parse("grad_reduce").unwrap();
    let taken = compile(&req).unwrap();
    assert_eq!(taken.plan.strategy.grad_reduce, dplc_ir::GradReduce::Bf16);
    assert!(taken.plan.estimate.step_time_s < kept.plan.estimate.step_time_s);
    assert!(taken.plan.search.configs_evaluated > kept.plan.search.configs_evaluated);
    assert!(dplc_planner::Allow::parse("grad")
        .unwrap_err()
        .to_string()
        .contains("sync, compress and/or grad_reduce"));
    // gpt2 trains in bf16: fp16 gradients are not its precision.
    let l = lowered("gpt2.dpl", "gpt2");
    let mut req = PlanRequest::new(&l.graph, l.train.clone(), parse_cluster("8xA100").unwrap());
    req.pinned = parse_strategy("grad_reduce=fp16").unwrap();
    let err = compile(&req).unwrap_err().to_string();
    assert!(err.contains("this model trains in bf16"), "{err}");
    assert!(parse_strategy("grad_reduce=int8")
        .unwrap_err()
        .to_string()
        .contains("grad_reduce is fp32, bf16 or fp16"));
}

/// ZeRO-1's weight all-gather is listed with the bytes the step prices: the
/// layers' FP8 casts (a byte each) under `fp8_gather`, the embedding and
/// the head in bf16.
#[test]
fn the_listed_weight_gather_moves_what_the_step_prices() {
    let gather = |extra: &str| {
        let c = plan(
            "llama3.dpl",
            "llama3_8b",
            "2x8xH100",
            &format!("tp=1,pp=1,cp=1,dp=16,mb=1,zero=1,fp8=on{extra}"),
            0,
        );
        let x = c.plan.collectives.iter();
        let g: Vec<_> = x
            .filter(|x| x.phase == dplc_ir::StepPhase::Optimizer)
            .map(|x| (x.what.clone(), x.bytes))
            .collect();
        assert_eq!(g.len(), 1, "{g:?}");
        g[0].clone()
    };
    let (bf16, fp8) = (gather(""), gather(",fp8_gather=on"));
    assert_eq!(bf16.0, "updated weights");
    assert_eq!(fp8.0, "updated weights (the layers' FP8 casts)");
    // 8.03 G parameters, 1.05 G of them outside the layers: the embedding,
    // the head and the final norm's gain.
    let (params, ends) = (8_030_261_248u64, 2 * 128_256 * 4096 + 4096);
    assert_eq!(bf16.1, 2 * params);
    assert_eq!(fp8.1, 2 * ends + (params - ends));
}

/// The expert weights' gradients and gathers are listed over the ranks
/// holding the same experts (dp / ep of them), as the step prices them, and
/// not at all where each expert lives on one rank of the replicas.
#[test]
fn expert_reductions_are_listed_over_the_expert_replicas() {
    let listed = |strategy: &str| {
        let c = plan("mixtral.dpl", "mixtral_8x7b", "4x8xH100", strategy, 0);
        let x = c.plan.collectives.into_iter();
        x.filter(|x| x.axis == dplc_ir::MeshAxis::Dp)
            .map(|x| (x.what, x.group.map(|(size, _)| size)))
            .collect::<Vec<_>>()
    };
    let split = listed("tp=2,pp=2,dp=8,ep=4");
    let group = |what: &str| {
        let hit = split.iter().find(|(w, _)| w == what);
        hit.unwrap_or_else(|| panic!("no `{what}` in {split:?}")).1
    };
    assert_eq!(group("gradients (fp32)"), Some(8));
    assert_eq!(group("expert gradients (fp32)"), Some(2));
    assert_eq!(group("updated expert weights"), Some(2));
    let whole = listed("tp=2,pp=2,dp=8,ep=8");
    assert!(
        whole.iter().all(|(w, _)| !w.contains("expert")),
        "{whole:?}"
    );
}

/// A dropout on the attention's scores costs a fused kernel its draws, per
/// attended score, at the device's measured rate (the H100 die's; none is
/// measured for the A100), and FlashAttention-3 has none: with dropout,
/// `attention=fused` is FlashAttention-2 on Hopper.
#[test]
fn attention_dropout_is_priced_per_attended_score() {
    let text = |p: f64| {
        format!(
            "model m(vocab = 1024, d = 1024, heads = 8, layers = 2) {{
                 input tokens: i32[batch, seq]
                 input targets: i32[batch, seq]
                 param embed: [vocab, d]
                 h = embedding(embed, tokens)
                 repeat layers {{
                     h = h + attention(layer_norm(h, d), d, heads, dropout = {p})
                 }}
                 return cross_entropy(h @ transpose(embed), targets)
             }}
             train m {{ seq = 4096 global_batch = 8 precision = bf16 optimizer = adamw(lr = 1e-4) }}"
        )
    };
    let step = |p: f64, cluster: &str, attention: &str| {
        let unit = dplc_frontend::parse("m.dpl", &text(p)).expect("the model parses");
        let l = unit.lower("m").expect("the model lowers");
        let mut req = PlanRequest::new(&l.graph, l.train.clone(), parse_cluster(cluster).unwrap());
        let pins = format!("tp=1,pp=1,dp=8,mb=1,zero=0,recompute=none,attention={attention}");
        req.pinned = parse_strategy(&pins).unwrap();
        compile(&req)
            .expect("the model plans")
            .plan
            .estimate
            .step_time_s
    };
    let same = |a: f64, b: f64| (a - b).abs() <= 1e-12 * a.max(b);
    // Hopper: with dropout, fused is FlashAttention-2 with the draws.
    assert!(same(
        step(0.1, "8xH100", "fused"),
        step(0.1, "8xH100", "flash2")
    ));
    assert!(step(0.0, "8xH100", "fused") < step(0.0, "8xH100", "flash2"));
    assert!(step(0.1, "8xH100", "flash2") > step(0.0, "8xH100", "flash2"));
    // The draws: two layers of one micro-batch, 8 heads × 4096² scores of
    // which FlashAttention-2's kernel pays for half under the causal mask
    // (`cost::region::attended_share`), at the H200's measured 0.040 +
    // 0.022 ms for 56,623,104 scores. The residual dropout's masks cost a
    // little beside them: on the A100, where no draw is measured, that is
    // all the dropout costs, and at the H100's memory bandwidth it takes
    // 2,039/3,350 of the A100's time.
    let draws = 2.0 * 8.0 * 4096.0 * 4096.0 * 0.5 * (0.040e-3 + 0.022e-3) / 56_623_104.0;
    let hopper = step(0.1, "8xH100", "flash2") - step(0.0, "8xH100", "flash2");
    let ampere = step(0.1, "8xA100", "flash2") - step(0.0, "8xA100", "flash2");
    let masks = ampere * 2039.0 / 3350.0;
    assert!(ampere > 0.0);
    assert!(
        ((hopper - masks) / draws - 1.0).abs() < 0.1,
        "{hopper} − {masks} vs {draws}"
    );
}

/// A pipelined plan prices the other schedule beside it: a source that
/// states no schedule (Megatron-Core's weak-scaling table) reads between
/// plain 1F1B and interleaving, and `explain` shows both ends.
#[test]
fn a_pipelined_plan_prices_the_other_schedule() {
    let one = plan(
        "megatron_gpt.dpl",
        "gpt_175b",
        "16x8xA100",
        "tp=8,pp=8,mb=1,schedule=1f1b",
        0,
    );
    let interleaved = what_if(&one, "schedule 1f1b → interleaved");
    assert!(
        interleaved < one.plan.estimate.step_time_s,
        "interleaving shrinks the bubble: {interleaved} against {}",
        one.plan.estimate.step_time_s
    );
    let v = plan(
        "megatron_gpt.dpl",
        "gpt_175b",
        "16x8xA100",
        "tp=8,pp=8,mb=1,schedule=interleaved,v=4",
        0,
    );
    let plain = what_if(&v, "schedule interleaved v=4 → 1f1b");
    assert!(
        plain > v.plan.estimate.step_time_s,
        "plain 1F1B pays the larger bubble: {plain} against {}",
        v.plan.estimate.step_time_s
    );
    // Unpipelined plans have no schedule to change.
    let flat = plan("megatron_gpt.dpl", "gpt_1_7b", "8xA100", "pp=1", 0);
    assert!(!flat
        .plan
        .what_if
        .iter()
        .any(|w| w.change.starts_with("schedule")));
}

/// A plan with Megatron's unfused loss prices the fused one beside it
/// (what `--cross-entropy-loss-fusion` buys); a fused plan has nothing to
/// gain there and shows no such line.
#[test]
fn an_unfused_loss_prices_the_fused_one() {
    let unfused = plan(
        "megatron_gpt.dpl",
        "mcore_gpt_1_7b",
        "8xH100",
        "tp=1,pp=1,mb=1,loss=unfused",
        0,
    );
    let fused = what_if(&unfused, "loss unfused → fused");
    assert!(
        fused < unfused.plan.estimate.step_time_s,
        "the fused loss is faster: {fused} against {}",
        unfused.plan.estimate.step_time_s
    );
    let default = plan(
        "megatron_gpt.dpl",
        "mcore_gpt_1_7b",
        "8xH100",
        "tp=1,pp=1,mb=1",
        0,
    );
    assert!(!default
        .plan
        .what_if
        .iter()
        .any(|w| w.change.starts_with("loss")));
}
