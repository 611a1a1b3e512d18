//! The fused attention on the host: its forward equals the unfused reference
//! evaluator's output (and the log-sum-exp of its scores) for the zoo's
//! attentions, and every backward pass equals the textbook gradients in
//! f64, dropout included: causal, windowed, biased, grouped- and
//! multi-query, cross-attention, a value width apart from the key's, and
//! lengths that are not whole tiles.

mod common;

use common::{dim, evaluate, Rng};
use dplc_codegen::{
    draw_state, drop_threshold, dropout_draw, fuse, interpret_attention, Args, AttentionBuffer,
    AttentionKernel, AttentionPass, BufferRef, Data, FusedAttention, Step,
};
use dplc_ir::{Graph, Op};
use std::collections::HashMap;

fn syms(pairs: &[(&str, i64)]) -> HashMap<String, i64> {
    pairs.iter().map(|(k, v)| (k.to_string(), *v)).collect()
}

/// The launch arguments of `at` at `syms`; the dropout key's words as a
/// run binds them at layer 3 of a micro-batch from sample 5.
fn args_of(g: &Graph, at: &FusedAttention, syms: &HashMap<String, i64>) -> Args {
    let place = dplc_codegen::KeyPlace::unsplit(3, 5, syms["batch"] as usize);
    Args {
        sizes: common::launch_sizes(g, &at.sizes, &at.key_sizes, syms, &place),
        scalars: vec![],
        seed: 0x5eed,
    }
}

fn len(k: &AttentionKernel, pass: AttentionPass, role: AttentionBuffer, args: &Args) -> usize {
    let i = k.roles(pass).iter().position(|&r| r == role).unwrap();
    k.buffers(pass)[i]
        .len
        .iter()
        .map(|&s| args.size(s))
        .product::<i64>() as usize
}

/// Run `pass` with `inputs` by role; returns the outputs by role.
fn run(
    k: &AttentionKernel,
    pass: AttentionPass,
    args: &Args,
    inputs: &HashMap<AttentionBuffer, Vec<f32>>,
) -> HashMap<AttentionBuffer, Vec<f32>> {
    let roles = k.roles(pass);
    let specs = k.buffers(pass);
    let ins: Vec<Data> = roles
        .iter()
        .map(|r| Data::F32(inputs.get(r).cloned().unwrap_or_default()))
        .collect();
    let mut outs: Vec<Data> = roles
        .iter()
        .map(|&r| Data::F32(vec![f32::NAN; len(k, pass, r, args)]))
        .collect();
    let mut refs: Vec<BufferRef> = Vec::new();
    for ((i, o), spec) in ins.iter().zip(outs.iter_mut()).zip(&specs) {
        refs.push(if spec.output {
            BufferRef::Output(o)
        } else {
            BufferRef::Input(i)
        });
    }
    interpret_attention(k, pass, args, &mut refs).unwrap_or_else(|e| panic!("{e}"));
    drop(refs);
    roles
        .iter()
        .zip(&specs)
        .zip(outs)
        .filter(|((_, s), _)| s.output)
        .map(|((&r, _), d)| (r, d.f32().to_vec()))
        .collect()
}

fn close(what: &str, got: &[f32], want: &[f64], tol: f64) {
    assert_eq!(got.len(), want.len(), "{what}");
    for (i, (&x, &y)) in got.iter().zip(want).enumerate() {
        let ok = (f64::from(x) - y).abs() <= tol * (1.0 + y.abs())
            || (x == f32::NEG_INFINITY && y == f64::NEG_INFINITY);
        assert!(ok, "{what}[{i}]: fused {x}, reference {y}");
    }
}

