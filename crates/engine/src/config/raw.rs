//! `[engine]` and `[engine.simulated]` as serde reads them.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

/// `[engine]`: rollout generation.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RawEngine {
    /// `native`, `remote` or `simulated`.
    pub backend: String,
    /// `cpu` or `cuda:N` of the native replicas (default `model.device`).
    pub device: Option<String>,
    /// Engine replicas on this node.
    pub replicas: i64,
    /// Cap on sequences decoded together per replica.
    pub max_running_sequences: i64,
    /// Token budget of one scheduler step (prefill + decode).
    pub max_step_tokens: i64,
    /// Compute threads per native replica (0 = half the cores).
    pub threads: i64,
    /// The native replicas' matrix products: `f32` or `bf16` (unset: the weights' dtype).
    pub compute_dtype: Option<String>,
    /// One product for q/k/v and one for gate/up per layer, their weights stacked (unset: on
    /// a GPU, off on the CPU).
    pub stacked_products: Option<bool>,
    /// Decode-only steps captured and replayed as CUDA graphs (a CUDA `engine.device` only).
    pub cuda_graphs: bool,
    /// KV cache pool of each native replica, MiB (0 = sized from the model and the limits).
    pub kv_cache_mb: i64,
    /// Tokens per KV cache block of each native replica.
    pub kv_block_tokens: i64,
    /// Share full KV blocks between sequences with equal leading tokens (prefix cache).
    pub prefix_caching: bool,
    /// Under `in_flight` updates, versions an older prefix block may lag the current weights
    /// and still serve a new request (0 = never).
    pub prefix_cache_version_lag: i64,
    /// Base URLs of remote servers (`backend = "remote"`).
    pub remote_urls: Vec<String>,
    /// Per-request timeout of the remote backend, seconds.
    pub request_timeout_s: f64,
    /// Published weight versions the remote backend keeps on disk under `<output_dir>/weights`.
    pub remote_keep_versions: i64,
    /// `[engine.simulated]`: the timing model of `backend = "simulated"`.
    pub simulated: RawSimEngine,
}

/// `[engine.simulated]`: a timing model run in scaled real time, plus the simulated task's shape.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RawSimEngine {
    /// Real seconds per simulated second (0 = as fast as possible).
    pub time_scale: f64,
    /// Prefill cost per prompt token, simulated seconds.
    pub prefill_seconds_per_token: f64,
    /// Decode step cost `a` in `a + b · running_sequences`, simulated seconds.
    pub decode_step_base_seconds: f64,
    /// Decode step cost `b` per running sequence, simulated seconds.
    pub decode_step_per_sequence_seconds: f64,
    /// Prompt length of a simulated task's first turn, tokens.
    pub prompt_tokens: i64,
    /// Tokens the simulated environment appends per reply (multi-turn).
    pub env_reply_tokens: i64,
    /// Completion-length distribution per domain; the key `default` covers the others.
    pub lengths: BTreeMap<String, RawLengthDistribution>,
    /// Seed of the simulated task and lengths (default: `run.seed`).
    pub seed: Option<i64>,
}

impl Default for RawSimEngine {
    fn default() -> Self {
        Self {
            time_scale: 1.0,
            prefill_seconds_per_token: 0.000_02,
            decode_step_base_seconds: 0.01,
            decode_step_per_sequence_seconds: 0.000_2,
            prompt_tokens: 128,
            env_reply_tokens: 32,
            lengths: BTreeMap::new(),
            seed: None,
        }
    }
}

/// One completion-length distribution: `fixed` (tokens), `uniform` (min, max) or `lognormal`
/// (median, sigma). Lengths are clamped to `[1, rollout.max_new_tokens]`.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RawLengthDistribution {
    /// `fixed`, `uniform` or `lognormal`.
    pub distribution: String,
    /// `fixed`: the length.
    pub tokens: i64,
    /// `uniform`: smallest length.
    pub min: i64,
    /// `uniform`: largest length.
    pub max: i64,
    /// `lognormal`: the median length.
    pub median: f64,
    /// `lognormal`: σ of the underlying normal (1.0 puts p99 near 10× the median).
    pub sigma: f64,
}

impl Default for RawLengthDistribution {
    fn default() -> Self {
        Self {
            distribution: "lognormal".into(),
            tokens: 256,
            min: 1,
            max: 512,
            median: 128.0,
            sigma: 1.0,
        }
    }
}

impl Default for RawEngine {
    fn default() -> Self {
        Self {
            backend: "native".into(),
            device: None,
            replicas: 1,
            max_running_sequences: 64,
            max_step_tokens: 4096,
            threads: 0,
            compute_dtype: None,
            stacked_products: None,
            cuda_graphs: false,
            kv_cache_mb: 0,
            kv_block_tokens: 16,
            prefix_caching: true,
            prefix_cache_version_lag: 0,
            remote_urls: Vec::new(),
            request_timeout_s: 120.0,
            remote_keep_versions: 3,
            simulated: RawSimEngine::default(),
        }
    }
}
