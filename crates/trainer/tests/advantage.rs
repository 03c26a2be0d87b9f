//! Advantage modes on hand-computed groups: GRPO with and without std, RLOO, REINFORCE++ with a
//! group baseline, discounting, outcome-only, situations with and without padding,
//! zero-advantage filtering; GAE, its whitening and the critic's clipped value loss.

mod common;

use common::{close, group, single_turn_group, turn};
use sluice_core::RolloutStatus;
use sluice_trainer::advantage::{AdvantageConfig, compute_advantages, discounted, mean_std};
use sluice_trainer::config::AdvantageKind;

fn config(kind: AdvantageKind, normalize_std: bool) -> AdvantageConfig {
    AdvantageConfig {
        kind,
        normalize_std,
        ..AdvantageConfig::default()
    }
}

fn advantages(batch: &sluice_trainer::AdvantageBatch<'_>) -> Vec<f64> {
    batch.texts.iter().map(|t| f64::from(t.advantage)).collect()
}

#[test]
fn gamma_discounts_the_final_reward_back_over_the_steps() {
    let d = discounted(1.0, 3, 0.9);
    for (got, want) in d.iter().zip([0.81, 0.9, 1.0]) {
        close(*got, want, 1e-12, "gamma = 0.9");
    }
    assert_eq!(discounted(2.0, 1, 0.5), [2.0]);
    assert!(discounted(1.0, 0, 0.9).is_empty());
}

#[test]
fn group_advantage_is_reward_minus_mean_optionally_over_std() {
    let groups = [single_turn_group(1, &[1.0, 0.0, 0.0, 1.0])];
    let plain = compute_advantages(&groups, &config(AdvantageKind::Group, false));
    assert_eq!(advantages(&plain), [0.5, -0.5, -0.5, 0.5]);
    let scaled = compute_advantages(&groups, &config(AdvantageKind::Group, true));
    // mean 0.5, population std 0.5 → ±1 (up to the epsilon).
    for (a, want) in advantages(&scaled).iter().zip([1.0, -1.0, -1.0, 1.0]) {
        close(*a, want, 1e-5, "normalized");
    }
    assert_eq!(mean_std(&[1.0, 0.0, 0.0, 1.0]), (0.5, 0.5));
}

#[test]
fn rloo_compares_each_rollout_with_the_mean_of_the_others() {
    let groups = [single_turn_group(1, &[1.0, 0.0, 0.0, 1.0])];
    let plain = compute_advantages(&groups, &config(AdvantageKind::Rloo, false));
    // 1 − (0 + 0 + 1)/3 and 0 − (1 + 0 + 1)/3.
    for (a, want) in advantages(&plain)
        .iter()
        .zip([2.0 / 3.0, -2.0 / 3.0, -2.0 / 3.0, 2.0 / 3.0])
    {
        close(*a, want, 1e-6, "leave-one-out");
    }
    let scaled = compute_advantages(&groups, &config(AdvantageKind::Rloo, true));
    close(
        advantages(&scaled)[0],
        4.0 / 3.0,
        1e-5,
        "over the group std",
    );
    // A rollout alone in its group has no baseline: no signal, filtered.
    let mut lone = single_turn_group(2, &[1.0, 0.0]);
    lone.rollouts[1].status = RolloutStatus::Error("env".into());
    let lone = [lone];
    let batch = compute_advantages(&lone, &config(AdvantageKind::Rloo, false));
    assert!(batch.is_empty());
    assert_eq!(batch.groups_filtered, 1);
}

