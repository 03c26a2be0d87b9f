//! The NodeSupervisor: builds a node's pipeline from a [`Config`], supervises it, serves the admin
//! API and `/metrics`, and shuts it down in order.
//!
//! Restart policy, per actor (ractor's default would stop everything on any child exit):
//!
//! | actor | on failure |
//! |---|---|
//! | engine replica | rebuilt by the engine actor after an exponential backoff (`[supervision]`); its requests return aborted with their last partial; a watchdog fails a replica that holds requests without progress; past `engine_max_restarts` failures in a row, or with no replica for `engine_unavailable_timeout_s`, the engine gives up and the node stops the run with a checkpoint |
//! | env worker | a panicking env fails that rollout (`Error("env_panic")`); the worker lives on |
//! | trainer step | a failed (or panicked) step stops training; the run ends with a checkpoint instead of looping (a panicked trainer's state is not checkpointed) |
//! | groups | `no_progress_groups` untrainable groups in a row stop the run with a checkpoint |
//! | sampler, controller, replay, engine actor, trainer, env worker (the actor itself ends) | the node stops with an error; restarting the process recovers from the last checkpoint plus the replay store |
//!
//! The last row is deliberate: those actors hold the run's accounting, and the replay store on
//! disk is the one place it survives. Every actor is linked to the node's supervisor actor
//! ([`supervisor`]), whose supervision handler applies that row; [`Node::failure`] reports which
//! actor ended first.
//!
//! Checkpoints, restore at start and the graceful stop live in [`crate::supervise_node`].

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use sluice_core::config::{Config, ExpiredPolicy};
use sluice_core::metrics as m;
use sluice_core::{KnobsHandle, NodeId, RunId, TrainerBackend, WeightSnapshot, WeightUpdateMode};
use sluice_engine::SamplingParams;

use crate::admin::{self, AdminState, Server};
use crate::checkpoint::CheckpointDir;
use crate::controller::{ControllerConfig, ControllerHandle, Peers};
use crate::engine::{EngineHandle, EngineSupervision, ReplicaFactory};
use crate::env_faults::{EnvFaults, FaultyEnv, TimeoutEnv};
use crate::env_worker::{EnvPoolConfig, EnvPoolHandle, RolloutEnv};
use crate::events::RunEvents;
use crate::native::NativeSetup;
use crate::replay::{ReplayHandle, ReplayOptions, ReplayStatus};
use crate::run::RunEnd;
use crate::sampler::{SampleSource, SamplerHandle};
use crate::supervise_node::{self, Restored};
use crate::trainer::{StepFeed, TrainerHandle, TrainerOptions};
use crate::{ActorError, telemetry};

mod build;
mod supervisor;

use supervisor::NodeSupervisor;

pub use crate::handles::{NodeHandles, NodeStatus};

/// What a node is built with beyond the config. `Default` builds every backend from the config
/// (simulated, native or remote, per `engine.backend`).
#[derive(Default)]
pub struct NodeOptions {
    /// Replay database directory; `None` keeps the store in memory.
    pub replay_dir: Option<PathBuf>,
    /// Serve the admin API on `admin.listen`.
    pub serve_admin: bool,
    /// Install the Prometheus recorder and serve `/metrics` on `metrics.listen` (when enabled).
    pub serve_metrics: bool,
    /// Record trained group ids (tests).
    pub track_ids: bool,
    /// Inference backends (default: per `engine.backend`: `[engine.simulated]`, native
    /// replicas of the run's model, or `engine.remote_urls`).
    pub backend: Option<ReplicaFactory>,
    /// Trainer backend (default: `[trainer.simulated]`, or the candle trainer on the run's
    /// model).
    pub trainer: Option<Box<dyn TrainerBackend>>,
    /// Sample source (default: synthetic samples over the configured domains, or
    /// `data.datasets` for a real model).
    pub source: Option<Box<dyn SampleSource>>,
    /// Environment (default: the simulated task, or the registered tasks for a real model).
    pub env: Option<Arc<dyn RolloutEnv>>,
    /// The run's model, already loaded (default: loaded from the run's warm-started copy or
    /// `model.path` when a native or remote part is built).
    pub native: Option<Arc<NativeSetup>>,
    /// Where the trainer sends every completed step (the run monitor's feed).
    pub step_feed: Option<StepFeed>,
    /// Checkpoint directory. `None`: `<run.output_dir>/checkpoint` when the replay store is the
    /// config's own (`replay_dir == replay.path`, as `sluice run` sets it), else no checkpoints
    /// (tests that point the store elsewhere never touch the run's output dir).
    pub checkpoint_dir: Option<PathBuf>,
    /// A head's members and served weights, for its admin API ([`crate::cluster::Head`]).
    pub cluster: Option<Arc<crate::cluster::ClusterState>>,
}

