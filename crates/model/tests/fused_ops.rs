//! The fused training ops (`sluice_model::fused`) against the plain candle composition they
//! replace and against central finite differences in f64, on random shapes: values, and the
//! gradient of every input of `Σ out ⊙ R` for a random `R`.

mod common;
#[path = "cuda_emu/emulated.rs"]
mod emulated;
#[path = "cuda_emu/emulated_engine.rs"]
mod emulated_engine;
#[path = "cuda_emu/emulated_optim.rs"]
mod emulated_optim;

use std::sync::Arc;

use candle_core::{D, DType, Device, Tensor, Var};
use common::{ALL_ARCHS, rel_err, snapshot, tiny_config};
use sluice_model::fused::{self, AttentionHeads, Segments};
use sluice_model::ops::Kernels;
use sluice_model::{ForwardOptions, PackedBatch, TrainableModel};

/// A deterministic random tensor (seeded per call site by `seed`).
fn rand(shape: &[usize], seed: u64, dtype: DType) -> Tensor {
    let n: usize = shape.iter().product();
    let mut state = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let v: Vec<f64> = (0..n)
        .map(|_| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            (state >> 11) as f64 / (1u64 << 53) as f64 * 2.0 - 1.0
        })
        .collect();
    Tensor::from_vec(v, shape, &Device::Cpu)
        .unwrap()
        .to_dtype(dtype)
        .unwrap()
}

type Op<'a> = dyn Fn(&[Tensor]) -> candle_core::Result<Tensor> + 'a;

/// Checks `fused` against `composed` on `inputs` (values and gradients; tolerance `tol`, relative
/// to the largest magnitude) and, in f64, every input's gradient against central finite
/// differences at a few entries.
fn check(name: &str, inputs: &[Tensor], fused: &Op<'_>, composed: &Op<'_>, tol: f64) {
    let vars: Vec<Var> = inputs
        .iter()
        .map(|t| Var::from_tensor(t).unwrap())
        .collect();
    let ts: Vec<Tensor> = vars.iter().map(|v| v.as_tensor().clone()).collect();
    let out_f = fused(&ts).unwrap();
    let out_c = composed(&ts).unwrap();
    assert_eq!(out_f.shape(), out_c.shape(), "{name}: shapes");
    let err = rel_err(&out_f, &out_c);
    assert!(
        err < tol,
        "{name}: forward differs from the composition by {err:e}"
    );
    let r = rand(out_f.dims(), 99, out_f.dtype());
    let loss = |out: &Tensor| (out * &r).unwrap().sum_all().unwrap();
    let g_f = loss(&out_f).backward().unwrap();
    let g_c = loss(&out_c).backward().unwrap();
    for (i, t) in ts.iter().enumerate() {
        let a = g_f
            .get(t)
            .unwrap_or_else(|| panic!("{name}: no gradient for input {i}"));
        let b = g_c.get(t).unwrap();
        let err = rel_err(a, b);
        assert!(
            err < tol,
            "{name}: input {i} gradient differs from the composition by {err:e}"
        );
    }
    if inputs[0].dtype() != DType::F64 {
        return;
    }
    let eps = 1e-6;
    for (i, t) in inputs.iter().enumerate() {
        let analytic: Vec<f64> = g_f
            .get(&ts[i])
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1()
            .unwrap();
        let n = t.elem_count();
        for probe in 0..4 {
            let idx = (probe * 7919 + i * 31 + 3) % n;
            let at = |delta: f64| {
                let mut v: Vec<f64> = t.flatten_all().unwrap().to_vec1().unwrap();
                v[idx] += delta;
                let mut moved = inputs.to_vec();
                moved[i] = Tensor::from_vec(v, t.shape(), t.device()).unwrap();
                loss(&fused(&moved).unwrap()).to_scalar::<f64>().unwrap()
            };
            let numeric = (at(eps) - at(-eps)) / (2.0 * eps);
            let a = analytic[idx];
            let ok = (a - numeric).abs() <= 1e-6 + 1e-5 * a.abs().max(numeric.abs());
            assert!(
                ok,
                "{name}: input {i}[{idx}] analytic {a:e} vs numeric {numeric:e}"
            );
        }
    }
}

fn tolerance(dtype: DType) -> f64 {
    if dtype == DType::F64 { 1e-10 } else { 1e-5 }
}

