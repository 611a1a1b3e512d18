//! The model zoo lowers and has exactly the published parameter counts.

fn zoo(file: &str) -> String {
    let path = format!("{}/../models/{file}", env!("CARGO_MANIFEST_DIR"));
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("reading {path}: {e}"))
}

fn params(file: &str, model: &str) -> u128 {
    let unit =
        dplc_frontend::parse(file, &zoo(file)).unwrap_or_else(|d| panic!("{}", d.render_plain()));
    let lowered = unit
        .lower(model)
        .unwrap_or_else(|d| panic!("{}", d.render_plain()));
    lowered.graph.param_count()
}

#[test]
fn gpt2_parameter_counts() {
    assert_eq!(params("gpt2.dpl", "gpt2"), 124_439_808);
    assert_eq!(params("gpt2.dpl", "gpt2_medium"), 354_823_168);
    assert_eq!(params("gpt2.dpl", "gpt2_large"), 774_030_080);
    assert_eq!(params("gpt2.dpl", "gpt2_xl"), 1_557_611_200);
}

#[test]
fn llama_parameter_counts() {
    assert_eq!(params("llama2.dpl", "llama2_7b"), 6_738_415_616);
    assert_eq!(params("llama2.dpl", "llama2_13b"), 13_015_864_320);
    assert_eq!(params("llama2.dpl", "llama2_70b"), 68_976_648_192);
    assert_eq!(params("llama3.dpl", "llama3_8b"), 8_030_261_248);
    assert_eq!(params("llama3.dpl", "llama3_70b"), 70_553_706_496);
    assert_eq!(params("llama3.dpl", "llama3_405b"), 405_853_388_800);
}

#[test]
fn mixtral_parameter_count() {
    assert_eq!(params("mixtral.dpl", "mixtral_8x7b"), 46_702_792_704);
}

#[test]
fn bert_parameter_counts() {
    assert_eq!(params("bert.dpl", "bert_base"), 109_482_240);
    assert_eq!(params("bert.dpl", "bert_large"), 335_141_888);
}

/// Gemma Team 2024 Table 1 (the counts transformers gives for the published
/// configs, embeddings included).
#[test]
fn gemma_parameter_counts() {
    assert_eq!(params("gemma.dpl", "gemma_2b"), 2_506_172_416);
    assert_eq!(params("gemma.dpl", "gemma_7b"), 8_537_680_896);
}

/// Jiang et al. 2023 Table 1 (transformers' count for the published config).
#[test]
fn mistral_parameter_count() {
    assert_eq!(params("mistral.dpl", "mistral_7b"), 7_241_732_096);
}

/// Dosovitskiy et al. 2021 Table 1 with timm's 1,000-class ImageNet head:
/// vit_base_patch16_224 and vit_large_patch16_224.
#[test]
fn vit_parameter_counts() {
    assert_eq!(params("vit.dpl", "vit_b16"), 86_567_656);
    assert_eq!(params("vit.dpl", "vit_l16"), 304_326_632);
}

/// DeepSeek-AI 2024 (DeepSeek-V2-Lite: "15.7B total parameters"): the sum
/// over the published config's tensors (deepseek-ai/DeepSeek-V2-Lite
/// config.json: 27 layers of width 2048, the first dense with an FFN of
/// 10944, the others 64 routed experts of 1408 and 2 shared; latent
/// attention with kv_lora_rank 512, no query compression, heads of 128 + 64
/// rotary channels, values of 128; vocabulary 102400, untied output).
#[test]
fn deepseek_v2_lite_parameter_count() {
    assert_eq!(params("deepseek.dpl", "deepseek_v2_lite"), 15_706_484_224);
}

/// t5-small as KerasNLP's preset lists it (keras_nlp/models/t5/t5_presets.py,
/// `"params": 60506624`, the original T5 with the embedding tied); the
/// same sum over the Hugging Face config.json of t5-small/base/large
/// (d_model, d_ff, d_kv 64, heads, layers, vocab 32128, 32 buckets) gives
/// 60,506,624 / 222,903,552 / 737,668,096, the counts transformers reports.
#[test]
fn t5_parameter_counts() {
    assert_eq!(params("t5.dpl", "t5_small"), 60_506_624);
    assert_eq!(params("t5.dpl", "t5_base"), 222_903_552);
    assert_eq!(params("t5.dpl", "t5_large"), 737_668_096);
}

