//! Products with few rows, `x (m, k) · w (n, k)ᵀ` for 2 ≤ m ≤ 128 (≤ 8 when `k` < 256): a
//! decode step's projections, one row per running sequence.
//!
//! gemm repacks the weight on every call (its microkernel wants the output dimension
//! contiguous, and a weight `(n, k)` has the input dimension contiguous). With a few dozen rows
//! the repacking and the crate's small-`m` blocking cost about as much as the arithmetic. Here
//! the weight is read where it lies: each tile keeps dot products of 3 weight rows against 4
//! input rows in 12 AVX2 accumulators (8 lanes of partial sums each), streaming both along `k`,
//! and sums the lanes once at the end. A step's weight rows are split between the pool's
//! threads in jobs of [`ROWS_PER_JOB`]; a job's rows stay in L2 while every input row passes
//! them, and while it computes, it prefetches the next job's rows into L2 (a real model's
//! weights stream from memory, and the first pass over a job's rows would wait on them).
//! `sluice bench engine`, small preset: decode at 64 in flight 602–714 → 882–955 tok/s, at 8 in
//! flight 191–252 → 367–391 (docs/engine.md).
//!
//! Only on CPUs with AVX2 and FMA; elsewhere, and for other shapes, the caller keeps gemm. Where
//! the CPU has AVX-512F the same tiles run on 16-lane registers.
//! Sums run in another order than gemm's, so results agree to rounding, not bit for bit.

use rayon::prelude::*;

#[cfg(target_arch = "x86_64")]
use super::lanes::{Avx2, Avx512, Lanes};

/// Fewest rows the kernel takes: a single row is gemm's matrix-vector path, as fast, and bound
/// by streaming the weight from memory.
const MIN_ROWS: usize = 2;
/// Most rows the kernel takes: past this the inputs leave L2 and gemm's blocking wins.
const MAX_ROWS: usize = 128;
/// Shallower products (`k` below this) pay the lanes' sums at every output often enough that
/// gemm, whose packing is cheap for a weight that small, wins past [`SHALLOW_MAX_ROWS`] rows:
/// the tiny preset (64 features) at 64 in flight ran 71.9k–77.2k tok/s on this kernel and
/// 81.1k–82.3k on gemm (`sluice bench engine`, three alternated runs).
const DEEP: usize = 256;
/// Most rows the kernel takes for a product shallower than [`DEEP`].
const SHALLOW_MAX_ROWS: usize = 8;
/// Weight rows per parallel job (a multiple of the tile's 3): rows of 768 inputs fill 72 KiB.
/// Consecutive jobs mostly run on the same thread (rayon splits the range in halves), so each
/// prefetches the next one's rows.
const ROWS_PER_JOB: usize = 24;

/// Whether [`linear_new`] takes an `(m, k)` input.
fn takes(m: usize, k: usize) -> bool {
    let most = if k >= DEEP {
        MAX_ROWS
    } else {
        SHALLOW_MAX_ROWS
    };
    (MIN_ROWS..=most).contains(&m) && k > 0 && super::avx2_fma()
}

/// `x (m, k) · w (n, k)ᵀ` as a new row-major `(m, n)` buffer, or `None` when the kernel does
/// not take this shape or CPU.
pub(super) fn linear_new(m: usize, k: usize, n: usize, x: &[f32], w: &[f32]) -> Option<Vec<f32>> {
    linear_with(m, k, n, x, w, super::avx512())
}

/// [`linear_new`] with the AVX-512 tiles (`wide`, where the CPU has them) or the AVX2 ones.
fn linear_with(m: usize, k: usize, n: usize, x: &[f32], w: &[f32], wide: bool) -> Option<Vec<f32>> {
    if !takes(m, k) || (wide && !super::avx512()) {
        return None;
    }
    check(m, k, n, x, w, m * n);
    let mut out = Vec::with_capacity(m * n);
    // SAFETY: `takes` saw AVX2 and FMA (and `wide` AVX-512F); `check` keeps every operand read in bounds; the fresh
    // vector's capacity holds the `m·n` outputs, which `run` writes every one of (without
    // reading them) before `set_len`.
    #[allow(unsafe_code)]
    unsafe {
        run(m, k, n, x, w, out.as_mut_ptr(), wide);
        out.set_len(m * n);
    }
    Some(out)
}

