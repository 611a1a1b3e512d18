//! Matmuls on cuBLAS: row-major (batched) `C = op(A) · op(B)` in f32, bf16 or
//! f16 storage with f32 accumulation, the form the fusion plan's `MatMul`
//! steps take (an operand may be transposed, or shared across the batch).
//!
//! A large 16-bit matmul with a dimension that is no multiple of 8 (gpt2's
//! vocabulary of 50,257) runs as [`super::staging`] plans it: padded with
//! zeros into aligned scratch, in blocks of C's rows.

use super::device::{DeviceBuffer, GpuDevice};
use super::error::{blas, GpuError, GpuResult};
use super::staging::{staging, At, Buf, Staged, Step, SCRATCH_BYTES, STAGE_ABOVE};
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
    /// scratch from `dev` where `staging` says it pays).
    pub fn matmul(
        &self,
        dev: &GpuDevice,
        mm: &MatMul,
        a: &DeviceBuffer,
        b: &DeviceBuffer,
        c: &DeviceBuffer,
    ) -> GpuResult<()> {
        self.run(dev, mm, [a, b, c], STAGE_ABOVE, SCRATCH_BYTES)
    }

    /// [`Blas::matmul`] through aligned scratch of at most `scratch_bytes`
    /// whatever the matmul's size, where `staging` would stage it (the
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
        self.run(dev, mm, [a, b, c], 0, scratch_bytes)
    }

    /// The matmul staged as [`staging`] plans it for these bounds, else as
    /// one call.
    fn run(
        &self,
        dev: &GpuDevice,
        mm: &MatMul,
        [a, b, c]: [&DeviceBuffer; 3],
        min_madds: usize,
        scratch_bytes: usize,
    ) -> GpuResult<()> {
        check_sizes(mm, a, b, c)?;
        match staging(mm, min_madds, scratch_bytes) {
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
            (mm.m, mm.n, mm.k),
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

    /// The staged plan's copies and GEMMs, its scratch zeroed first (the
    /// padding the copies leave untouched must read as zeros).
    fn staged(
        &self,
        dev: &GpuDevice,
        mm: &MatMul,
        plan: &Staged,
        a: &DeviceBuffer,
        b: &DeviceBuffer,
        c: &DeviceBuffer,
    ) -> GpuResult<()> {
        let w = mm.dtype.size_bytes() as usize;
        let scratch: Vec<Option<DeviceBuffer>> = plan
            .scratch
            .iter()
            .map(|&n| (n > 0).then(|| dev.zeros(n * w)).transpose())
            .collect::<GpuResult<_>>()?;
        let buf = |x: Buf| -> GpuResult<&DeviceBuffer> {
            let s = |i: usize| {
                scratch[i]
                    .as_ref()
                    .ok_or_else(|| GpuError::Invalid(format!("matmul {mm:?}: no scratch {x:?}")))
            };
            match x {
                Buf::A => Ok(a),
                Buf::B => Ok(b),
                Buf::C => Ok(c),
                Buf::ScratchA => s(0),
                Buf::ScratchB => s(1),
                Buf::ScratchC => s(2),
            }
        };
        let operand = |at: At| -> GpuResult<Operand> {
            Ok(Operand {
                ptr: buf(at.buf)?.device_ptr() + (at.offset * w) as u64,
                ld: at.ld,
                stride: 0,
            })
        };
        for step in &plan.steps {
            match *step {
                Step::Copy {
                    src,
                    dst,
                    width,
                    height,
                } => dev.copy_2d(
                    buf(src.buf)?,
                    (src.offset * w, src.ld * w),
                    buf(dst.buf)?,
                    (dst.offset * w, dst.ld * w),
                    width * w,
                    height,
                )?,
                Step::Gemm { m, n, k, a, b, c } => {
                    self.gemm(mm, (m, n, k), operand(a)?, operand(b)?, operand(c)?)?
                }
            }
        }
        Ok(())
    }

    /// One cuBLAS call: `C = op(A)·op(B)` of `m × n × k` with `mm`'s batch
    /// and transpositions, each operand at its address and leading
    /// dimension.
    fn gemm(
        &self,
        mm: &MatMul,
        (m, n, k): (usize, usize, usize),
        a: Operand,
        b: Operand,
        c: Operand,
    ) -> GpuResult<()> {
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
                int(n, "n")?,
                int(m, "m")?,
                int(k, "k")?,
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
