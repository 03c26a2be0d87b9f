//! [`ModelWeights`]: an immutable, versioned set of parameter tensors, shared by `Arc`.
//!
//! The trainer publishes one per policy version; engines swap it in between decoding steps. The
//! contract that makes the swap safe without locks: **no tensor inside a snapshot is ever written
//! after the snapshot is built.** Nothing in this crate runs in-place ops on snapshot tensors, and
//! every constructor that could alias a trainer's `Var` copies into fresh storage first (candle's
//! `detach` shares storage, and `Var::set` writes in place, so a plain clone of a parameter would
//! let the next optimizer step change the weights under a running engine).

use std::collections::HashMap;
use std::sync::Arc;

use candle_core::{DType, Device, Tensor};
use sluice_core::PolicyVersion;

use crate::config::ModelConfig;
use crate::error::{ModelError, Result, TensorContext};
use crate::names::parameter_specs;

/// Immutable parameters of one policy version. Cheap to share: hold it as `Arc<ModelWeights>`.
#[derive(Debug)]
pub struct ModelWeights {
    /// The policy version these weights are.
    pub version: PolicyVersion,
    config: Arc<ModelConfig>,
    names: Vec<String>,
    tensors: Vec<Tensor>,
    index: HashMap<String, usize>,
}

impl Drop for ModelWeights {
    fn drop(&mut self) {
        // A snapshot travels between threads (trainer, actors, engine replicas) and its last
        // reference can go on one that never touched the GPU: its buffers are freed there.
        if let Some(t) = self.tensors.first() {
            crate::device::bind(t.device());
        }
    }
}

impl ModelWeights {
    /// Builds a snapshot from named tensors, checking that every parameter `config` needs is
    /// present with the right shape, and that all share one dtype and device. Tensors that are
    /// trainable `Var`s are copied; other tensors are taken as they are, so the caller must not
    /// write to them afterwards (see the module doc). Names the config does not use are refused.
    pub fn new(
        config: Arc<ModelConfig>,
        version: PolicyVersion,
        mut tensors: HashMap<String, Tensor>,
    ) -> Result<Self> {
        let specs = parameter_specs(&config);
        let mut names = Vec::with_capacity(specs.len());
        let mut ordered = Vec::with_capacity(specs.len());
        let mut kind: Option<(DType, Device)> = None;
        for spec in specs {
            let t = tensors
                .remove(&spec.name)
                .ok_or_else(|| ModelError::MissingTensor {
                    name: spec.name.clone(),
                    dir: "<snapshot>".into(),
                })?;
            if t.dims() != spec.shape.as_slice() {
                return Err(ModelError::TensorShape {
                    name: spec.name,
                    expected: spec.shape,
                    actual: t.dims().to_vec(),
                });
            }
            match &kind {
                None => kind = Some((t.dtype(), t.device().clone())),
                Some((dt, dev)) => {
                    if t.dtype() != *dt || !t.device().same_device(dev) {
                        return Err(ModelError::input(format!(
                            "tensor `{}` is {:?} on {:?}, the others are {dt:?} on {dev:?}",
                            spec.name,
                            t.dtype(),
                            t.device()
                        )));
                    }
                }
            }
            let t = if t.is_variable() {
                t.copy().ctx(&spec.name)?.detach()
            } else {
                t
            };
            names.push(spec.name);
            ordered.push(t);
        }
        if let Some(extra) = tensors.keys().next() {
            return Err(ModelError::input(format!(
                "tensor `{extra}` is not a parameter of this {} config",
                config.architecture.class_name()
            )));
        }
        let index = names
            .iter()
            .enumerate()
            .map(|(i, n)| (n.clone(), i))
            .collect();
        Ok(Self {
            version,
            config,
            names,
            tensors: ordered,
            index,
        })
    }

