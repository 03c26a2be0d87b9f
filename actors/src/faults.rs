//! Fault injection (`[faults]`, every period 0 = off, the default): decorators around the traits
//! the actors drive, so a drill works the same for every backend.
//!
//! | decorator | wraps | fault |
//! |---|---|---|
//! | [`FaultyBackend`] | [`InferenceBackend`] (one per replica incarnation) | crash or hang at every N-th request |
//! | [`FaultyTrainer`] | [`TrainerBackend`] | the N-th training step fails or panics; every N-th step is skipped |
//! | [`crate::env_faults::FaultyEnv`] | the node's env | a step panics or hangs, a reward panics |
//!
//! A crashed replica behaves like a backend whose compute thread died and whose death was noticed
//! (a remote server's connection dropped): it goes silent, refuses every later call, and the
//! engine actor is told at once. A hung replica goes silent but keeps accepting calls, so only the
//! watchdog can notice it. Every injected fault counts `sluice_node_injected_failures_total` and logs its name.

use std::path::Path;
use std::sync::Arc;
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicU8, AtomicU64, Ordering};

use sluice_config::FaultsConfig;
use sluice_core::metrics as m;
use sluice_core::{
    BackendError, PolicyVersion, RequestId, RolloutGroup, TrainStepOutput, TrainerBackend,
    WeightSnapshot, WeightUpdateMode,
};
use sluice_engine::{EngineError, EngineStats, EventSink, GenerateRequest, InferenceBackend};

pub(crate) fn injected(fault: &'static str) {
    tracing::warn!(fault, "injecting a fault ([faults] config)");
    metrics::counter!(m::NODE_INJECTED_FAILURES).increment(1);
}

/// The engine part of `[faults]`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct EngineFaults {
    /// Crash at every N-th request a replica incarnation receives (0 = never).
    pub crash_every_requests: u64,
    /// Hang at every N-th request (0 = never).
    pub hang_every_requests: u64,
}

impl EngineFaults {
    /// From the config.
    pub fn from_config(faults: &FaultsConfig) -> Self {
        Self {
            crash_every_requests: faults.engine_crash_every_requests,
            hang_every_requests: faults.engine_hang_every_requests,
        }
    }

    /// Some fault is on.
    pub fn any(&self) -> bool {
        self.crash_every_requests > 0 || self.hang_every_requests > 0
    }
}

const HEALTHY: u8 = 0;
const CRASHED: u8 = 1;
const HUNG: u8 = 2;

/// An inference backend that crashes or hangs on schedule; see the module docs.
pub struct FaultyBackend {
    inner: Box<dyn InferenceBackend>,
    faults: EngineFaults,
    /// Open while healthy: the inner backend's events pass.
    gate: Arc<AtomicBool>,
    submitted: AtomicU64,
    state: AtomicU8,
    /// Statistics at the moment of the fault (a dead replica makes no progress).
    frozen: Mutex<Option<EngineStats>>,
    on_crash: Box<dyn Fn() + Send + Sync>,
}

impl FaultyBackend {
    /// Builds the inner backend with `build`, handing it a sink that forwards to `sink` until the
    /// fault; `on_crash` is called when a crash is injected. A failed build is returned as is.
    pub fn new<E>(
        build: impl FnOnce(EventSink) -> Result<Box<dyn InferenceBackend>, E>,
        sink: EventSink,
        faults: EngineFaults,
        on_crash: Box<dyn Fn() + Send + Sync>,
    ) -> Result<Self, E> {
        let gate = Arc::new(AtomicBool::new(true));
        let open = Arc::clone(&gate);
        let gated: EventSink = Arc::new(move |e| {
            if open.load(Ordering::SeqCst) {
                sink(e)
            }
        });
        Ok(Self {
            inner: build(gated)?,
            faults,
            gate,
            submitted: AtomicU64::new(0),
            state: AtomicU8::new(HEALTHY),
            frozen: Mutex::new(None),
            on_crash,
        })
    }

    fn fail(&self, state: u8, fault: &'static str) {
        self.gate.store(false, Ordering::SeqCst);
        if let Ok(mut f) = self.frozen.lock() {
            *f = Some(self.inner.stats());
        }
        self.state.store(state, Ordering::SeqCst);
        injected(fault);
    }

    /// `Some(result)` when the fault decides the call's outcome.
    fn dead(&self) -> Option<Result<(), EngineError>> {
        match self.state.load(Ordering::SeqCst) {
            CRASHED => Some(Err(EngineError::Stopped {
                backend: "replica crashed by [faults] engine_crash_every_requests".into(),
            })),
            HUNG => Some(Ok(())),
            _ => None,
        }
    }
}

impl InferenceBackend for FaultyBackend {
    fn submit(&self, request: GenerateRequest) -> Result<(), EngineError> {
        if let Some(r) = self.dead() {
            return r;
        }
        let n = self.submitted.fetch_add(1, Ordering::SeqCst) + 1;
        self.inner.submit(request)?;
        let hits = |every: u64| every > 0 && n.is_multiple_of(every);
        if hits(self.faults.crash_every_requests) {
            self.fail(CRASHED, "engine_crash");
            (self.on_crash)();
        } else if hits(self.faults.hang_every_requests) {
            self.fail(HUNG, "engine_hang");
        }
        Ok(())
    }

    fn abort(&self, id: RequestId) -> Result<(), EngineError> {
        self.dead().unwrap_or_else(|| self.inner.abort(id))
    }

