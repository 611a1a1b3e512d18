//! Fused backward kernels: for every forward kernel of the tiny zoo models,
//! the backward kernel (run by the CPU interpreter, with its column sums)
//! equals the directional derivative of the fused forward kernel — which
//! `fusion.rs` checks against the unfused reference — on random inputs.
//! Plus golden CUDA of gpt_tiny's backward kernels.

mod common;

use common::{data_of, evaluate, zoo, Rng};
use dplc_codegen::{
    backward, backward_keeping_row_stats, backward_plan, emit_cuda, fuse, interpret, Args,
    BackwardStep, Data, FusedKernel, GradBinding, Kernel, Step,
};
use dplc_ir::{DType, Graph};
use std::collections::HashMap;

fn run(k: &Kernel, args: &Args, mut bufs: Vec<Data>) -> Vec<Data> {
    interpret(k, args, &mut bufs).unwrap_or_else(|e| panic!("{e}\n{}", k.text()));
    bufs
}

/// `Σ_o <g_o, f_o(inputs)>` in f64, over finite outputs.
fn loss(k: &Kernel, args: &Args, inputs: &[Data], grads: &HashMap<usize, Vec<f32>>) -> f64 {
    let out = run(k, args, inputs.to_vec());
    let mut l = 0.0;
    for (b, g) in grads {
        for (y, g) in out[*b].f32().iter().zip(g) {
            if y.is_finite() {
                l += f64::from(*y) * f64::from(*g);
            }
        }
    }
    l
}

/// Check the backward of one fused kernel, and the backward reading the row
/// statistics the kernel keeps when it would keep them; returns false when
/// it has none.
fn check_kernel(
    g: &Graph,
    k: &FusedKernel,
    env: Option<&HashMap<dplc_ir::TensorId, common::T>>,
    args: &Args,
    rng: &mut Rng,
) -> bool {
    let fwd = &k.kernel;
    let needs: Vec<bool> = fwd
        .buffers
        .iter()
        .map(|b| !b.output && b.elem != dplc_codegen::Elem::I32)
        .collect();
    let bwd = match backward(fwd, &needs) {
        Ok(b) => b,
        Err(reason) => {
            eprintln!("no backward for {}: {reason}", fwd.op);
            return false;
        }
    };
    let mut inputs: Vec<Data> = match env {
        Some(env) => k
            .buffers
            .iter()
            .zip(&fwd.buffers)
            .map(|(&t, b)| {
                if b.output {
                    Data::F32(vec![])
                } else {
                    data_of(g, t, &env[&t])
                }
            })
            .collect(),
        // Random inputs, indices among the first four rows.
        None => fwd
            .buffers
            .iter()
            .enumerate()
            .map(|(i, b)| {
                let n = args.buffer_len(fwd, i);
                match (b.output, b.elem) {
                    (true, _) => Data::F32(vec![]),
                    (false, dplc_codegen::Elem::I32) => {
                        Data::I32((0..n).map(|_| (rng.next() % 4) as i32).collect())
                    }
                    (false, _) => Data::F32((0..n).map(|_| rng.normal_ish()).collect()),
                }
            })
            .collect(),
    };
    check_backward(fwd, &bwd, None, args, &inputs, rng);
    match backward_keeping_row_stats(fwd, &needs) {
        Ok((bwd, Some(kept))) => {
            inputs.push(Data::F32(vec![]));
            check_backward(&kept, &bwd, Some(fwd.buffers.len()), args, &inputs, rng);
        }
        Ok((_, None)) => {}
        Err(reason) => panic!("{}: {reason}", fwd.op),
    }
    true
}

