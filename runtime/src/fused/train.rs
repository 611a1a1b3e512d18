//! Data-parallel training on the fused executor: parameters, `f32` master
//! weights, gradients and AdamW moments live on the backend; each step runs
//! its micro-batches forward and backward, sums gradients over the replicas,
//! takes the global norm with a kernel, clips inside the AdamW kernel, and
//! writes the storage copy of each weight back from its master.
//!
//! The numbers match the CPU executor's serial run (same initial values, data
//! order, loss scaling, learning-rate schedule and clipping rule): the
//! equivalence tests check it on [`HostBackend`](super::HostBackend).

use super::backend::Backend;
use super::program::{flat_args, Executor, FusedGraph, ParamBufs, Val};
use crate::comm::{Communicator, Group};
use crate::data::Corpus;
use crate::error::{kernel_err, Result, RuntimeError};
use crate::interp::ParamKey;
use crate::params::init_value;
use crate::schedule::{Parameters, StepStats};
use crate::tensor::Tensor;
use dplc_codegen::{
    adamw_kernel, add_kernel, column_sum_kernel, convert_kernel, sgd_kernel, sum_squares_kernel,
    AdamwScalars, Elem, Kernel, SgdScalars, SUM_SQUARES_COLS,
};
use dplc_ir::{DType, Graph, Op, Optimizer, TrainSpec};
use std::collections::{BTreeMap, HashMap};
use std::time::Instant;

/// The kernels of a training step besides the model's own.
pub fn step_kernels() -> Vec<Kernel> {
    vec![
        adamw_kernel(),
        sgd_kernel(),
        column_sum_kernel(),
        add_kernel(Elem::F32, Elem::F32, Elem::Float),
        add_kernel(Elem::F32, Elem::F32, Elem::F32),
        add_kernel(Elem::Float, Elem::Float, Elem::Float),
        add_kernel(Elem::Float, Elem::Float, Elem::F32),
        convert_kernel(Elem::Float, Elem::F32),
        convert_kernel(Elem::F32, Elem::Float),
        sum_squares_kernel(Elem::F32),
    ]
}

/// How gradients and the loss are summed over data-parallel replicas.
pub trait GradSync<B: Backend> {
    /// `v` (f32) summed over the replicas; may reuse `v`'s buffer.
    fn all_reduce(&mut self, be: &mut B, v: Val<B>) -> Result<Val<B>>;
    /// `v` (f32, its buffer `shard × replicas` elements, zero-padded) summed
    /// over the replicas; this replica keeps its `shard` elements, in replica
    /// order (ZeRO: each replica updates its part of every parameter).
    fn reduce_scatter(&mut self, be: &mut B, v: &Val<B>, shard: usize) -> Result<Val<B>>;
    /// Every replica's f32 `shard`, in replica order.
    fn all_gather(&mut self, be: &mut B, shard: &Val<B>) -> Result<Val<B>>;
    /// Host values summed over the replicas.
    fn all_reduce_host(&mut self, v: &mut [f32]) -> Result<()>;
}

/// One replica: nothing to sum.
pub struct Alone;

impl<B: Backend> GradSync<B> for Alone {
    fn all_reduce(&mut self, _be: &mut B, v: Val<B>) -> Result<Val<B>> {
        Ok(v)
    }
    fn reduce_scatter(&mut self, _be: &mut B, v: &Val<B>, shard: usize) -> Result<Val<B>> {
        Ok(Val {
            len: shard,
            ..v.clone()
        })
    }
    fn all_gather(&mut self, _be: &mut B, shard: &Val<B>) -> Result<Val<B>> {
        Ok(shard.clone())
    }
    fn all_reduce_host(&mut self, _v: &mut [f32]) -> Result<()> {
        Ok(())
    }
}

/// Replicas as in-process ranks: values go through the host and the CPU
/// communicator (its deterministic in-order sum).
pub struct HostStaged {
    pub comm: Communicator,
    pub group: Group,
}

