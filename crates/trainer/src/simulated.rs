//! The simulated trainer: a step costs `c + d · tokens` simulated seconds and publishes
//! `version + 1`. Its checkpoint is the version, so a restarted run continues the version count.

use std::collections::BTreeMap;
use std::path::Path;

use crate::config::SimTrainerConfig;
use sluice_core::{
    BackendError, PolicyVersion, RolloutGroup, TrainStepOutput, TrainerBackend, WeightSnapshot,
};

/// See the module docs.
#[derive(Debug, Clone)]
pub struct SimTrainer {
    version: PolicyVersion,
    step_base_seconds: f64,
    step_seconds_per_token: f64,
    time_scale: f64,
}

impl SimTrainer {
    /// A trainer at version 0 with the step-time model of `config`, scaled by `time_scale`.
    pub fn new(config: &SimTrainerConfig, time_scale: f64) -> Self {
        Self {
            version: PolicyVersion::INITIAL,
            step_base_seconds: config.step_base_seconds,
            step_seconds_per_token: config.step_seconds_per_token,
            time_scale,
        }
    }

    /// The same trainer, continuing from `version` (a restarted run).
    pub fn with_version(mut self, version: PolicyVersion) -> Self {
        self.version = version;
        self
    }

    /// Simulated seconds one step on `tokens` tokens takes.
    pub fn step_seconds(&self, tokens: u64) -> f64 {
        self.step_base_seconds + self.step_seconds_per_token * tokens as f64
    }
}

const CHECKPOINT_FILE: &str = "sim_trainer.json";

impl TrainerBackend for SimTrainer {
    fn version(&self) -> PolicyVersion {
        self.version
    }

    fn train_step(&mut self, batch: &[RolloutGroup]) -> Result<TrainStepOutput, BackendError> {
        let tokens: u64 = batch.iter().map(|g| g.completion_tokens() as u64).sum();
        let seconds = self.step_seconds(tokens) * self.time_scale;
        if seconds > 0.0 {
            std::thread::sleep(sluice_core::sim::real_duration(seconds));
        }
        let rewards: Vec<f64> = batch
            .iter()
            .flat_map(|g| g.rollouts.iter().map(|r| r.reward))
            .collect();
        let mean_reward = if rewards.is_empty() {
            0.0
        } else {
            rewards.iter().sum::<f64>() / rewards.len() as f64
        };
        self.version = self.version.next();
        Ok(TrainStepOutput {
            metrics: BTreeMap::from([
                ("tokens".to_owned(), tokens as f64),
                ("groups".to_owned(), batch.len() as f64),
                ("mean_reward".to_owned(), mean_reward),
            ]),
            weights: Some(WeightSnapshot::version_only(self.version)),
            trained_tokens: tokens,
            situations: None,
        })
    }

    fn snapshot(&self) -> WeightSnapshot {
        WeightSnapshot::version_only(self.version)
    }

    fn checkpoint(&mut self, dir: &Path) -> Result<(), BackendError> {
        let io = |e: std::io::Error| {
            BackendError::new("checkpoint_io", format!("{}: {e}", dir.display()))
        };
        std::fs::create_dir_all(dir).map_err(io)?;
        let body = serde_json::json!({ "version": self.version.0 }).to_string();
        std::fs::write(dir.join(CHECKPOINT_FILE), body).map_err(io)
    }

    fn restore(&mut self, dir: &Path) -> Result<(), BackendError> {
        let path = dir.join(CHECKPOINT_FILE);
        let text = std::fs::read_to_string(&path)
            .map_err(|e| BackendError::new("checkpoint_io", format!("{}: {e}", path.display())))?;
        let value: serde_json::Value = serde_json::from_str(&text).map_err(|e| {
            BackendError::new("checkpoint_corrupt", format!("{}: {e}", path.display()))
        })?;
        let version = value["version"].as_u64().ok_or_else(|| {
            BackendError::new(
                "checkpoint_corrupt",
                format!("{}: no `version`", path.display()),
            )
        })?;
        self.version = PolicyVersion(version);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_step_publishes_the_next_version_and_checkpoints_round_trip() {
        let cfg = SimTrainerConfig {
            enabled: true,
            step_base_seconds: 1.0,
            step_seconds_per_token: 0.5,
        };
        let mut t = SimTrainer::new(&cfg, 0.0);
        assert_eq!(t.step_seconds(4), 3.0);
        let out = t.train_step(&[]).unwrap();
        assert_eq!(out.weights.unwrap().version, PolicyVersion(1));
        let dir = tempfile::tempdir().unwrap();
        t.checkpoint(dir.path()).unwrap();
        let mut u = SimTrainer::new(&cfg, 0.0);
        u.restore(dir.path()).unwrap();
        assert_eq!(u.version(), PolicyVersion(1));
    }
}
