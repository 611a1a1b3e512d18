//! The ops along an axis (shift, pad, cumsum), the standard attention's
//! options (head_dim, bias, cross-attention, scaled) and shared parameters,
//! as the IR shows them and as errors say what is wrong.

fn lower(src: &str) -> dplc_ir::Graph {
    let unit =
        dplc_frontend::parse("test.dpl", src).unwrap_or_else(|d| panic!("{}", d.render_plain()));
    unit.lower("m")
        .unwrap_or_else(|d| panic!("{}", d.render_plain()))
        .graph
}

/// The first diagnostic's code and message, or "ok".
fn error(src: &str) -> String {
    match dplc_frontend::parse("test.dpl", src).and_then(|u| u.check()) {
        Ok(()) => "ok".to_string(),
        Err(d) => format!("{} {}", d.codes()[0], d),
    }
}

/// The printed IR lines that mention `op`, without their scope and padding.
fn lines_with(g: &dplc_ir::Graph, op: &str) -> Vec<String> {
    dplc_ir::print_graph(g)
        .lines()
        .filter(|l| l.contains(op))
        .map(|l| l.split('@').next().unwrap_or("").trim().to_string())
        .collect()
}

#[test]
fn shift_pad_and_cumsum_lower_with_symbolic_lengths() {
    let g = lower(
        "model m() {\n  input tokens: i32[batch, seq]\n  input x: f32[batch, seq, 4]\n  \
         t = shift(tokens, 1, 1)\n  y = shift(x, 1, -2, fill = 1.5) + cumsum(x, 1)\n  \
         z = pad(x, 2, 2, -1)\n  r = cumsum(z, -1, reverse = true)\n  \
         return sum(sum(sum(y, -1), -1), -1), t, r\n}\n",
    );
    assert_eq!(
        lines_with(&g, "pad["),
        [
            "%2 = pad[axis=1, 1, -1, value=0](%0) : i32[batch, seq]",
            "%3 = pad[axis=1, -2, 2, value=1.5](%1) : f32[batch, seq, 4]",
            "%6 = pad[axis=2, 2, -1, value=0](%1) : f32[batch, seq, 5]",
        ]
    );
    assert_eq!(
        lines_with(&g, "cumsum["),
        [
            "%4 = cumsum[axis=1](%1) : f32[batch, seq, 4]",
            "%7 = cumsum[axis=2, reverse](%6) : f32[batch, seq, 5]",
        ]
    );
}

#[test]
fn a_pad_that_changes_a_symbolic_length_is_refused() {
    let e = error("model m() {\n  input x: f32[batch, seq]\n  return pad(x, 1, 1, 0)\n}\n");
    assert!(e.starts_with("dpl::shape"), "{e}");
    assert!(
        e.contains("only a shift (before = -after) keeps a symbolic length"),
        "{e}"
    );
    let e = error("model m() {\n  input x: f32[batch, 3]\n  return shift(x, 1, 3)\n}\n");
    assert!(e.contains("a shift by 3 leaves nothing of axis 1"), "{e}");
    let e = error("model m() {\n  input x: i32[batch, 3]\n  return cumsum(x, 1)\n}\n");
    assert!(e.starts_with("dpl::dtype"), "{e}");
}

const ATTN: &str =
    "model m(d = 8) {\n  input x: f32[batch, seq, d]\n  input e: f32[batch, 5, d]\n  \
                    input bias: f32[2, seq, seq]\n";

#[test]
fn attention_head_dim_bias_and_cross_attention() {
    let g = lower(&format!(
        "{ATTN}  y = attention(x, d, 2, head_dim = 3, bias = bias, causal = false, scaled = false)\n  \
         z = attention(y, d, 2, causal = false, kv = e, name = \"cross\")\n  return mean(z)\n}}\n"
    ));
    let shape = |name: &str| {
        let p = g
            .params()
            .find(|(_, p)| p.name == name)
            .unwrap_or_else(|| panic!("{name}"));
        g.shape_str(&p.1.shape)
    };
    // q/k/v project to heads * head_dim = 6, o back to d.
    assert_eq!(shape("attention.q.w"), "[8, 6]");
    assert_eq!(shape("attention.o.w"), "[6, 8]");
    assert_eq!(shape("cross.k.w"), "[8, 8]");
    let ir = dplc_ir::print_graph(&g);
    let has = |op: &str, ty: &str| ir.lines().any(|l| l.contains(op) && l.contains(ty));
    // The bias is added to the unscaled scores (no `mul` of that shape);
    // the cross scores are [batch, heads, seq, 5], scaled.
    assert!(has("= add(", ": f32[batch, 2, seq, seq]"), "{ir}");
    assert!(!has("= mul(", ": f32[batch, 2, seq, seq]"), "{ir}");
    assert!(has("= matmul(", ": f32[batch, 2, seq, 5]"), "{ir}");
    assert!(has("= mul(", ": f32[batch, 2, seq, 5]"), "{ir}");
    assert!(!ir.contains("causal_mask"), "{ir}");
    let e = error(&format!(
        "{ATTN}  return mean(attention(x, d, 2, kv = e))\n}}\n"
    ));
    assert!(
        e.contains("cross-attention (kv = …) has no causal mask"),
        "{e}"
    );
}

#[test]
fn a_shared_call_reads_the_same_parameters() {
    let src = |share: &str| {
        format!(
            "model m() {{\n  input x: f32[batch, 4]\n  y = linear(x, 4, 4, name = \"a\")\n  \
             z = linear(y, 4, 4{share})\n  return mean(z)\n}}\n"
        )
    };
    let own = lower(&src(""));
    let shared = lower(&src(", share = \"a\""));
    assert_eq!(own.param_count(), 40);
    assert_eq!(shared.param_count(), 20);
    let params: Vec<_> = shared.params().map(|(_, p)| p.name.clone()).collect();
    assert_eq!(params, ["a.w", "a.b"]);
    // One parameter, two matmuls reading it.
    let ir = dplc_ir::print_graph(&shared);
    assert_eq!(ir.matches("matmul(").count(), 2, "{ir}");

    let e = error(&src(", share = \"b\""));
    assert!(e.starts_with("dpl::unknown-share"), "{e}");
    assert!(e.contains("no parameter `b.w`"), "{e}");
    let e = error(
        "model m() {\n  input x: f32[batch, 4]\n  y = linear(x, 4, 4, name = \"a\")\n  \
         return mean(linear(y, 4, 2, share = \"a\"))\n}\n",
    );
    assert!(e.starts_with("dpl::shape"), "{e}");
    assert!(e.contains("the shared `a.w` is [4, 4]"), "{e}");
}

/// A block called inside a `repeat` shares a parameter declared outside it:
/// the body captures it, as it captures any outer tensor.
#[test]
fn a_repeat_body_shares_an_outer_call() {
    let g = lower(
        "model m() {\n  input x: f32[batch, 4]\n  h = linear(x, 4, 4, name = \"first\")\n  \
         repeat 3 {\n    h = h + linear(h, 4, 4, share = \"first\")\n  }\n  return mean(h)\n}\n",
    );
    assert_eq!(g.param_count(), 20);
}
