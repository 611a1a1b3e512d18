//! The equivalence matrix with `--compute fused`: one schedule executor runs
//! every strategy, its stages computed by codegen's fused kernels (the GPU's
//! kernels, interpreted on the CPU by `HostBackend`) instead of the reference
//! interpreter, and each run reproduces the reference's serial run over the
//! same global batch, seed and data.
//!
//! Tolerances are `runtime_zoo.rs`'s: with SGD (momentum 0.9) the loss at
//! each of five steps within 1e-5 and every parameter within 1e-6 normwise
//! relative; with AdamW (on the strategies that split its state) the loss
//! within 1e-5 and the gradient norm within 1e-4 (Adam turns the rounding of a near-zero gradient element into a step
//! of up to lr, so its parameters are not compared). With dropout 0.1 the
//! fused kernels draw the reference's masks, so the same tolerances hold.

use dplc_runtime::{train, Compute, Corpus, RunConfig, Schedule, TrainReport, ZeroStage};

mod common;
use common::{assert_losses, Opt, TINY};

const SGD_TOL: f32 = 1e-6;
const NORM_TOL: f64 = 1e-4;

/// Four-layer zoo models (so an interleaved pipeline of two stages gives
/// each chunk a layer), with and without dropout 0.1.
const MODELS: &str = r#"
model gpt_tiny4 = gpt_tiny(layers = 4)
model llama_tiny4 = llama_tiny(layers = 4)
model gpt_tiny4_dropout = gpt_tiny(layers = 4, dropout = 0.1)
model moe_tiny4 = moe_tiny(layers = 4)

// Two layer stacks of different widths, dense layers before MoE layers (as
// DeepSeek's first layers are dense): the layers number one after the other.
model stacks_tiny(vocab = 256, ctx = 64, d = 64, heads = 4, dense = 2, sparse = 2) {
    input tokens: i32[batch, seq]
    input targets: i32[batch, seq]
    param embed: [vocab, d]
    h = embedding(embed, tokens)
    repeat dense {
        h = h + attention(rms_norm(h, d, name = "attention_norm"), d, heads, rotary = true,
                          qkv_bias = false, out_bias = false)
        h = h + swiglu(rms_norm(h, d, name = "ffn_norm"), d, 128)
    }
    repeat sparse {
        h = h + attention(rms_norm(h, d, name = "attention_norm"), d, heads, rotary = true,
                          qkv_bias = false, out_bias = false)
        h = h + moe(rms_norm(h, d, name = "ffn_norm"), d, 64, 4, 2)
    }
    h = rms_norm(h, d, name = "norm")
    param output: [d, vocab]
    return cross_entropy(h @ output, targets)
}
"#;

fn lower(model: &str) -> (dplc_ir::Graph, dplc_ir::TrainSpec) {
    let text = format!("{TINY}\n{MODELS}");
    let unit = dplc_frontend::parse("tiny.dpl", &text).expect("the models parse");
    let lowered = unit.lower(model).expect("the model lowers");
    (lowered.graph, lowered.train)
}

fn try_run(model: &str, cfg: &RunConfig, opt: Opt) -> dplc_runtime::Result<TrainReport> {
    let (graph, mut spec) = lower(model);
    spec.seq = 16;
    spec.global_batch = cfg.global_batch() as u64;
    spec.optimizer = opt.optimizer();
    let data = Corpus::synthetic(5, 256, 1 << 14);
    let cfg = common::with_layout(&graph, cfg);
    train(&graph, &spec, &cfg, &data, 5, 11, |_| {})
}

fn run(model: &str, cfg: &RunConfig, opt: Opt) -> TrainReport {
    try_run(model, cfg, opt).unwrap_or_else(|e| panic!("{model} {cfg:?}: {e}"))
}

fn fused(cfg: RunConfig) -> RunConfig {
    RunConfig {
        compute: Compute::Fused,
        ..cfg
    }
}

