//! Ranks in separate processes without MPI: the processes a launcher starts
//! (torchrun, srun, or `dplc build`'s artifact) meet at `MASTER_ADDR:
//! MASTER_PORT` over TCP, and the communicator's envelopes travel there.
//!
//! Rank 0 listens; every other rank connects to it once, says which rank it
//! is, and sends every envelope to rank 0 framed with its destination; rank 0
//! delivers its own and relays the others. A pair's envelopes keep their
//! order (two FIFO streams in a row). One reader thread per stream turns
//! frames into a queue that `poll` drains; a closed stream is a failure of
//! the rank behind it, which the world reports like any other.
//!
//! The star is simple and correct; it is not fast for large worlds (rank 0
//! carries every byte), which is why the GPU path's bulk traffic belongs
//! on NCCL.

use crate::comm::{Envelope, Transport};
use crate::error::{Result, RuntimeError};
use crate::mpi_world::{decode, encode};
use std::io::{BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::mpsc::{channel, Receiver, Sender};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

const MAGIC: &[u8; 4] = b"dplT";

/// One process's place in a world that meets over TCP.
#[derive(Debug)]
pub struct TcpProcess {
    rank: usize,
    size: usize,
    /// Rank 0: a stream per other rank (index = rank); others: one, to rank 0.
    /// Taken by the first run's transport.
    streams: Mutex<Vec<Option<TcpStream>>>,
}

/// What a reader thread hands to `poll`: an envelope's bytes for this rank,
/// a rank leaving normally, or one lost.
enum Incoming {
    Frame { bytes: Vec<u8> },
    Bye { from: usize },
    Lost { from: usize, why: String },
}

fn net_err(addr: &str, detail: impl std::fmt::Display) -> RuntimeError {
    RuntimeError::Config(format!("rendezvous at {addr}: {detail}"))
}

impl TcpProcess {
    /// Join the world of `size` ranks as `rank`, meeting at `host:port`
    /// within `timeout` (rank 0 listens there, the others connect).
    pub fn join(
        rank: usize,
        size: usize,
        host: &str,
        port: u16,
        timeout: Duration,
    ) -> Result<TcpProcess> {
        let addr = format!("{host}:{port}");
        if rank >= size {
            return Err(net_err(&addr, format!("rank {rank} of a world of {size}")));
        }
        let deadline = Instant::now() + timeout;
        let mut streams: Vec<Option<TcpStream>> = (0..size).map(|_| None).collect();
        if rank == 0 {
            if size > 1 {
                let listener = TcpListener::bind(("0.0.0.0", port))
                    .map_err(|e| net_err(&addr, format!("cannot listen on port {port}: {e}")))?;
                listener
                    .set_nonblocking(true)
                    .map_err(|e| net_err(&addr, e))?;
                while streams[1..].iter().any(Option::is_none) {
                    match listener.accept() {
                        Ok((mut s, _)) => {
                            s.set_nonblocking(false).map_err(|e| net_err(&addr, e))?;
                            s.set_read_timeout(Some(timeout)).ok();
                            let mut hello = [0u8; 8];
                            if s.read_exact(&mut hello).is_err() || &hello[..4] != MAGIC {
                                continue;
                            }
                            let peer = u32::from_le_bytes(hello[4..].try_into().expect("4 bytes"))
                                as usize;
                            if peer == 0 || peer >= size || streams[peer].is_some() {
                                return Err(net_err(
                                    &addr,
                                    format!("a peer says it is rank {peer} of {size}"),
                                ));
                            }
                            s.set_read_timeout(None).ok();
                            s.set_nodelay(true).ok();
                            streams[peer] = Some(s);
                        }
                        Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                            if Instant::now() > deadline {
                                let missing: Vec<usize> =
                                    (1..size).filter(|&r| streams[r].is_none()).collect();
                                return Err(net_err(
                                    &addr,
                                    format!("ranks {missing:?} did not arrive within {timeout:?}"),
                                ));
                            }
                            std::thread::sleep(Duration::from_millis(5));
                        }
                        Err(e) => return Err(net_err(&addr, e)),
                    }
                }
            }
        } else {
            let mut s = loop {
                match TcpStream::connect((host, port)) {
                    Ok(s) => break s,
                    Err(e) if Instant::now() > deadline => {
                        return Err(net_err(&addr, format!("rank 0 cannot be reached: {e}")))
                    }
                    Err(_) => std::thread::sleep(Duration::from_millis(20)),
                }
            };
            let mut hello = MAGIC.to_vec();
            hello.extend((rank as u32).to_le_bytes());
            s.write_all(&hello).map_err(|e| net_err(&addr, e))?;
            s.set_nodelay(true).ok();
            streams[0] = Some(s);
        }
        Ok(TcpProcess {
            rank,
            size,
            streams: Mutex::new(streams),
        })
    }

    pub fn rank(&self) -> usize {
        self.rank
    }

    pub fn size(&self) -> usize {
        self.size
    }

    /// The world's transport over these streams (once: it takes them).
    pub(crate) fn transport(&self) -> Result<Box<dyn Transport>> {
        let (tx, rx) = channel();
        let mut writers: Vec<Option<Writer>> = (0..self.size).map(|_| None).collect();
        let mut readers = Vec::new();
        let mut streams = self.streams.lock().unwrap_or_else(|p| p.into_inner());
        if self.size > 1 && streams.iter().all(Option::is_none) {
            return Err(RuntimeError::Config(
                "this process's connections already served a run; join again".into(),
            ));
        }
        for (peer, s) in streams.iter_mut().enumerate() {
            let Some(s) = s.take() else { continue };
            let reader = s
                .try_clone()
                .map_err(|e| RuntimeError::Config(format!("a stream to rank {peer}: {e}")))?;
            readers.push((peer, reader));
            writers[peer] = Some(Arc::new(Mutex::new(s)));
        }
        let writers = Arc::new(writers);
        for (peer, reader) in readers {
            spawn_reader(self.rank, peer, reader, Arc::clone(&writers), tx.clone());
        }
        Ok(Box::new(TcpTransport {
            rank: self.rank,
            writers,
            incoming: rx,
            done: vec![false; self.size],
        }))
    }
}

