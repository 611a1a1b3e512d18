//! The model as the engines describe it: a decoder-only transformer's shape
//! (layers, width, heads, FFN, norms, positions, biases, tying) read from the
//! lowered graph's provenance — the standard blocks each layer called and
//! the arguments they were called with. A model that is not such a
//! transformer is refused with what differs; the recognised shape is
//! checked by recounting its parameters the way the engines build them.

use dplc_ir::{Graph, Op, ScalarArg, Scope, ScopeId, ScopeKind};

/// A decoder-only transformer in the terms Megatron-LM, torchtitan and
/// DeepSpeed configure.
#[derive(Clone, Debug, PartialEq)]
pub struct Transformer {
    pub layers: u64,
    pub d: u64,
    pub heads: u64,
    pub kv_heads: u64,
    pub vocab: u64,
    pub positions: Positions,
    pub norm: Norm,
    pub norm_eps: f64,
    pub ffn: Ffn,
    /// The FFN's hidden width (per expert for a mixture of experts).
    pub ffn_hidden: u64,
    pub bias: Bias,
    /// The output layer is the token embedding transposed.
    pub tied: bool,
    /// Dropout on the attention probabilities.
    pub attention_dropout: f64,
    /// Dropout on each block's output (attention projection, MLP).
    pub hidden_dropout: f64,
    pub params: u128,
}

#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Positions {
    /// A learned `[ctx, d]` table added to the token embedding.
    Learned {
        ctx: u64,
    },
    Rotary {
        theta: f64,
    },
    None,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Norm {
    LayerNorm,
    RmsNorm,
}

#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Ffn {
    /// Two linears around an activation: `gelu`, `gelu_tanh`, `relu`, `silu`.
    Mlp {
        act: &'static str,
    },
    SwiGlu,
    /// SwiGLU experts behind a top-k router (softmax over the chosen logits).
    Moe {
        experts: u64,
        top_k: u64,
        capacity_factor: f64,
    },
}

/// Which linears carry a bias.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Bias {
    pub qkv: bool,
    pub out: bool,
    pub mlp: bool,
}

impl Transformer {
    pub fn head_dim(&self) -> u64 {
        self.d / self.heads
    }

    /// Parameters as the engines build this shape: must equal the graph's.
    fn engine_params(&self) -> u128 {
        let (d, v, l) = (self.d as u128, self.vocab as u128, self.layers as u128);
        let (hd, kv, h) = (
            self.head_dim() as u128,
            self.kv_heads as u128,
            self.heads as u128,
        );
        let f = self.ffn_hidden as u128;
        let norm = match self.norm {
            Norm::LayerNorm => 2 * d,
            Norm::RmsNorm => d,
        };
        let qkv = d * (h + 2 * kv) * hd + if self.bias.qkv { (h + 2 * kv) * hd } else { 0 };
        let out = h * hd * d + if self.bias.out { d } else { 0 };
        let ffn = match self.ffn {
            Ffn::Mlp { .. } => 2 * d * f + if self.bias.mlp { f + d } else { 0 },
            Ffn::SwiGlu => 3 * d * f,
            Ffn::Moe { experts, .. } => d * experts as u128 + experts as u128 * 3 * d * f,
        };
        let positions = match self.positions {
            Positions::Learned { ctx } => ctx as u128 * d,
            _ => 0,
        };
        let output = if self.tied { 0 } else { d * v };
        v * d + positions + l * (2 * norm + qkv + out + ffn) + norm + output
    }
}

