//! `dplc explain`: why a plan looks the way it does — the mesh on the
//! hardware, memory by kind per stage, where the step's time goes, every
//! collective, the runners-up and what-if neighbours — from the plan file alone.

use crate::compile::read_plan;
use dplc_ir::{AttentionKind, LinkLevel, MeshAxis, Plan};
use miette::Result;
use serde_json::json;
use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::PathBuf;

#[derive(clap::Args)]
pub struct Args {
    /// A plan written by `dplc compile -o`.
    plan: PathBuf,
    /// Print a JSON object instead of the tables.
    #[arg(long)]
    json: bool,
}

const GIB: f64 = (1u64 << 30) as f64;

fn gib(b: u64) -> String {
    format!("{:.2}", b as f64 / GIB)
}

fn link(l: LinkLevel) -> &'static str {
    match l {
        LinkLevel::IntraNode => "intra-node",
        LinkLevel::InterNode => "inter-node",
        LinkLevel::None => "-",
    }
}

fn axis_size(plan: &Plan, axis: MeshAxis) -> u64 {
    plan.mesh
        .axes
        .iter()
        .find(|a| a.axis == axis)
        .map_or(1, |a| a.size)
}

/// The link an axis's communication crosses: the one its collectives
/// record (the gradient reduction spans the context-parallel ranks too),
/// else the mesh axis's own.
fn comm_link(plan: &Plan, axis: MeshAxis) -> LinkLevel {
    plan.collectives
        .iter()
        .filter(|c| c.axis == axis)
        .find_map(|c| c.group.map(|(_, level)| level))
        .unwrap_or_else(|| axis_link(plan, axis))
}

fn axis_link(plan: &Plan, axis: MeshAxis) -> LinkLevel {
    plan.mesh
        .axes
        .iter()
        .find(|a| a.axis == axis)
        .map_or(LinkLevel::None, |a| a.link)
}

/// One axis's communication per step: seconds before overlap and bytes,
/// summed over the collectives' calls, and the exposed and hidden seconds
/// the planner priced (absent in plans written before it recorded them).
#[derive(Default)]
struct AxisTotals {
    seconds: f64,
    bytes: u64,
    exposed_hidden: Option<(f64, f64)>,
}

fn comm_by_axis(plan: &Plan) -> BTreeMap<MeshAxis, AxisTotals> {
    let mut out: BTreeMap<MeshAxis, AxisTotals> = BTreeMap::new();
    for c in &plan.collectives {
        let e = out.entry(c.axis).or_default();
        e.seconds += c.time_s * c.count_per_step as f64;
        e.bytes += c.bytes * c.count_per_step;
    }
    for a in &plan.estimate.breakdown.comm_by_axis {
        out.entry(a.axis).or_default().exposed_hidden = Some((a.exposed_s, a.hidden_s));
    }
    out
}

fn attention_note(kind: AttentionKind) -> &'static str {
    match kind {
        AttentionKind::Fused => {
            "one kernel for the core, FlashAttention-3 where the device has it and the attention no dropout, else FlashAttention-2: no score matrix stored"
        }
        AttentionKind::Flash2 => {
            "one kernel for the core at FlashAttention-2's rate: no score matrix stored"
        }
        AttentionKind::Flash1 => {
            "one kernel for the core at FlashAttention (v1)'s rate, half FlashAttention-2's: no score matrix stored"
        }
        AttentionKind::Unfused => "scores, mask, softmax and dropout op by op, scores stored",
    }
}

