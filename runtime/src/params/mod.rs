//! Parameter storage of one rank: full values, the shard it updates, AdamW
//! moments and gradients, laid out per ZeRO stage; and the layer hooks through
//! which ZeRO-3 all-gathers weights and reduce-scatters gradients per layer.
//!
//! The store decides what every rank holds and when it moves; where the
//! vectors live is its [`Storage`]'s business: host memory for the
//! reference compute, the compute backend's buffers for the fused one
//! ([`device`]), so both run the same ZeRO stages, gradient sync and
//! optimizer rule. What only the host does (a parameter server's push and
//! pull, compression: [`staged`]; async weight versions, checkpoints)
//! stages the vectors through the host.

mod device;
mod shared;
mod staged;
mod storage;

pub(crate) use device::{
    all_to_all_host, all_to_all_position, recv_host, send_host, slice_of, DeviceBuf, DeviceStorage,
    HostStaged, Links,
};
pub(crate) use shared::{HandOver, SharedDevice};
pub(crate) use storage::{HostStorage, Pieces, Storage};

use crate::comm::{Communicator, Group};
use crate::error::{kernel_err, Result};
use crate::gradsync::{Feedback, Traffic};
use crate::interp::{ParamAccess, ParamKey, Value};
use crate::rng;
use crate::shard::{self, MeshGroups};
use crate::tensor::Tensor;
use dplc_codegen::{AdamwScalars, SgdScalars};
use dplc_ir::{Compression, GradSync, Graph, Init, Optimizer, TensorLayout, VocabOp};
use staged::initial_feedback;
use std::borrow::Cow;
use std::collections::{BTreeMap, HashMap, VecDeque};
use std::ops::Range;
use storage::{Moments, Update};

/// How much of the training state data-parallel ranks split between them.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum ZeroStage {
    /// Plain data parallel: everything replicated, gradients all-reduced.
    None,
    /// Optimizer states sharded.
    One,
    /// Optimizer states and gradients sharded (gradients reduce-scattered).
    Two,
    /// Parameters sharded too (FSDP): gathered per layer, freed after use.
    Three,
}

impl ZeroStage {
    /// The stage's number, as plans write it.
    pub(crate) fn stage(self) -> u8 {
        match self {
            ZeroStage::None => 0,
            ZeroStage::One => 1,
            ZeroStage::Two => 2,
            ZeroStage::Three => 3,
        }
    }

    /// Whether each rank keeps only its part of every gradient, reduced
    /// after each unit's backward of every micro-batch (ZeRO-2 and 3).
    pub(crate) fn shards_grads(self) -> bool {
        self >= ZeroStage::Two
    }

    /// Whether each rank keeps only its part of every weight, gathered per
    /// layer when a pass reaches it and freed after (ZeRO-3).
    pub(crate) fn shards_weights(self) -> bool {
        self == ZeroStage::Three
    }
}

/// A parameter's logical (unsharded) training state: what a checkpoint
/// holds, and what any split slices its own part from.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct LogicalParam {
    pub value: Vec<f32>,
    pub m: Vec<f32>,
    pub v: Vec<f32>,
}

/// The elements of one parameter's training state that this rank owns:
/// across the world every element is owned by exactly one rank, which is
/// the one that writes it to a checkpoint.
pub(crate) struct OwnedShard<'a> {
    pub key: ParamKey,
    /// `(axis, parts, index)` of the tensor- or expert-parallel part it lies in.
    pub part: Option<(usize, usize, usize)>,
    /// Where it lies in that part, flattened.
    pub range: Range<usize>,
    pub value: Cow<'a, [f32]>,
    pub m: Cow<'a, [f32]>,
    pub v: Cow<'a, [f32]>,
}

/// Which layer a parameter belongs to, for ZeRO-3's per-layer gathers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Unit {
    Root,
    Layer(u64),
}

