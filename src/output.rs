//! Every file dplc writes goes through one rule, so no command can destroy
//! what it was given or what a path merely points at:
//!
//! - an output that is one of the command's inputs (the same file, however
//!   it is named) is refused before anything is written;
//! - a symbolic link is followed: its target is written, the link stays;
//! - a regular file (or a new one) is written atomically — a temporary file
//!   in the same directory, flushed to disk, renamed over the target — so a
//!   reader never sees half of it and a failed write leaves the old one;
//! - anything else that exists (a device such as `/dev/null`, a FIFO) is
//!   written in place, as a shell redirection would, never replaced;
//! - a directory is refused;
//! - one command's outputs are distinct files, none inside a directory the
//!   command keeps (a checkpoint directory it saves into or resumes from):
//!   [`check_outputs`].

use miette::{miette, IntoDiagnostic, Result, WrapErr};
use std::fmt::Arguments;
use std::io::Write;
use std::path::{Path, PathBuf};

/// `print!` that fails instead of panicking when standard output cannot be
/// written (`> /dev/full`, a closed pipe): the command ends with an error.
macro_rules! out {
    ($($arg:tt)*) => { $crate::output::stdout(format_args!($($arg)*))? };
}

/// `println!` under the same rule as `out!`.
macro_rules! outln {
    () => { $crate::output::stdout(format_args!("\n"))? };
    ($($arg:tt)*) => { $crate::output::stdout(format_args!("{}\n", format_args!($($arg)*)))? };
}

/// `eprintln!` for notes and progress: a standard error that cannot be
/// written loses the note, never the run.
macro_rules! note {
    ($($arg:tt)*) => {{
        use std::io::Write as _;
        let _ = writeln!(std::io::stderr(), $($arg)*);
    }};
}

/// Standard output's reader went away (`dplc … | head`): the command stops
/// with a non-zero exit and nothing more to say, as Unix filters do.
#[derive(Debug)]
pub struct StdoutClosed;

impl std::fmt::Display for StdoutClosed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("standard output was closed by its reader")
    }
}

impl std::error::Error for StdoutClosed {}

impl miette::Diagnostic for StdoutClosed {}

/// Write to standard output, or say why not.
pub fn stdout(args: Arguments<'_>) -> Result<()> {
    let mut out = std::io::stdout().lock();
    out.write_fmt(args)
        .and_then(|()| out.flush())
        .map_err(|e| match e.kind() {
            std::io::ErrorKind::BrokenPipe => StdoutClosed.into(),
            _ => miette!("cannot write to standard output: {e}"),
        })
}

/// Refuse now what [`write`] would refuse later (an input, a directory, a
/// loop of links): a command that writes at its end (a run's `--trace`)
/// checks first, so it does not train for an hour and then fail.
pub fn check(path: &Path, inputs: &[&Path]) -> Result<()> {
    let target = resolve(path)?;
    refuse_inputs(path, &target, inputs)?;
    if target.is_dir() {
        return Err(miette!(
            help = "name a file to write, not a directory",
            "{} is a directory",
            path.display()
        ));
    }
    Ok(())
}

/// One file a command writes, and the flag that named it.
pub struct Output<'a> {
    pub flag: &'static str,
    pub path: &'a Path,
}

/// A directory a command reads or writes as a whole (a checkpoint
/// directory, a built artifact), the flag that named it and what it holds.
pub struct KeptDir<'a> {
    pub flag: &'static str,
    pub path: &'a Path,
    pub holds: &'static str,
}

/// Refuse, before anything is written, an output set that would destroy
/// its own work: two outputs landing in one file (the second would replace
/// the first), or an output inside a kept directory (a trace written over
/// a checkpoint's manifest makes the checkpoint unloadable).
pub fn check_outputs(outputs: &[Output<'_>], kept: &[KeptDir<'_>]) -> Result<()> {
    let lands: Vec<PathBuf> = outputs
        .iter()
        .map(|o| resolve(o.path).map(|t| absolute(&t)))
        .collect::<Result<_>>()?;
    for (i, (a, at)) in outputs.iter().zip(&lands).enumerate() {
        if let Some((b, _)) = outputs.iter().zip(&lands).take(i).find(|(_, bt)| *bt == at) {
            return Err(miette!(
                help = "give each output its own file",
                "{} {} and {} {} name the same file",
                b.flag,
                b.path.display(),
                a.flag,
                a.path.display()
            ));
        }
        for dir in kept {
            if at.starts_with(absolute(dir.path)) {
                return Err(miette!(
                    help = "write it outside that directory",
                    "{} {} is inside {} {}, which holds {}",
                    a.flag,
                    a.path.display(),
                    dir.flag,
                    dir.path.display(),
                    dir.holds
                ));
            }
        }
    }
    Ok(())
}

