//! Collectives on device buffers, with the operations of the CPU
//! `Communicator`, on NCCL: one communicator per group, bootstrapped from the
//! launcher's environment or (`super::links`) over the CPU communicator.
//! Ranks that share a GPU stage through the host instead
//! (`crate::params::HostStaged`).

use super::device::{DeviceBuffer, GpuDevice};
use super::error::{nccl, GpuError, GpuResult};
use super::launch_env::LaunchEnv;
use super::rendezvous::{share_id, ID_BYTES};
use cudarc::nccl::{result as nccl_result, sys as nccl_sys};
use dplc_ir::DType;
use std::ffi::c_void;
use std::sync::Arc;
use std::time::Duration;

/// The collectives a GPU rank uses, on `f32` device buffers (counts are elements).
pub trait DeviceCollectives {
    fn rank(&self) -> usize;
    fn world_size(&self) -> usize;
    /// Sum `buf[..count]` over all ranks, in place.
    fn all_reduce(&mut self, buf: &mut DeviceBuffer, count: usize) -> GpuResult<()>;
    /// Sum `send[..count * world]` over all ranks; keep this rank's part in `recv[..count]`.
    fn reduce_scatter(
        &mut self,
        send: &DeviceBuffer,
        recv: &mut DeviceBuffer,
        count: usize,
    ) -> GpuResult<()>;
    /// Every rank's `send[..count]`, in rank order, into `recv[..count * world]`.
    fn all_gather(
        &mut self,
        send: &DeviceBuffer,
        recv: &mut DeviceBuffer,
        count: usize,
    ) -> GpuResult<()>;
    /// `root`'s `buf[..count]` to every rank.
    fn broadcast(&mut self, root: usize, buf: &mut DeviceBuffer, count: usize) -> GpuResult<()>;
    fn send(&mut self, to: usize, buf: &DeviceBuffer, count: usize) -> GpuResult<()>;
    fn recv(&mut self, from: usize, buf: &mut DeviceBuffer, count: usize) -> GpuResult<()>;
}

fn check(buf: &DeviceBuffer, count: usize, what: &str) -> GpuResult<()> {
    if buf.bytes() < count * 4 {
        return Err(GpuError::Invalid(format!(
            "{what}: a {}-byte buffer for {count} f32 elements",
            buf.bytes()
        )));
    }
    Ok(())
}

/// NCCL's type for floats stored as `dtype`.
fn nccl_type(dtype: DType) -> GpuResult<nccl_sys::ncclDataType_t> {
    use nccl_sys::ncclDataType_t as T;
    match dtype {
        DType::F32 => Ok(T::ncclFloat32),
        DType::BF16 => Ok(T::ncclBfloat16),
        DType::F16 => Ok(T::ncclFloat16),
        d => Err(GpuError::Invalid(format!(
            "no NCCL collective sums values stored as {d:?}"
        ))),
    }
}

fn check_as(buf: &DeviceBuffer, count: usize, dtype: DType, what: &str) -> GpuResult<()> {
    let need = count * dtype.size_bytes() as usize;
    if buf.bytes() < need {
        return Err(GpuError::Invalid(format!(
            "{what}: a {}-byte buffer for {count} {dtype:?} elements",
            buf.bytes()
        )));
    }
    Ok(())
}

/// Whether NCCL's library can be opened.
pub fn nccl_present() -> bool {
    // SAFETY: only tries to dlopen the library by its usual names.
    unsafe { nccl_sys::is_culib_present() }
}

/// An NCCL communicator over all ranks of the run, on one device's stream.
pub struct NcclCommunicator {
    comm: nccl_sys::ncclComm_t,
    dev: Arc<GpuDevice>,
    rank: usize,
    world: usize,
}

// SAFETY: an NCCL communicator may be used from any thread as long as calls on
// it do not overlap; every method takes `&mut self`, so they cannot.
unsafe impl Send for NcclCommunicator {}

impl NcclCommunicator {
    /// A fresh unique id (on rank 0, to hand to the others).
    pub fn unique_id() -> GpuResult<[u8; ID_BYTES]> {
        if !nccl_present() {
            return Err(GpuError::NcclUnavailable(
                "libnccl.so.2 cannot be loaded (pip install nvidia-nccl-cu12, or the system NCCL)"
                    .into(),
            ));
        }
        let id = nccl_result::get_uniqueid().map_err(|e| nccl("ncclGetUniqueId", e))?;
        Ok(id.internal.map(|c| c as u8))
    }

