//! `dplc import hf CONFIG.json`: a Hugging Face `config.json` as a `.dpl`
//! model and train section (the families in `FAMILIES`). Every field that
//! shapes the model is read and checked; one whose value would change the
//! model into something the generated file does not say is an error naming
//! it, never ignored. Here: the command, the reading of the config's fields
//! and the train section; `llama`, `gemma` and `gpt` write the families.
//! Where a family differs from the standard blocks (Gemma's head width,
//! norm and gated GeLU) the file writes its own blocks from the builtins.

use miette::{miette, Result};
use serde_json::{Map, Value};
use std::fmt::Write;
use std::path::{Path, PathBuf};

mod gemma;
mod gpt;
mod llama;
use gemma::{gemma, gemma2};
use gpt::{bloom, gpt2, gpt_neox, opt, phi};
use llama::llama_like;

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
    let text = crate::load::read_text(config)
        .map_err(|e| miette!(code = "dplc::io", help = "check the path", "{e}"))?;
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
    // Architecture invariant: what `import` writes passes `dplc check`. The
    // fields are checked one by one above; this catches what no single field
    // says (sizes that together overflow the language's limits).
    if let Err(d) = dplc_frontend::parse("imported.dpl", &dpl).and_then(|unit| unit.check()) {
        return Err(miette!(
            code = "dplc::import",
            help = "the config's sizes are past what a .dpl model can hold; fix the fields, or write the model in .dpl (docs/language.md)",
            "{}: the model it describes does not check as .dpl: {d}",
            config.display()
        ));
    }
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
/// directory or stem, as a .dpl name: the grammar's (`dplc_frontend::is_name`),
/// so never a keyword. A given name must be one already; a derived one is
/// made one (other characters become `_`, a keyword gets `_model`).
fn model_name(given: Option<&str>, obj: &Map<String, Value>, file: &Path) -> Result<String> {
    if let Some(n) = given {
        if !dplc_frontend::is_name(n) {
            let help = if dplc_frontend::is_name(&format!("{n}_model")) {
                format!("`{n}` is a keyword of the .dpl language; choose another name, e.g. --name {n}_model")
            } else {
                "a .dpl name is letters, digits and _, not starting with a digit".to_string()
            };
            return Err(miette!(
                code = "dplc::input",
                help = help,
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
        .unwrap_or_else(|| "imported".into());
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
    if !dplc_frontend::is_name(&s) {
        s.push_str("_model");
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

    /// A layer count: a size the model's `repeat` can declare
    /// ([`dplc_frontend::MAX_REPEAT`]).
    fn layers(&self, key: &str) -> Result<u64> {
        let layers = self.size(key)?;
        let max = dplc_frontend::MAX_REPEAT as u64;
        if layers > max {
            return Err(self.err(
                key,
                format!("is {layers}: a .dpl `repeat` runs at most {max} layers"),
            ));
        }
        Ok(layers)
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
    // Qwen's configs switch their window on with `use_sliding_window`,
    // off unless given (Qwen2Config's default); Mistral's and Phi-3's have
    // no switch: a `sliding_window` slides.
    let qwen = c
        .get("model_type")
        .and_then(Value::as_str)
        .is_some_and(|t| t.starts_with("qwen"));
    let switched_off = match c.get("use_sliding_window") {
        Some(Value::Bool(on)) => !on,
        _ => qwen,
    };
    let sliding = if switched_off {
        None
    } else {
        match c.get("sliding_window") {
            None => None,
            Some(v) => Some(v.as_u64().filter(|&w| w > 0).ok_or_else(|| {
                c.err(
                    "sliding_window",
                    format!("is {v}, not a positive whole number"),
                )
            })?),
        }
    };
    // Qwen2's and Qwen3's window slides only the layers from
    // `max_window_layers` on (transformers' `layer_types`); dplc's layers
    // share one attention, so all or none of them slide.
    let sliding = match (sliding, c.get("max_window_layers")) {
        (Some(w), Some(v)) => {
            let from = v
                .as_u64()
                .ok_or_else(|| c.err("max_window_layers", format!("is {v}, not a whole number")))?;
            let layers = c.size("num_hidden_layers")?;
            match from {
                0 => Some(w),
                f if f >= layers => None,
                f => {
                    return Err(c.err(
                        "max_window_layers",
                        format!(
                            "is {f}: the sliding window covers only layers {f} to {} of {layers}, \
                             and dplc's layers share one attention; set it to 0 (every layer \
                             slides) or {layers} (none does)",
                            layers - 1
                        ),
                    ))
                }
            }
        }
        (sliding, _) => sliding,
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
