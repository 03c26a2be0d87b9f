//! [`SimEngine`]: a continuous-batching timing model on a dedicated thread.
//!
//! Each loop iteration: apply queued commands (between two steps, which is where `in_flight`
//! swaps happen), admit waiting requests up to the concurrency cap (unless a `drain` update is
//! pending), then run one step: every running sequence gains one token tagged with the current
//! version. A step costs `prefill · new_prompt_tokens + a + b · running` simulated seconds; the
//! thread sleeps that long times `time_scale`, against a running deadline so sleep overshoot does
//! not accumulate. Each submission draws its length; a resumed one draws conditioned on exceeding
//! the tokens it already has.

use std::collections::VecDeque;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, Sender};
use sluice_core::config::{LengthDistribution, SimEngineConfig};
use sluice_core::{PolicyVersion, RequestId, WeightSnapshot, WeightUpdateMode};

use crate::backend::{
    Completion, EngineError, EngineEvent, EngineStats, EventSink, FinishReason, GenerateRequest,
    InferenceBackend, TokenOutput, enqueued, push_token,
};
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

enum Command {
    Submit(GenerateRequest),
    Abort(RequestId),
    AbortAll,
    Update(WeightSnapshot, WeightUpdateMode, Instant),
    Shutdown,
}

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
    tx: Sender<Command>,
    shared: Arc<Shared>,
    started: Instant,
    thread: Option<JoinHandle<()>>,
    name: String,
}

impl SimEngine {
    /// Starts the engine thread at `version`; events go to `sink`.
    pub fn start(params: SimEngineParams, version: PolicyVersion, sink: EventSink) -> Self {
        let (tx, rx) = crossbeam_channel::bounded(COMMAND_QUEUE);
        let shared = Arc::new(Shared::default());
        shared.version.store(version.0, Ordering::Relaxed);
        let name = format!("sim-engine-{}", params.replica);
        let worker = Worker {
            rx,
            sink,
            shared: Arc::clone(&shared),
            cap: params.max_running_sequences.max(1) as usize,
            sim: params.sim,
            version,
            waiting: VecDeque::new(),
            running: Vec::new(),
            pending_drain: None,
            deadline: Instant::now(),
        };
        let thread = std::thread::Builder::new()
            .name(name.clone())
            .spawn(move || worker.run())
            .expect("spawning the simulated engine thread");
        Self {
            tx,
            shared,
            started: Instant::now(),
            thread: Some(thread),
            name,
        }
    }

    fn send(&self, command: Command) -> Result<(), EngineError> {
        enqueued(self.tx.try_send(command), &self.name, COMMAND_QUEUE)
    }
}

impl InferenceBackend for SimEngine {
    fn submit(&self, request: GenerateRequest) -> Result<(), EngineError> {
        self.send(Command::Submit(request))
    }

    fn abort(&self, id: RequestId) -> Result<(), EngineError> {
        self.send(Command::Abort(id))
    }

    fn abort_all(&self) -> Result<(), EngineError> {
        self.send(Command::AbortAll)
    }