    /// Join the communicator named by `id` as `rank` of `world`.
    pub fn new(
        dev: Arc<GpuDevice>,
        rank: usize,
        world: usize,
        id: [u8; ID_BYTES],
    ) -> GpuResult<Self> {
        if !nccl_present() {
            return Err(GpuError::NcclUnavailable(
                "libnccl.so.2 cannot be loaded".into(),
            ));
        }
        dev.context()
            .bind_to_thread()
            .map_err(|e| super::error::driver("binding the context", e))?;
        let id = nccl_sys::ncclUniqueId {
            internal: id.map(|b| b as std::ffi::c_char),
        };
        let mut comm: nccl_sys::ncclComm_t = std::ptr::null_mut();
        // SAFETY: `comm` is a live out-pointer; the id came from ncclGetUniqueId
        // on rank 0; the device's context is current on this thread.
        unsafe { nccl_result::comm_init_rank(&mut comm, world as i32, id, rank as i32) }
            .map_err(|e| nccl("ncclCommInitRank", e))?;
        Ok(NcclCommunicator {
            comm,
            dev,
            rank,
            world,
        })
    }

    /// Bootstrap from the launcher's environment: the GPU `LOCAL_RANK`, the id
    /// from rank 0 over TCP at MASTER_ADDR:MASTER_PORT.
    pub fn from_env(env: &LaunchEnv, timeout: Duration) -> GpuResult<Self> {
        let dev = Arc::new(GpuDevice::new(env.local_rank)?);
        let mine = if env.rank == 0 {
            Some(Self::unique_id()?)
        } else {
            None
        };
        let id = share_id(
            env.rank,
            env.world_size,
            &env.master_addr,
            env.master_port,
            mine,
            timeout,
        )?;
        NcclCommunicator::new(dev, env.rank, env.world_size, id)
    }

    /// Pieces sent and received as one NCCL group (so that no pair waits
    /// on another's order): each `(rank, buffer, bytes)` of `sends` the
    /// buffer's first bytes to that rank, each of `recvs` as many from it.
    pub fn exchange_bytes(
        &mut self,
        sends: &[(usize, &DeviceBuffer, usize)],
        recvs: &mut [(usize, &mut DeviceBuffer, usize)],
    ) -> GpuResult<()> {
        let sizes = sends
            .iter()
            .map(|(j, b, n)| (*j, b.bytes(), *n))
            .chain(recvs.iter().map(|(j, b, n)| (*j, b.bytes(), *n)));
        for (j, have, n) in sizes {
            if j >= self.world || have < n {
                return Err(GpuError::Invalid(format!(
                    "exchange: {n} bytes of a {have}-byte buffer with rank {j} of {}",
                    self.world
                )));
            }
        }
        let (comm, stream) = (self.comm, self.stream());
        nccl_result::group_start().map_err(|e| nccl("ncclGroupStart", e))?;
        // SAFETY: each buffer holds the bytes moved (checked above) and is
        // used on the communicator's stream.
        let queued = sends
            .iter()
            .try_for_each(|(j, b, n)| unsafe {
                nccl_result::send(
                    b.device_ptr() as *const c_void,
                    *n,
                    BYTES,
                    *j as i32,
                    comm,
                    stream,
                )
                .map(drop)
            })
            .and_then(|()| {
                recvs.iter_mut().try_for_each(|(j, b, n)| unsafe {
                    nccl_result::recv(
                        b.device_ptr() as *mut c_void,
                        *n,
                        BYTES,
                        *j as i32,
                        comm,
                        stream,
                    )
                    .map(drop)
                })
            })
            .map_err(|e| nccl("ncclSend/ncclRecv", e));
        // The group is closed even when a call in it failed.
        let closed = nccl_result::group_end().map_err(|e| nccl("ncclGroupEnd", e));
        queued.and(closed.map(drop))
    }

    /// `send[..count]` summed over all ranks into `recv[..count]`, in
    /// `dtype` (a layout change's values, in their storage type).
    pub fn all_reduce_as(
        &mut self,
        dtype: DType,
        send: &DeviceBuffer,
        recv: &mut DeviceBuffer,
        count: usize,
    ) -> GpuResult<()> {
        let t = nccl_type(dtype)?;
        check_as(send, count, dtype, "all_reduce")?;
        check_as(recv, count, dtype, "all_reduce")?;
        // SAFETY (this and the two below): buffers hold the elements NCCL
        // touches (checked), and are used on the communicator's stream.
        unsafe {
            nccl_result::all_reduce(
                send.device_ptr() as *const c_void,
                recv.device_ptr() as *mut c_void,
                count,
                t,
                SUM,
                self.comm,
                self.stream(),
            )
        }
        .map(drop)
        .map_err(|e| nccl("ncclAllReduce", e))
    }

