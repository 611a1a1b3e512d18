//! One CUDA device: the driver context and stream, device memory through the
//! caching allocator, modules loaded from NVRTC's PTX, and kernel launches.
//!
//! [`GpuDevice::new`] is the seam: without a driver library (or a device) it
//! returns [`GpuError::CudaUnavailable`] before any cudarc call that would panic.

use super::alloc::{Allocation, CachingAllocator, MemoryStats, RawMemory};
use super::convert::{bf16_to_f32, f16_to_f32, f32_to_bf16, f32_to_f16};
use super::error::{driver, GpuError, GpuResult};
use cudarc::driver::{
    CudaContext, CudaFunction, CudaSlice, CudaStream, DevicePtr, LaunchConfig, PushKernelArg,
};
use dplc_codegen::{
    Arch, Args, AttentionKernel, AttentionPass, Buffer, CudaSource, Elem, Kernel, LaunchShape, Ptx,
};
use dplc_ir::DType;
use std::sync::{Arc, Mutex};

/// Whether the CUDA driver library can be opened (`libcuda.so`, `nvcuda.dll`).
pub fn driver_present() -> bool {
    // SAFETY: only tries to dlopen the library by its usual names and closes it;
    // loading the driver runs no user-visible initialisation before cuInit.
    unsafe { cudarc::driver::sys::is_culib_present() }
}

/// Device memory from the driver, in bytes, on the device's stream.
pub struct DeviceMemory {
    stream: Arc<CudaStream>,
}

impl RawMemory for DeviceMemory {
    type Block = CudaSlice<u8>;

    fn alloc(&mut self, bytes: usize) -> GpuResult<CudaSlice<u8>> {
        // SAFETY: the memory is uninitialised; every user writes before it
        // reads (kernels write each output element, gradients that are added
        // to are zeroed by `GpuDevice::zeros`).
        unsafe { self.stream.alloc::<u8>(bytes) }.map_err(|e| driver("cuMemAlloc", e))
    }

    fn release(&mut self, block: CudaSlice<u8>) {
        drop(block);
    }
}

type Pool = Arc<Mutex<CachingAllocator<DeviceMemory>>>;

/// A device allocation; it goes back to the allocator's cache when dropped.
pub struct DeviceBuffer {
    alloc: Option<Allocation<CudaSlice<u8>>>,
    pool: Pool,
    stream: Arc<CudaStream>,
}

impl DeviceBuffer {
    /// Bytes asked for (the block may be larger).
    pub fn bytes(&self) -> usize {
        self.alloc.as_ref().map_or(0, |a| a.bytes)
    }

    fn slice(&self) -> &CudaSlice<u8> {
        &self.alloc.as_ref().expect("live until dropped").block
    }

    fn slice_mut(&mut self) -> &mut CudaSlice<u8> {
        &mut self.alloc.as_mut().expect("live until dropped").block
    }

    /// The raw device address, for kernel arguments, cuBLAS and NCCL.
    pub fn device_ptr(&self) -> u64 {
        // Event tracking is off (one stream per device), so the guard is inert.
        let (ptr, _guard) = self.slice().device_ptr(&self.stream);
        ptr
    }
}

impl Drop for DeviceBuffer {
    fn drop(&mut self) {
        if let Some(a) = self.alloc.take() {
            if let Ok(mut pool) = self.pool.lock() {
                pool.free(a);
            }
        }
    }
}

/// What a loaded kernel was generated from: its arguments are checked
/// against it, and it says how many points or items a launch covers.
#[derive(Clone, Debug)]
pub enum Program {
    Kernel(Kernel),
    /// One pass of a fused attention.
    Attention {
        kernel: Box<AttentionKernel>,
        pass: AttentionPass,
    },
}

impl Program {
    fn buffers(&self) -> Vec<Buffer> {
        match self {
            Program::Kernel(k) => k.buffers.clone(),
            Program::Attention { kernel, pass } => kernel.buffers(*pass),
        }
    }

    fn sizes(&self) -> usize {
        match self {
            Program::Kernel(k) => k.sizes,
            Program::Attention { kernel, .. } => kernel.sizes,
        }
    }

