//! `--strategy tp=8,pp=8,dp=24,mb=1,schedule=1f1b,…`: the choices a person
//! pins; the search fills in the rest.

use crate::PlanError;
use dplc_ir::{
    AttentionKind, Compression, Dispatch, Elementwise, GradAccum, GradReduce, GradSync, Loss,
    PipelineSchedule, Recompute, RootSplit, ServerRanks, ShardLayout, TpImpl, TpOverlap,
};
use std::fmt;

/// Choices fixed before the search; `None` leaves a choice to the search.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct StrategyConstraints {
    pub tp: Option<u64>,
    pub pp: Option<u64>,
    pub dp: Option<u64>,
    pub cp: Option<u64>,
    pub ep: Option<u64>,
    pub micro_batch: Option<u64>,
    pub num_micro_batches: Option<u64>,
    pub schedule: Option<PipelineSchedule>,
    pub virtual_stages: Option<u64>,
    pub zero: Option<u8>,
    pub recompute: Option<Recompute>,
    /// `recompute_layers=N` (implies `recompute=full`): only the first N
    /// layers of each model chunk rerun their forward, Megatron's
    /// `--recompute-method block --recompute-num-layers N`;
    /// `recompute_layers=all` (`Some(0)`) pins every layer. Unpinned, a
    /// pinned `recompute=full` covers every layer and the search's own full
    /// recomputation the fewest layers that fit.
    pub recompute_layers: Option<u64>,
    pub sequence_parallel: Option<bool>,
    /// `overlap=off` pins the data-parallel gradient reduction after backward;
    /// the search itself always overlaps (it is never slower).
    pub overlap_grad_reduce: Option<bool>,
    /// `attention=unfused` prices the attention core op by op, as the
    /// 2021–2022 stacks ran it; the search uses fused attention otherwise.
    pub attention: Option<AttentionKind>,
    /// `tp_overlap=none|async|ring|pipe` (`pipe` reads as `ring`); the search uses Megatron's default,
    /// `async`, otherwise.
    pub tp_overlap: Option<TpOverlap>,
    /// `grad_accum=fused|separate`; the search uses Megatron's default, fused.
    pub grad_accum: Option<GradAccum>,
    /// `grad_reduce=fp32|bf16|fp16`: the main gradients' precision; the
    /// search keeps them in fp32 (the half-precision ones change what the
    /// optimizer reads: the user's call).
    pub grad_reduce: Option<GradReduce>,
    /// `dispatch=alltoall|hierarchical` (`deepep`, `hybridep` and `flex` read
    /// as `hierarchical`); the search sends one all-to-all, as dplc's ranks do.
    pub dispatch: Option<Dispatch>,
    /// `root=vocab|replicated`; the search uses the e-graph's vocabulary split.
    pub root: Option<RootSplit>,
    /// `order=tp-cp-dp-pp|tp-cp-pp-dp`: the rank order of the mesh; the
    /// search tries both where dp and pp are both split.
    pub order: Option<AxisOrder>,
    /// `stages=even` splits the layers evenly over the pipeline stages, as
    /// Megatron-LM and DeepSpeed do by default; `stages=balanced` (the
    /// search's choice) balances them by time, the ends carrying the
    /// embedding and the loss.
    pub even_stages: Option<bool>,
    /// `fp8=on` runs the layers' linear GEMMs in FP8 (Transformer Engine);
    /// the search never turns it on itself, as it changes the numerics.
    pub fp8: Option<bool>,
    /// `fp8_gather=on` all-gathers ZeRO's weight shards as their FP8 casts
    /// (torchao's FSDP float8 all-gather, Megatron's `--fp8-param-gather`);
    /// needs `fp8=on` and zero ≥ 1. The search keeps what is pinned (off).
    pub fp8_gather: Option<bool>,
    /// `fp8_bf16_ends=N`: under `fp8=on`, the first N and the last N layers
    /// keep their GEMMs in bf16 (Megatron's `--first-last-layers-bf16`, on
    /// with N = 1 in NVIDIA's FP8 current-scaling recipes). Pinned only.
    pub fp8_bf16_ends: Option<u64>,
    /// `offload=none|optimizer|params|activations`, parts joined by `+`:
    /// state kept in host memory. The search offloads only when nothing
    /// fits without it.
    pub offload: Option<dplc_ir::Offload>,
    /// `autocast=on` prices PyTorch's automatic mixed precision over fp32
    /// weights (`torch.autocast`): pinned only, as it prices another
    /// engine's run.
    pub autocast: Option<bool>,
    /// `elementwise=fused|eager`: eager runs every elementwise op as its own
    /// kernel (PyTorch without torch.compile); the search fuses them.
    pub elementwise: Option<Elementwise>,
    /// `loss=fused|unfused`: unfused runs the cross-entropy in fp32 one
    /// pass at a time (Megatron's default loss); pinned only, as dplc's
    /// runtime fuses it.
    pub loss: Option<Loss>,
    /// `shards=flat|per_param`: where ZeRO-3 keeps what it gathers and
    /// reduces (`per_param`: FSDP2's copies in and out); the search keeps
    /// flat buffers, as dplc's runtime does.
    pub shards: Option<ShardLayout>,
    /// `tp_impl=dplc|megatron|dtensor`: how tensor parallelism lays out
    /// what it shards on the sequence (`megatron`: the model's ends split
    /// along it too; `dtensor`: torchtitan's batch-first layout, its
    /// collectives' copies, autograd's gathered inputs); the search takes
    /// dplc's runtime's (Megatron's layers, the ends whole).
    pub tp_impl: Option<TpImpl>,
    /// `sync=allreduce|ps|async`; the search all-reduces unless the user
    /// allows it to choose (`--allow sync`), as the others change the
    /// training dynamics.
    pub sync: Option<SyncMode>,
    /// `ps_shards=N`: parameter-server shards (sync=ps or async); the
    /// data-parallel degree when not given.
    pub ps_shards: Option<u64>,
    /// `staleness=K`: versions an async worker's weights may lag (sync=async; 1 when not given).
    pub staleness: Option<u64>,
    /// `ps_ranks=colocated|dedicated`: the servers on the first workers
    /// (the default) or on ranks of their own beyond the cluster's devices.
    pub ps_ranks: Option<ServerRanks>,
    /// `compress=none|bf16|fp16|powersgd:R[:W]|topk:F[:W]` (W: warm-up
    /// steps, the schedule's by default); the search sends fp32
    /// gradients unless the user allows it to choose (`--allow compress`).
    pub compress: Option<Compression>,
    /// The choices the search may make although they change the training
    /// dynamics (`--allow sync,compress`).
    pub allow: Allow,
}

