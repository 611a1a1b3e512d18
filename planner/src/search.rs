//! The strategy search: enumerate meshes, micro-batching, schedules, ZeRO,
//! recomputation and sequence parallelism; prune by memory; keep the fastest.
//!
//! Architecture invariant: the search is deterministic. Loops run in a fixed
//! order and ties break on the configuration's total order, never on hash order.

use crate::cluster::Cluster;
use crate::cost::{step_total, AxisOrder, Config, CostModel};
use crate::layouts::Layouts;
use crate::profile::ModelProfile;
use crate::{PlanError, StrategyConstraints};
use dplc_ir::validate::{self as rules, divisors};
use dplc_ir::{
    AttentionKind, Compression, GradReduce, GradSync, MemoryBreakdown, Offload, PipelineSchedule,
    Recompute, TimeBreakdown, TpOverlap,
};
use fxhash::FxHashMap as HashMap;

/// One evaluated, feasible configuration.
#[derive(Clone, Debug)]
pub(crate) struct Candidate {
    pub config: Config,
    pub step_time: f64,
    pub time: TimeBreakdown,
    pub peak_memory: u64,
    pub counts: Vec<u64>,
}

/// The configuration with the least memory, kept to explain an infeasible model.
#[derive(Clone, Debug)]
pub(crate) struct Smallest {
    pub config: Config,
    pub stage: u64,
    pub memory: MemoryBreakdown,
}

#[derive(Default)]
pub(crate) struct Outcome {
    /// Best first; at most `top_k + 1`.
    pub best: Vec<Candidate>,
    pub evaluated: u64,
    pub feasible: u64,
    pub smallest: Option<Smallest>,
    /// Of the configurations that fit the device but offload more than a
    /// rank's share of the host holds, the one needing the least host
    /// memory (its stage's breakdown, `host` the bytes): what an infeasible
    /// offloaded model is short of.
    pub host_short: Option<Smallest>,
}

impl Outcome {
    /// `s` kept as the host-memory shortfall if it needs less host than the last.
    fn note_host_short(&mut self, s: Smallest) {
        if self
            .host_short
            .as_ref()
            .is_none_or(|t| s.memory.host < t.memory.host)
        {
            self.host_short = Some(s);
        }
    }
}

fn allowed(pin: Option<u64>, v: u64) -> bool {
    pin.is_none_or(|p| p == v)
}

