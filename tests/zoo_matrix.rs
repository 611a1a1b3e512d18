//! Every zoo model's tiny variant, planned by `dplc compile` under each of
//! the splits issue #16 names, verifies against the serial run with
//! `dplc verify` on both computes (losses within 1e-5, SGD parameters
//! within 1e-6): the plan runs as it was priced, for every model the zoo has.

mod common;
use common::dplc;

/// The tiny variants: file, model, and the arguments that keep a run small.
const TINY: &[(&str, &str, &[&str])] = &[
    ("models/tiny.dpl", "gpt_tiny", &["--seq", "16"]),
    ("models/tiny.dpl", "llama_tiny", &["--seq", "16"]),
    ("models/tiny.dpl", "moe_tiny", &["--seq", "16"]),
    ("models/gemma.dpl", "gemma_tiny", &["--seq", "16"]),
    ("models/mistral.dpl", "mistral_tiny", &["--seq", "16"]),
    ("models/deepseek.dpl", "deepseek_tiny", &["--seq", "16"]),
    ("models/nemotron.dpl", "nemotron_tiny", &["--seq", "16"]),
    ("models/qwen3.dpl", "qwen3_tiny", &["--seq", "16"]),
    ("models/vit.dpl", "vit_tiny", &[]),
    ("models/t5.dpl", "t5_tiny", &[]),
];

fn verify_all(strategy: &str) {
    verify(TINY, strategy);
}

fn verify(models: &[(&str, &str, &[&str])], strategy: &str) {
    let dir = std::env::temp_dir().join(format!(
        "dplc-zoo-matrix-{}-{}",
        strategy.replace([',', '='], "_"),
        std::process::id()
    ));
    std::fs::create_dir_all(&dir).unwrap();
    let mut failures = Vec::new();
    for (file, model, extra) in models {
        let plan = dir.join(format!("{model}.ron"));
        let mut args = vec![
            "compile",
            file,
            "--model",
            model,
            "--cluster",
            "4xcpu",
            "--strategy",
            strategy,
            "--global-batch",
            "8",
        ];
        args.extend(extra.iter());
        args.extend(["-o", plan.to_str().unwrap()]);
        let out = dplc(&args);
        if !out.status.success() {
            failures.push(format!(
                "{model} {strategy}: compile: {}",
                String::from_utf8_lossy(&out.stderr)
            ));
            continue;
        }
        for compute in ["reference", "fused"] {
            let out = dplc(&[
                "verify",
                plan.to_str().unwrap(),
                "--json",
                "--steps",
                "2",
                "--compute",
                compute,
            ]);
            let v: serde_json::Value =
                serde_json::from_slice(&out.stdout).unwrap_or(serde_json::Value::Null);
            if !out.status.success() || v["pass"] != true {
                failures.push(format!(
                    "{model} {strategy} {compute}: {} {v}",
                    String::from_utf8_lossy(&out.stderr)
                ));
            }
        }
    }
    std::fs::remove_dir_all(&dir).ok();
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

#[test]
fn every_tiny_model_verifies_under_dp_and_pp() {
    verify_all("dp=2,pp=2");
}

#[test]
fn every_tiny_model_verifies_under_tp_and_dp() {
    verify_all("tp=2,dp=2");
}

#[test]
fn every_tiny_model_verifies_under_tp_without_sequence_parallelism() {
    verify_all("tp=2,dp=2,sp=off");
}

/// The tiny variants with a sequence to split (all but vit_tiny).
fn with_a_sequence() -> Vec<(&'static str, &'static str, &'static [&'static str])> {
    TINY.iter()
        .copied()
        .filter(|(_, m, _)| *m != "vit_tiny")
        .collect()
}

/// Context parallelism splits the sequence: every tiny model that has one
/// verifies under cp2 × dp2, T5 with its dropout and its relative position
/// bias over queries and keys included; vit_tiny, which has none, is
/// refused by the planner with the reason.
#[test]
fn every_tiny_model_with_a_sequence_verifies_under_cp_and_dp() {
    verify(&with_a_sequence(), "cp=2,dp=2");
    let out = dplc(&[
        "compile",
        "models/vit.dpl",
        "--model",
        "vit_tiny",
        "--cluster",
        "4xcpu",
        "--strategy",
        "cp=2,dp=2",
    ]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && err.contains("`seq` dimension"),
        "vit_tiny: {err}"
    );
}

/// cp2 × tp2 with sequence parallelism on: every cp rank splits its own
/// positions over tp as well.
#[test]
fn every_tiny_model_with_a_sequence_verifies_under_cp_and_tp() {
    verify(&with_a_sequence(), "cp=2,tp=2,sp=on");
}

/// cp2 with expert parallelism over the data-parallel replicas: the MoE
/// models route the gathered sequence to experts on other ranks.
#[test]
fn the_moe_models_verify_under_cp_and_ep() {
    let moe: Vec<_> = TINY
        .iter()
        .copied()
        .filter(|(_, m, _)| matches!(*m, "moe_tiny" | "deepseek_tiny"))
        .collect();
    verify(&moe, "cp=2,dp=2,ep=2");
}
