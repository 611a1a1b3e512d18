//! The sharding e-graph on the zoo's layer bodies: golden programs and
//! collective lists, Megatron's layout and volumes rediscovered.
//! Re-bless with `cargo insta review` (or `INSTA_UPDATE=always cargo test -p dplc-planner --test egraph`).

use dplc_ir::{Analysis, Graph, RegionId};
use dplc_planner::egraph::{
    shard_region, CollectiveKind, MeshAxis, Pass, ShardOptions, ShardResult,
};

fn model(file: &str, name: &str) -> Graph {
    let path = format!("{}/../models/{file}", env!("CARGO_MANIFEST_DIR"));
    let text = std::fs::read_to_string(&path).expect("zoo files are in the repository");
    let unit = dplc_frontend::parse(&format!("models/{file}"), &text)
        .unwrap_or_else(|d| panic!("{}", d.render_plain()));
    unit.lower(name)
        .unwrap_or_else(|d| panic!("{}", d.render_plain()))
        .graph
}

fn layer(g: &Graph) -> RegionId {
    Analysis::new(g)
        .layer_body()
        .expect("zoo models have layers")
}

fn shard(g: &Graph, region: RegionId, opts: &ShardOptions) -> ShardResult {
    let an = Analysis::new(g);
    shard_region(g, &an, region, opts).unwrap_or_else(|e| panic!("{e}"))
}

/// The program and the collective list, as the golden files hold them.
fn check(g: &Graph, region: RegionId, opts: &ShardOptions) -> String {
    let r = shard(g, region, opts);
    format!(
        "{}\ncollectives:\n{}stop: {}",
        r.program,
        r.collectives_text(g),
        r.stats.stop_reason
    )
}

#[test]
fn explore() {
    let g = model("tiny.dpl", "gpt_tiny");
    let r = shard(&g, layer(&g), &ShardOptions::tensor_parallel(2));
    println!("{}\n{}\n{:?}", r.program, r.collectives_text(&g), r.stats);
    let _ = (
        check,
        CollectiveKind::AllReduce,
        MeshAxis::Tp,
        Pass::Forward,
    );
}
