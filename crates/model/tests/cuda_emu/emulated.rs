//! Sluice's CUDA training kernels (`crates/model/kernels`) compiled as C++ over an emulation of
//! the CUDA execution model (`emu.h`: a thread per CUDA thread, barriers for `__syncthreads` and
//! warp shuffles) and run on the CPU, launched as on a GPU, against the fused CPU ops in f64:
//! values and gradients, in f32 and in bf16. The GPU check (`scripts/gpu-check`) runs the same
//! kernels on the device; this finds indexing, masking and arithmetic errors without one.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;
use std::sync::atomic::{AtomicUsize, Ordering};

use candle_core::{DType, Tensor, Var};
use sluice_model::fused::{self, AttentionHeads, Segments};

use super::{prefix_rows, rand, segment_rows};

/// The harness, compiled once per test process with `$CXX` (default `c++`, C++20).
fn harness() -> &'static Path {
    static BIN: OnceLock<PathBuf> = OnceLock::new();
    BIN.get_or_init(|| {
        let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/cuda_emu/harness.cpp");
        let bin = Path::new(env!("CARGO_TARGET_TMPDIR")).join("cuda-emu-harness");
        let cxx = std::env::var("CXX").unwrap_or_else(|_| "c++".into());
        let out = Command::new(&cxx)
            .args([
                "-O1",
                "-std=c++20",
                "-pthread",
                "-ffp-contract=off",
                "-Wno-unknown-pragmas",
                "-o",
            ])
            .arg(&bin)
            .arg(&src)
            .output()
            .unwrap_or_else(|e| panic!("cannot run `{cxx}` (a C++20 compiler; set CXX): {e}"));
        assert!(
            out.status.success(),
            "{cxx} failed on {}:\n{}",
            src.display(),
            String::from_utf8_lossy(&out.stderr)
        );
        bin
    })
}

