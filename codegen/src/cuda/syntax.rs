//! A small C syntax tree and its writer: the expressions and statements
//! the CUDA emitters build, rendered with the indentation a reader expects.

use super::prelude::{PRELUDE, STORAGE_BF16, STORAGE_F16, STORAGE_F32};
use dplc_ir::DType;

#[derive(Clone, Debug)]
pub(crate) enum C {
    Id(String),
    Lit(String),
    Call(String, Vec<C>),
    Bin(&'static str, Box<C>, Box<C>),
    Neg(Box<C>),
    At(Box<C>, Box<C>),
    Cond(Box<C>, Box<C>, Box<C>),
    Cast(&'static str, Box<C>),
    /// `&x`: the address of an element (atomic adds).
    Ref(Box<C>),
}

pub(crate) fn id(s: impl Into<String>) -> C {
    C::Id(s.into())
}

pub(crate) fn call(f: &str, args: Vec<C>) -> C {
    C::Call(f.to_string(), args)
}

pub(crate) fn bin(op: &'static str, a: C, b: C) -> C {
    C::Bin(op, Box::new(a), Box::new(b))
}

pub(crate) fn at(a: C, i: C) -> C {
    C::At(Box::new(a), Box::new(i))
}

impl C {
    pub(crate) fn render(&self) -> String {
        match self {
            C::Id(s) | C::Lit(s) => s.clone(),
            C::Call(f, args) => {
                let args: Vec<String> = args.iter().map(C::render).collect();
                format!("{f}({})", args.join(", "))
            }
            C::Bin(op, a, b) => format!("({} {op} {})", a.render(), b.render()),
            C::Neg(a) => format!("(-{})", a.render()),
            C::At(a, i) => format!("{}[{}]", a.render(), i.render()),
            C::Cond(c, a, b) => format!("({} ? {} : {})", c.render(), a.render(), b.render()),
            C::Cast(t, a) => format!("(({t}){})", a.render()),
            C::Ref(a) => format!("(&{})", a.render()),
        }
    }
}

#[derive(Clone, Debug)]
pub(crate) enum S {
    /// `[const] ty name[ = init];`
    Decl {
        ty: String,
        name: String,
        init: Option<C>,
        konst: bool,
    },
    Assign(C, C),
    For {
        var: String,
        from: C,
        to: C,
        step: C,
        body: Vec<S>,
    },
    If(C, Vec<S>),
    Block(Vec<S>),
    Line(String),
    /// An expression evaluated for its effect: `f(x);`.
    Expr(C),
    /// `[__shared__ __align__(16)] ty name[len];`: a per-thread or a block's array.
    Array {
        ty: &'static str,
        name: String,
        len: usize,
        shared: bool,
    },
    /// `#pragma unroll` for the loop that follows.
    Unroll,
}

pub(crate) fn decl(ty: &str, name: impl Into<String>, init: C) -> S {
    S::Decl {
        ty: ty.to_string(),
        name: name.into(),
        init: Some(init),
        konst: true,
    }
}

pub(crate) fn var(ty: &str, name: impl Into<String>, init: Option<C>) -> S {
    S::Decl {
        ty: ty.to_string(),
        name: name.into(),
        init,
        konst: false,
    }
}

pub(crate) struct Writer {
    pub(crate) out: String,
    pub(crate) depth: usize,
}

impl Writer {
    /// A translation unit's start: the fixed helpers and the storage type's
    /// load/store helpers for `dtype`, shared by every generated kernel.
    pub(crate) fn with_prelude(dtype: DType) -> Writer {
        let mut w = Writer {
            out: String::new(),
            depth: 0,
        };
        w.out.push_str(PRELUDE);
        w.out.push_str(match dtype {
            DType::BF16 => STORAGE_BF16,
            DType::F16 => STORAGE_F16,
            DType::F32 | DType::I32 => STORAGE_F32,
        });
        w
    }

    pub(crate) fn line(&mut self, s: &str) {
        for _ in 0..self.depth {
            self.out.push_str("    ");
        }
        self.out.push_str(s);
        self.out.push('\n');
    }

    pub(crate) fn stmts(&mut self, body: &[S]) {
        for s in body {
            self.stmt(s);
        }
    }

    fn stmt(&mut self, s: &S) {
        match s {
            S::Decl {
                ty,
                name,
                init,
                konst,
            } => {
                let k = if *konst { "const " } else { "" };
                match init {
                    Some(i) => self.line(&format!("{k}{ty} {name} = {};", i.render())),
                    None => self.line(&format!("{ty} {name};")),
                }
            }
            S::Assign(l, r) => self.line(&format!("{} = {};", l.render(), r.render())),
            S::For {
                var,
                from,
                to,
                step,
                body,
            } => {
                self.line(&format!(
                    "for (long long {var} = {}; {var} < {}; {var} += {}) {{",
                    from.render(),
                    to.render(),
                    step.render()
                ));
                self.depth += 1;
                self.stmts(body);
                self.depth -= 1;
                self.line("}");
            }
            S::If(c, body) => {
                self.line(&format!("if ({}) {{", c.render()));
                self.depth += 1;
                self.stmts(body);
                self.depth -= 1;
                self.line("}");
            }
            S::Block(body) => {
                self.line("{");
                self.depth += 1;
                self.stmts(body);
                self.depth -= 1;
                self.line("}");
            }
            S::Line(l) => self.line(l),
            S::Expr(c) => self.line(&format!("{};", c.render())),
            S::Array {
                ty,
                name,
                len,
                shared,
            } => {
                let q = if *shared {
                    "__shared__ __align__(16) "
                } else {
                    ""
                };
                self.line(&format!("{q}{ty} {name}[{len}];"))
            }
            S::Unroll => self.line("#pragma unroll"),
        }
    }
}

/// This thread's index in the whole grid, as `long long`.
pub(crate) fn grid_thread() -> C {
    bin(
        "+",
        bin(
            "*",
            C::Cast("long long", Box::new(id("blockIdx.x"))),
            id("blockDim.x"),
        ),
        id("threadIdx.x"),
    )
}
