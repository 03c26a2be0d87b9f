//! The server kit every Sluice JSON API shares (the admin API, a head's cluster routes, the
//! inference server): one refusal type answered in one shape, the bearer check as a refusal,
//! and the rules a request body must follow.
//!
//! A refusal answers a real status with `{"error": {"message", "type", "param", "code"}}`
//! (OpenAI's shape, which OpenAI clients of the inference server parse): `type` is a short
//! stable name (`invalid_json`, `authentication_error`, …), `param` the request field at fault
//! or `null`, `code` the status again. A 401 carries `WWW-Authenticate: Bearer`, a 503 from an
//! overloaded server `Retry-After`. A protocol that documents more members of the error object
//! (the env protocol's `kind` and `deadline_ms`) adds them with [`ApiError::with_detail`]; they
//! never replace the four above.

use axum::Json;
use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde::de::DeserializeOwned;
use serde_json::json;
use sluice_core::config::Secret;

use crate::auth::{BearerRefusal, check_bearer};

/// Largest body of a control call (a knob patch, a join, a heartbeat); larger ones answer 413.
/// Generation requests carry prompts and set their own limit.
pub const MAX_BODY_BYTES: usize = 64 * 1024;

/// What an overloaded server tells clients to wait before retrying, seconds: a command queue
/// drains within an engine step or two, so one second is plenty and keeps clients responsive.
pub const RETRY_AFTER_S: u32 = 1;

/// A refused or failed API call.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ApiError {
    /// HTTP status.
    pub status: StatusCode,
    /// What went wrong, for a person.
    pub message: String,
    /// Short stable name, answered as `type`.
    pub kind: &'static str,
    /// The request field at fault, when one is.
    pub param: Option<String>,
    /// Seconds after which the same call may succeed, sent as `Retry-After` (overload only).
    pub retry_after_s: Option<u32>,
    /// Members of the error object beyond `message`, `type`, `param` and `code`, in the order
    /// added: what a protocol documents on top of the kit's shape.
    pub details: Vec<(&'static str, serde_json::Value)>,
}

impl ApiError {
    /// A refusal with `status`, `kind` and `message`.
    pub fn new(status: StatusCode, kind: &'static str, message: impl Into<String>) -> Self {
        Self {
            status,
            message: message.into(),
            kind,
            param: None,
            retry_after_s: None,
            details: Vec::new(),
        }
    }

    /// The same refusal with one more member `name` in its error object (a member of the
    /// kit's shape keeps its value).
    pub fn with_detail(mut self, name: &'static str, value: impl Into<serde_json::Value>) -> Self {
        self.details.push((name, value.into()));
        self
    }

    /// 400 for the request field `param` (`invalid_request_error`).
    pub fn invalid(param: &str, message: impl Into<String>) -> Self {
        Self {
            param: Some(param.to_owned()),
            ..Self::bad_body(message)
        }
    }

    /// 400 without a field: a malformed body (`invalid_request_error`).
    pub fn bad_body(message: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, "invalid_request_error", message)
    }

    /// 401: a guarded route called without the server's bearer token
    /// (`authentication_error`).
    pub fn unauthorized(message: impl Into<String>) -> Self {
        Self::new(StatusCode::UNAUTHORIZED, "authentication_error", message)
    }

    /// 404 for `param` (an unknown model) or for the route (`not_found_error`).
    pub fn not_found(param: Option<&str>, message: impl Into<String>) -> Self {
        Self {
            param: param.map(str::to_owned),
            ..Self::new(StatusCode::NOT_FOUND, "not_found_error", message)
        }
    }

    /// 503: the server's engine is gone (`server_error`).
    pub fn unavailable(message: impl Into<String>) -> Self {
        Self::new(StatusCode::SERVICE_UNAVAILABLE, "server_error", message)
    }

    /// 503 with `Retry-After`: busy (a full command queue), not broken; OpenAI clients retry a
    /// 503, never a 400.
    pub fn overloaded(message: impl Into<String>) -> Self {
        Self {
            retry_after_s: Some(RETRY_AFTER_S),
            ..Self::unavailable(message)
        }
    }

    /// 502: a server this one depends on refused or failed (`server_error`).
    pub fn upstream(message: impl Into<String>) -> Self {
        Self {
            status: StatusCode::BAD_GATEWAY,
            ..Self::unavailable(message)
        }
    }

    /// 500 (`server_error`).
    pub fn internal(message: impl Into<String>) -> Self {
        Self::new(StatusCode::INTERNAL_SERVER_ERROR, "server_error", message)
    }

    /// The JSON body.
    pub fn body(&self) -> serde_json::Value {
        let mut error = json!({
            "message": self.message,
            "type": self.kind,
            "param": self.param,
            "code": self.status.as_u16(),
        });
        if let Some(members) = error.as_object_mut() {
            for (name, value) in &self.details {
                members.entry(*name).or_insert_with(|| value.clone());
            }
        }
        json!({ "error": error })
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

/// The bearer check of a guarded route as a refusal: 401 of kind `kind`; a missing token's
/// message names `setting`, where the server's token is configured (`admin.token`), when given.
/// The comparison is [`check_bearer`]'s, in constant time.
pub fn authorize(
    expected: Option<&Secret>,
    headers: &HeaderMap,
    kind: &'static str,
    setting: Option<&str>,
) -> Result<(), ApiError> {
    check_bearer(expected, headers).map_err(|refusal| {
        let message = match (refusal, setting) {
            (BearerRefusal::Missing, Some(setting)) => format!("{refusal} ({setting})"),
            _ => refusal.to_string(),
        };
        ApiError::new(StatusCode::UNAUTHORIZED, kind, message)
    })
}

/// The body of a call, or why it cannot be read: over the router's body limit of `limit_bytes`,
/// 413 `payload_too_large`; otherwise the extractor's status, `invalid_body`.
pub fn read_body(
    body: Result<Bytes, BytesRejection>,
    limit_bytes: usize,
) -> Result<Bytes, ApiError> {
    body.map_err(|r| match r.status() {
        StatusCode::PAYLOAD_TOO_LARGE => ApiError::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            "payload_too_large",
            format!("request body over {limit_bytes} bytes"),
        ),
        status => ApiError::new(status, "invalid_body", r.body_text()),
    })
}

