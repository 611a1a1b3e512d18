//! Dense row-major CPU tensors (f32 values or i32 indices) and the strided
//! gather/scatter that every layout op (transpose, broadcast, slice) reduces to.

use crate::error::{kernel_err, Result};

/// The elements of a tensor. Float tensors of every IR float type are held in
/// f32: the CPU reference computes in f32 whatever the plan's precision says.
#[derive(Clone, Debug, PartialEq)]
pub enum Data {
    F32(Vec<f32>),
    I32(Vec<i32>),
}

/// A dense tensor in row-major order.
#[derive(Clone, Debug, PartialEq)]
pub struct Tensor {
    pub shape: Vec<usize>,
    pub data: Data,
}

impl Tensor {
    pub fn f32(shape: Vec<usize>, data: Vec<f32>) -> Tensor {
        debug_assert_eq!(shape.iter().product::<usize>(), data.len());
        Tensor {
            shape,
            data: Data::F32(data),
        }
    }

    pub fn i32(shape: Vec<usize>, data: Vec<i32>) -> Tensor {
        debug_assert_eq!(shape.iter().product::<usize>(), data.len());
        Tensor {
            shape,
            data: Data::I32(data),
        }
    }

    pub fn zeros(shape: &[usize]) -> Tensor {
        Tensor::f32(shape.to_vec(), vec![0.0; shape.iter().product()])
    }

    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }

    pub fn is_float(&self) -> bool {
        matches!(self.data, Data::F32(_))
    }

    /// The float elements; an index tensor here is a graph the checker let through wrongly.
    pub fn f(&self) -> Result<&[f32]> {
        match &self.data {
            Data::F32(v) => Ok(v),
            Data::I32(_) => Err(kernel_err("tensor", "expected f32 values, found i32")),
        }
    }

    pub fn i(&self) -> Result<&[i32]> {
        match &self.data {
            Data::I32(v) => Ok(v),
            Data::F32(_) => Err(kernel_err("tensor", "expected i32 indices, found f32")),
        }
    }

    pub fn into_f(self) -> Result<Vec<f32>> {
        match self.data {
            Data::F32(v) => Ok(v),
            Data::I32(_) => Err(kernel_err("tensor", "expected f32 values, found i32")),
        }
    }

    /// Same elements under a new shape with the same element count.
    pub fn reshaped(mut self, shape: Vec<usize>) -> Tensor {
        debug_assert_eq!(shape.iter().product::<usize>(), self.numel());
        self.shape = shape;
        self
    }
}

pub fn strides(shape: &[usize]) -> Vec<usize> {
    let mut s = vec![1; shape.len()];
    for i in (0..shape.len().saturating_sub(1)).rev() {
        s[i] = s[i + 1] * shape[i + 1];
    }
    s
}

/// A row-major walk over `shape` that reads `N` operands, each through its
/// own strides, one innermost run at a time. Neighbouring axes that every
/// operand reads contiguously are merged first, so a bias add walks rows of
/// `d`, an add of equal shapes one run of everything, and a transpose that
/// keeps the last axis whole rows: the inner loops see plain slices and
/// vectorise, and no per-element index list is ever built.
pub struct Walk<const N: usize> {
    /// The merged outer axes (the innermost axis is `len`), outermost first.
    outer: Vec<(usize, [usize; N])>,
    /// Elements in one innermost run, and each operand's stride within it.
    len: usize,
    step: [usize; N],
    total: usize,
}

impl<const N: usize> Walk<N> {
    pub fn new(shape: &[usize], strides: [&[usize]; N]) -> Walk<N> {
        let total = shape.iter().product();
        // Innermost first; axes of one element do not move any operand.
        let mut axes: Vec<(usize, [usize; N])> = Vec::with_capacity(shape.len());
        for a in (0..shape.len()).rev() {
            if shape[a] == 1 {
                continue;
            }
            let st: [usize; N] = std::array::from_fn(|i| strides[i][a]);
            match axes.last_mut() {
                Some((n, inner)) if (0..N).all(|i| st[i] == inner[i] * *n) => *n *= shape[a],
                _ => axes.push((shape[a], st)),
            }
        }
        let (len, step) = axes.first().copied().unwrap_or((1, [0; N]));
        let outer = axes.into_iter().skip(1).rev().collect();
        Walk {
            outer,
            len,
            step,
            total,
        }
    }

    /// Elements in one innermost run and the operands' strides within it.
    pub fn run(&self) -> (usize, [usize; N]) {
        (self.len, self.step)
    }

