//! The measurements behind `sluice bench engine`'s rows: a stream of requests at a concurrency
//! (tokens/s and the gaps between tokens), and the prefix-sharing run.

use std::sync::{Arc, Mutex};

use anyhow::Context;
use std::time::{Duration, Instant};

use sluice_core::{GroupId, NodeId, RunId};
use sluice_engine::native::RequestUpdate;
use sluice_engine::{
    EngineEvent, GenerateRequest, InferenceBackend, NativeEngine, NativeEngineParams,
    NativeRequest, SamplingParams,
};
use sluice_model::ModelWeights;

use super::{GROUP_PROMPT_TOKENS, Measured, Sizing};

pub(crate) fn request(i: u64, max_tokens: u32, prompt_len: usize) -> GenerateRequest {
    GenerateRequest {
        id: GroupId {
            run: RunId::from_name("bench"),
            node: NodeId(0),
            counter: i,
        }
        .rollout(0)
        .request(0, 0),
        prompt_token_ids: (0..prompt_len as u64)
            .map(|j| ((i * 13 + j * 7) % 90) as u32)
            .collect(),
        resume: None,
        params: SamplingParams {
            temperature: 0.0,
            top_p: 1.0,
            top_k: 0,
            max_tokens,
            seed: None,
            stop_token_ids: Vec::new(),
        },
        domain: None,
    }
}

/// The lengths of the requests of a row.
#[derive(Clone, Copy)]
pub(super) struct Shape {
    pub max_tokens: u32,
    pub prompt_len: usize,
    /// See [`BenchEngineArgs::ragged`](super::BenchEngineArgs::ragged).
    pub ragged: bool,
}

impl Shape {
    /// `(max_tokens, prompt_len)` of request `i`: with `ragged`, completions of
    /// `max_tokens · (2k + 1) / 8` for `k = i mod 8` and prompts from half to one and a half
    /// times `prompt_len` on another cycle, both averaging the given lengths.
    fn of(&self, i: u64) -> (u32, usize) {
        if !self.ragged {
            return (self.max_tokens, self.prompt_len);
        }
        let k = i % 8;
        let max = ((u64::from(self.max_tokens) * (2 * k + 1) + 4) / 8).max(1) as u32;
        let half = self.prompt_len / 2;
        let prompt = half + ((i * 5 + 2) % (2 * half as u64 + 1)) as usize;
        (max, prompt.max(1))
    }
}

/// `total` requests with at most `concurrency` in flight (the engine's cap), each of its
/// [`Shape`]; tokens/s over the whole run and the gaps between consecutive
/// tokens of each request. A request preempted for lack of KV blocks comes back as an abort and
/// is resumed from its partial, as the controller would. With `warm_up`, as many requests of
/// the same lengths (other prompts) run once untimed on the same engine first, as
/// `scripts/pytorch-bench` warms up with one call.
pub(super) fn measure(
    w: &Arc<ModelWeights>,
    sizing: Sizing,
    (total, concurrency): (usize, usize),
    shape: Shape,
    warm_up: bool,
) -> anyhow::Result<Measured> {
    let shaped = |i: u64| {
        let (max_tokens, prompt_len) = shape.of(i);
        request(i, max_tokens, prompt_len)
    };
    let (tx, rx) = std::sync::mpsc::channel();
    let params = sizing.params(concurrency);
    let mut engine = NativeEngine::start(
        params,
        Arc::clone(w),
        None,
        Arc::new(move |e| {
            if let EngineEvent::Finished(c) = e {
                let _ = tx.send(c);
            }
        }),
    )?;
    if warm_up {
        // Requests of the same lengths once, untimed: the pool grown and every buffer's pages
        // touched, as a serving engine is after its first requests. Their ids (and so their
        // prompts) follow the timed round's, so no prompt is cached for it.
        let total = total as u64;
        let warm = |i: u64| {
            let (max_tokens, prompt_len) = shape.of(i % total);
            request(i, max_tokens, prompt_len)
        };
        let tokens = run_round(&mut engine, &rx, (total..2 * total).map(warm), &warm, None)?;
        anyhow::ensure!(tokens > 0, "the warm-up round generated no tokens");
    }
    let before = engine.control().breakdown();
    let preempted_before = preempted(&engine);
    let gaps = Arc::new(Mutex::new(Vec::new()));
    let started = Instant::now();
    let tokens = run_round(
        &mut engine,
        &rx,
        (0..total as u64).map(shaped),
        &shaped,
        Some(&gaps),
    )?;
    let preempted = preempted(&engine) - preempted_before;
    let elapsed = started.elapsed().as_secs_f64();
    let parts = engine.control().breakdown().since(&before);
    engine.shutdown();
    let busy = parts.model_seconds + parts.scheduler_seconds;
    let mut gaps = std::mem::take(&mut *gaps.lock().expect("not poisoned"));
    gaps.sort_unstable();
    let pct = |p: f64| {
        gaps.get(((gaps.len() as f64 - 1.0) * p).round() as usize)
            .map_or(0.0, |d| d.as_secs_f64() * 1e3)
    };
    Ok(Measured {
        tokens_per_s: tokens as f64 / elapsed,
        itl_p50_ms: pct(0.5),
        itl_p99_ms: pct(0.99),
        model_pct: 100.0 * parts.model_seconds / busy.max(1e-12),
        issue_pct: 100.0 * parts.issue_seconds / parts.model_seconds.max(1e-12),
        step_ms: 1e3 * busy / parts.steps.max(1) as f64,
        decode_tok_s: parts.decode_tokens as f64 / parts.decode_seconds.max(1e-12),
        preempted,
        graphed_pct: 100.0 * parts.graph_replays as f64 / parts.steps.max(1) as f64,
    })
}

