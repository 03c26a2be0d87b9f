//! Sizing a replica's KV cache pool from `engine.kv_cache_mb`, and the budget a request is
//! checked against before it is queued.

use sluice_model::ModelConfig;
use sluice_model::candle::DType;
use sluice_model::paged::block_bytes;

use super::{NativeEngineParams, NativeError};

/// Cap of the automatic pool (`kv_cache_mb = 0`), MiB: every running sequence at full context
/// is far more than a small model needs and more than a large one's host can give.
pub const AUTO_KV_CACHE_CAP_MB: u64 = 2048;

const MIB: u64 = 1024 * 1024;

/// A replica's pool: how many blocks of how many tokens, and what they cost.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KvBudget {
    /// Tokens per block.
    pub block_tokens: usize,
    /// Blocks in the pool.
    pub blocks: usize,
    /// Bytes of the pool.
    pub bytes: u64,
    /// Whether the size came from `kv_cache_mb = 0`.
    pub automatic: bool,
}

impl KvBudget {
    /// The pool for `params` and a model of `config` in `dtype`: `kv_cache_bytes`, or with 0,
    /// `max_running_sequences` sequences at the model's full context, capped at
    /// [`AUTO_KV_CACHE_CAP_MB`]. Refuses a budget below one block.
    pub fn new(
        params: &NativeEngineParams,
        config: &ModelConfig,
        dtype: DType,
    ) -> Result<Self, NativeError> {
        let block_tokens = params.kv_block_tokens;
        if block_tokens == 0 {
            return Err(NativeError::Params(
                "kv_block_tokens must be at least 1".into(),
            ));
        }
        let per_block = block_bytes(config, dtype, block_tokens) as u64;
        let automatic = params.kv_cache_bytes == 0;
        let bytes = if automatic {
            let tokens =
                params.max_running_sequences as u64 * config.max_position_embeddings as u64;
            (tokens.div_ceil(block_tokens as u64) * per_block).min(AUTO_KV_CACHE_CAP_MB * MIB)
        } else {
            params.kv_cache_bytes
        };
        let blocks = bytes / per_block;
        if blocks == 0 {
            return Err(NativeError::Params(format!(
                "a kv cache of {} bytes (engine.kv_cache_mb) holds no block: one block of {block_tokens} tokens takes {per_block} bytes for this model",
                params.kv_cache_bytes
            )));
        }
        Ok(Self {
            block_tokens,
            blocks: blocks as usize,
            bytes: blocks * per_block,
            automatic,
        })
    }

    /// Tokens the whole pool holds.
    pub fn tokens(&self) -> usize {
        self.blocks * self.block_tokens
    }

    /// Why a sequence of `tokens` tokens (prompt, resumed tokens and the first new one) can
    /// never run here, if it cannot.
    pub fn refuse(&self, tokens: usize) -> Option<String> {
        let needed = tokens.div_ceil(self.block_tokens);
        (needed > self.blocks).then(|| {
            format!(
                "the prompt needs {needed} KV cache blocks of {} tokens ({tokens} tokens with the first generated one); the replica's pool holds {} blocks ({:.1} MiB{}): raise engine.kv_cache_mb",
                self.block_tokens,
                self.blocks,
                self.bytes as f64 / MIB as f64,
                if self.automatic { ", sized automatically" } else { "" },
            )
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use sluice_model::presets::{Preset, preset_config};

    fn params(max_running: usize, bytes: u64) -> NativeEngineParams {
        NativeEngineParams {
            max_running_sequences: max_running,
            kv_cache_bytes: bytes,
            ..NativeEngineParams::default()
        }
    }

    #[test]
    fn automatic_size_covers_every_sequence_at_full_context_up_to_the_cap() {
        // Tiny preset: 2 layers × 2 kv heads × 16 dims × 2 (k, v) × 4 bytes = 512 bytes a token.
        let tiny = preset_config(Preset::Tiny);
        let b = KvBudget::new(&params(4, 0), &tiny, DType::F32).unwrap();
        assert_eq!(b.tokens(), 4 * tiny.max_position_embeddings);
        assert_eq!(b.bytes, 4 * 4096 * 512);
        assert!(b.automatic);
        // Medium preset (Qwen2.5-0.5B shapes): 64 × 32768 tokens would be 48 GiB; capped.
        let medium = preset_config(Preset::Medium);
        let b = KvBudget::new(&params(64, 0), &medium, DType::F32).unwrap();
        assert!(
            b.bytes <= AUTO_KV_CACHE_CAP_MB * MIB
                && b.bytes > AUTO_KV_CACHE_CAP_MB * MIB - 24 * 16 * 1024
        );
    }

    #[test]
    fn explicit_budgets_and_refusals() {
        let tiny = preset_config(Preset::Tiny);
        let b = KvBudget::new(&params(4, 64 * 1024), &tiny, DType::F32).unwrap();
        assert_eq!((b.blocks, b.block_tokens), (8, 16));
        assert_eq!(b.refuse(128), None);
        assert_eq!(
            b.refuse(129).unwrap(),
            "the prompt needs 9 KV cache blocks of 16 tokens (129 tokens with the first generated one); the replica's pool holds 8 blocks (0.1 MiB): raise engine.kv_cache_mb"
        );
        let err = KvBudget::new(&params(4, 100), &tiny, DType::F32).unwrap_err();
        assert!(err.to_string().contains("holds no block"), "{err}");
    }
}
