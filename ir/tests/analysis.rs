//! The analyses on a GPT layer built with the builder API: the stored bytes
//! must come out as Korthikanti et al. 2022 count them, 34·s·b·h + 5·a·s²·b.

use dplc_ir::*;

struct Layer {
    g: Graph,
    body: RegionId,
}

/// A Megatron GPT layer (pre-LN, fused QKV, dropout 0.1) repeated `layers` times.
fn gpt_layer(h: i64, heads: i64, layers: u64) -> Layer {
    let mut g = Graph::new("gpt");
    let (b, s) = (g.intern_sym("batch"), g.intern_sym("seq"));
    let (b, s) = (Dim::sym(b), Dim::sym(s));
    let root = g.root();
    let top = g.root_scope();
    let x0 = g
        .add_input(
            "x",
            DType::F32,
            Shape(vec![b.clone(), s.clone(), Dim::konst(h)]),
        )
        .unwrap();
    let body = g.add_region(root);
    let scope = g.add_scope(top, "layers", ScopeKind::Repeat { count: layers });
    let x = g.add_region_arg(body, DType::F32, g.tensor(x0).shape.clone());
    let hd = h / heads;
    let param = |g: &mut Graph, name: &str, dims: &[i64]| {
        g.add_param(
            body,
            scope,
            name,
            DType::F32,
            Shape::from_consts(dims),
            Init::Zeros,
        )
        .unwrap()
    };
    let (w1, b1) = (param(&mut g, "ln1.w", &[h]), param(&mut g, "ln1.b", &[h]));
    let wqkv = param(&mut g, "qkv.w", &[h, 3 * h]);
    let bqkv = param(&mut g, "qkv.b", &[3 * h]);
    let wo = param(&mut g, "out.w", &[h, h]);
    let (w2, b2) = (param(&mut g, "ln2.w", &[h]), param(&mut g, "ln2.b", &[h]));
    let wfc = param(&mut g, "fc.w", &[h, 4 * h]);
    let wpr = param(&mut g, "proj.w", &[4 * h, h]);
    let op = |g: &mut Graph, op: Op, ins: &[TensorId]| g.add_node1(body, scope, op, ins).unwrap();

    let ln1 = op(&mut g, Op::LayerNorm { eps: 1e-5 }, &[x, w1, b1]);
    let qkv = op(&mut g, Op::MatMul, &[ln1, wqkv]);
    let qkv = op(&mut g, Op::Binary(BinaryOp::Add), &[qkv, bqkv]);
    let heads_shape = Shape(vec![
        b.clone(),
        s.clone(),
        Dim::konst(heads),
        Dim::konst(hd),
    ]);
    let head = |g: &mut Graph, i: i64| {
        let part = op(
            g,
            Op::Slice {
                axis: 2,
                start: i * h,
                len: h,
            },
            &[qkv],
        );
        let part = op(
            g,
            Op::Reshape {
                shape: heads_shape.clone(),
            },
            &[part],
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
            p: 0.1,
            context: None,
            split: None,
        },
        &[probs],
    );
    let ctx = op(&mut g, Op::MatMul, &[probs, v]);
    let ctx = op(
        &mut g,
        Op::Transpose {
            perm: vec![0, 2, 1, 3],
        },
        &[ctx],
    );
    let x_shape = g.tensor(x).shape.clone();
    let ctx = op(&mut g, Op::Reshape { shape: x_shape }, &[ctx]);
    let attn = op(&mut g, Op::MatMul, &[ctx, wo]);
    let attn = op(
        &mut g,
        Op::Dropout {
            p: 0.1,
            context: None,
            split: None,
        },
        &[attn],
    );
    let x1 = op(&mut g, Op::Binary(BinaryOp::Add), &[x, attn]);
    let ln2 = op(&mut g, Op::LayerNorm { eps: 1e-5 }, &[x1, w2, b2]);
    let fc = op(&mut g, Op::MatMul, &[ln2, wfc]);
    let act = op(&mut g, Op::Unary(UnaryOp::GeluTanh), &[fc]);
    let pr = op(&mut g, Op::MatMul, &[act, wpr]);
    let pr = op(
        &mut g,
        Op::Dropout {
            p: 0.1,
            context: None,
            split: None,
        },
        &[pr],
    );
    let x2 = op(&mut g, Op::Binary(BinaryOp::Add), &[x1, pr]);
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
    g.set_region_results(root, vec![out]).unwrap();
    Layer { g, body }
}

