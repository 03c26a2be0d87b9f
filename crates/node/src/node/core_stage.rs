//! [`Stage::Core`](super::Stage::Core): the node's supervisor, the controller, the replay store
//! (whose recovery sets the version the run continues from), the engine on the trainer's
//! weights and the env pool, each linked to the supervisor. Nothing is generated yet: the
//! controller has no peers until the feeds stage connects it.

use std::sync::Arc;

use sluice_config::{Config, ExpiredPolicy};
use sluice_core::{KnobsHandle, NodeId, RunId, TrainerBackend, WeightSnapshot, WeightUpdateMode};
use sluice_engine::SamplingParams;

use super::supervisor::NodeSupervisor;
use crate::checkpoints;
use crate::telemetry;
use sluice_actors::ActorError;
use sluice_actors::controller::{ControllerConfig, ControllerHandle};
use sluice_actors::engine::{EngineHandle, EngineSupervision, ReplicaFactory};
use sluice_actors::env_faults::{EnvFaults, FaultyEnv, TimeoutEnv};
use sluice_actors::env_worker::{EnvPoolConfig, EnvPoolHandle, RolloutEnv};
use sluice_actors::events::RunEvents;
use sluice_actors::replay::{Recovery, ReplayHandle, ReplayOptions, ReplayStatus};

/// What the core stage starts from.
pub(super) struct CoreInputs {
    pub knobs: KnobsHandle,
    pub events: RunEvents,
    pub replay_dir: Option<std::path::PathBuf>,
    pub factory: ReplicaFactory,
    pub env: Arc<dyn RolloutEnv>,
    /// The trainer backend, restored from the checkpoint (if any).
    pub trainer: Box<dyn TrainerBackend>,
}

/// What the core stage hands the later stages.
pub(super) struct CoreOutputs {
    /// The trainer backend, brought up to the replay store's version.
    pub trainer: Box<dyn TrainerBackend>,
    /// What the replay store recovered (the controller's peers take it).
    pub recovery: Recovery,
    /// The weights the engine started on.
    pub start_weights: WeightSnapshot,
}

/// The core stage's guard: what it started, stopped by [`Core::stop`] (or told to stop when
/// dropped).
#[derive(Default)]
pub(crate) struct Core {
    pub supervisor: Option<NodeSupervisor>,
    pub controller: Option<ControllerHandle>,
    pub replay: Option<ReplayHandle>,
    pub engine: Option<EngineHandle>,
    pub env: Option<EnvPoolHandle>,
    joins: Vec<(&'static str, tokio::task::JoinHandle<()>)>,
}

impl Core {
    /// Starts the core stage; on a failure half-way, what it started is stopped first.
    pub(super) async fn start(
        config: &Config,
        inputs: CoreInputs,
    ) -> Result<(Self, CoreOutputs), ActorError> {
        let mut core = Self::default();
        match core.fill(config, inputs).await {
            Ok(out) => Ok((core, out)),
            Err(e) => {
                core.stop().await;
                Err(e)
            }
        }
    }

