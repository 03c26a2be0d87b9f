//! [`ModelRenderer`]: the environments' [`Renderer`] over a checkpoint's own tokenizer, chat
//! template and completion parser, so rollouts are rendered exactly as the model was trained to
//! read them (and as `sluice serve` renders chat requests).

use std::sync::Arc;

use sluice_core::{Message, ToolSpec};
use sluice_env::{EnvError, ParseError, Renderer};
use sluice_model::{ChatOptions, CompletionParser, Tokenizer};

/// Renders with the checkpoint's chat template; parses with the ChatML-style parser.
pub struct ModelRenderer {
    tokenizer: Arc<Tokenizer>,
    parser: CompletionParser,
    /// Extra template variables (`model.chat_template_kwargs`, e.g. `enable_thinking`).
    template_kwargs: serde_json::Map<String, serde_json::Value>,
}

impl std::fmt::Debug for ModelRenderer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ModelRenderer").finish_non_exhaustive()
    }
}

impl ModelRenderer {
    /// A renderer over `tokenizer`, which must carry a chat template.
    pub fn new(tokenizer: Arc<Tokenizer>) -> Result<Self, EnvError> {
        if tokenizer.chat_template().is_none() {
            return Err(EnvError::Config(
                "the model's tokenizer_config.json has no chat_template: environments need one to render prompts"
                    .into(),
            ));
        }
        Ok(Self {
            tokenizer,
            parser: CompletionParser::default(),
            template_kwargs: serde_json::Map::new(),
        })
    }

    /// The same renderer passing `kwargs` to the chat template with every prompt
    /// (`model.chat_template_kwargs`).
    pub fn with_template_kwargs(
        mut self,
        kwargs: &std::collections::BTreeMap<String, toml::Value>,
    ) -> Result<Self, EnvError> {
        for (name, value) in kwargs {
            let value = serde_json::to_value(value)
                .map_err(|e| EnvError::Config(format!("model.chat_template_kwargs.{name}: {e}")))?;
            self.template_kwargs.insert(name.clone(), value);
        }
        Ok(self)
    }

    /// The tokenizer.
    pub fn tokenizer(&self) -> &Arc<Tokenizer> {
        &self.tokenizer
    }

    /// Token ids of `text` as the reply of an assistant turn, ending with the first end-of-turn
    /// id (what the model must learn to produce, for supervised warm-starts).
    pub fn encode_reply(&self, text: &str) -> Result<Vec<u32>, EnvError> {
        let mut ids = self
            .tokenizer
            .encode(text, false)
            .map_err(|e| EnvError::Render(e.to_string()))?;
        if let Some(&eos) = self.tokenizer.eos_token_ids().first() {
            ids.push(eos);
        }
        Ok(ids)
    }
}

impl Renderer for ModelRenderer {
    fn render_prompt(
        &self,
        messages: &[Message],
        tools: &[ToolSpec],
    ) -> Result<Vec<u32>, EnvError> {
        let options = ChatOptions {
            add_generation_prompt: true,
            tools: (!tools.is_empty()).then(|| tools.to_vec()),
            extra: self.template_kwargs.clone(),
        };
        let text = self
            .tokenizer
            .apply_chat_template(messages, &options)
            .map_err(|e| EnvError::Render(e.to_string()))?;
        self.tokenizer
            .encode(&text, false)
            .map_err(|e| EnvError::Render(e.to_string()))
    }

    fn parse_completion(&self, completion: &[u32]) -> Result<Message, ParseError> {
        let eos = self.tokenizer.eos_token_ids();
        let end = completion
            .iter()
            .position(|t| eos.contains(t))
            .unwrap_or(completion.len());
        let text = self
            .tokenizer
            .decode(&completion[..end], false)
            .map_err(|e| ParseError {
                raw_text: String::new(),
                reason: format!("completion does not decode: {e}"),
            })?;
        self.parser.parse(&text, "call_").map_err(|e| ParseError {
            raw_text: text.clone(),
            reason: e.to_string(),
        })
    }
}
