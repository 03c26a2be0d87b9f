//! The TOML configs of the head and its nodes (part of the `cluster` test binary).

use super::*;

pub(super) fn head_config(dir: &Path, admin: &str, metrics: &str) -> PathBuf {
    head_config_with(dir, admin, metrics, &HeadOptions::default())
}

/// What the drills change in the head's config.
pub(super) struct HeadOptions {
    /// The training episodes run on the env nodes (else on the head's own envs).
    pub(super) env_nodes: bool,
    /// `node.lost_after_s`.
    pub(super) lost_after_s: f64,
    /// `supervision.engine_max_restarts`.
    pub(super) engine_max_restarts: u64,
}

impl Default for HeadOptions {
    fn default() -> Self {
        Self {
            env_nodes: true,
            lost_after_s: 1.0,
            engine_max_restarts: 10,
        }
    }
}

pub(super) fn head_config_with(dir: &Path, admin: &str, metrics: &str, o: &HeadOptions) -> PathBuf {
    let text = format!(
        r#"
[run]
name = "cluster"
max_steps = 1000
output_dir = "{out}"

[model]
init_preset = "tiny"

[engine]
backend = "remote"
replicas = 2
max_running_sequences = 64
remote_keep_versions = 8

[trainer]
micro_batch_size = 16
max_seq_len = 128

[rollout]
group_size = 4
groups_per_step = {B}
max_new_tokens = 6
max_version_lag = 1
weight_update_mode = "abort_resume"
enable_partial_rollout = true

[data]
datasets = ["math::arithmetic@train"]

# The episodes run on the env nodes that join (when env_nodes).
[data.domains.math]
env_nodes = {env_nodes}

[replay]
filter_zero_advantage = false

[warmup]
enabled = false

[eval]
every_steps = 0
samples = 8

[metrics]
enabled = true
listen = "{metrics}"

[admin]
listen = "{admin}"

[supervision]
checkpoint_every_steps = 5
restart_backoff_max_s = 1.0
engine_max_restarts = {max_restarts}

[node]
role = "head"
heartbeat_s = 0.2
lost_after_s = {lost_after}
"#,
        out = dir.join("head").display(),
        env_nodes = o.env_nodes,
        lost_after = o.lost_after_s,
        max_restarts = o.engine_max_restarts,
    );
    let path = dir.join("head.toml");
    std::fs::write(&path, text).unwrap();
    path
}

pub(super) fn env_config(dir: &Path, head: &str, listen: &str) -> PathBuf {
    let text = format!(
        r#"
[run]
name = "cluster"
output_dir = "{out}"

[node]
role = "env"
name = "env1"
head = "{head}"
listen = "{listen}"
"#,
        out = dir.join("env1").display()
    );
    let path = dir.join("env1.toml");
    std::fs::write(&path, text).unwrap();
    path
}

pub(super) fn engine_config(dir: &Path, tag: &str, head: &str, listen: &str) -> PathBuf {
    engine_config_advertising(dir, tag, head, listen, None)
}

/// An engine node's config, `advertise` (when given) being the URL it tells the head.
pub(super) fn engine_config_advertising(
    dir: &Path,
    tag: &str,
    head: &str,
    listen: &str,
    advertise: Option<&str>,
) -> PathBuf {
    let advertise = advertise.map_or_else(String::new, |a| format!("advertise = \"{a}\"\n"));
    let text = format!(
        r#"
[run]
name = "cluster"
seed = 7
output_dir = "{out}"

[model]
init_preset = "tiny"

[engine]
max_running_sequences = 64

[node]
role = "engine"
name = "{tag}"
head = "{head}"
listen = "{listen}"
{advertise}"#,
        out = dir.join(tag).display()
    );
    let path = dir.join(format!("{tag}.toml"));
    std::fs::write(&path, text).unwrap();
    path
}
