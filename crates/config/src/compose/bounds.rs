//! Upper bounds of the numeric keys, checked on the TOML tree (after `--set`, before the typed
//! checks). Without them a typo'd exponent got through: `env_step_timeout_s = 1e300` panicked in
//! `Duration::from_secs_f64`, `engine.replicas = 100000` was accepted and the run aborted on
//! allocation. Each bound is generous for real use and far below what breaks arithmetic or
//! memory; a value over it is refused with the key, the bound and what the bound is for.
//!
//! Every numeric key has a row here or in [`CHECKED_ELSEWHERE`] (a test walks the printed
//! config and fails on a key with neither), so a new key cannot arrive unbounded.

use sluice_core::config::ConfigError;
use sluice_core::config::check::Ctx;
use sluice_core::knobs::show_number as show;

/// Longest duration any `*_s` key accepts: a week. Longer timeouts are indistinguishable from
/// "never" in practice, and the bound keeps `Duration` arithmetic far from overflow.
pub(crate) const MAX_SECONDS: f64 = 7.0 * 24.0 * 3600.0;

/// Longest any simulated cost may be (one simulated step, one token's prefill), seconds: an
/// hour. Simulated costs are multiplied by counts (sequences, tokens) and by `time_scale`.
const MAX_SIM_SECONDS: f64 = 3600.0;

/// Largest token count of any length key (prompts, completions, packed rows): 1 Mi tokens.
const MAX_TOKENS: f64 = 1_048_576.0;

/// Largest step or period count: a billion.
const MAX_COUNT: f64 = 1e9;

/// One bound: the dotted key (`*` matches any name at that level), the largest value accepted,
/// and what it protects, for the message.
struct Bound {
    key: &'static str,
    max: f64,
    why: &'static str,
}

const fn bound(key: &'static str, max: f64, why: &'static str) -> Bound {
    Bound { key, max, why }
}

const SECONDS: &str = "seconds; a week at most";
const SIM: &str = "simulated seconds; an hour at most";
const TOKENS: &str = "tokens";
const STEPS: &str = "steps";
const REWARD: &str = "a reward";

/// Largest reward an override may set: rewards are averaged and normalized downstream, so a
/// typo'd exponent would swamp every other signal.
const MAX_REWARD: f64 = 1e6;

