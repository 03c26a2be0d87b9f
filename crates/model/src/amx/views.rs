//! The trainer's operands for the tiles ([`crate::fused::Bf16Products`]): read through strided
//! views, since a training product's operand is often a transpose (`dW = gᵀ x` reads both
//! `g` and `x` across their rows), packed or rounded per product with no transposed copy. A
//! transposed operand is read a tile's block at a time, each source row's part of the block
//! in one contiguous run, and turned in registers.

use std::mem::MaybeUninit;

use super::{Bf16Rows, Bf16Weight, K_BLOCK, Line, TILE, bf16_bits};
use crate::fused::Mat;

impl Bf16Weight {
    /// `rhs (k, n)` read through its view, packed as the weight of `n` outputs by `k` inputs:
    /// `lhs · rhs` is then `lhs · selfᵀ` ([`super::products`]).
    ///
    /// # Panics
    /// If the view does not fit `(k, n)`.
    pub(crate) fn pack_view(rhs: Mat<'_, f32>, k: usize, n: usize) -> Self {
        assert!(
            rhs.fits(k, n),
            "amx pack: view out of bounds for ({k}, {n})"
        );
        let mut w = Self::zeros(n, k);
        let Mat { data, rs, cs } = rhs;
        if rs == 1 {
            // Output j's inputs are consecutive (a row-major weight read transposed).
            w.repack_with(|[j, cols, first, len], block| {
                for (col, values) in block.iter_mut().enumerate().take(cols) {
                    values[..len].copy_from_slice(&data[(j + col) * cs + first..][..len]);
                }
            });
        } else if cs == 1 {
            // Input p's outputs are consecutive (a row-major activation `x` read as
            // `(N, in)`, or a weight `(out, in)` as the right operand of `g W`).
            #[cfg(target_arch = "x86_64")]
            if std::arch::is_x86_feature_detected!("avx512f") {
                w.repack_lines(true, |at, lines| {
                    // SAFETY: the CPU has AVX-512F.
                    #[allow(unsafe_code)]
                    unsafe {
                        super::wide::pack_input_rows(lines, (data, rs), at)
                    }
                });
                return w;
            }
            // A run of the block's outputs at a time.
            w.repack_with(|[j, cols, first, len], block| {
                for p in 0..len {
                    let run = &data[(first + p) * rs + j..][..cols];
                    for (values, &v) in block.iter_mut().zip(run) {
                        values[p] = v;
                    }
                }
            });
        } else {
            w.repack_with(|[j, cols, first, len], block| {
                for p in 0..len {
                    let row = (first + p) * rs + j * cs;
                    for (col, values) in block.iter_mut().enumerate().take(cols) {
                        values[p] = data[row + col * cs];
                    }
                }
            });
        }
        w
    }
}

impl Bf16Rows {
    /// Rounds `lhs (m, k)` read through its view.
    ///
    /// # Panics
    /// If the view does not fit `(m, k)`.
    pub(crate) fn round_view(lhs: Mat<'_, f32>, m: usize, k: usize) -> Self {
        assert!(
            lhs.fits(m, k),
            "amx rows: view out of bounds for ({m}, {k})"
        );
        let Mat { data, rs, cs } = lhs;
        if cs == 1 {
            #[cfg(target_arch = "x86_64")]
            if std::arch::is_x86_feature_detected!("avx512f") {
                return Self::from_tiles(m, k, 1, |first, dst| {
                    // SAFETY: the CPU has AVX-512F.
                    #[allow(unsafe_code)]
                    unsafe {
                        super::wide::round_rows(dst, (data, rs), first, (m, k))
                    }
                });
            }
            Self::fill(m, k, |r, col, out| {
                out.copy_from_slice(&data[r * rs + col..][..out.len()]);
            })
        } else if rs == 1 {
            Self::transposed(data, cs, m, k)
        } else {
            Self::fill(m, k, |r, col, out| {
                for (i, o) in out.iter_mut().enumerate() {
                    *o = data[r * rs + (col + i) * cs];
                }
            })
        }
    }

    /// The rows of `(m, k)` whose element `(r, c)` is `data[c · stride + r]` (the transpose
    /// of a row-major `(k, stride)` matrix): each tile's 16 rows × 32 inputs read as 32 runs
    /// of 16 consecutive values, then turned. With AVX-512, a job takes several tiles, block
    /// by block, so each source row is read in runs of several cache lines.
    fn transposed(data: &[f32], stride: usize, m: usize, k: usize) -> Self {
        #[cfg(target_arch = "x86_64")]
        if std::arch::is_x86_feature_detected!("avx512f") {
            let tiles = m.div_ceil(TILE);
            let per_job = (tiles / (2 * rayon::current_num_threads())).clamp(1, 8);
            return Self::from_tiles(m, k, per_job, |first, dst| {
                // SAFETY: the CPU has AVX-512F.
                #[allow(unsafe_code)]
                unsafe {
                    super::wide::turn_rows(dst, (data, stride), first, (m, k))
                }
            });
        }
        Self::from_tiles(m, k, 1, |first, dst| {
            turn(dst, (data, stride), first, (m, k))
        })
    }
}

/// Writes every line of `dst`, the tile of 16 rows from row `first` on ([`Bf16Rows`]'s
/// order), from the transposed source `(data, stride)` ([`Bf16Rows::transposed`]): zeros past
/// row `m` and input `k`.
#[inline(always)]
fn turn(
    dst: &mut [MaybeUninit<Line>],
    (data, stride): (&[f32], usize),
    first: usize,
    (m, k): (usize, usize),
) {
    let rows = m.saturating_sub(first).min(TILE);
    for (i, lines) in dst.chunks_exact_mut(TILE).enumerate() {
        let col = i * K_BLOCK;
        // A tile wholly past row `m` (the padding to 32 rows) reads nothing.
        let cols = if rows == 0 {
            0
        } else {
            k.saturating_sub(col).min(K_BLOCK)
        };
        let mut block = [[0f32; K_BLOCK]; TILE];
        for p in 0..cols {
            let run = &data[(col + p) * stride + first..][..rows];
            for (values, &v) in block.iter_mut().zip(run) {
                values[p] = v;
            }
        }
        for (line, values) in lines.iter_mut().zip(&block) {
            let mut bits = [0u16; K_BLOCK];
            for (b, &v) in bits.iter_mut().zip(values) {
                *b = bf16_bits(v);
            }
            line.write(Line(bits));
        }
    }
}
