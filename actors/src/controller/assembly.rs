//! Group assembly as a pure state machine: it takes a group to start (admitted or resumed),
//! engine completions, env answers and scored groups, and returns what to do next — engine
//! requests, env calls and store commands — as [`Action`]s. No actor, no channel, no clock:
//! the controller carries the actions out, and `assembly/tests.rs` property-tests the rules over
//! random interleavings of results, aborts and resumes.
//!
//! It lives beside the controller rather than beside [`sluice_replay::RolloutScheduler`] because it
//! speaks the engine's and the env's result types ([`Completion`], [`EnvReply`]), which the
//! replay crate does not know.
//!
//! Rules kept here:
//! - a rollout waits on one thing at a time (an engine request or the env); a result for a group
//!   not assembling, or for a rollout waiting on something else (an old request id), is stale
//!   and changes nothing;
//! - every submission of a turn gets a fresh attempt number (resumes never reuse a request id),
//!   starting at the rollout's abort count for a group that comes back from the store;
//! - the replica that last served a rollout serves its next turn and its resume (prefix cache,
//!   DESIGN §4.2), across trips through the aborted bucket;
//! - a group with nothing outstanding settles: aborted when any rollout was interrupted, else
//!   scored as a whole first (once) when the env scores groups, then finished.

use std::collections::{BTreeMap, HashMap};

use sluice_core::{GroupId, Rollout, RolloutGroup, RolloutId, RolloutStatus, RolloutTurn};
use sluice_engine::{Completion, FinishReason, TokenOutput};
use sluice_env::rollout_env::{EnvReply, TurnNote};

/// What a rollout of an assembling group waits for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Waiting {
    Engine(sluice_core::RequestId),
    Env,
}

/// One group being assembled, with the caller's data `M` (its sample, its start time).
struct Work<M> {
    group: RolloutGroup,
    waiting: BTreeMap<u32, Waiting>,
    /// Sent to the env to be scored as a whole; settles again when it comes back.
    scoring: bool,
    meta: M,
}

/// What the controller does next.
#[derive(Debug)]
pub enum Action<M> {
    /// Submit a turn to the engine (`replica`: the one that last served the rollout).
    Generate {
        /// The request (rollout, turn, attempt).
        request: sluice_core::RequestId,
        /// The turn's full prompt.
        prompt: Vec<u32>,
        /// The tokens already generated for the turn (a resume), versions kept.
        resume: Option<TokenOutput>,
        /// The replica to prefer.
        replica: Option<u32>,
    },
    /// Ask the env for the rollout's first prompt.
    EnvStart(RolloutId),
    /// Ask the env to answer the rollout's last turn (`truncated`: it hit `max_tokens`).
    EnvStep {
        /// A copy of the rollout so far.
        rollout: Rollout,
        /// The completion hit `max_tokens`.
        truncated: bool,
    },
    /// Have the env score the settled group as a whole (a copy; the group stays here).
    ScoreGroup(RolloutGroup),
    /// Store the group as finished (it left the assembly).
    Finished {
        /// The group.
        group: RolloutGroup,
        /// The caller's data.
        meta: M,
    },
    /// Store the group as aborted, to resume later (it left the assembly; the caller's data is
    /// dropped, a resume brings its own).
    Aborted {
        /// The group (the store reads its abort counts: tail candidacy is the store's call).
        group: RolloutGroup,
    },
}

/// The groups being assembled and what outlives one trip through the assembly (see the module
/// docs).
pub struct Assembly<M> {
    groups: HashMap<GroupId, Work<M>>,
    /// The next attempt number of each unfinished rollout.
    attempts: HashMap<RolloutId, u32>,
    /// The replica that last served each unfinished rollout.
    served_by: HashMap<RolloutId, u32>,
    /// The env scores settled groups as a whole.
    scores_groups: bool,
}

impl<M> Default for Assembly<M> {
    fn default() -> Self {
        Self {
            groups: HashMap::new(),
            attempts: HashMap::new(),
            served_by: HashMap::new(),
            scores_groups: false,
        }
    }
}

