//! Metrics plumbing: installing the Prometheus recorder once per process, and the periodic task
//! that exports gauges sampled from the actors (engine busy ratio, throughput, knobs) and runs the
//! exporter's upkeep.

use std::sync::OnceLock;
use std::time::{Duration, Instant};

use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusHandle};
use sluice_core::WeightUpdateMode;
use sluice_core::knobs::KnobsHandle;
use sluice_core::metrics as m;

use crate::engine::EngineHandle;

static HANDLE: OnceLock<Option<PrometheusHandle>> = OnceLock::new();

/// Installs the Prometheus recorder (first call in the process) with the catalog's histogram
/// buckets and help text; later calls return the same handle. `None` if another recorder was
/// installed first.
pub fn install() -> Option<PrometheusHandle> {
    HANDLE
        .get_or_init(|| {
            let mut builder = PrometheusBuilder::new();
            for def in m::CATALOG.iter().filter(|d| !d.buckets.is_empty()) {
                builder = builder
                    .set_buckets_for_metric(Matcher::Full(def.name.to_owned()), def.buckets)
                    .ok()?;
            }
            let handle = builder.install_recorder().ok()?;
            m::describe_all();
            metrics::gauge!(m::NODE_UP_INFO, "version" => env!("CARGO_PKG_VERSION")).set(1.0);
            Some(handle)
        })
        .clone()
}

/// Samples the engine and the knobs every `period`, exports gauges, and runs the exporter's
/// upkeep every few seconds. Runs until aborted.
pub async fn run(
    engine: EngineHandle,
    knobs: KnobsHandle,
    handle: Option<PrometheusHandle>,
    period: Duration,
) {
    let mut last: Vec<(f64, f64, u64)> = Vec::new();
    let mut last_upkeep = Instant::now();
    let mut tick = tokio::time::interval(period);
    loop {
        tick.tick().await;
        if let Ok(stats) = engine.stats().await {
            for (i, s) in stats.iter().enumerate() {
                let replica = i.to_string();
                let prev = last.get(i).copied().unwrap_or((0.0, 0.0, 0));
                let (dw, db) = (s.uptime_seconds - prev.0, s.busy_seconds - prev.1);
                if dw > 0.0 {
                    metrics::gauge!(m::ENGINE_BUSY_RATIO, "replica" => replica.clone())
                        .set((db / dw).clamp(0.0, 1.0));
                    let tps = s.generated_tokens.saturating_sub(prev.2) as f64 / dw;
                    metrics::gauge!(m::ENGINE_DECODE_TOKENS_PER_SECOND, "replica" => replica.clone()).set(tps);
                }
                metrics::gauge!(m::ENGINE_RUNNING_SEQUENCES, "replica" => replica.clone())
                    .set(s.running as f64);
                metrics::gauge!(m::ENGINE_WAITING_REQUESTS, "replica" => replica.clone())
                    .set(s.waiting as f64);
                metrics::counter!(m::ENGINE_GENERATED_TOKENS, "replica" => replica)
                    .absolute(s.generated_tokens);
            }
            last = stats
                .iter()
                .map(|s| (s.uptime_seconds, s.busy_seconds, s.generated_tokens))
                .collect();
        }
        export_knobs(&knobs);
        if let Some(h) = &handle
            && last_upkeep.elapsed() > Duration::from_secs(5)
        {
            h.run_upkeep();
            last_upkeep = Instant::now();
        }
    }
}

/// Exports every knob as a gauge.
pub fn export_knobs(knobs: &KnobsHandle) {
    let k = knobs.current();
    for (name, v) in k.gauge_values() {
        metrics::gauge!(m::NODE_KNOB_VALUE, "knob" => name).set(v);
    }
    for mode in WeightUpdateMode::ALL {
        let on = if mode == k.weight_update_mode {
            1.0
        } else {
            0.0
        };
        metrics::gauge!(m::NODE_WEIGHT_UPDATE_MODE_INFO, "mode" => mode.as_str()).set(on);
    }
    for (domain, share) in k.domain_shares() {
        metrics::gauge!(m::DOMAIN_MIX_TARGET, "domain" => domain).set(share);
    }
}
