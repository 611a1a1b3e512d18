//! The generated CUDA C itself, run on the CPU: every elementwise, row and
//! scan kernel of the tiny zoo models (forward, fused backward and column
//! sums) and the training step's flat kernels, in f32, bf16 and f16, compiled
//! by the machine's C++ compiler against `common/host_cuda.hpp` (a block's
//! threads as OS threads, barriers, warp shuffles, atomics, the storage
//! conversions) and launched on random inputs, equal to the interpreter:
//! f32 within 1e-5, bf16 and f16 within 1e-2, norm-wise relative. The
//! interpreter checks what a kernel computes; this checks the C that says
//! it — indexing, vector widths, tiles, reductions, the draws — on any
//! machine, where the GPU tests need a GPU. The fused attention's passes
//! run too, their inline PTX (`mma.m16n8k16`, `ldmatrix`, `cp.async`)
//! emulated as the PTX ISA lays out each warp's fragments. Without `c++`
//! the test says so and passes.

mod common;

use dplc_codegen::{
    adamw_kernel, add_kernel, backward_plan, column_sum_kernel, convert_kernel, emit_cuda, fuse,
    interpret, sgd_kernel, sum_squares_kernel, AdamwScalars, Args, BackwardStep, Data, Elem,
    Kernel, SgdScalars, Step, SUM_SQUARES_COLS,
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
}

fn skip(why: &str) {
    use std::io::Write;
    let _ = writeln!(std::io::stderr(), "SKIPPED host_cuda: {why}");
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
        let plan = fuse(g, r);
        for step in &plan.steps {
            if let Step::Kernel(k) = step {
                out.push(Case {
                    kernel: k.kernel.clone(),
                    args: args(sized_keyed(&k.sizes, &k.key_sizes)),
                    non_negative: vec![],
                    masked: vec![],
                });
            }
        }
        for step in backward_plan(g, &plan) {
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
                });
            }
            out.push(Case {
                kernel: backward.kernel,
                args: args(sizes),
                non_negative: vec![],
                masked: vec![],
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
    out.push(Case {
        kernel: adamw_kernel(),
        args: adamw.args(n),
        // p', m', v', then p, g, m, v: v is a second moment.
        non_negative: vec![6],
        masked: vec![],
    });
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
    });
}

fn c_type(elem: Elem) -> &'static str {
    match elem {
        Elem::Float => "dplc_t",
        Elem::F32 => "float",
        Elem::I32 => "int",
    }
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

/// `launch_<name>(buffers, sizes, scalars, seed, grid, block)`: kernel
/// `name`'s arguments from arrays, run as a grid on the CPU.
fn launcher(
    name: &str,
    buffers: &[dplc_codegen::Buffer],
    sizes: usize,
    scalars: usize,
    random: bool,
) -> String {
    let mut args: Vec<String> = buffers
        .iter()
        .enumerate()
        .map(|(i, b)| {
            let c = if b.output { "" } else { "const " };
            format!("({c}{}*)b[{i}]", c_type(b.elem))
        })
        .collect();
    args.extend((0..sizes).map(|i| format!("n[{i}]")));
    args.extend((0..scalars).map(|i| format!("s[{i}]")));
    if random {
        args.push("seed".into());
    }
    format!(
        "\nextern \"C\" void launch_{name}(void** b, const long long* n, const float* s, \
         unsigned long long seed, unsigned grid, unsigned block) {{\n    \
         (void)n; (void)s; (void)seed;\n    dplc_run(grid, block, [&] {{ {name}({}); }});\n}}\n",
        args.join(", ")
    )
}

fn dtype_of(code: u32) -> DType {
    match code {
        0 => DType::F32,
        1 => DType::BF16,
        _ => DType::F16,
    }
}

