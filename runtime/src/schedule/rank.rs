//! What one rank does: build its store and compute, run its pipeline
//! order of forward and backward passes over each step's micro-batches,
//! then its gradient synchronisation, clipping and optimizer step, save its
//! part of the checkpoints, and hand back what it exported. Ranks are
//! threads (of this process or of several) that share [`Shared`] and meet
//! only through their communicators.

use super::*;

struct Rank<'a, 'b, S: Storage> {
    sh: &'a Shared<'b>,
    at: Coords,
    stage: usize,
    dp_index: usize,
    store: ParamStore<S>,
    pp_group: Group,
    compute: Box<dyn StageCompute<S> + 'a>,
    losses: Vec<f64>,
    step: u64,
    /// Layers the forwards of micro-batch 0 ran in the run's first step.
    layers_run: u64,
    peak_activation_bytes: u64,
    /// Steps skipped so far for a non-finite loss or gradient norm.
    skipped_nonfinite: u64,
}

fn tag(micro: usize, chunk: usize, chunks: usize, backward: bool) -> u64 {
    ((micro * chunks + chunk) as u64) * 2 + u64::from(backward)
}

pub(super) fn run_rank(
    sh: &Shared,
    comm: Communicator,
    steps: u64,
    tx: &mpsc::Sender<StepStats>,
) -> Result<RankOut> {
    let cfg = sh.cfg;
    let rank = comm.rank();
    let at = Coords::of(rank, cfg);
    let dp_index = at.dp_index;
    // A dedicated parameter server: it joins the step's collectives (the
    // pushes it sums, the norm, the loss, the pulls it sends) and runs no
    // model compute.
    let server = dp_index >= cfg.replicas();
    let group_of = |f: &dyn Fn(usize) -> Coords, n: usize| {
        Group::new((0..n).map(|i| f(i).rank(cfg)).collect())
    };
    let tp_group = group_of(&|t| Coords { tp_index: t, ..at }, cfg.tp);
    // The `n` consecutive replicas of this one's block of `n`: its expert
    // group (n = ep) and its context group (n = cp).
    let block = |n: usize| {
        let first = at.dp_index - at.dp_index % n;
        group_of(
            &|i| Coords {
                dp_index: first + i,
                ..at
            },
            n,
        )
    };
    let ep_group = block(cfg.ep);
    let held = held::rank_keys(sh, at);
    // Top-k and PowerSGD carry their error feedback over a checkpoint.
    let feedback = match &sh.resume {
        Some(resume) if cfg.compress.has_feedback() => Some(checkpoint::read_feedback(
            &resume.dir,
            rank,
            sh.graph,
            held.iter().map(|h| h.key),
        )?),
        _ => None,
    };
    // Async carries the older weight versions its stale workers read.
    let versions = match &sh.resume {
        Some(resume) if cfg.sync.staleness() > 0 && !server => {
            let keys: Vec<_> = held.iter().map(|h| h.key).collect();
            Some(checkpoint::read_versions(
                &resume.dir,
                rank,
                sh.graph,
                &keys,
            )?)
        }
        _ => None,
    };
    let cp_group = block(cfg.cp);
    let init = StoreInit {
        graph: sh.graph,
        keys: held,
        comm,
        mesh: MeshGroups {
            tp: tp_group,
            ep: ep_group,
            cp: cp_group,
            skip_partial_sum: cfg.faults.skip_tp_sum,
        },
        seed: sh.seed,
        resume: sh.resume.as_ref().map(|r| &r.params),
        dp_sync: DpState {
            zero: cfg.zero,
            sync: cfg.sync,
            compress: cfg.compress,
            compress_warmup: cfg.compress.warmup_steps(&sh.spec.schedule),
            feedback: feedback.as_ref(),
            versions,
            server,
            hold: dplc_ir::zero3_holds_the_step(cfg.zero.stage(), cfg.pp as u64),
        },
    };
    // The reference keeps the state on the host; the fused compute keeps it
    // where its kernels run, in its backend's buffers. A dedicated server
    // computes nothing, so it holds its shards on the host.
    let fused_plan = || {
        sh.fused
            .as_ref()
            .ok_or_else(|| RuntimeError::Config("a fused run without its fused plan".into()))
    };
    match cfg.compute {
        Compute::Fused if !server => match cfg.device {
            Device::Host => {
                let be = HostBackend::with_storage(cfg.host_storage).sharing(sh.shelf.clone());
                let compute = Box::new(fused::Fused::new(sh, fused_plan()?, be.handle()));
                // Rank threads of one process share the host's memory as
                // ranks share a GPU: they hand each other buffers. Ranks in
                // other processes stage through the communicator.
                if sh.remote {
                    let store = ParamStore::new(init, DeviceStorage::new(be, HostStaged))?;
                    drive(sh, at, server, store, compute, steps, tx)
                } else {
                    let links = crate::params::SharedDevice::new(1, cfg.world_size());
                    let store = ParamStore::new(init, DeviceStorage::new(be, links))?;
                    drive(sh, at, server, store, compute, steps, tx)
                }
            }
            Device::Cuda { dtype, .. } => {
                let dev = sh
                    .gpus
                    .get(sh.cfg.gpu_of(rank).unwrap_or(0))
                    .cloned()
                    .flatten()
                    .ok_or_else(|| RuntimeError::Config(format!("rank {rank} has no GPU")))?;
                // Two handles on the one device: the compute's and the
                // store's (its allocator and stream are the device's).
                let be = crate::gpu::CudaBackend::new(dev.clone(), dtype)?;
                let handle = crate::gpu::CudaBackend::new(dev.clone(), dtype)?;
                let compute = Box::new(fused::Fused::new(sh, fused_plan()?, handle));
                match sh.collectives {
                    Collectives::Nccl => {
                        let links = crate::gpu::NcclLinks::new(dev);
                        let store = ParamStore::new(init, DeviceStorage::new(be, links))?;
                        drive(sh, at, server, store, compute, steps, tx)
                    }
                    Collectives::HostStaged => {
                        let store = ParamStore::new(init, DeviceStorage::new(be, HostStaged))?;
                        drive(sh, at, server, store, compute, steps, tx)
                    }
                    Collectives::SharedDevice => {
                        let links =
                            crate::params::SharedDevice::new(sh.gpus.len(), cfg.world_size());
                        let store = ParamStore::new(init, DeviceStorage::new(be, links))?;
                        drive(sh, at, server, store, compute, steps, tx)
                    }
                }
            }
        },
        _ => {
            let store = ParamStore::new(init, HostStorage)?;
            drive(
                sh,
                at,
                server,
                store,
                Box::new(Reference::new(sh)),
                steps,
                tx,
            )
        }
    }
}

