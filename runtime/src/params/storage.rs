//! Where a rank's training state lives and how its vectors move: the seam
//! between the parameter store's logic (ZeRO layouts, gradient sync, the
//! optimizer, checkpoints) and the memory it runs in.
//!
//! [`HostStorage`] keeps every vector in host memory and sums over the CPU
//! communicator: the reference compute's store. `super::device::DeviceStorage`
//! keeps them in a compute backend's buffers, so that the fused compute reads
//! parameters and adds gradients where its kernels run, the optimizer runs
//! as a kernel there, and the collectives go through its links (NCCL, or
//! staged through the host). The store decides what to move and when; a
//! storage only says how.

use crate::comm::{Communicator, Group, Message};
use crate::error::{kernel_err, Result};
use crate::interp::Value;
use crate::tensor::Tensor;
use dplc_codegen::{AdamwScalars, SgdScalars};
use std::borrow::Cow;
use std::ops::Range;
use std::sync::Arc;

/// One optimizer update, as the store asks it of a storage: the kernels'
/// scalar arguments, so that every storage takes the same `f32` step.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) enum Update {
    AdamW(AdamwScalars),
    Sgd(SgdScalars),
}

/// The vectors one update reads and writes: `master`, `m` and `v` in place,
/// from `grad[at..at + master.len()]`.
pub(crate) struct Moments<'a, V> {
    pub master: &'a mut V,
    pub m: &'a mut V,
    pub v: &'a mut V,
    pub grad: &'a V,
    pub at: usize,
}

/// One vector of a collective and the ranges of it each member owns (one
/// per member, in group order; empty for a member that owns none).
pub(crate) type Pieces<'a, V> = (&'a V, &'a [Range<usize>]);

/// How a rank's training state is held. Every method that sums does so in
/// the group's order, so that every storage gives the serial run's sums.
pub(crate) trait Storage {
    /// A flat `f32` vector of state (master values, moments, gradients).
    type Buf: Default;
    /// A parameter's whole value as the compute reads it.
    type Value: Clone;
    /// What crosses a pipeline cut: the values one chunk hands the next,
    /// held where the compute holds them (`None` where nothing flows);
    /// the first chunk's is empty.
    type Msg: Default;

