//! The tiles, the packing and the rounding against plain f32/f64 arithmetic.

use super::*;

fn values(len: usize, seed: u32) -> Vec<f32> {
    (0..len)
        .map(|i| {
            let h = (i as u32)
                .wrapping_mul(2_654_435_761)
                .wrapping_add(seed.wrapping_mul(40_503));
            (h >> 8) as f32 / (1u32 << 24) as f32 - 0.5
        })
        .collect()
}

/// Every line of `got` is the same as `want`'s, and there are as many.
fn assert_same_lines(got: &[Line], want: &[Line], what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: lines");
    for (i, (a, b)) in got.iter().zip(want).enumerate() {
        assert_eq!(a.0, b.0, "{what}: line {i}");
    }
}

/// [`values`] with, every seventh value, one that tests the rounding: NaN (quiet, and one whose
/// payload the rounding would carry into infinity), the infinities, a negative zero, ties to
/// even both ways, a subnormal, the largest finite value.
fn awkward(len: usize, seed: u32) -> Vec<f32> {
    let special = [
        f32::NAN,
        f32::from_bits(0x7f80_0001),
        f32::INFINITY,
        f32::NEG_INFINITY,
        -0.0,
        1.0 + 1.0 / 256.0,
        1.0 + 3.0 / 256.0,
        f32::MIN_POSITIVE / 3.0,
        f32::MAX,
    ];
    let mut v = values(len, seed);
    for (i, x) in v.iter_mut().enumerate().skip(3).step_by(7) {
        *x = special[(i / 7) % special.len()];
    }
    v
}

/// A transposed left operand (`gᵀ` of `dW = gᵀ x`, read in place) rounds into exactly the lines
/// a transposed copy rounds into: shapes off every tile multiple, rows read from a wider
/// source, NaN, infinities and ties.
#[test]
fn transposed_rows_equal_the_rows_of_a_transposed_copy() {
    for (m, k, stride) in [
        (1, 1, 1),
        (16, 32, 16),
        (17, 33, 20),
        (40, 70, 45),
        (96, 64, 96),
        (5, 100, 5),
        // Several tiles a job, the last job short (18 tiles in jobs of 4 on 2 threads).
        (270, 300, 280),
    ] {
        // The source is `(k, stride)`, row-major; element `(r, c)` is `src[c · stride + r]`.
        let src = awkward(k * stride, 9);
        let copy: Vec<f32> = (0..m)
            .flat_map(|r| (0..k).map(move |c| (r, c)))
            .map(|(r, c)| src[c * stride + r])
            .collect();
        let view = crate::fused::Mat {
            data: &src,
            rs: 1,
            cs: stride,
        };
        let got = Bf16Rows::round_view(view, m, k);
        let want = Bf16Rows::round(&copy, m, k);
        assert_same_lines(
            &got.lines,
            &want.lines,
            &format!("({m}, {k}) from stride {stride}"),
        );
    }
}

/// A left operand read as it is, rows a wider stride apart (`g` of `g W`, `x` of `x Wᵀ`),
/// rounds into exactly the lines of its compact copy.
#[test]
fn rows_read_in_place_equal_the_rows_of_a_copy() {
    for (m, k, rs) in [
        (1, 1, 1),
        (16, 32, 32),
        (17, 33, 40),
        (40, 70, 70),
        (5, 100, 117),
    ] {
        let src = awkward(m * rs, 13);
        let copy: Vec<f32> = src.chunks(rs).flat_map(|row| &row[..k]).copied().collect();
        let view = crate::fused::Mat {
            data: &src,
            rs,
            cs: 1,
        };
        let got = Bf16Rows::round_view(view, m, k);
        let want = Bf16Rows::round(&copy, m, k);
        assert_same_lines(
            &got.lines,
            &want.lines,
            &format!("({m}, {k}) from row stride {rs}"),
        );
    }
}

/// A right operand whose rows are the inputs (`x` of `dW = gᵀ x`, `W` of `dx = g W`) packs
/// into exactly the lines its transposed copy packs into as a weight.
#[test]
fn input_rows_pack_as_the_weight_they_are_read_as() {
    for (k, n, rs) in [
        (1, 1, 1),
        (32, 16, 16),
        (33, 17, 17),
        (70, 40, 50),
        (64, 96, 96),
        (100, 5, 8),
        // Several column tiles a job, the last job short.
        (300, 270, 280),
    ] {
        // The source is `(k, rs)`, row-major; output `j` of input `p` is `src[p · rs + j]`.
        let src = awkward(k * rs, 11);
        let weight: Vec<f32> = (0..n)
            .flat_map(|j| (0..k).map(move |p| (j, p)))
            .map(|(j, p)| src[p * rs + j])
            .collect();
        let view = crate::fused::Mat {
            data: &src,
            rs,
            cs: 1,
        };
        let got = Bf16Weight::pack_view(view, k, n);
        let want = Bf16Weight::pack(&weight, n, k);
        assert_same_lines(
            &got.lines,
            &want.lines,
            &format!("({k}, {n}) from row stride {rs}"),
        );
    }
}