/// `x` as `dtype` stores it, back as f32.
fn stored(x: f32, dtype: DType) -> f32 {
    match dtype {
        DType::BF16 => {
            let u = x.to_bits();
            let r = u.wrapping_add(0x7fff + ((u >> 16) & 1));
            f32::from_bits(r & 0xffff_0000)
        }
        DType::F16 => {
            // Round to 11 significant bits (the cases stay in f16's range;
            // a masked −∞ stays −∞).
            if x == 0.0 || !x.is_finite() {
                return x;
            }
            let e = x.abs().log2().floor() as i32;
            let q = 2f32.powi(e - 10);
            (x / q).round_ties_even() * q
        }
        _ => x,
    }
}

fn to_storage(v: &[f32], dtype: DType) -> Vec<u8> {
    match dtype {
        DType::BF16 => v
            .iter()
            .flat_map(|x| ((stored(*x, dtype).to_bits() >> 16) as u16).to_le_bytes())
            .collect(),
        DType::F16 => v.iter().flat_map(|x| f16_bits(*x).to_le_bytes()).collect(),
        _ => v.iter().flat_map(|x| x.to_le_bytes()).collect(),
    }
}

fn f16_bits(x: f32) -> u16 {
    let x = stored(x, DType::F16);
    if x == 0.0 {
        return if x.is_sign_negative() { 0x8000 } else { 0 };
    }
    let sign = if x < 0.0 { 0x8000u16 } else { 0 };
    if x.is_nan() {
        return 0x7e00;
    }
    if x.is_infinite() {
        return sign | 0x7c00;
    }
    let a = x.abs();
    let e = a.log2().floor() as i32;
    if e < -14 {
        // Subnormal: a multiple of 2^-24.
        return sign | (a / 2f32.powi(-24)).round() as u16;
    }
    let m = ((a / 2f32.powi(e) - 1.0) * 1024.0).round() as u16;
    sign | (((e + 15) as u16) << 10) | m
}

