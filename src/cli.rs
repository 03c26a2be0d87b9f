//! Command-line interface: every subcommand and flag Sluice accepts, in one place.
//!
//! Flags are public interface: add freely, rename never.

use std::path::PathBuf;

use clap::{Parser, Subcommand};
use sluice_core::config::Override;

/// Asynchronous reinforcement learning for language models.
#[derive(Debug, Parser)]
#[command(name = "sluice", version, about, propagate_version = true)]
pub struct Cli {
    /// What to do.
    #[command(subcommand)]
    pub command: Command,
}

/// The subcommands.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Validate a config file and print the resolved config as TOML.
    Check(ConfigArgs),
    /// Serve the built-in tasks' environments over the remote env protocol (JSON over HTTP).
    EnvServer(EnvServerArgs),
}

/// A config file plus `--set` overrides.
#[derive(Debug, clap::Args)]
pub struct ConfigArgs {
    /// Path to the TOML config.
    pub config: PathBuf,
    /// Override a key before validation, e.g. `--set rollout.group_size=4` (repeatable).
    #[arg(long = "set", value_name = "KEY=VALUE", value_parser = parse_override)]
    pub overrides: Vec<Override>,
}

fn parse_override(s: &str) -> Result<Override, String> {
    s.parse()
}

/// `sluice env-server`
#[derive(Debug, clap::Args)]
pub struct EnvServerArgs {
    /// Address to bind. The protocol has no authentication: bind beyond loopback only on a
    /// trusted network.
    #[arg(long, default_value = "127.0.0.1")]
    pub host: std::net::IpAddr,
    /// Port; 0 picks a free one (the bound address is printed).
    #[arg(long, default_value_t = 8071)]
    pub port: u16,
    /// Envs open at once; more are refused with 503 until some close.
    #[arg(long, default_value_t = 1024)]
    pub max_envs: usize,
    /// Deadline of each env call, in seconds.
    #[arg(long, default_value_t = 30.0)]
    pub call_timeout_s: f64,
    /// Envs unused for this many seconds are dropped when a new env is created (clients that
    /// died without closing); must exceed the call timeout.
    #[arg(long, default_value_t = 600.0)]
    pub idle_timeout_s: f64,
}