#[test]
fn linear_matches_the_composition_and_finite_differences() {
    for dtype in [DType::F64, DType::F32] {
        for (n, i, o) in [(1, 3, 2), (7, 5, 9), (33, 16, 12)] {
            let x = rand(&[n, i], 1, dtype);
            let w = rand(&[o, i], 2, dtype);
            let b = rand(&[o], 3, dtype);
            let plain = |t: &[Tensor]| t[0].matmul(&t[1].t()?);
            check(
                "linear",
                &[x.clone(), w.clone()],
                &|t| fused::linear(&t[0], &t[1], None),
                &plain,
                tolerance(dtype),
            );
            check(
                "linear+bias",
                &[x, w, b],
                &|t| fused::linear(&t[0], &t[1], Some(&t[2])),
                &|t| plain(t)?.broadcast_add(&t[2]),
                tolerance(dtype),
            );
        }
    }
}

#[test]
fn rms_norm_matches_the_composition_and_finite_differences() {
    for dtype in [DType::F64, DType::F32] {
        // Last dims of 2, odd and vector-width sizes; a 3-d input; a flat one normalised per
        // head. (A width of 1 has a gradient that is all rounding: x / |x|.)
        for (shape, d) in [
            (vec![4, 2], 2),
            (vec![5, 7], 7),
            (vec![3, 4, 16], 16),
            (vec![6, 24], 8),
        ] {
            let x = rand(&shape, 4, dtype);
            let w = (rand(&[d], 5, dtype) + 1.0).unwrap();
            let eps = 1e-6;
            let composed = move |t: &[Tensor]| {
                let rows = t[0].elem_count() / d;
                let x = t[0].reshape((rows, d))?;
                let inv = (x.sqr()?.mean_keepdim(D::Minus1)? + eps)?.sqrt()?.recip()?;
                x.broadcast_mul(&inv)?
                    .broadcast_mul(&t[1])?
                    .reshape(t[0].shape())
            };
            check(
                "rms norm",
                &[x, w],
                &|t| fused::rms_norm(&t[0], &t[1], eps),
                &composed,
                tolerance(dtype),
            );
        }
    }
}

#[test]
fn swiglu_matches_the_composition_and_finite_differences() {
    for dtype in [DType::F64, DType::F32] {
        for shape in [vec![1, 1], vec![9, 13], vec![64, 600]] {
            let gate = (rand(&shape, 6, dtype) * 4.0).unwrap();
            let up = rand(&shape, 7, dtype);
            check(
                "swiglu",
                &[gate, up],
                &|t| fused::swiglu(&t[0], &t[1]),
                &|t| t[0].silu()? * &t[1],
                tolerance(dtype),
            );
        }
    }
}

#[test]
fn rope_matches_the_composition_and_finite_differences() {
    for dtype in [DType::F64, DType::F32] {
        for (n, heads, d) in [(1, 1, 2), (5, 3, 4), (17, 2, 16)] {
            let x = rand(&[n, heads * d], 8, dtype);
            let angles = (rand(&[n, d / 2], 9, dtype) * 3.0).unwrap();
            let (cos, sin) = (angles.cos().unwrap(), angles.sin().unwrap());
            let (c2, s2) = (cos.clone(), sin.clone());
            // The composition: narrow, broadcast over heads, cat.
            let composed = move |t: &[Tensor]| {
                let x = t[0].reshape((n, heads, d))?;
                let x1 = x.narrow(D::Minus1, 0, d / 2)?;
                let x2 = x.narrow(D::Minus1, d / 2, d / 2)?;
                let (c, s) = (c2.unsqueeze(1)?, s2.unsqueeze(1)?);
                let r1 = (x1.broadcast_mul(&c)? - x2.broadcast_mul(&s)?)?;
                let r2 = (x2.broadcast_mul(&c)? + x1.broadcast_mul(&s)?)?;
                Tensor::cat(&[r1, r2], D::Minus1)?.reshape((n, heads * d))
            };
            check(
                "rope",
                &[x],
                &|t| fused::rope(&t[0], &cos, &sin, d),
                &composed,
                tolerance(dtype),
            );
        }
    }
}

