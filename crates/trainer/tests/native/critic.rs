//! PPO with a critic (`advantage = "gae"`) through the candle trainer (part of the `native` test
//! binary): the critic learns the returns, a group of equal rewards still trains, and a resume
//! from a checkpoint, critic included, is exact; a checkpoint with a critic is refused by a run
//! without one, and a run with one starts it after a checkpoint without; a critic starts from a
//! classifier's directory (`trainer.critic_path`) with its head; a critic warm-up
//! (`trainer.critic_warmup`) holds the policy back, across a resume too.

use super::*;
use sluice_trainer::critic::CriticConfig;

fn gae_config(lr: f64) -> NativeTrainerConfig {
    let mut c = config(lr, 4);
    c.advantage.kind = AdvantageKind::Gae;
    c.critic = Some(CriticConfig {
        init: None,
        gamma: 1.0,
        lambda: 1.0,
        value_clip: 0.5,
        warmup_steps: 0,
        optim: OptimConfig {
            learning_rate: 0.001,
            ..c.optim
        },
    });
    c
}

#[test]
fn the_critic_learns_the_returns_and_every_step_trains_the_policy() {
    let mut trainer = NativeTrainer::new(tiny(21), gae_config(0.01), None).unwrap();
    let steps: Vec<_> = (0..12)
        .map(|_| trainer.train_step(&fixed_batch()).unwrap())
        .collect();
    let at = |s: usize, name: &str| steps[s].metrics[name];
    // The value head starts at zero: the first values are 0 and every return is the reward.
    assert_eq!(at(0, m::TRAINER_CRITIC_VALUES_MEAN_VALUE), 0.0);
    let mean_reward = (1.0 + 0.0 + 0.5 + 0.2) / 4.0;
    assert!((at(0, m::TRAINER_CRITIC_RETURNS_MEAN_VALUE) - mean_reward).abs() < 1e-6);
    assert!(at(0, m::TRAINER_CRITIC_EXPLAINED_VARIANCE_RATIO).abs() < 1e-6);
    for s in &steps {
        assert!(s.weights.is_some(), "every step publishes");
        assert_eq!(s.trained_tokens, 24);
    }
    let (first, last) = (
        at(0, m::TRAINER_CRITIC_LOSS_VALUE),
        at(11, m::TRAINER_CRITIC_LOSS_VALUE),
    );
    // 0.161 → 0.040 when written; the first completion token of a group can only learn its
    // group's mean reward, so the loss does not go to 0.
    assert!(last < 0.3 * first, "value loss {first} → {last}");
    let explained = at(11, m::TRAINER_CRITIC_EXPLAINED_VARIANCE_RATIO);
    assert!(explained > 0.3, "explained variance {explained}");
    assert!(at(11, m::TRAINER_CRITIC_GRAD_NORM_VALUE) > 0.0);
}

#[test]
fn a_group_of_equal_rewards_still_trains_the_critic() {
    let mut trainer = NativeTrainer::new(tiny(22), gae_config(0.01), None).unwrap();
    let mut batch = fixed_batch();
    for g in &mut batch {
        for r in &mut g.rollouts {
            r.reward = 1.0;
        }
    }
    assert!(trainer.config().advantage.filter_zero_advantage);
    let first = trainer.train_step(&batch).unwrap();
    assert!(first.weights.is_some(), "not skipped: {:?}", first.metrics);
    assert_eq!(first.trained_tokens, 24);
    let loss = |o: &sluice_core::TrainStepOutput| o.metrics[m::TRAINER_CRITIC_LOSS_VALUE];
    assert!(
        (loss(&first) - 0.5).abs() < 1e-6,
        "½·(0 − 1)²: {}",
        loss(&first)
    );
    let later = (0..5)
        .map(|_| trainer.train_step(&batch).unwrap())
        .last()
        .unwrap();
    assert!(
        loss(&later) < 0.5 * loss(&first),
        "{} → {}",
        loss(&first),
        loss(&later)
    );
}

