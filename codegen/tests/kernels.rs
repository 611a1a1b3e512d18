//! Kernels on their own: AdamW against a scalar Rust AdamW, and golden CUDA C
//! for the kernels of a GPT layer and for gpt2's dropout draws (re-bless with
//! `cargo insta review`).

mod common;

use common::zoo;
use dplc_codegen::{
    adamw_kernel, emit_attention, emit_cuda, fuse, interpret, AdamwScalars, AttentionPass, Data,
    Step,
};
use dplc_ir::DType;

#[test]
fn adamw_matches_scalar_reference() {
    let mut rng = common::Rng(3);
    let n = 37;
    let p: Vec<f32> = (0..n).map(|_| rng.normal_ish()).collect();
    let g: Vec<f32> = (0..n).map(|_| rng.normal_ish()).collect();
    let m: Vec<f32> = (0..n).map(|_| rng.normal_ish() * 0.1).collect();
    let v: Vec<f32> = (0..n).map(|_| rng.uniform() * 0.1).collect();
    let s = AdamwScalars {
        lr: 6e-4,
        beta1: 0.9,
        beta2: 0.95,
        eps: 1e-8,
        weight_decay: 0.1,
        step: 7,
        grad_scale: 0.25,
    };
    let k = adamw_kernel();
    let mut bufs = vec![
        Data::F32(vec![]),
        Data::F32(vec![]),
        Data::F32(vec![]),
        Data::F32(p.clone()),
        Data::F32(g.clone()),
        Data::F32(m.clone()),
        Data::F32(v.clone()),
    ];
    interpret(&k, &s.args(n as i64), &mut bufs).unwrap();
    for i in 0..n {
        // PyTorch's AdamW: decay first, then the bias-corrected Adam step.
        let (b1, b2) = (s.beta1 as f64, s.beta2 as f64);
        // Clipping scales the gradient before it enters the moments.
        let gi = g[i] as f64 * s.grad_scale as f64;
        let mi = b1 * m[i] as f64 + (1.0 - b1) * gi;
        let vi = b2 * v[i] as f64 + (1.0 - b2) * gi * gi;
        let mhat = mi / (1.0 - b1.powi(s.step as i32));
        let vhat = vi / (1.0 - b2.powi(s.step as i32));
        let mut pi = p[i] as f64 * (1.0 - s.lr as f64 * s.weight_decay as f64);
        pi -= s.lr as f64 * mhat / (vhat.sqrt() + s.eps as f64);
        let close = |a: f32, b: f64| (a as f64 - b).abs() <= 1e-6 * (1.0 + b.abs());
        assert!(
            close(bufs[0].f32()[i], pi),
            "p[{i}] {} vs {pi}",
            bufs[0].f32()[i]
        );
        assert!(close(bufs[1].f32()[i], mi), "m[{i}]");
        assert!(close(bufs[2].f32()[i], vi), "v[{i}]");
    }
}

/// All generated sources of a model's kernels for one storage type.
fn cuda_of(model: &str, dtype: DType) -> String {
    let g = zoo("tiny.dpl", model).graph;
    let mut out = String::new();
    for (r, _) in g.regions() {
        for step in fuse(&g, r).steps {
            if let Step::Kernel(k) = step {
                let src = emit_cuda(&k.kernel, dtype);
                out += &format!("==== {} ({:?})\n{}\n", src.name, src.launch, src.source);
            }
        }
    }
    out
}

/// The kernels of the root region's forward and of its backward, in order.
fn root_kernels(g: &dplc_ir::Graph) -> Vec<dplc_codegen::Kernel> {
    let mut plan = fuse(g, g.root());
    let backward = dplc_codegen::backward_plan(g, &mut plan);
    let forward = plan.steps.iter().filter_map(|step| match step {
        Step::Kernel(k) => Some(k.kernel.clone()),
        _ => None,
    });
    let backward = backward.into_iter().filter_map(|step| match step {
        dplc_codegen::BackwardStep::Kernel { backward, .. } => Some(backward.kernel),
        _ => None,
    });
    forward.chain(backward).collect()
}

