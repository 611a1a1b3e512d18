//! The Llama-like families: Llama, Mistral, Qwen2, Qwen3 and Qwen3-MoE,
//! Phi-3 and Mixtral, written with the standard blocks (RMSNorm, rotary
//! attention with grouped KV heads, SwiGLU or SwiGLU experts).

use super::{kind, number, train_section, train_seq, Config};
use miette::Result;
use serde_json::Value;
use std::fmt::Write;

/// Llama, Mistral, Qwen2 and Mixtral: RMSNorm, rotary attention with grouped
/// KV heads, SwiGLU (or SwiGLU experts), untied or tied output.
pub(super) fn llama_like(c: &Config, name: &str) -> Result<String> {
    let family = c.str("model_type")?.to_string();
    let vocab = c.size("vocab_size")?;
    let d = c.size("hidden_size")?;
    let layers = c.layers("num_hidden_layers")?;
    let heads = c.size("num_attention_heads")?;
    let kv_heads = c.size_or("num_key_value_heads", Some(heads))?;
    // Qwen3-MoE's experts are `moe_intermediate_size` wide.
    let ffn = if family == "qwen3_moe" {
        c.size("moe_intermediate_size")?
    } else {
        c.size("intermediate_size")?
    };
    let eps = c.number_or("rms_norm_eps", 1e-6)?;
    let theta = c.number_or("rope_theta", 10000.0)?;
    let context = c.size_or("max_position_embeddings", Some(4096))?;
    c.act("hidden_act", "silu", &["silu"])?;
    // Qwen3 RMS-normalises each head's query and key.
    let qk_norm = family.starts_with("qwen3");
    if heads % kv_heads != 0 {
        return Err(c.err(
            "num_key_value_heads",
            format!("{kv_heads} does not divide num_attention_heads {heads}"),
        ));
    }
    // A head width of its own (Mistral NeMo's 128 on a 5120-wide model)
    // goes to the attention block as `head_dim`; otherwise the heads split
    // the width evenly.
    let head_dim = match c.get("head_dim") {
        None | Some(Value::Null) => None,
        Some(_) => Some(c.size("head_dim")?),
    }
    .filter(|&hd| d % heads != 0 || hd != d / heads);
    if head_dim.is_none() && d % heads != 0 {
        return Err(c.err(
            "num_attention_heads",
            format!("{heads} does not divide hidden_size {d} and the config gives no head_dim"),
        ));
    }
    let head_dim_arg = head_dim.map_or(String::new(), |hd| format!(", head_dim = {hd}"));
    // Partial rotary (Phi-3's and Phi-4-mini's `partial_rotary_factor`).
    let rotary_arg = c.rotary_dims("partial_rotary_factor", 1.0, head_dim.unwrap_or(d / heads))?;
    // Phi-3's dropouts (0 in every published config) are not imported.
    for key in ["resid_pdrop", "embd_pdrop"] {
        c.neutral(key, |v| v.as_f64() == Some(0.0), "dropout is not imported")?;
    }
    let qk_norm_arg = if qk_norm {
        ", qk_norm = true, qk_norm_eps = norm_eps"
    } else {
        ""
    };
    // Qwen2's attention always carries q/k/v biases and an unbiased output
    // (transformers' Qwen2Attention: `bias=True` whatever `attention_bias`
    // says, which it does not read).
    let qwen2 = family == "qwen2";
    let said = c.flag_or("attention_bias", qwen2)?;
    let qkv_bias = qwen2 || said;
    let out_bias = !qwen2 && said;
    c.neutral(
        "mlp_bias",
        |v| v == &Value::Bool(false),
        "dplc's SwiGLU has no biases",
    )?;
    c.neutral(
        "attention_dropout",
        |v| v.as_f64() == Some(0.0),
        "dropout in attention is not imported",
    )?;
    let tied = c.flag_or("tie_word_embeddings", false)?;
    let rope_note = match c.get("rope_scaling") {
        None => String::new(),
        Some(Value::Object(o)) => format!(
            "\n// rope_scaling ({}) stretches positions past the original context; it\n\
             // changes no parameter and is not modelled: train within the context below.",
            o.get("rope_type")
                .or_else(|| o.get("type"))
                .and_then(Value::as_str)
                .unwrap_or("?")
        ),
        Some(v) => return Err(c.err("rope_scaling", format!("is {}, not an object", kind(v)))),
    };
    let (seq, window) = train_seq(c, context)?;
    let (window_note, window_arg) = match window {
        Some(w) => (
            format!("\n// sliding_window = {w}: each query attends to the {w} keys before it."),
            format!(", window = {w}"),
        ),
        None => (String::new(), String::new()),
    };
    let ffn_call = if family == "qwen3_moe" {
        let experts = c.size("num_experts")?;
        let top_k = c.size("num_experts_per_tok")?;
        if top_k > experts {
            return Err(c.err(
                "num_experts_per_tok",
                format!("{top_k} exceeds num_experts {experts}"),
            ));
        }
        // The moe block weighs the chosen experts by a softmax over their k
        // logits: Qwen3's softmax over all of them renormalised over the k,
        // which its configs set (transformers' default is not to).
        if c.get("norm_topk_prob") != Some(&Value::Bool(true)) {
            return Err(c.err(
                "norm_topk_prob",
                "is not true: the moe block renormalises the chosen experts' weights".into(),
            ));
        }
        c.neutral(
            "decoder_sparse_step",
            |v| v.as_u64() == Some(1),
            "every layer's FFN is a mixture of experts here",
        )?;
        c.neutral(
            "mlp_only_layers",
            |v| v.as_array().is_some_and(Vec::is_empty),
            "every layer's FFN is a mixture of experts here",
        )?;
        format!("moe(rms_norm(h, d, norm_eps, name = \"ffn_norm\"), d, ffn, {experts}, {top_k})")
    } else if family == "mixtral" {
        let experts = c.size("num_local_experts")?;
        let top_k = c.size("num_experts_per_tok")?;
        if top_k > experts {
            return Err(c.err(
                "num_experts_per_tok",
                format!("{top_k} exceeds num_local_experts {experts}"),
            ));
        }
        format!("moe(rms_norm(h, d, norm_eps, name = \"ffn_norm\"), d, ffn, {experts}, {top_k})")
    } else {
        for key in ["num_local_experts", "num_experts"] {
            c.neutral(
                key,
                |v| v.as_u64().is_some_and(|n| n <= 1),
                "a mixture of experts is imported as model_type mixtral or qwen3_moe",
            )?;
        }
        "swiglu(rms_norm(h, d, norm_eps, name = \"ffn_norm\"), d, ffn)".to_string()
    };
    let head = if tied {
        "h @ transpose(embed)".to_string()
    } else {
        "h @ output".to_string()
    };
    let mut s = String::new();
    let _ = writeln!(
        s,
        "// {name}: imported from a Hugging Face config.json (model_type {family}) by\n\
         // `dplc import hf`.{rope_note}{window_note}\n\n\
         model {name}(vocab = {vocab}, d = {d}, heads = {heads}, kv_heads = {kv_heads}, layers = {layers},\n\
         {pad}ffn = {ffn}, rope_theta = {theta}, norm_eps = {eps}) {{\n\
         \x20   input tokens: i32[batch, seq]\n\
         \x20   input targets: i32[batch, seq]\n\
         \x20   param embed: [vocab, d]\n\
         \x20   h = embedding(embed, tokens)\n\
         \x20   repeat layers {{\n\
         \x20       h = h + attention(rms_norm(h, d, norm_eps, name = \"attention_norm\"), d, heads,\n\
         \x20                         kv_heads = kv_heads, rotary = true, rope_theta = rope_theta,\n\
         \x20                         qkv_bias = {qkv_bias}, out_bias = {out_bias}{head_dim_arg}{rotary_arg}{qk_norm_arg}{window_arg})\n\
         \x20       h = h + {ffn_call}\n\
         \x20   }}\n\
         \x20   h = rms_norm(h, d, norm_eps, name = \"norm\")\n{output}\
         \x20   return cross_entropy({head}, targets)\n}}\n",
        pad = " ".repeat(7 + name.len()),
        theta = number(theta),
        eps = number(eps),
        output = if tied { "" } else { "    param output: [d, vocab]\n" },
    );
    s.push_str(&train_section(c, name, seq)?);
    Ok(s)
}