/// `sync=` as written, before the shards and staleness are known.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SyncMode {
    AllReduce,
    Ps,
    Async,
}

impl SyncMode {
    pub fn name(self) -> &'static str {
        match self {
            SyncMode::AllReduce => "allreduce",
            SyncMode::Ps => "ps",
            SyncMode::Async => "async",
        }
    }

    pub fn of(s: GradSync) -> SyncMode {
        match s {
            GradSync::AllReduce => SyncMode::AllReduce,
            GradSync::Ps { .. } => SyncMode::Ps,
            GradSync::Async { .. } => SyncMode::Async,
        }
    }
}

/// Choices that change what training computes, which the search makes only
/// when the user names them (`--allow sync,compress,grad_reduce`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Allow {
    pub sync: bool,
    pub compress: bool,
    /// Main gradients in the training precision (`grad_reduce`).
    pub grad_reduce: bool,
}

impl Allow {
    /// Read `sync,compress,grad_reduce` (any of them, or `none`).
    pub fn parse(spec: &str) -> Result<Allow, PlanError> {
        let mut a = Allow::default();
        for item in spec.split(',').map(str::trim).filter(|s| !s.is_empty()) {
            match item.to_ascii_lowercase().as_str() {
                "sync" => a.sync = true,
                "compress" => a.compress = true,
                "grad_reduce" => a.grad_reduce = true,
                "none" => {}
                _ => {
                    return Err(PlanError::StrategySyntax {
                        spec: spec.to_string(),
                        detail: format!(
                            "--allow names sync, compress and/or grad_reduce (comma-separated), got `{item}`"
                        ),
                    })
                }
            }
        }
        Ok(a)
    }
}

impl StrategyConstraints {
    /// The gradient synchronisation pinned for `dp` replicas, `None` when
    /// the search chooses it. Errors name the key to change.
    pub fn grad_sync(&self, dp: u64) -> Result<Option<GradSync>, PlanError> {
        let shards = self.ps_shards.unwrap_or(dp).max(1);
        let servers = self.ps_ranks.unwrap_or_default();
        // Dedicated servers are ranks of their own: any number of them.
        if servers == ServerRanks::CoLocated && shards > dp.max(1) {
            return Err(PlanError::Strategy(format!(
                "ps_shards={shards} is more than the {dp} data-parallel workers the servers live on; \
                 give ps_shards at most dp"
            )));
        }
        Ok(match self.sync {
            None => None,
            Some(SyncMode::AllReduce) => Some(GradSync::AllReduce),
            Some(SyncMode::Ps) => Some(GradSync::Ps { shards, servers }),
            Some(SyncMode::Async) => Some(GradSync::Async {
                shards,
                staleness: self.staleness.unwrap_or(1),
                servers,
            }),
        })
    }
}

