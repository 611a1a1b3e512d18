//! The LayerNorm families with biased linears: GPT-2, GPT-NeoX (Pythia),
//! Phi-1.5/Phi-2, OPT and BLOOM.

use super::{number, train_section, train_seq, Config};
use miette::Result;
use serde_json::Value;
use std::fmt::Write;

/// GPT-2: learned positions, pre-LN with biases, tanh GeLU, tied output.
pub(super) fn gpt2(c: &Config, name: &str) -> Result<String> {
    let vocab = c.size("vocab_size")?;
    let d = c.size("n_embd")?;
    let layers = c.layers("n_layer")?;
    let heads = c.size("n_head")?;
    let ctx = c.size("n_positions")?;
    let inner = c.size_or("n_inner", Some(4 * d))?;
    let eps = c.number_or("layer_norm_epsilon", 1e-5)?;
    let act = c.act(
        "activation_function",
        "gelu_new",
        &["gelu_new", "gelu_pytorch_tanh", "gelu", "relu"],
    )?;
    let act = match act.as_str() {
        "gelu_new" | "gelu_pytorch_tanh" => "gelu_tanh",
        other => other,
    };
    c.heads_split("n_head", heads, d)?;
    let dropout = c.number_or("resid_pdrop", 0.1)?;
    for key in ["attn_pdrop", "embd_pdrop"] {
        let p = c.number_or(key, dropout)?;
        if p != dropout {
            return Err(c.err(
                key,
                format!("is {p}, not resid_pdrop {dropout}: dplc's blocks take one dropout"),
            ));
        }
    }
    c.neutral(
        "scale_attn_by_inverse_layer_idx",
        |v| v == &Value::Bool(false),
        "not modelled",
    )?;
    c.neutral(
        "reorder_and_upcast_attn",
        |v| v == &Value::Bool(false),
        "not modelled",
    )?;
    c.neutral(
        "tie_word_embeddings",
        |v| v == &Value::Bool(true),
        "GPT-2's output is its embedding",
    )?;
    let seq = ctx.min(8192);
    let mut s = String::new();
    let _ = writeln!(
        s,
        "// {name}: imported from a Hugging Face config.json (model_type gpt2) by\n\
         // `dplc import hf`.\n\n\
         model {name}(vocab = {vocab}, ctx = {ctx}, d = {d}, heads = {heads}, layers = {layers},\n\
         {pad}inner = {inner}, eps = {eps}, dropout = {dropout}) {{\n\
         \x20   input tokens: i32[batch, seq]\n\
         \x20   input targets: i32[batch, seq]\n\
         \x20   param wte: [vocab, d]\n\
         \x20   param wpe: [ctx, d]\n\
         \x20   h = dropout(embedding(wte, tokens) + embedding(wpe, positions(seq)), dropout)\n\
         \x20   repeat layers {{\n\
         \x20       h = h + attention(layer_norm(h, d, eps, name = \"ln_1\"), d, heads, causal = true, dropout = dropout)\n\
         \x20       h = h + mlp(layer_norm(h, d, eps, name = \"ln_2\"), d, inner, act = \"{act}\", dropout = dropout)\n\
         \x20   }}\n\
         \x20   h = layer_norm(h, d, eps, name = \"ln_f\")\n\
         \x20   return cross_entropy(h @ transpose(wte), targets)\n}}\n",
        pad = " ".repeat(7 + name.len()),
        eps = number(eps),
        dropout = number(dropout),
    );
    s.push_str(&train_section(c, name, seq)?);
    Ok(s)
}

