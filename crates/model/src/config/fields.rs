//! Field-by-field reading of `config.json`: each accessor removes what it reads, so whatever is
//! left at the end is exactly the set of fields Sluice does not interpret.

use candle_core::DType;
use serde_json::{Map, Value};

use super::{Architecture, Llama3RopeScaling, config_err};
use crate::error::{ModelError, Result};

/// The fields of `config.json` not consumed yet; each accessor removes what it reads.
pub(super) struct Fields<'a> {
    pub map: Map<String, Value>,
    pub origin: &'a str,
}

impl Fields<'_> {
    fn err(&self, field: &str, reason: impl Into<String>) -> ModelError {
        config_err(self.origin, field, reason)
    }

    fn take(&mut self, field: &str) -> Option<Value> {
        self.map.remove(field).filter(|v| !v.is_null())
    }

    pub(super) fn usize_opt(&mut self, field: &str) -> Result<Option<usize>> {
        match self.take(field) {
            None => Ok(None),
            Some(v) => match v.as_u64() {
                Some(n) if n > 0 => Ok(Some(n as usize)),
                _ => Err(self.err(field, format!("expected a positive integer, got {v}"))),
            },
        }
    }

    pub(super) fn usize_req(&mut self, field: &str) -> Result<usize> {
        self.usize_opt(field)?
            .ok_or_else(|| self.err(field, "required but absent"))
    }

    pub(super) fn u32_opt(&mut self, field: &str) -> Result<Option<u32>> {
        match self.take(field) {
            None => Ok(None),
            Some(v) => v
                .as_u64()
                .and_then(|n| u32::try_from(n).ok())
                .map(Some)
                .ok_or_else(|| self.err(field, format!("expected a token id, got {v}"))),
        }
    }

    pub(super) fn f64_opt(&mut self, field: &str) -> Result<Option<f64>> {
        match self.take(field) {
            None => Ok(None),
            Some(v) => match v.as_f64() {
                Some(x) if x.is_finite() && x > 0.0 => Ok(Some(x)),
                _ => Err(self.err(field, format!("expected a positive number, got {v}"))),
            },
        }
    }

    pub(super) fn bool_opt(&mut self, field: &str) -> Result<Option<bool>> {
        match self.take(field) {
            None => Ok(None),
            Some(Value::Bool(b)) => Ok(Some(b)),
            Some(v) => Err(self.err(field, format!("expected true or false, got {v}"))),
        }
    }

    fn str_opt(&mut self, field: &str) -> Result<Option<String>> {
        match self.take(field) {
            None => Ok(None),
            Some(Value::String(s)) => Ok(Some(s)),
            Some(v) => Err(self.err(field, format!("expected a string, got {v}"))),
        }
    }

    pub(super) fn architecture(&mut self) -> Result<Architecture> {
        let classes = self.take("architectures");
        let model_type = self.str_opt("model_type")?;
        let class = match &classes {
            Some(Value::Array(a)) if a.len() == 1 => a[0].as_str().map(str::to_owned),
            Some(other) => {
                return Err(self.err(
                    "architectures",
                    format!("expected a list of one class name, got {other}"),
                ));
            }
            None => None,
        };
        let arch = match (class, model_type.as_deref()) {
            (Some(c), _) => Architecture::from_class_name(&c).ok_or_else(|| {
                self.err(
                    "architectures",
                    format!(
                        "`{c}` is not supported (LlamaForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM)"
                    ),
                )
            })?,
            (None, Some("llama")) => Architecture::Llama,
            (None, Some("qwen2")) => Architecture::Qwen2,
            (None, Some("qwen3")) => Architecture::Qwen3,
            (None, other) => {
                return Err(self.err(
                    "architectures",
                    format!("absent, and model_type {other:?} is not llama, qwen2 or qwen3"),
                ));
            }
        };
        if let Some(t) = model_type
            && t != arch.model_type()
        {
            return Err(self.err(
                "model_type",
                format!("`{t}` contradicts architectures `{}`", arch.class_name()),
            ));
        }
        Ok(arch)
    }

    pub(super) fn dtype(&mut self) -> Result<DType> {
        let torch = self.str_opt("torch_dtype")?;
        let new = self.str_opt("dtype")?;
        let (field, name) = match (torch, new) {
            (Some(t), _) => ("torch_dtype", t),
            (None, Some(d)) => ("dtype", d),
            (None, None) => return Ok(DType::F32),
        };
        match name.as_str() {
            "float32" => Ok(DType::F32),
            "bfloat16" => Ok(DType::BF16),
            "float16" => Ok(DType::F16),
            "float64" => Ok(DType::F64),
            other => Err(self.err(
                field,
                format!("`{other}` is not supported (float32, bfloat16, float16)"),
            )),
        }
    }

    pub(super) fn eos_ids(&mut self) -> Result<Vec<u32>> {
        match self.take("eos_token_id") {
            None => Ok(Vec::new()),
            Some(Value::Array(ids)) => ids
                .iter()
                .map(|v| {
                    v.as_u64()
                        .and_then(|n| u32::try_from(n).ok())
                        .ok_or_else(|| self.err("eos_token_id", format!("bad token id {v}")))
                })
                .collect(),
            Some(v) => v
                .as_u64()
                .and_then(|n| u32::try_from(n).ok())
                .map(|id| vec![id])
                .ok_or_else(|| self.err("eos_token_id", format!("bad token id {v}"))),
        }
    }

    pub(super) fn rope_scaling(&mut self) -> Result<Option<Llama3RopeScaling>> {
        let field = "rope_scaling";
        let Some(v) = self.take(field) else {
            return Ok(None);
        };
        let Value::Object(m) = &v else {
            return Err(self.err(field, format!("expected an object, got {v}")));
        };
        let kind = m
            .get("rope_type")
            .or_else(|| m.get("type"))
            .and_then(Value::as_str);
        match kind {
            Some("default") => return Ok(None),
            Some("llama3") => {}
            other => {
                return Err(self.err(
                    "rope_scaling.rope_type",
                    format!("{other:?} is not supported (only `llama3`)"),
                ));
            }
        }
        let num = |k: &str| {
            m.get(k)
                .and_then(Value::as_f64)
                .filter(|x| x.is_finite() && *x > 0.0)
                .ok_or_else(|| self.err(&format!("rope_scaling.{k}"), "expected a positive number"))
        };
        let scaling = Llama3RopeScaling {
            factor: num("factor")?,
            low_freq_factor: num("low_freq_factor")?,
            high_freq_factor: num("high_freq_factor")?,
            original_max_position_embeddings: num("original_max_position_embeddings")? as usize,
        };
        if scaling.high_freq_factor <= scaling.low_freq_factor {
            return Err(self.err(
                "rope_scaling.high_freq_factor",
                "must exceed low_freq_factor",
            ));
        }
        Ok(Some(scaling))
    }

    /// Fields whose non-default values would change the computation in ways not implemented.
    pub(super) fn refuse_unsupported(&mut self, arch: Architecture) -> Result<()> {
        if let Some(act) = self.str_opt("hidden_act")?
            && act != "silu"
        {
            return Err(self.err("hidden_act", format!("`{act}` is not supported (silu)")));
        }
        for field in ["attention_bias", "mlp_bias", "use_sliding_window"] {
            if self.bool_opt(field)? == Some(true) {
                return Err(self.err(field, "`true` is not supported"));
            }
        }
        if let Some(v) = self.take("attention_dropout")
            && v.as_f64() != Some(0.0)
        {
            return Err(self.err("attention_dropout", format!("{v} is not supported (0.0)")));
        }
        if let Some(v) = self.take("pretraining_tp")
            && v.as_u64() != Some(1)
        {
            return Err(self.err("pretraining_tp", format!("{v} is not supported (1)")));
        }
        if let Some(v) = self.take("layer_types") {
            let all_full = v
                .as_array()
                .is_some_and(|a| a.iter().all(|t| t.as_str() == Some("full_attention")));
            if !all_full {
                return Err(self.err("layer_types", "only `full_attention` layers are supported"));
            }
        }
        if arch != Architecture::Llama
            && let Some(v) = self.take("use_mrope")
            && v.as_bool() != Some(false)
        {
            return Err(self.err("use_mrope", "multimodal RoPE is not supported"));
        }
        if self.take("quantization_config").is_some() {
            return Err(self.err(
                "quantization_config",
                "quantized checkpoints are not supported",
            ));
        }
        Ok(())
    }
}