#[test]
fn rounding_is_to_nearest_even() {
    assert_eq!(bf16_bits(1.0), 0x3f80);
    // 1 + 2^-8 is halfway between bf16 neighbours 1 and 1 + 2^-7: ties go to even (1).
    assert_eq!(bf16_bits(1.0 + 1.0 / 256.0), 0x3f80);
    assert_eq!(bf16_bits(1.0 + 3.0 / 256.0), 0x3f82);
    assert!(f32::from_bits(u32::from(bf16_bits(f32::NAN)) << 16).is_nan());
    assert_eq!(bf16_bits(f32::INFINITY), 0x7f80);
}

#[test]
fn packing_keeps_every_value_at_its_bf16_rounding() {
    for (n, k) in [(1, 1), (17, 33), (64, 576), (40, 70)] {
        let w = values(n * k, 3);
        let packed = Bf16Weight::pack(&w, n, k);
        let back = packed.unpack();
        for (b, v) in back.iter().zip(&w) {
            assert_eq!(b.to_bits() >> 16, u32::from(bf16_bits(*v)));
        }
    }
}

/// The fused norm rounds exactly what the f32 op computes, small and large.
#[test]
fn rms_norm_rows_are_the_rounded_norm() {
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(2)
        .build()
        .unwrap();
    for (m, k) in [(3, 40), (130, 576)] {
        let (x, w) = (values(m * k, 7), values(k, 8));
        let cpu = &candle_core::Device::Cpu;
        let xt = candle_core::Tensor::from_slice(&x, (m, k), cpu).unwrap();
        let wt = candle_core::Tensor::from_slice(&w, k, cpu).unwrap();
        let normed: Vec<f32> = crate::fused::rms_norm(&xt, &wt, 1e-5)
            .and_then(|t| t.flatten_all()?.to_vec1())
            .unwrap();
        let want = Bf16Rows::round(&normed, m, k);
        let got = pool.install(|| Bf16Rows::rms_norm(&x, &w, 1e-5, m, k));
        assert_same_lines(&got.lines, &want.lines, &format!("({m}, {k})"));
    }
}

/// The fused activation rounds exactly what the f32 op computes, on one thread (small) and
/// on the pool (large, rows past a multiple of 16), zeros in the padding.
#[test]
fn swiglu_rows_are_the_rounded_activation() {
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(2)
        .build()
        .unwrap();
    for (m, k) in [(3, 40), (50, 1536), (64, 70)] {
        let (g, u) = (values(m * k, 5), values(m * k, 6));
        let gt = candle_core::Tensor::from_slice(&g, (m, k), &candle_core::Device::Cpu);
        let ut = candle_core::Tensor::from_slice(&u, (m, k), &candle_core::Device::Cpu);
        let act: Vec<f32> = crate::fused::swiglu(&gt.unwrap(), &ut.unwrap())
            .and_then(|t| t.flatten_all()?.to_vec1())
            .unwrap();
        let want = Bf16Rows::round(&act, m, k);
        let got = pool.install(|| Bf16Rows::swiglu(&g, &u, m, k));
        assert_eq!(
            (got.m, got.k, got.lines.len()),
            (want.m, want.k, want.lines.len())
        );
        assert_same_lines(&got.lines, &want.lines, &format!("({m}, {k})"));
    }
}

/// The tiles against f64 sums of the same bf16-rounded operands: only the f32 summation
/// differs.
#[test]
fn products_in_one_pass_equal_each_alone() {
    if !available() {
        eprintln!("no AMX on this CPU: the tile kernel is not exercised here");
        return;
    }
    let (m, k) = (40, 100);
    let x = Bf16Rows::round(&values(m * k, 3), m, k);
    let weights: Vec<Bf16Weight> = [576, 192, 70]
        .iter()
        .zip(4..)
        .map(|(&n, seed)| Bf16Weight::pack(&values(n * k, seed), n, k))
        .collect();
    let together = products(&weights.iter().collect::<Vec<_>>(), &x);
    assert_eq!(together.len(), weights.len());
    for (w, got) in weights.iter().zip(&together) {
        assert_eq!(got, &w.product(&x), "({}, {k})", w.rows());
    }
}

#[test]
fn tile_products_match_the_rounded_operands() {
    if !available() {
        eprintln!("no AMX on this CPU: the tile kernel is not exercised here");
        return;
    }
    for (m, k, n) in [
        (1, 32, 32),
        (5, 33, 17),
        (64, 576, 192),
        (37, 100, 70),
        (96, 64, 96),
        // Two chunks of rows (256 and 44).
        (300, 64, 40),
    ] {
        let (x, w) = (values(m * k, 1), values(n * k, 2));
        let packed = Bf16Weight::pack(&w, n, k);
        let got = packed.linear(&x, m);
        assert_eq!(got.len(), m * n);
        let round = |v: f32| f64::from(f32::from_bits(u32::from(bf16_bits(v)) << 16));
        for r in 0..m {
            for j in 0..n {
                let want: f64 = (0..k)
                    .map(|i| round(x[r * k + i]) * round(w[j * k + i]))
                    .sum();
                let err = (f64::from(got[r * n + j]) - want).abs();
                assert!(
                    err <= 1e-5 * (k as f64).sqrt(),
                    "({m},{k},{n}) [{r},{j}]: {} vs {want}",
                    got[r * n + j]
                );
            }
        }
    }
}
