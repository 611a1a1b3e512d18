//! In-process communication between rank threads over shared memory: process
//! groups, the collectives, send/recv, and poisoning so that one failing rank
//! stops all the others (named) within a poll interval instead of hanging.
//!
//! Every collective is an exchange of contributions followed by local
//! arithmetic in group order, so each member computes the same bits and a run
//! is reproducible: the sum of an all-reduce is always `x_0 + x_1 + … + x_{n-1}`.
//!
//! A world may also hold one rank of several processes (`World::remote`): the
//! contributions of the ranks elsewhere then arrive through a `Transport` (MPI,
//! `crate::mpi_world`) into the same slots, and the same local sums run on
//! them, so a multi-process run equals the threaded one bit for bit.

use crate::error::{Result, RuntimeError};
use crate::tensor::Tensor;
use std::collections::{HashMap, HashSet, VecDeque};
use std::ops::Range;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

/// How often a waiting rank looks for a failure elsewhere.
const POLL: Duration = Duration::from_millis(20);

/// How long a rank that has a core of its own watches for its peers before
/// it sleeps. Balanced ranks meet at a collective within tens of
/// microseconds, while a sleep costs a futex wait, a wake-up by the last
/// rank to arrive and a trip through the scheduler (in a VM, an inter-processor
/// interrupt): a data-parallel step with a ZeRO all-gather per parameter
/// meets some 35 times, and sleeping at each cost a 2-rank run on 2 cores a
/// tenth of its speed.
const SPIN: Duration = Duration::from_micros(300);

/// A set of ranks that take part in collectives together, in a fixed order.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Group {
    ranks: Vec<usize>,
}

impl Group {
    pub fn new(ranks: Vec<usize>) -> Group {
        Group { ranks }
    }
    pub fn ranks(&self) -> &[usize] {
        &self.ranks
    }
    pub fn size(&self) -> usize {
        self.ranks.len()
    }
    /// Position of `rank` in the group.
    pub fn position(&self, rank: usize) -> Option<usize> {
        self.ranks.iter().position(|&r| r == rank)
    }
}

/// What one member contributed to a collective: one piece per destination
/// (all-to-all) or a single piece.
type Contribution = Arc<Vec<Vec<f32>>>;

struct Slot {
    deposits: Vec<Option<Contribution>>,
    taken: usize,
}

/// A point-to-point message: a list of tensors, `None` where a value has no gradient.
pub type Message = Vec<Option<Tensor>>;

/// What one process sends another: a rank's contribution to a collective, a
/// point-to-point message, or the news that a rank failed.
#[derive(Clone, Debug, PartialEq)]
pub(crate) enum Envelope {
    Deposit {
        group: Vec<usize>,
        seq: u64,
        from: usize,
        pieces: Vec<Vec<f32>>,
    },
    Mail {
        from: usize,
        to: usize,
        tag: u64,
        msg: Message,
    },
    Poison {
        rank: usize,
        reason: String,
    },
    /// `rank` has been blocked in a wait for a while (`true`) or no longer
    /// is (`false`): a peer that times out waiting for it then knows it is
    /// not the culprit.
    Waiting {
        rank: usize,
        waiting: bool,
    },
}

/// How envelopes reach the ranks of other processes. `post` never blocks
/// (buffers are kept until sent); `poll` returns whatever has arrived, also
/// without blocking, so every wait keeps its deadline.
pub(crate) trait Transport: Send {
    fn post(&mut self, to: usize, envelope: &Envelope) -> Result<()>;
    fn poll(&mut self) -> Result<Vec<Envelope>>;
}

#[derive(Default)]
struct State {
    failure: Option<(usize, String)>,
    slots: HashMap<(Vec<usize>, u64), Slot>,
    mail: HashMap<(usize, usize, u64), VecDeque<Message>>,
    /// The ranks blocked in a wait right now: this process's, and those of
    /// other processes that said so ([`Envelope::Waiting`]).
    waiting: HashSet<usize>,
    /// The other processes' ranks, when this process holds only `World::local`.
    transport: Option<Box<dyn Transport>>,
}

