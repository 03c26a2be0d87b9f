//! The simulated engine's contract: honest aborts with partials, resume continues to the same
//! length, `in_flight` tags later tokens with the new version, `drain` never lets a request span
//! two versions.
//!
//! The engine decodes on its own thread: the tests block on its events (a condition variable
//! the sink notifies) and, for its counters, which announce nothing, re-read its stats.

use std::collections::BTreeMap;
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use sluice_core::config::LengthDistribution;
use sluice_core::{
    GroupId, NodeId, PolicyVersion, RequestId, RunId, WeightSnapshot, WeightUpdateMode,
};
use sluice_engine::config::SimEngineConfig;
use sluice_engine::simulated::SimEngineParams;
use sluice_engine::{
    Completion, EngineEvent, EngineStats, FinishReason, GenerateRequest, InferenceBackend,
    SamplingParams, SimEngine,
};

fn params(tokens: u32, time_scale: f64) -> SimEngineParams {
    SimEngineParams {
        replica: 0,
        max_running_sequences: 4,
        sim: SimEngineConfig {
            time_scale,
            prefill_seconds_per_token: 0.0,
            decode_step_base_seconds: 0.001,
            decode_step_per_sequence_seconds: 0.0,
            prompt_tokens: std::num::NonZeroU32::new(4).unwrap(),
            env_reply_tokens: 0,
            lengths: BTreeMap::from([("default".to_owned(), LengthDistribution::Fixed { tokens })]),
            seed: 1,
        },
    }
}

fn req_id(counter: u64, attempt: u32) -> RequestId {
    GroupId {
        run: RunId::from_name("e"),
        node: NodeId(0),
        counter,
    }
    .rollout(0)
    .request(0, attempt)
}

fn request(id: RequestId, resume: Option<sluice_engine::TokenOutput>) -> GenerateRequest {
    GenerateRequest {
        id,
        prompt_token_ids: vec![1, 2, 3],
        resume,
        params: SamplingParams {
            temperature: 1.0,
            top_p: 1.0,
            top_k: 0,
            max_tokens: 1000,
            seed: None,
            stop_token_ids: vec![],
        },
        domain: None,
    }
}

/// How long a test waits for the engine (robust to a slow, shared CPU).
const PATIENCE: Duration = Duration::from_secs(10);

/// The engine's events as its sink delivered them; the sink notifies `arrived`.
#[derive(Default)]
struct Recorded {
    list: Mutex<Vec<EngineEvent>>,
    arrived: Condvar,
}

type Events = Arc<Recorded>;

impl Recorded {
    /// Blocks until `ok` holds for the events so far, or [`PATIENCE`] passes; returns them.
    fn wait(&self, mut ok: impl FnMut(&[EngineEvent]) -> bool) -> Vec<EngineEvent> {
        let list = self.list.lock().unwrap();
        let (list, _) = self
            .arrived
            .wait_timeout_while(list, PATIENCE, |l| !ok(l))
            .unwrap();
        list.clone()
    }
}

fn start(p: SimEngineParams) -> (SimEngine, Events) {
    let events: Events = Arc::default();
    let sink = Arc::clone(&events);
    let engine = SimEngine::start(
        p,
        PolicyVersion(0),
        Arc::new(move |e| {
            sink.list.lock().unwrap().push(e);
            sink.arrived.notify_all();
        }),
    );
    (engine, events)
}

