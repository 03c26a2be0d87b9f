//! [`SimEngine`]: a continuous-batching timing model on a dedicated thread.
//!
//! Queues, aborts, pause and the weight-update modes are the scheduler core's
//! ([`crate::sched`], shared with the native engine); this file is the simulated [`Stepper`]:
//! admission up to the concurrency cap, and a step in which every running sequence gains one
//! token tagged with the current version. A step costs `prefill · new_prompt_tokens + a + b · running` simulated seconds; the
//! thread sleeps that long times `time_scale`, against a running deadline so sleep overshoot does
//! not accumulate. Each submission draws its length; a resumed one draws conditioned on exceeding
//! the tokens it already has.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::config::SimEngineConfig;
use crossbeam_channel::Receiver;
use sluice_core::config::LengthDistribution;
use sluice_core::{PolicyVersion, RequestId, WeightSnapshot, WeightUpdateMode};

use crate::backend::{
    Completion, EngineError, EngineEvent, EngineStats, EventSink, FinishReason, GenerateRequest,
    InferenceBackend, TokenOutput, push_token,
};
use crate::sched::{Commands, Queued, Queues, Scheduler, Stepper};
use sluice_core::rng::{SplitMix64, mix};

/// Commands queued per replica; a full queue is back-pressure, reported as an error by `submit`.
const COMMAND_QUEUE: usize = 65_536;

/// Everything the timing model needs.
#[derive(Debug, Clone)]
pub struct SimEngineParams {
    /// Replica index (names the thread, seeds nothing).
    pub replica: u32,
    /// Cap on running sequences.
    pub max_running_sequences: u32,
    /// The timing model and length distributions.
    pub sim: SimEngineConfig,
}

type Command = crate::sched::Command<GenerateRequest, WeightSnapshot>;

#[derive(Default)]
struct Shared {
    version: AtomicU64,
    running: AtomicU64,
    waiting: AtomicU64,
    generated_tokens: AtomicU64,
    busy_nanos: AtomicU64,
}

/// See the module docs.
pub struct SimEngine {
    commands: Commands<GenerateRequest, WeightSnapshot>,
    shared: Arc<Shared>,
    started: Instant,
    thread: Option<JoinHandle<()>>,
}

impl SimEngine {
    /// Starts the engine thread at `version`; events go to `sink`.
    pub fn start(params: SimEngineParams, version: PolicyVersion, sink: EventSink) -> Self {
        let name = format!("sim-engine-{}", params.replica);
        let (commands, rx) = Commands::channel(&name, COMMAND_QUEUE);
        let shared = Arc::new(Shared::default());
        shared.version.store(version.0, Ordering::Relaxed);
        let worker = Worker {
            rx,
            sink,
            shared: Arc::clone(&shared),
            cap: params.max_running_sequences.max(1) as usize,
            sim: params.sim,
            version,
            deadline: Instant::now(),
        };
        let span = tracing::info_span!("engine_replica", backend = "simulated", thread = %name);
        let thread = std::thread::Builder::new()
            .name(name.clone())
            .spawn(move || {
                let _span = span.entered();
                let mut worker = worker;
                let rx = worker.rx.clone();
                Scheduler::new().run(&mut worker, &rx);
            })
            .expect("spawning the simulated engine thread");
        Self {
            commands,
            shared,
            started: Instant::now(),
            thread: Some(thread),
        }
    }

    /// Stops stepping: with `abort`, every request is aborted (partials returned); without, they
    /// wait in place until [`Self::continue_generation`] (as the native engine's pause).
    pub fn pause(&self, abort: bool) -> Result<(), EngineError> {
        self.commands.pause(abort)
    }

    /// Resumes stepping after [`Self::pause`].
    pub fn continue_generation(&self) -> Result<(), EngineError> {
        self.commands.continue_generation()
    }
}

impl InferenceBackend for SimEngine {
    fn submit(&self, request: GenerateRequest) -> Result<(), EngineError> {
        self.commands.submit(request)
    }

