//! The rules a parallel configuration obeys and the limits dplc plans within,
//! in one place: the planner's search and pin checks and `Plan::validate` read these.
//!
//! Each rule returns what is wrong in words; the caller says where (a plan
//! field, a `--strategy` key), so the same rule reads right in both.

use crate::{Dim, Graph, Op};
use std::fmt;

/// The most devices dplc plans for: 2^20, ten times today's largest
/// clusters. The search enumerates the world's divisors three deep.
pub const MAX_DEVICES: u64 = 1 << 20;
/// The longest sequence dplc plans for: 2^24 tokens. Positions are `i32`,
/// and no published model trains on a longer context.
pub const MAX_SEQ: u64 = 1 << 24;
/// The largest global batch dplc plans for: 2^24 sequences.
pub const MAX_GLOBAL_BATCH: u64 = 1 << 24;
/// The most forward passes of one stage's schedule dplc lays out
/// (micro-batches × model chunks × stages): `viz` and the runtime walk each.
pub const MAX_PIPELINE_PASSES: u64 = 1 << 20;

/// The range a number of a cluster's hardware is read over, as the cost
/// model prices it. Outside it a number is a slip (a unit dropped or
/// doubled), and at the edges step times turn absurd or infinite: a zero
/// bandwidth prices every transfer at infinity.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Bounds {
    pub min: f64,
    pub max: f64,
    /// The range as a cluster section would write it.
    pub shown: &'static str,
}

impl Bounds {
    pub fn contains(&self, x: f64) -> bool {
        x.is_finite() && (self.min..=self.max).contains(&x)
    }

    /// `x` within the bounds, or what is wrong in words (the caller names the key).
    pub fn check(&self, x: f64) -> Result<(), String> {
        if self.contains(x) {
            Ok(())
        } else {
            Err(format!("must be in the range {}", self.shown))
        }
    }
}

/// A link's (or a device's memory's, or its host link's) bandwidth: a
/// byte a second up to 1000 TB/s, well past NVLink 5's 1.8 TB/s.
pub const BANDWIDTH: Bounds = Bounds {
    min: 1.0,
    max: 1e15,
    shown: "1 B/s to 1000 TB/s",
};
/// A link's latency: none up to a second, a thousand times a WAN's.
pub const LATENCY: Bounds = Bounds {
    min: 0.0,
    max: 1.0,
    shown: "0 s to 1 s",
};
/// A device's peak compute rate at one precision: a GFLOP/s (a slow CPU
/// core) up to 1000 PFLOP/s, far past any chip's.
pub const FLOP_RATE: Bounds = Bounds {
    min: 1e9,
    max: 1e18,
    shown: "1 GFLOP/s to 1000 PFLOP/s",
};
/// A device's (or its host's) memory: a megabyte up to 1000 TB.
pub const MEMORY: Bounds = Bounds {
    min: 1e6,
    max: 1e15,
    shown: "1 MB to 1000 TB",
};

/// Why a model cannot be trained: what `compile` plans and `run` executes is
/// a training step, which updates parameters from the gradient of a scalar
/// float loss, the model's first result.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Untrainable {
    #[error(
        "`{model}` has no parameters: a training step updates parameters, so a model needs \
         some to train (declare them with `param`, or call blocks such as `linear` that do)"
    )]
    NoParams { model: String },
    #[error(
        "`{model}` returns nothing: a training step starts its backward from a scalar float \
         loss, returned first (e.g. `return cross_entropy(logits, targets)`)"
    )]
    NoResult { model: String },
    #[error(
        "`{model}` returns {found} first, not a scalar float loss: a training step starts its \
         backward from one (return the loss first, e.g. `return cross_entropy(logits, targets)`; \
         `dplc inspect` shows a model that does not train)"
    )]
    NotALoss { model: String, found: String },
}

