//! TokenEnv: statuses for every way an episode can end, history, its window and rendering, system
//! prompts, replies an env may not send.

mod common;

use std::time::Duration;

use common::{Scripted, renderer, rollout};
use sluice_core::{Message, RolloutStatus};
use sluice_env::{
    BoxFuture, ByteRenderer, EnvError, EnvInit, EnvStep, MessageEnv, Next, TokenEnv,
    TokenEnvLimits, TurnFinish, run_episode,
};

/// Replies "again" until the assistant says "stop"; misbehaves on demand.
struct Echo {
    mode: &'static str,
}

impl MessageEnv for Echo {
    fn init(&mut self) -> BoxFuture<'_, Result<EnvInit, EnvError>> {
        let mode = self.mode;
        Box::pin(async move {
            match mode {
                "init_panic" => panic!("init exploded"),
                "init_hang" => {
                    tokio::time::sleep(Duration::from_secs(3600)).await;
                    unreachable!()
                }
                "huge" => Ok(EnvInit {
                    messages: vec![Message::user("x".repeat(500))],
                    tools: vec![],
                }),
                "with_system" => Ok(EnvInit {
                    messages: vec![Message::system("env system"), Message::user("go")],
                    tools: vec![],
                }),
                _ => Ok(EnvInit {
                    messages: vec![Message::user("go")],
                    tools: vec![],
                }),
            }
        })
    }

    fn step(&mut self, assistant: Message) -> BoxFuture<'_, Result<EnvStep, EnvError>> {
        let mode = self.mode;
        Box::pin(async move {
            let text = assistant.content.unwrap_or_default();
            match (mode, text.as_str()) {
                ("step_panic", _) => panic!("step exploded"),
                ("step_hang", _) => {
                    tokio::time::sleep(Duration::from_secs(3600)).await;
                    unreachable!()
                }
                ("step_error", _) => Err(EnvError::Failed("sandbox crashed".into())),
                ("grow", _) => Ok(EnvStep::reply(vec![Message::user("y".repeat(200))])),
                ("speaks_for_policy", _) => Ok(EnvStep::reply(vec![
                    Message::user("fine"),
                    Message::assistant("and I answer for you"),
                ])),
                (_, "stop") => Ok(EnvStep::done().with_reward(1.0).with_situation("end")),
                _ => Ok(EnvStep::reply(vec![Message::user("again")])
                    .with_reward(0.25)
                    .with_situation("mid")),
            }
        })
    }
}

fn limits() -> TokenEnvLimits {
    TokenEnvLimits {
        max_prompt_tokens: 400,
        max_turns: 3,
        call_timeout: Duration::from_secs(5),
        max_history_turns: None,
    }
}

async fn run(mode: &'static str, replies: &[&str]) -> (sluice_core::Rollout, TokenEnv) {
    let mut env = TokenEnv::new(
        Box::new(Echo { mode }),
        renderer(),
        limits(),
        Some("sys".into()),
    );
    let mut r = rollout(0);
    run_episode(&mut env, &mut Scripted::new(replies), &mut r)
        .await
        .unwrap();
    (r, env)
}

#[tokio::test]
async fn completed_episode_records_turns_rewards_and_situations() {
    let (r, env) = run("ok", &["hello", "stop"]).await;
    assert_eq!(r.status, RolloutStatus::Completed);
    assert_eq!(r.turns.len(), 2);
    assert_eq!(r.turns[0].env_reward, Some(0.25));
    assert_eq!(r.turns[0].situation.as_deref(), Some("mid"));
    assert_eq!(r.turns[0].env_messages, vec![Message::user("again")]);
    assert_eq!(r.turns[1].env_reward, Some(1.0));
    assert_eq!(
        r.turns[1]
            .completion_message
            .as_ref()
            .unwrap()
            .content
            .as_deref(),
        Some("stop")
    );
    // The second prompt is the full history, rendered, with the system prompt first.
    let second = &r.turns[1].prompt_messages;
    assert_eq!(second[0], Message::system("sys"));
    assert_eq!(second.len(), 4, "system, user, assistant, env reply");
    assert_eq!(
        r.turns[1].prompt_token_ids,
        ByteRenderer::encode(&ByteRenderer::render_text(second, &[]))
    );
    assert_eq!(env.history().len(), 5);
    for t in &r.turns {
        t.check().unwrap();
    }
}