/// Check the pinned choices against the model and cluster before searching.
pub(crate) fn validate(
    pins: &StrategyConstraints,
    layouts: &Layouts,
    profile: &ModelProfile,
    world: u64,
    global_batch: u64,
    seq: u64,
) -> Result<(), PlanError> {
    let bad = |m: String| Err(PlanError::Strategy(m));
    let degrees = [
        ("tp", pins.tp),
        ("pp", pins.pp),
        ("dp", pins.dp),
        ("cp", pins.cp),
    ];
    let mut product = 1u64;
    for (name, d) in degrees {
        if let Some(d) = d {
            if !world.is_multiple_of(d) {
                return bad(format!("{name}={d} does not divide the {world} devices"));
            }
            product = product.saturating_mul(d);
        }
    }
    if !world.is_multiple_of(product) {
        return bad(format!(
            "{pins}: the pinned degrees multiply to {product}, which does not divide the {world} devices"
        ));
    }
    if let (Some(tp), Some(pp), Some(dp), Some(cp)) = (pins.tp, pins.pp, pins.dp, pins.cp) {
        rules::mesh_fills(dp, tp, pp, cp, world)
            .map_err(|why| PlanError::Strategy(format!("{pins}: {why}")))?;
    }
    // Expert groups are carved from the data-parallel ranks, which the
    // pinned degrees bound: say so before asking for layouts the search
    // never builds for such a split.
    if let (Some(ep), None) = (pins.ep, pins.dp) {
        let others = pins.tp.unwrap_or(1) * pins.pp.unwrap_or(1) * pins.cp.unwrap_or(1);
        let most = world / others.max(1);
        if others > 1 && rules::expert_groups(ep, most).is_err() {
            return bad(format!(
                "{pins}: ep={ep} needs its expert groups inside the data-parallel ranks, and the \
                 pinned degrees leave at most {most} of the {world} devices to them; lower ep or \
                 the other degrees"
            ));
        }
    }
    if let Some(tp) = pins.tp {
        if let Err(why) = layouts.at_tp(tp) {
            return bad(format!("tp={tp} cannot split the layer: {why}"));
        }
    }
    let pin = |key: &str, rule: Result<(), String>| {
        rule.map_err(|why| PlanError::Strategy(format!("{key}: {why}")))
    };
    if let Some(pp) = pins.pp {
        pin("pp", rules::pipeline_depth(pp, profile.layers))?;
    }
    if let Some(v) = pins.virtual_stages {
        let pp = pins.pp.unwrap_or(1);
        if v > 1 && profile.layers < pp.saturating_mul(v) {
            return bad(format!(
                "v={v} with pp={pp}: the {} layers cannot give each of the {pp} × {v} chunks a layer",
                profile.layers,
            ));
        }
    }
    if let Some(cp) = pins.cp {
        pin(
            "cp",
            rules::context(cp, seq, profile.context_refusal.as_deref()),
        )?;
    }
    if let Some(ep) = pins.ep {
        pin("ep", rules::expert_count(ep, profile.experts))?;
        if let Some(dp) = pins.dp {
            pin("ep", rules::expert_groups(ep, dp))?;
        }
    }
    if pins.dispatch == Some(dplc_ir::Dispatch::Hierarchical) && profile.experts.is_none() {
        return bad(
            "dispatch=hierarchical routes tokens to experts, but the model has no experts".into(),
        );
    }
    // A pinned chunked overlap with nothing to overlap is a slip, as sp=on at
    // tp=1 is (Megatron's asynchronous backward is the default, which a
    // plan's own pins carry at any tp).
    if pins.tp == Some(1) && pins.tp_overlap == Some(TpOverlap::Ring) {
        return bad(format!(
            "tp_overlap={} overlaps tensor-parallel communication, and tp=1 has none; \
             drop tp_overlap or raise tp",
            pins.tp_overlap.map_or("", |o| o.name())
        ));
    }
    if pins.ep == Some(1) && pins.dispatch == Some(dplc_ir::Dispatch::Hierarchical) {
        return bad(
            "dispatch=hierarchical routes tokens between expert-parallel ranks, and ep=1 has \
             none; drop dispatch or raise ep"
                .into(),
        );
    }
    if let Some(tp) = pins.tp {
        // Unpinned, cp is 1 or a divisor of seq: tp must divide seq either way.
        let cp = pins.cp.unwrap_or(1);
        pin(
            "sp",
            rules::sequence_parallel(pins.sequence_parallel == Some(true), tp, cp, seq),
        )?;
    }
    if let Some(dp) = pins.dp {
        if !global_batch.is_multiple_of(dp) {
            return bad(format!(
                "dp={dp} does not divide the global batch {global_batch}"
            ));
        }
        if let Some(mb) = pins.micro_batch {
            if !(global_batch / dp).is_multiple_of(mb) {
                return bad(format!(
                    "mb={mb} does not divide the {} sequences each of the {dp} replicas gets",
                    global_batch / dp
                ));
            }
        }
    }
    if let (Some(dp), Some(mb), Some(m)) = (pins.dp, pins.micro_batch, pins.num_micro_batches) {
        pin("m", rules::batch_split(global_batch, dp, mb, m))?;
    }
    Ok(())
}

/// The most rows (micro-batch × sequence) a micro-batch's GEMMs get that
/// the search still tries to grow: past 64 samples of 2,048 tokens the GEMMs
/// are large already. Counted in rows, not samples, so short-sequence and
/// sequence-less models (a ViT's 197 patches, a classifier) may use the
/// larger micro-batches their GEMMs need.
const MAX_MICRO_BATCH_ROWS: u64 = 64 * 2048;

