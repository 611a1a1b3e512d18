//! The fused attention on the CPU: the reference the CUDA kernels keep, in
//! their tiles — the forward's online softmax over key tiles (causal and
//! window tiles skipped), the backward recomputing each score tile from Q, K
//! and the saved log-sum-exp, with the dropout mask drawn again.

use crate::attention::{
    AttentionBuffer, AttentionKernel, AttentionOperand, AttentionPass, BLOCK_K, BLOCK_Q,
};
use crate::interp::{Args, BufferRef, Data};
use crate::kernel::{batch_draw, draw_state, drop_threshold, Idx};
use crate::CodegenError;

/// An operand's element addresses at a launch's sizes.
#[derive(Clone, Copy)]
struct At {
    offset: i64,
    strides: [i64; 4],
}

impl At {
    fn new(op: &AttentionOperand, args: &Args) -> At {
        At {
            offset: args.size(op.at.offset),
            strides: op.at.strides.map(|s| args.size(s)),
        }
    }

    fn at(&self, b: i64, h: i64, i: i64, d: i64) -> usize {
        let s = &self.strides;
        (self.offset + b * s[0] + h * s[1] + i * s[2] + d * s[3]) as usize
    }
}

/// Everything a pass reads, at a launch's sizes.
struct Problem<'a> {
    k: &'a AttentionKernel,
    args: &'a Args,
    batch: i64,
    heads: i64,
    kv_heads: i64,
    q_len: i64,
    k_len: i64,
    q_at: At,
    k_at: At,
    v_at: At,
    bias_at: Option<At>,
    out_at: At,
    drop: Option<Draws<'a>>,
    /// Query positions are the rank's places in the whole sequence.
    placed_queries: bool,
}

impl Problem<'_> {
    /// Value `at` (over `(b, h, i, j)`) of the kernel's index expressions.
    fn eval(&self, at: &Idx, bhij: [i64; 4]) -> i64 {
        at.eval(&bhij, &|s| self.args.size(s))
            .expect("the attention's places read only its axes and sizes")
    }

    /// Query `i`'s place in the whole sequence, which the masks read.
    fn query_position(&self, i: i64) -> i64 {
        if self.placed_queries {
            self.eval(&self.k.query_position, [0, 0, i, 0])
        } else {
            i
        }
    }

    fn masked(&self, i: i64, j: i64) -> bool {
        if !self.k.causal && self.k.window.is_none() {
            return false;
        }
        let i = self.query_position(i);
        (self.k.causal && j > i) || self.k.window.is_some_and(|w| i - j >= w)
    }

    /// Whether every pair of query rows `[i0, i1)` and keys `[j0, j1)` is
    /// masked (query places increase with `i`).
    fn tile_masked(&self, i0: i64, i1: i64, j0: i64, j1: i64) -> bool {
        let (first, last) = (self.query_position(i0), self.query_position(i1 - 1));
        (self.k.causal && j0 > last) || self.k.window.is_some_and(|w| first - (j1 - 1) >= w)
    }

    /// The scaled, biased score of query `i` against key `j` (not masked).
    fn score(&self, x: &Inputs, b: i64, h: i64, i: i64, j: i64) -> f32 {
        let kh = h / self.k.group;
        let mut s = 0.0f32;
        for d in 0..self.k.head_dim {
            s += x.q[self.q_at.at(b, h, i, d)] * x.k[self.k_at.at(b, kh, j, d)];
        }
        s *= self.k.scale as f32;
        if let (Some(at), Some(bias)) = (&self.bias_at, x.bias) {
            s += bias[at.at(b, h, i, j)];
        }
        s
    }

    /// The dropout's factor for element `(b, h, i, j)`: 0 if dropped, else `1/(1-p)`.
    fn keep(&self, b: i64, h: i64, i: i64, j: i64) -> f32 {
        let Some(d) = &self.drop else { return 1.0 };
        let index = self.eval(d.index, [b, h, i, j]);
        if batch_draw(d.state, d.first_sample, d.per_sample, b, index) < d.threshold {
            0.0
        } else {
            d.kept
        }
    }

    fn lse_at(&self, b: i64, h: i64, i: i64) -> usize {
        ((b * self.heads + h) * self.q_len + i) as usize
    }
}

