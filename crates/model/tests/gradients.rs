//! The training forward is differentiable end to end: every parameter gets a finite, non-zero
//! gradient, and gradients match central finite differences in f64; so do those of the
//! critic's value head (`gradients/value_head.rs`).

mod common;
#[path = "gradients/value_head.rs"]
mod value_head;

use std::collections::HashMap;
use std::sync::Arc;

use candle_core::{DType, Tensor};
use common::{ALL_ARCHS, rel_err, snapshot, tiny_config};
use sluice_model::ops::Kernels;
use sluice_model::{
    Activations, ForwardOptions, ModelWeights, PackedBatch, TokenScores, TrainableModel,
};

/// Two rows, three sequences: packing is part of what is differentiated.
fn batch() -> PackedBatch {
    let a = [3u32, 7, 1, 9, 12];
    let b = [4u32, 4, 20];
    let c = [8u32, 2, 5, 6, 11, 0];
    PackedBatch::from_rows(&[vec![&a[..], &b[..]], vec![&c[..]]], 9, 0).unwrap()
}

/// A loss using both outputs: masked log-likelihood plus an entropy bonus, with chunked logits
/// (3 rows at a time) so the chunk boundaries are exercised too.
fn loss(model: &TrainableModel, batch: &PackedBatch) -> Tensor {
    loss_at(model, batch, 1.0)
}

/// The same with logits divided by `temperature`.
fn loss_at(model: &TrainableModel, batch: &PackedBatch, temperature: f64) -> Tensor {
    let options = ForwardOptions {
        logits_chunk_rows: 3,
        temperature,
        ..ForwardOptions::default()
    };
    loss_of(model.token_scores(batch, options).unwrap(), batch)
}

fn loss_of(scores: TokenScores, batch: &PackedBatch) -> Tensor {
    let dtype = scores.logprobs.dtype();
    let mask: Vec<f64> = batch
        .target_mask
        .iter()
        .map(|&m| f64::from(u8::from(m)))
        .collect();
    let mask = Tensor::from_vec(mask, (batch.batch, batch.seq_len), scores.logprobs.device())
        .unwrap()
        .to_dtype(dtype)
        .unwrap();
    let ll = (scores.logprobs * &mask).unwrap().sum_all().unwrap();
    let ent = (scores.entropy * &mask).unwrap().sum_all().unwrap();
    (ll + (ent * 0.3).unwrap()).unwrap()
}

#[test]
fn every_parameter_gets_a_finite_nonzero_gradient() {
    for arch in ALL_ARCHS {
        for tied in [true, false] {
            let snap = snapshot(tiny_config(arch, tied), 1, DType::F32);
            let model = TrainableModel::from_snapshot(&snap, DType::F32).unwrap();
            let grads = loss(&model, &batch()).backward().unwrap();
            for (name, var) in model.vars() {
                let g = grads
                    .get(var.as_tensor())
                    .unwrap_or_else(|| panic!("{arch:?} tied={tied}: no gradient for {name}"));
                let v: Vec<f32> = g.flatten_all().unwrap().to_vec1().unwrap();
                assert!(
                    v.iter().all(|x| x.is_finite()),
                    "{arch:?}: non-finite gradient for {name}"
                );
                let norm: f32 = v.iter().map(|x| x * x).sum::<f32>().sqrt();
                assert!(
                    norm > 1e-8,
                    "{arch:?} tied={tied}: zero gradient for {name}"
                );
            }
        }
    }
}

fn with_entry(snap: &ModelWeights, name: &str, flat_index: usize, delta: f64) -> ModelWeights {
    let mut map = HashMap::new();
    for (n, t) in snap.iter() {
        let t = if n == name {
            let mut v: Vec<f64> = t.flatten_all().unwrap().to_vec1().unwrap();
            v[flat_index] += delta;
            Tensor::from_vec(v, t.shape(), t.device()).unwrap()
        } else {
            t.clone()
        };
        map.insert(n.to_owned(), t);
    }
    ModelWeights::new(Arc::clone(snap.config()), snap.version, map).unwrap()
}

