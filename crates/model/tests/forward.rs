//! The inference path (KV cache, ragged batches, fused kernels) and the packed training path
//! agree with plain full forwards; weight snapshots never alias trainer parameters.

mod common;

use std::sync::Arc;

use candle_core::{DType, IndexOp, Tensor};
use common::{ALL_ARCHS, reference_logits, rel_err, snapshot, tiny_config};
use sluice_core::PolicyVersion;
use sluice_model::{
    ContiguousKvCache, ForwardOptions, InferenceModel, KvCache, LogitsWanted, PackedBatch,
    StepInput, TrainableModel,
};

#[test]
fn ragged_incremental_decode_matches_full_forward() {
    // Each architecture with a product per projection and with the products stacked (q/k/v
    // split and rotated in one pass, gate/up split by the activation).
    for (arch, stacked) in ALL_ARCHS.into_iter().flat_map(|a| [(a, false), (a, true)]) {
        let snap = Arc::new(snapshot(tiny_config(arch, true), 3, DType::F32));
        let reference = TrainableModel::from_snapshot(&snap, DType::F32).unwrap();
        let mut model = InferenceModel::new(Arc::clone(&snap)).unwrap();
        model.set_stacked_products(stacked).unwrap();
        let mut cache = ContiguousKvCache::new(model.config(), DType::F32, snap.device());
        // Six sequences of different lengths (one longer than the cache's first capacity, more
        // sequences than its first slot count, so both grow mid-run).
        let lens = [12usize, 10, 21, 5, 14, 18];
        let seqs: Vec<Vec<u32>> = lens
            .iter()
            .enumerate()
            .map(|(s, &n)| (0..n).map(|i| ((i * 7 + s * 5 + 3) % 23) as u32).collect())
            .collect();
        // (seq, tokens added) per step: prefills of different lengths mixed with one-token
        // decodes and multi-token extensions, all at different positions; then decode-only
        // steps (the batched path) where sequences drop out as they finish.
        let mut schedule: Vec<Vec<(usize, usize)>> = vec![
            vec![(0, 4), (1, 2)],
            vec![(0, 1), (1, 1), (2, 5)],
            vec![(2, 1), (0, 1)],
            vec![(1, 3), (2, 1), (0, 1), (3, 2)],
            vec![(0, 2), (2, 4), (1, 1), (4, 6), (5, 3)],
        ];
        let mut planned = [0usize; 6];
        for step in &schedule {
            for &(s, n) in step {
                planned[s] += n;
            }
        }
        while planned.iter().zip(&lens).any(|(p, l)| p < l) {
            let step: Vec<(usize, usize)> = (0..6)
                .filter(|&s| planned[s] < lens[s])
                .map(|s| (s, 1))
                .collect();
            for &(s, _) in &step {
                planned[s] += 1;
            }
            schedule.push(step);
        }
        let mut done = [0usize; 6];
        let mut got: [Vec<Tensor>; 6] = Default::default();
        for step in &schedule {
            let inputs: Vec<StepInput<'_>> = step
                .iter()
                .map(|&(s, n)| StepInput {
                    seq: s as u64 + 100,
                    tokens: &seqs[s][done[s]..done[s] + n],
                })
                .collect();
            let logits = model.step(&mut cache, &inputs, LogitsWanted::All).unwrap();
            let mut row = 0;
            for &(s, n) in step.iter() {
                got[s].push(logits.narrow(0, row, n).unwrap());
                row += n;
                done[s] += n;
            }
        }
        for s in 0..6 {
            assert_eq!(done[s], seqs[s].len());
            assert_eq!(cache.seq_len(s as u64 + 100), seqs[s].len());
            let incremental = Tensor::cat(&got[s], 0).unwrap();
            let full = reference_logits(&reference, &seqs[s]);
            let err = rel_err(&incremental, &full);
            assert!(
                err <= 1e-5,
                "{arch:?} (stacked: {stacked}) seq {s}: relative error {err:e}"
            );
        }
        // `Last` returns the final row of each input.
        let mut fresh = ContiguousKvCache::new(model.config(), DType::F32, snap.device());
        let inputs = [
            StepInput {
                seq: 1,
                tokens: &seqs[0][..],
            },
            StepInput {
                seq: 2,
                tokens: &seqs[1][..3],
            },
        ];
        let last = model.step(&mut fresh, &inputs, LogitsWanted::Last).unwrap();
        let full0 = reference_logits(&reference, &seqs[0]);
        assert!(rel_err(&last.i(0).unwrap(), &full0.i(seqs[0].len() - 1).unwrap()) <= 1e-5);
    }
}

