//! The tiny zoo models (`models/tiny.dpl`) train on CPU ranks, and data
//! parallel, ZeRO and pipeline runs reproduce the serial run: loss at each of
//! five steps within 1e-5 and every parameter after them within 5e-5
//! normwise relative. Splitting the batch reassociates f32 gradient sums (a
//! few ulps); Adam divides each gradient element by its own RMS, so an element
//! that is a near-cancellation passes its reassociation error through at full
//! size: measured up to 1.2e-5 on these models after five steps. A missing
//! gradient all-reduce moves parameters by ~1e-3 relative or more.
//!
//! The key bias of gpt_tiny's attention is left out: softmax ignores a shift
//! shared by all keys, so its true gradient is exactly zero and Adam turns the
//! rounding noise of that zero into ±lr steps; comparing it compares noise.

use dplc_runtime::{train, Compute, Corpus, RunConfig, Schedule, TrainReport, ZeroStage};

mod common;
use common::{assert_losses, with_layout, Opt, TINY};

const TOL: f32 = 5e-5;

fn lower(model: &str) -> (dplc_ir::Graph, dplc_ir::TrainSpec) {
    // A four-layer gpt_tiny lets interleaved pipelines give each chunk a layer.
    let text = format!(
        "{TINY}\nmodel gpt_tiny4 = gpt_tiny(layers = 4)\nmodel gpt_tiny8 = gpt_tiny(layers = 8)\nmodel gpt_tiny_dropout = gpt_tiny(dropout = 0.1)\n{STACKS}"
    );
    let unit = dplc_frontend::parse("tiny.dpl", &text).expect("tiny.dpl parses");
    let lowered = unit.lower(model).expect("the model lowers");
    (lowered.graph, lowered.train)
}

/// Models of two layer stacks: an encoder whose output every decoder layer
/// reads (so a value made between the stacks crosses pipeline cuts inside
/// the second), and dense layers before MoE layers.
const STACKS: &str = r#"
model encdec_tiny(vocab = 256, d = 64, heads = 4, enc = 3, dec = 3) {
    input tokens: i32[batch, seq]
    input targets: i32[batch, seq]
    param embed: [vocab, d]
    h = embedding(embed, tokens)
    repeat enc {
        h = h + attention(rms_norm(h, d, name = "n1"), d, heads, causal = false, rotary = true,
                          qkv_bias = false, out_bias = false)
        h = h + swiglu(rms_norm(h, d, name = "n2"), d, 128)
    }
    e = rms_norm(h, d, name = "enc_norm")
    x = embedding(embed, tokens)
    repeat dec {
        x = x + attention(rms_norm(x, d, name = "n3"), d, heads, rotary = true,
                          qkv_bias = false, out_bias = false)
        x = x + e * 0.5
        x = x + swiglu(rms_norm(x, d, name = "n4"), d, 128)
    }
    x = rms_norm(x, d, name = "norm")
    return cross_entropy(x @ transpose(embed), targets)
}
"#;

fn run(model: &str, cfg: RunConfig) -> TrainReport {
    run_with(model, cfg, Opt::AdamW)
}

/// Five steps of `model` at seq 16 under `cfg`, with the layout a plan of
/// that split would carry.
fn run_with(model: &str, cfg: RunConfig, opt: Opt) -> TrainReport {
    let (graph, mut spec) = lower(model);
    spec.seq = 16;
    spec.global_batch = cfg.global_batch() as u64;
    spec.optimizer = opt.optimizer();
    let data = Corpus::synthetic(5, 256, 1 << 14);
    let cfg = with_layout(&graph, &cfg);
    train(&graph, &spec, &cfg, &data, 5, 11, |_| {}).unwrap_or_else(|e| panic!("{model}: {e}"))
}

