//! The generated CUDA C itself, run on the CPU: every elementwise, row and
//! scan kernel of the tiny zoo models (forward, fused backward and column
//! sums) and the training step's flat kernels, in f32, bf16 and f16, compiled
//! by the machine's C++ compiler against `common/host_cuda.hpp` (a block's
//! threads as fibers on x86-64 and OS threads elsewhere, barriers, warp
//! shuffles, atomics, the storage conversions) and launched on random inputs, equal to the interpreter:
//! f32 within 1e-5, bf16 and f16 within 1e-2, norm-wise relative. The
//! interpreter checks what a kernel computes; this checks the C that says
//! it — indexing, vector widths, tiles, reductions, the draws — on any
//! machine, where the GPU tests need a GPU (the fused attention's passes:
//! `host_cuda_attention.rs`). Without `c++` the test says so and passes.

mod common;

use common::host::{
    compile, dtype_of, from_storage, launcher, relative_error, skip, stored, to_storage, Launch,
};

use dplc_codegen::{
    adamw_kernel, adamw_value_kernel, add_kernel, backward_plan, column_sum_kernel, convert_kernel,
    emit_cuda, fuse, interpret, sgd_kernel, sum_squares_kernel, AdamwScalars, Args, BackwardStep,
    Data, Elem, Kernel, SgdScalars, Step, SUM_SQUARES_COLS,
};
use dplc_codegen::{
    vocab_embedding_backward_kernel, vocab_embedding_kernel, vocab_normalize_backward_kernel,
    vocab_normalize_kernel, vocab_row_stats_kernel, vocab_row_sum_kernel,
    vocab_take_backward_kernel, vocab_take_kernel, GradBinding,
};
use dplc_ir::{DType, Graph};
use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::process::Command;

/// One launch to check: a kernel and its arguments.
struct Case {
    kernel: Kernel,
    args: Args,
    /// Buffers drawn as magnitudes (a second moment).
    non_negative: Vec<usize>,
    /// Buffers with about seven in eight of their elements −∞ (masked
    /// scores, which a softmax's statistics must skip; so many that some
    /// threads see nothing else).
    masked: Vec<usize>,
    /// A backward reading row statistics: its forward, which computes them
    /// from the case's inputs (random statistics would be no row's).
    row_stats: Option<(Kernel, dplc_codegen::Backward)>,
}

/// Every forward, backward and column-sum kernel of `g` at batch 3, seq 8.
fn graph_cases(g: &Graph, out: &mut Vec<Case>) {
    let syms: HashMap<String, i64> = [("batch".to_string(), 3), ("seq".to_string(), 8)].into();
    // The dropout's key as a run binds it (layer 1 of a micro-batch of 3
    // from sample 5): each draw splits its index into sample and position.
    let place = dplc_codegen::KeyPlace::unsplit(1, 5, 3);
    let numel = |t: dplc_ir::TensorId| -> usize {
        g.tensor(t)
            .shape
            .0
            .iter()
            .map(|d| common::dim(d, &syms, g))
            .product()
    };
    let sized_keyed = |dims: &[dplc_ir::Dim], keys: &[(usize, dplc_codegen::KeySize)]| {
        let mut sizes: Vec<i64> = dims
            .iter()
            .map(|d| common::dim(d, &syms, g) as i64)
            .collect();
        place.bind_keys(&mut sizes, keys, numel);
        sizes
    };
    let args = |sizes: Vec<i64>| Args {
        sizes,
        scalars: vec![],
        seed: 9,
    };
    for (r, _) in g.regions() {
        let mut plan = fuse(g, r);
        let back = backward_plan(g, &mut plan);
        for step in &plan.steps {
            if let Step::Kernel(k) = step {
                out.push(Case {
                    kernel: k.kernel.clone(),
                    args: args(sized_keyed(&k.sizes, &k.key_sizes)),
                    non_negative: vec![],
                    masked: vec![],
                    row_stats: None,
                });
            }
        }
        for step in back {
            let BackwardStep::Kernel { step, backward } = step else {
                continue;
            };
            let Step::Kernel(fk) = &plan.steps[step] else {
                continue;
            };
            let sizes = sized_keyed(&fk.sizes, &fk.key_sizes);
            for cs in &backward.column_sums {
                out.push(Case {
                    kernel: cs.kernel.clone(),
                    args: args(cs.sizes(&sizes)),
                    non_negative: vec![],
                    masked: vec![],
                    row_stats: None,
                });
            }
            out.push(Case {
                kernel: backward.kernel.clone(),
                args: args(sizes),
                non_negative: vec![],
                masked: vec![],
                row_stats: fk.keeps_row_stats.then(|| (fk.kernel.clone(), backward)),
            });
        }
    }
}

