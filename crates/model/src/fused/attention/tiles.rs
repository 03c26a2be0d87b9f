//! Which tiles of a row's query-key square hold a visible pair: the GPU kernels skip the rest.
//!
//! A row packed with a shared prompt and its group's completions (`trainer.share_prompts`) lets
//! each completion see the prompt and itself, not the completions packed before it; the kernels
//! walk the keys from a query's first visible slot up to the query, so without the mask a late
//! completion's queries stage and score every earlier completion's keys only to mask them out
//! (about 3.4× the visible pairs for four completions after a 64-slot prompt at 2,048 slots).

/// Slots per side of a tile of [`visible_tiles`].
pub const TILE: usize = 64;

/// `(tiles, words)` of a row of `len` slots: its tiles of [`TILE`] slots a side, and the `u32`
/// words of one query tile's bits, one per key tile.
pub(super) fn mask_shape(len: usize) -> (usize, usize) {
    let tiles = len.div_ceil(TILE);
    (tiles, tiles.div_ceil(32))
}

/// For each row and each tile of [`TILE`] queries, one bit per tile of [`TILE`] keys (in
/// `len.div_ceil(TILE).div_ceil(32)` words): set iff some query of the one sees some key of the
/// other under the attention's rule (`first[i] ≤ j ≤ i`, and `j`'s segment is `i`'s own or the
/// prefix `i` continues, unless `runs`). Exact: a clear bit is a tile with no visible pair.
pub(super) fn visible_tiles(
    (batch, len): (usize, usize),
    ids: &[u32],
    prefixes: &[u32],
    first: &[u32],
    runs: bool,
) -> Vec<u32> {
    let (tiles, words) = mask_shape(len);
    let mut out = vec![0u32; batch * tiles * words];
    for r in 0..batch {
        let row = r * len..(r + 1) * len;
        let (ids, prefixes, first) = (&ids[row.clone()], &prefixes[row.clone()], &first[row]);
        // The row's runs of equal segment ids, `(start, end, id)`.
        let mut spans: Vec<(usize, usize, u32)> = Vec::new();
        for (i, &s) in ids.iter().enumerate() {
            match spans.last_mut() {
                Some(last) if last.2 == s => last.1 = i + 1,
                _ => spans.push((i, i + 1, s)),
            }
        }
        let mut mark = |qt: usize, lo: usize, hi: usize| {
            for kt in lo / TILE..=hi / TILE {
                out[(r * tiles + qt) * words + kt / 32] |= 1 << (kt % 32);
            }
        };
        // Queries of one tile with the same segment, prefix and first key see, together, the
        // keys of their segment and prefix from that first key up to the last of them.
        let mut i = 0;
        while i < len {
            let key = |i: usize| (i / TILE, ids[i], prefixes[i], first[i]);
            let (qt, s, p, f) = key(i);
            let mut last = i;
            while last + 1 < len && key(last + 1) == (qt, s, p, f) {
                last += 1;
            }
            let f = f as usize;
            if runs {
                mark(qt, f, last);
            } else {
                let from = spans.partition_point(|sp| sp.1 <= f);
                for &(a, b, id) in spans[from..].iter().take_while(|sp| sp.0 <= last) {
                    if crate::batch::segment_visible(s, p, id) {
                        mark(qt, a.max(f), (b - 1).min(last));
                    }
                }
            }
            i = last + 1;
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::super::Segments;
    use super::*;

    /// The skipped tile pairs below the diagonal (where the kernels' walk goes), row by row,
    /// after checking every pair one by one: each bit is whether any pair of its tiles is
    /// visible.
    fn check(seg: &Segments) -> Vec<usize> {
        let (batch, len) = seg.shape();
        let (tiles, words) = mask_shape(len);
        let mask = seg.visible_tiles();
        let mut skipped = vec![0usize; batch];
        for r in 0..batch {
            for qt in 0..tiles {
                for kt in 0..tiles {
                    let visible = (qt * TILE..((qt + 1) * TILE).min(len)).any(|i| {
                        let f = seg.first()[r * len + i] as usize;
                        (f..=i).any(|j| j / TILE == kt && seg.allowed(r, i, j))
                    });
                    let bit = mask[(r * tiles + qt) * words + kt / 32] >> (kt % 32) & 1 == 1;
                    assert_eq!(bit, visible, "row {r}, query tile {qt}, key tile {kt}");
                    skipped[r] += usize::from(!bit && kt <= qt);
                }
            }
        }
        skipped
    }

    #[test]
    fn the_tile_mask_is_exactly_the_tiles_with_a_visible_pair() {
        let len = 300;
        // A 20-slot prompt and completions of 70 that continue it.
        let grpo: Vec<u32> = (0..len)
            .map(|i| if i < 20 { 1 } else { 2 + (i as u32 - 20) / 70 })
            .collect();
        let grpo_prefix: Vec<u32> = (0..len).map(|i| u32::from(i >= 20)).collect();
        let plain: Vec<u32> = (0..len).map(|i| 1 + i as u32 / 90).collect();
        let scattered: Vec<u32> = (0..len).map(|i| [1, 1, 2, 1, 2, 2, 3][i % 7]).collect();
        let ids = [grpo, plain.clone(), scattered].concat();
        let prefixes = [grpo_prefix, vec![0; 2 * len]].concat();
        let mixed = Segments::with_prefixes(3, len, &ids, &prefixes).unwrap();
        assert!(!mixed.runs());
        let skipped = check(&mixed);
        // The completions skip the tiles of those packed before them, which the kernels walked.
        assert!(skipped[0] >= 3, "{skipped:?}");
        // Segments that are runs and continue nothing: the same mask by the ranges alone.
        let runs = Segments::new(1, len, &plain).unwrap();
        assert!(runs.runs());
        check(&runs);
        // Every tile marked, as the kernels walked before the mask.
        let every = Segments::new(1, len, &plain).unwrap().walking_every_tile();
        assert_eq!(every.visible_tiles(), [u32::MAX; 5]);
    }
}
