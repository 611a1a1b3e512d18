//! Search time for the benchmark: gpt_1t on 384×8 A100 (3072 GPUs),
//! nothing pinned, release build. `cargo bench -p dplc-planner --bench search`.

#[path = "../tests/common/mod.rs"]
mod common;

use dplc_planner::{compile, parse_cluster, PlanRequest};
use std::time::Instant;

fn main() {
    let cases = [
        ("gpt_1t", common::GPT_1T, "384x8xA100", 3072u64),
        ("gpt_175b", common::GPT_175B, "128x8xA100", 1536),
        ("gpt_1_7b", common::GPT_1_7B, "4x8xA100", 512),
    ];
    for (name, cfg, cluster, batch) in cases {
        let build = Instant::now();
        let g = common::gpt(name, cfg);
        let build_ms = build.elapsed().as_secs_f64() * 1e3;
        let req = PlanRequest::new(
            &g,
            common::train(2048, batch),
            parse_cluster(cluster).unwrap(),
        );
        let mut times = Vec::new();
        let mut last = None;
        for _ in 0..5 {
            let t = Instant::now();
            let c = compile(&req).expect("the model fits");
            times.push(t.elapsed().as_secs_f64() * 1e3);
            last = Some(c);
        }
        times.sort_by(f64::total_cmp);
        let c = last.expect("ran at least once");
        let p = &c.plan;
        println!(
            "{name:<9} on {cluster:<11} batch {batch:>4}: search median {:.1} ms (min {:.1}, max {:.1}) over 5 runs; \
             {} configs, {} fit; graph build {build_ms:.1} ms; chose dp {} tp {} pp {} mb {} {} v={} zero {} recompute {} sp {}; \
             {:.1} TFLOP/s/GPU hardware",
            times[2], times[0], times[4],
            p.search.configs_evaluated, p.search.feasible,
            p.mesh.dp, p.mesh.tp, p.mesh.pp, p.strategy.micro_batch, p.strategy.schedule.name(),
            p.strategy.virtual_stages, p.strategy.zero_stage, p.strategy.recompute.name(),
            p.strategy.sequence_parallel, p.estimate.hardware_tflops_per_gpu,
        );
    }
}
