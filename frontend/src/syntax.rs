//! Text to syntax tree: the pest grammar (`dpl.pest`), a Pratt parser for
//! operator precedence, unit literals, and guards against pathological nesting.

use crate::ast::*;
use crate::diag::{line_col, Diag, DiagExt, Res};
use pest::iterators::{Pair, Pairs};
use pest::pratt_parser::{Assoc, Op, PrattParser};
use pest::Parser;
use std::sync::OnceLock;

#[derive(pest_derive::Parser)]
#[grammar = "dpl.pest"]
struct DplParser;

/// Brackets and braces nested deeper than this are refused before pest runs:
/// its descent is recursive and would overflow the stack.
pub const MAX_NESTING: usize = 128;
/// Operators in one flat expression; bounds the Pratt parser's recursion.
const MAX_OPERATORS: usize = 256;
/// Depth of one expression tree; bounds the evaluator's recursion.
const MAX_EXPR_DEPTH: usize = 200;

/// Parse one file into its items.
pub fn parse_file(file: FileId, text: &str) -> Res<Vec<Item>> {
    scan(file, text)?;
    let mut pairs = DplParser::parse(Rule::file, text).map_err(|e| syntax_error(file, text, e))?;
    let file_pair = pairs.next().ok_or_else(|| {
        Diag::new(
            "dpl::syntax",
            span_at(file, 0, 0),
            "the file could not be read",
        )
    })?;
    let b = Builder { file, text };
    let mut items = Vec::new();
    for p in file_pair.into_inner() {
        match p.as_rule() {
            Rule::block_def => items.push(Item::Block(b.fn_def(p)?)),
            Rule::model_def => items.push(Item::Model(b.fn_def(p)?)),
            Rule::variant_def => items.push(Item::Variant(b.variant(p)?)),
            Rule::train_def => items.push(Item::Train(b.section(p)?)),
            Rule::cluster_def => items.push(Item::Cluster(b.section(p)?)),
            _ => {}
        }
    }
    Ok(items)
}

fn span_at(file: FileId, start: usize, end: usize) -> Span {
    Span { file, start, end }
}

/// The byte-order mark, accepted (and skipped by the grammar) only as the
/// first character of a file: editors on Windows write one.
const BOM: char = '\u{feff}';

/// What pest would only call "expected something else": characters that are
/// never text, comments and strings left open, and brackets nested so deep
/// that pest's recursive descent would overflow the stack. One pass over the
/// text before pest runs, skipping comments and strings as the grammar does.
fn scan(file: FileId, text: &str) -> Res<()> {
    for (i, c) in text.char_indices() {
        let at = || line_col(text, i);
        let message = match c {
            BOM if i > 0 => format!(
                "a byte-order mark (U+FEFF) at {}: only the start of a file may have one",
                at()
            ),
            '\0' => format!("a NUL byte at {}: .dpl files are UTF-8 text", at()),
            '\t' | '\n' | '\r' => continue,
            c if c.is_control() => format!(
                "a control character (U+{:04X}) at {}: .dpl files are UTF-8 text",
                c as u32,
                at()
            ),
            _ => continue,
        };
        return Err(Diag::new(
            "dpl::bad-char",
            span_at(file, i, i + c.len_utf8()),
            message,
        )
        .label("not text")
        .help("remove it; a file full of these was probably saved as UTF-16 or is not a .dpl file"));
    }
    let bytes = text.as_bytes();
    let mut depth = 0usize;
    let mut i = 0;
    while i < bytes.len() {
        match bytes[i] {
            b'/' if bytes.get(i + 1) == Some(&b'/') => {
                while i < bytes.len() && bytes[i] != b'\n' {
                    i += 1;
                }
            }
            b'/' if bytes.get(i + 1) == Some(&b'*') => {
                let open = i;
                i += 2;
                while i < bytes.len() && !(bytes[i] == b'*' && bytes.get(i + 1) == Some(&b'/')) {
                    i += 1;
                }
                if i >= bytes.len() {
                    return Err(Diag::new(
                        "dpl::unclosed-comment",
                        span_at(file, open, open + 2),
                        format!(
                            "the comment opened at {} is never closed",
                            line_col(text, open)
                        ),
                    )
                    .label("this `/*` has no `*/`")
                    .help("close it with `*/` (block comments do not nest)"));
                }
                i += 1;
            }
            b'"' => {
                let open = i;
                i += 1;
                while i < bytes.len() && bytes[i] != b'"' && bytes[i] != b'\n' {
                    i += 1;
                }
                if i >= bytes.len() || bytes[i] == b'\n' {
                    // Up to the line break, without a `\r` before it.
                    let end = if i > open + 1 && bytes[i - 1] == b'\r' {
                        i - 1
                    } else {
                        i
                    };
                    return Err(Diag::new(
                        "dpl::unclosed-string",
                        span_at(file, open, end),
                        format!(
                            "the string opened at {} is never closed",
                            line_col(text, open)
                        ),
                    )
                    .label("this string has no closing `\"`")
                    .help("a string ends with `\"` on the line where it starts"));
                }
            }
            b'(' | b'[' | b'{' => {
                depth += 1;
                if depth > MAX_NESTING {
                    return Err(Diag::new(
                        "dpl::too-deep",
                        span_at(file, i, i + 1),
                        format!("brackets are nested more than {MAX_NESTING} deep"),
                    )
                    .label("this bracket is too deep")
                    .help("split the expression into named steps"));
                }
            }
            b')' | b']' | b'}' => depth = depth.saturating_sub(1),
            _ => {}
        }
        i += 1;
    }
    Ok(())
}

