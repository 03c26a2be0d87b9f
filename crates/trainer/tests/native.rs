//! The candle trainer on the tiny preset: a bandit it learns, skipped all-zero batches,
//! publishing without aliasing, the supervised step, exact resumption from a checkpoint, the
//! lag-0 train/inference mismatch, and (`native/same_steps.rs`) micro-batch accumulation,
//! recomputed activations, kept logits and shared prompts taking the same steps,
//! (`native/threads.rs`) steps that do not depend on the thread count, (`native/refusals.rs`)
//! corrupt checkpoints and non-finite steps refused, (`native/bonus.rs`) the entropy bonus,
//! (`native/lora.rs`) LoRA adapters, (`native/critic.rs`) PPO with a critic, and
//! (`native/kl_reward.rs`) the KL penalty in the reward.

#[path = "native/bonus.rs"]
mod bonus;
mod common;
#[path = "native/critic.rs"]
mod critic;
#[path = "native/kl_reward.rs"]
mod kl_reward;
#[path = "native/lora.rs"]
mod lora;
#[path = "native/refusals.rs"]
mod refusals;
#[path = "native/same_steps.rs"]
mod same_steps;
#[path = "native/threads.rs"]
mod threads;

use std::sync::Arc;

use candle_core::{DType, Device};
use common::{group, turn};
use sluice_core::metrics as m;
use sluice_core::{PolicyVersion, RolloutGroup, TrainerBackend};
use sluice_model::presets::{Preset, preset_config, random_snapshot};
use sluice_model::{ForwardOptions, ModelWeights, PackedBatch};
use sluice_trainer::advantage::AdvantageConfig;
use sluice_trainer::batcher::BatcherConfig;
use sluice_trainer::config::{AdvantageKind, LossAggregation, LossKind, OversizedText};
use sluice_trainer::loss::{Aggregation, LossConfig};
use sluice_trainer::optim::OptimConfig;
use sluice_trainer::{NativeTrainer, NativeTrainerConfig, SupervisedExample};

fn tiny(seed: u64) -> Arc<ModelWeights> {
    let config = Arc::new(preset_config(Preset::Tiny));
    Arc::new(random_snapshot(config, seed, DType::F32, &Device::Cpu).unwrap())
}

fn config(lr: f64, rows: usize) -> NativeTrainerConfig {
    NativeTrainerConfig {
        advantage: AdvantageConfig {
            kind: AdvantageKind::Group,
            ..AdvantageConfig::default()
        },
        loss: LossConfig::default(),
        aggregation: Aggregation::new(LossAggregation::TokenMean, 1),
        batcher: BatcherConfig {
            rows,
            row_len: 16,
            oversized: OversizedText::Split,
            pad_id: 0,
            share_prompts: true,
        },
        optim: OptimConfig {
            learning_rate: lr,
            total_steps: 100,
            ..OptimConfig::default()
        },
        minibatches: 1,
        publish_dtype: DType::F32,
        device: sluice_core::config::Device::Cpu,
        logits_chunk_rows: 64,
        kept_logits_bytes: ForwardOptions::DEFAULT_KEPT_LOGITS_BYTES,
        temperature: 1.0,
        seed: 7,
        lora: None,
        kl_reward: None,
        critic: None,
        threads: 1,
        activation_checkpointing: false,
        sync_parts: false,
        compute_dtype: DType::F32,
    }
}

/// [`config`] with the decoupled loss, two minibatches a step and a KL reference: every
/// forward a step can take runs (the update's, the proximal policy's, the reference's).
fn decoupled_with_reference(rows: usize) -> NativeTrainerConfig {
    let mut c = config(0.01, rows);
    c.minibatches = 2;
    c.loss.kind = LossKind::DecoupledPpo;
    c.loss.kl_coef = 0.1;
    c
}

