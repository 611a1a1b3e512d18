//! The CUDA backend. On a machine without a driver the first test checks the
//! seam's error and every other test prints why it is skipped; on a GPU each
//! generated kernel (forward and backward, f32 and bf16) equals the CPU
//! interpreter on random inputs, cuBLAS equals a CPU matmul, the allocator's
//! peak is what was asked for, and the collectives sum.
//!
//! `scripts/gpu-check.sh` runs these plus the `#[ignore]`d bandwidth benchmark.

mod common;

use dplc_codegen::{
    adamw_kernel, adamw_value_kernel, interpret, Args, BackwardStep, Data, Elem, Kernel, Nvrtc,
    Step,
};
use dplc_ir::{DType, Dim, Graph};
use dplc_runtime::gpu::{
    compile_graph, driver_present, matmul_cpu, nccl_present, open_devices, Blas, DeviceBuffer,
    DeviceCollectives, GpuDevice, GpuError, MatMul, NcclCommunicator,
};
use std::collections::HashMap;
use std::sync::Arc;
use std::time::Instant;

/// Say why a test is skipped, past the test harness's output capture, so a
/// passing run on a machine without a GPU still shows it.
fn skip(test: &str, why: impl std::fmt::Display) {
    use std::io::Write;
    let _ = writeln!(std::io::stderr(), "SKIPPED {test}: {why}");
}

/// The device, or `None` after printing why this test is skipped.
fn gpu_or_skip(test: &str) -> Option<Arc<GpuDevice>> {
    match GpuDevice::new(0) {
        Ok(d) => Some(Arc::new(d)),
        Err(e) => {
            skip(test, e);
            None
        }
    }
}

fn nvrtc_or_skip(test: &str) -> Option<Nvrtc> {
    match Nvrtc::load() {
        Ok(n) => Some(n),
        Err(e) => {
            skip(test, e);
            None
        }
    }
}

#[test]
fn without_a_driver_the_seam_says_no_cuda_driver_found() {
    if driver_present() {
        skip(
            "without_a_driver_the_seam_says_no_cuda_driver_found",
            "this machine has a CUDA driver",
        );
        return;
    }
    let e = GpuDevice::new(0).unwrap_err();
    assert!(matches!(e, GpuError::CudaUnavailable(_)), "{e:?}");
    assert!(e.to_string().starts_with("no CUDA driver found"), "{e}");
    let e = open_devices(8).unwrap_err();
    assert!(e.to_string().contains("no CUDA driver found"), "{e}");
    // Through the crate's error type, as the CLI sees it.
    let r: dplc_runtime::RuntimeError = e.into();
    assert!(r.to_string().contains("no CUDA driver found"), "{r}");
}

/// Every kernel of a GPT (forward, backward, column sums, AdamW; the fused
/// attention's passes) compiles to
/// PTX for both architectures through `compile_graph`: NVRTC only, no GPU.
#[test]
fn a_gpt_compiles_for_sm80_and_sm90() {
    let test = "a_gpt_compiles_for_sm80_and_sm90";
    let Some(nvrtc) = nvrtc_or_skip(test) else {
        return;
    };
    let dir = std::env::temp_dir().join(format!("dplc-gpu-ptx-{}", std::process::id()));
    let nvrtc = nvrtc.with_cache(Some(dir.clone()));
    let g = common::Gpt::default().build();
    for arch in dplc_codegen::Arch::ALL {
        let c = compile_graph(&g, DType::BF16, arch, dplc_ir::AttentionKind::Fused, &nvrtc)
            .unwrap_or_else(|e| panic!("{e}"));
        assert!(c.kernels.len() >= 20, "{} kernels", c.kernels.len());
        // The fused attention's forward and its two backward passes.
        assert_eq!(c.attention.len(), 3, "{:?}", c.attention.keys());
        assert!(c
            .attention
            .values()
            .all(|a| a.ptx.text.contains(&a.source.name)));
        assert!(c
            .kernels
            .values()
            .all(|k| k.ptx.text.contains(&k.source.name)));
        let backwards = c
            .regions
            .iter()
            .flat_map(|(_, _, b)| b)
            .filter(|s| matches!(s, BackwardStep::Kernel { .. }))
            .count();
        assert!(backwards >= 8, "{backwards} backward kernels");
    }
    std::fs::remove_dir_all(dir).ok();
}

fn dim(d: &Dim, syms: &HashMap<String, i64>, g: &Graph) -> i64 {
    let mut v = d.coeff();
    for s in d.syms() {
        v = v
            .checked_mul(dplc_ir::Ratio::int(syms[&g.sym_names()[s.index()]]))
            .expect("small sizes");
    }
    v.as_int().expect("whole dimension")
}

/// `‖got − want‖ / ‖want‖`, infinities that agree left out (a masked
/// score's −∞ on both sides).
fn relative_error(got: &[f32], want: &[f32]) -> f64 {
    let (mut num, mut den) = (0.0f64, 0.0f64);
    for (x, y) in got.iter().zip(want) {
        if y.is_infinite() && x == y {
            continue;
        }
        num += (f64::from(*x) - f64::from(*y)).powi(2);
        den += f64::from(*y).powi(2);
    }
    num.sqrt() / den.sqrt().max(1e-30)
}

struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self
            .0
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        self.0 >> 33
    }
    fn normal_ish(&mut self) -> f32 {
        let u = |r: &mut Rng| (r.next() % 1_000_000) as f32 / 1_000_000.0;
        (u(self) + u(self) + u(self) - 1.5) * 1.4
    }
}

/// Round through the storage type, so the interpreter sees what the GPU reads.
fn stored(x: f32, elem: Elem, dtype: DType) -> f32 {
    let d = if elem == Elem::Float {
        dtype
    } else {
        DType::F32
    };
    dplc_runtime::gpu::decode(&dplc_runtime::gpu::encode(&[x], d).unwrap(), d)[0]
}

/// Run `k` on the GPU and in the interpreter on the same random inputs;
/// returns the worst norm-wise relative error over the outputs.
/// Worst norm-wise relative error of `k` on the GPU against the interpreter,
/// on random inputs; the buffers in `non_negative` are drawn as magnitudes
/// (a second moment, which AdamW takes the root of). A backward reading row
/// statistics (`row_stats`: its forward and itself) is given those its
/// forward computes from the same inputs.
fn compare(
    dev: &GpuDevice,
    compiled: &dplc_runtime::gpu::CompiledGraph,
    k: &Kernel,
    args: &Args,
    rng: &mut Rng,
    non_negative: &[usize],
    row_stats: Option<(&Kernel, &dplc_codegen::Backward)>,
) -> f64 {
    let dtype = compiled.dtype;
    let ck = compiled.get(k).expect("compiled");
    let gk = dev
        .load(&ck.kernel, &ck.source, &ck.ptx, dtype)
        .expect("loads");
    let mut host: Vec<Data> = Vec::new();
    let mut bufs: Vec<DeviceBuffer> = Vec::new();
    let stats_at = row_stats.and_then(|(_, bwd)| {
        bwd.bindings
            .iter()
            .position(|b| *b == dplc_codegen::GradBinding::RowStats)
    });
    for (i, b) in k.buffers.iter().enumerate() {
        let n = args.buffer_len(k, i);
        if Some(i) == stats_at {
            // Placeholder: the statistics follow from the other inputs.
            host.push(Data::F32(vec![]));
            bufs.push(dev.zeros(n * 4).expect("alloc"));
            continue;
        }
        let width = if b.elem == Elem::Float {
            dtype.size_bytes() as usize
        } else {
            4
        };
        if b.output {
            host.push(Data::F32(vec![]));
            bufs.push(dev.zeros(n * width).expect("alloc"));
        } else if b.elem == Elem::I32 {
            let v: Vec<i32> = (0..n).map(|_| (rng.next() % 4) as i32).collect();
            bufs.push(dev.upload_i32(&v).expect("upload"));
            host.push(Data::I32(v));
        } else {
            let magnitude = non_negative.contains(&i);
            let v: Vec<f32> = (0..n)
                .map(|_| {
                    let x = rng.normal_ish();
                    stored(if magnitude { x.abs() } else { x }, b.elem, dtype)
                })
                .collect();
            let d = if b.elem == Elem::Float {
                dtype
            } else {
                DType::F32
            };
            bufs.push(dev.upload_f32(&v, d).expect("upload"));
            host.push(Data::F32(v));
        }
    }
    if let (Some(at), Some((forward, bwd))) = (stats_at, row_stats) {
        let stats = bwd
            .row_stats(forward, args, &host)
            .expect("interprets")
            .expect("statistics");
        bufs[at] = dev.upload_f32(stats.f32(), DType::F32).expect("upload");
        host[at] = stats;
    }
    let refs: Vec<&DeviceBuffer> = bufs.iter().collect();
    dev.launch(&gk, &refs, args)
        .unwrap_or_else(|e| panic!("{}: {e}", gk.name));
    interpret(k, args, &mut host).expect("interprets");
    let mut worst = 0.0f64;
    for (i, b) in k.buffers.iter().enumerate() {
        if !b.output {
            continue;
        }
        let want = host[i].f32();
        let d = if b.elem == Elem::Float {
            dtype
        } else {
            DType::F32
        };
        let got = dev.download_f32(&bufs[i], want.len(), d).expect("download");
        let rel = relative_error(&got, want);
        assert!(rel.is_finite(), "{}: non-finite output", gk.name);
        worst = worst.max(rel);
    }
    worst
}

