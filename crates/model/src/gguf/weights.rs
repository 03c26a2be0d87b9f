//! A GGUF model's architecture and weights in HF terms: [`ModelConfig`] from the `{arch}.*`
//! metadata, llama.cpp tensor names mapped to transformers' ones, each tensor dequantised,
//! checked against the shape the config implies, and (for llama) its q/k rows put back in HF's
//! order.
//!
//! llama.cpp's converter permutes the rows of a llama model's `q_proj` / `k_proj` so that each
//! head's rotary pairs are adjacent (interleaved RoPE): HF row `h·d + j·d/2 + i` (pair half
//! `j`, index `i` within the half) is GGUF row `h·d + 2i + j`. Qwen2 and Qwen3 files are not
//! permuted (llama.cpp runs them with NeoX-style RoPE, the HF layout).

use std::collections::HashMap;
use std::sync::Arc;

use candle_core::{DType, Tensor};
use serde_json::{Map, json};

use super::reader::GgufFile;
use crate::config::{Architecture, ModelConfig};
use crate::error::Result;
use crate::names::{EMBED, FINAL_NORM, LM_HEAD, parameter_specs};

/// `general.architecture` values the importer accepts.
pub const SUPPORTED_ARCHITECTURES: &[&str] = &["llama", "qwen2", "qwen3"];

/// The architecture `general.architecture` names.
pub(super) fn architecture(g: &GgufFile) -> Result<(Architecture, String)> {
    let name = g.string("general.architecture")?;
    let arch = match name {
        "llama" => Architecture::Llama,
        "qwen2" => Architecture::Qwen2,
        "qwen3" => Architecture::Qwen3,
        other => {
            return Err(g.err(format!(
                "metadata key `general.architecture`: `{other}` is not supported (supported: {})",
                SUPPORTED_ARCHITECTURES.join(", ")
            )));
        }
    };
    Ok((arch, name.to_owned()))
}

/// The config the metadata describes, validated as a `config.json` would be.
pub(super) fn config_from_metadata(
    g: &GgufFile,
    dtype: DType,
    bos: Option<u32>,
    eos: Vec<u32>,
) -> Result<ModelConfig> {
    let (architecture, arch) = architecture(g)?;
    let key = |k: &str| format!("{arch}.{k}");
    let hidden = g.usize_req(&key("embedding_length"))?;
    let heads = g.usize_req(&key("attention.head_count"))?;
    let kv_heads = match g.uint_opt(&key("attention.head_count_kv"))? {
        Some(n) => n as usize,
        None => heads,
    };
    let head_dim = match g.uint_opt(&key("attention.key_length"))? {
        Some(d) => d as usize,
        None if heads > 0 && hidden % heads == 0 => hidden / heads,
        None => {
            return Err(g.err(format!(
                "metadata: `{}` is absent and embedding_length {hidden} is not a multiple of head_count {heads}",
                key("attention.key_length")
            )));
        }
    };
    if let Some(v) = g.uint_opt(&key("attention.value_length"))?
        && v as usize != head_dim
    {
        return Err(g.err(format!(
            "metadata key `{}` = {v} differs from the key length {head_dim} (not supported)",
            key("attention.value_length")
        )));
    }
    if let Some(r) = g.uint_opt(&key("rope.dimension_count"))?
        && r as usize != head_dim
    {
        return Err(g.err(format!(
            "metadata key `{}` = {r}: rotary embedding on part of a head (head dim {head_dim}) is not supported",
            key("rope.dimension_count")
        )));
    }
    if let Some(kind) = g.string_opt(&key("rope.scaling.type"))?
        && kind != "none"
    {
        return Err(g.err(format!(
            "metadata key `{}` = `{kind}`: RoPE scaling is not supported",
            key("rope.scaling.type")
        )));
    }
    if g.has_tensor("rope_freqs.weight") {
        return Err(g.err(
            "tensor `rope_freqs.weight`: per-frequency RoPE factors (llama3 rope scaling) are not supported",
        ));
    }
    let vocab = match g.uint_opt(&key("vocab_size"))? {
        Some(v) => v as usize,
        None => match g.tensor_shape("token_embd.weight") {
            Some(&[rows, ..]) => rows,
            Some(_) => return Err(g.err("tensor `token_embd.weight` has no dimensions")),
            None => return Err(g.err("tensor `token_embd.weight` is missing")),
        },
    };
    let mut extra = Map::new();
    if let Some(name) = g.string_opt("general.name")? {
        extra.insert("_name_or_path".into(), json!(name));
    }
    let config = ModelConfig {
        architecture,
        vocab_size: vocab,
        hidden_size: hidden,
        intermediate_size: g.usize_req(&key("feed_forward_length"))?,
        num_layers: g.usize_req(&key("block_count"))?,
        num_heads: heads,
        num_kv_heads: kv_heads,
        head_dim,
        rms_norm_eps: g
            .float_opt(&key("attention.layer_norm_rms_epsilon"))?
            .unwrap_or(1e-6),
        rope_theta: g.float_opt(&key("rope.freq_base"))?.unwrap_or(10_000.0),
        rope_scaling: None,
        max_position_embeddings: g
            .uint_opt(&key("context_length"))?
            .map_or(4096, |n| n as usize),
        tie_word_embeddings: !g.has_tensor("output.weight"),
        dtype,
        bos_token_id: bos,
        eos_token_ids: eos,
        extra,
    };
    // The same validation a `config.json` gets (GQA divisibility, even head dim, …).
    let origin = format!("{} (GGUF metadata)", g.path().display());
    ModelConfig::from_json(&config.to_hf_json(), &origin)
}

