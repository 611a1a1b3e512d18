//! Statements: assignments, `if`, `param` (and `share = ` parameters),
//! `input`, `repeat` (its body lowered once into a region) and `return`.

use super::*;

impl<'p> Elab<'p> {
    pub(super) fn exec(&mut self, stmts: &[Stmt]) -> Res<Flow> {
        for s in stmts {
            if let Flow::Return(v) = self.stmt(s)? {
                return Ok(Flow::Return(v));
            }
        }
        Ok(Flow::Next)
    }

    pub(super) fn stmt(&mut self, s: &Stmt) -> Res<Flow> {
        match &s.kind {
            StmtKind::Assign { targets, value } => {
                let v = self.eval(value)?;
                if targets.len() == 1 {
                    self.bind(&targets[0].name, v);
                    return Ok(Flow::Next);
                }
                let items = match v {
                    Value::Tuple(xs) | Value::List(xs) if xs.len() == targets.len() => xs,
                    other => {
                        return Err(Diag::new(
                            "dpl::destructure",
                            value.span,
                            format!(
                                "{} names on the left but the right side is {}",
                                targets.len(),
                                other.describe(&self.g)
                            ),
                        )
                        .label(format!("needs a tuple of {} values", targets.len())))
                    }
                };
                for (t, v) in targets.iter().zip(items) {
                    self.bind(&t.name, v);
                }
                Ok(Flow::Next)
            }
            StmtKind::Param { name, dims, init } => {
                self.param(name, dims, init.as_ref(), s.span)?;
                Ok(Flow::Next)
            }
            StmtKind::Input { name, dtype, dims } => {
                self.input(name, dtype, dims, s.span)?;
                Ok(Flow::Next)
            }
            StmtKind::If { arms, otherwise } => {
                for (cond, body) in arms {
                    let c = self.eval(cond)?;
                    match c {
                        Value::Bool(true) => return self.exec(body),
                        Value::Bool(false) => {}
                        other => {
                            return Err(self.expected(
                                &other,
                                cond.span,
                                "a bool (conditions are decided while compiling)",
                            ))
                        }
                    }
                }
                match otherwise {
                    Some(body) => self.exec(body),
                    None => Ok(Flow::Next),
                }
            }
            StmtKind::Repeat { count, body } => {
                self.repeat(count, body, s.span)?;
                Ok(Flow::Next)
            }
            StmtKind::Call(call) => {
                self.eval(call)?;
                Ok(Flow::Next)
            }
            StmtKind::Return(values) => {
                let base = self.frame().map_or(1, |f| f.level_base);
                if self.levels.len() != base {
                    return Err(Diag::new(
                        "dpl::return-in-repeat",
                        s.span,
                        "`return` inside a `repeat` body",
                    )
                    .label("a repeat body cannot return")
                    .help("assign to a variable in the body and return after the repeat"));
                }
                let mut vs = Vec::new();
                for v in values {
                    vs.push(self.eval(v)?);
                }
                Ok(Flow::Return(if vs.len() == 1 {
                    vs.pop().unwrap_or(Value::Tuple(Vec::new()))
                } else {
                    Value::Tuple(vs)
                }))
            }
        }
    }

