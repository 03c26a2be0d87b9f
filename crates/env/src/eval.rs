//! Evaluation: play a task on a fixed set of samples and summarize (mean reward, accuracy from the
//! `correct` component or a generic answer check, statuses). [`EvalReport::from_rollouts`] is the pure summary, for callers
//! that run episodes concurrently through their own engine plumbing; [`evaluate`] plays them one
//! after another with a [`Generate`] implementation.

use std::collections::BTreeMap;
use std::sync::Arc;

use sluice_core::{DataSample, GroupId, NodeId, Rollout, RunId};

use crate::episode::{Generate, run_episode};
use crate::error::EnvError;
use crate::renderer::Renderer;
use crate::reward_fns::ACCURACY_COMPONENTS;
use crate::rubric::Rubric;
use crate::task::Task;
use crate::token_env::TokenEnvLimits;

/// Summary of an evaluation.
#[derive(Debug, Clone, PartialEq)]
pub struct EvalReport {
    /// Episodes played.
    pub episodes: usize,
    /// Mean final reward.
    pub mean_reward: f64,
    /// Mean of the rubric's answer-checking component over all episodes (an episode without the
    /// component, such as a truncated one, counts as 0): `correct`, else the first of
    /// `math_answer`, `exact_match`, `regex` the rubric weights
    /// ([`crate::reward_fns::ACCURACY_COMPONENTS`]); a rubric with none of them (an env
    /// server's `env`, a verl reward function's score) is measured by its reward, as verl's
    /// validation score is. 0 without episodes.
    pub accuracy: f64,
    /// Episodes per final status label.
    pub statuses: BTreeMap<String, usize>,
}

/// What an evaluation scores a reply by.
#[derive(Debug, Clone, Copy)]
enum Measure {
    /// The rubric's answer-checking component.
    Component(&'static str),
    /// The reward, for a rubric that checks no answer.
    Reward,
}

/// The component of `rubric` that checks answers: `correct`, else the first of
/// [`ACCURACY_COMPONENTS`] it weights; else the reward.
fn measure(rubric: &Rubric) -> Measure {
    let weights = rubric.weights();
    ACCURACY_COMPONENTS
        .iter()
        .copied()
        .find(|c| weights.iter().any(|(name, _)| name == c))
        .map_or(Measure::Reward, Measure::Component)
}

/// One rollout's score: its answer-checking component (0 without it, e.g. truncated), or its
/// reward.
fn score(rollout: &Rollout, measure: Measure) -> f64 {
    match measure {
        Measure::Component(c) => rollout.reward_components.get(c).copied().unwrap_or(0.0),
        Measure::Reward => rollout.reward,
    }
}

/// pass@k and mean@k of k sampled replies per problem.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SampledScores {
    /// Replies per problem.
    pub k: u32,
    /// Mean over the problems of the best of their k scores: for a 0/1 `correct`, the share of
    /// problems with at least one correct reply.
    pub pass_at_k: f64,
    /// Mean score over every reply.
    pub mean_at_k: f64,
}

impl SampledScores {
    /// The scores of `rollouts`, which hold `k` replies of each problem one after another
    /// (problem i's at `i*k .. (i+1)*k`), each scored as [`EvalReport::accuracy`] scores them.
    /// `None` when `k` is 0 or the rollouts are not whole groups of k.
    pub fn from_rollouts(rubric: &Rubric, rollouts: &[Rollout], k: u32) -> Option<Self> {
        let component = measure(rubric);
        let per_problem = k as usize;
        if per_problem == 0 || rollouts.is_empty() || !rollouts.len().is_multiple_of(per_problem) {
            return None;
        }
        let problems = rollouts.chunks(per_problem);
        let n = problems.len() as f64;
        let pass = problems
            .map(|replies| {
                replies
                    .iter()
                    .map(|r| score(r, component))
                    .fold(0.0, f64::max)
            })
            .sum::<f64>()
            / n;
        let mean =
            rollouts.iter().map(|r| score(r, component)).sum::<f64>() / rollouts.len() as f64;
        Some(Self {
            k,
            pass_at_k: pass,
            mean_at_k: mean,
        })
    }
}

impl EvalReport {
    /// Summarizes rollouts scored by `rubric`.
    pub fn from_rollouts(rubric: &Rubric, rollouts: &[Rollout]) -> Self {
        let n = rollouts.len();
        let mut statuses = BTreeMap::new();
        for r in rollouts {
            *statuses.entry(r.status.as_label().to_owned()).or_insert(0) += 1;
        }
        let measure = measure(rubric);
        let mean = |f: &dyn Fn(&Rollout) -> f64| {
            if n == 0 {
                0.0
            } else {
                rollouts.iter().map(f).sum::<f64>() / n as f64
            }
        };
        Self {
            episodes: n,
            mean_reward: mean(&|r| r.reward),
            accuracy: mean(&|r| score(r, measure)),
            statuses,
        }
    }
}

/// Plays `task` once on each sample (in order) with `generator`, scores every episode with the
/// task's rubric, and summarizes. A generation failure stops the evaluation with that error.
pub async fn evaluate(
    task: &Task,
    samples: &[DataSample],
    renderer: Arc<dyn Renderer>,
    limits: &TokenEnvLimits,
    generator: &mut dyn Generate,
) -> Result<(EvalReport, Vec<Rollout>), EnvError> {
    let group = GroupId {
        run: RunId::from_name("eval"),
        node: NodeId(0),
        counter: 0,
    };
    let mut rollouts = Vec::with_capacity(samples.len());
    for (i, sample) in samples.iter().enumerate() {
        let mut rollout = Rollout::new(group.rollout(i as u32));
        match task.token_env(sample, renderer.clone(), limits.clone()) {
            Ok(mut env) => run_episode(&mut env, generator, &mut rollout).await?,
            Err(e) => rollout.status = sluice_core::RolloutStatus::Error(e.kind().to_owned()),
        }
        task.rubric()
            .score(sample, &rollout)
            .await
            .apply_to(&mut rollout);
        rollouts.push(rollout);
    }
    Ok((
        EvalReport::from_rollouts(task.rubric(), &rollouts),
        rollouts,
    ))
}
