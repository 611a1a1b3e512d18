//! CUDA C for the fused attention through the C writer: FlashAttention-2's
//! forward (a block per 64 queries of one head, key/value tiles staged in
//! shared memory, the online softmax in registers, causal and window tiles
//! skipped, f32 accumulation; for bf16/f16 storage the two block matmuls on
//! tensor cores with `mma.sync.m16n8k16`), and its backward recomputing the
//! scores per tile: `dQ` a block per query tile, `dK`/`dV` a block per key
//! tile summed over the query heads of its key head (for bf16/f16 both
//! passes' block matmuls on tensor cores too), the bias gradient a thread
//! per bias element. Every pass strides over its work items, so any grid is correct.

use crate::attention::{AttentionBuffer, AttentionKernel, AttentionPass};
use crate::cuda::{at, bin, call, decl, float_lit, id, index_with, size, var, Writer, C, S};
use crate::cuda::{CudaSource, LaunchShape};
use crate::kernel::{drop_threshold, Elem, Idx, Size};
use dplc_ir::DType;

/// Rows of a block's own tile (queries, or keys for `dK`/`dV`): one a thread
/// in the scalar kernels, sixteen a warp in the tensor-core forward.
const ROWS: i64 = 64;
/// Static shared memory a block may use.
const SHARED_BYTES: i64 = 48 * 1024;
/// Threads of a block of the bias-gradient pass (a thread an element).
const BIAS_BLOCK: u32 = 256;

/// `{pass}_{dtype}_{hash8}`: the hash covers the description, the pass and the storage type.
pub fn attention_name(k: &AttentionKernel, pass: AttentionPass, dtype: DType) -> String {
    let h =
        crate::kernel::fnv1a(format!("{}\n{}\n{}", dtype.name(), pass.name(), k.text()).as_bytes());
    format!(
        "{}_{}_{:08x}",
        pass.name(),
        dtype.name(),
        (h >> 32) as u32 ^ h as u32
    )
}

/// Whether the forward runs its block matmuls on tensor cores: 16-bit
/// storage, and widths that are whole `m16n8k16` steps.
fn tensor_cores(k: &AttentionKernel, dtype: DType) -> bool {
    matches!(dtype, DType::BF16 | DType::F16)
        && k.head_dim % 16 == 0
        && k.value_dim % 8 == 0
        && k.head_dim <= 256
        && k.value_dim <= 256
}

/// Rows of the tile a scalar block streams through shared memory (`f32`
/// elements of `width` per row): the largest of 64, 32, 16, 8 that fits.
fn streamed_rows(width: i64) -> i64 {
    [64, 32, 16, 8]
        .into_iter()
        .find(|t| 4 * t * (width + 2) <= SHARED_BYTES)
        .unwrap_or(8)
}

fn ll(n: i64) -> C {
    C::Lit(format!("{n}LL"))
}

fn f32_lit(x: f64) -> C {
    float_lit(x)
}

fn zero() -> C {
    C::Lit("0.0f".into())
}

fn neg_inf() -> C {
    float_lit(f64::NEG_INFINITY)
}

fn set(l: C, r: C) -> S {
    S::Assign(l, r)
}

fn add_to(l: C, r: C) -> S {
    S::Assign(l.clone(), bin("+", l, r))
}

fn mul_by(l: C, r: C) -> S {
    S::Assign(l.clone(), bin("*", l, r))
}

fn sync() -> S {
    S::Expr(call("__syncthreads", vec![]))
}

fn thread() -> C {
    C::Cast("long long", Box::new(id("threadIdx.x")))
}

fn array(ty: &'static str, name: &str, len: i64) -> S {
    S::Array {
        ty,
        name: name.into(),
        len: len.max(1) as usize,
        shared: false,
    }
}

fn shared(ty: &'static str, name: &str, len: i64) -> S {
    S::Array {
        ty,
        name: name.into(),
        len: len.max(1) as usize,
        shared: true,
    }
}

fn ix(name: &str, i: C) -> C {
    at(id(name), i)
}

fn loop_over(v: &str, from: C, to: C, step: C, body: Vec<S>) -> S {
    S::For {
        var: v.into(),
        from,
        to,
        step,
        body,
    }
}

/// `for v in 0..n` with a fixed count, unrolled (register arrays stay registers).
fn unrolled(v: &str, n: i64, body: Vec<S>) -> S {
    S::Block(vec![S::Unroll, loop_over(v, ll(0), ll(n), ll(1), body)])
}

/// The grid-stride loop over work items.
fn items_loop(items: C, per_thread: bool, body: Vec<S>) -> S {
    let (from, step) = if per_thread {
        (
            bin(
                "+",
                bin(
                    "*",
                    C::Cast("long long", Box::new(id("blockIdx.x"))),
                    id("blockDim.x"),
                ),
                id("threadIdx.x"),
            ),
            bin(
                "*",
                C::Cast("long long", Box::new(id("gridDim.x"))),
                id("blockDim.x"),
            ),
        )
    } else {
        (
            C::Cast("long long", Box::new(id("blockIdx.x"))),
            C::Cast("long long", Box::new(id("gridDim.x"))),
        )
    };
    loop_over("item", from, items, step, body)
}

/// Rows `[first, first + rows)` of `role` (`width` features, head `head`)
/// staged into shared `name`, zeros past `len`.
struct Tile<'a> {
    name: &'a str,
    role: AttentionBuffer,
    head: C,
    first: C,
    rows: i64,
    width: i64,
    len: Size,
}

/// What every pass's code needs: buffer names, addresses, masks, bias, dropout.
struct Ctx<'k> {
    k: &'k AttentionKernel,
    roles: Vec<AttentionBuffer>,
}

