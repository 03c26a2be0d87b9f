//! `GET /v1/status`: every actor's view gathered with a timeout each, actor health, and rates
//! over the last minute of status calls.

use std::collections::{BTreeMap, VecDeque};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use serde::Serialize;
use sluice_core::Knobs;
use sluice_engine::EngineStats;
use sluice_replay::StoreSnapshot;

use super::AdminState;
use sluice_actors::ActorError;
use sluice_actors::controller::ControllerStatus;
use sluice_actors::trainer::TrainerStatus;

/// How long `/v1/status` waits for each actor before reporting it unreachable.
const ACTOR_CALL_TIMEOUT: Duration = Duration::from_secs(2);

/// How an actor is doing, as `/v1/status` reports it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Health {
    /// Answering.
    Running,
    /// Finished its work (the trainer after `run.max_steps`).
    Done,
    /// Stopped with an error.
    Failed,
    /// Did not answer within the status timeout, or is gone.
    Unreachable,
}

/// One actor's line in `/v1/status`.
#[derive(Debug, Clone, Serialize)]
pub struct ActorHealth {
    /// Running, done, failed or unreachable.
    pub health: Health,
    /// Why, when not running.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub detail: Option<String>,
}

/// Throughput over the last minute of status calls (since start on the first call).
#[derive(Debug, Clone, Default, Serialize)]
pub struct Rates {
    /// Seconds the rates below are measured over.
    pub window_seconds: f64,
    /// Training steps per minute.
    pub steps_per_minute: f64,
    /// Rollouts trained per second.
    pub trained_samples_per_second: f64,
    /// Completion tokens trained per second.
    pub trained_tokens_per_second: f64,
    /// Tokens decoded per second, all engine replicas together.
    pub generated_tokens_per_second: f64,
    /// Busy fraction of the engine replicas over the window.
    pub engine_busy_ratio: f64,
    /// Fraction of its lifetime the trainer waited for data (since start).
    pub trainer_idle_ratio: f64,
    /// Mean version lag of trained tokens (since start).
    pub mean_version_lag: f64,
}

/// What `GET /v1/status` answers. Parts whose actor did not answer are `null`; `actors` says why.
#[derive(Debug, Clone, Serialize)]
pub struct StatusReport {
    /// Sluice's version.
    pub sluice_version: &'static str,
    /// Seconds since the admin API started (with the node).
    pub uptime_seconds: f64,
    /// Version of the weights the next training step starts from.
    pub policy_version: u64,
    /// Training steps taken.
    pub step: u64,
    /// The `paused` knob.
    pub paused: bool,
    /// Groups per replay bucket.
    pub buckets: Option<sluice_replay::BucketCounts>,
    /// Throughput.
    pub rates: Rates,
    /// Every knob's value.
    pub knobs: Knobs,
    /// Health of each actor the API can reach.
    pub actors: BTreeMap<&'static str, ActorHealth>,
    /// The controller's view.
    pub controller: Option<ControllerStatus>,
    /// The trainer's view.
    pub trainer: TrainerStatus,
    /// The replay store's buckets and counters.
    pub replay: Option<StoreSnapshot>,
    /// Each engine replica.
    pub engines: Option<Vec<EngineStats>>,
    /// A head's joined engine and env nodes (absent on other nodes).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub nodes: Option<Vec<crate::cluster::NodeView>>,
    /// The newest evaluation of a real-model run (absent until one ran).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub evaluation: Option<crate::handles::EvalStatus>,
}

/// Counters the rates are differences of.
#[derive(Debug, Clone, Copy, Default)]
struct Totals {
    steps: u64,
    trained_samples: u64,
    trained_tokens: u64,
    generated_tokens: u64,
    busy_seconds: f64,
    engine_seconds: f64,
}

/// Recent observations, at most a minute old and [`RateWindow::CAP`] long.
#[derive(Debug, Default)]
pub(super) struct RateWindow {
    seen: VecDeque<(Instant, Totals)>,
}

impl RateWindow {
    const SPAN: Duration = Duration::from_secs(60);
    const CAP: usize = 64;

    /// Records `now` and returns the baseline to difference against: the oldest observation at
    /// least a second old, else the start (all zeros).
    fn observe(&mut self, now: Instant, totals: Totals, started: Instant) -> (Instant, Totals) {
        while self
            .seen
            .front()
            .is_some_and(|(t, _)| now.duration_since(*t) > Self::SPAN)
            || self.seen.len() >= Self::CAP
        {
            self.seen.pop_front();
        }
        let baseline = match self.seen.front() {
            Some(&(t, old)) if now.duration_since(t) >= Duration::from_secs(1) => (t, old),
            _ => (started, Totals::default()),
        };
        self.seen.push_back((now, totals));
        baseline
    }
}

