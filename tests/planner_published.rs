//! The published rows on the zoo's Megatron GPT models: Korthikanti et al.
//! 2022 (Fig. 1 memory per GPU, Table 5 step times) and Narayanan et al. 2021
//! (Table 1 hardware TFLOP/s per GPU). The published configuration is pinned;
//! the search fills in what the papers do not state.
//!
//! The same cost-model constants serve every row (see planner/src/cost/);
//! nothing is calibrated per row. Megatron ran attention unfused in 2021–2022
//! (no FlashAttention) and its tensor-parallel collectives on the critical
//! path, and its cross-entropy in fp32 pass by pass (`mpu`'s
//! `vocab_parallel_cross_entropy`), and its sequence parallelism splits the
//! model's ends too, so every row pins
//! `attention=unfused,tp_overlap=none,loss=unfused,tp_impl=megatron` as its
//! stack.

use dplc_planner::{compile, parse_cluster, parse_strategy, Compiled, PlanRequest};

const GIB: f64 = (1u64 << 30) as f64;

fn plan(model: &str, cluster: &str, batch: u64, strategy: &str, ignore_memory: bool) -> Compiled {
    let path = format!("{}/models/megatron_gpt.dpl", env!("CARGO_MANIFEST_DIR"));
    let text = std::fs::read_to_string(&path).expect("the zoo file exists");
    let unit = dplc_frontend::parse("megatron_gpt.dpl", &text).expect("the zoo file parses");
    let l = unit.lower(model).expect("the model lowers");
    let mut req = PlanRequest::new(&l.graph, l.train.clone(), parse_cluster(cluster).unwrap());
    req.global_batch = Some(batch);
    req.seq = Some(2048);
    req.pinned = parse_strategy(&format!(
        "{strategy},attention=unfused,tp_overlap=none,loss=unfused,tp_impl=megatron"
    ))
    .unwrap();
    req.ignore_memory = ignore_memory;
    let c = compile(&req).unwrap_or_else(|e| panic!("{model}: {e}"));
    eprintln!("{}", dplc_planner::summary(&c));
    c
}

fn within(got: f64, want: f64, tol: f64, what: &str) {
    let rel = got / want - 1.0;
    assert!(
        rel.abs() <= tol,
        "{what}: predicted {got:.3}, published {want:.3} ({:+.1}%, tolerance {:.0}%)",
        rel * 100.0,
        tol * 100.0
    );
}

/// Korthikanti Fig. 1 per GPU, GiB: (weights + gradients + optimizer, activations
/// including the first stage's embedding part).
fn memory_row(model: &str, cluster: &str, batch: u64, strategy: &str) -> (f64, f64) {
    let c = plan(model, cluster, batch, strategy, true);
    let m = &c.plan.stages[0].memory;
    let states = (m.weights + m.gradients + m.optimizer) as f64 / GIB;
    let acts = (m.activations + m.embedding_and_loss) as f64 / GIB;
    (states, acts)
}

#[test]
fn korthikanti_fig1_gpt_22b() {
    let base = "tp=8,pp=1,dp=1,mb=4,zero=0";
    let (states, none) = memory_row(
        "gpt_22b",
        "8xA100",
        4,
        &format!("{base},recompute=none,sp=off"),
    );
    // The states rows keep their tolerance: they read +1.6% (IR-built,
    // tied output layer) to +3.0% (the zoo's untied one), above the 3% the
    // activation rows meet. The gap is the paper's parameter count, not a
    // byte per parameter: Fig. 1's bar is exactly 18 bytes (bf16 weight,
    // fp32 gradient, master and two moments) × 12·L·h² / t — 48 × 12 ×
    // 6144² / 8 = 2.718 G parameters × 18 B = 45.56 GiB — which leaves out
    // the embeddings, position table, biases and norms dplc counts.
    within(states, 45.56, 0.05, "22B weights+grads+optimizer");
    within(none, 59.25, 0.03, "22B activations, no recompute");
    let (_, sel) = memory_row(
        "gpt_22b",
        "8xA100",
        4,
        &format!("{base},recompute=selective,sp=on"),
    );
    within(sel, 9.56, 0.03, "22B activations, sp + selective");
}