#[test]
fn resuming_with_a_critic_is_exact_and_a_run_without_one_refuses_its_checkpoint() {
    let cfg = gae_config(0.01);
    let mut straight = NativeTrainer::new(tiny(23), cfg.clone(), None).unwrap();
    let mut last = None;
    for _ in 0..4 {
        last = Some(straight.train_step(&fixed_batch()).unwrap());
    }
    let dir = tempfile::tempdir().unwrap();
    let ckpt = dir.path().join("checkpoint");
    let mut first = NativeTrainer::new(tiny(23), cfg.clone(), None).unwrap();
    for _ in 0..2 {
        first.train_step(&fixed_batch()).unwrap();
    }
    first.checkpoint(&ckpt).unwrap();
    drop(first);
    for f in [
        "critic/model/model.safetensors",
        "critic/optimizer.safetensors",
        "critic/trainer_state.json",
        "critic/value_head.safetensors",
    ] {
        assert!(ckpt.join(f).exists(), "{f}");
    }
    let mut resumed = NativeTrainer::new(tiny(98), cfg.clone(), None).unwrap();
    resumed.restore(&ckpt).unwrap();
    let mut resumed_last = None;
    for _ in 0..2 {
        resumed_last = Some(resumed.train_step(&fixed_batch()).unwrap());
    }
    assert_eq!(params(&resumed), params(&straight), "bit-identical weights");
    let critic_figures = |o: &sluice_core::TrainStepOutput| {
        [
            m::TRAINER_CRITIC_LOSS_VALUE,
            m::TRAINER_CRITIC_VALUES_MEAN_VALUE,
        ]
        .map(|k| o.metrics[k])
    };
    assert_eq!(
        critic_figures(&resumed_last.unwrap()),
        critic_figures(&last.unwrap()),
        "the critic resumed where it was"
    );

    // A run without a critic refuses the checkpoint (it would drop the critic); a run with one
    // resumes a checkpoint without (a warm-up's, or another advantage's) and starts its critic
    // from the restored policy at the next step, as a run's first RL step does.
    let mut plain = NativeTrainer::new(tiny(23), config(0.01, 4), None).unwrap();
    let err = plain.restore(&ckpt).unwrap_err().to_string();
    assert!(
        err.contains("critic/") && err.contains("advantage"),
        "{err}"
    );
    let plain_ckpt = dir.path().join("plain");
    plain.train_step(&fixed_batch()).unwrap();
    plain.checkpoint(&plain_ckpt).unwrap();
    let mut gae = NativeTrainer::new(tiny(97), cfg, None).unwrap();
    gae.restore(&plain_ckpt).unwrap();
    let first = gae.train_step(&fixed_batch()).unwrap();
    assert_eq!(first.metrics[m::TRAINER_CRITIC_VALUES_MEAN_VALUE], 0.0);
    assert_eq!(gae.version(), PolicyVersion(2));
}

