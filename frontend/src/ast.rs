//! The syntax tree of a .dpl file: items, statements and expressions, each
//! carrying the span it came from so that every later error can point at it.

/// Which loaded file a span lies in (index into the unit's sources).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct FileId(pub u16);

/// A byte range of one source file.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Span {
    pub file: FileId,
    pub start: usize,
    pub end: usize,
}

impl Span {
    /// The smallest span covering both.
    pub fn to(self, other: Span) -> Span {
        Span {
            file: self.file,
            start: self.start.min(other.start),
            end: self.end.max(other.end),
        }
    }
}

#[derive(Clone, Debug)]
pub struct Ident {
    pub name: String,
    pub span: Span,
}

#[derive(Clone, Debug)]
pub enum Item {
    Block(FnDef),
    Model(FnDef),
    Variant(Variant),
    Train(Section),
    Cluster(Section),
}

/// A formal parameter of a block or model, with its default value.
#[derive(Clone, Debug)]
pub struct Formal {
    pub name: Ident,
    pub default: Option<Expr>,
}

/// A `block` or a `model`: a name, formals and a body.
#[derive(Clone, Debug)]
pub struct FnDef {
    pub name: Ident,
    pub formals: Vec<Formal>,
    pub body: Vec<Stmt>,
    pub span: Span,
}

/// `model name = base(key = value, …)`.
#[derive(Clone, Debug)]
pub struct Variant {
    pub name: Ident,
    pub base: Ident,
    pub args: Vec<Arg>,
    pub span: Span,
}

/// A `train` or `cluster` section: `key = value` entries.
#[derive(Clone, Debug)]
pub struct Section {
    pub name: Ident,
    pub entries: Vec<(Ident, Expr)>,
}

#[derive(Clone, Debug)]
pub struct Stmt {
    pub kind: StmtKind,
    pub span: Span,
}

#[derive(Clone, Debug)]
pub enum StmtKind {
    Input {
        name: Ident,
        dtype: Ident,
        dims: Vec<Expr>,
    },
    Param {
        name: Ident,
        dims: Vec<Expr>,
        init: Option<Expr>,
    },
    Assign {
        targets: Vec<Ident>,
        value: Expr,
    },
    Repeat {
        count: Expr,
        body: Vec<Stmt>,
    },
    /// `if c {…} else if c {…} else {…}`: the arms in order, then the else.
    If {
        arms: Vec<(Expr, Vec<Stmt>)>,
        otherwise: Option<Vec<Stmt>>,
    },
    Return(Vec<Expr>),
    /// A call evaluated for its effect (checks with `error`).
    Call(Expr),
}

/// An argument of a call: positional when `name` is `None`.
#[derive(Clone, Debug)]
pub struct Arg {
    pub name: Option<Ident>,
    pub value: Expr,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum UnOp {
    Neg,
    Not,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BinOp {
    Or,
    And,
    Eq,
    Ne,
    Lt,
    Le,
    Gt,
    Ge,
    Add,
    Sub,
    Mul,
    Div,
    Mod,
    MatMul,
    Pow,
}

impl BinOp {
    pub fn symbol(self) -> &'static str {
        match self {
            BinOp::Or => "or",
            BinOp::And => "and",
            BinOp::Eq => "==",
            BinOp::Ne => "!=",
            BinOp::Lt => "<",
            BinOp::Le => "<=",
            BinOp::Gt => ">",
            BinOp::Ge => ">=",
            BinOp::Add => "+",
            BinOp::Sub => "-",
            BinOp::Mul => "*",
            BinOp::Div => "/",
            BinOp::Mod => "%",
            BinOp::MatMul => "@",
            BinOp::Pow => "**",
        }
    }
}

/// What a unit measures; values are kept in SI base units.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum UnitKind {
    /// Bytes per second.
    Bandwidth,
    /// Seconds.
    Time,
    /// Bytes.
    Bytes,
    /// Floating-point operations per second.
    FlopRate,
}

impl UnitKind {
    pub fn name(self) -> &'static str {
        match self {
            UnitKind::Bandwidth => "a bandwidth",
            UnitKind::Time => "a time",
            UnitKind::Bytes => "a size in bytes",
            UnitKind::FlopRate => "a compute rate",
        }
    }
}

#[derive(Clone, Debug)]
pub struct Expr {
    pub kind: ExprKind,
    pub span: Span,
}

#[derive(Clone, Debug)]
pub enum ExprKind {
    Int(i64),
    Float(f64),
    Bool(bool),
    Str(String),
    Quantity {
        value: f64,
        unit: UnitKind,
        per_device: bool,
    },
    Name(String),
    Call {
        callee: Ident,
        args: Vec<Arg>,
    },
    Unary(UnOp, Box<Expr>),
    Binary(BinOp, Box<Expr>, Box<Expr>),
    Tuple(Vec<Expr>),
    List(Vec<Expr>),
}
