//! KV caches for incremental decoding, behind the [`KvCache`] trait so that a paged cache can
//! replace [`ContiguousKvCache`] without touching the model.

use std::collections::HashMap;

use candle_core::{DType, Device, Tensor};
use sluice_core::PolicyVersion;

use crate::config::ModelConfig;
use crate::error::{ModelError, Result, TensorContext};

/// Identifies one sequence in a cache (the engine maps its requests onto these).
pub type SeqId = u64;

/// One layer's new tokens of a batch, for [`KvCache::attend_new`].
#[derive(Debug, Clone, Copy)]
pub struct NewTokens<'a> {
    /// The sequences, each once; the rows below are theirs in this order.
    pub seqs: &'a [SeqId],
    /// The tokens each sequence adds.
    pub news: &'a [usize],
    /// Their queries, keys and values, a row per new token.
    pub heads: NewHeads<'a>,
}

/// The new tokens' queries, keys and values, as the layer's products give them.
#[derive(Debug, Clone, Copy)]
pub enum NewHeads<'a> {
    /// Split into heads, q and k after RoPE.
    Split {
        /// `(Σ news, heads, head_dim)`.
        q: &'a Tensor,
        /// `(Σ news, kv_heads, head_dim)`.
        k: &'a Tensor,
        /// `(Σ news, kv_heads, head_dim)`.
        v: &'a Tensor,
    },
    /// The rows of the stacked q/k/v product before its bias, split and rotation (what
    /// [`crate::fused::split_rope`] takes): a cache that computes attention may do those as it
    /// reads them, with the same rounding, and save a pass (on a GPU, a launch per layer).
    Stacked {
        /// `(Σ news, (heads + 2·kv_heads)·head_dim)`.
        qkv: &'a Tensor,
        /// One row's width, added to every row.
        bias: Option<&'a Tensor>,
        /// The cosines of the rows' angles, `(Σ news, head_dim / 2)`.
        cos: &'a Tensor,
        /// Their sines, `(Σ news, head_dim / 2)`.
        sin: &'a Tensor,
        /// Query heads, key/value heads, head dim.
        geometry: (usize, usize, usize),
    },
}

impl NewHeads<'_> {
    /// The step's query heads.
    #[cfg(feature = "cuda")]
    pub(crate) fn query_heads(&self) -> usize {
        match *self {
            Self::Split { q, .. } => q.dims().get(1).copied().unwrap_or(0),
            Self::Stacked { geometry, .. } => geometry.0,
        }
    }

    /// q `(rows, heads, d)`, k and v `(rows, kv_heads, d)`, q and k rotated: the stacked rows
    /// split (one [`crate::fused::split_rope`]), split heads as they are.
    pub fn split(&self) -> candle_core::Result<(Tensor, Tensor, Tensor)> {
        match *self {
            Self::Split { q, k, v } => Ok((q.clone(), k.clone(), v.clone())),
            Self::Stacked {
                qkv,
                bias,
                cos,
                sin,
                geometry: (heads, kv_heads, d),
            } => {
                let (q, k, v) = crate::fused::split_rope(qkv, bias, cos, sin, heads, kv_heads, d)?;
                let n = q.dim(0)?;
                Ok((
                    q.reshape((n, heads, d))?,
                    k.reshape((n, kv_heads, d))?,
                    v.reshape((n, kv_heads, d))?,
                ))
            }
        }
    }
}

/// Keys and values of past tokens, per sequence and layer.
///
/// Protocol of one model step: the model reads [`KvCache::seq_len`] of each sequence once, then
/// for every layer in order (0 first) appends that step's new keys and values, with
/// [`KvCache::append`] per sequence, [`KvCache::append_ragged`] for a batch of them, or
/// [`KvCache::attend_new`] for a batch whose attention the cache computes itself. `seq_len` counts tokens
/// appended to the last layer, so it changes only once a step has gone through every layer.
pub trait KvCache: Send {
    /// Tokens cached for `seq` (0 for a sequence the cache has never seen).
    fn seq_len(&self, seq: SeqId) -> usize;