/// The dropout at a launch: the key's state and words, where each element
/// draws, the threshold and the kept elements' scale.
struct Draws<'a> {
    state: u64,
    first_sample: i64,
    per_sample: i64,
    index: &'a Idx,
    threshold: f32,
    kept: f32,
}

/// The buffers a pass reads.
struct Inputs<'a> {
    q: &'a [f32],
    k: &'a [f32],
    v: &'a [f32],
    bias: Option<&'a [f32]>,
    out: &'a [f32],
    lse: &'a [f32],
    dout: &'a [f32],
    /// The `dQ` pass's δ, as the `dK`/`dV` pass reads it.
    delta: &'a [f32],
    /// The one-pass backward's unscaled `dQ`, as its last pass reads it.
    dq_sum: &'a [f32],
}

fn err(pass: AttentionPass, detail: String) -> CodegenError {
    CodegenError::Interpret {
        kernel: pass.name().into(),
        detail,
    }
}

/// Run `pass` of `kernel` on the CPU, one buffer per [`AttentionKernel::roles`]
/// entry. Outputs are zeroed over their length first, then written (the
/// forward's output and log-sum-exp, or one pass's gradients).
pub fn interpret_attention(
    kernel: &AttentionKernel,
    pass: AttentionPass,
    args: &Args,
    buffers: &mut [BufferRef],
) -> Result<(), CodegenError> {
    let roles = kernel.roles(pass);
    let specs = kernel.buffers(pass);
    if buffers.len() != roles.len() || args.sizes.len() < kernel.sizes {
        return Err(err(
            pass,
            format!(
                "{} buffers and {} sizes given, the pass takes {} and {}",
                buffers.len(),
                args.sizes.len(),
                roles.len(),
                kernel.sizes
            ),
        ));
    }
    let len_of = |i: usize| args.len_of(&specs[i]);
    let p = Problem {
        k: kernel,
        args,
        placed_queries: kernel.query_position != Idx::Var(2),
        batch: args.size(kernel.batch),
        heads: args.size(kernel.heads),
        kv_heads: args.size(kernel.kv_heads),
        q_len: args.size(kernel.q_len),
        k_len: args.size(kernel.k_len),
        q_at: At::new(&kernel.q, args),
        k_at: At::new(&kernel.k, args),
        v_at: At::new(&kernel.v, args),
        bias_at: kernel.bias.as_ref().map(|b| At::new(b, args)),
        out_at: At::new(&kernel.out, args),
        drop: kernel.dropout.as_ref().map(|d| Draws {
            state: draw_state(args.seed, d.key.node, args.size(d.key.layer)),
            first_sample: args.size(d.key.first_sample),
            per_sample: args.size(d.key.per_sample),
            index: &d.index,
            threshold: drop_threshold(d.p) as f32,
            kept: (1.0 / (1.0 - d.p)) as f32,
        }),
    };
    // Split the buffers into what is read and what is written.
    let mut reads: Vec<Option<&[f32]>> = vec![None; roles.len()];
    let mut writes: Vec<(AttentionBuffer, &mut Vec<f32>)> = Vec::new();
    for (i, (buf, spec)) in buffers.iter_mut().zip(&specs).enumerate() {
        let len = len_of(i);
        match (buf, spec.output) {
            (BufferRef::Input(Data::F32(v)), false) if v.len() >= len => {
                reads[i] = Some(v.as_slice())
            }
            (BufferRef::Output(Data::F32(v)), true) if v.len() >= len => {
                v[..len].fill(0.0);
                writes.push((roles[i], v));
            }
            _ => {
                return Err(err(
                    pass,
                    format!(
                        "{:?} ({}) needs {len} floats bound as {}",
                        roles[i],
                        spec.label,
                        if spec.output { "an output" } else { "an input" }
                    ),
                ))
            }
        }
    }
    let read = |role: AttentionBuffer| -> &[f32] {
        roles
            .iter()
            .position(|&r| r == role)
            .and_then(|i| reads[i])
            .unwrap_or(&[])
    };
    let x = Inputs {
        q: read(AttentionBuffer::Q),
        k: read(AttentionBuffer::K),
        v: read(AttentionBuffer::V),
        bias: kernel.bias.as_ref().map(|_| read(AttentionBuffer::Bias)),
        out: read(AttentionBuffer::Out),
        lse: read(AttentionBuffer::LogSumExp),
        dout: read(AttentionBuffer::OutGrad),
        delta: read(AttentionBuffer::Delta),
        dq_sum: read(AttentionBuffer::QGradSum),
    };
    match pass {
        AttentionPass::Forward => {
            let [(_, out), (_, lse)] = &mut writes[..] else {
                unreachable!("the forward writes the output and the log-sum-exp")
            };
            forward(&p, &x, out, lse);
        }
        AttentionPass::QueryGrad => {
            let [(_, dq), (_, delta)] = &mut writes[..] else {
                unreachable!("one gradient and δ")
            };
            query_grad(&p, &x, dq, delta);
        }
        AttentionPass::KeyValueGrad => {
            let [(_, dk), (_, dv)] = &mut writes[..] else {
                unreachable!("two gradients")
            };
            key_value_grad(&p, &x, dk, dv, None);
        }
        AttentionPass::Delta => {
            let [(_, deltas)] = &mut writes[..] else {
                unreachable!("δ")
            };
            for b in 0..p.batch {
                for h in 0..p.heads {
                    for i in 0..p.q_len {
                        deltas[p.lse_at(b, h, i)] = delta(&p, &x, b, h, i);
                    }
                }
            }
        }
        AttentionPass::Grads => {
            let [(_, dk), (_, dv), (_, dq_sum)] = &mut writes[..] else {
                unreachable!("two gradients and dQ's sum")
            };
            key_value_grad(&p, &x, dk, dv, Some(dq_sum));
        }
        AttentionPass::QueryGradScale => {
            let [(_, dq)] = &mut writes[..] else {
                unreachable!("one gradient")
            };
            let hd = p.k.head_dim;
            let scale = p.k.scale as f32;
            for b in 0..p.batch {
                for h in 0..p.heads {
                    for i in 0..p.q_len {
                        let row = p.lse_at(b, h, i) * hd as usize;
                        for d in 0..hd {
                            dq[p.q_at.at(b, h, i, d)] = x.dq_sum[row + d as usize] * scale;
                        }
                    }
                }
            }
        }
        AttentionPass::BiasGrad => {
            let [(_, db)] = &mut writes[..] else {
                unreachable!("one gradient")
            };
            bias_grad(&p, &x, db);
        }
    }
    Ok(())
}

