//! Each loss on hand-computed tokens (clipping on both sides, the dual clip, truncation and
//! masking, token and sequence level, GSPO's ratio per text, KL, the entropy bonus), aggregation
//! weights, and the surrogate's gradient against finite differences of the loss through a small candle policy.

mod common;

use candle_core::{D, DType, Device, Tensor, Var};
use common::close;
use sluice_trainer::config::{KlEstimator, LossAggregation, LossKind, TisLevel, TisMode};
use sluice_trainer::loss::{
    Aggregation, LossConfig, TextTokens, TokenInputs, aggregation_weights, token_terms,
};

fn ln(x: f32) -> f32 {
    x.ln()
}

fn inputs<'a>(
    lp: &'a [f32],
    b: &'a [f32],
    a: &'a [f32],
    w: &'a [f32],
    s: &'a [u32],
) -> TokenInputs<'a> {
    TokenInputs {
        logprobs: lp,
        behaviour: b,
        proximal: None,
        advantages: a,
        weights: w,
        sequence: s,
        reference: None,
        entropy: None,
    }
}

fn assert_all_close(got: &[f32], want: &[f64], what: &str) {
    assert_eq!(got.len(), want.len(), "{what}");
    for (g, w) in got.iter().zip(want) {
        close(f64::from(*g), *w, 1e-5, what);
    }
}

#[test]
fn ppo_clips_on_both_sides_only_where_the_clip_binds() {
    // Ratios 1, 1.5, 0.5, 1.5, 0.5 with advantages +1, +1, −1, −1, +1.
    let lp = [
        -1.0,
        -1.0 + ln(1.5),
        -1.0 + ln(0.5),
        -1.0 + ln(1.5),
        -1.0 + ln(0.5),
    ];
    let b = [-1.0; 5];
    let a = [1.0, 1.0, -1.0, -1.0, 1.0];
    let w = [1.0; 5];
    let s = [0; 5];
    let terms = token_terms(&inputs(&lp, &b, &a, &w, &s), &LossConfig::default()).unwrap();
    // ℓ = −min(rA, clip(r)A): −1, −1.2 (high clip), 0.8 (low clip), 1.5, −0.5.
    close(terms.stats.loss, -1.0 - 1.2 + 0.8 + 1.5 - 0.5, 1e-5, "loss");
    assert_all_close(
        &terms.coefficients,
        &[-1.0, 0.0, 0.0, 1.5, -0.5],
        "coefficients",
    );
    assert_eq!((terms.stats.clipped_low, terms.stats.clipped_high), (1, 1));
    let summary = terms.stats.summary();
    close(summary.clip_low_fraction, 0.2, 1e-12, "low fraction");
    close(summary.is_max, 1.5, 1e-5, "max weight");
    close(
        summary.is_mean,
        (1.0 + 1.5 + 0.5 + 1.5 + 0.5) / 5.0,
        1e-5,
        "mean weight",
    );
    let ess = 25.0 / (5.0 * (1.0 + 2.25 + 0.25 + 2.25 + 0.25));
    close(summary.ess_fraction, ess, 1e-5, "ess");
    // Weights scale both the value and the coefficients.
    let w2 = [0.5; 5];
    let half = token_terms(&inputs(&lp, &b, &a, &w2, &s), &LossConfig::default()).unwrap();
    close(half.stats.loss, terms.stats.loss / 2.0, 1e-6, "weighted");
    // Asymmetric clip: a wider upper range lets ratio 1.5 through.
    let wide = LossConfig {
        clip_high: 0.6,
        ..LossConfig::default()
    };
    let t = token_terms(&inputs(&lp, &b, &a, &w, &s), &wide).unwrap();
    assert_eq!(t.stats.clipped_high, 0);
    close(f64::from(t.coefficients[1]), -1.5, 1e-5, "unclipped high");
}

