//! `sluice check CONFIG [--set k=v]...`: validate and print the resolved config.

use std::process::ExitCode;

use crate::cli::ConfigArgs;

/// Loads the config (overrides first), builds its tasks (so a rubric naming a reward function
/// its task lacks is refused here, as `sluice run` would), and prints the config as TOML on
/// stdout, after any [`sluice_config::Config::advisories`] on stderr. Nothing is started
/// and no file is written.
pub fn run(args: &ConfigArgs) -> anyhow::Result<ExitCode> {
    let config = sluice_config::load(&args.config, &args.overrides)?;
    sluice_env::configured::registry(&config.data, config.supervision.env_step_timeout)
        .map_err(|e| anyhow::anyhow!("{}: {e}", args.config.display()))?;
    for note in config.advisories() {
        eprintln!("warning: {note}");
    }
    print!("{}", config.to_toml());
    Ok(ExitCode::SUCCESS)
}
