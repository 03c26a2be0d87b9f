//! On a GPU, the training forward's fused ops (Sluice's CUDA kernels: RMSNorm, SwiGLU, RoPE,
//! attention over packed segments; the linear layer as one node) against candle's composition
//! of elementary ops on the same
//! device, forward and backward, in f32 and bf16, at the medium preset's shapes (Qwen2.5-0.5B:
//! 8 rows of 512, hidden 896, 14 heads of 64 over 2 kv heads, MLP 4864; the attention in bf16
//! also at 8 rows of 2048): values and gradients agreeing, and the time of a forward and
//! backward of each.

use std::sync::Arc;
use std::time::Instant;

use sluice_model::candle::{D, DType, Device, Result as CResult, Tensor, Var};
use sluice_model::fused::{self, AttentionHeads, Segments};

const ROWS: usize = 8;
const LEN: usize = 512;
/// The long rows of the attention's second case (bf16 only), where the composition keeps every
/// head's `L × L` scores.
const LONG: usize = 2048;
const HIDDEN: usize = 896;
const MLP: usize = 4864;
const HEADS: AttentionHeads = AttentionHeads {
    heads: 14,
    kv_heads: 2,
    head_dim: 64,
};
/// Timed forward + backward passes per path (after one untimed).
const REPS: usize = 5;

type Op<'a> = dyn Fn(&[Tensor]) -> CResult<Tensor> + 'a;
/// An op's name, inputs, fused form and composition.
type Case<'a> = (&'static str, Vec<Tensor>, Box<Op<'a>>, Box<Op<'a>>);

