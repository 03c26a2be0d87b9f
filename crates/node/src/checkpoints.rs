//! A run's checkpoints: restoring the trainer at start (and bringing it up to the replay
//! store's version), writing checkpoints (on request, every N steps, at the end of training, on
//! a failed step, on stop). The graceful stop that ends in one is [`crate::graceful_stop`].
//!
//! What a restart recovers, and from where:
//!
//! | state | source | after SIGTERM | after `kill -9` |
//! |---|---|---|---|
//! | completed, aborted, expired groups | replay store (durable per commit) | all | all acknowledged ones |
//! | groups in flight | replay store (`InFlight` → `Aborted`) | stored as aborted, with partials | back as aborted with the partial last stored |
//! | consumed groups | replay store (final) | trained exactly once | never trained again; a batch in training when the process died is lost |
//! | trainer weights, optimizer, step | `checkpoint/trainer`, manifest | the state at stop | the last checkpoint |
//! | policy version | max(replay store, trainer) | continues | continues (newer versions' weights were lost: the checkpoint's weights go on under the next number) |
//!
//! A checkpoint is consistent by construction: the trainer writes it between two steps, when every
//! batch it was handed is trained, and consumed groups are final in the replay store.

use std::path::Path;
use std::sync::Arc;
use std::time::Instant;

use futures::future::BoxFuture;
use sluice_config::FaultsConfig;
use sluice_core::metrics as m;
use sluice_core::{KnobState, Knobs, KnobsHandle, PolicyVersion, TrainerBackend};

use crate::handles::NodeHandles;
use sluice_actors::ActorError;
use sluice_actors::checkpoint::{
    CheckpointDir, CheckpointError, FORMAT, MANIFEST, Manifest, ReplayMark, TRAINER_DIR, unix_now,
};
use sluice_actors::faults::{FaultyTrainer, TrainerFaults};
use sluice_actors::replay::Recovery;

mod config;
pub use config::{CONFIG_FILE, changes as config_changes, saved_target};

/// The trainer backend after restore, and the manifest it came from.
pub struct Restored {
    /// The backend, restored (and wrapped by the fault injector when `[faults]` asks).
    pub trainer: Box<dyn TrainerBackend>,
    /// The checkpoint's manifest (`None` for a fresh run).
    pub manifest: Option<Manifest>,
    /// The directory it was read from (the checkpoint, or the one before it when that was
    /// cut short).
    pub root: Option<std::path::PathBuf>,
}

/// Restores `trainer` from `checked` (a checkpoint the caller already read and checked) or
/// else the newest checkpoint under `dir`, if there is one.
pub fn restore(
    mut trainer: Box<dyn TrainerBackend>,
    dir: Option<&CheckpointDir>,
    checked: Option<(std::path::PathBuf, Manifest)>,
    faults: &FaultsConfig,
) -> Result<Restored, ActorError> {
    let found = match (checked, dir) {
        (Some(found), _) => Some(found),
        (None, Some(d)) => d
            .load()
            .map_err(|e| ActorError::Setup(format!("reading the checkpoint: {e}")))?,
        (None, None) => None,
    };
    let (manifest, root) = match found {
        Some((root, manifest)) => {
            let path = root.join(TRAINER_DIR);
            trainer.restore(&path).map_err(|e| {
                ActorError::Setup(format!(
                    "restoring the trainer from {}: {e}",
                    path.display()
                ))
            })?;
            check_trainer_version(&root, &manifest, trainer.version())?;
            tracing::info!(
                version = manifest.version,
                step = manifest.steps,
                reason = %manifest.reason,
                dir = %root.display(),
                "resuming from checkpoint"
            );
            (Some(manifest), Some(root))
        }
        None => (None, None),
    };
    let trainer_faults = TrainerFaults::from_config(faults);
    if trainer_faults.any() {
        trainer = Box::new(FaultyTrainer::new(trainer, trainer_faults));
    }
    Ok(Restored {
        trainer,
        manifest,
        root,
    })
}

/// Brings the live `knobs` (the config's, `config`) to the runtime values the checkpoint of
/// `manifest` recorded, by the rule of [`sluice_core::knobs::resume_knobs`]: a knob tuned at
/// runtime comes back unless the config's value was edited since; each decision is logged. A
/// checkpoint without knobs (written before they were recorded) leaves the config's; values
/// that no longer fit the run (a domain it does not serve any more) are refused with a warning,
/// and the config's stay.
pub fn resume_knobs(knobs: &KnobsHandle, manifest: Option<&Manifest>, config: &Knobs) {
    let Some(saved) = manifest.and_then(|m| m.knobs.as_ref()) else {
        return;
    };
    let (patch, decisions) = sluice_core::knobs::resume_knobs(saved, config);
    for d in &decisions {
        match d {
            sluice_core::KnobResumed::Runtime { knob, value } => {
                tracing::info!(knob, %value, "resumed knob: {d}")
            }
            sluice_core::KnobResumed::Config { knob, now, .. } => {
                tracing::info!(knob, value = %now, "resumed knob: {d}")
            }
        }
    }
    if patch.is_empty() {
        return;
    }
    if let Err(e) = knobs.update(&patch) {
        tracing::warn!(error = %e, "the checkpoint's runtime knobs do not fit this run; the config's values stay");
    }
}

