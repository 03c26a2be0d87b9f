//! Upper bounds of the numeric keys of `[engine]` and `[engine.simulated]`
//! (`sluice_core::config::bounds`): generous for real use, far below what breaks arithmetic or
//! memory. Resource keys are bounded by what one node holds.

use sluice_core::config::bounds::{
    Bound, MAX_SECONDS, MAX_SIM_SECONDS, MAX_TOKENS, SECONDS, SIM, TOKENS, bound,
};

/// Every bound of `[engine]` and `[engine.simulated]`.
pub const BOUNDS: &[Bound] = &[
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
    bound(
        "engine.remote_keep_versions",
        1024.0,
        "weight versions kept on disk",
    ),
];