fn assert_same(name: &str, a: &TrainReport, b: &TrainReport) {
    assert_eq!(a.steps.len(), b.steps.len());
    assert_losses(name, &a.steps, &b.steps);
    let keep = |p: &dplc_runtime::Parameters| {
        let mut p = p.clone();
        p.values
            .retain(|_, (name, _)| !name.ends_with("attention.k.b"));
        p
    };
    let (d, at) = keep(&a.params).max_rel_diff(&keep(&b.params), 1e-3);
    assert!(d < TOL, "{name}: parameters differ by {d:e} at {at}");
}

fn serial(n: usize) -> RunConfig {
    RunConfig {
        micro_batch: 1,
        num_micro_batches: n,
        ..RunConfig::default()
    }
}

fn check_strategies(model: &str, pipeline: bool) {
    let base = run(model, serial(4));
    assert!(
        base.steps[4].loss < base.steps[0].loss,
        "{model}: loss falls: {:?}",
        base.steps
    );
    let dp2 = RunConfig {
        dp: 2,
        micro_batch: 1,
        num_micro_batches: 2,
        ..RunConfig::default()
    };
    assert_same(&format!("{model} dp2"), &base, &run(model, dp2));
    let z3 = RunConfig {
        dp: 4,
        micro_batch: 1,
        num_micro_batches: 1,
        zero: ZeroStage::Three,
        ..RunConfig::default()
    };
    assert_same(&format!("{model} zero3 dp4"), &base, &run(model, z3));
    if pipeline {
        let pp = RunConfig {
            pp: 2,
            micro_batch: 1,
            num_micro_batches: 4,
            schedule: Schedule::OneFOneB,
            ..RunConfig::default()
        };
        assert_same(&format!("{model} pp2 1f1b"), &base, &run(model, pp));
        let mixed = RunConfig {
            dp: 2,
            pp: 2,
            micro_batch: 1,
            num_micro_batches: 2,
            zero: ZeroStage::One,
            recompute: dplc_ir::Recompute::Full,
            ..RunConfig::default()
        };
        assert_same(
            &format!("{model} dp2 pp2 zero1 recompute"),
            &base,
            &run(model, mixed),
        );
    }
}

#[test]
fn gpt_tiny_strategies_match_serial() {
    check_strategies("gpt_tiny", true);
}

#[test]
fn gpt_tiny_interleaved_pipeline_matches_serial() {
    let base = run("gpt_tiny4", serial(4));
    let cfg = RunConfig {
        pp: 2,
        micro_batch: 1,
        num_micro_batches: 4,
        schedule: Schedule::Interleaved { chunks: 2 },
        ..RunConfig::default()
    };
    assert_same(
        "gpt_tiny4 pp2 interleaved v2",
        &base,
        &run("gpt_tiny4", cfg),
    );
}

#[test]
fn llama_tiny_strategies_match_serial() {
    check_strategies("llama_tiny", true);
}

#[test]
fn moe_tiny_strategies_match_serial() {
    check_strategies("moe_tiny", true);
}

// Tensor, sequence and expert parallelism, alone and combined with data,
// ZeRO, pipeline and recompute. Each strategy is checked twice against the
// serial run over the same global batch, seed and data:
//
// - with the model's AdamW, the loss at each of five steps within 1e-5;
// - with SGD (momentum 0.9), the loss within 1e-6 and every parameter within
//   1e-6 normwise relative. SGD's update is linear in the gradient, so a
//   parameter difference is a gradient difference: reassociating the sums
//   (partial matmuls all-reduced over tp, tokens regrouped by the all-to-all)
//   moves a gradient by a few ulps, measured at most 4e-7 here, while a
//   dropped or misplaced collective moves parameters by 1e-2 or more. AdamW
//   divides each element by its own RMS, which turns the rounding of a
//   gradient element that is nearly zero into a step of up to lr: measured up
//   to 8e-5 for tp2, which is why the parameter check does not use it.

const SGD_TOL: f64 = 1e-6;

