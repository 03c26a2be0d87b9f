//! Engine replica supervision with stub backends: a replica whose calls fail, or that holds
//! requests without progress, is rebuilt after a backoff; its requests come back aborted with the
//! partial they were resumed from; requests that arrive while no replica is alive wait for one;
//! after `close`, every request is answered as aborted at once; a factory that fails is retried,
//! and a rebuilt replica starts on the newest weights the engine kept.
//!
//! Time is paused: the backoffs and the watchdog run on tokio's clock (the engine actor reads
//! `tokio::time::Instant`), so the runtime jumps to the next timer whenever every task waits, and
//! the tests wait on what the stubs record, never on the wall clock.

use crate::common;

use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use sluice_actors::engine::{
    BackendFactory, EngineHandle, EngineReport, EngineSupervision, ReplicaFactory,
};
use sluice_core::{
    GroupId, NodeId, PolicyVersion, RequestId, RunId, WeightSnapshot, WeightUpdateMode,
};
use sluice_engine::{
    EngineError, EngineStats, FinishReason, GenerateRequest, InferenceBackend, SamplingParams,
    TokenOutput,
};
use tokio::time::Instant;

use common::Recorded;

/// What a stub replica does with a submission.
#[derive(Clone, Copy, PartialEq)]
enum Mode {
    /// Accepts and never answers (its stats never move).
    Silent,
    /// Refuses every call after the first submission.
    FailAfterOne,
}

struct Stub {
    mode: Mode,
    submitted: AtomicU32,
    log: Log,
    replica: u32,
    incarnation: u32,
}

impl InferenceBackend for Stub {
    fn submit(&self, request: GenerateRequest) -> Result<(), EngineError> {
        let n = self.submitted.fetch_add(1, Ordering::SeqCst);
        if self.mode == Mode::FailAfterOne && n >= 1 {
            return Err(EngineError::Stopped {
                backend: "stub".into(),
            });
        }
        self.log.push((self.replica, self.incarnation, request.id));
        Ok(())
    }
    fn abort(&self, _id: RequestId) -> Result<(), EngineError> {
        Ok(())
    }
    fn abort_all(&self) -> Result<(), EngineError> {
        Ok(())
    }
    fn update_weights(&self, _w: WeightSnapshot, _m: WeightUpdateMode) -> Result<(), EngineError> {
        Ok(())
    }
    fn stats(&self) -> EngineStats {
        EngineStats::default()
    }
    fn shutdown(&mut self) {}
    fn is_alive(&self) -> bool {
        true
    }
    fn server_gone(&self) -> Option<String> {
        None
    }
}

/// (replica, incarnation, request) for every submission a stub accepted.
type Log = Arc<Recorded<(u32, u32, RequestId)>>;
type Reports = Arc<Recorded<EngineReport>>;
/// The incarnation of every stub built.
type Builds = Arc<Recorded<u32>>;

fn factory(mode: Mode, log: Log, builds: Builds) -> BackendFactory {
    let incarnations = Arc::new(AtomicU32::new(0));
    Arc::new(move |replica, _v, _sink| {
        let incarnation = incarnations.fetch_add(1, Ordering::SeqCst);
        builds.push(incarnation);
        Box::new(Stub {
            mode,
            submitted: AtomicU32::new(0),
            log: Arc::clone(&log),
            replica,
            incarnation,
        }) as Box<dyn InferenceBackend>
    })
}

fn request(counter: u64, resumed_tokens: usize) -> GenerateRequest {
    let resume = (resumed_tokens > 0).then(|| TokenOutput {
        token_ids: vec![7; resumed_tokens],
        logprobs: vec![-0.5; resumed_tokens],
        versions: vec![PolicyVersion(0); resumed_tokens],
    });
    GenerateRequest {
        id: GroupId {
            run: RunId::from_name("r"),
            node: NodeId(0),
            counter,
        }
        .rollout(0)
        .request(0, 0),
        prompt_token_ids: vec![1, 2],
        resume,
        params: SamplingParams {
            temperature: 1.0,
            top_p: 1.0,
            top_k: 0,
            max_tokens: 64,
            seed: None,
            stop_token_ids: vec![],
        },
        domain: None,
    }
}

