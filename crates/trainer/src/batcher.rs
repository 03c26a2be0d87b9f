//! The packing batcher: training texts (one per model turn: prompt + completion) packed into
//! fixed `(B, L)` micro-batches.
//!
//! A text of `n` tokens occupies `n − 1` slots: slot `j` holds input token `j` and scores target
//! token `j + 1`, and the loss mask is on exactly the slots whose target is a completion token.
//! Every packed piece gets its own segment id in its row and position ids counted from its place
//! in the text, so attention (same segment, causal) never crosses texts. Behaviour log-probs,
//! token versions, advantages and aggregation weights travel with each target.
//!
//! A text needing more than `L` slots is, per `trainer.oversized_text`, either rejected (counted,
//! with a warning) or split into row-sized pieces; a later piece then sees only its own tokens as
//! context, and pieces holding no completion token are left out. Never is a completion silently
//! cut. All pieces of a text land in the same micro-batch (so sequence-level weights see the
//! whole text), which bounds a split text to `B` rows.
//!
//! Texts with the same prompt (the rollouts of a GRPO group) share it when
//! `share_prompts` is on: the prompt's first `p − 1` slots are packed once, as a prefix segment,
//! and each text continues it with a segment of its own that starts at the prompt's last token
//! (whose slot scores the first completion token) and sees the prefix but not its siblings
//! ([`MicroBatch::prefix_ids`]). Every loss slot then sees exactly the tokens, at the positions,
//! it would see packed alone, so log-probs and gradients are unchanged while a group of `G`
//! texts costs `p − 1 + Σ c_i` slots instead of `Σ (p + c_i − 1)`: 70 instead of 224 for the
//! quickstart's 23-token prompts and 6-token answers. A shared block lies in one row; a family
//! that does not fit the room left in a row is split there, each part with its own copy of the
//! prompt. Split texts never share.
//!
//! Packing is first-fit decreasing over the texts that do not share (ties in input order), then
//! first fit of each family of shared prompts (in order of first appearance), split where a row
//! fills: deterministic for a given input, which exact resumption relies on.

use crate::config::OversizedText;

mod stats;

pub use stats::PackingStats;

/// Micro-batch shape and the oversized-text policy.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BatcherConfig {
    /// Rows `B` of a micro-batch.
    pub rows: usize,
    /// Slots `L` per row.
    pub row_len: usize,
    /// What to do with a text longer than a row.
    pub oversized: OversizedText,
    /// Token id written into padding slots.
    pub pad_id: u32,
    /// Pack a prompt once for all the texts that continue it (see the module docs).
    pub share_prompts: bool,
}

/// One training text to pack. Slices `completion`, `behaviour`, `versions` align.
#[derive(Debug, Clone, Copy)]
pub struct TrainingText<'a> {
    /// Prompt token ids.
    pub prompt: &'a [u32],
    /// Completion token ids (the loss tokens).
    pub completion: &'a [u32],
    /// Behaviour log-prob of each completion token.
    pub behaviour: &'a [f32],
    /// Policy version that generated each completion token.
    pub versions: &'a [u64],
    /// Advantage of every completion token.
    pub advantage: f32,
    /// Aggregation weight of every completion token.
    pub weight: f32,
}

impl TrainingText<'_> {
    fn len(&self) -> usize {
        self.prompt.len() + self.completion.len()
    }

    fn token(&self, i: usize) -> u32 {
        match i.checked_sub(self.prompt.len()) {
            None => self.prompt[i],
            Some(c) => self.completion[c],
        }
    }
}

