//! dplc's code generator: fuses elementwise and row-reduction chains into
//! kernels, differentiates each into a fused backward kernel, interprets them
//! on the CPU, emits CUDA C and compiles it with NVRTC.
//!
//! Architecture invariant: codegen never touches a GPU. Everything here runs
//! and is tested on a CPU; NVRTC (a compiler, not a driver) is optional and
//! loaded at run time.

mod adamw;
mod attention;
mod attention_cuda;
mod attention_interp;
mod attention_match;
mod backward;
mod cuda;
mod error;
mod flat;
mod fuse;
mod interp;
mod kernel;
mod moe;
mod nvrtc;
mod vocab;

pub use adamw::{adamw_kernel, adamw_value_kernel, sgd_kernel, AdamwScalars, SgdScalars};
pub use attention::{
    AttentionBackward, AttentionBuffer, AttentionDropout, AttentionKernel, AttentionOperand,
    AttentionPass, Strided, BLOCK_K, BLOCK_Q,
};
pub use attention_cuda::{
    attention_backward, attention_name, emit_attention, emit_attention_tuned, AttentionTuning,
};
pub use attention_interp::interpret_attention;
pub use backward::{
    backward, backward_keeping_row_stats, backward_plan, column_sum_kernel, with_row_stats,
    Backward, BackwardStep, ColumnSum, GradBinding,
};
pub use cuda::{
    emit_cuda, kernel_name, CudaSource, LaunchShape, COLUMN_BLOCK, COLUMN_TILE, ROW_BLOCK,
    WARP_ROW_VECTORS,
};
pub use error::CodegenError;
pub use flat::{
    add_kernel, column_chunk_kernel, column_chunks, convert_kernel, sum_parts_kernel,
    sum_squares_kernel, COLUMN_CHUNK, SUM_SQUARES_COLS,
};
pub use fuse::{
    elements_per_sample, fuse, fuse_cut, fuse_graph, fuse_with, tensor_elem, FuseConfig,
    FusedAttention, FusedKernel, FusionPlan, KeyPlace, KeySize, Operand, Step,
};
pub use interp::{
    binary, erf, erf_f64, interpret, interpret_refs, unary, unary_grad, Args, BufferRef, Data,
};
pub use kernel::{
    batch_draw, draw_seed, draw_state, drop_threshold, dropout_draw, fnv1a, key_absorb,
    sample_draw, Buffer, Builder, Cond, DrawKey, Elem, Expr, Idx, Kernel, RowReduce, Size, Space,
    Store, ValueId,
};
pub use moe::{
    moe_combine_backward_kernel, moe_combine_kernel, moe_combine_weights_backward_kernel,
    moe_dispatch_backward_kernel, moe_dispatch_kernel, moe_top_k_backward_kernel, moe_top_k_kernel,
};
pub use nvrtc::{Arch, Nvrtc, Ptx};
pub use vocab::{
    vocab_embedding_backward_kernel, vocab_embedding_kernel, vocab_normalize_backward_kernel,
    vocab_normalize_kernel, vocab_row_stats_kernel, vocab_row_sum_kernel,
    vocab_take_backward_kernel, vocab_take_kernel,
};
