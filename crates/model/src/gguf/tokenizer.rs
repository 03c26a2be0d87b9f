//! `tokenizer.json` and `tokenizer_config.json` from a GGUF file's `tokenizer.*` metadata.
//!
//! `tokenizer.ggml.model = "gpt2"`: byte-level BPE from `tokens` and `merges`, with the
//! pre-tokenizer llama.cpp runs for `tokenizer.ggml.pre` ([`PRE_TOKENIZERS`]). `"llama"`:
//! SentencePiece-style BPE as HF's llama `tokenizer.json` has it (`▁` for spaces, a `▁`
//! prepended, byte fallback through the `<0xNN>` tokens), its merges derived from `scores`: a
//! pair merges when the merged piece is in the vocabulary, higher score first, which is the
//! order SentencePiece's (and llama.cpp's) BPE applies them in. Control tokens
//! (`token_type` 3) become special added tokens, user-defined ones (4) non-special added
//! tokens.

use std::collections::{BTreeMap, HashMap};

use serde_json::{Map, Value, json};

use super::reader::GgufFile;
use crate::chat::ChatTemplate;
use crate::error::{ModelError, Result};

/// `tokenizer.ggml.pre` names understood, with what they stand for.
pub const PRE_TOKENIZERS: &[&str] = &[
    "default",
    "gpt2",
    "gpt-2",
    "smollm",
    "llama3",
    "llama-v3",
    "llama-bpe",
    "qwen2",
];

/// `tokenizer.ggml.model` values understood.
pub const TOKENIZER_MODELS: &[&str] = &["gpt2", "llama"];

/// GPT-2's split regex (what `ByteLevel` with `use_regex` applies).
const GPT2_REGEX: &str =
    r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+";
/// Llama 3's split regex (its `tokenizer.json`'s).
const LLAMA3_REGEX: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
/// Qwen2's split regex (its `tokenizer.json`'s).
const QWEN2_REGEX: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
/// llama.cpp's fallback sequence for BPE vocabularies whose pre-tokenizer it does not know.
const DEFAULT_REGEXES: &[&str] = &[
    r"[\p{P}\$\+<=>\^~\|]+",
    GPT2_REGEX,
    r"\p{N}+",
    r"[0-9][0-9][0-9]",
];

/// `token_type` values (llama.cpp's `llama_token_type`).
const TYPE_CONTROL: i64 = 3;
const TYPE_USER_DEFINED: i64 = 4;

/// The two tokenizer files and the special token ids the model config and generation config
/// need.
pub(super) struct TokenizerFiles {
    /// `tokenizer.json`.
    pub tokenizer_json: Value,
    /// `tokenizer_config.json`.
    pub tokenizer_config: Value,
    /// `tokenizer.ggml.bos_token_id`.
    pub bos: Option<u32>,
    /// End-of-sequence ids: eos, then end-of-turn / end-of-message when they differ.
    pub eos: Vec<u32>,
    /// `tokenizer.ggml.padding_token_id`.
    pub pad: Option<u32>,
    /// Tokens in the vocabulary.
    pub vocab_size: usize,
    /// `"gpt2 (smollm)"`, `"llama"`: what was built, for the import summary.
    pub description: String,
}