/// Re-reads `engine`'s stats until `ok` holds for them, or [`PATIENCE`] passes; returns the
/// last. The stats announce nothing, so this is the one place the tests poll.
fn wait_stats(engine: &SimEngine, mut ok: impl FnMut(&EngineStats) -> bool) -> EngineStats {
    let deadline = Instant::now() + PATIENCE;
    loop {
        let stats = engine.stats();
        if ok(&stats) || Instant::now() > deadline {
            return stats;
        }
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// Waits until the engine has decoded at least `n` tokens.
fn wait_tokens(engine: &SimEngine, n: u64) {
    wait_stats(engine, |s| s.generated_tokens >= n);
}

fn finished(events: &[EngineEvent]) -> Vec<Completion> {
    events
        .iter()
        .filter_map(|e| match e {
            EngineEvent::Finished(c) => Some(c.clone()),
            _ => None,
        })
        .collect()
}

/// Waits until `n` requests finished (or [`PATIENCE`] passed); returns those that did.
fn wait_finished(events: &Events, n: usize) -> Vec<Completion> {
    finished(&events.wait(|e| finished(e).len() >= n))
}

#[test]
fn abort_returns_the_partial_and_resume_reaches_the_same_length() {
    let (mut engine, events) = start(params(200, 1.0));
    engine.submit(request(req_id(0, 0), None)).unwrap();
    wait_tokens(&engine, 5);
    engine.abort(req_id(0, 0)).unwrap();
    let done = wait_finished(&events, 1);
    assert_eq!(done[0].finish, FinishReason::Abort);
    let partial = done[0].output.clone();
    assert!(
        !partial.is_empty() && partial.len() < 200,
        "partial of {} tokens",
        partial.len()
    );
    engine
        .update_weights(
            WeightSnapshot::version_only(PolicyVersion(1)),
            WeightUpdateMode::AbortResume,
        )
        .unwrap();
    engine
        .submit(request(req_id(0, 1), Some(partial.clone())))
        .unwrap();
    let done = wait_finished(&events, 2);
    let whole = &done[1].output;
    assert_eq!(done[1].finish, FinishReason::Stop);
    assert_eq!(
        whole.len(),
        200,
        "a fixed-length turn resumes to the same length"
    );
    assert_eq!(
        &whole.token_ids[..partial.len()],
        &partial.token_ids[..],
        "partial first"
    );
    assert_eq!(
        &whole.versions[..partial.len()],
        &partial.versions[..],
        "versions kept"
    );
    assert!(
        whole.versions[partial.len()..]
            .iter()
            .all(|v| *v == PolicyVersion(1))
    );
    engine.shutdown();
}

#[test]
fn in_flight_swap_tags_later_tokens_with_the_new_version() {
    let (mut engine, events) = start(params(300, 1.0));
    engine.submit(request(req_id(1, 0), None)).unwrap();
    wait_tokens(&engine, 5);
    engine
        .update_weights(
            WeightSnapshot::version_only(PolicyVersion(1)),
            WeightUpdateMode::InFlight,
        )
        .unwrap();
    let done = wait_finished(&events, 1);
    let v = &done[0].output.versions;
    assert_eq!(done[0].finish, FinishReason::Stop, "not aborted");
    let first_new = v
        .iter()
        .position(|x| *x == PolicyVersion(1))
        .expect("some tokens after the swap");
    assert!(first_new > 0, "some tokens before the swap");
    assert!(
        v[first_new..].iter().all(|x| *x == PolicyVersion(1)),
        "every later token is v1"
    );
    engine.shutdown();
}

#[test]
fn drain_never_lets_a_request_span_two_versions() {
    let (mut engine, events) = start(params(60, 1.0));
    for c in 0..8 {
        engine.submit(request(req_id(10 + c, 0), None)).unwrap();
    }
    // The first four are decoding, the others queued, when the drain comes.
    wait_tokens(&engine, 1);
    engine
        .update_weights(
            WeightSnapshot::version_only(PolicyVersion(1)),
            WeightUpdateMode::Drain,
        )
        .unwrap();
    let done = wait_finished(&events, 8);
    assert_eq!(done.len(), 8);
    let mut saw_new = false;
    for c in &done {
        assert_eq!(c.finish, FinishReason::Stop);
        let first = c.output.versions[0];
        assert!(
            c.output.versions.iter().all(|v| *v == first),
            "{} spans versions",
            c.id
        );
        saw_new |= first == PolicyVersion(1);
    }
    assert!(
        saw_new,
        "requests queued behind the drain ran on the new weights"
    );
    engine.shutdown();
}

/// Once every request finished, `running` and `waiting` read 0 (they kept the last step's
/// counts while the engine idled, feeding `sluice_engine_running_sequences` and `sluice status`).
#[test]
fn running_and_waiting_return_to_zero_when_idle() {
    let (mut engine, events) = start(params(3, 0.01));
    for counter in 0..6 {
        engine.submit(request(req_id(counter, 0), None)).unwrap();
    }
    assert_eq!(wait_finished(&events, 6).len(), 6);
    let stats = wait_stats(&engine, |s| (s.running, s.waiting) == (0, 0));
    assert_eq!((stats.running, stats.waiting), (0, 0), "{stats:?}");
    // Every token of the six 3-token completions, the last of each too (it used to count 2).
    assert_eq!(stats.generated_tokens, 6 * 3, "{stats:?}");
    engine.shutdown();
}

#[test]
fn pause_holds_requests_until_continue_and_pause_with_abort_returns_partials() {
    // Paused before the request arrives: it waits in the queue, nothing is generated.
    let (mut engine, events) = start(params(20, 1.0));
    engine.pause(false).unwrap();
    engine.submit(request(req_id(0, 0), None)).unwrap();
    engine
        .update_weights(
            WeightSnapshot::version_only(PolicyVersion(1)),
            WeightUpdateMode::InFlight,
        )
        .unwrap();
    // The swap made while paused is reported at once (no step is coming), before any token.
    events.wait(|e| {
        e.iter()
            .any(|e| matches!(e, EngineEvent::WeightsUpdated { .. }))
    });
    assert_eq!(engine.stats().generated_tokens, 0);
    assert_eq!(engine.stats().waiting, 1);
    engine.continue_generation().unwrap();
    let done = wait_finished(&events, 1);
    assert_eq!(done[0].finish, FinishReason::Stop);
    assert_eq!(done[0].output.len(), 20);
    assert!(
        done[0]
            .output
            .versions
            .iter()
            .all(|v| *v == PolicyVersion(1))
    );
    engine.shutdown();

    // Pause with abort: the running request comes back with its partial.
    let (mut engine, events) = start(params(1000, 1.0));
    engine.submit(request(req_id(1, 0), None)).unwrap();
    wait_tokens(&engine, 3);
    engine.pause(true).unwrap();
    let done = wait_finished(&events, 1);
    assert_eq!(done[0].finish, FinishReason::Abort);
    assert!(done[0].output.len() >= 3 && done[0].output.len() < 1000);
    engine.shutdown();
}