/// `path` made absolute with every part that exists resolved (links,
/// `..`), the rest appended as written: the same file gets the same name
/// whether or not it exists yet.
fn absolute(path: &Path) -> PathBuf {
    let path = std::path::absolute(path).unwrap_or_else(|_| path.to_path_buf());
    let mut existing = path.as_path();
    let mut rest = Vec::new();
    loop {
        if let Ok(real) = std::fs::canonicalize(existing) {
            return rest.iter().rev().fold(real, |p, part| p.join(part));
        }
        match (existing.parent(), existing.file_name()) {
            (Some(parent), Some(name)) => {
                rest.push(name.to_os_string());
                existing = parent;
            }
            _ => return path.clone(),
        }
    }
}

/// Write `bytes` to `path` under the rule above; `inputs` are the paths the
/// command reads (they may not exist, e.g. a cluster given by name).
pub fn write(path: &Path, bytes: &[u8], inputs: &[&Path]) -> Result<()> {
    let target = resolve(path)?;
    refuse_inputs(path, &target, inputs)?;
    match std::fs::metadata(&target) {
        Ok(meta) if meta.is_dir() => Err(miette!(
            help = "name a file to write, not a directory",
            "{} is a directory",
            path.display()
        )),
        Ok(meta) if !meta.is_file() => write_in_place(path, &target, bytes),
        Ok(meta) => write_atomic(path, &target, bytes, Some(meta.permissions())),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            write_atomic(path, &target, bytes, None)
        }
        Err(e) => Err(e)
            .into_diagnostic()
            .wrap_err_with(|| format!("cannot write {}", path.display())),
    }
}

/// The file a write to `path` lands in: symbolic links followed (also
/// dangling ones, whose target is created), at most 40 deep as the kernel does.
fn resolve(path: &Path) -> Result<PathBuf> {
    let mut at = path.to_path_buf();
    for _ in 0..40 {
        match std::fs::symlink_metadata(&at) {
            Ok(m) if m.file_type().is_symlink() => {
                let link = std::fs::read_link(&at)
                    .into_diagnostic()
                    .wrap_err_with(|| format!("cannot read the link {}", at.display()))?;
                at = match at.parent() {
                    Some(dir) if link.is_relative() => dir.join(link),
                    _ => link,
                };
            }
            _ => return Ok(at),
        }
    }
    Err(miette!(
        "{} is a loop of symbolic links; name a file to write",
        path.display()
    ))
}

/// Refuse to write over an input of the same command.
fn refuse_inputs(path: &Path, target: &Path, inputs: &[&Path]) -> Result<()> {
    for input in inputs {
        if same_file(target, input) {
            let also = if path == *input {
                String::new()
            } else {
                format!(" ({})", input.display())
            };
            return Err(miette!(
                help = "write the output somewhere else",
                "{} is an input of this command{also}; dplc will not write over it",
                path.display(),
            ));
        }
    }
    Ok(())
}

/// Whether two paths name the same existing file (hard links, `./x` and
/// `x`, links followed).
pub fn same_file(a: &Path, b: &Path) -> bool {
    match (std::fs::metadata(a), std::fs::metadata(b)) {
        (Ok(x), Ok(y)) => {
            #[cfg(unix)]
            {
                use std::os::unix::fs::MetadataExt;
                x.dev() == y.dev() && x.ino() == y.ino()
            }
            #[cfg(not(unix))]
            {
                let _ = (x, y);
                std::fs::canonicalize(a).ok() == std::fs::canonicalize(b).ok()
            }
        }
        _ => false,
    }
}

/// A device or a FIFO: open it for writing and write, as `>` would.
fn write_in_place(path: &Path, target: &Path, bytes: &[u8]) -> Result<()> {
    std::fs::OpenOptions::new()
        .write(true)
        .open(target)
        .and_then(|mut f| f.write_all(bytes).and_then(|()| f.flush()))
        .into_diagnostic()
        .wrap_err_with(|| format!("cannot write {}", path.display()))
}

