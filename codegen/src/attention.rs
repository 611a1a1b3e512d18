//! The fused attention kernel's description: one closed record of what a
//! FlashAttention-2 style kernel computes (shapes, strided operands, scale,
//! masks, bias, dropout key), its forward and backward passes and the buffers each binds.
//!
//! Forward: `O = dropout(softmax(scale·Q·Kᵀ + bias + masks)) · V` per batch and
//! query head, in tiles of [`BLOCK_Q`] queries against [`BLOCK_K`] keys with
//! the online softmax, saving `O` and the `f32` log-sum-exp of each score row.
//! Backward recomputes the scores tile by tile from `Q`, `K` and the
//! log-sum-exp, in one of two ways ([`AttentionBackward`]): two passes that
//! each recompute them — one per query tile for `dQ` (and each row's δ),
//! one per key tile for `dK` and `dV` (summed over the query heads sharing
//! a key head) — or, as FlashAttention-2 does, one pass per key tile that
//! also adds each tile's share of `dQ` into an `f32` sum, between a pass
//! for δ and one that scales the sum into `dQ`. A last pass over the bias's
//! elements gives its gradient. Each pass writes its outputs whole but the
//! sum, which its caller zeroes.

use crate::interp::Args;
use crate::kernel::{Buffer, DrawKey, Elem, Idx, Size};
use std::fmt::{self, Write as _};

/// Queries per tile: a CUDA block's rows, and the host reference's tile.
pub const BLOCK_Q: i64 = 64;
/// Keys per tile, staged through shared memory on the GPU.
pub const BLOCK_K: i64 = 64;

/// Where element `(batch, head, position, feature)` of an operand sits in its
/// buffer: `offset + batch·strides[0] + head·strides[1] +
/// position·strides[2] + feature·strides[3]`. For K and V, `head` is the key head (the query head
/// divided by the kernel's `group`); for the bias `feature` is the key
/// position and a broadcast axis has stride 0.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Strided {
    pub offset: Size,
    pub strides: [Size; 4],
}

/// One operand of the kernel: a buffer (a graph tensor in memory, read
/// through views) and where each element sits in it.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct AttentionOperand {
    /// What the buffer is in the graph (`%15`): for people, not hashed.
    pub label: String,
    /// Elements of the buffer, as a product of sizes.
    pub len: Vec<Size>,
    pub at: Strided,
}

/// The dropout of the probabilities: the draw of element `(b, h, i, j)` is
/// that of the dropout's output at `index`, as the unfused kernel draws it,
/// so both drop the same elements.
#[derive(Clone, Debug, PartialEq)]
pub struct AttentionDropout {
    pub p: f64,
    pub key: DrawKey,
    /// The element's flat index in the whole tensor of the serial run, over
    /// `Idx::Var(0..4)` = `(b, h, i, j)`: `((b·heads + h)·q_len + i)·k_len +
    /// j`, or in a rank's part (heads over tp, a cp rank's queries) its place
    /// in the whole, as codegen's one `whole_index` writes it for every
    /// fused kernel.
    pub index: Idx,
}

/// One fused attention: what it computes, for any batch of its shape.
#[derive(Clone, Debug, PartialEq)]
pub struct AttentionKernel {
    /// Run-time size arguments `n0..`.
    pub sizes: usize,
    pub batch: Size,
    /// Query heads.
    pub heads: Size,
    /// Key/value heads: `heads / group`.
    pub kv_heads: Size,
    /// Query heads per key/value head (1: multi-head; `heads`: multi-query).
    pub group: i64,
    pub q_len: Size,
    pub k_len: Size,
    /// Features of a query and a key.
    pub head_dim: i64,
    /// Features of a value (and of the output).
    pub value_dim: i64,
    /// The factor of `Q·Kᵀ` (1 when the model scales nothing).
    pub scale: f64,
    /// Keys after the query (`j > i`) weigh nothing.
    pub causal: bool,
    /// Keys `window` or more positions behind the query (`i − j >= window`) weigh nothing.
    pub window: Option<i64>,
    /// The place in the whole sequence of query `i` (`Idx::Var(2)`), which
    /// the causal and window masks compare with key `j`'s: `i` itself, or a
    /// cp rank's chunk positions (its keys are every position). Increasing
    /// in `i`, so a tile's first and last queries bound its masked keys.
    pub query_position: Idx,
    pub q: AttentionOperand,
    pub k: AttentionOperand,
    pub v: AttentionOperand,
    /// Added to the scaled scores, `(batch, head, query, key)`.
    pub bias: Option<AttentionOperand>,
    pub out: AttentionOperand,
    pub dropout: Option<AttentionDropout>,
}

