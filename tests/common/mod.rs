//! What the root's tests share: the tiny zoo, the optimizers their short
//! runs use, the per-step loss comparison, and running the `dplc` binary.

#![allow(dead_code)]

use dplc_ir::Optimizer;
use dplc_runtime::{RunConfig, StepStats};
use std::path::PathBuf;
use std::process::{Command, Output};

pub const TINY: &str = include_str!("../../models/tiny.dpl");
/// Two runs of the same function agree on each step's loss to this relative
/// tolerance (f32 sums in another association move it by a few ulps).
pub const LOSS_TOL: f64 = 1e-5;

/// The optimizer of a short tiny-model run.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Opt {
    AdamW,
    Sgd,
}

impl Opt {
    /// AdamW at lr 1e-2 (betas 0.9/0.95, weight decay 0.01), or SGD at lr 0.1
    /// with momentum 0.9: large steps, so five steps move every parameter.
    pub fn optimizer(self) -> Optimizer {
        match self {
            Opt::AdamW => Optimizer::AdamW {
                lr: 1e-2,
                beta1: 0.9,
                beta2: 0.95,
                eps: 1e-8,
                weight_decay: 0.01,
            },
            Opt::Sgd => Optimizer::Sgd {
                lr: 0.1,
                momentum: 0.9,
            },
        }
    }
}

/// Each step's loss of `b` within [`LOSS_TOL`] of `a`'s, step by step.
pub fn assert_losses(name: &str, a: &[StepStats], b: &[StepStats]) {
    for (x, y) in a.iter().zip(b) {
        let rel = ((x.loss - y.loss) / x.loss.abs()).abs();
        assert!(
            rel < LOSS_TOL,
            "{name}: step {} loss {} vs {}",
            x.step,
            x.loss,
            y.loss
        );
    }
}

/// `cfg` with the layout a plan of its split would carry (the planner's
/// Megatron layout) when a tensor- or expert-parallel degree needs one: the
/// runtime never derives a layout itself.
pub fn with_layout(graph: &dplc_ir::Graph, cfg: &RunConfig) -> RunConfig {
    let mut cfg = cfg.clone();
    if cfg.layout.is_none() && (cfg.tp > 1 || cfg.ep > 1) {
        cfg.layout = Some(
            dplc_planner::derive_layout(graph, cfg.tp as u64, cfg.ep as u64, cfg.sequence_parallel)
                .expect("the split has a Megatron layout"),
        );
    }
    cfg
}

/// Run the built `dplc` binary from the repository root, colours off.
pub fn dplc(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_dplc"))
        .args(args)
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .env("NO_COLOR", "1")
        .output()
        .expect("the dplc binary runs")
}

/// A model written to `file` in a scratch directory of its own (the
/// directory, to remove, and the file).
pub fn scratch_model(tag: &str, file: &str, text: &str) -> (PathBuf, PathBuf) {
    let dir = std::env::temp_dir().join(format!("dplc-{tag}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("a scratch directory");
    let src = dir.join(file);
    std::fs::write(&src, text).expect("the model is written");
    (dir, src)
}

/// A scratch directory, `dplc-{prefix}-{name}-{pid}` under the system's
/// temporary directory: emptied when made, removed when the test ends.
pub struct Scratch(pub PathBuf);

impl Scratch {
    pub fn new(prefix: &str, name: &str) -> Scratch {
        let dir = std::env::temp_dir().join(format!("dplc-{prefix}-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("a scratch directory");
        Scratch(dir)
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Compile each of `strategies` for `model` on 4 CPU ranks and verify the
/// plan on both computes.
/// Compile `model` of `src` on 4 CPU ranks under each of `strategies` (with
/// `extra` compile flags) and check that `dplc verify` passes the plan on
/// both computes.
pub fn verify_splits(src: &str, model: Option<&str>, strategies: &[&str], extra: &[&str]) {
    // One directory per source and model: tests run in parallel, and each
    // removes its own when done.
    let stem = std::path::Path::new(src)
        .file_stem()
        .map_or("model".into(), |s| s.to_string_lossy().into_owned());
    let dir = std::env::temp_dir().join(format!(
        "dplc-splits-{stem}-{}-{}",
        model.unwrap_or("model"),
        std::process::id()
    ));
    std::fs::create_dir_all(&dir).unwrap();
    for strategy in strategies {
        let plan = dir.join(format!("{strategy}.ron"));
        let mut args = vec!["compile", src, "--cluster", "4xcpu", "--strategy", strategy];
        if let Some(m) = model {
            args.extend(["--model", m]);
        }
        args.extend(extra);
        args.extend(["-o", plan.to_str().unwrap()]);
        let out = dplc(&args);
        assert!(out.status.success(), "{strategy}: {}", stderr(&out));
        for compute in ["reference", "fused"] {
            let out = dplc(&[
                "verify",
                plan.to_str().unwrap(),
                "--json",
                "--steps",
                "3",
                "--compute",
                compute,
            ]);
            assert!(
                out.status.success(),
                "{strategy} {compute}: {}",
                stderr(&out)
            );
            let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
            assert_eq!(v["pass"], true, "{strategy} {compute}: {v}");
        }
    }
    std::fs::remove_dir_all(&dir).ok();
}

/// The `dplc` process's standard error, as text.
pub fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

/// A small run: gpt_tiny at seq 16, four samples a step.
pub const SMALL: [&str; 8] = [
    "--model",
    "gpt_tiny",
    "--seq",
    "16",
    "--global-batch",
    "4",
    "--seed",
    "3",
];