/// The compressions `--allow compress` lets the search try, and `explain`
/// prices as what-ifs: one setting of each, the ones the papers lead with
/// (PowerSGD at rank 4, top-k at 1%), warm-ups as the schedule's.
pub(crate) const COMPRESSIONS: [Compression; 4] = [
    Compression::None,
    Compression::Bf16,
    Compression::PowerSgd {
        rank: 4,
        warmup: None,
    },
    Compression::TopK {
        per_million: 10_000,
        warmup: None,
    },
];

/// The best `top_k + 1` configurations of `global_batch` sequences of `seq`
/// tokens on `cluster` that keep `pins`, each offloading one of `offloads`.
pub(crate) fn search(
    layouts: &Layouts,
    cluster: &Cluster,
    (global_batch, seq): (u64, u64),
    pins: &StrategyConstraints,
    offloads: &[Offload],
    top_k: usize,
    ignore_memory: bool,
) -> Outcome {
    let profile = &layouts
        .get((1, 1))
        .expect("compile checks the single-rank layout first")
        .profile;
    let world = cluster.world_size();
    // `--top` is the user's number: any count past the configurations
    // there are keeps them all, so the largest one must not wrap to zero.
    let keep = top_k.saturating_add(1);
    let layers = profile.layers;
    let tps: Vec<u64> = divisors(world)
        .into_iter()
        .filter(|&t| {
            allowed(pins.tp, t)
                && layouts.at_tp(t).is_ok()
                && (t <= cluster.devices_per_node || pins.tp == Some(t))
        })
        .collect();
    // The meshes, in a fixed order; each is searched on its own (the
    // partitions it caches are its own) and the outcomes fold in this order.
    let mut meshes: Vec<(u64, u64, u64)> = Vec::new();
    for &tp in &tps {
        for cp in divisors(world / tp) {
            // Context parallelism pays off only for long sequences; it stays on the
            // menu up to 8 ranks when pinned or when seq ≥ 8192.
            let cp_useful = cp == 1 || (seq >= 8192 && cp <= 8);
            if !allowed(pins.cp, cp)
                || rules::context(cp, seq, profile.context_refusal.as_deref()).is_err()
                || !(cp_useful || pins.cp == Some(cp))
            {
                continue;
            }
            for pp in divisors(world / (tp * cp)) {
                if !allowed(pins.pp, pp) || pp > layers {
                    continue;
                }
                let dp = world / (tp * cp * pp);
                if !allowed(pins.dp, dp) || !global_batch.is_multiple_of(dp) {
                    continue;
                }
                meshes.push((tp, cp, pp));
            }
        }
    }
    let shared = Mesh {
        layouts,
        cluster,
        profile,
        pins,
        offloads,
        global_batch,
        seq,
        keep,
        ignore_memory,
    };
    let outcomes = crate::deal::map_with(&meshes, HashMap::default, |costs, &mesh| {
        shared.explore(mesh, costs)
    });
    let mut out = Outcome::default();
    for o in outcomes {
        out.evaluated += o.evaluated;
        out.feasible += o.feasible;
        if let Some(s) = o.smallest {
            if out
                .smallest
                .as_ref()
                .is_none_or(|t| s.memory.total() < t.memory.total())
            {
                out.smallest = Some(s);
            }
        }
        if let Some(s) = o.host_short {
            out.note_host_short(s);
        }
        for cand in o.best {
            insert(&mut out.best, cand, keep);
        }
    }
    out
}

/// What every mesh of one search shares.
struct Mesh<'a> {
    layouts: &'a Layouts,
    cluster: &'a Cluster,
    profile: &'a ModelProfile,
    pins: &'a StrategyConstraints,
    offloads: &'a [Offload],
    global_batch: u64,
    seq: u64,
    keep: usize,
    ignore_memory: bool,
}