/// Check `bwd` against the directional derivative of `fwd` on `inputs`;
/// `stats` is the forward buffer of the row statistics (not differentiated).
fn check_backward(
    fwd: &Kernel,
    bwd: &dplc_codegen::Backward,
    stats: Option<usize>,
    args: &Args,
    inputs: &[Data],
    rng: &mut Rng,
) {
    let inputs = inputs.to_vec();
    let fwd_out = run(fwd, args, inputs.clone());
    let out_grads: HashMap<usize, Vec<f32>> = fwd
        .buffers
        .iter()
        .enumerate()
        .filter(|&(i, b)| b.output && Some(i) != stats)
        .map(|(i, _)| (i, (0..fwd_out[i].len()).map(|_| rng.normal_ish()).collect()))
        .collect();
    let bufs: Vec<Data> = bwd
        .bindings
        .iter()
        .map(|b| match *b {
            GradBinding::Forward(i) if fwd.buffers[i].output => fwd_out[i].clone(),
            GradBinding::Forward(i) => inputs[i].clone(),
            GradBinding::OutputGrad(i) => Data::F32(out_grads[&i].clone()),
            GradBinding::RowStats => fwd_out[stats.expect("the forward keeps statistics")].clone(),
            _ => Data::F32(vec![]),
        })
        .collect();
    let got = run(&bwd.kernel, args, bufs);
    let mut grads: HashMap<usize, Vec<f32>> = HashMap::new();
    for (b, data) in bwd.bindings.iter().zip(&got) {
        match *b {
            GradBinding::InputGrad(i) | GradBinding::InputGradAccumulate(i) => {
                grads.insert(i, data.f32().to_vec());
            }
            GradBinding::Partial(i) => {
                let cs = bwd
                    .column_sums
                    .iter()
                    .find(|c| c.input == i)
                    .expect("a column sum");
                let cargs = Args {
                    sizes: cs.sizes(&args.sizes),
                    scalars: vec![],
                    seed: 0,
                };
                let out = run(&cs.kernel, &cargs, vec![data.clone(), Data::F32(vec![])]);
                grads.insert(i, out[1].f32().to_vec());
            }
            _ => {}
        }
    }
    for (i, grad) in &grads {
        assert_eq!(
            grad.len(),
            inputs[*i].len(),
            "gradient length of b{i} of\n{}",
            fwd.text()
        );
        for _ in 0..2 {
            let v: Vec<f32> = (0..grad.len()).map(|_| rng.normal_ish()).collect();
            let h = 1e-2f32;
            let shifted = |s: f32| {
                let mut x = inputs.clone();
                if let Data::F32(d) = &mut x[*i] {
                    for (a, dv) in d.iter_mut().zip(&v) {
                        *a += s * dv;
                    }
                }
                loss(fwd, args, &x, &out_grads)
            };
            let fd = (shifted(h) - shifted(-h)) / (2.0 * f64::from(h));
            let an: f64 = grad
                .iter()
                .zip(&v)
                .map(|(a, b)| f64::from(*a) * f64::from(*b))
                .sum();
            let scale = grad
                .iter()
                .map(|a| f64::from(*a).powi(2))
                .sum::<f64>()
                .sqrt()
                * v.iter().map(|a| f64::from(*a).powi(2)).sum::<f64>().sqrt();
            assert!(
                (fd - an).abs() <= 1e-2 * scale + 1e-3,
                "b{i} ({}): directional derivative {fd}, backward kernel {an} (scale {scale})\nforward:\n{}\nbackward:\n{}",
                fwd.buffers[*i].label,
                fwd.text(),
                bwd.kernel.text()
            );
        }
    }
}

fn check_model(model: &str, syms: &[(&str, i64)]) -> (usize, usize) {
    check_graph(&zoo("tiny.dpl", model).graph, syms)
}

fn check_graph(g: &Graph, syms: &[(&str, i64)]) -> (usize, usize) {
    let g = g.clone();
    let syms: HashMap<String, i64> = syms.iter().map(|(k, v)| (k.to_string(), *v)).collect();
    let mut rng = Rng(11);
    let (mut ok, mut total) = (0, 0);
    for (r, _) in g.regions() {
        let env = evaluate(&g, r, &syms, 7 + r.index() as u64);
        for step in fuse(&g, r).steps {
            let Step::Kernel(k) = step else { continue };
            let sizes = k
                .sizes
                .iter()
                .map(|d| common::dim(d, &syms, &g) as i64)
                .collect();
            let args = Args {
                sizes,
                scalars: vec![],
                seed: 1,
            };
            // Kernels of constants only (rotary tables) have nothing to differentiate.
            if k.kernel
                .buffers
                .iter()
                .all(|b| b.output || b.elem == dplc_codegen::Elem::I32)
            {
                continue;
            }
            total += 1;
            if check_kernel(&g, &k, Some(&env), &args, &mut rng) {
                ok += 1;
            }
        }
    }
    (ok, total)
}

#[test]
fn gpt_tiny_backward_kernels_match_derivatives() {
    let (ok, total) = check_model("gpt_tiny", &[("batch", 2), ("seq", 5)]);
    assert_eq!(ok, total, "every gpt_tiny kernel has a fused backward");
}

#[test]
fn llama_tiny_backward_kernels_match_derivatives() {
    let (ok, total) = check_model("llama_tiny", &[("batch", 2), ("seq", 6)]);
    assert_eq!(ok, total, "every llama_tiny kernel has a fused backward");
}

/// The backward plan of each region and the CUDA of gpt_tiny's backward kernels.
fn backward_cuda(model: &str, dtype: DType) -> String {
    let g = zoo("tiny.dpl", model).graph;
    let mut out = String::new();
    for (r, _) in g.regions() {
        let mut plan = fuse(&g, r);
        out += &format!("==== region {r}\n");
        for step in backward_plan(&g, &mut plan) {
            match step {
                BackwardStep::MatMul { step } => {
                    out += &format!("matmul backward of step {step}\n")
                }
                BackwardStep::Attention { step } => {
                    out += &format!("attention backward of step {step}\n")
                }
                BackwardStep::Extern { step, reason, .. } => {
                    out += &format!("extern backward of step {step}: {reason}\n")
                }
                BackwardStep::Kernel { step, backward } => {
                    let src = emit_cuda(&backward.kernel, dtype);
                    out += &format!(
                        "kernel backward of step {step}: {} {:?}\n",
                        src.name, backward.bindings
                    );
                    out += &src.source;
                    for cs in &backward.column_sums {
                        let src = emit_cuda(&cs.kernel, dtype);
                        out += &format!(
                            "column sum of b{} over {} leading axes: {}\n",
                            cs.input, cs.split, src.name
                        );
                    }
                }
            }
        }
    }
    out
}

