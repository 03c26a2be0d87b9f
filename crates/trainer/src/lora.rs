//! LoRA (Hu et al., 2021): low-rank adapters trained in place of the full weights, in PEFT's
//! conventions, through the merged weights.
//!
//! Each adapted projection `W₀ (out, in)` gets `A (r, in)` and `B (out, r)`, and the model
//! computes with `W = W₀ + s·B·A`, `s = alpha / r`. The trainer keeps `W` in the model's own
//! parameter, so the forward and the fused kernels are the full model's, unchanged, and the
//! engines receive `W` merged: inference runs at the full model's speed. The backward forms the
//! adapters' gradients itself ([`sluice_model::low_rank`]): from each projection's input `x`
//! and output gradient `g`, `∂L/∂A = s·(g·B)ᵀ·x` and `∂L/∂B = s·gᵀ·(x·Aᵀ)`, products of rank
//! `r`, with no gradient formed for the weights, norms, embeddings or head. Where a layer's
//! backward runs as candle's graph instead, the weights' gradients `G` are formed and projected
//! here (`s·Bᵀ·G`, `s·G·Aᵀ`: the same chain rule). AdamW updates `A` and `B` alone; after each
//! update the change of `s·B·A` is added to `W` ([`Adapters::merge`]), so `W₀` is never kept.
//!
//! What this saves: the weights' gradient products (half of each projection's backward),
//! the head's and the embedding's, and the optimizer's state: two moments and a sum of
//! `r·(in + out)` numbers per projection, where full training keeps three of `out·in` for every
//! parameter.
//!
//! As PEFT initialises them: `A` uniform in `±1/√in` (Kaiming's uniform bound with `a = √5`),
//! drawn from the run's seed and the parameter's name, and `B` zero, so the first forward is
//! the base model's exactly.

use std::collections::HashMap;
use std::path::Path;

use candle_core::backprop::GradStore;
use candle_core::{DType, Device, Tensor, Var};
use serde::{Deserialize, Serialize};
use sluice_core::rng::{SplitMix64, mix};
use sluice_model::TrainableModel;
use sluice_model::low_rank::LowRank;

use crate::error::{TrainerError, tensor_ctx};

/// The projections LoRA can adapt, by their module names (PEFT's `target_modules`); all of
/// them is PEFT's and verl's `all-linear` for these architectures.
pub const TARGETS: [&str; 7] = [
    "q_proj",
    "k_proj",
    "v_proj",
    "o_proj",
    "gate_proj",
    "up_proj",
    "down_proj",
];

/// The adapters' directory inside a checkpoint: PEFT's `adapter_model.safetensors` and
/// `adapter_config.json`, loadable onto the base model by PEFT.
pub const ADAPTER_DIR: &str = "adapter";
/// The adapters' weights in [`ADAPTER_DIR`].
pub const ADAPTER_WEIGHTS: &str = "adapter_model.safetensors";
/// Their settings in [`ADAPTER_DIR`].
pub const ADAPTER_CONFIG: &str = "adapter_config.json";

/// `trainer.lora_rank`, `trainer.lora_alpha`, `trainer.lora_targets`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LoraConfig {
    /// `r`, the adapters' rank (≥ 1).
    pub rank: usize,
    /// `alpha`: the update is scaled by `alpha / r`.
    pub alpha: f64,
    /// Module names of [`TARGETS`] to adapt.
    pub targets: Vec<String>,
}

impl LoraConfig {
    /// `s = alpha / r`.
    pub fn scale(&self) -> f64 {
        self.alpha / self.rank as f64
    }

    /// Whether the parameter called `name` is adapted: the weight of a targeted projection.
    pub fn adapts(&self, name: &str) -> bool {
        let Some(module) = name.strip_suffix(".weight") else {
            return false;
        };
        let module = module.rsplit('.').next().unwrap_or(module);
        self.targets.iter().any(|t| t == module)
    }
}

/// `adapter_config.json` as PEFT writes it (the keys a LoRA adapter needs; PEFT fills the rest
/// with its defaults).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
struct PeftConfig {
    peft_type: String,
    task_type: String,
    r: usize,
    lora_alpha: f64,
    target_modules: Vec<String>,
    #[serde(default)]
    lora_dropout: f64,
    #[serde(default = "no_bias")]
    bias: String,
    #[serde(default)]
    fan_in_fan_out: bool,
    #[serde(default)]
    use_rslora: bool,
    #[serde(default)]
    base_model_name_or_path: Option<String>,
    #[serde(default)]
    inference_mode: bool,
}

fn no_bias() -> String {
    "none".into()
}

