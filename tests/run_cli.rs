//! `dplc run` and `dplc verify` end to end: training on CPU ranks with a
//! falling loss, the JSON stream, Ctrl-C, bad input, and a plan's check.

use std::process::{Command, Output, Stdio};

mod common;
use common::{dplc, scratch_model, stderr, verify_splits, SMALL};
use std::time::{Duration, Instant};

#[test]
fn run_json_streams_steps_and_the_loss_falls() {
    let mut args = vec!["run", "models/tiny.dpl", "--cluster", "4xcpu"];
    args.extend(SMALL);
    args.extend(["--steps", "40", "--json"]);
    let out = dplc(&args);
    assert!(out.status.success(), "{}", stderr(&out));
    let lines: Vec<serde_json::Value> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(|l| serde_json::from_str(l).expect("one JSON object per line"))
        .collect();
    assert_eq!(lines.len(), 41, "40 steps and a summary");
    for (i, l) in lines[..40].iter().enumerate() {
        assert_eq!(l["step"], i as u64);
        for key in ["loss", "lr", "grad_norm", "tokens_per_s"] {
            assert!(l[key].as_f64().is_some(), "{key} in {l}");
        }
    }
    let summary = &lines[40];
    assert_eq!(summary["steps"], 40);
    assert_eq!(summary["interrupted"], false);
    let (first, last) = (
        summary["first_loss"].as_f64().unwrap(),
        summary["final_loss"].as_f64().unwrap(),
    );
    assert!(last < first - 0.3, "the loss falls: {first} → {last}");
}

#[test]
fn run_with_a_pinned_split_strategy() {
    let mut args = vec![
        "run",
        "models/tiny.dpl",
        "--cluster",
        "8xcpu",
        "--strategy",
        "dp=2,tp=2,pp=2,zero=1,sp=true,recompute=full",
    ];
    args.extend(SMALL);
    args.extend(["--steps", "2"]);
    let out = dplc(&args);
    let err = stderr(&out);
    assert!(out.status.success(), "{err}");
    assert!(
        err.contains("on 8 CPU ranks: dp 2 × tp 2 × pp 2, ZeRO-1"),
        "{err}"
    );
    assert!(err.contains("2 steps in"), "{err}");
}

#[test]
fn bad_input_gets_clear_errors() {
    let short = std::env::temp_dir().join(format!("dplc-short-{}.txt", std::process::id()));
    std::fs::write(&short, "a corpus of fewer than 65 bytes").unwrap();
    let short = short.to_str().unwrap().to_string();
    let cases: [(&[&str], &str); 3] = [
        (
            &["--cluster", "3xcpu", "--strategy", "tp=3"],
            "tp=3 cannot split the layer",
        ),
        (
            // Within the model's 64 positions, longer than the file.
            &["--cluster", "2xcpu", "--data", &short, "--seq", "64"],
            "one sample needs seq + 1",
        ),
        (
            &["--cluster", "2xcpu", "--data", "no/such/file"],
            "cannot read no/such/file",
        ),
    ];
    for (extra, want) in cases {
        let mut args = vec![
            "run",
            "models/tiny.dpl",
            "--model",
            "gpt_tiny",
            "--steps",
            "1",
        ];
        args.extend(extra);
        let out = dplc(&args);
        assert!(!out.status.success());
        let err = stderr(&out);
        assert!(err.contains(want), "{extra:?}: {err}");
        assert!(!err.contains("panicked"), "{err}");
    }
}