fn tiles(len: i64, block: i64) -> impl Iterator<Item = (i64, i64)> {
    (0..len)
        .step_by(block.max(1) as usize)
        .map(move |t| (t, (t + block).min(len)))
}

fn forward(p: &Problem, x: &Inputs, out: &mut [f32], lse: &mut [f32]) {
    let dv = p.k.value_dim as usize;
    let mut s = vec![0.0f32; BLOCK_K as usize];
    for b in 0..p.batch {
        for h in 0..p.heads {
            let kh = h / p.k.group;
            for (i0, i1) in tiles(p.q_len, BLOCK_Q) {
                let rows = (i1 - i0) as usize;
                let mut m = vec![f32::NEG_INFINITY; rows];
                let mut l = vec![0.0f32; rows];
                let mut acc = vec![0.0f32; rows * dv];
                for (j0, j1) in tiles(p.k_len, BLOCK_K) {
                    if p.tile_masked(i0, i1, j0, j1) {
                        continue;
                    }
                    for r in 0..rows {
                        let i = i0 + r as i64;
                        let mut tile_max = f32::NEG_INFINITY;
                        for j in j0..j1 {
                            let v = if p.masked(i, j) {
                                f32::NEG_INFINITY
                            } else {
                                p.score(x, b, h, i, j)
                            };
                            s[(j - j0) as usize] = v;
                            tile_max = tile_max.max(v);
                        }
                        let m_new = m[r].max(tile_max);
                        if m_new == f32::NEG_INFINITY {
                            continue;
                        }
                        let alpha = (m[r] - m_new).exp();
                        let a = &mut acc[r * dv..(r + 1) * dv];
                        a.iter_mut().for_each(|o| *o *= alpha);
                        let mut sum = 0.0f32;
                        for j in j0..j1 {
                            let e = (s[(j - j0) as usize] - m_new).exp();
                            sum += e;
                            let w = e * p.keep(b, h, i, j);
                            if w != 0.0 {
                                for (d, o) in a.iter_mut().enumerate() {
                                    *o += w * x.v[p.v_at.at(b, kh, j, d as i64)];
                                }
                            }
                        }
                        l[r] = l[r] * alpha + sum;
                        m[r] = m_new;
                    }
                }
                for r in 0..rows {
                    let i = i0 + r as i64;
                    let inv = if l[r] > 0.0 { 1.0 / l[r] } else { 0.0 };
                    for d in 0..dv {
                        out[p.out_at.at(b, h, i, d as i64)] = acc[r * dv + d] * inv;
                    }
                    lse[p.lse_at(b, h, i)] = if l[r] > 0.0 {
                        m[r] + l[r].ln()
                    } else {
                        f32::NEG_INFINITY
                    };
                }
            }
        }
    }
}

