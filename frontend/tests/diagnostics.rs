//! Every kind of error, rendered as the user sees it. Tests are data: each
//! case is a source text and its snapshot under `tests/snapshots/`.
//! Re-bless with `cargo insta review` or `INSTA_UPDATE=always cargo test`.

/// Parse and check `src`; the rendered diagnostics, or "ok".
fn check(src: &str) -> String {
    match dplc_frontend::parse("test.dpl", src).and_then(|u| u.check()) {
        Ok(()) => "ok".to_string(),
        Err(d) => d.render_plain(),
    }
}

/// `n` variants, each based on the one before, down to a model `m0`.
fn variant_chain(n: usize) -> String {
    let mut src = String::from("model m0(d = 4) { param w: [d]  return w }\n");
    for i in 1..=n {
        src += &format!("model m{i} = m{}(d = {})\n", i - 1, i + 4);
    }
    src
}

macro_rules! cases {
    ($($name:ident: $src:expr;)*) => {
        $(
            #[test]
            fn $name() {
                insta::assert_snapshot!(stringify!($name), check($src));
            }
        )*
    };
}

cases! {
    share_of_a_missing_path: "model m() {\n    input x: f32[b, 4]\n    y = linear(x, 4, 4, name = \"a\")\n    return linear(y, 4, 4, share = \"b\")\n}\n";
    share_of_another_shape: "model m() {\n    input x: f32[b, 4]\n    y = linear(x, 4, 4, name = \"a\")\n    return linear(y, 4, 2, share = \"a\")\n}\n";
    pad_of_a_symbolic_axis: "model m() {\n    input x: f32[b, s]\n    return pad(x, 1, 1, 0)\n}\n";
    cross_attention_with_a_causal_mask: "model m() {\n    input x: f32[b, s, 8]\n    input e: f32[b, 5, 8]\n    return attention(x, 8, 2, kv = e)\n}\n";
    syntax_error: "model m() {\n    x = 1 +\n}\n";
    unknown_name_with_suggestion: "model m(width = 4) {\n    input x: f32[b, 4]\n    return x * widht\n}\n";
    unknown_block: "model m() {\n    input x: f32[b, 4]\n    return lienar(x, 4, 4)\n}\n";
    wrong_arg_count: "model m() {\n    input x: f32[b, 4]\n    return linear(x, 4, 4, true, 5)\n}\n";
    missing_argument: "model m() {\n    input x: f32[b, 4]\n    return linear(x, 4)\n}\n";
    unknown_keyword_arg: "model m() {\n    input x: f32[b, 4]\n    return linear(x, 4, 4, biass = false)\n}\n";
    duplicate_keyword: "model m() {\n    input x: f32[b, 4]\n    return softmax(x, axis = 0, axis = 1)\n}\n";
    binary_shape_mismatch: "model m() {\n    input x: f32[b, 4]\n    param w: [3]\n    return x + w\n}\n";
    matmul_inner_dim_mismatch: "model m() {\n    input x: f32[b, 4]\n    param w: [5, 8]\n    return x @ w\n}\n";
    shape_error_inside_std_block: "model m() {\n    input x: f32[b, s, 64]\n    return attention(x, 48, 4)\n}\n";
    heads_not_dividing_width: "model m() {\n    input x: f32[b, s, 64]\n    return attention(x, 64, 5)\n}\n";
    partial_rotary_of_an_odd_width: "model m() {\n    input x: f32[b, s, 64]\n    return attention(x, 64, 4, rotary = true, rotary_dims = 5)\n}\n";
    partial_rotary_wider_than_a_head: "model m() {\n    input x: f32[b, s, 64]\n    return attention(x, 64, 4, rotary = true, rotary_dims = 32)\n}\n";
    reshape_count_mismatch: "model m() {\n    input x: f32[b, 4]\n    return reshape(x, [b, 3])\n}\n";
    non_integer_dim: "model m(d = 10, heads = 4) {\n    param w: [d / heads, 2]\n    return w\n}\n";
    non_positive_dim: "model m(d = 10) {\n    param w: [d - 10, 2]\n    return w\n}\n";
    division_by_zero: "model m(heads = 0) {\n    param w: [8 / heads]\n    return w\n}\n";
    integer_overflow: "model m(d = 4611686018427387904) {\n    param w: [d * 4]\n    return w\n}\n";
    huge_dim: "model m() {\n    param w: [1099511627776, 1099511627776]\n    return w\n}\n";
    duplicate_block: "block f(x) { return x }\nblock f(x) { return x }\nmodel m() { input x: f32[b]  return f(x) }\n";
    duplicate_model: "model m() { input x: f32[b]  return x }\nmodel m() { input x: f32[b]  return x }\n";
    duplicate_param: "model m() {\n    param w: [4]\n    param w: [4]\n    return w\n}\n";
    tensor_where_number_expected: "model m() {\n    input x: f32[b, 4]\n    param w: [x, 4]\n    return w\n}\n";
    missing_return_in_block: "block f(x) {\n    y = x\n}\nmodel m() {\n    input x: f32[b]\n    return f(x)\n}\n";
    recursive_block: "block f(x) {\n    return f(x)\n}\nmodel m() {\n    input x: f32[b]\n    return f(x)\n}\n";
    unknown_model_in_variant: "model gpt(d = 4) { param w: [d]  return w }\nmodel big = gtp(d = 8)\n";
    unknown_model_in_train: "model gpt(d = 4) { param w: [d]  return w }\ntrain gtp { seq = 8 }\n";
    unknown_train_key: "model m(d = 4) { param w: [d]  return w }\ntrain m {\n    seq = 8\n    global_bath = 4\n}\n";
    unknown_optimizer: "model m(d = 4) { param w: [d]  return w }\ntrain m {\n    optimizer = adam(lr = 1e-3)\n}\n";
    bad_unit: "cluster c {\n    devices_per_node = 8\n    device = A100\n    intra_node = nvswitch(bandwidth = 300 GB/h, latency = 2 us)\n}\n";
    wrong_unit_kind: "cluster c {\n    devices_per_node = 8\n    device = A100\n    intra_node = nvswitch(bandwidth = 2 us, latency = 2 us)\n}\n";
    unknown_link_kind: "cluster c {\n    devices_per_node = 8\n    device = A100\n    intra_node = nvlinc(bandwidth = 300 GB/s, latency = 2 us)\n}\n";
    repeat_count_not_positive: "model m(layers = 0) {\n    input x: f32[b, 4]\n    repeat layers {\n        x = x * 2\n    }\n    return x\n}\n";
    repeat_count_symbolic: "model m() {\n    input x: f32[b, 4]\n    repeat b {\n        x = x * 2\n    }\n    return x\n}\n";
    repeat_changes_shape: "model m() {\n    input x: f32[b, 4]\n    param w: [4, 8]\n    repeat 2 {\n        x = x @ w\n    }\n    return x\n}\n";
    model_formal_without_default: "model m(d) {\n    param w: [d]\n    return w\n}\n";
    too_deep_nesting: concat!("model m() {\n    x = ", "((((((((((((((((((((((((((((((((((((((((((((((((((((((((((((((((((((((((((((((((((((((((((((((((((((((((((((((((((((((((((((((((((((((1)))))))))))))))))))))))))))))))))))))))))))))))))))))))))))))))))))))))))))))))))))))))))))))))))))))))))))))))))))))))))))))))))", "\n    return x\n}\n");
    shadowing_a_builtin: "block softmax(x) { return x }\n";
    condition_not_bool: "model m(d = 4) {\n    param w: [d]\n    if d {\n        w = w * 2\n    }\n    return w\n}\n";
    bad_dtype: "model m() {\n    input x: int32[b, 4]\n    return x\n}\n";
    positional_variant_argument: "model gpt(d = 4) { param w: [d]  return w }\nmodel big = gpt(8)\n";
    axis_out_of_range: "model m() {\n    input x: f32[b, 4]\n    return softmax(x, 2)\n}\n";
    return_in_repeat: "model m() {\n    input x: f32[b, 4]\n    repeat 2 {\n        return x\n    }\n    return x\n}\n";
    byte_order_mark_is_skipped: "\u{feff}model m(d = 10) {\n    param w: [d - 10, 2]\n    return w\n}\n";
    byte_order_mark_inside_the_file: "model m() {\n    param w: [4]\u{feff}\n    return w\n}\n";
    nul_byte: "model m() {\n    param w\0: [4]\n    return w\n}\n";
    control_character: "model m() {\n    param w: [4]\n  \u{7}  return w\n}\n";
    unclosed_block_comment: "model m() {\n    param w: [4]\n    /* return w\n}\n";
    unclosed_string: "model m() {\n    input x: f32[b, 4]\n    return linear(x, 4, 4, name = \"q)\n}\n";
    unclosed_string_at_end_of_file: "model m() {\n    input x: f32[b, 4]\n    return linear(x, 4, 4, name = \"q";
    float_literal_overflow: "model m() {\n    param w: [4]\n    return w * 1e400\n}\n";
    integer_literal_overflow: "model m() {\n    param w: [99_999_999_999_999_999_999_999]\n    return w\n}\n";
    quantity_overflow: "cluster c {\n    devices_per_node = 8\n    device = A100\n    intra_node = nvswitch(bandwidth = 1e300 TB/s, latency = 2 us)\n}\n";
    link_bandwidth_zero: "cluster c {\n    devices_per_node = 4\n    device = cpu\n    intra_node = shm(bandwidth = 0 GB/s, latency = 1 us)\n}\n";
    link_bandwidth_negative: "cluster c {\n    devices_per_node = 4\n    device = cpu\n    intra_node = shm(bandwidth = -1 GB/s, latency = 1 us)\n}\n";
    link_bandwidth_tiny: "cluster c {\n    devices_per_node = 4\n    device = cpu\n    intra_node = shm(bandwidth = 1e-300 B/s, latency = 1 us)\n}\n";
    link_latency_huge: "cluster c {\n    devices_per_node = 4\n    device = cpu\n    intra_node = shm(bandwidth = 10 GB/s, latency = 1e308 s)\n}\n";
    link_latency_negative: "cluster c {\n    devices_per_node = 4\n    device = cpu\n    intra_node = shm(bandwidth = 10 GB/s, latency = -2 us)\n}\n";
    accelerator_memory_too_small: "cluster c {\n    devices_per_node = 1\n    device = accelerator(name = \"X\", bf16 = 100 TFLOP/s, memory = 1 B, memory_bandwidth = 1 TB/s)\n}\n";
    accelerator_rate_too_large: "cluster c {\n    devices_per_node = 1\n    device = accelerator(name = \"X\", bf16 = 1e9 PFLOP/s, memory = 16 GB, memory_bandwidth = 1 TB/s)\n}\n";
    accelerator_host_link_zero_is_none: "cluster c {\n    devices_per_node = 1\n    device = accelerator(name = \"X\", bf16 = 100 TFLOP/s, memory = 16 GB, memory_bandwidth = 1 TB/s, host_link = 0 GB/s)\n}\n";
    accelerator_host_link_tiny: "cluster c {\n    devices_per_node = 1\n    device = accelerator(name = \"X\", bf16 = 100 TFLOP/s, memory = 16 GB, memory_bandwidth = 1 TB/s, host_link = 1e-9 B/s)\n}\n";
    cluster_too_many_devices: "cluster c {\n    nodes = 2048\n    devices_per_node = 1024\n    device = cpu\n}\n";
    variant_cycle: "model gpt(d = 4) { param w: [d]  return w }\nmodel a = b(d = 8)\nmodel b = a(d = 16)\n";
    variant_of_itself: "model a = a(d = 8)\n";
    variant_chain_into_a_cycle: "model c = b(d = 4)\nmodel b = a(d = 8)\nmodel a = b(d = 16)\n";
    variant_chain_too_deep: &variant_chain(257);
    duplicate_scope_name: "model m() {\n    input x: f32[b, 4]\n    y = linear(x, 4, 4, name = \"q\")\n    z = linear(y, 4, 4, name = \"q\")\n    return z\n}\n";
    scope_name_of_an_unnamed_call: "model m() {\n    input x: f32[b, 4]\n    y = linear(x, 4, 4)\n    z = linear(y, 4, 4, name = \"linear\")\n    return z\n}\n";
    scope_name_taken_from_numbering: "model m() {\n    input x: f32[b, 4]\n    x = linear(x, 4, 4, name = \"linear_1\")\n    x = linear(x, 4, 4)\n    x = linear(x, 4, 4)\n    return x\n}\n";
    valid_program: "model m(d = 4) {\n    input x: f32[b, 4]\n    param w: [4, d]\n    return x @ w\n}\n";
}