#[cfg(unix)]
#[test]
fn ctrl_c_stops_cleanly_and_says_where() {
    let mut args = vec!["run", "models/tiny.dpl", "--cluster", "4xcpu"];
    args.extend(SMALL);
    args.extend(["--steps", "1000000", "--json"]);
    let mut child = Command::new(env!("CARGO_BIN_EXE_dplc"))
        .args(&args)
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .env("NO_COLOR", "1")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("dplc starts");
    // Interrupt it as a terminal would once it trains (its first step line
    // is out, so its handler is in: a fixed sleep raced a loaded machine).
    let mut lines = std::io::BufRead::lines(std::io::BufReader::new(
        child.stdout.take().expect("piped stdout"),
    ));
    let mut stdout = Vec::new();
    for line in lines.by_ref() {
        let line = line.expect("stdout is text");
        let stepped = line.contains("\"step\"");
        stdout.push(line);
        if stepped {
            break;
        }
    }
    let pid = child.id() as libc::pid_t;
    // SAFETY: sending SIGINT to the child we spawned.
    assert_eq!(unsafe { libc::kill(pid, libc::SIGINT) }, 0);
    let sent = Instant::now();
    stdout.extend(lines.map(|l| l.expect("stdout is text")));
    let out = child.wait_with_output().expect("dplc exits");
    assert!(sent.elapsed() < Duration::from_secs(10), "stops promptly");
    assert!(!out.status.success());
    let err = stderr(&out);
    assert!(
        err.contains("interrupted: stopped cleanly after step"),
        "{err}"
    );
    // The summary, then (under --json) the error as a JSON object.
    let json: Vec<serde_json::Value> = stdout
        .iter()
        .map(|l| serde_json::from_str(l).expect("JSON lines"))
        .collect();
    let [.., summary, error] = json.as_slice() else {
        panic!("a summary and an error line: {stdout:?}")
    };
    assert_eq!(summary["interrupted"], true);
    assert!(summary["steps"].as_u64().unwrap() >= 1);
    assert!(error["error"]["message"]
        .as_str()
        .is_some_and(|m| m.contains("interrupted")));
}