    /// Appends `k`, `v` (`(kv_heads, n, head_dim)`) to `seq`'s `layer` and returns all keys and
    /// values of that layer, `(kv_heads, past + n, head_dim)` each, contiguous.
    fn append(
        &mut self,
        seq: SeqId,
        layer: usize,
        k: &Tensor,
        v: &Tensor,
    ) -> Result<(Tensor, Tensor)>;

    /// Appends a ragged batch, `news[b]` new tokens of `seqs[b]` whose keys and values are rows
    /// of `k`, `v` (`(Σ news, kv_heads, head_dim)`, sequence `b`'s rows right after those of
    /// `b - 1`), to `layer`, and returns every sequence's keys and values padded to the longest,
    /// `(B, kv_heads, T_max, head_dim)`; slots past a sequence's own length hold anything and must
    /// be masked by the caller. The default goes through [`KvCache::append`] one sequence at a
    /// time; implementations override it to write and read the batch at once.
    fn append_ragged(
        &mut self,
        seqs: &[SeqId],
        news: &[usize],
        layer: usize,
        k: &Tensor,
        v: &Tensor,
    ) -> Result<(Tensor, Tensor)> {
        let mut ks = Vec::with_capacity(seqs.len());
        let mut vs = Vec::with_capacity(seqs.len());
        let mut start = 0;
        for (&seq, &n) in seqs.iter().zip(news) {
            let rows = |t: &Tensor| t.narrow(0, start, n)?.transpose(0, 1)?.contiguous();
            let (k_all, v_all) = self.append(
                seq,
                layer,
                &rows(k).ctx("kv cache append")?,
                &rows(v).ctx("kv cache append")?,
            )?;
            ks.push(k_all);
            vs.push(v_all);
            start += n;
        }
        let longest = ks.iter().map(|t| t.dim(1).unwrap_or(0)).max().unwrap_or(0);
        let pad_stack = |ts: Vec<Tensor>| -> candle_core::Result<Tensor> {
            let padded = ts
                .into_iter()
                .map(|t| {
                    let (h, len, d) = t.dims3()?;
                    if len == longest {
                        return Ok(t);
                    }
                    let zeros = Tensor::zeros((h, longest - len, d), t.dtype(), t.device())?;
                    Tensor::cat(&[t, zeros], 1)
                })
                .collect::<candle_core::Result<Vec<_>>>()?;
            Tensor::stack(&padded, 0)
        };
        Ok((
            pad_stack(ks).ctx("kv cache padding")?,
            pad_stack(vs).ctx("kv cache padding")?,
        ))
    }

    /// Attention of a batch's new tokens computed over the cache's own storage, without
    /// gathering every sequence's keys and values into a padded copy: appends the keys and
    /// values as [`KvCache::append_ragged`] does and returns `(Σ news, heads · head_dim)` for
    /// the queries, scores scaled by `scale`, new token `i` of a sequence seeing that sequence's
    /// tokens up to and including itself (causal); or `None`, having appended nothing, when the
    /// cache has no such path (the caller then uses `append_ragged`). One call covers decoding
    /// sequences (one new token each) and prompt chunks alike. The default has none.
    fn attend_new(
        &mut self,
        tokens: NewTokens<'_>,
        layer: usize,
        scale: f64,
    ) -> Result<Option<Tensor>> {
        let _ = (tokens, layer, scale);
        Ok(None)
    }

    /// Announces that the next model step feeds `tokens` to `seq`, computed by weights
    /// `version`, before any layer's append. A paged cache reserves the blocks they need here
    /// (failing with [`ModelError::KvCacheFull`] when none are left) and keeps the ids to share
    /// full blocks by content. The default does nothing.
    fn begin_step(&mut self, seq: SeqId, tokens: &[u32], version: PolicyVersion) -> Result<()> {
        let _ = (seq, tokens, version);
        Ok(())
    }

    /// Drops `seq` and frees its memory; false if it was not there.
    fn remove(&mut self, seq: SeqId) -> bool;

    /// Sequences currently cached.
    fn num_sequences(&self) -> usize;

