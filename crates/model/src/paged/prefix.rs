//! Prefix sharing of [`PagedKvCache`]: starting a sequence on registered blocks that match its
//! leading tokens, and which weight versions' blocks may be handed out (see the module docs of
//! [`super`]).

use sluice_core::PolicyVersion;

use super::{BlockKey, PagedKvCache, PagedSeq};
use crate::cache::SeqId;

impl PagedKvCache {
    /// Starts `seq` (unknown so far) on the longest run of registered full blocks that match
    /// the start of `tokens` at weight `version` (or, with a version lag, at most that many
    /// versions older: the longest run wins, the newer on a tie), leaving at least the last token
    /// to compute (its logits are what the caller samples from). Returns the tokens matched: the
    /// caller feeds `tokens[matched..]` next. A known `seq` matches nothing. A sequence started
    /// on older blocks mixes versions, so it registers nothing.
    pub fn attach_prefix(&mut self, seq: SeqId, tokens: &[u32], version: PolicyVersion) -> usize {
        if self.seqs.contains_key(&seq) {
            return 0;
        }
        self.note_version(version);
        let b = self.block_tokens;
        let most = tokens.len().saturating_sub(1) / b;
        let mut best: Option<(usize, PolicyVersion)> = None;
        if version == self.version {
            let oldest = version.0.saturating_sub(self.version_lag);
            for v in (oldest..=version.0).rev().map(PolicyVersion) {
                let n = self.matching_blocks(tokens, most, v);
                if n > best.map_or(0, |(m, _)| m) {
                    best = Some((n, v));
                }
            }
        }
        let mut s = PagedSeq::new((version == self.version).then_some(version));
        if let Some((n, v)) = best {
            for i in 0..n {
                let key = Self::key_at(tokens, b, i, s.chain, v);
                let block = self.alloc.acquire(&key).expect("matched just now");
                s.blocks.push(block);
                s.chain = key.chain_hash();
            }
            if v != version {
                s.version = None;
            }
        }
        s.len = s.blocks.len() * b;
        s.registered = s.blocks.len();
        s.tokens = if s.version.is_some() {
            tokens[..s.len].to_vec()
        } else {
            Vec::new()
        };
        self.seqs.insert(seq, s);
        self.seqs[&seq].len
    }

    /// The key of block `i` of `tokens` after a chain hash of `parent`, at `version`.
    fn key_at(tokens: &[u32], b: usize, i: usize, parent: u64, version: PolicyVersion) -> BlockKey {
        BlockKey {
            parent,
            version,
            tokens: tokens[i * b..(i + 1) * b].to_vec(),
        }
    }

    /// Leading full blocks of `tokens` (at most `most`) registered at `version`.
    fn matching_blocks(&self, tokens: &[u32], most: usize, version: PolicyVersion) -> usize {
        let mut chain = 0;
        for i in 0..most {
            let key = Self::key_at(tokens, self.block_tokens, i, chain, version);
            if !self.alloc.contains(&key) {
                return i;
            }
            chain = key.chain_hash();
        }
        most
    }

    /// Keeps the keys of up to `lag` versions before the newest and hands them to new
    /// sequences (0: only the newest version's; keys older than the new lag are forgotten at
    /// once). The engine sets it per weight update: the configured lag under `in_flight`, where a
    /// running sequence already keeps older keys and values, 0 under `drain` and
    /// `abort_resume`, whose requests never span two versions.
    pub fn set_version_lag(&mut self, lag: u64) {
        self.version_lag = lag;
        self.alloc
            .forget_before(PolicyVersion(self.version.0.saturating_sub(lag)));
    }

    /// Newer weights forget the keys older than the version lag allows.
    pub(super) fn note_version(&mut self, version: PolicyVersion) {
        if version > self.version {
            self.version = version;
            self.alloc
                .forget_before(PolicyVersion(version.0.saturating_sub(self.version_lag)));
        }
    }
}
