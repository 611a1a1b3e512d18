//! CPU ranks in separate processes: a built artifact launched under mpirun as
//! one process per rank trains bit for bit as the same artifact's threads
//! (pipelines, tensor parallelism, parameter servers, async updates and
//! compressed gradients), and
//! a rank whose process dies or hangs ends the job, named with its step,
//! within the timeout. Without the `mpi` feature, a launch says so.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn tmp(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("dplc-mpi-launch-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    dir.join(name)
}

fn text(out: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

/// A 4-rank gpt_tiny artifact for `strategy`.
fn build(name: &str, strategy: &str) -> PathBuf {
    let dir = tmp(name);
    let out = Command::new(env!("CARGO_BIN_EXE_dplc"))
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .args(["build", "models/tiny.dpl", "--model", "gpt_tiny"])
        .args(["--cluster", "4xcpu", "--strategy", strategy])
        .args(["--seq", "16", "--global-batch", "4", "-o"])
        .arg(&dir)
        .output()
        .expect("dplc runs");
    assert!(out.status.success(), "{}", text(&out));
    dir
}

/// `DIR/dplc launch DIR ARGS`, without any launcher's variables.
fn launch(dir: &Path, args: &[&str], env: &[(&str, &str)]) -> Output {
    let mut cmd = Command::new(dir.join("dplc"));
    cmd.arg("launch").arg(dir).args(args).env("NO_COLOR", "1");
    for var in ["RANK", "WORLD_SIZE", "SLURM_PROCID", "OMPI_COMM_WORLD_RANK"] {
        cmd.env_remove(var);
    }
    cmd.envs(env.iter().copied());
    cmd.output().expect("dplc runs")
}

#[cfg(not(feature = "mpi"))]
#[test]
fn without_mpi_a_launch_of_several_processes_says_so() {
    let dir = build("no-mpi", "dp=2,pp=2,mb=1");
    let env = [("OMPI_COMM_WORLD_RANK", "0"), ("OMPI_COMM_WORLD_SIZE", "4")];
    let out = launch(&dir, &["--steps", "1"], &env);
    assert_eq!(out.status.code(), Some(1), "{}", text(&out));
    assert!(text(&out).contains("built without MPI"), "{}", text(&out));
    let _ = std::fs::remove_dir_all(&dir);
}

#[cfg(feature = "mpi")]
mod with_mpi {
    use super::*;
    use std::time::{Duration, Instant};

    fn losses(stdout: &[u8]) -> Vec<f64> {
        String::from_utf8_lossy(stdout)
            .lines()
            .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
            .filter_map(|v| v["loss"].as_f64())
            .collect()
    }

    /// Whether mpirun can be used; CI must have it (scripts/install-mpi.sh).
    fn mpirun_present() -> bool {
        let found = Command::new("mpirun").arg("--version").output().is_ok();
        if !found {
            assert!(
                std::env::var_os("CI").is_none(),
                "mpirun is missing; scripts/install-mpi.sh installs it"
            );
            eprintln!("SKIPPED: mpirun is not installed (scripts/install-mpi.sh) and CI is unset");
        }
        found
    }

    /// `mpirun` (as root, oversubscribed) under `timeout`: killed after
    /// `seconds` whatever happens, so a hang fails the test instead of
    /// stalling CI.
    fn mpirun_within(seconds: u64) -> Command {
        let mut cmd = Command::new("timeout");
        cmd.args(["-k", "5", &seconds.to_string(), "mpirun"])
            .args(["--allow-run-as-root", "--oversubscribe"]);
        cmd
    }

    /// `mpirun -np 4 DIR/dplc launch DIR ARGS`, killed after two minutes
    /// whatever happens, so a hang fails the test instead of stalling CI.
    fn mpirun(dir: &Path, args: &[&str], env: &[(&str, &str)]) -> Output {
        let mut cmd = mpirun_within(120);
        cmd.args(["-np", "4"])
            .arg(dir.join("dplc"))
            .arg("launch")
            .arg(dir)
            .args(args)
            .env("NO_COLOR", "1");
        for var in ["RANK", "WORLD_SIZE", "SLURM_PROCID"] {
            cmd.env_remove(var);
        }
        cmd.envs(env.iter().copied());
        cmd.output().expect("timeout and mpirun run")
    }

    /// Four processes of `DIR/dplc launch DIR ARGS` under mpirun, the last
    /// one started with mpirun options `env` and launch arguments `extra`
    /// besides (an MPMD line: `-np 3 … : -np 1 …`), killed after a minute.
    fn mpirun_odd_one(dir: &Path, args: &[&str], env: &[&str], extra: &[&str]) -> Output {
        let mut cmd = mpirun_within(60);
        cmd.args(["-np", "3"])
            .arg(dir.join("dplc"))
            .arg("launch")
            .arg(dir)
            .args(args)
            .args([":", "-np", "1"])
            .args(env)
            .arg(dir.join("dplc"))
            .arg("launch")
            .arg(dir)
            .args(args)
            .args(extra);
        cmd.output().expect("timeout and mpirun run")
    }

    #[test]
    fn four_processes_train_bit_for_bit_as_four_threads() {
        if !mpirun_present() {
            return;
        }
        // The data-parallel synchronisations and compressions too: a
        // parameter server's pushes and pulls, PowerSGD's and top-k's
        // gathers, each process's error feedback its own.
        for (name, strategy) in [
            ("dp2pp2", "dp=2,pp=2,mb=1"),
            ("tp2pp2", "tp=2,pp=2,mb=1"),
            ("ps", "dp=4,zero=0,sync=ps,ps_shards=2"),
            ("async", "dp=4,zero=0,sync=async,staleness=1"),
            ("powersgd", "dp=4,zero=0,compress=powersgd:2:1"),
            ("topk", "dp=4,zero=0,compress=topk:0.1:1"),
        ] {
            let dir = build(name, strategy);
            let args = ["--steps", "4", "--seed", "3", "--json"];
            let threads = launch(&dir, &args, &[]);
            assert!(threads.status.success(), "{}", text(&threads));
            let processes = mpirun(&dir, &args, &[]);
            assert!(processes.status.success(), "{}", text(&processes));
            let (a, b) = (losses(&threads.stdout), losses(&processes.stdout));
            assert_eq!(a.len(), 4, "{strategy}: {}", text(&threads));
            // Tolerance zero: the same contributions are summed in the same order.
            assert_eq!(a, b, "{strategy}: processes train as threads, bit for bit");
            let _ = std::fs::remove_dir_all(&dir);
        }
    }

    /// Processes save checkpoints into one directory (each its shard, rank
    /// 0 the manifest) that threads resume bit for bit, and `--trace`
    /// gathers every process's spans into rank 0's file.
    #[test]
    fn processes_checkpoint_and_trace_as_threads_do() {
        if !mpirun_present() {
            return;
        }
        let dir = build("ckpt", "dp=2,pp=2,mb=1");
        let (ckpt, trace) = (tmp("ckpt-dir"), tmp("trace.json"));
        let (ckpt_s, trace_s) = (ckpt.to_str().unwrap(), trace.to_str().unwrap());
        let whole = launch(&dir, &["--steps", "4", "--seed", "3", "--json"], &[]);
        assert!(whole.status.success(), "{}", text(&whole));
        let args = ["--steps", "2", "--seed", "3", "--json"];
        let saved = mpirun(
            &dir,
            &[&args[..], &["--checkpoint-dir", ckpt_s, "--trace", trace_s]].concat(),
            &[],
        );
        assert!(saved.status.success(), "{}", text(&saved));
        let resumed = launch(&dir, &["--steps", "4", "--json", "--resume", ckpt_s], &[]);
        assert!(resumed.status.success(), "{}", text(&resumed));
        let (a, b) = (losses(&whole.stdout), losses(&resumed.stdout));
        assert_eq!(a.len(), 4, "{}", text(&whole));
        assert_eq!(a[2..], b[..], "resumed from the processes' checkpoint");
        let events: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&trace).expect("the trace file"))
                .expect("trace JSON");
        let events = events
            .get("traceEvents")
            .unwrap_or(&events)
            .as_array()
            .expect("an array of events")
            .clone();
        let mut ranks: Vec<u64> = events
            .iter()
            .filter(|e| e["ph"] == "X" && e["name"].as_str().is_some_and(|n| n.contains("forward")))
            .filter_map(|e| e["tid"].as_u64())
            .collect();
        ranks.sort_unstable();
        ranks.dedup();
        assert_eq!(ranks, [0, 1, 2, 3], "every process's forwards in the trace");
        for d in [&dir, &ckpt] {
            let _ = std::fs::remove_dir_all(d);
        }
    }

    /// Past MPI_Init a process's own failure ends the job at once, said by
    /// that process (a launcher rank that disagrees with MPI's), and under
    /// `--json` rank 0's failure is the JSON error object on stdout; a
    /// signal to mpirun stops every rank at a step boundary, saves, and
    /// ends the job without an abort (which had left mpirun hanging).
    #[test]
    fn a_process_failure_is_said_and_a_signal_ends_the_job_cleanly() {
        if !mpirun_present() {
            return;
        }
        let dir = build("said", "dp=4");
        let start = Instant::now();
        let out = mpirun_odd_one(
            &dir,
            &["--steps", "4", "--timeout", "30"],
            &["-x", "RANK=0", "-x", "WORLD_SIZE=4"],
            &[],
        );
        assert_ne!(out.status.code(), Some(0), "{}", text(&out));
        assert!(
            text(&out).contains("MPI says this is rank 3, but the launcher's environment says 0"),
            "{}",
            text(&out)
        );
        assert!(
            start.elapsed() < Duration::from_secs(25),
            "{:?}",
            start.elapsed()
        );

        // One process started with another seed: refused before step 0.
        let out = mpirun_odd_one(&dir, &["--steps", "4", "--json"], &[], &["--seed", "1"]);
        assert_ne!(out.status.code(), Some(0), "{}", text(&out));
        assert!(
            text(&out).contains("rank 3 was started with another plan or other options"),
            "{}",
            text(&out)
        );
        assert!(losses(&out.stdout).is_empty(), "no step ran");

        let out = mpirun(
            &dir,
            &["--steps", "4", "--resume", "/nonexistent", "--json"],
            &[],
        );
        assert_ne!(out.status.code(), Some(0), "{}", text(&out));
        let error = String::from_utf8_lossy(&out.stdout)
            .lines()
            .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
            .find(|v| v.get("error").is_some());
        assert!(error.is_some(), "no JSON error object: {}", text(&out));

        let ck = tmp("signal-ck");
        let mut child = mpirun_within(60)
            .args(["-np", "4"])
            .arg(dir.join("dplc"))
            .arg("launch")
            .arg(&dir)
            .args(["--steps", "100000", "--checkpoint-dir"])
            .arg(&ck)
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .expect("mpirun starts");
        // Signal mpirun itself once the ranks train (a step line on stderr
        // is not needed: a few seconds in, they are past their start).
        std::thread::sleep(Duration::from_secs(4));
        let mpirun_pid =
            std::fs::read_to_string(format!("/proc/{}/task/{}/children", child.id(), child.id()))
                .ok()
                .and_then(|c| c.split_whitespace().next().map(str::to_string))
                .expect("timeout's child, mpirun");
        let _ = Command::new("kill").args(["-TERM", &mpirun_pid]).status();
        let start = Instant::now();
        let status = child.wait().expect("waits");
        assert!(
            start.elapsed() < Duration::from_secs(30),
            "mpirun hung: {:?}",
            start.elapsed()
        );
        assert!(
            !matches!(status.code(), Some(0) | Some(124) | Some(137)),
            "{status:?}"
        );
        let saved = std::fs::read_dir(&ck)
            .expect("the checkpoint directory")
            .flatten()
            .any(|e| e.path().join("manifest.json").is_file());
        assert!(saved, "a checkpoint saved at the interrupt");
        for d in [&dir, &ck] {
            let _ = std::fs::remove_dir_all(d);
        }
    }

    #[test]
    fn a_dead_or_hung_rank_ends_the_job_within_the_timeout() {
        if !mpirun_present() {
            return;
        }
        let dir = build("faults", "dp=2,pp=2,mb=1");
        for (fault, says) in [
            ("kill:1:2", "rank 1 failed at step 2"),
            ("stall:1:2", "rank 1 stopped answering at step 2"),
        ] {
            let start = Instant::now();
            let args = ["--steps", "6", "--timeout", "5", "--json"];
            let out = mpirun(&dir, &args, &[("DPLC_FAULT", fault)]);
            let took = start.elapsed();
            assert_ne!(out.status.code(), Some(0), "{fault}: {}", text(&out));
            assert_ne!(out.status.code(), Some(124), "{fault} hung: {}", text(&out));
            assert!(text(&out).contains(says), "{fault}: {}", text(&out));
            assert!(took < Duration::from_secs(60), "{fault} took {took:?}");
        }
        let _ = std::fs::remove_dir_all(&dir);
    }
}