    fn update_weights(
        &self,
        weights: WeightSnapshot,
        mode: WeightUpdateMode,
    ) -> Result<(), EngineError> {
        self.send(Command::Update(weights, mode, Instant::now()))
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

    fn shutdown(&mut self) {
        // A full queue still sees the disconnect once the sender is gone, so ignore a failed send.
        let _ = self.tx.try_send(Command::Shutdown);
        if let Some(t) = self.thread.take() {
            let (tx, _) = crossbeam_channel::bounded(1);
            // Dropping our sender lets the worker's recv fail if the Shutdown did not fit.
            let _ = std::mem::replace(&mut self.tx, tx);
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
    waiting: VecDeque<Seq>,
    running: Vec<Seq>,
    pending_drain: Option<(WeightSnapshot, Instant)>,
    deadline: Instant,
}

impl Worker {
    fn run(mut self) {
        loop {
            let idle =
                self.running.is_empty() && self.waiting.is_empty() && self.pending_drain.is_none();
            let first = if idle {
                // The last step may have finished every sequence: publish that before blocking,
                // or the stats keep the last step's counts for as long as the engine idles.
                self.publish_gauges();
                match self.rx.recv() {
                    Ok(c) => {
                        // Simulated time does not run while the engine has nothing to do.
                        self.deadline = Instant::now();
                        Some(c)
                    }
                    Err(_) => return,
                }
            } else {
                None
            };
            let mut commands: Vec<Command> = first.into_iter().collect();
            commands.extend(self.rx.try_iter());
            for c in commands {
                if !self.apply(c) {
                    return;
                }
            }
            if let Some((w, asked)) = self.pending_drain.take() {
                if self.running.is_empty() {
                    self.swap(w, WeightUpdateMode::Drain, asked);
                } else {
                    self.pending_drain = Some((w, asked));
                }
            }
            self.admit();
            self.publish_gauges();
            if !self.running.is_empty() {
                self.step();
            }
        }
    }

    /// Returns false on shutdown.
    fn apply(&mut self, command: Command) -> bool {
        match command {
            Command::Submit(req) => {
                let seq = self.new_seq(req);
                self.waiting.push_back(seq);
            }
            Command::Abort(id) => {
                if let Some(i) = self.running.iter().position(|s| s.id == id) {
                    let s = self.running.swap_remove(i);
                    self.finish(s, FinishReason::Abort);
                } else if let Some(i) = self.waiting.iter().position(|s| s.id == id) {
                    let s = self.waiting.remove(i).expect("index from position");
                    self.finish(s, FinishReason::Abort);
                }
            }
            Command::AbortAll => self.abort_all(),
            Command::Update(w, mode, asked) => match mode {
                WeightUpdateMode::AbortResume => {
                    self.abort_all();
                    self.swap(w, mode, asked);
                }
                WeightUpdateMode::InFlight => self.swap(w, mode, asked),
                WeightUpdateMode::Drain => self.pending_drain = Some((w, asked)),
            },
            Command::Shutdown => return false,
        }
        true
    }

    fn abort_all(&mut self) {
        let running: Vec<Seq> = self.running.drain(..).collect();
        let waiting: Vec<Seq> = self.waiting.drain(..).collect();
        for s in running.into_iter().chain(waiting) {
            self.finish(s, FinishReason::Abort);
        }
    }

    fn swap(&mut self, w: WeightSnapshot, mode: WeightUpdateMode, asked: Instant) {
        if w.version > self.version {
            self.version = w.version;
            self.shared.version.store(w.version.0, Ordering::Relaxed);
        }
        (self.sink)(EngineEvent::WeightsUpdated {
            version: self.version,
            pause: asked.elapsed(),
            mode,
        });
    }

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

    fn admit(&mut self) {
        if self.pending_drain.is_some() {
            return;
        }
        while self.running.len() < self.cap {
            match self.waiting.pop_front() {
                Some(s) => self.running.push(s),
                None => break,
            }
        }
    }

    fn step(&mut self) {
        let prefill: u64 = self
            .running
            .iter()
            .filter(|s| !s.prefilled)
            .map(|s| s.prefill_tokens)
            .sum();
        let cost = self.sim.prefill_seconds_per_token * prefill as f64
            + self.sim.decode_step_base_seconds
            + self.sim.decode_step_per_sequence_seconds * self.running.len() as f64;
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
        let version = self.version;
        for (i, s) in self.running.iter_mut().enumerate() {
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
            if s.output.len() as u32 >= s.target.min(s.max_tokens) {
                finished.push(i);
            }
        }
        self.shared.generated_tokens.fetch_add(
            (self.running.len() - finished.len()) as u64,
            Ordering::Relaxed,
        );
        let elapsed = if real > 0.0 {
            super::real_duration(real)
        } else {
            start.elapsed()
        };
        self.shared
            .busy_nanos
            .fetch_add(elapsed.as_nanos() as u64, Ordering::Relaxed);
        for i in finished.into_iter().rev() {
            let s = self.running.swap_remove(i);
            let reason = if s.output.len() as u32 >= s.max_tokens {
                FinishReason::Length
            } else {
                FinishReason::Stop
            };
            self.finish(s, reason);
        }
    }

    fn finish(&mut self, s: Seq, finish: FinishReason) {
        (self.sink)(EngineEvent::Finished(Completion {
            id: s.id,
            output: s.output,
            finish,
        }));
    }

    fn publish_gauges(&self) {
        self.shared
            .running
            .store(self.running.len() as u64, Ordering::Relaxed);
        self.shared
            .waiting
            .store(self.waiting.len() as u64, Ordering::Relaxed);
    }
}