    /// Token slots currently cached over all sequences (a memory gauge).
    fn num_tokens(&self) -> usize;
}

/// Every sequence owns a slot of `capacity` positions in one buffer per layer,
/// `(slots · capacity, kv_heads · head_dim)` for keys and the same for values. Slots and
/// capacity double when exhausted (a copy of the whole cache, amortized away). One buffer per
/// layer lets a decode step write and read every sequence with a handful of ops.
#[derive(Debug)]
pub struct ContiguousKvCache {
    num_layers: usize,
    kv_heads: usize,
    head_dim: usize,
    dtype: DType,
    device: Device,
    /// Per layer: `(keys, values)`, each `(slots · capacity, kv_heads · head_dim)`.
    buffers: Vec<(Tensor, Tensor)>,
    slots: usize,
    capacity: usize,
    free: Vec<usize>,
    seqs: HashMap<SeqId, SlotState>,
}

#[derive(Debug, Clone, Copy)]
struct SlotState {
    slot: usize,
    /// Tokens committed (appended to every layer).
    len: usize,
}

impl ContiguousKvCache {
    /// An empty cache for `config`'s shapes, holding `dtype` tensors on `device` (use the
    /// weights' dtype and device). Memory is allocated on first use.
    pub fn new(config: &ModelConfig, dtype: DType, device: &Device) -> Self {
        Self {
            num_layers: config.num_layers,
            kv_heads: config.num_kv_heads,
            head_dim: config.head_dim,
            dtype,
            device: device.clone(),
            buffers: Vec::new(),
            slots: 0,
            capacity: 0,
            free: Vec::new(),
            seqs: HashMap::new(),
        }
    }

    fn width(&self) -> usize {
        self.kv_heads * self.head_dim
    }

    /// Makes room for at least `slots` slots of `capacity` positions, keeping the contents.
    fn reserve(&mut self, slots: usize, capacity: usize) -> candle_core::Result<()> {
        if slots <= self.slots && capacity <= self.capacity {
            return Ok(());
        }
        let new_slots = slots.max(self.slots).next_power_of_two().max(4);
        let new_cap = capacity.max(self.capacity).next_power_of_two().max(16);
        let width = self.width();
        let mut buffers = Vec::with_capacity(self.num_layers);
        for layer in 0..self.num_layers {
            let fresh = || Tensor::zeros((new_slots, new_cap, width), self.dtype, &self.device);
            let (k, v) = (fresh()?, fresh()?);
            if let Some((old_k, old_v)) = self.buffers.get(layer) {
                let shape = (self.slots, self.capacity, width);
                // The new buffers are private to this cache: in-place writes are safe.
                copy_into(&k, &old_k.reshape(shape)?)?;
                copy_into(&v, &old_v.reshape(shape)?)?;
            }
            let flat = (new_slots * new_cap, width);
            buffers.push((k.reshape(flat)?, v.reshape(flat)?));
        }
        self.free.extend((self.slots..new_slots).rev());
        self.buffers = buffers;
        self.slots = new_slots;
        self.capacity = new_cap;
        Ok(())
    }

    /// The slot of `seq`, taking a free one for a new sequence.
    fn slot_of(&mut self, seq: SeqId) -> candle_core::Result<SlotState> {
        if let Some(s) = self.seqs.get(&seq) {
            return Ok(*s);
        }
        if self.free.is_empty() {
            self.reserve(self.slots + 1, self.capacity)?;
        }
        let slot = self.free.pop().expect("reserve added free slots");
        let state = SlotState { slot, len: 0 };
        self.seqs.insert(seq, state);
        Ok(state)
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

    /// After the last layer's append, the step's tokens count.
    fn commit(&mut self, layer: usize, seq: SeqId, n: usize) {
        if layer + 1 == self.num_layers
            && let Some(s) = self.seqs.get_mut(&seq)
        {
            s.len += n;
        }
    }
}

/// Copies `src` `(s, c, w)` into the leading corner of `dst` `(S ≥ s, C ≥ c, w)`.
fn copy_into(dst: &Tensor, src: &Tensor) -> candle_core::Result<()> {
    let (s, c, w) = src.dims3()?;
    let dst_cap = dst.dim(1)?;
    // Pad each slot to the new capacity, then write all slots at once.
    let padded = if c < dst_cap {
        let zeros = Tensor::zeros((s, dst_cap - c, w), src.dtype(), src.device())?;
        Tensor::cat(&[src, &zeros], 1)?
    } else {
        src.clone()
    };
    dst.slice_set(&padded, 0, 0)
}

impl KvCache for ContiguousKvCache {
    fn seq_len(&self, seq: SeqId) -> usize {
        self.seqs.get(&seq).map_or(0, |s| s.len)
    }

