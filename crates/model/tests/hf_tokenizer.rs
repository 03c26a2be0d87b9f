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
//!
//! Tokenizers imported from GGUF metadata: a trained byte-level BPE written to GGUF with each
//! supported `tokenizer.ggml.pre` name comes back with the original's ids (and the names are
//! told apart by the corpus); a SentencePiece (`llama`) vocabulary encodes as SentencePiece's
//! score-ordered merging does, with byte fallback.

#[path = "hf_tokenizer/refusals.rs"]
mod refusals;

use std::path::Path;
use std::process::Command;

use candle_core::Device;
use candle_core::quantized::{QTensor, gguf_file};
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

/// Text that tells pre-tokenizers apart: digit runs, whitespace runs, contractions, CJK,
/// emoji (with joiners and skin tones), accents, and special tokens inside the text.
const GGUF_CORPUS: &[&str] = &[
    "The capital of France is Paris. It's 2024, and 1234567 people don't know.",
    "  two leading spaces,   three inside,\ttab\n\nnewlines\r\nand a trailing space ",
    "日本語のテキストと中文，한국어도 있습니다。",
    "emoji 😀👍🏽 family 👨‍👩‍👧 flag 🇫🇷",
    "accents: café naïve résumé Ünïcödé ÀÉÎÕÜ",
    "<|im_start|>user\nWhat is 37 * 12?<|im_end|>\n<|im_start|>assistant\n<think>444</think>444<|im_end|>",
    "I'M HERE, YOU'RE THERE, WE'LL SEE; they've said he'd 3.14159 and 10,000,000",
    "code:\n    def f(x):\n        return x**2  # squares\n",
];

