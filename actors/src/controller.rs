//! The RolloutController actor: decides what generates next (§4.1–4.3) and assembles groups.
//!
//! The decision rules (aborted-first resumes, over-sending, η and demand admission, tail rounds)
//! are [`sluice_replay::RolloutScheduler`]'s; the actor feeds it every event and carries out what it
//! decides. Weight updates during a tail round drain instead of aborting. What stays here is the
//! per-group assembly: engine requests, env steps, turn stitching, replica affinity of resumed
//! rollouts, the weight relay and the outcome statistics.
//!
//! A group counts as in flight from admission (or a resume request) until the replay store has
//! durably stored it, so an acknowledged completion and the in-flight count never overlap.

mod admission;
mod assembly;
mod clocks;
mod groups;
mod relay;
mod shape;
mod status;

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::Arc;

use ractor::{Actor, ActorProcessingErr, ActorRef, RpcReplyPort};
use sluice_core::{
    DataSample, GroupId, GroupIdGenerator, KnobsHandle, NodeId, PolicyVersion, RunId,
};
use sluice_engine::SamplingParams;
use sluice_env::OutcomeStats;
use sluice_replay::{GroupSummary, Lane, Pace, ProgressWatch, RolloutScheduler};

use crate::counters::ActorCounters;
use crate::engine::{EngineHandle, EngineReport};
use crate::env_worker::{EnvPoolHandle, EnvResult};
use crate::events::RunEvents;
use crate::replay::{Recovery, ReplayCounts, ReplayHandle, ReplayNotice};
use crate::sampler::SamplerHandle;
use crate::trainer::StepEvent;
use crate::{ActorError, Sink};

use assembly::Assembly;
use groups::GroupMeta;
pub use shape::{DomainShapeStatus, LengthBiasStatus};
pub use status::{BalanceStatus, ControllerStatus, PaceStatus};

/// Weight of a new reward in the outcome EMA.
const OUTCOME_EMA_ALPHA: f64 = 0.05;
/// Groups kept for the balance fractions.
const BALANCE_WINDOW: usize = 256;

/// The controller's fixed configuration (what changes lives in the knobs).
#[derive(Debug, Clone)]
pub struct ControllerConfig {
    /// Run id (for group ids).
    pub run: RunId,
    /// Node id (for group ids).
    pub node: NodeId,
    /// Rollouts per group.
    pub group_size: u32,
    /// Groups per training step (`B`).
    pub groups_per_step: u32,
    /// Untrainable groups in a row that stop the run (0 = never).
    pub no_progress_groups: u64,
    /// Sampling parameters of every request (`max_tokens` = tokens per turn).
    pub sampling: SamplingParams,
    /// Tokens per turn of the domains with their own budget (`data.domains.<d>.max_new_tokens`).
    pub domain_turn_tokens: std::collections::BTreeMap<String, u32>,
    /// Group mean reward below / above which a group counts as too hard / too easy
    /// (`rollout.balance_threshold`).
    pub balance_threshold: f64,
    /// Most groups admitted and not yet trained (`replay.capacity`).
    pub replay_capacity: Option<u64>,
    /// DAPO's soft overlong punishment of finished rollouts' rewards
    /// (`rollout.overlong_buffer_tokens`; `None`: off).
    pub overlong: Option<sluice_env::OverlongShaping>,
}

impl ControllerConfig {
    /// Tokens per turn of `domain`'s requests: its own budget, else `rollout.max_new_tokens`.
    pub fn turn_tokens(&self, domain: &str) -> u32 {
        self.domain_turn_tokens
            .get(domain)
            .copied()
            .unwrap_or(self.sampling.max_tokens)
    }
}

/// The peers the controller drives, handed over once they are started.
pub struct Peers {
    /// Dataset sampler.
    pub sampler: SamplerHandle,
    /// Inference engine.
    pub engine: EngineHandle,
    /// Environment pool (first prompts, steps, rewards).
    pub env: EnvPoolHandle,
    /// Replay store.
    pub replay: ReplayHandle,
    /// What the replay store recovered.
    pub recovery: Recovery,
}

enum Cmd {
    Connect(Box<Peers>),
    Samples(Vec<DataSample>),
    Engine(EngineReport),
    Env(EnvResult),
    Replay(ReplayNotice),
    Step(Arc<StepEvent>),
    Knobs,
    Status(RpcReplyPort<ControllerStatus>),
    Close(RpcReplyPort<()>),
}

/// The actor's messages (private: use [`ControllerHandle`]).
pub struct ControllerMsg(Cmd);

/// Typed handle; cloning is shallow.
#[derive(Clone)]
pub struct ControllerHandle {
    actor: ActorRef<ControllerMsg>,
}

impl ControllerHandle {
    /// The actor's cell (for linking it to a supervisor).
    pub fn cell(&self) -> ractor::ActorCell {
        self.actor.get_cell()
    }

