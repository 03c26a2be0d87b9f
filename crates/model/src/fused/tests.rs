//! Tests of the parent module (`fused`).

/// Within a few ulps of `exp` over f32's whole range (up to 88.72, just below `ln f32::MAX`),
/// 0 below it, infinite above, NaN kept.
#[test]
fn exp_matches_the_library_exp() {
    let mut xs: Vec<f32> = (-8800..=8872).map(|i| i as f32 / 100.0).collect();
    xs.extend([-0.0, 1e-8, -1e-8, 0.346_573_6, -0.346_573_6]);
    let mut got = xs.clone();
    super::exp_f32_slice(&mut got);
    for (&x, &y) in xs.iter().zip(&got) {
        if x < -87.3 {
            assert_eq!(y, 0.0, "exp({x})");
            continue;
        }
        let want = f64::from(x).exp();
        let rel = ((f64::from(y) - want) / want).abs();
        assert!(
            rel < 4e-7,
            "exp({x}) = {y}, want {want} (relative error {rel:e})"
        );
    }
    let mut odd = [f32::NAN, f32::NEG_INFINITY, 88.8, 1e30, f32::INFINITY];
    super::exp_f32_slice(&mut odd);
    assert!(odd[0].is_nan());
    assert_eq!(odd[1..], [0.0, f32::INFINITY, f32::INFINITY, f32::INFINITY]);
}

/// The GPU's linear node runs the backend's product forward and two candle products backward;
/// the same calls on CPU storage give the CPU kernel's values and gradients.
#[test]
fn the_device_linear_node_matches_the_cpu_kernel() {
    use candle_core::{DType, Device, Storage, Tensor, Var};
    let (n, i, o) = (5, 7, 3);
    let rand = |shape: (usize, usize), seed: u64| {
        let v: Vec<f64> = (0..shape.0 * shape.1)
            .map(|k| ((k as u64 * 2_654_435_761 + seed * 97) % 1000) as f64 / 500.0 - 1.0)
            .collect();
        Var::from_tensor(&Tensor::from_vec(v, shape, &Device::Cpu).unwrap()).unwrap()
    };
    let (x, w) = (rand((n, i), 1), rand((o, i), 2));
    let g = rand((n, o), 3).as_tensor().detach();
    let want = super::linear(&x, &w, None).unwrap();
    let op = super::linear::Linear::new(n, i, o);
    let (xs, xl) = x.storage_and_layout();
    let (ws, wl) = w.storage_and_layout();
    let (Storage::Cpu(xs), Storage::Cpu(ws)) = (&*xs, &*ws) else {
        unreachable!("CPU tensors")
    };
    let y = op.product(xs, xl, ws, wl).unwrap();
    let y = Tensor::from_storage(
        Storage::Cpu(y),
        (n, o),
        candle_core::op::BackpropOp::none(),
        false,
    );
    let diff = |a: &Tensor, b: &Tensor| {
        let d = (a - b).unwrap().abs().unwrap().max_all().unwrap();
        d.to_dtype(DType::F64).unwrap().to_scalar::<f64>().unwrap()
    };
    assert!(diff(&y, &want) < 1e-12, "forward");
    let grads = (want * &g).unwrap().sum_all().unwrap().backward().unwrap();
    let (dx, dw) = super::linear::Linear::bwd_products(&x, &w, &g, [true; 2]).unwrap();
    assert!(diff(&dx.unwrap(), grads.get(&x).unwrap()) < 1e-12, "dx");
    assert!(diff(&dw.unwrap(), grads.get(&w).unwrap()) < 1e-12, "dw");
}

