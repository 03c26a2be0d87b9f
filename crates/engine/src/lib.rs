//! Inference backends: the [`InferenceBackend`] trait the engine actor drives, and the simulated
//! backends used by tests, benchmarks and capacity planning.
//!
//! | module | what it holds |
//! |---|---|
//! | [`backend`] | the trait, requests, outputs, events and stats every backend speaks |
//! | [`config`] | the `[engine]` config section: raw → [`validate_engine`](config::validate_engine) → [`EngineConfig`](config::EngineConfig) |
//! | [`forward`] | [`forward_backend!`]: the one way a wrapper passes backend calls through (no call has a default) |
//! | [`native`] | [`NativeEngine`]: the candle model behind a continuous-batching scheduler |
//! | [`remote`] | [`remote::RemoteEngine`]: the trait over OpenAI-compatible servers with RL extensions |
//! | `sched` | the scheduler core the native and simulated backends share: queues, aborts, pause, weight-update modes |
//! | [`server`] | the OpenAI-compatible HTTP server on the native engine (`sluice serve`) |
//! | [`simulated`] | [`SimEngine`] (timing model on its own thread); the simulated trainer and task live in the trainer and env crates |
//!
//! The native candle engine and the remote HTTP backend implement the same trait, so the actors
//! never change when a backend is added.

pub mod backend;
pub mod config;
pub mod forward;
pub mod native;
pub mod remote;
mod sched;
pub mod server;
pub mod simulated;

pub use backend::{
    Completion, EngineError, EngineEvent, EngineStats, EventSink, FinishReason, GenerateRequest,
    InferenceBackend, KvCacheStats, SamplingParams, TokenOutput,
};
pub use native::{NativeControl, NativeEngine, NativeEngineParams, NativeRequest, StepBreakdown};
pub use simulated::SimEngine;
