//! Models of several layer stacks are priced as written: each stack's layers
//! at their own cost, under their own layout, with pipeline stages cutting
//! anywhere among them.

use dplc_ir::Plan;

/// A model of two stacks of different widths — narrow attention layers and
/// wide MLP layers — in the order `first`, `second`.
fn two_stacks(first: &str, second: &str) -> String {
    let stack = |kind: &str, at: usize| {
        if kind == "narrow" {
            format!(
                "repeat 8 {{\n        \
                 h = h + attention(rms_norm(h, d, name = \"n{at}\"), d, heads, rotary = true, \
                 qkv_bias = false, out_bias = false, name = \"att{at}\")\n        \
                 h = h + swiglu(rms_norm(h, d, name = \"m{at}\"), d, 2 * d, name = \"ffn{at}\")\n    }}"
            )
        } else {
            format!(
                "repeat 8 {{\n        \
                 h = h + swiglu(rms_norm(h, d, name = \"n{at}\"), d, 16 * d, name = \"ffn{at}\")\n    }}"
            )
        }
    };
    format!(
        "model two(vocab = 32000, d = 2048, heads = 16) {{\n    \
         input tokens: i32[batch, seq]\n    input targets: i32[batch, seq]\n    \
         param embed: [vocab, d]\n    h = embedding(embed, tokens)\n    \
         {}\n    {}\n    \
         h = rms_norm(h, d, name = \"norm\")\n    param output: [d, vocab]\n    \
         return cross_entropy(h @ output, targets)\n}}\n\
         train two {{\n    seq = 2048\n    global_batch = 64\n    precision = bf16\n    \
         optimizer = adamw(lr = 3e-4)\n}}\n",
        stack(first, 0),
        stack(second, 1)
    )
}

fn plan(text: &str, cluster: &str, strategy: &str) -> Plan {
    let unit = dplc_frontend::parse("two.dpl", text).expect("parses");
    let lowered = unit.lower("two").expect("lowers");
    let cluster = dplc_planner::parse_cluster(cluster).expect("cluster");
    let mut req = dplc_planner::PlanRequest::new(&lowered.graph, lowered.train.clone(), cluster);
    req.pinned = dplc_planner::parse_strategy(strategy).expect("strategy");
    dplc_planner::compile(&req).expect("plans").plan
}

fn rel(a: f64, b: f64) -> f64 {
    (a - b).abs() / a.max(b)
}

/// Swapping two stacks of different widths leaves the step unchanged where
/// nothing else moves (no pipeline: every rank runs every layer), and the
/// search's best plan within 1%.
#[test]
fn swapping_two_stacks_leaves_the_price_unchanged() {
    let (nw, wn) = (two_stacks("narrow", "wide"), two_stacks("wide", "narrow"));
    for strategy in [
        "dp=8,tp=1,pp=1",
        "dp=4,tp=2,pp=1,sp=on",
        "dp=2,tp=4,pp=1,zero=3",
        "dp=8,pp=1,recompute=full,zero=1",
    ] {
        let (a, b) = (
            plan(&nw, "1x8xA100-80GB", strategy),
            plan(&wn, "1x8xA100-80GB", strategy),
        );
        let (ta, tb) = (a.estimate.step_time_s, b.estimate.step_time_s);
        assert!(
            rel(ta, tb) < 1e-9,
            "{strategy}: {ta} s narrow-then-wide vs {tb} s wide-then-narrow"
        );
        assert_eq!(
            a.estimate.peak_memory_bytes, b.estimate.peak_memory_bytes,
            "{strategy}"
        );
    }
    let (a, b) = (
        plan(&nw, "2x8xA100-80GB", ""),
        plan(&wn, "2x8xA100-80GB", ""),
    );
    let (ta, tb) = (a.estimate.step_time_s, b.estimate.step_time_s);
    assert!(
        rel(ta, tb) < 0.01,
        "searched: {ta} s ({}) vs {tb} s ({})",
        a.strategy,
        b.strategy
    );
}

/// Each stack's layers cost what that stack's layer costs: the model's
/// step is the sum of the stacks', not every layer priced as the first.
#[test]
fn each_stack_is_priced_as_written() {
    let strategy = "dp=8,tp=1,pp=1";
    let both = plan(&two_stacks("narrow", "wide"), "1x8xA100-80GB", strategy);
    // The FLOPs of one step follow the graph; the compute priced follows
    // them (the wide stack has more than twice the narrow one's GEMM work).
    let narrow_first = plan(&two_stacks("narrow", "narrow"), "1x8xA100-80GB", strategy);
    let wide_first = plan(&two_stacks("wide", "wide"), "1x8xA100-80GB", strategy);
    let c = |p: &Plan| p.estimate.breakdown.compute_s;
    let mid = (c(&narrow_first) + c(&wide_first)) / 2.0;
    assert!(
        rel(c(&both), mid) < 0.02,
        "compute of narrow+wide {} s is the mean of narrow+narrow {} s and wide+wide {} s",
        c(&both),
        c(&narrow_first),
        c(&wide_first)
    );
}

/// A pipeline balances stages by the time of the layers they hold: the
/// cheap stack's stages hold more layers.
#[test]
fn pipeline_stages_balance_heterogeneous_layers() {
    let p = plan(
        &two_stacks("narrow", "wide"),
        "1x8xA100-80GB",
        "dp=2,tp=1,pp=4,schedule=1f1b",
    );
    let layers: Vec<u64> = p.stages.iter().map(|s| s.layers).collect();
    assert_eq!(layers.iter().sum::<u64>(), 16);
    assert!(
        layers[0] > layers[3],
        "the narrow layers' stages hold more of them: {layers:?}"
    );
    let times: Vec<f64> = p
        .stages
        .iter()
        .map(|s| s.forward_s + s.backward_s)
        .collect();
    let (max, min) = (
        times.iter().copied().fold(0.0, f64::max),
        times.iter().copied().fold(f64::MAX, f64::min),
    );
    assert!(
        max / min < 1.5,
        "stages within 1.5x of each other: {times:?} for {layers:?}"
    );
}
