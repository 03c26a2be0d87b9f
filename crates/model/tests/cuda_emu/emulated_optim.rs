//! The optimizer's many-parameter kernels (`kernels/adamw.cu`: `adamw_many_f32`,
//! `sumsq_many_f32`, `snapshot_many_f32`, `accumulate_many_f32`) under the CUDA emulation
//! (`emulated.rs`), launched as `crates/trainer/src/adamw_kernel/cuda.rs` launches them, against
//! the CPU operations they replace.

use candle_core::{DType, Tensor};

use super::emulated::{In, emulate, inputs};
use super::rand;

#[test]
fn emulated_many_parameter_adamw_and_norm_sums_match_the_cpu() {
    // Parameters of one element, of a partial chunk and of two chunks (65,536 elements a block).
    let sizes = [1usize, 300, 70_000];
    let (clip, b1, b2, eps, lr, wd, t) = (0.37f64, 0.9f64, 0.999f64, 1e-8f64, 1e-3f64, 0.01f64, 3);
    let (bc1, bc2) = (1.0 - b1.powi(t), 1.0 - b2.powi(t));
    // As `adamw_kernel::Update` rounds its constants to f32.
    let k = [
        clip,
        b1,
        1.0 - b1,
        b2,
        1.0 - b2,
        1.0 / bc1,
        1.0 / bc2,
        eps,
        lr,
        1.0 - lr * wd,
    ]
    .map(|x| x as f32);
    let mut ins = Vec::new();
    let mut want = Vec::new();
    for (i, &n) in sizes.iter().enumerate() {
        let [p, m, v, g] = [0, 1, 2, 3].map(|j| {
            let t = rand(&[n], 60 + 4 * i as u64 + j, DType::F32);
            // Second moments are non-negative.
            if j == 2 { t.abs().unwrap() } else { t }
        });
        let vals = |t: &Tensor| -> Vec<f32> { t.to_vec1().unwrap() };
        let (mut pv, mut mv, mut vv, gv) = (vals(&p), vals(&m), vals(&v), vals(&g));
        // The CPU kernel's operations (crates/trainer/src/adamw_kernel.rs), each rounded to f32.
        for e in 0..n {
            let gi = gv[e] * k[0] + 0.0;
            mv[e] = (mv[e] * k[1] + 0.0) + (gi * k[2] + 0.0);
            vv[e] = (vv[e] * k[3] + 0.0) + (gi * gi * k[4] + 0.0);
            let adam = (mv[e] * k[5] + 0.0) / ((vv[e] * k[6] + 0.0).sqrt() * 1.0 + k[7]);
            pv[e] = (pv[e] * k[9] + 0.0) - (adam * k[8] + 0.0);
        }
        want.extend(pv.into_iter().chain(mv).chain(vv));
        ins.extend([p, m, v, g]);
    }
    let inputs: Vec<In<'_>> = ins.iter().map(In::Floats).collect();
    let args: Vec<String> = k
        .iter()
        .map(|x| format!("{x:e}"))
        .chain(sizes.iter().map(|n| n.to_string()))
        .collect();
    let got = emulate("adamw_many", DType::F32, &inputs, &args);
    let differ = got
        .iter()
        .zip(&want)
        .filter(|(a, b)| a.to_bits() != b.to_bits())
        .count();
    assert_eq!(got.len(), want.len());
    assert_eq!(differ, 0, "{differ} elements differ from the CPU update");

    // The global gradient norm's sums over the same gradients, one per chunk.
    let grads: Vec<In<'_>> = ins.iter().skip(3).step_by(4).map(In::Floats).collect();
    let sizes: Vec<String> = sizes.iter().map(|n| n.to_string()).collect();
    let partial = emulate("sumsq_many", DType::F32, &grads, &sizes);
    assert_eq!(partial.len(), 4, "chunks of 1, 300 and 70,000 elements");
    let got: f64 = partial.iter().map(|&s| f64::from(s)).sum();
    let want: f64 = ins
        .iter()
        .skip(3)
        .step_by(4)
        .flat_map(|g| g.to_vec1::<f32>().unwrap())
        .map(|x| f64::from(x) * f64::from(x))
        .sum();
    assert!(
        (got - want).abs() <= 1e-5 * want,
        "sum of squares {got} against {want}"
    );
}