/// Every strategy the fused compute runs, over a global batch of four;
/// expert parallelism too where the model has `experts`.
fn strategies(experts: bool) -> Vec<(&'static str, RunConfig)> {
    let base = RunConfig {
        micro_batch: 1,
        num_micro_batches: 4,
        ..RunConfig::default()
    };
    let dp2 = RunConfig {
        dp: 2,
        num_micro_batches: 2,
        ..base.clone()
    };
    let pp2 = RunConfig {
        pp: 2,
        ..base.clone()
    };
    let mut out = vec![
        ("serial, 4 micro-batches", base.clone()),
        (
            "micro-batch 2",
            RunConfig {
                micro_batch: 2,
                num_micro_batches: 2,
                ..base.clone()
            },
        ),
        ("dp2", dp2.clone()),
        (
            "dp2 ZeRO-1",
            RunConfig {
                zero: ZeroStage::One,
                ..dp2.clone()
            },
        ),
        (
            "dp2 ZeRO-2",
            RunConfig {
                zero: ZeroStage::Two,
                ..dp2.clone()
            },
        ),
        (
            "dp4 ZeRO-3",
            RunConfig {
                dp: 4,
                num_micro_batches: 1,
                zero: ZeroStage::Three,
                ..base.clone()
            },
        ),
        (
            "pp2 GPipe",
            RunConfig {
                schedule: Schedule::GPipe,
                ..pp2.clone()
            },
        ),
        ("pp2 1F1B", pp2.clone()),
        (
            "pp2 interleaved v2",
            RunConfig {
                schedule: Schedule::Interleaved { chunks: 2 },
                ..pp2.clone()
            },
        ),
        (
            "pp2 uneven [3, 1]",
            RunConfig {
                stage_layers: Some(vec![3, 1]),
                ..pp2.clone()
            },
        ),
        (
            "dp2 × pp2 ZeRO-1 full recompute",
            RunConfig {
                dp: 2,
                pp: 2,
                num_micro_batches: 2,
                zero: ZeroStage::One,
                recompute: dplc_ir::Recompute::Full,
                ..base.clone()
            },
        ),
        (
            "selective recompute",
            RunConfig {
                recompute: dplc_ir::Recompute::Selective,
                ..base.clone()
            },
        ),
        (
            "tp2",
            RunConfig {
                tp: 2,
                ..base.clone()
            },
        ),
        (
            "tp2 + sequence parallel",
            RunConfig {
                tp: 2,
                sequence_parallel: true,
                ..base.clone()
            },
        ),
        (
            "dp2 × tp2 × pp2 ZeRO-1 sp",
            RunConfig {
                dp: 2,
                tp: 2,
                pp: 2,
                num_micro_batches: 2,
                zero: ZeroStage::One,
                sequence_parallel: true,
                ..base.clone()
            },
        ),
    ];
    if experts {
        out.extend([
            (
                "dp2 ep2",
                RunConfig {
                    ep: 2,
                    ..dp2.clone()
                },
            ),
            (
                "dp2 × ep2 × tp2",
                RunConfig {
                    ep: 2,
                    tp: 2,
                    ..dp2.clone()
                },
            ),
            (
                "dp2 × ep2 × pp2 ZeRO-2 full recompute",
                RunConfig {
                    dp: 2,
                    ep: 2,
                    pp: 2,
                    num_micro_batches: 2,
                    zero: ZeroStage::Two,
                    recompute: dplc_ir::Recompute::Full,
                    ..base
                },
            ),
        ]);
    }
    out
}

/// The strategies also run with AdamW (loss and gradient norm compared).
const ADAM_TOO: [&str; 3] = [
    "serial, 4 micro-batches",
    "dp2 ZeRO-2",
    "dp2 × pp2 ZeRO-1 full recompute",
];

