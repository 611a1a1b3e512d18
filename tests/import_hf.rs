//! `dplc import hf`: the published config.json of each supported family
//! (tests/data/hf, from the model cards) becomes a .dpl model with the
//! model's exact parameter count; the zoo's hand-written Llama 3, Mixtral
//! and GPT-2 round-trip to the same count; what cannot be imported is
//! refused naming the field.

use std::path::PathBuf;
use std::process::{Command, Output};

fn dplc(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_dplc"))
        .args(args)
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .env("NO_COLOR", "1")
        .output()
        .expect("dplc runs")
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

fn tmp(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("dplc-import-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    dir.join(name)
}

/// Import `config` to a temp .dpl and return its path.
fn import(config: &str) -> PathBuf {
    let out = tmp(&format!("{config}.dpl"));
    let o = dplc(&[
        "import",
        "hf",
        &format!("tests/data/hf/{config}.json"),
        "-o",
        out.to_str().unwrap(),
    ]);
    assert!(o.status.success(), "{config}: {}", stderr(&o));
    out
}

/// Write `text` as `NAME.json` and import it to `NAME.dpl`: the command's
/// output and the .dpl's path.
fn import_text(name: &str, text: &str) -> (Output, PathBuf) {
    let config = tmp(&format!("{name}.json"));
    std::fs::write(&config, text).expect("write the config");
    let file = tmp(&format!("{name}.dpl"));
    let out = dplc(&[
        "import",
        "hf",
        config.to_str().unwrap(),
        "-o",
        file.to_str().unwrap(),
    ]);
    (out, file)
}

/// Importing `text` (written as `NAME.json`) is refused, naming `field`.
fn assert_refused(name: &str, text: &str, field: &str) {
    let (out, _) = import_text(name, text);
    assert_eq!(out.status.code(), Some(1), "{name}");
    assert!(stderr(&out).contains(field), "{name}: {}", stderr(&out));
}

/// The parameters `dplc inspect` counts for the file's (only) model.
fn params(file: &str, model: Option<&str>) -> u64 {
    let mut args = vec!["inspect", file, "--json"];
    if let Some(m) = model {
        args.extend(["--model", m]);
    }
    let o = dplc(&args);
    assert!(o.status.success(), "{file}: {}", stderr(&o));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).expect("JSON");
    v["params"].as_u64().expect("a parameter count")
}

#[test]
fn every_family_imports_with_its_published_parameter_count() {
    // (config, published parameters, where the number comes from)
    let cases: [(&str, u64); 11] = [
        // Meta's model card: 8.03B (embedding and untied output 2 × 128256 × 4096).
        ("llama3_8b", 8_030_261_248),
        // The 3.1 config adds rope_scaling, which changes no parameter.
        ("llama3_1_8b", 8_030_261_248),
        // Touvron et al. 2023 / the model card: 6.74B.
        ("llama2_7b", 6_738_415_616),
        // Jiang et al. 2023: 7.24B.
        ("mistral_7b_v0_1", 7_241_732_096),
        // Jiang et al. 2024: 46.7B total.
        ("mixtral_8x7b", 46_702_792_704),
        // Qwen2 technical report: 7.62B (q/k/v biases, untied output).
        ("qwen2_7b", 7_615_616_512),
        // 0.49B, output tied to the embedding.
        ("qwen2_0_5b", 494_032_768),
        // Gemma report: 2.51B with the 256K embedding (head_dim 256, one KV head).
        ("gemma_2b", 2_506_172_416),
        // 8.54B (16 heads of 256 on a 3072-wide model).
        ("gemma_7b", 8_537_680_896),
        // Radford et al. 2019 as released: 124M and 355M.
        ("gpt2", 124_439_808),
        ("gpt2_medium", 354_823_168),
    ];
    for (config, published) in cases {
        let file = import(config);
        let f = file.to_str().unwrap();
        assert_eq!(params(f, None), published, "{config}");
        let o = dplc(&["check", f]);
        assert!(o.status.success(), "{config}: {}", stderr(&o));
    }
}

#[test]
fn the_zoo_configs_round_trip_to_the_hand_written_models() {
    for (config, zoo, model) in [
        ("llama3_8b", "models/llama3.dpl", "llama3_8b"),
        ("mixtral_8x7b", "models/mixtral.dpl", "mixtral_8x7b"),
        ("gpt2", "models/gpt2.dpl", "gpt2"),
    ] {
        let file = import(config);
        assert_eq!(
            params(file.to_str().unwrap(), None),
            params(zoo, Some(model)),
            "{config} against {zoo}"
        );
    }
}

#[test]
fn an_imported_model_plans_and_trains_like_a_written_one() {
    let file = import("gpt2");
    let f = file.to_str().unwrap();
    let o = dplc(&["compile", f, "--cluster", "8xA100", "--json"]);
    assert!(o.status.success(), "{}", stderr(&o));
    // Gemma's own blocks (head width, 1 + w norm, gated GeLU) plan too,
    // tensor parallelism included: 16 KV heads (7B) and one (2B).
    for config in ["gemma_7b", "gemma_2b"] {
        let gemma = import(config);
        let o = dplc(&[
            "compile",
            gemma.to_str().unwrap(),
            "--cluster",
            "8xH100",
            "--strategy",
            "tp=2",
            "--json",
        ]);
        assert!(o.status.success(), "{config}: {}", stderr(&o));
    }
    // The sliding window: the attention's `window`, said in the file.
    let mistral = std::fs::read_to_string(import("mistral_7b_v0_1")).unwrap();
    assert!(mistral.contains("seq = 8192"), "{mistral}");
    assert!(mistral.contains("sliding_window = 4096"));
    assert!(mistral.contains("window = 4096)"), "{mistral}");
}

/// A head width of its own (Mistral NeMo's 128 heads on a 5120-wide model)
/// is imported as the attention's `head_dim`; a `head_dim` equal to the
/// even split changes nothing. The config is Llama 3 8B's with the width
/// changed, so the count is by hand: embedding and untied output 2 × 128256
/// × 5120, per layer q and o 2 × 5120 × 4096, k and v 2 × 5120 × 1024, the
/// SwiGLU 3 × 5120 × 14336 and two norms, 32 layers and the final norm.
#[test]
fn a_head_width_of_its_own_is_imported_as_head_dim() {
    let base = std::fs::read_to_string("tests/data/hf/llama3_8b.json").unwrap();
    let wide = base.replace(
        "\"hidden_size\": 4096,",
        "\"hidden_size\": 5120,\n  \"head_dim\": 128,",
    );
    assert_ne!(wide, base);
    let (out, wide_file) = import_text("wide_heads", &wide);
    assert!(out.status.success(), "{}", stderr(&out));
    let dpl = std::fs::read_to_string(&wide_file).unwrap();
    assert!(dpl.contains("head_dim = 128"), "{dpl}");
    let per_layer = 2 * 5120 * 4096 + 2 * 5120 * 1024 + 3 * 5120 * 14336 + 2 * 5120;
    assert_eq!(
        params(wide_file.to_str().unwrap(), None),
        2 * 128_256 * 5120 + 32 * per_layer + 5120
    );
    let even = base.replace(
        "\"hidden_size\": 4096,",
        "\"hidden_size\": 4096,\n  \"head_dim\": 128,",
    );
    let p = tmp("even_heads.json");
    std::fs::write(&p, &even).unwrap();
    let out = dplc(&["import", "hf", p.to_str().unwrap()]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(!String::from_utf8_lossy(&out.stdout).contains("head_dim"));
}

/// Qwen3 (dense and MoE): each head's query and key RMS-normalised, a head
/// width of its own, experts `moe_intermediate_size` wide. The configs carry
/// the shapes the model cards state (Qwen/Qwen3-4B: 4.0B parameters, 3.6B
/// without the tied embedding; Qwen/Qwen3-30B-A3B: 30.5B, 29.9B without the
/// embedding and untied output), counted by hand: per layer q and o 2 × d ×
/// 4096, k and v 2 × d × kv × 128, the q and k norms 2 × 128, the FFN (3 × d
/// × 9728, or 128 experts of 3 × d × 768 and a d × 128 router) and two norms.
#[test]
fn qwen3_imports_with_its_query_key_norms_and_experts() {
    let dense = r#"{"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3",
        "vocab_size": 151936, "hidden_size": 2560, "intermediate_size": 9728,
        "num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8,
        "head_dim": 128, "hidden_act": "silu", "max_position_embeddings": 40960,
        "rms_norm_eps": 1e-06, "rope_theta": 1000000, "tie_word_embeddings": true,
        "attention_bias": false, "attention_dropout": 0.0, "torch_dtype": "bfloat16"}"#;
    let moe = r#"{"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
        "vocab_size": 151936, "hidden_size": 2048, "intermediate_size": 6144,
        "moe_intermediate_size": 768, "num_experts": 128, "num_experts_per_tok": 8,
        "norm_topk_prob": true, "decoder_sparse_step": 1, "mlp_only_layers": [],
        "num_hidden_layers": 48, "num_attention_heads": 32, "num_key_value_heads": 4,
        "head_dim": 128, "hidden_act": "silu", "max_position_embeddings": 40960,
        "rms_norm_eps": 1e-06, "rope_theta": 1000000, "tie_word_embeddings": false,
        "attention_bias": false, "attention_dropout": 0.0, "torch_dtype": "bfloat16"}"#;
    let layer = |d: u64, kv: u64, ffn: u64| 2 * d * 4096 + 2 * d * kv * 128 + 2 * 128 + ffn + 2 * d;
    for (name, text, total, embeddings, card) in [
        (
            "qwen3_4b",
            dense,
            151_936 * 2560 + 36 * layer(2560, 8, 3 * 2560 * 9728) + 2560,
            151_936 * 2560,
            (40, 36),
        ),
        (
            "qwen3_30b_a3b",
            moe,
            2 * 151_936 * 2048 + 48 * layer(2048, 4, 128 * 3 * 2048 * 768 + 2048 * 128) + 2048,
            2 * 151_936 * 2048,
            (305, 299),
        ),
    ] {
        let (out, out_file) = import_text(name, text);
        assert!(out.status.success(), "{name}: {}", stderr(&out));
        let dpl = std::fs::read_to_string(&out_file).unwrap();
        assert!(dpl.contains("qk_norm = true"), "{dpl}");
        let counted = params(out_file.to_str().unwrap(), None);
        assert_eq!(counted, total, "{name}");
        // The model card's figures, in tenths of a billion.
        let tenths = |n: u64| (n as f64 / 1e8).round() as u64;
        assert_eq!(
            (tenths(counted), tenths(counted - embeddings)),
            card,
            "{name}"
        );
        let o = dplc(&["check", out_file.to_str().unwrap()]);
        assert!(o.status.success(), "{name}: {}", stderr(&o));
    }
    // Weights over all the experts, not renormalised over the chosen (set,
    // or left to transformers' default): refused.
    assert_refused(
        "qwen3_moe_raw",
        &moe.replace("\"norm_topk_prob\": true", "\"norm_topk_prob\": false"),
        "norm_topk_prob",
    );
    assert_refused(
        "qwen3_moe_default",
        &moe.replace("\"norm_topk_prob\": true,", ""),
        "norm_topk_prob",
    );
}

