//! The reads of the trainer's tile operands ([`super::views`]) in AVX-512 registers, where the
//! portable code went through a scalar buffer: a transposing read turned each block through a
//! `[[f32; 32]; 16]` (a store per value, then a pass to round it and another to turn its
//! pairs), and a plain one copied each line's values before rounding them.
//!
//! - [`round_rows`]: rows read as they are (`x` of `x Wᵀ`, `g` of `g W`): a line is a row's 32
//!   values in two registers, rounded and narrowed in place.
//! - [`pack_input_rows`]: a weight block whose inputs are the source's rows (`x` and `W` as the
//!   right operand of `dW = gᵀ x` and `dx = g W`). Two source rows, each 16 consecutive
//!   outputs, are one tile line already: rounded, the first row's bf16 in each lane's low half
//!   and the second's in its high half. No turn at all.
//! - [`turn_rows`]: a tile of rows read from a transposed source (`gᵀ` of `dW = gᵀ x`). Each
//!   source row gives 16 consecutive tile rows of one input; pairs of inputs are packed into
//!   32-bit words as above and the 16 × 16 words turned by four stages of unpacks and lane
//!   shuffles.
//!
//! The rounding is [`super::bf16_bits`]'s, bit for bit (ties to even, NaN kept NaN): the tests
//! compare every line with the portable code's.

use std::arch::x86_64::*;
use std::mem::MaybeUninit;

use super::{K_BLOCK, Line, TILE};

/// Each lane of `v` rounded to bf16 in its high half (the low half is not cleared).
#[inline]
#[target_feature(enable = "avx512f")]
fn round_high(v: __m512) -> __m512i {
    let bits = _mm512_castps_si512(v);
    let odd = _mm512_and_si512(_mm512_srli_epi32::<16>(bits), _mm512_set1_epi32(1));
    let rounded = _mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7fff)));
    let nan = _mm512_cmp_ps_mask::<_CMP_UNORD_Q>(v, v);
    let quiet = _mm512_or_si512(bits, _mm512_set1_epi32(0x0040_0000));
    _mm512_mask_blend_epi32(nan, rounded, quiet)
}

/// Word `i` holds `low[i]` rounded in its low half and `high[i]` in its high half: a tile
/// line's pair order.
#[inline]
#[target_feature(enable = "avx512f")]
fn pairs(low: __m512, high: __m512) -> __m512i {
    let low = _mm512_srli_epi32::<16>(round_high(low));
    let high = _mm512_and_si512(round_high(high), _mm512_set1_epi32(0xffff_0000_u32 as i32));
    _mm512_or_si512(low, high)
}

/// The `lanes` (≤ 16) values of `data` from `at` on, zeros after; all zeros, and nothing read,
/// for no lanes.
#[inline]
#[target_feature(enable = "avx512f")]
fn load(data: &[f32], at: usize, lanes: usize) -> __m512 {
    debug_assert!(lanes <= 16);
    if lanes == 0 {
        return _mm512_setzero_ps();
    }
    let values = &data[at..][..lanes];
    let mask = (1u32 << lanes).wrapping_sub(1) as __mmask16;
    // SAFETY: the masked lanes read `values[..lanes]`, in bounds by the slice above; the rest
    // are not read.
    #[allow(unsafe_code)]
    unsafe {
        _mm512_maskz_loadu_ps(mask, values.as_ptr())
    }
}

/// `words` as a tile line.
#[inline]
#[target_feature(enable = "avx512f")]
fn line(words: __m512i) -> Line {
    // SAFETY: both are 64 bytes of plain integers with no invalid values.
    #[allow(unsafe_code)]
    unsafe {
        std::mem::transmute::<__m512i, Line>(words)
    }
}

/// The 16 lines of one weight block whose input `first + p` is the source row `data[(first +
/// p) · rs + j ..]`, `cols` consecutive outputs of it (`len` inputs, `cols` outputs: zeros past
/// them). Line `q` holds inputs `2q` and `2q + 1` of each output.
#[target_feature(enable = "avx512f")]
pub(super) fn pack_input_rows(
    lines: &mut [Line],
    (data, rs): (&[f32], usize),
    [j, cols, first, len]: [usize; 4],
) {
    let row = |p: usize| load(data, (first + p) * rs + j, if p < len { cols } else { 0 });
    for (q, out) in lines.iter_mut().enumerate().take(K_BLOCK / 2) {
        *out = line(pairs(row(2 * q), row(2 * q + 1)));
    }
}

/// Every line of `dst`, the tiles of 16 rows from `first` on, from the row-major source
/// `(data, rs)` (row `r` from `data[r · rs ..]`): zeros past row `m` and input `k`. A line is
/// two registers of a row rounded, with no buffer between.
#[target_feature(enable = "avx512f")]
pub(super) fn round_rows(
    dst: &mut [MaybeUninit<Line>],
    (data, rs): (&[f32], usize),
    first: usize,
    (m, k): (usize, usize),
) {
    let row_lines = k.div_ceil(K_BLOCK);
    for (t, tile) in dst.chunks_exact_mut(TILE * row_lines).enumerate() {
        // Row by row (the source in order), each row's line in every block of the tile.
        for r in 0..TILE {
            let row = first + t * TILE + r;
            for i in 0..row_lines {
                let words = if row < m {
                    let col = i * K_BLOCK;
                    let width = (k - col).min(K_BLOCK);
                    let at = row * rs + col;
                    let low = load(data, at, width.min(16));
                    let high = load(data, at + 16, width.saturating_sub(16));
                    in_order(low, high)
                } else {
                    _mm512_setzero_si512()
                };
                tile[i * TILE + r].write(line(words));
            }
        }
    }
}

