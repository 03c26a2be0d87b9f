//! What a node is built with beyond its config: the backends, source and env tests inject,
//! where the replay store and checkpoints live, which servers to start.

use std::path::PathBuf;
use std::sync::Arc;

use sluice_core::TrainerBackend;

use crate::native::NativeSetup;
use sluice_actors::engine::ReplicaFactory;
use sluice_actors::env_worker::RolloutEnv;
use sluice_actors::sampler::SampleSource;
use sluice_actors::trainer::StepFeed;

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
    /// The checkpoint to resume from, already read and checked by the caller (its directory and
    /// manifest; [`CheckpointDir::load`](sluice_actors::checkpoint::CheckpointDir::load) sums
    /// every file): the node restores from it without reading the files' sums again. `None`: the
    /// node looks in its checkpoint directory itself.
    pub resumed: Option<(PathBuf, sluice_actors::checkpoint::Manifest)>,
    /// A head's members and served weights, for its admin API ([`crate::cluster::Head`]).
    pub cluster: Option<Arc<crate::cluster::ClusterState>>,
    /// Fail the start right after this stage has started (tests of the unwinding: a failed
    /// start leaves nothing running). `None` in every real node.
    pub fail_after: Option<super::Stage>,
}
