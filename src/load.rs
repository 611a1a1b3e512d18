//! Reading a .dpl file and choosing the model a command works on.

use miette::{miette, Result};
use std::path::Path;

/// Read and parse `path` (the standard library comes with it).
pub fn parse(path: &Path) -> Result<dplc_frontend::Unit> {
    let text = std::fs::read_to_string(path).map_err(|e| {
        miette!(
            help = "check the path; dplc reads UTF-8 .dpl files",
            "cannot read {}: {e}",
            path.display()
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