/// A running sum's forward kernel (an elementwise chain into the scan) and
/// its backward (the reverse scan): rows walked in tiles of the block, a
/// carry between tiles.
#[test]
fn scan_cuda_f32() {
    let mut out = String::new();
    for k in root_kernels(&common::lower_m(common::SCANS)) {
        if k.op.starts_with("mul_sub_cumsum") {
            let src = emit_cuda(&k, DType::F32);
            out += &format!("==== {} ({:?})\n{}\n", src.name, src.launch, src.source);
        }
    }
    insta::assert_snapshot!(out);
}

#[test]
fn gpt_tiny_cuda_f32() {
    insta::assert_snapshot!(cuda_of("gpt_tiny", DType::F32));
}

#[test]
fn gpt_tiny_cuda_bf16() {
    insta::assert_snapshot!(cuda_of("gpt_tiny", DType::BF16));
}

/// gpt2's kernels that draw dropout masks (the fused attention's too): each
/// one's IR, its key's size arguments, and the CUDA lines that draw (the
/// prelude's `dplc_random` and `dplc_sample_draw` are in the gpt_tiny goldens).
#[test]
fn gpt2_dropout_draws() {
    let g = zoo("gpt2.dpl", "gpt2").graph;
    let mut out = String::new();
    for (r, _) in g.regions() {
        for step in fuse(&g, r).steps {
            if let Step::Attention(at) = &step {
                if at.kernel.dropout.is_some() {
                    out += &format!("==== attention key sizes {:?}\n", at.key_sizes);
                    out += &at.kernel.text();
                    let src = emit_attention(&at.kernel, AttentionPass::Forward, DType::F32);
                    for line in src
                        .source
                        .lines()
                        .filter(|l| l.contains("dplc_sample_draw(dplc_sample_state"))
                    {
                        out += &format!("cuda: {}\n", line.trim());
                    }
                }
                continue;
            }
            let Step::Kernel(k) = step else { continue };
            if !k.kernel.uses_random() {
                continue;
            }
            let src = emit_cuda(&k.kernel, DType::F32);
            out += &format!(
                "==== {} key sizes {:?}
",
                src.name, k.key_sizes
            );
            out += &k.kernel.text();
            for line in src.source.lines().filter(|l| {
                l.contains("dplc_random(dplc_rng")
                    || l.contains("dplc_sample_draw(dplc_ds")
                    || l.contains("dplc_sample_draw2(dplc_ds")
                    || l.contains("const unsigned long long dplc_ds")
            }) {
                out += &format!("cuda: {}\n", line.trim());
            }
        }
    }
    insta::assert_snapshot!(out);
}

/// gpt_tiny's fused attention in bf16, every pass on tensor cores
/// (`mma.sync.m16n8k16`) but δ's and dQ's scaling: the forward, the
/// two-pass backward (dQ; dK and dV) and the one-pass backward (δ; dK, dV
/// and dQ's sum; dQ).
#[test]
fn gpt_tiny_attention_cuda_bf16() {
    let g = zoo("tiny.dpl", "gpt_tiny").graph;
    let mut out = String::new();
    for (r, _) in g.regions() {
        for step in fuse(&g, r).steps {
            let Step::Attention(at) = step else { continue };
            for pass in common::attention_passes(&at.kernel, DType::BF16) {
                let src = emit_attention(&at.kernel, pass, DType::BF16);
                out += &format!(
                    "==== {} ({:?}, {} bytes of shared memory)\n",
                    src.name, src.launch, src.shared_bytes
                );
                let body = src
                    .source
                    .find("\n// attention_")
                    .expect("past the helpers");
                out += &src.source[body..];
            }
        }
    }
    insta::assert_snapshot!(out);
}