/// Phi-3 (model_type phi3): Llama's layer, its 4K variant's window of 2047
/// keys, and partial rotary where a config sets `partial_rotary_factor`.
/// The config carries Phi-3-mini's shape as its model card states it; its
/// count, published as 3,821,079,552 for microsoft/Phi-3-mini-4k-instruct,
/// by hand: embedding and untied output 2 × 32064 × 3072,
/// per layer four 3072² projections, the SwiGLU 3 × 3072 × 8192 and two
/// norms, 32 layers and the final norm.
#[test]
fn phi3_imports_with_its_window_and_partial_rotary() {
    let mini = r#"{"architectures": ["Phi3ForCausalLM"], "model_type": "phi3",
        "vocab_size": 32064, "hidden_size": 3072, "intermediate_size": 8192,
        "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 32,
        "hidden_act": "silu", "max_position_embeddings": 4096, "rms_norm_eps": 1e-05,
        "rope_theta": 10000.0, "rope_scaling": null, "sliding_window": 2047,
        "attention_dropout": 0.0, "resid_pdrop": 0.0, "embd_pdrop": 0.0,
        "tie_word_embeddings": false, "torch_dtype": "bfloat16"}"#;
    let (out, file) = import_text("phi3_mini", mini);
    assert!(out.status.success(), "{}", stderr(&out));
    let dpl = std::fs::read_to_string(&file).unwrap();
    assert!(dpl.contains("window = 2047"), "{dpl}");
    assert!(!dpl.contains("rotary_dims"), "{dpl}");
    let layer = 4 * 3072 * 3072 + 3 * 3072 * 8192 + 2 * 3072;
    let total = 2 * 32_064 * 3072 + 32 * layer + 3072;
    assert_eq!(total, 3_821_079_552);
    assert_eq!(params(file.to_str().unwrap(), None), total);
    // Three quarters of each 96-wide head turned: 72 channels.
    let partial = mini.replace(
        "\"rope_theta\": 10000.0,",
        "\"rope_theta\": 10000.0, \"partial_rotary_factor\": 0.75,",
    );
    let (out, file) = import_text("phi3_partial", &partial);
    assert!(out.status.success(), "{}", stderr(&out));
    let dpl = std::fs::read_to_string(&file).unwrap();
    assert!(dpl.contains("rotary_dims = 72"), "{dpl}");
    assert_eq!(params(file.to_str().unwrap(), None), total);
    let o = dplc(&["check", file.to_str().unwrap()]);
    assert!(o.status.success(), "{}", stderr(&o));
    // A dropout the import would drop, and a factor that turns an odd count: refused.
    for (name, text, want) in [
        (
            "phi3_dropout",
            mini.replace("\"resid_pdrop\": 0.0", "\"resid_pdrop\": 0.1"),
            "resid_pdrop",
        ),
        (
            "phi3_odd",
            mini.replace(
                "\"rope_theta\": 10000.0,",
                "\"rope_theta\": 10000.0, \"partial_rotary_factor\": 0.53125,",
            ),
            "partial_rotary_factor",
        ),
    ] {
        assert_refused(name, &text, want);
    }
}

