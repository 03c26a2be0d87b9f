//! A decode step over fixed buffers, for replaying a captured CUDA graph
//! ([`crate::InferenceModel::set_decode_graphs`]): the host builds the step's row tables at a
//! padded batch size ([`PagedKvCache::decode_meta`]), the attention reads them from a buffer the
//! graph was captured with ([`PagedKvCache::attend_meta`]), and the step's tokens are committed
//! afterwards ([`PagedKvCache::commit_decode`]). Padding rows see one position, stored in a
//! block no sequence ever gets.

use candle_core::{Storage, Tensor};

use super::{BlockId, PagedKvCache, rows::Writes};
use crate::cache::{NewHeads, SeqId};
use crate::error::{ModelError, Result, TensorContext};

impl PagedKvCache {
    /// The paged attention's row tables (`attention_meta`'s words) for a decode step of
    /// `rows ≥ seqs.len()` rows: one new token for each of `seqs` (whose `begin_step` reserved
    /// it), then padding rows that each see one position, stored in the scratch block
    /// ([`Self::take_scratch_block`] first).
    pub(crate) fn decode_meta(&self, seqs: &[SeqId], rows: usize) -> Result<Vec<u32>> {
        let scratch = match (rows > seqs.len(), self.scratch) {
            (false, _) => None,
            (true, Some(block)) => Some(block),
            (true, None) => {
                return Err(ModelError::input(
                    "decode step: padding rows without a scratch block",
                ));
            }
        };
        let mut words = Vec::with_capacity(3 * rows);
        let mut tables: Vec<u32> = Vec::new();
        for seq in seqs {
            let Some(s) = self.seqs.get(seq) else {
                return Err(ModelError::input(format!(
                    "decode step: sequence {seq} did not begin the step"
                )));
            };
            if self.blocks_for(s.len + 1) > s.blocks.len() {
                return Err(ModelError::input(format!(
                    "decode step: sequence {seq} has no block reserved for its next token"
                )));
            }
            let (start, len) = (tables.len() as u32, s.len as u32);
            tables.extend_from_slice(&s.blocks);
            words.extend([start, len + 1, len]);
        }
        if let Some(block) = scratch {
            let start = tables.len() as u32;
            tables.push(block);
            words.extend((seqs.len()..rows).flat_map(|_| [start, 1, 0]));
        }
        words.extend(tables);
        Ok(words)
    }

    /// The most words [`Self::decode_meta`] gives for `rows` rows whose sequences hold at most
    /// `tokens` tokens each (the new one included).
    pub(crate) fn decode_meta_capacity(&self, rows: usize, tokens: usize) -> usize {
        rows * (3 + self.blocks_for(tokens)) + 1
    }

    /// Whether the GPU attention may split a long row's keys over parts scored at once
    /// (flash-decoding: on by default; [`Self::key_parts`]). Off, each row and head is one
    /// warp's pass over its keys, as before the split: for measuring what the split pays.
    pub fn set_key_split(&mut self, on: bool) {
        self.key_split = on;
    }

    /// The parts the GPU attention splits each row's keys into, for `rows` rows of `heads`
    /// query heads whose longest sees `longest` positions: one per 512 keys of the longest row
    /// while the launch has fewer than about 4,096 warps, at most 16, a power of two; 1 with
    /// the split off ([`Self::set_key_split`]).
    pub fn key_parts(&self, rows: usize, heads: usize, longest: usize) -> u32 {
        if self.key_split {
            key_parts(rows, heads, longest)
        } else {
            1
        }
    }

    /// A decode step's attention in `layer` over the row tables `meta` (from
    /// [`Self::decode_meta`], on the pools' device), storing the rows' new keys and values; no
    /// block is reserved and nothing committed (the host did, and does, that around the step).
    /// On a GPU each row's keys are scored in `parts` stretches ([`Self::key_parts`]).
    pub(crate) fn attend_meta(
        &self,
        heads: NewHeads<'_>,
        layer: usize,
        meta: &Tensor,
        scale: f64,
        parts: u32,
    ) -> Result<Tensor> {
        self.check_layer(layer)?;
        if !self.attends_itself() {
            return Err(ModelError::input(format!(
                "a decode step over fixed tables on a {:?} pool on {:?}",
                self.dtype, self.device
            )));
        }
        #[cfg(feature = "cuda")]
        if self.attends_on_gpu() {
            let geometry = (self.kv_heads, self.block_tokens);
            let pool = &self.pools[layer];
            return crate::fused::device::paged_attention(
                heads, pool, meta, geometry, scale, parts,
            )
            .ctx("paged attention over fixed tables");
        }
        // The CPU reads the same words: each row's table and visible length, in one pass.
        let _ = parts;
        let (q, k, v) = heads.split().ctx("decode step heads")?;
        let rows = q.dim(0).ctx("decode step heads")?;
        let words: Vec<u32> = meta.to_vec1().ctx("decode step tables")?;
        let mut tables: Vec<&[BlockId]> = Vec::with_capacity(rows);
        let mut visible = Vec::with_capacity(rows);
        let mut writes = Vec::with_capacity(rows * self.kv_heads);
        for r in 0..rows {
            let (start, len) = (words[3 * r] as usize, words[3 * r + 1] as usize);
            let table = &words[3 * rows + start..][..self.blocks_for(len)];
            writes.extend((0..self.kv_heads).map(|h| self.row(table, len - 1, h) as u32));
            tables.push(table);
            visible.push(len);
        }
        let writes = Writes::on_host(writes);
        self.write_rows(&writes, layer, &k, &v.contiguous().ctx("v")?)
            .ctx("decode step keys")?;
        self.attend_cpu(layer, &q, &tables, &visible, scale)
            .ctx("paged attention over fixed tables")
    }