/// A model a training step can run: it has parameters, and its first result
/// is a scalar float loss. `compile` (the frontend, located, and the
/// planner) and the runtime all ask this.
pub fn trainable(graph: &Graph) -> Result<(), Untrainable> {
    let model = || graph.name.clone();
    if graph.param_count() == 0 {
        return Err(Untrainable::NoParams { model: model() });
    }
    let Some(&loss) = graph.outputs().first() else {
        return Err(Untrainable::NoResult { model: model() });
    };
    let t = graph.tensor(loss);
    if !t.shape.dims().is_empty() || !t.dtype.is_float() {
        return Err(Untrainable::NotALoss {
            model: model(),
            found: format!("{}{}", t.dtype, t.shape.display(graph.sym_names())),
        });
    }
    Ok(())
}

/// Why a plan cannot be run or drawn: the field, and what is wrong with it.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{field}: {detail}")]
pub struct PlanInvalid {
    /// The plan's field, as it is spelled in the file: `mesh`, `strategy.zero_stage`, `stages[2]`.
    pub field: String,
    pub detail: String,
}

impl PlanInvalid {
    pub fn new(field: impl fmt::Display, detail: impl fmt::Display) -> PlanInvalid {
        PlanInvalid {
            field: field.to_string(),
            detail: detail.to_string(),
        }
    }
}

/// A number dplc refuses to plan with, and the limit it crossed.
pub fn within(what: &str, value: u64, limit: u64, why: &str) -> Result<(), String> {
    if value > limit {
        return Err(format!(
            "{what} {value} is too large: dplc plans for at most {limit} ({why})"
        ));
    }
    Ok(())
}

/// `--seq` and `strategy.seq`: positive and within [`MAX_SEQ`].
pub fn seq(seq: u64) -> Result<(), String> {
    if seq == 0 {
        return Err("the sequence length must be positive".into());
    }
    within(
        "the sequence length",
        seq,
        MAX_SEQ,
        "2^24 tokens; positions are 32-bit",
    )
}

/// `--global-batch` and `strategy.global_batch`: positive and within [`MAX_GLOBAL_BATCH`].
pub fn global_batch(global_batch: u64) -> Result<(), String> {
    if global_batch == 0 {
        return Err("the global batch must be positive".into());
    }
    within(
        "the global batch",
        global_batch,
        MAX_GLOBAL_BATCH,
        "2^24 sequences",
    )
}

/// `nodes × devices_per_node`, or what is wrong with it.
pub fn world(nodes: u64, devices_per_node: u64) -> Result<u64, String> {
    if nodes == 0 || devices_per_node == 0 {
        return Err(format!(
            "{nodes} nodes of {devices_per_node} devices: both must be at least 1"
        ));
    }
    let world = nodes.checked_mul(devices_per_node).ok_or_else(|| {
        format!("{nodes} nodes × {devices_per_node} devices overflows a 64-bit count")
    })?;
    within(
        &format!("{nodes} nodes × {devices_per_node} devices ="),
        world,
        MAX_DEVICES,
        "2^20 devices",
    )?;
    Ok(world)
}

/// Every degree is at least 1.
pub fn degrees_positive(degrees: &[(&str, u64)]) -> Result<(), String> {
    match degrees.iter().find(|(_, d)| *d == 0) {
        Some((name, _)) => Err(format!("{name} is 0; every degree is at least 1")),
        None => Ok(()),
    }
}

/// `dp × tp × pp × cp` is the cluster's device count (expert parallelism is
/// carved out of dp and adds no devices).
pub fn mesh_fills(dp: u64, tp: u64, pp: u64, cp: u64, world: u64) -> Result<(), String> {
    let product = [tp, pp, cp]
        .iter()
        .try_fold(dp, |acc, &d| acc.checked_mul(d));
    match product {
        Some(p) if p == world => Ok(()),
        Some(p) => Err(format!(
            "dp {dp} × tp {tp} × pp {pp} × cp {cp} = {p} devices, but the cluster has {world}"
        )),
        None => Err(format!(
            "dp {dp} × tp {tp} × pp {pp} × cp {cp} overflows, but the cluster has {world} devices"
        )),
    }
}

/// A pipeline of `pp` stages needs at least one layer per stage.
pub fn pipeline_depth(pp: u64, layers: u64) -> Result<(), String> {
    if pp > layers {
        let noun = if layers == 1 { "layer" } else { "layers" };
        return Err(format!(
            "pp {pp} is more stages than the model's {layers} {noun}"
        ));
    }
    Ok(())
}

