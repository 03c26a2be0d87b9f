//! KV caches for incremental decoding, behind the [`KvCache`] trait so that a paged cache can
//! replace [`ContiguousKvCache`] without touching the model.

use std::collections::HashMap;

use candle_core::{DType, Device, Tensor};

use crate::config::ModelConfig;
use crate::error::{ModelError, Result, TensorContext};

/// Identifies one sequence in a cache (the engine maps its requests onto these).
pub type SeqId = u64;

/// Keys and values of past tokens, per sequence and layer.
///
/// Protocol of one model step: the model reads [`KvCache::seq_len`] of each sequence once, then
/// for every layer in order calls [`KvCache::append`] with that step's new keys and values. The
/// length reported by `seq_len` counts tokens appended to the last layer, so it changes only
/// once a step has gone through every layer.
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

    /// Drops `seq` and frees its memory; false if it was not there.
    fn remove(&mut self, seq: SeqId) -> bool;

    /// Sequences currently cached.
    fn num_sequences(&self) -> usize;

    /// Token slots currently cached over all sequences (a memory gauge).
    fn num_tokens(&self) -> usize;
}

/// One growable `(kv_heads, capacity, head_dim)` buffer pair per sequence and layer; capacity
/// doubles when full, so appending is amortized O(new tokens).
#[derive(Debug)]
pub struct ContiguousKvCache {
    num_layers: usize,
    kv_heads: usize,
    head_dim: usize,
    dtype: DType,
    device: Device,
    seqs: HashMap<SeqId, Vec<LayerKv>>,
}

#[derive(Debug)]
struct LayerKv {
    k: Tensor,
    v: Tensor,
    len: usize,
}

impl ContiguousKvCache {
    /// An empty cache for `config`'s shapes, holding `dtype` tensors on `device` (use the
    /// weights' dtype and device).
    pub fn new(config: &ModelConfig, dtype: DType, device: &Device) -> Self {
        Self {
            num_layers: config.num_layers,
            kv_heads: config.num_kv_heads,
            head_dim: config.head_dim,
            dtype,
            device: device.clone(),
            seqs: HashMap::new(),
        }
    }

    fn empty_layer(&self, capacity: usize) -> candle_core::Result<LayerKv> {
        let shape = (self.kv_heads, capacity, self.head_dim);
        Ok(LayerKv {
            k: Tensor::zeros(shape, self.dtype, &self.device)?,
            v: Tensor::zeros(shape, self.dtype, &self.device)?,
            len: 0,
        })
    }
}

impl KvCache for ContiguousKvCache {
    fn seq_len(&self, seq: SeqId) -> usize {
        self.seqs
            .get(&seq)
            .and_then(|layers| layers.last())
            .map_or(0, |l| l.len)
    }

    fn append(
        &mut self,
        seq: SeqId,
        layer: usize,
        k: &Tensor,
        v: &Tensor,
    ) -> Result<(Tensor, Tensor)> {
        if layer >= self.num_layers {
            return Err(ModelError::input(format!(
                "layer {layer} out of range ({} layers)",
                self.num_layers
            )));
        }
        let n = k.dim(1).ctx("kv cache append")?;
        if !self.seqs.contains_key(&seq) {
            let layers = (0..self.num_layers)
                .map(|_| self.empty_layer(n.next_power_of_two().max(16)))
                .collect::<candle_core::Result<Vec<_>>>()
                .ctx("kv cache allocation")?;
            self.seqs.insert(seq, layers);
        }
        let (kv_heads, head_dim, dtype, device) = (
            self.kv_heads,
            self.head_dim,
            self.dtype,
            self.device.clone(),
        );
        let slot = &mut self.seqs.get_mut(&seq).expect("inserted above")[layer];
        let mut grow = || -> candle_core::Result<()> {
            let needed = slot.len + n;
            let capacity = slot.k.dim(1)?;
            if needed > capacity {
                let new_cap = needed.next_power_of_two().max(2 * capacity);
                let shape = (kv_heads, new_cap, head_dim);
                let k2 = Tensor::zeros(shape, dtype, &device)?;
                let v2 = Tensor::zeros(shape, dtype, &device)?;
                if slot.len > 0 {
                    k2.slice_set(&slot.k.narrow(1, 0, slot.len)?.contiguous()?, 1, 0)?;
                    v2.slice_set(&slot.v.narrow(1, 0, slot.len)?.contiguous()?, 1, 0)?;
                }
                slot.k = k2;
                slot.v = v2;
            }
            // The buffers are private to this cache: writing in place cannot affect a snapshot
            // or another sequence.
            slot.k.slice_set(&k.contiguous()?, 1, slot.len)?;
            slot.v.slice_set(&v.contiguous()?, 1, slot.len)?;
            slot.len += n;
            Ok(())
        };
        grow().ctx("kv cache append")?;
        let read = |t: &Tensor| t.narrow(1, 0, slot.len).and_then(|t| t.contiguous());
        Ok((
            read(&slot.k).ctx("kv cache read")?,
            read(&slot.v).ctx("kv cache read")?,
        ))
    }

    fn remove(&mut self, seq: SeqId) -> bool {
        self.seqs.remove(&seq).is_some()
    }

    fn num_sequences(&self) -> usize {
        self.seqs.len()
    }

    fn num_tokens(&self) -> usize {
        self.seqs
            .values()
            .map(|layers| layers.last().map_or(0, |l| l.len))
            .sum()
    }
}