impl StrategyConstraints {
    /// Every choice `plan` made, pinned: planning again with these gives
    /// the plan back, and changing one prices a neighbour. Choices that are
    /// the search's own default (overlapped reduction, fused accumulation,
    /// the vocabulary-split root) stay unpinned, as a person would write them.
    pub fn of_plan(plan: &dplc_ir::Plan) -> StrategyConstraints {
        let s = &plan.strategy;
        let m = &plan.mesh;
        StrategyConstraints {
            tp: Some(m.tp),
            pp: Some(m.pp),
            dp: Some(m.dp),
            cp: Some(m.cp),
            ep: Some(m.ep),
            micro_batch: Some(s.micro_batch),
            num_micro_batches: Some(s.num_micro_batches),
            schedule: Some(s.schedule),
            virtual_stages: Some(s.virtual_stages),
            zero: Some(s.zero_stage),
            recompute: Some(s.recompute),
            recompute_layers: (s.recompute == Recompute::Full).then_some(s.recompute_layers),
            sequence_parallel: Some(s.sequence_parallel),
            overlap_grad_reduce: (!s.overlap_grad_reduce).then_some(false),
            attention: Some(s.attention),
            tp_overlap: Some(s.tp_overlap),
            grad_accum: (s.grad_accum != GradAccum::Fused).then_some(s.grad_accum),
            grad_reduce: (s.grad_reduce != GradReduce::Fp32).then_some(s.grad_reduce),
            dispatch: (s.dispatch != Dispatch::AllToAll).then_some(s.dispatch),
            root: (s.root != RootSplit::Vocab).then_some(s.root),
            order: Some(AxisOrder::of(m)),
            fp8: s.fp8.then_some(true),
            fp8_gather: s.fp8_gather.then_some(true),
            fp8_bf16_ends: (s.fp8_bf16_ends > 0).then_some(s.fp8_bf16_ends),
            offload: (!s.offload.is_none()).then_some(s.offload),
            autocast: s.autocast.then_some(true),
            elementwise: (s.elementwise != Elementwise::Fused).then_some(s.elementwise),
            loss: (s.loss != Loss::Fused).then_some(s.loss),
            shards: (s.shards != ShardLayout::Flat).then_some(s.shards),
            tp_impl: (s.tp_impl != TpImpl::default()).then_some(s.tp_impl),
            sync: (!s.sync.is_all_reduce()).then_some(SyncMode::of(s.sync)),
            ps_shards: s.sync.ps_shards(),
            ps_ranks: s.sync.servers().filter(|&r| r == ServerRanks::Dedicated),
            staleness: match s.sync {
                GradSync::Async { staleness, .. } => Some(staleness),
                GradSync::AllReduce | GradSync::Ps { .. } => None,
            },
            compress: (!s.compress.is_none()).then_some(s.compress),
            allow: Allow::default(),
            // Stages follow the model's balance unless they are the even split.
            even_stages: (plan.stage_layers() == dplc_ir::even_split(plan.layers, m.pp.max(1)))
                .then_some(true),
        }
    }
}

/// Mesh axes from the innermost (consecutive ranks) outwards.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum AxisOrder {
    /// Megatron's default order: tp, cp, dp (with ep inside), pp.
    DataInner,
    /// tp, cp, pp, dp (Megatron's `--use-tp-pp-dp-mapping`): pipeline
    /// neighbours share a node, replicas span nodes.
    PipelineInner,
}

impl AxisOrder {
    /// The order as the `order=` key writes it, innermost axis first.
    pub fn name(self) -> &'static str {
        match self {
            AxisOrder::DataInner => "tp-cp-dp-pp",
            AxisOrder::PipelineInner => "tp-cp-pp-dp",
        }
    }

    /// The order of a plan's mesh: where its pipeline axis sits.
    pub fn of(mesh: &dplc_ir::Mesh) -> AxisOrder {
        let stride = |a| {
            mesh.axes
                .iter()
                .find(|m| m.axis == a)
                .map_or(1, |m| m.stride)
        };
        if mesh.pp > 1
            && mesh.dp > 1
            && stride(dplc_ir::MeshAxis::Pp) < stride(dplc_ir::MeshAxis::Dp)
        {
            AxisOrder::PipelineInner
        } else {
            AxisOrder::DataInner
        }
    }
}

