//! Links for ranks that share one device in one process — rank threads
//! dealt over fewer GPUs (as the GPU check's tp=2 and pp=2 runs are), or
//! CPU ranks, whose device is the host's memory: a layout change's pieces,
//! a pipeline hop's values and the store's vectors are handed from rank to
//! rank without leaving the device, or even being copied.
//!
//! The giver leaves each buffer with the device under a token
//! ([`HandOver`]: `crate::gpu::GpuDevice::hand_over` on a GPU, a
//! [`crate::fused::Shelf`] on the host) and sends the token over the CPU
//! communicator; the taker takes the buffer by it. The ranks' backends
//! queue all their work on the device's one stream (on the host, every
//! call is done when it returns), so what the giver queued before handing
//! over (the kernel that wrote the value) is done before anything the taker
//! queues after.
//!
//! The executor writes a value in place only where it holds the only
//! handle (`Backend::unique`), so giver and taker may both read a handed
//! buffer; a parameter's compute copy, which a layout change may hand over
//! whole (an all-gather's own piece), is rewritten only by the optimizer
//! step, after the step's world-wide norm all-reduce, which a taker reaches
//! only once its reads (queued in the same conversion) are. The store's
//! sums take every member's vectors so and add them from zero in group
//! order (`sum_parts_kernel`: the host storage's bits); the store writes
//! its vectors in place (the optimizer, the accumulators), so its
//! collectives end with the group meeting once more, after every member has
//! queued its reads of the others' vectors ([`settle`]).
//!
//! A group goes through the host ([`HostStaged`]) where its members do not
//! all hold device storage on one device: ranks on several GPUs, or a
//! dedicated parameter server (its state on the host).

use super::{all_to_all_host, all_to_all_position, recv_host, send_host, slice_of};
use super::{DeviceBuf, HostStaged, Links, Pieces};
use crate::comm::{Communicator, Group};
use crate::error::{kernel_err, Result};
use crate::fused::relayout::LayoutKernels;
use crate::fused::{flat_args, Backend, HostBackend, Val};
use crate::tensor::Tensor;
use dplc_codegen::Elem;

/// A backend whose buffers rank threads of one process hand each other:
/// a GPU's, shared by the ranks dealt to it (whose work queues on its one
/// stream, in the order the threads queue it), or the host's.
pub(crate) trait HandOver: Backend {
    /// Leave `buf` for another rank's thread to take by the token.
    fn hand_over(&self, buf: Self::Buf) -> u64;
    /// The buffer left under `token`, once.
    fn take_over(&self, token: u64) -> Result<Self::Buf>;
}

impl HandOver for HostBackend {
    fn hand_over(&self, buf: Self::Buf) -> u64 {
        self.shelf().hand_over(buf)
    }

    fn take_over(&self, token: u64) -> Result<Self::Buf> {
        self.shelf().take_over(token)
    }
}

/// Handed over within a GPU's ranks, the rest through the host.
pub(crate) struct SharedDevice {
    /// Devices the run's ranks are dealt over (rank `r` has `r % gpus`).
    gpus: usize,
    /// The ranks below this hold device storage; those above are dedicated
    /// parameter servers, on the host.
    sharing: usize,
    host: HostStaged,
    /// The group-order sums, built once.
    kernels: LayoutKernels,
}

impl SharedDevice {
    /// Links of a run whose ranks below `sharing` hold device storage (the
    /// rest are dedicated parameter servers, whose state is on the host),
    /// dealt over `gpus` devices.
    pub fn new(gpus: usize, sharing: usize) -> Self {
        SharedDevice {
            gpus: gpus.max(1),
            sharing,
            host: HostStaged,
            kernels: LayoutKernels::new(),
        }
    }

