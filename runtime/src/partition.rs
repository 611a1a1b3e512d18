//! Pipeline structure: the root region cut into virtual stages by layers (the
//! first has the embedding, the last the head and loss), what crosses each cut,
//! and the per-rank order of forward and backward work under each schedule.

use crate::error::{Result, RuntimeError};
use dplc_ir::{Graph, NodeId, Op, TensorId};
use std::collections::HashSet;
use std::ops::Range;

/// How micro-batches flow through the pipeline.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Schedule {
    /// All forwards, then all backwards.
    GPipe,
    /// One forward, one backward after a warmup: at most `pp` micro-batches live.
    OneFOneB,
    /// 1F1B over `chunks` model chunks per rank (Megatron's interleaved schedule).
    Interleaved { chunks: usize },
}

impl Schedule {
    pub fn chunks(self) -> usize {
        match self {
            Schedule::Interleaved { chunks } => chunks.max(1),
            _ => 1,
        }
    }
}

/// One unit of pipeline work on a rank.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Work {
    Forward { micro: usize, chunk: usize },
    Backward { micro: usize, chunk: usize },
}

/// The part of the root region one virtual stage runs.
#[derive(Clone, Debug)]
pub struct Chunk {
    /// Root nodes in program order (the repeat included when it has layers here).
    pub nodes: Vec<NodeId>,
    /// Iterations of the top-level repeat.
    pub layers: Range<u64>,
}

/// The root region cut into `chunks.len()` virtual stages.
#[derive(Clone, Debug)]
pub struct Partition {
    pub chunks: Vec<Chunk>,
    /// The top-level repeat, if the model has one.
    pub repeat: Option<NodeId>,
    /// Values computed before the repeat that later stages read: they travel
    /// with the carried activations from stage to stage.
    pub extras: Vec<TensorId>,
}

fn replicated(op: &Op) -> bool {
    matches!(
        op,
        Op::Param(_) | Op::Constant(_) | Op::Iota { .. } | Op::Input(_)
    )
}

impl Partition {
    pub fn new(graph: &Graph, stages: usize) -> Result<Partition> {
        let root = graph.region(graph.root());
        let repeats: Vec<usize> = root
            .nodes
            .iter()
            .enumerate()
            .filter(|(_, &n)| matches!(graph.node(n).op, Op::Repeat { .. }))
            .map(|(i, _)| i)
            .collect();
        if stages == 1 {
            let count = repeats
                .first()
                .map_or(0, |&i| match graph.node(root.nodes[i]).op {
                    Op::Repeat { count, .. } => count,
                    _ => 0,
                });
            return Ok(Partition {
                chunks: vec![Chunk {
                    nodes: root.nodes.clone(),
                    layers: 0..count,
                }],
                repeat: repeats.first().map(|&i| root.nodes[i]),
                extras: Vec::new(),
            });
        }
        let [at] = repeats[..] else {
            return Err(RuntimeError::Config(format!(
                "pipeline parallelism cuts the model at its layers: it needs exactly one top-level repeat, found {}",
                repeats.len()
            )));
        };
        let rep = root.nodes[at];
        let (count, carried) = match graph.node(rep).op {
            Op::Repeat { count, carried, .. } => (count, carried),
            _ => unreachable!("filtered to repeats above"),
        };
        if (count as usize) < stages {
            return Err(RuntimeError::Config(format!(
                "{count} layers cannot fill {stages} pipeline stages"
            )));
        }
        let (base, extra) = (count / stages as u64, count % stages as u64);
        let mut start = 0;
        let ranges: Vec<Range<u64>> = (0..stages as u64)
            .map(|c| {
                let len = base + u64::from(c < extra);
                start += len;
                start - len..start
            })
            .collect();
        let pre: Vec<NodeId> = root.nodes[..at].to_vec();
        let post: Vec<NodeId> = root.nodes[at + 1..].to_vec();
        let is_rep = |n: NodeId| replicated(&graph.node(n).op);
        let produced_pre: HashSet<TensorId> = pre
            .iter()
            .filter(|&&n| !is_rep(n))
            .flat_map(|&n| graph.node(n).outputs.iter().copied())
            .collect();
        // Pre values read by the repeat's captured inputs or by the head travel along.
        let mut extras: Vec<TensorId> = Vec::new();
        let reads = graph.node(rep).inputs[carried..]
            .iter()
            .chain(post.iter().flat_map(|&n| graph.node(n).inputs.iter()))
            .chain(root.results.iter());
        for &t in reads {
            if produced_pre.contains(&t) && !extras.contains(&t) {
                extras.push(t);
            }
        }
        let chunks = ranges
            .into_iter()
            .enumerate()
            .map(|(c, layers)| {
                let mut own: Vec<NodeId> = Vec::new();
                if c == 0 {
                    own.extend(pre.iter().filter(|&&n| !is_rep(n)));
                }
                own.push(rep);
                if c == stages - 1 {
                    own.extend(post.iter().filter(|&&n| !is_rep(n)));
                }
                // Replicated leaves that this chunk's nodes read are computed here too.
                let mut needed: HashSet<TensorId> = HashSet::new();
                for &n in &own {
                    let node = graph.node(n);
                    let skip = if n == rep && c > 0 { carried } else { 0 };
                    needed.extend(node.inputs.iter().skip(skip));
                }
                let nodes = root
                    .nodes
                    .iter()
                    .copied()
                    .filter(|&n| {
                        own.contains(&n)
                            || (is_rep(n)
                                && graph.node(n).outputs.iter().any(|t| needed.contains(t)))
                    })
                    .collect();
                Chunk { nodes, layers }
            })
            .collect();
        Ok(Partition {
            chunks,
            repeat: Some(rep),
            extras,
        })
    }
}

