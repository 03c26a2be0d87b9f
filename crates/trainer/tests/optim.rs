//! AdamW against a scalar reference, global-norm clipping, the learning-rate schedule, f32
//! master weights under bf16 parameters, and an exact state round trip.

use candle_core::{DType, Device, Tensor, Var};
use sluice_trainer::config::LrSchedule;
use sluice_trainer::optim::{AdamW, GradAccumulator, OptimConfig};

fn close(a: f64, b: f64, tol: f64, what: &str) {
    assert!((a - b).abs() <= tol, "{what}: {a} vs {b}");
}

#[test]
fn schedule_warms_up_linearly_then_holds_or_follows_a_cosine() {
    let mut c = OptimConfig {
        learning_rate: 1.0,
        warmup_steps: 4,
        total_steps: 12,
        ..OptimConfig::default()
    };
    let lrs: Vec<f64> = (0..6).map(|s| c.learning_rate_at(s)).collect();
    assert_eq!(lrs, [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]);
    c.schedule = LrSchedule::Cosine;
    close(c.learning_rate_at(4), 1.0, 1e-12, "cosine start");
    close(c.learning_rate_at(8), 0.5, 1e-12, "cosine middle");
    close(c.learning_rate_at(12), 0.0, 1e-12, "cosine end");
    close(c.learning_rate_at(40), 0.0, 1e-12, "past the end");
}

/// Grad store for `loss = Σ_i k_i · p_i²` on the given variables.
fn grads(vars: &[&Var], k: &[f32]) -> GradAccumulator {
    let mut loss: Option<Tensor> = None;
    for (v, &k) in vars.iter().zip(k) {
        let term = (v
            .as_tensor()
            .to_dtype(DType::F32)
            .unwrap()
            .sqr()
            .unwrap()
            .sum_all()
            .unwrap()
            * f64::from(k))
        .unwrap();
        loss = Some(match loss {
            None => term,
            Some(l) => (l + term).unwrap(),
        });
    }
    let store = loss.unwrap().backward().unwrap();
    let mut acc = GradAccumulator::new(vars.len());
    acc.add(vars, &store).unwrap();
    acc
}

#[test]
fn adamw_matches_a_scalar_reference_with_clipping_and_decay() {
    let dev = Device::Cpu;
    let p0 = [1.0f32, -2.0, 0.5];
    let var = Var::from_tensor(&Tensor::new(&p0, &dev).unwrap()).unwrap();
    let config = OptimConfig {
        learning_rate: 0.1,
        weight_decay: 0.01,
        max_grad_norm: 1.0,
        ..OptimConfig::default()
    };
    let mut opt = AdamW::new(vec![var.clone()], config).unwrap();
    // Reference in f64.
    let mut p: Vec<f64> = p0.iter().map(|&x| f64::from(x)).collect();
    let (mut m, mut v) = (vec![0.0; 3], vec![0.0; 3]);
    for step in 1..=3 {
        let acc = grads(&[&var], &[3.0]);
        let g: Vec<f64> = p.iter().map(|x| 6.0 * x).collect();
        let norm = g.iter().map(|x| x * x).sum::<f64>().sqrt();
        let report = opt.step(&acc).unwrap();
        close(report.grad_norm, norm, 1e-3, "grad norm");
        let scale = if norm > 1.0 { 1.0 / (norm + 1e-6) } else { 1.0 };
        close(report.clip_scale, scale, 1e-6, "clip scale");
        for i in 0..3 {
            let gi = g[i] * scale;
            m[i] = 0.9 * m[i] + 0.1 * gi;
            v[i] = 0.999 * v[i] + 0.001 * gi * gi;
            let mh = m[i] / (1.0 - 0.9f64.powi(step));
            let vh = v[i] / (1.0 - 0.999f64.powi(step));
            p[i] -= 0.1 * (mh / (vh.sqrt() + 1e-8) + 0.01 * p[i]);
        }
        let got: Vec<f32> = var.as_tensor().to_vec1().unwrap();
        for i in 0..3 {
            close(
                f64::from(got[i]),
                p[i],
                1e-5,
                &format!("step {step} param {i}"),
            );
        }
    }
    assert_eq!(opt.step_count(), 3);
}