/// Run rank `at`'s steps over its store and compute, and hand back what
/// it exported.
fn drive<'a, S: Storage>(
    sh: &'a Shared,
    at: Coords,
    server: bool,
    store: ParamStore<S>,
    compute: Box<dyn StageCompute<S> + 'a>,
    steps: u64,
    tx: &mpsc::Sender<StepStats>,
) -> Result<RankOut> {
    let cfg = sh.cfg;
    let rank = store.comm.rank();
    let (dp_index, stage) = (at.dp_index, at.stage);
    let pp_group = Group::new(
        (0..cfg.pp)
            .map(|s| Coords { stage: s, ..at }.rank(cfg))
            .collect(),
    );
    let mut r = Rank {
        sh,
        at,
        stage,
        dp_index,
        store,
        pp_group,
        compute,
        losses: Vec::new(),
        step: sh.start_step,
        layers_run: 0,
        peak_activation_bytes: 0,
        skipped_nonfinite: 0,
    };
    let work = if server {
        Vec::new()
    } else {
        schedule(cfg.schedule, stage, cfg.pp, cfg.num_micro_batches)
    };
    let world = Group::new((0..cfg.ranks()).collect());
    // Each process has its own clock: traced ranks in separate processes
    // count from a barrier they leave together (to within one message).
    let t0 = if sh.remote && cfg.trace.is_on() {
        r.store.comm.all_reduce(&world, &mut [0.0])?;
        Instant::now()
    } else {
        sh.started
    };
    let mut done = sh.start_step;
    let mut saved = None;
    for step in sh.start_step..steps {
        let start = Instant::now();
        r.step = step;
        r.store.comm.set_step(step);
        // Every rank stops at the same step boundary, or none does.
        let mut stop = vec![if cfg.stop.is_set() { 1.0 } else { 0.0 }];
        if cfg.ranks() > 1 {
            r.store.comm.all_reduce(&world, &mut stop)?;
        }
        if stop[0] > 0.0 {
            break;
        }
        if cfg.faults.fail_rank_at == Some((rank, step)) {
            return Err(RuntimeError::Kernel {
                op: "rank",
                detail: format!("injected failure at step {step}"),
            });
        }
        if cfg.faults.exit_rank_at == Some((rank, step)) {
            eprintln!("rank {rank} failed at step {step}: its process exits (DPLC_FAULT)");
            std::process::exit(1);
        }
        if cfg.faults.panic_rank_at == Some((rank, step)) {
            panic!("injected panic at step {step}");
        }
        if cfg.faults.stall_rank_at == Some((rank, step)) {
            // Hang until a peer gives up on this rank, then leave quietly:
            // the peer's timeout is the error the run reports.
            let world = r.store.comm.world().clone();
            while world.failure().is_none() {
                std::thread::sleep(Duration::from_millis(20));
            }
            let (failed, reason) = world.failure().expect("just seen");
            return Err(RuntimeError::RankFailed {
                rank: failed,
                reason,
            });
        }
        let span = |kind, micro, chunk, from: Instant| TraceSpan {
            rank,
            stage,
            dp_index,
            tp_index: at.tp_index,
            step,
            kind,
            micro_batch: micro,
            chunk,
            start_us: from.duration_since(t0).as_secs_f64() * 1e6,
            duration_us: from.elapsed().as_secs_f64() * 1e6,
        };
        // Async with staleness K: replica d computes on the weights
        // d mod (K+1) versions old, so the replicas spread over every lag
        // the bound allows, the same way every run.
        let staleness = cfg.sync.staleness() as usize;
        if staleness > 0 && !server {
            r.store.use_version(dp_index % (staleness + 1));
        }
        for &w in &work {
            let from = Instant::now();
            match w {
                Work::Forward { micro, chunk } => {
                    r.forward(micro, chunk)?;
                    if cfg.trace.is_on() {
                        cfg.trace.push(span("forward", micro, chunk, from));
                    }
                }
                Work::Backward { micro, chunk } => {
                    r.backward(micro, chunk)?;
                    if cfg.trace.is_on() {
                        cfg.trace.push(span("backward", micro, chunk, from));
                    }
                }
            }
        }
        let from = Instant::now();
        let stats = r.finish_step(start)?;
        if cfg.trace.is_on() {
            cfg.trace.push(span("step", 0, 0, from));
        }
        if rank == 0 {
            // The receiver only goes away when the run is over; nothing to do then.
            let _ = tx.send(stats);
        }
        done = step + 1;
        if let Some(ck) = &cfg.checkpoint {
            if ck.every > 0 && done.is_multiple_of(ck.every) {
                r.save(done)?;
                saved = Some(done);
            }
        }
    }
    // The end of a run, finished or stopped, is saved too.
    if cfg.checkpoint.is_some() && done > sh.start_step && saved != Some(done) {
        r.save(done)?;
    }
    if sh.remote && cfg.trace.is_on() {
        gather_trace(&mut r.store.comm, cfg)?;
    }
    let exported = r.store.export()?;
    let traffic = r.store.traffic;
    let out = |exported| RankOut {
        rank,
        traffic,
        stage,
        peak_activation_bytes: r.peak_activation_bytes,
        device_peak_bytes: r.store.storage.peak_bytes(),
        host_crossings: r.store.storage.host_crossings(),
        layers_run: r.layers_run,
        exported,
    };
    // The first expert-parallel group holds every part once.
    if r.dp_index >= cfg.ep {
        return Ok(out(Vec::new()));
    }
    Ok(out(exported
        .into_iter()
        .map(|(key, value)| {
            let part = match sh.layouts.as_ref().and_then(|l| l.param(key.param)) {
                None => None,
                Some(SplitAxis::Tensor { axis }) => Some((axis, r.at.tp_index)),
                Some(SplitAxis::Expert) => Some((0, r.dp_index % cfg.ep)),
            };
            Exported { key, value, part }
        })
        .collect()))
}