#[test]
fn gradients_match_finite_differences_in_f64() {
    let batch = batch();
    for arch in ALL_ARCHS {
        let tied = arch != common::ALL_ARCHS[0];
        let snap = snapshot(tiny_config(arch, tied), 2, DType::F64);
        let model = TrainableModel::from_snapshot(&snap, DType::F64).unwrap();
        // A temperature other than 1 on one architecture checks the 1/T in the backward.
        let temperature = if arch == ALL_ARCHS[1] { 0.7 } else { 1.0 };
        let grads = loss_at(&model, &batch, temperature).backward().unwrap();
        let eval = |s: &ModelWeights| {
            let m = TrainableModel::from_snapshot(s, DType::F64).unwrap();
            loss_at(&m, &batch, temperature).to_scalar::<f64>().unwrap()
        };
        let eps = 1e-6;
        for (i, (name, var)) in model.vars().iter().enumerate() {
            let n = var.as_tensor().elem_count();
            // One entry per tensor, spread over the tensor by a stride.
            let idx = (i * 7919 + 13) % n;
            let analytic: Vec<f64> = grads
                .get(var.as_tensor())
                .unwrap()
                .flatten_all()
                .unwrap()
                .to_vec1()
                .unwrap();
            let numeric = (eval(&with_entry(&snap, name, idx, eps))
                - eval(&with_entry(&snap, name, idx, -eps)))
                / (2.0 * eps);
            let a = analytic[idx];
            let tol = 1e-6 + 1e-5 * a.abs().max(numeric.abs());
            assert!(
                (a - numeric).abs() <= tol,
                "{arch:?} {name}[{idx}]: analytic {a:e} vs numeric {numeric:e}"
            );
        }
    }
}

/// The layers' backward written by hand, on kept and on recomputed activations, gives the
/// gradients of candle's autograd over the forward's whole graph, for every architecture (q/k/v
/// biases, q/k norms, tied and untied heads), in f32 and in f64.
#[test]
fn the_hand_written_layer_backward_gives_the_graphs_gradients() {
    let options = ForwardOptions {
        logits_chunk_rows: 3,
        temperature: 0.7,
        ..ForwardOptions::default()
    };
    for (dtype, tol) in [(DType::F32, 1e-5), (DType::F64, 1e-12)] {
        for arch in ALL_ARCHS {
            for tied in [true, false] {
                let snap = snapshot(tiny_config(arch, tied), 5, dtype);
                let mut model = TrainableModel::from_snapshot(&snap, dtype).unwrap();
                let batch = batch();
                // The reference: candle's autograd over the forward's whole graph.
                model.set_hand_backward(false);
                let (graph_scores, saved) = model
                    .token_scores_for_backward(&batch, options, Activations::Kept)
                    .unwrap();
                assert!(format!("{saved:?}").contains("the forward's graph"));
                let graph = model
                    .backward_saved(&loss_of(graph_scores.clone(), &batch), saved)
                    .unwrap();
                model.set_hand_backward(true);
                for activations in [Activations::Kept, Activations::Recomputed] {
                    let case = format!("{dtype:?} {arch:?} tied={tied} {activations:?}");
                    let (scores, saved) = model
                        .token_scores_for_backward(&batch, options, activations)
                        .unwrap();
                    assert!(format!("{saved:?}").contains(match activations {
                        Activations::Kept => "every layer's activations",
                        Activations::Recomputed => "each layer's input",
                    }));
                    // The forward itself is the same computation.
                    assert!(
                        rel_err(&graph_scores.logprobs, &scores.logprobs) < tol,
                        "{case}"
                    );
                    assert!(
                        rel_err(&graph_scores.entropy, &scores.entropy) < tol,
                        "{case}"
                    );
                    let by_hand = model
                        .backward_saved(&loss_of(scores, &batch), saved)
                        .unwrap();
                    for (name, var) in model.vars() {
                        let a = graph.get(var.as_tensor()).unwrap();
                        let b = by_hand
                            .get(var.as_tensor())
                            .unwrap_or_else(|| panic!("{case}: no gradient for {name}"));
                        let err = rel_err(a, b);
                        assert!(err < tol, "{case}: {name}: relative error {err}");
                    }
                }
            }
        }
    }
}

