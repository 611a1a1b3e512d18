//! `dplc build` and `dplc launch` end to end: the artifact's files and
//! manifest, a launch that trains exactly as `dplc run` does, corrupted files
//! and mismatched worlds refused, GPU artifacts with their PTX, and GPU runs
//! on a machine without a driver stopping with a clear error.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn dplc_at(exe: &Path, args: &[&str], env: &[(&str, &str)]) -> Output {
    let mut cmd = Command::new(exe);
    cmd.args(args)
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .env("NO_COLOR", "1");
    for var in ["RANK", "WORLD_SIZE", "SLURM_PROCID", "OMPI_COMM_WORLD_RANK"] {
        cmd.env_remove(var);
    }
    for (k, v) in env {
        cmd.env(k, v);
    }
    cmd.output().expect("dplc runs")
}

fn dplc(args: &[&str]) -> Output {
    dplc_at(Path::new(env!("CARGO_BIN_EXE_dplc")), args, &[])
}

fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

fn tmp(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("dplc-build-cli-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    dir.join(name)
}

const CPU_PLAN: [&str; 12] = [
    "models/tiny.dpl",
    "--model",
    "gpt_tiny",
    "--cluster",
    "4xcpu",
    "--strategy",
    "dp=2,pp=2,mb=1",
    "--seq",
    "16",
    "--global-batch",
    "4",
    "--seed",
];

/// `dplc build` of gpt_tiny for 8 A100s, up to the output directory.
const GPU_BUILD: [&str; 7] = [
    "build",
    "models/tiny.dpl",
    "--model",
    "gpt_tiny",
    "--cluster",
    "8xA100",
    "-o",
];

fn build_cpu(name: &str) -> PathBuf {
    let dir = tmp(name);
    let mut args = vec!["build"];
    args.extend(&CPU_PLAN[..11]);
    args.extend(["-o", dir.to_str().unwrap()]);
    let out = dplc(&args);
    assert!(out.status.success(), "{}", stderr(&out));
    dir
}

fn losses(stdout: &[u8]) -> Vec<f64> {
    String::from_utf8_lossy(stdout)
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter_map(|v| v["loss"].as_f64())
        .collect()
}

#[test]
fn a_built_cpu_artifact_trains_exactly_as_dplc_run() {
    let dir = build_cpu("cpu");
    for f in ["dplc", "plan.ron", "manifest.json", "RUN.md"] {
        assert!(dir.join(f).is_file(), "{f} is written");
    }
    let manifest: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("manifest.json")).unwrap()).unwrap();
    assert_eq!(manifest["world_size"], 4);
    assert_eq!(manifest["backend"], "cpu");
    let run_md = std::fs::read_to_string(dir.join("RUN.md")).unwrap();
    assert!(run_md.contains("dplc launch"), "{run_md}");

    let d = dir.to_str().unwrap();
    let launched = dplc_at(
        &dir.join("dplc"),
        &["launch", d, "--steps", "3", "--seed", "3", "--json"],
        &[],
    );
    assert!(launched.status.success(), "{}", stderr(&launched));
    let mut args = vec!["run"];
    args.extend(CPU_PLAN);
    args.extend(["3", "--steps", "3", "--json"]);
    let ran = dplc(&args);
    assert!(ran.status.success(), "{}", stderr(&ran));
    let (a, b) = (losses(&launched.stdout), losses(&ran.stdout));
    assert_eq!(a.len(), 3);
    assert_eq!(a, b, "the artifact trains bit for bit as `dplc run`");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn corrupted_or_missing_files_and_other_worlds_are_refused() {
    let dir = build_cpu("refuse");
    let d = dir.to_str().unwrap();
    // Another world than the plan's: one process (threads) or one per rank.
    let out = dplc(&["launch", d, "--steps", "1"]);
    assert!(out.status.success(), "{}", stderr(&out));
    let out = dplc_at(
        Path::new(env!("CARGO_BIN_EXE_dplc")),
        &["launch", d, "--steps", "1"],
        &[
            ("RANK", "0"),
            ("WORLD_SIZE", "3"),
            ("MASTER_ADDR", "127.0.0.1"),
        ],
    );
    assert_eq!(out.status.code(), Some(1));
    assert!(
        stderr(&out).contains("the launcher started 3 processes"),
        "{}",
        stderr(&out)
    );
    // One byte of the plan changed.
    let plan = dir.join("plan.ron");
    let mut bytes = std::fs::read(&plan).unwrap();
    let at = bytes.len() / 2;
    bytes[at] ^= 0x20;
    std::fs::write(&plan, &bytes).unwrap();
    let out = dplc(&["launch", d, "--steps", "1"]);
    assert_eq!(out.status.code(), Some(1));
    let err = stderr(&out);
    assert!(err.contains("plan.ron is corrupted"), "{err}");
    // A missing file.
    std::fs::remove_file(&plan).unwrap();
    let err = stderr(&dplc(&["launch", d, "--steps", "1"]));
    assert!(err.contains("plan.ron is missing"), "{err}");
    // Not an artifact at all.
    let err = stderr(&dplc(&["launch", "models", "--steps", "1"]));
    assert!(err.contains("manifest.json"), "{err}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn gpu_artifacts_carry_their_kernels_and_refuse_other_worlds() {
    let dir = tmp("gpu");
    let d = dir.to_str().unwrap();
    let out = dplc(&[&GPU_BUILD[..], &[d]].concat());
    if !out.status.success() {
        let err = stderr(&out);
        assert!(err.contains("needs NVRTC"), "{err}");
        println!(
            "skipped the PTX part: no NVRTC (scripts/install-nvrtc.sh installs it; CI runs it)"
        );
        if std::env::var_os("CI").is_some() {
            panic!("CI must build GPU artifacts: scripts/test.sh installs NVRTC");
        }
        return;
    }
    let manifest: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("manifest.json")).unwrap()).unwrap();
    assert_eq!(manifest["world_size"], 8);
    let ptx: Vec<&str> = manifest["files"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|f| f["path"].as_str())
        .filter(|p| p.starts_with("kernels/") && p.ends_with(".ptx"))
        .collect();
    assert!(!ptx.is_empty());
    let first = std::fs::read_to_string(dir.join(ptx[0])).unwrap();
    assert!(
        first.contains(".target sm_80"),
        "{}",
        &first[..200.min(first.len())]
    );
    let run_md = std::fs::read_to_string(dir.join("RUN.md")).unwrap();
    for launcher in ["torchrun", "srun", "mpirun"] {
        assert!(run_md.contains(launcher), "{run_md}");
    }
    for (world, want) in [
        ("2", "but the launcher started 2"),
        ("1", "but the launcher started 1"),
    ] {
        let out = dplc_at(
            Path::new(env!("CARGO_BIN_EXE_dplc")),
            &["launch", d],
            &[
                ("RANK", "0"),
                ("WORLD_SIZE", world),
                ("MASTER_ADDR", "127.0.0.1"),
            ],
        );
        assert_eq!(out.status.code(), Some(1));
        assert!(stderr(&out).contains(want), "{}", stderr(&out));
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// A stack the runtime does not run is refused before anything is written.
#[test]
fn a_stack_the_runtime_does_not_run_is_refused_and_writes_nothing() {
    // Half-precision main gradients are priced and exported, not run.
    let dir = tmp("grad-reduce");
    let out = dplc(&[
        "build",
        "models/tiny.dpl",
        "--model",
        "gpt_tiny",
        "--cluster",
        "4xcpu",
        "--strategy",
        "dp=4,grad_reduce=bf16",
        "-o",
        dir.to_str().unwrap(),
    ]);
    assert_eq!(out.status.code(), Some(1));
    let err = stderr(&out);
    assert!(err.contains("drop grad_reduce from --strategy"), "{err}");
    assert!(!dir.exists(), "a refused build created {}", dir.display());
}

/// A GPU build that cannot make its kernels stops before it writes: no
/// half-written directory is left (which a second build would refuse to
/// write into), and an earlier artifact in the directory stays whole.
#[test]
fn a_failed_gpu_build_writes_nothing() {
    let no_nvrtc = [("DPLC_NVRTC_LIB", "/nonexistent/libnvrtc.so.12")];
    let gpu_build = |dir: &Path| {
        dplc_at(
            Path::new(env!("CARGO_BIN_EXE_dplc")),
            &[&GPU_BUILD[..], &[dir.to_str().unwrap()]].concat(),
            &no_nvrtc,
        )
    };
    let fresh = tmp("failed-gpu");
    let out = gpu_build(&fresh);
    assert_eq!(out.status.code(), Some(1));
    assert!(stderr(&out).contains("needs NVRTC"), "{}", stderr(&out));
    assert!(
        !fresh.exists(),
        "a failed build created {}",
        fresh.display()
    );
    // Over an earlier (CPU) artifact: refused the same way, the artifact
    // still launches.
    let earlier = build_cpu("failed-gpu-over-cpu");
    let out = gpu_build(&earlier);
    assert_eq!(out.status.code(), Some(1));
    assert!(earlier.join("manifest.json").is_file());
    let out = dplc(&["launch", earlier.to_str().unwrap(), "--steps", "1"]);
    assert!(out.status.success(), "{}", stderr(&out));
    let _ = std::fs::remove_dir_all(&earlier);
}

#[test]
fn gpu_runs_without_a_driver_say_so() {
    if dplc_runtime::gpu::driver_present() {
        println!("skipped: this machine has a CUDA driver");
        return;
    }
    let out = dplc(&[
        "run",
        "models/tiny.dpl",
        "--model",
        "gpt_tiny",
        "--cluster",
        "1xH100",
        "--steps",
        "1",
    ]);
    assert_eq!(out.status.code(), Some(1));
    assert!(
        stderr(&out).contains("no CUDA driver found"),
        "{}",
        stderr(&out)
    );
}
