//! Runtime knobs (`DESIGN.md` §4.5): the values an operator may change while a run is live.
//!
//! [`Knobs`] is one validated snapshot. A [`KnobPatch`] names the knobs to change; applying it
//! validates the *result*, so a patch either takes effect whole or changes nothing. The
//! [`KnobsHandle`] shares the current snapshot through a `tokio::sync::watch` channel: every actor
//! reads `handle.current()` (or its own receiver) at each decision, so a change is seen at the next
//! scheduling decision or training step without any actor being told.
//!
//! The knob names are the fields of [`Knobs`] as serde spells them, read back from the derive
//! ([`knob_names`], [`gauge_names`]; `fields`), and `sluice knobs set key=value` assignments are
//! read through [`KnobPatch`]'s own derive (`assign`): no list of names is written by hand.

use std::collections::BTreeMap;
use std::sync::Arc;

use serde::{Deserialize, Serialize};
use tokio::sync::watch;

use crate::choice::Choice;

mod assign;
mod fields;
mod persist;

pub use fields::{gauge_names, knob_names};
pub use persist::{KnobResumed, KnobState, resume_knobs};

/// How the inference engine treats in-flight requests when new weights are published (§4.2).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum WeightUpdateMode {
    /// Abort every in-flight request (saving partials), swap, resume later.
    AbortResume,
    /// Swap between two decoding steps and continue; later tokens carry the new version.
    InFlight,
    /// Stop admitting, let in-flight requests finish, then swap (synchronous behaviour).
    Drain,
}

impl WeightUpdateMode {
    /// All modes, in documentation order.
    pub const ALL: [Self; 3] = [Self::AbortResume, Self::InFlight, Self::Drain];

    /// The config / API spelling.
    pub fn as_str(self) -> &'static str {
        Choice::name(self)
    }
}

/// How far ahead of the trainer the controller admits new groups (§4.1).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum AdmissionMode {
    /// η stays the hard ceiling, but new groups are admitted only while those not yet trained
    /// fall short of what the trainer consumes before a group admitted now is ready: a
    /// trainer-bound run trains fresh data instead of data η versions old.
    #[default]
    Demand,
    /// Plain AReaL: admit up to the η ceiling, `(v + η + 1) · groups_per_step`.
    Eta,
}

impl AdmissionMode {
    /// All modes, in documentation order.
    pub const ALL: [Self; 2] = [Self::Demand, Self::Eta];

    /// The config / API spelling.
    pub fn as_str(self) -> &'static str {
        Choice::name(self)
    }
}

crate::impl_choice!(WeightUpdateMode, AdmissionMode);

/// One validated snapshot of every runtime knob.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Knobs {
    /// Over-sending: keep `ceil((1 + s) · remaining)` groups in flight per step (s ≥ 0).
    pub staleness_threshold: f64,
    /// η: no token older than η versions is ever trained on (0 = on-policy).
    pub max_version_lag: u64,
    /// `demand`: admit only as far ahead as keeps the trainer busy (η the ceiling); `eta`: up to η.
    #[serde(default)]
    pub admission: AdmissionMode,
    /// Resume aborted turns from their partial output (true) or regenerate them (false).
    pub enable_partial_rollout: bool,
    /// A rollout aborted `k + 1` times becomes a tail-batch candidate; 0 disables the tail batch.
    pub tail_batch_candidate_steps: u32,
    /// Number of candidates that triggers a tail-batch round (≥ 1).
    pub tail_batch_trigger_size: u32,
    /// What a weight publish does to in-flight requests.
    pub weight_update_mode: WeightUpdateMode,
    /// Target share of each domain (relative weights, normalized when used).
    pub domain_mix: BTreeMap<String, f64>,
    /// Cap on rollouts generating at once, on top of admission control; 0: none beyond
    /// admission, whose bound `(η + 1) · groups_per_step · group_size` follows η as it changes.
    pub max_concurrent_rollouts: u32,
    /// Admit no new groups while true (in-flight work continues).
    pub paused: bool,
}

/// Largest `staleness_threshold`: over-sending beyond 100× the missing groups only floods the
/// sampler and the engine (the controller asks for `(1 + s) · remaining` samples at once).
pub const MAX_STALENESS_THRESHOLD: f64 = 100.0;

/// Largest `max_version_lag`: a million versions is "never stale" for any real run, and the
/// admission formula `(v + η + 1) · groups_per_step` stays far from overflow.
pub const MAX_VERSION_LAG: u64 = 1_000_000;

