//! Lowering a materialized tensor into its kernel: the ops it recomputes
//! inside (views become index arithmetic), its row operation (the anchor)
//! and what it stores.

use super::*;

/// Where a row kernel is: its anchor, the axis it reduces, the anchor's input shape.
struct Anchor {
    node: NodeId,
    axis: usize,
    shape: Shape,
}

struct Lower<'a, 'g> {
    a: &'a Analysis<'g>,
    b: Builder,
    buffers: Vec<Buffer>,
    tensors: Vec<TensorId>,
    sizes: Vec<Dim>,
    key_sizes: Vec<(usize, KeySize)>,
    nodes: BTreeSet<NodeId>,
    anchor: Option<Anchor>,
    stores: Vec<Store>,
    memo: HashMap<(TensorId, Vec<Idx>), ValueId>,
    /// Flat indices that delinearised into these multi-indices over these dims.
    flat_of: HashMap<(Vec<Idx>, Vec<Dim>), Idx>,
    row_stats: HashMap<NodeId, Vec<ValueId>>,
    candidates: &'a HashSet<TensorId>,
    absorbed: Vec<TensorId>,
    root: TensorId,
}

type Res<T> = Result<T, String>;

pub(super) fn lower_root(
    a: &Analysis<'_>,
    root: TensorId,
    anchor: Option<NodeId>,
    candidates: &HashSet<TensorId>,
) -> Res<(FusedKernel, Vec<TensorId>)> {
    let g = a.g;
    let mut l = Lower {
        a,
        b: Builder::default(),
        buffers: Vec::new(),
        tensors: Vec::new(),
        sizes: Vec::new(),
        key_sizes: Vec::new(),
        nodes: BTreeSet::new(),
        anchor: None,
        stores: Vec::new(),
        memo: HashMap::new(),
        flat_of: HashMap::new(),
        row_stats: HashMap::new(),
        candidates,
        absorbed: Vec::new(),
        root,
    };
    let shape = g.tensor(root).shape.clone();
    let space;
    let index: Vec<Idx>;
    match anchor {
        None => {
            space = Space {
                outer: shape.dims().iter().map(|d| l.size(d)).collect(),
                inner: None,
            };
            index = (0..shape.rank()).map(Idx::Var).collect();
        }
        Some(n) => {
            let node = g.node(n);
            let axis = row_axis(g, n);
            let in_shape = g.tensor(node.inputs[0]).shape.clone();
            let rank = in_shape.rank();
            let rows: Vec<Idx> = (0..rank - 1).map(Idx::Var).collect();
            let outer = in_shape
                .dims()
                .iter()
                .enumerate()
                .filter(|(i, _)| *i != axis)
                .map(|(_, d)| d.clone())
                .collect::<Vec<_>>();
            space = Space {
                outer: outer.iter().map(|d| l.size(d)).collect(),
                inner: Some(l.size(&in_shape.dims()[axis])),
            };
            // A keep-dim reduction has a 1 where the row was.
            let keeps_dim = shape.rank() == rank
                && shape.dims()[axis].is_one()
                && !in_shape.dims()[axis].is_one();
            let along_row = shape.rank() == rank && !keeps_dim;
            index = if shape.rank() == rank - 1 {
                rows
            } else {
                let mut i = rows;
                i.insert(axis, if along_row { Idx::Inner } else { Idx::Const(0) });
                i
            };
            l.anchor = Some(Anchor {
                node: n,
                axis,
                shape: in_shape,
            });
        }
    }
    let out = l.buffer(root, true);
    let value = l.compute(root, &index)?;
    let at = l.linearize(&index, shape.dims());
    l.stores.insert(
        0,
        Store {
            buf: out,
            index: at,
            value,
            accumulate: false,
        },
    );
    let nodes: Vec<NodeId> = l.nodes.iter().copied().collect();
    let mut names: Vec<&'static str> = Vec::new();
    for &n in &nodes {
        let op = &g.node(n).op;
        if role(op) == Role::Inline || matches!(op, Op::Cast(_)) {
            continue;
        }
        if names.last() != Some(&op.name()) && names.len() < 4 {
            names.push(op.name());
        }
    }
    let op = if names.is_empty() {
        "copy".to_string()
    } else {
        names.join("_")
    };
    let kernel = Kernel {
        op,
        sizes: l.sizes.len(),
        scalars: 0,
        buffers: l.buffers,
        space,
        values: l.b.values,
        stores: l.stores,
    };
    Ok((
        FusedKernel {
            kernel,
            buffers: l.tensors,
            sizes: l.sizes,
            key_sizes: l.key_sizes,
            nodes,
            keeps_row_stats: false,
        },
        l.absorbed,
    ))
}

