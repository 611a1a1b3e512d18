//! The fused executor's backend on a GPU: buffers from the caching
//! allocator, kernels compiled by NVRTC (through its on-disk cache) on first
//! use and loaded once, matmuls on cuBLAS.

use super::blas::Blas;
use super::device::{DeviceBuffer, GpuDevice, GpuKernel};
use super::error::{GpuError, GpuResult};
use crate::error::Result;
use crate::fused::{Backend, MatMul};
use dplc_codegen::{
    attention_name, emit_attention, emit_attention_tuned, emit_cuda, kernel_name, Args,
    AttentionKernel, AttentionPass, AttentionTuning, Elem, Kernel, Nvrtc,
};
use dplc_ir::DType;
use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::time::Instant;

/// One rank's view of a GPU.
pub struct CudaBackend {
    dev: Arc<GpuDevice>,
    blas: Blas,
    nvrtc: Nvrtc,
    dtype: DType,
    kernels: KernelCache<GpuKernel>,
    /// Fused attention passes, by the launched pass's name
    /// (`{pass}_{dtype}_{hash8}`), each as `tuning` emits it.
    attention: HashMap<String, GpuKernel>,
    /// `DPLC_ATTENTION_TUNING=w8_k8` (say): the fused attention's passes as
    /// one of the tunings the GPU benchmark times
    /// ([`dplc_codegen::AttentionTuning::parse`]), to time a whole step
    /// with them before the codegen launches them; unset, the launched.
    tuning: AttentionTuning,
    /// `DPLC_CHECK_FINITE=1`: wait for every launch and fail, naming it,
    /// at the first that writes a NaN or an infinity ([`Self::check_finite`]);
    /// `=trace` also prints what every launch read and wrote.
    check_finite: bool,
    trace: bool,
    /// `DPLC_PROFILE=1`: every call waited for and timed ([`Profile`]).
    profile: Option<Profile>,
}

/// A per-call profile for machines without Nsight: each launch, matmul and
/// memory operation is waited for before and after and its time added to
/// its kernel's (or operation's) row; the table goes to stderr when the
/// backend drops. Waiting serialises the GPU with the host, so the rows are
/// device time plus a launch each, and the gap to the wall time is the
/// host's own. A row's first call also pays for loading its kernel (NVRTC's
/// compile, cuBLAS's lazily loaded modules), so rows are ranked by their
/// steady time, the median call's times the count.
struct Profile {
    opened: Instant,
    calls: BTreeMap<String, Vec<f64>>,
}

impl Profile {
    fn report(&self, device: &str) -> String {
        let wall = self.opened.elapsed().as_secs_f64();
        let busy: f64 = self.calls.values().flatten().sum();
        let mut rows: Vec<(&String, usize, f64, f64, f64)> = self
            .calls
            .iter()
            .map(|(what, times)| {
                let mut sorted = times.clone();
                sorted.sort_by(f64::total_cmp);
                let median = sorted[sorted.len() / 2];
                let max = sorted[sorted.len() - 1];
                (what, times.len(), times.iter().sum(), median, max)
            })
            .collect();
        rows.sort_by(|a, b| (b.3 * b.1 as f64).total_cmp(&(a.3 * a.1 as f64)));
        let steady: f64 = rows.iter().map(|r| r.3 * r.1 as f64).sum();
        let mut out = format!(
            "DPLC_PROFILE on {device}: {wall:.3} s since the backend opened, {busy:.3} s in its calls, \
             {steady:.3} s at each call's median\n\
             {:>8} {:>11} {:>11} {:>10} {:>10} {:>6}  what\n",
            "calls", "steady ms", "total ms", "median us", "max us", "share"
        );
        for (what, n, total, median, max) in rows.iter().take(40) {
            let steady = median * *n as f64;
            out += &format!(
                "{n:>8} {:>11.3} {:>11.3} {:>10.1} {:>10.1} {:>5.1}%  {what}\n",
                steady * 1e3,
                total * 1e3,
                median * 1e6,
                max * 1e6,
                100.0 * steady / wall.max(1e-12)
            );
        }
        if rows.len() > 40 {
            out += &format!("   … {} more\n", rows.len() - 40);
        }
        out
    }
}

impl Drop for CudaBackend {
    fn drop(&mut self) {
        if let Some(p) = &self.profile {
            if !p.calls.is_empty() {
                eprint!("{}", p.report(self.dev.name()));
            }
        }
    }
}

