//! DAPO's soft overlong punishment: a reply that runs into the last `buffer` tokens of its turn
//! budget loses reward in proportion to how far in it went, and one cut at the budget loses the
//! whole `penalty`, so the policy learns to finish before the limit from a signal that grows
//! smoothly instead of from the cliff between a finished reply and a truncated one.
//!
//! With budget `L` (the turn's `max_new_tokens`), buffer `B` and a reply of `y` tokens:
//! `0` for `y ≤ L − B`, else `−penalty · (y − (L − B)) / B` (`−penalty` at `y = L`). A rollout of
//! several turns is judged by its longest reply (the budget is per turn). The penalty is added to
//! the reward the rubric gave and recorded as the reward component [`COMPONENT`]; failed rollouts
//! keep the reward their failure gave.

use sluice_core::{Rollout, RolloutStatus, RolloutTurn};

/// The reward component the penalty is recorded under (0 for a reply outside the buffer).
pub const COMPONENT: &str = "overlong";

/// `rollout.overlong_buffer_tokens` and `rollout.overlong_penalty`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct OverlongShaping {
    /// `B`: the last tokens of a turn budget that cost reward (≥ 1, below every budget).
    pub buffer_tokens: u32,
    /// What a reply cut at the budget loses (≥ 0).
    pub penalty: f64,
}

impl OverlongShaping {
    /// The shaping of the config's two keys; `None` when the buffer is 0 (off).
    pub fn new(buffer_tokens: u32, penalty: f64) -> Option<Self> {
        (buffer_tokens > 0).then_some(Self {
            buffer_tokens,
            penalty,
        })
    }

    /// The (non-positive) reward change of a reply of `reply_tokens` under a turn budget of
    /// `budget` tokens.
    pub fn penalty(&self, reply_tokens: usize, budget: u32) -> f64 {
        let buffer = f64::from(self.buffer_tokens.min(budget).max(1));
        let free = f64::from(budget) - buffer;
        let over = (reply_tokens as f64 - free).min(buffer);
        if over > 0.0 {
            -self.penalty * over / buffer
        } else {
            0.0
        }
    }

    /// Adds the penalty of `rollout`'s longest reply to its reward and records it as the
    /// [`COMPONENT`] component; a rollout that did not finish (failed, aborted, expired) is left
    /// as it is. Returns the penalty applied.
    pub fn apply(&self, rollout: &mut Rollout, budget: u32) -> Option<f64> {
        if !matches!(
            rollout.status,
            RolloutStatus::Completed | RolloutStatus::Truncated
        ) {
            return None;
        }
        let longest = rollout
            .turns
            .iter()
            .map(RolloutTurn::completion_tokens)
            .max()
            .unwrap_or(0);
        let penalty = self.penalty(longest, budget);
        rollout.reward += penalty;
        rollout
            .reward_components
            .insert(COMPONENT.to_owned(), penalty);
        Some(penalty)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use sluice_core::{GroupId, NodeId, RolloutId, RunId};

    fn rollout(replies: &[usize], status: RolloutStatus, reward: f64) -> Rollout {
        let id = GroupId {
            run: RunId::from_name("t"),
            node: NodeId(0),
            counter: 0,
        };
        let mut r = Rollout::new(RolloutId {
            group: id,
            index: 0,
        });
        for &n in replies {
            let mut turn = RolloutTurn::new(vec![1, 2]);
            turn.completion_token_ids = vec![7; n];
            r.turns.push(turn);
        }
        r.status = status;
        r.reward = reward;
        r
    }

    #[test]
    fn the_penalty_grows_linearly_through_the_buffer() {
        let s = OverlongShaping::new(16, 1.0).unwrap();
        for (tokens, want) in [
            (0, 0.0),
            (48, 0.0),
            (52, -0.25),
            (56, -0.5),
            (64, -1.0),
            (90, -1.0),
        ] {
            assert_eq!(s.penalty(tokens, 64), want, "{tokens} tokens of 64");
        }
        assert_eq!(OverlongShaping::new(16, 0.5).unwrap().penalty(64, 64), -0.5);
        // A buffer larger than a (domain's) budget covers the whole budget.
        assert_eq!(s.penalty(4, 8), -0.5);
        assert_eq!(OverlongShaping::new(0, 1.0), None);
    }

    #[test]
    fn finished_rollouts_pay_for_their_longest_reply_and_failed_ones_do_not() {
        let s = OverlongShaping::new(16, 1.0).unwrap();
        let mut two_turns = rollout(&[10, 60], RolloutStatus::Completed, 1.0);
        assert_eq!(s.apply(&mut two_turns, 64), Some(-0.75));
        assert_eq!(two_turns.reward, 0.25);
        assert_eq!(two_turns.reward_components[COMPONENT], -0.75);
        let mut cut = rollout(&[64], RolloutStatus::Truncated, 0.0);
        assert_eq!(s.apply(&mut cut, 64), Some(-1.0));
        assert_eq!(cut.reward, -1.0);
        let mut short = rollout(&[20], RolloutStatus::Completed, 1.0);
        s.apply(&mut short, 64);
        assert_eq!(
            (short.reward, short.reward_components[COMPONENT]),
            (1.0, 0.0)
        );
        let mut failed = rollout(&[64], RolloutStatus::Error("env".into()), -1.0);
        assert_eq!(s.apply(&mut failed, 64), None);
        assert_eq!(failed.reward, -1.0);
        assert!(failed.reward_components.is_empty());
    }
}
