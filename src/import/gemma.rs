//! Gemma and Gemma 2, which the file writes as its own blocks: heads
//! `head_dim` wide, RMSNorm scaled by `1 + w`, the GeLU-gated FFN, and
//! Gemma 2's post-norms, soft caps and sliding/global layer pairs.

use super::{number, train_section, train_seq, Config};
use miette::Result;
use serde_json::Value;
use std::fmt::Write;

/// What Gemma and Gemma 2 read alike: the shape, the FFN's GeLU, and the
/// fields whose other values their blocks do not compute.
struct Shape {
    vocab: u64,
    d: u64,
    layers: u64,
    heads: u64,
    kv_heads: u64,
    head_dim: u64,
    ffn: u64,
    eps: f64,
    theta: f64,
    context: u64,
    gelu: &'static str,
}

fn shape(c: &Config) -> Result<Shape> {
    let d = c.size("hidden_size")?;
    let heads = c.size("num_attention_heads")?;
    let kv_heads = c.size_or("num_key_value_heads", Some(heads))?;
    let head_dim = c.size_or("head_dim", Some(d / heads))?;
    // transformers runs Gemma's FFN with `hidden_activation`, the tanh GeLU
    // when it is absent; the older `hidden_act` ("gelu" in the released
    // configs) is ignored, as transformers ignores it.
    let act = c.act(
        "hidden_activation",
        "gelu_pytorch_tanh",
        &["gelu_pytorch_tanh", "gelu"],
    )?;
    if heads % kv_heads != 0 {
        return Err(c.err(
            "num_key_value_heads",
            format!("{kv_heads} does not divide num_attention_heads {heads}"),
        ));
    }
    if !head_dim.is_multiple_of(2) {
        return Err(c.err(
            "head_dim",
            format!("{head_dim} is odd; rotary positions pair the head's features"),
        ));
    }
    c.neutral(
        "attention_bias",
        |v| v == &Value::Bool(false),
        "Gemma's attention has no biases",
    )?;
    c.neutral(
        "tie_word_embeddings",
        |v| v == &Value::Bool(true),
        "Gemma's output is its embedding",
    )?;
    Ok(Shape {
        vocab: c.size("vocab_size")?,
        d,
        layers: c.layers("num_hidden_layers")?,
        heads,
        kv_heads,
        head_dim,
        ffn: c.size("intermediate_size")?,
        eps: c.number_or("rms_norm_eps", 1e-6)?,
        theta: c.number_or("rope_theta", 10000.0)?,
        context: c.size_or("max_position_embeddings", Some(8192))?,
        gelu: if act == "gelu" { "gelu" } else { "gelu_tanh" },
    })
}

/// `tanh(x / c) · c` where a cap is set.
fn capped(x: &str, cap: Option<f64>) -> String {
    match cap {
        Some(v) => format!("tanh({x} * (1.0 / {v})) * {v}", v = number(v)),
        None => x.to_string(),
    }
}

