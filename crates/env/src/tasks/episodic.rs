//! `episodic`: a multi-step walk on the number line (seed 001's multi-turn env with action
//! parsing). The model starts at `start` and must stop exactly on `target`; every turn it writes
//! one action between `<|action_start|>` and `<|action_end|>`: `inc()`, `dec()` or `done()`. The
//! env replies with the new position and restates the target. The episode ends at `done()`
//! (outcome reward 1 on target, else 0) or after `max_steps` actions (reward 0). The outcome is
//! discounted backwards with `gamma` (step i of n gets `gamma^(n−1−i) · R`; [`EpisodeDiscount`]).
//!
//! Situation labels: `move`, `invalid` (no or unknown action; position unchanged), `done`,
//! `out_of_steps`.

use serde_json::json;
use sluice_core::{DataSample, Message};
use sluice_data::rng::Rng;

use crate::discount::EpisodeDiscount;
use crate::error::EnvError;
use crate::protocol::{BoxFuture, EnvInit, EnvStep, MessageEnv};
use crate::rubric::{RewardFn, Rubric, RubricConfig};
use crate::task::{DataGenerator, Task};
use crate::tasks::{draw, field};

/// Registered name.
pub const NAME: &str = "episodic";

/// Discount of the built-in task.
pub const DISCOUNT: EpisodeDiscount = EpisodeDiscount {
    gamma: 0.9,
    only_keep_outcome: false,
};

/// Opening tag of an action.
pub const ACTION_START: &str = "<|action_start|>";
/// Closing tag of an action.
pub const ACTION_END: &str = "<|action_end|>";

/// One action.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Action {
    /// Move +1.
    Inc,
    /// Move −1.
    Dec,
    /// Stop here.
    Done,
}

/// The last well-formed action in `text`.
pub fn parse_action(text: &str) -> Option<Action> {
    let (_, after) = text.rsplit_once(ACTION_START)?;
    let (body, _) = after.split_once(ACTION_END)?;
    match body.trim() {
        "inc()" => Some(Action::Inc),
        "dec()" => Some(Action::Dec),
        "done()" => Some(Action::Done),
        _ => None,
    }
}

/// Generates walks of the `train` / `eval` split.
#[derive(Debug, Clone, Copy, Default)]
pub struct Generator;

impl DataGenerator for Generator {
    fn generate(&self, split: &str, seed: u64, count: usize) -> Result<Vec<DataSample>, EnvError> {
        draw(NAME, split, seed, count, |rng: &mut Rng| {
            let start = rng.below(10) as i64;
            let target = rng.below(10) as i64;
            let max_steps = (start - target).abs() + 3;
            (
                format!("{start}->{target}"),
                json!({"start": start, "target": target, "max_steps": max_steps}),
            )
        })
    }
}

/// The env of one walk.
#[derive(Debug)]
pub struct WalkEnv {
    position: i64,
    target: i64,
    max_steps: i64,
    steps: i64,
}

impl WalkEnv {
    /// A walk from `start` to `target` with at most `max_steps` actions.
    pub fn new(start: i64, target: i64, max_steps: i64) -> Self {
        Self {
            position: start,
            target,
            max_steps,
            steps: 0,
        }
    }

    /// What the walker is told each turn: where it is and where to stop. The goal is restated
    /// with every position (as goal-conditioned envs do), so each decision reads one message.
    fn observation(&self) -> String {
        format!(
            "You are at {}. Stop exactly at {}.",
            self.position, self.target
        )
    }
}

impl MessageEnv for WalkEnv {
    fn init(&mut self) -> BoxFuture<'_, Result<EnvInit, EnvError>> {
        // The instructions first, the observation last: the first decision then reads the
        // position and target at the same distance as every later one.
        let prompt = format!(
            "Each turn write one action: \
             {ACTION_START}inc(){ACTION_END}, {ACTION_START}dec(){ACTION_END} or \
             {ACTION_START}done(){ACTION_END}. {}",
            self.observation()
        );
        Box::pin(async move {
            Ok(EnvInit {
                messages: vec![Message::user(prompt)],
                tools: Vec::new(),
            })
        })
    }

    fn step(&mut self, assistant: Message) -> BoxFuture<'_, Result<EnvStep, EnvError>> {
        Box::pin(async move {
            self.steps += 1;
            let action = assistant.content.as_deref().and_then(parse_action);
            let (reply, situation) = match action {
                Some(Action::Done) => {
                    let r = f64::from(u8::from(self.position == self.target));
                    return Ok(EnvStep::done().with_reward(r).with_situation("done"));
                }
                Some(Action::Inc) => {
                    self.position += 1;
                    (self.observation(), "move")
                }
                Some(Action::Dec) => {
                    self.position -= 1;
                    (self.observation(), "move")
                }
                None => (format!("Invalid action. {}", self.observation()), "invalid"),
            };
            if self.steps >= self.max_steps {
                return Ok(EnvStep::done()
                    .with_reward(0.0)
                    .with_situation("out_of_steps"));
            }
            Ok(EnvStep::reply(vec![Message::user(reply)]).with_situation(situation))
        })
    }
}

