//! `sluice model probe`: one prompt through a model directory on a chosen device and dtype,
//! printed as one JSON object, so two devices can be compared number for number
//! (`scripts/gpu-check` compares a GPU with the CPU).
//!
//! Two paths, the ones a run takes: the engine's (the inference model in `--dtype`, KV cache,
//! logits of the last position) and the trainer's (f32 master weights, the training forward of
//! every target, then the backward of `−mean log p(next token)` as the trainer takes it, the
//! weights converted once where the compute dtype is narrower: the gradients an RL step builds
//! its update from, with every advantage equal to 1). The engine's path is taken twice:
//! the whole prompt in one prefill (`logits`), and as a running engine meets it
//! (`decode_logits`): two sequences in the engine's paged cache, the prompt and the prompt
//! reversed, each prefilled with its first half and then fed the rest one token per step, both
//! in the same steps (the batched decode path), the last step's logits of each. The first row
//! of `decode_logits` is the same distribution as `logits`, by the other path.

use std::process::ExitCode;
use std::sync::Arc;

use anyhow::{Context, bail};
use sluice_model::candle::DType;
use sluice_model::{
    Activations, ContiguousKvCache, ForwardOptions, InferenceModel, LoadOptions, LogitsWanted,
    PackedBatch, PagedKvCache, StepInput, TrainableModel, load_checkpoint,
};

use sluice_model::config::candle_dtype;

use crate::cli::ModelProbeArgs;

/// Runs `sluice model probe`.
pub fn run(args: &ModelProbeArgs) -> anyhow::Result<ExitCode> {
    if args.tokens.len() < 2 {
        bail!("--tokens: expected at least 2 token ids (the gradients score each next token)");
    }
    let device = sluice_model::device(args.device).context("--device")?;
    let dtype = candle_dtype(args.dtype);
    let weights = Arc::new(
        load_checkpoint(
            &args.dir,
            &LoadOptions {
                dtype: Some(dtype),
                device: device.clone(),
            },
        )
        .with_context(|| format!("model {}", args.dir.display()))?,
    );
    let vocab = weights.config().vocab_size;
    if let Some(t) = args.tokens.iter().find(|&&t| t as usize >= vocab) {
        bail!("--tokens: id {t} is outside the vocabulary ({vocab})");
    }

    // The engine's path: prefill the prompt, logits of its last position.
    let model = InferenceModel::new(Arc::clone(&weights))?;
    let mut cache = ContiguousKvCache::new(model.config(), weights.dtype(), weights.device());
    let logits = model.step(
        &mut cache,
        &[StepInput {
            seq: 1,
            tokens: &args.tokens,
        }],
        LogitsWanted::Last,
    )?;
    let logits: Vec<f32> = logits.to_dtype(DType::F32)?.flatten_all()?.to_vec1()?;
    let decode_logits = decode_path(&model, &args.tokens)?;

    // The trainer's path: f32 master weights (converted once for the step under a narrower
    // compute dtype, as the trainer does), loss −mean log p over every next token, the
    // trainer's forward and backward.
    let mut trainable = TrainableModel::from_snapshot(&weights, DType::F32)?;
    trainable
        .set_compute_dtype(candle_dtype(args.compute_dtype))
        .context("--compute-dtype")?;
    sluice_trainer::native::convert_weights(&mut trainable)?;
    let batch = PackedBatch::from_rows(&[vec![&args.tokens[..]]], args.tokens.len(), 0)?;
    let (scores, saved) = trainable.token_scores_for_backward(
        &batch,
        ForwardOptions::default(),
        Activations::Kept,
    )?;
    let mask: Vec<f32> = batch
        .target_mask
        .iter()
        .map(|&m| if m { 1.0 } else { 0.0 })
        .collect();
    let targets = mask.iter().sum::<f32>();
    let mask = sluice_model::candle::Tensor::from_vec(mask, scores.logprobs.dims(), &device)?;
    let loss = ((scores.logprobs.to_dtype(DType::F32)? * mask)?
        .sum_all()?
        .affine(-1.0 / f64::from(targets), 0.0))?;
    let store = trainable.backward_saved(&loss, saved)?;
    // A parameter's gradient: its master's and its converted copy's, summed in f32.
    let mut grads: Vec<Option<sluice_model::candle::Tensor>> = vec![None; trainable.vars().len()];
    for (i, g) in trainable.parameter_gradients(&store) {
        let g = g.to_dtype(DType::F32)?;
        grads[i] = Some(match grads[i].take() {
            Some(sum) => (sum + g)?,
            None => g,
        });
    }
    let mut grad_norms = serde_json::Map::new();
    for ((name, _), g) in trainable.vars().iter().zip(grads) {
        let Some(g) = g else {
            bail!("parameter {name} received no gradient")
        };
        let norm = g.sqr()?.sum_all()?.sqrt()?.to_scalar::<f32>()?;
        grad_norms.insert(name.clone(), serde_json::json!(norm));
    }
    let out = serde_json::json!({
        "device": args.device.to_string(),
        "dtype": format!("{dtype:?}").to_lowercase(),
        "compute_dtype": args.compute_dtype.to_string(),
        "tokens": args.tokens,
        "logits": logits,
        "decode_logits": decode_logits,
        "loss": loss.to_scalar::<f32>()?,
        "grad_norms": grad_norms,
    });
    println!("{out}");
    Ok(ExitCode::SUCCESS)
}

/// The engine's decode path over `tokens` (see the module docs): rows of f32 logits, one per
/// sequence.
fn decode_path(model: &InferenceModel, tokens: &[u32]) -> anyhow::Result<Vec<Vec<f32>>> {
    const BLOCK_TOKENS: usize = 16;
    let reversed: Vec<u32> = tokens.iter().rev().copied().collect();
    let seqs = [tokens, &reversed[..]];
    let weights = model.snapshot();
    let blocks = seqs.len() * tokens.len().div_ceil(BLOCK_TOKENS);
    let mut cache = PagedKvCache::new(
        model.config(),
        weights.dtype(),
        weights.device(),
        blocks,
        BLOCK_TOKENS,
    )?;
    let half = tokens.len() / 2;
    let step = |cache: &mut PagedKvCache, range: std::ops::Range<usize>| {
        let rows: Vec<&[u32]> = seqs.iter().map(|t| &t[range.clone()]).collect();
        model.step(cache, &StepInput::numbered(&rows), LogitsWanted::Last)
    };
    let mut logits = step(&mut cache, 0..half)?;
    for i in half..tokens.len() {
        logits = step(&mut cache, i..i + 1)?;
    }
    Ok(logits.to_dtype(DType::F32)?.to_vec2()?)
}