#[test]
fn gpt_tiny_backward_cuda_bf16() {
    insta::assert_snapshot!(backward_cuda("gpt_tiny", DType::BF16));
}

/// Every kernel of every zoo model has a fused backward: the only backward
/// steps left to the runtime are those of steps it runs itself (`repeat`,
/// top-k, MoE routing).
#[test]
fn every_zoo_kernel_has_a_fused_backward() {
    let mut missing = Vec::new();
    let mut kernels = 0;
    for (name, lowered) in common::all_zoo() {
        let g = &lowered.graph;
        for (r, _) in g.regions() {
            let mut plan = fuse(g, r);
            for step in backward_plan(g, &mut plan) {
                match step {
                    BackwardStep::Kernel { .. } => kernels += 1,
                    BackwardStep::Extern { step, reason, .. } => {
                        if matches!(plan.steps[step], Step::Kernel(_)) {
                            missing.push(format!("{name}: step {step}: {reason}"));
                        }
                    }
                    BackwardStep::MatMul { .. } | BackwardStep::Attention { .. } => {}
                }
            }
        }
    }
    assert!(missing.is_empty(), "{}", missing.join("\n"));
    assert!(kernels > 100, "{kernels} backward kernels");
}

#[test]
fn moe_tiny_backward_kernels_match_derivatives() {
    let (ok, total) = check_model("moe_tiny", &[("batch", 2), ("seq", 4)]);
    assert_eq!(ok, total, "every moe_tiny kernel has a fused backward");
}

/// Dropout replays its mask in backward from the same counter-based random
/// numbers: gpt_tiny with dropout 0.1, on random inputs (the unfused reference
/// evaluator runs without dropout, so `evaluate` is not used here).
#[test]
fn dropout_backward_kernels_match_derivatives() {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../models/tiny.dpl");
    let text = std::fs::read_to_string(path).expect("the zoo is in the repository")
        + "\nmodel gpt_tiny_dropout = gpt_tiny(dropout = 0.1)\n";
    let unit = dplc_frontend::parse("models/tiny.dpl", &text)
        .unwrap_or_else(|d| panic!("{}", d.render_plain()));
    let g = unit
        .lower("gpt_tiny_dropout")
        .unwrap_or_else(|d| panic!("{}", d.render_plain()))
        .graph;
    let syms: HashMap<String, i64> = [("batch".to_string(), 2), ("seq".to_string(), 5)].into();
    let mut rng = Rng(17);
    let mut with_dropout = 0;
    for (r, _) in g.regions() {
        for step in fuse(&g, r).steps {
            let Step::Kernel(k) = step else { continue };
            if k.kernel
                .buffers
                .iter()
                .all(|b| b.output || b.elem == dplc_codegen::Elem::I32)
            {
                continue;
            }
            with_dropout += usize::from(k.kernel.uses_random());
            let sizes = k
                .sizes
                .iter()
                .map(|d| common::dim(d, &syms, &g) as i64)
                .collect();
            let args = Args {
                sizes,
                scalars: vec![],
                seed: 3,
            };
            assert!(
                check_kernel(&g, &k, None, &args, &mut rng),
                "{}",
                k.kernel.op
            );
        }
    }
    assert!(
        with_dropout >= 3,
        "{with_dropout} kernels draw random numbers"
    );
}

/// Running sums' backward kernels (the reverse scan of the gradient) match
/// their derivatives.
#[test]
fn scan_backward_kernels_match_derivatives() {
    let g = common::lower_m(common::SCANS);
    let (ok, total) = check_graph(&g, &[("batch", 2), ("seq", 5)]);
    assert!(total >= 4 && ok == total, "{ok} of {total}");
}

/// Shifts and pads (a select on the position in the forward kernel) have
/// fused backward kernels that match their derivatives. (T5's kernels are
/// not checked here: its position buckets take `min` of random inputs in
/// this check, whose kink a finite difference straddles; its backward is
/// checked by training it against the reference compute instead.)
#[test]
fn shift_pad_backward_kernels_match_derivatives() {
    let g = common::lower_m(common::SHIFTS);
    let (ok, total) = check_graph(&g, &[("batch", 2), ("seq", 5)]);
    assert!(total >= 1 && ok == total, "{ok} of {total}");
}
