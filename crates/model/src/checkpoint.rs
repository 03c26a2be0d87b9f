//! Hugging Face checkpoint directories in and out: `config.json` plus `model.safetensors`, or
//! shards listed by `model.safetensors.index.json`.
//!
//! Files are memory-mapped and only the tensors the config needs are read (each converted to the
//! requested dtype and device on the way). Saving writes the same tensor names with the
//! `{"format": "pt"}` metadata transformers checks for, the config (with `torch_dtype` updated),
//! a `generation_config.json` when none is there, and an index when sharded.

use std::collections::{BTreeMap, HashMap};
use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use candle_core::safetensors::Load;
use candle_core::{DType, Device, Tensor};
use safetensors::SafeTensors;
use serde_json::{Value, json};
use sluice_core::PolicyVersion;

use crate::config::ModelConfig;
use crate::error::{ModelError, Result, TensorContext};
use crate::names::{LM_HEAD, parameter_specs};
use crate::snapshot::ModelWeights;

/// File name of an unsharded checkpoint.
pub const SINGLE_FILE: &str = "model.safetensors";
/// File name of the shard index.
pub const INDEX_FILE: &str = "model.safetensors.index.json";

/// Files besides the weights that make a directory usable by tokenizers and chat code.
pub const AUX_FILES: &[&str] = &[
    "tokenizer.json",
    "tokenizer_config.json",
    "generation_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
];

/// How to load a checkpoint.
#[derive(Debug, Clone)]
pub struct LoadOptions {
    /// Dtype of the loaded tensors (`None`: keep what the files hold, per `config.json`).
    pub dtype: Option<DType>,
    /// Where the tensors go.
    pub device: Device,
}

impl Default for LoadOptions {
    fn default() -> Self {
        Self {
            dtype: None,
            device: Device::Cpu,
        }
    }
}

/// How to save a checkpoint.
#[derive(Debug, Clone, Default)]
pub struct SaveOptions {
    /// Split into shards of at most this many bytes (a tensor larger than that gets a shard of
    /// its own); `None` writes one `model.safetensors`.
    pub max_shard_bytes: Option<usize>,
}

/// Reads `dir/config.json` and the weights, as policy version 0.
pub fn load_checkpoint(dir: &Path, options: &LoadOptions) -> Result<ModelWeights> {
    let config = Arc::new(ModelConfig::from_file(&dir.join("config.json"))?);
    let files = weight_files(dir)?;
    let mut maps = Vec::with_capacity(files.len());
    for path in &files {
        maps.push((path.clone(), mmap(path)?));
    }
    let mut parsed = Vec::with_capacity(maps.len());
    for (path, bytes) in &maps {
        let st = SafeTensors::deserialize(bytes).map_err(|e| ModelError::Safetensors {
            path: path.clone(),
            reason: e.to_string(),
        })?;
        parsed.push((path, st));
    }
    let dtype = options.dtype.unwrap_or(config.dtype);
    let mut tensors = HashMap::new();
    for spec in parameter_specs(&config) {
        let found = parsed
            .iter()
            .find_map(|(path, st)| st.tensor(&spec.name).ok().map(|v| (*path, v)));
        let Some((path, view)) = found else {
            return Err(ModelError::MissingTensor {
                name: spec.name,
                dir: dir.to_owned(),
            });
        };
        if view.shape() != spec.shape.as_slice() {
            return Err(ModelError::TensorShape {
                name: spec.name,
                expected: spec.shape,
                actual: view.shape().to_vec(),
            });
        }
        let context = format!("{}: tensor `{}`", path.display(), spec.name);
        let t = view.load(&options.device).ctx(&context)?;
        if !all_finite(&t).ctx(&context)? {
            return Err(ModelError::NonFinite {
                path: path.clone(),
                name: spec.name,
            });
        }
        let t = if t.dtype() == dtype {
            t
        } else {
            t.to_dtype(dtype).ctx(&context)?
        };
        tensors.insert(spec.name, t);
    }
    let used: usize = tensors.len();
    let present: usize = parsed.iter().map(|(_, st)| st.len()).sum();
    let ignorable = usize::from(config.tie_word_embeddings && has_tensor(&parsed, LM_HEAD));
    if present > used + ignorable {
        tracing::warn!(
            dir = %dir.display(),
            unused = present - used,
            "checkpoint holds tensors the config does not use; they are ignored"
        );
    }
    ModelWeights::new(config, PolicyVersion::INITIAL, tensors)
}

