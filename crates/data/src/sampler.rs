//! The adaptive domain-weighted sampler (seed 000).
//!
//! Every draw first picks a domain, then the next row of that domain. Domain weights start from
//! the target shares of the live `domain_mix` knob and, when adaptation is on, are corrected by how
//! far the *completed* rollouts lag behind the target:
//!
//! ```text
//! adjusted_d = target_d × clamp(target_d / actual_d, min_ratio, max_ratio)
//! actual_d   = completed_d / Σ completed
//! ```
//!
//! A domain whose rollouts are slow (a code sandbox) or fail more often completes less than it is
//! sampled; boosting its weight keeps the *output* stream at the configured mix. Before any
//! completion the ratio is 1; a domain with targets but no completion yet gets `max_ratio`.
//! With an empty `domain_mix` domains are weighted by their row counts (plain concatenation).
//!
//! Rows within a domain are served in a shuffled order, reshuffled each epoch. The order of epoch
//! `e` is derived from `(seed, domain, e)`, so the checkpoint ([`SamplerState`]) only holds the
//! domain-choice RNG, each domain's epoch and cursor, and the counters — and restores exactly.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
use sluice_core::config::DataConfig;
use sluice_core::metrics::{DATA_SAMPLES, DOMAIN_MIX_ACTUAL, DOMAIN_MIX_COUNT, DOMAIN_MIX_TARGET};
use sluice_core::{DataSample, KnobsHandle};

use crate::dataset::Dataset;
use crate::error::DataError;
use crate::rng::{Rng, derive_seed, hash_str};

/// Per-domain settings (seed 000's `domain_system_prompts` and `domain_rollouts`).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct DomainOptions {
    /// System prompt given to every row of the domain that has none of its own.
    #[serde(default)]
    pub system_prompt: Option<String>,
    /// Name of the registered task that runs the domain's rows; when absent, a row goes to the
    /// task named like its dataset (`math::arithmetic` → `arithmetic`).
    #[serde(default)]
    pub task: Option<String>,
}

/// How the sampler behaves; fixed for a run.
#[derive(Debug, Clone, PartialEq)]
pub struct SamplerConfig {
    /// Seed of the domain choice and of every epoch's shuffle.
    pub seed: u64,
    /// Correct weights by completed/target ratios (true) or sample the target mix as is.
    pub adaptive: bool,
    /// Lower clamp of the correction ratio (seed 000: 0.1).
    pub min_ratio: f64,
    /// Upper clamp of the correction ratio (seed 000: 10).
    pub max_ratio: f64,
    /// Options per domain; every key must be a domain some dataset belongs to.
    pub domains: BTreeMap<String, DomainOptions>,
}

impl SamplerConfig {
    /// Adaptive, clamped to [0.1, 10], no per-domain options.
    pub fn new(seed: u64) -> Self {
        Self {
            seed,
            adaptive: true,
            min_ratio: 0.1,
            max_ratio: 10.0,
            domains: BTreeMap::new(),
        }
    }

    /// The sampler settings of a run's `[data]` config (`adaptive_mix`, `[data.domains.*]`),
    /// seeded with `seed` (derive it from the run seed).
    pub fn from_data_config(data: &DataConfig, seed: u64) -> Self {
        Self {
            adaptive: data.adaptive_mix,
            domains: data
                .domain_options
                .iter()
                .map(|(name, d)| {
                    let options = DomainOptions {
                        system_prompt: d.system_prompt.clone(),
                        task: d.task.clone(),
                    };
                    (name.clone(), options)
                })
                .collect(),
            ..Self::new(seed)
        }
    }
}

/// Checkpointable position of one domain.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DomainCursor {
    /// Rows in the domain when the state was taken (checked on restore).
    pub rows: u64,
    /// Completed passes over the domain.
    pub epoch: u64,
    /// Position within the current epoch's order.
    pub cursor: u64,
    /// Rows handed out since the start of the run.
    pub sampled: u64,
    /// Rollouts reported completed since the start of the run.
    pub completed: u64,
}