/// The logits the forward keeps for the backward (`ForwardOptions::kept_logits_bytes`: all,
/// the first chunk's, none) give the gradients of logits formed again, to the bit, on the
/// fused CPU kernels and on the composition (f32 and bf16 compute); the backward forms again
/// exactly the chunks the forward did not keep.
#[test]
fn kept_logits_give_the_recomputed_gradients_to_the_bit() {
    let batch = batch();
    let chunks = (batch.batch * batch.seq_len).div_ceil(3) as u64;
    for (kernels, compute) in [
        (Kernels::Custom, DType::F32),
        (Kernels::Differentiable, DType::F32),
        (Kernels::Custom, DType::BF16),
        (Kernels::Differentiable, DType::BF16),
    ] {
        let snap = snapshot(tiny_config(ALL_ARCHS[1], false), 9, DType::F32);
        let mut model = TrainableModel::from_snapshot(&snap, DType::F32).unwrap();
        model.set_kernels(kernels).unwrap();
        model.set_compute_dtype(compute).unwrap();
        // One chunk: 3 rows of the 23-token vocabulary in the dtype of the forward's tensors
        // (f32 where bf16's products run on AMX tiles).
        let tiles = kernels == Kernels::Custom && sluice_model::amx::available();
        let logits = if tiles { DType::F32 } else { compute };
        let chunk = 3 * 23 * logits.size_in_bytes();
        let gradients = |kept_logits_bytes: usize| {
            let options = ForwardOptions {
                logits_chunk_rows: 3,
                temperature: 0.8,
                kept_logits_bytes,
            };
            let (scores, saved) = model
                .token_scores_for_backward(&batch, options, Activations::Kept)
                .unwrap();
            let before = sluice_model::recomputed_logit_chunks();
            let grads = model
                .backward_saved(&loss_of(scores, &batch), saved)
                .unwrap();
            let recomputed = sluice_model::recomputed_logit_chunks() - before;
            let values: Vec<Vec<f32>> = (model.vars().iter())
                .map(|(_, v)| {
                    let g = grads.get(v.as_tensor()).unwrap();
                    g.flatten_all()
                        .unwrap()
                        .to_dtype(DType::F32)
                        .unwrap()
                        .to_vec1()
                        .unwrap()
                })
                .collect();
            (values, recomputed)
        };
        let case = format!("{kernels:?} {compute:?}");
        let (formed_again, n) = gradients(0);
        assert_eq!(n, chunks, "{case}: every chunk formed again");
        for (budget, expect) in [(chunk + chunk / 2, chunks - 1), (usize::MAX, 0)] {
            let (kept, n) = gradients(budget);
            assert_eq!(
                n, expect,
                "{case}: chunks formed again with {budget} bytes kept"
            );
            assert!(kept == formed_again, "{case}: {budget} bytes kept");
        }
    }
}

#[test]
fn a_loss_that_ignores_the_model_is_refused_by_the_recomputed_backward() {
    let snap = snapshot(tiny_config(ALL_ARCHS[0], true), 5, DType::F32);
    let model = TrainableModel::from_snapshot(&snap, DType::F32).unwrap();
    let (_, saved) = model
        .token_scores_recomputable(&batch(), ForwardOptions::default())
        .unwrap();
    let unrelated = model.vars()[0].1.as_tensor().sum_all().unwrap();
    let err = model.backward_saved(&unrelated, saved).unwrap_err();
    assert!(err.to_string().contains("does not depend"), "{err}");
}

