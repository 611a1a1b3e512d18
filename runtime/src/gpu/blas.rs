//! Matmuls on cuBLAS: row-major (batched) `C = op(A) · op(B)` in f32, bf16 or
//! f16 storage with f32 accumulation, the form the fusion plan's `MatMul`
//! steps take (an operand may be transposed, or shared across the batch).

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

    /// Queue `C = op(A)·op(B)` on the device's stream.
    pub fn matmul(
        &self,
        mm: &MatMul,
        a: &DeviceBuffer,
        b: &DeviceBuffer,
        c: &DeviceBuffer,
    ) -> GpuResult<()> {
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
        let t = mm.dtype;
        let dt = data_type(t)?;
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
        let lda = if mm.b_transposed { mm.k } else { mm.n };
        let ldb = if mm.a_transposed { mm.m } else { mm.k };
        let stride = |on: bool, n: usize| if on { n as i64 } else { 0 };
        let (alpha, beta) = (1.0f32, 0.0f32);
        // SAFETY: the three buffers hold at least the elements cuBLAS reads and
        // writes for these sizes, leading dimensions and strides (checked
        // above); alpha and beta are f32 as CUBLAS_COMPUTE_32F requires; the
        // handle is bound to the stream the buffers are used on.
        unsafe {
            cudarc::cublas::result::gemm_strided_batched_ex(
                *self.handle.handle(),
                op(mm.b_transposed),
                op(mm.a_transposed),
                int(mm.n, "n")?,
                int(mm.m, "m")?,
                int(mm.k, "k")?,
                (&alpha) as *const f32 as *const c_void,
                b.device_ptr() as *const c_void,
                dt,
                int(lda, "ldb")?,
                stride(mm.b_batched, nb),
                a.device_ptr() as *const c_void,
                dt,
                int(ldb, "lda")?,
                stride(mm.a_batched, na),
                (&beta) as *const f32 as *const c_void,
                c.device_ptr() as *mut c_void,
                dt,
                int(mm.n, "ldc")?,
                nc as i64,
                int(mm.batch, "batch")?,
                cublasComputeType_t::CUBLAS_COMPUTE_32F,
                cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
            )
        }
        .map_err(|e| blas("gemm", e))
    }
}
