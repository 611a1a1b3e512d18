//! Checkpoints: resuming continues bit for bit under the same split; loading
//! under another split reshards (equal to the uninterrupted run within the
//! equivalence tolerances of `tests/runtime_zoo.rs`); a kill while writing
//! leaves the previous checkpoint loadable; a corrupted, truncated or
//! missing file is refused by name before anything is loaded; and `dplc run
//! --checkpoint-dir … --resume` continues the same loss stream.
//!
//! Why the reshard tolerances are not zero: after the load every rank holds
//! bit-identical logical state (checked exactly below), but the steps that
//! follow sum gradients in another association (tp2's partial matmuls, dp4's
//! micro-batches), which moves results by a few ulps; AdamW turns the
//! rounding of a near-zero gradient element into a step of up to `lr`, so
//! parameters are compared under SGD with momentum, as the zoo tests do.

use dplc_runtime::{
    train, Checkpoint, CheckpointConfig, CheckpointKill, Corpus, Faults, KillPoint, RunConfig,
    Schedule, TrainReport, ZeroStage,
};
use std::path::Path;
use std::process::Output;

mod common;
use common::{dplc, with_layout, Opt, Scratch, LOSS_TOL, SMALL, TINY};

const SEED: u64 = 11;
const SGD_TOL: f64 = 1e-6;

fn try_run(
    model: &str,
    cfg: &RunConfig,
    steps: u64,
    opt: Opt,
) -> dplc_runtime::Result<TrainReport> {
    let unit = dplc_frontend::parse("tiny.dpl", TINY).expect("tiny.dpl parses");
    let lowered = unit.lower(model).expect("the model lowers");
    let mut spec = lowered.train;
    spec.seq = 16;
    spec.global_batch = cfg.global_batch() as u64;
    spec.optimizer = opt.optimizer();
    let data = Corpus::synthetic(5, 256, 1 << 14);
    let cfg = with_layout(&lowered.graph, cfg);
    train(&lowered.graph, &spec, &cfg, &data, steps, SEED, |_| {})
}

fn run(cfg: &RunConfig, steps: u64, opt: Opt) -> TrainReport {
    try_run("gpt_tiny", cfg, steps, opt).unwrap_or_else(|e| panic!("{e}"))
}

fn saving(cfg: &RunConfig, dir: &Path, every: u64) -> RunConfig {
    RunConfig {
        checkpoint: Some(CheckpointConfig {
            dir: dir.to_path_buf(),
            every,
        }),
        ..cfg.clone()
    }
}

fn resuming(cfg: &RunConfig, from: &Path) -> RunConfig {
    RunConfig {
        resume_from: Some(from.to_path_buf()),
        ..cfg.clone()
    }
}

fn dp2_zero1() -> RunConfig {
    RunConfig {
        dp: 2,
        micro_batch: 1,
        num_micro_batches: 2,
        zero: ZeroStage::One,
        ..RunConfig::default()
    }
}

fn tp2_pp2() -> RunConfig {
    RunConfig {
        tp: 2,
        pp: 2,
        micro_batch: 1,
        num_micro_batches: 4,
        schedule: Schedule::OneFOneB,
        ..RunConfig::default()
    }
}

fn dp4() -> RunConfig {
    RunConfig {
        dp: 4,
        micro_batch: 1,
        num_micro_batches: 1,
        zero: ZeroStage::Two,
        ..RunConfig::default()
    }
}

fn serial() -> RunConfig {
    RunConfig {
        micro_batch: 1,
        num_micro_batches: 4,
        ..RunConfig::default()
    }
}

fn losses(r: &TrainReport) -> Vec<(u64, u64)> {
    r.steps.iter().map(|s| (s.step, s.loss.to_bits())).collect()
}

/// `whole` equals `first` then `second`, bit for bit: losses and parameters.
fn assert_bitwise(name: &str, whole: &TrainReport, first: &TrainReport, second: &TrainReport) {
    let mut joined = losses(first);
    joined.extend(losses(second));
    assert_eq!(losses(whole), joined, "{name}: losses (step, f64 bits)");
    assert_eq!(
        whole.params, second.params,
        "{name}: parameters bit for bit"
    );
}

fn check_resume_is_bitwise(name: &str, cfg: RunConfig) {
    let dir = Scratch::new("ckpt", name);
    let whole = run(&cfg, 6, Opt::AdamW);
    let first = run(&saving(&cfg, &dir.0, 3), 3, Opt::AdamW);
    assert_eq!(first.checkpoints, vec![dir.0.join("step-000003")]);
    let second = run(&resuming(&cfg, &dir.0), 6, Opt::AdamW);
    assert_eq!(second.steps.first().map(|s| s.step), Some(3));
    assert_bitwise(name, &whole, &first, &second);
}

