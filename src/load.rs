//! Reading a .dpl file and choosing the model a command works on.

use miette::{miette, Result};
use std::path::Path;

/// Read and parse `path` (the standard library comes with it).
pub fn parse(path: &Path) -> Result<dplc_frontend::Unit> {
    let bytes = std::fs::read(path).map_err(|e| {
        miette!(
            help = "check the path",
            "cannot read {}: {e}",
            path.display()
        )
    })?;
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
