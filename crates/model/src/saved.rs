//! The training forward that keeps what its backward reads, and that backward: the head's by
//! candle's autograd, each decoder layer's by hand where the layer runs the fused ops
//! (`crate::layer_grads`), the embedding's as one scatter-add.
//!
//! [`Activations::Recomputed`] (`trainer.activation_checkpointing`) keeps only each layer's
//! input, and the backward runs the layers' forward again one at a time, last first: peak
//! activation memory becomes one layer's instead of every layer's, for one more forward per
//! layer. The gradients are the same chain rule in either case, equal within rounding to those
//! of the forward's whole graph (`backward()` on [`TrainableModel::token_scores`]'s loss).

use candle_core::backprop::GradStore;
use candle_core::{Tensor, Var};

use crate::batch::PackedBatch;
use crate::error::{ModelError, Result, TensorContext};
use crate::layer_grads::{LayerContext, LayerTape};
use crate::train::{ForwardOptions, LayerInputs, TokenScores, TrainableModel, check_temperature};

/// What [`TrainableModel::token_scores_for_backward`] keeps for the backward.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Activations {
    /// Every layer's activations (the default).
    Kept,
    /// Only each layer's input: the backward recomputes the rest, a layer at a time.
    Recomputed,
}

/// What [`TrainableModel::backward_saved`] needs from the forward.
pub struct SavedActivations(Saved);

enum Saved {
    /// The forward's graph holds everything: the loss's own `backward()` (a layer composed of
    /// candle's ops, [`crate::ops::Kernels::Differentiable`], or weights converted by the
    /// forward itself).
    Graph,
    /// The layers' activations outside any graph, and the last layer's output as the variable
    /// the head's graph starts from.
    Layers {
        inputs: LayerInputs,
        layers: Layers,
        top: Var,
    },
}

enum Layers {
    /// Each layer's tape, first layer first.
    Tapes(Vec<LayerTape>),
    /// Each layer's input (detached), first layer first.
    Inputs(Vec<Tensor>),
}

impl std::fmt::Debug for SavedActivations {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let what = match &self.0 {
            Saved::Graph => "the forward's graph",
            Saved::Layers {
                layers: Layers::Tapes(_),
                ..
            } => "every layer's activations",
            Saved::Layers {
                layers: Layers::Inputs(_),
                ..
            } => "each layer's input",
        };
        f.debug_tuple("SavedActivations").field(&what).finish()
    }
}

impl TrainableModel {
    /// [`TrainableModel::token_scores`] with what its backward reads: take the gradients of a
    /// loss built from these scores with [`TrainableModel::backward_saved`].
    pub fn token_scores_for_backward(
        &self,
        batch: &PackedBatch,
        options: ForwardOptions,
        activations: Activations,
    ) -> Result<(TokenScores, SavedActivations)> {
        check_temperature(options.temperature)?;
        let _tiles = self.products_scope();
        if activations == Activations::Kept && !self.layers_by_hand() {
            let scores = self.token_scores(batch, options)?;
            return Ok((scores, SavedActivations(Saved::Graph)));
        }
        let (top, saved) = self.layers_for_backward(batch, activations)?;
        let hidden = self.final_norm(&top)?;
        let scores = self.scores_from_hidden(&hidden, batch, options)?;
        Ok((scores, saved))
    }

    /// A value head's estimate at every slot, `(B, L)` in f32 (f64 for an f64 model, `head`'s
    /// dtype either way): `head` `(1, hidden)` times the
    /// final-norm hidden state, the critic of PPO with GAE. Differentiable with respect to
    /// `head` (a variable of the caller's) and every parameter; take the gradients of a loss
    /// built from the values with [`TrainableModel::backward_saved`], as for
    /// [`TrainableModel::token_scores_for_backward`].
    pub fn values_for_backward(
        &self,
        batch: &PackedBatch,
        head: &Tensor,
        activations: Activations,
    ) -> Result<(Tensor, SavedActivations)> {
        let _tiles = self.products_scope();
        let (hidden, saved) = if activations == Activations::Kept && !self.layers_by_hand() {
            (self.hidden_states(batch)?, SavedActivations(Saved::Graph))
        } else {
            let (top, saved) = self.layers_for_backward(batch, activations)?;
            (self.final_norm(&top)?, saved)
        };
        // f32 (f64 for an f64 model), as the log-probs are.
        let dtype = match self.dtype() {
            candle_core::DType::F64 => candle_core::DType::F64,
            _ => candle_core::DType::F32,
        };
        let values = hidden
            .to_dtype(dtype)
            .and_then(|h| h.matmul(&head.t()?))
            .and_then(|v| v.reshape((batch.batch, batch.seq_len)))
            .ctx("value head")?;
        Ok((values, saved))
    }