#[test]
fn tis_truncates_or_masks_per_token() {
    let lp = [-1.0, -1.0 + ln(3.0), -1.0 + ln(0.5)];
    let b = [-1.0; 3];
    let a = [1.0, 1.0, -2.0];
    let w = [1.0; 3];
    let s = [0, 1, 2];
    let mut c = LossConfig {
        kind: LossKind::Tis,
        ..LossConfig::default()
    };
    let t = token_terms(&inputs(&lp, &b, &a, &w, &s), &c).unwrap();
    assert_all_close(&t.coefficients, &[-1.0, -2.0, 1.0], "truncate");
    close(t.stats.loss, -1.0 - 2.0 + 1.0, 1e-5, "truncate loss");
    assert_eq!(t.stats.over_cap, 1);
    c.tis_mode = TisMode::Mask;
    let m = token_terms(&inputs(&lp, &b, &a, &w, &s), &c).unwrap();
    assert_all_close(&m.coefficients, &[-1.0, 0.0, 1.0], "mask");
}

#[test]
fn tis_at_sequence_level_uses_one_weight_per_text() {
    // Text 0: ratios 2 and 2 → 4, capped at 2. Text 1: ratios 0.5 and 1 → 0.5.
    let lp = [ln(2.0), ln(2.0), ln(0.5), 0.0];
    let b = [0.0; 4];
    let a = [1.0, 1.0, 1.0, -1.0];
    let w = [1.0; 4];
    let s = [0, 0, 1, 1];
    let mut c = LossConfig {
        kind: LossKind::Tis,
        tis_level: TisLevel::Sequence,
        ..LossConfig::default()
    };
    let t = token_terms(&inputs(&lp, &b, &a, &w, &s), &c).unwrap();
    assert_all_close(
        &t.coefficients,
        &[-2.0, -2.0, -0.5, 0.5],
        "sequence truncate",
    );
    assert_eq!(t.stats.over_cap, 2, "both tokens of the capped text");
    c.tis_mode = TisMode::Mask;
    let m = token_terms(&inputs(&lp, &b, &a, &w, &s), &c).unwrap();
    assert_all_close(&m.coefficients, &[0.0, 0.0, -0.5, 0.5], "sequence mask");
    // Token level would weight them 2, 2, 0.5, 1.
    c.tis_level = TisLevel::Token;
    c.tis_mode = TisMode::Truncate;
    let tok = token_terms(&inputs(&lp, &b, &a, &w, &s), &c).unwrap();
    assert_all_close(&tok.coefficients, &[-2.0, -2.0, -0.5, 1.0], "token level");
}

#[test]
fn decoupled_ppo_clips_against_the_proximal_policy_and_caps_the_behaviour_weight() {
    // Token 0: π_prox/π_behav = 3 → 2 (cap); π_θ/π_prox = 1.5 with A = +1 → clipped at 1.2.
    // Token 1: π_prox/π_behav = 0.5; π_θ = π_prox, A = −1 → ℓ = 0.5, coefficient 0.5.
    let b = [-2.0, -2.0];
    let prox = [-2.0 + ln(3.0), -2.0 + ln(0.5)];
    let lp = [prox[0] + ln(1.5), prox[1]];
    let a = [1.0, -1.0];
    let w = [1.0; 2];
    let s = [0, 1];
    let c = LossConfig {
        kind: LossKind::DecoupledPpo,
        ..LossConfig::default()
    };
    let mut i = inputs(&lp, &b, &a, &w, &s);
    i.proximal = Some(&prox);
    let t = token_terms(&i, &c).unwrap();
    close(t.stats.loss, 2.0 * -1.2 + 0.5, 1e-5, "loss");
    assert_all_close(&t.coefficients, &[0.0, 0.5], "coefficients");
    assert_eq!((t.stats.clipped_high, t.stats.over_cap), (1, 1));
    close(
        t.stats.is_max,
        3.0,
        1e-5,
        "behaviour weight statistics use π_prox/π_behav",
    );
    // Without explicit proximal log-probs the current ones are used: ratio 1, nothing clipped.
    let j = inputs(&lp, &b, &a, &w, &s);
    let t = token_terms(&j, &c).unwrap();
    assert_eq!(t.stats.clipped_high + t.stats.clipped_low, 0);
    // Behaviour weights exp(lp − b) = 4.5 → 2 and 0.5.
    assert_all_close(&t.coefficients, &[-2.0, 0.5], "prox = current");
}