/// llm-foundry's published training benchmarks (mosaicml/llm-foundry
/// scripts/train/benchmarking/README.md @ 5e85bd6, the NumParams column at
/// sequence 2048): the `mpt_causal_lm` defaults, learned positions and biases.
#[test]
fn mpt_parameter_counts() {
    for (model, count) in [
        ("mpt_125m", 125_311_488),
        ("mpt_350m", 355_985_408),
        ("mpt_760m", 760_470_528),
        ("mpt_1b", 1_315_950_592),
        ("mpt_3b", 2_651_837_440),
        ("mpt_7b", 6_658_859_008),
        ("mpt_13b", 12_853_954_560),
        ("mpt_30b", 29_975_214_080),
        ("mpt_70b", 64_862_437_376),
    ] {
        assert_eq!(params("mpt.dpl", model), count, "{model}");
    }
}

/// Nemotron-4 15B (Parmar et al. 2024, arXiv:2402.16819 §2): "12.5B
/// non-embedding parameters" (the embeddings, input and output, 3.15B, which
/// the paper rounds to "3.2B"). No exact count is published for Nemotron.
#[test]
fn nemotron_parameter_counts() {
    let total = params("nemotron.dpl", "nemotron4_15b");
    let embeddings = 2 * 256_000 * 6144;
    assert_eq!(total, 15_628_775_424);
    assert_eq!(((total - embeddings) as f64 / 1e8).round(), 125.0);
}

/// What the Qwen3 fields give (tests/import_hf.rs counts them by hand; the
/// model cards round them to 4.0B, 30.5B and 235B). The 235B by hand: the
/// embedding and the untied output 2 × 151,936 × 4,096; a layer's attention
/// 4,096 × (8,192 + 2 × 512) + 8,192 × 4,096 + 2 × 128 (the query and key
/// norms), its two norms 2 × 4,096, router 4,096 × 128 and experts
/// 128 × 3 × 4,096 × 1,536, 94 times; the final norm 4,096.
#[test]
fn qwen3_parameter_counts() {
    assert_eq!(params("qwen3.dpl", "qwen3_4b"), 4_022_468_096);
    assert_eq!(params("qwen3.dpl", "qwen3_30b_a3b"), 30_532_122_624);
    let layer = 4_096 * (8_192 + 2 * 512)
        + 8_192 * 4_096
        + 2 * 128
        + 2 * 4_096
        + 4_096 * 128
        + 128 * 3 * 4_096 * 1_536;
    let by_hand = 2 * 151_936 * 4_096 + 94 * layer + 4_096;
    assert_eq!(by_hand, 235_093_634_560);
    assert_eq!(params("qwen3.dpl", "qwen3_235b_a22b"), by_hand);
}

#[test]
fn every_zoo_file_checks() {
    for file in [
        "gpt2.dpl",
        "llama2.dpl",
        "llama3.dpl",
        "mixtral.dpl",
        "bert.dpl",
        "vit.dpl",
        "gemma.dpl",
        "mistral.dpl",
        "deepseek.dpl",
        "t5.dpl",
        "megatron_gpt.dpl",
        "mpt.dpl",
        "nemotron.dpl",
        "qwen3.dpl",
        "tiny.dpl",
    ] {
        let unit = dplc_frontend::parse(file, &zoo(file))
            .unwrap_or_else(|d| panic!("{}", d.render_plain()));
        unit.check()
            .unwrap_or_else(|d| panic!("{}", d.render_plain()));
    }
}

#[test]
fn megatron_models_are_listed_in_source_order() {
    let unit = dplc_frontend::parse("m.dpl", &zoo("megatron_gpt.dpl")).unwrap();
    let names = unit.model_names();
    assert_eq!(names.len(), 24);
    assert_eq!(names[0], "gpt_1_7b");
    assert_eq!(names[11], "gpt_175b");
    assert_eq!(names[13], "nemo_gpt3_20b");
    assert_eq!(names[14], "nemo_gpt3_175b");
    assert_eq!(names[15], "mcore_gpt_1_7b");
    assert_eq!(names[23], "mcore_gpt_462b");
    let lowered = unit.lower("gpt_175b").unwrap();
    assert_eq!(lowered.train.seq, 2048);
    // Megatron-Core's models take their own train section through the
    // variant chain (mcore_gpt_462b → mcore_gpt_1_7b), not gpt_1_7b's.
    let mcore = unit.lower("mcore_gpt_462b").unwrap();
    assert_eq!(mcore.train.seq, 4096);
    assert_eq!(mcore.train.precision, dplc_ir::Precision::Bf16);
    assert!(lowered
        .args
        .contains(&("d".to_string(), "12288".to_string())));
}

