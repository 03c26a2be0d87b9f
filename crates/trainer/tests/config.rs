//! The `[trainer]` section on its own: defaults, the simulated trainer following the engine, and
//! a bad value named by its key (the whole-file rows are in `sluice-config`'s table tests).

use std::collections::BTreeSet;

use sluice_core::config::check::Ctx;
use sluice_core::config::{DType, Device};
use sluice_trainer::config::{
    AdvantageKind, LossAggregation, LossKind, RawTrainer, TrainerConfig, validate_trainer,
};

fn validate(raw: RawTrainer, simulated_engine: bool) -> Result<TrainerConfig, String> {
    validate_on(raw, simulated_engine, Device::Cpu)
}

fn validate_on(
    raw: RawTrainer,
    simulated_engine: bool,
    device: Device,
) -> Result<TrainerConfig, String> {
    let overridden = BTreeSet::new();
    let ctx = Ctx {
        file: "t.toml",
        overridden: &overridden,
        env: &|_| None,
    };
    validate_trainer(raw, simulated_engine, device, &ctx).map_err(|e| e.to_string())
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
        clip_low: Some(1.0),
        ..RawTrainer::default()
    };
    assert_eq!(
        validate(raw, false).unwrap_err(),
        "t.toml: trainer.clip_low: expected a number in [0, 1), got 1"
    );
    for bad in [0.5, 1.0, -2.0] {
        let raw = RawTrainer {
            dual_clip: bad,
            ..RawTrainer::default()
        };
        assert_eq!(
            validate(raw, false).unwrap_err(),
            format!("t.toml: trainer.dual_clip: expected 0 (off) or a number > 1, got {bad}")
        );
    }
}

#[test]
fn gspo_takes_its_own_clip_range_and_text_mean_unless_set() {
    let of = |loss: &str, clip_high: Option<f64>, aggregation: Option<&str>| {
        let raw = RawTrainer {
            loss: loss.into(),
            clip_high,
            loss_aggregation: aggregation.map(str::to_owned),
            ..RawTrainer::default()
        };
        let c = validate(raw, false).unwrap();
        (c.clip_low, c.clip_high, c.loss_aggregation)
    };
    assert_eq!(
        of("ppo", None, None),
        (0.2, 0.2, LossAggregation::TokenMean)
    );
    assert_eq!(
        of("gspo", None, None),
        (3e-4, 4e-4, LossAggregation::SequenceMean)
    );
    assert_eq!(
        of("gspo", Some(1e-3), Some("token_sum_normalized")),
        (3e-4, 1e-3, LossAggregation::TokenSumNormalized)
    );
    let c = validate(RawTrainer::default(), false).unwrap();
    assert_eq!(c.dual_clip, 0.0);
}

#[test]
fn the_advantage_decides_whether_groups_are_divided_by_their_std() {
    let of = |advantage: &str, normalize: Option<bool>| {
        let raw = RawTrainer {
            advantage: advantage.into(),
            normalize_advantage_std: normalize,
            ..RawTrainer::default()
        };
        validate(raw, false).map(|c| (c.advantage, c.normalize_advantage_std))
    };
    assert_eq!(of("group", None), Ok((AdvantageKind::Group, true)));
    assert_eq!(
        of("situational", None),
        Ok((AdvantageKind::Situational, true))
    );
    assert_eq!(of("rloo", None), Ok((AdvantageKind::Rloo, false)));
    assert_eq!(of("rloo", Some(true)), Ok((AdvantageKind::Rloo, true)));
    assert_eq!(
        of("reinforce_plus_plus_baseline", None),
        Ok((AdvantageKind::ReinforcePlusPlusBaseline, false))
    );
    let err = of("reinforce_plus_plus_baseline", Some(true)).unwrap_err();
    assert!(
        err.starts_with("t.toml: trainer.normalize_advantage_std: ")
            && err.contains("step's spread"),
        "{err}"
    );
}

#[test]
fn compute_dtype_defaults_by_device_and_refuses_f16() {
    let on = |device, value: Option<&str>| {
        let raw = RawTrainer {
            compute_dtype: value.map(str::to_owned),
            ..RawTrainer::default()
        };
        validate_on(raw, false, device).map(|c| c.compute_dtype)
    };
    assert_eq!(on(Device::Cpu, None), Ok(DType::F32));
    assert_eq!(on(Device::Cuda(1), None), Ok(DType::Bf16));
    assert_eq!(on(Device::Cuda(0), Some("f32")), Ok(DType::F32));
    assert_eq!(on(Device::Cpu, Some("bf16")), Ok(DType::Bf16));
    let err = on(Device::Cuda(0), Some("f16")).unwrap_err();
    assert!(
        err.contains("trainer.compute_dtype") && err.contains("bf16"),
        "{err}"
    );
    let err = on(Device::Cpu, Some("fp8")).unwrap_err();
    assert!(err.contains("trainer.compute_dtype"), "{err}");
}