/// Every bound. Resource keys (replicas, sequences, batch sizes) are bounded by what one node
/// holds: each replica or sequence owns memory and tasks, so a typo must not reach the allocator.
const BOUNDS: &[Bound] = &[
    bound("run.max_steps", MAX_COUNT, STEPS),
    bound("engine.replicas", 256.0, "engine replicas on one node"),
    bound(
        "engine.max_running_sequences",
        16_384.0,
        "sequences per replica",
    ),
    bound("engine.max_step_tokens", MAX_TOKENS, TOKENS),
    bound("engine.threads", 1024.0, "compute threads per replica"),
    bound(
        "engine.kv_cache_mb",
        1_048_576.0,
        "MiB of KV cache per replica; 1 TiB at most",
    ),
    bound(
        "engine.kv_block_tokens",
        1024.0,
        "tokens per KV cache block",
    ),
    bound(
        "engine.prefix_cache_version_lag",
        1024.0,
        "weight versions a reused prefix block may lag",
    ),
    bound("engine.request_timeout_s", MAX_SECONDS, SECONDS),
    bound(
        "engine.simulated.time_scale",
        1000.0,
        "times real time; 1000 at most",
    ),
    bound(
        "engine.simulated.prefill_seconds_per_token",
        MAX_SIM_SECONDS,
        SIM,
    ),
    bound(
        "engine.simulated.decode_step_base_seconds",
        MAX_SIM_SECONDS,
        SIM,
    ),
    bound(
        "engine.simulated.decode_step_per_sequence_seconds",
        MAX_SIM_SECONDS,
        SIM,
    ),
    bound("engine.simulated.prompt_tokens", MAX_TOKENS, TOKENS),
    bound("engine.simulated.env_reply_tokens", MAX_TOKENS, TOKENS),
    bound("engine.simulated.lengths.*.tokens", MAX_TOKENS, TOKENS),
    bound("engine.simulated.lengths.*.min", MAX_TOKENS, TOKENS),
    bound("engine.simulated.lengths.*.max", MAX_TOKENS, TOKENS),
    bound("engine.simulated.lengths.*.median", MAX_TOKENS, TOKENS),
    bound(
        "engine.simulated.lengths.*.sigma",
        10.0,
        "log-space spread; e^10 is already 22,000×",
    ),
    bound("trainer.learning_rate", 1.0, "the learning rate"),
    bound("trainer.threads", 1024.0, "compute threads of the trainer"),
    bound("trainer.warmup_steps", MAX_COUNT, STEPS),
    bound("trainer.weight_decay", 1.0, "the decoupled weight decay"),
    bound("trainer.max_grad_norm", 1e6, "the gradient norm clip"),
    bound("trainer.clip_high", 100.0, "the upper ratio clip"),
    bound("trainer.kl_coef", 1000.0, "the KL penalty coefficient"),
    bound("trainer.micro_batch_size", 65_536.0, "rows per micro-batch"),
    bound("trainer.max_seq_len", MAX_TOKENS, TOKENS),
    bound("trainer.minibatches", 1024.0, "optimizer updates per step"),
    bound("trainer.is_cap", 1e6, "the importance-weight cap"),
    bound("trainer.simulated.step_base_seconds", MAX_SIM_SECONDS, SIM),
    bound(
        "trainer.simulated.step_seconds_per_token",
        MAX_SIM_SECONDS,
        SIM,
    ),
    bound(
        "engine.remote_keep_versions",
        1024.0,
        "weight versions kept on disk",
    ),
    bound("rollout.env_workers", 1024.0, "env workers on one node"),
    bound("node.heartbeat_s", MAX_SECONDS, SECONDS),
    bound("node.lost_after_s", MAX_SECONDS, SECONDS),
    bound("node.max_nodes", 4096.0, "members of one head"),
    bound(
        "rollout.env_calls_per_worker",
        65_536.0,
        "concurrent env calls per worker",
    ),
    bound("rollout.group_size", 4096.0, "rollouts per group"),
    bound("rollout.max_prompt_tokens", MAX_TOKENS, TOKENS),
    bound("rollout.balance_threshold", MAX_REWARD, REWARD),
    bound(
        "rollout.groups_per_step",
        65_536.0,
        "groups per training step",
    ),
    bound("rollout.max_turns", 1024.0, "turns per episode"),
    bound("rollout.max_new_tokens", MAX_TOKENS, TOKENS),
    bound("rollout.temperature", 100.0, "the sampling temperature"),
    bound("rollout.top_k", MAX_TOKENS, "candidate tokens"),
    bound(
        "rollout.max_version_lag",
        sluice_core::knobs::MAX_VERSION_LAG as f64,
        "policy versions",
    ),
    bound("rollout.tail_batch_candidate_steps", MAX_COUNT, "aborts"),
    bound("rollout.tail_batch_trigger_size", MAX_COUNT, "groups"),
    bound(
        "rollout.max_concurrent_rollouts",
        1_048_576.0,
        "rollouts in flight on one node",
    ),
    bound(
        "rollout.domain_mix.*",
        sluice_core::knobs::MAX_DOMAIN_WEIGHT,
        "a relative weight",
    ),
    bound("warmup.max_steps", MAX_COUNT, STEPS),
    bound("warmup.batch_size", 65_536.0, "demonstrations per step"),
    bound("warmup.learning_rate", 1.0, "the learning rate"),
    bound("warmup.check_every", MAX_COUNT, STEPS),
    bound("warmup.probe_samples", 1_048_576.0, "samples"),
    bound("eval.every_steps", MAX_COUNT, STEPS),
    bound("eval.samples", 1_048_576.0, "samples"),
    bound("eval.temperature", 100.0, "the sampling temperature"),
    bound("data.domains.*.rubric.weights.*", 1e9, "a relative weight"),
    bound(
        "data.domains.*.rubric.truncation_reward",
        MAX_REWARD,
        REWARD,
    ),
    bound("data.domains.*.rubric.error_reward", MAX_REWARD, REWARD),
    bound("data.domains.*.rubric.timeout_s", MAX_SECONDS, SECONDS),
    bound("data.domains.*.max_new_tokens", MAX_TOKENS, TOKENS),
    bound(
        "supervision.restart_backoff_initial_s",
        MAX_SECONDS,
        SECONDS,
    ),
    bound("supervision.restart_backoff_max_s", MAX_SECONDS, SECONDS),
    bound("supervision.engine_watchdog_s", MAX_SECONDS, SECONDS),
    bound("supervision.checkpoint_every_steps", MAX_COUNT, STEPS),
    bound("supervision.shutdown_timeout_s", MAX_SECONDS, SECONDS),
    bound("supervision.env_step_timeout_s", MAX_SECONDS, SECONDS),
    bound(
        "supervision.engine_max_restarts",
        MAX_COUNT,
        "failures in a row",
    ),
    bound(
        "supervision.engine_unavailable_timeout_s",
        MAX_SECONDS,
        SECONDS,
    ),
    bound("supervision.no_progress_groups", MAX_COUNT, "groups"),
    bound("faults.*", MAX_COUNT, "a fault period"),
];

/// Numeric keys bounded by other means: seeds (any value is a valid seed) and shares or
/// probabilities that their own checks hold to `[0, 1]` or to the knob's limit. (Read by the
/// coverage test only: these keys need nothing here.)
#[cfg(test)]
const CHECKED_ELSEWHERE: &[&str] = &[
    "run.seed",
    "engine.simulated.seed",
    "trainer.clip_low",
    "trainer.gamma",
    "rollout.top_p",
    "rollout.staleness_threshold",
    "warmup.target_accuracy",
    "eval.stop_at_accuracy",
    "data.domains.*.warmup_target_accuracy",
];

