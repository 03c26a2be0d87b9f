//! The `[trainer]` section on its own: defaults, the simulated trainer following the engine, and
//! a bad value named by its key (the whole-file rows are in `sluice-config`'s table tests).

use std::collections::BTreeSet;

use sluice_core::config::check::Ctx;
use sluice_core::config::{DType, Device};
use sluice_trainer::config::{LossKind, RawTrainer, TrainerConfig, validate_trainer};

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
        clip_low: 1.0,
        ..RawTrainer::default()
    };
    assert_eq!(
        validate(raw, false).unwrap_err(),
        "t.toml: trainer.clip_low: expected a number in [0, 1), got 1"
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
