//! Row sources for [`MixSampler`](crate::MixSampler): dataset rows shuffled per epoch
//! ([`DatasetRows`]) and rows made on demand per domain ([`GeneratorRows`]).

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
use sluice_core::DataSample;

use crate::dataset::Dataset;
use crate::error::DataError;
use crate::rng::{Rng, derive_seed, hash_str};
use crate::sampler::DomainRows;

/// Checkpointable position of one dataset domain.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DomainCursor {
    /// Rows in the domain when the state was taken (checked on restore).
    pub rows: u64,
    /// Completed passes over the domain.
    pub epoch: u64,
    /// Position within the current epoch's order.
    pub cursor: u64,
}

struct Domain {
    /// (dataset index, row index) of the domain's rows, concatenated in dataset order.
    rows: Vec<(u32, u32)>,
    /// Permutation of `0..rows.len()` for the current epoch.
    order: Vec<u32>,
    pos: DomainCursor,
}

/// The rows of datasets, grouped by domain (first-mention order). Rows within a domain are
/// served in a shuffled order, reshuffled each epoch; the order of epoch `e` is derived from
/// `(seed, domain, e)`, so the state is only each domain's epoch and cursor.
pub struct DatasetRows {
    seed: u64,
    names: Vec<String>,
    datasets: Vec<Dataset>,
    domains: Vec<Domain>,
}

impl DatasetRows {
    /// Groups `datasets` by domain; `seed` drives the epoch shuffles.
    pub fn new(datasets: Vec<Dataset>, seed: u64) -> Self {
        let mut names: Vec<String> = Vec::new();
        let mut domains: Vec<Domain> = Vec::new();
        for (di, ds) in datasets.iter().enumerate() {
            let name = &ds.spec().domain;
            let idx = match names.iter().position(|d| d == name) {
                Some(i) => i,
                None => {
                    names.push(name.clone());
                    domains.push(Domain {
                        rows: Vec::new(),
                        order: Vec::new(),
                        pos: DomainCursor {
                            rows: 0,
                            epoch: 0,
                            cursor: 0,
                        },
                    });
                    names.len() - 1
                }
            };
            domains[idx]
                .rows
                .extend((0..ds.len()).map(|r| (di as u32, r as u32)));
        }
        let mut rows = Self {
            seed,
            names,
            datasets,
            domains,
        };
        for i in 0..rows.domains.len() {
            rows.domains[i].pos.rows = rows.domains[i].rows.len() as u64;
            rows.reshuffle(i);
        }
        rows
    }

    fn reshuffle(&mut self, i: usize) {
        let d = &mut self.domains[i];
        d.order = (0..d.rows.len() as u32).collect();
        let seed = derive_seed(&[self.seed, hash_str(&self.names[i]), d.pos.epoch]);
        Rng::new(seed).shuffle(&mut d.order);
    }
}

impl DomainRows for DatasetRows {
    type State = BTreeMap<String, DomainCursor>;

    fn domains(&self) -> &[String] {
        &self.names
    }

    fn size_hint(&self, i: usize) -> f64 {
        self.domains[i].rows.len() as f64
    }

    fn next_row(&mut self, i: usize) -> Option<DataSample> {
        if self.domains[i].rows.is_empty() {
            return None;
        }
        if self.domains[i].pos.cursor as usize >= self.domains[i].order.len() {
            self.domains[i].pos.epoch += 1;
            self.domains[i].pos.cursor = 0;
            self.reshuffle(i);
        }
        let d = &mut self.domains[i];
        let (ds, row) = d.rows[d.order[d.pos.cursor as usize] as usize];
        d.pos.cursor += 1;
        Some(self.datasets[ds as usize].samples()[row as usize].clone())
    }

    fn state(&self) -> Self::State {
        self.names
            .iter()
            .cloned()
            .zip(self.domains.iter().map(|d| d.pos.clone()))
            .collect()
    }

    fn restore(&mut self, state: Self::State) -> Result<(), DataError> {
        for (name, d) in self.names.iter().zip(&self.domains) {
            let Some(s) = state.get(name) else {
                return Err(DataError::StateMismatch(format!(
                    "domain `{name}` is missing from the state"
                )));
            };
            if s.rows != d.rows.len() as u64 || s.cursor > s.rows {
                return Err(DataError::StateMismatch(format!(
                    "domain `{name}`: state has {} rows (cursor {}), the datasets have {}",
                    s.rows,
                    s.cursor,
                    d.rows.len()
                )));
            }
        }
        for i in 0..self.domains.len() {
            self.domains[i].pos = state[&self.names[i]].clone();
            self.reshuffle(i);
        }
        Ok(())
    }
}

/// Makes the `n`-th row (0-based) of a domain.
pub type RowGenerator = Box<dyn FnMut(&str, u64) -> DataSample + Send>;

/// Rows made on demand: the `n`-th draw of domain `d` is `generate(d, n)`. Endless; the state is
/// how many rows each domain has made, so a deterministic generator restores exactly.
pub struct GeneratorRows {
    names: Vec<String>,
    made: Vec<u64>,
    generate: RowGenerator,
}

impl GeneratorRows {
    /// Rows of `domains` (duplicates dropped, order kept) made by `generate`.
    pub fn new(domains: impl IntoIterator<Item = String>, generate: RowGenerator) -> Self {
        let mut names: Vec<String> = Vec::new();
        for d in domains {
            if !names.contains(&d) {
                names.push(d);
            }
        }
        Self {
            made: vec![0; names.len()],
            names,
            generate,
        }
    }

    /// Synthetic rows, for simulated runs: the `n`-th row of domain `d` has id `d-n`, dataset
    /// `synthetic` and input `{"domain": d, "n": n}`.
    pub fn synthetic(domains: impl IntoIterator<Item = String>) -> Self {
        Self::new(
            domains,
            Box::new(|domain, n| DataSample {
                id: format!("{domain}-{n}"),
                domain: domain.to_owned(),
                dataset: "synthetic".into(),
                input: serde_json::json!({ "domain": domain, "n": n }),
                system_prompt: None,
            }),
        )
    }
}

impl DomainRows for GeneratorRows {
    type State = BTreeMap<String, u64>;

    fn domains(&self) -> &[String] {
        &self.names
    }

    fn size_hint(&self, _i: usize) -> f64 {
        1.0
    }

    fn next_row(&mut self, i: usize) -> Option<DataSample> {
        let n = self.made[i];
        self.made[i] += 1;
        let mut sample = (self.generate)(&self.names[i], n);
        sample.domain.clone_from(&self.names[i]);
        Some(sample)
    }

    fn state(&self) -> Self::State {
        self.names.iter().cloned().zip(self.made.clone()).collect()
    }

    fn restore(&mut self, state: Self::State) -> Result<(), DataError> {
        let made = self
            .names
            .iter()
            .map(|n| {
                state.get(n).copied().ok_or_else(|| {
                    DataError::StateMismatch(format!("domain `{n}` is missing from the state"))
                })
            })
            .collect::<Result<Vec<u64>, _>>()?;
        self.made = made;
        Ok(())
    }
}
