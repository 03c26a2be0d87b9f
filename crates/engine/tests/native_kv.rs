//! The native engine on a paged KV cache with a small budget (tiny preset: 512 bytes a token,
//! 8 KiB a block of 16): preempted sequences come back as aborts whose resumes end exactly where
//! an uninterrupted run ends, a group's shared prompt is prefilled once, a resume on the same
//! replica reuses its prompt and partial, and a request that alone exceeds the pool is refused.

use std::sync::Arc;
use std::time::Duration;

use crossbeam_channel::Receiver;
use sluice_core::{GroupId, NodeId, PolicyVersion, RequestId, RunId};
use sluice_engine::{
    Completion, EngineError, EngineEvent, FinishReason, GenerateRequest, InferenceBackend,
    KvCacheStats, NativeEngine, NativeEngineParams, NativeRequest, SamplingParams,
};
use sluice_model::ModelWeights;
use sluice_model::candle::{DType, Device};
use sluice_model::presets::{Preset, preset_config, random_snapshot};

const BLOCK_BYTES: u64 = 8 * 1024;

fn weights() -> Arc<ModelWeights> {
    let config = Arc::new(preset_config(Preset::Tiny));
    let w = random_snapshot(config, 3, DType::F32, &Device::Cpu).unwrap();
    Arc::new(w.with_version(PolicyVersion(0)))
}

struct Harness {
    engine: NativeEngine,
    finished: Receiver<Completion>,
    /// Versions the engine reports installed.
    updated: Receiver<PolicyVersion>,
}

/// An engine of `max_running` sequences over `blocks` KV blocks (0: the automatic size).
fn start(max_running: usize, blocks: u64) -> Harness {
    start_with(NativeEngineParams {
        max_running_sequences: max_running,
        kv_cache_bytes: blocks * BLOCK_BYTES,
        seed: 1,
        ..NativeEngineParams::default()
    })
}

/// An engine of `params` on [`weights`].
fn start_with(params: NativeEngineParams) -> Harness {
    let (tx, finished) = crossbeam_channel::unbounded();
    let (tx_v, updated) = crossbeam_channel::unbounded();
    let engine = NativeEngine::start(
        params,
        weights(),
        None,
        Arc::new(move |e| match e {
            EngineEvent::Finished(c) => {
                let _ = tx.send(c);
            }
            EngineEvent::WeightsUpdated { version, .. } => {
                let _ = tx_v.send(version);
            }
        }),
    )
    .unwrap();
    Harness {
        engine,
        finished,
        updated,
    }
}

fn id(counter: u64) -> RequestId {
    GroupId {
        run: RunId::from_name("kv"),
        node: NodeId(0),
        counter,
    }
    .rollout(0)
    .request(0, 0)
}

fn request(counter: u64, prompt: Vec<u32>, max_tokens: u32) -> NativeRequest {
    NativeRequest {
        ignore_eos: true,
        ..NativeRequest::plain(GenerateRequest {
            id: id(counter),
            prompt_token_ids: prompt,
            resume: None,
            params: SamplingParams {
                temperature: 0.0,
                top_p: 1.0,
                top_k: 0,
                max_tokens,
                seed: None,
                stop_token_ids: vec![],
            },
            domain: None,
        })
    }
}

fn prompt(i: u64, len: u64) -> Vec<u32> {
    (0..len).map(|j| ((i * 11 + j * 7) % 90) as u32).collect()
}

fn next(h: &Harness) -> Completion {
    h.finished
        .recv_timeout(Duration::from_secs(60))
        .expect("a completion")
}

fn kv(h: &Harness) -> KvCacheStats {
    h.engine
        .stats()
        .kv_cache
        .expect("native engines report their kv cache")
}

/// Each request alone on a roomy engine: the uninterrupted greedy outputs.
fn reference(reqs: &[NativeRequest]) -> Vec<Completion> {
    let h = start(1, 0);
    reqs.iter()
        .map(|r| {
            h.engine.submit_native(r.clone()).unwrap();
            next(&h)
        })
        .collect()
}

