//! Turning the chosen configuration into a `Plan`, and the plan into the
//! human summary and the `--json` object.

use crate::cluster::Cluster;
use crate::cost::{
    collective_time, dispatch_time, group_link, Config, CostModel, GroupLink, Place,
};
use crate::profile::{Bind, ModelProfile, RegionProfile, Work};
use crate::search::{complexity, Candidate};
use crate::sharding::{Pass, TpCollectiveKind};
use crate::Compiled;
use dplc_ir::{
    Alternative, AxisMapping, ClusterSummary, Collective, CollectiveKind, Estimate, LinkLevel,
    Mesh, MeshAxis, ParamSharding, Plan, Recompute, SearchStats, StagePlan, StepPhase, Strategy,
    TimeBreakdown, TpImpl,
};
use serde_json::json;
use std::fmt::Write;

const GIB: f64 = (1u64 << 30) as f64;

pub(crate) fn mesh(c: &Config, cluster: &Cluster) -> Mesh {
    let mut axes = Vec::new();
    for axis in [
        MeshAxis::Tp,
        MeshAxis::Cp,
        MeshAxis::Ep,
        MeshAxis::Dp,
        MeshAxis::Pp,
    ] {
        let (stride, size) = c.stride_size(axis);
        let l = group_link(cluster, stride, size);
        axes.push(AxisMapping {
            axis,
            size,
            stride,
            link: l.level,
            bandwidth_bytes_per_s: match (l.level, axis) {
                (LinkLevel::None, _) => 0.0,
                // Expert parallelism's traffic is all-to-all.
                (_, MeshAxis::Ep) => l.all_to_all_bandwidth(),
                _ => l.bandwidth,
            },
        });
    }
    axes.sort_by_key(|a| (a.stride, a.axis));
    Mesh {
        dp: c.dp,
        tp: c.tp,
        pp: c.pp,
        cp: c.cp,
        ep: c.ep,
        axes,
    }
}

pub(crate) fn strategy(c: &Config, global_batch: u64, seq: u64) -> Strategy {
    Strategy {
        global_batch,
        seq,
        micro_batch: c.micro_batch,
        num_micro_batches: c.num_micro_batches,
        schedule: c.schedule,
        virtual_stages: c.virtual_stages,
        zero_stage: c.zero,
        recompute: c.recompute,
        recompute_layers: if c.recompute == Recompute::Full {
            c.recompute_layers
        } else {
            0
        },
        sequence_parallel: c.sp,
        overlap_grad_reduce: c.overlap,
        attention: c.attention,
        tp_overlap: c.tp_overlap,
        grad_accum: c.grad_accum,
        grad_reduce: c.grad_reduce,
        dispatch: if c.ep > 1 {
            c.dispatch
        } else {
            dplc_ir::Dispatch::AllToAll
        },
        root: c.root,
        fp8: c.fp8,
        fp8_gather: c.gathers_fp8(),
        fp8_bf16_ends: if c.fp8 { c.fp8_bf16_ends } else { 0 },
        offload: c.offload,
        autocast: c.autocast,
        elementwise: c.elementwise,
        loss: c.loss,
        shards: c.shards,
        tp_impl: c.tp_impl,
        sync: c.sync,
        compress: c.compress,
    }
}

/// FLOPs of one step, from the graph: what the model needs, what the
/// kernels execute, and what the attention masks remove.
pub(crate) struct StepFlops {
    /// `3 ×` the forward, each attention counted over the query-key pairs
    /// its mask keeps (a causal one: half, as Megatron-LM's
    /// `num_floating_point_operations` counts it from core_v0.16.0, "causal
    /// mask (only half of the mask is non-zero)", and FlashAttention's
    /// benchmarks).
    pub model: f64,
    /// The model's FLOPs, the forward recomputation repeats, and the masked
    /// scores an unfused attention computes anyway (a fused kernel skips
    /// their tiles).
    pub hardware: f64,
    /// `3 ×` the attention FLOPs the masks remove: what a count over every
    /// pair adds (PaLM's `6N + 12LHQT`, Megatron-LM before core_v0.16.0,
    /// torchtitan's MFU).
    pub masked: f64,
}