/// Whether `key` (dotted) matches `pattern` (`*` matches one level).
fn matches(pattern: &str, key: &str) -> bool {
    let (mut p, mut k) = (pattern.split('.'), key.split('.'));
    loop {
        match (p.next(), k.next()) {
            (None, None) => return true,
            (Some(a), Some(b)) if a == "*" || a == b => {}
            _ => return false,
        }
    }
}

/// The bound of `key`, if it has one here.
fn bound_of(key: &str) -> Option<&'static Bound> {
    BOUNDS.iter().find(|b| matches(b.key, key))
}

/// Whether `key` is bounded: a row in [`BOUNDS`] or in [`CHECKED_ELSEWHERE`].
#[cfg(test)]
fn is_bounded(key: &str) -> bool {
    bound_of(key).is_some() || CHECKED_ELSEWHERE.iter().any(|p| matches(p, key))
}

/// Every numeric leaf of `tree` with its dotted key.
fn numeric_leaves(prefix: &str, tree: &toml::Table, out: &mut Vec<(String, f64)>) {
    for (name, value) in tree {
        let key = if prefix.is_empty() {
            name.clone()
        } else {
            format!("{prefix}.{name}")
        };
        match value {
            toml::Value::Integer(i) => out.push((key, *i as f64)),
            toml::Value::Float(f) => out.push((key, *f)),
            toml::Value::Table(t) => numeric_leaves(&key, t, out),
            _ => {}
        }
    }
}

/// Refuses the first numeric value above its key's bound. Values of the wrong type and
/// non-finite ones are left to the typed checks, which say what type or range was expected.
pub(crate) fn check(tree: &toml::Table, ctx: &Ctx<'_>) -> Result<(), ConfigError> {
    let mut leaves = Vec::new();
    numeric_leaves("", tree, &mut leaves);
    for (key, v) in leaves {
        let Some(b) = bound_of(&key) else { continue };
        if v.is_finite() && v > b.max {
            return Err(ctx.value(
                &key,
                format!(
                    "expected at most {} ({}), got {}",
                    show(b.max),
                    b.why,
                    show(v)
                ),
            ));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::parse;

    fn load(text: &str) -> Result<crate::Config, String> {
        parse(text, "t.toml", &[], &|_| None).map_err(|e| e.to_string())
    }

    /// Every numeric key the config prints, with every optional table filled in, has a bound:
    /// a key added without one fails here.
    #[test]
    fn every_numeric_key_is_bounded() {
        let full = load(
            r#"
            [data]
            datasets = ["math::a"]
            [rollout]
            domain_mix = { math = 1.0 }
            [engine.simulated]
            seed = 3
            [engine.simulated.lengths.math]
            distribution = "uniform"
            min = 1
            max = 8
            [engine.simulated.lengths.fixed]
            distribution = "fixed"
            tokens = 8
            [eval]
            stop_at_accuracy = 0.9
            [data.domains.math]
            max_new_tokens = 16
            warmup_target_accuracy = 0.5
            [data.domains.math.rubric]
            weights = { correct = 1.0, format = 0.1 }
            truncation_reward = 0.0
            error_reward = -1.0
            timeout_s = 5.0
            [node]
            role = "engine"
            head = "http://127.0.0.1:9401"
            "#,
        )
        .unwrap();
        let tree: toml::Table = full.to_toml().parse().unwrap();
        let mut leaves = Vec::new();
        numeric_leaves("", &tree, &mut leaves);
        assert!(leaves.len() > 60, "{} numeric keys", leaves.len());
        let unbounded: Vec<&str> = leaves
            .iter()
            .map(|(k, _)| k.as_str())
            .filter(|k| !is_bounded(k))
            .collect();
        assert!(
            unbounded.is_empty(),
            "numeric keys without an upper bound (add a row to BOUNDS): {unbounded:?}"
        );
    }

    #[test]
    fn the_defaults_and_the_shipped_configs_are_within_bounds() {
        load("").unwrap();
        let configs = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../configs");
        for entry in std::fs::read_dir(configs).unwrap() {
            let path = entry.unwrap().path();
            if path.extension().is_some_and(|e| e == "toml") {
                let text = std::fs::read_to_string(&path).unwrap();
                let tree: toml::Table = text.parse().unwrap();
                let mut leaves = Vec::new();
                numeric_leaves("", &tree, &mut leaves);
                for (key, v) in leaves {
                    if let Some(b) = bound_of(&key) {
                        assert!(v <= b.max, "{}: {key} = {v} over {}", path.display(), b.max);
                    }
                }
            }
        }
    }

    #[test]
    fn patterns_match_one_level() {
        assert!(matches("faults.*", "faults.env_hang_every_steps"));
        assert!(!matches("faults.*", "faults"));
        assert!(matches(
            "engine.simulated.lengths.*.tokens",
            "engine.simulated.lengths.math.tokens"
        ));
        assert!(!matches("engine.replicas", "engine.replicas.x"));
        assert_eq!(show(1e300), "1e300");
        assert_eq!(show(604800.0), "604800");
    }
}
