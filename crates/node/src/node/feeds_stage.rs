//! [`Stage::Feeds`](super::Stage::Feeds): the sampler (where samples come in) and the trainer
//! actor (where batches go out), both linked to the node's supervisor, then the controller
//! connected to its peers: from then on the run generates.

use sluice_config::Config;
use sluice_core::{KnobsHandle, TrainerBackend};

use super::core_stage::Core;
use sluice_actors::ActorError;
use sluice_actors::checkpoint::Manifest;
use sluice_actors::controller::Peers;
use sluice_actors::events::RunEvents;
use sluice_actors::replay::Recovery;
use sluice_actors::sampler::{SampleSource, SamplerHandle};
use sluice_actors::trainer::{StepFeed, TrainerHandle, TrainerOptions};

/// What the feeds stage starts from (besides the core it connects).
pub(super) struct FeedsInputs<'a> {
    pub knobs: KnobsHandle,
    pub events: RunEvents,
    pub source: Box<dyn SampleSource>,
    /// The trainer backend, restored and aligned.
    pub trainer: Box<dyn TrainerBackend>,
    /// The checkpoint resumed from (`None`: a fresh run).
    pub manifest: Option<&'a Manifest>,
    pub recovery: Recovery,
    pub track_ids: bool,
    pub step_feed: Option<StepFeed>,
}

/// The feeds stage's guard: the sampler and the trainer actor.
#[derive(Default)]
pub(crate) struct Feeds {
    pub sampler: Option<SamplerHandle>,
    pub trainer: Option<TrainerHandle>,
    joins: Vec<(&'static str, tokio::task::JoinHandle<()>)>,
}

impl Feeds {
    /// Starts the feeds stage on a running `core`; on a failure half-way, what it started is
    /// stopped first.
    pub(super) async fn start(
        config: &Config,
        core: &Core,
        inputs: FeedsInputs<'_>,
    ) -> Result<Self, ActorError> {
        let mut feeds = Self::default();
        match feeds.fill(config, core, inputs).await {
            Ok(()) => Ok(feeds),
            Err(e) => {
                feeds.stop().await;
                Err(e)
            }
        }
    }

    async fn fill(
        &mut self,
        config: &Config,
        core: &Core,
        inputs: FeedsInputs<'_>,
    ) -> Result<(), ActorError> {
        let FeedsInputs {
            knobs,
            events,
            source,
            trainer,
            manifest,
            recovery,
            track_ids,
            step_feed,
        } = inputs;
        let (Some(supervisor), Some(controller), Some(replay), Some(engine), Some(env)) = (
            &core.supervisor,
            &core.controller,
            &core.replay,
            &core.engine,
            &core.env,
        ) else {
            return Err(ActorError::Setup(
                "the feeds stage needs a running core stage".into(),
            ));
        };
        // A resumed run draws on from where the checkpoint left the sampler (cursor, RNG,
        // per-domain counts), so the adaptive mix and the data order carry over.
        let sampler_state = manifest.and_then(|m| m.sampler.clone());
        let (sampler, j) = SamplerHandle::spawn_from(
            source,
            knobs.clone(),
            controller.sample_sink(),
            sampler_state,
        )
        .await?;
        supervisor.adopt("sampler", sampler.cell());
        self.joins.push(("sampler", j));
        let sampler = self.sampler.insert(sampler);
        let trainer_options = TrainerOptions {
            groups_per_step: config.rollout.groups_per_step.get() as usize,
            max_steps: config.run.max_steps.get(),
            start_step: manifest.map_or(0, |m| m.steps),
            start_trained_groups: manifest.map_or(0, |m| m.trained_groups),
            track_ids,
            events,
            feed: step_feed,
            advantage: Some(crate::native::setup::native_trainer_config(config).advantage),
        };
        let (trainer, j) = TrainerHandle::spawn(
            trainer,
            replay.clone(),
            knobs,
            controller.step_sink(),
            trainer_options,
        )
        .await?;
        supervisor.adopt("trainer", trainer.cell());
        self.joins.push(("trainer", j));
        self.trainer = Some(trainer);
        controller.connect(Peers {
            sampler: sampler.clone(),
            engine: engine.clone(),
            env: env.clone(),
            replay: replay.clone(),
            recovery,
        });
        Ok(())
    }

    /// Stops the trainer, then the sampler (upstream of everything the core runs).
    pub(super) async fn stop(mut self) {
        if let Some(t) = self.trainer.take() {
            t.stop().await;
        }
        if let Some(s) = self.sampler.take() {
            s.stop().await;
        }
        for (_, j) in self.joins.drain(..) {
            let _ = j.await;
        }
    }
}

impl Drop for Feeds {
    /// Not stopped: tells the trainer and the sampler to stop, without waiting.
    fn drop(&mut self) {
        if let Some(t) = self.trainer.take() {
            t.cell().stop(None);
        }
        if let Some(s) = self.sampler.take() {
            s.cell().stop(None);
        }
    }
}
