//! The two ways to fill in a [`RolloutEnv`](crate::RolloutEnv)'s calls besides `start` and
//! `step`: a wrapper passes them through with [`forward_env!`](crate::forward_env), an env with
//! nothing behind them answers with [`no_env_state!`](crate::no_env_state). Each lists the calls
//! it writes; the trait has no defaults, so an impl that forgets one does not compile.
//!
//! Defaults hid a wrapper's gap before: a wrapper that did not forward `scores_groups` answered
//! "no" from the default and the group rubric behind it never ran, and one that did not forward
//! `set_session_cap` lifted the cap silently.
//!
//! ```ignore
//! impl RolloutEnv for Counting {
//!     sluice_env::forward_env!(inner => start, abandon, scores_groups, score_group,
//!         set_session_cap);
//!     fn step<'a>(&'a self, sample: &'a DataSample, rollout: &'a Rollout, truncated: bool)
//!         -> BoxFuture<'a, (EnvReply, TurnNote)> {
//!         self.steps.fetch_add(1, Ordering::Relaxed);
//!         self.inner.step(sample, rollout, truncated)
//!     }
//! }
//! ```

#[doc(hidden)]
pub use sluice_core::{DataSample, Rollout, RolloutGroup, RolloutId};

/// Inside an `impl RolloutEnv for Wrapper` block: writes each listed call as a plain forward to
/// the field `$inner` (an `Arc<dyn RolloutEnv>` or any `RolloutEnv`). The calls are `start`,
/// `step`, `abandon`, `scores_groups`, `score_group` and `set_session_cap`.
#[macro_export]
macro_rules! forward_env {
    ($inner:ident => $($call:ident),+ $(,)?) => {
        $( $crate::forward_env!(@call $inner $call); )+
    };
    (@call $inner:ident start) => {
        fn start<'a>(
            &'a self,
            sample: &'a $crate::forward::DataSample,
            id: $crate::forward::RolloutId,
        ) -> $crate::BoxFuture<'a, $crate::EnvReply> {
            self.$inner.start(sample, id)
        }
    };
    (@call $inner:ident step) => {
        fn step<'a>(
            &'a self,
            sample: &'a $crate::forward::DataSample,
            rollout: &'a $crate::forward::Rollout,
            truncated: bool,
        ) -> $crate::BoxFuture<'a, ($crate::EnvReply, $crate::TurnNote)> {
            self.$inner.step(sample, rollout, truncated)
        }
    };
    (@call $inner:ident abandon) => {
        fn abandon(&self, id: $crate::forward::RolloutId) -> $crate::BoxFuture<'_, ()> {
            self.$inner.abandon(id)
        }
    };
    (@call $inner:ident scores_groups) => {
        fn scores_groups(&self) -> bool {
            self.$inner.scores_groups()
        }
    };
    (@call $inner:ident score_group) => {
        fn score_group<'a>(
            &'a self,
            sample: &'a $crate::forward::DataSample,
            group: $crate::forward::RolloutGroup,
        ) -> $crate::BoxFuture<'a, $crate::forward::RolloutGroup> {
            self.$inner.score_group(sample, group)
        }
    };
    (@call $inner:ident set_session_cap) => {
        fn set_session_cap(&self, sessions: usize) {
            self.$inner.set_session_cap(sessions)
        }
    };
}

/// Inside an `impl RolloutEnv` block of an env that keeps no per-rollout state and has no group
/// rubric: writes each listed call's answer for such an env. `abandon`: nothing to forget;
/// `scores_groups`: no; `score_group`: the group unchanged; `set_session_cap`: nothing to cap.
#[macro_export]
macro_rules! no_env_state {
    ($($call:ident),+ $(,)?) => {
        $( $crate::no_env_state!(@call $call); )+
    };
    (@call abandon) => {
        fn abandon(&self, _id: $crate::forward::RolloutId) -> $crate::BoxFuture<'_, ()> {
            ::std::boxed::Box::pin(async {})
        }
    };
    (@call scores_groups) => {
        fn scores_groups(&self) -> bool {
            false
        }
    };
    (@call score_group) => {
        fn score_group<'a>(
            &'a self,
            _sample: &'a $crate::forward::DataSample,
            group: $crate::forward::RolloutGroup,
        ) -> $crate::BoxFuture<'a, $crate::forward::RolloutGroup> {
            ::std::boxed::Box::pin(async move { group })
        }
    };
    (@call set_session_cap) => {
        fn set_session_cap(&self, _sessions: usize) {}
    };
}

