//! Steps that mix one-token inputs with prompt chunks, and the cache trait's default batched
//! append (what a new cache implementation starts from): the same logits as full forwards and
//! as the fast caches. And the same steps with bf16 products (AMX tiles): near the f32 logits,
//! following weight swaps.

mod common;

use std::sync::Arc;

use candle_core::{DType, Tensor};
use common::{ALL_ARCHS, reference_logits, rel_err, snapshot, tiny_config};
use sluice_model::{
    ContiguousKvCache, ForwardOptions, InferenceModel, KvCache, LogitsWanted, PackedBatch,
    StepInput, TrainableModel,
};

/// A cache that only implements per-sequence appends, so decode steps and prompt batches go
/// through the trait's default `append_ragged` (what a new cache implementation starts from).
struct PerSequence(ContiguousKvCache);

impl KvCache for PerSequence {
    fn seq_len(&self, seq: u64) -> usize {
        self.0.seq_len(seq)
    }
    fn append(
        &mut self,
        seq: u64,
        layer: usize,
        k: &Tensor,
        v: &Tensor,
    ) -> sluice_model::Result<(Tensor, Tensor)> {
        self.0.append(seq, layer, k, v)
    }
    fn remove(&mut self, seq: u64) -> bool {
        self.0.remove(seq)
    }
    fn num_sequences(&self) -> usize {
        self.0.num_sequences()
    }
    fn num_tokens(&self) -> usize {
        self.0.num_tokens()
    }
}

#[test]
fn default_batched_decode_of_the_cache_trait_matches_the_fast_one() {
    let snap = Arc::new(snapshot(
        tiny_config(sluice_model::Architecture::Qwen3, false),
        8,
        DType::F32,
    ));
    let model = InferenceModel::new(Arc::clone(&snap)).unwrap();
    let mut fast = ContiguousKvCache::new(model.config(), DType::F32, snap.device());
    let mut slow = PerSequence(ContiguousKvCache::new(
        model.config(),
        DType::F32,
        snap.device(),
    ));
    let prompts: [&[u32]; 3] = [&[1, 2, 3], &[4, 5, 6, 7, 8, 9], &[10]];
    let prefill = StepInput::numbered(&prompts);
    model.step(&mut fast, &prefill, LogitsWanted::Last).unwrap();
    model.step(&mut slow, &prefill, LogitsWanted::Last).unwrap();
    for token in [11u32, 12, 13] {
        let one = [token];
        let decode: Vec<StepInput<'_>> = (0..3)
            .map(|s| StepInput {
                seq: s,
                tokens: &one,
            })
            .collect();
        let a = model.step(&mut fast, &decode, LogitsWanted::Last).unwrap();
        let b = model.step(&mut slow, &decode, LogitsWanted::Last).unwrap();
        assert!(rel_err(&a, &b) <= 1e-6);
    }
    assert_eq!(slow.seq_len(1), 9);
}

