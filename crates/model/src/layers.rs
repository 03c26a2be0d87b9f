//! The decoder's parameters grouped per layer, and the per-token pieces shared by the training
//! and inference forwards (projections, q/k norm, SwiGLU MLP). Attention itself differs between
//! the two (packed mask vs KV cache) and lives with each.
//!
//! Activations here are flat token matrices `(N, hidden)`: training flattens `(B, L)`, inference
//! concatenates the new tokens of every sequence in the step.

use candle_core::{DType, Device, Result as CandleResult, Tensor};

use crate::config::ModelConfig;
use crate::error::Result;
use crate::names::{EMBED, FINAL_NORM, LM_HEAD, layer_prefix};
use crate::ops::{Kernels, rms_norm};

/// One decoder layer's tensors.
#[derive(Debug, Clone)]
pub(crate) struct LayerWeights {
    pub input_norm: Tensor,
    pub q_proj: Tensor,
    pub k_proj: Tensor,
    pub v_proj: Tensor,
    pub q_bias: Option<Tensor>,
    pub k_bias: Option<Tensor>,
    pub v_bias: Option<Tensor>,
    pub o_proj: Tensor,
    pub q_norm: Option<Tensor>,
    pub k_norm: Option<Tensor>,
    pub post_norm: Tensor,
    pub gate_proj: Tensor,
    pub up_proj: Tensor,
    pub down_proj: Tensor,
}

/// All tensors of the decoder. Clones share storage (candle tensors are `Arc`s).
#[derive(Debug, Clone)]
pub(crate) struct DecoderWeights {
    pub embed: Tensor,
    pub layers: Vec<LayerWeights>,
    pub final_norm: Tensor,
    /// The LM head, `(vocab, hidden)`: the embedding itself when tied.
    pub lm_head: Tensor,
}

impl DecoderWeights {
    /// Gathers the tensors `get` returns by HF name.
    pub(crate) fn build(
        config: &ModelConfig,
        mut get: impl FnMut(&str) -> Result<Tensor>,
    ) -> Result<Self> {
        let mut layers = Vec::with_capacity(config.num_layers);
        for l in 0..config.num_layers {
            let p = layer_prefix(l);
            let mut t = |suffix: &str| get(&format!("{p}.{suffix}"));
            let (q_bias, k_bias, v_bias) = if config.qkv_bias() {
                (
                    Some(t("self_attn.q_proj.bias")?),
                    Some(t("self_attn.k_proj.bias")?),
                    Some(t("self_attn.v_proj.bias")?),
                )
            } else {
                (None, None, None)
            };
            let (q_norm, k_norm) = if config.qk_norm() {
                (
                    Some(t("self_attn.q_norm.weight")?),
                    Some(t("self_attn.k_norm.weight")?),
                )
            } else {
                (None, None)
            };
            layers.push(LayerWeights {
                input_norm: t("input_layernorm.weight")?,
                q_proj: t("self_attn.q_proj.weight")?,
                k_proj: t("self_attn.k_proj.weight")?,
                v_proj: t("self_attn.v_proj.weight")?,
                q_bias,
                k_bias,
                v_bias,
                o_proj: t("self_attn.o_proj.weight")?,
                q_norm,
                k_norm,
                post_norm: t("post_attention_layernorm.weight")?,
                gate_proj: t("mlp.gate_proj.weight")?,
                up_proj: t("mlp.up_proj.weight")?,
                down_proj: t("mlp.down_proj.weight")?,
            });
        }
        let embed = get(EMBED)?;
        let lm_head = if config.tie_word_embeddings {
            embed.clone()
        } else {
            get(LM_HEAD)?
        };
        Ok(Self {
            embed,
            layers,
            final_norm: get(FINAL_NORM)?,
            lm_head,
        })
    }
}

/// A layer's projections stacked for the engine: the q, k and v weights (and biases) as one
/// `((heads + 2·kv_heads)·d, hidden)` matrix, gate and up as one `(2·inter, hidden)`, so a step
/// takes one product for each where it took three and two (one cuBLAS launch each on a GPU),
/// and splits the rows with what follows anyway ([`crate::fused::split_rope`],
/// [`crate::fused::swiglu_rows`]). A copy of those weights, rebuilt at every weight swap.
#[derive(Debug, Clone)]
pub(crate) struct StackedLayer {
    /// q/k/v weight and bias; `None` where the architecture norms q and k per head (Qwen3):
    /// the norms come between the product and the rotation, which the split does not apply.
    qkv: Option<(Tensor, Option<Tensor>)>,
    gate_up: Tensor,
}

