//! Deployment checks: what a valid config cannot do on the build and host that would run it.
//!
//! A config can be right on its own and still fail the moment `sluice run` starts it: a CUDA
//! device in a CPU-only build, an engine or env node listening beyond loopback without the token
//! its server requires, a node telling the others to reach it at a loopback address while it
//! listens for other machines. `sluice check` runs these checks so a launcher (`ops/slurm`,
//! `ops/kubernetes`) refuses such a config before anything starts; every error names the key.

use std::net::{IpAddr, SocketAddr};

use sluice_core::config::{ConfigError, ConfigErrorKind, Device};
use sluice_engine::config::EngineBackend;

use crate::ADMIN_TOKEN_ENV;
use crate::sections::NodeRole;
use crate::typed::Config;

/// The environment variable holding the env servers' bearer token (an env node requires it
/// beyond loopback; a head sends it to its env nodes).
pub const ENV_TOKEN_ENV: &str = "SLUICE_ENV_TOKEN";

/// What the checks need to know about the binary and its environment.
#[derive(Debug, Clone, Copy)]
pub struct Deployment {
    /// The binary was built with CUDA (`--features cuda`).
    pub cuda_built: bool,
    /// `$SLUICE_ENV_TOKEN` holds a token (non-empty once trimmed).
    pub env_token: bool,
}

/// Refuses what `sluice run` of this config would refuse, or would start and never make work,
/// on the deployment described; `file` names the config in the error.
pub fn check_deployment(config: &Config, file: &str, d: &Deployment) -> Result<(), ConfigError> {
    let err = |key: &str, message: String| {
        ConfigError::key(file, key.to_owned(), ConfigErrorKind::Value, message)
    };
    if !d.cuda_built
        && let Some((key, device)) = cuda_devices(config).into_iter().next()
    {
        return Err(err(
            key,
            format!(
                "{device} needs a CUDA build: this sluice was built without CUDA (build with `cargo build --release --features cuda`, docs/gpu.md), or set {key} = \"cpu\""
            ),
        ));
    }
    let Some(node) = &config.node else {
        return Ok(());
    };
    // Where the node serves other machines from: a member's node.listen, the head's admin.listen.
    let (listen_key, listen) = match node.role {
        NodeRole::Head => ("admin.listen", config.admin.listen),
        NodeRole::Engine | NodeRole::Env => match node.listen {
            Some(l) => ("node.listen", l),
            None => return Ok(()),
        },
    };
    let beyond_loopback = !listen.ip().is_loopback();
    if beyond_loopback {
        tokens(config, node.role, listen, d).map_err(|(key, m)| err(&key, m))?;
    }
    if let Some(url) = &node.advertise
        && beyond_loopback
        && advertises_loopback(url)
    {
        return Err(err(
            "node.advertise",
            format!(
                "{url} is a loopback address, but {listen_key} = {listen} serves other machines: they would reach themselves, not this node; advertise an address they can reach (on Debian/Ubuntu `hostname -i` often answers 127.0.1.1: use `hostname -I`)"
            ),
        ));
    }
    Ok(())
}

/// The tokens a node serving beyond loopback needs: a key to blame and why.
fn tokens(
    config: &Config,
    role: NodeRole,
    listen: SocketAddr,
    d: &Deployment,
) -> Result<(), (String, String)> {
    match role {
        NodeRole::Engine if config.admin.token.is_none() => Err((
            "node.listen".to_owned(),
            format!(
                "{listen} is not a loopback address: set admin.token or ${ADMIN_TOKEN_ENV} (the node token) so the engine's weight and control routes are guarded"
            ),
        )),
        NodeRole::Env if !d.env_token => Err((
            "node.listen".to_owned(),
            format!(
                "{listen} is not a loopback address: set ${ENV_TOKEN_ENV} (the env servers' bearer token; the head sends the same) to serve envs beyond this machine"
            ),
        )),
        NodeRole::Head if !d.env_token => {
            // Env nodes of a head that other machines reach listen beyond loopback too, and
            // refuse calls without the token: every rollout of the domain would fail.
            match config.data.domain_options.iter().find(|(_, o)| o.env_nodes) {
                Some((domain, _)) => Err((
                    format!("data.domains.{domain}.env_nodes"),
                    format!(
                        "data.domains.{domain}.env_nodes = true on a head serving {listen}: set ${ENV_TOKEN_ENV} (the env nodes' token), or every call to them is refused and each rollout of `{domain}` fails"
                    ),
                )),
                None => Ok(()),
            }
        }
        _ => Ok(()),
    }
}

/// The CUDA devices the config's role would open, each with the key that sets it.
fn cuda_devices(config: &Config) -> Vec<(&'static str, Device)> {
    let role = config.node.as_ref().map(|n| n.role);
    let mut used = Vec::new();
    match role {
        // An env node runs tasks only: no model, no device.
        Some(NodeRole::Env) => {}
        Some(NodeRole::Engine) => used.push(("engine.device", config.engine.device)),
        Some(NodeRole::Head) | None => {
            used.push(("trainer.device", config.trainer.device));
            used.push(("eval.device", config.eval.device));
            if config.engine.backend == EngineBackend::Native {
                used.push(("engine.device", config.engine.device));
            }
        }
    }
    // `model.device` is the default of every role's key: name it when it is the one set.
    used.into_iter()
        .filter(|(_, d)| matches!(d, Device::Cuda(_)))
        .map(|(key, d)| {
            if d == config.model.device {
                ("model.device", d)
            } else {
                (key, d)
            }
        })
        .collect()
}

/// `http://host:port` with a loopback host (`127.0.0.0/8`, `::1`, `localhost`).
fn advertises_loopback(url: &str) -> bool {
    let authority = url.trim_start_matches("http://");
    let host = authority
        .rsplit_once(':')
        .map_or(authority, |(h, _)| h)
        .trim_start_matches('[')
        .trim_end_matches(']');
    host.eq_ignore_ascii_case("localhost")
        || host.parse::<IpAddr>().is_ok_and(|ip| ip.is_loopback())
}
