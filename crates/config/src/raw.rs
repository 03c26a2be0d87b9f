//! Phase one of the whole file: [`RawConfig`], one field per section, as serde sees it. Every
//! section denies unknown keys and has defaults, so a minimal file is valid; the sections'
//! own raw types are re-exported here.

use serde::{Deserialize, Serialize};

pub use crate::sections::raw::*;
pub use sluice_data::config::{RawData, RawDomain, RawRubric};
pub use sluice_engine::config::{RawEngine, RawLengthDistribution, RawSimEngine};
pub use sluice_model::section::RawModel;
pub use sluice_replay::config::RawReplay;
pub use sluice_trainer::config::{RawSimTrainer, RawTrainer};

/// The whole file.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RawConfig {
    /// `[run]`
    pub run: RawRun,
    /// `[model]`
    pub model: RawModel,
    /// `[engine]`
    pub engine: RawEngine,
    /// `[trainer]`
    pub trainer: RawTrainer,
    /// `[rollout]`
    pub rollout: RawRollout,
    /// `[data]`
    pub data: RawData,
    /// `[replay]`
    pub replay: RawReplay,
    /// `[metrics]`
    pub metrics: RawMetrics,
    /// `[admin]`
    pub admin: RawAdmin,
    /// `[warmup]`
    pub warmup: RawWarmup,
    /// `[eval]`
    pub eval: RawEval,
    /// `[supervision]`
    pub supervision: RawSupervision,
    /// `[faults]`
    pub faults: RawFaults,
    /// `[node]` (absent: the whole pipeline in this process)
    #[serde(skip_serializing_if = "Option::is_none")]
    pub node: Option<RawNode>,
}