impl Ctx<'_> {
    fn buf(&self, role: AttentionBuffer) -> C {
        let i = self
            .roles
            .iter()
            .position(|&r| r == role)
            .expect("the pass binds the role");
        id(format!("b{i}"))
    }

    /// The element `(b, h, i, d)` of `role`'s operand, as an index.
    fn addr(&self, role: AttentionBuffer, b: C, h: C, i: C, d: C) -> C {
        let op = self.k.operand(role).expect("an operand");
        let mut acc: Option<C> = match op.at.offset {
            Size::Const(0) => None,
            s => Some(size(s)),
        };
        for (x, s) in [b, h, i, d].into_iter().zip(op.at.strides) {
            let term = match s {
                Size::Const(0) => continue,
                Size::Const(1) => x,
                s => bin("*", x, size(s)),
            };
            acc = Some(match acc {
                None => term,
                Some(a) => bin("+", a, term),
            });
        }
        acc.unwrap_or_else(|| ll(0))
    }

    /// The element as `f32`.
    fn load(&self, role: AttentionBuffer, b: C, h: C, i: C, d: C) -> C {
        call(
            "dplc_ld",
            vec![at(self.buf(role), self.addr(role, b, h, i, d))],
        )
    }

    fn store(&self, role: AttentionBuffer, b: C, h: C, i: C, d: C, v: C) -> S {
        set(
            at(self.buf(role), self.addr(role, b, h, i, d)),
            call("dplc_st", vec![v]),
        )
    }

    fn lse_at(&self, b: C, h: C, i: C) -> C {
        let k = self.k;
        bin(
            "+",
            bin("*", bin("+", bin("*", b, size(k.heads)), h), size(k.q_len)),
            i,
        )
    }

    /// Query `i`'s place in the whole sequence, which the masks compare
    /// with a key's ([`AttentionKernel::query_position`]).
    fn query_position(&self, i: &C) -> C {
        index_with(&self.k.query_position, &|a| match a {
            2 => i.clone(),
            _ => unreachable!("a query's place reads only its own index"),
        })
    }

    /// Whether query `i` may not see key `j` (`None`: every key is seen).
    fn masked(&self, i: &C, j: &C) -> Option<C> {
        if !self.k.causal && self.k.window.is_none() {
            return None;
        }
        let i = self.query_position(i);
        let causal = self.k.causal.then(|| bin(">", j.clone(), i.clone()));
        let window = self
            .k
            .window
            .map(|w| bin(">=", bin("-", i.clone(), j.clone()), ll(w)));
        match (causal, window) {
            (Some(a), Some(b)) => Some(bin("||", a, b)),
            (a, b) => a.or(b),
        }
    }

    /// Whether the pair is inside the problem and seen.
    fn visible(&self, i: &C, j: &C) -> C {
        let inside = bin(
            "&&",
            bin("<", i.clone(), size(self.k.q_len)),
            bin("<", j.clone(), size(self.k.k_len)),
        );
        match self.masked(i, j) {
            Some(m) => bin("&&", inside, call("!", vec![m])),
            None => inside,
        }
    }

    /// `score·scale (+ bias)` from the dot product.
    fn scaled(&self, dot: C, b: &C, h: &C, i: &C, j: &C) -> C {
        let s = bin("*", dot, f32_lit(self.k.scale));
        match self.k.bias {
            Some(_) => bin(
                "+",
                s,
                self.load(
                    AttentionBuffer::Bias,
                    b.clone(),
                    h.clone(),
                    i.clone(),
                    j.clone(),
                ),
            ),
            None => s,
        }
    }

    /// The dropout's factor of element `(b, h, i, j)` (`None` without dropout).
    fn keep(&self, b: &C, h: &C, i: &C, j: &C) -> Option<C> {
        let d = self.k.dropout.as_ref()?;
        let bhij = [b, h, i, j];
        let index = index_with(&d.index, &|a| bhij[a].clone());
        let draw = call(
            "dplc_random",
            vec![
                id("seed"),
                C::Lit(format!("{}ULL", d.key.node)),
                size(d.key.layer),
                size(d.key.first_sample),
                size(d.key.per_sample),
                index,
            ],
        );
        Some(C::Cond(
            Box::new(bin("<", draw, f32_lit(drop_threshold(d.p)))),
            Box::new(zero()),
            Box::new(f32_lit(1.0 / (1.0 - d.p))),
        ))
    }

    /// The key tiles of width `t` a block of queries `[i0, i0 + 64)` visits:
    /// `(begin, end)`, causal and window tiles past either end skipped.
    fn key_range(&self, t: i64) -> Vec<S> {
        let k = self.k;
        let placed = k.query_position != Idx::Var(2);
        let begin = match k.window {
            Some(w) => bin(
                "*",
                bin(
                    "/",
                    call(
                        "dplc_imax",
                        vec![bin("-", self.query_position(&id("i0")), ll(w - 1)), ll(0)],
                    ),
                    ll(t),
                ),
                ll(t),
            ),
            None => ll(0),
        };
        // The block's last query sees keys up to its place.
        let last_seen = if placed {
            let last = call(
                "dplc_imin",
                vec![
                    bin("+", id("i0"), ll(ROWS - 1)),
                    bin("-", size(k.q_len), ll(1)),
                ],
            );
            bin("+", self.query_position(&last), ll(1))
        } else {
            bin("+", id("i0"), ll(ROWS))
        };
        let end = if k.causal {
            call("dplc_imin", vec![size(k.k_len), last_seen])
        } else {
            size(k.k_len)
        };
        vec![
            decl("long long", "jbegin", begin),
            decl("long long", "jend", end),
        ]
    }

    /// The query tiles of width `t` a block of keys `[j0, j0 + 64)` visits.
    fn query_range(&self, t: i64) -> Vec<S> {
        let k = self.k;
        // Placed queries (a cp rank's chunks) are not a run of positions:
        // every query tile is visited, the masks drop what is not seen.
        let placed = k.query_position != Idx::Var(2);
        let begin = if k.causal && !placed {
            bin("*", bin("/", id("j0"), ll(t)), ll(t))
        } else {
            ll(0)
        };
        let end = match k.window {
            Some(w) if !placed => call(
                "dplc_imin",
                vec![size(k.q_len), bin("+", id("j0"), ll(ROWS - 1 + w))],
            ),
            _ => size(k.q_len),
        };
        vec![
            decl("long long", "ibegin", begin),
            decl("long long", "iend", end),
        ]
    }

    /// Stage the key and value tile of `rows` keys from `j0` (key head
    /// `kh`) into `kt` and `vt`, between barriers: the block's threads share
    /// both, and the previous tile's readers must be done with them.
    fn stage_key_values(&self, rows: i64, width: i64, value_width: i64) -> Vec<S> {
        let k_len = self.k.k_len;
        vec![
            sync(),
            self.stage(Tile {
                name: "kt",
                role: AttentionBuffer::K,
                head: id("kh"),
                first: id("j0"),
                rows,
                width,
                len: k_len,
            }),
            self.stage(Tile {
                name: "vt",
                role: AttentionBuffer::V,
                head: id("kh"),
                first: id("j0"),
                rows,
                width: value_width,
                len: k_len,
            }),
            sync(),
        ]
    }

    /// Stage a tile of an operand into shared memory as `f32`.
    fn stage(&self, tile: Tile) -> S {
        let Tile {
            name,
            role,
            head,
            first,
            rows,
            width,
            len,
        } = tile;
        let row = bin("+", first, bin("/", id("e"), ll(width)));
        let d = bin("%", id("e"), ll(width));
        let value = C::Cond(
            Box::new(bin("<", row.clone(), size(len))),
            Box::new(self.load(role, id("b"), head, row, d)),
            Box::new(zero()),
        );
        loop_over(
            "e",
            thread(),
            ll(rows * width),
            C::Cast("long long", Box::new(id("blockDim.x"))),
            vec![set(ix(name, id("e")), value)],
        )
    }
}

/// A tile of an operand staged as raw 16-bit storage for the tensor-core
/// passes: `rows` rows from `first` (of `len`) of head `head`, `width`
/// features each, into shared `name` with rows `stride` apart.
struct Tile16 {
    name: &'static str,
    role: AttentionBuffer,
    head: C,
    first: C,
    len: Size,
    rows: i64,
    width: i64,
    stride: i64,
}

