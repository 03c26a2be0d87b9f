//! Upper bounds of the numeric keys of `[data]` and `[data.domains.<domain>]` (`sluice_core::config::bounds`):
//! generous for real use, far below what breaks arithmetic or memory. Resource keys are bounded by
//! what one node holds.

use sluice_core::config::bounds::{
    Bound, MAX_REWARD, MAX_SECONDS, MAX_TOKENS, REWARD, SECONDS, TOKENS, bound,
};

/// Every bound of `[data]` and `[data.domains.<domain>]`.
pub const BOUNDS: &[Bound] = &[
    bound(
        "data.max_line_bytes",
        (1u64 << 30) as f64,
        "bytes; 1 GiB at most",
    ),
    bound(
        "data.max_file_bytes",
        (1u64 << 40) as f64,
        "bytes; 1 TiB at most",
    ),
    bound("data.domains.*.rubric.weights.*", 1e9, "a relative weight"),
    bound(
        "data.domains.*.rubric.truncation_reward",
        MAX_REWARD,
        REWARD,
    ),
    bound("data.domains.*.rubric.error_reward", MAX_REWARD, REWARD),
    bound("data.domains.*.rubric.timeout_s", MAX_SECONDS, SECONDS),
    bound("data.domains.*.max_new_tokens", MAX_TOKENS, TOKENS),
    bound("data.domains.*.rubric.judge.max_score", 1e9, "a score"),
    bound("data.domains.*.rubric.judge.max_tokens", MAX_TOKENS, TOKENS),
    bound(
        "data.domains.*.rubric.reward_model.max_tokens",
        MAX_TOKENS,
        TOKENS,
    ),
    bound(
        "data.domains.*.rubric.judge.timeout_s",
        MAX_SECONDS,
        SECONDS,
    ),
];
