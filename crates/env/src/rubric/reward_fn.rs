//! [`RewardFn`]: one named, weighted reward function — inline, blocking, async or over a whole
//! group ([`GroupMember`]) — and how each kind runs under its guard and deadline.

use std::sync::Arc;
use std::time::Duration;

use super::ScoreInput;
use crate::error::EnvError;
use crate::guard::{run_blocking_guarded, run_guarded, run_inline_guarded};
use crate::protocol::BoxFuture;

type SyncScorer = Arc<dyn Fn(&ScoreInput) -> Result<f64, String> + Send + Sync>;
type AsyncScorer =
    Arc<dyn Fn(Arc<ScoreInput>) -> BoxFuture<'static, Result<f64, String>> + Send + Sync>;

type GroupScorer = Arc<dyn Fn(&[GroupMember]) -> Result<Vec<f64>, String> + Send + Sync>;

#[derive(Clone)]
enum Scorer {
    /// Cheap, cannot hang: run where the rollout is scored.
    Inline(SyncScorer),
    Sync(SyncScorer),
    Async(AsyncScorer),
    Group(GroupScorer),
}

/// One rollout as a group reward function sees it.
#[derive(Debug, Clone)]
pub struct GroupMember {
    /// The rollout and its sample.
    pub input: Arc<ScoreInput>,
    /// The weighted score of the per-rollout functions (their share of the reward), or `None`
    /// when the rollout is not scored by functions (failed, overridden, or its scoring failed):
    /// such a member's value is ignored.
    pub score: Option<f64>,
}

/// One named, weighted reward function.
#[derive(Clone)]
pub struct RewardFn {
    pub(super) name: String,
    pub(super) weight: f64,
    scorer: Scorer,
}

impl std::fmt::Debug for RewardFn {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RewardFn")
            .field("name", &self.name)
            .field("weight", &self.weight)
            .finish_non_exhaustive()
    }
}

impl RewardFn {
    /// A synchronous reward function (run on the blocking pool).
    pub fn new(
        name: impl Into<String>,
        weight: f64,
        f: impl Fn(&ScoreInput) -> f64 + Send + Sync + 'static,
    ) -> Self {
        Self::fallible(name, weight, move |input| Ok(f(input)))
    }

    /// A cheap synchronous reward function: a parse of the rollout's text or a lookup, which
    /// cannot hang. It runs where the rollout is scored, with panics contained, instead of on
    /// the blocking pool: a pool hand-off per function and rollout (two per rollout, 256
    /// rollouts a step) was most of the async runtime's work in the quickstart. Anything that
    /// may take long (a subprocess, a file, a network call) belongs in [`RewardFn::new`] or
    /// [`RewardFn::new_async`], which run under the rubric's deadline.
    pub fn inline(
        name: impl Into<String>,
        weight: f64,
        f: impl Fn(&ScoreInput) -> f64 + Send + Sync + 'static,
    ) -> Self {
        Self::inline_fallible(name, weight, move |input| Ok(f(input)))
    }

    /// A cheap synchronous reward function that may refuse (its error fails the rollout), run
    /// like [`RewardFn::inline`]: a text check that cannot hang but can find its sample lacking
    /// (no reference answer).
    pub fn inline_fallible(
        name: impl Into<String>,
        weight: f64,
        f: impl Fn(&ScoreInput) -> Result<f64, String> + Send + Sync + 'static,
    ) -> Self {
        Self {
            name: name.into(),
            weight,
            scorer: Scorer::Inline(Arc::new(f)),
        }
    }

    /// A synchronous reward function that may refuse (its error fails the rollout).
    pub fn fallible(
        name: impl Into<String>,
        weight: f64,
        f: impl Fn(&ScoreInput) -> Result<f64, String> + Send + Sync + 'static,
    ) -> Self {
        Self {
            name: name.into(),
            weight,
            scorer: Scorer::Sync(Arc::new(f)),
        }
    }

    /// An asynchronous reward function (an LLM judge, a sandbox call).
    pub fn new_async<F, Fut>(name: impl Into<String>, weight: f64, f: F) -> Self
    where
        F: Fn(Arc<ScoreInput>) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Result<f64, String>> + Send + 'static,
    {
        Self {
            name: name.into(),
            weight,
            scorer: Scorer::Async(Arc::new(move |input| Box::pin(f(input)))),
        }
    }

    /// A function of the whole group (seed 003's group scoring): it returns one value per member,
    /// in order, and runs after the per-rollout functions, whose scores it sees.
    pub fn group(
        name: impl Into<String>,
        weight: f64,
        f: impl Fn(&[GroupMember]) -> Result<Vec<f64>, String> + Send + Sync + 'static,
    ) -> Self {
        Self {
            name: name.into(),
            weight,
            scorer: Scorer::Group(Arc::new(f)),
        }
    }

    /// The same function with another weight (rubrics from config reweight a task's functions).
    pub fn with_weight(mut self, weight: f64) -> Self {
        self.weight = weight;
        self
    }

    /// Whether the function scores whole groups.
    pub fn is_group(&self) -> bool {
        matches!(self.scorer, Scorer::Group(_))
    }

    /// Counts the env's per-turn rewards (their sum, 0 when there are none) with `weight`.
    pub fn env_reward(weight: f64) -> Self {
        Self::inline("env", weight, |input| input.env_reward_sum().unwrap_or(0.0))
    }

    /// The function's name (its component key).
    pub fn name(&self) -> &str {
        &self.name
    }

    pub(super) async fn score(
        &self,
        input: Arc<ScoreInput>,
        timeout: Duration,
    ) -> Result<f64, EnvError> {
        let name = self.name.clone();
        let value = match &self.scorer {
            Scorer::Inline(f) => run_inline_guarded(|| {
                f(&input).map_err(|e| EnvError::Failed(format!("reward `{name}`: {e}")))
            })?,
            Scorer::Sync(f) => {
                let f = f.clone();
                let n = name.clone();
                run_blocking_guarded(&name, timeout, move || {
                    f(&input).map_err(|e| EnvError::Failed(format!("reward `{n}`: {e}")))
                })
                .await?
            }
            Scorer::Group(_) => {
                return Err(EnvError::Config(format!(
                    "reward `{name}` scores groups, not single rollouts"
                )));
            }
            Scorer::Async(f) => {
                let fut = f(input);
                let n = name.clone();
                run_guarded(&name, timeout, async move {
                    fut.await
                        .map_err(|e| EnvError::Failed(format!("reward `{n}`: {e}")))
                })
                .await?
            }
        };
        if value.is_finite() {
            Ok(value)
        } else {
            Err(EnvError::Failed(format!(
                "reward `{name}` returned {value}"
            )))
        }
    }
}

impl RewardFn {
    /// Runs a group function over `members` (on the blocking pool, under `timeout`); it must
    /// return one finite value per member.
    pub(super) async fn score_members(
        &self,
        members: Arc<Vec<GroupMember>>,
        timeout: Duration,
    ) -> Result<Vec<f64>, EnvError> {
        let Scorer::Group(f) = &self.scorer else {
            return Err(EnvError::Config(format!(
                "reward `{}` scores single rollouts, not groups",
                self.name
            )));
        };
        let (f, n) = (f.clone(), self.name.clone());
        let values = run_blocking_guarded(&self.name, timeout, move || {
            f(&members).map_err(|e| EnvError::Failed(format!("reward `{n}`: {e}")))
        })
        .await?;
        if let Some(bad) = values.iter().find(|v| !v.is_finite()) {
            return Err(EnvError::Failed(format!(
                "reward `{}` returned {bad}",
                self.name
            )));
        }
        Ok(values)
    }
}
