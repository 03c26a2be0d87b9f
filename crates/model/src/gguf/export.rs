//! [`export_gguf`]: a model directory written as a GGUF file the way llama.cpp's converter lays
//! it out (its tensor names, llama q/k rows permuted, matrices quantised, a byte-level BPE
//! tokenizer in `tokenizer.*` metadata). It exists so the importer can be tested on files whose
//! exact contents are known; it is the importer's inverse, not a general converter.

use std::fs::File;
use std::io::{BufWriter, Seek, SeekFrom, Write};
use std::path::Path;

use candle_core::quantized::gguf_file::{self, Value as G};
use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{DType, Device};
use serde_json::Value;

use super::reader::gguf_err;
use super::weights::{gguf_name, permute_rows, permuted_heads};
use crate::checkpoint::{LoadOptions, load_checkpoint, read_json};
use crate::error::{ModelError, Result};
use crate::names::parameter_specs;

/// How to export.
#[derive(Debug, Clone)]
pub struct ExportOptions {
    /// Type of the 2-D weights (F32, F16, Q8_0, Q4_1, …); a matrix whose rows do not fill
    /// whole blocks of that type, and every 1-D tensor, stays F32.
    pub matrix_type: GgmlDType,
    /// `tokenizer.ggml.pre` written (the directory's pre-tokenizer must be what it stands for).
    pub pre_tokenizer: String,
    /// GGUF version, 2 or 3 (the layouts are the same for little-endian files).
    pub version: u32,
}

impl Default for ExportOptions {
    fn default() -> Self {
        Self {
            matrix_type: GgmlDType::F32,
            pre_tokenizer: "gpt2".into(),
            version: 3,
        }
    }
}

/// Writes the model directory `dir` (config, weights, byte-level BPE `tokenizer.json`,
/// `tokenizer_config.json`) as the GGUF file `path`.
pub fn export_gguf(dir: &Path, path: &Path, options: &ExportOptions) -> Result<()> {
    let snapshot = load_checkpoint(
        dir,
        &LoadOptions {
            dtype: Some(DType::F32),
            device: Device::Cpu,
        },
    )?;
    let config = snapshot.config();
    if config.rope_scaling.is_some() {
        return Err(gguf_err(
            path,
            "rope_scaling cannot be exported (the importer refuses it)",
        ));
    }
    let arch = config.architecture.model_type();
    let key = |k: &str| format!("{arch}.{k}");
    let u32v = |n: usize| G::U32(n as u32);
    let mut meta: Vec<(String, G)> = vec![
        ("general.architecture".into(), G::String(arch.into())),
        ("general.alignment".into(), G::U32(32)),
        (key("block_count"), u32v(config.num_layers)),
        (key("context_length"), u32v(config.max_position_embeddings)),
        (key("embedding_length"), u32v(config.hidden_size)),
        (key("feed_forward_length"), u32v(config.intermediate_size)),
        (key("attention.head_count"), u32v(config.num_heads)),
        (key("attention.head_count_kv"), u32v(config.num_kv_heads)),
        (key("attention.key_length"), u32v(config.head_dim)),
        (key("attention.value_length"), u32v(config.head_dim)),
        (key("rope.dimension_count"), u32v(config.head_dim)),
        (
            key("attention.layer_norm_rms_epsilon"),
            G::F32(config.rms_norm_eps as f32),
        ),
        (key("rope.freq_base"), G::F32(config.rope_theta as f32)),
        (key("vocab_size"), u32v(config.vocab_size)),
    ];
    meta.extend(tokenizer_metadata(dir, options, &config.eos_token_ids)?);

    let mut tensors: Vec<(String, QTensor)> = Vec::new();
    for spec in parameter_specs(config) {
        let name = gguf_name(&spec.name).expect("every parameter has a llama.cpp name");
        let t = snapshot
            .get(&spec.name)
            .expect("a snapshot holds every parameter");
        let ctx = |e: candle_core::Error| gguf_err(path, format!("tensor `{name}`: {e}"));
        let t = match permuted_heads(config, &spec.name) {
            Some(heads) => permute_rows(t, heads).map_err(ctx)?,
            None => t.clone(),
        };
        let dims = t.dims();
        let quantise = dims.len() == 2 && dims[1] % options.matrix_type.block_size() == 0;
        let ty = if quantise {
            options.matrix_type
        } else {
            GgmlDType::F32
        };
        tensors.push((name.clone(), QTensor::quantize(&t, ty).map_err(ctx)?));
    }
    write_file(path, &meta, &tensors, options.version)
}

