//! [`TrainableModel`]: parameters as candle `Var`s and the differentiable forward over packed
//! batches, returning per-token log-probabilities and entropies.

use std::sync::Arc;

use candle_core::{D, DType, Device, Tensor, Var};
use sluice_core::PolicyVersion;

use crate::batch::PackedBatch;
use crate::config::ModelConfig;
use crate::error::{ModelError, Result, TensorContext};
use crate::fused::{AttentionHeads, Segments};
use crate::layers::{DecoderWeights, LayerWeights, linear};
use crate::low_rank::{LowRank, LowRankTable};
use crate::ops::{Kernels, Rope, apply_rope, compute_dtype, softmax_last_dim};
use crate::scores::token_scores;
use crate::snapshot::ModelWeights;
use crate::step_weights::StepWeights;

/// Per-slot results of [`TrainableModel::token_scores`], each `(B, L)` in f32 (f64 for an f64
/// model) and differentiable with respect to every parameter.
#[derive(Debug, Clone)]
pub struct TokenScores {
    /// `log softmax(z / T)[target]`: natural-log probability of `target_ids` given the prefix
    /// of its sequence, with `z` the raw logits and `T` = [`ForwardOptions::temperature`].
    pub logprobs: Tensor,
    /// `−Σ_v p_v log p_v` of the same distribution, in nats.
    pub entropy: Tensor,
}

/// Options of the training forward.
#[derive(Debug, Clone, Copy)]
pub struct ForwardOptions {
    /// Rows of the `(B·L, vocab)` logits computed at a time.
    pub logits_chunk_rows: usize,
    /// Logits are divided by this before the softmax (use the engine's sampling temperature so
    /// that trainer and behaviour log-probs are of the same distribution). Must be > 0.
    pub temperature: f64,
    /// Bytes of logits the forward keeps for the backward (its first chunks, in order, while
    /// they fit), which forms the rest again from the hidden rows: one product with the
    /// vocabulary's weights per chunk, about a sixth of a real model's head. Only when a
    /// gradient may be taken; 0 recomputes every chunk.
    pub kept_logits_bytes: usize,
}

impl ForwardOptions {
    /// [`ForwardOptions::kept_logits_bytes`] by default: 1 GiB.
    pub const DEFAULT_KEPT_LOGITS_BYTES: usize = 1 << 30;
}

impl Default for ForwardOptions {
    fn default() -> Self {
        Self {
            logits_chunk_rows: 1024,
            temperature: 1.0,
            kept_logits_bytes: Self::DEFAULT_KEPT_LOGITS_BYTES,
        }
    }
}

/// The trainer's model: owns its parameters as `Var`s (fresh storage, never shared with a
/// snapshot), so an optimizer may update them in place.
#[derive(Debug)]
pub struct TrainableModel {
    config: Arc<ModelConfig>,
    vars: Vec<(String, Var)>,
    weights: DecoderWeights,
    rope: Rope,
    kernels: Kernels,
    /// Dtype of the forward's products and activations ([`TrainableModel::set_compute_dtype`]).
    compute: DType,
    /// The parameters converted to `compute` once for a step
    /// ([`TrainableModel::set_step_weights`]).
    pub(crate) step: Option<StepWeights>,
    /// Whether the layers' backward is written by hand where it applies
    /// ([`TrainableModel::set_hand_backward`]).
    pub(crate) hand_backward: bool,
    /// LoRA's adapters, whose gradients the backward forms in place of every parameter's
    /// ([`TrainableModel::set_low_rank`]).
    pub(crate) low_rank: Option<LowRankTable>,
}

