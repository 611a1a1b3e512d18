//! What the fused executor needs of a device: buffers, kernel launches, and
//! row-major (batched) matmuls. [`HostBackend`] runs the kernels through the
//! codegen interpreter and the matmuls on the CPU, so the executor that drives
//! a GPU is tested on every machine; `gpu::CudaBackend` runs the same calls on
//! NVRTC's PTX and cuBLAS.

use crate::error::{kernel_err, Result};
use dplc_codegen::{interpret, Args, Data, Elem, Kernel};
use dplc_ir::DType;
use std::cell::RefCell;
use std::rc::Rc;

/// One (batched) matmul: `C[b] (m×n) = op(A[b]) (m×k) · op(B[b]) (k×n)`, row-major.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MatMul {
    pub m: usize,
    pub n: usize,
    pub k: usize,
    pub batch: usize,
    /// A is stored `k×m` (its transpose is the operand).
    pub a_transposed: bool,
    pub b_transposed: bool,
    /// Whether each batch has its own A (else one A for all: a weight).
    pub a_batched: bool,
    pub b_batched: bool,
    pub dtype: DType,
}

impl MatMul {
    /// FLOPs of the call (2·m·n·k per batch).
    pub fn flops(&self) -> f64 {
        2.0 * (self.m * self.n * self.k * self.batch) as f64
    }
}

/// The reference matmul: the same row-major product on the CPU, accumulated in f64.
pub fn matmul_cpu(mm: &MatMul, a: &[f32], b: &[f32]) -> Vec<f32> {
    let mut c = vec![0.0f32; mm.batch * mm.m * mm.n];
    for bi in 0..mm.batch {
        let ao = if mm.a_batched { bi * mm.m * mm.k } else { 0 };
        let bo = if mm.b_batched { bi * mm.k * mm.n } else { 0 };
        for i in 0..mm.m {
            for j in 0..mm.n {
                let mut acc = 0.0f64;
                for p in 0..mm.k {
                    let x = if mm.a_transposed {
                        a[ao + p * mm.m + i]
                    } else {
                        a[ao + i * mm.k + p]
                    };
                    let y = if mm.b_transposed {
                        b[bo + j * mm.k + p]
                    } else {
                        b[bo + p * mm.n + j]
                    };
                    acc += f64::from(x) * f64::from(y);
                }
                c[bi * mm.m * mm.n + i * mm.n + j] = acc as f32;
            }
        }
    }
    c
}

/// A device the fused executor runs on. Buffers are shared handles: a kernel
/// may be given the same buffer as an input and an output (in-place updates),
/// and memory is released when the last handle is dropped.
pub trait Backend {
    type Buf: Clone;

    /// The storage type of [`Elem::Float`] buffers.
    fn dtype(&self) -> DType;
    /// A buffer of `len` zeros.
    fn zeros(&mut self, elem: Elem, len: usize) -> Result<Self::Buf>;
    /// A buffer whose every element the caller writes before reading it.
    fn alloc(&mut self, elem: Elem, len: usize) -> Result<Self::Buf> {
        self.zeros(elem, len)
    }
    fn upload(&mut self, elem: Elem, data: &[f32]) -> Result<Self::Buf>;
    fn upload_i32(&mut self, data: &[i32]) -> Result<Self::Buf>;
    /// The first `len` elements of a float buffer, as `f32`.
    fn download(&mut self, buf: &Self::Buf, elem: Elem, len: usize) -> Result<Vec<f32>>;
    /// Run `kernel` with one buffer per kernel buffer.
    fn launch(&mut self, kernel: &Kernel, args: &Args, bufs: &[Self::Buf]) -> Result<()>;
    /// `c = op(a)·op(b)`; `c` is overwritten.
    fn matmul(&mut self, mm: &MatMul, a: &Self::Buf, b: &Self::Buf, c: &Self::Buf) -> Result<()>;
    /// Wait for queued work (a no-op where calls are synchronous).
    fn synchronize(&mut self) -> Result<()> {
        Ok(())
    }
    /// Bytes held by live buffers at the high-water mark, when tracked.
    fn peak_bytes(&self) -> Option<usize> {
        None
    }
}

