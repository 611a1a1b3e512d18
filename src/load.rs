//! Reading a .dpl file and choosing the model a command works on.

use miette::{miette, Result};
use std::path::Path;

/// The most a text input (a .dpl, a plan, a config) may hold: far above
/// any real one, and a bound on what `/dev/zero` or a mistyped path to a
/// dataset can make a command read into memory.
pub const TEXT_LIMIT: u64 = 64 << 20;

/// The bytes of `path`, refused once they pass `limit` (read through a
/// bounded reader, so a device or a FIFO that never ends is refused too).
pub fn read_capped(path: &Path, limit: u64) -> Result<Vec<u8>> {
    use std::io::Read;
    let cannot = |e: std::io::Error| {
        miette!(
            help = "check the path",
            "cannot read {}: {e}",
            path.display()
        )
    };
    let file = std::fs::File::open(path).map_err(cannot)?;
    let mut bytes = Vec::new();
    file.take(limit + 1)
        .read_to_end(&mut bytes)
        .map_err(cannot)?;
    if bytes.len() as u64 > limit {
        return Err(miette!(
            help = "name the file this command reads; inputs of this kind are far smaller",
            "{} holds more than {} MiB; dplc stops reading it there",
            path.display(),
            limit >> 20
        ));
    }
    Ok(bytes)
}

/// [`read_capped`] at [`TEXT_LIMIT`], as UTF-8 text.
pub fn read_text(path: &Path) -> Result<String> {
    let bytes = read_capped(path, TEXT_LIMIT)?;
    String::from_utf8(bytes).map_err(|e| {
        miette!(
            help = "save the file as UTF-8",
            "{} is not UTF-8 text: {e}",
            path.display()
        )
    })
}

/// Read and parse `path` (the standard library comes with it).
pub fn parse(path: &Path) -> Result<dplc_frontend::Unit> {
    let bytes = read_capped(path, TEXT_LIMIT)?;
    let text = String::from_utf8(bytes).map_err(|e| {
        // Name the first bad byte where an editor would show it.
        let good = &e.as_bytes()[..e.utf8_error().valid_up_to()];
        let line = good.iter().filter(|&&b| b == b'\n').count() + 1;
        let col = good.len() - good.iter().rposition(|&b| b == b'\n').map_or(0, |i| i + 1) + 1;
        miette!(
            help = "save the file as UTF-8",
            "{}:{line}:{col}: byte 0x{:02x} is not UTF-8 text (.dpl files are UTF-8)",
            path.display(),
            e.as_bytes()[good.len()]
        )
    })?;
    Ok(dplc_frontend::parse(&path.display().to_string(), &text)?)
}

/// The model called `wanted`, or the file's only model.
pub fn choose_model(
    unit: &dplc_frontend::Unit,
    path: &Path,
    wanted: Option<&str>,
) -> Result<String> {
    let models = unit.model_names();
    match (wanted, models.as_slice()) {
        (Some(name), _) => Ok(name.to_string()),
        (None, [only]) => Ok(only.clone()),
        (None, []) => Err(miette!("{} defines no model", path.display())),
        (None, many) => Err(miette!(
            help = format!("pick one with --model, e.g. --model {}", many[0]),
            "{} defines {} models: {}",
            path.display(),
            many.len(),
            many.join(", ")
        )),
    }
}