#[test]
fn kl_penalty_adds_k3_and_its_gradient() {
    let lp = [-1.0f32];
    let reference = [-1.0 + ln(2.0)];
    let c = LossConfig {
        kl_coef: 0.1,
        ..LossConfig::default()
    };
    let mut i = inputs(&lp, &lp, &[0.0], &[1.0], &[0]);
    i.reference = Some(&reference);
    i.entropy = Some(&[0.7]);
    let t = token_terms(&i, &c).unwrap();
    let kl = 2.0 - 2f64.ln() - 1.0;
    close(t.stats.loss, 0.1 * kl, 1e-6, "loss");
    close(
        f64::from(t.coefficients[0]),
        0.1 * (1.0 - 2.0),
        1e-6,
        "coefficient",
    );
    let s = t.stats.summary();
    close(s.kl, kl, 1e-6, "kl metric");
    close(s.entropy, 0.7, 1e-6, "entropy metric");
    // k1 = lp − ref, gradient 1; k2 = (lp − ref)²/2, gradient lp − ref; the reported KL stays k3.
    let gap = -f64::from(2f32.ln());
    for (estimator, value, gradient) in [
        (KlEstimator::K1, gap, 1.0),
        (KlEstimator::K2, 0.5 * gap * gap, gap),
    ] {
        let c = LossConfig {
            kl_estimator: estimator,
            ..c.clone()
        };
        let t = token_terms(&i, &c).unwrap();
        close(t.stats.loss, 0.1 * value, 1e-6, "loss");
        close(
            f64::from(t.coefficients[0]),
            0.1 * gradient,
            1e-6,
            "coefficient",
        );
        close(t.stats.summary().kl, kl, 1e-6, "kl metric");
    }
}

#[test]
fn the_entropy_bonus_lowers_the_loss_by_its_weighted_entropy() {
    let (lp, adv, w) = ([-1.0f32, -2.0], [1.0f32, 1.0], [0.25f32, 0.75]);
    let entropy = [0.5f32, 2.0];
    let mut i = inputs(&lp, &lp, &adv, &w, &[0, 1]);
    i.entropy = Some(&entropy);
    let plain = token_terms(&i, &LossConfig::default()).unwrap();
    assert!(plain.entropy_coefficients.is_empty());
    let c = LossConfig {
        entropy_coeff: 0.1,
        ..LossConfig::default()
    };
    let t = token_terms(&i, &c).unwrap();
    close(
        t.stats.loss,
        plain.stats.loss - 0.1 * (0.25 * 0.5 + 0.75 * 2.0),
        1e-6,
        "loss",
    );
    assert_eq!(t.coefficients, plain.coefficients, "the log-prob terms");
    assert_all_close(&t.entropy_coefficients, &[-0.025, -0.075], "entropy terms");
    // Without entropies the bonus has nothing to work on: refused, not silently dropped.
    i.entropy = None;
    let e = token_terms(&i, &c).unwrap_err();
    assert_eq!((e.what, e.len, e.expected), ("entropy", 0, 2));
}

#[test]
fn mismatched_inputs_are_refused() {
    let e = token_terms(
        &inputs(&[0.0, 0.0], &[0.0], &[0.0; 2], &[1.0; 2], &[0; 2]),
        &LossConfig::default(),
    )
    .unwrap_err();
    assert_eq!((e.what, e.len, e.expected), ("behaviour", 1, 2));
}

