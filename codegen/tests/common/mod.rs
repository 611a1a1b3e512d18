//! Shared by codegen's tests: zoo models, the plan printout, and a small
//! unfused reference evaluator of the IR on concrete shapes.
#![allow(dead_code)]

pub mod host;

use dplc_codegen::{Data, FusionPlan, Step};
use dplc_ir::{DType, Dim, Graph, Op, ReduceKind, RegionId, TensorId};
use std::collections::HashMap;
use std::path::Path;

/// The passes of `k` the codegen may emit in `dtype`, in launch order: the
/// two-pass backward's and, where the codegen takes it, the one-pass
/// backward's (`ALL`'s order is each one's launch order) — every pass a
/// test of the generated code should see.
pub fn attention_passes(
    k: &dplc_codegen::AttentionKernel,
    dtype: DType,
) -> Vec<dplc_codegen::AttentionPass> {
    use dplc_codegen::{attention_backward, AttentionBackward, AttentionPass};
    let mut wanted = k.passes(AttentionBackward::TwoPass);
    wanted.extend(k.passes(attention_backward(k, dtype)));
    AttentionPass::ALL
        .into_iter()
        .filter(|p| wanted.contains(p) && k.runs(*p, [true; 4]))
        .collect()
}

/// The first fused attention of `g`'s regions.
pub fn first_attention(g: &dplc_ir::Graph) -> dplc_codegen::FusedAttention {
    g.regions()
        .flat_map(|(r, _)| dplc_codegen::fuse(g, r).steps)
        .find_map(|s| match s {
            Step::Attention(at) => Some(at),
            _ => None,
        })
        .expect("a fused attention")
}

pub fn zoo(file: &str, model: &str) -> dplc_frontend::Lowered {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../models")
        .join(file);
    let text = std::fs::read_to_string(&path).expect("zoo files are in the repository");
    let unit = dplc_frontend::parse(&format!("models/{file}"), &text)
        .unwrap_or_else(|d| panic!("{}", d.render_plain()));
    unit.lower(model)
        .unwrap_or_else(|d| panic!("{}", d.render_plain()))
}

/// Shifts and pads of a float activation along its symbolic sequence axis and
/// its fixed feature axis, read by the kernels that fuse them.
pub const SHIFTS: &str = "model m() {\n  input x: f32[batch, seq, 4]\n  param w: [4, 4]\n  \
    h = x @ w\n  y = shift(h, 1, 1) + shift(h, 1, -2, fill = 0.5) + pad(pad(h, 2, 2, -1), 2, -1, 0)\n  \
    return mean(mean(mean(y * y, -1), -1), -1)\n}\n";

/// Running sums: along the last axis of an elementwise chain, from the end,
/// along a middle axis (strided rows), and one read again by an op after it.
pub const SCANS: &str = "model m() {\n  input x: f32[batch, seq, 4]\n  param w: [4, 4]\n  \
    h = x @ w\n  a = cumsum(h * 2.0 - 1.0)\n  b = cumsum(h, axis = -1, reverse = true)\n  \
    c = cumsum(h, axis = 1)\n  y = a * b + tanh(c) + exp(cumsum(h, axis = 1, reverse = true) * 0.1)\n  \
    return mean(mean(mean(y * y, -1), -1), -1)\n}\n";

/// Model `m` of `src`.
pub fn lower_m(src: &str) -> Graph {
    let unit =
        dplc_frontend::parse("test.dpl", src).unwrap_or_else(|d| panic!("{}", d.render_plain()));
    unit.lower("m")
        .unwrap_or_else(|d| panic!("{}", d.render_plain()))
        .graph
}

/// The zoo's t5_tiny without dropout (which the reference evaluator leaves out).
pub fn t5_tiny_without_dropout() -> Graph {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../models/t5.dpl");
    let text = std::fs::read_to_string(&path).expect("zoo files are in the repository");
    lower_m(&format!("{text}\nmodel m = t5_tiny(dropout = 0.0)\n"))
}

