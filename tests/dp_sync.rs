//! The data-parallel gradient synchronisations and compressions on CPU
//! ranks: a parameter server with a shard per worker, co-located or on
//! dedicated ranks, sums as the all-reduce does (same losses and
//! parameters, bit for bit), with fewer shards to within the equivalence
//! tolerance; async with staleness 0 is the synchronous run; the bytes each
//! rank moved are what the algorithms send; error feedback and an async
//! run's older weight versions survive a checkpoint (a resumed run equals
//! an uninterrupted one); and 200 steps of async (staleness 2) and of each
//! compression end within the bounds README.md states of the all-reduce's loss.
//!
//! And the planner's side: the prices of a parameter server (co-located
//! and dedicated) and of each compression on a 4x8xA100 GPT-2 plan, in the order their bytes say; the
//! search takes them only when `--allow` names them.

use dplc_ir::{Compression, GradSync, ServerRanks};
use dplc_planner::{compile, parse_cluster, parse_strategy, Allow, Compiled, PlanRequest};
use dplc_runtime::{train, CheckpointConfig, Corpus, RunConfig, TrainReport, ZeroStage};

mod common;
use common::{assert_losses, Opt, Scratch, TINY};

const SEED: u64 = 11;

fn dp4(sync: GradSync, compress: Compression) -> RunConfig {
    RunConfig {
        dp: 4,
        sync,
        compress,
        ..RunConfig::default()
    }
}

/// `steps` steps of gpt_tiny at sequence `seq` with `opt` (the model's own
/// optimizer and schedule when `None`).
fn try_run(
    cfg: &RunConfig,
    steps: u64,
    seq: u64,
    opt: Option<Opt>,
) -> dplc_runtime::Result<TrainReport> {
    let unit = dplc_frontend::parse("tiny.dpl", TINY).expect("tiny.dpl parses");
    let lowered = unit.lower("gpt_tiny").expect("the model lowers");
    let mut spec = lowered.train;
    spec.seq = seq;
    spec.global_batch = cfg.global_batch() as u64;
    if let Some(opt) = opt {
        spec.optimizer = opt.optimizer();
    }
    let data = Corpus::synthetic(5, 256, 1 << 14);
    train(&lowered.graph, &spec, cfg, &data, steps, SEED, |_| {})
}

fn run(cfg: &RunConfig, steps: u64) -> TrainReport {
    try_run(cfg, steps, 16, Some(Opt::AdamW)).unwrap_or_else(|e| panic!("{e}"))
}

fn losses(r: &TrainReport) -> Vec<f64> {
    r.steps.iter().map(|s| s.loss).collect()
}

#[test]
fn a_parameter_server_sums_as_the_all_reduce_does() {
    let reduce = run(&dp4(GradSync::AllReduce, Compression::None), 5);
    // A shard per worker: each server sums its shard in group order, as the
    // all-reduce does, and the norm is counted over the same ranges.
    let ps = run(&dp4(GradSync::ps(4), Compression::None), 5);
    assert_eq!(losses(&reduce), losses(&ps));
    assert_eq!(reduce.params.max_rel_diff(&ps.params, 1e-6).0, 0.0);
    // Fewer servers: the same sums; only the norm's partial sums regroup.
    for shards in [1, 2] {
        let fewer = run(&dp4(GradSync::ps(shards), Compression::None), 5);
        assert_losses(&format!("ps_shards={shards}"), &reduce.steps, &fewer.steps);
    }
}

#[test]
fn async_with_staleness_zero_is_the_synchronous_run() {
    let sync = run(&dp4(GradSync::ps(4), Compression::None), 5);
    let async0 = run(&dp4(GradSync::async_ps(4, 0), Compression::None), 5);
    assert_eq!(losses(&sync), losses(&async0));
    assert_eq!(sync.params.max_rel_diff(&async0.params, 1e-6).0, 0.0);
    // Staleness 1: replicas 1 and 3 compute on the weights one step old,
    // so the second step already differs.
    let async1 = run(&dp4(GradSync::async_ps(4, 1), Compression::None), 5);
    assert_eq!(sync.steps[0].loss, async1.steps[0].loss);
    assert_ne!(losses(&sync), losses(&async1));
    // The fused compute keeps its weight versions on its backend, each a
    // copy of its own (a whole f32 value shares its master's memory): it
    // reads the same stale weights as the reference.
    let async2 = dp4(GradSync::async_ps(4, 2), Compression::None);
    let fused = RunConfig {
        compute: dplc_runtime::Compute::Fused,
        ..async2.clone()
    };
    assert_losses(
        "async staleness 2, fused",
        &run(&async2, 5).steps,
        &run(&fused, 5).steps,
    );
}