/// The interleaved schedule (`v > 1` chunks per stage) as Megatron runs it:
/// the layers split into `pp × v` equal chunks and the micro-batches go
/// through in groups of `pp`. `v = 1` is every other schedule.
pub fn interleaving(layers: u64, pp: u64, v: u64, micro_batches: u64) -> Result<(), String> {
    if v == 0 {
        return Err("virtual stages is 0; a stage runs at least one chunk".into());
    }
    if v == 1 {
        return Ok(());
    }
    if pp == 1 {
        return Err(format!(
            "v {v} needs a pipeline: one stage has nothing to interleave"
        ));
    }
    // Chunks may differ by a layer (each stage's layers split evenly over
    // its chunks, as `virtual_stage_layers` cuts them), but none is empty.
    let chunks = pp.saturating_mul(v);
    if layers < chunks {
        return Err(format!(
            "v {v} with pp {pp}: the {layers} layers cannot give each of the {pp} × {v} chunks a layer"
        ));
    }
    if !micro_batches.is_multiple_of(pp) {
        return Err(format!(
            "v {v} with pp {pp}: the {micro_batches} micro-batches are not a multiple of the {pp} stages"
        ));
    }
    Ok(())
}

/// `m × v × pp` forward passes within [`MAX_PIPELINE_PASSES`].
pub fn pipeline_passes(micro_batches: u64, v: u64, pp: u64) -> Result<(), String> {
    let passes = [v, pp]
        .iter()
        .try_fold(micro_batches, |acc, &d| acc.checked_mul(d))
        .unwrap_or(u64::MAX);
    within(
        &format!("{micro_batches} micro-batches × {v} chunks × {pp} stages ="),
        passes,
        MAX_PIPELINE_PASSES,
        "2^20 passes; use a larger micro-batch",
    )
}

/// The experts of the model's mixture-of-experts layers, if it has any.
pub fn model_experts(graph: &Graph) -> Option<u64> {
    graph.nodes().find_map(|(_, n)| match n.op {
        Op::MoeDispatch { experts, .. } => u64::try_from(experts).ok(),
        _ => None,
    })
}

/// The longest sequence a model reads, when it declares one: learned
/// positions (`embedding(table, positions(seq))`) have a row per position.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MaxSeq {
    pub tokens: u64,
    /// The position table's parameter name, e.g. `wpe`.
    pub table: String,
}

/// The model's [`MaxSeq`], if it has learned positions.
pub fn max_seq(graph: &Graph) -> Option<MaxSeq> {
    let seq = graph.sym_by_name("seq")?;
    graph
        .nodes()
        .filter_map(|(_, n)| match (&n.op, n.inputs.as_slice()) {
            (Op::Embedding, [table, indices]) => Some((*table, *indices)),
            _ => None,
        })
        .filter_map(|(table, indices)| {
            let Op::Iota { len } = &graph.producer(indices)?.op else {
                return None;
            };
            let per_token = len.coeff().as_int().filter(|&c| c > 0)?;
            if len.syms() != [seq] {
                return None;
            }
            let Op::Param(p) = graph.producer(table)?.op else {
                return None;
            };
            let rows = graph.tensor(table).shape.dims().first()?.as_const()?;
            Some(MaxSeq {
                tokens: u64::try_from(rows / per_token).ok()?,
                table: graph.param(p).name.clone(),
            })
        })
        .min_by_key(|m| m.tokens)
}

/// A sequence the model can read: at most its learned positions.
pub fn fits_context(seq: u64, graph: &Graph) -> Result<(), String> {
    match max_seq(graph) {
        Some(m) if seq > m.tokens => Err(format!(
            "the sequence length {seq} is longer than `{}` reads: its position table `{}` has {} rows \
             (use a sequence of at most {}, or derive the model with a table of {seq} rows)",
            graph.name, m.table, m.tokens, m.tokens
        )),
        _ => Ok(()),
    }
}

