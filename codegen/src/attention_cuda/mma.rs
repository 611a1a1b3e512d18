//! The tensor-core passes of the fused attention (bf16/f16 storage, head
//! and value widths of whole `m16n8k16` steps): the forward, `dQ` and
//! `dK`/`dV` (with `dQ`'s share, `one_pass`, the one-pass backward's pass
//! by key tiles), four warps of 16 rows a block, their block matmuls as
//! `mma.sync.m16n8k16` steps on fragments laid out as the PTX ISA states,
//! tiles staged in shared memory as raw 16-bit storage (`staging`).

use super::one_pass::{query_grad_share, score_grad_stride};
use super::staging::{Staged, Tile16};
use super::*;
use std::f64::consts::{LN_2, LOG2_E};

/// Registers of arrays a thread of the `dK`/`dV` pass may hold with K's and
/// V's A fragments in registers (K and V fragments, the dK, dV, Sᵀ and dPᵀ
/// accumulators); past it the fragments are read from shared memory at each
/// step by `ldmatrix`, as FlashAttention-2's backward keeps K and V. At head
/// width 64 (64-query tiles) the arrays hold 160 registers and ptxas uses
/// 239 with no spill; at 128 (32-query tiles) they hold 224 and ptxas used
/// all 255 and spilled 60 bytes.
const KEY_VALUE_REGISTER_ARRAYS: i64 = 192;

/// Warps of a tensor-core forward block as the executor launches it: 64
/// queries a block, [`super::ROWS`], the tile every pass's launch counts.
pub(super) const FORWARD_WARPS: i64 = 4;
/// Warps of a tensor-core `dK`/`dV` block as the executor launches it: 64
/// keys a block, [`super::ROWS`].
pub(super) const BACKWARD_WARPS: i64 = 4;

/// Whether the forward runs its block matmuls on tensor cores: 16-bit
/// storage, and widths that are whole `m16n8k16` steps.
pub(super) fn tensor_cores(k: &AttentionKernel, dtype: DType) -> bool {
    matches!(dtype, DType::BF16 | DType::F16)
        && k.head_dim % 16 == 0
        && k.value_dim % 8 == 0
        && k.head_dim <= 256
        && k.value_dim <= 256
}

/// Tensor-core helpers for 16-bit storage `ty` (`bf16` or `f16`): one
/// `m16n8k16` step with f32 accumulators, two floats packed into the
/// storage type's pair (the lower column in the low half), and sm_80's
/// `cp.async` for the tiles.
pub(super) fn mma_prelude(dtype: DType) -> String {
    let ty = if dtype == DType::BF16 { "bf16" } else { "f16" };
    MMA_PRELUDE.replace("{ty}", ty)
}

const MMA_PRELUDE: &str = r#"#ifndef DPLC_MMA
#define DPLC_MMA
__device__ __forceinline__ void dplc_mma(float* c, const unsigned* a, unsigned b0, unsigned b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.{ty}.{ty}.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
__device__ __forceinline__ unsigned dplc_pack(float lo, float hi) {
    unsigned r; asm("cvt.rn.{ty}x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo)); return r;
}
// Four 8×8 tiles of 16-bit elements from shared memory, each transposed
// (sm_75's ldmatrix): lane l gives the address of row l % 8 of tile l / 8,
// and register i of lane 4g + t holds tile i's rows 2t and 2t + 1 at
// column g, the lower row in the low half — an `m16n8k16` B fragment of a
// [k][n] tile in one instruction, where two 16-bit loads built each
// register.
__device__ __forceinline__ void dplc_ldsm_x4_t(unsigned* r, const void* row) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"((unsigned)__cvta_generic_to_shared(row)));
}
// The same, untransposed: register i of lane 4g + t holds tile i's row g
// at columns 2t and 2t + 1 — the B fragments of `A·Bᵀ` for a [n][k] tile.
__device__ __forceinline__ void dplc_ldsm_x4(unsigned* r, const void* row) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"((unsigned)__cvta_generic_to_shared(row)));
}
// A 16-byte copy global → shared that the copying thread waits for later
// (sm_80's cp.async): the next tile's fetch overlaps this tile's compute.
__device__ __forceinline__ void dplc_cp_async16(void* smem, const void* gmem) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;"
                 :: "r"((unsigned)__cvta_generic_to_shared(smem)), "l"(gmem) : "memory");
}
__device__ __forceinline__ void dplc_cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
__device__ __forceinline__ void dplc_cp_async_wait() { asm volatile("cp.async.wait_group 0;" ::: "memory"); }
#endif
"#;

/// Score `s`'s probability `p` (0 where query `qi` may not see key `kj`
/// or the row saw nothing: its log-sum-exp `lse2`, in base 2 as
/// [`lse_base2`] loads it, is −∞) and the dropout's factor `kp`, declared
/// as the backward passes recompute them.
/// In a tile whose every pair is seen (`open`), no test.
fn probability(c: &Ctx, s: C, lse2: C, b: &C, h: &C, open: bool) -> [S; 2] {
    let (qi, kj) = (id("qi"), id("kj"));
    let p = call(
        "dplc_exp2",
        vec![bin(
            "-",
            c.scaled_by(s, LOG2_E, b, h, &qi, &kj),
            lse2.clone(),
        )],
    );
    [
        decl(
            "float",
            "p",
            if open {
                p
            } else {
                C::Cond(
                    Box::new(bin("&&", c.visible(&qi, &kj), bin("!=", lse2, neg_inf()))),
                    Box::new(p),
                    Box::new(zero()),
                )
            },
        ),
        decl(
            "float",
            "kp",
            c.keep(b, h, &qi, &kj).unwrap_or(C::Lit("1.0f".into())),
        ),
    ]
}

/// Row `qi`'s log-sum-exp from the forward's buffer, in base 2 (what
/// [`probability`] subtracts from base-2 scores).
fn lse_base2(c: &Ctx, b: C, h: C, qi: C) -> C {
    bin(
        "*",
        at(c.buf(AttentionBuffer::LogSumExp), c.lse_at(b, h, qi)),
        f32_lit(LOG2_E),
    )
}

/// The first of the warp's 16 rows ([`warp_rows`]).
fn warp_first_row() -> C {
    bin("-", id("r0"), id("g"))
}