/// GPT-NeoX and Pythia: LayerNorm with biases, rotary on the first
/// `rotary_pct` of each head, biased linears, GeLU, the attention and the
/// MLP side by side on the layer's input (`use_parallel_residual`, every
/// Pythia) or one after the other, an untied output (`embed_out`).
pub(super) fn gpt_neox(c: &Config, name: &str) -> Result<String> {
    let vocab = c.size("vocab_size")?;
    let d = c.size("hidden_size")?;
    let layers = c.layers("num_hidden_layers")?;
    let heads = c.size("num_attention_heads")?;
    let ffn = c.size("intermediate_size")?;
    let eps = c.number_or("layer_norm_eps", 1e-5)?;
    let theta = c.number_or("rotary_emb_base", 10000.0)?;
    let context = c.size_or("max_position_embeddings", Some(2048))?;
    let act = c.act("hidden_act", "gelu", &["gelu", "gelu_new", "gelu_fast"])?;
    let act = if act == "gelu" { "gelu" } else { "gelu_tanh" };
    c.heads_split("num_attention_heads", heads, d)?;
    let rotary_arg = c.rotary_dims("rotary_pct", 1.0, d / heads)?;
    let bias = c.flag_or("attention_bias", true)?;
    let parallel = c.flag_or("use_parallel_residual", true)?;
    for key in ["attention_dropout", "hidden_dropout"] {
        c.neutral(key, |v| v.as_f64() == Some(0.0), "dropout is not imported")?;
    }
    c.neutral(
        "tie_word_embeddings",
        |v| v == &Value::Bool(false),
        "GPT-NeoX's output (`embed_out`) is a weight of its own",
    )?;
    c.neutral("rope_scaling", |v| v.is_null(), "not modelled")?;
    let attention = format!(
        "attention(layer_norm(h, d, norm_eps, name = \"input_layernorm\"), d, heads,\n\
         \x20                         rotary = true, rope_theta = rope_theta{rotary_arg},\n\
         \x20                         qkv_bias = {bias}, out_bias = {bias})"
    );
    let mlp = |input: &str| {
        format!(
            "mlp(layer_norm({input}, d, norm_eps, name = \"post_attention_layernorm\"), d, ffn, bias = {bias}, act = \"{act}\")"
        )
    };
    let body = if parallel {
        format!(
            "\x20       // The attention and the MLP read the same input (use_parallel_residual).\n\
             \x20       h = h + {attention}\n\
             \x20             + {}\n",
            mlp("h")
        )
    } else {
        format!(
            "\x20       h = h + {attention}\n\
             \x20       h = h + {}\n",
            mlp("h")
        )
    };
    let (seq, _) = train_seq(c, context)?;
    let mut s = String::new();
    let _ = writeln!(
        s,
        "// {name}: imported from a Hugging Face config.json (model_type gpt_neox) by\n\
         // `dplc import hf`.\n\n\
         model {name}(vocab = {vocab}, d = {d}, heads = {heads}, layers = {layers}, ffn = {ffn},\n\
         {pad}rope_theta = {theta}, norm_eps = {eps}) {{\n\
         \x20   input tokens: i32[batch, seq]\n\
         \x20   input targets: i32[batch, seq]\n\
         \x20   param embed: [vocab, d]\n\
         \x20   h = embedding(embed, tokens)\n\
         \x20   repeat layers {{\n\
         {body}\
         \x20   }}\n\
         \x20   h = layer_norm(h, d, norm_eps, name = \"final_layer_norm\")\n\
         \x20   param output: [d, vocab]\n\
         \x20   return cross_entropy(h @ output, targets)\n}}\n",
        pad = " ".repeat(7 + name.len()),
        theta = number(theta),
        eps = number(eps),
    );
    s.push_str(&train_section(c, name, seq)?);
    Ok(s)
}