/// Context parallelism splits the sequence evenly, and only a model it can
/// run (`refusal`, see [`context_refusal`]).
pub fn context(cp: u64, seq: u64, refusal: Option<&str>) -> Result<(), String> {
    if !seq.is_multiple_of(cp) {
        return Err(format!("cp {cp} does not divide the sequence length {seq}"));
    }
    match refusal {
        Some(why) if cp > 1 => Err(format!("cp {cp} {why}: use cp 1")),
        _ => Ok(()),
    }
}

/// Why context parallelism cannot run `graph`, if it cannot: the model has
/// no `seq` axis; an op moves or sums elements along `seq` (a `pad`,
/// `shift` or `cumsum`: no rank can compute its share of the sequence
/// alone); or the rank's program cannot be written ([`crate::split_context`]
/// says why). The planner and the runtime both ask.
pub fn context_refusal(graph: &Graph) -> Option<String> {
    let Some(seq) = graph.sym_by_name("seq") else {
        return Some("splits the sequence, and the model has no `seq` dimension".into());
    };
    let seq = Dim::sym(seq);
    let along_seq = graph.nodes().find_map(|(_, n)| {
        let axis = match n.op {
            Op::Pad { axis, .. } | Op::CumSum { axis, .. } => axis,
            _ => return None,
        };
        let along = graph.tensor(*n.inputs.first()?).shape.dims().get(axis)? == &seq;
        along.then(|| {
            format!(
                "splits the sequence, which `{}` in `{}` reads whole (a shift or running sum \
                 needs its neighbours' elements)",
                n.op.name(),
                graph.scope_path(n.scope)
            )
        })
    });
    // Whatever else the rank's program cannot be written for, as the
    // rewrite the runtime runs says it.
    along_seq.or_else(|| {
        crate::split_context(graph, 2)
            .err()
            .map(|e| format!("cannot split this model's sequence ({e})"))
    })
}

/// Expert parallelism splits the model's experts.
pub fn expert_count(ep: u64, experts: Option<u64>) -> Result<(), String> {
    match experts {
        None if ep > 1 => Err(format!("ep {ep}, but the model has no experts")),
        Some(e) if !e.is_multiple_of(ep) => Err(format!("ep {ep} does not divide the {e} experts")),
        _ => Ok(()),
    }
}

/// Expert-parallel groups are carved out of the data-parallel group.
pub fn expert_groups(ep: u64, dp: u64) -> Result<(), String> {
    if !dp.is_multiple_of(ep) {
        return Err(format!(
            "ep {ep} must divide dp {dp}: expert groups are carved from the data-parallel group"
        ));
    }
    Ok(())
}

/// Sequence parallelism splits each rank's positions (`seq / cp` of them)
/// evenly over the tensor-parallel group. The planner's search and pin
/// checks, `Plan::validate` and the runtime all read this one rule.
pub fn sequence_parallel(sp: bool, tp: u64, cp: u64, seq: u64) -> Result<(), String> {
    if !sp {
        return Ok(());
    }
    if tp == 1 {
        return Err(
            "sequence parallelism needs tp > 1: it splits along the tensor-parallel group".into(),
        );
    }
    // A zero degree or a cp that does not divide seq is the degrees' and
    // context rules' to name; here it only must not divide by zero.
    let positions = seq.checked_div(cp).unwrap_or(seq);
    if !positions.is_multiple_of(tp) {
        let per_rank = if cp > 1 {
            format!("seq {seq} / cp {cp} = {positions}")
        } else {
            format!("seq {seq}")
        };
        return Err(format!(
            "sequence parallelism splits the sequence over the tensor-parallel group: tp {tp} \
             must divide {per_rank}; use sp=off, or a sequence length tp divides"
        ));
    }
    Ok(())
}

/// ZeRO stages 0 to 3.
pub fn zero_stage(zero: u8) -> Result<(), String> {
    if zero > 3 {
        return Err(format!("ZeRO stage {zero}; stages are 0, 1, 2 and 3"));
    }
    Ok(())
}

