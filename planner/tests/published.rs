//! The published rows: Korthikanti et al. 2022 (Fig. 1 memory, Table 5 step
//! times) and Narayanan et al. 2021 (Table 1 throughput), with their
//! configurations pinned and the rest left to the search.

mod common;

use common::*;
use dplc_planner::{compile, parse_cluster, parse_strategy, Compiled, PlanRequest};

const GIB: f64 = (1u64 << 30) as f64;

fn plan(cfg: Gpt, cluster: &str, batch: u64, strategy: &str, ignore_memory: bool) -> Compiled {
    let g = gpt("gpt", cfg);
    let mut req = PlanRequest::new(&g, train(2048, batch), parse_cluster(cluster).unwrap());
    req.pinned = parse_strategy(strategy).unwrap();
    req.ignore_memory = ignore_memory;
    let c = compile(&req).unwrap();
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

/// Korthikanti Fig. 1: (weights + grads + optimizer, activations) per GPU, GiB.
fn memory_row(cfg: Gpt, cluster: &str, batch: u64, strategy: &str) -> (f64, f64) {
    let c = plan(cfg, cluster, batch, strategy, true);
    let m = &c.plan.stages[0].memory;
    let states = (m.weights + m.gradients + m.optimizer) as f64 / GIB;
    let acts = (m.activations + m.embedding_and_loss) as f64 / GIB;
    (states, acts)
}

#[test]
fn korthikanti_fig1_gpt_22b() {
    let base = "tp=8,pp=1,dp=1,mb=4,zero=0";
    let (states, none) = memory_row(GPT_22B, "8xA100", 4, &format!("{base},recompute=none,sp=off"));
    within(states, 45.56, 0.05, "22B weights+grads+optimizer");
    within(none, 59.25, 0.05, "22B activations, no recompute");
    let (_, sel) = memory_row(GPT_22B, "8xA100", 4, &format!("{base},recompute=selective,sp=on"));
    within(sel, 9.56, 0.05, "22B activations, sp + selective");
}

#[test]
fn korthikanti_fig1_gpt_175b_first_stage() {
    // Korthikanti et al. train 175B with the interleaved schedule, 3 chunks per device.
    let base = "tp=8,pp=8,dp=1,mb=1,zero=0,schedule=interleaved,v=3";
    let (states, none) = memory_row(GPT_175B, "8x8xA100", 64, &format!("{base},recompute=none,sp=off"));
    within(states, 45.56, 0.10, "175B weights+grads+optimizer");
    within(none, 66.84, 0.10, "175B activations, no recompute");
    let (_, sel) = memory_row(GPT_175B, "8x8xA100", 64, &format!("{base},recompute=selective,sp=on"));
    within(sel, 12.35, 0.10, "175B activations, sp + selective");
}

fn step_time(cfg: Gpt, cluster: &str, batch: u64, strategy: &str) -> f64 {
    plan(cfg, cluster, batch, strategy, false).plan.estimate.step_time_s
}

#[test]
fn korthikanti_table5_gpt_22b() {
    let base = "tp=8,pp=1,dp=1,mb=4";
    within(step_time(GPT_22B, "8xA100", 4, &format!("{base},recompute=full,sp=off")), 1.42, 0.10, "22B full recompute");
    within(step_time(GPT_22B, "8xA100", 4, &format!("{base},recompute=selective,sp=on")), 1.10, 0.10, "22B sp + selective");
}

#[test]
fn korthikanti_table5_gpt_175b() {
    let base = "tp=8,pp=8,dp=1,mb=1,schedule=interleaved,v=3";
    within(step_time(GPT_175B, "8x8xA100", 64, &format!("{base},recompute=full,sp=off")), 18.13, 0.10, "175B full recompute");
    within(step_time(GPT_175B, "8x8xA100", 64, &format!("{base},recompute=selective,sp=on")), 13.75, 0.10, "175B sp + selective");
}

fn hw_tflops(cfg: Gpt, cluster: &str, batch: u64, strategy: &str) -> f64 {
    plan(cfg, cluster, batch, strategy, false).plan.estimate.hardware_tflops_per_gpu
}

#[test]
fn narayanan_table1_gpt_1_7b() {
    within(hw_tflops(GPT_1_7B, "4x8xA100", 512, "tp=1,pp=1,dp=32,recompute=full"), 137.0, 0.10, "1.7B TFLOP/s");
}

#[test]
fn narayanan_table1_gpt_145_6b() {
    within(hw_tflops(GPT_145_6B, "192x8xA100", 2304, "tp=8,pp=8,dp=24,recompute=full,sp=off"), 148.0, 0.10, "145.6B TFLOP/s");
}

#[test]
fn narayanan_table1_gpt_1t() {
    within(hw_tflops(GPT_1T, "384x8xA100", 3072, "tp=8,pp=64,dp=6,recompute=full,sp=off"), 163.0, 0.10, "1T TFLOP/s");
}
