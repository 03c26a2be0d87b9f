//! Replica supervision (`[supervision]`, see the [`super`] module docs): the policy, each
//! replica's health record, building a replica's backend (behind the fault injector), the
//! periodic checks (dead threads, the watchdog, the give-up timer), failing and restarting a
//! replica, moving a replica whose server is gone (not a failure), and giving up.

use std::sync::Arc;
use std::time::Duration;

use ractor::ActorRef;
use serde::Serialize;
use sluice_config::{FaultsConfig, SupervisionConfig};
use sluice_core::RequestId;
use sluice_core::metrics as m;
use sluice_engine::{
    Completion, EngineError, EventSink, FinishReason, InferenceBackend, TokenOutput,
};
use tokio::time::Instant;

use super::{Cmd, EngineMsg, EngineReport, EngineState};
use crate::events::RunEvents;
use crate::faults::{EngineFaults, FaultyBackend};

/// How the engine supervises its replicas.
#[derive(Debug, Clone)]
pub struct EngineSupervision {
    /// First restart delay (doubles per consecutive failure of a replica).
    pub backoff_initial: Duration,
    /// Longest restart delay.
    pub backoff_max: Duration,
    /// Restart a replica that holds requests without progress this long (`None` = off).
    pub watchdog: Option<Duration>,
    /// Give up on a replica after this many failures in a row with nothing served in between
    /// (0 = never).
    pub max_restarts: u64,
    /// Give up when no replica can serve for this long (`None` = never).
    pub unavailable_timeout: Option<Duration>,
    /// Injected faults (tests and drills).
    pub faults: EngineFaults,
    /// Where giving up is announced (the node stops the run at once).
    pub events: RunEvents,
}

impl Default for EngineSupervision {
    fn default() -> Self {
        Self {
            backoff_initial: Duration::from_millis(100),
            backoff_max: Duration::from_secs(30),
            watchdog: None,
            max_restarts: 0,
            unavailable_timeout: None,
            faults: EngineFaults::default(),
            events: RunEvents::default(),
        }
    }
}

impl EngineSupervision {
    /// The policy of `[supervision]` with the engine faults of `[faults]`.
    pub fn from_config(supervision: &SupervisionConfig, faults: &FaultsConfig) -> Self {
        Self {
            backoff_initial: supervision.restart_backoff_initial,
            backoff_max: supervision.restart_backoff_max,
            watchdog: supervision.engine_watchdog,
            max_restarts: supervision.engine_max_restarts,
            unavailable_timeout: supervision.engine_unavailable_timeout,
            faults: EngineFaults::from_config(faults),
            events: RunEvents::default(),
        }
    }
}

/// A replica's supervision record, for `/v1/status` and the tests.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct ReplicaHealth {
    /// A backend is running (false while waiting out a restart backoff).
    pub alive: bool,
    /// Times the replica was rebuilt.
    pub restarts: u64,
    /// Failures by cause: `error` (a call failed), `crash` (injected), `watchdog`, `died` (its
    /// thread ended), `start` (its factory failed).
    pub failures: std::collections::BTreeMap<String, u64>,
    /// Seconds from the last failure to the rebuilt backend taking requests.
    pub last_restart_seconds: Option<f64>,
    /// Requests handed back as aborted because the replica died.
    pub requests_returned: u64,
    /// Failures since the replica last served a request.
    pub failures_in_a_row: u64,
    /// The last failure's error (or cause).
    pub last_error: Option<String>,
    /// Times the server it ran on went away (a head's engine node unreachable, lost, left or
    /// restarted): not failures of the replica, so not in `failures` nor `failures_in_a_row`.
    pub servers_lost: u64,
}

/// How often a replica without a server looks for one when its factory has no wake channel.
const VACANT_RETRY: Duration = Duration::from_millis(500);
/// With a wake channel, a vacant replica looks again at its next change, and at the latest
/// after this (a server freed by another slot changes nothing in the channel).
const VACANT_FALLBACK: Duration = Duration::from_secs(5);

