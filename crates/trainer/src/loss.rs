//! Policy losses (`DESIGN.md` §6), computed per token on the host from detached log-probs.
//!
//! Every objective here has a gradient of the form `Σ_t c_t ∇ log π_θ(t) + Σ_t e_t ∇H_t`, where
//! `c_t` and `e_t` depend only on detached quantities (ratios, advantages, clip decisions) and
//! `H_t` is the policy's entropy at the token (`e_t` is 0 but for the entropy bonus).
//! [`token_terms`] returns those coefficients and the exact loss value; the trainer then
//! back-propagates the surrogate `Σ_t c_t · logπ_θ(t) + Σ_t e_t · H_t` (coefficients as
//! constants), whose gradient is the gradient of the loss. This keeps the differentiable graph to
//! a multiply and a sum per column of the token scores, and lets every formula be tested on
//! plain numbers.
//!
//! Notation per completion token `t`: `lp` = log π_θ, `b` = behaviour log-prob from the engine,
//! `A` = advantage, `w` = aggregation weight (see [`aggregation_weights`]), `C` = `is_cap`,
//! `clip(r) = min(max(r, 1 − clip_low), 1 + clip_high)`.
//! - `ppo`: `r = exp(lp − b)`, `ℓ = −min(r·A, clip(r)·A)`.
//! - `tis`: `ρ = exp(lp − b)` per token (token level) or `exp(Σ_seq (lp − b))` per text (sequence
//!   level); `ρ̃ = min(ρ, C)` (`truncate`) or `ρ·[ρ ≤ C]` (`mask`); `ℓ = −sg(ρ̃/ρ)·r·A`, i.e. value
//!   `−ρ̃·A` and gradient `−ρ̃·A·∇lp`.
//! - `decoupled_ppo`: proximal log-prob `p` (recomputed by the trainer with this step's weights
//!   before any update), `r = exp(lp − p)`, behaviour weight `ρ̃` from `exp(p − b)` as in `tis`,
//!   `ℓ = −ρ̃ · min(r·A, clip(r)·A)`.
//! - `gspo` (GSPO): one ratio per text, the geometric mean of its tokens' ratios,
//!   `s = exp(mean_text(lp − b))`, and `ℓ = −min(s·A, clip(s)·A)` for each of its tokens. The
//!   gradient is GSPO-token's, `−s·A·∇lp` where unclipped: with a text's tokens sharing one
//!   advantage and one weight (as the trainer gives them), `Σ_t w ℓ_t` has exactly that gradient.
//! - Dual clip (`dual_clip = c > 1`, the clipped losses): with `A < 0` a token's clipped term is
//!   at most `−c·A`, so a ratio far above `c` stops pushing the token down (gradient 0).
//! - KL penalty (when a reference is given), `x = ref − lp`: `ℓ += kl_coef · k(x)` with the
//!   estimator `k3 = eˣ − x − 1` (non-negative; gradient `1 − eˣ`), `k1 = −x` (gradient 1) or
//!   `k2 = x²/2` (gradient `−x`). The reported KL is k3's whichever the penalty uses.
//! - Entropy bonus (`entropy_coeff = β > 0`): `ℓ −= β·H_t`, so `e_t = −β·w_t`; `H_t` is the
//!   entropy of the trainer's softmax at its temperature, as the scores head computes it.
//!
//! The step's loss is `Σ_t w_t ℓ_t`.

use std::collections::HashMap;

use crate::config::{KlEstimator, LossAggregation, LossKind, TisLevel, TisMode};

/// Which objective and its constants; built from `[trainer]`.
#[derive(Debug, Clone, PartialEq)]
pub struct LossConfig {
    /// `ppo`, `tis`, `decoupled_ppo` or `gspo`.
    pub kind: LossKind,
    /// Lower clip ε: ratios below `1 − clip_low` stop pulling when `A < 0`.
    pub clip_low: f64,
    /// Upper clip ε: ratios above `1 + clip_high` stop pushing when `A > 0`.
    pub clip_high: f64,
    /// Token- or sequence-level importance weights (`tis`).
    pub tis_level: TisLevel,
    /// Truncate weights at the cap, or mask tokens above it (`tis`, `decoupled_ppo`).
    pub tis_mode: TisMode,
    /// The importance-weight cap `C` (> 0).
    pub is_cap: f64,
    /// KL penalty coefficient (applies only when reference log-probs are given).
    pub kl_coef: f64,
    /// The KL penalty's estimator.
    pub kl_estimator: KlEstimator,
    /// Dual-clip bound `c` (> 1) of the clipped losses' terms with a negative advantage; 0 = off.
    pub dual_clip: f64,
    /// Entropy bonus `β` (≥ 0): each token's loss is lowered by `β·H_t`; 0 = off.
    pub entropy_coeff: f64,
}