/// Segment ids: packed sequences with padding, one row whose segment comes back after another
/// (not a single run), which the mask allows and the kernel must too, and one of many short
/// segments of growing length (1, 2, 3, … slots), which the kernel's query blocks follow and
/// merge.
fn segment_rows(batch: usize, len: usize, seed: usize) -> Vec<u32> {
    (0..batch * len)
        .map(|k| {
            let (r, i) = (k / len, k % len);
            match (r + seed) % 4 {
                0 => (i * 3 / len) as u32 + 1,
                1 if i >= len - 2 => 0,
                1 => 1,
                2 => [1, 1, 2, 1, 2, 2, 3][i % 7],
                // Segment s covers slots s(s+1)/2 .. (s+1)(s+2)/2.
                _ => (((8 * i + 1) as f64).sqrt() as u32 - 1) / 2 + 1,
            }
        })
        .collect()
}

/// Shared-prefix rows: a prompt (segment 1) continued by several segments that each see it, then
/// a plain segment; prefix ids per slot (0 where a slot continues nothing).
fn prefix_rows(batch: usize, len: usize, seed: usize) -> (Vec<u32>, Vec<u32>) {
    let mut seg = vec![0u32; batch * len];
    let mut prefix = vec![0u32; batch * len];
    for r in 0..batch {
        // Prompt of p slots, then branches of 1, 2, 3, … slots, the row's tail a plain segment.
        let p = 1 + (r + seed) % 5;
        let mut at = 0;
        let mut id = 1;
        while at < len {
            let n = if id == 1 {
                p
            } else {
                (id as usize - 1).min(len - at)
            };
            for i in at..(at + n).min(len) {
                seg[r * len + i] = id;
                prefix[r * len + i] = if id > 1 && id < 6 { 1 } else { 0 };
            }
            at += n;
            id += 1;
        }
    }
    (seg, prefix)
}

/// GRPO rows as `trainer.share_prompts` packs them: a prompt (segment 1) of a few slots, then
/// replies of 30 to 80 slots that each see it (a later reply's queries skip the earlier ones).
fn group_rows(batch: usize, len: usize, seed: usize) -> (Vec<u32>, Vec<u32>) {
    let mut seg = vec![0u32; batch * len];
    let mut prefix = vec![0u32; batch * len];
    for r in 0..batch {
        let mut at = 0;
        for id in 1u32.. {
            if at >= len {
                break;
            }
            let n = if id == 1 {
                3 + (r + seed) % 7
            } else {
                [30, 70, 45, 80][(id as usize + r) % 4]
            };
            for i in at..(at + n).min(len) {
                seg[r * len + i] = id;
                prefix[r * len + i] = if id > 1 { 1 } else { 0 };
            }
            at += n;
        }
    }
    (seg, prefix)
}

/// The composition: dense additive mask from the segment and prefix ids (`PackedBatch`'s rule),
/// softmax over `(B, heads, L, L)`.
fn attention_composed(
    t: &[Tensor],
    (seg, prefix): (&[u32], &[u32]),
    (b, l): (usize, usize),
    heads: AttentionHeads,
) -> candle_core::Result<Tensor> {
    let AttentionHeads {
        heads: h,
        kv_heads: kv,
        head_dim: d,
    } = heads;
    let mut mask = vec![f64::NEG_INFINITY; b * l * l];
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
    let dtype = t[0].dtype();
    let mask = Tensor::from_vec(mask, (b, 1, l, l), &Device::Cpu)?.to_dtype(dtype)?;
    let split = |x: &Tensor, n: usize| x.reshape((b, l, n, d))?.transpose(1, 2)?.contiguous();
    let q = split(&t[0], h)?;
    // Repeat each kv head for its query heads.
    let rep = |x: Tensor| -> candle_core::Result<Tensor> {
        let x = x.unsqueeze(2)?.broadcast_as((b, kv, h / kv, l, d))?;
        x.contiguous()?.reshape((b, h, l, d))
    };
    let k = rep(split(&t[1], kv)?)?;
    let v = rep(split(&t[2], kv)?)?;
    let s = (q.matmul(&k.t()?)? / (d as f64).sqrt())?.broadcast_add(&mask)?;
    let m = s.max_keepdim(D::Minus1)?.detach();
    let e = s.broadcast_sub(&m)?.exp()?;
    let p = e.broadcast_div(&e.sum_keepdim(D::Minus1)?)?;
    p.matmul(&v)?.transpose(1, 2)?.reshape((b * l, h * d))
}

