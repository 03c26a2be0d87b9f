//! [`TaskEnv`]: the registered tasks of `sluice-env` as the pipeline's [`RolloutEnv`]. Each
//! rollout gets a session (a [`sluice_env::TokenEnv`] in [`EnvSessions`]); its first prompt is
//! rendered with the model's chat template, each completion is parsed and stepped, and the
//! finished episode is scored with the task's rubric.
//!
//! Which task serves a sample: `[data.domain_options.<domain>] task` when set, else the name of
//! the sample's dataset without its split (`arithmetic@train` → `arithmetic`).
//!
//! Sessions live in memory. A rollout whose session is gone (the node restarted and resumed it
//! from the replay store) gets a fresh one replayed through its earlier turns' completions, which
//! restores the history of the deterministic built-in envs.

use std::collections::BTreeMap;
use std::sync::Arc;

use sluice_core::{DataSample, Rollout, RolloutGroup, RolloutId, RolloutStatus};
use sluice_env::token_env::TurnFinish;
use sluice_env::{EnvSessions, Next, TaskRegistry, TurnOutcome};

use sluice_actors::env_worker::{BoxFuture, EnvReply, RolloutEnv, TurnNote};

/// Tasks as a rollout environment.
pub struct TaskEnv {
    registry: Arc<TaskRegistry>,
    sessions: EnvSessions,
    domain_tasks: BTreeMap<String, String>,
}

impl std::fmt::Debug for TaskEnv {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TaskEnv")
            .field("sessions", &self.sessions)
            .field("domain_tasks", &self.domain_tasks)
            .finish_non_exhaustive()
    }
}

impl TaskEnv {
    /// Sessions over `registry`'s tasks; `domain_tasks` maps domains to task names.
    pub fn new(
        registry: Arc<TaskRegistry>,
        sessions: EnvSessions,
        domain_tasks: BTreeMap<String, String>,
    ) -> Self {
        Self {
            registry,
            sessions,
            domain_tasks,
        }
    }

    /// The cap on open sessions now.
    pub fn session_cap(&self) -> usize {
        self.sessions.max_sessions()
    }

    /// The task that serves `sample`.
    pub fn task_name<'s>(&'s self, sample: &'s DataSample) -> &'s str {
        self.domain_tasks
            .get(&sample.domain)
            .map_or_else(|| sample.dataset_name(), String::as_str)
    }

    /// Scores a finished episode: the rubric (with the task's truncation/error overrides).
    async fn finish(
        &self,
        sample: &DataSample,
        rollout: &Rollout,
        outcome: Option<&TurnOutcome>,
        status: RolloutStatus,
    ) -> EnvReply {
        let task = match self.registry.get(self.task_name(sample)) {
            Ok(t) => t,
            Err(e) => {
                return EnvReply::Failed {
                    kind: e.kind().to_owned(),
                };
            }
        };
        let mut scored = rollout.clone();
        if let (Some(o), Some(turn)) = (outcome, scored.turns.last_mut()) {
            o.apply_to(turn);
            scored.reward_components.extend(o.env_components.clone());
        }
        scored.status = status;
        if task.rubric().has_group_fns() {
            // The whole rubric runs once the group settles (`score_group`); the env's named
            // components ride along until then.
            return EnvReply::Done {
                reward: 0.0,
                status: scored.status,
                components: scored.reward_components,
            };
        }
        let score = task.rubric().score(sample, &scored).await;
        EnvReply::Done {
            reward: score.reward,
            status: score.failed.unwrap_or(scored.status),
            components: score.components,
        }
    }

    /// Reopens rollout `id`'s session by replaying its earlier turns (all but the last).
    async fn reopen(&self, sample: &DataSample, rollout: &Rollout) -> Result<(), RolloutStatus> {
        let task = self.task_name(sample);
        if let Next::Done(status) = self.sessions.start(rollout.id, sample, task).await {
            return Err(status);
        }
        let earlier = rollout.turns.len().saturating_sub(1);
        for turn in &rollout.turns[..earlier] {
            let o = self
                .sessions
                .step(rollout.id, &turn.completion_token_ids, TurnFinish::Stop)
                .await;
            if let Next::Done(status) = o.next {
                return Err(status);
            }
        }
        Ok(())
    }
}

fn note(o: &TurnOutcome) -> TurnNote {
    TurnNote {
        completion_message: Some(o.assistant.clone()),
        env_messages: o.env_messages.clone(),
        env_reward: o.env_reward,
        situation: o.situation.clone(),
    }
}

impl RolloutEnv for TaskEnv {
    fn start<'a>(&'a self, sample: &'a DataSample, id: RolloutId) -> BoxFuture<'a, EnvReply> {
        Box::pin(async move {
            // A regenerated rollout starts over: close whatever its earlier attempt left open.
            self.sessions.abandon(id).await;
            match self
                .sessions
                .start(id, sample, self.task_name(sample))
                .await
            {
                Next::Generate(p) => EnvReply::Continue {
                    next_prompt: p.prompt_token_ids,
                },
                Next::Done(status) => self.finish(sample, &Rollout::new(id), None, status).await,
            }
        })
    }

    fn step<'a>(
        &'a self,
        sample: &'a DataSample,
        rollout: &'a Rollout,
        truncated: bool,
    ) -> BoxFuture<'a, (EnvReply, TurnNote)> {
        Box::pin(async move {
            let Some(last) = rollout.turns.last() else {
                return (
                    EnvReply::Failed {
                        kind: "env_protocol".into(),
                    },
                    TurnNote::default(),
                );
            };
            if !self.sessions.contains(rollout.id)
                && let Err(status) = self.reopen(sample, rollout).await
            {
                return (
                    self.finish(sample, rollout, None, status).await,
                    TurnNote::default(),
                );
            }
            let finish = if truncated {
                TurnFinish::Length
            } else {
                TurnFinish::Stop
            };
            let outcome = self
                .sessions
                .step(rollout.id, &last.completion_token_ids, finish)
                .await;
            let step = match &outcome.next {
                Next::Generate(p) => EnvReply::Continue {
                    next_prompt: p.prompt_token_ids.clone(),
                },
                Next::Done(status) => {
                    self.finish(sample, rollout, Some(&outcome), status.clone())
                        .await
                }
            };
            (step, note(&outcome))
        })
    }

    fn abandon(&self, id: RolloutId) -> BoxFuture<'_, ()> {
        Box::pin(self.sessions.abandon(id))
    }

    fn scores_groups(&self) -> bool {
        self.registry
            .names()
            .iter()
            .filter_map(|n| self.registry.get(n).ok())
            .any(|t| t.rubric().has_group_fns())
    }

    /// Groups of tasks with group reward functions get their whole rubric here; the others
    /// were scored rollout by rollout and pass unchanged.
    fn score_group<'a>(
        &'a self,
        sample: &'a DataSample,
        mut group: RolloutGroup,
    ) -> BoxFuture<'a, RolloutGroup> {
        Box::pin(async move {
            if let Ok(task) = self.registry.get(self.task_name(sample))
                && task.rubric().has_group_fns()
            {
                task.score_group(&mut group).await;
            }
            group
        })
    }

    fn set_session_cap(&self, sessions: usize) {
        self.sessions.set_max_sessions(sessions);
    }
}
