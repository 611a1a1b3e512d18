//! Pipeline structure: the root region cut into virtual stages by layers (the
//! first has the embedding, the last the head and loss), what crosses each cut,
//! and the per-rank order of forward and backward work under each schedule.

use crate::error::{Result, RuntimeError};
use dplc_ir::{
    even_split, pipeline_order, virtual_stage_layers, Graph, NodeId, Op, PipelineSchedule,
    PipelineWork, TensorId,
};
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
    /// The top-level repeat a pipeline cuts: the model's one layer stack.
    pub repeat: Option<NodeId>,
    /// Every layer stack, in program order.
    pub stacks: Vec<Stack>,
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
    /// The layer stack repeat node `n` is, if it is one.
    pub fn stack(&self, n: NodeId) -> Option<&Stack> {
        self.stacks.iter().find(|s| s.node == n)
    }

    /// Cut `graph` into `pp × chunks` virtual stages, pipeline stage `s`
    /// running `stage_layers[s]` layers over its chunks — the plan's
    /// partition, uneven as it was balanced. A run not made from a plan
    /// (`None`) splits the layers evenly.
    pub fn new(
        graph: &Graph,
        pp: usize,
        chunks: usize,
        stage_layers: Option<&[u64]>,
    ) -> Result<Partition> {
        let stages = (pp * chunks).max(1);
        let root = graph.region(graph.root());
        let repeats: Vec<usize> = root
            .nodes
            .iter()
            .enumerate()
            .filter(|(_, &n)| matches!(graph.node(n).op, Op::Repeat { .. }))
            .map(|(i, _)| i)
            .collect();
        let mut stacks = Vec::with_capacity(repeats.len());
        let mut total = 0;
        for &i in &repeats {
            if let Op::Repeat { count, .. } = graph.node(root.nodes[i]).op {
                stacks.push(Stack {
                    node: root.nodes[i],
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
                repeat: match stacks[..] {
                    [one] => Some(one.node),
                    _ => None,
                },
                stacks,
                extras: Vec::new(),
            });
        }
        let [at] = repeats[..] else {
            return Err(RuntimeError::Unsupported(format!(
                "pipeline parallelism cuts a model's one layer stack; this model has {} (`repeat`s at its top level): train it without pp for now",
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
        let stage_layers = match stage_layers {
            Some(l) => l.to_vec(),
            None => even_split(count, pp as u64),
        };
        let planned: u64 = stage_layers.iter().sum();
        if stage_layers.len() != pp || planned != count {
            return Err(RuntimeError::Config(format!(
                "the plan puts {planned} layers on {} stages ({stage_layers:?}); the run has {pp} stages and the model {count} layers",
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
