//! The DatasetSampler actor: hands data samples to the controller when asked (credit-based: it
//! never sends more than the controller requested), and hears back how many rollouts of each
//! domain completed, which the adaptive mix steers by (seed 000).
//!
//! The samples come from a [`SampleSource`] (`sluice_data::source`): any `sluice-data` mix
//! sampler is one, and [`SimSource`] is the synthetic one of simulated runs.
//! After each request and each completion report the actor exports
//! `sluice_domain_mix_{actual,target,count}{domain}`.

use ractor::{Actor, ActorProcessingErr, ActorRef, RpcReplyPort};
use serde_json::Value;
use sluice_core::metrics as m;
use sluice_core::{DataSample, KnobsHandle, PolicyVersion, RolloutGroup, RolloutStatus};
pub use sluice_data::{SampleSource, SimSource};

use crate::counters::ActorCounters;
use crate::{ActorError, Sink};

/// Rollouts of a finished group that count as completed for the mix: those that produced a
/// trainable answer (`Completed` or `Truncated`), not failed ones — and none when the group is
/// already stale on arrival (a token older than `current − η`): the replay store expires it, and
/// it counts when it completes in time after regeneration, or never when expired groups are
/// dropped.
pub fn completed_rollouts(
    group: &RolloutGroup,
    current: PolicyVersion,
    max_version_lag: u64,
) -> u64 {
    let stale = group.min_version().is_some_and(|v| {
        v.lag_to(current)
            .ok()
            .is_none_or(|lag| lag > max_version_lag)
    });
    if stale {
        return 0;
    }
    group
        .rollouts
        .iter()
        .filter(|r| {
            matches!(
                r.status,
                RolloutStatus::Completed | RolloutStatus::Truncated
            )
        })
        .count() as u64
}

enum Cmd {
    Request(usize),
    Completed { domain: String, rollouts: u64 },
    State(RpcReplyPort<Value>),
}

/// The actor's messages (private: use [`SamplerHandle`]).
pub struct SamplerMsg(Cmd);

/// Typed handle; cloning is shallow.
#[derive(Clone)]
pub struct SamplerHandle {
    actor: ActorRef<SamplerMsg>,
}

impl SamplerHandle {
    /// The actor's cell (for linking it to a supervisor).
    pub fn cell(&self) -> ractor::ActorCell {
        self.actor.get_cell()
    }

    /// Starts the sampler; batches of samples go to `out`.
    pub async fn spawn(
        source: Box<dyn SampleSource>,
        knobs: KnobsHandle,
        out: Sink<Vec<DataSample>>,
    ) -> Result<(Self, tokio::task::JoinHandle<()>), ActorError> {
        Self::spawn_from(source, knobs, out, None).await
    }

    /// Starts the sampler, first restoring `state` (a [`SamplerHandle::state`] taken earlier)
    /// into `source` when given; a state the source refuses fails the start.
    pub async fn spawn_from(
        mut source: Box<dyn SampleSource>,
        knobs: KnobsHandle,
        out: Sink<Vec<DataSample>>,
        state: Option<Value>,
    ) -> Result<(Self, tokio::task::JoinHandle<()>), ActorError> {
        if let Some(state) = state {
            source.restore(state).map_err(|message| ActorError::Spawn {
                actor: "sampler",
                message,
            })?;
        }
        let (actor, join) = Actor::spawn(None, SamplerActor { knobs, out }, source)
            .await
            .map_err(|e| ActorError::Spawn {
                actor: "sampler",
                message: e.to_string(),
            })?;
        Ok((Self { actor }, join))
    }

    /// Asks for `n` samples (the answer may hold fewer when the source runs dry).
    pub fn request(&self, n: usize) {
        let _ = self.actor.cast(SamplerMsg(Cmd::Request(n)));
    }

    /// Reports `rollouts` completed rollouts of `domain`.
    pub fn completed(&self, domain: &str, rollouts: u64) {
        let _ = self.actor.cast(SamplerMsg(Cmd::Completed {
            domain: domain.to_owned(),
            rollouts,
        }));
    }

    /// Reports a finished (not aborted) group, finished while the policy is at `current` with lag
    /// bound `max_version_lag`: its [`completed_rollouts`] under its domain.
    pub fn group_finished(
        &self,
        group: &RolloutGroup,
        current: PolicyVersion,
        max_version_lag: u64,
    ) {
        let n = completed_rollouts(group, current, max_version_lag);
        if n > 0 {
            self.completed(&group.sample.domain, n);
        }
    }