    fn abort_all(&self) -> Result<(), EngineError> {
        self.dead().unwrap_or_else(|| self.inner.abort_all())
    }

    fn update_weights(
        &self,
        weights: WeightSnapshot,
        mode: WeightUpdateMode,
    ) -> Result<(), EngineError> {
        self.dead()
            .unwrap_or_else(|| self.inner.update_weights(weights, mode))
    }

    fn stats(&self) -> EngineStats {
        match self.frozen.lock().ok().and_then(|f| f.clone()) {
            Some(s) => s,
            None => self.inner.stats(),
        }
    }

    // A hung replica looks alive (only the watchdog can tell); a crash is reported at once, as
    // the inner backend's own death is.
    sluice_engine::forward_backend!(inner => is_alive, server_gone);

    fn shutdown(&mut self) {
        self.gate.store(false, Ordering::SeqCst);
        self.inner.shutdown();
    }
}

/// The trainer part of `[faults]`: steps counted 1-based in this process, 0 = off.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct TrainerFaults {
    /// This step fails with an error.
    pub error_at_step: u64,
    /// This step panics.
    pub panic_at_step: u64,
    /// Every N-th step publishes nothing (an all-zero-advantage batch).
    pub skip_every_steps: u64,
}

impl TrainerFaults {
    /// From the config.
    pub fn from_config(faults: &FaultsConfig) -> Self {
        Self {
            error_at_step: faults.trainer_error_at_step,
            panic_at_step: faults.trainer_panic_at_step,
            skip_every_steps: faults.trainer_skip_every_steps,
        }
    }

    /// Some fault is on.
    pub fn any(&self) -> bool {
        *self != Self::default()
    }
}

/// A trainer that fails, panics or skips steps on schedule ([`TrainerFaults`]).
pub struct FaultyTrainer {
    inner: Box<dyn TrainerBackend>,
    faults: TrainerFaults,
    steps: u64,
}

impl FaultyTrainer {
    /// Wraps `inner`.
    pub fn new(inner: Box<dyn TrainerBackend>, faults: TrainerFaults) -> Self {
        Self {
            inner,
            faults,
            steps: 0,
        }
    }
}

impl TrainerBackend for FaultyTrainer {
    fn version(&self) -> PolicyVersion {
        self.inner.version()
    }

    fn train_step(&mut self, batch: &[RolloutGroup]) -> Result<TrainStepOutput, BackendError> {
        self.steps += 1;
        let f = self.faults;
        if self.steps == f.error_at_step {
            injected("trainer_error");
            return Err(BackendError::new(
                "injected_trainer_error",
                format!(
                    "step {} failed on purpose ([faults] trainer_error_at_step)",
                    self.steps
                ),
            ));
        }
        if self.steps == f.panic_at_step {
            injected("trainer_panic");
            panic!(
                "step {} panicked on purpose ([faults] trainer_panic_at_step)",
                self.steps
            );
        }
        if f.skip_every_steps > 0 && self.steps.is_multiple_of(f.skip_every_steps) {
            injected("trainer_skip");
            return Ok(TrainStepOutput {
                metrics: Default::default(),
                weights: None,
                trained_tokens: 0,
                situations: None,
            });
        }
        self.inner.train_step(batch)
    }

    fn snapshot(&self) -> WeightSnapshot {
        self.inner.snapshot()
    }

    fn checkpoint(&mut self, dir: &Path) -> Result<(), BackendError> {
        self.inner.checkpoint(dir)
    }

    fn restore(&mut self, dir: &Path) -> Result<(), BackendError> {
        self.inner.restore(dir)
    }

    fn set_version(&mut self, version: PolicyVersion) -> Result<(), BackendError> {
        self.inner.set_version(version)
    }
}

#[cfg(test)]
mod tests {
    use sluice_core::PolicyVersion;

    use super::*;

    /// A backend whose compute thread has died, on a server that is gone.
    struct Dead;

    impl InferenceBackend for Dead {
        fn submit(&self, _: GenerateRequest) -> Result<(), EngineError> {
            Ok(())
        }
        fn abort(&self, _: RequestId) -> Result<(), EngineError> {
            Ok(())
        }
        fn abort_all(&self) -> Result<(), EngineError> {
            Ok(())
        }
        fn update_weights(
            &self,
            _: WeightSnapshot,
            _: WeightUpdateMode,
        ) -> Result<(), EngineError> {
            Ok(())
        }
        fn stats(&self) -> EngineStats {
            EngineStats {
                version: PolicyVersion(3),
                ..EngineStats::default()
            }
        }
        fn shutdown(&mut self) {}
        fn is_alive(&self) -> bool {
            false
        }
        fn server_gone(&self) -> Option<String> {
            Some("the server left".into())
        }
    }

    #[test]
    fn a_wrapped_dead_backend_is_seen_as_dead() {
        let sink: EventSink = Arc::new(|_| {});
        let wrapped = FaultyBackend::new(
            |_| Ok::<_, ()>(Box::new(Dead) as Box<dyn InferenceBackend>),
            sink,
            EngineFaults::default(),
            Box::new(|| {}),
        )
        .unwrap();
        assert!(!wrapped.is_alive(), "the wrapper hid a dead backend");
        assert_eq!(wrapped.server_gone().as_deref(), Some("the server left"));
        assert_eq!(wrapped.stats().version, PolicyVersion(3));
    }
}
