//! [`ModelConfig`]: the architecture read from a Hugging Face `config.json`, validated, and written
//! back in the same format.
//!
//! Fields that change the computation are either implemented or refused with an error naming the
//! field; fields known to be irrelevant to the forward pass (`use_cache`, `initializer_range`, …)
//! are kept and written back untouched; any other field is kept too and logged as a warning, so a
//! new transformers release does not make every checkpoint unloadable.

use std::path::Path;

use candle_core::DType;
use serde_json::{Map, Value, json};

use crate::checkpoint::JSON_FILE_MAX_BYTES;
use crate::error::{ModelError, Result};
use fields::Fields;
use sluice_core::files::read_text_capped;

mod fields;
pub mod limits;

/// Which HF model class the checkpoint is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Architecture {
    /// `LlamaForCausalLM`: no biases, no q/k norm.
    Llama,
    /// `Qwen2ForCausalLM`: bias on q, k and v projections.
    Qwen2,
    /// `Qwen3ForCausalLM`: RMSNorm on each head of q and k, explicit `head_dim`.
    Qwen3,
}

impl Architecture {
    /// The `architectures[0]` string.
    pub fn class_name(self) -> &'static str {
        match self {
            Architecture::Llama => "LlamaForCausalLM",
            Architecture::Qwen2 => "Qwen2ForCausalLM",
            Architecture::Qwen3 => "Qwen3ForCausalLM",
        }
    }

    /// The `model_type` string.
    pub fn model_type(self) -> &'static str {
        match self {
            Architecture::Llama => "llama",
            Architecture::Qwen2 => "qwen2",
            Architecture::Qwen3 => "qwen3",
        }
    }

    pub(crate) fn from_class_name(s: &str) -> Option<Self> {
        [Self::Llama, Self::Qwen2, Self::Qwen3]
            .into_iter()
            .find(|a| a.class_name() == s)
    }
}

/// Llama-3-style frequency scaling (`rope_scaling.rope_type = "llama3"`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Llama3RopeScaling {
    /// `factor`.
    pub factor: f64,
    /// `low_freq_factor`.
    pub low_freq_factor: f64,
    /// `high_freq_factor`.
    pub high_freq_factor: f64,
    /// `original_max_position_embeddings`.
    pub original_max_position_embeddings: usize,
}

/// A validated decoder configuration.
#[derive(Debug, Clone, PartialEq)]
pub struct ModelConfig {
    /// Model class.
    pub architecture: Architecture,
    /// `vocab_size`.
    pub vocab_size: usize,
    /// `hidden_size`.
    pub hidden_size: usize,
    /// `intermediate_size` (SwiGLU MLP width).
    pub intermediate_size: usize,
    /// `num_hidden_layers`.
    pub num_layers: usize,
    /// `num_attention_heads`.
    pub num_heads: usize,
    /// `num_key_value_heads` (GQA; equals `num_heads` when absent).
    pub num_kv_heads: usize,
    /// `head_dim` (`hidden_size / num_heads` when absent).
    pub head_dim: usize,
    /// `rms_norm_eps`.
    pub rms_norm_eps: f64,
    /// `rope_theta`.
    pub rope_theta: f64,
    /// `rope_scaling` of type `llama3`, if any.
    pub rope_scaling: Option<Llama3RopeScaling>,
    /// `max_position_embeddings`.
    pub max_position_embeddings: usize,
    /// `tie_word_embeddings`: the LM head reuses `model.embed_tokens.weight`.
    pub tie_word_embeddings: bool,
    /// `torch_dtype` / `dtype`: the dtype the checkpoint is stored in.
    pub dtype: DType,
    /// `bos_token_id`.
    pub bos_token_id: Option<u32>,
    /// `eos_token_id` (one id or a list).
    pub eos_token_ids: Vec<u32>,
    /// Every other field of `config.json`, written back unchanged on save.
    pub extra: Map<String, Value>,
}

/// Fields that do not change the forward pass; kept and written back without comment.
const HARMLESS: &[&str] = &[
    "_name_or_path",
    "transformers_version",
    "initializer_range",
    "use_cache",
    "pad_token_id",
    "max_window_layers",
    "sliding_window",
    "output_attentions",
    "output_hidden_states",
    "return_dict",
    "id2label",
    "label2id",
    "unsloth_version",
    "quantization_config_none",
];

