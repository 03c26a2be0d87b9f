//! OpenAI's error shape: `{"error": {"message", "type", "param", "code"}}` with a real status.

use axum::Json;
use axum::http::{HeaderValue, StatusCode, header};
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
    /// Seconds after which the same call may succeed, sent as `Retry-After` (overload only).
    pub retry_after_s: Option<u32>,
}

/// What an overloaded server tells clients to wait before retrying, seconds: the command queue
/// drains within an engine step or two, so one second is plenty and keeps clients responsive.
pub const RETRY_AFTER_S: u32 = 1;

impl ApiError {
    /// 400 for `param`.
    pub fn invalid(param: &str, message: impl Into<String>) -> Self {
        Self {
            status: StatusCode::BAD_REQUEST,
            message: message.into(),
            kind: "invalid_request_error",
            param: Some(param.to_owned()),
            retry_after_s: None,
        }
    }

    /// 400 without a field (malformed JSON).
    pub fn bad_body(message: impl Into<String>) -> Self {
        Self {
            status: StatusCode::BAD_REQUEST,
            message: message.into(),
            kind: "invalid_request_error",
            param: None,
            retry_after_s: None,
        }
    }

    /// 401: a guarded route called without the server's bearer token (answered with
    /// `WWW-Authenticate: Bearer`).
    pub fn unauthorized(message: impl Into<String>) -> Self {
        Self {
            status: StatusCode::UNAUTHORIZED,
            message: message.into(),
            kind: "authentication_error",
            param: None,
            retry_after_s: None,
        }
    }

    /// 404 (unknown model or route).
    pub fn not_found(param: Option<&str>, message: impl Into<String>) -> Self {
        Self {
            status: StatusCode::NOT_FOUND,
            message: message.into(),
            kind: "not_found_error",
            param: param.map(str::to_owned),
            retry_after_s: None,
        }
    }

    /// 503: the engine is gone or overloaded.
    pub fn unavailable(message: impl Into<String>) -> Self {
        Self {
            status: StatusCode::SERVICE_UNAVAILABLE,
            message: message.into(),
            kind: "server_error",
            param: None,
            retry_after_s: None,
        }
    }

    /// 503 with `Retry-After`: the engine is busy (its command queue is full), not broken; OpenAI
    /// clients retry a 503, never a 400.
    pub fn overloaded(message: impl Into<String>) -> Self {
        Self {
            retry_after_s: Some(RETRY_AFTER_S),
            ..Self::unavailable(message)
        }
    }

    /// 502: a server this one depends on (an engine node's weight source) refused or failed.
    pub fn upstream(message: impl Into<String>) -> Self {
        Self {
            status: StatusCode::BAD_GATEWAY,
            ..Self::unavailable(message)
        }
    }

    /// 500.
    pub fn internal(message: impl Into<String>) -> Self {
        Self {
            status: StatusCode::INTERNAL_SERVER_ERROR,
            message: message.into(),
            kind: "server_error",
            param: None,
            retry_after_s: None,
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
        let mut response = (self.status, Json(self.body())).into_response();
        if self.status == StatusCode::UNAUTHORIZED {
            response
                .headers_mut()
                .insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
        }
        if let Some(s) = self.retry_after_s {
            response
                .headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from(s));
        }
        response
    }
}

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
