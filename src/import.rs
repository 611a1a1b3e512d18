//! `dplc import hf CONFIG.json`: a Hugging Face `config.json` as a `.dpl`
//! model and train section, for the Llama, Mistral, Qwen2, Mixtral, Gemma
//! and GPT-2 families. Every field that shapes the model is read and
//! checked; one whose value would change the model into something the
//! generated file does not say is an error naming it, never ignored. Where a
//! family differs from the standard blocks (Gemma's head width, norm and
//! gated GeLU) the file writes its own blocks from the language's builtins.

use miette::{miette, Result};
use serde_json::{Map, Value};
use std::fmt::Write;
use std::path::{Path, PathBuf};

#[derive(clap::Args)]
pub struct Args {
    #[command(subcommand)]
    from: Source,
}

#[derive(clap::Subcommand)]
enum Source {
    /// A Hugging Face config.json (model_type llama, mistral, qwen2, qwen3, qwen3_moe, phi, phi3, mixtral, gemma, gemma2, gpt2, gpt_neox, opt or bloom).
    Hf {
        /// The config.json file.
        config: PathBuf,
        /// The model's name in the .dpl (default: from `_name_or_path` or the file).
        #[arg(long)]
        name: Option<String>,
        /// Write the .dpl here instead of standard output.
        #[arg(short, long)]
        output: Option<PathBuf>,
        /// Report errors as a JSON object on stdout (for scripts).
        #[arg(long)]
        json: bool,
    },
}

const FAMILIES: &str =
    "llama, mistral, qwen2, qwen3, qwen3_moe, phi3, mixtral, gemma, gpt2, gpt_neox";

pub fn run(args: &Args) -> Result<()> {
    let Source::Hf {
        config,
        name,
        output,
        ..
    } = &args.from;
    let text = std::fs::read_to_string(config).map_err(|e| {
        miette!(
            code = "dplc::io",
            help = "check the path",
            "cannot read {}: {e}",
            config.display()
        )
    })?;
    let v: Value = serde_json::from_str(&text).map_err(|e| {
        miette!(
            code = "dplc::import",
            help = "a Hugging Face config.json is one JSON object",
            "{}:{}:{}: not JSON: {e}",
            config.display(),
            e.line(),
            e.column()
        )
    })?;
    let obj = v.as_object().ok_or_else(|| {
        miette!(
            code = "dplc::import",
            "{}: a config.json is a JSON object, not {}",
            config.display(),
            kind(&v)
        )
    })?;
    let name = model_name(name.as_deref(), obj, config)?;
    let c = Config { obj, file: config };
    let dpl = match c.str("model_type")? {
        "llama" | "mistral" | "qwen2" | "qwen3" | "qwen3_moe" | "phi3" | "mixtral" => {
            llama_like(&c, &name)?
        }
        "gemma" => gemma(&c, &name)?,
        "gemma2" => gemma2(&c, &name)?,
        "gpt2" => gpt2(&c, &name)?,
        "gpt_neox" => gpt_neox(&c, &name)?,
        "phi" => phi(&c, &name)?,
        "opt" => opt(&c, &name)?,
        "bloom" => bloom(&c, &name)?,
        other => {
            return Err(miette!(
                code = "dplc::import",
                help = format!(
                    "dplc imports {FAMILIES}; write other models in .dpl (docs/language.md)"
                ),
                "{}: model_type `{other}` is not one dplc imports",
                config.display()
            ))
        }
    };
    match output {
        Some(path) => {
            crate::output::write(path, dpl.as_bytes(), &[config.as_path()])?;
            note!("wrote {} (model {name})", path.display());
        }
        None => out!("{dpl}"),
    }
    Ok(())
}

