//! [`NativeSetup`]: everything a node needs to run a real model, built from the config — the
//! checkpoint (created from `model.init_preset` when absent), tokenizer and renderer, the task
//! registry, engine replicas (native or remote), the candle trainer and the task environment.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use sluice_config::{Config, EngineBackend};
use sluice_core::{TrainerBackend, WeightSnapshot};
use sluice_engine::native::{NativeEngine, NativeEngineParams};
use sluice_engine::remote::{RemoteEngine, RemoteParams, WeightDirs};
use sluice_engine::{EngineError, EventSink, InferenceBackend};
use sluice_env::{EnvSessions, TaskRegistry, TokenEnvLimits};
use sluice_model::{LoadOptions, ModelWeights, Tokenizer, load_checkpoint};
use sluice_trainer::{NativeTrainer, NativeTrainerConfig, TrainerRunContext};

use super::renderer::ModelRenderer;
use super::task_env::TaskEnv;
use sluice_actors::ActorError;
use sluice_actors::engine::ReplicaFactory;
use sluice_actors::env_worker::session_cap;

/// The loaded model and what is derived from it.
pub struct NativeSetup {
    /// The model directory.
    pub model_dir: PathBuf,
    /// Its tokenizer.
    pub tokenizer: Arc<Tokenizer>,
    /// Its chat template as the environments' renderer.
    pub renderer: Arc<ModelRenderer>,
    /// The tasks.
    pub registry: Arc<TaskRegistry>,
    /// The weights the run starts from (version 0).
    pub weights: Arc<ModelWeights>,
}

impl std::fmt::Debug for NativeSetup {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NativeSetup")
            .field("model_dir", &self.model_dir)
            .finish_non_exhaustive()
    }
}

fn setup_err(what: impl std::fmt::Display) -> ActorError {
    ActorError::Setup(what.to_string())
}

/// Creates `config.model.path` from `model.init_preset` when the directory has no
/// `config.json`; returns whether it did.
pub fn ensure_model_dir(config: &Config) -> Result<bool, ActorError> {
    let dir = &config.model.path;
    if dir.join("config.json").exists() {
        return Ok(false);
    }
    let Some(preset) = config.model.init_preset else {
        return Err(setup_err(format!(
            "model.path: {} has no config.json (set model.init_preset to create a model there)",
            dir.display()
        )));
    };
    sluice_model::presets::write_preset(preset, dir, config.run.seed)
        .map_err(|e| setup_err(format!("model.init_preset: writing {}: {e}", dir.display())))?;
    Ok(true)
}

/// The renderer of `config`'s model: its tokenizer, with `model.chat_template` in place of the
/// directory's template when set, and `model.chat_template_kwargs`.
pub fn model_renderer(config: &Config) -> Result<ModelRenderer, ActorError> {
    let model_dir = &config.model.path;
    let mut tokenizer = Tokenizer::from_dir(model_dir)
        .map_err(|e| setup_err(format!("model.path {}: {e}", model_dir.display())))?;
    if let Some(path) = &config.model.chat_template {
        tokenizer
            .override_chat_template(path)
            .map_err(|e| setup_err(format!("model.chat_template {}: {e}", path.display())))?;
    }
    ModelRenderer::new(Arc::new(tokenizer))
        .map_err(|e| setup_err(format!("model.path {}: {e}", model_dir.display())))?
        .with_template_kwargs(&config.model.chat_template_kwargs)
        .map_err(setup_err)
}

