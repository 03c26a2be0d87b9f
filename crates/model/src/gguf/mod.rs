//! GGUF import: a llama.cpp model file (llama, qwen2 or qwen3; GGUF v2/v3; any tensor type
//! candle reads) turned into a complete Hugging Face directory that every other part of Sluice
//! loads — `config.json`, `generation_config.json`, `model.safetensors` (dequantised to f32,
//! bf16 or f16), `tokenizer.json` and `tokenizer_config.json` (chat template included).
//!
//! | file | what it does |
//! |---|---|
//! | `header` | the header checked around candle's parser: alignment, duplicates, tensor byte ranges |
//! | `reader` | [`GgufFile`]: candle's parser, typed metadata, tensors dequantised |
//! | `weights` | config from `{arch}.*` metadata, llama.cpp ↔ HF tensor names, q/k row (un)permutation |
//! | `tokenizer` | `tokenizer.json` / `tokenizer_config.json` from `tokenizer.*` metadata |
//! | `export` | [`export_gguf`]: the reverse, a model directory written as GGUF (round-trip tests) |

mod export;
mod header;
mod reader;
mod tokenizer;
mod weights;

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;

use candle_core::DType;
use serde_json::json;
use sluice_core::PolicyVersion;

use crate::checkpoint::{SaveOptions, generation_config, save_checkpoint, write_json};
use crate::config::ModelConfig;
use crate::error::{ModelError, Result};
use crate::snapshot::ModelWeights;

pub use export::{ExportOptions, export_gguf};
pub use reader::{GgufFile, SUPPORTED_TYPES};
pub use tokenizer::{PRE_TOKENIZERS, TOKENIZER_MODELS};
pub use weights::{SUPPORTED_ARCHITECTURES, gguf_name, permute_rows, unpermute_rows};

/// How to import.
#[derive(Debug, Clone)]
pub struct ImportOptions {
    /// Dtype of the written weights (f32 keeps every dequantised value exactly).
    pub dtype: DType,
}

impl Default for ImportOptions {
    fn default() -> Self {
        Self { dtype: DType::F32 }
    }
}

/// What an import found and wrote.
#[derive(Debug, Clone)]
pub struct ImportSummary {
    /// The config written to `config.json`.
    pub config: ModelConfig,
    /// Tensors per ggml type in the file (`{"Q4_1": 210, "F32": 61, …}`).
    pub tensor_types: BTreeMap<String, usize>,
    /// The tokenizer built, in words.
    pub tokenizer: String,
    /// Whether the file has a chat template.
    pub chat_template: bool,
}

/// Reads the GGUF file `path` and writes the HF directory `out` (created if needed).
/// Nothing is written unless the whole file converts.
pub fn import_gguf(path: &Path, out: &Path, options: &ImportOptions) -> Result<ImportSummary> {
    let mut g = GgufFile::open(path)?;
    weights::architecture(&g)?;
    // Built (and checked) before the weights: a refused tokenizer costs no dequantisation.
    let max_length = g
        .uint_opt(&format!(
            "{}.context_length",
            g.string("general.architecture")?
        ))?
        .map_or(4096, |n| n as usize);
    let tok = tokenizer::tokenizer_files(&g, max_length)?;
    let built: tokenizers::Tokenizer =
        serde_json::from_value(tok.tokenizer_json.clone()).map_err(|e| {
            g.err(format!(
                "the tokenizer built from the metadata does not load: {e}"
            ))
        })?;
    let config = weights::config_from_metadata(&g, options.dtype, tok.bos, tok.eos.clone())?;
    if tok.vocab_size > config.vocab_size {
        return Err(g.err(format!(
            "the tokenizer has {} tokens, the embedding only {} rows",
            tok.vocab_size, config.vocab_size
        )));
    }
    let config = Arc::new(config);
    let tensors = weights::load_tensors(&mut g, &config)?;
    let snapshot = ModelWeights::new(Arc::clone(&config), PolicyVersion::INITIAL, tensors)?;

    std::fs::create_dir_all(out).map_err(|e| ModelError::io(out, e))?;
    let mut generation = generation_config(&config);
    if let Some(pad) = tok.pad {
        generation["pad_token_id"] = json!(pad);
    }
    write_json(&out.join("generation_config.json"), &generation)?;
    save_checkpoint(&snapshot, out, &SaveOptions::default())?;
    let tokenizer_path = out.join("tokenizer.json");
    built
        .save(&tokenizer_path, true)
        .map_err(|e| ModelError::Tokenizer {
            path: tokenizer_path.display().to_string(),
            reason: e.to_string(),
        })?;
    write_json(&out.join("tokenizer_config.json"), &tok.tokenizer_config)?;
    Ok(ImportSummary {
        config: (*config).clone(),
        tensor_types: g.type_counts(),
        tokenizer: tok.description,
        chat_template: tok.tokenizer_config["chat_template"].is_string(),
    })
}