    fn abort(&self, id: RequestId) -> Result<(), EngineError> {
        self.commands.abort(id)
    }

    fn abort_all(&self) -> Result<(), EngineError> {
        self.commands.abort_all()
    }

    fn update_weights(
        &self,
        weights: WeightSnapshot,
        mode: WeightUpdateMode,
    ) -> Result<(), EngineError> {
        self.commands.update(weights, mode)
    }

    fn stats(&self) -> EngineStats {
        let s = &self.shared;
        EngineStats {
            version: PolicyVersion(s.version.load(Ordering::Relaxed)),
            running: s.running.load(Ordering::Relaxed),
            waiting: s.waiting.load(Ordering::Relaxed),
            generated_tokens: s.generated_tokens.load(Ordering::Relaxed),
            busy_seconds: s.busy_nanos.load(Ordering::Relaxed) as f64 * 1e-9,
            uptime_seconds: self.started.elapsed().as_secs_f64(),
            kv_cache: None,
        }
    }

    fn is_alive(&self) -> bool {
        self.thread.as_ref().is_some_and(|t| !t.is_finished())
    }

    fn server_gone(&self) -> Option<String> {
        // In-process: a failure is always the replica's own.
        None
    }

    fn shutdown(&mut self) {
        // A full queue still sees the disconnect once the sender is gone, so do not wait.
        self.commands.shutdown(Duration::ZERO);
        if let Some(t) = self.thread.take() {
            // Dropping our sender lets the worker's recv fail if the Shutdown did not fit.
            self.commands = self.commands.closed();
            let _ = t.join();
        }
    }
}

impl Drop for SimEngine {
    fn drop(&mut self) {
        self.shutdown();
    }
}

struct Seq {
    id: RequestId,
    output: TokenOutput,
    target: u32,
    max_tokens: u32,
    prefill_tokens: u64,
    prefilled: bool,
}

struct Worker {
    rx: Receiver<Command>,
    sink: EventSink,
    shared: Arc<Shared>,
    cap: usize,
    sim: SimEngineConfig,
    version: PolicyVersion,
    deadline: Instant,
}

impl Queued for Seq {
    fn request_id(&self) -> RequestId {
        self.id
    }
}

impl Worker {
    fn new_seq(&self, req: GenerateRequest) -> Seq {
        let dist = req
            .domain
            .as_ref()
            .and_then(|d| self.sim.lengths.get(d))
            .or_else(|| self.sim.lengths.get("default"))
            .cloned()
            .unwrap_or(LengthDistribution::Fixed { tokens: 16 });
        let r = req.id.rollout;
        // Seeded per submission, so a regenerated turn is a new sample. A resumed turn draws from
        // the length distribution conditioned on exceeding what it already generated: its
        // continuation is a fresh sample of the same policy, as on a real engine.
        let mut rng = SplitMix64::new(mix(&[
            self.sim.seed,
            r.group.run.0,
            u64::from(r.group.node.0),
            r.group.counter,
            u64::from(r.index),
            u64::from(req.id.turn),
            u64::from(req.id.attempt),
        ]));
        let max_tokens = req.params.max_tokens.max(1);
        let output = req.resume.unwrap_or_default();
        let done = output.len() as u32;
        let target = (0..16)
            .map(|_| rng.length(&dist, max_tokens))
            .find(|l| *l > done || done >= max_tokens)
            .unwrap_or((done + 1).min(max_tokens));
        Seq {
            id: req.id,
            prefill_tokens: (req.prompt_token_ids.len() + output.len()) as u64,
            target,
            max_tokens,
            output,
            prefilled: false,
        }
    }