/// One buffer of a launch, as [`CudaBackend::check_finite`] reads it.
struct Bound<'a> {
    label: String,
    output: bool,
    elem: Elem,
    len: usize,
    buf: &'a DeviceBuffer,
}

/// Loaded kernels by name, found without naming them on every launch.
///
/// A kernel's name renders and hashes its whole text (3–4 µs for gpt2's
/// kernels, `cargo bench --bench kernel_lookup`), too slow for every launch.
/// So the cache remembers which name the kernel at each address had, with a
/// copy of that kernel: comparing the copy (about 0.1 µs) proves the kernel
/// there is still the same one, and only a new or changed kernel is named
/// again.
pub(crate) struct KernelCache<T> {
    by_name: HashMap<String, T>,
    by_address: HashMap<usize, (Kernel, String)>,
}

impl<T> KernelCache<T> {
    pub(crate) fn new() -> Self {
        KernelCache {
            by_name: HashMap::new(),
            by_address: HashMap::new(),
        }
    }

    /// The entry for `k`, made by `load(k, name)` the first time its name is seen.
    pub(crate) fn get_or_load<E>(
        &mut self,
        k: &Kernel,
        dtype: DType,
        load: impl FnOnce(&Kernel) -> Result<T, E>,
    ) -> Result<&T, E> {
        let address = k as *const Kernel as usize;
        let known = matches!(self.by_address.get(&address), Some((seen, _)) if seen == k);
        if !known {
            let name = kernel_name(k, dtype);
            if !self.by_name.contains_key(&name) {
                let loaded = load(k)?;
                self.by_name.insert(name.clone(), loaded);
            }
            self.by_address.insert(address, (k.clone(), name));
        }
        let name = &self.by_address[&address].1;
        Ok(&self.by_name[name])
    }

    pub(crate) fn len(&self) -> usize {
        self.by_name.len()
    }
}

impl CudaBackend {
    /// A backend on `dev` with float tensors stored as `dtype`.
    pub fn new(dev: Arc<GpuDevice>, dtype: DType) -> GpuResult<CudaBackend> {
        dev.context()
            .bind_to_thread()
            .map_err(|e| super::error::driver("binding the context", e))?;
        let blas = Blas::new(&dev)?;
        let nvrtc = Nvrtc::load()?;
        let tuning = match std::env::var("DPLC_ATTENTION_TUNING") {
            Ok(text) => AttentionTuning::parse(&text)
                .map_err(|e| GpuError::Invalid(format!("DPLC_ATTENTION_TUNING: {e}")))?,
            Err(_) => AttentionTuning::LAUNCHED,
        };
        Ok(CudaBackend {
            dev,
            blas,
            nvrtc,
            dtype,
            kernels: KernelCache::new(),
            attention: HashMap::new(),
            tuning,
            check_finite: std::env::var_os("DPLC_CHECK_FINITE").is_some_and(|v| !v.is_empty()),
            trace: std::env::var_os("DPLC_CHECK_FINITE").is_some_and(|v| v == "trace"),
            profile: std::env::var_os("DPLC_PROFILE")
                .is_some_and(|v| v == "1")
                .then(|| Profile {
                    opened: Instant::now(),
                    calls: BTreeMap::new(),
                }),
        })
    }

    pub fn device(&self) -> &Arc<GpuDevice> {
        &self.dev
    }

    /// Compile and load `kernels` now (so a bad kernel fails before step 1);
    /// returns how many distinct kernels are loaded.
    pub fn preload(&mut self, kernels: &[Kernel]) -> GpuResult<usize> {
        for k in kernels {
            self.kernel(k)?;
        }
        Ok(self.kernels.len())
    }

    fn kernel(&mut self, k: &Kernel) -> GpuResult<&GpuKernel> {
        let (dev, nvrtc, dtype) = (&self.dev, &self.nvrtc, self.dtype);
        self.kernels.get_or_load(k, dtype, |k| {
            let src = emit_cuda(k, dtype);
            let ptx = nvrtc.compile(&src, dev.arch())?;
            dev.load(k, &src, &ptx, dtype)
        })
    }

    fn storage(&self, elem: Elem) -> DType {
        match elem {
            Elem::Float => self.dtype,
            Elem::F32 => DType::F32,
            Elem::I32 => DType::I32,
        }
    }