impl State {
    /// Take in what other processes sent; a broken transport is a failure.
    fn pump(&mut self, me: usize) {
        let Some(t) = self.transport.as_mut() else {
            return;
        };
        let arrived = match t.poll() {
            Ok(a) => a,
            Err(e) => {
                if self.failure.is_none() {
                    self.failure = Some((me, e.to_string()));
                }
                return;
            }
        };
        for e in arrived {
            match e {
                Envelope::Deposit {
                    group,
                    seq,
                    from,
                    pieces,
                } => {
                    let n = group.len();
                    let pos = group.iter().position(|&r| r == from);
                    let slot = self.slots.entry((group, seq)).or_insert_with(|| Slot {
                        deposits: vec![None; n],
                        taken: 0,
                    });
                    if let Some(pos) = pos {
                        slot.deposits[pos] = Some(Arc::new(pieces));
                    }
                }
                Envelope::Mail { from, to, tag, msg } => {
                    self.mail.entry((from, to, tag)).or_default().push_back(msg)
                }
                Envelope::Poison { rank, reason } => {
                    if self.failure.is_none() {
                        self.failure = Some((rank, reason));
                    }
                }
                Envelope::Waiting { rank, waiting } => {
                    if waiting {
                        self.waiting.insert(rank);
                    } else {
                        self.waiting.remove(&rank);
                    }
                }
            }
        }
    }
}

/// The shared memory of one process's ranks.
pub struct World {
    size: usize,
    timeout: Duration,
    /// The one rank this process holds when the others live in other processes.
    local: Option<usize>,
    state: Mutex<State>,
    changed: Condvar,
    /// Bumped at every change of `state` that a waiting rank may need, so a
    /// spinning rank can watch it without taking the lock.
    version: AtomicU64,
    /// Whether every rank of this process has a core to itself, so that a
    /// waiting rank may spin instead of sleeping: with more ranks than cores
    /// the spinning would take the core the awaited rank needs.
    spin: bool,
}

/// Whether `ranks` threads each get a core of their own here.
fn cores_for(ranks: usize) -> bool {
    std::thread::available_parallelism().is_ok_and(|n| ranks <= n.get())
}

impl World {
    /// A world of `size` ranks; a wait longer than `timeout` is an error.
    pub fn new(size: usize, timeout: Duration) -> Arc<World> {
        Arc::new(World {
            size,
            timeout,
            local: None,
            state: Mutex::new(State::default()),
            changed: Condvar::new(),
            version: AtomicU64::new(0),
            spin: cores_for(size),
        })
    }

    /// A world of `size` ranks of which this process holds only `local`; the
    /// others are reached through `transport`.
    pub(crate) fn remote(
        size: usize,
        local: usize,
        timeout: Duration,
        transport: Box<dyn Transport>,
    ) -> Arc<World> {
        Arc::new(World {
            size,
            timeout,
            local: Some(local),
            state: Mutex::new(State {
                transport: Some(transport),
                ..State::default()
            }),
            changed: Condvar::new(),
            version: AtomicU64::new(0),
            // Peers in other processes are seen only by polling the transport.
            spin: false,
        })
    }

    /// How many of `group`'s ranks this process holds.
    fn local_members(&self, group: &Group) -> usize {
        match self.local {
            Some(_) => 1,
            None => group.size(),
        }
    }

    /// How long a waiting rank sleeps before it looks again: a condition
    /// variable wakes local ranks at once, but messages from other processes
    /// are only seen by polling, so poll those often.
    fn poll_interval(&self) -> Duration {
        match self.local {
            Some(_) => Duration::from_micros(50),
            None => POLL,
        }
    }

    pub fn size(&self) -> usize {
        self.size
    }

