//! Devices: a config's `cpu` / `cuda:N` as a candle device, and weights placed on a role's
//! device without a copy when they already live there.

mod common;

use std::sync::Arc;

use candle_core::DType;
use common::{snapshot, tiny_config};
use sluice_core::config::Device;
use sluice_model::{Architecture, InferenceModel, ModelError};

#[test]
fn cpu_opens_and_weights_already_there_are_shared_not_copied() {
    let cpu = sluice_model::device(Device::Cpu).unwrap();
    let w = Arc::new(snapshot(
        tiny_config(Architecture::Qwen2, true),
        3,
        DType::F32,
    ));
    let placed = w.on_device(&cpu).unwrap();
    assert!(Arc::ptr_eq(&w, &placed), "same device: the same snapshot");
    // An engine swapping in a snapshot of its own device keeps it as it is.
    let mut engine = InferenceModel::new(Arc::clone(&w)).unwrap();
    let next = Arc::new(w.with_version(sluice_core::PolicyVersion(1)));
    engine.swap_weights(Arc::clone(&next)).unwrap();
    assert!(Arc::ptr_eq(engine.snapshot(), &next));
}

#[test]
fn a_cuda_device_this_build_or_machine_lacks_is_an_error_saying_why() {
    if cfg!(feature = "cuda") && std::path::Path::new("/dev/nvidiactl").exists() {
        return; // a GPU machine: scripts/gpu-check covers cuda:N there
    }
    let err = sluice_model::device(Device::Cuda(0)).unwrap_err();
    assert_eq!(err.kind(), "device");
    let text = err.to_string();
    assert!(matches!(err, ModelError::Device { .. }), "{text}");
    assert!(text.starts_with("cuda:0: "), "{text}");
    if cfg!(feature = "cuda") {
        assert!(text.contains("no CUDA driver found"), "{text}");
    } else {
        assert!(text.contains("built without CUDA"), "{text}");
        assert!(text.contains("--features cuda"), "{text}");
    }
}
