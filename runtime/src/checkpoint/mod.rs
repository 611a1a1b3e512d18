//! Sharded checkpoints: each rank writes the parameter and optimizer-state
//! shards it owns to its own safetensors file, rank 0 writes a JSON manifest
//! last; loading verifies every file, reassembles the logical (unsharded)
//! tensors, and each rank of any plan slices what its layout and ZeRO stage hold.
//!
//! On disk, `DIR/step-000006/` holds `rank-00000.safetensors` … one per rank
//! and `manifest.json`. One file per rank, not one per tensor: a rank's
//! shards are many small flat slices (a ZeRO shard is a range of the
//! flattened tensor, not a block), and one file per rank is one create, one
//! fsync and one rename per rank per checkpoint, written in parallel by the
//! ranks without coordination. Each file stores, for every tensor part the
//! rank owns, three 1-D f32 tensors `NAME[LAYER].value|m|v` (master weights,
//! AdamW's first and second moments or SGD's momentum in `m`), and in its
//! safetensors metadata where each slice lies in the logical tensor (`dplc.shards`:
//! parameter name, layer, tensor-/expert-parallel part, flat range in the part).
//! A rank owns an element when it counts it in the global gradient norm
//! (`Slot::norm_owner`: one tensor-parallel replica, the first stage of a tied
//! weight) and it lies in its data-parallel shard, so every element is
//! written exactly once whatever the plan.
//!
//! The rest of the training state is small and lives in the manifest: the
//! step, the RNG (counter-based, see `rng.rs`: its whole state is the seed
//! and the step), the data position (the next global sample index), the
//! optimizer kind, the split it was saved under, the model's parameter
//! signature, and each file's size and SHA-256 (a well-kept hash: a flipped
//! byte anywhere is refused, not just a truncation).
//!
//! Writes are atomic: `name.tmp`, fsync, rename, fsync the directory; the
//! manifest goes last, after every rank's file is in place, so a directory
//! without `manifest.json` is an incomplete checkpoint that `latest`
//! resolution skips, and a crash mid-write leaves the previous step's
//! directory intact. Rank 0 checksums the files by reading them back, which
//! assumes (like every multi-rank checkpointer) a directory all ranks see.
//! Loading reads and checks everything (sizes, checksums, dtypes, shapes,
//! full coverage of every tensor) before any rank is built: a bad file is an
//! error naming it, and nothing is partially loaded. The logical state is
//! held once in the process (the CPU runtime's ranks are threads); a
//! multi-process launch can have each rank read only the files whose
//! `dplc.shards` ranges overlap its slices, which this format allows.

use crate::error::{Result, RuntimeError};
use crate::interp::ParamKey;
use crate::params::{LogicalParam, OwnedShard};
use crate::shard::concat_along;
use crate::tensor::Tensor;
use dplc_ir::{Graph, Optimizer, ParamId};
use safetensors::tensor::{Dtype, SafeTensors, TensorView};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::io::Write;
use std::ops::Range;
use std::path::{Path, PathBuf};

mod disk;
mod load;
mod side;

use disk::{killed, latest_step_dir, sha256_hex, write_atomic};
pub(crate) use disk::{lock_dir, prepare_step_dir, DirLock};
pub(crate) use load::load;
pub(crate) use side::{
    read_feedback, read_versions, saved_versions, write_feedback, write_versions,
};

const FORMAT: &str = "dplc-checkpoint";
/// Version 2 adds the run that wrote a checkpoint and the manifest's own
/// checksum; version 1 checkpoints still load (unprotected, run unknown).
const VERSION: u32 = 2;
const OLDEST_VERSION: u32 = 1;
/// The lock file a saving run holds in its checkpoint directory.
const LOCK: &str = ".dplc-lock";
const MANIFEST: &str = "manifest.json";
const SHARDS_KEY: &str = "dplc.shards";

/// Where and how often a run saves checkpoints.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CheckpointConfig {
    /// Each checkpoint is a `step-NNNNNN` directory in here.
    pub dir: PathBuf,
    /// Save after every `every` steps; 0 saves only when the run ends (it
    /// also saves then when `every` is set, and when a run is stopped).
    pub every: u64,
}