    /// Wake the ranks waiting for a change of the state.
    fn notify(&self) {
        self.version.fetch_add(1, Ordering::Release);
        self.changed.notify_all();
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        // A rank that panicked while holding the lock left consistent data
        // (every update is a single insert or remove), so keep going.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Record that `rank` failed; the first failure is the one reported.
    pub fn poison(&self, rank: usize, reason: String) {
        let mut s = self.lock();
        self.poison_locked(&mut s, rank, reason);
        drop(s);
        self.notify();
    }

    /// Record the first failure while the caller holds the state, so no
    /// other rank sees the state between a change and its failure.
    fn poison_locked(&self, s: &mut State, rank: usize, reason: String) {
        if s.failure.is_none() {
            s.failure = Some((rank, reason.clone()));
            // Tell the other processes; one that cannot be reached is gone anyway.
            if let (Some(me), Some(t)) = (self.local, s.transport.as_mut()) {
                let news = Envelope::Poison { rank, reason };
                for to in (0..self.size).filter(|&r| r != me) {
                    let _ = t.post(to, &news);
                }
            }
        }
    }

    /// Tell the other processes whether `rank` is blocked in a wait.
    fn announce(&self, s: &mut State, rank: usize, waiting: bool) {
        if let (Some(me), Some(t)) = (self.local, s.transport.as_mut()) {
            let news = Envelope::Waiting { rank, waiting };
            for to in (0..self.size).filter(|&r| r != me) {
                // One that cannot be reached is gone; its own wait says so.
                let _ = t.post(to, &news);
            }
        }
    }

    /// The first failure, if any rank failed.
    pub fn failure(&self) -> Option<(usize, String)> {
        let mut s = self.lock();
        s.pump(self.local.unwrap_or(0));
        s.failure.clone()
    }

    pub fn communicator(self: &Arc<World>, rank: usize) -> Communicator {
        Communicator {
            world: Arc::clone(self),
            rank,
            seqs: HashMap::new(),
            step: 0,
        }
    }

    /// How long a rank waits for a peer before it declares the peer lost.
    pub fn timeout(&self) -> Duration {
        self.timeout
    }
}

/// One rank's handle on the world.
pub struct Communicator {
    world: Arc<World>,
    rank: usize,
    seqs: HashMap<Vec<usize>, u64>,
    /// The training step this rank is in, for naming where a peer was lost.
    step: u64,
}

impl Communicator {
    pub fn rank(&self) -> usize {
        self.rank
    }

    pub fn world(&self) -> &Arc<World> {
        &self.world
    }

    /// Say which training step this rank is in (timeouts name it).
    pub fn set_step(&mut self, step: u64) {
        self.step = step;
    }

