//! One module per subcommand; each takes its parsed arguments and returns an exit code.

mod check;
mod env_server;

use std::process::ExitCode;

use crate::cli::Command;

/// Runs one command.
pub fn run(command: Command) -> anyhow::Result<ExitCode> {
    match command {
        Command::Check(args) => check::run(&args),
        Command::EnvServer(args) => env_server::run(&args),
    }
}