/// A pest error in words: where, and what was expected there.
fn syntax_error(file: FileId, text: &str, e: pest::error::Error<Rule>) -> Box<Diag> {
    use pest::error::{ErrorVariant, InputLocation};
    let (start, end) = match e.location {
        InputLocation::Pos(p) => (p, p),
        InputLocation::Span((s, e)) => (s, e),
    };
    // Point at the offending character rather than an empty gap.
    let end = if end == start {
        text[start..]
            .chars()
            .next()
            .map_or(start, |c| start + c.len_utf8())
    } else {
        end
    };
    let first = text[start..].chars().next();
    let found = match first {
        None => "the end of the file".to_string(),
        Some(c) if c.is_whitespace() => "a line break or space".to_string(),
        // Named by its code point: a combining mark or an invisible
        // character shows as nothing (or joins the one before it) when
        // printed alone.
        Some(c) if !c.is_ascii() => format!("`{c}` (U+{:04X})", u32::from(c)),
        Some(_) => {
            let word: String = text[start..]
                .chars()
                .take_while(|c| c.is_alphanumeric() || *c == '_')
                .collect();
            if word.is_empty() {
                format!("`{}`", &text[start..end])
            } else {
                format!("`{word}`")
            }
        }
    };
    let expected = match &e.variant {
        ErrorVariant::ParsingError { positives, .. } => {
            let mut words: Vec<&str> = positives.iter().map(|r| rule_words(*r)).collect();
            words.sort();
            words.dedup();
            words.retain(|w| !w.is_empty());
            match words.len() {
                0 => "something else".to_string(),
                1 => words[0].to_string(),
                n => format!("{} or {}", words[..n - 1].join(", "), words[n - 1]),
            }
        }
        ErrorVariant::CustomError { message } => message.clone(),
    };
    let help = if first.is_some_and(|c| !c.is_ascii()) {
        "names are ASCII letters, digits and `_` (a comment may hold any text); see \
         docs/language.md for the grammar"
    } else {
        "see docs/language.md for the grammar"
    };
    Diag::new(
        "dpl::syntax",
        span_at(file, start, end),
        format!("syntax error: expected {expected}, found {found}"),
    )
    .label(format!("expected {expected}"))
    .help(help)
}

