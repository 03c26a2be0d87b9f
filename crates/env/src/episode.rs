//! A minimal episode driver: start a [`TokenEnv`], generate each turn with a [`Generate`]
//! implementation, record turns into a [`Rollout`], close. The pipeline's rollout controller does
//! the same across actors (with aborts and resumes); this driver serves evaluation, tests and
//! library users who do not need the pipeline.

use sluice_core::{PolicyVersion, Rollout, RolloutTurn};

use crate::error::EnvError;
use crate::protocol::BoxFuture;
use crate::token_env::{Next, TokenEnv, TurnFinish};

/// One completion from an inference backend.
#[derive(Debug, Clone, PartialEq)]
pub struct Generated {
    /// Generated token ids.
    pub token_ids: Vec<u32>,
    /// Behaviour log-probability per token.
    pub logprobs: Vec<f32>,
    /// Policy version per token.
    pub versions: Vec<PolicyVersion>,
    /// Why generation stopped.
    pub finish: TurnFinish,
}

/// Something that completes prompts: an engine handle, a scripted policy in tests.
pub trait Generate: Send {
    /// Completes `prompt`. An error is an infrastructure failure, not a bad rollout.
    fn generate<'a>(&'a mut self, prompt: &'a [u32]) -> BoxFuture<'a, Result<Generated, EnvError>>;
}

/// Runs one episode into `rollout` (turns appended, status set). Env failures end the episode
/// with their status; a generation failure is returned as an error after closing the env.
pub async fn run_episode(
    env: &mut TokenEnv,
    generator: &mut dyn Generate,
    rollout: &mut Rollout,
) -> Result<(), EnvError> {
    let mut next = env.start().await;
    let result = loop {
        let prompt = match next {
            Next::Done(status) => {
                rollout.status = status;
                break Ok(());
            }
            Next::Generate(p) => p,
        };
        let generated = match generator.generate(&prompt.prompt_token_ids).await {
            Ok(g) => g,
            Err(e) => break Err(e),
        };
        let mut turn = RolloutTurn::new(prompt.prompt_token_ids);
        turn.prompt_messages = prompt.prompt_messages;
        if let Err(e) = turn.append_tokens(
            &generated.token_ids,
            &generated.logprobs,
            &generated.versions,
        ) {
            break Err(EnvError::Generate(e.to_string()));
        }
        let outcome = env.step(&generated.token_ids, generated.finish).await;
        outcome.apply_to(&mut turn);
        // The env's named components, summed over the episode so far, for the rubric.
        rollout
            .reward_components
            .extend(outcome.env_components.clone());
        rollout.turns.push(turn);
        next = outcome.next;
    };
    env.close().await;
    result
}