impl Lower<'_, '_> {
    fn g(&self) -> &Graph {
        self.a.g
    }

    fn size(&mut self, d: &Dim) -> Size {
        if let Some(c) = d.as_const() {
            return Size::Const(c);
        }
        let k = match self.sizes.iter().position(|x| x == d) {
            Some(k) => k,
            None => {
                self.sizes.push(d.clone());
                self.sizes.len() - 1
            }
        };
        Size::Param(k)
    }

    /// The size argument carrying a word of the dropout key.
    fn key_size(&mut self, k: KeySize) -> Size {
        if let Some(&(i, _)) = self.key_sizes.iter().find(|(_, x)| *x == k) {
            return Size::Param(i);
        }
        self.sizes.push(Dim::konst(0));
        let i = self.sizes.len() - 1;
        self.key_sizes.push((i, k));
        Size::Param(i)
    }

    fn size_idx(&mut self, d: &Dim) -> Idx {
        match self.size(d) {
            Size::Const(c) => Idx::Const(c),
            s => Idx::Size(s),
        }
    }

    fn buffer(&mut self, t: TensorId, output: bool) -> usize {
        if let Some(i) = self.tensors.iter().position(|&x| x == t) {
            return i;
        }
        let tensor = self.g().tensor(t).clone();
        let len = tensor.shape.dims().iter().map(|d| self.size(d)).collect();
        self.buffers.push(Buffer {
            label: t.to_string(),
            elem: tensor_elem(&tensor),
            output,
            len,
        });
        self.tensors.push(t);
        self.tensors.len() - 1
    }

    fn linearize(&mut self, index: &[Idx], dims: &[Dim]) -> Idx {
        if let Some(flat) = self.flat_of.get(&(index.to_vec(), dims.to_vec())) {
            return flat.clone();
        }
        let mut acc = Idx::Const(0);
        for (i, d) in index.iter().zip(dims) {
            let s = self.size_idx(d);
            acc = Idx::add(Idx::mul(acc, s), i.clone());
        }
        acc
    }

    /// The flat index in the whole tensor of element `index` of a tensor of
    /// `dims` that is this rank's part: [`whole_index`] over this kernel's
    /// size arguments.
    fn whole_index(
        &mut self,
        index: &[Idx],
        dims: &[Dim],
        split: Option<usize>,
        context: Option<usize>,
    ) -> Idx {
        let lens: Vec<Idx> = dims.iter().map(|d| self.size_idx(d)).collect();
        whole_index(index, &lens, split, context, &mut |k| self.key_size(k))
    }

    fn delinearize(&mut self, flat: Idx, dims: &[Dim]) -> Vec<Idx> {
        let mut out = vec![Idx::Const(0); dims.len()];
        let mut stride = Idx::Const(1);
        for k in (0..dims.len()).rev() {
            let d = self.size_idx(&dims[k]);
            let q = Idx::div(flat.clone(), stride.clone());
            out[k] = if k == 0 { q } else { Idx::rem(q, d.clone()) };
            stride = Idx::mul(stride, d);
        }
        self.flat_of.insert((out.clone(), dims.to_vec()), flat);
        out
    }

