//! What a benchmark measures: a built-in preset (seeded random weights) or a Hugging Face model
//! directory (its own weights and shapes), chosen with `--preset` and `--model`.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::Context;
use sluice_config::ModelPreset;
use sluice_core::PolicyVersion;
use sluice_model::candle::{DType, Device};
use sluice_model::presets::{preset_config, random_snapshot};
use sluice_model::{LoadOptions, ModelConfig, ModelWeights, load_checkpoint};

/// One model a benchmark runs on.
#[derive(Debug, Clone, PartialEq)]
pub enum Subject {
    /// A built-in preset's shapes with weights drawn from a seed.
    Preset(ModelPreset),
    /// A model directory (`config.json`, safetensors), loaded as it is.
    Dir(PathBuf),
}

impl Subject {
    /// The presets and directories given on the command line, presets first; `tiny` and
    /// `small` when neither is given.
    pub fn list(presets: &[ModelPreset], dirs: &[PathBuf]) -> Vec<Subject> {
        if presets.is_empty() && dirs.is_empty() {
            return vec![
                Subject::Preset(ModelPreset::Tiny),
                Subject::Preset(ModelPreset::Small),
            ];
        }
        let presets = presets.iter().map(|&p| Subject::Preset(p));
        presets
            .chain(dirs.iter().cloned().map(Subject::Dir))
            .collect()
    }

    /// The name of its `RESULT` keys: the preset's, or the directory's last component with
    /// anything but letters, digits and `_` turned into `_` (`SmolLM2-135M` → `smollm2_135m`).
    pub fn name(&self) -> String {
        match self {
            Subject::Preset(p) => format!("{p:?}").to_lowercase(),
            Subject::Dir(dir) => {
                let base = dir
                    .canonicalize()
                    .ok()
                    .as_deref()
                    .and_then(Path::file_name)
                    .or_else(|| dir.file_name())
                    .map_or_else(|| "model".to_owned(), |n| n.to_string_lossy().into_owned());
                base.chars()
                    .map(|c| {
                        if c.is_ascii_alphanumeric() {
                            c.to_ascii_lowercase()
                        } else {
                            '_'
                        }
                    })
                    .collect()
            }
        }
    }

    /// Whether this is the preset `preset` (some rows of the benches are the presets' own).
    pub fn is(&self, preset: ModelPreset) -> bool {
        *self == Subject::Preset(preset)
    }

    /// The model's shapes.
    pub fn config(&self) -> anyhow::Result<Arc<ModelConfig>> {
        Ok(Arc::new(match self {
            Subject::Preset(p) => preset_config(*p),
            Subject::Dir(dir) => {
                let path = dir.join("config.json");
                ModelConfig::from_file(&path)
                    .with_context(|| format!("--model {}", dir.display()))?
            }
        }))
    }

    /// The preset whose default sizes (shapes, steps, lengths) suit this model: a directory
    /// takes the largest preset with at most its parameter count.
    pub fn size_class(&self) -> anyhow::Result<ModelPreset> {
        Ok(match self {
            Subject::Preset(p) => *p,
            Subject::Dir(_) => {
                let params = self.config()?.num_parameters();
                [ModelPreset::Medium, ModelPreset::Small]
                    .into_iter()
                    .find(|&p| preset_config(p).num_parameters() <= params)
                    .unwrap_or(ModelPreset::Tiny)
            }
        })
    }

    /// Weights in `dtype` on `device`, at version `version`. A preset draws them from
    /// `version`'s number as the seed, so two versions differ as two trained snapshots would; a
    /// directory's are its own at every version (a swap moves the same bytes either way).
    pub fn weights(
        &self,
        version: u64,
        dtype: DType,
        device: &Device,
    ) -> anyhow::Result<Arc<ModelWeights>> {
        let weights = match self {
            Subject::Preset(_) => random_snapshot(self.config()?, version, dtype, device)?,
            Subject::Dir(dir) => {
                let options = LoadOptions {
                    dtype: Some(dtype),
                    device: device.clone(),
                };
                load_checkpoint(dir, &options)
                    .with_context(|| format!("--model {}: loading the weights", dir.display()))?
            }
        };
        Ok(Arc::new(weights.with_version(PolicyVersion(version))))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_result_keys() {
        let dir = Subject::Dir(PathBuf::from("/nonexistent/SmolLM2-135M-Instruct"));
        assert_eq!(dir.name(), "smollm2_135m_instruct");
        assert_eq!(Subject::Preset(ModelPreset::Small).name(), "small");
    }

    #[test]
    fn defaults_are_tiny_and_small() {
        let list = Subject::list(&[], &[]);
        assert_eq!(
            list,
            vec![
                Subject::Preset(ModelPreset::Tiny),
                Subject::Preset(ModelPreset::Small)
            ]
        );
        let only_dir = Subject::list(&[], &[PathBuf::from("m")]);
        assert_eq!(only_dir, vec![Subject::Dir(PathBuf::from("m"))]);
    }
}
