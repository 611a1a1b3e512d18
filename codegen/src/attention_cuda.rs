//! CUDA C for the fused attention through the C writer: FlashAttention-2's
//! forward (a block per 64 queries of one head, key/value tiles staged in
//! shared memory, the online softmax in registers, causal and window tiles
//! skipped, f32 accumulation; for bf16/f16 storage the two block matmuls on
//! tensor cores with `mma.sync.m16n8k16`), and its backward recomputing the
//! scores per tile: `dQ` a block per query tile, `dK`/`dV` a block per key
//! tile summed over the query heads of its key head (for bf16/f16 both
//! passes' block matmuls on tensor cores too, in `mma`) — or, where it fits,
//! FlashAttention-2's one pass by key tiles that also adds each tile's
//! share of `dQ` into an `f32` sum, between a δ pass and one that scales
//! the sum (`one_pass`) —, the bias gradient a thread per bias element.
//! Every pass strides over its work items, so any grid is correct. Here:
//! the passes' shared context (addresses, masks, bias, dropout, tile
//! ranges) and the entry point; `scalar` holds the scalar passes, `mma`
//! the tensor-core ones, `one_pass` what the one-pass backward adds.

use crate::attention::{AttentionBackward, AttentionBuffer, AttentionKernel, AttentionPass};
use crate::cuda::{
    at, bin, call, decl, float_lit, grid_thread, id, index_with, size, var, Writer, C, S,
};
use crate::cuda::{CudaSource, LaunchShape};
use crate::kernel::{drop_threshold, Elem, Idx, Size};
use dplc_ir::DType;

mod mma;
mod one_pass;
mod scalar;
mod staging;
use mma::{
    forward_mma, key_value_grad_mma, mma_prelude, query_grad_mma, query_grad_tensor_cores,
    tensor_cores, BACKWARD_WARPS, FORWARD_WARPS,
};
pub use one_pass::attention_backward;
use one_pass::one_pass_fits;
use one_pass::{delta_pass, query_grad_scale};
use scalar::{bias_grad, forward_scalar, key_value_grad, query_grad};

/// Rows of a block's own tile (queries, or keys for `dK`/`dV`): one a thread
/// in the scalar kernels, sixteen a warp in the tensor-core forward.
const ROWS: i64 = 64;
/// Shared memory the backward and scalar passes size their tiles to: the
/// 48 KB a block may take without asking. Their tiles are bounded by
/// registers first (the tensor-core backward keeps `t / 8` accumulator
/// tiles of scores and of their gradients beside its row's gradients).
const SHARED_BYTES: i64 = 48 * 1024;
/// The most shared memory a block of the tensor-core passes takes: under
/// the 99 KB a block may ask for on every part dplc compiles for (A100
/// 163 KB, its sm_86/89 siblings 99, H100/H200 227). The forward sizes its
/// key tiles to it (at head width 128 two double-buffered 64-key tiles of
/// K and V take 68 KB, where 48 KB held 32 keys: twice the barriers and
/// waits a key); the dK/dV pass stages its own K and V rows within it.
const MOST_SHARED_BYTES: i64 = 96 * 1024;
/// The most shared memory a tuned variant's block takes
/// ([`emit_attention_tuned`]): under the A100's 163 KB and the H100's 227
/// KB, the parts the GPU benchmark runs on.
const TUNED_SHARED_BYTES: i64 = 160 * 1024;
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

/// How a pass declares its block's dynamic shared memory ([`carve`]); a
/// host emulation defines the macro first, as a static array of the bytes.
const SHARED_PRELUDE: &str = r#"#ifndef DPLC_DYNAMIC_SHARED
#define DPLC_DYNAMIC_SHARED(name, bytes) extern __shared__ __align__(16) unsigned char name[]
#endif
"#;

/// A pass as it launches: its body, its block's threads, the shared arrays
/// it carves from the block's dynamic shared memory, and, for a pass that
/// asks the assembler for registers few enough that more blocks share a
/// multiprocessor ([`resident_blocks`]), the registers its arrays hold a
/// thread.
struct Pass {
    body: Vec<S>,
    block: u32,
    shared: Vec<Shared>,
    fill: Option<u32>,
}