/// Every attention of `g` (its regions evaluated unfused at `syms`): the
/// fused forward's output and log-sum-exp against the evaluator's. Returns
/// how many ran.
fn forward_matches_reference(g: &Graph, syms: &HashMap<String, i64>) -> usize {
    let mut checked = 0;
    for (r, _) in g.regions() {
        let plan = fuse(g, r);
        let steps: Vec<&FusedAttention> = plan
            .steps
            .iter()
            .filter_map(|s| match s {
                Step::Attention(a) => Some(a),
                _ => None,
            })
            .collect();
        if steps.is_empty() {
            continue;
        }
        let env = evaluate(g, r, syms, 11 + r.index() as u64);
        for at in steps {
            let k = &at.kernel;
            let args = args_of(g, at, syms);
            let inputs: HashMap<AttentionBuffer, Vec<f32>> = [
                AttentionBuffer::Q,
                AttentionBuffer::K,
                AttentionBuffer::V,
                AttentionBuffer::Bias,
            ]
            .into_iter()
            .filter_map(|role| Some((role, env[&at.tensor(role)?].data.clone())))
            .collect();
            let out = run(k, AttentionPass::Forward, &args, &inputs);
            let want: Vec<f64> = env[&at.out].data.iter().map(|&x| f64::from(x)).collect();
            close(
                &format!("{}", at.out),
                &out[&AttentionBuffer::Out],
                &want,
                1e-4,
            );
            // The log-sum-exp of each row of the scores the softmax read.
            let softmax = at
                .nodes
                .iter()
                .find(|&&n| matches!(g.node(n).op, Op::Softmax { .. }))
                .unwrap();
            let scores = &env[&g.node(*softmax).inputs[0]];
            let keys = *scores.shape.last().unwrap();
            let lse: Vec<f64> = scores
                .data
                .chunks(keys)
                .map(|row| {
                    let m = row.iter().fold(f64::NEG_INFINITY, |a, &x| a.max(x as f64));
                    m + row.iter().map(|&x| (x as f64 - m).exp()).sum::<f64>().ln()
                })
                .collect();
            close("lse", &out[&AttentionBuffer::LogSumExp], &lse, 1e-4);
            checked += 1;
        }
    }
    checked
}

#[test]
fn causal_forward_equals_the_unfused_reference() {
    let g = common::zoo("tiny.dpl", "gpt_tiny").graph;
    assert_eq!(
        forward_matches_reference(&g, &syms(&[("batch", 2), ("seq", 9)])),
        1
    );
}

/// 70 queries and keys: a whole tile and a part, on both sides.
#[test]
fn lengths_that_are_not_whole_tiles_equal_the_reference() {
    let g = common::zoo("tiny.dpl", "gpt_tiny").graph;
    assert_eq!(
        forward_matches_reference(&g, &syms(&[("batch", 1), ("seq", 70)])),
        1
    );
}

#[test]
fn grouped_and_multi_query_forward_equals_the_reference() {
    let llama = common::zoo("tiny.dpl", "llama_tiny").graph;
    assert_eq!(
        forward_matches_reference(&llama, &syms(&[("batch", 2), ("seq", 7)])),
        1
    );
    let gemma = common::zoo("gemma.dpl", "gemma_tiny").graph;
    assert_eq!(
        forward_matches_reference(&gemma, &syms(&[("batch", 2), ("seq", 7)])),
        1
    );
}

/// Mistral's window of 8 over 20 positions, and causal.
#[test]
fn windowed_forward_equals_the_reference() {
    let g = common::zoo("mistral.dpl", "mistral_tiny").graph;
    assert_eq!(
        forward_matches_reference(&g, &syms(&[("batch", 2), ("seq", 20)])),
        1
    );
}

/// T5: a position bias broadcast over the batch, cross-attention to 5
/// encoder positions from 16 decoder ones.
#[test]
fn biased_and_cross_attention_forward_equals_the_reference() {
    let g = common::t5_tiny_without_dropout();
    assert_eq!(
        forward_matches_reference(&g, &syms(&[("batch", 2), ("seq", 5)])),
        3
    );
}

/// DeepSeek's latent attention: values narrower than keys, read as a slice.
#[test]
fn latent_attention_forward_equals_the_reference() {
    let text = std::fs::read_to_string(
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../models/deepseek.dpl"),
    )
    .unwrap();
    let g = common::lower_m(&format!("{text}\nmodel m = deepseek_tiny()\n"));
    assert_eq!(
        forward_matches_reference(&g, &syms(&[("batch", 2), ("seq", 6)])),
        2
    );
}

