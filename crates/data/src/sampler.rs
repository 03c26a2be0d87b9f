//! The adaptive domain-weighted sampler (seed 000), over any per-domain row source.
//!
//! Every draw first picks a domain, then asks the [`DomainRows`] for that domain's next row.
//! Domain weights start from the target shares of the live `domain_mix` knob and, when
//! adaptation is on, are corrected by how far the *completed* rollouts lag behind the target:
//!
//! ```text
//! adjusted_d = target_d × clamp(target_d / actual_d, min_ratio, max_ratio)
//! actual_d   = completed_d / Σ completed
//! ```
//!
//! A domain whose rollouts are slow (a code sandbox) or fail more often completes less than it is
//! sampled; boosting its weight keeps the *output* stream at the configured mix. Before any
//! completion the ratio is 1; a domain with targets but no completion yet gets `max_ratio`.
//! With an empty `domain_mix` domains are weighted by [`DomainRows::size_hint`] (row counts for
//! datasets: plain concatenation).
//!
//! Where rows come from is the [`DomainRows`]' business: shuffled dataset rows
//! ([`crate::rows::DatasetRows`], which makes [`DomainSampler`]) or rows made on
//! demand ([`GeneratorRows`](crate::rows::GeneratorRows), e.g. synthetic samples for simulated
//! runs). The checkpoint ([`SamplerState`]) holds the domain-choice RNG, the counters and the
//! row source's own state, and restores exactly.

use std::collections::BTreeMap;
use std::fmt::Debug;

use crate::config::DataConfig;
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use sluice_core::metrics::{DOMAIN_MIX_ACTUAL, DOMAIN_MIX_ROLLOUTS, DOMAIN_MIX_TARGET};
use sluice_core::{DataSample, KnobsHandle};

use crate::error::DataError;
use crate::rng::{Rng, derive_seed, hash_str};
use crate::rows::DatasetRows;

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
    /// Seed of the domain choice (and of a dataset's epoch shuffles).
    pub seed: u64,
    /// Correct weights by completed/target ratios (true) or sample the target mix as is.
    pub adaptive: bool,
    /// Lower clamp of the correction ratio (seed 000: 0.1).
    pub min_ratio: f64,
    /// Upper clamp of the correction ratio (seed 000: 10).
    pub max_ratio: f64,
    /// Options per domain; every key must be a domain the rows serve.
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

/// Where the rows of each domain come from. Domains are addressed by their index in
/// [`domains`](Self::domains), which must not change over the source's life.
pub trait DomainRows: Send + 'static {
    /// The source's checkpointable position.
    type State: Serialize + DeserializeOwned + Clone + PartialEq + Debug + Send;

    /// The domains served, in a fixed order.
    fn domains(&self) -> &[String];

    /// Relative size of domain `i`, its weight when the mix is empty (row count of a dataset);
    /// 0 means the domain has no rows and is never drawn.
    fn size_hint(&self, i: usize) -> f64;

    /// The next row of domain `i`; only called when `size_hint(i) > 0`. `None`: the domain has
    /// run dry (the draw returns nothing).
    fn next_row(&mut self, i: usize) -> Option<DataSample>;

    /// The current position.
    fn state(&self) -> Self::State;

    /// Continues from `state`. A domain the state does not name (added since) starts afresh,
    /// one it names that is not served any more is dropped (each said in a warning); refused,
    /// with nothing changed, when it does not fit otherwise.
    fn restore(&mut self, state: Self::State) -> Result<(), DataError>;
}

/// Counters of one domain since the start of the run.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct DomainCounts {
    /// Rows handed out.
    pub sampled: u64,
    /// Rollouts reported completed (what adaptation steers by).
    pub completed: u64,
}

/// Everything needed to continue sampling exactly where a checkpoint left off.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SamplerState<S> {
    /// The domain-choice generator.
    pub rng: Rng,
    /// Counters per domain, by name.
    pub domains: BTreeMap<String, DomainCounts>,
    /// The row source's position.
    pub rows: S,
}