#[test]
fn bf16_parameters_keep_f32_master_weights() {
    let dev = Device::Cpu;
    let var = Var::from_tensor(
        &Tensor::new(&[1.0f32], &dev)
            .unwrap()
            .to_dtype(DType::BF16)
            .unwrap(),
    )
    .unwrap();
    let config = OptimConfig {
        learning_rate: 1e-4,
        ..OptimConfig::default()
    };
    let mut opt = AdamW::new(vec![var.clone()], config).unwrap();
    for _ in 0..100 {
        opt.step(&grads(&[&var], &[1.0])).unwrap();
    }
    // Each step moves the master by about lr; bf16 alone (spacing 2⁻⁷ near 1) would never move.
    let master = opt.state_tensors()["master.0"].to_vec1::<f32>().unwrap()[0];
    close(f64::from(master), 0.99, 1e-3, "master");
    let p = var
        .as_tensor()
        .to_dtype(DType::F32)
        .unwrap()
        .to_vec1::<f32>()
        .unwrap()[0];
    assert!(p < 1.0, "the bf16 parameter follows its master: {p}");
    assert_eq!(opt.state_tensors()["m.0"].dtype(), DType::F32);
}

#[test]
fn restored_state_continues_exactly() {
    let dev = Device::Cpu;
    let make = || {
        let a = Var::from_tensor(&Tensor::new(&[0.3f32, -0.7], &dev).unwrap()).unwrap();
        let b = Var::from_tensor(
            &Tensor::new(&[[1.5f32, 2.0]], &dev)
                .unwrap()
                .to_dtype(DType::BF16)
                .unwrap(),
        )
        .unwrap();
        (a, b)
    };
    let config = OptimConfig {
        learning_rate: 0.05,
        warmup_steps: 2,
        ..OptimConfig::default()
    };
    let (a1, b1) = make();
    let mut straight = AdamW::new(vec![a1.clone(), b1.clone()], config).unwrap();
    for _ in 0..4 {
        straight.step(&grads(&[&a1, &b1], &[1.0, 2.0])).unwrap();
    }
    let (a2, b2) = make();
    let mut first = AdamW::new(vec![a2.clone(), b2.clone()], config).unwrap();
    for _ in 0..2 {
        first.step(&grads(&[&a2, &b2], &[1.0, 2.0])).unwrap();
    }
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("optimizer.safetensors");
    candle_core::safetensors::save(&first.state_tensors(), &path).unwrap();
    let saved_step = first.step_count();
    drop(first);
    let mut resumed = AdamW::new(vec![a2.clone(), b2.clone()], config).unwrap();
    resumed
        .load_state(
            candle_core::safetensors::load(&path, &dev).unwrap(),
            saved_step,
        )
        .unwrap();
    for _ in 0..2 {
        resumed.step(&grads(&[&a2, &b2], &[1.0, 2.0])).unwrap();
    }
    assert_eq!(
        a1.as_tensor().to_vec1::<f32>().unwrap(),
        a2.as_tensor().to_vec1::<f32>().unwrap()
    );
    let f = |v: &Var| {
        v.as_tensor()
            .to_dtype(DType::F32)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1::<f32>()
            .unwrap()
    };
    assert_eq!(f(&b1), f(&b2));
    assert!(
        resumed.load_state(Default::default(), 0).is_err(),
        "missing tensors are refused"
    );
}

#[test]
fn the_bias_correction_keeps_its_bits_and_never_wraps() {
    use sluice_trainer::optim::bias_correction;
    // Every step a run reaches: the bits the kernels were always given.
    for t in (1..=5000u64).chain([1 << 20, i32::MAX as u64]) {
        for beta in [0.9, 0.999] {
            assert_eq!(
                bias_correction(beta, t).to_bits(),
                (1.0 - beta.powi(t as i32)).to_bits(),
                "β {beta}, t {t}"
            );
        }
    }
    // Past i32 (a cast truncated to a negative exponent) and at u64::MAX: βᵗ is 0.
    for t in [i32::MAX as u64 + 1, 1 << 40, u64::MAX] {
        assert_eq!(bias_correction(0.9, t), 1.0, "t {t}");
        assert_eq!(bias_correction(0.999, t), 1.0, "t {t}");
    }
}

