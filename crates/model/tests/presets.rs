//! `sluice model init` presets: complete, loadable HF directories with a working tokenizer and
//! chat template, deterministic in the seed.

use candle_core::DType;
use sluice_core::Message;
use sluice_model::presets::{Preset, preset_config, write_preset};
use sluice_model::{ChatOptions, LoadOptions, Tokenizer, load_checkpoint};

#[test]
fn tiny_preset_is_a_complete_model_directory() {
    let dir = tempfile::tempdir().unwrap();
    write_preset(Preset::Tiny, dir.path(), 7).unwrap();
    for file in [
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "generation_config.json",
    ] {
        assert!(dir.path().join(file).exists(), "{file} missing");
    }
    let snap = load_checkpoint(dir.path(), &LoadOptions::default()).unwrap();
    assert_eq!(**snap.config(), preset_config(Preset::Tiny));
    assert_eq!(snap.dtype(), DType::F32);
    assert!(snap.config().num_parameters() < 200_000);

    let tok = Tokenizer::from_dir(dir.path()).unwrap();
    assert_eq!(tok.vocab_size(), snap.config().vocab_size);
    let im_end = tok.token_to_id("<|im_end|>").unwrap();
    let eot = tok.token_to_id("<|endoftext|>").unwrap();
    assert_eq!(tok.eos_token_ids(), [im_end, eot]);
    assert_eq!(tok.pad_token_id(), Some(eot));

    let text = "Hi there!\n12+30=42 ~";
    let ids = tok.encode(text, false).unwrap();
    assert_eq!(ids.len(), text.len(), "one token per character");
    assert_eq!(tok.decode(&ids, false).unwrap(), text);
    let tagged = "<|im_start|>user\n<think>x</think><tool_call>{}</tool_call><|im_end|>";
    let ids = tok.encode(tagged, false).unwrap();
    assert_eq!(ids[0], tok.token_to_id("<|im_start|>").unwrap());
    assert_eq!(ids.len(), 1 + 5 + 1 + 1 + 1 + 1 + 2 + 1 + 1);
    assert_eq!(tok.decode(&ids, false).unwrap(), tagged);
    // Specials are dropped when asked, the reasoning/tool tags are kept (not special).
    assert_eq!(
        tok.decode(&ids, true).unwrap(),
        "user\n<think>x</think><tool_call>{}</tool_call>"
    );
    let unk = tok.encode("é", false).unwrap();
    assert_eq!(unk, [tok.token_to_id("<unk>").unwrap()]);

    let prompt = tok
        .apply_chat_template(
            &[Message::user("1+1=")],
            &ChatOptions {
                add_generation_prompt: true,
                ..ChatOptions::default()
            },
        )
        .unwrap();
    assert_eq!(
        prompt,
        "<|im_start|>user\n1+1=<|im_end|>\n<|im_start|>assistant\n"
    );
}

#[test]
fn preset_weights_are_deterministic_in_the_seed() {
    let read = |seed: u64| {
        let dir = tempfile::tempdir().unwrap();
        write_preset(Preset::Tiny, dir.path(), seed).unwrap();
        std::fs::read(dir.path().join("model.safetensors")).unwrap()
    };
    assert_eq!(read(3), read(3));
    assert_ne!(read(3), read(4));
}

#[test]
fn small_preset_is_in_the_benchmark_size_range() {
    let n = preset_config(Preset::Small).num_parameters();
    assert!((50_000_000..=100_000_000).contains(&n), "{n}");
}

#[test]
fn medium_preset_has_qwen2_5_0_5b_layer_shapes() {
    let c = preset_config(Preset::Medium);
    let shapes = (
        c.hidden_size,
        c.num_layers,
        c.num_heads,
        c.num_kv_heads,
        c.intermediate_size,
    );
    assert_eq!(shapes, (896, 24, 14, 2, 4864));
    assert_eq!(c.head_dim, 64);
    // Qwen2.5-0.5B has 494M parameters, 136M of them in its 151,936-token embedding.
    let n = c.num_parameters();
    assert!((350_000_000..=365_000_000).contains(&n), "{n}");
}
