//! A prompt packed once and continued by several completions (`PackedBatch::prefix_ids`) scores
//! every completion token as the same texts packed one by one: the same log-probs and entropies,
//! and the same gradient of any loss over them, with the fused kernels and with the composition,
//! for every architecture.

mod common;

use candle_core::{DType, Tensor};
use common::{ALL_ARCHS, rel_err, snapshot, tiny_config};
use sluice_model::ops::Kernels;
use sluice_model::{ForwardOptions, PackedBatch, TrainableModel};

const PROMPT: [u32; 5] = [3, 7, 1, 9, 12];
const COMPLETIONS: [&[u32]; 3] = [&[4, 4, 20], &[8, 2, 5, 6], &[11]];
/// An unrelated text packed after the shared block in the same row.
const OTHER: [u32; 4] = [2, 17, 6, 6];

fn text(c: &[u32]) -> Vec<u32> {
    PROMPT.iter().chain(c).copied().collect()
}

const L: usize = 32;

/// Every text on its own: row 0 holds the three prompt+completion texts and the other one, row 1
/// the other one again.
fn unshared() -> PackedBatch {
    let texts: Vec<Vec<u32>> = COMPLETIONS.iter().map(|c| text(c)).collect();
    let mut row0: Vec<&[u32]> = texts.iter().map(Vec::as_slice).collect();
    row0.push(&OTHER);
    PackedBatch::from_rows(&[row0, vec![&OTHER[..]]], L, 0).unwrap()
}

/// The prompt's first four slots once (segment 1), then per completion a segment that starts
/// with the prompt's last token (which scores the completion's first token) and sees segment 1;
/// the other text after them in the same row, on its own.
fn shared() -> PackedBatch {
    let mut b = PackedBatch::from_rows(&[vec![], vec![]], L, 0).unwrap();
    // Writes the slots of `tokens` (each scoring the next) from slot `at` on.
    let put =
        |b: &mut PackedBatch, at: &mut usize, tokens: &[u32], pos: usize, seg: u32, prefix: u32| {
            for (k, pair) in tokens.windows(2).enumerate() {
                b.input_ids[*at] = pair[0];
                b.target_ids[*at] = pair[1];
                b.target_mask[*at] = true;
                b.position_ids[*at] = (pos + k) as u32;
                b.segment_ids[*at] = seg;
                b.prefix_ids[*at] = prefix;
                *at += 1;
            }
        };
    let p = PROMPT.len();
    let mut at = 0;
    put(&mut b, &mut at, &PROMPT, 0, 1, 0);
    for (i, c) in COMPLETIONS.iter().enumerate() {
        put(&mut b, &mut at, &text(c)[p - 1..], p - 1, i as u32 + 2, 1);
    }
    put(&mut b, &mut at, &OTHER, 0, 5, 0);
    let mut at = L;
    put(&mut b, &mut at, &OTHER, 0, 1, 0);
    b
}

/// The slots whose target is not a prompt token (completion tokens and the other text's),
/// keyed by (target, position, row), distinct here, so the two packings can be compared.
fn scored(b: &PackedBatch) -> Vec<((u32, u32, u32), usize)> {
    let prompt_target = |i: usize| {
        let j = b.position_ids[i] as usize;
        j + 1 < PROMPT.len() && b.target_ids[i] == PROMPT[j + 1]
    };
    let mut out: Vec<((u32, u32, u32), usize)> = (0..b.batch * b.seq_len)
        .filter(|&i| b.target_mask[i] && !prompt_target(i))
        .map(|i| {
            (
                (b.target_ids[i], b.position_ids[i], (i / b.seq_len) as u32),
                i,
            )
        })
        .collect();
    out.sort();
    out
}

fn at(t: &Tensor, slots: &[usize]) -> Vec<f32> {
    let v: Vec<f32> = t.flatten_all().unwrap().to_vec1().unwrap();
    slots.iter().map(|&i| v[i]).collect()
}

#[test]
fn a_shared_prompt_scores_and_trains_like_the_texts_packed_alone() {
    let (alone, together) = (unshared(), shared());
    together.validate(23).unwrap();
    let (ka, kb) = (scored(&alone), scored(&together));
    let keys = |k: &[((u32, u32, u32), usize)]| k.iter().map(|(k, _)| *k).collect::<Vec<_>>();
    assert_eq!(keys(&ka), keys(&kb), "the same targets are scored");
    let (sa, sb): (Vec<usize>, Vec<usize>) = (
        ka.iter().map(|(_, i)| *i).collect(),
        kb.iter().map(|(_, i)| *i).collect(),
    );
    let used = |b: &PackedBatch| b.segment_ids.iter().filter(|&&s| s != 0).count();
    assert!(used(&together) < used(&alone), "the prompt is packed once");
    let options = ForwardOptions {
        logits_chunk_rows: 5,
        temperature: 0.9,
        ..ForwardOptions::default()
    };
    for arch in ALL_ARCHS {
        for kernels in [Kernels::Custom, Kernels::Differentiable] {
            let snap = snapshot(tiny_config(arch, true), 5, DType::F32);
            let mut model = TrainableModel::from_snapshot(&snap, DType::F32).unwrap();
            model.set_kernels(kernels).unwrap();
            let a = model.token_scores(&alone, options).unwrap();
            let b = model.token_scores(&together, options).unwrap();
            let (la, lb) = (at(&a.logprobs, &sa), at(&b.logprobs, &sb));
            let (ea, eb) = (at(&a.entropy, &sa), at(&b.entropy, &sb));
            for (x, y) in la.iter().zip(&lb).chain(ea.iter().zip(&eb)) {
                assert!(
                    (x - y).abs() < 1e-5,
                    "{arch:?} {kernels:?}: {la:?} vs {lb:?}"
                );
            }
            // A loss over the scored slots only, weighted per slot.
            let loss = |s: &sluice_model::TokenScores, slots: &[usize]| {
                let n = s.logprobs.elem_count();
                let mut w = vec![0f32; n];
                for (k, &i) in slots.iter().enumerate() {
                    w[i] = 1.0 + k as f32 / 10.0;
                }
                let w = Tensor::from_vec(w, s.logprobs.shape(), s.logprobs.device()).unwrap();
                let lp = (&s.logprobs * &w).unwrap().sum_all().unwrap();
                let ent = (&s.entropy * &w).unwrap().sum_all().unwrap();
                (lp + (ent * 0.3).unwrap()).unwrap()
            };
            let ga = loss(&a, &sa).backward().unwrap();
            let gb = loss(&b, &sb).backward().unwrap();
            for (name, var) in model.vars() {
                let err = rel_err(
                    ga.get(var.as_tensor()).unwrap(),
                    gb.get(var.as_tensor()).unwrap(),
                );
                assert!(err < 1e-4, "{arch:?} {kernels:?} {name}: {err:e}");
            }
        }
    }
}
