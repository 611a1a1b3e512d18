//! "start => goal" for each rule family, on ops of the tiny zoo models'
//! layer bodies (see `tests/snapshots/golden_ir__*.snap` for the node ids).

use dplc_ir::{Analysis, Graph, RegionId};
use dplc_planner::egraph::{proves, rules, ShardOptions};

fn model(name: &str) -> Graph {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../models/tiny.dpl");
    let text = std::fs::read_to_string(path).expect("zoo files are in the repository");
    let unit = dplc_frontend::parse("models/tiny.dpl", &text)
        .unwrap_or_else(|d| panic!("{}", d.render_plain()));
    unit.lower(name)
        .unwrap_or_else(|d| panic!("{}", d.render_plain()))
        .graph
}

fn check(
    name: &str,
    opts: ShardOptions,
    rules: Vec<rules::Rule>,
    root: bool,
    start: &str,
    goal: &str,
) {
    let g = model(name);
    let an = Analysis::new(&g);
    let region: RegionId = if root {
        g.root()
    } else {
        an.layer_body().expect("a layer")
    };
    let ok = proves(&g, &an, region, &opts, &rules, start, goal).unwrap_or_else(|e| panic!("{e}"));
    assert!(ok, "{start}\n  does not reach\n{goal}");
}

/// `egg::test_fn!` with this e-graph's context: model, options, rules, start => goal.
macro_rules! rule_test {
    ($name:ident, $model:literal, $opts:expr, $rules:expr, $start:literal => $goal:literal) => {
        #[test]
        fn $name() {
            check($model, $opts, $rules, false, $start, $goal);
        }
    };
    ($name:ident, root $model:literal, $opts:expr, $rules:expr, $start:literal => $goal:literal) => {
        #[test]
        fn $name() {
            check($model, $opts, $rules, true, $start, $goal);
        }
    };
}

fn tp(t: u64) -> ShardOptions {
    ShardOptions::tensor_parallel(t)
}

fn sp(t: u64) -> ShardOptions {
    ShardOptions {
        sequence_parallel: true,
        ..tp(t)
    }
}

fn ep(e: u64) -> ShardOptions {
    ShardOptions {
        ep: e,
        ..ShardOptions::default()
    }
}

fn rules_of(families: &[fn() -> Vec<rules::Rule>]) -> Vec<rules::Rule> {
    families.iter().flat_map(|f| f()).collect()
}

// Node ids: in a layer body node `nK` defines tensor `%(K+1)` of the golden IR
// (the argument takes `%8`/`%4`); in the root, `nK` defines `%K` before the
// repeat and `%(K+1)` after it; a two-output node (topk) shifts later ids by one.
rule_test!(elementwise_gelu_and_bias, "gpt_tiny", tp(2), rules::elementwise::rules(),
    "(shard tp 2 (unary n50 (binary n49 (matmul n47 (arg 0) (param n46)) (param n48))))"
    => "(unary n50 (binary n49 (shard tp 2 (matmul n47 (arg 0) (param n46))) (shard tp 0 (param n48))))");

rule_test!(matmul_column_split, "gpt_tiny", tp(2), rules::matmul::rules(),
    "(shard tp 2 (matmul n12 (arg 0) (param n11)))"
    => "(matmul n12 (arg 0) (shard tp 1 (param n11)))");

rule_test!(matmul_row_split_to_all_reduce, "gpt_tiny", tp(2), rules_of(&[rules::partial::rules, rules::matmul::rules]),
    "(matmul n52 (arg 0) (param n51))"
    => "(all-reduce tp (matmul n52 (shard tp 2 (arg 0)) (shard tp 0 (param n51))))");

rule_test!(partial_resolves_by_reduce_scatter, "gpt_tiny", sp(2), rules::partial::rules(),
    "(shard tp 1 (matmul n52 (arg 0) (param n51)))"
    => "(reduce-scatter tp 1 (partial tp (matmul n52 (arg 0) (param n51))))");

rule_test!(attention_split_by_heads, "gpt_tiny", tp(2), rules_of(&[rules::attention::rules, rules::matmul::rules]),
    "(shard tp 1 (transpose n26 (reshape n15 (matmul n12 (arg 0) (param n11)))))"
    => "(transpose n26 (reshape n15 (matmul n12 (arg 0) (shard tp 1 (param n11)))))");

// llama_tiny: %62 = k heads expanded to 4 query heads from 2 KV heads.
rule_test!(attention_gqa_splits_kv_heads, "llama_tiny", tp(2), rules::attention::rules(),
    "(shard tp 2 (reshape n61 (expand n60 (reshape n59 (arg 0)))))"
    => "(reshape n61 (expand n60 (reshape n59 (shard tp 2 (arg 0)))))");

rule_test!(vocab_parallel_softmax, root "gpt_tiny", tp(2), rules_of(&[rules::vocab::rules, rules::matmul::rules, rules::attention::rules]),
    "(shard tp 2 (softmax n62 (matmul n61 (norm n59 (leaf n0) (param n57) (param n58)) (transpose n60 (param n2)))))"
    => "(softmax n62 (matmul n61 (norm n59 (leaf n0) (param n57) (param n58)) (transpose n60 (shard tp 0 (param n2)))))");

rule_test!(vocab_parallel_embedding, root "gpt_tiny", tp(2), rules::vocab::rules(),
    "(embedding n4 (param n2) (leaf n0))"
    => "(all-reduce tp (embedding n4 (shard tp 0 (param n2)) (leaf n0)))");

rule_test!(moe_dispatch_all_to_all, "moe_tiny", ep(2), rules_of(&[rules::moe::rules, rules::matmul::rules]),
    "(shard ep 0 (matmul n85 (moe-dispatch n81 (arg 0) (arg 0)) (param n82)))"
    => "(matmul n85 (all-to-all ep 0 (moe-dispatch n81 (arg 0) (arg 0))) (shard ep 0 (param n82)))");

rule_test!(context_norm_on_sequence_shards, "gpt_tiny", sp(2), rules_of(&[rules::context::rules, rules::elementwise::rules]),
    "(norm n10 (arg 0) (param n8) (param n9))"
    => "(all-gather tp 1 (norm n10 (shard tp 1 (arg 0)) (param n8) (param n9)))");