/// One packed `(B, L)` micro-batch; every vector is row-major with `B · L` entries.
#[derive(Debug, Clone, PartialEq)]
pub struct MicroBatch {
    /// Rows: at most `B`, the rows holding tokens (trailing empty rows are left out).
    pub rows: usize,
    /// Slots per row `L`.
    pub row_len: usize,
    /// Input token ids.
    pub input_ids: Vec<u32>,
    /// Position of each slot within its text.
    pub position_ids: Vec<u32>,
    /// Piece number within the row, from 1 (0 = padding).
    pub segment_ids: Vec<u32>,
    /// The shared prompt segment a slot's piece continues and also sees (0 = none).
    pub prefix_ids: Vec<u32>,
    /// Token scored at each slot (the next token of the same text).
    pub target_ids: Vec<u32>,
    /// The slot has a real next token (padding has none).
    pub target_mask: Vec<bool>,
    /// The target is a completion token: the loss is taken here.
    pub loss_mask: Vec<bool>,
    /// Behaviour log-prob of the target (0 where not a loss slot).
    pub behaviour: Vec<f32>,
    /// Policy version of the target (0 where not a loss slot).
    pub versions: Vec<u64>,
    /// Advantage of the target.
    pub advantages: Vec<f32>,
    /// Aggregation weight of the target.
    pub weights: Vec<f32>,
    /// Index of the text (in the input list) each slot belongs to (`u32::MAX` for padding); a
    /// shared prompt's slots belong to the first text of its block.
    pub text_ids: Vec<u32>,
}

impl MicroBatch {
    fn empty(rows: usize, row_len: usize, pad_id: u32) -> Self {
        let n = rows * row_len;
        Self {
            rows,
            row_len,
            input_ids: vec![pad_id; n],
            position_ids: vec![0; n],
            segment_ids: vec![0; n],
            prefix_ids: vec![0; n],
            target_ids: vec![pad_id; n],
            target_mask: vec![false; n],
            loss_mask: vec![false; n],
            behaviour: vec![0.0; n],
            versions: vec![0; n],
            advantages: vec![0.0; n],
            weights: vec![0.0; n],
            text_ids: vec![u32::MAX; n],
        }
    }

    /// Indices of the loss slots, in order.
    pub fn loss_slots(&self) -> Vec<usize> {
        (0..self.loss_mask.len())
            .filter(|&i| self.loss_mask[i])
            .collect()
    }

    /// Non-padding slots.
    pub fn used_slots(&self) -> usize {
        self.segment_ids.iter().filter(|&&s| s != 0).count()
    }
}

/// The micro-batches of one global batch and what packing them cost.
#[derive(Debug, Clone, Default)]
pub struct Packing {
    /// Micro-batches, to be accumulated into one optimizer step.
    pub micro_batches: Vec<MicroBatch>,
    /// Counts.
    pub stats: PackingStats,
}

/// A contiguous span `[start, end)` of one text's input slots.
#[derive(Debug, Clone, Copy)]
struct Piece {
    text: usize,
    start: usize,
    end: usize,
    kind: PieceKind,
}

/// How a piece's segment relates to its neighbours in the row.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum PieceKind {
    /// On its own.
    Alone,
    /// A shared prompt: the pieces after it in its chunk continue it.
    Prefix,
    /// Continues the prefix before it in its chunk.
    Continues,
}

impl Piece {
    fn alone(text: usize, start: usize, end: usize) -> Self {
        Self {
            text,
            start,
            end,
            kind: PieceKind::Alone,
        }
    }

    fn len(&self) -> usize {
        self.end - self.start
    }
}

/// Pieces of text `i`, or `None` when it must be rejected.
fn pieces(i: usize, text: &TrainingText<'_>, config: &BatcherConfig) -> Option<Vec<Piece>> {
    let slots = text.len().saturating_sub(1);
    if text.prompt.is_empty() && !text.completion.is_empty() {
        return None;
    }
    if slots <= config.row_len {
        return Some(vec![Piece::alone(i, 0, slots)]);
    }
    if config.oversized == OversizedText::Reject {
        return None;
    }
    // Slot j scores token j + 1: keep only pieces whose targets reach the completion.
    let first_loss_slot = text.prompt.len() - 1;
    let out: Vec<Piece> = (0..slots)
        .step_by(config.row_len)
        .map(|start| Piece::alone(i, start, (start + config.row_len).min(slots)))
        .filter(|p| p.end > first_loss_slot)
        .collect();
    (out.len() <= config.rows).then_some(out)
}

