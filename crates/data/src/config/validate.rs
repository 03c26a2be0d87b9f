//! Phase two of `[data]` (dataset specs, each domain listed by a dataset) and of
//! `[data.domains.<domain>]`: the task name, the env server URL and the rubric.
//! Which reward functions a task offers is the env crate's knowledge; here the names are checked
//! for shape and the weights and overrides for range, and the env crate names the key when a
//! function is unknown (`sluice_env::configured::registry`).

use std::collections::BTreeMap;
use std::path::PathBuf;

use sluice_core::config::ConfigError;
use sluice_core::config::check::{
    Ctx, choice, non_zero_u32, non_zero_u64, number, positive_seconds,
};

use crate::dataset::ReadLimits;

use super::raw::{RawData, RawDomain, RawRubric, RawSandbox};
use super::typed::{DataConfig, DatasetSpec, DomainConfig, DomainRubric, DomainSandbox};

/// Most reward functions one rubric may weight; each becomes a label value of
/// `sluice_rollout_reward_component_mean_reward`, so their number is bounded.
pub const MAX_REWARD_FNS: usize = 16;

/// Whether `s` is a name of `[A-Za-z0-9_.-]+`.
fn is_name(s: &str) -> bool {
    !s.is_empty()
        && s.bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'.' | b'-'))
}

/// Phase two of `[data]` and its `[data.domains.<domain>]`.
pub fn validate_data(raw: RawData, ctx: &Ctx<'_>) -> Result<DataConfig, ConfigError> {
    let mut datasets: Vec<DatasetSpec> = Vec::with_capacity(raw.datasets.len());
    for (i, spec) in raw.datasets.iter().enumerate() {
        let key = format!("data.datasets[{i}]");
        let parsed: DatasetSpec = spec.parse().map_err(|m: String| ctx.value(&key, m))?;
        if datasets.contains(&parsed) {
            return Err(ctx.value(&key, format!("`{spec}` is listed twice")));
        }
        datasets.push(parsed);
    }
    let mut domains = std::collections::BTreeMap::new();
    for (name, d) in raw.domains {
        let key = format!("data.domains.{name}");
        if !datasets.iter().any(|spec| spec.domain == name) {
            let known: Vec<&str> = datasets.iter().map(|spec| spec.domain.as_str()).collect();
            return Err(ctx.value(
                &key,
                format!(
                    "no dataset belongs to domain `{name}`; the datasets' domains are: {}",
                    known.join(", ")
                ),
            ));
        }
        domains.insert(name.clone(), validate_domain(&name, d, ctx)?);
    }
    Ok(DataConfig {
        datasets,
        data_dir: PathBuf::from(raw.data_dir),
        adaptive_mix: raw.adaptive_mix,
        domain_options: domains,
        on_bad_line: choice(ctx, "data.on_bad_line", &raw.on_bad_line)?,
        read_limits: ReadLimits {
            max_file_bytes: non_zero_u64(ctx, "data.max_file_bytes", raw.max_file_bytes)?.get(),
            max_line_bytes: non_zero_u64(ctx, "data.max_line_bytes", raw.max_line_bytes)?.get()
                as usize,
        },
    })
}

fn validate_domain(name: &str, raw: RawDomain, ctx: &Ctx<'_>) -> Result<DomainConfig, ConfigError> {
    let key = format!("data.domains.{name}");
    if let Some(task) = &raw.task
        && !is_name(task)
    {
        return Err(ctx.value(
            &format!("{key}.task"),
            format!("expected a task name of [A-Za-z0-9_.-], got `{task}`"),
        ));
    }
    if let Some(url) = &raw.env_url {
        let host = url
            .strip_prefix("http://")
            .or_else(|| url.strip_prefix("https://"));
        if host
            .is_none_or(|h| h.trim_end_matches('/').is_empty() || h.contains(char::is_whitespace))
        {
            return Err(ctx.value(
                &format!("{key}.env_url"),
                format!("expected an http:// or https:// base URL of an env server, got `{url}`"),
            ));
        }
    }
    if raw.env_nodes && raw.env_url.is_some() {
        return Err(ctx.value(
            &format!("{key}.env_nodes"),
            "expected one place for the domain's envs: set env_url (one env server) or env_nodes = true (the env nodes joined to the head), not both",
        ));
    }
    let rubric = raw
        .rubric
        .map(|r| validate_rubric(&format!("{key}.rubric"), r, ctx))
        .transpose()?;
    let max_new_tokens = raw
        .max_new_tokens
        .map(|v| non_zero_u32(ctx, &format!("{key}.max_new_tokens"), v))
        .transpose()?;
    let gamma = raw
        .gamma
        .map(|v| {
            number(ctx, &format!("{key}.gamma"), v, "a number in (0, 1]", |v| {
                v > 0.0 && v <= 1.0
            })
        })
        .transpose()?;
    if let Some(spec) = &raw.eval_dataset {
        let (name, split) = spec.split_once('@').unwrap_or((spec, "eval"));
        if !is_name(name) || !is_name(split) {
            return Err(ctx.value(
                &format!("{key}.eval_dataset"),
                format!("expected a dataset `name[@split]` of [A-Za-z0-9_.-], got `{spec}`"),
            ));
        }
    }
    let warmup_target_accuracy = raw
        .warmup_target_accuracy
        .map(|v| {
            number(
                ctx,
                &format!("{key}.warmup_target_accuracy"),
                v,
                "a fraction in [0, 1]",
                |v| (0.0..=1.0).contains(&v),
            )
        })
        .transpose()?;
    for (field, value) in [
        ("question_field", &raw.question_field),
        ("answer_field", &raw.answer_field),
        ("system_prompt_field", &raw.system_prompt_field),
    ] {
        if value.as_deref().is_some_and(|v| v.trim().is_empty()) {
            return Err(ctx.value(
                &format!("{key}.{field}"),
                "expected the name of a field of the dataset's rows, got an empty string",
            ));
        }
    }
    let answer_marker = raw
        .answer_marker
        .as_deref()
        .map(|m| choice(ctx, &format!("{key}.answer_marker"), m))
        .transpose()?;
    let sandbox = raw
        .sandbox
        .map(|r| validate_sandbox(&format!("{key}.sandbox"), r, ctx))
        .transpose()?;
    Ok(DomainConfig {
        system_prompt: raw.system_prompt,
        task: raw.task,
        env_url: raw.env_url,
        env_nodes: raw.env_nodes,
        rubric,
        max_new_tokens,
        gamma,
        eval_dataset: raw.eval_dataset,
        warmup_target_accuracy,
        question_field: raw.question_field,
        answer_field: raw.answer_field,
        system_prompt_field: raw.system_prompt_field,
        answer_marker,
        sandbox,
    })
}

