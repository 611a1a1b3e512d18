//! Each rank's own state beside the parameter shards: the gradient
//! compressors' error feedback and the older weight versions asynchronous
//! updates read, as flat f32 tensors in a safetensors file per rank.

use super::*;

fn feedback_file(rank: usize) -> String {
    format!("feedback-rank{rank:05}.safetensors")
}

fn versions_file(rank: usize) -> String {
    format!("versions-rank{rank:05}.safetensors")
}

/// How many older weight versions a versions file holds (its metadata).
const VERSIONS_KEY: &str = "dplc.versions";

/// Write one rank's own state (not a shard of a logical tensor) as flat f32
/// tensors: `what` names it in errors.
fn write_rank_state(
    path: &Path,
    what: &str,
    buffers: &[(String, Vec<u8>)],
    meta: Option<HashMap<String, String>>,
) -> Result<()> {
    let views = buffers
        .iter()
        .map(|(name, bytes)| {
            TensorView::new(Dtype::F32, vec![bytes.len() / 4], bytes)
                .map(|v| (name.clone(), v))
                .map_err(|e| err(path, format!("cannot lay out the {what}: {e}")))
        })
        .collect::<Result<Vec<_>>>()?;
    let bytes = safetensors::serialize(views, meta)
        .map_err(|e| err(path, format!("cannot serialise the {what}: {e}")))?;
    write_atomic(path, &bytes, false)
}

/// A flat f32 tensor `name` of a rank-state file.
fn read_floats(path: &Path, st: &SafeTensors, name: &str) -> Result<Vec<f32>> {
    let t = st
        .tensor(name)
        .map_err(|_| err(path, format!("has no tensor `{name}`")))?;
    Ok(t.data()
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect())
}

/// Write this rank's error-feedback state (top-k and PowerSGD): what its
/// compression left out so far and PowerSGD's right factor, per tensor it
/// holds. The state is the rank's own, not a shard of a logical tensor, so
/// a resumed run needs the same data-parallel split and compression.
pub(crate) fn write_feedback(
    dir: &Path,
    rank: usize,
    graph: &Graph,
    feedback: &BTreeMap<ParamKey, crate::gradsync::Feedback>,
) -> Result<()> {
    if feedback.is_empty() {
        return Ok(());
    }
    let mut buffers: Vec<(String, Vec<u8>)> = Vec::new();
    for (key, f) in feedback {
        let name = &graph.param(key.param).name;
        buffers.push((tensor_name(name, key.layer, "error"), f32_bytes(&f.error)));
        buffers.push((tensor_name(name, key.layer, "q"), f32_bytes(&f.q)));
    }
    write_rank_state(
        &dir.join(feedback_file(rank)),
        "feedback state",
        &buffers,
        None,
    )
}

/// Read rank `rank`'s error-feedback state for the tensors `keys`.
pub(crate) fn read_feedback(
    dir: &Path,
    rank: usize,
    graph: &Graph,
    keys: impl Iterator<Item = ParamKey>,
) -> Result<BTreeMap<ParamKey, crate::gradsync::Feedback>> {
    let path = dir.join(feedback_file(rank));
    let bytes = std::fs::read(&path).map_err(|e| {
        err(
            &path,
            format!(
                "holds no error-feedback state for rank {rank} ({e}): the checkpoint was saved \
                 without top-k or PowerSGD, or with fewer ranks; resume with the compression \
                 and split it was saved with"
            ),
        )
    })?;
    let st = SafeTensors::deserialize(&bytes)
        .map_err(|e| err(&path, format!("is not a safetensors file: {e}")))?;
    let mut out = BTreeMap::new();
    for key in keys {
        let name = &graph.param(key.param).name;
        out.insert(
            key,
            crate::gradsync::Feedback {
                error: read_floats(&path, &st, &tensor_name(name, key.layer, "error"))?,
                q: read_floats(&path, &st, &tensor_name(name, key.layer, "q"))?,
            },
        );
    }
    Ok(out)
}

/// Write the older weight versions an async rank computes on (newest
/// first, without the current weights, which the shards hold): tensor
/// `NAME[LAYER].vJ` is the weights J steps old, as this rank holds them
/// (its tensor-parallel part). Every rank writes its own, as it writes its
/// error feedback: a resumed run needs the same split and staleness.
pub(crate) fn write_versions(
    dir: &Path,
    rank: usize,
    graph: &Graph,
    older: &[BTreeMap<ParamKey, Vec<f32>>],
) -> Result<()> {
    let mut buffers: Vec<(String, Vec<u8>)> = Vec::new();
    for (j, version) in older.iter().enumerate() {
        for (key, values) in version {
            let name = &graph.param(key.param).name;
            let kind = format!("v{}", j + 1);
            buffers.push((tensor_name(name, key.layer, &kind), f32_bytes(values)));
        }
    }
    let meta = HashMap::from([(VERSIONS_KEY.to_string(), older.len().to_string())]);
    write_rank_state(
        &dir.join(versions_file(rank)),
        "weight versions",
        &buffers,
        Some(meta),
    )
}

/// Read rank `rank`'s older weight versions for the tensors `keys`, newest
/// first (see [`write_versions`]).
pub(crate) fn read_versions(
    dir: &Path,
    rank: usize,
    graph: &Graph,
    keys: &[ParamKey],
) -> Result<Vec<BTreeMap<ParamKey, Vec<f32>>>> {
    let path = dir.join(versions_file(rank));
    let bytes = std::fs::read(&path).map_err(|e| {
        err(
            &path,
            format!(
                "holds no older weight versions for rank {rank} ({e}): the checkpoint was saved \
                 without sync=async, or with fewer ranks; resume with the staleness and split \
                 it was saved with"
            ),
        )
    })?;
    let (_, header) = SafeTensors::read_metadata(&bytes)
        .map_err(|e| err(&path, format!("is not a safetensors file: {e}")))?;
    let count: usize = header
        .metadata()
        .as_ref()
        .and_then(|m| m.get(VERSIONS_KEY))
        .and_then(|n| n.parse().ok())
        .ok_or_else(|| err(&path, format!("has no `{VERSIONS_KEY}` count")))?;
    let st = SafeTensors::deserialize(&bytes)
        .map_err(|e| err(&path, format!("is not a safetensors file: {e}")))?;
    (1..=count)
        .map(|j| {
            keys.iter()
                .map(|&key| {
                    let name = &graph.param(key.param).name;
                    let kind = format!("v{j}");
                    Ok((
                        key,
                        read_floats(&path, &st, &tensor_name(name, key.layer, &kind))?,
                    ))
                })
                .collect()
        })
        .collect()
}

/// How many older weight versions rank 0's file of the checkpoint in `dir`
/// holds (the staleness it was saved with); `None` without such a file.
pub(crate) fn saved_versions(dir: &Path) -> Option<usize> {
    let bytes = std::fs::read(dir.join(versions_file(0))).ok()?;
    let (_, header) = SafeTensors::read_metadata(&bytes).ok()?;
    header
        .metadata()
        .as_ref()
        .and_then(|m| m.get(VERSIONS_KEY))
        .and_then(|n| n.parse().ok())
}