#[test]
fn resume_is_bitwise_under_dp2_zero1() {
    check_resume_is_bitwise("dp2-zero1", dp2_zero1());
}

#[test]
fn resume_is_bitwise_under_tp2_pp2() {
    check_resume_is_bitwise("tp2-pp2", tp2_pp2());
}

/// Context-parallel ranks are replicas: ZeRO-1 shards over dp × cp, and
/// each element is saved once by its owner, so a cp run resumes bit for
/// bit and a serial run loads its parameters exactly.
#[test]
fn resume_is_bitwise_under_cp2_dp2_zero1() {
    let cfg = RunConfig {
        cp: 2,
        ..dp2_zero1()
    };
    check_resume_is_bitwise("cp2-dp2-zero1", cfg.clone());
    let dir = Scratch::new("ckpt", "cp2-reload");
    let first = run(&saving(&cfg, &dir.0, 2), 2, Opt::AdamW);
    let loaded = run(&resuming(&serial(), &dir.0), 2, Opt::AdamW);
    assert!(loaded.steps.is_empty());
    assert_eq!(
        loaded.params, first.params,
        "serial loads cp2×dp2's parameters"
    );
}

#[test]
fn resume_is_bitwise_under_dp2_zero3() {
    check_resume_is_bitwise(
        "dp2-zero3",
        RunConfig {
            zero: ZeroStage::Three,
            ..dp2_zero1()
        },
    );
}

#[test]
fn an_expert_parallel_checkpoint_resumes_and_reshards() {
    let dir = Scratch::new("ckpt", "experts");
    let ep2 = RunConfig {
        dp: 2,
        ep: 2,
        micro_batch: 1,
        num_micro_batches: 2,
        zero: ZeroStage::One,
        ..RunConfig::default()
    };
    let go = |cfg: &RunConfig, steps| {
        try_run("moe_tiny", cfg, steps, Opt::AdamW).unwrap_or_else(|e| panic!("{e}"))
    };
    let whole = go(&ep2, 4);
    let first = go(&saving(&ep2, &dir.0, 2), 2);
    let second = go(&resuming(&ep2, &dir.0), 4);
    assert_bitwise("moe_tiny dp2 ep2", &whole, &first, &second);
    // The experts split over ep come back whole for a serial run.
    let loaded = go(&resuming(&serial(), &dir.0.join("step-000002")), 2);
    assert_eq!(
        loaded.params, first.params,
        "serial loads dp2 ep2's parameters"
    );
    // The step as a person types it names the same directory.
    let typed = go(&resuming(&serial(), &dir.0.join("step-2")), 2);
    assert_eq!(typed.params, loaded.params, "step-2 is step-000002");
}

#[test]
fn a_stopped_run_saves_where_it_stopped() {
    let dir = Scratch::new("ckpt", "stopped");
    let cfg = saving(&dp2_zero1(), &dir.0, 0);
    let unit = dplc_frontend::parse("tiny.dpl", TINY).expect("parses");
    let lowered = unit.lower("gpt_tiny").expect("lowers");
    let mut spec = lowered.train;
    spec.seq = 16;
    spec.global_batch = 4;
    let data = Corpus::synthetic(5, 256, 1 << 14);
    let stop = cfg.stop.clone();
    let report = train(&lowered.graph, &spec, &cfg, &data, 50, SEED, |st| {
        if st.step == 1 {
            stop.stop();
        }
    })
    .expect("a stopped run is not an error");
    assert!(report.interrupted);
    let done = report.steps.len() as u64;
    assert_eq!(
        report.checkpoints,
        vec![dir.0.join(format!("step-{done:06}"))]
    );
    assert_eq!(Checkpoint::open(&dir.0).expect("opens").step(), done);
}