    fn len(v: &Self::Buf) -> usize;
    fn stage_in(&mut self, data: Vec<f32>) -> Result<Self::Buf>;
    fn stage_out(&mut self, v: Self::Buf) -> Result<Vec<f32>>;
    /// Elements `at` of `v`, borrowed where they already are on the host.
    fn read<'a>(&mut self, v: &'a Self::Buf, at: Range<usize>) -> Result<Cow<'a, [f32]>>;
    /// Overwrite `v[at..at + data.len()]`.
    fn write(&mut self, v: &mut Self::Buf, at: usize, data: &[f32]) -> Result<()>;
    fn zeros(&mut self, len: usize) -> Result<Self::Buf>;
    /// `acc += x`, element by element (same lengths).
    fn add(&mut self, acc: &mut Self::Buf, x: &Self::Buf) -> Result<()>;
    /// Σ x² over every part `v[at]`: each part summed in `f64`, the parts
    /// added in order (one wait for all of them on a device).
    fn sq_norm(&mut self, parts: &[(&Self::Buf, Range<usize>)]) -> Result<f64>;
    fn update(&mut self, rule: Update, st: Moments<'_, Self::Buf>) -> Result<()>;
    /// The compute's copy of a whole master vector of shape `shape`.
    fn value(&mut self, shape: &[usize], master: &Self::Buf) -> Result<Self::Value>;
    /// [`Storage::update`] of a whole master vector, then its [`Storage::value`]:
    /// one pass where the storage can make both at once.
    fn update_value(
        &mut self,
        rule: Update,
        st: Moments<'_, Self::Buf>,
        shape: &[usize],
    ) -> Result<Self::Value> {
        update_then_value(self, rule, st, shape)
    }
    fn value_from_host(&mut self, shape: &[usize], data: Vec<f32>) -> Result<Self::Value>;
    fn value_to_host(&mut self, v: &Self::Value) -> Result<Vec<f32>>;
    /// A copy of `v` that later optimizer steps leave as it is: a weight
    /// version async workers read (a value may share its master's memory).
    fn keep(&mut self, v: &Self::Value) -> Result<Self::Value>;
    /// Bytes at the device's high-water mark, where the storage has a device.
    fn peak_bytes(&self) -> Option<u64> {
        None
    }
    /// Copies between the host and the device so far, where the storage has
    /// a device that counts them (the compute's on it included).
    fn host_crossings(&self) -> Option<u64> {
        None
    }

    /// Send `msg` to rank `to` under `tag` (a pipeline hop; never waits
    /// for the receiver).
    fn send(&mut self, comm: &mut Communicator, to: usize, tag: u64, msg: Self::Msg) -> Result<()>;
    /// What rank `from` sent under `tag`, waiting for it.
    fn recv(&mut self, comm: &mut Communicator, from: usize, tag: u64) -> Result<Self::Msg>;

    /// Sum the concatenation of `vs` over `group`, in place (one message).
    fn all_reduce(
        &mut self,
        comm: &mut Communicator,
        group: &Group,
        vs: &mut [&mut Self::Buf],
    ) -> Result<()>;
    /// Sum each vector over `group`; this member keeps its range of each.
    fn reduce_scatter(
        &mut self,
        comm: &mut Communicator,
        group: &Group,
        vs: &[Pieces<'_, Self::Buf>],
    ) -> Result<Vec<Self::Buf>>;
    /// Each vector whole again from every member's range of it; `vs[i].0`
    /// is this member's range of vector `i`.
    fn all_gather(
        &mut self,
        comm: &mut Communicator,
        group: &Group,
        vs: &[Pieces<'_, Self::Buf>],
    ) -> Result<Vec<Self::Buf>>;
}

/// [`Storage::update_value`] as two passes: the update, then the value.
pub(crate) fn update_then_value<S: Storage + ?Sized>(
    storage: &mut S,
    rule: Update,
    st: Moments<'_, S::Buf>,
    shape: &[usize],
) -> Result<S::Value> {
    let Moments {
        master,
        m,
        v,
        grad,
        at,
    } = st;
    storage.update(
        rule,
        Moments {
            master: &mut *master,
            m,
            v,
            grad,
            at,
        },
    )?;
    storage.value(shape, master)
}

/// Training state in host memory, summed by the CPU communicator.
#[derive(Default)]
pub(crate) struct HostStorage;

/// [`Storage::all_reduce`] on host vectors: one message for all of `vs`.
pub(crate) fn all_reduce_host(
    comm: &mut Communicator,
    group: &Group,
    vs: &mut [&mut Vec<f32>],
) -> Result<()> {
    if let [one] = vs {
        return comm.all_reduce(group, one);
    }
    let mut flat: Vec<f32> = Vec::with_capacity(vs.iter().map(|v| v.len()).sum());
    for v in vs.iter() {
        flat.extend_from_slice(v);
    }
    comm.all_reduce(group, &mut flat)?;
    let mut at = 0;
    for v in vs.iter_mut() {
        let n = v.len();
        v.copy_from_slice(&flat[at..at + n]);
        at += n;
    }
    Ok(())
}

/// [`Storage::reduce_scatter`] on host vectors: one message, every
/// member's ranges of every vector in member order, then vector order.
pub(crate) fn reduce_scatter_host(
    comm: &mut Communicator,
    group: &Group,
    vs: &[Pieces<'_, Vec<f32>>],
) -> Result<Vec<Vec<f32>>> {
    let members = group.size();
    let mut flat = Vec::new();
    let mut ranges = Vec::with_capacity(members);
    for p in 0..members {
        let start = flat.len();
        for (v, shards) in vs {
            flat.extend_from_slice(&v[shards.get(p).cloned().unwrap_or(0..0)]);
        }
        ranges.push(start..flat.len());
    }
    let mine = comm.reduce_scatter(group, &flat, &ranges)?;
    let pos = group.position(comm.rank()).unwrap_or(0);
    let mut rest = mine.into_iter();
    Ok(vs
        .iter()
        .map(|(_, shards)| {
            let n = shards.get(pos).map_or(0, |r| r.len());
            rest.by_ref().take(n).collect()
        })
        .collect())
}

/// [`Storage::all_gather`] on host vectors: one message, this member's
/// range of every vector in vector order.
pub(crate) fn all_gather_host(
    comm: &mut Communicator,
    group: &Group,
    vs: &[Pieces<'_, Vec<f32>>],
) -> Result<Vec<Vec<f32>>> {
    let mine: Vec<f32> = vs.iter().flat_map(|(v, _)| v.iter().copied()).collect();
    let parts = comm.all_gather(group, &mine)?;
    let mut at = vec![0usize; parts.len()];
    let mut out = Vec::with_capacity(vs.len());
    for (_, shards) in vs {
        let mut whole = Vec::with_capacity(shards.iter().map(|r| r.len()).sum());
        for (p, piece) in parts.iter().enumerate() {
            let n = shards.get(p).map_or(0, |r| r.len());
            let part = piece.get(at[p]..at[p] + n).ok_or_else(|| {
                kernel_err("all_gather", "a member sent fewer parts than it owns")
            })?;
            whole.extend_from_slice(part);
            at[p] += n;
        }
        out.push(whole);
    }
    Ok(out)
}

/// One update on host vectors, element by element as the kernels do it.
pub(crate) fn update_host(rule: Update, st: Moments<'_, Vec<f32>>) {
    let grad = &st.grad[st.at..st.at + st.master.len()];
    match rule {
        Update::AdamW(s) => {
            for (j, &g) in grad.iter().enumerate() {
                s.apply(&mut st.master[j], &mut st.m[j], &mut st.v[j], g);
            }
        }
        Update::Sgd(s) => {
            for (j, &g) in grad.iter().enumerate() {
                s.apply(&mut st.master[j], &mut st.m[j], g);
            }
        }
    }
}

impl Storage for HostStorage {
    type Buf = Vec<f32>;
    type Value = Value;
    type Msg = Message;

    fn send(&mut self, comm: &mut Communicator, to: usize, tag: u64, msg: Message) -> Result<()> {
        comm.send(to, tag, msg)
    }

    fn recv(&mut self, comm: &mut Communicator, from: usize, tag: u64) -> Result<Message> {
        comm.recv(from, tag)
    }

    fn len(v: &Vec<f32>) -> usize {
        v.len()
    }

    fn stage_in(&mut self, data: Vec<f32>) -> Result<Vec<f32>> {
        Ok(data)
    }

    fn stage_out(&mut self, v: Vec<f32>) -> Result<Vec<f32>> {
        Ok(v)
    }

    fn read<'a>(&mut self, v: &'a Vec<f32>, at: Range<usize>) -> Result<Cow<'a, [f32]>> {
        v.get(at.clone())
            .map(Cow::Borrowed)
            .ok_or_else(|| kernel_err("read", format!("{at:?} of {} elements", v.len())))
    }

    fn write(&mut self, v: &mut Vec<f32>, at: usize, data: &[f32]) -> Result<()> {
        let n = v.len();
        v.get_mut(at..at + data.len())
            .ok_or_else(|| kernel_err("write", format!("{} at {at} of {n}", data.len())))?
            .copy_from_slice(data);
        Ok(())
    }

    fn zeros(&mut self, len: usize) -> Result<Vec<f32>> {
        Ok(vec![0.0; len])
    }

    fn add(&mut self, acc: &mut Vec<f32>, x: &Vec<f32>) -> Result<()> {
        acc.iter_mut().zip(x).for_each(|(a, b)| *a += b);
        Ok(())
    }

    fn sq_norm(&mut self, parts: &[(&Vec<f32>, Range<usize>)]) -> Result<f64> {
        let mut sum = 0.0;
        for (v, at) in parts {
            sum += self
                .read(v, at.clone())?
                .iter()
                .map(|&g| f64::from(g) * f64::from(g))
                .sum::<f64>();
        }
        Ok(sum)
    }

    fn update(&mut self, rule: Update, st: Moments<'_, Vec<f32>>) -> Result<()> {
        update_host(rule, st);
        Ok(())
    }

    fn value(&mut self, shape: &[usize], master: &Vec<f32>) -> Result<Value> {
        Ok(Arc::new(Tensor::f32(shape.to_vec(), master.clone())))
    }

    fn value_from_host(&mut self, shape: &[usize], data: Vec<f32>) -> Result<Value> {
        Ok(Arc::new(Tensor::f32(shape.to_vec(), data)))
    }

    fn value_to_host(&mut self, v: &Value) -> Result<Vec<f32>> {
        Ok(v.f()?.to_vec())
    }

    fn keep(&mut self, v: &Value) -> Result<Value> {
        // Built from a copy of the master values: nothing writes it later.
        Ok(v.clone())
    }

    fn all_reduce(
        &mut self,
        comm: &mut Communicator,
        group: &Group,
        vs: &mut [&mut Vec<f32>],
    ) -> Result<()> {
        all_reduce_host(comm, group, vs)
    }

    fn reduce_scatter(
        &mut self,
        comm: &mut Communicator,
        group: &Group,
        vs: &[Pieces<'_, Vec<f32>>],
    ) -> Result<Vec<Vec<f32>>> {
        reduce_scatter_host(comm, group, vs)
    }

    fn all_gather(
        &mut self,
        comm: &mut Communicator,
        group: &Group,
        vs: &[Pieces<'_, Vec<f32>>],
    ) -> Result<Vec<Vec<f32>>> {
        all_gather_host(comm, group, vs)
    }
}