/// Every model of every zoo file.
pub fn all_zoo() -> Vec<(String, dplc_frontend::Lowered)> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../models");
    let mut files: Vec<_> = std::fs::read_dir(&dir)
        .expect("models/ exists")
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "dpl"))
        .collect();
    files.sort();
    let mut out = Vec::new();
    for f in files {
        let text = std::fs::read_to_string(&f).expect("readable");
        let name = f.file_name().unwrap().to_string_lossy().into_owned();
        let unit =
            dplc_frontend::parse(&name, &text).unwrap_or_else(|d| panic!("{}", d.render_plain()));
        for m in unit.model_names() {
            let lowered = unit
                .lower(&m)
                .unwrap_or_else(|d| panic!("{}", d.render_plain()));
            out.push((m, lowered));
        }
    }
    out
}

/// The plan of one region as text: one line per step, kernels with their IR.
pub fn plan_text(g: &Graph, plan: &FusionPlan) -> String {
    let mut s = format!("region {}\n", plan.region);
    for (n, reason) in &plan.unfused_attention {
        s += &format!(
            "  attention at {} runs unfused: {reason}\n",
            g.node(*n).outputs[0]
        );
    }
    for step in &plan.steps {
        match step {
            Step::MatMul { node, a, b } => {
                let t = |o: &dplc_codegen::Operand| {
                    format!("{}{}", o.tensor, if o.transposed { "ᵀ" } else { "" })
                };
                s += &format!(
                    "  matmul {} = {} × {}\n",
                    g.node(*node).outputs[0],
                    t(a),
                    t(b)
                );
            }
            Step::Extern { node, reason } => {
                s += &format!("  extern {} ({reason})\n", g.node(*node).op.name());
            }
            Step::Attention(at) => {
                let sizes: Vec<String> = at.sizes.iter().map(|d| g.dim_str(d)).collect();
                s += &format!(
                    "  attention {} -> {}  sizes [{}]\n",
                    g.node(at.nodes[0]).outputs[0],
                    at.out,
                    sizes.join(", ")
                );
                for line in at.kernel.text().lines() {
                    s += &format!("    {line}\n");
                }
            }
            Step::Kernel(k) => {
                let outs: Vec<String> = k
                    .kernel
                    .buffers
                    .iter()
                    .zip(&k.buffers)
                    .filter(|(b, _)| b.output)
                    .map(|(_, t)| t.to_string())
                    .collect();
                let sizes: Vec<String> = k.sizes.iter().map(|d| g.dim_str(d)).collect();
                s += &format!(
                    "  kernel {} -> {}  sizes [{}]\n",
                    k.kernel.op,
                    outs.join(", "),
                    sizes.join(", ")
                );
                for line in k.kernel.text().lines() {
                    s += &format!("    {line}\n");
                }
            }
        }
    }
    s
}

/// A dense tensor of the reference evaluator (i32 tensors hold whole floats).
#[derive(Clone, Debug)]
pub struct T {
    pub shape: Vec<usize>,
    pub data: Vec<f32>,
}

pub struct Rng(pub u64);

impl Rng {
    pub fn next(&mut self) -> u64 {
        self.0 = self
            .0
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        self.0 >> 33
    }
    pub fn uniform(&mut self) -> f32 {
        (self.next() % 1_000_000) as f32 / 1_000_000.0
    }
    pub fn normal_ish(&mut self) -> f32 {
        (self.uniform() + self.uniform() + self.uniform() - 1.5) * 1.4
    }
}

/// A launch's size arguments at `syms`: the dimensions, and the dropout
/// key's words bound at `place` as the executor binds them.
#[allow(dead_code)]
pub fn launch_sizes(
    g: &Graph,
    dims: &[Dim],
    keys: &[(usize, dplc_codegen::KeySize)],
    syms: &HashMap<String, i64>,
    place: &dplc_codegen::KeyPlace,
) -> Vec<i64> {
    let numel = |t: dplc_ir::TensorId| -> usize {
        g.tensor(t)
            .shape
            .dims()
            .iter()
            .map(|d| dim(d, syms, g))
            .product()
    };
    let mut sizes: Vec<i64> = dims.iter().map(|d| dim(d, syms, g) as i64).collect();
    place.bind_keys(&mut sizes, keys, numel);
    sizes
}

