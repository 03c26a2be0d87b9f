//! [`Tokenizer`]: `tokenizer.json` through the tokenizers crate, plus what the surrounding files
//! say about special tokens, end-of-sequence ids and the chat template.
//!
//! Sources, as transformers reads them: `tokenizer_config.json` (`bos_token`, `eos_token`,
//! `pad_token`, `unk_token` — strings or `{"content": …}` objects — and `chat_template`, a string
//! or a list of named templates), `chat_template.jinja` (newer layout, wins when present), and
//! `generation_config.json` (`eos_token_id`, one id or a list: generation stops on any of them).

use std::collections::BTreeMap;
use std::path::Path;

use serde_json::Value;
use sluice_core::Message;

use crate::chat::{ChatOptions, ChatTemplate};
use crate::checkpoint::{TEMPLATE_FILE_MAX_BYTES, TOKENIZER_FILE_MAX_BYTES, read_json};
use crate::error::{ModelError, Result};
use sluice_core::files::{read_capped, read_text_capped};

/// A loaded tokenizer with its special tokens and chat template.
#[derive(Debug)]
pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
    special_tokens: BTreeMap<String, String>,
    eos_token_ids: Vec<u32>,
    pad_token_id: Option<u32>,
    chat_template: Option<ChatTemplate>,
}

impl Tokenizer {
    /// Loads `dir/tokenizer.json` and the optional config files next to it.
    pub fn from_dir(dir: &Path) -> Result<Self> {
        let path = dir.join("tokenizer.json");
        let bytes = read_capped(&path, TOKENIZER_FILE_MAX_BYTES, "tokenizer files")?;
        let inner =
            tokenizers::Tokenizer::from_bytes(bytes).map_err(|e| ModelError::Tokenizer {
                path: path.display().to_string(),
                reason: e.to_string(),
            })?;
        if inner.get_vocab_size(true) == 0 {
            return Err(ModelError::Tokenizer {
                path: path.display().to_string(),
                reason: "the vocabulary is empty (no text could be encoded)".into(),
            });
        }
        let vocab_size = inner.get_vocab_size(true);
        let config_path = dir.join("tokenizer_config.json");
        let config = if config_path.exists() {
            read_json(&config_path)?
        } else {
            Value::Null
        };
        let mut special_tokens = BTreeMap::new();
        for key in ["bos_token", "eos_token", "pad_token", "unk_token"] {
            if let Some(s) = token_string(config.get(key)) {
                special_tokens.insert(key.to_owned(), s);
            }
        }
        let jinja_path = dir.join("chat_template.jinja");
        let (source, template_path) = if jinja_path.exists() {
            let source = read_text_capped(&jinja_path, TEMPLATE_FILE_MAX_BYTES, "chat templates")?;
            (Some(source), jinja_path)
        } else {
            (
                template_source(config.get("chat_template")),
                config_path.clone(),
            )
        };
        let chat_template = source
            .map(|s| compile_template(&s, &special_tokens, &template_path))
            .transpose()?;
        let mut eos_token_ids = Vec::new();
        let gen_path = dir.join("generation_config.json");
        if gen_path.exists() {
            let ids = eos_ids(read_json(&gen_path)?.get("eos_token_id"), vocab_size).map_err(
                |reason| ModelError::Tokenizer {
                    path: gen_path.display().to_string(),
                    reason: format!("`eos_token_id`: {reason}"),
                },
            )?;
            eos_token_ids.extend(ids);
        }
        let lookup = |key: &str| special_tokens.get(key).and_then(|t| inner.token_to_id(t));
        if let Some(eos) = special_tokens.get("eos_token") {
            // An end-of-sequence token the vocabulary lacks would never stop generation.
            let id = lookup("eos_token").ok_or_else(|| ModelError::Tokenizer {
                path: config_path.display().to_string(),
                reason: format!("`eos_token` {eos:?} is not in the vocabulary of tokenizer.json"),
            })?;
            if !eos_token_ids.contains(&id) {
                eos_token_ids.push(id);
            }
        }
        let pad_token_id = lookup("pad_token");
        Ok(Self {
            inner,
            special_tokens,
            eos_token_ids,
            pad_token_id,
            chat_template,
        })
    }

    /// Token ids of `text`; `add_special_tokens` applies the tokenizer's post-processor (e.g. a
    /// BOS token). Chat prompts already contain their special tokens: pass false for them.
    pub fn encode(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>> {
        self.inner
            .encode(text, add_special_tokens)
            .map(|e| e.get_ids().to_vec())
            .map_err(|e| ModelError::Tokenizer {
                path: "<encode>".into(),
                reason: e.to_string(),
            })
    }

    /// Text of `ids`; `skip_special_tokens` drops special added tokens (not `<think>`-style
    /// non-special ones).
    pub fn decode(&self, ids: &[u32], skip_special_tokens: bool) -> Result<String> {
        self.inner
            .decode(ids, skip_special_tokens)
            .map_err(|e| ModelError::Tokenizer {
                path: "<decode>".into(),
                reason: e.to_string(),
            })
    }

    /// The id of a token string.
    pub fn token_to_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }

    /// The string of a token id.
    pub fn id_to_token(&self, id: u32) -> Option<String> {
        self.inner.id_to_token(id)
    }