#[test]
fn each_rank_moves_the_bytes_its_algorithm_sends() {
    let steps = 2;
    let plain = run(&dp4(GradSync::AllReduce, Compression::None), steps);
    let grad_bytes: u64 = plain
        .params
        .values
        .values()
        .map(|(_, t)| t.numel() as u64 * 4)
        .sum();
    let n = 4;
    // Ring all-reduce: 2(n−1)/n of the gradient, each way, on every rank.
    for t in &plain.dp_traffic {
        assert_eq!(t.sent, steps * 2 * (n - 1) * grad_bytes / n);
    }
    // One server: it takes in n−1 gradients and sends n−1 copies back; a
    // worker sends its gradient and takes the weights in.
    let one = run(&dp4(GradSync::ps(1), Compression::None), steps);
    assert_eq!(one.dp_traffic[0].sent, steps * (n - 1) * grad_bytes);
    assert_eq!(one.dp_traffic[0].received, steps * (n - 1) * grad_bytes);
    assert_eq!(one.dp_traffic[1].sent, steps * grad_bytes);
    // bf16 halves what the ring carries.
    let bf16 = run(&dp4(GradSync::AllReduce, Compression::Bf16), steps);
    assert_eq!(bf16.dp_traffic[0].sent, plain.dp_traffic[0].sent / 2);
    // PowerSGD and top-k send less than the fp32 ring.
    for c in [
        Compression::PowerSgd {
            rank: 2,
            warmup: Some(0),
        },
        Compression::TopK {
            per_million: 100_000,
            warmup: Some(0),
        },
    ] {
        let r = run(&dp4(GradSync::AllReduce, c), steps);
        assert!(
            r.dp_traffic[0].sent < plain.dp_traffic[0].sent / 2,
            "{}: {} bytes",
            c.name(),
            r.dp_traffic[0].sent
        );
    }
}

#[test]
fn error_feedback_survives_a_checkpoint() {
    for (name, c) in [
        (
            "topk",
            Compression::TopK {
                per_million: 100_000,
                warmup: Some(0),
            },
        ),
        (
            "powersgd",
            Compression::PowerSgd {
                rank: 2,
                warmup: Some(0),
            },
        ),
    ] {
        let cfg = RunConfig {
            dp: 2,
            compress: c,
            ..RunConfig::default()
        };
        resumes_bit_for_bit(
            name,
            &cfg,
            "feedback-rank00001",
            "no error-feedback state for rank 1",
        );
    }
}

/// Error feedback and older weight versions are each rank's own, saved
/// under the run's split and staleness: a resume under another split (or
/// staleness) is refused before any rank starts, saying which it needs —
/// never run with some ranks' state dropped.
#[test]
fn side_state_resumes_only_under_its_split() {
    let topk = Compression::TopK {
        per_million: 100_000,
        warmup: Some(0),
    };
    let cases = [
        (
            "topk-dp",
            dp4(GradSync::AllReduce, topk),
            RunConfig {
                dp: 2,
                num_micro_batches: 2,
                ..dp4(GradSync::AllReduce, topk)
            },
            "saved under dp 4",
        ),
        (
            "async-staleness",
            dp4(GradSync::async_ps(4, 1), Compression::None),
            dp4(GradSync::async_ps(4, 2), Compression::None),
            "resume with staleness=1",
        ),
    ];
    for (name, saved, resumed, says) in cases {
        let dir = Scratch::new("dpsync-split", name);
        let first = run(
            &RunConfig {
                checkpoint: Some(CheckpointConfig {
                    dir: dir.0.clone(),
                    every: 0,
                }),
                ..saved
            },
            2,
        );
        let e = try_run(
            &RunConfig {
                resume_from: Some(first.checkpoints[0].clone()),
                ..resumed
            },
            4,
            16,
            Some(Opt::AdamW),
        )
        .expect_err("refused")
        .to_string();
        assert!(e.contains(says), "{name}: {e}");
    }
}

