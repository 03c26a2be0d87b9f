//! Packing properties: attention never crosses texts, every completion token is a loss target
//! exactly once with its own behaviour log-prob, version, advantage and weight; oversized texts
//! are split or rejected, never cut.

use std::collections::BTreeMap;

mod common;

use common::{OwnedText, text_views};
use proptest::prelude::*;
use sluice_trainer::batcher::{BatcherConfig, MicroBatch, TrainingText, pack};
use sluice_trainer::config::OversizedText;

fn text_tokens(i: usize, prompt_len: usize, completion_len: usize) -> OwnedText {
    // Token ids encode (text, position) so the checks can recognise every token.
    let tok = |j: usize| (i * 1000 + j) as u32;
    OwnedText {
        prompt: (0..prompt_len).map(tok).collect(),
        completion: (prompt_len..prompt_len + completion_len).map(tok).collect(),
        behaviour: (0..completion_len)
            .map(|c| -(i as f32) - c as f32 / 100.0)
            .collect(),
        versions: (0..completion_len).map(|c| (i + c) as u64 % 3).collect(),
    }
}

/// Checks one micro-batch's structure and returns, per text, the completion indices scored.
fn check_micro_batch(
    mb: &MicroBatch,
    texts: &[TrainingText<'_>],
    seen: &mut BTreeMap<usize, Vec<usize>>,
) {
    let l = mb.row_len;
    for r in 0..mb.rows {
        let row = r * l..(r + 1) * l;
        // Segment id → the single text it belongs to; segments are contiguous and positions
        // consecutive, so same-segment attention stays inside one piece of one text.
        let mut owner: BTreeMap<u32, u32> = BTreeMap::new();
        let mut last_seg = 0;
        for i in row.clone() {
            let seg = mb.segment_ids[i];
            if seg == 0 {
                assert!(
                    !mb.target_mask[i] && !mb.loss_mask[i],
                    "padding is never scored"
                );
                continue;
            }
            let text = mb.text_ids[i];
            assert_eq!(
                *owner.entry(seg).or_insert(text),
                text,
                "one segment, one text"
            );
            if seg == last_seg {
                assert_eq!(
                    mb.position_ids[i],
                    mb.position_ids[i - 1] + 1,
                    "positions run on"
                );
            } else {
                assert!(seg > last_seg, "segments are contiguous");
            }
            last_seg = seg;
            let t = &texts[text as usize];
            let j = mb.position_ids[i] as usize;
            assert_eq!(
                mb.input_ids[i],
                (text as usize * 1000 + j) as u32,
                "input is token j"
            );
            assert_eq!(
                mb.target_ids[i],
                (text as usize * 1000 + j + 1) as u32,
                "target is token j+1"
            );
            let is_completion = j + 1 >= t.prompt.len();
            assert_eq!(
                mb.loss_mask[i], is_completion,
                "loss exactly on completion targets"
            );
            if is_completion {
                let c = j + 1 - t.prompt.len();
                assert_eq!(mb.behaviour[i], t.behaviour[c]);
                assert_eq!(mb.versions[i], t.versions[c]);
                assert_eq!(mb.advantages[i], t.advantage);
                assert_eq!(mb.weights[i], t.weight);
                seen.entry(text as usize).or_default().push(c);
            }
        }
    }
}

fn lengths() -> impl Strategy<Value = Vec<(usize, usize)>> {
    prop::collection::vec((0usize..40, 0usize..40), 1..30)
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]
    #[test]
    fn packing_never_crosses_texts_and_never_drops_a_completion_token(
        lens in lengths(),
        rows in 1usize..5,
        row_len in 8usize..48,
        split in any::<bool>(),
    ) {
        let owned: Vec<OwnedText> = lens.iter().enumerate().map(|(i, &(p, c))| text_tokens(i, p, c)).collect();
        let texts = text_views(&owned);
        let config = BatcherConfig {
            rows,
            row_len,
            oversized: if split { OversizedText::Split } else { OversizedText::Reject },
            pad_id: 999_999,
            share_prompts: true,
        };
        let packing = pack(&texts, &config);
        let mut seen = BTreeMap::new();
        for mb in &packing.micro_batches {
            prop_assert!(mb.rows >= 1 && mb.rows <= rows);
            prop_assert_eq!(mb.input_ids.len(), mb.rows * row_len);
            // Only trailing padding rows are left out: the last row holds a token.
            prop_assert!(mb.segment_ids[(mb.rows - 1) * row_len..].iter().any(|&s| s != 0));
            check_micro_batch(mb, &texts, &mut seen);
        }
        let mut rejected = 0;
        for (i, t) in texts.iter().enumerate() {
            if t.completion.is_empty() {
                continue;
            }
            let slots = t.prompt.len() + t.completion.len() - 1;
            // Pieces that score at least one completion token (the others are left out).
            let pieces = (0..slots.div_ceil(row_len))
                .filter(|k| ((k + 1) * row_len).min(slots) > t.prompt.len().saturating_sub(1))
                .count();
            let must_reject = t.prompt.is_empty() || (slots > row_len && (!split || pieces > rows));
            match seen.get_mut(&i) {
                Some(cs) => {
                    prop_assert!(!must_reject);
                    cs.sort_unstable();
                    let all: Vec<usize> = (0..t.completion.len()).collect();
                    prop_assert_eq!(&*cs, &all, "every completion token exactly once");
                }
                None => {
                    prop_assert!(must_reject, "text {} was dropped", i);
                    rejected += t.completion.len();
                }
            }
        }
        prop_assert_eq!(packing.stats.rejected_tokens, rejected);
        let loss: usize = seen.values().map(Vec::len).sum();
        prop_assert_eq!(packing.stats.loss_tokens, loss);
        prop_assert!(packing.stats.efficiency() <= 1.0);
    }
}

