//! Every kernel a graph needs on the GPU — each region's fused forward
//! kernels, their fused backward kernels and column sums, each fused
//! attention's forward and backward passes, and AdamW —
//! generated, compiled to PTX with NVRTC (through its on-disk cache) for one
//! architecture and storage type. Needs NVRTC, not a GPU.

use super::error::GpuResult;
use dplc_codegen::{
    adamw_kernel, adamw_value_kernel, attention_backward, backward_plan, column_sum_kernel,
    emit_attention, emit_cuda, fuse_with, Arch, AttentionKernel, AttentionPass, BackwardStep,
    CudaSource, FuseConfig, FusionPlan, Kernel, Nvrtc, Ptx, Step,
};
use dplc_ir::{AttentionKind, DType, Graph, RegionId};
use std::collections::BTreeMap;

/// One compiled kernel.
#[derive(Clone, Debug)]
pub struct CompiledKernel {
    pub kernel: Kernel,
    pub source: CudaSource,
    pub ptx: Ptx,
}

/// One compiled pass of a fused attention.
#[derive(Clone, Debug)]
pub struct CompiledAttention {
    pub kernel: AttentionKernel,
    pub pass: AttentionPass,
    pub source: CudaSource,
    pub ptx: Ptx,
}

/// A graph's kernels for one device type.
#[derive(Clone, Debug)]
pub struct CompiledGraph {
    pub arch: Arch,
    pub dtype: DType,
    /// Per region: its fusion plan and its backward steps.
    pub regions: Vec<(RegionId, FusionPlan, Vec<BackwardStep>)>,
    /// By kernel name (`{op}_{dtype}_{hash8}`); identical kernels compile once.
    pub kernels: BTreeMap<String, CompiledKernel>,
    /// The fused attentions' passes, by name (`{pass}_{dtype}_{hash8}`).
    pub attention: BTreeMap<String, CompiledAttention>,
}

impl CompiledGraph {
    pub fn get(&self, kernel: &Kernel) -> Option<&CompiledKernel> {
        self.kernels
            .get(&dplc_codegen::kernel_name(kernel, self.dtype))
    }
}

/// Generate and compile everything `graph` needs for `arch` with float
/// tensors stored as `dtype`, attention run as `attention` says (as the
/// fused executor plans it).
pub fn compile_graph(
    graph: &Graph,
    dtype: DType,
    arch: Arch,
    attention: AttentionKind,
    nvrtc: &Nvrtc,
) -> GpuResult<CompiledGraph> {
    let mut kernels: BTreeMap<String, CompiledKernel> = BTreeMap::new();
    let mut add = |k: &Kernel| -> GpuResult<()> {
        let source = emit_cuda(k, dtype);
        if !kernels.contains_key(&source.name) {
            let ptx = nvrtc.compile(&source, arch)?;
            kernels.insert(
                source.name.clone(),
                CompiledKernel {
                    kernel: k.clone(),
                    source,
                    ptx,
                },
            );
        }
        Ok(())
    };
    let mut attention_passes: BTreeMap<String, CompiledAttention> = BTreeMap::new();
    add(&adamw_kernel())?;
    add(&adamw_value_kernel())?;
    add(&column_sum_kernel())?;
    add(&dplc_codegen::column_chunk_kernel())?;
    let mut regions = Vec::new();
    for (r, _) in graph.regions() {
        let config = FuseConfig {
            attention,
            ..FuseConfig::default()
        };
        let mut plan = fuse_with(graph, r, &config);
        // First: the backward decides which forward kernels keep their
        // row statistics, and so which forward kernels run.
        let back = backward_plan(graph, &mut plan);
        for step in &plan.steps {
            match step {
                Step::Kernel(k) => add(&k.kernel)?,
                Step::Attention(at) => {
                    let backward = attention_backward(&at.kernel, dtype);
                    for pass in at.kernel.passes(backward) {
                        if !at.kernel.runs(pass, [true; 4]) {
                            continue;
                        }
                        let source = emit_attention(&at.kernel, pass, dtype);
                        if !attention_passes.contains_key(&source.name) {
                            let ptx = nvrtc.compile(&source, arch)?;
                            attention_passes.insert(
                                source.name.clone(),
                                CompiledAttention {
                                    kernel: at.kernel.clone(),
                                    pass,
                                    source,
                                    ptx,
                                },
                            );
                        }
                    }
                }
                Step::Extern { node, .. } => {
                    for k in routing_kernels(graph, *node) {
                        add(&k)?;
                    }
                }
                Step::MatMul { .. } => {}
            }
        }
        for step in &back {
            if let BackwardStep::Kernel { backward, .. } = step {
                add(&backward.kernel)?;
                for cs in &backward.column_sums {
                    add(&cs.kernel)?;
                }
            }
        }
        regions.push((r, plan, back));
    }
    Ok(CompiledGraph {
        arch,
        dtype,
        regions,
        kernels,
        attention: attention_passes,
    })
}

/// The kernels MoE routing node `node` runs on the device, forward and
/// backward (none for other nodes): its `k` from top-k itself, or from the
/// width of dispatch's and combine's choices.
fn routing_kernels(graph: &Graph, node: dplc_ir::NodeId) -> Vec<Kernel> {
    let n = graph.node(node);
    let choices = |i: usize| {
        n.inputs
            .get(i)
            .and_then(|&t| {
                graph
                    .tensor(t)
                    .shape
                    .dims()
                    .get(1)
                    .and_then(|d| d.as_const())
            })
            .and_then(|k| usize::try_from(k).ok())
    };
    match n.op {
        dplc_ir::Op::TopK { k } => usize::try_from(k)
            .map(|k| {
                vec![
                    dplc_codegen::moe_top_k_kernel(k),
                    dplc_codegen::moe_top_k_backward_kernel(k),
                ]
            })
            .unwrap_or_default(),
        dplc_ir::Op::MoeDispatch { .. } => choices(1)
            .map(|k| {
                vec![
                    dplc_codegen::moe_dispatch_kernel(k),
                    dplc_codegen::moe_dispatch_backward_kernel(k),
                ]
            })
            .unwrap_or_default(),
        dplc_ir::Op::MoeCombine => choices(1)
            .map(|k| {
                vec![
                    dplc_codegen::moe_combine_kernel(k),
                    dplc_codegen::moe_combine_backward_kernel(k),
                    dplc_codegen::moe_combine_weights_backward_kernel(k),
                ]
            })
            .unwrap_or_default(),
        _ => Vec::new(),
    }
}
