//! Multi-turn group assembly: starting a group's rollouts, submitting each turn to the engine,
//! taking completions and env steps back, and handing a settled group to the replay store
//! (with its reward statistics).

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Instant;

use sluice_core::metrics as m;
use sluice_core::{DataSample, GroupId, RolloutGroup, RolloutStatus, RolloutTurn};
use sluice_engine::{FinishReason, GenerateRequest, TokenOutput};
use sluice_replay::GroupSummary;

use super::{ControllerState, GroupWork, Waiting};
use crate::env_worker::{EnvReply, EnvResult};

impl ControllerState {
    /// Submits every rollout of `group` that still has to generate.
    pub(super) fn start(&mut self, group: RolloutGroup, sample: Arc<DataSample>) {
        let id = group.id;
        let n = group.rollouts.len();
        let mut w = GroupWork {
            group,
            sample,
            waiting: HashMap::new(),
            started: Instant::now(),
            scoring: false,
        };
        for i in 0..n {
            let r = &w.group.rollouts[i];
            if matches!(r.status, RolloutStatus::Ongoing | RolloutStatus::Aborted) {
                if r.turns.is_empty() {
                    if let Some(p) = &self.peers {
                        w.waiting.insert(i as u32, Waiting::Env);
                        p.env.start(Arc::clone(&w.sample), r.id);
                        self.counters.sent(1);
                    }
                } else {
                    self.submit(&mut w, i);
                }
            }
        }
        self.work.insert(id, w);
        self.settle(id);
    }

    pub(super) fn submit(&mut self, w: &mut GroupWork, i: usize) {
        let Some(peers) = &self.peers else { return };
        let r = &mut w.group.rollouts[i];
        r.status = RolloutStatus::Ongoing;
        let turn_index = r.turns.len().saturating_sub(1) as u32;
        let Some(turn) = r.turns.last() else { return };
        let attempt = self.attempts.entry(r.id).or_insert(r.abort_count);
        let id = r.id.request(turn_index, *attempt);
        *attempt += 1;
        let resume = (turn.completion_tokens() > 0).then(|| TokenOutput {
            token_ids: turn.completion_token_ids.clone(),
            logprobs: turn.logprobs.clone(),
            versions: turn.token_versions.clone(),
        });
        let mut params = self.config.sampling.clone();
        if let Some(&tokens) = self.config.domain_turn_tokens.get(&w.sample.domain) {
            params.max_tokens = tokens;
        }
        let request = GenerateRequest {
            id,
            prompt_token_ids: turn.prompt_token_ids.clone(),
            resume,
            params,
            domain: Some(w.sample.domain.clone()),
        };
        w.waiting.insert(i as u32, Waiting::Engine(id));
        peers
            .engine
            .generate(request, self.served_by.get(&r.id).copied());
        self.counters.sent(1);
    }

    pub(super) fn on_completion(&mut self, c: sluice_engine::Completion, replica: u32) {
        let gid = c.id.rollout.group;
        let i = c.id.rollout.index;
        let Some(mut w) = self.work.remove(&gid) else {
            self.counters.dropped(1);
            return;
        };
        if !matches!(w.waiting.get(&i), Some(Waiting::Engine(id)) if *id == c.id) {
            self.counters.dropped(1);
            self.work.insert(gid, w);
            return;
        }
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
        match c.finish {
            FinishReason::Abort => {
                r.status = RolloutStatus::Aborted;
                r.abort_count += 1;
            }
            // A truncated turn still goes to the env: it ends the episode and scores it.
            FinishReason::Stop | FinishReason::Length => {
                w.waiting.insert(i, Waiting::Env);
                if let Some(p) = &self.peers {
                    let truncated = c.finish == FinishReason::Length;
                    p.env.step(Arc::clone(&w.sample), r.clone(), truncated);
                    self.counters.sent(1);
                }
            }
            FinishReason::Error(kind) => r.status = RolloutStatus::Error(kind),
        }
        self.work.insert(gid, w);
        self.settle(gid);
    }