/// Where a test kills a rank while it writes a checkpoint.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KillPoint {
    /// Half of the rank's shard file is in its temporary file.
    MidShard,
    /// The rank's shard file is in place; the manifest is not written.
    AfterShard,
    /// (rank 0) Every shard is in place and half the manifest is in its
    /// temporary file.
    MidManifest,
}

/// A checkpoint fault: `rank` dies at `at` while saving after step `step`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CheckpointKill {
    pub rank: usize,
    /// The number of completed steps the checkpoint is for.
    pub step: u64,
    pub at: KillPoint,
}

/// The split a checkpoint was saved under (for messages; loading reshards).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct SavedSplit {
    pub dp: usize,
    /// Context-parallel ranks per replica (absent before context
    /// parallelism ran: 1).
    #[serde(default = "one")]
    pub cp: usize,
    pub tp: usize,
    pub pp: usize,
    pub ep: usize,
    pub zero: u8,
    pub micro_batch: usize,
    pub num_micro_batches: usize,
    pub sequence_parallel: bool,
}

fn one() -> usize {
    1
}

/// The counter-based RNG's whole state.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
struct RngState {
    seed: u64,
    /// The next step's counter: dropout keys are (seed, step, …).
    step: u64,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct DataPosition {
    /// The global index of the next sample to train on.
    pub next_sample: u64,
    pub global_batch: u64,
    pub seq: u64,
}

/// One parameter of the model: the checkpoint's model signature.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct SavedParam {
    pub name: String,
    pub shape: Vec<usize>,
    /// Layer instances (1 outside a `repeat`).
    pub layers: u64,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
struct FileEntry {
    file: String,
    rank: usize,
    bytes: u64,
    sha256: String,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
struct Manifest {
    format: String,
    version: u32,
    /// Completed optimizer steps.
    step: u64,
    rng: RngState,
    data: DataPosition,
    /// `adamw` or `sgd`: what `m` and `v` mean.
    optimizer: String,
    split: SavedSplit,
    model: Vec<SavedParam>,
    files: Vec<FileEntry>,
    /// The run that wrote it (absent before version 2).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    run: Option<RunTag>,
    /// SHA-256 of this manifest written without this field (absent before
    /// version 2): an edited step or seed is refused, not resumed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    checksum: Option<String>,
}

impl Manifest {
    /// The text written to disk, and the checksum it is covered by.
    fn sealed_checksum(&self) -> Result<String> {
        let bare = Manifest {
            checksum: None,
            ..self.clone()
        };
        let text = serde_json::to_string_pretty(&bare)
            .map_err(|e| RuntimeError::Config(format!("cannot write the manifest: {e}")))?;
        Ok(sha256_hex(text.as_bytes()))
    }
}

/// Which run wrote a checkpoint. `seq` orders the runs that saved into one
/// directory (each takes one more than the highest it finds there), so
/// `--resume DIR` continues the latest run, not an older run's later step.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct RunTag {
    pub id: String,
    pub seq: u64,
}

/// A tensor- or expert-parallel part: `index` of `parts` along `axis`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
struct PartSpec {
    axis: usize,
    parts: usize,
    index: usize,
}

/// Where one stored slice lies in its logical tensor.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
struct ShardEntry {
    param: String,
    layer: u64,
    part: Option<PartSpec>,
    /// Flat element range within the part (the whole tensor without a part).
    start: usize,
    end: usize,
}

fn err(path: &Path, detail: impl Into<String>) -> RuntimeError {
    RuntimeError::Checkpoint {
        path: path.to_path_buf(),
        detail: detail.into(),
    }
}

fn io_err(path: &Path, what: &str, e: std::io::Error) -> RuntimeError {
    err(path, format!("cannot {what}: {e}"))
}

/// The directory of the checkpoint taken after `step` completed steps.
pub(crate) fn step_dir(root: &Path, step: u64) -> PathBuf {
    root.join(format!("step-{step:06}"))
}

fn rank_file(rank: usize) -> String {
    format!("rank-{rank:05}.safetensors")
}

fn optimizer_kind(opt: &Optimizer) -> &'static str {
    match opt {
        Optimizer::AdamW { .. } => "adamw",
        Optimizer::Sgd { .. } => "sgd",
    }
}