    pub(super) fn param(
        &mut self,
        name: &Ident,
        dims: &[Expr],
        init: Option<&Expr>,
        span: Span,
    ) -> Res<()> {
        let mut shape = Vec::new();
        let mut elements: u128 = 1;
        for d in dims {
            let v = self.eval(d)?;
            let dim = self.dim_arg(&v, d.span)?;
            match dim.as_const() {
                Some(n) => elements = elements.saturating_mul(n as u128),
                None => {
                    return Err(Diag::new(
                        "dpl::symbolic-param",
                        d.span,
                        format!(
                            "a parameter's dimensions must be constants, `{}` is {}",
                            self.prog.text(d.span),
                            self.g.dim_str(&dim)
                        ),
                    )
                    .label("depends on the input size"))
                }
            }
            shape.push(dim);
        }
        if elements > MAX_PARAM_ELEMENTS {
            return Err(Diag::new(
                "dpl::too-large",
                name.span,
                format!("parameter `{}` would have {elements} elements", name.name),
            )
            .label("too large")
            .help("a parameter may have at most 2^50 elements"));
        }
        let init = match init {
            None => Init::Normal { std: 0.02 },
            Some(e) => self.init(e)?,
        };
        let key = (self.scope, name.name.clone());
        if self.sharing.is_some() && !self.param_origins.contains_key(&key) {
            self.param_origins.insert(key, name.span);
            let t = self.shared_param(name, &shape)?;
            self.bind(&name.name, Value::Tensor(t));
            return Ok(());
        }
        if let Some(first) = self.param_origins.get(&key) {
            return Err(Diag::new(
                "dpl::duplicate-param",
                name.span,
                format!(
                    "parameter `{}` is already declared in this scope at {}",
                    name.name,
                    self.prog.line_col(*first)
                ),
            )
            .label("declared again here")
            .note(*first, format!("`{}` first declared here", name.name))
            .help("give each parameter of a block its own name"));
        }
        self.param_origins.insert(key, name.span);
        self.check_budget(span)?;
        let region = self.region();
        let t = self
            .g
            .add_param(
                region,
                self.scope,
                &name.name,
                DType::F32,
                Shape(shape),
                init,
            )
            .map_err(|err| self.ir_error(err, name.span))?;
        self.bind(&name.name, Value::Tensor(t));
        Ok(())
    }

    /// The parameter a `share = "path"` call uses for its `param name`: the
    /// one at the same place under `path`, with the same shape, brought into
    /// the current region (one parameter read twice: its gradients add up
    /// and it is counted once).
    pub(super) fn shared_param(&mut self, name: &Ident, shape: &[Dim]) -> Res<TensorId> {
        let (call_scope, prefix, said) = self.sharing.clone().expect("called while sharing");
        let here = self.g.scope_path(self.scope);
        let base = self.g.scope_path(call_scope);
        let rel = here.strip_prefix(base.as_str()).unwrap_or("");
        let target = format!("{prefix}{rel}.{}", name.name);
        let Some(p) = self
            .g
            .params()
            .find(|(_, p)| p.name == target)
            .map(|(_, p)| p.clone())
        else {
            let near = self
                .g
                .params()
                .filter(|(_, p)| p.name.starts_with(&format!("{prefix}.")))
                .map(|(_, p)| p.name.clone())
                .collect::<Vec<_>>();
            return Err(Diag::new(
                "dpl::unknown-share",
                name.span,
                format!("`share = \"{prefix}\"` has no parameter `{target}` for `{}`", name.name),
            )
            .label("declared here, to be shared")
            .note(said, "shared from here")
            .help(if near.is_empty() {
                format!("no parameter is declared under `{prefix}` before this call: call the block once without `share` first (parameter paths look like `layers.attention.q.w`)")
            } else {
                format!("parameters under `{prefix}`: {}", near.join(", "))
            }));
        };
        if p.shape.dims() != shape {
            return Err(Diag::new(
                "dpl::shape",
                name.span,
                format!(
                    "`{}` is {} here but the shared `{target}` is {}",
                    name.name,
                    self.g.shape_str(&Shape(shape.to_vec())),
                    self.g.shape_str(&p.shape)
                ),
            )
            .label("shape differs")
            .note(said, "shared from here")
            .help("a shared block must be called with the sizes of the call it shares"));
        }
        let region = self.g.tensor_region(p.tensor);
        if !self.levels.iter().any(|l| l.region == region) {
            return Err(Diag::new(
                "dpl::unknown-share",
                said,
                format!("`{target}` belongs to a `repeat` body this call is not in"),
            )
            .label("cannot share from here")
            .help("share parameters declared outside any `repeat`, or inside the same body"));
        }
        Ok(self.localize(p.tensor))
    }

