//! Hugging Face checkpoint directories in and out: `config.json` plus `model.safetensors`, or
//! shards listed by `model.safetensors.index.json`.
//!
//! Files are memory-mapped and only the tensors the config needs are read (each converted to the
//! requested dtype and device on the way). Saving writes the same tensor names with the
//! `{"format": "pt"}` metadata transformers checks for, the config (with `torch_dtype` updated),
//! a `generation_config.json` when none is there, and an index when sharded.

use std::collections::HashMap;
use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use candle_core::safetensors::Load;
use candle_core::{DType, Device, Tensor};
use safetensors::SafeTensors;
use safetensors::tensor::TensorView;
use serde_json::Value;
use sluice_core::PolicyVersion;
use sluice_core::files::{MIB, read_text_capped};

use crate::config::{ModelConfig, config_err};
use crate::error::{ModelError, Result, TensorContext};
use crate::names::{EMBED, LM_HEAD, parameter_specs};
use crate::snapshot::ModelWeights;

mod header;
mod save;

pub(crate) use save::generation_config;
pub use save::{copy_aux_files, save_checkpoint};

/// File name of an unsharded checkpoint.
pub const SINGLE_FILE: &str = "model.safetensors";
/// File name of the shard index.
pub const INDEX_FILE: &str = "model.safetensors.index.json";

/// Largest JSON file read from a model directory (`config.json`, the shard index,
/// `tokenizer_config.json`, `generation_config.json`): real ones are kilobytes to a few megabytes.
pub const JSON_FILE_MAX_BYTES: u64 = 64 * MIB;
/// Largest `tokenizer.json` read (those of 256k-token vocabularies are around 30 MB).
pub const TOKENIZER_FILE_MAX_BYTES: u64 = 512 * MIB;
/// Largest chat template file read (`chat_template.jinja`, `model.chat_template`).
pub const TEMPLATE_FILE_MAX_BYTES: u64 = 4 * MIB;

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
///
/// Everything [`check_checkpoint`] checks is checked before any tensor data is read.
pub fn load_checkpoint(dir: &Path, options: &LoadOptions) -> Result<ModelWeights> {
    let (config, maps) = open_checkpoint(dir)?;
    let (weights, _) = load_mapped(dir, config, &maps, &[], options)?;
    Ok(weights)
}

/// [`load_checkpoint`] of `dir`'s weights under `config` (read from `dir` by the caller, who
/// may have adapted it: a classifier's head in place of the LM head), with the tensors named
/// by `extra` read besides, each checked present, finite and of a float dtype, in that order.
pub fn load_checkpoint_with(
    dir: &Path,
    config: ModelConfig,
    extra: &[&str],
    options: &LoadOptions,
) -> Result<(ModelWeights, Vec<Tensor>)> {
    let maps = map_weight_files(dir)?;
    load_mapped(dir, config, &maps, extra, options)
}

fn load_mapped(
    dir: &Path,
    config: ModelConfig,
    maps: &Maps,
    extra: &[&str],
    options: &LoadOptions,
) -> Result<(ModelWeights, Vec<Tensor>)> {
    let parsed = parse_headers(maps)?;
    let mut located = locate_tensors(&config, &parsed, dir)?;
    for &name in extra {
        let (path, view) = find_tensor(&parsed, name, dir)?;
        check_float(path, name, &view)?;
        located.push((name.to_owned(), path, view));
    }
    let dtype = options.dtype.unwrap_or(config.dtype);
    let mut tensors = HashMap::new();
    let mut extras = Vec::with_capacity(extra.len());
    for (name, path, view) in located {
        let context = format!("{}: tensor `{name}`", path.display());
        let t = view.load(&options.device).ctx(&context)?;
        if !all_finite(&t).ctx(&context)? {
            return Err(ModelError::NonFinite {
                path: path.clone(),
                name,
            });
        }
        let t = if t.dtype() == dtype {
            t
        } else {
            t.to_dtype(dtype).ctx(&context)?
        };
        if extra.contains(&name.as_str()) {
            extras.push(t);
        } else {
            tensors.insert(name, t);
        }
    }
    let used: usize = tensors.len() + extras.len();
    let present: usize = parsed.iter().map(|(_, st)| st.len()).sum();
    let ignorable = usize::from(config.tie_word_embeddings && has_tensor(&parsed, LM_HEAD));
    if present > used + ignorable {
        tracing::warn!(
            dir = %dir.display(),
            unused = present - used,
            "checkpoint holds tensors the config does not use; they are ignored"
        );
    }
    // The roles that read them run on other threads.
    crate::device::settle(&options.device)?;
    let weights = ModelWeights::new(Arc::new(config), PolicyVersion::INITIAL, tensors)?;
    Ok((weights, extras))
}