    /// Every member's `mine` (each member's list as long), in group order:
    /// each member hands each other member its buffers.
    fn everyones<B: HandOver>(
        &self,
        be: &B,
        comm: &mut Communicator,
        group: &Group,
        mine: &[&DeviceBuf<B>],
    ) -> Result<Vec<Vec<DeviceBuf<B>>>> {
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
                        Some(b) if j != pos => be.hand_over(b.clone()),
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
                            Some(be.take_over(token)?)
                        };
                        Ok(DeviceBuf { buf, len })
                    })
                    .collect()
            })
            .collect()
    }

    /// `parts` (each `len` `f32`s) added from zero in group order.
    fn sum<B: HandOver>(
        &mut self,
        be: &mut B,
        parts: &[&DeviceBuf<B>],
        len: usize,
    ) -> Result<DeviceBuf<B>> {
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

    /// Whether `ranks` all hold device storage on one device: else their
    /// exchange goes through the host, as every member's does (a
    /// dedicated server sums on the host; ranks on another GPU cannot take
    /// this one's buffers).
    fn one_device(&self, ranks: &[usize]) -> bool {
        let mut devices = ranks
            .iter()
            .map(|&r| (r < self.sharing).then_some(r % self.gpus));
        let first = devices.next().flatten();
        first.is_some() && devices.all(|d| d == first)
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
fn note<B: Backend>(v: &Val<B>, token: u64) -> Vec<f32> {
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
fn take<B: HandOver>(be: &B, note: &[f32]) -> Result<Val<B>> {
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
        buf: be.take_over(unword(&note[5..9]))?,
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

impl<B: HandOver> Links<B> for SharedDevice {
    fn all_reduce(
        &mut self,
        be: &mut B,
        comm: &mut Communicator,
        group: &Group,
        vs: &mut [&mut DeviceBuf<B>],
    ) -> Result<()> {
        if !self.one_device(group.ranks()) {
            return self.host.all_reduce(be, comm, group, vs);
        }
        let mine: Vec<&DeviceBuf<B>> = vs.iter().map(|v| &**v).collect();
        let all = self.everyones(be, comm, group, &mine)?;
        for (i, v) in vs.iter_mut().enumerate() {
            let parts: Vec<&DeviceBuf<B>> = all.iter().map(|m| &m[i]).collect();
            let len = v.len;
            **v = self.sum(be, &parts, len)?;
        }
        settle(comm, group)
    }

    fn reduce_scatter(
        &mut self,
        be: &mut B,
        comm: &mut Communicator,
        group: &Group,
        vs: &[Pieces<'_, DeviceBuf<B>>],
    ) -> Result<Vec<DeviceBuf<B>>> {
        if !self.one_device(group.ranks()) {
            return self.host.reduce_scatter(be, comm, group, vs);
        }
        let pos = group.position(comm.rank()).unwrap_or(0);
        let mine: Vec<&DeviceBuf<B>> = vs.iter().map(|(v, _)| *v).collect();
        let all = self.everyones(be, comm, group, &mine)?;
        let mine = vs
            .iter()
            .enumerate()
            .map(|(i, (_, shards))| {
                let at = shards.get(pos).cloned().unwrap_or(0..0);
                let parts = all
                    .iter()
                    .map(|m| slice_of(be, &m[i], at.clone()))
                    .collect::<Result<Vec<_>>>()?;
                let parts: Vec<&DeviceBuf<B>> = parts.iter().collect();
                self.sum(be, &parts, at.len())
            })
            .collect::<Result<Vec<_>>>()?;
        settle(comm, group)?;
        Ok(mine)
    }

    fn all_gather(
        &mut self,
        be: &mut B,
        comm: &mut Communicator,
        group: &Group,
        vs: &[Pieces<'_, DeviceBuf<B>>],
    ) -> Result<Vec<DeviceBuf<B>>> {
        if !self.one_device(group.ranks()) {
            return self.host.all_gather(be, comm, group, vs);
        }
        let mine: Vec<&DeviceBuf<B>> = vs.iter().map(|(v, _)| *v).collect();
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
        be: &mut B,
        comm: &mut Communicator,
        group: &Group,
        pieces: Vec<Val<B>>,
    ) -> Result<Vec<Val<B>>> {
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
                    be.hand_over(p.buf.clone())
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
        be: &mut B,
        comm: &mut Communicator,
        (to, tag): (usize, u64),
        vals: Vec<Option<Val<B>>>,
    ) -> Result<()> {
        if !self.one_device(&[comm.rank(), to]) {
            return send_host(be, comm, (to, tag), &vals);
        }
        let msg = vals
            .iter()
            .map(|v| {
                v.as_ref().map(|v| {
                    let n = note(v, be.hand_over(v.buf.clone()));
                    Tensor::f32(vec![n.len()], n)
                })
            })
            .collect();
        comm.send(to, tag, msg)
    }

    fn recv(
        &mut self,
        be: &mut B,
        comm: &mut Communicator,
        (from, tag): (usize, u64),
    ) -> Result<Vec<Option<Val<B>>>> {
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

/// The hand-over protocol on CPU threads, whose host backends share a
/// shelf: its sums, gathers, all-to-alls and hops against the host-staged
/// links'.
#[cfg(test)]
mod threads {
    use super::*;
    use crate::comm::World;
    use crate::fused::Shelf;
    use std::time::Duration;

    fn vector(be: &mut HostBackend, v: &[f32]) -> DeviceBuf<HostBackend> {
        DeviceBuf {
            buf: Some(be.upload(Elem::F32, v).unwrap()),
            len: v.len(),
        }
    }

    fn read(be: &mut HostBackend, v: &DeviceBuf<HostBackend>) -> Vec<f32> {
        v.buf
            .as_ref()
            .map(|b| be.download(b, Elem::F32, v.len).unwrap())
            .unwrap_or_default()
    }

    fn floats(be: &mut HostBackend, v: &Val<HostBackend>) -> Vec<f32> {
        be.download(&v.buf, v.elem, v.len).unwrap()
    }

    /// On three ranks of one device: the store's all-reduce, reduce-scatter
    /// and all-gather, a layout change's all-to-all and a pipeline hop give
    /// what the host-staged links give (the reference's bits), and nothing
    /// is left on the shelf.
    #[test]
    fn handed_over_collectives_equal_the_host_staged_ones() {
        let n = 3;
        let world = World::new(n, Duration::from_secs(10));
        let shelf = Shelf::default();
        std::thread::scope(|s| {
            let ranks: Vec<_> = (0..n)
                .map(|r| {
                    let mut comm = world.communicator(r);
                    let shelf = shelf.clone();
                    s.spawn(move || {
                        let group = Group::new((0..n).collect());
                        let mut be = HostBackend::new().sharing(shelf);
                        let mut links = SharedDevice::new(1, n);
                        let mut host = HostStaged;
                        let mine: Vec<f32> = (0..10)
                            .map(|i| (i * 7 + r * 13) as f32 * 0.1 - 1.0)
                            .collect();
                        let other: Vec<f32> = (0..4).map(|i| (i + r) as f32 * 0.25).collect();

                        // All-reduce of two vectors at once.
                        let (mut a, mut b) = (vector(&mut be, &mine), vector(&mut be, &other));
                        links
                            .all_reduce(&mut be, &mut comm, &group, &mut [&mut a, &mut b])
                            .unwrap();
                        let (mut ha, mut hb) = (vector(&mut be, &mine), vector(&mut be, &other));
                        host.all_reduce(&mut be, &mut comm, &group, &mut [&mut ha, &mut hb])
                            .unwrap();
                        assert_eq!(read(&mut be, &a), read(&mut be, &ha), "rank {r}");
                        assert_eq!(read(&mut be, &b), read(&mut be, &hb), "rank {r}");

                        // Reduce-scatter and all-gather over uneven shards.
                        let shards = [0..4, 4..7, 7..10];
                        let v = vector(&mut be, &mine);
                        let got = links
                            .reduce_scatter(&mut be, &mut comm, &group, &[(&v, &shards)])
                            .unwrap();
                        let want = host
                            .reduce_scatter(&mut be, &mut comm, &group, &[(&v, &shards)])
                            .unwrap();
                        assert_eq!(read(&mut be, &got[0]), read(&mut be, &want[0]), "rank {r}");
                        let part = vector(&mut be, &mine[shards[r].clone()]);
                        let got = links
                            .all_gather(&mut be, &mut comm, &group, &[(&part, &shards)])
                            .unwrap();
                        let want = host
                            .all_gather(&mut be, &mut comm, &group, &[(&part, &shards)])
                            .unwrap();
                        assert_eq!(read(&mut be, &got[0]), read(&mut be, &want[0]), "rank {r}");

                        // A layout change's pieces, one for each member.
                        let pieces = |be: &mut HostBackend| -> Vec<Val<HostBackend>> {
                            (0..n)
                                .map(|j| Val {
                                    buf: be.upload(Elem::Float, &[(r * 10 + j) as f32; 2]).unwrap(),
                                    elem: Elem::Float,
                                    len: 2,
                                })
                                .collect()
                        };
                        let p = pieces(&mut be);
                        let got = links.all_to_all(&mut be, &mut comm, &group, p).unwrap();
                        let p = pieces(&mut be);
                        let want = all_to_all_host(&mut be, &mut comm, &group, p).unwrap();
                        for (g, w) in got.iter().zip(&want) {
                            assert_eq!(floats(&mut be, g), floats(&mut be, w), "rank {r}");
                        }

                        // A hop from each rank to the next.
                        let hop = vec![
                            Some(Val {
                                buf: be.upload(Elem::Float, &mine).unwrap(),
                                elem: Elem::Float,
                                len: mine.len(),
                            }),
                            None,
                        ];
                        links
                            .send(&mut be, &mut comm, ((r + 1) % n, 7), hop)
                            .unwrap();
                        let got = links
                            .recv(&mut be, &mut comm, ((r + n - 1) % n, 7))
                            .unwrap();
                        let from: Vec<f32> = (0..10)
                            .map(|i| (i * 7 + ((r + n - 1) % n) * 13) as f32 * 0.1 - 1.0)
                            .collect();
                        assert_eq!(got.len(), 2);
                        assert_eq!(floats(&mut be, got[0].as_ref().unwrap()), from, "rank {r}");
                        assert!(got[1].is_none());
                    })
                })
                .collect();
            for h in ranks {
                h.join().expect("a rank");
            }
        });
        assert!(shelf.is_empty(), "buffers left on the shelf");
    }
}
