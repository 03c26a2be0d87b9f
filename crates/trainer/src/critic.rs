//! PPO's critic and generalized advantage estimation (`trainer.advantage = "gae"`): the
//! arithmetic on the host. The critic model itself, its forward and its update are the native
//! trainer's (`native::critic`).
//!
//! A rollout is one trajectory: the completion tokens of its kept turns in order, each turn's
//! last token followed by the next turn's first (the environment's reply between them is the
//! transition). Its reward arrives after the last token, every other reward is 0 (or the KL
//! penalty's, `crate::kl_reward`), and the value after the last token is 0. With `V_t` the critic's value of the state before token `t`:
//!
//! - `δ_t = r_t + γ·V_{t+1} − V_t`, `A_t = δ_t + γλ·A_{t+1}` (Schulman et al., 2016);
//! - the critic's target, the return, is `R_t = A_t + V_t`;
//! - the policy's advantages are whitened over the step's tokens (mean 0, variance 1), as verl
//!   does for GAE.
//!
//! `λ = 1` makes `A_t = γ^(T−1−t)·r − V_t`, the discounted reward less the critic's baseline;
//! `λ = 0` the one-step TD error.
//!
//! The value loss is PPO's clipped one: with `v` the critic's value now, `v₀` its value at the
//! start of the step and `ε_v` = `trainer.value_clip`,
//! `ℓ_t = ½·max((v − R)², (v₀ + clip(v − v₀, −ε_v, ε_v) − R)²)`, averaged over the tokens.

use crate::optim::OptimConfig;

/// `advantage = "gae"`'s settings.
#[derive(Debug, Clone, PartialEq)]
pub struct CriticConfig {
    /// The directory the critic starts from (a one-label classifier's); `None`: the policy.
    pub init: Option<std::path::PathBuf>,
    /// Per-token discount `γ`, in (0, 1].
    pub gamma: f64,
    /// `λ`, in [0, 1].
    pub lambda: f64,
    /// `ε_v`: how far a value may move from the step's starting value before the clipped term
    /// binds (> 0).
    pub value_clip: f64,
    /// The critic's AdamW and schedule (the policy's, at `trainer.critic_learning_rate`).
    pub optim: OptimConfig,
    /// RL steps at the start that train the critic alone (`trainer.critic_warmup`).
    pub warmup_steps: u64,
}

/// Advantages and returns of one trajectory whose `values` are the critic's and `rewards` its
/// rewards, token by token (the reward after its last token at its last; 0 elsewhere unless
/// the KL penalty puts its own there).
pub fn gae(values: &[f32], rewards: &[f64], gamma: f64, lambda: f64) -> (Vec<f64>, Vec<f64>) {
    let n = values.len();
    let (mut advantages, mut returns) = (vec![0.0; n], vec![0.0; n]);
    let (mut next_value, mut next_advantage) = (0.0, 0.0);
    for t in (0..n).rev() {
        let r = rewards[t];
        let v = f64::from(values[t]);
        let delta = r + gamma * next_value - v;
        next_advantage = delta + gamma * lambda * next_advantage;
        advantages[t] = next_advantage;
        returns[t] = next_advantage + v;
        next_value = v;
    }
    (advantages, returns)
}

/// Shifts and scales every token's advantage so that over all of them the mean is 0 and the
/// variance 1 (nothing when there are none, or they are all equal: then they become 0).
pub fn whiten(advantages: &mut [Vec<f64>]) {
    let n: usize = advantages.iter().map(Vec::len).sum();
    if n == 0 {
        return;
    }
    let all = || advantages.iter().flatten();
    let mean = all().sum::<f64>() / n as f64;
    let var = all().map(|a| (a - mean) * (a - mean)).sum::<f64>() / n as f64;
    let scale = 1.0 / (var.sqrt() + crate::advantage::STD_EPSILON);
    for a in advantages.iter_mut().flatten() {
        *a = (*a - mean) * scale;
    }
}

/// What the critic's update reads at one micro-batch's loss slots, in slot order.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ValueTargets {
    /// The return `R` of each slot's token.
    pub returns: Vec<f32>,
    /// The critic's value `v₀` of the slot at the start of the step.
    pub old_values: Vec<f32>,
}

