//! What finding a kernel costs the GPU backend on every launch: naming it
//! (`kernel_name` renders and hashes its text) against comparing it with the
//! copy `KernelCache` keeps per address. Over the forward, backward and
//! training-step kernels of gpt2. `cargo bench --bench kernel_lookup`.

use std::hint::black_box;
use std::time::Instant;

fn main() {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/models/gpt2.dpl");
    let text = std::fs::read_to_string(path).expect("models/gpt2.dpl");
    let unit = dplc_frontend::parse("gpt2.dpl", &text).expect("gpt2.dpl parses");
    let lowered = unit.lower("gpt2").expect("gpt2 lowers");
    let fused = dplc_runtime::fused::FusedGraph::new(&lowered.graph).expect("gpt2 fuses");
    let kernels = fused.kernels();
    let copies = kernels.clone();
    let rounds = 200;
    let per_kernel = |f: &mut dyn FnMut()| {
        let start = Instant::now();
        for _ in 0..rounds {
            f();
        }
        start.elapsed().as_secs_f64() / (rounds * kernels.len()) as f64 * 1e6
    };
    let naming = per_kernel(&mut || {
        for k in &kernels {
            black_box(dplc_codegen::kernel_name(
                black_box(k),
                dplc_ir::DType::BF16,
            ));
        }
    });
    let comparing = per_kernel(&mut || {
        for (k, c) in kernels.iter().zip(&copies) {
            black_box(black_box(k) == black_box(c));
        }
    });
    println!(
        "{} kernels: naming {naming:.2} µs per kernel, comparing with the cached copy {comparing:.3} µs",
        kernels.len()
    );
}