/// A regular file: temporary sibling, fsync, rename, fsync the directory.
/// An existing file keeps its permissions.
fn write_atomic(
    path: &Path,
    target: &Path,
    bytes: &[u8],
    permissions: Option<std::fs::Permissions>,
) -> Result<()> {
    let dir = match target.parent() {
        Some(d) if !d.as_os_str().is_empty() => d.to_path_buf(),
        _ => PathBuf::from("."),
    };
    let name = target.file_name().ok_or_else(|| {
        miette!(
            help = "name a file to write",
            "{} does not name a file",
            path.display()
        )
    })?;
    let tmp = dir.join(format!(
        ".{}.dplc-{}.tmp",
        name.to_string_lossy(),
        std::process::id()
    ));
    let written = (|| -> std::io::Result<()> {
        let mut f = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .open(&tmp)?;
        f.write_all(bytes)?;
        if let Some(p) = permissions {
            f.set_permissions(p)?;
        }
        f.sync_all()?;
        std::fs::rename(&tmp, target)?;
        // The rename is durable once the directory is; not every
        // filesystem lets a directory be opened, and that is no failure.
        if let Ok(d) = std::fs::File::open(&dir) {
            let _ = d.sync_all();
        }
        Ok(())
    })();
    written.map_err(|e| {
        let _ = std::fs::remove_file(&tmp);
        miette!("cannot write {}: {e}", path.display())
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scratch(name: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("dplc-output-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        d
    }

    #[test]
    fn a_regular_file_is_replaced_whole_and_keeps_its_mode() {
        let d = scratch("regular");
        let f = d.join("plan.ron");
        std::fs::write(&f, "old").unwrap();
        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt;
            std::fs::set_permissions(&f, std::fs::Permissions::from_mode(0o600)).unwrap();
        }
        write(&f, b"new", &[]).unwrap();
        assert_eq!(std::fs::read_to_string(&f).unwrap(), "new");
        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt;
            let mode = std::fs::metadata(&f).unwrap().permissions().mode();
            assert_eq!(mode & 0o777, 0o600);
        }
        // No temporary file is left behind.
        assert_eq!(std::fs::read_dir(&d).unwrap().count(), 1);
        let _ = std::fs::remove_dir_all(&d);
    }

    #[test]
    fn an_input_is_never_written_over_under_any_name() {
        let d = scratch("input");
        let input = d.join("model.dpl");
        std::fs::write(&input, "model m {}").unwrap();
        let other_name = d.join(".").join("model.dpl");
        let err = write(&other_name, b"plan", &[&input]).unwrap_err();
        assert!(err.to_string().contains("is an input"), "{err}");
        #[cfg(unix)]
        {
            let link = d.join("link.ron");
            std::os::unix::fs::symlink(&input, &link).unwrap();
            let err = write(&link, b"plan", &[&input]).unwrap_err();
            assert!(err.to_string().contains("is an input"), "{err}");
        }
        assert_eq!(std::fs::read_to_string(&input).unwrap(), "model m {}");
        let _ = std::fs::remove_dir_all(&d);
    }

    #[cfg(unix)]
    #[test]
    fn a_link_is_followed_and_kept() {
        let d = scratch("link");
        let target = d.join("real.ron");
        std::fs::write(&target, "old").unwrap();
        let link = d.join("link.ron");
        std::os::unix::fs::symlink("real.ron", &link).unwrap();
        write(&link, b"new", &[]).unwrap();
        assert!(std::fs::symlink_metadata(&link)
            .unwrap()
            .file_type()
            .is_symlink());
        assert_eq!(std::fs::read_to_string(&target).unwrap(), "new");
        let _ = std::fs::remove_dir_all(&d);
    }

    #[cfg(unix)]
    #[test]
    fn a_device_is_written_in_place_not_replaced() {
        write(Path::new("/dev/null"), b"plan", &[]).unwrap();
        let meta = std::fs::metadata("/dev/null").unwrap();
        assert!(!meta.is_file(), "/dev/null is still a device");
    }

    #[test]
    fn outputs_are_distinct_and_outside_kept_directories() {
        let d = scratch("outputs");
        let ck = d.join("ck");
        std::fs::create_dir_all(ck.join("step-000002")).unwrap();
        let out = |flag, path| Output { flag, path };
        let kept = [KeptDir {
            flag: "--checkpoint-dir",
            path: &ck,
            holds: "checkpoints",
        }];
        let manifest = ck.join("step-000002").join("manifest.json");
        let err = check_outputs(&[out("--trace", &manifest)], &kept).unwrap_err();
        assert!(
            err.to_string().contains("is inside --checkpoint-dir"),
            "{err}"
        );
        // However it is spelt, and before the directory exists.
        let dotted = d.join("ck").join("..").join("ck").join("t.json");
        assert!(check_outputs(&[out("--trace", &dotted)], &kept).is_err());
        let later = d.join("later");
        let kept_later = [KeptDir {
            flag: "--checkpoint-dir",
            path: &later,
            holds: "checkpoints",
        }];
        let inside = later.join("x.json");
        assert!(check_outputs(&[out("--trace", &inside)], &kept_later).is_err());
        // Two outputs in one file, one of them named through `./`.
        let (a, b) = (d.join("same.out"), d.join(".").join("same.out"));
        let err = check_outputs(&[out("--trace", &a), out("--save-plan", &b)], &[]).unwrap_err();
        assert!(err.to_string().contains("name the same file"), "{err}");
        let (p, t) = (d.join("plan.ron"), d.join("trace.json"));
        check_outputs(&[out("--save-plan", &p), out("--trace", &t)], &kept).unwrap();
        let _ = std::fs::remove_dir_all(&d);
    }

    #[test]
    fn a_directory_is_refused() {
        let d = scratch("dir");
        let err = write(&d, b"plan", &[]).unwrap_err();
        assert!(err.to_string().contains("is a directory"), "{err}");
        let _ = std::fs::remove_dir_all(&d);
    }
}
