//! The one bearer-token check of every Sluice server (admin API, env server, inference server):
//! tokens are trimmed where they are loaded, compared in constant time, and refused with the
//! same two messages everywhere.

use hyper::HeaderMap;
use hyper::header::AUTHORIZATION;
use sluice_core::config::Secret;

/// Why a call's bearer token was refused (answered 401 with `WWW-Authenticate: Bearer`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum BearerRefusal {
    /// No `Authorization: Bearer …` header.
    #[error("missing bearer token: send `Authorization: Bearer <token>`")]
    Missing,
    /// A token that is not the configured one.
    #[error("wrong bearer token")]
    Wrong,
}

/// Checks the bearer token of a call against `expected` (every call passes when none is
/// configured). The token given is trimmed, as tokens are where they are loaded ([`token`]).
pub fn check_bearer(expected: Option<&Secret>, headers: &HeaderMap) -> Result<(), BearerRefusal> {
    let Some(expected) = expected else {
        return Ok(());
    };
    let given = headers
        .get(AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| {
            let (scheme, rest) = v.trim().split_once(' ')?;
            scheme.eq_ignore_ascii_case("bearer").then(|| rest.trim())
        });
    match given {
        None => Err(BearerRefusal::Missing),
        Some(t) if constant_time_eq(t.as_bytes(), expected.expose().as_bytes()) => Ok(()),
        Some(_) => Err(BearerRefusal::Wrong),
    }
}

/// Compares without an early exit, so timing does not tell how much of a guess was right
/// (only whether its length was).
pub fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// A token as loaded from a file, a flag or a variable: surrounding whitespace (a Kubernetes
/// Secret made from a file ends in a newline) is not part of it, so a server and its callers
/// compare the same bytes. `None` when nothing is left.
pub fn token(raw: &str) -> Option<Secret> {
    let t = raw.trim();
    (!t.is_empty()).then(|| Secret::new(t))
}

/// The token in the environment variable `var`: `Ok(None)` when unset, an error naming the
/// variable when it is empty (or only whitespace) or not UTF-8.
pub fn token_from_env(var: &str) -> Result<Option<Secret>, String> {
    match std::env::var(var) {
        Ok(t) => token(&t)
            .map(Some)
            .ok_or_else(|| format!("${var}: expected a non-empty token, got an empty string")),
        Err(std::env::VarError::NotPresent) => Ok(None),
        Err(std::env::VarError::NotUnicode(_)) => Err(format!("${var}: expected a UTF-8 token")),
    }
}

#[cfg(test)]
mod tests {
    use hyper::header::HeaderValue;

    use super::*;

    fn headers(auth: Option<&'static str>) -> HeaderMap {
        let mut h = HeaderMap::new();
        if let Some(a) = auth {
            h.insert(AUTHORIZATION, HeaderValue::from_static(a));
        }
        h
    }

    #[test]
    fn bearer_checks_scheme_and_whole_token() {
        let s = Secret::new("s3cret");
        let t = Some(&s);
        assert_eq!(check_bearer(t, &headers(Some("Bearer s3cret"))), Ok(()));
        assert_eq!(check_bearer(t, &headers(Some("bearer  s3cret "))), Ok(()));
        assert_eq!(check_bearer(t, &headers(None)), Err(BearerRefusal::Missing));
        assert_eq!(
            check_bearer(t, &headers(Some("Basic s3cret"))),
            Err(BearerRefusal::Missing)
        );
        for wrong in ["Bearer s3cre", "Bearer s3cretx", "Bearer S3cret"] {
            let h = HeaderMap::from_iter([(AUTHORIZATION, HeaderValue::from_static(wrong))]);
            assert_eq!(check_bearer(t, &h), Err(BearerRefusal::Wrong), "{wrong}");
        }
        assert_eq!(check_bearer(None, &headers(None)), Ok(()));
    }

    #[test]
    fn constant_time_eq_compares_whole_strings() {
        assert!(constant_time_eq(b"s3cret", b"s3cret"));
        assert!(!constant_time_eq(b"s3cre", b"s3cret"));
        assert!(!constant_time_eq(b"", b"s3cret"));
    }

    #[test]
    fn tokens_are_trimmed_at_load() {
        assert_eq!(token("s3cret\n").unwrap().expose(), "s3cret");
        assert_eq!(token("  s3cret \r\n").unwrap().expose(), "s3cret");
        assert!(token(" \n").is_none());
    }
}
