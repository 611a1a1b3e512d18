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