    fn scalars(&self) -> usize {
        match self {
            Program::Kernel(k) => k.scalars,
            Program::Attention { .. } => 0,
        }
    }

    fn draws(&self) -> bool {
        match self {
            Program::Kernel(k) => k.uses_random(),
            Program::Attention { kernel, .. } => kernel.dropout.is_some(),
        }
    }

    /// Points of the iteration space, or the attention pass's work items.
    fn extent(&self, args: &Args) -> u64 {
        let size = |s: dplc_codegen::Size| args.size(s).max(0);
        match self {
            Program::Kernel(k) => k.space.outer.iter().map(|&s| size(s) as u64).product(),
            Program::Attention { kernel, pass } => kernel.items(*pass, &size).max(0) as u64,
        }
    }
}

/// A kernel loaded into the device, with what it was generated from (for
/// argument checks) and its launch shape.
pub struct GpuKernel {
    pub name: String,
    pub program: Program,
    pub launch: LaunchShape,
    /// Dynamic shared memory a block takes ([`CudaSource::shared_bytes`]).
    shared_bytes: u32,
    pub dtype: DType,
    function: CudaFunction,
}

/// One GPU and its stream.
pub struct GpuDevice {
    ordinal: usize,
    name: String,
    arch: Arch,
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    pool: Pool,
    sm_count: u32,
    /// Uploads and downloads so far, every backend's on this device.
    crossings: std::sync::atomic::AtomicU64,
    /// Buffers one rank's thread hands another's on this device
    /// ([`GpuDevice::hand_over`]), by token.
    handed: Mutex<(u64, std::collections::HashMap<u64, Arc<DeviceBuffer>>)>,
}

impl std::fmt::Debug for GpuDevice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "GpuDevice({} {}: {})",
            self.ordinal,
            self.arch.name(),
            self.name
        )
    }
}

fn bytes_of(elem: Elem, dtype: DType) -> usize {
    match elem {
        Elem::Float => dtype.size_bytes() as usize,
        Elem::F32 | Elem::I32 => 4,
    }
}

impl GpuDevice {
    /// Open device `ordinal`, or say why there is no GPU to use.
    pub fn new(ordinal: usize) -> GpuResult<GpuDevice> {
        if !driver_present() {
            return Err(GpuError::CudaUnavailable(
                "the CUDA driver library (libcuda.so.1) cannot be loaded on this machine; \
                 install an NVIDIA driver or run on CPU ranks (--cluster Nxcpu)"
                    .into(),
            ));
        }
        let count = CudaContext::device_count().map_err(|e| {
            GpuError::CudaUnavailable(format!("the driver is present but cuInit failed: {e:?}"))
        })?;
        if ordinal >= count.max(0) as usize {
            return Err(GpuError::CudaUnavailable(format!(
                "device {ordinal} was asked for but the driver sees {count} device(s)"
            )));
        }
        let ctx = CudaContext::new(ordinal).map_err(|e| driver("creating the context", e))?;
        // SAFETY: the backend issues all work of a device on its one stream, in
        // order, so no allocation is used on another stream than its own and
        // cross-stream event tracking has nothing to guard.
        unsafe { ctx.disable_event_tracking() };
        let (major, minor) = ctx
            .compute_capability()
            .map_err(|e| driver("compute capability", e))?;
        let arch = match major {
            9.. => Arch::Sm90,
            8 => Arch::Sm80,
            _ => {
                return Err(GpuError::Unsupported(format!(
                    "compute capability {major}.{minor}: dplc's kernels target sm_80 and sm_90"
                )))
            }
        };
        let name = ctx.name().map_err(|e| driver("device name", e))?;
        let sm_count = ctx
            .attribute(
                cudarc::driver::sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT,
            )
            .map_err(|e| driver("multiprocessor count", e))? as u32;
        let stream = ctx.default_stream();
        let pool = Arc::new(Mutex::new(CachingAllocator::new(DeviceMemory {
            stream: stream.clone(),
        })));
        Ok(GpuDevice {
            ordinal,
            name,
            arch,
            ctx,
            stream,
            pool,
            sm_count,
            crossings: std::sync::atomic::AtomicU64::new(0),
            handed: Mutex::default(),
        })
    }