#[test]
fn verify_passes_a_plan_and_catches_a_broken_one() {
    let dir = std::env::temp_dir().join(format!("dplc-verify-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let plan = dir.join("plan.ron");
    let plan_s = plan.to_str().unwrap();
    let mut args = vec![
        "run",
        "models/tiny.dpl",
        "--cluster",
        "8xcpu",
        "--strategy",
        "dp=2,tp=2,pp=2,zero=1,sp=true",
        "--save-plan",
        plan_s,
    ];
    args.extend(SMALL);
    args.extend(["--steps", "1"]);
    let out = dplc(&args);
    assert!(out.status.success(), "{}", stderr(&out));

    let out = dplc(&["verify", plan_s, "--json"]);
    assert!(out.status.success(), "{}", stderr(&out));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["pass"], true, "{v}");
    assert_eq!(v["ranks"], 8);
    assert!(v["param_deviation"].as_f64().unwrap() < 1e-6, "{v}");

    // Zero steps would compare nothing and pass a broken plan.
    let out = dplc(&["verify", plan_s, "--steps", "0", "--inject", "grad-sync"]);
    assert_eq!(out.status.code(), Some(1), "{}", stderr(&out));
    assert!(
        stderr(&out).contains("--steps must be positive"),
        "{}",
        stderr(&out)
    );

    for fault in ["tp-sum", "grad-sync"] {
        let out = dplc(&["verify", plan_s, "--inject", fault]);
        assert!(!out.status.success(), "{fault} must fail the check");
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(text.contains("FAIL"), "{text}");
        assert!(
            stderr(&out).contains("largest deviation"),
            "{}",
            stderr(&out)
        );
    }
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn verify_checks_the_plans_own_layout() {
    let text = std::fs::read_to_string("models/tiny.dpl").unwrap();
    let unit = dplc_frontend::parse("models/tiny.dpl", &text).unwrap();
    let lowered = unit.lower("llama_tiny").unwrap();
    let cluster = dplc_planner::parse_cluster("4xcpu").unwrap();
    let mut req = dplc_planner::PlanRequest::new(&lowered.graph, lowered.train.clone(), cluster);
    req.pinned = dplc_planner::parse_strategy("dp=2,tp=2,sp=true,zero=2").unwrap();
    let mut plan = dplc_planner::compile(&req).unwrap().plan;
    plan.layout = Some(dplc_planner::derive_layout(&lowered.graph, 2, 1, true).unwrap());
    let path = std::env::temp_dir().join(format!("dplc-layout-{}.ron", std::process::id()));
    std::fs::write(&path, ron::to_string(&plan).unwrap()).unwrap();
    let out = dplc(&["verify", path.to_str().unwrap(), "--json"]);
    std::fs::remove_file(&path).ok();
    assert!(out.status.success(), "{}", stderr(&out));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["layout"], "the plan's", "{v}");
    assert_eq!(v["pass"], true, "{v}");
}

/// The planner's own tensor-parallel plans of the tiny zoo, their roots
/// split over the vocabulary as priced, verify on both computes: the split
/// run (its embedding, head and loss exchanging picks and row statistics
/// over the group) trains the serial run's function.
#[test]
fn verify_runs_the_vocabulary_split_root_on_both_computes() {
    let text = std::fs::read_to_string("models/tiny.dpl").unwrap();
    let unit = dplc_frontend::parse("models/tiny.dpl", &text).unwrap();
    for (model, strategy) in [
        ("gpt_tiny", "tp=2,pp=2"),
        ("llama_tiny", "dp=2,tp=2,sp=true,zero=3"),
        ("moe_tiny", "dp=2,tp=2,ep=2"),
    ] {
        let lowered = unit.lower(model).unwrap();
        let cluster = dplc_planner::parse_cluster("4xcpu").unwrap();
        let mut req =
            dplc_planner::PlanRequest::new(&lowered.graph, lowered.train.clone(), cluster);
        req.pinned = dplc_planner::parse_strategy(strategy).unwrap();
        let plan = dplc_planner::compile(&req).unwrap().plan;
        assert_eq!(plan.strategy.root, dplc_ir::RootSplit::Vocab);
        let layout = plan.layout.as_ref().expect("a tp plan carries its layout");
        let embedding = lowered.graph.params().next().unwrap().0;
        assert!(
            layout.param_split(embedding).is_some(),
            "{model}: the embedding table is split over the vocabulary"
        );
        let path =
            std::env::temp_dir().join(format!("dplc-vocab-{model}-{}.ron", std::process::id()));
        std::fs::write(&path, ron::to_string(&plan).unwrap()).unwrap();
        for compute in ["reference", "fused"] {
            let out = dplc(&[
                "verify",
                path.to_str().unwrap(),
                "--json",
                "--compute",
                compute,
                "--steps",
                "3",
            ]);
            assert!(out.status.success(), "{model} {compute}: {}", stderr(&out));
            let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
            assert_eq!(v["pass"], true, "{model} {compute}: {v}");
            assert_eq!(v["layout"], "the plan's", "{v}");
        }
        std::fs::remove_file(&path).ok();
    }
}

/// A plan file is checked against its model before any rank starts: a
/// layout naming a region the model lacks, a layout whose node list is not
/// the model's, a stage without layers and a stage list shorter than the
/// pipeline are each refused with what does not fit — never a panic.
#[test]
fn verify_refuses_a_plan_that_does_not_fit_its_model() {
    let text = std::fs::read_to_string("models/tiny.dpl").unwrap();
    let unit = dplc_frontend::parse("models/tiny.dpl", &text).unwrap();
    let lowered = unit.lower("gpt_tiny").unwrap();
    let cluster = dplc_planner::parse_cluster("4xcpu").unwrap();
    let mut req = dplc_planner::PlanRequest::new(&lowered.graph, lowered.train.clone(), cluster);
    req.pinned = dplc_planner::parse_strategy("tp=2,pp=2").unwrap();
    let plan = dplc_planner::compile(&req).unwrap().plan;
    let mut far_region = plan.clone();
    far_region.layout.as_mut().unwrap().regions[1].region = dplc_ir::RegionId::new(99);
    let mut short_nodes = plan.clone();
    short_nodes.layout.as_mut().unwrap().regions[1].nodes.pop();
    let mut empty_stage = plan.clone();
    empty_stage.stages[1].layers = 0;
    let mut one_stage = plan.clone();
    one_stage.stages.pop();
    let cases = [
        (
            far_region,
            "the plan does not fit the model: the layout names region r99",
        ),
        (
            short_nodes,
            "the plan does not fit the model: the layout of region",
        ),
        (empty_stage, "is not a plan dplc can use: stages[1]: 0"),
        (one_stage, "stages: 1 stages"),
    ];
    for (i, (broken, want)) in cases.into_iter().enumerate() {
        let path = std::env::temp_dir().join(format!("dplc-broken-{}-{i}.ron", std::process::id()));
        std::fs::write(&path, ron::to_string(&broken).unwrap()).unwrap();
        let out = dplc(&["verify", path.to_str().unwrap()]);
        std::fs::remove_file(&path).ok();
        let err = stderr(&out);
        assert!(!out.status.success(), "case {i}: {err}");
        assert!(err.contains(want), "case {i}: {err}");
        assert!(!err.contains("panicked"), "case {i}: {err}");
    }
}

#[test]
fn run_trains_on_a_data_file() {
    let mut args = vec!["run", "models/tiny.dpl", "--cluster", "2xcpu"];
    args.extend(SMALL);
    args.extend(["--steps", "2", "--data", "README.md"]);
    let out = dplc(&args);
    assert!(out.status.success(), "{}", stderr(&out));

    // u16 token ids past the vocabulary of 256 are refused before training.
    let path = std::env::temp_dir().join(format!("dplc-tokens-{}.u16", std::process::id()));
    let tokens: Vec<u8> = (0..200u16).flat_map(|t| (t * 7).to_le_bytes()).collect();
    std::fs::write(&path, tokens).unwrap();
    let mut args = vec!["run", "models/tiny.dpl", "--cluster", "2xcpu"];
    args.extend(SMALL);
    args.extend(["--steps", "2", "--data", path.to_str().unwrap()]);
    let out = dplc(&args);
    std::fs::remove_file(&path).ok();
    assert!(!out.status.success());
    assert!(
        stderr(&out).contains("outside the model's vocabulary of 256"),
        "{}",
        stderr(&out)
    );
}

/// `dplc run --trace` writes the measured timeline in the trace-event format
/// `dplc viz --format trace` uses: every rank's forwards and backwards per
/// micro-batch, then its step's synchronisation and optimizer.
#[test]
fn run_trace_records_every_rank_in_the_trace_event_format() {
    let trace = std::env::temp_dir().join(format!("dplc-run-trace-{}.json", std::process::id()));
    let mut args = vec![
        "run",
        "models/tiny.dpl",
        "--cluster",
        "4xcpu",
        "--strategy",
        "dp=1,tp=2,pp=2,schedule=1f1b,mb=1",
        "--trace",
        trace.to_str().unwrap(),
    ];
    args.extend(SMALL);
    args.extend(["--steps", "2"]);
    let out = dplc(&args);
    assert!(out.status.success(), "{}", stderr(&out));
    let v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&trace).expect("trace written")).unwrap();
    let events = v["traceEvents"].as_array().expect("traceEvents");
    let spans: Vec<&serde_json::Value> = events.iter().filter(|e| e["ph"] == "X").collect();
    for e in &spans {
        assert!(e["ts"].as_f64().unwrap() >= 0.0 && e["dur"].as_f64().unwrap() >= 0.0);
        assert!(e["pid"].is_u64() && e["tid"].is_u64() && e["name"].is_string());
    }
    let global_batch: usize = SMALL[SMALL.iter().position(|a| *a == "--global-batch").unwrap() + 1]
        .parse()
        .unwrap();
    for rank in 0..4u64 {
        let of = |cat: &str| {
            spans
                .iter()
                .filter(|e| e["tid"] == rank && e["cat"] == cat)
                .count()
        };
        // Two steps of `global_batch` one-sample micro-batches on one replica.
        assert_eq!(of("forward"), 2 * global_batch, "rank {rank}");
        assert_eq!(of("backward"), 2 * global_batch, "rank {rank}");
        assert_eq!(of("step"), 2, "rank {rank}");
    }
    assert!(v["otherData"]["predicted_step_time_s"].as_f64().unwrap() > 0.0);
}