/// A complete checkpoint on disk whose manifest has been read (its files
/// are checked when a run loads it).
#[derive(Clone, Debug, PartialEq)]
pub struct Checkpoint {
    dir: PathBuf,
    manifest: Manifest,
}

impl Checkpoint {
    /// Open `path`: a step directory with a `manifest.json`, or a checkpoint
    /// directory, whose latest complete step directory is taken (one
    /// without a manifest was cut short while being written, and is skipped).
    pub fn open(path: &Path) -> Result<Checkpoint> {
        // `DIR/step-3` names `DIR/step-000003`: the step as a person types it.
        let padded = path
            .file_name()
            .and_then(|n| n.to_str()?.strip_prefix("step-")?.parse::<u64>().ok())
            .zip(path.parent())
            .map(|(step, root)| step_dir(root, step));
        let path = match padded {
            Some(p) if !path.is_dir() && p.is_dir() => p,
            _ => path.to_path_buf(),
        };
        let path = path.as_path();
        if !path.is_dir() {
            return Err(err(
                path,
                "no such directory; pass the --checkpoint-dir of an earlier run, or one of its step-N directories",
            ));
        }
        let dir = if path.join(MANIFEST).is_file() {
            path.to_path_buf()
        } else {
            latest_step_dir(path)?.ok_or_else(|| {
                err(
                    path,
                    "holds no complete checkpoint (a step-N directory with a manifest.json); \
                     save one with `dplc run --checkpoint-dir`",
                )
            })?
        };
        let manifest_path = dir.join(MANIFEST);
        let manifest = read_manifest(&manifest_path)?;
        check_manifest(&manifest_path, &manifest)?;
        Ok(Checkpoint { dir, manifest })
    }

    /// The step directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Completed optimizer steps.
    pub fn step(&self) -> u64 {
        self.manifest.step
    }

    /// The seed of the run (parameters, data order, dropout).
    pub fn seed(&self) -> u64 {
        self.manifest.rng.seed
    }

    /// The split it was saved under, e.g. `dp 1 × tp 2 × pp 2, ZeRO-1`.
    pub fn split(&self) -> String {
        let s = &self.manifest.split;
        let mut out = format!("dp {} × tp {} × pp {}", s.dp, s.tp, s.pp);
        if s.cp > 1 {
            out.push_str(&format!(", cp {}", s.cp));
        }
        if s.ep > 1 {
            out.push_str(&format!(", ep {}", s.ep));
        }
        if s.zero > 0 {
            out.push_str(&format!(", ZeRO-{}", s.zero));
        }
        out
    }

    /// The sequence length and global batch it trained at.
    pub fn seq_and_batch(&self) -> (u64, u64) {
        let d = &self.manifest.data;
        (d.seq, d.global_batch)
    }

    /// The degrees it was saved under: dp, cp, tp, pp, ep.
    pub(crate) fn degrees(&self) -> [usize; 5] {
        let s = &self.manifest.split;
        [s.dp, s.cp, s.tp, s.pp, s.ep]
    }

    /// The id of the run that saved it (checkpoints before version 2: none).
    pub fn run_id(&self) -> Option<&str> {
        self.manifest.run.as_ref().map(|r| r.id.as_str())
    }

    fn manifest_path(&self) -> PathBuf {
        self.dir.join(MANIFEST)
    }
}

/// Read and parse `path`, a manifest (checked by [`check_manifest`]).
fn read_manifest(path: &Path) -> Result<Manifest> {
    let text = std::fs::read_to_string(path).map_err(|e| io_err(path, "read the manifest", e))?;
    serde_json::from_str(&text).map_err(|e| {
        err(
            path,
            format!(
                "is not a valid checkpoint manifest ({e}); resume from another step-N directory"
            ),
        )
    })
}

/// A manifest this dplc reads, whole as it was written.
fn check_manifest(path: &Path, manifest: &Manifest) -> Result<()> {
    if manifest.format != FORMAT || !(OLDEST_VERSION..=VERSION).contains(&manifest.version) {
        return Err(err(
            path,
            format!(
                "is format `{}` version {}; this dplc reads `{FORMAT}` versions {OLDEST_VERSION} to {VERSION}",
                manifest.format, manifest.version
            ),
        ));
    }
    if manifest.version >= 2 {
        let Some(sum) = &manifest.checksum else {
            return Err(err(
                path,
                "has no checksum: it was not written by dplc; resume from another step-N directory",
            ));
        };
        if *sum != manifest.sealed_checksum()? {
            return Err(err(
                path,
                "was changed after it was written (its checksum does not match): \
                 an edited step, seed or split would resume a different run; resume from another step-N directory",
            ));
        }
    }
    Ok(())
}