fn run_sgd(model: &str, cfg: RunConfig) -> TrainReport {
    run_with(model, cfg, Opt::Sgd)
}

fn assert_close(name: &str, a: &TrainReport, b: &TrainReport) {
    assert_eq!(a.steps.len(), b.steps.len());
    for (x, y) in a.steps.iter().zip(&b.steps) {
        let rel = ((x.loss - y.loss) / x.loss.abs()).abs();
        assert!(
            rel < SGD_TOL,
            "{name} (sgd): step {} loss {} vs {}",
            x.step,
            x.loss,
            y.loss
        );
    }
    let (d, at) = a.params.max_rel_diff(&b.params, 1e-3);
    assert!(
        f64::from(d) < SGD_TOL,
        "{name} (sgd): parameters differ by {d:e} at {at}"
    );
}

/// `(name, config)` pairs for the split strategies; every one has a global
/// batch of 4 samples.
fn split_strategies(experts: bool) -> Vec<(&'static str, RunConfig)> {
    let c = |dp, tp, pp, nmb| RunConfig {
        dp,
        tp,
        pp,
        micro_batch: 1,
        num_micro_batches: nmb,
        ..RunConfig::default()
    };
    let mut out = vec![
        ("tp2", c(1, 2, 1, 4)),
        (
            "tp2 sp",
            RunConfig {
                sequence_parallel: true,
                ..c(1, 2, 1, 4)
            },
        ),
        (
            "dp2 tp2 pp2 zero1 recompute",
            RunConfig {
                zero: ZeroStage::One,
                recompute: dplc_ir::Recompute::Full,
                ..c(2, 2, 2, 2)
            },
        ),
        (
            "dp2 tp2 sp zero3",
            RunConfig {
                zero: ZeroStage::Three,
                sequence_parallel: true,
                ..c(2, 2, 1, 2)
            },
        ),
        (
            "tp2 sp pp2 gpipe",
            RunConfig {
                sequence_parallel: true,
                schedule: Schedule::GPipe,
                ..c(1, 2, 2, 4)
            },
        ),
    ];
    if experts {
        out.push((
            "dp2 ep2",
            RunConfig {
                ep: 2,
                ..c(2, 1, 1, 2)
            },
        ));
        out.push((
            "dp4 ep2 zero2",
            RunConfig {
                ep: 2,
                zero: ZeroStage::Two,
                ..c(4, 1, 1, 1)
            },
        ));
        out.push((
            "dp2 ep2 tp2",
            RunConfig {
                ep: 2,
                ..c(2, 2, 1, 2)
            },
        ));
        out.push((
            "dp2 ep2 pp2 1f1b recompute",
            RunConfig {
                ep: 2,
                recompute: dplc_ir::Recompute::Full,
                ..c(2, 1, 2, 2)
            },
        ));
    }
    out
}

fn check_split_strategies(model: &str) {
    let experts = model.starts_with("moe");
    let base = run(model, serial(4));
    let base_sgd = run_sgd(model, serial(4));
    for (name, cfg) in split_strategies(experts) {
        let name = format!("{model} {name}");
        assert_losses(&name, &base.steps, &run(model, cfg.clone()).steps);
        assert_close(&name, &base_sgd, &run_sgd(model, cfg));
    }
}

#[test]
fn gpt_tiny_tensor_and_sequence_parallel_match_serial() {
    check_split_strategies("gpt_tiny");
}

#[test]
fn llama_tiny_tensor_and_sequence_parallel_match_serial() {
    check_split_strategies("llama_tiny");
}

#[test]
fn moe_tiny_tensor_and_expert_parallel_match_serial() {
    check_split_strategies("moe_tiny");
}

