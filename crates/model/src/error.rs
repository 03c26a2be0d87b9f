//! The model crate's error type: every variant names what failed and where (file, field, tensor),
//! and `kind()` gives a short stable name for metric labels.

use std::path::PathBuf;

/// Anything the model crate can refuse or fail at.
#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    /// `config.json` has a field that is missing, malformed or not supported.
    #[error("model config {path}: field `{field}`: {reason}")]
    Config {
        /// The file (or `<memory>` for a config built in code).
        path: String,
        /// The offending field.
        field: String,
        /// What was expected.
        reason: String,
    },
    /// A file could not be read or written.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The OS error.
        source: std::io::Error,
    },
    /// A model-directory file is not a regular file or is larger than its cap.
    #[error(transparent)]
    File(#[from] sluice_core::files::ReadFileError),
    /// A JSON file could not be parsed or written.
    #[error("{path}: invalid JSON: {source}")]
    Json {
        /// The file.
        path: PathBuf,
        /// The parser's error.
        source: serde_json::Error,
    },
    /// A safetensors file could not be parsed or written.
    #[error("{path}: safetensors: {reason}")]
    Safetensors {
        /// The file.
        path: PathBuf,
        /// What went wrong.
        reason: String,
    },
    /// A tensor the architecture needs is not in the checkpoint.
    #[error("tensor `{name}` is missing from the checkpoint in {dir}")]
    MissingTensor {
        /// HF tensor name, e.g. `model.layers.0.self_attn.q_proj.weight`.
        name: String,
        /// The checkpoint directory.
        dir: PathBuf,
    },
    /// A tensor has the wrong shape for the config.
    #[error("tensor `{name}` has shape {actual:?}, config implies {expected:?}")]
    TensorShape {
        /// HF tensor name.
        name: String,
        /// Shape implied by config.json.
        expected: Vec<usize>,
        /// Shape found.
        actual: Vec<usize>,
    },
    /// A weight tensor is stored with a non-float dtype (`I64`, `U8`, …): loading would convert
    /// integers to weights silently.
    #[error("{path}: tensor `{name}` is stored as {dtype}; weights must be F16, BF16, F32 or F64")]
    TensorDtype {
        /// The file.
        path: PathBuf,
        /// HF tensor name.
        name: String,
        /// The dtype found.
        dtype: String,
    },
    /// A tensor holds NaN or infinite values (a diverged run's weights): loading it would only
    /// produce garbage rollouts that every later check filters out.
    #[error("{path}: tensor `{name}` holds NaN or infinite values")]
    NonFinite {
        /// The file.
        path: PathBuf,
        /// HF tensor name.
        name: String,
    },
    /// A tensor operation failed (shape mismatch, device error, out of memory). candle's
    /// error is said in the message (without the backtrace candle may append), not chained as
    /// a source, so it is printed once.
    #[error("{context}: {}", candle_message(error))]
    Tensor {
        /// What was being computed.
        context: String,
        /// candle's error.
        error: candle_core::Error,
    },
    /// `tokenizer.json` or the token configuration could not be used.
    #[error("tokenizer {path}: {reason}")]
    Tokenizer {
        /// The file (or what was being tokenized).
        path: String,
        /// What went wrong.
        reason: String,
    },
    /// The chat template could not be compiled or rendered.
    #[error("chat template: {reason}")]
    ChatTemplate {
        /// minijinja's message, with the line when it has one.
        reason: String,
    },
    /// The paged KV cache has no free block for a sequence's new tokens (the engine preempts
    /// before this happens; a direct caller sees it).
    #[error(
        "kv cache full: sequence {seq} needs {needed} more blocks, {available} of {total} are available"
    )]
    KvCacheFull {
        /// The sequence.
        seq: u64,
        /// Blocks it needed.
        needed: usize,
        /// Blocks free or evictable.
        available: usize,
        /// Blocks in the pool.
        total: usize,
    },
    /// A configured device cannot be opened: a CPU-only build asked for `cuda:N`, no CUDA
    /// driver or library could be loaded, or the ordinal names no device.
    #[error("{device}: {reason}")]
    Device {
        /// The device asked for (`cuda:0`).
        device: String,
        /// Why it cannot be used.
        reason: String,
    },
    /// A GGUF file could not be read or imported: truncated, an architecture, tensor type or
    /// tokenizer that is not supported, or tensors that disagree with the metadata.
    #[error("{path}: {reason}")]
    Gguf {
        /// The GGUF file.
        path: PathBuf,
        /// What was wrong, naming the metadata key or tensor.
        reason: String,
    },
    /// A caller passed inconsistent input (lengths, unknown sequence, token out of vocabulary).
    #[error("invalid input: {reason}")]
    Input {
        /// What was inconsistent.
        reason: String,
    },
}

