//! HF checkpoint directories: bit-exact round trips (single file and sharded, tied and untied,
//! f32 and bf16), errors that name the broken tensor or config field; GGUF export → import
//! round trips (f32 exact, Q8_0 within its quantisation error, llama's q/k row layout).
//! Reward models (`checkpoint/reward.rs`): a one-label classifier scores as the value head does.

mod common;
#[path = "checkpoint/gguf.rs"]
mod gguf;
#[path = "checkpoint/reward.rs"]
mod reward;

use std::collections::HashMap;
use std::path::Path;

use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{DType, Tensor};
use common::{ALL_ARCHS, reference_logits, snapshot, tiny_config};
use serde_json::json;
use sluice_model::checkpoint::{INDEX_FILE, SINGLE_FILE};
use sluice_model::gguf::{ExportOptions, GgufFile, ImportOptions, export_gguf, import_gguf};
use sluice_model::presets;
use sluice_model::{
    Architecture, LoadOptions, ModelConfig, ModelWeights, SaveOptions, TrainableModel,
    load_checkpoint, save_checkpoint,
};

fn bits(t: &Tensor) -> Vec<u32> {
    // bf16/f16 → f32 is exact, so equal f32 bits mean equal original bits.
    let v: Vec<f32> = t
        .to_dtype(DType::F32)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1()
        .unwrap();
    v.into_iter().map(f32::to_bits).collect()
}

fn assert_same(a: &ModelWeights, b: &ModelWeights) {
    assert_eq!(a.len(), b.len());
    assert_eq!(**a.config(), **b.config());
    for (name, t) in a.iter() {
        let u = b
            .get(name)
            .unwrap_or_else(|| panic!("{name} missing after reload"));
        assert_eq!(t.dtype(), u.dtype(), "{name}");
        assert_eq!(bits(t), bits(u), "{name} changed in the round trip");
    }
}

#[test]
fn round_trip_is_bit_exact_single_and_sharded_tied_and_untied() {
    let cases = [
        (Architecture::Qwen2, true, DType::F32),
        (Architecture::Llama, false, DType::BF16),
        (Architecture::Qwen3, false, DType::F32),
    ];
    for (arch, tied, dtype) in cases {
        let mut config = tiny_config(arch, tied);
        config.dtype = dtype;
        let snap = snapshot(config, 7, dtype);
        for shard in [None, Some(2_000)] {
            let dir = tempfile::tempdir().unwrap();
            let options = SaveOptions {
                max_shard_bytes: shard,
            };
            save_checkpoint(&snap, dir.path(), &options).unwrap();
            let sharded = dir.path().join(INDEX_FILE).exists();
            assert_eq!(sharded, shard.is_some());
            assert_eq!(dir.path().join(SINGLE_FILE).exists(), shard.is_none());
            let loaded = load_checkpoint(dir.path(), &LoadOptions::default()).unwrap();
            assert_same(&snap, &loaded);
            if sharded {
                let index: serde_json::Value = serde_json::from_str(
                    &std::fs::read_to_string(dir.path().join(INDEX_FILE)).unwrap(),
                )
                .unwrap();
                let files: std::collections::BTreeSet<&str> = index["weight_map"]
                    .as_object()
                    .unwrap()
                    .values()
                    .map(|v| v.as_str().unwrap())
                    .collect();
                assert!(files.len() > 1, "{files:?}");
                assert!(index["weight_map"].get("lm_head.weight").is_some() != tied);
            }
            // Saving again into the same directory with the other layout leaves one layout.
            let other = SaveOptions {
                max_shard_bytes: if shard.is_some() { None } else { Some(2_000) },
            };
            save_checkpoint(&loaded, dir.path(), &other).unwrap();
            assert_ne!(
                dir.path().join(INDEX_FILE).exists(),
                dir.path().join(SINGLE_FILE).exists()
            );
            assert_same(
                &snap,
                &load_checkpoint(dir.path(), &LoadOptions::default()).unwrap(),
            );
        }
    }
}

#[test]
fn loading_converts_dtype_on_request() {
    let snap = snapshot(tiny_config(Architecture::Qwen2, true), 8, DType::F32);
    let dir = tempfile::tempdir().unwrap();
    save_checkpoint(&snap, dir.path(), &SaveOptions::default()).unwrap();
    let options = LoadOptions {
        dtype: Some(DType::BF16),
        ..LoadOptions::default()
    };
    let loaded = load_checkpoint(dir.path(), &options).unwrap();
    assert_eq!(loaded.dtype(), DType::BF16);
}

