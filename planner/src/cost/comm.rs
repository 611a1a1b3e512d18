//! What communication costs: the links a group of ranks sees, the
//! alpha–beta time of each collective on them, how much of a
//! tensor-parallel collective Megatron's overlaps hide, what hidden
//! communication takes from the compute beside it, and the data-parallel
//! gradient reduction as each synchronisation and compression sends it.

use super::{Config, CostModel, KERNEL_OVERHEAD_S, MEMORY_EFFICIENCY};
use crate::cluster::{Cluster, Link};
use crate::profile::Routing;
use crate::sharding::{Pass, TpCollectiveKind};
use dplc_ir::{CollectiveKind, Compression, Dispatch, GradSync, LinkLevel, TpOverlap};

/// NCCL reaches about 80% of the link's line rate: "with the protocol overhead
/// (~20%) NCCL can get an effective NVLink bandwidth of 370GB/s" of 450
/// (S. Jeaugey, NVIDIA/nccl-tests#212); the same holds over InfiniBand.
pub(crate) const NCCL_EFFICIENCY: f64 = 0.8;

/// Compute runs slower while collectives run beside it: their kernels take
/// SMs and memory bandwidth from the kernels they overlap. Lee et al. 2025
/// ("Characterizing Compute-Communication Overlap in GPU-Accelerated
/// Distributed Deep Learning: Performance and Power Implications",
/// arXiv:2507.03114), training GPT and Llama models on A100, H100, MI250
/// and MI210: "overlapping computation and communication can result in an
/// average computational slowdown of 18.9%, with a maximum of 40.0%",
/// against the same compute with no communication beside it.
const OVERLAP_COMPUTE_SLOWDOWN: f64 = 0.189;

/// What `hidden_s` seconds of communication overlapped with compute add to
/// the step: while they run compute advances at 1/(1 + s) of its pace, so
/// over them it does `hidden_s/(1 + s)` seconds of work and the rest waits.
pub fn overlap_slowdown(hidden_s: f64) -> f64 {
    hidden_s * OVERLAP_COMPUTE_SLOWDOWN / (1.0 + OVERLAP_COMPUTE_SLOWDOWN)
}

/// PowerSGD's GEMMs are skinny (`rows × cols` by `cols × R`, R a few):
/// memory-bound, so they reach a small part of the tensor cores' peak.
/// 10% is what a bf16 GEMV-like GEMM of rank ≤ 8 reaches on A100/H100.
pub(crate) const GEMM_EFFICIENCY_SKINNY: f64 = 0.1;

/// What one data-parallel gradient reduction costs ([`CostModel::dp_reduction`]).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub(crate) struct DpReduction {
    /// Seconds on the wire.
    pub wire_s: f64,
    /// Seconds of compression kernels.
    pub compute_s: f64,
    /// Bytes the busiest rank's link carries in one direction.
    pub link_bytes: f64,
}

/// The bandwidth and latency a group of `size` ranks spaced `stride` apart sees.
#[derive(Clone, Copy, Debug)]
pub(crate) struct GroupLink {
    pub size: u64,
    pub level: LinkLevel,
    /// A ring's bus bandwidth per device: across nodes, the NICs of the
    /// group's members on one node carry rings side by side.
    pub bandwidth: f64,
    pub latency: f64,
    /// Members of the group on one node (`size` when it stays in a node).
    pub per_node: u64,
    /// What one member's own links carry, in and out of its node: an
    /// all-to-all sends each peer its own piece directly, so the bytes for
    /// peers on other nodes leave through the sender's NIC alone (no ring
    /// spreads them over the node's NICs) while those for its node's peers
    /// cross the switch.
    pub nic_bandwidth: f64,
    pub intra_bandwidth: f64,
}

impl GroupLink {
    /// The rate at which one member's `n − 1` pieces of an all-to-all leave
    /// it: each goes straight to its peer, those for its node's `p − 1`
    /// peers over the switch while those for the `n − p` elsewhere leave
    /// through its NIC, whichever takes longer.
    pub fn all_to_all_bandwidth(&self) -> f64 {
        let n = self.size as f64;
        let p = (self.per_node as f64).clamp(1.0, n);
        let within = (p - 1.0) / self.intra_bandwidth;
        let across = (n - p) / self.nic_bandwidth;
        (n - 1.0) / within.max(across)
    }

    /// The rate of one message to one peer of the group: across nodes it
    /// takes one path, the sender's NIC (the node's other NICs carry other
    /// ranks' messages, not pieces of this one).
    pub fn send_bandwidth(&self) -> f64 {
        match self.level {
            LinkLevel::InterNode => self.nic_bandwidth,
            _ => self.bandwidth,
        }
    }
}