fn f32_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

fn tensor_name(param: &str, layer: u64, kind: &str) -> String {
    format!("{param}[{layer}].{kind}")
}

/// Write this rank's shard file: every element it owns of every parameter's
/// master value and optimizer moments.
pub(crate) fn write_shards<'a>(
    dir: &Path,
    rank: usize,
    graph: &Graph,
    owned: Vec<OwnedShard<'a>>,
    kill: Option<KillPoint>,
) -> Result<()> {
    let mut entries = Vec::new();
    let mut buffers: Vec<(String, Vec<u8>)> = Vec::new();
    for shard in owned {
        let name = &graph.param(shard.key.param).name;
        for (kind, values) in [("value", &shard.value), ("m", &shard.m), ("v", &shard.v)] {
            buffers.push((tensor_name(name, shard.key.layer, kind), f32_bytes(values)));
        }
        entries.push(ShardEntry {
            param: name.clone(),
            layer: shard.key.layer,
            part: shard
                .part
                .map(|(axis, parts, index)| PartSpec { axis, parts, index }),
            start: shard.range.start,
            end: shard.range.end,
        });
    }
    let path = dir.join(rank_file(rank));
    let views = buffers
        .iter()
        .map(|(name, bytes)| {
            TensorView::new(Dtype::F32, vec![bytes.len() / 4], bytes)
                .map(|v| (name.clone(), v))
                .map_err(|e| err(&path, format!("cannot lay out the shard: {e}")))
        })
        .collect::<Result<Vec<_>>>()?;
    let mut meta = HashMap::new();
    meta.insert("dplc.format".to_string(), format!("{FORMAT}/{VERSION}"));
    meta.insert("dplc.rank".to_string(), rank.to_string());
    meta.insert(
        SHARDS_KEY.to_string(),
        serde_json::to_string(&entries).map_err(|e| err(&path, e.to_string()))?,
    );
    let bytes = safetensors::serialize(views, Some(meta))
        .map_err(|e| err(&path, format!("cannot serialise the shard: {e}")))?;
    write_atomic(&path, &bytes, kill == Some(KillPoint::MidShard))?;
    if kill == Some(KillPoint::AfterShard) {
        return Err(killed(&path));
    }
    Ok(())
}

/// What the manifest records besides the files.
pub(crate) struct ManifestInfo<'a> {
    pub step: u64,
    pub seed: u64,
    pub data: DataPosition,
    pub optimizer: &'a Optimizer,
    pub split: SavedSplit,
    pub model: &'a [SavedParam],
    pub world: usize,
    pub run: &'a RunTag,
}

/// Rank 0, after every rank's file is in place: checksum them and write the
/// manifest, which makes the checkpoint complete.
pub(crate) fn write_manifest(
    dir: &Path,
    info: ManifestInfo<'_>,
    kill: Option<KillPoint>,
) -> Result<PathBuf> {
    let mut files = Vec::with_capacity(info.world);
    for rank in 0..info.world {
        let file = rank_file(rank);
        let path = dir.join(&file);
        let bytes = std::fs::read(&path).map_err(|e| io_err(&path, "read back the shard", e))?;
        files.push(FileEntry {
            file,
            rank,
            bytes: bytes.len() as u64,
            sha256: sha256_hex(&bytes),
        });
    }
    let manifest = Manifest {
        format: FORMAT.into(),
        version: VERSION,
        step: info.step,
        rng: RngState {
            seed: info.seed,
            step: info.step,
        },
        data: info.data,
        optimizer: optimizer_kind(info.optimizer).into(),
        split: info.split,
        model: info.model.to_vec(),
        files,
        run: Some(info.run.clone()),
        checksum: None,
    };
    let manifest = Manifest {
        checksum: Some(manifest.sealed_checksum()?),
        ..manifest
    };
    let path = dir.join(MANIFEST);
    let text = serde_json::to_string_pretty(&manifest).map_err(|e| err(&path, e.to_string()))?;
    write_atomic(&path, text.as_bytes(), kill == Some(KillPoint::MidManifest))?;
    Ok(dir.to_path_buf())
}