impl TrainableModel {
    /// Copies `snapshot` into new variables of `dtype` (f32 master weights are the usual choice)
    /// on the snapshot's device.
    pub fn from_snapshot(snapshot: &ModelWeights, dtype: DType) -> Result<Self> {
        let mut vars = Vec::with_capacity(snapshot.len());
        for (name, t) in snapshot.iter() {
            // `Var::from_tensor` would reuse a tensor that already is a variable: copy always.
            let fresh = if t.dtype() == dtype {
                t.copy()
            } else {
                t.to_dtype(dtype)
            };
            let var = Var::from_tensor(&fresh.ctx(name)?.detach()).ctx(name)?;
            vars.push((name.to_owned(), var));
        }
        let config = Arc::clone(snapshot.config());
        let weights = DecoderWeights::build(&config, |name| {
            vars.iter()
                .find(|(n, _)| n == name)
                .map(|(_, v)| v.as_tensor().clone())
                .ok_or_else(|| ModelError::MissingTensor {
                    name: name.to_owned(),
                    dir: "<trainable model>".into(),
                })
        })?;
        let rope = Rope::new(&config);
        Ok(Self {
            config,
            vars,
            weights,
            rope,
            kernels: Kernels::Custom,
            compute: dtype,
            step: None,
            hand_backward: true,
            low_rank: None,
        })
    }

    /// Chooses the training forward's kernels: [`Kernels::Custom`] (the default: fused ops with
    /// hand-written backward where they apply) or [`Kernels::Differentiable`] (candle's
    /// composition, the reference). [`Kernels::Fused`] has no backward and is refused.
    pub fn set_kernels(&mut self, kernels: Kernels) -> Result<()> {
        if kernels == Kernels::Fused {
            return Err(ModelError::input(
                "Kernels::Fused has no backward; a trainable model takes Custom or Differentiable",
            ));
        }
        self.kernels = kernels;
        Ok(())
    }

    /// Takes each decoder layer's backward by hand where it applies (`true`, the default:
    /// [`TrainableModel::backward_saved`]) or by candle's autograd over the forward's whole
    /// graph (`false`: the reference, for tests and `sluice bench trainer --graph-backward`).
    pub fn set_hand_backward(&mut self, on: bool) {
        self.hand_backward = on;
    }

    /// Trains LoRA's adapters in place of the parameters: each `(weight name, adapters)` of
    /// `adapters` is a projection computing with its weight as `W₀ + s·B·A` (the caller keeps
    /// the weight merged), and the backward ([`TrainableModel::backward_saved`]) files
    /// `∂L/∂A` and `∂L/∂B` under `A`'s and `B`'s tensors, formed from each projection's input
    /// and output gradient without forming the weight's ([`crate::low_rank`]), and no
    /// parameter's gradient: norms, biases, embeddings and the LM head are frozen. Where a
    /// layer's backward is not written by hand (candle's graph), the weights' gradients are
    /// formed as without adapters and the caller projects them. Empty: every parameter
    /// trains again. Refuses a name that is no projection's weight, one named twice, and
    /// adapters whose shapes do not fit.
    pub fn set_low_rank(&mut self, adapters: Vec<(String, LowRank)>) -> Result<()> {
        self.low_rank = if adapters.is_empty() {
            None
        } else {
            Some(LowRankTable::new(&self.config, adapters)?)
        };
        Ok(())
    }

    /// The training forward's kernels ([`TrainableModel::set_kernels`]).
    pub fn kernels(&self) -> Kernels {
        self.kernels
    }

    /// Sets the dtype the forward computes in. The parameters' own dtype is the default; a
    /// narrower float (bf16) gives mixed precision in the manner of PyTorch's autocast: every
    /// parameter is converted for the forward (gradients come back through the conversion, so
    /// they and the parameters stay in their own dtype), matrix products and activations run in
    /// the compute dtype, and norms' statistics, the attention softmax, log-probs and entropies
    /// in f32.
    pub fn set_compute_dtype(&mut self, dtype: DType) -> Result<()> {
        if !dtype.is_float() || dtype.size_in_bytes() > self.dtype().size_in_bytes() {
            return Err(ModelError::input(format!(
                "compute dtype {dtype:?}: a float no wider than the parameters' {:?}",
                self.dtype()
            )));
        }
        self.compute = dtype;
        self.step = None;
        Ok(())
    }

    /// The dtype the forward computes in ([`TrainableModel::set_compute_dtype`]).
    pub fn compute_dtype(&self) -> DType {
        self.compute
    }

