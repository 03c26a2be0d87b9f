//! Reward models (part of the `checkpoint` test binary): a one-label sequence classifier's
//! directory loads, scores each conversation at its last token exactly as the value head over
//! the same decoder does, packs several conversations without changing a score, and a
//! directory that is not such a classifier is refused naming what is wrong.

use std::path::Path;

use candle_core::{Device, Tensor};
use rand::SeedableRng;
use rand_distr::{Distribution, Normal};
use serde_json::Value;
use sluice_core::Message;
use sluice_model::presets::{Preset, write_preset, write_reward_preset};
use sluice_model::reward::SCORE;
use sluice_model::{
    Activations, LoadOptions, PackedBatch, RewardModel, TrainableModel, load_checkpoint,
};

const SEED: u64 = 7;

/// A random head of `hidden` values, large enough that scores differ visibly.
fn head(hidden: usize) -> Vec<f32> {
    let mut rng = rand::rngs::StdRng::seed_from_u64(11);
    let normal = Normal::new(0.0f32, 0.5).unwrap();
    (0..hidden).map(|_| normal.sample(&mut rng)).collect()
}

fn hidden_size() -> usize {
    sluice_model::presets::preset_config(Preset::Tiny).hidden_size
}

fn conversations() -> Vec<Vec<Message>> {
    let ask = |q: &str, a: &str| {
        vec![
            Message::system("Answer with a number."),
            Message::user(q),
            Message::assistant(a),
        ]
    };
    vec![
        ask("What is 2 + 3?", "5"),
        ask("What is 2 + 3?", "The answer is 6, I think."),
        ask("What is 7 times 6?", "#### 42"),
    ]
}

#[test]
fn a_reward_model_scores_the_last_token_as_the_value_head_over_its_decoder_does() {
    let dir = tempfile::tempdir().unwrap();
    let rm_dir = dir.path().join("rm");
    let head = head(hidden_size());
    write_reward_preset(Preset::Tiny, &rm_dir, SEED, &head).unwrap();
    RewardModel::check(&rm_dir).unwrap();
    let rm = RewardModel::load(&rm_dir, &Device::Cpu).unwrap();

    let tokens: Vec<Vec<u32>> = conversations()
        .iter()
        .map(|c| rm.tokens(c).unwrap())
        .collect();
    let packed = rm.score_tokens(&tokens).unwrap();
    assert_eq!(packed.len(), 3);

    // The same decoder as a causal model, its value head at every slot of each sequence alone:
    // the classifier's score is the value at the last token.
    let causal_dir = dir.path().join("causal");
    write_preset(Preset::Tiny, &causal_dir, SEED).unwrap();
    let weights = load_checkpoint(&causal_dir, &LoadOptions::default()).unwrap();
    let model = TrainableModel::from_snapshot(&weights, candle_core::DType::F32).unwrap();
    let head_t = Tensor::from_slice(&head, (1, head.len()), &Device::Cpu).unwrap();
    for (i, t) in tokens.iter().enumerate() {
        let alone = rm.score_tokens(std::slice::from_ref(t)).unwrap()[0];
        let batch = PackedBatch::from_rows(&[vec![t.as_slice()]], t.len(), 0).unwrap();
        let (values, _) = model
            .values_for_backward(&batch, &head_t, Activations::Kept)
            .unwrap();
        let reference = values.flatten_all().unwrap().to_vec1::<f32>().unwrap()[t.len() - 1];
        assert!(
            (alone - reference).abs() < 1e-5 * (1.0 + reference.abs()),
            "conversation {i}: {alone} vs the value head's {reference}"
        );
        assert!(
            (packed[i] - alone).abs() < 1e-5 * (1.0 + alone.abs()),
            "conversation {i}: packed {} vs alone {alone}",
            packed[i]
        );
    }
    // Different replies to one question score differently.
    assert!((packed[0] - packed[1]).abs() > 1e-4, "{packed:?}");
    // A longer reply is a longer conversation; nothing empty is scored.
    assert!(tokens[1].len() > tokens[0].len());
    assert!(rm.score_tokens(&[vec![]]).is_err());
}

/// `dir/config.json` rewritten by `edit`.
fn edit_config(dir: &Path, edit: impl FnOnce(&mut serde_json::Map<String, Value>)) {
    let path = dir.join("config.json");
    let mut json: Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    edit(json.as_object_mut().unwrap());
    std::fs::write(&path, serde_json::to_string_pretty(&json).unwrap()).unwrap();
}

/// Why `dir` is refused, from the check and from the load alike.
fn refusal(dir: &Path) -> String {
    let checked = RewardModel::check(dir).unwrap_err().to_string();
    let loaded = RewardModel::load(dir, &Device::Cpu)
        .unwrap_err()
        .to_string();
    assert_eq!(checked, loaded);
    checked
}

#[test]
fn what_is_not_a_one_label_classifier_is_refused_naming_it() {
    let root = tempfile::tempdir().unwrap();
    let fresh = |name: &str| {
        let dir = root.path().join(name);
        write_reward_preset(Preset::Tiny, &dir, SEED, &head(hidden_size())).unwrap();
        dir
    };

    let two = fresh("two-labels");
    edit_config(&two, |c| {
        c.insert(
            "id2label".into(),
            serde_json::json!({"0": "bad", "1": "good"}),
        );
    });
    let e = refusal(&two);
    assert!(e.contains("id2label") && e.contains("has 2"), "{e}");

    let unlabelled = fresh("no-labels");
    edit_config(&unlabelled, |c| {
        c.remove("id2label");
        c.remove("label2id");
    });
    let e = refusal(&unlabelled);
    assert!(e.contains("id2label") && e.contains("two labels"), "{e}");

    let causal = fresh("causal");
    edit_config(&causal, |c| {
        c.insert(
            "architectures".into(),
            serde_json::json!(["Qwen2ForCausalLM"]),
        );
    });
    let e = refusal(&causal);
    assert!(
        e.contains("architectures") && e.contains("Qwen2ForCausalLM"),
        "{e}"
    );

    let headless = root.path().join("headless");
    write_preset(Preset::Tiny, &headless, SEED).unwrap();
    let config = std::fs::read_to_string(fresh("donor").join("config.json")).unwrap();
    std::fs::write(headless.join("config.json"), config).unwrap();
    let e = refusal(&headless);
    assert!(e.contains(SCORE), "{e}");

    let wide = fresh("wide");
    let weights = wide.join(sluice_model::checkpoint::SINGLE_FILE);
    let mut tensors = candle_core::safetensors::load(&weights, &Device::Cpu).unwrap();
    let h = hidden_size();
    tensors.insert(
        SCORE.into(),
        Tensor::zeros((2, h), candle_core::DType::F32, &Device::Cpu).unwrap(),
    );
    candle_core::safetensors::save(&tensors, &weights).unwrap();
    let e = refusal(&wide);
    assert!(e.contains(SCORE) && e.contains("[2,"), "{e}");
}
