//! `sluice check CONFIG [--set k=v]...`: validate and print the resolved config, and say what a
//! run of it would resume from.

use std::process::ExitCode;

use sluice_actors::checkpoint::{CHECKPOINT_DIR, CheckpointDir};
use sluice_config::{Config, NodeRole};

use crate::cli::ConfigArgs;

/// Loads the config (overrides first), builds its tasks (so a rubric naming a reward function
/// its task lacks is refused here, as `sluice run` would), refuses what this binary on this
/// host could not run ([`sluice_config::check_deployment`]: a CUDA device in a CPU-only build, a
/// node serving beyond loopback without its token, a loopback `node.advertise` for other
/// machines), says on stderr what a run would resume from ([`resume_preview`]), and prints the
/// config as TOML on stdout, after any [`sluice_config::Config::advisories`] on stderr. Nothing
/// is started and no file is written.
pub fn run(args: &ConfigArgs) -> anyhow::Result<ExitCode> {
    let config = sluice_config::load(&args.config, &args.overrides)?;
    sluice_env::configured::registry(
        &config.data,
        config.supervision.env_step_timeout,
        Some(&*sluice_node::reward_models::checked()),
    )
    .map_err(|e| anyhow::anyhow!("{}: {e}", args.config.display()))?;
    sluice_node::reward_models::check_critic(&config, None)
        .map_err(|e| anyhow::anyhow!("{}: {e}", args.config.display()))?;
    let deployment = sluice_config::Deployment {
        cuda_built: cfg!(feature = "cuda"),
        env_token: super::env_server::token_from_env()?.is_some(),
    };
    sluice_config::check_deployment(&config, &args.config.display().to_string(), &deployment)?;
    for note in config.advisories() {
        eprintln!("warning: {note}");
    }
    resume_preview(&config)?;
    print!("{}", config.to_toml());
    Ok(ExitCode::SUCCESS)
}

/// The checkpoint a `sluice run` of `config` would resume from, checked as the run checks it
/// (the manifest, and every file's size and CRC-32 against it), and the keys the config changed
/// since, on stderr; a checkpoint the run would refuse is the error it would stop with. The
/// trainer's state itself is read only by the run.
fn resume_preview(config: &Config) -> anyhow::Result<()> {
    if config
        .node
        .as_ref()
        .is_some_and(|n| n.role != NodeRole::Head)
    {
        return Ok(());
    }
    let dir = CheckpointDir::new(config.run.output_dir.join(CHECKPOINT_DIR));
    let Some((root, m)) = dir
        .load()
        .map_err(|e| anyhow::anyhow!("a run of this config would not resume: {e}"))?
    else {
        return Ok(());
    };
    eprintln!(
        "resumes from {} at step {} (version {}, written at `{}`); its files are as written",
        root.display(),
        m.steps,
        m.version,
        m.reason
    );
    if let Some(changed) = sluice_node::checkpoints::config_changes(&root, &config.to_toml())
        && !changed.is_empty()
    {
        eprintln!("changed since that checkpoint: {}", changed.join("; "));
    }
    Ok(())
}
