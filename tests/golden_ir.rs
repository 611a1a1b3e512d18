//! Golden IR printouts of the tiny zoo models. A change to lowering shows up
//! as a reviewed diff: re-bless with `cargo insta review` (or
//! `INSTA_UPDATE=always cargo test --test golden_ir`).

use std::path::Path;

fn ir_of(file: &str, model: &str) -> String {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("models")
        .join(file);
    let text = std::fs::read_to_string(&path).expect("zoo files are in the repository");
    let unit = dplc_frontend::parse(&format!("models/{file}"), &text)
        .unwrap_or_else(|d| panic!("{}", d.render_plain()));
    let lowered = unit
        .lower(model)
        .unwrap_or_else(|d| panic!("{}", d.render_plain()));
    dplc_ir::print_graph(&lowered.graph)
}

#[test]
fn gpt_tiny() {
    insta::assert_snapshot!(ir_of("tiny.dpl", "gpt_tiny"));
}

#[test]
fn llama_tiny() {
    insta::assert_snapshot!(ir_of("tiny.dpl", "llama_tiny"));
}

#[test]
fn moe_tiny() {
    insta::assert_snapshot!(ir_of("tiny.dpl", "moe_tiny"));
}

/// An encoder-decoder: two stacks, the relative position buckets, the
/// decoder's ids shifted right (`pad[axis=1, 1, -1, value=0]`), cross-attention.
#[test]
fn t5_tiny() {
    insta::assert_snapshot!(ir_of("t5.dpl", "t5_tiny"));
}

/// A rank's local program under tp 2 with sequence parallelism (Megatron's
/// layout): the weights' halves, the sequence shards, and every layout
/// change as a `relayout` node. A change here changes what each GPU rank
/// fuses and which collectives it runs.
#[test]
fn golden_local_program_gpt_tiny_tp2_sp() {
    let src = std::fs::read_to_string("models/tiny.dpl").expect("the zoo file");
    let unit = dplc_frontend::parse("tiny.dpl", &src).expect("tiny.dpl parses");
    let g = unit.lower("gpt_tiny").expect("the model lowers").graph;
    let layout = dplc_planner::derive_layout(&g, 2, 1, true).expect("a layout");
    let local = dplc_ir::localize(&g, &layout).expect("the layout fits the model");
    insta::assert_snapshot!(dplc_ir::print_graph(&local));
}

/// A rank's program under context parallelism 2 (`dplc_ir::split_context`),
/// for Mistral's sliding window: the sequence axes at `seq/2`, the K and V
/// operands all-gathered as `relayout[context(a) -> replicated]`, the
/// rotary tables and the window mask built whole from the whole `iota` and
/// sliced to the rank's positions where they meet its values, the causal
/// mask a `select` of global positions, and the per-token loss gathered
/// before its mean over the sequence.
#[test]
fn golden_context_program_mistral_tiny_cp2() {
    let src = std::fs::read_to_string("models/mistral.dpl").expect("the zoo file");
    let unit = dplc_frontend::parse("mistral.dpl", &src).expect("mistral.dpl parses");
    let g = unit.lower("mistral_tiny").expect("the model lowers").graph;
    let local = dplc_ir::split_context(&g, 2).expect("the model splits its sequence");
    insta::assert_snapshot!(dplc_ir::print_graph(&local));
}

/// T5's rank program under cp 2: the encoder's relative position bias
/// `[heads, q, k]` is built whole from the whole positions on every rank
/// and sliced to the rank's queries where it meets the scores (its keys
/// whole, as the gathered keys are); each dropout draws at its global
/// positions (`dropout[.., context=a]`); the decoder (its length `tgt`, not
/// `seq`) runs whole, its cross-attention reading the encoder's keys and
/// values all-gathered.
#[test]
fn golden_context_program_t5_tiny_cp2() {
    let src = std::fs::read_to_string("models/t5.dpl").expect("the zoo file");
    let unit = dplc_frontend::parse("t5.dpl", &src).expect("t5.dpl parses");
    let g = unit.lower("t5_tiny").expect("the model lowers").graph;
    let local = dplc_ir::split_context(&g, 2).expect("the model splits its sequence");
    insta::assert_snapshot!(dplc_ir::print_graph(&local));
}

/// A layout for another model is refused, not half applied.
#[test]
fn a_layout_of_another_model_is_not_localized() {
    let src = std::fs::read_to_string("models/tiny.dpl").expect("the zoo file");
    let unit = dplc_frontend::parse("tiny.dpl", &src).expect("tiny.dpl parses");
    let gpt = unit.lower("gpt_tiny").expect("the model lowers").graph;
    let llama = unit.lower("llama_tiny").expect("the model lowers").graph;
    let layout = dplc_planner::derive_layout(&llama, 2, 1, false).expect("a layout");
    let err = dplc_ir::localize(&gpt, &layout).unwrap_err().to_string();
    assert!(err.contains("layout"), "{err}");
}
