//! The native backend: Sluice's candle model behind a continuous-batching scheduler on its own
//! thread.
//!
//! [`NativeEngine`] is the handle: every call enqueues a command on a bounded crossbeam channel
//! and returns. The compute thread (`worker`) applies commands between two steps (so weight
//! swaps, aborts and pauses take effect at a step boundary), admits waiting requests up to
//! `max_running_sequences`, and runs one model step over every running sequence: waiting prompt
//! tokens (chunked to the `max_step_tokens` budget) and one decode token per generating
//! sequence, in a single ragged batch. The behaviour log-probability definition is in
//! `sampler`; stop conditions in `stop`; the native request and its observer's updates in
//! `request`.
//!
//! Beyond the [`InferenceBackend`] trait, [`NativeEngine::submit_native`] takes a
//! [`NativeRequest`] with what the OpenAI server needs: stop strings, alternatives per token,
//! prompt log-probabilities, and an observer that sees each token as it is produced.

mod kv;
mod request;
pub mod sampler;
mod stop;
mod worker;

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::thread::JoinHandle;
use std::time::Instant;

use sluice_core::{PolicyVersion, RequestId, WeightSnapshot, WeightUpdateMode};
use sluice_model::{ModelConfig, ModelWeights, Tokenizer};

use crate::backend::{
    EngineError, EngineStats, EventSink, GenerateRequest, InferenceBackend, KvCacheStats,
    model_weights,
};
use crate::sched::Commands;
pub use kv::{AUTO_KV_CACHE_CAP_MB, KvBudget};
pub use request::{NativeRequest, PromptLogprob, RequestObserver, RequestUpdate, TokenStep};
pub use stop::{StopHit, truncate_at_stop};

/// Commands queued per engine; a full queue is back-pressure, reported by `submit`.
const COMMAND_QUEUE: usize = 4096;

/// How the engine is sized and seeded.
#[derive(Debug, Clone)]
pub struct NativeEngineParams {
    /// Replica index (names the thread).
    pub replica: u32,
    /// Cap on sequences in the running batch (`engine.max_running_sequences`).
    pub max_running_sequences: usize,
    /// Token budget of one step, prompt chunks plus decode tokens (`engine.max_step_tokens`).
    /// Decode tokens of running sequences are never starved: the budget limits prefill.
    pub max_step_tokens: usize,
    /// Seed of requests that carry none (mixed with the request id).
    pub seed: u64,
    /// End-of-sequence ids (the tokenizer's, else the model config's); every request stops on
    /// them unless it asks to ignore them.
    pub eos_token_ids: Vec<u32>,
    /// Compute threads of this replica's matrix products (`engine.threads`; 0 = half the
    /// cores, so a trainer in the same process keeps the other half).
    pub threads: usize,
    /// The replica's KV cache pool, bytes (`engine.kv_cache_mb` MiB; 0 = sized from the model:
    /// see [`KvBudget::new`]).
    pub kv_cache_bytes: u64,
    /// Tokens per KV cache block.
    pub kv_block_tokens: usize,
    /// The replica's matrix products (`engine.compute_dtype`; `None`: the weights' dtype).
    pub compute_dtype: Option<sluice_core::config::DType>,
    /// Stacked q/k/v and gate/up products (`engine.stacked_products`; `None`: the device's
    /// default, [`sluice_model::InferenceModel::set_stacked_products`]).
    pub stacked_products: Option<bool>,
    /// Decode-only steps captured and replayed as CUDA graphs (`engine.cuda_graphs`; a GPU
    /// only, [`sluice_model::InferenceModel::set_decode_graphs`]).
    pub cuda_graphs: bool,
    /// Reuse registered full blocks for new requests with the same prefix at the same weight
    /// version (off: every request prefills its whole input; `sluice bench engine` compares).
    pub prefix_caching: bool,
    /// Under `in_flight` updates, new requests may also start on blocks computed by weights up
    /// to this many versions older (`engine.prefix_cache_version_lag`; 0: never). Other update
    /// modes never reuse an older version's blocks.
    pub prefix_cache_version_lag: u64,
    /// Where the replica's weights and KV cache live (`engine.device`; `eval.device` for the
    /// evaluator's engine). Weights handed over from elsewhere are copied here; weights already
    /// here are shared.
    pub device: sluice_core::config::Device,
    /// A sequence preempted for KV blocks after it generated tokens goes back to the front of
    /// the queue and is computed again from its prompt and output (vLLM's recompute), unseen by
    /// the caller: what `sluice serve` does, whose clients have no way to resume a partial.
    /// Off (the pipeline's engines), it finishes as `Abort` with its partial, which the
    /// controller resumes (DESIGN §7), possibly on another replica.
    pub recompute_preempted: bool,
}