impl Default for LossConfig {
    fn default() -> Self {
        Self {
            kind: LossKind::Ppo,
            clip_low: 0.2,
            clip_high: 0.2,
            tis_level: TisLevel::Token,
            tis_mode: TisMode::Truncate,
            is_cap: 2.0,
            kl_coef: 0.0,
            kl_estimator: KlEstimator::K3,
            dual_clip: 0.0,
            entropy_coeff: 0.0,
        }
    }
}

/// Per-token inputs for the loss tokens of one micro-batch; all slices have the same length.
#[derive(Debug, Clone, Copy)]
pub struct TokenInputs<'a> {
    /// `log π_θ` of each token (detached values of the training forward).
    pub logprobs: &'a [f32],
    /// Behaviour log-probs recorded by the engine.
    pub behaviour: &'a [f32],
    /// Proximal log-probs for `decoupled_ppo`; `None` means "the current weights", i.e.
    /// `logprobs` itself: exact for a step's first minibatch, taken before any update (the
    /// later ones pass the starting weights' log-probs).
    pub proximal: Option<&'a [f32]>,
    /// Advantage of each token.
    pub advantages: &'a [f32],
    /// Aggregation weight of each token.
    pub weights: &'a [f32],
    /// Which text each token belongs to (sequence-level weights group by it; a text's tokens
    /// must all be in the same call).
    pub sequence: &'a [u32],
    /// Reference-policy log-probs for the KL penalty.
    pub reference: Option<&'a [f32]>,
    /// Policy entropy at each token, nats: statistics, and the entropy bonus's term (which
    /// needs it).
    pub entropy: Option<&'a [f32]>,
}

/// Counters of one or more micro-batches; merge them, then read [`LossStats::summary`].
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct LossStats {
    /// `Σ w_t ℓ_t`.
    pub loss: f64,
    /// Loss tokens seen.
    pub tokens: u64,
    /// Tokens whose clipped term was active with the ratio below `1 − clip_low`.
    pub clipped_low: u64,
    /// Tokens whose clipped term was active with the ratio above `1 + clip_high`.
    pub clipped_high: u64,
    /// Tokens with a negative advantage whose term the dual clip bounded (ratio above `c`).
    pub dual_clipped: u64,
    /// Tokens (or tokens of sequences) whose importance weight exceeded the cap.
    pub over_cap: u64,
    /// `Σ ρ`, `Σ ρ²` and `max ρ` of the behaviour importance weights (before capping).
    pub is_sum: f64,
    /// See `is_sum`.
    pub is_sq_sum: f64,
    /// See `is_sum`.
    pub is_max: f64,
    /// `Σ` of the k3 KL estimate (tokens with a reference).
    pub kl_sum: f64,
    /// Tokens that had a reference.
    pub kl_tokens: u64,
    /// `Σ` entropy (tokens with an entropy).
    pub entropy_sum: f64,
    /// Tokens that had an entropy.
    pub entropy_tokens: u64,
}

/// Step-level statistics derived from [`LossStats`].
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LossSummary {
    /// The aggregated loss.
    pub loss: f64,
    /// Fraction of tokens clipped on the low side.
    pub clip_low_fraction: f64,
    /// Fraction of tokens clipped on the high side.
    pub clip_high_fraction: f64,
    /// Fraction of tokens the dual clip bounded.
    pub dual_clip_fraction: f64,
    /// Fraction of tokens whose importance weight was over the cap.
    pub over_cap_fraction: f64,
    /// Mean importance weight `π/π_behav` (per token).
    pub is_mean: f64,
    /// Largest importance weight.
    pub is_max: f64,
    /// Effective sample size `(Σρ)² / (n Σρ²)`, in (0, 1].
    pub ess_fraction: f64,
    /// Mean k3 KL to the reference (NaN without a reference).
    pub kl: f64,
    /// Mean entropy (NaN without entropies).
    pub entropy: f64,
}

