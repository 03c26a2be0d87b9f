//! Products on Intel AMX tiles (Sapphire Rapids and later): `x (m, k) · w (n, k)ᵀ` with bf16
//! operands and f32 sums, for an engine or a trainer whose `compute_dtype` is bf16 on the CPU
//! (the trainer's operands, often transposed, are read by `views` and, with AVX-512, `wide`).
//!
//! Why: a decode step of 64 sequences is a product of 64 rows against every weight, and with f32
//! FMA lanes that arithmetic, not memory, bounds a 2-core CPU (`sluice bench model`).
//! One `tdpbf16ps` multiplies a 16×32 bf16 tile by a 32×16 one into 16×16 f32 sums (8,192
//! multiply-adds), so the same step moves towards being bound by streaming the weights (in bf16,
//! half the bytes of f32; `sluice bench kernels` times the tiles against the f32 product).
//!
//! Layout. A weight is packed once per weight version ([`Bf16Weight::pack`]) into the order the
//! tiles read: blocks of 16 output columns × 32 inputs, each 16 lines of 64 bytes where line `p`
//! holds, for each of the 16 columns, the pair of inputs `2p, 2p + 1` ("VNNI" order), and the
//! blocks of one column group consecutive along `k`. Inputs are padded to a multiple of 32 and
//! outputs to a multiple of 32 with zeros. The activations are rounded to bf16 per call into
//! rows padded the same way, 32 rows at a time.
//!
//! Each job takes 32 output columns at a time and, for every 32 input rows, keeps a 2×2 square
//! of 16×16 sum tiles (tiles 0–3) while two input tiles (4, 5) and two weight tiles (6, 7) walk
//! along `k`: four loads for four tile products. A column group's weights (32 × `k` bf16) stay
//! in L1/L2 while up to 256 rows pass them, so a decode step reads each weight from memory once,
//! and the walk asks for the weights a few blocks ahead of the tile loads. A prompt's rows go
//! 256 at a time, each chunk passing every column group while it stays in L2.
//!
//! Linux grants a process the tile registers only on request (`arch_prctl(ARCH_REQ_XCOMP_PERM)`),
//! made once by [`available`]. Rust has no stable AMX intrinsics, so the tile instructions are
//! written as inline assembly; the compiler never uses tile registers itself, and every job loads
//! its tile configuration and releases the tiles when it ends.

#[cfg(all(target_arch = "x86_64", target_os = "linux"))]
use rayon::prelude::*;

/// Inputs per tile row (a 64-byte line of bf16) and outputs per pair of column tiles.
const K_BLOCK: usize = 32;
/// Outputs of one column tile, and rows of one input or sum tile.
const TILE: usize = 16;
/// Rows and columns one job step covers (two tiles each way).
const PAIR: usize = 2 * TILE;

/// One 64-byte tile row of bf16 values (aligned, so a tile row never straddles cache lines).
#[repr(C, align(64))]
#[derive(Clone, Copy)]
struct Line([u16; K_BLOCK]);

const ZERO_LINE: Line = Line([0; K_BLOCK]);

/// Whether this CPU has AMX with bf16 tiles and the kernel lets this process use them. Checked
/// once (the first call asks Linux for the tile state).
pub fn available() -> bool {
    #[cfg(all(target_arch = "x86_64", target_os = "linux"))]
    {
        static OK: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
        *OK.get_or_init(|| {
            // CPUID leaf 7: EDX bit 24 is AMX-TILE, bit 22 AMX-BF16.
            let leaf = std::arch::x86_64::__cpuid_count(7, 0);
            let cpu = leaf.edx & (1 << 24) != 0 && leaf.edx & (1 << 22) != 0;
            // ARCH_REQ_XCOMP_PERM for XFEATURE_XTILEDATA: refused where the kernel or the
            // hypervisor does not save tile state.
            const ARCH_REQ_XCOMP_PERM: libc::c_long = 0x1023;
            const XFEATURE_XTILEDATA: libc::c_long = 18;
            // SAFETY: a plain system call with integer arguments; it changes only which
            // register state the kernel saves for this process.
            #[allow(unsafe_code)]
            let granted = cpu
                && unsafe {
                    libc::syscall(
                        libc::SYS_arch_prctl,
                        ARCH_REQ_XCOMP_PERM,
                        XFEATURE_XTILEDATA,
                    )
                } == 0;
            granted
        })
    }
    #[cfg(not(all(target_arch = "x86_64", target_os = "linux")))]
    false
}

