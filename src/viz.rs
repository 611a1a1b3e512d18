//! `dplc viz`: a plan as a Chrome trace (Perfetto, chrome://tracing), as
//! Graphviz of one layer's sharded program, or as one self-contained HTML page;
//! or the loss curves of `dplc run --json` outputs side by side (`--runs`).

use crate::compile::read_plan;
use dplc_ir::{AxisPart, Plan, RegionProgram};
use dplc_planner::{timeline, SpanKind};
use miette::{miette, Result};
use serde_json::json;
use std::fmt::Write as _;
use std::path::PathBuf;

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Format {
    /// Chrome trace-event JSON: one track per pipeline stage of one replica.
    Trace,
    /// Graphviz of the layer's per-rank program, collectives highlighted.
    Dot,
    /// One self-contained page: summary, pipeline timeline, memory, sharding.
    Html,
}

#[derive(clap::Args)]
pub struct Args {
    /// A plan written by `dplc compile -o`.
    #[arg(required_unless_present = "runs")]
    plan: Option<PathBuf>,
    /// Instead of a plan: the outputs of `dplc run --json` (one file per
    /// run), drawn as loss curves side by side on one HTML page, with each
    /// run's synchronisation, compression and final loss.
    #[arg(long, num_args = 1.., conflicts_with = "plan")]
    runs: Vec<PathBuf>,
    #[arg(long, value_enum, default_value = "html")]
    format: Format,
    /// Write here instead of standard output.
    #[arg(short, long)]
    output: Option<PathBuf>,
    /// Report errors as a JSON object on stdout (for scripts).
    #[arg(long)]
    json: bool,
}

pub fn run(args: &Args) -> Result<()> {
    let Some(plan_path) = &args.plan else {
        let runs = args
            .runs
            .iter()
            .map(|p| read_run(p))
            .collect::<Result<Vec<_>>>()?;
        let text = loss_curves(&runs);
        let inputs: Vec<&std::path::Path> = args.runs.iter().map(|p| p.as_path()).collect();
        return match &args.output {
            Some(path) => crate::output::write(path, text.as_bytes(), &inputs),
            None => {
                outln!("{text}");
                Ok(())
            }
        };
    };
    let plan = read_plan(plan_path)?;
    let text = match args.format {
        Format::Trace => serde_json::to_string(&trace(&plan)).expect("JSON values serialise"),
        Format::Dot => dot(&plan)?,
        Format::Html => html(&plan),
    };
    match &args.output {
        Some(path) => crate::output::write(path, text.as_bytes(), &[plan_path.as_path()]),
        None => {
            outln!("{text}");
            Ok(())
        }
    }
}

/// The Chrome trace of the plan's simulated step (times in microseconds).
pub fn trace(plan: &Plan) -> serde_json::Value {
    let t = timeline(plan);
    let mut events = Vec::new();
    events.push(json!({
        "name": "process_name", "ph": "M", "pid": 0, "tid": 0,
        "args": {"name": format!("{} on {} (data-parallel replica 0 of {})",
            plan.model, plan.cluster.name, plan.mesh.dp)},
    }));
    for st in 0..t.stages {
        events.push(json!({
            "name": "thread_name", "ph": "M", "pid": 0, "tid": st,
            "args": {"name": format!("stage {st}")},
        }));
    }
    for s in &t.spans {
        let name = match s.kind {
            SpanKind::Forward | SpanKind::Backward if plan.strategy.virtual_stages > 1 => {
                format!("{} mb{} c{}", s.kind.name(), s.micro_batch, s.chunk)
            }
            SpanKind::Forward | SpanKind::Backward => {
                format!("{} mb{}", s.kind.name(), s.micro_batch)
            }
            _ => s.kind.name().to_string(),
        };
        events.push(json!({
            "name": name,
            "cat": s.kind.name(),
            "ph": "X",
            "ts": s.start_s * 1e6,
            "dur": s.duration_s * 1e6,
            "pid": 0,
            "tid": s.stage,
            "args": {"micro_batch": s.micro_batch, "chunk": s.chunk, "send_us": s.send_s * 1e6},
        }));
    }
    json!({
        "traceEvents": events,
        "displayTimeUnit": "ms",
        "otherData": {
            "model": plan.model,
            "cluster": plan.cluster.name,
            "predicted_step_time_s": plan.estimate.step_time_s,
            "makespan_s": t.makespan_s,
            "note": format!(
                "every pipeline stage of one data-parallel replica; the other {} replicas run the same schedule",
                plan.mesh.dp.saturating_sub(1)
            ),
        },
    })
}

