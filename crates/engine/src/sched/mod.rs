//! The scheduler core of the local backends (native and simulated), written once: the waiting and
//! running queues, aborts, pause, and the three weight-update modes of DESIGN §4.2. A backend
//! supplies only what differs, as a [`Stepper`]: how a request becomes a sequence, how many
//! waiting sequences fit (KV blocks or a plain cap), what one step does (a model forward or a
//! simulated delay), how weights are installed and where events go.
//!
//! One loop iteration ([`Scheduler::iterate`]) is, in order:
//! 1. apply every queued command: submissions join the waiting queue; aborts finish their
//!    sequence as [`FinishReason::Abort`] with its partial output; `abort_resume` aborts
//!    everything then installs the weights; `in_flight` installs them at once and running
//!    sequences keep going (their KV from older weights kept); `drain` is held;
//! 2. a held drain update is installed once nothing runs (and the engine is not paused);
//! 3. admission, unless paused or a drain is held (a drain stops admitting);
//! 4. the last installed update is reported ([`EngineEvent::WeightsUpdated`]): its pause ends
//!    where the first step on the new weights starts, or at once when no step is coming (the
//!    engine is idle or paused). Both backends report at this point (the simulated one used to
//!    report at the install itself, before the step boundary the pause is defined by);
//! 5. one step over the running sequences, unless paused.
//!
//! Rules the tests hold it to: every submitted request is finished exactly once; a drain never
//! lets a request span two versions; a newer update supersedes a held drain (updates arrive in
//! publish order, so the held one is older: installing it after would go back a version); a
//! paused engine neither admits nor steps, and a pause with `abort` returns every partial.
//!
//! The sending side, what a backend's handle queues for its thread, is written once too
//! ([`Commands`]).

mod commands;
#[cfg(test)]
mod tests;

pub(crate) use commands::Commands;

use std::collections::VecDeque;
use std::time::Instant;

use crossbeam_channel::Receiver;
use sluice_core::{PolicyVersion, RequestId, WeightUpdateMode};

use crate::backend::{EngineEvent, FinishReason};

/// A sequence the scheduler queues: it only needs to know which request it serves.
pub(crate) trait Queued {
    /// The request it serves.
    fn request_id(&self) -> RequestId;
}

/// New weights, how to install them, and when they were asked for (the pause is measured from
/// there).
pub(crate) struct WeightUpdate<W> {
    pub weights: W,
    pub mode: WeightUpdateMode,
    pub asked: Instant,
}

/// What a backend's handle queues for its thread.
pub(crate) enum Command<R, W> {
    /// A new request.
    Submit(R),
    /// Abort one request (nothing happens if it already finished).
    Abort(RequestId),
    /// Abort every queued and running request.
    AbortAll,
    /// Install weights per the update's mode.
    Update(WeightUpdate<W>),
    /// Stop admitting and stepping; with `abort`, every request is aborted first.
    Pause { abort: bool },
    /// Resume after a pause.
    Continue,
    /// End the thread.
    Shutdown,
}

/// The two queues; a [`Stepper`] admits and steps over them.
pub(crate) struct Queues<S> {
    /// Submitted, not yet admitted, oldest first (a preempted sequence goes back to the front).
    pub waiting: VecDeque<S>,
    /// Admitted, in admission order (the newest last: preemption takes from the end).
    pub running: Vec<S>,
}

impl<S: Queued> Queues<S> {
    fn remove(&mut self, id: RequestId) -> Option<S> {
        if let Some(i) = self.running.iter().position(|s| s.request_id() == id) {
            return Some(self.running.remove(i));
        }
        let i = self.waiting.iter().position(|s| s.request_id() == id)?;
        self.waiting.remove(i)
    }

    fn is_empty(&self) -> bool {
        self.running.is_empty() && self.waiting.is_empty()
    }
}

/// What differs between backends; see the module docs.
pub(crate) trait Stepper {
    /// What a submission carries.
    type Request;
    /// A request inside the engine.
    type Seq: Queued;
    /// What a weight update carries.
    type Weights;
    /// The sequence to queue for `request`, or `None` when it was finished at once (through
    /// [`Self::finish`]: a prompt too long for the context, nothing left to generate).
    fn accept(&mut self, request: Self::Request) -> Option<Self::Seq>;
    /// Reports `seq` as finished (its resources released).
    fn finish(&mut self, seq: Self::Seq, finish: FinishReason);
    /// Installs `weights` for an update of `mode`; the version now in use, or `None` when they
    /// were refused (the old ones stay and nothing is reported).
    fn install(&mut self, weights: Self::Weights, mode: WeightUpdateMode) -> Option<PolicyVersion>;
    /// Moves waiting sequences to running, as many as fit.
    fn admit(&mut self, queues: &mut Queues<Self::Seq>);
    /// One step over the running sequences (finishing or preempting some).
    fn step(&mut self, queues: &mut Queues<Self::Seq>);
    /// Delivers an event.
    fn report(&mut self, event: EngineEvent);
    /// Publishes gauges (queue lengths) for lock-free reads.
    fn publish(&mut self, queues: &Queues<Self::Seq>);
    /// The thread wakes up after blocking on an empty queue.
    fn woke(&mut self) {}
}

