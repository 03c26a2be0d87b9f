//! The RolloutController actor: decides what generates next (§4.1–4.3).
//!
//! At every decision (any event, or a knob change) it reads the live knobs and:
//! 1. does nothing new while `paused` or while a `drain` weight update is pending;
//! 2. runs a tail round when enough tail candidates wait: only they are resumed (at most
//!    `remaining` in flight: no over-sending), nothing is admitted, and weight updates during the
//!    round drain instead of aborting; the round ends when every candidate is stored;
//! 3. otherwise keeps `ceil((1 + s) · remaining)` groups in flight (capped by
//!    `max_concurrent_rollouts / group_size`), taking aborted and expired groups first and
//!    admitting fresh samples only while `admitted < (v + η + 1) · groups_per_step` and, with
//!    `admission = "demand"`, while the groups not yet trained fall short of the trainer's demand
//!    ([`sluice_replay::Pace`], measured here from step and group times).
//!
//! A group counts as in flight from admission (or a resume request) until the replay store has
//! durably stored it, so an acknowledged completion and the in-flight count never overlap.

use std::collections::{BTreeMap, HashMap, HashSet, VecDeque};
use std::sync::Arc;
use std::time::Instant;

use ractor::{Actor, ActorProcessingErr, ActorRef, RpcReplyPort};
use serde::Serialize;
use sluice_core::metrics as m;
use sluice_core::{
    AdmissionMode, DataSample, GroupId, GroupIdGenerator, KnobsHandle, NodeId, PolicyVersion,
    RequestId, RolloutGroup, RolloutId, RolloutStatus, RolloutTurn, RunId, WeightSnapshot,
    WeightUpdateMode,
};
use sluice_engine::{FinishReason, GenerateRequest, SamplingParams, TokenOutput};
use sluice_env::OutcomeStats;
use sluice_replay::{
    Bucket, GroupSummary, Pace, ProgressWatch, admission_allows, demand_allows, in_flight_target,
    remaining_for_step,
};

use crate::engine::{EngineHandle, EngineReport};
use crate::env_worker::{EnvPoolHandle, EnvResult, EnvStep};
use crate::replay::{Recovery, ReplayCounts, ReplayHandle, ReplayNotice};
use crate::sampler::SamplerHandle;
use crate::telemetry::ActorCounters;
use crate::trainer::StepReport;
use crate::{ActorError, Sink};

/// Weight of a new reward in the outcome EMA.
const OUTCOME_EMA_ALPHA: f64 = 0.05;
/// Group mean reward below / above which a group counts as too hard / too easy.
const BALANCE_THRESHOLD: f64 = 0.5;
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

/// A point-in-time view of the controller.
#[derive(Debug, Clone, Default, Serialize)]
pub struct ControllerStatus {
    /// Newest published version.
    pub version: PolicyVersion,
    /// Groups ever admitted.
    pub admitted_total: u64,
    /// Groups generating, being resumed, or being stored.
    pub in_flight: u64,
    /// Aborted groups waiting (not tail candidates).
    pub aborted_waiting: u64,
    /// Expired groups waiting for regeneration.
    pub expired_waiting: u64,
    /// Tail-batch candidates waiting.
    pub tail_candidates: u64,
    /// A tail round is running.
    pub tail_round: bool,
    /// A drain weight update is pending.
    pub draining: bool,
    /// Tail rounds started.
    pub tail_rounds: u64,
    /// Smallest number of candidates a tail round started with (0 before the first round).
    pub tail_round_min_size: u64,
    /// Fresh groups admitted while a tail round ran (must stay 0: no over-sending in the tail).
    pub admitted_during_tail: u64,
    /// Scheduling decisions taken.
    pub decisions: u64,
    /// Largest number of groups in flight seen.
    pub max_in_flight: u64,
    /// Replay counts last heard.
    pub replay: ReplayCounts,
    /// Rollouts of finished (not aborted) groups.
    pub finished_rollouts: u64,
    /// Sum of their final rewards (mean reward over an interval = Δsum / Δcount).
    pub reward_sum: f64,
    /// Those rollouts by final status label (`completed`, `truncated`, `error`, `timeout`, …).
    pub finished_by_status: BTreeMap<String, u64>,
    /// Measured trainer step and group times (demand-aware admission).
    pub pace: PaceStatus,
    /// Groups admitted and not yet trained (ready, in flight, waiting to resume).
    pub pending_groups: u64,
    /// Scheduling decisions in which demand held back a fresh admission that η allowed.
    pub demand_holds: u64,
    /// Why the run makes no progress (too many untrainable groups in a row); the node stops it.
    pub no_progress: Option<String>,
}