/// Refuses a manifest whose version is not the restored trainer's: both are written from one
/// mark between two steps, so they differ only when a file was edited or mixed from two
/// checkpoints (a manifest at step 500 beside a trainer at step 10 would "resume at step 500").
fn check_trainer_version(
    root: &Path,
    manifest: &Manifest,
    trainer: PolicyVersion,
) -> Result<(), ActorError> {
    if manifest.version == trainer.0 {
        return Ok(());
    }
    let dir = root.join(TRAINER_DIR);
    // The native trainer's counters; another backend names its own files.
    let state = dir.join("trainer_state.json");
    let trainer_file = if state.exists() { state } else { dir };
    Err(ActorError::Setup(format!(
        "checkpoint {} says version {} (step {}) but the trainer state {} holds version {}: the \
         files do not belong to one checkpoint; restore them from one checkpoint, or start over \
         deliberately (a new `run.name` or `run.output_dir`, or remove {})",
        root.join(MANIFEST).display(),
        manifest.version,
        manifest.steps,
        trainer_file.display(),
        trainer.0,
        root.display()
    )))
}

/// Refuses to resume from a checkpoint with a replay store that holds less than the checkpoint
/// says it held: a store that is missing or empty (opened afresh) or older than the checkpoint.
/// Every counter of the store only grows and is committed before the manifest records it, so a
/// counter below the manifest's means the groups at rest there (completed, aborted, not yet
/// trained) were lost, which resuming would do silently. `store` is the store's directory
/// (`None`: in memory, nothing to compare); `checkpoint` and `manifest` are what [`restore`]
/// read (`None`: a fresh run).
pub fn check_replay_store(
    checkpoint: Option<&CheckpointDir>,
    manifest: Option<&Manifest>,
    recovery: &Recovery,
    store: Option<&Path>,
) -> Result<(), ActorError> {
    let (Some(checkpoint), Some(manifest), Some(store)) = (checkpoint, manifest, store) else {
        return Ok(());
    };
    let mark = manifest.replay;
    let pairs = [
        (
            "admitted_total",
            mark.admitted_total,
            recovery.admitted_total,
        ),
        (
            "consumed_total",
            mark.consumed_total,
            recovery.counts.consumed_total,
        ),
        (
            "policy_version",
            mark.policy_version,
            recovery.policy_version.0,
        ),
    ];
    let behind: Vec<String> = pairs
        .iter()
        .filter(|(_, checkpoint, found)| found < checkpoint)
        .map(|(key, checkpoint, found)| {
            format!("`{key}` {found} (the checkpoint's manifest: {checkpoint})")
        })
        .collect();
    if behind.is_empty() {
        return Ok(());
    }
    let file = store.join(sluice_replay::DB_FILE);
    // Opening creates a missing or empty file afresh: by now both look the same.
    let state = if recovery.admitted_total == 0 {
        "new (the file was missing or empty)"
    } else {
        "older than the checkpoint"
    };
    let root = checkpoint.root();
    Err(ActorError::Setup(format!(
        "the replay store {} is {state}: it holds {}; resuming from the checkpoint {} would lose \
         the groups it counted there. Put the run's replay store back, or start over \
         deliberately (a new `run.name` or `run.output_dir`, or remove {} and the store)",
        file.display(),
        behind.join(", "),
        root.join(MANIFEST).display(),
        root.display(),
    )))
}

/// Brings the trainer up to `replay_version` when the replay store saw newer versions than the
/// trainer holds (a crash after the last checkpoint): see [`TrainerBackend::set_version`].
pub fn align_version(
    mut trainer: Box<dyn TrainerBackend>,
    replay_version: PolicyVersion,
) -> Result<Box<dyn TrainerBackend>, ActorError> {
    let have = trainer.version();
    if have >= replay_version {
        return Ok(trainer);
    }
    trainer.set_version(replay_version).map_err(|e| {
        ActorError::Setup(format!(
            "the replay store saw {replay_version} published but the trainer holds {have} (the \
             weights in between were not checkpointed) and cannot continue under a newer number: \
             {e}; checkpoint more often (supervision.checkpoint_every_steps) or start a new run"
        ))
    })?;
    tracing::warn!(
        from = %have,
        to = %replay_version,
        "weights newer than the last checkpoint were lost; training continues from the weights restored (the last checkpoint's, or without one the run's start weights) under the next version"
    );
    Ok(trainer)
}

