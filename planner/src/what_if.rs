//! What `explain` prices beside a plan: its neighbours (each one choice
//! changed, every other as planned, each its own search) and the other ways
//! to synchronise and compress its data-parallel gradients.

use crate::{
    compile_one, cost, layouts, profile, search, Cluster, PlanRequest, StrategyConstraints,
};
use dplc_ir::{Plan, Recompute};

/// The plan's neighbours: tensor degree ×2 and ÷2, the other recompute
/// policies, the other pipeline schedule, the fused loss for an unfused
/// one, micro-batch ×2; every other choice stays as planned.
pub(crate) fn neighbours(
    req: &PlanRequest,
    plan: &Plan,
    cache: &layouts::LayoutCache,
) -> Vec<dplc_ir::WhatIf> {
    let s = &plan.strategy;
    let m = &plan.mesh;
    let base = StrategyConstraints {
        dp: None,
        num_micro_batches: None,
        order: None,
        even_stages: None,
        // A neighbour that does not fit says so; it does not offload instead.
        offload: Some(s.offload),
        ..StrategyConstraints::of_plan(plan)
    };
    let mut variants: Vec<(String, StrategyConstraints)> = Vec::new();
    let world = req.cluster.world_size();
    for tp in [m.tp * 2, m.tp / 2] {
        if tp >= 1 && tp != m.tp {
            // A wider tp that the plan's pp × cp leave no room for frees
            // them (and the chunks), rather than pricing nothing.
            let room = tp.saturating_mul(m.pp).saturating_mul(m.cp) <= world;
            let (pp, cp, virtual_stages) = if room {
                (base.pp, base.cp, base.virtual_stages)
            } else {
                (None, None, None)
            };
            variants.push((
                format!("tp {} → {tp}", m.tp),
                StrategyConstraints {
                    tp: Some(tp),
                    pp,
                    cp,
                    virtual_stages,
                    sequence_parallel: if tp == 1 {
                        Some(false)
                    } else {
                        base.sequence_parallel
                    },
                    ep: None,
                    // The data-parallel degree moves with tp; ZeRO stages
                    // above 0 need dp > 1, so the search picks the stage again.
                    zero: None,
                    ..base.clone()
                },
            ));
        }
    }
    let partial = s.recompute == Recompute::Full && s.recompute_layers > 0;
    let now = match s.recompute_layers {
        n if partial => format!("first {n}/chunk"),
        _ => s.recompute.name().to_string(),
    };
    for r in [Recompute::None, Recompute::Selective, Recompute::Full] {
        if r != s.recompute || partial {
            let to = if partial && r == Recompute::Full {
                "every layer"
            } else {
                r.name()
            };
            variants.push((
                format!("recompute {now} → {to}"),
                StrategyConstraints {
                    recompute: Some(r),
                    // `full` here is every layer.
                    recompute_layers: (r == Recompute::Full).then_some(0),
                    ..base.clone()
                },
            ));
        }
    }
    if !s.overlap_grad_reduce {
        // What `--overlap-grad-reduce` would buy a Megatron-style plan.
        variants.push((
            "overlap off → on".to_string(),
            StrategyConstraints {
                overlap_grad_reduce: None,
                ..base.clone()
            },
        ));
    }
    if s.loss != dplc_ir::Loss::Fused {
        // What a fused loss (Megatron's `--cross-entropy-loss-fusion`
        // with Transformer Engine's kernel, torchtitan's compiled loss)
        // would buy.
        variants.push((
            format!("loss {} → fused", s.loss.name()),
            StrategyConstraints {
                loss: None,
                ..base.clone()
            },
        ));
    }
    if s.tp_impl == dplc_ir::TpImpl::DTensor && m.tp > 1 {
        // What Megatron's sequence-first tensor parallelism (no layout
        // copies, shards kept and gathered again) would buy a plan priced
        // as torchtitan's DTensor runs it.
        variants.push((
            format!("tp_impl {} → megatron", s.tp_impl.name()),
            StrategyConstraints {
                tp_impl: Some(dplc_ir::TpImpl::Megatron),
                ..base.clone()
            },
        ));
    }
    if m.ep > 1 {
        // Would DeepEP or HybridEP pay here (or what the one all-to-all dplc's
        // ranks send costs a plan priced with them)?
        let other = match s.dispatch {
            dplc_ir::Dispatch::AllToAll => dplc_ir::Dispatch::Hierarchical,
            dplc_ir::Dispatch::Hierarchical => dplc_ir::Dispatch::AllToAll,
        };
        variants.push((
            format!("dispatch {} → {}", s.dispatch.name(), other.name()),
            StrategyConstraints {
                dispatch: Some(other),
                ..base.clone()
            },
        ));
    }
    if m.pp > 1 {
        // What the bubble costs: interleaved against plain 1F1B, so a
        // reader whose source states no schedule sees the range it spans
        // (an interleaved neighbour chooses its own chunks).
        use dplc_ir::PipelineSchedule::{Interleaved, OneFOneB};
        let (now, to, v) = match s.schedule {
            Interleaved => (
                format!("interleaved v={}", s.virtual_stages),
                OneFOneB,
                Some(1),
            ),
            other => (other.name().to_string(), Interleaved, None),
        };
        variants.push((
            format!("schedule {now} → {}", to.name()),
            StrategyConstraints {
                schedule: Some(to),
                virtual_stages: v,
                ..base.clone()
            },
        ));
    }
    variants.push((
        format!("micro-batch {} → {}", s.micro_batch, s.micro_batch * 2),
        StrategyConstraints {
            micro_batch: Some(s.micro_batch * 2),
            ..base.clone()
        },
    ));
    // Each neighbour is its own search; they run side by side.
    crate::deal::map(&variants, |(change, pinned)| {
        let change = change.clone();
        {
            // The fastest neighbour that fits; if none fits, the same choices
            // priced anyway (keeping the plan's ZeRO stage where it applies),
            // so the line says by how much it misses.
            let alt = |pinned: StrategyConstraints, ignore_memory: bool| {
                compile_one(
                    &PlanRequest {
                        pinned,
                        top_k: 0,
                        ignore_memory,
                        ..req.clone()
                    },
                    cache,
                )
            };
            let pinned = pinned.clone();
            let priced = alt(pinned.clone(), false).or_else(|_| {
                let keep_zero = StrategyConstraints {
                    zero: pinned.zero.or(Some(s.zero_stage)),
                    ..pinned.clone()
                };
                alt(keep_zero, true).or_else(|_| alt(pinned, true))
            });
            match priced {
                Ok(c) => {
                    let e = &c.plan.estimate;
                    let dm = &c.plan.mesh;
                    dplc_ir::WhatIf {
                        change: change.clone(),
                        step_time_s: Some(e.step_time_s),
                        peak_memory_bytes: Some(e.peak_memory_bytes),
                        fits: e.peak_memory_bytes <= req.cluster.device.memory_bytes,
                        note: {
                            let ds = &c.plan.strategy;
                            let mut also = Vec::new();
                            // Every degree the neighbour moved besides
                            // its own change, so pinning what it says
                            // gives the plan it priced.
                            for (name, was, is) in [
                                ("dp", m.dp, dm.dp),
                                ("tp", m.tp, dm.tp),
                                ("pp", m.pp, dm.pp),
                                ("cp", m.cp, dm.cp),
                                ("ep", m.ep, dm.ep),
                            ] {
                                if was != is && !change.starts_with(&format!("{name} ")) {
                                    also.push(format!("{name} {was} → {is}"));
                                }
                            }
                            if ds.zero_stage != s.zero_stage {
                                also.push(format!("ZeRO-{} → {}", s.zero_stage, ds.zero_stage));
                            }
                            also.join(", ")
                        },
                    }
                }
                Err(e) => dplc_ir::WhatIf {
                    change,
                    step_time_s: None,
                    peak_memory_bytes: None,
                    fits: false,
                    note: e.to_string(),
                },
            }
        }
    })
}