/// Read `key=value` pairs separated by commas. Keys: `tp pp dp cp ep mb m
/// schedule v zero recompute sp overlap attention tp_overlap`.
pub fn parse_strategy(spec: &str) -> Result<StrategyConstraints, PlanError> {
    let err = |detail: String| PlanError::StrategySyntax {
        spec: spec.to_string(),
        detail,
    };
    let mut c = StrategyConstraints::default();
    // Each choice once, under whichever of its names: the item that set it.
    let mut given: Vec<(&'static str, &str)> = Vec::new();
    for item in spec.split(',').map(str::trim).filter(|s| !s.is_empty()) {
        let (key, value) = item
            .split_once('=')
            .ok_or_else(|| err(format!("`{item}` is not key=value")))?;
        let (key, value) = (key.trim().to_ascii_lowercase(), value.trim());
        if let Some(choice) = choice_of(&key) {
            if let Some((_, first)) = given.iter().find(|(c, _)| *c == choice) {
                return Err(err(format!(
                    "{choice} is given twice (`{first}` and `{item}`); give each key once"
                )));
            }
            given.push((choice, item));
        }
        let int = || {
            value.parse::<u64>().ok().filter(|&n| n > 0).ok_or_else(|| {
                err(format!(
                    "{key} needs a positive whole number, got `{value}`"
                ))
            })
        };
        let on_off = || match value.to_ascii_lowercase().as_str() {
            "on" | "true" | "1" | "yes" => Ok(true),
            "off" | "false" | "0" | "no" => Ok(false),
            _ => Err(err(format!("{key} is on or off, got `{value}`"))),
        };
        match key.as_str() {
            "tp" => c.tp = Some(int()?),
            "pp" => c.pp = Some(int()?),
            "dp" => c.dp = Some(int()?),
            "cp" => c.cp = Some(int()?),
            "ep" => c.ep = Some(int()?),
            "mb" | "micro_batch" => c.micro_batch = Some(int()?),
            "m" | "micro_batches" | "num_micro_batches" => c.num_micro_batches = Some(int()?),
            "v" | "virtual_stages" => c.virtual_stages = Some(int()?),
            "zero" => {
                c.zero = Some(
                    value
                        .parse::<u8>()
                        .ok()
                        .filter(|&z| z <= 3)
                        .ok_or_else(|| err(format!("zero is 0, 1, 2 or 3, got `{value}`")))?,
                )
            }
            "schedule" => {
                c.schedule = Some(match value.to_ascii_lowercase().as_str() {
                    "gpipe" => PipelineSchedule::GPipe,
                    "1f1b" => PipelineSchedule::OneFOneB,
                    "interleaved" | "interleaved-1f1b" | "interleaved_1f1b" => {
                        PipelineSchedule::Interleaved
                    }
                    _ => {
                        return Err(err(format!(
                            "schedule is gpipe, 1f1b or interleaved, got `{value}`"
                        )))
                    }
                })
            }
            "recompute" => {
                c.recompute = Some(match value.to_ascii_lowercase().as_str() {
                    "none" | "off" => Recompute::None,
                    "selective" => Recompute::Selective,
                    "full" => Recompute::Full,
                    "op" => Recompute::Op,
                    _ => {
                        return Err(err(format!(
                            "recompute is none, selective, full or op, got `{value}`"
                        )))
                    }
                })
            }
            "recompute_layers" => {
                c.recompute_layers = Some(match value.to_ascii_lowercase().as_str() {
                    "all" => 0,
                    v => v.parse().ok().filter(|&n: &u64| n > 0).ok_or_else(|| {
                        err(format!(
                            "recompute_layers is how many layers of each chunk rerun their forward (at least 1), or `all`, got `{value}`"
                        ))
                    })?,
                })
            }
            "sp" | "sequence_parallel" => c.sequence_parallel = Some(on_off()?),
            "overlap" | "overlap_grad_reduce" => c.overlap_grad_reduce = Some(on_off()?),
            "attention" => {
                c.attention = Some(match value.to_ascii_lowercase().as_str() {
                    "fused" | "flash" => AttentionKind::Fused,
                    "flash2" => AttentionKind::Flash2,
                    "flash1" => AttentionKind::Flash1,
                    "unfused" => AttentionKind::Unfused,
                    _ => {
                        return Err(err(format!(
                            "attention is fused, flash2, flash1 or unfused, got `{value}`"
                        )))
                    }
                })
            }
            "tp_overlap" => {
                c.tp_overlap = Some(match value.to_ascii_lowercase().as_str() {
                    "none" | "off" => TpOverlap::None,
                    "async" => TpOverlap::Async,
                    // Megatron-Core's `--tp-comm-overlap` runs Transformer
                    // Engine's userbuffers overlap: the all-gathers beside
                    // their GEMMs by ring exchange (`ring_exchange`), the
                    // reduce-scatters after a GEMM cut into chunks
                    // (`pipeline`), the backward ones in bulk. Both cut the
                    // GEMM into chunks with one chunk's transfer left
                    // exposed, which is all the cost model prices, so `pipe`
                    // names the same mechanism as `ring`.
                    "ring" | "pipe" => TpOverlap::Ring,
                    _ => {
                        return Err(err(format!(
                            "tp_overlap is none, async, ring or pipe, got `{value}`"
                        )))
                    }
                })
            }
            "root" => {
                c.root = Some(match value.to_ascii_lowercase().as_str() {
                    "vocab" | "vocab_parallel" => RootSplit::Vocab,
                    "replicated" => RootSplit::Replicated,
                    _ => {
                        return Err(err(format!(
                            "root is vocab or replicated, got `{value}`"
                        )))
                    }
                })
            }
            "grad_accum" => {
                c.grad_accum = Some(match value.to_ascii_lowercase().as_str() {
                    "fused" | "on" => GradAccum::Fused,
                    "separate" | "off" => GradAccum::Separate,
                    _ => {
                        return Err(err(format!(
                            "grad_accum is fused or separate, got `{value}`"
                        )))
                    }
                })
            }
            "grad_reduce" => {
                c.grad_reduce = Some(match value.to_ascii_lowercase().as_str() {
                    "fp32" | "float32" => GradReduce::Fp32,
                    "bf16" | "bfloat16" => GradReduce::Bf16,
                    "fp16" | "float16" => GradReduce::Fp16,
                    _ => {
                        return Err(err(format!(
                            "grad_reduce is fp32, bf16 or fp16, got `{value}`"
                        )))
                    }
                })
            }
            "dispatch" => {
                c.dispatch = Some(match value.to_ascii_lowercase().as_str() {
                    "alltoall" | "all_to_all" | "all-to-all" => Dispatch::AllToAll,
                    "hierarchical" | "deepep" | "hybridep" | "flex" => Dispatch::Hierarchical,
                    _ => {
                        return Err(err(format!(
                            "dispatch is alltoall or hierarchical (deepep, hybridep), got `{value}`"
                        )))
                    }
                })
            }
            "order" => {
                c.order = Some(match value.to_ascii_lowercase().as_str() {
                    "tp-cp-dp-pp" => AxisOrder::DataInner,
                    "tp-cp-pp-dp" => AxisOrder::PipelineInner,
                    _ => {
                        return Err(err(format!(
                            "order is tp-cp-dp-pp or tp-cp-pp-dp (innermost axis first), got `{value}`"
                        )))
                    }
                })
            }
            "fp8" => c.fp8 = Some(on_off()?),
            "autocast" => c.autocast = Some(on_off()?),
            "fp8_gather" => c.fp8_gather = Some(on_off()?),
            "fp8_bf16_ends" => {
                c.fp8_bf16_ends = Some(value.parse().map_err(|_| {
                    err(format!(
                        "fp8_bf16_ends is how many layers at each end keep bf16 GEMMs, got `{value}`"
                    ))
                })?)
            }
            "elementwise" => {
                c.elementwise = Some(match value.to_ascii_lowercase().as_str() {
                    "fused" => Elementwise::Fused,
                    "eager" => Elementwise::Eager,
                    _ => {
                        return Err(err(format!(
                            "elementwise is fused or eager, got `{value}`"
                        )))
                    }
                })
            }
            "loss" => {
                c.loss = Some(match value.to_ascii_lowercase().as_str() {
                    "fused" => Loss::Fused,
                    "unfused" => Loss::Unfused,
                    "eager" => Loss::Eager,
                    _ => {
                        return Err(err(format!(
                            "loss is fused, unfused or eager, got `{value}`"
                        )))
                    }
                })
            }
            "shards" => {
                c.shards = Some(match value.to_ascii_lowercase().as_str() {
                    "flat" => ShardLayout::Flat,
                    "per_param" | "per-param" => ShardLayout::PerParam,
                    _ => {
                        return Err(err(format!(
                            "shards is flat or per_param, got `{value}`"
                        )))
                    }
                })
            }
            "tp_impl" => {
                c.tp_impl = Some(match value.to_ascii_lowercase().as_str() {
                    "dplc" => TpImpl::Dplc,
                    "megatron" => TpImpl::Megatron,
                    "dtensor" => TpImpl::DTensor,
                    _ => {
                        return Err(err(format!(
                            "tp_impl is dplc, megatron or dtensor, got `{value}`"
                        )))
                    }
                })
            }
            "offload" => {
                c.offload = Some(
                    dplc_ir::Offload::parse(&value.to_ascii_lowercase()).ok_or_else(|| {
                        err(format!(
                            "offload is none or optimizer, params, activations joined by + \
                             (offload=optimizer+activations), got `{value}`"
                        ))
                    })?,
                )
            }
            "sync" => {
                c.sync = Some(match value.to_ascii_lowercase().as_str() {
                    "allreduce" | "all_reduce" | "all-reduce" => SyncMode::AllReduce,
                    "ps" => SyncMode::Ps,
                    "async" => SyncMode::Async,
                    _ => {
                        return Err(err(format!(
                            "sync is allreduce, ps or async, got `{value}`"
                        )))
                    }
                })
            }
            "ps_shards" => c.ps_shards = Some(int()?),
            "ps_ranks" => {
                c.ps_ranks = Some(ServerRanks::parse(value).ok_or_else(|| {
                    err(format!(
                        "ps_ranks is colocated (the servers on the first workers) or dedicated \
                         (ranks of their own), got `{value}`"
                    ))
                })?)
            }
            "staleness" => {
                c.staleness = Some(value.parse::<u64>().map_err(|_| {
                    err(format!(
                        "staleness needs a whole number of steps (0 or more), got `{value}`"
                    ))
                })?)
            }
            "compress" => {
                c.compress = Some(Compression::parse(value).ok_or_else(|| {
                    err(format!(
                        "compress is none, bf16, fp16, powersgd:R (R a positive rank) or \
                         topk:F (F a fraction in (0, 1], at least 1e-6: kept in millionths), \
                         either with :W warm-up steps \
                         (powersgd:4:100), got `{value}`"
                    ))
                })?)
            }
            "stages" => {
                c.even_stages = Some(match value.to_ascii_lowercase().as_str() {
                    "even" => true,
                    "balanced" => false,
                    _ => {
                        return Err(err(format!(
                            "stages is even or balanced, got `{value}`"
                        )))
                    }
                })
            }
            _ => {
                return Err(err(format!(
                    "unknown key `{key}`; keys are tp, pp, dp, cp, ep, mb, m, schedule, v, zero, recompute, recompute_layers, sp, overlap, attention, tp_overlap, grad_accum, grad_reduce, dispatch, root, order, stages, fp8, fp8_gather, fp8_bf16_ends, autocast, offload, elementwise, loss, shards, sync, ps_shards, ps_ranks, staleness, compress"
                )))
            }
        }
    }
    if c.ps_shards.is_some() && !matches!(c.sync, Some(SyncMode::Ps | SyncMode::Async)) {
        return Err(err(
            "ps_shards shards a parameter server: give it with sync=ps or sync=async".into(),
        ));
    }
    if c.ps_ranks.is_some() && !matches!(c.sync, Some(SyncMode::Ps | SyncMode::Async)) {
        return Err(err(
            "ps_ranks places a parameter server: give it with sync=ps or sync=async".into(),
        ));
    }
    if c.staleness.is_some() && c.sync != Some(SyncMode::Async) {
        return Err(err(
            "staleness bounds asynchronous updates: give it with sync=async".into(),
        ));
    }
    if c.virtual_stages.is_some_and(|v| v > 1) {
        match c.schedule {
            None => c.schedule = Some(PipelineSchedule::Interleaved),
            Some(PipelineSchedule::Interleaved) => {}
            Some(s) => {
                return Err(PlanError::Strategy(format!(
                    "v={} needs the interleaved schedule, not {}",
                    c.virtual_stages.unwrap_or(1),
                    s.name()
                )))
            }
        }
    }
    Ok(c)
}

/// The choice a key (or its alias) pins, by its short name.
fn choice_of(key: &str) -> Option<&'static str> {
    Some(match key {
        "tp" => "tp",
        "pp" => "pp",
        "dp" => "dp",
        "cp" => "cp",
        "ep" => "ep",
        "mb" | "micro_batch" => "mb",
        "m" | "micro_batches" | "num_micro_batches" => "m",
        "v" | "virtual_stages" => "v",
        "zero" => "zero",
        "schedule" => "schedule",
        "recompute" => "recompute",
        "recompute_layers" => "recompute_layers",
        "sp" | "sequence_parallel" => "sp",
        "overlap" | "overlap_grad_reduce" => "overlap",
        "attention" => "attention",
        "tp_overlap" => "tp_overlap",
        "grad_accum" => "grad_accum",
        "grad_reduce" => "grad_reduce",
        "dispatch" => "dispatch",
        "root" => "root",
        "order" => "order",
        "stages" => "stages",
        "fp8" => "fp8",
        "autocast" => "autocast",
        "fp8_gather" => "fp8_gather",
        "fp8_bf16_ends" => "fp8_bf16_ends",
        "offload" => "offload",
        "elementwise" => "elementwise",
        "loss" => "loss",
        "shards" => "shards",
        "tp_impl" => "tp_impl",
        "sync" => "sync",
        "ps_shards" => "ps_shards",
        "ps_ranks" => "ps_ranks",
        "staleness" => "staleness",
        "compress" => "compress",
        _ => return None,
    })
}

