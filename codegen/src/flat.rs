//! Kernels over flat buffers that a training step needs besides the model's
//! own: adding gradients, converting between storage and `f32`, the per-row
//! sums of squares behind the global gradient norm, a long column sum's
//! first pass, and the group-order sum of a layout change's parts.
//!
//! They are ordinary kernel IR, so the CPU interpreter runs them and
//! `emit_cuda` generates them like every fused kernel: one executor drives
//! both.

use crate::kernel::{
    Buffer, Builder, Cond, Elem, Expr, Idx, Kernel, RowReduce, Size, Space, Store, ValueId,
};
use dplc_ir::BinaryOp;

pub(crate) fn flat(label: &str, elem: Elem, output: bool, len: Vec<Size>) -> Buffer {
    Buffer {
        label: label.to_string(),
        elem,
        output,
        len,
    }
}

/// A plain store of `value` at `index` of buffer `buf`.
pub(crate) fn store(buf: usize, index: Idx, value: ValueId) -> Store {
    Store {
        buf,
        index,
        value,
        accumulate: false,
    }
}

fn elem_tag(e: Elem) -> &'static str {
    match e {
        Elem::Float => "x",
        Elem::F32 => "f32",
        Elem::I32 => "i32",
    }
}

/// The element `i` of flat buffer `buf`.
pub(crate) fn load(k: &mut Builder, buf: usize) -> ValueId {
    k.push(Expr::Load {
        buf,
        index: Idx::Var(0),
    })
}

/// A kernel over `n0` elements of flat buffers: `buffers` are (label, element
/// type, output) in argument order, `values` computes each element from
/// [`load`]s and scalars, and `stores` writes (buffer, value) at index `i`.
pub(crate) fn elementwise(
    op: String,
    scalars: usize,
    buffers: &[(&str, Elem, bool)],
    values: Builder,
    stores: &[(usize, ValueId)],
) -> Kernel {
    let n = vec![Size::Param(0)];
    Kernel {
        op,
        sizes: 1,
        scalars,
        buffers: buffers
            .iter()
            .map(|&(label, elem, output)| flat(label, elem, output, n.clone()))
            .collect(),
        space: Space {
            outer: n,
            inner: None,
        },
        values: values.values,
        stores: stores
            .iter()
            .map(|&(buf, value)| Store {
                buf,
                index: Idx::Var(0),
                value,
                accumulate: false,
            })
            .collect(),
    }
}

/// `b0[i] = b1[i] + b2[i]` over `n0` elements. Each element is read before the
/// same thread writes it, so `b0` may be `b1` (an in-place add).
pub fn add_kernel(out: Elem, a: Elem, b: Elem) -> Kernel {
    let mut k = Builder::default();
    let x = load(&mut k, 1);
    let y = load(&mut k, 2);
    let s = k.binary(BinaryOp::Add, x, y);
    elementwise(
        format!("add_{}_{}_{}", elem_tag(out), elem_tag(a), elem_tag(b)),
        0,
        &[("out", out, true), ("a", a, false), ("b", b, false)],
        k,
        &[(0, s)],
    )
}

/// `b0[i] = b1[i]` over `n0` elements, converting between element types
/// (an `f32` master weight to its storage copy, a gradient to `f32`).
pub fn convert_kernel(to: Elem, from: Elem) -> Kernel {
    let mut k = Builder::default();
    let x = load(&mut k, 1);
    elementwise(
        format!("convert_{}_{}", elem_tag(to), elem_tag(from)),
        0,
        &[("out", to, true), ("in", from, false)],
        k,
        &[(0, x)],
    )
}

/// Row sums of squares of a flat buffer of `n2` elements read as `n0` rows of
/// `n1` (the last row padded with zeros): `b0[r] = Σ_c b1[r·n1 + c]²` in `f32`.
/// The caller adds the `n0` partial sums in `f64`.
pub fn sum_squares_kernel(elem: Elem) -> Kernel {
    let (rows, cols, len) = (Size::Param(0), Size::Param(1), Size::Param(2));
    let mut k = Builder::default();
    let at = Idx::add(Idx::mul(Idx::Var(0), Idx::Size(cols)), Idx::Inner);
    // Clamp the read into the buffer; the select zeroes the padding.
    let last = Idx::sub(Idx::Size(len), Idx::Const(1));
    let x = k.push(Expr::Load {
        buf: 1,
        index: Idx::min(at.clone(), last),
    });
    let xx = k.binary(BinaryOp::Mul, x, x);
    let zero = k.konst(0.0);
    let v = k.push(Expr::Select {
        cond: Cond::IdxLt(at, Idx::Size(len)),
        then: xx,
        otherwise: zero,
    });
    let s = k.reduce(RowReduce::Sum, v);
    Kernel {
        op: format!("sum_squares_{}", elem_tag(elem)),
        sizes: 3,
        scalars: 0,
        buffers: vec![
            flat("partial", Elem::F32, true, vec![rows]),
            flat("x", elem, false, vec![len]),
        ],
        space: Space {
            outer: vec![rows],
            inner: Some(cols),
        },
        values: k.values,
        stores: vec![Store {
            buf: 0,
            index: Idx::Var(0),
            value: s,
            accumulate: false,
        }],
    }
}

/// Rows of shares a block of [`column_chunk_kernel`] sums: a column sum over
/// more rows than this goes in two passes, so that a narrow gradient (a
/// bias of 768) over many rows (32,768 tokens) still spreads over every
/// multiprocessor — in one pass it has a block per 8 columns, 96 blocks
/// for 132 multiprocessors. Each of a `Columns` block's 128 groups of
/// threads walks 32 rows of a chunk, so its loads, not the block's sum of
/// the groups, bound the pass: chunks of 1,024 rows (8 a thread) took
/// 138 µs for a 32,768 × 768 sum on an H200, where one pass took 58 µs.
pub const COLUMN_CHUNK: i64 = 4096;

