//! LoRA's gradients formed by the backward itself
//! ([`TrainableModel::set_low_rank`](crate::TrainableModel::set_low_rank)).
//!
//! A projection adapted by `A (r, in)` and `B (out, r)` computes with `W = W₀ + s·B·A`. For its
//! input `x (N, in)` and its output's gradient `g (N, out)`, the weight's gradient would be
//! `G = gᵀ·x`, an `(out, in)` product of `N` terms; the adapters' are
//!
//! - `∂L/∂A = s·Bᵀ·G = s·(g·B)ᵀ·x` (`(r, in)`),
//! - `∂L/∂B = s·G·Aᵀ = s·gᵀ·(x·Aᵀ)` (`(out, r)`),
//!
//! four products of rank `r`, `2·N·r·(in + out)` multiply-adds in place of `G`'s `N·in·out`
//! (at SmolLM2's `576 × 576` and `r = 16`, 9× fewer). The input's gradient `g·W` is the full
//! model's, through the merged weight. With adapters set, the backward forms no other
//! parameter's gradient: norms, biases, embeddings and the LM head are frozen.

use candle_core::{Result, Tensor};

use crate::config::ModelConfig;
use crate::error::ModelError;
use crate::layers::Proj;
use crate::names::{layer_prefix, parameter_specs};

/// One adapted projection's adapters and the scale `s` of `W = W₀ + s·B·A`. `a` and `b` are
/// the trainer's own variables (clones share their ids): the backward files their gradients
/// under them.
#[derive(Debug, Clone)]
pub struct LowRank {
    /// `A`, `(r, in)`.
    pub a: Tensor,
    /// `B`, `(out, r)`.
    pub b: Tensor,
    /// `s = alpha / r`.
    pub scale: f64,
}

impl LowRank {
    /// `(∂L/∂A, ∂L/∂B)` for the projection's input `x (N, in)` and its output's gradient
    /// `g (N, out)`: products in `x`'s dtype, the results in the adapters' own.
    pub(crate) fn grads(&self, x: &Tensor, g: &Tensor) -> Result<(Tensor, Tensor)> {
        let dtype = x.dtype();
        let a = self.a.to_dtype(dtype)?;
        let b = self.b.to_dtype(dtype)?;
        let xa = x.matmul(&a.t()?)?; // (N, r)
        let gb = g.matmul(&b)?; // (N, r)
        let da = gb.t()?.matmul(x)?; // (r, in)
        let db = g.t()?.matmul(&xa)?; // (out, r)
        let da = (da.to_dtype(self.a.dtype())? * self.scale)?;
        let db = (db.to_dtype(self.b.dtype())? * self.scale)?;
        Ok((da, db))
    }
}

/// Each layer's adapted projections, indexed by [`Proj`].
#[derive(Debug, Clone)]
pub(crate) struct LowRankTable {
    pub(crate) layers: Vec<[Option<LowRank>; 7]>,
}

impl LowRankTable {
    /// The table of `adapters`, each named by its weight's HF name
    /// (`model.layers.0.self_attn.q_proj.weight`); refuses a name that is no projection's
    /// weight, one named twice, and adapters whose shapes do not fit the weight.
    pub(crate) fn new(
        config: &ModelConfig,
        adapters: Vec<(String, LowRank)>,
    ) -> crate::Result<Self> {
        let mut layers: Vec<[Option<LowRank>; 7]> =
            (0..config.num_layers).map(|_| Default::default()).collect();
        let specs = parameter_specs(config);
        for (name, lr) in adapters {
            let found = projection(config, &name)
                .zip(specs.iter().find(|s| s.name == name))
                .filter(|(_, s)| s.shape.len() == 2);
            let Some(((l, p), spec)) = found else {
                return Err(ModelError::input(format!(
                    "low-rank adapters for `{name}`: not a projection's weight of this model"
                )));
            };
            let (out, inp) = (spec.shape[0], spec.shape[1]);
            let (ad, bd) = (lr.a.dims(), lr.b.dims());
            let rank = ad.first().copied().unwrap_or(0);
            if ad != [rank, inp] || bd != [out, rank] || rank == 0 {
                return Err(ModelError::input(format!(
                    "low-rank adapters for `{name}` ({out} × {inp}): A is {ad:?} and B {bd:?}, \
                     wanted [r, {inp}] and [{out}, r] with r ≥ 1"
                )));
            }
            let slot = &mut layers[l][p as usize];
            if slot.is_some() {
                return Err(ModelError::input(format!(
                    "low-rank adapters for `{name}` given twice"
                )));
            }
            *slot = Some(lr);
        }
        Ok(Self { layers })
    }
}

/// The HF name of projection `p`'s weight in layer `l`.
fn projection_name(l: usize, p: Proj) -> String {
    format!("{}.{}.weight", layer_prefix(l), p.module())
}

/// The layer and projection whose weight is called `name`.
fn projection(config: &ModelConfig, name: &str) -> Option<(usize, Proj)> {
    let rest = name.strip_prefix("model.layers.")?;
    let (l, _) = rest.split_once('.')?;
    let l: usize = l.parse().ok().filter(|&l| l < config.num_layers)?;
    let p = Proj::ALL
        .into_iter()
        .find(|&p| projection_name(l, p) == name)?;
    Some((l, p))
}