impl Ctx<'_> {
    /// Stage `tile`, zeros past its operand's end: eight elements a 16-byte
    /// access where the operand's features are contiguous and the source
    /// row is 16-byte aligned (checked as it runs: a view of a fused buffer
    /// starts where it starts), else one at a time.
    fn stage16(&self, tile: Tile16) -> S {
        let Tile16 {
            name,
            role,
            head,
            first,
            len,
            rows,
            width,
            stride,
        } = tile;
        let contiguous = self.k.operand(role).expect("an operand").at.strides[3] == Size::Const(1);
        let step = C::Cast("long long", Box::new(id("blockDim.x")));
        if !(contiguous && width % 8 == 0 && stride % 8 == 0) {
            let row = bin("/", id("e"), ll(width));
            let d = bin("%", id("e"), ll(width));
            let src = bin("+", first, row.clone());
            return loop_over(
                "e",
                thread(),
                ll(rows * width),
                step,
                vec![set(
                    ix(name, bin("+", bin("*", row, ll(stride)), d.clone())),
                    C::Cond(
                        Box::new(bin("<", src.clone(), size(len))),
                        Box::new(at(self.buf(role), self.addr(role, id("b"), head, src, d))),
                        Box::new(C::Cast("dplc_t", Box::new(C::Lit("0".into())))),
                    ),
                )],
            );
        }
        let per_row = width / 8;
        let row = bin("/", id("e"), ll(per_row));
        let d = bin("*", bin("%", id("e"), ll(per_row)), ll(8));
        let src_row = bin("+", first, row.clone());
        let src = C::Ref(Box::new(at(
            self.buf(role),
            self.addr(role, id("b"), head, id("sr"), id("sd")),
        )));
        let dst = C::Ref(Box::new(ix(
            name,
            bin("+", bin("*", row, ll(stride)), id("sd")),
        )));
        loop_over(
            "e",
            thread(),
            ll(rows * per_row),
            step,
            vec![
                decl("long long", "sr", src_row),
                decl("long long", "sd", d),
                S::Line("uint4 v = make_uint4(0u, 0u, 0u, 0u);".into()),
                S::If(
                    bin("<", id("sr"), size(len)),
                    vec![
                        decl("dplc_t*", "src", src),
                        S::Line(
                            "if ((((unsigned long long)src) & 15ULL) == 0ULL) { v = *reinterpret_cast<const uint4*>(src); } \
                             else { __align__(16) dplc_t w[8]; for (int x = 0; x < 8; ++x) w[x] = src[x]; v = *reinterpret_cast<const uint4*>(w); }"
                                .into(),
                        ),
                    ],
                ),
                S::Line(format!(
                    "*reinterpret_cast<uint4*>({}) = v;",
                    dst.render()
                )),
            ],
        )
    }
}

/// The `item`'s head and tile: `(b, h)` of query heads (or key heads) and the tile's first row.
fn decompose(heads: Size, tiles_of: Size, first: &str) -> Vec<S> {
    let tiles = bin("/", bin("+", size(tiles_of), ll(ROWS - 1)), ll(ROWS));
    vec![
        decl("long long", "tiles", tiles),
        decl("long long", "bh", bin("/", id("item"), id("tiles"))),
        decl(
            "long long",
            first,
            bin("*", bin("%", id("item"), id("tiles")), ll(ROWS)),
        ),
        decl("long long", "b", bin("/", id("bh"), size(heads))),
        decl("long long", "hh", bin("%", id("bh"), size(heads))),
    ]
}

/// Work items of a pass that gives a block each 64-row tile of `len` rows
/// of every head: `⌈len / 64⌉ · batch · heads` ([`AttentionKernel::items`]).
fn tile_items(len: Size, batch: Size, heads: Size) -> C {
    bin(
        "*",
        bin("/", bin("+", size(len), ll(ROWS - 1)), ll(ROWS)),
        bin("*", size(batch), size(heads)),
    )
}

fn params(k: &AttentionKernel, pass: AttentionPass) -> Vec<String> {
    let mut p = Vec::new();
    for (i, b) in k.buffers(pass).iter().enumerate() {
        let c = if b.output { "" } else { "const " };
        let ty = match b.elem {
            Elem::Float => "dplc_t",
            Elem::F32 => "float",
            Elem::I32 => "int",
        };
        p.push(format!("{c}{ty}* __restrict__ b{i}"));
    }
    p.extend((0..k.sizes).map(|n| format!("long long n{n}")));
    if k.dropout.is_some() {
        p.push("unsigned long long seed".into());
    }
    p
}

/// The scalar forward: a thread per query row, key/value tiles in shared memory.
fn forward_scalar(c: &Ctx) -> (Vec<S>, u32) {
    use AttentionBuffer::*;
    let k = c.k;
    let (hd, vd) = (k.head_dim, k.value_dim);
    let t = streamed_rows(hd + vd);
    let (b, h, i) = (id("b"), id("hh"), id("i"));
    let j = bin("+", id("j0"), id("jj"));
    let mut body = decompose(k.heads, k.q_len, "i0");
    body.push(decl("long long", "kh", bin("/", h.clone(), ll(k.group))));
    body.push(decl("long long", "i", bin("+", id("i0"), thread())));
    body.push(decl("int", "live", bin("<", i.clone(), size(k.q_len))));
    body.push(array("float", "q", hd));
    body.push(array("float", "o", vd));
    body.push(unrolled(
        "d",
        hd,
        vec![set(
            ix("q", id("d")),
            C::Cond(
                Box::new(id("live")),
                Box::new(c.load(Q, b.clone(), h.clone(), i.clone(), id("d"))),
                Box::new(zero()),
            ),
        )],
    ));
    body.push(unrolled("d", vd, vec![set(ix("o", id("d")), zero())]));
    body.push(var("float", "m", Some(neg_inf())));
    body.push(var("float", "l", Some(zero())));
    body.extend(c.key_range(t));
    let mut tile = c.stage_key_values(t, hd, vd);
    // Scores of the tile, their maximum.
    let mut score = vec![var("float", "dot", Some(zero()))];
    score.push(unrolled(
        "d",
        hd,
        vec![add_to(
            id("dot"),
            bin(
                "*",
                ix("q", id("d")),
                ix("kt", bin("+", bin("*", id("jj"), ll(hd)), id("d"))),
            ),
        )],
    ));
    score.push(set(id("v"), c.scaled(id("dot"), &b, &h, &i, &id("j"))));
    let mut online = vec![array("float", "s", t), var("float", "mx", Some(neg_inf()))];
    online.push(loop_over(
        "jj",
        ll(0),
        ll(t),
        ll(1),
        vec![
            decl("long long", "j", j.clone()),
            var("float", "v", Some(neg_inf())),
            S::If(c.visible(&i, &id("j")), score),
            set(ix("s", id("jj")), id("v")),
            set(id("mx"), call("fmaxf", vec![id("mx"), id("v")])),
        ],
    ));
    online.push(decl("float", "mn", call("fmaxf", vec![id("m"), id("mx")])));
    let mut update = vec![
        decl(
            "float",
            "alpha",
            call("expf", vec![bin("-", id("m"), id("mn"))]),
        ),
        mul_by(id("l"), id("alpha")),
        unrolled("d", vd, vec![mul_by(ix("o", id("d")), id("alpha"))]),
    ];
    let mut per_key = vec![
        decl("long long", "j", j),
        decl(
            "float",
            "e",
            call("expf", vec![bin("-", ix("s", id("jj")), id("mn"))]),
        ),
        add_to(id("l"), id("e")),
    ];
    let w = match c.keep(&b, &h, &i, &id("j")) {
        Some(keep) => bin("*", id("e"), keep),
        None => id("e"),
    };
    per_key.push(decl("float", "w", w));
    per_key.push(S::If(
        bin("!=", id("w"), zero()),
        vec![unrolled(
            "d",
            vd,
            vec![add_to(
                ix("o", id("d")),
                bin(
                    "*",
                    id("w"),
                    ix("vt", bin("+", bin("*", id("jj"), ll(vd)), id("d"))),
                ),
            )],
        )],
    ));
    update.push(loop_over("jj", ll(0), ll(t), ll(1), per_key));
    update.push(set(id("m"), id("mn")));
    online.push(S::If(bin("!=", id("mn"), neg_inf()), update));
    tile.push(S::If(id("live"), online));
    body.push(loop_over("j0", id("jbegin"), id("jend"), ll(t), tile));
    let inv = C::Cond(
        Box::new(bin(">", id("l"), zero())),
        Box::new(bin("/", C::Lit("1.0f".into()), id("l"))),
        Box::new(zero()),
    );
    let lse = C::Cond(
        Box::new(bin(">", id("l"), zero())),
        Box::new(bin("+", id("m"), call("logf", vec![id("l")]))),
        Box::new(neg_inf()),
    );
    body.push(S::If(
        id("live"),
        vec![
            decl("float", "inv", inv),
            unrolled(
                "d",
                vd,
                vec![c.store(
                    Out,
                    b.clone(),
                    h.clone(),
                    i.clone(),
                    id("d"),
                    bin("*", ix("o", id("d")), id("inv")),
                )],
            ),
            set(at(c.buf(LogSumExp), c.lse_at(b, h, i)), lse),
        ],
    ));
    let items = tile_items(k.q_len, k.batch, k.heads);
    let out = vec![
        shared("float", "kt", t * hd),
        shared("float", "vt", t * vd),
        items_loop(items, false, body),
    ];
    (out, ROWS as u32)
}