impl Default for NativeEngineParams {
    fn default() -> Self {
        Self {
            replica: 0,
            max_running_sequences: 64,
            max_step_tokens: 4096,
            seed: 0,
            eos_token_ids: Vec::new(),
            threads: 0,
            kv_cache_bytes: 0,
            kv_block_tokens: sluice_model::paged::DEFAULT_BLOCK_TOKENS,
            compute_dtype: None,
            stacked_products: None,
            cuda_graphs: false,
            prefix_caching: true,
            prefix_cache_version_lag: 0,
            device: sluice_core::config::Device::Cpu,
            recompute_preempted: false,
        }
    }
}

impl NativeEngineParams {
    /// Replica `replica` of `[engine]` (`max_running_sequences`, `max_step_tokens`, `threads`,
    /// `kv_cache_mb`), seeded
    /// with `seed` (the same on every replica: a request's draws depend on its id, not on where
    /// it runs), stopping on `eos_token_ids`.
    pub fn from_config(
        engine: &crate::config::EngineConfig,
        replica: u32,
        seed: u64,
        eos_token_ids: Vec<u32>,
    ) -> Self {
        Self {
            replica,
            max_running_sequences: engine.max_running_sequences.get() as usize,
            max_step_tokens: engine.max_step_tokens.get() as usize,
            seed,
            eos_token_ids,
            threads: engine.threads as usize,
            kv_cache_bytes: u64::from(engine.kv_cache_mb) * 1024 * 1024,
            kv_block_tokens: engine.kv_block_tokens.get() as usize,
            compute_dtype: engine.compute_dtype,
            stacked_products: engine.stacked_products,
            cuda_graphs: engine.cuda_graphs,
            prefix_caching: engine.prefix_caching,
            prefix_cache_version_lag: u64::from(engine.prefix_cache_version_lag),
            device: engine.device,
            recompute_preempted: false,
        }
    }
}

/// The native engine could not start.
#[derive(Debug, thiserror::Error)]
pub enum NativeError {
    /// The model refused the weights.
    #[error("native engine: {0}")]
    Model(#[from] sluice_model::ModelError),
    /// A parameter is out of range.
    #[error("native engine: {0}")]
    Params(String),
}

impl NativeError {
    /// Short stable name.
    pub fn kind(&self) -> &'static str {
        match self {
            Self::Model(e) => e.kind(),
            Self::Params(_) => "engine_params",
        }
    }
}

/// What the handle queues for the compute thread.
pub(crate) type Command = crate::sched::Command<Box<NativeRequest>, Arc<ModelWeights>>;

/// Counters the compute thread publishes for lock-free reads.
#[derive(Default)]
pub(crate) struct Shared {
    pub stopped: std::sync::atomic::AtomicBool,
    pub version: AtomicU64,
    pub running: AtomicU64,
    pub waiting: AtomicU64,
    pub generated_tokens: AtomicU64,
    pub busy_nanos: AtomicU64,
    /// Of `busy_nanos`: inside the model's forward (and the logits' copy to the host).
    pub model_nanos: AtomicU64,
    /// Of `model_nanos`: until the forward had been issued (see [`StepBreakdown::issue_seconds`]).
    pub issue_nanos: AtomicU64,
    /// Scheduler steps taken.
    pub steps: AtomicU64,
    /// Of `busy_nanos`: steps in which every running sequence decoded one token (no prefill).
    pub decode_nanos: AtomicU64,
    /// Tokens those steps generated.
    pub decode_tokens: AtomicU64,
    /// KV blocks in running sequences' tables.
    pub kv_used_blocks: AtomicU64,
    /// Unreferenced KV blocks kept for prefix hits.
    pub kv_cached_blocks: AtomicU64,
    /// Prompt tokens (prompt plus resumed completion) of admitted requests.
    pub prompt_tokens: AtomicU64,
    /// Of those, tokens taken from the prefix cache.
    pub prefix_hit_tokens: AtomicU64,
    /// Sequences preempted for lack of blocks.
    pub preempted: AtomicU64,
    /// Model calls that replayed a captured CUDA graph (`engine.cuda_graphs`).
    pub graph_replays: AtomicU64,
}

