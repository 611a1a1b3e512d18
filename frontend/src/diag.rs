//! Diagnostics: the frontend's one error type. Internally an error is a `Diag`
//! (code, message, span, label, help, notes); `Diagnostics` binds them to the
//! source text and renders them with miette, caret under the span.

use crate::ast::{FileId, Span};
use miette::{
    GraphicalReportHandler, GraphicalTheme, LabeledSpan, NamedSource, Severity, SourceSpan,
};
use std::fmt;
use std::sync::Arc;

/// One problem found while reading or lowering, before it is bound to source text.
#[derive(Clone, Debug)]
pub struct Diag {
    pub code: &'static str,
    pub message: String,
    pub span: Span,
    pub label: String,
    pub help: Option<String>,
    /// Further places worth showing, e.g. the call that led into a std block.
    pub notes: Vec<(Span, String)>,
}

/// Internal results box the error: it is large and rare.
pub type Res<T> = Result<T, Box<Diag>>;

impl Diag {
    pub fn new(code: &'static str, span: Span, message: impl Into<String>) -> Box<Diag> {
        Box::new(Diag {
            code,
            message: message.into(),
            span,
            label: String::new(),
            help: None,
            notes: Vec::new(),
        })
    }
}

/// Builder-style additions on a boxed diagnostic.
pub trait DiagExt {
    fn label(self, label: impl Into<String>) -> Self;
    fn help(self, help: impl Into<String>) -> Self;
    fn note(self, span: Span, text: impl Into<String>) -> Self;
}

impl DiagExt for Box<Diag> {
    fn label(mut self, label: impl Into<String>) -> Self {
        self.label = label.into();
        self
    }
    fn help(mut self, help: impl Into<String>) -> Self {
        self.help = Some(help.into());
        self
    }
    fn note(mut self, span: Span, text: impl Into<String>) -> Self {
        self.notes.push((span, text.into()));
        self
    }
}

/// A loaded source file: its name as shown in diagnostics and its text.
#[derive(Clone, Debug)]
pub struct Source {
    pub name: String,
    pub text: Arc<String>,
}

/// One rendered-ready diagnostic with its source attached.
#[derive(Debug)]
pub struct Diagnostic {
    code: &'static str,
    message: String,
    severity: Severity,
    source: NamedSource<Arc<String>>,
    span: SourceSpan,
    label: String,
    help: Option<String>,
}

impl fmt::Display for Diagnostic {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.message)
    }
}

impl std::error::Error for Diagnostic {}

impl miette::Diagnostic for Diagnostic {
    fn code<'a>(&'a self) -> Option<Box<dyn fmt::Display + 'a>> {
        Some(Box::new(self.code))
    }
    fn severity(&self) -> Option<Severity> {
        Some(self.severity)
    }
    fn help<'a>(&'a self) -> Option<Box<dyn fmt::Display + 'a>> {
        self.help
            .as_ref()
            .map(|h| Box::new(h) as Box<dyn fmt::Display>)
    }
    fn source_code(&self) -> Option<&dyn miette::SourceCode> {
        Some(&self.source)
    }
    fn labels(&self) -> Option<Box<dyn Iterator<Item = LabeledSpan> + '_>> {
        let label = (!self.label.is_empty()).then(|| self.label.clone());
        Some(Box::new(std::iter::once(LabeledSpan::new_with_span(
            label, self.span,
        ))))
    }
}

/// One or more diagnostics: the first is the error, the rest come as `related()`.
#[derive(Debug)]
pub struct Diagnostics {
    // Boxed: results carrying diagnostics stay small on the happy path.
    first: Box<Diagnostic>,
    rest: Vec<Diagnostic>,
}

impl Diagnostics {
    /// Bind internal diagnostics to their source files. `diags` is non-empty.
    pub(crate) fn new(
        sources: &[Source],
        diags: impl IntoIterator<Item = Box<Diag>>,
    ) -> Diagnostics {
        let mut all = Vec::new();
        for d in diags {
            let d = *d;
            all.push(bind(
                sources,
                d.code,
                Severity::Error,
                d.message,
                d.span,
                d.label,
                d.help,
            ));
            for (span, text) in d.notes {
                all.push(bind(
                    sources,
                    "dpl::note",
                    Severity::Advice,
                    text,
                    span,
                    String::new(),
                    None,
                ));
            }
        }
        let mut iter = all.into_iter();
        let first = iter.next().unwrap_or_else(|| {
            bind(
                sources,
                "dpl::internal",
                Severity::Error,
                "no diagnostic was recorded".into(),
                Span {
                    file: FileId(0),
                    start: 0,
                    end: 0,
                },
                String::new(),
                None,
            )
        });
        Diagnostics {
            first: Box::new(first),
            rest: iter.collect(),
        }
    }