    /// The index into an input of shape `from` of a broadcasting elementwise op at `index`.
    fn broadcast(&self, index: &[Idx], from: &Shape, out: &Shape) -> Vec<Idx> {
        let off = out.rank() - from.rank();
        (0..from.rank())
            .map(|k| {
                if from.dims()[k].is_one() && !out.dims()[k + off].is_one() {
                    Idx::Const(0)
                } else {
                    index[k + off].clone()
                }
            })
            .collect()
    }

    fn value(&mut self, t: TensorId, index: &[Idx]) -> Res<ValueId> {
        let g = self.a.g;
        if g.tensor(t).dtype == DType::I32 {
            let i = self.index(t, index)?;
            return Ok(self.b.push(Expr::FromIndex(i)));
        }
        if self.absorbed.contains(&t) && self.memo.contains_key(&(t, index.to_vec())) {
            return self.compute(t, index);
        }
        if t != self.root && self.a.in_memory(t) {
            if self.absorbable(t, index) {
                self.absorbed.push(t);
                let v = self.compute(t, index)?;
                let buf = self.buffer(t, true);
                let at = self.linearize(index, g.tensor(t).shape.dims());
                self.stores.push(Store {
                    buf,
                    index: at,
                    value: v,
                    accumulate: false,
                });
                return Ok(v);
            }
            let buf = self.buffer(t, false);
            let at = self.linearize(index, g.tensor(t).shape.dims());
            return Ok(self.b.push(Expr::Load { buf, index: at }));
        }
        self.compute(t, index)
    }

    /// Whether materialized `t` can be computed and stored here instead of in its own kernel.
    fn absorbable(&self, t: TensorId, index: &[Idx]) -> bool {
        let Some(anchor) = &self.anchor else {
            return false;
        };
        if !self.candidates.contains(&t)
            || self.absorbed.contains(&t)
            || !self.a.materialized.contains(&t)
        {
            return false;
        }
        let g = self.a.g;
        let rank = anchor.shape.rank();
        if g.tensor(t).shape != anchor.shape || anchor.axis + 1 != rank {
            return false;
        }
        let mut want: Vec<Idx> = (0..rank - 1).map(Idx::Var).collect();
        want.push(Idx::Inner);
        if index != want.as_slice() {
            return false;
        }
        // Every other reader of `t` must run after this kernel.
        let root_pos = self.a.pos[&node_of(g, self.root)];
        self.a.consumers.get(&t).is_some_and(|cs| {
            cs.iter()
                .all(|c| self.a.pos[c] > root_pos || self.is_fused_here(*c))
        })
    }

    fn is_fused_here(&self, c: NodeId) -> bool {
        // The anchor chain: the readers this kernel recomputes are before its root.
        let g = self.a.g;
        let anchor = self.anchor.as_ref().map(|a| a.node);
        Some(c) == anchor
            || g.node(c)
                .outputs
                .iter()
                .any(|o| !self.a.in_memory(*o) && self.memo.keys().any(|(t, _)| t == o))
    }

