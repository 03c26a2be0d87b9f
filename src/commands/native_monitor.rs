//! The native run's monitor: logs every training step to `metrics.jsonl`, evaluates on schedule,
//! applies the stop rule (held-out target or `run.max_steps`) and draws the progress bar.
//!
//! Steps are numbered for the whole run, restarts included: a resumed run starts counting at its
//! checkpoint's step, its log was cut back to that step (the steps after it are trained again),
//! and wall time continues from the log's last record.

use std::collections::BTreeMap;
use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::bail;
use indicatif::{ProgressBar, ProgressStyle};
use sluice_actors::native::tap::{TapHandle, TappedStep, lock_tap};
use sluice_actors::{Node, NodeStatus};
use sluice_core::config::Config;
use sluice_core::metrics::TRAINER_LOSS_VALUE;
use sluice_core::{PolicyVersion, WeightSnapshot};
use sluice_report::{MetricsLog, StepRecord};

use super::run_native::Evaluations;

/// Weight of the newest step in the progress bar's reward average.
const REWARD_SMOOTHING: f64 = 0.1;

/// How often the monitor looks at the node.
const POLL: Duration = Duration::from_millis(200);

/// Where the monitored stretch of the run starts.
pub(super) struct Start {
    /// Steps the run had taken (the checkpoint's; 0 for a fresh run).
    pub step: u64,
    /// Wall time the run had used before this process (the log's last record).
    pub wall_s: f64,
    /// (held-out, training-probe) accuracy of the weights the stretch starts from.
    pub accuracy: (f64, f64),
    /// The stretch resumes a checkpoint.
    pub resumed: bool,
}

/// Watches the running node: logs steps, evaluates, draws the progress bar.
pub(super) struct Monitor {
    pub bar: ProgressBar,
    started: Instant,
    start: Start,
    every: u64,
    stop_at: Option<f64>,
    max_steps: u64,
    /// (held-out, training-probe) accuracy at the last evaluation, and the best held-out.
    last_accuracy: (f64, f64),
    best_accuracy: f64,
    /// Steps of the run so far (restarts included).
    steps: u64,
    reached_target_at: Option<(u64, f64)>,
    /// (finished rollouts, their reward sum) at the last poll and at the last record.
    finished: (u64, f64),
    reward: (u64, f64),
    tokens: (u64, Instant),
    tokens_per_s: f64,
    /// Mean reward of the rollouts finished since the previous record.
    reward_mean: f64,
    /// Its moving average over steps, for the progress bar.
    reward_smoothed: Option<f64>,
}

impl Monitor {
    pub(super) fn new(config: &Config, started: Instant, start: Start) -> Self {
        let bar = ProgressBar::new(config.run.max_steps.get());
        bar.set_style(
            ProgressStyle::with_template("{bar:30} step {pos}/{len} {msg}")
                .unwrap_or_else(|_| ProgressStyle::default_bar()),
        );
        bar.set_position(start.step);
        Self {
            bar,
            started,
            every: config.eval.every_steps,
            stop_at: config.eval.stop_at_accuracy,
            max_steps: config.run.max_steps.get(),
            last_accuracy: start.accuracy,
            best_accuracy: start.accuracy.0,
            steps: start.step,
            start,
            reached_target_at: None,
            finished: (0, 0.0),
            reward: (0, 0.0),
            tokens: (0, Instant::now()),
            tokens_per_s: 0.0,
            reward_mean: 0.0,
            reward_smoothed: None,
        }
    }

    /// Wall time of the whole run: this process's plus what the log had.
    fn wall(&self) -> f64 {
        self.start.wall_s + self.started.elapsed().as_secs_f64()
    }

    /// Until the step budget is spent, the target accuracy is reached, or the run fails.
    pub(super) async fn watch(
        &mut self,
        node: &Node,
        tap: &TapHandle,
        evaluations: &mut Evaluations,
        log: &mut MetricsLog,
    ) -> anyhow::Result<()> {
        if self.steps >= self.max_steps {
            return Ok(());
        }
        loop {
            let status = node.status().await?;
            self.rates(&status);
            let steps = lock_tap(tap).drain_steps();
            for s in steps {
                if self.record(&s, Some((tap, &mut *evaluations)), log).await? {
                    return Ok(());
                }
            }
            if let Some(e) = &status.engine_failure {
                bail!("inference engine unavailable: {e}");
            }
            if let Some(e) = &status.controller.no_progress {
                bail!("the run makes no progress: {e}");
            }
            if let Some(e) = &status.trainer.error {
                bail!("training failed: {e}");
            }
            if status.trainer.done {
                return Ok(());
            }
            if let Some(actor) = node.failure() {
                bail!("actor `{actor}` stopped unexpectedly");
            }
            tokio::time::sleep(POLL).await;
        }
    }

    /// Logs the steps trained since the last poll without evaluating them (after a stop: the
    /// checkpoint holds them, so the log must too).
    pub(super) async fn record_remaining(
        &mut self,
        tap: &TapHandle,
        log: &mut MetricsLog,
    ) -> anyhow::Result<()> {
        let steps = lock_tap(tap).drain_steps();
        for s in steps {
            self.record(&s, None, log).await?;
        }
        Ok(())
    }