#[test]
fn korthikanti_fig1_gpt_175b_first_stage() {
    // Korthikanti et al. run 175B with the interleaved schedule, 3 chunks per
    // device: Fig. 1's 66.84 GiB is 96 layers' worth × (1 + (p−1)/(p·v)).
    let base = "tp=8,pp=8,dp=1,mb=1,zero=0,schedule=interleaved,v=3";
    let (states, none) = memory_row(
        "gpt_175b",
        "8x8xA100",
        64,
        &format!("{base},recompute=none,sp=off"),
    );
    // +3.1%: the same 45.56 GiB (96/8 layers × 12 × 12288² / 8 = 2.718 G
    // parameters × 18 B) without the first stage's embedding, which dplc
    // holds there; the tolerance stays.
    within(states, 45.56, 0.10, "175B weights+grads+optimizer");
    within(none, 66.84, 0.03, "175B activations, no recompute");
    let (_, sel) = memory_row(
        "gpt_175b",
        "8x8xA100",
        64,
        &format!("{base},recompute=selective,sp=on"),
    );
    within(sel, 12.35, 0.03, "175B activations, sp + selective");
}

fn step_time(model: &str, cluster: &str, batch: u64, strategy: &str) -> f64 {
    plan(model, cluster, batch, strategy, false)
        .plan
        .estimate
        .step_time_s
}

#[test]
fn korthikanti_table5_gpt_22b() {
    let base = "tp=8,pp=1,dp=1,mb=4";
    let full = step_time(
        "gpt_22b",
        "8xA100",
        4,
        &format!("{base},recompute=full,sp=off"),
    );
    within(full, 1.42, 0.05, "22B full recompute");
    let sel = step_time(
        "gpt_22b",
        "8xA100",
        4,
        &format!("{base},recompute=selective,sp=on"),
    );
    within(sel, 1.10, 0.05, "22B sp + selective");
}

#[test]
fn korthikanti_table5_gpt_175b() {
    let base = "tp=8,pp=8,dp=1,mb=1,schedule=interleaved,v=3";
    let full = step_time(
        "gpt_175b",
        "8x8xA100",
        64,
        &format!("{base},recompute=full,sp=off"),
    );
    within(full, 18.13, 0.05, "175B full recompute");
    let sel = step_time(
        "gpt_175b",
        "8x8xA100",
        64,
        &format!("{base},recompute=selective,sp=on"),
    );
    within(sel, 13.75, 0.05, "175B sp + selective");
}

fn hw_tflops(model: &str, cluster: &str, batch: u64, strategy: &str) -> f64 {
    plan(model, cluster, batch, strategy, false)
        .plan
        .estimate
        .hardware_tflops_per_gpu
}

// Narayanan et al. 2021 Table 1, with the configuration of each row as
// Megatron-LM's own reproduction script gives it (examples/sc21/run_table_1.sh
// and CONFIG.sh): fp16, full ("uniform") recomputation, no sequence
// parallelism and no distributed optimizer (zero=0). The 1.7B row uses
// PyTorch DDP, which overlaps the gradient all-reduce with backward; the
// pipelined rows use Megatron's local DDP, which reduces after backward
// (overlap=off). 145.6B runs the interleaved schedule with 5 layers per
// virtual stage (v=2) and micro-batch 2; 1T runs plain 1F1B, micro-batch 1.

#[test]
fn narayanan_table1_gpt_1_7b() {
    let t = hw_tflops(
        "gpt_1_7b",
        "4x8xA100",
        512,
        "tp=1,pp=1,dp=32,mb=16,zero=0,recompute=full",
    );
    within(t, 137.0, 0.10, "1.7B hardware TFLOP/s per GPU");
}

#[test]
fn narayanan_table1_gpt_145_6b() {
    let t = hw_tflops(
        "gpt_145_6b",
        "192x8xA100",
        2304,
        "tp=8,pp=8,dp=24,mb=2,schedule=interleaved,v=2,zero=0,recompute=full,sp=off,overlap=off",
    );
    within(t, 148.0, 0.10, "145.6B hardware TFLOP/s per GPU");
}

#[test]
fn narayanan_table1_gpt_1t() {
    let t = hw_tflops(
        "gpt_1t",
        "384x8xA100",
        3072,
        "tp=8,pp=64,dp=6,mb=1,schedule=1f1b,zero=0,recompute=full,sp=off,overlap=off",
    );
    within(t, 163.0, 0.10, "1T hardware TFLOP/s per GPU");
}