/// `Δ_i = dO_i · O_i` of query `i` of head `h`, read from memory.
fn delta(c: &Ctx, b: &C, h: &C, i: &C) -> Vec<S> {
    use AttentionBuffer::*;
    vec![
        var("float", "delta", Some(zero())),
        unrolled(
            "d",
            c.k.value_dim,
            vec![add_to(
                id("delta"),
                bin(
                    "*",
                    c.load(OutGrad, b.clone(), h.clone(), i.clone(), id("d")),
                    c.load(Out, b.clone(), h.clone(), i.clone(), id("d")),
                ),
            )],
        ),
    ]
}

/// `ds` of pair `(i, j)` given `dot` (Q·K), `dp` (dO·V), the row's `lse` and `delta`:
/// the statements leave `p`, `pk` (dropped) and `ds` declared.
fn pair(c: &Ctx, b: &C, h: &C, i: &C, j: &C, lse: C, delta: C) -> Vec<S> {
    let mut out = vec![decl(
        "float",
        "p",
        call("expf", vec![bin("-", c.scaled(id("dot"), b, h, i, j), lse)]),
    )];
    let keep = c.keep(b, h, i, j);
    out.push(decl("float", "kp", keep.unwrap_or(C::Lit("1.0f".into()))));
    out.push(decl("float", "pk", bin("*", id("p"), id("kp"))));
    out.push(decl(
        "float",
        "ds",
        bin("*", id("p"), bin("-", bin("*", id("dp"), id("kp")), delta)),
    ));
    out
}

/// The scalar `dQ` pass: a thread per query row.
fn query_grad(c: &Ctx) -> (Vec<S>, u32) {
    use AttentionBuffer::*;
    let k = c.k;
    let (hd, vd) = (k.head_dim, k.value_dim);
    let t = streamed_rows(hd + vd);
    let (b, h, i) = (id("b"), id("hh"), id("i"));
    let mut body = decompose(k.heads, k.q_len, "i0");
    body.push(decl("long long", "kh", bin("/", h.clone(), ll(k.group))));
    body.push(decl("long long", "i", bin("+", id("i0"), thread())));
    body.push(decl("int", "live", bin("<", i.clone(), size(k.q_len))));
    body.push(array("float", "q", hd));
    body.push(array("float", "go", vd));
    body.push(array("float", "acc", hd));
    body.push(var("float", "delta", Some(zero())));
    body.push(var("float", "lse", Some(neg_inf())));
    let mut row = vec![
        unrolled(
            "d",
            hd,
            vec![set(
                ix("q", id("d")),
                c.load(Q, b.clone(), h.clone(), i.clone(), id("d")),
            )],
        ),
        unrolled(
            "d",
            vd,
            vec![set(
                ix("go", id("d")),
                c.load(OutGrad, b.clone(), h.clone(), i.clone(), id("d")),
            )],
        ),
    ];
    row.extend(delta(c, &b, &h, &i).into_iter().skip(1));
    row.push(set(
        id("lse"),
        at(c.buf(LogSumExp), c.lse_at(b.clone(), h.clone(), i.clone())),
    ));
    body.push(S::If(id("live"), row));
    body.push(unrolled("d", hd, vec![set(ix("acc", id("d")), zero())]));
    body.extend(c.key_range(t));
    let j = id("j");
    let mut inner = vec![
        var("float", "dot", Some(zero())),
        var("float", "dp", Some(zero())),
    ];
    inner.push(unrolled(
        "d",
        hd,
        vec![add_to(
            id("dot"),
            bin(
                "*",
                ix("q", id("d")),
                ix("kt", bin("+", bin("*", id("jj"), ll(hd)), id("d"))),
            ),
        )],
    ));
    inner.push(unrolled(
        "d",
        vd,
        vec![add_to(
            id("dp"),
            bin(
                "*",
                ix("go", id("d")),
                ix("vt", bin("+", bin("*", id("jj"), ll(vd)), id("d"))),
            ),
        )],
    ));
    inner.extend(pair(c, &b, &h, &i, &j, id("lse"), id("delta")));
    inner.push(unrolled(
        "d",
        hd,
        vec![add_to(
            ix("acc", id("d")),
            bin(
                "*",
                id("ds"),
                ix("kt", bin("+", bin("*", id("jj"), ll(hd)), id("d"))),
            ),
        )],
    ));
    let per_key = vec![
        decl("long long", "j", bin("+", id("j0"), id("jj"))),
        S::If(c.visible(&i, &j), inner),
    ];
    let mut tile = c.stage_key_values(t, hd, vd);
    tile.push(S::If(
        bin("&&", id("live"), bin("!=", id("lse"), neg_inf())),
        vec![loop_over("jj", ll(0), ll(t), ll(1), per_key)],
    ));
    body.push(loop_over("j0", id("jbegin"), id("jend"), ll(t), tile));
    body.push(S::If(
        id("live"),
        vec![unrolled(
            "d",
            hd,
            vec![c.store(
                QGrad,
                b.clone(),
                h.clone(),
                i.clone(),
                id("d"),
                bin("*", ix("acc", id("d")), f32_lit(k.scale)),
            )],
        )],
    ));
    let items = tile_items(k.q_len, k.batch, k.heads);
    let out = vec![
        shared("float", "kt", t * hd),
        shared("float", "vt", t * vd),
        items_loop(items, false, body),
    ];
    (out, ROWS as u32)
}