/// The fault switch: a rank that dies or stops answering at a chosen step
/// ends the run within the timeout, non-zero, naming the rank and the step.
#[test]
fn injected_faults_stop_the_run_and_name_the_rank_and_step() {
    let cases = [
        ("stall:1:2", "rank 1 stopped answering at step 2"),
        ("kill:2:1", "injected failure at step 1"),
        ("panic:3:0", "injected panic at step 0"),
        ("stall:one:2", "cannot read DPLC_FAULT"),
    ];
    for (fault, want) in cases {
        let mut args = vec![
            "run",
            "models/tiny.dpl",
            "--cluster",
            "4xcpu",
            "--timeout",
            "2",
        ];
        args.extend(SMALL);
        args.extend(["--steps", "5"]);
        let start = std::time::Instant::now();
        let out = Command::new(env!("CARGO_BIN_EXE_dplc"))
            .args(&args)
            .current_dir(env!("CARGO_MANIFEST_DIR"))
            .env("NO_COLOR", "1")
            .env("DPLC_FAULT", fault)
            .output()
            .expect("the dplc binary runs");
        assert_eq!(out.status.code(), Some(1), "{fault}: {}", stderr(&out));
        let err = stderr(&out);
        assert!(err.contains(want), "{fault}: {err}");
        assert!(
            start.elapsed() < std::time::Duration::from_secs(20),
            "{fault} took {:?}",
            start.elapsed()
        );
    }
}

