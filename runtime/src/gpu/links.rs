//! NCCL as the store's links ([`Links`]) when every rank has a GPU of its
//! own: the gradient sums, reduce-scatters and all-gathers run on the
//! device buffers the state lives in, nothing staged through the host.
//!
//! NCCL needs a communicator per group. One is made the first time a group
//! meets (every member reaches the same collective, so they make it
//! together): its first member draws NCCL's id and hands it to the others
//! over the CPU communicator, which already joins every rank of the run
//! (threads, MPI or TCP).
//!
//! NCCL moves equal counts per member, so several vectors travel packed:
//! each member's segment holds its range of every vector, padded to the
//! longest such range (`split`'s ranges differ by at most one element).

use super::backend::CudaBackend;
use super::comm::{DeviceCollectives, NcclCommunicator};
use super::device::{DeviceBuffer, GpuDevice};
use super::rendezvous::ID_BYTES;
use crate::comm::{Communicator, Group};
use crate::error::{kernel_err, Result};
use crate::fused::{Backend, Val};
use crate::params::{all_to_all_position, DeviceBuf, Links, Pieces};
use dplc_codegen::Elem;
use dplc_ir::DType;
use std::collections::HashMap;
use std::sync::Arc;

/// One NCCL communicator per group this rank has met in.
pub(crate) struct NcclLinks {
    dev: Arc<GpuDevice>,
    comms: HashMap<Vec<usize>, NcclCommunicator>,
}

impl NcclLinks {
    pub fn new(dev: Arc<GpuDevice>) -> Self {
        NcclLinks {
            dev,
            comms: HashMap::new(),
        }
    }

    /// `group`'s communicator, made on first use.
    fn comm(&mut self, cpu: &mut Communicator, group: &Group) -> Result<&mut NcclCommunicator> {
        let key = group.ranks().to_vec();
        if !self.comms.contains_key(&key) {
            let pos = group
                .position(cpu.rank())
                .ok_or_else(|| kernel_err("nccl", "a collective over a group without this rank"))?;
            // The id's bytes travel as floats, each exact.
            let mut id: Vec<f32> = if pos == 0 {
                NcclCommunicator::unique_id()?
                    .iter()
                    .map(|&b| f32::from(b))
                    .collect()
            } else {
                Vec::new()
            };
            cpu.broadcast(group, 0, &mut id)?;
            let bytes: [u8; ID_BYTES] = id
                .iter()
                .map(|&b| b as u8)
                .collect::<Vec<u8>>()
                .try_into()
                .map_err(|_| kernel_err("nccl", "a short NCCL id"))?;
            let nccl = NcclCommunicator::new(self.dev.clone(), pos, group.size(), bytes)?;
            self.comms.insert(key.clone(), nccl);
        }
        Ok(self.comms.get_mut(&key).expect("made above"))
    }
}

