//! Carrying out the group assembly's decisions ([`super::assembly`]): engine requests with the
//! run's sampling parameters, env calls with the group's sample, store commands, and the reward
//! statistics of a finished group.

use std::sync::Arc;
use std::time::Instant;

use sluice_core::metrics as m;
use sluice_core::{DataSample, RolloutGroup};
use sluice_engine::GenerateRequest;
use sluice_env::rollout_env::EnvReply;
use sluice_replay::{Bucket, GroupSummary};

use super::ControllerState;
use super::assembly::Action;
use crate::env_worker::EnvResult;
use crate::replay::ReplayNotice;

/// What the controller keeps with each assembling group.
pub(super) struct GroupMeta {
    sample: Arc<DataSample>,
    /// When the group started (admitted or resumed): its time to stored paces admission.
    started: Instant,
}

impl ControllerState {
    /// Starts (or resumes) `group`: its rollouts still to generate are submitted.
    pub(super) fn start(&mut self, group: RolloutGroup) {
        if self.peers.is_none() {
            return;
        }
        let now = Instant::now();
        let rollouts = group.rollouts.len();
        self.clocks
            .start(group.id, &group.sample.domain, rollouts, now);
        let meta = GroupMeta {
            sample: Arc::clone(&group.sample),
            started: now,
        };
        let actions = self.assembly.start(group, meta);
        self.apply(actions);
    }

    pub(super) fn on_completion(&mut self, c: sluice_engine::Completion, replica: u32) {
        let request = c.id;
        match self.assembly.on_completion(c, replica) {
            Some(actions) => {
                self.clocks.engine_done(request, Instant::now());
                self.apply(actions);
            }
            None => self.counters.dropped(1),
        }
    }

    pub(super) fn on_env(&mut self, result: EnvResult) {
        // A result for a group no longer here, or a rollout not waiting on the env, is stale.
        let (rollout, scored) = (result.rollout, matches!(result.step, EnvReply::Scored(_)));
        match self
            .assembly
            .on_env(result.rollout, result.step, result.note)
        {
            Some(actions) => {
                let now = Instant::now();
                if scored {
                    self.clocks.scoring_done(rollout.group, now);
                } else {
                    self.clocks.env_done(rollout, now);
                }
                self.apply(actions);
            }
            None => self.counters.dropped(1),
        }
    }

    /// What a replay notice ends: a group's clock when it is stored in a bucket other than
    /// aborted; a cleared or dropped group's clock, whose partials were generated for nothing,
    /// as were those a resumed group comes back without.
    pub(super) fn time_replay(&mut self, notice: &ReplayNotice) {
        let now = Instant::now();
        match notice {
            ReplayNotice::Stored { id, bucket, .. } if *bucket != Bucket::Aborted => {
                if let Some((domain, time)) = self.clocks.stored(*id, now) {
                    self.shape.record_time(&domain, time);
                }
            }
            ReplayNotice::Resumed {
                groups, dropped, ..
            } => {
                for group in groups {
                    let discarded = self.clocks.resumed(group);
                    self.shape.record_unfinished(&discarded);
                }
                for id in dropped {
                    if let Some(partials) = self.clocks.forget(*id) {
                        self.shape.record_unfinished(&partials);
                    }
                }
            }
            ReplayNotice::Cleared { ids, .. } => {
                for id in ids {
                    if let Some(partials) = self.clocks.forget(*id) {
                        self.shape.record_unfinished(&partials);
                    }
                }
            }
            _ => {}
        }
    }

    /// Carries out the assembly's actions, in order.
    fn apply(&mut self, actions: Vec<Action<GroupMeta>>) {
        for action in actions {
            self.apply_one(action);
        }
    }

    fn apply_one(&mut self, action: Action<GroupMeta>) {
        let Some(peers) = &self.peers else { return };
        match action {
            Action::Generate {
                request,
                prompt,
                resume,
                replica,
            } => {
                let Some(meta) = self.assembly.meta(request.rollout.group) else {
                    return;
                };
                let domain = &meta.sample.domain;
                let mut params = self.config.sampling.clone();
                params.max_tokens = self.config.turn_tokens(domain);
                self.clocks.engine_sent(request, Instant::now());
                let request = GenerateRequest {
                    id: request,
                    prompt_token_ids: prompt,
                    resume,
                    params,
                    domain: Some(domain.clone()),
                };
                peers.engine.generate(request, replica);
            }
            Action::EnvStart(rollout) => {
                let Some(meta) = self.assembly.meta(rollout.group) else {
                    return;
                };
                self.clocks.env_sent(rollout, Instant::now());
                peers.env.start(Arc::clone(&meta.sample), rollout);
            }
            Action::EnvStep { rollout, truncated } => {
                let Some(meta) = self.assembly.meta(rollout.id.group) else {
                    return;
                };
                self.clocks.env_sent(rollout.id, Instant::now());
                peers.env.step(Arc::clone(&meta.sample), rollout, truncated);
            }
            Action::ScoreGroup(group) => {
                let Some(meta) = self.assembly.meta(group.id) else {
                    return;
                };
                self.clocks.scoring_sent(group.id, Instant::now());
                peers.env.score_group(Arc::clone(&meta.sample), group);
            }
            Action::Aborted { group } => {
                self.clocks.aborted(&group);
                self.storing.insert(group.id);
                peers.replay.abort(group);
            }
            Action::Finished { group, meta } => return self.finished(group, &meta),
        }
        self.counters.sent(1);
    }

    /// A finished group: its rewards shaped, its statistics, then the sampler and the replay
    /// store.
    fn finished(&mut self, mut group: RolloutGroup, meta: &GroupMeta) {
        if let Some(overlong) = &self.config.overlong {
            let budget = self.config.turn_tokens(&meta.sample.domain);
            for r in &mut group.rollouts {
                overlong.apply(r, budget);
            }
        }
        self.record_outcome(&group, &meta.sample.domain);
        self.shape.record_group(&meta.sample.domain, &group);
        self.pace.record_group(meta.started.elapsed().as_secs_f64());
        let Some(peers) = &self.peers else { return };
        self.storing.insert(group.id);
        for r in &group.rollouts {
            let label = r.status.as_label();
            metrics::counter!(m::ROLLOUT_FINISHED_ROLLOUTS, "status" => label).increment(1);
            *self
                .status
                .finished_by_status
                .entry(label.to_owned())
                .or_insert(0) += 1;
        }
        self.ending.insert(group.id, GroupSummary::of(&group));
        let eta = self.knobs.current().max_version_lag;
        peers.sampler.group_finished(&group, self.version, eta);
        peers.replay.finish(group, self.version, eta);
        self.counters.sent(1);
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