/// Largest `max_concurrent_rollouts`: more rollouts in flight than one node's engine and env
/// workers can hold.
pub const MAX_CONCURRENT_ROLLOUTS: u32 = 1_048_576;

/// Largest `tail_batch_candidate_steps` and `tail_batch_trigger_size`, as the config bounds
/// every count ([`crate::config::bounds::MAX_COUNT`]).
pub const MAX_TAIL_COUNT: u32 = 1_000_000_000;

/// Largest `domain_mix` weight: weights are relative, and the bound keeps their sum finite (a
/// sum of several 1e308 weights is infinite and every share becomes NaN).
pub const MAX_DOMAIN_WEIGHT: f64 = 1e9;

/// Most domains `domain_mix` may name: the `domain` label of the metrics stays bounded even when
/// no datasets are configured (simulated runs), where any name is accepted.
pub const MAX_DOMAINS: usize = 256;

/// A knob value was refused; nothing changed.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("{knob}: {reason}")]
pub struct KnobError {
    /// The knob (or `domain_mix.<domain>`) that was refused.
    pub knob: String,
    /// What was expected, and what was given.
    pub reason: String,
}

/// A number as a person would write it: huge ones in exponent form (`1e300`, not 301 digits).
pub fn show_number(v: f64) -> String {
    if v.is_finite() && v.abs() >= 1e15 {
        format!("{v:e}")
    } else {
        format!("{v}")
    }
}

impl KnobError {
    fn new(knob: impl Into<String>, reason: impl Into<String>) -> Self {
        Self {
            knob: knob.into(),
            reason: reason.into(),
        }
    }
}

impl Knobs {
    /// Checks every value; the first problem is returned.
    pub fn validate(&self, known_domains: &[String]) -> Result<(), KnobError> {
        if !self.staleness_threshold.is_finite() || self.staleness_threshold < 0.0 {
            return Err(KnobError::new(
                "staleness_threshold",
                format!(
                    "expected a finite number ≥ 0, got {}",
                    self.staleness_threshold
                ),
            ));
        }
        if self.staleness_threshold > MAX_STALENESS_THRESHOLD {
            return Err(KnobError::new(
                "staleness_threshold",
                format!(
                    "expected a number ≤ {MAX_STALENESS_THRESHOLD}, got {}",
                    self.staleness_threshold
                ),
            ));
        }
        if self.max_version_lag > MAX_VERSION_LAG {
            return Err(KnobError::new(
                "max_version_lag",
                format!(
                    "expected an integer ≤ {MAX_VERSION_LAG}, got {}",
                    self.max_version_lag
                ),
            ));
        }
        if self.tail_batch_trigger_size == 0 {
            return Err(KnobError::new(
                "tail_batch_trigger_size",
                "expected an integer ≥ 1, got 0",
            ));
        }
        let counts = [
            (
                "tail_batch_candidate_steps",
                self.tail_batch_candidate_steps,
                MAX_TAIL_COUNT,
            ),
            (
                "tail_batch_trigger_size",
                self.tail_batch_trigger_size,
                MAX_TAIL_COUNT,
            ),
            (
                "max_concurrent_rollouts",
                self.max_concurrent_rollouts,
                MAX_CONCURRENT_ROLLOUTS,
            ),
        ];
        if let Some((knob, v, max)) = counts.into_iter().find(|&(_, v, max)| v > max) {
            return Err(KnobError::new(
                knob,
                format!("expected an integer ≤ {max}, got {v}"),
            ));
        }
        if self.domain_mix.len() > MAX_DOMAINS {
            return Err(KnobError::new(
                "domain_mix",
                format!(
                    "expected at most {MAX_DOMAINS} domains, got {}",
                    self.domain_mix.len()
                ),
            ));
        }
        for (domain, &w) in &self.domain_mix {
            if !known_domains.is_empty() && !known_domains.contains(domain) {
                return Err(KnobError::new(
                    format!("domain_mix.{domain}"),
                    format!(
                        "unknown domain; the sampler serves: {}",
                        known_domains.join(", ")
                    ),
                ));
            }
            if !w.is_finite() || !(0.0..=MAX_DOMAIN_WEIGHT).contains(&w) {
                return Err(KnobError::new(
                    format!("domain_mix.{domain}"),
                    format!(
                        "expected a finite weight in [0, {MAX_DOMAIN_WEIGHT:e}], got {}",
                        show_number(w)
                    ),
                ));
            }
        }
        if !self.domain_mix.is_empty() && self.domain_mix.values().sum::<f64>() <= 0.0 {
            return Err(KnobError::new(
                "domain_mix",
                "expected at least one weight > 0, all are 0",
            ));
        }
        Ok(())
    }

