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

fn tp(t: u64) -> ShardOptions {
    ShardOptions::tensor_parallel(t)
}

fn count(r: &ShardResult, kind: CollectiveKind, pass: Pass) -> usize {
    r.collectives
        .iter()
        .filter(|c| c.kind == kind && c.pass == pass)
        .count()
}

/// Elements a pass moves over tp, evaluated at `bind`.
fn tp_elements(g: &Graph, r: &ShardResult, pass: Pass, batch: i64, seq: i64) -> i64 {
    let (b, s) = (g.sym_by_name("batch"), g.sym_by_name("seq"));
    let bind = |x| {
        if Some(x) == b {
            batch
        } else if Some(x) == s {
            seq
        } else {
            1
        }
    };
    r.collectives
        .iter()
        .filter(|c| c.pass == pass && c.mesh == MeshAxis::Tp)
        .map(|c| c.elements.eval(&bind))
        .sum()
}

fn split_names(g: &Graph, r: &ShardResult) -> Vec<String> {
    dplc_planner::egraph::split_param_names(g, r)
        .into_iter()
        .collect()
}

/// Megatron's layout for one layer: one all-reduce of b·s·h after attention
/// and one after the MLP in forward, two in backward, nothing else; QKV and
/// MLP-up split by columns, attention-out and MLP-down by rows.
fn assert_megatron(g: &Graph, t: u64, hidden: i64) {
    let r = shard(g, layer(g), &tp(t));
    assert_eq!(
        count(&r, CollectiveKind::AllReduce, Pass::Forward),
        2,
        "{}",
        r.collectives_text(g)
    );
    assert_eq!(
        count(&r, CollectiveKind::AllReduce, Pass::Backward),
        2,
        "{}",
        r.collectives_text(g)
    );
    assert_eq!(r.collectives.len(), 4, "{}", r.collectives_text(g));
    for c in &r.collectives {
        assert_eq!(
            c.elements.eval(&|_| 3),
            9 * hidden,
            "b·s·h elements: {}",
            r.collectives_text(g)
        );
    }
    let splits = split_names(g, &r);
    for want in ["q.w/1", "k.w/1", "v.w/1", "o.w/0"] {
        assert!(
            splits
                .iter()
                .any(|s| s.ends_with(want) && s.contains("attention")),
            "{want} in {splits:?}"
        );
    }
    let mlp_col = splits
        .iter()
        .filter(|s| s.ends_with("/1") && !s.contains("attention"))
        .count();
    let mlp_row = splits
        .iter()
        .filter(|s| s.ends_with("/0") && !s.contains("attention") && !s.ends_with(".b/0"))
        .count();
    assert!(
        mlp_col >= 1 && mlp_row >= 1,
        "MLP split by columns then rows: {splits:?}"
    );
}

#[test]
fn gpt_tiny_megatron_layout() {
    insta::assert_snapshot!(check(
        &model("tiny.dpl", "gpt_tiny"),
        layer(&model("tiny.dpl", "gpt_tiny")),
        &tp(2)
    ));
    assert_megatron(&model("tiny.dpl", "gpt_tiny"), 2, 64);
}

#[test]
fn gpt2_and_megatron_gpt_megatron_layout() {
    assert_megatron(&model("gpt2.dpl", "gpt2"), 4, 768);
    assert_megatron(&model("megatron_gpt.dpl", "gpt_1_7b"), 8, 2304);
}

#[test]
fn llama_megatron_layout() {
    let g = model("tiny.dpl", "llama_tiny");
    insta::assert_snapshot!(check(&g, layer(&g), &tp(2)));
    assert_megatron(&g, 2, 64);
    assert_megatron(&model("llama3.dpl", "llama3_8b"), 8, 4096);
}

#[test]
fn kv_projections_replicate_above_kv_heads() {
    let g = model("tiny.dpl", "llama_tiny");
    let r = shard(&g, layer(&g), &tp(4));
    insta::assert_snapshot!(check(&g, layer(&g), &tp(4)));
    let splits = split_names(&g, &r);
    assert!(splits.iter().any(|s| s.contains("q.w")), "{splits:?}");
    assert!(
        !splits
            .iter()
            .any(|s| s.contains("k.w") || s.contains("v.w")),
        "KV replicated: {splits:?}"
    );
    let g = model("llama3.dpl", "llama3_8b");
    let r = shard(&g, layer(&g), &tp(16));
    let splits = split_names(&g, &r);
    assert!(
        !splits
            .iter()
            .any(|s| s.contains("k.w") || s.contains("v.w")),
        "KV replicated: {splits:?}"
    );
}

