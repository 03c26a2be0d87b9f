//! The versioned replay store (`DESIGN.md` §4.1, §4.4): pure logic plus crash-safe persistence.
//!
//! | module | what it holds |
//! |---|---|
//! | [`bucket`] | the per-group state machine `Pending → InFlight → Completed \| Aborted \| Expired \| Failed \| Filtered → Consumed` |
//! | [`store`] | [`ReplayStore`]: groups by bucket, transition counters, admission accounting, `take_batch`, the groups waiting to resume by [`Lane`] |
//! | [`admission`] | the admission bound and the over-sending target, as pure functions |
//! | [`scheduler`] | [`RolloutScheduler`]: what generates next — resumes first, over-sending, admission, tail rounds — from the store's counts |
//! | [`persist`] | [`Persister`]: the redb database under the run's output dir |
//! | [`error`] | [`ReplayError`] with stable `kind()` names |
//! | [`config`] | the `[replay]` config section: raw → [`validate_replay`](config::validate_replay) → [`ReplayConfig`](config::ReplayConfig) |
//!
//! No threads, no actors: the replay actor wraps this crate and decides when to flush.

pub mod admission;
pub mod bucket;
pub mod config;
pub mod error;
mod offline;
pub mod persist;
pub mod progress;
pub mod scheduler;
pub mod store;

pub use admission::{
    Pace, admission_allows, demand_allows, in_flight_cap, in_flight_target, remaining_for_step,
};
pub use bucket::{Bucket, BucketCounts, Transition};
pub use error::ReplayError;
pub use offline::clear_stopped_store;
pub use persist::{DB_FILE, PersistOp, Persister, Recovered};
pub use progress::{GroupSummary, ProgressWatch};
pub use scheduler::{Decision, RolloutScheduler, SchedulerStats, SchedulerView};
pub use store::{
    ClearOutcome, Counters, FinishOutcome, Lane, ReplayStore, ResumedGroups, StoreSnapshot,
    TakeOutcome, Waiting,
};