/// One line of the domain-mix report (also what the gauges export).
#[derive(Debug, Clone, PartialEq)]
pub struct DomainMixEntry {
    /// Domain name.
    pub domain: String,
    /// Target share (normalized `domain_mix`; size share when the mix is empty).
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

/// Draws [`DataSample`]s across the domains of `R` toward the target mix. See the module docs.
pub struct MixSampler<R: DomainRows> {
    config: SamplerConfig,
    rows: R,
    /// Options per domain, index-aligned with `rows.domains()`.
    options: Vec<DomainOptions>,
    counts: Vec<DomainCounts>,
    rng: Rng,
}

/// The sampler over JSONL (or generated) datasets: rows shuffled per epoch.
pub type DomainSampler = MixSampler<DatasetRows>;

impl<R: DomainRows> Debug for MixSampler<R> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MixSampler")
            .field("config", &self.config)
            .field("state", &self.state())
            .finish_non_exhaustive()
    }
}

impl MixSampler<DatasetRows> {
    /// A sampler over `datasets`; domains appear in first-mention order.
    pub fn new(config: SamplerConfig, datasets: Vec<crate::Dataset>) -> Result<Self, DataError> {
        if !datasets.is_empty() && datasets.iter().all(crate::Dataset::is_empty) {
            let each: Vec<String> = datasets
                .iter()
                .map(|d| match d.bad_lines().len() {
                    0 => format!("`{}` (no rows)", d.spec()),
                    n => format!("`{}` (no rows; {n} bad lines skipped)", d.spec()),
                })
                .collect();
            return Err(DataError::Config(format!(
                "every dataset is empty: {}",
                each.join(", ")
            )));
        }
        let rows = DatasetRows::new(datasets, config.seed);
        Self::with_rows(config, rows)
    }
}

impl<R: DomainRows> MixSampler<R> {
    /// A sampler over the domains of `rows`.
    pub fn with_rows(config: SamplerConfig, rows: R) -> Result<Self, DataError> {
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
        let names = rows.domains();
        if let Some(unknown) = config.domains.keys().find(|k| !names.contains(k)) {
            return Err(DataError::Config(format!(
                "options given for domain `{unknown}`, but no dataset belongs to it"
            )));
        }
        if (0..names.len()).all(|i| rows.size_hint(i) <= 0.0) {
            return Err(DataError::Config("no domain has any row".into()));
        }
        let options = names
            .iter()
            .map(|n| config.domains.get(n).cloned().unwrap_or_default())
            .collect();
        Ok(Self {
            rng: Rng::new(derive_seed(&[config.seed, hash_str("domain-choice")])),
            counts: vec![DomainCounts::default(); names.len()],
            options,
            config,
            rows,
        })
    }

    /// The domains, in the row source's order.
    pub fn domain_names(&self) -> Vec<String> {
        self.rows.domains().to_vec()
    }

    /// The row source.
    pub fn rows(&self) -> &R {
        &self.rows
    }

    /// Whether weights are corrected by completions.
    pub fn is_adaptive(&self) -> bool {
        self.config.adaptive
    }