#[test]
fn a_critic_starts_from_a_classifier_directory_with_its_head() {
    // A reward model of the policy's own decoder (the same preset and seed) with a head of
    // mixed signs: the first step's values are that head over the policy's hidden states.
    let hidden = sluice_model::presets::preset_config(Preset::Tiny).hidden_size;
    let head: Vec<f32> = (0..hidden)
        .map(|i| ((i * 37 % 17) as f32 - 8.0) * 0.06)
        .collect();
    let dir = tempfile::tempdir().unwrap();
    sluice_model::presets::write_reward_preset(Preset::Tiny, dir.path(), 21, &head).unwrap();
    let mut c = gae_config(0.01);
    c.critic.as_mut().unwrap().init = Some(dir.path().to_owned());
    let mut trainer = NativeTrainer::new(tiny(21), c.clone(), None).unwrap();
    let step = trainer.train_step(&fixed_batch()).unwrap();

    // The values at each completion token's slot (the slot before it), each text alone.
    let policy = sluice_model::TrainableModel::from_snapshot(&tiny(21), DType::F32).unwrap();
    let head = candle_core::Tensor::from_slice(&head, (1, hidden), &Device::Cpu).unwrap();
    let mut values = Vec::new();
    for base in [0, 5] {
        for i in 0..4u32 {
            let text = [10, 11, 12 + base, 20 + i, 30 + i, 40];
            let batch = PackedBatch::from_rows(&[vec![&text[..]]], text.len(), 0).unwrap();
            let (v, _) = policy
                .values_for_backward(&batch, &head, sluice_model::Activations::Kept)
                .unwrap();
            let v: Vec<f32> = v.flatten_all().unwrap().to_vec1().unwrap();
            values.extend_from_slice(&v[2..5]);
        }
    }
    let expected = values.iter().map(|&v| f64::from(v)).sum::<f64>() / values.len() as f64;
    let got = step.metrics[m::TRAINER_CRITIC_VALUES_MEAN_VALUE];
    assert!(
        expected.abs() > 1e-3,
        "a head that reads something: {expected}"
    );
    assert!((got - expected).abs() < 1e-4, "{got} vs {expected}");

    // A directory that is not a classifier fails the first RL step, naming the key.
    let mut bad = c.clone();
    bad.critic.as_mut().unwrap().init = Some(dir.path().join("absent"));
    let mut trainer = NativeTrainer::new(tiny(21), bad, None).unwrap();
    let e = trainer.train_step(&fixed_batch()).unwrap_err().to_string();
    assert!(e.contains("trainer.critic_path"), "{e}");

    // A classifier of another vocabulary cannot read the policy's tokens: refused, naming both.
    let mut wider = preset_config(Preset::Tiny);
    wider.vocab_size += 5;
    let other = dir.path().join("wider");
    let snapshot = random_snapshot(Arc::new(wider), 1, DType::F32, &Device::Cpu).unwrap();
    sluice_model::save_checkpoint(&snapshot, &other, &Default::default()).unwrap();
    let file = other.join("model.safetensors");
    let mut tensors = candle_core::safetensors::load(&file, &Device::Cpu).unwrap();
    tensors.insert(
        "score.weight".into(),
        candle_core::Tensor::zeros((1, hidden), DType::F32, &Device::Cpu).unwrap(),
    );
    candle_core::safetensors::save(&tensors, &file).unwrap();
    let config_file = other.join("config.json");
    let mut config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&config_file).unwrap()).unwrap();
    config["architectures"] = serde_json::json!(["Qwen2ForTokenClassification"]);
    config["num_labels"] = serde_json::json!(1);
    std::fs::write(&config_file, config.to_string()).unwrap();
    let mut mismatched = c;
    mismatched.critic.as_mut().unwrap().init = Some(other);
    let mut trainer = NativeTrainer::new(tiny(21), mismatched, None).unwrap();
    let e = trainer.train_step(&fixed_batch()).unwrap_err().to_string();
    let policy = preset_config(Preset::Tiny).vocab_size;
    assert!(
        e.contains("trainer.critic_path")
            && e.contains(&format!("{} tokens, the policy {policy}", policy + 5)),
        "{e}"
    );
}

#[test]
fn a_critic_warm_up_trains_the_critic_alone_and_resumes_where_it_was() {
    let mut cfg = gae_config(0.01);
    cfg.critic.as_mut().unwrap().warmup_steps = 2;
    let mut trainer = NativeTrainer::new(tiny(24), cfg.clone(), None).unwrap();
    let before = params(&trainer);
    let dir = tempfile::tempdir().unwrap();
    let first = trainer.train_step(&fixed_batch()).unwrap();
    trainer.checkpoint(dir.path()).unwrap();
    // Two warm-up steps: the critic trains, the policy waits (nothing published).
    for out in [first, trainer.train_step(&fixed_batch()).unwrap()] {
        assert!(out.weights.is_none(), "{:?}", out.metrics);
        assert!(out.metrics[m::TRAINER_CRITIC_LOSS_VALUE] > 0.0);
    }
    assert_eq!(params(&trainer), before, "the policy waited");
    assert_eq!(trainer.version(), PolicyVersion(0));
    let third = trainer.train_step(&fixed_batch()).unwrap();
    assert!(third.weights.is_some());
    assert_ne!(params(&trainer), before);

    // Resumed after the first warm-up step: one more waits, then the policy trains, as above.
    let mut resumed = NativeTrainer::new(tiny(24), cfg, None).unwrap();
    resumed.restore(dir.path()).unwrap();
    assert!(
        resumed
            .train_step(&fixed_batch())
            .unwrap()
            .weights
            .is_none()
    );
    let out = resumed.train_step(&fixed_batch()).unwrap();
    assert!(out.weights.is_some());
    assert_eq!(params(&resumed), params(&trainer), "the same three steps");
}