fn sink_for(me: &ActorRef<EngineMsg>, replica: u32, generation: u64) -> EventSink {
    let me = me.clone();
    Arc::new(move |e| {
        let _ = me.cast(EngineMsg(Cmd::Event(replica, generation, e)));
    })
}

impl EngineState {
    /// Builds replica `i`'s backend for its current generation on the latest weights (wrapped
    /// by the fault injector). A failed build fails the replica: it is retried after the backoff.
    pub(super) fn build(&mut self, i: usize) -> Result<(), EngineError> {
        let generation = self.replicas[i].generation;
        let sink = sink_for(&self.me, i as u32, generation);
        self.replicas[i].wake_seen = self.args.factory.wake_seen();
        let faults = &self.args.supervision.faults;
        let replica = i as u32;
        let backend: Box<dyn InferenceBackend> = if faults.any() {
            let me = self.me.clone();
            let on_crash = Box::new(move || {
                let _ = me.cast(EngineMsg(Cmd::Died(replica, generation, "crash")));
            });
            let factory = self.args.factory.clone();
            let latest = &self.latest;
            Box::new(FaultyBackend::new(
                move |gated| factory.build(replica, latest, gated),
                sink,
                faults.clone(),
                on_crash,
            )?)
        } else {
            self.args.factory.build(replica, &self.latest, sink)?
        };
        let r = &mut self.replicas[i];
        let counter = backend.stats().generated_tokens;
        r.backend = Some(backend);
        r.version = self.latest.version;
        r.load = 0;
        r.health.alive = true;
        r.backoff.started(Instant::now());
        if let Some(w) = &mut r.watchdog {
            w.reset(counter);
        }
        Ok(())
    }

    /// Builds replica `i`, or fails it (to be retried) when its factory fails; true when built.
    pub(super) fn build_or_fail(&mut self, i: usize) -> bool {
        match self.build(i) {
            Ok(()) => true,
            Err(e) => {
                self.fail_replica(i as u32, "start", Some(&e));
                false
            }
        }
    }

    /// The periodic checks: the give-up timer, and the watchdog, which fails a replica holding
    /// requests without progress for its limit.
    pub(super) fn watch(&mut self) {
        let now = Instant::now();
        if let (Some(since), Some(limit)) = (
            self.unavailable_since,
            self.args.supervision.unavailable_timeout,
        ) && now.saturating_duration_since(since) >= limit
        {
            let last = self
                .replicas
                .iter()
                .enumerate()
                .filter_map(|(i, r)| {
                    Some(format!("replica {i}: {}", r.health.last_error.as_ref()?))
                })
                .collect::<Vec<_>>()
                .join("; ");
            self.give_up(format!(
                "no engine replica could serve for {:.0} s (supervision.engine_unavailable_timeout_s); last errors: {last}",
                limit.as_secs_f64()
            ));
        }
        let dead: Vec<u32> = self
            .replicas
            .iter()
            .enumerate()
            .filter(|(_, r)| r.backend.as_ref().is_some_and(|b| !b.is_alive()))
            .map(|(i, _)| i as u32)
            .collect();
        for i in dead {
            let e = EngineError::Stopped {
                backend: format!("replica {i} (its compute thread ended unexpectedly)"),
            };
            self.fail_replica(i, "died", Some(&e));
        }
        let stuck: Vec<u32> = self
            .replicas
            .iter_mut()
            .enumerate()
            .filter_map(|(i, r)| {
                let b = r.backend.as_ref()?;
                let w = r.watchdog.as_mut()?;
                let counter = b.stats().generated_tokens;
                w.check(now, r.load > 0, counter).then_some(i as u32)
            })
            .collect();
        for i in stuck {
            tracing::warn!(
                replica = i,
                "engine replica made no progress; the watchdog restarts it"
            );
            self.fail_replica(i, "watchdog", None);
        }
    }

