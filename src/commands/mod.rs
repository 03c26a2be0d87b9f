//! One module per subcommand; each takes its parsed arguments and returns an exit code.

mod check;
mod data;
mod env_server;
mod knobs;
mod model;
mod node;
mod plot;
mod probe;
mod replay;
mod run;
mod serve;
mod signals;
mod status;

use std::process::ExitCode;

use signals::shutdown_signal;

use crate::cli::{BenchCommand, Command, HttpServerArgs, ReplayCommand};

/// The server options of `--header-read-timeout-s`, `--body-read-timeout-s`,
/// `--write-stall-timeout-s` and `--shutdown-grace-s` (each a number of seconds > 0) and
/// `--max-connections` (0: the default).
fn serve_options(args: &HttpServerArgs) -> anyhow::Result<sluice_http::ServeOptions> {
    let seconds = |flag: &str, v: f64| {
        std::time::Duration::try_from_secs_f64(v)
            .ok()
            .filter(|d| !d.is_zero())
            .ok_or_else(|| anyhow::anyhow!("{flag}: expected a number of seconds > 0, got {v}"))
    };
    let defaults = sluice_http::ServeOptions::default();
    Ok(sluice_http::ServeOptions {
        header_read_timeout: seconds("--header-read-timeout-s", args.header_read_timeout_s)?,
        body_read_timeout: seconds("--body-read-timeout-s", args.body_read_timeout_s)?,
        write_stall_timeout: seconds("--write-stall-timeout-s", args.write_stall_timeout_s)?,
        max_connections: match args.max_connections {
            0 => defaults.max_connections,
            n => n,
        },
        shutdown_grace: seconds("--shutdown-grace-s", args.shutdown_grace_s)?,
    })
}

/// Runs one command.
pub fn run(command: Command) -> anyhow::Result<ExitCode> {
    match command {
        Command::Check(args) => check::run(&args),
        Command::Data(args) => data::run(&args),
        Command::Run(args) => run::run(&args),
        Command::Knobs(args) => knobs::run(&args),
        Command::Status(args) => status::run(&args),
        Command::Pause(args) => status::set_paused(&args, true),
        Command::Resume(args) => status::set_paused(&args, false),
        Command::Replay(ReplayCommand::Clear(args)) => replay::clear(&args),
        Command::Bench(BenchCommand::Pipeline(args)) => sluice_bench::pipeline::pipeline(&args),
        Command::Bench(BenchCommand::Overhead(args)) => sluice_bench::pipeline::overhead(&args),
        Command::Model(cmd) => model::run(cmd),
        Command::Bench(BenchCommand::Model(args)) => sluice_bench::model::run(&args),
        Command::Bench(BenchCommand::Trainer(args)) => sluice_bench::trainer::run(&args),
        Command::EnvServer(args) => env_server::run(&args),
        Command::Serve(args) => serve::run(&args),
        Command::Bench(BenchCommand::Engine(args)) => sluice_bench::engine::run(&args),
        Command::Bench(BenchCommand::Kernels(args)) => sluice_bench::kernels::run(&args),
        Command::Bench(BenchCommand::RewardModel(args)) => sluice_bench::reward::run(&args),
        Command::Bench(BenchCommand::Weights(args)) => sluice_bench::weights::run(&args),
        Command::Bench(BenchCommand::Cluster(args)) => sluice_bench::cluster::run(&args),
        Command::Plot(args) => plot::run(&args),
    }
}