/// The kinds of span a trace records, by their index on the wire.
const SPAN_KINDS: [&str; 3] = ["forward", "backward", "step"];

/// Send every rank's trace spans to rank 0 (each process's sink holds only
/// its own rank's), which adds them to its sink. A span travels as eight
/// f32s; its times as two each (the value and what `f32` rounding left), so
/// microseconds survive hours of run.
fn gather_trace(comm: &mut Communicator, cfg: &RunConfig) -> Result<()> {
    let split = |x: f64| {
        let hi = x as f32;
        [hi, (x - f64::from(hi)) as f32]
    };
    let mine: Vec<f32> = cfg
        .trace
        .spans()
        .iter()
        .filter(|s| s.rank == comm.rank())
        .flat_map(|s| {
            let kind = SPAN_KINDS.iter().position(|k| *k == s.kind).unwrap_or(0);
            let [s0, s1] = split(s.start_us);
            let [d0, d1] = split(s.duration_us);
            [
                s.step as f32,
                kind as f32,
                s.micro_batch as f32,
                s.chunk as f32,
                s0,
                s1,
                d0,
                d1,
            ]
        })
        .collect();
    let world = Group::new((0..cfg.ranks()).collect());
    let all = comm.all_gather(&world, &mine)?;
    if comm.rank() != 0 {
        return Ok(());
    }
    for (rank, spans) in all.iter().enumerate().skip(1) {
        let at = Coords::of(rank, cfg);
        for s in spans.chunks_exact(8) {
            cfg.trace.push(TraceSpan {
                rank,
                stage: at.stage,
                dp_index: at.dp_index,
                tp_index: at.tp_index,
                step: s[0] as u64,
                kind: SPAN_KINDS[(s[1] as usize).min(SPAN_KINDS.len() - 1)],
                micro_batch: s[2] as usize,
                chunk: s[3] as usize,
                start_us: f64::from(s[4]) + f64::from(s[5]),
                duration_us: f64::from(s[6]) + f64::from(s[7]),
            });
        }
    }
    Ok(())
}

