//! A custom environment, reward function and task, played without the pipeline: a scripted
//! "policy" answers through the byte-level renderer, the task's rubric scores each episode.
//! Swap the scripted policy for an engine handle and the same task trains.
//!
//! ```text
//! cargo run --example custom_env
//! ```

use std::sync::Arc;

use sluice_core::{
    DataSample, GroupId, Message, NodeId, PolicyVersion, Rollout, RolloutStatus, RunId,
};
use sluice_env::{
    BoxFuture, ByteRenderer, EnvError, EnvInit, EnvStep, Generate, Generated, MessageEnv, RewardFn,
    Rubric, RubricConfig, ScoreInput, Task, TaskRegistry, TokenEnvLimits, TurnFinish, run_episode,
};

/// Asks for a palindrome; a wrong answer gets one retry.
struct Palindrome {
    tries: u32,
}

impl MessageEnv for Palindrome {
    fn init(&mut self) -> BoxFuture<'_, Result<EnvInit, EnvError>> {
        Box::pin(async {
            Ok(EnvInit {
                messages: vec![Message::user("Give me a palindrome.")],
                tools: vec![],
            })
        })
    }

    fn step(&mut self, reply: Message) -> BoxFuture<'_, Result<EnvStep, EnvError>> {
        Box::pin(async move {
            self.tries += 1;
            let ok = is_palindrome(reply.content.as_deref().unwrap_or_default());
            if ok || self.tries >= 2 {
                let reward = f64::from(u8::from(ok));
                return Ok(EnvStep::done().with_reward(reward).with_situation("final"));
            }
            Ok(
                EnvStep::reply(vec![Message::user("Not a palindrome, try again.")])
                    .with_situation("retry"),
            )
        })
    }
}

fn is_palindrome(text: &str) -> bool {
    let word = text.trim().to_lowercase();
    !word.is_empty() && word.chars().eq(word.chars().rev())
}

/// A reward function: prefer short answers (1 for one letter, falling toward 0).
fn brevity(input: &ScoreInput) -> f64 {
    input
        .final_text()
        .map_or(0.0, |t| 1.0 / t.trim().len().max(1) as f64)
}

/// Replies with fixed texts, one per turn.
struct Scripted(std::vec::IntoIter<&'static str>);

impl Generate for Scripted {
    fn generate<'a>(
        &'a mut self,
        _prompt: &'a [u32],
    ) -> BoxFuture<'a, Result<Generated, EnvError>> {
        let text = self.0.next().unwrap_or("");
        Box::pin(async move {
            let token_ids = ByteRenderer::encode(&format!("{text}{}", ByteRenderer::END));
            let n = token_ids.len();
            Ok(Generated {
                token_ids,
                logprobs: vec![0.0; n],
                versions: vec![PolicyVersion::INITIAL; n],
                finish: TurnFinish::Stop,
            })
        })
    }
}

fn main() -> anyhow::Result<()> {
    let rubric = Rubric::new(
        vec![
            RewardFn::env_reward(0.8),
            RewardFn::new("brevity", 0.2, brevity),
        ],
        RubricConfig::default(),
    )?;
    let make_env = |_s: &DataSample| -> Result<Box<dyn MessageEnv>, EnvError> {
        Ok(Box::new(Palindrome { tries: 0 }))
    };
    let mut registry = TaskRegistry::builtin();
    registry.register(
        Task::new("palindrome", make_env, rubric).with_system_prompt("Answer with one word."),
    )?;
    let task = registry.get("palindrome")?;

    let sample = DataSample {
        id: "0".into(),
        domain: "words".into(),
        dataset: "palindrome".into(),
        input: serde_json::json!({}),
        system_prompt: None,
    };
    let group = GroupId {
        run: RunId::from_name("example"),
        node: NodeId(0),
        counter: 0,
    };
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()?;
    for (i, script) in [vec!["level"], vec!["hello", "noon"], vec!["abc", "xyz"]]
        .into_iter()
        .enumerate()
    {
        let mut rollout = Rollout::new(group.rollout(i as u32));
        runtime.block_on(async {
            let mut env =
                task.token_env(&sample, Arc::new(ByteRenderer), TokenEnvLimits::default())?;
            run_episode(
                &mut env,
                &mut Scripted(script.clone().into_iter()),
                &mut rollout,
            )
            .await?;
            task.rubric()
                .score(&sample, &rollout)
                .await
                .apply_to(&mut rollout);
            anyhow::Ok(())
        })?;
        assert_eq!(rollout.status, RolloutStatus::Completed);
        println!(
            "{script:?}: {} turn(s), reward {:.3}, components {:?}",
            rollout.turns.len(),
            rollout.reward,
            rollout.reward_components
        );
    }
    Ok(())
}