fn kernels_match(dtype: DType, tol: f64, test: &str) {
    let Some(dev) = gpu_or_skip(test) else { return };
    let Some(nvrtc) = nvrtc_or_skip(test) else {
        return;
    };
    let g = common::Gpt::default().build();
    let compiled = compile_graph(&g, dtype, dev.arch(), dplc_ir::AttentionKind::Fused, &nvrtc)
        .expect("compiles");
    let syms: HashMap<String, i64> = [("batch".to_string(), 3), ("seq".to_string(), 8)].into();
    let mut rng = Rng(5);
    let mut checked = 0;
    for (_, plan, back) in &compiled.regions {
        for step in &plan.steps {
            let Step::Kernel(fk) = step else { continue };
            let sizes: Vec<i64> = fk.sizes.iter().map(|d| dim(d, &syms, &g)).collect();
            let args = Args {
                sizes: sizes.clone(),
                scalars: vec![],
                seed: 9,
            };
            let err = compare(&dev, &compiled, &fk.kernel, &args, &mut rng, &[], None);
            assert!(
                err <= tol,
                "{} ({dtype:?}): relative error {err:e} > {tol:e}",
                fk.kernel.op
            );
            checked += 1;
        }
        for step in back {
            let BackwardStep::Kernel { step, backward } = step else {
                continue;
            };
            let Step::Kernel(fk) = &plan.steps[*step] else {
                unreachable!("kernels have kernel backwards")
            };
            let sizes: Vec<i64> = fk.sizes.iter().map(|d| dim(d, &syms, &g)).collect();
            let args = Args {
                sizes: sizes.clone(),
                scalars: vec![],
                seed: 9,
            };
            let stats = fk.keeps_row_stats.then_some((&fk.kernel, backward));
            let err = compare(
                &dev,
                &compiled,
                &backward.kernel,
                &args,
                &mut rng,
                &[],
                stats,
            );
            assert!(
                err <= tol,
                "{} ({dtype:?}): relative error {err:e} > {tol:e}",
                backward.kernel.op
            );
            checked += 1;
            for cs in &backward.column_sums {
                let cargs = Args {
                    sizes: cs.sizes(&sizes),
                    scalars: vec![],
                    seed: 0,
                };
                let err = compare(&dev, &compiled, &cs.kernel, &cargs, &mut rng, &[], None);
                assert!(err <= tol, "column_sum ({dtype:?}): {err:e}");
            }
        }
    }
    // A long column sum's first pass (2,100 rows in chunks of 1,024).
    let chunks = dplc_codegen::column_chunk_kernel();
    let cargs = Args {
        sizes: vec![2100, 65, 1024, 3],
        scalars: vec![],
        seed: 0,
    };
    let err = compare(&dev, &compiled, &chunks, &cargs, &mut rng, &[], None);
    assert!(err <= tol, "column_chunk ({dtype:?}): {err:e}");
    let adamw = adamw_kernel();
    let args = dplc_codegen::AdamwScalars {
        lr: 1e-3,
        beta1: 0.9,
        beta2: 0.95,
        eps: 1e-8,
        weight_decay: 0.1,
        step: 3,
        grad_scale: 1.0,
    }
    .args(4099);
    // Buffers p', m', v', then p, g, m, v: the input v is a second moment;
    // the variant writes the compute's copy after them.
    for adamw in [adamw, adamw_value_kernel()] {
        let err = compare(&dev, &compiled, &adamw, &args, &mut rng, &[6], None);
        assert!(err <= tol, "{} ({dtype:?}): {err:e}", adamw.op);
    }
    eprintln!(
        "{checked} kernels + AdamW match the interpreter on {} ({dtype:?})",
        dev.name()
    );
}

#[test]
fn every_kernel_matches_the_interpreter_f32() {
    kernels_match(DType::F32, 1e-5, "every_kernel_matches_the_interpreter_f32");
}

#[test]
fn every_kernel_matches_the_interpreter_bf16() {
    kernels_match(
        DType::BF16,
        1e-2,
        "every_kernel_matches_the_interpreter_bf16",
    );
}

#[test]
fn cublas_matmul_matches_cpu() {
    let Some(dev) = gpu_or_skip("cublas_matmul_matches_cpu") else {
        return;
    };
    let blas = Blas::new(&dev).expect("cuBLAS");
    let mut rng = Rng(1);
    for dtype in [DType::F32, DType::BF16] {
        for (ta, tb, ab, bb) in [
            (false, false, true, false),
            (false, true, true, true),
            (true, false, false, true),
        ] {
            let mm = MatMul {
                m: 37,
                n: 19,
                k: 64,
                batch: 3,
                a_transposed: ta,
                b_transposed: tb,
                a_batched: ab,
                b_batched: bb,
                dtype,
            };
            let na = mm.m * mm.k * if ab { mm.batch } else { 1 };
            let nb = mm.k * mm.n * if bb { mm.batch } else { 1 };
            let a: Vec<f32> = (0..na)
                .map(|_| stored(rng.normal_ish(), Elem::Float, dtype))
                .collect();
            let b: Vec<f32> = (0..nb)
                .map(|_| stored(rng.normal_ish(), Elem::Float, dtype))
                .collect();
            let da = dev.upload_f32(&a, dtype).unwrap();
            let db = dev.upload_f32(&b, dtype).unwrap();
            let dc = dev
                .alloc(mm.batch * mm.m * mm.n * dtype.size_bytes() as usize)
                .unwrap();
            blas.matmul(&dev, &mm, &da, &db, &dc).unwrap();
            let got = dev
                .download_f32(&dc, mm.batch * mm.m * mm.n, dtype)
                .unwrap();
            let want = matmul_cpu(&mm, &a, &b);
            let tol = if dtype == DType::F32 { 1e-4 } else { 1e-2 };
            for (x, y) in got.iter().zip(&want) {
                assert!((x - y).abs() <= tol * (1.0 + y.abs()), "{mm:?}: {x} vs {y}");
            }
        }
    }
}