impl ModelConfig {
    /// Does the architecture put a bias on the q/k/v projections?
    pub fn qkv_bias(&self) -> bool {
        self.architecture == Architecture::Qwen2
    }

    /// Does the architecture RMS-normalize each head of q and k?
    pub fn qk_norm(&self) -> bool {
        self.architecture == Architecture::Qwen3
    }

    /// Query heads per key/value head.
    pub fn kv_groups(&self) -> usize {
        self.num_heads / self.num_kv_heads
    }

    /// Number of scalar parameters (an untied LM head counted once).
    pub fn num_parameters(&self) -> usize {
        let (h, i, d) = (self.hidden_size, self.intermediate_size, self.head_dim);
        let q = self.num_heads * d;
        let kv = self.num_kv_heads * d;
        let mut layer = h * q + 2 * h * kv + q * h + 3 * h * i + 2 * h;
        if self.qkv_bias() {
            layer += q + 2 * kv;
        }
        if self.qk_norm() {
            layer += 2 * d;
        }
        let head = if self.tie_word_embeddings {
            0
        } else {
            self.vocab_size * h
        };
        self.vocab_size * h + self.num_layers * layer + h + head
    }

    /// Reads and validates `config.json`.
    pub fn from_file(path: &Path) -> Result<Self> {
        let text = read_text_capped(path, JSON_FILE_MAX_BYTES, "model JSON files")?;
        let value: Value = serde_json::from_str(&text).map_err(|source| ModelError::Json {
            path: path.to_owned(),
            source,
        })?;
        Self::from_json(&value, &path.display().to_string())
    }

    /// Validates a parsed `config.json`; `origin` names it in errors.
    pub fn from_json(value: &Value, origin: &str) -> Result<Self> {
        let Value::Object(map) = value else {
            return Err(config_err(origin, "<root>", "expected a JSON object"));
        };
        let mut f = Fields {
            map: map.clone(),
            origin,
        };
        let architecture = f.architecture()?;
        let hidden_size = f.usize_req("hidden_size")?;
        let num_heads = f.usize_req("num_attention_heads")?;
        let num_kv_heads = f.usize_opt("num_key_value_heads")?.unwrap_or(num_heads);
        if num_kv_heads == 0 || num_heads % num_kv_heads != 0 {
            return Err(config_err(
                origin,
                "num_key_value_heads",
                format!("{num_kv_heads} must divide num_attention_heads = {num_heads}"),
            ));
        }
        let head_dim = match f.usize_opt("head_dim")? {
            Some(d) => d,
            None if hidden_size % num_heads == 0 => hidden_size / num_heads,
            None => {
                return Err(config_err(
                    origin,
                    "head_dim",
                    "absent and hidden_size is not a multiple of num_attention_heads",
                ));
            }
        };
        if head_dim % 2 != 0 {
            return Err(config_err(origin, "head_dim", "must be even for RoPE"));
        }
        let config = ModelConfig {
            architecture,
            vocab_size: f.usize_req("vocab_size")?,
            hidden_size,
            intermediate_size: f.usize_req("intermediate_size")?,
            num_layers: f.usize_req("num_hidden_layers")?,
            num_heads,
            num_kv_heads,
            head_dim,
            rms_norm_eps: f.f64_opt("rms_norm_eps")?.unwrap_or(1e-6),
            rope_theta: f.f64_opt("rope_theta")?.unwrap_or(10_000.0),
            rope_scaling: f.rope_scaling()?,
            max_position_embeddings: f.usize_opt("max_position_embeddings")?.unwrap_or(4096),
            tie_word_embeddings: f.bool_opt("tie_word_embeddings")?.unwrap_or(false),
            dtype: f.dtype()?,
            bos_token_id: f.u32_opt("bos_token_id")?,
            eos_token_ids: f.eos_ids()?,
            extra: Map::new(),
        };
        for (field, value, max) in limits::bounded_fields(&config) {
            if value > max {
                return Err(config_err(
                    origin,
                    field,
                    format!("{value} is over the limit of {max}"),
                ));
            }
        }
        let vocab = config.vocab_size;
        for (field, id) in config
            .bos_token_id
            .iter()
            .map(|&id| ("bos_token_id", id))
            .chain(config.eos_token_ids.iter().map(|&id| ("eos_token_id", id)))
        {
            if id as usize >= vocab {
                return Err(config_err(
                    origin,
                    field,
                    format!("{id} is outside the vocabulary (vocab_size {vocab})"),
                ));
            }
        }
        f.refuse_unsupported(architecture)?;
        let unknown: Vec<&String> = f
            .map
            .keys()
            .filter(|k| !HARMLESS.contains(&k.as_str()))
            .collect();
        if !unknown.is_empty() {
            tracing::warn!(config = origin, fields = ?unknown, "config.json fields not used by Sluice (kept on save)");
        }
        Ok(ModelConfig {
            extra: f.map,
            ..config
        })
    }