pub fn dim(d: &Dim, syms: &HashMap<String, i64>, g: &Graph) -> usize {
    let mut v = d.coeff();
    for s in d.syms() {
        v = v
            .checked_mul(dplc_ir::Ratio::int(syms[&g.sym_names()[s.index()]]))
            .unwrap();
    }
    v.as_int().expect("whole dimension") as usize
}

fn strides(shape: &[usize]) -> Vec<usize> {
    let mut s = vec![1; shape.len()];
    for i in (0..shape.len().saturating_sub(1)).rev() {
        s[i] = s[i + 1] * shape[i + 1];
    }
    s
}

fn unravel(mut flat: usize, shape: &[usize]) -> Vec<usize> {
    let mut idx = vec![0; shape.len()];
    for a in (0..shape.len()).rev() {
        idx[a] = flat % shape[a];
        flat /= shape[a];
    }
    idx
}

fn bcast_at(t: &T, idx: &[usize]) -> f32 {
    let off = idx.len() - t.shape.len();
    let st = strides(&t.shape);
    let mut at = 0;
    for k in 0..t.shape.len() {
        let i = if t.shape[k] == 1 { 0 } else { idx[k + off] };
        at += i * st[k];
    }
    t.data[at]
}

/// Evaluate region `r` of `g` unfused: random sources (parameters, inputs,
/// region arguments, outputs of matmul-free opaque ops), every other node by
/// the textbook definition. Matmuls are computed too.
pub fn evaluate(
    g: &Graph,
    r: RegionId,
    syms: &HashMap<String, i64>,
    seed: u64,
) -> HashMap<TensorId, T> {
    let mut rng = Rng(seed);
    let mut env: HashMap<TensorId, T> = HashMap::new();
    let shape_of = |t: TensorId| -> Vec<usize> {
        g.tensor(t)
            .shape
            .dims()
            .iter()
            .map(|d| dim(d, syms, g))
            .collect()
    };
    let random = |t: TensorId, rng: &mut Rng| -> T {
        let shape = shape_of(t);
        let n = shape.iter().product();
        let data = if g.tensor(t).dtype == DType::I32 {
            (0..n).map(|_| (rng.next() % 4) as f32).collect()
        } else {
            (0..n).map(|_| rng.normal_ish()).collect()
        };
        T { shape, data }
    };
    for &a in &g.region(r).args {
        env.insert(a, random(a, &mut rng));
    }
    for &n in &g.region(r).nodes {
        let node = g.node(n);
        let out_shape = shape_of(node.outputs[0]);
        let numel: usize = out_shape.iter().product();
        let x = |i: usize| env[&node.inputs[i]].clone();
        let elementwise = |f: &dyn Fn(&[usize]) -> f32| -> T {
            T {
                shape: out_shape.clone(),
                data: (0..numel).map(|i| f(&unravel(i, &out_shape))).collect(),
            }
        };
        let value = match &node.op {
            Op::Input(_)
            | Op::Param(_)
            | Op::TopK { .. }
            | Op::MoeDispatch { .. }
            | Op::MoeCombine
            | Op::Repeat { .. }
            | Op::Relayout { .. }
            | Op::VocabParallel(_) => {
                for &o in &node.outputs {
                    env.insert(o, random(o, &mut rng));
                }
                continue;
            }
            // Embedding tables are indexed by the random small integers above.
            Op::Constant(c) => T {
                shape: vec![],
                data: vec![*c as f32],
            },
            Op::Iota { .. } => elementwise(&|i| i[0] as f32),
            Op::Unary(u) => {
                let a = x(0);
                T {
                    shape: a.shape,
                    data: a.data.iter().map(|&v| dplc_codegen::unary(*u, v)).collect(),
                }
            }
            Op::Binary(b) => {
                let (a, c) = (x(0), x(1));
                elementwise(&|i| dplc_codegen::binary(*b, bcast_at(&a, i), bcast_at(&c, i)))
            }
            Op::Select => {
                let (c, a, b) = (x(0), x(1), x(2));
                elementwise(&|i| {
                    if bcast_at(&c, i) != 0.0 {
                        bcast_at(&a, i)
                    } else {
                        bcast_at(&b, i)
                    }
                })
            }
            Op::Cast(_) => x(0),
            Op::MatMul => {
                let (a, b) = (x(0), x(1));
                let k = a.shape[a.shape.len() - 1];
                elementwise(&|i| {
                    let r = i.len();
                    (0..k)
                        .map(|kk| {
                            let mut ia = i.to_vec();
                            ia[r - 1] = kk;
                            let mut ib = i.to_vec();
                            ib[r - 2] = kk;
                            bcast_at(&a, &ia) * bcast_at(&b, &ib)
                        })
                        .sum()
                })
            }
            Op::Transpose { perm } => {
                let a = x(0);
                let st = strides(&a.shape);
                elementwise(&|i| {
                    let mut at = 0;
                    for (o, &p) in perm.iter().enumerate() {
                        at += i[o] * st[p];
                    }
                    a.data[at]
                })
            }
            Op::Reshape { .. } => T {
                shape: out_shape.clone(),
                data: x(0).data,
            },
            Op::Expand { .. } => {
                let a = x(0);
                elementwise(&|i| bcast_at(&a, i))
            }
            Op::Slice { axis, start, .. } => {
                let a = x(0);
                let st = strides(&a.shape);
                elementwise(&|i| {
                    let mut at = 0;
                    for k in 0..i.len() {
                        at += (i[k] + if k == *axis { *start as usize } else { 0 }) * st[k];
                    }
                    a.data[at]
                })
            }
            Op::Pad {
                axis,
                before,
                value,
                ..
            } => {
                let a = x(0);
                let st = strides(&a.shape);
                elementwise(&|i| {
                    let from = i[*axis] as i64 - before;
                    if from < 0 || from >= a.shape[*axis] as i64 {
                        return *value as f32;
                    }
                    let mut j = i.to_vec();
                    j[*axis] = from as usize;
                    a.data[j.iter().zip(&st).map(|(a, b)| a * b).sum::<usize>()]
                })
            }
            Op::Concat { axis } => {
                let parts: Vec<T> = (0..node.inputs.len()).map(x).collect();
                elementwise(&|i| {
                    let mut k = i[*axis];
                    for p in &parts {
                        if k < p.shape[*axis] {
                            let mut j = i.to_vec();
                            j[*axis] = k;
                            let st = strides(&p.shape);
                            return p.data[j.iter().zip(&st).map(|(a, b)| a * b).sum::<usize>()];
                        }
                        k -= p.shape[*axis];
                    }
                    unreachable!()
                })
            }
            Op::Reduce { kind, axis, .. } => {
                let a = x(0);
                let st = strides(&a.shape);
                let len = a.shape[*axis];
                let keep = out_shape.len() == a.shape.len();
                elementwise(&|i| {
                    let mut base = i.to_vec();
                    if !keep {
                        base.insert(*axis, 0);
                    }
                    base[*axis] = 0;
                    let at0: usize = base.iter().zip(&st).map(|(a, b)| a * b).sum();
                    let vals = (0..len).map(|c| a.data[at0 + c * st[*axis]]);
                    match kind {
                        ReduceKind::Sum => vals.sum(),
                        ReduceKind::Mean => vals.sum::<f32>() / len as f32,
                        ReduceKind::Max => vals.fold(f32::NEG_INFINITY, f32::max),
                    }
                })
            }
            Op::Softmax { axis } | Op::LogSoftmax { axis } => {
                let a = x(0);
                let st = strides(&a.shape);
                let len = a.shape[*axis];
                let log = matches!(node.op, Op::LogSoftmax { .. });
                elementwise(&|i| {
                    let mut base = i.to_vec();
                    base[*axis] = 0;
                    let at0: usize = base.iter().zip(&st).map(|(a, b)| a * b).sum();
                    let row: Vec<f32> = (0..len).map(|c| a.data[at0 + c * st[*axis]]).collect();
                    let m = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                    let s: f32 = row.iter().map(|v| (v - m).exp()).sum();
                    let v = row[i[*axis]];
                    if log {
                        v - m - s.ln()
                    } else {
                        (v - m).exp() / s
                    }
                })
            }
            Op::CumSum { axis, reverse } => {
                let a = x(0);
                let st = strides(&a.shape);
                let len = a.shape[*axis];
                elementwise(&|i| {
                    let mut base = i.to_vec();
                    base[*axis] = 0;
                    let at0: usize = base.iter().zip(&st).map(|(a, b)| a * b).sum();
                    let at = |c: usize| a.data[at0 + c * st[*axis]];
                    let k = i[*axis];
                    let mut acc = 0.0f32;
                    if *reverse {
                        (k..len).rev().for_each(|c| acc += at(c));
                    } else {
                        (0..=k).for_each(|c| acc += at(c));
                    }
                    acc
                })
            }
            Op::LayerNorm { eps } | Op::RmsNorm { eps } => {
                let a = x(0);
                let w = x(1);
                let b = (node.inputs.len() == 3).then(|| x(2));
                let c = *a.shape.last().unwrap();
                elementwise(&|i| {
                    let r = i.len();
                    let row0 = i
                        .iter()
                        .zip(strides(&a.shape))
                        .map(|(x, s)| x * s)
                        .sum::<usize>()
                        - i[r - 1];
                    let row = &a.data[row0..row0 + c];
                    let v = row[i[r - 1]];
                    match &b {
                        Some(bias) => {
                            let mean = row.iter().sum::<f32>() / c as f32;
                            let var =
                                row.iter().map(|x| (x - mean) * (x - mean)).sum::<f32>() / c as f32;
                            (v - mean) / (var + *eps as f32).sqrt() * w.data[i[r - 1]]
                                + bias.data[i[r - 1]]
                        }
                        None => {
                            let ms = row.iter().map(|x| x * x).sum::<f32>() / c as f32;
                            v / (ms + *eps as f32).sqrt() * w.data[i[r - 1]]
                        }
                    }
                })
            }
            Op::Dropout { p, .. } => {
                assert_eq!(*p, 0.0, "the reference runs without dropout");
                x(0)
            }
            Op::CausalMask => {
                let a = x(0);
                elementwise(&|i| {
                    let r = i.len();
                    if i[r - 1] > i[r - 2] {
                        f32::NEG_INFINITY
                    } else {
                        bcast_at(&a, i)
                    }
                })
            }
            Op::Embedding => {
                let (table, idx) = (x(0), x(1));
                let d = table.shape[1];
                elementwise(&|i| {
                    let r = i.len();
                    let row = bcast_at(&idx, &i[..r - 1]) as usize;
                    table.data[row * d + i[r - 1]]
                })
            }
            Op::TakeAlong => {
                let (a, idx) = (x(0), x(1));
                elementwise(&|i| {
                    let mut j = i.to_vec();
                    j.push(bcast_at(&idx, i) as usize);
                    bcast_at(&a, &j)
                })
            }
        };
        env.insert(node.outputs[0], value);
    }
    env
}

