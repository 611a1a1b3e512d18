//! `dplc inspect`: what a model is, from the lowered graph — parameters by
//! block, layers, forward FLOPs per token and activations stored per layer.

use crate::{load, units};
use dplc_ir::{Analysis, Graph, Poly, SymId};
use miette::Result;
use serde_json::json;
use std::path::PathBuf;

#[derive(clap::Args)]
pub struct Args {
    /// The .dpl file.
    file: PathBuf,
    /// The model to inspect (needed when the file defines several).
    #[arg(long)]
    model: Option<String>,
    /// Sequence length for FLOPs and activations (default: the model's train section).
    #[arg(long)]
    seq: Option<u64>,
    /// Print a JSON object instead of the table.
    #[arg(long)]
    json: bool,
    /// Also print the textual IR.
    #[arg(long)]
    ir: bool,
}

/// The numbers `inspect` reports, evaluated at one sequence length.
struct Report {
    params: u128,
    params_by_block: Vec<(String, u128)>,
    layers: u64,
    seq: u64,
    flops_per_token: f64,
    attention_flops_per_token: f64,
    activation_bytes_per_layer_per_token: f64,
    activation_formula: String,
}

/// Bind `seq` to the sequence length and every other symbol (batch) to 1, so
/// that dividing by `seq` gives a per-token figure.
fn per_token(graph: &Graph, poly: &Poly, seq: u64) -> f64 {
    let seq_sym = graph.sym_by_name("seq");
    let bind = |s: SymId| if Some(s) == seq_sym { seq as f64 } else { 1.0 };
    let tokens = if seq_sym.is_some() { seq as f64 } else { 1.0 };
    // `+ 0.0` turns a −0 (no attention at all) into 0.
    poly.eval(&bind) / tokens + 0.0
}

fn report(graph: &Graph, seq: u64, precision: dplc_ir::Precision) -> Report {
    let an = Analysis::new(graph);
    let activations = an
        .layer_body()
        .map(|body| an.activations(body).bytes(precision))
        .unwrap_or_default();
    let report = Report {
        params: graph.param_count(),
        params_by_block: an.params_by_block(),
        layers: an.layers(),
        seq,
        flops_per_token: per_token(graph, &an.forward_flops(), seq),
        attention_flops_per_token: per_token(graph, &an.attention_flops(), seq),
        activation_bytes_per_layer_per_token: per_token(graph, &activations, seq),
        activation_formula: activations.display(graph.sym_names()).to_string(),
    };
    report
}

pub fn run(args: &Args) -> Result<()> {
    let unit = load::parse(&args.file)?;
    let name = load::choose_model(&unit, &args.file, args.model.as_deref())?;
    let lowered = unit.lower(&name)?;
    let train = &lowered.train;
    let seq = args.seq.unwrap_or(train.seq);
    let flag = if args.seq.is_some() {
        "--seq"
    } else {
        "the train section's seq"
    };
    dplc_ir::validate::seq(seq)
        .and_then(|()| dplc_ir::validate::fits_context(seq, &lowered.graph))
        .map_err(|why| {
            miette::miette!(
                code = "dplc::input",
                help = "pass a positive --seq the model can read",
                "{flag} {seq}: {why}"
            )
        })?;
    if let Some(dim) = lowered.graph.unbound_dims().first() {
        return Err(miette::miette!(
            code = "dplc::model",
            "{}",
            dplc_planner::unbound_dim_message(dim)
        ));
    }
    let r = report(&lowered.graph, seq, train.precision);
    if args.json {
        let by_block: serde_json::Map<String, serde_json::Value> = r
            .params_by_block
            .iter()
            .map(|(k, v)| (k.clone(), json!(*v as u64)))
            .collect();
        let obj = json!({
            "model": name,
            "file": args.file.display().to_string(),
            "arguments": lowered.args.iter().map(|(k, v)| (k.clone(), json!(v))).collect::<serde_json::Map<_, _>>(),
            "params": r.params as u64,
            "params_by_block": by_block,
            "layers": r.layers,
            "seq": r.seq,
            "precision": train.precision.name(),
            "flops_per_token_forward": r.flops_per_token,
            "attention_flops_per_token_forward": r.attention_flops_per_token,
            "activation_bytes_per_layer": r.activation_bytes_per_layer_per_token,
            "activation_bytes_per_layer_formula": r.activation_formula,
        });
        outln!(
            "{}",
            serde_json::to_string_pretty(&obj).expect("JSON values serialise")
        );
        return Ok(());
    }
    let args_line: Vec<String> = lowered
        .args
        .iter()
        .map(|(k, v)| format!("{k}={v}"))
        .collect();
    outln!("model {name}  ({})", args.file.display());
    outln!("  arguments        {}", args_line.join(" "));
    outln!(
        "  parameters       {} ({})",
        units::thousands(r.params),
        units::si(r.params as f64).trim()
    );
    outln!("  layers           {}", r.layers);
    // A model without a sequence (an image classifier) has no `seq` to train at.
    let seq = match lowered.graph.sym_by_name("seq") {
        Some(_) => format!("seq {}, ", train.seq),
        None => String::new(),
    };
    outln!(
        "  training         {seq}global batch {}, {}",
        train.global_batch,
        train.precision.name()
    );
    outln!();
    outln!("  parameters by block");
    let width = r
        .params_by_block
        .iter()
        .map(|(k, _)| k.len())
        .max()
        .unwrap_or(0);
    for (block, n) in &r.params_by_block {
        let share = 100.0 * *n as f64 / r.params.max(1) as f64;
        outln!(
            "    {block:<width$}  {:>18}  {share:5.1}%",
            units::thousands(*n)
        );
    }
    outln!();
    // A model without a sequence (an image classifier) counts per sample.
    if lowered.graph.sym_by_name("seq").is_some() {
        outln!("  per token, at seq {}", r.seq);
    } else {
        outln!("  per sample");
    }
    outln!(
        "    forward FLOPs                 {}FLOP  (attention {}FLOP)",
        units::si(r.flops_per_token),
        units::si(r.attention_flops_per_token)
    );
    outln!(
        "    activations stored per layer  {}  ({})",
        units::bytes(r.activation_bytes_per_layer_per_token),
        train.precision.name()
    );
    outln!(
        "    per layer, batch × seq        {} bytes",
        r.activation_formula
    );
    if args.ir {
        outln!();
        out!("{}", dplc_ir::print_graph(&lowered.graph));
    }
    Ok(())
}
