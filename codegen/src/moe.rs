//! Kernels of mixture-of-experts routing (`dplc_ir::Op::TopK`,
//! `MoeDispatch`, `MoeCombine`) and their backwards, so that a fused MoE
//! layer keeps its tokens on the device. Routing itself — which slot of
//! which expert each of a token's `k` choices takes, first come first
//! served up to the capacity — is a running count over the choices in
//! order; the caller makes it from the choices (a few bytes a token) with
//! the reference's own function and hands the kernels two tables:
//! `slot_of[j]`, choice `j`'s slot `e·capacity + c` (−1 when dropped), and
//! `token_of[s]`, the choice slot `s` holds (−1 when empty). Every kernel
//! writes each element of its output once (no atomics), adding a token's
//! choices in the reference's order (from zero, choice by choice).
//!
//! Size arguments: `n0` the rows of the output, `n1` their width, and
//! per kernel below. `k`, the choices per token, is built in.

use crate::flat::{flat, store};
use crate::kernel::{
    Buffer, Builder, Cond, Elem, Expr, Idx, Kernel, RowReduce, Size, Space, Store,
};
use crate::ValueId;
use dplc_ir::BinaryOp;

const ROWS: Size = Size::Param(0);
const WIDTH: Size = Size::Param(1);
const OTHER: Size = Size::Param(2);

/// How a kernel walks its `[n0, n1]` space.
enum Walk {
    /// A point an element.
    Points,
    /// A row of `n1` a point, reduced along.
    Rows,
}
use Walk::{Points, Rows};

fn kernel(
    op: String,
    sizes: usize,
    walk: Walk,
    buffers: Vec<Buffer>,
    b: Builder,
    stores: Vec<Store>,
) -> Kernel {
    let space = match walk {
        Points => Space {
            outer: vec![ROWS, WIDTH],
            inner: None,
        },
        Rows => Space {
            outer: vec![ROWS],
            inner: Some(WIDTH),
        },
    };
    Kernel {
        op,
        sizes,
        scalars: 0,
        buffers,
        space,
        values: b.values,
        stores,
    }
}

/// `r · n1 + c` of a `[rows, n1]` buffer, at outer index `row`.
fn at(row: Idx, col: Idx) -> Idx {
    Idx::add(Idx::mul(row, Idx::Size(WIDTH)), col)
}

/// `then` where values `x` and `y` are equal, else `otherwise`.
fn if_equal(
    b: &mut Builder,
    (x, y): (ValueId, ValueId),
    then: ValueId,
    otherwise: ValueId,
) -> ValueId {
    let not_above = b.push(Expr::Select {
        cond: Cond::ValLt(y, x),
        then: otherwise,
        otherwise: then,
    });
    b.push(Expr::Select {
        cond: Cond::ValLt(x, y),
        then: otherwise,
        otherwise: not_above,
    })
}

/// `v` where table entry `slot` is a slot (not −1), else 0.
fn if_slot(b: &mut Builder, slot: &Idx, v: ValueId) -> ValueId {
    let zero = b.konst(0.0);
    b.push(Expr::Select {
        cond: Cond::IdxLt(slot.clone(), Idx::Const(0)),
        then: zero,
        otherwise: v,
    })
}

/// Each row's `k` largest values of `b0` (`[rows, n1]`) in descending
/// order into `b1` and their indices into `b2` (`[rows, k]`), equal values
/// by lower index first (the reference's stable sort; `+0` and `−0` count
/// as equal here, where the reference puts `+0` first).
pub fn moe_top_k_kernel(k: usize) -> Kernel {
    let mut b = Builder::default();
    let x = b.push(Expr::Load {
        buf: 0,
        index: at(Idx::Var(0), Idx::Inner),
    });
    let j = b.push(Expr::FromIndex(Idx::Inner));
    let minus_j = b.push(Expr::FromIndex(Idx::sub(Idx::Const(0), Idx::Inner)));
    let gone = b.konst(f64::NEG_INFINITY);
    let (zero, half, one) = (b.konst(0.0), b.konst(0.5), b.konst(1.0));
    let mut picked: Vec<ValueId> = Vec::with_capacity(k);
    let mut stores = Vec::with_capacity(2 * k);
    for r in 0..k {
        // The values not picked yet, and whether each is free (1) or not (0).
        let (mut left, mut free) = (x, one);
        for &a in &picked {
            left = if_equal(&mut b, (j, a), gone, left);
            free = if_equal(&mut b, (j, a), zero, free);
        }
        let m = b.reduce(RowReduce::Max, left);
        // The lowest free index holding the maximum: the largest −j.
        let holds = b.push(Expr::Select {
            cond: Cond::ValLt(left, m),
            then: gone,
            otherwise: minus_j,
        });
        let candidate = b.push(Expr::Select {
            cond: Cond::ValLt(free, half),
            then: gone,
            otherwise: holds,
        });
        let neg = b.reduce(RowReduce::Max, candidate);
        let a = b.binary(BinaryOp::Sub, zero, neg);
        picked.push(a);
        let out = Idx::add(
            Idx::mul(Idx::Var(0), Idx::Const(k as i64)),
            Idx::Const(r as i64),
        );
        stores.push(store(1, out.clone(), m));
        stores.push(store(2, out, a));
    }
    let kk = Size::Const(k as i64);
    kernel(
        format!("moe_top{k}"),
        2,
        Rows,
        vec![
            flat("x", Elem::Float, false, vec![ROWS, WIDTH]),
            flat("values", Elem::Float, true, vec![ROWS, kk]),
            flat("indices", Elem::I32, true, vec![ROWS, kk]),
        ],
        b,
        stores,
    )
}