/// The Chrome trace of a real run (`dplc run --trace`): one track per rank,
/// in the same format as the plan's simulated trace, so the two open side by
/// side in Perfetto.
pub fn measured_trace(plan: &Plan, spans: &[dplc_runtime::TraceSpan]) -> serde_json::Value {
    let mut events = vec![json!({
        "name": "process_name", "ph": "M", "pid": 1, "tid": 0,
        "args": {"name": format!("{} on {} (measured)", plan.model, plan.cluster.name)},
    })];
    let mut ranks: Vec<&dplc_runtime::TraceSpan> = spans.iter().collect();
    ranks.sort_by_key(|s| s.rank);
    ranks.dedup_by_key(|s| s.rank);
    for s in ranks {
        events.push(json!({
            "name": "thread_name", "ph": "M", "pid": 1, "tid": s.rank,
            "args": {"name": format!("rank {} (stage {}, dp {}, tp {})",
                s.rank, s.stage, s.dp_index, s.tp_index)},
        }));
    }
    for s in spans {
        let name = match s.kind {
            "step" => format!("step {} sync + optimizer", s.step),
            kind if plan.strategy.virtual_stages > 1 => {
                format!("{kind} mb{} c{}", s.micro_batch, s.chunk)
            }
            kind => format!("{kind} mb{}", s.micro_batch),
        };
        events.push(json!({
            "name": name,
            "cat": s.kind,
            "ph": "X",
            "ts": s.start_us,
            "dur": s.duration_us,
            "pid": 1,
            "tid": s.rank,
            "args": {"step": s.step, "micro_batch": s.micro_batch, "chunk": s.chunk},
        }));
    }
    json!({
        "traceEvents": events,
        "displayTimeUnit": "ms",
        "otherData": {
            "model": plan.model,
            "cluster": plan.cluster.name,
            "predicted_step_time_s": plan.estimate.step_time_s,
        },
    })
}

fn layout_text(layout: &[(dplc_ir::MeshAxis, AxisPart)]) -> String {
    if layout.is_empty() {
        return "replicated".into();
    }
    layout
        .iter()
        .map(|(axis, part)| match part {
            AxisPart::Shard(d) => format!("{}:shard({d})", axis.name()),
            AxisPart::Partial => format!("{}:partial", axis.name()),
        })
        .collect::<Vec<_>>()
        .join(" ")
}

fn escape(s: &str) -> String {
    s.replace('\\', "\\\\").replace('"', "\\\"")
}

/// Graphviz of the layer's per-rank program: a model with several layer
/// stacks (an encoder and a decoder) draws each as a cluster of its own.
pub fn dot(plan: &Plan) -> Result<String> {
    let layers: Vec<&RegionProgram> = plan
        .programs
        .iter()
        .filter(|p| p.region != "model")
        .collect();
    match layers.as_slice() {
        [] => Err(miette!(
            help =
                "pin a tensor-parallel degree, e.g. `dplc compile … --strategy tp=2 -o plan.ron`",
            "the plan splits no layer (tp = ep = 1): it has no sharded program to draw"
        )),
        [one] => {
            let mut s = String::new();
            let _ = writeln!(s, "digraph layer {{");
            let _ = writeln!(
                s,
                "  label=\"{} layer at {}\"; labelloc=t; rankdir=TB;",
                escape(&plan.model),
                degrees(one)
            );
            dot_program(&mut s, one, "", "  ");
            let _ = writeln!(s, "}}");
            Ok(s)
        }
        many => {
            let mut s = String::new();
            let _ = writeln!(s, "digraph layers {{");
            let _ = writeln!(
                s,
                "  label=\"{} layer stacks\"; labelloc=t; rankdir=TB;",
                escape(&plan.model)
            );
            for prog in many {
                let _ = writeln!(s, "  subgraph cluster_{} {{", prog.region);
                let _ = writeln!(
                    s,
                    "    label=\"{} at {}\";",
                    escape(&prog.region),
                    degrees(prog)
                );
                dot_program(&mut s, prog, &format!("{}_", prog.region), "    ");
                let _ = writeln!(s, "  }}");
            }
            let _ = writeln!(s, "}}");
            Ok(s)
        }
    }
}