#[test]
fn adamw_cuda() {
    let src = emit_cuda(&adamw_kernel(), DType::BF16);
    insta::assert_snapshot!(format!("==== {}\n{}", src.name, src.source));
}

/// A column sum reads its columns side by side: eight neighbouring columns
/// a tile, each walked by a group of the block's threads.
#[test]
fn column_sum_cuda() {
    let src = emit_cuda(&dplc_codegen::column_sum_kernel(), DType::BF16);
    assert_eq!(
        src.launch,
        dplc_codegen::LaunchShape::Columns { block: 1024 }
    );
    insta::assert_snapshot!(format!("==== {}\n{}", src.name, src.source));
}

/// A long column sum's first pass reads its chunk's columns side by side
/// too, a block per eight columns of a chunk (`column_chunks`: 8 chunks of
/// 4,096 rows for a step's 32,768 tokens, so a bias of 768 gets 768
/// blocks where one pass had 96, each thread walking 32 rows).
#[test]
fn column_chunks_read_columns_side_by_side() {
    let src = emit_cuda(&dplc_codegen::column_chunk_kernel(), DType::BF16);
    assert_eq!(
        src.launch,
        dplc_codegen::LaunchShape::Columns { block: 1024 }
    );
    assert_eq!(dplc_codegen::column_chunks(32768), Some(8));
    assert_eq!(dplc_codegen::column_chunks(4096), None);
    assert_eq!(dplc_codegen::column_chunks(4097), Some(2));
}

#[test]
fn names_are_stable_and_distinct_per_dtype() {
    let k = adamw_kernel();
    let a = emit_cuda(&k, DType::F32).name;
    assert_eq!(a, emit_cuda(&k, DType::F32).name);
    assert_ne!(a, emit_cuda(&k, DType::BF16).name);
    assert!(
        a.starts_with("adamw_f32_") && a.len() == "adamw_f32_".len() + 8,
        "{a}"
    );
}

/// gpt2's loss: 50,257 logits a row, no multiple of a 16-byte vector, so
/// each row starts misaligned its own way. Forward and backward walk each
/// row's unaligned head and its tail an element at a time and the rest in
/// vectors (`dplc_head`, `dplc_vectors`, `dplc_tail`); the values are
/// checked on the CPU by `host_cuda.rs` (a vocabulary of 4,099).
#[test]
fn gpt2_loss_rows_walk_in_vectors_after_their_head() {
    let mut out = String::new();
    for k in root_kernels(&zoo("gpt2.dpl", "gpt2").graph) {
        if k.op.starts_with("log_softmax") {
            let src = emit_cuda(&k, DType::BF16);
            assert!(
                src.source.contains("dplc_head") && src.source.contains("uint4"),
                "{} does not walk in vectors",
                src.name
            );
            let kernel = src
                .source
                .split("extern \"C\"")
                .nth(1)
                .expect("a kernel after the prelude");
            out += &format!(
                "==== {} ({:?})\nextern \"C\"{kernel}\n",
                src.name, src.launch
            );
        }
    }
    assert_eq!(out.matches("====").count(), 2, "a forward and a backward");
    insta::assert_snapshot!(out);
}

