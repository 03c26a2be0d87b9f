//! LoRA through the candle trainer (part of the `native` test binary): only the targeted
//! projections move, each by `s·B·A` of rank `r` as the PEFT adapter the checkpoint writes
//! says; the adapters' gradients are the chain rule's through the merged weight, formed by the
//! layers' backward as candle's graph gives them projected; a resume is exact; a checkpoint of
//! the other kind, or of other adapter settings, is refused.

use std::collections::HashMap;

use candle_core::backprop::GradStore;
use candle_core::{Tensor, Var};
use sluice_model::{Activations, TrainableModel};
use sluice_trainer::LoraConfig;

use super::*;

fn lora_config(rank: usize, targets: &[&str]) -> NativeTrainerConfig {
    let mut cfg = config(0.01, 4);
    cfg.lora = Some(LoraConfig {
        rank,
        alpha: 2.0 * rank as f64,
        targets: targets.iter().map(|t| (*t).to_owned()).collect(),
    });
    cfg
}

fn named(trainer: &NativeTrainer) -> HashMap<String, Tensor> {
    let vars = trainer.model().vars().iter();
    vars.map(|(n, v)| (n.clone(), v.as_tensor().copy().unwrap()))
        .collect()
}

fn max_abs(t: &Tensor) -> f32 {
    t.abs().unwrap().max_all().unwrap().to_scalar().unwrap()
}

#[test]
fn only_the_targets_move_each_by_the_saved_adapters_product() {
    let (rank, scale) = (2, 2.0);
    let mut trainer =
        NativeTrainer::new(tiny(21), lora_config(rank, &["q_proj", "down_proj"]), None).unwrap();
    let before = named(&trainer);
    for _ in 0..3 {
        let out = trainer.train_step(&fixed_batch()).unwrap();
        assert!(out.weights.is_some());
    }
    let after = named(&trainer);
    let mut moved = 0;
    for (name, w) in &after {
        let delta = (w - &before[name]).unwrap();
        let targeted = name.ends_with("q_proj.weight") || name.ends_with("down_proj.weight");
        if targeted {
            assert!(max_abs(&delta) > 1e-6, "{name} did not move");
            moved += 1;
        } else {
            assert_eq!(max_abs(&delta), 0.0, "{name} is frozen but moved");
        }
    }
    let layers = trainer.model().config().num_layers;
    assert_eq!(moved, 2 * layers);

    // The checkpoint: merged weights in model/, the adapters as PEFT writes them in adapter/.
    let dir = tempfile::tempdir().unwrap();
    trainer.checkpoint(dir.path()).unwrap();
    let peft: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(dir.path().join("adapter/adapter_config.json")).unwrap(),
    )
    .unwrap();
    assert_eq!(peft["peft_type"], "LORA");
    assert_eq!(peft["r"], rank);
    assert_eq!(peft["lora_alpha"], 2.0 * rank as f64);
    assert_eq!(
        peft["target_modules"],
        serde_json::json!(["q_proj", "down_proj"])
    );
    let adapters = candle_core::safetensors::load(
        dir.path().join("adapter/adapter_model.safetensors"),
        &Device::Cpu,
    )
    .unwrap();
    assert_eq!(adapters.len(), 4 * layers);
    for (name, w) in &after {
        let Some(module) = name.strip_suffix(".weight") else {
            continue;
        };
        let key = |which: &str| format!("base_model.model.{module}.lora_{which}.weight");
        let (Some(a), Some(b)) = (adapters.get(&key("A")), adapters.get(&key("B"))) else {
            continue;
        };
        let (out, inp) = w.dims2().unwrap();
        assert_eq!(a.dims(), [rank, inp], "{name}");
        assert_eq!(b.dims(), [out, rank], "{name}");
        // W = W₀ + s·B·A, to rounding.
        let merged = (&before[name] + (b.matmul(a).unwrap() * scale).unwrap()).unwrap();
        let err = max_abs(&(w - merged).unwrap());
        assert!(err < 1e-6, "{name}: {err}");
    }
}