impl<'a> Mesh<'a> {
    /// The best configurations on the mesh `(tp, cp, pp)` (dp the rest),
    /// with `costs` the worker's cost models by (tp, ep).
    fn explore(
        &self,
        (tp, cp, pp): (u64, u64, u64),
        costs: &mut HashMap<(u64, u64), CostModel<'a>>,
    ) -> Outcome {
        let (pins, profile) = (self.pins, self.profile);
        let dp = self.cluster.world_size() / (tp * cp * pp);
        let capacity = self.cluster.device.memory_bytes;
        // Rows one sample puts into a GEMM: its tokens, or 1 without a sequence.
        let rows_per_sample = if profile.seq_sym.is_some() {
            self.seq
        } else {
            1
        };
        let mut out = Outcome::default();
        let mut partitions: HashMap<(Config, Option<u64>), Vec<u64>> = HashMap::default();
        let eps: Vec<u64> = match profile.experts {
            Some(e) => divisors(dp)
                .into_iter()
                .filter(|&x| {
                    e % x == 0 && allowed(pins.ep, x) && self.layouts.get((tp, x)).is_some()
                })
                .collect(),
            None => vec![1],
        };
        let orders: &[AxisOrder] = match pins.order {
            Some(AxisOrder::PipelineInner) if dp > 1 && pp > 1 => &[AxisOrder::PipelineInner],
            None if dp > 1 && pp > 1 => &[AxisOrder::DataInner, AxisOrder::PipelineInner],
            _ => &[AxisOrder::DataInner],
        };
        let per_replica = self.global_batch / dp;
        let grad_reduces = grad_reduces(pins, profile.precision, dp * cp);
        for &ep in &eps {
            let Some(layout) = self.layouts.get((tp, ep)) else {
                continue;
            };
            let root = pins.root.unwrap_or_else(|| layout.default_root());
            let cost = costs.entry((tp, ep)).or_insert_with(|| {
                CostModel::new(layout.profile_for(root), self.cluster, self.seq)
            });
            for &order in orders {
                for mb in divisors(per_replica) {
                    if !allowed(pins.micro_batch, mb)
                        || (mb.saturating_mul(rows_per_sample) > MAX_MICRO_BATCH_ROWS
                            && mb > 1
                            && pins.micro_batch != Some(mb))
                    {
                        continue;
                    }
                    let m = per_replica / mb;
                    if !allowed(pins.num_micro_batches, m)
                        || rules::pipeline_passes(m, 1, pp).is_err()
                    {
                        continue;
                    }
                    let base = Config {
                        tp,
                        cp,
                        pp,
                        dp,
                        ep,
                        micro_batch: mb,
                        num_micro_batches: m,
                        schedule: PipelineSchedule::OneFOneB,
                        virtual_stages: 1,
                        zero: 0,
                        recompute: Recompute::None,
                        recompute_layers: pins.recompute_layers.unwrap_or(0),
                        sp: false,
                        overlap: pins.overlap_grad_reduce.unwrap_or(true),
                        attention: pins.attention.unwrap_or(AttentionKind::Fused),
                        tp_overlap: pins.tp_overlap.unwrap_or(TpOverlap::Async),
                        grad_accum: pins.grad_accum.unwrap_or_default(),
                        grad_reduce: GradReduce::Fp32,
                        dispatch: pins.dispatch.unwrap_or_default(),
                        root,
                        order,
                        even_stages: pins.even_stages.unwrap_or(false),
                        fp8: pins.fp8.unwrap_or(false),
                        fp8_gather: pins.fp8_gather.unwrap_or(false),
                        fp8_bf16_ends: pins.fp8_bf16_ends.unwrap_or(0),
                        offload: Offload::NONE,
                        autocast: pins.autocast.unwrap_or(false),
                        elementwise: pins.elementwise.unwrap_or_default(),
                        loss: pins.loss.unwrap_or_default(),
                        shards: pins.shards.unwrap_or_default(),
                        tp_impl: pins.tp_impl.unwrap_or_default(),
                        sync: GradSync::AllReduce,
                        compress: Compression::None,
                    };
                    for (&offload, &grad_reduce) in self
                        .offloads
                        .iter()
                        .flat_map(|o| grad_reduces.iter().map(move |g| (o, g)))
                    {
                        explore(
                            Config {
                                offload,
                                grad_reduce,
                                ..base
                            },
                            profile,
                            pins,
                            cost,
                            &mut partitions,
                            &mut out,
                            (capacity, self.cluster.device.host_memory_bytes),
                            self.keep,
                            self.ignore_memory,
                        );
                    }
                }
            }
        }
        out
    }
}

