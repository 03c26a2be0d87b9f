//! The engine's step kernels for stacked products (`split_rope`, `swiglu_rows` and
//! `add_rms_norm`: on a GPU `kernels/fused.cu`, on the CPU `fused/stacked.rs`) against candle's
//! composition on the same device, at a decode step of the medium preset with 64 sequences in
//! flight, f32 (and bf16 on a GPU, where the split kernels take it): values agreeing and the
//! time of each, forward only (the engine takes no gradients).

use sluice_model::candle::{DType, Device, Result as CResult, Tensor};
use sluice_model::fused;

use super::training::{random, rel_err, report, rms_composed, rope_composed, timed};

/// Sequences in flight: one row each.
const ROWS: usize = 64;
const HIDDEN: usize = 896;
const MLP: usize = 4864;
const HEADS: usize = 14;
const KV_HEADS: usize = 2;
const HEAD_DIM: usize = 64;
/// Timed calls per path (after one untimed).
const REPS: usize = 20;

type Op<'a> = dyn Fn() -> CResult<Tensor> + 'a;

/// The checks and timings; false when any disagrees with the composition.
pub(super) fn compare(device: &Device, result: &mut Vec<String>) -> anyhow::Result<bool> {
    let mut ok = true;
    let d = HEAD_DIM;
    let width = (HEADS + 2 * KV_HEADS) * d;
    let dtypes: &[DType] = if device.is_cuda() {
        &[DType::F32, DType::BF16]
    } else {
        &[DType::F32]
    };
    for &dtype in dtypes {
        let tag = if dtype == DType::BF16 { "bf16" } else { "f32" };
        let x = |shape: &[usize], seed: u64| random(shape, seed, dtype, device);
        let (qkv, bias) = (x(&[ROWS, width], 21)?, x(&[width], 22)?);
        let (cos, sin) = (x(&[ROWS, d / 2], 23)?, x(&[ROWS, d / 2], 24)?);
        let gate_up = x(&[ROWS, 2 * MLP], 25)?;
        let (res, out, w) = (
            x(&[ROWS, HIDDEN], 26)?,
            x(&[ROWS, HIDDEN], 27)?,
            x(&[HIDDEN], 28)?,
        );
        let parts = |t: Vec<Tensor>| Tensor::cat(&t, 1);
        let cases: Vec<(&str, Box<Op<'_>>, Box<Op<'_>>)> = vec![
            (
                "split_rope",
                Box::new(|| {
                    let (q, k, v) =
                        fused::split_rope(&qkv, Some(&bias), &cos, &sin, HEADS, KV_HEADS, d)?;
                    parts(vec![q, k, v])
                }),
                Box::new(|| {
                    let all = qkv.broadcast_add(&bias)?;
                    let part = |at: usize, n: usize| all.narrow(1, at * d, n * d);
                    parts(vec![
                        rope_composed(&part(0, HEADS)?.contiguous()?, &cos, &sin, d)?,
                        rope_composed(&part(HEADS, KV_HEADS)?.contiguous()?, &cos, &sin, d)?,
                        part(HEADS + KV_HEADS, KV_HEADS)?.contiguous()?,
                    ])
                }),
            ),
            (
                "swiglu_rows",
                Box::new(|| fused::swiglu_rows(&gate_up)),
                Box::new(|| gate_up.narrow(1, 0, MLP)?.silu()? * gate_up.narrow(1, MLP, MLP)?),
            ),
            (
                "add_rms_norm",
                Box::new(|| {
                    let (sum, normed) = fused::add_rms_norm(&res, &out, &w, 1e-6)?;
                    parts(vec![sum, normed])
                }),
                Box::new(|| {
                    let sum = (&res + &out)?;
                    let normed = rms_composed(&sum, &w, 1e-6)?;
                    parts(vec![sum, normed])
                }),
            ),
        ];
        for (name, fused_op, composed_op) in &cases {
            let (fused_out, fused_ms) = timed(REPS, device, || Ok(fused_op()?))?;
            let (comp_out, comp_ms) = timed(REPS, device, || Ok(composed_op()?))?;
            let err = rel_err(&fused_out, &comp_out)?;
            let tol = if dtype == DType::BF16 { 1e-2 } else { 1e-5 };
            ok &= report(
                (
                    &format!("engine {name} ({tag}), {ROWS} rows"),
                    &format!("engine_{name}_{tag}"),
                ),
                (fused_ms, comp_ms),
                (err, tol),
                result,
            );
        }
    }
    Ok(ok)
}
