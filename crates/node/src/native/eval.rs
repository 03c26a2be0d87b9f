//! [`Evaluator`]: plays a task's held-out samples on a weight snapshot with a native engine of its
//! own (greedy unless told otherwise), every episode concurrently, and scores them with the task's
//! rubric. It runs beside the pipeline without touching its engine replicas, so evaluating never
//! aborts or delays a rollout.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use sluice_core::{DataSample, GroupId, NodeId, PolicyVersion, RequestId, Rollout, RunId};
use sluice_engine::native::{NativeEngine, NativeEngineParams};
use sluice_engine::{
    Completion, EngineEvent, EventSink, FinishReason, GenerateRequest, InferenceBackend,
    SamplingParams, TokenOutput,
};
use sluice_env::token_env::TurnFinish;
use sluice_env::{
    BoxFuture, EnvError, EvalReport, Generate, Generated, Renderer, Task, TokenEnvLimits,
    run_episode,
};
use sluice_model::{ModelWeights, Tokenizer};
use tokio::sync::oneshot;

type Pending = Arc<Mutex<HashMap<RequestId, oneshot::Sender<Completion>>>>;

/// Evaluates snapshots on a fixed sample set.
pub struct Evaluator {
    task: Arc<Task>,
    samples: Vec<DataSample>,
    renderer: Arc<dyn Renderer>,
    limits: TokenEnvLimits,
    params: NativeEngineParams,
    tokenizer: Arc<Tokenizer>,
    sampling: SamplingParams,
    rounds: u64,
    /// Nothing else computes while this evaluator runs: its engine takes every core when its
    /// sizing is automatic (`engine.threads = 0`), where it would take half of them.
    alone: bool,
}

impl std::fmt::Debug for Evaluator {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Evaluator")
            .field("task", &self.task.name())
            .field("samples", &self.samples.len())
            .finish_non_exhaustive()
    }
}

/// What one evaluation found.
#[derive(Debug, Clone)]
pub struct Evaluation {
    /// Version of the weights evaluated.
    pub version: PolicyVersion,
    /// Mean reward, accuracy, statuses.
    pub report: EvalReport,
    /// The scored episodes, in sample order.
    pub rollouts: Vec<Rollout>,
    /// Requests preempted (KV blocks ran out) and resumed from their partial output.
    pub resumed_requests: u64,
}

impl Evaluator {
    /// An evaluator of `task` on `samples`. `params` sizes its engine (its replica number only
    /// names the compute thread); `sampling.max_tokens` bounds each turn.
    pub fn new(
        task: Arc<Task>,
        samples: Vec<DataSample>,
        renderer: Arc<dyn Renderer>,
        limits: TokenEnvLimits,
        params: NativeEngineParams,
        tokenizer: Arc<Tokenizer>,
        sampling: SamplingParams,
    ) -> Self {
        Self {
            task,
            samples,
            renderer,
            limits,
            params,
            tokenizer,
            sampling,
            rounds: 0,
            alone: false,
        }
    }

    /// Says whether nothing else computes while this evaluator runs (the baseline before RL,
    /// the warm-up's probes between its steps): then its engine takes every core unless
    /// `engine.threads` names a count.
    pub fn set_alone(&mut self, alone: bool) {
        self.alone = alone;
    }

    /// Samples evaluated per round.
    pub fn len(&self) -> usize {
        self.samples.len()
    }

    /// No samples.
    pub fn is_empty(&self) -> bool {
        self.samples.is_empty()
    }