/// [`StepFlops`] of `c` for a step of `global_batch` sequences of `seq`.
pub(crate) fn step_flops(
    profile: &ModelProfile,
    c: &Config,
    recomputed: &[u64],
    global_batch: u64,
    seq: u64,
) -> StepFlops {
    let bind = Bind {
        batch_sym: profile.batch_sym,
        seq_sym: profile.seq_sym,
        micro_batch: global_batch as f64,
        seq: seq as f64,
        cp: 1.0,
    };
    let unfused = c.attention == dplc_ir::AttentionKind::Unfused;
    // Per stack, one layer's forward attention FLOPs its masks remove, each
    // mask's share taken over its own keys (a T5 decoder's fixed targets)
    // or the plan's sequence.
    let masked: Vec<f64> = profile
        .stacks
        .iter()
        .map(|st| {
            st.layer
                .ops
                .iter()
                .filter(|op| op.attention_core)
                .filter_map(|op| match &op.work {
                    Work::Gemm { m, n, k, .. } => {
                        let (m, n, k) = bind.eval_gemm(m, n, k);
                        let mask = op.mask;
                        let kept =
                            crate::cost::kept_share(mask.length(seq), mask.causal, mask.window);
                        Some(2.0 * m * n * k * (1.0 - kept))
                    }
                    _ => None,
                })
                .sum()
        })
        .collect();
    let masked_forward: f64 = profile
        .stacks
        .iter()
        .zip(&masked)
        .map(|(st, m)| st.layers as f64 * m)
        .sum();
    let model = 3.0 * (bind.eval(&profile.forward_flops) - masked_forward);
    let extra: f64 = profile
        .stacks
        .iter()
        .zip(recomputed)
        .zip(&masked)
        .map(|((st, &rerun), &masked)| {
            let layers = st.layers as f64;
            // What one layer's forward executes of what its mask removes.
            let skipped = if unfused { 0.0 } else { masked };
            match c.recompute {
                Recompute::None => 0.0,
                // A fused attention kernel has no core tensors to drop and redo.
                Recompute::Selective if unfused => layers * bind.eval(&st.attention_core_flops),
                Recompute::Selective => 0.0,
                Recompute::Full => rerun as f64 * (bind.eval(&st.layer.forward_flops) - skipped),
                Recompute::Op => layers * bind.eval(&st.op_recompute_flops),
            }
        })
        .sum();
    let computed_masked = if unfused { 3.0 * masked_forward } else { 0.0 };
    StepFlops {
        model,
        hardware: model + extra + computed_masked,
        masked: 3.0 * masked_forward,
    }
}

fn reason(best: &Candidate, alt: &Candidate) -> String {
    let (a, b) = (&alt.time, &best.time);
    let rel = alt.step_time / best.step_time - 1.0;
    if rel.abs() < 5e-4 {
        return if complexity(&alt.config) > complexity(&best.config) {
            "ties on step time (within 0.05%); the chosen plan needs less machinery \
             (lower ZeRO stage, less recomputation, fewer chunks)"
                .to_string()
        } else {
            format!(
                "ties on step time (within 0.05%); more memory ({:.1} vs {:.1} GiB)",
                alt.peak_memory as f64 / GIB,
                best.peak_memory as f64 / GIB
            )
        };
    }
    let terms = [
        (
            "compute",
            a.compute_s - a.recompute_s - (b.compute_s - b.recompute_s),
        ),
        ("recomputation", a.recompute_s - b.recompute_s),
        (
            "exposed tp/cp/ep communication",
            a.exposed_comm_s - b.exposed_comm_s,
        ),
        ("pipeline send/recv", a.pipeline_p2p_s - b.pipeline_p2p_s),
        ("pipeline bubble", a.bubble_s - b.bubble_s),
        (
            "exposed data-parallel communication",
            a.exposed_dp_comm_s - b.exposed_dp_comm_s,
        ),
        ("optimizer step", a.optimizer_s - b.optimizer_s),
        (
            "compute slowed by overlapped communication",
            a.overlap_slowdown_s - b.overlap_slowdown_s,
        ),
        ("host-link traffic", a.offload_s - b.offload_s),
    ];
    let (name, delta) = terms
        .iter()
        .copied()
        .max_by(|x, y| x.1.total_cmp(&y.1))
        .expect("terms are not empty");
    format!(
        "{:+.1}% step time: more {name} ({:+.3} s)",
        rel * 100.0,
        delta
    )
}