    /// Logs one step, evaluating it when due; true when the held-out target is reached.
    async fn record(
        &mut self,
        s: &TappedStep,
        eval: Option<(&TapHandle, &mut Evaluations)>,
        log: &mut MetricsLog,
    ) -> anyhow::Result<bool> {
        self.steps += 1;
        // Rollouts finished since the previous record (a step with none keeps the mean).
        let ((n, sum), (n0, sum0)) = (self.finished, self.reward);
        if n > n0 {
            self.reward_mean = (sum - sum0) / (n - n0) as f64;
            self.reward = self.finished;
        }
        let due = self.every > 0 && self.steps.is_multiple_of(self.every);
        let last = self.steps >= self.max_steps;
        let accuracy = match eval {
            Some((tap, evaluations)) if due || last => {
                let latest = lock_tap(tap).latest();
                match latest {
                    Some(w) => self.evaluate(evaluations, &w).await?,
                    None => None,
                }
            }
            _ => None,
        };
        let smoothed = self.reward_smoothed.map_or(s.reward_mean, |r| {
            r + REWARD_SMOOTHING * (s.reward_mean - r)
        });
        self.reward_smoothed = Some(smoothed);
        let mut extra = BTreeMap::from([("trained_reward_mean".to_owned(), s.reward_mean)]);
        if let Some((_, train)) = accuracy {
            extra.insert("train_accuracy".to_owned(), train);
        }
        log.append(&StepRecord {
            step: self.steps,
            wall_s: self.wall(),
            phase: Some("rl".into()),
            reward_mean: self.reward_mean,
            eval_accuracy: accuracy.map(|a| a.0),
            version_lag_mean: s.version_lag_mean,
            tokens_per_s: Some(self.tokens_per_s),
            loss: s.metrics.get(TRAINER_LOSS_VALUE).copied(),
            policy_version: Some(PolicyVersion(s.version.0 + 1)),
            extra,
        })?;
        let line = format!(
            "| reward {smoothed:.2} | eval {:.1}% (train {:.1}%) | lag {:.2} | {:.0} tok/s",
            100.0 * self.last_accuracy.0,
            100.0 * self.last_accuracy.1,
            s.version_lag_mean,
            self.tokens_per_s
        );
        // Without a terminal (logs, CI) the bar is hidden: one line per evaluation.
        if self.bar.is_hidden() && accuracy.is_some() {
            println!(
                "step {}/{} {:.0}s {line}",
                self.steps,
                self.max_steps,
                self.wall()
            );
        }
        self.bar.set_position(self.steps);
        self.bar.set_message(line);
        if let (Some(target), Some((heldout, _))) = (self.stop_at, accuracy)
            && heldout >= target
        {
            let at = self.wall();
            self.reached_target_at.get_or_insert((self.steps, at));
            return Ok(true);
        }
        Ok(false)
    }

    fn rates(&mut self, status: &NodeStatus) {
        self.finished = (
            status.controller.finished_rollouts,
            status.controller.reward_sum,
        );
        let tokens: u64 = status.engines.iter().map(|e| e.generated_tokens).sum();
        let (t0, at) = self.tokens;
        let dt = at.elapsed().as_secs_f64();
        if dt >= 1.0 {
            self.tokens_per_s = tokens.saturating_sub(t0) as f64 / dt;
            self.tokens = (tokens, Instant::now());
        }
    }

    async fn evaluate(
        &mut self,
        evaluations: &mut Evaluations,
        weights: &WeightSnapshot,
    ) -> anyhow::Result<Option<(f64, f64)>> {
        let Some(w) = sluice_model::WeightSnapshot::from_envelope(weights) else {
            return Ok(None);
        };
        let accuracy = evaluations.run(w).await?;
        self.last_accuracy = accuracy;
        self.best_accuracy = self.best_accuracy.max(accuracy.0);
        Ok(Some(accuracy))
    }

    /// The end-of-run summary.
    pub(super) fn print_summary(&self, status: Option<&NodeStatus>, log: &Path, plot: &Path) {
        let from = if self.start.resumed {
            format!("(at step {}) ", self.start.step)
        } else {
            String::new()
        };
        println!("steps                 {}", self.steps);
        println!("wall time             {:.1} s", self.wall());
        println!(
            "held-out accuracy     {from}{:.1}% → {:.1}% (best {:.1}%)",
            100.0 * self.start.accuracy.0,
            100.0 * self.last_accuracy.0,
            100.0 * self.best_accuracy
        );
        println!(
            "training problems     {from}{:.1}% → {:.1}%",
            100.0 * self.start.accuracy.1,
            100.0 * self.last_accuracy.1
        );
        if let Some((step, at)) = self.reached_target_at {
            println!("target reached        at step {step}, {at:.1} s");
        }
        if let Some(s) = status {
            println!(
                "version lag           mean {:.3}, max {} (violations {})",
                s.trainer.mean_lag(),
                s.trainer.max_lag,
                s.trainer.lag_violations
            );
            println!("engine busy ratio     {:.3}", s.engine_busy_ratio());
        }
        println!("metrics               {}", log.display());
        println!("plot                  {}", plot.display());
    }
}