fn degrees(prog: &RegionProgram) -> String {
    format!(
        "tp {} ep {} sp {}",
        prog.tp,
        prog.ep,
        if prog.sequence_parallel { "on" } else { "off" }
    )
}

/// `prog`'s nodes and edges, each name prefixed (`prefix`) so that several
/// programs share one graph, each line indented by `pad`.
fn dot_program(s: &mut String, prog: &RegionProgram, prefix: &str, pad: &str) {
    let _ = writeln!(s, "{pad}node [shape=box, fontname=monospace, fontsize=10];");
    for v in &prog.values {
        let op = v.expr.trim_start_matches('(');
        let op = op.split([' ', ')']).next().unwrap_or("");
        let style = match (v.collective, v.layout.is_empty()) {
            (Some(_), _) => "style=filled, fillcolor=\"#f4a261\", penwidth=2",
            (None, false) => "style=filled, fillcolor=\"#a8dadc\"",
            (None, true) => "style=filled, fillcolor=\"#f1faee\"",
        };
        let _ = writeln!(
            s,
            "{pad}{prefix}{} [label=\"{} = {}\\n{}\\n{}\", {style}];",
            v.name,
            v.name,
            escape(op),
            escape(&v.shape),
            escape(&layout_text(&v.layout))
        );
        for i in &v.inputs {
            let _ = writeln!(s, "{pad}{prefix}{i} -> {prefix}{};", v.name);
        }
    }
    for (i, b) in prog.backward.iter().enumerate() {
        let _ = writeln!(
            s,
            "{pad}{prefix}bwd{i} [label=\"backward {} {}\\nof {}\", shape=note, style=filled, fillcolor=\"#e76f51\"];",
            b.kind.name(),
            b.axis.name(),
            escape(&b.of)
        );
        let _ = writeln!(s, "{pad}{prefix}{} -> {prefix}bwd{i} [style=dashed];", b.of);
    }
}

/// One run's curve, read from what `dplc run --json` printed.
pub struct RunCurve {
    pub label: String,
    pub losses: Vec<f64>,
}

/// Read a `dplc run --json` output: its summary line carries the losses.
fn read_run(path: &std::path::Path) -> Result<RunCurve> {
    // A run's JSON lines grow with its steps: a larger bound than a plan's.
    let bytes = crate::load::read_capped(path, 16 * crate::load::TEXT_LIMIT)?;
    let text = String::from_utf8_lossy(&bytes);
    let summary = text
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .find(|v| v["summary"] == json!(true) && v["losses"].is_array())
        .ok_or_else(|| {
            miette!(
                code = "dplc::input",
                help = "save what `dplc run … --json > run.json` prints, one file per run",
                "{} holds no `dplc run --json` summary with losses",
                path.display()
            )
        })?;
    let losses: Vec<f64> = summary["losses"]
        .as_array()
        .map(|a| a.iter().filter_map(|x| x.as_f64()).collect())
        .unwrap_or_default();
    let name = path
        .file_stem()
        .map_or_else(String::new, |s| s.to_string_lossy().into_owned());
    let label = format!(
        "{name}: {} compress={}",
        summary["sync"].as_str().unwrap_or("sync=allreduce"),
        summary["compress"].as_str().unwrap_or("none")
    );
    Ok(RunCurve { label, losses })
}