/// `v` rounded to the nearest bf16 (ties to even), as its bits; NaN stays NaN.
#[inline(always)]
pub fn bf16_bits(v: f32) -> u16 {
    let bits = v.to_bits();
    let rounded = (bits.wrapping_add(0x7fff + ((bits >> 16) & 1)) >> 16) as u16;
    let quiet_nan = ((bits >> 16) | 0x40) as u16;
    // A select, not a branch, so loops over it vectorise.
    if v.is_nan() { quiet_nan } else { rounded }
}

/// A weight `(n, k)` rounded to bf16 and packed in tile order (see the module docs).
pub struct Bf16Weight {
    n: usize,
    k: usize,
    /// Blocks of [`K_BLOCK`] inputs (`k` padded).
    k_blocks: usize,
    /// Outputs padded to a multiple of [`PAIR`].
    n_padded: usize,
    lines: Vec<Line>,
}

impl std::fmt::Debug for Bf16Weight {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Bf16Weight({}, {})", self.n, self.k)
    }
}

impl Bf16Weight {
    /// Packs the row-major weight `w` of `n` outputs by `k` inputs (on the current rayon pool).
    pub fn pack(w: &[f32], n: usize, k: usize) -> Self {
        let mut packed = Self::zeros(n, k);
        packed.repack(w);
        packed
    }

    /// A weight of `n` outputs by `k` inputs, every value (and the padding) zero.
    fn zeros(n: usize, k: usize) -> Self {
        let k_blocks = k.div_ceil(K_BLOCK);
        let n_padded = n.div_ceil(PAIR) * PAIR;
        Self {
            n,
            k,
            k_blocks,
            n_padded,
            lines: vec![ZERO_LINE; n_padded / TILE * k_blocks * TILE],
        }
    }

    /// Packs `w` (same shape) into this weight's own memory: a weight swap's new version, with
    /// no fresh pages to fault in (the kernel clearing them was most of a fresh pack's time).
    ///
    /// # Panics
    /// If `w` does not hold `n · k` values.
    pub fn repack(&mut self, w: &[f32]) {
        let (n, k) = (self.n, self.k);
        assert_eq!(
            w.len(),
            n * k,
            "amx pack: weight of {} values for ({n}, {k})",
            w.len()
        );
        self.repack_with(|[j, cols, first, len], block| {
            for (col, values) in block.iter_mut().enumerate().take(cols) {
                values[..len].copy_from_slice(&w[(j + col) * k + first..][..len]);
            }
        });
    }

    /// Packs the values `read([j, cols, first, len], block)` gives: `block[col][..len]` gets
    /// inputs `first .. first + len` of output `j + col`, for `col < cols` (a block of at most
    /// a tile's outputs and one line's inputs).
    fn repack_with(&mut self, read: impl Fn([usize; 4], &mut [[f32; K_BLOCK]; TILE]) + Sync) {
        // The block's 16 × 32 inputs are read output by output, then rounded and turned into
        // its 16 lines.
        self.repack_lines(false, |at, lines| {
            let mut block = [[0f32; K_BLOCK]; TILE];
            read(at, &mut block);
            #[cfg(target_arch = "x86_64")]
            if std::arch::is_x86_feature_detected!("avx512f") {
                // SAFETY: the CPU has AVX-512F.
                #[allow(unsafe_code)]
                unsafe {
                    pack_block_wide(&block, lines)
                };
                return;
            }
            pack_block(&block, lines);
        });
    }