    /// Wait for the launch `what` and fail if an output holds a NaN or an
    /// infinity, saying how many and what each buffer held (non-finite
    /// count, largest magnitude): the first kernel to make one is the fault,
    /// or its inputs were already out of range. Slow — a debugging switch.
    fn check_finite(&self, what: &str, bound: &[Bound<'_>]) -> Result<()> {
        self.dev.synchronize()?;
        let mut bad = false;
        let mut report = Vec::new();
        for b in bound {
            if b.elem == Elem::I32 || b.len == 0 {
                continue;
            }
            let v = self.dev.download_f32(b.buf, b.len, self.storage(b.elem))?;
            let non_finite = v.iter().filter(|x| !x.is_finite()).count();
            let max = v
                .iter()
                .filter(|x| x.is_finite())
                .fold(0.0f32, |m, x| m.max(x.abs()));
            let mean = v
                .iter()
                .filter(|x| x.is_finite())
                .map(|x| f64::from(x.abs()))
                .sum::<f64>()
                / v.len().max(1) as f64;
            bad |= b.output && non_finite > 0;
            report.push(format!(
                "{} {} ({} elements): {non_finite} non-finite, max |x| {max:e}, mean |x| {mean:e}",
                if b.output { "wrote" } else { "read" },
                b.label,
                b.len
            ));
        }
        if self.trace {
            eprintln!("launch {what}: {}", report.join("; "));
        }
        if bad {
            return Err(GpuError::Invalid(format!(
                "DPLC_CHECK_FINITE: {what} wrote a NaN or an infinity: {}",
                report.join("; ")
            ))
            .into());
        }
        Ok(())
    }

    /// Under `DPLC_PROFILE`, wait for the queue and start a call's clock.
    fn begin(&self) -> Result<Option<Instant>> {
        if self.profile.is_none() {
            return Ok(None);
        }
        self.dev.synchronize()?;
        Ok(Some(Instant::now()))
    }

    /// Under `DPLC_PROFILE`, wait for the call begun at `t0` and add its
    /// time to `what`'s row.
    fn end(&mut self, t0: Option<Instant>, what: impl FnOnce() -> String) -> Result<()> {
        let Some(t0) = t0 else { return Ok(()) };
        self.dev.synchronize()?;
        let t = t0.elapsed().as_secs_f64();
        if let Some(p) = &mut self.profile {
            p.calls.entry(what()).or_default().push(t);
        }
        Ok(())
    }

    fn bytes(&self, elem: Elem, len: usize) -> usize {
        // Never a zero-byte allocation: a scalar view may be read as one element.
        len.max(1) * self.storage(elem).size_bytes() as usize
    }
}

impl Backend for CudaBackend {
    type Buf = Arc<DeviceBuffer>;

    fn unique(buf: &Self::Buf) -> bool {
        Arc::strong_count(buf) == 1
    }

    fn dtype(&self) -> DType {
        self.dtype
    }

    fn zeros(&mut self, elem: Elem, len: usize) -> Result<Self::Buf> {
        let t0 = self.begin()?;
        let b = Arc::new(self.dev.zeros(self.bytes(elem, len))?);
        self.end(t0, || "zeros (alloc and memset)".into())?;
        Ok(b)
    }

    fn alloc(&mut self, elem: Elem, len: usize) -> Result<Self::Buf> {
        let t0 = self.begin()?;
        let b = Arc::new(self.dev.alloc(self.bytes(elem, len))?);
        self.end(t0, || "alloc".into())?;
        Ok(b)
    }

    fn upload(&mut self, elem: Elem, data: &[f32]) -> Result<Self::Buf> {
        if elem == Elem::I32 {
            return Err(GpuError::Invalid("upload of floats as i32".into()).into());
        }
        let t0 = self.begin()?;
        let b = Arc::new(self.dev.upload_f32(data, self.storage(elem))?);
        self.end(t0, || "upload".into())?;
        Ok(b)
    }

    fn upload_i32(&mut self, data: &[i32]) -> Result<Self::Buf> {
        let t0 = self.begin()?;
        let b = Arc::new(self.dev.upload_i32(data)?);
        self.end(t0, || "upload".into())?;
        Ok(b)
    }

