//! Kernels of the ops over a vocabulary split across the tensor-parallel
//! group (Megatron's vocabulary-parallel embedding and cross-entropy,
//! `dplc_ir::VocabOp`), each rank's part on its own device. A softmax over
//! the split axis is three steps: each row's statistics of this rank's
//! slice ([`vocab_row_stats_kernel`]), the group's combined by the caller
//! (8 bytes a row through the host, in group order, so every rank
//! normalises by the same bits), then [`vocab_normalize_kernel`]; its
//! backward likewise sums each row's part ([`vocab_row_sum_kernel`]), the
//! caller adds the group's, and [`vocab_normalize_backward_kernel`] finishes.
//! A pick or an embedding over the split axis is this rank's summand alone:
//! its entries where this rank holds the index, zeros elsewhere.
//!
//! Size arguments: `n0` rows, `n1` entries of this rank's slice, and for the
//! picks `n2`, the slice's first index in the whole vocabulary (`n3`: an
//! embedding's width). The math is `runtime/src/vocab.rs`'s, which the host
//! runs for the reference executor.

use crate::flat::{flat, store};
use crate::kernel::{Builder, Cond, Elem, Expr, Idx, Kernel, RowReduce, Size, Space, Store};
use crate::ValueId;
use dplc_ir::{BinaryOp, UnaryOp};

const ROWS: Size = Size::Param(0);
const N: Size = Size::Param(1);
const LO: Size = Size::Param(2);
const WIDTH: Size = Size::Param(3);

/// `r · n1 + j`: element `j` of row `r` of a `[rows, n1]` buffer.
fn at_row() -> Idx {
    Idx::add(Idx::mul(Idx::Var(0), Idx::Size(N)), Idx::Inner)
}

/// The kernel over `[rows, n1]`, a row a block.
fn rows_kernel(
    op: &str,
    buffers: Vec<crate::kernel::Buffer>,
    b: Builder,
    stores: Vec<Store>,
) -> Kernel {
    Kernel {
        op: op.into(),
        sizes: 2,
        scalars: 0,
        buffers,
        space: Space {
            outer: vec![ROWS],
            inner: Some(N),
        },
        values: b.values,
        stores,
    }
}

/// Each row's maximum and sum of exponentials relative to it, of this
/// rank's slice: `b1[2r] = max_j b0[r, j]`, `b1[2r + 1] = Σ_j exp(b0[r, j] − b1[2r])`.
pub fn vocab_row_stats_kernel() -> Kernel {
    let mut b = Builder::default();
    let x = b.push(Expr::Load {
        buf: 0,
        index: at_row(),
    });
    let m = b.reduce(RowReduce::Max, x);
    let d = b.binary(BinaryOp::Sub, x, m);
    let e = b.unary(UnaryOp::Exp, d);
    let s = b.reduce(RowReduce::Sum, e);
    let row = Idx::mul(Idx::Var(0), Idx::Const(2));
    rows_kernel(
        "vocab_row_stats",
        vec![
            flat("x", Elem::Float, false, vec![ROWS, N]),
            flat("stats", Elem::F32, true, vec![ROWS, Size::Const(2)]),
        ],
        b,
        vec![
            store(1, row.clone(), m),
            store(1, Idx::add(row, Idx::Const(1)), s),
        ],
    )
}

/// The slice normalised by the group's statistics `b1` (each row's maximum
/// and sum of exponentials over the whole vocabulary): `log` softmax
/// `x − max − ln sum`, else softmax `exp(x − max) / sum`.
pub fn vocab_normalize_kernel(log: bool) -> Kernel {
    let mut b = Builder::default();
    let x = b.push(Expr::Load {
        buf: 0,
        index: at_row(),
    });
    let row = Idx::mul(Idx::Var(0), Idx::Const(2));
    let m = b.push(Expr::Load {
        buf: 1,
        index: row.clone(),
    });
    let s = b.push(Expr::Load {
        buf: 1,
        index: Idx::add(row, Idx::Const(1)),
    });
    let d = b.binary(BinaryOp::Sub, x, m);
    let y = if log {
        let l = b.unary(UnaryOp::Log, s);
        b.binary(BinaryOp::Sub, d, l)
    } else {
        let e = b.unary(UnaryOp::Exp, d);
        b.binary(BinaryOp::Div, e, s)
    };
    rows_kernel(
        if log {
            "vocab_log_softmax"
        } else {
            "vocab_softmax"
        },
        vec![
            flat("x", Elem::Float, false, vec![ROWS, N]),
            flat("stats", Elem::F32, false, vec![ROWS, Size::Const(2)]),
            flat("y", Elem::Float, true, vec![ROWS, N]),
        ],
        b,
        vec![store(2, at_row(), y)],
    )
}

