//! [`TrainerError`]: what can go wrong in a training step or a checkpoint, with a stable
//! [`TrainerError::kind`] for metric labels.

use std::path::PathBuf;

use sluice_core::BackendError;

use crate::loss::LossInputError;
use crate::optim::OptimError;

/// A training step or checkpoint failed.
#[derive(Debug, thiserror::Error)]
pub enum TrainerError {
    /// The model crate refused or failed (forward, snapshot, load, save).
    #[error(transparent)]
    Model(#[from] sluice_model::ModelError),
    /// The optimizer failed.
    #[error(transparent)]
    Optim(#[from] OptimError),
    /// Loss inputs did not line up.
    #[error(transparent)]
    Loss(#[from] LossInputError),
    /// A tensor operation of the trainer failed.
    #[error("trainer: {context}: {source}")]
    Tensor {
        /// What was being done.
        context: String,
        /// The candle error.
        source: candle_core::Error,
    },
    /// Reading or writing a checkpoint failed.
    #[error("checkpoint {path}: {message}")]
    Checkpoint {
        /// The file or directory.
        path: PathBuf,
        /// What went wrong.
        message: String,
    },
    /// The caller passed something unusable.
    #[error("trainer input: {0}")]
    Input(String),
    /// A step's loss was NaN or infinite: its optimizer update was refused, so no weight moved
    /// in it and nothing was published.
    #[error(
        "the training {what} is {value}: the optimizer update is refused (no weight changed, \
         nothing published); a corrupt checkpoint (huge weights) or a diverging run gives this"
    )]
    NonFinite {
        /// What was not finite.
        what: &'static str,
        /// Its value.
        value: f64,
    },
}

impl TrainerError {
    /// Short stable name.
    pub fn kind(&self) -> &'static str {
        match self {
            Self::Model(_) => "trainer_model",
            Self::Optim(e) => e.kind(),
            Self::Loss(_) => "trainer_loss_input",
            Self::Tensor { .. } => "trainer_tensor",
            Self::Checkpoint { .. } => "trainer_checkpoint",
            Self::Input(_) => "trainer_input",
            Self::NonFinite { .. } => "non_finite_loss",
        }
    }

    /// As the backend error the trainer actor expects.
    pub fn into_backend(self) -> BackendError {
        BackendError::new(self.kind(), self.to_string())
    }

    /// A checkpoint error about `path`.
    pub fn checkpoint(path: impl Into<PathBuf>, message: impl std::fmt::Display) -> Self {
        Self::Checkpoint {
            path: path.into(),
            message: message.to_string(),
        }
    }
}

/// Maps a candle error to [`TrainerError::Tensor`] with `context`.
pub fn tensor_ctx(context: &str) -> impl FnOnce(candle_core::Error) -> TrainerError + '_ {
    move |source| TrainerError::Tensor {
        context: context.to_owned(),
        source,
    }
}
