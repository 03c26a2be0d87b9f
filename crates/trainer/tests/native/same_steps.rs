//! Settings that change how a step is computed and not what it computes: micro-batches
//! accumulated against one large one, recomputed activations, kept logits and shared prompts
//! take the same steps (part of the `native` test binary).

use super::*;

#[test]
fn accumulating_micro_batches_equals_one_large_micro_batch() {
    for kind in [
        LossKind::Ppo,
        LossKind::Tis,
        LossKind::DecoupledPpo,
        LossKind::Gspo,
    ] {
        let mut one = config(0.01, 8);
        one.loss.kind = kind;
        one.aggregation.mode = LossAggregation::SequenceMean;
        // Each text its own slots (a shared prompt would pack a group into one row).
        one.batcher.share_prompts = false;
        let mut many = one.clone();
        many.batcher.rows = 1;
        let mut a = NativeTrainer::new(tiny(4), one, None).unwrap();
        let mut b = NativeTrainer::new(tiny(4), many, None).unwrap();
        let (sa, _) = a.rl_step(&fixed_batch()).unwrap();
        let (sb, _) = b.rl_step(&fixed_batch()).unwrap();
        assert_eq!((sa.micro_batches, sb.micro_batches), (1, 3));
        let (ga, gb) = (sa.optim.unwrap().grad_norm, sb.optim.unwrap().grad_norm);
        assert!(
            (ga - gb).abs() <= 1e-5 * ga.max(1.0),
            "{kind:?}: grad norm {ga} vs {gb}"
        );
        for (pa, pb) in params(&a).iter().zip(params(&b)) {
            for (x, y) in pa.iter().zip(pb) {
                assert!((x - y).abs() <= 1e-5, "{kind:?}: {x} vs {y}");
            }
        }
    }
}

#[test]
fn activation_checkpointing_takes_the_same_steps() {
    // Two steps, two minibatches and a KL reference: the recomputed backward, the proximal and
    // the reference forwards all run.
    let mut plain = config(0.01, 2);
    plain.minibatches = 2;
    plain.loss.kl_coef = 0.1;
    let mut recomputed = plain.clone();
    recomputed.activation_checkpointing = true;
    let mut a = NativeTrainer::new(tiny(6), plain, None).unwrap();
    let mut b = NativeTrainer::new(tiny(6), recomputed, None).unwrap();
    for step in 0..2 {
        let (sa, _) = a.rl_step(&fixed_batch()).unwrap();
        let (sb, _) = b.rl_step(&fixed_batch()).unwrap();
        let (ga, gb) = (sa.optim.unwrap().grad_norm, sb.optim.unwrap().grad_norm);
        assert!(ga > 0.0, "step {step}: no gradient");
        assert!(
            (ga - gb).abs() <= 1e-5 * ga.max(1.0),
            "step {step}: {ga} vs {gb}"
        );
    }
    // Adam divides by √v, so rounding-level gradient differences on near-zero entries move a
    // weight by a small share of the learning rate: allow 1 % of one step of lr 0.01.
    for (pa, pb) in params(&a).iter().zip(params(&b)) {
        for (x, y) in pa.iter().zip(pb) {
            assert!((x - y).abs() <= 1e-4, "{x} vs {y}");
        }
    }
}

/// Logits kept from the forward for the backward (`trainer.kept_logits_mib`) take the steps of
/// logits formed again, to the bit: the decoupled loss's proximal forward and the KL
/// reference's keep nothing, and the update's backward reads what its forward kept.
#[test]
fn kept_logits_take_the_same_steps_to_the_bit() {
    let mut kept = decoupled_with_reference(2);
    // Chunks of 4 rows, of which each forward keeps the first.
    kept.logits_chunk_rows = 4;
    let vocab = tiny(6).config().vocab_size;
    kept.kept_logits_bytes = 4 * vocab * 4;
    let mut formed_again = kept.clone();
    formed_again.kept_logits_bytes = 0;
    let mut a = NativeTrainer::new(tiny(6), kept, None).unwrap();
    let mut b = NativeTrainer::new(tiny(6), formed_again, None).unwrap();
    // The chunks formed again by the backward passes of a trainer's step, counted on the
    // thread that runs its steps (one here).
    let formed = |t: &NativeTrainer| {
        t.compute_pool()
            .install(sluice_model::recomputed_logit_chunks)
    };
    for step in 0..2 {
        let (before_a, before_b) = (formed(&a), formed(&b));
        let (sa, _) = a.rl_step(&fixed_batch()).unwrap();
        let (sb, _) = b.rl_step(&fixed_batch()).unwrap();
        let (ga, gb) = (sa.optim.unwrap().grad_norm, sb.optim.unwrap().grad_norm);
        assert!(ga > 0.0 && ga == gb, "step {step}: {ga} vs {gb}");
        // Each micro-batch's backward forms again the chunks its forward did not keep: all but
        // the first here, all there.
        let (na, nb) = (formed(&a) - before_a, formed(&b) - before_b);
        assert!(
            0 < na && na < nb,
            "step {step}: {na} and {nb} chunks formed again"
        );
    }
    assert!(params(&a) == params(&b), "the weights differ");
}

/// A group's prompt packed once (`share_prompts`, the default) trains like every rollout packed
/// with its own copy: the same gradients and weights, over fewer slots.
#[test]
fn shared_prompts_take_the_same_steps() {
    let shared = decoupled_with_reference(2);
    let mut alone = shared.clone();
    alone.batcher.share_prompts = false;
    let mut a = NativeTrainer::new(tiny(6), shared, None).unwrap();
    let mut b = NativeTrainer::new(tiny(6), alone, None).unwrap();
    for step in 0..2 {
        let (sa, _) = a.rl_step(&fixed_batch()).unwrap();
        let (sb, _) = b.rl_step(&fixed_batch()).unwrap();
        assert_eq!(sa.trained_tokens, sb.trained_tokens);
        assert!(
            sa.processed_tokens < sb.processed_tokens,
            "step {step}: {} slots shared vs {} alone",
            sa.processed_tokens,
            sb.processed_tokens
        );
        let (ga, gb) = (sa.optim.unwrap().grad_norm, sb.optim.unwrap().grad_norm);
        assert!(ga > 0.0, "step {step}: no gradient");
        assert!(
            (ga - gb).abs() <= 1e-5 * ga.max(1.0),
            "step {step}: {ga} vs {gb}"
        );
        assert!((sa.loss.loss - sb.loss.loss).abs() <= 1e-5 * sa.loss.loss.abs().max(1.0));
    }
    for (pa, pb) in params(&a).iter().zip(params(&b)) {
        for (x, y) in pa.iter().zip(pb) {
            assert!((x - y).abs() <= 1e-4, "{x} vs {y}");
        }
    }
}
