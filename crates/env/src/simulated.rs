//! The simulated task: every rollout starts from a prompt of `prompt_tokens` tokens, runs
//! `turns` model turns (the environment appends `env_reply_tokens` tokens between them) and ends
//! with a seeded random reward in {0, 1}, so groups carry non-zero advantages.

use std::collections::BTreeMap;

use sluice_core::rng::{SplitMix64, mix};
use sluice_core::{DataSample, Rollout, RolloutId, RolloutStatus};

use crate::BoxFuture;
use crate::rollout_env::{EnvReply, RolloutEnv, TurnNote};

/// What the environment says after a model turn.
#[derive(Debug, Clone, PartialEq)]
pub enum TaskStep {
    /// Another turn: the full next prompt (history + completion + env reply).
    Continue {
        /// Next prompt token ids.
        next_prompt: Vec<u32>,
    },
    /// The episode ended.
    Done {
        /// Final reward.
        reward: f64,
    },
}

/// See the module docs.
#[derive(Debug, Clone)]
pub struct SimTask {
    /// Prompt length of the first turn.
    pub prompt_tokens: u32,
    /// Tokens the environment appends per reply.
    pub env_reply_tokens: u32,
    /// Model turns per episode.
    pub turns: u32,
    /// Seed of prompts and rewards.
    pub seed: u64,
}

fn id_words(id: RolloutId) -> [u64; 4] {
    [
        id.group.run.0,
        u64::from(id.group.node.0),
        id.group.counter,
        u64::from(id.index),
    ]
}

impl SimTask {
    /// The first prompt of a rollout: the same for every rollout of a group (same sample).
    pub fn first_prompt(&self, id: RolloutId) -> Vec<u32> {
        let mut rng = SplitMix64::new(mix(&[self.seed, id.group.run.0, id.group.counter]));
        (0..self.prompt_tokens)
            .map(|_| (rng.next_u64() % 32_000) as u32)
            .collect()
    }

    /// The environment's answer to the rollout's last turn.
    pub fn step(&self, rollout: &Rollout) -> TaskStep {
        let done_turns = rollout.turns.len() as u32;
        let words = id_words(rollout.id);
        if done_turns < self.turns {
            let last = rollout.turns.last();
            let mut next: Vec<u32> = last.map(|t| t.prompt_token_ids.clone()).unwrap_or_default();
            if let Some(t) = last {
                next.extend_from_slice(&t.completion_token_ids);
            }
            let mut rng = SplitMix64::new(mix(&[
                self.seed,
                words[0],
                words[2],
                words[3],
                u64::from(done_turns),
            ]));
            next.extend((0..self.env_reply_tokens).map(|_| (rng.next_u64() % 32_000) as u32));
            TaskStep::Continue { next_prompt: next }
        } else {
            let mut rng = SplitMix64::new(mix(&[
                self.seed ^ 0x5eed,
                words[0],
                words[1],
                words[2],
                words[3],
            ]));
            TaskStep::Done {
                reward: if rng.next_f64() < 0.5 { 1.0 } else { 0.0 },
            }
        }
    }
}

impl RolloutEnv for SimTask {
    crate::no_env_state!(abandon, scores_groups, score_group, set_session_cap);

    fn start<'a>(&'a self, _sample: &'a DataSample, id: RolloutId) -> BoxFuture<'a, EnvReply> {
        let next_prompt = SimTask::first_prompt(self, id);
        Box::pin(async move { EnvReply::Continue { next_prompt } })
    }

    fn step<'a>(
        &'a self,
        _sample: &'a DataSample,
        rollout: &'a Rollout,
        truncated: bool,
    ) -> BoxFuture<'a, (EnvReply, TurnNote)> {
        let step = if truncated {
            EnvReply::Done {
                reward: 0.0,
                status: RolloutStatus::Truncated,
                components: BTreeMap::new(),
            }
        } else {
            match SimTask::step(self, rollout) {
                TaskStep::Continue { next_prompt } => EnvReply::Continue { next_prompt },
                TaskStep::Done { reward } => EnvReply::done(reward),
            }
        };
        Box::pin(async move { (step, TurnNote::default()) })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use sluice_core::{GroupId, NodeId, RolloutTurn, RunId};

    #[test]
    fn turns_then_a_seeded_reward() {
        let task = SimTask {
            prompt_tokens: 4,
            env_reply_tokens: 2,
            turns: 2,
            seed: 1,
        };
        let id = GroupId {
            run: RunId::from_name("t"),
            node: NodeId(0),
            counter: 3,
        }
        .rollout(1);
        let mut r = Rollout::new(id);
        let p = task.first_prompt(id);
        assert_eq!(p, task.first_prompt(id.group.rollout(0)));
        let mut t = RolloutTurn::new(p.clone());
        t.completion_token_ids = vec![9, 9, 9];
        r.turns.push(t);
        let TaskStep::Continue { next_prompt } = task.step(&r) else {
            panic!("two turns")
        };
        assert_eq!(next_prompt.len(), 4 + 3 + 2);
        assert_eq!(&next_prompt[..4], &p[..]);
        r.turns.push(RolloutTurn::new(next_prompt));
        assert_eq!(task.step(&r), task.step(&r.clone()), "rewards are seeded");
        assert!(matches!(task.step(&r), TaskStep::Done { .. }));
    }
}
