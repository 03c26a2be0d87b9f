//! Routing and reporting: where a request goes (its preferred replica when alive, else the
//! least loaded; parked while none is alive), refusals after the graceful stop, and the
//! completions and weight versions reported to the controller.

use sluice_core::metrics as m;
use sluice_engine::{Completion, EngineEvent, FinishReason, GenerateRequest};

use super::{EngineReport, EngineState};

impl EngineState {
    /// Sends a report to the controller (the engine actor's one outbound flow).
    pub(super) fn report(&self, report: EngineReport) {
        self.counters.sent(1);
        (self.args.reports)(report);
    }

    pub(super) fn route(&mut self, req: GenerateRequest, preferred: Option<u32>) {
        if self.closed {
            self.refuse(req);
            return;
        }
        let alive = |i: usize| self.replicas[i].backend.is_some();
        let n = self.replicas.len();
        let replica = match preferred {
            Some(r) if (r as usize) < n && alive(r as usize) => Some(r as usize),
            _ => (0..n)
                .filter(|i| alive(*i))
                .min_by_key(|i| self.replicas[*i].load),
        };
        let Some(replica) = replica else {
            self.parked.push_back((req, preferred));
            return;
        };
        self.owner
            .insert(req.id, (replica as u32, req.resume.clone()));
        let r = &mut self.replicas[replica];
        r.load += 1;
        let result = r.backend.as_ref().map(|b| b.submit(req));
        if let Some(Err(e)) = result {
            self.fail_replica(replica as u32, "error", Some(&e));
        }
    }

    /// Answers a request as aborted without running it (graceful stop).
    pub(super) fn refuse(&self, req: GenerateRequest) {
        self.report(EngineReport::Finished {
            completion: Completion {
                id: req.id,
                output: req.resume.unwrap_or_default(),
                finish: FinishReason::Abort,
            },
            replica: 0,
        });
    }

    pub(super) fn on_event(&mut self, replica: u32, event: EngineEvent) {
        let r = &mut self.replicas[replica as usize];
        match event {
            EngineEvent::Finished(c) => {
                metrics::counter!(m::ENGINE_FINISHED_REQUESTS, "reason" => c.finish.as_label())
                    .increment(1);
                if c.finish != FinishReason::Abort {
                    // It served a request: earlier failures were transient.
                    r.health.failures_in_a_row = 0;
                }
                if self.owner.remove(&c.id).is_some() {
                    r.load = r.load.saturating_sub(1);
                }
                if let Some(w) = &mut r.watchdog {
                    w.progressed();
                }
                self.report(EngineReport::Finished {
                    completion: c,
                    replica,
                });
            }
            EngineEvent::WeightsUpdated {
                version,
                pause,
                mode,
            } => {
                // A sync is a move to newer weights: the install of the start weights, at the
                // version the replica already runs, is none.
                if version > r.version {
                    metrics::histogram!(m::ENGINE_WEIGHT_SYNC_PAUSE_SECONDS, "mode" => mode.as_str())
                        .record(pause.as_secs_f64());
                }
                r.version = version;
                self.report_versions();
            }
        }
    }

    /// Reports when every live replica runs the latest version.
    pub(super) fn report_versions(&self) {
        let live = self.replicas.iter().filter(|r| r.backend.is_some());
        if live.clone().all(|r| r.version >= self.latest.version) && live.count() > 0 {
            self.report(EngineReport::WeightsUpdated {
                version: self.latest.version,
            });
        }
    }
}
