//! [`PagedKvCache`]: keys and values in fixed-size blocks from one pool, allocated once at a
//! byte budget, with per-sequence block tables and full blocks shared by content (prefix cache).
//!
//! Layout: per layer one tensor of `2 · blocks · kv_heads · block_tokens` rows of `head_dim`,
//! the keys in its first half and the values in its second (so one launch writes both), each
//! half head-major within a block (block `b` holds kv head 0's `block_tokens` rows,
//! then kv head 1's, ...), so one head's keys of a block are one contiguous run for attention to
//! stream and a gather yields `(B, kv_heads, T, head_dim)` without a transpose. Kv head `h` of a
//! sequence's token `t` lives at row `(table[t / B] · kv_heads + h) · B + t % B` (`B` =
//! `block_tokens`). The tensors are allocated for the blocks in use so far and doubled (a copy)
//! when a block past them is handed out, up to the budget. Growing on demand keeps resident
//! memory at what is used: an allocator that recycles freed memory (mimalloc in the binary)
//! zeroes a reused region eagerly, so a pool allocated whole would be resident whole. Attention
//! reads a sequence's rows with one gather per layer (or, on the CPU in f32, in place through
//! its table), so the logits are the contiguous cache's.
//!
//! Prefix sharing: once every layer holds a block's keys and values and the block is full, the
//! block is registered under a [`BlockKey`] (hash chain of the token ids and the weight version
//! that computed them). A new sequence whose leading tokens match registered blocks of the
//! current version takes references to them ([`PagedKvCache::attach_prefix`]) and computes only
//! the rest. A sequence whose keys and values mix versions (an `in_flight` weight swap while it
//! ran) registers nothing more, and when the weights change every key of an older version is
//! forgotten, so old-version blocks are never handed to a new request — unless the owner allows
//! a version lag ([`PagedKvCache::set_version_lag`], `engine.prefix_cache_version_lag` under
//! `in_flight` updates): then keys up to that many versions old are kept and a new request may
//! start on them, as a running `in_flight` sequence keeps its older keys and values.

mod attend;
mod blocks;
mod fixed;
mod prefix;
mod rows;

use std::collections::HashMap;

use candle_core::{DType, Device, Tensor};
use sluice_core::PolicyVersion;

pub use blocks::{BlockAllocator, BlockId, BlockKey};

use crate::cache::{KvCache, NewTokens, SeqId};
use crate::config::ModelConfig;
use crate::error::{ModelError, Result, TensorContext};

/// Tokens per block unless configured otherwise (vLLM's default).
pub const DEFAULT_BLOCK_TOKENS: usize = 16;

/// See the module docs.
#[derive(Debug)]
pub struct PagedKvCache {
    num_layers: usize,
    kv_heads: usize,
    head_dim: usize,
    block_tokens: usize,
    device: Device,
    /// Per layer: the keys, then the values, each `capacity · kv_heads · block_tokens` rows of
    /// `head_dim` (see [`Self::kv`]).
    pools: Vec<Tensor>,
    /// Blocks the pools hold now (grows to the allocator's total).
    capacity: usize,
    dtype: DType,
    alloc: BlockAllocator,
    seqs: HashMap<SeqId, PagedSeq>,
    /// The newest weight version seen: keys of older versions are forgotten.
    version: PolicyVersion,
    /// Versions behind `version` whose keys are kept and handed to new sequences (0: none).
    version_lag: u64,
    /// Pool rows of this step's batches, built at their first layer and reused by the others
    /// (tables and lengths do not change within a step; emptied when the next one begins).
    step_rows: Vec<rows::StepRows>,
    /// The block padded decode steps store their padding rows' keys in, once taken.
    scratch: Option<BlockId>,
    /// Whether the GPU attention may split a long row's keys ([`Self::set_key_split`]).
    key_split: bool,
}

#[derive(Debug)]
struct PagedSeq {
    /// Block table: block `i` holds tokens `i·B..(i+1)·B`.
    blocks: Vec<BlockId>,
    /// Tokens whose keys and values are in every layer.
    len: usize,
    /// Token ids at positions `0..`, kept while the blocks can still be shared.
    tokens: Vec<u32>,
    /// The version of every token's keys and values, while they share one and the ids are
    /// known; `None` once they mix (nothing more is registered).
    version: Option<PolicyVersion>,
    /// Leading full blocks registered (or matched at attach).
    registered: usize,
    /// Chain hash of the last of those blocks (0 before the first).
    chain: u64,
}

impl PagedSeq {
    fn new(version: Option<PolicyVersion>) -> Self {
        Self {
            blocks: Vec::new(),
            len: 0,
            tokens: Vec::new(),
            version,
            registered: 0,
            chain: 0,
        }
    }
}