    fn download(&mut self, buf: &Self::Buf, elem: Elem, len: usize) -> Result<Vec<f32>> {
        let t0 = self.begin()?;
        let v = self.dev.download_f32(buf, len, self.storage(elem))?;
        self.end(t0, || "download".into())?;
        Ok(v)
    }

    fn download_i32(&mut self, buf: &Self::Buf, len: usize) -> Result<Vec<i32>> {
        let t0 = self.begin()?;
        let v = self.dev.download_i32(buf, len)?;
        self.end(t0, || "download".into())?;
        Ok(v)
    }

    fn copy(
        &mut self,
        src: &Self::Buf,
        from: usize,
        dst: &Self::Buf,
        to: usize,
        len: usize,
    ) -> Result<()> {
        let w = self.bytes(Elem::F32, 1);
        let t0 = self.begin()?;
        self.dev.copy_at(src, from * w, dst, to * w, len * w)?;
        self.end(t0, || "copy".into())
    }

    fn copy_rows(
        &mut self,
        elem: Elem,
        (src, from, src_stride): (&Self::Buf, usize, usize),
        (dst, to, dst_stride): (&Self::Buf, usize, usize),
        rows: usize,
        width: usize,
    ) -> Result<()> {
        let w = self.bytes(elem, 1);
        let t0 = self.begin()?;
        if rows == 1 {
            // One row: a plain copy (a 2-D copy's pitch is capped at 2 GiB,
            // and one row's stride is the whole tensor's).
            self.dev.copy_at(src, from * w, dst, to * w, width * w)?;
            return self.end(t0, || "copy_rows".into());
        }
        self.dev.copy_2d(
            src,
            (from * w, src_stride * w),
            dst,
            (to * w, dst_stride * w),
            width * w,
            rows,
        )?;
        self.end(t0, || "copy_rows".into())
    }

    fn launch(&mut self, kernel: &Kernel, args: &Args, bufs: &[Self::Buf]) -> Result<()> {
        let dev = self.dev.clone();
        let check = self.check_finite;
        if self.profile.is_some() {
            // Compiled and loaded outside the clock.
            self.kernel(kernel)?;
        }
        let t0 = self.begin()?;
        let k = self.kernel(kernel)?;
        let refs: Vec<&DeviceBuffer> = bufs.iter().map(|b| &**b).collect();
        dev.launch(k, &refs, args)?;
        let name = (check || t0.is_some()).then(|| k.name.clone());
        self.end(t0, || name.clone().unwrap_or_default())?;
        if let Some(name) = name.filter(|_| check) {
            let bound: Vec<Bound<'_>> = kernel
                .buffers
                .iter()
                .enumerate()
                .map(|(i, b)| Bound {
                    label: b.label.clone(),
                    output: b.output,
                    elem: b.elem,
                    len: args.buffer_len(kernel, i),
                    buf: &bufs[i],
                })
                .collect();
            self.check_finite(&name, &bound)?;
        }
        Ok(())
    }

    fn attention(
        &mut self,
        kernel: &AttentionKernel,
        pass: AttentionPass,
        args: &Args,
        bufs: &[Self::Buf],
    ) -> Result<()> {
        let name = attention_name(kernel, pass, self.dtype);
        if !self.attention.contains_key(&name) {
            let src = emit_attention_tuned(kernel, pass, self.dtype, self.tuning)
                .unwrap_or_else(|| emit_attention(kernel, pass, self.dtype));
            let ptx = self
                .nvrtc
                .compile(&src, self.dev.arch())
                .map_err(GpuError::from)?;
            let loaded = self
                .dev
                .load_attention(kernel, pass, &src, &ptx, self.dtype)?;
            self.attention.insert(name.clone(), loaded);
        }
        let refs: Vec<&DeviceBuffer> = bufs.iter().map(|b| &**b).collect();
        let t0 = self.begin()?;
        self.dev.launch(&self.attention[&name], &refs, args)?;
        // The profile's row and a failure name the pass as it ran (a
        // tuned pass's name says its tuning).
        let name = self.attention[&name].name.clone();
        self.end(t0, || name.clone())?;
        if self.check_finite {
            let bound: Vec<Bound<'_>> = kernel
                .buffers(pass)
                .into_iter()
                .enumerate()
                .map(|(i, b)| Bound {
                    len: b.len.iter().map(|&s| args.size(s)).product::<i64>() as usize,
                    label: b.label,
                    output: b.output,
                    elem: b.elem,
                    buf: &bufs[i],
                })
                .collect();
            self.check_finite(&name, &bound)?;
        }
        Ok(())
    }