    /// Wait on the world until `ready` yields, a rank fails or the deadline
    /// passes. `missing` says which peers have not arrived: on a timeout the
    /// first of them is reported as the failed rank, since a rank that
    /// stopped answering is the fault, not the rank left waiting for it. A
    /// missing peer of this process that is itself waiting is blocked on
    /// someone else, so it is not blamed: its own wait names the culprit
    /// (until twice the timeout, which ends even a cycle of waits). Ranks of
    /// other processes learn the same of this one once it has waited a
    /// quarter of the timeout.
    fn wait<T>(
        &self,
        what: &str,
        missing: impl Fn(&State) -> Vec<usize>,
        mut ready: impl FnMut(&mut State) -> Option<T>,
    ) -> Result<T> {
        let start = Instant::now();
        let mut s = self.world.lock();
        s.waiting.insert(self.rank);
        let mut announced = false;
        // Leave the waiting set, here and, if told, in the other processes.
        let leave = |s: &mut State, announced: bool| {
            s.waiting.remove(&self.rank);
            if announced {
                self.world.announce(s, self.rank, false);
            }
        };
        loop {
            s.pump(self.rank);
            if let Some((rank, reason)) = &s.failure {
                let err = RuntimeError::RankFailed {
                    rank: *rank,
                    reason: reason.clone(),
                };
                leave(&mut s, announced);
                return Err(err);
            }
            if let Some(v) = ready(&mut s) {
                leave(&mut s, announced);
                drop(s);
                self.world.notify();
                return Ok(v);
            }
            let waited = start.elapsed();
            if !announced && waited > self.world.timeout / 4 {
                self.world.announce(&mut s, self.rank, true);
                announced = true;
            }
            if waited > self.world.timeout {
                let silent = missing(&s);
                let culprit = silent.iter().copied().find(|r| !s.waiting.contains(r));
                if culprit.is_some() || waited > self.world.timeout * 2 {
                    let err = RuntimeError::Timeout {
                        rank: self.rank,
                        what: what.to_string(),
                        seconds: waited.as_secs_f64(),
                        step: self.step,
                        silent: silent.clone(),
                    };
                    let blamed = culprit.or(silent.first().copied()).unwrap_or(self.rank);
                    // Blame and leave `waiting` under one lock: a rank that
                    // saw this one leave before the failure was recorded
                    // would blame it instead of the culprit.
                    self.world.poison_locked(&mut s, blamed, err.to_string());
                    leave(&mut s, announced);
                    drop(s);
                    self.world.notify();
                    return Err(err);
                }
            }
            if self.world.spin && waited < SPIN {
                // Read under the lock: a change after the check above bumps it.
                let seen = self.world.version.load(Ordering::Acquire);
                drop(s);
                while self.world.version.load(Ordering::Acquire) == seen && start.elapsed() < SPIN {
                    for _ in 0..64 {
                        std::hint::spin_loop();
                    }
                }
                s = self.world.lock();
                continue;
            }
            s = self
                .world
                .changed
                .wait_timeout(s, self.world.poll_interval())
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
    }

    /// Deposit this rank's contribution and collect every member's, in group order.
    fn exchange(
        &mut self,
        group: &Group,
        what: &str,
        mine: Vec<Vec<f32>>,
    ) -> Result<Vec<Contribution>> {
        let pos = group.position(self.rank).ok_or_else(|| {
            RuntimeError::Config(format!(
                "rank {} is not in group {:?}",
                self.rank, group.ranks
            ))
        })?;
        let seq = self.seqs.entry(group.ranks.clone()).or_insert(0);
        let key = (group.ranks.clone(), *seq);
        *seq += 1;
        let n = group.size();
        let takers = self.world.local_members(group);
        {
            let mut s = self.world.lock();
            if let Some(t) = s.transport.as_mut() {
                let deposit = Envelope::Deposit {
                    group: group.ranks.clone(),
                    seq: key.1,
                    from: self.rank,
                    pieces: mine.clone(),
                };
                for &to in group.ranks.iter().filter(|&&r| r != self.rank) {
                    t.post(to, &deposit)?;
                }
            }
            let slot = s.slots.entry(key.clone()).or_insert_with(|| Slot {
                deposits: vec![None; n],
                taken: 0,
            });
            slot.deposits[pos] = Some(Arc::new(mine));
        }
        self.world.notify();
        let absent = |s: &State| match s.slots.get(&key) {
            Some(slot) => group
                .ranks
                .iter()
                .zip(&slot.deposits)
                .filter(|(_, d)| d.is_none())
                .map(|(&r, _)| r)
                .collect(),
            None => Vec::new(),
        };
        self.wait(what, absent, |s| {
            let slot = s.slots.get_mut(&key)?;
            if slot.deposits.iter().any(Option::is_none) {
                return None;
            }
            let all: Vec<Contribution> = slot.deposits.iter().flatten().cloned().collect();
            slot.taken += 1;
            if slot.taken == takers {
                s.slots.remove(&key);
            }
            Some(all)
        })
    }

    /// Sum `data` over the group, in group order, on every member.
    pub fn all_reduce(&mut self, group: &Group, data: &mut [f32]) -> Result<()> {
        let all = self.exchange(group, "all_reduce", vec![data.to_vec()])?;
        sum_into(data, all.iter().map(|c| &c[0][..]));
        Ok(())
    }

    /// Sum over the group, delivered only at the member at position `root`.
    pub fn reduce(&mut self, group: &Group, root: usize, data: &mut [f32]) -> Result<()> {
        let all = self.exchange(group, "reduce", vec![data.to_vec()])?;
        if group.position(self.rank) == Some(root) {
            sum_into(data, all.iter().map(|c| &c[0][..]));
        }
        Ok(())
    }

    /// Sum over the group at the member at position `root`, as
    /// [`reduce`](Self::reduce) does, except that the root adds nothing of
    /// its own, only collects: a dedicated parameter server summing the
    /// workers' pushes. The sum is the workers' in group order, the same
    /// bits as an all-reduce over them alone.
    pub fn reduce_to_collector(
        &mut self,
        group: &Group,
        root: usize,
        data: &mut [f32],
    ) -> Result<()> {
        let collects = group.position(self.rank) == Some(root);
        let mine = if collects { Vec::new() } else { data.to_vec() };
        let all = self.exchange(group, "reduce", vec![mine])?;
        if collects {
            sum_into(data, all.iter().map(|c| &c[0][..]));
        }
        Ok(())
    }

    /// Every member's `data`, in group order.
    pub fn all_gather(&mut self, group: &Group, data: &[f32]) -> Result<Vec<Vec<f32>>> {
        let all = self.exchange(group, "all_gather", vec![data.to_vec()])?;
        Ok(all.iter().map(|c| c[0].clone()).collect())
    }

    /// Sum over the group and keep the part `ranges[position]` of the result.
    pub fn reduce_scatter(
        &mut self,
        group: &Group,
        data: &[f32],
        ranges: &[Range<usize>],
    ) -> Result<Vec<f32>> {
        let pos = group.position(self.rank).unwrap_or(0);
        let mine = ranges.get(pos).cloned().unwrap_or(0..0);
        // Each member ships every member's part; only the owner of a part reads it.
        let pieces = ranges.iter().map(|r| data[r.clone()].to_vec()).collect();
        let all = self.exchange(group, "reduce_scatter", pieces)?;
        let mut out = vec![0.0; mine.len()];
        sum_into(&mut out, all.iter().map(|c| &c[pos][..]));
        Ok(out)
    }

    /// The member at position `root` sends `data` to every member.
    pub fn broadcast(&mut self, group: &Group, root: usize, data: &mut Vec<f32>) -> Result<()> {
        let mine = if group.position(self.rank) == Some(root) {
            data.clone()
        } else {
            Vec::new()
        };
        let all = self.exchange(group, "broadcast", vec![mine])?;
        *data = all[root][0].clone();
        Ok(())
    }

    /// Piece `j` of `pieces` goes to the member at position `j`; returns what
    /// each member sent here, in group order.
    pub fn all_to_all(&mut self, group: &Group, pieces: Vec<Vec<f32>>) -> Result<Vec<Vec<f32>>> {
        let pos = group.position(self.rank).unwrap_or(0);
        let all = self.exchange(group, "all_to_all", pieces)?;
        Ok(all
            .iter()
            .map(|c| c.get(pos).cloned().unwrap_or_default())
            .collect())
    }

    /// Queue `msg` for `to` under `tag`; never blocks (buffers are unbounded).
    pub fn send(&mut self, to: usize, tag: u64, msg: Message) -> Result<()> {
        if to >= self.world.size {
            return Err(RuntimeError::Config(format!(
                "send to rank {to} of {}",
                self.world.size
            )));
        }
        let mut s = self.world.lock();
        if let (Some(me), Some(t)) = (self.world.local, s.transport.as_mut()) {
            if to != me {
                let mail = Envelope::Mail {
                    from: self.rank,
                    to,
                    tag,
                    msg,
                };
                return t.post(to, &mail);
            }
        }
        s.mail
            .entry((self.rank, to, tag))
            .or_default()
            .push_back(msg);
        drop(s);
        self.world.notify();
        Ok(())
    }

    /// The next message from `from` under `tag`, waiting for it.
    pub fn recv(&mut self, from: usize, tag: u64) -> Result<Message> {
        let key = (from, self.rank, tag);
        self.wait(
            &format!("recv from rank {from}"),
            |_| vec![from],
            |s| s.mail.get_mut(&key).and_then(VecDeque::pop_front),
        )
    }
}

fn sum_into<'a>(out: &mut [f32], parts: impl Iterator<Item = &'a [f32]>) {
    out.iter_mut().for_each(|v| *v = 0.0);
    for p in parts {
        out.iter_mut().zip(p).for_each(|(o, &v)| *o += v);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run<T: Send>(n: usize, f: impl Fn(Communicator) -> Result<T> + Sync) -> Vec<Result<T>> {
        let world = World::new(n, Duration::from_secs(5));
        std::thread::scope(|s| {
            let handles: Vec<_> = (0..n)
                .map(|r| {
                    let c = world.communicator(r);
                    let f = &f;
                    s.spawn(move || f(c))
                })
                .collect();
            handles
                .into_iter()
                .map(|h| h.join().expect("test rank"))
                .collect()
        })
    }

    #[test]
    fn collectives_agree_on_every_rank() {
        let out = run(4, |mut c| {
            let g = Group::new(vec![0, 1, 2, 3]);
            let r = c.rank() as f32;
            let mut x = vec![r, 1.0];
            c.all_reduce(&g, &mut x)?;
            let gathered = c.all_gather(&g, &[r])?;
            let ranges = [0..1, 1..2, 2..3, 3..4];
            let rs = c.reduce_scatter(&g, &[r; 4], &ranges)?;
            let mut b = vec![r];
            c.broadcast(&g, 2, &mut b)?;
            let a2a = c.all_to_all(&g, (0..4).map(|j| vec![r * 10.0 + j as f32]).collect())?;
            let mut red = vec![r];
            c.reduce(&g, 0, &mut red)?;
            Ok((x, gathered, rs, b, a2a, red))
        });
        for (rank, o) in out.into_iter().enumerate() {
            let (x, gathered, rs, b, a2a, red) = o.unwrap();
            assert_eq!(x, vec![6.0, 4.0]);
            assert_eq!(gathered, vec![vec![0.0], vec![1.0], vec![2.0], vec![3.0]]);
            assert_eq!(rs, vec![6.0]);
            assert_eq!(b, vec![2.0]);
            let want: Vec<Vec<f32>> = (0..4)
                .map(|s| vec![s as f32 * 10.0 + rank as f32])
                .collect();
            assert_eq!(a2a, want);
            if rank == 0 {
                assert_eq!(red, vec![6.0]);
            }
        }
    }

    #[test]
    fn send_and_recv_pair_by_tag() {
        let out = run(2, |mut c| {
            if c.rank() == 0 {
                c.send(1, 7, vec![Some(Tensor::f32(vec![1], vec![7.0]))])?;
                c.send(1, 3, vec![None])?;
                Ok(0.0)
            } else {
                let three = c.recv(0, 3)?;
                let seven = c.recv(0, 7)?;
                assert!(three[0].is_none());
                Ok(seven[0].as_ref().unwrap().f()?[0])
            }
        });
        assert_eq!(*out[1].as_ref().unwrap(), 7.0);
    }

    #[test]
    fn a_failed_rank_stops_the_others_quickly() {
        let start = Instant::now();
        let world = World::new(3, Duration::from_secs(60));
        let out: Vec<Result<()>> = std::thread::scope(|s| {
            let hs: Vec<_> = (0..3)
                .map(|r| {
                    let mut c = world.communicator(r);
                    let w = Arc::clone(&world);
                    s.spawn(move || {
                        if r == 1 {
                            w.poison(1, "deliberate failure".into());
                            return Ok(());
                        }
                        let mut x = vec![1.0];
                        c.all_reduce(&Group::new(vec![0, 1, 2]), &mut x)
                    })
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        });
        assert!(start.elapsed() < Duration::from_secs(2));
        for r in [0, 2] {
            assert_eq!(
                out[r].as_ref().unwrap_err().to_string(),
                "rank 1 failed: deliberate failure"
            );
        }
    }

    #[test]
    fn a_missing_rank_times_out_instead_of_hanging() {
        let world = World::new(2, Duration::from_millis(200));
        let mut c = world.communicator(0);
        let err = c.recv(1, 0).unwrap_err();
        assert!(
            matches!(err, RuntimeError::Timeout { rank: 0, .. }),
            "{err}"
        );
        assert!(world.failure().is_some());
    }
}
