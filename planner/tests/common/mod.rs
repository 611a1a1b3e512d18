//! Megatron GPT models built with the IR builder, for the published-row tests
//! and the benchmark (the .dpl zoo says the same through the frontend).

#![allow(dead_code)]

use dplc_ir::*;

/// A Megatron GPT: learned positions, pre-LN layers with fused QKV, biases on
/// every linear, dropout 0.1, GELU MLP of width 4h, logits tied to the embedding.
#[derive(Clone, Copy, Debug)]
pub struct Gpt {
    pub hidden: i64,
    pub heads: i64,
    pub layers: u64,
    pub vocab: i64,
    pub ctx: i64,
}

pub const GPT_1_7B: Gpt = Gpt {
    hidden: 2304,
    heads: 24,
    layers: 24,
    vocab: 51200,
    ctx: 2048,
};
pub const GPT_22B: Gpt = Gpt {
    hidden: 6144,
    heads: 64,
    layers: 48,
    vocab: 51200,
    ctx: 2048,
};
pub const GPT_145_6B: Gpt = Gpt {
    hidden: 12288,
    heads: 96,
    layers: 80,
    vocab: 51200,
    ctx: 2048,
};
pub const GPT_175B: Gpt = Gpt {
    hidden: 12288,
    heads: 96,
    layers: 96,
    vocab: 51200,
    ctx: 2048,
};
pub const GPT_1T: Gpt = Gpt {
    hidden: 25600,
    heads: 160,
    layers: 128,
    vocab: 51200,
    ctx: 2048,
};

pub fn train(seq: u64, global_batch: u64) -> TrainSpec {
    TrainSpec {
        seq,
        global_batch,
        ..TrainSpec::default()
    }
}

pub fn gpt(name: &str, cfg: Gpt) -> Graph {
    gpt_with_dropout(name, cfg, 0.1)
}