fn collectives(cost: &mut CostModel, cand: &Candidate) -> Vec<Collective> {
    let c = &cand.config;
    let profile = cost.profile;
    let bind = Bind {
        batch_sym: profile.batch_sym,
        seq_sym: profile.seq_sym,
        micro_batch: c.micro_batch as f64,
        seq: cost.seq as f64,
        cp: c.cp as f64,
    };
    let m = c.num_micro_batches;
    // The first stage's: its layers of each stack.
    let shares0 = cost.stage_shares(c, &cand.counts, 0);
    // Of those, per stack, the layers full recomputation runs again.
    let mut rerun0 = vec![0u64; profile.stacks.len()];
    if c.recompute == Recompute::Full {
        for sh in cost.recompute_split(c, &cand.counts, 0).0 {
            rerun0[sh.stack] += sh.layers;
        }
    }
    let names: Vec<String> = (0..profile.stacks.len())
        .map(|i| crate::layouts::stack_name(i, profile.stacks.len()))
        .collect();
    let mut out = Vec::new();
    let tp_link = cost.link(c, MeshAxis::Tp);
    if c.tp > 1 {
        // Each region, how often a micro-batch runs it, its name, how
        // often full recomputation runs it again, and where it sits.
        let mut regions: Vec<(&RegionProfile, u64, &str, u64, Place)> = Vec::new();
        for sh in &shares0 {
            let st = &profile.stacks[sh.stack];
            regions.push((
                &st.layer,
                sh.layers,
                &names[sh.stack],
                rerun0[sh.stack],
                Place::Layer,
            ));
            if sh.first && sh.stack > 0 {
                regions.push((&st.lead_in, 1, "between stacks", 0, Place::LeadIn));
            }
        }
        regions.push((&profile.pre, 1, "embedding", 0, Place::End));
        regions.push((&profile.post, u64::from(c.pp == 1), "head", 0, Place::End));
        for (region, per_mb, name, rerun, place) in regions {
            for col in &region.collectives {
                if col.sequence_parallel_only && !c.regathers(place) {
                    continue;
                }
                let bytes = bind.eval(&col.bytes);
                let phase = match col.pass {
                    Pass::Forward => StepPhase::Forward,
                    // DTensor's gather again is op-level checkpointing's.
                    Pass::Backward
                        if col.sequence_parallel_only && c.tp_impl == TpImpl::DTensor =>
                    {
                        StepPhase::Recompute
                    }
                    Pass::Backward => StepPhase::Backward,
                };
                let what = format!("{name}: {}", col.what);
                let kinds: &[CollectiveKind] = match (col.kind, c.sp) {
                    (TpCollectiveKind::AllReduce, true) => {
                        &[CollectiveKind::ReduceScatter, CollectiveKind::AllGather]
                    }
                    (TpCollectiveKind::AllGather, _) => &[CollectiveKind::AllGather],
                    _ => &[CollectiveKind::AllReduce],
                };
                for &kind in kinds {
                    push(
                        &mut out,
                        kind,
                        MeshAxis::Tp,
                        &what,
                        bytes,
                        phase,
                        per_mb * m,
                        &tp_link,
                    );
                    if phase == StepPhase::Forward && rerun > 0 {
                        push(
                            &mut out,
                            kind,
                            MeshAxis::Tp,
                            &what,
                            bytes,
                            StepPhase::Recompute,
                            rerun * m,
                            &tp_link,
                        );
                    }
                }
            }
        }
    }
    if c.cp > 1 {
        // What the rank's program gathers along the sequence
        // (`dplc_ir::context_traffic`), and the reduce-scatters of the
        // gradients of those with one.
        let link = cost.link(c, MeshAxis::Cp);
        // Each region, how often a micro-batch runs it, what its gathers and
        // reduce-scatters move, and how often full recomputation gathers
        // again.
        let mut regions: Vec<(&RegionProfile, u64, String, String, u64)> = Vec::new();
        for sh in &shares0 {
            let st = &profile.stacks[sh.stack];
            let name = &names[sh.stack];
            regions.push((
                &st.layer,
                sh.layers,
                format!("{name}: keys and values (every operand read along the whole sequence)"),
                format!("{name}: key and value gradients"),
                rerun0[sh.stack],
            ));
            if sh.first && sh.stack > 0 {
                regions.push((
                    &st.lead_in,
                    1,
                    "between stacks: operands read along the whole sequence".into(),
                    "between stacks: their gradients".into(),
                    0,
                ));
            }
        }
        regions.push((
            &profile.pre,
            1,
            "embedding: operands read along the whole sequence".into(),
            "embedding: their gradients".into(),
            0,
        ));
        regions.push((
            &profile.post,
            u64::from(c.pp == 1),
            "head: per-token losses before their mean".into(),
            "head: their gradients".into(),
            0,
        ));
        for (region, per_mb, gathered, scattered, rerun) in regions {
            let (forward, backward) = region.cp_traffic(&bind, c.tp as f64);
            push(
                &mut out,
                CollectiveKind::AllGather,
                MeshAxis::Cp,
                &gathered,
                forward,
                StepPhase::Forward,
                per_mb * m,
                &link,
            );
            if rerun > 0 {
                push(
                    &mut out,
                    CollectiveKind::AllGather,
                    MeshAxis::Cp,
                    &gathered,
                    forward,
                    StepPhase::Recompute,
                    rerun * m,
                    &link,
                );
            }
            push(
                &mut out,
                CollectiveKind::ReduceScatter,
                MeshAxis::Cp,
                &scattered,
                backward,
                StepPhase::Backward,
                per_mb * m,
                &link,
            );
        }
    }
    if c.ep > 1 {
        let link = cost.link(c, MeshAxis::Ep);
        let div = if c.sp { c.tp as f64 } else { 1.0 };
        for sh in &shares0 {
            let name = &names[sh.stack];
            let layer = &profile.stacks[sh.stack].layer;
            let bytes = bind.eval(&layer.all_to_all_bytes) / div / 2.0;
            let time_s = dispatch_time(c.dispatch, bytes, &link, layer.routing);
            // The bytes are every (token, expert) pair's; a hierarchical
            // dispatcher's time counts the copies it does not send.
            let how = match c.dispatch {
                dplc_ir::Dispatch::AllToAll => "",
                dplc_ir::Dispatch::Hierarchical => " (hierarchical: a token once per node)",
            };
            for (what, phase) in [
                ("token dispatch and combine", StepPhase::Forward),
                ("token dispatch and combine gradients", StepPhase::Backward),
            ] {
                push_timed(
                    &mut out,
                    (CollectiveKind::AllToAll, MeshAxis::Ep),
                    &format!("{name}: {what}{how}"),
                    bytes,
                    phase,
                    2 * sh.layers * m,
                    (&link, time_s),
                );
            }
        }
    }
    if c.pp > 1 {
        let link = cost.link(c, MeshAxis::Pp);
        let div = c.tp as f64;
        let bytes = profile
            .stacks
            .iter()
            .map(|st| bind.eval(&st.input_bytes))
            .fold(0.0, f64::max)
            / div;
        let n = m * c.virtual_stages;
        push(
            &mut out,
            CollectiveKind::SendRecv,
            MeshAxis::Pp,
            "stage boundary activations",
            bytes,
            StepPhase::Forward,
            n,
            &link,
        );
        push(
            &mut out,
            CollectiveKind::SendRecv,
            MeshAxis::Pp,
            "stage boundary gradients",
            bytes,
            StepPhase::Backward,
            n,
            &link,
        );
    }
    // The gradient reduction runs over the replicas, context-parallel
    // ranks included (`CostModel::replica_link`).
    if c.dp * c.cp > 1 {
        let link = cost.replica_link(c);
        // Stage 0's parameters, as the step prices its reduction (with the
        // head and loss when one stage holds everything): the dense ones
        // over the replicas, the experts' over the ranks holding the same
        // experts.
        let (params, expert) = cost.stage_params(c, 0, &shares0);
        let dense = params - expert;
        let expert_link = cost.expert_replica_link(c);
        let experts = expert > 0.0 && expert_link.size > 1;
        let grad_bytes = c.grad_bytes(profile.precision);
        let grads = match profile.precision {
            dplc_ir::Precision::Fp32 => "fp32",
            _ => c.grad_reduce.name(),
        };
        let kind = if c.zero >= 1 {
            CollectiveKind::ReduceScatter
        } else {
            CollectiveKind::AllReduce
        };
        let held = c.holds_the_step();
        let count = if c.zero >= 2 && !held { m } else { 1 };
        // ZeRO-3 gathers (and, but held through the step, reduce-scatters)
        // layer by layer: a collective a layer, as the step prices them.
        let layers = cand.counts[0].max(1);
        let per_layer = if c.zero >= 3 && !held { layers } else { 1 };
        push(
            &mut out,
            kind,
            MeshAxis::Dp,
            &format!("gradients ({grads})"),
            dense * grad_bytes / per_layer as f64,
            StepPhase::GradientSync,
            count * per_layer,
            &link,
        );
        if experts {
            push(
                &mut out,
                kind,
                MeshAxis::Dp,
                &format!("expert gradients ({grads})"),
                expert * grad_bytes,
                StepPhase::GradientSync,
                count,
                &expert_link,
            );
        }
        // What ZeRO's gathers move: the layers' FP8 casts when they gather
        // those (`fp8_gather`), as the step prices them.
        let gathered = cost.gathered_weight_bytes(c, dense, cost.layer_dense_params(c, &shares0));
        if c.zero >= 1 && experts {
            // The experts' updated shards, gathered once after the step.
            push(
                &mut out,
                CollectiveKind::AllGather,
                MeshAxis::Dp,
                "updated expert weights",
                expert * profile.precision.bytes() as f64,
                StepPhase::Optimizer,
                1,
                &expert_link,
            );
        }
        // ZeRO-3 gathers its weights where a pass needs them instead.
        if (1..3).contains(&c.zero) {
            push(
                &mut out,
                CollectiveKind::AllGather,
                MeshAxis::Dp,
                if c.gathers_fp8() {
                    "updated weights (the layers' FP8 casts)"
                } else {
                    "updated weights"
                },
                gathered,
                StepPhase::Optimizer,
                1,
                &link,
            );
        }
        let a_layer = gathered / layers as f64;
        if held {
            push(
                &mut out,
                CollectiveKind::AllGather,
                MeshAxis::Dp,
                "a layer's weights, held through the step",
                a_layer,
                StepPhase::Forward,
                layers,
                &link,
            );
        } else if c.zero >= 3 {
            push(
                &mut out,
                CollectiveKind::AllGather,
                MeshAxis::Dp,
                "a layer's weights for forward",
                a_layer,
                StepPhase::Forward,
                m * layers,
                &link,
            );
            push(
                &mut out,
                CollectiveKind::AllGather,
                MeshAxis::Dp,
                "a layer's weights for backward",
                a_layer,
                StepPhase::Backward,
                m * layers,
                &link,
            );
        }
    }
    out
}

