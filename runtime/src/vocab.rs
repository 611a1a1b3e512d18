//! Vocabulary parallelism: the ops that read the axis they index or
//! normalise split over the tensor-parallel group (Megatron's
//! vocabulary-parallel embedding and cross-entropy), forward and backward.
//!
//! Each rank holds the `p`-th of `tp` equal slices of the vocabulary. An
//! embedding or a pick along the split axis yields a summand (this rank's
//! rows, zeros for the ids other ranks hold); a softmax gathers every rank's
//! per-row maximum and sum of exponentials and combines them in group order,
//! so every rank normalises by the same bits. Both executors call these: the
//! interpreter for a node whose layout [`dplc_ir::NodeLayout::vocab_op`]
//! names, the fused compute for a local program's [`dplc_ir::Op::VocabParallel`].

use crate::comm::Communicator;
use crate::error::{kernel_err, Result};
use crate::kernels::check_index;
use crate::shard::MeshGroups;
use crate::tensor::Tensor;
use dplc_ir::VocabOp;

/// This rank's slice of a split axis of local length `n`: its first index
/// and the length of the whole axis.
pub(crate) fn slice(comm: &Communicator, groups: &MeshGroups, n: usize) -> (usize, usize) {
    let p = groups.tp.position(comm.rank()).unwrap_or(0);
    (p * n, n * groups.tp.size())
}

/// `i` as an index into this rank's slice `[lo, lo + n)` of an axis of
/// `whole`; `None` where another rank holds it. An id outside the whole
/// axis is an error, as it is unsplit.
fn local(op: &'static str, i: i32, lo: usize, n: usize, whole: usize) -> Result<Option<usize>> {
    let i = check_index(op, i, whole)?;
    Ok((lo..lo + n).contains(&i).then(|| i - lo))
}

/// `(outer, n, inner)` of `shape` around `axis`.
fn around(shape: &[usize], axis: usize) -> Result<(usize, usize, usize)> {
    let n = *shape
        .get(axis)
        .ok_or_else(|| kernel_err("vocab_parallel", format!("no axis {axis}")))?;
    Ok((
        shape[..axis].iter().product(),
        n,
        shape[axis + 1..].iter().product(),
    ))
}

/// The whole axis's row maximum and sum of exponentials (relative to it),
/// from every rank's: `(max, sum)` per row, the same bits on every rank.
fn row_stats(
    comm: &mut Communicator,
    groups: &MeshGroups,
    xs: &[f32],
    (outer, n, inner): (usize, usize, usize),
) -> Result<Vec<(f32, f32)>> {
    let rows = outer * inner;
    let idx = |r: usize, j: usize| ((r / inner) * n + j) * inner + r % inner;
    let mut mine = Vec::with_capacity(2 * rows);
    for r in 0..rows {
        let max = (0..n)
            .map(|j| xs[idx(r, j)])
            .fold(f32::NEG_INFINITY, f32::max);
        let sum: f32 = (0..n).map(|j| (xs[idx(r, j)] - max).exp()).sum();
        mine.extend([max, sum]);
    }
    let all = combine_row_stats(comm, groups, &mine)?;
    Ok(all.chunks(2).map(|p| (p[0], p[1])).collect())
}

/// The group's row statistics from this rank's `mine` (per row its slice's
/// maximum and sum of exponentials relative to it, interleaved): the whole
/// axis's, interleaved likewise, combined in group order so that every
/// rank has the same bits. The fused compute's device path computes `mine`
/// by a kernel and combines here, as the host path does.
pub(crate) fn combine_row_stats(
    comm: &mut Communicator,
    groups: &MeshGroups,
    mine: &[f32],
) -> Result<Vec<f32>> {
    let rows = mine.len() / 2;
    let all = comm.all_gather(&groups.tp, mine)?;
    let mut out = Vec::with_capacity(2 * rows);
    for r in 0..rows {
        let max = all
            .iter()
            .map(|s| s[2 * r])
            .fold(f32::NEG_INFINITY, f32::max);
        let sum: f32 = all
            .iter()
            .map(|s| s[2 * r + 1] * (s[2 * r] - max).exp())
            .sum();
        out.extend([max, sum]);
    }
    Ok(out)
}

/// Per row of `(outer, n, inner)`, the sum over the whole axis of `f(j)`.
fn row_sums(
    comm: &mut Communicator,
    groups: &MeshGroups,
    (outer, n, inner): (usize, usize, usize),
    f: impl Fn(usize) -> f32,
) -> Result<Vec<f32>> {
    let rows = outer * inner;
    let mut sums: Vec<f32> = (0..rows)
        .map(|r| {
            (0..n)
                .map(|j| f(((r / inner) * n + j) * inner + r % inner))
                .sum()
        })
        .collect();
    comm.all_reduce(&groups.tp, &mut sums)?;
    Ok(sums)
}

