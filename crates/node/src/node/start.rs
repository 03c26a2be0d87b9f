//! [`Node::start`]: the pipeline built in order (trainer and checkpoint first, then the
//! controller, replay store, engine, env pool, sampler and trainer actors, each linked to the
//! node's supervisor actor), then the admin and metrics servers.

use std::sync::Arc;
use std::time::{Duration, Instant};

use sluice_config::{Config, ExpiredPolicy};
use sluice_core::metrics as m;
use sluice_core::{KnobsHandle, NodeId, RunId, WeightUpdateMode};
use sluice_engine::SamplingParams;

use crate::admin::{self, AdminState, Server};
use crate::supervise_node::{self, Restored};
use crate::telemetry;
use sluice_actors::ActorError;
use sluice_actors::checkpoint::CheckpointDir;
use sluice_actors::controller::{ControllerConfig, ControllerHandle, Peers};
use sluice_actors::engine::{EngineHandle, EngineSupervision};
use sluice_actors::env_faults::{EnvFaults, FaultyEnv, TimeoutEnv};
use sluice_actors::env_worker::{EnvPoolConfig, EnvPoolHandle, RolloutEnv};
use sluice_actors::events::RunEvents;
use sluice_actors::replay::{ReplayHandle, ReplayOptions};
use sluice_actors::sampler::SamplerHandle;
use sluice_actors::trainer::{TrainerHandle, TrainerOptions};

use super::supervisor::NodeSupervisor;
use super::{Node, NodeHandles, NodeOptions, build};

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
                        .join(sluice_actors::checkpoint::CHECKPOINT_DIR)
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
            advantage: Some(crate::native::setup::native_trainer_config(config).advantage),
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
}