#[allow(clippy::too_many_arguments)]
fn push(
    out: &mut Vec<Collective>,
    kind: CollectiveKind,
    axis: MeshAxis,
    what: &str,
    bytes: f64,
    phase: StepPhase,
    count: u64,
    link: &GroupLink,
) {
    let time_s = collective_time(kind, bytes, link);
    push_timed(out, (kind, axis), what, bytes, phase, count, (link, time_s));
}

/// [`push`] for a collective whose time is not the textbook algorithm's
/// (a hierarchical MoE dispatch).
fn push_timed(
    out: &mut Vec<Collective>,
    (kind, axis): (CollectiveKind, MeshAxis),
    what: &str,
    bytes: f64,
    phase: StepPhase,
    count: u64,
    (link, time_s): (&GroupLink, f64),
) {
    if count == 0 || bytes <= 0.0 {
        return;
    }
    out.push(Collective {
        kind,
        axis,
        what: what.to_string(),
        bytes: bytes as u64,
        phase,
        count_per_step: count,
        time_s,
        group: Some((link.size, link.level)),
    });
}

#[allow(clippy::too_many_arguments)]
pub(crate) fn build_plan(
    profile: &ModelProfile,
    cluster: &Cluster,
    global_batch: u64,
    seq: u64,
    ranked: &[Candidate],
    evaluated: u64,
    space: u64,
    feasible: u64,
    pinned: String,
) -> Plan {
    let best = &ranked[0];
    let c = best.config;
    let mut cost = CostModel::new(profile, cluster, seq);
    let mut first = 0;
    // A micro-batch's share of what overlapped communication costs compute.
    let stretch = best.time.overlap_slowdown_s / c.num_micro_batches.max(1) as f64;
    let stages: Vec<StagePlan> = (0..c.pp)
        .map(|i| {
            let layers = best.counts[i as usize];
            let pass = cost.stage_pass(&c, &best.counts, i as usize);
            // Exposed communication and the overlap slowdown are charged to
            // each pass in proportion to its compute.
            let work = pass.forward + pass.backward + pass.recompute;
            let share = if work > 0.0 {
                (pass.comm + stretch) / work
            } else {
                0.0
            };
            let s = StagePlan {
                forward_s: pass.forward * (1.0 + share),
                backward_s: (pass.backward + pass.recompute) * (1.0 + share),
                stage: i,
                first_layer: first,
                layers,
                embedding: i == 0,
                head: i == c.pp - 1,
                micro_batches_in_flight: CostModel::in_flight(&c, i),
                memory: cost.stage_memory(&c, &best.counts, i),
            };
            first += layers;
            s
        })
        .collect();
    let param_sharding = profile
        .param_layout
        .iter()
        .map(|(name, elements, split, expert)| {
            let mut splits = Vec::new();
            if *expert && c.ep > 1 {
                splits.push((MeshAxis::Ep, 0));
            }
            if let Some(d) = split {
                if c.tp > 1 {
                    splits.push((MeshAxis::Tp, *d));
                }
            }
            ParamSharding {
                name: name.clone(),
                elements: *elements as u64,
                splits,
            }
        })
        .collect();
    let recomputed = cost.recomputed_layers(&c, &best.counts);
    let flops = step_flops(profile, &c, &recomputed, global_batch, seq);
    let (model_flops, hw_flops) = (flops.model, flops.hardware);
    let world = cluster.world_size() as f64;
    let step = best.step_time;
    let peak = cluster.device.peak_flops(profile.precision);
    let estimate = Estimate {
        step_time_s: step,
        breakdown: best.time.clone(),
        tokens_per_s: (global_batch * seq) as f64 / step,
        samples_per_s: profile
            .seq_sym
            .is_none()
            .then(|| global_batch as f64 / step),
        model_flops_per_step: model_flops,
        hardware_flops_per_step: hw_flops,
        masked_attention_flops_per_step: flops.masked,
        model_tflops_per_gpu: model_flops / step / world / 1e12,
        hardware_tflops_per_gpu: hw_flops / step / world / 1e12,
        mfu: model_flops / step / world / peak,
        peak_memory_bytes: stages.iter().map(|s| s.memory.total()).max().unwrap_or(0),
    };
    let alternatives = ranked[1..]
        .iter()
        .enumerate()
        .map(|(i, alt)| Alternative {
            rank: i as u64 + 2,
            mesh: mesh(&alt.config, cluster),
            strategy: strategy(&alt.config, global_batch, seq),
            step_time_s: alt.step_time,
            peak_memory_bytes: alt.peak_memory,
            reason: reason(best, alt),
        })
        .collect();
    Plan {
        model: profile.name.clone(),
        params: profile.total_params as u64,
        layers: profile.layers,
        cluster: ClusterSummary {
            name: cluster.name.clone(),
            nodes: cluster.nodes,
            devices_per_node: cluster.devices_per_node,
            device: cluster.device.name.to_string(),
            memory_bytes: cluster.device.memory_bytes,
            peak_flops: peak,
            custom_device: cluster.custom_device.clone(),
        },
        mesh: mesh(&c, cluster),
        strategy: strategy(&c, global_batch, seq),
        stages,
        param_sharding,
        collectives: collectives(&mut cost, best),
        estimate,
        search: SearchStats {
            configs_evaluated: evaluated,
            space,
            feasible,
            pinned,
            skipped: Vec::new(),
        },
        alternatives,
        what_if: Vec::new(),
        programs: Vec::new(),
        source: Default::default(),
        layout: None,
    }
}

