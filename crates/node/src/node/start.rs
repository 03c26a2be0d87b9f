//! [`Node::start`]: what needs no actor first (the backends, the knobs, the trainer restored
//! from its checkpoint, so a bad checkpoint stops the start before any actor runs), then the
//! three stages of [`super::stages`], each unwound in reverse order if a later one fails.

use std::sync::Arc;
use std::time::Instant;

use futures::future::BoxFuture;
use sluice_config::Config;
use sluice_core::metrics as m;
use sluice_core::{KnobsHandle, TrainerBackend};

use super::core_stage::{Core, CoreInputs, CoreOutputs};
use super::feeds_stage::{Feeds, FeedsInputs};
use super::servers_stage::{Servers, ServersInputs};
use super::stages::{Stage, Started, fail_point};
use super::{Node, NodeHandles, NodeOptions, build};
use crate::checkpoints::{self, Restored};
use crate::cluster::ClusterState;
use crate::telemetry;
use sluice_actors::ActorError;
use sluice_actors::checkpoint::{CheckpointDir, Manifest};
use sluice_actors::engine::ReplicaFactory;
use sluice_actors::env_worker::RolloutEnv;
use sluice_actors::events::RunEvents;
use sluice_actors::sampler::SampleSource;
use sluice_actors::trainer::StepFeed;

/// Everything the stages start from, ready before any actor runs.
struct Prepared {
    knobs: KnobsHandle,
    factory: ReplicaFactory,
    trainer: Box<dyn TrainerBackend>,
    source: Box<dyn SampleSource>,
    env: Arc<dyn RolloutEnv>,
    manifest: Option<Manifest>,
    checkpoint_dir: Option<CheckpointDir>,
    replay_dir: Option<std::path::PathBuf>,
    /// What the caller asked for that the stages use as given.
    serve_admin: bool,
    serve_metrics: bool,
    track_ids: bool,
    step_feed: Option<StepFeed>,
    cluster: Option<Arc<ClusterState>>,
    fail_after: Option<Stage>,
    /// When the start began (the node's uptime counts from it).
    started_at: Instant,
    /// The resolved config as TOML, written beside each checkpoint.
    config_toml: Arc<str>,
}

impl Node {
    /// Builds and starts the pipeline. Nothing is generated until every actor is up. When a
    /// stage fails, what the earlier stages started is stopped (in reverse order) before the
    /// error is returned: a failed start leaves nothing running.
    /// Boxed (see [`crate::node`]).
    pub fn start(config: &Config, options: NodeOptions) -> BoxFuture<'_, Result<Self, ActorError>> {
        Box::pin(async move {
            let started_at = Instant::now();
            // Building the backends and restoring the checkpoint read and check files (a real
            // model's weights, every checkpoint file's sum): off the runtime's workers, which
            // a head's cluster server already needs for its members' heartbeats.
            let owned = config.clone();
            let prepared =
                tokio::task::spawn_blocking(move || prepare(&owned, options, started_at))
                    .await
                    .map_err(|e| ActorError::Setup(format!("preparing the node: {e}")))??;
            let mut started = Started::default();
            let mut stage = Stage::Core;
            match Self::start_stages(config, prepared, &mut started, &mut stage).await {
                Ok(parts) => Ok(Self::assemble(config, parts, started)),
                Err(e) => Err(started.unwind(stage, e).await),
            }
        })
    }

    /// Runs the stages in order; `stage` says which one was running when an error came back.
    async fn start_stages(
        config: &Config,
        p: Prepared,
        started: &mut Started,
        stage: &mut Stage,
    ) -> Result<Parts, ActorError> {
        let prom = if p.serve_metrics {
            telemetry::install()
        } else {
            None
        };
        let domains = p.source.domains();
        let events = RunEvents::default();
        let core_inputs = CoreInputs {
            knobs: p.knobs.clone(),
            events: events.clone(),
            replay_dir: p.replay_dir.clone(),
            factory: p.factory,
            env: p.env,
            trainer: p.trainer,
        };
        let (core, out) = Core::start(config, core_inputs).await?;
        let core = started.core.insert(core);
        fail_point(p.fail_after, Stage::Core)?;
        let CoreOutputs {
            trainer,
            recovery,
            start_weights,
        } = out;
        // A checkpoint's groups must still be in the store it resumes with (nothing is
        // generated before the feeds start, so a refusal here loses nothing).
        checkpoints::check_replay_store(
            p.checkpoint_dir.as_ref(),
            p.manifest.as_ref(),
            &recovery,
            p.replay_dir.as_deref(),
        )?;
        *stage = Stage::Feeds;
        let feeds_inputs = FeedsInputs {
            knobs: p.knobs.clone(),
            events: events.clone(),
            source: p.source,
            trainer,
            manifest: p.manifest.as_ref(),
            recovery,
            track_ids: p.track_ids,
            step_feed: p.step_feed,
        };
        let feeds = started
            .feeds
            .insert(Feeds::start(config, core, feeds_inputs).await?);
        fail_point(p.fail_after, Stage::Feeds)?;
        if let Some(m) = &p.manifest {
            metrics::gauge!(m::NODE_CHECKPOINT_VERSION).set(m.version as f64);
        }
        let stores = Stores {
            checkpoint_dir: p.checkpoint_dir,
            manifest: p.manifest.clone(),
            started_at: p.started_at,
            config_toml: p.config_toml,
            config_knobs: Arc::new(config.rollout.knobs.clone()),
        };
        let handles = handles(core, feeds, p.knobs, events, stores)?;
        *stage = Stage::Servers;
        let servers_inputs = ServersInputs {
            serve_admin: p.serve_admin,
            prom,
            cluster: p.cluster,
            domains,
        };
        started.servers = Some(Servers::start(config, &handles, servers_inputs).await?);
        fail_point(p.fail_after, Stage::Servers)?;
        Ok(Parts {
            handles,
            start_weights,
            start_step: p.manifest.as_ref().map_or(0, |m| m.steps),
        })
    }

    fn assemble(config: &Config, parts: Parts, started: Started) -> Self {
        let Parts {
            handles,
            start_weights,
            start_step,
        } = parts;
        Self {
            handles,
            started,
            start_weights,
            start_step,
            shutdown_timeout: config.supervision.shutdown_timeout,
        }
    }
}