/// Every replica gets the same whole number of micro-batches:
/// `dp × micro_batch × micro-batches = global batch`.
pub fn batch_split(
    global_batch: u64,
    dp: u64,
    micro_batch: u64,
    micro_batches: u64,
) -> Result<(), String> {
    if micro_batch == 0 || micro_batches == 0 {
        return Err(format!(
            "micro-batch {micro_batch} × {micro_batches}: both must be at least 1"
        ));
    }
    let samples = [micro_batch, micro_batches]
        .iter()
        .try_fold(dp, |acc, &d| acc.checked_mul(d));
    if samples != Some(global_batch) {
        let samples = samples.map_or("an overflowing number of".to_string(), |s| s.to_string());
        return Err(format!(
            "dp {dp} × micro-batch {micro_batch} × {micro_batches} micro-batches = {samples} samples, but the global batch is {global_batch}"
        ));
    }
    Ok(())
}

/// The divisors of `n` in increasing order, by factorising `n` rather than
/// trying every number up to it. `n` is at most [`MAX_DEVICES`] or
/// [`MAX_GLOBAL_BATCH`] where dplc calls it, but any `u64` returns
/// (trial division stops at the smaller of √n and 2^20; a larger remaining
/// factor counts as prime, so for such `n` some divisors may be missing).
pub fn divisors(n: u64) -> Vec<u64> {
    if n == 0 {
        return Vec::new();
    }
    let mut factors: Vec<(u64, u32)> = Vec::new();
    let mut rest = n;
    let mut p = 2u64;
    while p <= 1 << 20 && p.checked_mul(p).is_some_and(|pp| pp <= rest) {
        let mut k = 0;
        while rest.is_multiple_of(p) {
            rest /= p;
            k += 1;
        }
        if k > 0 {
            factors.push((p, k));
        }
        p += if p == 2 { 1 } else { 2 };
    }
    if rest > 1 {
        factors.push((rest, 1));
    }
    let mut out = vec![1u64];
    for (p, k) in factors {
        let mut next = Vec::with_capacity(out.len() * (k as usize + 1));
        for &d in &out {
            let mut x = d;
            next.push(x);
            for _ in 0..k {
                x *= p;
                next.push(x);
            }
        }
        out = next;
    }
    out.sort_unstable();
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn divisors_by_factorisation() {
        assert_eq!(divisors(1), vec![1]);
        assert_eq!(divisors(12), vec![1, 2, 3, 4, 6, 12]);
        assert_eq!(divisors(97), vec![1, 97]);
        assert_eq!(divisors(1 << 20).len(), 21);
        // Bounded time for any u64: 2^64 − 1 = 3·5·17·257·641·65537·6700417.
        assert_eq!(divisors(u64::MAX).len(), 128);
        assert!(divisors(u64::MAX).iter().all(|d| u64::MAX % d == 0));
        for n in 1..300u64 {
            let slow: Vec<u64> = (1..=n).filter(|d| n % d == 0).collect();
            assert_eq!(divisors(n), slow, "{n}");
        }
    }

    #[test]
    fn rules_say_what_is_wrong() {
        assert_eq!(
            mesh_fills(3, 1, 1, 1, 4).unwrap_err(),
            "dp 3 × tp 1 × pp 1 × cp 1 = 3 devices, but the cluster has 4"
        );
        assert!(mesh_fills(u64::MAX, 2, 1, 1, 4)
            .unwrap_err()
            .contains("overflows"));
        assert!(world(65536, 65536).unwrap_err().contains("too large"));
        assert!(world(u64::MAX, 2).unwrap_err().contains("overflows"));
        assert!(seq(0).is_err() && seq(1 << 63).unwrap_err().contains("too large"));
        assert!(zero_stage(9).unwrap_err().contains("ZeRO stage 9"));
        assert!(batch_split(8, 2, 2, 2).is_ok());
        assert!(batch_split(8, u64::MAX, 2, 2)
            .unwrap_err()
            .contains("overflowing"));
        assert!(interleaving(12, 2, 3, 3).unwrap_err().contains("multiple"));
        assert!(
            interleaving(12, 2, 4, 4).is_ok(),
            "chunks of 2 and 1 layers"
        );
        assert!(interleaving(6, 2, 4, 4)
            .unwrap_err()
            .contains("chunks a layer"));
    }
}