#[test]
fn reinforce_plus_plus_whitens_group_baselined_advantages_over_the_steps_tokens() {
    // Two groups; the second's replies have 1, 3, 1 and 1 completion tokens, so a token-weighted
    // mean differs from a per-text one.
    let reply = |n: usize| vec![turn(&[1, 2], &vec![7; n], -1.0, 0, None)];
    let groups = [
        single_turn_group(1, &[1.0, 0.0, 0.0, 1.0]),
        group(
            2,
            &[1.0, 0.0, 0.0, 0.0],
            vec![reply(1), reply(3), reply(1), reply(1)],
        ),
    ];
    let batch = compute_advantages(
        &groups,
        &config(AdvantageKind::ReinforcePlusPlusBaseline, false),
    );
    assert_eq!(batch.texts.len(), 8);
    let raw = [0.5, -0.5, -0.5, 0.5, 0.75, -0.25, -0.25, -0.25];
    let tokens: Vec<f64> = batch
        .texts
        .iter()
        .map(|t| t.text.completion_tokens() as f64)
        .collect();
    let total: f64 = tokens.iter().sum();
    let mean = raw.iter().zip(&tokens).map(|(a, n)| a * n).sum::<f64>() / total;
    let var = raw
        .iter()
        .zip(&tokens)
        .map(|(a, n)| n * (a - mean).powi(2))
        .sum::<f64>()
        / total;
    for (got, a) in advantages(&batch).iter().zip(raw) {
        close(*got, (a - mean) / var.sqrt(), 1e-5, "whitened");
    }
    // Over the tokens: mean 0, variance 1.
    let got = advantages(&batch);
    let m = got.iter().zip(&tokens).map(|(a, n)| a * n).sum::<f64>() / total;
    let v = got.iter().zip(&tokens).map(|(a, n)| n * a * a).sum::<f64>() / total;
    close(m, 0.0, 1e-6, "mean");
    close(v, 1.0, 1e-5, "variance");
}

#[test]
fn multi_turn_rollouts_are_discounted_and_outcome_only_keeps_the_last_turn() {
    let three = vec![
        turn(&[1], &[2], -1.0, 0, None),
        turn(&[1, 2, 3], &[4], -1.0, 0, None),
        turn(&[1, 2, 3, 4, 5], &[6], -1.0, 0, None),
    ];
    let one = vec![turn(&[1], &[9], -1.0, 0, None)];
    let groups = [group(1, &[1.0, 0.0], vec![three, one])];
    let mut c = config(AdvantageKind::Group, false);
    c.gamma = 0.9;
    let batch = compute_advantages(&groups, &c);
    let want = [0.81 * 0.5, 0.9 * 0.5, 0.5, -0.5];
    for (a, w) in advantages(&batch).iter().zip(want) {
        close(*a, w, 1e-6, "discounted group advantage");
    }
    assert_eq!(
        batch
            .texts
            .iter()
            .map(|t| (t.rollout, t.turn))
            .collect::<Vec<_>>(),
        [(0, 0), (0, 1), (0, 2), (1, 0)]
    );
    c.only_keep_outcome = true;
    let outcome = compute_advantages(&groups, &c);
    assert_eq!(
        outcome
            .texts
            .iter()
            .map(|t| (t.rollout, t.turn))
            .collect::<Vec<_>>(),
        [(0, 2), (1, 0)]
    );
    assert_eq!(advantages(&outcome), [0.5, -0.5]);
}

/// A domain with its own γ (`data.domains.<d>.gamma` or its task's discount) discounts its
/// groups by it; the other domains keep `trainer.gamma`.
#[test]
fn each_domain_is_discounted_by_its_own_gamma() {
    let two = || {
        vec![
            turn(&[1], &[2], -1.0, 0, None),
            turn(&[1, 2, 3], &[4], -1.0, 0, None),
        ]
    };
    let math = group(1, &[1.0, 0.0], vec![two(), two()]);
    let mut walk = group(2, &[1.0, 0.0], vec![two(), two()]);
    std::sync::Arc::make_mut(&mut walk.sample).domain = "walk".into();
    let mut c = config(AdvantageKind::Group, false);
    c.gamma = 0.9;
    c.domain_gamma.insert("walk".into(), 0.5);
    assert_eq!(c.gamma_for("walk"), 0.5);
    assert_eq!(c.gamma_for("math"), 0.9);
    let groups = [math, walk];
    let batch = compute_advantages(&groups, &c);
    let want = [
        0.9 * 0.5,
        0.5,
        0.9 * -0.5,
        -0.5,
        0.5 * 0.5,
        0.5,
        0.5 * -0.5,
        -0.5,
    ];
    let got = advantages(&batch);
    assert_eq!(got.len(), want.len());
    for (a, w) in got.iter().zip(want) {
        close(*a, w, 1e-6, "per-domain discount");
    }
    // Situational advantages discount by the domain's γ too.
    c.kind = AdvantageKind::Situational;
    let mut walk = group(3, &[1.0, 0.0], vec![two(), two()]);
    std::sync::Arc::make_mut(&mut walk.sample).domain = "walk".into();
    let groups = [walk];
    let batch = compute_advantages(&groups, &c);
    // Values 0.5·R then R per rollout; one bucket (no labels): mean 0.375.
    for (a, w) in advantages(&batch)
        .iter()
        .zip([0.125, 0.625, -0.375, -0.375])
    {
        close(*a, w, 1e-6, "situational per-domain discount");
    }
}