/// Rewrites `dir/model.safetensors` through `edit`.
fn rewrite(dir: &Path, edit: impl FnOnce(&mut HashMap<String, Tensor>)) {
    let path = dir.join(SINGLE_FILE);
    let mut tensors = candle_core::safetensors::load(&path, &candle_core::Device::Cpu).unwrap();
    edit(&mut tensors);
    candle_core::safetensors::save(&tensors, &path).unwrap();
}

#[test]
fn missing_or_misshaped_tensors_are_named() {
    let snap = snapshot(tiny_config(Architecture::Qwen2, false), 9, DType::F32);
    let name = "model.layers.1.self_attn.k_proj.bias";
    let dir = tempfile::tempdir().unwrap();
    save_checkpoint(&snap, dir.path(), &SaveOptions::default()).unwrap();
    rewrite(dir.path(), |t| {
        t.remove(name);
    });
    let err = load_checkpoint(dir.path(), &LoadOptions::default()).unwrap_err();
    assert_eq!(err.kind(), "missing_tensor");
    assert!(err.to_string().contains(name), "{err}");

    save_checkpoint(&snap, dir.path(), &SaveOptions::default()).unwrap();
    let name = "model.layers.0.mlp.down_proj.weight";
    rewrite(dir.path(), |t| {
        let w = t[name].t().unwrap().contiguous().unwrap();
        t.insert(name.to_owned(), w);
    });
    let err = load_checkpoint(dir.path(), &LoadOptions::default()).unwrap_err();
    assert_eq!(err.kind(), "tensor_shape");
    assert!(err.to_string().contains(name), "{err}");

    save_checkpoint(&snap, dir.path(), &SaveOptions::default()).unwrap();
    rewrite(dir.path(), |t| {
        t.remove("lm_head.weight");
    });
    let err = load_checkpoint(dir.path(), &LoadOptions::default()).unwrap_err();
    assert!(
        err.to_string().contains("lm_head.weight"),
        "an untied head is required: {err}"
    );
}

/// Rewrites the JSON header of `dir/model.safetensors` through `edit` (tensor data unchanged).
fn rewrite_header(dir: &Path, edit: impl FnOnce(&mut serde_json::Map<String, serde_json::Value>)) {
    let path = dir.join(SINGLE_FILE);
    let bytes = std::fs::read(&path).unwrap();
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let mut header: serde_json::Map<String, serde_json::Value> =
        serde_json::from_slice(&bytes[8..8 + n]).unwrap();
    edit(&mut header);
    let mut text = serde_json::to_string(&header).unwrap();
    while !text.len().is_multiple_of(8) {
        text.push(' ');
    }
    let mut out = (text.len() as u64).to_le_bytes().to_vec();
    out.extend_from_slice(text.as_bytes());
    out.extend_from_slice(&bytes[8 + n..]);
    std::fs::write(&path, out).unwrap();
}

