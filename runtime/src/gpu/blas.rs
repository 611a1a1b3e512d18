//! Matmuls on cuBLAS: row-major (batched) `C = op(A) · op(B)` in f32, bf16 or
//! f16 storage with f32 accumulation, the form the fusion plan's `MatMul`
//! steps take (an operand may be transposed, or shared across the batch).
//!
//! A large 16-bit matmul whose only unaligned dimension is C's rows (`m`)
//! and whose A is stored transposed — A's rows, of `m` elements, then do
//! not start on 16-byte boundaries (gpt2's embedding gradient, `dLogitsᵀ ·
//! X`, with its vocabulary of 50,257) — runs in blocks of C's rows, each
//! block's columns of A copied into aligned scratch ([`staging`]): on an
//! H200 that ran at 2.2× the single call's speed. Unaligned `n` or `k`
//! are not helped by aligned rows alone (measured: the logits and their
//! input gradient ran 13–31% slower staged, every block's GEMM still had
//! the odd dimension); they would need the dimension padded with zeros.

use super::device::{DeviceBuffer, GpuDevice};
use super::error::{blas, GpuError, GpuResult};
pub use crate::fused::{matmul_cpu, MatMul};
use cudarc::cublas::sys::{cublasComputeType_t, cublasGemmAlgo_t, cublasOperation_t, cudaDataType};
use cudarc::cublas::CudaBlas;
use dplc_ir::DType;
use std::ffi::c_void;

/// A cuBLAS handle bound to the device's stream.
pub struct Blas {
    handle: CudaBlas,
}

fn data_type(d: DType) -> GpuResult<cudaDataType> {
    Ok(match d {
        DType::F32 => cudaDataType::CUDA_R_32F,
        DType::BF16 => cudaDataType::CUDA_R_16BF,
        DType::F16 => cudaDataType::CUDA_R_16F,
        DType::I32 => return Err(GpuError::Invalid("matmul of i32".into())),
    })
}

fn int(x: usize, what: &str) -> GpuResult<i32> {
    i32::try_from(x).map_err(|_| GpuError::Invalid(format!("{what} = {x} exceeds cuBLAS's int")))
}

impl Blas {
    pub fn new(dev: &GpuDevice) -> GpuResult<Blas> {
        // SAFETY: only probes with dlopen whether the library can be opened.
        if !unsafe { cudarc::cublas::sys::is_culib_present() } {
            return Err(GpuError::CudaUnavailable(
                "the cuBLAS library (libcublas.so.12) cannot be loaded".into(),
            ));
        }
        let handle =
            CudaBlas::new(dev.stream().clone()).map_err(|e| blas("creating a handle", e))?;
        Ok(Blas { handle })
    }

    /// Queue `C = op(A)·op(B)` on the device's stream (through aligned
    /// scratch from `dev` where [`staging`] says it pays).
    pub fn matmul(
        &self,
        dev: &GpuDevice,
        mm: &MatMul,
        a: &DeviceBuffer,
        b: &DeviceBuffer,
        c: &DeviceBuffer,
    ) -> GpuResult<()> {
        check_sizes(mm, a, b, c)?;
        match staging(mm, STAGE_ABOVE, SCRATCH_BYTES) {
            Some(plan) => self.staged(dev, mm, &plan, a, b, c),
            None => self.direct(mm, a, b, c),
        }
    }

    /// [`Blas::matmul`] through aligned scratch of at most `scratch_bytes`
    /// whatever the matmul's size, where [`staging`] would stage it (the
    /// GPU test's entry to the staged path at small sizes).
    pub fn matmul_staged(
        &self,
        dev: &GpuDevice,
        mm: &MatMul,
        a: &DeviceBuffer,
        b: &DeviceBuffer,
        c: &DeviceBuffer,
        scratch_bytes: usize,
    ) -> GpuResult<()> {
        check_sizes(mm, a, b, c)?;
        match staging(mm, 0, scratch_bytes) {
            Some(plan) => self.staged(dev, mm, &plan, a, b, c),
            None => self.direct(mm, a, b, c),
        }
    }

