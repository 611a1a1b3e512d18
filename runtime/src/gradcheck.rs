//! Finite-difference checks of every VJP against its forward kernel: the
//! analytic gradient of `Σ r·op(x)` must match central differences.

use crate::kernels::{forward, DropoutKey, OpCtx};
use crate::rng;
use crate::tensor::{Data, Tensor};
use crate::vjp::backward;
use dplc_ir::{BinaryOp, DType, Op, Ratio, ReduceKind, UnaryOp};

fn rand(shape: &[usize], salt: u64, positive: bool) -> Tensor {
    let n = shape.iter().product();
    let v = (0..n)
        .map(|i| {
            let x = rng::normal(&[salt, i as u64]) as f32;
            if positive {
                x.abs() + 0.5
            } else {
                x
            }
        })
        .collect();
    Tensor::f32(shape.to_vec(), v)
}

fn ints(shape: &[usize], vals: Vec<i32>) -> Tensor {
    Tensor::i32(shape.to_vec(), vals)
}

const KEY: DropoutKey = DropoutKey {
    seed: 1,
    step: 2,
    node: 3,
    layer: 0,
    first_sample: 0,
    batch: 2,
    cp_rank: 0,
    cp: 1,
    tp_rank: 0,
    tp: 1,
};

/// Σ r·y over finite outputs, in f64 (masked −∞ entries are constants).
fn objective(op: &Op, ins: &[Tensor], out_shapes: &[Vec<usize>], r: &[f32]) -> f64 {
    let refs: Vec<&Tensor> = ins.iter().collect();
    let ctx = OpCtx {
        out_shapes,
        dropout: KEY,
        split: None,
    };
    let y = forward(op, &refs, &ctx).expect("forward runs");
    y[0].f()
        .unwrap()
        .iter()
        .zip(r)
        .filter(|(y, _)| y.is_finite())
        .map(|(&y, &r)| f64::from(y) * f64::from(r))
        .sum()
}

/// Compare analytic and numeric gradients of every float input of `op`.
fn check(name: &str, op: Op, ins: Vec<Tensor>, out_shapes: Vec<Vec<usize>>) {
    let refs: Vec<&Tensor> = ins.iter().collect();
    let ctx = OpCtx {
        out_shapes: &out_shapes,
        dropout: KEY,
        split: None,
    };
    let outs = forward(&op, &refs, &ctx).expect("forward runs");
    assert_eq!(outs[0].shape, out_shapes[0], "{name}: output shape");
    let r = rand(&outs[0].shape, 99, false);
    let need: Vec<bool> = ins.iter().map(Tensor::is_float).collect();
    let need = dplc_ir::differentiable_inputs(&op, ins.len())
        .iter()
        .zip(need)
        .map(|(&a, b)| a && b)
        .collect::<Vec<_>>();
    let orefs: Vec<&Tensor> = outs.iter().collect();
    let grads = backward(&op, &refs, &orefs, &r, &need, &ctx).expect("backward runs");
    let rv = r.f().unwrap().to_vec();
    let eps = 1e-2f32;
    for (i, g) in grads.iter().enumerate() {
        let Some(g) = g else { continue };
        let g = g.f().unwrap();
        for j in 0..ins[i].numel() {
            let shifted = |d: f32| {
                let mut ins2 = ins.clone();
                if let Data::F32(v) = &mut ins2[i].data {
                    v[j] += d;
                }
                objective(&op, &ins2, &out_shapes, &rv)
            };
            let numeric = (shifted(eps) - shifted(-eps)) / (2.0 * f64::from(eps));
            let analytic = f64::from(g[j]);
            let tol = 2e-3 * (1.0 + numeric.abs().max(analytic.abs()));
            assert!(
                (numeric - analytic).abs() < tol,
                "{name}: d/d input {i}[{j}]: analytic {analytic}, numeric {numeric}"
            );
        }
    }
}

#[test]
fn unary_ops() {
    for u in UnaryOp::ALL {
        let positive = matches!(
            u,
            UnaryOp::Log | UnaryOp::Sqrt | UnaryOp::Rsqrt | UnaryOp::Recip
        );
        let mut x = rand(&[3, 4], 1, positive);
        if u == UnaryOp::Relu {
            // Keep away from the kink, where the derivative is not defined.
            if let Data::F32(v) = &mut x.data {
                v.iter_mut().for_each(|a| *a += 0.1f32.copysign(*a));
            }
        }
        check(u.name(), Op::Unary(u), vec![x], vec![vec![3, 4]]);
    }
}

#[test]
fn binary_ops_reduce_broadcast_gradients() {
    for b in BinaryOp::ALL {
        let a = rand(&[2, 3, 4], 2, b == BinaryOp::Pow);
        let c = rand(&[3, 1], 3, b == BinaryOp::Div);
        check(b.name(), Op::Binary(b), vec![a, c], vec![vec![2, 3, 4]]);
    }
}

#[test]
fn matmul_with_batch_broadcast() {
    check(
        "matmul",
        Op::MatMul,
        vec![rand(&[2, 3, 4], 4, false), rand(&[4, 5], 5, false)],
        vec![vec![2, 3, 5]],
    );
    check(
        "matmul_b",
        Op::MatMul,
        vec![rand(&[2, 1, 3, 4], 6, false), rand(&[3, 4, 2], 7, false)],
        vec![vec![2, 3, 3, 2]],
    );
}