/// A verified checkpoint, ready for any split to slice.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct Resume {
    /// The step directory it was read from.
    pub dir: PathBuf,
    pub step: u64,
    pub next_sample: u64,
    pub params: BTreeMap<ParamKey, LogicalParam>,
}

/// The model signature of `graph` over the keys a run holds.
pub(crate) fn signature(graph: &Graph, keys: &BTreeSet<ParamKey>) -> Vec<SavedParam> {
    let mut layers: BTreeMap<ParamId, u64> = BTreeMap::new();
    for k in keys {
        *layers.entry(k.param).or_default() += 1;
    }
    layers
        .into_iter()
        .map(|(p, layers)| {
            let info = graph.param(p);
            SavedParam {
                name: info.name.clone(),
                shape: const_shape(graph, p),
                layers,
            }
        })
        .collect()
}

fn const_shape(graph: &Graph, p: ParamId) -> Vec<usize> {
    graph
        .param(p)
        .shape
        .dims()
        .iter()
        .map(|d| d.as_const().unwrap_or(0).max(0) as usize)
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scratch(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("dplc-ckpt-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("temp dir");
        dir
    }

    #[test]
    fn an_atomic_write_cut_short_leaves_only_a_temporary_file() {
        let dir = scratch("atomic");
        let path = dir.join("a.bin");
        write_atomic(&path, b"first", false).expect("writes");
        assert!(write_atomic(&path, b"second version", true).is_err());
        assert_eq!(std::fs::read(&path).expect("still there"), b"first");
        assert_eq!(
            std::fs::read(dir.join("a.bin.tmp")).expect("tmp"),
            b"second "
        );
        std::fs::remove_dir_all(&dir).ok();
    }

    #[test]
    fn latest_skips_step_directories_without_a_manifest() {
        let dir = scratch("latest");
        // A manifest of run `seq` at `step` (no files: enough to order by).
        let manifest = |step: u64, seq: u64| {
            let m = Manifest {
                format: FORMAT.into(),
                version: VERSION,
                step,
                rng: RngState { seed: 0, step },
                data: DataPosition {
                    next_sample: 0,
                    global_batch: 1,
                    seq: 1,
                },
                optimizer: "sgd".into(),
                split: SavedSplit {
                    dp: 1,
                    cp: 1,
                    tp: 1,
                    pp: 1,
                    ep: 1,
                    zero: 0,
                    micro_batch: 1,
                    num_micro_batches: 1,
                    sequence_parallel: false,
                },
                model: Vec::new(),
                files: Vec::new(),
                run: Some(RunTag {
                    id: format!("run{seq}"),
                    seq,
                }),
                checksum: None,
            };
            serde_json::to_string(&m).expect("serialises")
        };
        for (step, complete) in [(3, true), (6, true), (9, false), (10, false)] {
            let d = step_dir(&dir, step);
            std::fs::create_dir_all(&d).expect("dir");
            if complete {
                std::fs::write(d.join(MANIFEST), manifest(step, 1)).expect("manifest");
            }
        }
        std::fs::create_dir_all(dir.join("other")).expect("dir");
        assert_eq!(
            latest_step_dir(&dir).expect("lists"),
            Some(step_dir(&dir, 6))
        );
        // A later run's lower step wins over an earlier run's higher one.
        std::fs::write(step_dir(&dir, 3).join(MANIFEST), manifest(3, 2)).expect("manifest");
        assert_eq!(
            latest_step_dir(&dir).expect("lists"),
            Some(step_dir(&dir, 3))
        );
        let e = Checkpoint::open(&step_dir(&dir, 9)).expect_err("incomplete");
        assert!(e.to_string().contains("no complete checkpoint"), "{e}");
        // A damaged manifest is refused by name, not skipped for an older one.
        std::fs::write(step_dir(&dir, 6).join(MANIFEST), "{}").expect("manifest");
        let e = Checkpoint::open(&dir).expect_err("the manifest is not valid");
        assert!(e.to_string().contains("step-000006/manifest.json"), "{e}");
        std::fs::remove_dir_all(&dir).ok();
    }
}