/// The training step's flat kernels at 4,099 elements (past a vector's
/// and a block's multiple).
fn step_cases(out: &mut Vec<Case>) {
    let n = 4099;
    let flat = |kernel: Kernel| Case {
        kernel,
        args: Args {
            sizes: vec![n],
            scalars: vec![],
            seed: 0,
        },
        non_negative: vec![],
        masked: vec![],
        row_stats: None,
    };
    let adamw = AdamwScalars {
        lr: 1e-3,
        beta1: 0.9,
        beta2: 0.95,
        eps: 1e-8,
        weight_decay: 0.1,
        step: 3,
        grad_scale: 0.5,
    };
    // p', m', v', then p, g, m, v (a second moment), and the variant's
    // compute copy after them.
    for kernel in [adamw_kernel(), adamw_value_kernel()] {
        out.push(Case {
            kernel,
            args: adamw.args(n),
            non_negative: vec![6],
            masked: vec![],
            row_stats: None,
        });
    }
    let sgd = SgdScalars {
        lr: 0.1,
        momentum: 0.9,
        grad_scale: 0.5,
    };
    out.push(Case {
        kernel: sgd_kernel(),
        args: sgd.args(n),
        non_negative: vec![],
        masked: vec![],
        row_stats: None,
    });
    for (to, from) in [(Elem::Float, Elem::F32), (Elem::F32, Elem::Float)] {
        out.push(flat(convert_kernel(to, from)));
    }
    for (o, a, b) in [
        (Elem::F32, Elem::F32, Elem::Float),
        (Elem::Float, Elem::Float, Elem::F32),
    ] {
        out.push(flat(add_kernel(o, a, b)));
    }
    let rows = (n + SUM_SQUARES_COLS - 1) / SUM_SQUARES_COLS;
    out.push(Case {
        kernel: sum_squares_kernel(Elem::F32),
        args: Args {
            sizes: vec![rows, SUM_SQUARES_COLS, n],
            scalars: vec![],
            seed: 0,
        },
        non_negative: vec![],
        masked: vec![],
        row_stats: None,
    });
    out.push(Case {
        kernel: column_sum_kernel(),
        args: Args {
            sizes: vec![37, 65],
            scalars: vec![],
            seed: 0,
        },
        non_negative: vec![],
        masked: vec![],
        row_stats: None,
    });
    // A long column sum's first pass: 2,100 rows in chunks of 1,024, the
    // last one short.
    out.push(Case {
        kernel: dplc_codegen::column_chunk_kernel(),
        args: Args {
            sizes: vec![2100, 65, 1024, 3],
            scalars: vec![],
            seed: 0,
        },
        non_negative: vec![],
        masked: vec![],
        row_stats: None,
    });
    // A layout change's sum of a group's parts.
    for elem in [Elem::Float, Elem::F32] {
        out.push(flat(dplc_codegen::sum_parts_kernel(elem, 3)));
    }
    vocab_cases(out);
    moe_cases(out);
}

/// The kernels of MoE routing with two choices a token: top-2 over 37 rows
/// of 9 scores, and dispatch and combine between 37 tokens and 8 slots (the
/// tables drawn 0 to 3 index tokens 0 and 1 and slots 0 to 3).
fn moe_cases(out: &mut Vec<Case>) {
    let case = |kernel: Kernel, sizes: Vec<i64>| Case {
        kernel,
        args: Args {
            sizes,
            scalars: vec![],
            seed: 0,
        },
        non_negative: vec![],
        masked: vec![],
        row_stats: None,
    };
    out.push(case(dplc_codegen::moe_top_k_kernel(2), vec![37, 9]));
    out.push(case(
        dplc_codegen::moe_top_k_backward_kernel(2),
        vec![37, 9],
    ));
    out.push(case(dplc_codegen::moe_dispatch_kernel(2), vec![8, 65, 37]));
    out.push(case(
        dplc_codegen::moe_dispatch_backward_kernel(2),
        vec![37, 65, 8],
    ));
    out.push(case(dplc_codegen::moe_combine_kernel(2), vec![37, 65, 8]));
    out.push(case(
        dplc_codegen::moe_combine_backward_kernel(2),
        vec![8, 65, 37],
    ));
    out.push(case(
        dplc_codegen::moe_combine_weights_backward_kernel(2),
        vec![74, 65, 8, 37],
    ));
}