impl ModelError {
    /// Short stable name, used as a metric label.
    pub fn kind(&self) -> &'static str {
        match self {
            ModelError::Config { .. } => "invalid_model_config",
            ModelError::Io { .. } => "model_io",
            ModelError::File(e) => e.kind(),
            ModelError::Json { .. } => "model_json",
            ModelError::Safetensors { .. } => "safetensors",
            ModelError::MissingTensor { .. } => "missing_tensor",
            ModelError::TensorShape { .. } => "tensor_shape",
            ModelError::TensorDtype { .. } => "tensor_dtype",
            ModelError::NonFinite { .. } => "non_finite_weights",
            ModelError::Tensor { .. } => "tensor_op",
            ModelError::Tokenizer { .. } => "tokenizer",
            ModelError::ChatTemplate { .. } => "chat_template",
            ModelError::KvCacheFull { .. } => "kv_cache_full",
            ModelError::Device { .. } => "device",
            ModelError::Gguf { .. } => "gguf",
            ModelError::Input { .. } => "invalid_input",
        }
    }

    /// An invalid-input error.
    pub(crate) fn input(reason: impl Into<String>) -> Self {
        ModelError::Input {
            reason: reason.into(),
        }
    }

    /// An I/O error on `path`.
    pub(crate) fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        ModelError::Io {
            path: path.into(),
            source,
        }
    }
}

/// Result alias of this crate.
pub type Result<T, E = ModelError> = std::result::Result<T, E>;

/// Attaches a context string to candle errors (`.ctx("attention layer 3")?`).
pub(crate) trait TensorContext<T> {
    /// Wraps the error with `context`.
    fn ctx(self, context: &str) -> Result<T>;
}

impl<T> TensorContext<T> for candle_core::Result<T> {
    fn ctx(self, context: &str) -> Result<T> {
        self.map_err(|error| ModelError::Tensor {
            context: context.to_owned(),
            error,
        })
    }
}

/// candle's message without the backtrace it appends when `RUST_BACKTRACE` is set (its first
/// line is a path inside candle's sources, which tells a user nothing about their file).
pub(crate) fn candle_message(e: &candle_core::Error) -> String {
    use candle_core::Error as E;
    match e {
        E::WithBacktrace { inner, .. } => candle_message(inner),
        E::Context { inner, context } => format!("{context}: {}", candle_message(inner)),
        E::WithPath { inner, path } => format!("{}: {}", path.display(), candle_message(inner)),
        other => other.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::error::Error as _;

    /// A failed tensor op is said once, without the backtrace candle appends under
    /// `RUST_BACKTRACE` (a path inside candle's sources).
    #[test]
    fn tensor_errors_carry_no_backtrace() {
        let inner = candle_core::Error::Msg("shape mismatch in matmul".into());
        let error = candle_core::Error::WithBacktrace {
            inner: Box::new(inner),
            backtrace: Box::new(std::backtrace::Backtrace::force_capture()),
        };
        assert!(
            error.to_string().lines().count() > 1,
            "the backtrace is in candle's text"
        );
        let e = ModelError::Tensor {
            context: "attention layer 3".into(),
            error,
        };
        assert_eq!(e.to_string(), "attention layer 3: shape mismatch in matmul");
        assert!(e.source().is_none(), "candle's error is not chained again");
    }
}
