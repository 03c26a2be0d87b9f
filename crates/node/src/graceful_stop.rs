//! The graceful stop (SIGTERM/SIGINT, `DESIGN.md` §9): stop admitting, store every request in
//! flight as aborted with its partial, write a checkpoint, all within the shutdown timeout; the
//! node shuts its actors down after ([`crate::Node::stop_gracefully`]).

use std::path::PathBuf;
use std::time::{Duration, Instant};

use serde::Serialize;
use sluice_core::KnobPatch;
use sluice_replay::StoreSnapshot;

use crate::checkpoints::checkpoint;
use crate::handles::NodeHandles;
use sluice_actors::checkpoint::Manifest;

/// Share of the stop's time the wait for groups in flight may take; the rest is the
/// checkpoint's. A group that does not come back in time (an episode waiting for an env node
/// that left, whose call's deadline is longer than the stop's) then stays in the store in
/// flight, which a resume takes back as aborted with its last stored partial, as after a
/// crash; it used to hold the stop to its end, which then had no time left for the checkpoint.
const DRAIN_SHARE: f64 = 0.75;

/// What a graceful stop did.
#[derive(Debug, Clone, Default, Serialize)]
pub struct StopReport {
    /// Seconds from the start of the stop to everything shut down.
    pub seconds: f64,
    /// Seconds until every group in flight was stored.
    pub drain_seconds: f64,
    /// Groups still in flight when the drain gave up (0 when everything was stored): left in
    /// the store in flight, taken back as aborted by a resume.
    pub in_flight_left: u64,
    /// The checkpoint written (`None` without a checkpoint directory or on failure).
    pub checkpoint: Option<Manifest>,
    /// Where the checkpoint went.
    pub checkpoint_dir: Option<PathBuf>,
    /// What went wrong, if anything.
    pub error: Option<String>,
    /// The replay store as it is on disk after the stop.
    pub final_replay: Option<StoreSnapshot>,
}

/// Stops admission, aborts what is in flight (partials stored as aborted) and checkpoints, within
/// `timeout`; the caller shuts the actors down after.
pub async fn drain_and_checkpoint(h: &NodeHandles, timeout: Duration) -> StopReport {
    let started = Instant::now();
    let deadline = tokio::time::Instant::now() + timeout;
    let drain_deadline = tokio::time::Instant::now() + timeout.mul_f64(DRAIN_SHARE);
    let mut report = StopReport {
        checkpoint_dir: h.checkpoint_dir.as_ref().map(|d| d.root().to_owned()),
        ..StopReport::default()
    };
    *h.knobs_before_stop
        .lock()
        .unwrap_or_else(|p| p.into_inner()) = Some(h.knobs.current());
    let pause = KnobPatch {
        paused: Some(true),
        ..KnobPatch::default()
    };
    if let Err(e) = h.knobs.update(&pause) {
        tracing::warn!(error = %e, "cannot pause admission");
    }
    // Paused, admitted groups still resume; closed, the controller starts nothing more.
    match tokio::time::timeout_at(deadline, h.controller.close()).await {
        Ok(Ok(())) => {}
        Ok(Err(e)) => report.error = Some(e.to_string()),
        Err(_) => report.error = Some("the controller did not take the stop in time".into()),
    }
    // No step after the checkpoint's mark: a step trained past it would publish weights the
    // checkpoint does not hold, and consume groups a restart could not train again.
    match tokio::time::timeout_at(deadline, h.trainer.hold()).await {
        Ok(Ok(_)) => {}
        Ok(Err(e)) => report.error = Some(e.to_string()),
        Err(_) => report.error = Some("the trainer did not finish its step in time".into()),
    }
    if tokio::time::timeout_at(deadline, h.engine.close())
        .await
        .is_err()
    {
        report.error = Some("the engine did not take the abort in time".into());
    }
    // Woken by the controller's announcement that nothing is in flight any more.
    let mut events = h.events.subscribe();
    loop {
        events.borrow_and_update();
        match h.controller.status().await {
            Ok(s) if s.in_flight == 0 => break,
            Ok(s) if tokio::time::Instant::now() >= drain_deadline => {
                report.in_flight_left = s.in_flight;
                tracing::warn!(
                    in_flight = s.in_flight,
                    "groups still in flight after {:.0}% of the shutdown timeout: the checkpoint goes ahead; the store keeps them in flight and a resume takes them back as aborted",
                    DRAIN_SHARE * 100.0
                );
                break;
            }
            Ok(_) => {
                // A timeout here is read on the next pass, as the status at the deadline.
                let _ = tokio::time::timeout_at(drain_deadline, events.changed()).await;
            }
            Err(e) => {
                report.error = Some(e.to_string());
                break;
            }
        }
    }
    report.drain_seconds = started.elapsed().as_secs_f64();
    if h.checkpoint_dir.is_some() {
        match tokio::time::timeout_at(deadline, checkpoint(h, "stop")).await {
            Ok(Ok(m)) => report.checkpoint = Some(m),
            Ok(Err(e)) => report.error = Some(e.to_string()),
            Err(_) => {
                report.error =
                    Some("the checkpoint did not finish within the shutdown timeout".into())
            }
        }
    }
    report
}
