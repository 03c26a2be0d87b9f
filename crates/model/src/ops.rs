//! The ops where training and inference part ways: RMSNorm, rotary embeddings and softmax (and,
//! for the training forward, linear layers, SwiGLU and attention: [`crate::fused`]).
//!
//! [`Kernels::Differentiable`] builds each from elementary candle ops that have backward rules;
//! candle-nn's fused `rms_norm`, `rope` and `softmax_last_dim` have none and would silently cut
//! gradients, so they are only used with [`Kernels::Fused`] (inference). [`Kernels::Custom`]
//! (training) uses Sluice's own fused ops with hand-written backward where they apply (f32/f64
//! on the CPU) and the composition elsewhere. Also here: the RoPE frequency table, including
//! Llama-3 scaling.

use std::sync::Mutex;

use candle_core::{D, DType, Device, Result, Tensor};

use crate::config::{Llama3RopeScaling, ModelConfig};

/// Which implementation of the shared ops a forward pass uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kernels {
    /// Elementary ops only: gradients flow (training, and reference computations in tests).
    Differentiable,
    /// candle-nn's fused kernels: faster, no gradients (inference).
    Fused,
    /// Sluice's fused ops with hand-written backward ([`crate::fused`]) for f32/f64 tensors on
    /// the CPU and f32/bf16 ones on a GPU, [`Kernels::Differentiable`] for anything else (bf16
    /// on the CPU): the training default.
    Custom,
}

impl Kernels {
    /// Whether the fused training kernels serve tensors like `t` under this choice.
    pub fn custom_for(self, t: &Tensor) -> bool {
        self == Kernels::Custom && (crate::fused::supported(t) || crate::fused::on_device(t))
    }
}

/// The dtype norms and rotary tables are computed in: f64 stays f64, the rest goes to f32.
pub(crate) fn compute_dtype(dtype: DType) -> DType {
    if dtype == DType::F64 {
        DType::F64
    } else {
        DType::F32
    }
}

/// RMSNorm over the last dim: `w * (x / sqrt(mean(x²) + eps))`, statistics in f32 (or f64).
pub(crate) fn rms_norm(x: &Tensor, weight: &Tensor, eps: f64, kernels: Kernels) -> Result<Tensor> {
    match kernels {
        // Sluice's kernel on the CPU: candle-nn's splits every call over the thread pool, and
        // waking it costs more than a decode step's few rows take.
        Kernels::Fused if crate::fused::supported(x) => crate::fused::rms_norm(x, weight, eps),
        Kernels::Custom if kernels.custom_for(x) => crate::fused::rms_norm(x, weight, eps),
        Kernels::Fused => candle_nn::ops::rms_norm(&x.contiguous()?, weight, eps as f32),
        Kernels::Differentiable | Kernels::Custom => {
            let dtype = x.dtype();
            let xf = x.to_dtype(compute_dtype(dtype))?;
            let inv_rms = (xf.sqr()?.mean_keepdim(D::Minus1)? + eps)?
                .sqrt()?
                .recip()?;
            xf.broadcast_mul(&inv_rms)?
                .to_dtype(dtype)?
                .broadcast_mul(weight)
        }
    }
}

/// Softmax over the last dim. The max is subtracted for stability and detached: softmax does
/// not depend on it, so its gradient is exactly zero and need not be traced.
pub(crate) fn softmax_last_dim(x: &Tensor, kernels: Kernels) -> Result<Tensor> {
    match kernels {
        Kernels::Fused => candle_nn::ops::softmax_last_dim(&x.contiguous()?),
        Kernels::Differentiable | Kernels::Custom => {
            let max = x.max_keepdim(D::Minus1)?.detach();
            let e = x.broadcast_sub(&max)?.exp()?;
            e.broadcast_div(&e.sum_keepdim(D::Minus1)?)
        }
    }
}