    /// Whether this model's forward runs the fused ops: on the CPU when it computes in its
    /// parameters' dtype (f32, f64); on a GPU in f32 or bf16, for heads the attention kernels
    /// take ([`crate::fused::on_device`]).
    pub(crate) fn custom(&self) -> bool {
        let embed = &self.weights.embed;
        if !self.kernels.custom_for(embed) {
            return false;
        }
        if crate::fused::supported(embed) {
            return self.compute == self.dtype() || self.tile_products();
        }
        matches!(self.compute, DType::F32 | DType::BF16)
            && crate::fused::on_device_head_dim(self.config.head_dim)
    }

    /// Whether this model's products run on AMX tiles: a CPU with AMX, f32 parameters and
    /// bf16 compute. The linear layers and the head then round their operands to bf16 and sum
    /// in f32 ([`crate::fused::Bf16Products`]), while every tensor stays f32: the CPU's fused
    /// kernels are f32 and f64, and there the rounding that matters for speed is the
    /// products'.
    pub(crate) fn tile_products(&self) -> bool {
        let embed = &self.weights.embed;
        self.compute == DType::BF16
            && embed.dtype() == DType::F32
            && crate::fused::supported(embed)
            && self.kernels.custom_for(embed)
            && crate::amx::available()
    }

    /// This thread's products on the tiles while the guard lives, where the model takes them
    /// ([`Self::tile_products`]); off otherwise.
    pub(crate) fn products_scope(&self) -> crate::fused::Bf16Products {
        crate::fused::Bf16Products::enter(self.tile_products())
    }

    /// The dtype the forward's tensors (activations and the weights it reads) are in: the
    /// compute dtype, except with the products on the tiles, where they stay f32.
    pub(crate) fn tensor_dtype(&self) -> DType {
        if self.tile_products() {
            self.dtype()
        } else {
            self.compute
        }
    }

    /// The weights the forward reads: the step's converted copies when there are some.
    fn forward_weights(&self) -> &DecoderWeights {
        self.step.as_ref().map_or(&self.weights, |s| &s.weights)
    }

    /// Whether the layers' weights are in the compute dtype already, where the forward reads
    /// them as they are (the parameters themselves, or the step's converted copies).
    pub(crate) fn layer_weights_converted(&self) -> bool {
        let layers = &self.forward_weights().layers;
        let dtype = self.tensor_dtype();
        layers.iter().all(|l| l.input_norm.dtype() == dtype)
    }

    /// The master parameters, as the decoder's tensors.
    pub(crate) fn weights(&self) -> &DecoderWeights {
        &self.weights
    }