/// A tile's element-wise step, `make(open)`: where the tile can be tested
/// whole (`all_visible`), unmasked when every pair in it is seen — the
/// test uniform across the warp, so the branch does not diverge — else
/// masked element by element.
fn open_or_masked(all_visible: Option<C>, make: impl Fn(bool) -> S) -> Vec<S> {
    match all_visible {
        Some(open) => vec![
            decl("bool", "dplc_open", open),
            S::If(id("dplc_open"), vec![make(true)]),
            S::If(call("!", vec![id("dplc_open")]), vec![make(false)]),
        ],
        None => vec![make(false)],
    }
}

/// Two 16-bit elements as one register, the first in the low half.
fn pair_bits(lo: C, hi: C) -> C {
    bin(
        "|",
        C::Cast("unsigned", Box::new(lo)),
        bin("<<", C::Cast("unsigned", Box::new(hi)), C::Lit("16".into())),
    )
}

/// The tensor-core forward: 4 warps of 16 query rows; per key tile, `S =
/// Q·Kᵀ` and `O += P·V` as `m16n8k16` steps. A thread holds, of each 16×8
/// accumulator tile, rows `g` and `g + 8` at columns `2t` and `2t + 1`
/// (`g` = lane / 4, `t` = lane % 4), so the scores' tiles are the
/// probabilities' operand fragments as they are.
/// The tensor-core forward: a block of `warps` warps takes `16 · warps`
/// queries of one head, each warp 16 of them (four warps as launched:
/// [`FORWARD_WARPS`]; more share each staged key and value tile among more
/// queries, at a block's registers).
pub(super) fn forward_mma(c: &Ctx, warps: i64) -> Pass {
    use AttentionBuffer::*;
    let k = c.k;
    let block_rows = 16 * warps;
    let (hd, vd) = (k.head_dim, k.value_dim);
    // Key rows per tile: K and V tiles of 16-bit elements within the shared
    // memory, rows padded by 8 elements against bank conflicts: `O += P·V`
    // reads V down a column, two keys a register, and unpadded rows of 64
    // or 128 elements put the four key pairs a quad reads in one bank.
    let (kstride, vstride) = (hd + 8, vd + 8);
    let t = [64i64, 48, 32, 16]
        .into_iter()
        .find(|t| 2 * 2 * t * (kstride + vstride) <= MOST_SHARED_BYTES)
        .unwrap_or(16);
    let (ns, nv) = (t / 8, vd / 8);
    let (b, h) = (id("b"), id("hh"));
    let mut body = decompose(k.heads, k.q_len, "i0", block_rows);
    body.push(decl("long long", "kh", bin("/", h.clone(), ll(k.group))));
    body.extend(warp_rows("i0"));
    // Q's fragments, straight from memory (zeros past the last query).
    body.extend(row_fragments(c, Q, (h.clone(), k.q_len), "qf", hd));
    body.push(array("float", "o", nv * 4));
    body.push(unrolled("x", nv * 4, vec![set(ix("o", id("x")), zero())]));
    body.push(array("float", "m", 2));
    body.push(array("float", "l", 2));
    body.push(unrolled(
        "r",
        2,
        vec![
            set(ix("m", id("r")), neg_inf()),
            set(ix("l", id("r")), zero()),
        ],
    ));
    body.extend(c.key_range(t, block_rows));
    // The key tiles (raw 16-bit storage; zeros past the last key), each
    // fetched while the one before computes.
    let staged = key_value_tiles(k, kstride, vstride);
    let mut tile = vec![array("float", "s", ns * 4)];
    // S = Q·Kᵀ: B's fragment is two consecutive features of one key.
    tile.push(mma_rows("s", RowsA::Registers("qf"), "kt", kstride, hd, ns));
    // Scale, bias, masks; the rows' maxima over the quad of threads sharing them.
    let (i, j) = (
        ix("row", bin("/", id("x"), ll(2))),
        bin(
            "+",
            bin("+", id("j0"), bin("*", id("nb"), ll(8))),
            bin("+", bin("*", id("tq"), ll(2)), bin("%", id("x"), ll(2))),
        ),
    );
    let sx = ix("s", bin("+", bin("*", id("nb"), ll(4)), id("x")));
    let scores = |open: bool| {
        let scaled = c.scaled_by(sx.clone(), LOG2_E, &b, &h, &id("qi"), &id("kj"));
        unrolled(
            "nb",
            ns,
            vec![unrolled(
                "x",
                4,
                vec![
                    decl("long long", "qi", i.clone()),
                    decl("long long", "kj", j.clone()),
                    set(
                        sx.clone(),
                        if open {
                            scaled
                        } else {
                            C::Cond(
                                Box::new(c.visible(&id("qi"), &id("kj"))),
                                Box::new(scaled),
                                Box::new(neg_inf()),
                            )
                        },
                    ),
                ],
            )],
        )
    };
    tile.extend(open_or_masked(
        c.all_visible(&warp_first_row(), 16, &id("j0"), t),
        scores,
    ));
    let shfl = |v: C, o: i64| {
        call(
            "__shfl_xor_sync",
            vec![C::Lit("0xffffffffu".into()), v, C::Lit(o.to_string())],
        )
    };
    let mut rows = vec![var("float", "mx", Some(ix("m", id("r"))))];
    rows.push(unrolled(
        "nb",
        ns,
        vec![unrolled(
            "x",
            2,
            vec![set(
                id("mx"),
                call(
                    "fmaxf",
                    vec![
                        id("mx"),
                        ix(
                            "s",
                            bin(
                                "+",
                                bin("+", bin("*", id("nb"), ll(4)), bin("*", id("r"), ll(2))),
                                id("x"),
                            ),
                        ),
                    ],
                ),
            )],
        )],
    ));
    rows.push(set(
        id("mx"),
        call("fmaxf", vec![id("mx"), shfl(id("mx"), 1)]),
    ));
    rows.push(set(
        id("mx"),
        call("fmaxf", vec![id("mx"), shfl(id("mx"), 2)]),
    ));
    // A row with nothing seen yet keeps its state (and subtracts 0, not −∞).
    rows.push(decl(
        "float",
        "base",
        C::Cond(
            Box::new(bin("==", id("mx"), neg_inf())),
            Box::new(zero()),
            Box::new(id("mx")),
        ),
    ));
    rows.push(decl(
        "float",
        "alpha",
        call("dplc_exp2", vec![bin("-", ix("m", id("r")), id("base"))]),
    ));
    rows.push(set(ix("m", id("r")), id("mx")));
    rows.push(mul_by(ix("l", id("r")), id("alpha")));
    rows.push(unrolled(
        "nb",
        nv,
        vec![unrolled(
            "x",
            2,
            vec![mul_by(
                ix(
                    "o",
                    bin(
                        "+",
                        bin("+", bin("*", id("nb"), ll(4)), bin("*", id("r"), ll(2))),
                        id("x"),
                    ),
                ),
                id("alpha"),
            )],
        )],
    ));
    let sr = ix(
        "s",
        bin(
            "+",
            bin("+", bin("*", id("nb"), ll(4)), bin("*", id("r"), ll(2))),
            id("x"),
        ),
    );
    let mut prob = vec![
        decl(
            "float",
            "e",
            call("dplc_exp2", vec![bin("-", sr.clone(), id("base"))]),
        ),
        add_to(ix("l", id("r")), id("e")),
    ];
    // The thread's two neighbouring keys of the row draw as one pair.
    let qi = ix("row", id("r"));
    let kj = bin(
        "+",
        bin("+", id("j0"), bin("*", id("nb"), ll(8))),
        bin("*", id("tq"), ll(2)),
    );
    let pair = c.keep_pair(&b, &h, &qi, &kj, "kp", ll(0));
    prob.push(set(
        sr,
        if pair.is_empty() {
            id("e")
        } else {
            bin("*", id("e"), ix("kp", id("x")))
        },
    ));
    let mut per_nb = Vec::new();
    if !pair.is_empty() {
        per_nb.push(array("float", "kp", 2));
        per_nb.extend(pair);
    }
    per_nb.push(unrolled("x", 2, prob));
    rows.push(unrolled("nb", ns, per_nb));
    tile.push(unrolled("r", 2, rows));
    // O += P·V: P's fragment for keys [16·kk, 16·kk + 16) is score tiles 2kk and 2kk + 1.
    tile.push(mma_cols(
        "o",
        ColsA::Packed("s"),
        "vt",
        vstride,
        (t, vd, None),
    ));
    body.extend(c.pipelined("j0", (id("jbegin"), id("jend")), t, &staged, tile));
    // The rows' sums over the quad, then O / l and the log-sum-exp.
    let mut fin = vec![
        add_to(ix("l", id("r")), shfl(ix("l", id("r")), 1)),
        add_to(ix("l", id("r")), shfl(ix("l", id("r")), 2)),
        decl("long long", "qi", ix("row", id("r"))),
        decl(
            "float",
            "inv",
            C::Cond(
                Box::new(bin(">", ix("l", id("r")), zero())),
                Box::new(bin("/", C::Lit("1.0f".into()), ix("l", id("r")))),
                Box::new(zero()),
            ),
        ),
    ];
    let mut write = vec![unrolled(
        "nb",
        nv,
        vec![unrolled(
            "x",
            2,
            vec![c.store(
                Out,
                b.clone(),
                h.clone(),
                id("qi"),
                bin(
                    "+",
                    bin("+", bin("*", id("nb"), ll(8)), bin("*", id("tq"), ll(2))),
                    id("x"),
                ),
                bin(
                    "*",
                    ix(
                        "o",
                        bin(
                            "+",
                            bin("+", bin("*", id("nb"), ll(4)), bin("*", id("r"), ll(2))),
                            id("x"),
                        ),
                    ),
                    id("inv"),
                ),
            )],
        )],
    )];
    write.push(S::If(
        bin("==", id("tq"), ll(0)),
        vec![set(
            at(c.buf(LogSumExp), c.lse_at(b.clone(), h.clone(), id("qi"))),
            C::Cond(
                Box::new(bin(">", ix("l", id("r")), zero())),
                // Natural again: (m + log2 l) · ln 2.
                Box::new(bin(
                    "*",
                    bin("+", ix("m", id("r")), call("log2f", vec![ix("l", id("r"))])),
                    f32_lit(LN_2),
                )),
                Box::new(neg_inf()),
            ),
        )],
    ));
    fin.push(S::If(bin("<", id("qi"), size(k.q_len)), write));
    body.push(unrolled("r", 2, fin));
    let items = tile_items(k.q_len, k.batch, k.heads, block_rows);
    Pass {
        // Q's fragments, O's and S's accumulators, the rows' statistics.
        fill: Some((hd / 16 * 4 + nv * 4 + ns * 4 + 4) as u32),
        ..Pass::tiles(
            items,
            body,
            (32 * warps) as u32,
            key_value_arrays(t, kstride, vstride),
        )
    }
}