/// Mixed precision (`trainer.compute_dtype = "bf16"`): the loss and every parameter's gradient
/// of a bf16-compute step stay within bf16's rounding of the f32 step on the same batch, the
/// gradients land on the f32 masters in f32, and plain and recomputed backward agree. On the
/// fused kernels where the CPU has AMX (the products on the tiles, every tensor f32: nothing
/// converted), and on the composition (every tensor bf16 but the statistics).
#[test]
fn a_bf16_compute_step_matches_the_f32_step_within_bf16_rounding() {
    let options = ForwardOptions {
        logits_chunk_rows: 3,
        temperature: 0.7,
        ..ForwardOptions::default()
    };
    let batch = batch();
    let cases = ALL_ARCHS.into_iter().flat_map(|arch| {
        [true, false].into_iter().flat_map(move |tied| {
            [Kernels::Custom, Kernels::Differentiable].map(|kernels| (arch, tied, kernels))
        })
    });
    for (arch, tied, kernels) in cases {
        let snap = snapshot(tiny_config(arch, tied), 3, DType::F32);
        let f32_model = TrainableModel::from_snapshot(&snap, DType::F32).unwrap();
        let mut bf16_model = TrainableModel::from_snapshot(&snap, DType::F32).unwrap();
        bf16_model.set_kernels(kernels).unwrap();
        bf16_model.set_compute_dtype(DType::BF16).unwrap();
        assert_eq!(bf16_model.compute_dtype(), DType::BF16);
        assert_eq!(bf16_model.dtype(), DType::F32);
        let tiles = kernels == Kernels::Custom && sluice_model::amx::available();
        assert_eq!(
            bf16_model.step_weight_params().is_empty(),
            tiles,
            "{kernels:?}: weights converted for the forward"
        );

        let reference = loss_of(f32_model.token_scores(&batch, options).unwrap(), &batch);
        let mixed_scores = bf16_model.token_scores(&batch, options).unwrap();
        // Log-probs and entropies come out in f32 whatever the products ran in.
        assert_eq!(mixed_scores.logprobs.dtype(), DType::F32);
        let mixed = loss_of(mixed_scores, &batch);
        let (a, b) = (scalar(&reference), scalar(&mixed));
        // bf16 keeps 8 significant bits (relative rounding 2^-9 ≈ 2e-3 per product);
        // measured: the loss within 1.2e-3, gradients within 3.9e-2 (median 1.7e-2).
        assert!(
            (a - b).abs() <= 5e-3 * a.abs(),
            "{arch:?} tied={tied} {kernels:?}: loss f32 {a} vs bf16 {b}"
        );
        assert!(
            (a - b).abs() > 0.0,
            "{arch:?} {kernels:?}: the bf16 step computed in f32"
        );

        let exact = reference.backward().unwrap();
        let grads = mixed.backward().unwrap();
        let (recomputed_scores, saved) = bf16_model
            .token_scores_recomputable(&batch, options)
            .unwrap();
        let recomputed = bf16_model
            .backward_saved(&loss_of(recomputed_scores, &batch), saved)
            .unwrap();
        for ((name, var), (_, var32)) in bf16_model.vars().iter().zip(f32_model.vars()) {
            let g = grads.get(var.as_tensor()).unwrap();
            assert_eq!(g.dtype(), DType::F32, "{name}: gradient dtype");
            let want = exact.get(var32.as_tensor()).unwrap();
            let err = norm_rel_err(want, g);
            assert!(
                err < 5e-2,
                "{arch:?} tied={tied} {kernels:?}: {name}: gradient off by {err} of its norm"
            );
            let again = recomputed.get(var.as_tensor()).unwrap();
            assert!(rel_err(g, again) < 1e-5, "{name}: recomputed backward");
        }
    }
}

/// Converting the parameters once for a step (`set_step_weights`) changes nothing but where the
/// gradients land: the loss is the per-forward conversion's bit for bit, and each parameter's
/// gradients (the master's and its copy's, summed in f32) are the ones the conversion's backward
/// gives the master, in the plain and the recomputed backward. Only a tied embedding's master
/// still gets a gradient of its own (its rows are gathered from the master table).
#[test]
fn weights_converted_once_per_step_give_the_per_forward_gradients() {
    let options = ForwardOptions {
        logits_chunk_rows: 3,
        temperature: 0.7,
        ..ForwardOptions::default()
    };
    let batch = batch();
    for arch in ALL_ARCHS {
        for tied in [true, false] {
            let snap = snapshot(tiny_config(arch, tied), 5, DType::F32);
            let mut model = TrainableModel::from_snapshot(&snap, DType::F32).unwrap();
            assert!(
                model.step_weight_params().is_empty(),
                "f32 compute: nothing to convert"
            );
            // The composition's forward, whose tensors are bf16 (on AMX tiles, the fused
            // kernels' stay f32 and nothing is converted).
            model.set_kernels(Kernels::Differentiable).unwrap();
            model.set_compute_dtype(DType::BF16).unwrap();
            let params = model.step_weight_params();
            assert_eq!(params.len(), model.vars().len() - usize::from(!tied));

            let each = loss_of(model.token_scores(&batch, options).unwrap(), &batch);
            let want = each.backward().unwrap();
            let (scores, saved) = model.token_scores_recomputable(&batch, options).unwrap();
            let want_recomputed = model
                .backward_saved(&loss_of(scores, &batch), saved)
                .unwrap();

            let converted: Vec<Tensor> = params
                .iter()
                .map(|&i| model.vars()[i].1.as_tensor().to_dtype(DType::BF16).unwrap())
                .collect();
            model.set_step_weights(converted).unwrap();
            assert!(model.has_step_weights());
            let once = loss_of(model.token_scores(&batch, options).unwrap(), &batch);
            assert_eq!(
                scalar(&once).to_bits(),
                scalar(&each).to_bits(),
                "{arch:?}: loss"
            );
            let got = once.backward().unwrap();
            let (scores, saved) = model.token_scores_recomputable(&batch, options).unwrap();
            let got_recomputed = model
                .backward_saved(&loss_of(scores, &batch), saved)
                .unwrap();
            for (store, reference, how) in [
                (&got, &want, "plain"),
                (&got_recomputed, &want_recomputed, "recomputed"),
            ] {
                let grads = model.parameter_gradients(store);
                for (i, (name, var)) in model.vars().iter().enumerate() {
                    let mine: Vec<&Tensor> = grads
                        .iter()
                        .filter(|(j, _)| *j == i)
                        .map(|(_, g)| g)
                        .collect();
                    // The embedding's rows are gathered from the master; a tied one is also
                    // read whole, from its copy, as the LM head.
                    let embedding = name == "model.embed_tokens.weight";
                    assert_eq!(
                        mine.len(),
                        1 + usize::from(embedding && tied),
                        "{name}: {how}"
                    );
                    if !embedding {
                        assert!(store.get(var.as_tensor()).is_none(), "{name}: master used");
                        assert_eq!(mine[0].dtype(), DType::BF16, "{name}: the copy's gradient");
                    }
                    let sum = mine
                        .iter()
                        .map(|g| g.to_dtype(DType::F32).unwrap())
                        .reduce(|a, b| (a + b).unwrap())
                        .unwrap();
                    let expected = reference.get(var.as_tensor()).unwrap();
                    assert_eq!(
                        sum.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
                        expected.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
                        "{arch:?} tied={tied}: {name}: {how} backward"
                    );
                }
            }
            model.clear_step_weights();
            assert!(!model.has_step_weights());
            assert!(model.parameter_gradients(&got).len() < params.len());
        }
    }
}