/// `linear_grads` off the CPU kernels' dtypes (bf16 here, the path a GPU takes): the input's
/// and weight's gradients by the backend's two products, and the bias's summed over the rows in
/// f32, against candle's autograd over the same forward (`x·wᵀ` then a broadcast add) computed
/// in f64; the CPU kernels' path (f64) against it exactly.
#[test]
fn linear_grads_match_autograd_on_both_paths() {
    use candle_core::{DType, Device, Tensor, Var};
    let (n, i, o) = (37, 16, 24);
    let rand = |len: usize, seed: u64| -> Vec<f64> {
        (0..len)
            .map(|k| ((k as u64 * 2_654_435_761 + seed * 97) % 1000) as f64 / 500.0 - 1.0)
            .collect()
    };
    let t = |v: Vec<f64>, shape: &[usize]| Tensor::from_vec(v, shape, &Device::Cpu).unwrap();
    let (x, w, b) = (
        t(rand(n * i, 1), &[n, i]),
        t(rand(o * i, 2), &[o, i]),
        t(rand(o, 3), &[o]),
    );
    let g = t(rand(n * o, 4), &[n, o]);
    // The reference: autograd over the composition, in f64.
    let vars = [&x, &w, &b].map(|t| Var::from_tensor(t).unwrap());
    let y = vars[0]
        .matmul(&vars[1].t().unwrap())
        .unwrap()
        .broadcast_add(&vars[2])
        .unwrap();
    let store = (y * &g).unwrap().sum_all().unwrap().backward().unwrap();
    let want: Vec<Tensor> = vars
        .iter()
        .map(|v| store.get(v.as_tensor()).unwrap().clone())
        .collect();
    let rel = |a: &Tensor, b: &Tensor| {
        let a = a.to_dtype(DType::F64).unwrap();
        let d = (&a - b).unwrap().abs().unwrap().max_all().unwrap();
        let s = b.abs().unwrap().max_all().unwrap();
        d.to_scalar::<f64>().unwrap() / s.to_scalar::<f64>().unwrap()
    };
    for (dtype, tol) in [(DType::F64, 1e-12), (DType::BF16, 2e-2)] {
        let [x, w, b, g] = [&x, &w, &b, &g].map(|t| t.to_dtype(dtype).unwrap());
        let (dx, dw, db) = super::linear_grads(&x, &w, Some(&b), &g).unwrap();
        let db = db.expect("a bias gradient");
        assert_eq!(db.dtype(), dtype);
        for (name, got, want) in [
            ("dx", &dx, &want[0]),
            ("dw", &dw, &want[1]),
            ("db", &db, &want[2]),
        ] {
            assert_eq!(got.dims(), want.dims(), "{dtype:?} {name}");
            let err = rel(got, want);
            assert!(err < tol, "{dtype:?} {name}: relative error {err}");
        }
    }
}