/// The fault switch during a checkpoint write: rank 1 dies after writing its
/// shard of step 4, before the manifest. Step 2 stays the latest complete
/// checkpoint, and resuming from it gives the uninterrupted run's losses.
#[test]
fn a_kill_during_a_checkpoint_write_then_resume() {
    let dir = std::env::temp_dir().join(format!("dplc-ckpt-kill-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let d = dir.to_str().unwrap();
    let run = |extra: &[&str], fault: Option<&str>| {
        let mut args = vec!["run", "models/tiny.dpl", "--cluster", "4xcpu"];
        args.extend(SMALL);
        args.extend(["--steps", "6", "--json"]);
        args.extend(extra);
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_dplc"));
        cmd.args(&args)
            .current_dir(env!("CARGO_MANIFEST_DIR"))
            .env("NO_COLOR", "1");
        if let Some(f) = fault {
            cmd.env("DPLC_FAULT", f);
        }
        cmd.output().expect("the dplc binary runs")
    };
    let by_step = |out: &Output| -> std::collections::BTreeMap<u64, f64> {
        String::from_utf8_lossy(&out.stdout)
            .lines()
            .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
            .filter_map(|v| Some((v["step"].as_u64()?, v["loss"].as_f64()?)))
            .collect()
    };
    let straight = run(&[], None);
    assert!(straight.status.success(), "{}", stderr(&straight));
    let killed = run(
        &["--checkpoint-dir", d, "--checkpoint-every", "2"],
        Some("checkpoint-kill:1:4"),
    );
    assert_eq!(killed.status.code(), Some(1));
    assert!(
        stderr(&killed).contains("injected kill while writing the checkpoint"),
        "{}",
        stderr(&killed)
    );
    assert!(dir.join("step-000002/manifest.json").is_file());
    assert!(!dir.join("step-000004/manifest.json").exists());
    let resumed = run(&["--checkpoint-dir", d, "--resume"], None);
    assert!(resumed.status.success(), "{}", stderr(&resumed));
    let (all, after) = (by_step(&straight), by_step(&resumed));
    assert_eq!(after.keys().copied().collect::<Vec<_>>(), vec![2, 3, 4, 5]);
    for (step, loss) in &after {
        assert_eq!(all[step], *loss, "step {step}: bit for bit");
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// Multi-query attention (one KV head, as Gemma 2B, Falcon and PaLM have)
/// splits under tensor parallelism: the query heads split, K and V stay
/// whole on every rank, and the split trains as the serial run does on both
/// computes (it stopped the planner with an unsound e-graph merge before).
#[test]
fn multi_query_attention_splits_under_tensor_parallelism() {
    let dir = std::env::temp_dir().join(format!("dplc-mqa-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let src = dir.join("mqa.dpl");
    let tiny = std::fs::read_to_string("models/tiny.dpl").unwrap();
    std::fs::write(
        &src,
        format!("{tiny}\nmodel mqa_tiny = llama_tiny(kv_heads = 1)\n"),
    )
    .unwrap();
    let plan = dir.join("mqa.ron");
    let out = dplc(&[
        "compile",
        src.to_str().unwrap(),
        "--model",
        "mqa_tiny",
        "--cluster",
        "4xcpu",
        "--strategy",
        "tp=2,dp=2",
        "-o",
        plan.to_str().unwrap(),
    ]);
    assert!(out.status.success(), "{}", stderr(&out));
    let text = std::fs::read_to_string(&plan).unwrap();
    let ron: dplc_ir::Plan = ron::from_str(&text).unwrap();
    let splits = |name: &str| {
        ron.param_sharding
            .iter()
            .find(|s| s.name == name)
            .unwrap_or_else(|| panic!("{name}"))
            .splits
            .len()
    };
    assert_eq!(splits("layers.attention.q.w"), 1);
    assert_eq!(splits("layers.attention.k.w"), 0);
    for compute in ["reference", "fused"] {
        let out = dplc(&[
            "verify",
            plan.to_str().unwrap(),
            "--compute",
            compute,
            "--json",
        ]);
        assert!(out.status.success(), "{compute}: {}", stderr(&out));
        let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        assert_eq!(v["pass"], true, "{compute}: {v}");
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// A rotary key shared by all heads (DeepSeek's latent attention) splits
/// under tensor parallelism the same way: the shared key whole on every
/// rank, the per-head parts split, the run equal to the serial one.
#[test]
fn a_rope_key_shared_across_heads_splits_under_tensor_parallelism() {
    let dir = std::env::temp_dir().join(format!("dplc-mla-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let plan = dir.join("mla.ron");
    let out = dplc(&[
        "compile",
        "tests/data/mla_tiny.dpl",
        "--cluster",
        "4xcpu",
        "--strategy",
        "tp=2,dp=2",
        "-o",
        plan.to_str().unwrap(),
    ]);
    assert!(out.status.success(), "{}", stderr(&out));
    let out = dplc(&["verify", plan.to_str().unwrap(), "--json"]);
    assert!(out.status.success(), "{}", stderr(&out));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["pass"], true, "{v}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// `where` and the comparisons inside a layer (a leaky gate on the MLP's
/// output) train as the serial run does under tensor, data and pipeline
/// splits on both computes.
#[test]
fn where_and_comparisons_train_under_every_split() {
    let (dir, src) = scratch_model("where", "where.dpl",
        "model wh(vocab = 256, d = 64, heads = 4, layers = 2) {\n    input tokens: i32[batch, seq]\n    \
         input targets: i32[batch, seq]\n    param embed: [vocab, d]\n    h = embedding(embed, tokens)\n    \
         repeat layers {\n        h = h + attention(rms_norm(h, d, name = \"an\"), d, heads, rotary = true)\n        \
         m = swiglu(rms_norm(h, d, name = \"fn\"), d, 128)\n        \
         h = h + where(gt(m, 0.0), m, m * 0.1) + abs(floor(m)) * 0.0\n    }\n    \
         param output: [d, vocab]\n    return cross_entropy(rms_norm(h, d, name = \"n\") @ output, targets)\n}\n",
    );
    verify_splits(
        src.to_str().unwrap(),
        None,
        &["tp=2,dp=2", "dp=2,pp=2"],
        &["--seq", "16", "--global-batch", "8"],
    );
    std::fs::remove_dir_all(&dir).ok();
}

/// A causal convolution of width 3 written with `shift` along the sequence
/// and a running sum (`cumsum`) inside a layer train as the serial run does
/// under tensor, data, pipeline and sequence-parallel splits on both
/// computes (under sequence parallelism they run on the whole sequence).
#[test]
fn shifts_and_running_sums_train_under_every_split() {
    let (dir, src) = scratch_model("shift", "conv.dpl",
        "model conv(vocab = 256, d = 64, heads = 4, layers = 2) {\n    input tokens: i32[batch, seq]\n    \
         input targets: i32[batch, seq]\n    param embed: [vocab, d]\n    h = embedding(embed, tokens)\n    \
         repeat layers {\n        h = h + attention(rms_norm(h, d, name = \"an\"), d, heads, rotary = true)\n        \
         x = rms_norm(h, d, name = \"cn\")\n        param w0: [d] = ones\n        param w1: [d] = zeros\n        \
         param w2: [d] = zeros\n        h = h + x * w0 + shift(x, 1, 1) * w1 + shift(x, 1, 2) * w2\n        \
         h = h + cumsum(x, 1) * 0.01\n        h = h + swiglu(rms_norm(h, d, name = \"fn\"), d, 128)\n    }\n    \
         param output: [d, vocab]\n    return cross_entropy(rms_norm(h, d, name = \"n\") @ output, targets)\n}\n",
    );
    verify_splits(
        src.to_str().unwrap(),
        None,
        &["tp=2,dp=2", "dp=2,pp=2", "tp=2,sp=true,dp=2"],
        &["--seq", "16", "--global-batch", "8"],
    );
    std::fs::remove_dir_all(&dir).ok();
}

/// One MLP's parameters read before the layers and in every layer (`share =
/// "first"`): counted once, their gradients summed from every reader, the
/// run as the serial one under tensor × data and data × pipeline splits on
/// both computes.
#[test]
fn a_shared_block_trains_under_every_split() {
    let (dir, src) = scratch_model("share", "share.dpl",
        "model sh(vocab = 256, d = 64, heads = 4, layers = 2) {\n    input tokens: i32[batch, seq]\n    \
         input targets: i32[batch, seq]\n    param embed: [vocab, d]\n    h = embedding(embed, tokens)\n    \
         h = h + mlp(rms_norm(h, d, name = \"n0\"), d, 128, name = \"first\")\n    repeat layers {\n        \
         h = h + attention(rms_norm(h, d, name = \"an\"), d, heads, rotary = true)\n        \
         h = h + mlp(rms_norm(h, d, name = \"fn\"), d, 128, share = \"first\")\n    }\n    \
         return cross_entropy(rms_norm(h, d, name = \"n\") @ transpose(embed), targets)\n}\n",
    );
    let out = dplc(&["inspect", src.to_str().unwrap(), "--json"]);
    assert!(out.status.success(), "{}", stderr(&out));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    // embed 16,384 + six norms 384 + the MLP once 16,576 + two attentions 33,280.
    assert_eq!(v["params"], 66_624);
    verify_splits(
        src.to_str().unwrap(),
        None,
        &["tp=2,dp=2", "dp=2,pp=2"],
        &["--seq", "16", "--global-batch", "8"],
    );
    std::fs::remove_dir_all(&dir).ok();
}

/// Dropout on values split over the tensor-parallel group (attention
/// probabilities by heads, the MLP's hidden units, the sequence under sp)
/// draws each element at its place in the whole tensor, so gpt_tiny with
/// dropout verifies under the planner's own tensor-parallel layouts on
/// both computes (it drew by the rank's local index and failed by 0.16).
#[test]
fn dropout_on_split_values_draws_the_serial_masks() {
    let text = std::fs::read_to_string("models/tiny.dpl").expect("the zoo file");
    let (dir, src) = scratch_model(
        "dropout-tp",
        "tiny.dpl",
        &format!("{text}\nmodel gpt_dropout = gpt_tiny(dropout = 0.1)\n"),
    );
    verify_splits(
        src.to_str().unwrap(),
        Some("gpt_dropout"),
        &["tp=2,dp=2,sp=true", "tp=4,sp=false"],
        &["--seq", "16", "--global-batch", "8"],
    );
    std::fs::remove_dir_all(&dir).ok();
}

/// Knobs that price another engine's stack are refused by `dplc run` with
/// what to do, before any rank starts: its ranks send one all-to-all.
#[test]
fn run_refuses_a_dispatcher_it_does_not_run() {
    let out = dplc(&[
        "run",
        "models/tiny.dpl",
        "--model",
        "moe_tiny",
        "--cluster",
        "4xcpu",
        "--strategy",
        "ep=2,dispatch=hierarchical",
        "--steps",
        "1",
    ]);
    assert!(!out.status.success());
    let err = stderr(&out);
    assert!(err.contains("dispatch=hierarchical"), "{err}");
    assert!(err.contains("drop dispatch from --strategy"), "{err}");
}

/// Half-precision main gradients are priced and exported, not run: `dplc
/// run` refuses them with the way out, exit non-zero.
#[test]
fn run_refuses_gradients_it_does_not_keep() {
    let out = dplc(&[
        "run",
        "models/tiny.dpl",
        "--model",
        "gpt_tiny",
        "--cluster",
        "2xcpu",
        "--strategy",
        "grad_reduce=bf16",
        "--steps",
        "1",
    ]);
    assert!(!out.status.success());
    let err = stderr(&out);
    assert!(err.contains("grad_reduce=bf16"), "{err}");
    assert!(err.contains("drop grad_reduce from --strategy"), "{err}");
}

/// A run's own outputs never destroy its work: `--trace` or `--save-plan`
/// inside the checkpoint directory it saves into or resumes from (a
/// manifest overwritten makes the checkpoint unloadable), or both on one
/// file, are refused before anything is written; the checkpoint still
/// resumes afterwards.
#[test]
fn run_outputs_stay_out_of_the_checkpoints() {
    let dir = std::env::temp_dir().join(format!("dplc-run-outputs-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let ck = dir.join("ck");
    let ck_s = ck.to_str().unwrap();
    let train = |extra: &[&str]| {
        let mut args = vec!["run", "models/tiny.dpl", "--cluster", "2xcpu"];
        args.extend(SMALL);
        args.extend(extra);
        dplc(&args)
    };
    let out = train(&["--steps", "2", "--checkpoint-dir", ck_s]);
    assert!(out.status.success(), "{}", stderr(&out));
    let manifest = ck.join("step-000002").join("manifest.json");
    let before = std::fs::read(&manifest).unwrap();
    let m = manifest.to_str().unwrap();
    let same = dir.join("same.out");
    let same_s = same.to_str().unwrap();
    for (extra, says) in [
        (
            vec!["--steps", "4", "--resume", ck_s, "--save-plan", m],
            "--save-plan",
        ),
        (
            vec![
                "--steps",
                "4",
                "--checkpoint-dir",
                ck_s,
                "--resume",
                "--trace",
                m,
            ],
            "--trace",
        ),
        (
            vec!["--steps", "1", "--trace", same_s, "--save-plan", same_s],
            "name the same file",
        ),
    ] {
        let out = train(&extra);
        assert_eq!(out.status.code(), Some(1), "{extra:?}: {}", stderr(&out));
        let said = stderr(&out).replace("\n  | ", " ");
        assert!(said.contains(says), "{extra:?}: {said}");
    }
    assert_eq!(
        std::fs::read(&manifest).unwrap(),
        before,
        "the manifest is untouched"
    );
    assert!(!same.exists(), "nothing written");
    let out = train(&["--steps", "3", "--resume", ck_s]);
    assert!(out.status.success(), "{}", stderr(&out));
    std::fs::remove_dir_all(&dir).ok();
}

/// Compressed gradients and async updates change what training computes by
/// design: `verify` checks such a plan's split without them and says so,
/// rather than failing it for the change it was asked to make.
#[test]
fn verify_sets_aside_what_changes_the_training_dynamics() {
    let dir = std::env::temp_dir().join(format!("dplc-verify-dyn-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    for (name, strategy, says) in [
        (
            "topk",
            "dp=2,zero=0,compress=topk:0.1",
            "compress=topk:0.1 changes",
        ),
        (
            "async",
            "dp=2,zero=0,sync=async,staleness=1",
            "sync=async (staleness 1) changes",
        ),
    ] {
        let plan = dir.join(format!("{name}.ron"));
        let plan_s = plan.to_str().unwrap();
        let mut args = vec![
            "run",
            "models/tiny.dpl",
            "--cluster",
            "2xcpu",
            "--strategy",
            strategy,
        ];
        args.extend(SMALL);
        args.extend(["--steps", "1", "--save-plan", plan_s]);
        let out = dplc(&args);
        assert!(out.status.success(), "{}", stderr(&out));
        let out = dplc(&["verify", plan_s, "--steps", "2"]);
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(out.status.success(), "{name}: {text}{}", stderr(&out));
        assert!(
            text.contains(says) && text.contains("pass"),
            "{name}: {text}"
        );
        let out = dplc(&["verify", plan_s, "--steps", "2", "--json"]);
        let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        assert_eq!(v["pass"], true, "{v}");
        assert_eq!(v["set_aside"].as_array().map(Vec::len), Some(1), "{v}");
    }
    std::fs::remove_dir_all(&dir).ok();
}

/// A run may go on from a checkpoint at another sequence length or batch,
/// and says so: the samples after the checkpoint are cut differently.
#[test]
fn a_resume_at_another_length_says_so() {
    let dir = std::env::temp_dir().join(format!("dplc-resume-len-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let ck = dir.join("ck");
    let ck_s = ck.to_str().unwrap();
    let tiny = [
        "run",
        "models/tiny.dpl",
        "--model",
        "gpt_tiny",
        "--cluster",
        "1xcpu",
    ];
    let mut args = tiny.to_vec();
    args.extend([
        "--steps",
        "2",
        "--seq",
        "16",
        "--global-batch",
        "4",
        "--checkpoint-dir",
        ck_s,
    ]);
    let out = dplc(&args);
    assert!(out.status.success(), "{}", stderr(&out));
    let mut args = tiny.to_vec();
    args.extend([
        "--steps",
        "3",
        "--seq",
        "32",
        "--global-batch",
        "4",
        "--resume",
        ck_s,
    ]);
    let out = dplc(&args);
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(
        stderr(&out).contains("the checkpoint trained at seq 16, global batch 4; this run goes on at seq 32, global batch 4"),
        "{}",
        stderr(&out)
    );
    std::fs::remove_dir_all(&dir).ok();
}