/// Phi-1, Phi-1.5 and Phi-2 (model_type phi): one LayerNorm per layer whose
/// output both the attention and the MLP read, their sum added to the
/// residual with the residual dropout; rotary on the first
/// `partial_rotary_factor` of each head; biased linears; GeLU; an untied
/// output with a bias.
pub(super) fn phi(c: &Config, name: &str) -> Result<String> {
    let vocab = c.size("vocab_size")?;
    let d = c.size("hidden_size")?;
    let layers = c.layers("num_hidden_layers")?;
    let heads = c.size("num_attention_heads")?;
    let kv_heads = c.size_or("num_key_value_heads", Some(heads))?;
    let ffn = c.size("intermediate_size")?;
    let eps = c.number_or("layer_norm_eps", 1e-5)?;
    let theta = c.number_or("rope_theta", 10000.0)?;
    let context = c.size_or("max_position_embeddings", Some(2048))?;
    let act = c.act(
        "hidden_act",
        "gelu_new",
        &["gelu_new", "gelu_pytorch_tanh", "gelu"],
    )?;
    let act = if act == "gelu" { "gelu" } else { "gelu_tanh" };
    if d % heads != 0 || heads % kv_heads != 0 {
        return Err(c.err(
            "num_attention_heads",
            format!("{heads} heads ({kv_heads} of keys and values) do not split hidden_size {d}"),
        ));
    }
    let rotary_arg = c.rotary_dims("partial_rotary_factor", 0.5, d / heads)?;
    c.neutral("qk_layernorm", |v| v == &Value::Bool(false), "not modelled")?;
    for key in ["attention_dropout", "embd_pdrop"] {
        c.neutral(
            key,
            |v| v.as_f64() == Some(0.0),
            "dropout is not imported there",
        )?;
    }
    let dropout = c.number_or("resid_pdrop", 0.0)?;
    c.neutral(
        "tie_word_embeddings",
        |v| v == &Value::Bool(false),
        "Phi's output (`lm_head`, with a bias) is a weight of its own",
    )?;
    c.neutral("rope_scaling", |v| v.is_null(), "not modelled")?;
    let (seq, _) = train_seq(c, context)?;
    let mut s = String::new();
    let _ = writeln!(
        s,
        "// {name}: imported from a Hugging Face config.json (model_type phi) by\n\
         // `dplc import hf`.\n\n\
         model {name}(vocab = {vocab}, d = {d}, heads = {heads}, kv_heads = {kv_heads}, layers = {layers},\n\
         {pad}ffn = {ffn}, rope_theta = {theta}, norm_eps = {eps}, dropout = {dropout}) {{\n\
         \x20   input tokens: i32[batch, seq]\n\
         \x20   input targets: i32[batch, seq]\n\
         \x20   param embed: [vocab, d]\n\
         \x20   h = embedding(embed, tokens)\n\
         \x20   repeat layers {{\n\
         \x20       // The attention and the MLP read one normalised input.\n\
         \x20       x = layer_norm(h, d, norm_eps, name = \"input_layernorm\")\n\
         \x20       h = h + dropout(attention(x, d, heads, kv_heads = kv_heads, rotary = true,\n\
         \x20                                 rope_theta = rope_theta{rotary_arg}), dropout)\n\
         \x20             + dropout(mlp(x, d, ffn, act = \"{act}\"), dropout)\n\
         \x20   }}\n\
         \x20   h = layer_norm(h, d, norm_eps, name = \"final_layernorm\")\n\
         \x20   param output: [d, vocab]\n\
         \x20   param output_bias: [vocab] = zeros\n\
         \x20   return cross_entropy(h @ output + output_bias, targets)\n}}\n",
        pad = " ".repeat(7 + name.len()),
        theta = number(theta),
        eps = number(eps),
        dropout = number(dropout),
    );
    s.push_str(&train_section(c, name, seq)?);
    Ok(s)
}

/// OPT (Zhang et al. 2022): GPT-2's layer with ReLU, learned positions read
/// two rows into their table (`OPTLearnedPositionalEmbedding`'s offset), the
/// output tied to the embedding. Only the pre-norm layout without a
/// projection (every OPT but 350M) is imported.
pub(super) fn opt(c: &Config, name: &str) -> Result<String> {
    let vocab = c.size("vocab_size")?;
    let d = c.size("hidden_size")?;
    let layers = c.layers("num_hidden_layers")?;
    let heads = c.size("num_attention_heads")?;
    let ffn = c.size("ffn_dim")?;
    let ctx = c.size("max_position_embeddings")?;
    c.act("activation_function", "relu", &["relu"])?;
    c.heads_split("num_attention_heads", heads, d)?;
    c.neutral(
        "do_layer_norm_before",
        |v| v == &Value::Bool(true),
        "only OPT's pre-norm layout (every size but 350M) is imported",
    )?;
    c.neutral(
        "word_embed_proj_dim",
        |v| v.as_u64() == Some(d),
        "a projection between the embedding and the layers (OPT-350M) is not imported",
    )?;
    for key in ["attention_dropout", "activation_dropout", "layerdrop"] {
        c.neutral(
            key,
            |v| v.as_f64() == Some(0.0),
            "dropout there is not imported",
        )?;
    }
    c.neutral(
        "enable_bias",
        |v| v == &Value::Bool(true),
        "OPT's linears have biases",
    )?;
    c.neutral(
        "tie_word_embeddings",
        |v| v == &Value::Bool(true),
        "OPT's output is its embedding",
    )?;
    let dropout = c.number_or("dropout", 0.1)?;
    let seq = ctx.min(8192);
    let mut s = String::new();
    let _ = writeln!(
        s,
        "// {name}: imported from a Hugging Face config.json (model_type opt) by\n\
         // `dplc import hf`.\n\n\
         model {name}(vocab = {vocab}, ctx = {ctx}, d = {d}, heads = {heads}, layers = {layers},\n\
         {pad}ffn = {ffn}, dropout = {dropout}) {{\n\
         \x20   input tokens: i32[batch, seq]\n\
         \x20   input targets: i32[batch, seq]\n\
         \x20   param embed: [vocab, d]\n\
         \x20   // OPT's position table has two rows before the first position.\n\
         \x20   param embed_positions: [ctx + 2, d]\n\
         \x20   pos = embedding(slice(embed_positions, 0, 2, ctx), positions(seq))\n\
         \x20   h = dropout(embedding(embed, tokens) + pos, dropout)\n\
         \x20   repeat layers {{\n\
         \x20       h = h + dropout(attention(layer_norm(h, d, name = \"self_attn_layer_norm\"), d, heads,\n\
         \x20                                 causal = true), dropout)\n\
         \x20       h = h + mlp(layer_norm(h, d, name = \"final_layer_norm\"), d, ffn, act = \"relu\",\n\
         \x20                   dropout = dropout)\n\
         \x20   }}\n\
         \x20   h = layer_norm(h, d, name = \"final_layer_norm\")\n\
         \x20   return cross_entropy(h @ transpose(embed), targets)\n}}\n",
        pad = " ".repeat(7 + name.len()),
        dropout = number(dropout),
    );
    s.push_str(&train_section(c, name, seq)?);
    Ok(s)
}