/// The chunks a column sum of `rows` rows takes its first pass in (`None`:
/// one pass). A function of the sizes alone, so the summation order, and
/// the bits, are every device's.
pub fn column_chunks(rows: i64) -> Option<i64> {
    (rows > COLUMN_CHUNK).then(|| (rows + COLUMN_CHUNK - 1) / COLUMN_CHUNK)
}

/// The first pass of a long column sum: `b1[s][c] = Σ_{j < n2} b0[s·n2 + j][c]`
/// over the rows that exist, `n0` rows of `n1` columns of `f32` shares in
/// `n3` chunks of `n2` rows; [`crate::column_sum_kernel`] then sums the chunks.
pub fn column_chunk_kernel() -> Kernel {
    let (rows, cols, chunk, chunks) = (
        Size::Param(0),
        Size::Param(1),
        Size::Param(2),
        Size::Param(3),
    );
    let mut b = Builder::default();
    let row = Idx::add(Idx::mul(Idx::Var(0), Idx::Size(chunk)), Idx::Inner);
    let last = Idx::sub(Idx::Size(rows), Idx::Const(1));
    // The last chunk's rows past the end read the last row and add nothing.
    let x = b.push(Expr::Load {
        buf: 0,
        index: Idx::add(
            Idx::mul(Idx::min(row.clone(), last), Idx::Size(cols)),
            Idx::Var(1),
        ),
    });
    let zero = b.konst(0.0);
    let v = b.push(Expr::Select {
        cond: Cond::IdxLt(row, Idx::Size(rows)),
        then: x,
        otherwise: zero,
    });
    let s = b.reduce(RowReduce::Sum, v);
    Kernel {
        op: "column_chunk".into(),
        sizes: 4,
        scalars: 0,
        buffers: vec![
            flat("shares", Elem::F32, false, vec![rows, cols]),
            flat("chunk_sums", Elem::F32, true, vec![chunks, cols]),
        ],
        space: Space {
            outer: vec![chunks, cols],
            inner: Some(chunk),
        },
        values: b.values,
        stores: vec![Store {
            buf: 1,
            index: Idx::add(Idx::mul(Idx::Var(0), Idx::Size(cols)), Idx::Var(1)),
            value: s,
            accumulate: false,
        }],
    }
}

/// `b0[i] = (((0 + b1[i]) + b2[i]) + …) + b{parts}[i]` over `n0` elements,
/// summed in `f32` and stored once as `elem`: the sum the CPU
/// communicator makes of a group's parts (from zero, in group order), so a
/// layout change's sum on the device has the reference's bits.
pub fn sum_parts_kernel(elem: Elem, parts: usize) -> Kernel {
    let mut k = Builder::default();
    let mut acc = k.konst(0.0);
    for i in 1..=parts {
        let x = load(&mut k, i);
        acc = k.binary(BinaryOp::Add, acc, x);
    }
    let labels: Vec<String> = (0..parts).map(|i| format!("part{i}")).collect();
    let mut buffers = vec![("out", elem, true)];
    buffers.extend(labels.iter().map(|l| (l.as_str(), elem, false)));
    elementwise(
        format!("sum_{parts}_parts_{}", elem_tag(elem)),
        0,
        &buffers,
        k,
        &[(0, acc)],
    )
}

/// Columns per row of [`sum_squares_kernel`].
pub const SUM_SQUARES_COLS: i64 = 4096;

#[cfg(test)]
mod tests {
    use super::*;
    use crate::interp::{interpret, Args, Data};

    #[test]
    fn add_convert_and_sum_squares_interpret() {
        let a: Vec<f32> = (0..10).map(|i| i as f32).collect();
        let b: Vec<f32> = (0..10).map(|i| 0.5 * i as f32).collect();
        let args = Args {
            sizes: vec![10],
            ..Args::default()
        };
        let mut bufs = vec![Data::F32(vec![]), Data::F32(a.clone()), Data::F32(b)];
        interpret(
            &add_kernel(Elem::F32, Elem::F32, Elem::Float),
            &args,
            &mut bufs,
        )
        .unwrap();
        assert_eq!(bufs[0].f32()[4], 6.0);

        let mut bufs = vec![Data::F32(vec![]), Data::F32(a.clone())];
        interpret(&convert_kernel(Elem::Float, Elem::F32), &args, &mut bufs).unwrap();
        assert_eq!(bufs[0].f32(), &a[..]);

        // 10 elements as 3 rows of 4: the last row has two padding zeros.
        let args = Args {
            sizes: vec![3, 4, 10],
            ..Args::default()
        };
        let mut bufs = vec![Data::F32(vec![]), Data::F32(a)];
        interpret(&sum_squares_kernel(Elem::Float), &args, &mut bufs).unwrap();
        assert_eq!(bufs[0].f32(), &[14.0, 126.0, 145.0]);
    }

    #[test]
    fn sum_parts_adds_from_zero_in_order() {
        // -0 + -0 is -0, but the communicator's sum starts from +0.
        let args = Args {
            sizes: vec![2],
            ..Args::default()
        };
        let mut bufs = vec![
            Data::F32(vec![]),
            Data::F32(vec![-0.0, 1e8]),
            Data::F32(vec![-0.0, 1.0]),
            Data::F32(vec![-0.0, -1e8]),
        ];
        interpret(&sum_parts_kernel(Elem::F32, 3), &args, &mut bufs).unwrap();
        let got = bufs[0].f32();
        assert_eq!(got[0].to_bits(), 0.0f32.to_bits());
        assert_eq!(got[1], (1e8f32 + 1.0) - 1e8);
    }
}