fn aborted(reports: &[EngineReport]) -> Vec<(RequestId, usize)> {
    reports
        .iter()
        .filter_map(|r| match r {
            EngineReport::Finished { completion, .. }
                if completion.finish == FinishReason::Abort =>
            {
                Some((completion.id, completion.output.len()))
            }
            _ => None,
        })
        .collect()
}

struct Spawned {
    engine: EngineHandle,
    log: Log,
    reports: Reports,
    builds: Builds,
    join: tokio::task::JoinHandle<()>,
}

async fn spawn(mode: Mode, sup: EngineSupervision) -> Spawned {
    let log: Log = Arc::default();
    let reports: Reports = Arc::default();
    let builds: Builds = Arc::default();
    let sink = Arc::clone(&reports);
    let (engine, join) = EngineHandle::spawn_supervised(
        1,
        PolicyVersion(0),
        factory(mode, Arc::clone(&log), Arc::clone(&builds)),
        Arc::new(move |r| sink.push(r)),
        sup,
    )
    .await
    .unwrap();
    Spawned {
        engine,
        log,
        reports,
        builds,
        join,
    }
}

#[tokio::test(start_paused = true)]
async fn a_failing_replica_returns_its_partials_waits_out_the_backoff_and_comes_back() {
    let sup = EngineSupervision {
        backoff_initial: Duration::from_millis(150),
        backoff_max: Duration::from_secs(1),
        ..EngineSupervision::default()
    };
    let Spawned {
        engine,
        log,
        reports,
        join,
        ..
    } = spawn(Mode::FailAfterOne, sup).await;
    engine.generate(request(1, 5), None); // accepted
    engine.generate(request(2, 0), None); // refused: the replica fails
    reports
        .until("both requests back as aborted", |r| aborted(r).len() == 2)
        .await;
    let mut back = aborted(&reports.lock());
    back.sort();
    assert_eq!(back[0].1, 5, "the resumed request keeps its partial");
    assert_eq!(back[1].1, 0);
    let health = engine.health().await.unwrap();
    assert!(!health[0].alive, "waiting out the backoff");
    assert_eq!(health[0].failures.get("error"), Some(&1));
    // Sent while no replica is alive: it waits, then goes to the rebuilt replica.
    engine.generate(request(3, 0), None);
    log.until("the restart", |l| l.iter().any(|(_, inc, _)| *inc == 1))
        .await;
    let health = engine.health().await.unwrap();
    assert!(health[0].alive);
    assert_eq!(health[0].restarts, 1);
    assert!(
        health[0].last_restart_seconds.unwrap() >= 0.14,
        "{health:?}"
    );
    assert_eq!(log.lock().last().unwrap().2, request(3, 0).id);
    assert_eq!(
        aborted(&reports.lock()).len(),
        2,
        "the waiting request was not aborted"
    );
    engine.stop().await;
    join.await.unwrap();
}

#[tokio::test(start_paused = true)]
async fn the_watchdog_fails_a_replica_that_holds_requests_without_progress() {
    let sup = EngineSupervision {
        backoff_initial: Duration::from_millis(1),
        backoff_max: Duration::from_millis(10),
        watchdog: Some(Duration::from_millis(200)),
        ..EngineSupervision::default()
    };
    let Spawned {
        engine,
        log,
        reports,
        builds,
        join,
    } = spawn(Mode::Silent, sup).await;
    // Idle time never counts: twice the limit passes on the engine's clock (time is paused,
    // so this costs no wall time and the watchdog's ticks all run).
    tokio::time::sleep(Duration::from_millis(400)).await;
    assert_eq!(engine.health().await.unwrap()[0].failures.len(), 0);
    let asked = Instant::now();
    engine.generate(request(1, 3), None);
    reports
        .until("the watchdog", |r| aborted(r).len() == 1)
        .await;
    assert!(asked.elapsed() >= Duration::from_millis(200));
    assert_eq!(aborted(&reports.lock())[0].1, 3);
    builds.until("the rebuild", |b| b.len() == 2).await;
    let health = engine.health().await.unwrap();
    assert_eq!(health[0].restarts, 1, "{health:?}");
    assert_eq!(health[0].failures.get("watchdog"), Some(&1));
    assert_eq!(log.lock().len(), 1);
    engine.stop().await;
    join.await.unwrap();
}