impl<M> Assembly<M> {
    /// Whether settled groups go to the env to be scored as a whole first.
    pub fn set_scores_groups(&mut self, on: bool) {
        self.scores_groups = on;
    }

    /// Groups being assembled.
    pub fn len(&self) -> usize {
        self.groups.len()
    }

    /// No group is being assembled.
    #[cfg(test)]
    pub fn is_empty(&self) -> bool {
        self.groups.is_empty()
    }

    /// Rollouts whose attempt or replica is remembered (unfinished ones, here or in the store).
    #[cfg(test)]
    pub fn remembered_rollouts(&self) -> usize {
        self.attempts.len().max(self.served_by.len())
    }

    /// Forgets rollout `id`'s attempt and replica (its group will never run again).
    pub fn forget(&mut self, id: RolloutId) {
        self.attempts.remove(&id);
        self.served_by.remove(&id);
    }

    /// The caller's data of an assembling group.
    pub fn meta(&self, id: GroupId) -> Option<&M> {
        self.groups.get(&id).map(|w| &w.meta)
    }

    /// Starts (or resumes) `group`: every rollout still to generate is submitted, a rollout
    /// without turns asks the env for its first prompt. A group with nothing to do settles.
    pub fn start(&mut self, group: RolloutGroup, meta: M) -> Vec<Action<M>> {
        let _span = tracing::debug_span!("group_assembly", group = %group.id).entered();
        let id = group.id;
        let mut w = Work {
            group,
            waiting: BTreeMap::new(),
            scoring: false,
            meta,
        };
        let mut out = Vec::new();
        for i in 0..w.group.rollouts.len() {
            let r = &w.group.rollouts[i];
            if !matches!(r.status, RolloutStatus::Ongoing | RolloutStatus::Aborted) {
                continue;
            }
            if r.turns.is_empty() {
                w.waiting.insert(i as u32, Waiting::Env);
                out.push(Action::EnvStart(r.id));
            } else {
                out.extend(self.submit(&mut w, i));
            }
        }
        self.groups.insert(id, w);
        self.settle(id, &mut out);
        out
    }

    /// The next request of rollout `i`'s last turn.
    fn submit(&mut self, w: &mut Work<M>, i: usize) -> Option<Action<M>> {
        let r = &mut w.group.rollouts[i];
        r.status = RolloutStatus::Ongoing;
        let turn_index = r.turns.len().saturating_sub(1) as u32;
        let turn = r.turns.last()?;
        let attempt = self.attempts.entry(r.id).or_insert(r.abort_count);
        let request = r.id.request(turn_index, *attempt);
        *attempt += 1;
        let resume = (turn.completion_tokens() > 0).then(|| TokenOutput {
            token_ids: turn.completion_token_ids.clone(),
            logprobs: turn.logprobs.clone(),
            versions: turn.token_versions.clone(),
        });
        w.waiting.insert(i as u32, Waiting::Engine(request));
        Some(Action::Generate {
            request,
            prompt: turn.prompt_token_ids.clone(),
            resume,
            replica: self.served_by.get(&r.id).copied(),
        })
    }

