//! The native engine's contract on the tiny preset: batching does not change greedy outputs,
//! seeds reproduce, aborts return the partial at the next step boundary, resume continues
//! exactly, `in_flight` swaps tag and use the new weights, `drain` never mixes versions.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crossbeam_channel::Receiver;
use sluice_core::{GroupId, NodeId, PolicyVersion, RequestId, RunId, WeightUpdateMode};
use sluice_engine::native::{NativeControl, RequestUpdate};
use sluice_engine::{
    Completion, EngineEvent, FinishReason, GenerateRequest, InferenceBackend, NativeEngine,
    NativeEngineParams, NativeRequest, SamplingParams, TokenOutput,
};
use sluice_model::candle::{DType, Device};
use sluice_model::presets::{Preset, preset_config, random_snapshot};
use sluice_model::{ContiguousKvCache, InferenceModel, LogitsWanted, ModelWeights, StepInput};

fn weights(seed: u64, version: u64) -> Arc<ModelWeights> {
    let config = Arc::new(preset_config(Preset::Tiny));
    let w = random_snapshot(config, seed, DType::F32, &Device::Cpu).unwrap();
    Arc::new(w.with_version(PolicyVersion(version)))
}

struct Harness {
    engine: NativeEngine,
    finished: Receiver<Completion>,
    updates: Receiver<(PolicyVersion, Duration, WeightUpdateMode)>,
}

fn start(w: Arc<ModelWeights>, max_running: usize, max_step_tokens: usize) -> Harness {
    let (ftx, finished) = crossbeam_channel::unbounded();
    let (utx, updates) = crossbeam_channel::unbounded();
    let params = NativeEngineParams {
        max_running_sequences: max_running,
        max_step_tokens,
        seed: 5,
        ..NativeEngineParams::default()
    };
    let engine = NativeEngine::start(
        params,
        w,
        None,
        Arc::new(move |e| match e {
            EngineEvent::Finished(c) => {
                let _ = ftx.send(c);
            }
            EngineEvent::WeightsUpdated {
                version,
                pause,
                mode,
            } => {
                let _ = utx.send((version, pause, mode));
            }
        }),
    )
    .unwrap();
    Harness {
        engine,
        finished,
        updates,
    }
}

fn id(counter: u64) -> RequestId {
    GroupId {
        run: RunId::from_name("native"),
        node: NodeId(0),
        counter,
    }
    .rollout(0)
    .request(0, 0)
}

fn prompt(i: u64) -> Vec<u32> {
    (0..(3 + i % 5))
        .map(|j| ((i * 7 + j * 3) % 90) as u32)
        .collect()
}

fn request(counter: u64, temperature: f64, max_tokens: u32, seed: Option<u64>) -> NativeRequest {
    NativeRequest {
        ignore_eos: true,
        ..NativeRequest::plain(GenerateRequest {
            id: id(counter),
            prompt_token_ids: prompt(counter),
            resume: None,
            params: SamplingParams {
                temperature,
                top_p: 1.0,
                top_k: 0,
                max_tokens,
                seed,
                stop_token_ids: vec![],
            },
            domain: None,
        })
    }
}

fn wait(h: &Harness, n: usize) -> Vec<Completion> {
    let mut out: Vec<Completion> = (0..n)
        .map(|_| {
            h.finished
                .recv_timeout(Duration::from_secs(30))
                .expect("a completion")
        })
        .collect();
    out.sort_by_key(|c| c.id.rollout.group.counter);
    out
}

fn run_each(w: &Arc<ModelWeights>, reqs: Vec<NativeRequest>) -> Vec<Completion> {
    let h = start(Arc::clone(w), 1, 4096);
    reqs.into_iter()
        .map(|r| {
            h.engine.submit_native(r).unwrap();
            wait(&h, 1).remove(0)
        })
        .collect()
}

#[test]
fn greedy_batched_equals_one_at_a_time() {
    let w = weights(0, 0);
    let reqs: Vec<NativeRequest> = (0..6).map(|i| request(i, 0.0, 10, None)).collect();
    // Batch of 4 with a small step budget: prompts are chunked and mixed with decodes.
    let h = start(Arc::clone(&w), 4, 6);
    for r in reqs.clone() {
        h.engine.submit_native(r).unwrap();
    }
    let batched = wait(&h, 6);
    let single = run_each(&w, reqs);
    for (b, s) in batched.iter().zip(&single) {
        assert_eq!(b.output.token_ids, s.output.token_ids, "{}", b.id);
        assert_eq!(b.output.len(), 10);
        assert_eq!(b.finish, FinishReason::Length);
        for (x, y) in b.output.logprobs.iter().zip(&s.output.logprobs) {
            assert!((x - y).abs() < 1e-4 && *x <= 0.0, "{x} vs {y}");
        }
    }
}