#[test]
fn removing_a_sequence_leaves_the_others_intact() {
    let snap = Arc::new(snapshot(
        tiny_config(sluice_model::Architecture::Qwen2, true),
        4,
        DType::F32,
    ));
    let reference = TrainableModel::from_snapshot(&snap, DType::F32).unwrap();
    let model = InferenceModel::new(Arc::clone(&snap)).unwrap();
    let mut cache = ContiguousKvCache::new(model.config(), DType::F32, snap.device());
    let a = [3u32, 4, 5, 6];
    let b = [7u32, 8, 9];
    model
        .step(
            &mut cache,
            &[
                StepInput {
                    seq: 1,
                    tokens: &a[..3],
                },
                StepInput { seq: 2, tokens: &b },
            ],
            LogitsWanted::Last,
        )
        .unwrap();
    assert_eq!(cache.num_sequences(), 2);
    assert!(cache.remove(2));
    assert!(!cache.remove(2));
    assert_eq!(cache.num_sequences(), 1);
    assert_eq!(cache.num_tokens(), 3);
    let last = model
        .step(
            &mut cache,
            &[StepInput {
                seq: 1,
                tokens: &a[3..],
            }],
            LogitsWanted::Last,
        )
        .unwrap();
    let full = reference_logits(&reference, &a);
    assert!(rel_err(&last.i(0).unwrap(), &full.i(3).unwrap()) <= 1e-5);
    // A removed id starts over as a new sequence at position 0.
    model
        .step(
            &mut cache,
            &[StepInput {
                seq: 2,
                tokens: &b[..1],
            }],
            LogitsWanted::Last,
        )
        .unwrap();
    assert_eq!(cache.seq_len(2), 1);
}

#[test]
fn bad_step_inputs_are_refused() {
    let snap = Arc::new(snapshot(
        tiny_config(sluice_model::Architecture::Qwen2, true),
        4,
        DType::F32,
    ));
    let model = InferenceModel::new(Arc::clone(&snap)).unwrap();
    let mut cache = ContiguousKvCache::new(model.config(), DType::F32, snap.device());
    let oov = [23u32];
    let err = model
        .step(
            &mut cache,
            &[StepInput {
                seq: 1,
                tokens: &oov,
            }],
            LogitsWanted::Last,
        )
        .unwrap_err();
    assert_eq!(err.kind(), "invalid_input");
    let twice = [
        StepInput {
            seq: 1,
            tokens: &[1][..],
        },
        StepInput {
            seq: 1,
            tokens: &[2][..],
        },
    ];
    assert!(model.step(&mut cache, &twice, LogitsWanted::Last).is_err());
    let long = vec![1u32; 129];
    assert!(
        model
            .step(
                &mut cache,
                &[StepInput {
                    seq: 3,
                    tokens: &long
                }],
                LogitsWanted::Last
            )
            .is_err()
    );
    assert_eq!(
        cache.num_sequences(),
        0,
        "refused steps must not touch the cache"
    );
}

#[test]
fn packed_forward_equals_separate_forwards() {
    for arch in ALL_ARCHS {
        let snap = snapshot(tiny_config(arch, false), 5, DType::F32);
        let model = TrainableModel::from_snapshot(&snap, DType::F32).unwrap();
        let seqs: [&[u32]; 3] = [&[1, 2, 3, 4, 5], &[9, 8, 7], &[4, 4, 21, 0, 6, 2]];
        let packed =
            PackedBatch::from_rows(&[vec![seqs[0], seqs[1]], vec![seqs[2]]], 10, 0).unwrap();
        let scores = model
            .token_scores(
                &packed,
                ForwardOptions {
                    logits_chunk_rows: 4,
                    ..ForwardOptions::default()
                },
            )
            .unwrap();
        let places = [(0, 0), (0, 5), (1, 0)];
        for (seq, (row, start)) in seqs.iter().zip(places) {
            let alone = PackedBatch::from_rows(&[vec![*seq]], seq.len(), 0).unwrap();
            let single = model
                .token_scores(&alone, ForwardOptions::default())
                .unwrap();
            for (what, packed_t, single_t) in [
                ("logprobs", &scores.logprobs, &single.logprobs),
                ("entropy", &scores.entropy, &single.entropy),
            ] {
                let p = packed_t
                    .i(row)
                    .unwrap()
                    .narrow(0, start, seq.len())
                    .unwrap();
                let s = single_t.i(0).unwrap();
                let err = rel_err(&p, &s);
                assert!(err <= 1e-5, "{arch:?} {what}: relative error {err:e}");
            }
        }
        // Log-probs are those of the full logits at the target ids.
        let logits = model.logits(&packed).unwrap();
        let lsm = candle_nn_free_log_softmax(&logits);
        let want: f32 = lsm.i((0, 1, 3)).unwrap().to_scalar().unwrap();
        let got: f32 = scores.logprobs.i((0, 1)).unwrap().to_scalar().unwrap();
        assert!((want - got).abs() < 1e-5, "{want} vs {got}");
    }
}