/// Rotates `x` of shape `(B, heads, T, head_dim)` by the angles in `cos`/`sin` of shape
/// `(B, T, head_dim/2)`, the "rotate half" convention of HF Llama/Qwen.
pub(crate) fn apply_rope(
    x: &Tensor,
    cos: &Tensor,
    sin: &Tensor,
    kernels: Kernels,
) -> Result<Tensor> {
    match kernels {
        Kernels::Fused => candle_nn::rotary_emb::rope(&x.contiguous()?, cos, sin),
        // The fused training RoPE works on `(N, heads·d)` rows instead ([`crate::fused::rope`]).
        Kernels::Differentiable | Kernels::Custom => {
            let half = x.dim(D::Minus1)? / 2;
            let x1 = x.narrow(D::Minus1, 0, half)?;
            let x2 = x.narrow(D::Minus1, half, half)?;
            // (B, T, d/2) → (B, 1, T, d/2), broadcast over heads.
            let cos = cos.unsqueeze(1)?;
            let sin = sin.unsqueeze(1)?;
            let r1 = (x1.broadcast_mul(&cos)? - x2.broadcast_mul(&sin)?)?;
            let r2 = (x2.broadcast_mul(&cos)? + x1.broadcast_mul(&sin)?)?;
            Tensor::cat(&[r1, r2], D::Minus1)
        }
    }
}

/// The rotary embedding: its inverse frequencies `(head_dim/2,)`, and the `cos`/`sin` tables
/// of every position seen so far on each device in each dtype.
#[derive(Debug)]
pub(crate) struct Rope {
    inv_freq: Vec<f64>,
    tables: Mutex<Vec<RopeTables>>,
}

/// `cos` and `sin` of positions `0..len`, `(len, head_dim/2)`, on one device in one dtype.
#[derive(Debug)]
struct RopeTables {
    device: Device,
    dtype: DType,
    len: usize,
    cos: Tensor,
    sin: Tensor,
    /// Tables outgrown: kept until the model drops, since another thread's stream may still
    /// be reading them (a GPU frees a buffer on the stream of the thread that drops it).
    retired: Vec<(Tensor, Tensor)>,
}

/// Positions the first table of a device covers.
const ROPE_FIRST_TABLE: usize = 256;
/// Positions past this are computed for each call instead (no table of their size is kept).
const ROPE_MAX_TABLE: usize = 1 << 20;

impl Clone for Rope {
    /// The frequencies; the copy builds its own tables.
    fn clone(&self) -> Self {
        Self {
            inv_freq: self.inv_freq.clone(),
            tables: Mutex::default(),
        }
    }
}

impl Rope {
    pub(crate) fn new(config: &ModelConfig) -> Self {
        let d = config.head_dim;
        let mut inv_freq: Vec<f64> = (0..d / 2)
            .map(|i| 1.0 / config.rope_theta.powf((2 * i) as f64 / d as f64))
            .collect();
        if let Some(s) = config.rope_scaling {
            llama3_scale(&mut inv_freq, &s);
        }
        Self {
            inv_freq,
            tables: Mutex::default(),
        }
    }

    /// `(cos, sin)` for `positions`, each shaped `(rows, cols, head_dim/2)` in `dtype`, where
    /// `positions.len() == rows * cols`: rows of the device's tables, gathered (one upload and
    /// two launches; computing them took about nine on a GPU). A position past the tables grows
    /// them to the next power of two; positions past [`ROPE_MAX_TABLE`] are computed
    /// instead. The values are the ones [`Self::compute`] gives for the positions alone: each
    /// element is the same function of its position.
    pub(crate) fn cos_sin(
        &self,
        positions: &[u32],
        (rows, cols): (usize, usize),
        dtype: DType,
        device: &Device,
    ) -> Result<(Tensor, Tensor)> {
        let needed = positions.iter().max().map_or(0, |&p| p as usize + 1);
        let shape = (rows, cols, self.inv_freq.len());
        if needed > ROPE_MAX_TABLE {
            let (cos, sin) = self.compute(positions, dtype, device)?;
            return Ok((cos.reshape(shape)?, sin.reshape(shape)?));
        }
        let (cos, sin) = self.tables(needed, dtype, device)?;
        let idx = Tensor::new(positions, device)?;
        Ok((
            cos.index_select(&idx, 0)?.reshape(shape)?,
            sin.index_select(&idx, 0)?.reshape(shape)?,
        ))
    }

