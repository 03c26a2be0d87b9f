//! Each loss on hand-computed tokens (clipping on both sides, truncation and masking, token and
//! sequence level, KL), aggregation weights, and the surrogate's gradient against finite
//! differences of the loss through a small candle policy.

mod common;

use candle_core::{D, DType, Device, Tensor, Var};
use common::close;
use sluice_trainer::config::{LossAggregation, LossKind, TisLevel, TisMode};
use sluice_trainer::loss::{LossConfig, TextTokens, TokenInputs, aggregation_weights, token_terms};

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
    let tm = aggregation_weights(&texts, LossAggregation::TokenMean);
    assert_all_close(&tm, &[1.0 / 6.0, 1.0 / 6.0, 1.0 / 6.0, 0.0], "token mean");
    let sm = aggregation_weights(&texts, LossAggregation::SequenceMean);
    assert_all_close(
        &sm,
        &[1.0 / 3.0, 1.0 / 9.0, 1.0 / 6.0, 0.0],
        "sequence mean",
    );
    let rn = aggregation_weights(&texts, LossAggregation::RolloutNormalized);
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

/// Back-propagating `Σ c_t lp_t` gives the finite-difference gradient of the loss value.
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
    let lp0 = lp_of(&init);
    // Behaviour/proximal log-probs near the current ones, away from clip boundaries.
    let behaviour: Vec<f32> = lp0
        .iter()
        .zip([0.05, -0.4, 0.6, -0.02])
        .map(|(l, d)| l + d)
        .collect();
    let reference: Vec<f32> = lp0.iter().map(|l| l - 0.3).collect();
    let prox: Vec<f32> = lp0
        .iter()
        .zip([0.1, -0.1, 0.02, 0.3])
        .map(|(l, d)| l + d)
        .collect();
    let adv = [1.0f32, 0.5, -0.8, -1.2];
    let weights = [0.25f32, 0.25, 0.1, 0.4];
    let seq = [0u32, 0, 1, 1];
    let configs = [
        LossConfig {
            kl_coef: 0.3,
            ..LossConfig::default()
        },
        LossConfig {
            kind: LossKind::DecoupledPpo,
            kl_coef: 0.1,
            ..LossConfig::default()
        },
    ];
    for config in configs {
        let loss_at = |flat: &[f32]| -> f64 {
            let lp = lp_of(flat);
            let mut i = inputs(&lp, &behaviour, &adv, &weights, &seq);
            i.reference = Some(&reference);
            i.proximal = Some(&prox);
            token_terms(&i, &config).unwrap().stats.loss
        };
        let var = Var::from_tensor(&Tensor::from_slice(&init, (t, v), &dev).unwrap()).unwrap();
        let lp = token_logprobs(var.as_tensor(), &targets);
        let mut i = inputs(&lp0, &behaviour, &adv, &weights, &seq);
        i.reference = Some(&reference);
        i.proximal = Some(&prox);
        let terms = token_terms(&i, &config).unwrap();
        assert!(
            terms.stats.clipped_low + terms.stats.clipped_high > 0,
            "exercise a clip"
        );
        let c = Tensor::new(terms.coefficients.as_slice(), &dev).unwrap();
        let surrogate = (lp * c).unwrap().sum_all().unwrap();
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
                &format!("{:?} d/dlogit[{k}]", config.kind),
            );
        }
    }
}