fn kind(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

/// `--name`, else the last part of `_name_or_path`, else the file's
/// directory or stem, as a .dpl name.
fn model_name(given: Option<&str>, obj: &Map<String, Value>, file: &Path) -> Result<String> {
    if let Some(n) = given {
        let ok = n
            .chars()
            .next()
            .is_some_and(|c| c.is_ascii_alphabetic() || c == '_')
            && n.chars().all(|c| c.is_ascii_alphanumeric() || c == '_');
        if !ok {
            return Err(miette!(
                code = "dplc::input",
                help = "a .dpl name is letters, digits and _, not starting with a digit",
                "--name `{n}` is not a .dpl name"
            ));
        }
        return Ok(n.to_string());
    }
    let from_path = obj
        .get("_name_or_path")
        .and_then(Value::as_str)
        .and_then(|p| p.rsplit('/').find(|s| !s.is_empty()))
        .map(str::to_string);
    let from_file = || {
        let stem = file.file_stem()?.to_str()?;
        if stem == "config" {
            file.canonicalize()
                .ok()?
                .parent()?
                .file_name()?
                .to_str()
                .map(str::to_string)
        } else {
            Some(stem.to_string())
        }
    };
    let raw = from_path
        .or_else(from_file)
        .unwrap_or_else(|| "model".into());
    let mut s: String = raw
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() {
                c.to_ascii_lowercase()
            } else {
                '_'
            }
        })
        .collect();
    if !s.starts_with(|c: char| c.is_ascii_alphabetic() || c == '_') {
        s.insert(0, 'm');
    }
    Ok(s)
}

/// Typed reads of a config's fields, each error naming the field.
struct Config<'a> {
    obj: &'a Map<String, Value>,
    file: &'a Path,
}

impl Config<'_> {
    fn err(&self, key: &str, what: String) -> miette::Report {
        miette!(
            code = "dplc::import",
            help = "fix the field, or write the model in .dpl (docs/language.md)",
            "{}: `{key}` {what}",
            self.file.display()
        )
    }

    fn get(&self, key: &str) -> Option<&Value> {
        self.obj.get(key).filter(|v| !v.is_null())
    }

    fn str(&self, key: &str) -> Result<&str> {
        match self.get(key) {
            Some(Value::String(s)) => Ok(s),
            Some(v) => Err(self.err(key, format!("is {}, not a string", kind(v)))),
            None => Err(self.err(key, "is missing".into())),
        }
    }

    fn size(&self, key: &str) -> Result<u64> {
        self.size_or(key, None)
    }

    /// A positive integer, or `default` when the field is absent.
    fn size_or(&self, key: &str, default: Option<u64>) -> Result<u64> {
        match self.get(key) {
            Some(v) => match v.as_u64() {
                Some(n) if n > 0 && n < 1 << 40 => Ok(n),
                _ => Err(self.err(key, format!("is {v}, not a positive whole number"))),
            },
            None => default.ok_or_else(|| self.err(key, "is missing".into())),
        }
    }

    fn number_or(&self, key: &str, default: f64) -> Result<f64> {
        match self.get(key) {
            Some(v) => match v.as_f64() {
                Some(x) if x.is_finite() && x >= 0.0 => Ok(x),
                _ => Err(self.err(key, format!("is {v}, not a non-negative number"))),
            },
            None => Ok(default),
        }
    }

    fn flag_or(&self, key: &str, default: bool) -> Result<bool> {
        match self.get(key) {
            Some(Value::Bool(b)) => Ok(*b),
            Some(v) => Err(self.err(key, format!("is {v}, not true or false"))),
            None => Ok(default),
        }
    }

    /// The activation, which must be one of `allowed` (HF's names).
    fn act(&self, key: &str, default: &str, allowed: &[&str]) -> Result<String> {
        let a = match self.get(key) {
            Some(Value::String(s)) => s.clone(),
            Some(v) => return Err(self.err(key, format!("is {}, not a string", kind(v)))),
            None => default.to_string(),
        };
        if allowed.contains(&a.as_str()) {
            Ok(a)
        } else {
            Err(self.err(
                key,
                format!(
                    "is `{a}`; this family's blocks are written for {}",
                    allowed.join(" or ")
                ),
            ))
        }
    }

    /// A field dplc does not model must be absent or at its neutral value.
    fn neutral(&self, key: &str, ok: impl Fn(&Value) -> bool, why: &str) -> Result<()> {
        match self.get(key) {
            Some(v) if !ok(v) => Err(self.err(key, format!("is {v}: {why}"))),
            _ => Ok(()),
        }
    }

    /// `heads` (the field `key`) split the model's width `d` evenly.
    fn heads_split(&self, key: &str, heads: u64, d: u64) -> Result<()> {
        if d.is_multiple_of(heads) {
            Ok(())
        } else {
            Err(self.err(key, format!("{heads} does not divide the width {d}")))
        }
    }

    /// The attention's `rotary_dims` argument for a head `width` wide of
    /// which the fraction `key` (default `default`) turns: transformers turns
    /// the first `int(fraction × width)` channels; empty when all of them.
    fn rotary_dims(&self, key: &str, default: f64, width: u64) -> Result<String> {
        let fraction = self.number_or(key, default)?;
        let turned = (fraction * width as f64) as u64;
        let fits = fraction > 0.0 && fraction <= 1.0 && turned > 0 && turned.is_multiple_of(2);
        if !fits {
            return Err(self.err(
                key,
                format!("is {fraction}: it turns {turned} of {width} channels; rotary turns pairs"),
            ));
        }
        Ok(if turned < width {
            format!(", rotary_dims = {turned}")
        } else {
            String::new()
        })
    }

    /// The precision of the train section, from `torch_dtype`.
    fn precision(&self) -> Result<&'static str> {
        match self.get("torch_dtype").or_else(|| self.get("dtype")) {
            None => Ok("bf16"),
            Some(Value::String(s)) => match s.as_str() {
                "bfloat16" => Ok("bf16"),
                "float16" => Ok("fp16"),
                "float32" => Ok("fp32"),
                other => Err(self.err(
                    "torch_dtype",
                    format!("is `{other}`, not bfloat16, float16 or float32"),
                )),
            },
            Some(v) => Err(self.err("torch_dtype", format!("is {}, not a string", kind(v)))),
        }
    }
}