/// A running node.
pub struct Node {
    /// Handles to every actor.
    pub handles: NodeHandles,
    sampler: SamplerHandle,
    env: EnvPoolHandle,
    joins: Vec<(&'static str, tokio::task::JoinHandle<()>)>,
    /// Every actor above is linked to it (see [`supervisor`]).
    supervisor: Option<NodeSupervisor>,
    admin: Option<Server>,
    metrics: Option<Server>,
    telemetry: Option<tokio::task::JoinHandle<()>>,
    /// Periodic checkpoints (`supervision.checkpoint_every_steps`).
    checkpointer: Option<tokio::task::JoinHandle<()>>,
    /// The weights the engine started on (the trainer's, after a restore).
    start_weights: WeightSnapshot,
    /// The run's steps when the node started (its checkpoint's; 0 for a fresh run).
    start_step: u64,
    pub(crate) shutdown_timeout: Duration,
}

impl Node {
    /// Builds and starts the pipeline. Nothing is generated until every actor is up.
    pub async fn start(config: &Config, options: NodeOptions) -> Result<Self, ActorError> {
        let started = Instant::now();
        let NodeOptions {
            replay_dir,
            serve_admin,
            serve_metrics,
            track_ids,
            backend,
            trainer,
            source,
            env,
            native,
            step_feed,
            checkpoint_dir,
            cluster,
        } = options;
        let build::Backends {
            factory,
            trainer,
            source,
            env,
        } = build::backends(
            config,
            build::Given {
                factory: backend,
                trainer,
                source,
                env,
                native,
            },
        )?;
        // `domain_mix` may name only domains the source serves: a weight on any other domain
        // would leave nothing to draw and stall the run without a word.
        let served = match source.domains() {
            d if d.is_empty() => config.data.domains(),
            d => d,
        };
        let knobs = KnobsHandle::new(
            config.rollout.knobs.clone(),
            config.rollout.groups_per_step.get(),
            served,
        )
        .map_err(|e| ActorError::Setup(format!("rollout knobs: {e}")))?;
        let checkpoint_dir = checkpoint_dir
            .or_else(|| {
                (replay_dir.as_ref() == Some(&config.replay.path)).then(|| {
                    config
                        .run
                        .output_dir
                        .join(crate::checkpoint::CHECKPOINT_DIR)
                })
            })
            .map(CheckpointDir::new);
        // The trainer and its checkpoint come first: a bad checkpoint stops the start before
        // any actor runs.
        let Restored {
            trainer: backend_trainer,
            manifest,
        } = supervise_node::restore(trainer, checkpoint_dir.as_ref(), &config.faults)?;
        let prom = if serve_metrics {
            telemetry::install()
        } else {
            None
        };
        let b = config.rollout.groups_per_step.get();
        let controller_config = ControllerConfig {
            run: RunId::from_name(&config.run.name),
            node: NodeId(0),
            group_size: config.rollout.group_size.get(),
            groups_per_step: b,
            no_progress_groups: config.supervision.no_progress_groups,
            sampling: SamplingParams {
                temperature: config.rollout.temperature,
                top_p: config.rollout.top_p,
                top_k: config.rollout.top_k,
                max_tokens: config.rollout.max_new_tokens.get(),
                seed: None,
                stop_token_ids: Vec::new(),
            },
            balance_threshold: config.rollout.balance_threshold,
            domain_turn_tokens: config.data.turn_token_overrides(),
        };
        let events = RunEvents::default();
        let supervisor = NodeSupervisor::start(events.clone()).await?;
        let mut joins = Vec::new();
        let (controller, j) =
            ControllerHandle::spawn(controller_config, knobs.clone(), events.clone()).await?;
        supervisor.adopt("controller", controller.cell());
        joins.push(("controller", j));
        let replay_options = ReplayOptions {
            dir: replay_dir,
            drop_expired: config.replay.expired == ExpiredPolicy::Drop,
            filter_zero_advantage: config.replay.filter_zero_advantage,
        };
        let (replay, mut recovery, j) =
            match ReplayHandle::spawn(replay_options, controller.replay_sink()).await {
                Ok(r) => r,
                Err(e) => {
                    controller.stop().await;
                    return Err(e);
                }
            };
        supervisor.adopt("replay", replay.cell());
        joins.push(("replay", j));
        // Versions never go backwards: the run continues from the newer of the replay store's
        // and the trainer's.
        let backend_trainer =
            match supervise_node::align_version(backend_trainer, recovery.policy_version) {
                Ok(t) => t,
                Err(e) => {
                    replay.stop().await;
                    controller.stop().await;
                    return Err(e);
                }
            };
        let version = backend_trainer.version().max(recovery.policy_version);
        recovery.policy_version = version;
        // The engine generates with the trainer's weights from the first request on: a factory
        // builds replicas from the model it was configured with, which a resumed run has
        // trained past (tokens of the old weights, tagged old, would all expire at once).
        let start_weights = backend_trainer.snapshot();
        let factory = telemetry::carry_token_counts(factory, config.engine.replicas.get() as usize);
        let (engine, j) = EngineHandle::spawn_supervised(
            config.engine.replicas.get(),
            version,
            factory,
            controller.engine_sink(),
            EngineSupervision {
                events: events.clone(),
                ..EngineSupervision::from_config(&config.supervision, &config.faults)
            },
        )
        .await?;
        supervisor.adopt("engine", engine.cell());
        joins.push(("engine", j));
        engine.update_weights(start_weights.clone(), WeightUpdateMode::AbortResume);
        let mut env_impl: Arc<dyn RolloutEnv> = env;
        let env_faults = EnvFaults::from_config(&config.faults);
        if env_faults.any() {
            env_impl = Arc::new(FaultyEnv::new(env_impl, env_faults));
        }
        let env_impl: Arc<dyn RolloutEnv> = Arc::new(TimeoutEnv::new(
            env_impl,
            config.supervision.env_step_timeout,
        ));
        let (env_pool, env_joins) = EnvPoolHandle::spawn(
            EnvPoolConfig::from_config(config),
            Arc::clone(&env_impl),
            controller.env_sink(),
            &knobs,
        )
        .await?;
        for cell in env_pool.cells() {
            supervisor.adopt("env", cell);
        }
        joins.extend(env_joins.into_iter().map(|j| ("env", j)));
        if prom.is_some() {
            let datasets: Vec<String> =
                config.data.datasets.iter().map(|d| d.to_string()).collect();
            telemetry::seed_node(
                config.engine.replicas.get() as usize,
                &source.domains(),
                &datasets,
            );
        }
        // A resumed run draws on from where the checkpoint left the sampler (cursor, RNG,
        // per-domain counts), so the adaptive mix and the data order carry over.
        let sampler_state = manifest.as_ref().and_then(|m| m.sampler.clone());
        let (sampler, j) = SamplerHandle::spawn_from(
            source,
            knobs.clone(),
            controller.sample_sink(),
            sampler_state,
        )
        .await?;
        supervisor.adopt("sampler", sampler.cell());
        joins.push(("sampler", j));
        let start_step = manifest.as_ref().map_or(0, |m| m.steps);
        let trainer_options = TrainerOptions {
            groups_per_step: b as usize,
            max_steps: config.run.max_steps.get(),
            start_step,
            start_trained_groups: manifest.as_ref().map_or(0, |m| m.trained_groups),
            track_ids,
            events: events.clone(),
            feed: step_feed,
            advantage: Some(sluice_trainer::NativeTrainerConfig::from_config(config).advantage),
        };
        let (trainer, j) = TrainerHandle::spawn(
            backend_trainer,
            replay.clone(),
            knobs.clone(),
            controller.step_sink(),
            trainer_options,
        )
        .await?;
        supervisor.adopt("trainer", trainer.cell());
        joins.push(("trainer", j));
        controller.connect(Peers {
            sampler: sampler.clone(),
            engine: engine.clone(),
            env: env_pool.clone(),
            replay: replay.clone(),
            recovery,
        });
        if let Some(m) = &manifest {
            metrics::gauge!(m::NODE_CHECKPOINT_VERSION).set(m.version as f64);
        }
        let handles = NodeHandles {
            knobs: knobs.clone(),
            controller,
            engine: engine.clone(),
            replay,
            trainer,
            sampler: sampler.clone(),
            events,
            started,
            checkpoint_dir,
            checkpointing: Arc::default(),
            last_checkpoint: Arc::new(std::sync::Mutex::new(manifest)),
            logged_steps: Arc::new(tokio::sync::watch::channel(None).0),
            evaluation: Arc::default(),
        };
        let checkpointer =
            supervise_node::spawn_periodic(&handles, config.supervision.checkpoint_every_steps);
        let admin = if serve_admin {
            let state = AdminState {
                node: handles.clone(),
                token: config.admin.token.clone(),
                cluster,
            };
            Some(Server::start(config.admin.listen, admin::router(state)).await?)
        } else {
            None
        };
        let metrics = match (&prom, config.metrics.enabled) {
            (Some(h), true) => {
                Some(Server::start(config.metrics.listen, admin::metrics_router(h.clone())).await?)
            }
            _ => None,
        };
        let telemetry = Some(tokio::spawn(telemetry::run(
            engine,
            knobs,
            prom,
            Duration::from_millis(250),
        )));
        Ok(Self {
            handles,
            sampler,
            env: env_pool,
            joins,
            supervisor: Some(supervisor),
            admin,
            metrics,
            telemetry,
            checkpointer,
            start_weights,
            start_step,
            shutdown_timeout: config.supervision.shutdown_timeout,
        })
    }

