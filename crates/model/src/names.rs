//! The Hugging Face tensor names and shapes an architecture needs, in checkpoint order.
//!
//! One list drives loading (what must be present, with which shape), saving (what is written),
//! random initialization and the trainer's parameter set, so the four can never disagree.

use crate::config::ModelConfig;

/// One parameter tensor: its HF name and the shape the config implies.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorSpec {
    /// HF name, e.g. `model.layers.0.mlp.up_proj.weight`.
    pub name: String,
    /// Shape, `[out, in]` for projections.
    pub shape: Vec<usize>,
    /// What random initialization gives it.
    pub init: InitKind,
}

/// How `sluice model init` fills a tensor.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum InitKind {
    /// Normal(0, 0.02), like transformers' `initializer_range`.
    Normal,
    /// All ones (RMSNorm scales).
    Ones,
    /// All zeros (biases).
    Zeros,
}

/// Name of the token embedding.
pub const EMBED: &str = "model.embed_tokens.weight";
/// Name of the final norm.
pub const FINAL_NORM: &str = "model.norm.weight";
/// Name of the untied LM head.
pub const LM_HEAD: &str = "lm_head.weight";

/// The prefix of layer `i`'s tensors.
pub fn layer_prefix(i: usize) -> String {
    format!("model.layers.{i}")
}

/// Every parameter of `config`, embeddings first, LM head last (absent when tied).
pub fn parameter_specs(config: &ModelConfig) -> Vec<TensorSpec> {
    let h = config.hidden_size;
    let q = config.num_heads * config.head_dim;
    let kv = config.num_kv_heads * config.head_dim;
    let i = config.intermediate_size;
    let spec = |name: String, shape: Vec<usize>, init| TensorSpec { name, shape, init };
    let mut out = vec![spec(
        EMBED.to_owned(),
        vec![config.vocab_size, h],
        InitKind::Normal,
    )];
    for l in 0..config.num_layers {
        let p = layer_prefix(l);
        out.push(spec(
            format!("{p}.input_layernorm.weight"),
            vec![h],
            InitKind::Ones,
        ));
        for (proj, rows) in [("q_proj", q), ("k_proj", kv), ("v_proj", kv)] {
            out.push(spec(
                format!("{p}.self_attn.{proj}.weight"),
                vec![rows, h],
                InitKind::Normal,
            ));
            if config.qkv_bias() {
                out.push(spec(
                    format!("{p}.self_attn.{proj}.bias"),
                    vec![rows],
                    InitKind::Zeros,
                ));
            }
        }
        out.push(spec(
            format!("{p}.self_attn.o_proj.weight"),
            vec![h, q],
            InitKind::Normal,
        ));
        if config.qk_norm() {
            for norm in ["q_norm", "k_norm"] {
                out.push(spec(
                    format!("{p}.self_attn.{norm}.weight"),
                    vec![config.head_dim],
                    InitKind::Ones,
                ));
            }
        }
        out.push(spec(
            format!("{p}.post_attention_layernorm.weight"),
            vec![h],
            InitKind::Ones,
        ));
        out.push(spec(
            format!("{p}.mlp.gate_proj.weight"),
            vec![i, h],
            InitKind::Normal,
        ));
        out.push(spec(
            format!("{p}.mlp.up_proj.weight"),
            vec![i, h],
            InitKind::Normal,
        ));
        out.push(spec(
            format!("{p}.mlp.down_proj.weight"),
            vec![h, i],
            InitKind::Normal,
        ));
    }
    out.push(spec(FINAL_NORM.to_owned(), vec![h], InitKind::Ones));
    if !config.tie_word_embeddings {
        out.push(spec(
            LM_HEAD.to_owned(),
            vec![config.vocab_size, h],
            InitKind::Normal,
        ));
    }
    out
}