/// The textbook attention and its gradients in f64, from the kernel's own
/// description of where each element is: `(out, lse, dq, dk, dv, dbias)`.
#[allow(clippy::type_complexity)]
fn dense(
    k: &AttentionKernel,
    args: &Args,
    x: &HashMap<AttentionBuffer, Vec<f32>>,
    dout: &[f32],
) -> HashMap<AttentionBuffer, Vec<f64>> {
    let sz = |s| args.size(s);
    let (nb, nh, sq, sk) = (sz(k.batch), sz(k.heads), sz(k.q_len), sz(k.k_len));
    let at = |op: &dplc_codegen::AttentionOperand, b: i64, h: i64, i: i64, d: i64| {
        let s = op.at.strides.map(sz);
        (sz(op.at.offset) + b * s[0] + h * s[1] + i * s[2] + d * s[3]) as usize
    };
    let buf = |r: AttentionBuffer| -> Vec<f64> {
        x.get(&r)
            .map(|v| v.iter().map(|&y| f64::from(y)).collect())
            .unwrap_or_default()
    };
    let (q, kk, v, bias) = (
        buf(AttentionBuffer::Q),
        buf(AttentionBuffer::K),
        buf(AttentionBuffer::V),
        buf(AttentionBuffer::Bias),
    );
    let n = |r| x.get(&r).map_or(0, |v: &Vec<f32>| v.len());
    let mut out = vec![0.0f64; len(k, AttentionPass::Forward, AttentionBuffer::Out, args)];
    let mut lse = vec![0.0f64; (nb * nh * sq) as usize];
    let mut deltas = vec![0.0f64; (nb * nh * sq) as usize];
    let (mut dq, mut dk, mut dv, mut db) = (
        vec![0.0f64; n(AttentionBuffer::Q)],
        vec![0.0f64; n(AttentionBuffer::K)],
        vec![0.0f64; n(AttentionBuffer::V)],
        vec![0.0f64; n(AttentionBuffer::Bias)],
    );
    let keep = |b: i64, h: i64, i: i64, j: i64| -> f64 {
        match &k.dropout {
            None => 1.0,
            Some(d) => {
                let state = draw_state(args.seed, d.key.node, args.size(d.key.layer));
                let index = ((b * nh + h) * sq + i) * sk + j;
                let u = dropout_draw(
                    state,
                    args.size(d.key.first_sample),
                    args.size(d.key.per_sample),
                    index,
                );
                if u < drop_threshold(d.p) as f32 {
                    0.0
                } else {
                    1.0 / (1.0 - d.p)
                }
            }
        }
    };
    for b in 0..nb {
        for h in 0..nh {
            let kh = h / k.group;
            for i in 0..sq {
                let s: Vec<f64> = (0..sk)
                    .map(|j| {
                        let masked = (k.causal && j > i) || k.window.is_some_and(|w| i - j >= w);
                        if masked {
                            return f64::NEG_INFINITY;
                        }
                        let mut s = 0.0;
                        for d in 0..k.head_dim {
                            s += q[at(&k.q, b, h, i, d)] * kk[at(&k.k, b, kh, j, d)];
                        }
                        s *= k.scale;
                        if let Some(bo) = &k.bias {
                            s += bias[at(bo, b, h, i, j)];
                        }
                        s
                    })
                    .collect();
                let m = s.iter().copied().fold(f64::NEG_INFINITY, f64::max);
                let sum: f64 = s.iter().map(|&x| (x - m).exp()).sum();
                lse[((b * nh + h) * sq + i) as usize] = m + sum.ln();
                let p: Vec<f64> = s.iter().map(|&x| (x - m).exp() / sum).collect();
                let z: Vec<f64> = (0..sk).map(|j| keep(b, h, i, j)).collect();
                for d in 0..k.value_dim {
                    out[at(&k.out, b, h, i, d)] = (0..sk)
                        .map(|j| p[j as usize] * z[j as usize] * v[at(&k.v, b, kh, j, d)])
                        .sum();
                }
                let go = |d: i64| f64::from(dout[at(&k.out, b, h, i, d)]);
                let dp: Vec<f64> = (0..sk)
                    .map(|j| {
                        let dpd: f64 = (0..k.value_dim)
                            .map(|d| go(d) * v[at(&k.v, b, kh, j, d)])
                            .sum();
                        dpd * z[j as usize]
                    })
                    .collect();
                let delta: f64 = p.iter().zip(&dp).map(|(a, b)| a * b).sum();
                deltas[((b * nh + h) * sq + i) as usize] = delta;
                for j in 0..sk {
                    let ju = j as usize;
                    let ds = p[ju] * (dp[ju] - delta);
                    for d in 0..k.head_dim {
                        dq[at(&k.q, b, h, i, d)] += k.scale * ds * kk[at(&k.k, b, kh, j, d)];
                        dk[at(&k.k, b, kh, j, d)] += k.scale * ds * q[at(&k.q, b, h, i, d)];
                    }
                    for d in 0..k.value_dim {
                        dv[at(&k.v, b, kh, j, d)] += p[ju] * z[ju] * go(d);
                    }
                    if let Some(bo) = &k.bias {
                        db[at(bo, b, h, i, j)] += ds;
                    }
                }
            }
        }
    }
    use AttentionBuffer::*;
    HashMap::from([
        (Out, out),
        (LogSumExp, lse),
        (Delta, deltas),
        (QGrad, dq),
        (KGrad, dk),
        (VGrad, dv),
        (BiasGrad, db),
    ])
}