impl LossStats {
    /// Adds `other`'s counts to these.
    pub fn merge(&mut self, other: &LossStats) {
        self.loss += other.loss;
        self.tokens += other.tokens;
        self.clipped_low += other.clipped_low;
        self.clipped_high += other.clipped_high;
        self.dual_clipped += other.dual_clipped;
        self.over_cap += other.over_cap;
        self.is_sum += other.is_sum;
        self.is_sq_sum += other.is_sq_sum;
        self.is_max = self.is_max.max(other.is_max);
        self.kl_sum += other.kl_sum;
        self.kl_tokens += other.kl_tokens;
        self.entropy_sum += other.entropy_sum;
        self.entropy_tokens += other.entropy_tokens;
    }

    /// Fractions and means over everything merged so far.
    pub fn summary(&self) -> LossSummary {
        let n = self.tokens.max(1) as f64;
        let per = |sum: f64, count: u64| {
            if count == 0 {
                f64::NAN
            } else {
                sum / count as f64
            }
        };
        LossSummary {
            loss: self.loss,
            clip_low_fraction: self.clipped_low as f64 / n,
            clip_high_fraction: self.clipped_high as f64 / n,
            dual_clip_fraction: self.dual_clipped as f64 / n,
            over_cap_fraction: self.over_cap as f64 / n,
            is_mean: self.is_sum / n,
            is_max: self.is_max,
            ess_fraction: if self.is_sq_sum > 0.0 {
                self.is_sum * self.is_sum / (n * self.is_sq_sum)
            } else {
                0.0
            },
            kl: per(self.kl_sum, self.kl_tokens),
            entropy: per(self.entropy_sum, self.entropy_tokens),
        }
    }
}

/// Coefficients of the surrogate and the statistics of one micro-batch.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct LossTerms {
    /// `c_t = w_t · ∂ℓ_t/∂lp_t`: back-propagate `Σ c_t · lp_t`.
    pub coefficients: Vec<f32>,
    /// `e_t = w_t · ∂ℓ_t/∂H_t` with the entropy bonus on (`Σ e_t · H_t` joins the surrogate);
    /// empty with it off.
    pub entropy_coefficients: Vec<f32>,
    /// Counters for this micro-batch.
    pub stats: LossStats,
}

/// The inputs did not line up.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("loss inputs: `{what}` has {len} entries, `logprobs` has {expected}")]
pub struct LossInputError {
    /// Which input.
    pub what: &'static str,
    /// Its length.
    pub len: usize,
    /// The length of `logprobs`.
    pub expected: usize,
}

/// Capped weight of `rho` and whether it was over the cap.
fn cap(rho: f64, config: &LossConfig) -> (f64, bool) {
    let over = rho > config.is_cap;
    let w = match (config.tis_mode, over) {
        (_, false) => rho,
        (TisMode::Truncate, true) => config.is_cap,
        (TisMode::Mask, true) => 0.0,
    };
    (w, over)
}

/// One token's clipped-ratio term.
struct Clipped {
    /// `−min(r·A, clip(r)·A)`, bounded by `−c·A` under the dual clip when `A < 0`.
    loss: f64,
    /// `∂loss/∂lp` (`−r·A` where the ratio's own term is the one taken, else 0).
    grad: f64,
    /// The clip bound the ratio below `1 − clip_low`.
    low: bool,
    /// The clip bound the ratio above `1 + clip_high`.
    high: bool,
    /// The dual clip bound the term.
    dual: bool,
}

/// Clipped-ratio term of ratio `r` and advantage `a`.
fn clipped(r: f64, a: f64, config: &LossConfig) -> Clipped {
    let rc = r.clamp(1.0 - config.clip_low, 1.0 + config.clip_high);
    let (unclipped, clip) = (r * a, rc * a);
    let mut term = if clip < unclipped {
        Clipped {
            loss: -clip,
            grad: 0.0,
            low: r < 1.0,
            high: r > 1.0,
            dual: false,
        }
    } else {
        Clipped {
            loss: -unclipped,
            grad: -unclipped,
            low: false,
            high: false,
            dual: false,
        }
    };
    let bound = -config.dual_clip * a;
    if config.dual_clip > 0.0 && a < 0.0 && term.loss > bound {
        term = Clipped {
            loss: bound,
            grad: 0.0,
            low: false,
            high: false,
            dual: true,
        };
    }
    term
}

