//! `sluice check CONFIG [--set k=v]...`: validate and print the resolved config.

use std::process::ExitCode;

use crate::cli::ConfigArgs;

/// Loads the config (overrides first), prints it as TOML on stdout. Nothing is started and no
/// file is written.
pub fn run(args: &ConfigArgs) -> anyhow::Result<ExitCode> {
    let config = sluice_core::config::load(&args.config, &args.overrides)?;
    print!("{}", config.to_toml());
    Ok(ExitCode::SUCCESS)
}