    /// Layer `i`'s weights in the compute dtype.
    pub(crate) fn layer_weights(
        &self,
        i: usize,
    ) -> candle_core::Result<std::borrow::Cow<'_, LayerWeights>> {
        let (layer, dtype) = (&self.forward_weights().layers[i], self.tensor_dtype());
        Ok(if layer.input_norm.dtype() == dtype {
            std::borrow::Cow::Borrowed(layer)
        } else {
            std::borrow::Cow::Owned(layer.to_dtype(dtype)?)
        })
    }

    /// The architecture.
    pub fn config(&self) -> &Arc<ModelConfig> {
        &self.config
    }

    /// Every parameter with its HF name, in checkpoint order (a tied LM head appears once, as
    /// the embedding).
    pub fn vars(&self) -> &[(String, Var)] {
        &self.vars
    }

    /// The parameter called `name`.
    pub fn var(&self, name: &str) -> Option<&Var> {
        self.vars.iter().find(|(n, _)| n == name).map(|(_, v)| v)
    }

    /// The dtype of the parameters.
    pub fn dtype(&self) -> DType {
        self.weights.embed.dtype()
    }

    /// The device of the parameters.
    pub fn device(&self) -> &Device {
        self.weights.embed.device()
    }

    /// Publishes the current parameters as an immutable snapshot: every tensor is copied into
    /// fresh storage (converted to `dtype` when given), so later optimizer steps cannot reach it.
    ///
    /// On a GPU the copies are finished before this returns: a snapshot goes to other threads
    /// (engines), and candle issues each thread's work on that thread's own stream, which is not
    /// ordered after this one's.
    pub fn snapshot(&self, version: PolicyVersion, dtype: Option<DType>) -> Result<ModelWeights> {
        let snapshot = ModelWeights::copied_from(
            Arc::clone(&self.config),
            version,
            self.vars.iter().map(|(n, v)| (n.as_str(), v.as_tensor())),
            dtype,
        )?;
        self.device().synchronize().ctx("snapshot copies")?;
        Ok(snapshot)
    }

    /// [`Self::snapshot`] from copies the caller made: `fresh[i]` is a copy of parameter `i` of
    /// [`Self::vars`] in fresh storage (a GPU's one-launch copy of every parameter). Finished
    /// on the device before this returns, as [`Self::snapshot`] is.
    pub fn snapshot_of(&self, version: PolicyVersion, fresh: Vec<Tensor>) -> Result<ModelWeights> {
        let names = self.vars.iter().map(|(n, _)| n.clone());
        let snapshot = ModelWeights::new(
            Arc::clone(&self.config),
            version,
            names.zip(fresh).collect(),
        )?;
        self.device().synchronize().ctx("snapshot copies")?;
        Ok(snapshot)
    }

    /// Log-probabilities of `batch.target_ids` and entropies, `(B, L)` each. Logits are formed
    /// `options.logits_chunk_rows` rows at a time, in the forward and the backward pass.
    pub fn token_scores(
        &self,
        batch: &PackedBatch,
        options: ForwardOptions,
    ) -> Result<TokenScores> {
        check_temperature(options.temperature)?;
        let _tiles = self.products_scope();
        let hidden = self.hidden_states(batch)?;
        self.scores_from_hidden(&hidden, batch, options)
    }

    /// The log-prob/entropy head over final-norm hidden states `(B·L, hidden)`.
    pub(crate) fn scores_from_hidden(
        &self,
        hidden: &Tensor,
        batch: &PackedBatch,
        options: ForwardOptions,
    ) -> Result<TokenScores> {
        let targets = Tensor::new(batch.target_ids.as_slice(), self.device()).ctx("targets")?;
        let head = self.forward_weights().lm_head.to_dtype(self.tensor_dtype());
        // Frozen under LoRA: the head's backward forms no weight gradient.
        let head = self.frozen(head.ctx("lm head")?);
        let scores = token_scores(
            hidden,
            &head,
            &targets,
            options.logits_chunk_rows,
            options.temperature,
            self.custom(),
            options.kept_logits_bytes,
        )
        .ctx("token scores")?;
        let shape = (batch.batch, batch.seq_len);
        let col = |i: usize| scores.narrow(1, i, 1)?.reshape(shape);
        Ok(TokenScores {
            logprobs: col(0).ctx("token scores")?,
            entropy: col(1).ctx("token scores")?,
        })
    }

    /// Full logits `(B, L, vocab)` in the compute dtype. Materializes everything: for tests and
    /// small evaluations, not for training.
    pub fn logits(&self, batch: &PackedBatch) -> Result<Tensor> {
        let _tiles = self.products_scope();
        let hidden = self.hidden_states(batch)?;
        let cdt = compute_dtype(self.dtype());
        let logits = hidden
            .to_dtype(cdt)
            .and_then(|h| linear(&h, &self.weights.lm_head.to_dtype(cdt)?, None))
            .ctx("logits")?;
        logits
            .reshape((batch.batch, batch.seq_len, self.config.vocab_size))
            .ctx("logits")
    }

    /// Final-norm hidden states, flat `(B·L, hidden)`.
    pub(crate) fn hidden_states(&self, batch: &PackedBatch) -> Result<Tensor> {
        let inputs = self.layer_inputs(batch)?;
        let mut x = self.embed(&inputs)?;
        for i in 0..self.weights.layers.len() {
            x = self.layer(i, &x, &inputs)?;
        }
        self.final_norm(&x)
    }

    /// What every layer reads besides the residual stream: token ids, rotary tables and mask.
    pub(crate) fn layer_inputs(&self, batch: &PackedBatch) -> Result<LayerInputs> {
        batch.validate(self.config.vocab_size)?;
        let (b, l) = (batch.batch, batch.seq_len);
        let (dtype, device) = (self.tensor_dtype(), self.device().clone());
        let ids = Tensor::new(batch.input_ids.as_slice(), &device).ctx("input ids")?;
        let (cos, sin) = self
            .rope
            .cos_sin(&batch.position_ids, (b, l), dtype, &device)
            .ctx("rotary tables")?;
        // Built once per batch for every layer: the segments for the fused attention, or the
        // (B, 1, 1, L, L) additive mask (broadcast over kv heads and the query heads of each
        // group) for the composition, in the softmax's dtype.
        let mask = if self.custom() {
            let segments = Segments::with_prefixes(b, l, &batch.segment_ids, &batch.prefix_ids)
                .ctx("segments")?;
            Mask::Segments(Arc::new(segments))
        } else {
            let mask = Tensor::from_vec(batch.attention_mask(), (b, 1, 1, l, l), &device)
                .and_then(|m| m.to_dtype(compute_dtype(dtype)))
                .ctx("attention mask")?;
            Mask::Dense(mask)
        };
        Ok(LayerInputs {
            ids,
            cos,
            sin,
            mask,
            shape: (b, l),
        })
    }

    pub(crate) fn embed(&self, inputs: &LayerInputs) -> Result<Tensor> {
        // Rows gathered from the master table, then converted: the table itself is not copied.
        self.weights
            .embed
            .index_select(&inputs.ids, 0)
            .and_then(|x| x.to_dtype(self.tensor_dtype()))
            .ctx("embedding")
    }

    pub(crate) fn final_norm(&self, x: &Tensor) -> Result<Tensor> {
        let eps = self.config.rms_norm_eps;
        self.forward_weights()
            .final_norm
            .to_dtype(self.tensor_dtype())
            .and_then(|w| crate::ops::rms_norm(x, &self.frozen(w), eps, self.kernels))
            .ctx("final norm")
    }

    /// `t` outside the graph while LoRA's adapters train ([`Self::set_low_rank`]), so no
    /// gradient is formed for it; else `t`.
    fn frozen(&self, t: Tensor) -> Tensor {
        match self.low_rank {
            Some(_) => t.detach(),
            None => t,
        }
    }

    /// Decoder layer `i` on the flat residual stream `x` `(B·L, hidden)`.
    pub(crate) fn layer(&self, i: usize, x: &Tensor, inputs: &LayerInputs) -> Result<Tensor> {
        match &inputs.mask {
            Mask::Segments(segments) => self.layer_fused(i, x, inputs, segments),
            Mask::Dense(mask) => self.layer_composed(i, x, inputs, mask),
        }
    }

    /// [`TrainableModel::layer`] with the fused ops: every activation stays `(B·L, features)`.
    fn layer_fused(
        &self,
        i: usize,
        x: &Tensor,
        inputs: &LayerInputs,
        segments: &Arc<Segments>,
    ) -> Result<Tensor> {
        let c = &self.config;
        let layer = self.layer_weights(i).ctx(&format!("layer {i} weights"))?;
        let step = || -> candle_core::Result<Tensor> {
            let qkv = layer.qkv_flat(x, c)?;
            let q = crate::fused::rope(&qkv.q, &inputs.cos, &inputs.sin, c.head_dim)?;
            let k = crate::fused::rope(&qkv.k, &inputs.cos, &inputs.sin, c.head_dim)?;
            let heads = AttentionHeads {
                heads: c.num_heads,
                kv_heads: c.num_kv_heads,
                head_dim: c.head_dim,
            };
            let att = crate::fused::attention(&q, &k, &qkv.v, segments, heads)?;
            let x = (x + crate::fused::linear(&att, &layer.o_proj, None)?)?;
            layer.mlp_block(&x, c.rms_norm_eps, Kernels::Custom)
        };
        step().ctx(&format!("training forward, layer {i}"))
    }

    /// [`TrainableModel::layer`] composed of candle's elementary ops.
    fn layer_composed(
        &self,
        i: usize,
        x: &Tensor,
        inputs: &LayerInputs,
        mask: &Tensor,
    ) -> Result<Tensor> {
        let c = &self.config;
        let layer = self.layer_weights(i).ctx(&format!("layer {i} weights"))?;
        let (b, l) = inputs.shape;
        let (cos, sin) = (&inputs.cos, &inputs.sin);
        let kernels = Kernels::Differentiable;
        let scale = 1.0 / (c.head_dim as f64).sqrt();
        let step = || -> candle_core::Result<Tensor> {
            let qkv = layer.qkv(x, c, kernels)?;
            // (B·L, heads, d) → (B, heads, L, d)
            let heads = |t: Tensor, n: usize| t.reshape((b, l, n, c.head_dim))?.transpose(1, 2);
            let q = apply_rope(&heads(qkv.q, c.num_heads)?, cos, sin, kernels)?;
            let k = apply_rope(&heads(qkv.k, c.num_kv_heads)?, cos, sin, kernels)?;
            let v = heads(qkv.v, c.num_kv_heads)?.contiguous()?;
            // GQA without copying k/v: group the query heads of each kv head as extra rows.
            let g = c.kv_groups();
            let q = q
                .contiguous()?
                .reshape((b, c.num_kv_heads, g * l, c.head_dim))?;
            // Products in the compute dtype, the mask and softmax in the mask's (f32 under bf16).
            let scores = (q.matmul(&k.contiguous()?.t()?)? * scale)?;
            let scores = scores
                .to_dtype(mask.dtype())?
                .reshape((b, c.num_kv_heads, g, l, l))?
                .broadcast_add(mask)?
                .reshape((b, c.num_kv_heads, g * l, l))?;
            let att = softmax_last_dim(&scores, kernels)?
                .to_dtype(v.dtype())?
                .matmul(&v)?;
            // (B, kv, g·L, d) = (B, heads, L, d) → (B·L, heads·d)
            let att = att
                .reshape((b, c.num_heads, l, c.head_dim))?
                .transpose(1, 2)?
                .reshape((b * l, c.num_heads * c.head_dim))?;
            let x = (x + linear(&att, &layer.o_proj, None)?)?;
            layer.mlp_block(&x, c.rms_norm_eps, kernels)
        };
        step().ctx(&format!("training forward, layer {i}"))
    }
}