#[test]
fn stored_activations_match_korthikanti() {
    let (h, a) = (1024i64, 16i64);
    let Layer { g, body } = gpt_layer(h, a, 24);
    let an = Analysis::new(&g);
    let bytes = an.activations(body).bytes(Precision::Bf16);
    let (bsz, s) = (2.0, 512.0);
    let bind = |sym: SymId| {
        if g.sym_names()[sym.index()] == "batch" {
            bsz
        } else {
            s
        }
    };
    let got = bytes.eval(&bind);
    let (hf, af) = (h as f64, a as f64);
    // Exactly: the norms' row statistics (which the fused kernels keep, a
    // few bytes a row) are not counted, as Korthikanti et al. do not count
    // them.
    let expected = s * bsz * hf * 34.0 + 5.0 * af * s * s * bsz;
    assert_eq!(
        got,
        expected,
        "stored bytes {}",
        bytes.display(g.sym_names())
    );
}

#[test]
fn flops_and_params_count_every_iteration() {
    let (h, a, l) = (1024i64, 16i64, 24u64);
    let Layer { g, .. } = gpt_layer(h, a, l);
    let an = Analysis::new(&g);
    assert_eq!(g.param_count(), l as u128 * (12 * h * h + 7 * h) as u128);
    let bind = |sym: SymId| {
        if g.sym_names()[sym.index()] == "batch" {
            1.0
        } else {
            2048.0
        }
    };
    let per_token = an.forward_flops().eval(&bind) / 2048.0;
    let (hf, sf) = (h as f64, 2048.0);
    // Megatron: 24·h² per token for the dense matmuls, 4·s·h for attention, per layer.
    assert_eq!(per_token, l as f64 * (24.0 * hf * hf + 4.0 * sf * hf));
    assert_eq!(
        an.attention_flops().eval(&bind) / sf,
        l as f64 * 4.0 * sf * hf
    );
    assert_eq!(an.layers(), 24);
}

#[test]
fn printer_keeps_the_repeat_body_once() {
    let Layer { g, .. } = gpt_layer(64, 4, 1000);
    let text = print_graph(&g);
    assert!(
        text.starts_with("model gpt (49600000 params)\n  syms batch, seq\n"),
        "{text}"
    );
    assert_eq!(text.matches("param layers.qkv.w").count(), 1);
    assert!(text.contains("repeat[count=1000, carried=1](%0)"), "{text}");
    assert!(text.contains("softmax[axis=3]"), "{text}");
}

#[test]
fn builder_rejects_mismatched_shapes_with_both_shapes() {
    let mut g = Graph::new("m");
    let s = g.intern_sym("seq");
    let root = g.root();
    let scope = g.root_scope();
    let x = g
        .add_input("x", DType::F32, Shape(vec![Dim::sym(s), Dim::konst(8)]))
        .unwrap();
    let w = g
        .add_param(
            root,
            scope,
            "w",
            DType::F32,
            Shape::from_consts(&[4, 2]),
            Init::Zeros,
        )
        .unwrap();
    let err = g.add_node1(root, scope, Op::MatMul, &[x, w]).unwrap_err();
    assert_eq!(
        err.to_string(),
        "matmul: shapes do not fit: [seq, 8] × [4, 2]: inner dimensions 8 and 4 differ"
    );
    let err = g.add_param(
        root,
        scope,
        "w",
        DType::F32,
        Shape::from_consts(&[1]),
        Init::Ones,
    );
    assert_eq!(err.unwrap_err(), IrError::DuplicateParam("w".into()));
}