/// Builds the tokenizer files from `g`'s metadata; `max_length` goes to `model_max_length`.
pub(super) fn tokenizer_files(g: &GgufFile, max_length: usize) -> Result<TokenizerFiles> {
    let model = g.string("tokenizer.ggml.model")?;
    let tokens = g
        .strings_opt("tokenizer.ggml.tokens")?
        .ok_or_else(|| g.err("metadata key `tokenizer.ggml.tokens` is missing"))?;
    let types = match g.numbers_opt("tokenizer.ggml.token_type")? {
        Some(t) if t.len() != tokens.len() => {
            return Err(g.err(format!(
                "metadata key `tokenizer.ggml.token_type` has {} entries, `tokenizer.ggml.tokens` {}",
                t.len(),
                tokens.len()
            )));
        }
        Some(t) => t
            .into_iter()
            .enumerate()
            .map(|(i, x)| token_type(g, i, x))
            .collect::<Result<Vec<i64>>>()?,
        None => vec![1; tokens.len()],
    };
    let mut vocab = Map::new();
    let mut seen: HashMap<&str, usize> = HashMap::with_capacity(tokens.len());
    for (id, tok) in tokens.iter().enumerate() {
        if let Some(first) = seen.insert(tok, id) {
            return Err(g.err(format!(
                "metadata key `tokenizer.ggml.tokens`: token {tok:?} appears twice (ids {first} and {id})"
            )));
        }
        vocab.insert((*tok).to_owned(), json!(id));
    }
    let id_key = |k: &str| g.token_id_opt(&format!("tokenizer.ggml.{k}_token_id"));
    let (bos, eos, unk, pad) = (
        id_key("bos")?,
        id_key("eos")?,
        id_key("unknown")?,
        id_key("padding")?,
    );
    for (key, id) in [
        ("bos", bos),
        ("eos", eos),
        ("unknown", unk),
        ("padding", pad),
    ] {
        if let Some(id) = id
            && id as usize >= tokens.len()
        {
            return Err(g.err(format!(
                "metadata key `tokenizer.ggml.{key}_token_id` = {id} is outside the vocabulary ({} tokens)",
                tokens.len()
            )));
        }
    }
    let name = |id: Option<u32>| id.map(|i| tokens[i as usize].to_owned());
    let (body, add_bos, description) = match model {
        "gpt2" => {
            let pre = g.string_opt("tokenizer.ggml.pre")?.unwrap_or("default");
            let merges = merges_from_metadata(g)?;
            let add_bos = g.bool_opt("tokenizer.ggml.add_bos_token")?.unwrap_or(false);
            let body = byte_level_bpe(g, pre, vocab, merges, name(unk))?;
            (
                body,
                add_bos,
                format!("gpt2 byte-level BPE, pre-tokenizer `{pre}`"),
            )
        }
        "llama" => {
            let scores = g
                .numbers_opt("tokenizer.ggml.scores")?
                .ok_or_else(|| g.err("metadata key `tokenizer.ggml.scores` is missing (needed for a `llama` tokenizer)"))?;
            if scores.len() != tokens.len() {
                return Err(g.err(format!(
                    "metadata key `tokenizer.ggml.scores` has {} entries, `tokenizer.ggml.tokens` {}",
                    scores.len(),
                    tokens.len()
                )));
            }
            let merges = merges_from_scores(&tokens, &scores, &types);
            let add_bos = g.bool_opt("tokenizer.ggml.add_bos_token")?.unwrap_or(true);
            let add_prefix = g
                .bool_opt("tokenizer.ggml.add_space_prefix")?
                .unwrap_or(true);
            let body = sentencepiece_bpe(vocab, merges, name(unk), add_prefix);
            (
                body,
                add_bos,
                "llama SentencePiece BPE with byte fallback".to_owned(),
            )
        }
        other => {
            return Err(g.err(format!(
                "metadata key `tokenizer.ggml.model`: `{other}` is not supported (supported: {})",
                TOKENIZER_MODELS.join(", ")
            )));
        }
    };
    let mut added = Vec::new();
    let mut decoder = Map::new();
    for (id, (tok, &ty)) in tokens.iter().zip(&types).enumerate() {
        if ty == TYPE_CONTROL || ty == TYPE_USER_DEFINED {
            let entry = json!({
                "id": id, "content": tok, "single_word": false, "lstrip": false,
                "rstrip": false, "normalized": false, "special": ty == TYPE_CONTROL,
            });
            let mut config_entry = entry.clone();
            config_entry.as_object_mut().expect("object").remove("id");
            decoder.insert(id.to_string(), config_entry);
            added.push(entry);
        }
    }
    let mut tokenizer_json = body;
    tokenizer_json["added_tokens"] = Value::Array(added);
    tokenizer_json["post_processor"] =
        post_processor(model, add_bos.then(|| name(bos)).flatten(), bos);
    let mut eos_ids: Vec<u32> = eos.into_iter().collect();
    for key in ["tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id"] {
        if let Some(id) = g.token_id_opt(key)?
            && (id as usize) < tokens.len()
            && !eos_ids.contains(&id)
        {
            eos_ids.push(id);
        }
    }
    let tokenizer_config = json!({
        "tokenizer_class": if model == "llama" { "LlamaTokenizerFast" } else { "PreTrainedTokenizerFast" },
        "add_bos_token": add_bos,
        "add_eos_token": false,
        "added_tokens_decoder": decoder,
        "bos_token": name(bos),
        "eos_token": name(eos),
        "pad_token": name(pad),
        "unk_token": name(unk),
        "model_max_length": max_length,
        "clean_up_tokenization_spaces": false,
        "chat_template": chat_template(g)?,
    });
    Ok(TokenizerFiles {
        tokenizer_json,
        tokenizer_config,
        bos,
        eos: eos_ids,
        pad,
        vocab_size: tokens.len(),
        description,
    })
}

