//! Links for ranks that share one GPU in one process (rank threads dealt
//! over fewer GPUs, as the GPU check's tp=2 and pp=2 runs are): a layout
//! change's pieces and a pipeline hop's values are handed from rank to
//! rank without leaving the device, or even being copied.
//!
//! The giver leaves each buffer with the device under a token
//! ([`GpuDevice::hand_over`](super::GpuDevice::hand_over)) and sends the
//! token over the CPU communicator; the taker takes the buffer by it. The
//! ranks' backends queue all their work on the device's one stream, so
//! what the giver queued before handing over (the kernel that wrote the
//! value) is done before anything the taker queues after. The executor
//! writes a value in place only where it holds the only handle
//! (`Backend::unique`), so giver and taker may both read a handed buffer;
//! a parameter's compute copy, which a layout change may hand over whole
//! (an all-gather's own piece), is rewritten only by the optimizer step,
//! after the step's world-wide norm all-reduce, which a taker reaches only
//! once its reads (queued in the same conversion) are. The store's sums take every member's vectors so and add
//! them from zero in group order (`sum_parts_kernel`: the host's bits);
//! the store writes its vectors in place (the optimizer, the accumulators),
//! so its collectives end with the group meeting once more, after every
//! member has queued its reads of the others' vectors ([`settle`]). Groups
//! spread over several GPUs go through the host ([`HostStaged`]).

use super::backend::CudaBackend;
use crate::comm::{Communicator, Group};
use crate::error::{kernel_err, Result};
use crate::fused::relayout::LayoutKernels;
use crate::fused::{flat_args, Backend, Val};
use crate::params::{
    all_to_all_host, all_to_all_position, recv_host, send_host, DeviceBuf, HostStaged, Links,
    Pieces,
};
use crate::tensor::Tensor;
use dplc_codegen::Elem;

/// Handed over within a GPU's ranks, the rest through the host.
pub(crate) struct SharedDevice {
    /// Devices the run's ranks are dealt over (rank `r` has `r % gpus`).
    gpus: usize,
    host: HostStaged,
    /// The group-order sums, built once.
    kernels: LayoutKernels,
}

impl SharedDevice {
    pub fn new(gpus: usize) -> Self {
        SharedDevice {
            gpus: gpus.max(1),
            host: HostStaged,
            kernels: LayoutKernels::new(),
        }
    }

    /// Every member's `mine` (each member's list as long), in group order:
    /// each member hands each other member its buffers.
    fn everyones(
        &self,
        be: &CudaBackend,
        comm: &mut Communicator,
        group: &Group,
        mine: &[&DeviceBuf<CudaBackend>],
    ) -> Result<Vec<Vec<DeviceBuf<CudaBackend>>>> {
        let pos = group
            .position(comm.rank())
            .ok_or_else(|| kernel_err("hand-over", "a group without this rank"))?;
        let notes = (0..group.size())
            .map(|j| {
                let mut w = Vec::with_capacity(8 * mine.len());
                for v in mine {
                    // Token 0: nothing handed (an empty vector, or this
                    // rank's own).
                    let token = match &v.buf {
                        Some(b) if j != pos => be.device().hand_over(b.clone()),
                        _ => 0,
                    };
                    w.extend(words(v.len as u64));
                    w.extend(words(token));
                }
                w
            })
            .collect();
        let heard = comm.all_to_all(group, notes)?;
        heard
            .iter()
            .enumerate()
            .map(|(j, note)| {
                if j == pos {
                    return Ok(mine
                        .iter()
                        .map(|v| DeviceBuf {
                            buf: v.buf.clone(),
                            len: v.len,
                        })
                        .collect());
                }
                if note.len() != 8 * mine.len() {
                    return Err(kernel_err("hand-over", "a member sent a malformed note"));
                }
                note.chunks(8)
                    .map(|w| {
                        let (len, token) = (unword(&w[..4]) as usize, unword(&w[4..]));
                        let buf = if token == 0 {
                            None
                        } else {
                            Some(be.device().take_over(token)?)
                        };
                        Ok(DeviceBuf { buf, len })
                    })
                    .collect()
            })
            .collect()
    }