#[test]
fn packed_attention_matches_the_composition_and_finite_differences() {
    // GQA and plain heads; rows shorter and longer than one query block (64).
    let cases = [
        (1, 5, 1, 1, 2),
        (3, 9, 4, 2, 4),
        (2, 70, 6, 2, 8),
        (3, 130, 2, 2, 4),
        (4, 150, 4, 2, 4),
    ];
    for dtype in [DType::F64, DType::F32] {
        for (k, &(b, l, h, kv, d)) in cases.iter().enumerate() {
            // The finite differences of the largest case add little at a large cost.
            if dtype == DType::F64 && l > 100 {
                continue;
            }
            let heads = AttentionHeads {
                heads: h,
                kv_heads: kv,
                head_dim: d,
            };
            // Plain packed segments, then shared prefixes continued by several segments, short
            // and (as a GRPO group's replies to one prompt) longer than a query block.
            let plain = (segment_rows(b, l, k), vec![0; b * l]);
            let rows = [plain, prefix_rows(b, l, k), group_rows(b, l, k)];
            for (seg, prefix) in rows {
                let segments = Arc::new(Segments::with_prefixes(b, l, &seg, &prefix).unwrap());
                let n = b * l;
                let q = rand(&[n, h * d], 10, dtype);
                let kk = rand(&[n, kv * d], 11, dtype);
                let v = rand(&[n, kv * d], 12, dtype);
                check(
                    "attention",
                    &[q, kk, v],
                    &|t| fused::attention(&t[0], &t[1], &t[2], &segments, heads),
                    &|t| attention_composed(t, (&seg, &prefix), (b, l), heads),
                    tolerance(dtype),
                );
            }
        }
    }
}

#[test]
fn bad_shapes_are_refused_with_the_op_named() {
    let x = rand(&[4, 6], 1, DType::F32);
    let err = fused::linear(&x, &rand(&[3, 5], 2, DType::F32), None).unwrap_err();
    assert!(err.to_string().contains("linear"), "{err}");
    let err = fused::rms_norm(&x, &rand(&[5], 2, DType::F32), 1e-6).unwrap_err();
    assert!(err.to_string().contains("rms norm"), "{err}");
    let err = fused::rope(&x, &x, &x, 4).unwrap_err();
    assert!(err.to_string().contains("rope"), "{err}");
    let err = fused::swiglu(&x, &rand(&[6, 4], 2, DType::F32)).unwrap_err();
    assert!(err.to_string().contains("swiglu"), "{err}");
    assert!(Segments::new(2, 3, &[1, 1, 1]).is_err());
    // A prefix must start before the slot that continues it.
    let err = Segments::with_prefixes(1, 3, &[1, 2, 2], &[0, 3, 3]).unwrap_err();
    assert!(err.to_string().contains("continues segment 3"), "{err}");
}

fn batch() -> PackedBatch {
    let a = [3u32, 7, 1, 9, 12];
    let b = [4u32, 4, 20];
    let c = [8u32, 2, 5, 6, 11, 0];
    PackedBatch::from_rows(&[vec![&a[..], &b[..]], vec![&c[..]]], 9, 0).unwrap()
}

/// The whole training forward and backward with the fused ops equals the composition's, for
/// every architecture (Qwen2 biases, Qwen3 q/k norms, Llama-3 RoPE scaling), tied and untied.
#[test]
fn fused_training_forward_and_gradients_equal_the_composition() {
    let options = ForwardOptions {
        logits_chunk_rows: 4,
        temperature: 0.8,
        ..ForwardOptions::default()
    };
    for arch in ALL_ARCHS {
        for tied in [true, false] {
            let snap = snapshot(tiny_config(arch, tied), 3, DType::F32);
            let fused_model = TrainableModel::from_snapshot(&snap, DType::F32).unwrap();
            assert_eq!(fused_model.kernels(), Kernels::Custom);
            let mut plain = TrainableModel::from_snapshot(&snap, DType::F32).unwrap();
            plain.set_kernels(Kernels::Differentiable).unwrap();
            let batch = batch();
            let a = fused_model.token_scores(&batch, options).unwrap();
            let b = plain.token_scores(&batch, options).unwrap();
            assert!(rel_err(&a.logprobs, &b.logprobs) < 1e-5, "{arch:?}");
            assert!(rel_err(&a.entropy, &b.entropy) < 1e-5, "{arch:?}");
            let loss = |s: sluice_model::TokenScores| {
                (s.logprobs.sum_all().unwrap() + (s.entropy.sum_all().unwrap() * 0.3).unwrap())
                    .unwrap()
            };
            let ga = loss(a).backward().unwrap();
            let gb = loss(b).backward().unwrap();
            for ((name, va), (_, vb)) in fused_model.vars().iter().zip(plain.vars()) {
                let err = rel_err(
                    ga.get(va.as_tensor()).unwrap(),
                    gb.get(vb.as_tensor()).unwrap(),
                );
                assert!(err < 1e-4, "{arch:?} tied={tied} {name}: {err:e}");
            }
        }
    }
}