/// One adapted projection.
#[derive(Debug)]
struct Adapter {
    /// Its weight's index in [`TrainableModel::vars`].
    param: usize,
    /// Its weight's name (`model.layers.0.self_attn.q_proj.weight`).
    name: String,
    /// `(r, in)`.
    a: Var,
    /// `(out, r)`.
    b: Var,
    /// Copies of the `A` and `B` whose product the weight holds now: `W = W₀ + s·B·A` with
    /// these, and [`Adapters::merge`] adds what the optimizer changed. `W₀` itself is never
    /// kept (a copy of every adapted weight).
    merged: (Tensor, Tensor),
}

impl Adapter {
    /// PEFT's key of `A` (`which = "A"`) or `B` in `adapter_model.safetensors`.
    fn peft_key(&self, which: &str) -> String {
        let module = self.name.strip_suffix(".weight").unwrap_or(&self.name);
        format!("base_model.model.{module}.lora_{which}.weight")
    }
}

/// The adapters of one trainable model (see the module docs).
#[derive(Debug)]
pub struct Adapters {
    config: LoraConfig,
    adapters: Vec<Adapter>,
    /// For each of the model's parameters, its adapter's index.
    slot: Vec<Option<usize>>,
}

impl Adapters {
    /// Fresh adapters on `model`'s targeted projections (`B = 0`: the model is unchanged).
    pub fn new(
        model: &TrainableModel,
        config: &LoraConfig,
        seed: u64,
    ) -> Result<Self, TrainerError> {
        Self::build(model, config, |name, base, rank| {
            let (out, inp) = base.dims2()?;
            let bound = 1.0 / (inp as f64).sqrt();
            let mut rng = SplitMix64::new(mix(&[seed, name_hash(name)]));
            let a: Vec<f32> = (0..rank * inp)
                .map(|_| ((2.0 * rng.next_f64() - 1.0) * bound) as f32)
                .collect();
            let a = Tensor::from_vec(a, (rank, inp), base.device())?;
            let b = Tensor::zeros((out, rank), DType::F32, base.device())?;
            Ok((a, b))
        })
    }

    /// Adapters read back from a checkpoint's [`ADAPTER_DIR`] onto `model`, whose targeted
    /// weights are the merged ones the checkpoint saved: `W₀ = W − s·B·A`.
    pub fn load(
        model: &TrainableModel,
        config: &LoraConfig,
        dir: &Path,
    ) -> Result<Self, TrainerError> {
        let config_path = dir.join(ADAPTER_CONFIG);
        let text = std::fs::read_to_string(&config_path)
            .map_err(|e| TrainerError::checkpoint(&config_path, e))?;
        let saved: PeftConfig =
            serde_json::from_str(&text).map_err(|e| TrainerError::checkpoint(&config_path, e))?;
        let mut saved_targets = saved.target_modules.clone();
        let mut targets = config.targets.clone();
        saved_targets.sort();
        targets.sort();
        if saved.r != config.rank || saved.lora_alpha != config.alpha || saved_targets != targets {
            return Err(TrainerError::checkpoint(
                &config_path,
                format!(
                    "the checkpoint's adapters are rank {}, alpha {}, on {}; the config asks for \
                     rank {}, alpha {}, on {} (trainer.lora_rank, lora_alpha, lora_targets): \
                     resume with the checkpoint's settings or start a new run",
                    saved.r,
                    saved.lora_alpha,
                    saved.target_modules.join(", "),
                    config.rank,
                    config.alpha,
                    config.targets.join(", "),
                ),
            ));
        }
        let path = dir.join(ADAPTER_WEIGHTS);
        let mut tensors = candle_core::safetensors::load(&path, model.device())
            .map_err(|e| TrainerError::checkpoint(&path, e))?;
        let adapters = Self::build(model, config, |name, merged, rank| {
            let (out, inp) = merged.dims2()?;
            let module = name.strip_suffix(".weight").unwrap_or(name);
            let mut take = |which: &str, shape: (usize, usize)| {
                let key = format!("base_model.model.{module}.lora_{which}.weight");
                let t = tensors
                    .remove(&key)
                    .ok_or_else(|| candle_core::Error::Msg(format!("missing tensor `{key}`")))?;
                if t.dims() != [shape.0, shape.1] {
                    return Err(candle_core::Error::Msg(format!(
                        "`{key}` has shape {:?}, expected {shape:?}",
                        t.dims()
                    )));
                }
                t.to_dtype(DType::F32)?.copy()
            };
            Ok((take("A", (rank, inp))?, take("B", (out, rank))?))
        })
        .map_err(|e| match e {
            TrainerError::Tensor { source, .. } => TrainerError::checkpoint(&path, source),
            e => e,
        })?;
        if let Some(extra) = tensors.keys().next() {
            return Err(TrainerError::checkpoint(
                &path,
                format!("unexpected tensor `{extra}`"),
            ));
        }
        // The checkpoint's W holds these adapters' product already.
        Ok(adapters)
    }