/// Matmuls whose every dimension is no multiple of 8, in every
/// transposition, through the padded, aligned scratch a large one takes
/// (forced here at a small size, with scratch for 64 rows, so the blocks
/// are ragged): zero padding of n and k, B copied whole, against the CPU.
#[test]
fn an_unaligned_matmul_through_aligned_scratch_matches_cpu() {
    let Some(dev) = gpu_or_skip("an_unaligned_matmul_through_aligned_scratch_matches_cpu") else {
        return;
    };
    let blas = Blas::new(&dev).expect("cuBLAS");
    let mut rng = Rng(5);
    for dtype in [DType::BF16, DType::F16] {
        for (ta, tb) in [(false, true), (false, false), (true, false), (true, true)] {
            let mm = MatMul {
                m: 203,
                n: 77,
                k: 45,
                batch: 1,
                a_transposed: ta,
                b_transposed: tb,
                a_batched: false,
                b_batched: false,
                dtype,
            };
            let a: Vec<f32> = (0..mm.m * mm.k)
                .map(|_| stored(rng.normal_ish(), Elem::Float, dtype))
                .collect();
            let b: Vec<f32> = (0..mm.k * mm.n)
                .map(|_| stored(rng.normal_ish(), Elem::Float, dtype))
                .collect();
            let da = dev.upload_f32(&a, dtype).unwrap();
            let db = dev.upload_f32(&b, dtype).unwrap();
            let dc = dev.alloc(mm.m * mm.n * 2).unwrap();
            // 64 rows a block (A's 48 and C's 80 padded elements a row): 203 = 3 · 64 + 11.
            blas.matmul_staged(&dev, &mm, &da, &db, &dc, 64 * 2 * (48 + 80))
                .unwrap();
            let got = dev.download_f32(&dc, mm.m * mm.n, dtype).unwrap();
            let want = matmul_cpu(&mm, &a, &b);
            for (x, y) in got.iter().zip(&want) {
                assert!(
                    (x - y).abs() <= 1e-2 * (1.0 + y.abs()),
                    "{mm:?}: {x} vs {y}"
                );
            }
        }
    }
}

#[test]
fn allocator_reuses_blocks_and_measures_the_peak() {
    let Some(dev) = gpu_or_skip("allocator_reuses_blocks_and_measures_the_peak") else {
        return;
    };
    dev.reset_peak_memory();
    let before = dev.memory_stats();
    {
        let _a = dev.alloc(3 << 20).unwrap();
        let _b = dev.alloc(1000).unwrap();
    }
    let s = dev.memory_stats();
    assert_eq!(s.peak_requested - before.requested, (3 << 20) + 1000);
    let hits = s.cache_hits;
    let _c = dev.alloc(3 << 20).unwrap();
    assert_eq!(dev.memory_stats().cache_hits, hits + 1);
}

#[test]
fn nccl_all_reduce_on_one_rank() {
    let Some(dev) = gpu_or_skip("nccl_all_reduce_on_one_rank") else {
        return;
    };
    if !nccl_present() {
        skip(
            "nccl_all_reduce_on_one_rank",
            "libnccl.so.2 is not loadable",
        );
        return;
    }
    let id = NcclCommunicator::unique_id().unwrap();
    let mut comm = NcclCommunicator::new(dev.clone(), 0, 1, id).unwrap();
    let x: Vec<f32> = (0..1000).map(|i| i as f32).collect();
    let mut b = dev.upload_f32(&x, DType::F32).unwrap();
    comm.all_reduce(&mut b, x.len()).unwrap();
    assert_eq!(dev.download_f32(&b, x.len(), DType::F32).unwrap(), x);
}

/// Achieved bandwidth of each fused kernel of a GPT-2-small layer at the
/// gpt2 training step's micro-batch (batch 32, seq 1024, bf16) against a
/// device-to-device copy of 256 MiB (the ceiling) and against a copy of
/// the kernel's own bytes (what launch and ramp leave of it at that size).
/// Prints one line per kernel.
#[test]
#[ignore = "a benchmark: scripts/gpu-check.sh runs it"]
fn bench_kernel_bandwidth() {
    let Some(dev) = gpu_or_skip("bench_kernel_bandwidth") else {
        return;
    };
    let Some(nvrtc) = nvrtc_or_skip("bench_kernel_bandwidth") else {
        return;
    };
    let gpt2 = common::Gpt {
        vocab: 50257,
        d: 768,
        heads: 12,
        layers: 1,
        ctx: 1024,
        dropout: 0.0,
    };
    let g = gpt2.build();
    let dtype = DType::BF16;
    let compiled = compile_graph(&g, dtype, dev.arch(), dplc_ir::AttentionKind::Fused, &nvrtc)
        .expect("compiles");
    let syms: HashMap<String, i64> = [("batch".to_string(), 32), ("seq".to_string(), 1024)].into();
    let time = |f: &mut dyn FnMut()| median_time(&dev, f);
    let mut rng = Rng(11);
    // The copy: 256 MiB device to device, of random data (METHOD: never time zeros).
    let bytes = 256usize << 20;
    let noise: Vec<f32> = (0..bytes / 4).map(|_| rng.normal_ish()).collect();
    let src = dev.upload_f32(&noise, DType::F32).unwrap();
    let mut dst = dev.zeros(bytes).unwrap();
    let copy_s = time(&mut || dev.copy(&src, &mut dst, bytes).unwrap());
    let copy_bw = 2.0 * bytes as f64 / copy_s;
    println!("device {} copy {:.0} GB/s", dev.name(), copy_bw / 1e9);
    let mut kernels: Vec<(Kernel, Vec<i64>)> = Vec::new();
    for (_, plan, back) in &compiled.regions {
        for step in &plan.steps {
            if let Step::Kernel(k) = step {
                kernels.push((
                    k.kernel.clone(),
                    k.sizes.iter().map(|d| dim(d, &syms, &g)).collect(),
                ));
            }
        }
        for step in back {
            if let BackwardStep::Kernel { step, backward } = step {
                if let Step::Kernel(k) = &plan.steps[*step] {
                    kernels.push((
                        backward.kernel.clone(),
                        k.sizes.iter().map(|d| dim(d, &syms, &g)).collect(),
                    ));
                }
            }
        }
    }
    for (k, sizes) in kernels {
        let args = Args {
            sizes,
            scalars: vec![],
            seed: 1,
        };
        let ck = compiled.get(&k).unwrap();
        let gk = dev.load(&ck.kernel, &ck.source, &ck.ptx, dtype).unwrap();
        let mut moved = 0usize;
        let bufs: Vec<DeviceBuffer> = k
            .buffers
            .iter()
            .enumerate()
            .map(|(i, b)| {
                let (w, d) = if b.elem == Elem::Float {
                    (2, dtype)
                } else {
                    (4, DType::F32)
                };
                let len = args.buffer_len(&k, i);
                moved += len * w;
                if b.elem == Elem::Float || b.elem == Elem::F32 {
                    let v: Vec<f32> = (0..len.max(8)).map(|_| rng.normal_ish()).collect();
                    dev.upload_f32(&v, d).unwrap()
                } else {
                    // Tokens and targets, uniform over the vocabulary as
                    // text's are near enough: all zeros would send every
                    // gather's gradient to one row, one atomic queue.
                    let ids: Vec<i32> = (0..len.max(4))
                        .map(|_| (rng.next() % gpt2.vocab as u64) as i32)
                        .collect();
                    dev.upload_i32(&ids).unwrap()
                }
            })
            .collect();
        let refs: Vec<&DeviceBuffer> = bufs.iter().collect();
        let s = time(&mut || dev.launch(&gk, &refs, &args).unwrap());
        let bw = moved as f64 / s;
        // A copy reads and writes: half the kernel's bytes each way (up to the copy buffers).
        let same = (moved / 2).clamp(16, bytes) / 16 * 16;
        let same_s = time(&mut || dev.copy(&src, &mut dst, same).unwrap());
        println!(
            "{:<50} {:>9.1} us {:>7.0} GB/s {:>5.1}% of copy {:>5.1}% of a copy of its bytes",
            gk.name,
            s * 1e6,
            bw / 1e9,
            100.0 * bw / copy_bw,
            100.0 * bw / (2.0 * same as f64 / same_s)
        );
    }
}

