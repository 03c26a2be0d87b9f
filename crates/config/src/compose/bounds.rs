//! Upper bounds of the numeric keys, checked on the TOML tree (after `--set`, before the typed
//! checks). Without them a typo'd exponent got through: `env_step_timeout_s = 1e300` panicked in
//! `Duration::from_secs_f64`, `engine.replicas = 100000` was accepted and the run aborted on
//! allocation. Each bound is generous for real use and far below what breaks arithmetic or
//! memory; a value over it is refused with the key, the bound and what the bound is for.
//!
//! Each section's rows live with its checks (a `BOUNDS` table in its crate's config module, built
//! from `sluice_core::config::bounds`); this file checks them all. Every numeric key has a row in
//! one of them or in [`CHECKED_ELSEWHERE`] (a test walks the printed config and fails on a key
//! with neither), so a new key cannot arrive unbounded.

use sluice_core::config::ConfigError;
use sluice_core::config::bounds::Bound;
use sluice_core::config::check::Ctx;
use sluice_core::knobs::show_number as show;

/// Every section's table, owner by owner.
const TABLES: &[&[Bound]] = &[
    crate::sections::bounds::BOUNDS,
    sluice_engine::config::BOUNDS,
    sluice_trainer::config::BOUNDS,
    sluice_data::config::BOUNDS,
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
    "trainer.gae_gamma",
    "trainer.gae_lambda",
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
    TABLES
        .iter()
        .flat_map(|t| t.iter())
        .find(|b| matches(b.key, key))
}

/// Whether `key` is bounded: a row in one of the [`TABLES`] or in [`CHECKED_ELSEWHERE`].
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
            "numeric keys without an upper bound (add a row to its section's BOUNDS): {unbounded:?}"
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