/// The CPU device: `f32` storage, kernels interpreted, matmuls in f64.
#[derive(Default)]
pub struct HostBackend {
    live: Rc<RefCell<(usize, usize)>>,
}

/// A host buffer; it tells its backend when it is freed, so peak memory is
/// measured the way the GPU's caching allocator measures it.
pub struct HostBuf {
    data: RefCell<Data>,
    bytes: usize,
    live: Rc<RefCell<(usize, usize)>>,
}

impl Drop for HostBuf {
    fn drop(&mut self) {
        self.live.borrow_mut().0 -= self.bytes;
    }
}

impl HostBackend {
    pub fn new() -> HostBackend {
        HostBackend::default()
    }

    fn wrap(&self, data: Data) -> Rc<HostBuf> {
        let bytes = data.len() * 4;
        let mut live = self.live.borrow_mut();
        live.0 += bytes;
        live.1 = live.1.max(live.0);
        Rc::new(HostBuf {
            data: RefCell::new(data),
            bytes,
            live: self.live.clone(),
        })
    }
}

impl Backend for HostBackend {
    type Buf = Rc<HostBuf>;

    fn dtype(&self) -> DType {
        DType::F32
    }

    fn zeros(&mut self, elem: Elem, len: usize) -> Result<Self::Buf> {
        Ok(self.wrap(match elem {
            Elem::I32 => Data::I32(vec![0; len]),
            Elem::F32 | Elem::Float => Data::F32(vec![0.0; len]),
        }))
    }

    fn upload(&mut self, _elem: Elem, data: &[f32]) -> Result<Self::Buf> {
        Ok(self.wrap(Data::F32(data.to_vec())))
    }

    fn upload_i32(&mut self, data: &[i32]) -> Result<Self::Buf> {
        Ok(self.wrap(Data::I32(data.to_vec())))
    }

    fn download(&mut self, buf: &Self::Buf, _elem: Elem, len: usize) -> Result<Vec<f32>> {
        match &*buf.data.borrow() {
            Data::F32(v) if v.len() >= len => Ok(v[..len].to_vec()),
            d => Err(kernel_err(
                "download",
                format!("{len} floats asked of a buffer of {} elements", d.len()),
            )),
        }
    }

    fn launch(&mut self, kernel: &Kernel, args: &Args, bufs: &[Self::Buf]) -> Result<()> {
        let mut data: Vec<Data> = bufs
            .iter()
            .zip(&kernel.buffers)
            .map(|(b, kb)| {
                if kb.output {
                    Data::F32(Vec::new())
                } else {
                    b.data.borrow().clone()
                }
            })
            .collect();
        interpret(kernel, args, &mut data).map_err(|e| kernel_err("launch", e.to_string()))?;
        for ((b, kb), d) in bufs.iter().zip(&kernel.buffers).zip(data) {
            if kb.output {
                let mut slot = b.data.borrow_mut();
                // A kernel writes the first elements of a longer buffer (a
                // gradient padded to whole ZeRO parts), as on the GPU.
                match (&mut *slot, d) {
                    (slot, d) if slot.len() == d.len() => *slot = d,
                    (Data::F32(v), Data::F32(d)) if v.len() > d.len() => {
                        v[..d.len()].copy_from_slice(&d)
                    }
                    (slot, d) => {
                        return Err(kernel_err(
                            "launch",
                            format!(
                                "{}: output {} has {} elements, the buffer {}",
                                kernel.op,
                                kb.label,
                                d.len(),
                                slot.len()
                            ),
                        ))
                    }
                }
            }
        }
        Ok(())
    }

    fn matmul(&mut self, mm: &MatMul, a: &Self::Buf, b: &Self::Buf, c: &Self::Buf) -> Result<()> {
        let out = {
            let (a, b) = (a.data.borrow(), b.data.borrow());
            matmul_cpu(mm, a.f32(), b.f32())
        };
        let mut slot = c.data.borrow_mut();
        match &mut *slot {
            Data::F32(v) if v.len() >= out.len() => {
                v[..out.len()].copy_from_slice(&out);
                Ok(())
            }
            _ => Err(kernel_err("matmul", format!("{mm:?}: C is too small"))),
        }
    }

    fn peak_bytes(&self) -> Option<usize> {
        Some(self.live.borrow().1)
    }
}
