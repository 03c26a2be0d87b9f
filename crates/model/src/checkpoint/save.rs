//! Writing a checkpoint directory: the weights (one file or shards with an index), the config
//! with its dtype, `generation_config.json` when none is there, and the tokenizer and template
//! files copied from a source directory.

use std::collections::{BTreeMap, HashMap};
use std::path::Path;

use candle_core::{Device, Tensor};
use serde_json::{Value, json};

use super::{AUX_FILES, INDEX_FILE, SINGLE_FILE, SaveOptions, write_json};
use crate::config::ModelConfig;
use crate::error::{ModelError, Result, TensorContext};
use crate::snapshot::ModelWeights;

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
