//! Row sources for [`MixSampler`](crate::MixSampler): dataset rows shuffled per epoch
//! ([`DatasetRows`]) and rows made on demand per domain ([`GeneratorRows`]).

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
use sluice_core::DataSample;

use crate::dataset::Dataset;
use crate::error::DataError;
use crate::rng::{Rng, derive_seed, hash_str};
use crate::sampler::DomainRows;

/// Checkpointable position of one dataset domain, with what identifies the data it is a
/// position in: a resume applies it only to the same data (see [`DatasetRows`]).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DomainCursor {
    /// Rows in the domain when the state was taken (checked on restore).
    pub rows: u64,
    /// Completed passes over the domain.
    pub epoch: u64,
    /// Position within the current epoch's order.
    pub cursor: u64,
    /// The domain's datasets (`domain::name[@split]`), in order. Absent in states written
    /// before it (not compared then).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub datasets: Option<Vec<String>>,
    /// A hash of the domain's rows (each row's id and input, in order), hex. Absent in states
    /// written before it (not compared then).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fingerprint: Option<String>,
}

impl DomainCursor {
    /// What changed between the data this position was taken in (`self`) and `now`'s; `None`
    /// when nothing did, as far as both can tell.
    fn changed_to(&self, now: &DomainCursor) -> Option<String> {
        if let (Some(then), Some(now)) = (&self.datasets, &now.datasets)
            && then != now
        {
            return Some(format!(
                "its datasets changed ([{}] → [{}])",
                then.join(", "),
                now.join(", ")
            ));
        }
        if self.rows != now.rows {
            return Some(format!(
                "its row count changed ({} → {})",
                self.rows, now.rows
            ));
        }
        if let (Some(then), Some(now)) = (&self.fingerprint, &now.fingerprint)
            && then != now
        {
            return Some(format!(
                "its rows' contents changed (same {} rows; fingerprint {then} → {now})",
                self.rows
            ));
        }
        None
    }
}

/// FNV-1a over the domain's rows: each row's id and input, in order.
fn fingerprint<'a>(rows: impl Iterator<Item = &'a DataSample>) -> String {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    let mut eat = |bytes: &[u8]| {
        for b in bytes.iter().chain([&0xff]) {
            h = (h ^ u64::from(*b)).wrapping_mul(0x0000_0100_0000_01b3);
        }
    };
    for row in rows {
        eat(row.id.as_bytes());
        eat(row.input.to_string().as_bytes());
        eat(row.system_prompt.as_deref().unwrap_or("").as_bytes());
    }
    format!("{h:016x}")
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
/// `(seed, domain, e)`, so the state is only each domain's epoch and cursor, with what
/// identifies the domain's data (its datasets, row count and a fingerprint of its rows).
///
/// A restore applies a domain's position only to the same data: a domain whose data changed
/// since the state was taken (another dataset list, row count or row contents) starts afresh,
/// as does a domain the state does not name (added since); a domain the state names that is no
/// longer served is dropped. Each is said once, in a warning naming the domain and what changed.
/// A state without datasets or fingerprint (written before them) is compared by row count alone.
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
                            datasets: Some(Vec::new()),
                            fingerprint: None,
                        },
                    });
                    names.len() - 1
                }
            };
            domains[idx]
                .rows
                .extend((0..ds.len()).map(|r| (di as u32, r as u32)));
            if let Some(list) = &mut domains[idx].pos.datasets {
                list.push(ds.spec().to_string());
            }
        }
        let mut rows = Self {
            seed,
            names,
            datasets,
            domains,
        };
        for i in 0..rows.domains.len() {
            let d = &rows.domains[i];
            let samples = d
                .rows
                .iter()
                .map(|&(ds, r)| &rows.datasets[ds as usize].samples()[r as usize]);
            let print = fingerprint(samples);
            let d = &mut rows.domains[i];
            d.pos.rows = d.rows.len() as u64;
            d.pos.fingerprint = Some(print);
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
        // Decided for every domain before anything changes: a refusal changes nothing.
        let mut apply = Vec::with_capacity(self.domains.len());
        for (name, d) in self.names.iter().zip(&self.domains) {
            let Some(s) = state.get(name) else {
                tracing::warn!(
                    domain = %name,
                    "domain `{name}` is not in the checkpoint's sampler state (added since): it starts at its beginning"
                );
                apply.push(None);
                continue;
            };
            if let Some(what) = s.changed_to(&d.pos) {
                let datasets = d.pos.datasets.clone().unwrap_or_default().join(", ");
                tracing::warn!(
                    domain = %name,
                    "domain `{name}` ({datasets}): {what} since the checkpoint; its position there (epoch {}, row {} of {}) does not apply, and it starts at its beginning",
                    s.epoch,
                    s.cursor,
                    s.rows
                );
                apply.push(None);
                continue;
            }
            if s.cursor > s.rows {
                return Err(DataError::StateMismatch(format!(
                    "domain `{name}`: the state's cursor {} is past its {} rows",
                    s.cursor, s.rows
                )));
            }
            apply.push(Some((s.epoch, s.cursor)));
        }
        for name in state.keys().filter(|n| !self.names.contains(n)) {
            tracing::warn!(
                domain = %name,
                "domain `{name}` of the checkpoint's sampler state is no longer in data.datasets: its position is dropped (its groups already in the replay store are still trained or resumed)"
            );
        }
        for (i, at) in apply.into_iter().enumerate() {
            let (epoch, cursor) = at.unwrap_or((0, 0));
            self.domains[i].pos.epoch = epoch;
            self.domains[i].pos.cursor = cursor;
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
        // A domain added since starts at its first row; one no longer served is dropped.
        self.made = self
            .names
            .iter()
            .map(|n| {
                state.get(n).copied().unwrap_or_else(|| {
                    tracing::warn!(domain = %n, "domain `{n}` is not in the checkpoint's sampler state (added since): it starts at its first row");
                    0
                })
            })
            .collect();
        Ok(())
    }
}