#[test]
fn aggregation_weights_count_tokens_texts_or_rollouts_once() {
    let texts = [
        TextTokens {
            group: 0,
            rollout: 0,
            tokens: 1,
        },
        TextTokens {
            group: 0,
            rollout: 0,
            tokens: 3,
        },
        TextTokens {
            group: 0,
            rollout: 1,
            tokens: 2,
        },
        TextTokens {
            group: 1,
            rollout: 0,
            tokens: 0,
        },
    ];
    let of = |mode| aggregation_weights(&texts, Aggregation::new(mode, 4));
    let tm = of(LossAggregation::TokenMean);
    assert_all_close(&tm, &[1.0 / 6.0, 1.0 / 6.0, 1.0 / 6.0, 0.0], "token mean");
    let sm = of(LossAggregation::SequenceMean);
    assert_all_close(
        &sm,
        &[1.0 / 3.0, 1.0 / 9.0, 1.0 / 6.0, 0.0],
        "sequence mean",
    );
    let rn = of(LossAggregation::RolloutNormalized);
    assert_all_close(
        &rn,
        &[1.0 / 8.0, 1.0 / 8.0, 1.0 / 4.0, 0.0],
        "rollout normalized",
    );
    // Every scheme's weights sum to 1 over the tokens.
    for w in [&tm, &sm, &rn] {
        let total: f32 = w.iter().zip(&texts).map(|(w, t)| w * t.tokens as f32).sum();
        close(f64::from(total), 1.0, 1e-6, "weights sum to one");
    }
    // Dr. GRPO: each of the three texts' token sums over the constant 4, whatever its length.
    let ts = of(LossAggregation::TokenSumNormalized);
    assert_all_close(
        &ts,
        &[1.0 / 12.0, 1.0 / 12.0, 1.0 / 12.0, 0.0],
        "token sum normalized",
    );
}

#[test]
fn dual_clip_bounds_a_negative_advantage_far_above_the_ratio_c() {
    // Ratios 4, 2 and 4 with advantages −1, −1, +1; c = 3.
    let lp = [-1.0 + ln(4.0), -1.0 + ln(2.0), -1.0 + ln(4.0)];
    let b = [-1.0; 3];
    let a = [-1.0, -1.0, 1.0];
    let w = [1.0; 3];
    let s = [0, 1, 2];
    let config = LossConfig {
        dual_clip: 3.0,
        ..LossConfig::default()
    };
    let terms = token_terms(&inputs(&lp, &b, &a, &w, &s), &config).unwrap();
    // ℓ: min(4, 3) = 3 (dual clip, no gradient); 2 (below c: −r·A); −1.2 (high clip).
    close(terms.stats.loss, 3.0 + 2.0 - 1.2, 1e-5, "loss");
    assert_all_close(&terms.coefficients, &[0.0, 2.0, 0.0], "coefficients");
    assert_eq!(
        (
            terms.stats.dual_clipped,
            terms.stats.clipped_high,
            terms.stats.clipped_low
        ),
        (1, 1, 0)
    );
    close(
        terms.stats.summary().dual_clip_fraction,
        1.0 / 3.0,
        1e-9,
        "fraction",
    );
    // Off by default: the first token's term is PPO's 4, pushing down with −r·A = 4.
    let plain = token_terms(&inputs(&lp, &b, &a, &w, &s), &LossConfig::default()).unwrap();
    assert_all_close(&plain.coefficients, &[4.0, 2.0, 0.0], "without dual clip");
    assert_eq!(plain.stats.dual_clipped, 0);
}

