//! The layouts the cost model prices, from the sharding e-graph: one e-graph
//! per distinct (region, tensor degree, expert degree), however many layers
//! repeat the body, and the model profile under each.

use crate::cluster::Cluster;
use crate::egraph::{shard_region, Limits, LinkCost, RuntimeLayout, ShardOptions, ShardResult};
use crate::profile::{layer_body, ModelProfile};
use crate::PlanError;
use dplc_ir::{Analysis, Graph, LinkLevel, Precision};
use serde::Serialize;
use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

/// The tensor- and expert-parallel degrees a layout is extracted for.
pub(crate) type Degrees = (u64, u64);

/// One extracted layout and the profile the cost model reads under it.
pub(crate) struct Layout {
    /// The model priced with the e-graph's root (vocabulary-parallel).
    pub profile: ModelProfile,
    /// The same layers with the root whole on every rank (`root=replicated`).
    pub replicated_root: ModelProfile,
    /// Each layer stack's body, in program order.
    pub stacks: Vec<ShardResult>,
    pub root: ShardResult,
}

impl Layout {
    /// The root split the search takes unless pinned: over the vocabulary
    /// where the runtime can run the root's e-graph layout, whole on every
    /// rank where it cannot (a tied weight the head reads through a view
    /// stored split), so the plan prices the root it runs.
    pub fn default_root(&self) -> dplc_ir::RootSplit {
        if self.root.runtime_layout.is_some() {
            dplc_ir::RootSplit::Vocab
        } else {
            dplc_ir::RootSplit::Replicated
        }
    }

    /// The profile the search prices for `root`.
    pub fn profile_for(&self, root: dplc_ir::RootSplit) -> &ModelProfile {
        match root {
            dplc_ir::RootSplit::Vocab => &self.profile,
            dplc_ir::RootSplit::Replicated => &self.replicated_root,
        }
    }
}

/// How one region's e-graph went, for `dplc compile --verbose`.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct LayoutStats {
    /// `layer` or `model`.
    pub region: String,
    pub tp: u64,
    pub ep: u64,
    pub sequence_parallel: bool,
    pub egraph_nodes: usize,
    pub egraph_classes: usize,
    pub iterations: usize,
    pub stop_reason: String,
    pub time_ms: f64,
    /// The extracted program's per-rank time under the e-graph's own cost model.
    pub cost_s: f64,
    /// Collectives of one call of the region (forward and backward).
    pub collectives: usize,
}

impl LayoutStats {
    pub(crate) fn of(region: &str, r: &ShardResult) -> LayoutStats {
        let p = &r.region_program;
        LayoutStats {
            region: region.to_string(),
            tp: p.tp,
            ep: p.ep,
            sequence_parallel: p.sequence_parallel,
            egraph_nodes: r.stats.nodes,
            egraph_classes: r.stats.classes,
            iterations: r.stats.iterations,
            stop_reason: r.stats.stop_reason.clone(),
            time_ms: r.stats.time.as_secs_f64() * 1e3,
            cost_s: r.stats.cost_s,
            collectives: r.collectives.len(),
        }
    }
}

/// The e-graph's options for `cluster`: the links the tensor- and
/// expert-parallel groups would use, and the device's rates, at one sequence
/// of `seq` tokens (the layout choice depends on ratios, not on the batch).
pub(crate) fn shard_options(
    cluster: &Cluster,
    precision: Precision,
    seq: u64,
    (tp, ep): Degrees,
    sequence_parallel: bool,
) -> ShardOptions {
    let link_for = |size: u64, stride: u64| {
        let l = crate::cost::group_link(cluster, stride, size);
        let link = if l.level == LinkLevel::InterNode {
            &cluster.inter_node
        } else {
            &cluster.intra_node
        };
        LinkCost {
            alpha_s: link.latency_s,
            bytes_per_s: l.bandwidth.max(1.0),
        }
    };
    let d = &cluster.device;
    ShardOptions {
        tp,
        ep,
        cp: 1,
        sequence_parallel: sequence_parallel && tp > 1,
        batch: 1,
        seq,
        element_bytes: precision.bytes(),
        flops_per_s: d.peak_flops(precision) * d.matmul_efficiency,
        memory_bytes_per_s: d.memory_bandwidth,
        links: [link_for(tp, 1), link_for(ep, tp), link_for(1, 1)],
        replicated_weight_s_per_byte: ShardOptions::default().replicated_weight_s_per_byte,
        limits: Limits {
            nodes: 20_000,
            iterations: 60,
            time: Duration::from_secs(2),
        },
    }
}

/// The name of layer stack `i` of `n` in plans and reports: `layer` when
/// the model has one.
pub(crate) fn stack_name(i: usize, n: usize) -> String {
    if n == 1 {
        "layer".to_string()
    } else {
        format!("stack{i}")
    }
}

