//! `train` and `cluster` sections: evaluate their entries and validate them
//! into `dplc_ir::TrainSpec` and `dplc_ir::ClusterSpec`, key by key.

use crate::ast::{Section, Span, UnitKind};
use crate::diag::{did_you_mean, Diag, DiagExt, Res};
use crate::elab::{Elab, Program};
use crate::value::Value;
use dplc_ir::validate::{self as rules, Bounds};
use dplc_ir::{ClusterSpec, DeviceSpec, LinkSpec, LrSchedule, Optimizer, Precision, TrainSpec};

const TRAIN_KEYS: &[&str] = &[
    "seq",
    "global_batch",
    "precision",
    "optimizer",
    "schedule",
    "grad_clip",
    "steps",
];
const CLUSTER_KEYS: &[&str] = &[
    "nodes",
    "devices_per_node",
    "device",
    "intra_node",
    "inter_node",
];
const LINK_KINDS: &[&str] = &[
    "nvswitch",
    "nvlink",
    "pcie",
    "infiniband",
    "ethernet",
    "shm",
];

/// Evaluate every entry, refusing unknown and repeated keys.
fn entries(
    prog: &Program,
    s: &Section,
    known: &[&str],
    what: &str,
) -> Res<Vec<(String, Value, Span)>> {
    let mut e = Elab::for_sections(prog);
    let mut out: Vec<(String, Value, Span)> = Vec::new();
    for (key, expr) in &s.entries {
        if !known.contains(&key.name.as_str()) {
            let d = Diag::new(
                "dpl::unknown-key",
                key.span,
                format!("unknown {what} key `{}`", key.name),
            )
            .label("not a known key");
            let list = format!("{what} keys are {}", known.join(", "));
            return Err(match did_you_mean(&key.name, known.iter().copied()) {
                Some(h) => d.help(format!("{h} {list}")),
                None => d.help(list),
            });
        }
        if out.iter().any(|(k, _, _)| *k == key.name) {
            return Err(Diag::new(
                "dpl::duplicate",
                key.span,
                format!("`{}` is set twice", key.name),
            )
            .label("set again here"));
        }
        let v = e.eval(expr)?;
        out.push((key.name.clone(), v, expr.span));
    }
    Ok(out)
}

fn expected(v: &Value, span: Span, what: &str) -> Box<Diag> {
    let found = match v {
        Value::Int(n) => format!("the integer {n}"),
        Value::Float(x) => format!("the number {x}"),
        Value::Bool(b) => format!("the bool {b}"),
        Value::Str(s) => format!("the string \"{s}\""),
        Value::Name(n) => format!("the name `{n}`"),
        Value::Quantity { unit, .. } => unit.name().to_string(),
        Value::Record { kind, .. } => format!("`{kind}(…)`"),
        Value::Tuple(_) => "a tuple".to_string(),
        Value::List(_) => "a list".to_string(),
        _ => "another kind of value".to_string(),
    };
    let code = if matches!(v, Value::Quantity { .. }) {
        "dpl::bad-unit"
    } else {
        "dpl::arg-type"
    };
    Diag::new(code, span, format!("expected {what}, found {found}"))
        .label(format!("should be {what}"))
}

/// A hardware number the cost model cannot price: where and the range it takes.
fn out_of_range(key: &str, at: Span, bounds: &Bounds, or_none: &str) -> Box<Diag> {
    Diag::new(
        "dpl::out-of-range",
        at,
        format!("`{key}` must be {or_none}in the range {}", bounds.shown),
    )
    .label("out of range")
    .help("the planner prices every transfer and kernel with these numbers: check the unit")
}

fn positive(v: &Value, span: Span) -> Res<u64> {
    match v {
        Value::Int(n) if *n > 0 => Ok(*n as u64),
        other => Err(expected(other, span, "a positive integer")),
    }
}

