//! Chat templates render as transformers' `apply_chat_template` would, and completions parse
//! back into messages (malformed ones into errors).

use std::collections::BTreeMap;

use serde_json::json;
use sluice_core::message::{FunctionCall, FunctionSpec};
use sluice_core::{Message, Role, ToolCall, ToolSpec};
use sluice_model::presets::CHATML_TEMPLATE;
use sluice_model::{ChatOptions, ChatTemplate, CompletionParseError, CompletionParser};

fn specials(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
    pairs
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

fn calc_tool() -> ToolSpec {
    ToolSpec {
        kind: "function".into(),
        function: FunctionSpec {
            name: "calc".into(),
            description: "Evaluate an arithmetic expression.".into(),
            // Keys in sorted order: serde_json may or may not preserve insertion order.
            parameters: json!({"properties": {"expr": {"type": "string"}}, "type": "object"}),
        },
    }
}

#[test]
fn chatml_with_tools_renders_the_expected_prompt() {
    let t = ChatTemplate::new(CHATML_TEMPLATE, specials(&[("eos_token", "<|im_end|>")])).unwrap();
    let call = ToolCall {
        id: "c0".into(),
        kind: "function".into(),
        function: FunctionCall {
            name: "calc".into(),
            arguments: r#"{"expr":"2+3"}"#.into(),
        },
    };
    let messages = vec![
        Message::system("Be brief."),
        Message::user("What is 2+3?"),
        Message {
            tool_calls: vec![call],
            content: None,
            reasoning_content: Some("Use the tool.".into()),
            ..Message::assistant("")
        },
        Message::tool("c0", "5"),
        Message::assistant("5"),
        Message::user("Thanks"),
    ];
    let options = ChatOptions {
        add_generation_prompt: true,
        tools: Some(vec![calc_tool()]),
        ..ChatOptions::default()
    };
    let got = t.render(&messages, &options).unwrap();
    let want = concat!(
        "<|im_start|>system\nBe brief.\n\n# Tools\n\nYou may call functions to help with the request. ",
        "Their signatures, one JSON object per line, are inside <tools></tools>:\n<tools>\n",
        r#"{"type": "function", "function": {"name": "calc", "description": "Evaluate an arithmetic expression.", "parameters": {"properties": {"expr": {"type": "string"}}, "type": "object"}}}"#,
        "\n</tools>\n\nTo call a function, answer with a JSON object holding its name and arguments inside ",
        "<tool_call></tool_call>:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n",
        "<|im_start|>user\nWhat is 2+3?<|im_end|>\n",
        "<|im_start|>assistant\n<think>\nUse the tool.\n</think>\n\n<tool_call>\n{\"name\": \"calc\", \"arguments\": {\"expr\": \"2+3\"}}\n</tool_call><|im_end|>\n",
        "<|im_start|>user\n<tool_response>\n5\n</tool_response><|im_end|>\n",
        "<|im_start|>assistant\n5<|im_end|>\n",
        "<|im_start|>user\nThanks<|im_end|>\n",
        "<|im_start|>assistant\n",
    );
    assert_eq!(got, want);

    let plain = t
        .render(&[Message::user("hi")], &ChatOptions::default())
        .unwrap();
    assert_eq!(plain, "<|im_start|>user\nhi<|im_end|>\n");
}

/// Meta-Llama-3-Instruct's template (one line, as shipped in its tokenizer_config.json).
const LLAMA3: &str = "{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}";

#[test]
fn llama3_template_renders_the_expected_prompt() {
    let t = ChatTemplate::new(LLAMA3, specials(&[("bos_token", "<|begin_of_text|>")])).unwrap();
    let messages = [
        Message::system("You are terse."),
        Message::user("  Hello  \n"),
    ];
    let options = ChatOptions {
        add_generation_prompt: true,
        ..ChatOptions::default()
    };
    assert_eq!(
        t.render(&messages, &options).unwrap(),
        "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nYou are terse.<|eot_id|>\
         <|start_header_id|>user<|end_header_id|>\n\nHello<|eot_id|>\
         <|start_header_id|>assistant<|end_header_id|>\n\n"
    );
}

#[test]
fn jinja_whitespace_python_methods_and_extra_variables_follow_transformers() {
    // Block tags on their own lines vanish with their newline (trim_blocks) and indentation
    // (lstrip_blocks); Python string methods and `is false` on an extra variable work.
    let source = "{% for m in messages %}\n    {% if m.role == 'assistant' %}\nA: {{ m.content.split('</think>')[-1].lstrip('\\n') | upper }}\n    {% elif m.content.startswith('!') %}\nCMD {{ m.content[1:].strip() }}\n    {% else %}\nU: {{ m.content }}\n    {% endif %}\n{% endfor %}\n{% if enable_thinking is defined and enable_thinking is false %}\n<think>\n\n</think>\n\n{% endif %}";
    let t = ChatTemplate::new(source, BTreeMap::new()).unwrap();
    let messages = [
        Message::user("hi"),
        Message::assistant("<think>x</think>\n\nok"),
        Message::user("! run  "),
    ];
    let mut options = ChatOptions::default();
    assert_eq!(
        t.render(&messages, &options).unwrap(),
        "U: hi\nA: OK\nCMD run\n"
    );
    options.extra.insert("enable_thinking".into(), json!(false));
    assert_eq!(
        t.render(&messages, &options).unwrap(),
        "U: hi\nA: OK\nCMD run\n<think>\n\n</think>\n\n"
    );
}

#[test]
fn template_errors_are_reported_not_panicked() {
    let t = ChatTemplate::new("{{ raise_exception('no system role') }}", BTreeMap::new()).unwrap();
    let err = t
        .render(&[Message::user("x")], &ChatOptions::default())
        .unwrap_err();
    assert_eq!(err.kind(), "chat_template");
    assert!(err.to_string().contains("no system role"), "{err}");
    assert!(ChatTemplate::new("{% for %}", BTreeMap::new()).is_err());
    let t = ChatTemplate::new("{{ tools | tojson(indent=2) }}", BTreeMap::new()).unwrap();
    let opts = ChatOptions {
        tools: Some(vec![]),
        ..ChatOptions::default()
    };
    assert_eq!(t.render(&[], &opts).unwrap(), "[]");
}

#[test]
fn completions_parse_into_reasoning_content_and_tool_calls() {
    let p = CompletionParser::default();
    let m = p
        .parse("<think>\nadd them\n</think>\n\nThe answer is 5.", "t0-")
        .unwrap();
    assert_eq!(m.role, Role::Assistant);
    assert_eq!(m.reasoning_content.as_deref(), Some("add them"));
    assert_eq!(m.content.as_deref(), Some("The answer is 5."));
    assert!(m.tool_calls.is_empty());

    // Thinking opened by the prompt: the completion starts inside the reasoning.
    let m = p.parse("hmm\n</think>\n\nok", "t0-").unwrap();
    assert_eq!(m.reasoning_content.as_deref(), Some("hmm"));
    assert_eq!(m.content.as_deref(), Some("ok"));

    let text = "Let me compute.\n<tool_call>\n{\"name\": \"calc\", \"arguments\": {\"expr\": \"2+3\"}}\n</tool_call>\n<tool_call>{\"name\": \"noop\"}</tool_call>";
    let m = p.parse(text, "t1-").unwrap();
    assert_eq!(m.content.as_deref(), Some("Let me compute."));
    assert_eq!(m.tool_calls.len(), 2);
    assert_eq!(m.tool_calls[0].id, "t1-0");
    assert_eq!(m.tool_calls[0].function.name, "calc");
    let args: serde_json::Value =
        serde_json::from_str(&m.tool_calls[0].function.arguments).unwrap();
    assert_eq!(args, json!({"expr": "2+3"}));
    assert_eq!(m.tool_calls[1].function.arguments, "{}");

    let only_call = p
        .parse(
            "<tool_call>{\"name\": \"calc\", \"arguments\": \"{}\"}</tool_call>",
            "x",
        )
        .unwrap();
    assert_eq!(only_call.content, None);

    let plain = p.parse("just text", "x").unwrap();
    assert_eq!(plain.content.as_deref(), Some("just text"));
    assert_eq!(plain.reasoning_content, None);
}

#[test]
fn malformed_completions_are_errors_with_kinds() {
    let p = CompletionParser::default();
    let cases: [(&str, &str); 7] = [
        ("<think>never closed", "unclosed_reasoning"),
        ("<tool_call>{\"name\": \"calc\"", "unclosed_tool_call"),
        ("oops </tool_call>", "stray_tool_call_close"),
        ("<tool_call>{not json}</tool_call>", "invalid_tool_call"),
        ("<tool_call>[1, 2]</tool_call>", "invalid_tool_call"),
        (
            "<tool_call>{\"arguments\": {}}</tool_call>",
            "invalid_tool_call",
        ),
        (
            "<tool_call>{\"name\": \"f\", \"arguments\": 3}</tool_call>",
            "invalid_tool_call",
        ),
    ];
    for (text, kind) in cases {
        let err = p.parse(text, "x").unwrap_err();
        assert_eq!(err.kind(), kind, "{text}: {err}");
    }
    assert_eq!(
        p.parse("a<tool_call>{\"name\":\"f\"}</tool_call>b<tool_call>{", "x")
            .unwrap_err(),
        CompletionParseError::UnclosedToolCall { index: 1 }
    );
}

#[test]
fn qwen3_style_namespace_and_reverse_iteration_work() {
    // The "last real user query" scan of Qwen3's template.
    let source = r#"{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == "user" and message.content is string and not(message.content.startswith('<tool_response>') and message.content.endswith('</tool_response>')) %}
        {%- set ns.multi_step_tool = false %}
        {%- set ns.last_query_index = index %}
    {%- endif %}
{%- endfor %}
{{- ns.last_query_index }}"#;
    let t = ChatTemplate::new(source, BTreeMap::new()).unwrap();
    let messages = [
        Message::user("a"),
        Message::user("b"),
        Message::assistant("c"),
        Message::user("<tool_response>x</tool_response>"),
    ];
    assert_eq!(t.render(&messages, &ChatOptions::default()).unwrap(), "1");
}

/// Runs `render` on a thread and waits at most 60 s: a template that loops fails the test
/// instead of hanging it.
fn within_60s(
    render: impl FnOnce() -> sluice_model::Result<String> + Send + 'static,
) -> sluice_model::Result<String> {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(render());
    });
    rx.recv_timeout(std::time::Duration::from_secs(60))
        .expect("the rendering returned (a looping template once hung it)")
}

