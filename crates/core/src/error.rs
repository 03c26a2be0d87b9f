//! The error type of the core crate, with short stable kind names for metric labels.

use crate::config::ConfigError;
use crate::ids::IdParseError;
use crate::knobs::KnobError;
use crate::rollout::TokenLengthMismatch;

/// Anything the core crate can refuse.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A config file or override was invalid.
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// A knob value was refused.
    #[error(transparent)]
    Knob(#[from] KnobError),
    /// An id string was malformed.
    #[error(transparent)]
    IdParse(#[from] IdParseError),
    /// Token ids, logprobs and versions of a turn did not line up.
    #[error(transparent)]
    TokenLength(#[from] TokenLengthMismatch),
}

impl Error {
    /// Short stable name, used as the `kind` label of `sluice_actor_errors_total`.
    pub fn kind(&self) -> &'static str {
        match self {
            Error::Config(e) => e.kind(),
            Error::Knob(_) => "invalid_knob",
            Error::IdParse(_) => "invalid_id",
            Error::TokenLength(_) => "token_length_mismatch",
        }
    }
}