#[test]
fn preempted_sequences_resume_to_the_uninterrupted_output() {
    // Four sequences of 10 + 60 tokens need 5 blocks each; the pool has 12, so decoding runs
    // out of blocks and the newest are preempted, more than once.
    let reqs: Vec<NativeRequest> = (0..4).map(|i| request(i, prompt(i, 10), 60)).collect();
    let expected = reference(&reqs);
    let h = start(4, 12);
    for r in &reqs {
        h.engine.submit_native(r.clone()).unwrap();
    }
    let mut done: Vec<Option<Completion>> = vec![None; reqs.len()];
    let mut aborts = 0;
    while done.iter().any(Option::is_none) {
        let c = next(&h);
        let i = c.id.rollout.group.counter as usize;
        match c.finish {
            FinishReason::Abort => {
                // What the controller does with an aborted rollout: resume from prompt + partial.
                aborts += 1;
                assert!(!c.output.is_empty(), "an abort carries the partial");
                let mut resumed = reqs[i].clone();
                resumed.request.resume = Some(c.output);
                h.engine.submit_native(resumed).unwrap();
            }
            FinishReason::Length => done[i] = Some(c),
            other => panic!("unexpected finish {other:?}"),
        }
    }
    let stats = kv(&h);
    assert!(aborts > 0, "the budget was meant to force preemption");
    assert!(stats.preempted_sequences >= aborts);
    for (got, want) in done.iter().flatten().zip(&expected) {
        // No token lost or generated twice: the same 60 tokens as without preemption.
        assert_eq!(got.output.token_ids, want.output.token_ids, "{}", got.id);
        for (x, y) in got.output.logprobs.iter().zip(&want.output.logprobs) {
            assert!((x - y).abs() < 1e-4, "{x} vs {y}");
        }
    }
    // The gauges are published when the engine goes idle, just after the last completion.
    let idle = std::time::Instant::now();
    while kv(&h).used_blocks != 0 && idle.elapsed() < Duration::from_secs(10) {
        std::thread::sleep(Duration::from_millis(1));
    }
    assert_eq!(
        kv(&h).used_blocks,
        0,
        "every block is back once nothing runs"
    );
}

/// With `recompute_preempted` (a server's engine) a preempted sequence is computed again from
/// its prompt and output inside the engine: every request finishes whole, never as an abort,
/// with the uninterrupted tokens. `sluice serve` used to hand its clients the partial.
#[test]
fn a_server_engine_recomputes_its_preempted_sequences() {
    let reqs: Vec<NativeRequest> = (0..4).map(|i| request(i, prompt(i, 10), 60)).collect();
    let expected = reference(&reqs);
    let h = start_with(NativeEngineParams {
        max_running_sequences: 4,
        kv_cache_bytes: 12 * BLOCK_BYTES,
        seed: 1,
        recompute_preempted: true,
        ..NativeEngineParams::default()
    });
    for r in &reqs {
        h.engine.submit_native(r.clone()).unwrap();
    }
    let mut done: Vec<Option<Completion>> = vec![None; reqs.len()];
    for _ in &reqs {
        let c = next(&h);
        assert_eq!(c.finish, FinishReason::Length, "{}", c.id);
        let i = c.id.rollout.group.counter as usize;
        done[i] = Some(c);
    }
    assert!(
        kv(&h).preempted_sequences > 0,
        "the budget was meant to force preemption"
    );
    for (got, want) in done.iter().flatten().zip(&expected) {
        assert_eq!(got.output.token_ids, want.output.token_ids, "{}", got.id);
        assert_eq!(got.output.versions, want.output.versions);
        for (x, y) in got.output.logprobs.iter().zip(&want.output.logprobs) {
            assert!((x - y).abs() < 1e-4, "{x} vs {y}");
        }
    }
}

