//! Running generated CUDA C on the CPU (`host_cuda.hpp`): each kernel's
//! launcher, the storage types' conversions, the C++ compile, and the
//! norm-wise error, shared by `host_cuda.rs` (the elementwise, row and scan
//! kernels) and `host_cuda_attention.rs` (the fused attention's passes).

use dplc_codegen::Elem;
use dplc_ir::DType;
use std::path::{Path, PathBuf};
use std::process::Command;

pub fn skip(test: &str, why: &str) {
    use std::io::Write;
    let _ = writeln!(std::io::stderr(), "SKIPPED {test}: {why}");
}

pub fn c_type(elem: Elem) -> &'static str {
    match elem {
        Elem::Float => "dplc_t",
        Elem::F32 => "float",
        Elem::I32 => "int",
    }
}

/// `launch_<name>(buffers, sizes, scalars, seed, grid, block)`: kernel
/// `name`'s arguments from arrays, run as a grid on the CPU.
pub fn launcher(
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

pub fn dtype_of(code: u32) -> DType {
    match code {
        0 => DType::F32,
        1 => DType::BF16,
        _ => DType::F16,
    }
}

/// `x` as `dtype` stores it, back as f32.
pub fn stored(x: f32, dtype: DType) -> f32 {
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

pub fn to_storage(v: &[f32], dtype: DType) -> Vec<u8> {
    match dtype {
        DType::BF16 => v
            .iter()
            .flat_map(|x| ((stored(*x, dtype).to_bits() >> 16) as u16).to_le_bytes())
            .collect(),
        DType::F16 => v.iter().flat_map(|x| f16_bits(*x).to_le_bytes()).collect(),
        _ => v.iter().flat_map(|x| x.to_le_bytes()).collect(),
    }
}

pub fn f16_bits(x: f32) -> u16 {
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

pub fn from_storage(b: &[u8], dtype: DType) -> Vec<f32> {
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

pub fn compile(tu: &str, dir: &Path, tag: &str) -> Result<PathBuf, String> {
    let src = dir.join(format!("{tag}.cpp"));
    let lib = dir.join(format!("lib{tag}.so"));
    std::fs::write(&src, tu).map_err(|e| e.to_string())?;
    // Unoptimised: the emulated kernels run in seconds once their threads
    // are fibers (`host_cuda.hpp`), and `-O1` took longer to compile them
    // than it saved (host_cuda_attention 31 s at -O1, 27 s at -O0;
    // host_cuda 19 s, 10 s).
    let out = Command::new("c++")
        .args([
            "-std=c++20",
            "-O0",
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
pub fn relative_error(what: &str, got: &[f32], want: &[f32]) -> f64 {
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

pub type Launch = unsafe extern "C" fn(*mut *mut u8, *const i64, *const f32, u64, u32, u32);