    pub(super) fn init(&mut self, e: &Expr) -> Res<Init> {
        let bad = || {
            Diag::new("dpl::bad-init", e.span, "unknown initialiser")
                .label("not an initialiser")
                .help("use `zeros`, `ones` or `normal(std = 0.02)`")
        };
        match &e.kind {
            ExprKind::Name(n) if n == "zeros" => Ok(Init::Zeros),
            ExprKind::Name(n) if n == "ones" => Ok(Init::Ones),
            ExprKind::Call { callee, args } if callee.name == "normal" && args.len() == 1 => {
                if args[0].name.as_ref().is_some_and(|n| n.name != "std") {
                    return Err(bad());
                }
                let v = self.eval(&args[0].value)?;
                match v.as_f64() {
                    Some(std) if std.is_finite() && std >= 0.0 => Ok(Init::Normal { std }),
                    _ => Err(self.expected(&v, args[0].value.span, "a non-negative number")),
                }
            }
            _ => Err(bad()),
        }
    }

    pub(super) fn input(
        &mut self,
        name: &Ident,
        dtype: &Ident,
        dims: &[Expr],
        span: Span,
    ) -> Res<()> {
        if self.frames.len() != 1 || self.levels.len() != 1 {
            return Err(Diag::new(
                "dpl::misplaced-input",
                span,
                "`input` is only allowed at the top level of a model",
            )
            .label("inside a block or repeat"));
        }
        let ty = DType::from_name(&dtype.name).ok_or_else(|| {
            let mut d = Diag::new(
                "dpl::unknown-dtype",
                dtype.span,
                format!("unknown element type `{}`", dtype.name),
            )
            .label("not a type");
            d = d.help(match did_you_mean(&dtype.name, builtins::dtype_names()) {
                Some(s) => format!("{s} types are f32, bf16, f16 and i32"),
                None => "types are f32, bf16, f16 and i32".to_string(),
            });
            d
        })?;
        let mut shape = Vec::new();
        for d in dims {
            // An unbound name in an input's dims declares a symbolic dimension.
            if let ExprKind::Name(n) = &d.kind {
                if self.lookup(n).is_none() && global(n).is_none() {
                    let sym = self.g.intern_sym(n);
                    self.bind(n, Value::Dim(Dim::sym(sym)));
                    shape.push(Dim::sym(sym));
                    continue;
                }
            }
            let v = self.eval(d)?;
            shape.push(self.dim_arg(&v, d.span)?);
        }
        let t = self
            .g
            .add_input(&name.name, ty, Shape(shape))
            .map_err(|err| self.ir_error(err, name.span))?;
        self.bind(&name.name, Value::Tensor(t));
        Ok(())
    }