/// Every attention of `g`: forward and the three backward passes on random
/// operands against [`dense`]. Returns how many ran.
fn backward_matches_textbook(g: &Graph, syms: &HashMap<String, i64>) -> usize {
    let mut rng = Rng(17);
    let mut checked = 0;
    for (r, _) in g.regions() {
        for step in fuse(g, r).steps {
            let Step::Attention(at) = step else { continue };
            let k = &at.kernel;
            let args = args_of(g, &at, syms);
            let mut x: HashMap<AttentionBuffer, Vec<f32>> = HashMap::new();
            for role in [
                AttentionBuffer::Q,
                AttentionBuffer::K,
                AttentionBuffer::V,
                AttentionBuffer::Bias,
            ] {
                if k.operand(role).is_some() {
                    let n = len(k, AttentionPass::Forward, role, &args);
                    x.insert(role, (0..n).map(|_| rng.normal_ish()).collect());
                }
            }
            let want = {
                let n = len(k, AttentionPass::Forward, AttentionBuffer::Out, &args);
                let dout: Vec<f32> = (0..n).map(|_| rng.normal_ish()).collect();
                let want = dense(k, &args, &x, &dout);
                x.insert(AttentionBuffer::OutGrad, dout);
                want
            };
            let fwd = run(k, AttentionPass::Forward, &args, &x);
            close(
                "out",
                &fwd[&AttentionBuffer::Out],
                &want[&AttentionBuffer::Out],
                1e-4,
            );
            close(
                "lse",
                &fwd[&AttentionBuffer::LogSumExp],
                &want[&AttentionBuffer::LogSumExp],
                1e-4,
            );
            x.extend(fwd);
            // Both backwards' passes in `ALL`'s order, which is each one's
            // launch order: two passes (dQ, then dK and dV) and one (δ, then
            // dK, dV and dQ's sum, then dQ from the sum).
            for pass in AttentionPass::ALL {
                if pass == AttentionPass::Forward || !k.runs(pass, [true; 4]) {
                    continue;
                }
                for (role, got) in run(k, pass, &args, &x) {
                    // dQ's sum is checked through the dQ made from it.
                    if role != AttentionBuffer::QGradSum {
                        close(&format!("{pass:?} {role:?}"), &got, &want[&role], 2e-4);
                    }
                    // Passes by key tiles read δ; the last one-pass, dQ's sum.
                    if matches!(role, AttentionBuffer::Delta | AttentionBuffer::QGradSum) {
                        x.insert(role, got);
                    }
                }
            }
            checked += 1;
        }
    }
    checked
}

#[test]
fn causal_backward_with_lengths_that_are_not_whole_tiles() {
    let g = common::zoo("tiny.dpl", "gpt_tiny").graph;
    assert_eq!(
        backward_matches_textbook(&g, &syms(&[("batch", 1), ("seq", 70)])),
        1
    );
}

#[test]
fn grouped_multi_query_and_windowed_backward() {
    for (file, model, n) in [
        ("tiny.dpl", "llama_tiny", 1),
        ("gemma.dpl", "gemma_tiny", 1),
        ("mistral.dpl", "mistral_tiny", 1),
    ] {
        let g = common::zoo(file, model).graph;
        assert_eq!(
            backward_matches_textbook(&g, &syms(&[("batch", 2), ("seq", 20)])),
            n,
            "{model}"
        );
    }
}

/// T5 as the zoo has it: dropout 0.1 on the probabilities (the mask drawn
/// again in every backward pass), the position bias's gradient summed over
/// the batch, cross-attention.
#[test]
fn biased_cross_attention_with_dropout_backward() {
    let g = common::zoo("t5.dpl", "t5_tiny").graph;
    assert_eq!(
        backward_matches_textbook(&g, &syms(&[("batch", 2), ("seq", 5)])),
        3
    );
}

