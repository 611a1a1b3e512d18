//! Bad input from a careful user or a script: dplc never destroys a file,
//! hangs, panics or passes for success. Output paths follow one rule
//! (`src/output.rs`), runs stop on non-finite numbers and on SIGTERM/SIGHUP
//! as on Ctrl-C, and a standard output that cannot be written is an error.

use std::path::{Path, PathBuf};

mod common;
use common::Scratch;
use std::process::{Command, Output, Stdio};

fn dplc() -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_dplc"));
    c.current_dir(env!("CARGO_MANIFEST_DIR"))
        .env("NO_COLOR", "1");
    c
}

/// Both streams, with miette's wrapped lines joined again.
fn text(out: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
    .replace("\n  | ", " ")
}

/// `dplc ARGS`, which must be refused (exit 1): what it said.
fn refused(args: &[&str]) -> String {
    let o = dplc().args(args).output().expect("dplc runs");
    assert_eq!(o.status.code(), Some(1), "{args:?}: {}", text(&o));
    text(&o)
}

const TINY: [&str; 9] = [
    "--model",
    "gpt_tiny",
    "--cluster",
    "2xcpu",
    "--seq",
    "16",
    "--global-batch",
    "4",
    "--strategy=dp=2",
];

fn compile_to(model: &Path, out: &Path) -> Output {
    dplc()
        .arg("compile")
        .arg(model)
        .args(TINY)
        .arg("-o")
        .arg(out)
        .output()
        .expect("dplc runs")
}

#[test]
fn an_output_never_replaces_an_input_a_device_or_a_link() {
    let d = Scratch::new("abuse", "outputs");
    let model = d.0.join("tiny.dpl");
    std::fs::copy("models/tiny.dpl", &model).expect("copy");
    let before = std::fs::read(&model).unwrap();
    // -o the input itself, and under another name.
    for out in [model.clone(), d.0.join(".").join("tiny.dpl")] {
        let o = compile_to(&model, &out);
        assert_eq!(o.status.code(), Some(1), "{}", text(&o));
        assert!(
            text(&o).contains("is an input of this command"),
            "{}",
            text(&o)
        );
    }
    assert_eq!(
        std::fs::read(&model).unwrap(),
        before,
        "the model is intact"
    );
    #[cfg(unix)]
    {
        // A link is followed; a link to the input is the input.
        let link = d.0.join("plan-link.ron");
        std::os::unix::fs::symlink(&model, &link).unwrap();
        let o = compile_to(&model, &link);
        assert_eq!(o.status.code(), Some(1), "{}", text(&o));
        assert_eq!(std::fs::read(&model).unwrap(), before);
        let real = d.0.join("real.ron");
        let link = d.0.join("to-real.ron");
        std::os::unix::fs::symlink(&real, &link).unwrap();
        let o = compile_to(&model, &link);
        assert!(o.status.success(), "{}", text(&o));
        assert!(std::fs::symlink_metadata(&link)
            .unwrap()
            .file_type()
            .is_symlink());
        assert!(std::fs::read_to_string(&real).unwrap().contains("mesh"));
        // A device is written in place, never turned into a file.
        let o = compile_to(&model, Path::new("/dev/null"));
        assert!(o.status.success(), "{}", text(&o));
        assert!(!std::fs::metadata("/dev/null").unwrap().is_file());
    }
    // A directory is refused.
    let o = compile_to(&model, &d.0);
    assert_eq!(o.status.code(), Some(1), "{}", text(&o));
    assert!(text(&o).contains("is a directory"), "{}", text(&o));
}