    /// The bytes token `id` stands for. Most decode to whole characters; a byte-level BPE
    /// token that holds part of one (an emoji's first two bytes) decodes to U+FFFD, so its
    /// bytes are read from its vocabulary string: GPT-2's byte-to-character table inverted,
    /// or a byte-fallback token `<0xF0>`.
    pub fn token_bytes(&self, id: u32) -> Vec<u8> {
        let text = self.inner.decode(&[id], false).unwrap_or_default();
        if !text.contains('\u{FFFD}') {
            return text.into_bytes();
        }
        let Some(token) = self.inner.id_to_token(id) else {
            return text.into_bytes();
        };
        if let Some(hex) = token.strip_prefix("<0x").and_then(|t| t.strip_suffix('>'))
            && let Ok(byte) = u8::from_str_radix(hex, 16)
        {
            return vec![byte];
        }
        token
            .chars()
            .map(byte_level_byte)
            .collect::<Option<Vec<u8>>>()
            .unwrap_or_else(|| text.into_bytes())
    }

    /// Number of token ids, added tokens included.
    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }

    /// Ids that end generation (generation config first, then the tokenizer's `eos_token`).
    pub fn eos_token_ids(&self) -> &[u32] {
        &self.eos_token_ids
    }

    /// The padding id, if the tokenizer config names a pad token.
    pub fn pad_token_id(&self) -> Option<u32> {
        self.pad_token_id
    }

    /// `bos_token`, `eos_token`, `pad_token`, `unk_token` strings that are set.
    pub fn special_tokens(&self) -> &BTreeMap<String, String> {
        &self.special_tokens
    }

    /// Replaces the checkpoint's chat template with the Jinja template in `path` (vLLM's
    /// `--chat-template`): a model whose own template is long or missing can be rendered with
    /// another without editing its directory.
    pub fn override_chat_template(&mut self, path: &Path) -> Result<()> {
        let source = read_text_capped(path, TEMPLATE_FILE_MAX_BYTES, "chat templates")?;
        self.chat_template = Some(compile_template(&source, &self.special_tokens, path)?);
        Ok(())
    }

    /// The chat template, if the checkpoint has one.
    pub fn chat_template(&self) -> Option<&ChatTemplate> {
        self.chat_template.as_ref()
    }

    /// Renders `messages` with the checkpoint's template.
    pub fn apply_chat_template(
        &self,
        messages: &[Message],
        options: &ChatOptions,
    ) -> Result<String> {
        self.chat_template
            .as_ref()
            .ok_or_else(|| ModelError::ChatTemplate {
                reason: "the checkpoint has no chat_template".into(),
            })?
            .render(messages, options)
    }

    /// The underlying tokenizers object, for what this wrapper does not cover.
    pub fn inner(&self) -> &tokenizers::Tokenizer {
        &self.inner
    }
}

/// A special token given as `"<s>"` or `{"content": "<s>", …}`.
fn token_string(v: Option<&Value>) -> Option<String> {
    match v? {
        Value::String(s) => Some(s.clone()),
        Value::Object(m) => m.get("content")?.as_str().map(str::to_owned),
        _ => None,
    }
}

/// `chat_template` as a string, or the `default` entry of a list of `{name, template}`.
fn template_source(v: Option<&Value>) -> Option<String> {
    match v? {
        Value::String(s) => Some(s.clone()),
        Value::Array(list) => list
            .iter()
            .find(|t| t.get("name").and_then(Value::as_str) == Some("default"))
            .and_then(|t| t.get("template")?.as_str().map(str::to_owned)),
        _ => None,
    }
}

/// The chat template `source` (from `path`) compiled; a template that does not parse is refused
/// naming the file, at load rather than by the first chat request.
fn compile_template(
    source: &str,
    special_tokens: &BTreeMap<String, String>,
    path: &Path,
) -> Result<ChatTemplate> {
    ChatTemplate::new(source, special_tokens.clone()).map_err(|e| match e {
        ModelError::ChatTemplate { reason } => ModelError::ChatTemplate {
            reason: format!("{}: {reason}", path.display()),
        },
        other => other,
    })
}

/// `eos_token_id` as one id or a list of ids (absent or `null`: none), each a token id below
/// `vocab_size`; `Err` says which entry is not.
fn eos_ids(v: Option<&Value>, vocab_size: usize) -> std::result::Result<Vec<u32>, String> {
    let items: &[Value] = match v {
        None | Some(Value::Null) => &[],
        Some(Value::Array(a)) => a,
        Some(one) => std::slice::from_ref(one),
    };
    items
        .iter()
        .map(|x| match x.as_u64().and_then(|n| u32::try_from(n).ok()) {
            Some(id) if (id as usize) < vocab_size => Ok(id),
            Some(id) => Err(format!(
                "{id} is outside the vocabulary of tokenizer.json ({vocab_size} tokens)"
            )),
            None => Err(format!("{x} is not a token id")),
        })
        .collect()
}

/// The byte a character of a byte-level BPE vocabulary stands for (GPT-2's `bytes_to_unicode`
/// inverted): printable bytes are themselves, the other 68 are `U+0100` onwards, in order.
fn byte_level_byte(c: char) -> Option<u8> {
    let printable =
        |b: u32| (33..=126).contains(&b) || (161..=172).contains(&b) || (174..=255).contains(&b);
    let code = c as u32;
    if code < 256 {
        return printable(code).then_some(code as u8);
    }
    let n = (code - 256) as usize;
    (0u32..256)
        .filter(|&b| !printable(b))
        .nth(n)
        .map(|b| b as u8)
}
