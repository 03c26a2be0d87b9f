//! Requests the server refuses or bounds: the log-probability budget, streamed echo, parameters it does not implement, reserved template variables, weight versions that would go back (part of the `server_api` test binary).

use super::*;

/// The `error.message` and `error.param` of a refusal with `status`.
fn refusal(r: &server_support::Reply, status: u16) -> (String, Value) {
    assert_eq!(r.status, status, "{}", r.body);
    let e = r.json();
    (
        e["error"]["message"].as_str().unwrap().to_owned(),
        e["error"]["param"].clone(),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn echo_logprobs_over_the_per_request_budget_are_refused_naming_the_fields() {
    let s = serve_tiny().await;
    // 2 prompts × n = 8 × 3,500 echoed tokens × (20 + 1) = 1,176,000 log-probabilities.
    let long: Vec<u32> = (0..3500).map(|i| 40 + i % 50).collect();
    let body = json!({
        "prompt": [long.clone(), long.clone()], "n": 8, "max_tokens": 1,
        "logprobs": 20, "echo": true,
    });
    let r = post(s.addr, "/v1/completions", body).await;
    let (message, param) = refusal(&r, 400);
    assert_eq!(param, "logprobs");
    assert!(
        message.contains("1176336 log-probabilities") && message.contains("at most 1048576"),
        "{message}"
    );
    assert!(
        message.contains("`n`") && message.contains("`logprobs`"),
        "{message}"
    );
    // Within the budget, every choice of a prompt carries its prompt's log-probabilities.
    let body = json!({
        "prompt": [[40, 41, 42, 43]], "n": 3, "max_tokens": 2, "logprobs": 2, "echo": true,
        "ignore_eos": true,
    });
    let v = post(s.addr, "/v1/completions", body).await.json();
    let choices = v["choices"].as_array().unwrap();
    assert_eq!(choices.len(), 3);
    let head = |c: &Value, k: &str| c["logprobs"][k].as_array().unwrap()[..4].to_vec();
    for c in choices {
        assert_eq!(c["logprobs"]["tokens"].as_array().unwrap().len(), 6);
        assert_eq!(c["logprobs"]["token_logprobs"][0], Value::Null);
        for k in ["tokens", "token_logprobs", "top_logprobs", "text_offset"] {
            assert_eq!(head(c, k), head(&choices[0], k), "{k}");
        }
    }
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_streamed_echo_sends_the_prompt_and_its_logprobs_first() {
    let s = serve_tiny().await;
    let body = json!({
        "prompt": "Hello", "max_tokens": 3, "temperature": 0, "ignore_eos": true,
        "echo": true, "logprobs": 1, "n": 2,
    });
    let whole = post(s.addr, "/v1/completions", body.clone()).await.json();
    let mut stream_body = body;
    stream_body["stream"] = json!(true);
    let r = post(s.addr, "/v1/completions", stream_body).await;
    assert_eq!(r.status, 200, "{}", r.body);
    let events = r.events();
    for i in 0..2 {
        let chunks: Vec<Value> = events[..events.len() - 1]
            .iter()
            .map(|e| serde_json::from_str::<Value>(e).unwrap()["choices"][0].clone())
            .filter(|c| c["index"] == i)
            .collect();
        assert_eq!(chunks[0]["text"], "Hello", "{chunks:?}");
        let prompt_lps = &chunks[0]["logprobs"]["token_logprobs"];
        assert_eq!(prompt_lps[0], Value::Null);
        let mut text = String::new();
        let mut logprobs = Vec::new();
        for c in &chunks {
            text.push_str(c["text"].as_str().unwrap());
            if let Some(l) = c["logprobs"]["token_logprobs"].as_array() {
                logprobs.extend(l.iter().cloned());
            }
        }
        let w = &whole["choices"][i as usize];
        assert_eq!(text, w["text"].as_str().unwrap());
        // The prompt's part exactly; the generated tokens' (batched differently) to the bit
        // or nearly.
        let want = w["logprobs"]["token_logprobs"].as_array().unwrap();
        let prompt_len = prompt_lps.as_array().unwrap().len();
        assert_eq!(logprobs.len(), want.len());
        assert_eq!(logprobs[..prompt_len], want[..prompt_len]);
        for (a, b) in logprobs[prompt_len..].iter().zip(&want[prompt_len..]) {
            assert!(
                (a.as_f64().unwrap() - b.as_f64().unwrap()).abs() < 1e-3,
                "{a} {b}"
            );
        }
    }
    // Echo without logprobs: the prompt text alone comes first.
    let r = post(
        s.addr,
        "/v1/completions",
        json!({"prompt": "Hi", "max_tokens": 2, "echo": true, "stream": true}),
    )
    .await;
    let first: Value = serde_json::from_str(&r.events()[0]).unwrap();
    assert_eq!(first["choices"][0]["text"], "Hi");
    assert_eq!(first["choices"][0]["logprobs"], Value::Null);
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unsupported_parameters_are_refused_unless_neutral() {
    let s = serve_tiny().await;
    let refused: Vec<(&str, Value)> = vec![
        ("logit_bias", json!({"5": 100})),
        ("presence_penalty", json!(0.5)),
        ("frequency_penalty", json!(-1)),
        ("repetition_penalty", json!(1.2)),
        ("min_p", json!(0.1)),
        ("min_tokens", json!(4)),
        ("best_of", json!(3)),
        ("suffix", json!("end")),
    ];
    for (field, value) in &refused {
        let mut body = json!({"prompt": "a", "max_tokens": 2});
        body[*field] = value.clone();
        let r = post(s.addr, "/v1/completions", body).await;
        let (message, param) = refusal(&r, 400);
        assert_eq!(param, *field, "{message}");
        assert!(message.contains("not supported"), "{message}");
    }
    // What clients such as LangChain send by default changes nothing and is accepted.
    let neutral = json!({
        "prompt": "a", "max_tokens": 2, "n": 2, "logit_bias": {}, "presence_penalty": 0,
        "frequency_penalty": 0.0, "repetition_penalty": 1, "min_p": 0, "min_tokens": 0,
        "best_of": 2, "suffix": null,
    });
    let r = post(s.addr, "/v1/completions", neutral).await;
    assert_eq!(r.status, 200, "{}", r.body);
    // Chat: the same fields, a tool choice the server cannot force, structured output it
    // cannot constrain, the legacy function fields, and alternatives asked for without the
    // log-probs they belong to (each was answered 200 with free text or nothing).
    let msgs = json!([{"role": "user", "content": "hi"}]);
    for (field, value) in [
        ("presence_penalty", json!(1)),
        ("tool_choice", json!("required")),
        (
            "tool_choice",
            json!({"type": "function", "function": {"name": "f"}}),
        ),
        ("response_format", json!({"type": "json_object"})),
        (
            "response_format",
            json!({"type": "json_schema", "json_schema": {"name": "p", "schema": {"type": "object"}}}),
        ),
        (
            "functions",
            json!([{"name": "f", "parameters": {"type": "object"}}]),
        ),
        ("function_call", json!({"name": "f"})),
        ("top_logprobs", json!(3)),
    ] {
        let mut body = json!({"messages": msgs, "max_tokens": 2});
        body[field] = value;
        let r = post(s.addr, "/v1/chat/completions", body).await;
        let (message, param) = refusal(&r, 400);
        assert_eq!(param, field, "{message}");
    }
    for choice in ["auto", "none"] {
        let body = json!({
            "messages": msgs, "max_tokens": 2, "tool_choice": choice, "presence_penalty": 0,
            "response_format": {"type": "text"}, "functions": [], "function_call": choice,
            "top_logprobs": 0,
        });
        let r = post(s.addr, "/v1/chat/completions", body).await;
        assert_eq!(r.status, 200, "{}", r.body);
    }
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chat_template_kwargs_may_not_replace_what_the_server_sets() {
    let s = serve_tiny().await;
    let msgs = json!([{"role": "user", "content": "hi"}]);
    for name in [
        "messages",
        "tools",
        "add_generation_prompt",
        "eos_token",
        "bos_token",
    ] {
        let body = json!({"messages": msgs, "max_tokens": 1, "chat_template_kwargs": {name: "x"}});
        let r = post(s.addr, "/v1/chat/completions", body).await;
        let (message, param) = refusal(&r, 400);
        assert_eq!(param, "chat_template_kwargs");
        assert!(message.contains(&format!("`{name}`")), "{message}");
    }
    let body = json!({"messages": msgs, "max_tokens": 1, "chat_template_kwargs": {"enable_thinking": false}});
    let r = post(s.addr, "/v1/chat/completions", body).await;
    assert_eq!(r.status, 200, "{}", r.body);
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn weight_versions_only_rise_and_never_wrap() {
    let s = serve_tiny().await;
    let next = s.dir.path().join("next");
    write_tiny(&next, 1);
    let update = |body: Value| post(s.addr, "/update_weights_from_disk", body);
    let u = update(json!({"model_path": next, "weight_version": 5})).await;
    assert_eq!(u.status, 200, "{}", u.body);
    let (message, param) = refusal(
        &update(json!({"model_path": next, "weight_version": 2})).await,
        409,
    );
    assert_eq!(param, "weight_version");
    assert!(
        message.contains("weight_version 2") && message.contains("5"),
        "{message}"
    );
    // The same version again is a reload, not a step back.
    assert_eq!(
        update(json!({"model_path": next, "weight_version": 5}))
            .await
            .status,
        200
    );
    let max = u64::MAX;
    let u = update(json!({"model_path": next, "weight_version": max})).await;
    assert_eq!(u.status, 200, "{}", u.body);
    let (message, param) = refusal(&update(json!({"model_path": next})).await, 400);
    assert_eq!(param, "weight_version");
    assert!(message.contains(&max.to_string()), "{message}");
    let v = call(s.addr, "GET", "/get_weight_version", "").await.json();
    assert_eq!(v["weight_version"], json!(max));
    s.stop().await;
}