impl NativeSetup {
    /// Loads the model of `config` (from `weights_dir` instead of `model.path` when given, e.g.
    /// a warm-started copy), on the configured device and dtype.
    pub fn load(config: &Config, weights_dir: Option<&Path>) -> Result<Self, ActorError> {
        let model_dir = config.model.path.clone();
        let renderer = Arc::new(model_renderer(config)?);
        let tokenizer = Arc::clone(renderer.tokenizer());
        // The run starts from weights on the device of their main user: the native engine
        // replicas (and the evaluator, which follows them), else the trainer. The other roles
        // copy them to theirs (sluice_model::ModelWeights::on_device).
        let device = match config.engine.backend {
            EngineBackend::Native => role_device("engine.device", config.engine.device)?,
            _ => role_device("trainer.device", config.trainer.device)?,
        };
        // Refused here, naming the key, rather than when the first evaluation starts.
        role_device("eval.device", config.eval.device)?;
        let dir = weights_dir.unwrap_or(&model_dir);
        let weights = load_checkpoint(
            dir,
            &LoadOptions {
                dtype: Some(native_trainer_config(config).publish_dtype),
                device,
            },
        )
        .map_err(|e| setup_err(format!("loading {}: {e}", dir.display())))?;
        config
            .check_turn_budget(weights.config().max_position_embeddings)
            .map_err(setup_err)?;
        crate::reward_models::check_critic(config, Some(weights.config().vocab_size))
            .map_err(setup_err)?;
        Ok(Self {
            model_dir,
            tokenizer,
            renderer,
            registry: Arc::new(
                sluice_env::configured::registry(
                    &config.data,
                    config.supervision.env_step_timeout,
                    Some(&*crate::reward_models::in_process()),
                )
                .map_err(setup_err)?,
            ),
            weights: Arc::new(weights),
        })
    }

    /// Episode limits of the config: prompt length bound by the model's context minus the
    /// completion budget, turns from `rollout.max_turns`, and each env call bounded by
    /// `supervision.env_step_timeout_s` (not by `TokenEnvLimits`' own 30 s default, which would
    /// cap a longer setting).
    pub fn limits(&self, config: &Config) -> TokenEnvLimits {
        env_limits(config, self.weights.config().max_position_embeddings)
    }

    /// The task environment: sessions over the registry, capped by [`session_cap`] of the
    /// config's knobs (the env pool moves the cap when the knobs change).
    pub fn env(&self, config: &Config) -> TaskEnv {
        self.env_over(config, Arc::clone(&self.registry))
    }

    /// [`NativeSetup::env`] over `registry`'s tasks instead of the setup's (a head's, whose
    /// domains with `env_nodes` run their envs on the joined env nodes).
    pub fn env_over(&self, config: &Config, registry: Arc<TaskRegistry>) -> TaskEnv {
        let max_sessions = session_cap(
            &config.rollout.knobs,
            config.rollout.group_size.get(),
            config.rollout.groups_per_step.get(),
        );
        let domain_tasks = registry.domain_tasks().clone();
        let sessions = EnvSessions::new(
            Arc::clone(&registry),
            self.renderer.clone(),
            self.limits(config),
            max_sessions,
        );
        TaskEnv::new(registry, sessions, domain_tasks)
    }

    /// The candle trainer, starting from `initial` (default: the loaded weights).
    pub fn trainer(
        &self,
        config: &Config,
        initial: Option<Arc<ModelWeights>>,
    ) -> Result<NativeTrainer, ActorError> {
        let initial = initial.unwrap_or_else(|| Arc::clone(&self.weights));
        role_device("trainer.device", config.trainer.device)?;
        NativeTrainer::new(
            initial,
            native_trainer_config(config),
            Some(&self.model_dir),
        )
        .map_err(|e| setup_err(format!("trainer: {e}")))
    }

    /// The trainer as the node's backend.
    pub fn trainer_backend(
        &self,
        config: &Config,
        initial: Option<Arc<ModelWeights>>,
    ) -> Result<Box<dyn TrainerBackend>, ActorError> {
        Ok(Box::new(self.trainer(config, initial)?))
    }

