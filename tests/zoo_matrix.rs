//! Every zoo model's tiny variant, planned by `dplc compile` under each of
//! the splits issue #16 names, verifies against the serial run with
//! `dplc verify` on both computes (losses within 1e-5, SGD parameters
//! within 1e-6): the plan runs as it was priced, for every model the zoo has.

use std::process::{Command, Output};

fn dplc(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_dplc"))
        .args(args)
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .env("NO_COLOR", "1")
        .output()
        .expect("the dplc binary runs")
}

/// The tiny variants: file, model, and the arguments that keep a run small.
const TINY: &[(&str, &str, &[&str])] = &[
    ("models/tiny.dpl", "gpt_tiny", &["--seq", "16"]),
    ("models/tiny.dpl", "llama_tiny", &["--seq", "16"]),
    ("models/tiny.dpl", "moe_tiny", &["--seq", "16"]),
    ("models/gemma.dpl", "gemma_tiny", &["--seq", "16"]),
    ("models/mistral.dpl", "mistral_tiny", &["--seq", "16"]),
    ("models/deepseek.dpl", "deepseek_tiny", &["--seq", "16"]),
    ("models/vit.dpl", "vit_tiny", &[]),
    ("models/t5.dpl", "t5_tiny", &[]),
];

fn verify_all(strategy: &str) {
    let dir = std::env::temp_dir().join(format!(
        "dplc-zoo-matrix-{}-{}",
        strategy.replace([',', '='], "_"),
        std::process::id()
    ));
    std::fs::create_dir_all(&dir).unwrap();
    let mut failures = Vec::new();
    for (file, model, extra) in TINY {
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