/// Why a model is not one the engines build.
pub fn recognise(g: &Graph) -> Result<Transformer, String> {
    let scopes: Vec<(ScopeId, &Scope)> = g.scopes().collect();
    let under = |s: ScopeId, ancestor: ScopeId| {
        let mut cur = Some(s);
        while let Some(c) = cur {
            if c == ancestor {
                return true;
            }
            cur = g.scope(c).parent;
        }
        false
    };
    let repeats: Vec<ScopeId> = scopes
        .iter()
        .filter(|(_, s)| matches!(s.kind, ScopeKind::Repeat { .. }))
        .map(|(id, _)| *id)
        .collect();
    let [stack] = repeats[..] else {
        return Err(format!(
            "the model has {} `repeat` stacks; the engines build one stack of identical layers",
            repeats.len()
        ));
    };
    let ScopeKind::Repeat { count: layers } = g.scope(stack).kind else {
        unreachable!("filtered to repeats")
    };
    let blocks = |name: &str, inside: ScopeId| -> Vec<ScopeId> {
        scopes
            .iter()
            .filter(|(id, s)| {
                matches!(&s.kind, ScopeKind::Block { block } if block == name) && under(*id, inside)
            })
            .map(|(id, _)| *id)
            .collect()
    };

    // The layer: one attention, one FFN, two norms of one kind, nothing else.
    let attention = match blocks("attention", stack)[..] {
        [a] => a,
        ref v => {
            return Err(format!(
                "a layer calls the standard `attention` {} times; the engines' layer has one",
                v.len()
            ))
        }
    };
    let attn = g.scope(attention);
    let int = |s: &Scope, k: &str| match s.arg(k) {
        Some(ScalarArg::Int(i)) if *i > 0 => Ok(*i as u64),
        _ => Err(format!("`{}` has no positive `{k}` argument", s.name)),
    };
    let float = |s: &Scope, k: &str| match s.arg(k) {
        Some(ScalarArg::Float(x)) => Ok(*x),
        Some(ScalarArg::Int(i)) => Ok(*i as f64),
        _ => Err(format!("`{}` has no number `{k}` argument", s.name)),
    };
    let boolean = |s: &Scope, k: &str| match s.arg(k) {
        Some(ScalarArg::Bool(b)) => Ok(*b),
        _ => Err(format!("`{}` has no true/false `{k}` argument", s.name)),
    };
    let d = int(attn, "d")?;
    let heads = int(attn, "heads")?;
    let kv_heads = int(attn, "kv_heads")?;
    if !boolean(attn, "causal")? {
        return Err("the attention is not causal; the engines' GPT models are".into());
    }
    let rotary = boolean(attn, "rotary")?;

    let mut ffns = Vec::new();
    for name in ["mlp", "swiglu", "moe"] {
        ffns.extend(blocks(name, stack).into_iter().map(|s| (name, s)));
    }
    let [(ffn_kind, ffn_scope)] = ffns[..] else {
        return Err(format!(
            "a layer calls {} of the standard `mlp`, `swiglu` and `moe`; the engines' layer has one FFN",
            ffns.len()
        ));
    };
    let fs = g.scope(ffn_scope);
    let ffn_hidden = int(fs, "hidden")?;
    let (ffn, mlp_bias, ffn_dropout) = match ffn_kind {
        "mlp" => {
            let act = match fs.arg("act") {
                Some(ScalarArg::Str(a)) => match a.as_str() {
                    "gelu" => "gelu",
                    "gelu_tanh" => "gelu_tanh",
                    "relu" => "relu",
                    "silu" => "silu",
                    other => return Err(format!("the MLP's activation `{other}` is unknown")),
                },
                _ => return Err("the MLP names no activation".into()),
            };
            (
                Ffn::Mlp { act },
                boolean(fs, "bias")?,
                float(fs, "dropout")?,
            )
        }
        "swiglu" => (Ffn::SwiGlu, false, 0.0),
        _ => (
            Ffn::Moe {
                experts: int(fs, "experts")?,
                top_k: int(fs, "top_k")?,
                capacity_factor: float(fs, "capacity_factor")?,
            },
            false,
            0.0,
        ),
    };
    if int(fs, "d")? != d {
        return Err("the FFN's width differs from the attention's".into());
    }

    let norms_in = |inside: ScopeId, exclude: &[ScopeId]| -> Vec<(Norm, ScopeId)> {
        let mut v = Vec::new();
        for (name, kind) in [("layer_norm", Norm::LayerNorm), ("rms_norm", Norm::RmsNorm)] {
            for s in blocks(name, inside) {
                if !exclude.iter().any(|&e| under(s, e)) {
                    v.push((kind, s));
                }
            }
        }
        v.sort_by_key(|(_, s)| s.index());
        v
    };
    let layer_norms = norms_in(stack, &[attention, ffn_scope]);
    let [(norm, n1), (norm2, n2)] = layer_norms[..] else {
        return Err(format!(
            "a layer has {} norms outside its attention and FFN; the engines' layer has two",
            layer_norms.len()
        ));
    };
    let norm_eps = float(g.scope(n1), "eps")?;
    if norm2 != norm || float(g.scope(n2), "eps")? != norm_eps {
        return Err("the layer's two norms differ in kind or epsilon".into());
    }
    pre_norm(g, n1)?;

    // The ends: token embedding, maybe learned positions, the final norm,
    // maybe an output matrix, and nothing else.
    let mut vocab = None;
    let mut positions = Positions::None;
    let mut embed_param = None;
    for (_, n) in g.nodes() {
        if n.op != Op::Embedding {
            continue;
        }
        let table = g.tensor(n.inputs[0]);
        let Some(Op::Param(p)) = g.producer(n.inputs[0]).map(|m| &m.op) else {
            continue;
        };
        let p = *p;
        let (Some(rows), Some(cols)) = (match table.shape.dims() {
            [rows, cols] => (rows.as_const(), cols.as_const()),
            _ => (None, None),
        }) else {
            return Err("an embedding table is not a [rows, d] matrix of known size".into());
        };
        if cols as u64 != d {
            return Err(format!(
                "embedding `{}` is not d = {d} wide",
                g.param(p).name
            ));
        }
        let from_positions = g
            .producer(n.inputs[1])
            .is_some_and(|m| matches!(m.op, Op::Iota { .. }));
        if from_positions {
            positions = Positions::Learned { ctx: rows as u64 };
        } else if vocab.replace(rows as u64).is_some() {
            return Err("the model has two token embeddings".into());
        } else {
            embed_param = Some(p);
        }
    }
    let (Some(vocab), Some(embed_param)) = (vocab, embed_param) else {
        return Err("the model has no token embedding; the engines train language models".into());
    };
    if rotary {
        if positions != Positions::None {
            return Err("the model has both learned and rotary positions".into());
        }
        positions = Positions::Rotary {
            theta: float(attn, "rope_theta")?,
        };
    }
    let final_norms = norms_in(g.root_scope(), &[stack]);
    match final_norms[..] {
        [(kind, s)] if kind == norm && float(g.scope(s), "eps")? == norm_eps => {}
        _ => {
            return Err(format!(
                "the model has {} norms outside its layers; the engines have one final norm like the layers'",
                final_norms.len()
            ))
        }
    }
    let tied = !g.params().any(|(p, info)| {
        p != embed_param && !under(info.scope, stack) && {
            let dims = info.shape.dims();
            dims.len() == 2
                && dims[0].as_const() == Some(d as i64)
                && dims[1].as_const() == Some(vocab as i64)
        }
    });

    let attention_dropout = float(attn, "dropout")?;
    if ffn_dropout != attention_dropout && matches!(ffn, Ffn::Mlp { .. }) {
        return Err(format!(
            "the attention's dropout {attention_dropout} and the MLP's {ffn_dropout} differ; the engines use one hidden dropout"
        ));
    }
    let t = Transformer {
        layers,
        d,
        heads,
        kv_heads,
        vocab,
        positions,
        norm,
        norm_eps,
        ffn,
        ffn_hidden,
        bias: Bias {
            qkv: boolean(attn, "qkv_bias")?,
            out: boolean(attn, "out_bias")?,
            mlp: mlp_bias,
        },
        tied,
        attention_dropout,
        hidden_dropout: attention_dropout,
        params: g.param_count(),
    };
    let counted = t.engine_params();
    if counted != t.params {
        return Err(format!(
            "the model has {} parameters, but the transformer its blocks describe has {counted}: \
             something outside the standard attention, FFN and norms holds parameters",
            t.params
        ));
    }
    Ok(t)
}

/// The layer normalises its input before the attention (pre-norm, as GPT-2,
/// Llama and the engines' GPT), rather than after the residual.
fn pre_norm(g: &Graph, norm: ScopeId) -> Result<(), String> {
    let reads_layer_input = g.nodes().any(|(_, n)| {
        n.scope == norm && {
            let args = &g.region(n.region).args;
            n.inputs.iter().any(|t| args.contains(t))
        }
    });
    if reads_layer_input {
        Ok(())
    } else {
        Err("the layer normalises after the residual (post-norm); the engines' GPT layers are pre-norm".into())
    }
}
