//! The critic's value head (`TrainableModel::values_for_backward`), part of the `gradients`
//! test binary.

use super::*;

/// `Σ (v − 0.3)²` over the target slots of `values` `(B, L)`.
fn value_loss(values: &Tensor, batch: &PackedBatch) -> Tensor {
    let mask: Vec<f64> = batch
        .target_mask
        .iter()
        .map(|&m| f64::from(u8::from(m)))
        .collect();
    let mask = Tensor::from_vec(mask, (batch.batch, batch.seq_len), values.device())
        .and_then(|m| m.to_dtype(values.dtype()))
        .unwrap();
    let centred = (values - 0.3).unwrap();
    (centred.sqr().unwrap() * mask).unwrap().sum_all().unwrap()
}

/// The critic's value head (`values_for_backward`): its gradients and every parameter's match
/// central finite differences in f64, and the hand-written backward on kept and on recomputed
/// activations gives candle's autograd's over the whole graph.
#[test]
fn the_value_heads_gradients_match_finite_differences_and_the_graph() {
    let batch = batch();
    let arch = ALL_ARCHS[1];
    let snap = snapshot(tiny_config(arch, false), 4, DType::F64);
    let mut model = TrainableModel::from_snapshot(&snap, DType::F64).unwrap();
    let hidden = model.config().hidden_size;
    let row: Vec<f64> = (0..hidden)
        .map(|i| ((i * 37 % 11) as f64 - 5.0) * 0.05)
        .collect();
    let head = candle_core::Var::from_tensor(
        &Tensor::from_vec(row.clone(), (1, hidden), &candle_core::Device::Cpu).unwrap(),
    )
    .unwrap();
    let grads_of = |model: &TrainableModel, activations| {
        let (values, saved) = model
            .values_for_backward(&batch, head.as_tensor(), activations)
            .unwrap();
        assert_eq!(values.dims(), [batch.batch, batch.seq_len]);
        let loss = value_loss(&values, &batch);
        model.backward_saved(&loss, saved).unwrap()
    };
    model.set_hand_backward(false);
    let graph = grads_of(&model, Activations::Kept);
    model.set_hand_backward(true);
    for activations in [Activations::Kept, Activations::Recomputed] {
        let by_hand = grads_of(&model, activations);
        for (name, var) in model
            .vars()
            .iter()
            .chain([&("head".to_owned(), head.clone())])
        {
            let (a, b) = (graph.get(var.as_tensor()), by_hand.get(var.as_tensor()));
            if name == sluice_model::names::LM_HEAD {
                assert!(a.is_none() && b.is_none(), "the LM head takes no part");
                continue;
            }
            let err = rel_err(a.unwrap(), b.unwrap());
            assert!(err < 1e-12, "{activations:?} {name}: relative error {err}");
        }
    }
    let eps = 1e-6;
    let eval = |s: &ModelWeights, row: &[f64]| {
        let m = TrainableModel::from_snapshot(s, DType::F64).unwrap();
        let head = Tensor::from_vec(row.to_vec(), (1, hidden), &candle_core::Device::Cpu).unwrap();
        let (values, _) = m
            .values_for_backward(&batch, &head, Activations::Recomputed)
            .unwrap();
        scalar(&value_loss(&values, &batch))
    };
    let check = |what: &str, analytic: f64, numeric: f64| {
        let tol = 1e-6 + 1e-5 * analytic.abs().max(numeric.abs());
        assert!(
            (analytic - numeric).abs() <= tol,
            "{what}: analytic {analytic:e} vs numeric {numeric:e}"
        );
    };
    let head_grad: Vec<f64> = graph
        .get(head.as_tensor())
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1()
        .unwrap();
    for idx in [0, hidden / 2, hidden - 1] {
        let moved = |d: f64| {
            let mut r = row.clone();
            r[idx] += d;
            eval(&snap, &r)
        };
        check(
            &format!("head[{idx}]"),
            head_grad[idx],
            (moved(eps) - moved(-eps)) / (2.0 * eps),
        );
    }
    for (i, (name, var)) in model.vars().iter().enumerate() {
        let Some(g) = graph.get(var.as_tensor()) else {
            continue;
        };
        let analytic: Vec<f64> = g.flatten_all().unwrap().to_vec1().unwrap();
        let idx = (i * 7919 + 13) % analytic.len();
        let numeric = (eval(&with_entry(&snap, name, idx, eps), &row)
            - eval(&with_entry(&snap, name, idx, -eps), &row))
            / (2.0 * eps);
        check(&format!("{name}[{idx}]"), analytic[idx], numeric);
    }
}
