//! The entropy bonus through the candle trainer (part of the `native` test binary): its value
//! joins the step's loss, and its gradient, which reaches the logits through the scores head's
//! entropy column, keeps the policy's entropy above what the same steps leave without it.

use super::*;

/// `steps` steps of [`fixed_batch`] from the same weights with the bonus `beta`: the metrics of
/// each step.
fn run(beta: f64, steps: usize) -> Vec<std::collections::BTreeMap<String, f64>> {
    let mut cfg = config(0.01, 4);
    cfg.loss.entropy_coeff = beta;
    let mut trainer = NativeTrainer::new(tiny(11), cfg, None).unwrap();
    (0..steps)
        .map(|_| trainer.train_step(&fixed_batch()).unwrap().metrics)
        .collect()
}

#[test]
fn the_entropy_bonus_joins_the_loss_and_holds_the_entropy_up() {
    let (beta, steps) = (0.5, 6);
    let plain = run(0.0, steps);
    let bonus = run(beta, steps);
    // The first step scores the same weights: its loss is lower by exactly β·H (token mean).
    let (h, loss) = (m::TRAINER_ENTROPY_NATS, m::TRAINER_LOSS_VALUE);
    assert_eq!(plain[0][h], bonus[0][h], "the same starting policy");
    let want = plain[0][loss] - beta * plain[0][h];
    assert!(
        (bonus[0][loss] - want).abs() < 1e-4,
        "loss with the bonus {} against {want}",
        bonus[0][loss]
    );
    // The policy-gradient steps sharpen the rewarded tokens; the bonus pushes back.
    let last = steps - 1;
    assert!(
        plain[last][h] < plain[0][h],
        "the plain steps lower the entropy: {} → {}",
        plain[0][h],
        plain[last][h]
    );
    assert!(
        bonus[last][h] > plain[last][h] + 1e-3,
        "with the bonus {} against {} without",
        bonus[last][h],
        plain[last][h]
    );
}
