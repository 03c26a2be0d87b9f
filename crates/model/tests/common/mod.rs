//! Helpers shared by the model crate's integration tests.
#![allow(dead_code)]

use std::sync::Arc;

use candle_core::{DType, Device, Tensor};
use serde_json::Map;
use sluice_model::config::Llama3RopeScaling;
use sluice_model::presets::random_snapshot;
use sluice_model::{Architecture, ModelConfig, ModelWeights};

/// A very small config of `arch` (vocab 23, hidden 16, 2 layers, 4 heads over 2 kv heads).
pub fn tiny_config(arch: Architecture, tied: bool) -> ModelConfig {
    ModelConfig {
        architecture: arch,
        vocab_size: 23,
        hidden_size: 16,
        intermediate_size: 24,
        num_layers: 2,
        num_heads: 4,
        num_kv_heads: 2,
        // Qwen3 configs carry an explicit head_dim that need not be hidden/heads.
        head_dim: if arch == Architecture::Qwen3 { 6 } else { 4 },
        rms_norm_eps: 1e-6,
        rope_theta: 10_000.0,
        rope_scaling: (arch == Architecture::Llama).then_some(Llama3RopeScaling {
            factor: 8.0,
            low_freq_factor: 1.0,
            high_freq_factor: 4.0,
            original_max_position_embeddings: 16,
        }),
        max_position_embeddings: 128,
        tie_word_embeddings: tied,
        dtype: DType::F32,
        bos_token_id: None,
        eos_token_ids: vec![1],
        extra: Map::new(),
    }
}

/// Seeded random weights; biases and norm scales are perturbed away from their init (0 and 1)
/// so that every code path carries signal.
pub fn snapshot(config: ModelConfig, seed: u64, dtype: DType) -> ModelWeights {
    let config = Arc::new(config);
    let base = random_snapshot(Arc::clone(&config), seed, DType::F64, &Device::Cpu).unwrap();
    let mut map = std::collections::HashMap::new();
    for (i, (name, t)) in base.iter().enumerate() {
        let t = if t.rank() == 1 {
            let noise = Tensor::arange(0u32, t.dim(0).unwrap() as u32, &Device::Cpu)
                .unwrap()
                .to_dtype(DType::F64)
                .unwrap();
            let noise = ((noise * 0.37).unwrap() + i as f64).unwrap().sin().unwrap();
            (t + (noise * 0.1).unwrap()).unwrap()
        } else {
            // Larger weights than init so logits are not nearly uniform.
            (t * 5.0).unwrap()
        };
        map.insert(name.to_owned(), t.to_dtype(dtype).unwrap());
    }
    ModelWeights::new(config, sluice_core::PolicyVersion::INITIAL, map).unwrap()
}

/// max |a − b| / max |b| over all elements.
pub fn rel_err(a: &Tensor, b: &Tensor) -> f64 {
    let a = a.to_dtype(DType::F64).unwrap().flatten_all().unwrap();
    let b = b.to_dtype(DType::F64).unwrap().flatten_all().unwrap();
    let diff = (a - &b)
        .unwrap()
        .abs()
        .unwrap()
        .max(0)
        .unwrap()
        .to_scalar::<f64>()
        .unwrap();
    let scale = b.abs().unwrap().max(0).unwrap().to_scalar::<f64>().unwrap();
    diff / scale
}

pub const ALL_ARCHS: [Architecture; 3] = [
    Architecture::Llama,
    Architecture::Qwen2,
    Architecture::Qwen3,
];

/// Full-sequence logits `(len, vocab)` from the differentiable path, one sequence alone.
pub fn reference_logits(model: &sluice_model::TrainableModel, seq: &[u32]) -> Tensor {
    let batch = sluice_model::PackedBatch::from_rows(&[vec![seq]], seq.len(), 0).unwrap();
    model.logits(&batch).unwrap().get(0).unwrap()
}