#[tokio::test]
async fn env_system_message_wins_over_task_prompt() {
    let (r, _) = run("with_system", &["stop"]).await;
    let msgs = &r.turns[0].prompt_messages;
    assert_eq!(msgs[0], Message::system("env system"));
    assert_eq!(
        msgs.iter()
            .filter(|m| m.role == sluice_core::Role::System)
            .count(),
        1
    );
}

#[tokio::test]
async fn limits_set_the_status() {
    let (r, _) = run("ok", &["a", "b", "c", "d"]).await;
    assert_eq!(r.status, RolloutStatus::Truncated, "max_turns = 3");
    assert_eq!(r.turns.len(), 3);

    let (r, _) = run("ok", &["a", "LEN:partial ans"]).await;
    assert_eq!(r.status, RolloutStatus::Truncated, "finish reason length");
    assert_eq!(
        r.turns[1]
            .completion_message
            .as_ref()
            .unwrap()
            .content
            .as_deref(),
        Some("partial ans"),
        "a cut turn keeps what it parsed"
    );
    assert!(r.turns[1].env_messages.is_empty(), "the env is not stepped");

    let (r, _) = run("huge", &[]).await;
    assert_eq!(r.status, RolloutStatus::PromptTooLong);
    assert!(r.turns.is_empty());

    let (r, _) = run("grow", &["a", "b"]).await;
    assert_eq!(
        r.status,
        RolloutStatus::PromptTooLong,
        "the history outgrew the limit"
    );
    assert_eq!(r.turns.len(), 2);
}

#[tokio::test]
async fn a_history_window_keeps_the_opening_and_the_last_turns() {
    // 200 characters a reply: the whole history outgrows 400 tokens at the third prompt (above);
    // keeping one turn, every prompt fits and the episode runs to max_turns.
    let mut env = TokenEnv::new(
        Box::new(Echo { mode: "grow" }),
        renderer(),
        TokenEnvLimits {
            max_history_turns: Some(1),
            ..limits()
        },
        Some("sys".into()),
    );
    let mut r = rollout(0);
    run_episode(&mut env, &mut Scripted::new(&["a", "b", "c"]), &mut r)
        .await
        .unwrap();
    assert_eq!(
        r.status,
        RolloutStatus::Truncated,
        "max_turns, not PromptTooLong"
    );
    assert_eq!(r.turns.len(), 3);
    let third = &r.turns[2].prompt_messages;
    let reply = Message::user("y".repeat(200));
    assert_eq!(
        third,
        &vec![
            Message::system("sys"),
            Message::user("go"),
            Message::assistant("b"),
            reply.clone()
        ],
        "opening messages, then only the last turn"
    );
    assert_eq!(
        r.turns[2].prompt_token_ids,
        ByteRenderer::encode(&ByteRenderer::render_text(third, &[])),
        "the prompt is rendered from the window"
    );
    assert_eq!(
        env.history().len(),
        2 + 3 * 2,
        "the history keeps every turn"
    );
}

#[tokio::test]
async fn an_env_reply_with_an_assistant_message_fails_the_episode() {
    let (r, env) = run("speaks_for_policy", &["a", "b"]).await;
    assert_eq!(r.status, RolloutStatus::Error("env_protocol".into()));
    assert_eq!(
        r.turns.len(),
        1,
        "the generated turn is kept, no second prompt"
    );
    assert!(
        env.history()
            .iter()
            .all(|m| m.content.as_deref() != Some("and I answer for you")),
        "the forged message never reaches a prompt"
    );
}

#[tokio::test]
async fn panics_errors_and_hangs_fail_only_the_rollout() {
    let (r, _) = run("init_panic", &[]).await;
    assert_eq!(r.status, RolloutStatus::Error("env_panic".into()));
    let (r, _) = run("step_panic", &["a"]).await;
    assert_eq!(r.status, RolloutStatus::Error("env_panic".into()));
    assert_eq!(r.turns.len(), 1, "the generated turn is kept");
    let (r, _) = run("step_error", &["a"]).await;
    assert_eq!(r.status, RolloutStatus::Error("env_failed".into()));
}