    async fn fill(
        &mut self,
        config: &Config,
        inputs: CoreInputs,
    ) -> Result<CoreOutputs, ActorError> {
        let CoreInputs {
            knobs,
            events,
            replay_dir,
            factory,
            env,
            trainer,
        } = inputs;
        let supervisor = self
            .supervisor
            .insert(NodeSupervisor::start(events.clone()).await?);
        let (controller, j) =
            ControllerHandle::spawn(controller_config(config), knobs.clone(), events.clone())
                .await?;
        supervisor.adopt("controller", controller.cell());
        self.joins.push(("controller", j));
        let controller = self.controller.insert(controller);
        let replay_options = ReplayOptions {
            dir: replay_dir,
            drop_expired: config.replay.expired == ExpiredPolicy::Drop,
            filter_zero_advantage: config.replay.filter_zero_advantage,
            tail_batch_candidate_steps: knobs.current().tail_batch_candidate_steps,
        };
        let (replay, mut recovery, j) =
            ReplayHandle::spawn(replay_options, controller.replay_sink()).await?;
        supervisor.adopt("replay", replay.cell());
        self.joins.push(("replay", j));
        self.replay = Some(replay);
        // Versions never go backwards: the run continues from the newer of the replay store's
        // and the trainer's.
        let trainer = checkpoints::align_version(trainer, recovery.policy_version)?;
        let version = trainer.version().max(recovery.policy_version);
        recovery.policy_version = version;
        // The engine generates with the trainer's weights from the first request on: a factory
        // builds replicas from the model it was configured with, which a resumed run has
        // trained past (tokens of the old weights, tagged old, would all expire at once).
        let start_weights = trainer.snapshot();
        let factory = telemetry::carry_token_counts(factory, config.engine.replicas.get() as usize);
        let (engine, j) = EngineHandle::spawn_supervised(
            config.engine.replicas.get(),
            version,
            factory,
            controller.engine_sink(),
            EngineSupervision {
                events,
                ..EngineSupervision::from_config(&config.supervision, &config.faults)
            },
        )
        .await?;
        supervisor.adopt("engine", engine.cell());
        self.joins.push(("engine", j));
        engine.update_weights(start_weights.clone(), WeightUpdateMode::AbortResume);
        self.engine = Some(engine);
        let (env_pool, env_joins) = EnvPoolHandle::spawn(
            EnvPoolConfig::from_config(config),
            wrapped_env(config, env),
            controller.env_sink(),
            &knobs,
        )
        .await?;
        for cell in env_pool.cells() {
            supervisor.adopt("env", cell);
        }
        self.joins.extend(env_joins.into_iter().map(|j| ("env", j)));
        self.env = Some(env_pool);
        Ok(CoreOutputs {
            trainer,
            recovery,
            start_weights,
        })
    }

    /// Stops the controller, the engine and the env pool, then the replay store (which commits
    /// what is queued), then the supervisor. Returns the replay store's last state.
    pub(super) async fn stop(mut self) -> Option<ReplayStatus> {
        if let Some(c) = self.controller.take() {
            c.stop().await;
        }
        if let Some(e) = self.engine.take() {
            e.stop().await;
        }
        if let Some(env) = self.env.take() {
            env.stop().await;
        }
        let mut last = None;
        if let Some(r) = self.replay.take() {
            last = r.status().await.ok();
            r.stop().await;
        }
        for (_, j) in self.joins.drain(..) {
            let _ = j.await;
        }
        if let Some(s) = self.supervisor.take() {
            s.stop().await;
        }
        last
    }
}

impl Drop for Core {
    /// Not stopped (a start cancelled half-way, a node dropped): tells what is left to stop, in
    /// the same order, without waiting.
    fn drop(&mut self) {
        let cells = [
            self.controller.take().map(|c| vec![c.cell()]),
            self.engine.take().map(|e| vec![e.cell()]),
            self.env.take().map(|e| e.cells()),
            self.replay.take().map(|r| vec![r.cell()]),
        ];
        for cell in cells.into_iter().flatten().flatten() {
            cell.stop(None);
        }
    }
}

/// The controller's settings from the config.
fn controller_config(config: &Config) -> ControllerConfig {
    ControllerConfig {
        run: RunId::from_name(&config.run.name),
        node: NodeId(0),
        group_size: config.rollout.group_size.get(),
        groups_per_step: config.rollout.groups_per_step.get(),
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
        replay_capacity: config.replay.capacity.map(|c| c.get()),
        overlong: sluice_env::OverlongShaping::new(
            config.rollout.overlong_buffer_tokens,
            config.rollout.overlong_penalty,
        ),
    }
}

/// The env as the workers call it: with the `[faults]` it injects, under the step timeout.
fn wrapped_env(config: &Config, env: Arc<dyn RolloutEnv>) -> Arc<dyn RolloutEnv> {
    let mut env = env;
    let env_faults = EnvFaults::from_config(&config.faults);
    if env_faults.any() {
        env = Arc::new(FaultyEnv::new(env, env_faults));
    }
    Arc::new(TimeoutEnv::new(env, config.supervision.env_step_timeout))
}