/// Next-token distribution after `prompt` under the trainer's current weights.
fn next_token_probs(trainer: &NativeTrainer, prompt: &[u32]) -> Vec<f32> {
    let batch = PackedBatch::from_rows(&[vec![prompt]], prompt.len(), 0).unwrap();
    let logits = trainer.model().logits(&batch).unwrap();
    let last: Vec<f32> = logits
        .squeeze(0)
        .unwrap()
        .get(prompt.len() - 1)
        .unwrap()
        .to_vec1()
        .unwrap();
    let max = last.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
    let exp: Vec<f32> = last.iter().map(|x| (x - max).exp()).collect();
    let z: f32 = exp.iter().sum();
    exp.iter().map(|e| e / z).collect()
}

/// A fixed batch: two groups of four single-turn rollouts with varied rewards.
fn fixed_batch() -> Vec<RolloutGroup> {
    let mk = |c: u64, base: u32| {
        let turns = (0..4u32)
            .map(|i| {
                vec![turn(
                    &[10, 11, 12 + base],
                    &[20 + i, 30 + i, 40],
                    -3.0 - i as f32 * 0.1,
                    0,
                    None,
                )]
            })
            .collect();
        group(c, &[1.0, 0.0, 0.5, 0.2], turns)
    };
    vec![mk(1, 0), mk(2, 5)]
}

fn params(trainer: &NativeTrainer) -> Vec<Vec<f32>> {
    trainer
        .model()
        .vars()
        .iter()
        .map(|(_, v)| v.as_tensor().flatten_all().unwrap().to_vec1().unwrap())
        .collect()
}

#[test]
fn a_one_step_bandit_learns_the_rewarded_answer() {
    let mut trainer = NativeTrainer::new(tiny(1), config(0.01, 4), None).unwrap();
    let prompt = [40u32, 41, 42, 43];
    let answers = [5u32, 6, 7, 8];
    let rewarded = answers[2];
    let start = next_token_probs(&trainer, &prompt)[rewarded as usize];
    let mut lcg = 12345u64;
    let mut skipped = 0;
    for step in 0..30u64 {
        let probs = next_token_probs(&trainer, &prompt);
        // Sample 8 answers from the policy restricted to the four arms.
        let arm_mass: f32 = answers.iter().map(|&a| probs[a as usize]).sum();
        let mut groups = Vec::new();
        let mut turns = Vec::new();
        let mut rewards = Vec::new();
        for _ in 0..8 {
            lcg = lcg
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            let u = (lcg >> 40) as f32 / (1u64 << 24) as f32 * arm_mass;
            let mut acc = 0.0;
            let mut pick = answers[3];
            for &a in &answers {
                acc += probs[a as usize];
                if u < acc {
                    pick = a;
                    break;
                }
            }
            let v = trainer.version().0;
            turns.push(vec![turn(
                &prompt,
                &[pick],
                probs[pick as usize].ln(),
                v,
                None,
            )]);
            rewards.push(if pick == rewarded { 1.0 } else { 0.0 });
        }
        groups.push(group(step, &rewards, turns));
        let out = trainer.train_step(&groups).unwrap();
        if out.weights.is_none() {
            skipped += 1;
            assert!(out.metrics.contains_key(m::TRAINER_SKIPPED_STEPS));
        } else {
            // Behaviour log-probs of the very weights the step starts from: no mismatch.
            let lp = |name: &str| out.metrics[name];
            assert_eq!(lp(m::TRAINER_MISMATCH_COMPARED_TOKENS), 8.0);
            assert!(
                lp(m::TRAINER_MISMATCH_LOGPROB_ABS_MEAN_NATS) < 1e-4,
                "{:?}",
                out.metrics
            );
        }
    }
    let end = next_token_probs(&trainer, &prompt)[rewarded as usize];
    assert!(skipped < 30);
    assert!(
        end > 0.25 && end > 10.0 * start,
        "p(rewarded) went from {start} to {end}"
    );
}