/// A safetensors header that does not describe its data names the tensor at fault and what was
/// expected: the crate's own messages named none ("invalid shape, data type, or offset for
/// tensor"), or, for a tensor removed from the header, blamed the healthy one after it.
#[test]
fn safetensors_header_errors_name_the_tensor_at_fault() {
    let snap = snapshot(tiny_config(Architecture::Qwen2, false), 9, DType::F32);
    let dir = tempfile::tempdir().unwrap();
    let norm = "model.layers.0.input_layernorm.weight";
    let offsets = |h: &serde_json::Map<String, serde_json::Value>, name: &str| {
        let o = &h[name]["data_offsets"];
        (o[0].as_u64().unwrap(), o[1].as_u64().unwrap())
    };
    type Edit = Box<dyn FnOnce(&mut serde_json::Map<String, serde_json::Value>)>;
    let cases: Vec<(&str, Edit, Vec<String>)> = vec![
        (
            "removed",
            Box::new(move |h| {
                h.remove(norm);
            }),
            vec![
                "belong to no tensor".into(),
                "a tensor missing from the header?".into(),
            ],
        ),
        (
            "f16 over f32",
            Box::new(move |h| h[norm]["dtype"] = json!("F16")),
            vec![format!(
                "tensor `{norm}`: F16 of shape [16] needs 32 bytes, its data_offsets"
            )],
        ),
        (
            "shifted",
            Box::new(move |h| {
                let (s, e) = offsets(h, norm);
                h[norm]["data_offsets"] = json!([s + 4, e + 4]);
            }),
            vec![format!("tensors `{norm}` and `"), "overlap".into()],
        ),
        (
            "past the end",
            Box::new(move |h| {
                let last = h
                    .iter()
                    .filter(|(k, _)| *k != "__metadata__")
                    .max_by_key(|(_, v)| v["data_offsets"][1].as_u64().unwrap())
                    .map(|(k, _)| k.clone())
                    .unwrap();
                let (s, e) = offsets(h, &last);
                let shape: Vec<u64> = serde_json::from_value(h[&last]["shape"].clone()).unwrap();
                let mut grown = shape.clone();
                grown[0] += 1;
                let row = (e - s) / shape[0];
                h[&last]["shape"] = json!(grown);
                h[&last]["data_offsets"] = json!([s, e + row]);
            }),
            vec!["which holds only".into(), "a truncated file?".into()],
        ),
    ];
    for (case, edit, needles) in cases {
        save_checkpoint(&snap, dir.path(), &SaveOptions::default()).unwrap();
        rewrite_header(dir.path(), edit);
        for err in [
            load_checkpoint(dir.path(), &LoadOptions::default()).unwrap_err(),
            sluice_model::check_checkpoint(dir.path()).unwrap_err(),
        ] {
            assert_eq!(err.kind(), "safetensors", "{case}: {err}");
            let msg = err.to_string();
            assert!(msg.contains(SINGLE_FILE), "{case}: {msg}");
            for needle in &needles {
                assert!(
                    msg.contains(needle.as_str()),
                    "{case}: {needle:?} not in {msg}"
                );
            }
            assert!(!msg.contains("invalid offset"), "{case}: {msg}");
        }
    }
}

#[test]
fn weights_with_nan_or_inf_are_refused_naming_the_tensor() {
    let snap = snapshot(tiny_config(Architecture::Qwen2, false), 9, DType::F32);
    let dir = tempfile::tempdir().unwrap();
    for bad in [f32::NAN, f32::INFINITY] {
        save_checkpoint(&snap, dir.path(), &SaveOptions::default()).unwrap();
        let name = "model.layers.1.mlp.up_proj.weight";
        rewrite(dir.path(), |t| {
            let w = &t[name];
            let mut values = w.flatten_all().unwrap().to_vec1::<f32>().unwrap();
            values[3] = bad;
            let w = Tensor::from_vec(values, w.shape(), w.device()).unwrap();
            t.insert(name.to_owned(), w);
        });
        let err = load_checkpoint(dir.path(), &LoadOptions::default()).unwrap_err();
        assert_eq!(err.kind(), "non_finite_weights");
        assert!(
            err.to_string().contains(name) && err.to_string().contains("NaN or infinite"),
            "{err}"
        );
    }
}

fn hf_config() -> serde_json::Value {
    json!({
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "vocab_size": 151936,
        "hidden_size": 1024,
        "intermediate_size": 3072,
        "num_hidden_layers": 28,
        "num_attention_heads": 16,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000,
        "rope_scaling": null,
        "max_position_embeddings": 40960,
        "tie_word_embeddings": true,
        "torch_dtype": "bfloat16",
        "attention_bias": false,
        "attention_dropout": 0.0,
        "use_sliding_window": false,
        "sliding_window": null,
        "max_window_layers": 28,
        "bos_token_id": 151643,
        "eos_token_id": 151645,
        "use_cache": true,
        "initializer_range": 0.02,
        "transformers_version": "4.51.0"
    })
}

