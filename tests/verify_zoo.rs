//! `dplc verify` of the zoo's models end to end: the planner's own plans
//! and pinned splits of each architecture checked against the serial run on
//! both computes (the reference interpreter and the fused kernels). Apart
//! from `run_cli.rs` so each test binary stays well under a minute.

mod common;
use common::{dplc, stderr, verify_splits, SMALL};

/// `--compute fused`: the planner's own plans of gpt_tiny and llama_tiny on
/// 2, 4 and 8 CPU ranks verify with the fused kernels computing the split
/// run; `dplc run --compute fused` trains with a falling loss; a split the
/// fused kernels cannot run yet is refused with the way out, exit non-zero.
#[test]
fn the_fused_compute_verifies_the_planners_plans() {
    let dir = std::env::temp_dir().join(format!("dplc-fused-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    for model in ["gpt_tiny", "llama_tiny", "moe_tiny"] {
        for ranks in [2, 4, 8] {
            let plan = dir.join(format!("{model}-{ranks}.ron"));
            let plan_s = plan.to_str().unwrap();
            let cluster = format!("{ranks}xcpu");
            let out = dplc(&[
                "compile",
                "models/tiny.dpl",
                "--model",
                model,
                "--cluster",
                &cluster,
                "-o",
                plan_s,
            ]);
            assert!(out.status.success(), "{}", stderr(&out));
            let out = dplc(&["verify", plan_s, "--compute", "fused", "--json"]);
            assert!(out.status.success(), "{model} {ranks}: {}", stderr(&out));
            let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
            assert_eq!(v["pass"], true, "{v}");
            assert_eq!(v["compute"], "fused", "{v}");
        }
    }
    let mut args = vec!["run", "models/tiny.dpl", "--cluster", "2xcpu"];
    args.extend(SMALL);
    args.extend(["--steps", "8", "--json", "--compute", "fused"]);
    let out = dplc(&args);
    assert!(out.status.success(), "{}", stderr(&out));
    let text = String::from_utf8_lossy(&out.stdout);
    let summary: serde_json::Value =
        serde_json::from_str(text.lines().last().expect("a summary line")).unwrap();
    assert!(
        summary["final_loss"].as_f64().unwrap() < summary["first_loss"].as_f64().unwrap(),
        "{summary}"
    );
    // Tensor and sequence parallelism pinned, on each rank's local program.
    let plan = dir.join("tp.ron");
    let plan_s = plan.to_str().unwrap();
    let out = dplc(&[
        "compile",
        "models/tiny.dpl",
        "--model",
        "moe_tiny",
        "--cluster",
        "4xcpu",
        "--strategy",
        "tp=2,ep=2,sp=on",
        "-o",
        plan_s,
    ]);
    assert!(out.status.success(), "{}", stderr(&out));
    let out = dplc(&["verify", plan_s, "--compute", "fused", "--json"]);
    assert!(out.status.success(), "tp2 ep2 sp: {}", stderr(&out));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["pass"], true, "{v}");
    std::fs::remove_dir_all(&dir).ok();
}

/// The zoo's multi-query model (Gemma's shape: one KV head, 256-wide heads
/// in the full model, a tied and √d-scaled embedding) verifies under tensor,
/// data and pipeline splits on both computes, as its planner priced them.
#[test]
fn the_gemma_zoo_model_verifies_under_its_splits() {
    verify_splits(
        "models/gemma.dpl",
        Some("gemma_tiny"),
        &["tp=2,dp=2", "dp=2,pp=2", "tp=2,pp=2,sp=true"],
        &["--seq", "16", "--global-batch", "8"],
    );
}

/// Sharded gradients and weights under a pipeline (torchtitan's FSDP + PP),
/// pinned, run as priced and equal to the serial run on both computes.
#[test]
fn zero_2_and_3_under_a_pipeline_verify_when_pinned() {
    verify_splits(
        "models/tiny.dpl",
        Some("gpt_tiny"),
        &["dp=2,pp=2,zero=2", "dp=2,pp=2,zero=3"],
        &[],
    );
}

/// The zoo's dense-then-MoE model (DeepSeek-V2-Lite's shape: a dense layer
/// stack, then a stack of routed plus shared experts, latent attention with
/// one rotary key shared by every head) verifies under tensor, data,
/// pipeline and expert splits on both computes, as its planner priced them.
#[test]
fn the_deepseek_zoo_model_verifies_under_its_splits() {
    verify_splits(
        "models/deepseek.dpl",
        Some("deepseek_tiny"),
        &["tp=2,dp=2", "dp=2,pp=2", "tp=2,ep=2,dp=2"],
        &[],
    );
}

/// The zoo's sliding-window model (Mistral's shape): a window as long as the
/// sequence is plain causal attention, a shorter one changes what is
/// learned, and the windowed model verifies under tensor, data and pipeline
/// splits on both computes.
#[test]
fn the_sliding_window_model_masks_and_verifies() {
    let dir = std::env::temp_dir().join(format!("dplc-window-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let src = dir.join("mistral.dpl");
    let zoo = std::fs::read_to_string("models/mistral.dpl").unwrap();
    std::fs::write(
        &src,
        format!("{zoo}\nmodel whole = mistral_tiny(window = 0)\nmodel as_long = mistral_tiny(window = 32)\n"),
    )
    .unwrap();
    let losses = |model: &str| -> Vec<f64> {
        let out = dplc(&[
            "run",
            src.to_str().unwrap(),
            "--model",
            model,
            "--cluster",
            "1xcpu",
            "--steps",
            "3",
            "--seq",
            "32",
            "--json",
        ]);
        assert!(out.status.success(), "{model}: {}", stderr(&out));
        String::from_utf8_lossy(&out.stdout)
            .lines()
            .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
            .filter_map(|v| v["loss"].as_f64())
            .collect()
    };
    let (whole, as_long, windowed) = (losses("whole"), losses("as_long"), losses("mistral_tiny"));
    for (a, b) in whole.iter().zip(&as_long) {
        assert!((a - b).abs() < 1e-6, "{whole:?} vs {as_long:?}");
    }
    assert!(
        (whole[2] - windowed[2]).abs() > 1e-5,
        "{whole:?} vs {windowed:?}"
    );
    verify_splits(
        "models/mistral.dpl",
        Some("mistral_tiny"),
        &["tp=2,dp=2", "dp=2,pp=2"],
        &[],
    );
    std::fs::remove_dir_all(&dir).ok();
}

/// The zoo's encoder-decoder (T5's shape: two stacks, a relative position
/// bias made once per stack, cross-attention to the encoder's output,
/// decoder inputs shifted right, one embedding read in three places,
/// dropout 0.1) verifies under tensor × data with and without sequence
/// parallelism (the e-graph's layout for both stacks, dropout on split
/// values), data × pipeline (cut between the two stacks) and tensor ×
/// pipeline with sequence parallelism on both computes.
#[test]
fn the_t5_zoo_model_verifies_under_its_splits() {
    verify_splits(
        "models/t5.dpl",
        Some("t5_tiny"),
        &[
            "tp=2,dp=2",
            "tp=2,dp=2,sp=false",
            "dp=2,pp=2",
            "tp=2,pp=2,sp=true",
        ],
        &["--seq", "16", "--global-batch", "8"],
    );
}