/// Checks that `dir` would load, without reading tensor data: `config.json` is valid and within
/// the [`config::limits`](crate::config::limits), the weight files are plain file names inside
/// `dir`, and every tensor the config needs is there with its shape and a float dtype. Returns
/// the config. What this cannot see: NaN or infinite values (they need the data).
pub fn check_checkpoint(dir: &Path) -> Result<ModelConfig> {
    let (config, maps) = open_checkpoint(dir)?;
    let parsed = parse_headers(&maps)?;
    locate_tensors(&config, &parsed, dir)?;
    Ok(config)
}

/// [`check_checkpoint`] of `dir`'s weights under `config` (as [`load_checkpoint_with`] takes
/// it), with the tensors named by `extra` found besides: their shapes, in that order.
pub fn check_checkpoint_with(
    dir: &Path,
    config: &ModelConfig,
    extra: &[&str],
) -> Result<Vec<Vec<usize>>> {
    let maps = map_weight_files(dir)?;
    let parsed = parse_headers(&maps)?;
    locate_tensors(config, &parsed, dir)?;
    extra
        .iter()
        .map(|&name| {
            let (path, view) = find_tensor(&parsed, name, dir)?;
            check_float(path, name, &view)?;
            Ok(view.shape().to_vec())
        })
        .collect()
}

/// The tensor called `name` in the first file holding it.
fn find_tensor<'a>(
    parsed: &'a Parsed<'a>,
    name: &str,
    dir: &Path,
) -> Result<(&'a PathBuf, TensorView<'a>)> {
    parsed
        .iter()
        .find_map(|(path, st)| st.tensor(name).ok().map(|view| (*path, view)))
        .ok_or_else(|| ModelError::MissingTensor {
            name: name.to_owned(),
            dir: dir.to_owned(),
        })
}

type Maps = Vec<(PathBuf, memmap2::Mmap)>;
type Parsed<'a> = Vec<(&'a PathBuf, SafeTensors<'a>)>;

/// The config and the mapped weight files of `dir`.
fn open_checkpoint(dir: &Path) -> Result<(ModelConfig, Maps)> {
    let config = ModelConfig::from_file(&dir.join("config.json"))?;
    Ok((config, map_weight_files(dir)?))
}

/// The mapped weight files of `dir`.
fn map_weight_files(dir: &Path) -> Result<Maps> {
    weight_files(dir)?
        .into_iter()
        .map(|path| mmap(&path).map(|map| (path, map)))
        .collect()
}

/// The safetensors headers of the mapped files (no tensor data is touched).
fn parse_headers(maps: &Maps) -> Result<Parsed<'_>> {
    maps.iter()
        .map(|(path, bytes)| {
            SafeTensors::deserialize(bytes)
                .map(|st| (path, st))
                .map_err(|e| ModelError::Safetensors {
                    path: path.clone(),
                    reason: header::diagnose(bytes).unwrap_or_else(|| e.to_string()),
                })
        })
        .collect()
}

