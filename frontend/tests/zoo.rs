//! The model zoo lowers and has exactly the published parameter counts.

fn zoo(file: &str) -> String {
    let path = format!("{}/../models/{file}", env!("CARGO_MANIFEST_DIR"));
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("reading {path}: {e}"))
}

fn params(file: &str, model: &str) -> u128 {
    let unit = dplc_frontend::parse(file, &zoo(file)).unwrap_or_else(|d| panic!("{}", d.render_plain()));
    let lowered = unit.lower(model).unwrap_or_else(|d| panic!("{}", d.render_plain()));
    lowered.graph.param_count()
}

#[test]
fn gpt2_parameter_counts() {
    assert_eq!(params("gpt2.dpl", "gpt2"), 124_439_808);
    assert_eq!(params("gpt2.dpl", "gpt2_medium"), 354_823_168);
    assert_eq!(params("gpt2.dpl", "gpt2_large"), 774_030_080);
    assert_eq!(params("gpt2.dpl", "gpt2_xl"), 1_557_611_200);
}
