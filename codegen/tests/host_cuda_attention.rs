//! The fused attention's generated CUDA C run on the CPU (`common/host_cuda.hpp`):
//! every pass, its inline PTX (`mma.m16n8k16`, `ldmatrix`, `cp.async`)
//! emulated as the PTX ISA lays out each warp's fragments, equal to the
//! interpreter on random inputs. Its own binary beside `host_cuda.rs`, so
//! each stays well under a minute on two cores. Without `c++` the test says
//! so and passes.

mod common;

use common::host::{
    compile, dtype_of, from_storage, launcher, relative_error, skip, stored, to_storage, Launch,
};
use dplc_codegen::{fuse, Args, Data, Elem, Step};
use dplc_ir::{DType, Graph};
use std::collections::HashMap;
use std::path::PathBuf;
use std::process::Command;

/// One fused attention of a graph, at its launch sizes.
struct AttentionCase {
    kernel: dplc_codegen::AttentionKernel,
    args: Args,
}

/// The fused attentions of `g` at batch 2, seq `seq` (the dropout key's
/// words as a launch binds them, at layer 2 of a micro-batch from sample 4).
fn attention_cases(g: &Graph, seq: i64, out: &mut Vec<AttentionCase>) {
    let syms: HashMap<String, i64> = [("batch".to_string(), 2), ("seq".to_string(), seq)].into();
    let place = dplc_codegen::KeyPlace::unsplit(2, 4, 2);
    for (r, _) in g.regions() {
        for step in fuse(g, r).steps {
            let Step::Attention(at) = step else { continue };
            out.push(AttentionCase {
                kernel: at.kernel.clone(),
                args: Args {
                    sizes: common::launch_sizes(g, &at.sizes, &at.key_sizes, &syms, &place),
                    scalars: vec![],
                    seed: 9,
                },
            });
        }
    }
}

/// The passes of `k` to check in `dtype`: both backwards' where the
/// codegen takes the one pass ([`common::attention_passes`]); in f16, whose
/// code differs from bf16's only in the storage type's conversions, the
/// passes the codegen takes alone (the test stays well under a minute).
fn passes(k: &dplc_codegen::AttentionKernel, dtype: DType) -> Vec<dplc_codegen::AttentionPass> {
    if dtype == DType::F16 {
        return k
            .passes(dplc_codegen::attention_backward(k, dtype))
            .into_iter()
            .filter(|&p| k.runs(p, [true; 4]))
            .collect();
    }
    common::attention_passes(k, dtype)
}