/// The shared arrays [`key_value_tiles`] stages into: two `t`-key tiles
/// each (the one computed on and the one fetched), rows `kstride` and
/// `vstride` elements apart.
fn key_value_arrays(t: i64, kstride: i64, vstride: i64) -> Vec<Shared> {
    vec![
        shared("dplc_t", 2, "kbuf", 2 * t * kstride),
        shared("dplc_t", 2, "vbuf", 2 * t * vstride),
    ]
}

/// The key and value tiles of key head `kh` the forward and the dQ pass
/// walk (`kt`/`vt`, fetched into `kn`/`vn`), rows `kstride` and `vstride`
/// elements apart.
fn key_value_tiles(k: &AttentionKernel, kstride: i64, vstride: i64) -> [Staged; 2] {
    use AttentionBuffer::*;
    [
        Staged {
            buf: "kbuf",
            cur: "kt",
            next: "kn",
            role: K,
            head: id("kh"),
            len: k.k_len,
            width: k.head_dim,
            stride: kstride,
        },
        Staged {
            buf: "vbuf",
            cur: "vt",
            next: "vn",
            role: V,
            head: id("kh"),
            len: k.k_len,
            width: k.value_dim,
            stride: vstride,
        },
    ]
}

/// A tensor-core pass's rows: 4 warps of 16 from `first`, this thread's
/// `row[0] = first + 16·warp + g` and `row[1] = row[0] + 8` (`g` = lane / 4,
/// `tq` = lane % 4: a thread holds, of each 16×8 accumulator tile, those
/// rows at columns `2·tq` and `2·tq + 1`).
pub(super) fn warp_rows(first: &str) -> Vec<S> {
    vec![
        decl("long long", "lane", bin("%", thread(), ll(32))),
        decl("long long", "g", bin("/", id("lane"), ll(4))),
        decl("long long", "tq", bin("%", id("lane"), ll(4))),
        decl(
            "long long",
            "r0",
            bin(
                "+",
                bin("+", id(first), bin("*", bin("/", thread(), ll(32)), ll(16))),
                id("g"),
            ),
        ),
        array("long long", "row", 2),
        set(ix("row", ll(0)), id("r0")),
        set(ix("row", ll(1)), bin("+", id("r0"), ll(8))),
    ]
}