#[test]
fn emulated_snapshot_kernel_converts_every_parameter_as_candle_does() {
    // Parameters of 1, 300 and 70,000 elements (the last over one 65,536-element chunk), f32
    // values that bf16 cannot hold: each converted to bf16 bit for bit as candle's `to_dtype`
    // rounds it, or copied as f32.
    let sizes = [1usize, 300, 70_000];
    let shapes: Vec<&[usize]> = sizes.iter().map(std::slice::from_ref).collect();
    let params = inputs(&shapes, 41, DType::F32);
    let ins: Vec<In<'_>> = params.iter().map(In::Floats).collect();
    let args: Vec<String> = sizes.iter().map(|n| n.to_string()).collect();
    for dtype in [DType::BF16, DType::F32] {
        let got = emulate("snapshot_many", dtype, &ins, &args);
        let want: Vec<f32> = params
            .iter()
            .flat_map(|p| {
                let p = p.to_dtype(DType::F32).unwrap().to_dtype(dtype).unwrap();
                p.to_dtype(DType::F32).unwrap().to_vec1::<f32>().unwrap()
            })
            .collect();
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&got), bits(&want), "snapshot in {dtype:?}");
    }
    // The bf16 values are not the f32 ones: the conversion was exercised.
    let f32s = emulate("snapshot_many", DType::F32, &ins, &args);
    assert_ne!(emulate("snapshot_many", DType::BF16, &ins, &args), f32s);
}

#[test]
fn emulated_accumulate_kernel_adds_gradients_as_the_conversions_and_adds_do() {
    // A micro-batch's gradients into the step's f32 sums, as the trainer launches it: a fresh
    // sum from one bf16 gradient, a sum over 65,536 elements (two chunks) plus an f32 one, a
    // fresh sum of two (a tied embedding's f32 rows and bf16 head), and an existing sum plus
    // two. Against converting each gradient and adding them tensor by tensor, bit for bit.
    const FRESH: u32 = 1;
    const G_BF16: u32 = 2;
    const H: u32 = 4;
    const H_BF16: u32 = 8;
    let params: [(usize, u32); 4] = [
        (300, FRESH | G_BF16),
        (70_000, 0),
        (1, FRESH | H | H_BF16),
        (513, G_BF16 | H),
    ];
    let mut tensors = Vec::new();
    let mut want: Vec<f32> = Vec::new();
    for (k, &(n, flags)) in params.iter().enumerate() {
        let seed = 60 + 3 * k as u64;
        let value = |seed: u64, bf16: bool| {
            let t = rand(&[n], seed, DType::F32).to_dtype(DType::F32).unwrap();
            let t = if bf16 {
                t.to_dtype(DType::BF16).unwrap()
            } else {
                t
            };
            t.to_dtype(DType::F32).unwrap()
        };
        let sum = (flags & FRESH == 0).then(|| value(seed, false));
        let g = value(seed + 1, flags & G_BF16 != 0);
        let h = (flags & H != 0).then(|| value(seed + 2, flags & H_BF16 != 0));
        let micro = match &h {
            Some(h) => (&g + h).unwrap(),
            None => g.clone(),
        };
        let total = match &sum {
            Some(s) => (s + &micro).unwrap(),
            None => micro,
        };
        want.extend(total.to_vec1::<f32>().unwrap());
        tensors.extend(sum.into_iter().chain([g]).chain(h));
    }
    // The harness reads every input as f32 and rounds those its flags call bf16: exact here.
    let ins: Vec<In<'_>> = tensors.iter().map(In::Floats).collect();
    let args: Vec<String> = params
        .iter()
        .flat_map(|(n, f)| [n.to_string(), f.to_string()])
        .collect();
    let got = emulate("accumulate_many", DType::F32, &ins, &args);
    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    assert_eq!(got.len(), want.len());
    assert_eq!(bits(&got), bits(&want));
}