pub(crate) struct Slot<S: Storage> {
    pub shape: Vec<usize>,
    pub numel: usize,
    /// The full value, when present (always below ZeRO-3; while gathered at 3).
    pub full: Option<S::Value>,
    /// Every data-parallel rank's part, in rank order.
    pub shards: Vec<Range<usize>>,
    /// The part this rank updates (all of it without ZeRO).
    pub own: Range<usize>,
    /// fp32 master values of `own`.
    pub master: S::Buf,
    pub m: S::Buf,
    pub v: S::Buf,
    /// Gradient: whole while accumulating, `own`'s part once reduce-scattered
    /// (ZeRO-1 after the step's sync, ZeRO-2 and 3 always).
    pub grad: S::Buf,
    /// Matrices decay; biases and norm gains do not (the GPT-2 convention).
    pub decay: bool,
    pub unit: Unit,
    /// Counted in the global gradient norm (a tied copy on a later stage is
    /// not, nor a tensor-parallel replica other than the first).
    pub norm_owner: bool,
    /// The data-parallel group that shares this tensor's gradient and shards
    /// its state (for an expert, the replicas of the same experts).
    pub group: Group,
    /// This rank's position in `group`.
    pub pos: usize,
    /// `(axis, parts, index)` of a tensor- or expert-parallel part.
    pub part: Option<(usize, usize, usize)>,
}

/// One parameter tensor a rank holds, and how.
pub(crate) struct HeldParam {
    pub key: ParamKey,
    pub unit: Unit,
    pub norm_owner: bool,
    pub group: Group,
    /// Only part `index` of `parts` along `axis` lives here (tensor or expert parallel).
    pub part: Option<(usize, usize, usize)>,
}

/// Split `n` elements over `parts` ranks in contiguous, nearly equal pieces.
pub(crate) fn split(n: usize, parts: usize) -> Vec<Range<usize>> {
    let chunk = n.div_ceil(parts);
    (0..parts)
        .map(|d| (d * chunk).min(n)..((d + 1) * chunk).min(n))
        .collect()
}

/// The initial value of one parameter tensor: keyed by (seed, param, layer,
/// element), so it is the same on every rank that holds it or a shard of it.
pub(crate) fn init_value(init: Init, seed: u64, key: ParamKey, n: usize) -> Vec<f32> {
    match init {
        Init::Zeros => vec![0.0; n],
        Init::Ones => vec![1.0; n],
        Init::Normal { std } => (0..n)
            .map(|j| {
                (std * rng::normal(&[seed, 0x1417, key.param.index() as u64, key.layer, j as u64]))
                    as f32
            })
            .collect(),
    }
}

pub(crate) struct ParamStore<S: Storage> {
    pub slots: BTreeMap<ParamKey, Slot<S>>,
    pub zero: ZeroStage,
    /// Where the vectors live and how they are summed.
    pub storage: S,
    pub comm: Communicator,
    /// The tensor- and expert-parallel groups layouts convert over.
    pub mesh: MeshGroups,
    /// ZeRO-2 and 3: whole gradients of the current micro-batch, waiting
    /// for their unit's reduce-scatter (of the step's micro-batches when
    /// `hold`).
    pending: HashMap<ParamKey, S::Buf>,
    /// ZeRO-3 keeps each unit's gathered weights and whole gradients from
    /// its first gather to the step's end ([`dplc_ir::zero3_holds_the_step`]):
    /// one all-gather and one reduce-scatter a step ([`Self::release_held`]).
    hold: bool,
    /// How the data-parallel group combines gradients. A parameter server
    /// keeps ZeRO-1's layout (each server updates its own shard of every
    /// tensor; `shards` has empty ranges for the workers that serve none).
    pub sync: GradSync,
    pub compress: Compression,
    /// Steps the compression warms up over ([`Compression::warmup_steps`]).
    pub compress_warmup: u64,
    /// Error-feedback state of top-k and PowerSGD, per held tensor.
    pub feedback: BTreeMap<ParamKey, Feedback>,
    /// Bytes the data-parallel reduction and the weights' return moved.
    pub traffic: Traffic,
    /// Async: the weights of the last `staleness + 1` versions, newest first.
    versions: VecDeque<BTreeMap<ParamKey, S::Value>>,
}

