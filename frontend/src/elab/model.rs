//! Lowering a whole model: its arguments, inputs and body, and the checks
//! of a model definition that need no lowering (every parameter has a default).

use super::*;

impl<'p> Elab<'p> {
    /// Lower model `name` (a model or a variant) with its default arguments.
    pub fn lower_model(prog: &'p Program, name: &str, at: Span) -> Res<LoweredModel> {
        let (def, overrides) = prog.resolve_model(name, at)?;
        let mut e = Elab::new(prog, name);
        e.frames.push(Frame {
            scopes: vec![HashMap::new()],
            level_base: 1,
            file: def.name.span.file,
        });
        let mut args = Vec::new();
        for a in &overrides {
            let key = a.name.as_ref().ok_or_else(|| {
                Diag::new(
                    "dpl::variant-positional",
                    a.value.span,
                    "a variant takes keyword arguments only",
                )
                .label("give this argument a name")
                .help(format!("the base model is {}", e.signature(def)))
            })?;
            if !def.formals.iter().any(|f| f.name.name == key.name) {
                return Err(e.unknown_keyword(&key.name, key.span, def));
            }
        }
        for f in &def.formals {
            let expr = match overrides
                .iter()
                .rev()
                .find(|a| a.name.as_ref().is_some_and(|n| n.name == f.name.name))
            {
                Some(a) => &a.value,
                None => f.default.as_ref().ok_or_else(|| missing_default(f))?,
            };
            let v = e.eval(expr)?;
            if !matches!(
                v,
                Value::Int(_) | Value::Float(_) | Value::Bool(_) | Value::Str(_)
            ) {
                return Err(e.expected(&v, expr.span, "a number, a bool or a string"));
            }
            args.push((f.name.name.clone(), v.clone()));
            e.bind(&f.name.name, v);
        }
        let flow = e.exec(&def.body)?;
        let Flow::Return(result) = flow else {
            return Err(Diag::new(
                "dpl::missing-return",
                def.name.span,
                format!("model `{}` ends without `return`", def.name.name),
            )
            .label("this model returns nothing")
            .help("end the model with `return loss`"));
        };
        let values = match result {
            Value::Tuple(xs) => xs,
            v => vec![v],
        };
        let mut outs = Vec::new();
        for v in &values {
            match v {
                Value::Tensor(t) => outs.push(*t),
                other => {
                    return Err(Diag::new(
                        "dpl::type",
                        def.name.span,
                        format!(
                            "model `{}` must return tensors, not {}",
                            def.name.name,
                            other.describe(&e.g)
                        ),
                    )
                    .label("in this model"))
                }
            }
        }
        let root = e.g.root();
        e.g.set_region_results(root, outs)
            .map_err(|err| e.ir_error(err, def.name.span))?;
        Ok(LoweredModel { graph: e.g, args })
    }
}

fn missing_default(f: &Formal) -> Box<Diag> {
    Diag::new(
        "dpl::missing-default",
        f.name.span,
        format!("model parameter `{}` has no default", f.name.name),
    )
    .label("needs `= value`")
    .help("every model parameter needs a default so that the model can be lowered on its own")
}

pub fn check_model_defaults(def: &FnDef) -> Res<()> {
    match def.formals.iter().find(|f| f.default.is_none()) {
        Some(f) => Err(missing_default(f)),
        None => Ok(()),
    }
}