/// The kernel buffer contents for tensor `t`.
pub fn data_of(g: &Graph, t: TensorId, v: &T) -> Data {
    if g.tensor(t).dtype == DType::I32 {
        Data::I32(v.data.iter().map(|&x| x as i32).collect())
    } else {
        Data::F32(v.data.clone())
    }
}

/// A bare causal attention with dropout 0.1 on its probabilities, its
/// values 16 wide (the sequence's length here): with zero scores and each
/// value one-hot at its own position, the output is the dropped
/// probabilities `P ∘ mask` themselves.
pub const PLACED: &str = "model m(heads = 4) {\n  input q: f32[batch, heads, seq, 8]\n  \
    input k: f32[batch, heads, seq, 8]\n  input v: f32[batch, heads, seq, 16]\n  \
    a = dropout(softmax(causal_mask(q @ transpose(k, 2, 3) * 0.35), -1), 0.1) @ v\n  \
    return mean(mean(mean(mean(a, -1), -1), -1), -1)\n}\n";

/// [`PLACED`] with a sliding window of 5 as the standard `attention` block
/// writes it (keys 5 or more positions behind a query weigh nothing): under
/// cp 2 at 16 positions the window crosses the rank's two chunks of 4.
pub const PLACED_WINDOWED: &str = "model m(heads = 4) {\n  input q: f32[batch, heads, seq, 8]\n  \
    input k: f32[batch, heads, seq, 8]\n  input v: f32[batch, heads, seq, 16]\n  \
    t = cast(positions(dim(q, 2)), f32)\n  \
    behind = reshape(t, [dim(q, 2), 1]) - reshape(t, [1, dim(q, 2)])\n  \
    s = q @ transpose(k, 2, 3) * 0.35 - ge(behind, 5) * 1.0e30\n  \
    a = dropout(softmax(causal_mask(s), -1), 0.1) @ v\n  \
    return mean(mean(mean(mean(a, -1), -1), -1), -1)\n}\n";