/// The blocks both families write: `gemma_norm` (RMSNorm scaled by 1 + w),
/// the attention block `attention` (heads `head_dim` wide, scores scaled by
/// 1/sqrt(`scale`) and soft-capped by `cap`, a `window` argument where
/// `windowed`) and `gemma_mlp` (the GeLU-gated FFN).
fn blocks(gelu: &str, attention: &str, windowed: bool, scale: &str, cap: Option<f64>) -> String {
    let window_param = if windowed { ", window" } else { "" };
    let window_mask = if windowed {
        "    if window > 0 {\n\
         \x20       t = cast(positions(s), f32)\n\
         \x20       behind = reshape(t, [s, 1]) - reshape(t, [1, s])\n\
         \x20       scores = scores - ge(behind, window) * 1.0e30\n\
         \x20   }\n"
    } else {
        ""
    };
    let cap_line = match cap {
        Some(_) => format!("    scores = {}\n", capped("scores", cap)),
        None => String::new(),
    };
    format!(
        "block gemma_norm(x, d, eps) {{\n\
         \x20   param w: [d] = zeros\n\
         \x20   return rmsnorm(x, w + 1.0, eps)\n}}\n\n\
         block {attention}(x, d, heads, kv_heads, head_dim, rope_theta{window_param}) {{\n\
         \x20   b = dim(x, 0)\n\
         \x20   s = dim(x, 1)\n\
         \x20   param wq: [d, heads * head_dim]\n\
         \x20   param wk: [d, kv_heads * head_dim]\n\
         \x20   param wv: [d, kv_heads * head_dim]\n\
         \x20   param wo: [heads * head_dim, d]\n\
         \x20   q = rotary(reshape(x @ wq, [b, s, heads, head_dim]), rope_theta)\n\
         \x20   k = rotary(reshape(x @ wk, [b, s, kv_heads, head_dim]), rope_theta)\n\
         \x20   v = reshape(x @ wv, [b, s, kv_heads, head_dim])\n\
         \x20   if kv_heads < heads {{\n\
         \x20       rep = heads / kv_heads\n\
         \x20       k = reshape(expand(reshape(k, [b, s, kv_heads, 1, head_dim]), [b, s, kv_heads, rep, head_dim]), [b, s, heads, head_dim])\n\
         \x20       v = reshape(expand(reshape(v, [b, s, kv_heads, 1, head_dim]), [b, s, kv_heads, rep, head_dim]), [b, s, heads, head_dim])\n\
         \x20   }}\n\
         \x20   q = transpose(q, 1, 2)\n\
         \x20   k = transpose(k, 1, 2)\n\
         \x20   v = transpose(v, 1, 2)\n\
         \x20   scores = (q @ transpose(k, 2, 3)) * (1.0 / sqrt({scale}))\n\
         {cap_line}{window_mask}\
         \x20   o = reshape(transpose(softmax(causal_mask(scores), -1) @ v, 1, 2), [b, s, heads * head_dim])\n\
         \x20   return o @ wo\n}}\n\n\
         block gemma_mlp(x, d, hidden) {{\n\
         \x20   param gate: [d, hidden]\n\
         \x20   param up: [d, hidden]\n\
         \x20   param down: [hidden, d]\n\
         \x20   return ({gelu}(x @ gate) * (x @ up)) @ down\n}}\n\n"
    )
}

/// Gemma: head width from `head_dim`, multi-query or grouped attention,
/// RMSNorm scaled by `1 + w`, the embedding scaled by √d, a GeLU-gated FFN
/// and the output tied to the embedding — written as the file's own blocks.
pub(super) fn gemma(c: &Config, name: &str) -> Result<String> {
    let Shape {
        vocab,
        d,
        layers,
        heads,
        kv_heads,
        head_dim,
        ffn,
        eps,
        theta,
        context,
        gelu,
    } = shape(c)?;
    let (seq, _) = train_seq(c, context)?;
    let mut s = String::new();
    let _ = writeln!(
        s,
        "// {name}: imported from a Hugging Face config.json (model_type gemma) by\n\
         // `dplc import hf`. Gemma's own blocks: attention whose heads are head_dim\n\
         // wide, RMSNorm scaled by 1 + w, a GeLU-gated FFN.\n\n\
         {blocks}\
         model {name}(vocab = {vocab}, d = {d}, heads = {heads}, kv_heads = {kv_heads},\n\
         {pad}head_dim = {head_dim}, layers = {layers}, ffn = {ffn}, rope_theta = {theta},\n\
         {pad}norm_eps = {eps}) {{\n\
         \x20   input tokens: i32[batch, seq]\n\
         \x20   input targets: i32[batch, seq]\n\
         \x20   param embed: [vocab, d]\n\
         \x20   h = embedding(embed, tokens) * sqrt(d)\n\
         \x20   repeat layers {{\n\
         \x20       h = h + gemma_attention(gemma_norm(h, d, norm_eps, name = \"input_norm\"), d, heads,\n\
         \x20                               kv_heads, head_dim, rope_theta)\n\
         \x20       h = h + gemma_mlp(gemma_norm(h, d, norm_eps, name = \"post_attention_norm\"), d, ffn)\n\
         \x20   }}\n\
         \x20   h = gemma_norm(h, d, norm_eps, name = \"norm\")\n\
         \x20   return cross_entropy(h @ transpose(embed), targets)\n}}\n",
        blocks = blocks(gelu, "gemma_attention", false, "head_dim", None),
        pad = " ".repeat(7 + name.len()),
        theta = number(theta),
        eps = number(eps),
    );
    s.push_str(&train_section(c, name, seq)?);
    Ok(s)
}

/// A soft cap the config sets (`tanh(x / c) · c`), or none (absent, null).
fn softcap(c: &Config, key: &str) -> Result<Option<f64>> {
    match c.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(_) => {
            let cap = c.number_or(key, 0.0)?;
            if cap > 0.0 {
                Ok(Some(cap))
            } else {
                Err(c.err(key, format!("is {cap}, not a positive cap")))
            }
        }
    }
}