/// GPT-NeoX (Pythia): attention and MLP side by side on each layer's input,
/// a quarter of each head turned by rotary, biased linears, an untied output.
/// The configs carry the shapes of the Pythia suite (Biderman et al. 2023,
/// Table 1: 70M, 160M, 410M, 1B — width, layers, heads; 50,304-token
/// vocabulary, `rotary_pct` 0.25, parallel residual), and the counts are the
/// published ones (the EleutherAI/pythia model cards' totals).
#[test]
fn gpt_neox_imports_pythia_with_its_published_counts() {
    for (name, d, layers, heads, published) in [
        ("pythia_70m", 512, 6, 8, 70_426_624),
        ("pythia_160m", 768, 12, 12, 162_322_944),
        ("pythia_410m", 1024, 24, 16, 405_334_016),
        ("pythia_1b", 2048, 16, 8, 1_011_781_632),
    ] {
        let config = format!(
            r#"{{"architectures": ["GPTNeoXForCausalLM"], "model_type": "gpt_neox",
            "hidden_act": "gelu", "hidden_size": {d}, "intermediate_size": {ffn},
            "layer_norm_eps": 1e-05, "max_position_embeddings": 2048,
            "num_attention_heads": {heads}, "num_hidden_layers": {layers},
            "rotary_emb_base": 10000, "rotary_pct": 0.25, "tie_word_embeddings": false,
            "torch_dtype": "float16", "use_parallel_residual": true, "vocab_size": 50304}}"#,
            ffn = 4 * d
        );
        let (out, file) = import_text(name, &config);
        assert!(out.status.success(), "{name}: {}", stderr(&out));
        assert_eq!(params(file.to_str().unwrap(), None), published, "{name}");
        let dpl = std::fs::read_to_string(&file).unwrap();
        assert!(
            dpl.contains(&format!("rotary_dims = {}", d / heads / 4)),
            "{dpl}"
        );
    }
    // Imported, it plans and trains under a split like a written model.
    let file = tmp("pythia_70m.dpl");
    let o = dplc(&[
        "compile",
        file.to_str().unwrap(),
        "--cluster",
        "8xA100",
        "--strategy",
        "tp=2",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
}

/// Phi-2 (model_type phi): one LayerNorm feeding the attention and the MLP
/// side by side, rotary on 40% of each head, the residual dropout, an
/// untied output with a bias. The config carries microsoft/phi-2's fields;
/// its count is the published 2,779,683,840.
#[test]
fn phi_imports_phi2_with_its_published_count() {
    let phi2 = r#"{"architectures": ["PhiForCausalLM"], "model_type": "phi",
        "attention_dropout": 0.0, "embd_pdrop": 0.0, "resid_pdrop": 0.1,
        "hidden_act": "gelu_new", "hidden_size": 2560, "intermediate_size": 10240,
        "layer_norm_eps": 1e-05, "max_position_embeddings": 2048,
        "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 32,
        "partial_rotary_factor": 0.4, "qk_layernorm": false, "rope_scaling": null,
        "rope_theta": 10000.0, "tie_word_embeddings": false, "torch_dtype": "float16",
        "vocab_size": 51200}"#;
    let (out, file) = import_text("phi2", phi2);
    assert!(out.status.success(), "{}", stderr(&out));
    assert_eq!(params(file.to_str().unwrap(), None), 2_779_683_840);
    let dpl = std::fs::read_to_string(&file).unwrap();
    assert!(
        dpl.contains("rotary_dims = 32") && dpl.contains("dropout = 0.1"),
        "{dpl}"
    );
    // A query/key LayerNorm (Phi-1.5's option) is not modelled: refused.
    assert_refused(
        "phi_qk",
        &phi2.replace("\"qk_layernorm\": false", "\"qk_layernorm\": true"),
        "qk_layernorm",
    );
}

