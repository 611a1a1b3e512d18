//! Recognising attention in a region: the chain `Q·Kᵀ` → scale → bias →
//! window → causal mask → softmax → dropout → `·V` whose intermediate values
//! nothing else reads, with Q, K, V, the bias and the output read as strided
//! views of tensors in memory. Fusion turns each match into one
//! [`crate::Step::Attention`]; a chain it cannot take gets its reason.

use dplc_ir::{BinaryOp, Dim, Graph, NodeId, Op, Ratio, TensorDef, TensorId, TensorLayout};
use std::collections::{HashMap, VecDeque};

/// One axis of a strided view: element `i` sits at `(i / group)·stride`.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct Axis {
    pub size: Dim,
    pub stride: Dim,
    pub group: i64,
}

/// A tensor as a strided view of a buffer: element `x` at
/// `offset + Σ (x[a] / group[a])·stride[a]`.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct View {
    /// The tensor whose (row-major) buffer the view reads.
    pub tensor: TensorId,
    pub offset: Dim,
    pub axes: Vec<Axis>,
}

/// An attention the fused kernel takes, in the graph's terms.
#[derive(Clone, Debug)]
pub(crate) struct AttentionMatch {
    /// The graph nodes the kernel computes, the score matmul first.
    pub nodes: Vec<NodeId>,
    /// The `P·V` matmul: where the step runs.
    pub pv: NodeId,
    pub batch: Dim,
    pub heads: Dim,
    pub kv_heads: Dim,
    pub group: i64,
    pub q_len: Dim,
    pub k_len: Dim,
    pub head_dim: i64,
    pub value_dim: i64,
    pub scale: f64,
    pub causal: bool,
    pub window: Option<i64>,
    /// Axes `(batch, head, position, feature)`; K and V by key head.
    pub q: View,
    pub k: View,
    pub v: View,
    /// Axes `(batch, head, query, key)`.
    pub bias: Option<View>,
    /// The output's buffer: the `P·V` product or the transpose of it that
    /// its reader takes (written in that layout, so no copy follows).
    pub out: View,
    /// Queries are the rank's sequence chunks under context parallelism
    /// (`dplc_ir::split_context`) and keys every position: the causal and
    /// window masks compare a key's position with the query's place in the
    /// whole sequence.
    pub query_context: bool,
    pub dropout: Option<MatchDropout>,
}

/// The dropout of the probabilities, as its node says it.
#[derive(Clone, Copy, Debug)]
pub(crate) struct MatchDropout {
    pub node: NodeId,
    pub p: f64,
    /// Its output, whose elements key the draws.
    pub out: TensorId,
    /// In a rank's program, the axes along which the probabilities are the
    /// rank's part of the whole (`Op::Dropout`): each element draws at its
    /// place in the whole tensor, as the unfused kernels and the reference do.
    pub split: Option<usize>,
    pub context: Option<usize>,
}

/// What the matcher needs of the region besides the graph.
pub(crate) struct Region<'a> {
    pub consumers: &'a HashMap<TensorId, Vec<NodeId>>,
    /// Tensors that must stay in memory: the region's results and values
    /// crossing a pipeline cut.
    pub pinned: &'a dyn Fn(TensorId) -> bool,
}

type Res<T> = Result<T, String>;

fn zero() -> Dim {
    Dim::konst(0)
}

fn is_zero(d: &Dim) -> bool {
    d.coeff() == Ratio::int(0)
}

fn mul(a: &Dim, b: &Dim) -> Res<Dim> {
    if is_zero(a) || is_zero(b) {
        return Ok(zero());
    }
    a.checked_mul(b)
        .ok_or_else(|| "a stride overflows".to_string())
}

/// `a / b` when it is a whole multiple.
fn divides(b: &Dim, a: &Dim) -> bool {
    a.checked_div(b)
        .is_some_and(|q| q.coeff().as_int().is_some())
}

fn producer_id(g: &Graph, t: TensorId) -> Option<NodeId> {
    match g.tensor(t).def {
        TensorDef::Node { node, .. } => Some(node),
        TensorDef::Arg { .. } => None,
    }
}