fn candle_nn_free_log_softmax(logits: &Tensor) -> Tensor {
    let max = logits.max_keepdim(2).unwrap();
    let shifted = logits.broadcast_sub(&max).unwrap();
    let lse = shifted
        .exp()
        .unwrap()
        .sum_keepdim(2)
        .unwrap()
        .log()
        .unwrap();
    shifted.broadcast_sub(&lse).unwrap()
}

#[test]
fn weight_swap_takes_effect_and_published_snapshots_do_not_alias_vars() {
    let config = tiny_config(sluice_model::Architecture::Qwen3, true);
    let snap0 = Arc::new(snapshot(config.clone(), 6, DType::F32));
    let trainer = TrainableModel::from_snapshot(&snap0, DType::F32).unwrap();
    let published = Arc::new(trainer.snapshot(PolicyVersion(1), None).unwrap());
    let name = "model.layers.0.mlp.up_proj.weight";
    let before: Vec<f32> = published
        .get(name)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1()
        .unwrap();
    // An optimizer step writes the Var in place…
    let var = trainer.var(name).unwrap();
    var.set(&(var.as_tensor() * 3.0).unwrap()).unwrap();
    // …which must reach neither the published snapshot nor the one the trainer started from.
    let after: Vec<f32> = published
        .get(name)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1()
        .unwrap();
    assert_eq!(before, after);
    let orig: Vec<f32> = snap0
        .get(name)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1()
        .unwrap();
    assert_eq!(before, orig);

    let changed = Arc::new(trainer.snapshot(PolicyVersion(2), None).unwrap());
    let tokens = [3u32, 1, 4, 1, 5];
    let run = |model: &InferenceModel| {
        let mut cache =
            ContiguousKvCache::new(model.config(), DType::F32, &candle_core::Device::Cpu);
        model
            .step(
                &mut cache,
                &[StepInput {
                    seq: 0,
                    tokens: &tokens,
                }],
                LogitsWanted::All,
            )
            .unwrap()
    };
    // With the products stacked, so the swap must rebuild the stacked gate/up weights too.
    let stacked = |snap: &Arc<sluice_model::ModelWeights>| {
        let mut m = InferenceModel::new(Arc::clone(snap)).unwrap();
        m.set_stacked_products(true).unwrap();
        m
    };
    let mut engine = stacked(&published);
    let old = run(&engine);
    engine.swap_weights(Arc::clone(&changed)).unwrap();
    assert_eq!(engine.version(), PolicyVersion(2));
    let swapped = run(&engine);
    let fresh = run(&stacked(&changed));
    assert!(rel_err(&swapped, &fresh) == 0.0);
    assert!(
        rel_err(&swapped, &old) > 1e-3,
        "new weights must change the logits"
    );
    let other = Arc::new(snapshot(
        tiny_config(sluice_model::Architecture::Qwen2, true),
        6,
        DType::F32,
    ));
    assert!(
        engine.swap_weights(other).is_err(),
        "a different architecture is refused"
    );
}

#[test]
fn snapshots_travel_in_the_core_envelope_without_copies() {
    let snap = Arc::new(snapshot(
        tiny_config(sluice_model::Architecture::Llama, true),
        1,
        DType::F32,
    ));
    let envelope = snap.with_version(PolicyVersion(4));
    let envelope = Arc::new(envelope).to_envelope();
    assert_eq!(envelope.version, PolicyVersion(4));
    let back = sluice_model::ModelWeights::from_envelope(&envelope).unwrap();
    assert_eq!(back.version, PolicyVersion(4));
    assert!(
        sluice_model::ModelWeights::from_envelope(&sluice_core::WeightSnapshot::version_only(
            PolicyVersion(1)
        ))
        .is_none()
    );
}