#[test]
fn build_writes_only_into_a_new_empty_or_artifact_directory() {
    let d = Scratch::new("abuse", "build");
    let busy = d.0.join("busy");
    std::fs::create_dir_all(&busy).unwrap();
    std::fs::write(busy.join("notes.txt"), "mine").unwrap();
    // Someone else's manifest.json does not make a directory an artifact.
    let webapp = d.0.join("webapp");
    std::fs::create_dir_all(&webapp).unwrap();
    std::fs::write(webapp.join("manifest.json"), r#"{"name": "my pwa"}"#).unwrap();
    std::fs::write(webapp.join("RUN.md"), "notes").unwrap();
    let build = |out: &Path| {
        dplc()
            .args(["build", "models/tiny.dpl"])
            .args(TINY)
            .arg("-o")
            .arg(out)
            .output()
            .expect("dplc runs")
    };
    for out in [
        busy.as_path(),
        webapp.as_path(),
        Path::new("/"),
        Path::new("models"),
    ] {
        let o = build(out);
        assert_eq!(o.status.code(), Some(1), "{}: {}", out.display(), text(&o));
        assert!(text(&o).contains("is not a dplc artifact"), "{}", text(&o));
    }
    assert_eq!(std::fs::read_dir(&busy).unwrap().count(), 1);
    assert_eq!(std::fs::read_dir(&webapp).unwrap().count(), 2);
    assert_eq!(
        std::fs::read_to_string(webapp.join("RUN.md")).unwrap(),
        "notes"
    );
    let art = d.0.join("art");
    let o = build(&art);
    assert!(o.status.success(), "{}", text(&o));
    // An artifact is rebuilt in place.
    let o = build(&art);
    assert!(o.status.success(), "{}", text(&o));
    // A launch writes nothing into its artifact: no trace over its plan or
    // executable, no checkpoints among its files.
    let plan = std::fs::read(art.join("plan.ron")).unwrap();
    for (flag, path) in [
        ("--trace", art.join("plan.ron")),
        ("--trace", art.join("dplc")),
        ("--checkpoint-dir", art.clone()),
        ("--checkpoint-dir", art.join("ck")),
    ] {
        let o = Command::new(art.join("dplc"))
            .arg("launch")
            .arg(&art)
            .args(["--steps", "1", flag])
            .arg(&path)
            .output()
            .expect("runs");
        assert_eq!(
            o.status.code(),
            Some(1),
            "{flag} {}: {}",
            path.display(),
            text(&o)
        );
        assert!(text(&o).contains("is inside the artifact"), "{}", text(&o));
    }
    assert_eq!(std::fs::read(art.join("plan.ron")).unwrap(), plan);
    assert!(!art.join("ck").exists());
    // A rewritten manifest that lists another world is refused by launch.
    let m = art.join("manifest.json");
    let t = std::fs::read_to_string(&m).unwrap();
    std::fs::write(&m, t.replace("\"world_size\": 2", "\"world_size\": 4")).unwrap();
    let o = Command::new(art.join("dplc"))
        .arg("launch")
        .arg(&art)
        .args(["--steps", "1"])
        .output()
        .expect("runs");
    assert_eq!(o.status.code(), Some(1), "{}", text(&o));
    assert!(
        text(&o).contains("the manifest's world size is 4, but plan.ron's is 2"),
        "{}",
        text(&o)
    );
}

fn run_tiny(extra: &[&str], env: &[(&str, &str)]) -> Output {
    dplc()
        .args(["run", "models/tiny.dpl"])
        .args(TINY)
        .args(extra)
        .envs(env.iter().copied())
        .output()
        .expect("dplc runs")
}

#[test]
fn numbers_and_faults_a_run_cannot_use_are_refused() {
    for (extra, env, says) in [
        (
            &["--timeout", "1e30"][..],
            &[][..],
            "--timeout must be a positive number of seconds, at most 86400",
        ),
        (&["--timeout", "nan"], &[], "--timeout must be a positive"),
        (
            &["--steps", "3"],
            &[("DPLC_FAULT", "kill:7:1")],
            "fault names rank 7, but the run has ranks 0 to 1",
        ),
        (
            &["--steps", "3"],
            &[("DPLC_FAULT", "stall:1:9")],
            "at step 9, but the run has steps 0 to 2",
        ),
    ] {
        let o = run_tiny(extra, env);
        assert_eq!(o.status.code(), Some(1), "{extra:?}: {}", text(&o));
        assert!(text(&o).contains(says), "{extra:?}: {}", text(&o));
    }
}

#[test]
fn a_non_finite_loss_ends_the_run_with_an_error_naming_the_step() {
    let o = run_tiny(&["--steps", "4"], &[("DPLC_FAULT", "nan:0:2")]);
    assert_eq!(o.status.code(), Some(1), "{}", text(&o));
    assert!(text(&o).contains("step 2: the loss is"), "{}", text(&o));
    let o = run_tiny(
        &["--steps", "4", "--json", "--skip-nonfinite", "1"],
        &[("DPLC_FAULT", "nan:0:2")],
    );
    assert!(o.status.success(), "{}", text(&o));
    assert!(text(&o).contains("\"skipped\":true"), "{}", text(&o));
}

#[cfg(unix)]
#[test]
fn sigterm_and_sighup_stop_at_a_step_boundary_and_save() {
    for sig in ["TERM", "HUP"] {
        let d = Scratch::new("abuse", &format!("sig{sig}"));
        let mut child = dplc()
            .args(["run", "models/tiny.dpl"])
            .args(TINY)
            .args(["--steps", "100000", "--json", "--checkpoint-dir"])
            .arg(&d.0)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("dplc runs");
        // Wait for the first step line, then signal.
        let mut out = child.stdout.take().expect("stdout");
        let mut first = [0u8; 1];
        std::io::Read::read_exact(&mut out, &mut first).expect("a first step");
        let killed = Command::new("kill")
            .args([&format!("-{sig}"), &child.id().to_string()])
            .status()
            .expect("kill runs");
        assert!(killed.success());
        let mut rest = Vec::new();
        std::io::Read::read_to_end(&mut out, &mut rest).expect("the rest");
        let o = child.wait_with_output().expect("ends");
        let err = String::from_utf8_lossy(&o.stderr);
        assert_eq!(o.status.code(), Some(1), "SIG{sig}: {err}");
        assert!(
            err.contains("interrupted: stopped cleanly"),
            "SIG{sig}: {err}"
        );
        // Under --json the error closes standard output as a JSON object.
        let last = String::from_utf8_lossy(&rest)
            .lines()
            .last()
            .unwrap_or_default()
            .to_string();
        let v: serde_json::Value = serde_json::from_str(&last).expect("a JSON error line");
        assert!(v["error"]["message"]
            .as_str()
            .is_some_and(|m| m.contains("interrupted: stopped cleanly")));
        let saved = std::fs::read_dir(&d.0)
            .unwrap()
            .filter_map(|e| e.ok())
            .any(|e| e.path().join("manifest.json").is_file());
        assert!(saved, "SIG{sig}: a checkpoint was saved");
        let tmp = walk(&d.0)
            .into_iter()
            .any(|p| p.to_string_lossy().ends_with(".tmp"));
        assert!(!tmp, "SIG{sig}: no temporary files are left");
    }
}

fn walk(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    for e in std::fs::read_dir(dir).into_iter().flatten().flatten() {
        let p = e.path();
        if p.is_dir() {
            out.extend(walk(&p));
        }
        out.push(p);
    }
    out
}

#[cfg(target_os = "linux")]
#[test]
fn a_full_standard_output_is_an_error_not_a_panic() {
    let d = Scratch::new("abuse", "full");
    let plan = d.0.join("plan.ron");
    let o = compile_to(Path::new("models/tiny.dpl"), &plan);
    assert!(o.status.success(), "{}", text(&o));
    let plan = plan.to_str().expect("a UTF-8 path");
    let commands: [&[&str]; 5] = [
        &[
            "compile",
            "models/tiny.dpl",
            "--model",
            "gpt_tiny",
            "--cluster",
            "2xcpu",
        ],
        &["inspect", "models/tiny.dpl", "--model", "gpt_tiny"],
        &["explain", plan],
        &["viz", plan, "--format", "trace"],
        &["check", "models/tiny.dpl"],
    ];
    for args in commands {
        let full = std::fs::OpenOptions::new()
            .write(true)
            .open("/dev/full")
            .expect("/dev/full");
        let o = dplc().args(args).stdout(full).output().expect("dplc runs");
        let err = String::from_utf8_lossy(&o.stderr);
        assert_eq!(o.status.code(), Some(1), "{args:?}: {err}");
        assert!(
            err.contains("cannot write to standard output"),
            "{args:?}: {err}"
        );
        assert!(!err.contains("panicked"), "{args:?}: {err}");
    }
}

#[test]
fn a_file_that_is_not_utf8_is_named_with_the_byte() {
    let d = Scratch::new("abuse", "utf8");
    let f = d.0.join("bad.dpl");
    std::fs::write(&f, b"model a() {}\n  \xff\n").unwrap();
    let o = dplc().arg("check").arg(&f).output().expect("dplc runs");
    assert_eq!(o.status.code(), Some(1), "{}", text(&o));
    assert!(
        text(&o).contains("bad.dpl:2:3: byte 0xff is not UTF-8 text"),
        "{}",
        text(&o)
    );
}

/// `verify` of a wide model on a large mesh would hold a copy per rank
/// thread: it is refused up front with the size, not killed after minutes.
#[test]
fn verify_refuses_a_reduced_run_this_machine_cannot_hold() {
    let d = Scratch::new("abuse", "verify-mem");
    let plan = d.0.join("gpt2.ron");
    let o = dplc()
        .args(["compile", "models/gpt2.dpl", "--model", "gpt2"])
        .args(["--cluster", "64x8xA100", "-o"])
        .arg(&plan)
        .output()
        .expect("dplc runs");
    assert!(o.status.success(), "{}", text(&o));
    let started = std::time::Instant::now();
    let o = dplc().arg("verify").arg(&plan).output().expect("dplc runs");
    assert_eq!(o.status.code(), Some(1), "{}", text(&o));
    assert!(text(&o).contains("verify would hold about"), "{}", text(&o));
    assert!(started.elapsed() < std::time::Duration::from_secs(20));
}

/// A dimension nothing gives a value (a T5's `src`) is an error naming it,
/// never silently 1.
#[test]
fn an_unbound_dimension_is_named_not_taken_as_one() {
    let d = Scratch::new("abuse", "dims");
    let f = d.0.join("t5ish.dpl");
    std::fs::write(
        &f,
        "model t5ish(vocab = 64, d = 16) {\n  input tokens: i32[batch, src]\n  input targets: i32[batch, src]\n  param emb: [vocab, d]\n  x = embedding(emb, tokens)\n  return mean(x)\n}\n",
    )
    .unwrap();
    for cmd in [&["inspect"][..], &["compile", "--cluster", "2xcpu"]] {
        let o = dplc()
            .arg(cmd[0])
            .arg(&f)
            .args(&cmd[1..])
            .output()
            .expect("dplc runs");
        assert_eq!(o.status.code(), Some(1), "{cmd:?}: {}", text(&o));
        assert!(
            text(&o).contains("the dimension `src` has no value"),
            "{cmd:?}: {}",
            text(&o)
        );
    }
}

/// A reader that goes away (`dplc run --json | head -1`) stops the run at
/// the next step boundary, quietly, with a non-zero exit.
#[cfg(unix)]
#[test]
fn a_closed_pipe_stops_a_run_quietly() {
    let mut child = dplc()
        .args(["run", "models/tiny.dpl"])
        .args(TINY)
        .args(["--steps", "100000", "--json"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("dplc runs");
    let mut out = child.stdout.take().expect("stdout");
    let mut first = [0u8; 1];
    std::io::Read::read_exact(&mut out, &mut first).expect("a first step");
    drop(out);
    let o = child.wait_with_output().expect("ends");
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(1), "{err}");
    assert!(
        !err.contains("panicked") && !err.contains("standard output"),
        "{err}"
    );
}

/// An output a run writes at its end is checked before it trains.
#[test]
fn a_run_refuses_its_trace_path_before_training() {
    let d = Scratch::new("abuse", "trace-dir");
    let o = run_tiny(&["--steps", "3", "--trace", d.0.to_str().unwrap()], &[]);
    assert_eq!(o.status.code(), Some(1), "{}", text(&o));
    assert!(text(&o).contains("is a directory"), "{}", text(&o));
    assert!(!text(&o).contains("steps in"), "no step ran: {}", text(&o));
}

/// A pinned mesh that leaves one free degree an impossible share of the
/// devices names that degree, not the global batch.
#[test]
fn an_impossible_mesh_is_blamed_on_the_mesh() {
    let o = dplc()
        .args(["compile", "models/tiny.dpl", "--model", "gpt_tiny"])
        .args(["--cluster", "8xcpu", "--strategy", "dp=1,tp=1,pp=1"])
        .output()
        .expect("dplc runs");
    assert_eq!(o.status.code(), Some(1), "{}", text(&o));
    assert!(
        text(&o).contains("dp 1 × tp 1 × pp 1 leave cp=8 to fill the cluster"),
        "{}",
        text(&o)
    );
    assert!(!text(&o).contains("global batch"), "{}", text(&o));
}

/// A pinned ZeRO stage whose split leaves no data-parallel ranks to shard
/// over says so, not that the global batch may be at fault.
#[test]
fn zero_without_data_parallel_ranks_is_named() {
    let o = dplc()
        .args(["compile", "models/tiny.dpl", "--model", "gpt_tiny"])
        .args(["--cluster", "4xcpu", "--strategy", "tp=2,pp=2,zero=1"])
        .output()
        .expect("dplc runs");
    assert_eq!(o.status.code(), Some(1), "{}", text(&o));
    assert!(
        text(&o).contains("zero=1 shards state over the data-parallel ranks"),
        "{}",
        text(&o)
    );
    assert!(!text(&o).contains("global batch"), "{}", text(&o));
}

/// `--cluster NAME` found in `clusters/` beside the model is an input like
/// any other: `compile -o` refuses to write the plan over it.
#[test]
fn a_zoo_cluster_file_is_an_input() {
    let d = Scratch::new("abuse", "zoo-cluster");
    let zoo = d.0.join("zoo");
    std::fs::create_dir_all(zoo.join("clusters")).unwrap();
    std::fs::copy("models/tiny.dpl", zoo.join("tiny.dpl")).unwrap();
    let cluster = zoo.join("clusters").join("cpu_4.dpl");
    std::fs::copy("models/clusters/cpu_4.dpl", &cluster).unwrap();
    let before = std::fs::read(&cluster).unwrap();
    let o = dplc()
        .arg("compile")
        .arg(zoo.join("tiny.dpl"))
        .args(["--model", "gpt_tiny", "--cluster", "cpu_4", "-o"])
        .arg(&cluster)
        .output()
        .expect("dplc runs");
    assert_eq!(o.status.code(), Some(1), "{}", text(&o));
    assert!(
        text(&o).contains("is an input of this command"),
        "{}",
        text(&o)
    );
    assert_eq!(std::fs::read(&cluster).unwrap(), before);
}

/// An input that never ends (`/dev/zero`) is refused after a bounded read,
/// never read until memory runs out: the text inputs at 64 MiB, data files
/// unless they are regular files.
#[cfg(unix)]
#[test]
fn an_endless_input_is_refused_after_a_bounded_read() {
    for args in [
        vec!["check", "/dev/zero"],
        vec!["verify", "/dev/zero"],
        vec!["import", "hf", "/dev/zero"],
    ] {
        let said = refused(&args);
        assert!(said.contains("holds more than 64 MiB"), "{args:?}: {said}");
    }
    let said = refused(&[
        "run",
        "models/tiny.dpl",
        "--model",
        "gpt_tiny",
        "--cluster",
        "1xcpu",
        "--steps",
        "1",
        "--data",
        "/dev/zero",
    ]);
    assert!(said.contains("is not a regular file"), "{said}");
}

/// Expert groups live inside the data-parallel ranks: pinned degrees that
/// leave too few of them for `ep` say so, not that a layout failed.
#[test]
fn expert_groups_beyond_the_data_parallel_ranks_are_named() {
    let said = refused(&[
        "compile",
        "models/qwen3.dpl",
        "--model",
        "qwen3_30b_a3b",
        "--cluster",
        "4x8xH100",
        "--strategy",
        "ep=32,tp=2",
    ]);
    assert!(
        said.contains("ep=32 needs its expert groups inside the data-parallel ranks")
            && said.contains("at most 16 of the 32 devices"),
        "{said}"
    );
}

/// A model whose plans fit the device only by offloading more than the
/// host holds is refused naming host memory, not the device's.
#[test]
fn an_offload_the_host_cannot_hold_names_host_memory() {
    let said = refused(&[
        "compile",
        "models/llama3.dpl",
        "--model",
        "llama3_70b",
        "--cluster",
        "8xA100",
        "--strategy",
        "offload=optimizer+params+activations",
    ]);
    assert!(
        said.contains("offload more than the host holds")
            && said.contains("a rank's share of the host is 128.00 GiB"),
        "{said}"
    );
}

/// Options that would be silently ignored are refused: a `--seq` for a
/// model without a sequence axis, a chunked overlap of tensor-parallel
/// communication at tp=1, DeepEP's dispatch at ep=1.
#[test]
fn options_with_nothing_to_act_on_are_refused() {
    let compile = |file: &'static str, model: &'static str, cluster: &'static str| {
        vec!["compile", file, "--model", model, "--cluster", cluster]
    };
    for (mut args, extra, says) in [
        (
            compile("models/vit.dpl", "vit_tiny", "1xcpu"),
            ["--seq", "16"],
            "has no sequence axis",
        ),
        (
            compile("models/tiny.dpl", "gpt_tiny", "2xcpu"),
            ["--strategy", "tp=1,tp_overlap=ring"],
            "tp=1 has none",
        ),
        (
            compile("models/mixtral.dpl", "mixtral_8x7b", "8xH100"),
            ["--strategy", "ep=1,dispatch=hierarchical"],
            "ep=1 has none",
        ),
    ] {
        args.extend(extra);
        let said = refused(&args);
        assert!(said.contains(says), "{args:?}: {said}");
    }
}

/// With nothing pinned, a cluster no split of the model and batch can fill
/// says what bounds the split, not that an empty pin list failed.
#[test]
fn a_cluster_no_split_fills_says_why() {
    let said = refused(&[
        "compile",
        "models/tiny.dpl",
        "--model",
        "gpt_tiny",
        "--cluster",
        "1048576xcpu",
    ]);
    assert!(
        said.contains("no split of this model and batch fills 1048576 devices")
            && !said.contains("``"),
        "{said}"
    );
}