/// One of the kernel's launches.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum AttentionPass {
    /// `O` and the log-sum-exp.
    Forward,
    /// `dQ` and each row's δ, one query tile per block (two-pass backward).
    QueryGrad,
    /// `dK` and `dV`, one key tile of one key head per block (two-pass backward).
    KeyValueGrad,
    /// Each query row's δ = `dO·O` (one-pass backward, before [`Self::Grads`]).
    Delta,
    /// `dK` and `dV` as [`Self::KeyValueGrad`] writes them, and each key
    /// tile's share of the unscaled `dQ` added into its `f32` sum
    /// (one-pass backward).
    Grads,
    /// `dQ` = the scale times the sum [`Self::Grads`] added (one-pass backward).
    QueryGradScale,
    /// The bias's gradient, summed over the axes it broadcasts along.
    BiasGrad,
}

/// How the backward recomputes the scores: twice (a `dQ` pass by query
/// tiles, a `dK`/`dV` pass by key tiles), or once (by key tiles, `dQ`
/// summed across them with atomic adds). Which one a kernel's code takes is
/// the codegen's call (`attention_backward`): the one pass needs the
/// tensor-core `dK`/`dV` pass and room for its score-gradient tile.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum AttentionBackward {
    TwoPass,
    OnePass,
}

impl AttentionPass {
    pub const ALL: [AttentionPass; 7] = [
        AttentionPass::Forward,
        AttentionPass::QueryGrad,
        AttentionPass::KeyValueGrad,
        AttentionPass::Delta,
        AttentionPass::Grads,
        AttentionPass::QueryGradScale,
        AttentionPass::BiasGrad,
    ];

    pub fn name(self) -> &'static str {
        match self {
            AttentionPass::Forward => "attention_fwd",
            AttentionPass::QueryGrad => "attention_bwd_dq",
            AttentionPass::KeyValueGrad => "attention_bwd_dkdv",
            AttentionPass::Delta => "attention_bwd_delta",
            AttentionPass::Grads => "attention_bwd",
            AttentionPass::QueryGradScale => "attention_bwd_dq_scale",
            AttentionPass::BiasGrad => "attention_bwd_dbias",
        }
    }
}

/// What a buffer of a pass holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum AttentionBuffer {
    Q,
    K,
    V,
    Bias,
    Out,
    /// `f32 [batch, heads, q_len]`: the log-sum-exp of each score row.
    LogSumExp,
    /// `f32 [batch, heads, q_len]`: `δ_i = dO_i · O_i` of each query row,
    /// written by the `dQ` pass (which reads both rows anyway) and read by
    /// the `dK`/`dV` pass, which would otherwise recompute it for every
    /// key tile (FlashAttention-2 computes it once, before both).
    Delta,
    /// The gradient of the output (read).
    OutGrad,
    /// `f32 [batch, heads, q_len, head_dim]`: the unscaled `dQ`, summed
    /// over key tiles by the one-pass backward's atomic adds.
    QGradSum,
    /// Gradients written, each element once, laid out as their operand's
    /// buffer; elements no view reads stay as the caller zeroed them.
    QGrad,
    KGrad,
    VGrad,
    BiasGrad,
}

impl AttentionKernel {
    /// The buffers `pass` binds, in launch order.
    pub fn roles(&self, pass: AttentionPass) -> Vec<AttentionBuffer> {
        use AttentionBuffer::*;
        let mut r = vec![Q, K, V];
        if self.bias.is_some() {
            r.push(Bias);
        }
        r.push(Out);
        r.push(LogSumExp);
        match pass {
            AttentionPass::Forward => {}
            AttentionPass::QueryGrad => r.extend([OutGrad, QGrad, Delta]),
            AttentionPass::KeyValueGrad => r.extend([OutGrad, Delta, KGrad, VGrad]),
            AttentionPass::Delta => r.extend([OutGrad, Delta]),
            AttentionPass::Grads => r.extend([OutGrad, Delta, KGrad, VGrad, QGradSum]),
            AttentionPass::QueryGradScale => r.extend([QGradSum, QGrad]),
            AttentionPass::BiasGrad => r.extend([OutGrad, BiasGrad]),
        }
        r
    }

