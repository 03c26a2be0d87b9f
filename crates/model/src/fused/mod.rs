//! Fused training ops with hand-written backward ([`crate::ops::Kernels::Custom`]): linear
//! layers, RMSNorm, RoPE, SwiGLU, causal attention over packed segments and the token
//! log-prob/entropy head, each one candle
//! custom op instead of the five to twenty elementary ops (and their backward nodes) the
//! composition builds.
//!
//! Why they pay: candle's backward allocates a zeroed gradient and adds into it for every node
//! of the graph, and the composition's transposes, broadcasts and `cat` each cost a full copy
//! forward and backward. One node per op, contiguous `(N, features)` layouts everywhere (no
//! head transposes) and the attention mask taken from segment ids instead of an `(L, L)` tensor
//! cut most of that.
//!
//! The kernels handle f32 and f64 on the CPU ([`supported`]). On a GPU ([`on_device`]: f32 and
//! bf16) RMSNorm, SwiGLU, RoPE and attention run Sluice's CUDA kernels (`kernels/fused.cu`,
//! `kernels/attention.cu`, launched by `device.rs`) and linear layers candle's products. Every backward is checked against central finite differences in
//! f64 and against the composition (`crates/model/tests/fused_ops.rs`).

mod attention;
#[cfg(feature = "cuda")]
pub(crate) mod device;
mod elementwise;
mod head;
#[cfg(target_arch = "x86_64")]
mod lanes;
mod linear;
mod products;
mod rope;
mod skinny;
mod stacked;

pub(crate) use skinny::Columns;

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, DType, Device, Layout, Result, Shape, Storage, Tensor, WithDType};

pub use attention::{AttentionHeads, Segments, attention};
pub(crate) use attention::{KeptAttention, attention_kept};
pub(crate) use elementwise::{rms_inv, rms_norm_grads, swiglu_grads};
pub use elementwise::{rms_norm, swiglu};
pub(crate) use head::token_scores;
pub use linear::linear;
pub(crate) use linear::{linear_grads, linear_input_grad};
pub(crate) use products::{Bf16Products, Rhs, product, product_new};
pub use rope::rope;
pub(crate) use rope::rope_grad;
pub use stacked::{add_rms_norm, split_rope, swiglu_rows};

/// Whether the fused kernels handle tensors like `t` (f32 or f64 on the CPU).
pub fn supported(t: &Tensor) -> bool {
    matches!(t.device(), Device::Cpu) && matches!(t.dtype(), DType::F32 | DType::F64)
}

/// Whether RMSNorm, SwiGLU, RoPE and attention run Sluice's CUDA kernels on tensors like `t`
/// (f32 or bf16 on a GPU, in a `cuda` build); the linear layers and the token scores keep
/// candle's ops (cuBLAS) there.
pub fn on_device(t: &Tensor) -> bool {
    #[cfg(feature = "cuda")]
    {
        device::supported(t)
    }
    #[cfg(not(feature = "cuda"))]
    {
        let _ = t;
        false
    }
}

/// Whether the attention kernels on a GPU take heads of `head_dim` (16, 32, 64 or 128).
pub fn on_device_head_dim(head_dim: usize) -> bool {
    #[cfg(feature = "cuda")]
    {
        device::attention_head_dim(head_dim)
    }
    #[cfg(not(feature = "cuda"))]
    {
        let _ = head_dim;
        false
    }
}