impl<S: Storage> Rank<'_, '_, S> {
    fn chunks(&self) -> usize {
        self.sh.part.chunks.len()
    }

    fn peer(&self, chunk: usize) -> usize {
        Coords {
            stage: chunk % self.sh.cfg.pp,
            ..self.at
        }
        .rank(self.sh.cfg)
    }

    /// The global index of this rank's first sample of micro-batch `micro`
    /// in the current step: the data position carries over a checkpoint.
    fn first_sample(&self, micro: usize) -> u64 {
        let sh = self.sh;
        let cfg = sh.cfg;
        sh.sample_base
            + (self.step - sh.start_step) * cfg.global_batch() as u64
            + ((micro * cfg.dp + self.dp_index / cfg.cp) * cfg.micro_batch) as u64
    }

    /// Save the checkpoint after `done` steps: rank 0 readies the step
    /// directory, every rank writes its shards, and once all are in place
    /// rank 0 writes the manifest.
    fn save(&mut self, done: u64) -> Result<()> {
        let sh = self.sh;
        let cfg = sh.cfg;
        let Some(ck) = &cfg.checkpoint else {
            return Ok(());
        };
        let rank = self.store.comm.rank();
        let dir = checkpoint::step_dir(&ck.dir, done);
        let kill = cfg
            .faults
            .kill_in_checkpoint
            .filter(|k| k.rank == rank && k.step == done)
            .map(|k| k.at);
        let world = Group::new((0..cfg.ranks()).collect());
        let barrier = |store: &mut ParamStore<S>| -> Result<()> {
            if cfg.ranks() > 1 {
                store.comm.all_reduce(&world, &mut [0.0])?;
            }
            Ok(())
        };
        if rank == 0 {
            checkpoint::prepare_step_dir(&dir)?;
        }
        barrier(&mut self.store)?;
        checkpoint::write_shards(&dir, rank, sh.graph, self.store.owned_shards()?, kill)?;
        checkpoint::write_feedback(&dir, rank, sh.graph, &self.store.feedback)?;
        if cfg.sync.staleness() > 0 && self.dp_index < cfg.replicas() {
            let older = self.store.older_versions()?;
            checkpoint::write_versions(&dir, rank, sh.graph, &older)?;
        }
        barrier(&mut self.store)?;
        if rank == 0 {
            let gb = cfg.global_batch() as u64;
            let info = checkpoint::ManifestInfo {
                step: done,
                seed: sh.seed,
                data: checkpoint::DataPosition {
                    next_sample: sh.sample_base + (done - sh.start_step) * gb,
                    global_batch: gb,
                    seq: sh.seq as u64,
                },
                optimizer: &sh.spec.optimizer,
                split: checkpoint::SavedSplit {
                    dp: cfg.dp,
                    cp: cfg.cp,
                    tp: cfg.tp,
                    pp: cfg.pp,
                    ep: cfg.ep,
                    zero: cfg.zero.stage(),
                    micro_batch: cfg.micro_batch,
                    num_micro_batches: cfg.num_micro_batches,
                    sequence_parallel: cfg.sequence_parallel,
                },
                model: &sh.signature,
                world: cfg.ranks(),
                run: &sh
                    .lock
                    .as_ref()
                    .ok_or_else(|| {
                        RuntimeError::Config("rank 0 saves without holding the directory".into())
                    })?
                    .run,
            };
            let dir = checkpoint::write_manifest(&dir, info, kill)?;
            sh.saved
                .lock()
                .unwrap_or_else(|poisoned| poisoned.into_inner())
                .push(dir);
        }
        Ok(())
    }

