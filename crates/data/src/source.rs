//! Where the pipeline's samples come from: the [`SampleSource`] seam the sampler actor draws
//! through, every [`MixSampler`] as one, and [`SimSource`], the synthetic samples of simulated
//! runs.

use std::collections::BTreeMap;

use crate::config::DataConfig;
use serde_json::Value;
use sluice_core::DataSample;

use crate::rng::{derive_seed, hash_str};
use crate::{DomainRows, GeneratorRows, MixSampler, SamplerConfig};

/// Where samples come from.
pub trait SampleSource: Send + 'static {
    /// The next sample, drawn toward `domain_shares` (normalized target shares; empty = no
    /// preference). `None` when the source is exhausted.
    fn next_sample(&mut self, domain_shares: &BTreeMap<String, f64>) -> Option<DataSample>;

    /// `rollouts` rollouts of `domain` completed (feedback for adaptive sources).
    fn record_completed(&mut self, _domain: &str, _rollouts: u64) {}

    /// Exports the source's gauges toward `domain_shares` (the domain-mix gauges for mixes).
    fn publish_metrics(&self, _domain_shares: &BTreeMap<String, f64>) {}

    /// The domains this source can serve; the `domain_mix` knob may name only these. Empty
    /// means the source cannot tell, and the node falls back to the config's datasets.
    /// Their metric series are seeded at start.
    fn domains(&self) -> Vec<String> {
        Vec::new()
    }

    /// Resumable state (for checkpoints).
    fn state(&self) -> Value;

    /// Continues from a [`state`](Self::state) taken earlier. Refused, with nothing changed, when
    /// it does not fit this source; the reason names what did not fit.
    fn restore(&mut self, state: Value) -> Result<(), String>;
}

/// Every `sluice-data` mix sampler is a source: the knob's shares are its target mix.
impl<R: DomainRows> SampleSource for MixSampler<R> {
    fn next_sample(&mut self, domain_shares: &BTreeMap<String, f64>) -> Option<DataSample> {
        MixSampler::next_sample(self, domain_shares)
    }

    fn record_completed(&mut self, domain: &str, rollouts: u64) {
        MixSampler::record_completed(self, domain, rollouts);
    }

    fn publish_metrics(&self, domain_shares: &BTreeMap<String, f64>) {
        MixSampler::publish_metrics(self, domain_shares);
    }

    fn domains(&self) -> Vec<String> {
        self.domain_names()
    }

    fn state(&self) -> Value {
        // The state is plain data (maps with string keys, integers): serializing cannot fail.
        serde_json::to_value(MixSampler::state(self)).unwrap_or_default()
    }

    fn restore(&mut self, state: Value) -> Result<(), String> {
        let state = serde_json::from_value(state).map_err(|e| format!("sampler state: {e}"))?;
        MixSampler::restore(self, state).map_err(|e| e.to_string())
    }
}

/// Endless synthetic samples over a list of domains (the simulated workload): the adaptive mix
/// over [`GeneratorRows::synthetic`].
#[derive(Debug)]
pub struct SimSource(MixSampler<GeneratorRows>);

impl SimSource {
    /// Samples spread over `domains` (`sim` when empty) by the target shares as they are
    /// (no adaptation), seeded.
    pub fn new(domains: Vec<String>, seed: u64) -> Self {
        let mut config = SamplerConfig::new(seed);
        config.adaptive = false;
        Self::build(domains, config)
    }

    /// The source of a simulated run: the domains of `data.datasets`, else `fallback_domains`
    /// (the composed config's choice: those with a `[engine.simulated.lengths.<domain>]`, else
    /// those of `rollout.domain_mix`; `sim` when none); adaptive per `data.adaptive_mix`, with the
    /// `[data.domains.*]` system prompts; seeded from `run_seed`.
    pub fn from_config(data: &DataConfig, fallback_domains: Vec<String>, run_seed: u64) -> Self {
        let mut domains = data.domains();
        if domains.is_empty() {
            domains = fallback_domains;
        }
        let seed = derive_seed(&[run_seed, hash_str("sampler")]);
        Self::build(domains, SamplerConfig::from_data_config(data, seed))
    }

    fn build(domains: Vec<String>, mut config: SamplerConfig) -> Self {
        let domains = if domains.is_empty() {
            vec!["sim".to_owned()]
        } else {
            domains
        };
        // Options only for domains this source serves (a config validates them against its
        // datasets, which are the domains here whenever there are any).
        config.domains.retain(|d, _| domains.contains(d));
        let rows = GeneratorRows::synthetic(domains);
        match MixSampler::with_rows(config.clone(), rows) {
            Ok(s) => Self(s),
            // Unreachable with a valid clamp and at least one domain, both ensured above; fall
            // back to the defaults rather than fail a simulated run.
            Err(_) => Self(
                MixSampler::with_rows(
                    SamplerConfig::new(config.seed),
                    GeneratorRows::synthetic(["sim".to_owned()]),
                )
                .expect("one synthetic domain with the default clamp is a valid sampler"),
            ),
        }
    }

    /// The mix sampler inside.
    pub fn sampler(&self) -> &MixSampler<GeneratorRows> {
        &self.0
    }
}

impl SampleSource for SimSource {
    fn next_sample(&mut self, domain_shares: &BTreeMap<String, f64>) -> Option<DataSample> {
        SampleSource::next_sample(&mut self.0, domain_shares)
    }
    fn record_completed(&mut self, domain: &str, rollouts: u64) {
        SampleSource::record_completed(&mut self.0, domain, rollouts);
    }
    fn publish_metrics(&self, domain_shares: &BTreeMap<String, f64>) {
        SampleSource::publish_metrics(&self.0, domain_shares);
    }
    fn domains(&self) -> Vec<String> {
        SampleSource::domains(&self.0)
    }
    fn state(&self) -> Value {
        SampleSource::state(&self.0)
    }
    fn restore(&mut self, state: Value) -> Result<(), String> {
        SampleSource::restore(&mut self.0, state)
    }
}