    /// Adapters on every targeted weight of `model`, `init(name, weight, rank)` giving `A`
    /// and `B`, whose product the weight holds already (`B = 0` fresh; a checkpoint's merged
    /// weight).
    fn build(
        model: &TrainableModel,
        config: &LoraConfig,
        mut init: impl FnMut(&str, &Tensor, usize) -> candle_core::Result<(Tensor, Tensor)>,
    ) -> Result<Self, TrainerError> {
        let mut adapters = Vec::new();
        let mut slot = vec![None; model.vars().len()];
        for (param, (name, var)) in model.vars().iter().enumerate() {
            if !config.adapts(name) {
                continue;
            }
            let weight = var.as_tensor();
            if weight.dtype() != DType::F32 {
                return Err(TrainerError::Input(format!(
                    "LoRA on {name}: the master weights are {:?}, f32 wanted",
                    weight.dtype()
                )));
            }
            let context = tensor_ctx(name);
            let (a, b) = init(name, weight, config.rank).map_err(context)?;
            let merged = (
                a.copy().map_err(tensor_ctx(name))?,
                b.copy().map_err(tensor_ctx(name))?,
            );
            let var = |t: Tensor| Var::from_tensor(&t).map_err(tensor_ctx(name));
            slot[param] = Some(adapters.len());
            adapters.push(Adapter {
                param,
                name: name.clone(),
                a: var(a)?,
                b: var(b)?,
                merged,
            });
        }
        if adapters.is_empty() {
            return Err(TrainerError::Input(format!(
                "trainer.lora_targets = [{}] matches no weight of the model",
                config.targets.join(", ")
            )));
        }
        Ok(Self {
            config: config.clone(),
            adapters,
            slot,
        })
    }

    /// The settings.
    pub fn config(&self) -> &LoraConfig {
        &self.config
    }

    /// The adapted weights' count.
    pub fn len(&self) -> usize {
        self.adapters.len()
    }

    /// Whether no weight is adapted (never, once built).
    pub fn is_empty(&self) -> bool {
        self.adapters.is_empty()
    }

    /// The trainable variables, in the optimizer's order: `A`, then `B`, of each adapter.
    pub fn vars(&self) -> Vec<Var> {
        let pairs = self.adapters.iter();
        pairs.flat_map(|a| [a.a.clone(), a.b.clone()]).collect()
    }

    /// Numbers trained: `r·(in + out)` over the adapted weights.
    pub fn trainable_numbers(&self) -> usize {
        let each = self.adapters.iter();
        each.map(|a| a.a.elem_count() + a.b.elem_count()).sum()
    }

    /// The adapters as the model's backward takes them ([`TrainableModel::set_low_rank`]): it
    /// then forms their gradients itself, in place of the weights'.
    pub fn low_rank(&self) -> Vec<(String, LowRank)> {
        let scale = self.config.scale();
        let each = self.adapters.iter();
        each.map(|ad| {
            let (a, b) = (ad.a.as_tensor().clone(), ad.b.as_tensor().clone());
            (ad.name.clone(), LowRank { a, b, scale })
        })
        .collect()
    }

    /// The adapters' gradients of one backward, with indices into [`Self::vars`]: those the
    /// backward formed itself (filed in `store` under `A` and `B`, [`Self::low_rank`]), else
    /// projected from the weights' (`grads`, indices into [`TrainableModel::vars`], as
    /// `TrainableModel::parameter_gradients` gives them: where a layer's backward ran as
    /// candle's graph): `∂L/∂A = s·Bᵀ·G`, `∂L/∂B = s·G·Aᵀ`. The frozen parameters' gradients
    /// are dropped.
    pub fn gradients(
        &self,
        store: &GradStore,
        grads: Vec<(usize, Tensor)>,
    ) -> Result<Vec<(usize, Tensor)>, TrainerError> {
        let s = self.config.scale();
        let mut out = Vec::with_capacity(2 * self.adapters.len());
        let mut formed = vec![false; self.adapters.len()];
        for (k, ad) in self.adapters.iter().enumerate() {
            if let (Some(da), Some(db)) = (store.get(ad.a.as_tensor()), store.get(ad.b.as_tensor()))
            {
                out.push((2 * k, da.clone()));
                out.push((2 * k + 1, db.clone()));
                formed[k] = true;
            }
        }
        for (param, g) in grads {
            let Some(k) = self.slot.get(param).copied().flatten() else {
                continue;
            };
            if formed[k] {
                continue;
            }
            let ad = &self.adapters[k];
            let grads = || -> candle_core::Result<(Tensor, Tensor)> {
                let g = g.to_dtype(DType::F32)?;
                // (r, out)·(out, in) and (out, in)·(in, r).
                let da = (ad.b.as_tensor().t()?.matmul(&g)? * s)?;
                let db = (g.matmul(&ad.a.as_tensor().t()?)? * s)?;
                Ok((da, db))
            };
            let (da, db) = grads().map_err(tensor_ctx(&ad.name))?;
            out.push((2 * k, da));
            out.push((2 * k + 1, db));
        }
        Ok(out)
    }

