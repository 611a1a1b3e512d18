//! Training on CPU ranks: the loss falls on the synthetic corpus, and every
//! parallel strategy reproduces the serial run.
//!
//! Tolerance: 1e-5 relative (floored at 1e-3 in magnitude). The strategies
//! compute the same sums in a different association — a micro-batch's matmul
//! over its own samples then an all-reduce over ranks, instead of one matmul
//! over all samples — and f32 addition is not associative: each reassociation
//! moves a result by a few ulps (1e-7 relative), and five AdamW steps amplify
//! that by at most a few tens. A missing gradient sync moves parameters by
//! about the learning rate (1e-2), three orders of magnitude more.

mod common;

use common::{spec, Gpt};
use dplc_runtime::*;

const STEPS: u64 = 5;
const TOL: f32 = 1e-5;

fn run(g: &dplc_ir::Graph, cfg: RunConfig) -> Result<TrainReport> {
    let data = Corpus::synthetic(7, 32, 4096);
    let s = spec(8, cfg.global_batch() as u64);
    let mut cfg = cfg;
    if cfg.tp > 1 && cfg.layout.is_none() {
        // The layout a plan of this split carries.
        cfg.layout = Some(
            dplc_planner::derive_layout(g, cfg.tp as u64, cfg.ep as u64, cfg.sequence_parallel)
                .expect("a Megatron layout"),
        );
    }
    train(g, &s, &cfg, &data, STEPS, 42, |_| {})
}

fn serial(mb: usize, n: usize) -> RunConfig {
    RunConfig {
        micro_batch: mb,
        num_micro_batches: n,
        ..RunConfig::default()
    }
}

fn assert_same(name: &str, a: &TrainReport, b: &TrainReport) {
    for (x, y) in a.steps.iter().zip(&b.steps) {
        let rel = ((x.loss - y.loss) / x.loss.abs().max(1e-3)).abs();
        assert!(
            rel < f64::from(TOL),
            "{name}: step {} loss {} vs {}",
            x.step,
            x.loss,
            y.loss
        );
    }
    assert_eq!(a.steps.len(), b.steps.len());
    let (d, at) = a.params.max_rel_diff(&b.params, 1e-3);
    eprintln!("{name}: max relative parameter difference {d:e} at {at}");
    assert!(d < TOL, "{name}: parameters differ by {d} at {at}");
}

#[test]
fn loss_falls_on_the_synthetic_corpus() {
    let g = Gpt {
        layers: 2,
        dropout: 0.0,
        ..Gpt::default()
    }
    .build();
    let data = Corpus::synthetic(1, 32, 8192);
    let mut s = spec(8, 8);
    s.schedule = dplc_ir::LrSchedule::Constant;
    let cfg = RunConfig {
        micro_batch: 8,
        ..RunConfig::default()
    };
    let mut losses = Vec::new();
    train(&g, &s, &cfg, &data, 30, 3, |st| losses.push(st.loss)).unwrap();
    let (first, last) = (losses[0], *losses.last().unwrap());
    assert!(
        (first - (32f64).ln()).abs() < 0.5,
        "starts near ln(vocab): {first}"
    );
    assert!(last < first - 0.7, "loss falls: {losses:?}");
}

#[test]
fn data_parallel_and_zero_match_serial() {
    let g = Gpt::default().build();
    let base = run(&g, serial(2, 4)).unwrap();
    let dp2 = run(
        &g,
        RunConfig {
            dp: 2,
            micro_batch: 2,
            num_micro_batches: 2,
            bucket_elems: 300,
            ..RunConfig::default()
        },
    )
    .unwrap();
    assert_same("dp2", &base, &dp2);
    for zero in [ZeroStage::One, ZeroStage::Two, ZeroStage::Three] {
        let r = run(
            &g,
            RunConfig {
                dp: 4,
                micro_batch: 2,
                num_micro_batches: 1,
                zero,
                ..RunConfig::default()
            },
        )
        .unwrap();
        assert_same(&format!("{zero:?} dp4"), &base, &r);
    }
}

