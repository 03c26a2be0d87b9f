//! Built-in model directories: `sluice model init --preset tiny|small|medium`.
//!
//! A preset is a Qwen2-shaped config, seeded random weights, a character-level tokenizer
//! (printable ASCII plus newline, one token per character) with ChatML special tokens, a ChatML
//! chat template with tool support, and a generation config — a complete HF directory that
//! transformers can load as well as Sluice.

mod tokenizer_json;

use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;

pub use crate::section::ModelPreset as Preset;
use candle_core::{DType, Device, Tensor};
use rand::SeedableRng;
use rand::rngs::StdRng;
use rand_distr::{Distribution, Normal};
use serde_json::Map;
use sluice_core::PolicyVersion;

use crate::checkpoint::{SaveOptions, generation_config, save_checkpoint, write_json};
use crate::config::{Architecture, ModelConfig};
use crate::error::{ModelError, Result, TensorContext};
use crate::names::{InitKind, parameter_specs};
use crate::snapshot::ModelWeights;
pub use tokenizer_json::{CHAR_VOCAB, SPECIAL_TOKENS, char_tokenizer_json, tokenizer_config_json};

/// The ChatML template the presets ship (tools, reasoning and tool responses supported).
pub const CHATML_TEMPLATE: &str = include_str!("chatml.jinja");

/// Standard deviation of the random normal init (transformers' `initializer_range`).
pub const INIT_STD: f64 = 0.02;

/// The config of `preset`. Vocabulary: the character tokenizer's size.
pub fn preset_config(preset: Preset) -> ModelConfig {
    let (hidden, layers, heads, kv_heads, intermediate, rope_theta, max_positions) = match preset {
        // ~0.1M parameters: CPU tests in milliseconds, the quickstart on 2 cores.
        Preset::Tiny => (64, 2, 4, 2, 256, 10_000.0, 4096),
        // ~76M parameters: benchmarks.
        Preset::Small => (768, 12, 12, 4, 2048, 10_000.0, 4096),
        // Qwen2.5-0.5B's layer shapes (~358M parameters without its 151k-token embedding).
        Preset::Medium => (896, 24, 14, 2, 4864, 1_000_000.0, 32_768),
    };
    let vocab = tokenizer_json::vocab_size();
    ModelConfig {
        architecture: Architecture::Qwen2,
        vocab_size: vocab,
        hidden_size: hidden,
        intermediate_size: intermediate,
        num_layers: layers,
        num_heads: heads,
        num_kv_heads: kv_heads,
        head_dim: hidden / heads,
        rms_norm_eps: 1e-6,
        rope_theta,
        rope_scaling: None,
        max_position_embeddings: max_positions,
        tie_word_embeddings: true,
        dtype: DType::F32,
        bos_token_id: None,
        eos_token_ids: vec![tokenizer_json::IM_END_ID],
        extra: Map::new(),
    }
}

/// Seeded random weights for `config` (normal(0, 0.02) matrices, unit norms, zero biases).
/// Each tensor draws from its own stream derived from `seed` and its name, so adding a tensor
/// never changes the others.
pub fn random_snapshot(
    config: Arc<ModelConfig>,
    seed: u64,
    dtype: DType,
    device: &Device,
) -> Result<ModelWeights> {
    let normal = Normal::new(0.0f32, INIT_STD as f32).expect("valid std");
    let mut tensors = HashMap::new();
    for spec in parameter_specs(&config) {
        let n: usize = spec.shape.iter().product();
        let data: Vec<f32> = match spec.init {
            InitKind::Ones => vec![1.0; n],
            InitKind::Zeros => vec![0.0; n],
            InitKind::Normal => {
                let mut rng = StdRng::seed_from_u64(seed ^ fnv1a(&spec.name));
                (0..n).map(|_| normal.sample(&mut rng)).collect()
            }
        };
        let t = Tensor::from_vec(data, spec.shape.as_slice(), device)
            .and_then(|t| t.to_dtype(dtype))
            .ctx(&spec.name)?;
        tensors.insert(spec.name, t);
    }
    ModelWeights::new(config, PolicyVersion::INITIAL, tensors)
}

/// Writes the complete HF directory of `preset` into `dir` (created if needed).
pub fn write_preset(preset: Preset, dir: &Path, seed: u64) -> Result<()> {
    let config = Arc::new(preset_config(preset));
    let snapshot = random_snapshot(Arc::clone(&config), seed, DType::F32, &Device::Cpu)?;
    write_model_dir(&snapshot, dir)
}

/// Writes `snapshot` with the preset tokenizer, template and generation config: a directory for
/// any config whose vocabulary is the character tokenizer's.
pub fn write_model_dir(snapshot: &ModelWeights, dir: &Path) -> Result<()> {
    let vocab = tokenizer_json::vocab_size();
    if snapshot.config().vocab_size != vocab {
        return Err(ModelError::input(format!(
            "the preset tokenizer has {vocab} tokens, the config {}",
            snapshot.config().vocab_size
        )));
    }
    std::fs::create_dir_all(dir).map_err(|e| ModelError::io(dir, e))?;
    let mut generation = generation_config(snapshot.config());
    generation["eos_token_id"] =
        serde_json::json!([tokenizer_json::IM_END_ID, tokenizer_json::ENDOFTEXT_ID]);
    generation["pad_token_id"] = serde_json::json!(tokenizer_json::ENDOFTEXT_ID);
    write_json(&dir.join("generation_config.json"), &generation)?;
    save_checkpoint(snapshot, dir, &SaveOptions::default())?;
    write_json(&dir.join("tokenizer.json"), &char_tokenizer_json())?;
    write_json(&dir.join("tokenizer_config.json"), &tokenizer_config_json())?;
    Ok(())
}

/// 64-bit FNV-1a, to derive per-tensor seeds.
fn fnv1a(s: &str) -> u64 {
    s.bytes().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3)
    })
}

/// Writes `preset` as a reward model into `dir`: the directory [`write_preset`] writes with
/// `seed`, turned into a one-label sequence classifier (`Qwen2ForSequenceClassification`,
/// `id2label` of one label) whose head `score.weight` holds `head` (`hidden_size` values).
/// What tests and examples score with; real reward models come from their own training.
pub fn write_reward_preset(preset: Preset, dir: &Path, seed: u64, head: &[f32]) -> Result<()> {
    write_preset(preset, dir, seed)?;
    let config = preset_config(preset);
    if head.len() != config.hidden_size {
        return Err(ModelError::input(format!(
            "a head of {} values for hidden size {}",
            head.len(),
            config.hidden_size
        )));
    }
    let weights = dir.join(crate::checkpoint::SINGLE_FILE);
    let mut tensors =
        candle_core::safetensors::load(&weights, &Device::Cpu).ctx("preset weights")?;
    let score = Tensor::from_slice(head, (1, head.len()), &Device::Cpu).ctx("score.weight")?;
    tensors.insert(crate::reward::SCORE.to_owned(), score);
    candle_core::safetensors::save(&tensors, &weights).ctx("preset weights")?;
    let mut json = config.to_hf_json();
    json["architectures"] = serde_json::json!([format!(
        "{}ForSequenceClassification",
        config
            .architecture
            .class_name()
            .trim_end_matches("ForCausalLM")
    )]);
    json["id2label"] = serde_json::json!({"0": "LABEL_0"});
    json["label2id"] = serde_json::json!({"LABEL_0": 0});
    write_json(&dir.join("config.json"), &json)
}
