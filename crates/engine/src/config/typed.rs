//! `[engine]` and `[engine.simulated]`, validated.

use std::num::NonZeroU32;
use std::time::Duration;

use serde::{Deserialize, Serialize, Serializer};

use sluice_core::config::{DType, Device, LengthDistribution};

sluice_core::impl_choice!(EngineBackend);

fn as_seconds<S: Serializer>(d: &Duration, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_f64(d.as_secs_f64())
}

/// Which inference backend drives rollouts.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum EngineBackend {
    /// Sluice's own candle engine.
    Native,
    /// OpenAI-compatible servers over HTTP.
    Remote,
    /// A timing model, for tests, benchmarks and capacity planning.
    Simulated,
}

/// `[engine]`
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct EngineConfig {
    /// Backend.
    pub backend: EngineBackend,
    /// Device of the native replicas (`model.device` unless set).
    pub device: Device,
    /// Replicas on this node.
    pub replicas: NonZeroU32,
    /// Cap on sequences decoded together per replica.
    pub max_running_sequences: NonZeroU32,
    /// Token budget of one scheduler step.
    pub max_step_tokens: NonZeroU32,
    /// Compute threads per native replica; 0 = automatic (half the cores).
    pub threads: u32,
    /// The native replicas' matrix products (`None`: the weights' dtype, `model.dtype`). bf16
    /// on the CPU rounds the products' operands to bf16 on Intel AMX tiles, sums in f32.
    pub compute_dtype: Option<DType>,
    /// Whether native replicas take one product for q/k/v and one for gate/up per layer with
    /// those weights stacked (a copy of most of each layer), or one per projection; `None`:
    /// stacked on a GPU, where each product is a kernel launch, not on the CPU, where it
    /// measured no faster.
    pub stacked_products: Option<bool>,
    /// Whether native replicas on a GPU capture their decode-only steps as CUDA graphs, one
    /// per padded batch size, and replay them (one launch a step where the eager step issues
    /// about eight per layer); refused on the CPU.
    pub cuda_graphs: bool,
    /// KV cache pool of each native replica, MiB; 0 = automatic (every running sequence at
    /// full context, capped; see docs/engine.md).
    pub kv_cache_mb: u32,
    /// Tokens per KV cache block of each native replica (the unit of allocation, admission,
    /// preemption and prefix sharing).
    pub kv_block_tokens: NonZeroU32,
    /// Whether native replicas share full KV blocks of equal leading tokens computed by the
    /// current weights (a group's prompt, a resumed rollout's prompt and partial).
    pub prefix_caching: bool,
    /// Under `in_flight` updates, how many versions behind the current weights a cached prefix
    /// block may be and still serve a new request (0: never; other modes: never).
    pub prefix_cache_version_lag: u32,
    /// Remote server base URLs.
    pub remote_urls: Vec<String>,
    /// Remote request timeout.
    #[serde(rename = "request_timeout_s", serialize_with = "as_seconds")]
    pub request_timeout: Duration,
    /// Published weight versions the remote backend keeps on disk (≥ 1).
    pub remote_keep_versions: NonZeroU32,
    /// `[engine.simulated]`
    pub simulated: SimEngineConfig,
}

/// `[engine.simulated]`
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct SimEngineConfig {
    /// Real seconds per simulated second (0 = as fast as possible).
    pub time_scale: f64,
    /// Prefill cost per prompt token, simulated seconds.
    pub prefill_seconds_per_token: f64,
    /// Decode step cost `a`.
    pub decode_step_base_seconds: f64,
    /// Decode step cost `b` per running sequence.
    pub decode_step_per_sequence_seconds: f64,
    /// First-turn prompt length, tokens.
    pub prompt_tokens: NonZeroU32,
    /// Tokens per environment reply.
    pub env_reply_tokens: u32,
    /// Length distribution per domain (`default` for the rest; always present).
    pub lengths: std::collections::BTreeMap<String, LengthDistribution>,
    /// Seed of lengths and rewards.
    pub seed: u64,
}