#[test]
fn pipeline_schedules_match_serial() {
    let g = Gpt::default().build();
    let base = run(&g, serial(2, 4)).unwrap();
    for schedule in [Schedule::GPipe, Schedule::OneFOneB] {
        let r = run(
            &g,
            RunConfig {
                pp: 2,
                micro_batch: 2,
                num_micro_batches: 4,
                schedule,
                ..RunConfig::default()
            },
        )
        .unwrap();
        assert_same(&format!("pp2 {schedule:?}"), &base, &r);
    }
    let r = run(
        &g,
        RunConfig {
            pp: 2,
            micro_batch: 2,
            num_micro_batches: 4,
            schedule: Schedule::Interleaved { chunks: 2 },
            ..RunConfig::default()
        },
    )
    .unwrap();
    assert_same("pp2 interleaved v2", &base, &r);
}

#[test]
fn data_and_pipeline_parallel_with_zero_and_recompute_match_serial() {
    let g = Gpt::default().build();
    let base = run(&g, serial(2, 4)).unwrap();
    let cfg = RunConfig {
        dp: 2,
        pp: 2,
        micro_batch: 2,
        num_micro_batches: 2,
        zero: ZeroStage::One,
        recompute: dplc_ir::Recompute::Full,
        ..RunConfig::default()
    };
    assert_same(
        "dp2 pp2 zero1 recompute",
        &base,
        &run(&g, cfg.clone()).unwrap(),
    );
    // The first layer of each stage's two recomputed, the second kept.
    let first = RunConfig {
        recompute_layers: 1,
        ..cfg
    };
    assert_same(
        "dp2 pp2 zero1 recompute 1 of 2",
        &base,
        &run(&g, first).unwrap(),
    );
}

#[test]
fn a_dropped_gradient_all_reduce_is_caught() {
    let g = Gpt::default().build();
    let base = run(&g, serial(2, 4)).unwrap();
    let faults = Faults {
        skip_grad_sync: true,
        ..Faults::default()
    };
    let bad = run(
        &g,
        RunConfig {
            dp: 2,
            micro_batch: 2,
            num_micro_batches: 2,
            faults,
            ..RunConfig::default()
        },
    )
    .unwrap();
    let (d, _) = base.params.max_rel_diff(&bad.params, 1e-3);
    assert!(
        d > 100.0 * TOL,
        "the check must see a missing all-reduce, diff {d}"
    );
}

#[test]
fn a_failing_rank_stops_every_rank_and_is_named() {
    let g = Gpt {
        layers: 2,
        ..Gpt::default()
    }
    .build();
    for (tp, faults) in [
        (
            1,
            Faults {
                fail_rank_at: Some((2, 1)),
                ..Faults::default()
            },
        ),
        (
            1,
            Faults {
                panic_rank_at: Some((2, 1)),
                ..Faults::default()
            },
        ),
        (
            2,
            Faults {
                panic_rank_at: Some((2, 1)),
                ..Faults::default()
            },
        ),
    ] {
        let start = std::time::Instant::now();
        let cfg = RunConfig {
            dp: 2,
            pp: 2,
            tp,
            micro_batch: 1,
            num_micro_batches: 2,
            faults,
            timeout: std::time::Duration::from_secs(30),
            ..RunConfig::default()
        };
        let err = run(&g, cfg).unwrap_err();
        assert!(
            matches!(err, RuntimeError::RankFailed { rank: 2, .. }),
            "{err}"
        );
        assert!(err.to_string().contains("injected"), "{err}");
        assert!(start.elapsed() < std::time::Duration::from_secs(10));
    }
}

/// A rank that hangs (a stuck process, not a crash) is noticed by the ranks
/// waiting for it once the timeout passes, and named with the step; nothing hangs.
#[test]
fn a_stalled_rank_is_named_with_its_step_within_the_timeout() {
    let g = Gpt {
        layers: 2,
        ..Gpt::default()
    }
    .build();
    let timeout = std::time::Duration::from_secs(2);
    let start = std::time::Instant::now();
    let cfg = RunConfig {
        dp: 2,
        pp: 2,
        micro_batch: 1,
        num_micro_batches: 2,
        faults: Faults {
            stall_rank_at: Some((3, 2)),
            ..Faults::default()
        },
        timeout,
        ..RunConfig::default()
    };
    let err = run(&g, cfg).unwrap_err();
    assert!(
        matches!(err, RuntimeError::RankFailed { rank: 3, .. }),
        "{err}"
    );
    let msg = err.to_string();
    assert!(msg.contains("rank 3 stopped answering at step 2"), "{msg}");
    let took = start.elapsed();
    assert!(took >= timeout && took < timeout * 4, "{took:?}");
}

