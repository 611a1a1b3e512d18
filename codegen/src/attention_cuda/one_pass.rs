//! The one-pass backward of the tensor-core attention (FlashAttention-2's):
//! whether a kernel takes it ([`attention_backward`]), its δ pass, the `dQ`
//! share its pass by key tiles adds into an `f32` sum (the pass itself is
//! `mma`'s `dK`/`dV` pass with `with_dq`), and the pass that scales the sum
//! into `dQ`.

use super::mma::{
    key_value_tiling, mma_cols, query_grad_tensor_cores, row_delta, warp_rows, ColsA,
    BACKWARD_WARPS,
};
use super::*;

/// Elements between rows of the one-pass backward's score-gradient tile
/// (`dS[query][key]` over the block's `keys`), padded by 8 as the other
/// tiles are.
pub(super) fn score_grad_stride(keys: i64) -> i64 {
    keys + 8
}

/// Bytes of the score-gradient tile of `t` query rows.
fn score_grad_tile_bytes(t: i64, keys: i64) -> i64 {
    2 * t * score_grad_stride(keys)
}

/// The `dQ` share of the one-pass backward: the block's `t × head_dim`
/// tile split over its `warps`, `16 · warps / t` warps to each 16-row block
/// of queries, each a run of column blocks — how many, or `None` where a
/// warp would take an odd count (each `ldmatrix.x4` feeds two) or none.
fn query_grad_split(t: i64, head_dim: i64, warps: i64) -> Option<i64> {
    let per_row_block = warps / (t / 16);
    let columns = head_dim / 8;
    (per_row_block > 0 && columns % (2 * per_row_block) == 0).then_some(columns / per_row_block)
}

/// Whether the one-pass backward with blocks of `warps` warps (16 keys
/// each) fits `limit` bytes of shared memory — its own K and V rows, its
/// streamed tiles and the score gradients `dQ` is made from — and splits
/// its `dQ` tile evenly.
pub(super) fn one_pass_fits(k: &AttentionKernel, warps: i64, limit: i64) -> bool {
    let keys = 16 * warps;
    let tiling = key_value_tiling(k, keys);
    tiling.streamed + tiling.own + score_grad_tile_bytes(tiling.t, keys) <= limit
        && query_grad_split(tiling.t, k.head_dim, warps).is_some()
}

/// Whether the backward is one pass (`dK`, `dV` and `dQ`'s share by key
/// tiles, FlashAttention-2's) for `k` stored as `dtype`: the tensor-core
/// `dK`/`dV` pass, with room in a block's shared memory for its own K and
/// V rows, its streamed tiles and the score gradients `dQ` is made from,
/// and a `dQ` tile its warps split evenly. Else two passes, each
/// recomputing the scores. One decision for the code, the executor and
/// the host backend alike.
pub fn attention_backward(k: &AttentionKernel, dtype: DType) -> AttentionBackward {
    if query_grad_tensor_cores(k, dtype) && one_pass_fits(k, BACKWARD_WARPS, MOST_SHARED_BYTES) {
        AttentionBackward::OnePass
    } else {
        AttentionBackward::TwoPass
    }
}