impl fmt::Display for StrategyConstraints {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut parts = Vec::new();
        let mut num = |k: &str, v: Option<u64>| {
            if let Some(v) = v {
                parts.push(format!("{k}={v}"));
            }
        };
        num("tp", self.tp);
        num("pp", self.pp);
        num("dp", self.dp);
        num("cp", self.cp);
        num("ep", self.ep);
        num("mb", self.micro_batch);
        num("m", self.num_micro_batches);
        num("v", self.virtual_stages);
        if let Some(s) = self.schedule {
            parts.push(format!("schedule={}", s.name()));
        }
        if let Some(z) = self.zero {
            parts.push(format!("zero={z}"));
        }
        if let Some(r) = self.recompute {
            parts.push(format!("recompute={}", r.name()));
        }
        match self.recompute_layers {
            Some(0) => parts.push("recompute_layers=all".to_string()),
            Some(n) => parts.push(format!("recompute_layers={n}")),
            None => {}
        }
        let on_off = |b: bool| if b { "on" } else { "off" };
        if let Some(sp) = self.sequence_parallel {
            parts.push(format!("sp={}", on_off(sp)));
        }
        if let Some(o) = self.overlap_grad_reduce {
            parts.push(format!("overlap={}", on_off(o)));
        }
        if let Some(a) = self.attention {
            parts.push(format!("attention={}", a.name()));
        }
        if let Some(o) = self.tp_overlap {
            parts.push(format!("tp_overlap={}", o.name()));
        }
        if let Some(g) = self.grad_accum {
            parts.push(format!("grad_accum={}", g.name()));
        }
        if let Some(g) = self.grad_reduce {
            parts.push(format!("grad_reduce={}", g.name()));
        }
        if let Some(d) = self.dispatch {
            parts.push(format!("dispatch={}", d.name()));
        }
        if let Some(r) = self.root {
            parts.push(format!("root={}", r.name()));
        }
        if let Some(o) = self.order {
            parts.push(format!("order={}", o.name()));
        }
        if let Some(o) = self.offload {
            parts.push(format!("offload={}", o.name()));
        }
        if let Some(fp8) = self.fp8 {
            parts.push(format!("fp8={}", if fp8 { "on" } else { "off" }));
        }
        if let Some(on) = self.fp8_gather {
            parts.push(format!("fp8_gather={}", if on { "on" } else { "off" }));
        }
        if let Some(n) = self.fp8_bf16_ends {
            parts.push(format!("fp8_bf16_ends={n}"));
        }
        if let Some(a) = self.autocast {
            parts.push(format!("autocast={}", on_off(a)));
        }
        if let Some(e) = self.elementwise {
            parts.push(format!("elementwise={}", e.name()));
        }
        if let Some(l) = self.loss {
            parts.push(format!("loss={}", l.name()));
        }
        if let Some(s) = self.shards {
            parts.push(format!("shards={}", s.name()));
        }
        if let Some(t) = self.tp_impl {
            parts.push(format!("tp_impl={}", t.name()));
        }
        if let Some(s) = self.sync {
            parts.push(format!("sync={}", s.name()));
        }
        if let Some(n) = self.ps_shards {
            parts.push(format!("ps_shards={n}"));
        }
        if let Some(r) = self.ps_ranks {
            parts.push(format!("ps_ranks={}", r.name()));
        }
        if let Some(k) = self.staleness {
            parts.push(format!("staleness={k}"));
        }
        if let Some(c) = self.compress {
            parts.push(format!("compress={}", c.name()));
        }
        if let Some(even) = self.even_stages {
            parts.push(format!("stages={}", if even { "even" } else { "balanced" }));
        }
        f.write_str(&parts.join(","))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_every_key_and_prints_it_back() {
        let s = "tp=8,pp=8,dp=24,cp=1,ep=1,mb=1,zero=1,schedule=interleaved,v=2,recompute=selective,sp=on,overlap=off,attention=unfused,tp_overlap=ring,elementwise=eager,loss=unfused,shards=per_param,tp_impl=dtensor";
        let c = parse_strategy(s).unwrap();
        assert_eq!(c.tp, Some(8));
        assert_eq!(c.schedule, Some(PipelineSchedule::Interleaved));
        assert_eq!(c.recompute, Some(Recompute::Selective));
        assert_eq!(c.sequence_parallel, Some(true));
        assert_eq!(c.overlap_grad_reduce, Some(false));
        assert_eq!(c.attention, Some(AttentionKind::Unfused));
        assert_eq!(c.tp_overlap, Some(TpOverlap::Ring));
        assert_eq!(c.elementwise, Some(Elementwise::Eager));
        assert_eq!(c.loss, Some(Loss::Unfused));
        assert_eq!(c.shards, Some(ShardLayout::PerParam));
        assert_eq!(c.tp_impl, Some(TpImpl::DTensor));
        assert_eq!(parse_strategy(&c.to_string()).unwrap(), c);
        for (s, layers, autocast) in [
            ("recompute_layers=3,autocast=on", Some(3), Some(true)),
            ("recompute_layers=ALL,autocast=off", Some(0), Some(false)),
        ] {
            let c = parse_strategy(s).unwrap();
            assert_eq!((c.recompute_layers, c.autocast), (layers, autocast));
            assert_eq!(parse_strategy(&c.to_string()).unwrap(), c);
        }
    }

