//! The AMX tile kernel: jobs over column pairs of packed weights on the role's rayon pool,
//! each a walk of 2×2 squares of sum tiles along `k`, written in inline assembly (Rust has no
//! stable AMX intrinsics). See the parent module for the layouts it reads.

use std::arch::asm;

use rayon::prelude::*;

use super::{Bf16Weight, Line, PAIR, TILE};

/// Palette 1 with tiles 0–7 all 16 rows of 64 bytes (sums: 16×16 f32; inputs: 16×32 bf16;
/// weights: 16 pairs × 16 columns of bf16).
#[repr(C, align(64))]
struct Config([u8; 64]);

const CONFIG: Config = {
    let mut c = [0u8; 64];
    c[0] = 1;
    let mut t = 0;
    while t < 8 {
        c[16 + 2 * t] = 64; // bytes per row (u16, little-endian)
        c[48 + t] = TILE as u8; // rows
        t += 1;
    }
    Config(c)
};

/// Input rows that pass a job's column pairs together. A prompt's rows (thousands) would
/// not stay in L2 while every pair passes them (at `k` = 1,536, 3 MB per 1,024 rows); 256
/// rows (768 KB there) do, and each pair's weights are read once per 256 rows. A decode
/// step (64 rows) is one chunk.
const ROW_CHUNK: usize = 256;

/// Column pairs per job: a few jobs per thread, so the split evens out.
fn pairs_per_job(pairs: usize) -> usize {
    let threads = rayon::current_num_threads().max(1);
    pairs.div_ceil(threads * 4).max(1)
}

/// Every 32×32 square of `a (m_padded, k) · wᵀ` into its `out` (row stride
/// `w.n_padded`), for each `(w, out)` of `products`, in one pass of the pool: the jobs of
/// every weight share one split, so the products that read one input wake the pool once.
///
/// # Safety
/// AMX is available and granted; `a` holds `m_padded` (a multiple of 32) rows of
/// `w.k_blocks` blocks, the same for every `w`; each `out` is valid for
/// `m_padded · w.n_padded` writes, and no two overlap.
#[allow(unsafe_code)]
pub(super) unsafe fn run(a: &[Line], m_padded: usize, products: &[(&Bf16Weight, *mut f32)]) {
    let pairs = |w: &Bf16Weight| w.n_padded / PAIR;
    let per_job = pairs_per_job(products.iter().map(|(w, _)| pairs(w)).sum());
    // (product, first pair, end pair).
    let jobs: Vec<(usize, usize, usize)> = products
        .iter()
        .enumerate()
        .flat_map(|(i, (w, _))| {
            let n = pairs(w);
            (0..n)
                .step_by(per_job)
                .map(move |first| (i, first, (first + per_job).min(n)))
        })
        .collect();
    let (weights, outs): (Vec<&Bf16Weight>, Vec<crate::fused::Columns>) = products
        .iter()
        .map(|&(w, out)| (w, crate::fused::Columns(out)))
        .unzip();
    let job = |&(i, first, end): &(usize, usize, usize)| {
        let w = weights[i];
        debug_assert_eq!(a.len(), m_padded * w.k_blocks);
        let (out, per_tile) = (outs[i], w.k_blocks * TILE);
        // SAFETY: the caller's contract; this job writes columns `32·first..32·end` of
        // every row of its product's output, which no other job writes.
        unsafe {
            asm!("ldtilecfg [{}]", in(reg) CONFIG.0.as_ptr(), options(nostack, readonly));
            for chunk in (0..m_padded).step_by(ROW_CHUNK) {
                let chunk_end = (chunk + ROW_CHUNK).min(m_padded);
                for pair in first..end {
                    let b = w.lines.as_ptr().add(2 * pair * per_tile);
                    for rows in (chunk..chunk_end).step_by(PAIR) {
                        square(
                            a.as_ptr().add(rows * w.k_blocks),
                            w.k_blocks,
                            b,
                            per_tile,
                            out.at(rows * w.n_padded + pair * PAIR),
                            w.n_padded,
                            // The chunk's first rows read the pair from memory; the
                            // others find it in L1/L2.
                            rows == chunk,
                        );
                    }
                }
            }
            asm!("tilerelease", options(nostack, nomem));
        }
    };
    if jobs.len() > 1 && rayon::current_num_threads() > 1 {
        jobs.par_iter().for_each(job);
    } else {
        jobs.iter().for_each(job);
    }
}