fn check_matrix(model: &str) {
    // The serial reference over micro-batches of the strategy's size: an MoE
    // layer's expert capacity counts the tokens of a micro-batch, so routing
    // (which tokens overflow) is a function of that size.
    let mut serial = std::collections::HashMap::new();
    for (strategy, cfg) in strategies(model.starts_with("moe")) {
        let (base_sgd, base_adam) = serial.entry(cfg.micro_batch).or_insert_with(|| {
            let cfg = RunConfig {
                micro_batch: cfg.micro_batch,
                num_micro_batches: 4 / cfg.micro_batch,
                ..RunConfig::default()
            };
            (run(model, &cfg, Opt::Sgd), run(model, &cfg, Opt::AdamW))
        });
        let name = format!("{model} {strategy} (fused)");
        let sgd = run(model, &fused(cfg.clone()), Opt::Sgd);
        assert_losses(&name, &base_sgd.steps, &sgd.steps);
        let (d, at) = base_sgd.params.max_rel_diff(&sgd.params, 1e-3);
        assert!(
            d < SGD_TOL,
            "{name}: SGD parameters differ by {d:e} at {at}"
        );
        // The optimizer is the executor's whatever computes, so the model's
        // AdamW runs where its state is split differently.
        if !ADAM_TOO.contains(&strategy) {
            continue;
        }
        let adam = run(model, &fused(cfg), Opt::AdamW);
        assert_losses(&name, &base_adam.steps, &adam.steps);
        for (x, y) in base_adam.steps.iter().zip(&adam.steps) {
            let rel = ((x.grad_norm - y.grad_norm) / x.grad_norm).abs();
            assert!(
                rel < NORM_TOL,
                "{name}: step {} gradient norm {} vs {}",
                x.step,
                x.grad_norm,
                y.grad_norm
            );
        }
    }
}

#[test]
fn gpt_tiny_fused_strategies_match_the_serial_reference() {
    check_matrix("gpt_tiny4");
}

#[test]
fn llama_tiny_fused_strategies_match_the_serial_reference() {
    check_matrix("llama_tiny4");
}

#[test]
fn moe_tiny_fused_strategies_match_the_serial_reference() {
    check_matrix("moe_tiny4");
}

#[test]
fn gpt_tiny_with_dropout_fused_strategies_match_the_serial_reference() {
    check_matrix("gpt_tiny4_dropout");
}

/// A root split over the vocabulary as the planner prices it (`root=vocab`:
/// the embedding, the head and the loss over each rank's slice, the group
/// exchanging picks and each row's statistics) runs on the fused compute's
/// device path — the slices by kernels, a few bytes a row through the host
/// — and trains the serial run's function, with and without sequence
/// parallelism.
#[test]
fn the_vocabulary_split_root_matches_the_serial_reference() {
    for model in ["gpt_tiny4", "llama_tiny4"] {
        let (graph, mut spec) = lower(model);
        spec.seq = 16;
        spec.global_batch = 4;
        let serial = run(
            model,
            &RunConfig {
                micro_batch: 1,
                num_micro_batches: 4,
                ..RunConfig::default()
            },
            Opt::Sgd,
        );
        for sp in [false, true] {
            let mut req = dplc_planner::PlanRequest::new(
                &graph,
                spec.clone(),
                dplc_planner::parse_cluster("2xcpu").unwrap(),
            );
            req.pinned = dplc_planner::parse_strategy(&format!("tp=2,sp={sp},root=vocab")).unwrap();
            let plan = dplc_planner::compile(&req).unwrap().plan;
            assert_eq!(plan.strategy.root, dplc_ir::RootSplit::Vocab);
            let cfg = RunConfig {
                tp: 2,
                sequence_parallel: sp,
                micro_batch: 1,
                num_micro_batches: 4,
                layout: plan.layout,
                ..RunConfig::default()
            };
            let name = format!("{model} tp2 sp={sp} root=vocab (fused)");
            let split = run(model, &fused(cfg), Opt::Sgd);
            assert_losses(&name, &serial.steps, &split.steps);
            let (d, at) = serial.params.max_rel_diff(&split.params, 1e-3);
            assert!(
                d < SGD_TOL,
                "{name}: SGD parameters differ by {d:e} at {at}"
            );
        }
    }
}

/// The plan's uneven stages run as planned on the fused compute too: the
/// layers each stage ran come back from the run.
#[test]
fn fused_uneven_stages_run_as_planned() {
    let cfg = fused(RunConfig {
        pp: 2,
        num_micro_batches: 4,
        stage_layers: Some(vec![3, 1]),
        ..RunConfig::default()
    });
    assert_eq!(run("gpt_tiny4", &cfg, Opt::Sgd).stage_layers, vec![3, 1]);
}

