//! The presets' character-level tokenizer in HF `tokenizer.json` format.
//!
//! A BPE model with no merges: every character of the vocabulary is one token, anything else
//! maps to `<unk>`. Special tokens follow ChatML; `<think>`, `<tool_call>` and the
//! `<|action_start|>` / `<|action_end|>` tags are added tokens that are not "special", so decoding
//! keeps them (as Qwen's and InternLM2's tokenizers do).
//!
//! The pipeline is Qwen2's own (NFC, the Qwen2 split regex, byte-level mapping, byte-level
//! decoder), with the vocabulary written in the byte-level alphabet (space is `Ġ`, newline `Ċ`;
//! printable ASCII maps to itself). Why: transformers 5 builds a `qwen2` model's tokenizer as
//! `Qwen2Tokenizer` whatever `tokenizer_class` says, taking only the vocabulary and merges from
//! `tokenizer.json` and imposing that pipeline. A plain character vocabulary then lost every
//! space and newline (`<|im_start|>user\n7+5=<|im_end|>\n`: 10 ids instead of 12). With the
//! same pipeline on both sides, `AutoTokenizer.from_pretrained(dir)` and this file give the
//! same ids; with no merges the split changes nothing, so the ids of ASCII text are exactly one
//! per character, as before.

use serde_json::{Map, Value, json};

use super::CHATML_TEMPLATE;

/// The characters of the vocabulary, ids `0..`: printable ASCII (space to `~`), then newline.
/// In `tokenizer.json` they appear in the byte-level alphabet (space `Ġ`, newline `Ċ`).
pub const CHAR_VOCAB: &str = concat!(
    " !\"#$%&'()*+,-./0123456789:;<=>?@ABCDEFGHIJKLMNOPQRSTUVWXYZ[\\]^_`abcdefghijklmnopqrstuvwxyz{|}~",
    "\n"
);

/// Added tokens after `<unk>`: `(content, special)`.
pub const SPECIAL_TOKENS: &[(&str, bool)] = &[
    ("<|endoftext|>", true),
    ("<|im_start|>", true),
    ("<|im_end|>", true),
    ("<think>", false),
    ("</think>", false),
    ("<tool_call>", false),
    ("</tool_call>", false),
    // InternLM2's agent tags (seed 001's action format), one token each as in its tokenizer.
    ("<|action_start|>", false),
    ("<|action_end|>", false),
];

const UNK: &str = "<unk>";

/// Qwen2's pre-tokenization regex (as transformers' `Qwen2Tokenizer` and Qwen's own
/// `tokenizer.json` have it).
const QWEN2_SPLIT_REGEX: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// A vocabulary character in the byte-level alphabet (GPT-2's byte-to-unicode map): the
/// printable characters `!`..`~` are themselves, space is `Ġ` (U+0120) and newline `Ċ`
/// (U+010A). These are all of `CHAR_VOCAB`.
fn byte_level(c: char) -> char {
    match c {
        ' ' => '\u{0120}',
        '\n' => '\u{010a}',
        _ => {
            debug_assert!(c.is_ascii_graphic(), "{c:?} is not in CHAR_VOCAB");
            c
        }
    }
}

fn unk_id() -> u32 {
    CHAR_VOCAB.chars().count() as u32
}

fn special_id(i: usize) -> u32 {
    unk_id() + 1 + i as u32
}

/// Id of `<|endoftext|>` (padding).
pub(crate) const ENDOFTEXT_ID: u32 = 97;
/// Id of `<|im_end|>` (end of turn).
pub(crate) const IM_END_ID: u32 = 99;

/// Tokens in the vocabulary.
pub(crate) fn vocab_size() -> usize {
    unk_id() as usize + 1 + SPECIAL_TOKENS.len()
}

/// The `tokenizer.json` document.
pub fn char_tokenizer_json() -> Value {
    let mut vocab = Map::new();
    for (i, c) in CHAR_VOCAB.chars().enumerate() {
        vocab.insert(byte_level(c).to_string(), json!(i));
    }
    vocab.insert(UNK.to_owned(), json!(unk_id()));
    let mut added = vec![json!({
        "id": unk_id(), "content": UNK, "single_word": false, "lstrip": false,
        "rstrip": false, "normalized": false, "special": true,
    })];
    for (i, (content, special)) in SPECIAL_TOKENS.iter().enumerate() {
        added.push(json!({
            "id": special_id(i), "content": content, "single_word": false, "lstrip": false,
            "rstrip": false, "normalized": false, "special": special,
        }));
    }
    json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": added,
        "normalizer": {"type": "NFC"},
        "pre_tokenizer": {
            "type": "Sequence",
            "pretokenizers": [
                {
                    "type": "Split",
                    "pattern": {"Regex": QWEN2_SPLIT_REGEX},
                    "behavior": "Isolated",
                    "invert": false,
                },
                {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": false, "use_regex": false},
            ],
        },
        "post_processor": null,
        "decoder": {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": false, "use_regex": false},
        "model": {
            "type": "BPE",
            "dropout": null,
            "unk_token": UNK,
            "continuing_subword_prefix": null,
            "end_of_word_suffix": null,
            // A character outside the vocabulary is several bytes after the byte-level
            // mapping; fused, it stays one `<unk>` as in the plain character tokenizer.
            "fuse_unk": true,
            "byte_fallback": false,
            "ignore_merges": false,
            "vocab": vocab,
            "merges": [],
        },
    })
}

/// The `tokenizer_config.json` document (special tokens and the ChatML template). The class is
/// `Qwen2Tokenizer`, the one transformers picks for the presets' `qwen2` model type anyway (a
/// different name is overridden and only invites the mismatch this module's docs describe).
pub fn tokenizer_config_json() -> Value {
    let mut decoder = Map::new();
    decoder.insert(
        unk_id().to_string(),
        json!({"content": UNK, "lstrip": false, "normalized": false, "rstrip": false, "single_word": false, "special": true}),
    );
    for (i, (content, special)) in SPECIAL_TOKENS.iter().enumerate() {
        decoder.insert(
            special_id(i).to_string(),
            json!({"content": content, "lstrip": false, "normalized": false, "rstrip": false, "single_word": false, "special": special}),
        );
    }
    json!({
        "tokenizer_class": "Qwen2Tokenizer",
        "added_tokens_decoder": decoder,
        "bos_token": null,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": UNK,
        "model_max_length": 4096,
        "clean_up_tokenization_spaces": false,
        "split_special_tokens": false,
        "chat_template": CHATML_TEMPLATE,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_of_named_specials_match_the_table() {
        assert_eq!(unk_id(), 96);
        assert_eq!(special_id(0), ENDOFTEXT_ID);
        assert_eq!(special_id(2), IM_END_ID);
        assert_eq!(SPECIAL_TOKENS[0].0, "<|endoftext|>");
        assert_eq!(SPECIAL_TOKENS[2].0, "<|im_end|>");
        assert_eq!(vocab_size(), 106);
    }
}
