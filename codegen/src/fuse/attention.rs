//! The fused attention's side of fusion: which of a region's attentions
//! the one kernel takes (and why not the others), and the kernel each
//! becomes, with its operands' places and its dropout's key.

use super::*;

/// Every attention of the region the fused kernel takes, and each one it
/// does not (its score matmul) with the reason.
pub(super) fn find_attention(
    a: &Analysis<'_>,
    cut: &[TensorId],
) -> (Vec<AttentionMatch>, Vec<(NodeId, String)>) {
    let g = a.g;
    let reg = g.region(a.region);
    let mut pinned: HashSet<TensorId> = reg.results.iter().copied().collect();
    for &t in cut {
        let mut t = t;
        pinned.insert(t);
        while let Some(n) = g.producer(t) {
            match n.op {
                Op::Reshape { .. } => t = n.inputs[0],
                _ => break,
            }
            pinned.insert(t);
        }
    }
    let pinned = |t: TensorId| pinned.contains(&t);
    let region = MatchRegion {
        consumers: &a.consumers,
        pinned: &pinned,
    };
    let (mut found, mut refused) = (Vec::new(), Vec::new());
    let mut taken: HashSet<NodeId> = HashSet::new();
    for &n in &reg.nodes {
        if taken.contains(&n) {
            continue;
        }
        match match_attention(g, &region, n) {
            None => {}
            Some(Ok(m)) if m.nodes.iter().all(|x| !taken.contains(x)) => {
                taken.extend(m.nodes.iter().copied());
                found.push(m);
            }
            Some(Ok(_)) => refused.push((n, "its nodes overlap another attention".into())),
            Some(Err(reason)) => refused.push((n, reason)),
        }
    }
    (found, refused)
}

/// The step of one matched attention: its description in size arguments.
pub(super) fn lower_attention(g: &Graph, m: &AttentionMatch) -> FusedAttention {
    let mut sizes: Vec<Dim> = Vec::new();
    let mut key_sizes: Vec<(usize, KeySize)> = Vec::new();
    // Only what shapes the code is fixed in it: the widths (register tiles),
    // zero strides (broadcasts) and unit strides (contiguous features).
    // Every other size is an argument of its own, in a fixed order, so
    // attentions that differ in head count, lengths or layout share one
    // kernel whatever sizes happen to coincide.
    let mut size = |d: &Dim| -> Size {
        if let Some(c @ (0 | 1)) = d.as_const() {
            return Size::Const(c);
        }
        sizes.push(d.clone());
        Size::Param(sizes.len() - 1)
    };
    // The shape's sizes first: they print as `n0..` in a readable order.
    let (batch, heads, kv_heads, q_len, k_len) = (
        size(&m.batch),
        size(&m.heads),
        size(&m.kv_heads),
        size(&m.q_len),
        size(&m.k_len),
    );
    let mut operand = |v: &View| -> AttentionOperand {
        let strides = [0, 1, 2, 3].map(|a| size(&v.axes[a].stride));
        AttentionOperand {
            label: v.tensor.to_string(),
            len: g
                .tensor(v.tensor)
                .shape
                .dims()
                .iter()
                .map(&mut size)
                .collect(),
            at: Strided {
                offset: size(&v.offset),
                strides,
            },
        }
    };
    let (q, k, v, out) = (operand(&m.q), operand(&m.k), operand(&m.v), operand(&m.out));
    let bias = m.bias.as_ref().map(&mut operand);
    // The words of the rank's place and of the dropout key, each one
    // argument however often it is read.
    let mut key_size = |k: KeySize| -> Size {
        if let Some(&(i, _)) = key_sizes.iter().find(|(_, x)| *x == k) {
            return Size::Param(i);
        }
        sizes.push(Dim::konst(0));
        key_sizes.push((sizes.len() - 1, k));
        Size::Param(sizes.len() - 1)
    };
    let query_position = whole_position(
        Idx::Var(2),
        Idx::size(q_len),
        false,
        m.query_context,
        &mut key_size,
    )
    .0;
    let dropout = m.dropout.map(|d| {
        let axes = [0, 1, 2, 3].map(Idx::Var);
        let lens = [batch, heads, q_len, k_len].map(Idx::size);
        AttentionDropout {
            p: d.p,
            index: whole_index(&axes, &lens, d.split, d.context, &mut key_size),
            key: DrawKey {
                node: d.node.index() as u64,
                layer: key_size(KeySize::Layer),
                first_sample: key_size(KeySize::FirstSample),
                per_sample: key_size(draw_per_sample(d.out, d.split, d.context)),
            },
        }
    });
    let kernel = AttentionKernel {
        sizes: sizes.len(),
        batch,
        heads,
        kv_heads,
        group: m.group,
        q_len,
        k_len,
        head_dim: m.head_dim,
        value_dim: m.value_dim,
        scale: m.scale,
        causal: m.causal,
        window: m.window,
        query_position,
        q,
        k,
        v,
        bias,
        out,
        dropout,
    };
    FusedAttention {
        kernel,
        q: m.q.tensor,
        k: m.k.tensor,
        v: m.v.tensor,
        bias: m.bias.as_ref().map(|b| b.tensor),
        out: m.out.tensor,
        sizes,
        key_sizes,
        nodes: m.nodes.clone(),
    }
}

