//! `dplc export` end to end: golden exports of the zoo's golden plans to
//! Megatron-LM, torchtitan and DeepSpeed; each format read back by a real
//! parser and checked against the engine's own argument names (pinned
//! releases, recorded under tests/data with their source); the gaps an
//! engine cannot express and the closest plan it can; models the engines
//! cannot build; and `--json` errors on every subcommand.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::Output;

mod common;
use common::dplc;

fn text(bytes: &[u8]) -> String {
    String::from_utf8(bytes.to_vec()).expect("UTF-8 output")
}

fn ok(args: &[&str]) -> Output {
    let out = dplc(args);
    assert!(
        out.status.success(),
        "dplc {}: {}",
        args.join(" "),
        text(&out.stderr)
    );
    out
}

fn tmp(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("dplc-export-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    dir.join(name)
}

/// Compile to a plan file and return its path.
fn compile(file: &str, model: &str, cluster: &str, extra: &[&str], name: &str) -> PathBuf {
    let out = tmp(name);
    let mut args = vec![
        "compile",
        file,
        "--model",
        model,
        "--cluster",
        cluster,
        "-o",
        out.to_str().expect("UTF-8 temp path"),
    ];
    args.extend_from_slice(extra);
    ok(&args);
    out
}

fn export(plan: &Path, engine: &str, extra: &[&str]) -> Output {
    let mut args = vec![
        "export",
        plan.to_str().expect("UTF-8 temp path"),
        "--to",
        engine,
    ];
    args.extend_from_slice(extra);
    dplc(&args)
}

/// The zoo's golden plans (tests/planner_zoo.rs), as plan files.
fn golden_plans() -> Vec<(&'static str, PathBuf)> {
    vec![
        (
            "gpt2_on_8xa100",
            compile("models/gpt2.dpl", "gpt2", "8xA100", &[], "gpt2.ron"),
        ),
        (
            "llama3_70b_on_8x8xh100",
            compile(
                "models/llama3.dpl",
                "llama3_70b",
                "8x8xH100",
                &[],
                "llama3_70b.ron",
            ),
        ),
        (
            "gpt_1t_on_384x8xa100",
            compile(
                "models/megatron_gpt.dpl",
                "gpt_1t",
                "384x8xA100",
                &["--global-batch", "3072"],
                "gpt_1t.ron",
            ),
        ),
        (
            "mixtral_8x7b_on_2x8xh100",
            compile(
                "models/mixtral.dpl",
                "mixtral_8x7b",
                "2x8xH100",
                &[],
                "mixtral.ron",
            ),
        ),
    ]
}

const ENGINES: [&str; 3] = ["megatron", "torchtitan", "deepspeed"];

/// One argument of Megatron-Core core_v0.12.0's parser.
struct MegatronArg {
    /// `flag` (no value), or the value's type: `int`, `float`, `str`.
    ty: String,
    choices: Vec<String>,
}

fn megatron_arguments() -> BTreeMap<String, MegatronArg> {
    include_str!("data/megatron-core_v0.12.0-arguments.tsv")
        .lines()
        .filter(|l| !l.starts_with('#'))
        .map(|l| {
            let f: Vec<&str> = l.split('\t').collect();
            let choices = f[3]
                .split(',')
                .filter(|c| !c.is_empty())
                .map(str::to_string)
                .collect();
            (
                f[0].to_string(),
                MegatronArg {
                    ty: f[1].to_string(),
                    choices,
                },
            )
        })
        .collect()
}

/// The flags after `pretrain_gpt.py` in a Megatron export, with values.
fn megatron_flags(script: &str) -> Vec<(String, Option<String>)> {
    let tail = script
        .split("pretrain_gpt.py")
        .nth(1)
        .expect("the torchrun line runs pretrain_gpt.py");
    let words: Vec<&str> = tail.split_whitespace().filter(|w| *w != "\\").collect();
    let mut flags = Vec::new();
    let mut i = 0;
    while i < words.len() {
        let name = words[i];
        assert!(
            name.starts_with("--"),
            "`{name}` is not a flag in:\n{script}"
        );
        let value = words.get(i + 1).filter(|w| !w.starts_with("--"));
        flags.push((name.to_string(), value.map(|v| v.to_string())));
        i += 1 + value.is_some() as usize;
    }
    flags
}

fn check_megatron(script: &str) {
    let known = megatron_arguments();
    let flags = megatron_flags(script);
    let mut seen = BTreeSet::new();
    for (name, value) in &flags {
        assert!(seen.insert(name), "{name} is given twice");
        let arg = known
            .get(name)
            .unwrap_or_else(|| panic!("{name} is not a Megatron-LM core_v0.12.0 argument"));
        match (arg.ty.as_str(), value) {
            ("flag", None) => {}
            // Python's int() and float() on the value, as argparse applies them.
            ("int", Some(v)) => assert!(v.parse::<i64>().is_ok(), "{name} {v}: not an int"),
            ("float", Some(v)) => assert!(v.parse::<f64>().is_ok(), "{name} {v}: not a float"),
            ("str", Some(v)) => assert!(
                arg.choices.is_empty() || arg.choices.contains(v),
                "{name} {v}: not one of {:?}",
                arg.choices
            ),
            (ty, v) => panic!("{name} {v:?}: the parser takes {ty}"),
        }
    }
    // The launch line covers the whole cluster.
    let nodes: u64 = after(script, "--nnodes");
    let gpus: u64 = after(script, "--nproc-per-node");
    let degree = |f: &str| -> u64 {
        flags
            .iter()
            .find(|(n, _)| n == f)
            .and_then(|(_, v)| v.as_ref()?.parse().ok())
            .unwrap_or(1)
    };
    let model = degree("--tensor-model-parallel-size")
        * degree("--pipeline-model-parallel-size")
        * degree("--context-parallel-size");
    assert_eq!((nodes * gpus) % model, 0, "{script}");
    let dp = nodes * gpus / model;
    assert_eq!(
        degree("--global-batch-size") % (degree("--micro-batch-size") * dp),
        0,
        "the global batch splits into whole micro-batches per replica"
    );
}

fn after<T: std::str::FromStr>(text: &str, key: &str) -> T {
    text.split_whitespace()
        .skip_while(|w| *w != key)
        .nth(1)
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("{key} has no value in\n{text}"))
}

