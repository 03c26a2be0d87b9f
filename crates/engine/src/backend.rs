//! The contract between the engine actor and an inference backend.
//!
//! A backend owns its compute thread(s). Calls are cheap and non-blocking: they enqueue a command
//! on a bounded channel. Results come back as [`EngineEvent`]s through the [`EventSink`] given at
//! construction. Every submitted request produces exactly one [`EngineEvent::Finished`], whether
//! it stopped, hit its length, was aborted (then the output is the partial completion) or failed.

use std::sync::Arc;
use std::time::Duration;

use serde::Serialize;
use sluice_core::{PolicyVersion, RequestId, WeightSnapshot, WeightUpdateMode};

/// Sampling parameters of one request.
#[derive(Debug, Clone, PartialEq)]
pub struct SamplingParams {
    /// Temperature (0 = greedy).
    pub temperature: f64,
    /// Nucleus mass in (0, 1].
    pub top_p: f64,
    /// Top-k (0 = off).
    pub top_k: u32,
    /// Most tokens the *whole* completion may have (resumed tokens included).
    pub max_tokens: u32,
    /// Per-request seed.
    pub seed: Option<u64>,
    /// Token ids that end the completion.
    pub stop_token_ids: Vec<u32>,
}

/// Generated tokens with their behaviour log-probabilities and the version that produced each.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct TokenOutput {
    /// Token ids.
    pub token_ids: Vec<u32>,
    /// Log-probability of each token under the sampling distribution.
    pub logprobs: Vec<f32>,
    /// Policy version of the weights that produced each token.
    pub versions: Vec<PolicyVersion>,
}

impl TokenOutput {
    /// Number of tokens.
    pub fn len(&self) -> usize {
        self.token_ids.len()
    }

    /// No tokens.
    pub fn is_empty(&self) -> bool {
        self.token_ids.is_empty()
    }

    fn push(&mut self, token: u32, logprob: f32, version: PolicyVersion) {
        self.token_ids.push(token);
        self.logprobs.push(logprob);
        self.versions.push(version);
    }
}

/// One generation request.
#[derive(Debug, Clone)]
pub struct GenerateRequest {
    /// Unique id (a resumed turn gets a new attempt number).
    pub id: RequestId,
    /// Prompt token ids.
    pub prompt_token_ids: Vec<u32>,
    /// A partial completion to continue from: the backend prefills prompt + these tokens and its
    /// reported completion is the whole thing (these tokens first, versions kept).
    pub resume: Option<TokenOutput>,
    /// Sampling parameters.
    pub params: SamplingParams,
    /// Workload hint (the sample's domain): the simulated backend draws lengths from it; real
    /// backends ignore it.
    pub domain: Option<String>,
}

/// Why a request left the engine.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum FinishReason {
    /// End of sequence or a stop token.
    Stop,
    /// `max_tokens` reached.
    Length,
    /// Aborted (by `abort`, `abort_all` or an `abort_resume` weight update): the output is the
    /// partial completion.
    Abort,
    /// The backend failed this request; the payload is a short stable kind.
    Error(String),
}

impl FinishReason {
    /// Short stable label.
    pub fn as_label(&self) -> &'static str {
        match self {
            Self::Stop => "stop",
            Self::Length => "length",
            Self::Abort => "abort",
            Self::Error(_) => "error",
        }
    }
}

/// A request that left the engine.
#[derive(Debug, Clone)]
pub struct Completion {
    /// The request.
    pub id: RequestId,
    /// The whole completion (resumed tokens first).
    pub output: TokenOutput,
    /// Why it ended.
    pub finish: FinishReason,
}

/// What a backend reports.
#[derive(Debug, Clone)]
pub enum EngineEvent {
    /// A request finished (or was aborted with its partial output).
    Finished(Completion),
    /// New weights are in use.
    WeightsUpdated {
        /// The version now in use.
        version: PolicyVersion,
        /// Time from the update request to the first step on the new weights.
        pause: Duration,
        /// The mode the update used.
        mode: WeightUpdateMode,
    },
}