/// DeepSeek's latent attention: the values' gradient lands in the slice of
/// the buffer they are read from, the rest stays zero.
#[test]
fn latent_attention_backward() {
    let text = std::fs::read_to_string(
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../models/deepseek.dpl"),
    )
    .unwrap();
    let g = common::lower_m(&format!("{text}\nmodel m = deepseek_tiny()\n"));
    assert_eq!(
        backward_matches_textbook(&g, &syms(&[("batch", 2), ("seq", 6)])),
        2
    );
}

/// The sequence's length of the mask tests: the values' width, so that
/// one-hot values read the probabilities off the output.
const SEQ: usize = 16;
const BATCH: usize = 2;
const HEADS: usize = 4;

/// One rank's place: piece `part` of `tp` of the heads, cp rank `rank` of
/// `cp`'s queries, in a sequence of `seq` positions.
#[derive(Clone, Copy, Debug)]
struct Place {
    part: usize,
    tp: usize,
    rank: usize,
    cp: usize,
    seq: usize,
}

impl Place {
    /// The rank's query positions in the whole sequence, in the order it holds them.
    fn positions(&self) -> Vec<usize> {
        match dplc_ir::context_chunks(self.seq, self.cp, self.rank) {
            Some([a, b]) if self.cp > 1 => a.chain(b).collect(),
            _ => (0..self.seq).collect(),
        }
    }
}

/// The rank's program of `model`, as the runtime makes it.
fn placed_program(model: &str, at: Place) -> Graph {
    common::placed_attention(model, at.tp as u64, at.cp as u64)
}

/// Launch arguments at the rank's place: its sizes, the key's words as the
/// executor sets them (per-sample counts of the whole tensor for a part).
fn placed_args(
    g: &Graph,
    sizes: &[dplc_ir::Dim],
    key_sizes: &[(usize, dplc_codegen::KeySize)],
    syms: &HashMap<String, i64>,
    at: Place,
) -> Args {
    // The executor's binding, at layer 3 of a micro-batch starting at sample 5.
    let key = dplc_codegen::KeyPlace {
        layer: 3,
        first_sample: 5,
        micro_batch: BATCH,
        cp_rank: at.rank,
        cp: at.cp,
        tp_rank: at.part,
        tp: at.tp,
    };
    let sizes = common::launch_sizes(g, sizes, key_sizes, syms, &key);
    Args {
        sizes,
        scalars: vec![],
        seed: 0x5eed,
    }
}

/// The output `[batch, heads, queries, values]` of the rank's part, row-major,
/// from the fused attention of its program of `model`: Q, K and V read
/// element `x(role, [batch, head, position, feature])` of the whole tensors,
/// at the rank's heads and query positions.
fn fused_output(
    model: &str,
    at: Place,
    x: &dyn Fn(AttentionBuffer, [usize; 4]) -> f32,
) -> Vec<f32> {
    let g = placed_program(model, at);
    let syms = syms(&[("batch", BATCH as i64), ("seq", at.seq as i64)]);
    let plan = fuse(&g, g.root());
    assert!(
        plan.unfused_attention.is_empty(),
        "{at:?}: {:?}",
        plan.unfused_attention
    );
    let fa = plan
        .steps
        .iter()
        .find_map(|s| match s {
            Step::Attention(a) => Some(a),
            _ => None,
        })
        .unwrap_or_else(|| panic!("{at:?}: no fused attention"));
    let k = &fa.kernel;
    assert!(k.causal, "{at:?}: {}", k.text());
    let args = placed_args(&g, &fa.sizes, &fa.key_sizes, &syms, at);
    let fwd = AttentionPass::Forward;
    let (heads, kv_heads) = (args.size(k.heads) as usize, args.size(k.kv_heads) as usize);
    let queries = args.size(k.q_len) as usize;
    let positions = at.positions();
    let (head_dim, value_dim) = (k.head_dim as usize, k.value_dim as usize);
    let mut inputs = HashMap::new();
    for (role, view, heads, rows, width) in [
        (AttentionBuffer::Q, &k.q, heads, queries, head_dim),
        (AttentionBuffer::K, &k.k, kv_heads, at.seq, head_dim),
        (AttentionBuffer::V, &k.v, kv_heads, at.seq, value_dim),
    ] {
        let mut buf = vec![0.0; len(k, fwd, role, &args)];
        let s = view.at.strides.map(|s| args.size(s) as usize);
        let offset = args.size(view.at.offset) as usize;
        for b in 0..BATCH {
            for h in 0..heads {
                for i in 0..rows {
                    // Queries are the rank's chunks; keys and values every position.
                    let p = if role == AttentionBuffer::Q {
                        positions[i]
                    } else {
                        i
                    };
                    for d in 0..width {
                        buf[offset + b * s[0] + h * s[1] + i * s[2] + d * s[3]] =
                            x(role, [b, at.part * heads + h, p, d]);
                    }
                }
            }
        }
        inputs.insert(role, buf);
    }
    let out = &run(k, fwd, &args, &inputs)[&AttentionBuffer::Out];
    let o = k.out.at.strides.map(|s| args.size(s) as usize);
    let offset = args.size(k.out.at.offset) as usize;
    let mut rows = Vec::new();
    for b in 0..BATCH {
        for h in 0..heads {
            for i in 0..queries {
                for d in 0..value_dim {
                    rows.push(out[offset + b * o[0] + h * o[1] + i * o[2] + d * o[3]]);
                }
            }
        }
    }
    rows
}