    /// Writes the 16 lines of every block that holds an output by `write([j, cols, first,
    /// len], lines)`: outputs `j .. j + cols`, inputs `first .. first + len`, zeros in the
    /// lines' places past them. The column tiles wholly past `n` (the padding to 32 outputs)
    /// keep the zeros they were made with.
    ///
    /// `across` walks a few column tiles' blocks of one input block before the next input
    /// block (for a source whose rows are the inputs: each source row is then read in runs of
    /// several cache lines), where the default walks each column tile along all its inputs
    /// (for a row-major weight, whose rows are the outputs).
    fn repack_lines(&mut self, across: bool, write: impl Fn([usize; 4], &mut [Line]) + Sync) {
        let (n, k, k_blocks) = (self.n, self.k, self.k_blocks);
        // One column tile's blocks: `k_blocks` tiles of TILE lines.
        let per_tile = k_blocks * TILE;
        let tiles = self.n_padded / TILE;
        // Column tiles per job: up to 8 (a 512-byte run of a source row) when walking across,
        // fewer where the pool needs more jobs.
        let group = if across {
            (tiles / (2 * rayon::current_num_threads())).clamp(1, 8)
        } else {
            1
        };
        let fill = |(g, chunk): (usize, &mut [Line])| {
            for kb in 0..k_blocks {
                let (first, len) = (kb * K_BLOCK, (k - kb * K_BLOCK).min(K_BLOCK));
                for (t, tile) in chunk.chunks_exact_mut(per_tile).enumerate() {
                    let j = (g * group + t) * TILE;
                    let cols = n.saturating_sub(j).min(TILE);
                    if cols > 0 {
                        write([j, cols, first, len], &mut tile[kb * TILE..][..TILE]);
                    }
                }
            }
        };
        #[cfg(all(target_arch = "x86_64", target_os = "linux"))]
        self.lines
            .par_chunks_mut(per_tile * group)
            .enumerate()
            .for_each(fill);
        #[cfg(not(all(target_arch = "x86_64", target_os = "linux")))]
        self.lines
            .chunks_mut(per_tile * group)
            .enumerate()
            .for_each(fill);
    }

    /// Outputs.
    pub fn rows(&self) -> usize {
        self.n
    }

    /// Inputs.
    pub fn cols(&self) -> usize {
        self.k
    }

    /// The weight's values back as f32, row-major `(n, k)` (each one its bf16 rounding).
    pub fn unpack(&self) -> Vec<f32> {
        let mut w = vec![0.0; self.n * self.k];
        let per_tile = self.k_blocks * TILE;
        for (j, row) in w.chunks_exact_mut(self.k).enumerate() {
            let tile = &self.lines[j / TILE * per_tile..][..per_tile];
            for (i, v) in row.iter_mut().enumerate() {
                let (kb, within) = (i / K_BLOCK, i % K_BLOCK);
                let bits = tile[kb * TILE + within / 2].0[(j % TILE) * 2 + within % 2];
                *v = f32::from_bits(u32::from(bits) << 16);
            }
        }
        w
    }

    /// `x (m, k) · selfᵀ` as a row-major `(m, n)` buffer: `x` rounded to bf16, sums in f32.
    ///
    /// # Panics
    /// If [`available`] is false, or `x` does not hold `m` rows of `k`.
    pub fn linear(&self, x: &[f32], m: usize) -> Vec<f32> {
        self.product(&Bf16Rows::round(x, m, self.k))
    }

    /// `x · selfᵀ` for inputs already rounded (one rounding serves every weight that reads the
    /// same input: q, k and v; gate and up).
    ///
    /// # Panics
    /// If [`available`] is false, or `x` has other than `k` columns.
    pub fn product(&self, x: &Bf16Rows) -> Vec<f32> {
        products(&[self], x).pop().expect("one product")
    }
}