/// Servers on ranks of their own (`ps_ranks=dedicated`): four workers and
/// N more ranks that hold the shards and the optimizer state and run no
/// model compute. With a server per worker each sums its shard in the
/// workers' order, as the all-reduce does, and counts the same ranges in
/// the norm: the same losses and parameters, bit for bit; with fewer only
/// the norm's partial sums regroup. A worker pushes its whole gradient and
/// pulls the whole weights; a server takes its 1/N of every worker's
/// gradient in and sends as many weights back: `n/N` of the gradient.
#[test]
fn dedicated_servers_sum_as_the_all_reduce_does() {
    let dedicated =
        |sync: GradSync| dp4(sync.with_servers(ServerRanks::Dedicated), Compression::None);
    let reduce = run(&dp4(GradSync::AllReduce, Compression::None), 5);
    let four = run(&dedicated(GradSync::ps(4)), 5);
    assert_eq!(losses(&reduce), losses(&four));
    assert_eq!(reduce.params.max_rel_diff(&four.params, 1e-6).0, 0.0);
    assert_eq!(four.dp_traffic.len(), 8, "4 workers and 4 servers");
    let grad_bytes: u64 = reduce
        .params
        .values
        .values()
        .map(|(_, t)| t.numel() as u64 * 4)
        .sum();
    let steps = 5;
    for shards in [1u64, 2] {
        let fewer = run(&dedicated(GradSync::ps(shards)), 5);
        assert_losses(
            &format!("dedicated ps_shards={shards}"),
            &reduce.steps,
            &fewer.steps,
        );
        let server = fewer.dp_traffic[4];
        assert_eq!(
            server.sent,
            steps * 4 * grad_bytes / shards,
            "ps_shards={shards}"
        );
        assert_eq!(server.received, server.sent);
    }
    for worker in &four.dp_traffic[..4] {
        assert_eq!(
            (worker.sent, worker.received),
            (steps * grad_bytes, steps * grad_bytes)
        );
    }
    // Async on dedicated servers is async on co-located ones: the same
    // lags, the same sums.
    let colocated = run(&dp4(GradSync::async_ps(4, 1), Compression::None), 5);
    let async_dedicated = run(&dedicated(GradSync::async_ps(4, 1)), 5);
    assert_eq!(losses(&colocated), losses(&async_dedicated));
}

/// The fused compute keeps parameters, gradients, moments and error
/// feedback in its backend's buffers (`DeviceStorage`, what a GPU rank
/// holds; on CPU rank threads its host backend handing buffers over, the
/// path ranks sharing a GPU take, and through the host with a dedicated
/// server's ranks): every synchronisation and compression runs through it
/// as through the reference's host store.
#[test]
fn every_mode_runs_the_same_on_the_device_storage() {
    let dedicated = GradSync::ps(2).with_servers(ServerRanks::Dedicated);
    let modes = [
        (GradSync::ps(4), Compression::None),
        (GradSync::ps(1), Compression::None),
        (dedicated, Compression::None),
        (GradSync::async_ps(4, 1), Compression::None),
        (GradSync::AllReduce, Compression::Bf16),
        (GradSync::AllReduce, Compression::Fp16),
        (
            GradSync::AllReduce,
            Compression::PowerSgd {
                rank: 2,
                warmup: Some(1),
            },
        ),
        (
            GradSync::AllReduce,
            Compression::TopK {
                per_million: 100_000,
                warmup: Some(1),
            },
        ),
    ];
    for (sync, compress) in modes {
        let reference = dp4(sync, compress);
        let fused = RunConfig {
            compute: dplc_runtime::Compute::Fused,
            ..reference.clone()
        };
        let (r, f) = (run(&reference, 4), run(&fused, 4));
        let name = format!("{sync:?}, {}, fused", compress.name());
        assert_losses(&name, &r.steps, &f.steps);
        assert_eq!(r.dp_traffic, f.dp_traffic, "{name}: bytes moved");
    }
}

