//! How the tensor-core passes bring tiles into shared memory: 16-bit tiles
//! fetched with `cp.async` (`Ctx::stage16`), double-buffered so that a
//! step's compute overlaps the next step's fetch (`Ctx::pipelined`).

use super::*;

/// A tile of an operand staged as raw 16-bit storage for the tensor-core
/// passes: `rows` rows from `first` (of `len`) of head `head`, `width`
/// features each, into shared `name` with rows `stride` apart.
pub(super) struct Tile16 {
    pub(super) name: &'static str,
    pub(super) role: AttentionBuffer,
    pub(super) head: C,
    pub(super) first: C,
    pub(super) len: Size,
    pub(super) rows: i64,
    pub(super) width: i64,
    pub(super) stride: i64,
}

impl Ctx<'_> {
    /// Stage `tile`, zeros past its operand's end: eight elements a 16-byte
    /// `cp.async` where the operand's features are contiguous and the
    /// source row is 16-byte aligned (checked as it runs: a view of a fused
    /// buffer starts where it starts), else one at a time through
    /// registers. The caller waits for the copies ([`Ctx::pipelined`]).
    pub(super) fn stage16(&self, tile: Tile16) -> S {
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
        // In range and aligned: straight to shared memory with `cp.async`
        // (the caller waits, [`Ctx::pipelined`]); else through registers
        // (zeros past the end), visible after the barrier that follows the
        // wait.
        loop_over(
            "e",
            thread(),
            ll(rows * per_row),
            step,
            vec![
                decl("long long", "sr", src_row),
                decl("long long", "sd", d),
                var("dplc_t*", "dst", Some(dst)),
                S::Line("uint4 v = make_uint4(0u, 0u, 0u, 0u);".into()),
                S::If(
                    bin("<", id("sr"), size(len)),
                    vec![
                        decl("dplc_t*", "src", src),
                        S::Line(
                            "if ((((unsigned long long)src) & 15ULL) == 0ULL) { dplc_cp_async16(dst, src); continue; } \
                             __align__(16) dplc_t w[8]; for (int x = 0; x < 8; ++x) w[x] = src[x]; v = *reinterpret_cast<const uint4*>(w);"
                                .into(),
                        ),
                    ],
                ),
                S::Line("*reinterpret_cast<uint4*>(dst) = v;".into()),
            ],
        )
    }
}

/// An operand a [`Ctx::pipelined`] loop stages each tile of: its shared
/// double buffer `buf` (two tiles of `rows × stride` elements), the tile a
/// step computes on as `cur` and the one it fetches as `next`.
pub(super) struct Staged {
    pub(super) buf: &'static str,
    pub(super) cur: &'static str,
    pub(super) next: &'static str,
    pub(super) role: AttentionBuffer,
    pub(super) head: C,
    pub(super) len: Size,
    pub(super) width: i64,
    pub(super) stride: i64,
}

impl Staged {
    fn tile_len(&self, rows: i64) -> i64 {
        rows * self.stride
    }
}

impl Ctx<'_> {
    /// `for walk in (begin..end).step_by(rows)`, each step's tiles of
    /// `staged` fetched with `cp.async` while the step before computes: the
    /// first tile before the loop, then at the top of each step a wait for
    /// this step's tiles and one barrier (after which every thread is done
    /// with the other buffer), the next step's fetch, and `compute` on
    /// `cur`. A barrier before the first fetch keeps it from the buffer the
    /// block's previous item may still be reading.
    pub(super) fn pipelined(
        &self,
        walk: &str,
        (begin, end): (C, C),
        rows: i64,
        staged: &[Staged],
        compute: Vec<S>,
    ) -> Vec<S> {
        let fetch = |first: C| -> Vec<S> {
            staged
                .iter()
                .map(|st| {
                    self.stage16(Tile16 {
                        name: st.next,
                        role: st.role,
                        head: st.head.clone(),
                        first: first.clone(),
                        len: st.len,
                        rows,
                        width: st.width,
                        stride: st.stride,
                    })
                })
                .collect()
        };
        let at_buffer = |st: &Staged, which: C| {
            C::Ref(Box::new(ix(st.buf, bin("*", which, ll(st.tile_len(rows))))))
        };
        let mut first = vec![];
        for st in staged {
            first.push(var("dplc_t*", st.next, Some(at_buffer(st, ll(0)))));
        }
        first.extend(fetch(begin.clone()));
        let mut step = vec![S::Expr(call("dplc_cp_async_wait", vec![])), sync()];
        for st in staged {
            step.push(decl("dplc_t*", st.cur, at_buffer(st, id("dplc_cur"))));
        }
        let ahead = bin("+", id(walk), ll(rows));
        let mut prefetch = vec![];
        for st in staged {
            prefetch.push(var(
                "dplc_t*",
                st.next,
                Some(at_buffer(st, bin("^", id("dplc_cur"), ll(1)))),
            ));
        }
        prefetch.extend(fetch(ahead.clone()));
        step.push(S::If(bin("<", ahead, end.clone()), prefetch));
        step.push(S::Expr(call("dplc_cp_async_commit", vec![])));
        step.extend(compute);
        step.push(S::Line("dplc_cur ^= 1;".into()));
        vec![
            sync(),
            var_int("dplc_cur"),
            S::If(bin("<", begin.clone(), end.clone()), first),
            S::Expr(call("dplc_cp_async_commit", vec![])),
            loop_over(walk, begin, end, ll(rows), step),
        ]
    }
}

fn var_int(name: &str) -> S {
    S::Line(format!("int {name} = 0;"))
}