pub(crate) fn group_link(cluster: &Cluster, stride: u64, size: u64) -> GroupLink {
    let dpn = cluster.devices_per_node;
    if size <= 1 {
        return GroupLink {
            size: 1,
            level: LinkLevel::None,
            bandwidth: f64::INFINITY,
            latency: 0.0,
            per_node: 1,
            nic_bandwidth: f64::INFINITY,
            intra_bandwidth: f64::INFINITY,
        };
    }
    let eff = |l: &Link| l.bandwidth * NCCL_EFFICIENCY;
    if stride * size <= dpn {
        GroupLink {
            size,
            level: LinkLevel::IntraNode,
            bandwidth: eff(&cluster.intra_node),
            latency: cluster.intra_node.latency_s,
            per_node: size,
            nic_bandwidth: eff(&cluster.intra_node),
            intra_bandwidth: eff(&cluster.intra_node),
        }
    } else {
        // Members of the group that share a node send over their own NICs in
        // parallel (NCCL runs one ring per NIC), up to the intra-node rate.
        let per_node = (dpn / stride.max(1)).clamp(1, size) as f64;
        GroupLink {
            size,
            level: LinkLevel::InterNode,
            bandwidth: (eff(&cluster.inter_node) * per_node).min(eff(&cluster.intra_node)),
            latency: cluster.inter_node.latency_s,
            per_node: per_node as u64,
            nic_bandwidth: eff(&cluster.inter_node),
            intra_bandwidth: eff(&cluster.intra_node),
        }
    }
}

/// Seconds for one collective of `bytes` (the full tensor) on `link`:
/// alpha–beta cost of the ring, or of a tree when latency dominates.
pub(crate) fn collective_time(kind: CollectiveKind, bytes: f64, link: &GroupLink) -> f64 {
    let n = link.size as f64;
    if link.size <= 1 || bytes <= 0.0 {
        return 0.0;
    }
    let (a, bw) = (link.latency, link.bandwidth);
    match kind {
        CollectiveKind::AllReduce => {
            let ring = 2.0 * (n - 1.0) / n * bytes / bw + 2.0 * (n - 1.0) * a;
            let tree = 2.0 * n.log2().ceil() * a + 2.0 * bytes / bw;
            ring.min(tree)
        }
        CollectiveKind::AllGather | CollectiveKind::ReduceScatter => {
            (n - 1.0) / n * bytes / bw + (n - 1.0) * a
        }
        CollectiveKind::AllToAll => {
            (n - 1.0) / n * bytes / link.all_to_all_bandwidth() + (n - 1.0) * a
        }
        CollectiveKind::SendRecv => bytes / link.send_bandwidth() + a,
    }
}

/// The rate at which a parameter server's pushes and pulls leave a rank of
/// the data-parallel group `link`: each piece goes straight to its server,
/// as an all-to-all's do, so no ring spreads the traffic for other nodes
/// over the node's NICs — across nodes a rank's own NIC carries it, all of
/// it where the servers are ranks of their own beyond the cluster.
pub(crate) fn server_rate(sync: GradSync, link: &GroupLink) -> f64 {
    if sync.dedicated_servers() > 0 {
        link.send_bandwidth()
    } else {
        link.all_to_all_bandwidth()
    }
}

/// Seconds for one MoE dispatch or combine over the expert group `link`,
/// `bytes` counting every (token, expert) pair: what one all-to-all moves.
/// A hierarchical dispatcher (DeepEP, HybridEP) sends each token across to
/// every other node holding one of its experts once and forwards it inside
/// that node to each rank holding one, once per rank; the combine retraces
/// the path, summing on the node first. With `routing`'s `top_k` of
/// `experts` spread evenly over the group (as many on each rank), a token
/// reaches a set of `m` experts' worth of ranks with the chance that not all
/// `k` of its distinct experts lie outside them:
/// `1 − C(E − m, k) / C(E, k)`.
pub(crate) fn dispatch_time(
    dispatch: Dispatch,
    bytes: f64,
    link: &GroupLink,
    routing: Option<Routing>,
) -> f64 {
    let routing = routing.filter(|r| dispatch == Dispatch::Hierarchical && r.top_k > 0);
    let Some(Routing { experts, top_k }) = routing else {
        return collective_time(CollectiveKind::AllToAll, bytes, link);
    };
    if link.size <= 1 || bytes <= 0.0 {
        return 0.0;
    }
    let (n, e, k) = (link.size as f64, experts as f64, top_k as f64);
    let p = (link.per_node as f64).clamp(1.0, n);
    let reaches = |held: f64| {
        let missed: f64 = (0..top_k)
            .map(|i| ((e - held - i as f64) / (e - i as f64)).max(0.0))
            .product();
        1.0 - missed
    };
    let per_rank = e / n;
    // Other ranks, and other nodes, holding at least one of a token's experts.
    let ranks = (n - 1.0) * reaches(per_rank);
    let nodes = (n / p - 1.0) * reaches(per_rank * p);
    let copy = bytes / k;
    // Each node reached takes the token over RDMA; every other rank reached
    // takes it over the switch (from its own node, or forwarded there).
    let within = copy * (ranks - nodes) / link.intra_bandwidth;
    let across = copy * nodes / link.nic_bandwidth;
    within.max(across) + (n - 1.0) * link.latency
}