fn check(m: usize, k: usize, n: usize, x: &[f32], w: &[f32], dst_len: usize) {
    assert!(
        x.len() >= m * k && w.len() >= n * k && dst_len >= m * n,
        "skinny linear: operands smaller than ({m}, {k}) · ({n}, {k})ᵀ"
    );
}

/// The output's base pointer, shared by jobs that each write their own columns (this kernel's
/// and the AMX tiles', [`crate::amx`]).
#[derive(Clone, Copy)]
pub(crate) struct Columns(pub(crate) *mut f32);
// SAFETY: every user's jobs write only their own output columns (disjoint ranges), and the
// pointer outlives the parallel loop that uses it.
#[allow(unsafe_code)]
unsafe impl Send for Columns {}
#[allow(unsafe_code)]
unsafe impl Sync for Columns {}

impl Columns {
    /// The pointer to column `j` of row 0 (a method, so closures capture the whole wrapper).
    ///
    /// # Safety
    /// `j` is within the output's allocation.
    #[allow(unsafe_code)]
    pub(crate) unsafe fn at(self, j: usize) -> *mut f32 {
        // SAFETY: the caller's.
        unsafe { self.0.add(j) }
    }
}

/// # Safety
/// The CPU has AVX2 and FMA, and AVX-512F if `wide`; `x` holds `(m, k)`, `w` holds `(n, k)`,
/// `dst` is valid for writes of `m·n` elements and overlaps neither.
#[allow(unsafe_code)]
unsafe fn run(m: usize, k: usize, n: usize, x: &[f32], w: &[f32], dst: *mut f32, wide: bool) {
    let dst = Columns(dst);
    let job = |j: usize| {
        let first = j * ROWS_PER_JOB;
        let end = (first + ROWS_PER_JOB).min(n);
        let next_end = (end + ROWS_PER_JOB).min(n);
        // SAFETY: the caller's contract; this job's weight rows `first..end` are in `w`, and it
        // writes output columns `first..end` of every row, which no other job writes.
        unsafe {
            let rows = Rows {
                w: &w[first * k..end * k],
                next: &w[end * k..next_end * k],
                x,
                m,
                k,
                dst: dst.at(first),
                n,
            };
            if wide {
                block_avx512(rows)
            } else {
                block_avx2(rows)
            }
        }
    };
    let jobs = n.div_ceil(ROWS_PER_JOB);
    if jobs > 1 && rayon::current_num_threads() > 1 && m * n * k >= super::MIN_PARALLEL_MACS {
        (0..jobs).into_par_iter().for_each(job);
    } else {
        (0..jobs).for_each(job);
    }
}

/// One job: all input rows `x` (`m` of them) against the weight rows `w` (`w.len() / k` of
/// them), writing output columns `0..rows` of `dst` (row stride `n`), and prefetching `next`
/// into L2 a few lines per tile.
#[derive(Clone, Copy)]
struct Rows<'a> {
    w: &'a [f32],
    next: &'a [f32],
    x: &'a [f32],
    m: usize,
    k: usize,
    dst: *mut f32,
    n: usize,
}

/// [`block`] with AVX2 and FMA (8 lanes).
///
/// # Safety
/// The CPU has AVX2 and FMA; `rows` is in bounds as [`Rows`] says.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
#[allow(unsafe_code)]
unsafe fn block_avx2(rows: Rows<'_>) {
    // SAFETY: the caller's.
    unsafe { block::<Avx2>(rows) }
}

/// [`block`] with AVX-512 (16 lanes: half the instructions of the AVX2 tile for the same
/// products, on CPUs with two 512-bit FMA units twice the arithmetic per cycle).
///
/// # Safety
/// The CPU has AVX-512F (and so AVX2 and FMA); `rows` is in bounds as [`Rows`] says.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx2,fma")]
#[allow(unsafe_code)]
unsafe fn block_avx512(rows: Rows<'_>) {
    // SAFETY: the caller's.
    unsafe { block::<Avx512>(rows) }
}

#[cfg(not(target_arch = "x86_64"))]
#[allow(unsafe_code)]
unsafe fn block_avx2(_: Rows<'_>) {
    unreachable!("the skinny kernel runs only where avx2_fma() holds")
}

#[cfg(not(target_arch = "x86_64"))]
#[allow(unsafe_code)]
unsafe fn block_avx512(_: Rows<'_>) {
    unreachable!("the skinny kernel runs only where avx512() holds")
}