    /// Numeric view of every number and switch among the knobs ([`gauge_names`], in that
    /// order), for the `sluice_node_knob_value{knob}` gauge. Booleans are 0/1;
    /// `weight_update_mode` and `admission` are exported separately as info gauges and `domain_mix` as
    /// `sluice_domain_mix_target`.
    pub fn gauge_values(&self) -> Vec<(&'static str, f64)> {
        let value = serde_json::to_value(self).unwrap_or_default();
        gauge_names()
            .iter()
            .filter_map(|&name| match &value[name] {
                serde_json::Value::Bool(b) => Some((name, f64::from(u8::from(*b)))),
                serde_json::Value::Number(n) => n.as_f64().map(|v| (name, v)),
                _ => None,
            })
            .collect()
    }

    /// `domain_mix` normalized to shares summing to 1 (empty when no mix is set).
    pub fn domain_shares(&self) -> BTreeMap<String, f64> {
        let total: f64 = self.domain_mix.values().sum();
        self.domain_mix
            .iter()
            .map(|(d, w)| (d.clone(), if total > 0.0 { w / total } else { 0.0 }))
            .collect()
    }
}

/// A partial update of the knobs (the body of `PATCH /v1/knobs`). Unset fields keep their value;
/// `domain_mix` entries are merged per domain (set a weight to 0 to turn a domain off).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct KnobPatch {
    /// See [`Knobs::staleness_threshold`].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub staleness_threshold: Option<f64>,
    /// See [`Knobs::max_version_lag`].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_version_lag: Option<u64>,
    /// See [`Knobs::admission`].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub admission: Option<AdmissionMode>,
    /// See [`Knobs::enable_partial_rollout`].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub enable_partial_rollout: Option<bool>,
    /// See [`Knobs::tail_batch_candidate_steps`].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tail_batch_candidate_steps: Option<u32>,
    /// See [`Knobs::tail_batch_trigger_size`]; 0 means "the global batch size in groups", as in the
    /// config file.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tail_batch_trigger_size: Option<u32>,
    /// See [`Knobs::weight_update_mode`].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub weight_update_mode: Option<WeightUpdateMode>,
    /// See [`Knobs::domain_mix`]; merged per domain.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub domain_mix: Option<BTreeMap<String, f64>>,
    /// See [`Knobs::max_concurrent_rollouts`].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_concurrent_rollouts: Option<u32>,
    /// See [`Knobs::paused`].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub paused: Option<bool>,
}

impl KnobPatch {
    /// Builds a patch from `key=value` assignments, as `sluice knobs set` takes them
    /// (`domain_mix.math=0.4` sets one domain's weight), read through the patch's serde derive.
    ///
    /// A value that is not a finite number is refused here, not only when the patch is applied:
    /// JSON, which carries the patch to a node, has no NaN or infinity (serde writes them as
    /// `null`, which the admin API refuses).
    pub fn from_assignments<S: AsRef<str>>(assignments: &[S]) -> Result<Self, KnobError> {
        let patch = assign::patch_from_assignments(assignments)?;
        patch.refuse_non_finite()?;
        Ok(patch)
    }

    /// The first number of the patch that is not finite, refused as [`Knobs::validate`] words it.
    fn refuse_non_finite(&self) -> Result<(), KnobError> {
        if let Some(v) = self.staleness_threshold.filter(|v| !v.is_finite()) {
            return Err(KnobError::new(
                "staleness_threshold",
                format!("expected a finite number ≥ 0, got {v}"),
            ));
        }
        let weights = self.domain_mix.iter().flatten();
        if let Some((domain, w)) = weights.into_iter().find(|(_, w)| !w.is_finite()) {
            return Err(KnobError::new(
                format!("domain_mix.{domain}"),
                format!("expected a finite weight in [0, {MAX_DOMAIN_WEIGHT:e}], got {w}"),
            ));
        }
        Ok(())
    }

    /// True when the patch changes nothing.
    pub fn is_empty(&self) -> bool {
        *self == Self::default()
    }