#[test]
fn variants_inherit_the_train_section_and_ctx_sets_seq() {
    let unit = dplc_frontend::parse("gpt2.dpl", &zoo("gpt2.dpl")).unwrap();
    let xl = unit.lower("gpt2_xl").unwrap();
    assert_eq!(xl.train.global_batch, 512);
    let bare = dplc_frontend::parse(
        "t.dpl",
        "model m(ctx = 77) { input x: i32[b, s]  param e: [4, 2]  return embedding(e, x) }",
    )
    .unwrap();
    assert_eq!(bare.lower("m").unwrap().train.seq, 77);
}

#[test]
fn llama3_405b_lowers_its_repeat_body_once() {
    let unit = dplc_frontend::parse("llama3.dpl", &zoo("llama3.dpl")).unwrap();
    let start = std::time::Instant::now();
    let lowered = unit.lower("llama3_405b").unwrap();
    let elapsed = start.elapsed();
    // 126 layers unrolled would be thousands of nodes; one body is ~100.
    assert!(
        lowered.graph.nodes().len() < 300,
        "{} nodes",
        lowered.graph.nodes().len()
    );
    assert_eq!(lowered.graph.regions().len(), 2);
    assert!(elapsed.as_secs_f64() < 1.0, "lowering took {elapsed:?}");
    let names: Vec<_> = lowered
        .graph
        .params()
        .map(|(_, p)| p.name.clone())
        .collect();
    assert!(
        names.contains(&"layers.attention.q.w".to_string()),
        "{names:?}"
    );
    assert!(names.contains(&"layers.swiglu.w1".to_string()), "{names:?}");
}

#[test]
fn clusters_convert_units_to_si() {
    let c = dplc_frontend::parse("c.dpl", &zoo("clusters/dgx_a100_x4.dpl"))
        .unwrap()
        .clusters()
        .unwrap();
    assert_eq!(c[0].world_size(), 32);
    let inter = c[0].inter_node.as_ref().unwrap();
    assert_eq!(
        (
            inter.kind.as_str(),
            inter.bandwidth_bytes_per_s,
            inter.latency_s
        ),
        ("infiniband", 25e9, 5e-6)
    );
    for f in ["clusters/dgx_h100.dpl", "clusters/cpu_4.dpl"] {
        let c = dplc_frontend::parse(f, &zoo(f))
            .unwrap()
            .clusters()
            .unwrap();
        assert_eq!(c.len(), 1);
    }
}

/// `cross_entropy` takes logits of any leading shape: a classifier's
/// `[batch, classes]` with `[batch]` labels lowers to a scalar loss, as do
/// 3 and 4 leading axes; five are refused by name.
#[test]
fn cross_entropy_takes_any_leading_shape() {
    let model = |input: &str, labels: &str| {
        format!(
            "model m(d = 4, classes = 3) {{\n  input x: f32[{input}, d]\n  input labels: i32[{labels}]\n  param w: [d, classes]\n  return cross_entropy(x @ w, labels)\n}}\n"
        )
    };
    for (input, labels) in [
        ("batch", "batch"),
        ("batch, seq", "batch, seq"),
        ("batch, 2, seq", "batch, 2, seq"),
        ("batch, 2, 3, seq", "batch, 2, 3, seq"),
    ] {
        let unit = dplc_frontend::parse("m.dpl", &model(input, labels))
            .unwrap_or_else(|d| panic!("{}", d.render_plain()));
        let lowered = unit
            .lower("m")
            .unwrap_or_else(|d| panic!("{labels}: {}", d.render_plain()));
        let loss = lowered.graph.outputs()[0];
        assert!(
            lowered.graph.tensor(loss).shape.dims().is_empty(),
            "{labels}: a scalar loss"
        );
    }
    let unit = dplc_frontend::parse(
        "m.dpl",
        &model("batch, 2, 3, 4, seq", "batch, 2, 3, 4, seq"),
    )
    .expect("parses");
    let e = unit.lower("m").expect_err("five axes are refused");
    assert!(
        e.render_plain()
            .contains("cross_entropy takes targets of 1 to 4 axes"),
        "{}",
        e.render_plain()
    );
}