    /// The admin API's bound address.
    pub fn admin_addr(&self) -> Option<std::net::SocketAddr> {
        self.admin.as_ref().map(|s| s.addr)
    }

    /// The metrics endpoint's bound address.
    pub fn metrics_addr(&self) -> Option<std::net::SocketAddr> {
        self.metrics.as_ref().map(|s| s.addr)
    }

    /// Every actor's view.
    pub async fn status(&self) -> Result<NodeStatus, ActorError> {
        self.handles.status().await
    }

    /// The first actor that ended while the node was running, if any.
    pub fn failure(&self) -> Option<&'static str> {
        self.handles.events.ended()
    }

    /// The weights the engine started on: the trainer's, after a restore (a resumed run's
    /// first evaluation scores them).
    pub fn start_weights(&self) -> &WeightSnapshot {
        &self.start_weights
    }

    /// The run's steps when the node started: its checkpoint's, 0 for a fresh run (the
    /// trainer may be past it by the time anyone asks its status).
    pub fn start_step(&self) -> u64 {
        self.start_step
    }

    /// Marks the end of the run with a final checkpoint (when checkpoints are on) whose reason
    /// says how it ended (`done`, `target_reached`, `trainer_error`, `no_progress`,
    /// `engine_failure`): the same config resumes from it. A failed checkpoint is logged; the
    /// run's end stands.
    pub async fn finish(&self, end: &RunEnd) {
        let Some(reason) = end.checkpoint_reason() else {
            return;
        };
        if self.handles.checkpoint_dir.is_none() {
            return;
        }
        if let Err(e) = supervise_node::checkpoint(&self.handles, reason).await {
            tracing::error!(error = %e, reason, "final checkpoint failed");
        }
    }