/// The widest head the GPU's paged attention kernel takes (`32 · MAX_COLS` in paged.cu).
const PAGED_GPU_MAX_HEAD_DIM: usize = 256;

/// Blocks the pools start with (grown by doubling).
const INITIAL_BLOCKS: usize = 64;

/// Bytes of keys and values one block holds for `config` in `dtype`.
pub fn block_bytes(config: &ModelConfig, dtype: DType, block_tokens: usize) -> usize {
    2 * config.num_layers
        * config.num_kv_heads
        * config.head_dim
        * block_tokens
        * dtype.size_in_bytes()
}

impl PagedKvCache {
    /// A pool of `blocks` blocks of `block_tokens` tokens for `config`'s shapes, in `dtype` on
    /// `device` (the weights'). Memory is allocated as blocks are first used, up to `blocks`.
    pub fn new(
        config: &ModelConfig,
        dtype: DType,
        device: &Device,
        blocks: usize,
        block_tokens: usize,
    ) -> Result<Self> {
        if blocks == 0 || block_tokens == 0 {
            return Err(ModelError::input(format!(
                "a paged kv cache needs at least one block of at least one token, got {blocks} blocks of {block_tokens}"
            )));
        }
        let mut cache = Self {
            num_layers: config.num_layers,
            kv_heads: config.num_kv_heads,
            head_dim: config.head_dim,
            block_tokens,
            device: device.clone(),
            pools: Vec::new(),
            capacity: 0,
            dtype,
            alloc: BlockAllocator::new(blocks),
            seqs: HashMap::new(),
            version: PolicyVersion(0),
            version_lag: 0,
            step_rows: Vec::new(),
            scratch: None,
            key_split: true,
        };
        cache.grow(INITIAL_BLOCKS.min(blocks))?;
        Ok(cache)
    }

    /// Makes the pools hold at least `blocks` blocks (doubling, at most the total), keeping
    /// their contents.
    fn grow(&mut self, blocks: usize) -> Result<()> {
        if blocks <= self.capacity {
            return Ok(());
        }
        let new_cap = blocks.max(2 * self.capacity).min(self.alloc.total());
        let rows = new_cap * self.kv_heads * self.block_tokens;
        let width = self.head_dim;
        let ctx = format!("growing the kv cache pool to {new_cap} blocks");
        let (dtype, device) = (self.dtype, self.device.clone());
        let widen = |old: Option<&Tensor>| -> candle_core::Result<Tensor> {
            let t = Tensor::zeros((2 * rows, width), dtype, &device)?;
            if let Some(old) = old {
                // The new tensor is private to this cache: writing in place is safe. The old
                // keys go to the start of the new keys, its values to the start of the values.
                let half = old.dim(0)? / 2;
                t.slice_set(&old.narrow(0, 0, half)?, 0, 0)?;
                t.slice_set(&old.narrow(0, half, half)?, 0, rows)?;
            }
            Ok(t)
        };
        if self.pools.is_empty() {
            for _ in 0..self.num_layers {
                self.pools.push(widen(None).ctx(&ctx)?);
            }
        } else {
            // Layer by layer, each old tensor dropped once copied: growing costs one layer's
            // worth of extra memory, not the pool's. After a failure some layers are larger
            // than `capacity`; their extra rows are unused and the next attempt copies them.
            for layer in 0..self.num_layers {
                if self.pools[layer].dim(0).ctx(&ctx)? < 2 * rows {
                    self.pools[layer] = widen(Some(&self.pools[layer])).ctx(&ctx)?;
                }
            }
        }
        self.capacity = new_cap;
        Ok(())
    }

    /// Layer `layer`'s keys and values: the two halves of its pool tensor, as views.
    fn kv(&self, layer: usize) -> candle_core::Result<(Tensor, Tensor)> {
        let pool = &self.pools[layer];
        let half = pool.dim(0)? / 2;
        Ok((pool.narrow(0, 0, half)?, pool.narrow(0, half, half)?))
    }

    /// Blocks the pools hold now (memory grows on demand up to [`Self::total_blocks`]).
    pub fn allocated_blocks(&self) -> usize {
        self.capacity
    }

    /// Tokens per block.
    pub fn block_tokens(&self) -> usize {
        self.block_tokens
    }

    /// Blocks in the pool.
    pub fn total_blocks(&self) -> usize {
        self.alloc.total()
    }

    /// Blocks a sequence can still get (free plus evictable cached ones).
    pub fn available_blocks(&self) -> usize {
        self.alloc.available()
    }