/// At Llama's head width of 128 the tensor-core forward's key tiles take
/// 64 keys, double-buffered K and V rows padded by 8: 2 · 2 · 64 · 136 · 2
/// = 69,632 bytes of dynamic shared memory, past the static 48 KB that held
/// 32 keys, and it asks for registers that let three such blocks share a
/// Hopper multiprocessor (227 KB); at GPT-2's width of 64, four (at most
/// four); at Gemma's 256, two (its register arrays). The backward passes,
/// bounded by their registers, keep 32 keys (or queries) a tile within 48 KB
/// and the assembler's registers; at 128 the dK/dV pass also stages its
/// block's 64 rows of K and V (2 · 64 · 136 · 2 = 34,816 bytes) and reads
/// their fragments from there, where at 64 they fit in registers and at 256
/// the two would pass 96 KB. The one-pass backward's pass by key tiles
/// always stages them, beside its `t × 72` tile of score gradients: at 128
/// 35,072 + 34,816 + 4,608 bytes, at 64 37,376 + 18,432 + 9,216; at 256 it
/// would pass 96 KB, so that width keeps two passes.
#[test]
fn wide_heads_take_their_forward_key_tiles_past_48_kb() {
    let attention = |width: usize| {
        let model = common::PLACED
            .replace("seq, 8]", &format!("seq, {width}]"))
            .replace("seq, 16]", &format!("seq, {width}]"));
        common::first_attention(&common::lower_m(&model))
    };
    let sizes = |width: usize| -> Vec<(u32, String)> {
        let at = attention(width);
        [
            AttentionPass::Forward,
            AttentionPass::QueryGrad,
            AttentionPass::KeyValueGrad,
        ]
        .into_iter()
        .map(|pass| {
            let src = emit_attention(&at.kernel, pass, DType::BF16);
            let bounds = src.source.find("__launch_bounds__(").expect("bounds");
            let end = bounds + src.source[bounds..].find(')').expect("closed");
            (src.shared_bytes, src.source[bounds + 18..end].to_string())
        })
        .collect()
    };
    let expect = |v: [(u32, &str); 3]| v.map(|(b, s)| (b, s.to_string())).to_vec();
    let one_pass = |width: usize| -> Option<u32> {
        let at = attention(width);
        (dplc_codegen::attention_backward(&at.kernel, DType::BF16)
            == dplc_codegen::AttentionBackward::OnePass)
            .then(|| emit_attention(&at.kernel, AttentionPass::Grads, DType::BF16).shared_bytes)
    };
    assert_eq!(one_pass(128), Some(74_496));
    assert_eq!(one_pass(64), Some(65_024));
    assert_eq!(one_pass(256), None);
    assert_eq!(
        sizes(128),
        expect([(69_632, "128, 3"), (34_816, "128"), (69_888, "128")])
    );
    assert_eq!(
        sizes(64),
        expect([(36_864, "128, 4"), (36_864, "128"), (37_376, "128")])
    );
    // Gemma's 256: the arrays (Q's fragments, O's accumulators) bound the
    // forward to two blocks, so the assembler keeps all its registers.
    assert_eq!(
        sizes(256),
        expect([(67_584, "128, 2"), (33_792, "128"), (33_920, "128")])
    );
}

/// How many blocks each launch shape takes, the one rule the GPU device
/// and the benchmarks read: a wider attention block (`Tiles`) takes as many
/// of the launch's items as it covers, so Llama 2 7B's forward at 4,096
/// 64-query items is 2,048 blocks of eight warps; elementwise launches stop
/// at 32 blocks a multiprocessor and stride; the others stop at 65,536.
#[test]
fn launch_shapes_take_their_blocks() {
    use dplc_codegen::LaunchShape::*;
    for (shape, outer, sms, want) in [
        (Rows { block: 128 }, 4096, 132, (4096, 128)),
        (
            Tiles {
                block: 256,
                items: 2,
            },
            4096,
            132,
            (2048, 256),
        ),
        (
            Tiles {
                block: 256,
                items: 2,
            },
            4095,
            132,
            (2048, 256),
        ),
        (
            Tiles {
                block: 256,
                items: 2,
            },
            0,
            132,
            (1, 256),
        ),
        (Elementwise { vector: 4 }, 1 << 20, 132, (1024, 256)),
        (Elementwise { vector: 1 }, 1 << 30, 132, (4224, 256)),
        (WarpRows { block: 256 }, 32768, 132, (4096, 256)),
        (Columns { block: 1024 }, 768, 132, (96, 1024)),
        (Rows { block: 256 }, 1 << 20, 132, (65536, 256)),
        (Rows { block: 256 }, 1 << 22, 4096, (131072, 256)),
    ] {
        assert_eq!(shape.grid(outer, sms), want, "{shape:?} over {outer}");
    }
}
