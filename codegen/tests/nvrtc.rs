//! Every kernel of every zoo model, forward and fused backward (with the
//! column sums; each fused attention's forward and backward passes),
//! compiles with NVRTC for sm_80 and sm_90 in the model's training precision
//! (the tiny models and the training step's kernels — AdamW, SGD, column
//! sum, add, convert, sum of squares — in all three; t5_tiny's rank program
//! under cp 2, whose dropouts draw at global positions, too). Every kernel is
//! checked without NVVM's optimizer; the tensor-core kernels a Hopper run
//! launches also compile as the runtime compiles them, optimizer and all.
//! NVRTC needs no GPU; when its library is absent (DPLC_NVRTC_LIB unset and
//! none on the library path) the test says so and passes. CI installs it
//! first: `export DPLC_NVRTC_LIB=$(scripts/install-nvrtc.sh)`.

mod common;

use dplc_codegen::{
    adamw_kernel, adamw_value_kernel, add_kernel, attention_backward, backward_plan,
    column_sum_kernel, convert_kernel, emit_attention, emit_attention_tuned, emit_cuda, fuse,
    sgd_kernel, sum_squares_kernel, Arch, AttentionTuning, BackwardStep, CodegenError, CudaSource,
    Elem, Nvrtc, Step,
};
use dplc_ir::DType;
use std::collections::{BTreeMap, BTreeSet};
use std::time::Instant;

/// Every distinct kernel of the tiny models, the scans and the training
/// step (`full_size` false), or of the full-size zoo models (true). The
/// first cover every code path — each storage type, vector width and
/// tensor-core path — and compile for every architecture; the full-size
/// models add other constant sizes of the same paths, of which those that
/// hold tiles (shared memory, tensor-core fragments) are compiled for
/// sm_90 alone, to keep the test within its time.
fn all_sources(full_size: bool) -> BTreeMap<String, CudaSource> {
    let mut out = BTreeMap::new();
    let mut add = |src: CudaSource| {
        out.entry(src.name.clone()).or_insert(src);
    };
    if full_size {
        for (name, lowered) in common::all_zoo() {
            if name.ends_with("_tiny") {
                continue;
            }
            let dtype = match lowered.train.precision {
                dplc_ir::Precision::Fp32 => DType::F32,
                dplc_ir::Precision::Bf16 => DType::BF16,
                dplc_ir::Precision::Fp16 => DType::F16,
            };
            add_graph(&lowered.graph, &[dtype], &mut add);
        }
        return out;
    }
    for dtype in [DType::F32, DType::BF16, DType::F16] {
        add(emit_cuda(&adamw_kernel(), dtype));
        add(emit_cuda(&adamw_value_kernel(), dtype));
        add(emit_cuda(&column_sum_kernel(), dtype));
        add(emit_cuda(&dplc_codegen::column_chunk_kernel(), dtype));
        // MoE routing, top-2 and top-8.
        for k in [2, 8] {
            for kernel in [
                dplc_codegen::moe_top_k_kernel(k),
                dplc_codegen::moe_top_k_backward_kernel(k),
                dplc_codegen::moe_dispatch_kernel(k),
                dplc_codegen::moe_dispatch_backward_kernel(k),
                dplc_codegen::moe_combine_kernel(k),
                dplc_codegen::moe_combine_backward_kernel(k),
                dplc_codegen::moe_combine_weights_backward_kernel(k),
            ] {
                add(emit_cuda(&kernel, dtype));
            }
        }
        // A layout change's sum of a group's parts.
        for elem in [Elem::Float, Elem::F32] {
            for parts in [2, 8] {
                add(emit_cuda(
                    &dplc_codegen::sum_parts_kernel(elem, parts),
                    dtype,
                ));
            }
        }
        // The training step's flat kernels (the fused executor's).
        add(emit_cuda(&sgd_kernel(), dtype));
        add(emit_cuda(&sum_squares_kernel(Elem::F32), dtype));
        // The ops over a split vocabulary, run on the device.
        for log in [true, false] {
            add(emit_cuda(&dplc_codegen::vocab_normalize_kernel(log), dtype));
            add(emit_cuda(&dplc_codegen::vocab_row_sum_kernel(log), dtype));
            add(emit_cuda(
                &dplc_codegen::vocab_normalize_backward_kernel(log),
                dtype,
            ));
        }
        for k in [
            dplc_codegen::vocab_row_stats_kernel(),
            dplc_codegen::vocab_take_kernel(),
            dplc_codegen::vocab_take_backward_kernel(),
            dplc_codegen::vocab_embedding_kernel(),
            dplc_codegen::vocab_embedding_backward_kernel(),
        ] {
            add(emit_cuda(&k, dtype));
        }
        for (to, from) in [(Elem::Float, Elem::F32), (Elem::F32, Elem::Float)] {
            add(emit_cuda(&convert_kernel(to, from), dtype));
        }
        for (out, a, b) in [
            (Elem::F32, Elem::F32, Elem::Float),
            (Elem::F32, Elem::F32, Elem::F32),
            (Elem::Float, Elem::Float, Elem::Float),
            (Elem::Float, Elem::Float, Elem::F32),
        ] {
            add(emit_cuda(&add_kernel(out, a, b), dtype));
        }
    }
    // A bare attention with dropout as a rank of tp 2 and cp 2 runs it:
    // its draws at the whole tensor's places (heads over tp, query chunks
    // over cp) and its causal mask at the queries' places in the sequence;
    // with a sliding window, the window's first key tile at the block's
    // first query's place too (in f32 alone: the tile bounds are the same
    // code in every dtype, and the test's time is short).
    add_graph(
        &common::placed_attention(common::PLACED, 2, 2),
        &[DType::F32, DType::BF16, DType::F16],
        &mut add,
    );
    add_graph(
        &common::placed_attention(common::PLACED_WINDOWED, 2, 2),
        &[DType::F32],
        &mut add,
    );
    // Beside the zoo (which has no running sum), the scan kernels.
    let scans = common::lower_m(common::SCANS);
    add_graph(&scans, &[DType::F32, DType::BF16, DType::F16], &mut add);
    for (name, lowered) in common::all_zoo() {
        if !name.ends_with("_tiny") {
            continue;
        }
        let dtypes = [DType::F32, DType::BF16, DType::F16];
        // A tiny model with dropout under cp 2 too: its rank program's
        // dropouts draw at global positions (the draw's index maps the
        // rank's chunks). The other cp programs add the same ops' kernels at
        // other sizes, left out for the test's time.
        let mut graphs = vec![lowered.graph.clone()];
        let dropout = lowered
            .graph
            .nodes()
            .any(|(_, n)| matches!(n.op, dplc_ir::Op::Dropout { p, .. } if p > 0.0));
        if name.ends_with("_tiny") && dropout {
            graphs.extend(dplc_ir::split_context(&lowered.graph, 2).ok());
        }
        for g in &graphs {
            add_graph(g, &dtypes, &mut add);
        }
    }
    out
}