/// Entry `i` of `tokenizer.ggml.token_type`: one of llama.cpp's types 1 (normal) to 6
/// (byte); any other would leave the token neither normal nor special.
fn token_type(g: &GgufFile, i: usize, x: f64) -> Result<i64> {
    if x.fract() == 0.0 && (1.0..=6.0).contains(&x) {
        Ok(x as i64)
    } else {
        Err(g.err(format!(
            "metadata key `tokenizer.ggml.token_type`[{i}] = {x}: expected a token type from 1 to 6 \
             (normal, unknown, control, user-defined, unused, byte)"
        )))
    }
}

/// `tokenizer.chat_template`, compiled once so that a template that does not parse is refused
/// at import rather than by the first chat request a server gets.
fn chat_template(g: &GgufFile) -> Result<Option<&str>> {
    let key = "tokenizer.chat_template";
    let Some(source) = g.string_opt(key)? else {
        return Ok(None);
    };
    if let Err(e) = ChatTemplate::new(source, BTreeMap::new()) {
        let reason = match e {
            ModelError::ChatTemplate { reason } => reason,
            other => other.to_string(),
        };
        return Err(g.err(format!(
            "metadata key `{key}`: the chat template does not parse: {reason}"
        )));
    }
    Ok(Some(source))
}

/// `tokenizer.ggml.merges` as `[left, right]` pairs.
fn merges_from_metadata(g: &GgufFile) -> Result<Vec<Value>> {
    let merges = g.strings_opt("tokenizer.ggml.merges")?.ok_or_else(|| {
        g.err("metadata key `tokenizer.ggml.merges` is missing (needed for a `gpt2` tokenizer)")
    })?;
    merges
        .iter()
        .enumerate()
        .map(|(i, m)| {
            m.split_once(' ')
                .map(|(a, b)| json!([a, b]))
                .ok_or_else(|| g.err(format!("metadata key `tokenizer.ggml.merges`[{i}] = {m:?} is not two tokens separated by a space")))
        })
        .collect()
}

/// The `tokenizer.json` body (model, normalizer, pre-tokenizer, decoder) of a byte-level BPE.
fn byte_level_bpe(
    g: &GgufFile,
    pre: &str,
    vocab: Map<String, Value>,
    merges: Vec<Value>,
    unk: Option<String>,
) -> Result<Value> {
    let byte_level = |use_regex: bool| json!({"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": use_regex});
    let split = |regex: &str| json!({"type": "Split", "pattern": {"Regex": regex}, "behavior": "Isolated", "invert": false});
    let (normalizer, pre_tokenizer) = match pre {
        "gpt2" | "gpt-2" => (Value::Null, byte_level(true)),
        "smollm" => (
            Value::Null,
            json!({"type": "Sequence", "pretokenizers": [
                {"type": "Digits", "individual_digits": true},
                byte_level(true),
            ]}),
        ),
        "llama3" | "llama-v3" | "llama-bpe" => (
            Value::Null,
            json!({"type": "Sequence", "pretokenizers": [split(LLAMA3_REGEX), byte_level(false)]}),
        ),
        "qwen2" => (
            json!({"type": "NFC"}),
            json!({"type": "Sequence", "pretokenizers": [split(QWEN2_REGEX), byte_level(false)]}),
        ),
        "default" => {
            let mut steps: Vec<Value> = DEFAULT_REGEXES.iter().map(|r| split(r)).collect();
            steps.push(byte_level(false));
            (
                Value::Null,
                json!({"type": "Sequence", "pretokenizers": steps}),
            )
        }
        other => {
            return Err(g.err(format!(
                "metadata key `tokenizer.ggml.pre`: pre-tokenizer `{other}` is not supported (supported: {})",
                PRE_TOKENIZERS.join(", ")
            )));
        }
    };
    Ok(json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": [],
        "normalizer": normalizer,
        "pre_tokenizer": pre_tokenizer,
        "post_processor": null,
        "decoder": {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true, "use_regex": true},
        "model": {
            "type": "BPE", "dropout": null, "unk_token": unk,
            "continuing_subword_prefix": null, "end_of_word_suffix": null,
            "fuse_unk": false, "byte_fallback": false, "ignore_merges": false,
            "vocab": vocab, "merges": merges,
        },
    }))
}