#[test]
fn an_all_zero_batch_is_skipped_and_publishes_nothing() {
    let mut trainer = NativeTrainer::new(tiny(2), config(0.01, 4), None).unwrap();
    let before = params(&trainer);
    let mut batch = fixed_batch();
    for g in &mut batch {
        for r in &mut g.rollouts {
            r.reward = 1.0;
        }
    }
    let out = trainer.train_step(&batch).unwrap();
    assert!(out.weights.is_none());
    assert_eq!(out.trained_tokens, 0);
    assert_eq!(trainer.version(), PolicyVersion(0));
    assert_eq!(params(&trainer), before, "no update");
    assert_eq!(out.metrics.get(m::TRAINER_SKIPPED_STEPS), Some(&1.0));
}

#[test]
fn published_snapshots_are_copies_that_later_steps_cannot_change() {
    let mut trainer = NativeTrainer::new(tiny(3), config(0.01, 4), None).unwrap();
    let out = trainer.train_step(&fixed_batch()).unwrap();
    let envelope = out.weights.expect("published");
    assert_eq!(envelope.version, PolicyVersion(1));
    assert_eq!(trainer.version(), PolicyVersion(1));
    let v1 = ModelWeights::from_envelope(&envelope).unwrap();
    let name = "model.embed_tokens.weight";
    let frozen: Vec<f32> = v1
        .require(name)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1()
        .unwrap();
    for key in [
        m::TRAINER_LOSS_VALUE,
        m::TRAINER_GRAD_NORM_VALUE,
        m::TRAINER_ENTROPY_NATS,
        m::TRAINER_PACKING_EFFICIENCY_RATIO,
    ] {
        assert!(out.metrics[key].is_finite(), "{key}");
    }
    assert_eq!(out.trained_tokens, 24);
    trainer.train_step(&fixed_batch()).unwrap();
    let after: Vec<f32> = v1
        .require(name)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1()
        .unwrap();
    assert_eq!(frozen, after, "version 1 did not move");
    let live: Vec<f32> = trainer
        .model()
        .var(name)
        .unwrap()
        .as_tensor()
        .flatten_all()
        .unwrap()
        .to_vec1()
        .unwrap();
    assert_ne!(live, frozen, "the parameters did move");
    assert_eq!(trainer.snapshot().version, PolicyVersion(2));
}

#[test]
fn supervised_steps_lower_the_cross_entropy() {
    let mut trainer = NativeTrainer::new(tiny(5), config(0.01, 2), None).unwrap();
    let (prompt, completion) = ([10u32, 11, 12], [50u32, 51, 52, 53]);
    let examples = [SupervisedExample {
        prompt: &prompt,
        completion: &completion,
    }];
    let (first, snap) = trainer.supervised_step(&examples).unwrap();
    assert_eq!(snap.version, PolicyVersion(1));
    let mut last = first.loss.loss;
    for _ in 0..10 {
        last = trainer.supervised_step(&examples).unwrap().0.loss.loss;
    }
    assert!(
        first.loss.loss > 3.0,
        "starts near ln(vocab): {}",
        first.loss.loss
    );
    assert!(last < first.loss.loss * 0.5, "{} → {last}", first.loss.loss);
    assert_eq!(trainer.version(), PolicyVersion(11));
}

#[test]
fn resuming_from_a_checkpoint_is_exact() {
    let mut cfg = config(0.01, 4);
    cfg.optim.warmup_steps = 2;
    cfg.optim.weight_decay = 0.01;
    let mut straight = NativeTrainer::new(tiny(6), cfg.clone(), None).unwrap();
    for _ in 0..4 {
        straight.train_step(&fixed_batch()).unwrap();
    }
    let dir = tempfile::tempdir().unwrap();
    let ckpt = dir.path().join("checkpoint");
    let mut first = NativeTrainer::new(tiny(6), cfg.clone(), None).unwrap();
    for _ in 0..2 {
        first.train_step(&fixed_batch()).unwrap();
    }
    first.checkpoint(&ckpt).unwrap();
    drop(first);
    for f in [
        "model/config.json",
        "model/model.safetensors",
        "optimizer.safetensors",
        "trainer_state.json",
    ] {
        assert!(ckpt.join(f).exists(), "{f}");
    }
    // A fresh trainer from different initial weights, restored, continues identically.
    let mut resumed = NativeTrainer::new(tiny(99), cfg, None).unwrap();
    resumed.restore(&ckpt).unwrap();
    assert_eq!(resumed.version(), PolicyVersion(2));
    for _ in 0..2 {
        resumed.train_step(&fixed_batch()).unwrap();
    }
    assert_eq!(resumed.version(), straight.version());
    assert_eq!(params(&resumed), params(&straight), "bit-identical weights");
    let state: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(ckpt.join("trainer_state.json")).unwrap())
            .unwrap();
    assert_eq!(state["step"], 2);
    assert_eq!(state["optimizer_step"], 2);
}