/// The float types the kernels are written for (f32, f64).
pub(crate) trait Real: WithDType + std::ops::Neg<Output = Self> {
    /// `e^x` for every element, in a loop the compiler vectorises (f32: a Cephes-style
    /// polynomial, relative error ≈ 1e-7, where libm's `expf` is a call per element; f64: libm).
    fn exp_slice(xs: &mut [Self]);
    fn ln(self) -> Self;
    fn sqrt(self) -> Self;
    /// `dst (m, n) [+]= lhs (m, k) · rhs (k, n)` (see [`gemm_checked`]).
    fn matmul(
        m: usize,
        n: usize,
        k: usize,
        dst: Dst<'_, Self>,
        lhs: Mat<'_, Self>,
        rhs: Mat<'_, Self>,
    );
    /// `lhs (m, k) · rhs (k, n)` as a new row-major `(m, n)` buffer that the product writes
    /// whole: no zero fill before it (a `vec![0; m·n]` ahead of an overwriting gemm was 8 % of
    /// the quickstart trainer's time, in `memset`).
    fn matmul_new(
        m: usize,
        n: usize,
        k: usize,
        lhs: Mat<'_, Self>,
        rhs: Mat<'_, Self>,
    ) -> Vec<Self>;
    /// `x (m, k) · w (n, k)ᵀ` as a new row-major `(m, n)` buffer by the few-rows kernel
    /// ([`skinny`]), or `None` where it does not take the shape, dtype or CPU.
    fn linear_few_rows(m: usize, k: usize, n: usize, x: &[Self], w: &[Self]) -> Option<Vec<Self>>;
    /// `rhs (k, n)` as this thread's linear and head products take it ([`product`]): packed
    /// for the AMX tiles inside a [`Bf16Products`] scope (f32), else the view itself.
    fn rhs(rhs: Mat<'_, Self>, k: usize, n: usize) -> Rhs<'_, Self>;
    /// `lhs (m, k) · w` on the tiles, `w` packed by [`Real::rhs`]: a new row-major buffer.
    fn tiles(m: usize, lhs: Mat<'_, Self>, w: &crate::amx::Bf16Weight) -> Vec<Self>;
}

macro_rules! real {
    ($t:ty, $exp_slice:expr, $few_rows:expr, $rhs:expr, $tiles:expr) => {
        impl Real for $t {
            #[inline(always)]
            fn exp_slice(xs: &mut [Self]) {
                $exp_slice(xs)
            }
            fn ln(self) -> Self {
                <$t>::ln(self)
            }
            fn sqrt(self) -> Self {
                <$t>::sqrt(self)
            }
            fn matmul(
                m: usize,
                n: usize,
                k: usize,
                dst: Dst<'_, Self>,
                lhs: Mat<'_, Self>,
                rhs: Mat<'_, Self>,
            ) {
                gemm_checked(m, n, k, dst, lhs, rhs)
            }
            fn matmul_new(
                m: usize,
                n: usize,
                k: usize,
                lhs: Mat<'_, Self>,
                rhs: Mat<'_, Self>,
            ) -> Vec<Self> {
                gemm_new(m, n, k, lhs, rhs)
            }
            fn linear_few_rows(
                m: usize,
                k: usize,
                n: usize,
                x: &[Self],
                w: &[Self],
            ) -> Option<Vec<Self>> {
                $few_rows(m, k, n, x, w)
            }
            fn rhs(rhs: Mat<'_, Self>, k: usize, n: usize) -> Rhs<'_, Self> {
                $rhs(rhs, k, n)
            }
            fn tiles(m: usize, lhs: Mat<'_, Self>, w: &crate::amx::Bf16Weight) -> Vec<Self> {
                $tiles(m, lhs, w)
            }
        }
    };
}
real!(
    f32,
    exp_f32_slice,
    skinny::linear_new,
    products::rhs_f32,
    products::tiles_f32
);
real!(
    f64,
    |xs: &mut [f64]| xs.iter_mut().for_each(|x| *x = x.exp()),
    |_, _, _, _, _| None,
    |rhs, _, _| Rhs::View(rhs),
    |_, _, _| unreachable!("f64 operands are never packed for the tiles")
);

/// Whether this CPU has AVX-512F as well as AVX2 and FMA (the skinny products' 16-lane tiles).
/// Checked once.
pub(crate) fn avx512() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        static OK: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
        *OK.get_or_init(|| avx2_fma() && std::arch::is_x86_feature_detected!("avx512f"))
    }
    #[cfg(not(target_arch = "x86_64"))]
    false
}

/// Whether this CPU has AVX2 and FMA, for kernels that compile a second copy of their loops for
/// them (the crate itself targets baseline x86-64, SSE2). Checked once.
pub(crate) fn avx2_fma() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        static OK: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
        *OK.get_or_init(|| {
            std::arch::is_x86_feature_detected!("avx2")
                && std::arch::is_x86_feature_detected!("fma")
        })
    }
    #[cfg(not(target_arch = "x86_64"))]
    false
}

