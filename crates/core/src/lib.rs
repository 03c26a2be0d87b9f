//! Shared vocabulary of Sluice: every other crate speaks in these types.
//!
//! | module | what it holds |
//! |---|---|
//! | [`backend`] | [`WeightSnapshot`] and the [`TrainerBackend`] trait the trainer actor drives |
//! | [`ids`] | [`RunId`], [`NodeId`], [`GroupId`], [`RolloutId`], [`RequestId`], [`PolicyVersion`] and the group-id generator |
//! | [`message`] | [`Message`] in the OpenAI chat shape, tool calls and tool specs |
//! | [`completion`] | [`CompletionParser`]: completion text → assistant message (reasoning, tool calls) |
//! | [`rollout`] | [`DataSample`], [`RolloutTurn`], [`Rollout`], [`RolloutGroup`], [`RolloutStatus`] |
//! | [`knobs`] | the runtime [`Knobs`], patches to them and the shared [`KnobsHandle`] |
//! | [`config`] | [`ConfigError`], the checks every crate validates its own config section with, and the config types several crates share (`Device`, `DType`, `Secret`); `sluice-config` composes the file |
//! | [`choice`] | [`Choice`](choice::Choice): enums whose serde names are their config spellings |
//! | [`metrics`] | the one catalog of Prometheus metric names, with help text |
//! | [`sim`] | what the simulated engine and trainer share (simulated seconds → real time) |
//! | [`rng`] | SplitMix64 and the seed mixer every crate draws with |
//! | [`error`] | the crate's error type and its stable `kind()` names |
//! | [`files`] | [`read_capped`](files::read_capped): user files read as regular files under a size cap |
//!
//! This crate depends on nothing else of Sluice (see `DESIGN.md` §1): it is the bottom of the graph.

pub mod backend;
pub mod choice;
pub mod completion;
pub mod config;
pub mod error;
pub mod files;
pub mod ids;
pub mod knobs;
pub mod message;
pub mod metrics;
pub mod rng;
pub mod rollout;
pub mod sim;

pub use backend::{
    BackendError, SituationAdvantage, SituationAdvantages, TrainStepOutput, TrainerBackend,
    WeightSnapshot,
};
pub use completion::{CompletionParseError, CompletionParser};
pub use config::ConfigError;
pub use error::Error;
pub use ids::{
    FutureVersion, GroupId, GroupIdGenerator, NodeId, PolicyVersion, RequestId, RolloutId, RunId,
};
pub use knobs::{
    AdmissionMode, KnobError, KnobPatch, KnobResumed, KnobState, Knobs, KnobsHandle,
    WeightUpdateMode,
};
pub use message::{Message, Role, ToolCall, ToolSpec};
pub use rollout::{DataSample, Rollout, RolloutGroup, RolloutStatus, RolloutTurn};
