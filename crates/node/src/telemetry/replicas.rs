//! Per-replica engine tallies: [`carry_token_counts`] keeps each replica slot's token count going
//! across rebuilds, and [`ReplicaTally`] turns the sampled totals into counter increments and
//! per-incarnation rates.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use sluice_engine::{EngineStats, InferenceBackend};

use sluice_actors::engine::ReplicaFactory;

/// Wraps `factory` so that each replica slot's `generated_tokens` counts on across rebuilds: when
/// a backend is shut down (or dropped, as a crashed one may be), its count is carried over to the
/// slot, and its successors report theirs on top. The per-replica token counter is then exact:
/// tokens generated between the last sample and a crash are not lost.
pub fn carry_token_counts(factory: ReplicaFactory, replicas: usize) -> ReplicaFactory {
    let retired: Arc<Vec<AtomicU64>> = Arc::new((0..replicas).map(|_| AtomicU64::new(0)).collect());
    ReplicaFactory::new(move |replica, weights, sink| {
        let inner = factory.build(replica, weights, sink)?;
        Ok(Box::new(Carried {
            inner,
            retired: Arc::clone(&retired),
            slot: replica as usize,
            done: false,
        }) as Box<dyn InferenceBackend>)
    })
}

/// A backend whose token count starts where its slot's earlier incarnations ended.
struct Carried {
    inner: Box<dyn InferenceBackend>,
    retired: Arc<Vec<AtomicU64>>,
    slot: usize,
    done: bool,
}

impl Carried {
    fn carried(&self) -> u64 {
        self.retired
            .get(self.slot)
            .map_or(0, |r| r.load(Ordering::Relaxed))
    }

    /// Adds this incarnation's count to the slot, once.
    fn retire(&mut self) {
        if !self.done {
            self.done = true;
            if let Some(r) = self.retired.get(self.slot) {
                r.fetch_add(self.inner.stats().generated_tokens, Ordering::Relaxed);
            }
        }
    }
}

impl InferenceBackend for Carried {
    // `is_alive` is forwarded: a wrapper that answered `true` hid a remote server that died (its
    // requests bounced back as aborts, were resumed on it again, and the run stalled).
    sluice_engine::forward_backend!(
        inner => submit, abort, abort_all, update_weights, is_alive, server_gone
    );

    fn stats(&self) -> EngineStats {
        let mut s = self.inner.stats();
        if !self.done {
            s.generated_tokens += self.carried();
        }
        s
    }

    fn shutdown(&mut self) {
        // Counted before the shutdown: a stopped backend may no longer report.
        self.retire();
        self.inner.shutdown();
    }
}

impl Drop for Carried {
    fn drop(&mut self) {
        self.retire();
    }
}

/// What a replica reported at the last sample.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
struct ReplicaSample {
    uptime_seconds: f64,
    busy_seconds: f64,
}

/// Turns per-replica running totals into increments. Token counts are cumulative per replica
/// slot ([`carry_token_counts`]) but may lag while a dead incarnation is being retired, so only
/// a new high counts: the exported counter never goes backwards and ends exact. Uptime and busy
/// time are per incarnation: a rebuilt replica (its uptime drops) counts them from 0 again. A
/// replica with nothing alive (all zeros) is skipped.
#[derive(Debug, Default)]
pub struct ReplicaTally {
    last: Vec<ReplicaSample>,
    high: Vec<u64>,
}

/// One replica's change since the last sample.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ReplicaDelta {
    /// Wall seconds since the last sample of this incarnation (0: nothing to rate).
    pub wall_seconds: f64,
    /// Busy seconds in them.
    pub busy_seconds: f64,
    /// Tokens generated since the last sample.
    pub tokens: u64,
}