#[test]
fn zero_advantage_groups_are_filtered_and_an_all_zero_batch_is_empty() {
    let groups = [
        single_turn_group(1, &[1.0, 1.0, 1.0]),
        single_turn_group(2, &[0.0, 1.0]),
    ];
    let c = config(AdvantageKind::Group, true);
    let batch = compute_advantages(&groups, &c);
    assert_eq!((batch.groups_kept, batch.groups_filtered), (1, 1));
    assert!(batch.texts.iter().all(|t| t.group == 1));
    let only_uniform = compute_advantages(&groups[..1], &c);
    assert!(
        only_uniform.is_empty(),
        "nothing to train on: skip, publish nothing"
    );
    let keep = AdvantageConfig {
        filter_zero_advantage: false,
        ..c
    };
    let kept = compute_advantages(&groups[..1], &keep);
    assert_eq!(kept.texts.len(), 3);
    assert!(kept.texts.iter().all(|t| t.advantage == 0.0));
}

#[test]
fn failed_rollouts_and_empty_turns_take_no_part() {
    let mut g = single_turn_group(1, &[1.0, 0.0, 5.0]);
    g.rollouts[2].status = RolloutStatus::Error("env_panic".into());
    g.rollouts[0].turns.push(turn(&[1], &[], 0.0, 0, None));
    let groups = [g];
    let batch = compute_advantages(&groups, &config(AdvantageKind::Group, false));
    // The failed rollout's reward 5 is not in the baseline: mean of {1, 0}.
    assert_eq!(advantages(&batch), [0.5, -0.5]);
    assert_eq!(batch.texts.len(), 2, "the empty turn makes no text");
}

#[test]
fn situational_baseline_is_per_situation_within_the_group() {
    // Rollout 0 (reward 1): situations a, b. Rollout 1 (reward 0): a. Rollout 2 (reward 0.5): a, b.
    let turns = vec![
        vec![
            turn(&[1], &[2], -1.0, 0, Some("a")),
            turn(&[1, 2], &[3], -1.0, 0, Some("b")),
        ],
        vec![turn(&[1], &[4], -1.0, 0, Some("a"))],
        vec![
            turn(&[1], &[5], -1.0, 0, Some("a")),
            turn(&[1, 5], &[6], -1.0, 0, Some("b")),
        ],
    ];
    let groups = [group(1, &[1.0, 0.0, 0.5], turns)];
    let batch = compute_advantages(&groups, &config(AdvantageKind::Situational, false));
    let by_text: Vec<(usize, usize, f64)> = batch
        .texts
        .iter()
        .map(|t| (t.rollout, t.turn, f64::from(t.advantage)))
        .collect();
    // a: {1, 0, 0.5}, mean 0.5. b: {1, 0.5}, mean 0.75.
    assert_eq!(
        by_text,
        [
            (0, 0, 0.5),
            (0, 1, 0.25),
            (1, 0, -0.5),
            (2, 0, 0.0),
            (2, 1, -0.25)
        ]
    );
}