    /// Waits until the run ends ([`RunEnd`]: the step budget used, a training step failed, no
    /// progress, the engine gave up, an actor ended) or `timeout` passes, and marks the end with
    /// [`Node::finish`]. It wakes on the actors' [`RunEvents`], reads the status and hands it to
    /// `progress`. A trainer that failed is returned as a status with its error (callers read
    /// it); the other failures as errors.
    pub async fn wait_done(
        &self,
        timeout: Duration,
        mut progress: impl FnMut(&NodeStatus),
    ) -> Result<NodeStatus, ActorError> {
        let deadline = tokio::time::Instant::now() + timeout;
        let mut events = self.handles.events.subscribe();
        loop {
            events.borrow_and_update();
            let status = self.status().await?;
            progress(&status);
            if let Some(end) = RunEnd::observe(&status, self.failure()) {
                self.finish(&end).await;
                return match end {
                    RunEnd::Done | RunEnd::TrainerFailed(_) => self.status().await,
                    failed => Err(failed.error().unwrap_or(ActorError::Gone { actor: "node" })),
                };
            }
            let timed_out = || ActorError::Setup(format!("run did not finish within {timeout:?}"));
            match tokio::time::timeout_at(deadline, events.changed()).await {
                Ok(Ok(())) => {}
                // Every sender is gone: nothing will announce again.
                Ok(Err(_)) => return Err(ActorError::Gone { actor: "node" }),
                Err(_) => return Err(timed_out()),
            }
        }
    }

