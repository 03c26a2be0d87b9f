//! AdamW with f32 master weights and moments, global-norm gradient clipping, and the
//! warmup + constant/cosine learning-rate schedule.
//!
//! Whatever the dtype of a model parameter, the optimizer keeps an f32 master copy (the parameter
//! itself when it already is f32), f32 first and second moments, and writes the updated master
//! back into the parameter (converted) after each step. Updates follow Loshchilov & Hutter:
//! `m ← β₁m + (1−β₁)g`, `v ← β₂v + (1−β₂)g²`, `p ← p − lr·(m̂/(√v̂ + ε) + λp)` with bias-corrected
//! `m̂ = m/(1−β₁ᵗ)`, `v̂ = v/(1−β₂ᵗ)`. Gradients are first scaled by `min(1, max_norm/‖g‖)`, the
//! norm taken over all parameters together.

use std::collections::HashMap;

use crate::config::LrSchedule;
use candle_core::{DType, Tensor, Var, backprop::GradStore};

/// Optimizer and schedule constants; built from `[trainer]` and `run.max_steps`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct OptimConfig {
    /// Peak learning rate.
    pub learning_rate: f64,
    /// Shape after warmup.
    pub schedule: LrSchedule,
    /// Linear warmup steps (step `s < warmup` uses `lr·(s+1)/warmup`).
    pub warmup_steps: u64,
    /// Steps of the whole run (the cosine reaches zero there).
    pub total_steps: u64,
    /// β₁.
    pub beta1: f64,
    /// β₂.
    pub beta2: f64,
    /// ε.
    pub eps: f64,
    /// Decoupled weight decay λ.
    pub weight_decay: f64,
    /// Global gradient-norm clip.
    pub max_grad_norm: f64,
}

impl Default for OptimConfig {
    fn default() -> Self {
        Self {
            learning_rate: 1e-5,
            schedule: LrSchedule::Constant,
            warmup_steps: 0,
            total_steps: 100,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 0.0,
            max_grad_norm: 1.0,
        }
    }
}

impl OptimConfig {
    /// Learning rate of step `step` (0-based).
    pub fn learning_rate_at(&self, step: u64) -> f64 {
        let peak = self.learning_rate;
        if step < self.warmup_steps {
            return peak * (step + 1) as f64 / self.warmup_steps as f64;
        }
        match self.schedule {
            LrSchedule::Constant => peak,
            LrSchedule::Cosine => {
                let span = self.total_steps.saturating_sub(self.warmup_steps).max(1) as f64;
                let progress = ((step - self.warmup_steps) as f64 / span).min(1.0);
                peak * 0.5 * (1.0 + (std::f64::consts::PI * progress).cos())
            }
        }
    }
}

/// An optimizer or gradient operation failed.
#[derive(Debug, thiserror::Error)]
pub enum OptimError {
    /// A tensor operation failed.
    #[error("optimizer: {context}: {source}")]
    Tensor {
        /// What was being done.
        context: String,
        /// The candle error.
        source: candle_core::Error,
    },
    /// Restored state does not match the parameters, or holds values no run can produce.
    #[error("optimizer state: {0}")]
    State(String),
    /// The gradients' global norm is NaN or infinite: the update is refused before any
    /// parameter or moment moves (clipping by a non-finite norm would turn every weight NaN).
    #[error(
        "the global gradient norm is {norm}: the optimizer update is refused (no parameter \
         changed); a corrupt checkpoint (huge weights) or a diverging run gives this"
    )]
    NonFiniteGradient {
        /// The norm.
        norm: f64,
    },
}

impl OptimError {
    /// Short stable name.
    pub fn kind(&self) -> &'static str {
        match self {
            Self::Tensor { .. } => "optim_tensor",
            Self::State(_) => "optim_state",
            Self::NonFiniteGradient { .. } => "non_finite_gradient",
        }
    }
}

trait Ctx<T> {
    fn ctx(self, context: impl FnOnce() -> String) -> Result<T, OptimError>;
}

impl<T> Ctx<T> for candle_core::Result<T> {
    fn ctx(self, context: impl FnOnce() -> String) -> Result<T, OptimError> {
        self.map_err(|source| OptimError::Tensor {
            context: context(),
            source,
        })
    }
}