    /// The matmul as one cuBLAS call on the buffers as they are.
    fn direct(
        &self,
        mm: &MatMul,
        a: &DeviceBuffer,
        b: &DeviceBuffer,
        c: &DeviceBuffer,
    ) -> GpuResult<()> {
        let lda = if mm.a_transposed { mm.m } else { mm.k };
        let ldb = if mm.b_transposed { mm.k } else { mm.n };
        let stride = |on: bool, n: usize| if on { n as i64 } else { 0 };
        self.gemm(
            mm,
            mm.m,
            Operand {
                ptr: a.device_ptr(),
                ld: lda,
                stride: stride(mm.a_batched, mm.m * mm.k),
            },
            Operand {
                ptr: b.device_ptr(),
                ld: ldb,
                stride: stride(mm.b_batched, mm.k * mm.n),
            },
            Operand {
                ptr: c.device_ptr(),
                ld: mm.n,
                stride: (mm.m * mm.n) as i64,
            },
        )
    }

    /// The matmul in blocks of `plan.rows` rows of C, each block's columns
    /// of the transposed A copied into aligned scratch first.
    fn staged(
        &self,
        dev: &GpuDevice,
        mm: &MatMul,
        plan: &Staging,
        a: &DeviceBuffer,
        b: &DeviceBuffer,
        c: &DeviceBuffer,
    ) -> GpuResult<()> {
        let w = mm.dtype.size_bytes() as usize;
        let (m, n, k) = (mm.m, mm.n, mm.k);
        let scratch = dev.alloc(k * aligned(plan.rows) * w)?;
        let ldb = if mm.b_transposed { k } else { n };
        for m0 in (0..m).step_by(plan.rows) {
            let rows = plan.rows.min(m - m0);
            // op(A)'s rows [m0, m0 + rows) are columns of the stored k×m.
            let lda = aligned(rows);
            dev.copy_2d(a, (m0 * w, m * w), &scratch, (0, lda * w), rows * w, k)?;
            let one = |ptr: u64, ld: usize| Operand { ptr, ld, stride: 0 };
            self.gemm(
                mm,
                rows,
                one(scratch.device_ptr(), lda),
                one(b.device_ptr(), ldb),
                one(c.device_ptr() + (m0 * n * w) as u64, n),
            )?;
        }
        Ok(())
    }

    /// One cuBLAS call: `m` rows of `C = op(A)·op(B)` for `mm`'s `n`, `k`,
    /// batch and transpositions, each operand at its address and leading
    /// dimension.
    fn gemm(&self, mm: &MatMul, m: usize, a: Operand, b: Operand, c: Operand) -> GpuResult<()> {
        let dt = data_type(mm.dtype)?;
        // Row-major C = A·B is column-major Cᵀ = Bᵀ·Aᵀ: swap the operands. A
        // row-major buffer read column-major is its transpose, so an operand
        // stored as itself needs no flag, and a transposed one needs `T`.
        let op = |tr: bool| {
            if tr {
                cublasOperation_t::CUBLAS_OP_T
            } else {
                cublasOperation_t::CUBLAS_OP_N
            }
        };
        let (alpha, beta) = (1.0f32, 0.0f32);
        // SAFETY: every operand's address, leading dimension and stride
        // keep cuBLAS's reads and writes inside its buffer (the callers
        // checked the sizes, and a block or scratch lies inside its
        // buffer); alpha and beta are f32 as CUBLAS_COMPUTE_32F requires;
        // the handle is bound to the stream the buffers are used on.
        unsafe {
            cudarc::cublas::result::gemm_strided_batched_ex(
                *self.handle.handle(),
                op(mm.b_transposed),
                op(mm.a_transposed),
                int(mm.n, "n")?,
                int(m, "m")?,
                int(mm.k, "k")?,
                (&alpha) as *const f32 as *const c_void,
                b.ptr as *const c_void,
                dt,
                int(b.ld, "ldb")?,
                b.stride,
                a.ptr as *const c_void,
                dt,
                int(a.ld, "lda")?,
                a.stride,
                (&beta) as *const f32 as *const c_void,
                c.ptr as *mut c_void,
                dt,
                int(c.ld, "ldc")?,
                c.stride,
                int(mm.batch, "batch")?,
                cublasComputeType_t::CUBLAS_COMPUTE_32F,
                cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
            )
        }
        .map_err(|e| blas("gemm", e))
    }
}

/// An operand of one cuBLAS call: its device address, leading dimension
/// (elements) and batch stride (elements; 0: shared by every batch).
struct Operand {
    ptr: u64,
    ld: usize,
    stride: i64,
}

