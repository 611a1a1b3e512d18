//! The pipeline as a plan decides it: which layers each (virtual) stage runs
//! and the order of every stage's forward and backward passes. The planner's
//! timeline and the runtime's executor both read these, so what runs is what
//! was priced.

use crate::PipelineSchedule;

/// One pass of one micro-batch through one of a stage's model chunks.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum PipelineWork {
    /// `chunk` is the stage's local chunk, `0..v` (always 0 unless interleaved).
    Forward {
        micro: u64,
        chunk: u64,
    },
    Backward {
        micro: u64,
        chunk: u64,
    },
}

impl PipelineWork {
    pub fn micro(self) -> u64 {
        match self {
            PipelineWork::Forward { micro, .. } | PipelineWork::Backward { micro, .. } => micro,
        }
    }

    pub fn chunk(self) -> u64 {
        match self {
            PipelineWork::Forward { chunk, .. } | PipelineWork::Backward { chunk, .. } => chunk,
        }
    }

    pub fn is_forward(self) -> bool {
        matches!(self, PipelineWork::Forward { .. })
    }
}

/// The order in which pipeline stage `stage` of `pp` runs the forward and
/// backward passes of `micro_batches` micro-batches through its `chunks`
/// model chunks (virtual stage `chunk · pp + stage`).
///
/// GPipe runs every forward, then every backward. 1F1B warms up with
/// `pp − stage − 1` forwards and then alternates, so at most `pp − stage`
/// micro-batches are in flight. The interleaved schedule is Megatron's:
/// micro-batches go through chunk 0 in groups of `pp`, then the same group
/// through chunk 1, …; backwards walk the chunks in reverse; the warm-up is
/// `2(pp − stage − 1) + (chunks − 1)·pp` forwards.
pub fn pipeline_order(
    schedule: PipelineSchedule,
    pp: u64,
    stage: u64,
    micro_batches: u64,
    chunks: u64,
) -> Vec<PipelineWork> {
    let (p, v) = (pp.max(1), chunks.max(1));
    let total = micro_batches * v;
    let at = |k: u64| {
        let (group, within) = (k / (p * v), k % (p * v));
        (group * p + within % p, within / p)
    };
    let fwd = |k: u64| {
        let (micro, chunk) = at(k);
        PipelineWork::Forward { micro, chunk }
    };
    let bwd = |k: u64| {
        let (micro, chunk) = at(k);
        PipelineWork::Backward {
            micro,
            chunk: v - 1 - chunk,
        }
    };
    let behind = p - 1 - stage.min(p - 1);
    let warmup = match schedule {
        PipelineSchedule::GPipe => total,
        PipelineSchedule::OneFOneB if v == 1 => behind.min(total),
        PipelineSchedule::OneFOneB | PipelineSchedule::Interleaved => {
            (2 * behind + (v - 1) * p).min(total)
        }
    };
    let mut out = Vec::with_capacity(2 * total as usize);
    out.extend((0..warmup).map(fwd));
    for k in 0..total - warmup {
        out.push(fwd(warmup + k));
        out.push(bwd(k));
    }
    out.extend((total - warmup..total).map(bwd));
    out
}

/// Whether ZeRO-3 keeps a stage's gathered weights and whole gradients
/// through the step: under a pipeline it does (torchtitan's FSDP2 does not
/// reshard after forward when pipelining, and PyTorch's pipeline stage
/// defers the gradients' reduce-scatter to its last backward), so each
/// weight is gathered once a step and each gradient reduce-scattered once,
/// where without a pipeline every micro-batch gathers and reduces its
/// layers again. The planner prices it and the runtime runs it from here.
pub fn zero3_holds_the_step(zero_stage: u8, pp: u64) -> bool {
    zero_stage >= 3 && pp > 1
}

/// `total` split into `parts` counts as equal as they go, the larger first.
pub fn even_split(total: u64, parts: u64) -> Vec<u64> {
    let parts = parts.max(1);
    (0..parts)
        .map(|i| total / parts + u64::from(i < total % parts))
        .collect()
}

/// Megatron-LM's stage split when it counts the embedding and/or the loss
/// as a layer (`--account-for-embedding-in-pipeline-split`,
/// `--account-for-loss-in-pipeline-split`): `layers` plus those over `pp`
/// stages of `chunks` equal chunks, the first chunk (beside the embedding)
/// and the last (beside the loss) one layer short. `None` where the counts
/// do not divide or a chunk would be empty. [`virtual_stage_layers`] cuts
/// these stages into exactly Megatron's chunks.
pub fn accounted_stage_layers(
    layers: u64,
    pp: u64,
    chunks: u64,
    embedding: bool,
    loss: bool,
) -> Option<Vec<u64>> {
    let slots = pp.checked_mul(chunks.max(1))?;
    let total = layers + u64::from(embedding) + u64::from(loss);
    if slots == 0 || !total.is_multiple_of(slots) || total / slots < 2 && (embedding || loss) {
        return None;
    }
    let mut stages = vec![total / pp; pp as usize];
    stages[0] -= u64::from(embedding);
    stages[pp as usize - 1] -= u64::from(loss);
    Some(stages)
}