    /// A snapshot holding deep copies of `tensors` (fresh storage, detached from any graph),
    /// converted to `dtype` when given. This is how a trainer publishes its parameters.
    pub fn copied_from<'a>(
        config: Arc<ModelConfig>,
        version: PolicyVersion,
        tensors: impl IntoIterator<Item = (&'a str, &'a Tensor)>,
        dtype: Option<DType>,
    ) -> Result<Self> {
        let mut map = HashMap::new();
        for (name, t) in tensors {
            // `to_dtype` to the same dtype and `detach` both share storage: copy explicitly.
            let fresh = match dtype {
                Some(dt) if dt != t.dtype() => t.to_dtype(dt),
                _ => t.copy(),
            }
            .ctx(name)?
            .detach();
            map.insert(name.to_owned(), fresh);
        }
        Self::new(config, version, map)
    }

    /// The same tensors under another version number (no copy: snapshot tensors are immutable).
    pub fn with_version(&self, version: PolicyVersion) -> Self {
        Self {
            version,
            config: Arc::clone(&self.config),
            names: self.names.clone(),
            tensors: self.tensors.clone(),
            index: self.index.clone(),
        }
    }

    /// Wraps this snapshot in the envelope the actors pass around
    /// (`sluice_core::WeightSnapshot`, same version; shares the tensors, copies nothing).
    pub fn to_envelope(self: &Arc<Self>) -> sluice_core::WeightSnapshot {
        sluice_core::WeightSnapshot::new(self.version, Arc::clone(self))
    }

    /// The model snapshot inside an envelope, when it carries one.
    pub fn from_envelope(envelope: &sluice_core::WeightSnapshot) -> Option<Arc<Self>> {
        envelope.payload::<Self>()
    }

    /// The architecture these weights belong to.
    pub fn config(&self) -> &Arc<ModelConfig> {
        &self.config
    }

    /// The tensor called `name`, if it is a parameter.
    pub fn get(&self, name: &str) -> Option<&Tensor> {
        self.index.get(name).map(|&i| &self.tensors[i])
    }

    /// The tensor called `name`, or an error naming it.
    pub fn require(&self, name: &str) -> Result<&Tensor> {
        self.get(name).ok_or_else(|| ModelError::MissingTensor {
            name: name.to_owned(),
            dir: "<snapshot>".into(),
        })
    }

    /// `(name, tensor)` pairs in checkpoint order.
    pub fn iter(&self) -> impl Iterator<Item = (&str, &Tensor)> {
        self.names.iter().map(String::as_str).zip(&self.tensors)
    }

    /// Number of parameter tensors.
    pub fn len(&self) -> usize {
        self.tensors.len()
    }

    /// Whether the snapshot holds no tensor (never true for a valid config).
    pub fn is_empty(&self) -> bool {
        self.tensors.is_empty()
    }

    /// The dtype of every tensor.
    pub fn dtype(&self) -> DType {
        self.tensors[0].dtype()
    }

    /// The device every tensor lives on.
    pub fn device(&self) -> &Device {
        self.tensors[0].device()
    }

    /// These weights on `device`: the same snapshot (no copy) when they already live there, else
    /// a copy in the same dtype — device to device between GPUs (candle's `to_device`), through
    /// the host only between the CPU and a GPU.
    pub fn on_device(self: &Arc<Self>, device: &Device) -> Result<Arc<Self>> {
        if self.device().same_device(device) {
            return Ok(Arc::clone(self));
        }
        // Another device means fresh storage already: no second copy.
        let mut map = HashMap::new();
        for (name, t) in self.iter() {
            map.insert(name.to_owned(), t.to_device(device).ctx(name)?);
        }
        Ok(Arc::new(Self::new(
            Arc::clone(&self.config),
            self.version,
            map,
        )?))
    }

    /// A deep copy on `device` in `dtype` (fresh storage even when nothing changes).
    pub fn to(&self, device: &Device, dtype: DType) -> Result<Self> {
        let mut map = HashMap::new();
        for (name, t) in self.iter() {
            let moved = t.to_device(device).ctx(name)?;
            let converted = if moved.dtype() == dtype {
                moved.copy()
            } else {
                moved.to_dtype(dtype)
            }
            .ctx(name)?;
            map.insert(name.to_owned(), converted);
        }
        Self::new(Arc::clone(&self.config), self.version, map)
    }
}