/// A looping template fails its rendering with an error naming the bound it ran out of (H5: a
/// 10¹⁰-step loop from `tokenizer_config.json` once hung `sluice run` with memory growing).
#[test]
fn runaway_templates_run_out_of_their_budget() {
    let looping =
        "{% for i in range(100000) %}{% for j in range(100000) %}x{% endfor %}{% endfor %}";
    let dir = tempfile::tempdir().unwrap();
    sluice_model::presets::write_preset(sluice_model::presets::Preset::Tiny, dir.path(), 0)
        .unwrap();
    let config_path = dir.path().join("tokenizer_config.json");
    let mut config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&config_path).unwrap()).unwrap();
    config["chat_template"] = json!(looping);
    std::fs::write(&config_path, config.to_string()).unwrap();
    let _ = std::fs::remove_file(dir.path().join("chat_template.jinja"));
    let tokenizer = sluice_model::Tokenizer::from_dir(dir.path()).unwrap();
    let err = within_60s(move || {
        tokenizer.apply_chat_template(&[Message::user("hi")], &ChatOptions::default())
    })
    .unwrap_err();
    assert_eq!(err.kind(), "chat_template");
    assert!(
        err.to_string()
            .contains("used up its budget of 10000000 template steps"),
        "{err}"
    );

    let budget = |fuel, max_output_bytes, seconds| sluice_model::chat::RenderBudget {
        fuel,
        max_output_bytes,
        deadline: std::time::Duration::from_secs(seconds),
    };
    let t = ChatTemplate::new(looping, BTreeMap::new())
        .unwrap()
        .with_budget(budget(u64::MAX / 4, 1000, 3600));
    let err =
        within_60s(move || t.render(&[Message::user("hi")], &ChatOptions::default())).unwrap_err();
    assert!(
        err.to_string().contains("the text passed 1000 bytes"),
        "{err}"
    );
    let t = ChatTemplate::new(looping, BTreeMap::new())
        .unwrap()
        .with_budget(budget(u64::MAX / 4, usize::MAX, 0));
    let err =
        within_60s(move || t.render(&[Message::user("hi")], &ChatOptions::default())).unwrap_err();
    assert!(err.to_string().contains("deadline"), "{err}");

    // Real templates render well within the default budget.
    let t = ChatTemplate::new(CHATML_TEMPLATE, BTreeMap::new()).unwrap();
    let many: Vec<Message> = (0..2000).map(|i| Message::user(format!("m{i}"))).collect();
    assert!(t.render(&many, &ChatOptions::default()).is_ok());
}