/// Gemma 2 (model_type gemma2): norms before and after the attention and
/// the FFN, scores scaled by `query_pre_attn_scalar` and soft-capped, layers
/// alternating a sliding window and the whole context (a pair a repeat),
/// soft-capped logits. The config carries google/gemma-2-2b's fields; its
/// count is the published 2,614,341,888. A small one with the same blocks
/// verifies under tensor and pipeline parallelism (`dplc verify` scales the
/// `layers` argument to the pairs it repeats).
#[test]
fn gemma2_imports_with_its_published_count_and_verifies_split() {
    let fields =
        |d: u64, heads: u64, kv: u64, hd: u64, layers: u64, ffn: u64, vocab: u64, window: u64| {
            format!(
                r#"{{"architectures": ["Gemma2ForCausalLM"], "model_type": "gemma2",
            "attention_bias": false, "attention_dropout": 0.0,
            "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0,
            "head_dim": {hd}, "hidden_act": "gelu_pytorch_tanh",
            "hidden_activation": "gelu_pytorch_tanh", "hidden_size": {d},
            "intermediate_size": {ffn}, "max_position_embeddings": 8192,
            "num_attention_heads": {heads}, "num_hidden_layers": {layers},
            "num_key_value_heads": {kv}, "query_pre_attn_scalar": {hd},
            "rms_norm_eps": 1e-06, "rope_theta": 10000.0, "sliding_window": {window},
            "torch_dtype": "float32", "vocab_size": {vocab}}}"#
            )
        };
    let import = |name: &str, text: String| {
        let (out, file) = import_text(name, &text);
        assert!(out.status.success(), "{name}: {}", stderr(&out));
        file
    };
    let two_b = import(
        "gemma2_2b",
        fields(2304, 8, 4, 256, 26, 9216, 256_000, 4096),
    );
    assert_eq!(params(two_b.to_str().unwrap(), None), 2_614_341_888);
    let small = import("gemma2_small", fields(48, 4, 2, 16, 4, 96, 128, 8));
    let s = small.to_str().unwrap();
    let plan = tmp("gemma2_small.ron");
    let o = dplc(&[
        "compile",
        s,
        "--cluster",
        "4xcpu",
        "--strategy",
        "tp=2,pp=2",
        "--seq",
        "16",
        "--global-batch",
        "8",
        "-o",
        plan.to_str().unwrap(),
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let o = dplc(&["verify", plan.to_str().unwrap(), "--source", s]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(String::from_utf8_lossy(&o.stdout).contains("reduced to 2 layers"));
}

/// More checkpoints through the families above, each config carrying the
/// shape its model card states and each count the published one:
/// meta-llama/Llama-3.2-1B (tied, 1,235,814,400), HuggingFaceTB/SmolLM2-135M
/// (9 heads of 64, 3 KV heads, 134,515,008), TinyLlama/TinyLlama-1.1B
/// (1,100,048,384), Qwen/Qwen2.5-1.5B (q/k/v biases, tied, 1,543,714,304)
/// and distilbert/distilgpt2 (GPT-2 small at six layers, 81,912,576).
#[test]
fn more_checkpoints_import_with_their_published_counts() {
    let llama = |model_type: &str,
                 d: u64,
                 ffn: u64,
                 layers: u64,
                 heads: u64,
                 kv: u64,
                 vocab: u64,
                 tied: bool| {
        format!(
            r#"{{"model_type": "{model_type}", "hidden_act": "silu", "hidden_size": {d},
            "intermediate_size": {ffn}, "num_hidden_layers": {layers},
            "num_attention_heads": {heads}, "num_key_value_heads": {kv},
            "max_position_embeddings": 2048, "rms_norm_eps": 1e-05, "rope_theta": 10000.0,
            "tie_word_embeddings": {tied}, "vocab_size": {vocab}, "torch_dtype": "bfloat16"}}"#
        )
    };
    let cases = [
        (
            "llama3_2_1b",
            llama("llama", 2048, 8192, 16, 32, 8, 128_256, true),
            1_235_814_400u64,
        ),
        (
            "smollm2_135m",
            llama("llama", 576, 1536, 30, 9, 3, 49_152, true),
            134_515_008,
        ),
        (
            "tinyllama_1_1b",
            llama("llama", 2048, 5632, 22, 32, 4, 32_000, false),
            1_100_048_384,
        ),
        (
            "qwen2_5_1_5b",
            llama("qwen2", 1536, 8960, 28, 12, 2, 151_936, true),
            1_543_714_304,
        ),
        (
            "distilgpt2",
            std::fs::read_to_string("tests/data/hf/gpt2.json")
                .unwrap()
                .replace("\"n_layer\": 12", "\"n_layer\": 6"),
            81_912_576,
        ),
    ];
    for (name, config, published) in cases {
        let (out, file) = import_text(name, &config);
        assert!(out.status.success(), "{name}: {}", stderr(&out));
        assert_eq!(params(file.to_str().unwrap(), None), published, "{name}");
    }
}