fn env(sample: &DataSample) -> Result<Box<dyn MessageEnv>, EnvError> {
    let start: i64 = field(sample, "start")?;
    let target: i64 = field(sample, "target")?;
    let max_steps: i64 = field(sample, "max_steps")?;
    if max_steps < 1 {
        return Err(EnvError::BadInput(format!(
            "sample `{}`: max_steps must be ≥ 1",
            sample.id
        )));
    }
    // Bounded so that no walk's position, nor the distance the reference walks, can overflow.
    for (name, v) in [
        ("start", start),
        ("target", target),
        ("max_steps", max_steps),
    ] {
        if v.unsigned_abs() > MAX_COORDINATE {
            return Err(EnvError::BadInput(format!(
                "sample `{}`: {name} must be within ±{MAX_COORDINATE} (2^53), got {v}",
                sample.id
            )));
        }
    }
    Ok(Box::new(WalkEnv::new(start, target, max_steps)))
}

/// Largest `|start|`, `|target|` and `max_steps` of a sample (2^53, the integers every JSON
/// reader keeps exactly): a position stays within ±2^54.
const MAX_COORDINATE: u64 = 1 << 53;

/// The reference walk: straight to the target, then `done()`.
fn reference(sample: &DataSample, turn: u32) -> Option<String> {
    let start: i64 = field(sample, "start").ok()?;
    let target: i64 = field(sample, "target").ok()?;
    let distance = target.checked_sub(start)?.unsigned_abs();
    let action = match u64::from(turn).cmp(&distance) {
        std::cmp::Ordering::Less if target > start => "inc()",
        std::cmp::Ordering::Less => "dec()",
        std::cmp::Ordering::Equal => "done()",
        std::cmp::Ordering::Greater => return None,
    };
    Some(format!("{ACTION_START}{action}{ACTION_END}"))
}

/// The task.
pub fn task() -> Task {
    // `correct` (weight 0: the reward is the env's outcome alone) says whether the walk stopped
    // on its target, so evaluations report an accuracy.
    let correct = RewardFn::new("correct", 0.0, |input| {
        let last = input.rollout.turns.last();
        let stopped = last.and_then(|t| t.situation.as_deref()) == Some("done");
        f64::from(u8::from(
            stopped && last.and_then(|t| t.env_reward) == Some(1.0),
        ))
    });
    let rubric = Rubric::new(
        vec![RewardFn::env_reward(1.0), correct],
        RubricConfig {
            truncation_reward: Some(0.0),
            error_reward: Some(0.0),
            ..RubricConfig::default()
        },
    )
    .expect("static rubric is valid");
    Task::new(NAME, env, rubric)
        .with_datasets(vec![
            "agent::episodic@train".parse().expect("valid spec"),
            "agent::episodic@eval".parse().expect("valid spec"),
        ])
        .with_generator(Generator)
        .with_discount(DISCOUNT)
        .with_reference(reference)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn actions_parse() {
        assert_eq!(
            parse_action("go <|action_start|>inc()<|action_end|>"),
            Some(Action::Inc)
        );
        assert_eq!(
            parse_action(
                "<|action_start|>inc()<|action_end|><|action_start|> done() <|action_end|>"
            ),
            Some(Action::Done)
        );
        assert_eq!(parse_action("<|action_start|>jump()<|action_end|>"), None);
        assert_eq!(parse_action("<|action_start|>inc()"), None);
        assert_eq!(parse_action("inc()"), None);
    }

    /// Coordinates whose walk could overflow are refused, naming the field; the reference walk
    /// of such a sample is none rather than a wrapped distance.
    #[test]
    fn coordinates_past_2_pow_53_are_refused() {
        let sample = |start: i64, target: i64, max_steps: i64| DataSample {
            id: "s".into(),
            domain: "games".into(),
            dataset: NAME.into(),
            input: json!({"start": start, "target": target, "max_steps": max_steps}),
            system_prompt: None,
        };
        let cases = [
            (sample(i64::MIN, i64::MAX, 5), "start must be within ±"),
            (sample(0, i64::MAX, 5), "target must be within ±"),
            (sample(0, 1, i64::MAX), "max_steps must be within ±"),
        ];
        for (s, expected) in cases {
            let err = env(&s).err().expect("refused").to_string();
            assert!(err.contains(expected), "{err}");
        }
        assert!(env(&sample(1 << 53, -(1 << 53), 1 << 53)).is_ok());
        assert_eq!(reference(&sample(i64::MIN, i64::MAX, 5), 0), None);
    }

    /// Every observation restates the target, so a turn's decision needs only its own message.
    #[tokio::test]
    async fn every_observation_restates_the_target() {
        let mut env = WalkEnv::new(3, 5, 4);
        let init = env.init().await.unwrap();
        let prompt = init.messages[0].content.clone().unwrap();
        assert!(
            prompt.ends_with(". You are at 3. Stop exactly at 5."),
            "{prompt}"
        );
        let act = |a: &str| Message::assistant(format!("{ACTION_START}{a}{ACTION_END}"));
        let step = env.step(act("inc()")).await.unwrap();
        assert_eq!(
            step.messages[0].content.as_deref(),
            Some("You are at 4. Stop exactly at 5.")
        );
        let step = env.step(Message::assistant("hmm")).await.unwrap();
        assert_eq!(step.situation.as_deref(), Some("invalid"));
        assert_eq!(
            step.messages[0].content.as_deref(),
            Some("Invalid action. You are at 4. Stop exactly at 5.")
        );
    }
}
