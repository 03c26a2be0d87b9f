//! Upper bounds of `config.json`'s sizes: generous for real checkpoints (the largest Llama has
//! 126 layers, hidden size 16384, a 128k vocabulary), far below what would exhaust memory in
//! the per-layer structures built from them before any weight is read.

/// Most `num_hidden_layers`.
pub const MAX_LAYERS: usize = 1024;
/// Largest `hidden_size`.
pub const MAX_HIDDEN_SIZE: usize = 1 << 17;
/// Largest `intermediate_size`.
pub const MAX_INTERMEDIATE_SIZE: usize = 1 << 20;
/// Most `num_attention_heads` (and `num_key_value_heads`).
pub const MAX_HEADS: usize = 1024;
/// Largest `head_dim`.
pub const MAX_HEAD_DIM: usize = 1024;
/// Largest `vocab_size`.
pub const MAX_VOCAB_SIZE: usize = 1 << 23;
/// Largest `max_position_embeddings` (and `rope_scaling.original_max_position_embeddings`).
pub const MAX_CONTEXT: usize = 1 << 24;

/// Each size field of `config.json` with its bound.
pub(crate) fn bounded_fields(config: &super::ModelConfig) -> [(&'static str, usize, usize); 8] {
    let original = config
        .rope_scaling
        .map_or(0, |s| s.original_max_position_embeddings);
    [
        ("num_hidden_layers", config.num_layers, MAX_LAYERS),
        ("hidden_size", config.hidden_size, MAX_HIDDEN_SIZE),
        (
            "intermediate_size",
            config.intermediate_size,
            MAX_INTERMEDIATE_SIZE,
        ),
        ("num_attention_heads", config.num_heads, MAX_HEADS),
        ("num_key_value_heads", config.num_kv_heads, MAX_HEADS),
        ("head_dim", config.head_dim, MAX_HEAD_DIM),
        ("vocab_size", config.vocab_size, MAX_VOCAB_SIZE),
        (
            "max_position_embeddings",
            config.max_position_embeddings.max(original),
            MAX_CONTEXT,
        ),
    ]
}
