//! Chat messages in the OpenAI shape, so that datasets, environments, chat templates and the HTTP
//! server all exchange the same structure without conversion.

use serde::{Deserialize, Serialize};

/// Who wrote a message.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Role {
    /// Instructions that frame the conversation.
    System,
    /// The user (or the environment speaking as the user).
    User,
    /// The model being trained.
    Assistant,
    /// The result of a tool call, answering `tool_call_id`.
    Tool,
}

impl Role {
    /// The lowercase name chat templates expect (`message.role`).
    pub fn as_str(self) -> &'static str {
        match self {
            Role::System => "system",
            Role::User => "user",
            Role::Assistant => "assistant",
            Role::Tool => "tool",
        }
    }
}

/// One chat message: `{role, content, reasoning_content, tool_calls, tool_call_id, name}`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Message {
    /// Author of the message.
    pub role: Role,
    /// Visible text. `None` for an assistant message that only calls tools.
    #[serde(default)]
    pub content: Option<String>,
    /// Reasoning the model produced before answering (`<think>…</think>`), kept apart from
    /// `content` as reasoning-model APIs do.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reasoning_content: Option<String>,
    /// Tool calls made by an assistant message (`null` reads as none, as OpenAI's clients
    /// write a message without calls).
    #[serde(
        default,
        skip_serializing_if = "Vec::is_empty",
        deserialize_with = "null_as_default"
    )]
    pub tool_calls: Vec<ToolCall>,
    /// For `role = tool`: the id of the call this message answers.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_call_id: Option<String>,
    /// Optional author name (OpenAI's `name`; for tool messages, the tool's name).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
}

impl Message {
    /// A message with text content and nothing else.
    pub fn text(role: Role, content: impl Into<String>) -> Self {
        Self {
            role,
            content: Some(content.into()),
            reasoning_content: None,
            tool_calls: Vec::new(),
            tool_call_id: None,
            name: None,
        }
    }

    /// A system message.
    pub fn system(content: impl Into<String>) -> Self {
        Self::text(Role::System, content)
    }

    /// A user message.
    pub fn user(content: impl Into<String>) -> Self {
        Self::text(Role::User, content)
    }

    /// An assistant message.
    pub fn assistant(content: impl Into<String>) -> Self {
        Self::text(Role::Assistant, content)
    }

    /// A tool result answering the call `tool_call_id`.
    pub fn tool(tool_call_id: impl Into<String>, content: impl Into<String>) -> Self {
        Self {
            tool_call_id: Some(tool_call_id.into()),
            ..Self::text(Role::Tool, content)
        }
    }
}

/// A function call requested by the assistant.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ToolCall {
    /// Unique id of the call within the conversation.
    pub id: String,
    /// Always `"function"` in the OpenAI schema.
    #[serde(rename = "type", default = "function_kind")]
    pub kind: String,
    /// Which function, with which arguments.
    pub function: FunctionCall,
}

fn function_kind() -> String {
    "function".to_owned()
}

/// The function part of a [`ToolCall`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct FunctionCall {
    /// Function name.
    pub name: String,
    /// Arguments as a JSON-encoded string, exactly as OpenAI's API carries them.
    pub arguments: String,
}

/// A tool the environment offers the model (OpenAI `tools[]` entry).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ToolSpec {
    /// Always `"function"`.
    #[serde(rename = "type", default = "function_kind")]
    pub kind: String,
    /// Name, description and JSON-schema parameters.
    pub function: FunctionSpec,
}

/// The function part of a [`ToolSpec`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct FunctionSpec {
    /// Function name the model must use.
    pub name: String,
    /// What the function does, shown to the model.
    #[serde(default)]
    pub description: String,
    /// JSON schema of the arguments object.
    #[serde(default)]
    pub parameters: serde_json::Value,
}

/// Deserializes `null` as the type's default: OpenAI's clients write absent lists as `null`
/// (`"tool_calls": null` on a message without calls).
pub fn null_as_default<'de, D, T>(deserializer: D) -> Result<T, D::Error>
where
    D: serde::Deserializer<'de>,
    T: Default + serde::Deserialize<'de>,
{
    Ok(Option::<T>::deserialize(deserializer)?.unwrap_or_default())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn openai_json_shape() {
        let json = r#"{"role":"assistant","content":null,"tool_calls":[{"id":"c1","type":"function","function":{"name":"calc","arguments":"{\"expr\":\"1+1\"}"}}]}"#;
        let m: Message = serde_json::from_str(json).unwrap();
        assert_eq!(m.role, Role::Assistant);
        assert_eq!(m.content, None);
        assert_eq!(m.tool_calls[0].function.name, "calc");
        assert_eq!(serde_json::to_string(&m).unwrap(), json);
        // As OpenAI's Python client dumps a message without calls.
        let dumped = r#"{"role":"assistant","content":"4","tool_calls":null,"name":null}"#;
        let m: Message = serde_json::from_str(dumped).unwrap();
        assert!(m.tool_calls.is_empty());
        let tool = Message::tool("c1", "2");
        assert_eq!(
            serde_json::to_value(&tool).unwrap(),
            serde_json::json!({"role":"tool","content":"2","tool_call_id":"c1"})
        );
    }
}