#[test]
fn a_group_prefills_its_shared_prompt_once() {
    let shared = prompt(7, 100);
    let reqs: Vec<NativeRequest> = (0..8).map(|i| request(i, shared.clone(), 4)).collect();
    let expected = reference(&reqs[..1]).remove(0);
    let h = start(8, 0);
    for r in &reqs {
        h.engine.submit_native(r.clone()).unwrap();
    }
    for _ in 0..8 {
        let c = next(&h);
        assert_eq!(c.output.token_ids, expected.output.token_ids, "{}", c.id);
    }
    let stats = kv(&h);
    assert_eq!(stats.prompt_tokens, 800);
    // Seven rollouts take the six full blocks of the first one's prompt (96 tokens) and
    // compute the last four tokens themselves.
    assert_eq!(stats.prefix_hit_tokens, 7 * 96);
    let prefilled = (stats.prompt_tokens - stats.prefix_hit_tokens) as f64;
    assert!(prefilled / 800.0 <= 1.0 / 8.0 + 0.05, "{prefilled} of 800");
}

/// `[engine] kv_block_tokens`, `prefix_caching` and `stacked_products` reach the replica through
/// `NativeEngineParams::from_config`: a group's hits come in the configured block size, with
/// prefix caching off every prompt token is computed, and stacked products give the same tokens.
#[test]
fn block_size_and_prefix_caching_come_from_the_engine_config() {
    let shared = prompt(5, 100);
    let reqs: Vec<NativeRequest> = (0..8).map(|i| request(i, shared.clone(), 4)).collect();
    let expected = reference(&reqs[..1]).remove(0);
    // (config lines, prompt tokens each of the 7 later rollouts takes from the first one's)
    for (lines, hits) in [
        ("kv_block_tokens = 8", 96),
        ("kv_block_tokens = 32", 96),
        ("kv_block_tokens = 64", 64),
        ("prefix_caching = false", 0),
        ("stacked_products = true", 96),
    ] {
        let text = format!("max_running_sequences = 8\n{lines}\n");
        let params = NativeEngineParams {
            seed: 1,
            ..NativeEngineParams::from_config(&engine_section(&text), 0, 1, vec![])
        };
        let block = params.kv_block_tokens;
        let stacked = lines.starts_with("stacked_products").then_some(true);
        assert_eq!(params.stacked_products, stacked, "{lines}");
        let h = start_with(params);
        for r in &reqs {
            h.engine.submit_native(r.clone()).unwrap();
        }
        for _ in 0..8 {
            assert_eq!(
                next(&h).output.token_ids,
                expected.output.token_ids,
                "{lines}"
            );
        }
        let stats = kv(&h);
        assert_eq!(stats.prefix_hit_tokens, 7 * hits, "{lines}");
        assert_eq!(stats.block_tokens, block as u64, "{lines}");
    }
}

/// Stacked products on weights the split kernels do not take (f16 on the CPU) stop the replica
/// before it starts, naming the key.
#[test]
fn stacked_products_without_split_kernels_are_refused_by_key() {
    let f16 = Arc::new(weights().to(&Device::Cpu, DType::F16).unwrap());
    let params = NativeEngineParams {
        stacked_products: Some(true),
        ..NativeEngineParams::default()
    };
    let Err(e) = NativeEngine::start(params, f16, None, Arc::new(|_| {})) else {
        panic!("stacked f16 products on the CPU started")
    };
    let e = e.to_string();
    assert!(
        e.contains("engine.stacked_products") && e.contains("F16"),
        "{e}"
    );
}

/// `engine.cuda_graphs` on a CPU replica stops it before it starts, naming the key (the config
/// refuses it too; this is the path `sluice bench engine --cuda-graphs` and library users take).
#[test]
fn cuda_graphs_on_the_cpu_are_refused_by_key() {
    let params = NativeEngineParams {
        cuda_graphs: true,
        ..NativeEngineParams::default()
    };
    let Err(e) = NativeEngine::start(params, weights(), None, Arc::new(|_| {})) else {
        panic!("CUDA graphs on the CPU started")
    };
    let e = e.to_string();
    assert!(e.contains("engine.cuda_graphs") && e.contains("cpu"), "{e}");
}

