//! One training step: the batch's invariant checks (every token's version lag against η, no
//! group trained twice), the backend call (a panic poisons the trainer), the status and step
//! metrics, and publishing the new weights (or releasing a skipped step's groups).

use std::collections::{BTreeMap, HashSet};
use std::time::Instant;

use sluice_core::metrics::{self as m, MetricKind};
use sluice_core::rollout::reward_component_means;
use sluice_core::{BackendError, GroupId, PolicyVersion, RolloutGroup, SituationAdvantages};
use sluice_trainer::situation_advantages;

use super::{StepEvent, Worker, panic_message};

impl Worker {
    /// One step on `batch`, taken from weights `version` under lag bound `eta`.
    pub(super) fn train(
        &mut self,
        batch: Vec<RolloutGroup>,
        version: PolicyVersion,
        eta: u64,
        idle: f64,
    ) {
        let span = tracing::info_span!(
            "train_step",
            step = self.status.steps + 1,
            version = version.0,
            groups = batch.len()
        );
        let _entered = span.enter();
        self.counters.received(1);
        let check = check_batch(&batch, version, eta, &mut self.trained);
        check.report(version);
        let step_started = Instant::now();
        let backend = &mut self.backend;
        let outcome =
            std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| backend.train_step(&batch)))
                .unwrap_or_else(|panic| {
                    self.poisoned = true;
                    Err(BackendError::new(
                        "trainer_panic",
                        format!("the training step panicked: {}", panic_message(&*panic)),
                    ))
                });
        let seconds = step_started.elapsed().as_secs_f64();
        metrics::histogram!(m::TRAINER_STEP_SECONDS).record(seconds);
        let groups = batch.len() as u64;
        let status = &mut self.status;
        status.idle_seconds += idle;
        status.uptime_seconds = self.started.elapsed().as_secs_f64();
        status.lag_violations += check.violations;
        status.duplicate_groups += check.duplicates;
        let out = match outcome {
            Ok(out) => out,
            Err(e) => {
                // The batch is consumed on disk and this step is lost; nothing is retried, so
                // nothing is trained twice.
                tracing::error!(error = %e, step = status.steps + 1, "training step failed; the trainer stops");
                self.counters.error(e.kind);
                status.failed_groups += groups;
                status.error = Some(e.to_string());
                self.publisher.status(&self.status, true);
                return;
            }
        };
        status.steps += 1;
        status.trained_groups += groups;
        status.done = status.steps >= self.options.max_steps;
        let steps = status.steps;
        if self.options.track_ids
            && let Ok(mut ids) = self.ids.lock()
        {
            ids.extend(batch.iter().map(|g| g.id));
        }
        let published = out.weights.inspect(|w| status.version = w.version);
        if published.is_some() {
            // What was trained: the rollouts with texts to train on, of a step that moved the
            // weights (the lags of every token were checked against η above).
            status.trained_samples += check.samples;
            status.trained_tokens += check.tokens;
            status.lag_sum += check.lag_sum;
            status.max_lag = status.max_lag.max(check.max_lag);
        } else {
            status.skipped_steps += 1;
            // The batch is consumed but no version moved the admission bound: give its groups
            // back, or η + 1 skipped steps would stop admission for good.
            self.replay.release_skipped(groups);
        }
        check.export(
            published.is_some(),
            status.idle_ratio(),
            seconds,
            &out.metrics,
        );
        if let Some(w) = &published {
            metrics::gauge!(m::TRAINER_POLICY_VERSION).set(w.version.0 as f64);
        }
        if let Some(mismatch) = super::MismatchStatus::of(steps, &out.metrics) {
            self.status.mismatch = Some(mismatch);
        }
        let situations = self.export_situations(&batch, out.situations);
        let event = StepEvent {
            step: steps,
            version,
            reward_mean: reward_mean(&batch),
            // The lags were summed by the invariant check already.
            version_lag_mean: check.lag_sum as f64 / check.tokens.max(1) as f64,
            reward_components: reward_component_means(batch.iter().flat_map(|g| &g.rollouts)),
            situations,
            domain_groups: batch.iter().fold(BTreeMap::new(), |mut m, g| {
                *m.entry(g.sample.domain.clone()).or_default() += 1;
                m
            }),
            trained_tokens: check.tokens,
            response_tokens: response_tokens(&batch),
            seconds,
            metrics: out.metrics,
            weights: published,
        };
        self.publisher.step(&self.status, event);
        self.counters.sent(1);
    }
}