/// `source` with its numbers written `#`: every run of digits not part of
/// a word (`f32`, `bf16`, `float4` and `half2` stay; sizes, strides,
/// literals and the sizes in a kernel's name go). Kernels equal under this
/// take the same code path at other sizes.
fn without_numbers(source: &str) -> String {
    let mut out = String::with_capacity(source.len());
    let mut prev = ' ';
    let mut number = false;
    for c in source.chars() {
        if c.is_ascii_digit() && (number || !prev.is_ascii_alphabetic()) {
            if !number {
                out.push('#');
            }
            number = true;
        } else {
            out.push(c);
            number = false;
        }
        prev = c;
    }
    out
}

/// The sizes of `source`'s array declarations (`[3072]`, not an index
/// such as `[0LL]`), in order.
fn array_sizes(source: &str) -> String {
    let mut out = String::new();
    let mut rest = source;
    while let Some(open) = rest.find('[') {
        rest = &rest[open + 1..];
        let end = rest.find(']').unwrap_or(rest.len());
        if end > 0 && rest[..end].bytes().all(|b| b.is_ascii_digit()) {
            out.push_str(&rest[..end]);
            out.push(',');
        }
    }
    out
}

/// Every forward and backward kernel of `g`'s regions, in `dtypes`.
fn add_graph(g: &dplc_ir::Graph, dtypes: &[DType], add: &mut impl FnMut(CudaSource)) {
    for (r, _) in g.regions() {
        let mut plan = fuse(g, r);
        // The backward decides which forward kernels keep row statistics.
        let back = backward_plan(g, &mut plan);
        for step in &plan.steps {
            match step {
                Step::Kernel(k) => {
                    for &dtype in dtypes {
                        add(emit_cuda(&k.kernel, dtype));
                    }
                }
                // The passes a run launches (the backward the codegen takes
                // for the storage type; the widest heads take two passes).
                Step::Attention(at) => {
                    for &dtype in dtypes {
                        let k = &at.kernel;
                        for pass in k.passes(attention_backward(k, dtype)) {
                            if k.runs(pass, [true; 4]) {
                                add(emit_attention(k, pass, dtype));
                                // The tunings the GPU benchmark times beside
                                // it, in bf16 (f16's code differs only in its
                                // conversions).
                                let tunings = match dtype {
                                    DType::BF16 => &AttentionTuning::VARIANTS[..],
                                    _ => &[],
                                };
                                for &tuning in tunings {
                                    if let Some(t) = emit_attention_tuned(k, pass, dtype, tuning) {
                                        add(t);
                                    }
                                }
                            }
                        }
                    }
                }
                Step::MatMul { .. } | Step::Extern { .. } => {}
            }
        }
        for step in back {
            if let BackwardStep::Kernel { backward, .. } = step {
                for &dtype in dtypes {
                    add(emit_cuda(&backward.kernel, dtype));
                }
            }
        }
    }
}

