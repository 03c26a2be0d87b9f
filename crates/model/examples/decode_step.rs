//! Profiling aid: `cargo run --release -p sluice-model --example decode_step -- tiny 64 16 200`
//! prefills `batch` sequences of `prompt` tokens into a paged cache, then times `steps` decode
//! steps of one token each (greedy), the steady state of continuous batching, and prints the
//! mean step time and tokens/s. Arguments: preset, batch, prompt tokens, steps, threads,
//! repeats (each a fresh cache).

use std::sync::Arc;
use std::time::Instant;

use candle_core::{DType, Device};
use sluice_model::presets::{Preset, preset_config, random_snapshot};
use sluice_model::{InferenceModel, LogitsWanted, PagedKvCache, StepInput, argmax_rows};

#[allow(unsafe_code)]
fn main() {
    // As the binary does: without it candle re-reads /proc/cpuinfo on every matrix product.
    for (name, value) in
        sluice_model::threads::process_thread_env(|n| std::env::var_os(n).is_some())
    {
        // SAFETY: first thing in `main`, before any thread exists.
        unsafe { std::env::set_var(name, value) };
    }
    let args: Vec<String> = std::env::args().collect();
    let preset = match args.get(1).map(String::as_str) {
        Some("small") => Preset::Small,
        Some("medium") => Preset::Medium,
        _ => Preset::Tiny,
    };
    let batch: usize = args.get(2).map_or(64, |s| s.parse().unwrap());
    let prompt: usize = args.get(3).map_or(16, |s| s.parse().unwrap());
    let steps: usize = args.get(4).map_or(200, |s| s.parse().unwrap());
    let threads: usize = args.get(5).map_or(2, |s| s.parse().unwrap());
    let repeats: usize = args.get(6).map_or(1, |s| s.parse().unwrap());
    let config = Arc::new(preset_config(preset));
    let snap = Arc::new(random_snapshot(Arc::clone(&config), 0, DType::F32, &Device::Cpu).unwrap());
    let model = InferenceModel::new(Arc::clone(&snap)).unwrap();
    let vocab = config.vocab_size as u32;
    let pool = sluice_model::ComputePool::new("prof", threads).unwrap();
    let block_tokens = 16;
    let blocks = batch * (prompt + steps).div_ceil(block_tokens) + 8;
    pool.install(|| {
        for _ in 0..repeats {
            let mut cache =
                PagedKvCache::new(&config, DType::F32, &Device::Cpu, blocks, block_tokens).unwrap();
            let prompts: Vec<Vec<u32>> = (0..batch)
                .map(|s| {
                    (0..prompt as u32)
                        .map(|i| (i * 5 + s as u32 * 3) % vocab)
                        .collect()
                })
                .collect();
            let inputs: Vec<StepInput<'_>> = prompts
                .iter()
                .enumerate()
                .map(|(s, t)| StepInput {
                    seq: s as u64,
                    tokens: t,
                })
                .collect();
            let logits = model.step(&mut cache, &inputs, LogitsWanted::Last).unwrap();
            let mut next = argmax_rows(&logits).unwrap();
            let start = Instant::now();
            for _ in 0..steps {
                let tokens: Vec<[u32; 1]> = next.iter().map(|&t| [t]).collect();
                let inputs: Vec<StepInput<'_>> = tokens
                    .iter()
                    .enumerate()
                    .map(|(s, t)| StepInput {
                        seq: s as u64,
                        tokens: t,
                    })
                    .collect();
                let logits = model.step(&mut cache, &inputs, LogitsWanted::Last).unwrap();
                next = argmax_rows(&logits).unwrap();
            }
            let secs = start.elapsed().as_secs_f64();
            println!(
                "{preset:?} batch {batch} prompt {prompt}: {:.3} ms/step, {:.0} tok/s",
                1e3 * secs / steps as f64,
                (batch * steps) as f64 / secs
            );
        }
    });
}