/// The gradient of [`moe_top_k_kernel`]'s input (`[rows, n1]`): each row's
/// output gradients `b1` (`[rows, k]`) at their indices `b0`, zeros elsewhere.
pub fn moe_top_k_backward_kernel(k: usize) -> Kernel {
    let mut b = Builder::default();
    let j = b.push(Expr::FromIndex(Idx::Var(1)));
    let zero = b.konst(0.0);
    let mut acc = zero;
    for r in 0..k {
        let choice = Idx::add(
            Idx::mul(Idx::Var(0), Idx::Const(k as i64)),
            Idx::Const(r as i64),
        );
        let i = b.push(Expr::Load {
            buf: 0,
            index: choice.clone(),
        });
        let g = b.push(Expr::Load {
            buf: 1,
            index: choice,
        });
        let here = if_equal(&mut b, (i, j), g, zero);
        acc = b.binary(BinaryOp::Add, acc, here);
    }
    let kk = Size::Const(k as i64);
    kernel(
        format!("moe_top{k}_backward"),
        2,
        Points,
        vec![
            flat("indices", Elem::I32, false, vec![ROWS, kk]),
            flat("dvalues", Elem::Float, false, vec![ROWS, kk]),
            flat("dx", Elem::Float, true, vec![ROWS, WIDTH]),
        ],
        b,
        vec![store(2, at(Idx::Var(0), Idx::Var(1)), acc)],
    )
}

/// Tokens `b0` (`[n2, n1]`) into the experts' slots `b2` (`[n0, n1]`, `n0`
/// slots): slot `s` holds token `token_of[s] / k` (`b1`), or zeros.
pub fn moe_dispatch_kernel(k: usize) -> Kernel {
    let mut b = Builder::default();
    let choice = Idx::Load(1, Box::new(Idx::Var(0)));
    let token = Idx::Div(
        Box::new(Idx::max(choice.clone(), Idx::Const(0))),
        Box::new(Idx::Const(k as i64)),
    );
    let x = b.push(Expr::Load {
        buf: 0,
        index: at(token, Idx::Var(1)),
    });
    let v = if_slot(&mut b, &choice, x);
    kernel(
        format!("moe_dispatch{k}"),
        3,
        Points,
        vec![
            flat("x", Elem::Float, false, vec![OTHER, WIDTH]),
            flat("token_of", Elem::I32, false, vec![ROWS]),
            flat("slots", Elem::Float, true, vec![ROWS, WIDTH]),
        ],
        b,
        vec![store(2, at(Idx::Var(0), Idx::Var(1)), v)],
    )
}

/// The tokens' gradient `b2` (`[n0, n1]`, `n0` tokens) of
/// [`moe_dispatch_kernel`]: each token's slots' gradients `b1` (`[n2, n1]`)
/// summed over its `k` choices (`slot_of`, `b0`).
pub fn moe_dispatch_backward_kernel(k: usize) -> Kernel {
    let mut b = Builder::default();
    let mut acc = b.konst(0.0);
    for r in 0..k {
        let slot = Idx::Load(
            0,
            Box::new(Idx::add(
                Idx::mul(Idx::Var(0), Idx::Const(k as i64)),
                Idx::Const(r as i64),
            )),
        );
        let g = b.push(Expr::Load {
            buf: 1,
            index: at(Idx::max(slot.clone(), Idx::Const(0)), Idx::Var(1)),
        });
        let v = if_slot(&mut b, &slot, g);
        acc = b.binary(BinaryOp::Add, acc, v);
    }
    kernel(
        format!("moe_dispatch{k}_backward"),
        3,
        Points,
        vec![
            flat(
                "slot_of",
                Elem::I32,
                false,
                vec![ROWS, Size::Const(k as i64)],
            ),
            flat("dslots", Elem::Float, false, vec![OTHER, WIDTH]),
            flat("dx", Elem::Float, true, vec![ROWS, WIDTH]),
        ],
        b,
        vec![store(2, at(Idx::Var(0), Idx::Var(1)), acc)],
    )
}