#[test]
fn a_dropped_tensor_parallel_all_reduce_is_caught() {
    let base = run_sgd("gpt_tiny", serial(4));
    let faults = dplc_runtime::Faults {
        skip_tp_sum: true,
        ..Default::default()
    };
    let bad = run_sgd(
        "gpt_tiny",
        RunConfig {
            tp: 2,
            micro_batch: 1,
            num_micro_batches: 4,
            faults,
            ..RunConfig::default()
        },
    );
    let (d, at) = base.params.max_rel_diff(&bad.params, 1e-3);
    assert!(
        f64::from(d) > 100.0 * SGD_TOL,
        "the check must see a missing all-reduce: {d:e} at {at}"
    );
}

#[test]
fn gpt_tiny_pp4_interleaved_pipeline_matches_serial() {
    let cfg = RunConfig {
        pp: 4,
        micro_batch: 1,
        num_micro_batches: 4,
        schedule: Schedule::Interleaved { chunks: 2 },
        ..RunConfig::default()
    };
    let name = "gpt_tiny8 pp4 interleaved v2";
    assert_losses(
        name,
        &run("gpt_tiny8", serial(4)).steps,
        &run("gpt_tiny8", cfg.clone()).steps,
    );
    assert_close(
        name,
        &run_sgd("gpt_tiny8", serial(4)),
        &run_sgd("gpt_tiny8", cfg),
    );
}

/// The planner's own layouts, from the sharding e-graph, run on CPU ranks and
/// match the serial run: Megatron's split at tp 2 (with and without sequence
/// parallelism, under a pipeline), llama_tiny's grouped KV heads, and layouts
/// Megatron's rule cannot express — gpt_tiny at tp 8 keeps its 4 heads whole
/// on every rank and splits the MLP, llama_tiny at tp 4 replicates its 2 KV
/// heads.
#[test]
fn the_egraph_layouts_run_and_match_serial() {
    let cases = [
        ("gpt_tiny", 2, "tp=2,sp=off"),
        ("gpt_tiny", 2, "tp=2,sp=on"),
        ("gpt_tiny", 4, "tp=2,pp=2,sp=on,schedule=1f1b"),
        ("gpt_tiny", 8, "tp=8,sp=off"),
        ("llama_tiny", 2, "tp=2,sp=on"),
        ("llama_tiny", 4, "tp=4,sp=off"),
    ];
    for (model, ranks, strategy) in cases {
        let (graph, spec) = lower(model);
        let mut req = dplc_planner::PlanRequest::new(
            &graph,
            spec,
            dplc_planner::parse_cluster(&format!("{ranks}xcpu")).unwrap(),
        );
        let tp: u64 = strategy[3..4].parse().unwrap();
        req.global_batch = Some(4 * (ranks / tp));
        req.seq = Some(16);
        req.pinned = dplc_planner::parse_strategy(&format!("{strategy},mb=1")).unwrap();
        let plan = dplc_planner::compile(&req)
            .unwrap_or_else(|e| panic!("{model} {strategy}: {e}"))
            .plan;
        let layout = plan
            .layout
            .as_ref()
            .expect("a split plan carries its layout");
        // What runs is what the planner priced: the same parameters split on
        // the same dims, the root's (embedding, head) over the vocabulary.
        let mut ran: Vec<(String, usize)> = layout
            .params
            .iter()
            .map(|s| match s.split {
                dplc_ir::SplitAxis::Tensor { axis } => (graph.param(s.param).name.clone(), axis),
                dplc_ir::SplitAxis::Expert => panic!("no experts here"),
            })
            .collect();
        let mut priced: Vec<(String, usize)> = plan
            .param_sharding
            .iter()
            .flat_map(|p| p.splits.iter().map(|&(_, d)| (p.name.clone(), d)))
            .collect();
        ran.sort();
        priced.sort();
        assert_eq!(ran, priced, "{model} {strategy}");
        let beyond_megatron = tp == 8 || (model == "llama_tiny" && tp == 4);
        if beyond_megatron {
            assert!(
                dplc_planner::derive_layout(&graph, plan.mesh.tp, 1, false).is_err(),
                "{model} {strategy}: Megatron's rule has no such layout"
            );
        }
        let cfg = RunConfig::from_plan(&plan).unwrap();
        let name = format!("{model} {strategy} (e-graph layout)");
        let serial_cfg = serial(cfg.global_batch());
        assert_losses(
            &name,
            &run(model, serial_cfg.clone()).steps,
            &run(model, cfg.clone()).steps,
        );
        assert_close(&name, &run_sgd(model, serial_cfg), &run_sgd(model, cfg));
    }
}

