//! Profiling aid: `cargo run --release -p sluice-bench --example decode_step -- tiny 64 16 200`
//! prefills `batch` sequences of `prompt` tokens into a paged cache, then times `steps` decode
//! steps of one token each (greedy), the steady state of continuous batching, and prints the
//! mean step time and tokens/s. Arguments: preset, batch, prompt tokens, steps, threads,
//! repeats (each a fresh cache).

use std::sync::Arc;

use sluice_bench::model::{greedy_decode, prompts};
use sluice_model::candle::{DType, Device};
use sluice_model::presets::{Preset, preset_config, random_snapshot};
use sluice_model::{InferenceModel, PagedKvCache};

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
    let arg = |i: usize, default: usize| args.get(i).map_or(default, |s| s.parse().unwrap());
    let (batch, prompt, steps, threads, repeats) =
        (arg(2, 64), arg(3, 16), arg(4, 200), arg(5, 2), arg(6, 1));
    let config = Arc::new(preset_config(preset));
    let snap = Arc::new(random_snapshot(Arc::clone(&config), 0, DType::F32, &Device::Cpu).unwrap());
    let model = InferenceModel::new(Arc::clone(&snap)).unwrap();
    let pool = sluice_model::ComputePool::new("prof", threads).unwrap();
    let block_tokens = 16;
    let blocks = batch * (prompt + steps).div_ceil(block_tokens) + 8;
    let prompts = prompts(batch, prompt, config.vocab_size);
    pool.install(|| {
        for _ in 0..repeats {
            let mut cache =
                PagedKvCache::new(&config, DType::F32, &Device::Cpu, blocks, block_tokens).unwrap();
            let secs = greedy_decode(&model, &mut cache, &prompts, steps)
                .unwrap()
                .as_secs_f64();
            println!(
                "{preset:?} batch {batch} prompt {prompt}: {:.3} ms/step, {:.0} tok/s",
                1e3 * secs / steps as f64,
                (batch * steps) as f64 / secs
            );
        }
    });
}