impl LossStats {
    /// Counts a clipped term's decisions.
    fn count(&mut self, term: &Clipped) {
        self.clipped_low += u64::from(term.low);
        self.clipped_high += u64::from(term.high);
        self.dual_clipped += u64::from(term.dual);
    }
}

/// Per text, the sum of `f(t)` over its tokens in this call (`sequence[t]` names the text), or
/// with `mean`, their mean.
fn per_text(sequence: &[u32], f: impl Fn(usize) -> f64, mean: bool) -> HashMap<u32, f64> {
    let mut sums = HashMap::<u32, (f64, u32)>::new();
    for (t, &text) in sequence.iter().enumerate() {
        let e = sums.entry(text).or_default();
        e.0 += f(t);
        e.1 += 1;
    }
    sums.into_iter()
        .map(|(text, (sum, n))| (text, if mean { sum / f64::from(n) } else { sum }))
        .collect()
}

/// Loss value and surrogate coefficients for the tokens of `inputs` (see the module docs).
pub fn token_terms(
    inputs: &TokenInputs<'_>,
    config: &LossConfig,
) -> Result<LossTerms, LossInputError> {
    let n = inputs.logprobs.len();
    let check = |what: &'static str, len: usize| {
        if len == n {
            Ok(())
        } else {
            Err(LossInputError {
                what,
                len,
                expected: n,
            })
        }
    };
    check("behaviour", inputs.behaviour.len())?;
    check("advantages", inputs.advantages.len())?;
    check("weights", inputs.weights.len())?;
    check("sequence", inputs.sequence.len())?;
    for (what, opt) in [
        ("proximal", inputs.proximal),
        ("reference", inputs.reference),
        ("entropy", inputs.entropy),
    ] {
        if let Some(s) = opt {
            check(what, s.len())?;
        }
    }
    let bonus = config.entropy_coeff;
    if bonus > 0.0 && inputs.entropy.is_none() {
        return Err(LossInputError {
            what: "entropy",
            len: 0,
            expected: n,
        });
    }
    let lp = |t: usize| f64::from(inputs.logprobs[t]);
    let prox = |t: usize| inputs.proximal.map_or(lp(t), |p| f64::from(p[t]));
    let behaviour = |t: usize| f64::from(inputs.behaviour[t]);
    // Sequence-level log-ratio per text: its sum for `tis` at sequence level, its mean for `gspo`.
    let log_ratio = |t: usize| lp(t) - behaviour(t);
    let seq_log_ratio = match (config.kind, config.tis_level) {
        (LossKind::Tis, TisLevel::Sequence) => per_text(inputs.sequence, log_ratio, false),
        (LossKind::Gspo, _) => per_text(inputs.sequence, log_ratio, true),
        _ => HashMap::new(),
    };
    let mut stats = LossStats {
        tokens: n as u64,
        ..LossStats::default()
    };
    let mut coefficients = Vec::with_capacity(n);
    let mut entropy_coefficients = Vec::with_capacity(if bonus > 0.0 { n } else { 0 });
    for t in 0..n {
        let a = f64::from(inputs.advantages[t]);
        let w = f64::from(inputs.weights[t]);
        // Behaviour importance weight of this token (statistics use the per-token value):
        // `π_θ/π_behav`, or `π_prox/π_behav` for the decoupled objective.
        let rho_token = match config.kind {
            LossKind::DecoupledPpo => (prox(t) - behaviour(t)).exp(),
            LossKind::Ppo | LossKind::Tis | LossKind::Gspo => log_ratio(t).exp(),
        };
        stats.is_sum += rho_token;
        stats.is_sq_sum += rho_token * rho_token;
        stats.is_max = stats.is_max.max(rho_token);
        let (mut loss, mut grad) = match config.kind {
            LossKind::Ppo => {
                let term = clipped(rho_token, a, config);
                stats.count(&term);
                (term.loss, term.grad)
            }
            LossKind::Gspo => {
                let term = clipped(seq_log_ratio[&inputs.sequence[t]].exp(), a, config);
                stats.count(&term);
                (term.loss, term.grad)
            }
            LossKind::Tis => {
                let rho = match config.tis_level {
                    TisLevel::Token => rho_token,
                    TisLevel::Sequence => seq_log_ratio[&inputs.sequence[t]].exp(),
                };
                let (rw, over) = cap(rho, config);
                stats.over_cap += u64::from(over);
                (-rw * a, -rw * a)
            }
            LossKind::DecoupledPpo => {
                let (rw, over) = cap(rho_token, config);
                stats.over_cap += u64::from(over);
                let term = clipped((lp(t) - prox(t)).exp(), a, config);
                stats.count(&term);
                (rw * term.loss, rw * term.grad)
            }
        };
        if let Some(reference) = inputs.reference {
            let x = f64::from(reference[t]) - lp(t);
            let k3 = x.exp() - x - 1.0;
            stats.kl_sum += k3;
            stats.kl_tokens += 1;
            let (kl, d_kl) = match config.kl_estimator {
                KlEstimator::K1 => (-x, 1.0),
                KlEstimator::K2 => (0.5 * x * x, -x),
                KlEstimator::K3 => (k3, 1.0 - x.exp()),
            };
            loss += config.kl_coef * kl;
            grad += config.kl_coef * d_kl;
        }
        if let Some(entropy) = inputs.entropy {
            let h = f64::from(entropy[t]);
            stats.entropy_sum += h;
            stats.entropy_tokens += 1;
            if bonus > 0.0 {
                loss -= bonus * h;
                entropy_coefficients.push((-w * bonus) as f32);
            }
        }
        stats.loss += w * loss;
        coefficients.push((w * grad) as f32);
    }
    Ok(LossTerms {
        coefficients,
        entropy_coefficients,
        stats,
    })
}

