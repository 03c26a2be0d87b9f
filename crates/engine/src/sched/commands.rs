//! The command half of a local backend's handle, written once: what the native engine's
//! [`NativeControl`](crate::NativeControl) and the [`SimEngine`](crate::SimEngine) queue for
//! their thread ([`Command`]), on a bounded channel whose refusals become [`EngineError`]s (a
//! full queue is `Overloaded`, a gone thread `Stopped`). The backends add only their own checks
//! before a submission or an update.

use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, Sender};
use sluice_core::{RequestId, WeightUpdateMode};

use super::{Command, WeightUpdate};
use crate::backend::{EngineError, enqueued};

/// The sending side of a backend's command queue. Cloning is shallow: clones feed one queue.
pub(crate) struct Commands<R, W> {
    tx: Sender<Command<R, W>>,
    /// The backend's name, for errors (`native-engine-0`).
    name: std::sync::Arc<str>,
    /// The queue's capacity, for the `Overloaded` error.
    capacity: usize,
}

impl<R, W> Clone for Commands<R, W> {
    fn clone(&self) -> Self {
        Self {
            tx: self.tx.clone(),
            name: std::sync::Arc::clone(&self.name),
            capacity: self.capacity,
        }
    }
}

impl<R, W> Commands<R, W> {
    /// A queue of `capacity` commands for the backend `name`; the receiver goes to its thread.
    pub(crate) fn channel(name: &str, capacity: usize) -> (Self, Receiver<Command<R, W>>) {
        let (tx, rx) = crossbeam_channel::bounded(capacity);
        let commands = Self {
            tx,
            name: name.into(),
            capacity,
        };
        (commands, rx)
    }

    /// The backend's name.
    pub(crate) fn name(&self) -> &str {
        &self.name
    }

    /// Queues `command` without waiting.
    pub(crate) fn send(&self, command: Command<R, W>) -> Result<(), EngineError> {
        enqueued(self.tx.try_send(command), &self.name, self.capacity)
    }

    /// Queues a request.
    pub(crate) fn submit(&self, request: R) -> Result<(), EngineError> {
        self.send(Command::Submit(request))
    }

    /// Aborts one request (its partial output comes back at the next step boundary).
    pub(crate) fn abort(&self, id: RequestId) -> Result<(), EngineError> {
        self.send(Command::Abort(id))
    }

    /// Aborts every queued and running request.
    pub(crate) fn abort_all(&self) -> Result<(), EngineError> {
        self.send(Command::AbortAll)
    }

    /// Installs `weights` per `mode`; the pause reported later is measured from now.
    pub(crate) fn update(&self, weights: W, mode: WeightUpdateMode) -> Result<(), EngineError> {
        self.send(Command::Update(WeightUpdate {
            weights,
            mode,
            asked: Instant::now(),
        }))
    }

    /// Stops stepping; with `abort`, every request is aborted first.
    pub(crate) fn pause(&self, abort: bool) -> Result<(), EngineError> {
        self.send(Command::Pause { abort })
    }

    /// Resumes stepping after a pause.
    pub(crate) fn continue_generation(&self) -> Result<(), EngineError> {
        self.send(Command::Continue)
    }

    /// Asks the thread to end, waiting at most `patience` for room in a full queue.
    pub(crate) fn shutdown(&self, patience: Duration) {
        // A failed send means the thread is gone already, or stuck: the caller joins or gives up.
        let _ = self.tx.send_timeout(Command::Shutdown, patience);
    }

    /// A handle of the same backend whose queue is closed: sends answer `Stopped`. Replacing a
    /// handle's own with it drops that sender, so the thread's `recv` ends once no clone is left.
    pub(crate) fn closed(&self) -> Self {
        let (tx, _) = crossbeam_channel::bounded(1);
        Self {
            tx,
            name: std::sync::Arc::clone(&self.name),
            capacity: self.capacity,
        }
    }
}
