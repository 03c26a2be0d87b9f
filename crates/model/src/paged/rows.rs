//! Where a step's new keys and values go in the block pools, and which pool rows a batch reads:
//! built at a batch's first layer and reused by the later ones (tables and lengths do not change
//! within a step).

use candle_core::Tensor;

use super::{BlockId, PagedKvCache};
use crate::cache::SeqId;

/// Where one batch of a step writes and reads in every layer's pools.
#[derive(Debug)]
pub(super) struct StepRows {
    seqs: Vec<SeqId>,
    news: Vec<usize>,
    /// The sequences' lengths before the step.
    lens: Vec<usize>,
    /// `(Σ news · kv_heads, head_dim)`: the pool row of each new token's kv heads, repeated
    /// across the row (scatter indexes are per element).
    write: Tensor,
    /// `(B · kv_heads · T)`: every sequence's kv heads at positions `0..T`, padded with row 0,
    /// and `T`; built when first needed (the CPU's decode kernel reads the pools in place).
    read: Option<(Tensor, usize)>,
}

impl PagedKvCache {
    /// Pool row of kv head `h` at position `t` of a sequence with table `blocks`.
    fn row(&self, blocks: &[BlockId], t: usize, h: usize) -> usize {
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
    ) -> candle_core::Result<(Tensor, Option<(Tensor, usize)>)> {
        let lens: Vec<usize> = seqs.iter().map(|q| self.seqs[q].len).collect();
        let found = self
            .step_rows
            .iter()
            .position(|r| r.seqs == seqs && r.news == news && r.lens == lens);
        let i = match found {
            Some(i) => i,
            None => {
                let (width, kv) = (self.head_dim, self.kv_heads);
                let rows = news.iter().sum::<usize>() * kv;
                let mut index = Vec::with_capacity(rows * width);
                for ((q, &len), &n) in seqs.iter().zip(&lens).zip(news) {
                    let blocks = &self.seqs[q].blocks;
                    for t in len..len + n {
                        for h in 0..kv {
                            let row = self.row(blocks, t, h) as u32;
                            index.extend(std::iter::repeat_n(row, width));
                        }
                    }
                }
                let write = Tensor::from_vec(index, (rows, width), &self.device)?;
                self.step_rows.push(StepRows {
                    seqs: seqs.to_vec(),
                    news: news.to_vec(),
                    lens,
                    write,
                    read: None,
                });
                self.step_rows.len() - 1
            }
        };
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

    /// Writes new keys and values (`k`, `v`: `(tokens, kv_heads, head_dim)`) of `layer` at the
    /// pool rows `index` (`(tokens · kv_heads, head_dim)`, from [`PagedKvCache::step_rows`]),
    /// in place.
    pub(super) fn write_rows(
        &self,
        index: &Tensor,
        layer: usize,
        k: &Tensor,
        v: &Tensor,
    ) -> candle_core::Result<()> {
        let (rows, width) = index.dims2()?;
        let (kb, vb) = &self.pools[layer];
        kb.scatter_set(index, &k.reshape((rows, width))?.contiguous()?, 0)?;
        vb.scatter_set(index, &v.reshape((rows, width))?.contiguous()?, 0)
    }

    /// Row indices of positions `0..total` of `blocks`, as a `(total,)` tensor.
    fn rows_tensor(&self, rows: Vec<u32>) -> candle_core::Result<Tensor> {
        let n = rows.len();
        Tensor::from_vec(rows, n, &self.device)
    }
}
