//! An engine's bf16 products on the CPU: every projection weight of the decoder and the LM head
//! rounded to bf16 and packed for the AMX tiles ([`crate::amx`]), once per weight version, beside
//! the f32 snapshot (which the embedding, the norms and the published checkpoints keep using).
//!
//! Only the products change precision: their inputs are rounded to bf16 as they enter the
//! tiles, their sums are f32, and every activation, norm, attention score and logit stays f32.
//! This is what a bf16 engine does on a GPU, and what [`crate::InferenceModel::set_compute_dtype`]
//! turns on.

use std::cell::RefCell;

use candle_core::{Device, Result as CandleResult, Tensor, TensorId};

use crate::amx::{Bf16Rows, Bf16Weight};
use crate::error::{ModelError, Result, TensorContext};
use crate::layers::{DecoderWeights, Proj};

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

    /// `x Wᵀ (+ bias)` for projection `p` of layer `layer`, `x` rounded through `rounded`.
    pub(crate) fn project(
        &self,
        layer: usize,
        x: &Tensor,
        p: Proj,
        bias: Option<&Tensor>,
        rounded: &RoundedInput,
    ) -> CandleResult<Tensor> {
        let y = rounded.product(&self.layers[layer], p, x)?;
        match bias {
            Some(b) => y.broadcast_add(b),
            None => Ok(y),
        }
    }

    /// The MLP's products for `h` (the post-attention norm's output) in layer `layer`:
    /// `down(silu(gate) ⊙ up)`, gate and up in one pass of the pool, their activation rounded
    /// for the down projection's tiles as it is computed ([`Bf16Rows::swiglu`]). The MLP has no
    /// biases in any architecture here.
    pub(crate) fn mlp(
        &self,
        layer: usize,
        h: &Tensor,
        rounded: &RoundedInput,
    ) -> CandleResult<Tensor> {
        let gate = rounded.product(&self.layers[layer], Proj::Gate, h)?;
        let up = rounded.product(&self.layers[layer], Proj::Up, h)?;
        let (m, k) = gate.dims2()?;
        let act = with_values(&gate, |g| {
            with_values(&up, |u| Bf16Rows::swiglu(g, u, m, k))
        })??;
        let down = &self.layers[layer][Proj::Down as usize];
        check_width(down, &gate)?;
        Tensor::from_vec(down.product(&act), (m, down.rows()), &Device::Cpu)
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

/// The last input of a layer's products, rounded for the tiles, with the products computed
/// beside the one asked for that read it too ([`Proj::with_same_input`]): q, k and v (gate and
/// up) round their input once and share one pass of the pool. Keyed by the tensor's id, which
/// candle never reuses.
#[derive(Debug, Default)]
pub(crate) struct RoundedInput(RefCell<Option<Rounded>>);

#[derive(Debug)]
struct Rounded {
    input: TensorId,
    rows: Bf16Rows,
    /// Products of `input` computed ahead, not yet asked for.
    ready: Vec<(Proj, Tensor)>,
}

impl RoundedInput {
    /// `x (m, k) · wᵀ` as a new `(m, n)` tensor, for the weight of projection `p` in `layer`
    /// (packed in [`Proj::ALL`] order).
    fn product(&self, layer: &[Bf16Weight], p: Proj, x: &Tensor) -> CandleResult<Tensor> {
        let (m, k) = x.dims2()?;
        let mut last = self.0.borrow_mut();
        let id = x.id();
        if let Some(r) = last.as_mut().filter(|r| r.input == id)
            && let Some(i) = r.ready.iter().position(|(q, _)| *q == p)
        {
            return Ok(r.ready.swap_remove(i).1);
        }
        let group = p.with_same_input();
        let weights: Vec<&Bf16Weight> = group.iter().map(|&q| &layer[q as usize]).collect();
        for w in &weights {
            check_width(w, x)?;
        }
        if last.as_ref().is_none_or(|r| r.input != id) {
            *last = Some(Rounded {
                input: id,
                rows: with_values(x, |v| Bf16Rows::round(v, m, k))?,
                ready: Vec::new(),
            });
        }
        let r = last.as_mut().expect("rounded above");
        let mut asked = None;
        for ((&q, w), y) in group
            .iter()
            .zip(&weights)
            .zip(crate::amx::products(&weights, &r.rows))
        {
            let y = Tensor::from_vec(y, (m, w.rows()), &Device::Cpu)?;
            if q == p {
                asked = Some(y);
            } else {
                r.ready.push((q, y));
            }
        }
        Ok(asked.expect("a group starts with the projection asked for"))
    }
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
