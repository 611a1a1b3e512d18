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
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, RwLock, RwLockReadGuard, RwLockWriteGuard};

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
    /// Copy `rows` rows of `width` elements of type `elem` between two
    /// buffers: row `r` from `src.0` at element `src.1 + r·src.2` to
    /// `dst.0` at `dst.1 + r·dst.2` (a piece of a tensor cut along an
    /// axis, or put back: a layout change's moves).
    fn copy_rows(
        &mut self,
        elem: Elem,
        src: (&Self::Buf, usize, usize),
        dst: (&Self::Buf, usize, usize),
        rows: usize,
        width: usize,
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
    /// Uploads and downloads so far, every handle on this memory's, when
    /// counted: each is a copy over the host link and, downloading, a wait
    /// for the device.
    fn host_crossings(&self) -> Option<u64> {
        None
    }
    /// Whether `buf` is this handle's alone, so that writing over it is
    /// seen by no other value (a gradient may be handed on unchanged as
    /// another tensor's).
    fn unique(buf: &Self::Buf) -> bool;
}

/// The CPU device: kernels interpreted, matmuls in f64, float tensors
/// stored as a GPU would store them. Values live as `f32`, but with a bf16
/// or f16 storage type ([`HostBackend::with_storage`]) every
/// [`Elem::Float`] value a kernel, a matmul or an upload writes is rounded
/// to it, buffers count their bytes at its width, and a kernel that reads a
/// buffer as the other float type than it holds is refused — on a GPU it
/// would read the bytes as the wrong type (the optimizer once read its `f32`
/// gradient as bf16, which no f32 run could show).
pub struct HostBackend {
    live: Arc<Mutex<(usize, usize)>>,
    storage: DType,
    /// Uploads and downloads so far, every handle's
    /// ([`Backend::host_crossings`]).
    crossings: Arc<AtomicU64>,
    /// Buffers left for another rank's thread ([`HostBackend::sharing`]).
    shelf: Shelf,
}

/// Buffers rank threads of one process hand each other, by token: the
/// host's memory is every thread's, as a GPU's is every rank's on it.
#[derive(Clone, Default)]
pub struct Shelf(Arc<Mutex<Shelved>>);

/// The last token given, and what is left under each.
type Shelved = (u64, HashMap<u64, Arc<HostBuf>>);

impl Shelf {
    fn lock(&self) -> MutexGuard<'_, Shelved> {
        self.0.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Leave `buf` under a fresh token.
    pub fn hand_over(&self, buf: Arc<HostBuf>) -> u64 {
        let mut shelf = self.lock();
        shelf.0 += 1;
        let token = shelf.0;
        shelf.1.insert(token, buf);
        token
    }

    /// The buffer left under `token`, once.
    pub fn take_over(&self, token: u64) -> Result<Arc<HostBuf>> {
        self.lock().1.remove(&token).ok_or_else(|| {
            kernel_err(
                "hand-over",
                format!("no buffer was handed over under token {token}"),
            )
        })
    }

    /// Whether nothing is left on it.
    pub fn is_empty(&self) -> bool {
        self.lock().1.is_empty()
    }
}

impl Default for HostBackend {
    fn default() -> Self {
        HostBackend::with_storage(DType::F32)
    }
}

/// A host buffer; it tells its backend when it is freed, so peak memory is
/// measured the way the GPU's caching allocator measures it.
pub struct HostBuf {
    data: RwLock<Data>,
    /// What it holds, as a GPU buffer's bytes would be read.
    elem: Mutex<Elem>,
    bytes: usize,
    live: Arc<Mutex<(usize, usize)>>,
}

impl HostBuf {
    fn read(&self) -> RwLockReadGuard<'_, Data> {
        self.data.read().unwrap_or_else(|p| p.into_inner())
    }

    fn write(&self) -> RwLockWriteGuard<'_, Data> {
        self.data.write().unwrap_or_else(|p| p.into_inner())
    }

    fn elem(&self) -> Elem {
        *self.elem.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn set_elem(&self, elem: Elem) {
        *self.elem.lock().unwrap_or_else(|p| p.into_inner()) = elem;
    }
}

fn locked(live: &Mutex<(usize, usize)>) -> MutexGuard<'_, (usize, usize)> {
    live.lock().unwrap_or_else(|p| p.into_inner())
}

impl Drop for HostBuf {
    fn drop(&mut self) {
        locked(&self.live).0 -= self.bytes;
    }
}

impl HostBackend {
    /// `f32` storage.
    pub fn new() -> HostBackend {
        HostBackend::default()
    }

    /// Float tensors stored as `storage` (`F32`, `BF16` or `F16`), as a GPU
    /// run of that precision stores them.
    pub fn with_storage(storage: DType) -> HostBackend {
        HostBackend {
            live: Arc::default(),
            storage,
            crossings: Arc::default(),
            shelf: Shelf::default(),
        }
    }