/// The dropped probabilities `[batch, heads, queries, keys]` of the rank's
/// part, row-major, from its fused attention (zero scores, one-hot values).
fn fused_mask(model: &str, at: Place) -> Vec<f32> {
    fused_output(model, at, &|role, [_, _, j, d]| {
        f32::from(u8::from(role == AttentionBuffer::V && j == d))
    })
}

/// The same from the unfused path: the program's kernels run in order on
/// zero inputs (so zero scores), up to the one that computes the dropout's
/// output, with the runtime's part of the relayouts that take the rank's
/// query chunks of a whole value (positions, the window term).
fn unfused_mask(model: &str, at: Place) -> Vec<f32> {
    use dplc_ir::TensorLayout::{Context, Replicated};
    let g = placed_program(model, at);
    let syms = syms(&[("batch", BATCH as i64), ("seq", at.seq as i64)]);
    let config = dplc_codegen::FuseConfig {
        cut: &[],
        attention: dplc_ir::AttentionKind::Unfused,
    };
    let plan = dplc_codegen::fuse_with(&g, g.root(), &config);
    let positions = at.positions();
    let rank_rows = |x: &[f32]| -> Vec<f32> {
        let row = x.len() / at.seq;
        positions
            .iter()
            .flat_map(|&p| x[p * row..(p + 1) * row].iter().copied())
            .collect()
    };
    let mut values: HashMap<dplc_ir::TensorId, Data> = HashMap::new();
    for step in &plan.steps {
        match step {
            Step::Extern { node, .. } => {
                let n = g.node(*node);
                let chunks = matches!(
                    n.op,
                    Op::Relayout {
                        from: Replicated,
                        to: Context { axis: 0 },
                        ..
                    }
                );
                let rows = match values.get(&n.inputs[0]) {
                    Some(Data::F32(x)) if chunks => Data::F32(rank_rows(x)),
                    Some(Data::I32(x)) if chunks => {
                        let x: Vec<f32> = x.iter().map(|&v| v as f32).collect();
                        Data::I32(rank_rows(&x).iter().map(|&v| v as i32).collect())
                    }
                    _ => continue,
                };
                values.insert(n.outputs[0], rows);
            }
            Step::Kernel(fk) => {
                let args = placed_args(&g, &fk.sizes, &fk.key_sizes, &syms, at);
                let mut bufs: Vec<Data> = fk
                    .buffers
                    .iter()
                    .zip(&fk.kernel.buffers)
                    .map(|(&t, b)| {
                        let n: usize = g
                            .tensor(t)
                            .shape
                            .dims()
                            .iter()
                            .map(|d| dim(d, &syms, &g))
                            .product();
                        match (b.output, values.get(&t)) {
                            (false, Some(x)) => x.clone(),
                            (false, None) if b.elem == dplc_codegen::Elem::I32 => {
                                Data::I32(vec![0; n])
                            }
                            _ => Data::F32(vec![0.0; n]),
                        }
                    })
                    .collect();
                dplc_codegen::interpret(&fk.kernel, &args, &mut bufs).unwrap();
                let dropout = fk
                    .nodes
                    .iter()
                    .find(|&&n| matches!(g.node(n).op, Op::Dropout { .. }))
                    .map(|&n| g.node(n).outputs[0]);
                for (&t, buf) in fk.buffers.iter().zip(bufs) {
                    if Some(t) == dropout {
                        return buf.f32().to_vec();
                    }
                    values.insert(t, buf);
                }
            }
            _ => {}
        }
    }
    panic!("{at:?}: no kernel draws the dropout")
}

