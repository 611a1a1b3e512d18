//! Context parallelism on CPU ranks: every zoo model's tiny variant with a
//! sequence under cp2, cp2 × dp2, cp2 × tp2 (with and without sequence
//! parallelism), cp2 × dp2 × ep2 (the MoE models) and cp2 × pp2, on the
//! reference interpreter and the fused kernels, reproduces the reference's
//! serial run over the same global batch, seed and data — dropout masks
//! included (t5_tiny's, a gpt_tiny with dropout): the loss at each of five
//! steps within 1e-5 (relative) and, with SGD, every parameter within 1e-5
//! normwise relative.
//!
//! Each cp rank holds chunks `r` and `2·cp−1−r` of every sample (the causal
//! load balancing of Megatron-LM and torchtitan), so at seq 16 under cp2
//! rank 0 holds positions 0–3 and 12–15: the causal mask, rotary angles and
//! Mistral's window (8, crossing chunks) all see global positions, and K/V
//! are all-gathered back into position order. Splitting the sequence
//! reassociates the sums of the K/V gradients and of the replicas'
//! gradients (a few ulps), hence a tolerance and not bit equality.

use dplc_runtime::{train, Compute, Corpus, RunConfig, TrainReport};

mod common;
use common::{assert_losses, Opt, TINY};

const PARAM_TOL: f32 = 1e-5;

/// Every zoo model with a tiny variant that has a `seq` to split: its
/// source and its name.
const ZOO: &[(&str, &str)] = &[
    (TINY, "gpt_tiny"),
    (TINY, "llama_tiny"),
    (TINY, "moe_tiny"),
    (include_str!("../models/mistral.dpl"), "mistral_tiny"),
    (include_str!("../models/gemma.dpl"), "gemma_tiny"),
    (include_str!("../models/nemotron.dpl"), "nemotron_tiny"),
    (include_str!("../models/qwen3.dpl"), "qwen3_tiny"),
    (include_str!("../models/deepseek.dpl"), "deepseek_tiny"),
    (include_str!("../models/t5.dpl"), "t5_tiny"),
];

fn try_run(src: &str, model: &str, cfg: &RunConfig, opt: Opt) -> dplc_runtime::Result<TrainReport> {
    let unit = dplc_frontend::parse("zoo.dpl", src).expect("the zoo parses");
    let lowered = unit.lower(model).expect("the model lowers");
    let mut spec = lowered.train;
    spec.seq = 16;
    spec.global_batch = cfg.global_batch() as u64;
    spec.optimizer = opt.optimizer();
    // Token ids every input's table holds (T5's vocabulary is 64).
    let g = &lowered.graph;
    let vocab = g
        .inputs()
        .filter_map(|(_, i)| g.index_bound(i.tensor))
        .min()
        .unwrap_or(256);
    let data = Corpus::synthetic(5, vocab as usize, 1 << 14);
    // The tensor-parallel layout a plan of the split carries (of the model).
    let cfg = common::with_layout(&lowered.graph, cfg);
    train(&lowered.graph, &spec, &cfg, &data, 5, 11, |_| {})
}

fn run(src: &str, model: &str, cfg: &RunConfig, opt: Opt) -> TrainReport {
    try_run(src, model, cfg, opt).unwrap_or_else(|e| panic!("{model} {cfg:?}: {e}"))
}

fn serial() -> RunConfig {
    RunConfig {
        micro_batch: 1,
        num_micro_batches: 4,
        ..RunConfig::default()
    }
}

/// cp2 alone and cp2 × dp2, over the serial run's global batch of four.
fn splits(compute: Compute) -> Vec<(&'static str, RunConfig)> {
    vec![
        (
            "cp2",
            RunConfig {
                cp: 2,
                compute,
                ..serial()
            },
        ),
        (
            "cp2 dp2",
            RunConfig {
                cp: 2,
                dp: 2,
                num_micro_batches: 2,
                compute,
                ..serial()
            },
        ),
        (
            "cp2 tp2",
            RunConfig {
                cp: 2,
                tp: 2,
                compute,
                ..serial()
            },
        ),
        (
            "cp2 tp2 sp",
            RunConfig {
                cp: 2,
                tp: 2,
                sequence_parallel: true,
                compute,
                ..serial()
            },
        ),
        (
            "cp2 dp2 ep2",
            RunConfig {
                cp: 2,
                dp: 2,
                ep: 2,
                num_micro_batches: 2,
                compute,
                ..serial()
            },
        ),
        (
            "cp2 pp2 1f1b",
            RunConfig {
                cp: 2,
                pp: 2,
                compute,
                ..serial()
            },
        ),
    ]
}

fn check(compute: Compute) {
    for &(src, model) in ZOO {
        let base = run(src, model, &serial(), Opt::Sgd);
        // The comparison is not vacuous: every step has a gradient to
        // apply. (Not "the loss falls": with dropout drawn anew each step,
        // five SGD steps move T5's loss, at chance, ln 64, by less than the
        // draws' noise.)
        assert!(
            base.steps.iter().all(|s| s.grad_norm > 1e-2),
            "{model}: every step has a gradient: {:?}",
            base.steps
        );
        for (name, cfg) in splits(compute) {
            // Gemma's one KV head has no Megatron layout over tp 2.
            if cfg.tp > 1 && model == "gemma_tiny" {
                continue;
            }
            if cfg.ep > 1 && !matches!(model, "moe_tiny" | "deepseek_tiny") {
                continue;
            }
            let name = format!("{model} {name} ({})", compute.name());
            let got = run(src, model, &cfg, Opt::Sgd);
            assert_losses(&name, &base.steps, &got.steps);
            let (d, at) = base.params.max_rel_diff(&got.params, 1e-3);
            assert!(d < PARAM_TOL, "{name}: parameters differ by {d:e} at {at}");
        }
    }
}

