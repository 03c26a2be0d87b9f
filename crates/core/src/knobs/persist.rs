//! The runtime knobs across a restart: what a checkpoint carries of them ([`KnobState`]) and
//! which value a resume starts from ([`resume_knobs`]).
//!
//! The rule, per knob: a value the operator set at runtime (the live value differs from the
//! config's at the checkpoint) comes back on resume **unless the config's value was edited
//! since**; then the config's new value wins, as an operator who edits the file asks for.
//!
//! ```text
//! runtime == config_then              → the config's value now (nothing was tuned)
//! runtime != config_then == config_now → runtime (tuned, and the file is as it was)
//! runtime != config_then != config_now → config_now (the file was edited since)
//! ```
//!
//! Both snapshots are kept as JSON objects by knob name, so a checkpoint written before a knob
//! existed (or after one was removed) still reads: a knob missing from either is left to the
//! config.

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

use super::{KnobPatch, Knobs, knob_names};

/// The knobs a checkpoint carries.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct KnobState {
    /// The config's knob values of the run that wrote the checkpoint (the values a runtime
    /// change was made against).
    pub config: Map<String, Value>,
    /// The live knob values at the checkpoint.
    pub runtime: Map<String, Value>,
}

impl KnobState {
    /// The state of a run whose config says `config` and whose live knobs are `runtime`.
    pub fn new(config: &Knobs, runtime: &Knobs) -> Self {
        Self {
            config: object(config),
            runtime: object(runtime),
        }
    }
}

fn object(knobs: &Knobs) -> Map<String, Value> {
    match serde_json::to_value(knobs) {
        Ok(Value::Object(map)) => map,
        _ => Map::new(),
    }
}

/// What a resume decided for one knob that was tuned at runtime.
#[derive(Debug, Clone, PartialEq)]
pub enum KnobResumed {
    /// The runtime value comes back (the config's value is as it was).
    Runtime {
        /// The knob.
        knob: &'static str,
        /// Its value now.
        value: Value,
    },
    /// The config was edited since the knob was tuned: the config's value wins.
    Config {
        /// The knob.
        knob: &'static str,
        /// The runtime value left behind.
        runtime: Value,
        /// The config's value when the knob was tuned.
        then: Value,
        /// The config's value now, which wins.
        now: Value,
    },
}

impl std::fmt::Display for KnobResumed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Runtime { knob, value } => write!(
                f,
                "{knob} = {value}: the value set at runtime before the restart (the config's is unchanged)"
            ),
            Self::Config {
                knob,
                runtime,
                then,
                now,
            } => write!(
                f,
                "{knob} = {now}: the config's value, edited since ({then} → {now}), wins over the value {runtime} set at runtime before the restart"
            ),
        }
    }
}

/// The patch that brings `config_now` (the knobs of the config resumed with) to what the
/// resume starts from, and a decision per knob tuned at runtime (see the module docs).
pub fn resume_knobs(saved: &KnobState, config_now: &Knobs) -> (KnobPatch, Vec<KnobResumed>) {
    let now = object(config_now);
    let mut winners = Vec::new();
    let mut decisions = Vec::new();
    for &knob in knob_names() {
        let (Some(runtime), Some(then), Some(now)) = (
            saved.runtime.get(knob),
            saved.config.get(knob),
            now.get(knob),
        ) else {
            continue;
        };
        if runtime == then || runtime == now {
            continue;
        }
        if then == now {
            winners.push((knob.to_owned(), runtime.clone()));
            decisions.push(KnobResumed::Runtime {
                knob,
                value: runtime.clone(),
            });
        } else {
            decisions.push(KnobResumed::Config {
                knob,
                runtime: runtime.clone(),
                then: then.clone(),
                now: now.clone(),
            });
        }
    }
    // Each value read back alone: one that no longer parses (the knob's type changed since)
    // is left to the config, and the others still come back.
    let mut patch = KnobPatch::default();
    for (k, v) in winners {
        let one = Value::Object(Map::from_iter([(k, v)]));
        if let Ok(p) = serde_json::from_value::<KnobPatch>(one) {
            patch = merge(patch, p);
        }
    }
    (patch, decisions)
}

/// `a` with the fields `b` sets.
fn merge(a: KnobPatch, b: KnobPatch) -> KnobPatch {
    KnobPatch {
        staleness_threshold: b.staleness_threshold.or(a.staleness_threshold),
        max_version_lag: b.max_version_lag.or(a.max_version_lag),
        admission: b.admission.or(a.admission),
        enable_partial_rollout: b.enable_partial_rollout.or(a.enable_partial_rollout),
        tail_batch_candidate_steps: b
            .tail_batch_candidate_steps
            .or(a.tail_batch_candidate_steps),
        tail_batch_trigger_size: b.tail_batch_trigger_size.or(a.tail_batch_trigger_size),
        weight_update_mode: b.weight_update_mode.or(a.weight_update_mode),
        domain_mix: b.domain_mix.or(a.domain_mix),
        max_concurrent_rollouts: b.max_concurrent_rollouts.or(a.max_concurrent_rollouts),
        paused: b.paused.or(a.paused),
    }
}