/// Weight blocks (1 KB each, per column tile) that [`square`] asks for ahead of the one it
/// multiplies: a tile load that waits on memory stalls the tile unit. Measured on SmolLM2
/// at 64 in flight (`sluice bench engine --warm-up`, alternated runs): decode 1,230 tok/s
/// without, 1,300 with 4 blocks; 8 or 16, or into L2 only, were no better.
const AHEAD: usize = 4;

/// Asks for the 16 lines of the weight block at `p` (a prefetch never faults, so `p` may
/// point past the weight: the request is dropped).
#[inline(always)]
fn prefetch_block(p: *const Line) {
    for line in 0..TILE {
        // SAFETY: a prefetch reads no memory architecturally and cannot fault.
        #[allow(unsafe_code)]
        unsafe {
            std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T0 }>(
                p.wrapping_add(line).cast(),
            )
        };
    }
}

/// One 32×32 square of sums: rows `a` (two row tiles of `k_blocks` blocks, in
/// [`Bf16Rows`](super::Bf16Rows)' order) against the column
/// tiles at `b` and `b + per_tile` lines, stored at `c` (row stride `c_stride` floats).
/// With `stream`, the weight blocks [`AHEAD`] along (into the next pair's at the end) are
/// asked for as the walk goes.
///
/// # Safety
/// Tiles configured by [`CONFIG`] on this thread; every pointer in bounds as described.
#[inline(always)]
#[allow(unsafe_code)]
unsafe fn square(
    a: *const Line,
    k_blocks: usize,
    b: *const Line,
    per_tile: usize,
    c: *mut f32,
    c_stride: usize,
    stream: bool,
) {
    let c_stride = c_stride * size_of::<f32>();
    let line = size_of::<Line>();
    // SAFETY: the caller's; each load reads 16 lines at the given stride inside `a` or the
    // packed weight, each store writes 16 rows of 16 floats inside `c`'s square.
    unsafe {
        asm!(
            "tilezero tmm0",
            "tilezero tmm1",
            "tilezero tmm2",
            "tilezero tmm3",
            options(nostack, nomem)
        );
        let (a_low, a_high) = (a, a.add(TILE * k_blocks));
        let (b_left, b_right) = (b, b.add(per_tile));
        for kb in 0..k_blocks {
            if stream {
                // Past this pair's blocks, the next pair's (2 · per_tile lines along).
                let ahead = kb + AHEAD;
                let (left, right) = if ahead < k_blocks {
                    (
                        b_left.wrapping_add(ahead * TILE),
                        b_right.wrapping_add(ahead * TILE),
                    )
                } else {
                    let next = b.wrapping_add(2 * per_tile + (ahead - k_blocks) * TILE);
                    (next, next.wrapping_add(per_tile))
                };
                prefetch_block(left);
                prefetch_block(right);
            }
            asm!(
                "tileloadd tmm4, [{a0} + {s}*1]",
                "tileloadd tmm5, [{a1} + {s}*1]",
                "tileloadd tmm6, [{b0} + {s}*1]",
                "tileloadd tmm7, [{b1} + {s}*1]",
                "tdpbf16ps tmm0, tmm4, tmm6",
                "tdpbf16ps tmm1, tmm4, tmm7",
                "tdpbf16ps tmm2, tmm5, tmm6",
                "tdpbf16ps tmm3, tmm5, tmm7",
                a0 = in(reg) a_low.add(kb * TILE),
                a1 = in(reg) a_high.add(kb * TILE),
                b0 = in(reg) b_left.add(kb * TILE),
                b1 = in(reg) b_right.add(kb * TILE),
                s = in(reg) line,
                options(nostack, readonly)
            );
        }
        let c_low = c.cast::<u8>();
        let c_high = c_low.add(TILE * c_stride);
        asm!(
            "tilestored [{c0} + {s}*1], tmm0",
            "tilestored [{c1} + {s}*1], tmm1",
            "tilestored [{c2} + {s}*1], tmm2",
            "tilestored [{c3} + {s}*1], tmm3",
            c0 = in(reg) c_low,
            c1 = in(reg) c_low.add(TILE * size_of::<f32>()),
            c2 = in(reg) c_high,
            c3 = in(reg) c_high.add(TILE * size_of::<f32>()),
            s = in(reg) c_stride,
            options(nostack)
        );
    }
}