    /// Graceful stop (SIGTERM/SIGINT, `DESIGN.md` §9): stops admitting, aborts every request in
    /// flight and stores its partial in the aborted bucket, writes a checkpoint, then shuts down,
    /// all within `supervision.shutdown_timeout_s` (past it, the steps left are skipped and the
    /// report says so). A restart with the same config resumes from there.
    pub async fn stop_gracefully(self) -> supervise_node::StopReport {
        let started = Instant::now();
        let mut report =
            supervise_node::drain_and_checkpoint(&self.handles, self.shutdown_timeout).await;
        report.final_replay = self.shutdown().await.map(|r| r.store);
        report.seconds = started.elapsed().as_secs_f64();
        report
    }

    /// Stops everything, upstream first so nothing new is produced: trainer, sampler,
    /// controller, engine, env workers, then the replay store (which commits what is queued).
    /// Returns the replay store's final state, as it is on disk.
    pub async fn shutdown(mut self) -> Option<ReplayStatus> {
        for t in [self.telemetry.take(), self.checkpointer.take()]
            .into_iter()
            .flatten()
        {
            t.abort();
            let _ = t.await;
        }
        for server in [self.admin.take(), self.metrics.take()]
            .into_iter()
            .flatten()
        {
            server.shutdown().await;
        }
        let h = &self.handles;
        h.trainer.stop().await;
        self.sampler.stop().await;
        h.controller.stop().await;
        h.engine.stop().await;
        self.env.stop().await;
        let last = h.replay.status().await.ok();
        h.replay.stop().await;
        for (_, j) in self.joins.drain(..) {
            let _ = j.await;
        }
        if let Some(s) = self.supervisor.take() {
            s.stop().await;
        }
        last
    }
}