    fn pass(&self, micro: usize, chunk: usize) -> Pass {
        Pass {
            micro,
            chunk,
            step: self.step,
            first_sample: self.first_sample(micro),
            cp_rank: self.dp_index % self.sh.cfg.cp,
            tp_rank: self.at.tp_index,
        }
    }

    /// Every input of micro-batch `micro`, as [`feeds`] says: `seq`-token
    /// windows of the stream for `tokens` and `targets`, the samples of
    /// each other input.
    fn inputs(&self, micro: usize) -> HashMap<dplc_ir::TensorId, Value> {
        let sh = self.sh;
        let first = self.first_sample(micro);
        let samples = first..first + sh.cfg.micro_batch as u64;
        let windows: Vec<(Vec<i32>, Vec<i32>)> = if sh.feeds.iter().any(|(_, f)| f.is_stream()) {
            samples.clone().map(|i| sh.data.sample(i, sh.seq)).collect()
        } else {
            Vec::new()
        };
        let mut out = HashMap::new();
        for (t, feed) in sh.feeds.iter() {
            let shape = |per: &[usize]| {
                let mut s = vec![sh.cfg.micro_batch];
                s.extend(per);
                s
            };
            let v = match feed {
                Feed::Tokens => Tensor::i32(
                    shape(&[sh.seq]),
                    windows.iter().flat_map(|w| w.0.clone()).collect(),
                ),
                Feed::Targets => Tensor::i32(
                    shape(&[sh.seq]),
                    windows.iter().flat_map(|w| w.1.clone()).collect(),
                ),
                &Feed::Samples {
                    ref name,
                    int,
                    shape: ref per,
                    bound,
                } => {
                    let numel = per.iter().product();
                    let draws = samples
                        .clone()
                        .map(|i| sh.data.input_sample(name, int, numel, bound, i));
                    let mut data = if int {
                        crate::Data::I32(Vec::new())
                    } else {
                        crate::Data::F32(Vec::new())
                    };
                    for d in draws {
                        match (&mut data, d) {
                            (crate::Data::I32(a), crate::Data::I32(b)) => a.extend(b),
                            (crate::Data::F32(a), crate::Data::F32(b)) => a.extend(b),
                            _ => unreachable!("input_sample returns the input's kind"),
                        }
                    }
                    Tensor {
                        shape: shape(per),
                        data,
                    }
                }
            };
            out.insert(*t, Arc::new(v));
        }
        out
    }