    /// The source's checkpointable state, after every message sent before this call.
    pub async fn state(&self) -> Result<Value, ActorError> {
        let (tx, rx) = tokio::sync::oneshot::channel();
        self.actor
            .cast(SamplerMsg(Cmd::State(tx.into())))
            .map_err(|_| ActorError::Gone { actor: "sampler" })?;
        rx.await.map_err(|_| ActorError::Gone { actor: "sampler" })
    }

    /// Stops the actor.
    pub async fn stop(&self) {
        let _ = self.actor.stop_and_wait(None, None).await;
    }
}

/// The actor, with what stays fixed for its life: the knobs it reads the mix from and where
/// the samples go. Its state is the source and its counters.
struct SamplerActor {
    knobs: KnobsHandle,
    out: Sink<Vec<DataSample>>,
}

impl Actor for SamplerActor {
    type Msg = SamplerMsg;
    type State = (Box<dyn SampleSource>, ActorCounters);
    type Arguments = Box<dyn SampleSource>;

    async fn pre_start(
        &self,
        _me: ActorRef<SamplerMsg>,
        source: Self::Arguments,
    ) -> Result<Self::State, ActorProcessingErr> {
        source.publish_metrics(&self.knobs.current().domain_shares());
        Ok((source, ActorCounters::new("sampler")))
    }