impl View {
    /// `t`'s own buffer, row-major.
    pub fn contiguous(g: &Graph, t: TensorId) -> Res<View> {
        let dims = g.tensor(t).shape.dims().to_vec();
        let mut axes = vec![
            Axis {
                size: Dim::konst(1),
                stride: zero(),
                group: 1
            };
            dims.len()
        ];
        let mut stride = Dim::konst(1);
        for (a, d) in dims.iter().enumerate().rev() {
            axes[a] = Axis {
                size: d.clone(),
                stride: if d.is_one() { zero() } else { stride.clone() },
                group: 1,
            };
            stride = mul(&stride, d)?;
        }
        Ok(View {
            tensor: t,
            offset: zero(),
            axes,
        })
    }

    /// The tensor `t` as a view of the buffer its views (transposes,
    /// reshapes, expands, slices) read.
    pub fn of(g: &Graph, t: TensorId) -> Res<View> {
        let mut chain = Vec::new();
        let mut base = t;
        while let Some(n) = g.producer(base) {
            match n.op {
                Op::Transpose { .. }
                | Op::Reshape { .. }
                | Op::Expand { .. }
                | Op::Slice { .. } => {
                    chain.push(producer_id(g, base).expect("produced"));
                    base = n.inputs[0];
                }
                _ => break,
            }
        }
        let mut v = View::contiguous(g, base)?;
        for &n in chain.iter().rev() {
            let node = g.node(n);
            let out = g.tensor(node.outputs[0]).shape.dims().to_vec();
            v = match &node.op {
                Op::Transpose { perm } => v.transpose(perm),
                Op::Reshape { .. } => v.reshape(&out)?,
                Op::Expand { .. } => v.expand(&out)?,
                Op::Slice { axis, start, .. } => v.slice(*axis, *start, &out[*axis])?,
                _ => unreachable!("only views are on the chain"),
            };
        }
        Ok(v)
    }

    /// Output axis `a` is input axis `perm[a]`.
    pub fn transpose(&self, perm: &[usize]) -> View {
        View {
            tensor: self.tensor,
            offset: self.offset.clone(),
            axes: perm.iter().map(|&p| self.axes[p].clone()).collect(),
        }
    }

    fn expand(&self, out: &[Dim]) -> Res<View> {
        let off = out
            .len()
            .checked_sub(self.axes.len())
            .ok_or("an expand to fewer axes")?;
        let mut axes: Vec<Axis> = out[..off]
            .iter()
            .map(|d| Axis {
                size: d.clone(),
                stride: zero(),
                group: 1,
            })
            .collect();
        for (a, d) in self.axes.iter().zip(&out[off..]) {
            axes.push(if a.size.is_one() && !d.is_one() {
                Axis {
                    size: d.clone(),
                    stride: zero(),
                    group: 1,
                }
            } else {
                a.clone()
            });
        }
        Ok(View {
            tensor: self.tensor,
            offset: self.offset.clone(),
            axes,
        })
    }

    /// The view as an operand of a broadcasting op of shape `out`: missing
    /// leading axes and axes of one are read at element 0.
    pub fn broadcast(&self, out: &[Dim]) -> Res<View> {
        self.expand(out)
    }

    fn slice(&self, axis: usize, start: i64, len: &Dim) -> Res<View> {
        let mut v = self.clone();
        let a = &mut v.axes[axis];
        if start != 0 {
            if a.group != 1 {
                return Err("a slice of a shared key/value head".into());
            }
            let by = a
                .stride
                .checked_scale(Ratio::int(start))
                .ok_or("a stride overflows")?;
            v.offset = if is_zero(&v.offset) {
                by
            } else if is_zero(&by) {
                v.offset
            } else {
                v.offset
                    .checked_add(&by)
                    .ok_or("slices at offsets of different symbols")?
            };
        }
        v.axes[axis].size = len.clone();
        Ok(v)
    }