fn gib(b: u64) -> String {
    format!("{:.2}", b as f64 / GIB)
}

fn link_name(l: LinkLevel) -> &'static str {
    match l {
        LinkLevel::IntraNode => "intra-node",
        LinkLevel::InterNode => "inter-node",
        LinkLevel::None => "-",
    }
}

fn time_line(t: &TimeBreakdown) -> String {
    format!(
        "compute {:.3} s (recompute {:.3} s), exposed comm {:.3} s, p2p {:.3} s, bubble {:.3} s, dp comm {:.3} s, optimizer {:.3} s",
        t.compute_s,
        t.recompute_s,
        t.exposed_comm_s,
        t.pipeline_p2p_s,
        t.bubble_s,
        t.exposed_dp_comm_s,
        t.optimizer_s
    ) + &if t.overlap_slowdown_s > 0.0 {
        format!(", overlap slowdown {:.3} s", t.overlap_slowdown_s)
    } else {
        String::new()
    } + &if t.offload_s > 0.0 {
        format!(", offload {:.3} s", t.offload_s)
    } else {
        String::new()
    }
}

/// Memory per rank of `stages` by kind, GiB, and the share of the capacity,
/// each line starting with `indent`.
pub fn memory_table(plan: &Plan, stages: &[u64], indent: &str) -> String {
    let mut s = String::new();
    let _ = writeln!(
        s,
        "{indent}stage  layers  weights  grads  optimizer  activations  emb+loss  buffers    total   use"
    );
    for &i in stages {
        let Some(st) = plan.stages.get(i as usize) else {
            continue;
        };
        let m = &st.memory;
        let _ = writeln!(
            s,
            "{indent}{:>5}  {:>6}  {:>7}  {:>5}  {:>9}  {:>11}  {:>8}  {:>7}  {:>7}  {:>3.0}%",
            st.stage,
            st.layers,
            gib(m.weights),
            gib(m.gradients),
            gib(m.optimizer),
            gib(m.activations),
            gib(m.embedding_and_loss),
            gib(m.buffers),
            gib(m.total()),
            100.0 * m.total() as f64 / plan.cluster.memory_bytes.max(1) as f64
        );
    }
    let host = stages
        .iter()
        .filter_map(|&i| plan.stages.get(i as usize))
        .map(|st| st.memory.host)
        .max()
        .unwrap_or(0);
    if host > 0 {
        let _ = writeln!(
            s,
            "{indent}offloaded {} GiB per rank to host memory ({}), not in the totals",
            gib(host),
            plan.strategy.offload.name()
        );
    }
    s
}