/// Layers per virtual stage, in pipeline order (virtual stage `c · pp + s` is
/// chunk `c` of stage `s`), given the layers of each pipeline stage: a stage's
/// layers are cut into `chunks` consecutive runs as equal as they go. The
/// first stage's shorter runs come first, beside the embedding its first
/// chunk also runs, and every other stage's last — the last stage's beside
/// the head and loss — as Megatron-LM's `--account-for-embedding-in-pipeline-split`
/// and `--account-for-loss-in-pipeline-split` place them.
pub fn virtual_stage_layers(stage_layers: &[u64], chunks: u64) -> Vec<u64> {
    let pp = stage_layers.len();
    let per_stage: Vec<Vec<u64>> = stage_layers
        .iter()
        .enumerate()
        .map(|(s, &l)| {
            let mut runs = even_split(l, chunks);
            if s == 0 {
                runs.reverse();
            }
            runs
        })
        .collect();
    (0..chunks.max(1) as usize * pp)
        .map(|k| per_stage[k % pp][k / pp])
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn in_flight_peak(order: &[PipelineWork]) -> i64 {
        let (mut live, mut peak) = (0i64, 0i64);
        for w in order {
            live += if w.is_forward() { 1 } else { -1 };
            peak = peak.max(live);
        }
        peak
    }

    #[test]
    fn one_f_one_b_keeps_at_most_pp_minus_stage_micro_batches_alive() {
        for stage in 0..4 {
            let o = pipeline_order(PipelineSchedule::OneFOneB, 4, stage, 8, 1);
            assert_eq!(in_flight_peak(&o), 4 - stage as i64);
            assert_eq!(o.len(), 16);
        }
    }

    #[test]
    fn gpipe_runs_every_forward_first() {
        let o = pipeline_order(PipelineSchedule::GPipe, 2, 1, 3, 1);
        assert_eq!(in_flight_peak(&o), 3);
        assert!(o[..3].iter().all(|w| w.is_forward()));
    }

    #[test]
    fn interleaved_runs_every_chunk_of_every_micro_batch_once_each_way() {
        for stage in 0..2 {
            let o = pipeline_order(PipelineSchedule::Interleaved, 2, stage, 4, 2);
            let mut fwd: Vec<(u64, u64)> = o
                .iter()
                .filter(|w| w.is_forward())
                .map(|w| (w.micro(), w.chunk()))
                .collect();
            let mut bwd: Vec<(u64, u64)> = o
                .iter()
                .filter(|w| !w.is_forward())
                .map(|w| (w.micro(), w.chunk()))
                .collect();
            fwd.sort();
            bwd.sort();
            let all: Vec<(u64, u64)> = (0..4).flat_map(|m| [(m, 0), (m, 1)]).collect();
            assert_eq!(fwd, all);
            assert_eq!(bwd, all);
        }
    }

    #[test]
    fn stage_layers_cut_into_virtual_stages_in_pipeline_order() {
        assert_eq!(even_split(10, 4), vec![3, 3, 2, 2]);
        assert_eq!(virtual_stage_layers(&[3, 5], 1), vec![3, 5]);
        // Stage 0 runs chunks [1, 2] (the short one beside the embedding),
        // stage 1 [3, 2]: virtual order s0c0 s1c0 s0c1 s1c1.
        assert_eq!(virtual_stage_layers(&[3, 5], 2), vec![1, 3, 2, 2]);
        // Llama 3.1 405B's 126 layers on 8 stages of 8 chunks, as Megatron
        // accounts for the embedding and the loss: (126 + 2) / 64 = 2 a
        // chunk, the first and the last one short.
        let stages = accounted_stage_layers(126, 8, 8, true, true).unwrap();
        assert_eq!(stages, [15, 16, 16, 16, 16, 16, 16, 15]);
        let v = virtual_stage_layers(&stages, 8);
        assert_eq!((v[0], v[63]), (1, 1));
        assert!(v[1..63].iter().all(|&n| n == 2));
        // Megatron's plain interleaving needs equal chunks; the others a
        // count that divides and a layer in the short chunk.
        assert_eq!(
            accounted_stage_layers(32, 2, 4, false, false),
            Some(vec![16, 16])
        );
        assert_eq!(accounted_stage_layers(32, 2, 4, true, true), None);
        assert_eq!(accounted_stage_layers(3, 2, 2, false, true), None);
        assert_eq!(
            accounted_stage_layers(7, 2, 2, false, true),
            Some(vec![4, 3])
        );
    }
}
