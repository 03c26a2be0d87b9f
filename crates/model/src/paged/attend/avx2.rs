//! The decode attention's AVX2 + FMA kernel (the portable loops of the parent module are the
//! reference): see the parent's docs on `avx2`.

use std::arch::x86_64::*;

use super::{PoolShape, Seq, head_stride, row_offsets};

/// Query heads per value pass.
const GROUP_PANEL: usize = 3;
/// 8-wide vectors of the head dim per value pass.
const DIM_PANEL: usize = 4;
/// Rows ahead that the loops prefetch: a sequence's rows lie in blocks scattered over the
/// pool, so the hardware prefetcher loses the stream at every block boundary.
const AHEAD: usize = 16;
/// f32s per cache line.
const LINE: usize = 16;

/// Starts loading the `n > 0` floats at `p` into L1: every cache line they touch (a row
/// need not start on a line).
///
/// # Safety
/// None beyond the CPU having SSE (a prefetch does not fault).
#[inline(always)]
pub(super) unsafe fn prefetch(p: *const f32, n: usize) {
    let lines = (p.wrapping_add(n - 1) as usize / 64) - (p as usize / 64);
    for l in 0..=lines {
        // SAFETY: a prefetch of any address is harmless; `wrapping_add` keeps the pointer
        // arithmetic defined.
        unsafe { _mm_prefetch::<_MM_HINT_T0>(p.wrapping_add(l * LINE).cast()) };
    }
}

/// # Safety
/// The CPU has AVX2 and FMA, and `shape.head_dim` is a multiple of 8.
#[target_feature(enable = "avx2,fma")]
pub(super) unsafe fn attend(seq: &Seq<'_>, shape: &PoolShape, scale: f32, out: &mut [f32]) {
    let PoolShape {
        kv_heads,
        groups,
        head_dim: d,
        ..
    } = *shape;
    debug_assert!(d.is_multiple_of(8));
    let len = seq.len;
    let (rows, stride) = (row_offsets(seq, shape), head_stride(shape));
    // Every read below is within a visible row of the pools, the query or the output.
    let last = rows
        .iter()
        .max()
        .map_or(0, |&r| r + (kv_heads - 1) * stride + d);
    assert!(
        last <= seq.keys.len() && last <= seq.values.len(),
        "paged attention: a block table points past the pool"
    );
    assert!(seq.q.len() >= kv_heads * groups * d && out.len() >= kv_heads * groups * d);
    let mut probs = vec![0f32; groups * len];
    for h in 0..kv_heads {
        // SAFETY: the asserts above: kv head `h`'s columns of each row, its query rows and
        // output rows are in bounds.
        unsafe {
            scores(
                seq.keys.as_ptr().add(h * stride),
                &rows,
                seq.q.as_ptr().add(h * groups * d),
                groups,
                d,
                scale,
                &mut probs,
            );
        }
        for p in probs.chunks_exact_mut(len) {
            // SAFETY: AVX2 (this function's contract).
            unsafe { softmax(p) };
        }
        let mut g0 = 0;
        while g0 < groups {
            let gn = (groups - g0).min(GROUP_PANEL);
            let panel = if d.is_multiple_of(8 * DIM_PANEL) {
                DIM_PANEL
            } else if d.is_multiple_of(16) {
                2
            } else {
                1
            };
            let mut c0 = 0;
            while c0 < d {
                // SAFETY: as above; columns `c0..c0 + 8·panel` of the head.
                unsafe {
                    let pass = ValuePass {
                        values: seq.values.as_ptr().add(h * stride + c0),
                        rows: &rows,
                        probs: probs.as_ptr().add(g0 * len),
                        d,
                        out: out.as_mut_ptr().add((h * groups + g0) * d + c0),
                    };
                    match (gn, panel) {
                        (3, 4) => pass.run::<3, 4>(),
                        (3, 2) => pass.run::<3, 2>(),
                        (3, _) => pass.run::<3, 1>(),
                        (2, 4) => pass.run::<2, 4>(),
                        (2, 2) => pass.run::<2, 2>(),
                        (2, _) => pass.run::<2, 1>(),
                        (_, 4) => pass.run::<1, 4>(),
                        (_, 2) => pass.run::<1, 2>(),
                        _ => pass.run::<1, 1>(),
                    }
                }
                c0 += 8 * panel;
            }
            g0 += gn;
        }
    }
}

/// Scaled scores of `groups` query rows (`q`, `d` apart) against the keys at `k + rows[t]`,
/// into `out[g · len + t]`.
///
/// # Safety
/// AVX2 and FMA; `d` a multiple of 8; `d` floats readable at `q + g·d` and at `k + row`.
#[inline(always)]
unsafe fn scores(
    k: *const f32,
    rows: &[usize],
    q: *const f32,
    groups: usize,
    d: usize,
    scale: f32,
    out: &mut [f32],
) {
    let len = rows.len();
    assert!(out.len() >= groups * len);
    // SAFETY: the caller's; stores stay in `out` (asserted).
    unsafe {
        let scale_v = _mm256_set1_ps(scale);
        let mut t = 0;
        while t + 8 <= len {
            let keys: [*const f32; 8] = std::array::from_fn(|j| k.add(rows[t + j]));
            for &row in rows.iter().skip(t + AHEAD).take(8) {
                prefetch(k.wrapping_add(row), d);
            }
            for g in 0..groups {
                let q_g = q.add(g * d);
                let mut acc = [_mm256_setzero_ps(); 8];
                for i in (0..d).step_by(8) {
                    let qv = _mm256_loadu_ps(q_g.add(i));
                    for (a, key) in acc.iter_mut().zip(&keys) {
                        *a = _mm256_fmadd_ps(qv, _mm256_loadu_ps(key.add(i)), *a);
                    }
                }
                let s = _mm256_mul_ps(sum_each(acc), scale_v);
                _mm256_storeu_ps(out.as_mut_ptr().add(g * len + t), s);
            }
            t += 8;
        }
        for (t, &row) in rows.iter().enumerate().skip(t) {
            let key = k.add(row);
            for g in 0..groups {
                let q_g = q.add(g * d);
                let mut acc = _mm256_setzero_ps();
                for i in (0..d).step_by(8) {
                    acc = _mm256_fmadd_ps(
                        _mm256_loadu_ps(q_g.add(i)),
                        _mm256_loadu_ps(key.add(i)),
                        acc,
                    );
                }
                out[g * len + t] = sum(acc) * scale;
            }
        }
    }
}