/// Each row's part of what the backward needs summed over the whole
/// vocabulary, from the output gradient `b0` and the output `b1`: `Σ g`
/// for a `log` softmax, else `Σ g·y`.
pub fn vocab_row_sum_kernel(log: bool) -> Kernel {
    let mut b = Builder::default();
    let g = b.push(Expr::Load {
        buf: 0,
        index: at_row(),
    });
    let v = if log {
        g
    } else {
        let y = b.push(Expr::Load {
            buf: 1,
            index: at_row(),
        });
        b.binary(BinaryOp::Mul, g, y)
    };
    let s = b.reduce(RowReduce::Sum, v);
    let mut buffers = vec![flat("dy", Elem::Float, false, vec![ROWS, N])];
    if !log {
        buffers.push(flat("y", Elem::Float, false, vec![ROWS, N]));
    }
    let out = buffers.len();
    buffers.push(flat("sums", Elem::F32, true, vec![ROWS]));
    rows_kernel(
        if log {
            "vocab_log_softmax_sums"
        } else {
            "vocab_softmax_sums"
        },
        buffers,
        b,
        vec![store(out, Idx::Var(0), s)],
    )
}

/// The slice's input gradient from the output gradient `b0`, the output
/// `b1` and the group's row sums `b2` ([`vocab_row_sum_kernel`]): `g −
/// exp(y)·s` for a `log` softmax, else `y·(g − s)`.
pub fn vocab_normalize_backward_kernel(log: bool) -> Kernel {
    let mut b = Builder::default();
    let g = b.push(Expr::Load {
        buf: 0,
        index: at_row(),
    });
    let y = b.push(Expr::Load {
        buf: 1,
        index: at_row(),
    });
    let s = b.push(Expr::Load {
        buf: 2,
        index: Idx::Var(0),
    });
    let dx = if log {
        let p = b.unary(UnaryOp::Exp, y);
        let ps = b.binary(BinaryOp::Mul, p, s);
        b.binary(BinaryOp::Sub, g, ps)
    } else {
        let d = b.binary(BinaryOp::Sub, g, s);
        b.binary(BinaryOp::Mul, y, d)
    };
    rows_kernel(
        if log {
            "vocab_log_softmax_backward"
        } else {
            "vocab_softmax_backward"
        },
        vec![
            flat("dy", Elem::Float, false, vec![ROWS, N]),
            flat("y", Elem::Float, false, vec![ROWS, N]),
            flat("sums", Elem::F32, false, vec![ROWS]),
            flat("dx", Elem::Float, true, vec![ROWS, N]),
        ],
        b,
        vec![store(3, at_row(), dx)],
    )
}

/// Index `id` (row `r`'s entry of the id buffer `ids`) relative to this
/// rank's slice, clamped into it, so that a read there stays in bounds.
fn clamped(ids: usize) -> (Idx, Idx) {
    let id = Idx::Load(ids, Box::new(Idx::Var(0)));
    let local = Idx::sub(id.clone(), Idx::Size(LO));
    let last = Idx::sub(Idx::Size(N), Idx::Const(1));
    (id, Idx::max(Idx::min(local, last), Idx::Const(0)))
}

/// `v` where this rank holds index `id` (`n2 ≤ id < n2 + n1`), else 0.
fn where_held(b: &mut Builder, id: &Idx, v: ValueId) -> ValueId {
    let zero = b.konst(0.0);
    let end = Idx::add(Idx::Size(LO), Idx::Size(N));
    let below_end = b.push(Expr::Select {
        cond: Cond::IdxLt(id.clone(), end),
        then: v,
        otherwise: zero,
    });
    b.push(Expr::Select {
        cond: Cond::IdxLt(id.clone(), Idx::Size(LO)),
        then: zero,
        otherwise: below_end,
    })
}