/// The kernels of the ops over a split vocabulary: the softmax's over 37
/// rows of 4,099 entries (a wide row past a vector's multiple), its
/// statistics drawn as a maximum and a positive sum; the picks and the
/// embedding over a slice of two entries from index 1, so that the ids
/// drawn (0 to 3) fall before, in and after it.
fn vocab_cases(out: &mut Vec<Case>) {
    let case = |kernel: Kernel, sizes: Vec<i64>, non_negative: Vec<usize>| Case {
        kernel,
        args: Args {
            sizes,
            scalars: vec![],
            seed: 0,
        },
        non_negative,
        masked: vec![],
        row_stats: None,
    };
    let wide = vec![37, 4099];
    out.push(case(vocab_row_stats_kernel(), wide.clone(), vec![]));
    for log in [true, false] {
        out.push(case(vocab_normalize_kernel(log), wide.clone(), vec![1]));
        out.push(case(vocab_row_sum_kernel(log), wide.clone(), vec![]));
        out.push(case(
            vocab_normalize_backward_kernel(log),
            wide.clone(),
            vec![],
        ));
    }
    out.push(case(vocab_take_kernel(), vec![37, 2, 1], vec![]));
    out.push(case(vocab_take_backward_kernel(), vec![37, 2, 1], vec![]));
    out.push(case(vocab_embedding_kernel(), vec![37, 2, 1, 9], vec![]));
    out.push(case(
        vocab_embedding_backward_kernel(),
        vec![37, 2, 1, 9],
        vec![],
    ));
}

/// One translation unit of `cases`' kernels in `dtype` (0 f32, 1 bf16, 2
/// f16), each with a launcher `launch_<name>(buffers, sizes, scalars, seed,
/// grid, block)`.
fn translation_unit(cases: &[(String, &Case)], dtype: u32) -> String {
    let mut tu = format!(
        "#define DPLC_DTYPE {dtype}\n{}\n",
        include_str!("common/host_cuda.hpp")
    );
    let mut seen = std::collections::BTreeSet::new();
    for (name, case) in cases {
        if !seen.insert(name.clone()) {
            continue;
        }
        let src = emit_cuda(&case.kernel, dtype_of(dtype));
        tu += &src.source;
        let k = &case.kernel;
        tu += &launcher(name, &k.buffers, k.sizes, k.scalars, k.uses_random());
    }
    tu
}

