//! How long each group takes from admission to stored, and what its rollouts waited on: a
//! record per group the controller feeds with its engine requests, env calls and their answers,
//! with the time each happened (passed in, so tests need no clock).
//!
//! A group's clock starts when it is first started (admitted, or resumed without a clock: after
//! an expiry or a restart), runs through its trips to the aborted bucket, and stops when the
//! store holds it in any other bucket. Engine time is summed per request (submitted → answered,
//! whatever the answer), env time per call (first prompt, step; group scoring counts for every
//! rollout); both are reported as means per rollout, so engine + env ≤ the group's time, the
//! rest being waits: in the aborted bucket, for the store, for the group's slowest rollout.
//! The partials a group had at its last abort are kept: those it comes back without (regenerated
//! from the prompt) and those of a group that never finishes (cleared or dropped while aborted)
//! were generated and never trained, and count on the generated side of the length bias.

use std::collections::HashMap;
use std::time::Instant;

use sluice_core::{GroupId, RequestId, RolloutGroup, RolloutId};

use super::shape::GroupTime;

#[derive(Debug)]
struct Clock {
    domain: String,
    started: Instant,
    rollouts: u32,
    engine: HashMap<RequestId, Instant>,
    env: HashMap<u32, Instant>,
    scoring: Option<Instant>,
    engine_sum: f64,
    env_sum: f64,
    /// Response tokens of each rollout at the group's last abort.
    partials: Vec<u32>,
}

/// Every timed group (those between admission and stored, and aborted ones waiting).
#[derive(Debug, Default)]
pub struct Clocks {
    groups: HashMap<GroupId, Clock>,
}

fn since(then: Instant, now: Instant) -> f64 {
    now.saturating_duration_since(then).as_secs_f64()
}

impl Clocks {
    /// Group `id` of `domain`, with `rollouts` rollouts, starts or resumes at `now` (a resume
    /// keeps its clock).
    pub fn start(&mut self, id: GroupId, domain: &str, rollouts: usize, now: Instant) {
        self.groups.entry(id).or_insert_with(|| Clock {
            domain: domain.to_owned(),
            started: now,
            rollouts: rollouts.max(1) as u32,
            engine: HashMap::new(),
            env: HashMap::new(),
            scoring: None,
            engine_sum: 0.0,
            env_sum: 0.0,
            partials: Vec::new(),
        });
    }

    /// `request` went to the engine.
    pub fn engine_sent(&mut self, request: RequestId, now: Instant) {
        if let Some(c) = self.groups.get_mut(&request.rollout.group) {
            c.engine.insert(request, now);
        }
    }

    /// The engine answered `request`.
    pub fn engine_done(&mut self, request: RequestId, now: Instant) {
        if let Some(c) = self.groups.get_mut(&request.rollout.group)
            && let Some(sent) = c.engine.remove(&request)
        {
            c.engine_sum += since(sent, now);
        }
    }

    /// Rollout `id` waits on the env.
    pub fn env_sent(&mut self, id: RolloutId, now: Instant) {
        if let Some(c) = self.groups.get_mut(&id.group) {
            c.env.insert(id.index, now);
        }
    }

    /// The env answered rollout `id`.
    pub fn env_done(&mut self, id: RolloutId, now: Instant) {
        if let Some(c) = self.groups.get_mut(&id.group)
            && let Some(sent) = c.env.remove(&id.index)
        {
            c.env_sum += since(sent, now);
        }
    }

    /// The env scores group `id` as a whole.
    pub fn scoring_sent(&mut self, id: GroupId, now: Instant) {
        if let Some(c) = self.groups.get_mut(&id) {
            c.scoring = Some(now);
        }
    }

    /// The env scored group `id`: every rollout waited for it.
    pub fn scoring_done(&mut self, id: GroupId, now: Instant) {
        if let Some(c) = self.groups.get_mut(&id)
            && let Some(sent) = c.scoring.take()
        {
            c.env_sum += since(sent, now) * f64::from(c.rollouts);
        }
    }

    /// `group` left for the aborted bucket: its rollouts' lengths so far are kept.
    pub fn aborted(&mut self, group: &RolloutGroup) {
        if let Some(c) = self.groups.get_mut(&group.id) {
            c.partials = group
                .rollouts
                .iter()
                .map(|r| u32::try_from(r.completion_tokens()).unwrap_or(u32::MAX))
                .collect();
        }
    }

    /// `group` comes back from the store to resume: the partials it no longer carries (regenerated
    /// from the prompt: partial rollouts off, or expired while aborted) were generated for
    /// nothing; their lengths at the abort are returned.
    pub fn resumed(&mut self, group: &RolloutGroup) -> Vec<u32> {
        let Some(c) = self.groups.get_mut(&group.id) else {
            return Vec::new();
        };
        let partials = std::mem::take(&mut c.partials);
        partials
            .into_iter()
            .zip(&group.rollouts)
            .filter(|(n, r)| *n > 0 && r.completion_tokens() < *n as usize)
            .map(|(n, _)| n)
            .collect()
    }

