//! The `[model]` section on its own: defaults under the output dir, presets by name, and a bad
//! value named by its key (the whole-file rows are in `sluice-config`'s table tests).

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use sluice_core::config::check::Ctx;
use sluice_core::config::{DType, Device};
use sluice_model::section::{ModelPreset, ModelSection, RawModel, validate_model};

fn validate(raw: RawModel) -> Result<ModelSection, String> {
    let overridden = BTreeSet::new();
    let ctx = Ctx {
        file: "t.toml",
        overridden: &overridden,
        env: &|_| None,
    };
    validate_model(raw, Path::new("runs/a"), &ctx).map_err(|e| e.to_string())
}

#[test]
fn defaults_resolve_under_the_output_dir() {
    let c = validate(RawModel::default()).unwrap();
    assert_eq!(c.path, PathBuf::from("runs/a/model"));
    assert_eq!(
        (c.dtype, c.device, c.init_preset),
        (DType::F32, Device::Cpu, None)
    );
    let tiny = RawModel {
        init_preset: Some("tiny".into()),
        ..RawModel::default()
    };
    assert_eq!(validate(tiny).unwrap().init_preset, Some(ModelPreset::Tiny));
    assert_eq!(ModelPreset::parse_name("medium"), Ok(ModelPreset::Medium));
}

#[test]
fn a_bad_value_names_its_key() {
    let raw = RawModel {
        device: "gpu".into(),
        ..RawModel::default()
    };
    assert_eq!(
        validate(raw).unwrap_err(),
        "t.toml: model.device: expected cpu, cuda or cuda:N, got `gpu`"
    );
}