/// Sequences the engine's KV cache has preempted so far.
fn preempted(engine: &NativeEngine) -> u64 {
    engine
        .control()
        .stats()
        .kv_cache
        .map_or(0, |k| k.preempted_sequences)
}

/// Submits `requests` and waits for all of them, resuming each preempted one (rebuilt by
/// `shaped` from its counter) from its partial; the tokens they generated. With `gaps`, the
/// gap between each request's consecutive tokens is recorded.
fn run_round(
    engine: &mut NativeEngine,
    rx: &std::sync::mpsc::Receiver<sluice_engine::Completion>,
    requests: impl Iterator<Item = GenerateRequest>,
    shaped: &dyn Fn(u64) -> GenerateRequest,
    gaps: Option<&Arc<Mutex<Vec<Duration>>>>,
) -> anyhow::Result<usize> {
    let mut total = 0;
    for request in requests {
        total += 1;
        let observer = gaps.map(|gaps| {
            let gaps = Arc::clone(gaps);
            let last = Mutex::new(None::<Instant>);
            Arc::new(move |u: RequestUpdate| {
                if let RequestUpdate::Token(_) = u {
                    let now = Instant::now();
                    let mut l = last.lock().expect("not poisoned");
                    if let Some(prev) = *l {
                        gaps.lock().expect("not poisoned").push(now - prev);
                    }
                    *l = Some(now);
                }
            }) as _
        });
        engine.submit_native(NativeRequest {
            ignore_eos: true,
            observer,
            ..NativeRequest::plain(request)
        })?;
    }
    let mut tokens = 0usize;
    let mut finished = 0;
    while finished < total {
        let c = rx
            .recv_timeout(Duration::from_secs(1800))
            .context("the engine stopped answering")?;
        if c.finish == sluice_engine::FinishReason::Abort {
            let mut resumed = shaped(c.id.rollout.group.counter);
            resumed.resume = Some(c.output);
            engine.submit_native(NativeRequest {
                ignore_eos: true,
                ..NativeRequest::plain(resumed)
            })?;
            continue;
        }
        finished += 1;
        tokens += c.output.len();
    }
    Ok(tokens)
}

/// Groups in the prefix-sharing measurement.
pub(super) const PREFIX_GROUPS: usize = 8;

/// [`PREFIX_GROUPS`] groups of `g` requests sharing a prompt of [`GROUP_PROMPT_TOKENS`] (4 new
/// tokens each, all submitted at once to a cold engine): prompt tokens prefilled ÷ submitted,
/// and the model's seconds.
pub(super) fn prefix_sharing(
    w: &Arc<ModelWeights>,
    sizing: Sizing,
    g: usize,
    caching: bool,
) -> anyhow::Result<(f64, f64)> {
    let (tx, rx) = std::sync::mpsc::channel();
    let params = NativeEngineParams {
        prefix_caching: caching,
        ..sizing.params((PREFIX_GROUPS * g).min(64))
    };
    let mut engine = NativeEngine::start(
        params,
        Arc::clone(w),
        None,
        Arc::new(move |e| {
            if let EngineEvent::Finished(c) = e {
                let _ = tx.send(c);
            }
        }),
    )?;
    for group in 0..PREFIX_GROUPS {
        let prompt = request(group as u64, 4, GROUP_PROMPT_TOKENS).prompt_token_ids;
        for k in 0..g {
            let mut r = request((group * g + k) as u64, 4, GROUP_PROMPT_TOKENS);
            r.prompt_token_ids.clone_from(&prompt);
            engine.submit_native(NativeRequest {
                ignore_eos: true,
                ..NativeRequest::plain(r)
            })?;
        }
    }
    for _ in 0..PREFIX_GROUPS * g {
        rx.recv_timeout(Duration::from_secs(1800))
            .context("the engine stopped answering")?;
    }
    let control = engine.control();
    let kv = control
        .stats()
        .kv_cache
        .context("a native engine reports its kv cache")?;
    let model = control.breakdown().model_seconds;
    engine.shutdown();
    let ratio = (kv.prompt_tokens - kv.prefix_hit_tokens) as f64 / kv.prompt_tokens.max(1) as f64;
    Ok((ratio, model))
}