/// One score pair's backward quantities: the probability, its dropped
/// form and the score's gradient, given the row's `lse` and `Δ = dO·O`.
struct PairGrad {
    p: f32,
    p_dropped: f32,
    ds: f32,
}

fn pair_grad(p: &Problem, x: &Inputs, b: i64, h: i64, i: i64, j: i64, delta: f32) -> PairGrad {
    let lse = x.lse[p.lse_at(b, h, i)];
    if p.masked(i, j) || lse == f32::NEG_INFINITY {
        return PairGrad {
            p: 0.0,
            p_dropped: 0.0,
            ds: 0.0,
        };
    }
    let prob = (p.score(x, b, h, i, j) - lse).exp();
    let kh = h / p.k.group;
    let mut dpd = 0.0f32;
    for d in 0..p.k.value_dim {
        dpd += x.dout[p.out_at.at(b, h, i, d)] * x.v[p.v_at.at(b, kh, j, d)];
    }
    let keep = p.keep(b, h, i, j);
    PairGrad {
        p: prob,
        p_dropped: prob * keep,
        ds: prob * (dpd * keep - delta),
    }
}

/// `Δ_i = dO_i · O_i`: the row sum of `P ∘ dP` (dropout included).
fn delta(p: &Problem, x: &Inputs, b: i64, h: i64, i: i64) -> f32 {
    (0..p.k.value_dim)
        .map(|d| {
            let at = p.out_at.at(b, h, i, d);
            x.dout[at] * x.out[at]
        })
        .sum()
}

fn query_grad(p: &Problem, x: &Inputs, dq: &mut [f32], deltas: &mut [f32]) {
    let hd = p.k.head_dim as usize;
    let scale = p.k.scale as f32;
    for b in 0..p.batch {
        for h in 0..p.heads {
            let kh = h / p.k.group;
            for (i0, i1) in tiles(p.q_len, BLOCK_Q) {
                for i in i0..i1 {
                    let dl = delta(p, x, b, h, i);
                    deltas[p.lse_at(b, h, i)] = dl;
                    let mut acc = vec![0.0f32; hd];
                    for (j0, j1) in tiles(p.k_len, BLOCK_K) {
                        if p.tile_masked(i0, i1, j0, j1) {
                            continue;
                        }
                        for j in j0..j1 {
                            let g = pair_grad(p, x, b, h, i, j, dl);
                            if g.ds != 0.0 {
                                for (d, a) in acc.iter_mut().enumerate() {
                                    *a += g.ds * x.k[p.k_at.at(b, kh, j, d as i64)];
                                }
                            }
                        }
                    }
                    for (d, a) in acc.iter().enumerate() {
                        dq[p.q_at.at(b, h, i, d as i64)] = a * scale;
                    }
                }
            }
        }
    }
}