/// Recomputation on the fused compute: the same kernels on the same inputs
/// with the same masks, so the same run bit for bit, holding less at peak —
/// full keeps only each layer's inputs; selective drops the core-attention
/// values of unfused attention, and fused attention has none to drop.
#[test]
fn fused_recomputation_is_the_same_run_in_less_memory() {
    let at_some = |recompute, recompute_layers, attention| {
        run(
            "gpt_tiny4_dropout",
            &fused(RunConfig {
                num_micro_batches: 4,
                recompute,
                recompute_layers,
                attention,
                ..RunConfig::default()
            }),
            Opt::AdamW,
        )
    };
    let at = |recompute, attention| at_some(recompute, 0, attention);
    let same = |a: &TrainReport, b: &TrainReport| {
        for (x, y) in a.steps.iter().zip(&b.steps) {
            assert_eq!(x.loss.to_bits(), y.loss.to_bits(), "step {} loss", x.step);
            assert_eq!(x.grad_norm.to_bits(), y.grad_norm.to_bits());
        }
        assert_eq!(a.params, b.params);
    };
    use dplc_ir::{AttentionKind, Recompute};
    // Fused attention keeps no score matrix: selective recomputation has
    // nothing to drop, full drops all but each layer's inputs.
    let kept = at(Recompute::None, AttentionKind::Fused);
    let selective = at(Recompute::Selective, AttentionKind::Fused);
    let full = at(Recompute::Full, AttentionKind::Fused);
    // Partial: the first two of the four layers rerun, the others keep all.
    let half = at_some(Recompute::Full, 2, AttentionKind::Fused);
    same(&kept, &selective);
    same(&kept, &full);
    same(&kept, &half);
    let (k, s, f, h) = (
        kept.peak_activation_bytes,
        selective.peak_activation_bytes,
        full.peak_activation_bytes,
        half.peak_activation_bytes,
    );
    assert!(
        f < h && h < k && s == k,
        "fused attention, activation bytes: kept {k}, selective {s}, full {f}, first two of four {h}"
    );
    // Op by op, selective drops the core-attention values.
    let kept = at(Recompute::None, AttentionKind::Unfused);
    let selective = at(Recompute::Selective, AttentionKind::Unfused);
    same(&kept, &selective);
    let (k, s) = (kept.peak_activation_bytes, selective.peak_activation_bytes);
    assert!(
        s < k,
        "unfused attention, activation bytes: kept {k}, selective {s}"
    );
}

/// What the fused compute cannot run yet (a `repeat` inside a layer) is
/// refused before a rank starts, with the way out.
#[test]
fn fused_refuses_what_it_cannot_run_with_a_reason() {
    let text = r#"
model nested(vocab = 256, d = 32) {
    input tokens: i32[batch, seq]
    input targets: i32[batch, seq]
    param embed: [vocab, d]
    h = embedding(embed, tokens)
    repeat 2 {
        repeat 2 {
            h = h + mlp(layer_norm(h, d, name = "ln"), d, 2 * d)
        }
    }
    return cross_entropy(h @ transpose(embed), targets)
}
"#;
    let unit = dplc_frontend::parse("nested.dpl", text).expect("the model parses");
    let lowered = unit.lower("nested").expect("the model lowers");
    let spec = dplc_ir::TrainSpec {
        seq: 16,
        global_batch: 4,
        ..lowered.train
    };
    let cfg = fused(RunConfig {
        num_micro_batches: 4,
        ..RunConfig::default()
    });
    let data = Corpus::synthetic(5, 256, 1 << 14);
    let err = train(&lowered.graph, &spec, &cfg, &data, 1, 11, |_| {})
        .unwrap_err()
        .to_string();
    assert!(err.contains("one level of `repeat`"), "{err}");
    assert!(err.contains("--compute reference"), "{err}");
}