#[test]
fn real_configs_parse_and_round_trip() {
    let c = ModelConfig::from_json(&hf_config(), "qwen3.json").unwrap();
    assert_eq!(c.architecture, Architecture::Qwen3);
    assert_eq!((c.head_dim, c.num_kv_heads, c.kv_groups()), (128, 8, 2));
    assert_eq!(c.dtype, DType::BF16);
    assert_eq!(c.eos_token_ids, [151645]);
    assert!(
        (c.num_parameters() as f64 / 1e6 - 596.0).abs() < 1.0,
        "{}",
        c.num_parameters()
    );
    let back = ModelConfig::from_json(&c.to_hf_json(), "again").unwrap();
    assert_eq!(back, c);

    let llama = json!({
        "architectures": ["LlamaForCausalLM"], "vocab_size": 128256, "hidden_size": 2048,
        "intermediate_size": 8192, "num_hidden_layers": 16, "num_attention_heads": 32,
        "num_key_value_heads": 8, "rope_theta": 500000.0, "tie_word_embeddings": true,
        "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                         "original_max_position_embeddings": 8192, "rope_type": "llama3"},
        "eos_token_id": [128001, 128008, 128009], "mlp_bias": false, "pretraining_tp": 1
    });
    let c = ModelConfig::from_json(&llama, "llama.json").unwrap();
    assert_eq!(c.head_dim, 64);
    assert_eq!(c.rope_scaling.unwrap().factor, 32.0);
    assert_eq!(c.eos_token_ids, [128001, 128008, 128009]);
    assert_eq!(ModelConfig::from_json(&c.to_hf_json(), "again").unwrap(), c);
}

#[test]
fn unsupported_configs_are_refused_naming_the_field() {
    let cases: Vec<(&str, serde_json::Value)> = vec![
        ("architectures", json!(["MistralForCausalLM"])),
        (
            "rope_scaling.rope_type",
            json!({"rope_type": "yarn", "factor": 4.0}),
        ),
        ("attention_bias", json!(true)),
        ("hidden_act", json!("gelu")),
        ("num_key_value_heads", json!(5)),
        ("torch_dtype", json!("int8")),
        ("use_sliding_window", json!(true)),
        ("hidden_size", json!(-3)),
        // Ids the embedding has no row for (vocab_size 151936) were once accepted.
        ("eos_token_id", json!(151936)),
        ("eos_token_id", json!([151645, 200000])),
        ("bos_token_id", json!(151936)),
    ];
    for (field, value) in cases {
        let mut config = hf_config();
        let key = field.split('.').next().unwrap();
        config[key] = value;
        let err = ModelConfig::from_json(&config, "c.json").unwrap_err();
        assert_eq!(err.kind(), "invalid_model_config");
        assert!(
            err.to_string().contains(&format!("`{field}`")),
            "{field}: {err}"
        );
    }
    let mut config = hf_config();
    config["eos_token_id"] = json!(200000);
    let err = ModelConfig::from_json(&config, "c.json").unwrap_err();
    assert!(
        err.to_string().contains(
            "c.json: field `eos_token_id`: 200000 is outside the vocabulary (vocab_size 151936)"
        ),
        "{err}"
    );
    let mut config = hf_config();
    config.as_object_mut().unwrap().remove("num_hidden_layers");
    let err = ModelConfig::from_json(&config, "c.json").unwrap_err();
    assert!(err.to_string().contains("num_hidden_layers"), "{err}");
}

/// Rewrites `dir/config.json` through `edit`.
fn edit_config(dir: &Path, edit: impl FnOnce(&mut serde_json::Value)) {
    let path = dir.join("config.json");
    let mut config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    edit(&mut config);
    std::fs::write(&path, config.to_string()).unwrap();
}