    /// This backend handing buffers over on `shelf`: every rank thread of a
    /// run shares one, as ranks sharing a GPU share its memory.
    pub fn sharing(mut self, shelf: Shelf) -> HostBackend {
        self.shelf = shelf;
        self
    }

    /// The shelf it hands buffers over on.
    pub fn shelf(&self) -> &Shelf {
        &self.shelf
    }

    fn cross(&self) {
        self.crossings.fetch_add(1, Ordering::Relaxed);
    }

    /// Another handle on the same memory: buffers of either are the
    /// other's, and live bytes and their peak are counted once for both.
    pub fn handle(&self) -> HostBackend {
        HostBackend {
            live: Arc::clone(&self.live),
            storage: self.storage,
            crossings: Arc::clone(&self.crossings),
            shelf: self.shelf.clone(),
        }
    }

    fn wrap(&self, data: Data, elem: Elem) -> Arc<HostBuf> {
        let width = match elem {
            Elem::Float => self.storage.size_bytes() as usize,
            Elem::F32 | Elem::I32 => 4,
        };
        let bytes = data.len() * width;
        let mut live = locked(&self.live);
        live.0 += bytes;
        live.1 = live.1.max(live.0);
        Arc::new(HostBuf {
            data: RwLock::new(data),
            elem: Mutex::new(elem),
            bytes,
            live: self.live.clone(),
        })
    }

    /// `x` as the storage type holds it.
    fn stored(&self, x: f32) -> f32 {
        stored_as(self.storage, x)
    }
}

/// `x` rounded to `storage` (to nearest even, as the GPU's conversions do).
fn stored_as(storage: DType, x: f32) -> f32 {
    use crate::gpu::{bf16_to_f32, f16_to_f32, f32_to_bf16, f32_to_f16};
    match storage {
        DType::BF16 => bf16_to_f32(f32_to_bf16(x)),
        DType::F16 => f16_to_f32(f32_to_f16(x)),
        _ => x,
    }
}

/// Refuse to read `buf` as `declared` when it holds the other float type
/// and the two differ in storage (bf16 or f16 runs): a GPU would read its
/// bytes as the wrong type. An f32 run stores both alike.
fn check_elem(storage: DType, what: &str, declared: Elem, buf: &HostBuf) -> Result<()> {
    let held = buf.elem();
    let floats = declared != Elem::I32 && held != Elem::I32;
    if storage != DType::F32 && floats && declared != held {
        return Err(kernel_err(
            "launch",
            format!(
                "{what} reads a buffer holding {held:?} as {declared:?}: with {storage:?} \
                 storage a GPU would read its bytes as the wrong type"
            ),
        ));
    }
    Ok(())
}

impl Backend for HostBackend {
    type Buf = Arc<HostBuf>;

    fn unique(buf: &Self::Buf) -> bool {
        Arc::strong_count(buf) == 1
    }

    fn dtype(&self) -> DType {
        self.storage
    }

    fn zeros(&mut self, elem: Elem, len: usize) -> Result<Self::Buf> {
        Ok(self.wrap(
            match elem {
                Elem::I32 => Data::I32(vec![0; len]),
                Elem::F32 | Elem::Float => Data::F32(vec![0.0; len]),
            },
            elem,
        ))
    }

    /// Poisoned, as a GPU's caching allocator hands back whatever its
    /// reused block last held: floats NaN, indices out of every range, so a
    /// read of an element nobody wrote shows on the CPU too.
    fn alloc(&mut self, elem: Elem, len: usize) -> Result<Self::Buf> {
        Ok(self.wrap(
            match elem {
                Elem::I32 => Data::I32(vec![i32::MIN; len]),
                Elem::F32 | Elem::Float => Data::F32(vec![f32::NAN; len]),
            },
            elem,
        ))
    }

    fn upload(&mut self, elem: Elem, data: &[f32]) -> Result<Self::Buf> {
        self.cross();
        if elem == Elem::I32 {
            return Err(kernel_err("upload", "floats uploaded as i32"));
        }
        let data = if elem == Elem::Float {
            data.iter().map(|&x| self.stored(x)).collect()
        } else {
            data.to_vec()
        };
        Ok(self.wrap(Data::F32(data), elem))
    }

    fn upload_i32(&mut self, data: &[i32]) -> Result<Self::Buf> {
        self.cross();
        Ok(self.wrap(Data::I32(data.to_vec()), Elem::I32))
    }

    fn download(&mut self, buf: &Self::Buf, elem: Elem, len: usize) -> Result<Vec<f32>> {
        self.cross();
        check_elem(self.storage, "download", elem, buf)?;
        match &*buf.read() {
            Data::F32(v) if v.len() >= len => Ok(v[..len].to_vec()),
            d => Err(kernel_err(
                "download",
                format!("{len} floats asked of a buffer of {} elements", d.len()),
            )),
        }
    }