#[tokio::test(start_paused = true)]
async fn after_close_every_request_is_answered_as_aborted() {
    let Spawned {
        engine,
        log,
        reports,
        join,
        ..
    } = spawn(Mode::Silent, EngineSupervision::default()).await;
    engine.close().await.unwrap();
    engine.generate(request(1, 4), None);
    reports
        .until("the refusal", |r| aborted(r).len() == 1)
        .await;
    assert_eq!(
        aborted(&reports.lock())[0].1,
        4,
        "the partial comes back as it was"
    );
    assert!(log.lock().is_empty(), "nothing reached a backend");
    engine.stop().await;
    join.await.unwrap();
}

/// A factory that fails its first `failures` builds, recording the version of the weights every
/// build was given.
fn flaky_factory(
    failures: u32,
    log: Log,
    built_on: Arc<Recorded<PolicyVersion>>,
) -> ReplicaFactory {
    let calls = Arc::new(AtomicU32::new(0));
    ReplicaFactory::new(move |replica, weights, _sink| {
        built_on.push(weights.version);
        let n = calls.fetch_add(1, Ordering::SeqCst);
        if n < failures {
            return Err(EngineError::Start {
                replica,
                reason: format!("build {n} refused"),
            });
        }
        Ok(Box::new(Stub {
            mode: Mode::FailAfterOne,
            submitted: AtomicU32::new(0),
            log: Arc::clone(&log),
            replica,
            incarnation: n,
        }) as Box<dyn InferenceBackend>)
    })
}

#[tokio::test(start_paused = true)]
async fn a_factory_that_fails_is_retried_and_a_rebuilt_replica_starts_on_the_latest_weights() {
    let log: Log = Arc::default();
    let built_on: Arc<Recorded<PolicyVersion>> = Arc::default();
    let reports: Reports = Arc::default();
    let sink = Arc::clone(&reports);
    let (engine, join) = EngineHandle::spawn_supervised(
        1,
        PolicyVersion(3),
        flaky_factory(2, Arc::clone(&log), Arc::clone(&built_on)),
        Arc::new(move |r| sink.push(r)),
        EngineSupervision {
            backoff_initial: Duration::from_millis(20),
            backoff_max: Duration::from_millis(100),
            ..EngineSupervision::default()
        },
    )
    .await
    .unwrap();
    // Nothing alive: the request waits at the engine (it is neither failed nor aborted) and is
    // served once a build succeeds.
    engine.generate(request(1, 0), None);
    log.until("the third build serves the parked request", |l| {
        l.len() == 1
    })
    .await;
    assert!(aborted(&reports.lock()).is_empty());
    let health = engine.health().await.unwrap();
    assert!(health[0].alive);
    assert_eq!(health[0].failures.get("start"), Some(&2));
    assert_eq!(
        health[0].restarts, 1,
        "only the build that worked counts as a restart"
    );
    // New weights, then the replica fails (its second submission is refused): it is rebuilt on
    // the newest weights, which the engine actor kept.
    engine.update_weights(
        WeightSnapshot::version_only(PolicyVersion(4)),
        WeightUpdateMode::InFlight,
    );
    engine.generate(request(2, 0), None);
    built_on
        .until("the rebuild after the failure", |b| b.len() == 4)
        .await;
    assert_eq!(
        *built_on.lock(),
        vec![
            PolicyVersion(3),
            PolicyVersion(3),
            PolicyVersion(3),
            PolicyVersion(4)
        ]
    );
    engine.stop().await;
    join.await.unwrap();
}
