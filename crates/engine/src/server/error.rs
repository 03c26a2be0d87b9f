//! OpenAI's error shape: `{"error": {"message", "type", "param", "code"}}` with a real status.

use axum::Json;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde_json::json;

/// A refused or failed API call.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ApiError {
    /// HTTP status.
    pub status: StatusCode,
    /// What went wrong, for a person.
    pub message: String,
    /// OpenAI's `type` (`invalid_request_error`, `not_found_error`, `server_error`).
    pub kind: &'static str,
    /// The request field at fault, when one is.
    pub param: Option<String>,
}

impl ApiError {
    /// 400 for `param`.
    pub fn invalid(param: &str, message: impl Into<String>) -> Self {
        Self {
            status: StatusCode::BAD_REQUEST,
            message: message.into(),
            kind: "invalid_request_error",
            param: Some(param.to_owned()),
        }
    }

    /// 400 without a field (malformed JSON).
    pub fn bad_body(message: impl Into<String>) -> Self {
        Self {
            status: StatusCode::BAD_REQUEST,
            message: message.into(),
            kind: "invalid_request_error",
            param: None,
        }
    }

    /// 404 (unknown model or route).
    pub fn not_found(param: Option<&str>, message: impl Into<String>) -> Self {
        Self {
            status: StatusCode::NOT_FOUND,
            message: message.into(),
            kind: "not_found_error",
            param: param.map(str::to_owned),
        }
    }

    /// 503: the engine is gone or overloaded.
    pub fn unavailable(message: impl Into<String>) -> Self {
        Self {
            status: StatusCode::SERVICE_UNAVAILABLE,
            message: message.into(),
            kind: "server_error",
            param: None,
        }
    }

    /// 500.
    pub fn internal(message: impl Into<String>) -> Self {
        Self {
            status: StatusCode::INTERNAL_SERVER_ERROR,
            message: message.into(),
            kind: "server_error",
            param: None,
        }
    }

    /// The JSON body.
    pub fn body(&self) -> serde_json::Value {
        json!({"error": {
            "message": self.message,
            "type": self.kind,
            "param": self.param,
            "code": self.status.as_u16(),
        }})
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        (self.status, Json(self.body())).into_response()
    }
}

impl From<crate::backend::EngineError> for ApiError {
    fn from(e: crate::backend::EngineError) -> Self {
        match e {
            crate::backend::EngineError::BadRequest { reason, .. } => Self::bad_body(reason),
            stopped @ crate::backend::EngineError::Stopped { .. } => {
                Self::unavailable(stopped.to_string())
            }
        }
    }
}