#[test]
fn situation_padding_holds_missing_rows_at_the_rollout_reward() {
    // Rollout 0 (reward 1) visits situation `s` twice; rollout 1 (reward 0) once; rollout 2
    // (reward 0) never (it has one text in `t`).
    let turns = vec![
        vec![
            turn(&[1], &[2], -1.0, 0, Some("s")),
            turn(&[1], &[3], -1.0, 0, Some("s")),
        ],
        vec![turn(&[1], &[4], -1.0, 0, Some("s"))],
        vec![turn(&[1], &[5], -1.0, 0, Some("t"))],
    ];
    let groups = [group(1, &[1.0, 0.0, 0.0], turns)];
    let mut c = config(AdvantageKind::Situational, false);
    let unpadded = compute_advantages(&groups, &c);
    // s: {1, 1, 0} mean 2/3; t: {0} mean 0.
    let want = [1.0 / 3.0, 1.0 / 3.0, -2.0 / 3.0, 0.0];
    for (a, w) in advantages(&unpadded).iter().zip(want) {
        close(*a, w, 1e-6, "unpadded");
    }
    c.pad_situations = true;
    let padded = compute_advantages(&groups, &c);
    // s padded to 2 rows each: {1, 1} ∪ {0, 0 (pad)} ∪ {0 (pad), 0 (pad)} → mean 1/3.
    // t padded to 1 row each: {0} ∪ {1 (pad)} ∪ {0 (pad)} → mean 1/3.
    let want = [2.0 / 3.0, 2.0 / 3.0, -1.0 / 3.0, -1.0 / 3.0];
    for (a, w) in advantages(&padded).iter().zip(want) {
        close(*a, w, 1e-6, "padded");
    }
    assert_eq!(padded.texts.len(), 4, "pad rows shape the baseline only");
}

#[test]
fn zero_signal_situations_can_be_left_out() {
    // Situation `absent` is met only by the two failed rollouts (seed 002's "gold absent"): its
    // baseline equals each text's value, so every advantage in it is zero.
    let turns = vec![
        vec![turn(&[1], &[2], -1.0, 0, Some("visible"))],
        vec![
            turn(&[1], &[3], -1.0, 0, Some("visible")),
            turn(&[1], &[4], -1.0, 0, Some("absent")),
        ],
        vec![turn(&[1], &[5], -1.0, 0, Some("absent"))],
    ];
    let groups = [group(1, &[1.0, 0.0, 0.0], turns)];
    let mut c = config(AdvantageKind::Situational, false);
    let kept = compute_advantages(&groups, &c);
    assert_eq!(kept.texts.len(), 4);
    c.drop_zero_signal_situations = true;
    let dropped = compute_advantages(&groups, &c);
    let left: Vec<(usize, usize, f64)> = dropped
        .texts
        .iter()
        .map(|t| (t.rollout, t.turn, f64::from(t.advantage)))
        .collect();
    // `visible`: {1, 0}, mean 0.5; `absent` is gone, so it no longer counts in the loss's
    // token mean.
    assert_eq!(left, [(0, 0, 0.5), (1, 0, -0.5)]);
    // A group where no situation carries signal has nothing left: it is filtered.
    let flat = [group(
        2,
        &[0.0, 0.0, 0.0],
        vec![
            vec![turn(&[1], &[2], -1.0, 0, Some("absent"))],
            vec![turn(&[1], &[3], -1.0, 0, Some("absent"))],
            vec![turn(&[1], &[4], -1.0, 0, Some("absent"))],
        ],
    )];
    let none = compute_advantages(&flat, &c);
    assert!(none.texts.is_empty());
    assert_eq!(none.groups_filtered, 1);
}

#[test]
fn without_labels_situational_equals_group() {
    let groups = [single_turn_group(1, &[0.2, 0.9, 0.4])];
    let g = compute_advantages(&groups, &config(AdvantageKind::Group, true));
    let s = compute_advantages(&groups, &config(AdvantageKind::Situational, true));
    assert_eq!(advantages(&g), advantages(&s));
}