    /// The device's tables for `dtype` covering positions `0..positions`, `(len, head_dim/2)`
    /// each with `len ≥ positions`, and `len`; `None` past [`ROPE_MAX_TABLE`]. A table is
    /// replaced only when outgrown, so one asked for the model's whole context stays the same
    /// tensor (a captured CUDA graph reads it).
    pub(crate) fn whole_tables(
        &self,
        positions: usize,
        dtype: DType,
        device: &Device,
    ) -> Result<Option<(Tensor, Tensor, usize)>> {
        if positions > ROPE_MAX_TABLE {
            return Ok(None);
        }
        let (cos, sin) = self.tables(positions, dtype, device)?;
        let len = cos.dim(0)?;
        Ok(Some((cos, sin, len)))
    }

    /// The device's tables for `dtype`, covering at least positions `0..needed`.
    fn tables(&self, needed: usize, dtype: DType, device: &Device) -> Result<(Tensor, Tensor)> {
        let mut all = self.tables.lock().unwrap_or_else(|e| e.into_inner());
        let found = all
            .iter()
            .position(|t| t.dtype == dtype && t.device.same_device(device));
        if let Some(t) = found.map(|i| &all[i])
            && t.len >= needed
        {
            return Ok((t.cos.clone(), t.sin.clone()));
        }
        // Lengths are powers of two, so a table outgrown at least doubles.
        let len = needed.max(ROPE_FIRST_TABLE).next_power_of_two();
        let positions: Vec<u32> = (0..len as u32).collect();
        let (cos, sin) = self.compute(&positions, dtype, device)?;
        let (cos, sin) = (cos.squeeze(0)?, sin.squeeze(0)?);
        // Built on this thread's stream, read on others': finished before anyone reads it.
        device.synchronize()?;
        let out = (cos.clone(), sin.clone());
        match found {
            Some(i) => {
                let t = &mut all[i];
                let old = (
                    std::mem::replace(&mut t.cos, cos),
                    std::mem::replace(&mut t.sin, sin),
                );
                t.retired.push(old);
                t.len = len;
            }
            None => all.push(RopeTables {
                device: device.clone(),
                dtype,
                len,
                cos,
                sin,
                retired: Vec::new(),
            }),
        }
        Ok(out)
    }

    /// `(cos, sin)` of `positions`, `(1, positions, head_dim/2)` in `dtype`: the angles in the
    /// compute dtype (f32 for 16-bit dtypes), rounded to `dtype` after the cosine and sine.
    fn compute(
        &self,
        positions: &[u32],
        dtype: DType,
        device: &Device,
    ) -> Result<(Tensor, Tensor)> {
        let cdt = compute_dtype(dtype);
        let (n, half) = (positions.len(), self.inv_freq.len());
        let pos = Tensor::from_iter(positions.iter().map(|&p| f64::from(p)), device)?
            .to_dtype(cdt)?
            .reshape((n, 1))?;
        let inv = Tensor::from_slice(&self.inv_freq, (1, half), device)?.to_dtype(cdt)?;
        let angles = pos.broadcast_mul(&inv)?.reshape((1, n, half))?;
        Ok((
            angles.cos()?.to_dtype(dtype)?,
            angles.sin()?.to_dtype(dtype)?,
        ))
    }
}

