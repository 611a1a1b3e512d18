//! The Megatron layout `dplc_planner::derive_layout` gives the tiny zoo models:
//! which parameters each split puts on which ranks, as text.

const TINY: &str = include_str!("../models/tiny.dpl");

fn check(model: &str, tp: u64, ep: u64, sp: bool) -> String {
    let unit = dplc_frontend::parse("tiny.dpl", TINY).expect("tiny.dpl parses");
    let g = unit.lower(model).expect("the model lowers").graph;
    let layout = dplc_planner::derive_layout(&g, tp, ep, sp).expect("a layout");
    let mut lines: Vec<String> = layout
        .params
        .iter()
        .map(|s| {
            let how = match s.split {
                dplc_ir::SplitAxis::Tensor { axis } => format!("tp axis {axis}"),
                dplc_ir::SplitAxis::Expert => "ep experts".to_string(),
            };
            format!("{} {how}", g.param(s.param).name)
        })
        .collect();
    let body = &layout.regions[1];
    let arg = body.args[0];
    lines.push(format!("residual stream {arg:?}"));
    lines.join("\n")
}

#[test]
fn gpt_tiny_megatron_layout() {
    assert_eq!(
        check("gpt_tiny", 2, 1, false),
        "layers.attention.q.w tp axis 1
layers.attention.q.b tp axis 0
layers.attention.k.w tp axis 1
layers.attention.k.b tp axis 0
layers.attention.v.w tp axis 1
layers.attention.v.b tp axis 0
layers.attention.o.w tp axis 0
layers.mlp.fc.w tp axis 1
layers.mlp.fc.b tp axis 0
layers.mlp.proj.w tp axis 0
residual stream Replicated"
    );
    assert!(check("gpt_tiny", 2, 1, true).ends_with("residual stream Split { axis: 1 }"));
}

#[test]
fn llama_and_moe_tiny_layouts() {
    assert_eq!(
        check("llama_tiny", 2, 1, false),
        "layers.attention.q.w tp axis 1
layers.attention.k.w tp axis 1
layers.attention.v.w tp axis 1
layers.attention.o.w tp axis 0
layers.swiglu.w1 tp axis 1
layers.swiglu.w3 tp axis 1
layers.swiglu.w2 tp axis 0
residual stream Replicated"
    );
    assert_eq!(
        check("moe_tiny", 1, 2, false),
        "layers.moe.w1 ep experts
layers.moe.w3 ep experts
layers.moe.w2 ep experts
residual stream Replicated"
    );
}

#[test]
fn a_tensor_parallel_degree_the_model_cannot_take_is_refused() {
    let unit = dplc_frontend::parse("tiny.dpl", TINY).expect("tiny.dpl parses");
    let g = unit.lower("gpt_tiny").expect("the model lowers").graph;
    let err = dplc_planner::derive_layout(&g, 8, 1, false).unwrap_err();
    assert!(
        err.to_string().contains("tp 8 does not divide the 4 heads"),
        "{err}"
    );
    let err = dplc_planner::derive_layout(&g, 3, 1, false).unwrap_err();
    assert!(
        err.to_string().contains("tp 3 divides neither dimension"),
        "{err}"
    );
}

#[test]
fn layouts_travel_in_plan_files() {
    let unit = dplc_frontend::parse("tiny.dpl", TINY).expect("tiny.dpl parses");
    let lowered = unit.lower("moe_tiny").expect("the model lowers");
    let cluster = dplc_planner::parse_cluster("4xcpu").unwrap();
    let mut req = dplc_planner::PlanRequest::new(&lowered.graph, lowered.train.clone(), cluster);
    req.pinned = dplc_planner::parse_strategy("dp=2,tp=2,ep=2,sp=true").unwrap();
    let mut plan = dplc_planner::compile(&req).unwrap().plan;
    // Expert parallelism runs the layout the search priced (the e-graph's):
    // the experts over ep, each whole over tp, the tokens reaching them in
    // the experts layout; and the root split over the vocabulary.
    let layout = plan
        .layout
        .clone()
        .expect("a split plan carries its layout");
    let g = &lowered.graph;
    for (p, info) in g.params() {
        if info.name.starts_with("layers.moe.w") {
            assert_eq!(
                layout.param_split(p),
                Some(dplc_ir::SplitAxis::Expert),
                "{}",
                info.name
            );
        }
    }
    assert!(layout.regions[1].nodes.iter().any(|n| matches!(
        g.node(n.node).op,
        dplc_ir::Op::MatMul
    ) && n.inputs
        == [
            dplc_ir::TensorLayout::Experts,
            dplc_ir::TensorLayout::Experts
        ]));
    assert_eq!((layout.tp, layout.ep), (2, 2));
    assert!(layout.regions[0]
        .nodes
        .iter()
        .any(|n| n.outputs == [dplc_ir::TensorLayout::Partial]));
    // A plan written before layouts existed still reads, with none.
    let older = dplc_ir::Plan {
        layout: None,
        ..plan.clone()
    };
    let old = ron::to_string(&older).unwrap().replace(",layout:None", "");
    assert!(!old.contains("layout:None"));
    let back: dplc_ir::Plan = ron::from_str(&old).unwrap();
    assert_eq!(back.layout, None);
    plan.layout = Some(dplc_planner::derive_layout(&lowered.graph, 2, 2, true).unwrap());
    let back: dplc_ir::Plan = ron::from_str(&ron::to_string(&plan).unwrap()).unwrap();
    assert_eq!(back, plan);
    // The runtime takes the plan's layout as it is.
    let cfg = dplc_runtime::RunConfig::from_plan(&back).unwrap();
    assert_eq!((cfg.dp, cfg.tp, cfg.ep, cfg.pp), (2, 2, 2, 1));
    assert!(cfg.sequence_parallel && cfg.layout.is_some());
}

