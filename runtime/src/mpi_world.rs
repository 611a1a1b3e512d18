//! CPU ranks in separate processes: `MpiProcess` (one rank per process, started
//! by mpirun) and the transport that carries the communicator's envelopes over
//! MPI point-to-point messages, with the wire format of those envelopes.
//!
//! Built only with the `mpi` feature (its build needs Open MPI's headers and
//! libclang, `scripts/install-mpi.sh`); without it `MpiProcess::init` says so.

use crate::comm::{Envelope, Message};
use crate::error::{Result, RuntimeError};
use crate::tensor::{Data, Tensor};

/// One process's place in an MPI job.
pub struct MpiProcess {
    #[cfg(feature = "mpi")]
    universe: mpi::environment::Universe,
    rank: usize,
    size: usize,
}

impl std::fmt::Debug for MpiProcess {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "MpiProcess {{ rank: {}, size: {} }}",
            self.rank, self.size
        )
    }
}

impl MpiProcess {
    pub fn rank(&self) -> usize {
        self.rank
    }

    pub fn size(&self) -> usize {
        self.size
    }
}

#[cfg(not(feature = "mpi"))]
impl MpiProcess {
    /// Without the `mpi` feature there is no MPI to join.
    pub fn init() -> Result<MpiProcess> {
        Err(RuntimeError::Unsupported(
            "this dplc was built without MPI, so CPU ranks cannot run in separate processes \
             (rebuild with `--features dplc-runtime/mpi` after scripts/install-mpi.sh)"
                .into(),
        ))
    }

    pub fn abort(&self, code: i32) -> ! {
        std::process::exit(code)
    }

    pub fn fingerprints(&self, fingerprint: u64) -> Vec<u64> {
        vec![fingerprint]
    }

    pub(crate) fn transport(&self) -> Box<dyn crate::comm::Transport> {
        unreachable!("an MpiProcess exists only with the mpi feature")
    }
}

#[cfg(feature = "mpi")]
mod with_mpi {
    use super::*;
    use crate::comm::Transport;
    use mpi::point_to_point::{Destination, MatchedReceiveVec, Source};
    use mpi::request::{Request, StaticScope};
    use mpi::topology::{Communicator, SimpleCommunicator};
    use mpi::Threading;

    /// Every envelope travels under this one tag: MPI keeps the messages
    /// between two processes in order, which is the order the sender posted.
    const TAG: mpi::Tag = 7;

    impl MpiProcess {
        /// Join the job mpirun started (MPI_Init). The rank thread makes every
        /// MPI call, serialised by the world's lock.
        pub fn init() -> Result<MpiProcess> {
            let (universe, _) = mpi::initialize_with_threading(Threading::Serialized)
                .ok_or_else(|| RuntimeError::Config("MPI was already initialised".into()))?;
            let world = universe.world();
            Ok(MpiProcess {
                rank: world.rank() as usize,
                size: world.size() as usize,
                universe,
            })
        }

        /// End every process of the job (MPI_Abort): a failed rank must not
        /// leave peers blocked in MPI_Finalize.
        pub fn abort(&self, code: i32) -> ! {
            self.universe.world().abort(code)
        }

        /// Each process's `fingerprint`, in rank order (MPI_Allgather),
        /// before any rank starts: what the processes of one job must share.
        pub fn fingerprints(&self, fingerprint: u64) -> Vec<u64> {
            use mpi::collective::CommunicatorCollectives;
            let world = self.universe.world();
            let mut all = vec![0u64; self.size];
            world.all_gather_into(&fingerprint, &mut all[..]);
            all
        }

        pub(crate) fn transport(&self) -> Box<dyn Transport> {
            Box::new(MpiTransport {
                world: self.universe.world(),
                pending: Vec::new(),
            })
        }
    }

    /// A send in flight and the buffer it reads, freed once MPI is done with it.
    struct Pending {
        request: Request<'static, [u8], StaticScope>,
        buffer: *mut [u8],
    }

    struct MpiTransport {
        world: SimpleCommunicator,
        pending: Vec<Pending>,
    }

    // SAFETY: MPI was initialised with MPI_THREAD_SERIALIZED and the transport
    // lives inside the world's mutex, so one thread at a time calls MPI through
    // it; the raw buffers are owned by the transport alone.
    unsafe impl Send for MpiTransport {}