#[test]
fn a_parameter_server_resumes_from_its_shards() {
    for (name, sync) in [
        ("ps", GradSync::ps(1)),
        (
            "ps-dedicated",
            GradSync::ps(2).with_servers(ServerRanks::Dedicated),
        ),
    ] {
        resumes_from_its_shards(name, dp4(sync, Compression::None));
    }
}

fn resumes_from_its_shards(name: &str, cfg: RunConfig) {
    let whole = run(&cfg, 4);
    let dir = Scratch::new("dpsync", name);
    let first = run(
        &RunConfig {
            checkpoint: Some(CheckpointConfig {
                dir: dir.0.clone(),
                every: 2,
            }),
            ..cfg.clone()
        },
        2,
    );
    let rest = run(
        &RunConfig {
            resume_from: first.checkpoints.last().cloned(),
            ..cfg.clone()
        },
        4,
    );
    let resumed: Vec<f64> = first
        .steps
        .iter()
        .chain(&rest.steps)
        .map(|s| s.loss)
        .collect();
    assert_eq!(losses(&whole), resumed, "{name}");
    assert_eq!(
        whole.params.max_rel_diff(&rest.params, 1e-6).0,
        0.0,
        "{name}"
    );
}

#[test]
fn what_the_runtime_does_not_run_is_refused() {
    let err = |cfg: RunConfig| {
        try_run(&cfg, 1, 16, Some(Opt::AdamW))
            .expect_err("refused")
            .to_string()
    };
    let e = err(RunConfig {
        zero: ZeroStage::One,
        ..dp4(GradSync::ps(2), Compression::None)
    });
    assert!(e.contains("use zero=0"), "{e}");
    let e = err(dp4(GradSync::ps(2), Compression::Bf16));
    assert!(e.contains("drop compress or use sync=allreduce"), "{e}");
    let e = err(dp4(GradSync::ps(5), Compression::None));
    assert!(e.contains("give 1 to 4"), "{e}");
    let e = err(RunConfig {
        dp: 2,
        cp: 2,
        ..dp4(
            GradSync::ps(2).with_servers(ServerRanks::Dedicated),
            Compression::None,
        )
    });
    assert!(e.contains("ps_ranks=dedicated runs beside data"), "{e}");
}

/// Async with staleness 2 saves the two older weight versions its stale
/// replicas read (one file per rank, beside the error feedback): resumed
/// at step 3, it equals the uninterrupted run bit for bit, with co-located
/// servers and with dedicated ones (which compute nothing and keep no
/// versions); without a worker's file the resume is refused, naming the rank.
#[test]
fn an_async_run_resumes_with_its_older_weight_versions() {
    for (name, sync) in [
        ("async", GradSync::async_ps(2, 2)),
        (
            "async-dedicated",
            GradSync::async_ps(2, 2).with_servers(ServerRanks::Dedicated),
        ),
    ] {
        async_resumes(name, dp4(sync, Compression::None));
    }
}

fn async_resumes(name: &str, cfg: RunConfig) {
    resumes_bit_for_bit(
        name,
        &cfg,
        "versions-rank00002",
        "no older weight versions for rank 2",
    );
}

