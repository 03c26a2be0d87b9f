//! The engine's step kernels for stacked products (`kernels/fused.cu`: `add_rms_fwd`,
//! `split_rope`, `swiglu_rows`) under the CUDA emulation (`emulated.rs`), against the CPU
//! compositions they replace, in f32 and bf16; and the CPU versions of the same ops
//! (`fused::add_rms_norm`, `split_rope`, `swiglu_rows`) against the same compositions; and the
//! paged cache's one-launch write of a step's keys and values (`kernels/paged.cu`, `kv_rows`) and
//! its attention over the stacked q/k/v rows (`paged_attention_qkv`).

use candle_core::{DType, Tensor};
use sluice_model::fused;

use super::emulated::{In, check, emulate, inputs};

/// A tensor's values as f32, in row-major order.
fn floats(t: &Tensor) -> Vec<f32> {
    let t = t.flatten_all().unwrap().to_dtype(DType::F32).unwrap();
    t.to_vec1().unwrap()
}

#[test]
fn emulated_engine_step_kernels_match_the_compositions() {
    for dtype in [DType::F32, DType::BF16] {
        // The residual add with the norm after it, rows narrower and wider than a block of 256
        // threads: the sum rounded to the dtype (as an add would store it) before the norm reads
        // it.
        for (rows, d) in [(3, 40), (70, 300)] {
            let xs = inputs(&[&[rows, d], &[rows, d], &[d]], 1, dtype);
            let exact = (&xs[0] + &xs[1]).unwrap();
            let sum = exact.to_dtype(dtype).unwrap().to_dtype(DType::F64).unwrap();
            let normed = fused::rms_norm(&sum, &xs[2], 1e-6).unwrap();
            let args = [rows.to_string(), d.to_string(), "1e-6".into()];
            let ins = [In::Floats(&xs[0]), In::Floats(&xs[1]), In::Floats(&xs[2])];
            let f = emulate("add_rms_fwd", dtype, &ins, &args);
            check("add + rms norm, sum", dtype, &f[..rows * d], &sum);
            check("add + rms norm, normed", dtype, &f[rows * d..], &normed);
            // The CPU op (f64, nothing rounded): the add, then the norm.
            let (s, n) = fused::add_rms_norm(&xs[0], &xs[1], &xs[2], 1e-6).unwrap();
            assert_eq!(floats(&s), floats(&exact));
            let want = fused::rms_norm(&exact, &xs[2], 1e-6).unwrap();
            assert_eq!(floats(&n), floats(&want));
        }
        // q/k/v rows plus the bias (Qwen2) or none (Llama, SmolLM2) split, q and k rotated
        // (GQA: 4 query heads, 2 key/value heads); the kernel writes q, then k, then v.
        let (rows, hq, hk, d) = (7, 4, 2, 8);
        let width = (hq + 2 * hk) * d;
        let shapes: [&[usize]; 4] = [&[rows, width], &[width], &[rows, d / 2], &[rows, d / 2]];
        let xs = inputs(&shapes, 13, dtype);
        for has_bias in [true, false] {
            let biased = match has_bias {
                true => xs[0].broadcast_add(&xs[1]).unwrap(),
                false => xs[0].clone(),
            };
            let part = |at: usize, heads: usize| biased.narrow(1, at * d, heads * d).unwrap();
            let rotated = |t: Tensor| fused::rope(&t, &xs[2], &xs[3], d).unwrap();
            let want = [
                rotated(part(0, hq)),
                rotated(part(hq, hk)),
                part(hq + hk, hk),
            ];
            let ins: Vec<In<'_>> = xs.iter().map(In::Floats).collect();
            let args = [rows, hq, hk, d, usize::from(has_bias)].map(|n| n.to_string());
            let f = emulate("split_rope", dtype, &ins, &args);
            let bias = has_bias.then_some(&xs[1]);
            let cpu = fused::split_rope(&xs[0], bias, &xs[2], &xs[3], hq, hk, d).unwrap();
            let mut at = 0;
            for ((name, w), got) in ["q", "k", "v"].iter().zip(&want).zip([cpu.0, cpu.1, cpu.2]) {
                let n = w.elem_count();
                let what = format!("split rope, {name}, bias {has_bias}");
                check(&what, dtype, &f[at..at + n], w);
                check(&format!("{what} (CPU)"), DType::F32, &floats(&got), w);
                at += n;
            }
            assert_eq!(at, f.len(), "split rope: q, k and v fill the output");
        }
        // Gate/up rows through the activation.
        let (rows, inter) = (6, 300);
        let xs = inputs(&[&[rows, 2 * inter]], 17, dtype);
        let half = |i: usize| xs[0].narrow(1, i * inter, inter).unwrap();
        let want = fused::swiglu(&half(0), &half(1)).unwrap();
        let args = [rows, inter].map(|n| n.to_string());
        let f = emulate("swiglu_rows", dtype, &[In::Floats(&xs[0])], &args);
        check("swiglu rows", dtype, &f, &want);
        let cpu = floats(&fused::swiglu_rows(&xs[0]).unwrap());
        check("swiglu rows (CPU)", DType::F32, &cpu, &want);
    }
}