/// Every pass of `case` on the CPU-compiled C against the interpreter, the
/// backward passes fed the interpreter's forward; the worst error.
fn check_attention(
    lib: &libloading::Library,
    case: &AttentionCase,
    dtype: DType,
    rng: &mut common::Rng,
) -> f64 {
    use dplc_codegen::{interpret_attention, AttentionBuffer, AttentionPass, BufferRef};
    let k = &case.kernel;
    let len = |pass: AttentionPass, role: AttentionBuffer| -> usize {
        let i = k.roles(pass).iter().position(|&r| r == role).unwrap();
        k.buffers(pass)[i]
            .len
            .iter()
            .map(|&s| case.args.size(s))
            .product::<i64>() as usize
    };
    let mut values: HashMap<AttentionBuffer, Vec<f32>> = HashMap::new();
    for role in [
        AttentionBuffer::Q,
        AttentionBuffer::K,
        AttentionBuffer::V,
        AttentionBuffer::Bias,
        AttentionBuffer::OutGrad,
    ] {
        if role == AttentionBuffer::Bias && k.bias.is_none() {
            continue;
        }
        let n = len(AttentionPass::KeyValueGrad, role);
        values.insert(
            role,
            (0..n).map(|_| stored(rng.normal_ish(), dtype)).collect(),
        );
    }
    let mut worst = 0.0f64;
    for (pass, src) in sources(k, dtype) {
        let block = match src.launch {
            dplc_codegen::LaunchShape::Rows { block }
            | dplc_codegen::LaunchShape::Tiles { block, .. } => block,
            _ => 64,
        };
        let roles = k.roles(pass);
        let specs = k.buffers(pass);
        let mut host: Vec<Data> = Vec::new();
        let mut bytes: Vec<Vec<u8>> = Vec::new();
        for (&role, b) in roles.iter().zip(&specs) {
            let n = len(pass, role);
            let d = if b.elem == Elem::Float {
                dtype
            } else {
                DType::F32
            };
            if b.output {
                host.push(Data::F32(vec![0.0; n]));
                // As the executor gives them: a gradient whose view reaches
                // part of its buffer zeroed (a view of a fused buffer writes
                // only its columns; the bias's), one reaching every element
                // poisoned, as the forward's outputs: each is written whole.
                let zeroed = !k.written_whole(role, &case.args, n);
                bytes.push(vec![
                    if zeroed { 0 } else { 0xff };
                    n * d.size_bytes() as usize + 16
                ]);
            } else {
                let v = values[&role].clone();
                bytes.push(to_storage(&v, d));
                host.push(Data::F32(v));
            }
        }
        let mut ptrs: Vec<*mut u8> = bytes.iter_mut().map(|b| b.as_mut_ptr()).collect();
        // SAFETY: the launcher takes the pass's buffers in order, sized
        // for this launch (with slack), and its sizes.
        unsafe {
            let launch: libloading::Symbol<Launch> = lib
                .get(format!("launch_{}\0", src.name).as_bytes())
                .unwrap_or_else(|e| panic!("{}: {e}", src.name));
            launch(
                ptrs.as_mut_ptr(),
                case.args.sizes.as_ptr(),
                std::ptr::null(),
                case.args.seed,
                2,
                block,
            );
        }
        {
            let mut inputs = host.clone();
            let mut refs: Vec<BufferRef> = Vec::new();
            for ((spec, h), i) in specs.iter().zip(host.iter_mut()).zip(inputs.iter_mut()) {
                refs.push(if spec.output {
                    BufferRef::Output(h)
                } else {
                    BufferRef::Input(i)
                });
            }
            interpret_attention(k, pass, &case.args, &mut refs).expect("interprets");
        }
        for ((&role, b), (h, got)) in roles.iter().zip(&specs).zip(host.iter().zip(&bytes)) {
            if !b.output {
                continue;
            }
            let want = h.f32();
            let d = if b.elem == Elem::Float {
                dtype
            } else {
                DType::F32
            };
            let got = from_storage(got, d);
            worst = worst.max(relative_error(
                &format!("{}: {role:?}", src.name),
                &got,
                want,
            ));
            // The backward passes read the interpreter's forward.
            values.insert(role, want.to_vec());
        }
    }
    worst
}

/// The code of each pass to check in `dtype` ([`passes`]), and in bf16 each
/// of the tunings the GPU benchmark times beside the launched passes
/// (`AttentionTuning::VARIANTS`: the forward with blocks of eight warps, the
/// one-pass backward adding four columns of dQ an atomic).
fn sources(
    k: &dplc_codegen::AttentionKernel,
    dtype: DType,
) -> Vec<(dplc_codegen::AttentionPass, dplc_codegen::CudaSource)> {
    let mut out = Vec::new();
    for p in passes(k, dtype) {
        out.push((p, dplc_codegen::emit_attention(k, p, dtype)));
        if dtype == DType::BF16 {
            for tuning in dplc_codegen::AttentionTuning::VARIANTS {
                if let Some(tuned) = dplc_codegen::emit_attention_tuned(k, p, dtype, tuning) {
                    out.push((p, tuned));
                }
            }
        }
    }
    out
}

/// `launch_<name>` for every pass of every case in `dtype` (0, 1, 2).
fn attention_unit(cases: &[AttentionCase], dtype: u32) -> String {
    let mut tu = format!(
        "#define DPLC_DTYPE {dtype}\n{}\n",
        include_str!("common/host_cuda.hpp")
    );
    let mut seen = std::collections::BTreeSet::new();
    for case in cases {
        let k = &case.kernel;
        for (pass, src) in sources(k, dtype_of(dtype)) {
            if !seen.insert(src.name.clone()) {
                continue;
            }
            tu += &src.source;
            let buffers = k.buffers(pass);
            tu += &launcher(&src.name, &buffers, k.sizes, 0, k.dropout.is_some());
        }
    }
    tu
}

