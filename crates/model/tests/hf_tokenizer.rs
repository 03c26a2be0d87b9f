//! A preset directory read by Python the usual way, `AutoTokenizer.from_pretrained(dir)`, gives
//! exactly our token ids: transformers 5 builds a `qwen2` model's tokenizer as `Qwen2Tokenizer`
//! (whatever `tokenizer_class` says) from the vocabulary alone, with Qwen2's pipeline, so the
//! written `tokenizer.json` must use that pipeline and the byte-level alphabet. A plain character
//! vocabulary lost every space and newline there (12 ids became 10; the quickstart's held-out
//! score fell from 30.4 % to 4.3 %).
//!
//! Two checks: the written files (always), and transformers itself on chat-rendered prompts
//! (`hf_tokenizer_check.py`, run when `python3` can import transformers; no download happens,
//! the directory is local).

use std::path::Path;
use std::process::Command;

use serde_json::{Value, json};
use sluice_core::Message;
use sluice_model::presets::{Preset, write_preset};
use sluice_model::{ChatOptions, Tokenizer};

/// Chat-rendered prompts of the kinds the pipeline renders: a system prompt, several turns,
/// spaces and newlines inside messages.
fn conversations() -> Vec<Vec<Message>> {
    vec![
        vec![Message::user("7+5=")],
        vec![
            Message::system("Answer with the number only."),
            Message::user("7+5="),
        ],
        vec![
            Message::system("You can use the calc tool. End with `[ANSWER] <number>`."),
            Message::user("Compute (37 * 12) - 5."),
            Message::assistant("Let me think.\n\n[ANSWER] 439"),
            Message::user("Sum the digits of 90210;\n  end with [ANSWER] n"),
        ],
    ]
}

fn json_file(path: &Path) -> Value {
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

#[test]
fn the_written_tokenizer_is_the_one_transformers_rebuilds() {
    let dir = tempfile::tempdir().unwrap();
    write_preset(Preset::Tiny, dir.path(), 0).unwrap();
    let config = json_file(&dir.path().join("tokenizer_config.json"));
    assert_eq!(config["tokenizer_class"], "Qwen2Tokenizer");
    let doc = json_file(&dir.path().join("tokenizer.json"));
    // What transformers 5's Qwen2Tokenizer imposes (normalizer, split, byte-level mapping).
    assert_eq!(doc["normalizer"], json!({"type": "NFC"}));
    let steps = &doc["pre_tokenizer"]["pretokenizers"];
    assert_eq!(steps[0]["type"], "Split");
    assert_eq!(steps[0]["behavior"], "Isolated");
    assert!(
        steps[0]["pattern"]["Regex"]
            .as_str()
            .unwrap()
            .starts_with(r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+"),
        "{}",
        steps[0]
    );
    assert_eq!(steps[1]["type"], "ByteLevel");
    assert_eq!(steps[1]["add_prefix_space"], false);
    assert_eq!(doc["decoder"]["type"], "ByteLevel");
    // Space and newline in the byte-level alphabet: a byte-level tokenizer never sees " " or
    // "\n", so those keys would drop every space and newline.
    let vocab = &doc["model"]["vocab"];
    assert_eq!(vocab["\u{0120}"], 0, "space is Ġ");
    assert_eq!(vocab["\u{010a}"], 95, "newline is Ċ");
    assert!(vocab.get(" ").is_none() && vocab.get("\n").is_none());

    // Our own ids are unchanged: one per ASCII character, specials whole.
    let tok = Tokenizer::from_dir(dir.path()).unwrap();
    let ids = tok
        .encode("<|im_start|>user\n7+5=<|im_end|>\n", false)
        .unwrap();
    assert_eq!(ids, [98, 85, 83, 69, 82, 95, 23, 11, 21, 29, 99, 95]);
    let text = "Hi there!\n12+30=42 ~";
    let ids = tok.encode(text, false).unwrap();
    assert_eq!(ids.len(), text.len());
    assert_eq!(tok.decode(&ids, false).unwrap(), text);
}

#[test]
fn transformers_auto_tokenizer_reproduces_our_ids_on_chat_prompts() {
    let dir = tempfile::tempdir().unwrap();
    let model = dir.path().join("model");
    write_preset(Preset::Tiny, &model, 0).unwrap();
    let tok = Tokenizer::from_dir(&model).unwrap();
    let options = ChatOptions {
        add_generation_prompt: true,
        ..ChatOptions::default()
    };
    let cases: Vec<Value> = conversations()
        .into_iter()
        .map(|messages| {
            let text = tok.apply_chat_template(&messages, &options).unwrap();
            let ids = tok.encode(&text, false).unwrap();
            let newlines = text.matches('\n').count();
            assert_eq!(
                ids.iter().filter(|&&i| i == 95).count(),
                newlines,
                "{text:?}"
            );
            json!({"messages": messages, "text": text, "ids": ids})
        })
        .collect();
    let cases_path = dir.path().join("cases.json");
    std::fs::write(&cases_path, serde_json::to_string(&cases).unwrap()).unwrap();

    let has_transformers = Command::new("python3")
        .args(["-c", "import transformers"])
        .output()
        .is_ok_and(|o| o.status.success());
    if !has_transformers {
        eprintln!("skipped the transformers check: python3 cannot import transformers");
        return;
    }
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/hf_tokenizer_check.py");
    let out = Command::new("python3")
        .arg(&script)
        .arg(&model)
        .arg(&cases_path)
        .env("HF_HUB_OFFLINE", "1")
        .env("TRANSFORMERS_OFFLINE", "1")
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "transformers disagrees:\n{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(stdout.starts_with("ok 3"), "{stdout}");
}