impl Pass {
    /// A pass whose blocks stride over `items` (a tile each), running `body`.
    fn tiles(items: C, body: Vec<S>, block: u32, shared: Vec<Shared>) -> Pass {
        Pass {
            body: vec![items_loop(items, false, body)],
            block,
            shared,
            fill: None,
        }
    }
}

/// Shared memory a Hopper multiprocessor gives its blocks (227 KB).
const SM_SHARED_BYTES: u32 = 227 * 1024;
/// Registers of a multiprocessor (every part since Volta).
const SM_REGISTERS: u32 = 65536;
/// Registers a thread needs beside its register arrays (addresses, indices,
/// the softmax's temporaries): the fewest ptxas 12.8 fit the forward into
/// at head width 128 under `__launch_bounds__(128, 3)` — 168 for 132 of
/// arrays, 16 bytes spilled.
const REGISTERS_BESIDE_ARRAYS: u32 = 36;

/// The blocks of `block` threads, `shared_bytes` of shared memory and
/// `array_registers` registers of arrays a thread that a multiprocessor
/// holds, at most four: what a filling pass asks of `__launch_bounds__`.
/// Measured on the H200 (bench_attention, run M), the tensor-core forward
/// left to the assembler's choice of registers ran fewer blocks than its
/// shared memory holds: at head width 64 (36 KB, three blocks by its 130
/// registers) four blocks took GPT-2's forward from 0.134 to 0.126 ms and
/// the gpt2 step's micro-batch from 0.738 to 0.670 ms; at 128 (68 KB, two
/// by its 172 registers) three took Llama 2 7B's from 1.998 to 1.628 ms,
/// and four, which neither its shared memory nor its arrays fit, 2.151 ms.
/// The arrays bound it where they are wide (two blocks at width 256: four
/// such threads' arrays alone would not fit a block of 128 registers each).
fn resident_blocks(block: u32, shared_bytes: u32, array_registers: u32) -> u32 {
    let by_shared = SM_SHARED_BYTES / shared_bytes.max(1);
    let by_registers = SM_REGISTERS / (block * (array_registers + REGISTERS_BESIDE_ARRAYS));
    by_shared.min(by_registers).clamp(1, 4)
}

/// An array in a block's shared memory: `len` elements of `ty`, `bytes` each.
struct Shared {
    ty: &'static str,
    bytes: i64,
    name: &'static str,
    len: i64,
}

fn shared(ty: &'static str, bytes: i64, name: &'static str, len: i64) -> Shared {
    Shared {
        ty,
        bytes,
        name,
        len: len.max(1),
    }
}