/// Row `r`'s entry at its id `b1[r]` of the slice `b0` (`[rows, n1]`) where
/// this rank holds it, else 0 (a summand over the group).
pub fn vocab_take_kernel() -> Kernel {
    let mut b = Builder::default();
    let (id, local) = clamped(1);
    let x = b.push(Expr::Load {
        buf: 0,
        index: Idx::add(Idx::mul(Idx::Var(0), Idx::Size(N)), local),
    });
    let v = where_held(&mut b, &id, x);
    Kernel {
        op: "vocab_take".into(),
        sizes: 3,
        scalars: 0,
        buffers: vec![
            flat("x", Elem::Float, false, vec![ROWS, N]),
            flat("ids", Elem::I32, false, vec![ROWS]),
            flat("y", Elem::Float, true, vec![ROWS]),
        ],
        space: Space {
            outer: vec![ROWS],
            inner: None,
        },
        values: b.values,
        stores: vec![store(2, Idx::Var(0), v)],
    }
}

/// The slice's gradient of [`vocab_take_kernel`]: row `r`'s output
/// gradient `b1[r]` at its id where this rank holds it, zeros elsewhere.
pub fn vocab_take_backward_kernel() -> Kernel {
    let mut b = Builder::default();
    let id = Idx::Load(0, Box::new(Idx::Var(0)));
    let local = Idx::sub(id, Idx::Size(LO));
    let g = b.push(Expr::Load {
        buf: 1,
        index: Idx::Var(0),
    });
    let zero = b.konst(0.0);
    // Neither before nor after the row's id: at it (never, for an id
    // another rank holds).
    let not_after = b.push(Expr::Select {
        cond: Cond::IdxLt(local.clone(), Idx::Inner),
        then: zero,
        otherwise: g,
    });
    let at = b.push(Expr::Select {
        cond: Cond::IdxLt(Idx::Inner, local),
        then: zero,
        otherwise: not_after,
    });
    Kernel {
        op: "vocab_take_backward".into(),
        sizes: 3,
        scalars: 0,
        buffers: vec![
            flat("ids", Elem::I32, false, vec![ROWS]),
            flat("dy", Elem::Float, false, vec![ROWS]),
            flat("dx", Elem::Float, true, vec![ROWS, N]),
        ],
        space: Space {
            outer: vec![ROWS],
            inner: Some(N),
        },
        values: b.values,
        stores: vec![store(2, at_row(), at)],
    }
}

/// `r · n3 + c` into a `[rows, n3]` buffer.
fn at_width(row: Idx) -> Idx {
    Idx::add(Idx::mul(row, Idx::Size(WIDTH)), Idx::Var(1))
}

/// Row `b1[r]` of the table slice `b0` (`[n1, n3]`) where this rank holds
/// it, else zeros (a summand over the group): `b2` is `[rows, n3]`.
pub fn vocab_embedding_kernel() -> Kernel {
    let mut b = Builder::default();
    let (id, local) = clamped(1);
    let x = b.push(Expr::Load {
        buf: 0,
        index: at_width(local),
    });
    let v = where_held(&mut b, &id, x);
    Kernel {
        op: "vocab_embedding".into(),
        sizes: 4,
        scalars: 0,
        buffers: vec![
            flat("table", Elem::Float, false, vec![N, WIDTH]),
            flat("ids", Elem::I32, false, vec![ROWS]),
            flat("y", Elem::Float, true, vec![ROWS, WIDTH]),
        ],
        space: Space {
            outer: vec![ROWS, WIDTH],
            inner: None,
        },
        values: b.values,
        stores: vec![store(2, at_width(Idx::Var(0)), v)],
    }
}

/// The table slice's gradient of [`vocab_embedding_kernel`], added into
/// `b2` (`f32`, zeroed by the caller): each row's output gradient where
/// this rank holds its id (zero added elsewhere, at a clamped row).
pub fn vocab_embedding_backward_kernel() -> Kernel {
    let mut b = Builder::default();
    let (id, local) = clamped(0);
    let g = b.push(Expr::Load {
        buf: 1,
        index: at_width(Idx::Var(0)),
    });
    let v = where_held(&mut b, &id, g);
    Kernel {
        op: "vocab_embedding_backward".into(),
        sizes: 4,
        scalars: 0,
        buffers: vec![
            flat("ids", Elem::I32, false, vec![ROWS]),
            flat("dy", Elem::Float, false, vec![ROWS, WIDTH]),
            flat("dtable", Elem::F32, true, vec![N, WIDTH]),
        ],
        space: Space {
            outer: vec![ROWS, WIDTH],
            inner: None,
        },
        values: b.values,
        stores: vec![Store {
            buf: 2,
            index: at_width(local),
            value: v,
            accumulate: true,
        }],
    }
}