type Writer = Arc<Mutex<TcpStream>>;

/// The destination word of the frame a rank sends when it leaves normally.
const BYE: u32 = u32::MAX;

fn write_frame(w: &Writer, to: u32, bytes: &[u8]) -> std::io::Result<()> {
    let mut frame = Vec::with_capacity(12 + bytes.len());
    frame.extend(to.to_le_bytes());
    frame.extend((bytes.len() as u64).to_le_bytes());
    frame.extend_from_slice(bytes);
    w.lock()
        .unwrap_or_else(|p| p.into_inner())
        .write_all(&frame)
}

/// Read frames `[to u32][len u64][bytes]` from `peer` until the stream ends.
/// On rank 0 a frame for another rank is relayed here, at once, so relaying
/// never waits for rank 0's own work.
fn spawn_reader(
    me: usize,
    peer: usize,
    stream: TcpStream,
    writers: Arc<Vec<Option<Writer>>>,
    tx: Sender<Incoming>,
) {
    std::thread::spawn(move || {
        let mut r = BufReader::new(stream);
        let mut said_bye = false;
        loop {
            let mut head = [0u8; 12];
            let mut bytes = Vec::new();
            let read = r.read_exact(&mut head).and_then(|()| {
                let len = u64::from_le_bytes(head[4..].try_into().expect("8 bytes")) as usize;
                bytes.resize(len, 0);
                r.read_exact(&mut bytes)
            });
            if let Err(e) = read {
                if !said_bye {
                    let _ = tx.send(Incoming::Lost {
                        from: peer,
                        why: format!("its connection closed ({e})"),
                    });
                }
                return;
            }
            let to = u32::from_le_bytes(head[..4].try_into().expect("4 bytes"));
            if to == BYE {
                said_bye = true;
                let _ = tx.send(Incoming::Bye { from: peer });
                continue;
            }
            let to = to as usize;
            if to == me {
                if tx.send(Incoming::Frame { bytes }).is_err() {
                    return;
                }
                continue;
            }
            let relayed = writers
                .get(to)
                .and_then(Option::as_ref)
                .map(|w| write_frame(w, to as u32, &bytes));
            if !matches!(relayed, Some(Ok(()))) {
                let _ = tx.send(Incoming::Lost {
                    from: to,
                    why: "a message for it could not be relayed".into(),
                });
            }
        }
    });
}

