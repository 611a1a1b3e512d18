//! Fusion of the zoo's layers: the plan printout (golden), and every fused
//! kernel run by the CPU interpreter against the unfused reference evaluator.

mod common;

use common::{data_of, evaluate, plan_text, zoo};
use dplc_codegen::{fuse, interpret, Args, Data, Step};
use dplc_ir::Graph;
use std::collections::HashMap;

fn plans(g: &Graph) -> String {
    g.regions()
        .map(|(r, _)| plan_text(g, &fuse(g, r)))
        .collect::<Vec<_>>()
        .join("\n")
}

#[test]
fn gpt_tiny_plan() {
    insta::assert_snapshot!(plans(&zoo("tiny.dpl", "gpt_tiny").graph));
}

#[test]
fn llama_tiny_plan() {
    insta::assert_snapshot!(plans(&zoo("tiny.dpl", "llama_tiny").graph));
}

/// Run every kernel of every region on reference inputs and compare each
/// output with the unfused evaluation; returns how many kernels ran.
fn check_against_reference(g: &Graph, syms: &HashMap<String, i64>) -> usize {
    let mut checked = 0;
    for (r, _) in g.regions() {
        let env = evaluate(g, r, syms, 7 + r.index() as u64);
        let plan = fuse(g, r);
        for step in &plan.steps {
            let Step::Kernel(k) = step else { continue };
            let sizes = k
                .sizes
                .iter()
                .map(|d| common::dim(d, syms, g) as i64)
                .collect();
            let args = Args {
                sizes,
                scalars: vec![],
                seed: 1,
            };
            let mut bufs: Vec<Data> = k
                .buffers
                .iter()
                .zip(&k.kernel.buffers)
                .map(|(&t, b)| {
                    if b.output {
                        Data::F32(vec![])
                    } else {
                        data_of(g, t, &env[&t])
                    }
                })
                .collect();
            interpret(&k.kernel, &args, &mut bufs)
                .unwrap_or_else(|e| panic!("{e}\n{}", k.kernel.text()));
            for ((&t, b), got) in k.buffers.iter().zip(&k.kernel.buffers).zip(&bufs) {
                if !b.output {
                    continue;
                }
                let want = &env[&t].data;
                let got = got.f32();
                assert_eq!(got.len(), want.len(), "{t} of\n{}", k.kernel.text());
                for (i, (x, y)) in got.iter().zip(want).enumerate() {
                    let ok = (x - y).abs() <= 1e-4 * (1.0 + y.abs()) || (x.is_infinite() && x == y);
                    assert!(
                        ok,
                        "{t}[{i}]: fused {x}, reference {y}\n{}",
                        k.kernel.text()
                    );
                }
            }
            checked += 1;
        }
    }
    checked
}

fn syms(pairs: &[(&str, i64)]) -> HashMap<String, i64> {
    pairs.iter().map(|(k, v)| (k.to_string(), *v)).collect()
}

#[test]
fn gpt_tiny_kernels_match_reference() {
    let g = zoo("tiny.dpl", "gpt_tiny").graph;
    let n = check_against_reference(&g, &syms(&[("batch", 2), ("seq", 5)]));
    assert!(n >= 8, "{n} kernels");
}

#[test]
fn llama_tiny_kernels_match_reference() {
    let g = zoo("tiny.dpl", "llama_tiny").graph;
    let n = check_against_reference(&g, &syms(&[("batch", 2), ("seq", 6)]));
    assert!(n >= 8, "{n} kernels");
}

/// Shifts and pads fused into the kernels that read them.
#[test]
fn shift_and_pad_kernels_match_reference() {
    let g = common::lower_m(common::SHIFTS);
    let n = check_against_reference(&g, &syms(&[("batch", 2), ("seq", 5)]));
    assert!(n >= 1, "{n} kernels");
}