/// The one-pass backward's first pass: each query row's δ. Where O's and
/// dO's features are contiguous, `value_dim / 8` threads a row (a power of
/// two up to a warp), each reading eight elements of both rows a 16-byte
/// load where the rows are aligned (checked as it runs), the row's sum
/// gathered by shuffles; elsewhere a quad of threads a row, as the
/// two-pass `dQ` pass makes it.
pub(super) fn delta_pass(c: &Ctx) -> Pass {
    use AttentionBuffer::*;
    let k = c.k;
    let vd = k.value_dim;
    let lanes = vd / 8;
    let contiguous = [Out, OutGrad]
        .iter()
        .all(|&r| k.operand(r).expect("an operand").at.strides[3] == Size::Const(1));
    let mut body = decompose(k.heads, k.q_len, "i0", ROWS);
    // At least two threads a row, so that every thread of the block takes
    // the same count of rows' parts (64 · lanes a multiple of 128).
    let vector =
        contiguous && vd % 8 == 0 && (2..=32).contains(&lanes) && (lanes as u64).is_power_of_two();
    if !vector {
        body.extend(warp_rows("i0"));
        body.push(array("float", "delta", 2));
        body.push(unrolled("r", 2, row_delta(c)));
        return Pass::tiles(
            tile_items(k.q_len, k.batch, k.heads, ROWS),
            body,
            128,
            vec![],
        );
    }
    let (b, h) = (id("b"), id("hh"));
    let part = bin("*", id("part"), ll(8));
    let row_at = |role: AttentionBuffer| {
        C::Ref(Box::new(at(
            c.buf(role),
            c.addr(role, b.clone(), h.clone(), id("qi"), part.clone()),
        )))
    };
    let mut live = vec![
        decl("dplc_t*", "po", row_at(Out)),
        decl("dplc_t*", "pd", row_at(OutGrad)),
        S::Line("__align__(16) dplc_t wo[8];".into()),
        S::Line("__align__(16) dplc_t wd[8];".into()),
        S::Line(
            "if (((((unsigned long long)po) | ((unsigned long long)pd)) & 15ULL) == 0ULL) { \
             *reinterpret_cast<uint4*>(wo) = *reinterpret_cast<const uint4*>(po); \
             *reinterpret_cast<uint4*>(wd) = *reinterpret_cast<const uint4*>(pd); } \
             else { for (int x = 0; x < 8; ++x) { wo[x] = po[x]; wd[x] = pd[x]; } }"
                .into(),
        ),
    ];
    live.push(unrolled(
        "x",
        8,
        vec![add_to(
            id("dsum"),
            bin(
                "*",
                call("dplc_ld", vec![ix("wd", id("x"))]),
                call("dplc_ld", vec![ix("wo", id("x"))]),
            ),
        )],
    ));
    let mut per_row = vec![
        decl(
            "long long",
            "qi",
            bin("+", id("i0"), bin("/", id("e"), ll(lanes))),
        ),
        decl("long long", "part", bin("%", id("e"), ll(lanes))),
        var("float", "dsum", Some(zero())),
        S::If(bin("<", id("qi"), size(k.q_len)), live),
    ];
    // The row's lanes are `lanes` neighbours of one warp (`e` steps by the
    // block, a multiple of 32), so a butterfly over them sums the row.
    let mut o = lanes / 2;
    while o >= 1 {
        per_row.push(add_to(
            id("dsum"),
            call(
                "__shfl_xor_sync",
                vec![
                    C::Lit("0xffffffffu".into()),
                    id("dsum"),
                    C::Lit(o.to_string()),
                ],
            ),
        ));
        o /= 2;
    }
    per_row.push(S::If(
        bin(
            "&&",
            bin("==", id("part"), ll(0)),
            bin("<", id("qi"), size(k.q_len)),
        ),
        vec![set(
            at(c.buf(Delta), c.lse_at(b.clone(), h.clone(), id("qi"))),
            id("dsum"),
        )],
    ));
    // Every thread takes the same count of rows' parts: whole warps shuffle.
    body.push(loop_over(
        "e",
        thread(),
        ll(ROWS * lanes),
        C::Cast("long long", Box::new(id("blockDim.x"))),
        per_row,
    ));
    Pass::tiles(
        tile_items(k.q_len, k.batch, k.heads, ROWS),
        body,
        128,
        vec![],
    )
}