/// The sequence the train section trains at (the context, at most 8192),
/// and the sliding window where a model has one narrower than the context
/// (the standard attention's `window`).
fn train_seq(c: &Config, context: u64) -> Result<(u64, Option<u64>)> {
    let sliding = match c.get("use_sliding_window") {
        Some(Value::Bool(false)) => None,
        _ => match c.get("sliding_window") {
            None => None,
            Some(v) => Some(v.as_u64().filter(|&w| w > 0).ok_or_else(|| {
                c.err(
                    "sliding_window",
                    format!("is {v}, not a positive whole number"),
                )
            })?),
        },
    };
    Ok((context.min(8192), sliding.filter(|&w| w < context)))
}

fn number(x: f64) -> String {
    let s = format!("{x:?}");
    if s.contains(['.', 'e']) {
        s
    } else {
        format!("{s}.0")
    }
}

fn train_section(c: &Config, name: &str, seq: u64) -> Result<String> {
    let precision = c.precision()?;
    let mut s = String::new();
    let _ = writeln!(
        s,
        "// The config says nothing of training: the batch, optimizer and schedule\n\
         // below are Llama 2's recipe, to edit.\ntrain {name} {{\n    seq = {seq}\n    \
         global_batch = 1024\n    precision = {precision}\n    \
         optimizer = adamw(lr = 3e-4, betas = (0.9, 0.95), eps = 1e-5, weight_decay = 0.1)\n    \
         schedule = warmup_cosine(warmup = 2000, total = 500000, min_ratio = 0.1)\n    \
         grad_clip = 1.0\n}}"
    );
    Ok(s)
}