fn number(v: &Value, span: Span) -> Res<f64> {
    match v.as_f64() {
        Some(x) if x.is_finite() && x >= 0.0 => Ok(x),
        _ => Err(expected(v, span, "a non-negative number")),
    }
}

fn name_of(v: &Value) -> Option<&str> {
    match v {
        Value::Name(n) | Value::Str(n) => Some(n),
        _ => None,
    }
}

/// The fields of a record, with defaults, refusing unknown fields.
struct Fields<'a> {
    kind: &'a str,
    fields: &'a [(String, Value, Span)],
    span: Span,
}

impl<'a> Fields<'a> {
    fn new(v: &'a Value, span: Span, allowed: &[&str], signature: &str) -> Res<Fields<'a>> {
        match v {
            Value::Record { kind, fields } => {
                for (k, _, at) in fields {
                    if !allowed.contains(&k.as_str()) {
                        return Err(Diag::new(
                            "dpl::unknown-keyword",
                            *at,
                            format!("`{kind}` has no field `{k}`"),
                        )
                        .label("unknown field")
                        .help(format!("the fields are {signature}")));
                    }
                }
                Ok(Fields { kind, fields, span })
            }
            Value::Name(kind) => Ok(Fields {
                kind,
                fields: &[],
                span,
            }),
            other => Err(expected(
                other,
                span,
                &format!("a record such as {signature}"),
            )),
        }
    }

    fn get(&self, key: &str) -> Option<(&'a Value, Span)> {
        self.fields
            .iter()
            .find(|(k, _, _)| k == key)
            .map(|(_, v, s)| (v, *s))
    }

    fn number(&self, key: &str, default: Option<f64>) -> Res<f64> {
        match (self.get(key), default) {
            (Some((v, s)), _) => number(v, s),
            (None, Some(d)) => Ok(d),
            (None, None) => Err(Diag::new(
                "dpl::missing-key",
                self.span,
                format!("`{}` needs `{key}`", self.kind),
            )
            .label(format!("`{key}` is missing"))),
        }
    }

    /// Field `key` as a quantity of `unit` (in SI base units), e.g. `300 GB/s`;
    /// `per device` is allowed on bandwidths only.
    fn quantity(&self, key: &str, unit: UnitKind, example: &str, default: Option<f64>) -> Res<f64> {
        match (self.get(key), default) {
            (
                Some((
                    Value::Quantity {
                        value,
                        unit: u,
                        per_device,
                    },
                    s,
                )),
                _,
            ) if *u == unit => {
                if *per_device && unit != UnitKind::Bandwidth {
                    return Err(Diag::new(
                        "dpl::bad-unit",
                        s,
                        "`per device` only applies to bandwidths",
                    )
                    .label("here"));
                }
                Ok(*value)
            }
            (Some((other, s)), _) => Err(expected(
                other,
                s,
                &format!("{} such as `{example}`", unit.name()),
            )),
            (None, Some(d)) => Ok(d),
            (None, None) => Err(Diag::new(
                "dpl::missing-key",
                self.span,
                format!("`{}` needs `{key}`", self.kind),
            )
            .label(format!("`{key}` is missing"))),
        }
    }

    /// Field `key` as a quantity of `unit` within `bounds` (see
    /// [`Fields::quantity`]).
    fn bounded(
        &self,
        key: &str,
        (unit, example): (UnitKind, &str),
        default: Option<f64>,
        bounds: &Bounds,
    ) -> Res<f64> {
        let x = self.quantity(key, unit, example, default)?;
        match self.get(key) {
            Some((_, at)) if !bounds.contains(x) => Err(out_of_range(key, at, bounds, "")),
            _ => Ok(x),
        }
    }

    /// As [`Fields::bounded`], where 0 (the default) says the device has none.
    fn bounded_or_none(
        &self,
        key: &str,
        (unit, example): (UnitKind, &str),
        bounds: &Bounds,
    ) -> Res<f64> {
        let x = self.quantity(key, unit, example, Some(0.0))?;
        match self.get(key) {
            Some((_, at)) if x != 0.0 && !bounds.contains(x) => {
                Err(out_of_range(key, at, bounds, "0 (none) or "))
            }
            _ => Ok(x),
        }
    }

    fn count(&self, key: &str, default: Option<u64>) -> Res<u64> {
        match (self.get(key), default) {
            (Some((Value::Int(n), _)), _) if *n >= 0 => Ok(*n as u64),
            (Some((v, s)), _) => Err(expected(v, s, "a non-negative integer")),
            (None, Some(d)) => Ok(d),
            (None, None) => Err(Diag::new(
                "dpl::missing-key",
                self.span,
                format!("`{}` needs `{key}`", self.kind),
            )
            .label(format!("`{key}` is missing"))),
        }
    }
}

fn optimizer(v: &Value, span: Span) -> Res<Optimizer> {
    let kind = match v {
        Value::Record { kind, .. } | Value::Name(kind) => kind.as_str(),
        other => {
            return Err(expected(
                other,
                span,
                "an optimizer such as adamw(lr = 3e-4)",
            ))
        }
    };
    match kind {
        "adamw" => {
            let f = Fields::new(
                v,
                span,
                &["lr", "betas", "eps", "weight_decay"],
                "adamw(lr, betas = (0.9, 0.999), eps = 1e-8, weight_decay = 0.0)",
            )?;
            let (beta1, beta2) = match f.get("betas") {
                None => (0.9, 0.999),
                Some((Value::Tuple(b) | Value::List(b), s)) if b.len() == 2 => {
                    (number(&b[0], s)?, number(&b[1], s)?)
                }
                Some((other, s)) => return Err(expected(other, s, "a pair of numbers (β1, β2)")),
            };
            Ok(Optimizer::AdamW {
                lr: f.number("lr", None)?,
                beta1,
                beta2,
                eps: f.number("eps", Some(1e-8))?,
                weight_decay: f.number("weight_decay", Some(0.0))?,
            })
        }
        "sgd" => {
            let f = Fields::new(v, span, &["lr", "momentum"], "sgd(lr, momentum = 0.0)")?;
            Ok(Optimizer::Sgd {
                lr: f.number("lr", None)?,
                momentum: f.number("momentum", Some(0.0))?,
            })
        }
        other => {
            let d = Diag::new(
                "dpl::unknown-kind",
                span,
                format!("unknown optimizer `{other}`"),
            )
            .label("not an optimizer");
            Err(d.help(match did_you_mean(other, ["adamw", "sgd"]) {
                Some(h) => format!("{h} optimizers are adamw and sgd"),
                None => "optimizers are adamw and sgd".to_string(),
            }))
        }
    }
}

fn schedule(v: &Value, span: Span) -> Res<LrSchedule> {
    let kind = match v {
        Value::Record { kind, .. } | Value::Name(kind) => kind.as_str(),
        other => return Err(expected(other, span, "a schedule such as warmup_cosine(…)")),
    };
    match kind {
        "constant" => {
            Fields::new(v, span, &[], "constant")?;
            Ok(LrSchedule::Constant)
        }
        "warmup_cosine" => {
            let f = Fields::new(
                v,
                span,
                &["warmup", "total", "min_ratio"],
                "warmup_cosine(warmup, total, min_ratio = 0.0)",
            )?;
            let warmup = f.count("warmup", None)?;
            let total = f.count("total", None)?;
            let min_ratio = f.number("min_ratio", Some(0.0))?;
            if warmup > total || min_ratio > 1.0 {
                return Err(Diag::new(
                    "dpl::bad-schedule",
                    span,
                    "a warmup-cosine schedule needs warmup ≤ total and min_ratio ≤ 1",
                )
                .label("inconsistent schedule"));
            }
            Ok(LrSchedule::WarmupCosine {
                warmup,
                total,
                min_ratio,
            })
        }
        other => {
            let d = Diag::new(
                "dpl::unknown-kind",
                span,
                format!("unknown schedule `{other}`"),
            )
            .label("not a schedule");
            Err(
                d.help(match did_you_mean(other, ["constant", "warmup_cosine"]) {
                    Some(h) => format!("{h} schedules are constant and warmup_cosine"),
                    None => "schedules are constant and warmup_cosine".to_string(),
                }),
            )
        }
    }
}

/// Validate a `train` section; `seq` defaults to the model's `ctx` argument.
pub fn train_spec(prog: &Program, s: Option<&Section>, ctx: Option<i64>) -> Res<TrainSpec> {
    let mut spec = TrainSpec::default();
    if let Some(c) = ctx.filter(|c| *c > 0) {
        spec.seq = c as u64;
    }
    let Some(s) = s else { return Ok(spec) };
    for (key, v, span) in entries(prog, s, TRAIN_KEYS, "train")? {
        match key.as_str() {
            "seq" => spec.seq = positive(&v, span)?,
            "global_batch" => spec.global_batch = positive(&v, span)?,
            "steps" => spec.steps = Some(positive(&v, span)?),
            "precision" => {
                let name = name_of(&v)
                    .ok_or_else(|| expected(&v, span, "a precision: fp32, bf16 or fp16"))?;
                spec.precision = Precision::from_name(name).ok_or_else(|| {
                    let d = Diag::new(
                        "dpl::unknown-kind",
                        span,
                        format!("unknown precision `{name}`"),
                    )
                    .label("not a precision");
                    d.help(match did_you_mean(name, ["fp32", "bf16", "fp16"]) {
                        Some(h) => format!("{h} precisions are fp32, bf16 and fp16"),
                        None => "precisions are fp32, bf16 and fp16".to_string(),
                    })
                })?;
            }
            "optimizer" => spec.optimizer = optimizer(&v, span)?,
            "schedule" => spec.schedule = schedule(&v, span)?,
            "grad_clip" => {
                spec.grad_clip = match &v {
                    Value::Name(n) if n == "none" => None,
                    other => Some(number(other, span)?),
                }
            }
            _ => {}
        }
    }
    Ok(spec)
}

fn link(v: &Value, span: Span) -> Res<LinkSpec> {
    let kind = match v {
        Value::Record { kind, .. } => kind.as_str(),
        other => {
            return Err(expected(
                other,
                span,
                "a link such as nvswitch(bandwidth = 300 GB/s, latency = 2 us)",
            ))
        }
    };
    if !LINK_KINDS.contains(&kind) {
        let d = Diag::new(
            "dpl::unknown-kind",
            span,
            format!("unknown link kind `{kind}`"),
        )
        .label("not a link kind");
        let list = format!("link kinds are {}", LINK_KINDS.join(", "));
        return Err(
            d.help(match did_you_mean(kind, LINK_KINDS.iter().copied()) {
                Some(h) => format!("{h} {list}"),
                None => list,
            }),
        );
    }
    let f = Fields::new(
        v,
        span,
        &["bandwidth", "latency"],
        &format!("{kind}(bandwidth = 300 GB/s, latency = 2 us)"),
    )?;
    Ok(LinkSpec {
        kind: kind.to_string(),
        bandwidth_bytes_per_s: f.bounded(
            "bandwidth",
            (UnitKind::Bandwidth, "300 GB/s"),
            None,
            &rules::BANDWIDTH,
        )?,
        latency_s: f.bounded("latency", (UnitKind::Time, "2 us"), None, &rules::LATENCY)?,
    })
}

/// `accelerator(name = "X", bf16 = 989 TFLOP/s, memory = 80 GB,
/// memory_bandwidth = 3.35 TB/s, …)`: a device the catalog does not know.
/// fp16 defaults to the bf16 rate and fp32 to a sixteenth of it (the
/// tensor-core ratio of A100 and H100), fp8 to none (`fp8=on` is then
/// refused); efficiency to the planner's default.
fn accelerator(v: &Value, span: Span) -> Res<DeviceSpec> {
    const SIGNATURE: &str = "accelerator(name = \"X\", bf16 = 989 TFLOP/s, fp16 = …, fp32 = …, fp8 = …, \
                             memory = 80 GB, memory_bandwidth = 3.35 TB/s, host_memory = 256 GB, \
                             host_link = 64 GB/s, host_memory_bandwidth = 77 GB/s, matmul_efficiency = 0.8, \
                             fp8_matmul_efficiency = 0.65, flash2_efficiency = 0.29, \
                             flash2_backward_efficiency = 0.29, fused_attention_efficiency = 0.64, \
                             fused_attention_backward_efficiency = 0.54, multiprocessors = 132)";
    let f = Fields::new(
        v,
        span,
        &[
            "name",
            "bf16",
            "fp16",
            "fp32",
            "fp8",
            "memory",
            "memory_bandwidth",
            "host_memory",
            "host_link",
            "host_memory_bandwidth",
            "matmul_efficiency",
            "fp8_matmul_efficiency",
            "flash2_efficiency",
            "flash2_backward_efficiency",
            "fused_attention_efficiency",
            "fused_attention_backward_efficiency",
            "unaligned_matmul_efficiency",
            "attention_dropout_forward_ps",
            "attention_dropout_backward_ps",
            "multiprocessors",
        ],
        SIGNATURE,
    )?;
    let name = match f.get("name") {
        Some((Value::Str(n), _)) if !n.trim().is_empty() => n.clone(),
        Some((other, s)) => return Err(expected(other, s, "a name such as \"MI355X\"")),
        None => {
            return Err(
                Diag::new("dpl::missing-key", span, "`accelerator` needs `name`")
                    .label("`name` is missing"),
            )
        }
    };
    const RATE: (UnitKind, &str) = (UnitKind::FlopRate, "989 TFLOP/s");
    const BANDWIDTH: (UnitKind, &str) = (UnitKind::Bandwidth, "64 GB/s");
    let rate = |key: &str, default: Option<f64>| f.bounded(key, RATE, default, &rules::FLOP_RATE);
    let bf16 = rate("bf16", None)?;
    let memory = f.bounded("memory", (UnitKind::Bytes, "80 GB"), None, &rules::MEMORY)?;
    let fraction = |key: &str| match f.get(key) {
        None => Ok(None),
        Some((v, s)) => {
            let e = number(v, s)?;
            if !(e > 0.0 && e <= 1.0) {
                return Err(expected(v, s, "a fraction of peak in (0, 1], e.g. 0.8"));
            }
            Ok(Some(e))
        }
    };
    let matmul_efficiency = fraction("matmul_efficiency")?;
    let fp8_matmul_efficiency = fraction("fp8_matmul_efficiency")?;
    let flash2_efficiency = fraction("flash2_efficiency")?;
    let flash2_backward_efficiency = fraction("flash2_backward_efficiency")?;
    let fused_attention_efficiency = fraction("fused_attention_efficiency")?;
    let fused_attention_backward_efficiency = fraction("fused_attention_backward_efficiency")?;
    let unaligned_matmul_efficiency = fraction("unaligned_matmul_efficiency")?;
    let picoseconds = |key: &str| match f.get(key) {
        None => Ok(None),
        Some((v, s)) => {
            let ps = number(v, s)?;
            if !(ps.is_finite() && ps >= 0.0) {
                return Err(expected(v, s, "picoseconds per attended score, e.g. 0.71"));
            }
            Ok(Some(ps))
        }
    };
    let attention_dropout_forward_ps = picoseconds("attention_dropout_forward_ps")?;
    let attention_dropout_backward_ps = picoseconds("attention_dropout_backward_ps")?;
    let spec = DeviceSpec {
        name,
        peak_bf16: bf16,
        peak_fp16: rate("fp16", Some(bf16))?,
        peak_fp32: rate("fp32", Some(bf16 / 16.0))?,
        // No FP8 tensor cores unless the section says so.
        peak_fp8: f.bounded_or_none("fp8", RATE, &rules::FLOP_RATE)?,
        // No host to offload to unless the section says so.
        host_memory_bytes: f.bounded_or_none(
            "host_memory",
            (UnitKind::Bytes, "256 GB"),
            &rules::MEMORY,
        )? as u64,
        host_link_bandwidth: f.bounded_or_none("host_link", BANDWIDTH, &rules::BANDWIDTH)?,
        host_memory_bandwidth: f.bounded_or_none(
            "host_memory_bandwidth",
            BANDWIDTH,
            &rules::BANDWIDTH,
        )?,
        memory_bytes: memory as u64,
        memory_bandwidth: f.bounded(
            "memory_bandwidth",
            (UnitKind::Bandwidth, "3.35 TB/s"),
            None,
            &rules::BANDWIDTH,
        )?,
        matmul_efficiency,
        fp8_matmul_efficiency,
        flash2_efficiency,
        flash2_backward_efficiency,
        fused_attention_efficiency,
        fused_attention_backward_efficiency,
        unaligned_matmul_efficiency,
        attention_dropout_forward_ps,
        attention_dropout_backward_ps,
        multiprocessors: f.count("multiprocessors", Some(0))?,
    };
    Ok(spec)
}

/// Validate a `cluster` section.
pub fn cluster_spec(prog: &Program, s: &Section) -> Res<ClusterSpec> {
    let mut spec = ClusterSpec {
        name: s.name.name.clone(),
        nodes: 1,
        devices_per_node: 0,
        device: String::new(),
        custom_device: None,
        intra_node: None,
        inter_node: None,
    };
    let mut count_spans = (s.name.span, s.name.span);
    for (key, v, span) in entries(prog, s, CLUSTER_KEYS, "cluster")? {
        match key.as_str() {
            "nodes" => (spec.nodes, count_spans.0) = (positive(&v, span)?, span),
            "devices_per_node" => (spec.devices_per_node, count_spans.1) = (positive(&v, span)?, span),
            "device" => match &v {
                Value::Record { kind, .. } if kind == "accelerator" => {
                    let d = accelerator(&v, span)?;
                    spec.device = d.name.clone();
                    spec.custom_device = Some(d);
                }
                _ => {
                    spec.device = name_of(&v)
                        .ok_or_else(|| {
                            expected(
                                &v,
                                span,
                                "a device name such as A100_80GB, or accelerator(name = …, bf16 = …, memory = …, memory_bandwidth = …)",
                            )
                        })?
                        .to_string()
                }
            },
            "intra_node" => spec.intra_node = Some(link(&v, span)?),
            "inter_node" => spec.inter_node = Some(link(&v, span)?),
            _ => {}
        }
    }
    for (missing, key) in [
        (spec.devices_per_node == 0, "devices_per_node"),
        (spec.device.is_empty(), "device"),
    ] {
        if missing {
            return Err(Diag::new(
                "dpl::missing-key",
                s.name.span,
                format!("cluster `{}` does not set `{key}`", s.name.name),
            )
            .label(format!("needs `{key} = …`")));
        }
    }
    if let Err(why) = rules::world(spec.nodes, spec.devices_per_node) {
        // Blame the count that is past the limit alone, else the two together.
        let at = if spec.nodes > rules::MAX_DEVICES {
            count_spans.0
        } else if spec.devices_per_node > rules::MAX_DEVICES {
            count_spans.1
        } else {
            s.name.span
        };
        return Err(Diag::new(
            "dpl::out-of-range",
            at,
            format!("cluster `{}`: {why}", s.name.name),
        )
        .label("too many devices"));
    }
    Ok(spec)
}