/// A tensor degree the cluster allows but no layer dimension divides is left
/// out of the search with the reason in the plan, which `compile --verbose`
/// and `explain` print — never an internal error, never silently.
#[test]
fn a_degree_the_layers_cannot_split_is_skipped_with_why() {
    let text = TINY.replace(
        "d = 64, heads = 4, layers = 2, dropout = 0.0",
        "d = 6, heads = 3, layers = 2, dropout = 0.0",
    );
    let unit = dplc_frontend::parse("tiny.dpl", &text).expect("parses");
    let lowered = unit.lower("gpt_tiny").expect("lowers");
    let cluster = dplc_planner::parse_cluster("16xcpu").unwrap();
    let req = dplc_planner::PlanRequest::new(&lowered.graph, lowered.train.clone(), cluster);
    let compiled = dplc_planner::compile(&req).unwrap();
    let skipped = &compiled.plan.search.skipped;
    assert_eq!(skipped.len(), 1, "{skipped:?}");
    assert_eq!((skipped[0].tp, skipped[0].ep), (16, 1));
    assert_eq!(
        skipped[0].reason,
        "no head or hidden dimension of the layer divides by 16"
    );
    assert!(dplc_planner::layouts_summary(&compiled).contains(
        "skipped tp 16 ep 1: no head or hidden dimension of the layer divides by 16 (not searched)"
    ));
    let mut req = dplc_planner::PlanRequest::new(
        &lowered.graph,
        lowered.train.clone(),
        dplc_planner::parse_cluster("16xcpu").unwrap(),
    );
    req.pinned = dplc_planner::parse_strategy("tp=16").unwrap();
    let err = dplc_planner::compile(&req).unwrap_err().to_string();
    assert!(err.contains("divides by 16"), "{err}");
}

/// A model of several layer stacks gets a layout that splits every stack
/// (the planner prices each layer split), not the first alone.
#[test]
fn every_layer_stack_is_laid_out() {
    let text = format!(
        "{TINY}\nmodel two(vocab = 256, d = 64, heads = 4) {{\n    input tokens: i32[batch, seq]\n    \
         input targets: i32[batch, seq]\n    param embed: [vocab, d]\n    h = embedding(embed, tokens)\n    \
         repeat 2 {{\n        h = h + attention(rms_norm(h, d, name = \"a\"), d, heads, rotary = true)\n    }}\n    \
         repeat 2 {{\n        h = h + swiglu(rms_norm(h, d, name = \"b\"), d, 128)\n    }}\n    \
         return cross_entropy(rms_norm(h, d, name = \"n\") @ transpose(embed), targets)\n}}\n"
    );
    let unit = dplc_frontend::parse("two.dpl", &text).expect("parses");
    let lowered = unit.lower("two").expect("lowers");
    let cluster = dplc_planner::parse_cluster("2xcpu").unwrap();
    let mut req = dplc_planner::PlanRequest::new(&lowered.graph, lowered.train.clone(), cluster);
    req.pinned = dplc_planner::parse_strategy("tp=2").unwrap();
    let plan = dplc_planner::compile(&req).unwrap().plan;
    let layout = plan.layout.expect("a tp plan carries its layout");
    let bodies = lowered.graph.regions().count();
    assert_eq!(
        layout.regions.len(),
        bodies,
        "{:?}",
        layout.regions.iter().map(|r| r.region).collect::<Vec<_>>()
    );
    assert!(
        layout.params.len() > 4,
        "both stacks' weights split: {:?}",
        layout.params
    );
}