#[test]
fn gspo_clips_each_text_on_the_geometric_mean_of_its_ratios() {
    // Text 0: log-ratios 0.1, −0.1, 0.3 (mean 0.1, s = e^0.1), advantage +1: clipped at 1 + 4e-4.
    // Text 1: log-ratios 2e-4 and 0 (s = e^1e-4, inside the range), advantage −1: unclipped.
    let b = [-1.0f32; 5];
    let lp = [-0.9f32, -1.1, -0.7, -1.0 + 2e-4, -1.0];
    let a = [1.0, 1.0, 1.0, -1.0, -1.0];
    let w = [0.1f32, 0.1, 0.1, 0.35, 0.35];
    let s = [0, 0, 0, 1, 1];
    let config = LossConfig {
        kind: LossKind::Gspo,
        clip_low: 3e-4,
        clip_high: 4e-4,
        ..LossConfig::default()
    };
    let terms = token_terms(&inputs(&lp, &b, &a, &w, &s), &config).unwrap();
    let s1 = f64::from(1e-4f32).exp();
    close(
        terms.stats.loss,
        0.3 * -(1.0 + 4e-4) + 0.7 * s1,
        1e-6,
        "loss",
    );
    // GSPO-token's gradient: −s·A per token where unclipped, one value for the whole text.
    assert_all_close(
        &terms.coefficients,
        &[0.0, 0.0, 0.0, 0.35 * s1, 0.35 * s1],
        "coefficients",
    );
    assert_eq!((terms.stats.clipped_high, terms.stats.clipped_low), (3, 0));
    // PPO on the same tokens clips token by token: the second token (ratio e^−0.1) is not.
    let ppo = token_terms(
        &inputs(&lp, &b, &a, &w, &s),
        &LossConfig {
            kind: LossKind::Ppo,
            ..config
        },
    )
    .unwrap();
    assert!(ppo.coefficients[1] < 0.0, "{:?}", ppo.coefficients);
}

/// `log_softmax(logits)[t, y_t]` for a `(T, V)` variable, built from differentiable ops.
fn token_logprobs(logits: &Tensor, targets: &Tensor) -> Tensor {
    let max = logits.max_keepdim(D::Minus1).unwrap();
    let shifted = logits.broadcast_sub(&max).unwrap();
    let lse = shifted
        .exp()
        .unwrap()
        .sum_keepdim(D::Minus1)
        .unwrap()
        .log()
        .unwrap();
    let logp = shifted.broadcast_sub(&lse).unwrap();
    logp.gather(targets, 1).unwrap().squeeze(1).unwrap()
}

/// `−Σ p log p` of each row of `softmax(logits)`, built from differentiable ops.
fn token_entropy(logits: &Tensor) -> Tensor {
    let max = logits.max_keepdim(D::Minus1).unwrap();
    let shifted = logits.broadcast_sub(&max).unwrap();
    let e = shifted.exp().unwrap();
    let sum = e.sum_keepdim(D::Minus1).unwrap();
    let p = e.broadcast_div(&sum).unwrap();
    let logp = shifted.broadcast_sub(&sum.log().unwrap()).unwrap();
    (p * logp).unwrap().sum(D::Minus1).unwrap().neg().unwrap()
}

