//! The `[trainer]` section on its own: defaults, the simulated trainer following the engine, and
//! a bad value named by its key (the whole-file rows are in `sluice-config`'s table tests).

use std::collections::BTreeSet;

use sluice_core::config::Device;
use sluice_core::config::check::Ctx;
use sluice_trainer::config::{LossKind, RawTrainer, TrainerConfig, validate_trainer};

fn validate(raw: RawTrainer, simulated_engine: bool) -> Result<TrainerConfig, String> {
    let overridden = BTreeSet::new();
    let ctx = Ctx {
        file: "t.toml",
        overridden: &overridden,
        env: &|_| None,
    };
    validate_trainer(raw, simulated_engine, Device::Cpu, &ctx).map_err(|e| e.to_string())
}

#[test]
fn defaults_and_the_simulated_trainer_follow_the_engine() {
    let c = validate(RawTrainer::default(), false).unwrap();
    assert_eq!(c.loss, LossKind::Ppo);
    assert_eq!(c.minibatches.get(), 1);
    assert!(!c.simulated.enabled);
    assert!(
        validate(RawTrainer::default(), true)
            .unwrap()
            .simulated
            .enabled
    );
}

#[test]
fn a_bad_value_names_its_key() {
    let raw = RawTrainer {
        clip_low: 1.0,
        ..RawTrainer::default()
    };
    assert_eq!(
        validate(raw, false).unwrap_err(),
        "t.toml: trainer.clip_low: expected a number in [0, 1), got 1"
    );
}