/// How a store's data-parallel group holds its state (the ZeRO stage) and
/// combines gradients, and the error-feedback state a checkpoint carried.
pub(crate) struct DpState<'a> {
    pub zero: ZeroStage,
    pub sync: GradSync,
    pub compress: Compression,
    pub compress_warmup: u64,
    pub feedback: Option<&'a BTreeMap<ParamKey, Feedback>>,
    /// Async: the older weight versions a checkpoint carried, newest first.
    pub versions: Option<Vec<BTreeMap<ParamKey, Vec<f32>>>>,
    /// A dedicated parameter server: it computes nothing, so it keeps no
    /// weight versions (and takes no weights back).
    pub server: bool,
    /// ZeRO-3 under a pipeline ([`dplc_ir::zero3_holds_the_step`]).
    pub hold: bool,
}

/// Where a rank's store comes from: its graph, the tensors it holds, its
/// links to the other ranks, and the state to start from.
pub(crate) struct StoreInit<'a> {
    pub graph: &'a Graph,
    pub keys: Vec<HeldParam>,
    pub comm: Communicator,
    pub mesh: MeshGroups,
    pub seed: u64,
    pub resume: Option<&'a BTreeMap<ParamKey, LogicalParam>>,
    pub dp_sync: DpState<'a>,
}

