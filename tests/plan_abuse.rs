//! Bad input to the planning commands gets an error naming the field or flag
//! and what is wrong, a non-zero exit, never a panic, a hang or a false
//! success: plan files edited by hand, sizes past what dplc plans for,
//! overflowing cluster counts, repeated strategy keys. The last test mutates
//! real plans at random (fixed seed) and checks every outcome.

use dplc_ir::{Graph, ModelSource, PipelineSchedule, Plan};
use dplc_planner::{parse_cluster, parse_strategy, PlanRequest};
use std::collections::HashMap;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::PathBuf;
use std::process::Output;

const TINY: &str = include_str!("../models/tiny.dpl");

fn dplc(args: &[&str]) -> Output {
    std::process::Command::new(env!("CARGO_BIN_EXE_dplc"))
        .args(args)
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .env("NO_COLOR", "1")
        .output()
        .expect("the dplc binary runs")
}

/// The error `dplc args` stops with: exit 1, no panic, on one line.
fn refused(args: &[&str]) -> String {
    let out = dplc(args);
    let err = String::from_utf8_lossy(&out.stderr).to_string();
    assert_eq!(
        out.status.code(),
        Some(1),
        "dplc {} should fail cleanly; stderr: {err}",
        args.join(" ")
    );
    assert!(!err.contains("panicked"), "dplc {}: {err}", args.join(" "));
    // miette wraps long lines; join them for matching.
    err.lines()
        .map(|l| l.trim().trim_start_matches(['x', '|']).trim())
        .collect::<Vec<_>>()
        .join(" ")
}

/// `needle` is in `err`, whitespace aside (miette wraps long lines, even
/// inside words at a hyphen).
fn assert_says(err: &str, needle: &str) {
    let squeeze = |s: &str| s.split_whitespace().collect::<String>();
    assert!(
        squeeze(err).contains(&squeeze(needle)),
        "`{needle}` missing from: {err}"
    );
}