/// Six steps straight equal three, a checkpoint and three more, losses and
/// parameters bit for bit; with the checkpoint's file starting `file`
/// removed the resume is refused with `error`.
fn resumes_bit_for_bit(name: &str, cfg: &RunConfig, file: &str, error: &str) {
    let whole = run(cfg, 6);
    let dir = Scratch::new("dpsync", name);
    let first = run(
        &RunConfig {
            checkpoint: Some(CheckpointConfig {
                dir: dir.0.clone(),
                every: 3,
            }),
            ..cfg.clone()
        },
        3,
    );
    let last = first.checkpoints.last().expect("a checkpoint").clone();
    let rest = run(
        &RunConfig {
            resume_from: Some(last.clone()),
            ..cfg.clone()
        },
        6,
    );
    let resumed: Vec<f64> = first
        .steps
        .iter()
        .chain(&rest.steps)
        .map(|s| s.loss)
        .collect();
    assert_eq!(losses(&whole), resumed, "{name}");
    assert_eq!(
        whole.params.max_rel_diff(&rest.params, 1e-6).0,
        0.0,
        "{name}"
    );
    let found = std::fs::read_dir(&last)
        .expect("the step directory")
        .flatten()
        .find(|e| e.file_name().to_string_lossy().starts_with(file))
        .unwrap_or_else(|| panic!("{name}: a {file} file"));
    std::fs::remove_file(found.path()).expect("removed");
    let e = try_run(
        &RunConfig {
            resume_from: Some(last),
            ..cfg.clone()
        },
        6,
        16,
        Some(Opt::AdamW),
    )
    .expect_err("the state is missing")
    .to_string();
    assert!(e.contains(error), "{name}: {e}");
}

/// 200 steps of gpt_tiny at sequence 32 (global batch 4 on dp 4: a quarter
/// of the train section's tokens, to keep the test short), with its own
/// AdamW and warmup-cosine schedule: each run's mean loss over the last 20
/// steps against the all-reduce's, within the bounds README.md states (the
/// measured gap rounded up by a fraction of a point). PowerSGD reaches a
/// few percent at rank 16, where only the three 256-wide matrices per
/// layer and the tied embedding are compressed; rank 4 is held to its
/// measured gap, and README.md says why it stays there.
#[test]
fn async_and_compressed_runs_train_close_to_the_all_reduce() {
    let last20 = |r: &TrainReport| {
        let l = losses(r);
        l[l.len() - 20..].iter().sum::<f64>() / 20.0
    };
    let go = |c: RunConfig| try_run(&c, 200, 32, None).unwrap_or_else(|e| panic!("{e}"));
    let base = last20(&go(dp4(GradSync::AllReduce, Compression::None)));
    let compressed = |c: &str| dp4(GradSync::AllReduce, Compression::parse(c).expect(c));
    let cases: [(&str, RunConfig, f64); 6] = [
        (
            "async staleness 2",
            dp4(GradSync::async_ps(4, 2), Compression::None),
            0.02,
        ),
        ("bf16", compressed("bf16"), 0.001),
        ("fp16", compressed("fp16"), 0.001),
        ("topk:0.1", compressed("topk:0.1"), 0.025),
        ("powersgd:16", compressed("powersgd:16"), 0.05),
        ("powersgd:4", compressed("powersgd:4"), 0.17),
    ];
    for (name, cfg, bound) in cases {
        let loss = last20(&go(cfg));
        let rel = loss / base - 1.0;
        eprintln!(
            "{name}: mean loss of the last 20 steps {loss:.4} vs {base:.4} ({:+.2}%)",
            100.0 * rel
        );
        assert!(
            rel < bound,
            "{name}: {loss} vs {base} (+{:.2}% > {:.1}%)",
            100.0 * rel,
            100.0 * bound
        );
    }
}

fn gpt2_plan(strategy: &str, allow: Allow) -> Compiled {
    let path = format!("{}/models/gpt2.dpl", env!("CARGO_MANIFEST_DIR"));
    let text = std::fs::read_to_string(&path).expect("zoo file exists");
    let unit = dplc_frontend::parse("gpt2.dpl", &text).expect("zoo file parses");
    let l = unit.lower("gpt2").expect("gpt2 lowers");
    let mut req = PlanRequest::new(
        &l.graph,
        l.train.clone(),
        parse_cluster("4x8xA100").unwrap(),
    );
    req.pinned = parse_strategy(strategy).unwrap();
    req.pinned.allow = allow;
    compile(&req).unwrap_or_else(|e| panic!("gpt2 `{strategy}`: {e}"))
}