#[test]
fn a_restored_step_count_at_u64_max_still_takes_a_finite_step() {
    let dev = Device::Cpu;
    for step in [u64::MAX, u64::MAX - 1, i32::MAX as u64, 1 << 33] {
        let var = Var::from_tensor(&Tensor::new(&[1.0f32, -2.0], &dev).unwrap()).unwrap();
        let mut opt = AdamW::new(vec![var.clone()], OptimConfig::default()).unwrap();
        let fresh = AdamW::new(vec![var.clone()], OptimConfig::default()).unwrap();
        opt.load_state(fresh.state_tensors(), step).unwrap();
        let report = opt.step(&grads(&[&var], &[1.0])).unwrap();
        assert!(report.learning_rate.is_finite());
        let got: Vec<f32> = var.as_tensor().to_vec1().unwrap();
        assert!(got.iter().all(|x| x.is_finite()), "step {step}: {got:?}");
        assert!(got[0] < 1.0 && got[1] > -2.0, "it moved: {got:?}");
        assert_eq!(opt.step_count(), step.saturating_add(1));
    }
}

#[test]
fn restored_moments_no_run_produces_are_refused_naming_the_tensor() {
    let dev = Device::Cpu;
    let var = || {
        (
            Var::from_tensor(&Tensor::new(&[1.0f32, 2.0, 3.0], &dev).unwrap()).unwrap(),
            Var::from_tensor(
                &Tensor::new(&[1.0f32, 2.0], &dev)
                    .unwrap()
                    .to_dtype(DType::BF16)
                    .unwrap(),
            )
            .unwrap(),
        )
    };
    let t3 = |v: [f32; 3]| Tensor::new(&v, &dev).unwrap();
    let t2 = |v: [f32; 2]| Tensor::new(&v, &dev).unwrap();
    let cases: Vec<(&str, Tensor, &str)> = vec![
        (
            "v.0",
            t3([0.0, -1e-3, 0.0]),
            "`v.0` (second moment) holds -0.001 at element 1",
        ),
        (
            "v.0",
            t3([0.0, 0.0, f32::NAN]),
            "`v.0` (second moment) holds NaN at element 2",
        ),
        (
            "v.0",
            t3([f32::INFINITY, 0.0, 0.0]),
            "`v.0` (second moment) holds inf",
        ),
        (
            "m.0",
            t3([0.0, f32::NEG_INFINITY, 0.0]),
            "`m.0` (first moment) holds -inf",
        ),
        (
            "m.1",
            t2([f32::NAN, 0.0]),
            "`m.1` (first moment) holds NaN at element 0",
        ),
        (
            "master.1",
            t2([1.0, f32::NAN]),
            "`master.1` (master weights) holds NaN",
        ),
        (
            "v.1",
            t3([0.0, 0.0, 0.0]),
            "`v.1` has shape [3], the parameter [2]",
        ),
    ];
    for (name, bad, expected) in cases {
        let (a, b) = var();
        let mut opt = AdamW::new(vec![a.clone(), b.clone()], OptimConfig::default()).unwrap();
        let mut state = opt.state_tensors();
        // A negative m is fine: only v must be ≥ 0.
        state.insert("m.0".into(), t3([-1.0, 0.5, -0.25]));
        opt.load_state(state.clone(), 3).unwrap();
        state.insert(name.into(), bad);
        let err = opt.load_state(state, 3).unwrap_err().to_string();
        assert!(err.contains(expected), "{name}: {err}");
    }
}

#[test]
fn a_non_finite_gradient_norm_moves_no_parameter() {
    let dev = Device::Cpu;
    let var = Var::from_tensor(&Tensor::new(&[1.0f32, -2.0], &dev).unwrap()).unwrap();
    let mut opt = AdamW::new(vec![var.clone()], OptimConfig::default()).unwrap();
    opt.step(&grads(&[&var], &[1.0])).unwrap();
    let before = var.as_tensor().to_vec1::<f32>().unwrap();
    let moments = opt.state_tensors()["v.0"].to_vec1::<f32>().unwrap();
    for k in [f32::NAN, f32::INFINITY] {
        let err = opt.step(&grads(&[&var], &[k])).unwrap_err();
        assert_eq!(err.kind(), "non_finite_gradient");
        assert!(err.to_string().contains("global gradient norm is"), "{err}");
        assert_eq!(var.as_tensor().to_vec1::<f32>().unwrap(), before);
        assert_eq!(
            opt.state_tensors()["v.0"].to_vec1::<f32>().unwrap(),
            moments
        );
        assert_eq!(opt.step_count(), 1);
    }
}