/// The gradients of `vars` in `store`, each with its variable's index, in their own dtype.
/// Taking them out lets the rest of the store (every intermediate's gradient) go at once.
pub fn gradients(vars: &[&Var], store: &GradStore) -> Vec<(usize, Tensor)> {
    let grads = vars.iter().enumerate();
    grads
        .filter_map(|(i, var)| store.get(var.as_tensor()).map(|g| (i, g.clone())))
        .collect()
}

/// Gradients summed over the micro-batches of one step, in f32, one slot per parameter.
#[derive(Debug)]
pub struct GradAccumulator {
    grads: Vec<Option<Tensor>>,
}

impl GradAccumulator {
    /// An empty accumulator for `n` parameters.
    pub fn new(n: usize) -> Self {
        Self {
            grads: vec![None; n],
        }
    }

    /// Adds the gradients of `vars` found in `store`.
    pub fn add(&mut self, vars: &[&Var], store: &GradStore) -> Result<(), OptimError> {
        self.add_gradients(gradients(vars, store))
    }

    /// Adds one micro-batch's gradients, each with its parameter's index (from [`gradients`],
    /// or `TrainableModel::parameter_gradients`, where a tied embedding has two: its gathered
    /// rows' and its LM head's), in any float dtype. A parameter's gradients are converted to
    /// f32 and summed in order, then added to its sum. On a GPU one launch takes every
    /// parameter ([`crate::adamw_kernel::accumulate`]), with the same bits.
    pub fn add_gradients(&mut self, grads: Vec<(usize, Tensor)>) -> Result<(), OptimError> {
        let mut per: Vec<Vec<Tensor>> = vec![Vec::new(); self.grads.len()];
        for (i, g) in grads {
            let Some(slot) = per.get_mut(i) else {
                return Err(OptimError::State(format!(
                    "a gradient for parameter {i} of {}",
                    self.grads.len()
                )));
            };
            slot.push(g);
        }
        let grouped = per.into_iter().enumerate().filter(|(_, g)| !g.is_empty());
        let rest = crate::adamw_kernel::accumulate(&mut self.grads, grouped.collect())
            .ctx(|| "accumulating gradients".to_owned())?;
        for (i, gs) in rest {
            let context = || format!("accumulating gradient {i}");
            let mut sum: Option<Tensor> = None;
            for g in gs {
                let g = g.to_dtype(DType::F32).ctx(context)?;
                sum = Some(match sum {
                    None => g,
                    Some(s) => (s + g).ctx(context)?,
                });
            }
            let acc = &mut self.grads[i];
            *acc = match (acc.take(), sum) {
                (Some(a), Some(s)) => Some((a + s).ctx(context)?),
                (a, s) => a.or(s),
            };
        }
        Ok(())
    }

    /// The accumulated gradient of parameter `i`.
    pub fn get(&self, i: usize) -> Option<&Tensor> {
        self.grads.get(i).and_then(Option::as_ref)
    }

    /// `√Σ g²` over every accumulated gradient. On a GPU one launch sums every gradient's squares
    /// ([`crate::adamw_kernel::sum_of_squares`]); elsewhere the squares are summed per parameter
    /// on the gradients' device and read back once.
    pub fn global_norm(&self) -> Result<f64, OptimError> {
        let present: Vec<&Tensor> = self.grads.iter().flatten().collect();
        if let Some(sq) = crate::adamw_kernel::sum_of_squares(&present)
            .ctx(|| "global gradient norm".to_owned())?
        {
            return Ok(sq.sqrt());
        }
        let mut sums = Vec::with_capacity(self.grads.len());
        for (i, g) in self.grads.iter().enumerate() {
            if let Some(g) = g {
                let s = g
                    .sqr()
                    .and_then(|s| s.sum_all())
                    .and_then(|s| s.to_dtype(DType::F64))
                    .ctx(|| format!("norm of gradient {i}"))?;
                sums.push(s);
            }
        }
        if sums.is_empty() {
            return Ok(0.0);
        }
        let sq = Tensor::stack(&sums, 0)
            .and_then(|s| s.sum_all())
            .and_then(|s| s.to_scalar::<f64>())
            .ctx(|| "global gradient norm".to_owned())?;
        Ok(sq.sqrt())
    }
}

/// What one optimizer step did.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct StepReport {
    /// Global gradient norm before clipping.
    pub grad_norm: f64,
    /// The factor gradients were scaled by (1 when not clipped).
    pub clip_scale: f64,
    /// Learning rate used.
    pub learning_rate: f64,
}