/// GPT-2 (124M) on 32 A100s as dp 32 with micro-batch 1 and the gradient
/// reduction after backward, so the reduction is on the critical path.
const EXPOSED: &str = "dp=32,mb=1,zero=0,overlap=off";

#[test]
fn the_planner_prices_servers_and_compression_in_the_order_of_their_bytes() {
    let priced = |extra: &str| {
        let c = gpt2_plan(&format!("{EXPOSED},{extra}"), Allow::default());
        let e = &c.plan.estimate;
        (e.step_time_s, e.breakdown.dp_link_bytes as f64)
    };
    let (t_ring, b_ring) = priced("sync=allreduce");
    let (t_ps32, b_ps32) = priced("sync=ps");
    let (t_ps1, b_ps1) = priced("sync=ps,ps_shards=1");
    let (t_async, b_async) = priced("sync=async,staleness=1");
    let (t_bf16, b_bf16) = priced("compress=bf16");
    let (t_topk, b_topk) = priced("compress=topk:0.01");
    let (t_psgd, b_psgd) = priced("compress=powersgd:4");
    let (t_psd, b_psd) = priced("sync=ps,ps_ranks=dedicated");
    let (_, b_psd1) = priced("sync=ps,ps_shards=1,ps_ranks=dedicated");
    // A shard per worker carries the ring's bytes (BytePS); one server
    // carries n − 1 gradients each way: 31/1.94 = 16× the ring's.
    assert!((b_ps32 / b_ring - 1.0).abs() < 1e-3, "{b_ps32} vs {b_ring}");
    assert!((b_ps1 / b_ring - 16.0).abs() < 0.1, "{b_ps1} vs {b_ring}");
    assert_eq!(b_async, b_ps32);
    // 32 dedicated servers: a worker pushes and pulls the gradient once,
    // a server 32/32 of it — half the ring's 2·31/32; one dedicated server
    // takes all 32 workers' gradients: 32×.
    assert!(
        (b_psd / b_ring - 16.0 / 31.0).abs() < 1e-3,
        "{b_psd} vs {b_ring}"
    );
    assert!((b_psd1 / b_psd - 32.0).abs() < 1e-3);
    // Fewer bytes are not less time across nodes: a server's pieces go point
    // to point, each rank's through its own NIC, where the ring reduces
    // inside each node and crosses on all eight NICs side by side. So the
    // dedicated servers (half the ring's bytes, 1× a worker's NIC) and a
    // shard per worker (the ring's bytes) both lose to the ring here, the
    // dedicated ones less.
    assert!(t_psd > t_ring, "{t_psd} vs {t_ring}");
    assert!(t_psd < t_ps32, "{t_psd} vs {t_ps32}");
    // bf16 halves the ring; top-k 1% sends (n−1)·k pairs of 8 bytes, 0.62×
    // the fp32 gradient at n = 32; PowerSGD rank 4 a few percent of it.
    assert!((b_bf16 / b_ring - 0.5).abs() < 1e-3);
    assert!(b_psgd < b_topk && b_topk < b_bf16 && b_bf16 < b_ring && b_ring < b_ps1);
    // Step times: the lone server is the slowest by far; async hides its
    // traffic behind the next step; every compression beats fp32 here.
    assert!(t_ps1 > 1.3 * t_ring, "{t_ps1} vs {t_ring}");
    assert!(t_async < t_ps32 && t_async < t_ring);
    assert!(t_ps32 > 1.1 * t_ring, "{t_ps32} vs {t_ring}");
    for (name, t) in [("bf16", t_bf16), ("topk", t_topk), ("powersgd", t_psgd)] {
        assert!(t < t_ring, "{name}: {t} vs {t_ring}");
    }
    // explain's what-ifs say the same, with the reason.
    let plan = gpt2_plan(EXPOSED, Allow::default()).plan;
    let line = |change: &str| {
        plan.what_if
            .iter()
            .find(|w| w.change == change)
            .unwrap_or_else(|| panic!("no what-if `{change}`"))
            .clone()
    };
    let ps1 = line("sync=ps,ps_shards=1");
    assert_eq!(ps1.step_time_s, Some(t_ps1));
    assert!(
        ps1.note
            .contains("server link carries 31.00× the gradient bytes"),
        "{}",
        ps1.note
    );
    assert!(
        ps1.note
            .contains("point to point at 26 GB/s a rank, where the ring runs at 160"),
        "{}",
        ps1.note
    );
    assert_eq!(line("compress=powersgd:4").step_time_s, Some(t_psgd));
    let dedicated = line("sync=ps,ps_ranks=dedicated");
    assert_eq!(dedicated.step_time_s, Some(t_psd));
    assert!(
        dedicated
            .note
            .contains("32 server ranks beyond the cluster's 32 devices"),
        "{}",
        dedicated.note
    );
}

