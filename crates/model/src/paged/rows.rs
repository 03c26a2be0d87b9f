//! Where a step's new keys and values go in the block pools, and which pool rows a batch reads:
//! built at a batch's first layer and reused by the later ones (tables and lengths do not change
//! within a step).

use std::sync::Arc;

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, InplaceOp3, Layout, Tensor};

use super::{BlockId, PagedKvCache};
use crate::cache::SeqId;

/// Where one batch of a step writes and reads in every layer's pools.
#[derive(Debug)]
pub(super) struct StepRows {
    seqs: Vec<SeqId>,
    news: Vec<usize>,
    /// The sequences' lengths before the step.
    lens: Vec<usize>,
    write: Writes,
    /// `(B · kv_heads · T)`: every sequence's kv heads at positions `0..T`, padded with row 0,
    /// and `T`; built when first needed (the CPU's decode kernel reads the pools in place).
    read: Option<(Tensor, usize)>,
    /// The GPU attention kernel's row tables ([`PagedKvCache::attention_meta`]).
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    meta: Option<Tensor>,
}

/// Where a batch's new keys and values go in the pools.
#[derive(Debug, Clone)]
pub(super) struct Writes {
    /// The pool row of each new token's kv heads, `(token, kv head)` in the batch's order.
    rows: Arc<[u32]>,
    /// The same rows as a tensor on the pools' device, for a GPU's `kv_rows` (`None` on the CPU,
    /// and until a gathering batch asks).
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    on_device: Option<Tensor>,
}

impl Writes {
    /// Rows computed on the host, not (yet) on the device.
    pub(super) fn on_host(rows: Vec<u32>) -> Self {
        Self {
            rows: rows.into(),
            on_device: None,
        }
    }
}

/// Copies row `i` of the new keys and of the new values, contiguous `(rows, width)`, to row
/// `rows[i]` of the pool's keys and of its values, in place, in one pass (on a GPU one launch:
/// the keys and the values are the two halves of one tensor for this).
struct CopyKv(Writes);

impl InplaceOp3 for CopyKv {
    fn name(&self) -> &'static str {
        "paged-kv-copy-rows"
    }

    fn cpu_fwd(
        &self,
        pool: &mut CpuStorage,
        pool_layout: &Layout,
        k: &CpuStorage,
        k_layout: &Layout,
        v: &CpuStorage,
        v_layout: &Layout,
    ) -> candle_core::Result<()> {
        fn copy<T: Copy>(
            rows: &[u32],
            (pool, at): (&mut [T], &Layout),
            new: [(&[T], &Layout); 2],
        ) -> candle_core::Result<()> {
            let (pool_rows, width) = at.shape().dims2()?;
            let half = pool_rows / 2;
            if !at.is_contiguous() {
                candle_core::bail!("kv rows: the pool is not contiguous")
            }
            let pool = &mut pool[at.start_offset()..][..2 * half * width];
            let (keys, values) = pool.split_at_mut(half * width);
            for (dst, (src, from)) in [keys, values].into_iter().zip(new) {
                let (n, w) = from.shape().dims2()?;
                if !from.is_contiguous() || n != rows.len() || w != width {
                    candle_core::bail!(
                        "kv rows: {n} rows of {w} for {} rows of {width}",
                        rows.len()
                    )
                }
                let src = &src[from.start_offset()..][..n * w];
                for (&row, values) in rows.iter().zip(src.chunks_exact(width)) {
                    let start = row as usize * width;
                    let Some(out) = dst.get_mut(start..start + width) else {
                        candle_core::bail!("kv rows: row {row} past the pool's {half}")
                    };
                    out.copy_from_slice(values);
                }
            }
            Ok(())
        }
        let rows = &self.0.rows;
        match (pool, k, v) {
            (CpuStorage::F32(p), CpuStorage::F32(k), CpuStorage::F32(v)) => {
                copy(rows, (p, pool_layout), [(k, k_layout), (v, v_layout)])
            }
            (CpuStorage::BF16(p), CpuStorage::BF16(k), CpuStorage::BF16(v)) => {
                copy(rows, (p, pool_layout), [(k, k_layout), (v, v_layout)])
            }
            (CpuStorage::F16(p), CpuStorage::F16(k), CpuStorage::F16(v)) => {
                copy(rows, (p, pool_layout), [(k, k_layout), (v, v_layout)])
            }
            (CpuStorage::F64(p), CpuStorage::F64(k), CpuStorage::F64(v)) => {
                copy(rows, (p, pool_layout), [(k, k_layout), (v, v_layout)])
            }
            (p, k, v) => candle_core::bail!(
                "kv rows: {:?} keys and {:?} values into a {:?} pool",
                k.dtype(),
                v.dtype(),
                p.dtype()
            ),
        }
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        pool: &mut candle_core::CudaStorage,
        pool_layout: &Layout,
        k: &candle_core::CudaStorage,
        k_layout: &Layout,
        v: &candle_core::CudaStorage,
        v_layout: &Layout,
    ) -> candle_core::Result<()> {
        let Some(rows) = &self.0.on_device else {
            candle_core::bail!("kv rows: the rows were built for the CPU")
        };
        crate::fused::device::kv_rows((pool, pool_layout), (k, k_layout), (v, v_layout), rows)
    }
}

