//! An engine's bf16 products on the CPU: every projection weight of the decoder and the LM head
//! rounded to bf16 and packed for the AMX tiles ([`crate::amx`]), once per weight version, beside
//! the f32 snapshot (which the embedding, the norms and the published checkpoints keep using).
//!
//! Only the products change precision: their inputs are rounded to bf16 as they enter the
//! tiles, their sums are f32, and every activation, norm, attention score and logit stays f32.
//! This is what a bf16 engine does on a GPU, and what [`crate::InferenceModel::set_compute_dtype`]
//! turns on.

use candle_core::{Device, Result as CandleResult, Tensor};

use crate::amx::{Bf16Rows, Bf16Weight};
use crate::error::{ModelError, Result, TensorContext};
use crate::layers::{DecoderWeights, LayerWeights, Proj};

/// The packed weights of one decoder.
#[derive(Debug)]
pub(crate) struct PackedDecoder {
    /// Per layer, the projections in [`Proj::ALL`] order.
    layers: Vec<Vec<Bf16Weight>>,
    lm_head: Bf16Weight,
}

impl PackedDecoder {
    /// Packs `weights` (f32, on the CPU).
    pub(crate) fn pack(weights: &DecoderWeights) -> Result<Self> {
        let layers = weights
            .layers
            .iter()
            .enumerate()
            .map(|(li, layer)| {
                Proj::ALL
                    .iter()
                    .map(|&p| pack(layer.weight(p)).ctx(&format!("bf16 packing, layer {li} {p:?}")))
                    .collect::<Result<Vec<_>>>()
            })
            .collect::<Result<_>>()?;
        let lm_head = pack(&weights.lm_head).ctx("bf16 packing, lm head")?;
        Ok(Self { layers, lm_head })
    }

    /// Packs `weights` (same architecture and shapes) into the memory already held.
    pub(crate) fn repack(&mut self, weights: &DecoderWeights) -> Result<()> {
        for (li, (packed, layer)) in self.layers.iter_mut().zip(&weights.layers).enumerate() {
            for (w, &p) in packed.iter_mut().zip(&Proj::ALL) {
                repack(w, layer.weight(p)).ctx(&format!("bf16 packing, layer {li} {p:?}"))?;
            }
        }
        repack(&mut self.lm_head, &weights.lm_head).ctx("bf16 packing, lm head")
    }

    /// q, k and v of layer `layer` for `x`, the layer's input: its input norm rounded for the
    /// tiles as it is computed ([`Bf16Rows::rms_norm`]), the three products in one pass of the
    /// pool, the biases added where the architecture has them.
    pub(crate) fn qkv(
        &self,
        layer: usize,
        weights: &LayerWeights,
        x: &Tensor,
        eps: f64,
    ) -> CandleResult<[Tensor; 3]> {
        let rows = normed(x, &weights.input_norm, eps)?;
        let [q, k, v] = self
            .products(layer, &[Proj::Q, Proj::K, Proj::V], &rows)?
            .try_into()
            .expect("three products");
        let bias = |t: Tensor, p: Proj| match weights.bias(p) {
            Some(b) => t.broadcast_add(b),
            None => Ok(t),
        };
        Ok([bias(q, Proj::Q)?, bias(k, Proj::K)?, bias(v, Proj::V)?])
    }

    /// The MLP block's output for `x`, the residual stream after attention:
    /// `down(silu(gate) ⊙ up)` of its post-attention norm, the norm and the activation each
    /// rounded for the tiles as it is computed, gate and up in one pass of the pool. The MLP has
    /// no biases in any architecture here.
    pub(crate) fn mlp(
        &self,
        layer: usize,
        weights: &LayerWeights,
        x: &Tensor,
        eps: f64,
    ) -> CandleResult<Tensor> {
        let rows = normed(x, &weights.post_norm, eps)?;
        let [gate, up] = self
            .products(layer, &[Proj::Gate, Proj::Up], &rows)?
            .try_into()
            .expect("two products");
        let (m, k) = gate.dims2()?;
        let act = with_values(&gate, |g| {
            with_values(&up, |u| Bf16Rows::swiglu(g, u, m, k))
        })??;
        Ok(self.products(layer, &[Proj::Down], &act)?.remove(0))
    }

    /// `x Wᵀ (+ bias)` for projection `p` of layer `layer`.
    pub(crate) fn project(
        &self,
        layer: usize,
        x: &Tensor,
        p: Proj,
        bias: Option<&Tensor>,
    ) -> CandleResult<Tensor> {
        let (m, k) = x.dims2()?;
        let rows = with_values(x, |v| Bf16Rows::round(v, m, k))?;
        let y = self.products(layer, &[p], &rows)?.remove(0);
        match bias {
            Some(b) => y.broadcast_add(b),
            None => Ok(y),
        }
    }