    /// The decoder layers' forward outside any graph, keeping what their backward reads: the
    /// last layer's output (the variable a head's graph starts from) and the saved activations.
    fn layers_for_backward(
        &self,
        batch: &PackedBatch,
        activations: Activations,
    ) -> Result<(Tensor, SavedActivations)> {
        let hand = self.layers_by_hand();
        let inputs = self.layer_inputs(batch)?;
        let layers = self.config().num_layers;
        let mut tapes = Vec::new();
        let mut layer_inputs = Vec::new();
        let mut x = self.embed(&inputs)?.detach();
        for i in 0..layers {
            let out = if hand {
                let (out, tape) = self.layer_taped(i, &x, &inputs)?;
                if activations == Activations::Kept {
                    tapes.push(tape);
                }
                out
            } else {
                // Detaching drops the layer's graph, and with it every intermediate activation.
                self.layer(i, &x, &inputs)?.detach()
            };
            if activations == Activations::Recomputed {
                layer_inputs.push(x);
            }
            x = out;
        }
        let top = Var::from_tensor(&x).ctx("last layer output")?;
        let layers = match activations {
            Activations::Kept => Layers::Tapes(tapes),
            Activations::Recomputed => Layers::Inputs(layer_inputs),
        };
        let output = top.as_tensor().clone();
        let saved = Saved::Layers {
            inputs,
            layers,
            top,
        };
        Ok((output, SavedActivations(saved)))
    }

    /// [`TrainableModel::token_scores_for_backward`] keeping only each layer's input. Also the
    /// cheapest forward when no gradient is wanted (drop the saved activations).
    pub fn token_scores_recomputable(
        &self,
        batch: &PackedBatch,
        options: ForwardOptions,
    ) -> Result<(TokenScores, SavedActivations)> {
        self.token_scores_for_backward(batch, options, Activations::Recomputed)
    }

    /// Gradients of the scalar `loss`, built from the scores of
    /// [`TrainableModel::token_scores_for_backward`], for every parameter: the head's from
    /// `loss`, then each layer's, last first (recomputing its activations where only its input
    /// was kept), then the embedding's.
    pub fn backward_saved(&self, loss: &Tensor, saved: SavedActivations) -> Result<GradStore> {
        let _tiles = self.products_scope();
        let Saved::Layers {
            inputs,
            layers,
            top,
        } = saved.0
        else {
            return loss.backward().ctx("backward");
        };
        let mut store = loss.backward().ctx("backward through the head")?;
        let mut grad = store
            .remove(top.as_tensor())
            .ok_or_else(|| ModelError::input("the loss does not depend on the model's output"))?;
        match layers {
            Layers::Tapes(tapes) => {
                for (i, tape) in tapes.into_iter().enumerate().rev() {
                    grad = self.layer_backward(i, tape, &grad, &inputs, &mut store)?;
                }
            }
            Layers::Inputs(layer_inputs) => {
                let hand = self.layers_by_hand();
                for (i, input) in layer_inputs.iter().enumerate().rev() {
                    grad = if hand {
                        let (_, tape) = self.layer_taped(i, input, &inputs)?;
                        self.layer_backward(i, tape, &grad, &inputs, &mut store)?
                    } else {
                        self.layer_backward_by_graph(i, input, &grad, &inputs, &mut store)?
                    };
                }
            }
        }
        if self.low_rank.is_some() {
            // Frozen under LoRA.
            return Ok(store);
        }
        // The embedding's rows were gathered from the master table, then converted.
        let embed = &self.weights().embed;
        let rows = grad
            .to_dtype(embed.dtype())
            .and_then(|g| {
                let zeros = Tensor::zeros(embed.shape(), embed.dtype(), embed.device())?;
                zeros.index_add(inputs.ids(), &g, 0)
            })
            .ctx("embedding backward")?;
        accumulate(&mut store, embed, rows).ctx("embedding backward")?;
        Ok(store)
    }