    /// The same elements in shape `out` (row-major), where strides can say it.
    pub fn reshape(&self, out: &[Dim]) -> Res<View> {
        let cannot = || "a reshape that no strides express".to_string();
        let ins: Vec<&Axis> = self.axes.iter().filter(|a| !a.size.is_one()).collect();
        let outs: Vec<usize> = (0..out.len()).filter(|&i| !out[i].is_one()).collect();
        let mut axes: Vec<Axis> = out
            .iter()
            .map(|d| Axis {
                size: d.clone(),
                stride: zero(),
                group: 1,
            })
            .collect();
        let (mut i, mut o) = (0, 0);
        while i < ins.len() || o < outs.len() {
            if i >= ins.len() || o >= outs.len() {
                return Err(cannot());
            }
            let (mut gi, mut go) = (vec![ins[i]], vec![outs[o]]);
            let (mut pi, mut po) = (ins[i].size.clone(), out[outs[o]].clone());
            i += 1;
            o += 1;
            while pi != po {
                if divides(&pi, &po) && i < ins.len() {
                    pi = mul(&pi, &ins[i].size)?;
                    gi.push(ins[i]);
                    i += 1;
                } else if divides(&po, &pi) && o < outs.len() {
                    po = mul(&po, &out[outs[o]])?;
                    go.push(outs[o]);
                    o += 1;
                } else {
                    return Err(cannot());
                }
            }
            // The input group as one axis, then split over the output group.
            let mut merged = gi.last().copied().cloned().ok_or_else(cannot)?;
            for outer in gi.iter().rev().skip(1) {
                merged = if merged.group == 1
                    && outer.group == 1
                    && outer.stride == mul(&merged.stride, &merged.size)?
                {
                    Axis {
                        size: mul(&outer.size, &merged.size)?,
                        ..merged
                    }
                } else if is_zero(&merged.stride) && outer.group == 1 && merged.group == 1 {
                    // Key/value heads repeated for grouped-query attention:
                    // each outer element read `size` times over.
                    let g = merged.size.as_const().ok_or_else(cannot)?;
                    Axis {
                        size: mul(&outer.size, &merged.size)?,
                        stride: outer.stride.clone(),
                        group: if is_zero(&outer.stride) { 1 } else { g },
                    }
                } else {
                    return Err(cannot());
                };
            }
            if go.len() == 1 {
                axes[go[0]] = Axis {
                    size: out[go[0]].clone(),
                    ..merged
                };
                continue;
            }
            if merged.group != 1 {
                return Err(cannot());
            }
            let mut stride = merged.stride.clone();
            for &k in go.iter().rev() {
                axes[k] = Axis {
                    size: out[k].clone(),
                    stride: stride.clone(),
                    group: 1,
                };
                stride = mul(&stride, &out[k])?;
            }
        }
        Ok(View {
            tensor: self.tensor,
            offset: self.offset.clone(),
            axes,
        })
    }
}

/// Whether a softmax is reachable from `t` through elementwise ops: the
/// chain is an attention's, so a reason is worth giving when it is refused.
fn reaches_softmax(g: &Graph, r: &Region, t: TensorId) -> bool {
    let mut queue = VecDeque::from([(t, 0)]);
    while let Some((t, depth)) = queue.pop_front() {
        for &c in r.consumers.get(&t).into_iter().flatten() {
            let n = g.node(c);
            match n.op {
                Op::Softmax { .. } => return true,
                Op::Unary(_)
                | Op::Binary(_)
                | Op::CausalMask
                | Op::Select
                | Op::Cast(_)
                | Op::Dropout { .. }
                    if depth < 8 =>
                {
                    queue.push_back((n.outputs[0], depth + 1));
                }
                _ => {}
            }
        }
    }
    false
}

/// Positions as a `[q, 1]` column (`col`) or a `[1, k]` row: `reshape`
/// of (a cast of) `iota`, or of the cp rank's part of it (a relayout from
/// replicated to its context chunks). `Some(true)` for the rank's part.
fn positions(g: &Graph, t: TensorId, col: bool) -> Option<bool> {
    let r = g.producer(t)?;
    let dims = g.tensor(t).shape.dims();
    if !matches!(r.op, Op::Reshape { .. }) || dims.len() != 2 || !dims[usize::from(col)].is_one() {
        return None;
    }
    let mut x = r.inputs[0];
    if let Some(Op::Cast(_)) = g.producer(x).map(|p| &p.op) {
        x = g.producer(x)?.inputs[0];
    }
    let whole = rank_chunks_of(g, x);
    let x = whole.unwrap_or(x);
    matches!(g.producer(x).map(|p| &p.op), Some(Op::Iota { .. })).then_some(whole.is_some())
}