    #[test]
    fn tp_overlap_takes_megatron_cores_names() {
        let overlap = |v: &str| parse_strategy(&format!("tp_overlap={v}")).map(|c| c.tp_overlap);
        assert_eq!(overlap("none").unwrap(), Some(TpOverlap::None));
        assert_eq!(overlap("async").unwrap(), Some(TpOverlap::Async));
        assert_eq!(overlap("ring").unwrap(), Some(TpOverlap::Ring));
        assert_eq!(overlap("pipe").unwrap(), Some(TpOverlap::Ring));
        assert_eq!(overlap("PIPE").unwrap(), Some(TpOverlap::Ring));
        let e = overlap("bulk").unwrap_err().to_string();
        assert!(e.contains("none, async, ring or pipe"), "{e}");
    }

    #[test]
    fn rejects_bad_keys_and_values() {
        assert!(parse_strategy("tq=8")
            .unwrap_err()
            .to_string()
            .contains("unknown key"));
        assert!(parse_strategy("tp=0").is_err());
        assert!(parse_strategy("zero=4").is_err());
        assert!(parse_strategy("overlap=maybe").is_err());
        assert!(parse_strategy("attention=sometimes").is_err());
        assert!(parse_strategy("elementwise=lazy").is_err());
        assert!(parse_strategy("loss=chunked").is_err());
        assert!(parse_strategy("shards=bucketed").is_err());
        assert!(parse_strategy("tp_impl=jax").is_err());
        assert!(parse_strategy("recompute_layers=-1").is_err());
        assert!(parse_strategy("recompute_layers=0").is_err());
        assert!(parse_strategy("autocast=maybe").is_err());
        assert!(parse_strategy("schedule=1f1b,v=2").is_err());
    }

    #[test]
    fn a_repeated_key_is_an_error_naming_it() {
        let e = parse_strategy("tp=2,tp=4").unwrap_err().to_string();
        assert_eq!(
            e,
            "cannot read strategy `tp=2,tp=4`: tp is given twice (`tp=2` and `tp=4`); give each key once"
        );
        let e = parse_strategy("mb=1,pp=2,micro_batch=2")
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("mb is given twice (`mb=1` and `micro_batch=2`)"),
            "{e}"
        );
    }
}
