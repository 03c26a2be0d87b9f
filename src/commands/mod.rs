//! One module per subcommand; each takes its parsed arguments and returns an exit code.

mod bench_engine;
mod bench_model;
mod bench_pipeline;
mod bench_trainer;
mod check;
mod env_server;
mod knobs;
mod model;
mod plot;
mod run;
mod serve;
mod signals;
mod status;

use std::process::ExitCode;

use signals::shutdown_signal;

use crate::cli::{BenchCommand, Command};

/// Runs one command.
pub fn run(command: Command) -> anyhow::Result<ExitCode> {
    match command {
        Command::Check(args) => check::run(&args),
        Command::Run(args) => run::run(&args),
        Command::Knobs(args) => knobs::run(&args),
        Command::Status(args) => status::run(&args),
        Command::Pause(args) => status::set_paused(&args, true),
        Command::Resume(args) => status::set_paused(&args, false),
        Command::Bench(BenchCommand::Pipeline(args)) => bench_pipeline::pipeline(&args),
        Command::Bench(BenchCommand::Overhead(args)) => bench_pipeline::overhead(&args),
        Command::Model(cmd) => model::run(cmd),
        Command::Bench(BenchCommand::Model(args)) => bench_model::run(&args),
        Command::Bench(BenchCommand::Trainer(args)) => bench_trainer::run(&args),
        Command::EnvServer(args) => env_server::run(&args),
        Command::Serve(args) => serve::run(&args),
        Command::Bench(BenchCommand::Engine(args)) => bench_engine::run(&args),
        Command::Plot(args) => plot::run(&args),
    }
}
