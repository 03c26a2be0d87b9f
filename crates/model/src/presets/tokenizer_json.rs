//! The presets' character-level tokenizer in HF `tokenizer.json` format.
//!
//! A BPE model with no merges: every character of the vocabulary is one token, anything else
//! maps to `<unk>`. No normalizer or pre-tokenizer (spaces and newlines are ordinary
//! characters), and a `Fuse` decoder so decoding concatenates characters without separators.
//! Special tokens follow ChatML; `<think>` and `<tool_call>` tags are added tokens that are not
//! "special", so decoding keeps them (as Qwen's tokenizer does).

use serde_json::{Map, Value, json};

use super::CHATML_TEMPLATE;

/// The characters of the vocabulary, ids `0..`: printable ASCII (space to `~`), then newline.
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
];

const UNK: &str = "<unk>";

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
        vocab.insert(c.to_string(), json!(i));
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
        "normalizer": null,
        "pre_tokenizer": null,
        "post_processor": null,
        "decoder": {"type": "Fuse"},
        "model": {
            "type": "BPE",
            "dropout": null,
            "unk_token": UNK,
            "continuing_subword_prefix": null,
            "end_of_word_suffix": null,
            "fuse_unk": false,
            "byte_fallback": false,
            "ignore_merges": false,
            "vocab": vocab,
            "merges": [],
        },
    })
}

/// The `tokenizer_config.json` document (special tokens and the ChatML template).
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
        "tokenizer_class": "PreTrainedTokenizerFast",
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
        assert_eq!(vocab_size(), 104);
    }
}