    fn index(&mut self, t: TensorId, index: &[Idx]) -> Res<Idx> {
        let g = self.a.g;
        if self.a.in_memory(t) && t != self.root {
            let buf = self.buffer(t, false);
            let at = self.linearize(index, g.tensor(t).shape.dims());
            return Ok(Idx::Load(buf, Box::new(at)));
        }
        let node = g.producer(t).expect("computed tensors have producers");
        self.nodes.insert(node_of(g, t));
        let out = &g.tensor(t).shape;
        Ok(match &node.op {
            Op::Iota { .. } => index[0].clone(),
            Op::Cast(_) => {
                let x = node.inputs[0];
                match g.producer(x).map(|n| &n.op) {
                    _ if g.tensor(x).dtype == DType::I32 => self.index(x, index)?,
                    Some(Op::Constant(c)) if c.fract() == 0.0 => Idx::Const(*c as i64),
                    _ => return Err("a float cast to an index inside a kernel".into()),
                }
            }
            Op::Binary(op @ (BinaryOp::Add | BinaryOp::Sub | BinaryOp::Mul)) => {
                let (x, y) = (node.inputs[0], node.inputs[1]);
                let ix = self.broadcast(index, &g.tensor(x).shape, out);
                let iy = self.broadcast(index, &g.tensor(y).shape, out);
                let (x, y) = (self.index(x, &ix)?, self.index(y, &iy)?);
                match op {
                    BinaryOp::Add => Idx::add(x, y),
                    BinaryOp::Sub => Idx::sub(x, y),
                    _ => Idx::mul(x, y),
                }
            }
            Op::Transpose { .. } | Op::Reshape { .. } | Op::Expand { .. } | Op::Slice { .. } => {
                let inner = self.view_index(node_of(g, t), index);
                self.index(node.inputs[0], &inner)?
            }
            Op::Pad { value, .. } => {
                let (ix, (from, len)) = self.pad_source(node_of(g, t), index);
                let x = self.index(node.inputs[0], &ix)?;
                // No select on indices: `inside` is 1 or 0 by clamping,
                // `[0 <= from] * [from < len]`, and the id is mixed by it.
                let one = || Idx::Const(1);
                let clamp01 = |i: Idx| Idx::min(Idx::max(i, Idx::Const(0)), one());
                let lo = clamp01(Idx::add(from.clone(), one()));
                let hi = clamp01(Idx::sub(len, from));
                let inside = Idx::mul(lo, hi);
                let fill = Idx::mul(Idx::sub(one(), inside.clone()), Idx::Const(*value as i64));
                Idx::add(Idx::mul(inside, x), fill)
            }
            op => return Err(format!("`{}` on indices inside a kernel", op.name())),
        })
    }

    /// For a pad node at output `index`: the input index it reads (its
    /// padded axis clamped into the input), and that axis's unclamped source
    /// position with the input's length, to test whether it is inside.
    fn pad_source(&mut self, n: NodeId, index: &[Idx]) -> (Vec<Idx>, (Idx, Idx)) {
        let g = self.a.g;
        let node = g.node(n);
        let Op::Pad { axis, before, .. } = node.op else {
            unreachable!("only pads")
        };
        let len = g.tensor(node.inputs[0]).shape.dims()[axis].clone();
        let len = self.size_idx(&len);
        let from = Idx::sub(index[axis].clone(), Idx::Const(before));
        let mut ix = index.to_vec();
        ix[axis] = Idx::min(
            Idx::max(from.clone(), Idx::Const(0)),
            Idx::sub(len.clone(), Idx::Const(1)),
        );
        (ix, (from, len))
    }

    /// The input index of a view node at output `index`.
    fn view_index(&mut self, n: NodeId, index: &[Idx]) -> Vec<Idx> {
        let g = self.a.g;
        let node = g.node(n);
        let input = g.tensor(node.inputs[0]).shape.clone();
        let out = g.tensor(node.outputs[0]).shape.clone();
        match &node.op {
            Op::Transpose { perm } => {
                let mut inner = vec![Idx::Const(0); perm.len()];
                for (i, &p) in perm.iter().enumerate() {
                    inner[p] = index[i].clone();
                }
                inner
            }
            Op::Reshape { .. } => {
                let flat = self.linearize(index, out.dims());
                self.delinearize(flat, input.dims())
            }
            Op::Expand { .. } => self.broadcast(index, &input, &out),
            Op::Slice { axis, start, .. } => {
                let mut inner = index.to_vec();
                inner[*axis] = Idx::add(inner[*axis].clone(), Idx::Const(*start));
                inner
            }
            _ => unreachable!("only views"),
        }
    }

    /// Lower the node producing `t` at `index`, whether or not `t` is materialized.
    fn compute(&mut self, t: TensorId, index: &[Idx]) -> Res<ValueId> {
        let key = (t, index.to_vec());
        if let Some(&v) = self.memo.get(&key) {
            return Ok(v);
        }
        let v = self.compute_inner(t, index)?;
        self.memo.insert(key, v);
        Ok(v)
    }

