//! Loading: every rank file read and checked, the logical (unsharded)
//! tensors reassembled from their shards with full coverage, before any
//! rank is built.

use super::*;

/// Per key being reassembled: its part split and, per part, the three
/// buffers and the ranges filled so far.
struct Assembly {
    split: Option<(usize, usize)>,
    part_shape: Vec<usize>,
    parts: Vec<[Vec<f32>; 3]>,
    filled: Vec<Vec<(Range<usize>, PathBuf)>>,
}

/// Read and verify every file of `ck`, then reassemble the logical state of
/// every key in `keys`. Nothing of a run is touched: an error here means the
/// run does not start.
pub(crate) fn load(
    ck: &Checkpoint,
    graph: &Graph,
    optimizer: &Optimizer,
    seed: u64,
    keys: &BTreeSet<ParamKey>,
) -> Result<Resume> {
    let m = &ck.manifest;
    let manifest_path = ck.manifest_path();
    if m.optimizer != optimizer_kind(optimizer) {
        return Err(err(
            &manifest_path,
            format!(
                "was saved with the {} optimizer, the run uses {}; its moments cannot carry over",
                m.optimizer,
                optimizer_kind(optimizer)
            ),
        ));
    }
    if m.rng.seed != seed {
        return Err(err(
            &manifest_path,
            format!(
                "was trained with seed {}, the run has seed {seed}: pass --seed {} (or leave --seed out) so the data order and dropout continue",
                m.rng.seed, m.rng.seed
            ),
        ));
    }
    let want = signature(graph, keys);
    if want != m.model {
        let saved: BTreeMap<&str, &SavedParam> =
            m.model.iter().map(|p| (p.name.as_str(), p)).collect();
        let detail = want
            .iter()
            .find_map(|p| match saved.get(p.name.as_str()) {
                None => Some(format!("it has no parameter `{}`", p.name)),
                Some(s) if s != &p => Some(format!(
                    "parameter `{}` is {:?} × {} layers there, {:?} × {} here",
                    p.name, s.shape, s.layers, p.shape, p.layers
                )),
                _ => None,
            })
            .unwrap_or_else(|| "it has parameters this model lacks".into());
        return Err(err(
            &manifest_path,
            format!("was saved from another model: {detail}"),
        ));
    }
    let by_name: HashMap<&str, ParamId> = graph
        .params()
        .map(|(p, info)| (info.name.as_str(), p))
        .collect();
    let mut asm: BTreeMap<ParamKey, Assembly> = BTreeMap::new();
    for entry in &m.files {
        if entry.file.contains(['/', '\\']) || entry.file.starts_with('.') {
            return Err(err(
                &manifest_path,
                format!("lists `{}`, which is not a file name", entry.file),
            ));
        }
        let path = ck.dir.join(&entry.file);
        let bytes = std::fs::read(&path).map_err(|e| {
            err(
                &path,
                format!("cannot read this checkpoint file ({e}); the checkpoint is incomplete, resume from another step-N directory"),
            )
        })?;
        if bytes.len() as u64 != entry.bytes {
            return Err(err(
                &path,
                format!(
                    "is truncated or overwritten: {} bytes, the manifest says {}; resume from another step-N directory",
                    bytes.len(),
                    entry.bytes
                ),
            ));
        }
        if sha256_hex(&bytes) != entry.sha256 {
            return Err(err(
                &path,
                "is corrupted: its SHA-256 does not match the manifest; resume from another step-N directory",
            ));
        }
        read_shards(&path, &bytes, graph, &by_name, keys, &mut asm)?;
    }
    let mut params = BTreeMap::new();
    for key in keys {
        let name = &graph.param(key.param).name;
        let a = asm.remove(key).ok_or_else(|| {
            err(
                &manifest_path,
                format!("no file holds `{name}` layer {}", key.layer),
            )
        })?;
        let part_numel: usize = a.part_shape.iter().product();
        for (i, filled) in a.filled.iter().enumerate() {
            let mut ranges: Vec<_> = filled.iter().collect();
            ranges.sort_by_key(|(r, _)| r.start);
            let mut at = 0;
            for (r, file) in ranges {
                if r.start != at {
                    let what = if r.start > at {
                        "missing"
                    } else {
                        "stored twice"
                    };
                    return Err(err(
                        file,
                        format!(
                            "elements {}..{} of `{name}` layer {} (part {i}) are {what}",
                            at.min(r.start),
                            at.max(r.start),
                            key.layer
                        ),
                    ));
                }
                at = r.end;
            }
            if at != part_numel {
                return Err(err(
                    &manifest_path,
                    format!(
                        "elements {at}..{part_numel} of `{name}` layer {} (part {i}) are in no file",
                        key.layer
                    ),
                ));
            }
        }
        let whole = |k: usize| -> Result<Vec<f32>> {
            let pieces: Vec<Tensor> = a
                .parts
                .iter()
                .map(|p| Tensor::f32(a.part_shape.clone(), p[k].clone()))
                .collect();
            match a.split {
                None => Ok(pieces[0].f()?.to_vec()),
                Some((axis, _)) => concat_along(&pieces, axis)?.into_f(),
            }
        };
        params.insert(
            *key,
            LogicalParam {
                value: whole(0)?,
                m: whole(1)?,
                v: whole(2)?,
            },
        );
    }
    Ok(Resume {
        dir: ck.dir().to_path_buf(),
        step: m.step,
        next_sample: m.data.next_sample,
        params,
    })
}