struct TcpTransport {
    rank: usize,
    writers: Arc<Vec<Option<Writer>>>,
    incoming: Receiver<Incoming>,
    /// Ranks that left (said bye, or were lost): rank 0 waits for them all
    /// before it stops relaying.
    done: Vec<bool>,
}

impl Transport for TcpTransport {
    fn post(&mut self, to: usize, envelope: &Envelope) -> Result<()> {
        // Rank 0 writes to the destination itself; the others through it.
        let via = if self.rank == 0 { to } else { 0 };
        let w = self.writers[via]
            .as_ref()
            .ok_or_else(|| RuntimeError::RankFailed {
                rank: via,
                reason: "no connection to it".into(),
            })?;
        write_frame(w, to as u32, &encode(envelope)).map_err(|e| RuntimeError::RankFailed {
            rank: via,
            reason: format!("its connection closed ({e})"),
        })
    }

    fn poll(&mut self) -> Result<Vec<Envelope>> {
        let mut out = Vec::new();
        while let Ok(item) = self.incoming.try_recv() {
            match item {
                Incoming::Frame { bytes } => out.push(decode(&bytes).ok_or_else(|| {
                    RuntimeError::Config("a malformed message arrived over TCP".into())
                })?),
                Incoming::Bye { from } => self.done[from] = true,
                Incoming::Lost { from, why } => {
                    self.done[from] = true;
                    return Err(RuntimeError::RankFailed {
                        rank: from,
                        reason: format!("rank {from} is gone: {why}"),
                    });
                }
            }
        }
        Ok(out)
    }
}

impl Drop for TcpTransport {
    /// Leave politely: the others say bye to rank 0, which keeps relaying
    /// until every one of them has left (or a minute has passed).
    fn drop(&mut self) {
        if self.rank != 0 {
            if let Some(w) = &self.writers[0] {
                let _ = write_frame(w, BYE, &[]);
            }
            return;
        }
        self.done[0] = true;
        let deadline = Instant::now() + Duration::from_secs(60);
        while self.done.iter().any(|d| !d) && Instant::now() < deadline {
            match self.incoming.recv_timeout(Duration::from_millis(50)) {
                Ok(Incoming::Bye { from } | Incoming::Lost { from, .. }) => self.done[from] = true,
                Ok(Incoming::Frame { .. }) | Err(_) => {}
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::comm::{Group, World};

    /// Rank 2 waits on rank 0, which soon waits on rank 1, which never
    /// answers: rank 2's deadline passes first, yet it does not blame rank
    /// 0 (whose process said it is blocked) but learns of rank 1 from rank
    /// 0's own timeout.
    #[test]
    fn a_timeout_blames_past_a_peer_that_is_itself_waiting() {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .expect("a local port")
            .port();
        let timeout = Duration::from_millis(800);
        let errs: Vec<String> = std::thread::scope(|sc| {
            let hs: Vec<_> = (0..3)
                .map(|rank| {
                    sc.spawn(move || -> String {
                        let p =
                            TcpProcess::join(rank, 3, "127.0.0.1", port, Duration::from_secs(10))
                                .expect("joins");
                        let world = World::remote(3, rank, timeout, p.transport().expect("links"));
                        let mut c = world.communicator(rank);
                        c.set_step(4);
                        match rank {
                            0 => {
                                std::thread::sleep(timeout / 2);
                                c.recv(1, 0).expect_err("rank 1 never sends").to_string()
                            }
                            // Silent until the run is known to have failed.
                            1 => {
                                while world.failure().is_none() {
                                    std::thread::sleep(Duration::from_millis(10));
                                }
                                String::new()
                            }
                            _ => c
                                .all_reduce(&Group::new(vec![0, 2]), &mut [1.0])
                                .expect_err("rank 0 is blocked")
                                .to_string(),
                        }
                    })
                })
                .collect();
            hs.into_iter().map(|h| h.join().expect("rank")).collect()
        });
        for (rank, e) in errs.iter().enumerate().filter(|(r, _)| *r != 1) {
            assert!(
                e.contains("rank 1 stopped answering at step 4"),
                "rank {rank}: {e}"
            );
        }
    }
}
