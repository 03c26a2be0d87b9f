//! The engine's token choice at a real vocabulary, for `sluice bench engine`: the presets'
//! character tokenizer (106 tokens) hides what choosing a token costs at ~150k.

use std::time::Instant;

use sluice_engine::SamplingParams;

/// Qwen2.5's vocabulary.
const REAL_VOCAB: usize = 151_936;

/// The engine's token choice for one decode step of 64 sequences at [`REAL_VOCAB`] (the rows
/// the model would hand it), on a pool of every core as an engine gets by default: ms per step
/// at temperature 1 (the RL setting, returned), with `top_p = 0.9` and greedy, each the median
/// of 9 steps.
pub(crate) fn sampling_ms() -> anyhow::Result<f64> {
    use sluice_engine::native::sampler::sample_rows;
    let rows: Vec<Vec<f32>> = (0..64u64)
        .map(|r| {
            (0..REAL_VOCAB as u64)
                .map(|i| {
                    let h = sluice_core::rng::splitmix(r * 1_000_003 + i);
                    // Logits spread over about 20 nats, as a trained model's are.
                    (h >> 40) as f32 / (1u64 << 24) as f32 * 20.0 - 10.0
                })
                .collect()
        })
        .collect();
    let threads = sluice_model::threads::role_threads(0, 1);
    let pool = sluice_model::ComputePool::new("bench-sampling", threads)?;
    let time = |temperature: f64, top_p: f64| -> f64 {
        let params = SamplingParams {
            temperature,
            top_p,
            top_k: 0,
            max_tokens: 1,
            seed: None,
            stop_token_ids: Vec::new(),
        };
        let jobs: Vec<(&[f32], &SamplingParams, u64, u64)> = rows
            .iter()
            .zip(0u64..)
            .map(|(row, r)| (row.as_slice(), &params, r, 0))
            .collect();
        let mut ms: Vec<f64> = (0..9u64)
            .map(|_| {
                let start = Instant::now();
                std::hint::black_box(pool.install(|| sample_rows(&jobs)));
                start.elapsed().as_secs_f64() * 1e3
            })
            .collect();
        ms.sort_by(f64::total_cmp);
        ms[ms.len() / 2]
    };
    let (plain, nucleus, greedy) = (time(1.0, 1.0), time(1.0, 0.9), time(0.0, 1.0));
    println!(
        "sampling 64 rows of a {REAL_VOCAB}-token vocabulary (Qwen2.5's), {threads} threads: {plain:.2} ms a step at temperature 1, {nucleus:.2} ms with top_p 0.9, {greedy:.2} ms greedy"
    );
    Ok(plain)
}