/// torchtitan v0.2.0's JobConfig: `section.field` → its type annotation.
fn torchtitan_fields() -> BTreeMap<String, String> {
    include_str!("data/torchtitan-v0.2.0-job-config.tsv")
        .lines()
        .filter(|l| !l.starts_with('#'))
        .map(|l| {
            let (k, v) = l.split_once('\t').expect("field\ttype");
            (k.to_string(), v.to_string())
        })
        .collect()
}

fn check_torchtitan(toml_text: &str, world: u64) {
    let doc: toml::Table = toml_text.parse().expect("the export is TOML");
    let fields = torchtitan_fields();
    fn walk(table: &toml::Table, prefix: &str, fields: &BTreeMap<String, String>) {
        for (key, value) in table {
            let path = format!("{prefix}{key}");
            if let toml::Value::Table(inner) = value {
                walk(inner, &format!("{path}."), fields);
                continue;
            }
            let ty = fields
                .get(&path)
                .unwrap_or_else(|| panic!("{path} is not a torchtitan v0.2.0 field"));
            let fits = match value {
                toml::Value::Integer(_) => ty.starts_with("int") || ty.contains("float | int"),
                toml::Value::Float(_) => ty.starts_with("float"),
                toml::Value::Boolean(_) => ty == "bool",
                toml::Value::String(s) => {
                    if let Some(lit) = ty.strip_prefix("Literal[") {
                        lit.contains(&format!("'{s}'"))
                    } else {
                        ty.starts_with("str")
                    }
                }
                toml::Value::Array(_) => ty.starts_with("list"),
                _ => false,
            };
            assert!(fits, "{path} = {value} does not fit {ty}");
        }
    }
    walk(&doc, "", &fields);
    let p = &doc["parallelism"];
    let int = |k: &str| p.get(k).and_then(toml::Value::as_integer).unwrap_or(1) as u64;
    assert_eq!(
        int("data_parallel_replicate_degree")
            * int("data_parallel_shard_degree")
            * int("tensor_parallel_degree")
            * int("context_parallel_degree")
            * int("pipeline_parallel_degree"),
        world,
        "the degrees fill the cluster"
    );
}

/// DeepSpeed v0.16.9's keys: path → JSON type.
fn deepspeed_keys() -> BTreeMap<String, String> {
    include_str!("data/deepspeed-v0.16.9-config.tsv")
        .lines()
        .filter(|l| !l.starts_with('#'))
        .map(|l| {
            let (k, v) = l.split_once('\t').expect("key\ttype");
            (k.to_string(), v.to_string())
        })
        .collect()
}

fn check_deepspeed(json: &str, world: u64, tp: u64, pp: u64) {
    let v: serde_json::Value = serde_json::from_str(json).expect("the export is JSON");
    let keys = deepspeed_keys();
    fn walk(
        v: &serde_json::Value,
        path: &str,
        keys: &BTreeMap<String, String>,
        found: &mut Vec<String>,
    ) {
        if let Some(ty) = keys.get(path) {
            let fits = match ty.as_str() {
                "integer" => v.is_u64(),
                "number" => v.is_number(),
                "boolean" => v.is_boolean(),
                "string" => v.is_string(),
                _ => v.is_object(),
            };
            assert!(fits, "{path} = {v} is not a {ty}");
            found.push(path.to_string());
            return;
        }
        let obj = v
            .as_object()
            .unwrap_or_else(|| panic!("{path} is not a DeepSpeed v0.16.9 key"));
        for (k, child) in obj {
            let p = if path.is_empty() {
                k.clone()
            } else {
                format!("{path}.{k}")
            };
            walk(child, &p, keys, found);
        }
    }
    let mut found = Vec::new();
    walk(&v, "", &keys, &mut found);
    let n = |k: &str| v[k].as_u64().expect("an integer");
    assert_eq!(
        n("train_batch_size"),
        n("train_micro_batch_size_per_gpu") * n("gradient_accumulation_steps") * world / (tp * pp),
        "DeepSpeed's batch rule: micro-batch × accumulation × data-parallel ranks"
    );
}