impl NodeHandles {
    /// Writes a checkpoint now (between two training steps): trainer state, a replay-store commit
    /// and the manifest, atomically under the checkpoint directory (see [`checkpoint`]).
    pub async fn checkpoint(&self) -> Result<Manifest, CheckpointError> {
        checkpoint(self, "request").await
    }
}

/// Writes a checkpoint (one at a time): the trainer's state between two steps, a replay-store
/// commit, then the manifest, atomically; a failure is counted. Boxed, like the node's entry
/// points ([`crate::node`]).
pub fn checkpoint<'a>(
    h: &'a NodeHandles,
    reason: &'a str,
) -> BoxFuture<'a, Result<Manifest, CheckpointError>> {
    Box::pin(async move {
        let written = write(h, reason).await;
        if written.as_ref().is_err_and(|e| !e.trainer_poisoned()) {
            metrics::counter!(m::NODE_CHECKPOINT_FAILURES).increment(1);
        }
        written
    })
}

/// [`checkpoint`]'s work.
async fn write(h: &NodeHandles, reason: &str) -> Result<Manifest, CheckpointError> {
    let dir = h.checkpoint_dir.clone().ok_or_else(|| {
        CheckpointError::Unavailable(
            "no checkpoint directory: this node was started without one".into(),
        )
    })?;
    let _one_at_a_time = h.checkpointing.lock().await;
    let started = Instant::now();
    let begin = dir.clone();
    let staging = blocking(move || begin.begin()).await?;
    let mark = h.trainer.checkpoint(staging.join(TRAINER_DIR)).await?;
    let (at, toml) = (staging.clone(), Arc::clone(&h.config_toml));
    blocking(move || config::stage(&at, &toml)).await?;
    let counters = h
        .replay
        .flush()
        .await
        .map_err(|e| CheckpointError::Unavailable(e.to_string()))?;
    // Taken after the trainer's mark: draws made since are at most a few groups drawn again on
    // resume (after a graceful stop, which stops admission first, none).
    let sampler = match h.sampler.state().await {
        Ok(state) => Some(state),
        Err(e) => {
            tracing::warn!(error = %e, "sampler state left out of the checkpoint");
            None
        }
    };
    // The operator's knobs, not the graceful stop's pause.
    let held = h
        .knobs_before_stop
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .clone();
    let knobs = KnobState::new(&h.config_knobs, &held.unwrap_or_else(|| h.knobs.current()));
    // Every mark is taken; before the commit makes them the resume point, the run log must
    // hold the trainer's steps (see `wait_for_log`; without a monitor logging, no wait).
    let waited = wait_for_log(h, mark.steps).await;
    let manifest = Manifest {
        format: FORMAT,
        version: mark.version.0,
        steps: mark.steps,
        trained_groups: mark.trained_groups,
        replay: ReplayMark {
            admitted_total: counters.admitted_total,
            consumed_total: counters.consumed_total,
            policy_version: counters.policy_version,
        },
        sampler,
        knobs: Some(knobs),
        reason: reason.to_owned(),
        written_unix_seconds: unix_now(),
        files: Default::default(),
    };
    let manifest = blocking(move || dir.commit(&manifest)).await?;
    // The write's own time: a wait for the run log (behind an evaluation, minutes on a large
    // model) is no part of it, and is logged beside it.
    let seconds = started.elapsed().saturating_sub(waited).as_secs_f64();
    metrics::histogram!(m::NODE_CHECKPOINT_SECONDS).record(seconds);
    metrics::gauge!(m::NODE_CHECKPOINT_VERSION).set(manifest.version as f64);
    tracing::info!(
        version = manifest.version,
        step = manifest.steps,
        reason,
        seconds,
        waited_for_run_log_seconds = waited.as_secs_f64(),
        "checkpoint written"
    );
    *h.last_checkpoint.lock().unwrap_or_else(|p| p.into_inner()) = Some(manifest.clone());
    Ok(manifest)
}

/// The longest a checkpoint waits for the run log (an evaluation of a large model on
/// its step can take this long); past it, the checkpoint is written anyway, with a warning.
const LOG_WAIT: std::time::Duration = std::time::Duration::from_secs(600);