/// The other ways to synchronise and compress the plan's data-parallel
/// gradients, priced on the plan's own configuration (ZeRO-0 where the
/// plan shards, as these run over replicated state): what `explain` shows
/// for every plan with dp > 1, whether or not `--allow` let the search
/// choose them. Each note says what moves on the busiest link.
pub(crate) fn dp_sync(
    profile: &profile::ModelProfile,
    cluster: &Cluster,
    seq: u64,
    best: &search::Candidate,
    capacity: u64,
) -> Vec<dplc_ir::WhatIf> {
    use dplc_ir::{Compression, GradSync, ServerRanks};
    let c = best.config;
    let n = c.dp * c.cp;
    if n <= 1 {
        return Vec::new();
    }
    let mut cost = cost::CostModel::new(profile, cluster, seq);
    let link = cost.replica_link(&c);
    // Bytes on the busiest link per fp32 gradient byte.
    let ratio = |cost: &cost::CostModel, alt: &cost::Config| {
        let grad = alt.grad_bytes(profile.precision);
        cost.dp_reduction(alt, 1.0, grad, &link).link_bytes / 4.0
    };
    let mut variants: Vec<(String, cost::Config)> = Vec::new();
    let base = cost::Config {
        zero: 0,
        sync: GradSync::AllReduce,
        compress: Compression::None,
        ..c
    };
    if c.zero != 0 {
        // The lines below run over replicated state: this one says what
        // dropping the ZeRO stage alone costs.
        variants.push((format!("zero {} → 0", c.zero), base));
    }
    let mut push = |change: String, alt: cost::Config| {
        if alt.sync != c.sync || alt.compress != c.compress {
            variants.push((change, alt));
        }
    };
    push(
        "sync=allreduce".into(),
        cost::Config {
            compress: c.compress,
            ..base
        },
    );
    push(
        format!("sync=ps,ps_shards={n}"),
        cost::Config {
            sync: GradSync::ps(n),
            ..base
        },
    );
    push(
        "sync=ps,ps_shards=1".into(),
        cost::Config {
            sync: GradSync::ps(1),
            ..base
        },
    );
    if c.cp == 1 && c.ep == 1 {
        // What the runtime runs dedicated servers with.
        // ps_shards defaults to dp: the label fits explain's column.
        push(
            "sync=ps,ps_ranks=dedicated".into(),
            cost::Config {
                sync: GradSync::ps(n).with_servers(ServerRanks::Dedicated),
                ..base
            },
        );
    }
    push(
        "sync=async,staleness=1".into(),
        cost::Config {
            sync: GradSync::async_ps(n, 1),
            ..base
        },
    );
    for compress in search::COMPRESSIONS {
        push(
            format!("compress={}", compress.name()),
            cost::Config {
                compress,
                sync: c.sync,
                ..base
            },
        );
    }
    // The main gradients in the other precision, every other choice kept.
    if let Some(half) = dplc_ir::GradReduce::half_for(profile.precision) {
        let other = match c.grad_reduce {
            dplc_ir::GradReduce::Fp32 => half,
            _ => dplc_ir::GradReduce::Fp32,
        };
        variants.push((
            format!("grad_reduce={}", other.name()),
            cost::Config {
                grad_reduce: other,
                ..c
            },
        ));
    }
    let plain = ratio(&cost, &base);
    variants
        .into_iter()
        .map(|(change, alt)| {
            let time = cost.step_time(&alt, &best.counts);
            let (peak, _) = cost.peak_memory(&alt, &best.counts);
            let bytes = ratio(&cost, &alt);
            let mut note = match alt.sync {
                GradSync::Ps { shards, servers }
                | GradSync::Async {
                    shards, servers, ..
                } => {
                    format!(
                        "server link carries {:.2}× the gradient bytes, all-reduce {:.2}×{}",
                        bytes,
                        plain,
                        match servers {
                            ServerRanks::Dedicated => format!(
                                " ({} server ranks beyond the cluster's {} devices: they hold \
                                 the shards and the optimizer state, no compute)",
                                shards * c.pp * c.tp,
                                c.dp * c.cp * c.pp * c.tp
                            ),
                            ServerRanks::CoLocated if shards == n => {
                                " (BytePS: a shard per worker)".into()
                            }
                            ServerRanks::CoLocated => String::new(),
                        }
                    )
                }
                GradSync::AllReduce => format!(
                    "each link carries {:.3}× the fp32 gradient bytes, {:.2}× uncompressed",
                    bytes, plain
                ),
            };
            // Across nodes a server's traffic goes point to point, slower
            // than the ring's bytes (which reduce inside each node first).
            let link = cost.replica_link(&alt);
            let rate = cost::server_rate(alt.sync, &link);
            if alt.sync != GradSync::AllReduce && rate < 0.99 * link.bandwidth {
                note.push_str(&format!(
                    "; point to point at {:.0} GB/s a rank, where the ring runs at {:.0}",
                    rate / 1e9,
                    link.bandwidth / 1e9
                ));
            }
            if alt.sync.staleness() > 0 {
                note.push_str(&format!(
                    "; no barrier, weights up to {} step stale",
                    alt.sync.staleness()
                ));
            }
            if alt.zero != c.zero {
                note.push_str(&format!("; ZeRO-{} → 0", c.zero));
            }
            match (
                alt.sync != GradSync::AllReduce,
                alt.compress != Compression::None,
            ) {
                (true, _) if alt.sync.dedicated_servers() > 0 => {
                    note.push_str("; pin it: the search adds no devices")
                }
                (true, _) => note.push_str("; the search takes it with --allow sync"),
                (false, true) => note.push_str("; the search takes it with --allow compress"),
                (false, false) => {}
            }
            if alt.grad_reduce != c.grad_reduce {
                note.push_str(&format!(
                    "; main gradients kept and reduced in {}: pin it, the search keeps fp32",
                    alt.grad_reduce.name()
                ));
            }
            dplc_ir::WhatIf {
                change,
                step_time_s: Some(cost::step_total(&time)),
                peak_memory_bytes: Some(peak),
                fits: peak <= capacity,
                note,
            }
        })
        .collect()
}