/// Where a native engine's compute time went since it started (`sluice bench engine`).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct StepBreakdown {
    /// Scheduler steps taken.
    pub steps: u64,
    /// Seconds in the model's forward, logits to the host included.
    pub model_seconds: f64,
    /// Of `model_seconds`: until the forward's call returned, before its logits or draws were
    /// read. On the CPU that is the whole forward; on a GPU, where kernels run behind the
    /// host, it is the host's time to issue them, and the rest is waiting for the device. A
    /// share near 1 on a GPU says the step is bound by launches, not by the device.
    pub issue_seconds: f64,
    /// Seconds in the rest of the steps: picking inputs, sampling, per-token bookkeeping,
    /// finishing requests.
    pub scheduler_seconds: f64,
    /// Seconds of steps with no prefill in them, every running sequence decoding one token
    /// (model and scheduler both).
    pub decode_seconds: f64,
    /// Tokens generated in those steps: over `decode_seconds`, the decode rate that
    /// `sluice bench model`'s decode bound is about (prefill left out).
    pub decode_tokens: u64,
    /// Of `steps`' model calls: those that replayed a captured CUDA graph
    /// (`engine.cuda_graphs`; always 0 without).
    pub graph_replays: u64,
}

impl StepBreakdown {
    /// What went into the steps after `earlier` (a breakdown taken before, of the same engine).
    pub fn since(&self, earlier: &Self) -> Self {
        Self {
            steps: self.steps - earlier.steps,
            model_seconds: self.model_seconds - earlier.model_seconds,
            issue_seconds: self.issue_seconds - earlier.issue_seconds,
            scheduler_seconds: self.scheduler_seconds - earlier.scheduler_seconds,
            decode_seconds: self.decode_seconds - earlier.decode_seconds,
            decode_tokens: self.decode_tokens - earlier.decode_tokens,
            graph_replays: self.graph_replays - earlier.graph_replays,
        }
    }
}

/// A cheap, cloneable handle for queueing commands (the server's request handlers and request
/// observers hold one). It does not own the thread: [`NativeEngine`] does.
#[derive(Clone)]
pub struct NativeControl {
    commands: Commands<Box<NativeRequest>, Arc<ModelWeights>>,
    shared: Arc<Shared>,
    started: Instant,
    config: Arc<ModelConfig>,
    tokenizer: Option<Arc<Tokenizer>>,
    kv: KvBudget,
}

/// See the module docs.
pub struct NativeEngine {
    control: NativeControl,
    thread: Option<JoinHandle<()>>,
}
impl NativeEngine {
    /// Starts the compute thread on `weights`; events go to `sink`. The tokenizer is needed only
    /// for stop strings.
    pub fn start(
        params: NativeEngineParams,
        weights: Arc<ModelWeights>,
        tokenizer: Option<Arc<Tokenizer>>,
        sink: EventSink,
    ) -> Result<Self, NativeError> {
        if params.max_running_sequences == 0 || params.max_step_tokens == 0 {
            return Err(NativeError::Params(
                "max_running_sequences and max_step_tokens must be at least 1".into(),
            ));
        }
        let weights = weights.on_device(&sluice_model::device(params.device)?)?;
        let mut model = sluice_model::InferenceModel::new(Arc::clone(&weights))?;
        if let Some(dtype) = params.compute_dtype {
            model.set_compute_dtype(sluice_model::config::candle_dtype(dtype))?;
        }
        if let Some(on) = params.stacked_products {
            model
                .set_stacked_products(on)
                .map_err(|e| NativeError::Params(format!("engine.stacked_products: {e}")))?;
        }
        if params.cuda_graphs {
            if !weights.device().is_cuda() {
                return Err(NativeError::Params(format!(
                    "engine.cuda_graphs: CUDA graphs need a CUDA device, this replica runs on {}",
                    params.device
                )));
            }
            model.set_decode_graphs(true);
        }
        // The model was built on this thread; the replica's thread runs it.
        sluice_model::device::settle(weights.device())?;
        let config = Arc::clone(model.config());
        let kv = KvBudget::new(&params, &config, weights.dtype())?;
        let name = format!("native-engine-{}", params.replica);
        let (commands, rx) = Commands::channel(&name, COMMAND_QUEUE);
        let shared = Arc::new(Shared::default());
        shared.version.store(weights.version.0, Ordering::Relaxed);
        let threads = sluice_model::threads::role_threads(params.threads as u32, 2);
        let pool =
            sluice_model::ComputePool::new(&format!("engine-{}-compute", params.replica), threads)?;
        let worker = worker::Worker::new(
            params,
            model,
            kv,
            tokenizer.clone(),
            rx,
            sink,
            Arc::clone(&shared),
        )?;
        let thread = std::thread::Builder::new()
            .name(name.clone())
            .spawn({
                let shared = Arc::clone(&shared);
                // Every event of this replica's thread (steps, swaps, failures) is logged inside
                // its span, so a slow step can be told apart by replica.
                let span =
                    tracing::info_span!("engine_replica", backend = "native", thread = %name);
                move || {
                    let _span = span.entered();
                    // Marks the engine stopped however the thread ends (a panic included).
                    struct Stopped(Arc<Shared>);
                    impl Drop for Stopped {
                        fn drop(&mut self) {
                            self.0.stopped.store(true, Ordering::Relaxed);
                        }
                    }
                    let _stopped = Stopped(shared);
                    // The scheduler loop itself runs on the pool, so every model step's matrix
                    // products split over this replica's threads and no others.
                    pool.install(|| worker.run());
                }
            })
            .map_err(|e| NativeError::Params(format!("spawning the engine thread: {e}")))?;
        Ok(Self {
            control: NativeControl {
                commands,
                shared,
                started: Instant::now(),
                config,
                tokenizer,
                kv,
            },
            thread: Some(thread),
        })
    }

