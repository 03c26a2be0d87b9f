//! The `[engine]` section on its own: defaults, the simulated seed following `run.seed`, and a
//! bad value named by its key (the whole-file rows are in `sluice-config`'s table tests).

use std::collections::BTreeSet;

use sluice_core::config::Device;
use sluice_core::config::check::Ctx;
use sluice_engine::config::{EngineBackend, EngineConfig, RawEngine, validate_engine};

fn validate(raw: RawEngine, run_seed: u64) -> Result<EngineConfig, String> {
    let overridden = BTreeSet::new();
    let ctx = Ctx {
        file: "t.toml",
        overridden: &overridden,
        env: &|_| None,
    };
    validate_engine(raw, run_seed, false, Device::Cpu, &ctx).map_err(|e| e.to_string())
}

#[test]
fn defaults_and_the_simulated_seed() {
    let c = validate(RawEngine::default(), 7).unwrap();
    assert_eq!(c.backend, EngineBackend::Native);
    assert_eq!(c.simulated.seed, 7);
    assert!(c.simulated.lengths.contains_key("default"));
}

#[test]
fn a_bad_value_names_its_key() {
    let raw = RawEngine {
        replicas: 0,
        ..RawEngine::default()
    };
    assert_eq!(
        validate(raw, 0).unwrap_err(),
        "t.toml: engine.replicas: expected an integer ≥ 1, got 0"
    );
}