/// The one-pass backward's last pass: `dQ` = scale · its `f32` sum, a block
/// a 64-row tile, each thread four neighbouring features of a row (one
/// 16-byte load of the sum on the GPU, whose allocations are aligned; one
/// at a time in a host emulation), `dQ`'s elements stored one by one.
pub(super) fn query_grad_scale(c: &Ctx) -> Pass {
    use AttentionBuffer::*;
    let k = c.k;
    let hd = k.head_dim;
    let quads = hd / 4;
    let mut body = decompose(k.heads, k.q_len, "i0", ROWS);
    let sum_at = bin(
        "+",
        bin("*", c.lse_at(id("b"), id("hh"), id("qi")), ll(hd)),
        id("d0"),
    );
    let mut live = vec![
        decl(
            "float*",
            "src",
            C::Ref(Box::new(at(c.buf(QGradSum), sum_at))),
        ),
        array("float", "v", 4),
        S::Line("#ifdef __CUDA_ARCH__".into()),
        S::Line(
            "if ((((unsigned long long)src) & 15ULL) == 0ULL) { \
             const float4 w = *reinterpret_cast<const float4*>(src); \
             v[0] = w.x; v[1] = w.y; v[2] = w.z; v[3] = w.w; } \
             else { for (int x = 0; x < 4; ++x) v[x] = src[x]; }"
                .into(),
        ),
        S::Line("#else".into()),
        S::Line("for (int x = 0; x < 4; ++x) v[x] = src[x];".into()),
        S::Line("#endif".into()),
    ];
    live.push(unrolled(
        "x",
        4,
        vec![c.store(
            QGrad,
            id("b"),
            id("hh"),
            id("qi"),
            bin("+", id("d0"), id("x")),
            bin("*", ix("v", id("x")), f32_lit(k.scale)),
        )],
    ));
    body.push(loop_over(
        "e",
        thread(),
        ll(ROWS * quads),
        C::Cast("long long", Box::new(id("blockDim.x"))),
        vec![
            decl(
                "long long",
                "qi",
                bin("+", id("i0"), bin("/", id("e"), ll(quads))),
            ),
            decl(
                "long long",
                "d0",
                bin("*", bin("%", id("e"), ll(quads)), ll(4)),
            ),
            S::If(bin("<", id("qi"), size(k.q_len)), live),
        ],
    ));
    Pass::tiles(
        tile_items(k.q_len, k.batch, k.heads, ROWS),
        body,
        128,
        vec![],
    )
}

/// `dQ += dS·K` for the query tile at `i0` of head `h` against the block's
/// 64 keys, through [`mma_cols`]: A the shared `dS[query][key]` tile (rows
/// `dstride` apart), B the block's K rows (`kown`, rows `kstride` apart);
/// each warp's `16 × 8·n` share (a 16-query block, `n` column blocks from
/// `c0`) added into the `f32` sum of `dQ` (row-major `[b, h, i, d]`) two
/// columns an atomic add.
pub(super) fn query_grad_share(c: &Ctx, t: i64, keys: i64, kstride: i64) -> S {
    let k = c.k;
    let dstride = score_grad_stride(keys);
    let n = query_grad_split(t, k.head_dim, keys / 16).expect("the tiling checked the split");
    let warp = bin("/", thread(), ll(32));
    let mut out = vec![
        decl("long long", "qb", bin("%", warp.clone(), ll(t / 16))),
        decl(
            "long long",
            "c0",
            bin("*", bin("/", warp, ll(t / 16)), ll(n * 8)),
        ),
        array("float", "dqs", n * 4),
        unrolled("x", n * 4, vec![set(ix("dqs", id("x")), zero())]),
        mma_cols(
            "dqs",
            ColsA::Shared("dsbuf", dstride, bin("*", id("qb"), ll(16))),
            "kown",
            kstride,
            (keys, n * 8, Some(id("c0"))),
        ),
    ];
    // Rows g and g + 8 of the warp's 16, columns 2·tq and 2·tq + 1 of each
    // block: one pair an add (sm_90's vector atomics; two adds elsewhere).
    let qi = query_of_share(bin("*", id("r"), ll(8)));
    let at_sum = in_sum(c, bin("*", id("tq"), ll(2)));
    let sum = c.buf(AttentionBuffer::QGradSum);
    let v = |x: i64| {
        ix(
            "dqs",
            bin(
                "+",
                bin("+", bin("*", id("nb"), ll(4)), bin("*", id("r"), ll(2))),
                ll(x),
            ),
        )
    };
    let add_pair = vec![
        var(
            "float*",
            "dst",
            Some(C::Ref(Box::new(at(sum.clone(), at_sum)))),
        ),
        S::Line("#if __CUDA_ARCH__ >= 900".into()),
        S::Expr(call(
            "atomicAdd",
            vec![
                C::Cast("float2*", Box::new(id("dst"))),
                call("make_float2", vec![v(0), v(1)]),
            ],
        )),
        S::Line("#else".into()),
        S::Expr(call("atomicAdd", vec![id("dst"), v(0)])),
        S::Expr(call(
            "atomicAdd",
            vec![bin("+", id("dst"), C::Lit("1".into())), v(1)],
        )),
        S::Line("#endif".into()),
    ];
    if c.tuning.dq_lanes == 4 {
        out.push(unrolled("nb", n, quad_add(c, sum)));
        return S::Block(out);
    }
    out.push(unrolled(
        "r",
        2,
        vec![
            decl("long long", "qi", qi),
            S::If(
                bin("<", id("qi"), size(k.q_len)),
                vec![unrolled("nb", n, add_pair)],
            ),
        ],
    ));
    S::Block(out)
}