/// BLOOM (BigScience 2022): ALiBi instead of positions (each head adds
/// `slope × key position` to its scores, the slopes `2^(-8(h+1)/heads)`), a
/// LayerNorm on the embedding, GPT-2's layer with biases and tanh GeLU, the
/// output tied to the embedding. Head counts that are not powers of two
/// (BLOOM-176B's 112) take ALiBi's interleaved slopes, which are not
/// imported.
pub(super) fn bloom(c: &Config, name: &str) -> Result<String> {
    let vocab = c.size("vocab_size")?;
    let d = c.size("hidden_size")?;
    let layers = c.layers("n_layer")?;
    let heads = c.size("n_head")?;
    let eps = c.number_or("layer_norm_epsilon", 1e-5)?;
    c.heads_split("n_head", heads, d)?;
    if !heads.is_power_of_two() {
        return Err(c.err(
            "n_head",
            format!("is {heads}, not a power of two: ALiBi's interleaved slopes are not imported"),
        ));
    }
    c.neutral(
        "apply_residual_connection_post_layernorm",
        |v| v == &Value::Bool(false),
        "only BLOOM's pre-norm residual is imported",
    )?;
    for key in ["attention_dropout", "hidden_dropout"] {
        c.neutral(key, |v| v.as_f64() == Some(0.0), "dropout is not imported")?;
    }
    c.neutral(
        "tie_word_embeddings",
        |v| v == &Value::Bool(true),
        "BLOOM's output is its embedding",
    )?;
    let mut s = String::new();
    let _ = writeln!(
        s,
        "// {name}: imported from a Hugging Face config.json (model_type bloom) by\n\
         // `dplc import hf`.\n\n\
         model {name}(vocab = {vocab}, d = {d}, heads = {heads}, layers = {layers}, eps = {eps}) {{\n\
         \x20   input tokens: i32[batch, seq]\n\
         \x20   input targets: i32[batch, seq]\n\
         \x20   param embed: [vocab, d]\n\
         \x20   h = layer_norm(embedding(embed, tokens), d, eps, name = \"word_embeddings_layernorm\")\n\
         \x20   // ALiBi: head h adds 2^(-8(h+1)/heads) × the key's position to its scores.\n\
         \x20   slopes = exp((cast(positions(heads), f32) + 1.0) * (-8.0 * log(2.0) / heads))\n\
         \x20   keys = cast(positions(seq), f32)\n\
         \x20   alibi = expand(reshape(slopes, [heads, 1, 1]) * reshape(keys, [1, 1, seq]), [heads, seq, seq])\n\
         \x20   repeat layers {{\n\
         \x20       h = h + attention(layer_norm(h, d, eps, name = \"input_layernorm\"), d, heads, bias = alibi)\n\
         \x20       h = h + mlp(layer_norm(h, d, eps, name = \"post_attention_layernorm\"), d, 4 * d)\n\
         \x20   }}\n\
         \x20   h = layer_norm(h, d, eps, name = \"ln_f\")\n\
         \x20   return cross_entropy(h @ transpose(embed), targets)\n}}\n",
        eps = number(eps),
    );
    s.push_str(&train_section(c, name, 2048)?);
    Ok(s)
}
