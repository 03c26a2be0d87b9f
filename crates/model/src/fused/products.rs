//! The products of the linear layers and the token-score head on the CPU, in this thread's
//! precision: by gemm in the tensors' dtype (f32, f64), or, inside a [`Bf16Products`] scope on
//! a CPU with AMX, on the tiles ([`crate::amx`]) with operands rounded to bf16 and sums in f32:
//! `trainer.compute_dtype = "bf16"` there. The scope is per thread, as PyTorch's autocast is.
//! Only these products change; the attention, norms, activations and the head's softmax stay
//! in the tensors' dtype, as the engine's bf16 products on the CPU leave them.

use std::cell::Cell;
use std::marker::PhantomData;

use super::{Dst, Mat, Real};
use crate::amx::{Bf16Rows, Bf16Weight};

thread_local! {
    static BF16: Cell<bool> = const { Cell::new(false) };
}

/// While one is alive, this thread's CPU linear layers and token-score head (f32) take their
/// products on the AMX tiles in bf16. Dropping it restores what was before.
pub(crate) struct Bf16Products {
    previous: bool,
    /// Bound to the thread whose flag it set.
    _thread: PhantomData<*const ()>,
}

impl Bf16Products {
    /// The tiles for this thread's products while the guard lives when `on` (and the CPU has
    /// AMX: else the products stay f32); `on = false` turns them off inside an outer scope.
    pub(crate) fn enter(on: bool) -> Self {
        let previous = BF16.replace(on && crate::amx::available());
        Self {
            previous,
            _thread: PhantomData,
        }
    }
}

impl Drop for Bf16Products {
    fn drop(&mut self) {
        BF16.set(self.previous);
    }
}

/// Whether this thread's products run on the tiles ([`Bf16Products`]).
pub(crate) fn bf16_products() -> bool {
    BF16.get()
}

/// A product's right operand `(k, n)` as this thread's products take it ([`Real::rhs`]).
pub(crate) enum Rhs<'a, T> {
    /// Read in place by gemm.
    View(Mat<'a, T>),
    /// Rounded to bf16 and packed for the tiles once, for every product that reads it (the
    /// head's weight, over all its chunks).
    Tiles(Bf16Weight),
}

/// `dst (m, n) [+]= lhs (m, k) · rhs (k, n)`.
pub(crate) fn product<T: Real>(
    m: usize,
    n: usize,
    k: usize,
    dst: Dst<'_, T>,
    lhs: Mat<'_, T>,
    rhs: &Rhs<'_, T>,
) {
    let w = match rhs {
        Rhs::View(rhs) => return T::matmul(m, n, k, dst, lhs, *rhs),
        Rhs::Tiles(w) => w,
    };
    let sums = T::tiles(m, lhs, w);
    let Dst {
        data,
        rs,
        accumulate,
    } = dst;
    assert!(
        m == 0 || n == 0 || ((m - 1) * rs + n <= data.len() && (m <= 1 || n <= rs)),
        "tile product: destination out of bounds"
    );
    for (r, row) in sums.chunks_exact(n.max(1)).enumerate() {
        let out = &mut data[r * rs..][..n];
        if accumulate {
            for (o, &s) in out.iter_mut().zip(row) {
                *o += s;
            }
        } else {
            out.copy_from_slice(row);
        }
    }
}

/// `lhs (m, k) · rhs (k, n)` as a new row-major `(m, n)` buffer, written only by the product.
pub(crate) fn product_new<T: Real>(
    m: usize,
    n: usize,
    k: usize,
    lhs: Mat<'_, T>,
    rhs: &Rhs<'_, T>,
) -> Vec<T> {
    match rhs {
        Rhs::View(rhs) => T::matmul_new(m, n, k, lhs, *rhs),
        Rhs::Tiles(w) => T::tiles(m, lhs, w),
    }
}

/// [`Real::rhs`] for f32: packed for the tiles inside a [`Bf16Products`] scope.
pub(super) fn rhs_f32(rhs: Mat<'_, f32>, k: usize, n: usize) -> Rhs<'_, f32> {
    if bf16_products() {
        Rhs::Tiles(Bf16Weight::pack_view(rhs, k, n))
    } else {
        Rhs::View(rhs)
    }
}

/// [`Real::tiles`] for f32: `lhs (m, k)` rounded to bf16 and multiplied by `w` on the tiles,
/// row-major `(m, w.rows())`.
pub(super) fn tiles_f32(m: usize, lhs: Mat<'_, f32>, w: &Bf16Weight) -> Vec<f32> {
    let (n, k) = (w.rows(), w.cols());
    assert!(lhs.fits(m, k), "tile product: lhs out of bounds");
    if m == 0 || n == 0 || k == 0 {
        return vec![0.0; m * n];
    }
    let rows = Bf16Rows::round_view(lhs, m, k);
    let mut sums = crate::amx::products(&[w], &rows);
    sums.pop().expect("one product")
}