    impl MpiTransport {
        /// Free the buffers of sends that completed.
        fn reap(&mut self) {
            let mut still = Vec::with_capacity(self.pending.len());
            for p in self.pending.drain(..) {
                match p.request.test() {
                    Ok(_) => {
                        // SAFETY: `buffer` came from Box::into_raw in `post`,
                        // and the send that read it has completed.
                        drop(unsafe { Box::from_raw(p.buffer) });
                    }
                    Err(request) => still.push(Pending {
                        request,
                        buffer: p.buffer,
                    }),
                }
            }
            self.pending = still;
        }
    }

    impl Transport for MpiTransport {
        fn post(&mut self, to: usize, envelope: &Envelope) -> Result<()> {
            let bytes = encode(envelope).into_boxed_slice();
            if bytes.len() > i32::MAX as usize {
                return Err(RuntimeError::Unsupported(format!(
                    "a message of {} bytes to rank {to} exceeds MPI's count",
                    bytes.len()
                )));
            }
            let buffer = Box::into_raw(bytes);
            // SAFETY: the buffer stays allocated (leaked, owned by `pending`)
            // until `reap` sees the send complete, so 'static holds while MPI reads it.
            let view: &'static [u8] = unsafe { &*buffer };
            let request = self
                .world
                .process_at_rank(to as mpi::Rank)
                .immediate_send_with_tag(StaticScope, view, TAG);
            self.pending.push(Pending { request, buffer });
            self.reap();
            Ok(())
        }

        fn poll(&mut self) -> Result<Vec<Envelope>> {
            self.reap();
            let mut arrived = Vec::new();
            while let Some(matched) = self
                .world
                .any_process()
                .immediate_matched_probe_with_tag(TAG)
            {
                let (bytes, status) = matched.matched_receive_vec::<u8>();
                arrived.push(decode(&bytes).ok_or_else(|| {
                    RuntimeError::Config(format!(
                        "a garbled message of {} bytes from rank {}",
                        bytes.len(),
                        status.source_rank()
                    ))
                })?);
            }
            Ok(arrived)
        }
    }

    impl Drop for MpiTransport {
        /// Give sends in flight a moment to complete (the peer may still be
        /// reading its last message); one that does not is leaked rather than
        /// freed under MPI, since its peer is gone or the job is ending.
        fn drop(&mut self) {
            let deadline = std::time::Instant::now() + std::time::Duration::from_secs(1);
            while !self.pending.is_empty() && std::time::Instant::now() < deadline {
                self.reap();
                std::thread::sleep(std::time::Duration::from_micros(100));
            }
            for p in self.pending.drain(..) {
                std::mem::forget(p.request);
            }
        }
    }
}

/// Little-endian wire format of an envelope: a kind byte, then its fields.
pub(crate) fn encode(e: &Envelope) -> Vec<u8> {
    let mut w = Vec::new();
    let u64s = |w: &mut Vec<u8>, v: u64| w.extend_from_slice(&v.to_le_bytes());
    match e {
        Envelope::Deposit {
            group,
            seq,
            from,
            pieces,
        } => {
            w.push(0);
            u64s(&mut w, group.len() as u64);
            group.iter().for_each(|&r| u64s(&mut w, r as u64));
            u64s(&mut w, *seq);
            u64s(&mut w, *from as u64);
            u64s(&mut w, pieces.len() as u64);
            for p in pieces {
                u64s(&mut w, p.len() as u64);
                p.iter().for_each(|v| w.extend_from_slice(&v.to_le_bytes()));
            }
        }
        Envelope::Mail { from, to, tag, msg } => {
            w.push(1);
            u64s(&mut w, *from as u64);
            u64s(&mut w, *to as u64);
            u64s(&mut w, *tag);
            u64s(&mut w, msg.len() as u64);
            for t in msg {
                match t {
                    None => w.push(0),
                    Some(t) => {
                        w.push(match t.data {
                            Data::F32(_) => 1,
                            Data::I32(_) => 2,
                        });
                        u64s(&mut w, t.shape.len() as u64);
                        t.shape.iter().for_each(|&d| u64s(&mut w, d as u64));
                        match &t.data {
                            Data::F32(v) => {
                                v.iter().for_each(|x| w.extend_from_slice(&x.to_le_bytes()))
                            }
                            Data::I32(v) => {
                                v.iter().for_each(|x| w.extend_from_slice(&x.to_le_bytes()))
                            }
                        }
                    }
                }
            }
        }
        Envelope::Poison { rank, reason } => {
            w.push(2);
            u64s(&mut w, *rank as u64);
            u64s(&mut w, reason.len() as u64);
            w.extend_from_slice(reason.as_bytes());
        }
        Envelope::Waiting { rank, waiting } => {
            w.push(3);
            u64s(&mut w, *rank as u64);
            w.push(u8::from(*waiting));
        }
    }
    w
}