/// The llama.cpp name of an HF tensor name.
pub fn gguf_name(hf: &str) -> Option<String> {
    match hf {
        EMBED => return Some("token_embd.weight".into()),
        FINAL_NORM => return Some("output_norm.weight".into()),
        LM_HEAD => return Some("output.weight".into()),
        _ => {}
    }
    let rest = hf.strip_prefix("model.layers.")?;
    let (layer, tail) = rest.split_once('.')?;
    let mapped = match tail {
        "input_layernorm.weight" => "attn_norm.weight",
        "post_attention_layernorm.weight" => "ffn_norm.weight",
        "self_attn.q_proj.weight" => "attn_q.weight",
        "self_attn.k_proj.weight" => "attn_k.weight",
        "self_attn.v_proj.weight" => "attn_v.weight",
        "self_attn.q_proj.bias" => "attn_q.bias",
        "self_attn.k_proj.bias" => "attn_k.bias",
        "self_attn.v_proj.bias" => "attn_v.bias",
        "self_attn.o_proj.weight" => "attn_output.weight",
        "self_attn.q_norm.weight" => "attn_q_norm.weight",
        "self_attn.k_norm.weight" => "attn_k_norm.weight",
        "mlp.gate_proj.weight" => "ffn_gate.weight",
        "mlp.up_proj.weight" => "ffn_up.weight",
        "mlp.down_proj.weight" => "ffn_down.weight",
        _ => return None,
    };
    Some(format!("blk.{layer}.{mapped}"))
}

/// How many heads' rows llama.cpp permuted in tensor `hf` (q: all heads, k: the kv heads), for
/// a llama model; `None` for tensors it leaves alone.
pub fn permuted_heads(config: &ModelConfig, hf: &str) -> Option<usize> {
    if config.architecture != Architecture::Llama {
        return None;
    }
    if hf.ends_with("self_attn.q_proj.weight") {
        Some(config.num_heads)
    } else if hf.ends_with("self_attn.k_proj.weight") {
        Some(config.num_kv_heads)
    } else {
        None
    }
}

/// Rows of `t` (`[heads·d, in]`) from llama.cpp's interleaved order back to HF's.
pub fn unpermute_rows(t: &Tensor, heads: usize) -> candle_core::Result<Tensor> {
    let (rows, cols) = t.dims2()?;
    let d = rows / heads;
    t.reshape((heads, d / 2, 2, cols))?
        .transpose(1, 2)?
        .contiguous()?
        .reshape((rows, cols))
}

/// Rows of `t` from HF's order to llama.cpp's interleaved one (the inverse of
/// [`unpermute_rows`]).
pub fn permute_rows(t: &Tensor, heads: usize) -> candle_core::Result<Tensor> {
    let (rows, cols) = t.dims2()?;
    let d = rows / heads;
    t.reshape((heads, 2, d / 2, cols))?
        .transpose(1, 2)?
        .contiguous()?
        .reshape((rows, cols))
}

/// Every tensor `config` needs, read from `g` under its llama.cpp name, shape-checked,
/// dequantised, un-permuted and converted to `config.dtype`. Tensors of the file the
/// architecture has no place for are refused by name.
pub(super) fn load_tensors(
    g: &mut GgufFile,
    config: &Arc<ModelConfig>,
) -> Result<HashMap<String, Tensor>> {
    let specs = parameter_specs(config);
    let mut used: Vec<String> = Vec::with_capacity(specs.len() + 1);
    let mut tensors = HashMap::with_capacity(specs.len());
    for spec in specs {
        let name = gguf_name(&spec.name).expect("every parameter has a llama.cpp name");
        let Some(shape) = g.tensor_shape(&name) else {
            return Err(g.err(format!(
                "tensor `{name}` (HF `{}`) is missing; a {} model needs it",
                spec.name,
                config.architecture.model_type()
            )));
        };
        if shape != spec.shape.as_slice() {
            return Err(g.err(format!(
                "tensor `{name}` (HF `{}`) has shape {shape:?}, the metadata implies {:?}",
                spec.name, spec.shape
            )));
        }
        let t = g.tensor_f32(&name)?;
        let t = match permuted_heads(config, &spec.name) {
            Some(heads) => unpermute_rows(&t, heads),
            None => Ok(t),
        }
        .and_then(|t| t.to_dtype(config.dtype))
        .map_err(|e| g.err(format!("tensor `{name}`: {e}")))?;
        used.push(name);
        tensors.insert(spec.name, t);
    }
    let unused: Vec<&str> = g
        .tensor_names()
        .into_iter()
        .filter(|n| !used.iter().any(|u| u == n))
        .collect();
    if !unused.is_empty() {
        return Err(g.err(format!(
            "tensors a {} model has no place for: {}",
            config.architecture.model_type(),
            unused.join(", ")
        )));
    }
    Ok(tensors)
}
