//! Admission by free KV blocks, prefix reuse, and preemption when blocks run out.
//!
//! - A waiting request is admitted (oldest first) only when the blocks for its whole input plus
//!   one generated token are free, after the blocks running prefills still need. Its leading full
//!   blocks are first looked up in the prefix cache at the current weight version; a hit is not
//!   prefilled again.
//! - Requests whose first block another running request is still prefilling wait a step, so a
//!   group's rollouts compute their shared prompt once.
//! - When a step's new tokens need more blocks than are free, the newest running sequences are
//!   preempted until they fit: one that generated nothing here goes back to the front of the
//!   queue; one that did finishes as `Abort` with its partial output, which the controller
//!   resumes (prompt + partial) like any aborted rollout, so no token is lost or generated twice
//!   — or, with `recompute_preempted` (a server, whose clients cannot resume), goes back to the
//!   front of the queue too, to be computed again from its prompt and output.

use std::sync::atomic::Ordering;

use sluice_model::KvCache;

use super::{Seq, Worker};
use crate::backend::FinishReason;
use crate::sched::Queues;

impl Worker {
    /// Admits waiting sequences (oldest first) while their blocks are free; the scheduler core
    /// calls it only when admission is open (not paused, no drain held).
    pub(super) fn admit_by_blocks(&mut self, q: &mut Queues<Seq>) {
        let version = self.model.version();
        // Blocks the running prefills will still take (their rest plus one generated token).
        let mut owed: usize = q
            .running
            .iter()
            .filter(|s| s.pending.len() > 1)
            .map(|s| self.cache.blocks_needed(s.cache_id, s.pending.len() + 1))
            .sum();
        while q.running.len() < self.params.max_running_sequences {
            let Some(mut s) = q.waiting.pop_front() else {
                break;
            };
            // Prompt log-probabilities need every prompt row computed: no prefix reuse.
            let matched = if s.prompt_lps.is_none() && self.params.prefix_caching {
                self.cache.attach_prefix(s.cache_id, &s.pending, version)
            } else {
                0
            };
            let shared_head_in_prefill = matched == 0
                && self.params.prefix_caching
                && s.prompt_lps.is_none()
                && !s.head.is_empty()
                && q.running
                    .iter()
                    .any(|r| r.pending.len() > 1 && r.head == s.head);
            let need = self
                .cache
                .blocks_needed(s.cache_id, s.pending.len() - matched + 1);
            if shared_head_in_prefill || need + owed > self.cache.available_blocks() {
                self.cache.remove(s.cache_id);
                q.waiting.push_front(s);
                break;
            }
            owed += need;
            self.shared
                .prompt_tokens
                .fetch_add(s.pending.len() as u64, Ordering::Relaxed);
            self.shared
                .prefix_hit_tokens
                .fetch_add(matched as u64, Ordering::Relaxed);
            s.pending.drain(..matched);
            q.running.push(s);
        }
    }

    /// Preempts the newest running sequences until the new tokens of this step (`take[i]` for
    /// `running[i]`) have blocks.
    pub(super) fn make_room(&mut self, q: &mut Queues<Seq>, take: &mut Vec<usize>) {
        loop {
            let need: usize = q
                .running
                .iter()
                .zip(take.iter())
                .filter(|&(_, &t)| t > 0)
                .map(|(s, &t)| self.cache.blocks_needed(s.cache_id, t))
                .sum();
            if need <= self.cache.available_blocks() {
                return;
            }
            let Some(s) = q.running.pop() else {
                return;
            };
            take.pop();
            if q.running.is_empty() {
                // Alone and still short: cannot happen (requests larger than the pool are
                // refused at submit, and a sequence stops at the pool's size), but never loop.
                tracing::error!(
                    id = %s.id,
                    need,
                    available = self.cache.available_blocks(),
                    "a lone sequence does not fit the kv cache"
                );
                self.finish_with(s, FinishReason::Error("kv_cache_full".into()), None);
                return;
            }
            self.preempt(q, s);
        }
    }

    fn preempt(&mut self, q: &mut Queues<Seq>, mut s: Seq) {
        self.shared.preempted.fetch_add(1, Ordering::Relaxed);
        tracing::debug!(id = %s.id, generated = s.output.len() - s.resumed_len, "preempted: kv cache full");
        if s.output.len() > s.resumed_len && !self.params.recompute_preempted {
            self.finish_with(s, FinishReason::Abort, None);
            return;
        }
        // Start over later from the prompt and what it generated so far (its input when it
        // generated nothing here), nothing to report: the output, with its log-probs and
        // versions, stays as it is and grows from where it stopped.
        self.cache.remove(s.cache_id);
        s.pending = s.input[..s.prompt_len].to_vec();
        s.pending.extend_from_slice(&s.output.token_ids);
        if let Some(lps) = &mut s.prompt_lps
            && lps.len() < s.prompt_len
        {
            lps.clear();
        }
        q.waiting.push_front(s);
    }
}
