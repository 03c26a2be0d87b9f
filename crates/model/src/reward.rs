//! Reward models: a Hugging Face `*ForSequenceClassification` directory with one label (a
//! Bradley–Terry reward model, as OpenRLHF and TRL train them and verl's reward worker scores
//! with). Its decoder is a causal model's without the LM head, and `score.weight`, one
//! `1 × hidden` row, reads the final-norm hidden state at the conversation's last token, as
//! transformers pools a sequence classifier at its last token. The conversation is rendered
//! with the reward model's own chat template and tokenizer, which need not be the policy's.

use std::path::{Path, PathBuf};

use candle_core::{DType, Device, Tensor};
use serde_json::Value;
use sluice_core::Message;
use sluice_core::files::read_text_capped;

use crate::batch::PackedBatch;
use crate::chat::ChatOptions;
use crate::checkpoint::{
    JSON_FILE_MAX_BYTES, LoadOptions, check_checkpoint_with, load_checkpoint_with,
};
use crate::config::{ModelConfig, config_err};
use crate::error::{ModelError, Result, TensorContext};
use crate::snapshot::ModelWeights;
use crate::tokenizer::Tokenizer;
use crate::train::TrainableModel;

/// The classifier head's tensor.
pub const SCORE: &str = "score.weight";

/// Most tokens packed into one row of a scoring forward (a longer conversation takes a row of
/// its own). The packed attention skips the keys before each conversation's first, so a row's
/// conversations cost what they would alone.
const ROW_TOKENS: usize = 4096;

/// A loaded reward model: its decoder, head, tokenizer and chat template.
#[derive(Debug)]
pub struct RewardModel {
    model: TrainableModel,
    /// `(1, hidden)`, f32 (f64 for an f64 model).
    head: Tensor,
    tokenizer: Tokenizer,
    dir: PathBuf,
}

impl RewardModel {
    /// Loads `dir` onto `device`: `config.json` must name `LlamaForSequenceClassification`,
    /// `Qwen2ForSequenceClassification` or `Qwen3ForSequenceClassification` with one label
    /// (`id2label`, else `num_labels`; transformers' default is two), the weights hold
    /// `score.weight` of shape `(1, hidden_size)`, and `tokenizer.json` and a chat template
    /// are there. Weights compute in f32 on the CPU and bf16 on a GPU (f32 kept either way).
    pub fn load(dir: &Path, device: &Device) -> Result<Self> {
        let tokenizer = tokenizer(dir)?;
        let options = LoadOptions {
            dtype: Some(DType::F32),
            device: device.clone(),
        };
        let (weights, head) = load_classifier(dir, &options)?;
        let mut model = TrainableModel::from_snapshot(&weights, DType::F32)?;
        drop(weights);
        if device.is_cuda() {
            model.set_compute_dtype(DType::BF16)?;
        }
        crate::device::settle(device)?;
        Ok(Self {
            model,
            head,
            tokenizer,
            dir: dir.to_owned(),
        })
    }

    /// Checks that `dir` would load as [`RewardModel::load`] loads it, reading no tensor data
    /// (the headers, the config, the tokenizer and its template); returns the decoder's config.
    pub fn check(dir: &Path) -> Result<ModelConfig> {
        let config = check_classifier(dir)?;
        tokenizer(dir)?;
        Ok(config)
    }

    /// The directory it was loaded from.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The model's config (its decoder's: the causal architecture the classifier is built on).
    pub fn config(&self) -> &ModelConfig {
        self.model.config()
    }

    /// The token ids of `messages` rendered with the reward model's chat template, as
    /// transformers' `apply_chat_template(messages, tokenize=True)` gives them (no generation
    /// prompt: the last message is the reply scored).
    pub fn tokens(&self, messages: &[Message]) -> Result<Vec<u32>> {
        let text = self
            .tokenizer
            .apply_chat_template(messages, &ChatOptions::default())?;
        self.tokenizer.encode(&text, false)
    }

    /// The reward of each sequence: the head over the final-norm hidden state at its last
    /// token. Sequences are packed several to a row (each sees only itself), so a group's
    /// replies take one forward.
    pub fn score_tokens(&self, sequences: &[Vec<u32>]) -> Result<Vec<f32>> {
        if let Some(i) = sequences.iter().position(Vec::is_empty) {
            return Err(ModelError::input(format!("sequence {i} is empty")));
        }
        let context = self.config().max_position_embeddings;
        if let Some((i, s)) = sequences
            .iter()
            .enumerate()
            .find(|(_, s)| s.len() > context)
        {
            return Err(ModelError::input(format!(
                "sequence {i} is {} tokens, more than the reward model's context ({context}, max_position_embeddings)",
                s.len()
            )));
        }
        let mut rows: Vec<Vec<&[u32]>> = Vec::new();
        let mut used = Vec::new();
        // Where each sequence's last token lands: (row, slot).
        let mut last = Vec::with_capacity(sequences.len());
        for seq in sequences {
            let fits = used
                .last()
                .is_some_and(|&u: &usize| u + seq.len() <= ROW_TOKENS);
            if !fits {
                rows.push(Vec::new());
                used.push(0);
            }
            let r = rows.len() - 1;
            rows[r].push(seq);
            used[r] += seq.len();
            last.push((r, used[r] - 1));
        }
        let seq_len = used.iter().copied().max().unwrap_or(1);
        let batch = PackedBatch::from_rows(&rows, seq_len, 0)?;
        let hidden = self.model.hidden_states(&batch)?.detach();
        let index: Vec<u32> = last
            .iter()
            .map(|&(r, slot)| (r * seq_len + slot) as u32)
            .collect();
        let index = Tensor::new(index.as_slice(), hidden.device()).ctx("last tokens")?;
        let scores = hidden
            .index_select(&index, 0)
            .and_then(|h| h.to_dtype(self.head.dtype()))
            .and_then(|h| h.matmul(&self.head.t()?))
            .and_then(|s| s.flatten_all())
            .and_then(|s| s.to_dtype(DType::F32))
            .and_then(|s| s.to_vec1::<f32>())
            .ctx("reward head")?;
        Ok(scores)
    }
}