/// Llama, Mistral, Qwen2 and Mixtral: RMSNorm, rotary attention with grouped
/// KV heads, SwiGLU (or SwiGLU experts), untied or tied output.
fn llama_like(c: &Config, name: &str) -> Result<String> {
    let family = c.str("model_type")?.to_string();
    let vocab = c.size("vocab_size")?;
    let d = c.size("hidden_size")?;
    let layers = c.size("num_hidden_layers")?;
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
    let bias_default = family == "qwen2";
    let qkv_bias = c.flag_or("attention_bias", bias_default)?;
    // Qwen2's attention carries q/k/v biases and an unbiased output.
    let out_bias = if family == "qwen2" { false } else { qkv_bias };
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

/// Gemma: head width from `head_dim`, multi-query or grouped attention,
/// RMSNorm scaled by `1 + w`, the embedding scaled by √d, a GeLU-gated FFN
/// and the output tied to the embedding — written as the file's own blocks.
fn gemma(c: &Config, name: &str) -> Result<String> {
    let vocab = c.size("vocab_size")?;
    let d = c.size("hidden_size")?;
    let layers = c.size("num_hidden_layers")?;
    let heads = c.size("num_attention_heads")?;
    let kv_heads = c.size_or("num_key_value_heads", Some(heads))?;
    let head_dim = c.size_or("head_dim", Some(d / heads))?;
    let ffn = c.size("intermediate_size")?;
    let eps = c.number_or("rms_norm_eps", 1e-6)?;
    let theta = c.number_or("rope_theta", 10000.0)?;
    let context = c.size_or("max_position_embeddings", Some(8192))?;
    // transformers runs Gemma's FFN with `hidden_activation`, the tanh GeLU
    // when it is absent; the older `hidden_act` ("gelu" in the released
    // configs) is ignored, as transformers ignores it.
    let act = c.act(
        "hidden_activation",
        "gelu_pytorch_tanh",
        &["gelu_pytorch_tanh", "gelu"],
    )?;
    let gelu = if act == "gelu" { "gelu" } else { "gelu_tanh" };
    if heads % kv_heads != 0 {
        return Err(c.err(
            "num_key_value_heads",
            format!("{kv_heads} does not divide num_attention_heads {heads}"),
        ));
    }
    if head_dim % 2 != 0 {
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
    let (seq, _) = train_seq(c, context)?;
    let mut s = String::new();
    let _ = writeln!(
        s,
        "// {name}: imported from a Hugging Face config.json (model_type gemma) by\n\
         // `dplc import hf`. Gemma's own blocks: attention whose heads are head_dim\n\
         // wide, RMSNorm scaled by 1 + w, a GeLU-gated FFN.\n\n\
         block gemma_norm(x, d, eps) {{\n\
         \x20   param w: [d] = zeros\n\
         \x20   return rmsnorm(x, w + 1.0, eps)\n}}\n\n\
         block gemma_attention(x, d, heads, kv_heads, head_dim, rope_theta) {{\n\
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
         \x20   scores = causal_mask((q @ transpose(k, 2, 3)) * (1.0 / sqrt(head_dim)))\n\
         \x20   o = reshape(transpose(softmax(scores, -1) @ v, 1, 2), [b, s, heads * head_dim])\n\
         \x20   return o @ wo\n}}\n\n\
         block gemma_mlp(x, d, hidden) {{\n\
         \x20   param gate: [d, hidden]\n\
         \x20   param up: [d, hidden]\n\
         \x20   param down: [hidden, d]\n\
         \x20   return ({gelu}(x @ gate) * (x @ up)) @ down\n}}\n\n\
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
        pad = " ".repeat(7 + name.len()),
        theta = number(theta),
        eps = number(eps),
    );
    s.push_str(&train_section(c, name, seq)?);
    Ok(s)
}

