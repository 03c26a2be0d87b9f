//! The one way to write a wrapper around an [`InferenceBackend`](crate::InferenceBackend):
//! [`forward_backend!`](crate::forward_backend) writes the calls a wrapper passes through
//! unchanged, so it states only what it changes.
//!
//! A wrapper that forgets a call does not compile: the trait has no default for
//! [`is_alive`](crate::InferenceBackend::is_alive) or
//! [`server_gone`](crate::InferenceBackend::server_gone), so each wrapper either forwards them
//! (listed in the macro) or says why it answers differently. A forwarding wrapper that answered
//! `true` from a default once hid a dead remote server and the run stalled (CHANGELOG.md).
//!
//! ```ignore
//! impl InferenceBackend for Counting {
//!     sluice_engine::forward_backend!(inner => abort, abort_all, update_weights, stats,
//!         shutdown, is_alive, server_gone);
//!     fn submit(&self, request: GenerateRequest) -> Result<(), EngineError> {
//!         self.count.fetch_add(1, Ordering::Relaxed);
//!         self.inner.submit(request)
//!     }
//! }
//! ```

#[doc(hidden)]
pub use sluice_core::{RequestId, WeightSnapshot, WeightUpdateMode};

/// Inside an `impl InferenceBackend for Wrapper` block: writes each listed call as a plain
/// forward to the field `$inner` (any `InferenceBackend`, boxed or not). The calls are `submit`,
/// `abort`, `abort_all`, `update_weights`, `stats`, `shutdown`, `is_alive` and `server_gone`.
#[macro_export]
macro_rules! forward_backend {
    ($inner:ident => $($call:ident),+ $(,)?) => {
        $( $crate::forward_backend!(@call $inner $call); )+
    };
    (@call $inner:ident submit) => {
        fn submit(
            &self,
            request: $crate::backend::GenerateRequest,
        ) -> ::std::result::Result<(), $crate::backend::EngineError> {
            self.$inner.submit(request)
        }
    };
    (@call $inner:ident abort) => {
        fn abort(
            &self,
            id: $crate::forward::RequestId,
        ) -> ::std::result::Result<(), $crate::backend::EngineError> {
            self.$inner.abort(id)
        }
    };
    (@call $inner:ident abort_all) => {
        fn abort_all(&self) -> ::std::result::Result<(), $crate::backend::EngineError> {
            self.$inner.abort_all()
        }
    };
    (@call $inner:ident update_weights) => {
        fn update_weights(
            &self,
            weights: $crate::forward::WeightSnapshot,
            mode: $crate::forward::WeightUpdateMode,
        ) -> ::std::result::Result<(), $crate::backend::EngineError> {
            self.$inner.update_weights(weights, mode)
        }
    };
    (@call $inner:ident stats) => {
        fn stats(&self) -> $crate::backend::EngineStats {
            self.$inner.stats()
        }
    };
    (@call $inner:ident shutdown) => {
        fn shutdown(&mut self) {
            self.$inner.shutdown()
        }
    };
    (@call $inner:ident is_alive) => {
        fn is_alive(&self) -> bool {
            self.$inner.is_alive()
        }
    };
    (@call $inner:ident server_gone) => {
        fn server_gone(&self) -> ::std::option::Option<::std::string::String> {
            self.$inner.server_gone()
        }
    };
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicU32, Ordering};

    use crate::backend::{EngineError, EngineStats, GenerateRequest, InferenceBackend};

    use super::{RequestId, WeightSnapshot, WeightUpdateMode};

    /// A backend that has died, counting the calls that reach it.
    #[derive(Default)]
    struct Dead {
        calls: AtomicU32,
    }

    impl Dead {
        fn called(&self) -> Result<(), EngineError> {
            self.calls.fetch_add(1, Ordering::Relaxed);
            Ok(())
        }
    }

    impl InferenceBackend for Dead {
        fn submit(&self, _: GenerateRequest) -> Result<(), EngineError> {
            self.called()
        }
        fn abort(&self, _: RequestId) -> Result<(), EngineError> {
            self.called()
        }
        fn abort_all(&self) -> Result<(), EngineError> {
            self.called()
        }
        fn update_weights(
            &self,
            _: WeightSnapshot,
            _: WeightUpdateMode,
        ) -> Result<(), EngineError> {
            self.called()
        }
        fn stats(&self) -> EngineStats {
            EngineStats {
                running: u64::from(self.calls.load(Ordering::Relaxed)),
                ..EngineStats::default()
            }
        }
        fn shutdown(&mut self) {
            *self.calls.get_mut() += 100;
        }
        fn is_alive(&self) -> bool {
            false
        }
        fn server_gone(&self) -> Option<String> {
            Some("gone".into())
        }
    }

    /// A wrapper that changes nothing: every call through the macro.
    struct Plain {
        inner: Box<dyn InferenceBackend>,
    }

    impl InferenceBackend for Plain {
        crate::forward_backend!(
            inner => submit, abort, abort_all, update_weights, stats, shutdown, is_alive,
            server_gone
        );
    }

    #[test]
    fn every_forwarded_call_reaches_the_inner_backend() {
        let mut wrapped = Plain {
            inner: Box::new(Dead::default()),
        };
        assert!(
            !wrapped.is_alive(),
            "a dead backend looks dead through the wrapper"
        );
        assert_eq!(wrapped.server_gone().as_deref(), Some("gone"));
        let id = sluice_core::GroupId {
            run: sluice_core::RunId(1),
            node: sluice_core::NodeId(0),
            counter: 0,
        }
        .rollout(0)
        .request(0, 0);
        wrapped.abort(id).unwrap();
        wrapped.abort_all().unwrap();
        let weights = WeightSnapshot::version_only(sluice_core::PolicyVersion(1));
        wrapped
            .update_weights(weights, WeightUpdateMode::Drain)
            .unwrap();
        assert_eq!(wrapped.stats().running, 3);
        wrapped.shutdown();
        assert_eq!(wrapped.stats().running, 103);
    }
}
