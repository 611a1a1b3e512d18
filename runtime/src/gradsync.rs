//! The data-parallel gradient reduction besides the plain all-reduce: a
//! parameter server's push and pull, and compressed all-reduces (bf16/fp16,
//! PowerSGD and top-k with error feedback), with the bytes each moves.
//!
//! Every exchange goes through the [`Communicator`]'s collectives, so it runs
//! on threads, processes (MPI, TCP) and host-staged GPU buffers alike, and
//! sums in group order: each rank ends with the same bits.

use crate::comm::{Communicator, Group};
use crate::error::{kernel_err, Result};
use crate::kernels::{gemm, Mat};
use crate::rng;
use dplc_ir::Compression;

/// Bytes this rank put on its link and took off it for the data-parallel
/// gradient reduction and the weights' return, counted at each collective
/// call as the textbook algorithm carries them: a ring all-reduce sends
/// `2(n−1)/n` of the buffer, a reduce sends the buffer to its root (which
/// takes `n−1` of them in), a broadcast's root sends `n−1` copies, an
/// all-gather sends this rank's piece to `n−1` peers. Top-k pairs count 8
/// bytes (a 4-byte index and an f32), as a real sparse all-gather sends them.
/// ZeRO's all-gathers of updated weights are not counted (nor does the
/// planner's `dp_link_bytes` count them); a parameter server's return of
/// the weights is. A compression's warm-up steps (plain or denser
/// all-reduces) are left out: the counts are of the steady state, which
/// is what the planner prices.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Traffic {
    pub sent: u64,
    pub received: u64,
    /// The steps whose bytes `sent` and `received` hold.
    pub steps: u64,
}

impl Traffic {
    pub(crate) fn all_reduce(&mut self, n: usize, bytes: usize) {
        if n > 1 {
            let b = (2 * (n - 1) * bytes / n) as u64;
            self.sent += b;
            self.received += b;
        }
    }

    /// A reduce-scatter (ZeRO-2 and 3): `(n−1)/n` of the buffer each way.
    pub(crate) fn reduce_scatter(&mut self, n: usize, bytes: usize) {
        if n > 1 {
            let b = ((n - 1) * bytes / n) as u64;
            self.sent += b;
            self.received += b;
        }
    }

    /// A reduce (`to_root`) or a broadcast (`!to_root`) of `bytes` with the root at `root`.
    pub(crate) fn star(&mut self, n: usize, root: bool, bytes: usize, to_root: bool) {
        if n <= 1 {
            return;
        }
        let (one, many) = (bytes as u64, ((n - 1) * bytes) as u64);
        match (root, to_root) {
            (true, true) => self.received += many,
            (false, true) => self.sent += one,
            (true, false) => self.sent += many,
            (false, false) => self.received += one,
        }
    }
}

/// Round to the nearest bfloat16 (ties to even), kept in an f32.
pub(crate) fn round_bf16(x: f32) -> f32 {
    if !x.is_finite() {
        return x;
    }
    let bits = x.to_bits();
    let rounded = bits.wrapping_add(0x7fff + ((bits >> 16) & 1)) & 0xffff_0000;
    f32::from_bits(rounded)
}

/// Round to the nearest IEEE half (ties to even, overflow to ±inf,
/// subnormals kept), kept in an f32.
pub(crate) fn round_fp16(x: f32) -> f32 {
    if !x.is_finite() || x == 0.0 {
        return x;
    }
    let a = x.abs();
    if a >= 65520.0 {
        return f32::INFINITY.copysign(x);
    }
    // Half has 10 fraction bits; below 2^-14 the spacing is fixed at 2^-24.
    let exp = a.log2().floor().max(-14.0);
    let ulp = (exp - 10.0).exp2();
    let q = a / ulp;
    let r = q.round_ties_even();
    (r * ulp).copysign(x)
}

/// A rank's error-feedback state for one gradient tensor: what compression
/// left out so far, and PowerSGD's warm-started right factor.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct Feedback {
    pub error: Vec<f32>,
    /// PowerSGD's `cols × rank` factor (empty for top-k and uncompressed tensors).
    pub q: Vec<f32>,
}