    /// `parts` (each `len` `f32`s) added from zero in group order.
    fn sum(
        &mut self,
        be: &mut CudaBackend,
        parts: &[&DeviceBuf<CudaBackend>],
        len: usize,
    ) -> Result<DeviceBuf<CudaBackend>> {
        if len == 0 {
            return Ok(DeviceBuf::default());
        }
        let out = be.alloc(Elem::F32, len)?;
        let mut bufs = vec![out.clone()];
        for p in parts {
            if p.len < len {
                return Err(kernel_err("hand-over", "a member's vector is short"));
            }
            bufs.push(p.get()?.clone());
        }
        let kernel = self.kernels.sum(Elem::F32, parts.len());
        be.launch(kernel, &flat_args(len), &bufs)?;
        Ok(DeviceBuf {
            buf: Some(out),
            len,
        })
    }

    /// Elements `at` of `v` as a vector of their own.
    fn cut(
        be: &mut CudaBackend,
        v: &DeviceBuf<CudaBackend>,
        at: std::ops::Range<usize>,
    ) -> Result<DeviceBuf<CudaBackend>> {
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

    fn one_device(&self, ranks: &[usize]) -> bool {
        let mut devices = ranks.iter().map(|r| r % self.gpus);
        let first = devices.next();
        devices.all(|d| Some(d) == first)
    }
}

/// A 64-bit token or count as four exact floats (16 bits each), and back:
/// the CPU communicator carries `f32`s.
fn words(x: u64) -> [f32; 4] {
    [0, 16, 32, 48].map(|s| ((x >> s) & 0xffff) as f32)
}

fn unword(w: &[f32]) -> u64 {
    w.iter()
        .zip([0, 16, 32, 48])
        .map(|(&x, s)| (x as u64) << s)
        .fold(0, |a, b| a | b)
}

/// What a value's note says: its element type, length and token.
fn note(v: &Val<CudaBackend>, token: u64) -> Vec<f32> {
    let elem = match v.elem {
        Elem::Float => 0.0,
        Elem::F32 => 1.0,
        Elem::I32 => 2.0,
    };
    let mut w = vec![elem];
    w.extend(words(v.len as u64));
    w.extend(words(token));
    w
}

/// The value a note names, taken from the device.
fn take(be: &CudaBackend, note: &[f32]) -> Result<Val<CudaBackend>> {
    let [elem, ..] = note else {
        return Err(kernel_err("hand-over", "an empty note"));
    };
    if note.len() != 9 {
        return Err(kernel_err("hand-over", "a malformed note"));
    }
    let elem = match *elem as u32 {
        0 => Elem::Float,
        1 => Elem::F32,
        2 => Elem::I32,
        _ => return Err(kernel_err("hand-over", "a note of no element type")),
    };
    Ok(Val {
        buf: be.device().take_over(unword(&note[5..9]))?,
        elem,
        len: unword(&note[1..5]) as usize,
    })
}

/// Wait until every member of `group` has queued its reads of the
/// vectors handed to it: only then may a member write its own in place.
fn settle(comm: &mut Communicator, group: &Group) -> Result<()> {
    comm.all_to_all(group, vec![Vec::new(); group.size()])
        .map(drop)
}

impl Links<CudaBackend> for SharedDevice {
    fn all_reduce(
        &mut self,
        be: &mut CudaBackend,
        comm: &mut Communicator,
        group: &Group,
        vs: &mut [&mut DeviceBuf<CudaBackend>],
    ) -> Result<()> {
        if !self.one_device(group.ranks()) {
            return self.host.all_reduce(be, comm, group, vs);
        }
        let mine: Vec<&DeviceBuf<CudaBackend>> = vs.iter().map(|v| &**v).collect();
        let all = self.everyones(be, comm, group, &mine)?;
        for (i, v) in vs.iter_mut().enumerate() {
            let parts: Vec<&DeviceBuf<CudaBackend>> = all.iter().map(|m| &m[i]).collect();
            let len = v.len;
            **v = self.sum(be, &parts, len)?;
        }
        settle(comm, group)
    }

