//! The engine's step kernels for stacked products (`split_rope`, `swiglu_rows` and
//! `add_rms_norm`: on a GPU `kernels/fused.cu`, on the CPU `fused/stacked.rs`) against candle's
//! composition on the same device, at a decode step of the medium preset with 64 sequences in
//! flight, f32 (and bf16 on a GPU, where the split kernels take it): values agreeing and the
//! time of each, forward only (the engine takes no gradients). And the decode steps over fixed
//! buffers (CUDA graphs on a GPU) against the eager steps (`decode_graphs`).

use std::sync::Arc;
use std::time::Instant;

use sluice_config::ModelPreset;
use sluice_model::candle::{DType, Device, Result as CResult, Tensor};
use sluice_model::presets::{preset_config, random_snapshot};
use sluice_model::{InferenceModel, LogitsWanted, PagedKvCache, StepInput, fused};

use super::training::{random, rel_err, report, rms_composed, rope_composed, timed};

/// Sequences in flight: one row each.
const ROWS: usize = 64;
const HIDDEN: usize = 896;
const MLP: usize = 4864;
const HEADS: usize = 14;
const KV_HEADS: usize = 2;
const HEAD_DIM: usize = 64;
/// Timed calls per path (after one untimed).
const REPS: usize = 20;

type Op<'a> = dyn Fn() -> CResult<Tensor> + 'a;

/// The checks and timings; false when any disagrees with the composition.
pub(super) fn compare(device: &Device, result: &mut Vec<String>) -> anyhow::Result<bool> {
    let mut ok = true;
    let d = HEAD_DIM;
    let width = (HEADS + 2 * KV_HEADS) * d;
    let dtypes: &[DType] = if device.is_cuda() {
        &[DType::F32, DType::BF16]
    } else {
        &[DType::F32]
    };
    for &dtype in dtypes {
        let tag = if dtype == DType::BF16 { "bf16" } else { "f32" };
        let x = |shape: &[usize], seed: u64| random(shape, seed, dtype, device);
        let (qkv, bias) = (x(&[ROWS, width], 21)?, x(&[width], 22)?);
        let (cos, sin) = (x(&[ROWS, d / 2], 23)?, x(&[ROWS, d / 2], 24)?);
        let gate_up = x(&[ROWS, 2 * MLP], 25)?;
        let (res, out, w) = (
            x(&[ROWS, HIDDEN], 26)?,
            x(&[ROWS, HIDDEN], 27)?,
            x(&[HIDDEN], 28)?,
        );
        let parts = |t: Vec<Tensor>| Tensor::cat(&t, 1);
        let cases: Vec<(&str, Box<Op<'_>>, Box<Op<'_>>)> = vec![
            (
                "split_rope",
                Box::new(|| {
                    let (q, k, v) =
                        fused::split_rope(&qkv, Some(&bias), &cos, &sin, HEADS, KV_HEADS, d)?;
                    parts(vec![q, k, v])
                }),
                Box::new(|| {
                    let all = qkv.broadcast_add(&bias)?;
                    let part = |at: usize, n: usize| all.narrow(1, at * d, n * d);
                    parts(vec![
                        rope_composed(&part(0, HEADS)?.contiguous()?, &cos, &sin, d)?,
                        rope_composed(&part(HEADS, KV_HEADS)?.contiguous()?, &cos, &sin, d)?,
                        part(HEADS + KV_HEADS, KV_HEADS)?.contiguous()?,
                    ])
                }),
            ),
            (
                "swiglu_rows",
                Box::new(|| fused::swiglu_rows(&gate_up)),
                Box::new(|| gate_up.narrow(1, 0, MLP)?.silu()? * gate_up.narrow(1, MLP, MLP)?),
            ),
            (
                "add_rms_norm",
                Box::new(|| {
                    let (sum, normed) = fused::add_rms_norm(&res, &out, &w, 1e-6)?;
                    parts(vec![sum, normed])
                }),
                Box::new(|| {
                    let sum = (&res + &out)?;
                    let normed = rms_composed(&sum, &w, 1e-6)?;
                    parts(vec![sum, normed])
                }),
            ),
        ];
        for (name, fused_op, composed_op) in &cases {
            let (fused_out, fused_ms) = timed(REPS, device, || Ok(fused_op()?))?;
            let (comp_out, comp_ms) = timed(REPS, device, || Ok(composed_op()?))?;
            let err = rel_err(&fused_out, &comp_out)?;
            let tol = if dtype == DType::BF16 { 1e-2 } else { 1e-5 };
            ok &= report(
                (
                    &format!("engine {name} ({tag}), {ROWS} rows"),
                    &format!("engine_{name}_{tag}"),
                ),
                (fused_ms, comp_ms),
                (err, tol),
                result,
            );
        }
    }
    Ok(ok)
}