/// Everything needed to continue sampling exactly where a checkpoint left off.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SamplerState {
    /// The domain-choice generator.
    pub rng: Rng,
    /// Per domain, by name.
    pub domains: BTreeMap<String, DomainCursor>,
}

/// One line of the domain-mix report (also what the gauges export).
#[derive(Debug, Clone, PartialEq)]
pub struct DomainMixEntry {
    /// Domain name.
    pub domain: String,
    /// Target share (normalized `domain_mix`; row share when the mix is empty).
    pub target: f64,
    /// Share of completed rollouts since the start.
    pub actual: f64,
    /// Completed rollouts since the start.
    pub completed: u64,
    /// Rows handed out since the start.
    pub sampled: u64,
    /// Probability of drawing this domain next (normalized adjusted weight).
    pub draw_probability: f64,
}

struct Domain {
    name: String,
    options: DomainOptions,
    /// (dataset index, row index) of the domain's rows, concatenated in dataset order.
    rows: Vec<(u32, u32)>,
    /// Permutation of `0..rows.len()` for the current epoch.
    order: Vec<u32>,
    pos: DomainCursor,
}

/// Draws [`DataSample`]s across domains toward the target mix. See the module docs.
pub struct DomainSampler {
    config: SamplerConfig,
    datasets: Vec<Dataset>,
    domains: Vec<Domain>,
    rng: Rng,
}

impl std::fmt::Debug for DomainSampler {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DomainSampler")
            .field("config", &self.config)
            .field("state", &self.state())
            .finish_non_exhaustive()
    }
}

impl DomainSampler {
    /// A sampler over `datasets`; domains appear in first-mention order.
    pub fn new(config: SamplerConfig, datasets: Vec<Dataset>) -> Result<Self, DataError> {
        let clamp_ok = config.min_ratio > 0.0
            && config.min_ratio <= 1.0
            && config.max_ratio >= 1.0
            && config.max_ratio.is_finite();
        if !clamp_ok {
            return Err(DataError::Config(format!(
                "ratio clamp must satisfy 0 < min_ratio ≤ 1 ≤ max_ratio < ∞, got [{}, {}]",
                config.min_ratio, config.max_ratio
            )));
        }
        let mut domains: Vec<Domain> = Vec::new();
        for (di, ds) in datasets.iter().enumerate() {
            let name = &ds.spec().domain;
            let idx = match domains.iter().position(|d| &d.name == name) {
                Some(i) => i,
                None => {
                    domains.push(Domain {
                        name: name.clone(),
                        options: config.domains.get(name).cloned().unwrap_or_default(),
                        rows: Vec::new(),
                        order: Vec::new(),
                        pos: DomainCursor {
                            rows: 0,
                            epoch: 0,
                            cursor: 0,
                            sampled: 0,
                            completed: 0,
                        },
                    });
                    domains.len() - 1
                }
            };
            let rows = &mut domains[idx].rows;
            rows.extend((0..ds.len()).map(|r| (di as u32, r as u32)));
        }
        if let Some(unknown) = config
            .domains
            .keys()
            .find(|k| !domains.iter().any(|d| &d.name == *k))
        {
            return Err(DataError::Config(format!(
                "options given for domain `{unknown}`, but no dataset belongs to it"
            )));
        }
        if domains.iter().all(|d| d.rows.is_empty()) {
            return Err(DataError::Config("no dataset has any row".into()));
        }
        let mut sampler = Self {
            rng: Rng::new(derive_seed(&[config.seed, hash_str("domain-choice")])),
            config,
            datasets,
            domains,
        };
        for i in 0..sampler.domains.len() {
            sampler.domains[i].pos.rows = sampler.domains[i].rows.len() as u64;
            sampler.reshuffle(i);
        }
        Ok(sampler)
    }