    /// The knobs after this patch, validated. `default_trigger_size` resolves a trigger size of 0.
    pub fn apply(
        &self,
        current: &Knobs,
        default_trigger_size: u32,
        known_domains: &[String],
    ) -> Result<Knobs, KnobError> {
        let Self {
            staleness_threshold,
            max_version_lag,
            admission,
            enable_partial_rollout,
            tail_batch_candidate_steps,
            tail_batch_trigger_size,
            weight_update_mode,
            domain_mix,
            max_concurrent_rollouts,
            paused,
        } = self;
        let mut next = current.clone();
        if let Some(v) = staleness_threshold {
            next.staleness_threshold = *v;
        }
        if let Some(v) = max_version_lag {
            next.max_version_lag = *v;
        }
        if let Some(v) = admission {
            next.admission = *v;
        }
        if let Some(v) = enable_partial_rollout {
            next.enable_partial_rollout = *v;
        }
        if let Some(v) = tail_batch_candidate_steps {
            next.tail_batch_candidate_steps = *v;
        }
        if let Some(v) = tail_batch_trigger_size {
            next.tail_batch_trigger_size = if *v == 0 { default_trigger_size } else { *v };
        }
        if let Some(v) = weight_update_mode {
            next.weight_update_mode = *v;
        }
        if let Some(mix) = domain_mix {
            for (domain, w) in mix {
                next.domain_mix.insert(domain.clone(), *w);
            }
        }
        if let Some(v) = max_concurrent_rollouts {
            next.max_concurrent_rollouts = *v;
        }
        if let Some(v) = paused {
            next.paused = *v;
        }
        next.validate(known_domains)?;
        Ok(next)
    }
}

/// One knob that a patch changed, for logs and API replies.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct KnobChange {
    /// Knob name.
    pub knob: &'static str,
    /// Value before, as JSON.
    pub old: serde_json::Value,
    /// Value after, as JSON.
    pub new: serde_json::Value,
}

/// Lists the knobs whose values differ between two snapshots.
pub fn diff(old: &Knobs, new: &Knobs) -> Vec<KnobChange> {
    let (old_v, new_v) = (
        serde_json::to_value(old).unwrap_or_default(),
        serde_json::to_value(new).unwrap_or_default(),
    );
    knob_names()
        .iter()
        .filter_map(|&knob| {
            let (o, n) = (&old_v[knob], &new_v[knob]);
            (o != n).then(|| KnobChange {
                knob,
                old: o.clone(),
                new: n.clone(),
            })
        })
        .collect()
}

/// Shared, validated access to the live knobs. Cloning is shallow: clones see the same knobs.
#[derive(Debug, Clone)]
pub struct KnobsHandle {
    inner: Arc<KnobsShared>,
}

#[derive(Debug)]
struct KnobsShared {
    tx: watch::Sender<Knobs>,
    /// What a `tail_batch_trigger_size` of 0 resolves to: the global batch size in groups.
    default_trigger_size: u32,
    /// Domains the data config declares; `domain_mix` may only name these (empty: unchecked).
    known_domains: Vec<String>,
}

impl KnobsHandle {
    /// Shares `initial` after validating it.
    pub fn new(
        initial: Knobs,
        default_trigger_size: u32,
        known_domains: Vec<String>,
    ) -> Result<Self, KnobError> {
        initial.validate(&known_domains)?;
        let (tx, _rx) = watch::channel(initial);
        Ok(Self {
            inner: Arc::new(KnobsShared {
                tx,
                default_trigger_size: default_trigger_size.max(1),
                known_domains,
            }),
        })
    }

    /// A copy of the current knobs.
    pub fn current(&self) -> Knobs {
        self.inner.tx.borrow().clone()
    }

    /// A receiver that is notified of every change (for actors that must react, not just read).
    pub fn subscribe(&self) -> watch::Receiver<Knobs> {
        self.inner.tx.subscribe()
    }

    /// Applies `patch` atomically: validated against the current value under the channel's lock,
    /// so two concurrent patches cannot interleave. On error nothing changes. Every change is
    /// logged as `old → new`.
    pub fn update(&self, patch: &KnobPatch) -> Result<Vec<KnobChange>, KnobError> {
        let shared = &self.inner;
        let mut outcome = Ok(Vec::new());
        shared.tx.send_if_modified(|knobs| {
            match patch.apply(knobs, shared.default_trigger_size, &shared.known_domains) {
                Ok(next) => {
                    let changes = diff(knobs, &next);
                    let modified = !changes.is_empty();
                    *knobs = next;
                    outcome = Ok(changes);
                    modified
                }
                Err(e) => {
                    outcome = Err(e);
                    false
                }
            }
        });
        if let Ok(changes) = &outcome {
            for c in changes {
                tracing::info!(knob = c.knob, old = %c.old, new = %c.new, "knob changed");
            }
        }
        outcome
    }
}

#[cfg(test)]
mod tests;
