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

/// The launch arguments of `at` at `syms`; the dropout key's words fixed.
fn args_of(g: &Graph, at: &FusedAttention, syms: &HashMap<String, i64>) -> Args {
    let mut sizes: Vec<i64> = at.sizes.iter().map(|d| dim(d, syms, g) as i64).collect();
    for (n, (i, _)) in at.key_sizes.iter().enumerate() {
        sizes[*i] = [3, 5, 7][n];
    }
    Args {
        sizes,
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
            for pass in [
                AttentionPass::QueryGrad,
                AttentionPass::KeyValueGrad,
                AttentionPass::BiasGrad,
            ] {
                if !k.runs(pass, [true; 4]) {
                    continue;
                }
                for (role, got) in run(k, pass, &args, &x) {
                    close(&format!("{role:?}"), &got, &want[&role], 2e-4);
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

const SEQ: usize = 16;
const BATCH: usize = 2;
const HEADS: usize = 4;

/// One rank's place: piece `part` of `tp` of the heads, cp rank `rank` of `cp`'s queries.
#[derive(Clone, Copy, Debug)]
struct Place {
    part: usize,
    tp: usize,
    rank: usize,
    cp: usize,
}

impl Place {
    /// The rank's query positions in the whole sequence, in the order it holds them.
    fn positions(&self) -> Vec<usize> {
        match dplc_ir::context_chunks(SEQ, self.cp, self.rank) {
            Some([a, b]) if self.cp > 1 => a.chain(b).collect(),
            _ => (0..SEQ).collect(),
        }
    }
}

/// The rank's program, as the runtime makes it.
fn placed_program(at: Place) -> Graph {
    common::placed_attention(at.tp as u64, at.cp as u64)
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
    use dplc_codegen::KeySize;
    let numel = |t: dplc_ir::TensorId| -> usize {
        g.tensor(t)
            .shape
            .dims()
            .iter()
            .map(|d| dim(d, syms, g))
            .product()
    };
    let mut sizes: Vec<i64> = sizes.iter().map(|d| dim(d, syms, g) as i64).collect();
    for &(i, key) in key_sizes {
        sizes[i] = match key {
            KeySize::Layer => 3,
            KeySize::FirstSample => 5,
            KeySize::PerSample(t) => (numel(t) / BATCH) as i64,
            KeySize::WholePerSample {
                tensor,
                split,
                context,
            } => {
                let tp = if split { at.tp } else { 1 };
                let cp = if context { at.cp } else { 1 };
                (numel(tensor) * tp * cp / BATCH) as i64
            }
            KeySize::ContextRank => at.rank as i64,
            KeySize::ContextRanks => at.cp as i64,
            KeySize::SplitPart => at.part as i64,
            KeySize::SplitParts => at.tp as i64,
        };
    }
    Args {
        sizes,
        scalars: vec![],
        seed: 0x5eed,
    }
}

/// The dropped probabilities `[batch, heads, queries, keys]` of the rank's
/// part, row-major, from its fused attention (zero scores, one-hot values).
fn fused_mask(at: Place) -> Vec<f32> {
    let g = placed_program(at);
    let syms = syms(&[("batch", BATCH as i64), ("seq", SEQ as i64)]);
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
    let mut x: HashMap<AttentionBuffer, Vec<f32>> = [AttentionBuffer::Q, AttentionBuffer::K]
        .into_iter()
        .map(|r| (r, vec![0.0; len(k, fwd, r, &args)]))
        .collect();
    let mut v = vec![0.0; len(k, fwd, AttentionBuffer::V, &args)];
    let s = k.v.at.strides.map(|s| args.size(s));
    let kv_heads = args.size(k.kv_heads);
    for b in 0..BATCH as i64 {
        for h in 0..kv_heads {
            for j in 0..SEQ as i64 {
                v[(args.size(k.v.at.offset) + b * s[0] + h * s[1] + j * s[2] + j * s[3])
                    as usize] = 1.0;
            }
        }
    }
    x.insert(AttentionBuffer::V, v);
    let out = &run(k, fwd, &args, &x)[&AttentionBuffer::Out];
    let (heads, queries) = (args.size(k.heads), args.size(k.q_len));
    let o = k.out.at.strides.map(|s| args.size(s));
    let mut mask = Vec::new();
    for b in 0..BATCH as i64 {
        for h in 0..heads {
            for i in 0..queries {
                for d in 0..SEQ as i64 {
                    mask.push(
                        out[(args.size(k.out.at.offset) + b * o[0] + h * o[1] + i * o[2] + d * o[3])
                            as usize],
                    );
                }
            }
        }
    }
    mask
}

/// The same from the unfused path: the fused kernel that computes the
/// dropout's output from zero scores (and the rank's query positions).
fn unfused_mask(at: Place) -> Vec<f32> {
    let g = placed_program(at);
    let syms = syms(&[("batch", BATCH as i64), ("seq", SEQ as i64)]);
    let config = dplc_codegen::FuseConfig {
        cut: &[],
        attention: dplc_ir::AttentionKind::Unfused,
    };
    let plan = dplc_codegen::fuse_with(&g, g.root(), &config);
    let (drop_out, fk) = plan
        .steps
        .iter()
        .find_map(|s| match s {
            Step::Kernel(k) => k.nodes.iter().find_map(|&n| match g.node(n).op {
                Op::Dropout { .. } => Some((g.node(n).outputs[0], k)),
                _ => None,
            }),
            _ => None,
        })
        .expect("a kernel draws the dropout");
    let args = placed_args(&g, &fk.sizes, &fk.key_sizes, &syms, at);
    let positions: Vec<i32> = at.positions().iter().map(|&p| p as i32).collect();
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
            let ints = |v: Vec<i32>| match b.elem {
                dplc_codegen::Elem::I32 => Data::I32(v),
                _ => Data::F32(v.iter().map(|&p| p as f32).collect()),
            };
            match (b.output, &g.producer(t).map(|p| &p.op)) {
                (true, _) => Data::F32(vec![]),
                // The sequence's positions, and the rank's part of them.
                (false, Some(Op::Iota { .. })) => ints((0..n as i32).collect()),
                (false, Some(Op::Relayout { .. })) => ints(positions.clone()),
                (false, _) => Data::F32(vec![0.0; n]),
            }
        })
        .collect();
    dplc_codegen::interpret(&fk.kernel, &args, &mut bufs).unwrap();
    let i = fk.buffers.iter().position(|&t| t == drop_out).unwrap();
    bufs[i].f32().to_vec()
}

/// A rank's part of the probabilities — its heads under tp, its query
/// chunks under cp, both — is dropped as the serial run drops those
/// elements: the fused attention's mask at each place equals the whole
/// attention's at the same element, and equals the unfused kernels' mask
/// of the same program.
#[test]
fn split_dropout_draws_the_whole_attentions_masks() {
    let whole = fused_mask(Place {
        part: 0,
        tp: 1,
        rank: 0,
        cp: 1,
    });
    let kept = whole.iter().filter(|&&x| x > 0.0).count();
    let seen = BATCH * HEADS * SEQ * (SEQ + 1) / 2;
    assert!(kept < seen && kept > seen * 3 / 4, "{kept} of {seen} kept");
    for (tp, cp) in [(2, 1), (1, 2), (2, 2)] {
        for part in 0..tp {
            for rank in 0..cp {
                let at = Place { part, tp, rank, cp };
                let positions = at.positions();
                let heads = HEADS / tp;
                let mut want = Vec::new();
                for b in 0..BATCH {
                    for h in part * heads..(part + 1) * heads {
                        for &i in &positions {
                            let row = ((b * HEADS + h) * SEQ + i) * SEQ;
                            want.extend_from_slice(&whole[row..row + SEQ]);
                        }
                    }
                }
                let want: Vec<f64> = want.iter().map(|&x| f64::from(x)).collect();
                close(&format!("fused {at:?}"), &fused_mask(at), &want, 1e-6);
                close(&format!("unfused {at:?}"), &unfused_mask(at), &want, 1e-6);
            }
        }
    }
}