/// Whether the three buffers hold what `mm` reads and writes.
fn check_sizes(mm: &MatMul, a: &DeviceBuffer, b: &DeviceBuffer, c: &DeviceBuffer) -> GpuResult<()> {
    let width = mm.dtype.size_bytes() as usize;
    let (na, nb, nc) = (mm.m * mm.k, mm.k * mm.n, mm.m * mm.n);
    let batches = |on: bool| if on { mm.batch } else { 1 };
    for (buf, elems, name) in [
        (a, na * batches(mm.a_batched), "A"),
        (b, nb * batches(mm.b_batched), "B"),
        (c, nc * mm.batch, "C"),
    ] {
        if buf.bytes() < elems * width {
            return Err(GpuError::Invalid(format!(
                "matmul {mm:?}: {name} holds {} bytes, needs {}",
                buf.bytes(),
                elems * width
            )));
        }
    }
    Ok(())
}

/// Elements a row must be a multiple of for cuBLAS's aligned kernels (16
/// bytes of 16-bit elements).
const ALIGN: usize = 8;

/// `x` rounded up to [`ALIGN`].
fn aligned(x: usize) -> usize {
    x.div_ceil(ALIGN) * ALIGN
}

/// Multiply-adds below which an unaligned matmul runs as it is (the
/// copies and extra calls would cost more than the unaligned kernels lose).
const STAGE_ABOVE: usize = 1 << 30;

/// The most scratch a staged matmul holds for its blocks: the device
/// allocator's peak grows by at most this much.
const SCRATCH_BYTES: usize = 64 << 20;

/// How a 16-bit matmul with a transposed A of unaligned rows runs aligned:
/// in blocks of `rows` rows of C (a multiple of 64 but the last), each
/// block's columns of A through scratch.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Staging {
    pub rows: usize,
}

/// The staging of `mm` with at most `scratch_bytes` of scratch, or `None`
/// where it runs as one call: 32-bit storage (cuBLAS aligns those
/// itself), batched, fewer than `min_madds` multiply-adds, an A stored
/// untransposed or with aligned rows (nothing to stage), or an unaligned
/// `n` or `k` (every block's GEMM would keep it: see the module header).
pub fn staging(mm: &MatMul, min_madds: usize, scratch_bytes: usize) -> Option<Staging> {
    let w = mm.dtype.size_bytes() as usize;
    let (m, n, k) = (mm.m, mm.n, mm.k);
    let unaligned = |x: usize| !x.is_multiple_of(ALIGN);
    if w != 2
        || mm.batch != 1
        || !mm.a_transposed
        || !unaligned(m)
        || unaligned(n)
        || unaligned(k)
        || m * n * k < min_madds
    {
        return None;
    }
    let rows = scratch_bytes / (k * w).max(1) / 64 * 64;
    (rows > 0).then(|| Staging { rows: rows.min(m) })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn mm(m: usize, n: usize, k: usize, a_transposed: bool, b_transposed: bool) -> MatMul {
        MatMul {
            m,
            n,
            k,
            batch: 1,
            a_transposed,
            b_transposed,
            a_batched: false,
            b_batched: false,
            dtype: DType::BF16,
        }
    }

    /// gpt2's embedding gradient at 32 × 1024 tokens (`dLogitsᵀ · X`: A
    /// stored 32768 × 50257) is staged in blocks within the scratch; its
    /// logits and their input gradient (an unaligned `n` or `k`), aligned,
    /// small, 32-bit and batched matmuls run as one call.
    #[test]
    fn an_unaligned_transposed_a_is_staged_in_blocks() {
        let plan = |x: &MatMul| staging(x, STAGE_ABOVE, SCRATCH_BYTES);
        let de = plan(&mm(50257, 768, 32768, true, false)).unwrap();
        assert!(de.rows >= 64 && de.rows % 64 == 0, "{de:?}");
        assert!(aligned(de.rows) * 32768 * 2 <= SCRATCH_BYTES);
        assert_eq!(plan(&mm(50257, 768, 32768, true, true)), Some(de));
        assert_eq!(plan(&mm(32768, 50257, 768, false, true)), None);
        assert_eq!(plan(&mm(32768, 768, 50257, false, false)), None);
        assert_eq!(plan(&mm(3072, 768, 32768, true, false)), None);
        assert_eq!(plan(&mm(50257, 768, 16, true, false)), None);
        let mut f32_de = mm(50257, 768, 32768, true, false);
        f32_de.dtype = DType::F32;
        assert_eq!(plan(&f32_de), None);
        let mut batched = mm(50257, 768, 32768, true, false);
        batched.batch = 2;
        assert_eq!(plan(&batched), None);
    }
}
