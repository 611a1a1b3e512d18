//! The checkpoint directory's discipline: the lock a saving run holds, atomic
//! writes (a temporary file, fsync, rename, fsync the directory), the step
//! directories and the one `--resume` takes, and the files' checksums.

use super::*;

/// A checkpoint directory held by one saving run: the OS lock on its lock
/// file lasts while this lives (and dies with the process, so a crashed run
/// leaves nothing stale).
#[derive(Debug)]
pub(crate) struct DirLock {
    _file: std::fs::File,
    pub run: RunTag,
}

/// Take `root` for a run that saves into it: refuse it, naming the holder,
/// while another run does; refuse it when an earlier run's checkpoint
/// there has a step this run may save (`writes`: every step after the one
/// it starts from), which the save would replace; tag the new run after
/// every run already there.
pub(crate) fn lock_dir(root: &Path, writes: std::ops::RangeInclusive<u64>) -> Result<DirLock> {
    std::fs::create_dir_all(root)
        .map_err(|e| io_err(root, "create the checkpoint directory", e))?;
    let path = root.join(LOCK);
    let mut file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .open(&path)
        .map_err(|e| io_err(&path, "open the lock file", e))?;
    match file.try_lock() {
        Ok(()) => {}
        Err(std::fs::TryLockError::WouldBlock) => {
            let holder = std::fs::read_to_string(&path).unwrap_or_default();
            let holder = holder.trim();
            return Err(err(
                root,
                format!(
                    "is being written by another run ({}); wait for it to end, or save into another --checkpoint-dir",
                    if holder.is_empty() { "its holder is not recorded" } else { holder }
                ),
            ));
        }
        Err(std::fs::TryLockError::Error(e)) => {
            return Err(io_err(&path, "lock the checkpoint directory", e))
        }
    }
    let earlier = step_manifests(root)?;
    if let Some((_, path, m)) = earlier
        .iter()
        .filter(|(step, _, _)| writes.contains(step))
        .min_by_key(|(step, _, _)| *step)
    {
        let whose = m
            .run
            .as_ref()
            .map_or("an earlier run".to_string(), |r| format!("run {}", r.id));
        return Err(err(
            root,
            format!(
                "holds {whose}'s checkpoint {}, which this run would save over; \
                 continue that run with --resume {}, or save into another --checkpoint-dir",
                path.display(),
                root.display()
            ),
        ));
    }
    let seq = earlier
        .iter()
        .filter_map(|(_, _, m)| m.run.as_ref().map(|r| r.seq))
        .max()
        .unwrap_or(0)
        + 1;
    let started = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default();
    let id = sha256_hex(format!("{}-{}-{seq}", std::process::id(), started.as_nanos()).as_bytes())
        [..12]
        .to_string();
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|h| h.trim().to_string())
        .unwrap_or_else(|_| "this machine".into());
    let note = format!(
        "run {id}, process {} on {host}, started {} s after the epoch\n",
        std::process::id(),
        started.as_secs()
    );
    file.set_len(0)
        .and_then(|()| file.write_all(note.as_bytes()))
        .and_then(|()| file.sync_all())
        .map_err(|e| io_err(&path, "write the lock file", e))?;
    Ok(DirLock {
        _file: file,
        run: RunTag { id, seq },
    })
}

/// Every `step-N` directory under `root` with a manifest, read.
pub(super) fn step_manifests(root: &Path) -> Result<Vec<(u64, PathBuf, Manifest)>> {
    let entries = std::fs::read_dir(root).map_err(|e| io_err(root, "list the directory", e))?;
    let mut out = Vec::new();
    for entry in entries {
        let entry = entry.map_err(|e| io_err(root, "list the directory", e))?;
        let name = entry.file_name();
        let Some(step) = name
            .to_str()
            .and_then(|n| n.strip_prefix("step-"))
            .and_then(|n| n.parse::<u64>().ok())
        else {
            continue;
        };
        let path = entry.path();
        let manifest_path = path.join(MANIFEST);
        if !manifest_path.is_file() {
            continue;
        }
        // Manifests are written atomically: one that does not parse was
        // damaged, and guessing past it could resume the wrong state.
        let manifest = read_manifest(&manifest_path)?;
        out.push((step, path, manifest));
    }
    Ok(out)
}

/// The checkpoint `--resume DIR` continues: the latest run's (runs ordered
/// by their tag; untagged version-1 checkpoints come first) highest step.
pub(super) fn latest_step_dir(root: &Path) -> Result<Option<PathBuf>> {
    Ok(step_manifests(root)?
        .into_iter()
        .max_by_key(|(step, _, m)| (m.run.as_ref().map_or(0, |r| r.seq), *step))
        .map(|(_, p, _)| p))
}

/// fsync a directory so that a rename in it survives a crash (a no-op where
/// directories cannot be opened as files).
pub(super) fn sync_dir(dir: &Path) -> Result<()> {
    #[cfg(unix)]
    {
        std::fs::File::open(dir)
            .and_then(|d| d.sync_all())
            .map_err(|e| io_err(dir, "fsync the directory", e))?;
    }
    #[cfg(not(unix))]
    let _ = dir;
    Ok(())
}

/// Write `bytes` to `path` atomically: `path.tmp`, fsync, rename, fsync the
/// directory. `cut_short` (fault injection) leaves half the bytes in the
/// temporary file and fails, as a killed process would.
pub(super) fn write_atomic(path: &Path, bytes: &[u8], cut_short: bool) -> Result<()> {
    let mut tmp = path.as_os_str().to_owned();
    tmp.push(".tmp");
    let tmp = PathBuf::from(tmp);
    let len = if cut_short {
        bytes.len() / 2
    } else {
        bytes.len()
    };
    let mut f = std::fs::File::create(&tmp).map_err(|e| io_err(&tmp, "create", e))?;
    f.write_all(&bytes[..len])
        .and_then(|()| f.sync_all())
        .map_err(|e| io_err(&tmp, "write", e))?;
    drop(f);
    if cut_short {
        return Err(killed(&tmp));
    }
    std::fs::rename(&tmp, path).map_err(|e| io_err(path, "rename the temporary file into", e))?;
    sync_dir(path.parent().unwrap_or(Path::new(".")))
}

pub(super) fn killed(path: &Path) -> RuntimeError {
    err(path, "injected kill while writing the checkpoint")
}

/// Rank 0, before any rank writes: make the step directory and drop a stale
/// manifest of the same step (a checkpoint being replaced is incomplete from
/// now until its new manifest is in place).
pub(crate) fn prepare_step_dir(dir: &Path) -> Result<()> {
    std::fs::create_dir_all(dir).map_err(|e| io_err(dir, "create the checkpoint directory", e))?;
    let manifest = dir.join(MANIFEST);
    if manifest.exists() {
        std::fs::remove_file(&manifest)
            .map_err(|e| io_err(&manifest, "replace the old manifest", e))?;
        sync_dir(dir)?;
    }
    if let Some(parent) = dir.parent() {
        sync_dir(parent)?;
    }
    Ok(())
}

pub(super) fn sha256_hex(bytes: &[u8]) -> String {
    Sha256::digest(bytes)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}
