//! Checkpoints no run writes and steps whose loss is not finite are refused, naming what was wrong, and a step the packing empties moves nothing (part of the `native` test binary).

use super::*;

/// A checkpoint of one step of [`config`], under `dir/checkpoint`.
fn one_step_checkpoint(dir: &std::path::Path) -> std::path::PathBuf {
    let mut trainer = NativeTrainer::new(tiny(6), config(0.01, 4), None).unwrap();
    trainer.train_step(&fixed_batch()).unwrap();
    let ckpt = dir.join("checkpoint");
    trainer.checkpoint(&ckpt).unwrap();
    ckpt
}

/// Rewrites the safetensors file `path` with `f` applied to each of its tensors.
fn rewrite_tensors(
    path: &std::path::Path,
    f: impl Fn(&str, candle_core::Tensor) -> candle_core::Tensor,
) {
    let tensors = candle_core::safetensors::load(path, &Device::Cpu).unwrap();
    let tensors: std::collections::HashMap<String, candle_core::Tensor> = tensors
        .into_iter()
        .map(|(k, t)| {
            let t = f(&k, t);
            (k, t)
        })
        .collect();
    candle_core::safetensors::save(&tensors, path).unwrap();
}

#[test]
fn a_corrupt_trainer_checkpoint_is_refused_naming_the_file_and_the_value() {
    let dir = tempfile::tempdir().unwrap();
    let ckpt = one_step_checkpoint(dir.path());
    let pristine = dir.path().join("pristine");
    std::fs::rename(&ckpt, &pristine).unwrap();
    fn edit_state(ckpt: &std::path::Path, edit: fn(&mut serde_json::Value)) {
        let path = ckpt.join("trainer_state.json");
        let mut state: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
        edit(&mut state);
        std::fs::write(&path, state.to_string()).unwrap();
    }
    let huge_step = |c: &std::path::Path| edit_state(c, |s| s["optimizer_step"] = u64::MAX.into());
    let wobble = |c: &std::path::Path| edit_state(c, |s| s["schedule"] = "wobble".into());
    let negative_v = |ckpt: &std::path::Path| {
        rewrite_tensors(&ckpt.join("optimizer.safetensors"), |name, t| {
            if name == "v.3" { (t - 1.0).unwrap() } else { t }
        })
    };
    type Corrupt<'a> = &'a dyn Fn(&std::path::Path);
    let cases: Vec<(&str, Corrupt<'_>, &[&str])> = vec![
        (
            "optimizer_step = u64::MAX",
            &huge_step,
            &[
                "trainer_state.json",
                "`optimizer_step` = 18446744073709551615",
            ],
        ),
        (
            "an unknown schedule",
            &wobble,
            &[
                "trainer_state.json",
                "`schedule` = \"wobble\"",
                "constant, cosine",
            ],
        ),
        (
            "a negative second moment",
            &negative_v,
            &["optimizer.safetensors", "`v.3` (second moment) holds -"],
        ),
    ];
    for (what, corrupt, expected) in cases {
        let _ = std::fs::remove_dir_all(&ckpt);
        let ok = std::process::Command::new("cp")
            .arg("-r")
            .arg(&pristine)
            .arg(&ckpt)
            .status()
            .unwrap()
            .success();
        assert!(ok);
        corrupt(&ckpt);
        let mut resumed = NativeTrainer::new(tiny(99), config(0.01, 4), None).unwrap();
        let err = resumed.restore(&ckpt).unwrap_err().to_string();
        for e in expected {
            assert!(err.contains(e), "{what}: `{e}` not in: {err}");
        }
    }
}

#[test]
fn a_step_with_a_non_finite_loss_fails_and_moves_no_weight() {
    // Weights huge but finite (a bit-flipped checkpoint passes the load's finite check), and
    // behaviour log-probs that are NaN: either way the step must not train to NaN.
    let dir = tempfile::tempdir().unwrap();
    let ckpt = one_step_checkpoint(dir.path());
    rewrite_tensors(&ckpt.join("model/model.safetensors"), |_, t| {
        (t * 1e30).unwrap()
    });
    let mut huge = NativeTrainer::new(tiny(99), config(0.01, 4), None).unwrap();
    huge.restore(&ckpt).unwrap();
    let mut nan = NativeTrainer::new(tiny(6), config(0.01, 4), None).unwrap();
    let mut nan_batch = fixed_batch();
    for g in &mut nan_batch {
        for r in &mut g.rollouts {
            for t in &mut r.turns {
                for lp in &mut t.logprobs {
                    *lp = f32::NAN;
                }
            }
        }
    }
    for (what, trainer, batch) in [
        ("huge weights", &mut huge, fixed_batch()),
        ("NaN log-probs", &mut nan, nan_batch),
    ] {
        let before = params(trainer);
        let version = trainer.version();
        let err = trainer.train_step(&batch).unwrap_err();
        assert!(
            ["non_finite_loss", "non_finite_gradient"].contains(&err.kind),
            "{what}: {err}"
        );
        assert!(
            err.message.contains("the optimizer update is refused"),
            "{what}: {err}"
        );
        assert!(params(trainer) == before, "{what}: no weight moved");
        assert_eq!(trainer.version(), version, "{what}: nothing published");
    }
}

/// A step whose every text the packing policy leaves out (`oversized_text = "reject"`, texts
/// longer than a row) trains nothing: no optimizer step, no version, as an all-zero batch.
/// A supervised step with nothing left says so.
#[test]
fn a_step_the_packing_empties_moves_nothing() {
    let mut c = config(0.01, 4);
    c.batcher.row_len = 4;
    c.batcher.oversized = OversizedText::Reject;
    let mut trainer = NativeTrainer::new(tiny(2), c, None).unwrap();
    let before = params(&trainer);
    let out = trainer.train_step(&fixed_batch()).unwrap();
    assert!(out.weights.is_none(), "a version was published");
    assert_eq!(out.trained_tokens, 0);
    assert_eq!(trainer.version(), PolicyVersion(0));
    assert_eq!(trainer.optimizer_updates(), 0, "the optimizer stepped");
    assert_eq!(params(&trainer), before, "no update");
    let (prompt, completion) = (vec![1u32, 2, 3], vec![4u32, 5, 6]);
    let example = SupervisedExample {
        prompt: &prompt,
        completion: &completion,
    };
    let err = trainer.supervised_step(&[example]).unwrap_err().to_string();
    assert!(
        err.contains("all 1 examples were left out of the batch"),
        "{err}"
    );
}