/// Waits until the run monitor's log holds `steps` (the trainer may be a step or more ahead of
/// the log while the monitor evaluates), or no monitor logs any more; returns how long.
async fn wait_for_log(h: &NodeHandles, steps: u64) -> std::time::Duration {
    let started = Instant::now();
    let mut logged = h.logged_steps.subscribe();
    let caught_up = logged.wait_for(|l| l.is_none_or(|s| s >= steps));
    if tokio::time::timeout(LOG_WAIT, caught_up).await.is_err() {
        tracing::warn!(
            steps,
            logged = ?*h.logged_steps.borrow(),
            "checkpoint written before the run log caught up with it"
        );
    }
    started.elapsed()
}

async fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> Result<T, CheckpointError> + Send + 'static,
) -> Result<T, CheckpointError> {
    tokio::task::spawn_blocking(f)
        .await
        .map_err(|e| CheckpointError::Unavailable(format!("checkpoint task: {e}")))?
}

/// Periodic checkpoints that fail in a row before the run stops ([`crate::run::RunEnd::CheckpointFailed`]):
/// one failure may pass (the next one retries), but a run whose checkpoints keep failing (a
/// full or read-only disk) would train on with nothing saved, and lose it all at its end.
pub const MAX_FAILED_IN_A_ROW: u32 = 3;

/// Starts the task that checkpoints every `every` steps (`None` when off or without a directory).
/// After [`MAX_FAILED_IN_A_ROW`] failures in a row it records why in the status and announces
/// it, which ends the run.
pub fn spawn_periodic(h: &NodeHandles, every: u64) -> Option<tokio::task::JoinHandle<()>> {
    if every == 0 || h.checkpoint_dir.is_none() {
        return None;
    }
    let h = h.clone();
    Some(tokio::spawn(async move {
        let mut status = h.trainer.watch_status();
        let mut last = status.borrow_and_update().steps;
        let mut failed = 0;
        while status.changed().await.is_ok() {
            let now = status.borrow_and_update().steps;
            if now / every > last / every {
                match checkpoint(&h, "periodic").await {
                    Ok(_) => failed = 0,
                    Err(e) => {
                        failed += 1;
                        tracing::error!(error = %e, step = now, failed_in_a_row = failed, "periodic checkpoint failed");
                        if failed >= MAX_FAILED_IN_A_ROW {
                            let why = format!(
                                "{failed} periodic checkpoints in a row failed, the last at step {now}: {e}"
                            );
                            *h.checkpoint_failure
                                .lock()
                                .unwrap_or_else(|p| p.into_inner()) = Some(why);
                            h.events.announce();
                            return;
                        }
                    }
                }
            }
            last = now;
        }
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn manifest() -> Manifest {
        Manifest {
            format: FORMAT,
            version: 10,
            steps: 10,
            trained_groups: 320,
            replay: ReplayMark {
                admitted_total: 360,
                consumed_total: 320,
                policy_version: 10,
            },
            sampler: None,
            knobs: None,
            reason: "stop".into(),
            written_unix_seconds: 0.0,
            files: Default::default(),
        }
    }

    fn recovery(admitted: u64, consumed: u64, version: u64) -> Recovery {
        let mut r = Recovery {
            admitted_total: admitted,
            policy_version: PolicyVersion(version),
            ..Recovery::default()
        };
        r.counts.consumed_total = consumed;
        r
    }

    #[test]
    fn a_replay_store_behind_the_checkpoint_is_refused_naming_both_counters() {
        let dir = CheckpointDir::new("/runs/a/checkpoint");
        let m = manifest();
        let store = Path::new("/runs/a/replay");
        let check = |r: &Recovery| check_replay_store(Some(&dir), Some(&m), r, Some(store));
        // The store as the checkpoint left it, or further on (a crash after it): fine.
        check(&recovery(360, 320, 10)).unwrap();
        check(&recovery(400, 352, 12)).unwrap();
        // No checkpoint, or a store in memory: nothing to compare.
        check_replay_store(None, None, &recovery(0, 0, 0), Some(store)).unwrap();
        check_replay_store(Some(&dir), Some(&m), &recovery(0, 0, 0), None).unwrap();

        let err = check(&recovery(0, 0, 0)).unwrap_err().to_string();
        for expected in [
            "/runs/a/replay/replay.redb is new (the file was missing or empty)",
            "`admitted_total` 0 (the checkpoint's manifest: 360)",
            "`consumed_total` 0 (the checkpoint's manifest: 320)",
            "`policy_version` 0 (the checkpoint's manifest: 10)",
            "/runs/a/checkpoint/manifest.json",
            "`run.output_dir`",
        ] {
            assert!(err.contains(expected), "`{expected}` in {err}");
        }
        let err = check(&recovery(360, 300, 10)).unwrap_err().to_string();
        assert!(err.contains("older than the checkpoint"), "{err}");
        assert!(err.contains("`consumed_total` 300 (the checkpoint's manifest: 320)"));
        assert!(!err.contains("`admitted_total`"), "{err}");
    }
}