/// What the stages hand the node.
struct Parts {
    handles: NodeHandles,
    start_weights: sluice_core::WeightSnapshot,
    start_step: u64,
}

/// The backends (given or built from the config), the knobs, the checkpoint directory and the
/// trainer restored from it: everything before the first actor.
fn prepare(
    config: &Config,
    options: NodeOptions,
    started_at: Instant,
) -> Result<Prepared, ActorError> {
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
        resumed,
        cluster,
        fail_after,
    } = options;
    let given = build::Given {
        factory: backend,
        trainer,
        source,
        env,
        native,
    };
    let build::Backends {
        factory,
        trainer,
        source,
        env,
    } = build::backends(config, given)?;
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
                    .join(sluice_actors::checkpoint::CHECKPOINT_DIR)
            })
        })
        .map(CheckpointDir::new);
    let Restored {
        trainer,
        manifest,
        root,
    } = checkpoints::restore(trainer, checkpoint_dir.as_ref(), resumed, &config.faults)?;
    checkpoints::resume_knobs(&knobs, manifest.as_ref(), &config.rollout.knobs);
    let config_toml: Arc<str> = config.to_toml().into();
    if let (Some(root), Some(m)) = (&root, &manifest)
        && let Some(changed) = checkpoints::config_changes(root, &config_toml)
        && !changed.is_empty()
    {
        tracing::warn!(
            step = m.steps,
            "resuming with a config that differs from the checkpoint's ({}): {}",
            root.join(checkpoints::CONFIG_FILE).display(),
            changed.join("; ")
        );
    }
    Ok(Prepared {
        knobs,
        factory,
        trainer,
        source,
        env,
        manifest,
        checkpoint_dir,
        replay_dir,
        serve_admin,
        serve_metrics,
        track_ids,
        step_feed,
        cluster,
        fail_after,
        started_at,
        config_toml,
    })
}

/// Where the node's checkpoints go, the one it resumed from, and when it started.
struct Stores {
    checkpoint_dir: Option<CheckpointDir>,
    manifest: Option<Manifest>,
    started_at: Instant,
    config_toml: Arc<str>,
    config_knobs: Arc<sluice_core::Knobs>,
}

/// The node's typed handles, cloned from the stages' guards.
fn handles(
    core: &Core,
    feeds: &Feeds,
    knobs: KnobsHandle,
    events: RunEvents,
    stores: Stores,
) -> Result<NodeHandles, ActorError> {
    let Stores {
        checkpoint_dir,
        manifest,
        started_at,
        config_toml,
        config_knobs,
    } = stores;
    let missing = || ActorError::Setup("a stage's guard lacks an actor it started".into());
    Ok(NodeHandles {
        knobs,
        controller: core.controller.clone().ok_or_else(missing)?,
        engine: core.engine.clone().ok_or_else(missing)?,
        replay: core.replay.clone().ok_or_else(missing)?,
        trainer: feeds.trainer.clone().ok_or_else(missing)?,
        sampler: feeds.sampler.clone().ok_or_else(missing)?,
        events,
        started: started_at,
        checkpoint_dir,
        checkpointing: Arc::default(),
        last_checkpoint: Arc::new(std::sync::Mutex::new(manifest)),
        logged_steps: Arc::new(tokio::sync::watch::channel(None).0),
        evaluation: Arc::default(),
        checkpoint_failure: Arc::default(),
        config_toml,
        config_knobs,
        knobs_before_stop: Arc::default(),
    })
}