/// `e^x` in place: `x = n ln2 + r` with `|r| ≤ ln2/2`, `e^r` by Cephes' `expf` polynomial,
/// `2^n` built in the exponent bits of two factors (`n` reaches 128 just below f32's largest
/// value, one past the largest exponent). Branch-free (selects only) and free of float-to-int
/// casts (Rust's saturate, and LLVM turns each into a scalar conversion and compares), so it
/// vectorises. Below −87.3 (where f32 underflows) the result is 0, as `expf`'s is there up to
/// denormals; past `ln f32::MAX` it is infinite.
///
/// Compiled for AVX2 + FMA (8 lanes) where the CPU has them, else for the baseline (4 lanes),
/// for callers outside an AVX2 context (the engine's sampler, the training head's and
/// attention's softmaxes): the same operations in either, so the same values.
pub fn exp_f32_slice(xs: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if avx2_fma() {
        // SAFETY: `avx2_fma()`: the CPU has AVX2 and FMA.
        #[allow(unsafe_code)]
        return unsafe { exp_f32_wide(xs) };
    }
    exp_f32_in_place(xs);
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
fn exp_f32_wide(xs: &mut [f32]) {
    exp_f32_in_place(xs);
}

/// The body of [`exp_f32_slice`], inlined into kernels already compiled for AVX2.
#[inline(always)]
pub(crate) fn exp_f32_in_place(xs: &mut [f32]) {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    const LN2_HI: f32 = 0.693_359_4;
    const LN2_LO: f32 = -2.121_944_4e-4;
    // 1.5 · 2²³: adding it rounds to the nearest integer, which then sits in the low mantissa
    // bits (as `2²² + n`); subtracting it back gives `n` as a float.
    const ROUND: f32 = 12_582_912.0;
    for x in xs.iter_mut() {
        let v = x.clamp(-87.3, 88.8);
        let shifted = v * LOG2E + ROUND;
        let n = shifted - ROUND;
        let r = v - n * LN2_HI - n * LN2_LO;
        let p = ((((1.987_569_1e-4 * r + 1.398_199_9e-3) * r + 8.333_452e-3) * r + 4.166_579_6e-2)
            * r
            + 1.666_666_5e-1)
            * r
            + 0.5;
        let e = p * r * r + r + 1.0;
        // `n` (−126 ≤ n ≤ 128 after the clamp) is the mantissa bits of `shifted` minus those
        // of `ROUND`; `2^n = 2^h · 2^(n − h)` with `h = n / 2`, each a normal f32.
        let n = shifted.to_bits().wrapping_sub(ROUND.to_bits()) as i32;
        let h = n >> 1;
        let pow2 = |k: i32| f32::from_bits(((k + 127) as u32) << 23);
        *x = if *x < -87.3 {
            0.0
        } else {
            e * pow2(h) * pow2(n - h)
        };
    }
}

/// The destination of a product: element `(i, j)` at `data[i * rs + j]`, overwritten or (with
/// `accumulate`) added to.
pub(crate) struct Dst<'a, T> {
    pub data: &'a mut [T],
    pub rs: usize,
    pub accumulate: bool,
}

impl<'a, T> Dst<'a, T> {
    /// A row-major matrix of `cols` columns, overwritten.
    pub fn rows(data: &'a mut [T], cols: usize) -> Self {
        Self {
            data,
            rs: cols,
            accumulate: false,
        }
    }

    /// A row-major matrix of `cols` columns, added to.
    pub fn adding(data: &'a mut [T], cols: usize) -> Self {
        Self {
            data,
            rs: cols,
            accumulate: true,
        }
    }
}

/// A read-only matrix view: element `(i, j)` at `data[i * rs + j * cs]`.
#[derive(Clone, Copy)]
pub(crate) struct Mat<'a, T> {
    pub data: &'a [T],
    pub rs: usize,
    pub cs: usize,
}

impl<'a, T> Mat<'a, T> {
    /// A row-major `(rows, cols)` matrix.
    pub fn rows(data: &'a [T], cols: usize) -> Self {
        Self {
            data,
            rs: cols,
            cs: 1,
        }
    }

    /// The transpose of a row-major `(rows, cols)` matrix, read as `(cols, rows)`.
    pub fn transposed(data: &'a [T], cols: usize) -> Self {
        Self {
            data,
            rs: 1,
            cs: cols,
        }
    }

