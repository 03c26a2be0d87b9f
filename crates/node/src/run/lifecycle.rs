//! A run's lifecycle, the same for every backend, in four calls: [`prepare`] readies the run
//! (its output dir; for a real model the model, data, warm-start and the baseline
//! evaluation), [`PreparedRun::start`] starts the node (a head's cluster first) with its run
//! monitor and log, [`Run::watch`] follows it until it ends or a stop is asked for, and
//! [`Run::finish`] marks the end (a final checkpoint, or the graceful stop), shuts the node
//! down, logs the steps left and draws the plot. What is said to the operator, and how, is the
//! caller's (`sluice run`): each call returns what there is to say.

use std::future::Future;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::future::BoxFuture;
use sluice_config::{Config, EngineBackend, NodeRole};
use sluice_report::{
    METRICS_FILE, MetricsLog, PLOT_FILE, ReportError, TENSORBOARD_DIR, plot_run, read_log,
};

use super::end::already_ended;
use super::lock::{LockError, RunLock};
use super::target_model;
use super::{Evaluations, NativeRun, Progress, RunEnd, RunMonitor, RunSummary, Scores, Start};
use crate::cluster::Head;
use crate::graceful_stop::StopReport;
use crate::native::WarmupProgress;
use crate::{Node, NodeOptions, NodeStatus};
use sluice_actors::ActorError;
use sluice_actors::trainer::STEP_FEED_CAPACITY;