/// The step metrics the actor records itself, whatever the backend reports under their names:
/// the step's time, each token's lag, and a skipped step.
const RECORDED_BY_THE_ACTOR: [&str; 3] = [
    m::TRAINER_STEP_SECONDS,
    m::TRAINER_TOKEN_VERSION_LAG_VERSIONS,
    m::TRAINER_SKIPPED_STEPS,
];

/// Exports a step's catalog-named scalars: gauges are set, counters incremented by the value.
/// What the actor records itself (the step's time, each token's lag, a skipped step) is
/// skipped, so nothing counts twice; names outside the catalog are ignored (an ad-hoc name
/// would be an undocumented series). Returns how many names were ignored.
pub fn export_step_metrics(values: &BTreeMap<String, f64>) -> usize {
    let mut ignored = 0;
    for (name, v) in values {
        if RECORDED_BY_THE_ACTOR.contains(&name.as_str()) {
            continue;
        }
        match m::find(name).map(|d| d.kind) {
            Some(MetricKind::Gauge) => metrics::gauge!(name.clone()).set(*v),
            Some(MetricKind::Counter) if *v >= 0.0 => {
                metrics::counter!(name.clone()).increment(v.round() as u64)
            }
            Some(MetricKind::Histogram) => metrics::histogram!(name.clone()).record(*v),
            Some(_) => {}
            None => ignored += 1,
        }
    }
    ignored
}

impl Worker {
    /// The advantages of `batch`'s texts per (domain, situation), exported as gauges (new
    /// series up to the cap; labels come from envs, maybe remote ones). They are the backend's
    /// (computed with the step's advantages) when it reports them; computed here only for a
    /// backend that computes none. Not reported without an advantage configuration.
    fn export_situations(
        &mut self,
        batch: &[RolloutGroup],
        from_backend: Option<SituationAdvantages>,
    ) -> SituationAdvantages {
        let Some(config) = &self.options.advantage else {
            return SituationAdvantages::new();
        };
        let situations = from_backend.unwrap_or_else(|| situation_advantages(batch, config));
        for ((domain, situation), a) in &situations {
            if !self.situation_series.admit(domain, situation) {
                continue;
            }
            let labels = [("domain", domain.clone()), ("situation", situation.clone())];
            metrics::gauge!(m::TRAINER_SITUATION_SEQUENCES, &labels).set(a.texts as f64);
            metrics::gauge!(m::TRAINER_SITUATION_ADVANTAGE_MEAN_VALUE, &labels).set(a.mean);
            metrics::gauge!(m::TRAINER_SITUATION_ADVANTAGE_ABS_MEAN_VALUE, &labels).set(a.abs_mean);
        }
        situations
    }
}

/// Response tokens of each rollout of `batch` with model output to train on.
fn response_tokens(batch: &[RolloutGroup]) -> Vec<u32> {
    batch
        .iter()
        .flat_map(|g| &g.rollouts)
        .filter(|r| r.status.is_trainable())
        .map(|r| u32::try_from(r.completion_tokens()).unwrap_or(u32::MAX))
        .collect()
}

/// Mean final reward over the rollouts of `batch`.
fn reward_mean(batch: &[RolloutGroup]) -> f64 {
    let (sum, n) = batch
        .iter()
        .flat_map(|g| &g.rollouts)
        .fold((0.0, 0usize), |(s, n), r| (s + r.reward, n + 1));
    sum / n.max(1) as f64
}