/// A block's 16 outputs × 32 inputs (`block[col][input]`) rounded into its 16 lines, line `p`
/// holding each output's inputs `2p, 2p + 1` (the tiles' pair order): rounded row by row,
/// then the pairs turned as a 16 × 16 matrix of 32-bit words.
#[inline(always)]
fn pack_block(block: &[[f32; K_BLOCK]; TILE], lines: &mut [Line]) {
    let mut pairs = [[0u32; TILE]; TILE];
    for (words, values) in pairs.iter_mut().zip(block) {
        for (w, v) in words.iter_mut().zip(values.chunks_exact(2)) {
            *w = u32::from(bf16_bits(v[0])) | u32::from(bf16_bits(v[1])) << 16;
        }
    }
    for (p, line) in lines.iter_mut().enumerate() {
        for (col, words) in pairs.iter().enumerate() {
            line.0[2 * col] = words[p] as u16;
            line.0[2 * col + 1] = (words[p] >> 16) as u16;
        }
    }
}

/// [`pack_block`] compiled for AVX-512 (the crate targets baseline x86-64).
///
/// # Safety
/// The CPU has AVX-512F.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
#[allow(unsafe_code)]
unsafe fn pack_block_wide(block: &[[f32; K_BLOCK]; TILE], lines: &mut [Line]) {
    pack_block(block, lines)
}

/// `x · wᵀ` for each of `weights`, row-major `(m, w.rows())` each, in one pass of the thread
/// pool: the products that read one input (q, k and v; gate and up) share its rounding and one
/// split of the work, so the pool wakes once for all of them.
///
/// # Panics
/// If [`available`] is false, or `x` has other than `k` columns for some weight.
pub fn products(weights: &[&Bf16Weight], x: &Bf16Rows) -> Vec<Vec<f32>> {
    assert!(
        available(),
        "amx product on a CPU or kernel without AMX tiles"
    );
    for w in weights {
        assert_eq!(
            x.k, w.k,
            "amx product: inputs of {} columns against a weight of {}",
            x.k, w.k
        );
    }
    let (m, m_padded) = (x.m, x.m.div_ceil(PAIR) * PAIR);
    let mut outs: Vec<Vec<f32>> = weights
        .iter()
        .map(|w| Vec::with_capacity(m_padded * w.n_padded))
        .collect();
    #[cfg(all(target_arch = "x86_64", target_os = "linux"))]
    // SAFETY: `available` holds; `x` holds `m_padded` rows of `k_blocks` blocks and each packed
    // weight `n_padded` columns of as many blocks; each `out` has room for
    // `m_padded · n_padded` sums, which the tiles write every one of before `set_len`.
    #[allow(unsafe_code)]
    unsafe {
        let jobs: Vec<(&Bf16Weight, *mut f32)> = weights
            .iter()
            .zip(&mut outs)
            .map(|(&w, out)| (w, out.as_mut_ptr()))
            .collect();
        tiles::run(&x.lines, m_padded, &jobs);
        for (w, out) in weights.iter().zip(&mut outs) {
            out.set_len(m_padded * w.n_padded);
        }
    }
    for (w, out) in weights.iter().zip(&mut outs) {
        let np = w.n_padded;
        if np != w.n {
            for r in 1..m {
                out.copy_within(r * np..r * np + w.n, r * w.n);
            }
        }
        out.truncate(m * w.n);
    }
    outs
}

/// Activations `(m, k)` rounded to bf16 in the tiles' order: each input tile (16 rows × 32
/// inputs) is 16 consecutive 64-byte lines, the tiles of 16 rows consecutive along `k`, so a
/// tile load reads 1 KB in a row (not 16 lines a row's width apart). `k` is padded with zeros
/// to whole lines, `m` with zero rows to a multiple of 32.
pub struct Bf16Rows {
    m: usize,
    k: usize,
    lines: Vec<Line>,
}