/// Loss curves side by side: one SVG polyline per run over the same axes,
/// and a table of each run's final loss beside the first run's.
pub fn loss_curves(runs: &[RunCurve]) -> String {
    const COLOURS: [&str; 8] = [
        "#1d3557", "#e63946", "#2a9d8f", "#f4a261", "#6a4c93", "#8ab17d", "#264653", "#b5838d",
    ];
    let (w, h, left, bottom) = (900.0, 420.0, 60.0, 30.0);
    let finite = runs
        .iter()
        .flat_map(|r| r.losses.iter().copied())
        .filter(|x| x.is_finite());
    let (lo, hi) = finite.fold((f64::INFINITY, f64::NEG_INFINITY), |(a, b), x| {
        (a.min(x), b.max(x))
    });
    let (lo, hi) = if lo.is_finite() && hi > lo {
        (lo, hi)
    } else {
        (0.0, 1.0)
    };
    let steps = runs
        .iter()
        .map(|r| r.losses.len())
        .max()
        .unwrap_or(1)
        .max(2);
    let x = |i: usize| left + (w - left - 10.0) * i as f64 / (steps - 1) as f64;
    let y = |l: f64| 10.0 + (h - bottom - 10.0) * (hi - l) / (hi - lo);
    let mut s = String::from(
        "<!DOCTYPE html><html lang=\"en\"><head><meta charset=\"utf-8\"><title>dplc runs: loss</title>\
         <style>body{font-family:sans-serif;margin:24px;color:#1d3557}table{border-collapse:collapse}\
         td,th{border:1px solid #ccd;padding:3px 8px;text-align:right}</style></head><body>\
         <h1>Loss by step</h1>",
    );
    let _ = write!(
        s,
        "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{w}\" height=\"{h}\" role=\"img\" aria-label=\"loss curves\">\
         <line x1=\"{left}\" y1=\"{}\" x2=\"{}\" y2=\"{}\" stroke=\"#888\"/>\
         <line x1=\"{left}\" y1=\"10\" x2=\"{left}\" y2=\"{}\" stroke=\"#888\"/>\
         <text x=\"4\" y=\"16\" font-size=\"11\">{hi:.3}</text>\
         <text x=\"4\" y=\"{}\" font-size=\"11\">{lo:.3}</text>\
         <text x=\"{}\" y=\"{}\" font-size=\"11\">step {}</text>",
        h - bottom,
        w - 10.0,
        h - bottom,
        h - bottom,
        h - bottom,
        w - 80.0,
        h - 8.0,
        steps - 1
    );
    for (i, r) in runs.iter().enumerate() {
        let points: Vec<String> = r
            .losses
            .iter()
            .enumerate()
            .filter(|(_, l)| l.is_finite())
            .map(|(j, &l)| format!("{:.1},{:.1}", x(j), y(l)))
            .collect();
        let _ = write!(
            s,
            "<polyline fill=\"none\" stroke=\"{}\" stroke-width=\"1.5\" points=\"{}\"><title>{}</title></polyline>",
            COLOURS[i % COLOURS.len()],
            points.join(" "),
            html_escape(&r.label)
        );
    }
    s.push_str(
        "</svg><table><tr><th>run</th><th>steps</th><th>final loss</th><th>vs first run</th></tr>",
    );
    let base = runs.first().and_then(|r| r.losses.last().copied());
    for (i, r) in runs.iter().enumerate() {
        let last = r.losses.last().copied().unwrap_or(f64::NAN);
        let vs = match base {
            Some(b) if b.abs() > 0.0 => format!("{:+.2}%", 100.0 * (last / b - 1.0)),
            _ => String::new(),
        };
        let _ = write!(
            s,
            "<tr><td style=\"text-align:left;color:{}\">{}</td><td>{}</td><td>{last:.4}</td><td>{vs}</td></tr>",
            COLOURS[i % COLOURS.len()],
            html_escape(&r.label),
            r.losses.len()
        );
    }
    s.push_str("</table></body></html>");
    s
}

fn html_escape(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;")
}

const GIB: f64 = (1u64 << 30) as f64;