fn tmp(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("dplc-plan-abuse-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    dir.join(name)
}

fn lower(model: &str) -> dplc_frontend::Lowered {
    dplc_frontend::parse("models/tiny.dpl", TINY)
        .expect("the zoo parses")
        .lower(model)
        .expect("the zoo lowers")
}

/// A plan of `model` on `cluster`, made through the library as `dplc
/// compile` makes it, carrying its source.
fn compile(model: &str, cluster: &str, strategy: &str, global_batch: Option<u64>) -> Plan {
    let lowered = lower(model);
    let mut req = PlanRequest::new(
        &lowered.graph,
        lowered.train.clone(),
        parse_cluster(cluster).expect("cluster"),
    );
    req.pinned = parse_strategy(strategy).expect("strategy");
    req.global_batch = global_batch;
    req.top_k = 2;
    let mut plan = dplc_planner::compile(&req)
        .unwrap_or_else(|e| panic!("{model} on {cluster} `{strategy}`: {e}"))
        .plan;
    plan.source = ModelSource {
        file: "models/tiny.dpl".into(),
        model: model.into(),
        text: TINY.into(),
    };
    plan
}

fn ron_text(plan: &Plan) -> String {
    ron::ser::to_string_pretty(plan, ron::ser::PrettyConfig::default()).expect("plans serialise")
}

fn write(plan: &Plan, name: &str) -> PathBuf {
    let path = tmp(name);
    std::fs::write(&path, ron_text(plan)).expect("write plan");
    path
}

/// Every command that reads a plan refuses `plan` with `needle` in the message.
fn every_command_refuses(plan: &Plan, name: &str, needle: &str) {
    let path = write(plan, name);
    let p = path.to_str().expect("UTF-8 path");
    for args in [
        vec!["explain", p],
        vec!["explain", p, "--json"],
        vec!["viz", p, "--format", "html"],
        vec!["viz", p, "--format", "trace"],
        vec!["viz", p, "--format", "dot"],
        vec!["verify", p, "--steps", "1"],
    ] {
        let err = refused(&args);
        assert_says(&err, "is not a plan dplc can use");
        assert_says(&err, needle);
        assert_says(&err, "compile the plan again");
    }
}

#[test]
fn impossible_plans_are_refused_by_explain_viz_and_verify() {
    let base = compile("gpt_tiny", "4xcpu", "tp=2", None);
    assert_eq!((base.mesh.dp, base.mesh.tp), (2, 2));
    let edit = |f: &dyn Fn(&mut Plan)| {
        let mut p = base.clone();
        f(&mut p);
        p
    };
    let cases: Vec<(&str, Plan, &str)> = vec![
        (
            "no-stages",
            edit(&|p| p.stages.clear()),
            "stages: 0 stages for a pipeline of pp 1",
        ),
        (
            "dp3",
            edit(&|p| p.mesh.dp = 3),
            "mesh: dp 3 × tp 2 × pp 1 × cp 1 = 6 devices, but the cluster has 4",
        ),
        (
            "tp3",
            edit(&|p| {
                p.mesh.tp = 3;
                p.mesh.dp = 1;
            }),
            "mesh: dp 1 × tp 3 × pp 1 × cp 1 = 3 devices, but the cluster has 4",
        ),
        (
            "batch0",
            edit(&|p| p.strategy.global_batch = 0),
            "strategy.global_batch: the global batch must be positive",
        ),
        (
            "zero9",
            edit(&|p| p.strategy.zero_stage = 9),
            "strategy.zero_stage: ZeRO stage 9; stages are 0, 1, 2 and 3",
        ),
        (
            "group0",
            edit(&|p| {
                if let Some((_, link)) = p.collectives[0].group {
                    p.collectives[0].group = Some((0, link));
                }
            }),
            "collectives[0].group: 0 ranks; a group holds 1 to the cluster's 4",
        ),
        (
            "nodes",
            edit(&|p| p.cluster.nodes = 2),
            "mesh: dp 2 × tp 2 × pp 1 × cp 1 = 4 devices, but the cluster has 8",
        ),
        (
            "micro",
            edit(&|p| p.strategy.micro_batch = 3),
            "strategy.micro_batch: dp 2 × micro-batch 3 × 1 micro-batches = 6 samples, but the global batch is 8",
        ),
        (
            "layers",
            edit(&|p| p.stages[0].layers = 5),
            "stages[0]: layers 0..0+5 run past the model's 2 layers",
        ),
        (
            "seq",
            edit(&|p| p.strategy.seq = 1 << 40),
            "strategy.seq: the sequence length 1099511627776 is too large",
        ),
        (
            "context",
            edit(&|p| p.strategy.seq = 128),
            "the sequence length 128 is longer than `gpt_tiny` reads: its position table `wpe` has 64 rows",
        ),
        (
            "virtual",
            edit(&|p| p.strategy.virtual_stages = 2),
            "strategy.virtual_stages: 2 needs the interleaved schedule, not 1f1b",
        ),
        (
            "reserve",
            edit(&|p| p.stages[0].memory.reserve = p.stages[0].memory.buffers + 1),
            "stages[0]: its runtime reserve",
        ),
        (
            "bf16_ends",
            edit(&|p| p.strategy.fp8_bf16_ends = u64::MAX),
            "strategy.fp8_bf16_ends: 18446744073709551615: the first and last layers kept in bf16 need fp8",
        ),
        (
            "recompute_layers",
            edit(&|p| p.strategy.recompute_layers = 2),
            "strategy.recompute_layers: 2: recomputing some layers of each chunk needs recompute = full",
        ),
        (
            "layout",
            edit(&|p| {
                p.mesh.tp = 4;
                p.mesh.dp = 1;
                p.strategy.micro_batch = 8;
                for a in &mut p.mesh.axes {
                    a.size = match a.axis {
                        dplc_ir::MeshAxis::Tp => 4,
                        dplc_ir::MeshAxis::Dp => 1,
                        _ => a.size,
                    };
                }
            }),
            "layout: for tp 2 ep 1 sequence parallel true, but the plan runs tp 4",
        ),
        (
            "sp-seq",
            edit(&|p| {
                p.strategy.sequence_parallel = true;
                p.strategy.seq = 31;
            }),
            "strategy.sequence_parallel: sequence parallelism splits the sequence over the tensor-parallel group: tp 2 must divide seq 31; use sp=off",
        ),
        (
            "step-time",
            edit(&|p| p.estimate.step_time_s = f64::NAN),
            "estimate.step_time_s: NaN; it is a finite number > 0",
        ),
    ];
    for (name, plan, needle) in &cases {
        every_command_refuses(plan, &format!("{name}.ron"), needle);
    }
}

#[test]
fn a_layout_the_model_cannot_take_names_the_heads() {
    // gpt_tiny has 4 heads: tp 3 cannot split them, on a cluster where the
    // mesh itself is fine.
    let mut p = compile("gpt_tiny", "6xcpu", "tp=2", Some(12));
    assert_eq!((p.mesh.dp, p.mesh.tp), (3, 2));
    p.mesh.tp = 3;
    p.mesh.dp = 2;
    // Sequence parallelism would be refused first: tp 3 does not divide seq 64.
    p.strategy.sequence_parallel = false;
    p.strategy.micro_batch = 6;
    p.strategy.num_micro_batches = 1;
    p.mesh.axes.clear();
    p.layout = None;
    p.programs.clear();
    let path = write(&p, "tp3-heads.ron");
    let err = refused(&["explain", path.to_str().expect("UTF-8")]);
    assert_says(
        &err,
        "layout: the plan has none, and tp 3 ep 1 cannot split `gpt_tiny`",
    );
    assert_says(
        &err,
        "tp 3 divides neither dimension of `layers.attention.q.w` ([64, 64])",
    );
}

#[test]
fn sizes_past_the_limits_are_refused_by_name() {
    let compile = |extra: &[&str]| {
        let mut args = vec![
            "compile",
            "models/tiny.dpl",
            "--model",
            "llama_tiny",
            "--cluster",
            "4xcpu",
        ];
        args.extend_from_slice(extra);
        refused(&args)
    };
    let err = compile(&["--seq", "18446744073709551615"]);
    assert_says(
        &err,
        "--seq 18446744073709551615: the sequence length 18446744073709551615 is too large: dplc plans for at most 16777216 (2^24 tokens; positions are 32-bit)",
    );
    assert_says(&compile(&["--seq", "9223372036854775808"]), "is too large");
    assert_says(
        &compile(&["--global-batch", "18446744073709551615"]),
        "--global-batch 18446744073709551615: the global batch 18446744073709551615 is too large: dplc plans for at most 16777216 (2^24 sequences)",
    );
    assert_says(
        &compile(&["--global-batch", "0"]),
        "--global-batch 0: the global batch must be positive",
    );
    assert_says(
        &compile(&["--seq", "0"]),
        "--seq 0: the sequence length must be positive",
    );
    // Within the limits the search stays bounded: a million devices and the
    // largest batch plan in well under a second of search.
    let out = dplc(&[
        "compile",
        "models/tiny.dpl",
        "--model",
        "llama_tiny",
        "--cluster",
        "1048576xH100",
        "--global-batch",
        "16777216",
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
fn the_library_refuses_what_the_flags_refuse() {
    let lowered = lower("llama_tiny");
    let plan = |seq: Option<u64>, global_batch: Option<u64>, cluster: dplc_planner::Cluster| {
        let mut req = PlanRequest::new(&lowered.graph, lowered.train.clone(), cluster);
        req.seq = seq;
        req.global_batch = global_batch;
        dplc_planner::compile(&req)
            .map(|_| ())
            .unwrap_err()
            .to_string()
    };
    let cpu = || parse_cluster("4xcpu").expect("cluster");
    assert_says(
        &plan(Some(u64::MAX), None, cpu()),
        "cannot plan: the sequence length 18446744073709551615 is too large",
    );
    assert_says(
        &plan(None, Some(u64::MAX), cpu()),
        "cannot plan: the global batch 18446744073709551615 is too large",
    );
    // A cluster built by hand, past the shorthand's checks.
    let huge =
        dplc_planner::Cluster::new(65536, 65536, dplc_planner::device("H100").expect("device"));
    assert_says(
        &plan(None, None, huge),
        "cannot plan: 65536 nodes × 65536 devices = 4294967296 is too large: dplc plans for at most 1048576 (2^20 devices)",
    );
    let wraps = dplc_planner::Cluster::new(
        1 << 33,
        1 << 33,
        dplc_planner::device("H100").expect("device"),
    );
    assert_says(&plan(None, None, wraps), "overflows a 64-bit count");
}

#[test]
fn the_largest_top_lists_every_plan() {
    // `--top usize::MAX` once wrapped `top + 1` to zero: "does not fit".
    let out = dplc(&[
        "compile",
        "models/tiny.dpl",
        "--model",
        "gpt_tiny",
        "--cluster",
        "4xcpu",
        "--top",
        "18446744073709551615",
    ]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert!(!stderr.contains("does not fit"), "{stderr}");
    let lowered = lower("gpt_tiny");
    let mut req = PlanRequest::new(
        &lowered.graph,
        lowered.train.clone(),
        parse_cluster("4xcpu").expect("cluster"),
    );
    req.top_k = usize::MAX;
    let compiled = dplc_planner::compile(&req).expect("the largest top plans");
    req.top_k = 3;
    let three = dplc_planner::compile(&req).expect("top 3 plans");
    assert_eq!(compiled.plan.mesh, three.plan.mesh, "the same winner");
}

#[test]
fn sequence_parallelism_needs_tp_to_divide_seq() {
    // Unpinned, the search once took tp 2 with sp at seq 31, which the
    // runtime refused; it keeps sp off where tp does not divide seq.
    let lowered = lower("gpt_tiny");
    let mut req = PlanRequest::new(
        &lowered.graph,
        lowered.train.clone(),
        parse_cluster("2xcpu").expect("cluster"),
    );
    req.global_batch = Some(1);
    for seq in [31, 32] {
        req.seq = Some(seq);
        let plan = dplc_planner::compile(&req).expect("plans").plan;
        assert!(
            !plan.strategy.sequence_parallel || seq.is_multiple_of(plan.mesh.tp),
            "seq {seq}: sp with tp {}",
            plan.mesh.tp
        );
    }
    let args = |seq: &'static str, extra: &[&'static str]| {
        let mut a = vec![
            "models/tiny.dpl",
            "--model",
            "gpt_tiny",
            "--cluster",
            "2xcpu",
            "--global-batch",
            "1",
            "--seq",
            seq,
        ];
        a.extend_from_slice(extra);
        a
    };
    let out = dplc(&[&["run"][..], &args("31", &["--steps", "2"])].concat());
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // Pinned, the planner refuses it and names the fix.
    let err = refused(&[&["compile"][..], &args("31", &["--strategy", "tp=2,sp=on"])].concat());
    assert_says(
        &err,
        "sp: sequence parallelism splits the sequence over the tensor-parallel group: tp 2 must divide seq 31; use sp=off",
    );
    let out = dplc(&[&["compile"][..], &args("32", &["--strategy", "tp=2,sp=on"])].concat());
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
fn a_model_that_cannot_train_is_refused_at_compile_by_its_line() {
    let no_params = "model m(d = 4) {\n    input x: f32[batch, d]\n    h = x\n    repeat 2 {\n        h = h * 2.0\n    }\n    return sum(sum(h))\n}\n";
    let no_loss = TINY.replace(
        "return cross_entropy(h @ transpose(wte), targets)",
        "return h @ transpose(wte)",
    );
    assert_ne!(no_loss, TINY);
    for (name, text, model, needle, at) in [
        (
            "noparams.dpl",
            no_params.to_string(),
            "m",
            "`m` has no parameters: a training step updates parameters, so a model needs some to train",
            "noparams.dpl:1:7",
        ),
        (
            "noloss.dpl",
            no_loss,
            "gpt_tiny",
            "`gpt_tiny` returns f32[batch, seq, 256] first, not a scalar float loss",
            "noloss.dpl:14:5",
        ),
    ] {
        let path = tmp(name);
        std::fs::write(&path, &text).expect("write model");
        let p = path.to_str().expect("UTF-8");
        for command in ["compile", "run"] {
            let err = refused(&[command, p, "--model", model, "--cluster", "2xcpu"]);
            assert_says(&err, needle);
            assert_says(&err, at);
            assert!(!err.contains("bug in dplc"), "{err}");
        }
        // Not training, a model may return anything.
        let out = dplc(&["inspect", p, "--model", model]);
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        // The library refuses it too, before it searches.
        let lowered = dplc_frontend::parse(name, &text)
            .expect("parses")
            .lower(model)
            .expect("lowers");
        let req = PlanRequest::new(
            &lowered.graph,
            lowered.train.clone(),
            parse_cluster("2xcpu").expect("cluster"),
        );
        let e = dplc_planner::compile(&req).map(|_| ()).unwrap_err().to_string();
        assert_says(&e, needle);
    }
}

#[test]
fn a_plan_must_agree_with_its_device_its_memory_and_its_source() {
    let base = compile("gpt_tiny", "4xcpu", "tp=2", None);
    let edit = |f: &dyn Fn(&mut Plan)| {
        let mut p = base.clone();
        f(&mut p);
        p
    };
    let wider = TINY.replacen("d = 64", "d = 128", 1);
    assert_ne!(wider, TINY);
    let cases: Vec<(&str, Plan, &str)> = vec![
        (
            "params1",
            edit(&|p| p.params = 1),
            "params: the plan records 1 parameters, but its source lowers `gpt_tiny` to 120576",
        ),
        (
            "tpu",
            edit(&|p| p.cluster.device = "TPU".into()),
            "cluster.device: `TPU` is not in dplc's catalog",
        ),
        (
            "mem1",
            edit(&|p| p.cluster.memory_bytes = 1),
            "more than the device's 1 (cluster.memory_bytes): the plan does not fit",
        ),
        (
            "mem-catalog",
            edit(&|p| p.cluster.memory_bytes *= 2),
            "cluster.memory_bytes: 34359738368 bytes, but the catalog's `cpu` has 17179869184",
        ),
        (
            "peak",
            edit(&|p| p.estimate.peak_memory_bytes = 1),
            "estimate.peak_memory_bytes: 1 bytes, but the largest stage holds",
        ),
        (
            "d128",
            edit(&|p| p.source.text = wider.clone()),
            "params: the plan records 120576 parameters, but its source lowers `gpt_tiny` to 437760",
        ),
        (
            "sharding",
            edit(&|p| p.param_sharding[0].elements += 1),
            "param_sharding[0]: `wte` has 16385 elements in the plan, 16384 in its source",
        ),
        (
            "sharding-name",
            edit(&|p| p.param_sharding[0].name = "nope".into()),
            "param_sharding[0]: `nope` is not a parameter of `gpt_tiny`",
        ),
    ];
    for (name, plan, needle) in &cases {
        every_command_refuses(plan, &format!("{name}.ron"), needle);
    }
    // A device a cluster section describes is recorded in the plan, and
    // loads as the catalog's do.
    let path = tmp("custom-cluster.dpl");
    std::fs::write(
        &path,
        "cluster mine {\n    devices_per_node = 2\n    device = accelerator(name = \"X\", bf16 = 100 TFLOP/s, \
         memory = 16 GB, memory_bandwidth = 1 TB/s)\n    intra_node = nvlink(bandwidth = 100 GB/s, latency = 2 us)\n}\n",
    )
    .expect("write cluster");
    let plan_path = tmp("custom.ron");
    let out = dplc(&[
        "compile",
        "models/tiny.dpl",
        "--model",
        "gpt_tiny",
        "--cluster",
        path.to_str().expect("UTF-8"),
        "-o",
        plan_path.to_str().expect("UTF-8"),
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let out = dplc(&["explain", plan_path.to_str().expect("UTF-8")]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let mut custom: Plan =
        ron::from_str(&std::fs::read_to_string(&plan_path).expect("read plan")).expect("a plan");
    assert_eq!(custom.cluster.device, "X");
    custom.cluster.device = "Y".into();
    every_command_refuses(
        &custom,
        "custom-renamed.ron",
        "cluster.device: `Y`, but the plan's accelerator(…) is named `X`",
    );
}

#[test]
fn seq_beyond_the_position_table_is_refused() {
    let err = refused(&[
        "compile",
        "models/tiny.dpl",
        "--model",
        "gpt_tiny",
        "--cluster",
        "4xcpu",
        "--seq",
        "4096",
    ]);
    assert_says(
        &err,
        "cannot plan: the sequence length 4096 is longer than `gpt_tiny` reads: its position table `wpe` has 64 rows",
    );
    let err = refused(&[
        "inspect",
        "models/tiny.dpl",
        "--model",
        "gpt_tiny",
        "--seq",
        "65",
    ]);
    assert_says(&err, "--seq 65: the sequence length 65 is longer than");
}

#[test]
fn inspect_refuses_seq_zero() {
    let err = refused(&[
        "inspect",
        "models/tiny.dpl",
        "--model",
        "llama_tiny",
        "--seq",
        "0",
    ]);
    assert_says(&err, "--seq 0: the sequence length must be positive");
    assert!(!err.contains("NaN"), "{err}");
}

#[test]
fn cluster_counts_that_overflow_are_named() {
    let compile = |cluster: &str| {
        refused(&[
            "compile",
            "models/tiny.dpl",
            "--model",
            "gpt_tiny",
            "--cluster",
            cluster,
        ])
    };
    let err = compile("99999999999999999999xH100");
    assert_says(
        &err,
        "cannot read cluster `99999999999999999999xH100`: the count 99999999999999999999 overflows a 64-bit number; dplc plans for at most 1048576 devices",
    );
    assert!(!err.contains("not a shorthand"), "{err}");
    assert_says(
        &compile("65536x65536xH100"),
        "65536 nodes × 65536 devices = 4294967296 is too large: dplc plans for at most 1048576 (2^20 devices)",
    );
    assert_says(
        &compile("4294967296x4294967296xH100"),
        "4294967296 nodes × 4294967296 devices overflows a 64-bit count",
    );
}

#[test]
fn a_repeated_strategy_key_is_an_error() {
    let err = refused(&[
        "compile",
        "models/tiny.dpl",
        "--model",
        "gpt_tiny",
        "--cluster",
        "4xcpu",
        "--strategy",
        "tp=2,tp=4",
    ]);
    assert_says(
        &err,
        "cannot read strategy `tp=2,tp=4`: tp is given twice (`tp=2` and `tp=4`); give each key once",
    );
}

// ---- the property test ----

/// SplitMix64: a fixed seed, the same mutants on every run.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n.max(1) as u64) as usize
    }
    fn pick<'a, T>(&mut self, xs: &'a [T]) -> &'a T {
        &xs[self.below(xs.len())]
    }
}

const NUMBERS: &[&str] = &[
    "0",
    "1",
    "2",
    "3",
    "5",
    "-1",
    "-7",
    "18446744073709551615",
    "9223372036854775808",
    "4294967296",
    "1e308",
    "-0.5",
    "NaN",
    "inf",
];

/// One random edit of a plan, as a person might make in a text editor or
/// a tool might make by mistake.
fn mutate(base: &Plan, rng: &mut Rng) -> String {
    let mut p = base.clone();
    let big = [0u64, 1, 2, 3, 4, 8, 1 << 20, u64::MAX];
    match rng.below(12) {
        // Numbers in the text: zero, huge, negative, non-finite.
        0..=3 => {
            let text = ron_text(&p);
            let spots: Vec<(usize, usize)> = number_spots(&text);
            let (start, end) = *rng.pick(&spots);
            return format!("{}{}{}", &text[..start], rng.pick(NUMBERS), &text[end..]);
        }
        // A one-line field deleted.
        4 => {
            let text = ron_text(&p);
            let lines: Vec<&str> = text.lines().collect();
            let simple: Vec<usize> = (0..lines.len())
                .filter(|&i| {
                    let l = lines[i].trim();
                    l.contains(": ") && l.ends_with(',') && !l.ends_with("(,") && !l.contains('[')
                })
                .collect();
            let drop = *rng.pick(&simple);
            return lines
                .iter()
                .enumerate()
                .filter(|&(i, _)| i != drop)
                .map(|(_, l)| *l)
                .collect::<Vec<_>>()
                .join("\n");
        }
        5 => match rng.below(5) {
            0 => p.stages.clear(),
            1 if !p.stages.is_empty() => {
                let i = rng.below(p.stages.len());
                p.stages.remove(i);
            }
            2 if !p.stages.is_empty() => {
                let i = rng.below(p.stages.len());
                p.stages.push(p.stages[i].clone());
            }
            3 => p.stages.reverse(),
            _ if !p.stages.is_empty() => {
                let i = rng.below(p.stages.len());
                let s = &mut p.stages[i];
                match rng.below(3) {
                    0 => s.layers = *rng.pick(&big),
                    1 => s.first_layer = *rng.pick(&big),
                    _ => s.stage = *rng.pick(&big),
                }
            }
            _ => {}
        },
        6 => {
            let m = &mut p.mesh;
            let d = *rng.pick(&big);
            match rng.below(6) {
                0 => m.dp = d,
                1 => m.tp = d,
                2 => m.pp = d,
                3 => m.cp = d,
                4 => m.ep = d,
                _ => std::mem::swap(&mut m.dp, &mut m.tp),
            }
        }
        7 => {
            let s = &mut p.strategy;
            match rng.below(7) {
                0 => s.zero_stage = rng.next() as u8,
                1 => s.global_batch = *rng.pick(&big),
                2 => s.micro_batch = *rng.pick(&big),
                3 => s.num_micro_batches = *rng.pick(&big),
                4 => s.virtual_stages = *rng.pick(&big),
                5 => {
                    s.schedule = *rng.pick(&[
                        PipelineSchedule::GPipe,
                        PipelineSchedule::OneFOneB,
                        PipelineSchedule::Interleaved,
                    ])
                }
                _ => s.sequence_parallel = !s.sequence_parallel,
            }
        }
        8 => {
            let c = &mut p.cluster;
            match rng.below(3) {
                0 => c.nodes = *rng.pick(&big),
                1 => c.devices_per_node = *rng.pick(&big),
                _ => c.memory_bytes = *rng.pick(&big),
            }
        }
        9 => match rng.below(3) {
            0 => p.layout = None,
            1 => p.programs.clear(),
            _ => p.layers = *rng.pick(&big),
        },
        10 => match rng.below(3) {
            0 => p.source.text.truncate(p.source.text.len() / 2),
            1 => p.source.model = "no_such_model".into(),
            _ => p.model = "llama_tiny".into(),
        },
        // Two edits that keep the mesh's product: a consistent-looking lie.
        _ => {
            let m = &mut p.mesh;
            std::mem::swap(&mut m.dp, &mut m.pp);
        }
    }
    ron_text(&p)
}

/// Byte ranges of the numbers after `field: ` in RON text.
fn number_spots(text: &str) -> Vec<(usize, usize)> {
    let b = text.as_bytes();
    let mut out = Vec::new();
    let mut i = 0;
    while let Some(off) = text[i..].find(": ") {
        let start = i + off + 2;
        let mut end = start;
        while end < b.len() && (b[end].is_ascii_digit() || b"-+.eE".contains(&b[end])) {
            end += 1;
        }
        if end > start && b[start] != b'e' && b[start] != b'E' {
            out.push((start, end));
        }
        i = start;
    }
    out
}

/// What `read_plan` does, with the model lowered once per source: parse,
/// validate (the plan, its device), and check against the carried model (with the planner's layout
/// where the plan has none).
fn load(
    text: &str,
    models: &mut HashMap<(String, String), Result<Graph, String>>,
) -> Result<Plan, String> {
    let plan: Plan = ron::from_str(text).map_err(|e| format!("not a plan: {e}"))?;
    plan.validate().map_err(|e| e.to_string())?;
    dplc_planner::check_plan_cluster(&plan).map_err(|e| e.to_string())?;
    if plan.source.text.is_empty() {
        return Ok(plan);
    }
    let key = (plan.source.text.clone(), plan.source.model.clone());
    let graph = models
        .entry(key)
        .or_insert_with(|| {
            let unit =
                dplc_frontend::parse("plan", &plan.source.text).map_err(|e| e.to_string())?;
            unit.lower(&plan.source.model)
                .map(|l| l.graph)
                .map_err(|e| e.to_string())
        })
        .clone()?;
    if graph.name != plan.model {
        return Err("model".into());
    }
    let mut checked = plan.clone();
    let m = &plan.mesh;
    if checked.layout.is_none() && (m.tp > 1 || m.ep > 1) {
        checked.layout = Some(
            dplc_planner::derive_layout(&graph, m.tp, m.ep, plan.strategy.sequence_parallel)
                .map_err(|e| e.to_string())?,
        );
    }
    checked.check_against(&graph).map_err(|e| e.to_string())?;
    Ok(plan)
}

/// The facts that make a plan runnable, checked here without the
/// validator's code: an accepted plan must satisfy every one.
fn consistent(plan: &Plan, graph: &Graph) -> Result<(), String> {
    let (m, s, c) = (&plan.mesh, &plan.strategy, &plan.cluster);
    let world = c.nodes as u128 * c.devices_per_node as u128;
    let mesh = m.dp as u128 * m.tp as u128 * m.pp as u128 * m.cp as u128;
    let layers = dplc_ir::Analysis::new(graph).layers();
    let checks = [
        (mesh == world, "mesh × = world"),
        (
            [m.dp, m.tp, m.pp, m.cp, m.ep].iter().all(|&d| d > 0),
            "degrees > 0",
        ),
        (m.dp % m.ep.max(1) == 0, "ep | dp"),
        (4 % m.tp.max(1) == 0 || m.tp == 1, "tp | heads"),
        (
            s.global_batch > 0
                && s.global_batch as u128
                    == m.dp as u128 * s.micro_batch as u128 * s.num_micro_batches as u128,
            "dp × mb × m = global batch",
        ),
        (s.zero_stage <= 3, "ZeRO ≤ 3"),
        (
            s.seq > 0
                && s.seq <= 1 << 24
                && (plan.model != "gpt_tiny" || s.seq <= 64)
                && s.seq % m.cp.max(1) == 0,
            "seq",
        ),
        (plan.layers == layers, "layers"),
        (plan.stages.len() as u64 == m.pp, "one stage per pp"),
        (
            plan.stages.iter().map(|st| st.layers as u128).sum::<u128>() == layers as u128,
            "stages cover the layers",
        ),
        (
            plan.stages
                .iter()
                .enumerate()
                .all(|(i, st)| st.stage == i as u64 && st.layers >= plan.chunks()),
            "stages in order, each non-empty",
        ),
        (
            plan.stages
                .windows(2)
                .all(|w| w[0].first_layer + w[0].layers == w[1].first_layer)
                && plan.stages.first().is_some_and(|st| st.first_layer == 0),
            "stages contiguous",
        ),
        (
            s.virtual_stages == plan.chunks()
                && (plan.chunks() == 1
                    || (layers.is_multiple_of(m.pp * plan.chunks())
                        && s.num_micro_batches.is_multiple_of(m.pp))),
            "virtual stages",
        ),
        (!s.sequence_parallel || m.tp > 1, "sp needs tp"),
        (
            plan.estimate.step_time_s.is_finite() && plan.estimate.step_time_s > 0.0,
            "step time",
        ),
    ];
    match checks.iter().find(|(ok, _)| !ok) {
        Some((_, what)) => Err(what.to_string()),
        None => Ok(()),
    }
}

#[test]
fn mutated_plans_never_panic_and_never_pass_unvalidated() {
    let started = std::time::Instant::now();
    let bases = [
        compile("gpt_tiny", "4xcpu", "tp=2", None),
        compile("gpt_tiny", "4xcpu", "pp=2,dp=2", None),
        compile("llama_tiny", "2x2xcpu", "tp=2,pp=2,schedule=gpipe", None),
        compile("moe_tiny", "4xcpu", "ep=2", None),
    ];
    let mut models = HashMap::new();
    for b in &bases {
        let text = ron_text(b);
        let plan =
            load(&text, &mut models).unwrap_or_else(|e| panic!("a compiled plan loads: {e}"));
        consistent(&plan, &lower(&plan.model).graph).expect("a compiled plan is consistent");
    }
    let mut rng = Rng(0x5EED_D91C);
    let (mut accepted, mut refused_count) = (0, 0);
    let mut to_cli: Vec<String> = Vec::new();
    for i in 0..600 {
        let base = &bases[i % bases.len()];
        let text = mutate(base, &mut rng);
        let outcome = catch_unwind(AssertUnwindSafe(|| load(&text, &mut models)));
        let Ok(outcome) = outcome else {
            panic!("loading mutant {i} panicked:\n{text}");
        };
        match outcome {
            Ok(plan) => {
                accepted += 1;
                let graph = lower(&plan.model).graph;
                if let Err(what) = consistent(&plan, &graph) {
                    panic!("mutant {i} was accepted but breaks `{what}`:\n{text}");
                }
                // What viz, explain and verify do first with a plan they accept.
                let drawn = catch_unwind(|| {
                    let t = dplc_planner::timeline(&plan);
                    assert!(t.makespan_s.is_finite(), "a finite step");
                    dplc_runtime::RunConfig::from_plan(&plan).map(|_| ())
                });
                match drawn {
                    Ok(r) => r.unwrap_or_else(|e| {
                        panic!("mutant {i} was accepted but the runtime refuses it: {e}")
                    }),
                    Err(_) => panic!("mutant {i}: timeline or run config panicked:\n{text}"),
                }
            }
            Err(why) => {
                refused_count += 1;
                assert!(!why.is_empty(), "mutant {i}: an empty error");
            }
        }
        if i % 25 == 0 {
            to_cli.push(text);
        }
    }
    assert!(
        accepted > 20 && refused_count > 200,
        "{accepted} accepted, {refused_count} refused"
    );
    // The commands themselves on a sample: never a panic, and a success only
    // where the loader above accepts the plan.
    for (k, text) in to_cli.iter().enumerate() {
        let path = tmp(&format!("mutant{k}.ron"));
        std::fs::write(&path, text).expect("write mutant");
        let p = path.to_str().expect("UTF-8");
        let valid = load(text, &mut models).is_ok();
        for args in [
            vec!["explain", p],
            vec!["viz", p, "--format", "trace"],
            vec!["viz", p, "--format", "html"],
        ] {
            let out = dplc(&args);
            let err = String::from_utf8_lossy(&out.stderr);
            assert!(
                matches!(out.status.code(), Some(0 | 1)) && !err.contains("panicked"),
                "dplc {} on mutant {k}: {err}\n{text}",
                args.join(" ")
            );
            assert_eq!(
                out.status.success(),
                valid,
                "dplc {} on mutant {k} (loader says valid = {valid}): {err}\n{text}",
                args.join(" ")
            );
        }
    }
    eprintln!(
        "{accepted} mutants accepted, {refused_count} refused, {} through the CLI, in {:.1} s",
        to_cli.len(),
        started.elapsed().as_secs_f64()
    );
}