/// What can stop a run's lifecycle, with where.
#[derive(Debug, thiserror::Error)]
pub enum RunError {
    /// The node, the model or an evaluation failed.
    #[error(transparent)]
    Actor(#[from] ActorError),
    /// The run's log or plot could not be read or written.
    #[error(transparent)]
    Report(#[from] ReportError),
    /// The run's output directory could not be created.
    #[error("creating {}: {source}", path.display())]
    OutputDir {
        /// `run.output_dir`.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
    /// A resumed real-model run's trainer holds no model weights to evaluate.
    #[error("the restored trainer has no weights to evaluate")]
    NoStartWeights,
    /// Another run holds the output directory, or its lock file could not be written.
    #[error(transparent)]
    Locked(#[from] LockError),
    /// The graceful stop did not finish within `supervision.shutdown_timeout_s` and a margin.
    #[error("the graceful stop did not finish within {0:?}")]
    StopTimedOut(Duration),
}

/// A run ready to start: see [`prepare`].
pub struct PreparedRun {
    /// A real model's preparation (`None`: a simulated run).
    pub native: Option<NativeRun>,
    /// A fresh real-model run's held-out baseline, measured before RL (a resumed run's is
    /// measured on the restored weights once the node is up: [`Run::resumed_scores`]).
    pub baseline: Option<Scores>,
    /// The run's wall time counts from here (model creation, warm-up and the first evaluation
    /// included).
    started: Instant,
    /// The output directory's lock, held until the run's process ends.
    lock: Option<RunLock>,
    /// Why the run has nothing left to do (its checkpoint says it ended), if so.
    ended: Option<String>,
}

/// Readies the run of `config`: its output directory, and for a real model (`native`,
/// `remote`) the model (created when absent), the data, the warm-start on a fresh run
/// (`on_warmup` hears each warm-up step) and the held-out baseline.
pub async fn prepare(
    config: &Config,
    on_warmup: impl FnMut(&WarmupProgress) + Send,
) -> Result<PreparedRun, RunError> {
    let started = Instant::now();
    // Before the data loads: what it counts (bad dataset lines) is exported from the start.
    if config.metrics.enabled {
        crate::telemetry::install();
    }
    let out = &config.run.output_dir;
    std::fs::create_dir_all(out).map_err(|source| RunError::OutputDir {
        path: out.clone(),
        source,
    })?;
    // Before anything is written there: a second run stops here.
    let lock = RunLock::take(out)?;
    let mut native = match config.engine.backend {
        EngineBackend::Simulated => None,
        EngineBackend::Native | EngineBackend::Remote => {
            Some(NativeRun::prepare(config, on_warmup).await?)
        }
    };
    let ended = native
        .as_ref()
        .and_then(|n| n.resumed.as_ref())
        .and_then(|(root, m)| already_ended(config, root, m));
    if ended.is_some() {
        return Ok(PreparedRun {
            native,
            baseline: None,
            started,
            lock,
            ended,
        });
    }
    let baseline = match &mut native {
        Some(n) if n.resumed.is_none() => Some(
            n.evaluations
                .run_alone(Arc::clone(&n.setup.weights))
                .await?,
        ),
        _ => None,
    };
    Ok(PreparedRun {
        native,
        baseline,
        started,
        lock,
        ended: None,
    })
}

/// A running run: its node, the monitor that follows it, and what it started from.
pub struct Run {
    node: Node,
    /// A head's side of the cluster, stopped after the node.
    head: Option<Head>,
    monitor: RunMonitor,
    log_path: PathBuf,
    plot_path: PathBuf,
    evaluating: bool,
    /// The held-out scores the run started from (the baseline, or the resumed weights').
    start_scores: Option<Scores>,
    /// Measured on the restored weights after the node started (a resumed real-model run).
    resumed_scores: bool,
    shutdown_timeout: Duration,
    /// The run's model directory (`model.path`): the tokenizer and template files of the
    /// weights written at the target.
    model_dir: PathBuf,
    /// `run.output_dir`.
    out: PathBuf,
    /// The output directory's lock ([`RunLock`]), let go with the run.
    _lock: Option<RunLock>,
}

impl PreparedRun {
    /// Why the run has nothing left to do, when its checkpoint says it ended (it trained its
    /// `run.max_steps`, or reached a target the config does not raise): then it is not started.
    pub fn ended(&self) -> Option<&str> {
        self.ended.as_deref()
    }

    /// Starts the node of `config` on what was prepared — a head's cluster first, its engine
    /// replicas and env episodes on the nodes that join it — with the run monitor logging to
    /// `metrics.jsonl` (resumed at the checkpoint's step), and evaluates a resumed run's
    /// restored weights. Boxed (see [`crate::node`]).
    pub fn start(self, config: &Config) -> BoxFuture<'_, Result<Run, RunError>> {
        Box::pin(async move {
            let Self {
                native,
                baseline,
                started,
                lock,
                ended: _,
            } = self;
            let (feed, steps) = tokio::sync::mpsc::channel(STEP_FEED_CAPACITY);
            let (setup, source, evaluations, resumed) = match native {
                Some(n) => (
                    Some(n.setup),
                    Some(n.source),
                    Some(n.evaluations),
                    n.resumed,
                ),
                None => (None, None, None, None),
            };
            let (head, head_factory, head_env) =
                match (&setup, config.node.as_ref().map(|n| n.role)) {
                    (Some(setup), Some(NodeRole::Head)) => {
                        let (head, factory) = Head::start(config, setup)?;
                        let env = head.rollout_env(config, setup)?.map(|e| Arc::new(e) as _);
                        (Some(head), Some(factory), env)
                    }
                    _ => (None, None, None),
                };
            let options = NodeOptions {
                replay_dir: Some(config.replay.path.clone()),
                serve_admin: true,
                serve_metrics: config.metrics.enabled,
                backend: head_factory,
                cluster: head.as_ref().map(Head::state),
                env: head_env,
                native: setup,
                source: source.map(|s| Box::new(s) as _),
                step_feed: Some(feed),
                // Read and summed by the preparation: not summed again.
                resumed,
                ..NodeOptions::default()
            };
            let node = match Node::start(config, options).await {
                Ok(node) => node,
                Err(e) => {
                    if let Some(head) = head {
                        head.stop().await;
                    }
                    return Err(e.into());
                }
            };
            let out = &config.run.output_dir;
            let log_path = out.join(METRICS_FILE);
            // The steps after the checkpoint are trained again: their old records go (a failure
            // here stops the node it started: nothing is left running).
            let first_step = node.start_step();
            let log = match open_log(config, first_step) {
                Ok(log) => log,
                Err(e) => {
                    node.shutdown().await;
                    if let Some(head) = head {
                        head.stop().await;
                    }
                    return Err(e.into());
                }
            };
            let start = Start {
                step: first_step,
                wall_s: log.last().map_or(0.0, |r| r.wall_s),
                accuracy: baseline.as_ref().map(Scores::pair).unwrap_or_default(),
                resumed: first_step > 0,
            };
            let evaluating = evaluations.is_some();
            let mut monitor =
                RunMonitor::new(config, started, start, steps, Some(log), evaluations);
            if let Some(a) = &baseline {
                monitor.start_scores(a);
            }
            let mut run = Run {
                node,
                head,
                monitor,
                log_path,
                plot_path: out.join(PLOT_FILE),
                evaluating,
                start_scores: baseline,
                resumed_scores: false,
                shutdown_timeout: config.supervision.shutdown_timeout,
                model_dir: config.model.path.clone(),
                out: out.clone(),
                _lock: lock,
            };
            if evaluating
                && run.start_scores.is_none()
                && let Err(e) = run.evaluate_resumed().await
            {
                run.shutdown().await;
                return Err(e);
            }
            Ok(run)
        })
    }
}

/// How [`Run::watch`] came back.
#[derive(Debug)]
pub enum Watched {
    /// The run ended ([`RunEnd`]), or the monitor failed (an evaluation, the log).
    Ended(Result<RunEnd, ActorError>),
    /// A stop was asked for (SIGINT, SIGTERM) before the run ended.
    StopAsked,
}

/// How the run ended, as [`Run::finish`] left it.
#[derive(Debug)]
pub enum Ending {
    /// The run ended and the node marked it (a final checkpoint when checkpoints are on).
    Ended(RunEnd),
    /// The run ended, but its final checkpoint failed (why): what it trained since the last
    /// checkpoint on disk is lost.
    FinalCheckpointFailed(RunEnd, String),
    /// The monitor failed; the run's state was checkpointed all the same.
    MonitorFailed(ActorError),
    /// A graceful stop: admission stopped, in-flight partials stored, a checkpoint written.
    Stopped(Box<StopReport>),
    /// A second stop request came during the graceful stop: the node was left without a
    /// checkpoint (the replay store keeps every acknowledged group either way).
    Abandoned,
}

/// What a finished run leaves to say.
pub struct Finished {
    /// How it ended.
    pub ending: Ending,
    /// The node's last status (the replay store's as it is on disk after a stop).
    pub status: Option<NodeStatus>,
    /// The run as its monitor saw it.
    pub summary: RunSummary,
    /// The held-out scores the run started from.
    pub start_scores: Option<Scores>,
    /// The run evaluated a real model.
    pub evaluating: bool,
    /// `metrics.jsonl`.
    pub log_path: PathBuf,
    /// `progress.png` (`None`: the run was abandoned before it was drawn).
    pub plot_path: Option<PathBuf>,
    /// The weights that met the held-out target, with their step ([`super::TARGET_MODEL_DIR`]);
    /// `None` when no evaluation met it or they could not be written (logged).
    pub target_model: Option<(PathBuf, u64)>,
}

impl Run {
    /// The running node.
    pub fn node(&self) -> &Node {
        &self.node
    }

    /// Stops the node, then a head's cluster side, without marking the end.
    async fn shutdown(self) {
        self.node.shutdown().await;
        if let Some(head) = self.head {
            head.stop().await;
        }
    }

    /// The held-out scores the run starts from.
    pub fn start_scores(&self) -> Option<&Scores> {
        self.start_scores.as_ref()
    }

    /// The start scores were measured on a resumed run's restored weights (after the node
    /// started), not before RL.
    pub fn resumed_scores(&self) -> bool {
        self.resumed_scores
    }

    /// The run's evaluations (a real model's run).
    pub fn evaluations(&mut self) -> Option<&mut Evaluations> {
        self.monitor.evaluations()
    }

    /// The run evaluates a real model on schedule.
    pub fn evaluating(&self) -> bool {
        self.evaluating
    }

    async fn evaluate_resumed(&mut self) -> Result<(), RunError> {
        let scores = self
            .monitor
            .evaluate_start(self.node.start_weights())
            .await?
            .ok_or(RunError::NoStartWeights)?;
        self.start_scores = Some(scores);
        self.resumed_scores = true;
        Ok(())
    }

    /// Follows the run until it ends or `stop` resolves, handing `progress` every look.
    pub async fn watch(
        &mut self,
        progress: impl FnMut(&Progress<'_>),
        stop: impl Future<Output = ()>,
    ) -> Watched {
        tokio::select! {
            r = self.monitor.watch(&self.node, progress) => Watched::Ended(r),
            () = stop => Watched::StopAsked,
        }
    }

    /// Marks the end and shuts the node down: a run that ended gets its final checkpoint; a
    /// failed monitor, a checkpoint of the state all the same; a stop request, the graceful
    /// stop (bounded by `supervision.shutdown_timeout_s`, abandoned when `again` resolves
    /// first). Then the steps trained while stopping are logged and the plot is drawn.
    pub async fn finish(
        self,
        watched: Watched,
        again: impl Future<Output = ()>,
    ) -> Result<Finished, RunError> {
        let Self {
            node,
            head,
            mut monitor,
            log_path,
            plot_path,
            evaluating,
            start_scores,
            resumed_scores: _,
            shutdown_timeout,
            model_dir,
            out,
            // Held to the end of the run: the plot below still writes into the directory.
            _lock: _held,
        } = self;
        let mut status = node.status().await.ok();
        let mut target_model = None;
        let ending = match watched {
            Watched::Ended(Ok(end)) => {
                let failed = node.finish(&end).await;
                node.shutdown().await;
                if let (RunEnd::TargetReached { step, .. }, Some(w)) =
                    (&end, monitor.target_weights())
                {
                    match target_model::write(w, &model_dir, &out).await {
                        Ok(dir) => target_model = Some((dir, *step)),
                        Err(e) => {
                            tracing::error!(error = %e, "writing the weights that met the target failed")
                        }
                    }
                }
                match failed {
                    Some(e) => Ending::FinalCheckpointFailed(end, e.to_string()),
                    None => Ending::Ended(end),
                }
            }
            Watched::Ended(Err(e)) => {
                if let Err(c) = node.handles.checkpoint().await {
                    tracing::error!(error = %c, "final checkpoint failed");
                }
                node.shutdown().await;
                Ending::MonitorFailed(e)
            }
            Watched::StopAsked => match graceful_stop(node, shutdown_timeout, again).await? {
                Some(report) => {
                    if let (Some(s), Some(replay)) = (&mut status, report.final_replay.clone()) {
                        s.replay = replay;
                    }
                    Ending::Stopped(Box::new(report))
                }
                None => Ending::Abandoned,
            },
        };
        if let Some(head) = head {
            head.stop().await;
        }
        let mut finished = Finished {
            summary: monitor.summary(),
            ending,
            status,
            start_scores,
            evaluating,
            log_path,
            plot_path: None,
            target_model,
        };
        // Steps trained while stopping are in the checkpoint: log them too. Abandoned as well:
        // a periodic checkpoint may have taken steps the log has not (checkpoints stop waiting
        // for the log once the stop begins), and the resume would never log them.
        monitor.record_remaining()?;
        if matches!(finished.ending, Ending::Abandoned) {
            finished.summary = monitor.summary();
            return Ok(finished);
        }
        finished.summary = monitor.summary();
        plot_run(&read_log(&finished.log_path)?, &plot_path)?;
        finished.plot_path = Some(plot_path);
        Ok(finished)
    }
}

/// The graceful stop, bounded by the shutdown timeout and a margin; `None` when `again`
/// resolved first.
async fn graceful_stop(
    node: Node,
    shutdown_timeout: Duration,
    again: impl Future<Output = ()>,
) -> Result<Option<StopReport>, RunError> {
    let bound = shutdown_timeout + Duration::from_secs(5);
    tokio::select! {
        r = tokio::time::timeout(bound, node.stop_gracefully()) => match r {
            Ok(report) => Ok(Some(report)),
            Err(_) => Err(RunError::StopTimedOut(bound)),
        },
        () = again => Ok(None),
    }
}

/// The run's metrics log, its records after the checkpoint of `first_step` dropped (they are
/// trained again), also written as TensorBoard events when `[metrics] tensorboard` asks.
fn open_log(config: &Config, first_step: u64) -> Result<MetricsLog, ReportError> {
    let out = &config.run.output_dir;
    let log = MetricsLog::resume(out.join(METRICS_FILE), first_step)?;
    if log.dropped() > 0 {
        tracing::warn!(
            dropped = log.dropped(),
            after_step = first_step,
            "{}: the records after step {first_step} were dropped: those steps are trained again from the restored weights",
            out.join(METRICS_FILE).display()
        );
    }
    if config.metrics.tensorboard {
        log.with_tensorboard(out.join(TENSORBOARD_DIR))
    } else {
        Ok(log)
    }
}
