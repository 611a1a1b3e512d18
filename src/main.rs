//! The `dplc` command line: parse arguments, run one command, render errors
//! with miette (source line, caret, hint) and exit non-zero on failure.

#[macro_use]
mod output;
mod build;
mod compile;
mod explain;
mod export;
mod import;
mod inspect;
mod load;
mod run;
mod stack;
mod units;
mod verify;
mod viz;

use clap::{Parser, Subcommand};
use std::path::PathBuf;
use std::process::ExitCode;

/// dplc — a declarative compiler for distributed training.
#[derive(Parser)]
#[command(name = "dplc", version, about, long_about = None, arg_required_else_help = true)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Parse and type-check a .dpl file: every model, train and cluster section.
    Check {
        /// The .dpl file.
        file: PathBuf,
        /// Print a JSON object (and errors as JSON) instead of text.
        #[arg(long)]
        json: bool,
    },
    /// Show a model's parameters, layers, FLOPs and stored activations.
    Inspect(inspect::Args),
    /// Plan a model on a cluster: the fastest split that fits, with its estimates.
    Compile(compile::Args),
    /// Explain a plan: mesh on the hardware, memory, step time, collectives, alternatives, what-ifs.
    Explain(explain::Args),
    /// Draw a plan: Chrome trace, Graphviz of a layer's sharded program, or an HTML page.
    Viz(viz::Args),
    /// Train a model on CPU ranks (threads of this process).
    Run(run::Args),
    /// Check a plan on CPU ranks at reduced size against the serial run.
    Verify(verify::Args),
    /// Write a runnable artifact: the executable, the plan, the kernels, RUN.md.
    Build(build::BuildArgs),
    /// Run one rank of a built artifact (what RUN.md's launch lines start).
    Launch(build::LaunchArgs),
    /// Hand a plan to another engine: Megatron-LM arguments, a torchtitan TOML or a DeepSpeed config.
    Export(export::Args),
    /// Bring a model in from another format: `dplc import hf config.json`.
    Import(import::Args),
}

fn main() -> ExitCode {
    restore_sigpipe();
    // Every subcommand takes `--json`; under it errors are a JSON object on
    // stdout, the argument parser's included, so scripts read one format.
    let json = std::env::args_os()
        .skip(1)
        .take_while(|a| a != "--")
        .any(|a| a == "--json");
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        Err(e) if json && e.use_stderr() => {
            let rendered = e.render().to_string();
            let mut lines = rendered.lines().map(str::trim).filter(|l| !l.is_empty());
            let first = lines.next().unwrap_or_default();
            let message = first.strip_prefix("error: ").unwrap_or(first);
            let help = lines.collect::<Vec<_>>().join("\n");
            print_json_error("dplc::usage", message, None, Some(&help));
            return ExitCode::from(2);
        }
        Err(e) => e.exit(),
    };
    let result = match cli.command {
        Command::Check { file, json } => check(&file, json),
        Command::Inspect(args) => inspect::run(&args),
        Command::Compile(args) => compile::run(&args),
        Command::Explain(args) => explain::run(&args),
        Command::Viz(args) => viz::run(&args),
        Command::Run(args) => run::run(&args),
        Command::Verify(args) => verify::run(&args),
        Command::Build(args) => build::build(&args),
        Command::Launch(args) => build::launch(&args),
        Command::Export(args) => export::run(&args),
        Command::Import(args) => import::run(&args),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(report) => {
            if report.downcast_ref::<output::StdoutClosed>().is_none() {
                // Scripts read the JSON on stdout; a person watching still
                // sees the report on stderr.
                if json {
                    json_error(&report);
                }
                note!("{report:?}");
            }
            ExitCode::FAILURE
        }
    }
}

/// `{"error": {"code", "message", "file", "line", "column", "help"}}` on
/// stdout: the report's code (`dplc::error` when it has none), its message
/// with its causes, and where its first label points (1-based), if it has one.
pub(crate) fn json_error(report: &miette::Report) {
    let code = report
        .code()
        .map_or("dplc::error".to_string(), |c| c.to_string());
    let message = report
        .chain()
        .map(ToString::to_string)
        .collect::<Vec<_>>()
        .join(": ");
    let at = report.source_code().and_then(|src| {
        let label = report.labels()?.next()?;
        let span = src.read_span(label.inner(), 0, 0).ok()?;
        Some((
            span.name().map(str::to_string),
            span.line() as u64 + 1,
            span.column() as u64 + 1,
        ))
    });
    let help = report.help().map(|h| h.to_string());
    print_json_error(&code, &message, at, help.as_deref());
}

fn print_json_error(
    code: &str,
    message: &str,
    at: Option<(Option<String>, u64, u64)>,
    help: Option<&str>,
) {
    let (file, line, column) = match at {
        Some((file, line, column)) => (file, Some(line), Some(column)),
        None => (None, None, None),
    };
    let v = serde_json::json!({
        "error": {
            "code": code,
            "message": message,
            "file": file,
            "line": line,
            "column": column,
            "help": help,
        }
    });
    // A closed stdout has nowhere to take the error either.
    let _ = output::stdout(format_args!("{v}\n"));
}

fn check(file: &std::path::Path, json: bool) -> miette::Result<()> {
    let unit = load::parse(file)?;
    unit.check()?;
    let models = unit.model_names();
    let clusters = unit.clusters()?;
    if json {
        let names: Vec<&str> = clusters.iter().map(|c| c.name.as_str()).collect();
        let v = serde_json::json!({
            "file": file.display().to_string(),
            "models": models,
            "clusters": names,
        });
        outln!("{v}");
        return Ok(());
    }
    outln!(
        "{}: ok ({} model{}, {} cluster{})",
        file.display(),
        models.len(),
        if models.len() == 1 { "" } else { "s" },
        clusters.len(),
        if clusters.len() == 1 { "" } else { "s" },
    );
    Ok(())
}

/// Rust ignores SIGPIPE, so `dplc … | head` would fail on its next print;
/// like every Unix filter, dplc should just stop when its reader goes away.
fn restore_sigpipe() {
    #[cfg(unix)]
    // SAFETY: called first thing in main, before any thread exists; SIG_DFL
    // is a valid disposition for SIGPIPE.
    unsafe {
        libc::signal(libc::SIGPIPE, libc::SIG_DFL);
    }
}

#[cfg(test)]
mod tests {
    /// clap checks its own definition only when a subcommand is parsed;
    /// this checks every one (a clash of two `--json` flags panicked once).
    #[test]
    fn the_command_line_definition_is_consistent() {
        use clap::CommandFactory;
        super::Cli::command().debug_assert();
    }
}