#[test]
fn seeded_sampling_reproduces_and_seeds_matter() {
    let w = weights(0, 0);
    let run = |seed: u64| {
        let h = start(Arc::clone(&w), 8, 4096);
        for i in 0..3 {
            h.engine
                .submit_native(request(i, 1.5, 24, Some(seed)))
                .unwrap();
        }
        wait(&h, 3)
    };
    let (a, b, c) = (run(7), run(7), run(8));
    for i in 0..3 {
        assert_eq!(a[i].output.token_ids, b[i].output.token_ids);
    }
    assert!((0..3).any(|i| a[i].output.token_ids != c[i].output.token_ids));
}

/// A request whose observer aborts it (from the compute thread) after `after` tokens.
fn aborting_request(control: NativeControl, counter: u64, after: usize) -> NativeRequest {
    let seen = Arc::new(Mutex::new(0usize));
    let mut r = request(counter, 0.0, 40, None);
    r.observer = Some(Arc::new(move |u| {
        if let RequestUpdate::Token(_) = u {
            let mut n = seen.lock().unwrap();
            *n += 1;
            if *n == after {
                control.abort(id(counter)).unwrap();
            }
        }
    }));
    r
}

#[test]
fn abort_returns_the_partial_at_the_next_step_and_resume_continues_exactly() {
    let w = weights(0, 0);
    let full = run_each(&w, vec![request(1, 0.0, 40, None)]).remove(0);
    let h = start(Arc::clone(&w), 4, 4096);
    // A second request keeps the batch busy, so steps keep coming after the abort is queued.
    h.engine.submit_native(request(2, 0.0, 40, None)).unwrap();
    h.engine
        .submit_native(aborting_request(h.engine.control(), 1, 7))
        .unwrap();
    let partial = h.finished.recv_timeout(Duration::from_secs(30)).unwrap();
    assert_eq!(partial.id, id(1));
    assert_eq!(partial.finish, FinishReason::Abort);
    // Queued after token 7 and applied before the next step: exactly 7 tokens.
    assert_eq!(partial.output.len(), 7);
    assert_eq!(partial.output.token_ids, full.output.token_ids[..7]);
    wait(&h, 1);

    let mut resumed = request(1, 0.0, 40, None);
    resumed.request.resume = Some(partial.output.clone());
    h.engine.submit_native(resumed).unwrap();
    let done = wait(&h, 1).remove(0);
    assert_eq!(done.finish, FinishReason::Length);
    assert_eq!(done.output.token_ids, full.output.token_ids);
    assert_eq!(done.output.logprobs[..7], partial.output.logprobs[..]);
    for (x, y) in done.output.logprobs.iter().zip(&full.output.logprobs) {
        assert!((x - y).abs() < 1e-4);
    }
}

#[test]
fn abort_all_and_unknown_ids() {
    let w = weights(0, 0);
    let h = start(Arc::clone(&w), 1, 4096);
    for i in 0..3 {
        h.engine.submit_native(request(i, 0.0, 4000, None)).unwrap();
    }
    h.engine.abort(id(99)).unwrap();
    h.engine.abort_all().unwrap();
    let out = wait(&h, 3);
    assert!(out.iter().all(|c| c.finish == FinishReason::Abort));
    // Only one could be running: the two waiting ones have no tokens.
    assert!(out.iter().filter(|c| c.output.is_empty()).count() >= 2);
}