/// PowerSGD's `(rows, cols, rank)` for a gradient of `shape`, or `None`
/// where it goes uncompressed (the rule lives in ir, beside the planner's
/// price of it).
pub(crate) fn powersgd_dims(shape: &[usize], rank: usize) -> Option<(usize, usize, usize)> {
    let shape: Vec<u64> = shape.iter().map(|&d| d as u64).collect();
    dplc_ir::powersgd_factors(&shape, rank as u64)
        .map(|(r, c, k)| (r as usize, c as usize, k as usize))
}

fn sparsified(shape: &[usize]) -> bool {
    let shape: Vec<u64> = shape.iter().map(|&d| d as u64).collect();
    dplc_ir::topk_sparsifies(&shape)
}

/// PowerSGD's first right factor: the same on every rank (seeded by the key).
pub(crate) fn initial_q(seed: u64, key: (u64, u64), cols: usize, rank: usize) -> Vec<f32> {
    (0..cols * rank)
        .map(|j| rng::normal(&[seed, 0x9051, key.0, key.1, j as u64]) as f32)
        .collect()
}

/// `a · b` for row-major `a` (`r×k`, or `k×r` read transposed when `a_t`)
/// and `b` (`k×c`, or `c×k` read transposed when `b_t`): the runtime's
/// GEMM over strided views.
#[allow(clippy::too_many_arguments)]
fn matmul(a: &[f32], a_t: bool, b: &[f32], b_t: bool, r: usize, k: usize, c: usize) -> Vec<f32> {
    let view = |data, rows_stride, transposed| {
        let (rs, cs) = if transposed {
            (1, rows_stride)
        } else {
            (rows_stride, 1)
        };
        Mat {
            data,
            offset: 0,
            rs,
            cs,
        }
    };
    let mut out = vec![0.0f32; r * c];
    gemm(
        r,
        k,
        c,
        view(a, if a_t { r } else { k }, a_t),
        view(b, if b_t { k } else { c }, b_t),
        &mut out,
        0,
        0.0,
    );
    out
}

/// Orthonormalise the columns of `p` (`rows × r`) in place, by modified
/// Gram–Schmidt: deterministic, so every rank gets the same basis.
fn orthonormalize(p: &mut [f32], rows: usize, r: usize) {
    for j in 0..r {
        for i in 0..j {
            let dot: f64 = (0..rows)
                .map(|x| f64::from(p[x * r + i]) * f64::from(p[x * r + j]))
                .sum();
            for x in 0..rows {
                p[x * r + j] -= (dot as f32) * p[x * r + i];
            }
        }
        let norm = (0..rows)
            .map(|x| f64::from(p[x * r + j]).powi(2))
            .sum::<f64>()
            .sqrt();
        let inv = if norm > 1e-12 {
            (1.0 / norm) as f32
        } else {
            0.0
        };
        for x in 0..rows {
            p[x * r + j] *= inv;
        }
    }
}

/// One gradient tensor of a compressed reduction.
pub(crate) struct Tensor<'a> {
    pub grad: &'a mut Vec<f32>,
    pub shape: &'a [usize],
    /// Top-k's and PowerSGD's state (`None` for bf16/fp16, which keep none).
    pub feedback: Option<&'a mut Feedback>,
}

/// A tensor's error-feedback state, which top-k and PowerSGD need.
fn state<'a>(feedback: &'a mut Option<&mut Feedback>) -> Result<&'a mut Feedback> {
    feedback
        .as_deref_mut()
        .ok_or_else(|| kernel_err("compress", "a gradient without its error-feedback state"))
}

/// The compression one step runs: `compress` at `step` (0-based) of a run
/// whose compression warms up over `warmup` steps.
#[derive(Clone, Copy, Debug)]
pub(crate) struct CompressedStep {
    pub compress: Compression,
    pub step: u64,
    pub warmup: u64,
}