/// Each vector's offset in a member's segment, and the segment's length.
fn segment<V>(vs: &[Pieces<'_, V>]) -> (Vec<usize>, usize) {
    let mut offsets = Vec::with_capacity(vs.len());
    let mut seg = 0;
    for (_, shards) in vs {
        offsets.push(seg);
        seg += shards.iter().map(|r| r.len()).max().unwrap_or(0);
    }
    (offsets, seg)
}

/// A buffer NCCL writes through `&mut`: one this call made and holds alone.
fn unique(b: &mut Arc<DeviceBuffer>) -> Result<&mut DeviceBuffer> {
    Arc::get_mut(b).ok_or_else(|| kernel_err("nccl", "a buffer NCCL writes is shared"))
}

/// `len` elements of `src` from `at`, as a vector of their own.
fn cut(
    be: &mut CudaBackend,
    src: &Arc<DeviceBuffer>,
    at: usize,
    len: usize,
) -> Result<DeviceBuf<CudaBackend>> {
    if len == 0 {
        return Ok(DeviceBuf::default());
    }
    let out = be.alloc(Elem::F32, len)?;
    be.copy(src, at, &out, 0, len)?;
    Ok(DeviceBuf {
        buf: Some(out),
        len,
    })
}

impl Links<CudaBackend> for NcclLinks {
    fn all_reduce(
        &mut self,
        be: &mut CudaBackend,
        comm: &mut Communicator,
        group: &Group,
        vs: &mut [&mut DeviceBuf<CudaBackend>],
    ) -> Result<()> {
        let total: usize = vs.iter().map(|v| v.len).sum();
        if group.size() == 1 || total == 0 {
            return Ok(());
        }
        let mut flat = be.alloc(Elem::F32, total)?;
        let mut at = 0;
        for v in vs.iter() {
            if v.len > 0 {
                be.copy(v.get()?, 0, &flat, at, v.len)?;
            }
            at += v.len;
        }
        self.comm(comm, group)?
            .all_reduce(unique(&mut flat)?, total)?;
        let mut at = 0;
        for v in vs.iter_mut() {
            **v = cut(be, &flat, at, v.len)?;
            at += v.len;
        }
        Ok(())
    }

    fn reduce_scatter(
        &mut self,
        be: &mut CudaBackend,
        comm: &mut Communicator,
        group: &Group,
        vs: &[Pieces<'_, DeviceBuf<CudaBackend>>],
    ) -> Result<Vec<DeviceBuf<CudaBackend>>> {
        let members = group.size();
        let pos = group.position(comm.rank()).unwrap_or(0);
        let (offsets, seg) = segment(vs);
        // Zeros: the padding sums to nothing.
        let send = be.zeros(Elem::F32, seg * members)?;
        for ((v, shards), &off) in vs.iter().zip(&offsets) {
            for (p, r) in shards.iter().enumerate() {
                if !r.is_empty() {
                    be.copy(v.get()?, r.start, &send, p * seg + off, r.len())?;
                }
            }
        }
        let recv = if members > 1 && seg > 0 {
            let mut recv = be.alloc(Elem::F32, seg)?;
            self.comm(comm, group)?
                .reduce_scatter(&send, unique(&mut recv)?, seg)?;
            recv
        } else {
            send
        };
        vs.iter()
            .zip(&offsets)
            .map(|((_, shards), &off)| {
                let n = shards.get(pos).map_or(0, |r| r.len());
                cut(be, &recv, off, n)
            })
            .collect()
    }

    fn all_gather(
        &mut self,
        be: &mut CudaBackend,
        comm: &mut Communicator,
        group: &Group,
        vs: &[Pieces<'_, DeviceBuf<CudaBackend>>],
    ) -> Result<Vec<DeviceBuf<CudaBackend>>> {
        let members = group.size();
        let (offsets, seg) = segment(vs);
        let send = be.zeros(Elem::F32, seg)?;
        for ((v, _), &off) in vs.iter().zip(&offsets) {
            if v.len > 0 {
                be.copy(v.get()?, 0, &send, off, v.len)?;
            }
        }
        let recv = if members > 1 && seg > 0 {
            let mut recv = be.alloc(Elem::F32, seg * members)?;
            self.comm(comm, group)?
                .all_gather(&send, unique(&mut recv)?, seg)?;
            recv
        } else {
            send
        };
        vs.iter()
            .zip(&offsets)
            .map(|((_, shards), &off)| {
                let len: usize = shards.iter().map(|r| r.len()).sum();
                if len == 0 {
                    return Ok(DeviceBuf::default());
                }
                let out = be.alloc(Elem::F32, len)?;
                let mut at = 0;
                for (p, r) in shards.iter().enumerate() {
                    if !r.is_empty() {
                        be.copy(&recv, p * seg + off, &out, at, r.len())?;
                    }
                    at += r.len();
                }
                Ok(DeviceBuf {
                    buf: Some(out),
                    len,
                })
            })
            .collect()
    }

    fn all_to_all(
        &mut self,
        be: &mut CudaBackend,
        comm: &mut Communicator,
        group: &Group,
        pieces: Vec<Val<CudaBackend>>,
    ) -> Result<Vec<Val<CudaBackend>>> {
        let members = group.size();
        let pos = all_to_all_position(comm, group, &pieces)?;
        let mine = pieces[pos].clone();
        if members == 1 || mine.len == 0 {
            return Ok(vec![mine; members]);
        }
        let float = be.dtype().size_bytes() as usize;
        let width = |elem: Elem| match elem {
            Elem::Float => float,
            Elem::F32 | Elem::I32 => 4,
        };
        let bytes = mine.len * width(mine.elem);
        let mut got: Vec<Val<CudaBackend>> = Vec::with_capacity(members);
        for j in 0..members {
            got.push(if j == pos {
                mine.clone()
            } else {
                Val {
                    buf: be.alloc(mine.elem, mine.len)?,
                    elem: mine.elem,
                    len: mine.len,
                }
            });
        }
        let sends: Vec<(usize, &DeviceBuffer, usize)> = pieces
            .iter()
            .enumerate()
            .filter(|&(j, _)| j != pos)
            .map(|(j, p)| (j, &*p.buf, p.len * width(p.elem)))
            .collect();
        let mut recvs = Vec::with_capacity(members - 1);
        for (j, v) in got.iter_mut().enumerate() {
            if j != pos {
                recvs.push((j, unique(&mut v.buf)?, bytes));
            }
        }
        self.comm(comm, group)?.exchange_bytes(&sends, &mut recvs)?;
        Ok(got)
    }

    fn sum_value(
        &mut self,
        be: &mut CudaBackend,
        comm: &mut Communicator,
        group: &Group,
        v: &Val<CudaBackend>,
    ) -> Result<Option<Val<CudaBackend>>> {
        let Some(dtype) = wire(be, v.elem) else {
            return Ok(None);
        };
        if group.size() == 1 || v.len == 0 {
            return Ok(Some(v.clone()));
        }
        let mut out = be.alloc(v.elem, v.len)?;
        self.comm(comm, group)?
            .all_reduce_as(dtype, &v.buf, unique(&mut out)?, v.len)?;
        Ok(Some(Val {
            buf: out,
            elem: v.elem,
            len: v.len,
        }))
    }

    fn gather_value(
        &mut self,
        be: &mut CudaBackend,
        comm: &mut Communicator,
        group: &Group,
        v: &Val<CudaBackend>,
    ) -> Result<Option<Vec<Val<CudaBackend>>>> {
        let Some(dtype) = wire(be, v.elem) else {
            return Ok(None);
        };
        let members = group.size();
        if members == 1 || v.len == 0 {
            return Ok(Some(vec![v.clone(); members]));
        }
        let mut all = be.alloc(v.elem, v.len * members)?;
        self.comm(comm, group)?
            .all_gather_as(dtype, &v.buf, unique(&mut all)?, v.len)?;
        // Each member's part as a value of its own.
        (0..members)
            .map(|j| {
                let part = be.alloc(v.elem, v.len)?;
                be.copy_rows(
                    v.elem,
                    (&all, j * v.len, v.len),
                    (&part, 0, v.len),
                    1,
                    v.len,
                )?;
                Ok(Val {
                    buf: part,
                    elem: v.elem,
                    len: v.len,
                })
            })
            .collect::<Result<_>>()
            .map(Some)
    }

    fn scatter_sum(
        &mut self,
        be: &mut CudaBackend,
        comm: &mut Communicator,
        group: &Group,
        pieces: &[Val<CudaBackend>],
    ) -> Result<Option<Val<CudaBackend>>> {
        let pos = all_to_all_position(comm, group, pieces)?;
        let mine = &pieces[pos];
        let (elem, len) = (mine.elem, mine.len);
        let Some(dtype) = wire(be, elem) else {
            return Ok(None);
        };
        if pieces.iter().any(|p| p.len != len || p.elem != elem) {
            return Ok(None);
        }
        let members = group.size();
        if members == 1 || len == 0 {
            return Ok(Some(mine.clone()));
        }
        // The pieces side by side, member order, as NCCL scatters them.
        let packed = be.alloc(elem, len * members)?;
        for (j, p) in pieces.iter().enumerate() {
            be.copy_rows(elem, (&p.buf, 0, len), (&packed, j * len, len), 1, len)?;
        }
        let mut out = be.alloc(elem, len)?;
        self.comm(comm, group)?
            .reduce_scatter_as(dtype, &packed, unique(&mut out)?, len)?;
        Ok(Some(Val {
            buf: out,
            elem,
            len,
        }))
    }
}

/// The type a value of `elem` travels in through NCCL's collectives: its
/// storage type (`None` for indices, which are not summed).
fn wire(be: &CudaBackend, elem: Elem) -> Option<DType> {
    match elem {
        Elem::Float => Some(be.dtype()),
        Elem::F32 => Some(DType::F32),
        Elem::I32 => None,
    }
}