/// OPT (model_type opt): GPT-2's layer with ReLU and learned positions two
/// rows into their table. facebook/opt-125m's config imports with its
/// published 125,239,296; OPT-350M's post-norm layout with a projection is
/// refused by field.
#[test]
fn opt_imports_with_its_published_count() {
    let opt = r#"{"activation_dropout": 0.0, "activation_function": "relu",
        "architectures": ["OPTForCausalLM"], "attention_dropout": 0.0,
        "do_layer_norm_before": true, "dropout": 0.1, "ffn_dim": 3072,
        "hidden_size": 768, "layerdrop": 0.0, "max_position_embeddings": 2048,
        "model_type": "opt", "num_attention_heads": 12, "num_hidden_layers": 12,
        "torch_dtype": "float16", "vocab_size": 50272, "word_embed_proj_dim": 768}"#;
    let (out, file) = import_text("opt_125m", opt);
    assert!(out.status.success(), "{}", stderr(&out));
    assert_eq!(params(file.to_str().unwrap(), None), 125_239_296);
    for (name, text, want) in [
        (
            "opt_post_norm",
            opt.replace(
                "\"do_layer_norm_before\": true",
                "\"do_layer_norm_before\": false",
            ),
            "do_layer_norm_before",
        ),
        (
            "opt_projected",
            opt.replace(
                "\"word_embed_proj_dim\": 768",
                "\"word_embed_proj_dim\": 512",
            ),
            "word_embed_proj_dim",
        ),
    ] {
        assert_refused(name, &text, want);
    }
}