impl std::fmt::Debug for Bf16Rows {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Bf16Rows({}, {})", self.m, self.k)
    }
}

/// Values below which one thread rounds (or norms) them all.
const MIN_PARALLEL: usize = 1 << 16;

impl Bf16Rows {
    /// Its rows (before the padding to a multiple of 32).
    pub fn rows(&self) -> usize {
        self.m
    }

    /// Its values per row (before the padding to a whole line).
    pub fn cols(&self) -> usize {
        self.k
    }

    /// Rounds `x`, `m` rows of `k`.
    ///
    /// # Panics
    /// If `x` does not hold `m · k` values.
    pub fn round(x: &[f32], m: usize, k: usize) -> Self {
        assert_eq!(
            x.len(),
            m * k,
            "amx rows: {} values for ({m}, {k})",
            x.len()
        );
        Self::fill(m, k, |r, col, out| {
            out.copy_from_slice(&x[r * k + col..][..out.len()])
        })
    }

    /// The RMS norm of `x`'s `m` rows of `k` times `w` (`k` weights), as
    /// [`crate::fused::rms_norm`] computes it, rounded as it is computed: a layer's normed input
    /// goes into its products' tiles with no f32 copy written and read back.
    ///
    /// # Panics
    /// If `x` does not hold `m · k` values or `w` `k`.
    pub fn rms_norm(x: &[f32], w: &[f32], eps: f64, m: usize, k: usize) -> Self {
        assert!(
            x.len() == m * k && w.len() == k,
            "amx rms norm: {} values and {} weights for ({m}, {k})",
            x.len(),
            w.len()
        );
        let inv_row = |row: &[f32]| crate::fused::rms_inv(row, eps as f32);
        let inv: Vec<f32> = if m * k >= MIN_PARALLEL && rayon::current_num_threads() > 1 {
            use rayon::prelude::*;
            x.par_chunks(k.max(1)).map(inv_row).collect()
        } else {
            x.chunks(k.max(1)).map(inv_row).collect()
        };
        Self::fill(m, k, |r, col, out| {
            let (xs, ws) = (&x[r * k + col..][..out.len()], &w[col..][..out.len()]);
            for ((o, &xv), &wv) in out.iter_mut().zip(xs).zip(ws) {
                *o = xv * inv[r] * wv;
            }
        })
    }

    /// `silu(gate) ⊙ up` of two `(m, k)` matrices (the MLP's activation, `g / (1 + e^−g) · u`,
    /// as [`crate::fused::swiglu`] computes it), rounded as it is computed: it goes into the
    /// down projection's tiles with no f32 copy written and read back.
    ///
    /// # Panics
    /// If `gate` or `up` does not hold `m · k` values.
    pub fn swiglu(gate: &[f32], up: &[f32], m: usize, k: usize) -> Self {
        assert!(
            gate.len() == m * k && up.len() == m * k,
            "amx swiglu: {} and {} values for ({m}, {k})",
            gate.len(),
            up.len()
        );
        Self::fill(m, k, |r, col, out| {
            let at = r * k + col;
            let (g, u) = (&gate[at..][..out.len()], &up[at..][..out.len()]);
            for (o, &g) in out.iter_mut().zip(g) {
                *o = -g;
            }
            crate::fused::exp_f32_in_place(out);
            for ((o, &g), &u) in out.iter_mut().zip(g).zip(u) {
                *o = g / (1.0 + *o) * u;
            }
        })
    }

    /// Rows whose values `values(r, col, out)` writes into `out` (row `r < m`, columns `col ..
    /// col + out.len()`, at most one line's), rounded into the tiles' order.
    fn fill(m: usize, k: usize, values: impl Fn(usize, usize, &mut [f32]) + Sync) -> Self {
        Self::from_tiles(m, k, 1, |first, dst| {
            #[cfg(target_arch = "x86_64")]
            if std::arch::is_x86_feature_detected!("avx512f") {
                // SAFETY: the CPU has AVX-512F.
                #[allow(unsafe_code)]
                unsafe {
                    fill_wide(dst, first, m, k, &values)
                };
                return;
            }
            fill_lines(dst, first, m, k, &values);
        })
    }

