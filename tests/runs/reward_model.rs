//! A reward model as a run's reward (part of the `cli_run` test binary): the tiny model trains
//! on verl's GSM8K rows while a one-label classifier written beside it scores every reply, and
//! `sluice check` refuses a classifier of two labels naming the key and the field.

use std::process::Command;

use sluice_model::presets::{Preset, preset_config, write_reward_preset};

use super::runs;

/// A reward model of the tiny preset's shapes with a head of mixed signs, in `dir`.
fn reward_model(dir: &std::path::Path) {
    let hidden = preset_config(Preset::Tiny).hidden_size;
    let head: Vec<f32> = (0..hidden)
        .map(|i| ((i * 37 % 17) as f32 - 8.0) * 0.06)
        .collect();
    write_reward_preset(Preset::Tiny, dir, 3, &head).unwrap();
}

fn sets(rm: &std::path::Path, sigmoid: bool) -> Vec<String> {
    let mut sets = runs::verl_qa_sets();
    sets.extend([
        "data.domains.gsm8k.rubric.weights={ reward_model = 1.0 }".to_owned(),
        format!(
            "data.domains.gsm8k.rubric.reward_model={{ path = \"{}\", sigmoid = {sigmoid} }}",
            rm.display()
        ),
    ]);
    sets
}

#[test]
fn a_reward_model_scores_every_reply_of_a_run() {
    let dir = tempfile::tempdir().unwrap();
    let rm = dir.path().join("rm");
    reward_model(&rm);
    let (config, _) = runs::verl_tiny_config();
    let steps = runs::run_records(config, &dir.path().join("run"), &sets(&rm, true));
    assert_eq!(steps.last().unwrap()["policy_version"], 2, "{steps:?}");
    let scored: Vec<f64> = steps
        .iter()
        .filter_map(|s| s["reward.reward_model"].as_f64())
        .collect();
    assert!(!scored.is_empty(), "{steps:?}");
    for s in &scored {
        // The logistic of a forward's score: inside (0, 1), never a failure's error reward (0).
        assert!(*s > 0.0 && *s < 1.0, "{steps:?}");
    }
    // The only weighted function: the step's reward is the model's.
    for s in &steps {
        if let (Some(reward), Some(model)) = (
            s["trained_reward_mean"].as_f64(),
            s["reward.reward_model"].as_f64(),
        ) {
            assert!(reward > 0.0 && reward < 1.0 && model > 0.0, "{s}");
        }
    }

    // Two labels: `sluice check` refuses it before anything runs, naming the key and the field.
    let text = std::fs::read_to_string(rm.join("config.json")).unwrap();
    std::fs::write(
        rm.join("config.json"),
        text.replace(
            "\"0\": \"LABEL_0\"",
            "\"0\": \"LABEL_0\", \"1\": \"LABEL_1\"",
        ),
    )
    .unwrap();
    let mut check = Command::new(env!("CARGO_BIN_EXE_sluice"));
    check.args(["check", config]);
    for s in sets(&rm, false) {
        check.args(["--set", &s]);
    }
    let out = check.output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{stderr}");
    assert!(
        stderr.contains("data.domains.gsm8k.rubric.reward_model.path")
            && stderr.contains("id2label")
            && stderr.contains("has 2"),
        "{stderr}"
    );
}
