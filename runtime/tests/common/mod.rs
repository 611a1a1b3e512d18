//! A GPT built with the IR builder (tied embedding, pre-LN attention and MLP,
//! dropout, `repeat` over layers), shared by the runtime's integration tests.

#![allow(dead_code)]

use dplc_ir::*;

pub struct Gpt {
    pub vocab: i64,
    pub d: i64,
    pub heads: i64,
    pub layers: u64,
    pub ctx: i64,
    pub dropout: f64,
}

impl Default for Gpt {
    fn default() -> Self {
        Gpt {
            vocab: 32,
            d: 16,
            heads: 2,
            layers: 4,
            ctx: 8,
            dropout: 0.1,
        }
    }
}

impl Gpt {
    pub fn build(&self) -> Graph {
        let Gpt {
            vocab,
            d,
            heads,
            layers,
            ctx,
            dropout,
        } = *self;
        let mut g = Graph::new("gpt_test");
        let (b, s) = (g.intern_sym("batch"), g.intern_sym("seq"));
        let (b, s) = (Dim::sym(b), Dim::sym(s));
        let root = g.root();
        let top = g.root_scope();
        let bs = Shape(vec![b.clone(), s.clone()]);
        let tokens = g.add_input("tokens", DType::I32, bs.clone()).unwrap();
        let targets = g.add_input("targets", DType::I32, bs.clone()).unwrap();
        let normal = Init::Normal { std: 0.2 };
        let wte = g
            .add_param(
                root,
                top,
                "wte",
                DType::F32,
                Shape::from_consts(&[vocab, d]),
                normal,
            )
            .unwrap();
        let wpe = g
            .add_param(
                root,
                top,
                "wpe",
                DType::F32,
                Shape::from_consts(&[ctx, d]),
                normal,
            )
            .unwrap();
        let op = |g: &mut Graph, r: RegionId, op: Op, ins: &[TensorId]| {
            g.add_node1(r, top, op, ins).unwrap()
        };
        let te = op(&mut g, root, Op::Embedding, &[wte, tokens]);
        let pos = op(&mut g, root, Op::Iota { len: s.clone() }, &[]);
        let pe = op(&mut g, root, Op::Embedding, &[wpe, pos]);
        let h0 = op(&mut g, root, Op::Binary(BinaryOp::Add), &[te, pe]);
        let h0 = op(
            &mut g,
            root,
            Op::Dropout {
                p: dropout,
                context: None,
                split: None,
            },
            &[h0],
        );

        let body = g.add_region(root);
        let scope = g.add_scope(top, "layers", ScopeKind::Repeat { count: layers });
        let xs = Shape(vec![b.clone(), s.clone(), Dim::konst(d)]);
        let x = g.add_region_arg(body, DType::F32, xs.clone());
        let hd = d / heads;
        let param = |g: &mut Graph, name: &str, dims: &[i64], init: Init| {
            g.add_param(
                body,
                scope,
                name,
                DType::F32,
                Shape::from_consts(dims),
                init,
            )
            .unwrap()
        };
        let (w1, b1) = (
            param(&mut g, "ln1.w", &[d], Init::Ones),
            param(&mut g, "ln1.b", &[d], Init::Zeros),
        );
        // No qkv bias: the key bias has an exactly zero true gradient (softmax
        // ignores a shift shared by all keys), and Adam scales the rounding
        // noise in it to full-size steps, so it would only compare noise.
        let wqkv = param(&mut g, "qkv.w", &[d, 3 * d], normal);
        let wo = param(&mut g, "out.w", &[d, d], normal);
        let (w2, b2) = (
            param(&mut g, "ln2.w", &[d], Init::Ones),
            param(&mut g, "ln2.b", &[d], Init::Zeros),
        );
        let wfc = param(&mut g, "fc.w", &[d, 4 * d], normal);
        let wpr = param(&mut g, "proj.w", &[4 * d, d], normal);
        let bo = |g: &mut Graph, o: Op, ins: &[TensorId]| g.add_node1(body, scope, o, ins).unwrap();
        let ln1 = bo(&mut g, Op::LayerNorm { eps: 1e-5 }, &[x, w1, b1]);
        let qkv = bo(&mut g, Op::MatMul, &[ln1, wqkv]);
        let hs = Shape(vec![
            b.clone(),
            s.clone(),
            Dim::konst(heads),
            Dim::konst(hd),
        ]);
        let head = |g: &mut Graph, i: i64| {
            let part = bo(
                g,
                Op::Slice {
                    axis: 2,
                    start: i * d,
                    len: d,
                },
                &[qkv],
            );
            let part = bo(g, Op::Reshape { shape: hs.clone() }, &[part]);
            bo(
                g,
                Op::Transpose {
                    perm: vec![0, 2, 1, 3],
                },
                &[part],
            )
        };
        let (q, k, v) = (head(&mut g, 0), head(&mut g, 1), head(&mut g, 2));
        let kt = bo(
            &mut g,
            Op::Transpose {
                perm: vec![0, 1, 3, 2],
            },
            &[k],
        );
        let sc = bo(&mut g, Op::MatMul, &[q, kt]);
        let scale = bo(&mut g, Op::Constant(1.0 / (hd as f64).sqrt()), &[]);
        let sc = bo(&mut g, Op::Binary(BinaryOp::Mul), &[sc, scale]);
        let sc = bo(&mut g, Op::CausalMask, &[sc]);
        let p = bo(&mut g, Op::Softmax { axis: 3 }, &[sc]);
        let p = bo(
            &mut g,
            Op::Dropout {
                p: dropout,
                context: None,
                split: None,
            },
            &[p],
        );
        let c = bo(&mut g, Op::MatMul, &[p, v]);
        let c = bo(
            &mut g,
            Op::Transpose {
                perm: vec![0, 2, 1, 3],
            },
            &[c],
        );
        let c = bo(&mut g, Op::Reshape { shape: xs.clone() }, &[c]);
        let a = bo(&mut g, Op::MatMul, &[c, wo]);
        let x1 = bo(&mut g, Op::Binary(BinaryOp::Add), &[x, a]);
        let ln2 = bo(&mut g, Op::LayerNorm { eps: 1e-5 }, &[x1, w2, b2]);
        let fc = bo(&mut g, Op::MatMul, &[ln2, wfc]);
        let act = bo(&mut g, Op::Unary(UnaryOp::GeluTanh), &[fc]);
        let pr = bo(&mut g, Op::MatMul, &[act, wpr]);
        let pr = bo(
            &mut g,
            Op::Dropout {
                p: dropout,
                context: None,
                split: None,
            },
            &[pr],
        );
        let x2 = bo(&mut g, Op::Binary(BinaryOp::Add), &[x1, pr]);
        g.set_region_results(body, vec![x2]).unwrap();
        let h = g
            .add_node1(
                root,
                scope,
                Op::Repeat {
                    count: layers,
                    body,
                    carried: 1,
                },
                &[h0],
            )
            .unwrap();

        let lnf_w = g
            .add_param(
                root,
                top,
                "lnf.w",
                DType::F32,
                Shape::from_consts(&[d]),
                Init::Ones,
            )
            .unwrap();
        let lnf_b = g
            .add_param(
                root,
                top,
                "lnf.b",
                DType::F32,
                Shape::from_consts(&[d]),
                Init::Zeros,
            )
            .unwrap();
        let hf = op(
            &mut g,
            root,
            Op::LayerNorm { eps: 1e-5 },
            &[h, lnf_w, lnf_b],
        );
        let wt = op(&mut g, root, Op::Transpose { perm: vec![1, 0] }, &[wte]);
        let logits = op(&mut g, root, Op::MatMul, &[hf, wt]);
        let lp = op(&mut g, root, Op::LogSoftmax { axis: 2 }, &[logits]);
        let picked = op(&mut g, root, Op::TakeAlong, &[lp, targets]);
        let m = op(
            &mut g,
            root,
            Op::Reduce {
                kind: ReduceKind::Mean,
                axis: 1,
                keep_dim: false,
            },
            &[picked],
        );
        let m = op(
            &mut g,
            root,
            Op::Reduce {
                kind: ReduceKind::Mean,
                axis: 0,
                keep_dim: false,
            },
            &[m],
        );
        let loss = op(&mut g, root, Op::Unary(UnaryOp::Neg), &[m]);
        g.set_region_results(root, vec![loss]).unwrap();
        g
    }
}

pub fn spec(seq: u64, global_batch: u64) -> TrainSpec {
    TrainSpec {
        seq,
        global_batch,
        precision: Precision::Fp32,
        optimizer: Optimizer::AdamW {
            lr: 1e-2,
            beta1: 0.9,
            beta2: 0.95,
            eps: 1e-8,
            weight_decay: 0.1,
        },
        schedule: LrSchedule::WarmupCosine {
            warmup: 2,
            total: 20,
            min_ratio: 0.1,
        },
        grad_clip: Some(1.0),
        steps: None,
    }
}
