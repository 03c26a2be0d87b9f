//! The OpenAI-compatible server through a real HTTP client on 127.0.0.1:0: completions (text and
//! ids, echo + logprobs, n, stop, streaming), chat (logprobs, streaming), models and health,
//! the RL extensions (guarded by the bearer token when one is set), the prompt-size bound, and
//! the bad-input table.

#[path = "server_api/refusals.rs"]
mod refusals;
mod server_support;

use serde_json::{Value, json};
use server_support::{
    call, call_with, post, serve_scripted, serve_tiny, serve_tiny_with, write_tiny,
};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn completions_with_echo_logprobs_and_token_ids() {
    let s = serve_tiny().await;
    let r = post(
        s.addr,
        "/v1/completions",
        json!({
            "model": "tiny", "prompt": "Hello", "max_tokens": 5, "temperature": 0,
            "logprobs": 2, "echo": true, "ignore_eos": true, "return_token_ids": true,
        }),
    )
    .await;
    assert_eq!(r.status, 200, "{}", r.body);
    let v = r.json();
    let c = &v["choices"][0];
    assert_eq!(c["token_ids"].as_array().unwrap().len(), 5);
    assert_eq!(c["prompt_token_ids"].as_array().unwrap().len(), 5);
    assert_eq!(c["token_versions"], json!([0, 0, 0, 0, 0]));
    assert_eq!(c["finish_reason"], "length");
    assert!(c["text"].as_str().unwrap().starts_with("Hello"));
    let lp = &c["logprobs"];
    assert_eq!(lp["tokens"].as_array().unwrap().len(), 10);
    assert_eq!(lp["token_logprobs"][0], Value::Null);
    assert!(lp["token_logprobs"][1].as_f64().unwrap() < 0.0);
    assert_eq!(lp["top_logprobs"][3].as_object().unwrap().len(), 2);
    assert_eq!(v["usage"]["completion_tokens"], 5);

    // Token-id prompts, n = 2 with a seed: two choices, reproducible.
    let body = json!({"prompt": [40, 41, 42], "max_tokens": 6, "n": 2, "seed": 3, "ignore_eos": true, "return_token_ids": true});
    let a = post(s.addr, "/v1/completions", body.clone()).await.json();
    let b = post(s.addr, "/v1/completions", body).await.json();
    assert_eq!(a["choices"].as_array().unwrap().len(), 2);
    assert_eq!(a["choices"][0]["token_ids"], b["choices"][0]["token_ids"]);
    assert_eq!(a["choices"][1]["token_ids"], b["choices"][1]["token_ids"]);
    s.stop().await;
}

