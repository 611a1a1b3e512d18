//! What the fused executor needs of a device: buffers, kernel launches, and
//! row-major (batched) matmuls. [`HostBackend`] runs the kernels through the
//! codegen interpreter and the matmuls on the CPU, so the executor that drives
//! a GPU is tested on every machine; `gpu::CudaBackend` runs the same calls on
//! NVRTC's PTX and cuBLAS.

use crate::error::{kernel_err, Result};
use dplc_codegen::{
    interpret_attention, interpret_refs, Args, AttentionKernel, AttentionPass, Buffer, BufferRef,
    CodegenError, Data, Elem, Kernel,
};
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

/// The reference matmul: the same row-major product on the CPU, accumulated in
/// f64 over `k` in order. Each row of C accumulates in a row of f64 sums while
/// B's rows stream past contiguously (B is transposed into that layout first),
/// so the inner loop is a unit-stride axpy; each sum still adds its terms in
/// the order `p = 0..k`, so the result is the plain triple loop's.
pub fn matmul_cpu(mm: &MatMul, a: &[f32], b: &[f32]) -> Vec<f32> {
    let (m, n, k) = (mm.m, mm.n, mm.k);
    let mut c = vec![0.0f32; mm.batch * m * n];
    let mut bt = Vec::new();
    let mut acc = vec![0.0f64; n];
    for bi in 0..mm.batch {
        let ao = if mm.a_batched { bi * m * k } else { 0 };
        let bo = if mm.b_batched { bi * k * n } else { 0 };
        // B as k rows of n f64s, built once per distinct B.
        if bi == 0 || mm.b_batched {
            let b = &b[bo..bo + k * n];
            bt.clear();
            if mm.b_transposed {
                bt.resize(k * n, 0.0f64);
                for (j, col) in b.chunks_exact(k.max(1)).enumerate().take(n) {
                    for (p, &y) in col.iter().enumerate() {
                        bt[p * n + j] = f64::from(y);
                    }
                }
            } else {
                bt.extend(b.iter().map(|&y| f64::from(y)));
            }
        }
        let a = &a[ao..ao + m * k];
        for (i, row) in c[bi * m * n..(bi + 1) * m * n]
            .chunks_exact_mut(n.max(1))
            .enumerate()
            .take(m)
        {
            acc.fill(0.0);
            for p in 0..k {
                let x = f64::from(if mm.a_transposed {
                    a[p * m + i]
                } else {
                    a[i * k + p]
                });
                for (s, &y) in acc.iter_mut().zip(&bt[p * n..(p + 1) * n]) {
                    *s += x * y;
                }
            }
            for (o, &s) in row.iter_mut().zip(&acc) {
                *o = s as f32;
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
    /// The first `len` elements of an index buffer.
    fn download_i32(&mut self, buf: &Self::Buf, len: usize) -> Result<Vec<i32>>;
    /// Copy `len` `f32` elements from `src[from..]` to `dst[to..]` (the two
    /// ranges do not overlap when the buffers are the same).
    fn copy(
        &mut self,
        src: &Self::Buf,
        from: usize,
        dst: &Self::Buf,
        to: usize,
        len: usize,
    ) -> Result<()>;
    /// Run `kernel` with one buffer per kernel buffer.
    fn launch(&mut self, kernel: &Kernel, args: &Args, bufs: &[Self::Buf]) -> Result<()>;
    /// Run one pass of a fused attention, with one buffer per
    /// [`AttentionKernel::roles`] entry of the pass.
    fn attention(
        &mut self,
        kernel: &AttentionKernel,
        pass: AttentionPass,
        args: &Args,
        bufs: &[Self::Buf],
    ) -> Result<()>;
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

    /// Another handle on the same memory: buffers of either are the
    /// other's, and live bytes and their peak are counted once for both.
    pub fn handle(&self) -> HostBackend {
        HostBackend {
            live: Rc::clone(&self.live),
        }
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

    /// Poisoned, as a GPU's caching allocator hands back whatever its
    /// reused block last held: floats NaN, indices out of every range, so a
    /// read of an element nobody wrote shows on the CPU too.
    fn alloc(&mut self, elem: Elem, len: usize) -> Result<Self::Buf> {
        Ok(self.wrap(match elem {
            Elem::I32 => Data::I32(vec![i32::MIN; len]),
            Elem::F32 | Elem::Float => Data::F32(vec![f32::NAN; len]),
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

    fn download_i32(&mut self, buf: &Self::Buf, len: usize) -> Result<Vec<i32>> {
        match &*buf.data.borrow() {
            Data::I32(v) if v.len() >= len => Ok(v[..len].to_vec()),
            d => Err(kernel_err(
                "download",
                format!("{len} indices asked of a buffer of {} elements", d.len()),
            )),
        }
    }

    fn copy(
        &mut self,
        src: &Self::Buf,
        from: usize,
        dst: &Self::Buf,
        to: usize,
        len: usize,
    ) -> Result<()> {
        let short = || kernel_err("copy", format!("{len} floats from {from} to {to}"));
        if Rc::ptr_eq(src, dst) {
            let mut d = dst.data.borrow_mut();
            let Data::F32(v) = &mut *d else {
                return Err(short());
            };
            if from.max(to) + len > v.len() {
                return Err(short());
            }
            v.copy_within(from..from + len, to);
            return Ok(());
        }
        let s = src.data.borrow();
        let mut d = dst.data.borrow_mut();
        match (&*s, &mut *d) {
            (Data::F32(s), Data::F32(d)) if from + len <= s.len() && to + len <= d.len() => {
                d[to..to + len].copy_from_slice(&s[from..from + len]);
                Ok(())
            }
            _ => Err(short()),
        }
    }

    fn launch(&mut self, kernel: &Kernel, args: &Args, bufs: &[Self::Buf]) -> Result<()> {
        run_on_host(&kernel.op, &kernel.buffers, args, bufs, |refs| {
            interpret_refs(kernel, args, refs)
        })
    }

    fn attention(
        &mut self,
        kernel: &AttentionKernel,
        pass: AttentionPass,
        args: &Args,
        bufs: &[Self::Buf],
    ) -> Result<()> {
        run_on_host(pass.name(), &kernel.buffers(pass), args, bufs, |refs| {
            interpret_attention(kernel, pass, args, refs)
        })
    }

    fn matmul(&mut self, mm: &MatMul, a: &Self::Buf, b: &Self::Buf, c: &Self::Buf) -> Result<()> {
        let out = {
            let (a, b) = (a.data.borrow(), b.data.borrow());
            let batches = |batched: bool| if batched { mm.batch } else { 1 };
            let need_a = batches(mm.a_batched) * mm.m * mm.k;
            let need_b = batches(mm.b_batched) * mm.k * mm.n;
            if a.f32().len() < need_a || b.f32().len() < need_b {
                return Err(kernel_err(
                    "matmul",
                    format!(
                        "{mm:?}: A has {} floats (needs {need_a}), B {} (needs {need_b})",
                        a.f32().len(),
                        b.f32().len()
                    ),
                ));
            }
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

/// Bind `bufs` as the kernel buffers `specs` say (outputs sized for their
/// type, an input also bound as an output read from a snapshot) and run
/// `interpret` over them.
fn run_on_host(
    op: &str,
    specs: &[Buffer],
    args: &Args,
    bufs: &[Rc<HostBuf>],
    interpret: impl FnOnce(&mut [BufferRef]) -> std::result::Result<(), CodegenError>,
) -> Result<()> {
    if bufs.len() != specs.len() {
        return Err(kernel_err(
            "launch",
            format!(
                "{}: {} buffers given, the kernel takes {}",
                op,
                bufs.len(),
                specs.len()
            ),
        ));
    }
    let bound_as_output = |b: &Rc<HostBuf>, before: usize| {
        bufs[..before]
            .iter()
            .zip(specs)
            .any(|(o, kb)| kb.output && Rc::ptr_eq(o, b))
    };
    // Outputs are written in place, so each must be sized for its type
    // and bound once; an input that is also an output (an in-place
    // update) is read from a snapshot, as every point reads the old value.
    let mut snapshots: Vec<Option<Data>> = Vec::with_capacity(bufs.len());
    for (i, (b, kb)) in bufs.iter().zip(specs).enumerate() {
        if !kb.output {
            let aliased = bound_as_output(b, bufs.len());
            snapshots.push(aliased.then(|| b.data.borrow().clone()));
            continue;
        }
        if bound_as_output(b, i) {
            return Err(kernel_err(
                "launch",
                format!("{}: output {} is bound twice", op, kb.label),
            ));
        }
        let len = args.len_of(&specs[i]);
        let mut slot = b.data.borrow_mut();
        let fits = match (&*slot, kb.elem) {
            (Data::F32(v), Elem::F32 | Elem::Float) => v.len() >= len,
            (Data::I32(v), Elem::I32) => v.len() >= len,
            _ => false,
        };
        // A kernel writes the first elements of a longer buffer (a
        // gradient padded to whole ZeRO parts), as on the GPU; a buffer of
        // the exact length may change type.
        if !fits {
            if slot.len() != len {
                return Err(kernel_err(
                    "launch",
                    format!(
                        "{}: output {} has {len} elements, the buffer {}",
                        op,
                        kb.label,
                        slot.len()
                    ),
                ));
            }
            *slot = match kb.elem {
                Elem::I32 => Data::I32(vec![0; len]),
                Elem::F32 | Elem::Float => Data::F32(vec![0.0; len]),
            };
        }
        snapshots.push(None);
    }
    let mut reads = Vec::with_capacity(bufs.len());
    let mut writes = Vec::with_capacity(bufs.len());
    for ((b, kb), snap) in bufs.iter().zip(specs).zip(&snapshots) {
        let (r, w) = match (kb.output, snap) {
            (true, _) => (None, Some(b.data.borrow_mut())),
            (false, Some(_)) => (None, None),
            (false, None) => (Some(b.data.borrow()), None),
        };
        reads.push(r);
        writes.push(w);
    }
    let mut refs: Vec<BufferRef> = Vec::with_capacity(bufs.len());
    for ((r, w), snap) in reads.iter().zip(writes.iter_mut()).zip(&snapshots) {
        refs.push(match (r, w, snap) {
            (_, Some(w), _) => BufferRef::Output(w),
            (Some(r), _, _) => BufferRef::Input(r),
            (None, None, Some(s)) => BufferRef::Input(s),
            (None, None, None) => {
                return Err(kernel_err("launch", "a buffer neither read nor written"))
            }
        });
    }
    interpret(&mut refs).map_err(|e| kernel_err("launch", e.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The plain triple loop `matmul_cpu` reorganises.
    fn naive(mm: &MatMul, a: &[f32], b: &[f32]) -> Vec<f32> {
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

    #[test]
    fn blocked_matmul_is_the_triple_loop_bit_for_bit() {
        let (m, n, k, batch) = (5, 7, 3, 2);
        let a: Vec<f32> = (0..batch * m * k)
            .map(|i| (i as f32 * 0.37).sin())
            .collect();
        let b: Vec<f32> = (0..batch * k * n)
            .map(|i| (i as f32 * 0.91).cos())
            .collect();
        for bits in 0..16u32 {
            let mm = MatMul {
                m,
                n,
                k,
                batch,
                a_transposed: bits & 1 != 0,
                b_transposed: bits & 2 != 0,
                a_batched: bits & 4 != 0,
                b_batched: bits & 8 != 0,
                dtype: DType::F32,
            };
            let (got, want) = (matmul_cpu(&mm, &a, &b), naive(&mm, &a, &b));
            assert!(
                got.iter()
                    .zip(&want)
                    .all(|(x, y)| x.to_bits() == y.to_bits()),
                "{mm:?}"
            );
        }
    }
}