    /// Every rank's `send[..count]`, in rank order, into
    /// `recv[..count * world]`, in `dtype`.
    pub fn all_gather_as(
        &mut self,
        dtype: DType,
        send: &DeviceBuffer,
        recv: &mut DeviceBuffer,
        count: usize,
    ) -> GpuResult<()> {
        let t = nccl_type(dtype)?;
        check_as(send, count, dtype, "all_gather")?;
        check_as(recv, count * self.world, dtype, "all_gather")?;
        unsafe {
            nccl_result::all_gather(
                send.device_ptr() as *const c_void,
                recv.device_ptr() as *mut c_void,
                count,
                t,
                self.comm,
                self.stream(),
            )
        }
        .map(drop)
        .map_err(|e| nccl("ncclAllGather", e))
    }

    /// `send[..count * world]` summed over all ranks, this rank's part into
    /// `recv[..count]`, in `dtype`.
    pub fn reduce_scatter_as(
        &mut self,
        dtype: DType,
        send: &DeviceBuffer,
        recv: &mut DeviceBuffer,
        count: usize,
    ) -> GpuResult<()> {
        let t = nccl_type(dtype)?;
        check_as(send, count * self.world, dtype, "reduce_scatter")?;
        check_as(recv, count, dtype, "reduce_scatter")?;
        unsafe {
            nccl_result::reduce_scatter(
                send.device_ptr() as *const c_void,
                recv.device_ptr() as *mut c_void,
                count,
                t,
                SUM,
                self.comm,
                self.stream(),
            )
        }
        .map(drop)
        .map_err(|e| nccl("ncclReduceScatter", e))
    }

    pub fn device(&self) -> &Arc<GpuDevice> {
        &self.dev
    }

    fn stream(&self) -> nccl_sys::cudaStream_t {
        self.dev.stream().cu_stream() as nccl_sys::cudaStream_t
    }
}

impl Drop for NcclCommunicator {
    fn drop(&mut self) {
        // SAFETY: `comm` was initialised by ncclCommInitRank and is destroyed once.
        let _ = unsafe { nccl_result::comm_destroy(self.comm) };
    }
}

const F32: nccl_sys::ncclDataType_t = nccl_sys::ncclDataType_t::ncclFloat32;
const BYTES: nccl_sys::ncclDataType_t = nccl_sys::ncclDataType_t::ncclUint8;
const SUM: nccl_sys::ncclRedOp_t = nccl_sys::ncclRedOp_t::ncclSum;

impl DeviceCollectives for NcclCommunicator {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.world
    }

    fn all_reduce(&mut self, buf: &mut DeviceBuffer, count: usize) -> GpuResult<()> {
        check(buf, count, "all_reduce")?;
        let p = buf.device_ptr() as *mut c_void;
        // SAFETY (this and the calls below): buffers hold at least the elements
        // NCCL touches (checked), and are used on the communicator's stream.
        unsafe { nccl_result::all_reduce(p, p, count, F32, SUM, self.comm, self.stream()) }
            .map(drop)
            .map_err(|e| nccl("ncclAllReduce", e))
    }

    fn reduce_scatter(
        &mut self,
        send: &DeviceBuffer,
        recv: &mut DeviceBuffer,
        count: usize,
    ) -> GpuResult<()> {
        self.reduce_scatter_as(DType::F32, send, recv, count)
    }

    fn all_gather(
        &mut self,
        send: &DeviceBuffer,
        recv: &mut DeviceBuffer,
        count: usize,
    ) -> GpuResult<()> {
        self.all_gather_as(DType::F32, send, recv, count)
    }

    fn broadcast(&mut self, root: usize, buf: &mut DeviceBuffer, count: usize) -> GpuResult<()> {
        check(buf, count, "broadcast")?;
        let p = buf.device_ptr() as *mut c_void;
        unsafe { nccl_result::broadcast(p, p, count, F32, root as i32, self.comm, self.stream()) }
            .map(drop)
            .map_err(|e| nccl("ncclBroadcast", e))
    }

    fn send(&mut self, to: usize, buf: &DeviceBuffer, count: usize) -> GpuResult<()> {
        check(buf, count, "send")?;
        unsafe {
            nccl_result::send(
                buf.device_ptr() as *const c_void,
                count,
                F32,
                to as i32,
                self.comm,
                self.stream(),
            )
        }
        .map(drop)
        .map_err(|e| nccl("ncclSend", e))
    }

    fn recv(&mut self, from: usize, buf: &mut DeviceBuffer, count: usize) -> GpuResult<()> {
        check(buf, count, "recv")?;
        unsafe {
            nccl_result::recv(
                buf.device_ptr() as *mut c_void,
                count,
                F32,
                from as i32,
                self.comm,
                self.stream(),
            )
        }
        .map(drop)
        .map_err(|e| nccl("ncclRecv", e))
    }
}
