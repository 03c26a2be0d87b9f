//! `sluice check` on the trainer's keys (part of the `cli_check` test binary): the defaults
//! chosen from the loss, LoRA, PPO's critic and the KL penalty in the reward resolved, and bad
//! values refused naming the key.

use super::*;

#[test]
fn check_resolves_gspo_defaults_lora_and_gae_and_refuses_a_bad_dual_clip_bonus_buffer_or_target() {
    let check = |sets: &[&str]| {
        let mut args = vec!["check", "configs/quickstart.toml"];
        for s in sets {
            args.extend(["--set", s]);
        }
        sluice(&args, repo())
    };
    let out = check(&[
        "trainer.loss=gspo",
        "trainer.dual_clip=3",
        "trainer.entropy_coeff=0.001",
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let printed: toml::Table = String::from_utf8(out.stdout).unwrap().parse().unwrap();
    let trainer = &printed["trainer"];
    assert_eq!(trainer["loss"].as_str(), Some("gspo"));
    assert_eq!(trainer["clip_low"].as_float(), Some(3e-4));
    assert_eq!(trainer["clip_high"].as_float(), Some(4e-4));
    assert_eq!(trainer["loss_aggregation"].as_str(), Some("sequence_mean"));
    assert_eq!(trainer["dual_clip"].as_float(), Some(3.0));
    assert_eq!(trainer["entropy_coeff"].as_float(), Some(0.001));
    // LoRA off by default, `all-linear` resolved to the seven projections.
    assert_eq!(trainer["lora_rank"].as_integer(), Some(0));
    assert_eq!(trainer["lora_targets"].as_array().map(Vec::len), Some(7));
    let out = check(&[
        "trainer.lora_rank=8",
        "trainer.lora_targets=[\"q_proj\", \"v_proj\"]",
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let resolved: toml::Table = String::from_utf8(out.stdout).unwrap().parse().unwrap();
    assert_eq!(resolved["trainer"]["lora_rank"].as_integer(), Some(8));
    let targets = resolved["trainer"]["lora_targets"].as_array().unwrap();
    assert_eq!(targets.len(), 2);
    for (bad, says) in [
        ("[\"qkv_proj\"]", "`qkv_proj` is not a module LoRA adapts"),
        ("[\"all-linear\", \"q_proj\"]", "list it alone"),
        ("[\"q_proj\", \"q_proj\"]", "listed twice"),
    ] {
        let out = check(&[&format!("trainer.lora_targets={bad}")]);
        assert!(!out.status.success(), "{bad}");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            err.contains("trainer.lora_targets") && err.contains(says),
            "{err}"
        );
    }
    // PPO with a critic: the critic's learning rate is the policy's unless set.
    let out = check(&["trainer.advantage=gae", "trainer.learning_rate=2e-5"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let resolved: toml::Table = String::from_utf8(out.stdout).unwrap().parse().unwrap();
    let trainer = &resolved["trainer"];
    assert_eq!(trainer["advantage"].as_str(), Some("gae"));
    assert_eq!(trainer["critic_learning_rate"].as_float(), Some(2e-5));
    assert_eq!(trainer["value_clip"].as_float(), Some(0.5));
    assert_eq!(trainer["normalize_advantage_std"].as_bool(), Some(false));
    for (sets, key, says) in [
        (
            &["trainer.loss=gspo"][..],
            "trainer.advantage",
            "clips whole texts",
        ),
        (
            &["trainer.normalize_advantage_std=true"][..],
            "trainer.normalize_advantage_std",
            "whitens",
        ),
        (
            &["trainer.gae_lambda=1.5"][..],
            "trainer.gae_lambda",
            "[0, 1]",
        ),
        (&["trainer.value_clip=0"][..], "trainer.value_clip", ""),
        (
            &["trainer.critic_path=\"/nonexistent/critic\""][..],
            "trainer.critic_path",
            "/nonexistent/critic",
        ),
    ] {
        let mut all = vec!["trainer.advantage=gae"];
        all.extend(sets);
        let out = check(&all);
        assert!(!out.status.success(), "{sets:?}");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains(key) && err.contains(says), "{sets:?}: {err}");
    }
    // A critic's directory, or its warm-up, without a critic.
    for (set, key) in [
        ("trainer.critic_path=\"models/rm\"", "trainer.critic_path"),
        ("trainer.critic_warmup=3", "trainer.critic_warmup"),
    ] {
        let out = check(&[set]);
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            !out.status.success() && err.contains(key) && err.contains("gae"),
            "{err}"
        );
    }
    // The KL penalty in the reward: fixed unless a target is set, and a target needs a start.
    let out = check(&[
        "trainer.kl_in_reward=0.001",
        "trainer.kl_in_reward_target=0.1",
        "trainer.kl_in_reward_estimator=k3",
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let resolved: toml::Table = String::from_utf8(out.stdout).unwrap().parse().unwrap();
    let trainer = &resolved["trainer"];
    assert_eq!(trainer["kl_in_reward"].as_float(), Some(0.001));
    assert_eq!(trainer["kl_in_reward_target"].as_float(), Some(0.1));
    assert_eq!(trainer["kl_in_reward_horizon"].as_integer(), Some(10_000));
    assert_eq!(trainer["kl_in_reward_estimator"].as_str(), Some("k3"));
    let out = check(&["trainer.kl_in_reward_estimator=low_var_kl"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && err.contains("trainer.kl_in_reward_estimator"),
        "{err}"
    );
    let out = check(&["trainer.kl_in_reward_target=0.1"]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("trainer.kl_in_reward_target") && err.contains("is 0 (off)"),
        "{err}"
    );
    let out = check(&["trainer.kl_in_reward=-1"]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("trainer.kl_in_reward"));
    let out = check(&["trainer.entropy_coeff=-0.01"]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("trainer.entropy_coeff"), "{err}");
    let out = check(&["trainer.dual_clip=1"]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("trainer.dual_clip") && err.contains("> 1"),
        "{err}"
    );
    // The overlong buffer lies inside the turn budget (the quickstart's is 6 tokens).
    let out = check(&["rollout.overlong_buffer_tokens=7"]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("rollout.overlong_buffer_tokens")
            && err.contains("rollout.max_new_tokens (6)"),
        "{err}"
    );
}