/// The checks and timings of every op and dtype; false when any disagrees with the composition.
pub(super) fn compare(device: &Device, result: &mut Vec<String>) -> anyhow::Result<bool> {
    let mut ok = true;
    let (seg, prefix) = grpo_rows(LEN);
    let segments = Arc::new(Segments::with_prefixes(ROWS, LEN, &seg, &prefix)?);
    let (long_seg, long_prefix) = grpo_rows(LONG);
    let long = Arc::new(Segments::with_prefixes(
        ROWS,
        LONG,
        &long_seg,
        &long_prefix,
    )?);
    let n = ROWS * LEN;
    let (h, kv, d) = (HEADS.heads, HEADS.kv_heads, HEADS.head_dim);
    for dtype in [DType::F32, DType::BF16] {
        let tag = if dtype == DType::BF16 { "bf16" } else { "f32" };
        let x = |shape: &[usize], seed: u64| random(shape, seed, dtype, device);
        let mut cases: Vec<Case<'_>> = vec![
            (
                // The MLP's gate projection: one node against a product over a transpose node.
                "linear",
                vec![x(&[n, HIDDEN], 14)?, x(&[MLP, HIDDEN], 15)?],
                Box::new(|t: &[Tensor]| fused::linear(&t[0], &t[1], None)),
                Box::new(|t: &[Tensor]| t[0].matmul(&t[1].t()?)),
            ),
            (
                "rms_norm",
                vec![x(&[n, HIDDEN], 1)?, (x(&[HIDDEN], 2)? + 1.0)?],
                Box::new(|t: &[Tensor]| fused::rms_norm(&t[0], &t[1], 1e-6)),
                Box::new(|t: &[Tensor]| rms_composed(&t[0], &t[1], 1e-6)),
            ),
            (
                "swiglu",
                vec![x(&[n, MLP], 3)?, x(&[n, MLP], 4)?],
                Box::new(|t: &[Tensor]| fused::swiglu(&t[0], &t[1])),
                Box::new(|t: &[Tensor]| t[0].silu()? * &t[1]),
            ),
            (
                "rope",
                vec![x(&[n, h * d], 5)?, x(&[n, d / 2], 6)?, x(&[n, d / 2], 7)?],
                Box::new(move |t: &[Tensor]| fused::rope(&t[0], &t[1].detach(), &t[2].detach(), d)),
                Box::new(move |t: &[Tensor]| {
                    rope_composed(&t[0], &t[1].detach(), &t[2].detach(), d)
                }),
            ),
            (
                "attention",
                vec![
                    x(&[n, h * d], 8)?,
                    x(&[n, kv * d], 9)?,
                    x(&[n, kv * d], 10)?,
                ],
                Box::new(|t: &[Tensor]| fused::attention(&t[0], &t[1], &t[2], &segments, HEADS)),
                Box::new(|t: &[Tensor]| attention_composed(t, (&seg, &prefix), LEN)),
            ),
        ];
        if dtype == DType::BF16 {
            let n = ROWS * LONG;
            cases.push((
                "attention_2048",
                vec![
                    x(&[n, h * d], 11)?,
                    x(&[n, kv * d], 12)?,
                    x(&[n, kv * d], 13)?,
                ],
                Box::new(|t: &[Tensor]| fused::attention(&t[0], &t[1], &t[2], &long, HEADS)),
                Box::new(|t: &[Tensor]| attention_composed(t, (&long_seg, &long_prefix), LONG)),
            ));
        }
        // Useful floating-point operations of a forward and backward: the linear layer's three
        // products; the attention's QKᵀ and PV over the visible pairs, and 2.5 times that for
        // the backward (dV, dP, dQ, dK and the recomputed scores), FlashAttention's count.
        let attention_flops = |(seg, prefix): (&[u32], &[u32]), len: usize| {
            14.0 * visible_pairs(seg, prefix, len) as f64 * (h * d) as f64
        };
        let flops = |name: &str| match name {
            "linear" => Some(6.0 * (n * HIDDEN * MLP) as f64),
            "attention" => Some(attention_flops((&seg, &prefix), LEN)),
            "attention_2048" => Some(attention_flops((&long_seg, &long_prefix), LONG)),
            _ => None,
        };
        // The forward's share of those: one of the linear layer's three products, and the
        // attention's 4 of 14.
        let forward_share = |name: &str| {
            if name == "linear" {
                1.0 / 3.0
            } else {
                4.0 / 14.0
            }
        };
        for (name, inputs, fused_op, composed_op) in &cases {
            // RoPE's tables are not differentiated: only its first input is compared.
            let grads = if *name == "rope" { 1 } else { inputs.len() };
            let (fused_out, fused_grads, fused_ms) = run(inputs, fused_op, device)?;
            if let Some(flops) = flops(name) {
                // A rate to hold against the GPU's peak: what share of it the kernels reach.
                let tflops = flops / (fused_ms * 1e-3) / 1e12;
                // The forward alone (inputs without a graph), so each pass has its own rate.
                let (_, fwd_ms) = timed(REPS, device, || Ok(fused_op(inputs)?))?;
                let fwd_flops = flops * forward_share(name);
                let fwd = fwd_flops / (fwd_ms * 1e-3) / 1e12;
                let bwd = (flops - fwd_flops) / ((fused_ms - fwd_ms).max(1e-6) * 1e-3) / 1e12;
                println!(
                    "{name} ({tag}), fused: {tflops:.1} TFLOP/s useful (forward + backward); forward {fwd_ms:.4} ms, {fwd:.1} TFLOP/s; backward {bwd:.1} TFLOP/s"
                );
                result.extend([
                    format!("fused_{name}_{tag}_tflops={tflops:.1}"),
                    format!("fused_{name}_{tag}_fwd_tflops={fwd:.1}"),
                    format!("fused_{name}_{tag}_bwd_tflops={bwd:.1}"),
                ]);
            }
            let (comp_out, comp_grads, comp_ms) = run(inputs, composed_op, device)?;
            let err = largest_difference(
                (&fused_out, &fused_grads[..grads]),
                (&comp_out, &comp_grads[..grads]),
            )?;
            let tol = if dtype == DType::BF16 { 3e-2 } else { 1e-4 };
            ok &= report(
                (
                    &format!("{name} ({tag}), forward + backward"),
                    &format!("fused_{name}_{tag}"),
                ),
                (fused_ms, comp_ms),
                (err, tol),
                result,
            );
        }
    }
    ok &= tile_skip(device, &long, result)?;
    Ok(ok)
}