    /// Every pass of the kernel in launch order, the backward's as `backward` makes it.
    pub fn passes(&self, backward: AttentionBackward) -> Vec<AttentionPass> {
        use AttentionPass::*;
        match backward {
            AttentionBackward::TwoPass => vec![Forward, QueryGrad, KeyValueGrad, BiasGrad],
            AttentionBackward::OnePass => {
                vec![Forward, Delta, Grads, QueryGradScale, BiasGrad]
            }
        }
    }

    /// The operand a buffer is laid out as (`None` for the log-sum-exp).
    pub fn operand(&self, role: AttentionBuffer) -> Option<&AttentionOperand> {
        use AttentionBuffer::*;
        match role {
            Q | QGrad => Some(&self.q),
            K | KGrad => Some(&self.k),
            V | VGrad => Some(&self.v),
            Bias | BiasGrad => self.bias.as_ref(),
            Out | OutGrad => Some(&self.out),
            LogSumExp | Delta | QGradSum => None,
        }
    }

    /// Whether the pass that writes output `role` (a buffer of
    /// `buffer_len` elements at `args`) writes every element of it, so its
    /// caller need not zero it: the forward's output and log-sum-exp and δ
    /// always; a gradient of Q, K or V when its view reaches every element
    /// of its buffer (a view of a fused QKV buffer reaches a third); the
    /// bias's gradient and `dQ`'s sum never (they add into their buffer).
    pub fn written_whole(&self, role: AttentionBuffer, args: &Args, buffer_len: usize) -> bool {
        use AttentionBuffer::*;
        match role {
            Out | LogSumExp | Delta => true,
            _ => self.view_sizes(role).is_some_and(|v| {
                v.iter().map(|&s| args.size(s)).product::<i64>() == buffer_len as i64
            }),
        }
    }

    /// The sizes of `role`'s view of Q, K or V — batch, heads (key heads
    /// for K and V), rows, features — whose product is the elements the
    /// view reaches; `None` for the others.
    fn view_sizes(&self, role: AttentionBuffer) -> Option<[Size; 4]> {
        use AttentionBuffer::*;
        match role {
            Q | QGrad => Some([
                self.batch,
                self.heads,
                self.q_len,
                Size::Const(self.head_dim),
            ]),
            K | KGrad => Some([
                self.batch,
                self.kv_heads,
                self.k_len,
                Size::Const(self.head_dim),
            ]),
            V | VGrad => Some([
                self.batch,
                self.kv_heads,
                self.k_len,
                Size::Const(self.value_dim),
            ]),
            _ => None,
        }
    }

    /// The buffers of `pass` as kernel arguments, in [`Self::roles`] order.
    pub fn buffers(&self, pass: AttentionPass) -> Vec<Buffer> {
        self.roles(pass)
            .into_iter()
            .map(|role| self.buffer(pass, role))
            .collect()
    }

    fn buffer(&self, pass: AttentionPass, role: AttentionBuffer) -> Buffer {
        use AttentionBuffer::*;
        let output = match role {
            Out | LogSumExp => pass == AttentionPass::Forward,
            Delta => matches!(pass, AttentionPass::QueryGrad | AttentionPass::Delta),
            QGradSum => pass == AttentionPass::Grads,
            QGrad | KGrad | VGrad | BiasGrad => true,
            Q | K | V | Bias | OutGrad => false,
        };
        match self.operand(role) {
            Some(op) => Buffer {
                label: match role {
                    OutGrad | QGrad | KGrad | VGrad | BiasGrad => format!("d{}", op.label),
                    _ => op.label.clone(),
                },
                elem: Elem::Float,
                output,
                len: op.len.clone(),
            },
            None if role == QGradSum => Buffer {
                label: "dq_sum".into(),
                elem: Elem::F32,
                output,
                len: vec![
                    self.batch,
                    self.heads,
                    self.q_len,
                    Size::Const(self.head_dim),
                ],
            },
            None => Buffer {
                label: if role == Delta { "delta" } else { "lse" }.into(),
                elem: Elem::F32,
                output,
                len: vec![self.batch, self.heads, self.q_len],
            },
        }
    }