/// The human summary `dplc compile` prints.
pub fn summary(compiled: &Compiled) -> String {
    let p = &compiled.plan;
    let mut s = String::new();
    let cl = &p.cluster;
    let _ = writeln!(
        s,
        "plan {} ({} params, {} layers) on {} ({} × {} {})",
        p.model,
        crate::report::si(p.params as f64),
        p.layers,
        cl.name,
        cl.nodes,
        cl.devices_per_node,
        cl.device
    );
    let _ = writeln!(s, "  mesh      {}", p.mesh);
    for a in p.mesh.axes.iter().filter(|a| a.size > 1) {
        let _ = writeln!(
            s,
            "    {:<3} {:>5}  stride {:<5} {:<11} {:>7.1} GB/s per device",
            a.axis.name(),
            a.size,
            a.stride,
            link_name(a.link),
            a.bandwidth_bytes_per_s / 1e9
        );
    }
    let _ = writeln!(s, "  strategy  {}", p.strategy);
    let last = p.stages.len() - 1;
    let layers: Vec<u64> = p.stages.iter().map(|st| st.layers).collect();
    let same = layers.iter().all(|&l| l == layers[0]);
    let per_stage = if same {
        format!("{} layers", layers[0])
    } else {
        format!("layers {layers:?}")
    };
    let ends = if last == 0 {
        "with the embedding, head and loss".to_string()
    } else {
        format!("; stage 0 holds the embedding, stage {last} the head and loss")
    };
    let _ = writeln!(
        s,
        "  stages    {} × {per_stage}{}{ends}",
        p.stages.len(),
        if last == 0 { " " } else { "" }
    );
    let _ = writeln!(
        s,
        "  memory per rank, GiB (capacity {})",
        gib(cl.memory_bytes)
    );
    let peak_stage = p
        .stages
        .iter()
        .max_by_key(|st| (st.memory.total(), std::cmp::Reverse(st.stage)))
        .map_or(0, |st| st.stage);
    let mut shown: Vec<u64> = vec![0, 1, last as u64, peak_stage];
    shown.retain(|&i| (i as usize) <= last);
    shown.sort();
    shown.dedup();
    s.push_str(&memory_table(p, &shown, "    "));
    let e = &p.estimate;
    let _ = writeln!(
        s,
        "  step      {:.3} s: {}",
        e.step_time_s,
        time_line(&e.breakdown)
    );
    let _ = writeln!(
        s,
        "  speed     {}; model {:.1} TFLOP/s/GPU, hardware {:.1} TFLOP/s/GPU, MFU {:.1}%",
        throughput(e),
        e.model_tflops_per_gpu,
        e.hardware_tflops_per_gpu,
        e.mfu * 100.0
    );
    let _ = writeln!(
        s,
        "  search    {} configurations of {} the knobs span (the rest settled analytically), {} fit, {:.0} ms{}",
        p.search.configs_evaluated,
        p.search.space.max(p.search.configs_evaluated),
        p.search.feasible,
        compiled.search_time_ms,
        if p.search.pinned.is_empty() {
            String::new()
        } else {
            format!("; pinned {}", p.search.pinned)
        }
    );
    if let Some(caveat) = compiled.caveat() {
        let _ = writeln!(s, "  caveat    {caveat}");
    }
    for a in &p.alternatives {
        let _ = writeln!(
            s,
            "  #{:<2} {:.3} s  {}; {}: {}",
            a.rank, a.step_time_s, a.mesh, a.strategy, a.reason
        );
    }
    s
}