/// Pass `pass` of `k` in `dtype` loaded on `dev`, and its code: the PTX
/// `compile_graph` made, or compiled here for a pass the graph's own
/// backward does not launch (the two-pass backward where it takes one).
fn load_attention_pass(
    dev: &GpuDevice,
    nvrtc: &Nvrtc,
    compiled: &dplc_runtime::gpu::CompiledGraph,
    k: &dplc_codegen::AttentionKernel,
    pass: dplc_codegen::AttentionPass,
    dtype: DType,
) -> (dplc_codegen::CudaSource, dplc_runtime::gpu::GpuKernel) {
    let source = dplc_codegen::emit_attention(k, pass, dtype);
    let ptx = match compiled.attention.get(&source.name) {
        Some(c) => c.ptx.clone(),
        None => nvrtc.compile(&source, dev.arch()).expect("compiles"),
    };
    let gk = dev
        .load_attention(k, pass, &source, &ptx, dtype)
        .expect("loads");
    (source, gk)
}

/// Whether a profiler drives this run (`DPLC_BENCH_PROFILED` set, as
/// `scripts/gpu-check.sh`'s `ncu` part sets it): each timed call then runs
/// once, so the profiler replays one launch of each kernel, not 33.
fn profiled() -> bool {
    std::env::var_os("DPLC_BENCH_PROFILED").is_some()
}

/// Whether a benchmark runs `shape`: every one, unless `DPLC_BENCH_SHAPES`
/// lists those to run (comma-separated), as the profiler's part does.
fn shape_wanted(shape: &str) -> bool {
    match std::env::var("DPLC_BENCH_SHAPES") {
        Ok(list) => list.split(',').any(|s| s.trim() == shape),
        Err(_) => true,
    }
}

/// Median seconds of `f` over 30 timed runs after 3 warm-ups, the device
/// synchronised around each (the kernels here run far past the launch gap);
/// one run, no warm-up, under a profiler ([`profiled`]).
fn median_time(dev: &GpuDevice, f: &mut dyn FnMut()) -> f64 {
    let (warm_ups, timed) = if profiled() { (0, 1) } else { (3, 30) };
    for _ in 0..warm_ups {
        f();
    }
    dev.synchronize().unwrap();
    let mut times: Vec<f64> = (0..timed)
        .map(|_| {
            let t = Instant::now();
            f();
            dev.synchronize().unwrap();
            t.elapsed().as_secs_f64()
        })
        .collect();
    times.sort_by(f64::total_cmp);
    times[times.len() / 2]
}