    /// Calls `f` with each operand's offset at the start of every innermost
    /// run, in row-major order (so sums over a broadcast keep the order a
    /// plain element-by-element walk would give).
    pub fn for_each(&self, base: [usize; N], mut f: impl FnMut([usize; N])) {
        if self.total == 0 {
            return;
        }
        let rank = self.outer.len();
        let mut idx = vec![0usize; rank];
        let mut cur = base;
        loop {
            f(cur);
            let mut a = rank;
            loop {
                if a == 0 {
                    return;
                }
                a -= 1;
                let (n, st) = self.outer[a];
                idx[a] += 1;
                if idx[a] < n {
                    (0..N).for_each(|i| cur[i] += st[i]);
                    break;
                }
                idx[a] = 0;
                (0..N).for_each(|i| cur[i] -= st[i] * (n - 1));
            }
        }
    }
}

/// The elements of `src` read through `strides` (from `offset`) in the
/// row-major order of `shape`.
pub fn gather_strided<T: Copy>(
    src: &[T],
    shape: &[usize],
    strides: &[usize],
    offset: usize,
) -> Vec<T> {
    if let Some(out) = transpose_tiled(src, shape, strides, offset) {
        return out;
    }
    let out_strides = self::strides(shape);
    let walk = Walk::new(shape, [&out_strides, strides]);
    let mut out = Vec::with_capacity(shape.iter().product());
    let (len, [_, step]) = walk.run();
    walk.for_each([0, offset], |[_, o]| match step {
        1 => out.extend_from_slice(&src[o..o + len]),
        0 => out.extend(std::iter::repeat_n(src[o], len)),
        s => out.extend((0..len).map(|j| src[o + j * s])),
    });
    out
}

/// Tiles of [`transpose_tiled`]: 32 × 32 four-byte elements, 4 KiB read
/// and 4 KiB written, well inside L1.
const TILE: usize = 32;

/// [`gather_strided`] when the last two axes read a matrix transposed (the
/// source's contiguous axis is the second-to-last, the last strides over
/// it), over any outer axes: in square tiles, so each cache line read
/// serves a tile's whole row instead of one element. An element walk
/// misses the cache at every element of a large matrix (a tied output
/// layer's `transpose(wte)` was half of a gpt2-sized reference step).
/// `None` for every other pattern, and for matrices small enough to stay
/// in cache either way.
fn transpose_tiled<T: Copy>(
    src: &[T],
    shape: &[usize],
    strides: &[usize],
    offset: usize,
) -> Option<Vec<T>> {
    let r = shape.len();
    if r < 2 || strides[r - 2] != 1 || strides[r - 1] <= 1 {
        return None;
    }
    let (rows, cols, step) = (shape[r - 2], shape[r - 1], strides[r - 1]);
    if rows * cols < TILE * TILE {
        return None;
    }
    let outer: usize = shape[..r - 2].iter().product();
    let first = *src.get(offset)?;
    let mut out = vec![first; outer * rows * cols];
    let mut index = vec![0usize; r - 2];
    for o in 0..outer {
        let base: usize = offset + index.iter().zip(strides).map(|(i, s)| i * s).sum::<usize>();
        let dst = &mut out[o * rows * cols..(o + 1) * rows * cols];
        for i0 in (0..rows).step_by(TILE) {
            for j0 in (0..cols).step_by(TILE) {
                let j1 = (j0 + TILE).min(cols);
                for i in i0..(i0 + TILE).min(rows) {
                    let row = &mut dst[i * cols + j0..i * cols + j1];
                    for (d, j) in row.iter_mut().zip(j0..) {
                        *d = src[base + i + j * step];
                    }
                }
            }
        }
        // The next outer index, last axis fastest.
        for a in (0..r - 2).rev() {
            index[a] += 1;
            if index[a] < shape[a] {
                break;
            }
            index[a] = 0;
        }
    }
    Some(out)
}

/// Strides of `from` read as a tensor of shape `to` (numpy broadcasting, right-aligned).
pub fn broadcast_strides(from: &[usize], to: &[usize]) -> Vec<usize> {
    let s = strides(from);
    let lead = to.len() - from.len();
    (0..to.len())
        .map(|i| {
            if i < lead || from[i - lead] == 1 {
                0
            } else {
                s[i - lead]
            }
        })
        .collect()
}

/// Broadcasting of two concrete shapes; `None` when they do not fit.
pub fn broadcast_shape(a: &[usize], b: &[usize]) -> Option<Vec<usize>> {
    let rank = a.len().max(b.len());
    (0..rank)
        .map(|i| {
            let da = (i + a.len()).checked_sub(rank).map_or(1, |j| a[j]);
            let db = (i + b.len()).checked_sub(rank).map_or(1, |j| b[j]);
            match (da, db) {
                _ if da == db => Some(da),
                (1, _) => Some(db),
                (_, 1) => Some(da),
                _ => None,
            }
        })
        .collect()
}