/// The scalar `dK`/`dV` pass: a thread per key row of one key head, over
/// the query heads that share it and their query tiles.
fn key_value_grad(c: &Ctx) -> (Vec<S>, u32) {
    use AttentionBuffer::*;
    let k = c.k;
    let (hd, vd) = (k.head_dim, k.value_dim);
    let t = streamed_rows(hd + vd);
    let (b, h, j) = (id("b"), id("h"), id("j"));
    let mut body = decompose(k.kv_heads, k.k_len, "j0");
    body.push(decl("long long", "kh", id("hh")));
    body.push(decl("long long", "j", bin("+", id("j0"), thread())));
    body.push(decl("int", "live", bin("<", j.clone(), size(k.k_len))));
    body.push(array("float", "kr", hd));
    body.push(array("float", "vr", vd));
    body.push(array("float", "dk", hd));
    body.push(array("float", "dv", vd));
    body.push(unrolled(
        "d",
        hd,
        vec![
            set(
                ix("kr", id("d")),
                C::Cond(
                    Box::new(id("live")),
                    Box::new(c.load(K, b.clone(), id("kh"), j.clone(), id("d"))),
                    Box::new(zero()),
                ),
            ),
            set(ix("dk", id("d")), zero()),
        ],
    ));
    body.push(unrolled(
        "d",
        vd,
        vec![
            set(
                ix("vr", id("d")),
                C::Cond(
                    Box::new(id("live")),
                    Box::new(c.load(V, b.clone(), id("kh"), j.clone(), id("d"))),
                    Box::new(zero()),
                ),
            ),
            set(ix("dv", id("d")), zero()),
        ],
    ));
    body.extend(c.query_range(t));
    let i = id("i");
    // Per query row of the tile: its log-sum-exp and Δ, staged once.
    let mut rowstats = vec![
        decl("long long", "i", bin("+", id("i0"), id("r"))),
        set(ix("lt", id("r")), neg_inf()),
        set(ix("dt", id("r")), zero()),
    ];
    let mut live_row = delta(c, &b, &h, &i);
    live_row.push(set(ix("dt", id("r")), id("delta")));
    live_row.push(set(
        ix("lt", id("r")),
        at(c.buf(LogSumExp), c.lse_at(b.clone(), h.clone(), i.clone())),
    ));
    rowstats.push(S::If(bin("<", i.clone(), size(k.q_len)), live_row));
    let mut inner = vec![
        var("float", "dot", Some(zero())),
        var("float", "dp", Some(zero())),
    ];
    inner.push(unrolled(
        "d",
        hd,
        vec![add_to(
            id("dot"),
            bin(
                "*",
                ix("qt", bin("+", bin("*", id("r"), ll(hd)), id("d"))),
                ix("kr", id("d")),
            ),
        )],
    ));
    inner.push(unrolled(
        "d",
        vd,
        vec![add_to(
            id("dp"),
            bin(
                "*",
                ix("gt", bin("+", bin("*", id("r"), ll(vd)), id("d"))),
                ix("vr", id("d")),
            ),
        )],
    ));
    inner.extend(pair(
        c,
        &b,
        &h,
        &i,
        &j,
        ix("lt", id("r")),
        ix("dt", id("r")),
    ));
    inner.push(unrolled(
        "d",
        vd,
        vec![add_to(
            ix("dv", id("d")),
            bin(
                "*",
                id("pk"),
                ix("gt", bin("+", bin("*", id("r"), ll(vd)), id("d"))),
            ),
        )],
    ));
    inner.push(unrolled(
        "d",
        hd,
        vec![add_to(
            ix("dk", id("d")),
            bin(
                "*",
                id("ds"),
                ix("qt", bin("+", bin("*", id("r"), ll(hd)), id("d"))),
            ),
        )],
    ));
    let per_query = vec![
        decl("long long", "i", bin("+", id("i0"), id("r"))),
        S::If(
            bin(
                "&&",
                c.visible(&i, &j),
                bin("!=", ix("lt", id("r")), neg_inf()),
            ),
            inner,
        ),
    ];
    let tile = vec![
        sync(),
        c.stage(Tile {
            name: "qt",
            role: Q,
            head: h.clone(),
            first: id("i0"),
            rows: t,
            width: hd,
            len: k.q_len,
        }),
        c.stage(Tile {
            name: "gt",
            role: OutGrad,
            head: h.clone(),
            first: id("i0"),
            rows: t,
            width: vd,
            len: k.q_len,
        }),
        loop_over(
            "r",
            thread(),
            ll(t),
            C::Cast("long long", Box::new(id("blockDim.x"))),
            rowstats,
        ),
        sync(),
        S::If(
            id("live"),
            vec![loop_over("r", ll(0), ll(t), ll(1), per_query)],
        ),
    ];
    let heads = loop_over(
        "g",
        ll(0),
        ll(k.group),
        ll(1),
        vec![
            decl(
                "long long",
                "h",
                bin("+", bin("*", id("kh"), ll(k.group)), id("g")),
            ),
            loop_over("i0", id("ibegin"), id("iend"), ll(t), tile),
        ],
    );
    body.push(heads);
    body.push(S::If(
        id("live"),
        vec![
            unrolled(
                "d",
                hd,
                vec![c.store(
                    KGrad,
                    b.clone(),
                    id("kh"),
                    j.clone(),
                    id("d"),
                    bin("*", ix("dk", id("d")), f32_lit(k.scale)),
                )],
            ),
            unrolled(
                "d",
                vd,
                vec![c.store(VGrad, b, id("kh"), j, id("d"), ix("dv", id("d")))],
            ),
        ],
    ));
    let items = tile_items(k.k_len, k.batch, k.kv_heads);
    let out = vec![
        shared("float", "qt", t * hd),
        shared("float", "gt", t * vd),
        shared("float", "lt", t),
        shared("float", "dt", t),
        items_loop(items, false, body),
    ];
    (out, ROWS as u32)
}

/// The bias gradient: a thread per element the bias holds, summing the
/// score gradients over the axes it broadcasts along (row-major).
fn bias_grad(c: &Ctx) -> (Vec<S>, u32) {
    use AttentionBuffer::*;
    let k = c.k;
    let bias = k.bias.as_ref().expect("a bias");
    let extent = [k.batch, k.heads, k.q_len, k.k_len];
    let names = ["b", "h", "i", "j"];
    let broadcast: Vec<bool> = bias
        .at
        .strides
        .iter()
        .map(|s| *s == Size::Const(0))
        .collect();
    let mut body = vec![var("long long", "rest", Some(id("item")))];
    for a in (0..4).rev() {
        let name = format!("o{}", names[a]);
        if broadcast[a] {
            body.push(decl("long long", name, ll(0)));
        } else {
            body.push(decl(
                "long long",
                name,
                bin("%", id("rest"), size(extent[a])),
            ));
            body.push(set(id("rest"), bin("/", id("rest"), size(extent[a]))));
        }
    }
    body.push(var("float", "acc", Some(zero())));
    let (b, h, i, j) = (id("b"), id("h"), id("i"), id("j"));
    let mut inner = vec![
        decl(
            "float",
            "lse",
            at(c.buf(LogSumExp), c.lse_at(b.clone(), h.clone(), i.clone())),
        ),
        decl("long long", "kh", bin("/", h.clone(), ll(k.group))),
        var("float", "dot", Some(zero())),
        var("float", "dp", Some(zero())),
    ];
    inner.extend(delta(c, &b, &h, &i));
    inner.push(unrolled(
        "d",
        k.head_dim,
        vec![add_to(
            id("dot"),
            bin(
                "*",
                c.load(Q, b.clone(), h.clone(), i.clone(), id("d")),
                c.load(K, b.clone(), id("kh"), j.clone(), id("d")),
            ),
        )],
    ));
    inner.push(unrolled(
        "d",
        k.value_dim,
        vec![add_to(
            id("dp"),
            bin(
                "*",
                c.load(OutGrad, b.clone(), h.clone(), i.clone(), id("d")),
                c.load(V, b.clone(), id("kh"), j.clone(), id("d")),
            ),
        )],
    ));
    let mut seen = pair(c, &b, &h, &i, &j, id("lse"), id("delta"));
    seen.push(add_to(id("acc"), id("ds")));
    inner.push(S::If(bin("!=", id("lse"), neg_inf()), seen));
    let mut walk = vec![S::If(c.visible(&i, &j), inner)];
    for a in (0..4).rev() {
        let (n, o) = (names[a], format!("o{}", names[a]));
        let s = format!("s{n}");
        let to = if broadcast[a] { size(extent[a]) } else { ll(1) };
        walk = vec![loop_over(
            &s,
            ll(0),
            to,
            ll(1),
            [
                vec![decl("long long", n, bin("+", id(o), id(s.as_str())))],
                walk,
            ]
            .concat(),
        )];
    }
    body.extend(walk);
    body.push(c.store(BiasGrad, id("ob"), id("oh"), id("oi"), id("oj"), id("acc")));
    let mut items: Option<C> = None;
    for a in 0..4 {
        if !broadcast[a] {
            items = Some(match items {
                None => size(extent[a]),
                Some(x) => bin("*", x, size(extent[a])),
            });
        }
    }
    (
        vec![items_loop(items.unwrap_or_else(|| ll(1)), true, body)],
        BIAS_BLOCK,
    )
}

