//! Random text and random edits of the zoo and std never make the frontend
//! panic: every outcome is a model or a diagnostic.

use proptest::prelude::*;

const SOURCES: &[&str] = &[
    include_str!("../../models/gpt2.dpl"),
    include_str!("../../models/llama3.dpl"),
    include_str!("../../models/mixtral.dpl"),
    include_str!("../../models/bert.dpl"),
    include_str!("../../models/tiny.dpl"),
    include_str!("../../models/clusters/dgx_a100_x4.dpl"),
    include_str!("../std/layers.dpl"),
    include_str!("../std/attention.dpl"),
    include_str!("../std/moe.dpl"),
];

/// Tokens worth splicing in: they reach deeper than random bytes.
const TOKENS: &[&str] = &[
    "(",
    ")",
    "[",
    "]",
    "{",
    "}",
    ",",
    "=",
    "==",
    "-",
    "+",
    "*",
    "/",
    "**",
    "@",
    "%",
    "0",
    "-1",
    "1e400",
    "99999999999999999999",
    "repeat",
    "if",
    "else",
    "return",
    "param",
    "input",
    "block",
    "model",
    "x",
    "h",
    "d",
    "seq",
    "GB/s",
    "us",
    "per device",
    "\"",
    "//",
    "/*",
    "\n",
    "true",
    "not",
    "and",
    "attention(",
    "linear(",
    "reshape(",
    "topk(",
    "name = \"q\"",
    "0.0",
    "\0",
    "\u{feff}",
    "\u{7}",
    "*/",
    "\r\n",
    "name = \"linear\"",
    "name = \"linear_1\"",
];

#[derive(Debug, Clone)]
enum Edit {
    Delete(usize, usize),
    Insert(usize, usize),
    Swap(usize, usize),
    Duplicate(usize, usize),
}

fn edit() -> impl Strategy<Value = Edit> {
    prop_oneof![
        (any::<usize>(), 1usize..20).prop_map(|(a, n)| Edit::Delete(a, n)),
        (any::<usize>(), any::<usize>()).prop_map(|(a, t)| Edit::Insert(a, t)),
        (any::<usize>(), any::<usize>()).prop_map(|(a, b)| Edit::Swap(a, b)),
        (any::<usize>(), 1usize..40).prop_map(|(a, n)| Edit::Duplicate(a, n)),
    ]
}

fn boundary(s: &str, i: usize) -> usize {
    let mut i = i % (s.len() + 1);
    while !s.is_char_boundary(i) {
        i -= 1;
    }
    i
}

/// `i` clamped to the text and moved back to a character boundary.
fn clamp(s: &str, i: usize) -> usize {
    let mut i = i.min(s.len());
    while !s.is_char_boundary(i) {
        i -= 1;
    }
    i
}

fn apply(mut s: String, e: &Edit) -> String {
    match *e {
        Edit::Delete(a, n) => {
            let a = boundary(&s, a);
            let b = clamp(&s, a + n);
            if b > a {
                s.replace_range(a..b, "");
            }
        }
        Edit::Insert(a, t) => {
            let a = boundary(&s, a);
            s.insert_str(a, TOKENS[t % TOKENS.len()]);
        }
        Edit::Swap(a, b) => {
            let (a, b) = (boundary(&s, a), boundary(&s, b));
            let (a, b) = (a.min(b), a.max(b));
            let mid = s[a..b].to_string();
            let words: Vec<&str> = mid.split(' ').collect();
            if words.len() > 1 {
                let mut w = words.clone();
                w.swap(0, words.len() - 1);
                s.replace_range(a..b, &w.join(" "));
            }
        }
        Edit::Duplicate(a, n) => {
            let a = boundary(&s, a);
            let b = clamp(&s, a + n);
            let piece = s[a..b].to_string();
            s.insert_str(b, &piece);
        }
    }
    s
}

fn run(text: &str) {
    if let Ok(unit) = dplc_frontend::parse("fuzz.dpl", text) {
        let _ = unit.check().map_err(|d| d.render_plain());
        let _ = unit.clusters();
    } else if let Err(d) = dplc_frontend::parse("fuzz.dpl", text) {
        let _ = d.render_plain();
    }
}

/// Characters that are rare in random text but that the lexer must refuse or
/// skip: NUL and other controls, byte-order marks, comment and string openers.
fn lexer_char() -> impl Strategy<Value = char> {
    prop_oneof![
        4 => any::<char>(),
        1 => Just('\0'),
        1 => Just('\u{feff}'),
        1 => Just('\u{1b}'),
        1 => Just('\r'),
        1 => Just('\n'),
        2 => Just('"'),
        2 => Just('/'),
        2 => Just('*'),
    ]
}

/// `bases.len()` variants `v0…`, each based on `v{b}` or, past the end, the model.
fn variant_file(bases: &[usize]) -> String {
    let mut src = String::from("model m(d = 4) { param w: [d]  return w }\n");
    for (i, b) in bases.iter().enumerate() {
        let base = if *b < bases.len() {
            format!("v{b}")
        } else {
            "m".to_string()
        };
        src += &format!("model v{i} = {base}(d = {})\n", i + 1);
    }
    src
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, failure_persistence: None, ..ProptestConfig::default() })]

    #[test]
    fn control_characters_and_open_comments_never_panic(
        chars in prop::collection::vec(lexer_char(), 0..120),
        file in 0usize..SOURCES.len(),
        at in any::<usize>(),
    ) {
        let junk: String = chars.into_iter().collect();
        run(&junk);
        let mut text = SOURCES[file].to_string();
        text.insert_str(boundary(&text, at), &junk);
        run(&text);
    }

    /// Random variant graphs: cycles, chains into cycles, long chains. A file
    /// with every base defined fails only for a cycle, never panics or hangs.
    #[test]
    fn variant_graphs_never_panic(bases in prop::collection::vec(0usize..80, 1..60)) {
        let src = variant_file(&bases);
        let unit = dplc_frontend::parse("v.dpl", &src).expect("variants parse");
        match unit.check() {
            Ok(()) => {}
            Err(d) => {
                let code = d.codes()[0];
                prop_assert!(code == "dpl::variant-cycle", "{}", d.render_plain());
            }
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, failure_persistence: None, ..ProptestConfig::default() })]

    #[test]
    fn random_text_never_panics(text in "\\PC{0,200}") {
        run(&text);
    }

    #[test]
    fn random_token_soup_never_panics(tokens in prop::collection::vec(0usize..TOKENS.len(), 0..60)) {
        let text: Vec<&str> = tokens.iter().map(|t| TOKENS[*t]).collect();
        run(&text.join(" "));
    }

    #[test]
    fn mutated_zoo_files_never_panic(file in 0usize..SOURCES.len(), edits in prop::collection::vec(edit(), 1..6)) {
        let text = edits.iter().fold(SOURCES[file].to_string(), apply);
        run(&text);
    }
}