/// Refuses a body that does not say it is JSON: 415 `unsupported_media_type`.
pub fn require_json(headers: &HeaderMap) -> Result<(), ApiError> {
    let ct = headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("");
    let essence = ct.split(';').next().unwrap_or("").trim();
    if essence.eq_ignore_ascii_case("application/json") {
        Ok(())
    } else {
        Err(ApiError::new(
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
            "unsupported_media_type",
            format!(
                "expected Content-Type: application/json, got `{}`",
                if ct.is_empty() { "none" } else { ct }
            ),
        ))
    }
}

/// `body` read as JSON into `T`: 400 of kind `kind`, the message starting with `what`
/// (`invalid JSON`, `invalid knob patch`) and serde's reason.
pub fn parse_json<T: DeserializeOwned>(
    body: &[u8],
    kind: &'static str,
    what: &str,
) -> Result<T, ApiError> {
    serde_json::from_slice(body)
        .map_err(|e| ApiError::new(StatusCode::BAD_REQUEST, kind, format!("{what}: {e}")))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn refusals_answer_one_shape() {
        let e = ApiError::invalid("prompt", "the prompt is empty");
        assert_eq!(
            e.body(),
            json!({"error": {"message": "the prompt is empty", "type": "invalid_request_error",
                "param": "prompt", "code": 400}})
        );
        let e = ApiError::new(StatusCode::GATEWAY_TIMEOUT, "env_timeout", "late")
            .with_detail("kind", "env_timeout")
            .with_detail("deadline_ms", 30_000)
            .with_detail("code", "ignored");
        assert_eq!(
            e.body(),
            json!({"error": {"message": "late", "type": "env_timeout", "param": null,
                "code": 504, "kind": "env_timeout", "deadline_ms": 30_000}})
        );
        let r = ApiError::overloaded("busy").into_response();
        assert_eq!(r.status(), StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(r.headers()[header::RETRY_AFTER], "1");
        let r = ApiError::new(StatusCode::UNAUTHORIZED, "unauthorized", "no").into_response();
        assert_eq!(r.headers()[header::WWW_AUTHENTICATE], "Bearer");
    }

    #[test]
    fn authorize_names_the_setting_of_a_missing_token() {
        let token = Secret::new("s3cret");
        let missing = authorize(
            Some(&token),
            &HeaderMap::new(),
            "unauthorized",
            Some("admin.token"),
        )
        .unwrap_err();
        assert_eq!(missing.status, StatusCode::UNAUTHORIZED);
        assert_eq!(
            missing.message,
            "missing bearer token: send `Authorization: Bearer <token>` (admin.token)"
        );
        let mut wrong = HeaderMap::new();
        wrong.insert(
            header::AUTHORIZATION,
            HeaderValue::from_static("Bearer nope"),
        );
        let e = authorize(Some(&token), &wrong, "authentication_error", None).unwrap_err();
        assert_eq!(
            (e.kind, e.message.as_str()),
            ("authentication_error", "wrong bearer token")
        );
        assert!(authorize(None, &HeaderMap::new(), "unauthorized", None).is_ok());
    }

    #[test]
    fn bodies_must_say_json_and_parse() {
        let mut h = HeaderMap::new();
        assert_eq!(
            require_json(&h).unwrap_err().status,
            StatusCode::UNSUPPORTED_MEDIA_TYPE
        );
        h.insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/json; charset=utf-8"),
        );
        assert!(require_json(&h).is_ok());
        let e = parse_json::<serde_json::Value>(b"{", "invalid_json", "invalid JSON").unwrap_err();
        assert_eq!(
            (e.status, e.kind),
            (StatusCode::BAD_REQUEST, "invalid_json")
        );
        assert!(e.message.starts_with("invalid JSON: EOF"), "{}", e.message);
    }
}