#[test]
fn the_kl_penalty_is_measured_against_the_frozen_initial_weights() {
    let mut cfg = config(0.01, 4);
    cfg.loss.kl_coef = 0.1;
    let mut trainer = NativeTrainer::new(tiny(8), cfg, None).unwrap();
    let first = trainer.train_step(&fixed_batch()).unwrap();
    // The first step starts from the reference itself.
    assert!(first.metrics[m::TRAINER_KL_NATS].abs() < 1e-6);
    let second = trainer.train_step(&fixed_batch()).unwrap();
    assert!(
        second.metrics[m::TRAINER_KL_NATS] > 1e-6,
        "the policy moved away from the reference"
    );
    let plain = trainer.train_step(&fixed_batch()).unwrap();
    assert!(plain.metrics.contains_key(m::TRAINER_KL_NATS));
}

#[test]
fn set_version_relabels_the_weights_without_changing_them() {
    let mut trainer = NativeTrainer::new(tiny(7), config(0.01, 4), None).unwrap();
    trainer.train_step(&fixed_batch()).unwrap();
    let before = params(&trainer);
    trainer.set_version(PolicyVersion(9)).unwrap();
    assert_eq!(trainer.version(), PolicyVersion(9));
    assert_eq!(
        trainer.snapshot().version,
        PolicyVersion(9),
        "published under the new number"
    );
    assert_eq!(params(&trainer), before, "same weights");
    let err = trainer.set_version(PolicyVersion(3)).unwrap_err();
    assert_eq!(err.kind, "version_backwards");
    trainer.train_step(&fixed_batch()).unwrap();
    assert_eq!(
        trainer.version(),
        PolicyVersion(10),
        "training continues from the new number"
    );
}

#[test]
fn minibatches_take_an_update_each_and_clip_against_the_step_start() {
    let mut one = config(0.05, 4);
    one.loss = LossConfig {
        kind: LossKind::DecoupledPpo,
        ..LossConfig::default()
    };
    let mut two = one.clone();
    two.minibatches = 2;
    let mut single = NativeTrainer::new(tiny(4), one, None).unwrap();
    let mut split = NativeTrainer::new(tiny(4), two, None).unwrap();
    let (s1, _) = single.rl_step(&fixed_batch()).unwrap();
    let (s2, w2) = split.rl_step(&fixed_batch()).unwrap();
    // Two updates, one published version, the same tokens trained.
    assert_eq!(
        (single.optimizer_updates(), split.optimizer_updates()),
        (1, 2)
    );
    assert_eq!(
        (single.version(), split.version()),
        (PolicyVersion(1), PolicyVersion(1))
    );
    assert_eq!(w2.expect("published").version, PolicyVersion(1));
    assert_eq!((s1.trained_tokens, s2.trained_tokens), (24, 24));
    // Every token is version 0's, the weights the step starts from: all are compared with the
    // batch's made-up behaviour log-probs, by the first share's forward or by the proximal
    // log-probs taken at the start, so one and two updates measure the same mismatch.
    assert_eq!((s1.mismatch.tokens, s2.mismatch.tokens), (24, 24));
    let (a, b) = (
        s1.mismatch.abs_mean().unwrap(),
        s2.mismatch.abs_mean().unwrap(),
    );
    assert!(a > 0.1 && (a - b).abs() < 1e-4, "{a} vs {b}");
    assert!(s1.mismatch.kl().unwrap() > 0.0);
    // One update: the proximal policy is the current one, the ratio is 1, nothing is clipped.
    let clipped = |s: &sluice_trainer::report::StepStats| {
        let l = s.loss.summary();
        l.clip_low_fraction + l.clip_high_fraction
    };
    assert_eq!(clipped(&s1), 0.0);
    // Two: the second group is scored after the first update moved the weights, against the
    // step's starting policy, and the clip engages.
    assert!(clipped(&s2) > 0.0, "{:?}", s2.loss.summary());
    assert_ne!(params(&single), params(&split));
}