/// The arrays of `shared` laid out in the block's dynamic shared memory,
/// each from a 16-byte boundary (`cp.async` and `ldmatrix` address whole
/// 16-byte rows): their declarations and the bytes the launch must give.
/// One mechanism for every pass, so a tile past the static 48 KB needs
/// nothing else (the launcher raises the function's limit).
fn carve(shared: &[Shared]) -> (Vec<S>, u32) {
    let mut at_byte = 0i64;
    let mut decls = vec![];
    for s in shared {
        decls.push(S::Line(format!(
            "{}* {} = reinterpret_cast<{}*>(dplc_smem + {at_byte});",
            s.ty, s.name, s.ty
        )));
        at_byte += (s.len * s.bytes + 15) / 16 * 16;
    }
    if at_byte == 0 {
        return (vec![], 0);
    }
    let mut out = vec![S::Line(format!(
        "DPLC_DYNAMIC_SHARED(dplc_smem, {at_byte});"
    ))];
    out.extend(decls);
    (out, at_byte as u32)
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
            grid_thread(),
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
    tuning: AttentionTuning,
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

    /// Whether queries `[i, i + rows)` see every key of `[j, j + cols)`, all
    /// inside the problem: a test a tile makes once, so that its elements
    /// skip their masks (`None` where queries sit at placed positions, which
    /// need not rise with the index: then each element is tested).
    fn all_visible(&self, i: &C, rows: i64, j: &C, cols: i64) -> Option<C> {
        if self.k.query_position != Idx::Var(2) {
            return None;
        }
        let last_i = bin("+", i.clone(), ll(rows - 1));
        let last_j = bin("+", j.clone(), ll(cols - 1));
        let mut all = bin(
            "&&",
            bin("<", last_i.clone(), size(self.k.q_len)),
            bin("<", last_j.clone(), size(self.k.k_len)),
        );
        if self.k.causal {
            all = bin("&&", all, bin("<=", last_j, i.clone()));
        }
        if let Some(w) = self.k.window {
            all = bin("&&", all, bin("<", bin("-", last_i, j.clone()), ll(w)));
        }
        Some(all)
    }

    /// `score·scale (+ bias)` from the dot product.
    fn scaled(&self, dot: C, b: &C, h: &C, i: &C, j: &C) -> C {
        self.scaled_by(dot, 1.0, b, h, i, j)
    }

    /// `(score·scale + bias)·unit` from the dot product, `unit` folded into
    /// the scale (`log2 e` for scores in base 2).
    fn scaled_by(&self, dot: C, unit: f64, b: &C, h: &C, i: &C, j: &C) -> C {
        let s = bin("*", dot, f32_lit(self.k.scale * unit));
        match self.k.bias {
            Some(_) => {
                let bias = self.load(
                    AttentionBuffer::Bias,
                    b.clone(),
                    h.clone(),
                    i.clone(),
                    j.clone(),
                );
                let bias = if unit == 1.0 {
                    bias
                } else {
                    bin("*", bias, f32_lit(unit))
                };
                bin("+", s, bias)
            }
            None => s,
        }
    }

    /// The dropout's factor of element `(b, h, i, j)` (`None` without dropout).
    fn keep(&self, b: &C, h: &C, i: &C, j: &C) -> Option<C> {
        let d = self.k.dropout.as_ref()?;
        let (state, pos) = self.draw_at(b, h, i, j)?;
        Some(self.factor(call("dplc_sample_draw", vec![state, pos]), d.p))
    }

    /// The dropout's factors of elements `(b, h, i, j)` and `(b, h, i, j +
    /// 1)` into `into[at]` and `into[at + 1]` (nothing without dropout):
    /// where their positions are one pair's (`j` even in a row of even
    /// length, the usual case) one mix draws both (`dplc_sample_draw2`).
    /// Neighbouring keys are neighbouring positions wherever the draw's
    /// index steps by one with the key (every placement dplc makes: a
    /// rank's keys are the whole sequence's); elsewhere each draws alone.
    fn keep_pair(&self, b: &C, h: &C, i: &C, j: &C, into: &str, at: C) -> Vec<S> {
        let Some(d) = self.k.dropout.as_ref() else {
            return Vec::new();
        };
        let next = bin("+", j.clone(), ll(1));
        if !self.keys_neighbour() {
            let (Some(k0), Some(k1)) = (self.keep(b, h, i, j), self.keep(b, h, i, &next)) else {
                return Vec::new();
            };
            return vec![
                set(ix(into, at.clone()), k0),
                set(ix(into, bin("+", at, ll(1))), k1),
            ];
        }
        let Some((state, pos)) = self.draw_at(b, h, i, j) else {
            return Vec::new();
        };
        let u = |n: i64| ix("dplc_u", ll(n));
        vec![S::Block(vec![
            array("float", "dplc_u", 2),
            S::Expr(call("dplc_sample_draw2", vec![state, pos, u(0), u(1)])),
            set(ix(into, at.clone()), self.factor(u(0), d.p)),
            set(ix(into, bin("+", at, ll(1))), self.factor(u(1), d.p)),
        ])]
    }

    /// Whether the dropout's index steps by one with the key (`j`), so
    /// neighbouring keys draw at neighbouring positions.
    fn keys_neighbour(&self) -> bool {
        self.k
            .dropout
            .as_ref()
            .is_some_and(|d| d.index.contiguous_in(&Idx::Var(3)).is_some())
    }

    /// The dK/dV pass's dropout factors (nothing without dropout): its
    /// thread holds keys `row[0]`, `row[1]` (of the lane's parity, `g % 2`)
    /// at queries `q` and `q + 1`, so a key pair's draws are split between
    /// it and lane `lane ^ 4` (the other key of each pair, the same
    /// queries). Each lane draws the pairs of one query — `q + g % 2` — for
    /// both its keys, one mix a pair, and the two swap the draws each other
    /// holds: two mixes and two shuffles for four draws, where each had
    /// been a mix. Into `into[2y + x]` for key `row[y]`, query `q + x`.
    /// Where neighbouring keys are not neighbouring positions
    /// ([`Ctx::keys_neighbour`]) nothing: each element draws alone.
    fn keep_swapped(&self, b: &C, h: &C, q: &C, into: &str) -> Vec<S> {
        let Some(d) = self.k.dropout.as_ref().filter(|_| self.keys_neighbour()) else {
            return Vec::new();
        };
        let odd = bin("%", id("g"), ll(2));
        let mine = bin("+", q.clone(), odd.clone());
        let key = bin("-", ix("row", id("y")), odd.clone());
        let Some((state, pos)) = self.draw_at(b, h, &mine, &key) else {
            return Vec::new();
        };
        let u = |n: i64| ix("dplc_u", ll(n));
        let is_odd = bin("!=", odd, ll(0));
        let pick = |yes: C, no: C| C::Cond(Box::new(is_odd.clone()), Box::new(yes), Box::new(no));
        let at = |x: i64| ix(into, bin("+", bin("*", id("y"), ll(2)), ll(x)));
        vec![S::Block(vec![
            S::Unroll,
            loop_over(
                "y",
                ll(0),
                ll(2),
                ll(1),
                vec![
                    array("float", "dplc_u", 2),
                    S::Expr(call("dplc_sample_draw2", vec![state, pos, u(0), u(1)])),
                    decl(
                        "float",
                        "dplc_theirs",
                        call(
                            "__shfl_xor_sync",
                            vec![
                                C::Lit("0xffffffffu".into()),
                                pick(u(0), u(1)),
                                C::Lit("4".into()),
                            ],
                        ),
                    ),
                    set(at(0), self.factor(pick(id("dplc_theirs"), u(0)), d.p)),
                    set(at(1), self.factor(pick(u(1), id("dplc_theirs")), d.p)),
                ],
            ),
        ])]
    }

    /// 0 where `draw` drops the element, else `1 / (1 - p)`.
    fn factor(&self, draw: C, p: f64) -> C {
        C::Cond(
            Box::new(bin("<", draw, f32_lit(drop_threshold(p)))),
            Box::new(zero()),
            Box::new(f32_lit(1.0 / (1.0 - p))),
        )
    }

    /// The sample's key state and the position there of element `(b, h,
    /// i, j)`'s draw.
    ///
    /// The whole tensor's flat index has the batch leading, so sample `b`'s
    /// elements are `[b·per, (b + 1)·per)` of it (`per` 0: one shared
    /// sample): the split into sample and position that `dplc_random` does
    /// by division is `b` and a subtraction here ([`crate::batch_draw`]),
    /// the sample's key state is the same for a whole block (hoisted), and
    /// the draw has no branch, so a thread's draws overlap instead of
    /// waiting on each other (under dropout they had been most of the
    /// passes' time on the H200).
    fn draw_at(&self, b: &C, h: &C, i: &C, j: &C) -> Option<(C, C)> {
        let d = self.k.dropout.as_ref()?;
        let bhij = [b, h, i, j];
        let index = index_with(&d.index, &|a| bhij[a].clone());
        let per = size(d.key.per_sample);
        let split = |yes: C, no: C| {
            C::Cond(
                Box::new(bin(">", per.clone(), ll(0))),
                Box::new(yes),
                Box::new(no),
            )
        };
        let sample = split(
            C::Cast(
                "unsigned long long",
                Box::new(bin("+", size(d.key.first_sample), b.clone())),
            ),
            C::Lit("~0ULL".into()),
        );
        let pos = C::Cast(
            "unsigned long long",
            Box::new(split(
                bin("-", index.clone(), bin("*", b.clone(), per.clone())),
                index,
            )),
        );
        let state = call(
            "dplc_sample_state",
            vec![
                id("seed"),
                C::Lit(format!("{}ULL", d.key.node)),
                size(d.key.layer),
                sample,
            ],
        );
        Some((state, pos))
    }

    /// The key tiles of width `t` a block of queries `[i0, i0 + rows)`
    /// visits: `(begin, end)`, causal and window tiles past either end skipped.
    fn key_range(&self, t: i64, rows: i64) -> Vec<S> {
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
                    bin("+", id("i0"), ll(rows - 1)),
                    bin("-", size(k.q_len), ll(1)),
                ],
            );
            bin("+", self.query_position(&last), ll(1))
        } else {
            bin("+", id("i0"), ll(rows))
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

    /// The query tiles of width `t` a block of keys `[j0, j0 + keys)` visits.
    fn query_range(&self, t: i64, keys: i64) -> Vec<S> {
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
                vec![size(k.q_len), bin("+", id("j0"), ll(keys - 1 + w))],
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

/// The `item`'s head and tile: `(b, h)` of query heads (or key heads) and
/// the first row of its tile of `rows`.
fn decompose(heads: Size, tiles_of: Size, first: &str, rows: i64) -> Vec<S> {
    let tiles = bin("/", bin("+", size(tiles_of), ll(rows - 1)), ll(rows));
    vec![
        decl("long long", "tiles", tiles),
        decl("long long", "bh", bin("/", id("item"), id("tiles"))),
        decl(
            "long long",
            first,
            bin("*", bin("%", id("item"), id("tiles")), ll(rows)),
        ),
        decl("long long", "b", bin("/", id("bh"), size(heads))),
        decl("long long", "hh", bin("%", id("bh"), size(heads))),
    ]
}

/// Work items of a pass that gives a block each tile of `rows` of `len`
/// rows of every head: `⌈len / rows⌉ · batch · heads` (at 64 rows,
/// [`AttentionKernel::items`]).
fn tile_items(len: Size, batch: Size, heads: Size, rows: i64) -> C {
    bin(
        "*",
        bin("/", bin("+", size(len), ll(rows - 1)), ll(rows)),
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

/// How the tensor-core passes are tiled and add into `dQ`'s sum: the choice
/// the executor launches ([`AttentionTuning::LAUNCHED`]) and the variants
/// the GPU benchmark times beside it ([`AttentionTuning::VARIANTS`]), so
/// that each choice is made by a measurement on the same GPU.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AttentionTuning {
    /// Warps of a tensor-core forward block, 16 queries each: more share
    /// each staged key and value tile among more queries (a multiple of 4;
    /// a block takes `forward_warps / 4` of the launch's 64-query items,
    /// [`LaunchShape::Tiles`]).
    pub forward_warps: u32,
    /// Warps of a one-pass backward block, 16 keys each: more share each
    /// streamed query tile among more keys and add each query's `dQ` share
    /// summed over more keys (a multiple of 4; a block takes
    /// `backward_warps / 4` of the launch's 64-key items).
    pub backward_warps: u32,
    /// `f32` lanes of each atomic add of the one-pass backward into `dQ`'s
    /// sum on sm_90: 2 (a thread's own pair of columns) or 4 (neighbouring
    /// lanes trade pairs first, so each add carries four columns of one row
    /// and half as many adds reach L2).
    pub dq_lanes: u32,
}

impl AttentionTuning {
    pub const LAUNCHED: AttentionTuning = AttentionTuning {
        forward_warps: FORWARD_WARPS as u32,
        backward_warps: BACKWARD_WARPS as u32,
        dq_lanes: 2,
    };

    /// The variants the benchmark times, each one choice away from the launched.
    pub const VARIANTS: [AttentionTuning; 3] = [
        AttentionTuning {
            forward_warps: 8,
            ..AttentionTuning::LAUNCHED
        },
        AttentionTuning {
            backward_warps: 8,
            ..AttentionTuning::LAUNCHED
        },
        AttentionTuning {
            dq_lanes: 4,
            ..AttentionTuning::LAUNCHED
        },
    ];

    /// What sets it apart from the launched choice, for names and reports
    /// (`w8_k8`; empty for the launched).
    pub fn describe(&self) -> String {
        let mut parts = Vec::new();
        if self.forward_warps != Self::LAUNCHED.forward_warps {
            parts.push(format!("w{}", self.forward_warps));
        }
        if self.backward_warps != Self::LAUNCHED.backward_warps {
            parts.push(format!("k{}", self.backward_warps));
        }
        if self.dq_lanes != Self::LAUNCHED.dq_lanes {
            parts.push(format!("q{}", self.dq_lanes));
        }
        parts.join("_")
    }

    /// The tuning `text` names (`w8`, `k8_q4`, `w8,k8`; empty or
    /// `launched` for the launched), each pass's part one the benchmark
    /// times and the host emulation checks: a [`VARIANTS`](Self::VARIANTS)
    /// entry's, so no untested combination runs.
    pub fn parse(text: &str) -> Result<AttentionTuning, String> {
        let mut t = Self::LAUNCHED;
        for word in text.split([',', '_', '+']).map(str::trim) {
            let value = |rest: &str| {
                rest.parse::<u32>()
                    .map_err(|_| format!("`{word}`: a tuning is a letter and a count, e.g. `w8`"))
            };
            let mut letters = word.chars();
            match (letters.next(), letters.as_str()) {
                (None, _) => {}
                _ if word == "launched" => {}
                (Some('w'), n) => t.forward_warps = value(n)?,
                (Some('k'), n) => t.backward_warps = value(n)?,
                (Some('q'), n) => t.dq_lanes = value(n)?,
                _ => return Err(format!("`{word}` is not a tuning")),
            }
        }
        let forward = Self {
            forward_warps: t.forward_warps,
            ..Self::LAUNCHED
        };
        let backward = Self {
            forward_warps: Self::LAUNCHED.forward_warps,
            ..t
        };
        let known = |part: Self| part == Self::LAUNCHED || Self::VARIANTS.contains(&part);
        if !known(forward) || !known(backward) {
            let names: Vec<String> = Self::VARIANTS.iter().map(|v| v.describe()).collect();
            return Err(format!(
                "`{text}` is not a combination of the checked tunings: one of each pass's \
                 among {} (the forward's w, the backward's k or q)",
                names.join(", ")
            ));
        }
        Ok(t)
    }

    /// The part of this tuning that changes `pass`; the launched elsewhere.
    fn part_for(&self, pass: AttentionPass) -> AttentionTuning {
        match pass {
            AttentionPass::Forward => AttentionTuning {
                forward_warps: self.forward_warps,
                ..Self::LAUNCHED
            },
            AttentionPass::Grads => AttentionTuning {
                forward_warps: Self::LAUNCHED.forward_warps,
                ..*self
            },
            _ => Self::LAUNCHED,
        }
    }
}

/// Emit CUDA C for `pass` of `kernel` with float buffers stored as `dtype`.
/// Its launch strides over [`AttentionKernel::items`]: a block of `block`
/// threads per item (`Rows`), or for the bias gradient a thread per item
/// (`Elementwise`).
pub fn emit_attention(kernel: &AttentionKernel, pass: AttentionPass, dtype: DType) -> CudaSource {
    emit(kernel, pass, dtype, AttentionTuning::LAUNCHED)
}

/// `pass` of `kernel` under the part of `tuning` that changes it, for the
/// GPU benchmark to time beside the launched code and for a run that asks
/// for it: `None` where no part changes the pass (a forward not on tensor
/// cores, or a tuning of another pass) or the pass cannot take it. Its name
/// is the launched pass's with the part's
/// [`AttentionTuning::describe`] appended.
pub fn emit_attention_tuned(
    kernel: &AttentionKernel,
    pass: AttentionPass,
    dtype: DType,
    tuning: AttentionTuning,
) -> Option<CudaSource> {
    let part = tuning.part_for(pass);
    let whole = |warps: u32, launched: i64| warps > 0 && warps.is_multiple_of(launched as u32);
    let valid = whole(part.forward_warps, FORWARD_WARPS)
        && whole(part.backward_warps, BACKWARD_WARPS)
        && matches!(part.dq_lanes, 2 | 4);
    let applies = part != AttentionTuning::LAUNCHED
        && match pass {
            AttentionPass::Forward => tensor_cores(kernel, dtype),
            AttentionPass::Grads => {
                attention_backward(kernel, dtype) == AttentionBackward::OnePass
                    && one_pass_fits(kernel, i64::from(part.backward_warps), TUNED_SHARED_BYTES)
            }
            _ => false,
        };
    (valid && applies).then(|| emit(kernel, pass, dtype, part))
}

fn emit(
    kernel: &AttentionKernel,
    pass: AttentionPass,
    dtype: DType,
    tuning: AttentionTuning,
) -> CudaSource {
    let mut name = attention_name(kernel, pass, dtype);
    if tuning != AttentionTuning::LAUNCHED {
        name = format!("{name}_{}", tuning.describe());
    }
    let c = Ctx {
        k: kernel,
        roles: kernel.roles(pass),
        tuning,
    };
    let mma = match pass {
        AttentionPass::Forward => tensor_cores(kernel, dtype),
        AttentionPass::QueryGrad | AttentionPass::KeyValueGrad => {
            query_grad_tensor_cores(kernel, dtype)
        }
        AttentionPass::Grads => true,
        AttentionPass::Delta | AttentionPass::QueryGradScale | AttentionPass::BiasGrad => false,
    };
    let pass_code = match pass {
        AttentionPass::Forward if mma => forward_mma(&c, i64::from(tuning.forward_warps)),
        AttentionPass::Forward => forward_scalar(&c),
        AttentionPass::QueryGrad if mma => query_grad_mma(&c),
        AttentionPass::QueryGrad => query_grad(&c),
        AttentionPass::KeyValueGrad if mma => key_value_grad_mma(&c, false),
        AttentionPass::KeyValueGrad => key_value_grad(&c),
        AttentionPass::Delta => delta_pass(&c),
        AttentionPass::Grads => {
            assert_eq!(
                attention_backward(kernel, dtype),
                AttentionBackward::OnePass,
                "{}: the one-pass backward asked of a kernel `attention_backward` gives two",
                pass.name()
            );
            key_value_grad_mma(&c, true)
        }
        AttentionPass::QueryGradScale => query_grad_scale(&c),
        AttentionPass::BiasGrad => bias_grad(&c),
    };
    let per_block = match pass {
        AttentionPass::Forward if mma => tuning.forward_warps / FORWARD_WARPS as u32,
        AttentionPass::Grads => tuning.backward_warps / BACKWARD_WARPS as u32,
        _ => 1,
    };
    let launch = match pass {
        AttentionPass::BiasGrad => LaunchShape::Elementwise { vector: 1 },
        _ if per_block > 1 => LaunchShape::Tiles {
            block: pass_code.block,
            items: per_block,
        },
        _ => LaunchShape::Rows {
            block: pass_code.block,
        },
    };
    finish(kernel, pass, dtype, (name, launch), mma, pass_code)
}

/// A pass's CUDA C: the preludes, the kernel's signature as a comment, its
/// shared arrays carved, its launch bounds, its body.
fn finish(
    kernel: &AttentionKernel,
    pass: AttentionPass,
    dtype: DType,
    (name, launch): (String, LaunchShape),
    mma: bool,
    pass_code: Pass,
) -> CudaSource {
    let mut w = Writer::with_prelude(dtype);
    w.out.push_str(SHARED_PRELUDE);
    if mma {
        w.out.push_str(&mma_prelude(dtype));
    }
    w.line("");
    w.line(&format!("// {}", pass.name()));
    for l in kernel.signature().lines() {
        w.line(&format!("// {l}"));
    }
    let (mut body, shared_bytes) = carve(&pass_code.shared);
    let bounds = match pass_code.fill {
        Some(registers) => format!(
            "{}, {}",
            pass_code.block,
            resident_blocks(pass_code.block, shared_bytes, registers)
        ),
        None => pass_code.block.to_string(),
    };
    w.line(&format!(
        "extern \"C\" __global__ void __launch_bounds__({bounds}) {name}("
    ));
    w.depth += 1;
    let p = params(kernel, pass);
    for (i, s) in p.iter().enumerate() {
        let sep = if i + 1 == p.len() { ") {" } else { "," };
        w.line(&format!("{s}{sep}"));
    }
    body.extend(pass_code.body);
    w.stmts(&body);
    w.depth -= 1;
    w.line("}");
    CudaSource {
        name,
        source: w.out,
        launch,
        shared_bytes,
    }
}