#[test]
fn layout_ops() {
    let x = || rand(&[2, 3, 4], 8, false);
    check(
        "cast",
        Op::Cast(DType::BF16),
        vec![x()],
        vec![vec![2, 3, 4]],
    );
    check(
        "transpose",
        Op::Transpose {
            perm: vec![2, 0, 1],
        },
        vec![x()],
        vec![vec![4, 2, 3]],
    );
    let shape = dplc_ir::Shape::from_consts(&[6, 4]);
    check(
        "reshape",
        Op::Reshape { shape },
        vec![x()],
        vec![vec![6, 4]],
    );
    let shape = dplc_ir::Shape::from_consts(&[2, 3, 4]);
    check(
        "expand",
        Op::Expand { shape },
        vec![rand(&[3, 1], 9, false)],
        vec![vec![2, 3, 4]],
    );
    check(
        "slice",
        Op::Slice {
            axis: 2,
            start: 1,
            len: 2,
        },
        vec![x()],
        vec![vec![2, 3, 2]],
    );
    check(
        "concat",
        Op::Concat { axis: 1 },
        vec![x(), rand(&[2, 2, 4], 10, false)],
        vec![vec![2, 5, 4]],
    );
    // A shift right by one (T5's decoder input), one left, and a pad that
    // grows one end and crops the other.
    for (before, after, shape) in [(1, -1, [2, 3, 4]), (-2, 2, [2, 3, 4]), (2, -1, [2, 4, 4])] {
        check(
            "pad",
            Op::Pad {
                axis: 1,
                before,
                after,
                value: 0.5,
            },
            vec![x()],
            vec![shape.to_vec()],
        );
    }
    for (axis, reverse) in [(1, false), (2, true)] {
        check(
            "cumsum",
            Op::CumSum { axis, reverse },
            vec![x()],
            vec![vec![2, 3, 4]],
        );
    }
}

#[test]
fn reductions_softmax_and_norms() {
    let x = || rand(&[2, 3, 4], 11, false);
    for kind in [ReduceKind::Sum, ReduceKind::Mean, ReduceKind::Max] {
        check(
            kind.name(),
            Op::Reduce {
                kind,
                axis: 1,
                keep_dim: false,
            },
            vec![x()],
            vec![vec![2, 4]],
        );
    }
    check(
        "softmax",
        Op::Softmax { axis: 1 },
        vec![x()],
        vec![vec![2, 3, 4]],
    );
    check(
        "log_softmax",
        Op::LogSoftmax { axis: 2 },
        vec![x()],
        vec![vec![2, 3, 4]],
    );
    let (w, b) = (rand(&[4], 12, false), rand(&[4], 13, false));
    check(
        "layernorm",
        Op::LayerNorm { eps: 1e-5 },
        vec![x(), w.clone(), b],
        vec![vec![2, 3, 4]],
    );
    check(
        "rmsnorm",
        Op::RmsNorm { eps: 1e-5 },
        vec![x(), w],
        vec![vec![2, 3, 4]],
    );
}

#[test]
fn masking_and_dropout() {
    check(
        "dropout",
        Op::Dropout {
            p: 0.3,
            context: None,
            split: None,
        },
        vec![rand(&[2, 3, 4], 14, false)],
        vec![vec![2, 3, 4]],
    );
    check(
        "causal_mask",
        Op::CausalMask,
        vec![rand(&[2, 3, 3], 15, false)],
        vec![vec![2, 3, 3]],
    );
    // A 0/1 condition broadcast over the rows, both sides broadcasting too.
    let cond = Tensor::f32(vec![1, 4], vec![1.0, 0.0, 0.0, 1.0]);
    check(
        "where",
        Op::Select,
        vec![cond, rand(&[3, 4], 18, false), rand(&[3, 1], 19, false)],
        vec![vec![3, 4]],
    );
}

#[test]
fn indexing_ops() {
    let idx = ints(&[2, 3], vec![0, 4, 4, 1, 2, 0]);
    check(
        "embedding",
        Op::Embedding,
        vec![rand(&[5, 3], 16, false), idx.clone()],
        vec![vec![2, 3, 3]],
    );
    let idx = ints(&[2, 3], vec![0, 4, 4, 1, 2, 0]);
    check(
        "take_along",
        Op::TakeAlong,
        vec![rand(&[2, 3, 5], 17, false), idx],
        vec![vec![2, 3]],
    );
    check(
        "topk",
        Op::TopK { k: 2 },
        vec![rand(&[3, 5], 18, false)],
        vec![vec![3, 2], vec![3, 2]],
    );
}

#[test]
fn moe_routing() {
    // 4 tokens, top-2 of 3 experts, capacity 2: expert 0 is chosen three times, so one choice drops.
    let idx = ints(&[4, 2], vec![0, 1, 0, 2, 1, 2, 0, 1]);
    let cf = Ratio::new(3, 4).expect("non-zero denominator");
    check(
        "moe_dispatch",
        Op::MoeDispatch {
            experts: 3,
            capacity_factor: cf,
        },
        vec![rand(&[4, 3], 19, false), idx.clone()],
        vec![vec![3, 2, 3]],
    );
    check(
        "moe_combine",
        Op::MoeCombine,
        vec![rand(&[3, 2, 3], 20, false), rand(&[4, 2], 21, false), idx],
        vec![vec![4, 3]],
    );
}