/// Extract the layouts of `g`'s layer stacks' bodies and root at `degrees`.
pub(crate) fn extract(
    g: &Graph,
    an: &Analysis,
    cluster: &Cluster,
    precision: Precision,
    seq: u64,
    degrees: Degrees,
    sequence_parallel: bool,
) -> Result<(Vec<ShardResult>, ShardResult), String> {
    layer_body(g, an).map_err(|e| e.to_string())?;
    let opts = shard_options(cluster, precision, seq, degrees, sequence_parallel);
    let bodies = an.stacks();
    let mut stacks = Vec::with_capacity(bodies.len());
    for (i, &(_, body, _)) in bodies.iter().enumerate() {
        let mut layer = shard_region(g, an, body, &opts).map_err(|e| e.to_string())?;
        layer.region_program.region = stack_name(i, bodies.len());
        stacks.push(layer);
    }
    let mut root = shard_region(g, an, g.root(), &opts).map_err(|e| e.to_string())?;
    root.region_program.region = "model".into();
    Ok((stacks, root))
}

/// Why tensor degree `tp` cannot split the layers of `stacks`, if it cannot.
fn tp_refusal(stacks: &[ShardResult], tp: u64) -> Option<String> {
    if tp <= 1 {
        return None;
    }
    let n = stacks.len();
    stacks.iter().enumerate().find_map(|(i, l)| {
        let max_tp = l.sharding.max_tp;
        let which = if n == 1 {
            "the layer".to_string()
        } else {
            format!("layer stack {i}")
        };
        if max_tp <= 1 {
            Some(format!(
                "no head or hidden dimension of {which} divides by {tp}"
            ))
        } else if !max_tp.is_multiple_of(tp) {
            Some(format!(
                "the split dimensions (heads, hidden widths) of {which} have greatest common \
                 divisor {max_tp}, which tp={tp} does not divide"
            ))
        } else {
            None
        }
    })
}

/// Every layout the search may price, by degrees; a degree with no layout
/// keeps the reason.
pub(crate) struct Layouts {
    pub by_degrees: BTreeMap<Degrees, Arc<Result<Layout, String>>>,
}

/// The layouts one `compile` has extracted, by degrees: the search and each
/// what-if ask for some of the same ones (the same graph, cluster,
/// precision and sequence), and an e-graph is most of a search's time.
/// What-ifs run side by side: a degree asked for twice at once is
/// extracted once, the second asker waiting for the first.
#[derive(Default)]
pub(crate) struct LayoutCache {
    done: Cells<Arc<Result<Layout, String>>>,
    /// The programs under sequence parallelism, extracted for a plan's own
    /// degrees (the what-ifs that keep them ask again).
    sequence_parallel: Cells<SpPrograms>,
}

/// A value per degrees, each computed once.
type Cells<V> = Mutex<BTreeMap<Degrees, Arc<OnceLock<V>>>>;

/// The cell for `d`, made empty if new. (The lock is held only to find the
/// cell, never while a value is computed.)
fn cell<V>(cells: &Cells<V>, d: Degrees) -> Arc<OnceLock<V>> {
    cells
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
        .entry(d)
        .or_default()
        .clone()
}

/// A region's programs at some degrees under sequence parallelism: the
/// layer stacks' and the root's.
pub(crate) type SpPrograms = Arc<Result<(Vec<ShardResult>, ShardResult), String>>;

impl LayoutCache {
    /// The layer stacks' and the root's programs at degrees `d` with the
    /// residual stream split along the sequence, extracted once.
    pub fn sequence_parallel(
        &self,
        g: &Graph,
        cluster: &Cluster,
        precision: Precision,
        seq: u64,
        d: Degrees,
    ) -> SpPrograms {
        cell(&self.sequence_parallel, d)
            .get_or_init(|| {
                let an = Analysis::new(g);
                Arc::new(extract(g, &an, cluster, precision, seq, d, true))
            })
            .clone()
    }
}

impl Layouts {
    /// Extract a layout for each of `degrees`, those not in `cache` on as
    /// many threads as the machine has cores (each is its own e-graph).
    pub fn new(
        g: &Graph,
        precision: Precision,
        cluster: &Cluster,
        seq: u64,
        degrees: impl IntoIterator<Item = Degrees>,
        cache: &LayoutCache,
    ) -> Result<Layouts, PlanError> {
        let an = Analysis::new(g);
        layer_body(g, &an)?;
        let cells: Vec<(Degrees, Arc<OnceLock<_>>)> = degrees
            .into_iter()
            .map(|d| (d, cell(&cache.done, d)))
            .collect();
        let missing: Vec<&(Degrees, Arc<OnceLock<_>>)> =
            cells.iter().filter(|(_, c)| c.get().is_none()).collect();
        crate::deal::map(&missing, |(d, c)| {
            c.get_or_init(|| Arc::new(layout_at(g, &an, precision, cluster, seq, *d)));
        });
        let by_degrees = cells
            .into_iter()
            .filter_map(|(d, c)| c.get().map(|l| (d, l.clone())))
            .collect();
        Ok(Layouts { by_degrees })
    }

    /// Whether some expert degree has a layout at tensor degree `tp`; if none
    /// has, why the first one failed.
    pub fn at_tp(&self, tp: u64) -> Result<(), &str> {
        let mut why = "no layout was extracted";
        for ((t, _), l) in &self.by_degrees {
            match &**l {
                _ if *t != tp => {}
                Ok(_) => return Ok(()),
                Err(e) => why = e,
            }
        }
        Err(why)
    }