    /// Whether `pass` runs at all for gradients wanted of `wants`
    /// (whether Q, K, V and the bias need one).
    pub fn runs(&self, pass: AttentionPass, wants: [bool; 4]) -> bool {
        match pass {
            AttentionPass::Forward => true,
            // The `dK`/`dV` pass reads the δ the `dQ` pass writes.
            AttentionPass::QueryGrad => wants[0] || wants[1] || wants[2],
            AttentionPass::KeyValueGrad => wants[1] || wants[2],
            AttentionPass::Delta | AttentionPass::Grads => wants[0] || wants[1] || wants[2],
            AttentionPass::QueryGradScale => wants[0],
            AttentionPass::BiasGrad => self.bias.is_some() && wants[3],
        }
    }

    /// The work items a launch of `pass` strides over: query tiles of every
    /// head, key tiles of every key head, or the bias's elements.
    pub fn items(&self, pass: AttentionPass, sizes: &dyn Fn(Size) -> i64) -> i64 {
        let tiles = |len: Size, block: i64| (sizes(len) + block - 1) / block;
        match pass {
            AttentionPass::Forward
            | AttentionPass::QueryGrad
            | AttentionPass::Delta
            | AttentionPass::QueryGradScale => {
                tiles(self.q_len, BLOCK_Q) * sizes(self.batch) * sizes(self.heads)
            }
            AttentionPass::KeyValueGrad | AttentionPass::Grads => {
                tiles(self.k_len, BLOCK_K) * sizes(self.batch) * sizes(self.kv_heads)
            }
            AttentionPass::BiasGrad => match &self.bias {
                None => 0,
                Some(b) => [self.batch, self.heads, self.q_len, self.k_len]
                    .into_iter()
                    .zip(b.at.strides)
                    .filter(|(_, s)| *s != Size::Const(0))
                    .map(|(e, _)| sizes(e))
                    .product(),
            },
        }
    }

    /// The row-major index of element `(b, h, i, j)` (`Idx::Var(0..4)`) of
    /// the kernel's own probabilities: the dropout's draw index where they
    /// are the whole tensor.
    pub fn local_index(&self) -> Idx {
        let lens = [self.batch, self.heads, self.q_len, self.k_len].map(Idx::size);
        (0..4).zip(lens).fold(Idx::Const(0), |acc, (a, len)| {
            Idx::add(Idx::mul(acc, len), Idx::Var(a))
        })
    }

    /// The stable textual form, shown in goldens.
    pub fn text(&self) -> String {
        self.render(true)
    }

    /// What a kernel name's hash covers: the text without the operands'
    /// graph labels, so attentions alike but for their tensors share a kernel.
    pub fn signature(&self) -> String {
        self.render(false)
    }

    fn render(&self, labels: bool) -> String {
        let mut s = String::new();
        let _ = write!(
            s,
            "attention batch {} heads {} (kv {}, group {}) q {} k {} dim {} value {} sizes={} scale {:?}",
            self.batch,
            self.heads,
            self.kv_heads,
            self.group,
            self.q_len,
            self.k_len,
            self.head_dim,
            self.value_dim,
            self.sizes,
            self.scale
        );
        if self.causal {
            s.push_str(" causal");
        }
        if let Some(w) = self.window {
            let _ = write!(s, " window {w}");
        }
        if self.query_position != Idx::Var(2) {
            let _ = write!(s, " queries at {}", self.query_position);
        }
        s.push('\n');
        let mut operand = |name: &str, op: &AttentionOperand| {
            let len: Vec<String> = op.len.iter().map(|d| d.to_string()).collect();
            let _ = write!(s, "  {name}: float[{}] at {}", len.join("*"), op.at);
            if labels {
                let _ = write!(s, "  // {}", op.label);
            }
            s.push('\n');
        };
        operand("q", &self.q);
        operand("k", &self.k);
        operand("v", &self.v);
        if let Some(b) = &self.bias {
            operand("bias", b);
        }
        operand("out", &self.out);
        if let Some(d) = &self.dropout {
            let _ = write!(
                s,
                "  dropout p {:?} node {} layer {} samples {} + / {}",
                d.p, d.key.node, d.key.layer, d.key.first_sample, d.key.per_sample
            );
            if d.index != self.local_index() {
                let _ = write!(s, " at {}", d.index);
            }
            s.push('\n');
        }
        s
    }
}

impl fmt::Display for Strided {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let [b, h, i, d] = &self.strides;
        write!(f, "{} + b*{b} + h*{h} + i*{i} + d*{d}", self.offset)
    }
}