    /// Blocks in some sequence's table.
    pub fn blocks_in_use(&self) -> usize {
        self.alloc.in_use()
    }

    /// Unreferenced blocks kept for prefix hits.
    pub fn cached_blocks(&self) -> usize {
        self.alloc.cached()
    }

    /// The allocator (tests check its invariants).
    pub fn allocator(&self) -> &BlockAllocator {
        &self.alloc
    }

    /// `seq`'s block table.
    pub fn block_table(&self, seq: SeqId) -> &[BlockId] {
        self.seqs.get(&seq).map_or(&[], |s| &s.blocks)
    }

    /// Blocks `tokens` tokens occupy.
    pub fn blocks_for(&self, tokens: usize) -> usize {
        tokens.div_ceil(self.block_tokens)
    }

    /// More blocks `seq` needs to add `new_tokens` tokens.
    pub fn blocks_needed(&self, seq: SeqId, new_tokens: usize) -> usize {
        let (len, have) = self
            .seqs
            .get(&seq)
            .map_or((0, 0), |s| (s.len, s.blocks.len()));
        self.blocks_for(len + new_tokens).saturating_sub(have)
    }

    /// Grows `seq`'s table to hold `new_tokens` more tokens.
    fn reserve(&mut self, seq: SeqId, new_tokens: usize) -> Result<()> {
        let needed = self.blocks_needed(seq, new_tokens);
        if needed > self.alloc.available() {
            return Err(ModelError::KvCacheFull {
                seq,
                needed,
                available: self.alloc.available(),
                total: self.alloc.total(),
            });
        }
        let fresh: Vec<BlockId> = (0..needed)
            .map(|_| self.alloc.allocate().expect("checked available blocks"))
            .collect();
        if let Some(&top) = fresh.iter().max()
            && let Err(e) = self.grow(top as usize + 1)
        {
            for block in fresh {
                self.alloc.release(block);
            }
            return Err(e);
        }
        self.seqs
            .entry(seq)
            .or_insert_with(|| PagedSeq::new(None))
            .blocks
            .extend(fresh);
        Ok(())
    }

    /// Whether the attention over the pools runs here ([`KvCache::attend_new`] gives it): the
    /// CPU's kernel takes f32 pools, the GPU's (a `cuda` build) f32 and bf16.
    pub(crate) fn attends_itself(&self) -> bool {
        self.attends_on_gpu() || (self.dtype == DType::F32 && self.device.is_cpu())
    }

    fn attends_on_gpu(&self) -> bool {
        cfg!(feature = "cuda")
            && self.device.is_cuda()
            && matches!(self.dtype, DType::F32 | DType::BF16)
            && self.head_dim <= PAGED_GPU_MAX_HEAD_DIM
    }

    fn check_layer(&self, layer: usize) -> Result<()> {
        if layer >= self.num_layers {
            return Err(ModelError::input(format!(
                "layer {layer} out of range ({} layers)",
                self.num_layers
            )));
        }
        Ok(())
    }

    /// After the last layer's append the step's `n` tokens count, and blocks they filled are
    /// registered for sharing.
    fn commit(&mut self, layer: usize, seq: SeqId, n: usize) {
        if layer + 1 != self.num_layers {
            return;
        }
        let b = self.block_tokens;
        let current = self.version;
        let Some(s) = self.seqs.get_mut(&seq) else {
            return;
        };
        s.len += n;
        if s.tokens.len() < s.len {
            // Ids not announced by `begin_step`: the contents are unknown.
            s.version = None;
        }
        let Some(version) = s.version.filter(|&v| v == current) else {
            return;
        };
        while s.registered < s.len / b {
            let i = s.registered;
            let key = BlockKey {
                parent: s.chain,
                version,
                tokens: s.tokens[i * b..(i + 1) * b].to_vec(),
            };
            s.chain = key.chain_hash();
            // A duplicate (another sequence computed the same block first) stays private.
            self.alloc.register(s.blocks[i], key);
            s.registered += 1;
        }
    }
}

impl KvCache for PagedKvCache {
    fn seq_len(&self, seq: SeqId) -> usize {
        self.seqs.get(&seq).map_or(0, |s| s.len)
    }

    fn begin_step(&mut self, seq: SeqId, tokens: &[u32], version: PolicyVersion) -> Result<()> {
        self.step_rows.clear();
        self.note_version(version);
        let current = self.version;
        let s = self
            .seqs
            .entry(seq)
            .or_insert_with(|| PagedSeq::new(Some(version)));
        if s.version != Some(version) || version != current || s.tokens.len() != s.len {
            s.version = None;
        }
        if s.version.is_some() {
            s.tokens.extend_from_slice(tokens);
        } else {
            s.tokens = Vec::new();
        }
        self.reserve(seq, tokens.len())
    }

