//! Training state resident on a compute backend: master values, moments,
//! gradients and the compute's parameter copies are the backend's buffers
//! (a GPU's memory under `CudaBackend`; interpreted on a CPU under
//! `HostBackend`, which is how this path is tested without a GPU). The
//! optimizer, gradient accumulation, the norm and the storage-type copies
//! run as codegen's flat kernels; nothing crosses to the host in a step but
//! the norm's partial sums, and whatever the links stage.
//!
//! The collectives go through [`Links`]: [`HostStaged`] copies through the
//! host and sums with the CPU communicator (any backend; several ranks on
//! one GPU), `crate::gpu::NcclLinks` runs NCCL on the device buffers.

use super::storage::{
    all_gather_host, all_reduce_host, reduce_scatter_host, update_then_value, Moments, Pieces,
    Storage, Update,
};
use crate::comm::{Communicator, Group};
use crate::error::{kernel_err, Result};
use crate::fused::relayout::{DeviceMoves, LayoutKernels};
use crate::fused::{flat_args, to_backend, Backend, Val};
use crate::tensor::Tensor;
use dplc_codegen::{
    adamw_kernel, adamw_value_kernel, add_kernel, convert_kernel, sgd_kernel, sum_squares_kernel,
    Args, Elem, Kernel, SUM_SQUARES_COLS,
};
use dplc_ir::DType;
use std::borrow::Cow;
use std::ops::Range;

/// A flat `f32` vector in a backend's memory (no buffer while empty).
pub(crate) struct DeviceBuf<B: Backend> {
    pub buf: Option<B::Buf>,
    pub len: usize,
}

impl<B: Backend> Default for DeviceBuf<B> {
    fn default() -> Self {
        DeviceBuf { buf: None, len: 0 }
    }
}

impl<B: Backend> DeviceBuf<B> {
    /// The buffer of a vector known to be non-empty.
    pub fn get(&self) -> Result<&B::Buf> {
        self.buf
            .as_ref()
            .ok_or_else(|| kernel_err("device state", "an empty vector read as a buffer"))
    }
}