/// Fused attention's passes (bf16, causal) at GPT-2-small's shape (batch 8,
/// 12 heads of 64, seq 1024; without dropout and with GPT-2's 0.1) and
/// Llama 2 7B's (batch 2, 32 heads of 128, seq 4096), on random operands, the backward fed the
/// forward's output and log-sum-exp. Prints one `attention` line per shape
/// in FlashAttention's convention (causal forward `2·b·h·s²·d` FLOPs,
/// backward 2.5×); `bench/torch_attention.py` times PyTorch's flash SDPA at
/// the same shapes.
#[test]
#[ignore = "a benchmark: scripts/gpu-check.sh runs it"]
fn bench_attention() {
    use dplc_codegen::{attention_backward, AttentionBackward, AttentionBuffer, AttentionPass};
    let Some(dev) = gpu_or_skip("bench_attention") else {
        return;
    };
    let Some(nvrtc) = nvrtc_or_skip("bench_attention") else {
        return;
    };
    let dtype = DType::BF16;
    let mut rng = Rng(5);
    for (shape, batch, heads, head_dim, seq, dropout) in [
        ("gpt2", 8i64, 12i64, 64i64, 1024i64, 0.0),
        ("llama2_7b", 2, 32, 128, 4096, 0.0),
        ("gpt2_dropout", 8, 12, 64, 1024, 0.1),
        // A gpt2 training step's micro-batch: 151 MB of Q, K and V, past
        // the L2 cache the smaller shapes sit in between launches.
        ("gpt2_step", 32, 12, 64, 1024, 0.1),
    ] {
        if !shape_wanted(shape) {
            continue;
        }
        let g = common::Gpt {
            vocab: 256,
            d: heads * head_dim,
            heads,
            layers: 1,
            ctx: seq,
            dropout,
        }
        .build();
        let compiled = compile_graph(&g, dtype, dev.arch(), dplc_ir::AttentionKind::Fused, &nvrtc)
            .expect("compiles");
        let syms: HashMap<String, i64> =
            [("batch".to_string(), batch), ("seq".to_string(), seq)].into();
        let at = compiled
            .regions
            .iter()
            .flat_map(|(_, plan, _)| &plan.steps)
            .find_map(|s| match s {
                Step::Attention(at) => Some(at.clone()),
                _ => None,
            })
            .expect("the layer has a fused attention");
        let k = &at.kernel;
        let mut sizes: Vec<i64> = at.sizes.iter().map(|d| dim(d, &syms, &g)).collect();
        // The dropout's key as a run binds it (the first micro-batch of
        // layer 0): with its per-sample size, each draw splits its index
        // into sample and position, as in training.
        let place = dplc_codegen::KeyPlace::unsplit(0, 0, batch as usize);
        let numel = |t: dplc_ir::TensorId| -> usize {
            g.tensor(t)
                .shape
                .0
                .iter()
                .map(|d| dim(d, &syms, &g))
                .product::<i64>() as usize
        };
        place.bind_keys(&mut sizes, &at.key_sizes, numel);
        let args = Args {
            sizes,
            scalars: vec![],
            seed: 3,
        };
        let mut bufs: HashMap<AttentionBuffer, DeviceBuffer> = HashMap::new();
        let mut lens: HashMap<AttentionBuffer, (usize, DType)> = HashMap::new();
        let mut seconds = Vec::new();
        // The passes as the executor launches them, then the other
        // backward's (the two-pass one, where the codegen takes one pass)
        // timed beside them.
        let backward = attention_backward(k, dtype);
        let mut passes = k.passes(backward);
        if backward == AttentionBackward::OnePass {
            passes.extend([AttentionPass::QueryGrad, AttentionPass::KeyValueGrad]);
        }
        let mut other = Vec::new();
        for pass in passes {
            if pass == AttentionPass::BiasGrad {
                continue;
            }
            let roles = k.roles(pass);
            for (&role, b) in roles.iter().zip(k.buffers(pass)) {
                let n = b.len.iter().map(|&s| args.size(s)).product::<i64>() as usize;
                let d = if b.elem == Elem::Float {
                    dtype
                } else {
                    DType::F32
                };
                if let std::collections::hash_map::Entry::Vacant(slot) = bufs.entry(role) {
                    // Inputs random. The forward's outputs poisoned (it
                    // writes every element, which the backward reads); the
                    // gradients zeroed, as the executor gives them (a view
                    // of a fused QKV buffer writes only its own columns).
                    let gradient = matches!(
                        role,
                        AttentionBuffer::QGrad
                            | AttentionBuffer::KGrad
                            | AttentionBuffer::VGrad
                            | AttentionBuffer::QGradSum
                    );
                    let v: Vec<f32> = (0..n)
                        .map(|_| match (b.output, gradient) {
                            (false, _) => rng.normal_ish(),
                            (true, false) => f32::NAN,
                            (true, true) => 0.0,
                        })
                        .collect();
                    slot.insert(dev.upload_f32(&v, d).expect("upload"));
                    lens.insert(role, (n, d));
                }
            }
            let (src, gk) = load_attention_pass(&dev, &nvrtc, &compiled, k, pass, dtype);
            let refs: Vec<&DeviceBuffer> = roles.iter().map(|r| &bufs[r]).collect();
            // dQ's sum is zeroed before each pass that adds into it, as the
            // executor zeroes it: timed with the pass.
            let sum_at = roles.iter().position(|&r| r == AttentionBuffer::QGradSum);
            let s = match (pass, sum_at) {
                (AttentionPass::Grads, Some(at)) => {
                    let bytes = lens[&AttentionBuffer::QGradSum].0 * 4;
                    median_time(&dev, &mut || {
                        let zeroed = dev.zeros(bytes).unwrap();
                        let mut refs = refs.clone();
                        refs[at] = &zeroed;
                        dev.launch(&gk, &refs, &args).unwrap();
                    })
                }
                _ => median_time(&dev, &mut || dev.launch(&gk, &refs, &args).unwrap()),
            };
            if k.passes(backward).contains(&pass) {
                seconds.push((pass, s));
            } else {
                other.push((pass, s));
            }
            // The forward asks the assembler for registers few enough that
            // as many blocks share a multiprocessor as its shared memory
            // holds (`__launch_bounds__(128, n)`); timed beside it, the same
            // kernel with the registers left to the assembler, so each run
            // checks the choice again.
            if pass == AttentionPass::Forward {
                let mut free = src.clone();
                let bounds = free
                    .source
                    .find("__launch_bounds__(128, ")
                    .expect("the forward states its resident blocks");
                let end = bounds + free.source[bounds..].find(')').expect("closed") + 1;
                free.source
                    .replace_range(bounds..end, "__launch_bounds__(128)");
                let ptx = nvrtc.compile(&free, dev.arch()).expect("compiles");
                let gk = dev
                    .load_attention(k, pass, &free, &ptx, dtype)
                    .expect("loads");
                let s = median_time(&dev, &mut || dev.launch(&gk, &refs, &args).unwrap());
                println!(
                    "variant {shape} {}: __launch_bounds__(128) {:.3} ms",
                    pass.name(),
                    s * 1e3
                );
            }
            // The tunings the codegen does not launch yet, each timed beside
            // the launched pass (the forward with blocks of eight warps, the
            // one-pass backward adding four columns of dQ an atomic), its
            // output against the launched pass's — the forward's O, the
            // backward's sum of dQ, each into a fresh zeroed buffer — and
            // then the launched pass again, whose outputs the next read.
            for tuning in dplc_codegen::AttentionTuning::VARIANTS {
                let Some(tuned) = dplc_codegen::emit_attention_tuned(k, pass, dtype, tuning) else {
                    continue;
                };
                let ptx = nvrtc.compile(&tuned, dev.arch()).expect("compiles");
                let tk = dev
                    .load_attention(k, pass, &tuned, &ptx, dtype)
                    .expect("loads");
                let role = match pass {
                    AttentionPass::Forward => AttentionBuffer::Out,
                    _ => AttentionBuffer::QGradSum,
                };
                let (n, d) = lens[&role];
                let bytes = n * d.size_bytes() as usize;
                let at = roles
                    .iter()
                    .position(|&r| r == role)
                    .expect("the pass writes it");
                let once = |kernel: &dplc_runtime::gpu::GpuKernel| -> Vec<f32> {
                    let zeroed = dev.zeros(bytes).unwrap();
                    let mut refs = refs.clone();
                    refs[at] = &zeroed;
                    dev.launch(kernel, &refs, &args).unwrap();
                    dev.download_f32(&zeroed, n, d).unwrap()
                };
                let (want, got) = (once(&gk), once(&tk));
                let scale = want.iter().fold(0.0f32, |m, x| m.max(x.abs()));
                let differ = want
                    .iter()
                    .zip(&got)
                    .map(|(a, b)| (a - b).abs())
                    .fold(0.0f32, f32::max);
                let s = median_time(&dev, &mut || {
                    let zeroed;
                    let mut refs = refs.clone();
                    if role == AttentionBuffer::QGradSum {
                        zeroed = dev.zeros(bytes).unwrap();
                        refs[at] = &zeroed;
                    }
                    dev.launch(&tk, &refs, &args).unwrap();
                });
                println!(
                    "variant {shape} {}: {} {:.3} ms (output within {differ:.1e} of the launched pass's, largest {scale:.1e})",
                    pass.name(),
                    tuning.describe(),
                    s * 1e3
                );
                dev.launch(&gk, &refs, &args).expect("launches");
            }
        }
        // Every output written and finite.
        for role in [
            AttentionBuffer::Out,
            AttentionBuffer::LogSumExp,
            AttentionBuffer::QGrad,
            AttentionBuffer::KGrad,
            AttentionBuffer::VGrad,
        ] {
            let (n, d) = lens[&role];
            let v = dev.download_f32(&bufs[&role], n, d).expect("download");
            assert!(
                v.iter().all(|x| x.is_finite()),
                "{shape}: {role:?} holds an unwritten or non-finite element"
            );
        }
        let fwd_flops = 2.0 * (batch * heads * seq * seq * head_dim) as f64;
        let list = |passes: &[(AttentionPass, f64)]| -> String {
            passes
                .iter()
                .map(|(p, s)| format!("{} {:.3} ms", p.name(), s * 1e3))
                .collect::<Vec<_>>()
                .join(", ")
        };
        let fwd = seconds[0].1;
        let bwd: f64 = seconds[1..].iter().map(|(_, s)| s).sum();
        println!(
            "attention {shape} b{batch} h{heads} d{head_dim} s{seq}: fwd {:.3} ms ({:.0} TFLOP/s), \
             bwd {:.3} ms ({:.0} TFLOP/s, {backward:?}; {}), fwd+bwd {:.3} ms",
            fwd * 1e3,
            fwd_flops / fwd / 1e12,
            bwd * 1e3,
            2.5 * fwd_flops / bwd / 1e12,
            list(&seconds[1..]),
            (fwd + bwd) * 1e3
        );
        if !other.is_empty() {
            let two: f64 = other.iter().map(|(_, s)| s).sum();
            println!(
                "variant {shape} two-pass backward: {:.3} ms ({}), fwd+bwd {:.3} ms",
                two * 1e3,
                list(&other),
                (fwd + two) * 1e3
            );
        }
    }
}

/// The common test GPT without dropout (the GPU draws its masks with its own
/// generator), and a spec for a few quick steps.
fn tiny_gpt(precision: dplc_ir::Precision) -> (Graph, dplc_ir::TrainSpec) {
    let g = common::Gpt {
        dropout: 0.0,
        ..common::Gpt::default()
    }
    .build();
    let spec = dplc_ir::TrainSpec {
        seq: 8,
        global_batch: 4,
        precision,
        optimizer: dplc_ir::Optimizer::AdamW {
            lr: 1e-2,
            beta1: 0.9,
            beta2: 0.95,
            eps: 1e-8,
            weight_decay: 0.01,
        },
        schedule: dplc_ir::LrSchedule::Constant,
        grad_clip: Some(1.0),
        steps: Some(4),
    };
    (g, spec)
}

/// Losses of 4 steps of the fused compute on the host backend, over
/// `mb`-sample micro-batches, `n` per step.
fn host_losses(g: &Graph, spec: &dplc_ir::TrainSpec, mb: usize, n: usize) -> Vec<f64> {
    let data = dplc_runtime::Corpus::synthetic(5, 32, 1 << 12);
    let spec = &dplc_ir::TrainSpec {
        global_batch: (mb * n) as u64,
        ..spec.clone()
    };
    let cfg = dplc_runtime::RunConfig {
        micro_batch: mb,
        num_micro_batches: n,
        compute: dplc_runtime::Compute::Fused,
        ..Default::default()
    };
    dplc_runtime::train(g, spec, &cfg, &data, 4, 3, |_| {})
        .unwrap()
        .steps
        .iter()
        .map(|s| s.loss)
        .collect()
}

fn gpu_losses(
    g: &Graph,
    spec: &dplc_ir::TrainSpec,
    ranks_per_gpu: usize,
    mb: usize,
    n: usize,
) -> (Vec<f64>, usize) {
    gpu_run(g, spec, ranks_per_gpu, mb, n, false, false)
}