#[test]
fn every_zoo_kernel_compiles() {
    let nvrtc = match Nvrtc::load() {
        Ok(n) => n.with_cache(None),
        Err(CodegenError::NvrtcUnavailable { reason }) => {
            // Past the harness's capture, so a passing CI log shows the skip.
            use std::io::Write;
            let _ = writeln!(
                std::io::stderr(),
                "SKIPPED every_zoo_kernel_compiles: NVRTC is unavailable: {reason}"
            );
            return;
        }
        Err(e) => panic!("{e}"),
    };
    // A kernel that differs from another only in its numbers (sizes,
    // strides, scales, the name) compiles to PTX as that one does: one of
    // each such family is enough. Where a number can still break the C++
    // is an array's size (a tile's, a fragment's), so a kernel with tiles
    // (attention, scans, tensor-core fragments) keeps its own family for
    // each set of array sizes. (Registers and shared memory past a
    // device's limits are ptxas's and the driver's to refuse, not NVRTC's:
    // `bench/ptxas.sh` reports them.)
    // A row kernel's reduction scratch (`red`) has one size whatever the
    // kernel's numbers: it is no tile.
    let tiled = |s: &CudaSource| {
        s.source.contains("mma.sync")
            || s.source.lines().any(|l| {
                l.contains("__shared__") && !l.trim_start().starts_with("__shared__ float red[")
            })
    };
    let mut families = BTreeSet::new();
    let mut every_arch = all_sources(false);
    let mut family = |s: &CudaSource| {
        let mut key = without_numbers(&s.source.replace(&s.name, ""));
        if tiled(s) {
            key.push_str(&array_sizes(&s.source));
        }
        families.insert(key)
    };
    every_arch.retain(|_, s| family(s));
    let mut sm90: BTreeMap<String, CudaSource> = all_sources(true);
    sm90.retain(|name, s| !every_arch.contains_key(name) && family(s));
    let start = Instant::now();
    // Kernels of one storage type share translation units of up to 48 (their
    // helpers are include-guarded): NVRTC's fixed cost per program dominates
    // small kernels. A failure names its kernel in the log; compile that one
    // alone to see its source.
    // A kernel without tiles uses nothing either architecture lacks and no
    // resource that differs between them: sm_80 alone checks it (the tiled
    // ones compile for both).
    // The attention's tunings are timed on Hopper alone (the GPU
    // benchmark's parts): sm_90 checks them.
    let tuned = |name: &str| {
        AttentionTuning::VARIANTS
            .iter()
            .any(|t| name.ends_with(&format!("_{}", t.describe())))
    };
    let (tuned_sources, every_arch): (BTreeMap<_, _>, BTreeMap<_, _>) =
        every_arch.into_iter().partition(|(name, _)| tuned(name));
    sm90.extend(tuned_sources.clone());
    let distinct = every_arch.len();
    let (tiled_sources, untiled): (BTreeMap<_, _>, BTreeMap<_, _>) =
        every_arch.into_iter().partition(|(_, s)| tiled(s));
    // Every kernel is checked without NVVM's optimizer (`Nvrtc::check`: the
    // C++ and the PTX it emits, a seventh of the time: the optimizer took
    // 60 of this test's 70 s); the tensor-core paths a Hopper run launches
    // (the tiny zoo's tiled kernels and the tunings) also compile as the
    // runtime compiles them, optimizer and all, for sm_90.
    let mut batches: Vec<(CudaSource, &[Arch], bool)> = Vec::new();
    for (sources, archs, optimized) in [
        (&tiled_sources, &Arch::ALL[..], false),
        (&untiled, &[Arch::Sm80][..], false),
        (&sm90, &[Arch::Sm90][..], false),
        (&tiled_sources, &[Arch::Sm90][..], true),
        (&tuned_sources, &[Arch::Sm90][..], true),
    ] {
        for dtype in ["_f32_", "_bf16_", "_f16_"] {
            let group: Vec<&CudaSource> = sources
                .values()
                .filter(|s| s.name.contains(dtype))
                .collect();
            for chunk in group.chunks(48) {
                let batch = CudaSource {
                    name: format!("batch{}{}", dtype.trim_end_matches('_'), batches.len()),
                    source: chunk
                        .iter()
                        .map(|s| s.source.as_str())
                        .collect::<Vec<_>>()
                        .join("\n"),
                    launch: chunk[0].launch,
                    shared_bytes: 0,
                };
                batches.push((batch, archs, optimized));
            }
        }
    }
    // Two threads: CI has two cores, and NVRTC programs are independent.
    let jobs: Vec<(&CudaSource, Arch, bool)> = batches
        .iter()
        .flat_map(|(s, archs, optimized)| archs.iter().map(move |&a| (s, a, *optimized)))
        .collect();
    // Each thread takes the next job when it is free (the batches differ in
    // size, so fixed halves leave one core idle at the end).
    let next = std::sync::atomic::AtomicUsize::new(0);
    let failures: Vec<String> = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..2)
            .map(|_| {
                let (nvrtc, jobs, next) = (&nvrtc, &jobs, &next);
                scope.spawn(move || {
                    let mut failed = Vec::new();
                    loop {
                        let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                        let Some(&(s, a, optimized)) = jobs.get(i) else {
                            break failed;
                        };
                        let result = match optimized {
                            true => nvrtc.compile_uncached(s, a).map(drop),
                            false => nvrtc.check(s, a),
                        };
                        if let Err(e) = result {
                            failed.push(e.to_string());
                        }
                    }
                })
            })
            .collect();
        handles
            .into_iter()
            .flat_map(|h| h.join().expect("compile thread"))
            .collect()
    });
    eprintln!(
        "NVRTC {:?}: {} distinct kernels ({} with tiles for sm_80 and sm_90, the rest for sm_80), \
         {} more for sm_90 (the full-size zoo's and the attention's tunings), checked without \
         the optimizer; {} with tiles and {} tunings also with it, for sm_90; in {:.1?}",
        nvrtc.version(),
        distinct,
        tiled_sources.len(),
        sm90.len(),
        tiled_sources.len(),
        tuned_sources.len(),
        start.elapsed()
    );
    assert!(
        failures.is_empty(),
        "{} failures; the first:\n{}",
        failures.len(),
        failures[0]
    );
}