/// How a rank's device state is summed over a group.
pub(crate) trait Links<B: Backend> {
    fn all_reduce(
        &mut self,
        be: &mut B,
        comm: &mut Communicator,
        group: &Group,
        vs: &mut [&mut DeviceBuf<B>],
    ) -> Result<()>;
    fn reduce_scatter(
        &mut self,
        be: &mut B,
        comm: &mut Communicator,
        group: &Group,
        vs: &[Pieces<'_, DeviceBuf<B>>],
    ) -> Result<Vec<DeviceBuf<B>>>;
    fn all_gather(
        &mut self,
        be: &mut B,
        comm: &mut Communicator,
        group: &Group,
        vs: &[Pieces<'_, DeviceBuf<B>>],
    ) -> Result<Vec<DeviceBuf<B>>>;
    /// Piece `j` of `pieces` to the member at position `j` of `group`; what
    /// each member sent here, in group order. The pieces of a layout change
    /// (`crate::fused::relayout`): floats in any storage type, every
    /// member's piece for this rank as long as this rank's own.
    fn all_to_all(
        &mut self,
        be: &mut B,
        comm: &mut Communicator,
        group: &Group,
        pieces: Vec<Val<B>>,
    ) -> Result<Vec<Val<B>>>;
    /// Every member's `v` summed by a collective of the links' own (`None`
    /// where they have none: the caller gathers and sums in group order).
    fn sum_value(
        &mut self,
        _be: &mut B,
        _comm: &mut Communicator,
        _group: &Group,
        _v: &Val<B>,
    ) -> Result<Option<Val<B>>> {
        Ok(None)
    }
    /// Every member's `v`, in group order, by a collective of the links'
    /// own (`None`: the caller runs [`Links::all_to_all`]).
    fn gather_value(
        &mut self,
        _be: &mut B,
        _comm: &mut Communicator,
        _group: &Group,
        _v: &Val<B>,
    ) -> Result<Option<Vec<Val<B>>>> {
        Ok(None)
    }
    /// Piece `j` of `pieces` (equal lengths) summed over the members, at
    /// member `j`, by a collective of the links' own (`None`: the caller
    /// exchanges and sums in group order).
    fn scatter_sum(
        &mut self,
        _be: &mut B,
        _comm: &mut Communicator,
        _group: &Group,
        _pieces: &[Val<B>],
    ) -> Result<Option<Val<B>>> {
        Ok(None)
    }
    /// Send a pipeline hop's values to rank `to` under `tag`, without
    /// waiting for the receiver (the schedule's sends and receives cross
    /// between stages). Through the host unless the links say otherwise.
    fn send(
        &mut self,
        be: &mut B,
        comm: &mut Communicator,
        (to, tag): (usize, u64),
        vals: Vec<Option<Val<B>>>,
    ) -> Result<()> {
        send_host(be, comm, (to, tag), &vals)
    }
    /// What rank `from` sent under `tag`, waiting for it.
    fn recv(
        &mut self,
        be: &mut B,
        comm: &mut Communicator,
        (from, tag): (usize, u64),
    ) -> Result<Vec<Option<Val<B>>>> {
        recv_host(be, comm, (from, tag))
    }
}

/// [`Links::send`] through the host: each value down (floats as `f32`,
/// exact from any storage type) and posted by the CPU communicator.
pub(crate) fn send_host<B: Backend>(
    be: &mut B,
    comm: &mut Communicator,
    (to, tag): (usize, u64),
    vals: &[Option<Val<B>>],
) -> Result<()> {
    let msg = vals
        .iter()
        .map(|v| {
            v.as_ref()
                .map(|v| {
                    Ok(match v.elem {
                        Elem::I32 => Tensor::i32(vec![v.len], be.download_i32(&v.buf, v.len)?),
                        Elem::Float | Elem::F32 => {
                            Tensor::f32(vec![v.len], be.download(&v.buf, v.elem, v.len)?)
                        }
                    })
                })
                .transpose()
        })
        .collect::<Result<_>>()?;
    comm.send(to, tag, msg)
}

/// [`Links::recv`] through the host: floats up in the storage type.
pub(crate) fn recv_host<B: Backend>(
    be: &mut B,
    comm: &mut Communicator,
    (from, tag): (usize, u64),
) -> Result<Vec<Option<Val<B>>>> {
    comm.recv(from, tag)?
        .iter()
        .map(|t| t.as_ref().map(|t| to_backend(be, t)).transpose())
        .collect()
}

/// Through the host: each collective copies its vectors down, runs the CPU
/// communicator's collective (the host storage's very code, so the sums
/// are the reference's bits) and copies the result up. Correct on any
/// backend and any placement of ranks; not fast.
#[derive(Default)]
pub(crate) struct HostStaged;

fn down<B: Backend>(be: &mut B, v: &DeviceBuf<B>) -> Result<Vec<f32>> {
    match &v.buf {
        Some(b) => be.download(b, Elem::F32, v.len),
        None => Ok(Vec::new()),
    }
}

fn up<B: Backend>(be: &mut B, data: &[f32]) -> Result<DeviceBuf<B>> {
    Ok(DeviceBuf {
        buf: if data.is_empty() {
            None
        } else {
            Some(be.upload(Elem::F32, data)?)
        },
        len: data.len(),
    })
}

impl<B: Backend> Links<B> for HostStaged {
    fn all_reduce(
        &mut self,
        be: &mut B,
        comm: &mut Communicator,
        group: &Group,
        vs: &mut [&mut DeviceBuf<B>],
    ) -> Result<()> {
        let mut host: Vec<Vec<f32>> = vs.iter().map(|v| down(be, v)).collect::<Result<_>>()?;
        let mut refs: Vec<&mut Vec<f32>> = host.iter_mut().collect();
        all_reduce_host(comm, group, &mut refs)?;
        for (v, h) in vs.iter_mut().zip(&host) {
            **v = up(be, h)?;
        }
        Ok(())
    }

    fn reduce_scatter(
        &mut self,
        be: &mut B,
        comm: &mut Communicator,
        group: &Group,
        vs: &[Pieces<'_, DeviceBuf<B>>],
    ) -> Result<Vec<DeviceBuf<B>>> {
        through_host(be, vs, |pieces| reduce_scatter_host(comm, group, pieces))
    }

    fn all_gather(
        &mut self,
        be: &mut B,
        comm: &mut Communicator,
        group: &Group,
        vs: &[Pieces<'_, DeviceBuf<B>>],
    ) -> Result<Vec<DeviceBuf<B>>> {
        through_host(be, vs, |pieces| all_gather_host(comm, group, pieces))
    }

    fn all_to_all(
        &mut self,
        be: &mut B,
        comm: &mut Communicator,
        group: &Group,
        pieces: Vec<Val<B>>,
    ) -> Result<Vec<Val<B>>> {
        all_to_all_host(be, comm, group, pieces)
    }

    /// Down once and gathered by the communicator (an all-to-all of copies
    /// would download the value once a member).
    fn gather_value(
        &mut self,
        be: &mut B,
        comm: &mut Communicator,
        group: &Group,
        v: &Val<B>,
    ) -> Result<Option<Vec<Val<B>>>> {
        if v.elem == Elem::I32 {
            return Ok(None);
        }
        let pos = group
            .position(comm.rank())
            .ok_or_else(|| kernel_err("all_gather", "a group without this rank"))?;
        let mine = be.download(&v.buf, v.elem, v.len)?;
        comm.all_gather(group, &mine)?
            .iter()
            .enumerate()
            .map(|(j, h)| {
                if j == pos {
                    return Ok(v.clone());
                }
                Ok(Val {
                    buf: be.upload(v.elem, h)?,
                    elem: v.elem,
                    len: h.len(),
                })
            })
            .collect::<Result<_>>()
            .map(Some)
    }
}

/// This rank's position in `group`, checked to have a piece for each
/// member: what every [`Links::all_to_all`] checks first.
pub(crate) fn all_to_all_position<V>(
    comm: &Communicator,
    group: &Group,
    pieces: &[V],
) -> Result<usize> {
    let pos = group
        .position(comm.rank())
        .ok_or_else(|| kernel_err("all_to_all", "a group without this rank"))?;
    if pieces.len() != group.size() {
        return Err(kernel_err(
            "all_to_all",
            format!("{} pieces for a group of {}", pieces.len(), group.size()),
        ));
    }
    Ok(pos)
}

/// [`Links::all_to_all`] through the host, for any backend: the pieces
/// down as `f32` (exact from any storage type), the CPU communicator's
/// all-to-all, the arrivals up in the pieces' type.
pub(crate) fn all_to_all_host<B: Backend>(
    be: &mut B,
    comm: &mut Communicator,
    group: &Group,
    pieces: Vec<Val<B>>,
) -> Result<Vec<Val<B>>> {
    let elem = pieces
        .first()
        .map(|p| p.elem)
        .ok_or_else(|| kernel_err("all_to_all", "no pieces"))?;
    if elem == Elem::I32 {
        return Err(kernel_err(
            "all_to_all",
            "indices move between ranks on the host, not as a layout change's pieces",
        ));
    }
    // This rank's own piece stays where it is.
    let pos = all_to_all_position(comm, group, &pieces)?;
    let host: Vec<Vec<f32>> = pieces
        .iter()
        .enumerate()
        .map(|(j, p)| {
            if j == pos {
                Ok(Vec::new())
            } else {
                be.download(&p.buf, p.elem, p.len)
            }
        })
        .collect::<Result<_>>()?;
    comm.all_to_all(group, host)?
        .iter()
        .enumerate()
        .map(|(j, h)| {
            if j == pos {
                return Ok(pieces[pos].clone());
            }
            Ok(Val {
                buf: be.upload(elem, h)?,
                elem,
                len: h.len(),
            })
        })
        .collect()
}

/// `collective` on host copies of `vs`, its results copied up.
fn through_host<B: Backend>(
    be: &mut B,
    vs: &[Pieces<'_, DeviceBuf<B>>],
    collective: impl FnOnce(&[Pieces<'_, Vec<f32>>]) -> Result<Vec<Vec<f32>>>,
) -> Result<Vec<DeviceBuf<B>>> {
    let host: Vec<Vec<f32>> = vs.iter().map(|(v, _)| down(be, v)).collect::<Result<_>>()?;
    let pieces: Vec<Pieces<'_, Vec<f32>>> =
        host.iter().zip(vs).map(|(h, (_, s))| (h, *s)).collect();
    collective(&pieces)?.iter().map(|h| up(be, h)).collect()
}

/// The flat kernels a step runs besides the model's, built once.
struct StepKernels {
    adamw: Kernel,
    adamw_value: Kernel,
    sgd: Kernel,
    add: Kernel,
    sum_squares: Kernel,
    to_storage: Kernel,
}

/// Training state in a backend's buffers (see the module header).
pub(crate) struct DeviceStorage<B: Backend, L> {
    pub be: B,
    links: L,
    kernels: StepKernels,
    layout: LayoutKernels,
}

impl<B: Backend, L: Links<B>> DeviceStorage<B, L> {
    pub fn new(be: B, links: L) -> Self {
        DeviceStorage {
            be,
            links,
            kernels: StepKernels {
                adamw: adamw_kernel(),
                adamw_value: adamw_value_kernel(),
                sgd: sgd_kernel(),
                add: add_kernel(Elem::F32, Elem::F32, Elem::F32),
                sum_squares: sum_squares_kernel(Elem::F32),
                to_storage: convert_kernel(Elem::Float, Elem::F32),
            },
            layout: LayoutKernels::new(),
        }
    }

    /// What a layout change on `be` (the compute's handle on this
    /// device) moves its pieces with.
    pub fn moves<'x>(
        &'x mut self,
        be: &'x mut B,
        comm: &'x mut Communicator,
    ) -> DeviceMoves<'x, B, L> {
        DeviceMoves {
            be,
            links: &mut self.links,
            comm,
            kernels: &mut self.layout,
        }
    }

    /// Whether a whole parameter's compute value is its master vector
    /// itself: when floats are stored as f32, a second copy would only
    /// hold the same numbers.
    fn shares_master(&self) -> bool {
        self.be.dtype() == DType::F32
    }

    /// One update's launch, in place; with `value`, AdamW also writes the
    /// new parameter there in the storage type ([`adamw_value_kernel`]).
    fn launch_update(
        &mut self,
        rule: Update,
        st: Moments<'_, DeviceBuf<B>>,
        value: Option<&B::Buf>,
    ) -> Result<()> {
        let n = st.master.len;
        if n == 0 {
            return Ok(());
        }
        let grad = self.slice(st.grad, st.at..st.at + n)?;
        let (p, m, g) = (
            st.master.get()?.clone(),
            st.m.get()?.clone(),
            grad.get()?.clone(),
        );
        match rule {
            Update::AdamW(s) => {
                let v = st.v.get()?.clone();
                let mut bufs = vec![p.clone(), m.clone(), v.clone(), p, g, m, v];
                let kernel = match value {
                    Some(out) => {
                        bufs.push(out.clone());
                        &self.kernels.adamw_value
                    }
                    None => &self.kernels.adamw,
                };
                self.be.launch(kernel, &s.args(n as i64), &bufs)
            }
            Update::Sgd(_) if value.is_some() => Err(kernel_err(
                "sgd",
                "writes no compute copy as it steps".to_string(),
            )),
            Update::Sgd(s) => self.be.launch(
                &self.kernels.sgd,
                &s.args(n as i64),
                &[p.clone(), m.clone(), p, g, m],
            ),
        }
    }

    /// `v[at]` ([`slice_of`] on this storage's backend).
    fn slice(&mut self, v: &DeviceBuf<B>, at: Range<usize>) -> Result<DeviceBuf<B>> {
        slice_of(&mut self.be, v, at)
    }
}

/// `v[at]` as a vector of its own (`v` itself when `at` is all of it).
pub(crate) fn slice_of<B: Backend>(
    be: &mut B,
    v: &DeviceBuf<B>,
    at: Range<usize>,
) -> Result<DeviceBuf<B>> {
    if at == (0..v.len) {
        return Ok(DeviceBuf {
            buf: v.buf.clone(),
            len: v.len,
        });
    }
    if at.end > v.len {
        return Err(kernel_err("slice", format!("{at:?} of {} elements", v.len)));
    }
    if at.is_empty() {
        return Ok(DeviceBuf::default());
    }
    let out = be.alloc(Elem::F32, at.len())?;
    be.copy(v.get()?, at.start, &out, 0, at.len())?;
    Ok(DeviceBuf {
        buf: Some(out),
        len: at.len(),
    })
}

impl<B: Backend, L: Links<B>> Storage for DeviceStorage<B, L> {
    type Buf = DeviceBuf<B>;
    type Value = Val<B>;
    type Msg = Vec<Option<Val<B>>>;

    fn send(&mut self, comm: &mut Communicator, to: usize, tag: u64, msg: Self::Msg) -> Result<()> {
        self.links.send(&mut self.be, comm, (to, tag), msg)
    }

    fn recv(&mut self, comm: &mut Communicator, from: usize, tag: u64) -> Result<Self::Msg> {
        self.links.recv(&mut self.be, comm, (from, tag))
    }

    fn len(v: &DeviceBuf<B>) -> usize {
        v.len
    }

    fn stage_in(&mut self, data: Vec<f32>) -> Result<DeviceBuf<B>> {
        up(&mut self.be, &data)
    }

    fn stage_out(&mut self, v: DeviceBuf<B>) -> Result<Vec<f32>> {
        down(&mut self.be, &v)
    }

    fn read<'a>(&mut self, v: &'a DeviceBuf<B>, at: Range<usize>) -> Result<Cow<'a, [f32]>> {
        let part = self.slice(v, at)?;
        Ok(Cow::Owned(down(&mut self.be, &part)?))
    }

    fn write(&mut self, v: &mut DeviceBuf<B>, at: usize, data: &[f32]) -> Result<()> {
        if data.is_empty() {
            return Ok(());
        }
        if at + data.len() > v.len {
            return Err(kernel_err(
                "write",
                format!("{} at {at} of {}", data.len(), v.len),
            ));
        }
        let src = self.be.upload(Elem::F32, data)?;
        self.be.copy(&src, 0, v.get()?, at, data.len())
    }

    fn zeros(&mut self, len: usize) -> Result<DeviceBuf<B>> {
        Ok(DeviceBuf {
            buf: if len == 0 {
                None
            } else {
                Some(self.be.zeros(Elem::F32, len)?)
            },
            len,
        })
    }

    fn add(&mut self, acc: &mut DeviceBuf<B>, x: &DeviceBuf<B>) -> Result<()> {
        if acc.len != x.len {
            return Err(kernel_err(
                "add",
                format!("{} elements added to {}", x.len, acc.len),
            ));
        }
        if acc.len == 0 {
            return Ok(());
        }
        let a = acc.get()?.clone();
        self.be.launch(
            &self.kernels.add,
            &flat_args(acc.len),
            &[a.clone(), a, x.get()?.clone()],
        )
    }

    fn sq_norm(&mut self, parts: &[(&DeviceBuf<B>, Range<usize>)]) -> Result<f64> {
        // Each part's row sums land in one buffer, read back once: a read
        // waits for the device, and a model has hundreds of tensors.
        let mut rows = Vec::with_capacity(parts.len());
        let mut partials = Vec::with_capacity(parts.len());
        for (v, at) in parts {
            let part = self.slice(v, at.clone())?;
            let n = part.len.div_ceil(SUM_SQUARES_COLS as usize);
            rows.push(n);
            if n == 0 {
                continue;
            }
            let partial = self.be.alloc(Elem::F32, n)?;
            let args = Args {
                sizes: vec![n as i64, SUM_SQUARES_COLS, part.len as i64],
                ..Args::default()
            };
            self.be.launch(
                &self.kernels.sum_squares,
                &args,
                &[partial.clone(), part.get()?.clone()],
            )?;
            partials.push(partial);
        }
        let total: usize = rows.iter().sum();
        if total == 0 {
            return Ok(0.0);
        }
        let all = self.be.alloc(Elem::F32, total)?;
        let mut at = 0;
        for (partial, &n) in partials.iter().zip(rows.iter().filter(|&&n| n > 0)) {
            self.be.copy(partial, 0, &all, at, n)?;
            at += n;
        }
        let host = self.be.download(&all, Elem::F32, total)?;
        let mut sum = 0.0;
        let mut at = 0;
        for n in rows {
            sum += host[at..at + n].iter().map(|&x| f64::from(x)).sum::<f64>();
            at += n;
        }
        Ok(sum)
    }

    fn update(&mut self, rule: Update, st: Moments<'_, DeviceBuf<B>>) -> Result<()> {
        self.launch_update(rule, st, None)
    }

    fn update_value(
        &mut self,
        rule: Update,
        st: Moments<'_, DeviceBuf<B>>,
        shape: &[usize],
    ) -> Result<Val<B>> {
        // AdamW writes the compute's copy as it steps (one launch, one
        // read of the master); where the copy is the master itself, or the
        // rule another, the two passes.
        let n = st.master.len;
        let (Update::AdamW(_), false, true) = (rule, self.shares_master(), n > 0) else {
            return update_then_value(self, rule, st, shape);
        };
        let out = self.be.alloc(Elem::Float, n)?;
        self.launch_update(rule, st, Some(&out))?;
        Ok(Val {
            buf: out,
            elem: Elem::Float,
            len: n,
        })
    }

    fn value(&mut self, _shape: &[usize], master: &DeviceBuf<B>) -> Result<Val<B>> {
        // Stored as f32, the compute reads the master values themselves, as
        // an fp32 run keeps one copy of its weights.
        if self.shares_master() {
            if let Some(buf) = &master.buf {
                return Ok(Val {
                    buf: buf.clone(),
                    elem: Elem::Float,
                    len: master.len,
                });
            }
        }
        let out = self.be.alloc(Elem::Float, master.len)?;
        if master.len > 0 {
            self.be.launch(
                &self.kernels.to_storage,
                &flat_args(master.len),
                &[out.clone(), master.get()?.clone()],
            )?;
        }
        Ok(Val {
            buf: out,
            elem: Elem::Float,
            len: master.len,
        })
    }

    fn value_from_host(&mut self, _shape: &[usize], data: Vec<f32>) -> Result<Val<B>> {
        Ok(Val {
            buf: self.be.upload(Elem::Float, &data)?,
            elem: Elem::Float,
            len: data.len(),
        })
    }

    fn value_to_host(&mut self, v: &Val<B>) -> Result<Vec<f32>> {
        self.be.download(&v.buf, v.elem, v.len)
    }

    fn keep(&mut self, v: &Val<B>) -> Result<Val<B>> {
        if !self.shares_master() || v.len == 0 {
            return Ok(v.clone());
        }
        let out = self.be.alloc(Elem::Float, v.len)?;
        self.be.copy(&v.buf, 0, &out, 0, v.len)?;
        Ok(Val {
            buf: out,
            elem: Elem::Float,
            len: v.len,
        })
    }

    fn peak_bytes(&self) -> Option<u64> {
        self.be.peak_bytes().map(|b| b as u64)
    }

    fn host_crossings(&self) -> Option<u64> {
        self.be.host_crossings()
    }

    fn all_reduce(
        &mut self,
        comm: &mut Communicator,
        group: &Group,
        vs: &mut [&mut DeviceBuf<B>],
    ) -> Result<()> {
        // A group of one sums nothing: no copy through the host, no wait.
        if group.size() == 1 {
            return Ok(());
        }
        self.links.all_reduce(&mut self.be, comm, group, vs)
    }

    fn reduce_scatter(
        &mut self,
        comm: &mut Communicator,
        group: &Group,
        vs: &[Pieces<'_, DeviceBuf<B>>],
    ) -> Result<Vec<DeviceBuf<B>>> {
        if group.size() == 1 {
            return vs.iter().map(|(v, s)| self.slice(v, own(s))).collect();
        }
        self.links.reduce_scatter(&mut self.be, comm, group, vs)
    }

    fn all_gather(
        &mut self,
        comm: &mut Communicator,
        group: &Group,
        vs: &[Pieces<'_, DeviceBuf<B>>],
    ) -> Result<Vec<DeviceBuf<B>>> {
        if group.size() == 1 {
            return vs
                .iter()
                .map(|(v, s)| self.slice(v, 0..own(s).len()))
                .collect();
        }
        self.links.all_gather(&mut self.be, comm, group, vs)
    }
}

/// The range a group's only member owns of a vector.
fn own(shards: &[Range<usize>]) -> Range<usize> {
    shards.first().cloned().unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::comm::World;
    use crate::fused::HostBackend;
    use crate::params::split;
    use crate::params::storage::HostStorage;
    use dplc_codegen::AdamwScalars;
    use std::time::Duration;

    fn vector(rank: usize, k: usize, n: usize) -> Vec<f32> {
        (0..n)
            .map(|i| ((i * 7 + k * 3 + rank * 11) as f32 * 0.37).sin())
            .collect()
    }

    /// What one rank gets from a round of every storage operation.
    fn round<S: Storage>(s: &mut S, comm: &mut Communicator) -> Vec<Vec<f32>> {
        let group = Group::new(vec![0, 1]);
        let rank = comm.rank();
        let sizes = [13, 6, 1];
        let shards: Vec<Vec<Range<usize>>> = sizes.iter().map(|&n| split(n, 2)).collect();
        let mut vs: Vec<S::Buf> = (0..sizes.len())
            .map(|k| s.stage_in(vector(rank, k, sizes[k])).unwrap())
            .collect();
        let mut out = Vec::new();
        let mut refs: Vec<&mut S::Buf> = vs.iter_mut().collect();
        s.all_reduce(comm, &group, &mut refs).unwrap();
        let pieces: Vec<Pieces<'_, S::Buf>> =
            vs.iter().zip(&shards).map(|(v, r)| (v, &r[..])).collect();
        let mine = s.reduce_scatter(comm, &group, &pieces).unwrap();
        let mine_pieces: Vec<Pieces<'_, S::Buf>> =
            mine.iter().zip(&shards).map(|(v, r)| (v, &r[..])).collect();
        let whole = s.all_gather(comm, &group, &mine_pieces).unwrap();
        // An update from an offset into a longer gradient, then a write.
        let (mut p, mut m, mut v) = (
            s.stage_in(vector(rank, 5, 4)).unwrap(),
            s.zeros(4).unwrap(),
            s.zeros(4).unwrap(),
        );
        let grad = s.stage_in(vector(rank, 6, 9)).unwrap();
        let rule = Update::AdamW(AdamwScalars {
            lr: 0.01,
            beta1: 0.9,
            beta2: 0.95,
            eps: 1e-8,
            weight_decay: 0.1,
            step: 2,
            grad_scale: 0.5,
        });
        let st = Moments {
            master: &mut p,
            m: &mut m,
            v: &mut v,
            grad: &grad,
            at: 3,
        };
        s.update(rule, st).unwrap();
        s.write(&mut p, 1, &[9.0, 8.0]).unwrap();
        let mut acc = s.stage_in(vector(rank, 7, 9)).unwrap();
        s.add(&mut acc, &grad).unwrap();
        let norm = s.sq_norm(&[(&acc, 2..8), (&grad, 1..4)]).unwrap();
        for v in vs
            .into_iter()
            .chain(mine)
            .chain(whole)
            .chain([p, m, v, acc])
        {
            out.push(s.stage_out(v).unwrap());
        }
        out.push(s.read(&grad, 2..5).unwrap().into_owned());
        out.push(vec![norm as f32]);
        out
    }

    /// The device storage (interpreted, staged through the host) is the
    /// host storage: the same bits for every collective, update, add and
    /// copy, on two ranks.
    #[test]
    fn device_state_is_the_host_state() {
        let run = |device: bool| -> Vec<Vec<Vec<f32>>> {
            let world = World::new(2, Duration::from_secs(20));
            std::thread::scope(|sc| {
                let hs: Vec<_> = (0..2)
                    .map(|r| {
                        let mut comm = world.communicator(r);
                        sc.spawn(move || {
                            if device {
                                let mut s = DeviceStorage::new(HostBackend::new(), HostStaged);
                                round(&mut s, &mut comm)
                            } else {
                                round(&mut HostStorage, &mut comm)
                            }
                        })
                    })
                    .collect();
                hs.into_iter().map(|h| h.join().unwrap()).collect()
            })
        };
        let (host, device) = (run(false), run(true));
        for (r, (h, d)) in host.iter().zip(&device).enumerate() {
            let n = h.len();
            assert_eq!(h[..n - 1], d[..n - 1], "rank {r}");
            let (a, b) = (h[n - 1][0], d[n - 1][0]);
            assert!(((a - b) / a).abs() < 1e-6, "rank {r}: norm {a} vs {b}");
        }
        // The sums are sums: rank 0's first vector, all-reduced.
        let want: Vec<f32> = vector(0, 0, 13)
            .iter()
            .zip(vector(1, 0, 13))
            .map(|(a, b)| a + b)
            .collect();
        assert_eq!(host[0][0], want);
    }

    /// AdamW with the compute's copy made as it steps (`update_value`, one
    /// launch) is the update then the copy (two): the same master, moments
    /// and bf16 value, bit for bit; so is SGD, which takes the two passes.
    #[test]
    fn adamw_makes_the_compute_copy_as_it_steps() {
        let adamw = Update::AdamW(AdamwScalars {
            lr: 0.01,
            beta1: 0.9,
            beta2: 0.95,
            eps: 1e-8,
            weight_decay: 0.1,
            step: 3,
            grad_scale: 0.5,
        });
        let sgd = Update::Sgd(dplc_codegen::SgdScalars {
            lr: 0.1,
            momentum: 0.9,
            grad_scale: 0.5,
        });
        for rule in [adamw, sgd] {
            let run = |fused: bool| {
                let mut s = DeviceStorage::new(HostBackend::with_storage(DType::BF16), HostStaged);
                let (mut p, mut m, mut v) = (
                    s.stage_in(vector(0, 5, 37)).unwrap(),
                    s.stage_in(vector(0, 6, 37)).unwrap(),
                    s.stage_in(vector(0, 7, 37).iter().map(|x| x * x).collect())
                        .unwrap(),
                );
                let grad = s.stage_in(vector(0, 8, 40)).unwrap();
                let st = Moments {
                    master: &mut p,
                    m: &mut m,
                    v: &mut v,
                    grad: &grad,
                    at: 2,
                };
                let value = if fused {
                    s.update_value(rule, st, &[37]).unwrap()
                } else {
                    s.update(rule, st).unwrap();
                    s.value(&[37], &p).unwrap()
                };
                let value = s.value_to_host(&value).unwrap();
                let state: Vec<Vec<f32>> = [p, m, v]
                    .into_iter()
                    .map(|b| s.stage_out(b).unwrap())
                    .collect();
                (value, state)
            };
            let (fused, apart) = (run(true), run(false));
            assert_eq!(fused, apart, "{rule:?}");
            assert_ne!(fused.0, vector(0, 5, 37), "{rule:?}: the value moved");
        }
    }

    /// A rank alone in its group copies nothing to the host for a
    /// collective, and reads a norm over many tensors back once.
    #[test]
    fn one_rank_state_stays_on_the_device() {
        let world = World::new(1, Duration::from_secs(20));
        let mut comm = world.communicator(0);
        let be = HostBackend::new();
        let mut s = DeviceStorage::new(be.handle(), HostStaged);
        let group = Group::new(vec![0]);
        let mut a = s.stage_in(vector(0, 1, 10)).unwrap();
        let b = s.stage_in(vector(0, 2, 3)).unwrap();
        let before = be.host_crossings().unwrap();
        s.all_reduce(&mut comm, &group, &mut [&mut a]).unwrap();
        let shards = [Range { start: 0, end: 10 }];
        let mine = s
            .reduce_scatter(&mut comm, &group, &[(&a, &shards[..])])
            .unwrap();
        let whole = s
            .all_gather(&mut comm, &group, &[(&mine[0], &shards[..])])
            .unwrap();
        let norm = s.sq_norm(&[(&a, 2..8), (&b, 0..3)]).unwrap();
        assert_eq!(
            be.host_crossings().unwrap() - before,
            1,
            "only the norm's one read"
        );
        let want: f64 = vector(0, 1, 10)[2..8]
            .iter()
            .chain(&vector(0, 2, 3))
            .map(|&x| f64::from(x) * f64::from(x))
            .sum();
        assert!(((norm - want) / want).abs() < 1e-6, "{norm} vs {want}");
        assert_eq!(
            s.stage_out(whole.into_iter().next().unwrap()).unwrap(),
            vector(0, 1, 10)
        );
    }
}