    /// [`Rank::inputs`] at this rank's sequence positions under context
    /// parallelism (`dplc_ir::context_chunks`): every input along `seq`.
    fn local_inputs(&self, micro: usize) -> Result<HashMap<dplc_ir::TensorId, Value>> {
        let sh = self.sh;
        let mut out = self.inputs(micro);
        let seq = sh.graph.sym_by_name("seq");
        if sh.cfg.cp > 1 {
            let pos = self.dp_index % sh.cfg.cp;
            for (_, input) in sh.graph.inputs() {
                let along = input
                    .shape
                    .dims()
                    .iter()
                    .position(|d| seq.is_some_and(|s| *d == dplc_ir::Dim::sym(s)));
                if let (Some(axis), Some(v)) = (along, out.get_mut(&input.tensor)) {
                    *v = Arc::new(crate::shard::take_chunks(v, axis, sh.cfg.cp, pos)?);
                }
            }
        }
        Ok(out)
    }

    fn forward(&mut self, micro: usize, c: usize) -> Result<()> {
        let sh = self.sh;
        let received = if c > 0 {
            self.store
                .recv(self.peer(c - 1), tag(micro, c, self.chunks(), false))?
        } else {
            S::Msg::default()
        };
        if micro == 0 && self.step == sh.start_step {
            let layers = &sh.part.chunks[c].layers;
            self.layers_run += layers.end - layers.start;
        }
        let pass = self.pass(micro, c);
        let inputs = self.local_inputs(micro)?;
        self.store.gather(Unit::Root)?;
        let out = self
            .compute
            .forward(&pass, &inputs, received, &mut self.store)?;
        self.store.release(Unit::Root, false)?;
        match out {
            Forwarded::Loss(loss) => self.losses.push(loss),
            Forwarded::Send(msg) => self.store.send(
                self.peer(c + 1),
                tag(micro, c + 1, self.chunks(), false),
                msg,
            )?,
        }
        // Every step runs the same schedule on the same shapes, so the first
        // step's peak is every step's: the walk over the live values stays
        // off the later steps' path.
        if self.step == sh.start_step {
            self.peak_activation_bytes = self
                .peak_activation_bytes
                .max(self.compute.activation_bytes());
        }
        Ok(())
    }

    fn backward(&mut self, micro: usize, c: usize) -> Result<()> {
        let received = if c + 1 == self.chunks() {
            None
        } else {
            Some(
                self.store
                    .recv(self.peer(c + 1), tag(micro, c, self.chunks(), true))?,
            )
        };
        let pass = self.pass(micro, c);
        self.store.gather(Unit::Root)?;
        let msg = self.compute.backward(&pass, received, &mut self.store)?;
        self.store.release(Unit::Root, true)?;
        if c > 0 {
            self.store.send(
                self.peer(c - 1),
                tag(micro, c - 1, self.chunks(), true),
                msg,
            )?;
        }
        Ok(())
    }