    /// Engine replicas per `engine.backend`, each built on the newest weights the engine actor
    /// holds (a replica rebuilt after a crash starts on them; `initial`, default the loaded
    /// ones, until the snapshot carries a model): native replicas share them; remote replicas
    /// have their servers install them before sending any work, handing them checkpoints under
    /// `<output_dir>/weights` (the newest `engine.remote_keep_versions` kept). A replica that
    /// cannot start is a replica failure (restarted after the backoff).
    pub fn backend_factory(
        &self,
        config: &Config,
        initial: Option<Arc<ModelWeights>>,
    ) -> Result<ReplicaFactory, ActorError> {
        let initial = initial.unwrap_or_else(|| Arc::clone(&self.weights));
        let model = move |weights: &WeightSnapshot| {
            ModelWeights::from_envelope(weights).unwrap_or_else(|| Arc::clone(&initial))
        };
        let failed = |replica: u32, reason: String| EngineError::Start { replica, reason };
        match config.engine.backend {
            EngineBackend::Native => {
                let tokenizer = Arc::clone(&self.tokenizer);
                let engine = config.engine.clone();
                let seed = config.run.seed;
                let eos = self.tokenizer.eos_token_ids().to_vec();
                Ok(ReplicaFactory::new(
                    move |replica, weights, sink: EventSink| {
                        let params =
                            NativeEngineParams::from_config(&engine, replica, seed, eos.clone());
                        NativeEngine::start(
                            params,
                            model(weights),
                            Some(Arc::clone(&tokenizer)),
                            sink,
                        )
                        .map(|e| Box::new(e) as Box<dyn InferenceBackend>)
                        .map_err(|e| failed(replica, e.to_string()))
                    },
                ))
            }
            EngineBackend::Remote => {
                let engine = config.engine.clone();
                // One set of weight directories for every replica: a version is written once.
                let dirs = WeightDirs::new(
                    config.run.output_dir.join("weights"),
                    Some(self.model_dir.clone()),
                    engine.remote_keep_versions.get() as usize,
                );
                Ok(ReplicaFactory::new(
                    move |replica, weights, sink: EventSink| {
                        let params = RemoteParams::from_config(
                            &engine,
                            replica,
                            Arc::clone(&dirs),
                            Some(model(weights)),
                        );
                        RemoteEngine::start(params, weights.version, sink)
                            .map(|e| Box::new(e) as Box<dyn InferenceBackend>)
                            .map_err(|e| failed(replica, e))
                    },
                ))
            }
            EngineBackend::Simulated => Err(setup_err(
                "engine.backend = \"simulated\" has no native engine (the node builds the simulated one itself)",
            )),
        }
    }
}

/// The candle device of a role, or an error naming its key and why it cannot be had (a build
/// without CUDA, no driver, no such device).
pub fn role_device(
    key: &str,
    device: sluice_config::Device,
) -> Result<sluice_model::candle::Device, ActorError> {
    sluice_model::device(device).map_err(|e| setup_err(format!("{key}: {e}")))
}

/// [`NativeSetup::limits`] for a model with a `context`-token window.
pub fn env_limits(config: &Config, context: usize) -> TokenEnvLimits {
    TokenEnvLimits {
        max_prompt_tokens: config.max_prompt_tokens(context),
        max_turns: config.rollout.max_turns.get(),
        call_timeout: config.supervision.env_step_timeout,
        max_history_turns: config.rollout.max_history_turns.map(|n| n.get()),
    }
}

/// The native trainer's settings of `config`: its `[trainer]` section and what the trainer takes
/// from the other sections.
pub fn native_trainer_config(config: &Config) -> NativeTrainerConfig {
    let mut settings = NativeTrainerConfig::from_config(
        &config.trainer,
        &TrainerRunContext {
            max_steps: config.run.max_steps.get(),
            seed: config.run.seed,
            model_dtype: config.model.dtype,
            rollout_temperature: config.rollout.temperature,
            max_new_tokens: u64::from(config.rollout.max_new_tokens.get()),
            filter_zero_advantage: config.replay.filter_zero_advantage,
            native_engine_in_process: config.engine.backend == EngineBackend::Native,
        },
    );
    // Each domain's episodes are discounted by their own γ where they have one.
    settings.advantage.domain_gamma = sluice_env::configured::domain_gammas(&config.data);
    settings
}