/// The main gradients' precisions to try for `replicas` replicas: the
/// pinned one, else fp32, and the training precision too where `--allow
/// grad_reduce` names it and there is a reduction for it to halve.
fn grad_reduces(
    pins: &StrategyConstraints,
    precision: dplc_ir::Precision,
    replicas: u64,
) -> Vec<GradReduce> {
    match (pins.grad_reduce, GradReduce::half_for(precision)) {
        (Some(g), _) => vec![g],
        (None, Some(h)) if pins.allow.grad_reduce && replicas > 1 => vec![GradReduce::Fp32, h],
        _ => vec![GradReduce::Fp32],
    }
}

/// The gradient synchronisations and compressions to try for `dp`
/// replicas: the pinned ones, else the all-reduce of fp32 gradients, and
/// more only where `--allow` names them (they change the training
/// dynamics, so they are the user's call). A parameter server has as many
/// shards as workers unless pinned; compression runs over the all-reduce.
///
/// Dedicated server ranks are devices the cluster does not list: the search
/// prices them only when pinned, and only where the runtime runs them
/// (`dedicated_ok`: no context or expert parallelism).
pub(crate) fn dp_reductions(
    pins: &StrategyConstraints,
    dp: u64,
    dedicated_ok: bool,
) -> Vec<(GradSync, Compression)> {
    let Ok(pinned_sync) = pins.grad_sync(dp) else {
        return Vec::new();
    };
    let syncs: Vec<GradSync> = match pinned_sync {
        Some(s) if s.dedicated_servers() > 0 && !dedicated_ok => Vec::new(),
        Some(s) => vec![s],
        None if pins.allow.sync && dp > 1 => vec![
            GradSync::AllReduce,
            GradSync::ps(dp),
            GradSync::async_ps(dp, 1),
        ],
        None => vec![GradSync::AllReduce],
    };
    let compressions: Vec<Compression> = match pins.compress {
        Some(c) => vec![c],
        None if pins.allow.compress && dp > 1 => COMPRESSIONS.to_vec(),
        None => vec![Compression::None],
    };
    syncs
        .iter()
        .flat_map(|&s| compressions.iter().map(move |&c| (s, c)))
        .filter(|&(s, c)| s == GradSync::AllReduce || c == Compression::None)
        .collect()
}

/// Schedules worth trying for `pp` stages and `m` micro-batches.
fn schedules(
    pp: u64,
    m: u64,
    layers: u64,
    pins: &StrategyConstraints,
) -> Vec<(PipelineSchedule, u64)> {
    let mut v = Vec::new();
    if pp == 1 {
        v.push((PipelineSchedule::OneFOneB, 1));
    } else {
        v.push((PipelineSchedule::OneFOneB, 1));
        v.push((PipelineSchedule::GPipe, 1));
        // Megatron needs the micro-batches to be a multiple of the stages.
        // Chunks that differ by a layer run and are priced when `v` is
        // pinned; unasked the search keeps to the chunks Megatron builds:
        // equal ones, or equal but for the first and the last, a layer
        // short beside the embedding and the loss it counts as layers
        // (`--account-for-embedding/loss-in-pipeline-split`; Llama 3.1
        // 405B's 126 layers and those two in 16 stages of 8, as the Llama 3
        // paper splits them). `CostModel::partition` takes the split.
        for chunks in 2..=(layers / pp) {
            let megatron = layers.is_multiple_of(pp * chunks)
                || [(true, false), (false, true), (true, true)]
                    .iter()
                    .any(|&(e, l)| {
                        dplc_ir::accounted_stage_layers(layers, pp, chunks, e, l).is_some()
                    });
            if (megatron || pins.virtual_stages == Some(chunks))
                && rules::interleaving(layers, pp, chunks, m).is_ok()
                && rules::pipeline_passes(m, chunks, pp).is_ok()
            {
                v.push((PipelineSchedule::Interleaved, chunks));
            }
        }
    }
    v.retain(|&(s, chunks)| {
        allowed(pins.schedule.map(|x| x as u64), s as u64)
            && allowed(pins.virtual_stages, chunks)
            && !(pins.schedule == Some(PipelineSchedule::Interleaved) && pp == 1)
    });
    if pp == 1 && pins.schedule.is_some() {
        // One stage has no pipeline: any pinned schedule means the same thing.
        v = vec![(pins.schedule.unwrap_or(PipelineSchedule::OneFOneB), 1)];
    }
    v
}