#[test]
fn the_zoo_under_context_parallelism_matches_serial() {
    check(Compute::Reference);
}

#[test]
fn the_zoo_under_context_parallelism_matches_serial_on_fused_kernels() {
    check(Compute::Fused);
}

/// AdamW, the models' own optimizer kind, on the strategy with the most
/// reassociation: the losses of cp2 × dp2 with ZeRO-1 over the four replicas.
#[test]
fn context_parallel_replicas_share_zero_state() {
    for &(src, model) in &ZOO[..2] {
        let base = run(src, model, &serial(), Opt::AdamW);
        let cfg = RunConfig {
            cp: 2,
            dp: 2,
            num_micro_batches: 2,
            zero: dplc_runtime::ZeroStage::One,
            ..serial()
        };
        let got = run(src, model, &cfg, Opt::AdamW);
        assert_losses(&format!("{model} cp2 dp2 zero1"), &base.steps, &got.steps);
    }
}

/// Dropout under context parallelism draws each element's mask at its
/// global position (sample, and flat index in the whole tensor), as the
/// serial run keys it: the embedding's, the attention probabilities'
/// (`[batch, heads, q, k]`, the rank's queries against every key) and the
/// MLP's masks are the serial run's on both computes, with and without
/// sequence parallelism.
#[test]
fn dropout_under_context_parallelism_draws_the_serial_masks() {
    let src = format!("{TINY}\nmodel gpt_tiny_dropout = gpt_tiny(dropout = 0.1)\n");
    let model = "gpt_tiny_dropout";
    let base = run(&src, model, &serial(), Opt::Sgd);
    for compute in [Compute::Reference, Compute::Fused] {
        for (name, cfg) in splits(compute)
            .into_iter()
            .filter(|(n, _)| matches!(*n, "cp2 dp2" | "cp2 tp2 sp"))
        {
            let name = format!("{model} {name} ({})", compute.name());
            let got = run(&src, model, &cfg, Opt::Sgd);
            assert_losses(&name, &base.steps, &got.steps);
            let (d, at) = base.params.max_rel_diff(&got.params, 1e-3);
            assert!(d < PARAM_TOL, "{name}: parameters differ by {d:e} at {at}");
        }
    }
}

/// A value with two sequence axes read at the rank's positions along both:
/// scores made symmetric (`s + sᵀ`) hold the rank's queries along one axis
/// and, transposed, along the other; the transposed one is gathered and
/// sliced to the rank's positions along its other axis, its gradient
/// reduce-scattered back. Both computes reproduce the serial run.
#[test]
fn a_value_read_along_two_sequence_axes_is_gathered_then_sliced() {
    let src = "model sym(vocab = 256, d = 64, layers = 2) {\n\
               input tokens: i32[batch, seq]\n\
               input targets: i32[batch, seq]\n\
               param embed: [vocab, d]\n\
               h = embedding(embed, tokens)\n\
               repeat layers {\n\
                   x = rms_norm(h, d, name = \"n1\")\n\
                   param wq: [d, d]\n\
                   param wk: [d, d]\n\
                   s = (x @ wq) @ transpose(x @ wk, 1, 2) * 0.125\n\
                   h = h + softmax(s + transpose(s, 1, 2), -1) @ x\n\
               }\n\
               param output: [d, vocab]\n\
               return cross_entropy(rms_norm(h, d, name = \"n\") @ output, targets)\n\
               }\n";
    let base = run(src, "sym", &serial(), Opt::Sgd);
    for compute in [Compute::Reference, Compute::Fused] {
        for (name, cfg) in splits(compute)
            .into_iter()
            .filter(|(n, _)| matches!(*n, "cp2" | "cp2 dp2"))
        {
            let name = format!("sym {name} ({})", compute.name());
            let got = run(src, "sym", &cfg, Opt::Sgd);
            assert_losses(&name, &base.steps, &got.steps);
            let (d, at) = base.params.max_rel_diff(&got.params, 1e-3);
            assert!(d < PARAM_TOL, "{name}: parameters differ by {d:e} at {at}");
        }
    }
}

/// The comparison sees the K/V gradients' reduce-scatter: with each rank
/// keeping its own summand of its chunks' gradient (the sum left out), the
/// parameters leave the serial run's far beyond the tolerance.
#[test]
fn a_dropped_kv_gradient_sum_is_caught() {
    let base = run(TINY, "llama_tiny", &serial(), Opt::Sgd);
    let cfg = RunConfig {
        cp: 2,
        faults: dplc_runtime::Faults {
            skip_tp_sum: true,
            ..Default::default()
        },
        ..serial()
    };
    let got = run(TINY, "llama_tiny", &cfg, Opt::Sgd);
    let (d, at) = base.params.max_rel_diff(&got.params, 1e-3);
    assert!(d > 100.0 * PARAM_TOL, "only {d:e} at {at}");
}

/// What context parallelism does not run says so before any rank starts.
#[test]
fn context_parallelism_refuses_what_it_cannot_split() {
    let err = |src: &str, model: &str, cfg: RunConfig| {
        try_run(src, model, &cfg, Opt::Sgd)
            .err()
            .unwrap_or_else(|| panic!("{model} {cfg:?} runs"))
            .to_string()
    };
    // The sequence is cut into 2·cp chunks.
    let e = err(TINY, "gpt_tiny", RunConfig { cp: 3, ..serial() });
    assert!(e.contains("2·cp = 6") && e.contains("seq 16"), "{e}");
    // A model without a sequence.
    let vit = include_str!("../models/vit.dpl");
    let e = err(vit, "vit_tiny", RunConfig { cp: 2, ..serial() });
    assert!(e.contains("no `seq` dimension"), "{e}");
}