/// Identity of a text for aggregation: `(group, rollout)` and its loss-token count.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TextTokens {
    /// Group index in the batch.
    pub group: usize,
    /// Rollout index in the group.
    pub rollout: usize,
    /// Completion (loss) tokens of the text.
    pub tokens: usize,
}

/// How the step's loss adds up its tokens: `trainer.loss_aggregation`, and the constant a
/// text's summed loss is divided by under `token_sum_normalized`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Aggregation {
    /// The scheme.
    pub mode: LossAggregation,
    /// `L` of `token_sum_normalized` (`rollout.max_new_tokens`; 0 is read as 1).
    pub normalizer_tokens: usize,
}

impl Aggregation {
    /// `mode`, with `normalizer_tokens` for `token_sum_normalized`.
    pub fn new(mode: LossAggregation, normalizer_tokens: usize) -> Self {
        Self {
            mode,
            normalizer_tokens,
        }
    }
}

/// Per-token weight of each text so that `Σ_t w_t ℓ_t` is the chosen aggregate over the whole
/// global batch (so gradient accumulation over micro-batches is exact):
/// - `token_mean`: `1 / Σ tokens`;
/// - `sequence_mean`: `1 / (texts · tokens_of_text)`: every text counts once;
/// - `rollout_normalized`: `1 / (rollouts · tokens_of_rollout)`: every rollout counts once however
///   many texts it has (seed 002's `loss_weight_scale`);
/// - `token_sum_normalized`: `1 / (texts · L)` with a constant `L` (Dr. GRPO): each text's
///   token sum over a length that depends on no reply, so neither a long reply's tokens nor a
///   short batch's are weighed down.
///
/// Texts with zero tokens get weight 0.
pub fn aggregation_weights(texts: &[TextTokens], aggregation: Aggregation) -> Vec<f32> {
    let total: usize = texts.iter().map(|t| t.tokens).sum();
    let mut per_rollout = HashMap::<(usize, usize), usize>::new();
    for t in texts {
        *per_rollout.entry((t.group, t.rollout)).or_default() += t.tokens;
    }
    let rollouts = per_rollout.values().filter(|&&n| n > 0).count();
    let live_texts = texts.iter().filter(|t| t.tokens > 0).count();
    texts
        .iter()
        .map(|t| {
            if t.tokens == 0 {
                return 0.0;
            }
            let w = match aggregation.mode {
                LossAggregation::TokenMean => 1.0 / total as f64,
                LossAggregation::SequenceMean => 1.0 / (live_texts * t.tokens) as f64,
                LossAggregation::RolloutNormalized => {
                    1.0 / (rollouts * per_rollout[&(t.group, t.rollout)]) as f64
                }
                LossAggregation::TokenSumNormalized => {
                    1.0 / (live_texts as f64 * aggregation.normalizer_tokens.max(1) as f64)
                }
            };
            w as f32
        })
        .collect()
}
