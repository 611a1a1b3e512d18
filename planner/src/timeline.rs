//! The step as the cost model sees it, laid out in time: every pipeline
//! stage's forwards and backwards per micro-batch (and chunk) in the order of
//! its schedule, then gradient synchronisation and the optimizer step.
//!
//! Stages run in lockstep at the slowest stage's pace — the cost model's own
//! assumption — so the makespan of this layout is the plan's predicted step
//! time, which `viz` and its tests rely on.

use dplc_ir::{pipeline_order, PipelineWork, Plan};

/// What a span of a stage's time is spent on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SpanKind {
    Forward,
    Backward,
    /// The data-parallel gradient reduction (and ZeRO gathers) not hidden behind backward.
    GradientSync,
    Optimizer,
}

impl SpanKind {
    pub fn name(self) -> &'static str {
        match self {
            SpanKind::Forward => "forward",
            SpanKind::Backward => "backward",
            SpanKind::GradientSync => "grad-sync",
            SpanKind::Optimizer => "optimizer",
        }
    }
}

/// One busy interval of one pipeline stage.
#[derive(Clone, Debug, PartialEq)]
pub struct Span {
    pub stage: u64,
    pub kind: SpanKind,
    pub micro_batch: u64,
    /// Model chunk (0 unless interleaved).
    pub chunk: u64,
    pub start_s: f64,
    pub duration_s: f64,
    /// The part of `duration_s` that is the send to the next stage (or back).
    pub send_s: f64,
}

/// The simulated step of one data-parallel replica.
#[derive(Clone, Debug, PartialEq)]
pub struct Timeline {
    pub stages: u64,
    pub spans: Vec<Span>,
    /// When the last span ends: the predicted step time.
    pub makespan_s: f64,
}

/// Lay out `plan`'s step.
pub fn timeline(plan: &Plan) -> Timeline {
    let s = &plan.strategy;
    let e = &plan.estimate;
    let (p, m) = (plan.mesh.pp.max(1), s.num_micro_batches.max(1));
    let v = plan.chunks();
    let slowest = plan
        .stages
        .iter()
        .max_by(|a, b| (a.forward_s + a.backward_s).total_cmp(&(b.forward_s + b.backward_s)))
        .expect("a plan has a stage");
    let slots = m * v + p - 1;
    let send = if p > 1 {
        e.breakdown.pipeline_p2p_s / (2 * slots) as f64
    } else {
        0.0
    };
    // A chunk's share of its stage's time: its layers' (chunks may differ
    // by a layer), paced by the slowest stage.
    let chunk_layers = dplc_ir::even_split(slowest.layers.max(v), v);
    let part = |t: f64, chunk: u64| {
        if slowest.layers.is_multiple_of(v) {
            t / v as f64
        } else {
            t * chunk_layers[chunk as usize] as f64 / slowest.layers as f64
        }
    };

    // Discrete-event simulation: a chunk-pass starts when its stage is free
    // and its input has arrived (the previous virtual stage's forward, or the
    // next one's backward).
    let virt = |stage: u64, chunk: u64| chunk * p + stage;
    let nv = (p * v) as usize;
    let mut f_end = vec![vec![f64::NAN; m as usize]; nv];
    let mut b_end = vec![vec![f64::NAN; m as usize]; nv];
    let orders: Vec<Vec<PipelineWork>> = (0..p)
        .map(|st| pipeline_order(s.schedule, p, st, m, v))
        .collect();
    let mut next = vec![0usize; p as usize];
    let mut free = vec![0.0f64; p as usize];
    let mut spans = Vec::with_capacity(2 * (m * v * p) as usize);
    loop {
        let mut progressed = false;
        for st in 0..p {
            while let Some(&work) = orders[st as usize].get(next[st as usize]) {
                let (forward, mb, chunk) = (work.is_forward(), work.micro(), work.chunk());
                let k = virt(st, chunk) as usize;
                let ready = match (forward, k) {
                    (true, 0) => Some(0.0),
                    (true, _) => Some(f_end[k - 1][mb as usize]).filter(|t| !t.is_nan()),
                    (false, _) if k == nv - 1 => {
                        Some(f_end[k][mb as usize]).filter(|t| !t.is_nan())
                    }
                    (false, _) => Some(b_end[k + 1][mb as usize]).filter(|t| !t.is_nan()),
                };
                let Some(ready) = ready else { break };
                let start = free[st as usize].max(ready);
                let pass = if forward {
                    slowest.forward_s
                } else {
                    slowest.backward_s
                };
                let dur = part(pass, chunk) + send;
                let end = start + dur;
                if forward {
                    f_end[k][mb as usize] = end;
                } else {
                    b_end[k][mb as usize] = end;
                }
                free[st as usize] = end;
                spans.push(Span {
                    stage: st,
                    kind: if forward {
                        SpanKind::Forward
                    } else {
                        SpanKind::Backward
                    },
                    micro_batch: mb,
                    chunk,
                    start_s: start,
                    duration_s: dur,
                    send_s: send,
                });
                next[st as usize] += 1;
                progressed = true;
            }
        }
        if !progressed {
            break;
        }
    }
    debug_assert!(
        next.iter().zip(&orders).all(|(n, o)| *n == o.len()),
        "every schedule order respects its dependencies"
    );
    let pipeline_end = free.iter().copied().fold(0.0, f64::max);
    let mut end = pipeline_end;
    for (kind, dur) in [
        (SpanKind::GradientSync, e.breakdown.exposed_dp_comm_s),
        (
            SpanKind::Optimizer,
            e.breakdown.optimizer_s + e.breakdown.offload_s,
        ),
    ] {
        if dur > 0.0 {
            for st in 0..p {
                spans.push(Span {
                    stage: st,
                    kind,
                    micro_batch: 0,
                    chunk: 0,
                    start_s: end,
                    duration_s: dur,
                    send_s: 0.0,
                });
            }
            end += dur;
        }
    }
    Timeline {
        stages: p,
        spans,
        makespan_s: end,
    }
}