    /// The domains, in first-mention order.
    pub fn domain_names(&self) -> Vec<String> {
        self.domains.iter().map(|d| d.name.clone()).collect()
    }

    fn reshuffle(&mut self, i: usize) {
        let seed = self.config.seed;
        let d = &mut self.domains[i];
        d.order = (0..d.rows.len() as u32).collect();
        Rng::new(derive_seed(&[seed, hash_str(&d.name), d.pos.epoch])).shuffle(&mut d.order);
    }

    /// Target shares per domain (index-aligned with the domains), from a `domain_mix` map.
    fn targets(&self, mix: &BTreeMap<String, f64>) -> Vec<f64> {
        let raw: Vec<f64> = if mix.is_empty() {
            self.domains.iter().map(|d| d.rows.len() as f64).collect()
        } else {
            self.domains
                .iter()
                .map(|d| {
                    mix.get(&d.name)
                        .copied()
                        .filter(|w| w.is_finite() && *w > 0.0)
                        .unwrap_or(0.0)
                })
                .collect()
        };
        let total: f64 = raw.iter().sum();
        raw.iter()
            .map(|w| if total > 0.0 { w / total } else { 0.0 })
            .collect()
    }

    /// Normalized draw probabilities for the next pick (zero for domains without rows).
    fn draw_probabilities(&self, targets: &[f64]) -> Vec<f64> {
        let total_completed: u64 = self.domains.iter().map(|d| d.pos.completed).sum();
        let weights: Vec<f64> = self
            .domains
            .iter()
            .zip(targets)
            .map(|(d, &target)| {
                if d.rows.is_empty() || target <= 0.0 {
                    return 0.0;
                }
                if !self.config.adaptive || total_completed == 0 {
                    return target;
                }
                let actual = d.pos.completed as f64 / total_completed as f64;
                let ratio = if actual > 0.0 {
                    target / actual
                } else {
                    self.config.max_ratio
                };
                target * ratio.clamp(self.config.min_ratio, self.config.max_ratio)
            })
            .collect();
        let total: f64 = weights.iter().sum();
        weights
            .iter()
            .map(|w| if total > 0.0 { w / total } else { 0.0 })
            .collect()
    }

    /// The next row, toward the mix `domain_mix` (raw weights, normalized here). `None` when
    /// every domain with rows has weight 0.
    pub fn next_sample(&mut self, domain_mix: &BTreeMap<String, f64>) -> Option<DataSample> {
        let probs = self.draw_probabilities(&self.targets(domain_mix));
        if probs.iter().all(|&p| p <= 0.0) {
            return None;
        }
        let u = self.rng.next_f64();
        let mut acc = 0.0;
        // Fall back to the last eligible domain so rounding can never pick a zero-weight one.
        let mut pick = probs.iter().rposition(|&p| p > 0.0)?;
        for (i, &p) in probs.iter().enumerate() {
            acc += p;
            if p > 0.0 && u < acc {
                pick = i;
                break;
            }
        }
        Some(self.take_row(pick))
    }

    /// [`next_sample`](Self::next_sample) with the mix read from the live knobs.
    pub fn next_from_knobs(&mut self, knobs: &KnobsHandle) -> Option<DataSample> {
        self.next_sample(&knobs.current().domain_mix)
    }

    fn take_row(&mut self, i: usize) -> DataSample {
        if self.domains[i].pos.cursor as usize >= self.domains[i].order.len() {
            self.domains[i].pos.epoch += 1;
            self.domains[i].pos.cursor = 0;
            self.reshuffle(i);
        }
        let d = &mut self.domains[i];
        let (ds, row) = d.rows[d.order[d.pos.cursor as usize] as usize];
        d.pos.cursor += 1;
        d.pos.sampled += 1;
        let mut sample = self.datasets[ds as usize].samples()[row as usize].clone();
        if sample.system_prompt.is_none() {
            sample.system_prompt = d.options.system_prompt.clone();
        }
        metrics::counter!(DATA_SAMPLES, "domain" => d.name.clone()).increment(1);
        sample
    }