fn from_storage(b: &[u8], dtype: DType) -> Vec<f32> {
    match dtype {
        DType::BF16 => b
            .chunks(2)
            .map(|c| f32::from_bits(u32::from(u16::from_le_bytes([c[0], c[1]])) << 16))
            .collect(),
        DType::F16 => b
            .chunks(2)
            .map(|c| {
                let h = u16::from_le_bytes([c[0], c[1]]);
                let sign = if h & 0x8000 != 0 { -1.0 } else { 1.0 };
                let e = i32::from((h >> 10) & 0x1f);
                let m = f32::from(h & 0x3ff);
                sign * match e {
                    0 => m * 2f32.powi(-24),
                    31 => {
                        if m == 0.0 {
                            f32::INFINITY
                        } else {
                            f32::NAN
                        }
                    }
                    _ => (1.0 + m / 1024.0) * 2f32.powi(e - 15),
                }
            })
            .collect(),
        _ => b
            .chunks(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect(),
    }
}

fn compile(tu: &str, dir: &Path, tag: &str) -> Result<PathBuf, String> {
    let src = dir.join(format!("{tag}.cpp"));
    let lib = dir.join(format!("lib{tag}.so"));
    std::fs::write(&src, tu).map_err(|e| e.to_string())?;
    let out = Command::new("c++")
        .args([
            "-std=c++20",
            "-O1",
            "-shared",
            "-fPIC",
            "-pthread",
            "-w",
            "-o",
        ])
        .arg(&lib)
        .arg(&src)
        .output()
        .map_err(|e| format!("c++ cannot run: {e}"))?;
    if !out.status.success() {
        return Err(format!(
            "c++ failed on {}:\n{}",
            src.display(),
            String::from_utf8_lossy(&out.stderr)
                .lines()
                .take(30)
                .collect::<Vec<_>>()
                .join("\n")
        ));
    }
    Ok(lib)
}

/// `‖got − want‖ / ‖want‖`, an element of `want`'s infinities equal where
/// `got` has it too; a NaN in `got` where `want` has none (an element the
/// kernel left poisoned, or computed wrong) fails naming `what`.
fn relative_error(what: &str, got: &[f32], want: &[f32]) -> f64 {
    let (mut num, mut den) = (0.0f64, 0.0f64);
    for (j, (x, y)) in got.iter().zip(want).enumerate() {
        assert!(
            !x.is_nan() || y.is_nan(),
            "{what}[{j}] unwritten or NaN (want {y})"
        );
        if y.is_infinite() && x == y {
            continue;
        }
        num += (f64::from(*x) - f64::from(*y)).powi(2);
        den += f64::from(*y).powi(2);
    }
    num.sqrt() / den.sqrt().max(1e-30)
}

type Launch = unsafe extern "C" fn(*mut *mut u8, *const i64, *const f32, u64, u32, u32);

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
        skip("no C++ compiler (`c++`) on this machine");
        return;
    }
    let mut cases = Vec::new();
    for model in ["gpt_tiny", "llama_tiny"] {
        graph_cases(&common::zoo("tiny.dpl", model).graph, &mut cases);
    }
    // gpt_tiny with GPT-2's dropout: the kernels that draw it.
    let text =
        std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("../models/tiny.dpl"))
            .unwrap();
    let dropped = text.replacen(
        "layers = 2, dropout = 0.0)",
        "layers = 2, dropout = 0.1)",
        1,
    );
    assert_ne!(dropped, text, "gpt_tiny's header changed");
    let unit = dplc_frontend::parse("models/tiny.dpl", &dropped).unwrap();
    graph_cases(&unit.lower("gpt_tiny").unwrap().graph, &mut cases);
    // A vocabulary of 4,099 logits, no multiple of a vector (GPT-2's
    // 50,257 is not either): each row of the loss starts misaligned its own
    // way, and the row kernels walk its head and tail one element at a time.
    let odd = text.replacen(
        "model gpt_tiny(vocab = 256,",
        "model gpt_tiny(vocab = 4099,",
        1,
    );
    assert_ne!(odd, text, "gpt_tiny's header changed");
    let unit = dplc_frontend::parse("models/tiny.dpl", &odd).unwrap();
    let before = cases.len();
    graph_cases(&unit.lower("gpt_tiny").unwrap().graph, &mut cases);
    assert!(
        cases[before..]
            .iter()
            .any(|c| emit_cuda(&c.kernel, DType::BF16)
                .source
                .contains("dplc_head")),
        "a loss row walked from its unaligned head"
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
    for pass in AttentionPass::ALL {
        if !k.runs(pass, [true; 4]) {
            continue;
        }
        let src = dplc_codegen::emit_attention(k, pass, dtype);
        let block = match src.launch {
            dplc_codegen::LaunchShape::Rows { block } => block,
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
                // Gradients are zeroed by the caller (a view of a fused
                // buffer writes only its columns); the forward's outputs
                // poisoned: it writes every element.
                let zeroed = !matches!(
                    role,
                    AttentionBuffer::Out | AttentionBuffer::LogSumExp | AttentionBuffer::Delta
                );
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

/// `launch_<name>` for every pass of every case in `dtype` (0, 1, 2).
fn attention_unit(cases: &[AttentionCase], dtype: u32) -> String {
    use dplc_codegen::AttentionPass;
    let mut tu = format!(
        "#define DPLC_DTYPE {dtype}\n{}\n",
        include_str!("common/host_cuda.hpp")
    );
    let mut seen = std::collections::BTreeSet::new();
    for case in cases {
        let k = &case.kernel;
        for pass in AttentionPass::ALL {
            if !k.runs(pass, [true; 4]) {
                continue;
            }
            let src = dplc_codegen::emit_attention(k, pass, dtype_of(dtype));
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
        skip("no C++ compiler (`c++`) on this machine");
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
    let mut rng = common::Rng(23);
    for (&(code, tol), lib_path) in dtypes.iter().zip(&libs) {
        let dtype = dtype_of(code);
        // SAFETY: a library this test just built from the generated C.
        let lib = unsafe { libloading::Library::new(lib_path) }.expect("loads");
        for case in &cases {
            let err = check_attention(&lib, case, dtype, &mut rng);
            assert!(
                err <= tol,
                "attention ({dtype:?}): relative error {err:e} > {tol:e}"
            );
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
    eprintln!(
        "{} fused attentions' passes run as C on the CPU in f32, bf16 and f16, equal to the interpreter",
        cases.len()
    );
}