/// A one-label classifier's decoder (as a causal model whose LM head is tied to its
/// embedding: [`classifier_config`]) and its head `score.weight`, `(1, hidden)`: a reward
/// model's, or a critic's (`*ForTokenClassification`, verl's critic checkpoints).
pub fn load_classifier(dir: &Path, options: &LoadOptions) -> Result<(ModelWeights, Tensor)> {
    let config = classifier_config(dir)?;
    let hidden = config.hidden_size;
    let (weights, mut extra) = load_checkpoint_with(dir, config, &[SCORE], options)?;
    let head = extra.remove(0);
    check_head(head.dims(), hidden)?;
    Ok((weights, head))
}

/// Checks that `dir` would load as [`load_classifier`] loads it, reading no tensor data;
/// returns the decoder's config.
pub fn check_classifier(dir: &Path) -> Result<ModelConfig> {
    let config = classifier_config(dir)?;
    let shapes = check_checkpoint_with(dir, &config, &[SCORE])?;
    check_head(&shapes[0], config.hidden_size)?;
    Ok(config)
}

/// `score.weight` is one row of the hidden size.
fn check_head(shape: &[usize], hidden: usize) -> Result<()> {
    if shape == [1, hidden] {
        return Ok(());
    }
    Err(ModelError::TensorShape {
        name: SCORE.into(),
        expected: vec![1, hidden],
        actual: shape.to_vec(),
    })
}

/// The reward model's tokenizer, which must have a chat template.
fn tokenizer(dir: &Path) -> Result<Tokenizer> {
    let tokenizer = Tokenizer::from_dir(dir)?;
    if tokenizer.chat_template().is_none() {
        return Err(ModelError::ChatTemplate {
            reason: format!(
                "{}: the reward model has no chat template (tokenizer_config.json `chat_template` or chat_template.jinja); it scores conversations rendered with its own",
                dir.display()
            ),
        });
    }
    Ok(tokenizer)
}

/// The classifier class `dir/config.json` names (`Qwen2ForSequenceClassification`, …), if
/// it names one: which directories [`classifier_config`] is for.
pub fn classifier_class(dir: &Path) -> Option<String> {
    let text = read_text_capped(
        &dir.join("config.json"),
        JSON_FILE_MAX_BYTES,
        "model JSON files",
    )
    .ok()?;
    let value: Value = serde_json::from_str(&text).ok()?;
    let class = value.get("architectures")?.get(0)?.as_str()?;
    CLASSIFIER_SUFFIXES
        .iter()
        .any(|s| class.ends_with(s))
        .then(|| class.to_owned())
}

/// The class name endings of the classifiers Sluice loads.
const CLASSIFIER_SUFFIXES: [&str; 2] = ["ForSequenceClassification", "ForTokenClassification"];

/// `dir/config.json` read as the causal model a one-label classifier is built on: its class
/// `XForSequenceClassification` (or `XForTokenClassification`) read as `XForCausalLM`, the LM
/// head (which a classifier does not have) tied to the embedding so nothing more is looked for.
pub fn classifier_config(dir: &Path) -> Result<ModelConfig> {
    let path = dir.join("config.json");
    let origin = path.display().to_string();
    let text = read_text_capped(&path, JSON_FILE_MAX_BYTES, "model JSON files")?;
    let mut value: Value = serde_json::from_str(&text).map_err(|source| ModelError::Json {
        path: path.clone(),
        source,
    })?;
    let Value::Object(map) = &mut value else {
        return Err(config_err(&origin, "<root>", "expected a JSON object"));
    };
    let class = map
        .get("architectures")
        .and_then(Value::as_array)
        .filter(|a| a.len() == 1)
        .and_then(|a| a[0].as_str())
        .unwrap_or_default()
        .to_owned();
    let base = CLASSIFIER_SUFFIXES
        .iter()
        .find_map(|suffix| class.strip_suffix(suffix));
    let Some(base) = base else {
        return Err(config_err(
            &origin,
            "architectures",
            format!(
                "expected a classifier of one label (LlamaForSequenceClassification, Qwen2ForSequenceClassification, Qwen3ForSequenceClassification, or the same ForTokenClassification), got `{class}`"
            ),
        ));
    };
    let labels = match (map.get("id2label"), map.get("num_labels")) {
        (Some(Value::Object(labels)), _) => Some(("id2label", labels.len())),
        (_, Some(n)) => n.as_u64().map(|n| ("num_labels", n as usize)),
        _ => None,
    };
    match labels {
        Some((_, 1)) => {}
        Some((field, n)) => {
            return Err(config_err(
                &origin,
                field,
                format!("a reward model has one label; this classifier has {n}"),
            ));
        }
        None => {
            return Err(config_err(
                &origin,
                "id2label",
                "absent (or not an object), and num_labels too: transformers reads that as two labels, a reward model has one",
            ));
        }
    }
    map.insert(
        "architectures".into(),
        Value::from(vec![format!("{base}ForCausalLM")]),
    );
    map.insert("tie_word_embeddings".into(), Value::Bool(true));
    for field in ["id2label", "label2id", "num_labels"] {
        map.remove(field);
    }
    ModelConfig::from_json(&value, &origin)
}