/// Every tensor the config needs, found in the headers with its shape and a float dtype. The
/// config's sizes are checked against the tensors first ([`check_config_against_tensors`]), so
/// the per-layer list of names is only built for as many layers as the files hold.
fn locate_tensors<'a>(
    config: &ModelConfig,
    parsed: &'a Parsed<'a>,
    dir: &Path,
) -> Result<Vec<(String, &'a PathBuf, TensorView<'a>)>> {
    let mut views: HashMap<String, (&PathBuf, TensorView<'_>)> = HashMap::new();
    for (path, st) in parsed {
        for (name, view) in st.tensors() {
            views.entry(name).or_insert((*path, view));
        }
    }
    check_config_against_tensors(config, &views, dir)?;
    let mut out = Vec::new();
    for spec in parameter_specs(config) {
        let Some((path, view)) = views.remove(&spec.name) else {
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
        check_float(path, &spec.name, &view)?;
        out.push((spec.name, path, view));
    }
    Ok(out)
}

/// A tensor's stored dtype is one a model computes in (converted on load).
fn check_float(path: &Path, name: &str, view: &TensorView<'_>) -> Result<()> {
    if matches!(
        view.dtype(),
        safetensors::Dtype::F16
            | safetensors::Dtype::BF16
            | safetensors::Dtype::F32
            | safetensors::Dtype::F64
    ) {
        return Ok(());
    }
    Err(ModelError::TensorDtype {
        path: path.to_owned(),
        name: name.to_owned(),
        dtype: format!("{:?}", view.dtype()),
    })
}

/// The config's layer count, vocabulary, widths and heads against the tensors that carry them
/// (the embedding and layer 0's projections), each mismatch naming the `config.json` field: a
/// config claiming 10⁹ layers over a two-layer file is refused here, before anything is built
/// per layer.
fn check_config_against_tensors(
    config: &ModelConfig,
    views: &HashMap<String, (&PathBuf, TensorView<'_>)>,
    dir: &Path,
) -> Result<()> {
    let origin = dir.join("config.json").display().to_string();
    let mut layers = std::collections::BTreeSet::new();
    for name in views.keys() {
        if let Some(index) = name
            .strip_prefix("model.layers.")
            .and_then(|rest| rest.split('.').next())
            .and_then(|i| i.parse::<usize>().ok())
        {
            layers.insert(index);
        }
    }
    // Layers past the config's count are ignored (with a warning) as any unused tensor is.
    let held = layers.len();
    if config.num_layers > held {
        return Err(config_err(
            &origin,
            "num_hidden_layers",
            format!(
                "{} but the weight files hold {held} layers",
                config.num_layers
            ),
        ));
    }
    let h = config.hidden_size;
    let d = config.head_dim;
    let checks: [(&str, &str, [usize; 2], &str); 4] = [
        (EMBED, "vocab_size", [config.vocab_size, h], "hidden_size"),
        (
            "model.layers.0.self_attn.q_proj.weight",
            "num_attention_heads",
            [config.num_heads * d, h],
            "head_dim",
        ),
        (
            "model.layers.0.self_attn.k_proj.weight",
            "num_key_value_heads",
            [config.num_kv_heads * d, h],
            "head_dim",
        ),
        (
            "model.layers.0.mlp.gate_proj.weight",
            "intermediate_size",
            [config.intermediate_size, h],
            "hidden_size",
        ),
    ];
    for (name, rows_field, expected, cols_field) in checks {
        let Some((_, view)) = views.get(name) else {
            continue; // reported as a missing tensor by the caller
        };
        let actual = view.shape();
        if actual.len() == 2 && actual[0] != expected[0] {
            return Err(config_err(
                &origin,
                rows_field,
                format!(
                    "implies {name} has {} rows; it has shape {actual:?}",
                    expected[0]
                ),
            ));
        }
        if actual.len() == 2 && actual[1] != expected[1] {
            let field = if name == EMBED {
                cols_field
            } else {
                "hidden_size"
            };
            return Err(config_err(
                &origin,
                field,
                format!(
                    "implies {name} has {} columns; it has shape {actual:?}",
                    expected[1]
                ),
            ));
        }
    }
    Ok(())
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
            if !is_plain_file_name(name) {
                return Err(ModelError::Safetensors {
                    path: index.clone(),
                    reason: format!(
                        "weight_map names `{name}`: shard names must be plain file names inside the model directory"
                    ),
                });
            }
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

/// Whether `name` is a plain file name: no directory part, not `.` or `..`, so joined to the model
/// directory it stays inside it (a symlink there, as in the HF cache, is still followed).
fn is_plain_file_name(name: &str) -> bool {
    !name.is_empty()
        && name != "."
        && name != ".."
        && !name.contains(['/', '\\', '\0'])
        && Path::new(name).components().count() == 1
}

/// Maps a regular file read-only.
#[allow(unsafe_code)]
fn mmap(path: &Path) -> Result<memmap2::Mmap> {
    let meta = std::fs::metadata(path).map_err(|e| ModelError::io(path, e))?;
    if !meta.is_file() {
        return Err(ModelError::Safetensors {
            path: path.to_owned(),
            reason: "not a regular file".into(),
        });
    }
    let file = File::open(path).map_err(|e| ModelError::io(path, e))?;
    // SAFETY: the map is read-only and lives only while this load runs. The one hazard is another
    // process truncating the file meanwhile (SIGBUS); checkpoints are written to a new directory
    // and never rewritten in place by Sluice.
    unsafe { memmap2::Mmap::map(&file) }.map_err(|e| ModelError::io(path, e))
}

/// Reads a JSON file.
pub(crate) fn read_json(path: &Path) -> Result<Value> {
    let text = read_text_capped(path, JSON_FILE_MAX_BYTES, "model JSON files")?;
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