#[test]
fn step_weights_of_the_wrong_count_dtype_or_shape_are_refused() {
    let snap = snapshot(tiny_config(ALL_ARCHS[0], false), 3, DType::F32);
    let mut model = TrainableModel::from_snapshot(&snap, DType::F32).unwrap();
    model.set_kernels(Kernels::Differentiable).unwrap();
    model.set_compute_dtype(DType::BF16).unwrap();
    let params = model.step_weight_params();
    let masters: Vec<Tensor> = params
        .iter()
        .map(|&i| model.vars()[i].1.as_tensor().clone())
        .collect();
    let first_name = model.vars()[params[0]].0.clone();
    let convert = |dtype: DType| -> Vec<Tensor> {
        masters.iter().map(|t| t.to_dtype(dtype).unwrap()).collect()
    };
    let mut short = convert(DType::BF16);
    short.pop();
    let err = model.set_step_weights(short).unwrap_err().to_string();
    assert!(err.contains("tensors for"), "{err}");
    let err = model
        .set_step_weights(convert(DType::F32))
        .unwrap_err()
        .to_string();
    assert!(err.contains("wanted BF16"), "{err}");
    let mut reshaped = convert(DType::BF16);
    reshaped[0] = reshaped[0].unsqueeze(0).unwrap();
    let err = model.set_step_weights(reshaped).unwrap_err().to_string();
    assert!(err.contains(&first_name), "{err}");
    assert!(!model.has_step_weights(), "a refused set leaves none");
    model.set_step_weights(convert(DType::BF16)).unwrap();
    model.set_compute_dtype(DType::F32).unwrap();
    assert!(!model.has_step_weights(), "a new compute dtype drops them");
}

#[test]
fn a_compute_dtype_wider_than_the_parameters_is_refused() {
    let snap = snapshot(tiny_config(ALL_ARCHS[0], true), 3, DType::F32);
    let mut model = TrainableModel::from_snapshot(&snap, DType::F32).unwrap();
    let err = model.set_compute_dtype(DType::F64).unwrap_err();
    assert!(err.to_string().contains("compute dtype"), "{err}");
    assert!(model.set_compute_dtype(DType::U32).is_err());
}

fn scalar(t: &Tensor) -> f64 {
    t.to_dtype(DType::F64).unwrap().to_scalar::<f64>().unwrap()
}

/// `‖a − b‖ / ‖a‖`.
fn norm_rel_err(a: &Tensor, b: &Tensor) -> f64 {
    let a = a.to_dtype(DType::F64).unwrap();
    let b = b.to_dtype(DType::F64).unwrap();
    let norm = |t: &Tensor| scalar(&t.sqr().unwrap().sum_all().unwrap()).sqrt();
    norm(&(&a - &b).unwrap()) / norm(&a).max(1e-30)
}