impl PagedKvCache {
    /// Pool row of kv head `h` at position `t` of a sequence with table `blocks`.
    pub(super) fn row(&self, blocks: &[BlockId], t: usize, h: usize) -> usize {
        let b = self.block_tokens;
        (blocks[t / b] as usize * self.kv_heads + h) * b + t % b
    }

    /// The rows `news[b]` new tokens of each of `seqs` go to, and with `read` the rows of every
    /// sequence's positions padded to the longest: from this step's earlier layers when a
    /// batch of the same sequences came by, else built (and kept for the later layers).
    pub(super) fn step_rows(
        &mut self,
        seqs: &[SeqId],
        news: &[usize],
        read: bool,
    ) -> candle_core::Result<(Writes, Option<(Tensor, usize)>)> {
        let lens: Vec<usize> = seqs.iter().map(|q| self.seqs[q].len).collect();
        let found = self
            .step_rows
            .iter()
            .position(|r| r.seqs == seqs && r.news == news && r.lens == lens);
        let i = match found {
            Some(i) => i,
            None => {
                let kv = self.kv_heads;
                let mut rows = Vec::with_capacity(news.iter().sum::<usize>() * kv);
                for ((q, &len), &n) in seqs.iter().zip(&lens).zip(news) {
                    let blocks = &self.seqs[q].blocks;
                    for t in len..len + n {
                        rows.extend((0..kv).map(|h| self.row(blocks, t, h) as u32));
                    }
                }
                let write = Writes {
                    rows: rows.into(),
                    on_device: None,
                };
                self.step_rows.push(StepRows {
                    seqs: seqs.to_vec(),
                    news: news.to_vec(),
                    lens,
                    write,
                    read: None,
                    meta: None,
                });
                self.step_rows.len() - 1
            }
        };
        // A GPU's gathering batches store their keys with `kv_rows`, which reads the rows on
        // the device (its paged attention stores them itself: no upload for it).
        let write = &mut self.step_rows[i].write;
        if read && write.on_device.is_none() && !self.device.is_cpu() {
            write.on_device = Some(Tensor::new(&write.rows[..], &self.device)?);
        }
        if read && self.step_rows[i].read.is_none() {
            let r = &self.step_rows[i];
            let longest = r
                .lens
                .iter()
                .zip(news)
                .map(|(l, n)| l + n)
                .max()
                .unwrap_or(1);
            let mut rows = Vec::with_capacity(seqs.len() * self.kv_heads * longest);
            for ((q, &len), &n) in seqs.iter().zip(&r.lens).zip(news) {
                let blocks = &self.seqs[q].blocks;
                for h in 0..self.kv_heads {
                    rows.extend((0..len + n).map(|t| self.row(blocks, t, h) as u32));
                    rows.extend(std::iter::repeat_n(0, longest - len - n));
                }
            }
            let rows = self.rows_tensor(rows)?;
            self.step_rows[i].read = Some((rows, longest));
        }
        let r = &self.step_rows[i];
        Ok((r.write.clone(), r.read.clone()))
    }

