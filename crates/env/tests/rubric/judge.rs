//! The `judge` reward function against a stub OpenAI-compatible chat server (part of the
//! `rubric` test binary): the request it sends, the score it reads, its concurrency bound, and
//! how a judge without a score, a refusing one and an unreachable one fail the rollout.

use std::sync::Mutex;

use axum::Json;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::routing::post;
use serde_json::{Value, json};
use sluice_data::config::{DEFAULT_JUDGE_PROMPT, DEFAULT_SCORE_REGEX, DomainRubric, JudgeConfig};
use sluice_env::configured::rubric_for;

use super::*;

/// What the stub answers and what it saw.
struct Stub {
    answer: String,
    status: StatusCode,
    delay: Duration,
    bodies: Mutex<Vec<(Option<String>, Value)>>,
    in_flight: AtomicUsize,
    most_in_flight: AtomicUsize,
}

async fn completions(
    State(stub): State<Arc<Stub>>,
    headers: HeaderMap,
    Json(body): Json<Value>,
) -> (StatusCode, Json<Value>) {
    let now = stub.in_flight.fetch_add(1, Ordering::SeqCst) + 1;
    stub.most_in_flight.fetch_max(now, Ordering::SeqCst);
    let auth = headers
        .get("authorization")
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned);
    stub.bodies.lock().unwrap().push((auth, body));
    tokio::time::sleep(stub.delay).await;
    stub.in_flight.fetch_sub(1, Ordering::SeqCst);
    let reply = json!({
        "id": "chatcmpl-0",
        "object": "chat.completion",
        "choices": [{"index": 0, "finish_reason": "stop",
                     "message": {"role": "assistant", "content": stub.answer}}],
    });
    (stub.status, Json(reply))
}

/// A stub judge answering `answer` with `status` after `delay`, on `http://127.0.0.1:PORT/v1`.
async fn stub(answer: &str, status: StatusCode, delay: Duration) -> (Arc<Stub>, String) {
    let stub = Arc::new(Stub {
        answer: answer.to_owned(),
        status,
        delay,
        bodies: Mutex::new(Vec::new()),
        in_flight: AtomicUsize::new(0),
        most_in_flight: AtomicUsize::new(0),
    });
    let app = axum::Router::new()
        .route("/v1/chat/completions", post(completions))
        .with_state(Arc::clone(&stub));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}/v1", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    (stub, url)
}

fn judge_config(url: &str, concurrency: u32) -> JudgeConfig {
    JudgeConfig {
        url: url.to_owned(),
        model: "grader".into(),
        prompt: DEFAULT_JUDGE_PROMPT.into(),
        system_prompt: Some("You grade strictly.".into()),
        score_regex: DEFAULT_SCORE_REGEX.into(),
        max_score: 10.0,
        max_tokens: 64,
        temperature: 0.0,
        concurrency,
        timeout: Duration::from_secs(5),
    }
}

/// A finished rollout whose first prompt asked `question` and whose reply is `reply`.
fn answered(question: &str, reply: &str) -> sluice_core::Rollout {
    let mut r = finished(reply, RolloutStatus::Completed);
    r.turns[0].prompt_messages = vec![Message::system("Be brief."), Message::user(question)];
    r
}

/// A rubric of the `judge` function alone over `word_problems`: `Err` is the refusal.
fn judged(judge: Option<JudgeConfig>, error_reward: Option<f64>) -> Result<Rubric, String> {
    let task = sluice_env::TaskRegistry::builtin()
        .get("word_problems")
        .unwrap();
    let spec = DomainRubric {
        weights: [("judge".to_owned(), 1.0)].into(),
        truncation_reward: None,
        error_reward,
        timeout: None,
        regex: None,
        judge,
        reward_model: None,
    };
    rubric_for(&task, &spec)
}

fn rubric_with(judge: JudgeConfig, error_reward: Option<f64>) -> Rubric {
    judged(Some(judge), error_reward).unwrap()
}