impl StackedLayer {
    pub(crate) fn new(layer: &LayerWeights, config: &ModelConfig) -> CandleResult<Self> {
        let qkv = if config.qk_norm() {
            None
        } else {
            let w = Tensor::cat(&[&layer.q_proj, &layer.k_proj, &layer.v_proj], 0)?;
            let b = match (&layer.q_bias, &layer.k_bias, &layer.v_bias) {
                (Some(q), Some(k), Some(v)) => Some(Tensor::cat(&[q, k, v], 0)?),
                _ => None,
            };
            Some((w, b))
        };
        Ok(Self {
            qkv,
            gate_up: Tensor::cat(&[&layer.gate_proj, &layer.up_proj], 0)?,
        })
    }

    /// Whether q, k and v are one product ([`Self::qkv_rows`] gives it).
    pub(crate) fn stacks_qkv(&self) -> bool {
        self.qkv.is_some()
    }

    /// The input norm (`normed` where the previous layer computed it) and the stacked q/k/v
    /// product of `x (N, hidden)`, returned with the bias still to add: the rows that
    /// [`crate::cache::NewHeads::Stacked`] carries to the attention, which splits and rotates
    /// them (on a GPU's paged cache, in its own launch). `None` where q/k/v are not stacked.
    pub(crate) fn qkv_rows(
        &self,
        layer: &LayerWeights,
        x: &Tensor,
        normed: Option<Tensor>,
        config: &ModelConfig,
    ) -> CandleResult<Option<(Tensor, Option<&Tensor>)>> {
        let Some((w, b)) = &self.qkv else {
            return Ok(None);
        };
        let h = match normed {
            Some(h) => h,
            None => rms_norm(x, &layer.input_norm, config.rms_norm_eps, Kernels::Fused)?,
        };
        Ok(Some((
            linear_with(&h, w, None, Kernels::Fused)?,
            b.as_ref(),
        )))
    }

    /// The rest of the layer after attention's output `o`: `x + o`, then the MLP block with
    /// the gate/up product stacked, each residual add fused with the norm after it
    /// ([`crate::fused::add_rms_norm`]: on a GPU one launch for two). Returns the layer's
    /// output and, given the next layer's input norm `next_norm`, that norm of it.
    pub(crate) fn residual_mlp(
        &self,
        layer: &LayerWeights,
        x: &Tensor,
        o: &Tensor,
        next_norm: Option<&Tensor>,
        eps: f64,
    ) -> CandleResult<(Tensor, Option<Tensor>)> {
        let (x, h) = crate::fused::add_rms_norm(x, o, &layer.post_norm, eps)?;
        let gate_up = linear_with(&h, &self.gate_up, None, Kernels::Fused)?;
        let act = crate::fused::swiglu_rows(&gate_up)?;
        let down = layer.project(&act, Proj::Down, Kernels::Fused)?;
        match next_norm {
            Some(w) => {
                let (out, normed) = crate::fused::add_rms_norm(&x, &down, w, eps)?;
                Ok((out, Some(normed)))
            }
            None => Ok(((x + down)?, None)),
        }
    }
}

/// Whether a model on `device` stacks its products unless told otherwise
/// ([`crate::InferenceModel::set_stacked_products`]): on a GPU, where its kernels are.
pub(crate) fn stacks_by_default(device: &Device, dtype: DType) -> bool {
    device.is_cuda() && stacking_refused(device, dtype).is_none()
}

/// Why weights of `dtype` on `device` cannot be stacked, if they cannot: the split kernels
/// (`crate::fused::split_rope`, `swiglu_rows`) take f32 and f64 on the CPU, f32 and bf16 on a
/// GPU.
pub(crate) fn stacking_refused(device: &Device, dtype: DType) -> Option<String> {
    let kernels = match device {
        Device::Cpu => matches!(dtype, DType::F32 | DType::F64),
        d => d.is_cuda() && cfg!(feature = "cuda") && matches!(dtype, DType::F32 | DType::BF16),
    };
    (!kernels)
        .then(|| format!("stacked products: no split kernels for {dtype:?} weights on {device:?}"))
}