/// An installed update not reported yet.
struct Installed {
    version: PolicyVersion,
    mode: WeightUpdateMode,
    asked: Instant,
}

/// See the module docs.
pub(crate) struct Scheduler<S, W> {
    queues: Queues<S>,
    /// A drain update held until nothing runs.
    drain: Option<WeightUpdate<W>>,
    paused: bool,
    installed: Option<Installed>,
}

impl<S: Queued, W> Scheduler<S, W> {
    pub(crate) fn new() -> Self {
        Self {
            queues: Queues {
                waiting: VecDeque::new(),
                running: Vec::new(),
            },
            drain: None,
            paused: false,
            installed: None,
        }
    }

    /// Runs `stepper` on commands from `rx` until a shutdown or until every sender is gone.
    pub(crate) fn run<T>(mut self, stepper: &mut T, rx: &Receiver<Command<T::Request, W>>)
    where
        T: Stepper<Seq = S, Weights = W>,
    {
        loop {
            let first = if self.idle() {
                // The last step may have finished every sequence: publish that before blocking,
                // or the stats keep the last step's counts for as long as the engine idles.
                stepper.publish(&self.queues);
                match rx.recv() {
                    Ok(c) => {
                        stepper.woke();
                        Some(c)
                    }
                    Err(_) => return,
                }
            } else {
                None
            };
            let commands: Vec<_> = first.into_iter().chain(rx.try_iter()).collect();
            if !self.iterate(stepper, commands) {
                return;
            }
        }
    }

    /// Nothing to do until a command comes: paused, or no request and no held drain.
    pub(crate) fn idle(&self) -> bool {
        self.paused || self.queues.is_empty() && self.drain.is_none()
    }

    /// One loop iteration over `commands` (see the module docs). Returns false on shutdown.
    pub(crate) fn iterate<T>(
        &mut self,
        stepper: &mut T,
        commands: Vec<Command<T::Request, W>>,
    ) -> bool
    where
        T: Stepper<Seq = S, Weights = W>,
    {
        // One span per iteration, inside the replica's span: a step's events and its weight
        // swaps are grouped in a debug log (the fields are read only when the span is enabled).
        let _iteration = tracing::debug_span!(
            "engine_iteration",
            commands = commands.len(),
            waiting = self.queues.waiting.len(),
            running = self.queues.running.len(),
        )
        .entered();
        for command in commands {
            match command {
                Command::Submit(request) => {
                    if let Some(seq) = stepper.accept(request) {
                        self.queues.waiting.push_back(seq);
                    }
                }
                Command::Abort(id) => {
                    if let Some(seq) = self.queues.remove(id) {
                        stepper.finish(seq, FinishReason::Abort);
                    }
                }
                Command::AbortAll => self.abort_all(stepper),
                Command::Update(update) => match update.mode {
                    WeightUpdateMode::AbortResume => {
                        self.abort_all(stepper);
                        self.install(stepper, update);
                    }
                    WeightUpdateMode::InFlight => self.install(stepper, update),
                    // A newer drain replaces an older one still held: only the last matters.
                    WeightUpdateMode::Drain => self.drain = Some(update),
                },
                Command::Pause { abort } => {
                    if abort {
                        self.abort_all(stepper);
                    }
                    self.paused = true;
                }
                Command::Continue => self.paused = false,
                Command::Shutdown => return false,
            }
        }
        if !self.paused
            && self.queues.running.is_empty()
            && let Some(update) = self.drain.take()
        {
            self.install(stepper, update);
        }
        if !self.paused && self.drain.is_none() {
            stepper.admit(&mut self.queues);
        }
        stepper.publish(&self.queues);
        if let Some(Installed {
            version,
            mode,
            asked,
        }) = self.installed.take()
        {
            stepper.report(EngineEvent::WeightsUpdated {
                version,
                pause: asked.elapsed(),
                mode,
            });
        }
        if !self.paused && !self.queues.running.is_empty() {
            stepper.step(&mut self.queues);
        }
        true
    }

    fn abort_all<T: Stepper<Seq = S, Weights = W>>(&mut self, stepper: &mut T) {
        let running = std::mem::take(&mut self.queues.running);
        let waiting = std::mem::take(&mut self.queues.waiting);
        for seq in running.into_iter().chain(waiting) {
            stepper.finish(seq, FinishReason::Abort);
        }
    }

    fn install<T: Stepper<Seq = S, Weights = W>>(
        &mut self,
        stepper: &mut T,
        update: WeightUpdate<W>,
    ) {
        // A held drain is older than any update installed now: drop it (see the module docs).
        if update.mode != WeightUpdateMode::Drain {
            self.drain = None;
        }
        let WeightUpdate {
            weights,
            mode,
            asked,
        } = update;
        if let Some(version) = stepper.install(weights, mode) {
            // Two installs between steps report once, as the newer one.
            self.installed = Some(Installed {
                version,
                mode,
                asked,
            });
        }
    }
}
