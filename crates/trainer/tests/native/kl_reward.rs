//! The KL penalty in the reward (`trainer.kl_in_reward`) through the candle trainer (part of
//! the `native` test binary): the step's KL is the engine's log-probs against the frozen
//! initial weights', the adaptive coefficient moves by the controller's rule and resumes from a
//! checkpoint, and the penalised rewards move advantages that the rewards alone leave at 0.

use super::*;
use sluice_trainer::config::KlEstimator;
use sluice_trainer::kl_reward::KlRewardConfig;

fn with_kl(coef: f64, target: Option<f64>) -> NativeTrainerConfig {
    let mut c = config(0.01, 4);
    c.kl_reward = Some(KlRewardConfig {
        coef,
        target,
        horizon: 10.0,
        estimator: KlEstimator::K1,
    });
    c
}

/// The mean over [`fixed_batch`]'s rollouts of each one's mean `behaviour − log π(token)` under
/// `weights`.
fn batch_kl(weights: &Arc<ModelWeights>) -> f64 {
    batch_kl_by(weights, KlEstimator::K1)
}

/// [`batch_kl`] with each token's log-ratio through `estimator`.
fn batch_kl_by(weights: &Arc<ModelWeights>, estimator: KlEstimator) -> f64 {
    let model = sluice_model::TrainableModel::from_snapshot(weights, DType::F32).unwrap();
    let mut sum = 0.0;
    let mut rollouts = 0;
    for g in fixed_batch() {
        for r in &g.rollouts {
            let t = &r.turns[0];
            let text: Vec<u32> = t
                .prompt_token_ids
                .iter()
                .chain(&t.completion_token_ids)
                .copied()
                .collect();
            let batch = PackedBatch::from_rows(&[vec![&text[..]]], text.len(), 0).unwrap();
            let scores = model
                .token_scores(&batch, ForwardOptions::default())
                .unwrap();
            let lp: Vec<f32> = scores.logprobs.flatten_all().unwrap().to_vec1().unwrap();
            let p = t.prompt_token_ids.len();
            let k: Vec<f64> = (0..t.completion_tokens())
                .map(|c| estimator.at(f64::from(t.logprobs[c]) - f64::from(lp[p - 1 + c])))
                .collect();
            sum += k.iter().sum::<f64>() / k.len() as f64;
            rollouts += 1;
        }
    }
    sum / f64::from(rollouts)
}

#[test]
fn the_step_kl_is_against_the_initial_weights_and_the_coefficient_adapts() {
    let target = 0.5;
    let mut trainer = NativeTrainer::new(tiny(31), with_kl(0.2, Some(target)), None).unwrap();
    let expected = batch_kl(&tiny(31));
    let steps: Vec<_> = (0..3)
        .map(|_| trainer.train_step(&fixed_batch()).unwrap().metrics)
        .collect();
    let (coef, kl) = (
        m::TRAINER_KL_IN_REWARD_COEF_VALUE,
        m::TRAINER_KL_IN_REWARD_NATS,
    );
    assert!(
        (steps[0][kl] - expected).abs() < 1e-4,
        "step KL {} against {expected} by hand",
        steps[0][kl]
    );
    // The behaviour log-probs are fixed and the reference frozen: every step sees that KL.
    assert!((steps[2][kl] - expected).abs() < 1e-4);
    assert_eq!(steps[0][coef], 0.2);
    // β ← β·(1 + clip(KL/KL* − 1, ±0.2)·n/H), n = 8 rollouts, H = 10.
    let factor = 1.0 + (expected / target - 1.0).clamp(-0.2, 0.2) * 8.0 / 10.0;
    assert!(
        (factor - 1.0).abs() > 0.1,
        "a KL away from the target: {expected}"
    );
    for (s, metrics) in steps.iter().enumerate() {
        let want = 0.2 * factor.powi(s as i32);
        assert!(
            (metrics[coef] - want).abs() < 1e-9,
            "step {s}: β {} against {want}",
            metrics[coef]
        );
    }
    // Without a target it stays.
    let mut fixed = NativeTrainer::new(tiny(31), with_kl(0.2, None), None).unwrap();
    for _ in 0..2 {
        fixed.train_step(&fixed_batch()).unwrap();
    }
    let last = fixed.train_step(&fixed_batch()).unwrap().metrics;
    assert_eq!(last[coef], 0.2);
}

#[test]
fn penalised_rewards_give_advantages_where_the_rewards_alone_give_none() {
    let equal = || {
        let mut batch = fixed_batch();
        for g in &mut batch {
            for r in &mut g.rollouts {
                r.reward = 1.0;
            }
        }
        batch
    };
    let unfiltered = |mut c: NativeTrainerConfig| {
        c.advantage.filter_zero_advantage = false;
        c
    };
    let grad = m::TRAINER_GRAD_NORM_VALUE;
    let mut plain = NativeTrainer::new(tiny(32), unfiltered(config(0.01, 4)), None).unwrap();
    let out = plain.train_step(&equal()).unwrap();
    assert_eq!(out.metrics[grad], 0.0, "equal rewards: no signal");
    let mut penalised = NativeTrainer::new(tiny(32), unfiltered(with_kl(1.0, None)), None).unwrap();
    let out = penalised.train_step(&equal()).unwrap();
    assert!(out.metrics[grad] > 0.0, "{:?}", out.metrics);
}

#[test]
fn the_adaptive_coefficient_resumes_from_a_checkpoint() {
    let cfg = with_kl(0.2, Some(0.5));
    let mut straight = NativeTrainer::new(tiny(33), cfg.clone(), None).unwrap();
    let mut last = None;
    for _ in 0..3 {
        last = Some(straight.train_step(&fixed_batch()).unwrap().metrics);
    }
    let dir = tempfile::tempdir().unwrap();
    let ckpt = dir.path().join("checkpoint");
    let mut first = NativeTrainer::new(tiny(33), cfg.clone(), None).unwrap();
    for _ in 0..2 {
        first.train_step(&fixed_batch()).unwrap();
    }
    first.checkpoint(&ckpt).unwrap();
    let state: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(ckpt.join("trainer_state.json")).unwrap())
            .unwrap();
    assert!(
        state["kl_in_reward_coef"].as_f64().unwrap() != 0.2,
        "{state}"
    );
    let mut resumed = NativeTrainer::new(tiny(33), cfg, None).unwrap();
    resumed.restore(&ckpt).unwrap();
    let after = resumed.train_step(&fixed_batch()).unwrap().metrics;
    let coef = m::TRAINER_KL_IN_REWARD_COEF_VALUE;
    assert_eq!(after[coef], last.unwrap()[coef]);
    assert_eq!(params(&resumed), params(&straight), "bit-identical weights");
}

#[test]
fn the_penalty_takes_the_configured_estimate_of_each_token() {
    for estimator in [KlEstimator::K2, KlEstimator::K3] {
        let mut c = with_kl(0.2, None);
        c.kl_reward.as_mut().unwrap().estimator = estimator;
        let mut trainer = NativeTrainer::new(tiny(31), c, None).unwrap();
        let got = trainer.train_step(&fixed_batch()).unwrap().metrics[m::TRAINER_KL_IN_REWARD_NATS];
        let expected = batch_kl_by(&tiny(31), estimator);
        assert!(
            (got - expected).abs() < 1e-4 * (1.0 + expected.abs()),
            "{estimator:?}: step KL {got} against {expected} by hand"
        );
        assert!(
            (expected - batch_kl(&tiny(31))).abs() > 1e-3,
            "{estimator:?} differs from k1 here"
        );
    }
}
