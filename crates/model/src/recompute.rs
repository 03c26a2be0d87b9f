//! Activation recomputation (`trainer.activation_checkpointing`): the training forward keeps
//! only each decoder layer's input, and the backward runs one layer at a time, recomputing that
//! layer's activations from its saved input. Peak activation memory becomes one layer's instead
//! of every layer's, for one more forward per layer; the gradients are the same chain rule, in
//! a different order of additions (equal to the plain backward within rounding).

use candle_core::backprop::GradStore;
use candle_core::{Tensor, Var};

use crate::batch::PackedBatch;
use crate::error::{ModelError, Result, TensorContext};
use crate::train::{ForwardOptions, LayerInputs, TokenScores, TrainableModel, check_temperature};

/// What [`TrainableModel::backward_recomputed`] needs from the forward: each layer's input
/// (detached) and the last layer's output as the variable the head's graph starts from.
#[derive(Debug)]
pub struct SavedActivations {
    inputs: LayerInputs,
    layer_inputs: Vec<Tensor>,
    top: Var,
}

impl TrainableModel {
    /// [`TrainableModel::token_scores`] that keeps only each layer's input. The scores are
    /// differentiable only through the final norm and the head: take the gradients with
    /// [`TrainableModel::backward_recomputed`], not `backward()`. Also the cheapest forward when
    /// no gradient is wanted (drop the saved activations).
    pub fn token_scores_recomputable(
        &self,
        batch: &PackedBatch,
        options: ForwardOptions,
    ) -> Result<(TokenScores, SavedActivations)> {
        check_temperature(options.temperature)?;
        let inputs = self.layer_inputs(batch)?;
        let layers = self.config().num_layers;
        let mut layer_inputs = Vec::with_capacity(layers);
        let mut x = self.embed(&inputs)?.detach();
        for i in 0..layers {
            // Detaching drops the layer's graph, and with it every intermediate activation.
            let out = self.layer(i, &x, &inputs)?.detach();
            layer_inputs.push(std::mem::replace(&mut x, out));
        }
        let top = Var::from_tensor(&x).ctx("last layer output")?;
        let hidden = self.final_norm(top.as_tensor())?;
        let scores = self.scores_from_hidden(&hidden, batch, options)?;
        Ok((
            scores,
            SavedActivations {
                inputs,
                layer_inputs,
                top,
            },
        ))
    }

    /// Gradients of the scalar `loss`, built from the scores of
    /// [`TrainableModel::token_scores_recomputable`], for every parameter: the head's from
    /// `loss`, then each layer's, last first, by recomputing it from its saved input and
    /// back-propagating the gradient that reached its output.
    pub fn backward_recomputed(&self, loss: &Tensor, saved: SavedActivations) -> Result<GradStore> {
        let mut store = loss.backward().ctx("backward through the head")?;
        let mut grad = store
            .remove(saved.top.as_tensor())
            .ok_or_else(|| ModelError::input("the loss does not depend on the model's output"))?;
        for (i, input) in saved.layer_inputs.iter().enumerate().rev() {
            let input = Var::from_tensor(input).ctx("layer input")?;
            let out = self.layer(i, input.as_tensor(), &saved.inputs)?;
            let context = format!("recomputed backward, layer {i}");
            let layer_store = (out * &grad)
                .and_then(|t| t.sum_all())
                .and_then(|t| t.backward())
                .ctx(&context)?;
            self.add_parameter_grads(&mut store, &layer_store)
                .ctx(&context)?;
            grad = layer_store
                .get(input.as_tensor())
                .cloned()
                .ok_or_else(|| ModelError::input(format!("no gradient reached layer {i}")))?;
        }
        let embedded = self.embed(&saved.inputs)?;
        let embed_store = (embedded * &grad)
            .and_then(|t| t.sum_all())
            .and_then(|t| t.backward())
            .ctx("recomputed backward, embedding")?;
        self.add_parameter_grads(&mut store, &embed_store)
            .ctx("recomputed backward, embedding")?;
        Ok(store)
    }

    /// Adds every parameter gradient of `part` into `total` (the step's converted copies'
    /// included, [`TrainableModel::set_step_weights`]).
    fn add_parameter_grads(
        &self,
        total: &mut GradStore,
        part: &GradStore,
    ) -> candle_core::Result<()> {
        for param in self.parameter_tensors() {
            let Some(g) = part.get(param) else {
                continue;
            };
            let sum = match total.get(param) {
                Some(acc) => (acc + g)?,
                None => g.clone(),
            };
            total.insert(param, sum);
        }
        Ok(())
    }
}