fn world_of(plan: &Path) -> (u64, u64, u64) {
    let text = std::fs::read_to_string(plan).expect("plan");
    let v = |k: &str| -> u64 { after(&text.replace([',', ':'], " "), k) };
    (v("nodes") * v("devices_per_node"), v("tp"), v("pp"))
}

#[test]
fn golden_exports_of_the_zoo_plans_parse_as_the_engines_read_them() {
    for (name, plan) in golden_plans() {
        let (world, tp, pp) = world_of(&plan);
        for engine in ENGINES {
            let out = export(&plan, engine, &["--closest"]);
            let (stdout, stderr) = (text(&out.stdout), text(&out.stderr));
            if out.status.success() {
                match engine {
                    "megatron" => check_megatron(&stdout),
                    "torchtitan" => check_torchtitan(&stdout, world),
                    _ => check_deepspeed(&stdout, world, tp, pp),
                }
            } else {
                // A model the engine cannot build is refused, with why.
                assert!(
                    stderr.contains("cannot build"),
                    "{name} → {engine}: {stderr}"
                );
            }
            insta::assert_snapshot!(
                format!("{name}_to_{engine}"),
                format!(
                    "exit {}\n--- stdout\n{stdout}--- stderr\n{stderr}",
                    out.status.code().unwrap_or(-1)
                )
            );
        }
    }
}

