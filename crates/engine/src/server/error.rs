//! The server's refusals: the kit's [`ApiError`] (OpenAI's shape,
//! `{"error": {"message", "type", "param", "code"}}`, with a real status; `sluice_http::api`),
//! and how an engine failure maps onto it.

pub use sluice_http::api::{ApiError, RETRY_AFTER_S};

impl From<crate::backend::EngineError> for ApiError {
    fn from(e: crate::backend::EngineError) -> Self {
        match e {
            crate::backend::EngineError::BadRequest { reason, .. } => Self::bad_body(reason),
            stopped @ (crate::backend::EngineError::Stopped { .. }
            | crate::backend::EngineError::Start { .. }
            | crate::backend::EngineError::NoServer { .. }) => {
                Self::unavailable(stopped.to_string())
            }
            busy @ crate::backend::EngineError::Overloaded { .. } => {
                Self::overloaded(busy.to_string())
            }
        }
    }
}