fn rates(now: (Instant, Totals), then: (Instant, Totals), trainer: &TrainerStatus) -> Rates {
    let secs = now.0.duration_since(then.0).as_secs_f64().max(1e-9);
    let (a, b) = (now.1, then.1);
    let per_s = |x: u64, y: u64| x.saturating_sub(y) as f64 / secs;
    let engine_seconds = a.engine_seconds - b.engine_seconds;
    Rates {
        window_seconds: secs,
        steps_per_minute: per_s(a.steps, b.steps) * 60.0,
        trained_samples_per_second: per_s(a.trained_samples, b.trained_samples),
        trained_tokens_per_second: per_s(a.trained_tokens, b.trained_tokens),
        generated_tokens_per_second: per_s(a.generated_tokens, b.generated_tokens),
        engine_busy_ratio: if engine_seconds > 0.0 {
            ((a.busy_seconds - b.busy_seconds) / engine_seconds).clamp(0.0, 1.0)
        } else {
            0.0
        },
        trainer_idle_ratio: trainer.idle_ratio(),
        mean_version_lag: trainer.mean_lag(),
    }
}

/// Awaits an actor call with the status timeout.
async fn ask<T>(fut: impl Future<Output = Result<T, ActorError>>) -> Result<T, String> {
    match tokio::time::timeout(ACTOR_CALL_TIMEOUT, fut).await {
        Ok(Ok(v)) => Ok(v),
        Ok(Err(e)) => Err(e.to_string()),
        Err(_) => Err(format!("no answer within {ACTOR_CALL_TIMEOUT:?}")),
    }
}

fn health<T>(r: &Result<T, String>) -> ActorHealth {
    match r {
        Ok(_) => ActorHealth {
            health: Health::Running,
            detail: None,
        },
        Err(e) => ActorHealth {
            health: Health::Unreachable,
            detail: Some(e.clone()),
        },
    }
}

/// Gathers every actor's view; an actor that does not answer is reported, not fatal. `started`
/// is when the API started; `window` keeps recent observations for the rates.
pub(super) async fn status_report(
    admin: &AdminState,
    started: Instant,
    window: &Mutex<RateWindow>,
) -> StatusReport {
    let node = &admin.node;
    let (controller, replay, engines, engine_failure) = tokio::join!(
        ask(node.controller.status()),
        ask(node.replay.status()),
        ask(node.engine.stats()),
        ask(node.engine.failure()),
    );
    let trainer = node.trainer.status();
    let knobs = node.knobs.current();
    let now = Instant::now();
    let engine_list = engines.as_ref().map(Vec::as_slice).unwrap_or_default();
    let totals = Totals {
        steps: trainer.steps,
        trained_samples: trainer.trained_samples,
        trained_tokens: trainer.trained_tokens,
        generated_tokens: engine_list.iter().map(|e| e.generated_tokens).sum(),
        busy_seconds: engine_list.iter().map(|e| e.busy_seconds).sum(),
        engine_seconds: engine_list.iter().map(|e| e.uptime_seconds).sum(),
    };
    let baseline = window
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .observe(now, totals, started);
    let trainer_health = match (&trainer.error, trainer.done) {
        (Some(e), _) => ActorHealth {
            health: Health::Failed,
            detail: Some(e.clone()),
        },
        (None, true) => ActorHealth {
            health: Health::Done,
            detail: None,
        },
        (None, false) => ActorHealth {
            health: Health::Running,
            detail: None,
        },
    };
    let actors = [
        ("controller", health(&controller)),
        ("replay", health(&replay)),
        (
            "engine",
            match engine_failure {
                // Gave up serving: the run is stopping, whatever the replicas' stats say.
                Ok(Some(reason)) => ActorHealth {
                    health: Health::Failed,
                    detail: Some(reason),
                },
                _ => health(&engines),
            },
        ),
        ("trainer", trainer_health),
    ]
    .into_iter()
    .collect();
    let replay = replay.ok().map(|r| r.store);
    StatusReport {
        sluice_version: env!("CARGO_PKG_VERSION"),
        uptime_seconds: now.duration_since(started).as_secs_f64(),
        policy_version: trainer.version.0,
        step: trainer.steps,
        paused: knobs.paused,
        buckets: replay.as_ref().map(|r| r.buckets.clone()),
        rates: rates((now, totals), baseline, &trainer),
        knobs,
        actors,
        controller: controller.ok(),
        trainer,
        replay,
        engines: engines.ok(),
        nodes: admin.cluster.as_ref().map(|c| c.registry.list()),
        evaluation: node.evaluation(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_rate_window_differences_against_a_second_old_baseline() {
        let start = Instant::now();
        let mut w = RateWindow::default();
        let t = |steps| Totals {
            steps,
            ..Totals::default()
        };
        let (base, _) = w.observe(start + Duration::from_millis(500), t(1), start);
        assert_eq!(base, start, "first call: since start");
        let (base, old) = w.observe(start + Duration::from_secs(3), t(5), start);
        assert_eq!((base, old.steps), (start + Duration::from_millis(500), 1));
        let (base, _) = w.observe(start + Duration::from_secs(120), t(9), start);
        assert_eq!(base, start, "observations older than a minute are dropped");
        for i in 0..200 {
            w.observe(
                start + Duration::from_secs(121) + Duration::from_millis(i),
                t(9),
                start,
            );
        }
        assert!(w.seen.len() <= RateWindow::CAP);
    }
}