#[tokio::test]
async fn the_judge_grades_the_reply_with_the_question_and_the_reference() {
    let (stub, url) = stub("Correct sum.\n**Score:** 7", StatusCode::OK, Duration::ZERO).await;
    let rubric = rubric_with(judge_config(&url, 4), None);
    let s = sample(json!({"answer": "48 + 24 = 72\n#### 72"}));
    let r = answered("How many clips in all?", "She sold 72 clips. #### 72");
    let score = rubric.score(&s, &r).await;
    assert_eq!(score.failed, None);
    assert!((score.components["judge"] - 0.7).abs() < 1e-12, "{score:?}");
    assert!((score.reward - 0.7).abs() < 1e-12);
    let bodies = stub.bodies.lock().unwrap();
    let (auth, body) = &bodies[0];
    assert_eq!(auth, &None, "no $SLUICE_JUDGE_TOKEN in the test");
    assert_eq!(body["model"], "grader");
    assert_eq!(body["max_tokens"], 64);
    assert_eq!(body["temperature"], 0.0);
    let messages = body["messages"].as_array().unwrap();
    assert_eq!(messages[0]["role"], "system");
    assert_eq!(messages[0]["content"], "You grade strictly.");
    assert_eq!(messages[1]["role"], "user");
    let prompt = messages[1]["content"].as_str().unwrap();
    for part in [
        "How many clips in all?",
        "48 + 24 = 72\n#### 72",
        "She sold 72 clips. #### 72",
    ] {
        assert!(prompt.contains(part), "{part:?} not in {prompt}");
    }
    assert!(
        !prompt.contains("Be brief."),
        "the question, not the system prompt"
    );
}

#[tokio::test]
async fn scores_are_scaled_clamped_and_bounded_in_flight() {
    let (stub, url) = stub("score = 14", StatusCode::OK, Duration::from_millis(50)).await;
    let rubric = rubric_with(judge_config(&url, 2), None);
    let s = sample(json!({}));
    let scores = futures::future::join_all((0..6).map(|i| {
        let (rubric, s) = (rubric.clone(), s.clone());
        async move {
            rubric
                .score(&s, &answered("q", &format!("reply {i}")))
                .await
        }
    }))
    .await;
    for score in &scores {
        assert_eq!(score.components["judge"], 1.0, "14 of 10 clamps to 1");
    }
    assert_eq!(stub.bodies.lock().unwrap().len(), 6);
    assert_eq!(
        stub.most_in_flight.load(Ordering::SeqCst),
        2,
        "concurrency = 2"
    );
}

#[tokio::test]
async fn a_judge_without_a_score_or_an_answer_fails_the_rollout_with_the_reason() {
    let s = sample(json!({}));
    let r = answered("q", "a reply");
    // An answer without a score: the rollout fails, its reward is the error reward.
    let (_stub, url) = stub("I cannot grade this.", StatusCode::OK, Duration::ZERO).await;
    let score = rubric_with(judge_config(&url, 1), Some(-1.0))
        .score(&s, &r)
        .await;
    assert!(
        matches!(score.failed, Some(RolloutStatus::Error(_))),
        "{score:?}"
    );
    assert_eq!(score.reward, -1.0);
    // A refusing server.
    let (_stub, url) = stub("busy", StatusCode::SERVICE_UNAVAILABLE, Duration::ZERO).await;
    let score = rubric_with(judge_config(&url, 1), Some(-1.0))
        .score(&s, &r)
        .await;
    assert!(matches!(score.failed, Some(RolloutStatus::Error(_))));
    // Nothing listening.
    let closed = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        format!("http://{}/v1", l.local_addr().unwrap())
    };
    let score = rubric_with(judge_config(&closed, 1), None)
        .score(&s, &r)
        .await;
    assert!(matches!(score.failed, Some(RolloutStatus::Error(_))));
    assert_eq!(score.reward, 0.0);
}

#[test]
fn a_rubric_weighting_judge_without_its_table_is_refused_by_name() {
    let err = judged(None, None).unwrap_err();
    assert!(
        err.starts_with("weights.judge:") && err.contains("`judge` table"),
        "{err}"
    );
}