/// 4 steps on GPU 0 through the schedule executor: `ranks` data-parallel
/// ranks sharing it, optionally recomputing every layer or with ZeRO-1.
fn gpu_run(
    g: &Graph,
    spec: &dplc_ir::TrainSpec,
    ranks: usize,
    mb: usize,
    n: usize,
    recompute: bool,
    shard_optimizer: bool,
) -> (Vec<f64>, usize) {
    let data = dplc_runtime::Corpus::synthetic(5, 32, 1 << 12);
    let spec = &dplc_ir::TrainSpec {
        global_batch: (ranks * mb * n) as u64,
        ..spec.clone()
    };
    let cfg = dplc_runtime::RunConfig {
        dp: ranks,
        micro_batch: mb,
        num_micro_batches: n,
        recompute: if recompute {
            dplc_ir::Recompute::Full
        } else {
            dplc_ir::Recompute::None
        },
        zero: if shard_optimizer {
            dplc_runtime::ZeroStage::One
        } else {
            dplc_runtime::ZeroStage::None
        },
        compute: dplc_runtime::Compute::Fused,
        device: dplc_runtime::Device::Cuda {
            gpus: 1,
            dtype: dplc_runtime::gpu::storage_dtype(spec.precision),
        },
        ..Default::default()
    };
    let r = dplc_runtime::train(g, spec, &cfg, &data, 4, 3, |_| {}).unwrap();
    let peak = r.device.map_or(0, |d| d.peak_bytes as usize);
    (r.steps.iter().map(|s| s.loss).collect(), peak)
}

fn assert_close(what: &str, a: &[f64], b: &[f64], tol: f64) {
    assert_eq!(a.len(), b.len(), "{what}");
    for (i, (x, y)) in a.iter().zip(b).enumerate() {
        assert!(
            ((x - y) / x.abs()).abs() < tol,
            "{what}: step {i} loss {x} vs {y}"
        );
    }
}

#[test]
fn the_fused_step_on_the_gpu_matches_the_host_backend_f32() {
    let test = "the_fused_step_on_the_gpu_matches_the_host_backend_f32";
    if gpu_or_skip(test).is_none() || nvrtc_or_skip(test).is_none() {
        return;
    }
    let (g, spec) = tiny_gpt(dplc_ir::Precision::Fp32);
    let host = host_losses(&g, &spec, 4, 1);
    let (gpu, peak) = gpu_losses(&g, &spec, 1, 4, 1);
    assert_close("f32 GPU vs host", &host, &gpu, 1e-4);
    assert!(peak > 0, "the allocator saw the run");
    eprintln!("f32 losses {gpu:?}, peak {peak} bytes");
}

#[test]
fn the_fused_step_on_the_gpu_trains_in_bf16() {
    let test = "the_fused_step_on_the_gpu_trains_in_bf16";
    if gpu_or_skip(test).is_none() || nvrtc_or_skip(test).is_none() {
        return;
    }
    let (g, spec) = tiny_gpt(dplc_ir::Precision::Bf16);
    let host = host_losses(&g, &spec, 4, 1);
    let (gpu, _) = gpu_losses(&g, &spec, 1, 4, 1);
    // bf16 storage keeps 8 bits of mantissa: the losses agree to a few percent.
    assert_close("bf16 GPU vs f32 host", &host, &gpu, 3e-2);
}

#[test]
fn full_recomputation_on_the_gpu_is_the_same_run_in_less_memory() {
    let test = "full_recomputation_on_the_gpu_is_the_same_run_in_less_memory";
    if gpu_or_skip(test).is_none() || nvrtc_or_skip(test).is_none() {
        return;
    }
    let (g, spec) = tiny_gpt(dplc_ir::Precision::Fp32);
    let (kept, k) = gpu_run(&g, &spec, 1, 4, 1, false, false);
    let (again, r) = gpu_run(&g, &spec, 1, 4, 1, true, false);
    // The same kernels on the same inputs; bit for bit on the host, here up to
    // the order of atomic accumulations in the backward kernels.
    assert_close("recomputed vs kept", &kept, &again, 1e-5);
    assert!(
        r <= k,
        "recomputation peaked at {r} bytes, keeping every layer {k}"
    );
    eprintln!("peak {k} bytes keeping every layer, {r} recomputing");
}

#[test]
fn zero1_over_ranks_on_one_gpu_matches_replicated_state() {
    let test = "zero1_over_ranks_on_one_gpu_matches_replicated_state";
    if gpu_or_skip(test).is_none() || nvrtc_or_skip(test).is_none() {
        return;
    }
    let (g, spec) = tiny_gpt(dplc_ir::Precision::Fp32);
    let (whole, _) = gpu_run(&g, &spec, 3, 1, 1, false, false);
    let (parts, _) = gpu_run(&g, &spec, 3, 1, 1, false, true);
    assert_close("ZeRO-1 vs replicated", &whole, &parts, 1e-5);
}

#[test]
fn two_ranks_on_one_gpu_match_one_rank_accumulating() {
    let test = "two_ranks_on_one_gpu_match_one_rank_accumulating";
    if gpu_or_skip(test).is_none() || nvrtc_or_skip(test).is_none() {
        return;
    }
    let (g, spec) = tiny_gpt(dplc_ir::Precision::Fp32);
    let (one, _) = gpu_losses(&g, &spec, 1, 2, 2);
    let (two, _) = gpu_losses(&g, &spec, 2, 2, 1);
    assert_close("dp2 on one GPU vs accumulation", &one, &two, 1e-5);
}

/// The reference the GPU runs above compare with trains on any machine.
#[test]
fn the_host_backend_trains_the_test_gpt() {
    let (g, spec) = tiny_gpt(dplc_ir::Precision::Fp32);
    let losses = host_losses(&g, &spec, 4, 1);
    assert!(losses.iter().all(|l| l.is_finite()), "{losses:?}");
    assert!(losses[3] < losses[0], "the loss falls: {losses:?}");
}

/// The planner's layout of `g` at tp=2 with its root split over the
/// vocabulary (the embedding, head and loss over each rank's slice, which the
/// fused compute runs on the device).
fn vocab_root_layout(g: &Graph, spec: &dplc_ir::TrainSpec) -> dplc_ir::ModelLayout {
    let mut req = dplc_planner::PlanRequest::new(
        g,
        spec.clone(),
        dplc_planner::parse_cluster("2xcpu").unwrap(),
    );
    req.pinned = dplc_planner::parse_strategy("tp=2,root=vocab").unwrap();
    let plan = dplc_planner::compile(&req).unwrap().plan;
    assert_eq!(plan.strategy.root, dplc_ir::RootSplit::Vocab);
    plan.layout.expect("a tp plan carries its layout")
}

/// The zoo's gpt_tiny in f32 over sequences of 8, four a step: a model the
/// planner splits over its vocabulary (the hand-built test GPT it does not).
fn zoo_tiny(model: &str) -> (Graph, dplc_ir::TrainSpec) {
    let text = include_str!("../../models/tiny.dpl");
    let unit = dplc_frontend::parse("models/tiny.dpl", text).expect("the zoo parses");
    let lowered = unit.lower(model).expect("the tiny model lowers");
    let mut spec = lowered.train;
    spec.seq = 8;
    spec.global_batch = 4;
    spec.precision = dplc_ir::Precision::Fp32;
    spec.steps = Some(4);
    (lowered.graph, spec)
}

/// The vocabulary-split layout the GPU test runs is one the planner makes
/// (checked without a GPU, so that the GPU test's split is sound).
#[test]
fn gpt_tiny_has_a_vocabulary_split_root() {
    let (g, spec) = zoo_tiny("gpt_tiny");
    let layout = vocab_root_layout(&g, &spec);
    let over_vocab = layout
        .regions
        .iter()
        .flat_map(|r| &r.nodes)
        .filter(|n| n.vocab_op(&g.node(n.node).op).is_some())
        .count();
    assert!(
        over_vocab >= 3,
        "{over_vocab} ops over the split vocabulary"
    );
}