/// What `dplc compile --verbose` adds: every e-graph the search ran and the
/// chosen plan's per-rank programs with their collectives.
pub fn layouts_summary(compiled: &Compiled) -> String {
    let mut s = String::new();
    let _ = writeln!(
        s,
        "  layouts   {} e-graphs (one per region and distinct tp × ep{})",
        compiled.layouts.len(),
        if compiled.plan.strategy.sequence_parallel {
            ", and the plan's under sequence parallelism"
        } else {
            ""
        }
    );
    let _ = writeln!(
        s,
        "    region  tp  ep  sp   nodes  classes  iters  stop             time ms  collectives"
    );
    for l in &compiled.layouts {
        let _ = writeln!(
            s,
            "    {:<6} {:>3} {:>3}  {:<3} {:>6}  {:>7}  {:>5}  {:<15} {:>8.2}  {:>11}",
            l.region,
            l.tp,
            l.ep,
            if l.sequence_parallel { "on" } else { "off" },
            l.egraph_nodes,
            l.egraph_classes,
            l.iterations,
            l.stop_reason,
            l.time_ms,
            l.collectives
        );
    }
    for d in &compiled.plan.search.skipped {
        let _ = writeln!(
            s,
            "    skipped tp {} ep {}: {} (not searched)",
            d.tp, d.ep, d.reason
        );
    }
    for prog in &compiled.plan.programs {
        let _ = writeln!(
            s,
            "  program   {} at tp {} ep {} sp {}: {} values",
            prog.region,
            prog.tp,
            prog.ep,
            if prog.sequence_parallel { "on" } else { "off" },
            prog.values.len()
        );
        for v in prog.values.iter().filter(|v| v.collective.is_some()) {
            let _ = writeln!(s, "    forward   {} = {} : {}", v.name, v.expr, v.shape);
        }
        for b in &prog.backward {
            let _ = writeln!(
                s,
                "    backward  {} {} of {} ({} elements)",
                b.kind.name(),
                b.axis.name(),
                b.of,
                b.elements
            );
        }
    }
    s
}