/// Decode steps timed and compared per path in [`decode_graphs`].
const DECODE_STEPS: usize = 12;

/// Decode steps over fixed buffers, captured and replayed as CUDA graphs on a GPU (run eagerly
/// on the CPU), against the eager steps: 64 sequences after a 16-token prompt each, every step
/// feeding both models the eager one's greedy tokens. On a GPU the medium preset in bf16 (its
/// first graphed step is the capture, not timed), on the CPU the tiny one in f32. False when
/// the logits disagree, a capture failed, or (on a GPU) no step replayed a graph.
pub(super) fn decode_graphs(device: &Device, result: &mut Vec<String>) -> anyhow::Result<bool> {
    let (preset, dtype, tol) = match device.is_cuda() {
        true => (ModelPreset::Medium, DType::BF16, 1e-3),
        false => (ModelPreset::Tiny, DType::F32, 1e-5),
    };
    let config = Arc::new(preset_config(preset));
    let weights = Arc::new(random_snapshot(Arc::clone(&config), 0, dtype, device)?);
    let model = |graphs: bool| -> anyhow::Result<InferenceModel> {
        let mut m = InferenceModel::new(Arc::clone(&weights))?;
        m.set_decode_graphs(graphs);
        Ok(m)
    };
    let (eager, graphed) = (model(false)?, model(true)?);
    let cache = || PagedKvCache::new(&config, dtype, device, 2 * ROWS * 2, 16);
    let (mut a, mut b) = (cache()?, cache()?);
    let prompts = prompts(16, config.vocab_size);
    // The graphed model's first decode step is its capture: not timed.
    let (eager_ms, graphed_ms, err) =
        side_by_side(device, (&eager, &mut a), (&graphed, &mut b), &prompts, 1)?;
    let stats = graphed.decode_graph_stats().unwrap_or_default();
    let replayed = stats.replays > 0 || !device.is_cuda();
    let ok = err <= tol && stats.failed.is_none() && replayed;
    println!(
        "decode steps over fixed buffers ({preset:?}, {dtype:?}, {ROWS} sequences): eager {eager_ms:.3} ms, graphed {graphed_ms:.3} ms ({:.2}x); {} captures, {} replays{}; largest difference {err:.2e} (at most {tol:e}){}",
        eager_ms / graphed_ms,
        stats.captures,
        stats.replays,
        stats
            .failed
            .as_deref()
            .map(|f| format!(", capture failed: {f}"))
            .unwrap_or_default(),
        if ok { "" } else { ": FAILED" }
    );
    result.extend([
        format!("decode_graph_ms={graphed_ms:.4}"),
        format!("decode_eager_ms={eager_ms:.4}"),
        format!("decode_graph_speedup={:.3}", eager_ms / graphed_ms),
        format!("decode_graph_err={err:.3e}"),
        format!("decode_graph_steps={}", stats.steps),
        format!("decode_graph_replays={}", stats.replays),
        format!("decode_graph_failed={}", u8::from(stats.failed.is_some())),
    ]);
    Ok(ok)
}

/// Prompt tokens per sequence of [`key_split`]: four parts of 512 keys at 64 sequences.
const LONG_PROMPT: usize = 2048;