/// `op`'s outputs from its inputs, each at this rank's share.
pub(crate) fn forward(
    comm: &mut Communicator,
    groups: &MeshGroups,
    op: VocabOp,
    ins: &[&Tensor],
) -> Result<Vec<Tensor>> {
    let x = ins
        .first()
        .ok_or_else(|| kernel_err("vocab_parallel", "no input"))?;
    match op {
        VocabOp::Embedding => {
            let (table, ids) = (x.f()?, ins[1].i()?);
            let (n, d) = (x.shape[0], x.shape[1]);
            let (lo, whole) = slice(comm, groups, n);
            let mut out = vec![0.0f32; ids.len() * d];
            for (o, &i) in out.chunks_mut(d).zip(ids) {
                if let Some(r) = local("embedding", i, lo, n, whole)? {
                    o.copy_from_slice(&table[r * d..(r + 1) * d]);
                }
            }
            let mut shape = ins[1].shape.clone();
            shape.push(d);
            Ok(vec![Tensor::f32(shape, out)])
        }
        VocabOp::TakeAlong => {
            let (xs, ids) = (x.f()?, ins[1].i()?);
            let n = *x.shape.last().expect("take_along input has an axis");
            let (lo, whole) = slice(comm, groups, n);
            let out = ids
                .iter()
                .enumerate()
                .map(|(r, &i)| {
                    Ok(local("take_along", i, lo, n, whole)?.map_or(0.0, |j| xs[r * n + j]))
                })
                .collect::<Result<_>>()?;
            Ok(vec![Tensor::f32(ins[1].shape.clone(), out)])
        }
        VocabOp::Softmax { axis } | VocabOp::LogSoftmax { axis } => {
            let log = matches!(op, VocabOp::LogSoftmax { .. });
            let xs = x.f()?;
            let dims = around(&x.shape, axis)?;
            let (_, n, inner) = dims;
            let stats = row_stats(comm, groups, xs, dims)?;
            let out = xs
                .iter()
                .enumerate()
                .map(|(k, &v)| {
                    let (max, sum) = stats[(k / (n * inner)) * inner + k % inner];
                    if log {
                        (v - max) - sum.ln()
                    } else {
                        (v - max).exp() / sum
                    }
                })
                .collect();
            Ok(vec![Tensor::f32(x.shape.clone(), out)])
        }
    }
}

/// The gradients of `op`'s inputs where `need` asks (only the first can
/// have one) from its inputs, outputs and output gradient, each at this
/// rank's share.
pub(crate) fn backward(
    comm: &mut Communicator,
    groups: &MeshGroups,
    op: VocabOp,
    (ins, outs): (&[&Tensor], &[&Tensor]),
    gout: &Tensor,
    need: &[bool],
) -> Result<Vec<Option<Tensor>>> {
    let mut grads = vec![None; ins.len()];
    if !need.first().copied().unwrap_or(false) {
        return Ok(grads);
    }
    let x = ins
        .first()
        .ok_or_else(|| kernel_err("vocab_parallel", "no input"))?;
    let g = gout.f()?;
    let dx = match op {
        VocabOp::Embedding => {
            let ids = ins[1].i()?;
            let (n, d) = (x.shape[0], x.shape[1]);
            let (lo, whole) = slice(comm, groups, n);
            let mut dt = vec![0.0f32; n * d];
            for (r, &i) in ids.iter().enumerate() {
                if let Some(row) = local("embedding", i, lo, n, whole)? {
                    for (t, &v) in dt[row * d..][..d].iter_mut().zip(&g[r * d..][..d]) {
                        *t += v;
                    }
                }
            }
            dt
        }
        VocabOp::TakeAlong => {
            let ids = ins[1].i()?;
            let n = *x.shape.last().expect("take_along input has an axis");
            let (lo, whole) = slice(comm, groups, n);
            let mut dx = vec![0.0f32; x.numel()];
            for (r, (&i, &gv)) in ids.iter().zip(g).enumerate() {
                if let Some(j) = local("take_along", i, lo, n, whole)? {
                    dx[r * n + j] += gv;
                }
            }
            dx
        }
        VocabOp::Softmax { axis } | VocabOp::LogSoftmax { axis } => {
            let ys = outs
                .first()
                .ok_or_else(|| kernel_err("vocab_parallel", "no output"))?
                .f()?;
            let dims = around(&x.shape, axis)?;
            let (_, n, inner) = dims;
            let row = |k: usize| (k / (n * inner)) * inner + k % inner;
            if matches!(op, VocabOp::LogSoftmax { .. }) {
                let sums = row_sums(comm, groups, dims, |k| g[k])?;
                (0..g.len())
                    .map(|k| g[k] - ys[k].exp() * sums[row(k)])
                    .collect()
            } else {
                let dots = row_sums(comm, groups, dims, |k| g[k] * ys[k])?;
                (0..g.len())
                    .map(|k| ys[k] * (g[k] - dots[row(k)]))
                    .collect()
            }
        }
    };
    grads[0] = Some(Tensor::f32(x.shape.clone(), dx));
    Ok(grads)
}