/// Where a backend delivers events; called from the backend's thread, so it must not block.
pub type EventSink = Arc<dyn Fn(EngineEvent) + Send + Sync>;

/// A point-in-time view of a backend.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct EngineStats {
    /// Weights version in use.
    pub version: PolicyVersion,
    /// Sequences in the running batch.
    pub running: u64,
    /// Requests queued, not yet admitted.
    pub waiting: u64,
    /// Tokens decoded since start.
    pub generated_tokens: u64,
    /// Wall seconds spent computing since start.
    pub busy_seconds: f64,
    /// Wall seconds since start.
    pub uptime_seconds: f64,
    /// The paged KV cache (native backend only).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub kv_cache: Option<KvCacheStats>,
}

/// A native replica's KV cache pool, admission and prefix cache, counted since it started.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct KvCacheStats {
    /// Tokens per block.
    pub block_tokens: u64,
    /// Blocks in the pool.
    pub total_blocks: u64,
    /// Blocks in some running sequence's table.
    pub used_blocks: u64,
    /// Unreferenced blocks kept for prefix hits (evicted least recently used first).
    pub cached_blocks: u64,
    /// Prompt tokens (prompt plus resumed completion) of admitted requests.
    pub prompt_tokens: u64,
    /// Of those, tokens whose keys and values came from the prefix cache instead of a prefill.
    pub prefix_hit_tokens: u64,
    /// Running sequences preempted when blocks ran out (returned as aborts with their partials).
    pub preempted_sequences: u64,
}

/// A backend refused a call.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum EngineError {
    /// The backend's thread is gone.
    #[error("engine backend `{backend}` has stopped")]
    Stopped {
        /// Which backend.
        backend: String,
    },
    /// The backend's bounded command queue is full: nothing is wrong with the request, the
    /// backend is busy; the same call can succeed later.
    #[error(
        "engine backend `{backend}` is overloaded: command queue full ({capacity}); retry later"
    )]
    Overloaded {
        /// Which backend.
        backend: String,
        /// The queue's capacity.
        capacity: usize,
    },
    /// A replica could not be built (its factory failed: a model that does not load, a thread
    /// that does not start).
    #[error("engine replica {replica} could not start: {reason}")]
    Start {
        /// The replica.
        replica: u32,
        /// Why.
        reason: String,
    },
    /// A replica slot has no server to run on yet (a head whose engine nodes have not joined,
    /// or are all taken): not a failure of anything; the slot waits for a node.
    #[error("engine replica {replica} has no server: {reason}")]
    NoServer {
        /// The replica.
        replica: u32,
        /// Why (which servers exist and are taken).
        reason: String,
    },
    /// The request is malformed.
    #[error("request {id}: {reason}")]
    BadRequest {
        /// The request.
        id: String,
        /// Why.
        reason: String,
    },
}

impl EngineError {
    /// Short stable name, used as a metric label.
    pub fn kind(&self) -> &'static str {
        match self {
            Self::Stopped { .. } => "engine_stopped",
            Self::Overloaded { .. } => "engine_overloaded",
            Self::Start { .. } => "engine_start",
            Self::NoServer { .. } => "engine_no_server",
            Self::BadRequest { .. } => "engine_bad_request",
        }
    }
}