/// GPT-2: learned positions, pre-LN with biases, tanh GeLU, tied output.
fn gpt2(c: &Config, name: &str) -> Result<String> {
    let vocab = c.size("vocab_size")?;
    let d = c.size("n_embd")?;
    let layers = c.size("n_layer")?;
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
fn gpt_neox(c: &Config, name: &str) -> Result<String> {
    let vocab = c.size("vocab_size")?;
    let d = c.size("hidden_size")?;
    let layers = c.size("num_hidden_layers")?;
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
fn phi(c: &Config, name: &str) -> Result<String> {
    let vocab = c.size("vocab_size")?;
    let d = c.size("hidden_size")?;
    let layers = c.size("num_hidden_layers")?;
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
fn gemma2(c: &Config, name: &str) -> Result<String> {
    let vocab = c.size("vocab_size")?;
    let d = c.size("hidden_size")?;
    let layers = c.size("num_hidden_layers")?;
    let heads = c.size("num_attention_heads")?;
    let kv_heads = c.size_or("num_key_value_heads", Some(heads))?;
    let head_dim = c.size_or("head_dim", Some(d / heads))?;
    let ffn = c.size("intermediate_size")?;
    let eps = c.number_or("rms_norm_eps", 1e-6)?;
    let theta = c.number_or("rope_theta", 10000.0)?;
    let context = c.size_or("max_position_embeddings", Some(8192))?;
    let window = c.size("sliding_window")?;
    let scalar = c.number_or("query_pre_attn_scalar", head_dim as f64)?;
    let act = c.act(
        "hidden_activation",
        "gelu_pytorch_tanh",
        &["gelu_pytorch_tanh", "gelu"],
    )?;
    let gelu = if act == "gelu" { "gelu" } else { "gelu_tanh" };
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
        "attention_bias",
        |v| v == &Value::Bool(false),
        "Gemma's attention has no biases",
    )?;
    c.neutral(
        "tie_word_embeddings",
        |v| v == &Value::Bool(true),
        "Gemma's output is its embedding",
    )?;
    c.neutral(
        "attention_dropout",
        |v| v.as_f64() == Some(0.0),
        "dropout is not imported",
    )?;
    let attn_cap = softcap(c, "attn_logit_softcapping")?;
    let final_cap = softcap(c, "final_logit_softcapping")?;
    let cap = |x: &str, cap: Option<f64>| match cap {
        Some(v) => format!("tanh({x} * (1.0 / {v})) * {v}", v = number(v)),
        None => x.to_string(),
    };
    let (seq, _) = train_seq(c, context)?;
    let mut s = String::new();
    let _ = writeln!(
        s,
        "// {name}: imported from a Hugging Face config.json (model_type gemma2) by\n\
         // `dplc import hf`. Gemma 2's own blocks: attention whose heads are head_dim\n\
         // wide, its scores scaled by 1/sqrt({scalar}) and soft-capped, a sliding\n\
         // window of {window} keys on every other layer; RMSNorm scaled by 1 + w before\n\
         // and after the attention and the FFN; a GeLU-gated FFN; soft-capped logits.\n\n\
         block gemma_norm(x, d, eps) {{\n\
         \x20   param w: [d] = zeros\n\
         \x20   return rmsnorm(x, w + 1.0, eps)\n}}\n\n\
         block gemma2_attention(x, d, heads, kv_heads, head_dim, rope_theta, window) {{\n\
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
         \x20   scores = (q @ transpose(k, 2, 3)) * (1.0 / sqrt({scalar}))\n\
         \x20   scores = {capped}\n\
         \x20   if window > 0 {{\n\
         \x20       t = cast(positions(s), f32)\n\
         \x20       behind = reshape(t, [s, 1]) - reshape(t, [1, s])\n\
         \x20       scores = scores - ge(behind, window) * 1.0e30\n\
         \x20   }}\n\
         \x20   o = reshape(transpose(softmax(causal_mask(scores), -1) @ v, 1, 2), [b, s, heads * head_dim])\n\
         \x20   return o @ wo\n}}\n\n\
         block gemma_mlp(x, d, hidden) {{\n\
         \x20   param gate: [d, hidden]\n\
         \x20   param up: [d, hidden]\n\
         \x20   param down: [hidden, d]\n\
         \x20   return ({gelu}(x @ gate) * (x @ up)) @ down\n}}\n\n\
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
        pad = " ".repeat(7 + name.len()),
        theta = number(theta),
        eps = number(eps),
        scalar = number(scalar),
        capped = cap("scores", attn_cap),
        final_capped = cap("logits", final_cap),
    );
    s.push_str(&train_section(c, name, seq)?);
    Ok(s)
}

/// OPT (Zhang et al. 2022): GPT-2's layer with ReLU, learned positions read
/// two rows into their table (`OPTLearnedPositionalEmbedding`'s offset), the
/// output tied to the embedding. Only the pre-norm layout without a
/// projection (every OPT but 350M) is imported.
fn opt(c: &Config, name: &str) -> Result<String> {
    let vocab = c.size("vocab_size")?;
    let d = c.size("hidden_size")?;
    let layers = c.size("num_hidden_layers")?;
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
fn bloom(c: &Config, name: &str) -> Result<String> {
    let vocab = c.size("vocab_size")?;
    let d = c.size("hidden_size")?;
    let layers = c.size("n_layer")?;
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