/// Column block `nb` of a warp's `dQ` share added four columns an atomic
/// add ([`AttentionTuning::dq_lanes`] 4): lanes `tq` and `tq ^ 1` trade
/// the pair of columns the other adds — the even lane takes row `g`'s
/// columns `2·tq … 2·tq + 3`, the odd lane row `g + 8`'s `2·tq − 2 … 2·tq +
/// 1` — every lane shuffling before any tests its row.
fn quad_add(c: &Ctx, sum: C) -> Vec<S> {
    let k = c.k;
    let own = |r: i64, x: i64| ix("dqs", bin("+", bin("*", id("nb"), ll(4)), ll(2 * r + x)));
    let shfl = |v: C| {
        call(
            "__shfl_xor_sync",
            vec![C::Lit("0xffffffffu".into()), v, C::Lit("1".into())],
        )
    };
    let odd = id("odd");
    let pick = |a: C, b: C| C::Cond(Box::new(odd.clone()), Box::new(a), Box::new(b));
    let qi = query_of_share(pick(ll(8), ll(0)));
    let at_sum = in_sum(c, bin("-", bin("*", id("tq"), ll(2)), pick(ll(2), ll(0))));
    // The four columns in order: the odd lane's come from the even lane
    // first, the even lane's from the odd lane last.
    let lanes = [
        pick(id("o0"), own(0, 0)),
        pick(id("o1"), own(0, 1)),
        pick(own(1, 0), id("o0")),
        pick(own(1, 1), id("o1")),
    ];
    let mut add = vec![
        var("float*", "dst", Some(C::Ref(Box::new(at(sum, at_sum))))),
        S::Line("#if __CUDA_ARCH__ >= 900".into()),
        S::Expr(call(
            "atomicAdd",
            vec![
                C::Cast("float4*", Box::new(id("dst"))),
                call("make_float4", lanes.to_vec()),
            ],
        )),
        S::Line("#else".into()),
    ];
    for (i, lane) in lanes.into_iter().enumerate() {
        add.push(S::Expr(call(
            "atomicAdd",
            vec![bin("+", id("dst"), C::Lit(i.to_string())), lane],
        )));
    }
    add.push(S::Line("#endif".into()));
    vec![
        decl("bool", "odd", bin("!=", bin("&", id("tq"), ll(1)), ll(0))),
        // What this lane hands its neighbour: row g + 8's pair from the
        // even lane, row g's from the odd.
        decl("float", "o0", shfl(pick(own(0, 0), own(1, 0)))),
        decl("float", "o1", shfl(pick(own(0, 1), own(1, 1)))),
        decl("long long", "qi", qi),
        S::If(bin("<", id("qi"), size(k.q_len)), add),
    ]
}

/// The query of row `g + below` of the warp's 16-query block `qb` of the
/// tile at `i0`.
fn query_of_share(below: C) -> C {
    bin(
        "+",
        id("i0"),
        bin("+", bin("*", id("qb"), ll(16)), bin("+", id("g"), below)),
    )
}

/// Where query `qi`'s column `c0 + 8·nb + within` lies in dQ's `f32` sum
/// (row-major `[b, h, i, d]`).
fn in_sum(c: &Ctx, within: C) -> C {
    bin(
        "+",
        bin("*", c.lse_at(id("b"), id("h"), id("qi")), ll(c.k.head_dim)),
        bin("+", id("c0"), bin("+", bin("*", id("nb"), ll(8)), within)),
    )
}