/// An inference backend. All calls enqueue and return at once; outcomes arrive as events.
pub trait InferenceBackend: Send {
    /// Queues a request.
    fn submit(&self, request: GenerateRequest) -> Result<(), EngineError>;
    /// Aborts one request; its partial output arrives as a `Finished` event with
    /// [`FinishReason::Abort`] (nothing happens if it already finished).
    fn abort(&self, id: RequestId) -> Result<(), EngineError>;
    /// Aborts every queued and running request, each reported with its partial output.
    fn abort_all(&self) -> Result<(), EngineError>;
    /// Installs new weights per `mode` (§4.2): `abort_resume` aborts everything then swaps,
    /// `in_flight` swaps between two steps and continues, `drain` stops admitting, lets running
    /// requests finish, then swaps.
    fn update_weights(
        &self,
        weights: WeightSnapshot,
        mode: WeightUpdateMode,
    ) -> Result<(), EngineError>;
    /// Current statistics (lock-free read).
    fn stats(&self) -> EngineStats;
    /// Stops the compute thread and joins it. Requests still queued are dropped.
    fn shutdown(&mut self);
    /// Whether the backend can still make progress: false once its compute thread ended on its
    /// own (a panic). The engine actor checks it periodically and restarts a dead replica at
    /// once instead of waiting for its watchdog. No default: a wrapper must forward it (see
    /// [`forward_backend!`](crate::forward_backend)) or say why it answers otherwise.
    fn is_alive(&self) -> bool;
    /// Why the server this replica runs on is gone, when it is: a head's replica on a joined
    /// engine node that the head cannot reach, or that left, was lost or joined again. Its
    /// failure is then the server's, not the replica's: the engine actor hands its requests
    /// back and moves the slot to another server, counting nothing towards
    /// `supervision.engine_max_restarts`. `None`: a failure is the replica's own (an in-process
    /// backend). No default, for the same reason as `is_alive`.
    fn server_gone(&self) -> Option<String>;
}

/// Why a command did not get onto a backend's bounded command queue.
pub(crate) enum QueueRefusal {
    /// The queue is at capacity: the caller must bound its requests.
    Full,
    /// The backend's thread is gone.
    Closed,
}

impl<T> From<crossbeam_channel::TrySendError<T>> for QueueRefusal {
    fn from(e: crossbeam_channel::TrySendError<T>) -> Self {
        match e {
            crossbeam_channel::TrySendError::Full(_) => Self::Full,
            crossbeam_channel::TrySendError::Disconnected(_) => Self::Closed,
        }
    }
}

impl<T> From<tokio::sync::mpsc::error::TrySendError<T>> for QueueRefusal {
    fn from(e: tokio::sync::mpsc::error::TrySendError<T>) -> Self {
        match e {
            tokio::sync::mpsc::error::TrySendError::Full(_) => Self::Full,
            tokio::sync::mpsc::error::TrySendError::Closed(_) => Self::Closed,
        }
    }
}

/// The outcome of `try_send` on backend `backend`'s command queue of `capacity`, as the trait
/// reports it: a full queue is [`EngineError::Overloaded`] (back-pressure: the caller bounds its
/// requests, an HTTP client retries later), a closed one means the backend stopped.
pub(crate) fn enqueued<E: Into<QueueRefusal>>(
    sent: Result<(), E>,
    backend: &str,
    capacity: usize,
) -> Result<(), EngineError> {
    sent.map_err(|e| match e.into() {
        QueueRefusal::Full => EngineError::Overloaded {
            backend: backend.to_owned(),
            capacity,
        },
        QueueRefusal::Closed => EngineError::Stopped {
            backend: backend.to_owned(),
        },
    })
}

/// The model weights inside a weight-update envelope; a snapshot without them (a simulated
/// trainer's) is refused, naming `backend`.
pub(crate) fn model_weights(
    weights: &WeightSnapshot,
    backend: &str,
) -> Result<Arc<sluice_model::ModelWeights>, EngineError> {
    sluice_model::ModelWeights::from_envelope(weights).ok_or_else(|| EngineError::BadRequest {
        id: backend.to_owned(),
        reason: format!(
            "weight snapshot {} carries no model weights (a simulated trainer's?)",
            weights.version
        ),
    })
}

pub(crate) fn push_token(out: &mut TokenOutput, token: u32, logprob: f32, version: PolicyVersion) {
    out.push(token, logprob, version);
}
