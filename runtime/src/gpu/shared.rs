//! Links for ranks that share one GPU in one process (rank threads over
//! fewer GPUs, as the GPU check's tp=2 and pp=2 runs are): a layout
//! change's pieces move device to device. The ranks' backends queue all
//! work on the device's one stream, so a copy queued after another rank
//! queued the kernel that wrote its source reads what that kernel wrote.
//!
//! Each member tells each other member, over the CPU communicator, the
//! address and length of the piece for it; each copies the pieces meant
//! for it into buffers of its own; then the group meets once more, so that
//! no piece is freed (and its memory reused) before every copy of it is
//! queued. The store's gradient sums and gathers still go through the host
//! ([`HostStaged`]): they run once a step, where the layout changes run
//! several times a layer.

use super::backend::CudaBackend;
use crate::comm::{Communicator, Group};
use crate::error::{kernel_err, Result};
use crate::fused::{Backend, Val};
use crate::params::{all_to_all_host, DeviceBuf, HostStaged, Links, Pieces};
use dplc_codegen::Elem;

/// Device-to-device pieces within a GPU's ranks, the rest through the host.
pub(crate) struct SharedDevice {
    /// Devices the run's ranks are dealt over (rank `r` has `r % gpus`).
    gpus: usize,
    host: HostStaged,
}

impl SharedDevice {
    pub fn new(gpus: usize) -> Self {
        SharedDevice {
            gpus: gpus.max(1),
            host: HostStaged,
        }
    }

    fn one_device(&self, group: &Group) -> bool {
        let mut devices = group.ranks().iter().map(|r| r % self.gpus);
        let first = devices.next();
        devices.all(|d| Some(d) == first)
    }
}

/// A 64-bit address or count as four exact floats (16 bits each), and
/// back: the CPU communicator carries `f32`s.
fn words(x: u64) -> [f32; 4] {
    [0, 16, 32, 48].map(|s| ((x >> s) & 0xffff) as f32)
}

fn unword(w: &[f32]) -> u64 {
    w.iter()
        .zip([0, 16, 32, 48])
        .map(|(&x, s)| (x as u64) << s)
        .fold(0, |a, b| a | b)
}

impl Links<CudaBackend> for SharedDevice {
    fn all_reduce(
        &mut self,
        be: &mut CudaBackend,
        comm: &mut Communicator,
        group: &Group,
        vs: &mut [&mut DeviceBuf<CudaBackend>],
    ) -> Result<()> {
        self.host.all_reduce(be, comm, group, vs)
    }

    fn reduce_scatter(
        &mut self,
        be: &mut CudaBackend,
        comm: &mut Communicator,
        group: &Group,
        vs: &[Pieces<'_, DeviceBuf<CudaBackend>>],
    ) -> Result<Vec<DeviceBuf<CudaBackend>>> {
        self.host.reduce_scatter(be, comm, group, vs)
    }

    fn all_gather(
        &mut self,
        be: &mut CudaBackend,
        comm: &mut Communicator,
        group: &Group,
        vs: &[Pieces<'_, DeviceBuf<CudaBackend>>],
    ) -> Result<Vec<DeviceBuf<CudaBackend>>> {
        self.host.all_gather(be, comm, group, vs)
    }

    fn all_to_all(
        &mut self,
        be: &mut CudaBackend,
        comm: &mut Communicator,
        group: &Group,
        pieces: Vec<Val<CudaBackend>>,
    ) -> Result<Vec<Val<CudaBackend>>> {
        if !self.one_device(group) {
            return all_to_all_host(be, comm, group, pieces);
        }
        let members = group.size();
        let pos = group
            .position(comm.rank())
            .ok_or_else(|| kernel_err("exchange", "a group without this rank"))?;
        if pieces.len() != members {
            return Err(kernel_err(
                "exchange",
                format!("{} pieces for a group of {members}", pieces.len()),
            ));
        }
        let mine = pieces[pos].clone();
        let width = match mine.elem {
            Elem::Float => be.dtype().size_bytes() as usize,
            Elem::F32 | Elem::I32 => 4,
        };
        let notes: Vec<Vec<f32>> = pieces
            .iter()
            .map(|p| {
                let mut w = words(p.buf.device_ptr()).to_vec();
                w.extend(words(p.len as u64));
                w
            })
            .collect();
        let heard = comm.all_to_all(group, notes)?;
        let mut got = Vec::with_capacity(members);
        for (j, note) in heard.iter().enumerate() {
            if j == pos {
                got.push(mine.clone());
                continue;
            }
            let (address, len) = match note.as_slice() {
                [a @ .., _, _, _, _] if a.len() == 4 => (unword(a), unword(&note[4..]) as usize),
                _ => return Err(kernel_err("exchange", "a piece's note is malformed")),
            };
            if len != mine.len {
                return Err(kernel_err(
                    "exchange",
                    format!(
                        "a piece of {len} elements where this rank's has {}",
                        mine.len
                    ),
                ));
            }
            let buf = be.alloc(mine.elem, len)?;
            if len > 0 {
                // SAFETY: member j holds the piece (in `pieces`) until the
                // group meets again below, after every copy is queued; it
                // queued the piece's writes on this device's one stream
                // before sending its address.
                unsafe { be.device().copy_from_address(address, &buf, len * width) }?;
            }
            got.push(Val {
                buf,
                elem: mine.elem,
                len,
            });
        }
        comm.all_to_all(group, vec![Vec::new(); members])?;
        drop(pieces);
        Ok(got)
    }
}