#[test]
fn sequence_parallel_splits_all_reduces() {
    let g = model("tiny.dpl", "gpt_tiny");
    let opts = ShardOptions {
        sequence_parallel: true,
        ..tp(2)
    };
    insta::assert_snapshot!(check(&g, layer(&g), &opts));
    let r = shard(&g, layer(&g), &opts);
    let plain = shard(&g, layer(&g), &tp(2));
    assert_eq!(count(&r, CollectiveKind::AllReduce, Pass::Forward), 0);
    assert_eq!(count(&r, CollectiveKind::ReduceScatter, Pass::Forward), 2);
    assert_eq!(count(&r, CollectiveKind::AllGather, Pass::Forward), 2);
    assert_eq!(count(&r, CollectiveKind::ReduceScatter, Pass::Backward), 2);
    assert_eq!(count(&r, CollectiveKind::AllGather, Pass::Backward), 2);
    // Same total volume: an all-reduce moves twice what a reduce-scatter does.
    let volume = |r: &ShardResult, pass| {
        r.collectives
            .iter()
            .filter(|c| {
                c.pass == pass && c.mesh == MeshAxis::Tp && c.kind != CollectiveKind::AllReduce
            })
            .map(|c| c.elements.eval(&|_| 8))
            .sum::<i64>()
    };
    assert_eq!(
        volume(&r, Pass::Forward),
        2 * tp_elements(&g, &plain, Pass::Forward, 8, 8)
    );
    assert!(
        r.program
            .lines()
            .any(|l| l.contains("(norm ") && l.contains("tp:shard(1)")),
        "norms on sequence shards:\n{}",
        r.program
    );
}

#[test]
fn moe_experts_all_to_all() {
    let g = model("tiny.dpl", "moe_tiny");
    let opts = ShardOptions {
        ep: 2,
        ..ShardOptions::default()
    };
    insta::assert_snapshot!(check(&g, layer(&g), &opts));
    let r = shard(&g, layer(&g), &opts);
    assert_eq!(
        count(&r, CollectiveKind::AllToAll, Pass::Forward),
        2,
        "{}",
        r.collectives_text(&g)
    );
    assert_eq!(count(&r, CollectiveKind::AllToAll, Pass::Backward), 2);
    assert_eq!(r.sharding.all_to_all.len(), 2);
    let g = model("mixtral.dpl", "mixtral_8x7b");
    let r = shard(
        &g,
        layer(&g),
        &ShardOptions {
            ep: 8,
            ..ShardOptions::default()
        },
    );
    assert_eq!(
        count(&r, CollectiveKind::AllToAll, Pass::Forward),
        2,
        "{}",
        r.collectives_text(&g)
    );
    assert_eq!(count(&r, CollectiveKind::AllToAll, Pass::Backward), 2);
}

#[test]
fn one_rank_needs_no_collective() {
    for (file, name) in [
        ("tiny.dpl", "gpt_tiny"),
        ("tiny.dpl", "llama_tiny"),
        ("tiny.dpl", "moe_tiny"),
    ] {
        let g = model(file, name);
        let r = shard(&g, layer(&g), &tp(1));
        assert!(
            r.collectives.is_empty(),
            "{name}: {}",
            r.collectives_text(&g)
        );
        assert!(r.sharding.split_params.is_empty());
        let r = shard(&g, g.root(), &tp(1));
        assert!(
            r.collectives.is_empty(),
            "{name} root: {}",
            r.collectives_text(&g)
        );
    }
}

#[test]
fn vocab_parallel_embedding_and_loss() {
    let g = model("tiny.dpl", "gpt_tiny");
    insta::assert_snapshot!(check(&g, g.root(), &tp(2)));
}

/// Megatron's closed form: 4·b·s·h all-reduced elements per layer per step.
#[test]
fn volumes_match_megatron_closed_form() {
    for (file, name, h, heads) in [
        ("tiny.dpl", "gpt_tiny", 64, 4),
        ("gpt2.dpl", "gpt2", 768, 12),
        ("megatron_gpt.dpl", "gpt_1_7b", 2304, 24),
        ("megatron_gpt.dpl", "gpt_175b", 12288, 96),
    ] {
        let g = model(file, name);
        for t in [2, 4, 8].into_iter().filter(|t| heads % t == 0) {
            let r = shard(&g, layer(&g), &tp(t));
            let (b, s) = (4, 2048);
            let total = tp_elements(&g, &r, Pass::Forward, b, s)
                + tp_elements(&g, &r, Pass::Backward, b, s);
            assert_eq!(
                total,
                4 * b * s * h,
                "{name} at tp {t}:\n{}",
                r.collectives_text(&g)
            );
        }
    }
}

/// The result reads like `sharding::propagate`'s for the planner.
#[test]
fn region_sharding_for_the_planner() {
    let g = model("tiny.dpl", "gpt_tiny");
    let r = shard(&g, layer(&g), &tp(2));
    let s = &r.sharding;
    assert_eq!(s.collectives.len(), 4);
    assert_eq!(s.max_tp, 4, "heads bound the degree");
    assert!(!s.sharded.is_empty());
    assert!(r.stats.stop_reason == "saturated", "{:?}", r.stats);
    assert!(r.stats.nodes < 2000, "{:?}", r.stats);
}