/// A step mixing one-token inputs with prompt chunks of similar lengths at different positions:
/// the chunks share one padded attention batch (queries padded to the longest chunk, keys to
/// the longest sequence), and every row equals the full forward, whatever the cache.
#[test]
fn padded_prompt_batches_in_a_mixed_step_match_full_forwards() {
    for arch in ALL_ARCHS {
        let snap = Arc::new(snapshot(tiny_config(arch, false), 4, DType::F32));
        let reference = TrainableModel::from_snapshot(&snap, DType::F32).unwrap();
        let model = InferenceModel::new(Arc::clone(&snap)).unwrap();
        // Cached first, then added in one step: prompt chunks of 8, 7, 8, 7 tokens on 4, 5, 4
        // and 6 cached ones (one batch: 416 padded scores against 367), and two sequences
        // adding one token each, listed between them.
        let (first, then) = ([4usize, 5, 4, 6, 9, 3], [8usize, 7, 8, 7, 1, 1]);
        let seqs: Vec<Vec<u32>> = (0..6)
            .map(|s| {
                (0..first[s] + then[s])
                    .map(|i| ((i * 5 + s * 7 + 2) % 23) as u32)
                    .collect()
            })
            .collect();
        let order = [0usize, 4, 1, 2, 5, 3];
        let cache = |kind: usize| -> Box<dyn KvCache> {
            let (config, device) = (model.config(), snap.device());
            match kind {
                0 => Box::new(ContiguousKvCache::new(config, DType::F32, device)),
                1 => Box::new(
                    sluice_model::PagedKvCache::new(config, DType::F32, device, 64, 4).unwrap(),
                ),
                _ => Box::new(PerSequence(ContiguousKvCache::new(
                    config,
                    DType::F32,
                    device,
                ))),
            }
        };
        for (kind, wanted) in (0..3).flat_map(|k| [(k, LogitsWanted::All), (k, LogitsWanted::Last)])
        {
            let mut cache = cache(kind);
            let head: Vec<StepInput<'_>> = (0..6)
                .map(|s| StepInput {
                    seq: s as u64,
                    tokens: &seqs[s][..first[s]],
                })
                .collect();
            model
                .step(cache.as_mut(), &head, LogitsWanted::Last)
                .unwrap();
            let step: Vec<StepInput<'_>> = order
                .iter()
                .map(|&s| StepInput {
                    seq: s as u64,
                    tokens: &seqs[s][first[s]..],
                })
                .collect();
            let got = model.step(cache.as_mut(), &step, wanted).unwrap();
            let mut row = 0;
            for &s in &order {
                let full = reference_logits(&reference, &seqs[s]);
                let (want, n) = match wanted {
                    LogitsWanted::All => (full.narrow(0, first[s], then[s]).unwrap(), then[s]),
                    LogitsWanted::Last => (full.narrow(0, seqs[s].len() - 1, 1).unwrap(), 1),
                };
                let err = rel_err(&got.narrow(0, row, n).unwrap(), &want);
                assert!(
                    err <= 1e-5,
                    "{arch:?} cache {kind} {wanted:?} seq {s}: relative error {err:e}"
                );
                row += n;
            }
            assert_eq!(got.dim(0).unwrap(), row);
            for (s, tokens) in seqs.iter().enumerate() {
                assert_eq!(cache.seq_len(s as u64), tokens.len());
            }
        }
    }
}

/// Prefill of three prompts, then three decode steps; every step's logits.
fn prefill_and_decode(model: &InferenceModel) -> Vec<Tensor> {
    let mut cache = ContiguousKvCache::new(model.config(), DType::F32, model.snapshot().device());
    let prompts: [&[u32]; 3] = [&[1, 2, 3, 4, 5], &[6, 7, 8, 9, 10, 11, 12, 13, 14], &[15]];
    let mut out = vec![
        model
            .step(
                &mut cache,
                &StepInput::numbered(&prompts),
                LogitsWanted::All,
            )
            .unwrap(),
    ];
    for t in 0..3u32 {
        let next: Vec<[u32; 1]> = (0..3).map(|s| [(t * 3 + s + 2) % 23]).collect();
        out.push(
            model
                .step(&mut cache, &StepInput::numbered(&next), LogitsWanted::Last)
                .unwrap(),
        );
    }
    out
}

#[test]
fn bf16_products_stay_near_f32_and_follow_weight_swaps() {
    if !sluice_model::amx::available() {
        eprintln!("no AMX tiles on this machine: bf16 compute is refused here, checked below");
        let snap = Arc::new(snapshot(tiny_config(ALL_ARCHS[0], true), 2, DType::F32));
        let mut model = InferenceModel::new(snap).unwrap();
        let err = model.set_compute_dtype(DType::BF16).unwrap_err();
        assert!(err.to_string().contains("AMX"), "{err}");
        return;
    }
    for arch in ALL_ARCHS {
        for tied in [true, false] {
            let snap = Arc::new(snapshot(tiny_config(arch, tied), 4, DType::F32));
            let exact = InferenceModel::new(Arc::clone(&snap)).unwrap();
            let mut tiles = InferenceModel::new(Arc::clone(&snap)).unwrap();
            tiles.set_compute_dtype(DType::BF16).unwrap();
            assert_eq!(tiles.compute_dtype(), DType::BF16);
            for (step, (a, b)) in prefill_and_decode(&exact)
                .iter()
                .zip(&prefill_and_decode(&tiles))
                .enumerate()
            {
                let err = rel_err(a, b);
                // bf16 operands keep 8 bits: a few 2⁻⁹ of relative error through the layers;
                // zero would mean the tiles never ran.
                assert!(
                    err > 0.0 && err < 3e-2,
                    "{arch:?} tied={tied} step {step}: {err}"
                );
            }
            // A swap repacks: the swapped model computes exactly what a fresh one on the new
            // weights does.
            let changed = Arc::new(snapshot(tiny_config(arch, tied), 9, DType::F32));
            tiles.swap_weights(Arc::clone(&changed)).unwrap();
            let mut fresh = InferenceModel::new(Arc::clone(&changed)).unwrap();
            fresh.set_compute_dtype(DType::BF16).unwrap();
            for (a, b) in prefill_and_decode(&tiles)
                .iter()
                .zip(&prefill_and_decode(&fresh))
            {
                assert_eq!(rel_err(a, b), 0.0, "{arch:?} tied={tied}");
            }
            // And back to f32 products: the exact logits again.
            tiles.set_compute_dtype(DType::F32).unwrap();
            assert_eq!(tiles.compute_dtype(), DType::F32);
            let exact = InferenceModel::new(changed).unwrap();
            for (a, b) in prefill_and_decode(&tiles)
                .iter()
                .zip(&prefill_and_decode(&exact))
            {
                assert_eq!(rel_err(a, b), 0.0, "{arch:?} tied={tied}");
            }
        }
    }
}

