//! The engine's step kernels for stacked products (`kernels/fused.cu`: `add_rms_fwd`,
//! `split_rope`, `swiglu_rows`) under the CUDA emulation (`emulated.rs`), against the CPU
//! compositions they replace, in f32 and bf16; and the CPU versions of the same ops
//! (`fused::add_rms_norm`, `split_rope`, `swiglu_rows`) against the same compositions; and the
//! paged cache's one-launch write of a step's keys and values (`kernels/paged.cu`, `kv_rows`).

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