    /// Records `rollouts` completed rollouts of `domain` (what adaptation steers by). Unknown
    /// domains are ignored with a warning: a checkpoint from an older config may name them.
    pub fn record_completed(&mut self, domain: &str, rollouts: u64) {
        match self.domains.iter_mut().find(|d| d.name == domain) {
            Some(d) => d.pos.completed += rollouts,
            None => tracing::warn!(domain, "completion reported for an unknown domain"),
        }
    }

    /// Name of the task that runs `sample`: its domain's configured task, else its dataset name
    /// without the split.
    pub fn task_for<'a>(&'a self, sample: &'a DataSample) -> &'a str {
        self.domains
            .iter()
            .find(|d| d.name == sample.domain)
            .and_then(|d| d.options.task.as_deref())
            .unwrap_or_else(|| {
                sample
                    .dataset
                    .split_once('@')
                    .map_or(sample.dataset.as_str(), |(name, _)| name)
            })
    }

    /// Target, actual, counts and draw probability per domain, toward `domain_mix`.
    pub fn mix_report(&self, domain_mix: &BTreeMap<String, f64>) -> Vec<DomainMixEntry> {
        let targets = self.targets(domain_mix);
        let probs = self.draw_probabilities(&targets);
        let total: u64 = self.domains.iter().map(|d| d.pos.completed).sum();
        self.domains
            .iter()
            .enumerate()
            .map(|(i, d)| DomainMixEntry {
                domain: d.name.clone(),
                target: targets[i],
                actual: if total > 0 {
                    d.pos.completed as f64 / total as f64
                } else {
                    0.0
                },
                completed: d.pos.completed,
                sampled: d.pos.sampled,
                draw_probability: probs[i],
            })
            .collect()
    }

    /// Sets `sluice_domain_mix_{actual,target,count}{domain}` from [`mix_report`](Self::mix_report).
    pub fn publish_metrics(&self, domain_mix: &BTreeMap<String, f64>) {
        for e in self.mix_report(domain_mix) {
            metrics::gauge!(DOMAIN_MIX_ACTUAL, "domain" => e.domain.clone()).set(e.actual);
            metrics::gauge!(DOMAIN_MIX_TARGET, "domain" => e.domain.clone()).set(e.target);
            metrics::gauge!(DOMAIN_MIX_COUNT, "domain" => e.domain).set(e.completed as f64);
        }
    }

    /// The checkpointable state.
    pub fn state(&self) -> SamplerState {
        SamplerState {
            rng: self.rng.clone(),
            domains: self
                .domains
                .iter()
                .map(|d| (d.name.clone(), d.pos.clone()))
                .collect(),
        }
    }

    /// Continues from `state`. Refused (nothing changes) when it names other domains or other
    /// row counts than the datasets this sampler holds.
    pub fn restore(&mut self, state: SamplerState) -> Result<(), DataError> {
        let names: Vec<&String> = state.domains.keys().collect();
        let mut ours: Vec<&String> = self.domains.iter().map(|d| &d.name).collect();
        ours.sort();
        if names != ours {
            return Err(DataError::StateMismatch(format!(
                "state has domains {names:?}, the datasets have {ours:?}"
            )));
        }
        for d in &self.domains {
            let s = &state.domains[&d.name];
            if s.rows != d.rows.len() as u64 || s.cursor > s.rows {
                return Err(DataError::StateMismatch(format!(
                    "domain `{}`: state has {} rows (cursor {}), the datasets have {}",
                    d.name,
                    s.rows,
                    s.cursor,
                    d.rows.len()
                )));
            }
        }
        self.rng = state.rng;
        for i in 0..self.domains.len() {
            self.domains[i].pos = state.domains[&self.domains[i].name].clone();
            self.reshuffle(i);
        }
        Ok(())
    }
}