/// How a grammar rule reads in an error message.
fn rule_words(rule: Rule) -> &'static str {
    match rule {
        Rule::EOI => "the end of the file",
        Rule::ident | Rule::keyword => "a name",
        Rule::block_def | Rule::kw_block => "`block`",
        Rule::model_def | Rule::variant_def | Rule::kw_model => "`model`",
        Rule::train_def | Rule::kw_train => "`train`",
        Rule::cluster_def | Rule::kw_cluster => "`cluster`",
        Rule::kw_param | Rule::param_stmt => "`param`",
        Rule::kw_input | Rule::input_stmt => "`input`",
        Rule::kw_repeat | Rule::repeat_stmt => "`repeat`",
        Rule::kw_if | Rule::if_stmt => "`if`",
        Rule::kw_else | Rule::else_if | Rule::else_body => "`else`",
        Rule::kw_return | Rule::return_stmt => "`return`",
        Rule::assign_stmt => "an assignment",
        Rule::call_stmt => "a call",
        Rule::formals => "a parameter list `(…)`",
        Rule::formal => "a parameter name",
        Rule::section | Rule::body => "`{`",
        Rule::entry => "`key = value`",
        Rule::dims => "a dimension list `[…]`",
        Rule::expr => "an expression",
        Rule::op_neg | Rule::op_sub => "`-`",
        Rule::op_not => "`not`",
        Rule::op_or => "`or`",
        Rule::op_and => "`and`",
        Rule::op_eq => "`==`",
        Rule::op_ne => "`!=`",
        Rule::op_le => "`<=`",
        Rule::op_ge => "`>=`",
        Rule::op_lt => "`<`",
        Rule::op_gt => "`>`",
        Rule::op_add => "an operator",
        Rule::op_pow | Rule::op_mul | Rule::op_div | Rule::op_mod | Rule::op_matmul => {
            "an operator"
        }
        Rule::quantity | Rule::number => "a number",
        Rule::unit => "a unit",
        Rule::per_device => "`per device`",
        Rule::bool_lit => "`true` or `false`",
        Rule::string => "a string",
        Rule::call => "a call",
        Rule::kwarg => "a keyword argument",
        Rule::paren => "`(`",
        Rule::comma => "`,`",
        Rule::list => "`[`",
        _ => "",
    }
}

fn pratt() -> &'static PrattParser<Rule> {
    static PRATT: OnceLock<PrattParser<Rule>> = OnceLock::new();
    PRATT.get_or_init(|| {
        PrattParser::new()
            .op(Op::infix(Rule::op_or, Assoc::Left))
            .op(Op::infix(Rule::op_and, Assoc::Left))
            .op(Op::prefix(Rule::op_not))
            .op(Op::infix(Rule::op_eq, Assoc::Left)
                | Op::infix(Rule::op_ne, Assoc::Left)
                | Op::infix(Rule::op_lt, Assoc::Left)
                | Op::infix(Rule::op_le, Assoc::Left)
                | Op::infix(Rule::op_gt, Assoc::Left)
                | Op::infix(Rule::op_ge, Assoc::Left))
            .op(Op::infix(Rule::op_add, Assoc::Left) | Op::infix(Rule::op_sub, Assoc::Left))
            .op(Op::infix(Rule::op_mul, Assoc::Left)
                | Op::infix(Rule::op_div, Assoc::Left)
                | Op::infix(Rule::op_mod, Assoc::Left)
                | Op::infix(Rule::op_matmul, Assoc::Left))
            .op(Op::prefix(Rule::op_neg))
            .op(Op::infix(Rule::op_pow, Assoc::Right))
    })
}

fn is_primary(rule: Rule) -> bool {
    matches!(
        rule,
        Rule::quantity
            | Rule::number
            | Rule::bool_lit
            | Rule::string
            | Rule::call
            | Rule::ident
            | Rule::paren
            | Rule::list
    )
}

/// Whether `name` can name a model, block or section: the grammar's
/// `ident`, which excludes its keywords. Tools that write .dpl (`dplc
/// import`) ask here rather than keep a list of their own.
pub fn is_name(name: &str) -> bool {
    DplParser::parse(Rule::ident, name)
        .ok()
        .and_then(|mut pairs| pairs.next())
        .is_some_and(|p| p.as_str().len() == name.len())
}