/// The rank's rows of `whole` (`[batch, heads, positions, VALUES]` of the
/// serial run): its heads under tp, its query chunks under cp.
fn rank_part(whole: &[f32], at: Place) -> Vec<f64> {
    const VALUES: usize = 16;
    let heads = HEADS / at.tp;
    let mut want = Vec::new();
    for b in 0..BATCH {
        for h in at.part * heads..(at.part + 1) * heads {
            for &i in &at.positions() {
                let row = ((b * HEADS + h) * at.seq + i) * VALUES;
                want.extend(whole[row..row + VALUES].iter().map(|&x| f64::from(x)));
            }
        }
    }
    want
}

/// Every place of tp and cp 1 or 2 but the serial one, in `seq` positions.
fn places(seq: usize) -> impl Iterator<Item = Place> {
    [(2, 1), (1, 2), (2, 2)]
        .into_iter()
        .flat_map(move |(tp, cp)| {
            (0..tp).flat_map(move |part| {
                (0..cp).map(move |rank| Place {
                    part,
                    tp,
                    rank,
                    cp,
                    seq,
                })
            })
        })
}

/// The serial run's place in `seq` positions.
fn serial(seq: usize) -> Place {
    Place {
        part: 0,
        tp: 1,
        rank: 0,
        cp: 1,
        seq,
    }
}

/// A rank's part of the probabilities — its heads under tp, its query
/// chunks under cp, both — is dropped as the serial run drops those
/// elements: the fused attention's mask at each place equals the whole
/// attention's at the same element, and equals the unfused kernels' mask
/// of the same program.
#[test]
fn split_dropout_draws_the_whole_attentions_masks() {
    let whole = fused_mask(common::PLACED, serial(SEQ));
    let kept = whole.iter().filter(|&&x| x > 0.0).count();
    let seen = BATCH * HEADS * SEQ * (SEQ + 1) / 2;
    assert!(kept < seen && kept > seen * 3 / 4, "{kept} of {seen} kept");
    for at in places(SEQ) {
        let want = rank_part(&whole, at);
        close(
            &format!("fused {at:?}"),
            &fused_mask(common::PLACED, at),
            &want,
            1e-6,
        );
        close(
            &format!("unfused {at:?}"),
            &unfused_mask(common::PLACED, at),
            &want,
            1e-6,
        );
    }
}

/// A sliding window under cp: the rank's window term (the whole `[s, s]`
/// term sliced to its query chunks) fuses, and the kernel masks at the
/// queries' places in the whole sequence, across the two chunks. Its
/// dropped probabilities equal the serial attention's at the same elements
/// and the unfused kernels' of the same program; so does its output on
/// random inputs, also over sequences of several key tiles, where the
/// rank's query chunks fill whole tiles (256 positions: tiles skipped past
/// the window) and where a tile spans both chunks (200: none skipped there).
#[test]
fn a_ranks_window_masks_at_the_whole_sequences_places() {
    let model = common::PLACED_WINDOWED;
    let whole = fused_mask(model, serial(SEQ));
    let kept = whole.iter().filter(|&&x| x > 0.0).count();
    let seen: usize = BATCH * HEADS * (0..SEQ).map(|i| (i + 1).min(5)).sum::<usize>();
    assert!(kept < seen && kept > seen * 3 / 4, "{kept} of {seen} kept");
    for at in places(SEQ) {
        let want = rank_part(&whole, at);
        close(
            &format!("fused {at:?}"),
            &fused_mask(model, at),
            &want,
            1e-6,
        );
        close(
            &format!("unfused {at:?}"),
            &unfused_mask(model, at),
            &want,
            1e-6,
        );
    }
    let random = |role: AttentionBuffer, [b, h, i, d]: [usize; 4]| {
        let mut r = Rng((((role as usize * 7 + b) * 31 + h) * 1031 + i) as u64 * 1009 + d as u64);
        r.next();
        r.normal_ish()
    };
    for seq in [SEQ, 200, 256] {
        let whole = fused_output(model, serial(seq), &random);
        for at in places(seq).filter(|at| at.cp > 1) {
            let got = fused_output(model, at, &random);
            close(
                &format!("output {at:?}"),
                &got,
                &rank_part(&whole, at),
                1e-5,
            );
        }
    }
}

