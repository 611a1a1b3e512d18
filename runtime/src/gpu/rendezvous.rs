//! Rank 0 hands one opaque id (NCCL's 128-byte unique id) to every other rank
//! over TCP at MASTER_ADDR:MASTER_PORT: the bootstrap NCCL itself leaves to
//! the launcher. Peers retry connecting until rank 0 listens or time runs out.

use super::error::{GpuError, GpuResult};
use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream, ToSocketAddrs};
use std::time::{Duration, Instant};

/// Bytes of the id exchanged.
pub const ID_BYTES: usize = 128;

/// A small greeting so that a stray connection is not taken for a rank.
const MAGIC: &[u8; 4] = b"dplc";

fn err(addr: &str, detail: impl Into<String>) -> GpuError {
    GpuError::Rendezvous {
        addr: addr.to_string(),
        detail: detail.into(),
    }
}

/// On rank 0: serve `id` to the `world_size - 1` other ranks, then return it.
/// On other ranks: connect to rank 0 and return the id it serves.
pub fn share_id(
    rank: usize,
    world_size: usize,
    host: &str,
    port: u16,
    id: Option<[u8; ID_BYTES]>,
    timeout: Duration,
) -> GpuResult<[u8; ID_BYTES]> {
    let addr = format!("{host}:{port}");
    if rank == 0 {
        let id = id.ok_or_else(|| err(&addr, "rank 0 has no id to share"))?;
        if world_size <= 1 {
            return Ok(id);
        }
        // Listen on every interface: MASTER_ADDR names this host from the others' side.
        let listener = TcpListener::bind(("0.0.0.0", port))
            .map_err(|e| err(&addr, format!("cannot listen on port {port}: {e}")))?;
        listener
            .set_nonblocking(true)
            .map_err(|e| err(&addr, e.to_string()))?;
        let deadline = Instant::now() + timeout;
        let mut served = vec![false; world_size];
        served[0] = true;
        while served.iter().any(|s| !s) {
            match listener.accept() {
                Ok((mut s, _)) => {
                    s.set_nonblocking(false)
                        .map_err(|e| err(&addr, e.to_string()))?;
                    s.set_read_timeout(Some(timeout)).ok();
                    let mut hello = [0u8; 8];
                    if s.read_exact(&mut hello).is_err() || &hello[..4] != MAGIC {
                        continue;
                    }
                    let peer = u32::from_le_bytes(hello[4..].try_into().expect("4 bytes")) as usize;
                    if peer == 0 || peer >= world_size {
                        return Err(err(
                            &addr,
                            format!("a peer says it is rank {peer} of {world_size}"),
                        ));
                    }
                    s.write_all(&id).map_err(|e| err(&addr, e.to_string()))?;
                    served[peer] = true;
                }
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                    if Instant::now() > deadline {
                        let missing: Vec<usize> = (0..world_size).filter(|&r| !served[r]).collect();
                        return Err(err(&addr, format!("ranks {missing:?} never connected")));
                    }
                    std::thread::sleep(Duration::from_millis(10));
                }
                Err(e) => return Err(err(&addr, e.to_string())),
            }
        }
        Ok(id)
    } else {
        let deadline = Instant::now() + timeout;
        loop {
            let target = addr
                .to_socket_addrs()
                .map_err(|e| err(&addr, format!("cannot resolve: {e}")))?
                .next()
                .ok_or_else(|| err(&addr, "resolves to no address"))?;
            match TcpStream::connect_timeout(&target, Duration::from_millis(500)) {
                Ok(mut s) => {
                    s.set_read_timeout(Some(timeout)).ok();
                    let mut hello = [0u8; 8];
                    hello[..4].copy_from_slice(MAGIC);
                    hello[4..].copy_from_slice(&(rank as u32).to_le_bytes());
                    s.write_all(&hello).map_err(|e| err(&addr, e.to_string()))?;
                    let mut id = [0u8; ID_BYTES];
                    s.read_exact(&mut id)
                        .map_err(|e| err(&addr, format!("reading the id: {e}")))?;
                    return Ok(id);
                }
                Err(e) if Instant::now() > deadline => {
                    return Err(err(&addr, format!("rank 0 never answered: {e}")))
                }
                Err(_) => std::thread::sleep(Duration::from_millis(20)),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn free_port() -> u16 {
        TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port()
    }

    #[test]
    fn every_rank_gets_rank_zeros_id() {
        let port = free_port();
        let mut id = [0u8; ID_BYTES];
        for (i, b) in id.iter_mut().enumerate() {
            *b = (i * 7 + 3) as u8;
        }
        let world = 4;
        let got: Vec<[u8; ID_BYTES]> = std::thread::scope(|s| {
            let hs: Vec<_> = (0..world)
                .map(|r| {
                    s.spawn(move || {
                        let mine = (r == 0).then_some(id);
                        share_id(r, world, "127.0.0.1", port, mine, Duration::from_secs(20))
                            .unwrap()
                    })
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        });
        assert!(got.iter().all(|g| *g == id));
    }

    #[test]
    fn a_missing_rank_times_out_with_its_number() {
        let port = free_port();
        let e = share_id(
            0,
            2,
            "127.0.0.1",
            port,
            Some([1; ID_BYTES]),
            Duration::from_millis(200),
        )
        .unwrap_err();
        assert!(e.to_string().contains("ranks [1] never connected"), "{e}");
    }
}