/// The part of a tensor-parallel collective taking `t` seconds that stays on
/// the critical path beside GEMMs taking `beside` seconds (forward time of
/// the GEMMs it overlaps; a weight- or input-gradient GEMM takes the same).
///
/// - A column-parallel input gradient (backward): Megatron launches the
///   all-reduce once the input-gradient GEMM is done and computes the weight
///   gradient meanwhile. With sequence parallelism the all-reduce is a
///   reduce-scatter of the input gradient, beside the weight-gradient GEMM,
///   and the all-gather of the output gradient that the row-parallel layer's
///   backward starts with (`_ReduceScatterToSequenceParallelRegion.backward`),
///   half the time each; `async` runs that all-gather synchronously, the
///   userbuffers overlap of `ring` exchanges it beside the row-parallel
///   input-gradient GEMM (priced as one of the GEMMs beside it).
/// - The sequence-parallel re-gather of a column-parallel input (backward,
///   `regather`): launched before the input-gradient GEMM and awaited after
///   it, under `async` and `ring` alike.
/// - With `Ring` the forward all-gathers and row-parallel reductions too: the
///   GEMM is cut into `tp` chunks and each chunk's transfer runs beside the
///   next chunk's compute, leaving the longer of the two plus one chunk.
pub(super) fn exposed_tp(c: &Config, col: TpExposure, t: f64, beside: f64) -> f64 {
    let TpExposure {
        kind,
        pass,
        regather,
    } = col;
    if beside <= 0.0 || c.tp_overlap == TpOverlap::None || kind == TpCollectiveKind::RowStats {
        return t;
    }
    match pass {
        Pass::Backward if regather => (t - beside).max(0.0),
        Pass::Backward if kind == TpCollectiveKind::AllReduce => {
            if !c.sp {
                (t - beside).max(0.0)
            } else if c.tp_overlap == TpOverlap::Ring {
                2.0 * (t / 2.0 - beside).max(0.0)
            } else {
                (t / 2.0 - beside).max(0.0) + t / 2.0
            }
        }
        Pass::Forward if c.tp_overlap == TpOverlap::Ring => {
            (t - beside).max(0.0) + t.min(beside) / c.tp as f64
        }
        _ => t,
    }
}

/// What decides how much of a tensor-parallel collective overlap can hide.
#[derive(Clone, Copy, Debug)]
pub(super) struct TpExposure {
    pub kind: TpCollectiveKind,
    pub pass: Pass,
    /// The sequence-parallel re-gather of a saved input shard.
    pub regather: bool,
}

