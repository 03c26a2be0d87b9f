//! Tests of the parent module (`fused`).

/// Within a few ulps of `exp` over f32's whole range (up to 88.72, just below `ln f32::MAX`),
/// 0 below it, infinite above, NaN kept.
#[test]
fn exp_matches_the_library_exp() {
    let mut xs: Vec<f32> = (-8800..=8872).map(|i| i as f32 / 100.0).collect();
    xs.extend([-0.0, 1e-8, -1e-8, 0.346_573_6, -0.346_573_6]);
    let mut got = xs.clone();
    super::exp_f32_slice(&mut got);
    for (&x, &y) in xs.iter().zip(&got) {
        if x < -87.3 {
            assert_eq!(y, 0.0, "exp({x})");
            continue;
        }
        let want = f64::from(x).exp();
        let rel = ((f64::from(y) - want) / want).abs();
        assert!(
            rel < 4e-7,
            "exp({x}) = {y}, want {want} (relative error {rel:e})"
        );
    }
    let mut odd = [f32::NAN, f32::NEG_INFINITY, 88.8, 1e30, f32::INFINITY];
    super::exp_f32_slice(&mut odd);
    assert!(odd[0].is_nan());
    assert_eq!(odd[1..], [0.0, f32::INFINITY, f32::INFINITY, f32::INFINITY]);
}
