//! The controller's point-in-time view ([`ControllerStatus`], served at `/v1/status`) and how
//! the actor's state fills it.

use std::collections::BTreeMap;

use serde::Serialize;
use sluice_core::PolicyVersion;

use super::ControllerState;
use crate::replay::ReplayCounts;

/// A point-in-time view of the controller.
#[derive(Debug, Clone, Default, Serialize)]
pub struct ControllerStatus {
    /// Newest published version.
    pub version: PolicyVersion,
    /// Groups ever admitted.
    pub admitted_total: u64,
    /// Groups generating, being resumed, or being stored.
    pub in_flight: u64,
    /// Aborted groups waiting (not tail candidates).
    pub aborted_waiting: u64,
    /// Expired groups waiting for regeneration.
    pub expired_waiting: u64,
    /// Tail-batch candidates waiting.
    pub tail_candidates: u64,
    /// A tail round is running.
    pub tail_round: bool,
    /// A drain weight update is pending.
    pub draining: bool,
    /// Tail rounds started.
    pub tail_rounds: u64,
    /// Smallest number of candidates a tail round started with at its trigger (0 before the
    /// first round).
    pub tail_round_min_size: u64,
    /// Tail rounds started below the trigger size because only tail candidates could fill the
    /// batch the trainer waited for (η had closed admission).
    pub early_tail_rounds: u64,
    /// Fresh groups admitted while a tail round ran (must stay 0: no over-sending in the tail).
    pub admitted_during_tail: u64,
    /// Scheduling decisions taken.
    pub decisions: u64,
    /// Largest number of groups in flight seen.
    pub max_in_flight: u64,
    /// Replay counts last heard.
    pub replay: ReplayCounts,
    /// Rollouts of finished (not aborted) groups.
    pub finished_rollouts: u64,
    /// Sum of their final rewards (mean reward over an interval = Δsum / Δcount).
    pub reward_sum: f64,
    /// Those rollouts by final status label (`completed`, `truncated`, `error`, `timeout`, …).
    pub finished_by_status: BTreeMap<String, u64>,
    /// Measured trainer step and group times (demand-aware admission).
    pub pace: PaceStatus,
    /// Groups admitted and not yet trained (ready, in flight, waiting to resume).
    pub pending_groups: u64,
    /// Scheduling decisions in which demand held back a fresh admission that η allowed.
    pub demand_holds: u64,
    /// Scheduling decisions in which `replay.capacity` held back a fresh admission.
    pub capacity_holds: u64,
    /// Why the run makes no progress (too many untrainable groups in a row); the node stops it.
    pub no_progress: Option<String>,
    /// Recent groups against the balance threshold.
    pub balance: BalanceStatus,
    /// Each domain's rollouts: lengths, turns, truncation, finish reasons, group times.
    pub shape: BTreeMap<String, super::DomainShapeStatus>,
    /// Generated against trained response lengths, as of the last step (`None` before one).
    pub length_bias: Option<super::LengthBiasStatus>,
}

/// Outcome statistics (seed 001): how recent groups sit against the balance threshold.
#[derive(Debug, Clone, Copy, Default, Serialize)]
pub struct BalanceStatus {
    /// `rollout.balance_threshold`.
    pub threshold: f64,
    /// Fraction of recent groups whose mean reward is below it (too hard).
    pub below_ratio: f64,
    /// Fraction above it (too easy).
    pub above_ratio: f64,
    /// Moving average of outcome rewards (`None` before the first group).
    pub outcome_ema: Option<f64>,
}

/// The pace demand-aware admission decides with, as `/v1/status` shows it.
#[derive(Debug, Clone, Copy, Default, Serialize)]
pub struct PaceStatus {
    /// Moving average of a training step's compute time.
    pub train_step_seconds: Option<f64>,
    /// Moving average of a group's time from start to stored.
    pub group_seconds: Option<f64>,
    /// Groups worth keeping ahead of the trainer (one batch and the headroom until both times
    /// are measured).
    pub demand_groups: u64,
}
impl ControllerState {
    pub(super) fn snapshot(&self) -> ControllerStatus {
        let b = self.config.groups_per_step;
        let stats = self.scheduler.stats();
        ControllerStatus {
            pace: PaceStatus {
                train_step_seconds: self.pace.train_step_seconds,
                group_seconds: self.pace.group_seconds,
                demand_groups: self.pace.demand(b),
            },
            pending_groups: self.pending(),
            version: self.version,
            admitted_total: self.admitted_total,
            in_flight: self.in_flight(),
            aborted_waiting: self.counts.waiting.aborted,
            expired_waiting: self.counts.waiting.expired,
            tail_candidates: self.counts.waiting.tail,
            tail_round: self.scheduler.tail_active(),
            tail_rounds: stats.tail_rounds,
            tail_round_min_size: stats.tail_round_min_size,
            early_tail_rounds: stats.early_tail_rounds,
            decisions: stats.decisions,
            demand_holds: stats.demand_holds,
            capacity_holds: stats.capacity_holds,
            draining: self.draining,
            replay: self.counts,
            shape: self.shape.status(),
            length_bias: self.shape.length_bias(),
            balance: {
                let (below_ratio, above_ratio) = self.outcomes.balance();
                BalanceStatus {
                    threshold: self.config.balance_threshold,
                    below_ratio,
                    above_ratio,
                    outcome_ema: self.outcomes.ema_reward(),
                }
            },
            ..self.status.clone()
        }
    }
}
