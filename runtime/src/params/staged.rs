//! What the store stages through the host: a parameter server's push and
//! pull, and the compressed all-reduces (bf16/fp16, top-k and PowerSGD with
//! error feedback, `crate::gradsync`). Every storage serves them by copying
//! the vectors they read and write (free for host memory).

use super::{DpState, ParamStore, Storage};
use crate::comm::Group;
use crate::error::{kernel_err, Result};
use crate::gradsync::{self, Feedback, Traffic};
use crate::interp::ParamKey;
use dplc_ir::Compression;

impl<S: Storage> ParamStore<S> {
    /// Parameter server, push: every worker reduces each server's shard of
    /// every gradient (the group's tensors in key order, one message per
    /// server) to that server, which sums them in group order — the order
    /// the all-reduce sums in, so the sums are the same bits. A dedicated
    /// server collects without adding anything of its own. Staged through
    /// the host.
    pub(super) fn push_to_servers(&mut self) -> Result<()> {
        for (ranks, keys) in self.by_group() {
            let group = Group::new(ranks);
            for server in 0..self.servers(&keys) {
                let (with, root, at) = self.server_group(&group, server);
                let Some(me) = with.position(self.comm.rank()) else {
                    continue;
                };
                let mut flat = Vec::new();
                for k in &keys {
                    let slot = &self.slots[k];
                    flat.extend_from_slice(
                        &self.storage.read(&slot.grad, slot.shards[at].clone())?,
                    );
                }
                if self.dedicated_servers() > 0 {
                    self.comm.reduce_to_collector(&with, root, &mut flat)?;
                } else {
                    self.comm.reduce(&with, root, &mut flat)?;
                }
                self.traffic
                    .star(with.size(), me == root, flat.len() * 4, true);
                if me == root {
                    let mut pos = 0;
                    for k in &keys {
                        let slot = self.slots.get_mut(k).expect("key from the slots");
                        let r = slot.shards[at].clone();
                        let len = r.len();
                        self.storage
                            .write(&mut slot.grad, r.start, &flat[pos..pos + len])?;
                        pos += len;
                    }
                }
            }
        }
        Ok(())
    }

    /// How many servers hold the group's shards (the same for every tensor).
    fn servers(&self, keys: &[ParamKey]) -> usize {
        let shards = self.sync.ps_shards().unwrap_or(1) as usize;
        if self.dedicated_servers() > 0 {
            return shards;
        }
        keys.first()
            .map_or(0, |k| shards.min(self.slots[k].shards.len()))
    }

    /// Dedicated server replicas at the end of each data-parallel group.
    fn dedicated_servers(&self) -> usize {
        self.sync.dedicated_servers() as usize
    }

    /// Server `server`'s exchanges: the group it pushes and pulls over, its
    /// position there, and its position in `group` (which indexes
    /// `Slot::shards`). Co-located, the whole group, the server one of its
    /// workers; dedicated, the workers and that server alone, last —
    /// servers exchange nothing with each other.
    fn server_group(&self, group: &Group, server: usize) -> (Group, usize, usize) {
        let dedicated = self.dedicated_servers();
        if dedicated == 0 {
            return (group.clone(), server, server);
        }
        let workers = group.size() - dedicated;
        let mut ranks = group.ranks()[..workers].to_vec();
        ranks.push(group.ranks()[workers + server]);
        (Group::new(ranks), workers, workers + server)
    }

    /// Parameter server, pull: each server sends its updated shard of every
    /// tensor to every worker, which puts the whole weights together.
    pub(super) fn pull_from_servers(&mut self) -> Result<()> {
        for (ranks, keys) in self.by_group() {
            let group = Group::new(ranks);
            let mut fulls: Vec<Vec<f32>> = keys
                .iter()
                .map(|k| Vec::with_capacity(self.slots[k].numel))
                .collect();
            // A dedicated server takes no weights back: it computes nothing.
            let mut whole = true;
            for server in 0..self.servers(&keys) {
                let (with, root, at) = self.server_group(&group, server);
                let Some(me) = with.position(self.comm.rank()) else {
                    whole = false;
                    continue;
                };
                let mut flat: Vec<f32> = Vec::new();
                if me == root {
                    for k in &keys {
                        let master = &self.slots[k].master;
                        flat.extend_from_slice(&self.storage.read(master, 0..S::len(master))?);
                    }
                }
                self.comm.broadcast(&with, root, &mut flat)?;
                self.traffic
                    .star(with.size(), me == root, flat.len() * 4, false);
                let mut pos = 0;
                for (k, full) in keys.iter().zip(fulls.iter_mut()) {
                    let len = self.slots[k].shards[at].len();
                    let piece = flat.get(pos..pos + len).ok_or_else(|| {
                        kernel_err("broadcast", "a server sent fewer weights than it owns")
                    })?;
                    full.extend_from_slice(piece);
                    pos += len;
                }
            }
            if !whole {
                continue;
            }
            for (k, full) in keys.iter().zip(fulls) {
                let slot = self.slots.get_mut(k).expect("key from the slots");
                slot.full = Some(self.storage.value_from_host(&slot.shape, full)?);
            }
        }
        Ok(())
    }