#[test]
fn model_types_can_move_to_compute_threads() {
    fn send_sync<T: Send + Sync>() {}
    fn send<T: Send>() {}
    send_sync::<sluice_model::ModelWeights>();
    send_sync::<InferenceModel>();
    send_sync::<sluice_model::Tokenizer>();
    send_sync::<sluice_model::ChatTemplate>();
    send::<TrainableModel>();
    send::<ContiguousKvCache>();
    send::<Box<dyn KvCache>>();
}

#[test]
fn half_precision_paths_track_f32() {
    for dtype in [DType::BF16, DType::F16] {
        let config = tiny_config(sluice_model::Architecture::Qwen2, true);
        let full = Arc::new(snapshot(config.clone(), 9, DType::F32));
        let half = Arc::new(full.to(&candle_core::Device::Cpu, dtype).unwrap());
        assert_eq!(half.dtype(), dtype);
        let tokens = [3u32, 9, 4, 17, 2, 8];
        let run = |snap: &Arc<sluice_model::ModelWeights>| {
            let model = InferenceModel::new(Arc::clone(snap)).unwrap();
            let mut cache = ContiguousKvCache::new(model.config(), snap.dtype(), snap.device());
            let first = model
                .step(
                    &mut cache,
                    &[StepInput {
                        seq: 0,
                        tokens: &tokens[..4],
                    }],
                    LogitsWanted::All,
                )
                .unwrap();
            let rest = model
                .step(
                    &mut cache,
                    &[
                        StepInput {
                            seq: 0,
                            tokens: &tokens[4..5],
                        },
                        StepInput {
                            seq: 1,
                            tokens: &tokens[..1],
                        },
                    ],
                    LogitsWanted::Last,
                )
                .unwrap();
            Tensor::cat(&[first, rest], 0).unwrap()
        };
        let err = rel_err(&run(&half), &run(&full));
        assert!(err < 5e-2, "{dtype:?} inference: relative error {err:e}");
        // The stacked products' split kernels take f32 and f64 on the CPU: refused, by name.
        let mut model = InferenceModel::new(Arc::clone(&half)).unwrap();
        let refused = model.set_stacked_products(true).unwrap_err().to_string();
        assert!(refused.contains("no split kernels for"), "{refused}");
        model.set_stacked_products(false).unwrap();
        // Training in half precision: log-probs stay close and finite.
        let batch = PackedBatch::from_rows(&[vec![&tokens[..]]], 8, 0).unwrap();
        let score = |snap: &sluice_model::ModelWeights, dt| {
            let m = TrainableModel::from_snapshot(snap, dt).unwrap();
            m.token_scores(&batch, ForwardOptions::default())
                .unwrap()
                .logprobs
        };
        let err = rel_err(&score(&half, dtype), &score(&full, DType::F32));
        assert!(err < 5e-2, "{dtype:?} training: relative error {err:e}");
    }
}

#[test]
fn temperature_scales_the_scored_distribution() {
    let snap = snapshot(
        tiny_config(sluice_model::Architecture::Llama, false),
        10,
        DType::F32,
    );
    let model = TrainableModel::from_snapshot(&snap, DType::F32).unwrap();
    let seq = [5u32, 1, 12, 7];
    let batch = PackedBatch::from_rows(&[vec![&seq[..]]], 4, 0).unwrap();
    let options = ForwardOptions {
        temperature: 0.5,
        ..ForwardOptions::default()
    };
    let scores = model.token_scores(&batch, options).unwrap();
    let scaled = (model.logits(&batch).unwrap() / 0.5).unwrap();
    let lsm = candle_nn_free_log_softmax(&scaled);
    for i in 0..3 {
        let want: f32 = lsm
            .i((0, i, seq[i + 1] as usize))
            .unwrap()
            .to_scalar()
            .unwrap();
        let got: f32 = scores.logprobs.i((0, i)).unwrap().to_scalar().unwrap();
        assert!((want - got).abs() < 1e-5, "slot {i}: {want} vs {got}");
    }
    for bad in [0.0, -1.0, f64::NAN] {
        let options = ForwardOptions {
            temperature: bad,
            ..ForwardOptions::default()
        };
        assert!(model.token_scores(&batch, options).is_err());
    }
}