    /// Starts the controller; it waits for [`ControllerHandle::connect`].
    pub async fn spawn(
        config: ControllerConfig,
        knobs: KnobsHandle,
        events: RunEvents,
    ) -> Result<(Self, tokio::task::JoinHandle<()>), ActorError> {
        let (actor, join) = Actor::spawn(None, ControllerActor, (config, knobs, events))
            .await
            .map_err(|e| ActorError::Spawn {
                actor: "controller",
                message: e.to_string(),
            })?;
        Ok((Self { actor }, join))
    }

    fn sink<T: Send + 'static>(&self, wrap: fn(T) -> Cmd) -> Sink<T> {
        let actor = self.actor.clone();
        Arc::new(move |t| {
            let _ = actor.cast(ControllerMsg(wrap(t)));
        })
    }

    /// Where the sampler delivers samples.
    pub fn sample_sink(&self) -> Sink<Vec<DataSample>> {
        self.sink(Cmd::Samples)
    }

    /// Where the engine reports.
    pub fn engine_sink(&self) -> Sink<EngineReport> {
        self.sink(Cmd::Engine)
    }

    /// Where env workers report.
    pub fn env_sink(&self) -> Sink<EnvResult> {
        self.sink(Cmd::Env)
    }

    /// Where the replay store reports.
    pub fn replay_sink(&self) -> Sink<ReplayNotice> {
        self.sink(Cmd::Replay)
    }

    /// Where the trainer reports each step: its compute time (the demand-aware admission's pace)
    /// and the weights it published, which the controller relays to the engine with the
    /// effective update mode, and to the replay store.
    pub fn step_sink(&self) -> Sink<Arc<StepEvent>> {
        self.sink(Cmd::Step)
    }

    /// Hands the peers over and starts scheduling.
    pub fn connect(&self, peers: Peers) {
        let _ = self
            .actor
            .cast(ControllerMsg(Cmd::Connect(Box::new(peers))));
    }

    /// The controller's view.
    pub async fn status(&self) -> Result<ControllerStatus, ActorError> {
        self.ask(Cmd::Status).await
    }

    /// A graceful stop has begun: from the answer on, nothing is admitted or resumed (the engine
    /// is about to answer every request as aborted), while what is in flight is still stored.
    /// A pause is not enough: it lets admitted groups resume.
    pub async fn close(&self) -> Result<(), ActorError> {
        self.ask(Cmd::Close).await
    }

    /// Sends the command `make` builds around a reply port, and waits for the answer.
    async fn ask<T: Send + 'static>(
        &self,
        make: impl FnOnce(RpcReplyPort<T>) -> Cmd,
    ) -> Result<T, ActorError> {
        let gone = || ActorError::Gone {
            actor: "controller",
        };
        let (tx, rx) = tokio::sync::oneshot::channel();
        self.actor
            .cast(ControllerMsg(make(tx.into())))
            .map_err(|_| gone())?;
        rx.await.map_err(|_| gone())
    }

    /// Stops the actor.
    pub async fn stop(&self) {
        let _ = self.actor.stop_and_wait(None, None).await;
    }
}

struct ControllerActor;

/// The actor's state.
pub struct ControllerState {
    config: ControllerConfig,
    knobs: KnobsHandle,
    peers: Option<Peers>,
    ids: Option<GroupIdGenerator>,
    version: PolicyVersion,
    admitted_total: u64,
    /// What the run trained before this start beyond what its steps would have at this
    /// `groups_per_step` (signed; 0 unless a resume changed it): see
    /// [`ControllerState::admitted_at_this_batch_size`].
    admitted_rebase: i128,
    counts: ReplayCounts,
    /// The groups being assembled (from admission or resume until they settle).
    assembly: Assembly<GroupMeta>,
    /// Resume requests sent to the replay store and not yet answered, oldest first: the lane
    /// and how many groups each asked for. The store answers each exactly once, in order.
    resume_requests: VecDeque<(Lane, u64)>,
    /// The `tail_batch_candidate_steps` last sent to the store, which classifies tail candidates
    /// with it (`None` before the first decision).
    tail_steps_sent: Option<u32>,
    /// Groups sent to the replay store as finished or aborted, not yet acknowledged.
    storing: HashSet<GroupId>,
    /// The decision rules and the running tail round (the store owns the waiting groups).
    scheduler: RolloutScheduler,
    samples: VecDeque<DataSample>,
    samples_requested: usize,
    draining: bool,
    /// A graceful stop has begun ([`ControllerHandle::close`]): no more decisions.
    closed: bool,
    status: ControllerStatus,
    /// Outcome EMA and balance fractions (seed 001).
    outcomes: OutcomeStats,
    /// The reward component series exported so far (capped).
    component_series: sluice_core::metrics::ComponentSeries,
    /// Trainer step and group times (demand-aware admission).
    pace: Pace,
    /// Finished groups on their way to the store, as they ended (for the progress watch).
    ending: HashMap<GroupId, GroupSummary>,
    /// Untrainable groups since the last trainable one.
    progress: ProgressWatch,
    knob_watch: Option<tokio::task::JoinHandle<()>>,
    /// Where finding no progress, and the last group in flight being stored, are announced.
    events: RunEvents,
    /// Groups in flight after the previous decision.
    last_in_flight: u64,
    /// Messages handled, sent to the sampler, engine, env pool and replay store, and dropped.
    counters: ActorCounters,
    /// Each group's time from admission to stored, split by what it waited on.
    clocks: clocks::Clocks,
    /// Rollout shapes per domain and the length bias.
    shape: shape::RolloutShape,
}