    fn step_batch(&mut self, q: &mut Queues<Seq>) {
        let prefill: u64 = q
            .running
            .iter()
            .filter(|s| !s.prefilled)
            .map(|s| s.prefill_tokens)
            .sum();
        let cost = self.sim.prefill_seconds_per_token * prefill as f64
            + self.sim.decode_step_base_seconds
            + self.sim.decode_step_per_sequence_seconds * q.running.len() as f64;
        let real = cost * self.sim.time_scale;
        let start = Instant::now();
        if real > 0.0 {
            // Sleep to a running deadline, so sleep overshoot and this thread's own bookkeeping
            // are absorbed by later steps instead of stretching simulated time. Only a lag of
            // more than a few steps (a starved CPU) is given up.
            let behind = start.saturating_duration_since(self.deadline);
            if behind > super::real_duration(real * 8.0).max(Duration::from_millis(2)) {
                self.deadline = start;
            }
            self.deadline += super::real_duration(real);
            let now = Instant::now();
            if self.deadline > now {
                std::thread::sleep(self.deadline - now);
            }
        }
        let mut finished = Vec::new();
        let mut generated = 0u64;
        let version = self.version;
        for (i, s) in q.running.iter_mut().enumerate() {
            s.prefilled = true;
            if s.output.len() as u32 >= s.target.min(s.max_tokens) {
                // A resumed request that already reached its length stops without a new token.
                finished.push(i);
                continue;
            }
            let pos = s.output.len() as u64;
            let h = mix(&[
                u64::from(s.id.rollout.index),
                s.id.rollout.group.counter,
                pos,
            ]);
            push_token(
                &mut s.output,
                (h % 32_000) as u32,
                -((h >> 40) as f32 / (1u64 << 24) as f32) * 3.0,
                version,
            );
            generated += 1;
            if s.output.len() as u32 >= s.target.min(s.max_tokens) {
                finished.push(i);
            }
        }
        // Every token made this step, the last one of a sequence that ends with it included.
        self.shared
            .generated_tokens
            .fetch_add(generated, Ordering::Relaxed);
        let elapsed = if real > 0.0 {
            super::real_duration(real)
        } else {
            start.elapsed()
        };
        self.shared
            .busy_nanos
            .fetch_add(elapsed.as_nanos() as u64, Ordering::Relaxed);
        for i in finished.into_iter().rev() {
            let s = q.running.swap_remove(i);
            let reason = if s.output.len() as u32 >= s.max_tokens {
                FinishReason::Length
            } else {
                FinishReason::Stop
            };
            self.finish(s, reason);
        }
    }
}

impl Stepper for Worker {
    type Request = GenerateRequest;
    type Seq = Seq;
    type Weights = WeightSnapshot;

    fn accept(&mut self, request: GenerateRequest) -> Option<Seq> {
        Some(self.new_seq(request))
    }

    fn finish(&mut self, s: Seq, finish: FinishReason) {
        (self.sink)(EngineEvent::Finished(Completion {
            id: s.id,
            output: s.output,
            finish,
        }));
    }

    fn install(
        &mut self,
        weights: WeightSnapshot,
        _mode: WeightUpdateMode,
    ) -> Option<PolicyVersion> {
        if weights.version > self.version {
            self.version = weights.version;
            self.shared
                .version
                .store(weights.version.0, Ordering::Relaxed);
        }
        Some(self.version)
    }

    fn admit(&mut self, q: &mut Queues<Seq>) {
        while q.running.len() < self.cap {
            match q.waiting.pop_front() {
                Some(s) => q.running.push(s),
                None => break,
            }
        }
    }

    fn step(&mut self, q: &mut Queues<Seq>) {
        self.step_batch(q);
    }

    fn report(&mut self, event: EngineEvent) {
        (self.sink)(event);
    }

    fn publish(&mut self, q: &Queues<Seq>) {
        self.shared
            .running
            .store(q.running.len() as u64, Ordering::Relaxed);
        self.shared
            .waiting
            .store(q.waiting.len() as u64, Ordering::Relaxed);
    }

    fn woke(&mut self) {
        // Simulated time does not run while the engine has nothing to do.
        self.deadline = Instant::now();
    }
}