/// Greedy reference on a bare model: token `i` comes from the weights its version names.
fn replay_greedy(
    prompt: &[u32],
    out: &TokenOutput,
    old: &Arc<ModelWeights>,
    new: &Arc<ModelWeights>,
) {
    let mut model = InferenceModel::new(Arc::clone(old)).unwrap();
    let mut cache = ContiguousKvCache::new(model.config(), DType::F32, &Device::Cpu);
    for i in 0..out.len() {
        if out.versions[i] == new.version && model.version() != new.version {
            model.swap_weights(Arc::clone(new)).unwrap();
        }
        let feed: Vec<u32> = if i == 0 {
            prompt.to_vec()
        } else {
            vec![out.token_ids[i - 1]]
        };
        let logits = model
            .step(
                &mut cache,
                &[StepInput {
                    seq: 0,
                    tokens: &feed,
                }],
                LogitsWanted::Last,
            )
            .unwrap();
        let best = sluice_model::argmax_rows(&logits).unwrap()[0];
        assert_eq!(best, out.token_ids[i], "token {i}");
        let row = logits.to_vec2::<f32>().unwrap().remove(0);
        let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let z = row.iter().map(|x| (x - max).exp()).sum::<f32>().ln() + max;
        let lp = row[best as usize] - z;
        assert!(
            (lp - out.logprobs[i]).abs() < 1e-4,
            "token {i}: {lp} vs {}",
            out.logprobs[i]
        );
    }
}

#[test]
fn in_flight_swap_keeps_going_on_the_new_weights() {
    let (old, new) = (weights(0, 0), weights(1, 1));
    let old_only = run_each(&old, vec![request(1, 0.0, 30, None)]).remove(0);
    let h = start(Arc::clone(&old), 4, 4096);
    let control = h.engine.control();
    let envelope = new.to_envelope();
    let seen = Arc::new(Mutex::new(0usize));
    let mut r = request(1, 0.0, 30, None);
    r.observer = Some(Arc::new(move |u| {
        if let RequestUpdate::Token(_) = u {
            let mut n = seen.lock().unwrap();
            *n += 1;
            if *n == 10 {
                control
                    .update_weights(envelope.clone(), WeightUpdateMode::InFlight)
                    .unwrap();
            }
        }
    }));
    h.engine.submit_native(r).unwrap();
    let done = wait(&h, 1).remove(0);
    assert_eq!(done.output.len(), 30);
    let v: Vec<u64> = done.output.versions.iter().map(|v| v.0).collect();
    assert_eq!(v[..10], [0; 10]);
    assert_eq!(v[10..], [1; 20]);
    replay_greedy(&prompt(1), &done.output, &old, &new);
    // Random tiny weights often repeat one token greedily; the log-probabilities tell the
    // weights apart: equal to the old-only run before the swap, different after. (The replay
    // above pins every token to its own weights; here, two random weight sets may give one
    // token the same log-probability to within 1e-3 by chance, as token 15 once did: so
    // most, not all, of the tokens after the swap must differ.)
    let gaps: Vec<f32> = (0..30)
        .map(|i| (done.output.logprobs[i] - old_only.output.logprobs[i]).abs())
        .collect();
    assert!(gaps[..10].iter().all(|&g| g <= 1e-3), "{gaps:?}");
    let differ = gaps[10..].iter().filter(|&&g| g > 1e-3).count();
    assert!(
        differ >= 15,
        "{differ} of 20 tokens differ after the swap: {gaps:?}"
    );
    let (version, pause, mode) = h.updates.recv_timeout(Duration::from_secs(5)).unwrap();
    assert_eq!(
        (version, mode),
        (PolicyVersion(1), WeightUpdateMode::InFlight)
    );
    assert!(pause < Duration::from_secs(5));
    assert_eq!(h.engine.stats().version, PolicyVersion(1));
}

#[test]
fn drain_never_lets_a_request_span_two_versions() {
    let (old, new) = (weights(0, 0), weights(1, 1));
    let h = start(Arc::clone(&old), 2, 4096);
    for i in 0..4 {
        h.engine
            .submit_native(request(i, 0.0, 8 + 4 * i as u32, None))
            .unwrap();
    }
    // Let the first two start, then ask for the drain while the rest wait.
    let t0 = Instant::now();
    while h.engine.stats().generated_tokens < 2 && t0.elapsed() < Duration::from_secs(10) {
        std::thread::sleep(Duration::from_millis(1));
    }
    h.engine
        .update_weights(new.to_envelope(), WeightUpdateMode::Drain)
        .unwrap();
    for i in 4..6 {
        h.engine.submit_native(request(i, 0.0, 6, None)).unwrap();
    }
    let out = wait(&h, 6);
    let mut by_version = [0, 0];
    for c in &out {
        let first = c.output.versions[0];
        assert!(
            c.output.versions.iter().all(|&v| v == first),
            "{} spans versions",
            c.id
        );
        by_version[first.0 as usize] += 1;
    }
    assert!(by_version[0] >= 2 && by_version[1] >= 2, "{by_version:?}");
    let (version, _, mode) = h.updates.recv_timeout(Duration::from_secs(5)).unwrap();
    assert_eq!((version, mode), (PolicyVersion(1), WeightUpdateMode::Drain));
}