/// A number with an SI prefix, e.g. `1.3 G`.
/// `12.3k tokens/s`, or samples/s for a model without a sequence.
pub fn throughput(e: &dplc_ir::Estimate) -> String {
    match e.samples_per_s {
        Some(samples) => format!("{} samples/s", si(samples)),
        None => format!("{} tokens/s", si(e.tokens_per_s)),
    }
}

pub(crate) fn si(x: f64) -> String {
    let units = [(1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")];
    for (scale, u) in units {
        if x.abs() >= scale {
            return format!("{:.1}{u}", x / scale);
        }
    }
    format!("{x:.0}")
}

/// The `--json` object.
pub fn to_json(compiled: &Compiled) -> serde_json::Value {
    let p = &compiled.plan;
    let s = &p.strategy;
    let e = &p.estimate;
    json!({
        "model": p.model,
        "cluster": p.cluster.name,
        "mesh": {
            "dp": p.mesh.dp, "tp": p.mesh.tp, "pp": p.mesh.pp, "cp": p.mesh.cp, "ep": p.mesh.ep,
            "axes": p.mesh.axes.iter().map(|a| json!({
                "axis": a.axis.name(), "size": a.size, "stride": a.stride,
                "link": link_name(a.link), "bandwidth_bytes_per_s": a.bandwidth_bytes_per_s,
            })).collect::<Vec<_>>(),
        },
        "strategy": {
            "micro_batch": s.micro_batch,
            "num_micro_batches": s.num_micro_batches,
            "global_batch": s.global_batch,
            "seq": s.seq,
            "schedule": s.schedule.name(),
            "virtual_stages": s.virtual_stages,
            "zero_stage": s.zero_stage,
            "recompute": s.recompute.name(),
            "sequence_parallel": s.sequence_parallel,
            "overlap_grad_reduce": s.overlap_grad_reduce,
            // The engine's stack the plan is priced on.
            "attention": s.attention.name(),
            "tp_overlap": s.tp_overlap.name(),
            "grad_accum": s.grad_accum.name(),
            "grad_reduce": s.grad_reduce.name(),
            "dispatch": s.dispatch.name(),
            "root": s.root.name(),
            "fp8": s.fp8,
            "offload": s.offload.name(),
            "autocast": s.autocast,
            "elementwise": s.elementwise.name(),
            "loss": s.loss.name(),
            "shards": s.shards.name(),
            "tp_impl": s.tp_impl.name(),
            "compress": s.compress.name(),
            // Every choice in words, as `compile` prints it.
            "description": s.to_string(),
        },
        "estimate": {
            "step_time_s": e.step_time_s,
            "tokens_per_s": e.tokens_per_s,
            "samples_per_s": e.samples_per_s,
            "model_tflops_per_gpu": e.model_tflops_per_gpu,
            "hardware_tflops_per_gpu": e.hardware_tflops_per_gpu,
            "mfu": e.mfu,
            "peak_memory_bytes": e.peak_memory_bytes,
            "breakdown": {
                "compute_s": e.breakdown.compute_s,
                "recompute_s": e.breakdown.recompute_s,
                "exposed_comm_s": e.breakdown.exposed_comm_s,
                "overlapped_comm_s": e.breakdown.overlapped_comm_s,
                "pipeline_p2p_s": e.breakdown.pipeline_p2p_s,
                "bubble_s": e.breakdown.bubble_s,
                "exposed_dp_comm_s": e.breakdown.exposed_dp_comm_s,
                "optimizer_s": e.breakdown.optimizer_s,
                "overlap_slowdown_s": e.breakdown.overlap_slowdown_s,
                "offload_s": e.breakdown.offload_s,
            },
            "memory_by_stage": p.stages.iter().map(|st| json!({
                "stage": st.stage,
                "layers": st.layers,
                "weights": st.memory.weights,
                "gradients": st.memory.gradients,
                "optimizer": st.memory.optimizer,
                "activations": st.memory.activations,
                "embedding_and_loss": st.memory.embedding_and_loss,
                "buffers": st.memory.buffers,
                "total": st.memory.total(),
            })).collect::<Vec<_>>(),
        },
        "search": {
            "configs_evaluated": p.search.configs_evaluated,
            "space": p.search.space,
            "feasible": p.search.feasible,
            "time_ms": compiled.search_time_ms,
        },
        "caveat": compiled.caveat(),
        "alternatives": p.alternatives.iter().map(|a| json!({
            "rank": a.rank,
            "mesh": {"dp": a.mesh.dp, "tp": a.mesh.tp, "pp": a.mesh.pp, "cp": a.mesh.cp, "ep": a.mesh.ep},
            "strategy": a.strategy.to_string(),
            "step_time_s": a.step_time_s,
            "peak_memory_bytes": a.peak_memory_bytes,
            "reason": a.reason,
        })).collect::<Vec<_>>(),
    })
}
