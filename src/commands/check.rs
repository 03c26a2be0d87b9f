//! `sluice check CONFIG [--set k=v]...`: validate and print the resolved config.

use std::process::ExitCode;

use crate::cli::ConfigArgs;

/// Loads the config (overrides first), builds its tasks (so a rubric naming a reward function
/// its task lacks is refused here, as `sluice run` would), refuses what this binary on this
/// host could not run ([`sluice_config::check_deployment`]: a CUDA device in a CPU-only build, a
/// node serving beyond loopback without its token, a loopback `node.advertise` for other
/// machines), and prints the config as TOML on stdout, after any
/// [`sluice_config::Config::advisories`] on stderr. Nothing is started and no file is written.
pub fn run(args: &ConfigArgs) -> anyhow::Result<ExitCode> {
    let config = sluice_config::load(&args.config, &args.overrides)?;
    sluice_env::configured::registry(&config.data, config.supervision.env_step_timeout)
        .map_err(|e| anyhow::anyhow!("{}: {e}", args.config.display()))?;
    let deployment = sluice_config::Deployment {
        cuda_built: cfg!(feature = "cuda"),
        env_token: super::env_server::token_from_env()?.is_some(),
    };
    sluice_config::check_deployment(&config, &args.config.display().to_string(), &deployment)?;
    for note in config.advisories() {
        eprintln!("warning: {note}");
    }
    print!("{}", config.to_toml());
    Ok(ExitCode::SUCCESS)
}