/// The texts (indices into `texts`, each fitting a row whole) grouped by equal prompts, in order
/// of first appearance.
fn families(texts: &[TrainingText<'_>], whole: &[usize]) -> Vec<Vec<usize>> {
    let mut by_prompt: std::collections::HashMap<&[u32], usize> = Default::default();
    let mut out: Vec<Vec<usize>> = Vec::new();
    for &i in whole {
        let k = *by_prompt.entry(texts[i].prompt).or_insert_with(|| {
            out.push(Vec::new());
            out.len() - 1
        });
        out[k].push(i);
    }
    out
}

/// Places a family of texts sharing one prompt: first fit, splitting the family where a row is
/// full, so rows left part-empty by the other units fill up. Each row's share is a chunk of a
/// prefix piece (the prompt's first `p − 1` slots) and its continuations, or a text alone when
/// only one fits.
fn place_family(
    family: &[usize],
    texts: &[TrainingText<'_>],
    config: &BatcherConfig,
    free: &mut Vec<Vec<usize>>,
    placed: &mut Vec<Vec<Vec<Piece>>>,
) {
    let shared = texts[family[0]].prompt.len() - 1;
    let continuation = |i: usize| Piece {
        text: i,
        start: shared,
        end: texts[i].len() - 1,
        kind: PieceKind::Continues,
    };
    let mut rest = family;
    while let Some(&first) = rest.first() {
        let need = shared + continuation(first).len();
        let found = free
            .iter()
            .enumerate()
            .find_map(|(m, rows)| rows.iter().position(|&f| f >= need).map(|r| (m, r)));
        let (m, r) = found.unwrap_or_else(|| {
            free.push(vec![config.row_len; config.rows]);
            placed.push(vec![Vec::new(); config.rows]);
            (free.len() - 1, 0)
        });
        let mut used = shared;
        let mut take = 0;
        while take < rest.len() && used + continuation(rest[take]).len() <= free[m][r] {
            used += continuation(rest[take]).len();
            take += 1;
        }
        let chunk: Vec<Piece> = if take == 1 {
            vec![Piece::alone(first, 0, continuation(first).end)]
        } else {
            let prefix = Piece {
                text: first,
                start: 0,
                end: shared,
                kind: PieceKind::Prefix,
            };
            std::iter::once(prefix)
                .chain(rest[..take].iter().map(|&i| continuation(i)))
                .collect()
        };
        free[m][r] -= used;
        placed[m][r].extend(chunk);
        rest = &rest[take..];
    }
}

/// Packs `texts` into micro-batches (see the module docs).
pub fn pack(texts: &[TrainingText<'_>], config: &BatcherConfig) -> Packing {
    let mut stats = PackingStats::default();
    // Each packable text with its pieces.
    let mut packable: Vec<(usize, Vec<Piece>)> = Vec::with_capacity(texts.len());
    for (i, text) in texts.iter().enumerate() {
        if text.completion.is_empty() {
            continue;
        }
        match pieces(i, text, config) {
            Some(p) => {
                stats.texts += 1;
                stats.split_texts += usize::from(p.len() > 1);
                packable.push((i, p));
            }
            None => {
                stats.rejected_texts += 1;
                stats.rejected_tokens += text.completion.len();
                tracing::warn!(
                    text = i,
                    tokens = text.len(),
                    row_len = config.row_len,
                    rows = config.rows,
                    "training text left out of the batch (too long for the packing policy, or no prompt)"
                );
            }
        }
    }
    let mut placed = place(&packable, texts, config, config.share_prompts);
    if config.share_prompts {
        // First fit is not monotone: sharing saves slots, yet the families placed after the
        // other texts can end up needing a micro-batch more than every text alone would. Keep
        // whichever placement runs fewer micro-batches (the shared one on a tie).
        let alone = place(&packable, texts, config, false);
        if alone.len() < placed.len() {
            placed = alone;
        }
    }

    let micro_batches: Vec<MicroBatch> = placed
        .into_iter()
        .map(|rows| materialize(&rows, texts, config))
        .collect();
    for mb in &micro_batches {
        stats.used_slots += mb.used_slots();
        stats.total_slots += mb.rows * mb.row_len;
        stats.loss_tokens += mb.loss_mask.iter().filter(|&&m| m).count();
    }
    Packing {
        micro_batches,
        stats,
    }
}

/// Where each piece goes: per micro-batch, per row, its pieces in order. With `share`, the
/// texts that fit a row whole and have a prompt of two tokens or more share it within their
/// family (`place_family`); every other text is a unit of its own pieces, each piece to its own
/// row of one micro-batch.
fn place(
    packable: &[(usize, Vec<Piece>)],
    texts: &[TrainingText<'_>],
    config: &BatcherConfig,
    share: bool,
) -> Vec<Vec<Vec<Piece>>> {
    let mut units: Vec<Vec<Piece>> = Vec::with_capacity(packable.len());
    let mut whole: Vec<usize> = Vec::new();
    for (i, p) in packable {
        // Only texts that fit a row whole share (a split text's pieces stand alone).
        let whole_text = p.len() == 1 && p[0].start == 0;
        if share && whole_text && texts[*i].prompt.len() > 1 {
            whole.push(*i);
        } else {
            units.push(p.clone());
        }
    }
    // First-fit decreasing over the units that cannot be split (ties in input order), then the
    // families of shared prompts fill what is left.
    let size = |u: &Vec<Piece>| u.iter().map(Piece::len).sum::<usize>();
    units.sort_by_key(|u| std::cmp::Reverse(size(u)));

    // Remaining capacity of each row of each micro-batch, and what goes where.
    let mut free: Vec<Vec<usize>> = Vec::new();
    let mut placed: Vec<Vec<Vec<Piece>>> = Vec::new();
    for unit in units {
        let fit = |rows: &[usize]| -> Option<Vec<usize>> {
            let mut rows = rows.to_vec();
            let mut chosen = Vec::with_capacity(unit.len());
            for p in &unit {
                let len = p.len();
                // Pieces of one text go to distinct rows (a row holds at most one piece of it).
                let r = (0..rows.len()).find(|&r| rows[r] >= len && !chosen.contains(&r))?;
                rows[r] -= len;
                chosen.push(r);
            }
            Some(chosen)
        };
        let (mb, rows) = match free
            .iter()
            .enumerate()
            .find_map(|(m, f)| fit(f).map(|r| (m, r)))
        {
            Some(found) => found,
            None => {
                free.push(vec![config.row_len; config.rows]);
                placed.push(vec![Vec::new(); config.rows]);
                let m = free.len() - 1;
                let rows = fit(&free[m])
                    .expect("a text of at most B row-sized pieces fits an empty micro-batch");
                (m, rows)
            }
        };
        for (p, r) in unit.into_iter().zip(rows) {
            free[mb][r] -= p.len();
            placed[mb][r].push(p);
        }
    }

    for family in families(texts, &whole) {
        place_family(&family, texts, config, &mut free, &mut placed);
    }
    placed
}

/// Writes the pieces of each row into a micro-batch.
fn materialize(
    rows: &[Vec<Piece>],
    texts: &[TrainingText<'_>],
    config: &BatcherConfig,
) -> MicroBatch {
    // Rows fill in order: trailing rows that would hold only padding are left out (a step's
    // last micro-batch is seldom full, and every row costs a full row of compute).
    let used = rows
        .iter()
        .rposition(|r| !r.is_empty())
        .map_or(1, |r| r + 1);
    let mut mb = MicroBatch::empty(used, config.row_len, config.pad_id);
    for (r, row) in rows.iter().enumerate() {
        let mut at = r * config.row_len;
        let mut prefix = 0;
        for (s, piece) in row.iter().enumerate() {
            let text = &texts[piece.text];
            let prompt_len = text.prompt.len();
            let segment = s as u32 + 1;
            prefix = match piece.kind {
                PieceKind::Alone => 0,
                PieceKind::Prefix => segment,
                PieceKind::Continues => prefix,
            };
            for j in piece.start..piece.end {
                mb.input_ids[at] = text.token(j);
                mb.position_ids[at] = j as u32;
                mb.segment_ids[at] = segment;
                if piece.kind == PieceKind::Continues {
                    mb.prefix_ids[at] = prefix;
                }
                mb.target_ids[at] = text.token(j + 1);
                mb.target_mask[at] = true;
                mb.text_ids[at] = piece.text as u32;
                if let Some(c) = (j + 1).checked_sub(prompt_len) {
                    mb.loss_mask[at] = true;
                    mb.behaviour[at] = text.behaviour[c];
                    mb.versions[at] = text.versions[c];
                    mb.advantages[at] = text.advantage;
                    mb.weights[at] = text.weight;
                }
                at += 1;
            }
        }
    }
    mb
}
