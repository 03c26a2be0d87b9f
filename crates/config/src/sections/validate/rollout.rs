//! Phase two of `[rollout]` (it reads the data domains).

use std::str::FromStr;

use sluice_core::config::ConfigError;
use sluice_core::config::check::{
    Ctx, non_negative, non_zero_u32, number, u32_incl_zero, u64_incl_zero,
};
use sluice_core::knobs::{AdmissionMode, Knobs, WeightUpdateMode};

use crate::sections::raw::RawRollout;
use crate::sections::typed::RolloutConfig;

/// Phase two of `[rollout]`; `data_domains` are the domains of `data.datasets` (what
/// `domain_mix` may weight).
pub fn validate_rollout(
    raw: RawRollout,
    data_domains: &[String],
    ctx: &Ctx<'_>,
) -> Result<RolloutConfig, ConfigError> {
    let group_size = non_zero_u32(ctx, "rollout.group_size", raw.group_size)?;
    let groups_per_step = non_zero_u32(ctx, "rollout.groups_per_step", raw.groups_per_step)?;
    let max_version_lag = u64_incl_zero(ctx, "rollout.max_version_lag", raw.max_version_lag)?;
    let staleness_threshold =
        non_negative(ctx, "rollout.staleness_threshold", raw.staleness_threshold)?;
    let weight_update_mode = WeightUpdateMode::from_str(&raw.weight_update_mode)
        .map_err(|m| ctx.value("rollout.weight_update_mode", m))?;
    let admission =
        AdmissionMode::from_str(&raw.admission).map_err(|m| ctx.value("rollout.admission", m))?;
    let trigger = u32_incl_zero(
        ctx,
        "rollout.tail_batch_trigger_size",
        raw.tail_batch_trigger_size,
    )?;
    // 0 stays 0, "no cap beyond admission": the scheduler reads admission's bound from the live
    // η (`sluice_replay::in_flight_cap`), so raising η at runtime opens room.
    let max_concurrent_rollouts = u32_incl_zero(
        ctx,
        "rollout.max_concurrent_rollouts",
        raw.max_concurrent_rollouts,
    )?;
    let domains = data_domains;
    for (domain, &w) in &raw.domain_mix {
        let key = format!("rollout.domain_mix.{domain}");
        if !domains.is_empty() && !domains.contains(domain) {
            return Err(ctx.value(
                &key,
                format!(
                    "unknown domain; data.datasets declares: {}",
                    domains.join(", ")
                ),
            ));
        }
        number(ctx, &key, w, "a weight ≥ 0", |v| v >= 0.0)?;
    }
    let knobs = Knobs {
        staleness_threshold,
        max_version_lag,
        admission,
        enable_partial_rollout: raw.enable_partial_rollout,
        tail_batch_candidate_steps: u32_incl_zero(
            ctx,
            "rollout.tail_batch_candidate_steps",
            raw.tail_batch_candidate_steps,
        )?,
        tail_batch_trigger_size: if trigger == 0 {
            groups_per_step.get()
        } else {
            trigger
        },
        weight_update_mode,
        domain_mix: raw.domain_mix,
        max_concurrent_rollouts,
        paused: raw.paused,
    };
    // The knobs' own rules (ceilings, the domain count, a mix that is not all zero), read at
    // `rollout.<knob>`: the file and `PATCH /v1/knobs` refuse the same values. Membership of
    // `domain_mix` was checked above against `data.datasets`, named as the file knows it.
    knobs
        .validate(&[])
        .map_err(|e| ctx.value(&format!("rollout.{}", e.knob), e.reason))?;
    Ok(RolloutConfig {
        group_size,
        groups_per_step,
        max_turns: non_zero_u32(ctx, "rollout.max_turns", raw.max_turns)?,
        max_history_turns: std::num::NonZeroU32::new(u32_incl_zero(
            ctx,
            "rollout.max_history_turns",
            raw.max_history_turns,
        )?),
        max_new_tokens: non_zero_u32(ctx, "rollout.max_new_tokens", raw.max_new_tokens)?,
        max_prompt_tokens: std::num::NonZeroU32::new(u32_incl_zero(
            ctx,
            "rollout.max_prompt_tokens",
            raw.max_prompt_tokens,
        )?),
        temperature: non_negative(ctx, "rollout.temperature", raw.temperature)?,
        top_p: number(ctx, "rollout.top_p", raw.top_p, "a number in (0, 1]", |v| {
            v > 0.0 && v <= 1.0
        })?,
        top_k: u32_incl_zero(ctx, "rollout.top_k", raw.top_k)?,
        balance_threshold: number(
            ctx,
            "rollout.balance_threshold",
            raw.balance_threshold,
            "a finite reward",
            |_| true,
        )?,
        overlong_buffer_tokens: u32_incl_zero(
            ctx,
            "rollout.overlong_buffer_tokens",
            raw.overlong_buffer_tokens,
        )?,
        overlong_penalty: non_negative(ctx, "rollout.overlong_penalty", raw.overlong_penalty)?,
        env_workers: non_zero_u32(ctx, "rollout.env_workers", raw.env_workers)?,
        env_calls_per_worker: non_zero_u32(
            ctx,
            "rollout.env_calls_per_worker",
            raw.env_calls_per_worker,
        )?,
        knobs,
    })
}