    pub fn get(&self, d: Degrees) -> Option<&Layout> {
        self.by_degrees.get(&d).and_then(|l| (**l).as_ref().ok())
    }
}

/// The layout at degrees `d`: the layer stacks' and the root's e-graphs,
/// and the model priced under them (with the root as extracted, and whole).
fn layout_at(
    g: &Graph,
    an: &Analysis,
    precision: Precision,
    cluster: &Cluster,
    seq: u64,
    d: Degrees,
) -> Result<Layout, String> {
    let (l, r) = extract(g, an, cluster, precision, seq, d, false)?;
    if let Some(why) = tp_refusal(&l, d.0) {
        return Err(why);
    }
    let stack_sh: Vec<_> = l.iter().map(|s| &s.sharding).collect();
    let profile =
        ModelProfile::new(g, an, precision, &stack_sh, &r.sharding).map_err(|e| e.to_string())?;
    let replicated_root = ModelProfile::new(
        g,
        an,
        precision,
        &stack_sh,
        &crate::sharding::RegionSharding::default(),
    )
    .map_err(|e| e.to_string())?;
    Ok(Layout {
        profile,
        replicated_root,
        stacks: l,
        root: r,
    })
}

/// The runtime's layout of the whole model from its layer stacks' bodies
/// (in program order): the root (embedding, head, loss) runs whole on every
/// rank and hands each stack its input in the layout its body expects.
pub(crate) fn model_layout(
    g: &Graph,
    bodies: Vec<RuntimeLayout>,
    (tp, ep): (u64, u64),
    sequence_parallel: bool,
) -> Option<dplc_ir::ModelLayout> {
    use dplc_ir::{NodeLayout, Op, RegionLayout, TensorLayout};
    let root = g.root();
    let mut found = 0;
    let nodes = g
        .region(root)
        .nodes
        .iter()
        .map(|&n| {
            let node = g.node(n);
            let body = match node.op {
                Op::Repeat { body: b, .. } => bodies.iter().find(|l| l.region.region == b),
                _ => None,
            };
            match body {
                Some(body) => {
                    found += 1;
                    NodeLayout {
                        node: n,
                        inputs: body.region.args.clone(),
                        outputs: body.region.results.clone(),
                    }
                }
                None => NodeLayout {
                    node: n,
                    inputs: vec![TensorLayout::Replicated; node.inputs.len()],
                    outputs: vec![TensorLayout::Replicated; node.outputs.len()],
                },
            }
        })
        .collect();
    // Every stack's captured values (beyond the carried ones, which the
    // localizer hands over in the layout the body asks) must arrive whole,
    // as the root makes them: a body that splits one (a position bias by
    // heads) is laid out by the Megatron rule instead.
    let complete = bodies.iter().all(|b| {
        let region = g.region(b.region.region);
        let carried = region.repeat.map_or(0, |n| match g.node(n).op {
            Op::Repeat { carried, .. } => carried,
            _ => 0,
        });
        b.region.args.len() == region.args.len()
            && b.region.args[carried..]
                .iter()
                .all(|l| *l == TensorLayout::Replicated)
    });
    if found != bodies.len() || !complete {
        return None;
    }
    let mut regions = vec![RegionLayout {
        region: root,
        args: Vec::new(),
        nodes,
        results: vec![TensorLayout::Replicated; g.region(root).results.len()],
    }];
    let mut params = Vec::new();
    for b in bodies {
        regions.push(b.region);
        params.extend(b.params);
    }
    params.sort_by_key(|p| p.param);
    Some(dplc_ir::ModelLayout {
        tp,
        ep,
        sequence_parallel: sequence_parallel && tp > 1,
        regions,
        params,
    })
}

/// `model` with its root laid out as the root's e-graph split it
/// (`root=vocab`: the embedding, head and loss over the vocabulary): every
/// root node but the layer stacks, whose layouts `model` keeps, and the
/// root's split parameters. `None` where the two split one parameter
/// differently, so the plan cannot run the root it would price.
pub(crate) fn with_root(
    g: &Graph,
    mut model: dplc_ir::ModelLayout,
    root: &RuntimeLayout,
) -> Option<dplc_ir::ModelLayout> {
    let region = model
        .regions
        .iter_mut()
        .find(|r| r.region == root.region.region)?;
    if region.nodes.len() != root.region.nodes.len() {
        return None;
    }
    for (mine, split) in region.nodes.iter_mut().zip(&root.region.nodes) {
        if mine.node != split.node {
            return None;
        }
        if !matches!(g.node(mine.node).op, dplc_ir::Op::Repeat { .. }) {
            *mine = split.clone();
        }
    }
    for p in &root.params {
        match model.param_split(p.param) {
            Some(s) if s != p.split => return None,
            Some(_) => {}
            None => model.params.push(p.clone()),
        }
    }
    model.params.sort_by_key(|p| p.param);
    Some(model)
}