/// A template that writes `<think>` reasons (its replies' reasoning is parsed out by the
/// server): Sluice's ChatML, as Qwen3's; SmolLM2's plain ChatML and Llama 3's do not, and a
/// `<think>` in their replies stays text.
#[test]
fn a_template_reasons_when_it_writes_the_think_tag() {
    let plain =
        "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}";
    assert!(
        !ChatTemplate::new(plain, specials(&[]))
            .unwrap()
            .has_reasoning()
    );
    let llama = ChatTemplate::new(LLAMA3, specials(&[])).unwrap();
    assert!(!llama.has_reasoning());
    let t = ChatTemplate::new(CHATML_TEMPLATE, specials(&[])).unwrap();
    assert!(t.has_reasoning());
    // The parser reads the tags only when asked: the pipeline asks for both.
    let p = CompletionParser::default();
    let text = "<think>plan</think>The answer";
    let off = p.parse_only(text, "c", false, false).unwrap();
    assert_eq!(off.content.as_deref(), Some(text));
    let on = p.parse_only(text, "c", true, false).unwrap();
    assert_eq!(on.reasoning_content.as_deref(), Some("plan"));
    assert_eq!(on.content.as_deref(), Some("The answer"));
}

/// A tool schema and an earlier call's arguments render with their keys in the order the client
/// sent them, as transformers' `json.dumps` prints them: sorted, the prompt differed from the
/// reference and rewrote what the model itself had written.
#[test]
fn tool_schemas_and_arguments_keep_their_key_order() {
    let t = ChatTemplate::new(CHATML_TEMPLATE, specials(&[])).unwrap();
    let schema: serde_json::Value = serde_json::from_str(
        r#"{"type": "object", "properties": {"unit": {"type": "string", "enum": ["c", "f"]}, "location": {"type": "string"}}, "required": ["location"]}"#,
    )
    .unwrap();
    let tool = ToolSpec {
        kind: "function".into(),
        function: FunctionSpec {
            name: "weather".into(),
            description: String::new(),
            parameters: schema,
        },
    };
    let call: serde_json::Value =
        serde_json::from_str(r#"{"unit": "c", "location": "Paris"}"#).unwrap();
    let messages = [
        Message::user("Weather?"),
        Message {
            role: Role::Assistant,
            content: None,
            reasoning_content: None,
            tool_calls: vec![ToolCall {
                id: "c0".into(),
                kind: "function".into(),
                function: FunctionCall {
                    name: "weather".into(),
                    arguments: call.to_string(),
                },
            }],
            tool_call_id: None,
            name: None,
        },
    ];
    let opts = ChatOptions {
        tools: Some(vec![tool]),
        ..ChatOptions::default()
    };
    let prompt = t.render(&messages, &opts).unwrap();
    assert!(
        prompt.contains(r#""parameters": {"type": "object", "properties": {"unit": {"type": "string", "enum": ["c", "f"]}, "location""#),
        "{prompt}"
    );
    assert!(
        prompt.contains(r#""arguments": {"unit": "c", "location": "Paris"}"#),
        "{prompt}"
    );
}