    async fn handle(
        &self,
        _me: ActorRef<SamplerMsg>,
        SamplerMsg(cmd): SamplerMsg,
        (source, counters): &mut Self::State,
    ) -> Result<(), ActorProcessingErr> {
        counters.received(1);
        let shares = self.knobs.current().domain_shares();
        match cmd {
            Cmd::Request(n) => {
                let samples: Vec<DataSample> =
                    (0..n).map_while(|_| source.next_sample(&shares)).collect();
                for s in &samples {
                    metrics::counter!(m::DATA_SAMPLES, "domain" => s.domain.clone()).increment(1);
                }
                (self.out)(samples);
                counters.sent(1);
            }
            Cmd::Completed { domain, rollouts } => source.record_completed(&domain, rollouts),
            Cmd::State(reply) => {
                let _ = reply.send(source.state());
                return Ok(());
            }
        }
        source.publish_metrics(&shares);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::{Arc, Mutex};
    use std::time::Duration;

    use sluice_core::{Knobs, WeightUpdateMode};
    use sluice_data::{GeneratorRows, MixSampler, SamplerConfig};

    fn knobs(mix: &[(&str, f64)]) -> KnobsHandle {
        let knobs = Knobs {
            staleness_threshold: 0.0,
            max_version_lag: 1,
            admission: Default::default(),
            enable_partial_rollout: true,
            tail_batch_candidate_steps: 0,
            tail_batch_trigger_size: 1,
            weight_update_mode: WeightUpdateMode::AbortResume,
            domain_mix: mix.iter().map(|(d, w)| ((*d).to_owned(), *w)).collect(),
            max_concurrent_rollouts: 8,
            paused: false,
        };
        KnobsHandle::new(knobs, 1, Vec::new()).unwrap()
    }

    fn adaptive(domains: &[&str]) -> Box<dyn SampleSource> {
        let rows = GeneratorRows::synthetic(domains.iter().map(|d| (*d).to_owned()));
        Box::new(MixSampler::with_rows(SamplerConfig::new(5), rows).unwrap())
    }

    type Got = Arc<Mutex<Vec<DataSample>>>;

    fn sink() -> (Sink<Vec<DataSample>>, Got) {
        let got: Got = Arc::default();
        let g = Arc::clone(&got);
        (Arc::new(move |s| g.lock().unwrap().extend(s)), got)
    }

    async fn take(got: &Got, n: usize) -> Vec<String> {
        for _ in 0..500 {
            if got.lock().unwrap().len() >= n {
                break;
            }
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
        let mut g = got.lock().unwrap();
        assert_eq!(
            g.len(),
            n,
            "the sampler answers a request with exactly n samples"
        );
        g.drain(..).map(|s| s.id).collect()
    }

    #[tokio::test]
    async fn feedback_steers_and_state_restores_at_spawn() {
        let k = knobs(&[("a", 1.0), ("b", 1.0)]);
        let (out, got) = sink();
        let (h, j) = SamplerHandle::spawn(adaptive(&["a", "b"]), k.clone(), out)
            .await
            .unwrap();
        h.request(10);
        take(&got, 10).await;
        // `a` completed plenty, `b` nothing: `b` gets 10× its weight, `a` half of it.
        h.completed("a", 100);
        let state = h.state().await.unwrap();
        assert_eq!(state["domains"]["a"]["completed"], 100);
        h.request(200);
        let ids = take(&got, 200).await;
        let b = ids.iter().filter(|id| id.starts_with("b-")).count();
        assert!(b > 170, "b should be drawn ~95 % of the time, got {b}/200");

        // A second sampler restored from the state draws exactly what the first drew.
        let (out2, got2) = sink();
        let (h2, j2) =
            SamplerHandle::spawn_from(adaptive(&["a", "b"]), k.clone(), out2, Some(state))
                .await
                .unwrap();
        h2.request(200);
        assert_eq!(take(&got2, 200).await, ids);

        // A state for other domains starts (`c`, new, has no weight in these knobs): `a` goes
        // on where the first sampler left it, drawing none of its rows again.
        let (out3, got3) = sink();
        let other = h.state().await.unwrap();
        let (h3, j3) = SamplerHandle::spawn_from(adaptive(&["a", "c"]), k, out3, Some(other))
            .await
            .expect("a changed domain starts afresh, not refused");
        h3.request(50);
        let drawn = take(&got3, 50).await;
        assert!(drawn.iter().all(|id| id.starts_with("a-")), "{drawn:?}");
        assert!(
            drawn.iter().all(|id| !ids.contains(id)),
            "{drawn:?} / {ids:?}"
        );
        for (h, j) in [(h, j), (h2, j2), (h3, j3)] {
            h.stop().await;
            j.await.unwrap();
        }
    }

    #[test]
    fn only_answered_rollouts_count_as_completed() {
        use sluice_core::{GroupId, NodeId, RunId};
        let id = GroupId {
            run: RunId::from_name("t"),
            node: NodeId(0),
            counter: 1,
        };
        let sample = DataSample {
            id: "1".into(),
            domain: "code".into(),
            dataset: "x".into(),
            input: Value::Null,
            system_prompt: None,
        };
        let mut g = RolloutGroup::new(id, sample, 4, PolicyVersion::INITIAL);
        g.rollouts[0].status = RolloutStatus::Completed;
        g.rollouts[1].status = RolloutStatus::Truncated;
        g.rollouts[2].status = RolloutStatus::Error("env_panic".into());
        g.rollouts[3].status = RolloutStatus::Timeout;
        assert_eq!(completed_rollouts(&g, PolicyVersion(0), 0), 2);
        // A token of version 0 is 3 versions behind v3: stale for η = 2, fine for η = 3.
        for r in &mut g.rollouts {
            let mut t = sluice_core::RolloutTurn::new(vec![1]);
            t.completion_token_ids = vec![5];
            t.logprobs = vec![-0.5];
            t.token_versions = vec![PolicyVersion(0)];
            r.turns.push(t);
        }
        assert_eq!(completed_rollouts(&g, PolicyVersion(3), 2), 0);
        assert_eq!(completed_rollouts(&g, PolicyVersion(3), 3), 2);
    }

    #[test]
    fn sim_source_from_config_follows_data_and_lengths() {
        let text = r#"
            [run]
            seed = 3
            [data]
            adaptive_mix = false
            [engine.simulated.lengths.slow]
            distribution = "fixed"
            tokens = 100
            [engine.simulated.lengths.fast]
            distribution = "fixed"
            tokens = 10
        "#;
        let config = sluice_config::parse(text, "t.toml", &[], &|_| None).unwrap();
        let s = SimSource::from_config(&config.data, config.simulated_domains(), config.run.seed);
        let mut names = s.sampler().domain_names();
        names.sort();
        assert_eq!(names, ["fast", "slow"]);
        assert!(!s.sampler().is_adaptive());
        let plain = SimSource::new(Vec::new(), 1);
        assert_eq!(plain.sampler().domain_names(), ["sim"]);
    }
}