struct Reader<'a>(&'a [u8]);

impl Reader<'_> {
    fn take(&mut self, n: usize) -> Option<&[u8]> {
        if self.0.len() < n {
            return None;
        }
        let (head, rest) = self.0.split_at(n);
        self.0 = rest;
        Some(head)
    }
    fn u8(&mut self) -> Option<u8> {
        Some(self.take(1)?[0])
    }
    fn u64(&mut self) -> Option<u64> {
        Some(u64::from_le_bytes(self.take(8)?.try_into().ok()?))
    }
    fn len(&mut self) -> Option<usize> {
        usize::try_from(self.u64()?).ok()
    }
    fn f32s(&mut self, n: usize) -> Option<Vec<f32>> {
        let bytes = self.take(n.checked_mul(4)?)?;
        Some(
            bytes
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect(),
        )
    }
    fn i32s(&mut self, n: usize) -> Option<Vec<i32>> {
        let bytes = self.take(n.checked_mul(4)?)?;
        Some(
            bytes
                .chunks_exact(4)
                .map(|c| i32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect(),
        )
    }
}

/// The envelope `encode` wrote; `None` for bytes it did not write.
pub(crate) fn decode(bytes: &[u8]) -> Option<Envelope> {
    let mut r = Reader(bytes);
    let e = match r.u8()? {
        0 => {
            let n = r.len()?;
            let group = (0..n).map(|_| r.len()).collect::<Option<Vec<_>>>()?;
            let seq = r.u64()?;
            let from = r.len()?;
            let count = r.len()?;
            let mut pieces = Vec::new();
            for _ in 0..count {
                let n = r.len()?;
                pieces.push(r.f32s(n)?);
            }
            Envelope::Deposit {
                group,
                seq,
                from,
                pieces,
            }
        }
        1 => {
            let (from, to, tag, count) = (r.len()?, r.len()?, r.u64()?, r.len()?);
            let mut msg: Message = Vec::new();
            for _ in 0..count {
                let kind = r.u8()?;
                if kind == 0 {
                    msg.push(None);
                    continue;
                }
                let dims = r.len()?;
                let shape = (0..dims).map(|_| r.len()).collect::<Option<Vec<_>>>()?;
                let n = shape.iter().try_fold(1usize, |a, &d| a.checked_mul(d))?;
                msg.push(Some(match kind {
                    1 => Tensor::f32(shape, r.f32s(n)?),
                    2 => Tensor::i32(shape, r.i32s(n)?),
                    _ => return None,
                }));
            }
            Envelope::Mail { from, to, tag, msg }
        }
        2 => {
            let (rank, n) = (r.len()?, r.len()?);
            let reason = String::from_utf8_lossy(r.take(n)?).into_owned();
            Envelope::Poison { rank, reason }
        }
        3 => {
            let rank = r.len()?;
            let waiting = match r.u8()? {
                0 => false,
                1 => true,
                _ => return None,
            };
            Envelope::Waiting { rank, waiting }
        }
        _ => return None,
    };
    r.0.is_empty().then_some(e)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::comm::{Group, Transport, World};
    use std::sync::mpsc::{channel, Receiver, Sender};
    use std::time::{Duration, Instant};

    /// Processes stood in for by threads, each with a world of its own: the
    /// envelopes go through the wire format and channels as they would
    /// through MPI, so the remote path is tested without Open MPI.
    struct Channels {
        to: Vec<Sender<Vec<u8>>>,
        inbox: Receiver<Vec<u8>>,
    }

    impl Transport for Channels {
        fn post(&mut self, to: usize, envelope: &Envelope) -> Result<()> {
            // A peer that already left does not read its mail; nor would MPI's.
            let _ = self.to[to].send(encode(envelope));
            Ok(())
        }
        fn poll(&mut self) -> Result<Vec<Envelope>> {
            Ok(self
                .inbox
                .try_iter()
                .map(|b| decode(&b).expect("well formed"))
                .collect())
        }
    }

    fn worlds(n: usize, timeout: Duration) -> Vec<std::sync::Arc<World>> {
        let (to, inboxes): (Vec<_>, Vec<_>) = (0..n).map(|_| channel()).unzip();
        inboxes
            .into_iter()
            .enumerate()
            .map(|(rank, inbox)| {
                let t = Channels {
                    to: to.clone(),
                    inbox,
                };
                World::remote(n, rank, timeout, Box::new(t))
            })
            .collect()
    }

    /// An all-reduce, a reduce-scatter, an all-to-all and a received value.
    type Outcome = (Vec<f32>, Vec<f32>, Vec<Vec<f32>>, f32);

    #[test]
    fn ranks_in_separate_worlds_reduce_in_group_order() {
        let ws = worlds(3, Duration::from_secs(10));
        let out: Vec<Result<Outcome>> = std::thread::scope(|s| {
            let hs: Vec<_> = ws
                .iter()
                .enumerate()
                .map(|(r, w)| {
                    let mut c = w.communicator(r);
                    s.spawn(move || {
                        let g = Group::new(vec![0, 1, 2]);
                        // Values whose float sum depends on the order.
                        let mut x = vec![[1e8f32, 1.0, -1e8][r], r as f32];
                        c.all_reduce(&g, &mut x)?;
                        let rs = c.reduce_scatter(&g, &[r as f32; 3], &[0..1, 1..2, 2..3])?;
                        let a2a =
                            c.all_to_all(&g, (0..3).map(|j| vec![(r * 3 + j) as f32]).collect())?;
                        let next = (r + 1) % 3;
                        c.send(next, 5, vec![Some(Tensor::f32(vec![1], vec![r as f32]))])?;
                        let got = c.recv((r + 2) % 3, 5)?;
                        Ok((x, rs, a2a, got[0].as_ref().expect("sent").f()?[0]))
                    })
                })
                .collect();
            hs.into_iter().map(|h| h.join().expect("rank")).collect()
        });
        for (r, o) in out.into_iter().enumerate() {
            let (x, rs, a2a, got) = o.expect("no failure");
            assert_eq!(x, vec![(1e8f32 + 1.0) + -1e8, 3.0]);
            assert_eq!(rs, vec![3.0]);
            assert_eq!(
                a2a,
                (0..3).map(|s| vec![(s * 3 + r) as f32]).collect::<Vec<_>>()
            );
            assert_eq!(got, ((r + 2) % 3) as f32);
        }
    }

    #[test]
    fn a_silent_rank_in_another_process_is_named_and_the_news_spreads() {
        let ws = worlds(3, Duration::from_millis(300));
        let start = Instant::now();
        let errs: Vec<String> = std::thread::scope(|s| {
            let hs: Vec<_> = [0, 2]
                .into_iter()
                .map(|r| {
                    let mut c = ws[r].communicator(r);
                    c.set_step(4);
                    s.spawn(move || {
                        let mut x = vec![1.0];
                        let e = c.all_reduce(&Group::new(vec![0, 1, 2]), &mut x);
                        e.expect_err("rank 1 never comes").to_string()
                    })
                })
                .collect();
            hs.into_iter().map(|h| h.join().expect("rank")).collect()
        });
        assert!(start.elapsed() < Duration::from_secs(5));
        for e in &errs {
            assert!(e.contains("rank 1 stopped answering at step 4"), "{e}");
        }
        // Rank 1's own process hears of it.
        let (rank, reason) = ws[1].failure().expect("poisoned over the wire");
        assert_eq!(rank, 1);
        assert!(reason.contains("step 4"), "{reason}");
    }

    #[test]
    fn envelopes_survive_the_wire_bit_for_bit() {
        let cases = [
            Envelope::Deposit {
                group: vec![0, 2, 5],
                seq: 41,
                from: 2,
                pieces: vec![vec![1.5, -0.0, f32::MIN_POSITIVE / 3.0], vec![]],
            },
            Envelope::Mail {
                from: 1,
                to: 3,
                tag: u64::MAX,
                msg: vec![
                    Some(Tensor::f32(vec![2, 1], vec![0.1, 7e-39])),
                    None,
                    Some(Tensor::i32(vec![3], vec![-1, 0, 9])),
                ],
            },
            Envelope::Poison {
                rank: 3,
                reason: "rank 3 stopped answering at step 2".into(),
            },
            Envelope::Waiting {
                rank: 2,
                waiting: true,
            },
            Envelope::Waiting {
                rank: 5,
                waiting: false,
            },
        ];
        for e in cases {
            let bytes = encode(&e);
            assert_eq!(decode(&bytes).as_ref(), Some(&e));
            assert_eq!(decode(&bytes[..bytes.len() - 1]), None);
        }
    }
}
