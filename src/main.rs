//! The `dplc` command line: parse arguments, run one command, render errors
//! with miette (source line, caret, hint) and exit non-zero on failure.

#[macro_use]
mod output;
mod build;
mod compile;
mod explain;
mod export;
mod inspect;
mod load;
mod run;
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
}

fn main() -> ExitCode {
    restore_sigpipe();
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Check { file } => check(&file),
        Command::Inspect(args) => inspect::run(&args),
        Command::Compile(args) => compile::run(&args),
        Command::Explain(args) => explain::run(&args),
        Command::Viz(args) => viz::run(&args),
        Command::Run(args) => run::run(&args),
        Command::Verify(args) => verify::run(&args),
        Command::Build(args) => build::build(&args),
        Command::Launch(args) => build::launch(&args),
        Command::Export(args) => export::run(&args),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(report) => {
            if report.downcast_ref::<output::StdoutClosed>().is_none() {
                note!("{report:?}");
            }
            ExitCode::FAILURE
        }
    }
}

fn check(file: &std::path::Path) -> miette::Result<()> {
    let unit = load::parse(file)?;
    unit.check()?;
    let models = unit.model_names();
    let clusters = unit.clusters()?;
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