/// What runs is what was priced, for the parameters: the weights the plan
/// prices on a rank are the elements its layout puts there (each tensor-split
/// parameter a `tp`-th, each expert-split one an `ep`-th), to the byte. Under
/// expert parallelism the runtime keeps every expert whole on its rank (its
/// layout splits the experts over ep alone), and the plan prices that, not
/// experts split over tp as well (it did, and read a dp2 × ep2 × tp2 MoE run
/// at 1.66× its measured memory). Each case below failed once: a tied
/// embedding counted one and a half times (gpt2 at tp 2), experts priced
/// split over tp 8 and run whole (mixtral: 11.7 GB priced, 90.6 GB held), a
/// vocabulary-split root priced and a whole one run (bert, t5).
#[test]
fn the_plan_prices_the_parameters_its_layout_holds() {
    let mut wrong = Vec::new();
    for (file, model, cluster, strategy) in [
        (
            "tiny.dpl",
            "moe_tiny",
            "4xcpu",
            "dp=2,ep=2,tp=2,pp=1,zero=1",
        ),
        (
            "tiny.dpl",
            "moe_tiny",
            "4xcpu",
            "dp=2,ep=2,tp=2,pp=1,zero=1,sp=off",
        ),
        ("tiny.dpl", "moe_tiny", "2xcpu", "dp=1,tp=2,pp=1,zero=0"),
        ("tiny.dpl", "gpt_tiny", "2xcpu", "dp=1,tp=2,pp=1,zero=0"),
        ("tiny.dpl", "llama_tiny", "4xcpu", "dp=2,tp=2,pp=1,zero=2"),
        (
            "deepseek.dpl",
            "deepseek_tiny",
            "4xcpu",
            "dp=2,ep=2,tp=2,pp=1,zero=1",
        ),
        (
            "mixtral.dpl",
            "mixtral_8x7b",
            "4x8xH200",
            "dp=16,ep=8,tp=2,pp=1,zero=1",
        ),
        // A node the e-graph computes in two layouts (three reshapes of each
        // Mixtral layer, whole for one reader and split for another) runs
        // once, whole.
        (
            "mixtral.dpl",
            "mixtral_8x7b",
            "8x8xH200",
            "tp=8,pp=1,zero=0",
        ),
        // A tied embedding is stored once, as the root's layout holds it.
        ("gpt2.dpl", "gpt2", "8x8xH200", "tp=2,pp=1,zero=0"),
        // A root whose vocabulary split the runtime cannot say (the head
        // reads the tied embedding through a view) is planned whole.
        (
            "bert.dpl",
            "bert_base",
            "8x8xH200",
            "tp=2,pp=1,sp=on,zero=0",
        ),
        ("bert.dpl", "bert_base", "8x8xH200", "tp=8,pp=1,zero=0"),
        ("t5.dpl", "t5_tiny", "8x8xH200", "tp=8,pp=1,zero=0"),
    ] {
        let plan = plan_of(file, model, cluster, strategy).expect("the case plans");
        wrong.extend(weights_against_layout(file, model, strategy, &plan));
    }
    assert!(wrong.is_empty(), "{}", wrong.join("\n"));
}

/// A pinned choice the runtime cannot run as priced (T5's layer stacks under
/// sequence parallelism) is planned as asked, with a caveat that says so in
/// the summary and the JSON; unpinned, `compile` plans without it and has
/// nothing to say.
#[test]
fn a_pinned_choice_the_runtime_cannot_run_as_priced_says_so() {
    let path = format!("{}/models/t5.dpl", env!("CARGO_MANIFEST_DIR"));
    let text = std::fs::read_to_string(&path).expect("the zoo file exists");
    let unit = dplc_frontend::parse("t5.dpl", &text).expect("parses");
    let lowered = unit.lower("t5_small").expect("lowers");
    let compile = |strategy: &str| {
        let mut req = dplc_planner::PlanRequest::new(
            &lowered.graph,
            lowered.train.clone(),
            dplc_planner::parse_cluster("8x8xH200").unwrap(),
        );
        req.pinned = dplc_planner::parse_strategy(strategy).unwrap();
        dplc_planner::compile(&req).unwrap()
    };
    let pinned = compile("tp=2,sp=on");
    assert!(pinned.plan.strategy.sequence_parallel);
    let caveat = pinned.caveat().expect("a caveat");
    assert!(caveat.contains("unpin sp=on"), "{caveat}");
    assert!(dplc_planner::summary(&pinned).contains("  caveat    "));
    assert_eq!(dplc_planner::to_json(&pinned)["caveat"], caveat.as_str());
    let free = compile("tp=2");
    assert!(!free.plan.strategy.sequence_parallel);
    assert_eq!(free.caveat(), None);
    assert!(dplc_planner::to_json(&free)["caveat"].is_null());
}