/// Rewards near ±1e308 (finite, but their sum or squares overflow f64) and rewards whose
/// advantage is beyond f32 leave their group out of the step instead of a NaN or infinite loss
/// that stops the run (the hostile sweep's finding 7); the other groups are trained as usual.
#[test]
fn groups_whose_rewards_overflow_are_left_out_and_the_rest_trained() {
    let groups = [
        single_turn_group(1, &[1e308, 1e308, -1e308, 0.0]),
        single_turn_group(2, &[1e308, -1e308]),
        single_turn_group(3, &[1e39, 0.0]),
        single_turn_group(4, &[1.0, 0.0]),
    ];
    for kind in [AdvantageKind::Group, AdvantageKind::Situational] {
        for normalize_std in [false, true] {
            let batch = compute_advantages(&groups, &config(kind, normalize_std));
            let what = format!("{kind:?}, normalize_std {normalize_std}");
            assert!(
                batch.texts.iter().all(|t| t.advantage.is_finite()),
                "{what}"
            );
            // 1e39 vs 0 normalised is ±1; unnormalised, ±5e38 is beyond f32.
            let (kept, trained): (usize, &[usize]) = if normalize_std {
                (2, &[2, 2, 3, 3])
            } else {
                (1, &[3, 3])
            };
            assert_eq!(
                batch.texts.iter().map(|t| t.group).collect::<Vec<_>>(),
                trained,
                "{what}"
            );
            assert_eq!(
                (batch.groups_kept, batch.groups_filtered),
                (kept, 4 - kept),
                "{what}"
            );
        }
    }
}

#[test]
fn gae_with_lambda_one_is_the_return_less_the_value_and_with_zero_the_td_error() {
    use sluice_trainer::critic::gae;
    let values = [0.2f32, 0.5, -0.25];
    // λ = 1, γ = 1: every return is the reward, the advantage the reward less the value.
    let end = |r: f64| [0.0, 0.0, r];
    let (a, r) = gae(&values, &end(1.0), 1.0, 1.0);
    for t in 0..3 {
        close(r[t], 1.0, 1e-7, "return");
        close(a[t], 1.0 - f64::from(values[t]), 1e-7, "advantage");
    }
    // λ = 0: the one-step TD error, the next value bootstrapping (0 after the last token).
    let (a, r) = gae(&values, &end(1.0), 0.9, 0.0);
    let v: Vec<f64> = values.iter().map(|&v| f64::from(v)).collect();
    close(a[0], 0.9 * v[1] - v[0], 1e-7, "TD at 0");
    close(a[1], 0.9 * v[2] - v[1], 1e-7, "TD at 1");
    close(a[2], 1.0 - v[2], 1e-7, "TD at the end");
    close(r[0], 0.9 * v[1], 1e-7, "return at 0");
    // γ < 1, λ between: the recursion A_t = δ_t + γλ·A_{t+1} by hand.
    let (gamma, lambda) = (0.9, 0.5);
    let (a, _) = gae(&values, &end(2.0), gamma, lambda);
    let d2 = 2.0 - v[2];
    let d1 = gamma * v[2] - v[1];
    let d0 = gamma * v[1] - v[0];
    close(a[2], d2, 1e-7, "A2");
    close(a[1], d1 + gamma * lambda * d2, 1e-7, "A1");
    close(
        a[0],
        d0 + gamma * lambda * (d1 + gamma * lambda * d2),
        1e-7,
        "A0",
    );
    assert!(gae(&[], &[], 1.0, 1.0).0.is_empty());
    // A reward on every token (the KL penalty's) enters each δ where it falls.
    let (a, _) = gae(&values, &[-0.1, -0.2, 1.0], 1.0, 1.0);
    close(a[0], -0.1 - 0.2 + 1.0 - v[0], 1e-7, "rewards along the way");
}