pub(crate) fn check_temperature(t: f64) -> Result<()> {
    if !(t.is_finite() && t > 0.0) {
        return Err(ModelError::input(format!(
            "temperature must be a positive number, got {t}"
        )));
    }
    Ok(())
}

/// Per-batch inputs shared by every layer of one forward.
#[derive(Debug)]
pub(crate) struct LayerInputs {
    ids: Tensor,
    /// `(B, L, head_dim/2)`.
    cos: Tensor,
    sin: Tensor,
    mask: Mask,
    shape: (usize, usize),
}

impl LayerInputs {
    /// The batch's input token ids, flat.
    pub(crate) fn ids(&self) -> &Tensor {
        &self.ids
    }

    /// The rotary tables' cosines and sines.
    pub(crate) fn cos(&self) -> &Tensor {
        &self.cos
    }

    /// See [`LayerInputs::cos`].
    pub(crate) fn sin(&self) -> &Tensor {
        &self.sin
    }

    /// The segments of the fused attention, where the forward runs it.
    pub(crate) fn segments(&self) -> Option<&Arc<Segments>> {
        match &self.mask {
            Mask::Segments(segments) => Some(segments),
            Mask::Dense(_) => None,
        }
    }
}

/// Which slots see which, in the form the forward's attention takes.
#[derive(Debug)]
enum Mask {
    /// For the fused attention.
    Segments(Arc<Segments>),
    /// The additive `(B, 1, 1, L, L)` mask of the composition.
    Dense(Tensor),
}

/// Sums `t` over everything (a scalar loss helper for tests and simple callers).
pub fn sum_all(t: &Tensor) -> Result<Tensor> {
    t.flatten_all().and_then(|f| f.sum(D::Minus1)).ctx("sum")
}
