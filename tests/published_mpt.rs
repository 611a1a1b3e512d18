//! llm-foundry's published MPT training throughput (MosaicML: Composer's
//! FSDP on 8 to 512 H100s and 8 A100s, 125M to 70B parameters, sequences of
//! 512 to 65,536 tokens) as test data, the whole of three tables
//! (`tests/data/llm_foundry_mpt.csv`, its header cites them).
//!
//! Every row is planned with its configuration pinned by one rule, the stack
//! the tables ran, never a choice per row: Composer's FSDP (FSDP1, flat
//! parameters: `FULL_SHARD` is ZeRO-3, `SHARD_GRAD_OP` ZeRO-2; mixed
//! precision `DEFAULT`: bf16 gathers, fp32 reductions), eager PyTorch,
//! whole-block activation checkpointing where the row has it, and
//! llm-foundry's attention at the time, `attn_impl: triton`
//! (FlashAttention's Triton port: `attention=flash1`; submit_benchmarks.py's
//! default @ b2a43a1). The models are `models/mpt.dpl`, each at the row's
//! sequence length (its learned positions are that long).
//!
//! What is asserted: that each configuration, which ran, fits in dplc's
//! memory model; that dplc counts each row's published parameters exactly;
//! and that at least as many rows as on 2026-11-26 (86 of 129) are within
//! 10% of their published tokens/s per GPU — a floor that catches a
//! regression, not a tolerance fitted per row. `cargo test --test
//! published_mpt -- --nocapture` prints every row; bench/RESULTS.md has the
//! table and what the rows outside 10% have in common.

use dplc_planner::{compile, parse_cluster, parse_strategy, PlanRequest};

/// Rows within 10% when the floor was set (2026-11-26).
const WITHIN_TEN_PERCENT_FLOOR: usize = 86;

struct Row {
    table: String,
    model: String,
    seq: u64,
    gpus: u64,
    micro_batch: u64,
    global_batch: u64,
    /// Published tokens/s per GPU.
    published: f64,
    sharding: String,
    checkpointing: bool,
    params: u64,
}

fn rows() -> Vec<Row> {
    let text = include_str!("data/llm_foundry_mpt.csv");
    let mut lines = text.lines().filter(|l| !l.starts_with('#'));
    assert_eq!(
        lines.next(),
        Some("table,model,seq,gpus,micro_batch,grad_accum,global_batch,tokens_per_s_per_gpu,sharding,activation_checkpointing,params")
    );
    lines
        .map(|line| {
            let f: Vec<&str> = line.split(',').collect();
            assert_eq!(f.len(), 11, "{line}");
            let int = |i: usize| f[i].parse::<u64>().unwrap_or_else(|_| panic!("{line}"));
            Row {
                table: f[0].to_string(),
                model: f[1].to_string(),
                seq: int(2),
                gpus: int(3),
                micro_batch: int(4),
                global_batch: int(6),
                published: int(7) as f64,
                sharding: f[8].to_string(),
                checkpointing: f[9] == "true",
                params: int(10),
            }
        })
        .collect()
}

/// The stack the tables ran, as dplc keys (the module header says why).
fn pinned(row: &Row) -> String {
    let zero = match row.sharding.as_str() {
        "FULL_SHARD" => 3,
        "SHARD_GRAD_OP" => 2,
        other => panic!("no rule for sharding {other}"),
    };
    let recompute = if row.checkpointing { "full" } else { "none" };
    format!(
        "tp=1,pp=1,cp=1,dp={},mb={},recompute={recompute},zero={zero},shards=flat,\
         attention=flash1,elementwise=eager,offload=none",
        row.gpus, row.micro_batch
    )
}

/// Hosts of eight GPUs: the catalog H100 SXM or A100 80GB (DGX-class hosts;
/// the A100 table's 1600 Gbps between hosts is the catalog's 8 × 200 Gb/s).
fn cluster(row: &Row) -> String {
    let device = match row.table.as_str() {
        "a100_80gb" => "A100",
        _ => "H100",
    };
    match row.gpus {
        8 => format!("8x{device}"),
        n => format!("{}x8x{device}", n / 8),
    }
}

/// `models/mpt.dpl` with the row's model at the row's sequence length.
fn lowered(row: &Row) -> dplc_frontend::Lowered {
    let zoo = include_str!("../models/mpt.dpl");
    let text = format!("{zoo}\nmodel row = mpt_{}(ctx = {})\n", row.model, row.seq);
    let unit = dplc_frontend::parse("mpt.dpl", &text).expect("the zoo file parses");
    unit.lower("row").expect("the model lowers")
}

#[test]
fn llm_foundry_mpt_rows_fit_count_their_parameters_and_hold_the_floor() {
    let rows = rows();
    assert_eq!(rows.len(), 129);
    let mut within = 0;
    let mut ratios = Vec::new();
    let mut failures = Vec::new();
    eprintln!("| table | model | seq | GPUs | micro-batch | AC | predicted tok/s/GPU | published | ratio | memory used |");
    for row in &rows {
        let l = lowered(row);
        let params = l.graph.param_count();
        if params != u128::from(row.params) {
            failures.push(format!(
                "{} {} seq {}: {params} parameters, published {}",
                row.table, row.model, row.seq, row.params
            ));
        }
        let spec = cluster(row);
        let cl = parse_cluster(&spec).expect("a catalog cluster");
        let world = cl.world_size() as f64;
        let mut req = PlanRequest::new(&l.graph, l.train.clone(), cl);
        req.seq = Some(row.seq);
        req.global_batch = Some(row.global_batch);
        req.pinned = parse_strategy(&pinned(row)).expect("the pinned keys parse");
        match compile(&req) {
            Err(e) => failures.push(format!(
                "{} {} seq {} on {spec}: ran, but dplc cannot plan it: {e}",
                row.table, row.model, row.seq
            )),
            Ok(c) => {
                let predicted = c.plan.estimate.tokens_per_s / world;
                let ratio = predicted / row.published;
                let used = c
                    .plan
                    .stages
                    .iter()
                    .map(|s| s.memory.total() as f64)
                    .fold(0.0, f64::max)
                    / c.plan.cluster.memory_bytes as f64;
                eprintln!(
                    "| {} | {} | {} | {} | {} | {} | {predicted:.0} | {:.0} | {ratio:.3} | {:.0}% |",
                    row.table,
                    row.model,
                    row.seq,
                    row.gpus,
                    row.micro_batch,
                    if row.checkpointing { "yes" } else { "no" },
                    row.published,
                    used * 100.0
                );
                if (ratio - 1.0).abs() <= 0.10 {
                    within += 1;
                }
                ratios.push(ratio);
            }
        }
    }
    ratios.sort_by(f64::total_cmp);
    if !ratios.is_empty() {
        eprintln!(
            "{within} of {} within 10%; ratio min {:.3}, median {:.3}, max {:.3}",
            rows.len(),
            ratios[0],
            ratios[ratios.len() / 2],
            ratios[ratios.len() - 1]
        );
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
    assert!(
        within >= WITHIN_TEN_PERCENT_FLOOR,
        "{within} rows within 10%, fewer than the {WITHIN_TEN_PERCENT_FLOOR} of 2026-11-26"
    );
}
