//! Bad input from the abuse-proofing list: each error's exact message, which
//! names where (line:column) and what, and the limits that still accept
//! reasonable input (a byte-order mark, long chains of variants).

/// The first diagnostic's message and the `line:col` of its header, or "ok".
fn check(src: &str) -> String {
    match dplc_frontend::parse("test.dpl", src).and_then(|u| u.check()) {
        Ok(()) => "ok".to_string(),
        Err(d) => {
            let plain = d.render_plain();
            let at = plain
                .split("[test.dpl:")
                .nth(1)
                .and_then(|rest| rest.split(']').next())
                .unwrap_or("?");
            format!("{} [{at}] {}", d.codes()[0], d)
        }
    }
}

/// `n` variants, each based on the one before, down to a model `m0`, and a
/// train section for `m0` alone.
fn variant_chain(n: usize) -> String {
    let mut src =
        String::from("model m0(d = 4) { param w: [d]  return w }\ntrain m0 { seq = 77 }\n");
    for i in 1..=n {
        src += &format!("model m{i} = m{}(d = {})\n", i - 1, i + 4);
    }
    src
}

macro_rules! cases {
    ($($name:ident: $src:expr => $expected:expr;)*) => {
        $(
            #[test]
            fn $name() {
                assert_eq!(check($src), $expected);
            }
        )*
    };
}

cases! {
    nul_byte: "model m() {\n    param w\0: [4]\n    return w\n}\n"
        => "dpl::bad-char [2:12] a NUL byte at 2:12: .dpl files are UTF-8 text";
    nul_byte_in_a_comment: "// a\0b\nmodel m() { param w: [4]  return w }\n"
        => "dpl::bad-char [1:5] a NUL byte at 1:5: .dpl files are UTF-8 text";
    control_character: "model m() {\n\u{1b}[0m}\n"
        => "dpl::bad-char [2:1] a control character (U+001B) at 2:1: .dpl files are UTF-8 text";
    columns_after_crlf: "model m() {\r\n    param w: [4]\r\n  \0\r\n}\r\n"
        => "dpl::bad-char [3:3] a NUL byte at 3:3: .dpl files are UTF-8 text";
    byte_order_mark_inside: "model m() { param w: [4]  return w }\n\u{feff}"
        => "dpl::bad-char [2:1] a byte-order mark (U+FEFF) at 2:1: only the start of a file may have one";
    two_byte_order_marks: "\u{feff}\u{feff}model m() { param w: [4]  return w }\n"
        => "dpl::bad-char [1:4] a byte-order mark (U+FEFF) at 1:4: only the start of a file may have one";
    // A combining mark after a name shows as nothing alone: named by its
    // code point (the help says names are ASCII).
    combining_mark_in_a_name: "model m\u{301}() { param w: [4]  return w }\n"
        => "dpl::syntax [1:8] syntax error: expected a parameter list `(…)`, found `\u{301}` (U+0301)";
        unclosed_comment: "model m() {\n    param w: [4]\n/* return w\n}\n"
        => "dpl::unclosed-comment [3:1] the comment opened at 3:1 is never closed";
    comments_do_not_nest: "/* a /* b */ c */\nmodel m() { param w: [4]  return w }\n"
        => "dpl::syntax [1:14] syntax error: expected `block`, `cluster`, `model`, `train` or the end of the file, found `c`";
    a_quote_in_a_comment_is_not_a_string: "// \"\n/* \" */\nmodel m() { param w: [4]  return w }\n"
        => "ok";
    unclosed_string: "model m() {\n  return f(\"abc)\n}\n"
        => "dpl::unclosed-string [2:12] the string opened at 2:12 is never closed";
    unclosed_string_before_crlf: "model m() {\r\n  return f(\"abc\r\n}\r\n"
        => "dpl::unclosed-string [2:12] the string opened at 2:12 is never closed";
    a_comment_opener_in_a_string_is_text: "model m() {\n  input x: f32[b, 4]\n  return linear(x, 4, 4, name = \"/*\")\n}\n"
        => "dpl::arg-type [3:33] expected a name string such as \"q\" (letters, digits, _), found the string \"/*\"";
    float_overflow: "model m() {\n  x = 1e400\n  param w: [4]\n  return w\n}\n"
        => "dpl::overflow [2:7] the number `1e400` at 2:7 overflows a 64-bit float";
    integer_overflow_in_a_dimension: "model m() {\n  param w: [99999999999999999999999]\n  return w\n}\n"
        => "dpl::overflow [2:13] the integer `99999999999999999999999` at 2:13 overflows 64 bits";
    integer_overflow_in_a_default: "model m(d = 9223372036854775808) {\n  param w: [d]\n  return w\n}\n"
        => "dpl::overflow [1:13] the integer `9223372036854775808` at 1:13 overflows 64 bits";
    largest_integer_is_fine: "model m(d = 9223372036854775807) {\n  param w: [d / 9223372036854775807]\n  return w\n}\n"
        => "ok";
    quantity_overflow: "cluster c {\n  devices_per_node = 8\n  device = A100\n  intra_node = nvswitch(bandwidth = 1e300 TB/s, latency = 2 us)\n}\n"
        => "dpl::overflow [4:37] the quantity `1e300 TB/s` at 4:37 overflows a 64-bit float";
    variant_cycle: "model a = b(d = 8)\nmodel b = a(d = 16)\n"
        => "dpl::variant-cycle [1:11] model `b` is a variant of itself: `b` → `a` → `b`";
    variant_chain_into_a_cycle: "model gpt(d = 4) { param w: [d]  return w }\nmodel c = b(d = 4)\nmodel b = a(d = 8)\nmodel a = b(d = 16)\n"
        => "dpl::variant-cycle [4:11] model `b` is a variant of itself: `b` → `a` → `b`";
    variant_chain_too_deep: &variant_chain(257)
        => "dpl::variant-depth [4:12] variant chain deeper than 256: `m257` → `m256` → … → `m1` → …";
    variant_chain_at_the_limit: &variant_chain(256) => "ok";
    duplicate_name: "model m() {\n  input x: f32[b, 4]\n  x = linear(x, 4, 4, name = \"w\")\n  x = linear(x, 4, 4, name = \"w\")\n  return x\n}\n"
        => "dpl::duplicate-name [4:23] the name `w` is already used in this scope at 3:23";
    name_of_an_unnamed_call: "model m() {\n  input x: f32[b, 4]\n  x = linear(x, 4, 4)\n  x = linear(x, 4, 4, name = \"linear\")\n  return x\n}\n"
        => "dpl::duplicate-name [4:23] the name `linear` is already used in this scope at 3:7";
    numbered_name_already_taken: "model m() {\n  input x: f32[b, 4]\n  x = linear(x, 4, 4, name = \"linear_1\")\n  x = linear(x, 4, 4)\n  x = linear(x, 4, 4)\n  return x\n}\n"
        => "dpl::duplicate-name [5:7] this `linear` would be named `linear_1`, which is already used in this scope at 3:23";
    same_name_in_two_block_calls_is_fine: "block two(x) {\n  x = linear(x, 4, 4, name = \"q\")\n  return x\n}\nmodel m() {\n  input x: f32[b, 4]\n  return two(two(x))\n}\n"
        => "ok";
    duplicate_param: "model m() {\n  param w: [4]\n  if true {\n    param w: [4]\n  }\n  return w\n}\n"
        => "dpl::duplicate-param [4:11] parameter `w` is already declared in this scope at 2:9";
}