    /// The `config.json` this config is written as: known fields first, then `extra`.
    pub fn to_hf_json(&self) -> Value {
        let mut out = Map::new();
        let a = self.architecture;
        out.insert("architectures".into(), json!([a.class_name()]));
        out.insert("model_type".into(), json!(a.model_type()));
        out.insert("vocab_size".into(), json!(self.vocab_size));
        out.insert("hidden_size".into(), json!(self.hidden_size));
        out.insert("intermediate_size".into(), json!(self.intermediate_size));
        out.insert("num_hidden_layers".into(), json!(self.num_layers));
        out.insert("num_attention_heads".into(), json!(self.num_heads));
        out.insert("num_key_value_heads".into(), json!(self.num_kv_heads));
        out.insert("head_dim".into(), json!(self.head_dim));
        out.insert("hidden_act".into(), json!("silu"));
        out.insert("rms_norm_eps".into(), json!(self.rms_norm_eps));
        out.insert("rope_theta".into(), json!(self.rope_theta));
        let scaling = match self.rope_scaling {
            None => Value::Null,
            Some(s) => json!({
                "rope_type": "llama3",
                "factor": s.factor,
                "low_freq_factor": s.low_freq_factor,
                "high_freq_factor": s.high_freq_factor,
                "original_max_position_embeddings": s.original_max_position_embeddings,
            }),
        };
        out.insert("rope_scaling".into(), scaling);
        out.insert(
            "max_position_embeddings".into(),
            json!(self.max_position_embeddings),
        );
        out.insert(
            "tie_word_embeddings".into(),
            json!(self.tie_word_embeddings),
        );
        out.insert("torch_dtype".into(), json!(dtype_name(self.dtype)));
        out.insert("attention_dropout".into(), json!(0.0));
        match a {
            Architecture::Llama => {
                out.insert("attention_bias".into(), json!(false));
                out.insert("mlp_bias".into(), json!(false));
            }
            Architecture::Qwen2 => {
                out.insert("use_sliding_window".into(), json!(false));
            }
            Architecture::Qwen3 => {
                out.insert("attention_bias".into(), json!(false));
                out.insert("use_sliding_window".into(), json!(false));
            }
        }
        if let Some(bos) = self.bos_token_id {
            out.insert("bos_token_id".into(), json!(bos));
        }
        match self.eos_token_ids.as_slice() {
            [] => {}
            [one] => {
                out.insert("eos_token_id".into(), json!(one));
            }
            many => {
                out.insert("eos_token_id".into(), json!(many));
            }
        }
        for (k, v) in &self.extra {
            out.entry(k.clone()).or_insert_with(|| v.clone());
        }
        Value::Object(out)
    }
}

/// The HF name of a dtype (`torch_dtype` values).
pub fn dtype_name(dtype: DType) -> &'static str {
    match dtype {
        DType::BF16 => "bfloat16",
        DType::F16 => "float16",
        DType::F64 => "float64",
        _ => "float32",
    }
}

/// Converts the config file's dtype to candle's.
pub fn candle_dtype(dtype: sluice_core::config::DType) -> DType {
    match dtype {
        sluice_core::config::DType::F32 => DType::F32,
        sluice_core::config::DType::Bf16 => DType::BF16,
        sluice_core::config::DType::F16 => DType::F16,
    }
}

pub(crate) fn config_err(origin: &str, field: &str, reason: impl Into<String>) -> ModelError {
    ModelError::Config {
        path: origin.to_owned(),
        field: field.to_owned(),
        reason: reason.into(),
    }
}