fn validate_sandbox(
    key: &str,
    raw: RawSandbox,
    ctx: &Ctx<'_>,
) -> Result<DomainSandbox, ConfigError> {
    let RawSandbox {
        cpu_seconds,
        wall_s,
        memory_mib,
        max_processes,
        max_output_kib,
    } = raw;
    let count = |name: &str, value: Option<i64>, lo: i64, hi: i64, unit: &str| {
        value
            .map(|v| {
                if (lo..=hi).contains(&v) {
                    Ok(v as u64)
                } else {
                    Err(ctx.value(
                        &format!("{key}.{name}"),
                        format!("expected {unit} in {lo}..={hi}, got {v}"),
                    ))
                }
            })
            .transpose()
    };
    Ok(DomainSandbox {
        cpu_seconds: count("cpu_seconds", cpu_seconds, 1, 3600, "CPU seconds")?,
        wall_s: wall_s
            .map(|v| {
                number(
                    ctx,
                    &format!("{key}.wall_s"),
                    v,
                    "seconds in (0, 3600]",
                    |v| v > 0.0 && v <= 3600.0,
                )
            })
            .transpose()?,
        memory_mib: count("memory_mib", memory_mib, 16, 65_536, "MiB")?,
        max_processes: count("max_processes", max_processes, 1, 4096, "processes")?,
        max_output_kib: count("max_output_kib", max_output_kib, 1, 65_536, "KiB")?,
    })
}

fn validate_rubric(key: &str, raw: RawRubric, ctx: &Ctx<'_>) -> Result<DomainRubric, ConfigError> {
    let RawRubric {
        weights,
        truncation_reward,
        error_reward,
        timeout_s,
        regex,
        judge,
        reward_model,
    } = raw;
    let weights_key = format!("{key}.weights");
    if weights.is_empty() {
        return Err(ctx.value(
            &weights_key,
            "expected at least one reward function, e.g. `weights = { correct = 1.0 }`",
        ));
    }
    if weights.len() > MAX_REWARD_FNS {
        return Err(ctx.value(
            &weights_key,
            format!(
                "expected at most {MAX_REWARD_FNS} reward functions, got {}",
                weights.len()
            ),
        ));
    }
    let mut checked = BTreeMap::new();
    for (f, w) in weights {
        let fkey = format!("{weights_key}.{f}");
        if !is_name(&f) {
            return Err(ctx.value(
                &fkey,
                format!("expected a reward function name of [A-Za-z0-9_.-], got `{f}`"),
            ));
        }
        let w = number(ctx, &fkey, w, "a weight ≥ 0", |v| v >= 0.0)?;
        checked.insert(f, w);
    }
    if checked.values().sum::<f64>() <= 0.0 {
        return Err(ctx.value(&weights_key, "expected at least one weight > 0, all are 0"));
    }
    let reward = |name: &str, v: Option<f64>| {
        v.map(|v| {
            number(ctx, &format!("{key}.{name}"), v, "a finite number", |_| {
                true
            })
        })
        .transpose()
    };
    let regex = regex
        .map(|pattern| validate_regex(&format!("{key}.regex"), &checked, pattern, ctx))
        .transpose()?;
    let judge = judge
        .map(|raw| super::judge::validate_judge(&format!("{key}.judge"), &checked, raw, ctx))
        .transpose()?;
    let reward_model = reward_model
        .map(|raw| {
            let key = format!("{key}.reward_model");
            super::reward_model::validate_reward_model(&key, &checked, raw, ctx)
        })
        .transpose()?;
    Ok(DomainRubric {
        weights: checked,
        truncation_reward: reward("truncation_reward", truncation_reward)?,
        error_reward: reward("error_reward", error_reward)?,
        timeout: timeout_s
            .map(|s| positive_seconds(ctx, &format!("{key}.timeout_s"), s))
            .transpose()?,
        regex,
        judge,
        reward_model,
    })
}

/// The `regex` reward function's pattern: it compiles, and the weights use it.
fn validate_regex(
    key: &str,
    weights: &BTreeMap<String, f64>,
    pattern: String,
    ctx: &Ctx<'_>,
) -> Result<String, ConfigError> {
    if let Err(e) = regex::Regex::new(&pattern) {
        // The regex crate's message spans lines (pattern, caret, reason): keep it on one.
        let reason = e
            .to_string()
            .lines()
            .map(str::trim)
            .collect::<Vec<_>>()
            .join(" ");
        return Err(ctx.value(
            key,
            format!("expected a valid regular expression: {reason}"),
        ));
    }
    if !weights.contains_key("regex") {
        return Err(ctx.value(
            key,
            "the pattern is for the `regex` reward function, which `weights` does not name",
        ));
    }
    Ok(pattern)
}