pub fn render(plan: &Plan) -> String {
    let mut s = String::new();
    let cl = &plan.cluster;
    let _ = writeln!(
        s,
        "{} ({} parameters, {} layers) on {}: {} node{} × {} {}",
        plan.model,
        plan.params,
        plan.layers,
        cl.name,
        cl.nodes,
        if cl.nodes == 1 { "" } else { "s" },
        cl.devices_per_node,
        cl.device
    );
    let _ = writeln!(s, "strategy: {}", plan.strategy);
    for d in &plan.search.skipped {
        let _ = writeln!(s, "not searched: tp {} × ep {}: {}", d.tp, d.ep, d.reason);
    }
    let _ = writeln!(
        s,
        "attention: {} ({})",
        plan.strategy.attention.name(),
        attention_note(plan.strategy.attention)
    );
    if !plan.strategy.offload.is_none() {
        let host = plan
            .stages
            .iter()
            .map(|st| st.memory.host)
            .max()
            .unwrap_or(0);
        let b = &plan.estimate.breakdown;
        let _ = writeln!(
            s,
            "offload: {}: {} GiB per rank in host memory; host-link traffic {} GiB per step, {:.3} s of it exposed",
            plan.strategy.offload.name(),
            gib(host),
            gib(b.offload_bytes),
            b.offload_s
        );
    }

    let _ = writeln!(
        s,
        "\nmesh: how the axes map onto the hardware (innermost first)"
    );
    let _ = writeln!(
        s,
        "  axis   size  stride  ranks of a group            link         GB/s per device"
    );
    for a in plan.mesh.axes.iter().filter(|a| a.size > 1) {
        let last = a.stride * (a.size - 1);
        let members = match a.size {
            2 => format!("0, {last}"),
            3 => format!("0, {}, {last}", a.stride),
            _ => format!("0, {}, …, {last}", a.stride),
        };
        let _ = writeln!(
            s,
            "  {:<5} {:>5}  {:>6}  {:<27} {:<12} {:>8.1}",
            a.axis.name(),
            a.size,
            a.stride,
            members,
            link(a.link),
            a.bandwidth_bytes_per_s / 1e9
        );
    }

    let _ = writeln!(
        s,
        "\nmemory per rank by stage, GiB (capacity {})",
        gib(cl.memory_bytes)
    );
    let all: Vec<u64> = plan.stages.iter().map(|st| st.stage).collect();
    s.push_str(&dplc_planner::memory_table(plan, &all, "  "));
    let e = &plan.estimate;
    let b = &e.breakdown;
    let _ = writeln!(s, "\nstep time {:.3} s", e.step_time_s);
    let share = |x: f64| 100.0 * x / e.step_time_s.max(1e-12);
    for (what, t) in [
        (
            "compute (forward and backward)",
            b.compute_s - b.recompute_s,
        ),
        ("recomputation", b.recompute_s),
        ("exposed tp/cp/ep communication", b.exposed_comm_s),
        ("pipeline send/recv", b.pipeline_p2p_s),
        ("pipeline bubble", b.bubble_s),
        ("exposed data-parallel communication", b.exposed_dp_comm_s),
        ("optimizer step", b.optimizer_s),
        ("compute slowed by overlapped comm", b.overlap_slowdown_s),
        ("exposed host-link traffic (offload)", b.offload_s),
    ] {
        if t == 0.0 && (what.contains("offload") || what.contains("slowed")) {
            continue;
        }
        let _ = writeln!(s, "  {what:<38} {t:>9.3} s  {:>5.1}%", share(t));
    }
    if b.overlapped_comm_s > 0.0 {
        // Plans written before the slowdown was priced hid it for free.
        let slows = if b.overlap_slowdown_s > 0.0 {
            format!(
                "in the step only as the {:.3} s it slows compute",
                dplc_planner::overlap_slowdown(b.overlapped_comm_s)
            )
        } else {
            "not in the step".to_string()
        };
        let _ = writeln!(
            s,
            "  (tp communication hidden behind GEMMs, tp overlap {}: {:.3} s, {slows})",
            plan.strategy.tp_overlap.name(),
            b.overlapped_comm_s
        );
    }
    let _ = writeln!(
        s,
        "  {}; model {:.1} TFLOP/s per GPU, hardware {:.1}; MFU {:.1}%",
        match e.samples_per_s {
            Some(samples) => format!("{} samples/s", samples.round()),
            None => format!("{} tokens/s", e.tokens_per_s.round()),
        },
        e.model_tflops_per_gpu,
        e.hardware_tflops_per_gpu,
        e.mfu * 100.0
    );
    if e.masked_attention_flops_per_step > 0.0 && e.model_flops_per_step > 0.0 {
        // Logs that count attention over every query-key pair read higher:
        // say by how much, so the two compare.
        let every_pair = 1.0 + e.masked_attention_flops_per_step / e.model_flops_per_step;
        let _ = writeln!(
            s,
            "  (model FLOPs count the attention pairs the masks keep, as Megatron-LM from \
             core_v0.16.0;\n  over every pair, as PaLM, torchtitan and earlier Megatron-LM count: \
             {:.1} TFLOP/s per GPU, MFU {:.1}%)",
            e.model_tflops_per_gpu * every_pair,
            e.mfu * every_pair * 100.0
        );
    }
    let by_axis = comm_by_axis(plan);
    let priced = by_axis.values().any(|a| a.exposed_hidden.is_some());
    if priced {
        let _ = writeln!(
            s,
            "  communication per step by axis (exposed: in the step; hidden: behind compute,\n  \
             which it slows: its kernels take SMs and memory bandwidth from the kernels beside them):"
        );
        let _ = writeln!(
            s,
            "    axis over          exposed s   hidden s  slows compute s   per step GiB"
        );
        for (axis, a) in &by_axis {
            let (exposed, hidden) = a.exposed_hidden.unwrap_or((0.0, 0.0));
            let _ = writeln!(
                s,
                "    {:<4} {:<11} {:>10.3} {:>10.3} {:>16.3} {:>14.2}",
                axis.name(),
                link(comm_link(plan, *axis)),
                exposed,
                hidden,
                // Plans written before the slowdown was priced have none.
                if b.overlap_slowdown_s > 0.0 {
                    dplc_planner::overlap_slowdown(hidden)
                } else {
                    0.0
                },
                a.bytes as f64 / GIB
            );
        }
    } else if !by_axis.is_empty() {
        let _ = writeln!(s, "  communication per step by axis (before overlap):");
        for (axis, a) in &by_axis {
            let _ = writeln!(
                s,
                "    {:<3} over {:<11} {:>9.3} s  {:>10.2} GiB",
                axis.name(),
                link(comm_link(plan, *axis)),
                a.seconds,
                a.bytes as f64 / GIB
            );
        }
    }

    let _ = writeln!(s, "\ncollectives per step");
    let _ = writeln!(
        s,
        "  kind            axis  group  link         phase       calls     bytes each   time each  what"
    );
    for c in &plan.collectives {
        let _ = writeln!(
            s,
            "  {:<15} {:<4} {:>6}  {:<11}  {:<10} {:>6}  {:>13}  {:>8.3} ms  {}",
            c.kind.name(),
            c.axis.name(),
            c.group.map_or(axis_size(plan, c.axis), |(size, _)| size),
            link(c.group.map_or(axis_link(plan, c.axis), |(_, l)| l)),
            c.phase.name(),
            c.count_per_step,
            c.bytes,
            c.time_s * 1e3,
            c.what
        );
    }
    if plan.collectives.is_empty() {
        let _ = writeln!(s, "  none: one rank holds everything");
    }

    for p in &plan.programs {
        let forward = p.values.iter().filter(|v| v.collective.is_some()).count();
        let _ = writeln!(
            s,
            "\nlayout of the {} (sharding e-graph at tp {} ep {} sp {}: {} e-nodes, {} iterations, {}): {} values, {} forward and {} backward collectives",
            p.region,
            p.tp,
            p.ep,
            if p.sequence_parallel { "on" } else { "off" },
            p.egraph_nodes,
            p.egraph_iterations,
            p.stop_reason,
            p.values.len(),
            forward,
            p.backward.len()
        );
    }

    if !plan.alternatives.is_empty() {
        let _ = writeln!(s, "\nrunners-up and why they lost");
        for a in &plan.alternatives {
            let _ = writeln!(
                s,
                "  #{:<2} {:>9.3} s {:>7} GiB  {}; {}: {}",
                a.rank,
                a.step_time_s,
                gib(a.peak_memory_bytes),
                a.mesh,
                a.strategy,
                a.reason
            );
        }
    }

    if !plan.what_if.is_empty() {
        let _ = writeln!(s, "\nwhat if (every other choice as planned)");
        // One column for the changes, as wide as the longest.
        let width = plan
            .what_if
            .iter()
            .map(|w| w.change.chars().count())
            .max()
            .unwrap_or(0)
            .max(28);
        for w in &plan.what_if {
            match (w.step_time_s, w.peak_memory_bytes) {
                (Some(t), Some(mem)) => {
                    let _ = writeln!(
                        s,
                        "  {:<width$} {:>9.3} s ({:+.1}%)  peak {:>7} GiB{}{}",
                        w.change,
                        t,
                        100.0 * (t / e.step_time_s - 1.0),
                        gib(mem),
                        if w.fits { "" } else { "  does not fit" },
                        if w.note.is_empty() {
                            String::new()
                        } else {
                            format!("  ({})", w.note)
                        }
                    );
                }
                _ => {
                    let _ = writeln!(s, "  {:<width$} impossible: {}", w.change, w.note);
                }
            }
        }
    }
    s
}

pub fn run(args: &Args) -> Result<()> {
    let plan = read_plan(&args.plan)?;
    if args.json {
        let by_axis: serde_json::Map<String, serde_json::Value> = comm_by_axis(&plan)
            .into_iter()
            .map(|(a, t)| {
                let mut v = json!({"seconds_per_step": t.seconds, "bytes_per_step": t.bytes,
                                   "link": link(axis_link(&plan, a))});
                if let Some((exposed, hidden)) = t.exposed_hidden {
                    v["exposed_s"] = exposed.into();
                    v["hidden_s"] = hidden.into();
                }
                (a.name().to_string(), v)
            })
            .collect();
        let mut v = serde_json::to_value(&plan).expect("plans serialise");
        if let Some(o) = v.as_object_mut() {
            o.remove("source");
            o.insert("communication_by_axis".into(), by_axis.into());
        }
        outln!(
            "{}",
            serde_json::to_string_pretty(&v).expect("JSON values serialise")
        );
        return Ok(());
    }
    out!("{}", render(&plan));
    Ok(())
}