struct Slot {
    param: Var,
    /// f32 copy of a non-f32 parameter; `None` when `param` is f32 and is its own master.
    master: Option<Var>,
    m: Tensor,
    v: Tensor,
}

/// AdamW over a fixed list of parameters (see the module docs).
pub struct AdamW {
    config: OptimConfig,
    slots: Vec<Slot>,
    step: u64,
}

impl std::fmt::Debug for AdamW {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AdamW")
            .field("config", &self.config)
            .field("params", &self.slots.len())
            .field("step", &self.step)
            .finish()
    }
}

impl AdamW {
    /// An optimizer at step 0 for `params`, with zero moments.
    pub fn new(params: Vec<Var>, config: OptimConfig) -> Result<Self, OptimError> {
        let mut slots = Vec::with_capacity(params.len());
        for (i, param) in params.into_iter().enumerate() {
            let master = if param.dtype() == DType::F32 {
                None
            } else {
                let t = param
                    .as_tensor()
                    .to_dtype(DType::F32)
                    .ctx(|| format!("master copy of parameter {i}"))?;
                Some(Var::from_tensor(&t).ctx(|| format!("master copy of parameter {i}"))?)
            };
            let zeros = || Tensor::zeros(param.shape(), DType::F32, param.device());
            let m = zeros().ctx(|| format!("moments of parameter {i}"))?;
            let v = zeros().ctx(|| format!("moments of parameter {i}"))?;
            slots.push(Slot {
                param,
                master,
                m,
                v,
            });
        }
        Ok(Self {
            config,
            slots,
            step: 0,
        })
    }

    /// Steps taken so far (the next step is this one, 0-based).
    pub fn step_count(&self) -> u64 {
        self.step
    }

    /// The constants.
    pub fn config(&self) -> &OptimConfig {
        &self.config
    }

    /// Clips `grads` to the global norm, takes one AdamW step and writes the parameters.
    /// Parameters without a gradient are left as they are (moments too).
    pub fn step(&mut self, grads: &GradAccumulator) -> Result<StepReport, OptimError> {
        let c = self.config;
        let grad_norm = grads.global_norm()?;
        if !grad_norm.is_finite() {
            return Err(OptimError::NonFiniteGradient { norm: grad_norm });
        }
        let clip_scale = if grad_norm > c.max_grad_norm {
            c.max_grad_norm / (grad_norm + 1e-6)
        } else {
            1.0
        };
        let lr = c.learning_rate_at(self.step);
        let t = self.step.saturating_add(1);
        let (bc1, bc2) = (bias_correction(c.beta1, t), bias_correction(c.beta2, t));
        let u = crate::adamw_kernel::Update {
            clip_scale,
            beta1: c.beta1,
            beta2: c.beta2,
            bc1,
            bc2,
            eps: c.eps,
            lr,
            weight_decay: c.weight_decay,
        };
        let mut updated = Vec::with_capacity(self.slots.len());
        let mut operands = Vec::with_capacity(self.slots.len());
        for (i, slot) in self.slots.iter_mut().enumerate() {
            let Some(g) = grads.get(i) else { continue };
            updated.push(i);
            let operands_of_i = crate::adamw_kernel::Operands {
                master: slot.master.as_ref().unwrap_or(&slot.param),
                m: &mut slot.m,
                v: &mut slot.v,
                g,
            };
            operands.push((i, operands_of_i));
        }
        crate::adamw_kernel::apply_many(operands, u).ctx(|| "AdamW update".to_string())?;
        for &i in &updated {
            let slot = &self.slots[i];
            if let Some(master) = &slot.master {
                let copy = || {
                    slot.param
                        .set(&master.as_tensor().to_dtype(slot.param.dtype())?)
                };
                copy().ctx(|| format!("AdamW update of parameter {i}"))?;
            }
        }
        self.step = self.step.saturating_add(1);
        Ok(StepReport {
            grad_norm,
            clip_scale,
            learning_rate: lr,
        })
    }