    /// A replica failed: hand its requests back as aborted (with the output they were resumed
    /// from: nothing newer was reported), shut the backend down off the actor, and schedule the
    /// restart after the backoff. A replica whose server is gone ([`InferenceBackend::server_gone`])
    /// or that has none ([`EngineError::NoServer`]) has not failed: see [`Self::lose_server`] and
    /// [`Self::vacate`].
    pub(super) fn fail_replica(
        &mut self,
        replica: u32,
        cause: &'static str,
        error: Option<&EngineError>,
    ) {
        if let Some(EngineError::NoServer { reason, .. }) = error {
            self.vacate(replica, reason.clone());
            return;
        }
        let gone = self.replicas[replica as usize]
            .backend
            .as_ref()
            .and_then(|b| b.server_gone());
        if let Some(reason) = gone {
            self.lose_server(replica, reason);
            return;
        }
        let kind = error.map_or(
            match cause {
                "watchdog" => "engine_watchdog",
                "crash" => "engine_crash",
                _ => "engine_failure",
            },
            EngineError::kind,
        );
        self.counters.error(kind);
        let described = error.map_or_else(|| format!("{cause} ({kind})"), ToString::to_string);
        let now = Instant::now();
        let r = &mut self.replicas[replica as usize];
        if let Some(mut old) = r.backend.take() {
            self.tasks
                .push(tokio::task::spawn_blocking(move || old.shutdown()));
        }
        r.generation += 1;
        r.load = 0;
        r.failed_at = Some(now);
        r.health.alive = false;
        *r.health.failures.entry(cause.to_owned()).or_default() += 1;
        r.health.failures_in_a_row += 1;
        r.health.last_error = Some(described.clone());
        let in_a_row = r.health.failures_in_a_row;
        let generation = r.generation;
        let delay = r.backoff.failed(now);
        let max = self.args.supervision.max_restarts;
        let give_up = max > 0 && in_a_row > max;
        if !give_up {
            tracing::warn!(replica, error = %described, "engine replica failed; restarting it");
        }
        if self.unavailable_since.is_none() && self.replicas.iter().all(|r| r.backend.is_none()) {
            self.unavailable_since = Some(now);
        }
        self.hand_back(replica);
        if give_up {
            self.give_up(format!(
                "engine replica {replica} failed {in_a_row} times in a row without serving a \
                 request (supervision.engine_max_restarts = {max}); last error: {described}"
            ));
            return;
        }
        metrics::gauge!(m::ACTOR_RESTART_BACKOFF_SECONDS, "actor" => "engine")
            .set(delay.as_secs_f64());
        self.timers.retain(|t| !t.is_finished());
        self.timers.push(
            self.me
                .send_after(delay, move || EngineMsg(Cmd::Restart(replica, generation))),
        );
    }

    /// Hands the requests replica `replica` held back as aborted, each with the output it was
    /// resumed from (nothing newer was reported), and reaps finished shutdowns.
    fn hand_back(&mut self, replica: u32) {
        let lost: Vec<(RequestId, Option<TokenOutput>)> = self
            .owner
            .iter()
            .filter(|(_, (rep, _))| *rep == replica)
            .map(|(id, (_, resume))| (*id, resume.clone()))
            .collect();
        self.replicas[replica as usize].health.requests_returned += lost.len() as u64;
        for (id, resume) in lost {
            self.owner.remove(&id);
            self.report(EngineReport::Finished {
                completion: Completion {
                    id,
                    output: resume.unwrap_or_default(),
                    finish: FinishReason::Abort,
                },
                replica,
            });
        }
        self.tasks.retain(|t| !t.is_finished());
    }