/// Back-propagating `Σ c_t lp_t + Σ e_t H_t` gives the finite-difference gradient of the loss
/// value.
#[test]
fn surrogate_gradient_matches_finite_differences_of_the_loss() {
    let dev = Device::Cpu;
    let (t, v) = (4usize, 5usize);
    let init: Vec<f32> = (0..t * v)
        .map(|i| ((i * 7 % 11) as f32 - 5.0) * 0.3)
        .collect();
    let targets = Tensor::new(&[[1u32], [3], [0], [4]], &dev).unwrap();
    let lp_of = |flat: &[f32]| -> Vec<f32> {
        let x = Tensor::from_slice(flat, (t, v), &dev).unwrap();
        token_logprobs(&x, &targets).to_vec1().unwrap()
    };
    let entropy_of = |flat: &[f32]| -> Vec<f32> {
        let x = Tensor::from_slice(flat, (t, v), &dev).unwrap();
        token_entropy(&x).to_vec1().unwrap()
    };
    let lp0 = lp_of(&init);
    let entropy0 = entropy_of(&init);
    // Behaviour/proximal log-probs near the current ones, away from clip boundaries.
    // The last token's ratio, e^1, is over the dual clip's bound below.
    let behaviour: Vec<f32> = lp0
        .iter()
        .zip([0.05, -0.4, 0.6, -1.0])
        .map(|(l, d)| l + d)
        .collect();
    let reference: Vec<f32> = lp0.iter().map(|l| l - 0.3).collect();
    let prox: Vec<f32> = lp0
        .iter()
        .zip([0.1, -0.1, 0.02, 0.3])
        .map(|(l, d)| l + d)
        .collect();
    let per_token = ([1.0f32, 0.5, -0.8, -1.2], [0.25f32, 0.25, 0.1, 0.4]);
    // GSPO's gradient is exact when a text's tokens share their advantage and weight, as the
    // trainer gives them.
    let per_text = ([1.0f32, 1.0, -0.8, -0.8], [0.3f32, 0.3, 0.2, 0.2]);
    let seq = [0u32, 0, 1, 1];
    let cases = [
        (
            LossConfig {
                kl_coef: 0.3,
                ..LossConfig::default()
            },
            per_token,
        ),
        (
            LossConfig {
                kl_coef: 0.1,
                dual_clip: 2.0,
                kl_estimator: KlEstimator::K2,
                entropy_coeff: 0.05,
                ..LossConfig::default()
            },
            per_token,
        ),
        (
            LossConfig {
                kl_coef: 0.2,
                kl_estimator: KlEstimator::K1,
                ..LossConfig::default()
            },
            per_token,
        ),
        (
            LossConfig {
                kind: LossKind::DecoupledPpo,
                kl_coef: 0.1,
                ..LossConfig::default()
            },
            per_token,
        ),
        (
            LossConfig {
                kind: LossKind::Gspo,
                clip_low: 3e-4,
                clip_high: 4e-4,
                kl_coef: 0.1,
                entropy_coeff: 0.2,
                ..LossConfig::default()
            },
            per_text,
        ),
    ];
    for (config, (adv, weights)) in cases {
        let loss_at = |flat: &[f32]| -> f64 {
            let (lp, entropy) = (lp_of(flat), entropy_of(flat));
            let mut i = inputs(&lp, &behaviour, &adv, &weights, &seq);
            i.reference = Some(&reference);
            i.proximal = Some(&prox);
            i.entropy = Some(&entropy);
            token_terms(&i, &config).unwrap().stats.loss
        };
        let var = Var::from_tensor(&Tensor::from_slice(&init, (t, v), &dev).unwrap()).unwrap();
        let lp = token_logprobs(var.as_tensor(), &targets);
        let mut i = inputs(&lp0, &behaviour, &adv, &weights, &seq);
        i.reference = Some(&reference);
        i.proximal = Some(&prox);
        i.entropy = Some(&entropy0);
        let terms = token_terms(&i, &config).unwrap();
        assert_eq!(
            terms.entropy_coefficients.is_empty(),
            config.entropy_coeff == 0.0,
            "the bonus's coefficients come with the bonus"
        );
        assert!(
            terms.stats.clipped_low + terms.stats.clipped_high > 0,
            "exercise a clip"
        );
        assert_eq!(
            terms.stats.dual_clipped > 0,
            config.dual_clip > 0.0,
            "exercise the dual clip"
        );
        let c = Tensor::new(terms.coefficients.as_slice(), &dev).unwrap();
        let mut surrogate = (lp * c).unwrap().sum_all().unwrap();
        if !terms.entropy_coefficients.is_empty() {
            let e = Tensor::new(terms.entropy_coefficients.as_slice(), &dev).unwrap();
            let bonus = (token_entropy(var.as_tensor()) * e)
                .unwrap()
                .sum_all()
                .unwrap();
            surrogate = (surrogate + bonus).unwrap();
        }
        let grads = surrogate.backward().unwrap();
        let g: Vec<f32> = grads
            .get(&var)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_dtype(DType::F32)
            .unwrap()
            .to_vec1()
            .unwrap();
        let h = 1e-2f32;
        for k in 0..t * v {
            let (mut up, mut down) = (init.clone(), init.clone());
            up[k] += h;
            down[k] -= h;
            let fd = (loss_at(&up) - loss_at(&down)) / f64::from(2.0 * h);
            close(
                f64::from(g[k]),
                fd,
                2e-3,
                &format!("{config:?} d/dlogit[{k}]"),
            );
        }
    }
}