/// The bf16 attention on the GRPO rows of 2,048 slots, skipping the tiles that hold no visible
/// pair against the same kernels walking every tile from each block's first visible slot
/// ([`Segments::walking_every_tile`]): the time the mask saves (`tile_skip_speedup`), and the
/// results, which skipped tiles (every score masked) cannot change (`tile_skip_err`).
fn tile_skip(
    device: &Device,
    segments: &Arc<Segments>,
    result: &mut Vec<String>,
) -> anyhow::Result<bool> {
    let (rows, len) = segments.shape();
    let every = Arc::new(
        Segments::with_prefixes(rows, len, segments.ids(), segments.prefixes())?
            .walking_every_tile(),
    );
    let n = rows * len;
    let (h, kv, d) = (HEADS.heads, HEADS.kv_heads, HEADS.head_dim);
    let inputs = vec![
        random(&[n, h * d], 11, DType::BF16, device)?,
        random(&[n, kv * d], 12, DType::BF16, device)?,
        random(&[n, kv * d], 13, DType::BF16, device)?,
    ];
    let with = |s: Arc<Segments>| -> Box<Op<'_>> {
        Box::new(move |t: &[Tensor]| fused::attention(&t[0], &t[1], &t[2], &s, HEADS))
    };
    let (skip_out, skip_grads, skip_ms) = run(&inputs, &with(Arc::clone(segments)), device)?;
    let (every_out, every_grads, every_ms) = run(&inputs, &with(every), device)?;
    let err = largest_difference((&skip_out, &skip_grads), (&every_out, &every_grads))?;
    // `report`'s "fused" is the kernels skipping tiles, its "composition" the same walking all.
    Ok(report(
        (
            "attention_2048 (bf16), tiles without a visible pair skipped vs every tile walked",
            "tile_skip",
        ),
        (skip_ms, every_ms),
        (err, 1e-6),
        result,
    ))
}

/// The largest relative difference between two runs' outputs and input gradients.
fn largest_difference(
    (out_a, grads_a): (&Tensor, &[Tensor]),
    (out_b, grads_b): (&Tensor, &[Tensor]),
) -> anyhow::Result<f64> {
    let mut err = rel_err(out_a, out_b)?;
    for (a, b) in grads_a.iter().zip(grads_b) {
        err = err.max(rel_err(a, b)?);
    }
    Ok(err)
}

/// Prints one comparison (`what`) and adds its `RESULT` keys `{key}_speedup` and `{key}_err`;
/// whether the fused op agrees with the composition within `tol`.
pub(super) fn report(
    (what, key): (&str, &str),
    (fused_ms, comp_ms): (f64, f64),
    (err, tol): (f64, f64),
    result: &mut Vec<String>,
) -> bool {
    let agrees = err <= tol;
    println!(
        "{what}: fused {fused_ms:.4} ms, composition {comp_ms:.4} ms ({:.2}x); largest difference {err:.2e} (at most {tol:e}){}",
        comp_ms / fused_ms,
        if agrees { "" } else { ": FAILED" }
    );
    result.extend([
        format!("{key}_speedup={:.3}", comp_ms / fused_ms),
        format!("{key}_err={err:.3e}"),
    ]);
    agrees
}

/// The last result of `reps` timed calls of `f` (after one untimed) and their median time, ms,
/// the device synchronised around each.
pub(super) fn timed<T>(
    reps: usize,
    device: &Device,
    mut f: impl FnMut() -> anyhow::Result<T>,
) -> anyhow::Result<(T, f64)> {
    let mut times = Vec::with_capacity(reps);
    let mut last = None;
    for rep in 0..=reps {
        device.synchronize()?;
        let start = Instant::now();
        let out = f()?;
        device.synchronize()?;
        if rep > 0 {
            times.push(start.elapsed().as_secs_f64() * 1e3);
        }
        last = Some(out);
    }
    times.sort_by(f64::total_cmp);
    Ok((last.expect("at least one call"), times[times.len() / 2]))
}