/// Llama-3 frequency scaling: long wavelengths divided by `factor`, short ones kept, a smooth
/// blend between (as transformers' `_compute_llama3_parameters`).
fn llama3_scale(inv_freq: &mut [f64], s: &Llama3RopeScaling) {
    let old = s.original_max_position_embeddings as f64;
    let low_wavelen = old / s.low_freq_factor;
    let high_wavelen = old / s.high_freq_factor;
    for f in inv_freq.iter_mut() {
        let wavelen = 2.0 * std::f64::consts::PI / *f;
        if wavelen > low_wavelen {
            *f /= s.factor;
        } else if wavelen >= high_wavelen {
            let smooth =
                (old / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor);
            *f = (1.0 - smooth) * *f / s.factor + smooth * *f;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn llama3_scaling_divides_long_wavelengths_and_keeps_short_ones() {
        let s = Llama3RopeScaling {
            factor: 8.0,
            low_freq_factor: 1.0,
            high_freq_factor: 4.0,
            original_max_position_embeddings: 8192,
        };
        // wavelen 2π/1 ≈ 6.3 < 2048: kept; 2π/1e-4 ≈ 62832 > 8192: divided by 8.
        let mut f = [1.0, 1e-4, 2.0 * std::f64::consts::PI / 4096.0];
        llama3_scale(&mut f, &s);
        assert_eq!(f[0], 1.0);
        assert!((f[1] - 1e-4 / 8.0).abs() < 1e-15);
        // wavelen 4096 sits between: smooth = (2 - 1) / 3.
        let base = 2.0 * std::f64::consts::PI / 4096.0;
        let expected = (2.0 / 3.0) * base / 8.0 + (1.0 / 3.0) * base;
        assert!((f[2] - expected).abs() < 1e-15);
    }

    #[test]
    fn rope_tables_give_the_computed_values_and_grow_to_powers_of_two() -> Result<()> {
        let config = crate::presets::preset_config(crate::presets::Preset::Tiny);
        let rope = Rope::new(&config);
        let dev = Device::Cpu;
        let bits = |t: &Tensor| -> Result<Vec<u32>> {
            let t = t.flatten_all()?.to_dtype(DType::F32)?.to_vec1::<f32>()?;
            Ok(t.iter().map(|x| x.to_bits()).collect())
        };
        // Positions inside the first table, then one past it, in f32 and in bf16: each gather is
        // bit for bit what computing the positions alone gives.
        let lens = |r: &Rope| -> Vec<usize> {
            let all = r.tables.lock().unwrap();
            all.iter().map(|t| t.len).collect()
        };
        for (positions, dtype, want_lens) in [
            (vec![0u32, 5, 3, 255, 17, 1], DType::F32, vec![256]),
            (vec![700, 2, 256, 1023], DType::F32, vec![1024]),
            (vec![9, 0, 300, 4], DType::BF16, vec![1024, 512]),
        ] {
            let (cos, sin) = rope.cos_sin(&positions, (2, positions.len() / 2), dtype, &dev)?;
            let (c, s) = rope.compute(&positions, dtype, &dev)?;
            let half = config.head_dim / 2;
            assert_eq!(cos.dims3()?, (2, positions.len() / 2, half));
            assert_eq!(bits(&cos)?, bits(&c)?, "cos at {positions:?} in {dtype:?}");
            assert_eq!(bits(&sin)?, bits(&s)?, "sin at {positions:?} in {dtype:?}");
            assert_eq!(lens(&rope), want_lens);
        }
        // A position past the largest table is computed, no table grows for it.
        let far = [3, ROPE_MAX_TABLE as u32];
        let (cos, _) = rope.cos_sin(&far, (1, 2), DType::F32, &dev)?;
        assert_eq!(bits(&cos)?, bits(&rope.compute(&far, DType::F32, &dev)?.0)?);
        assert_eq!(lens(&rope), [1024, 512]);
        // The outgrown f32 table is kept (another thread may still read it).
        assert_eq!(rope.tables.lock().unwrap()[0].retired.len(), 1);
        assert!(
            lens(&rope.clone()).is_empty(),
            "a copy builds its own tables"
        );
        Ok(())
    }

    #[test]
    fn fused_and_differentiable_kernels_agree() -> Result<()> {
        let dev = Device::Cpu;
        let x = Tensor::randn(0f32, 1.0, (2, 3, 5, 8), &dev)?;
        let w = Tensor::randn(0f32, 1.0, 8, &dev)?;
        let max_diff = |a: Tensor, b: Tensor| -> Result<f32> {
            (a - b)?.abs()?.flatten_all()?.max(0)?.to_scalar::<f32>()
        };
        let a = rms_norm(&x, &w, 1e-6, Kernels::Fused)?;
        let b = rms_norm(&x, &w, 1e-6, Kernels::Differentiable)?;
        assert!(max_diff(a, b)? < 1e-5);
        let a = softmax_last_dim(&x, Kernels::Fused)?;
        let b = softmax_last_dim(&x, Kernels::Differentiable)?;
        assert!(max_diff(a, b)? < 1e-6);
        let cos = Tensor::randn(0f32, 1.0, (2, 5, 4), &dev)?;
        let sin = Tensor::randn(0f32, 1.0, (2, 5, 4), &dev)?;
        let a = apply_rope(&x, &cos, &sin, Kernels::Fused)?;
        let b = apply_rope(&x, &cos, &sin, Kernels::Differentiable)?;
        assert!(max_diff(a, b)? < 1e-5);
        Ok(())
    }
}