#[test]
fn a_leading_byte_order_mark_is_skipped_and_columns_count_it() {
    let plain = "model m(d = 10) { param w: [d]  return w }\n";
    let with_bom = format!("\u{feff}{plain}");
    for src in [plain, &with_bom] {
        let unit = dplc_frontend::parse("t.dpl", src).expect("parses");
        assert_eq!(unit.lower("m").expect("lowers").graph.param_count(), 10);
    }
    // Columns are bytes, as in the rendered header: the mark takes three.
    assert_eq!(
        check("\u{feff}model m() {\n  x = 1e400 }\n"),
        "dpl::overflow [2:7] the number `1e400` at 2:7 overflows a 64-bit float"
    );
    assert_eq!(
        check("\u{feff}model m() { x = 1e400 }\n"),
        "dpl::overflow [1:20] the number `1e400` at 1:20 overflows a 64-bit float"
    );
}

#[test]
fn a_chain_of_forty_variants_lowers_with_the_outermost_arguments_and_inherits_train() {
    let unit = dplc_frontend::parse("t.dpl", &variant_chain(40)).expect("parses");
    unit.check().expect("checks");
    let m40 = unit.lower("m40").expect("lowers");
    assert_eq!(m40.graph.param_count(), 44);
    assert_eq!(m40.args, [("d".to_string(), "44".to_string())]);
    // Found through all forty bases, not lost after 32 of them.
    assert_eq!(m40.train.seq, 77);
}