/// The pace demand-aware admission decides with, as `/v1/status` shows it.
#[derive(Debug, Clone, Copy, Default, Serialize)]
pub struct PaceStatus {
    /// Moving average of a training step's compute time.
    pub train_step_seconds: Option<f64>,
    /// Moving average of a group's time from start to stored.
    pub group_seconds: Option<f64>,
    /// Groups worth keeping ahead of the trainer (one batch and the headroom until both times
    /// are measured).
    pub demand_groups: u64,
}

enum Cmd {
    Connect(Box<Peers>),
    Samples(Vec<DataSample>),
    Engine(EngineReport),
    Env(EnvResult),
    Replay(ReplayNotice),
    Step(StepReport),
    Knobs,
    Status(RpcReplyPort<ControllerStatus>),
}

/// The actor's messages (private: use [`ControllerHandle`]).
pub struct ControllerMsg(Cmd);

/// Typed handle; cloning is shallow.
#[derive(Clone)]
pub struct ControllerHandle {
    actor: ActorRef<ControllerMsg>,
}

impl ControllerHandle {
    /// Starts the controller; it waits for [`ControllerHandle::connect`].
    pub async fn spawn(
        config: ControllerConfig,
        knobs: KnobsHandle,
    ) -> Result<(Self, tokio::task::JoinHandle<()>), ActorError> {
        let (actor, join) = Actor::spawn(None, ControllerActor, (config, knobs))
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
    pub fn step_sink(&self) -> Sink<StepReport> {
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
        let (tx, rx) = tokio::sync::oneshot::channel();
        self.actor
            .cast(ControllerMsg(Cmd::Status(tx.into())))
            .map_err(|_| ActorError::Gone {
                actor: "controller",
            })?;
        rx.await.map_err(|_| ActorError::Gone {
            actor: "controller",
        })
    }

    /// Stops the actor.
    pub async fn stop(&self) {
        let _ = self.actor.stop_and_wait(None, None).await;
    }
}

enum Waiting {
    Engine(RequestId),
    Env,
}

struct GroupWork {
    group: RolloutGroup,
    sample: Arc<DataSample>,
    waiting: HashMap<u32, Waiting>,
    /// When the group started (admitted or resumed): its time to stored paces admission.
    started: Instant,
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
    counts: ReplayCounts,
    work: HashMap<GroupId, GroupWork>,
    /// Resume requests sent to the replay store, not yet answered.
    resuming: HashSet<GroupId>,
    /// Groups sent to the replay store as finished or aborted, not yet acknowledged.
    storing: HashSet<GroupId>,
    aborted: VecDeque<GroupId>,
    expired: VecDeque<GroupId>,
    tail: VecDeque<GroupId>,
    tail_round: HashSet<GroupId>,
    /// A tail round is running: only candidates are served until none is left.
    tail_active: bool,
    attempts: HashMap<RolloutId, u32>,
    /// The replica that last served each unfinished rollout: its next turn or its resume after
    /// an abort goes back there (prefix cache, §4.2), across trips through the aborted bucket.
    served_by: HashMap<RolloutId, u32>,
    /// Largest abort count of each group on its way to the aborted bucket.
    abort_counts: HashMap<GroupId, u32>,
    samples: VecDeque<DataSample>,
    samples_requested: usize,
    draining: bool,
    status: ControllerStatus,
    /// Outcome EMA and balance fractions (seed 001).
    outcomes: OutcomeStats,
    /// Trainer step and group times (demand-aware admission).
    pace: Pace,
    /// Finished groups on their way to the store, as they ended (for the progress watch).
    ending: HashMap<GroupId, GroupSummary>,
    /// Untrainable groups since the last trainable one.
    progress: ProgressWatch,
    knob_watch: Option<tokio::task::JoinHandle<()>>,
    /// Messages handled, sent to the sampler, engine, env pool and replay store, and dropped.
    counters: ActorCounters,
}

impl Actor for ControllerActor {
    type Msg = ControllerMsg;
    type State = ControllerState;
    type Arguments = (ControllerConfig, KnobsHandle);