    /// The server replica `replica` ran on is gone (its backend says why: a head's engine node
    /// that does not answer, or that left or was lost): not the replica's failure. Its requests
    /// come back aborted and its backend is shut down as for a failure, but nothing counts
    /// towards giving up and the backoff does not grow: the slot is rebuilt at once, on another
    /// server or vacant until one is free (the factory no longer offers the gone one).
    fn lose_server(&mut self, replica: u32, reason: String) {
        let now = Instant::now();
        let r = &mut self.replicas[replica as usize];
        tracing::warn!(replica, %reason, "engine replica lost its server; it moves to another");
        if let Some(mut old) = r.backend.take() {
            self.tasks
                .push(tokio::task::spawn_blocking(move || old.shutdown()));
        }
        r.generation += 1;
        r.load = 0;
        r.failed_at = Some(now);
        r.health.alive = false;
        r.health.servers_lost += 1;
        r.health.last_error = Some(reason);
        let generation = r.generation;
        if self.unavailable_since.is_none() && self.replicas.iter().all(|r| r.backend.is_none()) {
            self.unavailable_since = Some(now);
        }
        self.hand_back(replica);
        let _ = self.me.cast(EngineMsg(Cmd::Restart(replica, generation)));
    }

    /// Replica `replica` has no server to run on (a head waiting for engine nodes): it holds
    /// no requests, so nothing is handed back; it is not a failure (no backoff growth, nothing
    /// counted towards giving up) and is tried again when the factory's wake channel changes
    /// from what it was at the build (a node joined), else after [`VACANT_RETRY`]. The give-up
    /// timer still runs while no replica at all can serve.
    fn vacate(&mut self, replica: u32, reason: String) {
        let now = Instant::now();
        let r = &mut self.replicas[replica as usize];
        if r.health.last_error.as_deref() != Some(reason.as_str()) {
            tracing::info!(replica, %reason, "engine replica waits for a server");
        }
        r.generation += 1;
        r.load = 0;
        r.health.alive = false;
        r.health.last_error = Some(reason);
        let generation = r.generation;
        if self.unavailable_since.is_none() && self.replicas.iter().all(|r| r.backend.is_none()) {
            self.unavailable_since = Some(now);
        }
        let seen = self.replicas[replica as usize].wake_seen;
        self.timers.retain(|t| !t.is_finished());
        let retry = move || EngineMsg(Cmd::Restart(replica, generation));
        match (self.args.factory.wake(), seen) {
            (Some(mut changes), Some(seen)) => {
                let me = self.me.clone();
                self.timers.push(tokio::spawn(async move {
                    // A change since the build (even one during it) wakes it at once.
                    let _ = tokio::time::timeout(VACANT_FALLBACK, changes.wait_for(|n| *n != seen))
                        .await;
                    me.cast(retry())
                }));
            }
            _ => self.timers.push(self.me.send_after(VACANT_RETRY, retry)),
        }
    }

    pub(super) fn restart(&mut self, replica: u32, generation: u64) {
        let i = replica as usize;
        if self.replicas[i].generation != generation || self.replicas[i].backend.is_some() {
            return;
        }
        if !self.build_or_fail(i) {
            return;
        }
        self.unavailable_since = None;
        let r = &mut self.replicas[i];
        r.health.restarts += 1;
        r.health.last_restart_seconds = r.failed_at.take().map(|t| t.elapsed().as_secs_f64());
        metrics::counter!(m::ACTOR_RESTARTS, "actor" => "engine").increment(1);
        metrics::gauge!(m::ACTOR_RESTART_BACKOFF_SECONDS, "actor" => "engine").set(0.0);
        tracing::info!(
            replica,
            restarts = r.health.restarts,
            "engine replica restarted"
        );
        // Weights published while it was down: it starts on the latest already.
        self.report_versions();
        let parked: Vec<_> = self.parked.drain(..).collect();
        for (req, preferred) in parked {
            self.route(req, preferred);
        }
    }

    /// Stops restarting and records why; the node stops the run (see the module docs).
    pub(super) fn give_up(&mut self, reason: String) {
        if self.failure.is_some() {
            return;
        }
        tracing::error!(%reason, "the engine cannot serve; the run stops");
        self.counters.error("engine_unavailable");
        self.failure = Some(reason);
        self.args.supervision.events.announce();
    }
}
