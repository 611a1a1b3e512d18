//! The `dplc` binary end to end: exit codes, JSON fields, and errors that
//! point at the source.

mod common;
use common::dplc;

fn json(args: &[&str]) -> serde_json::Value {
    let out = dplc(args);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).expect("--json prints one JSON object")
}

#[test]
fn inspect_json_reports_published_parameter_counts() {
    let v = json(&["inspect", "models/gpt2.dpl", "--model", "gpt2", "--json"]);
    assert_eq!(v["params"], 124_439_808u64);
    assert_eq!(v["layers"], 12);
    assert_eq!(v["model"], "gpt2");
    // Megatron's count: 24·l·h² + 2·l·s·h·2 + 2·V·h per token, forward.
    let (l, h, s, vocab) = (12.0, 768.0, 1024.0, 50257.0);
    let expected = l * (24.0 * h * h + 4.0 * s * h) + 2.0 * vocab * h;
    assert_eq!(v["flops_per_token_forward"].as_f64().unwrap(), expected);
    assert!(v["activation_bytes_per_layer"].as_f64().unwrap() > 0.0);

    let v = json(&[
        "inspect",
        "models/llama3.dpl",
        "--model",
        "llama3_405b",
        "--json",
    ]);
    assert_eq!(v["params"], 405_853_388_800u64);
    assert_eq!(v["layers"], 126);

    // Two stacks (encoder and decoder), the embedding counted once though
    // three places read it (frontend/tests/zoo.rs cites the count).
    let v = json(&["inspect", "models/t5.dpl", "--model", "t5_small", "--json"]);
    assert_eq!(v["params"], 60_506_624u64);
    let v = json(&["inspect", "models/t5.dpl", "--model", "t5_tiny", "--json"]);
    assert_eq!(
        v["params"],
        64 * 32
            + 2 * (4 * 32 * 32 + 2 * 32 * 64 + 2 * 32)
            + 2 * 8 * 4
            + 2 * 32
            + 2 * (8 * 32 * 32 + 2 * 32 * 64 + 3 * 32)
    );
}

#[test]
fn inspect_table_names_blocks() {
    let out = dplc(&["inspect", "models/tiny.dpl", "--model", "gpt_tiny"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8_lossy(&out.stdout);
    for needle in [
        "parameters by block",
        "attention",
        "forward FLOPs",
        "activations stored per layer",
    ] {
        assert!(text.contains(needle), "missing {needle:?} in\n{text}");
    }
}

#[test]
fn a_file_with_several_models_asks_which() {
    let out = dplc(&["inspect", "models/gpt2.dpl"]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("gpt2_medium") && err.contains("--model"),
        "{err}"
    );
}

#[test]
fn check_accepts_every_zoo_file() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    let dirs = [root.join("models"), root.join("models/clusters")];
    let entries = dirs.iter().flat_map(|d| std::fs::read_dir(d).unwrap());
    for entry in entries {
        let path = entry.unwrap().path();
        if path.extension().is_some_and(|e| e == "dpl") {
            let out = dplc(&["check", path.to_str().unwrap()]);
            assert!(
                out.status.success(),
                "{}: {}",
                path.display(),
                String::from_utf8_lossy(&out.stderr)
            );
        }
    }
}

#[test]
fn bad_input_points_at_the_source_and_exits_non_zero() {
    let dir = std::env::temp_dir().join(format!("dplc-cli-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("bad.dpl");
    std::fs::write(
        &file,
        "model m(d = 8) {\n    input x: f32[batch, d]\n    param w: [d, d]\n    return x @ w2\n}\n",
    )
    .unwrap();
    let out = dplc(&["check", file.to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("bad.dpl:4:"), "no file:line:col in\n{err}");
    assert!(err.contains("w2"), "{err}");
    assert!(!err.contains("panicked"), "{err}");

    let out = dplc(&["inspect", dir.join("missing.dpl").to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("cannot read"));
}

#[test]
fn every_command_has_help() {
    for cmd in [
        &["--help"][..],
        &["check", "--help"],
        &["inspect", "--help"],
    ] {
        let out = dplc(cmd);
        assert!(out.status.success());
        assert!(String::from_utf8_lossy(&out.stdout).contains("Usage"));
    }
}

/// An engine's stack keys (`recompute=op`, `elementwise=eager`,
/// `loss=unfused`, `shards=per_param`, `tp_impl=dtensor`, `tp_impl=megatron`, `autocast=on`,
/// `dispatch=hierarchical`) are priced by `compile` and refused by `run`
/// and `build` (one list, `src/stack.rs`), whose own kernels and buffers do
/// none of them: each says what to pin instead and names the pin, and a
/// refused build writes nothing.
#[test]
fn engine_stack_keys_are_priced_not_run() {
    for (model, cluster, pin) in [
        ("gpt_tiny", "2xcpu", "dp=2,recompute=op"),
        ("gpt_tiny", "2xcpu", "dp=2,elementwise=eager"),
        ("gpt_tiny", "2xcpu", "dp=2,loss=unfused"),
        ("gpt_tiny", "2xcpu", "dp=2,loss=eager"),
        ("gpt_tiny", "2xcpu", "dp=2,zero=3,shards=per_param"),
        ("gpt_tiny", "2xcpu", "tp=2,sp=on,tp_impl=dtensor"),
        ("gpt_tiny", "2xcpu", "tp=2,sp=on,tp_impl=megatron"),
        ("gpt_tiny", "2xcpu", "dp=2,autocast=on"),
        ("moe_tiny", "4xcpu", "ep=2,dispatch=hierarchical"),
    ] {
        let key = pin.rsplit(',').next().unwrap();
        let plan = [
            "models/tiny.dpl",
            "--model",
            model,
            "--cluster",
            cluster,
            "--strategy",
            pin,
        ];
        let compiled = dplc(&[&["compile"][..], &plan].concat());
        assert!(
            compiled.status.success(),
            "{pin}: {}",
            String::from_utf8_lossy(&compiled.stderr)
        );
        let run = dplc(&[&["run"][..], &plan, &["--steps", "1"]].concat());
        let err = String::from_utf8_lossy(&run.stderr).replace("\n  | ", " ");
        assert!(!run.status.success(), "{pin} ran");
        assert!(err.contains("dplc's runtime"), "{pin}: {err}");
        assert!(
            err.contains(key) && err.contains("to train here"),
            "{pin}: {err}"
        );
        let scratch = common::Scratch::new("cli", "refused-build");
        let out = scratch.0.join("artifact");
        let built = dplc(&[&["build"][..], &plan, &["-o", out.to_str().unwrap()]].concat());
        let err = String::from_utf8_lossy(&built.stderr).replace("\n  | ", " ");
        assert!(!built.status.success(), "{pin} built");
        assert!(err.contains("an artifact cannot"), "{pin}: {err}");
        assert!(err.contains(key), "{pin}: {err}");
        assert!(!out.exists(), "{pin}: a refused build wrote {out:?}");
    }
}