    async fn pre_start(
        &self,
        me: ActorRef<ControllerMsg>,
        (config, knobs): Self::Arguments,
    ) -> Result<ControllerState, ActorProcessingErr> {
        let progress = ProgressWatch::new(config.no_progress_groups);
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
            counts: ReplayCounts::default(),
            work: HashMap::new(),
            resuming: HashSet::new(),
            storing: HashSet::new(),
            aborted: VecDeque::new(),
            expired: VecDeque::new(),
            tail: VecDeque::new(),
            tail_round: HashSet::new(),
            tail_active: false,
            attempts: HashMap::new(),
            served_by: HashMap::new(),
            abort_counts: HashMap::new(),
            samples: VecDeque::new(),
            samples_requested: 0,
            draining: false,
            status: ControllerStatus::default(),
            outcomes: OutcomeStats::new(OUTCOME_EMA_ALPHA, BALANCE_THRESHOLD, BALANCE_WINDOW),
            pace: Pace::default(),
            ending: HashMap::new(),
            progress,
            knob_watch: Some(knob_watch),
            counters: ActorCounters::new("controller"),
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
            Cmd::Replay(notice) => s.on_replay(notice),
            Cmd::Step(StepReport { seconds, weights }) => {
                s.pace.record_train_step(seconds);
                if let Some(w) = weights {
                    s.on_published(w);
                }
            }
            Cmd::Knobs => {}
            Cmd::Status(reply) => {
                let _ = reply.send(s.snapshot());
                return Ok(());
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
        self.version = r.policy_version;
        self.counts = r.counts;
        let k = self.knobs.current().tail_batch_candidate_steps;
        for (id, aborts) in &r.aborted {
            if k > 0 && *aborts > k {
                self.tail.push_back(*id);
            } else {
                self.aborted.push_back(*id);
            }
        }
        self.expired.extend(r.expired.iter().copied());
        self.peers = Some(peers);
    }

    fn in_flight(&self) -> u64 {
        (self.work.len() + self.resuming.len() + self.storing.len()) as u64
    }

    /// Groups admitted and not yet trained: ready in the store, in flight, or waiting to resume.
    fn pending(&self) -> u64 {
        self.counts.completed
            + self.in_flight()
            + (self.aborted.len() + self.expired.len() + self.tail.len()) as u64
    }

    fn snapshot(&self) -> ControllerStatus {
        let b = self.config.groups_per_step;
        ControllerStatus {
            pace: PaceStatus {
                train_step_seconds: self.pace.train_step_seconds,
                group_seconds: self.pace.group_seconds,
                demand_groups: self.pace.demand(b),
            },
            pending_groups: self.pending(),
            version: self.version,
            admitted_total: self.admitted_total,
            in_flight: self.in_flight(),
            aborted_waiting: self.aborted.len() as u64,
            expired_waiting: self.expired.len() as u64,
            tail_candidates: self.tail.len() as u64,
            tail_round: self.tail_active,
            draining: self.draining,
            replay: self.counts,
            ..self.status.clone()
        }
    }

    /// One scheduling decision; see the module docs.
    fn schedule(&mut self) {
        let Some(peers) = &self.peers else { return };
        let knobs = self.knobs.current();
        self.status.decisions += 1;
        let b = self.config.groups_per_step;
        let eta = knobs.max_version_lag;
        let mut resumes: Vec<GroupId> = Vec::new();
        let mut fresh: Vec<DataSample> = Vec::new();
        if !knobs.paused && !self.draining {
            self.tail_round.retain(|id| {
                self.work.contains_key(id)
                    || self.resuming.contains(id)
                    || self.storing.contains(id)
            });
            let k = knobs.tail_batch_candidate_steps;
            if k == 0 && !self.tail.is_empty() && !self.tail_active {
                // The tail batch was switched off: candidates are ordinary aborted groups again.
                self.aborted.extend(self.tail.drain(..));
            }
            if !self.tail_active
                && k > 0
                && self.tail.len() >= knobs.tail_batch_trigger_size as usize
            {
                self.tail_active = true;
                self.status.tail_rounds += 1;
                let size = self.tail.len() as u64;
                self.status.tail_round_min_size = if self.status.tail_rounds == 1 {
                    size
                } else {
                    self.status.tail_round_min_size.min(size)
                };
            }
            if self.tail_active && self.tail.is_empty() && self.tail_round.is_empty() {
                self.tail_active = false;
            }
            let remaining = remaining_for_step(b, self.counts.completed);
            let cap = u64::from((knobs.max_concurrent_rollouts / self.config.group_size).max(1));
            let mut active = self.in_flight();
            if self.tail_active {
                // A tail round serves only candidates, without over-sending (s = 0).
                while active < remaining.min(cap) {
                    let Some(id) = self.tail.pop_front() else {
                        break;
                    };
                    self.tail_round.insert(id);
                    resumes.push(id);
                    active += 1;
                }
            } else {
                let target = in_flight_target(knobs.staleness_threshold, remaining).min(cap);
                while active < target {
                    if let Some(id) = self
                        .aborted
                        .pop_front()
                        .or_else(|| self.expired.pop_front())
                    {
                        resumes.push(id);
                    } else {
                        let load =
                            self.admitted_total + fresh.len() as u64 - self.counts.released_total;
                        if !admission_allows(load, self.version.0, eta, b) {
                            break;
                        }
                        let pending = self.pending() + fresh.len() as u64;
                        if knobs.admission == AdmissionMode::Demand
                            && !demand_allows(pending, self.pace.demand(b))
                        {
                            self.status.demand_holds += 1;
                            break;
                        }
                        let Some(sample) = self.samples.pop_front() else {
                            break;
                        };
                        fresh.push(sample);
                    }
                    active += 1;
                }
                // Keep a batch of samples ready beyond what the target needs now.
                let want = (target as usize).max(b as usize) + b as usize;
                if self.samples_requested == 0 && self.samples.len() < want {
                    self.samples_requested = want - self.samples.len();
                    peers.sampler.request(self.samples_requested);
                    self.counters.sent(1);
                }
            }
        }
        for id in resumes {
            self.resuming.insert(id);
            peers
                .replay
                .resume(id, self.version, eta, knobs.enable_partial_rollout);
            self.counters.sent(1);
        }
        for sample in fresh {
            self.admit(sample);
        }
        let in_flight = self.in_flight();
        self.status.max_in_flight = self.status.max_in_flight.max(in_flight);
        metrics::gauge!(m::ROLLOUT_IN_FLIGHT_GROUPS).set(in_flight as f64);
    }

    fn admit(&mut self, sample: DataSample) {
        let (Some(ids), Some(peers)) = (&self.ids, &self.peers) else {
            return;
        };
        let id = ids.next_id();
        // Rollouts start without turns: the env renders their first prompts (in `start`).
        let group = RolloutGroup::new(id, sample.clone(), self.config.group_size, self.version);
        peers.replay.admit(group.clone());
        self.counters.sent(1);
        self.admitted_total += 1;
        if self.tail_active {
            self.status.admitted_during_tail += 1;
        }
        metrics::counter!(m::ROLLOUT_ADMITTED_GROUPS).increment(1);
        self.start(group, Arc::new(sample));
    }

    /// Submits every rollout of `group` that still has to generate.
    fn start(&mut self, group: RolloutGroup, sample: Arc<DataSample>) {
        let id = group.id;
        let n = group.rollouts.len();
        let mut w = GroupWork {
            group,
            sample,
            waiting: HashMap::new(),
            started: Instant::now(),
        };
        for i in 0..n {
            let r = &w.group.rollouts[i];
            if matches!(r.status, RolloutStatus::Ongoing | RolloutStatus::Aborted) {
                if r.turns.is_empty() {
                    if let Some(p) = &self.peers {
                        w.waiting.insert(i as u32, Waiting::Env);
                        p.env.start(Arc::clone(&w.sample), r.id);
                        self.counters.sent(1);
                    }
                } else {
                    self.submit(&mut w, i);
                }
            }
        }
        self.work.insert(id, w);
        self.settle(id);
    }

    fn submit(&mut self, w: &mut GroupWork, i: usize) {
        let Some(peers) = &self.peers else { return };
        let r = &mut w.group.rollouts[i];
        r.status = RolloutStatus::Ongoing;
        let turn_index = r.turns.len().saturating_sub(1) as u32;
        let Some(turn) = r.turns.last() else { return };
        let attempt = self.attempts.entry(r.id).or_insert(r.abort_count);
        let id = r.id.request(turn_index, *attempt);
        *attempt += 1;
        let resume = (turn.completion_tokens() > 0).then(|| TokenOutput {
            token_ids: turn.completion_token_ids.clone(),
            logprobs: turn.logprobs.clone(),
            versions: turn.token_versions.clone(),
        });
        let request = GenerateRequest {
            id,
            prompt_token_ids: turn.prompt_token_ids.clone(),
            resume,
            params: self.config.sampling.clone(),
            domain: Some(w.sample.domain.clone()),
        };
        w.waiting.insert(i as u32, Waiting::Engine(id));
        peers
            .engine
            .generate(request, self.served_by.get(&r.id).copied());
        self.counters.sent(1);
    }

    fn on_completion(&mut self, c: sluice_engine::Completion, replica: u32) {
        let gid = c.id.rollout.group;
        let i = c.id.rollout.index;
        let Some(mut w) = self.work.remove(&gid) else {
            self.counters.dropped(1);
            return;
        };
        if !matches!(w.waiting.get(&i), Some(Waiting::Engine(id)) if *id == c.id) {
            self.counters.dropped(1);
            self.work.insert(gid, w);
            return;
        }
        w.waiting.remove(&i);
        let r = &mut w.group.rollouts[i as usize];
        self.served_by.insert(r.id, replica);
        if let Some(turn) = r.turns.last_mut()
            && c.output.len() >= turn.completion_tokens()
        {
            // The engine reports the whole completion (resumed tokens first, versions kept).
            turn.completion_token_ids = c.output.token_ids;
            turn.logprobs = c.output.logprobs;
            turn.token_versions = c.output.versions;
        }
        match c.finish {
            FinishReason::Abort => {
                r.status = RolloutStatus::Aborted;
                r.abort_count += 1;
            }
            // A truncated turn still goes to the env: it ends the episode and scores it.
            FinishReason::Stop | FinishReason::Length => {
                w.waiting.insert(i, Waiting::Env);
                if let Some(p) = &self.peers {
                    let truncated = c.finish == FinishReason::Length;
                    p.env.step(Arc::clone(&w.sample), r.clone(), truncated);
                    self.counters.sent(1);
                }
            }
            FinishReason::Error(kind) => r.status = RolloutStatus::Error(kind),
        }
        self.work.insert(gid, w);
        self.settle(gid);
    }

    fn on_env(&mut self, result: EnvResult) {
        let gid = result.rollout.group;
        let i = result.rollout.index;
        // A result for a group no longer here, or a rollout not waiting on the env, is stale.
        let Some(mut w) = self.work.remove(&gid) else {
            self.counters.dropped(1);
            return;
        };
        if !matches!(w.waiting.remove(&i), Some(Waiting::Env)) {
            self.counters.dropped(1);
            self.work.insert(gid, w);
            return;
        }
        let r = &mut w.group.rollouts[i as usize];
        if let (Some(note), Some(turn)) = (result.note, r.turns.last_mut()) {
            turn.completion_message = note.completion_message;
            turn.env_messages = note.env_messages;
            turn.env_reward = note.env_reward;
            turn.situation = note.situation;
        }
        match result.step {
            EnvStep::Continue { next_prompt } => {
                r.turns.push(RolloutTurn::new(next_prompt));
                self.submit(&mut w, i as usize);
            }
            EnvStep::Done {
                reward,
                status,
                components,
            } => {
                r.status = status;
                r.reward = reward;
                r.reward_components = components;
            }
            EnvStep::Failed { kind } => r.status = RolloutStatus::Error(kind),
        }
        self.work.insert(gid, w);
        self.settle(gid);
    }

    /// A group with nothing outstanding goes to the replay store: aborted if any rollout was
    /// interrupted, finished otherwise.
    fn settle(&mut self, gid: GroupId) {
        let Some(w) = self.work.get(&gid) else { return };
        if !w.waiting.is_empty() {
            return;
        }
        let Some(w) = self.work.remove(&gid) else {
            return;
        };
        let group = w.group;
        let aborted = group
            .rollouts
            .iter()
            .any(|r| r.status == RolloutStatus::Aborted);
        if !aborted {
            self.record_outcome(&group, &w.sample.domain);
            self.pace.record_group(w.started.elapsed().as_secs_f64());
        }
        let Some(peers) = &self.peers else { return };
        self.storing.insert(gid);
        if aborted {
            let max_aborts = group
                .rollouts
                .iter()
                .map(|r| r.abort_count)
                .max()
                .unwrap_or(0);
            self.abort_counts.insert(gid, max_aborts);
            peers.replay.abort(group);
            self.counters.sent(1);
        } else {
            for r in &group.rollouts {
                let label = r.status.as_label();
                metrics::counter!(m::ROLLOUT_FINISHED_ROLLOUTS, "status" => label).increment(1);
                *self
                    .status
                    .finished_by_status
                    .entry(label.to_owned())
                    .or_insert(0) += 1;
                self.attempts.remove(&r.id);
                self.served_by.remove(&r.id);
            }
            self.ending.insert(gid, GroupSummary::of(&group));
            let eta = self.knobs.current().max_version_lag;
            peers.sampler.group_finished(&group, self.version, eta);
            peers.replay.finish(group, self.version, eta);
            self.counters.sent(1);
        }
    }

    /// Reward statistics of a finished group: per-domain mean, outcome EMA and balance.
    fn record_outcome(&mut self, group: &RolloutGroup, domain: &str) {
        let n = group.rollouts.len();
        if n == 0 {
            return;
        }
        let sum: f64 = group.rollouts.iter().map(|r| r.reward).sum();
        self.status.finished_rollouts += n as u64;
        self.status.reward_sum += sum;
        metrics::gauge!(m::ROLLOUT_MEAN_REWARD, "domain" => domain.to_owned()).set(sum / n as f64);
        self.outcomes.record_group(group);
        self.outcomes.publish_metrics();
    }

    fn on_replay(&mut self, notice: ReplayNotice) {
        match notice {
            ReplayNotice::Stored { id, bucket, counts } => {
                self.storing.remove(&id);
                self.counts = counts;
                let summary = self.ending.remove(&id);
                if let Some(why) = self.progress.stored(bucket, summary.as_ref()) {
                    tracing::error!(reason = %why, "the run makes no progress; it stops");
                    self.status.no_progress.get_or_insert(why);
                }
                if bucket == Bucket::Aborted {
                    self.park_aborted(id);
                }
            }
            ReplayNotice::Resumed(group) => {
                self.resuming.remove(&group.id);
                let sample = Arc::new(group.sample.clone());
                self.start(group, sample);
            }
            ReplayNotice::Dropped { id, counts } => {
                for i in 0..self.config.group_size {
                    let rollout = id.rollout(i);
                    if let Some(p) = &self.peers {
                        p.env.abandon(rollout);
                    }
                    self.attempts.remove(&rollout);
                    self.served_by.remove(&rollout);
                }
                self.resuming.remove(&id);
                self.tail_round.remove(&id);
                self.counts = counts;
            }
            ReplayNotice::Expired { id } => self.expired.push_back(id),
            ReplayNotice::Counts(counts) => self.counts = counts,
        }
    }

    fn park_aborted(&mut self, id: GroupId) {
        let k = self.knobs.current().tail_batch_candidate_steps;
        let max_aborts = self.abort_counts.remove(&id).unwrap_or(0);
        if k > 0 && max_aborts > k {
            self.tail.push_back(id);
        } else {
            self.aborted.push_back(id);
        }
        metrics::gauge!(m::ROLLOUT_TAIL_CANDIDATE_ROLLOUTS)
            .set((self.tail.len() as u64 * u64::from(self.config.group_size)) as f64);
    }

    fn on_published(&mut self, w: WeightSnapshot) {
        let Some(peers) = &self.peers else { return };
        if w.version <= self.version {
            return;
        }
        self.version = w.version;
        peers.replay.set_version(w.version);
        let knobs = self.knobs.current();
        // A tail round runs without aborts: its updates drain instead.
        let mode = if self.tail_active {
            WeightUpdateMode::Drain
        } else {
            knobs.weight_update_mode
        };
        if mode == WeightUpdateMode::Drain {
            self.draining = true;
        }
        peers.engine.update_weights(w, mode);
        self.counters.sent(1);
    }
}
