//! f32 SIMD registers of two widths (AVX2's 8 lanes, AVX-512's 16) behind one trait, so a
//! kernel's loop is written once and compiled inside each width's `#[target_feature]` wrapper.

/// A SIMD register of f32 lanes and the three operations a tile needs. Every method is
/// `inline(always)`, to be compiled inside a `#[target_feature]` function that enables its
/// instructions.
#[cfg(target_arch = "x86_64")]
#[allow(unsafe_code)]
pub(super) trait Lanes: Copy {
    /// f32s per register.
    const WIDTH: usize;
    /// # Safety
    /// The CPU has the instructions; nothing to read.
    unsafe fn zero() -> Self;
    /// # Safety
    /// The CPU has the instructions; `p` is valid for reads of `WIDTH` f32s.
    unsafe fn load(p: *const f32) -> Self;
    /// `self + a·b` lane by lane.
    /// # Safety
    /// The CPU has the instructions.
    unsafe fn fma(self, a: Self, b: Self) -> Self;
    /// The sum of the lanes.
    /// # Safety
    /// The CPU has the instructions.
    unsafe fn sum(self) -> f32;
}

#[cfg(target_arch = "x86_64")]
#[derive(Clone, Copy)]
pub(super) struct Avx2(std::arch::x86_64::__m256);

#[cfg(target_arch = "x86_64")]
#[allow(unsafe_code)]
impl Lanes for Avx2 {
    const WIDTH: usize = 8;
    #[inline(always)]
    unsafe fn zero() -> Self {
        // SAFETY: the caller's (AVX).
        Self(unsafe { std::arch::x86_64::_mm256_setzero_ps() })
    }
    #[inline(always)]
    unsafe fn load(p: *const f32) -> Self {
        // SAFETY: the caller's.
        Self(unsafe { std::arch::x86_64::_mm256_loadu_ps(p) })
    }
    #[inline(always)]
    unsafe fn fma(self, a: Self, b: Self) -> Self {
        // SAFETY: the caller's (FMA).
        Self(unsafe { std::arch::x86_64::_mm256_fmadd_ps(a.0, b.0, self.0) })
    }
    #[inline(always)]
    unsafe fn sum(self) -> f32 {
        use std::arch::x86_64::*;
        // SAFETY: the caller's (AVX).
        unsafe {
            let a = self.0;
            let half = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
            let pair = _mm_add_ps(half, _mm_movehl_ps(half, half));
            _mm_cvtss_f32(_mm_add_ss(pair, _mm_shuffle_ps(pair, pair, 1)))
        }
    }
}

#[cfg(target_arch = "x86_64")]
#[derive(Clone, Copy)]
pub(super) struct Avx512(std::arch::x86_64::__m512);

#[cfg(target_arch = "x86_64")]
#[allow(unsafe_code)]
impl Lanes for Avx512 {
    const WIDTH: usize = 16;
    #[inline(always)]
    unsafe fn zero() -> Self {
        // SAFETY: the caller's (AVX-512F).
        Self(unsafe { std::arch::x86_64::_mm512_setzero_ps() })
    }
    #[inline(always)]
    unsafe fn load(p: *const f32) -> Self {
        // SAFETY: the caller's.
        Self(unsafe { std::arch::x86_64::_mm512_loadu_ps(p) })
    }
    #[inline(always)]
    unsafe fn fma(self, a: Self, b: Self) -> Self {
        // SAFETY: the caller's (AVX-512F).
        Self(unsafe { std::arch::x86_64::_mm512_fmadd_ps(a.0, b.0, self.0) })
    }
    #[inline(always)]
    unsafe fn sum(self) -> f32 {
        // SAFETY: the caller's (AVX-512F).
        unsafe { std::arch::x86_64::_mm512_reduce_add_ps(self.0) }
    }
}