#[test]
fn emulated_kv_rows_kernel_writes_keys_and_values_in_one_launch() {
    // Five new tokens' rows (head dim 72, so more rows than a block's 256 threads cover in one
    // pass) into a pool of 40 rows per half, at scattered rows: the keys' half and the values'
    // half each get their rows, every other element is left as it was, bit for bit.
    let (n, width, half) = (5usize, 72usize, 40usize);
    let rows: Vec<u32> = vec![7, 0, 39, 12, 25];
    for dtype in [DType::F32, DType::BF16] {
        let xs = inputs(&[&[n, width], &[n, width], &[2 * half, width]], 31, dtype);
        let ins = [
            In::Floats(&xs[0]),
            In::Floats(&xs[1]),
            In::Words(&rows),
            In::Floats(&xs[2]),
        ];
        let got = emulate(
            "kv_rows",
            dtype,
            &ins,
            &[n, width, half].map(|x| x.to_string()),
        );
        let (k, v, mut want) = (floats(&xs[0]), floats(&xs[1]), floats(&xs[2]));
        for (i, &r) in rows.iter().enumerate() {
            let (new, r) = (i * width..(i + 1) * width, r as usize);
            want[r * width..][..width].copy_from_slice(&k[new.clone()]);
            want[(half + r) * width..][..width].copy_from_slice(&v[new]);
        }
        assert_eq!(got, want, "kv rows ({dtype:?})");
    }
}

#[test]
fn emulated_paged_attention_over_stacked_rows_is_the_split_then_the_attention() {
    // The decode layer's last fold: the paged attention reading the stacked q/k/v product, its
    // bias, rotation and split done as it reads, against `split_rope`'s launch and then the
    // attention over what it wrote: the same output and the same pool after, bit for bit. The
    // rows of `emulated.rs`'s paged test: a prompt chunk of three rows, whose later rows read the
    // earlier ones' fresh (rotated) keys, and a row over more than a warp's 32 keys; GQA, and a
    // head dim over a warp's 32 columns.
    let bt = 4usize;
    let long: Vec<u32> = (8..19).rev().collect();
    let tables: [&[u32]; 4] = [&[5, 1, 7], &[0], &[2, 6, 3, 4], &long];
    let cached = [8u32, 2, 10, 40];
    let rows = [(0usize, 9u32), (1, 3), (2, 11), (2, 12), (2, 13), (3, 41)];
    let mut starts = Vec::new();
    let mut flat = Vec::new();
    for t in tables {
        starts.push(flat.len() as u32);
        flat.extend_from_slice(t);
    }
    let mut meta: Vec<u32> = (rows.iter())
        .flat_map(|&(s, len)| [starts[s], len, cached[s]])
        .collect();
    meta.extend(flat);
    let r = rows.len();
    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    for dtype in [DType::F32, DType::BF16] {
        for (heads, kv, d) in [(4usize, 2usize, 16usize), (3, 3, 72)] {
            let pool_rows = 19 * kv * bt;
            let width = (heads + 2 * kv) * d;
            let shapes: [&[usize]; 5] = [
                &[r, width],
                &[width],
                &[r, d / 2],
                &[r, d / 2],
                &[2 * pool_rows, d],
            ];
            let xs = inputs(&shapes, 90 + d as u64, dtype);
            let scale = 1.0 / (d as f64).sqrt();
            let paged_args: Vec<String> = ([r, heads, kv, d, bt].map(|x| x.to_string()))
                .into_iter()
                .chain([scale.to_string(), pool_rows.to_string()])
                .chain([meta.len().to_string()])
                .collect();
            let mut outs = Vec::new();
            for has_bias in [true, false] {
                let what = format!("paged over stacked rows, {heads}/{kv} of {d}, bias {has_bias}");
                let mut args = paged_args.clone();
                args.push(usize::from(has_bias).to_string());
                let mut ins: Vec<In<'_>> = xs.iter().map(In::Floats).collect();
                ins.push(In::Words(&meta));
                let fused = emulate("paged_qkv", dtype, &ins, &args);
                // The two launches it replaces.
                let split_args = [r, heads, kv, d, usize::from(has_bias)].map(|x| x.to_string());
                let ins: Vec<In<'_>> = xs[..4].iter().map(In::Floats).collect();
                let split = emulate("split_rope", dtype, &ins, &split_args);
                let cpu = candle_core::Device::Cpu;
                let (q, rest) = split.split_at(r * heads * d);
                let (k, v) = rest.split_at(r * kv * d);
                let [q, k, v] = [q, k, v].map(|x| Tensor::from_slice(x, x.len(), &cpu).unwrap());
                let ins = [
                    In::Floats(&q),
                    In::Floats(&k),
                    In::Floats(&v),
                    In::Floats(&xs[4]),
                    In::Words(&meta),
                ];
                let two = emulate("paged", dtype, &ins, &paged_args);
                assert_eq!(bits(&fused), bits(&two), "{what} ({dtype:?})");
                let (out, pool) = fused.split_at(r * heads * d);
                assert!(out.iter().all(|x| x.is_finite()), "{what}: finite");
                assert_ne!(pool, floats(&xs[4]), "{what}: the step's rows are stored");
                outs.push(fused);
            }
            assert_ne!(outs[0], outs[1], "the bias is read when it is there");
        }
    }
}