/// The plan's stage partition is what runs: gpt_tiny's four layers on three
/// stages cannot split evenly, the planner balances them by time (the last
/// stage also runs the head and loss), and the run reports the layers each
/// stage ran forward — those of the plan — and matches the serial run. A plan
/// edited to another partition runs that one; one whose stages do not add up
/// to the model is refused before any rank starts.
#[test]
fn uneven_stages_run_as_planned() {
    let (graph, spec) = lower("gpt_tiny4");
    let mut req =
        dplc_planner::PlanRequest::new(&graph, spec, dplc_planner::parse_cluster("3xcpu").unwrap());
    req.global_batch = Some(3);
    req.seq = Some(16);
    req.pinned = dplc_planner::parse_strategy("pp=3,mb=1,schedule=1f1b").unwrap();
    let plan = dplc_planner::compile(&req).unwrap().plan;
    let planned = plan.stage_layers();
    assert_eq!(planned.iter().sum::<u64>(), 4);
    plan.check_against(&graph).unwrap();
    let base = run("gpt_tiny4", serial(3));
    let cfg = RunConfig::from_plan(&plan).unwrap();
    let got = run("gpt_tiny4", cfg.clone());
    assert_eq!(got.stage_layers, planned, "the run's stages are the plan's");
    assert_same("gpt_tiny4 pp3 (the planner's stages)", &base, &got);

    let mut edited = plan.clone();
    for (s, layers) in edited.stages.iter_mut().zip([2, 1, 1]) {
        s.layers = layers;
    }
    let mut cfg = RunConfig::from_plan(&edited).unwrap();
    let got = run("gpt_tiny4", cfg.clone());
    assert_eq!(got.stage_layers, vec![2, 1, 1]);
    assert_same("gpt_tiny4 pp3 stages [2, 1, 1]", &base, &got);

    edited.stages[0].layers = 1;
    let err = edited.check_against(&graph).unwrap_err().to_string();
    assert_eq!(
        err,
        "the plan does not fit the model: the stages hold 3 layers, the model has 4"
    );
    cfg.stage_layers = Some(edited.stage_layers());
    let (graph, mut spec) = lower("gpt_tiny4");
    spec.seq = 16;
    spec.global_batch = 3;
    let data = Corpus::synthetic(5, 256, 1 << 14);
    let err = train(&graph, &spec, &cfg, &data, 1, 11, |_| {}).unwrap_err();
    assert_eq!(
        err.to_string(),
        "invalid run configuration: the plan puts 3 layers on 3 stages ([1, 1, 1]); the run has 3 stages and the model 4 layers"
    );
}

