//! The scalar passes of the fused attention, for f32 storage (and any
//! dtype without tensor cores): a thread per query row in the forward and
//! in `dQ`, per key row in `dK`/`dV`, tiles staged in shared memory, and the
//! bias gradient a thread per bias element.

use super::*;

/// The scalar forward: a thread per query row, key/value tiles in shared memory.
pub(super) fn forward_scalar(c: &Ctx) -> Pass {
    use AttentionBuffer::*;
    let k = c.k;
    let (hd, vd) = (k.head_dim, k.value_dim);
    let t = streamed_rows(hd + vd);
    let (b, h, i) = (id("b"), id("hh"), id("i"));
    let j = bin("+", id("j0"), id("jj"));
    let mut body = decompose(k.heads, k.q_len, "i0", ROWS);
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
    body.extend(c.key_range(t, ROWS));
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
    let items = tile_items(k.q_len, k.batch, k.heads, ROWS);
    Pass::tiles(items, body, ROWS as u32, key_value_arrays(t, hd, vd))
}

/// The key and value tiles of `t` keys the forward and the dQ pass walk,
/// in shared memory (`hd` and `vd` floats a key).
fn key_value_arrays(t: i64, hd: i64, vd: i64) -> Vec<Shared> {
    vec![
        shared("float", 4, "kt", t * hd),
        shared("float", 4, "vt", t * vd),
    ]
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
pub(super) fn query_grad(c: &Ctx) -> Pass {
    use AttentionBuffer::*;
    let k = c.k;
    let (hd, vd) = (k.head_dim, k.value_dim);
    let t = streamed_rows(hd + vd);
    let (b, h, i) = (id("b"), id("hh"), id("i"));
    let mut body = decompose(k.heads, k.q_len, "i0", ROWS);
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
        at(c.buf(Delta), c.lse_at(b.clone(), h.clone(), i.clone())),
        id("delta"),
    ));
    row.push(set(
        id("lse"),
        at(c.buf(LogSumExp), c.lse_at(b.clone(), h.clone(), i.clone())),
    ));
    body.push(S::If(id("live"), row));
    body.push(unrolled("d", hd, vec![set(ix("acc", id("d")), zero())]));
    body.extend(c.key_range(t, ROWS));
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
    let items = tile_items(k.q_len, k.batch, k.heads, ROWS);
    Pass::tiles(items, body, ROWS as u32, key_value_arrays(t, hd, vd))
}

/// The scalar `dK`/`dV` pass: a thread per key row of one key head, over
/// the query heads that share it and their query tiles.
pub(super) fn key_value_grad(c: &Ctx) -> Pass {
    use AttentionBuffer::*;
    let k = c.k;
    let (hd, vd) = (k.head_dim, k.value_dim);
    let t = streamed_rows(hd + vd);
    let (b, h, j) = (id("b"), id("h"), id("j"));
    let mut body = decompose(k.kv_heads, k.k_len, "j0", ROWS);
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
    body.extend(c.query_range(t, ROWS));
    let i = id("i");
    // Per query row of the tile: its log-sum-exp and Δ, staged once.
    let mut rowstats = vec![
        decl("long long", "i", bin("+", id("i0"), id("r"))),
        set(ix("lt", id("r")), neg_inf()),
        set(ix("dt", id("r")), zero()),
    ];
    let mut live_row = vec![set(
        ix("dt", id("r")),
        at(c.buf(Delta), c.lse_at(b.clone(), h.clone(), i.clone())),
    )];
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
    let items = tile_items(k.k_len, k.batch, k.kv_heads, ROWS);
    Pass::tiles(
        items,
        body,
        ROWS as u32,
        vec![
            shared("float", 4, "qt", t * hd),
            shared("float", 4, "gt", t * vd),
            shared("float", 4, "lt", t),
            shared("float", 4, "dt", t),
        ],
    )
}

/// The bias gradient: a thread per element the bias holds, summing the
/// score gradients over the axes it broadcasts along (row-major).
pub(super) fn bias_grad(c: &Ctx) -> Pass {
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
    Pass {
        body: vec![items_loop(items.unwrap_or_else(|| ll(1)), true, body)],
        block: BIAS_BLOCK,
        shared: vec![],
        fill: None,
    }
}