/// The plan `compile` makes of `model` in `models/FILE` on `cluster` with
/// `strategy` pinned, or why it cannot.
fn plan_of(
    file: &str,
    model: &str,
    cluster: &str,
    strategy: &str,
) -> Result<dplc_ir::Plan, String> {
    let path = format!("{}/models/{file}", env!("CARGO_MANIFEST_DIR"));
    let text = std::fs::read_to_string(&path).expect("the zoo file exists");
    let unit = dplc_frontend::parse(file, &text).expect("parses");
    let lowered = unit.lower(model).expect("lowers");
    let mut req = dplc_planner::PlanRequest::new(
        &lowered.graph,
        lowered.train.clone(),
        dplc_planner::parse_cluster(cluster).unwrap(),
    );
    req.pinned = dplc_planner::parse_strategy(strategy).unwrap();
    dplc_planner::compile(&req)
        .map(|c| c.plan)
        .map_err(|e| e.to_string())
}

/// Where the weights `plan` prices on its first stage differ from the
/// elements its layout puts on a rank (each tensor-split parameter a
/// `tp`-th, each expert-split one an `ep`-th), what they are.
fn weights_against_layout(
    file: &str,
    model: &str,
    strategy: &str,
    plan: &dplc_ir::Plan,
) -> Option<String> {
    let path = format!("{}/models/{file}", env!("CARGO_MANIFEST_DIR"));
    let text = std::fs::read_to_string(&path).expect("the zoo file exists");
    let unit = dplc_frontend::parse(file, &text).expect("parses");
    let lowered = unit.lower(model).expect("lowers");
    let g = &lowered.graph;
    let layout = plan.layout.as_ref()?;
    let held: u128 = g
        .params()
        .map(|(p, _)| {
            let n = g.param_elements(p);
            match layout.param_split(p) {
                None => n,
                Some(dplc_ir::SplitAxis::Tensor { .. }) => n / layout.tp as u128,
                Some(dplc_ir::SplitAxis::Expert) => n / layout.ep as u128,
            }
        })
        .sum();
    let bytes = match lowered.train.precision {
        dplc_ir::Precision::Fp32 => 4,
        _ => 2,
    };
    (plan.stages[0].memory.weights as u128 != held * bytes).then(|| {
        format!(
            "{model} {strategy}: the plan prices {} bytes of weights, its layout holds {}",
            plan.stages[0].memory.weights,
            held * bytes
        )
    })
}

/// The same check over the zoo's models under the splits people pin (tp 2
/// with and without sequence parallelism, tp 4 and 8, tp × ep, ep alone) on
/// 8x8xH200 — a sweep, too slow for a debug test run:
/// `cargo test --release --test layout -- --ignored` (2026-11-25: every
/// plan that compiles matches).
#[test]
#[ignore]
fn every_zoo_plan_prices_the_parameters_its_layout_holds() {
    let mut wrong = Vec::new();
    let mut checked = 0;
    for (file, model) in [
        ("bert.dpl", "bert_base"),
        ("deepseek.dpl", "deepseek_v2_lite"),
        ("gemma.dpl", "gemma_2b"),
        ("gpt2.dpl", "gpt2"),
        ("llama2.dpl", "llama2_7b"),
        ("llama3.dpl", "llama3_8b"),
        ("megatron_gpt.dpl", "gpt_1_7b"),
        ("mistral.dpl", "mistral_7b"),
        ("mixtral.dpl", "mixtral_8x7b"),
        ("t5.dpl", "t5_small"),
        ("vit.dpl", "vit_b16"),
    ] {
        // ZeRO-0: the weights whole on each rank, as the layout holds them.
        for strategy in [
            "tp=2,pp=1,sp=off,zero=0",
            "tp=2,pp=1,zero=0",
            "tp=4,pp=1,zero=0",
            "tp=8,pp=1,zero=0",
            "tp=2,ep=2,pp=1,zero=0",
            "tp=1,ep=4,pp=1,zero=0",
        ] {
            // A split the model cannot take is refused with its reason,
            // which other tests check; here only plans are compared.
            let Ok(plan) = plan_of(file, model, "8x8xH200", strategy) else {
                continue;
            };
            checked += 1;
            wrong.extend(weights_against_layout(file, model, strategy, &plan));
        }
    }
    assert!(checked > 40, "only {checked} plans compiled");
    assert!(wrong.is_empty(), "{}", wrong.join("\n"));
}
