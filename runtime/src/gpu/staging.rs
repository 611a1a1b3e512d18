//! How a large 16-bit matmul with a dimension that is no multiple of 8 runs
//! on cuBLAS's fast kernels: as a plan of 2-D copies into aligned, zeroed
//! scratch and GEMM calls whose every dimension is a multiple of 8 (but
//! the last block's rows), pure data so that a CPU test can run it.
//!
//! Why (bench/RESULTS.md, "The third H200 session"): gpt2's vocabulary of
//! 50,257 made its three vocabulary matmuls run at 95–152 TFLOP/s on an
//! H200 against 535–727 for its aligned ones. Aligning the rows alone
//! (leading dimensions) helped only where no dimension stayed odd — the
//! embedding gradient, `dLogitsᵀ · X`, blocked along the vocabulary, 16.7 →
//! 7.6 ms — and made the logits and their input gradient, whose blocks kept
//! 50,257 as `n` or `k`, 13–31% slower. So `n` and `k` are padded with
//! zeros here (zero rows of B and columns of A add nothing to C; C's pad
//! columns are dropped when its block is copied out), and `m` is cut into
//! blocks of whole 64-row multiples.

use crate::fused::MatMul;

/// Elements a dimension and a row must be a multiple of (16 bytes of
/// 16-bit elements).
pub const ALIGN: usize = 8;

/// `x` rounded up to [`ALIGN`].
pub fn aligned(x: usize) -> usize {
    x.div_ceil(ALIGN) * ALIGN
}

/// Multiply-adds below which a matmul runs as one call (the copies and
/// extra calls would cost more than the unaligned kernels lose).
pub const STAGE_ABOVE: usize = 1 << 30;

/// The most scratch a staged matmul's blocks hold (A's and C's): with
/// B's padded copy, what the device allocator's peak may grow by.
pub const SCRATCH_BYTES: usize = 64 << 20;

/// The largest B a staged matmul copies whole (gpt2's 50,257 × 768
/// embedding is 77 MB); a larger one runs as one call.
pub const B_COPY_BYTES: usize = 256 << 20;

/// A buffer a staged matmul's steps name: the call's three, or scratch
/// (zeroed when allocated).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Buf {
    A,
    B,
    C,
    ScratchA,
    ScratchB,
    ScratchC,
}

/// Where a matrix starts in a buffer and its leading dimension, in elements.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct At {
    pub buf: Buf,
    pub offset: usize,
    pub ld: usize,
}

/// One step of a staged matmul.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Step {
    /// `height` rows of `width` elements from `src` to `dst`.
    Copy {
        src: At,
        dst: At,
        width: usize,
        height: usize,
    },
    /// `C = op(A)·op(B)` for `m × n × k`, with the matmul's transpositions.
    Gemm {
        m: usize,
        n: usize,
        k: usize,
        a: At,
        b: At,
        c: At,
    },
}

/// A staged matmul: the elements of its scratch buffers (A's, B's, C's; 0
/// where it needs none) and its steps, in order.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Staged {
    pub scratch: [usize; 3],
    pub steps: Vec<Step>,
}