#[test]
fn gae_advantages_are_whitened_over_every_token() {
    use sluice_trainer::critic::whiten;
    let mut a = vec![vec![1.0, 2.0], vec![], vec![3.0, 6.0, 8.0]];
    whiten(&mut a);
    let all: Vec<f64> = a.iter().flatten().copied().collect();
    let (mean, std) = mean_std(&all);
    close(mean, 0.0, 1e-12, "mean");
    close(std, 1.0, 1e-5, "std");
    assert!(a[1].is_empty());
    let mut equal = vec![vec![0.7, 0.7]];
    whiten(&mut equal);
    assert_eq!(equal, [[0.0, 0.0]]);
}

#[test]
fn the_value_loss_clips_a_value_that_moved_too_far_away_from_the_return() {
    use sluice_trainer::critic::{ValueTargets, value_terms};
    let targets = ValueTargets {
        returns: vec![1.0, 1.0, 1.0, 0.0],
        old_values: vec![0.0, 0.0, 0.9, 0.0],
    };
    // Token 0 moved 0.3 (inside the clip), token 1 moved 1.5 toward the return and beyond it,
    // token 2 moved 0.8 away from it, token 3 sits on its return.
    let values = [0.3f32, 1.5, 0.1, 0.0];
    let w = [0.5f32; 4];
    let t = value_terms(&values, &targets, &w, 0.5);
    // 0: ½(0.3−1)² unclipped; 1: max((1.5−1)², (0.5−1)²) equal: the plain term, gradient on;
    // 2: clipped value 0.4, (0.4−1)² > (0.1−1)²? no: 0.36 < 0.81, plain; 3: zero.
    let want_loss = 0.5 * 0.5 * (0.49 + 0.25 + 0.81 + 0.0);
    close(t.loss, want_loss, 1e-6, "loss");
    assert_eq!(t.clipped, 0);
    close(f64::from(t.coefficients[0]), 0.5 * (0.3 - 1.0), 1e-6, "c0");
    // A value that moved away from its start past the clip and the return: the clipped term
    // binds and the gradient stops.
    let far = value_terms(
        &[2.0],
        &ValueTargets {
            returns: vec![1.2],
            old_values: vec![0.0],
        },
        &[1.0],
        0.5,
    );
    // max((2 − 1.2)², (0.5 − 1.2)²) = max(0.64, 0.49): plain.
    assert_eq!(far.clipped, 0);
    let bound = value_terms(
        &[1.0],
        &ValueTargets {
            returns: vec![0.9],
            old_values: vec![0.0],
        },
        &[1.0],
        0.5,
    );
    // Clipped value 0.5: (0.5 − 0.9)² = 0.16 > (1 − 0.9)² = 0.01: the clipped term, no gradient.
    assert_eq!(bound.clipped, 1);
    assert_eq!(bound.coefficients, [0.0]);
    close(bound.loss, 0.5 * 0.16, 1e-6, "clipped loss");
    // The coefficient is the loss's derivative where it is smooth (token 1 sits on the kink).
    let eps = 1e-3f32;
    for (i, &v) in values.iter().enumerate().filter(|(i, _)| *i != 1) {
        let one = |v: f32| {
            let t = ValueTargets {
                returns: vec![targets.returns[i]],
                old_values: vec![targets.old_values[i]],
            };
            value_terms(&[v], &t, &[0.5], 0.5).loss
        };
        let numeric = (one(v + eps) - one(v - eps)) / (2.0 * f64::from(eps));
        close(f64::from(t.coefficients[i]), numeric, 1e-3, "derivative");
    }
}

#[test]
fn gae_keeps_groups_of_equal_rewards_that_the_filter_drops_elsewhere() {
    let groups = [single_turn_group(1, &[1.0, 1.0, 1.0])];
    let mut c = config(AdvantageKind::Gae, false);
    c.filter_zero_advantage = true;
    let batch = compute_advantages(&groups, &c);
    assert_eq!((batch.texts.len(), batch.groups_kept), (3, 1));
    assert!(compute_advantages(&groups, &config(AdvantageKind::Group, false)).is_empty());
}