    fn compute_inner(&mut self, t: TensorId, index: &[Idx]) -> Res<ValueId> {
        let g = self.a.g;
        // Integer arithmetic (positions, shifted ids) stored for a reader
        // that is not a kernel (a vocabulary-parallel lookup): its index
        // expression, written as a value.
        if g.tensor(t).dtype == DType::I32 {
            let i = self.index(t, index)?;
            return Ok(self.b.push(Expr::FromIndex(i)));
        }
        let n = node_of(g, t);
        let node = g.node(n);
        self.nodes.insert(n);
        let out = g.tensor(t).shape.clone();
        let input = |i: usize| node.inputs[i];
        Ok(match &node.op {
            Op::Constant(c) => self.b.konst(*c),
            Op::Unary(op) => {
                let x = self.value(input(0), index)?;
                self.b.unary(*op, x)
            }
            Op::Binary(op) => {
                let ix = self.broadcast(index, &g.tensor(input(0)).shape, &out);
                let iy = self.broadcast(index, &g.tensor(input(1)).shape, &out);
                let x = self.value(input(0), &ix)?;
                let y = self.value(input(1), &iy)?;
                self.b.binary(*op, x, y)
            }
            Op::Cast(_) => self.value(input(0), index)?,
            Op::Transpose { .. } | Op::Reshape { .. } | Op::Expand { .. } | Op::Slice { .. } => {
                let inner = self.view_index(n, index);
                self.value(input(0), &inner)?
            }
            Op::Concat { axis } => {
                let mut parts = Vec::new();
                let mut offset = Idx::Const(0);
                for &x in &node.inputs {
                    let len = g.tensor(x).shape.dims()[*axis].clone();
                    let len = self.size_idx(&len);
                    let mut ix = index.to_vec();
                    let local = Idx::sub(index[*axis].clone(), offset.clone());
                    ix[*axis] = Idx::min(
                        Idx::max(local, Idx::Const(0)),
                        Idx::sub(len.clone(), Idx::Const(1)),
                    );
                    let v = self.value(x, &ix)?;
                    offset = Idx::add(offset, len);
                    parts.push((v, offset.clone()));
                }
                let (mut acc, _) = parts.pop().expect("concat has inputs");
                while let Some((v, end)) = parts.pop() {
                    acc = self.b.push(Expr::Select {
                        cond: Cond::IdxLt(index[*axis].clone(), end),
                        then: v,
                        otherwise: acc,
                    });
                }
                acc
            }
            Op::Pad {
                before,
                after,
                value,
                ..
            } => {
                let (ix, inside) = self.pad_source(n, index);
                let x = self.value(input(0), &ix)?;
                let fill = self.b.konst(*value);
                let (from, len) = inside;
                // Only the ends that grew need a test: a cropped end reads inside.
                let mut v = x;
                if *after > 0 {
                    v = self.b.push(Expr::Select {
                        cond: Cond::IdxLt(from.clone(), len),
                        then: v,
                        otherwise: fill,
                    });
                }
                if *before > 0 {
                    v = self.b.push(Expr::Select {
                        cond: Cond::IdxLt(from, Idx::Const(0)),
                        then: fill,
                        otherwise: v,
                    });
                }
                v
            }
            Op::Select => {
                let ix =
                    |i: usize, me: &mut Self| me.broadcast(index, &g.tensor(input(i)).shape, &out);
                let (ic, ia, ib) = (ix(0, self), ix(1, self), ix(2, self));
                let c = self.value(input(0), &ic)?;
                let then = self.value(input(1), &ia)?;
                let otherwise = self.value(input(2), &ib)?;
                // Non-zero: 0 < |c|.
                let zero = self.b.konst(0.0);
                let mag = self.b.unary(UnaryOp::Abs, c);
                self.b.push(Expr::Select {
                    cond: Cond::ValLt(zero, mag),
                    then,
                    otherwise,
                })
            }
            Op::CausalMask => {
                let x = self.value(input(0), index)?;
                let r = index.len();
                let neg_inf = self.b.konst(f64::NEG_INFINITY);
                self.b.push(Expr::Select {
                    cond: Cond::IdxLt(index[r - 2].clone(), index[r - 1].clone()),
                    then: neg_inf,
                    otherwise: x,
                })
            }
            Op::Dropout { p, context, split } => {
                let x = self.value(input(0), index)?;
                if *p == 0.0 {
                    x
                } else {
                    let t = node.outputs[0];
                    let at = match (*split, *context) {
                        (None, None) => self.linearize(index, out.dims()),
                        (split, context) => self.whole_index(index, out.dims(), split, context),
                    };
                    let per_sample = draw_per_sample(t, *split, *context);
                    let key = DrawKey {
                        node: n.index() as u64,
                        layer: self.key_size(KeySize::Layer),
                        first_sample: self.key_size(KeySize::FirstSample),
                        per_sample: self.key_size(per_sample),
                    };
                    let r = self.b.push(Expr::Random { key, index: at });
                    let pv = self.b.konst(drop_threshold(*p));
                    let zero = self.b.konst(0.0);
                    let scale = self.b.konst(1.0 / (1.0 - *p));
                    let kept = self.b.binary(BinaryOp::Mul, x, scale);
                    self.b.push(Expr::Select {
                        cond: Cond::ValLt(r, pv),
                        then: zero,
                        otherwise: kept,
                    })
                }
            }
            Op::Embedding => {
                let r = index.len();
                let row = self.index(input(1), &index[..r - 1])?;
                self.value(input(0), &[row, index[r - 1].clone()])?
            }
            Op::TakeAlong => {
                let col = self.index(input(1), index)?;
                let mut ix = index.to_vec();
                ix.push(col);
                self.value(input(0), &ix)?
            }
            Op::Reduce { .. }
            | Op::Softmax { .. }
            | Op::LogSoftmax { .. }
            | Op::LayerNorm { .. }
            | Op::RmsNorm { .. }
            | Op::CumSum { .. } => self.row_op(n, index)?,
            op => return Err(format!("`{}` inside a kernel", op.name())),
        })
    }

