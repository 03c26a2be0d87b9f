//! The parameters in the compute dtype, converted once for a training step.
//!
//! Under mixed precision (`trainer.compute_dtype = "bf16"` with f32 masters) each forward
//! converts every parameter it reads whole, and each conversion is a node of the graph: on a GPU
//! one launch forward and, backward, the gradient's conversion back to f32 plus the zero-fill and
//! add candle spends on every edge, about six launches per parameter and micro-batch (about
//! 1,700 on Qwen2.5-0.5B's shapes). A step whose weights do not change between its micro-batches
//! can convert them once instead ([`TrainableModel::set_step_weights`], one launch for every
//! parameter on a GPU) and use the copies as leaf variables: their gradients come back in the
//! compute dtype ([`TrainableModel::parameter_gradients`]) for the caller to add to its f32
//! sums, the values the conversion's backward would have produced.

use candle_core::backprop::GradStore;
use candle_core::{Tensor, Var};

use crate::error::{ModelError, Result, TensorContext};
use crate::layers::DecoderWeights;
use crate::names::EMBED;
use crate::train::TrainableModel;

/// The converted parameters the forward reads ([`TrainableModel::set_step_weights`]).
#[derive(Debug)]
pub(crate) struct StepWeights {
    /// The decoder's weights in the compute dtype (an untied embedding stays the master's:
    /// the forward gathers its rows from the master table).
    pub(crate) weights: DecoderWeights,
    /// Each converted parameter's index in [`TrainableModel::vars`] and its leaf variable.
    leaves: Vec<(usize, Var)>,
}

impl TrainableModel {
    /// The parameters [`Self::set_step_weights`] takes, as indices into [`Self::vars`], in the
    /// order it takes them: every parameter the forward reads whole, which is all but an untied
    /// embedding (the forward gathers its rows from the master table). Empty when the
    /// forward's tensors are in the parameters' dtype (the compute dtype is theirs, or the
    /// products round on AMX tiles): there is nothing to convert.
    pub fn step_weight_params(&self) -> Vec<usize> {
        if self.tensor_dtype() == self.dtype() {
            return Vec::new();
        }
        let tied = self.config().tie_word_embeddings;
        let vars = self.vars().iter().enumerate();
        vars.filter(|(_, (name, _))| tied || name != EMBED)
            .map(|(i, _)| i)
            .collect()
    }

    /// Uses `converted` for every forward until [`Self::clear_step_weights`], where each
    /// forward would convert each parameter again: `converted[k]` is parameter
    /// [`Self::step_weight_params`]`()[k]` in the compute dtype. Tensors that are not variables
    /// yet are copied into variables (a GPU caller makes them as variables, saving the copy).
    ///
    /// The gradients of the forwards run meanwhile reach these copies, not the masters: take
    /// them with [`Self::parameter_gradients`]. Clear the copies before the masters change, or
    /// the forward reads the old weights.
    pub fn set_step_weights(&mut self, converted: Vec<Tensor>) -> Result<()> {
        let params = self.step_weight_params();
        if converted.len() != params.len() {
            return Err(ModelError::input(format!(
                "step weights: {} tensors for {} converted parameters",
                converted.len(),
                params.len()
            )));
        }
        let mut leaves = Vec::with_capacity(params.len());
        for (i, t) in params.into_iter().zip(converted) {
            let (name, master) = &self.vars()[i];
            let master = master.as_tensor();
            if t.dtype() != self.tensor_dtype()
                || t.dims() != master.dims()
                || !t.device().same_device(master.device())
            {
                return Err(ModelError::input(format!(
                    "step weights: {name} is {:?} {:?} on {:?}; wanted {:?} {:?} on {:?}",
                    t.dtype(),
                    t.dims(),
                    t.device().location(),
                    self.tensor_dtype(),
                    master.dims(),
                    master.device().location(),
                )));
            }
            leaves.push((i, Var::from_tensor(&t).ctx(name)?));
        }
        // What the forward reads per parameter: its copy, else its master.
        let mut read: Vec<&Var> = self.vars().iter().map(|(_, v)| v).collect();
        for (i, v) in &leaves {
            read[*i] = v;
        }
        let weights = DecoderWeights::build(self.config(), |name| {
            let Some(i) = self.vars().iter().position(|(n, _)| n == name) else {
                return Err(ModelError::MissingTensor {
                    name: name.to_owned(),
                    dir: "<trainable model>".into(),
                });
            };
            Ok(read[i].as_tensor().clone())
        })?;
        self.step = Some(StepWeights { weights, leaves });
        Ok(())
    }

    /// Drops the converted copies of [`Self::set_step_weights`]: forwards convert each
    /// parameter themselves again.
    pub fn clear_step_weights(&mut self) {
        self.step = None;
    }

    /// Whether the forward reads converted copies ([`Self::set_step_weights`]).
    pub fn has_step_weights(&self) -> bool {
        self.step.is_some()
    }

    /// Every gradient in `store` that belongs to a parameter, with the parameter's index in
    /// [`Self::vars`], in the gradient's own dtype: the master's, then its converted copy's
    /// ([`Self::set_step_weights`]). A tied embedding can have both (its rows gathered from
    /// the master, the LM head read from the copy); their sum is the parameter's gradient.
    pub fn parameter_gradients(&self, store: &GradStore) -> Vec<(usize, Tensor)> {
        let mut grads: Vec<(usize, Tensor)> = self
            .parameters()
            .filter_map(|(i, v)| store.get(v.as_tensor()).map(|g| (i, g.clone())))
            .collect();
        // Stable: a parameter's master gradient stays before its copy's.
        grads.sort_by_key(|(i, _)| *i);
        grads
    }

    /// Every tensor the backward gives gradients to: the masters and the converted copies.
    pub(crate) fn parameter_tensors(&self) -> impl Iterator<Item = &Tensor> {
        self.parameters().map(|(_, v)| v.as_tensor())
    }

    /// The masters, then the step's converted copies, each with its parameter's index in
    /// [`Self::vars`].
    fn parameters(&self) -> impl Iterator<Item = (usize, &Var)> {
        let leaves = self
            .step
            .iter()
            .flat_map(|s| s.leaves.iter().map(|(i, v)| (*i, v)));
        let masters = self.vars().iter().map(|(_, v)| v).enumerate();
        masters.chain(leaves)
    }
}
