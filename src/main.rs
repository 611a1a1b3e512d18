//! The `dplc` command line: parse arguments, run one command, render errors
//! with miette (source line, caret, hint) and exit non-zero on failure.

mod inspect;
mod load;
mod run;
mod units;
mod verify;

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
    /// Train a model on CPU ranks (threads of this process).
    Run(run::Args),
    /// Check a plan on CPU ranks at reduced size against the serial run.
    Verify(verify::Args),
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Check { file } => check(&file),
        Command::Inspect(args) => inspect::run(&args),
        Command::Run(args) => run::run(&args),
        Command::Verify(args) => verify::run(&args),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(report) => {
            eprintln!("{report:?}");
            ExitCode::FAILURE
        }
    }
}

fn check(file: &std::path::Path) -> miette::Result<()> {
    let unit = load::parse(file)?;
    unit.check()?;
    let models = unit.model_names();
    let clusters = unit.clusters()?;
    println!(
        "{}: ok ({} model{}, {} cluster{})",
        file.display(),
        models.len(),
        if models.len() == 1 { "" } else { "s" },
        clusters.len(),
        if clusters.len() == 1 { "" } else { "s" },
    );
    Ok(())
}