    /// The products of `rows` with the weights of `projections` in layer `layer`, one pass of
    /// the pool, as `(m, n)` tensors.
    fn products(
        &self,
        layer: usize,
        projections: &[Proj],
        rows: &Bf16Rows,
    ) -> CandleResult<Vec<Tensor>> {
        let weights: Vec<&Bf16Weight> = projections
            .iter()
            .map(|&p| &self.layers[layer][p as usize])
            .collect();
        for w in &weights {
            if w.cols() != rows.cols() {
                candle_core::bail!(
                    "bf16 product: inputs of {} against a weight of {} inputs",
                    rows.cols(),
                    w.cols()
                )
            }
        }
        crate::amx::products(&weights, rows)
            .into_iter()
            .zip(&weights)
            .map(|(y, w)| Tensor::from_vec(y, (rows.rows(), w.rows()), &Device::Cpu))
            .collect()
    }

    /// The LM head's logits of `x`.
    pub(crate) fn lm_head(&self, x: &Tensor) -> CandleResult<Tensor> {
        let (m, k) = x.dims2()?;
        check_width(&self.lm_head, x)?;
        let rows = with_values(x, |v| Bf16Rows::round(v, m, k))?;
        Tensor::from_vec(
            self.lm_head.product(&rows),
            (m, self.lm_head.rows()),
            &Device::Cpu,
        )
    }
}

/// `x`'s rows RMS-normed by `w` and rounded for the tiles.
fn normed(x: &Tensor, w: &Tensor, eps: f64) -> CandleResult<Bf16Rows> {
    let (m, k) = x.dims2()?;
    if w.elem_count() != k {
        candle_core::bail!("rms norm of {:?} by {} weights", x.shape(), w.elem_count())
    }
    with_values(x, |x| {
        with_values(w, |w| Bf16Rows::rms_norm(x, w, eps, m, k))
    })?
}

/// Fails unless `x`'s rows are as wide as `w`'s inputs.
fn check_width(w: &Bf16Weight, x: &Tensor) -> CandleResult<()> {
    let k = x.dims2()?.1;
    if k != w.cols() {
        candle_core::bail!(
            "bf16 product: input {:?} against a weight of {} inputs",
            x.shape(),
            w.cols()
        )
    }
    Ok(())
}

/// The f32 CPU weight `w` (of `into`'s shape) rounded and packed into `into`.
fn repack(into: &mut Bf16Weight, w: &Tensor) -> CandleResult<()> {
    if w.dims2()? != (into.rows(), into.cols()) {
        candle_core::bail!(
            "bf16 packing: weight {:?} for a packed ({}, {})",
            w.shape(),
            into.rows(),
            into.cols()
        )
    }
    with_values(w, |v| into.repack(v))
}

/// The f32 CPU weight `w (n, k)` rounded and packed.
fn pack(w: &Tensor) -> CandleResult<Bf16Weight> {
    let (n, k) = w.dims2()?;
    with_values(w, |v| Bf16Weight::pack(v, n, k))
}

/// `f` of the f32 values of the CPU tensor `t`, row-major.
fn with_values<R>(t: &Tensor, f: impl FnOnce(&[f32]) -> R) -> CandleResult<R> {
    let t = t.contiguous()?;
    let (storage, layout) = t.storage_and_layout();
    Ok(f(crate::fused::storage_slice::<f32>(&storage, layout)?))
}

/// Why `weights` cannot be packed for bf16 products, if they cannot: they must be f32 on the
/// CPU, on a CPU whose AMX tiles this process may use.
pub(crate) fn refusal(weights: &DecoderWeights) -> Option<ModelError> {
    let embed = &weights.embed;
    if !matches!(embed.device(), Device::Cpu) {
        return Some(ModelError::input(
            "bf16 compute is for CPU engines; on a GPU set the weights' dtype (model.dtype = \"bf16\") instead",
        ));
    }
    if embed.dtype() != candle_core::DType::F32 {
        return Some(ModelError::input(format!(
            "bf16 compute on the CPU packs f32 weights; these are {:?} (set model.dtype = \"f32\")",
            embed.dtype()
        )));
    }
    if !crate::amx::available() {
        return Some(ModelError::input(
            "bf16 compute on the CPU needs Intel AMX tiles (Sapphire Rapids or later, Linux 5.16+), which this machine does not offer: use f32",
        ));
    }
    None
}