/// The pipeline timeline as SVG: one row per stage, forwards blue, backwards green.
fn timeline_svg(plan: &Plan) -> String {
    let t = timeline(plan);
    let (w, row, left) = (1000.0, 22.0, 70.0);
    let h = row * t.stages as f64 + 30.0;
    let scale = (w - left - 10.0) / t.makespan_s.max(1e-12);
    let mut s = format!(
        "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{w}\" height=\"{h}\" role=\"img\" aria-label=\"pipeline timeline\">"
    );
    // Thousands of micro-batches would make the page heavy: spans narrower
    // than a pixel merge into their neighbours.
    let mut last_end: Vec<(f64, SpanKind)> = vec![(-1.0, SpanKind::Forward); t.stages as usize];
    for st in 0..t.stages {
        let y = 10.0 + row * st as f64;
        let _ = write!(
            s,
            "<text x=\"4\" y=\"{}\" font-size=\"12\" font-family=\"sans-serif\">stage {st}</text>",
            y + 14.0
        );
    }
    for span in &t.spans {
        let x = left + span.start_s * scale;
        let width = (span.duration_s * scale).max(0.5);
        let slot = &mut last_end[span.stage as usize];
        if x + width < slot.0 + 1.0 && slot.1 == span.kind {
            continue;
        }
        *slot = (x + width, span.kind);
        let color = match span.kind {
            SpanKind::Forward => "#457b9d",
            SpanKind::Backward => "#2a9d8f",
            SpanKind::GradientSync => "#e76f51",
            SpanKind::Optimizer => "#e9c46a",
        };
        let y = 10.0 + row * span.stage as f64;
        let _ = write!(
            s,
            "<rect x=\"{x:.2}\" y=\"{y:.1}\" width=\"{width:.2}\" height=\"{:.1}\" fill=\"{color}\"><title>{} mb{} chunk {}: {:.3} ms</title></rect>",
            row - 4.0,
            span.kind.name(),
            span.micro_batch,
            span.chunk,
            span.duration_s * 1e3
        );
    }
    let _ = write!(
        s,
        "<text x=\"{left}\" y=\"{}\" font-size=\"11\" font-family=\"sans-serif\">0 s — {:.3} s (predicted step {:.3} s)</text></svg>",
        h - 4.0,
        t.makespan_s,
        plan.estimate.step_time_s
    );
    s
}

/// Memory per stage against the device's capacity, as stacked SVG bars.
fn memory_svg(plan: &Plan) -> String {
    let cap = plan.cluster.memory_bytes as f64;
    let max = plan
        .stages
        .iter()
        .map(|s| s.memory.total() as f64)
        .fold(cap, f64::max);
    let (w, row, left) = (1000.0, 20.0, 70.0);
    let h = row * plan.stages.len() as f64 + 40.0;
    let scale = (w - left - 10.0) / max.max(1.0);
    let mut s = format!(
        "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{w}\" height=\"{h}\" role=\"img\" aria-label=\"memory per stage\">"
    );
    let kinds = [
        ("weights", "#457b9d"),
        ("gradients", "#a8dadc"),
        ("optimizer", "#1d3557"),
        ("activations", "#2a9d8f"),
        ("embedding and loss", "#e9c46a"),
        ("buffers", "#f4a261"),
    ];
    for st in &plan.stages {
        let m = &st.memory;
        let y = 10.0 + row * st.stage as f64;
        let _ = write!(
            s,
            "<text x=\"4\" y=\"{}\" font-size=\"12\" font-family=\"sans-serif\">stage {}</text>",
            y + 13.0,
            st.stage
        );
        let mut x = left;
        for ((name, color), bytes) in kinds.iter().zip([
            m.weights,
            m.gradients,
            m.optimizer,
            m.activations,
            m.embedding_and_loss,
            m.buffers,
        ]) {
            let width = bytes as f64 * scale;
            let _ = write!(
                s,
                "<rect x=\"{x:.2}\" y=\"{y:.1}\" width=\"{width:.2}\" height=\"{:.1}\" fill=\"{color}\"><title>{name}: {:.2} GiB</title></rect>",
                row - 4.0,
                bytes as f64 / GIB
            );
            x += width;
        }
    }
    let cx = left + cap * scale;
    let _ = write!(
        s,
        "<line x1=\"{cx:.1}\" y1=\"5\" x2=\"{cx:.1}\" y2=\"{:.1}\" stroke=\"#d62828\" stroke-width=\"2\"/><text x=\"{:.1}\" y=\"{:.1}\" font-size=\"11\" font-family=\"sans-serif\" fill=\"#d62828\">capacity {:.1} GiB</text></svg>",
        h - 25.0,
        (cx - 90.0).max(left),
        h - 10.0,
        cap / GIB
    );
    s
}