#[cfg(test)]
mod tests {
    use std::sync::Mutex;

    use sluice_core::{GroupId, NodeId, PolicyVersion, RunId};

    use super::{DataSample, Rollout, RolloutGroup, RolloutId};
    use crate::{BoxFuture, EnvReply, RolloutEnv, TurnNote};

    /// An env with a group rubric and sessions, recording the calls that reach it.
    #[derive(Default)]
    struct Recording {
        calls: Mutex<Vec<String>>,
    }

    impl Recording {
        fn saw(&self, call: impl Into<String>) {
            self.calls.lock().unwrap().push(call.into());
        }
    }

    impl RolloutEnv for Recording {
        fn start<'a>(&'a self, _: &'a DataSample, _: RolloutId) -> BoxFuture<'a, EnvReply> {
            self.saw("start");
            Box::pin(async {
                EnvReply::Continue {
                    next_prompt: vec![1],
                }
            })
        }
        fn step<'a>(
            &'a self,
            _: &'a DataSample,
            _: &'a Rollout,
            _: bool,
        ) -> BoxFuture<'a, (EnvReply, TurnNote)> {
            self.saw("step");
            Box::pin(async {
                let reply = EnvReply::Continue {
                    next_prompt: vec![2],
                };
                (reply, TurnNote::default())
            })
        }
        fn abandon(&self, _: RolloutId) -> BoxFuture<'_, ()> {
            self.saw("abandon");
            Box::pin(async {})
        }
        fn scores_groups(&self) -> bool {
            true
        }
        fn score_group<'a>(
            &'a self,
            _: &'a DataSample,
            mut group: RolloutGroup,
        ) -> BoxFuture<'a, RolloutGroup> {
            self.saw("score_group");
            group.rollouts.truncate(1);
            Box::pin(async move { group })
        }
        fn set_session_cap(&self, sessions: usize) {
            self.saw(format!("cap {sessions}"));
        }
    }

    /// A wrapper that changes nothing: every call through the macro.
    struct Plain {
        inner: Recording,
    }

    impl RolloutEnv for Plain {
        crate::forward_env!(inner => start, step, abandon, scores_groups, score_group,
            set_session_cap);
    }

    /// An env with nothing behind the optional calls.
    struct Stateless;

    impl RolloutEnv for Stateless {
        crate::no_env_state!(abandon, scores_groups, score_group, set_session_cap);
        fn start<'a>(&'a self, _: &'a DataSample, _: RolloutId) -> BoxFuture<'a, EnvReply> {
            Box::pin(std::future::pending())
        }
        fn step<'a>(
            &'a self,
            _: &'a DataSample,
            _: &'a Rollout,
            _: bool,
        ) -> BoxFuture<'a, (EnvReply, TurnNote)> {
            Box::pin(std::future::pending())
        }
    }

    fn group() -> (DataSample, RolloutGroup) {
        let sample = DataSample {
            id: "1".into(),
            domain: "math".into(),
            dataset: "toy".into(),
            input: serde_json::Value::Null,
            system_prompt: None,
        };
        let id = GroupId {
            run: RunId::from_name("t"),
            node: NodeId(0),
            counter: 0,
        };
        let group = RolloutGroup::new(id, sample.clone(), 3, PolicyVersion(0));
        (sample, group)
    }

    #[tokio::test]
    async fn every_forwarded_call_reaches_the_inner_env() {
        let wrapped = Plain {
            inner: Recording::default(),
        };
        let (sample, group) = group();
        let id = group.rollouts[0].id;
        assert!(
            wrapped.scores_groups(),
            "the group rubric behind the wrapper"
        );
        wrapped.start(&sample, id).await;
        wrapped.step(&sample, &group.rollouts[0], false).await;
        wrapped.abandon(id).await;
        assert_eq!(wrapped.score_group(&sample, group).await.rollouts.len(), 1);
        wrapped.set_session_cap(7);
        let calls = wrapped.inner.calls.lock().unwrap().clone();
        assert_eq!(
            calls,
            ["start", "step", "abandon", "score_group", "cap 7"].map(String::from)
        );
    }

    #[tokio::test]
    async fn an_env_without_state_answers_the_neutral_way() {
        let env = Stateless;
        let (sample, group) = group();
        assert!(!env.scores_groups());
        env.abandon(group.rollouts[0].id).await;
        env.set_session_cap(3);
        let scored = env.score_group(&sample, group.clone()).await;
        assert_eq!(scored, group, "the group comes back unchanged");
    }
}