    /// A cloneable handle for queueing commands.
    pub fn control(&self) -> NativeControl {
        self.control.clone()
    }

    /// See [`NativeControl::submit_native`].
    pub fn submit_native(&self, request: NativeRequest) -> Result<(), EngineError> {
        self.control.submit_native(request)
    }

    /// The model's architecture (vocabulary, context length).
    pub fn model_config(&self) -> &Arc<ModelConfig> {
        &self.control.config
    }
}

impl NativeControl {
    /// The model's architecture (vocabulary, context length).
    pub fn model_config(&self) -> &Arc<ModelConfig> {
        &self.config
    }

    /// The replica's KV cache pool.
    pub fn kv_budget(&self) -> KvBudget {
        self.kv
    }

    /// The tokenizer given at start.
    pub fn tokenizer(&self) -> Option<&Arc<Tokenizer>> {
        self.tokenizer.as_ref()
    }

    /// Queues a request with native options. Refuses empty prompts, out-of-vocabulary ids and
    /// stop strings without a tokenizer; a prompt too long for the context finishes with
    /// `Error("prompt_too_long")`.
    pub fn submit_native(&self, request: NativeRequest) -> Result<(), EngineError> {
        let r = &request.request;
        let bad = |reason: String| EngineError::BadRequest {
            id: r.id.to_string(),
            reason,
        };
        if r.prompt_token_ids.is_empty() {
            return Err(bad("the prompt is empty".into()));
        }
        let vocab = self.config.vocab_size;
        let resumed = r.resume.iter().flat_map(|o| o.token_ids.iter());
        if let Some(t) = r
            .prompt_token_ids
            .iter()
            .chain(resumed)
            .find(|&&t| t as usize >= vocab)
        {
            return Err(bad(format!(
                "token id {t} is outside the vocabulary ({vocab})"
            )));
        }
        let tokens = r.prompt_token_ids.len() + r.resume.as_ref().map_or(0, |o| o.token_ids.len());
        if let Some(reason) = self.kv.refuse(tokens + 1) {
            return Err(bad(reason));
        }
        if !request.stop.is_empty() && self.tokenizer.is_none() {
            return Err(bad(
                "stop strings need a tokenizer; the engine has none".into()
            ));
        }
        if !(r.params.temperature >= 0.0 && r.params.top_p > 0.0 && r.params.top_p <= 1.0) {
            return Err(bad("temperature must be >= 0 and top_p in (0, 1]".into()));
        }
        self.commands.submit(Box::new(request))
    }

    /// Stops stepping: with `abort`, every request is aborted (partials returned); without, they
    /// wait in place until [`Self::continue_generation`].
    pub fn pause(&self, abort: bool) -> Result<(), EngineError> {
        self.commands.pause(abort)
    }

    /// Resumes stepping after [`Self::pause`].
    pub fn continue_generation(&self) -> Result<(), EngineError> {
        self.commands.continue_generation()
    }

