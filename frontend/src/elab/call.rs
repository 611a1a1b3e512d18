//! Calls: builtins (through [`crate::lowering::Lowering`]) and blocks, their
//! arguments bound by position and keyword, each block call in a scope of
//! its own (`name = "…"`), parameters shared with `share = "…"`.

use super::*;

impl<'p> Elab<'p> {
    pub(super) fn find_block(&self, name: &str) -> Option<&'p FnDef> {
        if self.in_user_file() {
            if let Some(b) = self.prog.user_blocks.get(name) {
                return Some(b);
            }
        }
        self.prog.std_blocks.get(name)
    }

    pub(super) fn call(&mut self, callee: &Ident, args: &[Arg], span: Span) -> Res<Value> {
        if self.section_mode {
            let mut fields = Vec::new();
            for a in args {
                let Some(n) = &a.name else {
                    return Err(Diag::new(
                        "dpl::record-positional",
                        a.value.span,
                        format!("the fields of `{}(…)` need names", callee.name),
                    )
                    .label("write `key = value`"));
                };
                if fields
                    .iter()
                    .any(|(k, _, _): &(String, Value, Span)| *k == n.name)
                {
                    return Err(Diag::new(
                        "dpl::duplicate-keyword",
                        n.span,
                        format!("field `{}` is given twice", n.name),
                    )
                    .label("given again here"));
                }
                let v = self.eval(&a.value)?;
                fields.push((n.name.clone(), v, a.value.span));
            }
            return Ok(Value::Record {
                kind: callee.name.clone(),
                fields,
            });
        }
        let mut values = Vec::new();
        for a in args {
            values.push((a.name.clone(), self.eval(&a.value)?, a.value.span));
        }
        if let Some(def) = self.find_block(&callee.name) {
            return self.call_block(def, values, callee, span);
        }
        if let Some(b) = builtins::find(&callee.name) {
            let names: Vec<&str> = b.params.iter().map(|(n, _)| *n).collect();
            let bound = self.bind_args(&names, &b.signature(), values, callee, span)?;
            let mut full = Vec::new();
            for ((pname, default), slot) in b.params.iter().zip(bound) {
                full.push(match (slot, default) {
                    (Some(v), _) => v,
                    (None, builtins::ArgDefault::Int(i)) => (Value::Int(*i), span),
                    (None, builtins::ArgDefault::Float(x)) => (Value::Float(*x), span),
                    (None, builtins::ArgDefault::Bool(x)) => (Value::Bool(*x), span),
                    (None, builtins::ArgDefault::Required) => {
                        return Err(self.missing_arg(pname, &b.signature(), span));
                    }
                });
            }
            return builtins::call(self, b, full, span);
        }
        if self.prog.models.iter().any(|m| m.name.name == callee.name) {
            return Err(Diag::new(
                "dpl::call-model",
                callee.span,
                format!(
                    "`{}` is a model; only blocks and builtins can be called",
                    callee.name
                ),
            )
            .label("a model"));
        }
        let mut names: Vec<String> = builtins::BUILTINS
            .iter()
            .map(|b| b.name.to_string())
            .collect();
        names.extend(self.prog.std_blocks.keys().cloned());
        if self.in_user_file() {
            names.extend(self.prog.user_blocks.keys().cloned());
        }
        let d = Diag::new(
            "dpl::unknown-block",
            callee.span,
            format!("unknown block or builtin `{}`", callee.name),
        )
        .label("not a block or builtin");
        Err(match did_you_mean(&callee.name, names.iter().map(String::as_str)) {
            Some(s) => d.help(s),
            None => d.help("blocks are declared with `block name(…) { … }`; docs/language.md lists the builtins"),
        })
    }

    pub(super) fn missing_arg(&self, name: &str, signature: &str, span: Span) -> Box<Diag> {
        Diag::new("dpl::arg-count", span, format!("missing argument `{name}`"))
            .label(format!("`{name}` is not given"))
            .help(format!("the signature is {signature}"))
    }

    /// Match positional then keyword arguments to formals.
    pub(super) fn bind_args(
        &self,
        formals: &[&str],
        signature: &str,
        args: Vec<(Option<Ident>, Value, Span)>,
        callee: &Ident,
        span: Span,
    ) -> Res<Vec<Option<(Value, Span)>>> {
        let mut slots: Vec<Option<(Value, Span)>> = vec![None; formals.len()];
        let mut positional = 0;
        let mut seen_keyword = false;
        for (name, v, at) in args {
            match name {
                None => {
                    if seen_keyword {
                        return Err(Diag::new(
                            "dpl::arg-order",
                            at,
                            "a positional argument after a keyword argument",
                        )
                        .label("move this before the keyword arguments")
                        .help(format!("the signature is {signature}")));
                    }
                    if positional >= formals.len() {
                        return Err(Diag::new(
                            "dpl::arg-count",
                            span,
                            format!(
                                "`{}` takes {} argument{}, but {} or more were given",
                                callee.name,
                                formals.len(),
                                if formals.len() == 1 { "" } else { "s" },
                                positional + 1
                            ),
                        )
                        .label("too many arguments")
                        .help(format!("the signature is {signature}")));
                    }
                    slots[positional] = Some((v, at));
                    positional += 1;
                }
                Some(n) => {
                    seen_keyword = true;
                    let Some(i) = formals.iter().position(|f| *f == n.name) else {
                        let d = Diag::new(
                            "dpl::unknown-keyword",
                            n.span,
                            format!("`{}` has no parameter `{}`", callee.name, n.name),
                        )
                        .label("unknown keyword");
                        let hint = did_you_mean(&n.name, formals.iter().copied());
                        return Err(d.help(match hint {
                            Some(h) => format!("{h} the signature is {signature}"),
                            None => format!("the signature is {signature}"),
                        }));
                    };
                    if slots[i].is_some() {
                        return Err(Diag::new(
                            "dpl::duplicate-keyword",
                            n.span,
                            format!("argument `{}` is given twice", n.name),
                        )
                        .label("given again here")
                        .help(format!("the signature is {signature}")));
                    }
                    slots[i] = Some((v, at));
                }
            }
        }
        Ok(slots)
    }

    pub fn signature(&self, def: &FnDef) -> String {
        let params: Vec<String> = def
            .formals
            .iter()
            .map(|f| match &f.default {
                Some(d) => format!("{} = {}", f.name.name, self.prog.text(d.span)),
                None => f.name.name.clone(),
            })
            .collect();
        format!("{}({})", def.name.name, params.join(", "))
    }

    pub(super) fn unknown_keyword(&self, key: &str, span: Span, def: &FnDef) -> Box<Diag> {
        let names: Vec<&str> = def.formals.iter().map(|f| f.name.name.as_str()).collect();
        let d = Diag::new(
            "dpl::unknown-keyword",
            span,
            format!("`{}` has no parameter `{key}`", def.name.name),
        )
        .label("unknown keyword");
        let sig = self.signature(def);
        d.help(match did_you_mean(key, names) {
            Some(h) => format!("{h} the signature is {sig}"),
            None => format!("the signature is {sig}"),
        })
    }

    pub(super) fn call_block(
        &mut self,
        def: &'p FnDef,
        mut args: Vec<(Option<Ident>, Value, Span)>,
        callee: &Ident,
        span: Span,
    ) -> Res<Value> {
        let name = &def.name.name;
        if self.calls.iter().any(|c| c == name) || self.calls.len() >= MAX_CALL_DEPTH {
            return Err(Diag::new(
                "dpl::recursive-block",
                callee.span,
                format!("block `{name}` calls itself"),
            )
            .label("recursive call")
            .help(format!(
                "blocks are inlined while compiling, so they cannot recurse; call chain: {} → {name}",
                self.calls.join(" → ")
            )));
        }
        // `name = "q"` names the block instance's scope (and so its parameters).
        let mut scope_name = name.clone();
        let mut named_at = None;
        if let Some(i) = args
            .iter()
            .position(|(n, _, _)| n.as_ref().is_some_and(|n| n.name == "name"))
        {
            let (key, v, at) = args.remove(i);
            match v {
                Value::Str(s) if is_scope_name(&s) => {
                    scope_name = s;
                    named_at = Some(key.map_or(at, |k| k.span.to(at)));
                }
                other => {
                    return Err(self.expected(
                        &other,
                        at,
                        "a name string such as \"q\" (letters, digits, _)",
                    ))
                }
            }
        }
        // `share = "enc.embed"`: the parameters of an earlier call, not new ones.
        let mut share = None;
        if let Some(i) = args
            .iter()
            .position(|(n, _, _)| n.as_ref().is_some_and(|n| n.name == "share"))
        {
            let (key, v, at) = args.remove(i);
            match v {
                Value::Str(s) if !s.is_empty() && s.split('.').all(is_scope_name) => {
                    share = Some((s, key.map_or(at, |k| k.span.to(at))));
                }
                other => {
                    return Err(self.expected(
                        &other,
                        at,
                        "a parameter path string such as \"enc.embed\" (names joined by .)",
                    ))
                }
            }
        }
        let formals: Vec<&str> = def.formals.iter().map(|f| f.name.name.as_str()).collect();
        let sig = self.signature(def);
        let bound = self.bind_args(&formals, &sig, args, callee, span)?;
        let outer_scope = self.scope;
        let block_scope = self.open_scope(
            &scope_name,
            ScopeKind::Block {
                block: name.clone(),
            },
            named_at.unwrap_or(span),
            named_at.is_some(),
        )?;
        self.calls.push(name.clone());
        self.frames.push(Frame {
            scopes: vec![HashMap::new()],
            level_base: self.levels.len(),
            file: def.name.span.file,
        });
        self.scope = block_scope;
        let outer_sharing = match share {
            Some((path, at)) => self.sharing.replace((block_scope, path, at)),
            None => self.sharing.clone(),
        };
        let result = self.run_block(def, bound, span, &sig);
        self.sharing = outer_sharing;
        self.scope = outer_scope;
        self.frames.pop();
        self.calls.pop();
        result.map_err(|mut d| {
            if self.prog.is_std(d.span.file) && !self.prog.is_std(span.file) && d.notes.is_empty() {
                d.notes
                    .push((span, format!("the error is inside this call of `{name}`")));
            }
            d
        })
    }

    /// A new scope under the current one, named `base` or, when a sibling has
    /// that name already, numbered by the graph (`linear_1`). A name given
    /// with `name = "…"` is never numbered: reusing one is an error, as is a
    /// numbered name that a `name =` took before (both would be one path).
    pub(super) fn open_scope(
        &mut self,
        base: &str,
        kind: ScopeKind,
        origin: Span,
        explicit: bool,
    ) -> Res<ScopeId> {
        let parent = self.scope;
        let taken = |e: &Self, name: &str, message: String| -> Option<Box<Diag>> {
            let first = *e.scope_origins.get(&(parent, name.to_string()))?;
            Some(
                Diag::new(
                    "dpl::duplicate-name",
                    origin,
                    format!(
                        "{message} is already used in this scope at {}",
                        e.prog.line_col(first)
                    ),
                )
                .label("used again here")
                .note(first, format!("`{name}` first named here"))
                .help("give each block call in a scope its own `name = \"…\"`"),
            )
        };
        if explicit {
            if let Some(d) = taken(self, base, format!("the name `{base}`")) {
                return Err(d);
            }
        }
        let id = self.g.add_scope(parent, base, kind);
        let unique = self.g.scope(id).name.clone();
        if let Some(d) = taken(
            self,
            &unique,
            format!("this `{base}` would be named `{unique}`, which"),
        ) {
            return Err(d);
        }
        self.scope_origins.insert((parent, unique), origin);
        Ok(id)
    }

    pub(super) fn run_block(
        &mut self,
        def: &'p FnDef,
        bound: Vec<Option<(Value, Span)>>,
        span: Span,
        sig: &str,
    ) -> Res<Value> {
        for (f, slot) in def.formals.iter().zip(bound) {
            let v = match (slot, &f.default) {
                (Some((v, _)), _) => v,
                (None, Some(d)) => self.eval(d)?,
                (None, None) => return Err(self.missing_arg(&f.name.name, sig, span)),
            };
            let scalar = match &v {
                Value::Int(i) => Some(ScalarArg::Int(*i)),
                Value::Float(x) => Some(ScalarArg::Float(*x)),
                Value::Bool(b) => Some(ScalarArg::Bool(*b)),
                Value::Str(s) => Some(ScalarArg::Str(s.clone())),
                _ => None,
            };
            if let Some(scalar) = scalar {
                self.g.add_scope_arg(self.scope, &f.name.name, scalar);
            }
            if let Some(frame) = self.frames.last_mut() {
                if let Some(s) = frame.scopes.first_mut() {
                    s.insert(f.name.name.clone(), v);
                }
            }
        }
        match self.exec(&def.body)? {
            Flow::Return(v) => Ok(v),
            Flow::Next => Err(Diag::new(
                "dpl::missing-return",
                def.name.span,
                format!("block `{}` ends without `return`", def.name.name),
            )
            .label("no `return` on this path")
            .help("every path through a block must end in `return value`")
            .note(span, "called here")),
        }
    }
}

fn is_scope_name(s: &str) -> bool {
    !s.is_empty()
        && s.chars().all(|c| c.is_ascii_alphanumeric() || c == '_')
        && !s.starts_with(|c: char| c.is_ascii_digit())
}