fn is_keyword_token(rule: Rule) -> bool {
    matches!(
        rule,
        Rule::kw_block
            | Rule::kw_model
            | Rule::kw_train
            | Rule::kw_cluster
            | Rule::kw_param
            | Rule::kw_input
            | Rule::kw_repeat
            | Rule::kw_if
            | Rule::kw_else
            | Rule::kw_return
    )
}

/// Inner pairs without the keyword tokens, which carry no information.
fn parts(p: Pair<'_, Rule>) -> impl Iterator<Item = Pair<'_, Rule>> {
    p.into_inner().filter(|q| !is_keyword_token(q.as_rule()))
}

/// The grammar guarantees the shape of each pair; a mismatch is a bug here, but
/// still reported as a diagnostic rather than a panic.
fn internal(span: Span, what: &str) -> Box<Diag> {
    Diag::new(
        "dpl::internal",
        span,
        format!("internal error: the parser produced an unexpected {what}"),
    )
}

struct Builder<'t> {
    file: FileId,
    /// The file's text, to say where a literal is in its message.
    text: &'t str,
}

impl Builder<'_> {
    fn span(&self, p: &Pair<'_, Rule>) -> Span {
        let s = p.as_span();
        span_at(self.file, s.start(), s.end())
    }

    fn next<'i>(
        &self,
        it: &mut impl Iterator<Item = Pair<'i, Rule>>,
        at: Span,
    ) -> Res<Pair<'i, Rule>> {
        it.next().ok_or_else(|| internal(at, "end of a rule"))
    }

    fn ident(&self, p: Pair<'_, Rule>) -> Ident {
        Ident {
            name: p.as_str().to_string(),
            span: self.span(&p),
        }
    }

    fn fn_def(&self, p: Pair<'_, Rule>) -> Res<FnDef> {
        let span = self.span(&p);
        let mut it = parts(p);
        let name = self.ident(self.next(&mut it, span)?);
        let mut formals = Vec::new();
        for f in self.next(&mut it, span)?.into_inner() {
            let mut fi = f.into_inner();
            let fname = self.ident(self.next(&mut fi, span)?);
            let default = fi.next().map(|e| self.expr(e)).transpose()?;
            formals.push(Formal {
                name: fname,
                default,
            });
        }
        let body = self.body(self.next(&mut it, span)?)?;
        Ok(FnDef {
            name,
            formals,
            body,
            span,
        })
    }

    fn variant(&self, p: Pair<'_, Rule>) -> Res<Variant> {
        let span = self.span(&p);
        let mut it = parts(p);
        let name = self.ident(self.next(&mut it, span)?);
        let call = self.next(&mut it, span)?;
        let mut ci = call.into_inner();
        let base = self.ident(self.next(&mut ci, span)?);
        let args = ci.map(|a| self.arg(a)).collect::<Res<Vec<_>>>()?;
        Ok(Variant {
            name,
            base,
            args,
            span,
        })
    }

    fn section(&self, p: Pair<'_, Rule>) -> Res<Section> {
        let span = self.span(&p);
        let mut it = parts(p);
        let name = self.ident(self.next(&mut it, span)?);
        let mut entries = Vec::new();
        for e in self.next(&mut it, span)?.into_inner() {
            let mut ei = e.into_inner();
            let key = self.ident(self.next(&mut ei, span)?);
            let value = self.expr(self.next(&mut ei, span)?)?;
            entries.push((key, value));
        }
        Ok(Section { name, entries })
    }

    fn body(&self, p: Pair<'_, Rule>) -> Res<Vec<Stmt>> {
        p.into_inner().map(|s| self.stmt(s)).collect()
    }

    fn stmt(&self, p: Pair<'_, Rule>) -> Res<Stmt> {
        let span = self.span(&p);
        let rule = p.as_rule();
        let mut it = parts(p);
        let kind = match rule {
            Rule::input_stmt => {
                let name = self.ident(self.next(&mut it, span)?);
                let dtype = self.ident(self.next(&mut it, span)?);
                let dims = self.exprs(self.next(&mut it, span)?.into_inner())?;
                StmtKind::Input { name, dtype, dims }
            }
            Rule::param_stmt => {
                let name = self.ident(self.next(&mut it, span)?);
                let dims = self.exprs(self.next(&mut it, span)?.into_inner())?;
                let init = it.next().map(|e| self.expr(e)).transpose()?;
                StmtKind::Param { name, dims, init }
            }
            Rule::repeat_stmt => {
                let count = self.expr(self.next(&mut it, span)?)?;
                let body = self.body(self.next(&mut it, span)?)?;
                StmtKind::Repeat { count, body }
            }
            Rule::if_stmt => {
                let cond = self.expr(self.next(&mut it, span)?)?;
                let body = self.body(self.next(&mut it, span)?)?;
                let mut arms = vec![(cond, body)];
                let mut otherwise = None;
                for q in it {
                    let qspan = self.span(&q);
                    match q.as_rule() {
                        Rule::else_if => {
                            let mut qi = parts(q);
                            let c = self.expr(self.next(&mut qi, qspan)?)?;
                            let b = self.body(self.next(&mut qi, qspan)?)?;
                            arms.push((c, b));
                        }
                        Rule::else_body => {
                            let mut qi = parts(q);
                            otherwise = Some(self.body(self.next(&mut qi, qspan)?)?);
                        }
                        _ => return Err(internal(qspan, "part of an `if`")),
                    }
                }
                StmtKind::If { arms, otherwise }
            }
            Rule::return_stmt => StmtKind::Return(self.exprs(it)?),
            Rule::call_stmt => {
                let call = self.next(&mut it, span)?;
                StmtKind::Call(self.primary(call)?)
            }
            Rule::assign_stmt => {
                let mut targets = Vec::new();
                let mut value = None;
                for q in it {
                    match q.as_rule() {
                        Rule::ident => targets.push(self.ident(q)),
                        _ => value = Some(self.expr(q)?),
                    }
                }
                let value = value.ok_or_else(|| internal(span, "assignment"))?;
                StmtKind::Assign { targets, value }
            }
            _ => return Err(internal(span, "statement")),
        };
        Ok(Stmt { kind, span })
    }

    fn exprs<'i>(&self, it: impl Iterator<Item = Pair<'i, Rule>>) -> Res<Vec<Expr>> {
        it.map(|e| self.expr(e)).collect()
    }

    fn arg(&self, p: Pair<'_, Rule>) -> Res<Arg> {
        let span = self.span(&p);
        match p.as_rule() {
            Rule::kwarg => {
                let mut it = p.into_inner();
                let name = self.ident(self.next(&mut it, span)?);
                let value = self.expr(self.next(&mut it, span)?)?;
                Ok(Arg {
                    name: Some(name),
                    value,
                })
            }
            _ => Ok(Arg {
                name: None,
                value: self.expr(p)?,
            }),
        }
    }

    /// Fold a flat `expr` pair with the Pratt parser.
    fn expr(&self, p: Pair<'_, Rule>) -> Res<Expr> {
        let span = self.span(&p);
        let pairs = p.into_inner();
        let operators = pairs
            .clone()
            .filter(|q| q.as_rule() != Rule::expr && !is_primary(q.as_rule()))
            .count();
        if operators > MAX_OPERATORS {
            return Err(Diag::new(
                "dpl::too-deep",
                span,
                format!("this expression has {operators} operators, more than the {MAX_OPERATORS} allowed"),
            )
            .label("too long")
            .help("split the expression into named steps"));
        }
        let e = self.fold(pairs)?;
        if depth(&e) > MAX_EXPR_DEPTH {
            return Err(Diag::new(
                "dpl::too-deep",
                span,
                format!("this expression is nested more than {MAX_EXPR_DEPTH} deep"),
            )
            .label("too deep")
            .help("split the expression into named steps"));
        }
        Ok(e)
    }

    fn fold(&self, pairs: Pairs<'_, Rule>) -> Res<Expr> {
        pratt()
            .map_primary(|q| self.primary(q))
            .map_prefix(|op, rhs| {
                let rhs = rhs?;
                let op_span = self.span(&op);
                let kind = if op.as_rule() == Rule::op_not {
                    UnOp::Not
                } else {
                    UnOp::Neg
                };
                // Fold `-3` into a literal so that `-1` is a plain number.
                let span = op_span.to(rhs.span);
                Ok(match (kind, &rhs.kind) {
                    (UnOp::Neg, ExprKind::Int(n)) => Expr {
                        kind: ExprKind::Int(-n),
                        span,
                    },
                    (UnOp::Neg, ExprKind::Float(x)) => Expr {
                        kind: ExprKind::Float(-x),
                        span,
                    },
                    _ => Expr {
                        kind: ExprKind::Unary(kind, Box::new(rhs)),
                        span,
                    },
                })
            })
            .map_infix(|lhs, op, rhs| {
                let (lhs, rhs) = (lhs?, rhs?);
                let bin = match op.as_rule() {
                    Rule::op_or => BinOp::Or,
                    Rule::op_and => BinOp::And,
                    Rule::op_eq => BinOp::Eq,
                    Rule::op_ne => BinOp::Ne,
                    Rule::op_lt => BinOp::Lt,
                    Rule::op_le => BinOp::Le,
                    Rule::op_gt => BinOp::Gt,
                    Rule::op_ge => BinOp::Ge,
                    Rule::op_add => BinOp::Add,
                    Rule::op_sub => BinOp::Sub,
                    Rule::op_mul => BinOp::Mul,
                    Rule::op_div => BinOp::Div,
                    Rule::op_mod => BinOp::Mod,
                    Rule::op_matmul => BinOp::MatMul,
                    Rule::op_pow => BinOp::Pow,
                    _ => return Err(internal(self.span(&op), "operator")),
                };
                let span = lhs.span.to(rhs.span);
                Ok(Expr {
                    kind: ExprKind::Binary(bin, Box::new(lhs), Box::new(rhs)),
                    span,
                })
            })
            .parse(pairs)
    }

    fn primary(&self, p: Pair<'_, Rule>) -> Res<Expr> {
        let span = self.span(&p);
        let kind = match p.as_rule() {
            Rule::number => self.number(&p)?,
            Rule::quantity => {
                let written = p.as_str();
                let mut it = p.into_inner();
                let num = self.next(&mut it, span)?;
                let value = match self.number(&num)? {
                    ExprKind::Int(n) => n as f64,
                    ExprKind::Float(x) => x,
                    _ => return Err(internal(span, "number")),
                };
                let unit_pair = self.next(&mut it, span)?;
                let (unit, factor) = unit_factor(unit_pair.as_str()).ok_or_else(|| {
                    let known = UNITS.iter().map(|(n, _, _)| *n);
                    let mut d = Diag::new(
                        "dpl::bad-unit",
                        self.span(&unit_pair),
                        format!("unknown unit `{}`", unit_pair.as_str()),
                    )
                    .label("not a unit");
                    let list = "bandwidths B/s KB/s MB/s GB/s TB/s KiB/s MiB/s GiB/s Kb/s Mb/s Gb/s Tb/s; \
                                times ns us ms s; sizes B KB MB GB TB KiB MiB GiB TiB";
                    d = match crate::diag::did_you_mean(unit_pair.as_str(), known) {
                        Some(s) => d.help(format!("{s} known units: {list}")),
                        None => d.help(format!("known units: {list}")),
                    };
                    d
                })?;
                // Divide by 10^k for sub-unit factors: `5 us` must be exactly 5e-6.
                let si = if factor < 1.0 {
                    value / (1.0 / factor).round()
                } else {
                    value * factor
                };
                if !si.is_finite() {
                    return Err(Diag::new(
                        "dpl::overflow",
                        span,
                        format!(
                            "the quantity `{}` at {} overflows a 64-bit float",
                            written,
                            line_col(self.text, span.start)
                        ),
                    )
                    .label("overflows")
                    .help("floats range up to about 1.8e308 in SI base units"));
                }
                ExprKind::Quantity {
                    value: si,
                    unit,
                    per_device: it.next().is_some(),
                }
            }
            Rule::bool_lit => ExprKind::Bool(p.as_str() == "true"),
            Rule::string => {
                let s = p.as_str();
                ExprKind::Str(s[1..s.len() - 1].to_string())
            }
            Rule::ident => ExprKind::Name(p.as_str().to_string()),
            Rule::call => {
                let mut it = p.into_inner();
                let callee = self.ident(self.next(&mut it, span)?);
                let args = it.map(|a| self.arg(a)).collect::<Res<Vec<_>>>()?;
                ExprKind::Call { callee, args }
            }
            Rule::paren => {
                let mut tuple = false;
                let mut items = Vec::new();
                for q in p.into_inner() {
                    if q.as_rule() == Rule::comma {
                        tuple = true;
                    } else {
                        items.push(self.expr(q)?);
                    }
                }
                if !tuple && items.len() == 1 {
                    let inner = items.pop().ok_or_else(|| internal(span, "group"))?;
                    return Ok(Expr {
                        kind: inner.kind,
                        span,
                    });
                }
                ExprKind::Tuple(items)
            }
            Rule::list => ExprKind::List(self.exprs(p.into_inner())?),
            _ => return Err(internal(span, "expression")),
        };
        Ok(Expr { kind, span })
    }

    fn number(&self, p: &Pair<'_, Rule>) -> Res<ExprKind> {
        let span = self.span(p);
        let written = p.as_str();
        let text: String = written.chars().filter(|c| *c != '_').collect();
        let at = line_col(self.text, span.start);
        if text.contains(['.', 'e', 'E']) {
            match text.parse::<f64>() {
                Ok(x) if x.is_finite() => Ok(ExprKind::Float(x)),
                _ => Err(Diag::new(
                    "dpl::overflow",
                    span,
                    format!("the number `{written}` at {at} overflows a 64-bit float"),
                )
                .label("overflows")
                .help("floats range up to about 1.8e308")),
            }
        } else {
            // The grammar admits only digits here, so overflow is the one failure.
            text.parse::<i64>().map(ExprKind::Int).map_err(|_| {
                Diag::new(
                    "dpl::overflow",
                    span,
                    format!("the integer `{written}` at {at} overflows 64 bits"),
                )
                .label("overflows")
                .help("integers range up to 9223372036854775807")
            })
        }
    }
}

