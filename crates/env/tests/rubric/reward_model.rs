//! The `reward_model` reward function over a scorer the test supplies (part of the `rubric`
//! test binary; a real model scores in the `checkpoint` tests and through the binary in
//! `cli_run`): the conversation it is given, the logistic option, failures, and the refusals
//! of a rubric that lacks its table or its loader.

use std::sync::Mutex;

use serde_json::json;
use sluice_core::{Message, Role};
use sluice_data::config::{DomainRubric, RewardModelConfig};
use sluice_env::configured::rubric_with_answers;
use sluice_env::reward_fns::AnswerOptions;
use sluice_env::reward_model::{ConversationScorer, RewardModelLoader};

use super::*;

/// Scores a conversation by its reply's length, or fails on an empty reply; keeps what it saw.
#[derive(Default)]
struct Lengths {
    seen: Mutex<Vec<Vec<Message>>>,
}

impl ConversationScorer for Lengths {
    fn score(&self, messages: &[Message]) -> Result<f64, String> {
        self.seen.lock().unwrap().push(messages.to_vec());
        let reply = messages
            .last()
            .and_then(|m| m.content.clone())
            .unwrap_or_default();
        if reply.is_empty() {
            return Err("nothing to score".into());
        }
        Ok(reply.len() as f64 - 10.0)
    }
}

fn config(sigmoid: bool) -> RewardModelConfig {
    RewardModelConfig {
        path: "models/rm".into(),
        device: sluice_core::config::Device::Cpu,
        max_tokens: 8192,
        sigmoid,
    }
}

fn spec(model: Option<RewardModelConfig>) -> DomainRubric {
    DomainRubric {
        weights: [("reward_model".to_owned(), 2.0), ("format".to_owned(), 1.0)].into(),
        truncation_reward: None,
        error_reward: Some(-1.0),
        timeout: None,
        regex: None,
        judge: None,
        reward_model: model,
    }
}

/// A rubric over `scorer`, whose loader records the configs it was asked for.
fn rubric(
    model: Option<RewardModelConfig>,
    scorer: Arc<Lengths>,
    asked: Arc<Mutex<Vec<RewardModelConfig>>>,
) -> Result<Rubric, String> {
    let task = sluice_env::TaskRegistry::builtin()
        .get("word_problems")
        .unwrap();
    let loader: Box<RewardModelLoader> = Box::new(move |c: &RewardModelConfig| {
        asked.lock().unwrap().push(c.clone());
        Ok(scorer.clone() as Arc<dyn ConversationScorer>)
    });
    rubric_with_answers(
        &task,
        &spec(model),
        AnswerOptions::default(),
        Some(&*loader),
    )
}

/// A finished two-turn rollout: the second turn's prompt holds the whole history.
fn two_turns(reply: &str) -> sluice_core::Rollout {
    let mut r = finished(reply, RolloutStatus::Completed);
    let history = vec![
        Message::system("Be brief."),
        Message::user("What is 6 times 7?"),
        Message::assistant("Let me use the calculator."),
        Message::text(Role::Tool, "42"),
    ];
    let mut first = r.turns[0].clone();
    first.prompt_messages = history[..2].to_vec();
    first.completion_message = Some(history[2].clone());
    r.turns[0].prompt_messages = history;
    r.turns.insert(0, first);
    r
}

#[tokio::test]
async fn the_reward_model_scores_the_whole_conversation_ending_with_the_reply() {
    let scorer = Arc::new(Lengths::default());
    let asked = Arc::new(Mutex::new(Vec::new()));
    let rubric = rubric(Some(config(false)), scorer.clone(), asked.clone()).unwrap();
    assert_eq!(asked.lock().unwrap().as_slice(), &[config(false)]);
    let reply = "It is 42. #### 42";
    let score = rubric.score(&sample(json!({})), &two_turns(reply)).await;
    assert_eq!(score.failed, None, "{score:?}");
    let expected = reply.len() as f64 - 10.0;
    assert_eq!(score.components["reward_model"], expected);
    // Weights are normalized: 2/3 of the model's score, 1/3 of `format` (1: the reply marks it).
    assert!(
        (score.reward - (2.0 * expected + 1.0) / 3.0).abs() < 1e-12,
        "{score:?}"
    );
    let seen = scorer.seen.lock().unwrap();
    let contents: Vec<(Role, &str)> = seen[0]
        .iter()
        .map(|m| (m.role, m.content.as_deref().unwrap_or("")))
        .collect();
    assert_eq!(
        contents,
        [
            (Role::System, "Be brief."),
            (Role::User, "What is 6 times 7?"),
            (Role::Assistant, "Let me use the calculator."),
            (Role::Tool, "42"),
            (Role::Assistant, reply),
        ]
    );
}

#[tokio::test]
async fn sigmoid_maps_the_score_and_failures_fail_the_rollout() {
    let scorer = Arc::new(Lengths::default());
    let asked = Arc::new(Mutex::new(Vec::new()));
    let rubric = rubric(Some(config(true)), scorer, asked).unwrap();
    let s = sample(json!({}));
    let score = rubric.score(&s, &two_turns("#### 1")).await;
    let logistic = 1.0 / (1.0 + (4.0f64).exp()); // the score 6 − 10 = −4
    assert!(
        (score.components["reward_model"] - logistic).abs() < 1e-12,
        "{score:?}"
    );
    // The scorer refuses an empty reply: the rollout's scoring fails with the error reward.
    let score = rubric.score(&s, &two_turns("")).await;
    assert!(
        matches!(score.failed, Some(RolloutStatus::Error(_))),
        "{score:?}"
    );
    assert_eq!(score.reward, -1.0);
}

#[test]
fn a_rubric_without_its_table_or_its_loader_is_refused() {
    let scorer = Arc::new(Lengths::default());
    let asked = Arc::new(Mutex::new(Vec::new()));
    let e = rubric(None, scorer, asked).err().unwrap();
    assert!(
        e.contains("weights.reward_model") && e.contains("`reward_model` table"),
        "{e}"
    );
    let task = sluice_env::TaskRegistry::builtin()
        .get("word_problems")
        .unwrap();
    let e = rubric_with_answers(
        &task,
        &spec(Some(config(false))),
        AnswerOptions::default(),
        None,
    )
    .err()
    .unwrap();
    assert!(e.starts_with("reward_model:"), "{e}");
    let failing: Box<RewardModelLoader> =
        Box::new(|_: &RewardModelConfig| Err("no such dir".into()));
    let e = rubric_with_answers(
        &task,
        &spec(Some(config(false))),
        AnswerOptions::default(),
        Some(&*failing),
    )
    .err()
    .unwrap();
    assert_eq!(e, "reward_model.path: no such dir");
}