impl<S: Storage> ParamStore<S> {
    /// Every element of training state this rank owns (see [`OwnedShard`]),
    /// on the host.
    pub fn owned_shards(&mut self) -> Result<Vec<OwnedShard<'_>>> {
        let storage = &mut self.storage;
        let mut out = Vec::new();
        for (&key, slot) in &self.slots {
            let range = slot.shards[slot.pos].clone();
            if !slot.norm_owner || range.is_empty() {
                continue;
            }
            // Below ZeRO-1 a replica holds every element; above, its own range.
            let len = S::len(&slot.master);
            let at = if len == slot.numel {
                range.clone()
            } else {
                0..len
            };
            out.push(OwnedShard {
                key,
                part: slot.part,
                value: storage.read(&slot.master, at.clone())?,
                m: storage.read(&slot.m, at.clone())?,
                v: storage.read(&slot.v, at)?,
                range,
            });
        }
        Ok(out)
    }

    pub fn new(init: StoreInit, mut storage: S) -> Result<ParamStore<S>> {
        let StoreInit {
            graph,
            keys,
            comm,
            mesh,
            seed,
            resume,
            dp_sync,
        } = init;
        let mut slots = BTreeMap::new();
        let mut feedback = BTreeMap::new();
        // A parameter server lays its state out as ZeRO-1 does over its servers.
        let ps_shards = dp_sync.sync.ps_shards().map(|n| n.max(1) as usize);
        let zero = if ps_shards.is_some() {
            ZeroStage::One
        } else {
            dp_sync.zero
        };
        for held in keys {
            let HeldParam {
                key,
                unit,
                norm_owner,
                group,
                part,
            } = held;
            let dp = group.size();
            let pos = group.position(comm.rank()).unwrap_or(0);
            let info = graph.param(key.param);
            let mut shape: Vec<usize> = info
                .shape
                .dims()
                .iter()
                .map(|d| d.as_const().unwrap_or(0).max(0) as usize)
                .collect();
            let numel: usize = shape.iter().product();
            // The whole tensor's initial value (or its checkpointed state),
            // then this rank's part of it, so that every split starts from
            // the serial run's values.
            let whole_shape = shape.clone();
            let (mut value, mut m, mut v) = match resume {
                None => (init_value(info.init, seed, key, numel), None, None),
                Some(state) => {
                    let s = state.get(&key).ok_or_else(|| {
                        kernel_err("checkpoint", format!("{key:?} is not in the checkpoint"))
                    })?;
                    (s.value.clone(), Some(s.m.clone()), Some(s.v.clone()))
                }
            };
            if let Some((axis, parts, index)) = part {
                let mine = |x: Vec<f32>| -> Result<Vec<f32>> {
                    let whole = Tensor::f32(whole_shape.clone(), x);
                    shard::split_along(&whole, axis, parts)?
                        .swap_remove(index)
                        .into_f()
                };
                value = mine(value)?;
                m = m.map(mine).transpose()?;
                v = v.map(mine).transpose()?;
                shape[axis] /= parts;
            }
            let numel: usize = shape.iter().product();
            let dedicated = dp_sync.sync.dedicated_servers() as usize;
            let shards = match ps_shards {
                // Dedicated servers are the group's last members, after
                // the workers, which serve nothing.
                Some(servers) if dedicated > 0 => {
                    let mut s = vec![numel..numel; dp.saturating_sub(servers)];
                    s.extend(split(numel, servers));
                    s
                }
                // Co-located servers are the group's first members; the rest serve nothing.
                Some(servers) => {
                    let mut s = split(numel, servers.min(dp));
                    s.resize(dp, numel..numel);
                    s
                }
                None => split(numel, dp),
            };
            if let Some(state) = initial_feedback(&dp_sync, seed, key, &shape, numel)? {
                feedback.insert(key, state);
            }
            let own = if zero == ZeroStage::None {
                0..numel
            } else {
                shards[pos].clone()
            };
            // ZeRO-1 accumulates whole gradients over the micro-batches and
            // reduce-scatters once per step; ZeRO-2 and 3 reduce-scatter
            // each unit's gradients after its backward of every micro-batch
            // and keep only their part (what the planner prices: a
            // reduce-scatter per micro-batch, sharded gradient memory).
            let grad_len = if zero.shards_grads() {
                own.len()
            } else {
                numel
            };
            let part_of = |x: Option<Vec<f32>>| {
                x.map_or_else(|| vec![0.0; own.len()], |x| x[own.clone()].to_vec())
            };
            let (m, v) = (part_of(m), part_of(v));
            let master = storage.stage_in(value[own.clone()].to_vec())?;
            let slot = Slot {
                // Below ZeRO-1 the master is the whole tensor, which the
                // compute's copy is made from as after every step.
                full: match zero {
                    ZeroStage::Three => None,
                    ZeroStage::None => Some(storage.value(&shape, &master)?),
                    _ => Some(storage.value_from_host(&shape, value)?),
                },
                master,
                m: storage.stage_in(m)?,
                v: storage.stage_in(v)?,
                grad: storage.zeros(grad_len)?,
                decay: shape.len() >= 2,
                shape,
                numel,
                shards,
                own,
                unit,
                norm_owner,
                group,
                pos,
                part,
            };
            slots.insert(key, slot);
        }
        let staleness = dp_sync.sync.staleness() as usize;
        let mut versions = VecDeque::new();
        if staleness > 0 && !dp_sync.server {
            let mut current = BTreeMap::new();
            for (k, s) in &slots {
                let s: &Slot<S> = s;
                if let Some(f) = &s.full {
                    current.insert(*k, storage.keep(f)?);
                }
            }
            versions.push_back(current);
            for older in dp_sync.versions.into_iter().flatten().take(staleness) {
                let mut version = BTreeMap::new();
                for (key, values) in older {
                    let slot = slots.get(&key).ok_or_else(|| {
                        kernel_err("checkpoint", format!("{key:?} is not held by this rank"))
                    })?;
                    if values.len() != slot.numel {
                        return Err(kernel_err(
                            "checkpoint",
                            format!(
                                "the weight versions of {key:?} have another shape; resume \
                                 with the split they were saved with"
                            ),
                        ));
                    }
                    version.insert(key, storage.value_from_host(&slot.shape, values)?);
                }
                versions.push_back(version);
            }
        }
        Ok(ParamStore {
            slots,
            zero,
            hold: dp_sync.hold,
            storage,
            comm,
            mesh,
            pending: HashMap::new(),
            sync: dp_sync.sync,
            compress: dp_sync.compress,
            compress_warmup: dp_sync.compress_warmup,
            feedback,
            traffic: Traffic::default(),
            versions,
        })
    }

    /// The keys of the parameters of `unit` this rank holds.
    pub(crate) fn keys_of(&self, unit: Unit) -> Vec<ParamKey> {
        self.slots
            .iter()
            .filter(|(_, s)| s.unit == unit)
            .map(|(&k, _)| k)
            .collect()
    }

    /// Send a pipeline hop's values to rank `to` under `tag`, as the
    /// storage moves them ([`Storage::send`]).
    pub fn send(&mut self, to: usize, tag: u64, msg: S::Msg) -> Result<()> {
        self.storage.send(&mut self.comm, to, tag, msg)
    }

    /// What rank `from` sent under `tag` ([`Storage::recv`]).
    pub fn recv(&mut self, from: usize, tag: u64) -> Result<S::Msg> {
        self.storage.recv(&mut self.comm, from, tag)
    }

    /// ZeRO-3: all-gather the parameters of `unit` from their shards (held
    /// ones are gathered already).
    pub fn gather(&mut self, unit: Unit) -> Result<()> {
        if !self.zero.shards_weights() {
            return Ok(());
        }
        for key in self.keys_of(unit) {
            let slot = self.slots.get_mut(&key).expect("key listed from the slots");
            if self.hold && slot.full.is_some() {
                continue;
            }
            let whole = self
                .storage
                .all_gather(&mut self.comm, &slot.group, &[(&slot.master, &slot.shards)])?
                .pop()
                .ok_or_else(|| kernel_err("all_gather", "nothing gathered"))?;
            slot.full = Some(self.storage.value(&slot.shape, &whole)?);
        }
        Ok(())
    }

    /// ZeRO-2 and 3: reduce-scatter the gradients `unit` got in this
    /// micro-batch (when `reduce`); ZeRO-3 then frees its gathered parameters.
    /// Held, both wait for the step's end ([`Self::release_held`]).
    pub fn release(&mut self, unit: Unit, reduce: bool) -> Result<()> {
        if !self.zero.shards_grads() || self.hold {
            return Ok(());
        }
        self.release_keys(self.keys_of(unit), reduce)
    }

    /// The step's end under `hold`: every unit's whole gradients are
    /// reduce-scattered to this rank's shard, once, and its gathered weights
    /// freed — what PyTorch's pipeline stage runs after its last backward.
    pub fn release_held(&mut self) -> Result<()> {
        if !self.hold {
            return Ok(());
        }
        let keys: Vec<ParamKey> = self.slots.keys().copied().collect();
        self.release_keys(keys, true)
    }

    fn release_keys(&mut self, keys: Vec<ParamKey>, reduce: bool) -> Result<()> {
        for key in keys {
            let slot = self.slots.get_mut(&key).expect("key listed from the slots");
            if reduce {
                let full = match self.pending.remove(&key) {
                    Some(g) => g,
                    None => self.storage.zeros(slot.numel)?,
                };
                let part = self
                    .storage
                    .reduce_scatter(&mut self.comm, &slot.group, &[(&full, &slot.shards)])?
                    .pop()
                    .ok_or_else(|| kernel_err("reduce_scatter", "nothing reduced"))?;
                self.traffic
                    .reduce_scatter(slot.group.size(), S::len(&full) * 4);
                self.storage.add(&mut slot.grad, &part)?;
            }
            if self.zero.shards_weights() {
                slot.full = None;
            }
        }
        Ok(())
    }

    /// Add `grad` (whole, this rank's shape) to `key`'s gradient: to the
    /// accumulator below ZeRO-2, to the micro-batch's pending sum above.
    pub fn add_grad(&mut self, key: ParamKey, grad: S::Buf) -> Result<()> {
        if self.zero.shards_grads() {
            return match self.pending.get_mut(&key) {
                Some(acc) => self.storage.add(acc, &grad),
                None => {
                    self.pending.insert(key, grad);
                    Ok(())
                }
            };
        }
        let slot = self
            .slots
            .get_mut(&key)
            .ok_or_else(|| kernel_err("param", format!("{key:?} is not held by this rank")))?;
        self.storage.add(&mut slot.grad, &grad)
    }

    /// The buffer `key`'s gradient of the current micro-batch accumulates
    /// into, for a compute that adds in place where the state lives: the
    /// step's accumulator below ZeRO-2 (whole until ZeRO-1's reduce-scatter
    /// at the step's end), the micro-batch's pending sum above.
    pub fn accumulator(&mut self, key: ParamKey) -> Result<&S::Buf> {
        let slot = self
            .slots
            .get(&key)
            .ok_or_else(|| kernel_err("param", format!("{key:?} is not held by this rank")))?;
        if !self.zero.shards_grads() {
            return Ok(&slot.grad);
        }
        if !self.pending.contains_key(&key) {
            let zeros = self.storage.zeros(slot.numel)?;
            self.pending.insert(key, zeros);
        }
        Ok(&self.pending[&key])
    }

    /// `key`'s whole value as the compute reads it.
    pub fn value(&self, key: ParamKey) -> Result<S::Value> {
        let slot = self
            .slots
            .get(&key)
            .ok_or_else(|| kernel_err("param", format!("{key:?} is not held by this rank")))?;
        slot.full
            .clone()
            .ok_or_else(|| kernel_err("param", format!("{key:?} is used while not gathered")))
    }

    /// Sum `key`'s gradient over `group` (a tied weight's copies).
    pub fn all_reduce_grad(&mut self, key: ParamKey, group: &Group) -> Result<()> {
        let slot = self
            .slots
            .get_mut(&key)
            .ok_or_else(|| kernel_err("param", format!("{key:?} is not held by this rank")))?;
        self.storage
            .all_reduce(&mut self.comm, group, &mut [&mut slot.grad])
    }

    /// Sum every gradient over the data-parallel group: all-reduce in buckets
    /// of about `bucket` elements (ZeRO-0), or reduce-scatter each rank's
    /// part to it (ZeRO-1, as Megatron's distributed optimizer and the
    /// planner's price do: the optimizer step reads only that part). ZeRO-2
    /// and 3 reduced each micro-batch's gradients in [`Self::release`].
    /// `step` (0-based) places a compression in its warm-up.
    pub fn reduce_grads(&mut self, bucket: usize, step: u64) -> Result<()> {
        let steady = !self.compressed_step(step).warming_up();
        if steady {
            self.traffic.steps += 1;
        }
        if self.sync.ps_shards().is_some() {
            return self.push_to_servers();
        }
        if self.compress != Compression::None {
            return self.compressed_reduce(step);
        }
        match self.zero {
            ZeroStage::None => {
                for (group, keys) in self.by_group() {
                    self.all_reduce_buckets(&group, &keys, bucket)?;
                }
            }
            ZeroStage::One => {
                // Gradients were accumulated full-length over the micro-batches;
                // each rank keeps the sum of its own part. One reduce-scatter
                // per data-parallel group: every member's part of every
                // gradient, in key order, is one range of the flat buffer.
                for (ranks, keys) in self.by_group() {
                    let group = Group::new(ranks);
                    let pieces: Vec<Pieces<'_, S::Buf>> = keys
                        .iter()
                        .map(|k| (&self.slots[k].grad, &self.slots[k].shards[..]))
                        .collect();
                    let bytes: usize = pieces.iter().map(|(g, _)| S::len(g) * 4).sum();
                    let mine = self
                        .storage
                        .reduce_scatter(&mut self.comm, &group, &pieces)?;
                    self.traffic.reduce_scatter(group.size(), bytes);
                    for (k, part) in keys.iter().zip(mine) {
                        self.slots.get_mut(k).expect("key from the slots").grad = part;
                    }
                }
            }
            ZeroStage::Two | ZeroStage::Three => {}
        }
        Ok(())
    }

    /// Async: the weight versions older than the current weights, newest
    /// first, as a checkpoint keeps them.
    pub fn older_versions(&mut self) -> Result<Vec<BTreeMap<ParamKey, Vec<f32>>>> {
        let mut out = Vec::new();
        for version in self.versions.iter().skip(1) {
            let mut host = BTreeMap::new();
            for (k, v) in version {
                host.insert(*k, self.storage.value_to_host(v)?);
            }
            out.push(host);
        }
        Ok(out)
    }

    /// Async: compute the coming step on the weights `lag` versions old
    /// (the oldest kept where fewer exist).
    pub fn use_version(&mut self, lag: usize) {
        let Some(version) = self.versions.get(lag).or(self.versions.back()) else {
            return;
        };
        for (k, v) in version {
            if let Some(slot) = self.slots.get_mut(k) {
                slot.full = Some(v.clone());
            }
        }
    }

    /// The held tensors by data-parallel group, groups in a fixed order so
    /// that every rank runs their collectives in the same sequence.
    fn by_group(&self) -> BTreeMap<Vec<usize>, Vec<ParamKey>> {
        let mut out: BTreeMap<Vec<usize>, Vec<ParamKey>> = BTreeMap::new();
        for (k, s) in &self.slots {
            out.entry(s.group.ranks().to_vec()).or_default().push(*k);
        }
        out
    }

    fn all_reduce_buckets(
        &mut self,
        group: &[usize],
        keys: &[ParamKey],
        bucket: usize,
    ) -> Result<()> {
        let group = Group::new(group.to_vec());
        // Consecutive keys (in key order) fill a bucket up to `bucket`
        // elements; a larger tensor is a bucket of its own.
        let mut bucket_of = HashMap::with_capacity(keys.len());
        let mut sizes: Vec<usize> = Vec::new();
        for k in keys {
            let n = self.slots[k].numel;
            match sizes.last_mut() {
                Some(size) if *size + n <= bucket => *size += n,
                _ => sizes.push(n),
            }
            bucket_of.insert(*k, sizes.len() - 1);
        }
        let mut buckets: Vec<Vec<&mut S::Buf>> = sizes.iter().map(|_| Vec::new()).collect();
        for (k, slot) in self.slots.iter_mut() {
            if let Some(&b) = bucket_of.get(k) {
                buckets[b].push(&mut slot.grad);
            }
        }
        for (mut grads, size) in buckets.into_iter().zip(sizes) {
            self.storage
                .all_reduce(&mut self.comm, &group, &mut grads)?;
            self.traffic.all_reduce(group.size(), size * 4);
        }
        Ok(())
    }

    /// Σ g² over the gradient elements this rank counts towards the global norm.
    pub fn local_sq_norm(&mut self) -> Result<f64> {
        let parts: Vec<(&S::Buf, Range<usize>)> = self
            .slots
            .values()
            .filter(|s| s.norm_owner)
            .map(|s| {
                let len = S::len(&s.grad);
                let part = if len == s.numel {
                    s.shards[s.pos].clone()
                } else {
                    0..len
                };
                (&s.grad, part)
            })
            .collect();
        self.storage.sq_norm(&parts)
    }

    /// Forget this step's gradients: the next step accumulates from zero
    /// (after an optimizer step, or instead of one for a skipped step).
    pub fn discard_grads(&mut self) -> Result<()> {
        for slot in self.slots.values_mut() {
            // ZeRO-1's reduce-scatter left only this rank's part;
            // accumulation needs the whole tensor again.
            let len = if self.zero == ZeroStage::One {
                slot.numel
            } else {
                S::len(&slot.grad)
            };
            slot.grad = self.storage.zeros(len)?;
        }
        Ok(())
    }

    /// One optimizer step on this rank's part of every parameter, with the
    /// gradient multiplied by `clip`, then the parameters made whole again.
    pub fn step(&mut self, opt: &Optimizer, lr: f64, clip: f64, t: u64) -> Result<()> {
        for slot in self.slots.values_mut() {
            let at = if S::len(&slot.grad) == slot.numel {
                slot.own.start
            } else {
                0
            };
            let rule = match *opt {
                Optimizer::AdamW {
                    beta1,
                    beta2,
                    eps,
                    weight_decay,
                    ..
                } => Update::AdamW(AdamwScalars {
                    lr: lr as f32,
                    beta1: beta1 as f32,
                    beta2: beta2 as f32,
                    eps: eps as f32,
                    weight_decay: if slot.decay { weight_decay as f32 } else { 0.0 },
                    step: t,
                    grad_scale: clip as f32,
                }),
                Optimizer::Sgd { momentum, .. } => Update::Sgd(SgdScalars {
                    lr: lr as f32,
                    momentum: momentum as f32,
                    grad_scale: clip as f32,
                }),
            };
            let moments = Moments {
                master: &mut slot.master,
                m: &mut slot.m,
                v: &mut slot.v,
                grad: &slot.grad,
                at,
            };
            // Unsharded, the compute's copy is made from the master as it
            // steps (one pass on a device: `Storage::update_value`).
            if self.zero == ZeroStage::None {
                slot.full = Some(self.storage.update_value(rule, moments, &slot.shape)?);
            } else {
                self.storage.update(rule, moments)?;
            }
        }
        self.discard_grads()?;
        match self.zero {
            ZeroStage::None => {}
            ZeroStage::One if self.sync.ps_shards().is_some() => self.pull_from_servers()?,
            ZeroStage::One | ZeroStage::Two => {
                // One all-gather per data-parallel group, not one per
                // parameter: each member's updated parts, in key order. Every
                // meeting costs the ranks a wait on each other.
                for (ranks, keys) in self.by_group() {
                    let group = Group::new(ranks);
                    let pieces: Vec<Pieces<'_, S::Buf>> = keys
                        .iter()
                        .map(|k| (&self.slots[k].master, &self.slots[k].shards[..]))
                        .collect();
                    let wholes = self.storage.all_gather(&mut self.comm, &group, &pieces)?;
                    for (k, whole) in keys.iter().zip(wholes) {
                        let slot = self.slots.get_mut(k).expect("key from the slots");
                        slot.full = Some(self.storage.value(&slot.shape, &whole)?);
                    }
                }
            }
            ZeroStage::Three => {}
        }
        let keep = self.sync.staleness() as usize + 1;
        // A dedicated server keeps none (it computes nothing).
        if keep > 1 && !self.versions.is_empty() {
            let mut newest = BTreeMap::new();
            for (k, s) in &self.slots {
                if let Some(f) = &s.full {
                    newest.insert(*k, self.storage.keep(f)?);
                }
            }
            self.versions.push_front(newest);
            self.versions.truncate(keep);
        }
        Ok(())
    }

    /// Whole values of every parameter (all-gathering shards where sharded).
    pub fn export(&mut self) -> Result<Vec<(ParamKey, Tensor)>> {
        let keys: Vec<ParamKey> = self.slots.keys().copied().collect();
        let mut out = Vec::with_capacity(keys.len());
        for k in keys {
            let slot = &self.slots[&k];
            let full = if self.zero == ZeroStage::None {
                self.storage.read(&slot.master, 0..slot.numel)?.into_owned()
            } else {
                let whole = self
                    .storage
                    .all_gather(&mut self.comm, &slot.group, &[(&slot.master, &slot.shards)])?
                    .pop()
                    .ok_or_else(|| kernel_err("all_gather", "nothing gathered"))?;
                self.storage.stage_out(whole)?
            };
            out.push((k, Tensor::f32(slot.shape.clone(), full)));
        }
        Ok(out)
    }
}