    /// Whether the compute thread is still running.
    pub fn is_alive(&self) -> bool {
        !self.shared.stopped.load(Ordering::Relaxed)
    }

    /// Current statistics (lock-free read).
    pub fn stats(&self) -> EngineStats {
        let s = &self.shared;
        EngineStats {
            version: PolicyVersion(s.version.load(Ordering::Relaxed)),
            running: s.running.load(Ordering::Relaxed),
            waiting: s.waiting.load(Ordering::Relaxed),
            generated_tokens: s.generated_tokens.load(Ordering::Relaxed),
            busy_seconds: s.busy_nanos.load(Ordering::Relaxed) as f64 * 1e-9,
            uptime_seconds: self.started.elapsed().as_secs_f64(),
            kv_cache: Some(KvCacheStats {
                block_tokens: self.kv.block_tokens as u64,
                total_blocks: self.kv.blocks as u64,
                used_blocks: s.kv_used_blocks.load(Ordering::Relaxed),
                cached_blocks: s.kv_cached_blocks.load(Ordering::Relaxed),
                prompt_tokens: s.prompt_tokens.load(Ordering::Relaxed),
                prefix_hit_tokens: s.prefix_hit_tokens.load(Ordering::Relaxed),
                preempted_sequences: s.preempted.load(Ordering::Relaxed),
            }),
        }
    }

    /// Aborts one request (its partial output is reported at the next step boundary).
    pub fn abort(&self, id: RequestId) -> Result<(), EngineError> {
        self.commands.abort(id)
    }

    /// Where the compute time went so far.
    pub fn breakdown(&self) -> StepBreakdown {
        let s = &self.shared;
        let busy = s.busy_nanos.load(Ordering::Relaxed) as f64 * 1e-9;
        let model = s.model_nanos.load(Ordering::Relaxed) as f64 * 1e-9;
        StepBreakdown {
            steps: s.steps.load(Ordering::Relaxed),
            model_seconds: model,
            issue_seconds: s.issue_nanos.load(Ordering::Relaxed) as f64 * 1e-9,
            scheduler_seconds: (busy - model).max(0.0),
            decode_seconds: s.decode_nanos.load(Ordering::Relaxed) as f64 * 1e-9,
            decode_tokens: s.decode_tokens.load(Ordering::Relaxed),
            graph_replays: s.graph_replays.load(Ordering::Relaxed),
        }
    }

    /// Aborts every queued and running request.
    pub fn abort_all(&self) -> Result<(), EngineError> {
        self.commands.abort_all()
    }

    /// Installs new weights per `mode`; see [`InferenceBackend::update_weights`].
    pub fn update_weights(
        &self,
        weights: WeightSnapshot,
        mode: WeightUpdateMode,
    ) -> Result<(), EngineError> {
        let name = self.commands.name();
        let model = model_weights(&weights, name)?;
        if **model.config() != *self.config {
            return Err(EngineError::BadRequest {
                id: name.to_owned(),
                reason: format!(
                    "weight snapshot {} has another architecture",
                    weights.version
                ),
            });
        }
        self.commands.update(model, mode)
    }
}

impl InferenceBackend for NativeEngine {
    fn submit(&self, request: GenerateRequest) -> Result<(), EngineError> {
        self.control.submit_native(NativeRequest::plain(request))
    }

    fn abort(&self, id: RequestId) -> Result<(), EngineError> {
        self.control.abort(id)
    }

    fn abort_all(&self) -> Result<(), EngineError> {
        self.control.abort_all()
    }

    fn update_weights(
        &self,
        weights: WeightSnapshot,
        mode: WeightUpdateMode,
    ) -> Result<(), EngineError> {
        self.control.update_weights(weights, mode)
    }

    fn stats(&self) -> EngineStats {
        self.control.stats()
    }

    fn is_alive(&self) -> bool {
        self.control.is_alive()
    }

    fn server_gone(&self) -> Option<String> {
        // In-process: a failure is always the replica's own.
        None
    }

    fn shutdown(&mut self) {
        if let Some(t) = self.thread.take() {
            // Clones of the control may keep the channel open, so the command must get in: wait
            // for room rather than rely on a disconnect.
            self.control
                .commands
                .shutdown(std::time::Duration::from_secs(10));
            let _ = t.join();
        }
    }
}

impl Drop for NativeEngine {
    fn drop(&mut self) {
        self.shutdown();
    }
}