    /// Moments (and master copies) as named tensors, for `safetensors`: `m.{i}`, `v.{i}`,
    /// `master.{i}`.
    pub fn state_tensors(&self) -> HashMap<String, Tensor> {
        let mut out = HashMap::new();
        for (i, s) in self.slots.iter().enumerate() {
            out.insert(format!("m.{i}"), s.m.clone());
            out.insert(format!("v.{i}"), s.v.clone());
            if let Some(master) = &s.master {
                out.insert(format!("master.{i}"), master.as_tensor().clone());
            }
        }
        out
    }

    /// Restores what [`Self::state_tensors`] produced, and the step count. Refuses a missing,
    /// extra or misshapen tensor, and values no run can produce: a non-finite first moment or
    /// master copy, a second moment that is negative or not finite (the error names the tensor
    /// and the element). After an error the optimizer is partly restored: drop it.
    pub fn load_state(
        &mut self,
        mut tensors: HashMap<String, Tensor>,
        step: u64,
    ) -> Result<(), OptimError> {
        for (i, s) in self.slots.iter_mut().enumerate() {
            let mut take = |name: String| -> Result<Tensor, OptimError> {
                let t = tensors
                    .remove(&name)
                    .ok_or_else(|| OptimError::State(format!("missing tensor `{name}`")))?;
                if t.dims() != s.param.dims() {
                    return Err(OptimError::State(format!(
                        "`{name}` has shape {:?}, the parameter {:?}",
                        t.dims(),
                        s.param.dims()
                    )));
                }
                // A private copy: the moments are updated in place.
                t.to_dtype(DType::F32)
                    .and_then(|t| t.to_device(s.param.device()))
                    .and_then(|t| t.copy())
                    .ctx(|| format!("loading `{name}`"))
            };
            let m = take(format!("m.{i}"))?;
            check_moment(&m, &format!("m.{i}"), Moment::First)?;
            let v = take(format!("v.{i}"))?;
            check_moment(&v, &format!("v.{i}"), Moment::Second)?;
            s.m = m;
            s.v = v;
            if let Some(master) = &s.master {
                let t = take(format!("master.{i}"))?;
                check_moment(&t, &format!("master.{i}"), Moment::Master)?;
                master.set(&t).ctx(|| format!("loading master {i}"))?;
            }
        }
        if let Some(extra) = tensors.keys().next() {
            return Err(OptimError::State(format!("unexpected tensor `{extra}`")));
        }
        self.step = step;
        Ok(())
    }
}

/// `1 − βᵗ`, AdamW's bias correction at step `t` (1-based). `powi` while `t` fits an `i32`, so
/// every step a run can reach gives the bits it always gave (the CPU and GPU kernels and the
/// composition are compared bit for bit); `powf` beyond, where `βᵗ` has long underflowed to 0
/// for any `β < 1`. A cast would wrap (`u64::MAX + 1` is step 0, `1 − β⁰ = 0`, a division by
/// zero) or truncate to a negative exponent.
pub fn bias_correction(beta: f64, t: u64) -> f64 {
    let power = match i32::try_from(t) {
        Ok(t) => beta.powi(t),
        Err(_) => beta.powf(t as f64),
    };
    1.0 - power
}

/// Which restored optimizer tensor is checked.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Moment {
    /// `m`: any finite value.
    First,
    /// `v`: a running mean of squares, finite and ≥ 0.
    Second,
    /// The f32 master copy of a non-f32 parameter: finite.
    Master,
}

/// Refuses a restored tensor no run can produce (a NaN, an infinity, a negative second moment):
/// resuming from one turns every weight NaN at the first update. One pass over the values, at
/// load only.
fn check_moment(t: &Tensor, name: &str, moment: Moment) -> Result<(), OptimError> {
    let values: Vec<f32> = t
        .flatten_all()
        .and_then(|t| t.to_vec1())
        .ctx(|| format!("checking `{name}`"))?;
    let bad = values
        .iter()
        .enumerate()
        .find(|&(_, &x)| !x.is_finite() || (moment == Moment::Second && x < 0.0));
    match (bad, moment) {
        (None, _) => Ok(()),
        (Some((at, x)), Moment::First | Moment::Master) => Err(OptimError::State(format!(
            "tensor `{name}` ({}) holds {x} at element {at}: it must be finite",
            if moment == Moment::First {
                "first moment"
            } else {
                "master weights"
            }
        ))),
        (Some((at, x)), Moment::Second) => Err(OptimError::State(format!(
            "tensor `{name}` (second moment) holds {x} at element {at}: it must be finite and \
             ≥ 0"
        ))),
    }
}