#[test]
fn a_checkpoint_reshards_on_load() {
    let dir = Scratch::new("ckpt", "reshard");
    for opt in [Opt::AdamW, Opt::Sgd] {
        let _ = std::fs::remove_dir_all(&dir.0);
        let whole = run(&tp2_pp2(), 6, opt);
        let first = run(&saving(&tp2_pp2(), &dir.0, 3), 3, opt);
        // Loading alone is exact: the logical tensors come back bit for bit
        // whatever the split that loads them.
        let loaded = run(&resuming(&dp4(), &dir.0), 3, opt);
        assert!(loaded.steps.is_empty());
        assert_eq!(
            loaded.params, first.params,
            "dp4 loads tp2×pp2's parameters"
        );
        for (name, cfg) in [("dp4 zero2", dp4()), ("serial", serial())] {
            let second = run(&resuming(&cfg, &dir.0), 6, opt);
            assert_eq!(second.steps.len(), 3);
            let tol = match opt {
                Opt::AdamW => LOSS_TOL,
                Opt::Sgd => SGD_TOL,
            };
            for (x, y) in whole.steps[3..].iter().zip(&second.steps) {
                assert_eq!(x.step, y.step);
                let rel = ((x.loss - y.loss) / x.loss).abs();
                assert!(
                    rel < tol,
                    "{name}: step {} loss {} vs {}",
                    x.step,
                    x.loss,
                    y.loss
                );
            }
            if let Opt::Sgd = opt {
                let (d, at) = whole.params.max_rel_diff(&second.params, 1e-3);
                assert!(
                    f64::from(d) < SGD_TOL,
                    "{name} (sgd): parameters differ by {d:e} at {at}"
                );
            }
        }
    }
}

#[test]
fn a_kill_while_writing_leaves_the_previous_checkpoint() {
    let cfg = dp2_zero1();
    let whole = run(&cfg, 6, Opt::AdamW);
    for (rank, at) in [
        (1, KillPoint::MidShard),
        (1, KillPoint::AfterShard),
        (0, KillPoint::MidManifest),
    ] {
        let dir = Scratch::new("ckpt", "kill");
        let mut dying = saving(&cfg, &dir.0, 2);
        dying.faults = Faults {
            kill_in_checkpoint: Some(CheckpointKill { rank, step: 4, at }),
            ..Faults::default()
        };
        let e = try_run("gpt_tiny", &dying, 6, Opt::AdamW).expect_err("the kill fails the run");
        assert!(e.to_string().contains("injected kill"), "{at:?}: {e}");
        // step-000004 exists but has no manifest: the latest complete
        // checkpoint is still step 2.
        assert!(dir.0.join("step-000004").is_dir());
        let ck = Checkpoint::open(&dir.0).expect("the previous checkpoint opens");
        assert_eq!(ck.step(), 2, "{at:?}");
        let first = run(&cfg, 2, Opt::AdamW);
        let second = run(&resuming(&cfg, &dir.0), 6, Opt::AdamW);
        assert_bitwise(&format!("{at:?}"), &whole, &first, &second);
    }
}

/// Copy a step directory (flat) to `to`.
fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).expect("mkdir");
    for e in std::fs::read_dir(from).expect("list") {
        let e = e.expect("entry");
        std::fs::copy(e.path(), to.join(e.file_name())).expect("copy");
    }
}

/// A manifest as version 1 wrote it (no run, no checksum of its own): the
/// checks behind the checksum still guard those.
fn as_version_1(text: &str) -> String {
    let mut v: serde_json::Value = serde_json::from_str(text).expect("JSON");
    let m = v.as_object_mut().expect("an object");
    m.remove("checksum");
    m.remove("run");
    m.insert("version".into(), serde_json::json!(1));
    v.to_string()
}