/// Check one shard file's tensors against the model and copy them into place.
fn read_shards(
    path: &Path,
    bytes: &[u8],
    graph: &Graph,
    by_name: &HashMap<&str, ParamId>,
    keys: &BTreeSet<ParamKey>,
    asm: &mut BTreeMap<ParamKey, Assembly>,
) -> Result<()> {
    let bad = |detail: String| {
        err(
            path,
            format!("{detail}; resume from another step-N directory"),
        )
    };
    let (_, meta) = SafeTensors::read_metadata(bytes)
        .map_err(|e| bad(format!("is not a safetensors file ({e:?})")))?;
    let tensors = SafeTensors::deserialize(bytes)
        .map_err(|e| bad(format!("is not a safetensors file ({e:?})")))?;
    let entries: Vec<ShardEntry> = meta
        .metadata()
        .as_ref()
        .and_then(|m| m.get(SHARDS_KEY))
        .ok_or_else(|| bad(format!("has no `{SHARDS_KEY}` metadata: not a dplc shard")))
        .and_then(|s| {
            serde_json::from_str(s).map_err(|e| bad(format!("has unreadable `{SHARDS_KEY}` ({e})")))
        })?;
    for e in entries {
        let param = *by_name
            .get(e.param.as_str())
            .ok_or_else(|| bad(format!("holds `{}`, which the model lacks", e.param)))?;
        let key = ParamKey {
            param,
            layer: e.layer,
        };
        if !keys.contains(&key) {
            return Err(bad(format!(
                "holds `{}` layer {}, which the model lacks",
                e.param, e.layer
            )));
        }
        let shape = const_shape(graph, param);
        let (split, part_shape, index) = match e.part {
            None => (None, shape.clone(), 0),
            Some(PartSpec { axis, parts, index }) => {
                let ok = shape
                    .get(axis)
                    .is_some_and(|&n| parts > 0 && index < parts && n % parts == 0);
                if !ok {
                    return Err(bad(format!(
                        "splits `{}` {shape:?} into part {index} of {parts} along axis {axis}, which does not fit",
                        e.param
                    )));
                }
                let mut s = shape.clone();
                s[axis] /= parts;
                (Some((axis, parts)), s, index)
            }
        };
        let part_numel: usize = part_shape.iter().product();
        if e.start > e.end || e.end > part_numel {
            return Err(bad(format!(
                "holds elements {}..{} of `{}` layer {}, which has {part_numel}",
                e.start, e.end, e.param, e.layer
            )));
        }
        let parts = split.map_or(1, |(_, p)| p);
        let a = asm.entry(key).or_insert_with(|| Assembly {
            split,
            part_shape: part_shape.clone(),
            parts: vec![
                [
                    vec![0.0; part_numel],
                    vec![0.0; part_numel],
                    vec![0.0; part_numel]
                ];
                parts
            ],
            filled: vec![Vec::new(); parts],
        });
        if a.split != split {
            return Err(bad(format!(
                "splits `{}` layer {} differently from another file of this checkpoint",
                e.param, e.layer
            )));
        }
        for (k, kind) in ["value", "m", "v"].into_iter().enumerate() {
            let name = tensor_name(&e.param, e.layer, kind);
            let view = tensors
                .tensor(&name)
                .map_err(|_| bad(format!("lacks the tensor `{name}`")))?;
            if view.dtype() != Dtype::F32 || view.shape() != [e.end - e.start] {
                return Err(bad(format!(
                    "`{name}` is {:?} {:?}, expected F32 [{}]",
                    view.dtype(),
                    view.shape(),
                    e.end - e.start
                )));
            }
            let dst = &mut a.parts[index][k][e.start..e.end];
            for (d, c) in dst.iter_mut().zip(view.data().chunks_exact(4)) {
                *d = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
            }
        }
        a.filled[index].push((e.start..e.end, path.to_path_buf()));
    }
    Ok(())
}