    /// Lower `repeat count { body }` once into a new region.
    pub(super) fn repeat(&mut self, count_expr: &Expr, body: &[Stmt], span: Span) -> Res<()> {
        let count = match self.eval(count_expr)? {
            Value::Int(n) if (1..=MAX_REPEAT).contains(&n) => n as u64,
            Value::Int(n) => {
                return Err(Diag::new(
                    "dpl::repeat-count",
                    count_expr.span,
                    format!(
                        "a repeat count must be between 1 and {MAX_REPEAT}, `{}` is {n}",
                        self.prog.text(count_expr.span)
                    ),
                )
                .label("not a valid count"))
            }
            other => {
                return Err(self.expected(&other, count_expr.span, "a positive integer count"))
            }
        };
        if self.levels.len() > MAX_REPEAT_NESTING {
            return Err(Diag::new(
                "dpl::too-deep",
                span,
                format!("repeats are nested more than {MAX_REPEAT_NESTING} deep"),
            )
            .label("too deep"));
        }
        let scope_name = match &count_expr.kind {
            ExprKind::Name(n) => n.clone(),
            _ => "repeat".to_string(),
        };
        // Variables defined before the repeat and assigned inside it are carried.
        let mut assigned = Vec::new();
        assigned_names(body, &mut assigned);
        let mut carried: Vec<(String, Value)> = Vec::new();
        for n in assigned {
            if let Some(v) = self.lookup(&n) {
                let v = self.localize_value(v);
                carried.push((n, v));
            }
        }
        let outer_scope = self.scope;
        let body_scope = self.open_scope(&scope_name, ScopeKind::Repeat { count }, span, false)?;
        let parent_region = self.region();
        let body_region = self.g.add_region(parent_region);
        self.levels.push(Level {
            region: body_region,
            captured: HashMap::new(),
            capture_inputs: Vec::new(),
        });
        let mut scope_vars = HashMap::new();
        let mut initial = Vec::new();
        for (n, v) in &carried {
            if let Value::Tensor(t) = v {
                let info = self.g.tensor(*t).clone();
                let arg = self.g.add_region_arg(body_region, info.dtype, info.shape);
                initial.push(*t);
                scope_vars.insert(n.clone(), Value::Tensor(arg));
            } else {
                scope_vars.insert(n.clone(), v.clone());
            }
        }
        if let Some(f) = self.frames.last_mut() {
            f.scopes.push(scope_vars);
        }
        self.scope = body_scope;
        let flow = self.exec(body);
        self.scope = outer_scope;
        let finals = self
            .frames
            .last_mut()
            .and_then(|f| f.scopes.pop())
            .unwrap_or_default();
        let level = self.levels.pop();
        flow?;
        let level = level.ok_or_else(|| {
            Diag::new(
                "dpl::internal",
                span,
                "internal error: region stack is empty",
            )
        })?;
        let mut results = Vec::new();
        for (n, before) in &carried {
            let after = finals.get(n).cloned().unwrap_or_else(|| before.clone());
            match before {
                Value::Tensor(t) => {
                    let Value::Tensor(out) = after else {
                        return Err(Diag::new(
                            "dpl::repeat-carried",
                            span,
                            format!(
                                "`{n}` enters the repeat as a tensor but leaves as {}",
                                after.describe(&self.g)
                            ),
                        )
                        .label("in this repeat"));
                    };
                    let (a, b) = (self.g.tensor(*t), self.g.tensor(out));
                    if a.dtype != b.dtype || a.shape != b.shape {
                        return Err(Diag::new(
                            "dpl::repeat-carried",
                            span,
                            format!(
                                "`{n}` enters the repeat as {}{} but leaves as {}{}",
                                a.dtype,
                                self.g.shape_str(&a.shape),
                                b.dtype,
                                self.g.shape_str(&b.shape)
                            ),
                        )
                        .label("each iteration must keep the shape of what it carries"));
                    }
                    // A body that only passes the value through still yields a body value.
                    results.push(out);
                }
                other if *other != after => {
                    return Err(Diag::new(
                        "dpl::repeat-carried",
                        span,
                        format!("`{n}` is not a tensor and changes inside the repeat"),
                    )
                    .label("the body is lowered once, so only tensors may change per iteration")
                    .help("compute the value before the repeat"));
                }
                _ => {}
            }
        }
        self.g
            .set_region_results(body_region, results)
            .map_err(|err| self.ir_error(err, span))?;
        let carried_count = initial.len();
        let mut inputs = initial;
        inputs.extend(level.capture_inputs);
        let outs = self.node(
            Op::Repeat {
                count,
                body: body_region,
                carried: carried_count,
            },
            &inputs,
            span,
        )?;
        let mut outs = outs.into_iter();
        for (n, before) in &carried {
            if matches!(before, Value::Tensor(_)) {
                if let Some(o) = outs.next() {
                    self.bind(n, Value::Tensor(o));
                }
            }
        }
        Ok(())
    }
}

/// Names assigned anywhere in `body` (through `if`s and nested `repeat`s), in order.
fn assigned_names(body: &[Stmt], out: &mut Vec<String>) {
    for s in body {
        match &s.kind {
            StmtKind::Assign { targets, .. } => {
                for t in targets {
                    if !out.contains(&t.name) {
                        out.push(t.name.clone());
                    }
                }
            }
            StmtKind::Param { name, .. } => {
                if !out.contains(&name.name) {
                    out.push(name.name.clone());
                }
            }
            StmtKind::If { arms, otherwise } => {
                for (_, b) in arms {
                    assigned_names(b, out);
                }
                if let Some(b) = otherwise {
                    assigned_names(b, out);
                }
            }
            StmtKind::Repeat { body, .. } => assigned_names(body, out),
            StmtKind::Input { .. } | StmtKind::Return(_) | StmtKind::Call(_) => {}
        }
    }
}