#[test]
fn the_adapters_gradients_are_the_chain_rules_through_the_merged_weight() {
    let trainer = NativeTrainer::new(tiny(22), lora_config(3, &[]), None);
    // No target at all is refused by name.
    let err = trainer.unwrap_err().to_string();
    assert!(err.contains("trainer.lora_targets"), "{err}");

    let model = NativeTrainer::new(tiny(22), config(0.01, 4), None).unwrap();
    let model = model.model();
    let lora = LoraConfig {
        rank: 3,
        alpha: 6.0,
        targets: vec!["up_proj".into()],
    };
    let adapters = sluice_trainer::Adapters::new(model, &lora, 5).unwrap();
    // B starts at zero; give it values so both gradients are non-trivial.
    let vars = adapters.vars();
    let (a, b) = (&vars[0], &vars[1]);
    b.set(&Tensor::randn(0f32, 0.1, b.shape(), &Device::Cpu).unwrap())
        .unwrap();
    let (i, (_, w)) = model
        .vars()
        .iter()
        .enumerate()
        .find(|(_, (n, _))| n.ends_with("layers.0.mlp.up_proj.weight"))
        .unwrap();
    let g = Tensor::randn(0f32, 1.0, w.shape(), &Device::Cpu).unwrap();
    let none = GradStore::default();
    let projected = adapters.gradients(&none, vec![(i, g.clone())]).unwrap();
    assert_eq!(projected.len(), 2);
    assert_eq!(projected[0].0, 0);
    // candle's autograd through L = Σ G ⊙ (W₀ + s·B·A).
    let (a2, b2) = (
        Var::from_tensor(a.as_tensor()).unwrap(),
        Var::from_tensor(b.as_tensor()).unwrap(),
    );
    let merged = (w.as_tensor().detach() + (b2.matmul(&a2).unwrap() * 2.0).unwrap()).unwrap();
    let loss = (merged * &g).unwrap().sum_all().unwrap();
    let store = loss.backward().unwrap();
    for ((_, got), want) in projected.iter().zip([&a2, &b2]) {
        let want = store.get(want.as_tensor()).unwrap();
        let err = max_abs(&(got - want).unwrap()) / max_abs(want);
        assert!(err < 1e-5, "relative error {err}");
    }
    // A frozen parameter's gradient is dropped.
    let embed = (
        0,
        Tensor::zeros(model.vars()[0].1.shape(), DType::F32, &Device::Cpu).unwrap(),
    );
    assert!(adapters.gradients(&none, vec![embed]).unwrap().is_empty());
}

#[test]
fn the_backward_forms_the_adapters_gradients_as_the_graph_projects_them() {
    // Every projection adapted: the layers' hand-written backward forms
    // dA and dB from each projection's input and output gradient; candle's graph forms the
    // weights' gradients, which the trainer projects. Three steps (B moves off zero after the
    // first) land on the same weights.
    let cfg = lora_config(4, &sluice_trainer::lora::TARGETS);
    let mut hand = NativeTrainer::new(tiny(24), cfg.clone(), None).unwrap();
    let mut graph = NativeTrainer::new(tiny(24), cfg, None).unwrap();
    graph.set_graph_backward(true);
    for _ in 0..3 {
        let (a, b) = (
            hand.train_step(&fixed_batch()).unwrap(),
            graph.train_step(&fixed_batch()).unwrap(),
        );
        let norm = |out: &sluice_core::TrainStepOutput| out.metrics[m::TRAINER_GRAD_NORM_VALUE];
        let (a, b) = (norm(&a), norm(&b));
        assert!(b > 0.0 && (a - b).abs() / b < 1e-4, "grad norm {a} vs {b}");
    }
    let (after_hand, after_graph) = (named(&hand), named(&graph));
    for (name, w) in &after_hand {
        let err = max_abs(&(w - &after_graph[name]).unwrap());
        assert!(err < 1e-5, "{name}: {err}");
    }
}

