//! The native engine's limits that `sluice serve` takes as flags (`--max-running-sequences`,
//! `--max-step-tokens`, `--kv-cache-mb`, `--kv-block-tokens`), checked by the rules of their
//! `[engine]` keys: the same lower bounds as [`validate_engine`](super::validate_engine) and the
//! upper bounds of [`BOUNDS`], so a flag and its config key can never disagree.

use super::bounds::BOUNDS;

/// The engine limits a standalone server is started with.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EngineLimits {
    /// `engine.max_running_sequences`: sequences decoded together (≥ 1).
    pub max_running_sequences: u64,
    /// `engine.max_step_tokens`: tokens per engine step (≥ 1).
    pub max_step_tokens: u64,
    /// `engine.kv_cache_mb`: the KV pool, MiB (0 = sized automatically).
    pub kv_cache_mb: u64,
    /// `engine.kv_block_tokens`: tokens per KV block (≥ 1).
    pub kv_block_tokens: u64,
}

/// A limit refused: the `[engine]` key and what was expected.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{key}: {reason}")]
pub struct LimitError {
    /// The `[engine]` key (`engine.kv_cache_mb`); a flag is its last part, dashed.
    pub key: &'static str,
    /// What was expected, and what was given.
    pub reason: String,
}

impl LimitError {
    /// The command-line spelling of the key: `engine.kv_cache_mb` → `--kv-cache-mb`.
    pub fn flag(&self) -> String {
        let name = self.key.rsplit('.').next().unwrap_or(self.key);
        format!("--{}", name.replace('_', "-"))
    }
}

/// The upper bound of `key` in [`BOUNDS`].
fn max_of(key: &str) -> u64 {
    BOUNDS
        .iter()
        .find(|b| b.key == key)
        .map_or(u64::MAX, |b| b.max as u64)
}

impl EngineLimits {
    /// Checks every limit; the first refused is returned.
    pub fn validate(&self) -> Result<(), LimitError> {
        let Self {
            max_running_sequences,
            max_step_tokens,
            kv_cache_mb,
            kv_block_tokens,
        } = *self;
        let refuse = |key, reason: String| Err(LimitError { key, reason });
        for (key, v) in [
            ("engine.max_running_sequences", max_running_sequences),
            ("engine.max_step_tokens", max_step_tokens),
        ] {
            if v == 0 {
                return refuse(key, "expected an integer ≥ 1, got 0".into());
            }
            let max = max_of(key);
            if v > max {
                return refuse(key, format!("expected at most {max}, got {v}"));
            }
        }
        let key = "engine.kv_cache_mb";
        let max = max_of(key);
        if kv_cache_mb > max {
            return refuse(
                key,
                format!(
                    "expected at most {max} (MiB of KV cache; 1 TiB at most), got {kv_cache_mb}"
                ),
            );
        }
        let key = "engine.kv_block_tokens";
        let max = max_of(key);
        if !(1..=max).contains(&kv_block_tokens) {
            return refuse(
                key,
                format!("expected 1 to {max} (tokens per KV cache block), got {kv_block_tokens}"),
            );
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const OK: EngineLimits = EngineLimits {
        max_running_sequences: 64,
        max_step_tokens: 2048,
        kv_cache_mb: 0,
        kv_block_tokens: 16,
    };

    #[test]
    fn limits_follow_the_engine_keys() {
        assert_eq!(OK.validate(), Ok(()));
        let cases = [
            (
                EngineLimits {
                    max_running_sequences: 16_385,
                    ..OK
                },
                "--max-running-sequences",
                "expected at most 16384, got 16385",
            ),
            (
                EngineLimits {
                    max_step_tokens: 0,
                    ..OK
                },
                "--max-step-tokens",
                "expected an integer ≥ 1, got 0",
            ),
            (
                EngineLimits {
                    kv_cache_mb: (1 << 20) + 1,
                    ..OK
                },
                "--kv-cache-mb",
                "expected at most 1048576 (MiB of KV cache; 1 TiB at most), got 1048577",
            ),
            (
                EngineLimits {
                    kv_block_tokens: 1025,
                    ..OK
                },
                "--kv-block-tokens",
                "expected 1 to 1024 (tokens per KV cache block), got 1025",
            ),
        ];
        for (limits, flag, reason) in cases {
            let e = limits.validate().unwrap_err();
            assert_eq!((e.flag().as_str(), e.reason.as_str()), (flag, reason));
        }
        // The largest values the config accepts are accepted here too.
        let most = EngineLimits {
            max_running_sequences: 16_384,
            max_step_tokens: 1 << 20,
            kv_cache_mb: 1 << 20,
            kv_block_tokens: 1024,
        };
        assert_eq!(most.validate(), Ok(()));
    }
}