/// `x @ w.T + b` for `x: (N, in)`, `w: (out, in)`: Sluice's fused linear for f32/f64 CPU
/// tensors (one gemm in the weight's own layout; a differentiable node under
/// [`Kernels::Custom`]), candle's product otherwise and under [`Kernels::Differentiable`].
pub(crate) fn linear_with(
    x: &Tensor,
    w: &Tensor,
    b: Option<&Tensor>,
    kernels: Kernels,
) -> CandleResult<Tensor> {
    if kernels != Kernels::Differentiable && crate::fused::supported(x) {
        crate::fused::linear(x, w, b)
    } else {
        linear(x, w, b)
    }
}

/// `x @ w.T + b` for `x: (N, in)`, `w: (out, in)`.
pub(crate) fn linear(x: &Tensor, w: &Tensor, b: Option<&Tensor>) -> CandleResult<Tensor> {
    let y = x.matmul(&w.t()?)?;
    match b {
        Some(b) => y.broadcast_add(b),
        None => Ok(y),
    }
}

/// A layer's projections, named for forwards whose products do not read the f32 weights
/// themselves (the engine's bf16 tiles, [`crate::packed`], which index by `p as usize`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Proj {
    Q,
    K,
    V,
    O,
    Gate,
    Up,
    Down,
}

impl Proj {
    /// Its module's name within a layer (`self_attn.q_proj`, `mlp.gate_proj`, …).
    pub(crate) fn module(self) -> &'static str {
        match self {
            Proj::Q => "self_attn.q_proj",
            Proj::K => "self_attn.k_proj",
            Proj::V => "self_attn.v_proj",
            Proj::O => "self_attn.o_proj",
            Proj::Gate => "mlp.gate_proj",
            Proj::Up => "mlp.up_proj",
            Proj::Down => "mlp.down_proj",
        }
    }

    /// Every projection, in declaration order (`Proj::ALL[p as usize] == p`).
    pub(crate) const ALL: [Proj; 7] = [
        Proj::Q,
        Proj::K,
        Proj::V,
        Proj::O,
        Proj::Gate,
        Proj::Up,
        Proj::Down,
    ];
}

/// Projected heads of one layer for flat tokens.
pub(crate) struct Qkv {
    /// `(N, heads, head_dim)`, q-norm applied, before RoPE.
    pub q: Tensor,
    /// `(N, kv_heads, head_dim)`, k-norm applied, before RoPE.
    pub k: Tensor,
    /// `(N, kv_heads, head_dim)`.
    pub v: Tensor,
}

impl LayerWeights {
    /// Every tensor converted to `dtype`: the bf16 copy a mixed-precision forward computes with
    /// (each conversion is a graph node, so gradients reach the f32 masters in f32).
    pub(crate) fn to_dtype(&self, dtype: candle_core::DType) -> CandleResult<Self> {
        self.map(|t| t.to_dtype(dtype))
    }

    /// The layer with `f` of each of its tensors.
    pub(crate) fn map(&self, f: impl Fn(&Tensor) -> CandleResult<Tensor>) -> CandleResult<Self> {
        let opt = |t: &Option<Tensor>| t.as_ref().map(&f).transpose();
        Ok(Self {
            input_norm: f(&self.input_norm)?,
            q_proj: f(&self.q_proj)?,
            k_proj: f(&self.k_proj)?,
            v_proj: f(&self.v_proj)?,
            q_bias: opt(&self.q_bias)?,
            k_bias: opt(&self.k_bias)?,
            v_bias: opt(&self.v_bias)?,
            o_proj: f(&self.o_proj)?,
            q_norm: opt(&self.q_norm)?,
            k_norm: opt(&self.k_norm)?,
            post_norm: f(&self.post_norm)?,
            gate_proj: f(&self.gate_proj)?,
            up_proj: f(&self.up_proj)?,
            down_proj: f(&self.down_proj)?,
        })
    }

    /// The weight of projection `p`.
    pub(crate) fn weight(&self, p: Proj) -> &Tensor {
        match p {
            Proj::Q => &self.q_proj,
            Proj::K => &self.k_proj,
            Proj::V => &self.v_proj,
            Proj::O => &self.o_proj,
            Proj::Gate => &self.gate_proj,
            Proj::Up => &self.up_proj,
            Proj::Down => &self.down_proj,
        }
    }