    pub(super) fn on_env(&mut self, result: EnvResult) {
        let gid = result.rollout.group;
        if let EnvReply::Scored(scored) = result.step {
            return self.on_scored(*scored);
        }
        let i = result.rollout.index;
        // A result for a group no longer here, or a rollout not waiting on the env, is stale.
        let Some(mut w) = self.work.remove(&gid) else {
            self.counters.dropped(1);
            return;
        };
        if !matches!(w.waiting.remove(&i), Some(Waiting::Env)) {
            self.counters.dropped(1);
            self.work.insert(gid, w);
            return;
        }
        let r = &mut w.group.rollouts[i as usize];
        if let (Some(note), Some(turn)) = (result.note, r.turns.last_mut()) {
            turn.completion_message = note.completion_message;
            turn.env_messages = note.env_messages;
            turn.env_reward = note.env_reward;
            turn.situation = note.situation;
        }
        match result.step {
            EnvReply::Continue { next_prompt } => {
                r.turns.push(RolloutTurn::new(next_prompt));
                self.submit(&mut w, i as usize);
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
        self.work.insert(gid, w);
        self.settle(gid);
    }

    /// A group scored as a whole comes back: it is stored like any settled group.
    fn on_scored(&mut self, scored: RolloutGroup) {
        let gid = scored.id;
        match self.work.get_mut(&gid) {
            Some(w) if w.scoring => {
                w.group = scored;
                self.settle(gid);
            }
            _ => self.counters.dropped(1),
        }
    }

    /// A group with nothing outstanding goes to the replay store: aborted if any rollout was
    /// interrupted, finished otherwise.
    pub(super) fn settle(&mut self, gid: GroupId) {
        let Some(w) = self.work.get_mut(&gid) else {
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
        // A finished group whose env scores groups goes there first (once); it settles again
        // when it comes back scored.
        if !aborted
            && !w.scoring
            && let Some(peers) = &self.peers
            && peers.env.scores_groups()
        {
            w.scoring = true;
            peers
                .env
                .score_group(Arc::clone(&w.sample), w.group.clone());
            self.counters.sent(1);
            return;
        }
        let Some(w) = self.work.remove(&gid) else {
            return;
        };
        let group = w.group;
        if !aborted {
            self.record_outcome(&group, &w.sample.domain);
            self.pace.record_group(w.started.elapsed().as_secs_f64());
        }
        let Some(peers) = &self.peers else { return };
        self.storing.insert(gid);
        if aborted {
            let max_aborts = group
                .rollouts
                .iter()
                .map(|r| r.abort_count)
                .max()
                .unwrap_or(0);
            self.scheduler.group_aborted(gid, max_aborts);
            peers.replay.abort(group);
            self.counters.sent(1);
        } else {
            for r in &group.rollouts {
                let label = r.status.as_label();
                metrics::counter!(m::ROLLOUT_FINISHED_ROLLOUTS, "status" => label).increment(1);
                *self
                    .status
                    .finished_by_status
                    .entry(label.to_owned())
                    .or_insert(0) += 1;
                self.attempts.remove(&r.id);
                self.served_by.remove(&r.id);
            }
            self.ending.insert(gid, GroupSummary::of(&group));
            let eta = self.knobs.current().max_version_lag;
            peers.sampler.group_finished(&group, self.version, eta);
            peers.replay.finish(group, self.version, eta);
            self.counters.sent(1);
        }
    }

    /// Reward statistics of a finished group: per-domain mean, outcome EMA and balance.
    pub(super) fn record_outcome(&mut self, group: &RolloutGroup, domain: &str) {
        let n = group.rollouts.len();
        if n == 0 {
            return;
        }
        let sum: f64 = group.rollouts.iter().map(|r| r.reward).sum();
        self.status.finished_rollouts += n as u64;
        self.status.reward_sum += sum;
        metrics::gauge!(m::ROLLOUT_MEAN_REWARD, "domain" => domain.to_owned()).set(sum / n as f64);
        for (component, mean) in group.reward_component_means() {
            if self.component_series.admit(domain, &component) {
                metrics::gauge!(
                    m::ROLLOUT_REWARD_COMPONENT_MEAN_REWARD,
                    "domain" => domain.to_owned(),
                    "component" => component
                )
                .set(mean);
            }
        }
        self.outcomes.record_group(group);
        self.outcomes.publish_metrics();
    }
}