fn write_file(
    path: &Path,
    meta: &[(String, G)],
    tensors: &[(String, QTensor)],
    version: u32,
) -> Result<()> {
    if !(2..=3).contains(&version) {
        return Err(ModelError::input(format!(
            "GGUF version {version}: only 2 and 3 can be written"
        )));
    }
    let file = File::create(path).map_err(|e| ModelError::io(path, e))?;
    let mut w = BufWriter::new(file);
    let meta_refs: Vec<(&str, &G)> = meta.iter().map(|(k, v)| (k.as_str(), v)).collect();
    let tensor_refs: Vec<(&str, &QTensor)> = tensors.iter().map(|(k, v)| (k.as_str(), v)).collect();
    gguf_file::write(&mut w, &meta_refs, &tensor_refs)
        .map_err(|e| gguf_err(path, format!("writing: {e}")))?;
    // candle writes version 2; version 3 differs only in allowing big-endian files.
    let io = |e| ModelError::io(path, e);
    w.seek(SeekFrom::Start(4)).map_err(io)?;
    w.write_all(&version.to_le_bytes()).map_err(io)?;
    w.flush().map_err(io)
}

/// `tokenizer.*` metadata from `dir`'s byte-level BPE `tokenizer.json` and its config files.
fn tokenizer_metadata(
    dir: &Path,
    options: &ExportOptions,
    eos_ids: &[u32],
) -> Result<Vec<(String, G)>> {
    let path = dir.join("tokenizer.json");
    let tj = read_json(&path)?;
    let bad = |reason: &str| ModelError::Tokenizer {
        path: path.display().to_string(),
        reason: reason.to_owned(),
    };
    let model = &tj["model"];
    if model["type"] != "BPE" {
        return Err(bad("only BPE tokenizers can be exported"));
    }
    let vocab = model["vocab"]
        .as_object()
        .ok_or_else(|| bad("no model.vocab"))?;
    let mut tokens: Vec<Option<String>> = Vec::new();
    let mut types: Vec<i32> = Vec::new();
    let mut place = |id: usize, tok: &str, ty: i32| {
        if tokens.len() <= id {
            tokens.resize(id + 1, None);
            types.resize(id + 1, 1);
        }
        tokens[id] = Some(tok.to_owned());
        types[id] = ty;
    };
    for (tok, id) in vocab {
        let id = id
            .as_u64()
            .ok_or_else(|| bad("a vocab id is not a number"))?;
        place(id as usize, tok, 1);
    }
    for added in tj["added_tokens"].as_array().into_iter().flatten() {
        let id = added["id"]
            .as_u64()
            .ok_or_else(|| bad("an added token has no id"))?;
        let content = added["content"]
            .as_str()
            .ok_or_else(|| bad("an added token has no content"))?;
        let ty = if added["special"] == true { 3 } else { 4 };
        place(id as usize, content, ty);
    }
    let tokens: Vec<String> = tokens
        .into_iter()
        .enumerate()
        .map(|(i, t)| t.ok_or_else(|| bad(&format!("no token has id {i}"))))
        .collect::<Result<_>>()?;
    let merges: Vec<G> = model["merges"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|m| match m {
            Value::String(s) => Ok(G::String(s.clone())),
            Value::Array(p) if p.len() == 2 => Ok(G::String(format!(
                "{} {}",
                p[0].as_str().unwrap_or_default(),
                p[1].as_str().unwrap_or_default()
            ))),
            _ => Err(bad("a merge is neither \"a b\" nor [a, b]")),
        })
        .collect::<Result<_>>()?;
    let config_path = dir.join("tokenizer_config.json");
    let tc = if config_path.exists() {
        read_json(&config_path)?
    } else {
        Value::Null
    };
    let id_of = |key: &str| -> Option<u32> {
        let v = &tc[key];
        let s = v.as_str().or_else(|| v["content"].as_str())?;
        tokens.iter().position(|t| t == s).map(|i| i as u32)
    };
    let mut meta = vec![
        ("tokenizer.ggml.model".to_owned(), G::String("gpt2".into())),
        (
            "tokenizer.ggml.pre".to_owned(),
            G::String(options.pre_tokenizer.clone()),
        ),
        (
            "tokenizer.ggml.tokens".to_owned(),
            G::Array(tokens.iter().map(|t| G::String(t.clone())).collect()),
        ),
        (
            "tokenizer.ggml.token_type".to_owned(),
            G::Array(types.into_iter().map(G::I32).collect()),
        ),
        ("tokenizer.ggml.merges".to_owned(), G::Array(merges)),
        (
            "tokenizer.ggml.add_bos_token".to_owned(),
            G::Bool(tc["add_bos_token"] == true),
        ),
    ];
    let eos = id_of("eos_token").or_else(|| eos_ids.first().copied());
    for (key, id) in [
        ("bos", id_of("bos_token")),
        ("eos", eos),
        ("unknown", id_of("unk_token")),
        ("padding", id_of("pad_token")),
    ] {
        if let Some(id) = id {
            meta.push((format!("tokenizer.ggml.{key}_token_id"), G::U32(id)));
        }
    }
    if let Some(t) = tc["chat_template"].as_str() {
        meta.push(("tokenizer.chat_template".into(), G::String(t.to_owned())));
    }
    Ok(meta)
}