/// The depth of an expression tree, computed bottom-up while it is small.
fn depth(e: &Expr) -> usize {
    1 + match &e.kind {
        ExprKind::Unary(_, x) => depth(x),
        ExprKind::Binary(_, a, b) => depth(a).max(depth(b)),
        ExprKind::Call { args, .. } => args.iter().map(|a| depth(&a.value)).max().unwrap_or(0),
        ExprKind::Tuple(xs) | ExprKind::List(xs) => xs.iter().map(depth).max().unwrap_or(0),
        _ => 0,
    }
}

/// Units and their factor to SI base units (bytes/s, seconds, bytes, FLOP/s).
pub const UNITS: &[(&str, UnitKind, f64)] = &[
    ("B/s", UnitKind::Bandwidth, 1.0),
    ("KB/s", UnitKind::Bandwidth, 1e3),
    ("MB/s", UnitKind::Bandwidth, 1e6),
    ("GB/s", UnitKind::Bandwidth, 1e9),
    ("TB/s", UnitKind::Bandwidth, 1e12),
    ("KiB/s", UnitKind::Bandwidth, 1024.0),
    ("MiB/s", UnitKind::Bandwidth, 1048576.0),
    ("GiB/s", UnitKind::Bandwidth, 1073741824.0),
    ("TiB/s", UnitKind::Bandwidth, 1099511627776.0),
    // Bits per second: network links are sold in bits.
    ("Kb/s", UnitKind::Bandwidth, 125.0),
    ("Mb/s", UnitKind::Bandwidth, 1.25e5),
    ("Gb/s", UnitKind::Bandwidth, 1.25e8),
    ("Tb/s", UnitKind::Bandwidth, 1.25e11),
    ("ns", UnitKind::Time, 1e-9),
    ("us", UnitKind::Time, 1e-6),
    ("ms", UnitKind::Time, 1e-3),
    ("s", UnitKind::Time, 1.0),
    ("B", UnitKind::Bytes, 1.0),
    ("KB", UnitKind::Bytes, 1e3),
    ("MB", UnitKind::Bytes, 1e6),
    ("GB", UnitKind::Bytes, 1e9),
    ("TB", UnitKind::Bytes, 1e12),
    ("KiB", UnitKind::Bytes, 1024.0),
    ("MiB", UnitKind::Bytes, 1048576.0),
    ("GiB", UnitKind::Bytes, 1073741824.0),
    ("TiB", UnitKind::Bytes, 1099511627776.0),
    ("GFLOP/s", UnitKind::FlopRate, 1e9),
    ("TFLOP/s", UnitKind::FlopRate, 1e12),
    ("PFLOP/s", UnitKind::FlopRate, 1e15),
];