impl CostModel<'_> {
    /// The one place a data-parallel gradient reduction is priced: `params`
    /// gradients of `grad_bytes` each over `link`, as `c.sync` combines
    /// them and `c.compress` shrinks them.
    ///
    /// - all-reduce: the ring (or tree), `2(n−1)/n` of the bytes on each
    ///   rank's link; ZeRO ≥ 1 reduce-scatters, `(n−1)/n`;
    /// - bf16/fp16: the same collective on 2-byte elements, plus a cast
    ///   pass each way (read 4 write 2, read 2 write 4 bytes per element);
    /// - PowerSGD rank R: two all-reduces of the factors, `R·(rows + cols)`
    ///   per compressed matrix instead of `rows·cols` (vectors, and
    ///   matrices the factors would not halve, uncompressed:
    ///   `dplc_ir::powersgd_factors`), plus its GEMMs (`M·Q` and `Mᵀ·P`,
    ///   4·R flops per element) and four passes over the fp32 gradient and
    ///   error (add, two GEMM reads, error write);
    /// - top-k fraction F: an all-gather of every rank's `F·matrix params`
    ///   (index, value) pairs, 8 bytes each — each link carries `(n−1)·k·8`
    ///   — plus a ring all-reduce of the vectors, and four memory passes
    ///   (error add, selection, error write, scatter-add of the `n·k`
    ///   received pairs);
    ///
    /// A compression's warm-up steps (plain or denser) are not priced: the
    /// estimate is the steady state.
    /// - parameter server with N shards on the first N workers: each server
    ///   receives `(n−1)/N` of every worker's gradient and sends as many
    ///   weights back, on top of its own worker's push, so its link carries
    ///   `max(1, (n+N−2)/N)` × the gradient bytes each way: N = n is the
    ///   ring's `2(n−1)/n` (BytePS), N = 1 is `n−1` (the bottleneck at the
    ///   server). On N dedicated server ranks (`ps_ranks=dedicated`, each
    ///   with a link of the data-parallel group's kind) a server carries
    ///   `n/N` × the gradient each way and a worker 1×: `max(1, n/N)`, half
    ///   the ring's bytes at N = n — what BytePS's extra machines buy.
    ///   The bytes are the ring's at N = n, not its rate: a worker sends
    ///   each server its piece directly, so across nodes they leave through
    ///   its own NIC ([`GroupLink::all_to_all_bandwidth`]) where a ring's
    ///   run over all of the node's NICs side by side.
    ///   Async costs the same bytes; `step_time` hides them behind the next
    ///   step instead of waiting at a barrier.
    pub(crate) fn dp_reduction(
        &self,
        c: &Config,
        params: f64,
        grad_bytes: f64,
        link: &GroupLink,
    ) -> DpReduction {
        let n = link.size as f64;
        if link.size <= 1 || params <= 0.0 {
            return DpReduction::default();
        }
        let bytes = params * grad_bytes;
        let mem = |b: f64| b / (self.cluster.device.memory_bandwidth * MEMORY_EFFICIENCY);
        if let Some(shards) = c.sync.ps_shards() {
            let link_bytes = if c.sync.dedicated_servers() > 0 {
                // A server takes 1/N of each of the n workers' gradients in
                // and sends as many weights out; a worker pushes its whole
                // gradient and pulls the whole weights: the busier of the two.
                bytes * (n / (shards as f64).max(1.0)).max(1.0)
            } else {
                let shards = (shards as f64).clamp(1.0, n);
                bytes * ((n + shards - 2.0) / shards).max(1.0)
            };
            return DpReduction {
                wire_s: link_bytes / server_rate(c.sync, link) + 2.0 * link.latency,
                compute_s: 0.0,
                link_bytes,
            };
        }
        if c.zero >= 1 {
            return DpReduction {
                wire_s: collective_time(CollectiveKind::ReduceScatter, bytes, link),
                compute_s: 0.0,
                link_bytes: (n - 1.0) / n * bytes,
            };
        }
        let all_reduce = |b: f64, compute_s: f64| DpReduction {
            wire_s: collective_time(CollectiveKind::AllReduce, b, link),
            compute_s,
            link_bytes: 2.0 * (n - 1.0) / n * b,
        };
        match c.compress {
            Compression::None => all_reduce(bytes, 0.0),
            Compression::Bf16 | Compression::Fp16 => {
                all_reduce(params * 2.0, mem(params * 12.0) + 2.0 * KERNEL_OVERHEAD_S)
            }
            Compression::PowerSgd { rank, .. } => {
                let (compressed, factors) = self.profile.powersgd_shares(rank);
                let sent = params * ((1.0 - compressed) + compressed * factors);
                let flops = 4.0 * rank as f64 * params * compressed;
                let gemm = flops
                    / (self.cluster.device.peak_flops(self.profile.precision)
                        * GEMM_EFFICIENCY_SKINNY);
                all_reduce(
                    sent * 4.0,
                    gemm + mem(params * 16.0) + 4.0 * KERNEL_OVERHEAD_S,
                )
            }
            Compression::TopK { per_million, .. } => {
                let sparse = params * self.profile.matrix_share();
                let k = sparse * per_million as f64 / 1e6;
                let gathered = n * k * 8.0;
                let vectors = all_reduce((params - sparse) * 4.0, 0.0);
                DpReduction {
                    wire_s: collective_time(CollectiveKind::AllGather, gathered, link)
                        + vectors.wire_s,
                    compute_s: mem(sparse * 16.0 + n * k * 12.0) + 4.0 * KERNEL_OVERHEAD_S,
                    link_bytes: (n - 1.0) * k * 8.0 + vectors.link_bytes,
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::{collective_time, dispatch_time, group_link};
    use crate::cluster::parse_cluster;
    use crate::profile::Routing;
    use dplc_ir::{CollectiveKind, Dispatch};

    /// An all-to-all across two DGX H100 nodes is bound by each GPU's own NIC
    /// (half its bytes leave the node at 40 GB/s), where a ring all-gather of
    /// the same group spreads over the node's eight NICs; inside a node the
    /// two are the same; a pipeline's send goes over one NIC too.
    #[test]
    fn an_all_to_all_or_a_send_across_nodes_leaves_through_each_senders_nic() {
        let cluster = parse_cluster("2x8xH100").unwrap();
        let bytes = 1e9;
        let across = group_link(&cluster, 1, 16);
        let nic = 50e9 * super::NCCL_EFFICIENCY;
        let a2a = collective_time(CollectiveKind::AllToAll, bytes, &across);
        let want = 0.5 * bytes / nic + 15.0 * across.latency;
        assert!((a2a - want).abs() < 1e-9, "{a2a} != {want}");
        let ring = collective_time(CollectiveKind::AllGather, bytes, &across);
        assert!(a2a > 4.0 * ring, "all-to-all {a2a} s vs ring {ring} s");

        let within = group_link(&cluster, 1, 8);
        let a2a = collective_time(CollectiveKind::AllToAll, bytes, &within);
        let ring = collective_time(CollectiveKind::AllGather, bytes, &within);
        assert!((a2a - ring).abs() < 1e-12);

        // A pipeline's send across nodes takes one path, the sender's NIC,
        // however many of the group's ranks share its node.
        let pipeline = group_link(&cluster, 4, 4);
        let hop = collective_time(CollectiveKind::SendRecv, bytes, &pipeline);
        assert!(
            (hop - (bytes / nic + pipeline.latency)).abs() < 1e-9,
            "{hop}"
        );

        // Spread one to a node (a stride of 8), every byte leaves through a NIC.
        let spread = group_link(&cluster, 8, 2);
        let a2a = collective_time(CollectiveKind::AllToAll, bytes, &spread);
        let want = 0.5 * bytes / nic + spread.latency;
        assert!((a2a - want).abs() < 1e-9, "{a2a} != {want}");
    }

    /// Qwen3-30B-A3B's routing (8 of 128 experts) over 16 ranks on two
    /// nodes: an all-to-all sends half of a token's 8 copies across, a
    /// hierarchical dispatcher the token once to the other node whenever one
    /// of its experts is there (all but 1 − C(64, 8)/C(128, 8) of the time).
    #[test]
    fn a_hierarchical_dispatch_crosses_to_each_node_once() {
        let cluster = parse_cluster("2x8xH100").unwrap();
        let link = group_link(&cluster, 1, 16);
        let routing = Some(Routing {
            experts: 128,
            top_k: 8,
        });
        let bytes = 8e9;
        let flat = dispatch_time(Dispatch::AllToAll, bytes, &link, routing);
        assert_eq!(
            flat,
            collective_time(CollectiveKind::AllToAll, bytes, &link)
        );
        let hier = dispatch_time(Dispatch::Hierarchical, bytes, &link, routing);
        let missed: f64 = (0..8)
            .map(|i| (64.0 - i as f64) / (128.0 - i as f64))
            .product();
        let want = 1e9 * (1.0 - missed) / link.nic_bandwidth + 15.0 * link.latency;
        assert!((hier - want).abs() < 1e-9, "{hier} != {want}");
        assert!(flat / hier > 3.9 && flat / hier < 4.1, "{flat} / {hier}");
    }

    /// One expert a token moves one copy either way; more, and the
    /// hierarchical dispatcher never sends more than the all-to-all, inside a
    /// node or across, spread or packed.
    #[test]
    fn a_hierarchical_dispatch_is_never_slower_and_equal_at_top_1() {
        let cluster = parse_cluster("8x8xH100").unwrap();
        for (stride, size) in [(1, 8), (1, 16), (1, 64), (2, 16), (8, 8), (4, 4)] {
            let link = group_link(&cluster, stride, size);
            for (experts, top_k) in [(64, 1), (64, 2), (128, 8), (256, 8), (8, 2), (64, 6)] {
                if experts % size != 0 {
                    continue;
                }
                let routing = Some(Routing { experts, top_k });
                let flat = dispatch_time(Dispatch::AllToAll, 1e9, &link, routing);
                let hier = dispatch_time(Dispatch::Hierarchical, 1e9, &link, routing);
                let case = format!("stride {stride} size {size}, top {top_k} of {experts}");
                assert!(hier <= flat * (1.0 + 1e-12), "{case}: {hier} > {flat}");
                if top_k == 1 {
                    assert!(
                        (hier - flat).abs() <= 1e-12 * flat,
                        "{case}: {hier} != {flat}"
                    );
                }
            }
        }
    }
}