/// One activation model: the activations the fused compute holds at its
/// peak (every live value, measured after each forward) are what the
/// planner prices for the same configuration — one rule,
/// `dplc_ir::saved_values`, read by both — on gpt_tiny, llama_tiny and
/// moe_tiny (4 layers, seq 64, f32) at micro-batches 1, 4 and 16, with
/// fused attention (no score matrix kept: the output and the log-sum-exp)
/// and no recomputation, and at micro-batch 4 with the first two layers
/// recomputed (each keeps its input) and the other two whole.
#[test]
fn the_fused_computes_activations_are_the_plans() {
    let text = format!(
        "{TINY}\nmodel gpt4 = gpt_tiny(layers = 4)\nmodel llama4 = llama_tiny(layers = 4)\n\
         model moe4 = moe_tiny(layers = 4)\n"
    );
    let unit = dplc_frontend::parse("tiny.dpl", &text).expect("parses");
    let mut worst: f64 = 0.0;
    for model in ["gpt4", "llama4", "moe4"] {
        let lowered = unit.lower(model).expect("lowers");
        let (graph, mut spec) = (lowered.graph, lowered.train);
        for (mb, recompute) in [
            (1usize, "recompute=none"),
            (4, "recompute=none"),
            (16, "recompute=none"),
            (4, "recompute_layers=2"),
        ] {
            spec.seq = 64;
            spec.global_batch = mb as u64;
            spec.precision = dplc_ir::Precision::Fp32;
            let mut req = dplc_planner::PlanRequest::new(
                &graph,
                spec.clone(),
                dplc_planner::parse_cluster("1xH100").unwrap(),
            );
            req.pinned = dplc_planner::parse_strategy(&format!(
                "mb={mb},{recompute},attention=fused,tp_overlap=none"
            ))
            .unwrap();
            let plan = dplc_planner::compile(&req).unwrap().plan;
            let m = &plan.stages[0].memory;
            let planned = (m.activations + m.embedding_and_loss) as f64;
            let cfg = fused(RunConfig {
                micro_batch: mb,
                recompute: plan.strategy.recompute,
                recompute_layers: plan.strategy.recompute_layers,
                ..RunConfig::default()
            });
            let data = Corpus::synthetic(5, 256, 1 << 14);
            let report = train(&graph, &spec, &cfg, &data, 1, 11, |_| {}).unwrap();
            let held = report.peak_activation_bytes as f64;
            let ratio = held / planned;
            eprintln!(
                "{model} mb {mb} {recompute}: the fused compute holds {:.3} MiB of activations, \
                 {ratio:.4}× the plan's {:.3} MiB",
                held / (1u64 << 20) as f64,
                planned / (1u64 << 20) as f64
            );
            worst = worst.max((ratio - 1.0).abs());
        }
    }
    assert!(worst <= 0.10, "worst |ratio − 1| {worst:.4}");
}

/// Several layer stacks train whole on every rank (no pipeline cuts between
/// them yet): data, ZeRO-3, tensor (+ sequence) and expert parallelism and
/// recomputation reproduce the serial run on both computes, parameters of
/// both stacks included.
#[test]
fn two_layer_stacks_match_the_serial_reference() {
    let base = RunConfig {
        micro_batch: 1,
        num_micro_batches: 4,
        ..RunConfig::default()
    };
    let dp2 = RunConfig {
        dp: 2,
        num_micro_batches: 2,
        ..base.clone()
    };
    let serial = run("stacks_tiny", &base, Opt::Sgd);
    let names: Vec<&str> = serial
        .params
        .values
        .values()
        .map(|(n, _)| n.as_str())
        .collect();
    assert!(
        names.iter().any(|n| n.contains("swiglu")) && names.iter().any(|n| n.contains("moe")),
        "both stacks' parameters are trained: {names:?}"
    );
    for (name, cfg) in [
        (
            "dp2 ZeRO-3",
            RunConfig {
                zero: ZeroStage::Three,
                ..dp2.clone()
            },
        ),
        (
            "dp2 × tp2 sp",
            RunConfig {
                tp: 2,
                sequence_parallel: true,
                ..dp2.clone()
            },
        ),
        (
            "dp2 × ep2",
            RunConfig {
                ep: 2,
                ..dp2.clone()
            },
        ),
        (
            "full recompute",
            RunConfig {
                recompute: dplc_ir::Recompute::Full,
                ..base.clone()
            },
        ),
    ] {
        for compute in [Compute::Reference, Compute::Fused] {
            let name = format!("stacks_tiny {name} ({})", compute.name());
            let got = run(
                "stacks_tiny",
                &RunConfig {
                    compute,
                    ..cfg.clone()
                },
                Opt::Sgd,
            );
            assert_losses(&name, &serial.steps, &got.steps);
            let (d, at) = serial.params.max_rel_diff(&got.params, 1e-3);
            assert!(
                d < SGD_TOL,
                "{name}: SGD parameters differ by {d:e} at {at}"
            );
        }
    }
}
