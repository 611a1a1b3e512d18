//! Pipeline structure: the root region cut into virtual stages by layers (the
//! first has the embedding, the last the head and loss), what crosses each cut,
//! and the per-rank order of forward and backward work under each schedule.

use crate::error::{Result, RuntimeError};
use dplc_ir::{
    even_split, pipeline_order, virtual_stage_layers, Graph, NodeId, Op, PipelineSchedule,
    PipelineWork, TensorId,
};
use std::collections::{HashMap, HashSet};
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
    /// The model's layers it runs, numbered across its stacks.
    pub layers: Range<u64>,
}

/// One top-level `repeat`: a layer stack, and the model's number of its
/// first layer (stacks number their layers one after the other).
#[derive(Clone, Copy, Debug)]
pub struct Stack {
    pub node: NodeId,
    pub first: u64,
    pub count: u64,
}

/// The root region cut into `chunks.len()` virtual stages.
#[derive(Clone, Debug)]
pub struct Partition {
    pub chunks: Vec<Chunk>,
    /// Every layer stack, in program order.
    pub stacks: Vec<Stack>,
    /// Values a chunk reads that an earlier chunk made and no stack's
    /// carried values deliver: they travel with those from stage to stage
    /// (empty where not yet made).
    pub extras: Vec<TensorId>,
}

fn replicated(op: &Op) -> bool {
    matches!(
        op,
        Op::Param(_) | Op::Constant(_) | Op::Iota { .. } | Op::Input(_)
    )
}

/// What crosses the cut after a chunk: the carried values of `stack` after
/// the chunk's last layer, which the next chunk continues (`continues`) or,
/// when that was the stack's last layer, reads as the stack's outputs.
#[derive(Clone, Copy, Debug)]
pub struct Cut {
    pub stack: Stack,
    pub continues: bool,
}

impl Partition {
    /// The layer stack repeat node `n` is, if it is one.
    pub fn stack(&self, n: NodeId) -> Option<&Stack> {
        self.stacks.iter().find(|s| s.node == n)
    }

    /// The iterations of `stack` chunk `c` runs.
    pub fn stack_layers(&self, c: usize, stack: &Stack) -> Range<u64> {
        let layers = &self.chunks[c].layers;
        let from = layers.start.max(stack.first);
        let to = layers.end.min(stack.first + stack.count).max(from);
        from - stack.first..to - stack.first
    }

    /// What crosses the cut after chunk `c` (`None` after the last).
    pub fn cut(&self, c: usize) -> Option<Cut> {
        if c + 1 >= self.chunks.len() {
            return None;
        }
        let last = self.chunks[c].layers.end.checked_sub(1)?;
        let stack = *self
            .stacks
            .iter()
            .find(|s| (s.first..s.first + s.count).contains(&last))?;
        Some(Cut {
            stack,
            continues: last + 1 < stack.first + stack.count,
        })
    }