/// Tiles of up to 3 weight rows by 4 input rows over the job, inlined into the
/// `#[target_feature]` wrapper that names the instructions `V` uses.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
#[allow(unsafe_code)]
unsafe fn block<V: Lanes>(rows: Rows<'_>) {
    use std::arch::x86_64::{_MM_HINT_T1, _mm_prefetch};
    /// f32s per cache line.
    const LINE: usize = 16;
    let Rows {
        w,
        next,
        x,
        m,
        k,
        dst,
        n,
    } = rows;
    let rows = w.len() / k;
    let lines = next.len().div_ceil(LINE);
    let lines_per_tile = lines.div_ceil(m.div_ceil(4) * rows.div_ceil(3));
    let mut line = 0;
    let mut t0 = 0;
    while t0 < m {
        let tt = (m - t0).min(4);
        let mut r0 = 0;
        while r0 < rows {
            let rr = (rows - r0).min(3);
            for l in line..(line + lines_per_tile).min(lines) {
                // SAFETY: line `l` starts inside `next`; a prefetch does not fault anyway.
                unsafe { _mm_prefetch::<_MM_HINT_T1>(next.as_ptr().add(l * LINE).cast()) };
            }
            line = (line + lines_per_tile).min(lines);
            // SAFETY: rows `r0..r0 + rr` of `w`, `t0..t0 + tt` of `x` and the outputs
            // `(t0.., r0..)` are in bounds (the caller's contract).
            unsafe {
                let tile = Tile {
                    w: w.as_ptr().add(r0 * k),
                    x: x.as_ptr().add(t0 * k),
                    k,
                    dst: dst.add(t0 * n + r0),
                    n,
                };
                match (rr, tt) {
                    (3, 4) => tile.run::<V, 3, 4>(),
                    (3, 3) => tile.run::<V, 3, 3>(),
                    (3, 2) => tile.run::<V, 3, 2>(),
                    (3, _) => tile.run::<V, 3, 1>(),
                    (2, 4) => tile.run::<V, 2, 4>(),
                    (2, 3) => tile.run::<V, 2, 3>(),
                    (2, 2) => tile.run::<V, 2, 2>(),
                    (2, _) => tile.run::<V, 2, 1>(),
                    (_, 4) => tile.run::<V, 1, 4>(),
                    (_, 3) => tile.run::<V, 1, 3>(),
                    (_, 2) => tile.run::<V, 1, 2>(),
                    _ => tile.run::<V, 1, 1>(),
                }
            }
            r0 += rr;
        }
        t0 += tt;
    }
}

/// `R` weight rows against `T` input rows, all `k` deep, into the `(T, R)` outputs at `dst`.
#[cfg(target_arch = "x86_64")]
struct Tile {
    w: *const f32,
    x: *const f32,
    k: usize,
    dst: *mut f32,
    n: usize,
}