/// Gemma 2: Gemma's blocks with a norm after the attention and after the FFN
/// as well as before them, the attention's scores scaled by
/// `query_pre_attn_scalar` and soft-capped, the layers alternating between a
/// sliding window (the first of each pair, as transformers' `is_sliding`)
/// and the whole context, and the logits soft-capped.
pub(super) fn gemma2(c: &Config, name: &str) -> Result<String> {
    let Shape {
        vocab,
        d,
        layers,
        heads,
        kv_heads,
        head_dim,
        ffn,
        eps,
        theta,
        context,
        gelu,
    } = shape(c)?;
    let window = c.size("sliding_window")?;
    let scalar = c.number_or("query_pre_attn_scalar", head_dim as f64)?;
    if !layers.is_multiple_of(2) {
        return Err(c.err(
            "num_hidden_layers",
            format!("{layers} is odd; the layers alternate sliding and global in pairs"),
        ));
    }
    if scalar <= 0.0 {
        return Err(c.err(
            "query_pre_attn_scalar",
            format!("is {scalar}, not positive"),
        ));
    }
    c.neutral(
        "attention_dropout",
        |v| v.as_f64() == Some(0.0),
        "dropout is not imported",
    )?;
    let attn_cap = softcap(c, "attn_logit_softcapping")?;
    let final_cap = softcap(c, "final_logit_softcapping")?;
    let (seq, _) = train_seq(c, context)?;
    let mut s = String::new();
    let _ = writeln!(
        s,
        "// {name}: imported from a Hugging Face config.json (model_type gemma2) by\n\
         // `dplc import hf`. Gemma 2's own blocks: attention whose heads are head_dim\n\
         // wide, its scores scaled by 1/sqrt({scalar}) and soft-capped, a sliding\n\
         // window of {window} keys on every other layer; RMSNorm scaled by 1 + w before\n\
         // and after the attention and the FFN; a GeLU-gated FFN; soft-capped logits.\n\n\
         {blocks}\
         block gemma2_layer(h, d, heads, kv_heads, head_dim, ffn, rope_theta, eps, window) {{\n\
         \x20   a = gemma2_attention(gemma_norm(h, d, eps, name = \"input_norm\"), d, heads, kv_heads,\n\
         \x20                        head_dim, rope_theta, window)\n\
         \x20   h = h + gemma_norm(a, d, eps, name = \"post_attention_norm\")\n\
         \x20   m = gemma_mlp(gemma_norm(h, d, eps, name = \"pre_feedforward_norm\"), d, ffn)\n\
         \x20   return h + gemma_norm(m, d, eps, name = \"post_feedforward_norm\")\n}}\n\n\
         model {name}(vocab = {vocab}, d = {d}, heads = {heads}, kv_heads = {kv_heads},\n\
         {pad}head_dim = {head_dim}, layers = {layers}, ffn = {ffn}, rope_theta = {theta},\n\
         {pad}norm_eps = {eps}, window = {window}) {{\n\
         \x20   input tokens: i32[batch, seq]\n\
         \x20   input targets: i32[batch, seq]\n\
         \x20   param embed: [vocab, d]\n\
         \x20   h = embedding(embed, tokens) * sqrt(d)\n\
         \x20   // A pair a step: the sliding-window layer, then the global one.\n\
         \x20   repeat layers / 2 {{\n\
         \x20       h = gemma2_layer(h, d, heads, kv_heads, head_dim, ffn, rope_theta, norm_eps, window,\n\
         \x20                        name = \"sliding\")\n\
         \x20       h = gemma2_layer(h, d, heads, kv_heads, head_dim, ffn, rope_theta, norm_eps, 0,\n\
         \x20                        name = \"global\")\n\
         \x20   }}\n\
         \x20   h = gemma_norm(h, d, norm_eps, name = \"norm\")\n\
         \x20   logits = h @ transpose(embed)\n\
         \x20   return cross_entropy({final_capped}, targets)\n}}\n",
        blocks = blocks(gelu, "gemma2_attention", true, &number(scalar), attn_cap),
        pad = " ".repeat(7 + name.len()),
        theta = number(theta),
        eps = number(eps),
        scalar = number(scalar),
        final_capped = capped("logits", final_cap),
    );
    s.push_str(&train_section(c, name, seq)?);
    Ok(s)
}