/// Run `case` through `lib`'s launcher and the interpreter on the same
/// random inputs; the worst norm-wise relative error over its outputs.
fn check(
    lib: &libloading::Library,
    name: &str,
    case: &Case,
    dtype: DType,
    rng: &mut common::Rng,
) -> f64 {
    let k = &case.kernel;
    let mut host: Vec<Data> = Vec::new();
    let mut bytes: Vec<Vec<u8>> = Vec::new();
    for (i, b) in k.buffers.iter().enumerate() {
        let n = case.args.buffer_len(k, i).max(1);
        let width = match b.elem {
            Elem::Float => dtype.size_bytes() as usize,
            _ => 4,
        };
        if b.output {
            host.push(Data::F32(vec![]));
            // Poisoned — every element a kernel writes, it must write —
            // except a buffer it adds into, which its caller zeroes.
            let adds = k.stores.iter().any(|st| st.buf == i && st.accumulate);
            bytes.push(vec![if adds { 0 } else { 0xff }; n * width + 16]);
        } else if b.elem == Elem::I32 {
            let v: Vec<i32> = (0..n).map(|_| (rng.next() % 4) as i32).collect();
            bytes.push(v.iter().flat_map(|x| x.to_le_bytes()).collect());
            host.push(Data::I32(v));
        } else {
            let magnitude = case.non_negative.contains(&i);
            let masked = case.masked.contains(&i);
            let d = if b.elem == Elem::Float {
                dtype
            } else {
                DType::F32
            };
            let v: Vec<f32> = (0..n)
                .map(|_| {
                    let x = rng.normal_ish();
                    if masked && !rng.next().is_multiple_of(8) {
                        return f32::NEG_INFINITY;
                    }
                    stored(if magnitude { x.abs() } else { x }, d)
                })
                .collect();
            bytes.push(to_storage(&v, d));
            host.push(Data::F32(v));
        }
    }
    if let Some((forward, backward)) = &case.row_stats {
        let at = backward
            .bindings
            .iter()
            .position(|b| *b == GradBinding::RowStats)
            .expect("a backward reading statistics");
        let stats = backward
            .row_stats(forward, &case.args, &host)
            .expect("interprets")
            .expect("statistics");
        bytes[at] = to_storage(stats.f32(), DType::F32);
        host[at] = stats;
    }
    let mut ptrs: Vec<*mut u8> = bytes.iter_mut().map(|b| b.as_mut_ptr()).collect();
    let sizes = case.args.sizes.clone();
    let scalars = case.args.scalars.clone();
    let block = match emit_cuda(k, dtype).launch {
        dplc_codegen::LaunchShape::Elementwise { .. } => 64,
        // Two warps: the block reductions cross warps.
        dplc_codegen::LaunchShape::Rows { block } => block.min(64),
        // Two warps: two rows a block, the grid striding over the rest.
        dplc_codegen::LaunchShape::WarpRows { block } => block.min(64),
        // Eight threads a column, the grid striding over the tiles.
        dplc_codegen::LaunchShape::Columns { block } => block.min(64),
        // Generated kernels take no several-item blocks (the attention's
        // wider forward does: host_cuda_attention.rs).
        dplc_codegen::LaunchShape::Tiles { block, .. } => block.min(64),
    };
    // SAFETY: the launcher takes the kernel's buffers in order, each sized
    // for this launch (with slack), and the arrays of its sizes and scalars.
    unsafe {
        let launch: libloading::Symbol<Launch> = lib
            .get(format!("launch_{name}\0").as_bytes())
            .unwrap_or_else(|e| panic!("{name}: {e}"));
        launch(
            ptrs.as_mut_ptr(),
            sizes.as_ptr(),
            scalars.as_ptr(),
            case.args.seed,
            2,
            block,
        );
    }
    interpret(k, &case.args, &mut host).expect("interprets");
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
        let got = from_storage(&bytes[i], d);
        worst = worst.max(relative_error(&format!("{name}: output b{i}"), &got, want));
    }
    worst
}