/// Tensor-core helpers: one `m16n8k16` step with f32 accumulators, and two
/// floats packed into the storage type's pair (the lower column in the low half).
const MMA_BF16: &str = r#"#ifndef DPLC_MMA
#define DPLC_MMA
__device__ __forceinline__ void dplc_mma(float* c, const unsigned* a, unsigned b0, unsigned b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
__device__ __forceinline__ unsigned dplc_pack(float lo, float hi) {
    unsigned r; asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo)); return r;
}
#endif
"#;

const MMA_F16: &str = r#"#ifndef DPLC_MMA
#define DPLC_MMA
__device__ __forceinline__ void dplc_mma(float* c, const unsigned* a, unsigned b0, unsigned b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
__device__ __forceinline__ unsigned dplc_pack(float lo, float hi) {
    unsigned r; asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo)); return r;
}
#endif
"#;

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
fn forward_mma(c: &Ctx) -> (Vec<S>, u32) {
    use AttentionBuffer::*;
    let k = c.k;
    let (hd, vd) = (k.head_dim, k.value_dim);
    // Key rows per tile: K and V tiles of 16-bit elements (K rows padded by
    // 8 against bank conflicts) within the shared memory.
    let t = [64i64, 48, 32, 16]
        .into_iter()
        .find(|t| 2 * t * (hd + 8 + vd) <= SHARED_BYTES)
        .unwrap_or(16);
    let kstride = hd + 8;
    let (ns, nv) = (t / 8, vd / 8);
    let (b, h) = (id("b"), id("hh"));
    let mut body = decompose(k.heads, k.q_len, "i0");
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
    body.extend(c.key_range(t));
    // Stage the tiles (raw 16-bit storage; zeros past the last key).
    let stage = |name: &'static str, role: AttentionBuffer, width: i64, stride: i64| {
        c.stage16(Tile16 {
            name,
            role,
            head: id("kh"),
            first: id("j0"),
            len: k.k_len,
            rows: t,
            width,
            stride,
        })
    };
    let mut tile = vec![
        sync(),
        stage("kt", K, hd, kstride),
        stage("vt", V, vd, vd),
        sync(),
        array("float", "s", ns * 4),
    ];
    // S = Q·Kᵀ: B's fragment is two consecutive features of one key.
    tile.push(mma_rows("s", "qf", "kt", kstride, hd, ns));
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
    tile.push(unrolled(
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
                    C::Cond(
                        Box::new(c.visible(&id("qi"), &id("kj"))),
                        Box::new(c.scaled(sx.clone(), &b, &h, &id("qi"), &id("kj"))),
                        Box::new(neg_inf()),
                    ),
                ),
            ],
        )],
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
        call("expf", vec![bin("-", ix("m", id("r")), id("base"))]),
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
            call("expf", vec![bin("-", sr.clone(), id("base"))]),
        ),
        add_to(ix("l", id("r")), id("e")),
    ];
    let qi = ix("row", id("r"));
    let kj = bin(
        "+",
        bin("+", id("j0"), bin("*", id("nb"), ll(8))),
        bin("+", bin("*", id("tq"), ll(2)), id("x")),
    );
    prob.push(set(
        sr,
        match c.keep(&b, &h, &qi, &kj) {
            Some(keep) => bin("*", id("e"), keep),
            None => id("e"),
        },
    ));
    rows.push(unrolled("nb", ns, vec![unrolled("x", 2, prob)]));
    tile.push(unrolled("r", 2, rows));
    // O += P·V: P's fragment for keys [16·kk, 16·kk + 16) is score tiles 2kk and 2kk + 1.
    tile.push(mma_cols("o", "s", "vt", vd, t, vd));
    body.push(loop_over("j0", id("jbegin"), id("jend"), ll(t), tile));
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
                Box::new(bin(
                    "+",
                    ix("m", id("r")),
                    call("logf", vec![ix("l", id("r"))]),
                )),
                Box::new(neg_inf()),
            ),
        )],
    ));
    fin.push(S::If(bin("<", id("qi"), size(k.q_len)), write));
    body.push(unrolled("r", 2, fin));
    let items = tile_items(k.q_len, k.batch, k.heads);
    let out = vec![
        shared("dplc_t", "kt", t * kstride),
        shared("dplc_t", "vt", t * vd),
        items_loop(items, false, body),
    ];
    (out, 128)
}