/// The whole value that `t` is the cp rank's query chunks of: `t` made by
/// a relayout from replicated to context chunks along axis 0, which is how
/// `dplc_ir::split_context` slices what it builds from positions alone.
fn rank_chunks_of(g: &Graph, t: TensorId) -> Option<TensorId> {
    let n = g.producer(t)?;
    matches!(
        n.op,
        Op::Relayout {
            from: TensorLayout::Replicated,
            to: TensorLayout::Context { axis: 0 },
            ..
        }
    )
    .then(|| n.inputs[0])
}

/// The window term subtracted from the scores: the serial graph's
/// (`dplc_ir::window_mask`) or a cp rank's, the whole `[s, s]` term sliced
/// to the rank's query chunks. The window, whether it is the rank's, and
/// the nodes that make it (their values read by nothing else).
fn window_term(g: &Graph, r: &Region, t: TensorId) -> Res<(i64, bool, Vec<NodeId>)> {
    let not = || "the scores minus a term that is not a window mask".to_string();
    let whole = rank_chunks_of(g, t);
    let mask = dplc_ir::window_mask(g, whole.unwrap_or(t)).ok_or_else(not)?;
    let mut nodes = mask.nodes.to_vec();
    if whole.is_some() {
        nodes.push(producer_id(g, t).ok_or_else(not)?);
    }
    for &n in &nodes {
        let out = g.node(n).outputs[0];
        if (r.pinned)(out) || r.consumers.get(&out).map(Vec::len) != Some(1) {
            return Err(format!("the window term's {out} is read elsewhere"));
        }
    }
    Ok((mask.window as i64, whole.is_some(), nodes))
}

/// The causal mask of a cp rank's program (`dplc_ir::split_context`):
/// `select(key positions > the rank's query positions, −∞, scores)`, its
/// queries the rank's chunks and its keys every position. The node that
/// makes the condition (the comparison; the positions may have other readers).
fn context_causal_mask(g: &Graph, r: &Region, select: &dplc_ir::Node) -> Option<Vec<NodeId>> {
    let cond = select.inputs[0];
    if dplc_ir::scalar_constant(g, select.inputs[1]) != Some(f64::NEG_INFINITY)
        || r.consumers.get(&cond).map(Vec::len) != Some(1)
        || (r.pinned)(cond)
    {
        return None;
    }
    let gt = g.producer(select.inputs[0])?;
    if gt.op != Op::Binary(BinaryOp::Gt)
        || positions(g, gt.inputs[0], false) != Some(false)
        || positions(g, gt.inputs[1], true) != Some(true)
    {
        return None;
    }
    Some(vec![producer_id(g, select.inputs[0])?])
}

/// The attention whose score matmul is `qk`: `None` when its product is not
/// an attention's scores, else the match or why the kernel cannot take it.
pub(crate) fn match_attention(
    g: &Graph,
    r: &Region,
    qk: NodeId,
) -> Option<Result<AttentionMatch, String>> {
    let node = g.node(qk);
    // Scores are a product of two activations (a weight times an
    // activation feeding a softmax is a router's gate).
    let weight = |t: TensorId| {
        let mut t = t;
        while let Some(n) = g.producer(t) {
            match n.op {
                Op::Param(_) => return true,
                Op::Transpose { .. }
                | Op::Reshape { .. }
                | Op::Expand { .. }
                | Op::Slice { .. } => t = n.inputs[0],
                _ => return false,
            }
        }
        false
    };
    if node.op != Op::MatMul
        || node.inputs.iter().any(|&t| weight(t))
        || !reaches_softmax(g, r, node.outputs[0])
    {
        return None;
    }
    Some(attention_at(g, r, qk))
}