#[cfg(target_arch = "x86_64")]
impl Tile {
    /// Inlined into [`block`], whose instructions it compiles with.
    ///
    /// # Safety
    /// `V`'s instructions; `w` holds `R` rows of `k`, `x` holds `T` rows of `k`, and outputs
    /// `dst + t·n + r` are valid for every `t < T`, `r < R`.
    #[inline(always)]
    #[allow(unsafe_code)]
    unsafe fn run<V: Lanes, const R: usize, const T: usize>(&self) {
        let Self { w, x, k, dst, n } = *self;
        // SAFETY: every pointer below stays inside the rows the contract names.
        unsafe {
            // acc[t][r]: input row t against weight row r.
            let mut acc = [[V::zero(); R]; T];
            let deep = k / V::WIDTH * V::WIDTH;
            let mut j = 0;
            while j < deep {
                let mut wv = [V::zero(); R];
                for (r, v) in wv.iter_mut().enumerate() {
                    *v = V::load(w.add(r * k + j));
                }
                for (t, acc_t) in acc.iter_mut().enumerate() {
                    let xv = V::load(x.add(t * k + j));
                    for (a, &w_r) in acc_t.iter_mut().zip(&wv) {
                        *a = a.fma(w_r, xv);
                    }
                }
                j += V::WIDTH;
            }
            for (t, acc_t) in acc.iter().enumerate() {
                for (r, &a) in acc_t.iter().enumerate() {
                    // The lanes' partial sums, then the `k % WIDTH` tail.
                    let mut s = a.sum();
                    for i in deep..k {
                        s += *w.add(r * k + i) * *x.add(t * k + i);
                    }
                    *dst.add(t * n + r) = s;
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn reference(m: usize, k: usize, n: usize, x: &[f32], w: &[f32]) -> Vec<f64> {
        let mut y = vec![0f64; m * n];
        for t in 0..m {
            for r in 0..n {
                y[t * n + r] = (0..k)
                    .map(|i| f64::from(x[t * k + i]) * f64::from(w[r * k + i]))
                    .sum();
            }
        }
        y
    }

    fn values(len: usize, seed: u32) -> Vec<f32> {
        (0..len)
            .map(|i| ((i as u32).wrapping_mul(2_654_435_761).wrapping_add(seed) >> 8) as f32)
            .map(|v| v / (1u32 << 24) as f32 - 0.5)
            .collect()
    }

    /// Every tile shape and tail: rows not a multiple of 4, weight rows not a multiple of 3 or
    /// of a job, depths not a multiple of 8; parallel and not.
    #[test]
    fn matches_the_exact_product_on_every_tile_shape() {
        if !super::super::avx2_fma() {
            return;
        }
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(2)
            .build()
            .unwrap();
        for &(m, k, n) in &[
            (2, 8, 1),
            (3, 13, 5),
            (5, 64, 50),
            (7, 100, 97),
            (64, 768, 256),
            (128, 259, 3),
            (8, 300, 40),
            (6, 576, 49),
            (64, 1536, 100),
        ] {
            let (x, w) = (values(m * k, 1), values(n * k, 2));
            let exact = reference(m, k, n, &x, &w);
            let got = pool
                .install(|| linear_with(m, k, n, &x, &w, false))
                .unwrap();
            // The AVX-512 tiles (16 lanes: depths below 16 are all tail) where the CPU has them.
            let wide = pool.install(|| linear_with(m, k, n, &x, &w, true));
            assert_eq!(wide.is_some(), super::super::avx512());
            for (i, v) in wide.iter().flatten().enumerate() {
                let tol = 1e-5 * (k as f64).sqrt();
                assert!(
                    (f64::from(*v) - exact[i]).abs() <= tol,
                    "AVX-512 ({m}, {k}, {n}) element {i}: {v} vs {}",
                    exact[i]
                );
            }
            // The fused linear with a bias takes this kernel too, adding the bias after it.
            let bias = values(n, 3);
            let tensor = |v: &[f32], shape: (usize, usize)| {
                candle_core::Tensor::from_slice(v, shape, &candle_core::Device::Cpu).unwrap()
            };
            let b = candle_core::Tensor::from_slice(&bias, n, &candle_core::Device::Cpu).unwrap();
            let added: Vec<f32> = pool
                .install(|| {
                    super::super::linear(&tensor(&x, (m, k)), &tensor(&w, (n, k)), Some(&b))
                })
                .unwrap()
                .flatten_all()
                .unwrap()
                .to_vec1()
                .unwrap();
            for i in 0..m * n {
                let tol = 1e-5 * (k as f64).sqrt();
                assert!(
                    (f64::from(got[i]) - exact[i]).abs() <= tol,
                    "({m}, {k}, {n}) element {i}: {} vs {}",
                    got[i],
                    exact[i]
                );
                let want = exact[i] + f64::from(bias[i % n]);
                assert!(
                    (f64::from(added[i]) - want).abs() <= tol,
                    "({m}, {k}, {n}) element {i} with bias: {} vs {want}",
                    added[i]
                );
            }
        }
    }

    #[test]
    fn leaves_single_rows_and_tall_inputs_to_gemm() {
        let (x, w) = (values(129 * 256, 1), values(8 * 256, 2));
        assert!(linear_new(1, 8, 8, &x, &w).is_none());
        assert!(linear_new(129, 256, 8, &x, &w).is_none());
        assert!(linear_new(9, 255, 8, &x, &w).is_none());
        assert!(linear_new(4, 0, 8, &x, &w).is_none());
        if super::super::avx2_fma() {
            assert!(linear_new(128, 256, 8, &x, &w).is_some());
            assert!(linear_new(8, 255, 8, &x, &w).is_some());
        }
    }
}