/// Output, input gradients of `Σ out ⊙ R` and the median time of a forward and backward.
fn run(
    inputs: &[Tensor],
    op: &Op<'_>,
    device: &Device,
) -> anyhow::Result<(Tensor, Vec<Tensor>, f64)> {
    let vars: Vec<Var> = inputs
        .iter()
        .map(Var::from_tensor)
        .collect::<Result<_, _>>()?;
    let ts: Vec<Tensor> = vars.iter().map(|v| v.as_tensor().clone()).collect();
    // The output's weights are made once, outside the timed calls. Made inside them (until
    // 2026-11-30), their generation on the host and upload (14.7M values for the attention at
    // 8 rows of 2048) were timed with the kernels, the same cost in both paths: every ratio was
    // pulled toward 1 and every rate down.
    let r = {
        let out = op(&ts)?;
        random(out.dims(), 99, out.dtype(), device)?
    };
    let ((out, grads), ms) = timed(REPS, device, || {
        let out = op(&ts)?;
        let grads = (&out * &r)?.sum_all()?.backward()?;
        Ok((out, grads))
    })?;
    let g = ts
        .iter()
        .map(|t| {
            grads
                .get(t)
                .cloned()
                .unwrap_or_else(|| t.zeros_like().expect("zeros"))
        })
        .collect();
    Ok((out, g, ms))
}