    /// Counts a decode step's one token of each of `seqs` as cached in every layer.
    pub(crate) fn commit_decode(&mut self, seqs: &[SeqId]) {
        for &seq in seqs {
            self.commit(self.num_layers - 1, seq, 1);
        }
    }

    /// Changes whenever the pools' buffers do (they are copied as they grow): a graph captured
    /// over the old ones must not be replayed.
    pub(crate) fn pool_generation(&self) -> usize {
        self.capacity
    }

    /// Whether the block padding rows store their keys in is there: taken from the allocator
    /// the first time and never given back, so no sequence reads it. False when no block is
    /// free for it (the step then runs unpadded, eagerly).
    pub(crate) fn take_scratch_block(&mut self) -> bool {
        if self.scratch.is_some() {
            return true;
        }
        let Some(block) = self.alloc.allocate() else {
            return false;
        };
        if self.grow(block as usize + 1).is_err() {
            self.alloc.release(block);
            return false;
        }
        self.scratch = Some(block);
        true
    }

    /// Attention on the CPU for query rows `q (rows, heads, d)` whose keys and values are in
    /// the pools already: row `i` sees positions `0..visible[i]` of the sequence with block
    /// table `tables[i]`.
    pub(super) fn attend_cpu(
        &self,
        layer: usize,
        q: &Tensor,
        tables: &[&[BlockId]],
        visible: &[usize],
        scale: f64,
    ) -> candle_core::Result<Tensor> {
        let (rows, heads, d) = q.dims3()?;
        if tables.len() != rows || visible.len() != rows {
            candle_core::bail!("{rows} query rows for {} new tokens", tables.len())
        }
        let shape = super::attend::PoolShape {
            kv_heads: self.kv_heads,
            groups: heads / self.kv_heads,
            head_dim: d,
            block_tokens: self.block_tokens,
        };
        let q = q.contiguous()?;
        let (q_storage, q_layout) = q.storage_and_layout();
        let (kb, vb) = self.kv(layer)?;
        let (k_storage, k_layout) = kb.storage_and_layout();
        let (v_storage, v_layout) = vb.storage_and_layout();
        let (Storage::Cpu(q_cpu), Storage::Cpu(k_cpu), Storage::Cpu(v_cpu)) =
            (&*q_storage, &*k_storage, &*v_storage)
        else {
            candle_core::bail!("the paged kv pool is not on the CPU");
        };
        let q = &q_cpu.as_slice::<f32>()?[q_layout.start_offset()..][..rows * heads * d];
        // The halves of the layer's contiguous pool: rows counted from each one's start.
        let keys = &k_cpu.as_slice::<f32>()?[k_layout.start_offset()..];
        let values = &v_cpu.as_slice::<f32>()?[v_layout.start_offset()..];
        let out = super::attend::attention(keys, values, q, tables, visible, &shape, scale as f32);
        Tensor::from_vec(out, (rows, heads * d), &self.device)
    }
}

/// Keys a part of a split launch scores at least (below this a row is scored in one part).
const KEYS_PER_PART: usize = 512;
/// Parts a row's keys are split into at most.
const MAX_KEY_PARTS: usize = 16;
/// Warps a launch is split for: a few per SM of the largest GPUs (132 SMs on an H100/H200).
const TARGET_WARPS: usize = 4096;

/// How many stretches the GPU's paged attention splits each row's keys into, for `rows` rows of
/// `heads` query heads whose longest sees `longest` positions: one per 512 keys of the longest
/// row while the launch has fewer than about 4,096 warps, at most 16, rounded down to a power of
/// two (a captured decode step keeps its count; fewer distinct counts, fewer captures). Rows
/// under 1,024 positions take one part, the launch as it was before the split.
fn key_parts(rows: usize, heads: usize, longest: usize) -> u32 {
    let by_length = longest / KEYS_PER_PART;
    let by_warps = TARGET_WARPS / (rows * heads).max(1);
    let parts = by_length.min(by_warps).clamp(1, MAX_KEY_PARTS);
    1 << parts.ilog2()
}

#[cfg(test)]
mod tests {
    use super::key_parts;

    #[test]
    fn long_rows_in_small_launches_split_their_keys() {
        // The check's decode (64 sequences, 14 heads, about 150 positions): one pass.
        assert_eq!(key_parts(64, 14, 150), 1);
        assert_eq!(key_parts(64, 14, 1023), 1);
        // 896 warps: four parts bring the launch to about 3,600.
        assert_eq!(key_parts(64, 14, 4096), 4);
        // Five parts by length, rounded down to four.
        assert_eq!(key_parts(4, 14, 3000), 4);
        assert_eq!(key_parts(1, 14, 32_768), 16);
        // A launch with thousands of warps already is not split.
        assert_eq!(key_parts(256, 14, 32_768), 1);
    }
}