impl ParamAccess for ParamStore<HostStorage> {
    fn param(&mut self, key: ParamKey) -> Result<Value> {
        self.value(key)
    }

    fn add_grad(&mut self, key: ParamKey, grad: Tensor) -> Result<()> {
        ParamStore::add_grad(self, key, grad.into_f()?)
    }

    fn layer_hook(&mut self, layer: u64, backward: bool, enter: bool) -> Result<()> {
        if enter {
            self.gather(Unit::Layer(layer))
        } else {
            self.release(Unit::Layer(layer), backward)
        }
    }

    fn convert(&mut self, v: &Tensor, from: TensorLayout, to: TensorLayout) -> Result<Tensor> {
        shard::convert(&mut self.comm, &self.mesh, v, from, to)
    }

    fn vocab_forward(&mut self, op: VocabOp, ins: &[&Tensor]) -> Result<Vec<Tensor>> {
        crate::vocab::forward(&mut self.comm, &self.mesh, op, ins)
    }

    fn vocab_backward(
        &mut self,
        op: VocabOp,
        saved: (&[&Tensor], &[&Tensor]),
        gout: &Tensor,
        need: &[bool],
    ) -> Result<Vec<Option<Tensor>>> {
        crate::vocab::backward(&mut self.comm, &self.mesh, op, saved, gout, need)
    }
}