#[test]
fn the_generated_cuda_runs_on_the_cpu_as_the_interpreter_computes() {
    if Command::new("c++").arg("--version").output().is_err() {
        skip("host_cuda", "no C++ compiler (`c++`) on this machine");
        return;
    }
    let mut cases = Vec::new();
    for model in ["gpt_tiny", "llama_tiny"] {
        graph_cases(&common::zoo("tiny.dpl", model).graph, &mut cases);
    }
    // tiny.dpl's `model` with one header field changed (`from` → `to`).
    let text =
        std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("../models/tiny.dpl"))
            .unwrap();
    let variant = |model: &str, from: &str, to: &str| {
        let changed = text.replacen(from, to, 1);
        assert_ne!(changed, text, "{model}'s header changed");
        let unit = dplc_frontend::parse("models/tiny.dpl", &changed).unwrap();
        unit.lower(model).unwrap().graph
    };
    // gpt_tiny with GPT-2's dropout: the kernels that draw it.
    let dropped = variant(
        "gpt_tiny",
        "layers = 2, dropout = 0.0)",
        "layers = 2, dropout = 0.1)",
    );
    graph_cases(&dropped, &mut cases);
    // A vocabulary of 4,099 logits, no multiple of a vector (GPT-2's
    // 50,257 is not either): each row of the loss starts misaligned its own
    // way, and the row kernels walk its head and tail one element at a time.
    let odd = variant(
        "gpt_tiny",
        "model gpt_tiny(vocab = 256,",
        "model gpt_tiny(vocab = 4099,",
    );
    let before = cases.len();
    graph_cases(&odd, &mut cases);
    assert!(
        cases[before..]
            .iter()
            .any(|c| emit_cuda(&c.kernel, DType::BF16)
                .source
                .contains("dplc_head")),
        "a loss row walked from its unaligned head"
    );
    // llama_tiny at width 4,096: its norms' rows are a block's (past a
    // warp's 256 vectors), each walked twice (the sum of squares, then the
    // stores).
    let wide = variant(
        "llama_tiny",
        "model llama_tiny(vocab = 256, ctx = 64, d = 64,",
        "model llama_tiny(vocab = 256, ctx = 64, d = 4096,",
    );
    let before = cases.len();
    graph_cases(&wide, &mut cases);
    assert!(
        cases[before..].iter().any(|c| {
            !c.kernel.op.starts_with("log_softmax")
                && matches!(
                    emit_cuda(&c.kernel, DType::BF16).launch,
                    dplc_codegen::LaunchShape::Rows { .. }
                )
        }),
        "a norm's row walked by a block"
    );
    // The loss rows again (the vocabulary of 4,099 walked by a block, 256
    // by a warp) with most logits masked: the one-walk maximum and sum
    // skip −∞, a thread or lane that saw only −∞ adds nothing, and the
    // gradient there is 0.
    let losses: Vec<Case> = cases
        .iter()
        .filter(|c| c.kernel.op.starts_with("log_softmax_take_along"))
        .map(|c| {
            let logits = (0..c.kernel.buffers.len())
                .filter(|&i| !c.kernel.buffers[i].output && c.kernel.buffers[i].elem == Elem::Float)
                .max_by_key(|&i| c.args.buffer_len(&c.kernel, i))
                .expect("a loss reads its logits");
            Case {
                kernel: c.kernel.clone(),
                args: c.args.clone(),
                non_negative: vec![],
                masked: vec![logits],
                row_stats: None,
            }
        })
        .collect();
    assert!(losses.len() >= 4, "{} loss kernels", losses.len());
    cases.extend(losses);
    graph_cases(&common::lower_m(common::SCANS), &mut cases);
    step_cases(&mut cases);
    let dir = std::env::temp_dir().join(format!("dplc-host-cuda-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let mut rng = common::Rng(17);
    let mut report = BTreeMap::new();
    let dtypes = [(0u32, 1e-5), (1, 1e-2), (2, 1e-2)];
    let named: Vec<Vec<(String, &Case)>> = dtypes
        .iter()
        .map(|&(code, _)| {
            cases
                .iter()
                .map(|c| (emit_cuda(&c.kernel, dtype_of(code)).name, c))
                .collect()
        })
        .collect();
    // One library per storage type, compiled side by side.
    let libs: Vec<PathBuf> = std::thread::scope(|s| {
        let jobs: Vec<_> = dtypes
            .iter()
            .zip(&named)
            .map(|(&(code, _), named)| {
                let tu = translation_unit(named, code);
                let dir = &dir;
                s.spawn(move || compile(&tu, dir, dtype_of(code).name()))
            })
            .collect();
        jobs.into_iter()
            .map(|j| j.join().unwrap().unwrap_or_else(|e| panic!("{e}")))
            .collect()
    });
    for ((&(code, tol), named), lib_path) in dtypes.iter().zip(&named).zip(&libs) {
        let dtype = dtype_of(code);
        // SAFETY: a library this test just built from the generated C.
        let lib = unsafe { libloading::Library::new(lib_path) }.expect("loads");
        for (name, case) in named {
            let err = check(&lib, name, case, dtype, &mut rng);
            assert!(
                err <= tol,
                "{name} ({dtype:?}): relative error {err:e} > {tol:e}"
            );
            report.insert(
                format!("{dtype:?}"),
                report.get(&format!("{dtype:?}")).copied().unwrap_or(0) + 1,
            );
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
    eprintln!("kernels run as C on the CPU and equal to the interpreter: {report:?}");
}