/// A-operand fragments of `role` (a `[row][feature]` operand of `width`
/// features, rows of head `head`, `len` of them) for this thread's rows
/// `row[0]`, `row[1]`, straight from memory into `name[width / 16 * 4]`
/// (zeros past the last row): the `m16n8k16` layout of [`forward_mma`]'s `Q`.
fn row_fragments(
    c: &Ctx,
    role: AttentionBuffer,
    (head, len): (C, Size),
    name: &str,
    width: i64,
) -> Vec<S> {
    let b = id("b");
    let h = head;
    let bits = |r: C, d: C| {
        C::Cond(
            Box::new(bin("<", r.clone(), size(len))),
            Box::new(C::Cast(
                "unsigned",
                Box::new(at(c.buf(role), c.addr(role, b.clone(), h.clone(), r, d))),
            )),
            Box::new(C::Lit("0u".into())),
        )
    };
    let mut load = Vec::new();
    for (reg, (rsel, dofs)) in [(0, 0), (1, 0), (0, 8), (1, 8)].into_iter().enumerate() {
        let d = bin(
            "+",
            bin("+", bin("*", id("ks"), ll(16)), ll(dofs)),
            bin("*", id("tq"), ll(2)),
        );
        load.push(set(
            ix(name, bin("+", bin("*", id("ks"), ll(4)), ll(reg as i64))),
            pair_bits(
                bits(ix("row", ll(rsel)), d.clone()),
                bits(ix("row", ll(rsel)), bin("+", d, ll(1))),
            ),
        ));
    }
    vec![
        array("unsigned", name, width / 16 * 4),
        unrolled("ks", width / 16, load),
    ]
}

/// Where lane `l` points `ldmatrix.x4` for the `m16n8k16` A fragment of
/// step `step` (16 columns a step) of the 16 rows from `first` of the
/// shared tile `name` (rows `stride` apart): row (l % 8) + 8·((l / 8) % 2),
/// columns 16·step + 8·(l / 16), so its four tiles are rows 0–7 and 8–15
/// of columns 0–7, then of 8–15 — registers a0..a3.
fn a_fragment_at(name: &str, stride: i64, first: C, step: &str) -> C {
    let row = bin(
        "+",
        first,
        bin(
            "+",
            bin("%", id("lane"), ll(8)),
            bin("*", bin("%", bin("/", id("lane"), ll(8)), ll(2)), ll(8)),
        ),
    );
    ix(
        name,
        bin(
            "+",
            bin("*", row, ll(stride)),
            bin(
                "+",
                bin("*", id(step), ll(16)),
                bin("*", bin("/", id("lane"), ll(16)), ll(8)),
            ),
        ),
    )
}