    pub(super) fn compressed_step(&self, step: u64) -> gradsync::CompressedStep {
        gradsync::CompressedStep {
            compress: self.compress,
            step,
            warmup: self.compress_warmup,
        }
    }

    /// Compressed all-reduce of every gradient (ZeRO-0), with error
    /// feedback, staged through the host. A warm-up step's bytes are not
    /// the steady state's: they are left out of `traffic`.
    pub(super) fn compressed_reduce(&mut self, step: u64) -> Result<()> {
        let at = self.compressed_step(step);
        let mut warmup_traffic = Traffic::default();
        for (ranks, keys) in self.by_group() {
            let group = Group::new(ranks);
            let mut grads = Vec::with_capacity(keys.len());
            for k in &keys {
                let slot = self.slots.get_mut(k).expect("key from the slots");
                grads.push(self.storage.stage_out(std::mem::take(&mut slot.grad))?);
            }
            {
                // Both maps iterate in key order; bf16/fp16 keep no state.
                let mut feedback = self
                    .feedback
                    .iter_mut()
                    .filter(|(k, _)| keys.contains(k))
                    .peekable();
                let mut tensors: Vec<gradsync::Tensor> = Vec::with_capacity(keys.len());
                for (k, grad) in keys.iter().zip(grads.iter_mut()) {
                    let state = match feedback.peek() {
                        Some((fk, _)) if *fk == k => feedback.next().map(|(_, f)| f),
                        _ => None,
                    };
                    tensors.push(gradsync::Tensor {
                        grad,
                        shape: &self.slots[k].shape,
                        feedback: state,
                    });
                }
                let traffic = if at.warming_up() {
                    &mut warmup_traffic
                } else {
                    &mut self.traffic
                };
                gradsync::compressed_all_reduce(&mut self.comm, &group, at, &mut tensors, traffic)?;
            }
            for (k, grad) in keys.iter().zip(grads) {
                let grad = self.storage.stage_in(grad)?;
                self.slots.get_mut(k).expect("key from the slots").grad = grad;
            }
        }
        Ok(())
    }
}

/// Top-k's and PowerSGD's error-feedback state for one tensor of `shape`
/// (`numel` elements): the checkpoint's where it carried one, else zero
/// error and PowerSGD's orthonormalised warm start. `None` for the
/// compressions that keep no state.
pub(super) fn initial_feedback(
    dp_sync: &DpState,
    seed: u64,
    key: ParamKey,
    shape: &[usize],
    numel: usize,
) -> Result<Option<Feedback>> {
    let q = match dp_sync.compress {
        Compression::PowerSgd { rank, .. } => gradsync::powersgd_dims(shape, rank as usize)
            .map(|(_, cols, r)| {
                gradsync::initial_q(seed, (key.param.index() as u64, key.layer), cols, r)
            })
            .unwrap_or_default(),
        Compression::TopK { .. } => Vec::new(),
        Compression::None | Compression::Bf16 | Compression::Fp16 => return Ok(None),
    };
    Ok(Some(match dp_sync.feedback.and_then(|f| f.get(&key)) {
        Some(saved) => {
            if saved.error.len() != numel || saved.q.len() != q.len() {
                return Err(kernel_err(
                    "checkpoint",
                    format!(
                        "the error-feedback state of {key:?} has another shape; \
                         resume with the compression and split it was saved with"
                    ),
                ));
            }
            saved.clone()
        }
        None => Feedback {
            error: vec![0.0; numel],
            q,
        },
    }))
}
