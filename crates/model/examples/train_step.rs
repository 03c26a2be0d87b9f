//! Profiling aid: `cargo run --release -p sluice-model --example train_step -- tiny 8 128 20 custom`
//! runs forward + backward of a preset `iters` times and prints the mean time of each.

use std::sync::Arc;
use std::time::Instant;

use candle_core::{DType, Device, Tensor};
use sluice_model::ops::Kernels;
use sluice_model::presets::{Preset, preset_config, random_snapshot};
use sluice_model::{ForwardOptions, PackedBatch, TrainableModel};

/// User + system CPU seconds of this process so far.
fn cpu_seconds() -> f64 {
    let stat = std::fs::read_to_string("/proc/self/stat").unwrap();
    let f: Vec<&str> = stat
        .rsplit(')')
        .next()
        .unwrap()
        .split_whitespace()
        .collect();
    (f[11].parse::<f64>().unwrap() + f[12].parse::<f64>().unwrap()) / 100.0
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let preset = match args.get(1).map(String::as_str) {
        Some("small") => Preset::Small,
        _ => Preset::Tiny,
    };
    let rows: usize = args.get(2).map_or(8, |s| s.parse().unwrap());
    let len: usize = args.get(3).map_or(128, |s| s.parse().unwrap());
    let iters: usize = args.get(4).map_or(10, |s| s.parse().unwrap());
    let modes: Vec<Kernels> = match args.get(5).map(String::as_str) {
        Some("composed") => vec![Kernels::Differentiable],
        Some("both") => vec![Kernels::Differentiable, Kernels::Custom],
        _ => vec![Kernels::Custom],
    };
    let config = Arc::new(preset_config(preset));
    let snap = random_snapshot(config, 0, DType::F32, &Device::Cpu).unwrap();
    let vocab = snap.config().vocab_size as u32;
    let seqs: Vec<Vec<u32>> = (0..rows)
        .map(|r| {
            (0..len as u32)
                .map(|i| (i * 7 + r as u32 * 13) % vocab)
                .collect()
        })
        .collect();
    let packed: Vec<Vec<&[u32]>> = seqs.iter().map(|s| vec![s.as_slice()]).collect();
    let batch = PackedBatch::from_rows(&packed, len, 0).unwrap();
    let pool = sluice_model::ComputePool::new("prof", 2).unwrap();
    for kernels in modes {
        let mut model = TrainableModel::from_snapshot(&snap, DType::F32).unwrap();
        model.set_kernels(kernels).unwrap();
        pool.install(|| {
            let (mut f, mut b) = (0.0, 0.0);
            let mut cpu0 = 0.0;
            for it in 0..=iters {
                if it == 1 {
                    cpu0 = cpu_seconds();
                }
                let t = Instant::now();
                let s = model.token_scores(&batch, ForwardOptions::default()).unwrap();
                let loss = (s.logprobs.sum_all().unwrap() + s.entropy.sum_all().unwrap()).unwrap();
                let t1 = t.elapsed().as_secs_f64();
                let g = loss.backward().unwrap();
                let t2 = t.elapsed().as_secs_f64();
                drop(g);
                let _ = Tensor::zeros(1, DType::F32, &Device::Cpu);
                if it > 0 {
                    f += t1;
                    b += t2 - t1;
                }
            }
            let n = iters as f64;
            let cpu = cpu_seconds() - cpu0;
            println!(
                "{kernels:?}: fwd {:.2} ms  bwd {:.2} ms  tok/s {:.0}  cpu {:.2} ms/iter  tok/cpu-s {:.0}",
                1e3 * f / n,
                1e3 * b / n,
                (rows * len) as f64 * n / (f + b),
                1e3 * cpu / n,
                (rows * len) as f64 * n / cpu
            );
        });
    }
}
