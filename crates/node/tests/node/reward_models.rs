//! A reward model loaded for the rubric's `reward_model` function as a run loads it
//! (`sluice_node::reward_models::in_process`): rollouts scored at the same moment from many
//! threads (a group finishing) share forwards and each gets its own conversation's score, the
//! one the model gives that conversation alone; one over `max_tokens` fails alone.

use std::sync::{Arc, Barrier};

use sluice_core::Message;
use sluice_data::config::RewardModelConfig;
use sluice_model::RewardModel;
use sluice_model::candle::Device;
use sluice_model::presets::{Preset, preset_config, write_reward_preset};

fn conversation(i: usize) -> Vec<Message> {
    vec![
        Message::user(format!("What is {i} + {}?", 3 * i)),
        Message::assistant(format!("{}{}", "so ".repeat(i % 5), 4 * i)),
    ]
}

#[test]
fn concurrent_scores_share_forwards_and_each_is_its_own_conversations() {
    let dir = tempfile::tempdir().unwrap();
    let hidden = preset_config(Preset::Tiny).hidden_size;
    let head: Vec<f32> = (0..hidden).map(|i| (i % 9) as f32 * 0.02 - 0.08).collect();
    write_reward_preset(Preset::Tiny, dir.path(), 4, &head).unwrap();
    let config = RewardModelConfig {
        path: dir.path().display().to_string(),
        device: sluice_core::config::Device::Cpu,
        max_tokens: 60,
        sigmoid: false,
    };
    let load = sluice_node::reward_models::in_process();
    let scorer = load(&config).unwrap();

    let n = 12;
    let barrier = Arc::new(Barrier::new(n));
    let threads: Vec<_> = (0..n)
        .map(|i| {
            let (scorer, barrier) = (Arc::clone(&scorer), Arc::clone(&barrier));
            std::thread::spawn(move || {
                barrier.wait();
                scorer.score(&conversation(i))
            })
        })
        .collect();
    let scores: Vec<f64> = threads
        .into_iter()
        .map(|t| t.join().unwrap().unwrap())
        .collect();

    let alone = RewardModel::load(dir.path(), &Device::Cpu).unwrap();
    for (i, score) in scores.iter().enumerate() {
        let tokens = alone.tokens(&conversation(i)).unwrap();
        let expected = f64::from(alone.score_tokens(&[tokens]).unwrap()[0]);
        assert!(
            (score - expected).abs() < 1e-5 * (1.0 + expected.abs()),
            "conversation {i}: {score} vs {expected} alone"
        );
    }
    assert!(scores.windows(2).any(|w| w[0] != w[1]), "{scores:?}");

    // Over max_tokens: that one call fails, naming the key; the model still scores.
    let long = vec![Message::user("x".repeat(80)), Message::assistant("y")];
    let e = scorer.score(&long).unwrap_err();
    assert!(e.contains("reward_model.max_tokens = 60"), "{e}");
    let again = scorer.score(&conversation(3)).unwrap();
    assert!((again - scores[3]).abs() < 1e-5 * (1.0 + again.abs()));
}