    fn append(
        &mut self,
        seq: SeqId,
        layer: usize,
        k: &Tensor,
        v: &Tensor,
    ) -> Result<(Tensor, Tensor)> {
        let n = k.dim(1).ctx("kv cache append")?;
        // (kv, n, d) → (n, kv, d): the token rows of a batch of one.
        let rows = |t: &Tensor| t.transpose(0, 1)?.contiguous();
        let (k_rows, v_rows) = (
            rows(k).ctx("kv cache append")?,
            rows(v).ctx("kv cache append")?,
        );
        let (k_all, v_all) = self.append_ragged(&[seq], &[n], layer, &k_rows, &v_rows)?;
        Ok((
            k_all.squeeze(0).ctx("kv cache append")?,
            v_all.squeeze(0).ctx("kv cache append")?,
        ))
    }

    fn append_ragged(
        &mut self,
        seqs: &[SeqId],
        news: &[usize],
        layer: usize,
        k: &Tensor,
        v: &Tensor,
    ) -> Result<(Tensor, Tensor)> {
        self.check_layer(layer)?;
        for (&seq, &n) in seqs.iter().zip(news) {
            self.reserve(seq, n)?;
        }
        let mut write = || -> candle_core::Result<(Tensor, Tensor)> {
            let (index, read) = self.step_rows(seqs, news, true)?;
            let (gather, longest) = read.expect("asked for the read rows");
            self.write_rows(&index, layer, k, v)?;
            let (kb, vb) = self.kv(layer)?;
            let shape = (seqs.len(), self.kv_heads, longest, self.head_dim);
            let read = |pool: &Tensor| pool.index_select(&gather, 0)?.reshape(shape);
            Ok((read(&kb)?, read(&vb)?))
        };
        let out = write().ctx("paged kv cache ragged append")?;
        for (&seq, &n) in seqs.iter().zip(news) {
            self.commit(layer, seq, n);
        }
        Ok(out)
    }

    fn attend_new(
        &mut self,
        tokens: NewTokens<'_>,
        layer: usize,
        scale: f64,
    ) -> Result<Option<Tensor>> {
        if !self.attends_itself() {
            return Ok(None);
        }
        let NewTokens { seqs, news, heads } = tokens;
        self.check_layer(layer)?;
        for (&seq, &n) in seqs.iter().zip(news) {
            self.reserve(seq, n)?;
        }
        let mut run = || -> candle_core::Result<Tensor> {
            // On a GPU the attention's launch also stores the new keys and values (and splits
            // and rotates stacked rows).
            #[cfg(feature = "cuda")]
            if self.attends_on_gpu() {
                let meta = self.attention_meta(seqs, news)?;
                let geometry = (self.kv_heads, self.block_tokens);
                let pool = &self.pools[layer];
                let lens = seqs.iter().zip(news).map(|(q, n)| self.seqs[q].len + n);
                let rows = news.iter().sum();
                let parts = self.key_parts(rows, heads.query_heads(), lens.max().unwrap_or(0));
                return crate::fused::device::paged_attention(
                    heads, pool, &meta, geometry, scale, parts,
                );
            }
            let (q, k, v) = heads.split()?;
            let (q, k) = (&q, &k);
            let (index, _) = self.step_rows(seqs, news, false)?;
            self.write_rows(&index, layer, k, &v.contiguous()?)?;
            // One query row per new token: its sequence's table, and the positions it sees.
            let mut tables: Vec<&[BlockId]> = Vec::new();
            let mut visible = Vec::new();
            for (seq, &n) in seqs.iter().zip(news) {
                let s = &self.seqs[seq];
                tables.extend(std::iter::repeat_n(&s.blocks[..], n));
                visible.extend(s.len + 1..=s.len + n);
            }
            self.attend_cpu(layer, q, &tables, &visible, scale)
        };
        let out = run().ctx("paged attention")?;
        for (&seq, &n) in seqs.iter().zip(news) {
            self.commit(layer, seq, n);
        }
        Ok(Some(out))
    }

    fn remove(&mut self, seq: SeqId) -> bool {
        self.step_rows.clear();
        match self.seqs.remove(&seq) {
            Some(s) => {
                for block in s.blocks {
                    self.alloc.release(block);
                }
                true
            }
            None => false,
        }
    }

    fn num_sequences(&self) -> usize {
        self.seqs.len()
    }

    fn num_tokens(&self) -> usize {
        self.seqs.values().map(|s| s.len).sum()
    }
}