#[test]
fn a_plan_an_engine_cannot_run_names_the_closest_and_its_price() {
    // A time-balanced pipeline over 12 layers: its ends carry the embedding
    // and loss, so the stages are uneven.
    let plan = compile(
        "models/gpt2.dpl",
        "gpt2",
        "8xA100",
        &["--strategy", "pp=4,dp=2"],
        "gpt2_pp4.ron",
    );
    let text_of = std::fs::read_to_string(&plan).unwrap();
    assert!(text_of.contains("layers: 1,") || text_of.contains("layers: 2,"));

    // Megatron says an uneven first and last stage in its own flags.
    let out = export(&plan, "megatron", &[]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let script = text(&out.stdout);
    check_megatron(&script);
    assert!(script.contains("--decoder-first-pipeline-num-layers"));

    // DeepSpeed's uniform partition cannot: it stops, naming the closest plan.
    let out = export(&plan, "deepspeed", &[]);
    assert_eq!(out.status.code(), Some(1));
    let err = text(&out.stderr);
    assert!(err.contains("stage split"), "{err}");
    assert!(err.contains("stages=even"), "{err}");
    assert!(err.contains("s per step ("), "{err}");
    assert!(err.contains("--closest"), "{err}");
    assert!(out.stdout.is_empty(), "nothing is exported on a refusal");

    // With --closest it exports that plan and says so.
    let out = export(&plan, "deepspeed", &["--closest"]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    check_deepspeed(&text(&out.stdout), 8, 1, 4);
    assert!(text(&out.stderr).contains("exporting the closest plan"));

    // Under --json the refusal is a JSON error with its code.
    let out = export(&plan, "deepspeed", &["--json"]);
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("JSON error");
    assert_eq!(v["error"]["code"], "dplc::export-gap");
}

/// No engine runs a parameter server or dplc's compressed all-reduces: the
/// export names them and offers the all-reduce of fp32 gradients.
#[test]
fn a_parameter_server_or_compression_is_named_as_a_gap() {
    for (strategy, name, what) in [
        (
            "sync=ps",
            "gpt2_ps.ron",
            "sync=ps,ps_shards=8: the engine all-reduces gradients",
        ),
        (
            "compress=powersgd:4",
            "gpt2_psgd.ron",
            "compress=powersgd:4: the engine reduces uncompressed gradients",
        ),
    ] {
        let plan = compile(
            "models/gpt2.dpl",
            "gpt2",
            "8xA100",
            &["--strategy", strategy],
            name,
        );
        // torchtitan builds no LayerNorm model; the gap is shared code.
        for engine in ["megatron", "deepspeed"] {
            let out = export(&plan, engine, &[]);
            assert_eq!(out.status.code(), Some(1), "{engine}");
            let err = text(&out.stderr);
            assert!(err.contains(what), "{engine}: {err}");
            let out = export(&plan, engine, &["--closest"]);
            assert!(out.status.success(), "{engine}: {}", text(&out.stderr));
        }
    }
}

/// FlashAttention (v1)'s kernel is priced at half FlashAttention-2's rate;
/// Megatron's `flash` backend and torchtitan's SDPA run FlashAttention-2 or
/// newer, so the export names it and offers the plan at FlashAttention-2's
/// price; DeepSpeed's config sets no attention kernel.
#[test]
fn flash1_is_named_as_a_gap_where_the_engine_runs_a_newer_kernel() {
    let plan = compile(
        "models/tiny.dpl",
        "llama_tiny",
        "8xH100",
        &["--strategy", "tp=2,pp=2,dp=2,mb=1,attention=flash1"],
        "flash1.ron",
    );
    for engine in ["megatron", "torchtitan"] {
        let out = export(&plan, engine, &[]);
        assert_eq!(out.status.code(), Some(1), "{engine}");
        let err = text(&out.stderr);
        assert!(err.contains("FlashAttention (v1)"), "{engine}: {err}");
        let out = export(&plan, engine, &["--closest"]);
        assert!(out.status.success(), "{engine}: {}", text(&out.stderr));
        assert!(text(&out.stderr).contains("attention=flash2"), "{engine}");
    }
}

#[test]
fn a_gpipe_plan_goes_to_megatron_as_1f1b() {
    let plan = compile(
        "models/tiny.dpl",
        "llama_tiny",
        "8xH100",
        &["--strategy", "tp=2,pp=2,dp=2,mb=1,schedule=gpipe"],
        "gpipe.ron",
    );
    let out = export(&plan, "megatron", &[]);
    assert_eq!(out.status.code(), Some(1));
    assert!(text(&out.stderr).contains("GPipe"));
    let out = export(&plan, "megatron", &["--closest"]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert!(text(&out.stderr).contains("schedule=1f1b"));
    check_megatron(&text(&out.stdout));
    // torchtitan runs GPipe as planned.
    let out = export(&plan, "torchtitan", &["--closest"]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let toml_text = text(&out.stdout);
    check_torchtitan(&toml_text, 8);
    assert!(toml_text.contains("pipeline_parallel_schedule = \"GPipe\""));
    assert!(toml_text.contains("\"layers.1\", \"norm\", \"output\""));
}

#[test]
fn models_the_engines_cannot_build_are_refused_with_why() {
    let gpt2 = compile("models/gpt2.dpl", "gpt2", "8xA100", &[], "gpt2_refuse.ron");
    let out = export(&gpt2, "torchtitan", &["--json"]);
    assert_eq!(out.status.code(), Some(1));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("JSON error");
    assert_eq!(v["error"]["code"], "dplc::export-model");
    assert!(v["error"]["message"]
        .as_str()
        .unwrap()
        .contains("LayerNorm"));

    // BERT: post-norm, bidirectional, token types.
    let bert = compile(
        "models/bert.dpl",
        "bert_base",
        "8xA100",
        &["--seq", "128", "--global-batch", "64"],
        "bert.ron",
    );
    for engine in ENGINES {
        let out = export(&bert, engine, &[]);
        assert_eq!(out.status.code(), Some(1), "{engine}");
        assert!(text(&out.stderr).contains("is not a model"), "{engine}");
    }

    // Two stacks of layers.
    let src = tmp("two_stacks.dpl");
    std::fs::write(
        &src,
        "model two(vocab = 256, d = 64, heads = 4) {\n\
         input tokens: i32[batch, seq]\n input targets: i32[batch, seq]\n\
         param embed: [vocab, d]\n h = embedding(embed, tokens)\n\
         repeat 2 { h = h + attention(rms_norm(h, d, name = \"n1\"), d, heads, rotary = true) }\n\
         repeat 2 { h = h + swiglu(rms_norm(h, d, name = \"n2\"), d, 128) }\n\
         param output: [d, vocab]\n return cross_entropy(h @ output, targets)\n}\n\
         train two {\n seq = 64\n global_batch = 8\n precision = fp32\n}\n",
    )
    .unwrap();
    let plan = compile(src.to_str().unwrap(), "two", "8xA100", &[], "two.ron");
    let out = export(&plan, "megatron", &["--json"]);
    assert_eq!(out.status.code(), Some(1));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("JSON error");
    assert!(v["error"]["message"]
        .as_str()
        .unwrap()
        .contains("2 `repeat` stacks"));
}

#[test]
fn the_export_never_writes_over_its_plan() {
    let plan = compile("models/gpt2.dpl", "gpt2", "8xA100", &[], "gpt2_keep.ron");
    let before = std::fs::read(&plan).unwrap();
    let p = plan.to_str().unwrap();
    let out = dplc(&["export", p, "--to", "megatron", "-o", p]);
    assert_eq!(out.status.code(), Some(1));
    assert_eq!(std::fs::read(&plan).unwrap(), before);
    // Written elsewhere, the file is what stdout would have been.
    let dest = tmp("gpt2.sh");
    ok(&[
        "export",
        p,
        "--to",
        "megatron",
        "-o",
        dest.to_str().unwrap(),
    ]);
    let stdout = ok(&["export", p, "--to", "megatron"]).stdout;
    assert_eq!(std::fs::read(&dest).unwrap(), stdout);
}

#[test]
fn every_subcommand_reports_errors_as_json_under_json() {
    let missing = tmp("missing.ron");
    let m = missing.to_str().unwrap();
    let bad = tmp("bad.dpl");
    std::fs::write(&bad, "model m() {\n  x = foo(1)\n}\n").unwrap();
    let b = bad.to_str().unwrap();
    let cases: Vec<Vec<&str>> = vec![
        vec!["check", b],
        vec!["inspect", b],
        vec!["compile", b, "--cluster", "8xA100"],
        vec!["explain", m],
        vec!["viz", m],
        vec!["run", b],
        vec!["verify", m],
        vec!["build", b, "--cluster", "8xcpu", "-o", m],
        vec!["launch", m],
        vec!["export", m, "--to", "megatron"],
        vec!["import", "hf", m],
        vec!["compile", "models/gpt2.dpl", "--no-such-flag"],
    ];
    for mut args in cases {
        args.push("--json");
        let out = dplc(&args);
        assert!(!out.status.success(), "{args:?} succeeded");
        let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap_or_else(|e| {
            panic!("{args:?}: stdout is not JSON ({e}): {}", text(&out.stdout))
        });
        let e = &v["error"];
        for key in ["code", "message", "file", "line", "column", "help"] {
            assert!(e.get(key).is_some(), "{args:?}: no `{key}` in {v}");
        }
        assert!(e["message"].as_str().is_some_and(|s| !s.is_empty()));
    }
    // A .dpl error points at its place.
    let out = dplc(&["check", b, "--json"]);
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["error"]["code"], "dpl::unknown-block");
    assert_eq!(v["error"]["line"], 2);
    assert_eq!(v["error"]["column"], 7);
    assert!(v["error"]["file"].as_str().unwrap().ends_with("bad.dpl"));
    // Usage errors exit 2, as the argument parser's always have.
    let out = dplc(&["export", m, "--to", "nope", "--json"]);
    assert_eq!(out.status.code(), Some(2));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["error"]["code"], "dplc::usage");
}

#[test]
fn fp8_plans_go_to_megatron_and_torchtitan_as_their_fp8_recipes() {
    let plan = compile(
        "models/llama3.dpl",
        "llama3_8b",
        "8xH100",
        &["--seq", "4096", "--strategy", "tp=2,dp=4,fp8=on"],
        "fp8.ron",
    );
    let out = export(&plan, "megatron", &[]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let script = text(&out.stdout);
    check_megatron(&script);
    assert!(script.contains("--fp8-format hybrid"));
    let out = export(&plan, "torchtitan", &["--closest"]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let toml_text = text(&out.stdout);
    check_torchtitan(&toml_text, 8);
    assert!(toml_text.contains("converters = [\"quantize.linear.float8\"]"));
    // DeepSpeed's config has no FP8: the closest plan turns it off.
    let out = export(&plan, "deepspeed", &[]);
    assert_eq!(out.status.code(), Some(1));
    assert!(text(&out.stderr).contains("FP8"));
}

#[test]
fn an_offloaded_plan_goes_to_deepspeed_megatron_and_torchtitan_offloaded() {
    // Llama 3 8B on one H100 fits only with its optimizer on the host (the
    // search also offloads the activations of the layers it does not
    // recompute, which DeepSpeed cannot: its closest plan recomputes more).
    let plan = compile(
        "models/llama3.dpl",
        "llama3_8b",
        "1xH100",
        &["--seq", "2048", "--global-batch", "8"],
        "offload.ron",
    );
    let out = export(&plan, "deepspeed", &["--closest"]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert!(
        text(&out.stderr).contains("activations offloaded without recomputation"),
        "{}",
        text(&out.stderr)
    );
    let json = text(&out.stdout);
    check_deepspeed(&json, 1, 1, 1);
    let v: serde_json::Value = serde_json::from_str(&json).unwrap();
    assert_eq!(v["zero_optimization"]["offload_optimizer"]["device"], "cpu");
    let out = export(&plan, "megatron", &["--closest"]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let script = text(&out.stdout);
    check_megatron(&script);
    assert!(script.contains("--optimizer-cpu-offload"));
    // torchtitan offloads FSDP2's whole state or nothing: the closest plan.
    let out = export(&plan, "torchtitan", &["--closest"]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let toml_text = text(&out.stdout);
    check_torchtitan(&toml_text, 1);
    assert!(toml_text.contains("enable_cpu_offload = true"));
    assert!(text(&out.stderr).contains("offload=optimizer+params"));
}

/// dplc keeps each expert whole on its expert-parallel rank and prices it
/// so; Megatron would split the experts over tp by default, so a plan with
/// both says `--expert-tensor-parallel-size 1`, and one without experts
/// split never does.
#[test]
fn experts_go_to_megatron_whole_over_tp() {
    let plan = compile(
        "models/mixtral.dpl",
        "mixtral_8x7b",
        "2x8xH100",
        &["--strategy", "tp=2,pp=2,ep=4,dp=4"],
        "experts_tp.ron",
    );
    let out = export(&plan, "megatron", &[]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let script = text(&out.stdout);
    check_megatron(&script);
    assert!(
        script.contains("--expert-model-parallel-size 4"),
        "{script}"
    );
    assert!(
        script.contains("--expert-tensor-parallel-size 1"),
        "{script}"
    );
    // The dispatcher the plan priced: one all-to-all.
    assert!(
        script.contains("--moe-token-dispatcher-type alltoall"),
        "{script}"
    );
    let plan = compile(
        "models/mixtral.dpl",
        "mixtral_8x7b",
        "2x8xH100",
        &["--strategy", "tp=2,pp=8,ep=1"],
        "experts_ep1.ron",
    );
    let script = text(&export(&plan, "megatron", &[]).stdout);
    assert!(
        !script.contains("--expert-tensor-parallel-size"),
        "{script}"
    );
    assert!(!script.contains("--moe-token-dispatcher-type"), "{script}");
}

/// DeepEP's hierarchical dispatch is a gap for Megatron (its flex
/// dispatcher cannot drop at a capacity factor, which dplc's experts do),
/// whose closest plan sends the all-to-all (the dispatcher itself:
/// `experts_go_to_megatron_whole_over_tp`).
#[test]
fn a_hierarchical_dispatch_is_a_megatron_gap() {
    let deepep = compile(
        "models/mixtral.dpl",
        "mixtral_8x7b",
        "2x8xH100",
        &["--strategy", "tp=2,pp=2,ep=4,dp=4,dispatch=deepep"],
        "dispatch_deepep.ron",
    );
    let out = export(&deepep, "megatron", &[]);
    assert!(!out.status.success());
    let err = text(&out.stderr);
    assert!(
        err.contains("DeepEP's hierarchical token dispatch"),
        "{err}"
    );
    // The closest plan leaves the dispatcher at its default, the all-to-all.
    assert!(!err.contains("dispatch="), "{err}");
    let out = export(&deepep, "megatron", &["--closest"]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let script = text(&out.stdout);
    check_megatron(&script);
    assert!(
        script.contains("--moe-token-dispatcher-type alltoall"),
        "{script}"
    );
}

/// Half-precision main gradients (`grad_reduce=bf16`, Megatron-Bridge's
/// performance recipes' `grad_reduce_in_fp32=False`): Megatron-LM's
/// `--grad-reduce-in-bf16`, DeepSpeed's communication and accumulation
/// dtypes; torchtitan reduces in float32 only, a gap whose closest plan keeps
/// fp32 gradients.
#[test]
fn half_precision_gradients_go_where_the_engine_keeps_them() {
    let plan = compile(
        "models/llama3.dpl",
        "llama3_8b",
        "2x8xH100",
        &["--strategy", "tp=2,pp=2,dp=4,zero=1,grad_reduce=bf16"],
        "grad_reduce_bf16.ron",
    );
    let out = export(&plan, "megatron", &[]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let script = text(&out.stdout);
    check_megatron(&script);
    assert!(script.contains("--grad-reduce-in-bf16"), "{script}");
    let out = export(&plan, "deepspeed", &["--closest"]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let config: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(config["communication_data_type"], "bf16", "{config}");
    assert_eq!(config["data_types"]["grad_accum_dtype"], "bf16", "{config}");
    let out = export(&plan, "torchtitan", &[]);
    assert!(!out.status.success());
    let err = text(&out.stderr);
    assert!(err.contains("main gradients reduced in bf16"), "{err}");
    assert!(!err.contains("grad_reduce="), "{err}");
    // The default keeps Megatron's fp32 main gradients: no flag.
    let fp32 = compile(
        "models/llama3.dpl",
        "llama3_8b",
        "2x8xH100",
        &["--strategy", "tp=2,pp=2,dp=4,zero=1"],
        "grad_reduce_fp32.ron",
    );
    let out = export(&fp32, "megatron", &[]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert!(!text(&out.stdout).contains("--grad-reduce-in-bf16"));
}

/// The loss as the plan priced it: a fused plan asks Megatron for
/// Transformer Engine's one-pass cross-entropy; `loss=unfused` is
/// Megatron's default, no flag.
#[test]
fn the_loss_goes_to_megatron_as_priced() {
    for (pin, fused) in [
        ("tp=2,dp=8,zero=1", true),
        ("tp=2,dp=8,zero=1,loss=unfused", false),
    ] {
        let plan = compile(
            "models/llama3.dpl",
            "llama3_8b",
            "2x8xH100",
            &["--strategy", pin],
            &format!("loss_{fused}.ron"),
        );
        let out = export(&plan, "megatron", &[]);
        assert!(out.status.success(), "{}", text(&out.stderr));
        let script = text(&out.stdout);
        check_megatron(&script);
        for flag in [
            "--cross-entropy-loss-fusion",
            "--cross-entropy-fusion-impl te",
        ] {
            assert_eq!(script.contains(flag), fused, "{pin}: {flag}\n{script}");
        }
    }
}

/// torchtitan compiles what the plan prices fused: a fused loss is
/// torch.compile's (the model compiled or not), an eager one is PyTorch's
/// `F.cross_entropy` with only the model compiled.
#[test]
fn the_loss_goes_to_torchtitan_as_priced() {
    for (pin, components) in [
        ("dp=8,zero=3", None),
        ("dp=8,zero=3,loss=eager", Some("[\"model\"]")),
        ("dp=8,zero=3,elementwise=eager", Some("[\"loss\"]")),
        ("dp=8,zero=3,elementwise=eager,loss=eager", None),
    ] {
        let plan = compile(
            "models/llama3.dpl",
            "llama3_8b",
            "8xH100",
            &["--strategy", pin],
            &format!("loss_{}.ron", pin.replace([',', '='], "_")),
        );
        let out = export(&plan, "torchtitan", &["--closest"]);
        assert!(out.status.success(), "{pin}: {}", text(&out.stderr));
        let toml_text = text(&out.stdout);
        check_torchtitan(&toml_text, 8);
        let doc: toml::Value = toml::from_str(&toml_text).unwrap();
        let got = doc.get("compile").and_then(|c| c.get("components"));
        match components {
            None => assert!(got.is_none(), "{pin}:\n{toml_text}"),
            Some(want) => assert_eq!(got.map(|v| v.to_string()), Some(want.to_string()), "{pin}"),
        }
        let enabled = doc.get("compile").and_then(|c| c.get("enable"));
        let compiled = !pin.contains("elementwise=eager") || !pin.contains("loss=eager");
        assert_eq!(
            enabled.and_then(|v| v.as_bool()),
            compiled.then_some(true),
            "{pin}"
        );
    }
}

#[test]
fn an_interleaved_split_goes_to_megatron_and_torchtitan_as_planned() {
    // Llama 3.1 405B as Megatron-Bridge runs it on 1024 H100s (tp 8, pp 8,
    // cp 2, 8 chunks a stage): 126 layers do not fill 64 equal chunks, so
    // the time-balanced split gives the first and last stages 15 and their
    // end chunks one layer, beside the embedding and the loss — Megatron's
    // --account-for-embedding/loss-in-pipeline-split.
    let plan = compile(
        "models/llama3.dpl",
        "llama3_405b",
        "128x8xH100",
        &[
            "--seq",
            "8192",
            "--global-batch",
            "512",
            "--strategy",
            "tp=8,pp=8,cp=2,dp=8,mb=1,schedule=interleaved,v=8,zero=1,sp=on,fp8=on,fp8_gather=on,fp8_bf16_ends=1,recompute=none,offload=none",
        ],
        "llama405b_interleaved.ron",
    );
    let out = export(&plan, "megatron", &[]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let script = text(&out.stdout);
    check_megatron(&script);
    for f in [
        "--first-last-layers-bf16",
        "--num-layers-at-start-in-bf16 1",
        "--num-layers-at-end-in-bf16 1",
        "--num-virtual-stages-per-pipeline-rank 8",
        "--account-for-embedding-in-pipeline-split",
        "--account-for-loss-in-pipeline-split",
    ] {
        assert!(script.contains(f), "{f} missing:\n{script}");
    }
    assert!(!script.contains("--decoder-first-pipeline-num-layers"));

    // torchtitan runs its closest plan: FSDP2 (ZeRO-3) for the distributed
    // optimizer, holding the step under the pipeline (no reshard after
    // forward), FP8 kept, the model parts exactly the plan's chunks.
    let out = export(&plan, "torchtitan", &["--closest"]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let toml_text = text(&out.stdout);
    check_torchtitan(&toml_text, 1024);
    for line in [
        "fsdp_reshard_after_forward = \"never\"",
        "pipeline_parallel_schedule = \"Interleaved1F1B\"",
        "[\"tok_embeddings\", \"layers.0\"],",
        "[\"layers.1\", \"layers.2\"],",
        "[\"layers.125\", \"norm\", \"output\"],",
        "converters = [\"quantize.linear.float8\"]",
        "filter_fqns = [\"output\", \"layers.0.\", \"layers.125.\"]",
    ] {
        assert!(toml_text.contains(line), "{line} missing:\n{toml_text}");
    }

    // ZeRO-2 under a pipeline is not what FSDP2 runs there (it holds the
    // gradients through the step): the closest torchtitan plan is ZeRO-3.
    let plan = compile(
        "models/tiny.dpl",
        "llama_tiny",
        "4xA100",
        &["--strategy", "dp=2,pp=2,zero=2"],
        "llama_tiny_pp_zero2.ron",
    );
    let out = export(&plan, "torchtitan", &[]);
    assert!(!out.status.success());
    let err = text(&out.stderr);
    assert!(err.contains("ZeRO-2 under a pipeline"), "{err}");
    assert!(err.contains("zero=3"), "{err}");

    // 24 layers in 4 stages of 4 chunks: no equal chunks, with or without
    // a short one at the ends, so Megatron cannot build it; the closest
    // plan it can run is named.
    let plan = compile(
        "models/megatron_gpt.dpl",
        "gpt_1_7b",
        "4x8xA100",
        &[
            "--global-batch",
            "512",
            "--strategy",
            "tp=2,pp=4,schedule=interleaved,v=4",
        ],
        "gpt_interleaved_v4.ron",
    );
    let out = export(&plan, "megatron", &[]);
    assert!(!out.status.success());
    let err = text(&out.stderr);
    assert!(err.contains("in 4 chunks"), "{err}");
    assert!(err.contains("schedule=1f1b"), "{err}");
}

/// Partial recomputation goes to Megatron and DeepSpeed as the block
/// method (the first N layers of each chunk) and to torchtitan as its
/// layer checkpointing (every M-th layer) where the counts agree: llama3_8b
/// on one stage, 8 of its 32 layers, every 4th; 12 of 32 no M gives, so
/// torchtitan is handed the closest plan, every layer.
#[test]
fn partial_recomputation_goes_to_each_engine_as_its_own_knob() {
    let at = |k: u64| {
        compile(
            "models/llama3.dpl",
            "llama3_8b",
            "8xH100",
            &[
                "--seq",
                "4096",
                "--strategy",
                &format!("tp=2,dp=4,recompute_layers={k}"),
            ],
            &format!("partial{k}.ron"),
        )
    };
    let plan = at(8);
    let out = export(&plan, "megatron", &[]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let script = text(&out.stdout);
    check_megatron(&script);
    for flag in [
        "--recompute-granularity full",
        "--recompute-method block",
        "--recompute-num-layers 8",
    ] {
        assert!(script.contains(flag), "{flag} missing:\n{script}");
    }
    let out = export(&plan, "deepspeed", &["--closest"]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    // (The closest plan for the other gaps: ZeRO-1, the tp overlap.)
    let out = export(&plan, "torchtitan", &["--closest"]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let toml_text = text(&out.stdout);
    check_torchtitan(&toml_text, 8);
    assert!(toml_text.contains("mode = \"selective\""), "{toml_text}");
    assert!(
        toml_text.contains("selective_ac_option = \"4\""),
        "{toml_text}"
    );
    assert!(!text(&out.stderr).contains("layers of each chunk recomputed"));
    let out = export(&at(12), "torchtitan", &["--closest"]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert!(
        text(&out.stderr).contains("the first 12 layers of each chunk recomputed"),
        "{}",
        text(&out.stderr)
    );
    assert!(text(&out.stdout).contains("mode = \"full\""));
}

/// A plan priced with PyTorch's autocast goes to no engine as it is: each
/// keeps activations in the training precision, and the closest plan
/// drops autocast.
#[test]
fn autocast_is_named_as_a_gap() {
    let plan = compile(
        "models/llama3.dpl",
        "llama3_8b",
        "8xH100",
        &["--seq", "4096", "--strategy", "tp=2,dp=4,autocast=on"],
        "autocast.ron",
    );
    for engine in ["megatron", "deepspeed", "torchtitan"] {
        let out = export(&plan, engine, &[]);
        assert_eq!(out.status.code(), Some(1), "{engine}");
        let err = text(&out.stderr).replace("\n  | ", " ");
        assert!(
            err.contains("autocast over fp32 weights"),
            "{engine}: {err}"
        );
        let out = export(&plan, engine, &["--closest"]);
        assert!(out.status.success(), "{engine}: {}", text(&out.stderr));
    }
}

/// Tensor parallelism as the engine runs it: torchtitan's is DTensor's
/// (batch-first, its sequence-parallel collectives copied into place, the
/// gathered inputs kept), a gap for a plan priced with Megatron's layout
/// whose closest plan prices DTensor's; Megatron-LM and DeepSpeed run
/// Megatron's, a gap for a plan priced with DTensor's.
#[test]
fn tensor_parallelism_goes_to_each_engine_as_it_runs_it() {
    let megatron = compile(
        "models/llama3.dpl",
        "llama3_8b",
        "2x8xH100",
        &["--strategy", "tp=8,dp=2,sp=on,zero=3,shards=per_param"],
        "tp_megatron.ron",
    );
    let out = export(&megatron, "torchtitan", &[]);
    assert!(!out.status.success());
    let err = text(&out.stderr);
    assert!(err.contains("Megatron's tensor parallelism"), "{err}");
    assert!(err.contains("tp_impl=dtensor"), "{err}");
    let out = export(&megatron, "torchtitan", &["--closest"]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    check_torchtitan(&text(&out.stdout), 16);
    let out = export(&megatron, "megatron", &["--closest"]);
    assert!(!text(&out.stderr).contains("tensor parallelism"));

    let dtensor = compile(
        "models/llama3.dpl",
        "llama3_8b",
        "2x8xH100",
        &[
            "--strategy",
            "tp=8,dp=2,sp=on,zero=3,shards=per_param,tp_impl=dtensor",
        ],
        "tp_dtensor.ron",
    );
    let out = export(&dtensor, "torchtitan", &["--closest"]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert!(!text(&out.stderr).contains("tensor parallelism"));
    for engine in ["megatron", "deepspeed"] {
        let out = export(&dtensor, engine, &[]);
        assert!(!out.status.success(), "{engine}");
        let err = text(&out.stderr);
        assert!(
            err.contains("DTensor's tensor parallelism"),
            "{engine}: {err}"
        );
    }
}