    /// Whether the layers' backward is written by hand: where it is not turned off
    /// ([`TrainableModel::set_hand_backward`]) and the layers run the fused ops on weights
    /// already in the compute dtype (a forward that converts them itself keeps its graph).
    fn layers_by_hand(&self) -> bool {
        self.hand_backward && self.custom() && self.layer_weights_converted()
    }

    /// Layer `i`'s output for input `x` and its tape.
    fn layer_taped(
        &self,
        i: usize,
        x: &Tensor,
        inputs: &LayerInputs,
    ) -> Result<(Tensor, LayerTape)> {
        let context = format!("training forward, layer {i}");
        let cx = self.layer_context(inputs).ctx(&context)?;
        let w = self.layer_weights(i).ctx(&context)?;
        LayerTape::forward(&w, x, &cx).ctx(&context)
    }

    /// Adds layer `i`'s weight gradients to `store` and returns its input's.
    fn layer_backward(
        &self,
        i: usize,
        tape: LayerTape,
        grad: &Tensor,
        inputs: &LayerInputs,
        store: &mut GradStore,
    ) -> Result<Tensor> {
        let context = format!("backward, layer {i}");
        let cx = self.layer_context(inputs).ctx(&context)?;
        let w = self.layer_weights(i).ctx(&context)?;
        let adapters = self.low_rank.as_ref().map(|t| &t.layers[i]);
        let (dx, grads) = tape.backward(&w, grad, &cx, adapters).ctx(&context)?;
        for (tensor, g) in grads {
            accumulate(store, &tensor, g).ctx(&context)?;
        }
        Ok(dx)
    }

    /// [`TrainableModel::layer_backward`] by recomputing layer `i` from its saved input as a
    /// graph and back-propagating the gradient that reached its output.
    fn layer_backward_by_graph(
        &self,
        i: usize,
        input: &Tensor,
        grad: &Tensor,
        inputs: &LayerInputs,
        store: &mut GradStore,
    ) -> Result<Tensor> {
        let input = Var::from_tensor(input).ctx("layer input")?;
        let out = self.layer(i, input.as_tensor(), inputs)?;
        let context = format!("recomputed backward, layer {i}");
        let layer_store = (out * grad)
            .and_then(|t| t.sum_all())
            .and_then(|t| t.backward())
            .ctx(&context)?;
        for param in self.parameter_tensors() {
            if let Some(g) = layer_store.get(param) {
                accumulate(store, param, g.clone()).ctx(&context)?;
            }
        }
        layer_store
            .get(input.as_tensor())
            .cloned()
            .ok_or_else(|| ModelError::input(format!("no gradient reached layer {i}")))
    }

    /// What a layer's forward and backward read besides its weights and input.
    fn layer_context<'a>(
        &'a self,
        inputs: &'a LayerInputs,
    ) -> candle_core::Result<LayerContext<'a>> {
        let Some(segments) = inputs.segments() else {
            candle_core::bail!("the hand-written backward runs the fused attention")
        };
        Ok(LayerContext {
            config: self.config(),
            cos: inputs.cos(),
            sin: inputs.sin(),
            segments,
        })
    }
}

/// Adds `g` to `param`'s gradient in `store`.
fn accumulate(store: &mut GradStore, param: &Tensor, g: Tensor) -> candle_core::Result<()> {
    let sum = match store.get(param) {
        Some(acc) => (acc + g)?,
        None => g,
    };
    store.insert(param, sum);
    Ok(())
}