/// BLOOM (model_type bloom): ALiBi slopes as the attention's score bias, a
/// LayerNorm on the embedding, biased linears, a tied output.
/// bigscience/bloom-560m's config imports with its published 559,214,592;
/// 112 heads (BLOOM-176B: ALiBi's interleaved slopes) are refused by field.
#[test]
fn bloom_imports_with_its_published_count() {
    let bloom = r#"{"apply_residual_connection_post_layernorm": false,
        "attention_dropout": 0.0, "architectures": ["BloomForCausalLM"],
        "hidden_dropout": 0.0, "hidden_size": 1024, "layer_norm_epsilon": 1e-05,
        "model_type": "bloom", "n_head": 16, "n_layer": 24, "vocab_size": 250880}"#;
    let (out, file) = import_text("bloom_560m", bloom);
    assert!(out.status.success(), "{}", stderr(&out));
    assert_eq!(params(file.to_str().unwrap(), None), 559_214_592);
    assert!(std::fs::read_to_string(&file)
        .unwrap()
        .contains("bias = alibi"));
    assert_refused(
        "bloom_112",
        &bloom
            .replace("\"n_head\": 16", "\"n_head\": 112")
            .replace("\"hidden_size\": 1024", "\"hidden_size\": 14336"),
        "n_head",
    );
}

/// Small models of the new families, imported, run every split they are
/// planned under as the serial run does (`dplc verify`, reference compute):
/// Pythia's parallel residual and partial rotary, Phi's shared norm and
/// residual dropout, OPT's offset positions, BLOOM's ALiBi bias.
#[test]
fn imported_small_models_verify_under_splits() {
    let configs = [
        (
            "small_pythia",
            r#"{"model_type": "gpt_neox", "hidden_act": "gelu", "hidden_size": 64,
            "intermediate_size": 256, "layer_norm_eps": 1e-05, "max_position_embeddings": 64,
            "num_attention_heads": 4, "num_hidden_layers": 2, "rotary_emb_base": 10000,
            "rotary_pct": 0.25, "tie_word_embeddings": false, "torch_dtype": "float32",
            "use_parallel_residual": true, "vocab_size": 128}"#,
        ),
        (
            "small_phi",
            r#"{"model_type": "phi", "attention_dropout": 0.0, "embd_pdrop": 0.0,
            "hidden_act": "gelu_new", "hidden_size": 64, "intermediate_size": 256,
            "max_position_embeddings": 64, "num_attention_heads": 4, "num_hidden_layers": 2,
            "partial_rotary_factor": 0.5, "qk_layernorm": false, "resid_pdrop": 0.1,
            "tie_word_embeddings": false, "torch_dtype": "float32", "vocab_size": 128}"#,
        ),
        (
            "small_opt",
            r#"{"model_type": "opt", "activation_function": "relu", "activation_dropout": 0.0,
            "attention_dropout": 0.0, "do_layer_norm_before": true, "dropout": 0.1,
            "ffn_dim": 128, "hidden_size": 32, "layerdrop": 0.0, "max_position_embeddings": 64,
            "num_attention_heads": 4, "num_hidden_layers": 2, "torch_dtype": "float32",
            "vocab_size": 128, "word_embed_proj_dim": 32}"#,
        ),
        (
            "small_bloom",
            r#"{"model_type": "bloom", "apply_residual_connection_post_layernorm": false,
            "attention_dropout": 0.0, "hidden_dropout": 0.0, "hidden_size": 32,
            "n_head": 4, "n_layer": 2, "torch_dtype": "float32", "vocab_size": 128}"#,
        ),
    ];
    for (name, config) in configs {
        let (out, file) = import_text(name, config);
        assert!(out.status.success(), "{name}: {}", stderr(&out));
        let f = file.to_str().unwrap();
        for split in ["tp=2,pp=2", "cp=2,dp=2"] {
            let plan = tmp(&format!("{name}-{}.ron", split.replace([',', '='], "_")));
            let o = dplc(&[
                "compile",
                f,
                "--cluster",
                "4xcpu",
                "--strategy",
                split,
                "--seq",
                "16",
                "--global-batch",
                "8",
                "-o",
                plan.to_str().unwrap(),
            ]);
            assert!(o.status.success(), "{name} {split}: {}", stderr(&o));
            let o = dplc(&["verify", plan.to_str().unwrap(), "--source", f]);
            assert!(o.status.success(), "{name} {split}: {}", stderr(&o));
        }
    }
}