#[allow(clippy::too_many_arguments)]
fn explore(
    base: Config,
    profile: &ModelProfile,
    pins: &StrategyConstraints,
    cost: &mut CostModel,
    partitions: &mut HashMap<(Config, Option<u64>), Vec<u64>>,
    out: &mut Outcome,
    (capacity, host_capacity): (u64, u64),
    keep: usize,
    ignore_memory: bool,
) {
    // The peaks of the configurations that do not fit without recomputation:
    // where one does fit, partial recomputation of it is slower and not
    // searched for; where it does not, its peak starts the search for the
    // fewest layers to recompute.
    let mut whole_peaks: fxhash::FxHashMap<Config, u64> = fxhash::FxHashMap::default();
    let sps: &[bool] = if rules::sequence_parallel(true, base.tp, base.cp, cost.seq).is_ok() {
        &[false, true]
    } else {
        &[false]
    };
    for &sp in sps {
        if pins.sequence_parallel.is_some_and(|p| p != sp) {
            continue;
        }
        for recompute in [
            Recompute::None,
            Recompute::Selective,
            Recompute::Full,
            Recompute::Op,
        ] {
            if pins.recompute.is_some_and(|p| p != recompute)
                || (pins.recompute_layers.is_some() && recompute != Recompute::Full)
            {
                continue;
            }
            // torchtitan's op-level policy is an engine's, priced when pinned.
            if recompute == Recompute::Op && pins.recompute.is_none() {
                continue;
            }
            // Under fused attention selective recomputation drops nothing: it
            // is the plan without recomputation, unless pinned.
            if recompute == Recompute::Selective
                && base.attention.is_fused()
                && pins.recompute.is_none()
            {
                continue;
            }
            for (schedule, v) in schedules(base.pp, base.num_micro_batches, profile.layers, pins) {
                // Offloaded weights are ZeRO-3's shards (ZeRO-Infinity), one
                // rank's included.
                let one_rank: [u8; 1];
                let zeros: &[u8] = if base.offload.params {
                    &[3]
                } else if base.dp * base.cp == 1 {
                    // Nothing to shard over one rank; but DeepSpeed's
                    // ZeRO-Offload runs an offloaded optimizer on one GPU
                    // under a ZeRO stage, so a pinned one is kept there.
                    one_rank = [match pins.zero {
                        Some(z @ 1..=3) if base.offload.optimizer => z,
                        _ => 0,
                    }];
                    &one_rank
                } else if base.pp > 1 && pins.zero.is_none() {
                    // Sharded gradients and weights under a pipeline
                    // (torchtitan's FSDP + PP) run and are priced when
                    // pinned; unasked the search keeps to what Megatron's
                    // and DeepSpeed's pipelines run (ZeRO-1 at most), the
                    // engines a plan is most often handed to.
                    &[0, 1]
                } else {
                    &[0, 1, 2, 3]
                };
                let reductions =
                    dp_reductions(pins, base.dp * base.cp, base.cp == 1 && base.ep == 1);
                for (&zero, &(sync, compress)) in zeros
                    .iter()
                    .flat_map(|z| reductions.iter().map(move |r| (z, r)))
                {
                    if pins.zero.is_some_and(|z| z != zero) {
                        continue;
                    }
                    // The runtime runs a parameter server and compression
                    // over replicated state only (ZeRO-0).
                    if zero > 0 && (sync != GradSync::AllReduce || compress != Compression::None) {
                        continue;
                    }
                    let c = Config {
                        sp,
                        recompute,
                        schedule,
                        virtual_stages: v,
                        zero,
                        sync,
                        compress,
                        ..base
                    };
                    out.evaluated += 1;
                    // Interleaved, the split keeps a layer in each of a stage's chunks.
                    let interleaved = (schedule == PipelineSchedule::Interleaved).then_some(v);
                    let key = (
                        Config {
                            zero: 0,
                            recompute_layers: 0,
                            schedule: PipelineSchedule::OneFOneB,
                            virtual_stages: 1,
                            order: AxisOrder::DataInner,
                            ..c
                        },
                        interleaved,
                    );
                    let counts = partitions
                        .entry(key)
                        .or_insert_with(|| cost.partition(&c))
                        .clone();
                    let (peak, stage) = cost.peak_memory(&c, &counts);
                    let searched = pins.recompute.is_none()
                        && pins.recompute_layers.is_none()
                        && !ignore_memory;
                    if searched && c.recompute == Recompute::None {
                        whole_peaks.insert(c, peak);
                    }
                    // Unasked, full recomputation also tries only the layers
                    // it must: the fewest of each chunk that fit — where
                    // nothing recomputed does not fit, or where what is kept
                    // goes to the host and back (its traffic may cost more
                    // than recomputing it).
                    let partial = match whole_peaks.get(&c.keeping_every_layer()) {
                        Some(&whole)
                            if searched
                                && c.recompute == Recompute::Full
                                && peak <= capacity
                                && (whole > capacity || c.offload.activations) =>
                        {
                            fewest_recomputed(cost, c, &counts, capacity, (whole, peak))
                        }
                        _ => None,
                    };
                    let limits = (capacity, host_capacity, ignore_memory);
                    if let Some(p) = partial {
                        out.evaluated += 1;
                        consider(cost, out, p, counts.clone(), limits, keep);
                    }
                    consider(cost, out, (c, peak, stage), counts, limits, keep);
                }
            }
        }
    }
}