    /// The transpose of this view.
    pub fn t(self) -> Self {
        Self {
            data: self.data,
            rs: self.cs,
            cs: self.rs,
        }
    }

    pub(crate) fn fits(&self, rows: usize, cols: usize) -> bool {
        rows == 0 || cols == 0 || (rows - 1) * self.rs + (cols - 1) * self.cs < self.data.len()
    }
}

/// `dst (m, n) [+]= lhs (m, k) · rhs (k, n)`, `dst` row-major, split over the current rayon
/// pool (the role's [`crate::ComputePool`]).
fn gemm_checked<T: 'static + WithDType>(
    m: usize,
    n: usize,
    k: usize,
    dst: Dst<'_, T>,
    lhs: Mat<'_, T>,
    rhs: Mat<'_, T>,
) {
    let Dst {
        data: dst,
        rs: dst_rs,
        accumulate,
    } = dst;
    let dst_fits = m == 0 || n == 0 || (m - 1) * dst_rs + n <= dst.len();
    assert!(
        dst_fits && (m <= 1 || n <= dst_rs) && lhs.fits(m, k) && rhs.fits(k, n),
        "gemm operands out of bounds"
    );
    if m == 0 || n == 0 {
        return;
    }
    if k == 0 {
        if !accumulate {
            for r in 0..m {
                dst[r * dst_rs..r * dst_rs + n].fill(T::from_f64(0.0));
            }
        }
        return;
    }
    // SAFETY: the assertion above keeps every destination index `i·dst_rs + j` (`i < m`,
    // `j < n`) inside `dst` and every operand index inside its slice; `dst` is exclusively
    // borrowed, so it aliases neither operand.
    #[allow(unsafe_code)]
    unsafe {
        gemm_raw(m, n, k, dst.as_mut_ptr(), dst_rs, accumulate, lhs, rhs);
    }
}

/// `lhs (m, k) · rhs (k, n)` into a new row-major `(m, n)` vector, written only by the product.
fn gemm_new<T: 'static + WithDType>(
    m: usize,
    n: usize,
    k: usize,
    lhs: Mat<'_, T>,
    rhs: Mat<'_, T>,
) -> Vec<T> {
    assert!(
        lhs.fits(m, k) && rhs.fits(k, n),
        "gemm operands out of bounds"
    );
    let len = m * n;
    if len == 0 || k == 0 {
        return vec![T::from_f64(0.0); len];
    }
    let mut out = Vec::with_capacity(len);
    // SAFETY: the vector's capacity holds the `m·n` elements the product writes (row stride
    // `n`) and is a fresh allocation, so it aliases neither operand, whose indices the assertion
    // keeps in bounds. With `accumulate = false` gemm never reads the destination (its `alpha`
    // is zeroed and the kernels store `beta · lhs·rhs` without loading), and it writes every one
    // of the `m·n` elements for `k > 0`, so all are initialised before `set_len`.
    #[allow(unsafe_code)]
    unsafe {
        gemm_raw(m, n, k, out.as_mut_ptr(), n, false, lhs, rhs);
        out.set_len(len);
    }
    out
}

/// Below this many multiply-adds a product is faster on one thread than split.
const MIN_PARALLEL_MACS: usize = 1 << 21;

/// The gemm call behind [`gemm_checked`] and [`gemm_new`], single-threaded below 2²¹
/// multiply-adds.
///
/// # Safety
/// `dst` must be valid for writes (and, with `accumulate`, reads) of every `i·dst_rs + j`,
/// `i < m`, `j < n`, and must not overlap `lhs` or `rhs`, whose views must fit `(m, k)` and
/// `(k, n)`; `m`, `n`, `k` > 0; T is f32 or f64.
#[allow(unsafe_code, clippy::too_many_arguments)]
unsafe fn gemm_raw<T: 'static + WithDType>(
    m: usize,
    n: usize,
    k: usize,
    dst: *mut T,
    dst_rs: usize,
    accumulate: bool,
    lhs: Mat<'_, T>,
    rhs: Mat<'_, T>,
) {
    let threads = rayon::current_num_threads();
    let parallelism = if threads > 1 && m * n * k >= MIN_PARALLEL_MACS {
        gemm::Parallelism::Rayon(threads)
    } else {
        gemm::Parallelism::None
    };
    // SAFETY: the caller's contract (see above) is gemm's.
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            dst,
            1,
            dst_rs as isize,
            accumulate,
            lhs.data.as_ptr(),
            lhs.cs as isize,
            lhs.rs as isize,
            rhs.data.as_ptr(),
            rhs.cs as isize,
            rhs.rs as isize,
            T::from_f64(1.0),
            T::from_f64(1.0),
            false,
            false,
            false,
            parallelism,
        )
    }
}