    pub fn ordinal(&self) -> usize {
        self.ordinal
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    /// The architecture kernels are compiled for.
    pub fn arch(&self) -> Arch {
        self.arch
    }

    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    /// Wait for all work queued on the device's stream.
    pub fn synchronize(&self) -> GpuResult<()> {
        self.stream
            .synchronize()
            .map_err(|e| driver("synchronize", e))
    }

    /// The allocator's counts (peak bytes in use: compare with the planner's prediction).
    pub fn memory_stats(&self) -> MemoryStats {
        self.pool.lock().map(|p| p.stats()).unwrap_or_default()
    }

    pub fn reset_peak_memory(&self) {
        if let Ok(mut p) = self.pool.lock() {
            p.reset_peaks();
        }
    }

    /// Uninitialised device memory of `bytes` bytes (at least 16-byte aligned:
    /// the driver aligns every block to 256 bytes).
    pub fn alloc(&self, bytes: usize) -> GpuResult<DeviceBuffer> {
        let a = self
            .pool
            .lock()
            .map_err(|_| GpuError::Invalid("the allocator lock is poisoned".into()))?
            .alloc(bytes)?;
        Ok(DeviceBuffer {
            alloc: Some(a),
            pool: self.pool.clone(),
            stream: self.stream.clone(),
        })
    }

    /// Zeroed device memory.
    pub fn zeros(&self, bytes: usize) -> GpuResult<DeviceBuffer> {
        let mut b = self.alloc(bytes)?;
        let mut view = b.slice_mut().slice_mut(0..bytes);
        self.stream
            .memset_zeros(&mut view)
            .map_err(|e| driver("memset", e))?;
        Ok(b)
    }

    /// Queue a device-to-device copy of `bytes` bytes.
    pub fn copy(&self, src: &DeviceBuffer, dst: &mut DeviceBuffer, bytes: usize) -> GpuResult<()> {
        if src.bytes() < bytes || dst.bytes() < bytes {
            return Err(GpuError::Invalid(format!(
                "copying {bytes} bytes from {} into {}",
                src.bytes(),
                dst.bytes()
            )));
        }
        // SAFETY: both buffers hold at least `bytes` bytes (checked) and are
        // used on this device's stream only.
        unsafe {
            cudarc::driver::result::memcpy_dtod_async(
                dst.device_ptr(),
                src.device_ptr(),
                bytes,
                self.stream.cu_stream(),
            )
        }
        .map_err(|e| driver("copy on device", e))
    }

    /// Queue a device-to-device copy of `bytes` bytes from `src` at byte
    /// `from` to `dst` at byte `to`.
    pub fn copy_at(
        &self,
        src: &DeviceBuffer,
        from: usize,
        dst: &DeviceBuffer,
        to: usize,
        bytes: usize,
    ) -> GpuResult<()> {
        if from + bytes > src.bytes() || to + bytes > dst.bytes() {
            return Err(GpuError::Invalid(format!(
                "copying {bytes} bytes from {from} of {} to {to} of {}",
                src.bytes(),
                dst.bytes()
            )));
        }
        // SAFETY: both ranges lie inside their buffers (checked), which are
        // used on this device's stream only.
        unsafe {
            cudarc::driver::result::memcpy_dtod_async(
                dst.device_ptr() + to as u64,
                src.device_ptr() + from as u64,
                bytes,
                self.stream.cu_stream(),
            )
        }
        .map_err(|e| driver("copy on device", e))
    }

    /// Leave `buf` for another rank's thread on this device to take by the
    /// returned token ([`GpuDevice::take_over`]): ranks sharing a GPU in
    /// one process hand each other values without a copy. Their work is
    /// queued on the device's one stream, so whatever the giver queued
    /// before handing over is done before anything the taker queues after.
    pub fn hand_over(&self, buf: Arc<DeviceBuffer>) -> u64 {
        let mut handed = self.handed.lock().unwrap_or_else(|p| p.into_inner());
        handed.0 += 1;
        let token = handed.0;
        handed.1.insert(token, buf);
        token
    }

    /// The buffer handed over under `token`, once.
    pub fn take_over(&self, token: u64) -> GpuResult<Arc<DeviceBuffer>> {
        let mut handed = self.handed.lock().unwrap_or_else(|p| p.into_inner());
        handed.1.remove(&token).ok_or_else(|| {
            GpuError::Invalid(format!(
                "no buffer was handed over on this device under token {token}"
            ))
        })
    }

    /// Queue a device-to-device copy of `height` rows of `width` bytes: row
    /// `r` from `src` at byte `from + r·src_pitch` to `dst` at byte `to +
    /// r·dst_pitch` (a block of a row-major matrix into another's).
    pub fn copy_2d(
        &self,
        src: &DeviceBuffer,
        (from, src_pitch): (usize, usize),
        dst: &DeviceBuffer,
        (to, dst_pitch): (usize, usize),
        width: usize,
        height: usize,
    ) -> GpuResult<()> {
        if height == 0 || width == 0 {
            return Ok(());
        }
        let end = |at: usize, pitch: usize| at + (height - 1) * pitch + width;
        if width > src_pitch
            || width > dst_pitch
            || end(from, src_pitch) > src.bytes()
            || end(to, dst_pitch) > dst.bytes()
        {
            return Err(GpuError::Invalid(format!(
                "copying {height} rows of {width} bytes from {from} (pitch {src_pitch}) of {} \
                 to {to} (pitch {dst_pitch}) of {}",
                src.bytes(),
                dst.bytes()
            )));
        }
        use cudarc::driver::sys::{CUmemorytype, CUDA_MEMCPY2D};
        let copy = CUDA_MEMCPY2D {
            srcXInBytes: 0,
            srcY: 0,
            srcMemoryType: CUmemorytype::CU_MEMORYTYPE_DEVICE,
            srcHost: std::ptr::null(),
            srcDevice: src.device_ptr() + from as u64,
            srcArray: std::ptr::null_mut(),
            srcPitch: src_pitch,
            dstXInBytes: 0,
            dstY: 0,
            dstMemoryType: CUmemorytype::CU_MEMORYTYPE_DEVICE,
            dstHost: std::ptr::null_mut(),
            dstDevice: dst.device_ptr() + to as u64,
            dstArray: std::ptr::null_mut(),
            dstPitch: dst_pitch,
            WidthInBytes: width,
            Height: height,
        };
        // SAFETY: every row read and written lies inside its buffer (checked
        // above); both are used on this device's stream only.
        unsafe { cudarc::driver::sys::cuMemcpy2DAsync_v2(&copy, self.stream.cu_stream()) }
            .result()
            .map_err(|e| driver("2-D copy on device", e))
    }

    /// Copy raw bytes to a new device buffer.
    pub fn upload_bytes(&self, data: &[u8]) -> GpuResult<DeviceBuffer> {
        self.crossings
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let mut b = self.alloc(data.len())?;
        let mut view = b.slice_mut().slice_mut(0..data.len());
        self.stream
            .memcpy_htod(data, &mut view)
            .map_err(|e| driver("copy to device", e))?;
        Ok(b)
    }

    /// Overwrite the start of an existing buffer with `data`.
    pub fn write_bytes(&self, b: &mut DeviceBuffer, data: &[u8]) -> GpuResult<()> {
        if data.len() > b.bytes() {
            return Err(GpuError::Invalid(format!(
                "writing {} bytes into a {}-byte buffer",
                data.len(),
                b.bytes()
            )));
        }
        let mut view = b.slice_mut().slice_mut(0..data.len());
        self.stream
            .memcpy_htod(data, &mut view)
            .map_err(|e| driver("copy to device", e))
    }

    /// Overwrite the start of an existing buffer with floats stored as `dtype`.
    pub fn write_f32(&self, b: &mut DeviceBuffer, data: &[f32], dtype: DType) -> GpuResult<()> {
        self.write_bytes(b, &encode(data, dtype)?)
    }

    /// Read back the first `len` bytes of a buffer (waits for the stream).
    pub fn download_bytes(&self, b: &DeviceBuffer, len: usize) -> GpuResult<Vec<u8>> {
        self.crossings
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        if len > b.bytes() {
            return Err(GpuError::Invalid(format!(
                "reading {len} bytes of a {}-byte buffer",
                b.bytes()
            )));
        }
        let mut out = vec![0u8; len];
        let view = b.slice().slice(0..len);
        self.stream
            .memcpy_dtoh(&view, &mut out)
            .map_err(|e| driver("copy to host", e))?;
        self.synchronize()?;
        Ok(out)
    }

    /// Uploads and downloads so far on this device.
    pub fn host_crossings(&self) -> u64 {
        self.crossings.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Upload floats stored as `dtype` (f32, bf16 or f16; rounded to nearest even).
    pub fn upload_f32(&self, data: &[f32], dtype: DType) -> GpuResult<DeviceBuffer> {
        self.upload_bytes(&encode(data, dtype)?)
    }

    /// Read back `len` floats stored as `dtype`.
    pub fn download_f32(&self, b: &DeviceBuffer, len: usize, dtype: DType) -> GpuResult<Vec<f32>> {
        let width = match dtype {
            DType::F32 => 4,
            DType::BF16 | DType::F16 => 2,
            DType::I32 => return Err(GpuError::Invalid("i32 is not a float storage".into())),
        };
        let raw = self.download_bytes(b, len * width)?;
        Ok(decode(&raw, dtype))
    }

    pub fn download_i32(&self, b: &DeviceBuffer, len: usize) -> GpuResult<Vec<i32>> {
        let raw = self.download_bytes(b, len * 4)?;
        Ok(raw
            .chunks_exact(4)
            .map(|c| i32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect())
    }

    pub fn upload_i32(&self, data: &[i32]) -> GpuResult<DeviceBuffer> {
        let raw: Vec<u8> = data.iter().flat_map(|x| x.to_le_bytes()).collect();
        self.upload_bytes(&raw)
    }

    /// Load a compiled kernel into this device.
    pub fn load(
        &self,
        kernel: &Kernel,
        src: &CudaSource,
        ptx: &Ptx,
        dtype: DType,
    ) -> GpuResult<GpuKernel> {
        self.load_program(Program::Kernel(kernel.clone()), src, ptx, dtype)
    }

    /// Load a compiled pass of a fused attention into this device.
    pub fn load_attention(
        &self,
        kernel: &AttentionKernel,
        pass: AttentionPass,
        src: &CudaSource,
        ptx: &Ptx,
        dtype: DType,
    ) -> GpuResult<GpuKernel> {
        let program = Program::Attention {
            kernel: Box::new(kernel.clone()),
            pass,
        };
        self.load_program(program, src, ptx, dtype)
    }

    fn load_program(
        &self,
        program: Program,
        src: &CudaSource,
        ptx: &Ptx,
        dtype: DType,
    ) -> GpuResult<GpuKernel> {
        if ptx.arch != self.arch {
            return Err(GpuError::Invalid(format!(
                "{} was compiled for {}, the device is {}",
                ptx.name,
                ptx.arch.name(),
                self.arch.name()
            )));
        }
        let module = self
            .ctx
            .load_module(cudarc::nvrtc::Ptx::from_src(ptx.text.clone()))
            .map_err(|e| driver(&format!("loading the module of {}", src.name), e))?;
        let function = module
            .load_function(&src.name)
            .map_err(|e| driver(&format!("finding {}", src.name), e))?;
        // Past 48 KB a block's dynamic shared memory must be allowed first.
        if src.shared_bytes > 48 * 1024 {
            function
                .set_attribute(
                    cudarc::driver::sys::CUfunction_attribute_enum::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                    src.shared_bytes as i32,
                )
                .map_err(|e| {
                    driver(
                        &format!(
                            "allowing {} {} bytes of shared memory a block",
                            src.name, src.shared_bytes
                        ),
                        e,
                    )
                })?;
        }
        Ok(GpuKernel {
            name: src.name.clone(),
            program,
            launch: src.launch,
            shared_bytes: src.shared_bytes,
            dtype,
            function,
        })
    }

    /// Launch `k` on the device's stream with one buffer per kernel buffer.
    /// Buffer sizes are checked against the kernel's IR first, so a launch
    /// never reads or writes past an allocation.
    pub fn launch(&self, k: &GpuKernel, buffers: &[&DeviceBuffer], args: &Args) -> GpuResult<()> {
        let program = &k.program;
        let specs = program.buffers();
        if buffers.len() != specs.len()
            || args.sizes.len() != program.sizes()
            || args.scalars.len() != program.scalars()
        {
            return Err(GpuError::Invalid(format!(
                "{}: {} buffers, {} sizes, {} scalars given; it takes {}, {}, {}",
                k.name,
                buffers.len(),
                args.sizes.len(),
                args.scalars.len(),
                specs.len(),
                program.sizes(),
                program.scalars()
            )));
        }
        if args.sizes.iter().any(|&s| s < 0) {
            return Err(GpuError::Invalid(format!("{}: a negative size", k.name)));
        }
        for (i, (b, buf)) in buffers.iter().zip(&specs).enumerate() {
            let len: i64 = buf.len.iter().map(|&s| args.size(s)).product();
            let need = len.max(0) as usize * bytes_of(buf.elem, k.dtype);
            if b.bytes() < need {
                return Err(GpuError::Invalid(format!(
                    "{}: buffer b{i} ({}) holds {} bytes, the launch needs {need}",
                    k.name,
                    buf.label,
                    b.bytes()
                )));
            }
        }
        let outer = program.extent(args);
        let (grid, block) = k.launch.grid(outer, self.sm_count);
        let cfg = LaunchConfig {
            grid_dim: (grid as u32, 1, 1),
            block_dim: (block, 1, 1),
            shared_mem_bytes: k.shared_bytes,
        };
        if outer == 0 {
            return Ok(());
        }
        let ptrs: Vec<u64> = buffers.iter().map(|b| b.device_ptr()).collect();
        let seed = args.seed;
        let mut launch = self.stream.launch_builder(&k.function);
        for p in &ptrs {
            launch.arg(p);
        }
        for s in &args.sizes {
            launch.arg(s);
        }
        for s in &args.scalars {
            launch.arg(s);
        }
        if program.draws() {
            launch.arg(&seed);
        }
        // SAFETY: the arguments are pushed in the order `emit_cuda` (and
        // `emit_attention`, with no scalars) declares the parameters (buffers as device pointers, `long long` sizes, `float`
        // scalars, the `unsigned long long` seed when the kernel draws random
        // numbers), their counts were checked above, and every buffer is at
        // least as large as the kernel indexes it for these sizes.
        unsafe { launch.launch(cfg) }.map_err(|e| driver(&format!("launching {}", k.name), e))?;
        Ok(())
    }
}

/// Host floats to the bytes of `dtype` storage.
pub fn encode(data: &[f32], dtype: DType) -> GpuResult<Vec<u8>> {
    Ok(match dtype {
        DType::F32 => data.iter().flat_map(|x| x.to_le_bytes()).collect(),
        DType::BF16 => data
            .iter()
            .flat_map(|&x| f32_to_bf16(x).to_le_bytes())
            .collect(),
        DType::F16 => data
            .iter()
            .flat_map(|&x| f32_to_f16(x).to_le_bytes())
            .collect(),
        DType::I32 => return Err(GpuError::Invalid("i32 is not a float storage".into())),
    })
}

/// Bytes of `dtype` storage back to floats.
pub fn decode(raw: &[u8], dtype: DType) -> Vec<f32> {
    match dtype {
        DType::F32 | DType::I32 => raw
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes(c.try_into().expect("4 bytes")))
            .collect(),
        DType::BF16 => raw
            .chunks_exact(2)
            .map(|c| bf16_to_f32(u16::from_le_bytes([c[0], c[1]])))
            .collect(),
        DType::F16 => raw
            .chunks_exact(2)
            .map(|c| f16_to_f32(u16::from_le_bytes([c[0], c[1]])))
            .collect(),
    }
}