/// Keep `c` (peaking at `peak` on `stage` with the stages holding
/// `counts` layers) among the best if it fits the device and host memory of
/// `limits`, and note it if its peak is the smallest yet.
fn consider(
    cost: &mut CostModel,
    out: &mut Outcome,
    (c, peak, stage): (Config, u64, u64),
    counts: Vec<u64>,
    (capacity, host_capacity, ignore_memory): (u64, u64, bool),
    keep: usize,
) {
    let smaller = out
        .smallest
        .as_ref()
        .is_none_or(|s| peak < s.memory.total());
    if smaller {
        out.smallest = Some(Smallest {
            config: c,
            stage,
            memory: cost.stage_memory(&c, &counts, stage),
        });
    }
    if peak > capacity && !ignore_memory {
        return;
    }
    if !c.offload.is_none() && !ignore_memory {
        let (stage, memory) = (0..c.pp)
            .map(|i| (i, cost.stage_memory(&c, &counts, i)))
            .max_by_key(|(_, m)| m.host)
            .expect("a plan has a stage");
        if memory.host > host_capacity {
            out.note_host_short(Smallest {
                config: c,
                stage,
                memory,
            });
            return;
        }
    }
    out.feasible += 1;
    let time = cost.step_time(&c, &counts);
    let cand = Candidate {
        config: c,
        step_time: step_total(&time),
        time,
        peak_memory: peak,
        counts,
    };
    insert(&mut out.best, cand, keep);
}

