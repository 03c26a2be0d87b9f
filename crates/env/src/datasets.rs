//! Resolving the configured `[data] datasets` to rows: a spec whose JSONL file exists under
//! `data_dir` is loaded from it; otherwise, when a registered task is named like the dataset and
//! generates its own data (the built-ins), its generator supplies the rows. Anything else is an
//! error naming the file that was looked for.

use sluice_data::config::{DataConfig, DatasetSpec};
use sluice_data::{Dataset, dataset_file};

use crate::error::EnvError;
use crate::task::TaskRegistry;

/// How many rows a generating task produces per split, and from which seed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GeneratedRows {
    /// Seed of the generators (derive it from the run seed).
    pub seed: u64,
    /// Rows of a `train` (or split-less) dataset.
    pub train: usize,
    /// Rows of any other split (`eval`).
    pub eval: usize,
}

impl GeneratedRows {
    /// 4096 training rows, 256 evaluation rows.
    pub fn new(seed: u64) -> Self {
        Self {
            seed,
            train: 4096,
            eval: 256,
        }
    }
}

/// Loads or generates every dataset of `data`, in config order.
pub fn load_datasets(
    data: &DataConfig,
    registry: &TaskRegistry,
    rows: GeneratedRows,
) -> Result<Vec<Dataset>, EnvError> {
    data.datasets
        .iter()
        .map(|spec| load_dataset(data, registry, spec, rows))
        .collect()
}

/// Loads `spec` from its JSONL (or Parquet) file under `data.data_dir`, or generates it with the task named
/// like the dataset.
pub fn load_dataset(
    data: &DataConfig,
    registry: &TaskRegistry,
    spec: &DatasetSpec,
    rows: GeneratedRows,
) -> Result<Dataset, EnvError> {
    let path = dataset_file(&data.data_dir, spec);
    // Something at the path, even a link that leads nowhere, means a file was meant: it is read,
    // and a failure names it, rather than the task's generated rows quietly taking its place.
    if std::fs::symlink_metadata(&path).is_ok() {
        return Dataset::load_limited(&data.data_dir, spec, data.on_bad_line, &data.read_limits)
            .map_err(|e| EnvError::Config(e.to_string()));
    }
    let task = registry.get(&spec.name).map_err(|_| {
        EnvError::Config(format!(
            "dataset `{spec}`: no file {} (nor {}) and no registered task `{}` that generates data",
            path.display(),
            path.with_extension("parquet").display(),
            spec.name
        ))
    })?;
    let count = match spec.split.as_deref() {
        None | Some("train") => rows.train,
        Some(_) => rows.eval,
    };
    task.generate_dataset(spec, rows.seed, count)
}