/// Megatron's layout of the bare attention over `tp`: the inputs whole,
/// sliced to the rank's heads where the score matmul reads them, every
/// `[batch, heads, ·, ·]` value split along its heads, gathered again for
/// the loss.
pub fn heads_layout(g: &Graph, tp: u64) -> dplc_ir::ModelLayout {
    use dplc_ir::TensorLayout::{Replicated, Split};
    let root = g.root();
    let reg = g.region(root);
    let split = |n: &dplc_ir::Node| {
        !matches!(n.op, Op::Input(_)) && g.tensor(n.outputs[0]).shape.rank() == 4
    };
    let nodes = reg
        .nodes
        .iter()
        .map(|&id| {
            let n = g.node(id);
            let layout = |t: dplc_ir::TensorId| {
                if split(n) && g.tensor(t).shape.rank() == 4 {
                    Split { axis: 1 }
                } else {
                    Replicated
                }
            };
            dplc_ir::NodeLayout {
                node: id,
                inputs: n.inputs.iter().map(|&t| layout(t)).collect(),
                outputs: n.outputs.iter().map(|&t| layout(t)).collect(),
            }
        })
        .collect();
    dplc_ir::ModelLayout {
        tp,
        ep: 1,
        sequence_parallel: false,
        regions: vec![dplc_ir::RegionLayout {
            region: root,
            args: vec![Replicated; reg.args.len()],
            nodes,
            results: vec![Replicated; reg.results.len()],
        }],
        params: vec![],
    }
}

/// A rank's program of `model` ([`PLACED`], [`PLACED_WINDOWED`]), as the
/// runtime makes it: the model split over a context group of `cp`
/// (`split_context`), then localized to its heads over `tp`.
pub fn placed_attention(model: &str, tp: u64, cp: u64) -> Graph {
    let whole = lower_m(model);
    let mut g = whole.clone();
    if cp > 1 {
        g = dplc_ir::split_context(&whole, cp).unwrap();
    }
    if tp > 1 {
        let mut layout = heads_layout(&whole, tp);
        if cp > 1 {
            layout = dplc_ir::context_layout(&g, &layout).unwrap();
        }
        g = dplc_ir::localize(&g, &layout).unwrap();
    }
    g
}