impl CompressedStep {
    /// Still in the warm-up, whose bytes are not the steady state's.
    pub fn warming_up(&self) -> bool {
        self.step < self.warmup && self.compress.has_feedback()
    }
}

/// Sum the group's gradients of `tensors` (this rank's contribution in
/// `grad`, the sum there afterwards) as `at.compress` sends them at `at.step`.
pub(crate) fn compressed_all_reduce(
    comm: &mut Communicator,
    group: &Group,
    at: CompressedStep,
    tensors: &mut [Tensor],
    traffic: &mut Traffic,
) -> Result<()> {
    let n = group.size();
    // PowerSGD's warm-up all-reduces plain gradients (PyTorch's
    // `start_powerSGD_iter`); the error stays zero and Q its seed.
    let compress = match at.compress {
        Compression::PowerSgd { .. } if at.warming_up() => Compression::None,
        c => c,
    };
    match compress {
        Compression::None => {
            let mut flat: Vec<f32> = tensors
                .iter()
                .flat_map(|t| t.grad.iter().copied())
                .collect();
            comm.all_reduce(group, &mut flat)?;
            traffic.all_reduce(n, flat.len() * 4);
            scatter_back(tensors, &flat);
        }
        Compression::Bf16 | Compression::Fp16 => {
            let round = if compress == Compression::Bf16 {
                round_bf16
            } else {
                round_fp16
            };
            // Each rank's contribution is what a 16-bit buffer holds; the
            // sum is taken in f32 (NCCL's bf16 all-reduce sums in bf16, so
            // this is the gentler of the two: it isolates the rounding of
            // what is sent).
            let mut flat: Vec<f32> = tensors
                .iter()
                .flat_map(|t| t.grad.iter().map(|&g| round(g)))
                .collect();
            comm.all_reduce(group, &mut flat)?;
            traffic.all_reduce(n, flat.len() * 2);
            scatter_back(tensors, &flat);
        }
        Compression::TopK { .. } => {
            let fraction = compress
                .topk_fraction_at(at.step, at.warmup)
                .expect("a top-k compression");
            topk(comm, group, fraction, tensors, traffic)?
        }
        Compression::PowerSgd { rank, .. } => {
            powersgd(comm, group, rank as usize, tensors, traffic)?
        }
    }
    Ok(())
}

/// Top-k with error feedback (Stich et al. 2018; Lin et al. 2018's
/// local accumulation): each rank adds its error to each matrix gradient,
/// keeps the `⌈fraction·numel⌉` largest magnitudes (ties by position),
/// all-gathers (index, value) pairs and sums them in rank order; the rest
/// becomes its error. Vectors go whole in one all-reduce, as DGC's
/// reference code leaves them (`param.dim() > 1` only).
fn topk(
    comm: &mut Communicator,
    group: &Group,
    fraction: f64,
    tensors: &mut [Tensor],
    traffic: &mut Traffic,
) -> Result<()> {
    let n = group.size();
    // (offset into the concatenated sparsified tensors, value), each
    // offset as two f32s of 20 bits (exact; a real implementation sends an int32).
    let mut pairs: Vec<f32> = Vec::new();
    let mut dense: Vec<f32> = Vec::new();
    let mut offset = 0usize;
    for t in tensors.iter_mut() {
        if !sparsified(t.shape) {
            dense.extend_from_slice(t.grad);
            continue;
        }
        let len = t.grad.len();
        let error = &state(&mut t.feedback)?.error;
        let v: Vec<f32> = t.grad.iter().zip(error).map(|(g, e)| g + e).collect();
        let k = ((len as f64 * fraction).ceil() as usize).clamp(1, len.max(1));
        let mut order: Vec<usize> = (0..len).collect();
        // The k largest magnitudes, ties by position (a total order: the
        // same set on every machine), by selection, not a sort; then in
        // position order, so the message is the same too.
        let by_size = |a: &usize, b: &usize| v[*b].abs().total_cmp(&v[*a].abs()).then(a.cmp(b));
        let k = k.min(len);
        if k < len {
            order.select_nth_unstable_by(k, by_size);
        }
        order.truncate(k);
        order.sort_unstable();
        let mut error = v.clone();
        for &i in &order {
            let at = offset + i;
            if at >= 1 << 40 {
                return Err(kernel_err("topk", "more than 2^40 gradient elements"));
            }
            pairs.push((at >> 20) as f32);
            pairs.push((at & 0xf_ffff) as f32);
            pairs.push(v[i]);
            error[i] = 0.0;
        }
        state(&mut t.feedback)?.error = error;
        offset += len;
    }
    let all = comm.all_gather(group, &pairs)?;
    let mine = pairs.len() / 3 * 8;
    traffic.sent += ((n - 1) * mine) as u64;
    traffic.received += all
        .iter()
        .enumerate()
        .filter(|(p, _)| group.ranks().get(*p) != Some(&comm.rank()))
        .map(|(_, piece)| (piece.len() / 3 * 8) as u64)
        .sum::<u64>();
    let mut sum = vec![0.0f32; offset];
    for piece in &all {
        for pair in piece.chunks_exact(3) {
            let at = ((pair[0] as usize) << 20) | pair[1] as usize;
            if let Some(s) = sum.get_mut(at) {
                *s += pair[2];
            }
        }
    }
    comm.all_reduce(group, &mut dense)?;
    traffic.all_reduce(n, dense.len() * 4);
    let (mut at_sparse, mut at_dense) = (0, 0);
    for t in tensors.iter_mut() {
        let len = t.grad.len();
        if sparsified(t.shape) {
            t.grad.copy_from_slice(&sum[at_sparse..at_sparse + len]);
            at_sparse += len;
        } else {
            t.grad.copy_from_slice(&dense[at_dense..at_dense + len]);
            at_dense += len;
        }
    }
    Ok(())
}