/// Running sums as scan kernels (forward and reverse, along the last and a
/// middle axis), none left to the host.
#[test]
fn running_sums_are_scan_kernels_that_match_reference() {
    let g = common::lower_m(common::SCANS);
    let plan = fuse(&g, g.root());
    let scans = plan
        .steps
        .iter()
        .filter(|s| match s {
            Step::Kernel(k) => k.kernel.scan_direction().ok().flatten().is_some(),
            _ => false,
        })
        .count();
    assert_eq!(scans, 4, "{}", plan_text(&g, &plan));
    assert!(
        !plan.steps.iter().any(|s| matches!(s, Step::Extern { .. })),
        "{}",
        plan_text(&g, &plan)
    );
    // Rows longer than one tile of the GPU's block, too.
    for seq in [5, 300] {
        let n = check_against_reference(&g, &syms(&[("batch", 2), ("seq", seq)]));
        assert!(n >= 4, "{n} kernels");
    }
}

/// The zoo's T5: relative position buckets, the shifted decoder ids, cross-attention.
#[test]
fn t5_tiny_kernels_match_reference() {
    let g = common::t5_tiny_without_dropout();
    let n = check_against_reference(&g, &syms(&[("batch", 2), ("seq", 5)]));
    assert!(n >= 8, "{n} kernels");
}

/// Every attention of every zoo model is one fused step: causal, windowed
/// (Mistral), with a position bias and cross-attention (T5), grouped- and
/// multi-query (Llama 3, Gemma), latent (DeepSeek), and so is every tiny
/// model's as a rank of cp 2 (its queries the rank's chunks, its causal
/// mask and window built whole and sliced to them); none is left to the
/// unfused path.
#[test]
fn every_zoo_attention_is_one_fused_step() {
    let mut programs = Vec::new();
    for (model, lowered) in common::all_zoo() {
        if model.ends_with("_tiny") {
            if let Ok(rank) = dplc_ir::split_context(&lowered.graph, 2) {
                programs.push((format!("{model} cp 2"), rank));
            }
        }
        programs.push((model, lowered.graph));
    }
    // Mistral's window under cp: the rank's slice of the whole window term.
    assert!(programs.iter().any(|(m, _)| m == "mistral_tiny cp 2"));
    for (model, g) in &programs {
        let mut fused = 0;
        for (r, _) in g.regions() {
            let plan = fuse(g, r);
            assert!(
                plan.unfused_attention.is_empty(),
                "{model}: {:?}",
                plan.unfused_attention
            );
            fused += plan
                .steps
                .iter()
                .filter(|s| matches!(s, Step::Attention(_)))
                .count();
        }
        assert!(fused >= 1, "{model}: no fused attention");
    }
}

/// An attention the kernel cannot take (a soft-capped score, a probability
/// read twice) stays on the unfused path, and the plan says why.
#[test]
fn attention_the_kernel_cannot_take_stays_unfused_with_its_reason() {
    let g = common::lower_m(
        "model m() {\n  input q: f32[batch, 2, seq, 4]\n  input k: f32[batch, 2, seq, 4]\n  \
         input v: f32[batch, 2, seq, 4]\n  a = softmax(tanh(q @ transpose(k, 2, 3)), -1) @ v\n  \
         p = softmax(q @ transpose(v, 2, 3), -1)\n  b = p @ k + p @ v\n  \
         return mean(mean(mean(mean(a + b, -1), -1), -1), -1)\n}\n",
    );
    let plan = fuse(&g, g.root());
    let text = plan_text(&g, &plan);
    assert!(
        !plan.steps.iter().any(|s| matches!(s, Step::Attention(_))),
        "{text}"
    );
    let reasons: Vec<&str> = plan
        .unfused_attention
        .iter()
        .map(|(_, r)| r.as_str())
        .collect();
    assert_eq!(reasons.len(), 2, "{text}");
    assert!(reasons[0].contains("`tanh`"), "{text}");
    assert!(reasons[1].contains("several readers"), "{text}");
    assert!(
        text.contains("runs unfused: the scores feed `tanh`"),
        "{text}"
    );
}