/// The `tokenizer.json` body of a SentencePiece-style BPE (HF's llama layout).
fn sentencepiece_bpe(
    vocab: Map<String, Value>,
    merges: Vec<Value>,
    unk: Option<String>,
    add_prefix: bool,
) -> Value {
    let mut normalizers = Vec::new();
    if add_prefix {
        normalizers.push(json!({"type": "Prepend", "prepend": "▁"}));
    }
    normalizers.push(json!({"type": "Replace", "pattern": {"String": " "}, "content": "▁"}));
    let mut decoders = vec![
        json!({"type": "Replace", "pattern": {"String": "▁"}, "content": " "}),
        json!({"type": "ByteFallback"}),
        json!({"type": "Fuse"}),
    ];
    if add_prefix {
        decoders.push(json!({"type": "Strip", "content": " ", "start": 1, "stop": 0}));
    }
    json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": [],
        "normalizer": {"type": "Sequence", "normalizers": normalizers},
        "pre_tokenizer": null,
        "post_processor": null,
        "decoder": {"type": "Sequence", "decoders": decoders},
        "model": {
            "type": "BPE", "dropout": null, "unk_token": unk,
            "continuing_subword_prefix": null, "end_of_word_suffix": null,
            "fuse_unk": true, "byte_fallback": true, "ignore_merges": false,
            "vocab": vocab, "merges": merges,
        },
    })
}

/// Merges of a SentencePiece BPE vocabulary: every split of a normal token into two
/// vocabulary pieces, ordered by the merged token's score (highest first, then lower id).
fn merges_from_scores(tokens: &[&str], scores: &[f64], types: &[i64]) -> Vec<Value> {
    let ids: HashMap<&str, usize> = tokens.iter().enumerate().map(|(i, t)| (*t, i)).collect();
    let mut merges: Vec<(f64, usize, &str, &str)> = Vec::new();
    for (id, tok) in tokens.iter().enumerate() {
        if types[id] != 1 {
            continue;
        }
        for (at, _) in tok.char_indices().skip(1) {
            let (l, r) = tok.split_at(at);
            let normal = |p: &str| ids.get(p).is_some_and(|&i| types[i] == 1);
            if normal(l) && normal(r) {
                merges.push((scores[id], id, l, r));
            }
        }
    }
    merges.sort_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)));
    merges
        .into_iter()
        .map(|(_, _, l, r)| json!([l, r]))
        .collect()
}

/// The post-processor: the BOS token prepended when the tokenizer adds one; otherwise
/// byte-level offsets (gpt2) or nothing (llama).
fn post_processor(model: &str, bos: Option<String>, bos_id: Option<u32>) -> Value {
    match (bos, bos_id) {
        (Some(bos), Some(id)) => json!({
            "type": "TemplateProcessing",
            "single": [{"SpecialToken": {"id": bos, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
            "pair": [
                {"SpecialToken": {"id": bos, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
                {"SpecialToken": {"id": bos, "type_id": 1}}, {"Sequence": {"id": "B", "type_id": 1}},
            ],
            "special_tokens": {bos.clone(): {"id": bos, "ids": [id], "tokens": [bos]}},
        }),
        _ if model == "gpt2" => json!({
            "type": "ByteLevel", "add_prefix_space": true, "trim_offsets": false, "use_regex": true,
        }),
        _ => Value::Null,
    }
}