    /// Brings each adapted weight of `model` to `W₀ + s·B·A` for the current `A` and `B`
    /// (after every optimizer update): it holds `W₀ + s·B'·A'` for the last merged `A'`, `B'`,
    /// so `s·(B·A − B'·A') = s·(B·(A − A') + (B − B')·A')` is added, formed from the update's
    /// own small differences (its rounding scales with them, not with the adapters).
    pub fn merge(&mut self, model: &TrainableModel) -> Result<(), TrainerError> {
        let s = self.config.scale();
        for ad in &mut self.adapters {
            let (a, b) = (ad.a.as_tensor(), ad.b.as_tensor());
            let var = &model.vars()[ad.param].1;
            let merged = || -> candle_core::Result<(Tensor, Tensor)> {
                let (a0, b0) = &ad.merged;
                // One product of inner size 2r: [B, B − B'] · [A − A'; A'].
                let left = Tensor::cat(&[b, &(b - b0)?], 1)?;
                let right = Tensor::cat(&[&(a - a0)?, a0], 0)?;
                let delta = left.matmul(&right)?.affine(s, 0.0)?;
                var.set(&(var.as_tensor() + delta)?)?;
                Ok((a.copy()?, b.copy()?))
            };
            ad.merged = merged().map_err(tensor_ctx(&ad.name))?;
        }
        Ok(())
    }

    /// Writes the adapters under `dir` as PEFT does: [`ADAPTER_WEIGHTS`] (`lora_A` and
    /// `lora_B` of each module, f32) and [`ADAPTER_CONFIG`], naming `base` as the base model.
    pub fn save(&self, dir: &Path, base: Option<&Path>) -> Result<(), TrainerError> {
        std::fs::create_dir_all(dir).map_err(|e| TrainerError::checkpoint(dir, e))?;
        let path = dir.join(ADAPTER_WEIGHTS);
        let mut tensors = HashMap::new();
        for ad in &self.adapters {
            for (which, var) in [("A", &ad.a), ("B", &ad.b)] {
                let t = var
                    .as_tensor()
                    .to_device(&Device::Cpu)
                    .map_err(|e| TrainerError::checkpoint(&path, e))?;
                tensors.insert(ad.peft_key(which), t);
            }
        }
        candle_core::safetensors::save(&tensors, &path)
            .map_err(|e| TrainerError::checkpoint(&path, e))?;
        let config = PeftConfig {
            peft_type: "LORA".into(),
            task_type: "CAUSAL_LM".into(),
            r: self.config.rank,
            lora_alpha: self.config.alpha,
            target_modules: self.config.targets.clone(),
            lora_dropout: 0.0,
            bias: no_bias(),
            fan_in_fan_out: false,
            use_rslora: false,
            base_model_name_or_path: base.map(|p| p.display().to_string()),
            inference_mode: true,
        };
        let path = dir.join(ADAPTER_CONFIG);
        let json = serde_json::to_string_pretty(&config)
            .map_err(|e| TrainerError::checkpoint(&path, e))?;
        std::fs::write(&path, json + "\n").map_err(|e| TrainerError::checkpoint(&path, e))
    }
}

/// FNV-1a of a parameter's name: each adapter draws from its own stream.
fn name_hash(name: &str) -> u64 {
    name.bytes().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(targets: &[&str]) -> LoraConfig {
        LoraConfig {
            rank: 4,
            alpha: 8.0,
            targets: targets.iter().map(|t| (*t).to_owned()).collect(),
        }
    }

    #[test]
    fn a_target_is_a_projection_weight_by_its_module_name() {
        let c = config(&["q_proj", "down_proj"]);
        assert!(c.adapts("model.layers.0.self_attn.q_proj.weight"));
        assert!(c.adapts("model.layers.11.mlp.down_proj.weight"));
        assert!(!c.adapts("model.layers.0.self_attn.q_proj.bias"));
        assert!(!c.adapts("model.layers.0.self_attn.k_proj.weight"));
        assert!(!c.adapts("model.embed_tokens.weight"));
        assert_eq!(c.scale(), 2.0);
    }
}