/// `dK` and `dV` by key tiles; with `dq_sum`, each pair's `dS·K` added
/// into the unscaled `dQ` of its query row (`[b, h, i, d]`, row-major) too.
fn key_value_grad(
    p: &Problem,
    x: &Inputs,
    dk: &mut [f32],
    dv: &mut [f32],
    mut dq_sum: Option<&mut Vec<f32>>,
) {
    let (hd, vd) = (p.k.head_dim as usize, p.k.value_dim as usize);
    let scale = p.k.scale as f32;
    for b in 0..p.batch {
        for kh in 0..p.kv_heads {
            for (j0, j1) in tiles(p.k_len, BLOCK_K) {
                for j in j0..j1 {
                    let mut ak = vec![0.0f32; hd];
                    let mut av = vec![0.0f32; vd];
                    for h in kh * p.k.group..(kh + 1) * p.k.group {
                        for (i0, i1) in tiles(p.q_len, BLOCK_Q) {
                            if p.tile_masked(i0, i1, j0, j1) {
                                continue;
                            }
                            for i in i0..i1 {
                                let dl = x.delta[p.lse_at(b, h, i)];
                                let g = pair_grad(p, x, b, h, i, j, dl);
                                if g.p == 0.0 {
                                    continue;
                                }
                                for (d, a) in av.iter_mut().enumerate() {
                                    *a += g.p_dropped * x.dout[p.out_at.at(b, h, i, d as i64)];
                                }
                                for (d, a) in ak.iter_mut().enumerate() {
                                    *a += g.ds * x.q[p.q_at.at(b, h, i, d as i64)];
                                }
                                if let Some(sum) = dq_sum.as_deref_mut() {
                                    let row = p.lse_at(b, h, i) * hd;
                                    for d in 0..hd {
                                        sum[row + d] += g.ds * x.k[p.k_at.at(b, kh, j, d as i64)];
                                    }
                                }
                            }
                        }
                    }
                    for (d, a) in ak.iter().enumerate() {
                        dk[p.k_at.at(b, kh, j, d as i64)] = a * scale;
                    }
                    for (d, a) in av.iter().enumerate() {
                        dv[p.v_at.at(b, kh, j, d as i64)] = *a;
                    }
                }
            }
        }
    }
}

/// The bias's gradient: for each element it holds (its axes of nonzero
/// stride), the sum of the score gradients over the axes it broadcasts
/// along, in row-major order of those.
fn bias_grad(p: &Problem, x: &Inputs, db: &mut [f32]) {
    let Some(at) = p.bias_at else { return };
    let extent = [p.batch, p.heads, p.q_len, p.k_len];
    let broadcast: Vec<bool> = (0..4).map(|a| at.strides[a] == 0).collect();
    let owned = |a: usize| if broadcast[a] { 1 } else { extent[a] };
    let summed = |a: usize| if broadcast[a] { extent[a] } else { 1 };
    for ob in 0..owned(0) {
        for oh in 0..owned(1) {
            for oi in 0..owned(2) {
                for oj in 0..owned(3) {
                    let mut acc = 0.0f32;
                    for sb in 0..summed(0) {
                        for sh in 0..summed(1) {
                            for si in 0..summed(2) {
                                for sj in 0..summed(3) {
                                    let (b, h, i, j) = (ob + sb, oh + sh, oi + si, oj + sj);
                                    let dl = delta(p, x, b, h, i);
                                    acc += pair_grad(p, x, b, h, i, j, dl).ds;
                                }
                            }
                        }
                    }
                    db[at.at(ob, oh, oi, oj)] = acc;
                }
            }
        }
    }
}