    /// The store holds group `id` in a bucket other than aborted: its clock stops; its domain
    /// and time.
    pub fn stored(&mut self, id: GroupId, now: Instant) -> Option<(String, GroupTime)> {
        let c = self.groups.remove(&id)?;
        let n = f64::from(c.rollouts);
        let time = GroupTime {
            total: since(c.started, now),
            engine: c.engine_sum / n,
            env: c.env_sum / n,
        };
        Some((c.domain, time))
    }

    /// Group `id` will never run again (cleared or dropped): the lengths its rollouts had at
    /// its last abort (`None` when it had no clock, e.g. it was stored already).
    pub fn forget(&mut self, id: GroupId) -> Option<Vec<u32>> {
        self.groups.remove(&id).map(|c| c.partials)
    }

    /// Groups with a clock.
    #[cfg(test)]
    pub fn len(&self) -> usize {
        self.groups.len()
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use sluice_core::{DataSample, NodeId, PolicyVersion, RolloutTurn, RunId};

    fn id(counter: u64) -> GroupId {
        GroupId {
            run: RunId::from_name("clocks"),
            node: NodeId(0),
            counter,
        }
    }

    fn at(t0: Instant, seconds: f64) -> Instant {
        t0 + Duration::from_secs_f64(seconds)
    }

    /// Two rollouts, an abort in between: engine and env time add up across the trip, scoring
    /// counts for both rollouts, and the stale answer of an old request adds nothing.
    #[test]
    fn a_group_splits_its_time_across_trips() {
        let (g, t0) = (id(1), Instant::now());
        let mut c = Clocks::default();
        c.start(g, "math", 2, t0);
        let (r0, r1) = (g.rollout(0), g.rollout(1));
        c.env_sent(r0, t0);
        c.env_sent(r1, t0);
        c.env_done(r0, at(t0, 0.5));
        c.env_done(r1, at(t0, 0.5));
        c.engine_sent(r0.request(0, 0), at(t0, 0.5));
        c.engine_sent(r1.request(0, 0), at(t0, 0.5));
        c.engine_done(r0.request(0, 0), at(t0, 2.5));
        c.engine_done(r1.request(0, 0), at(t0, 1.5));
        // Aborted, waits 10 s, resumed: the clock runs on.
        c.start(g, "math", 2, at(t0, 11.5));
        c.engine_sent(r1.request(0, 1), at(t0, 11.5));
        c.engine_done(r1.request(0, 1), at(t0, 12.5));
        c.engine_done(r1.request(0, 0), at(t0, 13.0));
        c.scoring_sent(g, at(t0, 12.5));
        c.scoring_done(g, at(t0, 13.5));
        let (domain, time) = c.stored(g, at(t0, 14.0)).unwrap();
        assert_eq!(domain, "math");
        assert!((time.total - 14.0).abs() < 1e-9);
        // Engine: r0 2 s, r1 1 s + 1 s → 4 s over 2 rollouts.
        assert!((time.engine - 2.0).abs() < 1e-9, "{time:?}");
        // Env: 0.5 s each, plus 1 s of scoring each → 1.5 s.
        assert!((time.env - 1.5).abs() < 1e-9, "{time:?}");
        assert!(time.engine + time.env <= time.total);
        assert_eq!(c.len(), 0);
        assert_eq!(c.stored(g, at(t0, 15.0)), None);
    }

    #[test]
    fn a_cleared_group_leaves_its_partials() {
        let (g, t0) = (id(2), Instant::now());
        let sample = DataSample {
            id: "1".into(),
            domain: "math".into(),
            dataset: "toy".into(),
            input: serde_json::Value::Null,
            system_prompt: None,
        };
        let mut group = RolloutGroup::new(g, sample, 2, PolicyVersion(0));
        let mut t = RolloutTurn::new(vec![1]);
        t.append_tokens(&[5, 6, 7], &[-0.1; 3], &[PolicyVersion(0); 3])
            .unwrap();
        group.rollouts[1].turns.push(t);
        let mut c = Clocks::default();
        c.start(g, "math", 2, t0);
        c.aborted(&group);
        // Resumed with its partial: nothing was thrown away.
        assert_eq!(c.resumed(&group), Vec::<u32>::new());
        c.aborted(&group);
        // Regenerated from the prompt: the 3 tokens were generated for nothing.
        let mut regenerated = group.clone();
        regenerated.rollouts[1].turns.clear();
        assert_eq!(c.resumed(&regenerated), vec![3]);
        assert_eq!(c.resumed(&regenerated), Vec::<u32>::new(), "counted once");
        c.aborted(&group);
        assert_eq!(c.forget(g), Some(vec![0, 3]));
        assert_eq!(c.forget(g), None, "forgotten once");
        assert_eq!(c.len(), 0);
    }
}
