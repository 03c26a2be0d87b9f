//! The DatasetSampler actor: hands data samples to the controller when asked (credit-based: it
//! never sends more than the controller requested). The samples come from a [`SampleSource`], a
//! small trait; the domain-weighted dataset sampler of `sluice-data` implements it below.

use std::collections::BTreeMap;

use ractor::{Actor, ActorProcessingErr, ActorRef};
use sluice_core::metrics as m;
use sluice_core::{DataSample, KnobsHandle};
use sluice_engine::simulated::{SplitMix64, mix};

use crate::{ActorError, Sink};

/// Where samples come from.
pub trait SampleSource: Send + 'static {
    /// The next sample, drawn toward `domain_shares` (normalized target shares; empty = no
    /// preference). `None` when the source is exhausted.
    fn next_sample(&mut self, domain_shares: &BTreeMap<String, f64>) -> Option<DataSample>;
    /// Resumable state (for checkpoints).
    fn state(&self) -> serde_json::Value;
}

/// Endless synthetic samples over a list of domains (the simulated workload).
#[derive(Debug, Clone)]
pub struct SimSource {
    domains: Vec<String>,
    rng: SplitMix64,
    drawn: u64,
}

impl SimSource {
    /// Samples spread over `domains` (at least one; `sim` when empty), seeded.
    pub fn new(domains: Vec<String>, seed: u64) -> Self {
        let domains = if domains.is_empty() {
            vec!["sim".to_owned()]
        } else {
            domains
        };
        Self {
            domains,
            rng: SplitMix64::new(mix(&[seed, 0xda7a])),
            drawn: 0,
        }
    }
}

impl SampleSource for SimSource {
    fn next_sample(&mut self, shares: &BTreeMap<String, f64>) -> Option<DataSample> {
        let weights: Vec<f64> = self
            .domains
            .iter()
            .map(|d| {
                if shares.is_empty() {
                    1.0
                } else {
                    shares.get(d).copied().unwrap_or(0.0)
                }
            })
            .collect();
        let total: f64 = weights.iter().sum();
        let mut x = self.rng.next_f64()
            * if total > 0.0 {
                total
            } else {
                weights.len() as f64
            };
        let mut domain = &self.domains[0];
        for (d, w) in self.domains.iter().zip(&weights) {
            let w = if total > 0.0 { *w } else { 1.0 };
            if x < w {
                domain = d;
                break;
            }
            x -= w;
        }
        self.drawn += 1;
        Some(DataSample {
            id: self.drawn.to_string(),
            domain: domain.clone(),
            dataset: "simulated".into(),
            input: serde_json::Value::Null,
            system_prompt: None,
        })
    }

    fn state(&self) -> serde_json::Value {
        serde_json::json!({ "drawn": self.drawn })
    }
}

/// The dataset sampler of `sluice-data` (JSONL datasets, adaptive domain weights) is a source as
/// it is: the knob's shares are its target mix.
impl SampleSource for sluice_data::DomainSampler {
    fn next_sample(&mut self, domain_shares: &BTreeMap<String, f64>) -> Option<DataSample> {
        sluice_data::DomainSampler::next_sample(self, domain_shares)
    }

    fn state(&self) -> serde_json::Value {
        serde_json::to_value(sluice_data::DomainSampler::state(self)).unwrap_or_default()
    }
}

/// The actor's messages (private: use [`SamplerHandle`]).
pub struct SamplerMsg(usize);

/// Typed handle; cloning is shallow.
#[derive(Clone)]
pub struct SamplerHandle {
    actor: ActorRef<SamplerMsg>,
}

impl SamplerHandle {
    /// Starts the sampler; batches of samples go to `out`.
    pub async fn spawn(
        source: Box<dyn SampleSource>,
        knobs: KnobsHandle,
        out: Sink<Vec<DataSample>>,
    ) -> Result<(Self, tokio::task::JoinHandle<()>), ActorError> {
        let (actor, join) = Actor::spawn(None, SamplerActor, (source, knobs, out))
            .await
            .map_err(|e| ActorError::Spawn {
                actor: "sampler",
                message: e.to_string(),
            })?;
        Ok((Self { actor }, join))
    }

    /// Asks for `n` samples (the answer may hold fewer when the source runs dry).
    pub fn request(&self, n: usize) {
        let _ = self.actor.cast(SamplerMsg(n));
    }

    /// Stops the actor.
    pub async fn stop(&self) {
        let _ = self.actor.stop_and_wait(None, None).await;
    }
}

struct SamplerActor;

impl Actor for SamplerActor {
    type Msg = SamplerMsg;
    type State = (Box<dyn SampleSource>, KnobsHandle, Sink<Vec<DataSample>>);
    type Arguments = Self::State;

    async fn pre_start(
        &self,
        _me: ActorRef<SamplerMsg>,
        args: Self::State,
    ) -> Result<Self::State, ActorProcessingErr> {
        Ok(args)
    }

    async fn handle(
        &self,
        _me: ActorRef<SamplerMsg>,
        SamplerMsg(n): SamplerMsg,
        (source, knobs, out): &mut Self::State,
    ) -> Result<(), ActorProcessingErr> {
        let shares = knobs.current().domain_shares();
        let samples: Vec<DataSample> = (0..n).map_while(|_| source.next_sample(&shares)).collect();
        for s in &samples {
            metrics::counter!(m::DATA_SAMPLES, "domain" => s.domain.clone()).increment(1);
        }
        out(samples);
        Ok(())
    }
}