/// The configuration recomputing the fewest layers of each chunk (the
/// first ones, Megatron's block method) whose peak still fits `capacity`,
/// with its peak and the stage at it; `None` when only every layer fits.
/// `c` recomputes every layer and fits, at peak `every`; without
/// recomputation it peaks at `none` (over `capacity`, or under it with the
/// activations offloaded: then the fewest is one). The peak falls as
/// more layers are recomputed, close to linearly (each layer recomputed
/// keeps its input instead of its activations): the line through the two
/// ends gives a first guess, and a walk from it finds the fewest, in a
/// step or two where the line holds.
fn fewest_recomputed(
    cost: &mut CostModel,
    c: Config,
    counts: &[u64],
    capacity: u64,
    (none, every): (u64, u64),
) -> Option<(Config, u64, u64)> {
    // The longest chunk: an even split of the largest stage.
    let v = crate::stages::chunks(&c);
    let longest = counts.iter().max().map_or(0, |&n| n.div_ceil(v));
    let with = |k: u64| Config {
        recompute_layers: k,
        ..c
    };
    let share = (none as f64 - capacity as f64) / (none as f64 - every as f64).max(1.0);
    let guess = ((longest as f64 * share).ceil() as u64).clamp(1, longest.max(1));
    let mut fits = |k: u64| {
        if k >= longest {
            return Some((every, u64::MAX));
        }
        let (peak, stage) = cost.peak_memory(&with(k), counts);
        (peak <= capacity).then_some((peak, stage))
    };
    let (mut k, mut at) = (guess, fits(guess));
    if at.is_some() {
        while k > 1 {
            match fits(k - 1) {
                Some(p) => (k, at) = (k - 1, Some(p)),
                None => break,
            }
        }
    } else {
        while at.is_none() && k < longest {
            k += 1;
            at = fits(k);
        }
    }
    match at {
        Some((peak, stage)) if k < longest => Some((with(k), peak, stage)),
        _ => None,
    }
}

/// Step times within 0.05% of each other tie: the model is not that precise,
/// and a tie should go to the simpler strategy, not to noise in the last digit.
fn time_bucket(step_time: f64) -> i64 {
    (step_time.max(1e-12).ln() * 2000.0).round() as i64
}

/// How much machinery a configuration asks for: lower is simpler.
pub(crate) fn complexity(c: &Config) -> (u8, u8, Recompute, u64) {
    // A change to the training dynamics first: on a tie the all-reduce of
    // fp32 gradients wins.
    let dynamics = u8::from(c.sync != GradSync::AllReduce)
        + u8::from(c.compress != Compression::None)
        + u8::from(c.grad_reduce != GradReduce::Fp32);
    (dynamics, c.zero, c.recompute, c.virtual_stages)
}

/// On a tie in step time: the simpler plan, then the one holding less
/// memory (1F1B before GPipe, sequence parallelism on), then a fixed order.
fn before(a: &Candidate, b: &Candidate) -> std::cmp::Ordering {
    time_bucket(a.step_time)
        .cmp(&time_bucket(b.step_time))
        .then(complexity(&a.config).cmp(&complexity(&b.config)))
        .then(a.peak_memory.cmp(&b.peak_memory))
        .then(a.config.cmp(&b.config))
}

/// Keep the `keep` best, ordered by step time, then simplicity, memory and
/// configuration. Configurations that differ only in how the mesh maps onto
/// nodes count once (the better mapping).
fn insert(best: &mut Vec<Candidate>, cand: Candidate, keep: usize) {
    use std::cmp::Ordering::Less;
    let same_choice = |a: &Config, b: &Config| {
        Config {
            order: AxisOrder::DataInner,
            ..*a
        } == Config {
            order: AxisOrder::DataInner,
            ..*b
        }
    };
    if let Some(i) = best
        .iter()
        .position(|b| same_choice(&b.config, &cand.config))
    {
        if before(&cand, &best[i]) != Less {
            return;
        }
        best.remove(i);
    }
    if best.len() == keep && best.last().is_some_and(|w| before(&cand, w) != Less) {
        return;
    }
    let at = best.partition_point(|b| before(b, &cand) == Less);
    best.insert(at, cand);
    best.truncate(keep);
}