/// The contiguous elements of a CPU storage seen through `layout`.
pub(crate) fn cpu_slice<'a, T: Real>(s: &'a CpuStorage, layout: &Layout) -> Result<&'a [T]> {
    let Some((start, end)) = layout.contiguous_offsets() else {
        candle_core::bail!("fused op: non-contiguous input {:?}", layout.shape())
    };
    Ok(&T::cpu_storage_as_slice(s)?[start..end])
}

/// The contiguous elements of `t` (a CPU tensor), borrowed from its storage guard.
pub(crate) fn storage_slice<'a, T: Real>(s: &'a Storage, layout: &Layout) -> Result<&'a [T]> {
    match s {
        Storage::Cpu(c) => cpu_slice(c, layout),
        _ => candle_core::bail!("fused op: tensor is not on the CPU"),
    }
}

/// A CPU tensor owning `v`.
pub(crate) fn tensor<T: Real>(v: Vec<T>, shape: &Shape) -> Result<Tensor> {
    Tensor::from_vec(v, shape, &Device::Cpu)
}

/// Runs `f(first_row, rows)` over blocks of whole rows of `out` (rows of `width` elements), on
/// the current rayon pool when `out` is large enough to be worth splitting, and returns the
/// per-block results in order.
pub(crate) fn row_blocks<T: Send, R: Send>(
    out: &mut [T],
    width: usize,
    f: impl Fn(usize, &mut [T]) -> R + Sync,
) -> Vec<R> {
    use rayon::prelude::*;
    /// Below this many elements a split costs more than it saves.
    const MIN_PARALLEL: usize = 1 << 15;
    let rows = out.len() / width.max(1);
    let threads = rayon::current_num_threads();
    if threads <= 1 || out.len() < MIN_PARALLEL || rows < 2 {
        return vec![f(0, out)];
    }
    let block_rows = rows.div_ceil(threads);
    out.par_chunks_mut(block_rows * width)
        .enumerate()
        .map(|(b, chunk)| f(b * block_rows, chunk))
        .collect()
}

/// [`row_blocks`] with blocks of `block_rows` rows whatever the pool: per-block results (partial
/// sums) are the same on one thread or many, so adding them in order gives the same bits for
/// every thread count (a trainer's result must not depend on `trainer.threads`).
pub(crate) fn fixed_row_blocks<T: Send, R: Send>(
    out: &mut [T],
    width: usize,
    block_rows: usize,
    f: impl Fn(usize, &mut [T]) -> R + Sync,
) -> Vec<R> {
    use rayon::prelude::*;
    /// Below this many elements a split costs more than it saves.
    const MIN_PARALLEL: usize = 1 << 15;
    let block_rows = block_rows.max(1);
    let chunk = block_rows * width.max(1);
    if rayon::current_num_threads() <= 1 || out.len() < MIN_PARALLEL {
        out.chunks_mut(chunk)
            .enumerate()
            .map(|(b, c)| f(b * block_rows, c))
            .collect()
    } else {
        out.par_chunks_mut(chunk)
            .enumerate()
            .map(|(b, c)| f(b * block_rows, c))
            .collect()
    }
}

/// Elements of one dtype from two storages, or an error naming the op.
pub(crate) fn same_dtype(op: &str, a: &CpuStorage, b: &CpuStorage) -> Result<DType> {
    let (da, db) = (a.dtype(), b.dtype());
    if da != db {
        candle_core::bail!("{op}: dtype mismatch {da:?} vs {db:?}")
    }
    match da {
        DType::F32 | DType::F64 => Ok(da),
        other => candle_core::bail!("{op}: no fused kernel for {other:?}"),
    }
}

#[cfg(test)]
mod tests;