impl<B: Backend> GradSync<B> for HostStaged {
    fn all_reduce(&mut self, be: &mut B, v: Val<B>) -> Result<Val<B>> {
        let mut host = be.download(&v.buf, v.elem, v.len)?;
        self.comm.all_reduce(&self.group, &mut host)?;
        Ok(Val {
            buf: be.upload(v.elem, &host)?,
            elem: v.elem,
            len: v.len,
        })
    }
    fn reduce_scatter(&mut self, be: &mut B, v: &Val<B>, shard: usize) -> Result<Val<B>> {
        let n = self.group.size();
        let host = be.download(&v.buf, v.elem, shard * n)?;
        let ranges: Vec<_> = (0..n).map(|i| i * shard..(i + 1) * shard).collect();
        let mine = self.comm.reduce_scatter(&self.group, &host, &ranges)?;
        Ok(Val {
            buf: be.upload(Elem::F32, &mine)?,
            elem: Elem::F32,
            len: shard,
        })
    }
    fn all_gather(&mut self, be: &mut B, shard: &Val<B>) -> Result<Val<B>> {
        let host = be.download(&shard.buf, shard.elem, shard.len)?;
        let all: Vec<f32> = self.comm.all_gather(&self.group, &host)?.concat();
        Ok(Val {
            buf: be.upload(Elem::F32, &all)?,
            elem: Elem::F32,
            len: all.len(),
        })
    }
    fn all_reduce_host(&mut self, v: &mut [f32]) -> Result<()> {
        self.comm.all_reduce(&self.group, v)
    }
}

/// One replica's share of a run.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FusedRun {
    /// Samples per micro-batch.
    pub micro_batch: usize,
    /// Micro-batches per step on this replica.
    pub num_micro_batches: usize,
    /// Data-parallel replicas and this one's index.
    pub dp: usize,
    pub dp_index: usize,
    pub steps: u64,
    pub seed: u64,
    /// Full recomputation of each `repeat` layer (see [`Executor::recompute`]).
    pub recompute: bool,
    /// ZeRO-1: each replica keeps the f32 master and moments of its
    /// `1/dp` part of every parameter; gradients are reduce-scattered, the
    /// parts updated, and the new values all-gathered.
    pub shard_optimizer: bool,
}

/// What a fused run did.
#[derive(Debug)]
pub struct FusedReport {
    pub steps: Vec<StepStats>,
    /// Final parameter values (the `f32` masters).
    pub params: Parameters,
    /// The backend's peak of live buffer bytes, when it tracks it.
    pub peak_bytes: Option<usize>,
}

/// Every (parameter, layer) of the graph with its shape.
fn param_keys(graph: &Graph) -> Result<Vec<(ParamKey, Vec<usize>)>> {
    let root = graph.root();
    let mut layers: HashMap<dplc_ir::RegionId, u64> = HashMap::new();
    layers.insert(root, 1);
    for &n in &graph.region(root).nodes {
        if let Op::Repeat { count, body, .. } = graph.node(n).op {
            if graph
                .region(body)
                .nodes
                .iter()
                .any(|&m| matches!(graph.node(m).op, Op::Repeat { .. }))
            {
                return Err(RuntimeError::Unsupported(
                    "the fused executor runs one level of `repeat`".into(),
                ));
            }
            layers.insert(body, count);
        }
    }
    let mut keys = Vec::new();
    for (p, info) in graph.params() {
        let region = graph.tensor_region(info.tensor);
        let count = *layers.get(&region).ok_or_else(|| {
            RuntimeError::Unsupported(format!("parameter {} sits in a nested region", info.name))
        })?;
        let shape = info
            .shape
            .dims()
            .iter()
            .map(|d| {
                d.as_const().map(|v| v as usize).ok_or_else(|| {
                    RuntimeError::Unsupported(format!(
                        "parameter {} has a symbolic shape",
                        info.name
                    ))
                })
            })
            .collect::<Result<Vec<_>>>()?;
        for layer in 0..count {
            keys.push((ParamKey { param: p, layer }, shape.clone()));
        }
    }
    Ok(keys)
}