#[test]
fn a_step_whose_parts_wait_for_the_device_trains_the_same() {
    let batch = fixed_batch();
    let mut plain = NativeTrainer::new(tiny(3), config(0.01, 4), None).unwrap();
    let mut waiting = NativeTrainer::new(tiny(3), config(0.01, 4), None).unwrap();
    waiting.set_sync_parts(true);
    plain.rl_step(&batch).unwrap();
    let (stats, _) = waiting.rl_step(&batch).unwrap();
    assert_eq!(params(&plain), params(&waiting), "waiting changes no value");
    let p = stats.parts;
    assert!(
        p.forward > 0.0 && p.backward > 0.0 && p.optimizer > 0.0,
        "{p:?}"
    );
    let sum: f64 = p.named().iter().map(|(_, s)| s).sum();
    assert!(
        sum <= stats.seconds,
        "parts {sum} s of a {} s step",
        stats.seconds
    );
}

/// Mixed precision on the CPU (`compute_dtype = bf16`, f32 masters): the products on AMX
/// tiles where the CPU has them, else the parameters converted once per update and read by
/// each of its micro-batches, and converted again after every optimizer update. Two updates a step (the second clips against the first's moved
/// weights only if it reads them), several micro-batches each, two steps (the second's
/// gradient norm is 40 times smaller, and 0.5 with the first's weights): the gradients stay
/// within bf16's rounding of the f32 trainer's (measured: 4 % at most), and the clip engages.
#[test]
fn bf16_compute_converts_the_weights_once_per_update_and_follows_them() {
    // The KL reference's frozen weights are converted once, for every step.
    let mut f32s = decoupled_with_reference(1);
    f32s.batcher.share_prompts = false;
    let mut bf16s = f32s.clone();
    bf16s.compute_dtype = DType::BF16;
    let mut exact = NativeTrainer::new(tiny(8), f32s, None).unwrap();
    let mut mixed = NativeTrainer::new(tiny(8), bf16s, None).unwrap();
    for step in 0..2 {
        let (se, _) = exact.rl_step(&fixed_batch()).unwrap();
        let (sm, _) = mixed.rl_step(&fixed_batch()).unwrap();
        assert_eq!(sm.micro_batches, se.micro_batches);
        assert!(sm.micro_batches >= 2, "{} micro-batches", sm.micro_batches);
        let (ge, gm) = (se.optim.unwrap().grad_norm, sm.optim.unwrap().grad_norm);
        assert!(
            (ge - gm).abs() <= 0.1 * ge,
            "step {step}: grad norm f32 {ge} vs bf16 {gm}"
        );
        let clipped = |s: &sluice_trainer::report::StepStats| {
            let l = s.loss.summary();
            l.clip_low_fraction + l.clip_high_fraction
        };
        assert!(clipped(&se) > 0.0 && clipped(&sm) > 0.0, "step {step}");
        let (le, lm) = (se.loss.summary().loss, sm.loss.summary().loss);
        assert!(
            (le - lm).abs() <= 0.1 * le.abs(),
            "step {step}: loss {le} vs {lm}"
        );
    }
    assert_ne!(
        params(&exact),
        params(&mixed),
        "the bf16 trainer computed in f32"
    );
}
