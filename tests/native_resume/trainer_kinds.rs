//! Runs whose trainer keeps more than the policy's weights, through the binary: LoRA's
//! adapters and PPO's critic are checkpointed, resumed with, and a resume of the other kind is
//! refused naming the key (part of the `native_resume` test binary).

use super::*;

/// LoRA through the binary: a quickstart run with `trainer.lora_rank` checkpoints the merged
/// weights and the adapters as PEFT writes them, the same command resumes with them, and a
/// resume asking for another rank is refused naming both.
#[test]
fn a_lora_run_checkpoints_peft_adapters_and_resumes_with_them() {
    let out = tempfile::tempdir().unwrap().keep().join("run");
    let lora = ["trainer.lora_rank=4", "trainer.learning_rate=0.001"];
    let mut run = short_run_with(&out, 3, &lora);
    let code = run.wait_exit();
    let logs = run.logs();
    assert!(code.success(), "{code}\n{logs}");
    assert!(
        logs.contains("LoRA: adapters train in place of the weights"),
        "{logs}"
    );
    let trainer = out.join("checkpoint/trainer");
    let peft: Value = serde_json::from_str(
        &std::fs::read_to_string(trainer.join("adapter/adapter_config.json")).unwrap(),
    )
    .unwrap();
    assert_eq!(peft["peft_type"], "LORA");
    assert_eq!(peft["r"], 4);
    assert_eq!(peft["target_modules"].as_array().unwrap().len(), 7);
    assert!(trainer.join("adapter/adapter_model.safetensors").is_file());
    assert!(trainer.join("model/model.safetensors").is_file());

    let mut more = short_run_with(&out, 5, &lora);
    let code = more.wait_exit();
    assert!(code.success(), "{code}\n{}", more.logs());
    assert_eq!(manifest(&out)["steps"], 5, "{}", more.logs());

    let mut other = short_run_with(&out, 7, &["trainer.lora_rank=8"]);
    let code = other.wait_exit();
    let logs = other.logs();
    assert!(
        !code.success(),
        "a resume with another rank must fail\n{logs}"
    );
    for e in [
        "adapter_config.json",
        "rank 4",
        "rank 8",
        "trainer.lora_rank",
    ] {
        assert!(logs.contains(e), "`{e}` not in the output\n{logs}");
    }
    let _ = std::fs::remove_dir_all(out.parent().unwrap());
}

/// PPO with a critic through the binary: a quickstart run with `trainer.advantage = "gae"` (and
/// an adaptive KL penalty in the reward) starts its critic from a reward model's directory
/// (`trainer.critic_path`) and warms it up for a step (`trainer.critic_warmup`), logs the
/// critic's figures and the penalty's each step, checkpoints
/// the critic beside the policy, the same command resumes with it, and a resume without `gae`
/// is refused naming the key.
#[test]
fn a_gae_run_checkpoints_its_critic_and_resumes_with_it() {
    let out = tempfile::tempdir().unwrap().keep().join("run");
    let rm = out.parent().unwrap().join("rm");
    let preset = sluice_model::presets::Preset::Tiny;
    let hidden = sluice_model::presets::preset_config(preset).hidden_size;
    let head: Vec<f32> = (0..hidden).map(|i| (i % 5) as f32 * 0.05 - 0.1).collect();
    sluice_model::presets::write_reward_preset(preset, &rm, 3, &head).unwrap();
    let critic_path = format!("trainer.critic_path=\"{}\"", rm.display());
    let gae = [
        "trainer.advantage=gae",
        "trainer.critic_learning_rate=0.001",
        "trainer.kl_in_reward=0.01",
        "trainer.kl_in_reward_target=0.001",
        critic_path.as_str(),
        "trainer.critic_warmup=1",
    ];
    let mut run = short_run_with(&out, 3, &gae);
    let code = run.wait_exit();
    assert!(code.success(), "{code}\n{}", run.logs());
    let critic = out.join("checkpoint/trainer/critic");
    for f in [
        "value_head.safetensors",
        "model/model.safetensors",
        "optimizer.safetensors",
    ] {
        assert!(critic.join(f).is_file(), "{f}");
    }
    let steps = records(&out.join("metrics.jsonl"));
    let rl: Vec<&Value> = steps
        .iter()
        .filter(|r| r.get("critic.loss").is_some())
        .collect();
    assert_eq!(rl.len(), 3, "every RL step logs the critic: {steps:?}");
    // The first RL step warms the critic up: the policy's figures wait for the second.
    assert!(rl[0].get("train.clip_fraction").is_none(), "{:?}", rl[0]);
    assert!(rl[1]["train.clip_fraction"].is_number(), "{:?}", rl[1]);
    // The critic starts from the reward model's decoder and head (the policy's would start at
    // zero, its head's values all 0).
    assert!(
        rl[0]["critic.values_mean"].as_f64().unwrap().abs() > 1e-4,
        "{:?}",
        rl[0]
    );
    // The KL penalty's coefficient starts as set and moves toward its target.
    assert_eq!(rl[0]["train.kl_in_reward_coef"], 0.01);
    assert!(
        rl[2]["train.kl_in_reward_coef"].as_f64().unwrap() != 0.01,
        "{:?}",
        rl[2]
    );
    assert!(rl[2]["train.kl_in_reward"].as_f64().unwrap().is_finite());

    let mut more = short_run_with(&out, 5, &gae);
    let code = more.wait_exit();
    assert!(code.success(), "{code}\n{}", more.logs());
    assert_eq!(manifest(&out)["steps"], 5, "{}", more.logs());

    let mut other = short_run_with(&out, 7, &[]);
    let code = other.wait_exit();
    let logs = other.logs();
    assert!(
        !code.success(),
        "a resume without the critic must fail\n{logs}"
    );
    for e in ["critic/", "trainer.advantage"] {
        assert!(logs.contains(e), "`{e}` not in the output\n{logs}");
    }
    let _ = std::fs::remove_dir_all(out.parent().unwrap());
}