/// On a GPU: decode steps of the medium preset in bf16 at 64 sequences after a 2,048-token
/// prompt each, with the attention splitting each row's keys over parts (flash-decoding, the
/// default) against one warp's pass per row and head; both fed the one-pass steps' greedy
/// tokens. False when the logits disagree beyond bf16's rounding or the split was not taken.
pub(super) fn key_split(device: &Device, result: &mut Vec<String>) -> anyhow::Result<bool> {
    let (preset, dtype, tol) = (ModelPreset::Medium, DType::BF16, 2e-2);
    let config = Arc::new(preset_config(preset));
    let weights = Arc::new(random_snapshot(Arc::clone(&config), 0, dtype, device)?);
    let model = InferenceModel::new(Arc::clone(&weights))?;
    let block_tokens = 16;
    let blocks = ROWS * (LONG_PROMPT + DECODE_STEPS + 1).div_ceil(block_tokens);
    let cache = |split: bool| -> anyhow::Result<PagedKvCache> {
        let mut c = PagedKvCache::new(&config, dtype, device, blocks, block_tokens)?;
        c.set_key_split(split);
        Ok(c)
    };
    let (mut one, mut split) = (cache(false)?, cache(true)?);
    let prompts = prompts(LONG_PROMPT, config.vocab_size);
    let (one_ms, split_ms, err) = side_by_side(
        device,
        (&model, &mut one),
        (&model, &mut split),
        &prompts,
        0,
    )?;
    // Both caches saw the same positions: the parts the split one took.
    let parts = split.key_parts(ROWS, config.num_heads, LONG_PROMPT + DECODE_STEPS);
    let ok = err <= tol && parts > 1;
    println!(
        "decode steps at {LONG_PROMPT}-token contexts ({preset:?}, {dtype:?}, {ROWS} sequences): one pass per row {one_ms:.3} ms, keys split in {parts} parts {split_ms:.3} ms ({:.2}x); largest difference {err:.2e} (at most {tol:e}){}",
        one_ms / split_ms,
        if ok { "" } else { ": FAILED" }
    );
    result.extend([
        format!("key_split_ms={split_ms:.4}"),
        format!("key_split_one_pass_ms={one_ms:.4}"),
        format!("key_split_speedup={:.3}", one_ms / split_ms),
        format!("key_split_err={err:.3e}"),
        format!("key_split_parts={parts}"),
    ]);
    Ok(ok)
}

/// `ROWS` prompts of `len` tokens below `vocab`, a different one per sequence.
fn prompts(len: usize, vocab: usize) -> Vec<Vec<u32>> {
    let (len, vocab) = (len as u32, vocab as u32);
    (0..ROWS as u32)
        .map(|s| (0..len).map(|j| (s * 7 + j * 3 + 1) % vocab).collect())
        .collect()
}

/// The same decode steps on two models and caches: `prompts` into each, then [`DECODE_STEPS`]
/// steps, both fed the first's greedy tokens. Returns the median step time of each (ms; the
/// second's first `untimed` steps not counted) and the largest relative difference of the
/// second's logits from the first's.
fn side_by_side(
    device: &Device,
    (first, first_cache): (&InferenceModel, &mut PagedKvCache),
    (second, second_cache): (&InferenceModel, &mut PagedKvCache),
    prompts: &[Vec<u32>],
    untimed: usize,
) -> anyhow::Result<(f64, f64, f64)> {
    let step = |m: &InferenceModel, c: &mut PagedKvCache, rows: &[Vec<u32>]| {
        let logits = m.step_paged(c, &StepInput::numbered(rows), LogitsWanted::Last)?;
        device.synchronize()?;
        anyhow::Ok(logits)
    };
    let mut logits = step(first, first_cache, prompts)?;
    step(second, second_cache, prompts)?;
    let (mut first_ms, mut second_ms, mut err) = (Vec::new(), Vec::new(), 0f64);
    for i in 0..DECODE_STEPS {
        let tokens: Vec<Vec<u32>> = (sluice_model::argmax_rows(&logits)?.into_iter())
            .map(|t| vec![t])
            .collect();
        let start = Instant::now();
        logits = step(first, first_cache, &tokens)?;
        first_ms.push(start.elapsed().as_secs_f64() * 1e3);
        let start = Instant::now();
        let got = step(second, second_cache, &tokens)?;
        if i >= untimed {
            second_ms.push(start.elapsed().as_secs_f64() * 1e3);
        }
        err = err.max(super::training::rel_err(&got, &logits)?);
    }
    Ok((crate::median(first_ms), crate::median(second_ms), err))
}