/// Selective recomputation is selective: a layer keeps everything but its
/// core-attention tensors (those growing with the square of the sequence:
/// scores, softmax, its dropout), which are computed again before its
/// backward — the same ops on the same inputs under the same dropout keys,
/// so the run is bit for bit the run that keeps everything, serial and
/// tensor-parallel, while the ranks hold fewer activation bytes; full
/// recomputation holds fewer still.
#[test]
fn selective_recomputation_recomputes_only_the_attention_core() {
    use dplc_ir::Recompute;
    for (tp, sp) in [(1, false), (2, true)] {
        let runs: Vec<TrainReport> = [Recompute::None, Recompute::Selective, Recompute::Full]
            .into_iter()
            .map(|recompute| {
                run(
                    "gpt_tiny_dropout",
                    RunConfig {
                        tp,
                        sequence_parallel: sp,
                        micro_batch: 2,
                        num_micro_batches: 2,
                        recompute,
                        ..RunConfig::default()
                    },
                )
            })
            .collect();
        let [none, selective, full] = &runs[..] else {
            unreachable!("three runs")
        };
        let trace = |r: &TrainReport| -> Vec<(f64, f64)> {
            r.steps.iter().map(|s| (s.loss, s.grad_norm)).collect()
        };
        assert_eq!(
            trace(none),
            trace(selective),
            "tp{tp}: selective is the same run"
        );
        assert_eq!(none.params, selective.params, "tp{tp}");
        assert_same(&format!("tp{tp} full recompute"), none, full);
        let bytes = [none, selective, full].map(|r| r.peak_activation_bytes);
        eprintln!("tp{tp}: peak activation bytes none/selective/full {bytes:?}");
        assert!(
            bytes[0] > bytes[1] && bytes[1] > bytes[2],
            "tp{tp}: activation bytes none > selective > full: {bytes:?}"
        );
    }
}

/// Pipelines cut a model of several layer stacks anywhere: at the boundary
/// between them, inside either (the encoder's output, made between the
/// stacks, travels with the decoder's carried values), unevenly and
/// interleaved, with data and tensor parallelism — each the serial run
/// under SGD on both computes, parameters within 1e-6.
#[test]
fn pipelines_cut_layer_stacks_anywhere() {
    let base = run_with("encdec_tiny", serial(4), Opt::Sgd);
    let pp2 = RunConfig {
        pp: 2,
        micro_batch: 1,
        num_micro_batches: 4,
        ..RunConfig::default()
    };
    for (name, cfg) in [
        ("pp2 at the boundary", pp2.clone()),
        (
            "pp2 [1, 5] inside the encoder",
            RunConfig {
                stage_layers: Some(vec![1, 5]),
                ..pp2.clone()
            },
        ),
        (
            "pp2 [4, 2] inside the decoder",
            RunConfig {
                stage_layers: Some(vec![4, 2]),
                ..pp2.clone()
            },
        ),
        (
            "pp3",
            RunConfig {
                pp: 3,
                num_micro_batches: 3,
                ..serial(1)
            },
        ),
        (
            "pp2 interleaved v3",
            RunConfig {
                schedule: Schedule::Interleaved { chunks: 3 },
                ..pp2.clone()
            },
        ),
        (
            "pp2 interleaved v2 (chunks of 2 and 1 layers)",
            RunConfig {
                schedule: Schedule::Interleaved { chunks: 2 },
                ..pp2.clone()
            },
        ),
        (
            "pp2 GPipe",
            RunConfig {
                schedule: Schedule::GPipe,
                ..pp2.clone()
            },
        ),
        (
            "dp2 × pp2 ZeRO-1",
            RunConfig {
                dp: 2,
                num_micro_batches: 2,
                zero: ZeroStage::One,
                ..pp2.clone()
            },
        ),
        (
            "tp2 × pp2 sp",
            RunConfig {
                tp: 2,
                sequence_parallel: true,
                ..pp2.clone()
            },
        ),
    ] {
        let base = if cfg.num_micro_batches * cfg.dp == 4 {
            base.clone()
        } else {
            run_with(
                "encdec_tiny",
                serial(cfg.num_micro_batches * cfg.dp),
                Opt::Sgd,
            )
        };
        for compute in [Compute::Reference, Compute::Fused] {
            let name = format!("{name} ({})", compute.name());
            let got = run_with(
                "encdec_tiny",
                RunConfig {
                    compute,
                    ..cfg.clone()
                },
                Opt::Sgd,
            );
            assert_losses(&name, &base.steps, &got.steps);
            let (d, at) = base.params.max_rel_diff(&got.params, 1e-3);
            assert!(d < 1e-6, "{name}: parameters differ by {d:e} at {at}");
        }
    }
}