    /// For the GPU's attention over the pools (`kernels/paged.cu`): per query row (each new token
    /// of `seqs`, in order) the start of its sequence's block table, the number of positions it
    /// sees and its sequence's length before the step (the kernel stores the positions from
    /// there on and reads them from the step's own keys and values), then the tables, as one
    /// u32 tensor on the pools' device; built at the step's first layer and reused by the later
    /// ones.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub(super) fn attention_meta(
        &mut self,
        seqs: &[SeqId],
        news: &[usize],
    ) -> candle_core::Result<Tensor> {
        self.step_rows(seqs, news, false)?;
        let lens: Vec<usize> = seqs.iter().map(|q| self.seqs[q].len).collect();
        let i = self
            .step_rows
            .iter()
            .position(|r| r.seqs == seqs && r.news == news && r.lens == lens)
            .expect("step_rows keeps the step's entry");
        if let Some(meta) = &self.step_rows[i].meta {
            return Ok(meta.clone());
        }
        let mut meta = Vec::with_capacity(3 * news.iter().sum::<usize>());
        let mut tables: Vec<u32> = Vec::new();
        for ((q, &len), &n) in seqs.iter().zip(&lens).zip(news) {
            let start = tables.len() as u32;
            tables.extend_from_slice(&self.seqs[q].blocks);
            let cached = len as u32;
            meta.extend((len + 1..=len + n).flat_map(|visible| [start, visible as u32, cached]));
        }
        meta.extend(tables);
        let meta = self.rows_tensor(meta)?;
        self.step_rows[i].meta = Some(meta.clone());
        Ok(meta)
    }

    /// Writes new keys and values (`k`, `v`: `(tokens, kv_heads, head_dim)`) of `layer` at the
    /// pool rows `writes` (from [`PagedKvCache::step_rows`]), in place, in the pools' dtype.
    pub(super) fn write_rows(
        &self,
        writes: &Writes,
        layer: usize,
        k: &Tensor,
        v: &Tensor,
    ) -> candle_core::Result<()> {
        let shape = (writes.rows.len(), self.head_dim);
        let rows = |t: &Tensor| t.reshape(shape)?.to_dtype(self.dtype)?.contiguous();
        self.pools[layer].inplace_op3(&rows(k)?, &rows(v)?, &CopyKv(writes.clone()))
    }

    /// Row indices of positions `0..total` of `blocks`, as a `(total,)` tensor.
    fn rows_tensor(&self, rows: Vec<u32>) -> candle_core::Result<Tensor> {
        let n = rows.len();
        Tensor::from_vec(rows, n, &self.device)
    }
}

#[cfg(test)]
mod tests {
    use candle_core::{DType, Device};
    use sluice_core::PolicyVersion;

    use crate::cache::KvCache;
    use crate::presets::{Preset, preset_config};

    use super::PagedKvCache;

    /// Two sequences, one with 5 cached tokens adding a prompt of 2, one adding its first token:
    /// a row per new token naming its table's start and how many positions it sees, then the
    /// tables; the same tensor for every layer of the step.
    #[test]
    fn attention_meta_lists_each_rows_table_and_visible_positions() {
        let config = preset_config(Preset::Tiny);
        let mut cache = PagedKvCache::new(&config, DType::F32, &Device::Cpu, 16, 4).unwrap();
        let v = PolicyVersion(0);
        cache.begin_step(1, &[1, 2, 3, 4, 5], v).unwrap();
        // Five tokens count as cached once the last layer commits them.
        for layer in 0..config.num_layers {
            cache.commit(layer, 1, 5);
        }
        cache.begin_step(1, &[6, 7], v).unwrap();
        cache.begin_step(2, &[9], v).unwrap();
        let meta = cache.attention_meta(&[1, 2], &[2, 1]).unwrap();
        let meta: Vec<u32> = meta.to_vec1().unwrap();
        let (t1, t2) = (cache.block_table(1).to_vec(), cache.block_table(2).to_vec());
        assert_eq!(t1.len(), 2, "7 tokens in blocks of 4");
        let start2 = t1.len() as u32;
        let mut want = vec![0, 6, 5, 0, 7, 5, start2, 1, 0];
        want.extend(t1);
        want.extend(t2);
        assert_eq!(meta, want);
        let again: Vec<u32> = cache
            .attention_meta(&[1, 2], &[2, 1])
            .unwrap()
            .to_vec1()
            .unwrap();
        assert_eq!(again, meta);
    }
}