/// A parameter on the device: the copy kernels read, its `f32` master and
/// moments (this replica's `shard` elements of them under ZeRO-1).
struct Held<B: Backend> {
    shape: Vec<usize>,
    value: Val<B>,
    master: Val<B>,
    m: Val<B>,
    v: Val<B>,
    decay: bool,
    /// Elements of the master and moments held here: all of them, or under
    /// ZeRO-1 `ceil(n / dp)` (the last replica's part zero-padded).
    shard: usize,
}

/// A zeroed f32 gradient of `n` elements in a buffer of `padded >= n`.
fn zero_grad<B: Backend>(be: &mut B, n: usize, padded: usize) -> Result<Val<B>> {
    Ok(Val {
        buf: be.zeros(Elem::F32, padded)?,
        elem: Elem::F32,
        len: n,
    })
}

/// Train `graph` for `run.steps` steps on `be`, one data-parallel replica of
/// `run.dp`, summing over the others through `sync`.
#[allow(clippy::too_many_arguments)]
pub fn train_fused<B: Backend>(
    be: &mut B,
    graph: &Graph,
    spec: &TrainSpec,
    data: &Corpus,
    run: &FusedRun,
    sync: &mut dyn GradSync<B>,
    mut on_step: impl FnMut(&StepStats),
) -> Result<FusedReport> {
    if run.micro_batch == 0 || run.num_micro_batches == 0 || run.dp == 0 {
        return Err(RuntimeError::Config(
            "micro_batch, num_micro_batches and dp must be positive".into(),
        ));
    }
    let seq = spec.seq as usize;
    let mut syms = Vec::new();
    for name in graph.sym_names() {
        syms.push(match name.as_str() {
            "batch" => run.micro_batch as i64,
            "seq" => seq as i64,
            other => {
                return Err(RuntimeError::Unsupported(format!(
                    "the symbolic dimension `{other}` has no value"
                )))
            }
        });
    }
    let loss_t = *graph
        .outputs()
        .first()
        .ok_or_else(|| RuntimeError::Config("the model returns nothing".into()))?;
    let recompute = if run.recompute {
        dplc_ir::Recompute::Full
    } else {
        dplc_ir::Recompute::None
    };
    let fused = FusedGraph::for_run(graph, recompute, &[])?;
    if let Some(op) = fused.host_step_op(graph) {
        return Err(RuntimeError::Unsupported(format!(
            "`{op}` runs on the host between kernels, which this data-parallel loop does not \
             do; the schedule executor does (CPU ranks: --compute fused)"
        )));
    }

    // Parameters: the CPU executor's initial values, uploaded.
    let mut held: BTreeMap<ParamKey, Held<B>> = BTreeMap::new();
    let mut pbufs = ParamBufs {
        values: BTreeMap::new(),
        grads: BTreeMap::new(),
    };
    let float_is_f32 = be.dtype() == DType::F32;
    let sharded = run.shard_optimizer && run.dp > 1;
    // Gradients are padded to whole parts for the reduce-scatter.
    let parts = if sharded { run.dp } else { 1 };
    for (key, shape) in param_keys(graph)? {
        let n: usize = shape.iter().product();
        let init = init_value(graph.param(key.param).init, run.seed, key, n);
        let shard = if sharded { n.div_ceil(run.dp) } else { n };
        let master = if sharded {
            let start = (run.dp_index * shard).min(n);
            let mut part = init[start..(start + shard).min(n)].to_vec();
            part.resize(shard, 0.0);
            Val {
                buf: be.upload(Elem::F32, &part)?,
                elem: Elem::F32,
                len: shard,
            }
        } else {
            Val {
                buf: be.upload(Elem::F32, &init)?,
                elem: Elem::F32,
                len: n,
            }
        };
        let value = if float_is_f32 && !sharded {
            master.clone()
        } else {
            Val {
                buf: be.upload(Elem::Float, &init)?,
                elem: Elem::Float,
                len: n,
            }
        };
        let zeros = |be: &mut B, len: usize| -> Result<Val<B>> {
            Ok(Val {
                buf: be.zeros(Elem::F32, len)?,
                elem: Elem::F32,
                len,
            })
        };
        let (m, v) = (zeros(be, shard)?, zeros(be, shard)?);
        let g = zero_grad(be, n, shard * parts)?;
        pbufs.values.insert(key, value.clone());
        pbufs.grads.insert(key, g);
        held.insert(
            key,
            Held {
                decay: shape.len() >= 2,
                shape,
                value,
                master,
                m,
                v,
                shard,
            },
        );
    }

    // The step's own kernels, built once rather than per parameter and step.
    let (adamw, sgd) = (adamw_kernel(), sgd_kernel());
    let sum_squares = sum_squares_kernel(Elem::F32);
    let to_storage = convert_kernel(Elem::Float, Elem::F32);
    let global_batch = run.dp * run.micro_batch * run.num_micro_batches;
    let scale = 1.0 / (run.dp * run.num_micro_batches) as f32;
    let mut stats = Vec::new();
    for step in 0..run.steps {
        let started = Instant::now();
        let mut loss_sum = 0.0f64;
        for micro in 0..run.num_micro_batches {
            let first = step * global_batch as u64
                + ((micro * run.dp + run.dp_index) * run.micro_batch) as u64;
            let (mut xs, mut ys) = (Vec::new(), Vec::new());
            for i in 0..run.micro_batch as u64 {
                let (x, y) = data.sample(first + i, seq);
                xs.extend(x);
                ys.extend(y);
            }
            let mut inputs = HashMap::new();
            for (_, input) in graph.inputs() {
                let v = match input.name.as_str() {
                    "tokens" => &xs,
                    "targets" => &ys,
                    other => {
                        return Err(RuntimeError::Unsupported(format!(
                            "input `{other}`: the data loader feeds `tokens` and `targets` only"
                        )))
                    }
                };
                let buf = be.upload_i32(v)?;
                inputs.insert(
                    input.tensor,
                    Val {
                        buf,
                        elem: Elem::I32,
                        len: v.len(),
                    },
                );
            }
            let exec = Executor {
                graph,
                fused: &fused,
                syms: syms.clone(),
                seed: crate::rng::hash(&[run.seed, step]),
                first_sample: first,
                micro_batch: run.micro_batch,
                host: None,
            };
            let root = graph.root();
            let mut fwd = exec.forward(be, root, Vec::new(), &inputs, 0, &pbufs)?;
            let loss = exec.read(be, &fwd, loss_t)?;
            loss_sum += f64::from(*loss.first().ok_or_else(|| kernel_err("fused", "no loss"))?);
            let seed = Val {
                buf: be.upload(Elem::Float, &[scale])?,
                elem: Elem::Float,
                len: 1,
            };
            let mut grads = HashMap::from([(loss_t, seed)]);
            exec.backward(be, root, &mut fwd, &mut grads, 0, &mut pbufs)?;
        }

        // Sum over replicas (or reduce-scatter the parts under ZeRO-1), then
        // the global norm from per-row partial sums.
        let mut sq = 0.0f64;
        let mut parts_of: BTreeMap<ParamKey, Val<B>> = BTreeMap::new();
        let keys: Vec<ParamKey> = pbufs.grads.keys().copied().collect();
        for key in keys {
            // Handed over by value: an in-place device sum needs the only handle.
            let g = pbufs
                .grads
                .remove(&key)
                .ok_or_else(|| kernel_err("fused", "a lost gradient"))?;
            let (g, summed) = if sharded {
                let shard = held.get(&key).map_or(g.len, |h| h.shard);
                let part = sync.reduce_scatter(be, &g, shard)?;
                (g, part)
            } else {
                let g = sync.all_reduce(be, g)?;
                (g.clone(), g)
            };
            let rows = (summed.len.div_ceil(SUM_SQUARES_COLS as usize)).max(1) as i64;
            let partial = be.alloc(Elem::F32, rows as usize)?;
            be.launch(
                &sum_squares,
                &dplc_codegen::Args {
                    sizes: vec![rows, SUM_SQUARES_COLS, summed.len as i64],
                    ..Default::default()
                },
                &[partial.clone(), summed.buf.clone()],
            )?;
            let parts = be.download(&partial, Elem::F32, rows as usize)?;
            sq += parts.iter().map(|&x| f64::from(x)).sum::<f64>();
            pbufs.grads.insert(key, g);
            parts_of.insert(key, summed);
        }
        if sharded {
            // Each replica summed the squares of its parts only.
            let mut total = [sq as f32];
            sync.all_reduce_host(&mut total)?;
            sq = f64::from(total[0]);
        }
        let grad_norm = sq.sqrt();
        let clip = match spec.grad_clip {
            Some(max) if grad_norm > max => max / (grad_norm + 1e-6),
            _ => 1.0,
        };
        let lr = spec.optimizer.lr() * spec.schedule.factor(step);
        for (key, h) in held.iter_mut() {
            let g = parts_of
                .remove(key)
                .ok_or_else(|| kernel_err("fused", "a parameter without a gradient buffer"))?;
            let (kernel, args, bufs) = match spec.optimizer {
                Optimizer::AdamW {
                    beta1,
                    beta2,
                    eps,
                    weight_decay,
                    ..
                } => {
                    let scalars = AdamwScalars {
                        lr: lr as f32,
                        beta1: beta1 as f32,
                        beta2: beta2 as f32,
                        eps: eps as f32,
                        weight_decay: if h.decay { weight_decay as f32 } else { 0.0 },
                        step: step + 1,
                        grad_scale: clip as f32,
                    };
                    (
                        &adamw,
                        scalars.args(h.master.len as i64),
                        vec![
                            h.master.buf.clone(),
                            h.m.buf.clone(),
                            h.v.buf.clone(),
                            h.master.buf.clone(),
                            g.buf.clone(),
                            h.m.buf.clone(),
                            h.v.buf.clone(),
                        ],
                    )
                }
                Optimizer::Sgd { momentum, .. } => {
                    let scalars = SgdScalars {
                        lr: lr as f32,
                        momentum: momentum as f32,
                        grad_scale: clip as f32,
                    };
                    (
                        &sgd,
                        scalars.args(h.master.len as i64),
                        vec![
                            h.master.buf.clone(),
                            h.m.buf.clone(),
                            h.master.buf.clone(),
                            g.buf.clone(),
                            h.m.buf.clone(),
                        ],
                    )
                }
            };
            be.launch(kernel, &args, &bufs)?;
            if sharded {
                // Every replica's updated part, then the storage copy of the whole.
                let whole = sync.all_gather(be, &h.master)?;
                be.launch(
                    &to_storage,
                    &flat_args(h.value.len),
                    &[h.value.buf.clone(), whole.buf],
                )?;
            } else if !float_is_f32 {
                be.launch(
                    &to_storage,
                    &flat_args(h.master.len),
                    &[h.value.buf.clone(), h.master.buf.clone()],
                )?;
            }
            // Zero the gradient for the next step.
            let n = h.shape.iter().product();
            pbufs.grads.insert(*key, zero_grad(be, n, h.shard * parts)?);
        }
        let mut loss = [loss_sum as f32];
        sync.all_reduce_host(&mut loss)?;
        be.synchronize()?;
        let s = StepStats {
            step,
            loss: f64::from(loss[0]) / (run.dp * run.num_micro_batches) as f64,
            lr,
            grad_norm,
            tokens_per_s: (global_batch * seq) as f64 / started.elapsed().as_secs_f64().max(1e-9),
        };
        on_step(&s);
        stats.push(s);
    }

    let mut params = Parameters::default();
    for (key, h) in &held {
        let n: usize = h.shape.iter().product();
        let master = if sharded {
            sync.all_gather(be, &h.master)?
        } else {
            h.master.clone()
        };
        let values = be.download(&master.buf, Elem::F32, n)?;
        params.values.insert(
            *key,
            (
                graph.param(key.param).name.clone(),
                Tensor::f32(h.shape.clone(), values),
            ),
        );
    }
    Ok(FusedReport {
        steps: stats,
        params,
        peak_bytes: be.peak_bytes(),
    })
}