/// The same GPT with dropout `p` (0: a model context parallelism can run).
pub fn gpt_with_dropout(name: &str, cfg: Gpt, p: f64) -> Graph {
    let dropout = p;
    let Gpt {
        hidden: h,
        heads,
        layers,
        vocab,
        ctx,
    } = cfg;
    let mut g = Graph::new(name);
    let (bs, ss) = (g.intern_sym("batch"), g.intern_sym("seq"));
    let (b, s) = (Dim::sym(bs), Dim::sym(ss));
    let root = g.root();
    let top = g.root_scope();
    let x_shape = Shape(vec![b.clone(), s.clone(), Dim::konst(h)]);
    let tok_shape = Shape(vec![b.clone(), s.clone()]);
    let tokens = g
        .add_input("tokens", DType::I32, tok_shape.clone())
        .unwrap();
    let targets = g.add_input("targets", DType::I32, tok_shape).unwrap();
    let p = |g: &mut Graph, r: RegionId, sc: ScopeId, name: &str, dims: &[i64]| {
        g.add_param(
            r,
            sc,
            name,
            DType::F32,
            Shape::from_consts(dims),
            Init::Zeros,
        )
        .unwrap()
    };
    let wte = p(&mut g, root, top, "wte", &[vocab, h]);
    let wpe = p(&mut g, root, top, "wpe", &[ctx, h]);
    let tok = g
        .add_node1(root, top, Op::Embedding, &[wte, tokens])
        .unwrap();
    let pos = g
        .add_node1(root, top, Op::Iota { len: s.clone() }, &[])
        .unwrap();
    let pos = g.add_node1(root, top, Op::Embedding, &[wpe, pos]).unwrap();
    let x = g
        .add_node1(root, top, Op::Binary(BinaryOp::Add), &[tok, pos])
        .unwrap();
    let x0 = g
        .add_node1(
            root,
            top,
            Op::Dropout {
                p: dropout,
                context: None,
                split: None,
            },
            &[x],
        )
        .unwrap();

    let body = g.add_region(root);
    let scope = g.add_scope(top, "layers", ScopeKind::Repeat { count: layers });
    let x = g.add_region_arg(body, DType::F32, x_shape.clone());
    let hd = h / heads;
    let (w1, b1) = (
        p(&mut g, body, scope, "ln1.w", &[h]),
        p(&mut g, body, scope, "ln1.b", &[h]),
    );
    let wqkv = p(&mut g, body, scope, "qkv.w", &[h, 3 * h]);
    let bqkv = p(&mut g, body, scope, "qkv.b", &[3 * h]);
    let wo = p(&mut g, body, scope, "proj.w", &[h, h]);
    let bo = p(&mut g, body, scope, "proj.b", &[h]);
    let (w2, b2) = (
        p(&mut g, body, scope, "ln2.w", &[h]),
        p(&mut g, body, scope, "ln2.b", &[h]),
    );
    let wfc = p(&mut g, body, scope, "fc1.w", &[h, 4 * h]);
    let bfc = p(&mut g, body, scope, "fc1.b", &[4 * h]);
    let wpr = p(&mut g, body, scope, "fc2.w", &[4 * h, h]);
    let bpr = p(&mut g, body, scope, "fc2.b", &[h]);
    let op = |g: &mut Graph, op: Op, ins: &[TensorId]| g.add_node1(body, scope, op, ins).unwrap();
    let add = BinaryOp::Add;

    let ln1 = op(&mut g, Op::LayerNorm { eps: 1e-5 }, &[x, w1, b1]);
    let qkv = op(&mut g, Op::MatMul, &[ln1, wqkv]);
    let qkv = op(&mut g, Op::Binary(add), &[qkv, bqkv]);
    // Megatron's fused QKV: the projection's columns are grouped by head
    // (`[heads, 3·hd]`), so the output is viewed per head first and q, k, v are
    // slices of each head's row. A column split of the weight then hands each
    // rank whole heads, which is why Megatron lays the weight out this way.
    let fused_shape = Shape(vec![
        b.clone(),
        s.clone(),
        Dim::konst(heads),
        Dim::konst(3 * hd),
    ]);
    let fused = op(&mut g, Op::Reshape { shape: fused_shape }, &[qkv]);
    let head = |g: &mut Graph, i: i64| {
        let part = op(
            g,
            Op::Slice {
                axis: 3,
                start: i * hd,
                len: hd,
            },
            &[fused],
        );
        op(
            g,
            Op::Transpose {
                perm: vec![0, 2, 1, 3],
            },
            &[part],
        )
    };
    let (q, k, v) = (head(&mut g, 0), head(&mut g, 1), head(&mut g, 2));
    let kt = op(
        &mut g,
        Op::Transpose {
            perm: vec![0, 1, 3, 2],
        },
        &[k],
    );
    let scores = op(&mut g, Op::MatMul, &[q, kt]);
    let scale = op(&mut g, Op::Constant(1.0 / (hd as f64).sqrt()), &[]);
    let scores = op(&mut g, Op::Binary(BinaryOp::Mul), &[scores, scale]);
    let scores = op(&mut g, Op::CausalMask, &[scores]);
    let probs = op(&mut g, Op::Softmax { axis: 3 }, &[scores]);
    let probs = op(
        &mut g,
        Op::Dropout {
            p: dropout,
            context: None,
            split: None,
        },
        &[probs],
    );
    let ctxv = op(&mut g, Op::MatMul, &[probs, v]);
    let ctxv = op(
        &mut g,
        Op::Transpose {
            perm: vec![0, 2, 1, 3],
        },
        &[ctxv],
    );
    let ctxv = op(
        &mut g,
        Op::Reshape {
            shape: x_shape.clone(),
        },
        &[ctxv],
    );
    let attn = op(&mut g, Op::MatMul, &[ctxv, wo]);
    let attn = op(&mut g, Op::Binary(add), &[attn, bo]);
    let attn = op(
        &mut g,
        Op::Dropout {
            p: dropout,
            context: None,
            split: None,
        },
        &[attn],
    );
    let x1 = op(&mut g, Op::Binary(add), &[x, attn]);
    let ln2 = op(&mut g, Op::LayerNorm { eps: 1e-5 }, &[x1, w2, b2]);
    let fc = op(&mut g, Op::MatMul, &[ln2, wfc]);
    let fc = op(&mut g, Op::Binary(add), &[fc, bfc]);
    let act = op(&mut g, Op::Unary(UnaryOp::GeluTanh), &[fc]);
    let pr = op(&mut g, Op::MatMul, &[act, wpr]);
    let pr = op(&mut g, Op::Binary(add), &[pr, bpr]);
    let pr = op(
        &mut g,
        Op::Dropout {
            p: dropout,
            context: None,
            split: None,
        },
        &[pr],
    );
    let x2 = op(&mut g, Op::Binary(add), &[x1, pr]);
    g.set_region_results(body, vec![x2]).unwrap();
    let out = g
        .add_node1(
            root,
            scope,
            Op::Repeat {
                count: layers,
                body,
                carried: 1,
            },
            &[x0],
        )
        .unwrap();

    let (wf, bf) = (
        p(&mut g, root, top, "ln_f.w", &[h]),
        p(&mut g, root, top, "ln_f.b", &[h]),
    );
    let r = |g: &mut Graph, op: Op, ins: &[TensorId]| g.add_node1(root, top, op, ins).unwrap();
    let hf = r(&mut g, Op::LayerNorm { eps: 1e-5 }, &[out, wf, bf]);
    let wt = r(&mut g, Op::Transpose { perm: vec![1, 0] }, &[wte]);
    let logits = r(&mut g, Op::MatMul, &[hf, wt]);
    let logp = r(&mut g, Op::LogSoftmax { axis: 2 }, &[logits]);
    let picked = r(&mut g, Op::TakeAlong, &[logp, targets]);
    let loss = r(
        &mut g,
        Op::Reduce {
            kind: ReduceKind::Mean,
            axis: 1,
            keep_dim: false,
        },
        &[picked],
    );
    let loss = r(
        &mut g,
        Op::Reduce {
            kind: ReduceKind::Mean,
            axis: 0,
            keep_dim: false,
        },
        &[loss],
    );
    let loss = r(&mut g, Op::Unary(UnaryOp::Neg), &[loss]);
    g.set_region_results(root, vec![loss]).unwrap();
    g
}