/// Dtypes the kernels do not handle (bf16) run the composition under `Kernels::Custom`: the same
/// numbers as asking for it, bit for bit. `Kernels::Fused` (no backward) is refused.
#[test]
fn unsupported_dtypes_fall_back_to_the_composition() {
    let snap = snapshot(tiny_config(ALL_ARCHS[0], true), 4, DType::F32);
    let custom = TrainableModel::from_snapshot(&snap, DType::BF16).unwrap();
    let mut plain = TrainableModel::from_snapshot(&snap, DType::BF16).unwrap();
    plain.set_kernels(Kernels::Differentiable).unwrap();
    let options = ForwardOptions::default();
    let a = custom.token_scores(&batch(), options).unwrap().logprobs;
    let b = plain.token_scores(&batch(), options).unwrap().logprobs;
    let diff = (a - b).unwrap().abs().unwrap().max_all().unwrap();
    assert_eq!(
        diff.to_dtype(DType::F32)
            .unwrap()
            .to_scalar::<f32>()
            .unwrap(),
        0.0
    );
    assert!(plain.set_kernels(Kernels::Fused).is_err());
}

/// Preset-sized shapes on two threads, where the kernels split rows and products over the pool
/// (the small tests above stay below those thresholds): many packed sequences per row, as the
/// trainer packs them, give the composition's numbers and gradients.
#[test]
fn parallel_kernels_on_packed_rows_equal_the_composition() {
    use sluice_model::presets::{Preset, preset_config, random_snapshot};
    let snap = random_snapshot(
        Arc::new(preset_config(Preset::Tiny)),
        5,
        DType::F32,
        &Device::Cpu,
    )
    .unwrap();
    let vocab = snap.config().vocab_size as u32;
    let seqs: Vec<Vec<u32>> = (0..40u32)
        .map(|s| {
            (0..(17 + s % 13))
                .map(|i| (i * 7 + s * 3) % vocab)
                .collect()
        })
        .collect();
    let mut rows: Vec<Vec<&[u32]>> = vec![Vec::new(); 4];
    let mut used = [0usize; 4];
    for (k, s) in seqs.iter().enumerate() {
        let r = k % 4;
        if used[r] + s.len() <= 256 {
            used[r] += s.len();
            rows[r].push(s);
        }
    }
    let batch = PackedBatch::from_rows(&rows, 256, 0).unwrap();
    let pool = sluice_model::ComputePool::new("fused-test", 2).unwrap();
    pool.install(|| {
        let fused_model = TrainableModel::from_snapshot(&snap, DType::F32).unwrap();
        let mut plain = TrainableModel::from_snapshot(&snap, DType::F32).unwrap();
        plain.set_kernels(Kernels::Differentiable).unwrap();
        let options = ForwardOptions {
            logits_chunk_rows: 300,
            temperature: 1.0,
            ..ForwardOptions::default()
        };
        let a = fused_model.token_scores(&batch, options).unwrap();
        let b = plain.token_scores(&batch, options).unwrap();
        assert!(rel_err(&a.logprobs, &b.logprobs) < 1e-5);
        assert!(rel_err(&a.entropy, &b.entropy) < 1e-5);
        let ga = (a.logprobs.sum_all().unwrap()).backward().unwrap();
        let gb = (b.logprobs.sum_all().unwrap()).backward().unwrap();
        for ((name, va), (_, vb)) in fused_model.vars().iter().zip(plain.vars()) {
            let err = rel_err(
                ga.get(va.as_tensor()).unwrap(),
                gb.get(vb.as_tensor()).unwrap(),
            );
            assert!(err < 1e-4, "{name}: {err:e}");
        }
    });
}