    fn matmul(&mut self, mm: &MatMul, a: &Self::Buf, b: &Self::Buf, c: &Self::Buf) -> Result<()> {
        let t0 = self.begin()?;
        self.blas.matmul(&self.dev, mm, a, b, c)?;
        self.end(t0, || {
            format!(
                "matmul {}x{}x{}{}{}{}",
                mm.m,
                mm.n,
                mm.k,
                if mm.batch > 1 {
                    format!(" ×{}", mm.batch)
                } else {
                    String::new()
                },
                if mm.a_transposed { " Aᵀ" } else { "" },
                if mm.b_transposed { " Bᵀ" } else { "" }
            )
        })?;
        if self.check_finite {
            let (a_len, b_len) = (
                mm.m * mm.k * if mm.a_batched { mm.batch } else { 1 },
                mm.k * mm.n * if mm.b_batched { mm.batch } else { 1 },
            );
            let bound = [
                ("A", false, a_len, a),
                ("B", false, b_len, b),
                ("C", true, mm.m * mm.n * mm.batch, c),
            ]
            .map(|(label, output, len, buf)| Bound {
                label: label.into(),
                output,
                elem: Elem::Float,
                len,
                buf,
            });
            self.check_finite(&format!("{mm:?}"), &bound)?;
        }
        Ok(())
    }

    fn synchronize(&mut self) -> Result<()> {
        Ok(self.dev.synchronize()?)
    }

    fn host_crossings(&self) -> Option<u64> {
        Some(self.dev.host_crossings())
    }

    fn peak_bytes(&self) -> Option<usize> {
        Some(self.dev.memory_stats().peak_requested)
    }
}

impl crate::params::HandOver for CudaBackend {
    fn hand_over(&self, buf: Self::Buf) -> u64 {
        self.device().hand_over(buf)
    }

    fn take_over(&self, token: u64) -> Result<Self::Buf> {
        Ok(self.device().take_over(token)?)
    }
}

#[cfg(test)]
mod tests {
    use super::KernelCache;
    use super::Profile;
    use dplc_codegen::{add_kernel, convert_kernel, Elem};
    use dplc_ir::DType;
    use std::collections::BTreeMap;
    use std::time::Instant;

    #[test]
    fn the_cache_loads_each_kernel_once_and_notices_a_changed_one() {
        let mut cache: KernelCache<String> = KernelCache::new();
        let mut loads = 0;
        let mut get = |cache: &mut KernelCache<String>, k: &dplc_codegen::Kernel| {
            cache
                .get_or_load(k, DType::BF16, |k| {
                    loads += 1;
                    Ok::<_, ()>(k.op.clone())
                })
                .unwrap()
                .clone()
        };
        let mut k = add_kernel(Elem::F32, Elem::F32, Elem::F32);
        let twin = k.clone();
        assert_eq!(get(&mut cache, &k), "add_f32_f32_f32");
        assert_eq!(get(&mut cache, &k), "add_f32_f32_f32");
        // The same kernel at another address: named again, not loaded again.
        assert_eq!(get(&mut cache, &twin), "add_f32_f32_f32");
        // Another kernel at the same address is not taken for the old one.
        k = convert_kernel(Elem::Float, Elem::F32);
        assert_eq!(get(&mut cache, &k), "convert_x_f32");
        assert_eq!(cache.len(), 2);
        assert_eq!(loads, 2);
    }

    /// A kernel whose first call paid for its loading ranks by its steady
    /// calls: 100 calls of 60 µs after one of 70 ms come after 10 calls of
    /// 1 ms.
    #[test]
    fn the_profile_ranks_rows_by_their_steady_time() {
        let mut calls = BTreeMap::new();
        let mut loaded = vec![70e-3];
        loaded.extend([60e-6; 99]);
        calls.insert("matmul loaded lazily".to_string(), loaded);
        calls.insert("attention".to_string(), vec![1e-3; 10]);
        let p = Profile {
            opened: Instant::now(),
            calls,
        };
        let report = p.report("test");
        let rows: Vec<&str> = report.lines().skip(2).collect();
        assert!(rows[0].ends_with("attention"), "{report}");
        assert!(
            rows[1].contains("      6.000 ") && rows[1].contains("70000.0"),
            "{report}"
        );
    }
}
