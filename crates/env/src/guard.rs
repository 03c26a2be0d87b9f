//! Runs untrusted user code (env calls, reward functions) so that a panic or a hang fails only the
//! call: the future runs on its own tokio task (a panic surfaces as a `JoinError`), under a
//! deadline (the task is aborted when it passes).
//!
//! Limit: a future that blocks its thread without ever yielding cannot be aborted by tokio; it
//! keeps one runtime worker busy. Synchronous reward functions therefore run on the blocking pool
//! ([`run_blocking_guarded`]), where a hang costs a pool thread, not a runtime worker.

use std::any::Any;
use std::future::Future;
use std::time::Duration;

use sluice_core::metrics::ENV_FAILURES;

use crate::error::EnvError;

/// Text of a panic payload.
pub fn panic_message(payload: &(dyn Any + Send)) -> String {
    if let Some(s) = payload.downcast_ref::<&str>() {
        (*s).to_owned()
    } else if let Some(s) = payload.downcast_ref::<String>() {
        s.clone()
    } else {
        "non-string panic payload".to_owned()
    }
}

fn count_failure(err: &EnvError) {
    metrics::counter!(ENV_FAILURES, "kind" => err.kind()).increment(1);
}

/// Runs `fut` on its own task with a deadline. Panics become [`EnvError::Panic`], a passed
/// deadline [`EnvError::Timeout`] (the task is aborted), errors pass through. Every failure is
/// counted in `sluice_env_failures_total{kind}`.
pub async fn run_guarded<T, F>(call: &str, timeout: Duration, fut: F) -> Result<T, EnvError>
where
    T: Send + 'static,
    F: Future<Output = Result<T, EnvError>> + Send + 'static,
{
    let mut handle = tokio::spawn(fut);
    let result = match tokio::time::timeout(timeout, &mut handle).await {
        Ok(Ok(inner)) => inner,
        Ok(Err(join)) => Err(join_error(join)),
        Err(_) => {
            handle.abort();
            Err(EnvError::Timeout {
                call: call.to_owned(),
                after: timeout,
            })
        }
    };
    if let Err(e) = &result {
        count_failure(e);
    }
    result
}

/// Runs a cheap synchronous closure (a parse of the rollout's text, a lookup) where it is called:
/// no blocking-pool hand-off and no deadline, a panic becomes [`EnvError::Panic`] all the same.
/// Only for functions that cannot hang; anything else goes through [`run_blocking_guarded`].
pub fn run_inline_guarded<T>(f: impl FnOnce() -> Result<T, EnvError>) -> Result<T, EnvError> {
    let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(f))
        .unwrap_or_else(|payload| Err(EnvError::Panic(panic_message(&*payload))));
    if let Err(e) = &result {
        count_failure(e);
    }
    result
}

/// Runs a synchronous closure on the blocking pool with a deadline; see [`run_guarded`].
pub async fn run_blocking_guarded<T, F>(call: &str, timeout: Duration, f: F) -> Result<T, EnvError>
where
    T: Send + 'static,
    F: FnOnce() -> Result<T, EnvError> + Send + 'static,
{
    let handle = tokio::task::spawn_blocking(f);
    let result = match tokio::time::timeout(timeout, handle).await {
        Ok(Ok(inner)) => inner,
        Ok(Err(join)) => Err(join_error(join)),
        // A blocking closure cannot be interrupted; the pool thread finishes it on its own.
        Err(_) => Err(EnvError::Timeout {
            call: call.to_owned(),
            after: timeout,
        }),
    };
    if let Err(e) = &result {
        count_failure(e);
    }
    result
}

fn join_error(join: tokio::task::JoinError) -> EnvError {
    if join.is_panic() {
        EnvError::Panic(panic_message(&*join.into_panic()))
    } else {
        EnvError::Failed("task was cancelled".into())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn panics_timeouts_and_errors_are_contained() {
        let t = Duration::from_secs(1);
        let ok = run_guarded("step", t, async { Ok(3) }).await;
        assert_eq!(ok, Ok(3));
        let panicked: Result<u8, _> =
            run_guarded("step", t, async { panic!("boom at step 2") }).await;
        assert_eq!(panicked, Err(EnvError::Panic("boom at step 2".into())));
        let hung: Result<u8, _> = run_guarded("init", t, async {
            tokio::time::sleep(Duration::from_secs(3600)).await;
            Ok(1)
        })
        .await;
        assert_eq!(hung.unwrap_err().kind(), "env_timeout");
        let failed: Result<u8, _> =
            run_guarded("step", t, async { Err(EnvError::Failed("nope".into())) }).await;
        assert_eq!(failed.unwrap_err().kind(), "env_failed");
    }

    #[test]
    fn inline_panics_are_contained() {
        let r: Result<u8, _> = run_inline_guarded(|| panic!("bad parse"));
        assert_eq!(r, Err(EnvError::Panic("bad parse".into())));
        assert_eq!(run_inline_guarded(|| Ok(1.5)), Ok(1.5));
    }

    #[tokio::test]
    async fn blocking_panics_are_contained() {
        let r: Result<u8, _> =
            run_blocking_guarded("reward", Duration::from_secs(5), || panic!("bad reward")).await;
        assert_eq!(r, Err(EnvError::Panic("bad reward".into())));
        let r = run_blocking_guarded("reward", Duration::from_secs(5), || Ok(2.5)).await;
        assert_eq!(r, Ok(2.5));
    }
}