    pub(crate) fn one(sources: &[Source], diag: Box<Diag>) -> Diagnostics {
        Diagnostics::new(sources, vec![diag])
    }

    /// How many diagnostics there are, notes included.
    pub fn len(&self) -> usize {
        1 + self.rest.len()
    }

    /// Never true: there is always at least one diagnostic.
    pub fn is_empty(&self) -> bool {
        false
    }

    /// The error codes, in order (e.g. `dpl::unknown-name`).
    pub fn codes(&self) -> Vec<&'static str> {
        std::iter::once(self.first.as_ref())
            .chain(&self.rest)
            .map(|d| d.code)
            .collect()
    }

    /// The diagnostics as text without colour: stable for snapshots.
    pub fn render_plain(&self) -> String {
        let handler = GraphicalReportHandler::new_themed(GraphicalTheme::unicode_nocolor())
            .with_width(100)
            .with_links(false);
        let mut out = String::new();
        if handler.render_report(&mut out, self).is_err() {
            out = self.to_string();
        }
        out
    }
}

fn bind(
    sources: &[Source],
    code: &'static str,
    severity: Severity,
    message: String,
    span: Span,
    label: String,
    help: Option<String>,
) -> Diagnostic {
    let (name, text) = match sources.get(span.file.0 as usize) {
        Some(s) => (s.name.clone(), s.text.clone()),
        None => ("<unknown>".to_string(), Arc::new(String::new())),
    };
    // Clamp: a span past the end would make the renderer drop the snippet.
    let start = span.start.min(text.len());
    let end = span.end.clamp(start, text.len());
    Diagnostic {
        code,
        message,
        severity,
        source: NamedSource::new(name, text),
        span: SourceSpan::new(start.into(), end - start),
        label,
        help,
    }
}

impl fmt::Display for Diagnostics {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.first.message)
    }
}

impl std::error::Error for Diagnostics {}

impl miette::Diagnostic for Diagnostics {
    fn code<'a>(&'a self) -> Option<Box<dyn fmt::Display + 'a>> {
        self.first.code()
    }
    fn severity(&self) -> Option<Severity> {
        self.first.severity()
    }
    fn help<'a>(&'a self) -> Option<Box<dyn fmt::Display + 'a>> {
        self.first.help()
    }
    fn source_code(&self) -> Option<&dyn miette::SourceCode> {
        self.first.source_code()
    }
    fn labels(&self) -> Option<Box<dyn Iterator<Item = LabeledSpan> + '_>> {
        self.first.labels()
    }
    fn related<'a>(&'a self) -> Option<Box<dyn Iterator<Item = &'a dyn miette::Diagnostic> + 'a>> {
        if self.rest.is_empty() {
            return None;
        }
        Some(Box::new(
            self.rest.iter().map(|d| d as &dyn miette::Diagnostic),
        ))
    }
}

/// `line:column` of byte `offset` in `text`, both from 1, counted as the
/// header of a rendered diagnostic counts them (columns in bytes, `\r\n` or a
/// lone `\r` ends a line), so that a message and its header agree.
pub fn line_col(text: &str, offset: usize) -> String {
    let bytes = &text.as_bytes()[..offset.min(text.len())];
    let (mut line, mut start) = (1, 0);
    let mut i = 0;
    while i < bytes.len() {
        match bytes[i] {
            b'\r' if bytes.get(i + 1) == Some(&b'\n') => {}
            b'\n' | b'\r' => {
                line += 1;
                start = i + 1;
            }
            _ => {}
        }
        i += 1;
    }
    format!("{line}:{}", bytes.len() - start + 1)
}

/// Up to three known names closest to `name`, for "did you mean" hints.
pub fn suggest<'a>(name: &str, known: impl IntoIterator<Item = &'a str>) -> Vec<String> {
    let mut scored: Vec<(f64, &str)> = known
        .into_iter()
        .filter(|k| *k != name)
        .map(|k| (strsim::jaro_winkler(name, k), k))
        .filter(|(score, _)| *score >= 0.8)
        .collect();
    scored.sort_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(b.1)));
    scored.dedup_by(|a, b| a.1 == b.1);
    scored
        .into_iter()
        .take(3)
        .map(|(_, k)| format!("`{k}`"))
        .collect()
}

/// "did you mean `a` or `b`?" or `None` when nothing is close.
pub fn did_you_mean<'a>(name: &str, known: impl IntoIterator<Item = &'a str>) -> Option<String> {
    let s = suggest(name, known);
    match s.len() {
        0 => None,
        1 => Some(format!("did you mean {}?", s[0])),
        _ => Some(format!(
            "did you mean {} or {}?",
            s[..s.len() - 1].join(", "),
            s[s.len() - 1]
        )),
    }
}