#[test]
fn configuration_errors_are_reported() {
    let g = Gpt {
        layers: 2,
        ..Gpt::default()
    }
    .build();
    let err = run(
        &g,
        RunConfig {
            pp: 4,
            micro_batch: 1,
            num_micro_batches: 4,
            ..RunConfig::default()
        },
    )
    .unwrap_err();
    assert_eq!(
        err.to_string(),
        "invalid run configuration: 2 layers cannot fill 4 pipeline stages"
    );
}

#[test]
fn tensor_parallel_with_fused_qkv_and_dropout_matches_serial() {
    // The fused QKV projection is sliced along its split axis and dropout
    // masks are keyed by whole-tensor positions: the layout gathers both
    // before use, so the split still computes the serial function.
    let g = Gpt::default().build();
    let base = run(&g, serial(2, 4)).unwrap();
    for sequence_parallel in [false, true] {
        let cfg = RunConfig {
            tp: 2,
            sequence_parallel,
            micro_batch: 2,
            num_micro_batches: 4,
            ..RunConfig::default()
        };
        assert_same(
            &format!("tp2 sp={sequence_parallel}"),
            &base,
            &run(&g, cfg).unwrap(),
        );
    }
}

/// A free TCP port on this machine (taken, then released for the test).
fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a local port")
        .port()
}

/// Train `cfg` as one process per rank meeting over TCP (here threads, each
/// with its own world and connection, as separate processes would have).
fn run_over_tcp(g: &dplc_ir::Graph, cfg: RunConfig) -> Vec<Result<TrainReport>> {
    let n = cfg.world_size();
    run_over_tcp_each(g, n, STEPS, |_| cfg.clone())
}