/// `tokenizer.ggml.pre` names with the `tokenizer.json` pipeline (normalizer, pre-tokenizer) of
/// the HF tokenizers they stand for: SmolLM2's, GPT-2's, Llama 3's and Qwen2's files.
fn hf_pipelines() -> Vec<(&'static str, Value, Value)> {
    let byte_level = |re: bool| json!({"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": re});
    let split = |re: &str| json!({"type": "Split", "pattern": {"Regex": re}, "behavior": "Isolated", "invert": false});
    vec![
        (
            "smollm",
            Value::Null,
            json!({"type": "Sequence", "pretokenizers": [{"type": "Digits", "individual_digits": true}, byte_level(true)]}),
        ),
        ("gpt2", Value::Null, byte_level(true)),
        (
            "llama-bpe",
            Value::Null,
            json!({"type": "Sequence", "pretokenizers": [split(r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"), byte_level(false)]}),
        ),
        (
            "qwen2",
            json!({"type": "NFC"}),
            json!({"type": "Sequence", "pretokenizers": [split(r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"), byte_level(false)]}),
        ),
    ]
}

/// A byte-level BPE trained on the corpus with no pre-tokenization at all, so its merges
/// cross word, digit and space boundaries and each pre-tokenizer gives different ids. Returns
/// the `model` and `added_tokens` parts of its `tokenizer.json`.
fn trained_byte_level_bpe() -> (Value, Value) {
    use tokenizers::models::bpe::{BPE, BpeTrainerBuilder};
    use tokenizers::pre_tokenizers::byte_level::ByteLevel;
    use tokenizers::{
        AddedToken, DecoderWrapper, NormalizerWrapper, PostProcessorWrapper, TokenizerBuilder,
        TokenizerImpl,
    };
    let specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"];
    let mut trainer = BpeTrainerBuilder::new()
        .vocab_size(700)
        .min_frequency(2)
        .show_progress(false)
        .initial_alphabet(ByteLevel::alphabet().into_iter().collect())
        .special_tokens(
            specials
                .iter()
                .map(|s| AddedToken::from(*s, true))
                .collect(),
        )
        .build();
    let mut tok: TokenizerImpl<
        BPE,
        NormalizerWrapper,
        ByteLevel,
        PostProcessorWrapper,
        DecoderWrapper,
    > = TokenizerBuilder::new()
        .with_model(BPE::default())
        .with_pre_tokenizer(Some(ByteLevel::new(false, false, false)))
        .build()
        .unwrap();
    let lines: Vec<String> = (0..20)
        .flat_map(|_| GGUF_CORPUS.iter().map(|s| s.to_string()))
        .collect();
    tok.train(&mut trainer, lines.iter()).unwrap();
    let mut doc: Value = serde_json::from_str(&tok.to_string(false).unwrap()).unwrap();
    let n = doc["model"]["vocab"].as_object().unwrap().len();
    let mut added = doc["added_tokens"].take();
    for (i, content) in ["<think>", "</think>"].iter().enumerate() {
        added.as_array_mut().unwrap().push(json!({
            "id": n + i, "content": content, "single_word": false, "lstrip": false,
            "rstrip": false, "normalized": false, "special": false,
        }));
    }
    (doc["model"].take(), added)
}

/// A model directory holding the trained vocabulary with one HF pipeline, and seeded weights
/// sized to it.
fn bpe_model_dir(
    model: &Value,
    added: &Value,
    normalizer: &Value,
    pre: &Value,
) -> tempfile::TempDir {
    use candle_core::{DType, Device};
    let dir = tempfile::tempdir().unwrap();
    let vocab = model["vocab"].as_object().unwrap().len() + 2;
    let mut config = sluice_model::presets::preset_config(Preset::Tiny);
    config.vocab_size = vocab;
    config.eos_token_ids = vec![2];
    let config = std::sync::Arc::new(config);
    let snap = sluice_model::presets::random_snapshot(config, 1, DType::F32, &Device::Cpu).unwrap();
    sluice_model::save_checkpoint(&snap, dir.path(), &Default::default()).unwrap();
    let tokenizer = json!({
        "version": "1.0", "truncation": null, "padding": null,
        "added_tokens": added, "normalizer": normalizer, "pre_tokenizer": pre,
        "post_processor": null,
        "decoder": {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true, "use_regex": true},
        "model": model,
    });
    std::fs::write(dir.path().join("tokenizer.json"), tokenizer.to_string()).unwrap();
    let config = json!({
        "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "bos_token": null,
        "chat_template": sluice_model::presets::CHATML_TEMPLATE,
    });
    std::fs::write(dir.path().join("tokenizer_config.json"), config.to_string()).unwrap();
    dir
}

/// A byte-level BPE written to GGUF (vocabulary, merges, token types, special ids, template)
/// and imported back tokenizes exactly as the original `tokenizer.json` does, for each
/// pre-tokenizer name; the names are not interchangeable on this corpus, so a wrong pipeline
/// would show.
#[test]
fn gguf_byte_level_bpe_imports_with_the_original_ids_for_each_pre_tokenizer() {
    use sluice_model::gguf::{ExportOptions, ImportOptions, export_gguf, import_gguf};
    let (model, added) = trained_byte_level_bpe();
    let mut per_pre: Vec<Vec<Vec<u32>>> = Vec::new();
    for (pre, normalizer, pipeline) in hf_pipelines() {
        let dir = bpe_model_dir(&model, &added, &normalizer, &pipeline);
        let file = dir.path().join("model.gguf");
        let options = ExportOptions {
            pre_tokenizer: pre.into(),
            ..Default::default()
        };
        export_gguf(dir.path(), &file, &options).unwrap();
        let out = dir.path().join("imported");
        import_gguf(&file, &out, &ImportOptions::default()).unwrap();
        let original = Tokenizer::from_dir(dir.path()).unwrap();
        let imported = Tokenizer::from_dir(&out).unwrap();
        let mut all = Vec::new();
        for text in GGUF_CORPUS {
            let ids = original.encode(text, false).unwrap();
            assert_eq!(
                imported.encode(text, false).unwrap(),
                ids,
                "{pre}: {text:?}"
            );
            assert_eq!(
                imported.encode(text, true).unwrap(),
                ids,
                "{pre}: no BOS is added"
            );
            assert_eq!(
                imported.decode(&ids, false).unwrap(),
                *text,
                "{pre}: decode"
            );
            all.push(ids);
        }
        let think = imported.token_to_id("<think>").unwrap();
        assert_eq!(
            imported.decode(&[think], true).unwrap(),
            "<think>",
            "non-special kept"
        );
        let im_end = imported.token_to_id("<|im_end|>").unwrap();
        assert_eq!(
            imported.decode(&[im_end], true).unwrap(),
            "",
            "special skipped"
        );
        assert_eq!(imported.eos_token_ids(), original.eos_token_ids(), "{pre}");
        assert_eq!(imported.pad_token_id(), original.pad_token_id(), "{pre}");
        let chat = [Message::user("7+5=")];
        let options = ChatOptions::default();
        assert_eq!(
            imported.apply_chat_template(&chat, &options).unwrap(),
            original.apply_chat_template(&chat, &options).unwrap()
        );
        per_pre.push(all);
    }
    for i in 0..per_pre.len() {
        for j in i + 1..per_pre.len() {
            assert_ne!(
                per_pre[i], per_pre[j],
                "pipelines {i} and {j} agree: the corpus cannot tell them apart"
            );
        }
    }
}

/// A SentencePiece (`tokenizer.ggml.model = "llama"`) vocabulary: `<unk>`, `<s>`, `</s>`, the
/// 256 byte tokens, every character of `words` and every substring of 2 to 5 characters of
/// `▁word`, with scores from a fixed pseudo-random sequence (so merge order matters).
fn spm_vocab(words: &[&str]) -> (Vec<String>, Vec<f32>, Vec<i32>) {
    let mut tokens: Vec<String> = vec!["<unk>".into(), "<s>".into(), "</s>".into()];
    let mut types = vec![2, 3, 3];
    for b in 0..=255u8 {
        tokens.push(format!("<0x{b:02X}>"));
        types.push(6);
    }
    let mut pieces: Vec<String> = Vec::new();
    for w in words {
        let chars: Vec<char> = format!("▁{w}").chars().collect();
        for len in 1..=5 {
            for start in 0..chars.len().saturating_sub(len - 1) {
                let p: String = chars[start..start + len].iter().collect();
                if !pieces.contains(&p) {
                    pieces.push(p);
                }
            }
        }
    }
    let mut scores = vec![0.0; tokens.len()];
    for (i, p) in pieces.into_iter().enumerate() {
        tokens.push(p);
        types.push(1);
        scores.push(-(((i * 7919) % 1009) as f32));
    }
    (tokens, scores, types)
}

/// SentencePiece BPE as llama.cpp runs it: `▁` for spaces and one in front, then merge the
/// adjacent pair whose concatenation is the highest-scoring vocabulary piece (leftmost on
/// ties) until none is; pieces outside the vocabulary become their bytes.
fn spm_reference(text: &str, tokens: &[String], scores: &[f32], types: &[i32]) -> Vec<u32> {
    let id = |s: &str| tokens.iter().position(|t| t == s);
    let mut syms: Vec<String> = format!("▁{}", text.replace(' ', "▁"))
        .chars()
        .map(String::from)
        .collect();
    loop {
        let mut best: Option<(f32, usize)> = None;
        for i in 0..syms.len().saturating_sub(1) {
            let merged = format!("{}{}", syms[i], syms[i + 1]);
            if let Some(t) = id(&merged).filter(|&t| types[t] == 1)
                && best.is_none_or(|(s, _)| scores[t] > s)
            {
                best = Some((scores[t], i));
            }
        }
        let Some((_, i)) = best else { break };
        let right = syms.remove(i + 1);
        syms[i].push_str(&right);
    }
    let mut ids = Vec::new();
    for s in syms {
        match id(&s) {
            Some(t) => ids.push(t as u32),
            None => ids.extend(
                s.bytes()
                    .map(|b| id(&format!("<0x{b:02X}>")).unwrap() as u32),
            ),
        }
    }
    ids
}

/// `src` rewritten with its `tokenizer.*` metadata replaced by `tokenizer` (tensors kept).
fn replace_tokenizer_metadata(src: &Path, dst: &Path, tokenizer: Vec<(&str, gguf_file::Value)>) {
    let mut f = std::fs::File::open(src).unwrap();
    let content = gguf_file::Content::read(&mut f).unwrap();
    let mut meta: Vec<(&str, gguf_file::Value)> = content
        .metadata
        .iter()
        .filter(|(k, _)| !k.starts_with("tokenizer."))
        .map(|(k, v)| (k.as_str(), v.clone()))
        .collect();
    meta.extend(tokenizer);
    let tensors: Vec<(String, QTensor)> = content
        .tensor_infos
        .keys()
        .map(|n| (n.clone(), content.tensor(&mut f, n, &Device::Cpu).unwrap()))
        .collect();
    let meta: Vec<(&str, &gguf_file::Value)> = meta.iter().map(|(k, v)| (*k, v)).collect();
    let tensors: Vec<(&str, &QTensor)> = tensors.iter().map(|(k, v)| (k.as_str(), v)).collect();
    gguf_file::write(&mut std::fs::File::create(dst).unwrap(), &meta, &tensors).unwrap();
}

/// A `llama` (SentencePiece) tokenizer imported from GGUF encodes as SentencePiece does —
/// score-ordered merges, `▁` for spaces, byte fallback for characters outside the vocabulary,
/// BOS prepended — and decodes back to the text.
#[test]
fn gguf_sentencepiece_tokenizer_merges_by_score_with_byte_fallback() {
    use gguf_file::Value as V;
    use sluice_model::gguf::{ExportOptions, ImportOptions, export_gguf, import_gguf};
    let words = [
        "hello", "world", "the", "quick", "brown", "fox", "lower", "slower",
    ];
    let (tokens, scores, types) = spm_vocab(&words);
    let dir = tempfile::tempdir().unwrap();
    let mut config = sluice_model::presets::preset_config(Preset::Tiny);
    config.vocab_size = tokens.len();
    let snap = sluice_model::presets::random_snapshot(
        std::sync::Arc::new(config),
        2,
        candle_core::DType::F32,
        &Device::Cpu,
    )
    .unwrap();
    sluice_model::save_checkpoint(&snap, dir.path(), &Default::default()).unwrap();
    let tokenizer = sluice_model::presets::char_tokenizer_json();
    std::fs::write(dir.path().join("tokenizer.json"), tokenizer.to_string()).unwrap();
    let exported = dir.path().join("char.gguf");
    export_gguf(dir.path(), &exported, &ExportOptions::default()).unwrap();
    let file = dir.path().join("spm.gguf");
    let strings = |v: &[String]| V::Array(v.iter().map(|s| V::String(s.clone())).collect());
    replace_tokenizer_metadata(
        &exported,
        &file,
        vec![
            ("tokenizer.ggml.model", V::String("llama".into())),
            ("tokenizer.ggml.tokens", strings(&tokens)),
            (
                "tokenizer.ggml.scores",
                V::Array(scores.iter().map(|&s| V::F32(s)).collect()),
            ),
            (
                "tokenizer.ggml.token_type",
                V::Array(types.iter().map(|&t| V::I32(t)).collect()),
            ),
            ("tokenizer.ggml.bos_token_id", V::U32(1)),
            ("tokenizer.ggml.eos_token_id", V::U32(2)),
            ("tokenizer.ggml.unknown_token_id", V::U32(0)),
        ],
    );
    let out = dir.path().join("imported");
    import_gguf(&file, &out, &ImportOptions::default()).unwrap();
    let tok = Tokenizer::from_dir(&out).unwrap();
    let texts = [
        "hello world",
        "the quick brown fox",
        "slower lower hello",
        "the  fox",
        "héllo wörld 😀",
        "quickbrown foxhello",
    ];
    for text in texts {
        let want = spm_reference(text, &tokens, &scores, &types);
        assert_eq!(tok.encode(text, false).unwrap(), want, "{text:?}");
        let with_bos = tok.encode(text, true).unwrap();
        assert_eq!(with_bos[0], 1, "{text:?}: BOS first");
        assert_eq!(&with_bos[1..], want.as_slice(), "{text:?}");
        assert_eq!(tok.decode(&want, false).unwrap(), text, "{text:?}: decode");
    }
    assert_eq!(tok.eos_token_ids(), &[2]);
}

/// Each token's bytes, joined, are the text's UTF-8, also where byte-level tokens split a
/// character (the emoji and CJK tokens of the trained vocabulary are single bytes, which
/// decode to U+FFFD alone): what an OpenAI client rebuilds text from (`logprobs[].bytes`).
#[test]
fn token_bytes_rebuild_text_whose_tokens_split_characters() {
    let (model, added) = trained_byte_level_bpe();
    let (_, normalizer, pre) = hf_pipelines().remove(1);
    let dir = bpe_model_dir(&model, &added, &normalizer, &pre);
    let tok = Tokenizer::from_dir(dir.path()).unwrap();
    let text = "ok 👌🏼 中文 é\n";
    let ids = tok.encode(text, false).unwrap();
    let split = ids
        .iter()
        .filter(|&&id| tok.decode(&[id], false).unwrap().contains('\u{FFFD}'))
        .count();
    assert!(split > 0, "the text was meant to split characters: {ids:?}");
    let bytes: Vec<u8> = ids.iter().flat_map(|&id| tok.token_bytes(id)).collect();
    assert_eq!(String::from_utf8(bytes).unwrap(), text);
}