#[test]
fn what_cannot_be_imported_is_refused_naming_the_field() {
    let write = |name: &str, text: &str| {
        let p = tmp(name);
        std::fs::write(&p, text).unwrap();
        p
    };
    let base = std::fs::read_to_string("tests/data/hf/llama3_8b.json").unwrap();
    let cases = [
        (
            "bert.json",
            r#"{"model_type": "bert", "hidden_size": 768}"#.to_string(),
            "model_type `bert`",
        ),
        ("broken.json", "{\"model_type\": ".to_string(), "not JSON"),
        ("list.json", "[1, 2]".to_string(), "JSON object"),
        (
            "nolayers.json",
            base.replace("\"num_hidden_layers\": 32,", ""),
            "`num_hidden_layers` is missing",
        ),
        (
            "relu.json",
            base.replace("\"silu\"", "\"relu\""),
            "`hidden_act` is `relu`",
        ),
        (
            "kv.json",
            base.replace("\"num_key_value_heads\": 8", "\"num_key_value_heads\": 5"),
            "`num_key_value_heads`",
        ),
        (
            "neg.json",
            base.replace("\"hidden_size\": 4096", "\"hidden_size\": -4096"),
            "`hidden_size` is -4096",
        ),
        (
            "mlpbias.json",
            base.replace(
                "\"attention_bias\": false",
                "\"attention_bias\": false, \"mlp_bias\": true",
            ),
            "`mlp_bias`",
        ),
    ];
    for (name, text, want) in cases {
        let p = write(name, &text);
        let o = dplc(&["import", "hf", p.to_str().unwrap()]);
        assert_eq!(o.status.code(), Some(1), "{name}");
        assert!(stderr(&o).contains(want), "{name}: {}", stderr(&o));
        assert!(
            o.stdout.is_empty(),
            "{name}: nothing is written on a refusal"
        );
    }
    // Under --json the error is JSON.
    let p = write("bert2.json", r#"{"model_type": "bert"}"#);
    let o = dplc(&["import", "hf", p.to_str().unwrap(), "--json"]);
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).expect("a JSON error");
    assert_eq!(v["error"]["code"], "dplc::import");
    // The config is an input: -o onto it is refused and it is left whole.
    let keep = write("keep.json", &base);
    let k = keep.to_str().unwrap();
    let o = dplc(&["import", "hf", k, "-o", k]);
    assert_eq!(o.status.code(), Some(1));
    assert_eq!(std::fs::read_to_string(&keep).unwrap(), base);
    // A name that is not a .dpl name.
    let o = dplc(&["import", "hf", k, "--name", "3-bad"]);
    assert_eq!(o.status.code(), Some(1));
    assert!(stderr(&o).contains("--name"));
}

/// `dplc check` on `file`: passes, or the error.
fn checks(file: &std::path::Path) -> Result<(), String> {
    let o = dplc(&["check", file.to_str().unwrap()]);
    if o.status.success() {
        Ok(())
    } else {
        Err(stderr(&o))
    }
}

