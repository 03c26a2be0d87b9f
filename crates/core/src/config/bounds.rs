//! Upper bounds of numeric config keys, one row per key, with the shared limits and reasons: each
//! crate lists the bounds of its own section next to its checks (a `BOUNDS` table), and
//! `sluice-config` checks every table on the TOML tree before the typed checks run (its
//! `compose/bounds.rs`, which also holds the test that every numeric key has a row).

/// Longest duration any `*_s` key accepts: a week. Longer timeouts are indistinguishable from
/// "never" in practice, and the bound keeps `Duration` arithmetic far from overflow.
pub const MAX_SECONDS: f64 = 7.0 * 24.0 * 3600.0;

/// Longest any simulated cost may be (one simulated step, one token's prefill), seconds: an
/// hour. Simulated costs are multiplied by counts (sequences, tokens) and by `time_scale`.
pub const MAX_SIM_SECONDS: f64 = 3600.0;

/// Largest token count of any length key (prompts, completions, packed rows): 1 Mi tokens.
pub const MAX_TOKENS: f64 = 1_048_576.0;

/// Largest step or period count: a billion.
pub const MAX_COUNT: f64 = 1e9;

/// One bound: the dotted key (`*` matches any name at that level), the largest value accepted,
/// and what it protects, for the message.
pub struct Bound {
    /// The dotted key; `*` matches any name at that level.
    pub key: &'static str,
    /// The largest value accepted.
    pub max: f64,
    /// What the bound protects, for the message.
    pub why: &'static str,
}

/// A [`Bound`] row.
pub const fn bound(key: &'static str, max: f64, why: &'static str) -> Bound {
    Bound { key, max, why }
}

/// Why of a `*_s` bound.
pub const SECONDS: &str = "seconds; a week at most";
/// Why of a simulated-cost bound.
pub const SIM: &str = "simulated seconds; an hour at most";
/// Why of a token-count bound.
pub const TOKENS: &str = "tokens";
/// Why of a step-count bound.
pub const STEPS: &str = "steps";
/// Why of a reward bound.
pub const REWARD: &str = "a reward";

/// Largest reward an override may set: rewards are averaged and normalized downstream, so a
/// typo'd exponent would swamp every other signal.
pub const MAX_REWARD: f64 = 1e6;