    /// Gradient sync, norm, clipping, optimizer step and the step's statistics.
    fn finish_step(&mut self, start: Instant) -> Result<StepStats> {
        let sh = self.sh;
        let cfg = sh.cfg;
        // ZeRO-3 under a pipeline reduce-scatters the step's gradients now,
        // after the stage's last backward.
        self.store.release_held()?;
        // Tied weights (an embedding reused by the head on another stage):
        // every copy gets the sum of the copies' gradients.
        for (key, stages) in &sh.tied {
            if !stages.contains(&self.stage) {
                continue;
            }
            let group = Group::new(
                stages
                    .iter()
                    .map(|&s| {
                        Coords {
                            stage: s,
                            ..self.at
                        }
                        .rank(cfg)
                    })
                    .collect(),
            );
            self.store.all_reduce_grad(*key, &group)?;
        }
        if !cfg.faults.skip_grad_sync {
            self.store.reduce_grads(cfg.bucket_elems, self.step)?;
        }
        // Every gradient element is counted by exactly one rank of the world.
        let mut sq = vec![self.store.local_sq_norm()? as f32];
        if cfg.faults.nan_grad_at == Some((self.store.comm.rank(), self.step)) {
            sq[0] = f32::NAN;
        }
        let world = Group::new((0..cfg.ranks()).collect());
        self.store.comm.all_reduce(&world, &mut sq)?;
        // The loss reaches the dedicated servers too (they add nothing to
        // it): every rank takes the same skip decision.
        let dp_group = Group::new(
            (0..cfg.replicas() + cfg.server_replicas())
                .map(|d| {
                    Coords {
                        dp_index: d,
                        ..self.at
                    }
                    .rank(cfg)
                })
                .collect(),
        );
        let grad_norm = f64::from(sq[0]).sqrt();
        let clip = match sh.spec.grad_clip {
            Some(max) if grad_norm > max => max / (grad_norm + 1e-6),
            _ => 1.0,
        };
        // The loss lives on the last stage: sum it over replicas, then hand it to every stage.
        let mut loss = vec![self.losses.drain(..).sum::<f64>() as f32];
        self.store.comm.all_reduce(&dp_group, &mut loss)?;
        let mut loss_v = loss.clone();
        self.store
            .comm
            .broadcast(&self.pp_group, cfg.pp - 1, &mut loss_v)?;
        let loss = f64::from(loss_v[0]) / (cfg.replicas() * cfg.num_micro_batches) as f64;
        let lr = sh.spec.optimizer.lr() * sh.spec.schedule.factor(self.step);
        // Every rank sees the same loss and norm, so all decide alike: a
        // non-finite step is skipped (its gradients dropped, the parameters
        // and moments untouched) while the allowance lasts, else the run
        // stops here, before the step can poison the state.
        let skipped = !(loss.is_finite() && grad_norm.is_finite());
        if skipped {
            if self.skipped_nonfinite >= cfg.skip_nonfinite {
                return Err(RuntimeError::NonFinite {
                    step: self.step,
                    loss,
                    grad_norm,
                    skipped: self.skipped_nonfinite,
                });
            }
            self.skipped_nonfinite += 1;
            self.store.discard_grads()?;
        } else {
            self.store
                .step(&sh.spec.optimizer, lr, clip, self.step + 1)?;
        }
        let seconds = start.elapsed().as_secs_f64().max(1e-9);
        let samples_per_s = cfg.global_batch() as f64 / seconds;
        Ok(StepStats {
            step: self.step,
            loss,
            lr,
            grad_norm,
            samples_per_s,
            tokens_per_s: sh
                .graph
                .sym_by_name("seq")
                .map(|_| samples_per_s * sh.seq as f64),
            skipped,
        })
    }
}