    /// Target shares per domain (index-aligned with the domains), from a `domain_mix` map.
    fn targets(&self, mix: &BTreeMap<String, f64>) -> Vec<f64> {
        let names = self.rows.domains();
        let raw: Vec<f64> = if mix.is_empty() {
            (0..names.len())
                .map(|i| self.rows.size_hint(i).max(0.0))
                .collect()
        } else {
            names
                .iter()
                .map(|d| {
                    mix.get(d)
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
        let total_completed: u64 = self.counts.iter().map(|c| c.completed).sum();
        let weights: Vec<f64> = targets
            .iter()
            .enumerate()
            .map(|(i, &target)| {
                if self.rows.size_hint(i) <= 0.0 || target <= 0.0 {
                    return 0.0;
                }
                if !self.config.adaptive || total_completed == 0 {
                    return target;
                }
                let actual = self.counts[i].completed as f64 / total_completed as f64;
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
    /// every domain with rows has weight 0, or the drawn domain ran dry.
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
        let mut sample = self.rows.next_row(pick)?;
        self.counts[pick].sampled += 1;
        if sample.system_prompt.is_none() {
            sample.system_prompt = self.options[pick].system_prompt.clone();
        }
        Some(sample)
    }

    /// [`next_sample`](Self::next_sample) with the mix read from the live knobs.
    pub fn next_from_knobs(&mut self, knobs: &KnobsHandle) -> Option<DataSample> {
        self.next_sample(&knobs.current().domain_mix)
    }

    /// Records `rollouts` completed rollouts of `domain` (what adaptation steers by). Unknown
    /// domains are ignored with a warning: a checkpoint from an older config may name them.
    pub fn record_completed(&mut self, domain: &str, rollouts: u64) {
        match self.rows.domains().iter().position(|d| d == domain) {
            Some(i) => self.counts[i].completed += rollouts,
            None => tracing::warn!(domain, "completion reported for an unknown domain"),
        }
    }

    /// Name of the task that runs `sample`: its domain's configured task, else its dataset name
    /// without the split.
    pub fn task_for<'a>(&'a self, sample: &'a DataSample) -> &'a str {
        self.rows
            .domains()
            .iter()
            .position(|d| *d == sample.domain)
            .and_then(|i| self.options[i].task.as_deref())
            .unwrap_or_else(|| sample.dataset_name())
    }

    /// Target, actual, counts and draw probability per domain, toward `domain_mix`.
    pub fn mix_report(&self, domain_mix: &BTreeMap<String, f64>) -> Vec<DomainMixEntry> {
        let targets = self.targets(domain_mix);
        let probs = self.draw_probabilities(&targets);
        let total: u64 = self.counts.iter().map(|c| c.completed).sum();
        self.rows
            .domains()
            .iter()
            .zip(&self.counts)
            .enumerate()
            .map(|(i, (name, c))| DomainMixEntry {
                domain: name.clone(),
                target: targets[i],
                actual: if total > 0 {
                    c.completed as f64 / total as f64
                } else {
                    0.0
                },
                completed: c.completed,
                sampled: c.sampled,
                draw_probability: probs[i],
            })
            .collect()
    }

    /// Sets `sluice_domain_mix_{actual,target}{domain}` and `sluice_domain_mix_rollouts_total` from [`mix_report`](Self::mix_report).
    pub fn publish_metrics(&self, domain_mix: &BTreeMap<String, f64>) {
        for e in self.mix_report(domain_mix) {
            metrics::gauge!(DOMAIN_MIX_ACTUAL, "domain" => e.domain.clone()).set(e.actual);
            metrics::gauge!(DOMAIN_MIX_TARGET, "domain" => e.domain.clone()).set(e.target);
            metrics::counter!(DOMAIN_MIX_ROLLOUTS, "domain" => e.domain).absolute(e.completed);
        }
    }

    /// The checkpointable state.
    pub fn state(&self) -> SamplerState<R::State> {
        SamplerState {
            rng: self.rng.clone(),
            domains: self
                .rows
                .domains()
                .iter()
                .cloned()
                .zip(self.counts.iter().copied())
                .collect(),
            rows: self.rows.state(),
        }
    }

    /// Continues from `state`. Refused (nothing changes) when the row source refuses its
    /// part. Domains may have come or gone since the state was taken: the row source says how
    /// it takes them ([`DomainRows::restore`]); the completion counts of the adaptive mix carry
    /// over for the domains in both, a domain added since starts at zero, and those of a
    /// domain no longer served are dropped.
    pub fn restore(&mut self, state: SamplerState<R::State>) -> Result<(), DataError> {
        self.rows.restore(state.rows)?;
        self.rng = state.rng;
        self.counts = self
            .rows
            .domains()
            .iter()
            .map(|d| state.domains.get(d).copied().unwrap_or_default())
            .collect();
        Ok(())
    }
}