/// Inside a [`super::Bf16Products`] scope on a CPU with AMX, the linear layer's products
/// (forward, dx and dw, each reading one operand through a transposed view) are those of
/// operands rounded to bf16 summed in f32, and the head's log-probs those of logits formed
/// so; outside it, the same calls are f32 again. Shapes off every multiple of the tiles' 16
/// and 32, and the head in several chunks.
#[test]
fn products_on_the_tiles_round_their_operands() {
    use candle_core::{Device, Tensor};
    if !crate::amx::available() {
        eprintln!("no AMX on this CPU: the scope keeps f32 products, checked below");
        let _tiles = super::Bf16Products::enter(true);
        assert!(!super::products::bf16_products());
        return;
    }
    let (n, i, o) = (37, 70, 45);
    let rand = |len: usize, seed: u64| -> Vec<f32> {
        (0..len)
            .map(|k| ((k as u64 * 2_654_435_761 + seed * 97) % 1000) as f32 / 500.0 - 1.0)
            .collect()
    };
    let (x, w, g) = (rand(n * i, 1), rand(o * i, 2), rand(n * o, 3));
    let t = |v: &[f32], shape: (usize, usize)| Tensor::from_slice(v, shape, &Device::Cpu);
    let (xt, wt, gt) = (
        t(&x, (n, i)).unwrap(),
        t(&w, (o, i)).unwrap(),
        t(&g, (n, o)).unwrap(),
    );
    let round = |v: f32| f64::from(f32::from_bits(u32::from(crate::amx::bf16_bits(v)) << 16));
    // `a (m, k) · b (k, n)` in f64, element (r, c) of each at `at(r, c)`.
    let product = |(m, k, cols): (usize, usize, usize),
                   a: &dyn Fn(usize, usize) -> f64,
                   b: &dyn Fn(usize, usize) -> f64| {
        let mut out = vec![0f64; m * cols];
        for r in 0..m {
            for c in 0..cols {
                out[r * cols + c] = (0..k).map(|p| a(r, p) * b(p, c)).sum();
            }
        }
        out
    };
    let values = |t: &Tensor| -> Vec<f32> { t.flatten_all().unwrap().to_vec1().unwrap() };
    // Largest difference to `want`, over `want`'s largest magnitude.
    let err = |got: &[f32], want: &[f64]| {
        let scale = want.iter().fold(0f64, |s, v| s.max(v.abs()));
        let d = got.iter().zip(want).map(|(&a, b)| (f64::from(a) - b).abs());
        d.fold(0f64, f64::max) / scale
    };
    let y_want = product((n, i, o), &|r, p| round(x[r * i + p]), &|p, c| {
        round(w[c * i + p])
    });
    let dx_want = product((n, o, i), &|r, p| round(g[r * o + p]), &|p, c| {
        round(w[p * i + c])
    });
    let dw_want = product((o, n, i), &|r, p| round(g[p * o + r]), &|p, c| {
        round(x[p * i + c])
    });
    let unrounded = product((n, i, o), &|r, p| f64::from(x[r * i + p]), &|p, c| {
        f64::from(w[c * i + p])
    });
    let f32_y = values(&super::linear(&xt, &wt, None).unwrap());
    let (y, dx, dw, scores) = {
        let _tiles = super::Bf16Products::enter(true);
        let y = values(&super::linear(&xt, &wt, None).unwrap());
        let (dx, dw, _) = super::linear_grads(&xt, &wt, None, &gt).unwrap();
        let targets: Vec<u32> = (0..n as u32).map(|r| (r * 7) % o as u32).collect();
        let scores = super::token_scores(&xt, &wt, &targets, 16, 1.0 / 0.7, 0).unwrap();
        (y, values(&dx), values(&dw), (targets, values(&scores)))
    };
    assert!(!super::products::bf16_products(), "the scope ended");
    // f32 sums of k products each: a few ulps of the sum's scale.
    for (name, got, want) in [
        ("y", &y, &y_want),
        ("dx", &dx, &dx_want),
        ("dw", &dw, &dw_want),
    ] {
        let e = err(got, want);
        assert!(e < 1e-6, "{name}: {e:e} from the rounded operands' product");
    }
    assert!(
        err(&y, &unrounded) > 1e-4,
        "the tiles' forward was not rounded"
    );
    assert!(
        err(&f32_y, &unrounded) < 1e-6,
        "outside the scope, f32 again"
    );
    // The head: log softmax(z / T) at the target, and the entropy, of the rounded logits.
    let (targets, scores) = scores;
    for (r, &target) in targets.iter().enumerate() {
        let z: Vec<f64> = (0..o).map(|c| y_want[r * o + c] / 0.7).collect();
        let max = z.iter().fold(f64::MIN, |a, &b| a.max(b));
        let lse = max + z.iter().map(|v| (v - max).exp()).sum::<f64>().ln();
        let entropy: f64 = z.iter().map(|v| -(v - lse).exp() * (v - lse)).sum();
        let (lp, h) = (f64::from(scores[2 * r]), f64::from(scores[2 * r + 1]));
        assert!(
            (lp - (z[target as usize] - lse)).abs() < 1e-5,
            "row {r}: log-prob {lp}"
        );
        assert!(
            (h - entropy).abs() < 1e-5,
            "row {r}: entropy {h} vs {entropy}"
        );
    }
}
