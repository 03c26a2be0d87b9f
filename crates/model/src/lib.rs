//! Sluice's decoder-only transformer on candle: Llama, Qwen2 and Qwen3 checkpoints from Hugging
//! Face directories, one implementation serving the trainer (differentiable forward over packed
//! batches) and the engine (KV-cached prefill and ragged batched decode), tokenizer and chat
//! templates.
//!
//! | module | what it holds |
//! |---|---|
//! | [`config`] | [`ModelConfig`] from `config.json` (Llama / Qwen2 / Qwen3, GQA, llama3 RoPE scaling), refused fields |
//! | [`names`] | HF tensor names and shapes per config: the single list loading, saving, init and training share |
//! | [`gguf`] | [`gguf::import_gguf`]: a llama.cpp GGUF file (llama / qwen2 / qwen3, any candle-readable quant type) as an HF directory, tokenizer included; [`gguf::export_gguf`] the reverse for tests |
//! | [`snapshot`] | [`ModelWeights`]: immutable, versioned, `Arc`-shared weights the trainer publishes and engines swap in |
//! | [`checkpoint`] | [`load_checkpoint`] / [`save_checkpoint`]: safetensors (memory-mapped, sharded with index), HF layout |
//! | [`batch`] | [`PackedBatch`]: sequences packed in `(B, L)` rows with positions, segments, next-token targets |
//! | [`train`] | [`TrainableModel`]: parameters as `Var`s, [`TrainableModel::token_scores`] (log-probs + entropy, chunked) |
//! | [`amx`] | bf16 products on Intel AMX tiles ([`amx::Bf16Weight`]): the engine's (weights packed once per version) and the trainer's (`trainer.compute_dtype = "bf16"`, operands rounded per product) |
//! | [`low_rank`] | [`low_rank::LowRank`]: LoRA's adapters, whose gradients the training backward forms in place of the weights' ([`TrainableModel::set_low_rank`]) |
//! | [`fused`] | the training forward's fused CPU ops with hand-written backward (linear, RMSNorm, RoPE, SwiGLU, packed attention) |
//! | [`cache`] | [`KvCache`] trait and [`ContiguousKvCache`] |
//! | [`paged`] | [`PagedKvCache`]: fixed-size blocks from one pool, block tables, prefix sharing by content and weight version |
//! | [`infer`] | [`InferenceModel`]: [`InferenceModel::step`] for prefill/decode of many sequences, weight swap |
//! | [`tokenizer`] | [`Tokenizer`]: `tokenizer.json` + special tokens, eos ids, chat template |
//! | [`chat`] | [`ChatTemplate`] rendering as transformers does, [`CompletionParser`] for reasoning and tool calls |
//! | [`threads`] | [`ComputePool`]: the threads a role's model work runs on; the process-wide thread environment |
//! | [`presets`] | `tiny` / `small` directories: config, seeded weights, char tokenizer, ChatML template |
//! | `kernels` | (`cuda` builds) Sluice's own CUDA kernels, `kernels/*.cu` compiled to PTX by `build.rs`, loaded per device |
//! | [`device`](mod@device) | [`device()`]: a config's `cpu` / `cuda:N` as a candle device; CUDA's libraries loaded on demand |
//! | [`error`] | [`ModelError`] with stable `kind()` names |
//! | [`section`] | [`ModelSection`](section::ModelSection): the `[model]` section of the run config (not `config.json`), and the [`ModelPreset`](section::ModelPreset)s |
//!
//! Typical use:
//!
//! ```no_run
//! # fn main() -> Result<(), sluice_model::ModelError> {
//! use std::sync::Arc;
//! use sluice_model::*;
//! let dir = std::path::Path::new("/tmp/tiny");
//! presets::write_preset(presets::Preset::Tiny, dir, 0)?;
//! let snapshot = Arc::new(load_checkpoint(dir, &LoadOptions::default())?);
//! // Engine side: share the snapshot, decode with a cache.
//! let model = InferenceModel::new(Arc::clone(&snapshot))?;
//! let mut cache = ContiguousKvCache::new(model.config(), snapshot.dtype(), snapshot.device());
//! let logits = model.step(&mut cache, &[StepInput { seq: 1, tokens: &[5, 6, 7] }], LogitsWanted::Last)?;
//! // Trainer side: own copies as Vars, score packed batches, publish new snapshots.
//! let trainable = TrainableModel::from_snapshot(&snapshot, candle_core::DType::F32)?;
//! let batch = PackedBatch::from_rows(&[vec![&[5, 6, 7][..]]], 8, 0)?;
//! let scores = trainable.token_scores(&batch, ForwardOptions::default())?;
//! let next = trainable.snapshot(snapshot.version.next(), None)?;
//! # let _ = (logits, scores, next); Ok(()) }
//! ```
//!
//! Candle's fused `rms_norm`, `rope` and `softmax_last_dim` have no backward rules; they are used
//! only on the inference path. The training forward uses Sluice's own fused ops ([`fused`]),
//! which do have them, where they apply, and candle's composition elsewhere ([`ops::Kernels`]).

pub mod amx;
pub mod batch;
pub mod cache;
pub mod chat;
pub mod checkpoint;
pub mod config;
pub mod device;
pub mod error;
pub mod fused;
pub mod gguf;
pub mod infer;
#[cfg(feature = "cuda")]
pub mod kernels;
mod layer_grads;
mod layers;
pub mod low_rank;
pub mod names;
pub mod ops;
mod packed;
pub mod paged;
pub mod presets;
mod ragged;
pub mod reward;
pub mod saved;
mod scores;
pub mod section;
pub mod snapshot;
mod step_weights;
pub mod threads;
pub mod tokenizer;
pub mod train;

/// The candle version this crate is built on, for callers that build tensors themselves.
pub use candle_core as candle;

pub use batch::PackedBatch;
pub use cache::{ContiguousKvCache, KvCache, SeqId};
pub use chat::{ChatOptions, ChatTemplate, CompletionParseError, CompletionParser};
pub use checkpoint::{
    LoadOptions, SaveOptions, check_checkpoint, copy_aux_files, load_checkpoint, save_checkpoint,
};
pub use config::{Architecture, ModelConfig};
pub use error::{ModelError, Result};
pub use infer::{DecodeGraphStats, InferenceModel, LogitsWanted, StepInput, argmax_rows};
pub use paged::PagedKvCache;
pub use reward::RewardModel;
pub use saved::{Activations, SavedActivations};
pub use scores::recomputed_logit_chunks;
pub use snapshot::ModelWeights;
pub use threads::ComputePool;
pub use tokenizer::Tokenizer;
pub use train::{ForwardOptions, TokenScores, TrainableModel};

pub use device::device;