/// The 16 values of `low`, then those of `high`, rounded to bf16.
#[inline]
#[target_feature(enable = "avx512f")]
fn in_order(low: __m512, high: __m512) -> __m512i {
    let low = _mm512_cvtepi32_epi16(_mm512_srli_epi32::<16>(round_high(low)));
    let high = _mm512_cvtepi32_epi16(_mm512_srli_epi32::<16>(round_high(high)));
    _mm512_inserti64x4::<1>(_mm512_castsi256_si512(low), high)
}

/// Every line of `dst`, the tiles of 16 rows from `first` on, whose element `(r, c)` is
/// `data[c · stride + r]`: zeros past row `m` and input `k` ([`super::views`]' `turn`). Block
/// by block across the tiles: each source row is read in runs of one cache line a tile.
#[target_feature(enable = "avx512f")]
pub(super) fn turn_rows(
    dst: &mut [MaybeUninit<Line>],
    (data, stride): (&[f32], usize),
    first: usize,
    (m, k): (usize, usize),
) {
    let row_lines = k.div_ceil(K_BLOCK);
    for i in 0..row_lines {
        for (t, tile) in dst.chunks_exact_mut(TILE * row_lines).enumerate() {
            let lines = &mut tile[i * TILE..][..TILE];
            turn_block(lines, (data, stride), first + t * TILE, i * K_BLOCK, (m, k));
        }
    }
}

/// The 16 lines of one block: rows `first ..`, inputs `col ..` (zeros past `m` and `k`).
#[inline]
#[target_feature(enable = "avx512f")]
fn turn_block(
    lines: &mut [MaybeUninit<Line>],
    (data, stride): (&[f32], usize),
    first: usize,
    col: usize,
    (m, k): (usize, usize),
) {
    let rows = m.saturating_sub(first).min(TILE);
    // A tile wholly past row `m` (the padding to 32 rows) reads nothing.
    let cols = if rows == 0 {
        0
    } else {
        k.saturating_sub(col).min(K_BLOCK)
    };
    let input = |c: usize| {
        load(
            data,
            (col + c) * stride + first,
            if c < cols { rows } else { 0 },
        )
    };
    // Word q of lane r: inputs 2q and 2q + 1 of row r.
    let mut words = [_mm512_setzero_si512(); TILE];
    for (q, w) in words.iter_mut().enumerate() {
        if 2 * q < cols {
            *w = pairs(input(2 * q), input(2 * q + 1));
        }
    }
    for (out, words) in lines.iter_mut().zip(turn(words)) {
        out.write(line(words));
    }
}

/// The 16 × 16 matrix of 32-bit words `w` (rows are registers) turned: row `r` of the result
/// holds word `r` of each row of `w`.
#[inline]
#[target_feature(enable = "avx512f")]
fn turn(w: [__m512i; 16]) -> [__m512i; 16] {
    // Within each 128-bit lane: words of row pairs, then quads.
    let mut a = [_mm512_setzero_si512(); 16];
    for i in (0..16).step_by(2) {
        a[i] = _mm512_unpacklo_epi32(w[i], w[i + 1]);
        a[i + 1] = _mm512_unpackhi_epi32(w[i], w[i + 1]);
    }
    // b[4g + s], lane L: word 4L + s of rows 4g .. 4g + 4.
    let mut b = [_mm512_setzero_si512(); 16];
    for g in (0..16).step_by(4) {
        b[g] = _mm512_unpacklo_epi64(a[g], a[g + 2]);
        b[g + 1] = _mm512_unpackhi_epi64(a[g], a[g + 2]);
        b[g + 2] = _mm512_unpacklo_epi64(a[g + 1], a[g + 3]);
        b[g + 3] = _mm512_unpackhi_epi64(a[g + 1], a[g + 3]);
    }
    // Row 4L + s of the result: lane L of b[s], b[4 + s], b[8 + s], b[12 + s].
    let mut out = [_mm512_setzero_si512(); 16];
    for s in 0..4 {
        let c0 = _mm512_shuffle_i32x4::<0x44>(b[s], b[4 + s]);
        let c1 = _mm512_shuffle_i32x4::<0xee>(b[s], b[4 + s]);
        let c2 = _mm512_shuffle_i32x4::<0x44>(b[8 + s], b[12 + s]);
        let c3 = _mm512_shuffle_i32x4::<0xee>(b[8 + s], b[12 + s]);
        out[s] = _mm512_shuffle_i32x4::<0x88>(c0, c2);
        out[4 + s] = _mm512_shuffle_i32x4::<0xdd>(c0, c2);
        out[8 + s] = _mm512_shuffle_i32x4::<0x88>(c1, c3);
        out[12 + s] = _mm512_shuffle_i32x4::<0xdd>(c1, c3);
    }
    out
}