/// A tensor-core pass's rows: 4 warps of 16 from `first`, this thread's
/// `row[0] = first + 16·warp + g` and `row[1] = row[0] + 8` (`g` = lane / 4,
/// `tq` = lane % 4: a thread holds, of each 16×8 accumulator tile, those
/// rows at columns `2·tq` and `2·tq + 1`).
fn warp_rows(first: &str) -> Vec<S> {
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

/// `acc[nb·4 ..] += A·Bᵀ` for `nb` in `0..tiles`: A the fragments `frag`
/// over `width / 16` steps, B's column `nb·8 + g` the row of the shared
/// tile `tile` (rows `stride` apart) — two consecutive features of one row
/// per register, as [`forward_mma`]'s `S = Q·Kᵀ`.
fn mma_rows(acc: &str, frag: &str, tile: &str, stride: i64, width: i64, tiles: i64) -> S {
    let word = |dofs: i64| {
        at(
            C::Cast(
                "const unsigned*",
                Box::new(C::Ref(Box::new(ix(
                    tile,
                    bin(
                        "+",
                        bin(
                            "*",
                            bin("+", bin("*", id("nb"), ll(8)), id("g")),
                            ll(stride),
                        ),
                        bin(
                            "+",
                            bin("+", bin("*", id("ks"), ll(16)), ll(dofs)),
                            bin("*", id("tq"), ll(2)),
                        ),
                    ),
                )))),
            ),
            ll(0),
        )
    };
    unrolled(
        "nb",
        tiles,
        vec![
            unrolled(
                "x",
                4,
                vec![set(
                    ix(acc, bin("+", bin("*", id("nb"), ll(4)), id("x"))),
                    zero(),
                )],
            ),
            unrolled(
                "ks",
                width / 16,
                vec![S::Expr(call(
                    "dplc_mma",
                    vec![
                        C::Ref(Box::new(ix(acc, bin("*", id("nb"), ll(4))))),
                        C::Ref(Box::new(ix(frag, bin("*", id("ks"), ll(4))))),
                        word(0),
                        word(8),
                    ],
                ))],
            ),
        ],
    )
}

/// `out[nb·4 ..] += P·T` for `nb` in `0..width / 8`: P the accumulator
/// tiles `scores` (keys along columns, packed into A fragments sixteen keys
/// at a time), T the shared tile `tile` (`[key][feature]`, rows `stride`
/// apart) — [`forward_mma`]'s `O += P·V`.
fn mma_cols(out: &str, scores: &str, tile: &str, stride: i64, keys: i64, width: i64) -> S {
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
    let bits = |kofs: i64| {
        let key = bin(
            "+",
            bin("+", bin("*", id("kk"), ll(16)), ll(kofs)),
            bin("*", id("tq"), ll(2)),
        );
        let col = bin("+", bin("*", id("nb"), ll(8)), id("g"));
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
    let mut step = vec![
        array("unsigned", "pf", 4),
        set(ix("pf", ll(0)), call("dplc_pack", vec![p(0, 0), p(0, 1)])),
        set(ix("pf", ll(1)), call("dplc_pack", vec![p(0, 2), p(0, 3)])),
        set(ix("pf", ll(2)), call("dplc_pack", vec![p(1, 0), p(1, 1)])),
        set(ix("pf", ll(3)), call("dplc_pack", vec![p(1, 2), p(1, 3)])),
    ];
    step.push(unrolled(
        "nb",
        width / 8,
        vec![S::Expr(call(
            "dplc_mma",
            vec![
                C::Ref(Box::new(ix(out, bin("*", id("nb"), ll(4))))),
                id("pf"),
                bits(0),
                bits(8),
            ],
        ))],
    ));
    unrolled("kk", keys / 16, step)
}

/// Whether the `dQ` pass runs on tensor cores: the forward's condition,
/// with the value width whole `k16` steps too (`dO·Vᵀ` steps along it).
fn query_grad_tensor_cores(k: &AttentionKernel, dtype: DType) -> bool {
    tensor_cores(k, dtype) && k.value_dim % 16 == 0
}

/// The tensor-core `dQ` pass: 4 warps of 16 query rows, as [`forward_mma`];
/// per key tile `S = Q·Kᵀ` and `dP = dO·Vᵀ` as `m16n8k16` steps, `dS = P ∘
/// (dP·keep − δ)` in their accumulators (P from the saved log-sum-exp),
/// then `dQ += dS·K` with `dS` packed to the storage type as FlashAttention-2
/// packs it. A thread holds rows `g` and `g + 8` of its warp's 16.
fn query_grad_mma(c: &Ctx) -> (Vec<S>, u32) {
    use AttentionBuffer::*;
    let k = c.k;
    let (hd, vd) = (k.head_dim, k.value_dim);
    // Key rows per tile: S and dP hold t / 8 accumulator tiles each, so the
    // wider heads take narrower tiles; K and V staged as 16-bit elements,
    // rows padded by 8 against bank conflicts.
    let (kstride, vstride) = (hd + 8, vd + 8);
    let t = [if hd.max(vd) > 64 { 32 } else { 64 }, 32, 16]
        .into_iter()
        .find(|t| 2 * t * (kstride + vstride) <= SHARED_BYTES)
        .unwrap_or(16);
    let ns = t / 8;
    let (b, h) = (id("b"), id("hh"));
    let mut body = decompose(k.heads, k.q_len, "i0");
    body.push(decl("long long", "kh", bin("/", h.clone(), ll(k.group))));
    body.extend(warp_rows("i0"));
    body.extend(row_fragments(c, Q, (h.clone(), k.q_len), "qf", hd));
    body.extend(row_fragments(c, OutGrad, (h.clone(), k.q_len), "of", vd));
    // Each row's log-sum-exp, and δ = Σ dO ∘ O over the quad sharing it.
    body.push(array("float", "lse", 2));
    body.push(array("float", "delta", 2));
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
    body.push(unrolled(
        "r",
        2,
        vec![
            decl("int", "live", bin("<", qi.clone(), size(k.q_len))),
            var("float", "dsum", Some(zero())),
            S::If(
                id("live"),
                vec![unrolled(
                    "nb",
                    vd / 8,
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
            set(
                ix("lse", id("r")),
                C::Cond(
                    Box::new(id("live")),
                    Box::new(at(
                        c.buf(LogSumExp),
                        c.lse_at(b.clone(), h.clone(), qi.clone()),
                    )),
                    Box::new(neg_inf()),
                ),
            ),
        ],
    ));
    body.push(array("float", "dq", hd / 8 * 4));
    body.push(unrolled(
        "x",
        hd / 8 * 4,
        vec![set(ix("dq", id("x")), zero())],
    ));
    body.extend(c.key_range(t));
    let stage = |name: &'static str, role: AttentionBuffer, width: i64, stride: i64| {
        c.stage16(Tile16 {
            name,
            role,
            head: id("kh"),
            first: id("j0"),
            len: k.k_len,
            rows: t,
            width,
            stride,
        })
    };
    let mut tile = vec![
        sync(),
        stage("kt", K, hd, kstride),
        stage("vt", V, vd, vstride),
        sync(),
        array("float", "s", ns * 4),
        array("float", "dp", ns * 4),
        mma_rows("s", "qf", "kt", kstride, hd, ns),
        mma_rows("dp", "of", "vt", vstride, vd, ns),
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
    let lse_x = ix("lse", bin("/", id("x"), ll(2)));
    let delta_x = ix("delta", bin("/", id("x"), ll(2)));
    tile.push(unrolled(
        "nb",
        ns,
        vec![unrolled(
            "x",
            4,
            vec![
                decl("long long", "qi", qi),
                decl("long long", "kj", kj),
                decl(
                    "float",
                    "p",
                    C::Cond(
                        Box::new(bin(
                            "&&",
                            c.visible(&id("qi"), &id("kj")),
                            bin("!=", lse_x.clone(), neg_inf()),
                        )),
                        Box::new(call(
                            "expf",
                            vec![bin(
                                "-",
                                c.scaled(at_x("s"), &b, &h, &id("qi"), &id("kj")),
                                lse_x,
                            )],
                        )),
                        Box::new(zero()),
                    ),
                ),
                decl(
                    "float",
                    "kp",
                    c.keep(&b, &h, &id("qi"), &id("kj"))
                        .unwrap_or(C::Lit("1.0f".into())),
                ),
                set(
                    at_x("s"),
                    bin(
                        "*",
                        id("p"),
                        bin("-", bin("*", at_x("dp"), id("kp")), delta_x),
                    ),
                ),
            ],
        )],
    ));
    tile.push(mma_cols("dq", "s", "kt", kstride, t, hd));
    body.push(loop_over("j0", id("jbegin"), id("jend"), ll(t), tile));
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
    let items = tile_items(k.q_len, k.batch, k.heads);
    let out = vec![
        shared("dplc_t", "kt", t * kstride),
        shared("dplc_t", "vt", t * vstride),
        items_loop(items, false, body),
    ];
    (out, 128)
}

/// The tensor-core `dK`/`dV` pass: 4 warps of 16 key rows of one key head
/// (64 keys a block), over the query heads that share it and their query
/// tiles: per tile `Sᵀ = K·Qᵀ` and `dPᵀ = V·dOᵀ` as `m16n8k16` steps (keys
/// along rows, queries along columns), then `dV += Pᵀ·dO` with P dropped as
/// the forward dropped it and `dK += dSᵀ·Q`, P and dS packed to the storage
/// type as FlashAttention-2 packs them; each query's log-sum-exp and δ =
/// Σ dO ∘ O staged beside its Q and dO rows.
fn key_value_grad_mma(c: &Ctx) -> (Vec<S>, u32) {
    use AttentionBuffer::*;
    let k = c.k;
    let (hd, vd) = (k.head_dim, k.value_dim);
    let (qstride, ostride) = (hd + 8, vd + 8);
    // Query rows per tile: Sᵀ and dPᵀ hold t / 8 accumulator tiles each
    // beside dK and dV, so the wider heads take narrower tiles.
    let t = [if hd.max(vd) > 64 { 32 } else { 64 }, 32, 16]
        .into_iter()
        .find(|t| 2 * t * (qstride + ostride) + 8 * t <= SHARED_BYTES)
        .unwrap_or(16);
    let ns = t / 8;
    let (b, h) = (id("b"), id("h"));
    let mut body = decompose(k.kv_heads, k.k_len, "j0");
    body.push(decl("long long", "kh", id("hh")));
    body.extend(warp_rows("j0"));
    body.extend(row_fragments(c, K, (id("kh"), k.k_len), "kf", hd));
    body.extend(row_fragments(c, V, (id("kh"), k.k_len), "vf", vd));
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
    // The block's keys are [j0, j0 + 64), as `query_range` takes them.
    body.extend(c.query_range(t));
    let stage = |name: &'static str, role: AttentionBuffer, width: i64, stride: i64| {
        c.stage16(Tile16 {
            name,
            role,
            head: h.clone(),
            first: id("i0"),
            len: k.q_len,
            rows: t,
            width,
            stride,
        })
    };
    // Per query row of the tile: its log-sum-exp and δ, staged once.
    let qi = bin("+", id("i0"), id("q"));
    let mut live_row = delta(c, &b, &h, &id("qi"));
    live_row.push(set(ix("dt", id("q")), id("delta")));
    live_row.push(set(
        ix("lt", id("q")),
        at(c.buf(LogSumExp), c.lse_at(b.clone(), h.clone(), id("qi"))),
    ));
    let rowstats = vec![
        decl("long long", "qi", qi),
        set(ix("lt", id("q")), neg_inf()),
        set(ix("dt", id("q")), zero()),
        S::If(bin("<", id("qi"), size(k.q_len)), live_row),
    ];
    let mut tile = vec![
        sync(),
        stage("qt", Q, hd, qstride),
        stage("ot", OutGrad, vd, ostride),
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
        mma_rows("s", "kf", "qt", qstride, hd, ns),
        mma_rows("dp", "vf", "ot", ostride, vd, ns),
    ];
    // Pᵀ dropped in S's place, dSᵀ in dP's: key `row[x / 2]`, query
    // `i0 + 8·nb + 2·tq + x % 2`.
    let at_x = |name: &str| ix(name, bin("+", bin("*", id("nb"), ll(4)), id("x")));
    let qcol = bin(
        "+",
        bin("*", id("nb"), ll(8)),
        bin("+", bin("*", id("tq"), ll(2)), bin("%", id("x"), ll(2))),
    );
    tile.push(unrolled(
        "nb",
        ns,
        vec![unrolled(
            "x",
            4,
            vec![
                decl("long long", "kj", ix("row", bin("/", id("x"), ll(2)))),
                decl("long long", "qc", qcol),
                decl("long long", "qi", bin("+", id("i0"), id("qc"))),
                decl("float", "lq", ix("lt", id("qc"))),
                decl(
                    "float",
                    "p",
                    C::Cond(
                        Box::new(bin(
                            "&&",
                            c.visible(&id("qi"), &id("kj")),
                            bin("!=", id("lq"), neg_inf()),
                        )),
                        Box::new(call(
                            "expf",
                            vec![bin(
                                "-",
                                c.scaled(at_x("s"), &b, &h, &id("qi"), &id("kj")),
                                id("lq"),
                            )],
                        )),
                        Box::new(zero()),
                    ),
                ),
                decl(
                    "float",
                    "kp",
                    c.keep(&b, &h, &id("qi"), &id("kj"))
                        .unwrap_or(C::Lit("1.0f".into())),
                ),
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
        )],
    ));
    tile.push(mma_cols("dv", "s", "ot", ostride, t, vd));
    tile.push(mma_cols("dk", "dp", "qt", qstride, t, hd));
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
            loop_over("i0", id("ibegin"), id("iend"), ll(t), tile),
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
    let items = tile_items(k.k_len, k.batch, k.kv_heads);
    let out = vec![
        shared("dplc_t", "qt", t * qstride),
        shared("dplc_t", "ot", t * ostride),
        shared("float", "lt", t),
        shared("float", "dt", t),
        items_loop(items, false, body),
    ];
    (out, 128)
}

/// Emit CUDA C for `pass` of `kernel` with float buffers stored as `dtype`.
/// Its launch strides over [`AttentionKernel::items`]: a block of `block`
/// threads per item (`Rows`), or for the bias gradient a thread per item
/// (`Elementwise`).
pub fn emit_attention(kernel: &AttentionKernel, pass: AttentionPass, dtype: DType) -> CudaSource {
    let name = attention_name(kernel, pass, dtype);
    let c = Ctx {
        k: kernel,
        roles: kernel.roles(pass),
    };
    let mma = match pass {
        AttentionPass::Forward => tensor_cores(kernel, dtype),
        AttentionPass::QueryGrad | AttentionPass::KeyValueGrad => {
            query_grad_tensor_cores(kernel, dtype)
        }
        AttentionPass::BiasGrad => false,
    };
    let (body, block) = match pass {
        AttentionPass::Forward if mma => forward_mma(&c),
        AttentionPass::Forward => forward_scalar(&c),
        AttentionPass::QueryGrad if mma => query_grad_mma(&c),
        AttentionPass::QueryGrad => query_grad(&c),
        AttentionPass::KeyValueGrad if mma => key_value_grad_mma(&c),
        AttentionPass::KeyValueGrad => key_value_grad(&c),
        AttentionPass::BiasGrad => bias_grad(&c),
    };
    let mut w = Writer::with_prelude(dtype);
    if mma {
        w.out.push_str(if dtype == DType::BF16 {
            MMA_BF16
        } else {
            MMA_F16
        });
    }
    w.line("");
    w.line(&format!("// {}", pass.name()));
    for l in kernel.signature().lines() {
        w.line(&format!("// {l}"));
    }
    w.line(&format!(
        "extern \"C\" __global__ void __launch_bounds__({block}) {name}("
    ));
    w.depth += 1;
    let p = params(kernel, pass);
    for (i, s) in p.iter().enumerate() {
        let sep = if i + 1 == p.len() { ") {" } else { "," };
        w.line(&format!("{s}{sep}"));
    }
    w.stmts(&body);
    w.depth -= 1;
    w.line("}");
    let launch = match pass {
        AttentionPass::BiasGrad => LaunchShape::Elementwise { vector: 1 },
        _ => LaunchShape::Rows { block },
    };
    CudaSource {
        name,
        source: w.out,
        launch,
    }
}