/// Whether every value of `t` is finite: `0 · x` is 0 for finite `x` and NaN for NaN or ±∞, so
/// the sum is 0 exactly when all are (one pass, in f32 whatever the stored dtype).
fn all_finite(t: &Tensor) -> candle_core::Result<bool> {
    let s = t
        .to_dtype(DType::F32)?
        .affine(0.0, 0.0)?
        .sum_all()?
        .to_scalar::<f32>()?;
    Ok(s == 0.0)
}

fn has_tensor(parsed: &[(&PathBuf, SafeTensors<'_>)], name: &str) -> bool {
    parsed.iter().any(|(_, st)| st.tensor(name).is_ok())
}

/// The safetensors files of `dir`: the index's shards, or the single file.
fn weight_files(dir: &Path) -> Result<Vec<PathBuf>> {
    let index = dir.join(INDEX_FILE);
    if index.exists() {
        let value = read_json(&index)?;
        let map = value
            .get("weight_map")
            .and_then(Value::as_object)
            .ok_or_else(|| ModelError::Safetensors {
                path: index.clone(),
                reason: "no `weight_map` object".into(),
            })?;
        let mut files: Vec<PathBuf> = Vec::new();
        for file in map.values() {
            let name = file.as_str().ok_or_else(|| ModelError::Safetensors {
                path: index.clone(),
                reason: format!("weight_map value {file} is not a file name"),
            })?;
            let path = dir.join(name);
            if !files.contains(&path) {
                files.push(path);
            }
        }
        Ok(files)
    } else {
        let single = dir.join(SINGLE_FILE);
        if single.exists() {
            Ok(vec![single])
        } else {
            Err(ModelError::io(
                single,
                std::io::Error::new(
                    std::io::ErrorKind::NotFound,
                    format!("neither {SINGLE_FILE} nor {INDEX_FILE} exists"),
                ),
            ))
        }
    }
}

/// Maps a file read-only.
#[allow(unsafe_code)]
fn mmap(path: &Path) -> Result<memmap2::Mmap> {
    let file = File::open(path).map_err(|e| ModelError::io(path, e))?;
    // SAFETY: the map is read-only and lives only while this load runs. The one hazard is another
    // process truncating the file meanwhile (SIGBUS); checkpoints are written to a new directory
    // and never rewritten in place by Sluice.
    unsafe { memmap2::Mmap::map(&file) }.map_err(|e| ModelError::io(path, e))
}

/// Reads a JSON file.
pub(crate) fn read_json(path: &Path) -> Result<Value> {
    let text = std::fs::read_to_string(path).map_err(|e| ModelError::io(path, e))?;
    serde_json::from_str(&text).map_err(|source| ModelError::Json {
        path: path.to_owned(),
        source,
    })
}

/// Writes `value` as pretty JSON with a trailing newline.
pub(crate) fn write_json(path: &Path, value: &Value) -> Result<()> {
    let mut text = serde_json::to_string_pretty(value).map_err(|source| ModelError::Json {
        path: path.to_owned(),
        source,
    })?;
    text.push('\n');
    std::fs::write(path, text).map_err(|e| ModelError::io(path, e))
}

/// Writes `snapshot` to `dir` (created if needed) in HF format. Stale weight files from an
/// earlier save in the same directory are removed so loaders never see two layouts.
pub fn save_checkpoint(snapshot: &ModelWeights, dir: &Path, options: &SaveOptions) -> Result<()> {
    std::fs::create_dir_all(dir).map_err(|e| ModelError::io(dir, e))?;
    remove_stale_weights(dir)?;
    let mut config = (**snapshot.config()).clone();
    config.dtype = snapshot.dtype();
    write_json(&dir.join("config.json"), &config.to_hf_json())?;
    let gen_path = dir.join("generation_config.json");
    if !gen_path.exists() {
        write_json(&gen_path, &generation_config(&config))?;
    }
    let cpu: Vec<(String, Tensor)> = snapshot
        .iter()
        .map(|(n, t)| {
            let t = t.to_device(&Device::Cpu).and_then(|t| t.contiguous());
            t.ctx(n).map(|t| (n.to_owned(), t))
        })
        .collect::<Result<_>>()?;
    let shards = plan_shards(&cpu, options.max_shard_bytes);
    let metadata = Some(HashMap::from([("format".to_owned(), "pt".to_owned())]));
    if shards.len() == 1 {
        return write_shard(&cpu, &dir.join(SINGLE_FILE), metadata);
    }
    let total = shards.len();
    let mut weight_map = BTreeMap::new();
    for (i, shard) in shards.iter().enumerate() {
        let file = format!("model-{:05}-of-{total:05}.safetensors", i + 1);
        let members: Vec<(String, Tensor)> = shard.iter().map(|&k| cpu[k].clone()).collect();
        for (name, _) in &members {
            weight_map.insert(name.clone(), file.clone());
        }
        write_shard(&members, &dir.join(&file), metadata.clone())?;
    }
    let total_size: usize = cpu.iter().map(|(_, t)| bytes_of(t)).sum();
    let index = json!({"metadata": {"total_size": total_size}, "weight_map": weight_map});
    write_json(&dir.join(INDEX_FILE), &index)
}

/// Copies tokenizer and chat files from `src` to `dst` (those that exist), so a saved
/// checkpoint is a complete model directory.
pub fn copy_aux_files(src: &Path, dst: &Path) -> Result<()> {
    std::fs::create_dir_all(dst).map_err(|e| ModelError::io(dst, e))?;
    for name in AUX_FILES {
        let from = src.join(name);
        if from.exists() {
            std::fs::copy(&from, dst.join(name)).map_err(|e| ModelError::io(&from, e))?;
        }
    }
    Ok(())
}

/// A `generation_config.json` carrying the config's bos/eos ids.
pub(crate) fn generation_config(config: &ModelConfig) -> Value {
    let mut generation = serde_json::Map::new();
    if let Some(bos) = config.bos_token_id {
        generation.insert("bos_token_id".into(), json!(bos));
    }
    if !config.eos_token_ids.is_empty() {
        generation.insert("eos_token_id".into(), json!(config.eos_token_ids));
    }
    generation.insert("transformers_version".into(), json!("4.51.0"));
    Value::Object(generation)
}

fn bytes_of(t: &Tensor) -> usize {
    t.elem_count() * t.dtype().size_in_bytes()
}

/// Greedy split in checkpoint order: a new shard starts when the next tensor would overflow.
fn plan_shards(tensors: &[(String, Tensor)], max_bytes: Option<usize>) -> Vec<Vec<usize>> {
    let Some(max) = max_bytes else {
        return vec![(0..tensors.len()).collect()];
    };
    let mut shards: Vec<Vec<usize>> = vec![Vec::new()];
    let mut size = 0;
    for (i, (_, t)) in tensors.iter().enumerate() {
        let b = bytes_of(t);
        let current = shards.last_mut().expect("never empty");
        if !current.is_empty() && size + b > max {
            shards.push(vec![i]);
            size = b;
        } else {
            current.push(i);
            size += b;
        }
    }
    shards
}

fn write_shard(
    tensors: &[(String, Tensor)],
    path: &Path,
    metadata: Option<HashMap<String, String>>,
) -> Result<()> {
    let items = tensors.iter().map(|(n, t)| (n.as_str(), t));
    safetensors::serialize_to_file(items, metadata, path).map_err(|e| ModelError::Safetensors {
        path: path.to_owned(),
        reason: e.to_string(),
    })
}

fn remove_stale_weights(dir: &Path) -> Result<()> {
    let entries = std::fs::read_dir(dir).map_err(|e| ModelError::io(dir, e))?;
    for entry in entries {
        let entry = entry.map_err(|e| ModelError::io(dir, e))?;
        let name = entry.file_name();
        let name = name.to_string_lossy();
        let is_weights = name == SINGLE_FILE
            || name == INDEX_FILE
            || (name.starts_with("model-") && name.ends_with(".safetensors"));
        if is_weights {
            let path = entry.path();
            std::fs::remove_file(&path).map_err(|e| ModelError::io(&path, e))?;
        }
    }
    Ok(())
}