/// Sizes past sane maxima are refused when the config is read, and sizes the tensors contradict
/// before anything is built per layer (H3: a config claiming 10⁹ layers over a tiny file once
/// aborted the process allocating 3.7 GB).
#[test]
fn config_sizes_are_bounded_and_checked_against_the_tensors() {
    for (field, value) in [
        ("num_hidden_layers", 1_000_000_000u64),
        ("hidden_size", 1 << 20),
        ("intermediate_size", 1 << 24),
        ("num_attention_heads", 4096),
        ("vocab_size", 1 << 30),
        ("max_position_embeddings", 1 << 30),
    ] {
        let mut config = hf_config();
        config[field] = json!(value);
        let err = ModelConfig::from_json(&config, "c.json").unwrap_err();
        assert_eq!(err.kind(), "invalid_model_config", "{field}");
        assert!(
            err.to_string()
                .contains(&format!("`{field}`: {value} is over the limit of")),
            "{field}: {err}"
        );
    }

    let snap = snapshot(tiny_config(Architecture::Qwen2, false), 9, DType::F32);
    let dir = tempfile::tempdir().unwrap();
    let cases = [
        (
            "num_hidden_layers",
            json!(1000),
            "1000 but the weight files hold 2 layers",
        ),
        (
            "vocab_size",
            json!(5000),
            "implies model.embed_tokens.weight has 5000 rows",
        ),
        (
            "intermediate_size",
            json!(96),
            "implies model.layers.0.mlp.gate_proj.weight has 96 rows",
        ),
    ];
    for (field, value, message) in cases {
        save_checkpoint(&snap, dir.path(), &SaveOptions::default()).unwrap();
        edit_config(dir.path(), |c| c[field] = value);
        for err in [
            load_checkpoint(dir.path(), &LoadOptions::default()).unwrap_err(),
            sluice_model::check_checkpoint(dir.path()).unwrap_err(),
        ] {
            assert_eq!(err.kind(), "invalid_model_config", "{field}: {err}");
            let msg = err.to_string();
            assert!(
                msg.contains("config.json") && msg.contains(&format!("`{field}`: {message}")),
                "{field}: {msg}"
            );
        }
    }
    save_checkpoint(&snap, dir.path(), &SaveOptions::default()).unwrap();
    assert_eq!(
        sluice_model::check_checkpoint(dir.path()).unwrap(),
        **snap.config()
    );
}

/// Shard names in the index are plain file names inside the model directory (H6: `../..` once
/// loaded weights from elsewhere and `/etc/passwd` was opened and mapped).
#[test]
fn shard_names_outside_the_directory_are_refused() {
    let snap = snapshot(tiny_config(Architecture::Llama, true), 3, DType::F32);
    let root = tempfile::tempdir().unwrap();
    let dir = root.path().join("model");
    let options = SaveOptions {
        max_shard_bytes: Some(2_000),
    };
    save_checkpoint(&snap, &dir, &options).unwrap();
    // A complete copy next door: `../other/<shard>` would load without complaint.
    save_checkpoint(&snap, &root.path().join("other"), &options).unwrap();
    let index_path = dir.join(INDEX_FILE);
    let original = std::fs::read_to_string(&index_path).unwrap();
    for bad in ["../other/", "/etc/passwd#", "./", "sub/"] {
        let mut index: serde_json::Value = serde_json::from_str(&original).unwrap();
        for v in index["weight_map"].as_object_mut().unwrap().values_mut() {
            let name = v.as_str().unwrap().to_owned();
            *v = json!(match bad.strip_suffix('#') {
                Some(whole) => whole.to_owned(),
                None => format!("{bad}{name}"),
            });
        }
        std::fs::write(&index_path, index.to_string()).unwrap();
        let err = load_checkpoint(&dir, &LoadOptions::default()).unwrap_err();
        let msg = err.to_string();
        assert!(
            msg.contains("shard names must be plain file names inside the model directory"),
            "{bad}: {msg}"
        );
        assert!(sluice_model::check_checkpoint(&dir).is_err());
    }
    std::fs::write(&index_path, original).unwrap();
    load_checkpoint(&dir, &LoadOptions::default()).unwrap();
}

/// Integer tensors are refused naming the tensor (M3: `I64` weights once loaded silently as
/// floats).
#[test]
fn integer_weight_tensors_are_refused_naming_the_tensor() {
    let snap = snapshot(tiny_config(Architecture::Qwen2, true), 4, DType::F32);
    let dir = tempfile::tempdir().unwrap();
    save_checkpoint(&snap, dir.path(), &SaveOptions::default()).unwrap();
    let name = "model.layers.1.mlp.up_proj.weight";
    rewrite(dir.path(), |t| {
        let w = t[name].to_dtype(DType::I64).unwrap();
        t.insert(name.to_owned(), w);
    });
    for err in [
        load_checkpoint(dir.path(), &LoadOptions::default()).unwrap_err(),
        sluice_model::check_checkpoint(dir.path()).unwrap_err(),
    ] {
        assert_eq!(err.kind(), "tensor_dtype");
        assert!(
            err.to_string()
                .contains(&format!("tensor `{name}` is stored as I64")),
            "{err}"
        );
    }
}
