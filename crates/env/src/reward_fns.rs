//! Reward functions every task offers to a rubric from config, besides its own (`correct`,
//! `format`, …):
//!
//! | name | scores | value |
//! |---|---|---|
//! | `env` | one rollout | the sum of the env's per-turn rewards (0 when there are none) |
//! | `env.<name>` | one rollout | the env's named component `<name>`, summed over the episode (0 when absent) |
//! | `length` | the group | Kimi k1.5's length reward: `λ = 0.5 − (len − min)/(max − min)` over the group's scored rollouts (completion tokens); the group's best-scored rollouts get `λ`, the others `min(0, λ)`; 0 when all lengths are equal |

use crate::rubric::{ENV_COMPONENT_PREFIX, GroupMember, RewardFn};

/// Names of the generic functions (for error messages; `env.<name>` stands for any component).
pub const GENERIC_NAMES: &[&str] = &["env", "env.<name>", "length"];

/// The generic function called `name` with `weight`, if there is one.
pub fn generic(name: &str, weight: f64) -> Option<RewardFn> {
    match name {
        "env" => Some(RewardFn::env_reward(weight)),
        "length" => Some(RewardFn::group("length", weight, |m| Ok(length_reward(m)))),
        _ => {
            let component = name.strip_prefix(ENV_COMPONENT_PREFIX)?;
            if component.is_empty() {
                return None;
            }
            let key = name.to_owned();
            Some(RewardFn::inline(name, weight, move |input| {
                input
                    .rollout
                    .reward_components
                    .get(&key)
                    .copied()
                    .unwrap_or(0.0)
            }))
        }
    }
}

/// Kimi k1.5's group length reward (see the module table). Members without a score get 0.
pub fn length_reward(members: &[GroupMember]) -> Vec<f64> {
    let len = |m: &GroupMember| m.input.rollout.completion_tokens() as f64;
    let scored: Vec<&GroupMember> = members.iter().filter(|m| m.score.is_some()).collect();
    let (min, max) = scored
        .iter()
        .fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), m| {
            (lo.min(len(m)), hi.max(len(m)))
        });
    let best = scored
        .iter()
        .filter_map(|m| m.score)
        .fold(f64::NEG_INFINITY, f64::max);
    members
        .iter()
        .map(|m| match m.score {
            Some(score) if max > min => {
                let lambda = 0.5 - (len(m) - min) / (max - min);
                if score >= best {
                    lambda
                } else {
                    lambda.min(0.0)
                }
            }
            _ => 0.0,
        })
        .collect()
}