impl Actor for ControllerActor {
    type Msg = ControllerMsg;
    type State = ControllerState;
    type Arguments = (ControllerConfig, KnobsHandle, RunEvents);

    async fn pre_start(
        &self,
        me: ActorRef<ControllerMsg>,
        (config, knobs, events): Self::Arguments,
    ) -> Result<ControllerState, ActorProcessingErr> {
        let progress = ProgressWatch::new(config.no_progress_groups);
        let balance_threshold = config.balance_threshold;
        let scheduler = RolloutScheduler::new(config.group_size, config.groups_per_step)
            .with_capacity(config.replay_capacity);
        // Knob changes are decisions too: a paused, idle pipeline must notice an unpause.
        let mut rx = knobs.subscribe();
        let knob_watch = tokio::spawn(async move {
            while rx.changed().await.is_ok() {
                if me.cast(ControllerMsg(Cmd::Knobs)).is_err() {
                    break;
                }
            }
        });
        Ok(ControllerState {
            config,
            knobs,
            peers: None,
            ids: None,
            version: PolicyVersion::INITIAL,
            admitted_total: 0,
            admitted_rebase: 0,
            counts: ReplayCounts::default(),
            assembly: Assembly::default(),
            resume_requests: VecDeque::new(),
            tail_steps_sent: None,
            storing: HashSet::new(),
            scheduler,
            samples: VecDeque::new(),
            samples_requested: 0,
            draining: false,
            closed: false,
            status: ControllerStatus::default(),
            outcomes: OutcomeStats::new(OUTCOME_EMA_ALPHA, balance_threshold, BALANCE_WINDOW),
            component_series: sluice_core::metrics::ComponentSeries::default(),
            pace: Pace::default(),
            ending: HashMap::new(),
            progress,
            knob_watch: Some(knob_watch),
            events,
            last_in_flight: 0,
            counters: ActorCounters::new("controller"),
            clocks: clocks::Clocks::default(),
            shape: shape::RolloutShape::default(),
        })
    }

    async fn handle(
        &self,
        _me: ActorRef<ControllerMsg>,
        ControllerMsg(cmd): ControllerMsg,
        s: &mut ControllerState,
    ) -> Result<(), ActorProcessingErr> {
        s.counters.received(1);
        match cmd {
            Cmd::Connect(peers) => s.connect(*peers),
            Cmd::Samples(samples) => {
                s.samples_requested = 0;
                s.samples.extend(samples);
            }
            Cmd::Engine(EngineReport::Finished {
                completion,
                replica,
            }) => s.on_completion(completion, replica),
            Cmd::Engine(EngineReport::WeightsUpdated { version }) => {
                if version >= s.version {
                    s.draining = false;
                }
            }
            Cmd::Env(result) => s.on_env(result),
            Cmd::Replay(notice) => {
                s.time_replay(&notice);
                s.on_replay(notice);
            }
            Cmd::Step(step) => {
                s.pace.record_train_step(step.seconds);
                s.shape.record_trained(&step.response_tokens);
                if let Some(w) = &step.weights {
                    s.on_published(w.clone());
                }
            }
            Cmd::Knobs => {}
            Cmd::Status(reply) => {
                let _ = reply.send(s.snapshot());
                return Ok(());
            }
            Cmd::Close(reply) => {
                s.closed = true;
                let _ = reply.send(());
            }
        }
        s.schedule();
        Ok(())
    }

    async fn post_stop(
        &self,
        _me: ActorRef<ControllerMsg>,
        s: &mut ControllerState,
    ) -> Result<(), ActorProcessingErr> {
        if let Some(t) = s.knob_watch.take() {
            t.abort();
            let _ = t.await;
        }
        Ok(())
    }
}

impl ControllerState {
    fn connect(&mut self, peers: Peers) {
        let r = &peers.recovery;
        self.ids = Some(GroupIdGenerator::new(
            self.config.run,
            self.config.node,
            r.next_group_counter,
        ));
        self.admitted_total = r.admitted_total;
        // Trained groups that moved a version, against what the versions hold at this batch
        // size (skipped steps' groups were given back: they count as released already).
        let trained = r.counts.consumed_total.saturating_sub(r.skipped_total);
        self.admitted_rebase = i128::from(trained)
            - i128::from(r.policy_version.0) * i128::from(self.config.groups_per_step);
        self.version = r.policy_version;
        self.counts = r.counts;
        self.assembly.set_scores_groups(peers.env.scores_groups());
        self.peers = Some(peers);
    }
}