/// What a batch holds, as the step counts it: the rollouts with texts to train on (completed or
/// truncated) and their tokens' lags; every token of the batch is checked against η.
struct BatchCheck {
    samples: u64,
    tokens: u64,
    lag_sum: u64,
    max_lag: u64,
    violations: u64,
    duplicates: u64,
    /// Tokens tagged with a version ahead of the one trained from (also violations).
    future_tokens: u64,
    /// The newest such version.
    future: Option<PolicyVersion>,
    /// Trained tokens by lag (the last bucket holds every larger lag).
    per_lag: [u64; 64],
}

impl BatchCheck {
    /// Logs (and counts) what the batch broke; `version`: the weights it trained from.
    fn report(&self, version: PolicyVersion) {
        if self.violations > 0 || self.duplicates > 0 {
            tracing::error!(
                violations = self.violations,
                duplicates = self.duplicates,
                "batch broke an invariant"
            );
        }
        if let Some(newest) = self.future {
            tracing::error!(
                tokens = self.future_tokens,
                newest = newest.0,
                trained_from = version.0,
                "batch holds tokens from a weight version the trainer never published (an engine's weights were replaced behind the head's back); counted as lag violations"
            );
            metrics::counter!(m::TRAINER_FUTURE_VERSION_TOKENS).increment(self.future_tokens);
        }
    }

    /// The step's metrics: the ones the actor records itself (steps, skipped steps, idle ratio,
    /// and, for a step that `trained` (published), its tokens, their lags and tokens/s when the
    /// backend reports none), then the `backend`'s own by name. Recorded together after the
    /// step, so that one scrape sees the lag histogram and the token counter agree.
    fn export(
        &self,
        trained: bool,
        idle_ratio: f64,
        seconds: f64,
        backend: &BTreeMap<String, f64>,
    ) {
        metrics::counter!(m::TRAINER_STEPS).increment(1);
        metrics::gauge!(m::TRAINER_IDLE_RATIO).set(idle_ratio);
        if !trained {
            metrics::counter!(m::TRAINER_SKIPPED_STEPS).increment(1);
            export_step_metrics(backend);
            return;
        }
        metrics::counter!(m::TRAINER_TRAINED_TOKENS).increment(self.tokens);
        for (lag, n) in self.per_lag.iter().enumerate().filter(|(_, n)| **n > 0) {
            metrics::histogram!(m::TRAINER_TOKEN_VERSION_LAG_VERSIONS)
                .record_many(lag as f64, *n as usize);
        }
        if self.tokens > 0 {
            metrics::gauge!(m::TRAINER_MEAN_VERSION_LAG_VERSIONS)
                .set(self.lag_sum as f64 / self.tokens as f64);
            metrics::gauge!(m::TRAINER_MAX_VERSION_LAG_VERSIONS).set(self.max_lag as f64);
        }
        if !backend.contains_key(m::TRAINER_TOKENS_PER_SECOND) && seconds > 0.0 {
            metrics::gauge!(m::TRAINER_TOKENS_PER_SECOND).set(self.tokens as f64 / seconds);
        }
        export_step_metrics(backend);
    }
}

/// Lags of every token against the weights `version` the batch trains from; a token from a
/// version ahead of it is a violation with no lag (see [`PolicyVersion::lag_to`]).
fn check_batch(
    batch: &[RolloutGroup],
    version: PolicyVersion,
    eta: u64,
    trained: &mut HashSet<GroupId>,
) -> BatchCheck {
    let mut c = BatchCheck {
        samples: 0,
        tokens: 0,
        lag_sum: 0,
        max_lag: 0,
        violations: 0,
        duplicates: 0,
        future_tokens: 0,
        future: None,
        per_lag: [0; 64],
    };
    for g in batch {
        if !trained.insert(g.id) {
            c.duplicates += 1;
        }
        for r in &g.rollouts {
            let counted = r.status.is_trainable();
            c.samples += u64::from(counted);
            for v in r.turns.iter().flat_map(|t| t.token_versions.iter()) {
                c.check_token(*v, version, eta, counted);
            }
        }
    }
    c
}