/// A trainer computing in bf16 on AMX tiles (`trainer.compute_dtype = "bf16"` on the CPU)
/// rounds the operands the engine's bf16 products round: its log-probs of a prompt are far
/// nearer the bf16 engine's than the f32 trainer's are. That gap is the train/inference
/// mismatch of a run whose engine computes in bf16.
#[test]
fn a_bf16_trainer_scores_what_the_bf16_engine_computes() {
    if !sluice_model::amx::available() {
        eprintln!("no AMX tiles on this machine: neither side rounds its products here");
        return;
    }
    let tokens = [3u32, 7, 1, 9, 12, 4, 4, 20, 8, 2, 5, 6, 11];
    let batch = PackedBatch::from_rows(&[vec![&tokens[..]]], tokens.len(), 0).unwrap();
    for arch in ALL_ARCHS {
        let snap = Arc::new(snapshot(tiny_config(arch, false), 6, DType::F32));
        let mut engine = InferenceModel::new(Arc::clone(&snap)).unwrap();
        engine.set_compute_dtype(DType::BF16).unwrap();
        let mut cache = ContiguousKvCache::new(engine.config(), DType::F32, snap.device());
        let rows = [&tokens[..]];
        let prompt = StepInput::numbered(&rows);
        let logits = engine.step(&mut cache, &prompt, LogitsWanted::All).unwrap();
        let logits: Vec<Vec<f32>> = logits.to_vec2().unwrap();
        // log softmax at each next token, in f64.
        let engine_lp: Vec<f64> = logits
            .iter()
            .zip(&tokens[1..])
            .map(|(row, &next)| {
                let max = row.iter().fold(f32::MIN, |a, &b| a.max(b));
                let sum: f64 = row.iter().map(|&v| f64::from(v - max).exp()).sum();
                f64::from(row[next as usize] - max) - sum.ln()
            })
            .collect();
        let trainer = |compute: DType| -> Vec<f32> {
            let mut model = TrainableModel::from_snapshot(&snap, DType::F32).unwrap();
            model.set_compute_dtype(compute).unwrap();
            let scores = model.token_scores(&batch, ForwardOptions::default());
            scores
                .unwrap()
                .logprobs
                .flatten_all()
                .unwrap()
                .to_vec1()
                .unwrap()
        };
        let gap = |lp: &[f32]| {
            let pairs = engine_lp.iter().zip(lp);
            pairs.fold(0f64, |m, (a, &b)| m.max((a - f64::from(b)).abs()))
        };
        let (same, f32_gap) = (gap(&trainer(DType::BF16)), gap(&trainer(DType::F32)));
        eprintln!(
            "{arch:?}: bf16 trainer {same:.2e}, f32 trainer {f32_gap:.2e} from the bf16 engine"
        );
        assert!(
            f32_gap > 0.0 && same < f32_gap / 10.0,
            "{arch:?}: log-probs {same:e} from the bf16 engine's, the f32 trainer's {f32_gap:e}"
        );
    }
}