    /// Cut `graph` into `pp × chunks` virtual stages, pipeline stage `s`
    /// running `stage_layers[s]` layers over its chunks — the plan's
    /// partition, uneven as it was balanced. A run not made from a plan
    /// (`None`) splits the layers evenly. The layers of several stacks are
    /// numbered one after the other, and a cut may fall anywhere among
    /// them: the root's other nodes run on the chunk that runs the next
    /// stack's first layer (after the last stack: the last chunk).
    pub fn new(
        graph: &Graph,
        pp: usize,
        chunks: usize,
        stage_layers: Option<&[u64]>,
    ) -> Result<Partition> {
        let stages = (pp * chunks).max(1);
        let root = graph.region(graph.root());
        let mut stacks = Vec::new();
        let mut total = 0;
        for &n in &root.nodes {
            if let Op::Repeat { count, .. } = graph.node(n).op {
                stacks.push(Stack {
                    node: n,
                    first: total,
                    count,
                });
                total += count;
            }
        }
        if stages == 1 {
            return Ok(Partition {
                chunks: vec![Chunk {
                    nodes: root.nodes.clone(),
                    layers: 0..total,
                }],
                stacks,
                extras: Vec::new(),
            });
        }
        if stacks.is_empty() {
            return Err(RuntimeError::Config(
                "pipeline parallelism cuts the model at its layers, and it has no `repeat`".into(),
            ));
        }
        if (total as usize) < stages {
            return Err(RuntimeError::Config(format!(
                "{total} layers cannot fill {stages} pipeline stages"
            )));
        }
        let stage_layers = match stage_layers {
            Some(l) => l.to_vec(),
            None => even_split(total, pp as u64),
        };
        let planned: u64 = stage_layers.iter().sum();
        if stage_layers.len() != pp || planned != total {
            return Err(RuntimeError::Config(format!(
                "the plan puts {planned} layers on {} stages ({stage_layers:?}); the run has {pp} stages and the model {total} layers",
                stage_layers.len()
            )));
        }
        let layers = virtual_stage_layers(&stage_layers, chunks as u64);
        if layers.contains(&0) {
            return Err(RuntimeError::Config(format!(
                "stages of {stage_layers:?} layers leave a chunk empty: each of the {chunks} chunks per stage needs a layer"
            )));
        }
        let mut start = 0;
        let ranges: Vec<Range<u64>> = layers
            .iter()
            .map(|&len| {
                start += len;
                start - len..start
            })
            .collect();
        let chunk_of = |layer: u64| {
            ranges
                .iter()
                .position(|r| r.contains(&layer))
                .unwrap_or(stages - 1)
        };
        let is_rep = |n: NodeId| replicated(&graph.node(n).op);
        // Which chunks run each root node: a stack every chunk that runs
        // one of its layers; any other node the chunk of the next stack's
        // first layer; a replicated leaf wherever it is read.
        let mut owners: HashMap<NodeId, Vec<usize>> = HashMap::new();
        let mut next = 0;
        for &n in &root.nodes {
            if is_rep(n) {
                continue;
            }
            let own = match stacks.get(next) {
                Some(st) if st.node == n => {
                    next += 1;
                    (chunk_of(st.first)..=chunk_of(st.first + st.count - 1)).collect()
                }
                Some(st) => vec![chunk_of(st.first)],
                None => vec![stages - 1],
            };
            owners.insert(n, own);
        }
        // The chunk that finally produces each root value, and the chunks
        // that read it.
        let mut producer: HashMap<TensorId, usize> = HashMap::new();
        for (&n, own) in &owners {
            for &t in &graph.node(n).outputs {
                producer.insert(t, *own.iter().max().expect("a node runs somewhere"));
            }
        }
        // What crosses a cut besides a stack's carried values: a value read
        // on a chunk after the one that made it, unless the stack's carried
        // values at the cut right after it deliver it.
        let mut extras: Vec<TensorId> = Vec::new();
        let read = |t: TensorId, reader: usize, extras: &mut Vec<TensorId>| {
            let Some(&p) = producer.get(&t) else { return };
            if reader <= p || extras.contains(&t) {
                return;
            }
            let delivered = reader == p + 1
                && stacks.iter().any(|st| {
                    graph.node(st.node).outputs.contains(&t) && ranges[p].end == st.first + st.count
                });
            if !delivered {
                extras.push(t);
            }
        };
        for &n in &root.nodes {
            let Some(own) = owners.get(&n) else { continue };
            let node = graph.node(n);
            let carried = match node.op {
                Op::Repeat { carried, .. } => carried,
                _ => 0,
            };
            for (j, &t) in node.inputs.iter().enumerate() {
                // A stack's carried inputs start its first layer only.
                let readers: Vec<usize> = if j < carried {
                    vec![own[0]]
                } else {
                    own.clone()
                };
                for r in readers {
                    read(t, r, &mut extras);
                }
            }
        }
        for &t in &root.results {
            read(t, stages - 1, &mut extras);
        }
        let chunks = ranges
            .into_iter()
            .enumerate()
            .map(|(c, layers)| {
                let own: Vec<NodeId> = root
                    .nodes
                    .iter()
                    .copied()
                    .filter(|n| owners.get(n).is_some_and(|o| o.contains(&c)))
                    .collect();
                // Replicated leaves that this chunk's nodes read are computed here too.
                let needed: HashSet<TensorId> = own
                    .iter()
                    .flat_map(|&n| graph.node(n).inputs.iter().copied())
                    .collect();
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
            stacks,
            extras,
        })
    }
}

/// The order of work on pipeline rank `stage` of `pp`, for `micro`
/// micro-batches: the plan's own order (`dplc_ir::pipeline_order`, which the
/// planner's timeline prices), with chunks named by their virtual stage
/// `local · pp + stage`.
pub fn schedule(kind: Schedule, stage: usize, pp: usize, micro: usize) -> Vec<Work> {
    let ir_kind = match kind {
        Schedule::GPipe => PipelineSchedule::GPipe,
        Schedule::OneFOneB => PipelineSchedule::OneFOneB,
        Schedule::Interleaved { .. } => PipelineSchedule::Interleaved,
    };
    let virt = |local: u64| local as usize * pp + stage;
    pipeline_order(
        ir_kind,
        pp as u64,
        stage as u64,
        micro as u64,
        kind.chunks() as u64,
    )
    .into_iter()
    .map(|w| match w {
        PipelineWork::Forward { micro, chunk } => Work::Forward {
            micro: micro as usize,
            chunk: virt(chunk),
        },
        PipelineWork::Backward { micro, chunk } => Work::Backward {
            micro: micro as usize,
            chunk: virt(chunk),
        },
    })
    .collect()
}