/// The staged form of `mm` with at most `scratch_bytes` for its blocks, or
/// `None` where it runs as one call: every dimension aligned, 32-bit
/// storage (cuBLAS pads those itself), batched, fewer than `min_madds`
/// multiply-adds, or a B too large to copy.
pub fn staging(mm: &MatMul, min_madds: usize, scratch_bytes: usize) -> Option<Staged> {
    let w = mm.dtype.size_bytes() as usize;
    let (m, n, k) = (mm.m, mm.n, mm.k);
    let odd = |x: usize| !x.is_multiple_of(ALIGN);
    if w != 2 || mm.batch != 1 || !(odd(m) || odd(n) || odd(k)) || m * n * k < min_madds {
        return None;
    }
    let (np, kp) = (aligned(n), aligned(k));
    let (at, bt) = (mm.a_transposed, mm.b_transposed);
    // B holds n and k: padded, it is copied whole once.
    let stage_b = odd(n) || odd(k);
    // A holds k, and its rows are m long when it is stored transposed.
    let stage_a = odd(k) || (at && odd(m));
    // C's rows are n long.
    let stage_c = odd(n);
    let b_elems = if stage_b { np * kp } else { 0 };
    if b_elems * w > B_COPY_BYTES {
        return None;
    }
    let per_row = if stage_a { kp } else { 0 } + if stage_c { np } else { 0 };
    let rows = if per_row == 0 {
        // Only m is odd: its whole 64-row multiples in one call, the rest in another.
        m / 64 * 64
    } else {
        scratch_bytes / (per_row * w) / 64 * 64
    };
    if rows == 0 {
        return None;
    }
    // Whole 64-row multiples of m in every block but the last.
    let rows = if m >= 64 { rows.min(m / 64 * 64) } else { m };
    let a_ld = if at { aligned(rows) } else { kp };
    let scratch = [
        if stage_a {
            a_ld * if at { kp } else { rows }
        } else {
            0
        },
        b_elems,
        if stage_c { rows * np } else { 0 },
    ];
    let mut steps = Vec::new();
    let whole = |buf, ld| At { buf, offset: 0, ld };
    let b = if stage_b {
        let (src, dst) = if bt {
            (whole(Buf::B, k), whole(Buf::ScratchB, kp))
        } else {
            (whole(Buf::B, n), whole(Buf::ScratchB, np))
        };
        let (width, height) = if bt { (k, n) } else { (n, k) };
        steps.push(Step::Copy {
            src,
            dst,
            width,
            height,
        });
        dst
    } else {
        whole(Buf::B, if bt { k } else { n })
    };
    for m0 in (0..m).step_by(rows) {
        let r = rows.min(m - m0);
        // op(A)'s rows [m0, m0 + r): columns of a stored k × m, rows of an m × k.
        let a_block = if at {
            At {
                buf: Buf::A,
                offset: m0,
                ld: m,
            }
        } else {
            At {
                buf: Buf::A,
                offset: m0 * k,
                ld: k,
            }
        };
        let a = if stage_a {
            let dst = whole(Buf::ScratchA, a_ld);
            let (width, height) = if at { (r, k) } else { (k, r) };
            steps.push(Step::Copy {
                src: a_block,
                dst,
                width,
                height,
            });
            dst
        } else {
            a_block
        };
        let c_block = At {
            buf: Buf::C,
            offset: m0 * n,
            ld: n,
        };
        let c = if stage_c {
            whole(Buf::ScratchC, np)
        } else {
            c_block
        };
        steps.push(Step::Gemm {
            m: r,
            n: np,
            k: kp,
            a,
            b,
            c,
        });
        if stage_c {
            steps.push(Step::Copy {
                src: c,
                dst: c_block,
                width: n,
                height: r,
            });
        }
    }
    Some(Staged { scratch, steps })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fused::matmul_cpu;
    use dplc_ir::DType;

    fn mm(m: usize, n: usize, k: usize, a_transposed: bool, b_transposed: bool) -> MatMul {
        MatMul {
            m,
            n,
            k,
            batch: 1,
            a_transposed,
            b_transposed,
            a_batched: false,
            b_batched: false,
            dtype: DType::BF16,
        }
    }

    /// Run a staged matmul's steps on host buffers, as the GPU runs them:
    /// scratch zeroed, C unwritten (NaN) until a step writes it, every
    /// access bounds-checked by the vectors.
    fn run(mm: &MatMul, plan: &Staged, a: &[f32], b: &[f32]) -> Vec<f32> {
        let mut bufs: Vec<Vec<f32>> = vec![
            a.to_vec(),
            b.to_vec(),
            vec![f32::NAN; mm.m * mm.n],
            vec![0.0; plan.scratch[0]],
            vec![0.0; plan.scratch[1]],
            vec![0.0; plan.scratch[2]],
        ];
        let ix = |b: Buf| b as usize;
        let last_gemm = plan
            .steps
            .iter()
            .rposition(|s| matches!(s, Step::Gemm { .. }));
        for (at, step) in plan.steps.iter().enumerate() {
            match *step {
                Step::Copy {
                    src,
                    dst,
                    width,
                    height,
                } => {
                    assert!(width <= src.ld && width <= dst.ld, "{step:?}");
                    for r in 0..height {
                        for x in 0..width {
                            let v = bufs[ix(src.buf)][src.offset + r * src.ld + x];
                            bufs[ix(dst.buf)][dst.offset + r * dst.ld + x] = v;
                        }
                    }
                }
                Step::Gemm { m, n, k, a, b, c } => {
                    assert!(m % ALIGN == 0 || Some(at) == last_gemm, "{step:?}");
                    assert!(n % ALIGN == 0 && k % ALIGN == 0, "{step:?}");
                    for ld in [a.ld, b.ld, c.ld] {
                        assert_eq!(ld % ALIGN, 0, "an unaligned row in {step:?}");
                    }
                    let mut out = vec![0.0f32; m * n];
                    for i in 0..m {
                        for j in 0..n {
                            let mut acc = 0.0f64;
                            for p in 0..k {
                                let x = if mm.a_transposed {
                                    bufs[ix(a.buf)][a.offset + p * a.ld + i]
                                } else {
                                    bufs[ix(a.buf)][a.offset + i * a.ld + p]
                                };
                                let y = if mm.b_transposed {
                                    bufs[ix(b.buf)][b.offset + j * b.ld + p]
                                } else {
                                    bufs[ix(b.buf)][b.offset + p * b.ld + j]
                                };
                                acc += f64::from(x) * f64::from(y);
                            }
                            out[i * n + j] = acc as f32;
                        }
                    }
                    for i in 0..m {
                        for j in 0..n {
                            bufs[ix(c.buf)][c.offset + i * c.ld + j] = out[i * n + j];
                        }
                    }
                }
            }
        }
        bufs.swap_remove(2)
    }

    /// Every odd dimension, every transposition, blocks ragged or whole:
    /// the staged steps compute the matmul, every GEMM they call has
    /// aligned dimensions and rows, and the scratch stays in budget.
    #[test]
    fn staged_steps_compute_the_matmul_on_aligned_gemms() {
        let mut seed = 7u64;
        let mut next = move || {
            seed = seed
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((seed >> 33) as f32 / (1u64 << 31) as f32) - 0.5
        };
        let mut staged = 0;
        for (m, n, k) in [
            (203, 77, 45),
            (203, 80, 45),
            (203, 77, 48),
            (203, 80, 48),
            (130, 13, 21),
        ] {
            for (at, bt) in [(false, false), (false, true), (true, false), (true, true)] {
                for budget in [64 * 2 * (aligned(k) + aligned(n)), 1 << 20] {
                    let x = mm(m, n, k, at, bt);
                    let Some(plan) = staging(&x, 0, budget) else {
                        continue;
                    };
                    staged += 1;
                    assert!((plan.scratch[0] + plan.scratch[2]) * 2 <= budget, "{x:?}");
                    let a: Vec<f32> = (0..m * k).map(|_| next()).collect();
                    let b: Vec<f32> = (0..k * n).map(|_| next()).collect();
                    let got = run(&x, &plan, &a, &b);
                    let want = matmul_cpu(&x, &a, &b);
                    for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                        assert!(
                            (g - w).abs() <= 1e-4 * (1.0 + w.abs()),
                            "{x:?} budget {budget}: C[{i}] {g} vs {w}"
                        );
                    }
                }
            }
        }
        assert!(staged >= 30, "{staged} staged cases");
    }

    /// gpt2's three vocabulary matmuls at 32 × 1024 tokens stage within
    /// the budgets; aligned, small, 32-bit and batched matmuls, and a B
    /// too large to copy, run as one call.
    #[test]
    fn gpt2s_vocabulary_matmuls_are_staged_within_budget() {
        let plan = |x: &MatMul| staging(x, STAGE_ABOVE, SCRATCH_BYTES);
        for x in [
            mm(32768, 50257, 768, false, true),
            mm(32768, 768, 50257, false, false),
            mm(50257, 768, 32768, true, false),
        ] {
            let p = plan(&x).unwrap_or_else(|| panic!("{x:?} staged"));
            assert!((p.scratch[0] + p.scratch[2]) * 2 <= SCRATCH_BYTES, "{x:?}");
            assert!(p.scratch[1] * 2 <= B_COPY_BYTES, "{x:?}");
            let gemms = p
                .steps
                .iter()
                .filter(|s| matches!(s, Step::Gemm { .. }))
                .count();
            assert!((2..=200).contains(&gemms), "{x:?}: {gemms} GEMMs");
        }
        assert_eq!(plan(&mm(32768, 768, 3072, false, true)), None);
        assert_eq!(plan(&mm(8, 50257, 768, false, true)), None);
        assert_eq!(plan(&mm(32768, 50257, 8192, false, true)), None);
        let mut f32_logits = mm(32768, 50257, 768, false, true);
        f32_logits.dtype = DType::F32;
        assert_eq!(plan(&f32_logits), None);
        let mut batched = mm(32768, 50257, 768, false, true);
        batched.batch = 2;
        assert_eq!(plan(&batched), None);
    }
}