#[test]
fn the_search_changes_the_training_dynamics_only_when_allowed() {
    let plain = gpt2_plan(EXPOSED, Allow::default()).plan;
    assert_eq!(plain.strategy.sync, GradSync::AllReduce);
    assert_eq!(plain.strategy.compress, Compression::None);
    // Not allowed: the space is the all-reduce's alone.
    let pinned = gpt2_plan(
        &format!("{EXPOSED},sync=allreduce,compress=none"),
        Allow::default(),
    )
    .plan;
    assert_eq!(
        plain.search.configs_evaluated,
        pinned.search.configs_evaluated
    );
    let free = gpt2_plan(
        EXPOSED,
        Allow {
            sync: true,
            compress: true,
            ..Allow::default()
        },
    )
    .plan;
    assert!(free.search.configs_evaluated > plain.search.configs_evaluated);
    assert!(
        free.strategy.sync != GradSync::AllReduce || free.strategy.compress != Compression::None
    );
    assert!(free.estimate.step_time_s < plain.estimate.step_time_s);
}

#[test]
fn strategy_keys_are_checked_where_they_are_read() {
    let e = |s: &str| parse_strategy(s).expect_err(s).to_string();
    assert!(e("staleness=2").contains("give it with sync=async"));
    assert!(e("ps_shards=2").contains("give it with sync=ps or sync=async"));
    assert!(e("compress=topk:2").contains("topk:F (F a fraction in (0, 1]"));
    assert!(e("compress=topk:1e-7").contains("at least 1e-6"));
    assert!(e("compress=powersgd:0").contains("powersgd:R (R a positive rank)"));
    assert!(e("sync=gossip").contains("sync is allreduce, ps or async"));
    assert!(e("ps_ranks=dedicated").contains("give it with sync=ps or sync=async"));
    assert!(e("sync=ps,ps_ranks=remote").contains("ps_ranks is colocated"));
    let d = parse_strategy("sync=ps,ps_shards=2,ps_ranks=dedicated").unwrap();
    assert_eq!(parse_strategy(&d.to_string()).unwrap(), d);
    let c = parse_strategy("sync=async,ps_shards=2,staleness=3,compress=none").unwrap();
    assert_eq!(parse_strategy(&c.to_string()).unwrap(), c);
    assert!(Allow::parse("sync,fast").is_err());
    // Pins no plan can satisfy say what to change.
    let refused = |strategy: &str| {
        let path = format!("{}/models/gpt2.dpl", env!("CARGO_MANIFEST_DIR"));
        let text = std::fs::read_to_string(&path).expect("zoo file exists");
        let unit = dplc_frontend::parse("gpt2.dpl", &text).expect("zoo file parses");
        let l = unit.lower("gpt2").expect("gpt2 lowers");
        let mut req = PlanRequest::new(
            &l.graph,
            l.train.clone(),
            parse_cluster("4x8xA100").unwrap(),
        );
        req.pinned = parse_strategy(strategy).unwrap();
        compile(&req).expect_err(strategy).to_string()
    };
    assert!(refused("sync=ps,zero=1").contains("pin zero=0"));
    assert!(refused("sync=ps,compress=bf16").contains("drop compress or pin sync=allreduce"));
    assert!(refused("dp=8,sync=ps,ps_shards=16").contains("give ps_shards at most dp"));
    assert!(refused("cp=2,sync=ps,ps_ranks=dedicated").contains("drop cp and ep"));
}