pub fn broadcast_data<T: Copy>(src: &[T], from: &[usize], to: &[usize]) -> Vec<T> {
    if from == to {
        return src.to_vec();
    }
    gather_strided(src, to, &broadcast_strides(from, to), 0)
}

/// Sum `grad` (of shape `from`) down to `to`, the shape it was broadcast from.
/// Each element of the result adds its contributions in `grad`'s row-major
/// order, as an element-by-element walk would.
pub fn reduce_to(grad: &[f32], from: &[usize], to: &[usize]) -> Vec<f32> {
    if from == to {
        return grad.to_vec();
    }
    let mut out = vec![0.0f32; to.iter().product()];
    let walk = Walk::new(from, [&strides(from), &broadcast_strides(to, from)]);
    let (len, [_, step]) = walk.run();
    walk.for_each([0, 0], |[g, o]| {
        let g = &grad[g..g + len];
        match step {
            1 => out[o..o + len]
                .iter_mut()
                .zip(g)
                .for_each(|(o, &v)| *o += v),
            _ => {
                let acc = &mut out[o];
                g.iter().for_each(|&v| *acc += v);
            }
        }
    });
    out
}

/// `[outer, n, inner]` around `axis`: how reductions and softmax walk a tensor.
pub fn split_axis(shape: &[usize], axis: usize) -> (usize, usize, usize) {
    let outer = shape[..axis].iter().product();
    let inner = shape[axis + 1..].iter().product();
    (outer, shape[axis], inner)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The offsets an element-by-element row-major walk visits.
    fn naive(shape: &[usize], st: &[usize], offset: usize) -> Vec<usize> {
        let n: usize = shape.iter().product();
        (0..n)
            .map(|mut flat| {
                let mut o = offset;
                for a in (0..shape.len()).rev() {
                    o += (flat % shape[a]) * st[a];
                    flat /= shape[a];
                }
                o
            })
            .collect()
    }

    /// Large transposes take the tiled path; it reads what the walk does,
    /// with outer axes, ragged tiles and an offset.
    #[test]
    fn tiled_transposes_match_an_element_walk() {
        let cases: [(&[usize], &[usize], usize); 4] = [
            // A [100, 70] matrix read as its transpose.
            (&[70, 100], &[1, 70], 0),
            // Batched: [3, 45, 33] with the last two axes swapped.
            (&[3, 33, 45], &[45 * 33, 1, 33], 0),
            // Outer axes permuted too, from an offset.
            (&[2, 3, 40, 50], &[40 * 50, 2 * 40 * 50, 1, 40], 7),
            // Exactly one tile.
            (&[32, 32], &[1, 32], 0),
        ];
        for (shape, st, off) in cases {
            let n: usize = naive(shape, st, off).into_iter().max().unwrap() + 1;
            let src: Vec<usize> = (0..n).collect();
            assert!(transpose_tiled(&src, shape, st, off).is_some(), "{shape:?}");
            assert_eq!(
                gather_strided(&src, shape, st, off),
                naive(shape, st, off),
                "{shape:?} {st:?} {off}"
            );
        }
    }

    #[test]
    fn strided_gathers_match_an_element_walk() {
        let src: Vec<usize> = (0..2 * 3 * 4 * 5).collect();
        let cases: [(&[usize], &[usize], usize); 6] = [
            (&[2, 3, 4, 5], &[60, 20, 5, 1], 0),
            (&[2, 4, 3, 5], &[60, 5, 20, 1], 0),
            (&[5, 4, 3, 2], &[1, 5, 20, 60], 0),
            (&[2, 3, 1, 5], &[60, 20, 5, 1], 5),
            (&[3, 4, 5], &[0, 5, 1], 0),
            (&[2, 3, 4], &[60, 0, 1], 1),
        ];
        for (shape, st, off) in cases {
            assert_eq!(
                gather_strided(&src, shape, st, off),
                naive(shape, st, off),
                "{shape:?} {st:?}"
            );
        }
    }

    #[test]
    fn broadcast_sums_keep_the_element_order() {
        let grad: Vec<f32> = (0..24).map(|i| 1.0 + i as f32 * 1e-3).collect();
        for to in [&[4][..], &[3, 1], &[1, 3, 4], &[2, 1, 1], &[]] {
            let from = [2, 3, 4];
            let mut want = vec![0.0f32; to.iter().product()];
            let offs = naive(&from, &broadcast_strides(to, &from), 0);
            for (g, o) in grad.iter().zip(offs) {
                want[o] += g;
            }
            assert_eq!(reduce_to(&grad, &from, to), want, "{to:?}");
        }
    }
}