    fn reduce_scatter(
        &mut self,
        be: &mut CudaBackend,
        comm: &mut Communicator,
        group: &Group,
        vs: &[Pieces<'_, DeviceBuf<CudaBackend>>],
    ) -> Result<Vec<DeviceBuf<CudaBackend>>> {
        if !self.one_device(group.ranks()) {
            return self.host.reduce_scatter(be, comm, group, vs);
        }
        let pos = group.position(comm.rank()).unwrap_or(0);
        let mine: Vec<&DeviceBuf<CudaBackend>> = vs.iter().map(|(v, _)| *v).collect();
        let all = self.everyones(be, comm, group, &mine)?;
        let mine = vs
            .iter()
            .enumerate()
            .map(|(i, (_, shards))| {
                let at = shards.get(pos).cloned().unwrap_or(0..0);
                let parts = all
                    .iter()
                    .map(|m| Self::cut(be, &m[i], at.clone()))
                    .collect::<Result<Vec<_>>>()?;
                let parts: Vec<&DeviceBuf<CudaBackend>> = parts.iter().collect();
                self.sum(be, &parts, at.len())
            })
            .collect::<Result<Vec<_>>>()?;
        settle(comm, group)?;
        Ok(mine)
    }

    fn all_gather(
        &mut self,
        be: &mut CudaBackend,
        comm: &mut Communicator,
        group: &Group,
        vs: &[Pieces<'_, DeviceBuf<CudaBackend>>],
    ) -> Result<Vec<DeviceBuf<CudaBackend>>> {
        if !self.one_device(group.ranks()) {
            return self.host.all_gather(be, comm, group, vs);
        }
        let mine: Vec<&DeviceBuf<CudaBackend>> = vs.iter().map(|(v, _)| *v).collect();
        let all = self.everyones(be, comm, group, &mine)?;
        let wholes = vs
            .iter()
            .enumerate()
            .map(|(i, (_, shards))| {
                // Each member's part in member order, as the host joins them.
                let len: usize = shards.iter().map(|r| r.len()).sum();
                if len == 0 {
                    return Ok(DeviceBuf::default());
                }
                let whole = be.alloc(Elem::F32, len)?;
                let mut at = 0;
                for (p, m) in all.iter().enumerate() {
                    let n = shards.get(p).map_or(0, |r| r.len());
                    if n > 0 {
                        if m[i].len < n {
                            return Err(kernel_err(
                                "all_gather",
                                "a member sent fewer parts than it owns",
                            ));
                        }
                        be.copy(m[i].get()?, 0, &whole, at, n)?;
                    }
                    at += n;
                }
                Ok(DeviceBuf {
                    buf: Some(whole),
                    len,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        settle(comm, group)?;
        Ok(wholes)
    }

    fn all_to_all(
        &mut self,
        be: &mut CudaBackend,
        comm: &mut Communicator,
        group: &Group,
        pieces: Vec<Val<CudaBackend>>,
    ) -> Result<Vec<Val<CudaBackend>>> {
        if !self.one_device(group.ranks()) {
            return all_to_all_host(be, comm, group, pieces);
        }
        let pos = all_to_all_position(comm, group, &pieces)?;
        let notes = pieces
            .iter()
            .enumerate()
            .map(|(j, p)| {
                // This rank's own piece stays where it is.
                let token = if j == pos {
                    0
                } else {
                    be.device().hand_over(p.buf.clone())
                };
                note(p, token)
            })
            .collect();
        let heard = comm.all_to_all(group, notes)?;
        heard
            .iter()
            .enumerate()
            .map(|(j, n)| {
                if j == pos {
                    Ok(pieces[pos].clone())
                } else {
                    take(be, n)
                }
            })
            .collect()
    }

    fn send(
        &mut self,
        be: &mut CudaBackend,
        comm: &mut Communicator,
        (to, tag): (usize, u64),
        vals: Vec<Option<Val<CudaBackend>>>,
    ) -> Result<()> {
        if !self.one_device(&[comm.rank(), to]) {
            return send_host(be, comm, (to, tag), &vals);
        }
        let msg = vals
            .iter()
            .map(|v| {
                v.as_ref().map(|v| {
                    let n = note(v, be.device().hand_over(v.buf.clone()));
                    Tensor::f32(vec![n.len()], n)
                })
            })
            .collect();
        comm.send(to, tag, msg)
    }

    fn recv(
        &mut self,
        be: &mut CudaBackend,
        comm: &mut Communicator,
        (from, tag): (usize, u64),
    ) -> Result<Vec<Option<Val<CudaBackend>>>> {
        if !self.one_device(&[comm.rank(), from]) {
            return recv_host(be, comm, (from, tag));
        }
        comm.recv(from, tag)?
            .iter()
            .map(|t| t.as_ref().map(|t| take(be, t.f()?)).transpose())
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens_and_counts_travel_as_exact_floats() {
        for x in [0, 1, 0xffff, 0x1_0000, 0x7fff_ffff_ffff, u64::MAX] {
            assert_eq!(unword(&words(x)), x);
        }
    }
}