#[tokio::test(start_paused = true)]
async fn hanging_calls_time_out() {
    let (r, _) = run("init_hang", &[]).await;
    assert_eq!(r.status, RolloutStatus::Timeout);
    let (r, _) = run("step_hang", &["a"]).await;
    assert_eq!(r.status, RolloutStatus::Timeout);
}

#[tokio::test]
async fn misuse_is_an_error_not_a_panic() {
    let mut env = TokenEnv::new(Box::new(Echo { mode: "ok" }), renderer(), limits(), None);
    let out = env.step(&ByteRenderer::encode("x"), TurnFinish::Stop).await;
    assert_eq!(
        out.next,
        Next::Done(RolloutStatus::Error("env_protocol".into()))
    );
}

#[tokio::test]
async fn unparsable_completion_reaches_the_env_as_text() {
    let mut env = TokenEnv::new(Box::new(Echo { mode: "ok" }), renderer(), limits(), None);
    assert!(matches!(env.start().await, Next::Generate(_)));
    let out = env
        .step(
            &ByteRenderer::encode("<tool_call>{bad</tool_call>"),
            TurnFinish::Stop,
        )
        .await;
    assert!(out.parse_error.is_some());
    assert_eq!(
        out.assistant.content.as_deref(),
        Some("<tool_call>{bad</tool_call>")
    );
    assert_eq!(env.parse_errors(), 1);
    assert!(matches!(out.next, Next::Generate(_)));
}

/// A renderer that counts the characters it is asked to render (the byte renderer underneath).
struct Counting(std::sync::atomic::AtomicUsize);

impl sluice_env::Renderer for Counting {
    fn render_prompt(
        &self,
        messages: &[Message],
        tools: &[sluice_core::ToolSpec],
    ) -> Result<Vec<u32>, EnvError> {
        let text = ByteRenderer::render_text(messages, tools);
        self.0
            .fetch_add(text.len(), std::sync::atomic::Ordering::Relaxed);
        ByteRenderer.render_prompt(messages, tools)
    }

    fn parse_completion(
        &self,
        completion: &[u32],
    ) -> Result<Message, sluice_env::renderer::ParseError> {
        ByteRenderer.parse_completion(completion)
    }
}

/// A dataset row far longer than any prompt may be (H4: a 100 MB line once aborted the run while
/// it was rendered and tokenized) ends its episode as `PromptTooLong` before it is rendered.
#[tokio::test]
async fn an_overlong_prompt_is_refused_before_it_is_rendered() {
    struct Huge;
    impl MessageEnv for Huge {
        fn init(&mut self) -> BoxFuture<'_, Result<EnvInit, EnvError>> {
            Box::pin(async {
                Ok(EnvInit {
                    messages: vec![Message::user("é".repeat(8 << 20))],
                    tools: vec![],
                })
            })
        }
        fn step(&mut self, _: Message) -> BoxFuture<'_, Result<EnvStep, EnvError>> {
            Box::pin(async { Ok(EnvStep::done()) })
        }
    }
    let counting = std::sync::Arc::new(Counting(0.into()));
    let mut env = TokenEnv::new(Box::new(Huge), counting.clone(), limits(), None);
    assert_eq!(env.start().await, Next::Done(RolloutStatus::PromptTooLong));
    assert_eq!(
        counting.0.load(std::sync::atomic::Ordering::Relaxed),
        0,
        "nothing was rendered"
    );

    // At the bound (32 characters per allowed token) the prompt is rendered and judged in
    // tokens, as before.
    struct AtBound;
    impl MessageEnv for AtBound {
        fn init(&mut self) -> BoxFuture<'_, Result<EnvInit, EnvError>> {
            Box::pin(async {
                Ok(EnvInit {
                    messages: vec![Message::user("x".repeat(400 * 32))],
                    tools: vec![],
                })
            })
        }
        fn step(&mut self, _: Message) -> BoxFuture<'_, Result<EnvStep, EnvError>> {
            Box::pin(async { Ok(EnvStep::done()) })
        }
    }
    let mut env = TokenEnv::new(Box::new(AtBound), counting.clone(), limits(), None);
    assert_eq!(env.start().await, Next::Done(RolloutStatus::PromptTooLong));
    assert!(counting.0.load(std::sync::atomic::Ordering::Relaxed) > 400 * 32);
    assert_eq!(sluice_env::MAX_PROMPT_CHARS_PER_TOKEN, 32);
}