/// [`super::softmax`] with the maximum and the sum in 8-wide vectors (the portable loops
/// are one scalar chain each: a float reduction is not reordered for the compiler).
///
/// # Safety
/// AVX2 (inlined into [`attend`]).
#[inline(always)]
unsafe fn softmax(scores: &mut [f32]) {
    let (whole, tail) = scores.split_at_mut(scores.len() / 8 * 8);
    // SAFETY: AVX2 (the caller's); loads and stores stay in `whole`.
    unsafe {
        let mut m = _mm256_set1_ps(f32::NEG_INFINITY);
        for c in whole.chunks_exact(8) {
            m = _mm256_max_ps(m, _mm256_loadu_ps(c.as_ptr()));
        }
        let m = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
        let m = _mm_max_ps(m, _mm_movehl_ps(m, m));
        let m = _mm_max_ss(m, _mm_shuffle_ps(m, m, 1));
        let max = tail.iter().copied().fold(_mm_cvtss_f32(m), f32::max);
        for x in scores.iter_mut() {
            *x -= max;
        }
        crate::fused::exp_f32_in_place(scores);
        let (whole, tail) = scores.split_at_mut(scores.len() / 8 * 8);
        let mut acc = _mm256_setzero_ps();
        for c in whole.chunks_exact(8) {
            acc = _mm256_add_ps(acc, _mm256_loadu_ps(c.as_ptr()));
        }
        let inv = 1.0 / (sum(acc) + tail.iter().sum::<f32>());
        for x in scores.iter_mut() {
            *x *= inv;
        }
    }
}

/// The lane sums of eight vectors, as one vector (`out[j]` = the sum of `a[j]`'s lanes).
///
/// # Safety
/// AVX2 (inlined into [`attend`]).
#[inline(always)]
unsafe fn sum_each(a: [__m256; 8]) -> __m256 {
    // SAFETY: register-only AVX operations; the caller's CPU has AVX2.
    unsafe {
        // Each 128-bit half: [a0, a1, a2, a3] partial sums of its own half of the lanes.
        let s0123 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
        let s4567 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
        let lo = _mm256_permute2f128_ps(s0123, s4567, 0x20);
        let hi = _mm256_permute2f128_ps(s0123, s4567, 0x31);
        _mm256_add_ps(lo, hi)
    }
}

/// The sum of one vector's lanes.
///
/// # Safety
/// AVX2 (inlined into [`attend`]).
#[inline(always)]
unsafe fn sum(a: __m256) -> f32 {
    // SAFETY: register-only AVX operations; the caller's CPU has AVX2.
    unsafe {
        let half = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
        let pair = _mm_add_ps(half, _mm_movehl_ps(half, half));
        _mm_cvtss_f32(_mm_add_ss(pair, _mm_shuffle_ps(pair, pair, 1)))
    }
}

/// `G` query heads' probabilities (`probs + g·len`, one per row) times `C` vectors of each
/// value row (`values + rows[t]`), into `out + g·d`.
#[derive(Clone, Copy)]
struct ValuePass<'a> {
    values: *const f32,
    rows: &'a [usize],
    probs: *const f32,
    d: usize,
    out: *mut f32,
}

impl ValuePass<'_> {
    /// Inlined into [`attend`], whose AVX2 and FMA it compiles with.
    ///
    /// # Safety
    /// AVX2 and FMA; `8·C` floats readable at `values + row` for every row, `len` at
    /// `probs + g·len` and writable at `out + g·d` for every `g < G`.
    #[inline(always)]
    unsafe fn run<const G: usize, const C: usize>(&self) {
        let Self {
            values,
            rows,
            probs,
            d,
            out,
        } = *self;
        let len = rows.len();
        // SAFETY: the contract.
        unsafe {
            let mut acc = [[_mm256_setzero_ps(); C]; G];
            for (t, &row) in rows.iter().enumerate() {
                if let Some(&ahead) = rows.get(t + AHEAD) {
                    prefetch(values.wrapping_add(ahead), 8 * C);
                }
                let v = values.add(row);
                let vv: [__m256; C] = std::array::from_fn(|i| _mm256_loadu_ps(v.add(8 * i)));
                for (g, acc_g) in acc.iter_mut().enumerate() {
                    let p = _mm256_set1_ps(*probs.add(g * len + t));
                    for (a, &v) in acc_g.iter_mut().zip(&vv) {
                        *a = _mm256_fmadd_ps(p, v, *a);
                    }
                }
            }
            for (g, acc_g) in acc.iter().enumerate() {
                for (i, &a) in acc_g.iter().enumerate() {
                    _mm256_storeu_ps(out.add(g * d + 8 * i), a);
                }
            }
        }
    }
}