#[test]
fn an_imported_file_always_checks_whatever_the_name() {
    let base = std::fs::read_to_string("tests/data/hf/llama3_8b.json").unwrap();
    let gpt2 = std::fs::read_to_string("tests/data/hf/gpt2.json").unwrap();
    let gemma = std::fs::read_to_string("tests/data/hf/gemma_2b.json").unwrap();
    let with_path = |text: &str, path: &str| {
        text.replacen('{', &format!("{{\"_name_or_path\": \"{path}\", "), 1)
    };
    // Names from `_name_or_path`: keywords of the language, a leading
    // digit, characters a name cannot hold, nothing at all.
    let cases = [
        ("kw_input", with_path(&base, "my-org/Input"), "input_model"),
        ("kw_model", with_path(&gpt2, "model"), "model_model"),
        ("kw_repeat", with_path(&gemma, "org/repeat"), "repeat_model"),
        ("kw_true", with_path(&base, "True"), "true_model"),
        (
            "kw_cluster",
            with_path(&base, "a/b/cluster/"),
            "cluster_model",
        ),
        ("digit", with_path(&base, "org/7b"), "m7b"),
        (
            "dashes",
            with_path(&base, "meta-llama/Llama-3-8B"),
            "llama_3_8b",
        ),
        ("empty", with_path(&base, ""), "empty"),
    ];
    for (name, text, model) in cases {
        let (out, file) = import_text(name, &text);
        assert!(out.status.success(), "{name}: {}", stderr(&out));
        let dpl = std::fs::read_to_string(&file).unwrap();
        assert!(dpl.contains(&format!("model {model}(")), "{name}:\n{dpl}");
        checks(&file).unwrap_or_else(|e| panic!("{name} ({model}) does not check: {e}"));
    }
    // A keyword given as --name is refused, naming a name that works.
    let config = tmp("named.json");
    std::fs::write(&config, &base).unwrap();
    for keyword in [
        "input", "model", "repeat", "block", "param", "if", "true", "train", "cluster",
    ] {
        let o = dplc(&["import", "hf", config.to_str().unwrap(), "--name", keyword]);
        assert_eq!(o.status.code(), Some(1), "--name {keyword}");
        let err = stderr(&o);
        assert!(
            err.contains(&format!("`{keyword}` is a keyword"))
                && err.contains(&format!("--name {keyword}_model")),
            "--name {keyword}: {err}"
        );
    }
    // A name that only starts like a keyword is a name.
    let file = tmp("inputs.dpl");
    let o = dplc(&[
        "import",
        "hf",
        config.to_str().unwrap(),
        "--name",
        "inputs",
        "-o",
        file.to_str().unwrap(),
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    checks(&file).unwrap();
}

#[test]
fn layer_counts_past_the_languages_repeat_limit_are_refused_by_field() {
    let llama = std::fs::read_to_string("tests/data/hf/llama3_8b.json").unwrap();
    let gpt2 = std::fs::read_to_string("tests/data/hf/gpt2.json").unwrap();
    let max = dplc_frontend::MAX_REPEAT;
    for (name, text, field) in [
        (
            "layers_huge",
            llama.replace(
                "\"num_hidden_layers\": 32",
                "\"num_hidden_layers\": 1000000000",
            ),
            "num_hidden_layers",
        ),
        (
            "n_layer_huge",
            gpt2.replace("\"n_layer\": 12", &format!("\"n_layer\": {}", max + 1)),
            "n_layer",
        ),
    ] {
        let (out, file) = import_text(name, &text);
        assert_eq!(out.status.code(), Some(1), "{name}");
        let err = stderr(&out);
        assert!(
            err.contains(&format!("`{field}` is")) && err.contains(&format!("at most {max}")),
            "{name}: {err}"
        );
        assert!(!file.exists(), "{name}: nothing is written on a refusal");
    }
}

/// Qwen2 as transformers builds it: its q/k/v projections always carry
/// biases (Qwen2Attention ignores `attention_bias`), and its sliding window
/// covers only the layers from `max_window_layers` on — all of them or none
/// are imported, a window over some layers is refused by field.
#[test]
fn qwen2_imports_as_transformers_builds_it() {
    let qwen2 = |extra: &str| {
        format!(
            r#"{{"model_type": "qwen2", "hidden_act": "silu", "hidden_size": 1536,
            "intermediate_size": 8960, "num_hidden_layers": 28, "num_attention_heads": 12,
            "num_key_value_heads": 2, "max_position_embeddings": 32768, "rms_norm_eps": 1e-06,
            "rope_theta": 1000000.0, "tie_word_embeddings": true, "vocab_size": 151936,
            "torch_dtype": "bfloat16", "sliding_window": 4096{extra}}}"#
        )
    };
    // Qwen2.5-1.5B's count whatever `attention_bias` says.
    for (name, extra) in [
        ("qwen2_plain", String::new()),
        ("qwen2_nobias", r#", "attention_bias": false"#.to_string()),
        (
            "qwen2_no_window",
            r#", "use_sliding_window": true, "max_window_layers": 28"#.to_string(),
        ),
    ] {
        let (out, file) = import_text(name, &qwen2(&extra));
        assert!(out.status.success(), "{name}: {}", stderr(&out));
        let file = file.to_str().unwrap();
        assert_eq!(params(file, None), 1_543_714_304, "{name}");
        let text = std::fs::read_to_string(file).unwrap();
        assert!(
            !text.contains("window ="),
            "{name}: no layer slides\n{text}"
        );
    }
    let (out, file) = import_text(
        "qwen2_all_window",
        &qwen2(r#", "use_sliding_window": true, "max_window_layers": 0"#),
    );
    assert!(out.status.success(), "{}", stderr(&out));
    let text = std::fs::read_to_string(file).unwrap();
    assert!(text.contains("window = 4096"), "{text}");
    assert_refused(
        "qwen2_some_window",
        &qwen2(r#", "use_sliding_window": true, "max_window_layers": 21"#),
        "max_window_layers",
    );
}
