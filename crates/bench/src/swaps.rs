//! `sluice bench engine`'s weight-update pauses: one update per mode while 8 requests decode,
//! and the spread of `in_flight` swaps landing anywhere in a step.

use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use sluice_core::{PolicyVersion, WeightUpdateMode};
use sluice_engine::{
    EngineEvent, InferenceBackend, NativeEngine, NativeEngineParams, NativeRequest,
};
use sluice_model::ModelWeights;

use crate::engine::{Sizing, request};

/// An engine on `w0` with 8 requests of `max_tokens` decoding (16 tokens in), and the pauses its
/// updates report.
fn decoding_engine(
    w0: &Arc<ModelWeights>,
    max_tokens: u32,
    prompt_len: usize,
    sizing: Sizing,
) -> anyhow::Result<(NativeEngine, std::sync::mpsc::Receiver<Duration>)> {
    let (tx, rx) = std::sync::mpsc::channel();
    let engine = NativeEngine::start(
        NativeEngineParams {
            kv_cache_bytes: sizing.kv_cache_bytes,
            device: sizing.device,
            compute_dtype: sizing.compute_dtype,
            ..NativeEngineParams::default()
        },
        Arc::clone(w0),
        None,
        Arc::new(move |e| {
            if let EngineEvent::WeightsUpdated { pause, .. } = e {
                let _ = tx.send(pause);
            }
        }),
    )?;
    for i in 0..8 {
        engine.submit_native(NativeRequest {
            ignore_eos: true,
            ..NativeRequest::plain(request(i, max_tokens, prompt_len))
        })?;
    }
    // Let decoding get going so updates land mid-batch.
    let t0 = Instant::now();
    while engine.stats().generated_tokens < 16 && t0.elapsed() < Duration::from_secs(600) {
        std::thread::sleep(Duration::from_micros(200));
    }
    Ok((engine, rx))
}

/// The pause one update in `mode` reports while 8 requests decode.
pub(crate) fn swap_pause(
    w0: &Arc<ModelWeights>,
    w1: &Arc<ModelWeights>,
    mode: WeightUpdateMode,
    prompt_len: usize,
    sizing: Sizing,
) -> anyhow::Result<Duration> {
    let (mut engine, rx) = decoding_engine(w0, 24, prompt_len, sizing)?;
    engine.update_weights(w1.to_envelope(), mode)?;
    let pause = rx
        .recv_timeout(Duration::from_secs(1800))
        .context("no WeightsUpdated event")?;
    engine.shutdown();
    Ok(pause)
}

/// In-flight swaps measured while 8 requests decode.
const IN_FLIGHT_SWAPS: usize = 24;

/// The pauses of [`IN_FLIGHT_SWAPS`] in-flight updates (alternating two weight sets) while 8
/// requests decode, sorted. A trainer publishes at times unrelated to the engine's steps, so
/// each update is sent after a pseudo-random wait of 3–9 ms: it lands anywhere in a step, and
/// the pause (the rest of that step, then the swap) is sampled over that spread. One update
/// sent just after a step started would wait for nearly a whole step: that worst case is about
/// the inter-token latency at concurrency 8 in the table above.
pub(crate) fn in_flight_pauses(
    w0: &Arc<ModelWeights>,
    w1: &Arc<ModelWeights>,
    prompt_len: usize,
    sizing: Sizing,
) -> anyhow::Result<Vec<Duration>> {
    let (mut engine, rx) = decoding_engine(w0, 4000, prompt_len, sizing)?;
    let mut pauses = Vec::with_capacity(IN_FLIGHT_SWAPS);
    let mut state = 0x9e37_79b9_7f4a_7c15u64;
    for k in 0..IN_FLIGHT_SWAPS {
        // xorshift: a fixed sequence of waits, so runs are comparable.
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        std::thread::sleep(Duration::from_micros(3000 + state % 6000));
        anyhow::ensure!(
            engine.stats().running == 8,
            "the requests finished before the swaps did; the pauses would be idle ones"
        );
        let w = if k % 2 == 0 { w1 } else { w0 };
        let w = Arc::new(w.with_version(PolicyVersion(k as u64 + 1)));
        engine.update_weights(w.to_envelope(), WeightUpdateMode::InFlight)?;
        pauses.push(
            rx.recv_timeout(Duration::from_secs(600))
                .context("no WeightsUpdated event")?,
        );
    }
    engine.shutdown();
    pauses.sort_unstable();
    Ok(pauses)
}
