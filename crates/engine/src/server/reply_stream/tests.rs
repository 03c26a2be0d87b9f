//! Tests of the parent module (`reply_stream`).

use super::*;

/// Feeds `pieces`, then reassembles the deltas as a client would.
fn reassemble(prompt: &str, pieces: &[&str]) -> (ParsedReply, ParsedReply, Vec<Vec<Delta>>) {
    let mut s = ReplyStream::new(prompt, "call_x_0_".into(), Parsing::ALL);
    let mut all = Vec::new();
    for p in pieces {
        all.push(s.push(p));
    }
    let (last, parsed) = s.finish("");
    all.push(last);
    let mut got = ParsedReply::default();
    let (mut content, mut reasoning) = (String::new(), String::new());
    for d in all.iter().flatten() {
        match d {
            Delta::Reasoning(t) => reasoning.push_str(t),
            Delta::Content(t) => content.push_str(t),
            Delta::CallStart { index, id, name } => {
                assert_eq!(*index, got.tool_calls.len(), "headers in order");
                got.tool_calls.push(ToolCall {
                    id: id.clone(),
                    kind: "function".into(),
                    function: sluice_core::message::FunctionCall {
                        name: name.clone(),
                        arguments: String::new(),
                    },
                });
            }
            Delta::CallArgs { index, fragment } => {
                got.tool_calls[*index].function.arguments.push_str(fragment)
            }
        }
    }
    got.content = (!content.is_empty() || got.tool_calls.is_empty()).then_some(content);
    got.reasoning = (!reasoning.is_empty() || parsed.reasoning.is_some()).then_some(reasoning);
    (got, parsed, all)
}

#[test]
fn content_then_a_call_streams_header_first_then_argument_fragments() {
    let pieces = [
        "  Let me ",
        "check. ",
        "<tool",
        "_call>",
        "{\"name\": \"get_",
        "weather\", \"arguments\": {\"city\": \"Pa",
        "ris\", \"days\": 3",
        "}}</tool_call>",
    ];
    let (got, parsed, all) = reassemble("", &pieces);
    assert_eq!(got, parsed);
    assert_eq!(
        parsed.tool_calls[0].function.arguments,
        r#"{"city":"Paris","days":3}"#
    );
    assert_eq!(parsed.content.as_deref(), Some("Let me check."));
    assert_eq!(parsed.tool_calls[0].function.name, "get_weather");
    // The header arrives with the piece that completes the name, before the arguments.
    assert!(matches!(&all[5][0], Delta::CallStart { name, .. } if name == "get_weather"));
    let fragments = all
        .iter()
        .flatten()
        .filter(|d| matches!(d, Delta::CallArgs { .. }))
        .count();
    assert!(fragments >= 3, "{all:?}");
    // No markup leaked into the content.
    assert!(all.iter().flatten().all(|d| match d {
        Delta::Content(t) => !t.contains('<'),
        _ => true,
    }));
}

#[test]
fn reasoning_calls_in_any_order_and_odd_pieces_reassemble_exactly() {
    let cases: Vec<(&str, Vec<&str>)> = vec![
        (
            "",
            vec![
                "<think>\nhm",
                "m\n</think>\n\nOK",
                "<tool_call>{\"name\":\"a\",\"arguments\":{\"z\":1,\"b\":2.50}}</tool_call>",
                "<tool_call>{\"arguments\":{},\"name\":\"b\"}</tool_call> bye \n",
            ],
        ),
        (
            "<|im_start|>assistant\n<think>\n",
            vec!["why", "\n</think>", "x"],
        ),
        ("", vec!["plain ", "text ", " "]),
        (
            "",
            vec![
                "esc<tool_call>{\"name\": \"e\", \"arguments\": {\"s\": \"a\\u0041\", \"t\": [1, true, null]}}",
                "</tool_call>",
            ],
        ),
        ("", vec!["bad <tool_call>{\"nam", "e\": 1}</tool_call>"]),
        (
            "",
            vec![
                "<",
                "tool",
                "_call",
                ">{\"name\":\"n\",\"arguments\":\"{\\\"k\\\": 1}\"}</tool_call>",
            ],
        ),
    ];
    for (prompt, pieces) in cases {
        let (got, parsed, _) = reassemble(prompt, &pieces);
        assert_eq!(got, parsed, "pieces {pieces:?}");
    }
    // A call left open: the final reply is the raw text, and the header already sent
    // has no call behind it (documented); the content still reassembles.
    let pieces = ["open <tool_call>{\"name\": \"x\"", ", \"arguments\": {"];
    let (got, parsed, _) = reassemble("", &pieces);
    assert_eq!(parsed.content.as_deref(), Some(pieces.concat().as_str()));
    assert!(parsed.tool_calls.is_empty());
    assert_eq!(got.content, parsed.content);
}

#[test]
fn split_at_tag_holds_back_a_possible_tag_start() {
    assert_eq!(split_at_tag("ab<to", "<tool_call>"), ("ab".into(), false));
    assert_eq!(split_at_tag("ab<x", "<tool_call>"), ("ab<x".into(), false));
    assert_eq!(
        split_at_tag("a<tool_call>b", "<tool_call>"),
        ("a".into(), true)
    );
}