#[test]
fn compile_errors_carry_log_and_source_and_the_cache_hits() {
    let Ok(nvrtc) = Nvrtc::load() else {
        use std::io::Write;
        let _ = writeln!(
            std::io::stderr(),
            "SKIPPED compile_errors_carry_log_and_source_and_the_cache_hits: NVRTC is unavailable"
        );
        return;
    };
    let bad = CudaSource {
        name: "broken_f32_00000000".into(),
        source: "extern \"C\" __global__ void broken_f32_00000000() { undeclared = 1; }\n".into(),
        launch: dplc_codegen::LaunchShape::Elementwise { vector: 1 },
        shared_bytes: 0,
    };
    match nvrtc.compile(&bad, Arch::Sm80) {
        Err(CodegenError::Compile { log, code, .. }) => {
            assert!(log.contains("undeclared"), "{log}");
            assert_eq!(code, bad.source);
        }
        other => panic!("expected a compile error, got {other:?}"),
    }
    // The check without the optimizer, which the zoo test runs, refuses it too.
    match nvrtc.check(&bad, Arch::Sm90) {
        Err(CodegenError::Compile { log, .. }) => assert!(log.contains("undeclared"), "{log}"),
        other => panic!("expected a compile error, got {other:?}"),
    }
    let dir = std::env::temp_dir().join(format!("dplc-ptx-test-{}", std::process::id()));
    let nvrtc = nvrtc.with_cache(Some(dir.clone()));
    let src = emit_cuda(&adamw_kernel(), DType::BF16);
    let first = nvrtc.compile(&src, Arch::Sm90).unwrap();
    let path = nvrtc.cache_path(&src, Arch::Sm90).unwrap();
    assert!(path.is_file(), "{}", path.display());
    assert!(first.text.contains(&src.name));
    let again = nvrtc.compile(&src, Arch::Sm90).unwrap();
    assert_eq!(first, again);
    std::fs::remove_dir_all(dir).ok();
}