/// One self-contained page: no network, no scripts.
pub fn html(plan: &Plan) -> String {
    let e = &plan.estimate;
    let st = &plan.strategy;
    let mut s = String::new();
    let _ = write!(
        s,
        "<!DOCTYPE html><html lang=\"en\"><head><meta charset=\"utf-8\"><title>dplc plan: {model}</title>\
         <style>body{{font-family:sans-serif;margin:24px;color:#1d3557}}table{{border-collapse:collapse;margin:8px 0}}\
         td,th{{border:1px solid #ccc;padding:3px 8px;text-align:right}}th{{background:#f1faee}}td.l,th.l{{text-align:left}}\
         h2{{margin-top:28px}}</style></head><body>",
        model = html_escape(&plan.model)
    );
    let _ = write!(
        s,
        "<h1>{} on {}</h1><p>{}; {}</p>",
        html_escape(&plan.model),
        html_escape(&plan.cluster.name),
        plan.mesh,
        st
    );
    let b = &e.breakdown;
    let _ = write!(
        s,
        "<h2>Step</h2><table><tr><th class=l>step time</th><td>{:.3} s</td></tr>\
         <tr><th class=l>compute (recompute)</th><td>{:.3} s ({:.3} s)</td></tr>\
         <tr><th class=l>exposed tp/cp/ep communication</th><td>{:.3} s</td></tr>\
         <tr><th class=l>pipeline send/recv</th><td>{:.3} s</td></tr>\
         <tr><th class=l>pipeline bubble</th><td>{:.3} s</td></tr>\
         <tr><th class=l>exposed data-parallel communication</th><td>{:.3} s</td></tr>\
         <tr><th class=l>optimizer</th><td>{:.3} s</td></tr>\
         <tr><th class=l>tokens/s</th><td>{:.0}</td></tr>\
         <tr><th class=l>model / hardware TFLOP/s per GPU</th><td>{:.1} / {:.1}</td></tr>\
         <tr><th class=l>MFU</th><td>{:.1}%</td></tr></table>",
        e.step_time_s,
        b.compute_s,
        b.recompute_s,
        b.exposed_comm_s,
        b.pipeline_p2p_s,
        b.bubble_s,
        b.exposed_dp_comm_s,
        b.optimizer_s,
        e.tokens_per_s,
        e.model_tflops_per_gpu,
        e.hardware_tflops_per_gpu,
        e.mfu * 100.0
    );
    let _ = write!(
        s,
        "<h2>Pipeline timeline (one data-parallel replica)</h2>{}",
        timeline_svg(plan)
    );
    let _ = write!(s, "<h2>Memory per rank by stage</h2>{}", memory_svg(plan));
    s.push_str("<h2>Sharding</h2><table><tr><th class=l>parameter</th><th>elements</th><th class=l>split</th></tr>");
    for p in &plan.param_sharding {
        let split = if p.splits.is_empty() {
            "replicated".to_string()
        } else {
            p.splits
                .iter()
                .map(|(a, d)| format!("{} on dim {d}", a.name()))
                .collect::<Vec<_>>()
                .join(", ")
        };
        let _ = write!(
            s,
            "<tr><td class=l>{}</td><td>{}</td><td class=l>{}</td></tr>",
            html_escape(&p.name),
            p.elements,
            html_escape(&split)
        );
    }
    s.push_str("</table><h2>Collectives per step</h2><table><tr><th class=l>kind</th><th class=l>axis</th><th class=l>what</th><th>bytes</th><th class=l>phase</th><th>count</th><th>time each</th></tr>");
    for c in &plan.collectives {
        let _ = write!(
            s,
            "<tr><td class=l>{}</td><td class=l>{}</td><td class=l>{}</td><td>{}</td><td class=l>{}</td><td>{}</td><td>{:.3} ms</td></tr>",
            c.kind.name(),
            c.axis.name(),
            html_escape(&c.what),
            c.bytes,
            c.phase.name(),
            c.count_per_step,
            c.time_s * 1e3
        );
    }
    s.push_str("</table></body></html>\n");
    s
}