pub(super) enum In<'a> {
    Floats(&'a Tensor),
    Words(&'a [u32]),
}

/// Runs `op` in `dtype` (F32 or BF16) on `inputs`; the outputs as one f32 vector.
pub(super) fn emulate(op: &str, dtype: DType, inputs: &[In<'_>], args: &[String]) -> Vec<f32> {
    static CALL: AtomicUsize = AtomicUsize::new(0);
    let tmp = Path::new(env!("CARGO_TARGET_TMPDIR"));
    let id = format!(
        "{}-{}",
        std::process::id(),
        CALL.fetch_add(1, Ordering::Relaxed)
    );
    let (inp, outp) = (
        tmp.join(format!("emu-{id}.in")),
        tmp.join(format!("emu-{id}.out")),
    );
    let mut bytes = Vec::new();
    for i in inputs {
        match i {
            In::Floats(t) => {
                let v: Vec<f32> = t
                    .to_dtype(DType::F32)
                    .unwrap()
                    .flatten_all()
                    .unwrap()
                    .to_vec1()
                    .unwrap();
                v.iter()
                    .for_each(|x| bytes.extend_from_slice(&x.to_le_bytes()));
            }
            In::Words(w) => w
                .iter()
                .for_each(|x| bytes.extend_from_slice(&x.to_le_bytes())),
        }
    }
    std::fs::File::create(&inp)
        .unwrap()
        .write_all(&bytes)
        .unwrap();
    let dt = if dtype == DType::BF16 { "bf16" } else { "f32" };
    let out = Command::new(harness())
        .args([op, dt])
        .arg(&inp)
        .arg(&outp)
        .args(args)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{op}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let raw = std::fs::read(&outp).unwrap();
    let _ = (std::fs::remove_file(&inp), std::fs::remove_file(&outp));
    raw.chunks_exact(4)
        .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
        .collect()
}

/// Inputs as the kernels see them: rounded to `dtype`, then widened to f64 for the reference.
pub(super) fn inputs(shapes: &[&[usize]], seed: u64, dtype: DType) -> Vec<Tensor> {
    shapes
        .iter()
        .enumerate()
        .map(|(i, s)| {
            rand(s, seed + i as u64, DType::F32)
                .to_dtype(dtype)
                .unwrap()
                .to_dtype(DType::F64)
                .unwrap()
        })
        .collect()
}

/// Largest difference of `got` from `want`, relative to `want`'s largest magnitude; infinite
/// where a value is NaN (`f64::max` would pass over it).
fn err(got: &[f32], want: &Tensor) -> f64 {
    let want: Vec<f64> = want.flatten_all().unwrap().to_vec1().unwrap();
    assert_eq!(got.len(), want.len(), "lengths");
    let scale = want.iter().fold(0f64, |m, x| m.max(x.abs()));
    let diff = got.iter().zip(&want).fold(0f64, |m, (a, b)| {
        let d = (f64::from(*a) - b).abs();
        if d.is_nan() { f64::INFINITY } else { m.max(d) }
    });
    diff / scale
}

/// `(forward, gradients of Σ out ⊙ r)` of `op` on `xs` in f64 on the CPU.
fn reference(xs: &[Tensor], r: &Tensor, op: &dyn Fn(&[Tensor]) -> Tensor) -> (Tensor, Vec<Tensor>) {
    let vars: Vec<Var> = xs.iter().map(|t| Var::from_tensor(t).unwrap()).collect();
    let ts: Vec<Tensor> = vars.iter().map(|v| v.as_tensor().clone()).collect();
    let out = op(&ts);
    let grads = (&out * r).unwrap().sum_all().unwrap().backward().unwrap();
    let g = ts.iter().map(|t| grads.get(t).unwrap().clone()).collect();
    (out, g)
}

/// f32 kernels agree with f64 to rounding; bf16 ones to bf16's 8 bits (inputs rounded alike).
fn tol(dtype: DType) -> f64 {
    if dtype == DType::BF16 { 6e-3 } else { 2e-5 }
}

pub(super) fn check(what: &str, dtype: DType, got: &[f32], want: &Tensor) {
    let e = err(got, want);
    assert!(e < tol(dtype), "{what} ({dtype:?}): {e:e} from the CPU op");
}

#[test]
fn emulated_norm_swiglu_and_rope_kernels_match_the_cpu_ops() {
    for dtype in [DType::F32, DType::BF16] {
        // Rows narrower and wider than a block of 256 threads.
        for (rows, d) in [(3, 40), (70, 300)] {
            let xs = inputs(&[&[rows, d], &[d], &[rows, d]], 1, dtype);
            let (y, g) = reference(&xs[..2], &xs[2], &|t| {
                fused::rms_norm(&t[0], &t[1], 1e-6).unwrap()
            });
            let args = [rows.to_string(), d.to_string(), "1e-6".into()];
            let f = emulate(
                "rms_fwd",
                dtype,
                &[In::Floats(&xs[0]), In::Floats(&xs[1])],
                &args,
            );
            check("rms norm", dtype, &f, &y);
            let b = emulate(
                "rms_bwd",
                dtype,
                &[In::Floats(&xs[0]), In::Floats(&xs[1]), In::Floats(&xs[2])],
                &args,
            );
            check("rms norm dx", dtype, &b[..rows * d], &g[0]);
            check("rms norm dw", dtype, &b[rows * d..], &g[1]);
        }
        // 1,000 values move 16 bytes a load, 1,001 one at a time.
        for n in [1000, 1001] {
            let xs = inputs(&[&[n], &[n], &[n]], 7, dtype);
            let (y, g) = reference(&xs[..2], &xs[2], &|t| fused::swiglu(&t[0], &t[1]).unwrap());
            let f = emulate(
                "swiglu_fwd",
                dtype,
                &[In::Floats(&xs[0]), In::Floats(&xs[1])],
                &[n.to_string()],
            );
            check("swiglu", dtype, &f, &y);
            let b = emulate(
                "swiglu_bwd",
                dtype,
                &[In::Floats(&xs[0]), In::Floats(&xs[1]), In::Floats(&xs[2])],
                &[n.to_string()],
            );
            check("swiglu d gate", dtype, &b[..n], &g[0]);
            check("swiglu d up", dtype, &b[n..], &g[1]);
        }
        let (rows, heads, d) = (5, 3, 8);
        let xs = inputs(
            &[
                &[rows, heads * d],
                &[rows, d / 2],
                &[rows, d / 2],
                &[rows, heads * d],
            ],
            11,
            dtype,
        );
        let (y, g) = reference(&xs[..1], &xs[3], &|t| {
            fused::rope(&t[0], &xs[1], &xs[2], d).unwrap()
        });
        let args = |sign: &str| {
            [
                rows.to_string(),
                (heads * d).to_string(),
                d.to_string(),
                sign.to_string(),
            ]
        };
        let f = emulate(
            "rope",
            dtype,
            &[In::Floats(&xs[0]), In::Floats(&xs[1]), In::Floats(&xs[2])],
            &args("1"),
        );
        check("rope", dtype, &f, &y);
        // The backward is the rotation by minus the angles, applied to the output's gradient.
        let b = emulate(
            "rope",
            dtype,
            &[In::Floats(&xs[3]), In::Floats(&xs[1]), In::Floats(&xs[2])],
            &args("-1"),
        );
        check("rope backward", dtype, &b, &g[0]);
    }
}

#[test]
fn emulated_attention_kernels_match_the_cpu_op() {
    // GQA and plain heads; rows shorter and longer than a block (64 queries, 32 at d = 128).
    let cases = [
        (2, 9, 4, 2, 16),
        (2, 70, 2, 1, 32),
        (1, 130, 4, 2, 64),
        (1, 40, 2, 2, 128),
        (2, 75, 2, 1, 64),
    ];
    for dtype in [DType::F32, DType::BF16] {
        for (k, &(b, l, h, kv, d)) in cases.iter().enumerate() {
            let plain = (segment_rows(b, l, k), vec![0; b * l]);
            for (seg, prefix) in [plain, prefix_rows(b, l, k)] {
                emulated_attention_matches(dtype, (b, l, h, kv, d), (&seg, &prefix), k);
            }
        }
        // A prompt shared by three long completions, then a plain segment: the kernels skip
        // the tile of 64 × 64 slots where the third completion's queries (192..250) would meet
        // the first two's keys (64..128), which they walk past on the way from the prompt.
        let (b, l) = (1, 260);
        let seg: Vec<u32> = (0..l)
            .map(|i| if i < 10 { 1 } else { 2 + (i as u32 - 10) / 80 })
            .collect();
        let prefix: Vec<u32> = seg.iter().map(|&s| u32::from(s > 1 && s < 5)).collect();
        let mask = Segments::with_prefixes(b, l, &seg, &prefix).unwrap();
        assert_eq!(
            mask.visible_tiles()[3] & 0b1111,
            0b1101,
            "query tile 3 skips key tile 1"
        );
        emulated_attention_matches(dtype, (b, l, 2, 1, 64), (&seg, &prefix), cases.len());
        // A prompt of 70 slots shared by two completions of 100: the tensor-core kernels take
        // spans of the prompt's keys whole for the completions' queries by the prefix rule,
        // and must mask the first completion's keys for the second's queries one by one.
        let l = 270;
        let seg: Vec<u32> = (0..l)
            .map(|i| if i < 70 { 1 } else { 2 + (i as u32 - 70) / 100 })
            .collect();
        let prefix: Vec<u32> = seg.iter().map(|&s| u32::from(s > 1)).collect();
        emulated_attention_matches(dtype, (1, l, 2, 1, 64), (&seg, &prefix), cases.len() + 1);
        // A prompt of 96 slots, a completion of 32, then one of 80: the key tile 64..128 is
        // half prompt, half first completion, which the second's queries see only in part.
        let l = 208;
        let seg: Vec<u32> = (0..l)
            .map(|i| match i {
                0..96 => 1,
                96..128 => 2,
                _ => 3,
            })
            .collect();
        let prefix: Vec<u32> = seg.iter().map(|&s| u32::from(s > 1)).collect();
        emulated_attention_matches(dtype, (1, l, 2, 1, 64), (&seg, &prefix), cases.len() + 2);
    }
}

/// The emulated attention kernels (on tensor cores too, for bf16 heads of 64 and 128) against
/// the CPU op: output and the three gradients.
fn emulated_attention_matches(
    dtype: DType,
    (b, l, h, kv, d): (usize, usize, usize, usize, usize),
    (seg, prefix): (&[u32], &[u32]),
    k: usize,
) {
    let heads = AttentionHeads {
        heads: h,
        kv_heads: kv,
        head_dim: d,
    };
    let segments = std::sync::Arc::new(Segments::with_prefixes(b, l, seg, prefix).unwrap());
    let n = b * l;
    let xs = inputs(
        &[&[n, h * d], &[n, kv * d], &[n, kv * d], &[n, h * d]],
        20 + k as u64,
        dtype,
    );
    let (o, g) = reference(&xs[..3], &xs[3], &|t| {
        fused::attention(&t[0], &t[1], &t[2], &segments, heads).unwrap()
    });
    let args = [b, l, h, kv, d, usize::from(segments.runs())].map(|x| x.to_string());
    let ins = [
        In::Floats(&xs[0]),
        In::Floats(&xs[1]),
        In::Floats(&xs[2]),
        In::Floats(&xs[3]),
        In::Words(segments.ids()),
        In::Words(segments.prefixes()),
        In::Words(segments.first()),
        In::Words(segments.visible_tiles()),
    ];
    // bf16 heads of 64 and 128 also take the tensor-core kernels (attention_tc.cu).
    let tensor_cores = dtype == DType::BF16 && (d == 64 || d == 128);
    for tc in [false, true].into_iter().filter(|&tc| !tc || tensor_cores) {
        let mut args = args.to_vec();
        args.push(usize::from(tc).to_string());
        let out = emulate("attention", dtype, &ins, &args);
        let what = |p: &str| format!("attention {p}, case {k}, runs {}, tc {tc}", segments.runs());
        let (qn, kn) = (n * h * d, n * kv * d);
        check(&what("output"), dtype, &out[..qn], &o);
        let rest = &out[qn + n * h..];
        check(&what("dq"), dtype, &rest[..qn], &g[0]);
        check(&what("dk"), dtype, &rest[qn..qn + kn], &g[1]);
        check(&what("dv"), dtype, &rest[qn + kn..], &g[2]);
    }
}

#[test]
fn emulated_token_score_kernels_match_the_composition() {
    // A vocabulary narrower than a block of 256 threads, one over several strides, and one
    // whose 16-byte loads are several a thread (its running max moves), also at a temperature
    // that spreads the scaled logits over ±200 (2^288 in base 2: a sum not kept below its
    // max overflows); 106 values a row are read one at a time (rows off 16-byte boundaries),
    // the others 16 bytes a load.
    let cases = [
        (3usize, 106usize, 1.0f64),
        (5, 1000, 0.7),
        (2, 5000, 1.3),
        (2, 5000, 0.02),
    ];
    for dtype in [DType::F32, DType::BF16] {
        for (rows, vocab, temperature) in cases {
            let xs = inputs(&[&[rows, vocab], &[rows, 2]], 40, dtype);
            let logits = (&xs[0] * 4.0).unwrap();
            // The upstream gradient is f32 whatever the logits' dtype.
            let grad = rand(&[rows, 2], 41, DType::F64);
            let targets: Vec<u32> = (0..rows).map(|r| ((r * 37 + 5) % vocab) as u32).collect();
            let t = Tensor::new(targets.as_slice(), &candle_core::Device::Cpu).unwrap();
            let (want, g) = reference(std::slice::from_ref(&logits), &grad, &|x| {
                let z = (&x[0] / temperature).unwrap();
                let logp = candle_nn::ops::log_softmax(&z, 1).unwrap();
                let target = logp.gather(&t.unsqueeze(1).unwrap(), 1).unwrap();
                let entropy = (logp.exp().unwrap() * &logp)
                    .unwrap()
                    .sum_keepdim(1)
                    .unwrap()
                    .neg()
                    .unwrap();
                Tensor::cat(&[target, entropy], 1).unwrap()
            });
            let args = [
                rows.to_string(),
                vocab.to_string(),
                (1.0 / temperature).to_string(),
            ];
            let out = emulate(
                "scores",
                dtype,
                &[In::Floats(&logits), In::Words(&targets), In::Floats(&grad)],
                &args,
            );
            check("token scores", dtype, &out[..rows * 2], &want);
            check(
                "token scores' logit gradient",
                dtype,
                &out[rows * 2..],
                &g[0],
            );
        }
    }
}

#[test]
fn emulated_paged_attention_kernel_stores_the_step_and_matches_a_dense_softmax_split_or_not() {
    // Rows of four sequences over a pool of 4-token blocks, one adding a prompt of three tokens
    // (three rows, each seeing one more key), one over more than a warp's 32 keys; GQA; head
    // dims below, at and over a warp's 32 columns. The launch also stores each row's new key and
    // value in the pool: the pool that comes back is the one given with exactly those rows
    // replaced, and the attention reads the new positions as stored.
    for dtype in [DType::F32, DType::BF16] {
        for (heads, kv, d) in [(4usize, 2usize, 16usize), (2, 1, 32), (3, 3, 72)] {
            let bt = 4;
            let long: Vec<u32> = (8..19).rev().collect();
            let tables: [&[u32]; 4] = [&[5, 1, 7], &[0], &[2, 6, 3, 4], &long];
            let (pool_blocks, cached) = (19, [8usize, 2, 10, 40]);
            // (sequence, visible length) per query row; the last over 32 keys (a warp's).
            let rows = [(0usize, 9usize), (1, 3), (2, 11), (2, 12), (2, 13), (3, 41)];
            let (r, pool_rows) = (rows.len(), pool_blocks * kv * bt);
            let xs = inputs(
                &[
                    &[r, heads * d],
                    &[r, kv * d],
                    &[r, kv * d],
                    &[2 * pool_rows, d],
                ],
                70 + d as u64,
                dtype,
            );
            let (q, k_new, v_new, pool) = (&xs[0], &xs[1], &xs[2], &xs[3]);
            let mut meta = Vec::new();
            let mut flat = Vec::new();
            let mut starts = Vec::new();
            for t in tables {
                starts.push(flat.len() as u32);
                flat.extend_from_slice(t);
            }
            for &(s, len) in &rows {
                meta.extend([starts[s], len as u32, cached[s] as u32]);
            }
            meta.extend(flat);
            // The reference: the new rows stored, then each row's keys gathered through its
            // table, a dense softmax.
            let flat = |t: &Tensor| -> Vec<f64> { t.flatten_all().unwrap().to_vec1().unwrap() };
            let (qv, kn, vn, mut stored) = (flat(q), flat(k_new), flat(v_new), flat(pool));
            let at = |s: usize, t: usize, kh: usize| {
                ((tables[s][t / bt] as usize * kv + kh) * bt + t % bt) * d
            };
            for (i, &(s, len)) in rows.iter().enumerate() {
                for kh in 0..kv {
                    let (to, from) = (at(s, len - 1, kh), (i * kv + kh) * d);
                    stored[to..to + d].copy_from_slice(&kn[from..from + d]);
                    let to = pool_rows * d + to;
                    stored[to..to + d].copy_from_slice(&vn[from..from + d]);
                }
            }
            let (keys, values) = stored.split_at(pool_rows * d);
            let mut want = vec![0f64; r * heads * d];
            for (i, &(s, len)) in rows.iter().enumerate() {
                for h in 0..heads {
                    let kh = h / (heads / kv);
                    let qh = &qv[(i * heads + h) * d..][..d];
                    let scores: Vec<f64> = (0..len)
                        .map(|t| {
                            let key = &keys[at(s, t, kh)..][..d];
                            qh.iter().zip(key).map(|(a, b)| a * b).sum::<f64>() / (d as f64).sqrt()
                        })
                        .collect();
                    let max = scores.iter().copied().fold(f64::NEG_INFINITY, f64::max);
                    let e: Vec<f64> = scores.iter().map(|x| (x - max).exp()).collect();
                    let z: f64 = e.iter().sum();
                    for c in 0..d {
                        want[(i * heads + h) * d + c] =
                            (0..len).map(|t| e[t] / z * values[at(s, t, kh) + c]).sum();
                    }
                }
            }
            let want = Tensor::from_vec(want, r * heads * d, &candle_core::Device::Cpu).unwrap();
            let scale = 1.0 / (d as f64).sqrt();
            let args = [r, heads, kv, d, bt]
                .map(|x| x.to_string())
                .into_iter()
                .chain([
                    scale.to_string(),
                    pool_rows.to_string(),
                    meta.len().to_string(),
                ])
                .collect::<Vec<_>>();
            let stored: Vec<f32> = stored.iter().map(|&x| x as f32).collect();
            // In one pass, and split over parts (flash-decoding): three parts give the 41-key
            // row two stretches of 32 and 9 and an empty third, the short rows one and two
            // empty ones.
            let mut outs = Vec::new();
            for parts in [1usize, 3] {
                let mut args = args.clone();
                args.push(parts.to_string());
                let got = emulate(
                    "paged",
                    dtype,
                    &[
                        In::Floats(q),
                        In::Floats(k_new),
                        In::Floats(v_new),
                        In::Floats(pool),
                        In::Words(&meta),
                    ],
                    &args,
                );
                let what = format!("paged attention, heads {heads}/{kv} of {d}, {parts} parts");
                let (out, pool_after) = got.split_at(r * heads * d);
                check(&what, dtype, out, &want);
                assert_eq!(
                    pool_after, stored,
                    "{what} ({dtype:?}): the pool after the launch"
                );
                outs.push(out.to_vec());
            }
            // In f32 the split's other order of sums shows (bf16 rounds it away).
            if dtype == DType::F32 {
                let differ = outs[0].iter().zip(&outs[1]).filter(|(a, b)| a != b).count();
                assert!(differ > 0, "the split launch took the one-pass path");
            }
        }
    }
}