/// GPU runs go through the one schedule executor: several ranks sharing one
/// GPU run data, tensor (with sequence, and with the root split over the
/// vocabulary), pipeline and expert parallelism (MoE routing on the device)
/// and ZeRO-3, a parameter server, async updates and compressed gradients,
/// and each
/// matches the same split computed by the same fused kernels on the host
/// backend.
#[test]
fn every_split_on_one_gpu_matches_the_host_fused_compute() {
    use dplc_ir::{Compression, GradSync};
    use dplc_runtime::{Compute, Device, RunConfig, ZeroStage};
    let test = "every_split_on_one_gpu_matches_the_host_fused_compute";
    if gpu_or_skip(test).is_none() || nvrtc_or_skip(test).is_none() {
        return;
    }
    let (g, spec) = tiny_gpt(dplc_ir::Precision::Fp32);
    let data = dplc_runtime::Corpus::synthetic(5, 32, 1 << 12);
    let base = RunConfig {
        micro_batch: 1,
        num_micro_batches: 4,
        compute: Compute::Fused,
        ..RunConfig::default()
    };
    let splits = [
        ("serial", base.clone()),
        (
            "dp2 ZeRO-3",
            RunConfig {
                dp: 2,
                num_micro_batches: 2,
                zero: ZeroStage::Three,
                ..base.clone()
            },
        ),
        (
            "tp2 sp",
            RunConfig {
                tp: 2,
                sequence_parallel: true,
                ..base.clone()
            },
        ),
        (
            "pp2 1F1B",
            RunConfig {
                pp: 2,
                ..base.clone()
            },
        ),
    ];
    // The data-parallel synchronisations and compressions keep their state
    // (servers' shards, older weight versions, error feedback) where the
    // store keeps the rest: on the GPU.
    let dp2 = |sync: GradSync, compress: Compression| RunConfig {
        dp: 2,
        num_micro_batches: 2,
        sync,
        compress,
        ..base.clone()
    };
    let syncs = [
        ("dp2 ps", dp2(GradSync::ps(2), Compression::None)),
        (
            "dp2 async 1",
            dp2(GradSync::async_ps(2, 1), Compression::None),
        ),
        ("dp2 bf16", dp2(GradSync::AllReduce, Compression::Bf16)),
        (
            "dp2 powersgd:2",
            dp2(
                GradSync::AllReduce,
                Compression::PowerSgd {
                    rank: 2,
                    warmup: Some(1),
                },
            ),
        ),
        (
            "dp2 topk:0.1",
            dp2(
                GradSync::AllReduce,
                Compression::TopK {
                    per_million: 100_000,
                    warmup: Some(1),
                },
            ),
        ),
    ];
    // The root split over the vocabulary: its ops run on the device.
    let (tiny, tiny_spec) = zoo_tiny("gpt_tiny");
    let tiny_data = dplc_runtime::Corpus::synthetic(5, 256, 1 << 12);
    let vocab = RunConfig {
        tp: 2,
        layout: Some(vocab_root_layout(&tiny, &tiny_spec)),
        ..base.clone()
    };
    // MoE routing on the device, its experts over two ranks.
    let (moe, moe_spec) = zoo_tiny("moe_tiny");
    let experts = RunConfig {
        dp: 2,
        ep: 2,
        num_micro_batches: 2,
        ..base.clone()
    };
    let cases = splits
        .into_iter()
        .chain(syncs)
        .map(|(name, cfg)| (name, &g, &spec, &data, cfg))
        .chain([
            ("tp2 root=vocab", &tiny, &tiny_spec, &tiny_data, vocab),
            ("moe dp2 ep2", &moe, &moe_spec, &tiny_data, experts),
        ]);
    for (name, g, spec, data, mut cfg) in cases {
        // Every split plan carries the layout the planner wrote for it.
        if (cfg.tp > 1 || cfg.ep > 1) && cfg.layout.is_none() {
            cfg.layout = Some(
                dplc_planner::derive_layout(g, cfg.tp as u64, cfg.ep as u64, cfg.sequence_parallel)
                    .unwrap(),
            );
        }
        let ranks = cfg.world_size();
        let host = dplc_runtime::train(g, spec, &cfg, data, 4, 3, |_| {}).unwrap();
        let gpu_cfg = RunConfig {
            device: Device::Cuda {
                gpus: 1,
                dtype: DType::F32,
            },
            ..cfg
        };
        let gpu = dplc_runtime::train(g, spec, &gpu_cfg, data, 4, 3, |_| {}).unwrap();
        let losses =
            |r: &dplc_runtime::TrainReport| r.steps.iter().map(|s| s.loss).collect::<Vec<_>>();
        assert_close(name, &losses(&host), &losses(&gpu), 1e-4);
        let used = gpu.device.clone().expect("a GPU run reports its device");
        assert!(used.peak_bytes > 0, "{name}: the allocator saw the run");
        // Ranks sharing the GPU move layout changes' pieces on it.
        if ranks > 1 {
            assert_eq!(
                used.collectives,
                dplc_runtime::Collectives::SharedDevice,
                "{name}"
            );
        }
        eprintln!(
            "{name}: GPU losses {:?}, peak {} bytes on {}",
            losses(&gpu),
            used.peak_bytes,
            used.name
        );
    }
}

/// Ranks with a GPU each keep their state on it and sum it with NCCL
/// (every ZeRO stage, and a pipeline whose tied embedding sums across
/// stages): the same training as the fused compute on the host backend,
/// and the run says it used NCCL. Needs two GPUs.
#[test]
fn ranks_with_a_gpu_each_sum_through_nccl() {
    use dplc_runtime::{Collectives, Compute, Device, RunConfig, ZeroStage};
    let test = "ranks_with_a_gpu_each_sum_through_nccl";
    if gpu_or_skip(test).is_none() || nvrtc_or_skip(test).is_none() {
        return;
    }
    if GpuDevice::new(1).is_err() {
        skip(test, "one GPU: NCCL between ranks needs two");
        return;
    }
    if !nccl_present() {
        skip(test, "libnccl.so.2 is not loadable");
        return;
    }
    let (g, spec) = tiny_gpt(dplc_ir::Precision::Fp32);
    let data = dplc_runtime::Corpus::synthetic(5, 32, 1 << 12);
    let base = RunConfig {
        dp: 2,
        micro_batch: 1,
        num_micro_batches: 2,
        compute: Compute::Fused,
        ..RunConfig::default()
    };
    let mut splits: Vec<(&str, RunConfig)> = [
        ("dp2", ZeroStage::None),
        ("dp2 ZeRO-1", ZeroStage::One),
        ("dp2 ZeRO-2", ZeroStage::Two),
        ("dp2 ZeRO-3", ZeroStage::Three),
    ]
    .into_iter()
    .map(|(name, zero)| {
        (
            name,
            RunConfig {
                zero,
                ..base.clone()
            },
        )
    })
    .collect();
    splits.push((
        "pp2",
        RunConfig {
            dp: 1,
            pp: 2,
            num_micro_batches: 4,
            ..base.clone()
        },
    ));
    // The layout changes' pieces through NCCL's sends and receives.
    splits.push((
        "tp2 sp",
        RunConfig {
            dp: 1,
            tp: 2,
            sequence_parallel: true,
            num_micro_batches: 4,
            layout: Some(dplc_planner::derive_layout(&g, 2, 1, true).unwrap()),
            ..base.clone()
        },
    ));
    for (name, cfg) in splits {
        let host = dplc_runtime::train(&g, &spec, &cfg, &data, 4, 3, |_| {}).unwrap();
        let gpu_cfg = RunConfig {
            device: Device::Cuda {
                gpus: 2,
                dtype: DType::F32,
            },
            ..cfg
        };
        let gpu = dplc_runtime::train(&g, &spec, &gpu_cfg, &data, 4, 3, |_| {}).unwrap();
        let losses =
            |r: &dplc_runtime::TrainReport| r.steps.iter().map(|s| s.loss).collect::<Vec<_>>();
        assert_close(name, &losses(&host), &losses(&gpu), 1e-4);
        let used = gpu.device.expect("a GPU run reports its device");
        assert_eq!(used.collectives, Collectives::Nccl, "{name}");
    }
}