fn unit_factor(name: &str) -> Option<(UnitKind, f64)> {
    UNITS
        .iter()
        .find(|(n, _, _)| *n == name)
        .map(|(_, k, f)| (*k, *f))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(text: &str) -> Res<Vec<Item>> {
        parse_file(FileId(0), text)
    }

    #[test]
    fn precedence_follows_the_table() {
        let items = parse("model m() { x = 1 + 2 * 3 ** 2 ** 2  return x }").unwrap();
        let Item::Model(m) = &items[0] else { panic!() };
        let StmtKind::Assign { value, .. } = &m.body[0].kind else {
            panic!()
        };
        // 1 + (2 * (3 ** (2 ** 2)))
        let ExprKind::Binary(BinOp::Add, _, rhs) = &value.kind else {
            panic!()
        };
        let ExprKind::Binary(BinOp::Mul, _, pow) = &rhs.kind else {
            panic!()
        };
        let ExprKind::Binary(BinOp::Pow, _, inner) = &pow.kind else {
            panic!()
        };
        assert!(matches!(inner.kind, ExprKind::Binary(BinOp::Pow, _, _)));
    }

    #[test]
    fn units_become_si_values() {
        let items =
            parse("cluster c { a = 300 GB/s per device  b = 2 us  c = 400 Gb/s  s = 1 }").unwrap();
        let Item::Cluster(c) = &items[0] else {
            panic!()
        };
        let values: Vec<_> = c
            .entries
            .iter()
            .map(|(_, e)| match e.kind {
                ExprKind::Quantity {
                    value, per_device, ..
                } => (value, per_device),
                ExprKind::Int(n) => (n as f64, false),
                _ => panic!(),
            })
            .collect();
        assert_eq!(
            values,
            vec![(3e11, true), (2e-6, false), (5e10, false), (1.0, false)]
        );
    }

    #[test]
    fn too_deep_nesting_is_refused_before_parsing() {
        let text = format!(
            "model m() {{ x = {}1{} }}",
            "(".repeat(500),
            ")".repeat(500)
        );
        assert_eq!(parse(&text).unwrap_err().code, "dpl::too-deep");
    }

    #[test]
    fn a_name_is_the_grammars_ident_and_never_a_keyword() {
        for name in ["gpt", "_x", "inputs", "model_model", "m7b", "returned"] {
            assert!(is_name(name), "{name}");
        }
        for name in [
            "input", "model", "true", "repeat", "", "7b", "a-b", "a b", "x.",
        ] {
            assert!(!is_name(name), "{name}");
        }
    }

    #[test]
    fn keywords_need_a_word_boundary() {
        assert!(parse("model m() { returned = 1  return returned }").is_ok());
    }
}
