//! Turning one HTTP call into engine requests and collecting what they produce.
//!
//! Each choice is one engine request. Their observers push updates, tagged with the choice
//! index, into one tokio channel per call; its capacity is the most updates the choices can
//! produce (one per token, the prompt log-probabilities, the end), so the engine thread's
//! `try_send` never finds it full. [`Launched`] aborts whatever is still running when dropped:
//! a client that disconnects frees its sequences at the next step.

use std::sync::Arc;
use std::sync::atomic::Ordering;

use sluice_core::{GroupId, NodeId, RequestId, RunId};
use tokio::sync::mpsc;

use super::{ApiError, ServerState};
use crate::backend::{Completion, GenerateRequest, SamplingParams};
use crate::native::{NativeRequest, PromptLogprob, RequestUpdate, StopHit, TokenStep};

/// One choice to generate.
#[derive(Debug, Clone)]
pub struct ChoiceSpec {
    /// Prompt token ids (validated).
    pub prompt: Vec<u32>,
    /// Sampling.
    pub params: SamplingParams,
    /// Stop strings.
    pub stop: Vec<String>,
    /// Ignore end-of-sequence ids.
    pub ignore_eos: bool,
    /// Alternatives per token.
    pub top_logprobs: u32,
    /// Report prompt log-probabilities.
    pub prompt_logprobs: bool,
}

/// Everything one choice produced.
#[derive(Debug, Clone)]
pub struct ChoiceOutput {
    /// Prompt token ids.
    pub prompt: Vec<u32>,
    /// Prompt log-probabilities, when asked.
    pub prompt_logprobs: Option<Vec<PromptLogprob>>,
    /// Each generated token.
    pub tokens: Vec<TokenStep>,
    /// The engine's completion.
    pub completion: Completion,
    /// The stop condition met.
    pub stop: Option<StopHit>,
}

/// Requests of one HTTP call in flight.
pub struct Launched {
    state: Arc<ServerState>,
    /// The response id (`cmpl-N`).
    pub response_id: String,
    keys: Vec<String>,
    ids: Vec<RequestId>,
    finished: Vec<bool>,
    rx: mpsc::Receiver<(usize, RequestUpdate)>,
    /// Sequences taken from the server's budget, given back on drop.
    reserved: usize,
}

/// Submits every choice; on a refusal, aborts the ones already queued. A call beyond the
/// server's sequence budget is refused before anything is submitted.
pub fn launch(
    state: &Arc<ServerState>,
    rid: Option<String>,
    specs: Vec<ChoiceSpec>,
) -> Result<Launched, ApiError> {
    let taken = |rid: &str| {
        ApiError::invalid(
            "rid",
            format!("rid `{rid}` names a request still in flight; give each request its own rid"),
        )
    };
    let in_flight = |r: &&String| state.rids.lock().expect("not poisoned").contains_key(*r);
    if let Some(r) = rid.as_ref().filter(in_flight) {
        return Err(taken(r));
    }
    state.reserve(specs.len())?;
    let counter = state.next_id.fetch_add(1, Ordering::Relaxed);
    let group = GroupId {
        run: RunId::from_name("serve"),
        node: NodeId(0),
        counter,
    };
    let capacity: usize = specs.iter().map(|s| s.params.max_tokens as usize + 4).sum();
    let (tx, rx) = mpsc::channel(capacity.max(1));
    let response_id = format!("cmpl-{counter}");
    let mut keys = vec![response_id.clone()];
    keys.extend(rid);
    let mut launched = Launched {
        state: Arc::clone(state),
        response_id,
        keys,
        ids: Vec::new(),
        finished: Vec::new(),
        rx,
        reserved: specs.len(),
    };
    for (index, spec) in specs.into_iter().enumerate() {
        let id = group.rollout(index as u32).request(0, 0);
        let tx = tx.clone();
        let request = NativeRequest {
            request: GenerateRequest {
                id,
                prompt_token_ids: spec.prompt,
                resume: None,
                params: spec.params,
                domain: None,
            },
            stop: spec.stop,
            ignore_eos: spec.ignore_eos,
            top_logprobs: spec.top_logprobs,
            prompt_logprobs: spec.prompt_logprobs,
            observer: Some(Arc::new(move |u| {
                // Never full by construction; closed only when the client left.
                let _ = tx.try_send((index, u));
            })),
        };
        state.control.submit_native(request)?;
        launched.ids.push(id);
        launched.finished.push(false);
    }
    {
        let mut rids = state.rids.lock().expect("not poisoned");
        // Checked again under the lock: two calls with one rid may have raced past the first
        // check. The loser's requests are aborted when `launched` drops.
        if let Some(k) = launched.keys.iter().find(|k| rids.contains_key(*k)) {
            let err = taken(k);
            drop(rids);
            // Keep the winner's entry: dropping `launched` must not remove it.
            launched.keys.clear();
            return Err(err);
        }
        for k in &launched.keys {
            rids.insert(k.clone(), launched.ids.clone());
        }
    }
    Ok(launched)
}

impl Launched {
    /// Number of choices.
    pub fn len(&self) -> usize {
        self.ids.len()
    }

    /// No choices (never, once launched).
    pub fn is_empty(&self) -> bool {
        self.ids.is_empty()
    }

    /// The next update of any choice; `None` once every choice finished.
    pub async fn next(&mut self) -> Option<(usize, RequestUpdate)> {
        if self.finished.iter().all(|&f| f) {
            return None;
        }
        let (i, u) = self.rx.recv().await?;
        if matches!(u, RequestUpdate::Finished { .. }) {
            self.finished[i] = true;
        }
        Some((i, u))
    }

    /// Waits for every choice and returns their outputs in choice order.
    pub async fn collect(mut self, prompts: &[Vec<u32>]) -> Result<Vec<ChoiceOutput>, ApiError> {
        let n = self.ids.len();
        let mut prompt_lps: Vec<Option<Vec<PromptLogprob>>> = vec![None; n];
        let mut tokens: Vec<Vec<TokenStep>> = vec![Vec::new(); n];
        let mut ends: Vec<Option<(Completion, Option<StopHit>)>> = vec![None; n];
        while let Some((i, u)) = self.next().await {
            match u {
                RequestUpdate::PromptLogprobs(p) => prompt_lps[i] = Some(p),
                RequestUpdate::Token(t) => tokens[i].push(t),
                RequestUpdate::Finished { completion, stop } => ends[i] = Some((completion, stop)),
            }
        }
        let mut out = Vec::with_capacity(n);
        for (i, end) in ends.into_iter().enumerate() {
            let (completion, stop) =
                end.ok_or_else(|| ApiError::unavailable("the engine stopped mid-request"))?;
            out.push(ChoiceOutput {
                prompt: prompts[i].clone(),
                prompt_logprobs: prompt_lps[i].take(),
                tokens: std::mem::take(&mut tokens[i]),
                completion,
                stop,
            });
        }
        Ok(out)
    }
}

impl Drop for Launched {
    fn drop(&mut self) {
        for (id, done) in self.ids.iter().zip(&self.finished) {
            if !done {
                let _ = self.state.control.abort(*id);
            }
        }
        let mut rids = self.state.rids.lock().expect("not poisoned");
        for k in &self.keys {
            rids.remove(k);
        }
        drop(rids);
        self.state.release(self.reserved);
    }
}