#[test]
fn corrupted_checkpoints_are_refused_by_name() {
    let dir = Scratch::new("ckpt", "corrupt");
    let cfg = dp2_zero1();
    run(&saving(&cfg, &dir.0, 2), 2, Opt::AdamW);
    let good = dir.0.join("step-000002");
    let shard = |d: &Path| d.join("rank-00001.safetensors");
    type Damage = fn(&Path);
    let cases: [(&str, Damage, &str); 7] = [
        (
            "flip",
            |p| {
                let mut b = std::fs::read(p).expect("read");
                let at = b.len() - 7;
                b[at] ^= 0x10;
                std::fs::write(p, b).expect("write");
            },
            "is corrupted: its SHA-256 does not match",
        ),
        (
            "truncate",
            |p| {
                let b = std::fs::read(p).expect("read");
                std::fs::write(p, &b[..b.len() / 2]).expect("write");
            },
            "is truncated",
        ),
        (
            "delete",
            |p| std::fs::remove_file(p).expect("rm"),
            "cannot read this checkpoint file",
        ),
        (
            "manifest",
            |p| {
                let m = p.with_file_name("manifest.json");
                let t = std::fs::read_to_string(&m).expect("read");
                std::fs::write(&m, &t[..t.len() / 2]).expect("write");
            },
            "is not a valid checkpoint manifest",
        ),
        (
            "manifest-listing",
            |p| {
                let m = p.with_file_name("manifest.json");
                let t = std::fs::read_to_string(&m).expect("read");
                let t = as_version_1(&t.replace("rank-00001", "../rank-00001"));
                std::fs::write(&m, t).expect("write");
            },
            "which is not a file name",
        ),
        (
            "manifest-dropped-file",
            |p| {
                let m = p.with_file_name("manifest.json");
                let t = std::fs::read_to_string(&m).expect("read");
                let mut v: serde_json::Value = serde_json::from_str(&t).expect("JSON");
                let files = v["files"].as_array_mut().expect("files");
                files.retain(|f| f["rank"] != 1);
                std::fs::write(&m, as_version_1(&v.to_string())).expect("write");
            },
            "are in no file",
        ),
        (
            "manifest-edited",
            |p| {
                let m = p.with_file_name("manifest.json");
                let t = std::fs::read_to_string(&m).expect("read");
                let mut v: serde_json::Value = serde_json::from_str(&t).expect("JSON");
                v["rng"]["seed"] = serde_json::json!(12345);
                std::fs::write(&m, serde_json::to_string_pretty(&v).unwrap()).expect("write");
            },
            "was changed after it was written",
        ),
    ];
    for (name, damage, says) in cases {
        let copy = dir.0.join(name);
        copy_dir(&good, &copy);
        damage(&shard(&copy));
        let mut stepped = false;
        let unit = dplc_frontend::parse("tiny.dpl", TINY).expect("parses");
        let lowered = unit.lower("gpt_tiny").expect("lowers");
        let mut spec = lowered.train;
        spec.seq = 16;
        spec.global_batch = 4;
        spec.optimizer = Opt::AdamW.optimizer();
        let data = Corpus::synthetic(5, 256, 1 << 14);
        let e = train(
            &lowered.graph,
            &spec,
            &resuming(&cfg, &copy),
            &data,
            4,
            SEED,
            |_| stepped = true,
        )
        .expect_err("refused");
        let msg = e.to_string();
        assert!(msg.contains(says), "{name}: {msg}");
        let file = if name.starts_with("manifest") {
            "manifest.json"
        } else {
            "rank-00001.safetensors"
        };
        assert!(
            msg.contains(&copy.join(file).display().to_string()),
            "{name} names the file: {msg}"
        );
        assert!(!stepped, "{name}: no step ran on a bad checkpoint");
    }
    // Another model, another optimizer, another seed: refused up front.
    let e = try_run("llama_tiny", &resuming(&cfg, &good), 4, Opt::AdamW).expect_err("refused");
    assert!(
        e.to_string().contains("was saved from another model"),
        "{e}"
    );
    let e = try_run("gpt_tiny", &resuming(&cfg, &good), 4, Opt::Sgd).expect_err("refused");
    assert!(e.to_string().contains("adamw optimizer"), "{e}");
    let e = try_run(
        "gpt_tiny",
        &resuming(&cfg, &dir.0.join("nowhere")),
        4,
        Opt::AdamW,
    )
    .expect_err("refused");
    assert!(e.to_string().contains("no such directory"), "{e}");
}

/// Stderr with miette's line wrapping undone.
fn flat(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr)
        .split_whitespace()
        .filter(|w| *w != "|")
        .collect::<Vec<_>>()
        .join(" ")
}

fn json_losses(out: &Output) -> Vec<(u64, f64)> {
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).expect("JSON lines"))
        .filter(|v| v.get("summary").is_none())
        .map(|v| {
            (
                v["step"].as_u64().expect("step"),
                v["loss"].as_f64().expect("loss"),
            )
        })
        .collect()
}

