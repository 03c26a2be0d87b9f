//! What a node runs on, built from the config: the simulated engine, trainer, samples and task
//! for `engine.backend = "simulated"`; for `"native"` and `"remote"`, the model of the run (its
//! warm-started copy when there is one) with native or remote engine replicas, the candle
//! trainer, `data.datasets` and the task environment. Whatever the caller passes in
//! [`super::NodeOptions`] is used instead (tests inject their own backends).

use std::sync::Arc;

use sluice_config::{Config, EngineBackend};
use sluice_core::{
    BackendError, PolicyVersion, RolloutGroup, TrainStepOutput, TrainerBackend, WeightSnapshot,
};
use sluice_engine::simulated::SimEngineParams;
use sluice_engine::{InferenceBackend, SimEngine};
use sluice_env::SimTask;
use sluice_trainer::SimTrainer;

use crate::native::NativeSetup;
use crate::run::{load_run_setup, sample_source};
use sluice_actors::ActorError;
use sluice_actors::engine::{BackendFactory, ReplicaFactory};
use sluice_actors::env_worker::RolloutEnv;
use sluice_actors::sampler::{SampleSource, SimSource};

/// The pipeline's four backends.
pub(super) struct Backends {
    pub factory: ReplicaFactory,
    pub trainer: Box<dyn TrainerBackend>,
    pub source: Box<dyn SampleSource>,
    pub env: Arc<dyn RolloutEnv>,
}

/// What the caller passed; `None` parts are built from the config.
pub(super) struct Given {
    pub factory: Option<ReplicaFactory>,
    pub trainer: Option<Box<dyn TrainerBackend>>,
    pub source: Option<Box<dyn SampleSource>>,
    pub env: Option<Arc<dyn RolloutEnv>>,
    pub native: Option<Arc<NativeSetup>>,
}

/// The backends of `config`, taking the given ones as they are. A real model's run loads the
/// model (once) only when a part it serves is missing.
pub(super) fn backends(config: &Config, given: Given) -> Result<Backends, ActorError> {
    if config.engine.backend == EngineBackend::Simulated {
        return with_simulated_defaults(config, given);
    }
    let mut loaded = given.native;
    let mut setup = || -> Result<Arc<NativeSetup>, ActorError> {
        if let Some(s) = &loaded {
            return Ok(Arc::clone(s));
        }
        let s = Arc::new(load_run_setup(config)?);
        loaded = Some(Arc::clone(&s));
        Ok(s)
    };
    let factory = match given.factory {
        Some(f) => f,
        None => setup()?.backend_factory(config, None)?,
    };
    let trainer = match given.trainer {
        Some(t) => t,
        None => setup()?.trainer_backend(config, None)?,
    };
    let source: Box<dyn SampleSource> = match given.source {
        Some(s) => s,
        None => Box::new(sample_source(config, &*setup()?)?),
    };
    let env: Arc<dyn RolloutEnv> = match given.env {
        Some(e) => e,
        None => Arc::new(setup()?.env(config)),
    };
    Ok(Backends {
        factory,
        trainer,
        source,
        env,
    })
}

/// The simulated defaults for every part not given.
fn with_simulated_defaults(config: &Config, given: Given) -> Result<Backends, ActorError> {
    let sim = &config.engine.simulated;
    let trainer = match given.trainer {
        Some(t) => t,
        None if config.trainer.simulated.enabled => Box::new(SimBackend(SimTrainer::new(
            &config.trainer.simulated,
            sim.time_scale,
        ))),
        None => {
            return Err(ActorError::Setup(
                "no trainer backend: set trainer.simulated.enabled = true or pass a trainer".into(),
            ));
        }
    };
    Ok(Backends {
        factory: given.factory.unwrap_or_else(|| sim_engine(config).into()),
        trainer,
        source: given.source.unwrap_or_else(|| {
            Box::new(SimSource::from_config(
                &config.data,
                config.simulated_domains(),
                config.run.seed,
            ))
        }),
        env: given.env.unwrap_or_else(|| {
            Arc::new(SimTask {
                prompt_tokens: sim.prompt_tokens.get(),
                env_reply_tokens: sim.env_reply_tokens,
                turns: config.rollout.max_turns.get(),
                seed: sim.seed,
            })
        }),
    })
}

/// Simulated engine replicas from `[engine.simulated]`.
fn sim_engine(config: &Config) -> BackendFactory {
    let sim = config.engine.simulated.clone();
    let cap = config.engine.max_running_sequences.get();
    Arc::new(move |replica, version, sink| {
        let params = SimEngineParams {
            replica,
            max_running_sequences: cap,
            sim: sim.clone(),
        };
        Box::new(SimEngine::start(params, version, sink)) as Box<dyn InferenceBackend>
    })
}

/// The simulated trainer with [`TrainerBackend::set_version`] (its weights are its version).
pub(crate) struct SimBackend(pub SimTrainer);

impl TrainerBackend for SimBackend {
    fn version(&self) -> PolicyVersion {
        self.0.version()
    }

    fn train_step(&mut self, batch: &[RolloutGroup]) -> Result<TrainStepOutput, BackendError> {
        self.0.train_step(batch)
    }

    fn snapshot(&self) -> WeightSnapshot {
        self.0.snapshot()
    }

    fn checkpoint(&mut self, dir: &std::path::Path) -> Result<(), BackendError> {
        self.0.checkpoint(dir)
    }

    fn restore(&mut self, dir: &std::path::Path) -> Result<(), BackendError> {
        self.0.restore(dir)
    }

    fn set_version(&mut self, version: PolicyVersion) -> Result<(), BackendError> {
        self.0 = self.0.clone().with_version(version);
        Ok(())
    }
}