/// The experts' outputs `b0` (`[n2, n1]`, `n2` slots) back to the tokens
/// `b3` (`[n0, n1]`): each token's slots weighted by its choices' weights
/// `b1` (`[n0, k]`) and summed over its choices (`slot_of`, `b2`).
pub fn moe_combine_kernel(k: usize) -> Kernel {
    let mut b = Builder::default();
    let mut acc = b.konst(0.0);
    for r in 0..k {
        let choice = Idx::add(
            Idx::mul(Idx::Var(0), Idx::Const(k as i64)),
            Idx::Const(r as i64),
        );
        let slot = Idx::Load(2, Box::new(choice.clone()));
        let y = b.push(Expr::Load {
            buf: 0,
            index: at(Idx::max(slot.clone(), Idx::Const(0)), Idx::Var(1)),
        });
        let w = b.push(Expr::Load {
            buf: 1,
            index: choice,
        });
        let wy = b.binary(BinaryOp::Mul, w, y);
        let v = if_slot(&mut b, &slot, wy);
        acc = b.binary(BinaryOp::Add, acc, v);
    }
    let kk = Size::Const(k as i64);
    kernel(
        format!("moe_combine{k}"),
        3,
        Points,
        vec![
            flat("y", Elem::Float, false, vec![OTHER, WIDTH]),
            flat("weights", Elem::Float, false, vec![ROWS, kk]),
            flat("slot_of", Elem::I32, false, vec![ROWS, kk]),
            flat("out", Elem::Float, true, vec![ROWS, WIDTH]),
        ],
        b,
        vec![store(3, at(Idx::Var(0), Idx::Var(1)), acc)],
    )
}

/// The experts' outputs' gradient `b3` (`[n0, n1]`, `n0` slots) of
/// [`moe_combine_kernel`]: slot `s` gets its choice's weight (`b1`) times
/// its token's output gradient (`b2`, `[n2, n1]`), or zeros when empty
/// (`token_of`, `b0`).
pub fn moe_combine_backward_kernel(k: usize) -> Kernel {
    let mut b = Builder::default();
    let choice = Idx::Load(0, Box::new(Idx::Var(0)));
    let held = Idx::max(choice.clone(), Idx::Const(0));
    let token = Idx::Div(Box::new(held.clone()), Box::new(Idx::Const(k as i64)));
    let w = b.push(Expr::Load {
        buf: 1,
        index: held,
    });
    let g = b.push(Expr::Load {
        buf: 2,
        index: at(token, Idx::Var(1)),
    });
    let zero = b.konst(0.0);
    // From zero, as the reference adds into zeros.
    let wg = b.binary(BinaryOp::Mul, w, g);
    let sum = b.binary(BinaryOp::Add, zero, wg);
    let v = if_slot(&mut b, &choice, sum);
    kernel(
        format!("moe_combine{k}_backward"),
        3,
        Points,
        vec![
            flat("token_of", Elem::I32, false, vec![ROWS]),
            flat(
                "weights",
                Elem::Float,
                false,
                vec![OTHER, Size::Const(k as i64)],
            ),
            flat("dout", Elem::Float, false, vec![OTHER, WIDTH]),
            flat("dy", Elem::Float, true, vec![ROWS, WIDTH]),
        ],
        b,
        vec![store(3, at(Idx::Var(0), Idx::Var(1)), v)],
    )
}

/// The weights' gradient `b3` (`[n0]`, one per choice) of
/// [`moe_combine_kernel`]: the dot product of the choice's token's output
/// gradient (`b1`, `[n3, n1]`, `n3` tokens) with its slot's expert output
/// (`b2`, `[n2, n1]`), or 0 when dropped (`slot_of`, `b0`). A row per choice.
pub fn moe_combine_weights_backward_kernel(k: usize) -> Kernel {
    let mut b = Builder::default();
    let slot = Idx::Load(0, Box::new(Idx::Var(0)));
    let token = Idx::Div(Box::new(Idx::Var(0)), Box::new(Idx::Const(k as i64)));
    let g = b.push(Expr::Load {
        buf: 1,
        index: at(token, Idx::Inner),
    });
    let y = b.push(Expr::Load {
        buf: 2,
        index: at(Idx::max(slot.clone(), Idx::Const(0)), Idx::Inner),
    });
    let gy = b.binary(BinaryOp::Mul, g, y);
    let dot = b.reduce(RowReduce::Sum, gy);
    let v = if_slot(&mut b, &slot, dot);
    kernel(
        format!("moe_combine{k}_weights_backward"),
        4,
        Rows,
        vec![
            flat("slot_of", Elem::I32, false, vec![ROWS]),
            flat("dout", Elem::Float, false, vec![Size::Param(3), WIDTH]),
            flat("y", Elem::Float, false, vec![OTHER, WIDTH]),
            flat("dweights", Elem::Float, true, vec![ROWS]),
        ],
        b,
        vec![store(3, Idx::Var(0), v)],
    )
}