    fn download_i32(&mut self, buf: &Self::Buf, len: usize) -> Result<Vec<i32>> {
        self.cross();
        match &*buf.read() {
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
        // The trait copies `f32` elements.
        check_elem(self.storage, "copy", Elem::F32, src)?;
        check_elem(self.storage, "copy", Elem::F32, dst)?;
        let short = || kernel_err("copy", format!("{len} floats from {from} to {to}"));
        if Arc::ptr_eq(src, dst) {
            let mut d = dst.write();
            let Data::F32(v) = &mut *d else {
                return Err(short());
            };
            if from.max(to) + len > v.len() {
                return Err(short());
            }
            v.copy_within(from..from + len, to);
            return Ok(());
        }
        let s = src.read();
        let mut d = dst.write();
        match (&*s, &mut *d) {
            (Data::F32(s), Data::F32(d)) if from + len <= s.len() && to + len <= d.len() => {
                d[to..to + len].copy_from_slice(&s[from..from + len]);
                Ok(())
            }
            _ => Err(short()),
        }
    }

    fn copy_rows(
        &mut self,
        elem: Elem,
        (src, from, src_stride): (&Self::Buf, usize, usize),
        (dst, to, dst_stride): (&Self::Buf, usize, usize),
        rows: usize,
        width: usize,
    ) -> Result<()> {
        check_elem(self.storage, "copy_rows", elem, src)?;
        check_elem(self.storage, "copy_rows", elem, dst)?;
        if rows == 0 || width == 0 {
            return Ok(());
        }
        let bad = || {
            kernel_err(
                "copy_rows",
                format!(
                    "{rows} rows of {width} from {from} (stride {src_stride}) to {to} \
                     (stride {dst_stride})"
                ),
            )
        };
        // Rows may not overlap (a GPU's 2-D copy asks as much).
        if Arc::ptr_eq(src, dst) || width > src_stride || width > dst_stride {
            return Err(bad());
        }
        let end = |at: usize, stride: usize| at + (rows - 1) * stride + width;
        fn rows_of<T: Copy>(
            s: &[T],
            d: &mut [T],
            (from, src_stride): (usize, usize),
            (to, dst_stride): (usize, usize),
            (rows, width): (usize, usize),
        ) {
            for r in 0..rows {
                let (a, b) = (from + r * src_stride, to + r * dst_stride);
                d[b..b + width].copy_from_slice(&s[a..a + width]);
            }
        }
        let s = src.read();
        let mut d = dst.write();
        let fits = |s: usize, d: usize| end(from, src_stride) <= s && end(to, dst_stride) <= d;
        let shape = (rows, width);
        match (&*s, &mut *d) {
            (Data::F32(s), Data::F32(d)) if fits(s.len(), d.len()) => {
                rows_of(s, d, (from, src_stride), (to, dst_stride), shape);
            }
            (Data::I32(s), Data::I32(d)) if fits(s.len(), d.len()) => {
                rows_of(s, d, (from, src_stride), (to, dst_stride), shape);
            }
            _ => return Err(bad()),
        }
        Ok(())
    }

    fn launch(&mut self, kernel: &Kernel, args: &Args, bufs: &[Self::Buf]) -> Result<()> {
        run_on_host(
            self.storage,
            &kernel.op,
            &kernel.buffers,
            args,
            bufs,
            |refs| interpret_refs(kernel, args, refs),
        )
    }

    fn attention(
        &mut self,
        kernel: &AttentionKernel,
        pass: AttentionPass,
        args: &Args,
        bufs: &[Self::Buf],
    ) -> Result<()> {
        run_on_host(
            self.storage,
            pass.name(),
            &kernel.buffers(pass),
            args,
            bufs,
            |refs| interpret_attention(kernel, pass, args, refs),
        )
    }

    fn matmul(&mut self, mm: &MatMul, a: &Self::Buf, b: &Self::Buf, c: &Self::Buf) -> Result<()> {
        let what = format!("{mm:?}");
        for x in [a, b] {
            check_elem(self.storage, &what, Elem::Float, x)?;
        }
        let out = {
            let (a, b) = (a.read(), b.read());
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
        let mut slot = c.write();
        match &mut *slot {
            Data::F32(v) if v.len() >= out.len() => {
                for (slot, x) in v.iter_mut().zip(out) {
                    *slot = stored_as(self.storage, x);
                }
                c.set_elem(Elem::Float);
                Ok(())
            }
            _ => Err(kernel_err("matmul", format!("{mm:?}: C is too small"))),
        }
    }

    fn host_crossings(&self) -> Option<u64> {
        Some(self.crossings.load(Ordering::Relaxed))
    }

    fn peak_bytes(&self) -> Option<usize> {
        Some(locked(&self.live).1)
    }
}

/// Bind `bufs` as the kernel buffers `specs` say (outputs sized for their
/// type, an input also bound as an output read from a snapshot), run
/// `interpret` over them, and round what it wrote as floats to `storage`.
fn run_on_host(
    storage: DType,
    op: &str,
    specs: &[Buffer],
    args: &Args,
    bufs: &[Arc<HostBuf>],
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
    let bound_as_output = |b: &Arc<HostBuf>, before: usize| {
        bufs[..before]
            .iter()
            .zip(specs)
            .any(|(o, kb)| kb.output && Arc::ptr_eq(o, b))
    };
    // Outputs are written in place, so each must be sized for its type
    // and bound once; an input that is also an output (an in-place
    // update) is read from a snapshot, as every point reads the old value.
    let mut snapshots: Vec<Option<Data>> = Vec::with_capacity(bufs.len());
    for (i, (b, kb)) in bufs.iter().zip(specs).enumerate() {
        if !kb.output {
            check_elem(storage, &format!("{op}'s {}", kb.label), kb.elem, b)?;
            let aliased = bound_as_output(b, bufs.len());
            snapshots.push(aliased.then(|| b.read().clone()));
            continue;
        }
        if bound_as_output(b, i) {
            return Err(kernel_err(
                "launch",
                format!("{}: output {} is bound twice", op, kb.label),
            ));
        }
        let len = args.len_of(&specs[i]);
        let mut slot = b.write();
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
            (true, _) => (None, Some(b.write())),
            (false, Some(_)) => (None, None),
            (false, None) => (Some(b.read()), None),
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
    interpret(&mut refs).map_err(|e| kernel_err("launch", e.to_string()))?;
    drop(refs);
    drop(writes);
    drop(reads);
    for (b, kb) in bufs.iter().zip(specs).filter(|(_, kb)| kb.output) {
        b.set_elem(kb.elem);
        if kb.elem == Elem::Float && storage != DType::F32 {
            if let Data::F32(v) = &mut *b.write() {
                let len = v.len().min(args.len_of(kb));
                for x in &mut v[..len] {
                    *x = stored_as(storage, *x);
                }
            }
        }
    }
    Ok(())
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

    /// A bf16 host stores floats as a GPU of that precision does: rounded,
    /// at two bytes each, and refuses a kernel that reads an `f32` buffer as
    /// the storage type (the optimizer's bug of the first GPU run).
    #[test]
    fn a_bf16_host_rounds_counts_and_refuses_a_wrong_float_type() {
        use crate::gpu::{bf16_to_f32, f32_to_bf16};
        use dplc_codegen::add_kernel;
        let mut be = HostBackend::with_storage(DType::BF16);
        let x = [1.0f32 + 1.0 / 1024.0, -2.71234, 1e-3];
        let a = be.upload(Elem::Float, &x).unwrap();
        let rounded: Vec<f32> = x.iter().map(|&v| bf16_to_f32(f32_to_bf16(v))).collect();
        assert_eq!(be.download(&a, Elem::Float, 3).unwrap(), rounded);
        let f = be.upload(Elem::F32, &x).unwrap();
        assert_eq!(be.download(&f, Elem::F32, 3).unwrap(), x);
        assert_eq!(be.peak_bytes(), Some(3 * 2 + 3 * 4));
        // f32 + bf16 into bf16: the sum is rounded.
        let out = be.alloc(Elem::Float, 3).unwrap();
        let add = add_kernel(Elem::Float, Elem::F32, Elem::Float);
        let args = crate::fused::flat_args(3);
        be.launch(&add, &args, &[out.clone(), f.clone(), a.clone()])
            .unwrap();
        let want: Vec<f32> = x
            .iter()
            .zip(&rounded)
            .map(|(p, q)| bf16_to_f32(f32_to_bf16(p + q)))
            .collect();
        assert_eq!(be.download(&out, Elem::Float, 3).unwrap(), want);
        // The f32 buffer read as bf16: refused, naming the buffer.
        let wrong = add_kernel(Elem::Float, Elem::Float, Elem::Float);
        let err = be
            .launch(&wrong, &args, &[out.clone(), f.clone(), a.clone()])
            .unwrap_err()
            .to_string();
        assert!(err.contains("holding F32 as Float"), "{err}");
        // An f32 host stores both alike and lets it pass.
        let mut be = HostBackend::new();
        let (f, a) = (
            be.upload(Elem::F32, &x).unwrap(),
            be.upload(Elem::Float, &x).unwrap(),
        );
        let out = be.alloc(Elem::Float, 3).unwrap();
        be.launch(&wrong, &args, &[out, f, a]).unwrap();
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