/// Where the A operand of [`mma_rows`] comes from.
enum RowsA<'a> {
    /// Fragments in registers, `name[ks·4 ..]` for step `ks`
    /// ([`row_fragments`]).
    Registers(&'a str),
    /// A shared `[row][feature]` tile of the block's 64 rows, rows `stride`
    /// apart: each step's fragment loaded by `ldmatrix` from the warp's 16.
    Shared(&'a str, i64),
}

/// `acc[nb·4 ..] = A·Bᵀ` for `nb` in `0..tiles`: A the rows of `a` over
/// `width / 16` steps, B's column `nb·8 + g` the row of the shared tile
/// `tile` (rows `stride` apart, a multiple of 8; the tile 16-byte aligned)
/// — two consecutive features of one row per register, loaded by
/// `ldmatrix` — as [`forward_mma`]'s `S = Q·Kᵀ`.
fn mma_rows(acc: &str, a: RowsA, tile: &str, stride: i64, width: i64, tiles: i64) -> S {
    // Key tiles are 16, 32, 48 or 64 rows: whole pairs of 8-key blocks.
    assert!(
        tiles % 2 == 0,
        "{tiles} key blocks: a tile is whole 16-row steps"
    );
    let frag = match a {
        RowsA::Registers(name) => C::Ref(Box::new(ix(name, bin("*", id("ks"), ll(4))))),
        RowsA::Shared(..) => id("af"),
    };
    let mma = |nb: C, b0: C, b1: C| {
        S::Expr(call(
            "dplc_mma",
            vec![
                C::Ref(Box::new(ix(acc, bin("*", nb, ll(4))))),
                frag.clone(),
                b0,
                b1,
            ],
        ))
    };
    // Two key blocks a `ldmatrix.x4`: lane 4g + t points at key 8·(2·nb2 +
    // g / 4) + (4g + t) % 8, features 16·ks + 8·((g / 2) % 2), so its tiles
    // are features 0–7 and 8–15 of block 2·nb2, then of block 2·nb2 + 1
    // (registers b0, b1 of the first `mma`, then of the second).
    let row_addr = ix(
        tile,
        bin(
            "+",
            bin(
                "*",
                bin(
                    "+",
                    bin(
                        "*",
                        bin("+", bin("*", id("nb2"), ll(2)), bin("/", id("g"), ll(4))),
                        ll(8),
                    ),
                    bin("+", bin("*", bin("%", id("g"), ll(2)), ll(4)), id("tq")),
                ),
                ll(stride),
            ),
            bin(
                "+",
                bin("*", id("ks"), ll(16)),
                bin("*", bin("%", bin("/", id("g"), ll(2)), ll(2)), ll(8)),
            ),
        ),
    );
    let kb = |i: i64| ix("kb", ll(i));
    let (first, second) = (
        bin("*", id("nb2"), ll(2)),
        bin("+", bin("*", id("nb2"), ll(2)), ll(1)),
    );
    let pair = vec![
        array("unsigned", "kb", 4),
        S::Expr(call(
            "dplc_ldsm_x4",
            vec![id("kb"), C::Ref(Box::new(row_addr))],
        )),
        mma(first.clone(), kb(0), kb(1)),
        mma(second.clone(), kb(2), kb(3)),
    ];
    let zeroed = |nb: C| {
        unrolled(
            "x",
            4,
            vec![set(ix(acc, bin("+", bin("*", nb, ll(4)), id("x"))), zero())],
        )
    };
    match a {
        // Steps inside the key blocks: the fragments are at hand.
        RowsA::Registers(_) => unrolled(
            "nb2",
            tiles / 2,
            vec![
                zeroed(first),
                zeroed(second),
                unrolled("ks", width / 16, pair),
            ],
        ),
        // Key blocks inside the steps: each step's fragment loaded once.
        RowsA::Shared(name, a_stride) => {
            let a_addr = a_fragment_at(
                name,
                a_stride,
                bin("*", bin("/", thread(), ll(32)), ll(16)),
                "ks",
            );
            S::Block(vec![
                unrolled("nb2", tiles / 2, vec![zeroed(first), zeroed(second)]),
                unrolled(
                    "ks",
                    width / 16,
                    vec![
                        array("unsigned", "af", 4),
                        S::Expr(call(
                            "dplc_ldsm_x4",
                            vec![id("af"), C::Ref(Box::new(a_addr))],
                        )),
                        unrolled("nb2", tiles / 2, pair),
                    ],
                ),
            ])
        }
    }
}

/// Where the A operand of [`mma_cols`] comes from: `[row][key]`, sixteen
/// keys a step.
pub(super) enum ColsA<'a> {
    /// Accumulator tiles in registers (keys along columns), packed into A
    /// fragments as they are — [`forward_mma`]'s P.
    Packed(&'a str),
    /// A shared tile, rows `stride` apart, the warp's 16 rows from `first`:
    /// each step's fragment loaded by `ldmatrix`.
    Shared(&'a str, i64, C),
}

/// `out[nb·4 ..] += A·T` for `nb` in `0..width / 8`: A over `keys` (packed
/// accumulator tiles or a shared tile, [`ColsA`]), T the shared tile
/// `tile` (`[key][feature]`, rows `stride` apart) from column `first_col`
/// — [`forward_mma`]'s `O += P·V`, the one-pass backward's `dQ += dS·K`.
pub(super) fn mma_cols(
    out: &str,
    a: ColsA,
    tile: &str,
    stride: i64,
    (keys, width, first_col): (i64, i64, Option<C>),
) -> S {
    let from = |col: C| match &first_col {
        Some(c0) => bin("+", c0.clone(), col),
        None => col,
    };
    let bits = |kofs: i64| {
        let key = bin(
            "+",
            bin("+", bin("*", id("kk"), ll(16)), ll(kofs)),
            bin("*", id("tq"), ll(2)),
        );
        let col = from(bin("+", bin("*", id("nb"), ll(8)), id("g")));
        pair_bits(
            ix(
                tile,
                bin("+", bin("*", key.clone(), ll(stride)), col.clone()),
            ),
            ix(
                tile,
                bin("+", bin("*", bin("+", key, ll(1)), ll(stride)), col),
            ),
        )
    };
    let (mut step, frag) = match &a {
        ColsA::Packed(scores) => {
            let p = |tile_ofs: i64, x: i64| {
                ix(
                    scores,
                    bin(
                        "+",
                        bin(
                            "*",
                            bin("+", bin("*", id("kk"), ll(2)), ll(tile_ofs)),
                            ll(4),
                        ),
                        ll(x),
                    ),
                )
            };
            (
                vec![
                    array("unsigned", "pf", 4),
                    set(ix("pf", ll(0)), call("dplc_pack", vec![p(0, 0), p(0, 1)])),
                    set(ix("pf", ll(1)), call("dplc_pack", vec![p(0, 2), p(0, 3)])),
                    set(ix("pf", ll(2)), call("dplc_pack", vec![p(1, 0), p(1, 1)])),
                    set(ix("pf", ll(3)), call("dplc_pack", vec![p(1, 2), p(1, 3)])),
                ],
                id("pf"),
            )
        }
        ColsA::Shared(name, a_stride, first) => {
            let a_addr = a_fragment_at(name, *a_stride, first.clone(), "kk");
            (
                vec![
                    array("unsigned", "af", 4),
                    S::Expr(call(
                        "dplc_ldsm_x4",
                        vec![id("af"), C::Ref(Box::new(a_addr))],
                    )),
                ],
                id("af"),
            )
        }
    };
    // Two column blocks of T a `ldmatrix.x4.trans`: lane 4g + t points at
    // key 16·kk + (4g + t) % 16 of block 2·nb2 + g / 4, so its tiles are
    // keys 0–7 and 8–15 of block 2·nb2, then of block 2·nb2 + 1 (registers
    // b0, b1 of the first `mma`, then of the second). Rows are 16-byte
    // aligned: `stride` is a multiple of 8 and the tile 16-byte aligned.
    let lane_row = bin("+", bin("*", bin("%", id("g"), ll(4)), ll(4)), id("tq"));
    let row_addr = ix(
        tile,
        bin(
            "+",
            bin(
                "*",
                bin("+", bin("*", id("kk"), ll(16)), lane_row),
                ll(stride),
            ),
            from(bin(
                "*",
                bin("+", bin("*", id("nb2"), ll(2)), bin("/", id("g"), ll(4))),
                ll(8),
            )),
        ),
    );
    let mma = |nb: C, b0: C, b1: C| {
        S::Expr(call(
            "dplc_mma",
            vec![
                C::Ref(Box::new(ix(out, bin("*", nb, ll(4))))),
                frag.clone(),
                b0,
                b1,
            ],
        ))
    };
    let tb = |i: i64| ix("tb", ll(i));
    step.push(unrolled(
        "nb2",
        width / 16,
        vec![
            array("unsigned", "tb", 4),
            S::Expr(call(
                "dplc_ldsm_x4_t",
                vec![id("tb"), C::Ref(Box::new(row_addr))],
            )),
            mma(bin("*", id("nb2"), ll(2)), tb(0), tb(1)),
            mma(bin("+", bin("*", id("nb2"), ll(2)), ll(1)), tb(2), tb(3)),
        ],
    ));
    // An odd last column block (a value width of 8 · odd): two 16-bit loads a register.
    if width % 16 != 0 {
        step.push(S::Block(vec![
            decl("long long", "nb", ll(width / 8 - 1)),
            mma(id("nb"), bits(0), bits(8)),
        ]));
    }
    unrolled("kk", keys / 16, step)
}

/// Whether the `dQ` pass runs on tensor cores: the forward's condition,
/// with the value width whole `k16` steps too (`dO·Vᵀ` steps along it).
pub(super) fn query_grad_tensor_cores(k: &AttentionKernel, dtype: DType) -> bool {
    tensor_cores(k, dtype) && k.value_dim % 16 == 0
}

/// The tensor-core `dQ` pass: 4 warps of 16 query rows, as [`forward_mma`];
/// per key tile `S = Q·Kᵀ` and `dP = dO·Vᵀ` as `m16n8k16` steps, `dS = P ∘
/// (dP·keep − δ)` in their accumulators (P from the saved log-sum-exp),
/// then `dQ += dS·K` with `dS` packed to the storage type as FlashAttention-2
/// packs it. A thread holds rows `g` and `g + 8` of its warp's 16.
pub(super) fn query_grad_mma(c: &Ctx) -> Pass {
    use AttentionBuffer::*;
    let k = c.k;
    let (hd, vd) = (k.head_dim, k.value_dim);
    // Key rows per tile: S and dP hold t / 8 accumulator tiles each, so the
    // wider heads take narrower tiles; K and V staged as 16-bit elements,
    // rows padded by 8 against bank conflicts.
    let (kstride, vstride) = (hd + 8, vd + 8);
    let t = [if hd.max(vd) > 64 { 32 } else { 64 }, 32, 16]
        .into_iter()
        .find(|t| 2 * 2 * t * (kstride + vstride) <= SHARED_BYTES)
        .unwrap_or(16);
    let ns = t / 8;
    let (b, h) = (id("b"), id("hh"));
    let mut body = decompose(k.heads, k.q_len, "i0", ROWS);
    body.push(decl("long long", "kh", bin("/", h.clone(), ll(k.group))));
    body.extend(warp_rows("i0"));
    body.extend(row_fragments(c, Q, (h.clone(), k.q_len), "qf", hd));
    body.extend(row_fragments(c, OutGrad, (h.clone(), k.q_len), "of", vd));
    // Each row's log-sum-exp, and δ = Σ dO ∘ O over the quad sharing it.
    body.push(array("float", "lse", 2));
    body.push(array("float", "delta", 2));
    let qi = ix("row", id("r"));
    let mut per_row = row_delta(c);
    per_row.push(set(
        ix("lse", id("r")),
        C::Cond(
            Box::new(id("live")),
            Box::new(lse_base2(c, b.clone(), h.clone(), qi.clone())),
            Box::new(neg_inf()),
        ),
    ));
    body.push(unrolled("r", 2, per_row));
    body.push(array("float", "dq", hd / 8 * 4));
    body.push(unrolled(
        "x",
        hd / 8 * 4,
        vec![set(ix("dq", id("x")), zero())],
    ));
    body.extend(c.key_range(t, ROWS));
    let staged = key_value_tiles(k, kstride, vstride);
    let mut tile = vec![
        array("float", "s", ns * 4),
        array("float", "dp", ns * 4),
        mma_rows("s", RowsA::Registers("qf"), "kt", kstride, hd, ns),
        mma_rows("dp", RowsA::Registers("of"), "vt", vstride, vd, ns),
    ];
    // dS in S's place: P from the log-sum-exp (0 where masked or past an
    // end), the dropout's factor on dP.
    let (qi, kj) = (
        ix("row", bin("/", id("x"), ll(2))),
        bin(
            "+",
            bin("+", id("j0"), bin("*", id("nb"), ll(8))),
            bin("+", bin("*", id("tq"), ll(2)), bin("%", id("x"), ll(2))),
        ),
    );
    let at_x = |name: &str| ix(name, bin("+", bin("*", id("nb"), ll(4)), id("x")));
    let delta_x = ix("delta", bin("/", id("x"), ll(2)));
    let lse2 = ix("lse", bin("/", id("x"), ll(2)));
    // Each of the thread's two rows draws its two neighbouring keys as one pair.
    let pair = c.keep_pair(
        &b,
        &h,
        &ix("row", id("y")),
        &bin(
            "+",
            bin("+", id("j0"), bin("*", id("nb"), ll(8))),
            bin("*", id("tq"), ll(2)),
        ),
        "kq",
        bin("*", id("y"), ll(2)),
    );
    let scores = |open: bool| {
        let [p, mut kp] = probability(c, at_x("s"), lse2.clone(), &b, &h, open);
        let mut per_nb = Vec::new();
        if !pair.is_empty() {
            per_nb.push(array("float", "kq", 4));
            per_nb.push(unrolled("y", 2, pair.clone()));
            kp = decl("float", "kp", ix("kq", id("x")));
        }
        per_nb.push(unrolled(
            "x",
            4,
            vec![
                decl("long long", "qi", qi.clone()),
                decl("long long", "kj", kj.clone()),
                p,
                kp,
                set(
                    at_x("s"),
                    bin(
                        "*",
                        id("p"),
                        bin("-", bin("*", at_x("dp"), id("kp")), delta_x.clone()),
                    ),
                ),
            ],
        ));
        unrolled("nb", ns, per_nb)
    };
    tile.extend(open_or_masked(
        c.all_visible(&warp_first_row(), 16, &id("j0"), t),
        scores,
    ));
    tile.push(mma_cols(
        "dq",
        ColsA::Packed("s"),
        "kt",
        kstride,
        (t, hd, None),
    ));
    body.extend(c.pipelined("j0", (id("jbegin"), id("jend")), t, &staged, tile));
    let write = vec![unrolled(
        "nb",
        hd / 8,
        vec![unrolled(
            "x",
            2,
            vec![c.store(
                QGrad,
                b.clone(),
                h.clone(),
                id("qi"),
                bin(
                    "+",
                    bin("+", bin("*", id("nb"), ll(8)), bin("*", id("tq"), ll(2))),
                    id("x"),
                ),
                bin(
                    "*",
                    ix(
                        "dq",
                        bin(
                            "+",
                            bin("+", bin("*", id("nb"), ll(4)), bin("*", id("r"), ll(2))),
                            id("x"),
                        ),
                    ),
                    f32_lit(k.scale),
                ),
            )],
        )],
    )];
    body.push(unrolled(
        "r",
        2,
        vec![
            decl("long long", "qi", ix("row", id("r"))),
            S::If(bin("<", id("qi"), size(k.q_len)), write),
        ],
    ));
    let items = tile_items(k.q_len, k.batch, k.heads, ROWS);
    Pass::tiles(items, body, 128, key_value_arrays(t, kstride, vstride))
}

/// Row `row[r]`'s δ = Σ dO ∘ O (query head `hh` of sample `b`), each of
/// the quad sharing the row summing a quarter of it: into `delta[r]` and,
/// by the quad's first thread, the δ buffer; `live` says whether the row
/// is inside the problem.
pub(super) fn row_delta(c: &Ctx) -> Vec<S> {
    use AttentionBuffer::*;
    let (b, h) = (id("b"), id("hh"));
    let shfl = |v: C, o: i64| {
        call(
            "__shfl_xor_sync",
            vec![C::Lit("0xffffffffu".into()), v, C::Lit(o.to_string())],
        )
    };
    let qi = ix("row", id("r"));
    let part = bin(
        "+",
        bin("*", id("nb"), ll(8)),
        bin("+", bin("*", id("tq"), ll(2)), id("x")),
    );
    vec![
        decl("int", "live", bin("<", qi.clone(), size(c.k.q_len))),
        var("float", "dsum", Some(zero())),
        S::If(
            id("live"),
            vec![unrolled(
                "nb",
                c.k.value_dim / 8,
                vec![unrolled(
                    "x",
                    2,
                    vec![add_to(
                        id("dsum"),
                        bin(
                            "*",
                            c.load(OutGrad, b.clone(), h.clone(), qi.clone(), part.clone()),
                            c.load(Out, b.clone(), h.clone(), qi.clone(), part.clone()),
                        ),
                    )],
                )],
            )],
        ),
        add_to(id("dsum"), shfl(id("dsum"), 1)),
        add_to(id("dsum"), shfl(id("dsum"), 2)),
        set(ix("delta", id("r")), id("dsum")),
        S::If(
            bin("&&", id("live"), bin("==", id("tq"), ll(0))),
            vec![set(at(c.buf(Delta), c.lse_at(b, h, qi)), id("dsum"))],
        ),
    ]
}

/// The tensor-core `dK`/`dV` pass: 4 warps of 16 key rows of one key head
/// (64 keys a block), over the query heads that share it and their query
/// tiles: per tile `Sᵀ = K·Qᵀ` and `dPᵀ = V·dOᵀ` as `m16n8k16` steps (keys
/// along rows, queries along columns), then `dV += Pᵀ·dO` with P dropped as
/// the forward dropped it and `dK += dSᵀ·Q`, P and dS packed to the storage
/// type as FlashAttention-2 packs them; each query's log-sum-exp and δ
/// (the `dQ` pass's) staged beside its Q and dO rows.
/// The `dK`/`dV` pass's tiling: query rows per streamed tile, and the
/// shared bytes of its streamed tiles (Q, dO, their rows' statistics) and
/// of its own 64 rows of K and V.
pub(super) struct KeyValueTiling {
    pub(super) t: i64,
    pub(super) streamed: i64,
    pub(super) own: i64,
}

pub(super) fn key_value_tiling(k: &AttentionKernel, keys: i64) -> KeyValueTiling {
    let (hd, vd) = (k.head_dim, k.value_dim);
    let (qstride, ostride) = (hd + 8, vd + 8);
    // Query rows per tile: Sᵀ and dPᵀ hold t / 8 accumulator tiles each
    // beside dK and dV, so the wider heads take narrower tiles.
    let t = [if hd.max(vd) > 64 { 32 } else { 64 }, 32, 16]
        .into_iter()
        .find(|t| 2 * 2 * t * (qstride + ostride) + 8 * t <= SHARED_BYTES)
        .unwrap_or(16);
    KeyValueTiling {
        t,
        streamed: 2 * 2 * t * (qstride + ostride) + 8 * t,
        own: 2 * keys * ((hd + 8) + (vd + 8)),
    }
}

/// With `with_dq` (the one-pass backward's [`AttentionPass::Grads`]) each
/// query tile's `dS` also goes through shared memory into `dQ += dS·K`
/// over the block's 64 keys, added into `dQ`'s `f32` sum atomically.
pub(super) fn key_value_grad_mma(c: &Ctx, with_dq: bool) -> Pass {
    use AttentionBuffer::*;
    let k = c.k;
    let (hd, vd) = (k.head_dim, k.value_dim);
    let (qstride, ostride) = (hd + 8, vd + 8);
    // The launched block's warps, 16 keys each; a tuned one-pass's own.
    let warps = if with_dq {
        i64::from(c.tuning.backward_warps)
    } else {
        BACKWARD_WARPS
    };
    let keys = 16 * warps;
    let KeyValueTiling {
        t,
        streamed,
        own: own_bytes,
    } = key_value_tiling(k, keys);
    let ns = t / 8;
    let (b, h) = (id("b"), id("h"));
    let mut body = decompose(k.kv_heads, k.k_len, "j0", keys);
    body.push(decl("long long", "kh", id("hh")));
    body.extend(warp_rows("j0"));
    // K's and V's A fragments: in registers, or the block's 64 rows of each
    // staged in shared memory once per item and read at each step (always
    // with `dQ`, whose `dS·K` reads K's rows as B fragments).
    let (kstride, vstride) = (hd + 8, vd + 8);
    let arrays = (hd + vd) / 4 + (hd + vd) / 2 + t;
    let from_shared = with_dq
        || (arrays > KEY_VALUE_REGISTER_ARRAYS && streamed + own_bytes <= MOST_SHARED_BYTES);
    let mut own = vec![];
    if from_shared {
        // After every thread is done with the last item's rows; waited for
        // here, so no copy is in flight when the next item rewrites them.
        body.push(sync());
        for (name, role, width, stride) in [("kown", K, hd, kstride), ("vown", V, vd, vstride)] {
            body.push(c.stage16(Tile16 {
                name,
                role,
                head: id("kh"),
                first: id("j0"),
                len: k.k_len,
                rows: keys,
                width,
                stride,
            }));
            own.push(shared("dplc_t", 2, name, keys * stride));
        }
        body.push(S::Expr(call("dplc_cp_async_commit", vec![])));
        body.push(S::Expr(call("dplc_cp_async_wait", vec![])));
        body.push(sync());
    } else {
        body.extend(row_fragments(c, K, (id("kh"), k.k_len), "kf", hd));
        body.extend(row_fragments(c, V, (id("kh"), k.k_len), "vf", vd));
    }
    body.push(array("float", "dk", hd / 8 * 4));
    body.push(array("float", "dv", vd / 8 * 4));
    body.push(unrolled(
        "x",
        hd / 8 * 4,
        vec![set(ix("dk", id("x")), zero())],
    ));
    body.push(unrolled(
        "x",
        vd / 8 * 4,
        vec![set(ix("dv", id("x")), zero())],
    ));
    // The block's keys are [j0, j0 + keys), as `query_range` takes them.
    body.extend(c.query_range(t, keys));
    let staged = [
        Staged {
            buf: "qbuf",
            cur: "qt",
            next: "qn",
            role: Q,
            head: h.clone(),
            len: k.q_len,
            width: hd,
            stride: qstride,
        },
        Staged {
            buf: "obuf",
            cur: "ot",
            next: "on",
            role: OutGrad,
            head: h.clone(),
            len: k.q_len,
            width: vd,
            stride: ostride,
        },
    ];
    // Per query row of the tile: its log-sum-exp and δ, staged once (the
    // barrier at the step's top has every thread done with the last ones).
    let qi = bin("+", id("i0"), id("q"));
    let mut live_row = vec![set(
        ix("dt", id("q")),
        at(c.buf(Delta), c.lse_at(b.clone(), h.clone(), id("qi"))),
    )];
    live_row.push(set(
        ix("lt", id("q")),
        lse_base2(c, b.clone(), h.clone(), id("qi")),
    ));
    let rowstats = vec![
        decl("long long", "qi", qi),
        set(ix("lt", id("q")), neg_inf()),
        set(ix("dt", id("q")), zero()),
        S::If(bin("<", id("qi"), size(k.q_len)), live_row),
    ];
    let mut tile = vec![
        loop_over(
            "q",
            thread(),
            ll(t),
            C::Cast("long long", Box::new(id("blockDim.x"))),
            rowstats,
        ),
        sync(),
        array("float", "s", ns * 4),
        array("float", "dp", ns * 4),
    ];
    if from_shared {
        tile.push(mma_rows(
            "s",
            RowsA::Shared("kown", kstride),
            "qt",
            qstride,
            hd,
            ns,
        ));
        tile.push(mma_rows(
            "dp",
            RowsA::Shared("vown", vstride),
            "ot",
            ostride,
            vd,
            ns,
        ));
    } else {
        tile.push(mma_rows("s", RowsA::Registers("kf"), "qt", qstride, hd, ns));
        tile.push(mma_rows(
            "dp",
            RowsA::Registers("vf"),
            "ot",
            ostride,
            vd,
            ns,
        ));
    }
    // Pᵀ dropped in S's place, dSᵀ in dP's: key `row[x / 2]`, query
    // `i0 + 8·nb + 2·tq + x % 2`.
    let at_x = |name: &str| ix(name, bin("+", bin("*", id("nb"), ll(4)), id("x")));
    let qcol = bin(
        "+",
        bin("*", id("nb"), ll(8)),
        bin("+", bin("*", id("tq"), ll(2)), bin("%", id("x"), ll(2))),
    );
    // The dropout's draws, swapped between the lanes that hold a key pair.
    let first_query = bin(
        "+",
        id("i0"),
        bin("+", bin("*", id("nb"), ll(8)), bin("*", id("tq"), ll(2))),
    );
    let swapped = c.keep_swapped(&b, &h, &first_query, "kq");
    let scores = |open: bool| {
        let [p, mut kp] = probability(c, at_x("s"), id("lq"), &b, &h, open);
        let mut per_nb = Vec::new();
        if !swapped.is_empty() {
            per_nb.push(array("float", "kq", 4));
            per_nb.extend(swapped.clone());
            kp = decl("float", "kp", ix("kq", id("x")));
        }
        per_nb.push(unrolled(
            "x",
            4,
            vec![
                decl("long long", "kj", ix("row", bin("/", id("x"), ll(2)))),
                decl("long long", "qc", qcol.clone()),
                decl("long long", "qi", bin("+", id("i0"), id("qc"))),
                decl("float", "lq", ix("lt", id("qc"))),
                p,
                kp,
                set(
                    at_x("dp"),
                    bin(
                        "*",
                        id("p"),
                        bin("-", bin("*", at_x("dp"), id("kp")), ix("dt", id("qc"))),
                    ),
                ),
                set(at_x("s"), bin("*", id("p"), id("kp"))),
            ],
        ));
        unrolled("nb", ns, per_nb)
    };
    // The warp's 16 keys against the tile's queries.
    tile.extend(open_or_masked(
        c.all_visible(&id("i0"), t, &warp_first_row(), 16),
        scores,
    ));
    let dstride = score_grad_stride(keys);
    if with_dq {
        // dSᵀ's accumulators into the tile `dS[query][key]`, read back
        // after the barrier below as the A fragments of `dS·K`.
        let key = bin("-", ix("row", bin("/", id("x"), ll(2))), id("j0"));
        tile.push(unrolled(
            "nb",
            ns,
            vec![unrolled(
                "x",
                4,
                vec![set(
                    ix("dsbuf", bin("+", bin("*", qcol.clone(), ll(dstride)), key)),
                    call("dplc_st", vec![at_x("dp")]),
                )],
            )],
        ));
    }
    tile.push(mma_cols(
        "dv",
        ColsA::Packed("s"),
        "ot",
        ostride,
        (t, vd, None),
    ));
    tile.push(mma_cols(
        "dk",
        ColsA::Packed("dp"),
        "qt",
        qstride,
        (t, hd, None),
    ));
    if with_dq {
        tile.push(sync());
        tile.push(query_grad_share(c, t, keys, kstride));
    }
    let heads = loop_over(
        "gq",
        ll(0),
        ll(k.group),
        ll(1),
        vec![
            decl(
                "long long",
                "h",
                bin("+", bin("*", id("kh"), ll(k.group)), id("gq")),
            ),
            S::Block(c.pipelined("i0", (id("ibegin"), id("iend")), t, &staged, tile)),
        ],
    );
    body.push(heads);
    let col = bin(
        "+",
        bin("+", bin("*", id("nb"), ll(8)), bin("*", id("tq"), ll(2))),
        id("x"),
    );
    let acc = |name: &str| {
        ix(
            name,
            bin(
                "+",
                bin("+", bin("*", id("nb"), ll(4)), bin("*", id("r"), ll(2))),
                id("x"),
            ),
        )
    };
    let write = vec![
        unrolled(
            "nb",
            hd / 8,
            vec![unrolled(
                "x",
                2,
                vec![c.store(
                    KGrad,
                    b.clone(),
                    id("kh"),
                    id("kj"),
                    col.clone(),
                    bin("*", acc("dk"), f32_lit(k.scale)),
                )],
            )],
        ),
        unrolled(
            "nb",
            vd / 8,
            vec![unrolled(
                "x",
                2,
                vec![c.store(VGrad, b.clone(), id("kh"), id("kj"), col, acc("dv"))],
            )],
        ),
    ];
    body.push(unrolled(
        "r",
        2,
        vec![
            decl("long long", "kj", ix("row", id("r"))),
            S::If(bin("<", id("kj"), size(k.k_len)), write),
        ],
    ));
    let items = tile_items(k.k_len, k.batch, k.kv_heads, keys);
    let mut arrays = vec![
        shared("dplc_t", 2, "qbuf", 2 * t * qstride),
        shared("dplc_t", 2, "obuf", 2 * t * ostride),
        shared("float", 4, "lt", t),
        shared("float", 4, "dt", t),
    ];
    arrays.extend(own);
    if with_dq {
        arrays.push(shared("dplc_t", 2, "dsbuf", t * dstride));
    }
    Pass::tiles(items, body, (32 * warps) as u32, arrays)
}