    fn append(
        &mut self,
        seq: SeqId,
        layer: usize,
        k: &Tensor,
        v: &Tensor,
    ) -> Result<(Tensor, Tensor)> {
        self.check_layer(layer)?;
        let n = k.dim(1).ctx("kv cache append")?;
        let mut write = || -> candle_core::Result<(Tensor, Tensor)> {
            let state = self.slot_of(seq)?;
            self.reserve(self.slots, state.len + n)?;
            let (kb, vb) = &self.buffers[layer];
            let row = state.slot * self.capacity + state.len;
            // (kv, n, d) → (n, kv·d) rows of the slot.
            let rows = |t: &Tensor| t.transpose(0, 1)?.contiguous()?.reshape((n, ()));
            kb.slice_set(&rows(k)?, 0, row)?;
            vb.slice_set(&rows(v)?, 0, row)?;
            let total = state.len + n;
            let read = |b: &Tensor| {
                b.narrow(0, state.slot * self.capacity, total)?
                    .reshape((total, self.kv_heads, self.head_dim))?
                    .transpose(0, 1)?
                    .contiguous()
            };
            Ok((read(kb)?, read(vb)?))
        };
        let out = write().ctx("kv cache append")?;
        self.commit(layer, seq, n);
        Ok(out)
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
        let mut write = || -> candle_core::Result<(Tensor, Tensor)> {
            let mut states = Vec::with_capacity(seqs.len());
            for &seq in seqs {
                states.push(self.slot_of(seq)?);
            }
            let longest = states
                .iter()
                .zip(news)
                .map(|(s, n)| s.len + n)
                .max()
                .unwrap_or(1);
            self.reserve(self.slots, longest)?;
            let width = self.width();
            let rows: usize = news.iter().sum();
            // Row of each new token in the flat buffer, repeated across the row's width
            // (scatter indexes are per element).
            let index: Vec<u32> = states
                .iter()
                .zip(news)
                .flat_map(|(s, &n)| {
                    let first = s.slot * self.capacity + s.len;
                    (first..first + n).flat_map(|row| std::iter::repeat_n(row as u32, width))
                })
                .collect();
            let index = Tensor::from_vec(index, (rows, width), &self.device)?;
            let (kb, vb) = &self.buffers[layer];
            kb.scatter_set(&index, &k.reshape((rows, width))?.contiguous()?, 0)?;
            vb.scatter_set(&index, &v.reshape((rows, width))?.contiguous()?, 0)?;
            let slots: Vec<u32> = states.iter().map(|s| s.slot as u32).collect();
            let slots = Tensor::from_vec(slots, seqs.len(), &self.device)?;
            let shape = (self.slots, self.capacity, self.kv_heads, self.head_dim);
            let read = |buf: &Tensor| {
                buf.reshape(shape)?
                    .index_select(&slots, 0)?
                    .narrow(1, 0, longest)?
                    .transpose(1, 2)?
                    .contiguous()
            };
            Ok((read(kb)?, read(vb)?))
        };
        let out = write().ctx("kv cache ragged append")?;
        for (&seq, &n) in seqs.iter().zip(news) {
            self.commit(layer, seq, n);
        }
        Ok(out)
    }

    fn remove(&mut self, seq: SeqId) -> bool {
        match self.seqs.remove(&seq) {
            Some(s) => {
                self.free.push(s.slot);
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