/// The flat index in the whole tensor of element `index` of a tensor of
/// local lengths `lens` that is this rank's part, as `dplc_ir::Placement`
/// computes it on the host: a dropout's draw, in a fused kernel or the
/// fused attention, is keyed by it so every split draws the serial run's
/// mask. `key` gives the size argument of a word of the rank's place.
pub(crate) fn whole_index(
    index: &[Idx],
    lens: &[Idx],
    split: Option<usize>,
    context: Option<usize>,
    key: &mut dyn FnMut(KeySize) -> Size,
) -> Idx {
    let mut acc = Idx::Const(0);
    for (k, (i, len)) in index.iter().zip(lens).enumerate() {
        let (i, len) = whole_position(
            i.clone(),
            len.clone(),
            split == Some(k),
            context == Some(k),
            key,
        );
        acc = Idx::add(Idx::mul(acc, len), i);
    }
    acc
}

/// Position `i` of an axis of local length `len` in the whole axis, and the
/// whole axis's length: along a `split` axis the rank's `1/tp` piece (`i +
/// part·len` of an axis `tp` times as long); then along a `context` axis its
/// sequence chunks (`dplc_ir::context_position`: `i + rank·len/2 + (i /
/// (len/2))·(cp−1−rank)·len` of an axis `cp` times as long). The fused
/// attention's causal and window masks read a query's place here too.
pub(crate) fn whole_position(
    i: Idx,
    len: Idx,
    split: bool,
    context: bool,
    key: &mut dyn FnMut(KeySize) -> Size,
) -> (Idx, Idx) {
    let (mut i, mut len) = (i, len);
    if split {
        let part = Idx::Size(key(KeySize::SplitPart));
        let parts = Idx::Size(key(KeySize::SplitParts));
        i = Idx::add(i, Idx::mul(part, len.clone()));
        len = Idx::mul(len, parts);
    }
    if context {
        let rank = Idx::Size(key(KeySize::ContextRank));
        let cp = Idx::Size(key(KeySize::ContextRanks));
        let chunk = Idx::div(len.clone(), Idx::Const(2));
        let later = Idx::mul(
            Idx::sub(Idx::sub(cp.clone(), Idx::Const(1)), rank.clone()),
            len.clone(),
        );
        i = Idx::add(
            Idx::add(i.clone(), Idx::mul(rank, chunk.clone())),
            Idx::mul(Idx::div(i, chunk), later),
        );
        len = Idx::mul(len, cp);
    }
    (i, len)
}

/// How many elements of a dropout's output `t` a sample holds, as its key
/// reads it: of `t` itself, or of the whole tensor whose part along
/// `split` (tp) or `context` (cp) it is.
pub(super) fn draw_per_sample(
    t: TensorId,
    split: Option<usize>,
    context: Option<usize>,
) -> KeySize {
    match (split, context) {
        (None, None) => KeySize::PerSample(t),
        (split, context) => KeySize::WholePerSample {
            tensor: t,
            split: split.is_some(),
            context: context.is_some(),
        },
    }
}