    fn row_op(&mut self, n: NodeId, index: &[Idx]) -> Res<ValueId> {
        let g = self.a.g;
        let node = g.node(n);
        let Some(anchor) = &self.anchor else {
            return Err("a row operation in an elementwise kernel".into());
        };
        if anchor.node != n {
            return Err("a second row operation in one kernel".into());
        }
        let axis = anchor.axis;
        let rank = anchor.shape.rank();
        let inner_len = anchor.shape.dims()[axis].clone();
        // The point asked for: its row must be this kernel's row.
        let (rows, col): (Vec<Idx>, Option<Idx>) = match &node.op {
            Op::Reduce { keep_dim, .. } => {
                let mut r = index.to_vec();
                if *keep_dim {
                    r.remove(axis);
                }
                (r, None)
            }
            _ => {
                let mut r = index.to_vec();
                let c = r.remove(axis);
                (r, Some(c))
            }
        };
        if rows != (0..rank - 1).map(Idx::Var).collect::<Vec<_>>() {
            return Err("a row operation read at another row".into());
        }
        let at = |c: Idx| {
            let mut i = rows.clone();
            i.insert(axis, c);
            i
        };
        let x = node.inputs[0];
        if let Op::CumSum { reverse, .. } = node.op {
            // The scan gives element `j` of the row: read at the point's own `j`.
            if col != Some(Idx::Inner) {
                return Err("a running sum read at another position of its row".into());
            }
            let xj = self.value(x, &at(Idx::Inner))?;
            return Ok(self.b.scan(xj, reverse));
        }
        let stats = match self.row_stats.get(&n) {
            Some(s) => s.clone(),
            None => {
                let xj = self.value(x, &at(Idx::Inner))?;
                let len = self.size_idx(&inner_len);
                let len = match len {
                    Idx::Const(c) => self.b.konst(c as f64),
                    i => self.b.push(Expr::FromIndex(i)),
                };
                let s = match &node.op {
                    Op::Reduce { kind, .. } => {
                        let r = self.b.reduce(
                            if *kind == ReduceKind::Max {
                                RowReduce::Max
                            } else {
                                RowReduce::Sum
                            },
                            xj,
                        );
                        if *kind == ReduceKind::Mean {
                            vec![self.b.binary(BinaryOp::Div, r, len)]
                        } else {
                            vec![r]
                        }
                    }
                    Op::Softmax { .. } | Op::LogSoftmax { .. } => {
                        let m = self.b.reduce(RowReduce::Max, xj);
                        let d = self.b.binary(BinaryOp::Sub, xj, m);
                        let e = self.b.unary(UnaryOp::Exp, d);
                        let s = self.b.reduce(RowReduce::Sum, e);
                        vec![m, s]
                    }
                    Op::LayerNorm { eps } => {
                        let sum = self.b.reduce(RowReduce::Sum, xj);
                        let mean = self.b.binary(BinaryOp::Div, sum, len);
                        let d = self.b.binary(BinaryOp::Sub, xj, mean);
                        let d2 = self.b.binary(BinaryOp::Mul, d, d);
                        let ss = self.b.reduce(RowReduce::Sum, d2);
                        let var = self.b.binary(BinaryOp::Div, ss, len);
                        let eps = self.b.konst(*eps);
                        let ve = self.b.binary(BinaryOp::Add, var, eps);
                        let rstd = self.b.unary(UnaryOp::Rsqrt, ve);
                        vec![mean, rstd]
                    }
                    Op::RmsNorm { eps } => {
                        let x2 = self.b.binary(BinaryOp::Mul, xj, xj);
                        let ss = self.b.reduce(RowReduce::Sum, x2);
                        let ms = self.b.binary(BinaryOp::Div, ss, len);
                        let eps = self.b.konst(*eps);
                        let me = self.b.binary(BinaryOp::Add, ms, eps);
                        vec![self.b.unary(UnaryOp::Rsqrt, me)]
                    }
                    _ => unreachable!("row operations only"),
                };
                self.row_stats.insert(n, s.clone());
                s
            }
        };
        let Some(col) = col else { return Ok(stats[0]) };
        let xi = self.value(x, &at(col.clone()))?;
        Ok(match &node.op {
            Op::Softmax { .. } => {
                let d = self.b.binary(BinaryOp::Sub, xi, stats[0]);
                let e = self.b.unary(UnaryOp::Exp, d);
                self.b.binary(BinaryOp::Div, e, stats[1])
            }
            Op::LogSoftmax { .. } => {
                let ls = self.b.unary(UnaryOp::Log, stats[1]);
                let lse = self.b.binary(BinaryOp::Add, stats[0], ls);
                self.b.binary(BinaryOp::Sub, xi, lse)
            }
            Op::LayerNorm { .. } => {
                let d = self.b.binary(BinaryOp::Sub, xi, stats[0]);
                let nrm = self.b.binary(BinaryOp::Mul, d, stats[1]);
                let w = self.value(node.inputs[1], std::slice::from_ref(&col))?;
                let bias = self.value(node.inputs[2], &[col])?;
                let y = self.b.binary(BinaryOp::Mul, nrm, w);
                self.b.binary(BinaryOp::Add, y, bias)
            }
            Op::RmsNorm { .. } => {
                let nrm = self.b.binary(BinaryOp::Mul, xi, stats[0]);
                let w = self.value(node.inputs[1], &[col])?;
                self.b.binary(BinaryOp::Mul, nrm, w)
            }
            _ => unreachable!("reductions return above"),
        })
    }
}