    /// `m` rows of `k` whose lines `write(first, dst)` writes, every one of `dst`'s: up to
    /// `per_job` tiles of 16 rows from row `first` on, one after another (`k` padded to whole
    /// lines, the rows to a multiple of 32). Jobs on the pool when there are enough values to
    /// pay for the split.
    fn from_tiles(
        m: usize,
        k: usize,
        per_job: usize,
        write: impl Fn(usize, &mut [std::mem::MaybeUninit<Line>]) + Sync,
    ) -> Self {
        let row_lines = k.div_ceil(K_BLOCK);
        let m_padded = m.div_ceil(PAIR) * PAIR;
        let mut lines: Vec<Line> = Vec::with_capacity(m_padded * row_lines);
        let spare = &mut lines.spare_capacity_mut()[..m_padded * row_lines];
        let tile =
            |(b, dst): (usize, &mut [std::mem::MaybeUninit<Line>])| write(b * per_job * TILE, dst);
        let chunk = per_job * TILE * row_lines;
        if m * k >= MIN_PARALLEL && rayon::current_num_threads() > 1 {
            use rayon::prelude::*;
            spare.par_chunks_mut(chunk).enumerate().for_each(tile);
        } else {
            spare.chunks_mut(chunk).enumerate().for_each(tile);
        }
        // SAFETY: `write` wrote every one of the `m_padded · row_lines` lines.
        #[allow(unsafe_code)]
        unsafe {
            lines.set_len(m_padded * row_lines)
        };
        Self { m, k, lines }
    }
}

/// Writes every line of `dst`, the tiles of 16 rows from row `first` on, in the tiles' order
/// ([`Bf16Rows`]): row `r < m` holds its values from `values` rounded, zeros after its `k`; the
/// rows past `m` are zeros.
#[inline(always)]
fn fill_lines(
    dst: &mut [std::mem::MaybeUninit<Line>],
    first: usize,
    m: usize,
    k: usize,
    values: &impl Fn(usize, usize, &mut [f32]),
) {
    let row_lines = k.div_ceil(K_BLOCK);
    for (block, tiles) in dst.chunks_exact_mut(TILE * row_lines).enumerate() {
        for (i, r) in (0..TILE).flat_map(|r| (0..row_lines).map(move |i| (i, r))) {
            let line = &mut tiles[i * TILE + r];
            let r = first + block * TILE + r;
            let mut part = [0f32; K_BLOCK];
            if r < m {
                let width = k.saturating_sub(i * K_BLOCK).min(K_BLOCK);
                values(r, i * K_BLOCK, &mut part[..width]);
            }
            // A plain loop (not `array::map`, which is not inlined into the AVX-512 copy).
            let mut bits = [0u16; K_BLOCK];
            for (b, &v) in bits.iter_mut().zip(&part) {
                *b = bf16_bits(v);
            }
            line.write(Line(bits));
        }
    }
}

/// [`fill_lines`] in 16-lane registers (the crate targets baseline x86-64, whose 4-lane loop was
/// most of a decode step's rounding time).
///
/// # Safety
/// The CPU has AVX-512F.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
#[allow(unsafe_code)]
unsafe fn fill_wide(
    dst: &mut [std::mem::MaybeUninit<Line>],
    first: usize,
    m: usize,
    k: usize,
    values: &impl Fn(usize, usize, &mut [f32]),
) {
    fill_lines(dst, first, m, k, values)
}

#[cfg(all(target_arch = "x86_64", target_os = "linux"))]
mod tiles;
mod views;
#[cfg(target_arch = "x86_64")]
mod wide;

#[cfg(test)]
mod tests;