/// A stream rejoins to the whole reply: its text, its tokens' `text_offset`s (they were all 0)
/// and, with `stream_options.include_usage`, a last chunk of the same usage and no choices.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streaming_matches_the_whole_reply() {
    let s = serve_tiny().await;
    let body = json!({"prompt": "abc", "max_tokens": 8, "temperature": 0, "ignore_eos": true, "logprobs": 1, "echo": true});
    let whole = post(s.addr, "/v1/completions", body.clone()).await.json();
    let mut stream_body = body;
    stream_body["stream"] = json!(true);
    stream_body["stream_options"] = json!({"include_usage": true});
    let r = post(s.addr, "/v1/completions", stream_body).await;
    assert_eq!(r.status, 200);
    let events = r.events();
    assert_eq!(events.last().unwrap(), "[DONE]");
    let usage: Value = serde_json::from_str(&events[events.len() - 2]).unwrap();
    assert_eq!(usage["choices"], json!([]), "{usage}");
    assert_eq!(usage["usage"], whole["usage"]);
    let mut text = String::new();
    let mut offsets = Vec::new();
    let mut finish = Value::Null;
    for e in &events[..events.len() - 2] {
        let v: Value = serde_json::from_str(e).unwrap();
        let c = &v["choices"][0];
        text.push_str(c["text"].as_str().unwrap());
        if let Some(o) = c["logprobs"]["text_offset"].as_array() {
            offsets.extend(o.iter().cloned());
        }
        if !c["finish_reason"].is_null() {
            finish = c["finish_reason"].clone();
        }
    }
    let c = &whole["choices"][0];
    assert_eq!(text, c["text"].as_str().unwrap());
    assert_eq!(json!(offsets), c["logprobs"]["text_offset"]);
    assert_eq!(finish, "length");
    // The options belong to a stream.
    let r = post(
        s.addr,
        "/v1/completions",
        json!({"prompt": "abc", "max_tokens": 2, "stream_options": {"include_usage": true}}),
    )
    .await;
    assert_eq!(r.status, 400, "{}", r.body);
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stop_strings_cut_the_text() {
    let s = serve_tiny().await;
    let body = json!({"prompt": "xy", "max_tokens": 12, "temperature": 0, "ignore_eos": true, "return_token_ids": true});
    let free = post(s.addr, "/v1/completions", body.clone()).await.json();
    let text = free["choices"][0]["text"].as_str().unwrap().to_owned();
    // Stop on the 4th..5th characters of the free completion.
    let stop: String = text.chars().skip(3).take(2).collect();
    let mut stopped = body;
    stopped["stop"] = json!([stop]);
    let v = post(s.addr, "/v1/completions", stopped).await.json();
    let c = &v["choices"][0];
    assert_eq!(c["finish_reason"], "stop");
    let cut = c["text"].as_str().unwrap();
    assert!(
        text.starts_with(cut) && !cut.contains(&stop),
        "{cut:?} / {text:?} / {stop:?}"
    );
    assert_eq!(c["stop_reason"], json!(stop));
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chat_with_logprobs_and_streaming() {
    let s = serve_tiny().await;
    // History as OpenAI's Python client dumps its replies: `tool_calls` and `name` null.
    let body = json!({
        "model": "tiny",
        "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"},
                     {"role": "assistant", "content": "Hi.", "tool_calls": null, "name": null},
                     {"role": "user", "content": [{"type": "text", "text": "Hi"}]}],
        "max_tokens": 6, "temperature": 0, "logprobs": true, "top_logprobs": 3, "ignore_eos": true,
        "tools": [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}],
    });
    let r = post(s.addr, "/v1/chat/completions", body.clone()).await;
    assert_eq!(r.status, 200, "{}", r.body);
    let v = r.json();
    assert_eq!(v["object"], "chat.completion");
    let c = &v["choices"][0];
    assert_eq!(c["message"]["role"], "assistant");
    let content = c["logprobs"]["content"].as_array().unwrap();
    assert_eq!(content.len(), 6);
    assert_eq!(content[0]["top_logprobs"].as_array().unwrap().len(), 3);
    let mut streamed = body.clone();
    streamed["stream"] = json!(true);
    streamed.as_object_mut().unwrap().remove("tools");
    let r = post(s.addr, "/v1/chat/completions", streamed).await;
    let events = r.events();
    assert_eq!(events.last().unwrap(), "[DONE]");
    let first: Value = serde_json::from_str(&events[0]).unwrap();
    assert_eq!(first["choices"][0]["delta"]["role"], "assistant");
    assert_eq!(first["object"], "chat.completion.chunk");
    // Usage: the prompt once, whatever `n` (it was counted n times), and at the end of a
    // stream that asks for it.
    let mut two = body.clone();
    two["n"] = json!(2);
    let one = post(s.addr, "/v1/chat/completions", body.clone())
        .await
        .json();
    let two = post(s.addr, "/v1/chat/completions", two).await.json();
    assert_eq!(two["usage"]["prompt_tokens"], one["usage"]["prompt_tokens"]);
    assert_eq!(two["usage"]["completion_tokens"], 12);
    let mut counted = body;
    counted["stream"] = json!(true);
    counted["stream_options"] = json!({"include_usage": true});
    let events = post(s.addr, "/v1/chat/completions", counted).await.events();
    let usage: Value = serde_json::from_str(&events[events.len() - 2]).unwrap();
    assert_eq!(usage["choices"], json!([]));
    assert_eq!(usage["usage"], one["usage"]);
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn models_health_and_the_bad_input_table() {
    let s = serve_tiny().await;
    assert_eq!(call(s.addr, "GET", "/health", "").await.status, 200);
    let m = call(s.addr, "GET", "/v1/models", "").await.json();
    assert_eq!(m["data"][0]["id"], "tiny");
    let cases: Vec<(&str, String, u16)> = vec![
        (
            "unknown model",
            json!({"model": "gpt-9", "prompt": "a"}).to_string(),
            404,
        ),
        (
            "negative max_tokens",
            json!({"prompt": "a", "max_tokens": -1}).to_string(),
            400,
        ),
        (
            "huge max_tokens",
            json!({"prompt": "a", "max_tokens": 100_000_000}).to_string(),
            400,
        ),
        (
            "prompt too long",
            json!({"prompt": "a".repeat(5000)}).to_string(),
            400,
        ),
        (
            "token id out of vocab",
            json!({"prompt": [1, 2, 999_999]}).to_string(),
            400,
        ),
        ("malformed JSON", "{\"prompt\": ".to_owned(), 400),
        (
            "temperature < 0",
            json!({"prompt": "a", "temperature": -0.5}).to_string(),
            400,
        ),
        ("n = 0", json!({"prompt": "a", "n": 0}).to_string(), 400),
        ("bad prompt type", json!({"prompt": 5}).to_string(), 400),
    ];
    for (what, body, status) in cases {
        let r = call(s.addr, "POST", "/v1/completions", &body).await;
        assert_eq!(r.status, status, "{what}: {}", r.body);
        let e = r.json();
        assert!(
            e["error"]["message"].as_str().is_some(),
            "{what}: {}",
            r.body
        );
        assert!(e["error"]["type"].as_str().is_some());
    }
    let chat_bad = post(
        s.addr,
        "/v1/chat/completions",
        json!({"messages": [{"role": "wizard", "content": "x"}]}),
    )
    .await;
    assert_eq!(chat_bad.status, 400);
    assert_eq!(call(s.addr, "GET", "/nope", "").await.status, 404);
    // Still serving.
    let ok = post(
        s.addr,
        "/v1/completions",
        json!({"prompt": "a", "max_tokens": 2}),
    )
    .await;
    assert_eq!(ok.status, 200, "{}", ok.body);
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn abort_pause_continue_and_weights_from_disk() {
    let s = serve_tiny().await;
    let addr = s.addr;
    let long = tokio::spawn(async move {
        post(addr, "/v1/completions", json!({
            "prompt": "go", "max_tokens": 3000, "ignore_eos": true, "rid": "long-1", "return_token_ids": true,
        }))
        .await
    });
    // Wait until it is generating, then abort it by rid.
    loop {
        let v = call(addr, "GET", "/get_weight_version", "").await.json();
        if v["generated_tokens"].as_u64().unwrap() >= 3 {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(5)).await;
    }
    let a = post(addr, "/abort_request", json!({"rid": "long-1"})).await;
    assert_eq!(a.status, 200);
    let r = long.await.unwrap().json();
    let c = &r["choices"][0];
    assert_eq!(c["finish_reason"], "abort");
    let n = c["token_ids"].as_array().unwrap().len();
    assert!((3..3000).contains(&n), "{n}");

    // Paused in place: a request waits; continuing lets it finish.
    assert_eq!(
        post(addr, "/pause_generation", json!({"mode": "in_place"}))
            .await
            .status,
        200
    );
    let waiting = tokio::spawn(async move {
        post(
            addr,
            "/v1/completions",
            json!({"prompt": "p", "max_tokens": 3, "ignore_eos": true}),
        )
        .await
    });
    tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    assert!(!waiting.is_finished());
    assert_eq!(
        post(addr, "/continue_generation", json!({})).await.status,
        200
    );
    assert_eq!(
        waiting.await.unwrap().json()["choices"][0]["finish_reason"],
        "length"
    );

    // New weights from disk become version 1; later tokens carry it.
    let next = s.dir.path().join("next");
    write_tiny(&next, 1);
    let u = post(
        addr,
        "/update_weights_from_disk",
        json!({"model_path": next}),
    )
    .await;
    assert_eq!(u.status, 200, "{}", u.body);
    assert_eq!(u.json()["weight_version"], 1);
    let v = post(
        addr,
        "/v1/completions",
        json!({"prompt": "q", "max_tokens": 3, "ignore_eos": true, "return_token_ids": true}),
    )
    .await
    .json();
    assert_eq!(v["choices"][0]["token_versions"], json!([1, 1, 1]));
    let missing = post(
        addr,
        "/update_weights_from_disk",
        json!({"model_path": "/nonexistent/x"}),
    )
    .await;
    assert_eq!(missing.status, 400);
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streamed_tool_calls_come_as_openai_deltas_and_reassemble_to_the_whole_reply() {
    let pieces = [
        "Let me check.",
        "<tool_call>",
        "{\"name\": \"get_",
        "weather\", \"arguments\": {\"city\": \"",
        "Paris",
        "\", \"days\": 3",
        "}}",
        "</tool_call>",
    ];
    let s = serve_scripted(&pieces).await;
    let body = json!({
        "model": "tiny", "max_tokens": 32, "temperature": 0,
        "messages": [{"role": "user", "content": "Weather in Paris?"}],
        "tools": [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}],
    });
    let whole = post(s.addr, "/v1/chat/completions", body.clone())
        .await
        .json();
    let choice = &whole["choices"][0];
    assert_eq!(choice["finish_reason"], "tool_calls", "{whole}");
    let message = &choice["message"];
    assert_eq!(message["content"], "Let me check.");
    let call = &message["tool_calls"][0];
    assert_eq!(call["type"], "function");
    assert_eq!(call["function"]["name"], "get_weather");
    assert_eq!(
        call["function"]["arguments"],
        r#"{"city":"Paris","days":3}"#
    );

    let mut streamed = body.clone();
    streamed["stream"] = json!(true);
    let r = post(s.addr, "/v1/chat/completions", streamed).await;
    assert_eq!(r.status, 200, "{}", r.body);
    let events = r.events();
    assert_eq!(events.last().unwrap(), "[DONE]");
    let (mut content, mut finish) = (String::new(), Value::Null);
    let (mut header, mut arguments, mut fragments) = (Value::Null, String::new(), 0);
    for e in &events[..events.len() - 1] {
        let v: Value = serde_json::from_str(e).unwrap();
        let c = &v["choices"][0];
        if let Some(t) = c["delta"]["content"].as_str() {
            assert!(header.is_null(), "content after the tool call: {t:?}");
            content.push_str(t);
        }
        for call in c["delta"]["tool_calls"].as_array().into_iter().flatten() {
            assert_eq!(call["index"], 0);
            if header.is_null() {
                // The first tool-call delta carries the header, arguments still empty.
                assert!(call["id"].as_str().unwrap().starts_with("call_"));
                assert_eq!(call["type"], "function");
                assert_eq!(call["function"]["arguments"], "");
                header = call.clone();
            } else {
                assert!(call.get("id").is_none() && call["function"].get("name").is_none());
                arguments.push_str(call["function"]["arguments"].as_str().unwrap());
                fragments += 1;
            }
        }
        if !c["finish_reason"].is_null() {
            finish = c["finish_reason"].clone();
        }
    }
    assert_eq!(content, message["content"].as_str().unwrap());
    assert_eq!(header["function"]["name"], call["function"]["name"]);
    assert_eq!(arguments, call["function"]["arguments"].as_str().unwrap());
    // The arguments came as they were generated: one fragment per token of them at least.
    assert!(fragments >= 3, "{fragments} fragments");
    assert_eq!(finish, "tool_calls");

    // Offered no tools, or told `tool_choice: "none"`, the same reply is text, as generated
    // streamed or not: it used to come back as a call nobody offered.
    let raw = pieces.concat();
    let mut plain = body.clone();
    plain.as_object_mut().unwrap().remove("tools");
    let mut none = body.clone();
    none["tool_choice"] = json!("none");
    for request in [plain, none] {
        let v = post(s.addr, "/v1/chat/completions", request.clone())
            .await
            .json();
        let choice = &v["choices"][0];
        assert_eq!(choice["finish_reason"], "stop", "{v}");
        assert_eq!(choice["message"]["content"], raw.as_str(), "{v}");
        assert!(choice["message"].get("tool_calls").is_none(), "{v}");
        let mut streamed = request;
        streamed["stream"] = json!(true);
        let events = post(s.addr, "/v1/chat/completions", streamed)
            .await
            .events();
        let mut text = String::new();
        for e in &events[..events.len() - 1] {
            let v: Value = serde_json::from_str(e).unwrap();
            assert!(v["choices"][0]["delta"].get("tool_calls").is_none(), "{v}");
            text.push_str(v["choices"][0]["delta"]["content"].as_str().unwrap_or(""));
        }
        assert_eq!(text, raw);
    }
    s.stop().await;
}

/// The routes that change the server (weights, pause, abort, continue) need the bearer token
/// when one is set: without it, or with a wrong one, they answer 401 and change nothing (the
/// hostile sweep's `update_weights_from_disk` with `weight_version: 999999` answered 200); with
/// it they work; generation and the read-only routes stay open.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn guarded_routes_need_the_token_and_change_nothing_without_it() {
    let s = serve_tiny_with(Some("s3cret"), Default::default()).await;
    let addr = s.addr;
    let next = s.dir.path().join("next");
    write_tiny(&next, 1);
    let update = json!({"model_path": next, "weight_version": 999_999}).to_string();
    for headers in [
        "",
        "authorization: Bearer wrong\r\n",
        "authorization: s3cret\r\n",
    ] {
        for (path, body) in [
            ("/update_weights_from_disk", update.as_str()),
            (
                "/update_weights_from_url",
                r#"{"url": "http://x:1/v1/weights/1", "crc32": 0}"#,
            ),
            ("/pause_generation", r#"{"mode": "in_place"}"#),
            ("/abort_request", r#"{"abort_all": true}"#),
            ("/continue_generation", "{}"),
        ] {
            let r = call_with(addr, "POST", path, body, headers).await;
            assert_eq!(r.status, 401, "{path} with {headers:?}: {}", r.body);
            assert!(r.head.contains("www-authenticate: bearer"), "{}", r.head);
            assert_eq!(r.json()["error"]["type"], "authentication_error");
        }
    }
    let v = call(addr, "GET", "/get_weight_version", "").await.json();
    assert_eq!(v["weight_version"], 0, "nothing was swapped in");
    // Not paused either: a request runs to its end.
    let r = post(
        addr,
        "/v1/completions",
        json!({"prompt": "p", "max_tokens": 2, "ignore_eos": true}),
    )
    .await;
    assert_eq!(r.json()["choices"][0]["finish_reason"], "length");

    let auth = "authorization: Bearer s3cret\r\n";
    let body = json!({"model_path": next, "weight_version": 1}).to_string();
    let r = call_with(addr, "POST", "/update_weights_from_disk", &body, auth).await;
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(r.json()["weight_version"], 1);
    for path in ["/pause_generation", "/continue_generation"] {
        assert_eq!(
            call_with(addr, "POST", path, "{}", auth).await.status,
            200,
            "{path}"
        );
    }
    s.stop().await;
}

/// A prompt far longer than the context could hold (16 bytes of text per token of context) is
/// refused with a 400 naming its size before it is tokenized, as a text completion and as a
/// chat message; one that fits the bound but not the context is still refused in tokens.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prompt_far_over_the_context_is_refused_before_tokenizing() {
    let s = serve_tiny().await;
    let addr = s.addr;
    let context = call(addr, "GET", "/v1/models", "").await.json()["data"][0]["max_model_len"]
        .as_u64()
        .unwrap() as usize;
    let max = context * sluice_engine::server::prompt_text::PROMPT_BYTES_PER_TOKEN;
    let huge = "a".repeat(1 << 20);
    assert!(huge.len() > max);
    let r = post(
        addr,
        "/v1/completions",
        json!({"prompt": huge, "max_tokens": 1}),
    )
    .await;
    assert_eq!(r.status, 400, "{}", r.body);
    let e = &r.json()["error"];
    assert_eq!(e["param"], "prompt");
    let expected = format!(
        "the prompt text is {} bytes; this model's context of {context} tokens takes at most {max} bytes of text",
        1 << 20
    );
    assert!(e["message"].as_str().unwrap().starts_with(&expected), "{e}");
    let r = post(
        addr,
        "/v1/completions",
        json!({"prompt": ["ok", huge], "max_tokens": 1}),
    )
    .await;
    assert_eq!(r.status, 400, "{}", r.body);
    let r = post(
        addr,
        "/v1/chat/completions",
        json!({"messages": [{"role": "user", "content": huge}], "max_tokens": 1}),
    )
    .await;
    assert_eq!(r.status, 400, "{}", r.body);
    assert_eq!(r.json()["error"]["param"], "messages");
    assert!(r.body.contains("bytes of text"), "{}", r.body);
    // Within the byte bound but over the context: refused in tokens, as before.
    let long = "a ".repeat(context);
    let r = post(
        addr,
        "/v1/completions",
        json!({"prompt": long, "max_tokens": 1}),
    )
    .await;
    assert_eq!(r.status, 400, "{}", r.body);
    assert!(r.body.contains("maximum context length"), "{}", r.body);
    s.stop().await;
}