#[test]
fn short_texts_share_rows_and_efficiency_counts_padding() {
    let owned = vec![
        text_tokens(0, 3, 3),
        text_tokens(1, 2, 2),
        text_tokens(2, 2, 1),
    ];
    let texts = text_views(&owned);
    let config = BatcherConfig {
        rows: 2,
        row_len: 8,
        oversized: OversizedText::Reject,
        pad_id: 0,
        share_prompts: true,
    };
    let packing = pack(&texts, &config);
    // Slots 5, 3, 2 → first fit decreasing: row 0 = [5, 3], row 1 = [2].
    assert_eq!(packing.micro_batches.len(), 1);
    let mb = &packing.micro_batches[0];
    assert_eq!(&mb.segment_ids[..8], &[1, 1, 1, 1, 1, 2, 2, 2]);
    assert_eq!(&mb.segment_ids[8..], &[1, 1, 0, 0, 0, 0, 0, 0]);
    assert_eq!(&mb.position_ids[..8], &[0, 1, 2, 3, 4, 0, 1, 2]);
    assert_eq!(packing.stats.used_slots, 10);
    assert!((packing.stats.efficiency() - 10.0 / 16.0).abs() < 1e-12);
    assert_eq!(packing.stats.loss_tokens, 6);
}

#[test]
fn an_oversized_text_is_split_with_running_positions_or_rejected() {
    // 4 prompt + 12 completion tokens = 15 slots; rows of 6 → pieces [0,6), [6,12), [12,15).
    let owned = vec![text_tokens(0, 4, 12)];
    let texts = text_views(&owned);
    let mut config = BatcherConfig {
        rows: 4,
        row_len: 6,
        oversized: OversizedText::Split,
        pad_id: 0,
        share_prompts: true,
    };
    let packing = pack(&texts, &config);
    assert_eq!(
        (packing.stats.split_texts, packing.stats.loss_tokens),
        (1, 12)
    );
    let mb = &packing.micro_batches[0];
    assert_eq!(&mb.position_ids[6..12], &[6, 7, 8, 9, 10, 11]);
    assert_eq!(&mb.position_ids[12..15], &[12, 13, 14]);
    // A long prompt's leading piece scores no completion token and is left out.
    let long_prompt = vec![text_tokens(0, 14, 2)];
    let lp = text_views(&long_prompt);
    let packing = pack(&lp, &config);
    assert_eq!(
        packing.stats.used_slots, 3,
        "only the piece [12, 15) is packed"
    );
    assert_eq!(packing.stats.loss_tokens, 2);
    config.oversized = OversizedText::Reject;
    let rejected = pack(&texts, &config);
    assert!(rejected.micro_batches.is_empty());
    assert_eq!(
        (
            rejected.stats.rejected_texts,
            rejected.stats.rejected_tokens
        ),
        (1, 12)
    );
}

#[test]
fn packing_is_deterministic() {
    let owned: Vec<OwnedText> = (0..20)
        .map(|i| text_tokens(i, 1 + i % 7, 1 + (i * 5) % 11))
        .collect();
    let texts = text_views(&owned);
    let config = BatcherConfig {
        rows: 3,
        row_len: 16,
        oversized: OversizedText::Split,
        pad_id: 0,
        share_prompts: true,
    };
    assert_eq!(
        pack(&texts, &config).micro_batches,
        pack(&texts, &config).micro_batches
    );
}