impl ReplicaTally {
    /// The change of each replica since the last call, from their current totals.
    pub fn update(&mut self, stats: &[EngineStats]) -> Vec<ReplicaDelta> {
        self.last.resize(stats.len(), ReplicaSample::default());
        self.high.resize(stats.len(), 0);
        stats
            .iter()
            .enumerate()
            .map(|(i, s)| {
                let tokens = s.generated_tokens.saturating_sub(self.high[i]);
                self.high[i] = self.high[i].max(s.generated_tokens);
                if s.uptime_seconds <= 0.0 {
                    // No live backend (or one just built): nothing to rate yet.
                    return ReplicaDelta {
                        wall_seconds: 0.0,
                        busy_seconds: 0.0,
                        tokens,
                    };
                }
                let cur = ReplicaSample {
                    uptime_seconds: s.uptime_seconds,
                    busy_seconds: s.busy_seconds,
                };
                let prev = self.last[i];
                let rebuilt = cur.uptime_seconds < prev.uptime_seconds;
                self.last[i] = cur;
                if rebuilt {
                    // The tokens may include what the old incarnation did unseen: no rate.
                    return ReplicaDelta {
                        wall_seconds: 0.0,
                        busy_seconds: 0.0,
                        tokens,
                    };
                }
                ReplicaDelta {
                    wall_seconds: cur.uptime_seconds - prev.uptime_seconds,
                    busy_seconds: cur.busy_seconds - prev.busy_seconds,
                    tokens,
                }
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use sluice_core::{RequestId, WeightSnapshot, WeightUpdateMode};
    use sluice_engine::{EngineError, GenerateRequest};

    use super::*;

    fn stats(uptime_seconds: f64, busy_seconds: f64, generated_tokens: u64) -> EngineStats {
        EngineStats {
            uptime_seconds,
            busy_seconds,
            generated_tokens,
            ..EngineStats::default()
        }
    }

    /// A backend that generated `tokens` and does nothing else.
    struct Fixed(u64);

    impl InferenceBackend for Fixed {
        fn submit(&self, _: GenerateRequest) -> Result<(), EngineError> {
            Ok(())
        }
        fn abort(&self, _: RequestId) -> Result<(), EngineError> {
            Ok(())
        }
        fn abort_all(&self) -> Result<(), EngineError> {
            Ok(())
        }
        fn update_weights(
            &self,
            _: WeightSnapshot,
            _: WeightUpdateMode,
        ) -> Result<(), EngineError> {
            Ok(())
        }
        fn stats(&self) -> EngineStats {
            stats(1.0, 0.0, self.0)
        }
        fn is_alive(&self) -> bool {
            self.0 > 0
        }
        fn server_gone(&self) -> Option<String> {
            None
        }
        fn shutdown(&mut self) {}
    }

    #[test]
    fn a_dead_backend_looks_dead_through_the_wrapper() {
        let counts = std::sync::Mutex::new(vec![0u64, 5]);
        let factory: sluice_actors::engine::BackendFactory = Arc::new(move |_, _, _| {
            Box::new(Fixed(counts.lock().unwrap().remove(0))) as Box<dyn InferenceBackend>
        });
        let carried = carry_token_counts(factory.into(), 1);
        let sink: sluice_engine::EventSink = Arc::new(|_| {});
        let weights = WeightSnapshot::version_only(sluice_core::PolicyVersion(0));
        assert!(
            !carried
                .build(0, &weights, Arc::clone(&sink))
                .unwrap()
                .is_alive()
        );
        assert!(carried.build(0, &weights, sink).unwrap().is_alive());
    }

    #[test]
    fn a_rebuilt_replica_counts_on_where_the_old_one_stopped() {
        let counts = std::sync::Mutex::new(vec![120u64, 30, 7]);
        let factory: sluice_actors::engine::BackendFactory = Arc::new(move |_, _, _| {
            Box::new(Fixed(counts.lock().unwrap().remove(0))) as Box<dyn InferenceBackend>
        });
        let carried = carry_token_counts(factory.into(), 2);
        let sink: sluice_engine::EventSink = Arc::new(|_| {});
        let weights = WeightSnapshot::version_only(sluice_core::PolicyVersion(0));
        let build = |sink| carried.build(1, &weights, sink).unwrap();
        let mut first = build(Arc::clone(&sink));
        assert_eq!(first.stats().generated_tokens, 120);
        first.shutdown();
        let second = build(Arc::clone(&sink));
        assert_eq!(second.stats().generated_tokens, 150);
        // Dropped without a shutdown (a crash): counted all the same.
        drop(second);
        let third = build(sink);
        assert_eq!(third.stats().generated_tokens, 157);
    }

    #[test]
    fn the_tally_exports_new_highs_and_rates_per_incarnation() {
        let mut tally = ReplicaTally::default();
        let mut total = 0;
        let mut rates = Vec::new();
        for s in [
            stats(1.0, 0.5, 100),
            stats(2.0, 1.5, 200),
            // Dead: no backend reports (all zeros).
            stats(0.0, 0.0, 0),
            // Rebuilt before the old one's count was carried over: below the high.
            stats(0.5, 0.25, 40),
            // Carried over: 200 from before + 60 new.
            stats(1.0, 0.5, 260),
        ] {
            let d = tally.update(&[s])[0];
            total += d.tokens;
            if d.wall_seconds > 0.0 {
                rates.push(d.busy_seconds / d.wall_seconds);
            }
        }
        assert_eq!(total, 260);
        assert_eq!(rates, vec![0.5, 1.0, 0.5]);
    }
}