    /// Plays every sample on `weights` and scores it.
    pub async fn evaluate(&mut self, weights: Arc<ModelWeights>) -> Result<Evaluation, EnvError> {
        let version = weights.version;
        let pending: Pending = Arc::default();
        let resumed = Arc::new(AtomicU64::new(0));
        let sink: EventSink = {
            let pending = Arc::clone(&pending);
            Arc::new(move |event| {
                if let EngineEvent::Finished(c) = event {
                    let tx = lock(&pending).remove(&c.id);
                    if let Some(tx) = tx {
                        let _ = tx.send(c);
                    }
                }
            })
        };
        let mut params = self.params.clone();
        if self.alone && params.threads == 0 {
            params.threads = sluice_model::threads::available_cores();
        }
        let mut engine =
            NativeEngine::start(params, weights, Some(Arc::clone(&self.tokenizer)), sink)
                .map_err(|e| EnvError::Generate(format!("evaluation engine: {e}")))?;
        self.rounds += 1;
        let group = GroupId {
            run: RunId::from_name("eval"),
            node: NodeId(0),
            counter: self.rounds,
        };
        let episodes = self.samples.iter().enumerate().map(|(i, sample)| {
            let id = group.rollout(i as u32);
            let mut generator = EngineGenerate {
                engine: &engine,
                pending: Arc::clone(&pending),
                sampling: self.sampling.clone(),
                rollout: id,
                turn: 0,
                resumed: Arc::clone(&resumed),
            };
            let task = Arc::clone(&self.task);
            let renderer = Arc::clone(&self.renderer);
            let limits = self.limits.clone();
            async move {
                let mut rollout = Rollout::new(id);
                match task.token_env(sample, renderer, limits) {
                    Ok(mut env) => run_episode(&mut env, &mut generator, &mut rollout).await?,
                    Err(e) => {
                        rollout.status = sluice_core::RolloutStatus::Error(e.kind().to_owned())
                    }
                }
                task.rubric()
                    .score(sample, &rollout)
                    .await
                    .apply_to(&mut rollout);
                Ok::<_, EnvError>(rollout)
            }
        });
        let results = futures::future::join_all(episodes).await;
        engine.shutdown();
        let rollouts = results.into_iter().collect::<Result<Vec<_>, _>>()?;
        Ok(Evaluation {
            version,
            report: EvalReport::from_rollouts(self.task.rubric(), &rollouts),
            rollouts,
            resumed_requests: resumed.load(Ordering::Relaxed),
        })
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// One episode's view of the evaluation engine.
struct EngineGenerate<'e> {
    engine: &'e NativeEngine,
    pending: Pending,
    sampling: SamplingParams,
    rollout: sluice_core::RolloutId,
    turn: u32,
    /// Requests of this evaluation resumed after a preemption.
    resumed: Arc<AtomicU64>,
}

impl EngineGenerate<'_> {
    /// Submits one attempt and waits for its completion.
    async fn attempt(
        &self,
        id: RequestId,
        prompt: &[u32],
        resume: Option<TokenOutput>,
    ) -> Result<Completion, EnvError> {
        let (tx, rx) = oneshot::channel();
        lock(&self.pending).insert(id, tx);
        let request = GenerateRequest {
            id,
            prompt_token_ids: prompt.to_vec(),
            resume,
            params: self.sampling.clone(),
            domain: None,
        };
        if let Err(e) = self.engine.submit(request) {
            lock(&self.pending).remove(&id);
            return Err(EnvError::Generate(e.to_string()));
        }
        rx.await
            .map_err(|_| EnvError::Generate("evaluation engine stopped".into()))
    }
}

impl Generate for EngineGenerate<'_> {
    fn generate<'a>(&'a mut self, prompt: &'a [u32]) -> BoxFuture<'a, Result<Generated, EnvError>> {
        Box::pin(async move {
            let turn = self.turn;
            self.turn += 1;
            // A request preempted for lack of KV blocks comes back as an abort with its partial
            // output: resume it from prompt + partial on a new attempt (as the controller resumes
            // a rollout) until it ends. Such an abort always brings at least one new token (a
            // sequence preempted before generating is requeued inside the engine), so one that
            // brings nothing means the engine stopped serving.
            let mut resume: Option<TokenOutput> = None;
            let mut attempt = 0;
            let (c, finish) = loop {
                let id = self.rollout.request(turn, attempt);
                let had = resume.as_ref().map_or(0, TokenOutput::len);
                let c = self.attempt(id, prompt, resume.take()).await?;
                let finish = match &c.finish {
                    FinishReason::Stop => TurnFinish::Stop,
                    FinishReason::Length => TurnFinish::Length,
                    FinishReason::Abort if c.output.len() > had => {
                        self.resumed.fetch_add(1, Ordering::Relaxed);
                        resume = Some(c.output);
                        attempt += 1;
                        continue;
                    }
                    FinishReason::Abort => {
                        return Err(EnvError::Generate(format!(
                            "request {id} was aborted without progress"
                        )));
                    }
                    FinishReason::Error(kind) => {
                        return Err(EnvError::Generate(format!("request {id} failed: {kind}")));
                    }
                };
                break (c, finish);
            };
            Ok(Generated {
                token_ids: c.output.token_ids,
                logprobs: c.output.logprobs,
                versions: c.output.versions,
                finish,
            })
        })
    }
}