/// Train `steps` steps as `n` processes over TCP, rank `r` with
/// `cfg_of(r)` (its own trace sink, as a process has).
fn run_over_tcp_each(
    g: &dplc_ir::Graph,
    n: usize,
    steps: u64,
    cfg_of: impl Fn(usize) -> RunConfig + Sync,
) -> Vec<Result<TrainReport>> {
    let data = Corpus::synthetic(7, 32, 4096);
    let port = free_port();
    std::thread::scope(|sc| {
        let handles: Vec<_> = (0..n)
            .map(|rank| {
                let (cfg_of, data) = (&cfg_of, &data);
                sc.spawn(move || {
                    let cfg = cfg_of(rank);
                    let s = spec(8, cfg.global_batch() as u64);
                    let p = TcpProcess::join(
                        rank,
                        n,
                        "127.0.0.1",
                        port,
                        std::time::Duration::from_secs(20),
                    )?;
                    train_process(g, &s, &cfg, data, steps, 42, Process::Tcp(&p), |_| {})
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("a rank thread"))
            .collect()
    })
}

/// Ranks in separate processes save checkpoints (each its shard, rank 0 the
/// manifest) that resume bit for bit over TCP and in one process, and their
/// trace spans reach rank 0.
#[test]
fn ranks_over_tcp_checkpoint_resume_and_trace() {
    let g = Gpt::default().build();
    let dir = std::env::temp_dir().join(format!("dplc-tcp-ckpt-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let base = RunConfig {
        dp: 2,
        pp: 2,
        micro_batch: 1,
        num_micro_batches: 2,
        zero: ZeroStage::One,
        ..RunConfig::default()
    };
    let whole = run(&g, base.clone()).unwrap();
    let n = base.world_size();
    let saving = |_| RunConfig {
        checkpoint: Some(CheckpointConfig {
            dir: dir.clone(),
            every: 2,
        }),
        trace: TraceSink::recording(),
        ..base.clone()
    };
    let sinks: Vec<RunConfig> = (0..n).map(saving).collect();
    let reports: Vec<TrainReport> = run_over_tcp_each(&g, n, STEPS, |r| sinks[r].clone())
        .into_iter()
        .map(|r| r.unwrap_or_else(|e| panic!("saving over TCP: {e}")))
        .collect();
    assert_eq!(reports[0].checkpoints.len(), 3, "steps 2, 4 and the end");
    let spans = sinks[0].trace.spans();
    for rank in 0..n {
        for kind in ["forward", "backward", "step"] {
            let steps: std::collections::BTreeSet<u64> = spans
                .iter()
                .filter(|s| s.rank == rank && s.kind == kind)
                .map(|s| s.step)
                .collect();
            assert_eq!(steps.len() as u64, STEPS, "rank {rank}'s {kind} spans");
        }
    }
    assert!(spans
        .iter()
        .all(|s| s.start_us >= 0.0 && s.duration_us >= 0.0));
    let from = reports[0].checkpoints[0].clone();
    let bits = |r: &TrainReport| -> Vec<(u64, u64)> {
        r.steps.iter().map(|s| (s.step, s.loss.to_bits())).collect()
    };
    let tail: Vec<(u64, u64)> = bits(&whole).split_off(2);
    let resumed = run_over_tcp_each(&g, n, STEPS, |_| RunConfig {
        resume_from: Some(from.clone()),
        ..base.clone()
    })
    .into_iter()
    .next()
    .expect("rank 0")
    .unwrap_or_else(|e| panic!("resuming over TCP: {e}"));
    assert_eq!(bits(&resumed), tail, "resumed over TCP");
    let here = run(
        &g,
        RunConfig {
            resume_from: Some(from),
            ..base.clone()
        },
    )
    .unwrap();
    assert_eq!(bits(&here), tail, "resumed in one process");
    let _ = std::fs::remove_dir_all(&dir);
}

/// Ranks in separate processes without MPI, meeting over TCP (as a
/// launcher's world does): the same training as the ranks of one process.
#[test]
fn ranks_meeting_over_tcp_match_the_in_process_run() {
    let g = Gpt::default().build();
    for cfg in [
        RunConfig {
            dp: 2,
            micro_batch: 1,
            num_micro_batches: 2,
            zero: ZeroStage::One,
            ..RunConfig::default()
        },
        RunConfig {
            dp: 2,
            pp: 2,
            micro_batch: 1,
            num_micro_batches: 2,
            ..RunConfig::default()
        },
    ] {
        let here = run(&g, cfg.clone()).unwrap();
        let name = format!("dp {} pp {} over TCP", cfg.dp, cfg.pp);
        let results = run_over_tcp(&g, cfg);
        let rank0 = results
            .into_iter()
            .map(|r| r.unwrap_or_else(|e| panic!("{name}: {e}")))
            .next()
            .expect("rank 0");
        for (x, y) in here.steps.iter().zip(&rank0.steps) {
            assert_eq!(
                x.loss.to_bits(),
                y.loss.to_bits(),
                "{name}: step {}",
                x.step
            );
        }
    }
}

/// A rank that fails over TCP stops the others with its name, quickly.
#[test]
fn a_failing_rank_over_tcp_is_named_by_the_others() {
    let g = Gpt::default().build();
    let cfg = RunConfig {
        dp: 2,
        micro_batch: 1,
        num_micro_batches: 2,
        faults: Faults {
            fail_rank_at: Some((1, 2)),
            ..Faults::default()
        },
        timeout: std::time::Duration::from_secs(20),
        ..RunConfig::default()
    };
    let start = std::time::Instant::now();
    let results = run_over_tcp(&g, cfg);
    for r in &results {
        let err = r.as_ref().expect_err("every rank stops");
        assert!(
            err.to_string().contains("injected failure at step 2"),
            "{err}"
        );
    }
    assert!(start.elapsed() < std::time::Duration::from_secs(10));
}

/// A rank that stops answering over TCP is the one every process names
/// (dp2 × pp2: rank 1 stalls; its pipeline peer waits for it, and that
/// peer's data-parallel partner waits for the peer). Which wait ends first
/// is up to the scheduler; `tcp_world`'s unit test pins the order in which
/// the partner's deadline passes first.
#[test]
fn a_stalled_rank_over_tcp_is_named_by_every_process() {
    let g = Gpt::default().build();
    let cfg = RunConfig {
        dp: 2,
        pp: 2,
        micro_batch: 1,
        num_micro_batches: 2,
        zero: ZeroStage::One,
        faults: Faults {
            stall_rank_at: Some((1, 2)),
            ..Faults::default()
        },
        timeout: std::time::Duration::from_secs(3),
        ..RunConfig::default()
    };
    let start = std::time::Instant::now();
    for (rank, r) in run_over_tcp(&g, cfg).iter().enumerate() {
        let err = r.as_ref().expect_err("every rank stops");
        assert!(
            err.to_string()
                .contains("rank 1 stopped answering at step 2"),
            "rank {rank}: {err}"
        );
    }
    assert!(start.elapsed() < std::time::Duration::from_secs(20));
}

/// A non-finite gradient stops the run at that step, before the optimizer
/// can poison the state, on every rank alike; with an allowance the step is
/// skipped (nothing updated) and training goes on.
#[test]
fn a_non_finite_step_stops_the_run_or_is_skipped() {
    let g = Gpt::default().build();
    let cfg = RunConfig {
        dp: 2,
        micro_batch: 1,
        num_micro_batches: 2,
        faults: Faults {
            nan_grad_at: Some((1, 2)),
            ..Faults::default()
        },
        ..RunConfig::default()
    };
    let e = run(&g, cfg.clone()).expect_err("stops");
    assert!(matches!(e, RuntimeError::NonFinite { step: 2, .. }), "{e}");
    assert!(e.to_string().contains("step 2: the loss is"), "{e}");
    let skipping = run(
        &g,
        RunConfig {
            skip_nonfinite: 1,
            ..cfg.clone()
        },
    )
    .expect("skips one step");
    let skipped: Vec<u64> = skipping
        .steps
        .iter()
        .filter(|s| s.skipped)
        .map(|s| s.step)
        .collect();
    assert_eq!(skipped, [2]);
    assert!(skipping.steps[3..].iter().all(|s| s.loss.is_finite()));
    // The allowance counts skips: one at step 1, then ordinary steps.
    let e = run(
        &g,
        RunConfig {
            faults: Faults {
                nan_grad_at: Some((0, 1)),
                ..Faults::default()
            },
            skip_nonfinite: 1,
            ..cfg.clone()
        },
    )
    .expect("one skip allowed");
    assert!(e.steps[1].skipped && !e.steps[2].skipped);
}

/// A fault that could never fire is refused, so a fault test cannot pass
/// vacuously.
#[test]
fn faults_outside_the_run_are_refused() {
    let g = Gpt::default().build();
    for (faults, says) in [
        (
            Faults {
                fail_rank_at: Some((2, 1)),
                ..Faults::default()
            },
            "names rank 2, but the run has ranks 0 to 1",
        ),
        (
            Faults {
                stall_rank_at: Some((0, STEPS)),
                ..Faults::default()
            },
            "the stall fault is at step 5, but the run has steps 0 to 4",
        ),
    ] {
        let cfg = RunConfig {
            dp: 2,
            micro_batch: 1,
            num_micro_batches: 2,
            faults,
            ..RunConfig::default()
        };
        let e = run(&g, cfg).expect_err("refused");
        assert!(e.to_string().contains(says), "{e}");
    }
}

/// A parameter server, async updates and the compressions move their
/// gradients through the collectives, so ranks in separate processes
/// (TCP) reproduce the threaded run bit for bit.
#[test]
fn dp_synchronisations_over_tcp_equal_the_threaded_run() {
    let g = Gpt::default().build();
    for (sync, compress) in [
        (dplc_ir::GradSync::ps(1), dplc_ir::Compression::None),
        (
            dplc_ir::GradSync::async_ps(2, 1),
            dplc_ir::Compression::None,
        ),
        (
            dplc_ir::GradSync::AllReduce,
            dplc_ir::Compression::TopK {
                per_million: 100_000,
                warmup: Some(0),
            },
        ),
        (
            dplc_ir::GradSync::AllReduce,
            dplc_ir::Compression::PowerSgd {
                rank: 2,
                warmup: Some(0),
            },
        ),
    ] {
        let cfg = RunConfig {
            dp: 2,
            pp: 2,
            micro_batch: 1,
            num_micro_batches: 2,
            sync,
            compress,
            ..RunConfig::default()
        };
        let here = run(&g, cfg.clone()).unwrap();
        let there = run_over_tcp(&g, cfg)
            .into_iter()
            .next()
            .expect("rank 0")
            .unwrap_or_else(|e| panic!("{}/{}: {e}", sync.keys(), compress.name()));
        let losses = |r: &TrainReport| r.steps.iter().map(|s| s.loss.to_bits()).collect::<Vec<_>>();
        assert_eq!(
            losses(&here),
            losses(&there),
            "{} {}",
            sync.keys(),
            compress.name()
        );
    }
}