fn attention_at(g: &Graph, r: &Region, qk: NodeId) -> Res<AttentionMatch> {
    let only_reader = |t: TensorId| -> Res<NodeId> {
        if (r.pinned)(t) {
            return Err(format!(
                "{t} is kept in memory (a result or a value crossing a cut)"
            ));
        }
        match r.consumers.get(&t).map(Vec::as_slice) {
            Some([c]) => Ok(*c),
            _ => Err(format!("{t} has several readers")),
        }
    };
    let scores = g.node(qk).outputs[0];
    let shape = g.tensor(scores).shape.dims().to_vec();
    if shape.len() != 4 {
        return Err(format!(
            "scores of rank {}, the kernel takes [batch, heads, queries, keys]",
            shape.len()
        ));
    }
    let mut nodes = vec![qk];
    let (mut scale, mut bias, mut window, mut causal) = (None, None, None, false);
    // Per mask, whether it is a cp rank's (its queries the rank's chunks).
    let mut placed: Vec<bool> = Vec::new();
    let mut cur = scores;
    let softmax = loop {
        let c = only_reader(cur)?;
        let n = g.node(c);
        let other = |n: &dplc_ir::Node| {
            if n.inputs[0] == cur {
                n.inputs[1]
            } else {
                n.inputs[0]
            }
        };
        match &n.op {
            Op::Binary(BinaryOp::Mul) if cur == scores => {
                match dplc_ir::scalar_constant(g, other(n)) {
                    Some(c) => scale = Some(c),
                    None => return Err("the scores times a tensor".into()),
                }
            }
            Op::Binary(BinaryOp::Add) if bias.is_none() && n.inputs[0] != n.inputs[1] => {
                bias = Some(other(n));
            }
            Op::Binary(BinaryOp::Sub) if window.is_none() && n.inputs[0] == cur => {
                let (w, ranks, made) = window_term(g, r, n.inputs[1])?;
                window = Some(w);
                placed.push(ranks);
                nodes.extend(made);
            }
            Op::CausalMask if !causal => {
                causal = true;
                placed.push(false);
            }
            Op::Select if !causal && n.inputs[2] == cur => {
                let made = context_causal_mask(g, r, n)
                    .ok_or("the scores selected by a condition that is not a causal mask")?;
                causal = true;
                placed.push(true);
                nodes.extend(made);
            }
            Op::Softmax { axis } if *axis == 3 => break c,
            op => {
                return Err(format!(
                    "the scores feed `{}`, which the kernel does not take",
                    op.name()
                ))
            }
        }
        nodes.push(c);
        cur = n.outputs[0];
    };
    nodes.push(softmax);
    // The kernel has one place for its queries, which every mask reads.
    let query_context = placed.first().copied().unwrap_or(false);
    if placed.iter().any(|&p| p != query_context) {
        return Err("masks of the whole sequence and of a cp rank's queries together".into());
    }
    let mut probs = g.node(softmax).outputs[0];
    let mut dropout = None;
    let mut pv = only_reader(probs)?;
    if let Op::Dropout { p, context, split } = g.node(pv).op {
        let out = g.node(pv).outputs[0];
        if p > 0.0 {
            dropout = Some(MatchDropout {
                node: pv,
                p,
                out,
                split,
                context,
            });
        }
        nodes.push(pv);
        probs = out;
        pv = only_reader(probs)?;
    }
    let pvn = g.node(pv);
    if pvn.op != Op::MatMul || pvn.inputs[0] != probs || pvn.inputs[1] == probs {
        return Err(format!(
            "the probabilities feed `{}`, not a product with the values",
            pvn.op.name()
        ));
    }
    nodes.push(pv);

    let qkn = g.node(qk);
    let (qt, kt, vt) = (qkn.inputs[0], qkn.inputs[1], pvn.inputs[1]);
    for t in [qt, kt, vt] {
        if g.tensor(t).shape.rank() != 4 {
            return Err("operands that broadcast over the batch".into());
        }
    }
    let dims = |t: TensorId| g.tensor(t).shape.dims().to_vec();
    let (qd, kd, vd) = (dims(qt), dims(kt), dims(vt));
    let (batch, heads, q_len, k_len) = (
        shape[0].clone(),
        shape[1].clone(),
        shape[2].clone(),
        shape[3].clone(),
    );
    if qd[..2] != shape[..2] || kd[..2] != shape[..2] || vd[..2] != shape[..2] {
        return Err("operands that broadcast over the batch or the heads".into());
    }
    let head_dim = qd[3].as_const().ok_or("a head width that is not fixed")?;
    let value_dim = vd[3].as_const().ok_or("a value width that is not fixed")?;
    let q = View::of(g, qt)?;
    // Kᵀ's axes are (batch, head, feature, key).
    let k = View::of(g, kt)?.transpose(&[0, 1, 3, 2]);
    let v = View::of(g, vt)?;
    let heads_const = heads.as_const();
    // The key/value head each query head reads: one head of a group
    // repeated (grouped-query), or one for all (multi-query).
    let group_of = |v: &View| -> Res<i64> {
        let h = &v.axes[1];
        if is_zero(&h.stride) && !h.size.is_one() {
            heads_const
                .ok_or_else(|| "a shared key head over a head count that is not fixed".into())
        } else {
            Ok(h.group)
        }
    };
    let group = group_of(&k)?;
    if group_of(&v)? != group {
        return Err("keys and values shared over different groups of heads".into());
    }
    let kv_heads = if group == 1 {
        heads.clone()
    } else {
        match heads_const {
            Some(h) if h % group == 0 => Dim::konst(h / group),
            _ => return Err("query heads that are not whole groups of key heads".into()),
        }
    };
    let by_key_head = |mut v: View| -> View {
        if group > 1 {
            v.axes[1] = Axis {
                size: kv_heads.clone(),
                stride: if v.axes[1].group == 1 {
                    zero()
                } else {
                    v.axes[1].stride.clone()
                },
                group: 1,
            };
        }
        v
    };
    let (k, v) = (by_key_head(k), by_key_head(v));
    for (what, view) in [("queries", &q), ("keys", &k), ("values", &v)] {
        for a in &view.axes {
            if a.group != 1 || (is_zero(&a.stride) && !a.size.is_one()) {
                return Err(format!(
                    "{what} read as a view that repeats elements (their gradient would be a sum)"
                ));
            }
        }
    }
    let bias = match bias {
        None => None,
        Some(b) => {
            let bv = View::of(g, b)?.broadcast(&shape)?;
            if bv.axes.iter().any(|a| a.group != 1) {
                return Err("a bias read through a grouped view".into());
            }
            Some(bv)
        }
    };
    // The output: through the transposes and reshapes its one reader takes.
    let mut end = pvn.outputs[0];
    let mut views = Vec::new();
    while let Ok(c) = only_reader(end) {
        match g.node(c).op {
            Op::Transpose { .. } | Op::Reshape { .. } => {
                views.push(c);
                end = g.node(c).outputs[0];
            }
            _ => break,
        }
    }
    // The buffer is the last transpose's output (later reshapes alias it).
    while let Some(&last) = views.last() {
        if matches!(g.node(last).op, Op::Transpose { .. }) {
            break;
        }
        views.pop();
    }
    let buffer = views
        .last()
        .map_or(pvn.outputs[0], |&n| g.node(n).outputs[0]);
    let mut out = View::contiguous(g, buffer)?;
    for &n in views.iter().rev() {
        let node = g.node(n);
        let input = g.tensor(node.inputs[0]).shape.dims().to_vec();
        out = match &node.op {
            Op::Transpose { perm } => {
                let mut inv = vec![0; perm.len()];
                for (a, &p) in perm.iter().enumerate() {
                    inv[p] = a;
                }
                out.transpose(&inv)
            }
            _ => out.reshape(&input)?,
        };
    }
    nodes.extend(views);
    Ok(AttentionMatch {
        nodes,
        pv,
        batch,
        heads,
        kv_heads,
        group,
        q_len,
        k_len,
        head_dim,
        value_dim,
        scale: scale.unwrap_or(1.0),
        causal,
        window,
        q,
        k,
        v,
        bias,
        out,
        query_context,
        dropout,
    })
}