/// Fused attention's C on the CPU: the scalar passes in f32, the
/// tensor-core forward (its `mma` steps as the PTX ISA lays out their
/// fragments) and the scalar backward passes in bf16 and f16, for the tiny
/// models' attentions (causal; grouped-query) and a bare causal attention
/// with dropout — each pass equal to the interpreter, the backward fed the
/// interpreter's forward: f32 within 1e-4, bf16 and f16 within 2e-2 (the
/// GPU test's bounds).
#[test]
fn fused_attention_cuda_runs_on_the_cpu_as_the_interpreter_computes() {
    if Command::new("c++").arg("--version").output().is_err() {
        skip(
            "host_cuda_attention",
            "no C++ compiler (`c++`) on this machine",
        );
        return;
    }
    let mut cases = Vec::new();
    for model in ["gpt_tiny", "llama_tiny"] {
        attention_cases(&common::zoo("tiny.dpl", model).graph, 70, &mut cases);
    }
    attention_cases(&common::lower_m(common::PLACED), 70, &mut cases);
    // The tensor-core paths with dropout, a window and a value width other
    // than the key's: the common bare attentions at widths of whole `k16`
    // steps, under cp 2 too (its queries placed in the sequence).
    for model in [common::PLACED, common::PLACED_WINDOWED] {
        let wide = model.replace("seq, 8]", "seq, 16]").replace(
            "v: f32[batch, heads, seq, 16]",
            "v: f32[batch, heads, seq, 32]",
        );
        attention_cases(&common::lower_m(&wide), 70, &mut cases);
        attention_cases(&common::placed_attention(&wide, 1, 2), 70, &mut cases);
    }
    // At 136 positions whole tiles lie under the causal diagonal: the
    // passes' unmasked branch (`all_visible`), beside the masked one.
    let wide = common::PLACED.replace("seq, 8]", "seq, 16]").replace(
        "v: f32[batch, heads, seq, 16]",
        "v: f32[batch, heads, seq, 32]",
    );
    attention_cases(&common::lower_m(&wide), 136, &mut cases);
    // Llama's head width: the forward's 64-key tiles, double-buffered, take
    // 68 KB of dynamic shared memory (one head: the emulated tensor cores
    // are slow at this width).
    let wide = common::PLACED
        .replace("heads = 4", "heads = 1")
        .replace("seq, 8]", "seq, 128]")
        .replace("seq, 16]", "seq, 128]");
    attention_cases(&common::lower_m(&wide), 65, &mut cases);
    // An odd sequence: neighbouring keys straddle the draws' pairs in
    // every other row (`dplc_sample_draw2`'s second path); a value width
    // of 8 · odd: `O += P·V` ends on a column block no `ldmatrix.x4` pairs.
    let wide = common::PLACED.replace("seq, 8]", "seq, 16]").replace(
        "v: f32[batch, heads, seq, 16]",
        "v: f32[batch, heads, seq, 24]",
    );
    attention_cases(&common::lower_m(&wide), 69, &mut cases);
    // Under cp 3 at 18 positions a rank's queries are two chunks of 3.
    attention_cases(&common::placed_attention(&wide, 1, 3), 18, &mut cases);
    assert!(cases.len() >= 7, "{} attentions", cases.len());
    let dir = std::env::temp_dir().join(format!("dplc-host-attention-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let dtypes = [(0u32, 1e-4), (1, 2e-2), (2, 2e-2)];
    let libs: Vec<PathBuf> = std::thread::scope(|s| {
        let jobs: Vec<_> = dtypes
            .iter()
            .map(|&(code, _)| {
                let tu = attention_unit(&cases, code);
                let dir = &dir;
                s.spawn(move || compile(&tu, dir, &format!("attention_{code}")))
            })
            .collect();
        jobs.into_iter()
            .map(|j| j.join().unwrap().unwrap_or_else(|e| panic!("{e}")))
            .collect()
    });
    // Each storage type's checks on their own thread (their own library,
    // their own random inputs): the CPU's cores share the emulation.
    std::thread::scope(|s| {
        for (&(code, tol), lib_path) in dtypes.iter().zip(&libs) {
            let cases = &cases;
            s.spawn(move || {
                let dtype = dtype_of(code);
                let mut rng = common::Rng(23 + u64::from(code));
                // SAFETY: a library this test just built from the generated C.
                let lib = unsafe { libloading::Library::new(lib_path) }.expect("loads");
                for case in cases {
                    let err = check_attention(&lib, case, dtype, &mut rng);
                    assert!(
                        err <= tol,
                        "attention ({dtype:?}): relative error {err:e} > {tol:e}"
                    );
                }
            });
        }
    });
    let _ = std::fs::remove_dir_all(&dir);
    eprintln!(
        "{} fused attentions' passes run as C on the CPU in f32, bf16 and f16, equal to the interpreter",
        cases.len()
    );
}