#[test]
fn dplc_run_saves_and_resumes() {
    let dir = Scratch::new("ckpt", "cli");
    let ck = dir.0.display().to_string();
    let with = |extra: &[&str]| {
        let mut a = vec!["run", "models/tiny.dpl", "--json"];
        a.extend(SMALL);
        a.extend(extra);
        dplc(&a)
    };
    let whole = json_losses(&with(&["--cluster", "2xcpu", "--steps", "4"]));
    let first = json_losses(&with(&[
        "--cluster",
        "2xcpu",
        "--steps",
        "2",
        "--checkpoint-dir",
        &ck,
        "--checkpoint-every",
        "1",
    ]));
    assert!(dir.0.join("step-000001/manifest.json").is_file());
    assert!(dir.0.join("step-000002/manifest.json").is_file());
    let second = json_losses(&with(&[
        "--cluster",
        "2xcpu",
        "--steps",
        "4",
        "--resume",
        &ck,
    ]));
    let mut joined = first.clone();
    joined.extend(second);
    assert_eq!(whole, joined, "same split: the same losses");
    // Another cluster reshards; the seed comes from the checkpoint.
    let out = dplc(&[
        "run",
        "models/tiny.dpl",
        "--model",
        "gpt_tiny",
        "--seq",
        "16",
        "--global-batch",
        "4",
        "--cluster",
        "4xcpu",
        "--steps",
        "3",
        "--resume",
        &format!("{ck}/step-000002"),
    ]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{err}");
    assert!(err.contains("resuming from"), "{err}");
    assert!(err.contains("at step 2"), "{err}");
    // Errors say what is wrong and with which file.
    let out = with(&["--cluster", "2xcpu", "--steps", "4", "--resume"]);
    assert!(!out.status.success());
    let err = flat(&out);
    assert!(err.contains("--resume needs a directory"), "{err}");
    let out = with(&["--cluster", "2xcpu", "--steps", "2", "--resume", &ck]);
    let err = flat(&out);
    assert!(
        !out.status.success() && err.contains("nothing left to train"),
        "{err}"
    );
    let missing = dir.0.join("missing").display().to_string();
    let out = with(&["--cluster", "2xcpu", "--steps", "4", "--resume", &missing]);
    let err = flat(&out);
    assert!(!out.status.success() && err.contains(&missing), "{err}");
    let out = dplc(&[
        "run",
        "models/tiny.dpl",
        "--model",
        "gpt_tiny",
        "--seq",
        "16",
        "--global-batch",
        "4",
        "--cluster",
        "2xcpu",
        "--steps",
        "4",
        "--seed",
        "4",
        "--resume",
        &ck,
    ]);
    let err = flat(&out);
    assert!(
        !out.status.success() && err.contains("was trained with seed 3"),
        "{err}"
    );
}

/// A directory a run saves into is that run's until it ends: a second run
/// is refused, naming the holder. The lock is the OS's, so it dies with a
/// crashed run, and the directory is free again once the first run ends.
#[test]
fn a_second_run_on_a_checkpoint_directory_is_refused() {
    let dir = Scratch::new("ckpt", "lock");
    let cfg = saving(&dp2_zero1(), &dir.0, 0);
    let (go, wait) = std::sync::mpsc::channel::<()>();
    std::thread::scope(|s| {
        let cfg = &cfg;
        let first = s.spawn(move || {
            let unit = dplc_frontend::parse("tiny.dpl", TINY).expect("parses");
            let lowered = unit.lower("gpt_tiny").expect("lowers");
            let mut spec = lowered.train;
            spec.seq = 16;
            spec.global_batch = cfg.global_batch() as u64;
            spec.optimizer = Opt::AdamW.optimizer();
            let data = Corpus::synthetic(5, 256, 1 << 14);
            let cfg = with_layout(&lowered.graph, cfg);
            // Hold the run (and its lock) at its first step until the
            // second run has been turned away.
            train(&lowered.graph, &spec, &cfg, &data, 2, SEED, |_| {
                let _ = wait.recv();
            })
        });
        // The first run holds the directory once its lock file names it.
        let lock = dir.0.join(".dplc-lock");
        while std::fs::read_to_string(&lock).map_or(true, |t| t.is_empty()) {
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
        let e = try_run("gpt_tiny", cfg, 2, Opt::AdamW).expect_err("refused");
        assert!(
            e.to_string()
                .contains("is being written by another run (run "),
            "{e}"
        );
        drop(go);
        first
            .join()
            .expect("joins")
            .expect("the first run ends well");
    });
    // Free again: a run continuing the first saves its next step there.
    run(&resuming(&cfg, &dir.0), 3, Opt::AdamW);
}

/// A run never saves over an earlier run's checkpoint: a fresh run whose
/// steps an earlier run already saved in the directory is refused before
/// it trains, naming the checkpoint, and the earlier run's files are
/// untouched; continuing that run, or another directory, is what it asks for.
#[test]
fn a_run_does_not_save_over_an_earlier_runs_checkpoint() {
    let dir = Scratch::new("ckpt", "over");
    let cfg = dp2_zero1();
    run(&saving(&cfg, &dir.0, 2), 4, Opt::AdamW);
    let manifest = dir.0.join("step-000002").join("manifest.json");
    let before = std::fs::read(&manifest).expect("step 2 saved");
    let e = try_run("gpt_tiny", &saving(&cfg, &dir.0, 0), 3, Opt::AdamW).expect_err("refused");
    assert!(
        e.to_string()
            .contains("step-000002, which this run would save over")
            && e.to_string().contains("--resume"),
        "{e}"
    );
    assert_eq!(std::fs::read(&manifest).expect("still there"), before);
    // Continuing the run saves its later steps beside the earlier ones.
    let more = run(&resuming(&saving(&cfg, &dir.0, 0), &dir.0), 6, Opt::AdamW);
    assert_eq!(more.checkpoints.len(), 1);
}

/// A reused directory: `--resume DIR` continues the latest run that saved
/// there, not an older run's later step, and says which run it is.
#[test]
fn resume_takes_the_latest_run_not_the_highest_step() {
    let dir = Scratch::new("ckpt", "runs");
    let cfg = dp2_zero1();
    run(&saving(&cfg, &dir.0, 0), 4, Opt::AdamW);
    // A new run from scratch in the same directory, stopped at step 2.
    let second = run(&saving(&cfg, &dir.0, 0), 2, Opt::AdamW);
    let ck = Checkpoint::open(&dir.0).expect("opens");
    assert_eq!(ck.step(), 2, "the second run's checkpoint, not step 4");
    assert_eq!(ck.dir(), second.checkpoints[0]);
    let first = Checkpoint::open(&dir.0.join("step-000004")).expect("opens");
    assert!(ck.run_id().is_some() && ck.run_id() != first.run_id());
}

/// Random edits of a manifest never panic and never pass unchecked: a
/// sealed (version 2) manifest refuses every edit; an unsealed version-1
/// one either is refused or resumes a run whose losses are numbers.
#[test]
fn mutated_manifests_never_panic_nor_pass_unchecked() {
    let dir = Scratch::new("ckpt", "mutate");
    let cfg = dp2_zero1();
    run(&saving(&cfg, &dir.0, 0), 2, Opt::AdamW);
    let good = dir.0.join("step-000002");
    let text = std::fs::read_to_string(good.join("manifest.json")).expect("manifest");
    let original: serde_json::Value = serde_json::from_str(&text).expect("JSON");
    let mut rng = 0x9e37_79b9_7f4a_7c15u64;
    let mut next = move |n: usize| {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        (rng % n as u64) as usize
    };
    let replacements = [
        serde_json::json!(0),
        serde_json::json!(-1),
        serde_json::json!(u64::MAX),
        serde_json::json!(1e300),
        serde_json::json!("x"),
        serde_json::Value::Null,
        serde_json::json!([]),
        serde_json::json!({}),
    ];
    for case in 0..48 {
        let sealed = case % 2 == 0;
        let mut v = original.clone();
        if !sealed {
            v = serde_json::from_str(&as_version_1(&v.to_string())).expect("JSON");
        }
        // Pick a leaf (or a field) along a random path and change it.
        let mut at = &mut v;
        loop {
            let keys: Vec<String> = match at {
                serde_json::Value::Object(m) => m.keys().cloned().collect(),
                serde_json::Value::Array(a) => (0..a.len()).map(|i| i.to_string()).collect(),
                _ => break,
            };
            if keys.is_empty() || next(4) == 0 {
                break;
            }
            let k = &keys[next(keys.len())];
            at = match at {
                serde_json::Value::Object(m) => m.get_mut(k).expect("a key"),
                serde_json::Value::Array(a) => &mut a[k.parse::<usize>().expect("an index")],
                _ => unreachable!("only containers are entered"),
            };
        }
        let new = replacements[next(replacements.len())].clone();
        if *at == new {
            continue;
        }
        *at = new;
        let copy = dir.0.join(format!("case-{case}"));
        copy_dir(&good, &copy);
        std::fs::write(copy.join("manifest.json"), v.to_string()).expect("write");
        let resumed =
            std::panic::catch_unwind(|| try_run("gpt_tiny", &resuming(&cfg, &copy), 3, Opt::AdamW))
                .unwrap_or_else(|_| panic!("case {case} panicked: {v}"));
        match resumed {
            Err(_) => {}
            Ok(r) => {
                assert!(
                    !sealed,
                    "case {case}: an edited sealed manifest resumed: {v}"
                );
                assert!(r.steps.iter().all(|s| s.loss.is_finite()), "case {case}");
            }
        }
    }
}