/// `engine.prefix_cache_version_lag = 1`: after an `in_flight` update a resubmitted prompt
/// starts on the blocks the older weights computed; after a `drain` update it computes them again.
#[test]
fn a_version_lag_reuses_older_prompts_only_under_in_flight_updates() {
    let shared = prompt(9, 100);
    for (mode, hits) in [
        (sluice_core::WeightUpdateMode::InFlight, 96),
        (sluice_core::WeightUpdateMode::Drain, 0),
    ] {
        let h = start_with(NativeEngineParams {
            prefix_cache_version_lag: 1,
            seed: 1,
            ..NativeEngineParams::default()
        });
        h.engine
            .submit_native(request(0, shared.clone(), 4))
            .unwrap();
        next(&h);
        let w1 = Arc::new(weights().with_version(PolicyVersion(1)));
        h.engine.update_weights(w1.to_envelope(), mode).unwrap();
        assert_eq!(
            h.updated.recv_timeout(Duration::from_secs(60)).unwrap(),
            PolicyVersion(1)
        );
        let before = kv(&h).prefix_hit_tokens;
        h.engine
            .submit_native(request(1, shared.clone(), 4))
            .unwrap();
        let c = next(&h);
        assert_eq!(c.output.versions, vec![PolicyVersion(1); 4], "{mode:?}");
        assert_eq!(kv(&h).prefix_hit_tokens - before, hits, "{mode:?}");
    }
}

#[test]
fn a_resume_on_the_same_replica_reuses_its_prompt_and_partial() {
    let first = request(1, prompt(3, 20), 40);
    let expected = reference(std::slice::from_ref(&first)).remove(0);
    let h = start(2, 0);
    h.engine.submit_native(first.clone()).unwrap();
    assert_eq!(next(&h).output.token_ids, expected.output.token_ids);
    let before = kv(&h).prefix_hit_tokens;
    // As if it had been aborted after 30 tokens: 50 tokens, three full blocks cached.
    let mut partial = expected.output.clone();
    partial.token_ids.truncate(30);
    partial.logprobs.truncate(30);
    partial.versions.truncate(30);
    let mut resumed = first;
    resumed.request.resume = Some(partial);
    h.engine.submit_native(resumed).unwrap();
    let done = next(&h);
    assert_eq!(done.output.token_ids, expected.output.token_ids);
    assert_eq!(kv(&h).prefix_hit_tokens - before, 48);
}

#[test]
fn a_request_that_alone_exceeds_the_pool_is_refused() {
    let h = start(2, 8);
    let err = h
        .engine
        .submit_native(request(1, prompt(1, 128), 4))
        .unwrap_err();
    let EngineError::BadRequest { reason, .. } = err else {
        panic!("expected a bad request, got {err}");
    };
    assert_eq!(
        reason,
        "the prompt needs 9 KV cache blocks of 16 tokens (129 tokens with the first generated one); the replica's pool holds 8 blocks (0.1 MiB): raise engine.kv_cache_mb"
    );
    // One that fits runs, and stops at the pool's size rather than failing.
    h.engine
        .submit_native(request(2, prompt(2, 100), 200))
        .unwrap();
    let c = next(&h);
    assert_eq!(c.finish, FinishReason::Length);
    assert_eq!(100 + c.output.len(), 128);
}

/// The `[engine]` section written as `text` (its keys without the header), validated alone.
fn engine_section(text: &str) -> sluice_engine::config::EngineConfig {
    let raw: sluice_engine::config::RawEngine = toml::from_str(text).unwrap();
    let overridden = std::collections::BTreeSet::new();
    let ctx = sluice_core::config::check::Ctx {
        file: "test.toml",
        overridden: &overridden,
        env: &|_| None,
    };
    sluice_engine::config::validate_engine(raw, 0, false, sluice_core::config::Device::Cpu, &ctx)
        .unwrap()
}