/// Copy a flat buffer back into the tensors' gradients, in order.
fn scatter_back(tensors: &mut [Tensor], flat: &[f32]) {
    let mut at = 0;
    for t in tensors.iter_mut() {
        let len = t.grad.len();
        t.grad.copy_from_slice(&flat[at..at + len]);
        at += len;
    }
}

/// PowerSGD (Vogels et al. 2019, PyTorch's `powerSGD_hook`): with
/// `M = g + e` per rank, the warm-started `Q` orthonormalised, `P = Σ M·Q`
/// (all-reduced), orthonormalised, `Q = Σ Mᵀ·P` (all-reduced), and the sum
/// taken as `P·Qᵀ`; `Q` warm starts the next step. A rank's gradient
/// already holds its `1/n` share of the mean (the loss is scaled by
/// `1/(replicas·micro-batches)`), so the all-reduced sum is the mean
/// gradient, `P·Qᵀ` approximates `Σ M`, and each rank's new error is
/// `M − P·Qᵀ/n` — PyTorch's `M − mean` on gradients it averages after the
/// sum. Vectors and matrices it would not shrink twofold go uncompressed
/// in a third all-reduce.
fn powersgd(
    comm: &mut Communicator,
    group: &Group,
    rank: usize,
    tensors: &mut [Tensor],
    traffic: &mut Traffic,
) -> Result<()> {
    let n = group.size();
    let dims: Vec<Option<(usize, usize, usize)>> = tensors
        .iter()
        .map(|t| powersgd_dims(t.shape, rank))
        .collect();
    let mut plain: Vec<f32> = Vec::new();
    let mut ms: Vec<Vec<f32>> = Vec::with_capacity(tensors.len());
    let mut ps: Vec<f32> = Vec::new();
    for (t, d) in tensors.iter_mut().zip(&dims) {
        match d {
            None => {
                plain.extend_from_slice(t.grad);
                ms.push(Vec::new());
            }
            Some((rows, cols, r)) => {
                let grad: &[f32] = t.grad;
                let fb = state(&mut t.feedback)?;
                let m: Vec<f32> = grad.iter().zip(&fb.error).map(|(g, e)| g + e).collect();
                // The last step's Q spans the right subspace but not with
                // orthonormal columns; PyTorch's hook and the authors' code
                // orthonormalise it before the power step, as here.
                orthonormalize(&mut fb.q, *cols, *r);
                ps.extend(matmul(&m, false, &fb.q, false, *rows, *cols, *r));
                ms.push(m);
            }
        }
    }
    comm.all_reduce(group, &mut ps)?;
    traffic.all_reduce(n, ps.len() * 4);
    let mut qs: Vec<f32> = Vec::new();
    let mut at = 0;
    for (m, d) in ms.iter().zip(&dims) {
        if let Some((rows, cols, r)) = *d {
            let p = &mut ps[at..at + rows * r];
            orthonormalize(p, rows, r);
            qs.extend(matmul(m, true, p, false, cols, rows, r));
            at += rows * r;
        }
    }
    // Mᵀ·P is cols×r row-major: the layout Q keeps.
    comm.all_reduce(group, &mut qs)?;
    traffic.all_reduce(n, qs.len() * 4);
    comm.all_reduce(group, &mut plain)?;
    traffic.all_reduce(n, plain.len() * 4);
    let (mut at_p, mut at_q, mut at_plain) = (0, 0, 0);
    let scale = 1.0 / n as f32;
    for ((t, m), d) in tensors.iter_mut().zip(ms).zip(&dims) {
        match *d {
            None => {
                let len = t.grad.len();
                t.grad.copy_from_slice(&plain[at_plain..at_plain + len]);
                at_plain += len;
            }
            Some((rows, cols, r)) => {
                let p = &ps[at_p..at_p + rows * r];
                let q = &qs[at_q..at_q + cols * r];
                // P·Qᵀ: rows×cols.
                let approx = matmul(p, false, q, true, rows, r, cols);
                let fb = state(&mut t.feedback)?;
                fb.error = m.iter().zip(&approx).map(|(x, a)| x - a * scale).collect();
                fb.q = q.to_vec();
                t.grad.copy_from_slice(&approx);
                at_p += rows * r;
                at_q += cols * r;
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bf16_and_fp16_round_to_their_grids() {
        assert_eq!(round_bf16(1.0), 1.0);
        // 1 + 2^-8 is halfway between bf16 neighbours 1 and 1 + 2^-7: ties to even.
        assert_eq!(round_bf16(1.0 + 2f32.powi(-8)), 1.0);
        assert_eq!(round_bf16(1.0 + 3.0 * 2f32.powi(-8)), 1.0 + 2f32.powi(-6));
        assert_eq!(round_fp16(1.0 + 2f32.powi(-11)), 1.0);
        assert_eq!(round_fp16(1.0 + 2f32.powi(-10)), 1.0 + 2f32.powi(-10));
        assert_eq!(round_fp16(70000.0), f32::INFINITY);
        assert_eq!(round_fp16(2f32.powi(-24)), 2f32.powi(-24));
    }

    #[test]
    fn orthonormal_columns() {
        let mut p = vec![1.0, 2.0, 3.0, 4.0, 5.0, 7.0];
        orthonormalize(&mut p, 3, 2);
        let dot = |i: usize, j: usize| (0..3).map(|x| p[x * 2 + i] * p[x * 2 + j]).sum::<f32>();
        assert!((dot(0, 0) - 1.0).abs() < 1e-6);
        assert!((dot(1, 1) - 1.0).abs() < 1e-6);
        assert!(dot(0, 1).abs() < 1e-6);
    }

    /// One rank, a rank-1 gradient `u·vᵀ`: one power step recovers it
    /// exactly (P ∝ u, Q = v·|u|), so nothing is left for the error; and
    /// top-k keeps the largest element and feeds the rest back.
    #[test]
    fn powersgd_recovers_a_rank_one_gradient_and_topk_feeds_back_the_rest() {
        let world = crate::comm::World::new(1, std::time::Duration::from_secs(5));
        let mut comm = world.communicator(0);
        let group = Group::new(vec![0]);
        let (u, v) = (
            [1.0f32, -2.0, 0.5, 3.0, 0.0, -1.0],
            [0.25f32, 1.0, -1.0, 2.0, 0.5, -0.5, 1.5, 0.0],
        );
        let g: Vec<f32> = u
            .iter()
            .flat_map(|a| v.iter().map(move |b| a * b))
            .collect();
        let shape = [6usize, 8];
        let mut grad = g.clone();
        let mut fb = Feedback {
            error: vec![0.0; 48],
            q: initial_q(7, (0, 0), 8, 1),
        };
        let mut traffic = Traffic::default();
        let step = |compress| CompressedStep {
            compress,
            step: 0,
            warmup: 0,
        };
        compressed_all_reduce(
            &mut comm,
            &group,
            step(Compression::PowerSgd {
                rank: 1,
                warmup: None,
            }),
            &mut [Tensor {
                grad: &mut grad,
                shape: &shape,
                feedback: Some(&mut fb),
            }],
            &mut traffic,
        )
        .unwrap();
        for (a, b) in grad.iter().zip(&g) {
            assert!((a - b).abs() < 1e-5, "{grad:?} vs {g:?}");
        }
        assert!(fb.error.iter().all(|e| e.abs() < 1e-5), "{:?}", fb.error);

        // A 2×2 matrix is sparsified; a vector beside it goes whole.
        let mut grad = vec![0.1f32, -3.0, 0.2, 1.0];
        let mut bias = vec![0.01f32, -0.02];
        let mut fb = Feedback {
            error: vec![0.0, 0.0, 0.0, 0.5],
            q: Vec::new(),
        };
        compressed_all_reduce(
            &mut comm,
            &group,
            step(Compression::TopK {
                per_million: 250_000,
                warmup: None,
            }),
            &mut [
                Tensor {
                    grad: &mut grad,
                    shape: &[2, 2],
                    feedback: Some(&mut fb),
                },
                Tensor {
                    grad: &mut bias,
                    shape: &[2],
                    feedback: None,
                },
            ],
            &mut traffic,
        )
        .unwrap();
        assert_eq!(grad, vec![0.0, -3.0, 0.0, 0.0]);
        assert_eq!(fb.error, vec![0.1, 0.0, 0.2, 1.5]);
        assert_eq!(bias, vec![0.01, -0.02]);
    }

    /// DGC's warm-up: the kept fraction falls from nearly dense to F over
    /// the warm-up steps; PowerSGD sends plain gradients until it ends.
    #[test]
    fn compression_warms_up() {
        let topk = Compression::TopK {
            per_million: 1_000,
            warmup: Some(2),
        };
        let at = |s| topk.topk_fraction_at(s, 2).unwrap();
        assert!((at(0) - 0.1).abs() < 1e-12 && (at(1) - 0.01).abs() < 1e-12);
        assert_eq!(at(2), 0.001);
        let psgd = Compression::PowerSgd {
            rank: 4,
            warmup: None,
        };
        let schedule = dplc_ir::LrSchedule::WarmupCosine {
            warmup: 10,
            total: 100,
            min_ratio: 0.1,
        };
        assert_eq!(psgd.warmup_steps(&schedule), 10);
        assert_eq!(topk.warmup_steps(&schedule), 2);
        assert_eq!(psgd.warmup_steps(&dplc_ir::LrSchedule::Constant), 0);
        let warming = CompressedStep {
            compress: psgd,
            step: 9,
            warmup: 10,
        };
        assert!(warming.warming_up());
        assert!(!CompressedStep {
            step: 10,
            ..warming
        }
        .warming_up());
    }

    #[test]
    fn powersgd_compresses_matrices_only() {
        assert_eq!(powersgd_dims(&[64], 4), None);
        assert_eq!(powersgd_dims(&[64, 256], 4), Some((64, 256, 4)));
        assert_eq!(powersgd_dims(&[4, 4], 4), None);
        // Factors must be at most half the matrix: 64×64 at rank 16 is not.
        assert_eq!(powersgd_dims(&[64, 64], 15), Some((64, 64, 15)));
        assert_eq!(powersgd_dims(&[64, 64], 16), None);
    }
}
