//! `sluice env-server`: serves the environments of the built-in tasks over the remote env
//! protocol (`docs/envs.md`), so env workers can run in another process or on another machine.
//! Runs until SIGINT or SIGTERM, then stops accepting and exits 0.
//!
//! The admin API's rule applies: a bind beyond loopback needs a token (`$SLUICE_ENV_TOKEN`),
//! because env calls run task code on this machine and the calculator's evaluator, say, is
//! reachable by anyone who can open an env.

use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, bail};
use sluice_config::Secret;
use sluice_env::TaskRegistry;
use sluice_env::remote::{ServerConfig, serve};

use crate::cli::EnvServerArgs;

/// The environment variable holding the server's bearer token.
pub const ENV_TOKEN_VAR: &str = "SLUICE_ENV_TOKEN";

/// The server's bearer token from `$SLUICE_ENV_TOKEN`, if set (trimmed: a token read from a
/// file with its newline is the same token).
pub fn token_from_env() -> anyhow::Result<Option<Secret>> {
    sluice_http::auth::token_from_env(ENV_TOKEN_VAR).map_err(anyhow::Error::msg)
}

/// Runs the server.
pub fn run(args: &EnvServerArgs) -> anyhow::Result<ExitCode> {
    let call_timeout = Duration::try_from_secs_f64(args.call_timeout_s)
        .ok()
        .filter(|d| !d.is_zero())
        .with_context(|| {
            format!(
                "--call-timeout-s: expected a number of seconds > 0, got {}",
                args.call_timeout_s
            )
        })?;
    let idle_timeout = Duration::try_from_secs_f64(args.idle_timeout_s)
        .ok()
        .filter(|d| *d > call_timeout)
        .with_context(|| {
            format!(
                "--idle-timeout-s: expected more seconds than --call-timeout-s ({}), got {}",
                args.call_timeout_s, args.idle_timeout_s
            )
        })?;
    if args.max_envs == 0 {
        bail!("--max-envs: expected an integer ≥ 1, got 0");
    }
    let token = token_from_env()?;
    if !args.host.is_loopback() && token.is_none() {
        bail!(
            "--host {}: not a loopback address; set ${ENV_TOKEN_VAR} to serve envs beyond this machine (clients send it as a bearer token)",
            args.host
        );
    }
    let config = ServerConfig {
        max_envs: args.max_envs,
        call_timeout,
        idle_timeout,
        token,
        http: super::serve_options(&args.http)?,
    };
    // Env calls are light (parsing, tiny simulations); two workers keep a 2-core machine usable.
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .context("cannot start the async runtime")?;
    runtime.block_on(async {
        let listener = tokio::net::TcpListener::bind((args.host, args.port))
            .await
            .with_context(|| format!("cannot bind {}:{}", args.host, args.port))?;
        let addr = listener.local_addr()?;
        let registry = Arc::new(TaskRegistry::builtin());
        println!(
            "sluice env-server listening on http://{addr} (tasks: {})",
            registry.names().join(", ")
        );
        serve(listener, registry, config, super::shutdown_signal())
            .await
            .context("env server failed")?;
        tracing::info!("env server stopped");
        Ok(ExitCode::SUCCESS)
    })
}