    /// The engine answered a request served by `replica`. `None`: stale (changes nothing).
    pub fn on_completion(&mut self, c: Completion, replica: u32) -> Option<Vec<Action<M>>> {
        let gid = c.id.rollout.group;
        let i = c.id.rollout.index;
        let w = self.groups.get_mut(&gid)?;
        if w.waiting.get(&i) != Some(&Waiting::Engine(c.id)) {
            return None;
        }
        let _span = tracing::debug_span!("group_assembly", group = %gid).entered();
        w.waiting.remove(&i);
        let r = &mut w.group.rollouts[i as usize];
        self.served_by.insert(r.id, replica);
        if let Some(turn) = r.turns.last_mut()
            && c.output.len() >= turn.completion_tokens()
        {
            // The engine reports the whole completion (resumed tokens first, versions kept).
            turn.completion_token_ids = c.output.token_ids;
            turn.logprobs = c.output.logprobs;
            turn.token_versions = c.output.versions;
        }
        let mut out = Vec::new();
        match c.finish {
            FinishReason::Abort => {
                r.status = RolloutStatus::Aborted;
                r.abort_count += 1;
            }
            // A truncated turn still goes to the env: it ends the episode and scores it.
            FinishReason::Stop | FinishReason::Length => {
                w.waiting.insert(i, Waiting::Env);
                out.push(Action::EnvStep {
                    rollout: r.clone(),
                    truncated: c.finish == FinishReason::Length,
                });
            }
            FinishReason::Error(kind) => r.status = RolloutStatus::Error(kind),
        }
        self.settle(gid, &mut out);
        Some(out)
    }

    /// The env answered rollout `id` (`note`: what it learned about the turn it answered).
    /// `None`: stale (changes nothing).
    pub fn on_env(
        &mut self,
        id: RolloutId,
        reply: EnvReply,
        note: Option<TurnNote>,
    ) -> Option<Vec<Action<M>>> {
        if let EnvReply::Scored(scored) = reply {
            return self.on_scored(*scored);
        }
        let gid = id.group;
        let mut w = self.groups.remove(&gid)?;
        if w.waiting.get(&id.index) != Some(&Waiting::Env) {
            self.groups.insert(gid, w);
            return None;
        }
        let _span = tracing::debug_span!("group_assembly", group = %gid).entered();
        w.waiting.remove(&id.index);
        let i = id.index as usize;
        let r = &mut w.group.rollouts[i];
        if let (Some(note), Some(turn)) = (note, r.turns.last_mut()) {
            turn.completion_message = note.completion_message;
            turn.env_messages = note.env_messages;
            turn.env_reward = note.env_reward;
            turn.situation = note.situation;
        }
        let mut out = Vec::new();
        match reply {
            EnvReply::Continue { next_prompt } => {
                r.turns.push(RolloutTurn::new(next_prompt));
                out.extend(self.submit(&mut w, i));
            }
            EnvReply::Done {
                reward,
                status,
                components,
            } => {
                r.status = status;
                r.reward = reward;
                r.reward_components = components;
            }
            EnvReply::Failed { kind } => r.status = RolloutStatus::Error(kind),
            // Answered before the `match`.
            EnvReply::Scored(_) => {}
        }
        self.groups.insert(gid, w);
        self.settle(gid, &mut out);
        Some(out)
    }

    /// A group scored as a whole came back: it settles like any group.
    fn on_scored(&mut self, scored: RolloutGroup) -> Option<Vec<Action<M>>> {
        let gid = scored.id;
        let w = self.groups.get_mut(&gid).filter(|w| w.scoring)?;
        w.group = scored;
        let mut out = Vec::new();
        self.settle(gid, &mut out);
        Some(out)
    }

    /// A group with nothing outstanding leaves for the store (or for scoring first).
    fn settle(&mut self, gid: GroupId, out: &mut Vec<Action<M>>) {
        let Some(w) = self.groups.get_mut(&gid) else {
            return;
        };
        if !w.waiting.is_empty() {
            return;
        }
        let aborted = w
            .group
            .rollouts
            .iter()
            .any(|r| r.status == RolloutStatus::Aborted);
        if !aborted && !w.scoring && self.scores_groups {
            w.scoring = true;
            out.push(Action::ScoreGroup(w.group.clone()));
            return;
        }
        let Some(Work { group, meta, .. }) = self.groups.remove(&gid) else {
            return;
        };
        if aborted {
            out.push(Action::Aborted { group });
        } else {
            for r in &group.rollouts {
                self.attempts.remove(&r.id);
                self.served_by.remove(&r.id);
            }
            out.push(Action::Finished { group, meta });
        }
    }
}

#[cfg(test)]
mod tests;