impl BatchCheck {
    /// Checks one token of version `v` against the bound η of a step training from `version`;
    /// a `counted` one (of a rollout that trains) adds to the tokens and their lags.
    fn check_token(&mut self, v: PolicyVersion, version: PolicyVersion, eta: u64, counted: bool) {
        self.tokens += u64::from(counted);
        let lag = match v.lag_to(version) {
            Ok(lag) => lag,
            Err(_) => {
                // No lag to record: a version from the future breaks the bound outright.
                self.future_tokens += 1;
                self.future = self.future.max(Some(v));
                self.violations += 1;
                return;
            }
        };
        if lag > eta {
            self.violations += 1;
        }
        if counted {
            self.lag_sum += lag;
            self.max_lag = self.max_lag.max(lag);
            self.per_lag[(lag as usize).min(63)] += 1;
        }
    }
}

#[cfg(test)]
mod tests {
    use sluice_core::{DataSample, NodeId, RolloutStatus, RolloutTurn, RunId};

    use super::*;

    /// A group of one rollout whose tokens carry `versions`.
    fn group(counter: u64, versions: &[u64]) -> RolloutGroup {
        let id = GroupId {
            run: RunId::from_name("step"),
            node: NodeId(0),
            counter,
        };
        let sample = DataSample {
            id: counter.to_string(),
            domain: "math".into(),
            dataset: "arith".into(),
            input: serde_json::Value::Null,
            system_prompt: None,
        };
        let mut g = RolloutGroup::new(id, sample, 1, PolicyVersion(0));
        let mut t = RolloutTurn::new(vec![1, 2]);
        let n = versions.len();
        let vs: Vec<PolicyVersion> = versions.iter().copied().map(PolicyVersion).collect();
        t.append_tokens(&vec![7; n], &vec![-0.5; n], &vs).unwrap();
        g.rollouts[0].turns = vec![t];
        g.rollouts[0].status = RolloutStatus::Completed;
        g
    }

    /// A token from a version the trainer never published (the sweep's 999999 against a
    /// trainer at 3) used to count as lag 0: now it is a violation, counted apart, and no lag
    /// is recorded for it.
    #[test]
    fn a_token_from_the_future_is_a_violation_not_lag_zero() {
        let mut trained = HashSet::new();
        let batch = vec![group(1, &[3, 2]), group(2, &[999_999, 999_999, 3])];
        let c = check_batch(&batch, PolicyVersion(3), 1, &mut trained);
        assert_eq!((c.tokens, c.violations, c.future_tokens), (5, 2, 2));
        assert_eq!(c.future, Some(PolicyVersion(999_999)));
        assert_eq!((c.lag_sum, c.max_lag), (1, 1), "only the real lags");
        let clean = check_batch(&[group(3, &[2, 3])], PolicyVersion(3), 1, &mut trained);
        assert_eq!(
            (clean.violations, clean.future_tokens, clean.future),
            (0, 0, None)
        );
    }

    /// A rollout that ended without texts to train on (an env error, a timeout) is checked
    /// against η but not counted as trained: a broken env used to show as training throughput.
    #[test]
    fn only_rollouts_that_train_count_as_trained() {
        let mut trained = HashSet::new();
        let mut failed = group(2, &[0, 0, 0]);
        failed.rollouts[0].status = RolloutStatus::Error("env".into());
        let c = check_batch(
            &[group(1, &[3, 2]), failed],
            PolicyVersion(3),
            1,
            &mut trained,
        );
        assert_eq!((c.samples, c.tokens, c.lag_sum, c.max_lag), (1, 2, 1, 1));
        assert_eq!(c.per_lag[..2], [1, 1]);
        assert_eq!(c.violations, 3, "every token is held to η, trained or not");
    }
}