#[test]
fn with_adapters_the_backward_forms_theirs_and_no_parameters() {
    let snapshot = tiny(25);
    let mut model = TrainableModel::from_snapshot(&snapshot, DType::F32).unwrap();
    let lora = LoraConfig {
        rank: 2,
        alpha: 4.0,
        targets: vec!["k_proj".into(), "up_proj".into()],
    };
    let adapters = sluice_trainer::Adapters::new(&model, &lora, 7).unwrap();
    model.set_low_rank(adapters.low_rank()).unwrap();
    let batch =
        PackedBatch::from_rows(&[vec![&[5, 6, 7, 8, 9][..], &[5, 6, 10][..]]], 8, 0).unwrap();
    let backward = |model: &TrainableModel| {
        let (scores, saved) = model
            .token_scores_for_backward(&batch, ForwardOptions::default(), Activations::Kept)
            .unwrap();
        let loss = scores.logprobs.sum_all().unwrap();
        model.backward_saved(&loss, saved).unwrap()
    };
    let store = backward(&model);
    // Every A and B has its gradient (B starts at zero, so A's is zero at first), and no
    // parameter has one: embeddings, norms, the head and the weights are frozen.
    for v in adapters.vars() {
        let g = store
            .get(v.as_tensor())
            .expect("an adapter without a gradient");
        assert_eq!(g.dims(), v.dims());
    }
    let b = &adapters.vars()[1];
    assert!(max_abs(store.get(b.as_tensor()).unwrap()) > 0.0);
    assert!(model.parameter_gradients(&store).is_empty());
    // A name that is no projection's weight, and adapters that do not fit, are refused.
    let mut low_rank = adapters.low_rank();
    low_rank[0].0 = "model.embed_tokens.weight".into();
    let err = model.set_low_rank(low_rank).unwrap_err().to_string();
    assert!(err.contains("model.embed_tokens.weight"), "{err}");
    let mut low_rank = adapters.low_rank();
    low_rank[1].0 = low_rank[0].0.clone(); // up_proj's adapters on a k_proj
    let err = model.set_low_rank(low_rank).unwrap_err().to_string();
    assert!(err.contains("wanted"), "{err}");
    // Without adapters every parameter has its gradient again.
    model.set_low_rank(Vec::new()).unwrap();
    let grads = model.parameter_gradients(&backward(&model));
    assert_eq!(grads.len(), model.vars().len());
}

#[test]
fn a_lora_resume_is_exact_and_refuses_other_settings() {
    let cfg = lora_config(2, &["q_proj", "v_proj", "gate_proj"]);
    let mut straight = NativeTrainer::new(tiny(23), cfg.clone(), None).unwrap();
    for _ in 0..4 {
        straight.train_step(&fixed_batch()).unwrap();
    }
    let dir = tempfile::tempdir().unwrap();
    let ckpt = dir.path().join("checkpoint");
    let mut first = NativeTrainer::new(tiny(23), cfg.clone(), None).unwrap();
    for _ in 0..2 {
        first.train_step(&fixed_batch()).unwrap();
    }
    first.checkpoint(&ckpt).unwrap();
    drop(first);
    // From other initial weights, restored, it continues to the same weights.
    let mut resumed = NativeTrainer::new(tiny(99), cfg.clone(), None).unwrap();
    resumed.restore(&ckpt).unwrap();
    for _ in 0..2 {
        resumed.train_step(&fixed_batch()).unwrap();
    }
    let (got, want) = (params(&resumed), params(&straight));
    for (g, w) in got.iter().zip(&want) {
        let err = g
            .iter()
            .zip(w)
            .map(|(a, b)| (a - b).abs())
            .fold(0.0, f32::max);
        // The merged weights and the adapters are read back as saved, and each update adds
        // its change to them: the same to the bit.
        assert_eq!(err, 0.0);
    }

    let refused = |cfg: NativeTrainerConfig, expected: &[&str]| {
        let mut t = NativeTrainer::new(tiny(23), cfg, None).unwrap();
        let err = t.restore(&ckpt).unwrap_err().to_string();
        for e in expected {
            assert!(err.contains(e), "`{e}` not in: {err}");
        }
    };
    refused(config(0.01, 4), &["adapter/", "trainer.lora_rank = 0"]);
    refused(
        lora_config(4, &["q_proj", "v_proj", "gate_proj"]),
        &["rank 2", "rank 4", "adapter_config.json"],
    );
    // A checkpoint where every weight trained is refused by a LoRA trainer.
    let full = dir.path().join("full");
    let mut plain = NativeTrainer::new(tiny(23), config(0.01, 4), None).unwrap();
    plain.train_step(&fixed_batch()).unwrap();
    plain.checkpoint(&full).unwrap();
    let mut t = NativeTrainer::new(tiny(23), cfg, None).unwrap();
    let err = t.restore(&full).unwrap_err().to_string();
    assert!(err.contains("every weight trained"), "{err}");
}