/// A deterministic tensor with entries in [-1, 1).
pub(super) fn random(
    shape: &[usize],
    seed: u64,
    dtype: DType,
    device: &Device,
) -> anyhow::Result<Tensor> {
    let n: usize = shape.iter().product();
    let v: Vec<f32> = (0..n as u64)
        .map(|i| {
            let h = sluice_core::rng::splitmix(seed.wrapping_mul(0x9E37_79B9) ^ i);
            (h >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0
        })
        .collect();
    Ok(Tensor::from_vec(v, shape, device)?.to_dtype(dtype)?)
}

pub(super) fn rel_err(a: &Tensor, b: &Tensor) -> anyhow::Result<f64> {
    let a = a.to_dtype(DType::F32)?.flatten_all()?;
    let b = b.to_dtype(DType::F32)?.flatten_all()?;
    let diff = (a - &b)?.abs()?.max(0)?.to_scalar::<f32>()?;
    let scale = b.abs()?.max(0)?.to_scalar::<f32>()?;
    Ok(f64::from(diff / scale.max(f32::MIN_POSITIVE)))
}

/// Query-key pairs that see each other in rows of `len` slots with segments `seg` and shared
/// prompts `prefix` (the attention's rule: earlier or same slots of the own segment, and the
/// whole prompt segment a completion names). Segments are runs of slots, as packing lays them.
fn visible_pairs(seg: &[u32], prefix: &[u32], len: usize) -> u64 {
    let mut pairs = 0u64;
    for (seg, prefix) in seg.chunks(len).zip(prefix.chunks(len)) {
        let mut sizes = std::collections::HashMap::new();
        for &s in seg {
            *sizes.entry(s).or_insert(0u64) += 1;
        }
        let mut start = 0;
        for i in 0..seg.len() {
            if i > 0 && seg[i] != seg[i - 1] {
                start = i;
            }
            pairs += (i - start + 1) as u64;
            if prefix[i] != 0 {
                pairs += sizes[&prefix[i]];
            }
        }
    }
    pairs
}

/// Packed GRPO rows of `len` slots: a 64-slot prompt shared by four completions.
fn grpo_rows(len: usize) -> (Vec<u32>, Vec<u32>) {
    let completion = (len - 64) / 4;
    let mut seg = Vec::with_capacity(ROWS * len);
    let mut prefix = Vec::with_capacity(ROWS * len);
    for _ in 0..ROWS {
        for i in 0..len {
            if i < 64 {
                seg.push(1);
                prefix.push(0);
            } else {
                seg.push(2 + ((i - 64) / completion) as u32);
                prefix.push(1);
            }
        }
    }
    (seg, prefix)
}

pub(super) fn rms_composed(x: &Tensor, w: &Tensor, eps: f64) -> CResult<Tensor> {
    let xf = x.to_dtype(DType::F32)?;
    let inv = (xf.sqr()?.mean_keepdim(D::Minus1)? + eps)?
        .sqrt()?
        .recip()?;
    xf.broadcast_mul(&inv)?
        .to_dtype(x.dtype())?
        .broadcast_mul(w)
}

/// "Rotate half" over `(N, heads·d)` rows, tables `(N, d/2)`.
pub(super) fn rope_composed(x: &Tensor, cos: &Tensor, sin: &Tensor, d: usize) -> CResult<Tensor> {
    let (n, width) = x.dims2()?;
    let x = x.reshape((n, width / d, d))?;
    let half = d / 2;
    let (x1, x2) = (x.narrow(2, 0, half)?, x.narrow(2, half, half)?);
    let (c, s) = (cos.reshape((n, 1, half))?, sin.reshape((n, 1, half))?);
    let r1 = (x1.broadcast_mul(&c)? - x2.broadcast_mul(&s)?)?;
    let r2 = (x2.broadcast_mul(&c)? + x1.broadcast_mul(&s)?)?;
    Tensor::cat(&[r1, r2], 2)?.reshape((n, width))
}

/// The trainer's composition: products in the inputs' dtype, the mask and softmax in f32.
fn attention_composed(
    t: &[Tensor],
    (seg, prefix): (&[u32], &[u32]),
    len: usize,
) -> CResult<Tensor> {
    let (b, l) = (ROWS, len);
    let AttentionHeads {
        heads: h,
        kv_heads: kv,
        head_dim: d,
    } = HEADS;
    let mut mask = vec![f32::NEG_INFINITY; b * l * l];
    for r in 0..b {
        for i in 0..l {
            for j in 0..=i {
                let (si, sj, pi) = (seg[r * l + i], seg[r * l + j], prefix[r * l + i]);
                if si == sj || (pi != 0 && sj == pi) {
                    mask[(r * l + i) * l + j] = 0.0;
                }
            }
        }
    }
    let device = t[0].device();
    let mask = Tensor::from_vec(mask, (b, 1, l, l), device)?;
    let split = |x: &Tensor, n: usize| x.reshape((b, l, n, d))?.transpose(1, 2)?.contiguous();
    let repeat = |x: Tensor| -> CResult<Tensor> {
        x.unsqueeze(2)?
            .broadcast_as((b, kv, h / kv, l, d))?
            .contiguous()?
            .reshape((b, h, l, d))
    };
    let q = split(&t[0], h)?;
    let k = repeat(split(&t[1], kv)?)?;
    let v = repeat(split(&t[2], kv)?)?;
    let s = (q.matmul(&k.t()?)? / (d as f64).sqrt())?
        .to_dtype(DType::F32)?
        .broadcast_add(&mask)?;
    let m = s.max_keepdim(D::Minus1)?.detach();
    let e = s.broadcast_sub(&m)?.exp()?;
    let p = e
        .broadcast_div(&e.sum_keepdim(D::Minus1)?)?
        .to_dtype(t[0].dtype())?;
    p.matmul(&v)?.transpose(1, 2)?.reshape((b * l, h * d))
}

#[cfg(test)]
mod tests {
    use super::{LEN, ROWS, grpo_rows, visible_pairs};

    #[test]
    fn visible_pairs_count_the_prompt_once_per_completion_slot() {
        // A 64-slot prompt (causal: 64·65/2 pairs), then four completions of 112 slots, each
        // slot seeing the whole prompt and its own completion up to itself.
        let (seg, prefix) = grpo_rows(LEN);
        let c = (LEN as u64 - 64) / 4;
        let row = 64 * 65 / 2 + 4 * (64 * c + c * (c + 1) / 2);
        assert_eq!(visible_pairs(&seg, &prefix, LEN), ROWS as u64 * row);
    }
}
