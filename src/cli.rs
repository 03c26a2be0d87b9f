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