#[test]
fn abort_resume_update_aborts_then_swaps() {
    let (old, new) = (weights(0, 0), weights(1, 1));
    let h = start(Arc::clone(&old), 4, 4096);
    for i in 0..2 {
        h.engine.submit_native(request(i, 0.0, 4000, None)).unwrap();
    }
    h.engine
        .update_weights(new.to_envelope(), WeightUpdateMode::AbortResume)
        .unwrap();
    let out = wait(&h, 2);
    assert!(out.iter().all(|c| c.finish == FinishReason::Abort));
    assert!(
        out.iter()
            .all(|c| c.output.versions.iter().all(|v| v.0 == 0))
    );
    h.engine.submit_native(request(3, 0.0, 3, None)).unwrap();
    let after = wait(&h, 1).remove(0);
    assert!(after.output.versions.iter().all(|v| v.0 == 1));
}

#[test]
fn bad_requests_are_refused_and_long_prompts_fail_alone() {
    let w = weights(0, 0);
    let h = start(Arc::clone(&w), 4, 4096);
    let mut empty = request(1, 0.0, 3, None);
    empty.request.prompt_token_ids.clear();
    assert!(h.engine.submit_native(empty).is_err());
    let mut oov = request(2, 0.0, 3, None);
    oov.request.prompt_token_ids.push(10_000);
    assert!(h.engine.submit_native(oov).is_err());
    let mut cold = request(3, -1.0, 3, None);
    cold.request.params.temperature = -1.0;
    assert!(h.engine.submit_native(cold).is_err());
    let mut long = request(4, 0.0, 3, None);
    long.request.prompt_token_ids = vec![1; 5000];
    h.engine.submit_native(long).unwrap();
    let c = wait(&h, 1).remove(0);
    assert_eq!(c.finish, FinishReason::Error("prompt_too_long".into()));
    h.engine.submit_native(request(5, 0.0, 2, None)).unwrap();
    assert_eq!(wait(&h, 1)[0].output.len(), 2);
}

#[test]
fn prompt_logprobs_match_a_full_forward() {
    let w = weights(0, 0);
    // Step budget 3 chunks the 7-token prompt: rows must line up across chunks.
    let h = start(Arc::clone(&w), 4, 3);
    let got = Arc::new(Mutex::new(None));
    let sink = Arc::clone(&got);
    let mut r = request(4, 0.0, 0, None);
    r.prompt_logprobs = true;
    r.top_logprobs = 2;
    r.observer = Some(Arc::new(move |u| {
        if let RequestUpdate::PromptLogprobs(lps) = u {
            *sink.lock().unwrap() = Some(lps);
        }
    }));
    h.engine.submit_native(r).unwrap();
    let done = wait(&h, 1).remove(0);
    assert!(done.output.is_empty());
    let lps = got.lock().unwrap().take().expect("prompt logprobs");
    let p = prompt(4);
    assert_eq!(lps.len(), p.len());
    assert_eq!(lps[0].logprob, None);
    let model = InferenceModel::new(Arc::clone(&w)).unwrap();
    let mut cache = ContiguousKvCache::new(model.config(), DType::F32, &Device::Cpu);
    let rows = model
        .step(
            &mut cache,
            &[StepInput { seq: 0, tokens: &p }],
            LogitsWanted::All,
        )
        .unwrap()
        .to_vec2::<f32>()
        .unwrap();
    for j in 1..p.len() {
        let row = &rows[j - 1];
        let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let z: f32 = row.iter().map(|x| (x - max).exp()).sum::<f32>().ln() + max;
        let expected = row[p[j] as usize] - z;
        let got = lps[j].logprob.unwrap();
        assert!((got - expected).abs() < 1e-4, "{j}: {got} vs {expected}");
        assert_eq!(lps[j].token, p[j]);
        assert_eq!(lps[j].top.len(), 2);
    }
}