/// Without a driver, a GPU run on the executor stops before any rank starts
/// with the seam's own error, typed.
#[test]
fn a_gpu_run_without_a_driver_fails_typed() {
    if driver_present() {
        skip(
            "a_gpu_run_without_a_driver_fails_typed",
            "a driver is present",
        );
        return;
    }
    let (g, spec) = tiny_gpt(dplc_ir::Precision::Fp32);
    let data = dplc_runtime::Corpus::synthetic(5, 32, 1 << 12);
    let cfg = dplc_runtime::RunConfig {
        num_micro_batches: 4,
        compute: dplc_runtime::Compute::Fused,
        device: dplc_runtime::Device::Cuda {
            gpus: 1,
            dtype: DType::F32,
        },
        ..Default::default()
    };
    let err = dplc_runtime::train(&g, &spec, &cfg, &data, 1, 3, |_| {}).unwrap_err();
    assert!(
        matches!(
            err,
            dplc_runtime::RuntimeError::Gpu(GpuError::CudaUnavailable(_))
        ),
        "{err}"
    );
}

/// Every pass of each fused attention of two GPTs (causal, dropout 0.1;
/// head widths 8 and 16, the second taking the tensor-core passes in bf16)
/// on the GPU against the host interpreter on the same random operands
/// (rounded through the storage type): the forward's output and
/// log-sum-exp, then each backward pass from the host's forward (both the
/// two-pass and, where the codegen takes it, the one-pass backward's).
/// Worst norm-wise relative error.
fn attention_matches(dtype: DType, tol: f64, test: &str) {
    use dplc_codegen::{
        attention_backward, interpret_attention, AttentionBackward, AttentionBuffer, AttentionPass,
        BufferRef,
    };
    let Some(dev) = gpu_or_skip(test) else { return };
    let Some(nvrtc) = nvrtc_or_skip(test) else {
        return;
    };
    let mut rng = Rng(7);
    let mut checked = 0;
    // Head width 8 (the scalar passes) at 8 positions, 16 (under bf16 and
    // f16 the tensor-core passes) at 70, past one 64-wide tile, and Llama's
    // 128 (the forward's 64-key tiles in 68 KB of dynamic shared memory).
    let wide = common::Gpt {
        d: 32,
        heads: 2,
        ctx: 128,
        ..Default::default()
    };
    let llama_wide = common::Gpt {
        d: 256,
        heads: 2,
        ctx: 160,
        ..Default::default()
    };
    for (gpt, seq) in [(common::Gpt::default(), 8), (wide, 70), (llama_wide, 150)] {
        let g = gpt.build();
        let compiled = compile_graph(&g, dtype, dev.arch(), dplc_ir::AttentionKind::Fused, &nvrtc)
            .expect("compiles");
        let syms: HashMap<String, i64> =
            [("batch".to_string(), 2), ("seq".to_string(), seq)].into();
        for (_, plan, _) in &compiled.regions {
            for step in &plan.steps {
                let Step::Attention(at) = step else { continue };
                let k = &at.kernel;
                let mut sizes: Vec<i64> = at.sizes.iter().map(|d| dim(d, &syms, &g)).collect();
                for (n, (i, _)) in at.key_sizes.iter().enumerate() {
                    sizes[*i] = [2, 4, 64][n];
                }
                let args = Args {
                    sizes,
                    scalars: vec![],
                    seed: 9,
                };
                let len = |pass: AttentionPass, role: AttentionBuffer| -> usize {
                    let i = k.roles(pass).iter().position(|&r| r == role).unwrap();
                    k.buffers(pass)[i]
                        .len
                        .iter()
                        .map(|&s| args.size(s))
                        .product::<i64>() as usize
                };
                let mut values: HashMap<AttentionBuffer, Vec<f32>> = HashMap::new();
                for role in [
                    AttentionBuffer::Q,
                    AttentionBuffer::K,
                    AttentionBuffer::V,
                    AttentionBuffer::OutGrad,
                ] {
                    let n = len(AttentionPass::KeyValueGrad, role);
                    let v = (0..n)
                        .map(|_| stored(rng.normal_ish(), Elem::Float, dtype))
                        .collect();
                    values.insert(role, v);
                }
                // Both backwards where the codegen takes the one pass (its
                // passes after the two-pass ones, in `ALL`'s order).
                let mut wanted = k.passes(AttentionBackward::TwoPass);
                wanted.extend(k.passes(attention_backward(k, dtype)));
                for pass in AttentionPass::ALL {
                    if !wanted.contains(&pass) || !k.runs(pass, [true, true, true, false]) {
                        continue;
                    }
                    let roles = k.roles(pass);
                    let specs = k.buffers(pass);
                    let mut host: Vec<Data> = Vec::new();
                    let mut bufs: Vec<DeviceBuffer> = Vec::new();
                    for (&role, b) in roles.iter().zip(&specs) {
                        let n = len(pass, role);
                        let d = if b.elem == Elem::Float {
                            dtype
                        } else {
                            DType::F32
                        };
                        if b.output {
                            host.push(Data::F32(vec![0.0; n]));
                            // As the executor gives them: what a pass writes
                            // whole (the forward's outputs, δ, a gradient
                            // whose view reaches its whole buffer) poisoned,
                            // so an element left unwritten fails; the rest
                            // zeroed.
                            bufs.push(if k.written_whole(role, &args, n) {
                                dev.upload_f32(&vec![f32::NAN; n], d).expect("upload")
                            } else {
                                dev.zeros(n * d.size_bytes() as usize).expect("alloc")
                            });
                        } else {
                            let v = values[&role].clone();
                            bufs.push(dev.upload_f32(&v, d).expect("upload"));
                            host.push(Data::F32(v));
                        }
                    }
                    let (_, gk) = load_attention_pass(&dev, &nvrtc, &compiled, k, pass, dtype);
                    let refs: Vec<&DeviceBuffer> = bufs.iter().collect();
                    dev.launch(&gk, &refs, &args)
                        .unwrap_or_else(|e| panic!("{}: {e}", gk.name));
                    {
                        let mut inputs = host.clone();
                        let mut refs: Vec<BufferRef> = Vec::new();
                        for ((spec, h), i) in
                            specs.iter().zip(host.iter_mut()).zip(inputs.iter_mut())
                        {
                            refs.push(if spec.output {
                                BufferRef::Output(h)
                            } else {
                                BufferRef::Input(i)
                            });
                        }
                        interpret_attention(k, pass, &args, &mut refs).expect("interprets");
                    }
                    for ((&role, b), (h, buf)) in
                        roles.iter().zip(&specs).zip(host.iter().zip(&bufs))
                    {
                        if !b.output {
                            continue;
                        }
                        let want = h.f32();
                        let d = if b.elem == Elem::Float {
                            dtype
                        } else {
                            DType::F32
                        };
                        let got = dev.download_f32(buf, want.len(), d).expect("download");
                        let rel = relative_error(&got, want);
                        assert!(
                            rel <= tol,
                            "{} {role:?} ({dtype:?}): relative error {rel:e} > {tol:e}",
                            gk.name
                        );
                        // The backward passes read the host's forward.
                        values.insert(role, want.to_vec());
                    }
                    checked += 1;
                }
            }
        }
    }
    assert!(checked >= 9, "{checked} attention passes");
    eprintln!(
        "{checked} attention passes match the interpreter on {} ({dtype:?})",
        dev.name()
    );
}

#[test]
fn every_attention_pass_matches_the_interpreter_f32() {
    attention_matches(
        DType::F32,
        1e-4,
        "every_attention_pass_matches_the_interpreter_f32",
    );
}

#[test]
fn every_attention_pass_matches_the_interpreter_bf16() {
    attention_matches(
        DType::BF16,
        2e-2,
        "every_attention_pass_matches_the_interpreter_bf16",
    );
}