    /// The bias of projection `p`, if the architecture has one.
    pub(crate) fn bias(&self, p: Proj) -> Option<&Tensor> {
        match p {
            Proj::Q => self.q_bias.as_ref(),
            Proj::K => self.k_bias.as_ref(),
            Proj::V => self.v_bias.as_ref(),
            _ => None,
        }
    }

    /// `x Wᵀ (+ b)` of projection `p` with this layer's own weights.
    pub(crate) fn project(&self, x: &Tensor, p: Proj, kernels: Kernels) -> CandleResult<Tensor> {
        linear_with(x, self.weight(p), self.bias(p), kernels)
    }

    /// Input norm and q/k/v projections of `x: (N, hidden)`.
    pub(crate) fn qkv(
        &self,
        x: &Tensor,
        config: &ModelConfig,
        kernels: Kernels,
    ) -> CandleResult<Qkv> {
        let h = rms_norm(x, &self.input_norm, config.rms_norm_eps, kernels)?;
        let qkv = [
            self.project(&h, Proj::Q, kernels)?,
            self.project(&h, Proj::K, kernels)?,
            self.project(&h, Proj::V, kernels)?,
        ];
        self.heads(qkv, config, kernels)
    }

    /// The q, k and v projections `(N, ·)` of the layer's normed input as heads, the q/k norms
    /// applied where the architecture has them.
    pub(crate) fn heads(
        &self,
        [q, k, v]: [Tensor; 3],
        config: &ModelConfig,
        kernels: Kernels,
    ) -> CandleResult<Qkv> {
        let n = q.dim(0)?;
        let d = config.head_dim;
        let eps = config.rms_norm_eps;
        let q = q.reshape((n, config.num_heads, d))?;
        let k = k.reshape((n, config.num_kv_heads, d))?;
        let v = v.reshape((n, config.num_kv_heads, d))?;
        let q = match &self.q_norm {
            Some(w) => rms_norm(&q, w, eps, kernels)?,
            None => q,
        };
        let k = match &self.k_norm {
            Some(w) => rms_norm(&k, w, eps, kernels)?,
            None => k,
        };
        Ok(Qkv { q, k, v })
    }

    /// Input norm and q/k/v projections of `x: (N, hidden)` with the fused training ops, heads
    /// left flat: q `(N, heads·d)`, k and v `(N, kv_heads·d)` (no reshape nodes in the graph;
    /// the q/k norms normalise each head's `d` values in place).
    pub(crate) fn qkv_flat(&self, x: &Tensor, config: &ModelConfig) -> CandleResult<Qkv> {
        let eps = config.rms_norm_eps;
        let h = crate::fused::rms_norm(x, &self.input_norm, eps)?;
        let q = crate::fused::linear(&h, &self.q_proj, self.q_bias.as_ref())?;
        let k = crate::fused::linear(&h, &self.k_proj, self.k_bias.as_ref())?;
        let v = crate::fused::linear(&h, &self.v_proj, self.v_bias.as_ref())?;
        let q = match &self.q_norm {
            Some(w) => crate::fused::rms_norm(&q, w, eps)?,
            None => q,
        };
        let k = match &self.k_norm {
            Some(w) => crate::fused::rms_norm(&k, w, eps)?,
            None => k,
        };
        Ok(Qkv { q, k, v })
    }

    /// Residual MLP block: `x + down(silu(gate(n)) * up(n))` with `n = post_norm(x)`.
    pub(crate) fn mlp_block(&self, x: &Tensor, eps: f64, kernels: Kernels) -> CandleResult<Tensor> {
        let h = rms_norm(x, &self.post_norm, eps, kernels)?;
        let gate = self.project(&h, Proj::Gate, kernels)?;
        let up = self.project(&h, Proj::Up, kernels)?;
        // The fused op for training (it has a backward) and for inference too: one pass with
        // a vectorised exp, where candle's `silu` then `mul` were two passes, libm's `expf` per
        // element and a barrier-pool split (about 40 % of the quickstart engine's samples).
        let fused = match kernels {
            Kernels::Differentiable => false,
            // On a GPU one launch (`kernels/fused.cu`) where silu and mul were two.
            Kernels::Fused => crate::fused::supported(&gate) || crate::fused::on_device(&gate),
            Kernels::Custom => kernels.custom_for(&gate),
        };
        let act = if fused {
            crate::fused::swiglu(&gate, &up)?
        } else {
            (gate.silu()? * up)?
        };
        x + self.project(&act, Proj::Down, kernels)?
    }
}