/// The order of work on pipeline rank `stage` of `pp`, for `micro` micro-batches
/// and `v` chunks per rank; chunk ids are virtual stages `local·pp + stage`.
pub fn schedule(kind: Schedule, stage: usize, pp: usize, micro: usize) -> Vec<Work> {
    let v = kind.chunks();
    let f = |micro, chunk| Work::Forward { micro, chunk };
    let b = |micro, chunk| Work::Backward { micro, chunk };
    match kind {
        Schedule::GPipe => (0..micro)
            .map(|m| f(m, stage))
            .chain((0..micro).map(|m| b(m, stage)))
            .collect(),
        Schedule::OneFOneB | Schedule::Interleaved { .. } => {
            let total = micro * v;
            // The k-th forward (backward) of this rank: micro-batches go in groups
            // of pp through chunk 0, then the same group through chunk 1, …
            let at = |k: usize, backward: bool| {
                let group = k / (pp * v);
                let within = k % (pp * v);
                let local = if backward {
                    v - 1 - within / pp
                } else {
                    within / pp
                };
                (group * pp + within % pp, local * pp + stage)
            };
            let warmup = if v == 1 {
                (pp - stage - 1).min(total)
            } else {
                ((pp - stage - 1) * 2 + (v - 1) * pp).min(total)
            };
            let mut out = Vec::with_capacity(2 * total);
            for k in 0..warmup {
                let (m, c) = at(k, false);
                out.push(f(m, c));
            }
            for k in 0..total - warmup {
                let (m, c) = at(warmup + k, false);
                out.push(f(m, c));
                let (m, c) = at(k, true);
                out.push(b(m, c));
            }
            for k in total - warmup..total {
                let (m, c) = at(k, true);
                out.push(b(m, c));
            }
            out
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_f_one_b_keeps_at_most_pp_micro_batches_alive() {
        for stage in 0..4 {
            let s = schedule(Schedule::OneFOneB, stage, 4, 8);
            let (mut live, mut peak) = (0i32, 0i32);
            for w in &s {
                live += if matches!(w, Work::Forward { .. }) {
                    1
                } else {
                    -1
                };
                peak = peak.max(live);
            }
            assert_eq!(peak as usize, 4 - stage);
            assert_eq!(s.len(), 16);
        }
    }

    #[test]
    fn interleaved_runs_every_chunk_of_every_micro_batch() {
        let s = schedule(Schedule::Interleaved { chunks: 2 }, 1, 2, 4);
        let mut fwd: Vec<(usize, usize)> = s
            .iter()
            .filter_map(|w| match *w {
                Work::Forward { micro, chunk } => Some((micro, chunk)),
                _ => None,
            })
            .collect();
        fwd.sort();
        assert_eq!(
            fwd,
            vec![
                (0, 1),
                (0, 3),
                (1, 1),
                (1, 3),
                (2, 1),
                (2, 3),
                (3, 1),
                (3, 3)
            ]
        );
    }
}
