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

/// Offsets `offset + Σ index_i·strides_i` for every index of `shape`, row-major.
pub fn strided_offsets(shape: &[usize], strides: &[usize], offset: usize) -> Vec<usize> {
    let n: usize = shape.iter().product();
    let mut out = Vec::with_capacity(n);
    if n == 0 {
        return out;
    }
    let rank = shape.len();
    let mut idx = vec![0usize; rank];
    let mut cur = offset;
    for _ in 0..n {
        out.push(cur);
        for a in (0..rank).rev() {
            idx[a] += 1;
            cur += strides[a];
            if idx[a] < shape[a] {
                break;
            }
            cur -= strides[a] * shape[a];
            idx[a] = 0;
        }
    }
    out
}

pub fn gather<T: Copy>(src: &[T], offsets: &[usize]) -> Vec<T> {
    offsets.iter().map(|&o| src[o]).collect()
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
    gather(src, &strided_offsets(to, &broadcast_strides(from, to), 0))
}

/// Sum `grad` (of shape `from`) down to `to`, the shape it was broadcast from.
pub fn reduce_to(grad: &[f32], from: &[usize], to: &[usize]) -> Vec<f32> {
    if from == to {
        return grad.to_vec();
    }
    let mut out = vec![0.0f32; to.iter().product()];
    for (g, o) in grad
        .iter()
        .zip(strided_offsets(from, &broadcast_strides(to, from), 0))
    {
        out[o] += g;
    }
    out
}

/// `[outer, n, inner]` around `axis`: how reductions and softmax walk a tensor.
pub fn split_axis(shape: &[usize], axis: usize) -> (usize, usize, usize) {
    let outer = shape[..axis].iter().product();
    let inner = shape[axis + 1..].iter().product();
    (outer, shape[axis], inner)
}