/// The value loss of one micro-batch's loss slots: coefficients `c_t = ∂(w_t·ℓ_t)/∂v_t` (the
/// gradient reaches the critic as that of `Σ c_t·v_t`), and the figures.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ValueTerms {
    /// `∂(w_t·ℓ_t)/∂v_t`.
    pub coefficients: Vec<f32>,
    /// `Σ w_t·ℓ_t`.
    pub loss: f64,
    /// Tokens whose clipped term is the larger (its gradient is 0).
    pub clipped: u64,
}

/// [`ValueTerms`] of `values` against `targets`, token weights `weights`, clip `clip`.
pub fn value_terms(
    values: &[f32],
    targets: &ValueTargets,
    weights: &[f32],
    clip: f64,
) -> ValueTerms {
    let mut out = ValueTerms {
        coefficients: Vec::with_capacity(values.len()),
        ..ValueTerms::default()
    };
    for (t, &v) in values.iter().enumerate() {
        let (v, r) = (f64::from(v), f64::from(targets.returns[t]));
        let old = f64::from(targets.old_values[t]);
        let w = f64::from(weights[t]);
        let clipped = old + (v - old).clamp(-clip, clip);
        let (plain, bound) = ((v - r).powi(2), (clipped - r).powi(2));
        out.loss += w * 0.5 * plain.max(bound);
        let c = if bound > plain {
            // The clipped value is constant in v there (it is clipped whenever bound > plain).
            out.clipped += 1;
            0.0
        } else {
            w * (v - r)
        };
        out.coefficients.push(c as f32);
    }
    out
}

/// The critic's figures of one step.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct CriticStats {
    /// Tokens the value loss was taken over.
    pub tokens: u64,
    /// The value loss, the mean of each update's.
    pub loss: f64,
    /// Updates taken.
    pub updates: u64,
    /// Tokens whose clipped value term was the larger.
    pub clipped: u64,
    /// Sums over the step's tokens of the starting value `v₀`, the return `R`, `R²`,
    /// `R − v₀` and `(R − v₀)²`: the means and the explained variance.
    pub value_sum: f64,
    /// See `value_sum`.
    pub return_sum: f64,
    /// See `value_sum`.
    pub return_sq_sum: f64,
    /// See `value_sum`.
    pub residual_sum: f64,
    /// See `value_sum`.
    pub residual_sq_sum: f64,
    /// Tokens in the sums above.
    pub scored: u64,
    /// The last update's gradient norm before clipping.
    pub grad_norm: f64,
}

impl CriticStats {
    /// Adds a token's starting value and return.
    pub fn score(&mut self, value: f64, ret: f64) {
        self.scored += 1;
        self.value_sum += value;
        self.return_sum += ret;
        self.return_sq_sum += ret * ret;
        self.residual_sum += ret - value;
        self.residual_sq_sum += (ret - value) * (ret - value);
    }

    /// Mean starting value over the step's tokens.
    pub fn values_mean(&self) -> f64 {
        self.value_sum / self.scored.max(1) as f64
    }

    /// Mean return over the step's tokens.
    pub fn returns_mean(&self) -> f64 {
        self.return_sum / self.scored.max(1) as f64
    }

    /// `1 − Var(R − v₀) / Var(R)`: 1 when the critic predicts every return, 0 when it does no
    /// better than their mean, negative when worse; `None` when the returns do not vary.
    pub fn explained_variance(&self) -> Option<f64> {
        let n = self.scored as f64;
        if n == 0.0 {
            return None;
        }
        let var = |sum: f64, sq: f64| (sq / n - (sum / n).powi(2)).max(0.0);
        let returns = var(self.return_sum, self.return_sq_sum);
        (returns > 1e-12).then(|| 1.0 - var(self.residual_sum, self.residual_sq_sum) / returns)
    }

    /// Fraction of the value loss's tokens whose clipped term was the larger.
    pub fn clip_fraction(&self) -> f64 {
        self.clipped as f64 / self.tokens.max(1) as f64
    }
}