/// The two backwards' launch lists and what each pass binds: the one pass
/// reads the δ its own first pass writes and adds into dQ's `f32` sum, the
/// one buffer its caller must zero (never written whole), which the last
/// pass scales into dQ; `attention_backward` takes it for the tensor-core
/// storage types and keeps two passes in f32.
#[test]
fn the_one_pass_backward_launches_delta_grads_and_the_scaling_in_order() {
    use dplc_codegen::{attention_backward, AttentionBackward};
    use dplc_ir::DType;
    use AttentionBuffer as B;
    use AttentionPass as P;
    let g = common::zoo("tiny.dpl", "gpt_tiny").graph;
    let at = common::first_attention(&g);
    let k = &at.kernel;
    assert_eq!(
        k.passes(AttentionBackward::TwoPass),
        [P::Forward, P::QueryGrad, P::KeyValueGrad, P::BiasGrad]
    );
    assert_eq!(
        k.passes(AttentionBackward::OnePass),
        [
            P::Forward,
            P::Delta,
            P::Grads,
            P::QueryGradScale,
            P::BiasGrad
        ]
    );
    assert_eq!(
        attention_backward(k, DType::BF16),
        AttentionBackward::OnePass
    );
    assert_eq!(
        attention_backward(k, DType::F16),
        AttentionBackward::OnePass
    );
    assert_eq!(
        attention_backward(k, DType::F32),
        AttentionBackward::TwoPass
    );
    let outputs = |pass: P| -> Vec<B> {
        k.roles(pass)
            .into_iter()
            .zip(k.buffers(pass))
            .filter(|(_, b)| b.output)
            .map(|(r, _)| r)
            .collect()
    };
    assert_eq!(outputs(P::Delta), [B::Delta]);
    assert_eq!(outputs(P::Grads), [B::KGrad, B::VGrad, B::QGradSum]);
    assert_eq!(outputs(P::QueryGradScale), [B::QGrad]);
    assert!(k.roles(P::Grads).contains(&B::Delta));
    assert!(k.roles(P::QueryGradScale).contains(&B::QGradSum));
    let args = args_of(&g, &at, &syms(&[("batch", 2), ("seq", 20)]));
    let len = |pass: P, role: B| len(k, pass, role, &args);
    let sum = len(P::Grads, B::QGradSum);
    assert_eq!(sum, len(P::Delta, B::Delta) * k.head_dim as usize);
    assert!(!k.written_whole(B::QGradSum, &args, sum));
    assert!(k.written_whole(B::Delta, &args, len(P::Delta, B::Delta)));
    // Without Q's gradient no scaling; without K's and V's the one pass
    // still runs, for dQ's sum.
    assert!(!k.runs(P::QueryGradScale, [false, true, true, false]));
    assert!(k.runs(P::Grads, [true, false, false, false]));
    assert!(k.runs(P::Delta, [true, false, false, false]));
    assert!(!k.runs(P::Grads, [false, false, false, true]));
}

/// `DPLC_ATTENTION_TUNING`'s words: each pass's part one the GPU benchmark
/// times and the host emulation checks (a `VARIANTS` entry's) or the
/// launched; anything else, combinations of untested parts included, is
/// refused with what is accepted, and nothing panics.
#[test]
fn tunings_parse_to_the_checked_combinations_only() {
    use dplc_codegen::AttentionTuning;
    for (text, want) in [
        ("", ""),
        ("launched", ""),
        ("w8", "w8"),
        ("k8", "k8"),
        ("q4", "q4"),
        ("w8_k8", "w8_k8"),
        ("w8,q4", "w8_q4"),
        ("k8+w8", "w8_k8"),
    ] {
        let got = AttentionTuning::parse(text).unwrap_or_else(|e| panic!("{text}: {e}"));
        assert_eq!(got.describe(), want, "{text}");
    }
    for text in [
        "w16",
        "k8_q4",
        "q3",
        "x8",
        "w",
        "w-1",
        "é",
        "w8_é",
        "k99999999999",
    ] {
        let err = AttentionTuning::parse(text).expect_err(text);
        assert!(err.contains('`'), "{text}: {err}");
    }
}
