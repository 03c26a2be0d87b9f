//! Phase two of `[engine]` and `[engine.simulated]`.

use std::time::Duration;

use sluice_core::config::check::{
    Ctx, choice, non_negative, non_zero_u32, number, u32_incl_zero, u64_incl_zero,
};
use sluice_core::config::{ConfigError, DType, Device, LengthDistribution};

use super::raw::{RawEngine, RawSimEngine};
use super::typed::{EngineBackend, EngineConfig, SimEngineConfig};

/// Phase two of `[engine]`; `device` is `engine.device` resolved, `head` says this node is a head,
/// `run_seed` (`run.seed`) is the simulated engine's default seed.
pub fn validate_engine(
    raw: RawEngine,
    run_seed: u64,
    head: bool,
    device: Device,
    ctx: &Ctx<'_>,
) -> Result<EngineConfig, ConfigError> {
    let backend: EngineBackend = choice(ctx, "engine.backend", &raw.backend)?;
    // Checked as the remote backend will parse it, so a bad entry is refused here, not when
    // its replica first starts.
    for (i, url) in raw.remote_urls.iter().enumerate() {
        if let Err(sluice_http::HttpError::BadUrl { reason, .. }) =
            sluice_http::HttpClient::new(url, "remote engine")
        {
            return Err(ctx.value(
                &format!("engine.remote_urls[{i}]"),
                format!("expected an http://host:port[/prefix] base URL, got `{url}`: it {reason}"),
            ));
        }
    }
    // A head's servers are the engine nodes that join it; static ones are optional there.
    if backend == EngineBackend::Remote && raw.remote_urls.is_empty() && !head {
        return Err(ctx.value(
            "engine.remote_urls",
            "backend `remote` needs at least one base URL",
        ));
    }
    let timeout = number(
        ctx,
        "engine.request_timeout_s",
        raw.request_timeout_s,
        "a number of seconds > 0",
        |v| v > 0.0,
    )?;
    let mut replicas = non_zero_u32(ctx, "engine.replicas", raw.replicas)?;
    if backend == EngineBackend::Remote {
        // Each server is a replica of the engine actor, which does all the routing: at least one
        // replica per server (more wrap around the list).
        let servers = u32::try_from(raw.remote_urls.len()).unwrap_or(u32::MAX);
        replicas = replicas.max(std::num::NonZeroU32::new(servers).unwrap_or(replicas));
    }
    Ok(EngineConfig {
        backend,
        device,
        replicas,
        max_running_sequences: non_zero_u32(
            ctx,
            "engine.max_running_sequences",
            raw.max_running_sequences,
        )?,
        max_step_tokens: non_zero_u32(ctx, "engine.max_step_tokens", raw.max_step_tokens)?,
        threads: u32_incl_zero(ctx, "engine.threads", raw.threads)?,
        compute_dtype: raw
            .compute_dtype
            .as_deref()
            .map(|v| compute_dtype(v, device).map_err(|r| ctx.value("engine.compute_dtype", r)))
            .transpose()?,
        stacked_products: raw.stacked_products,
        cuda_graphs: match (raw.cuda_graphs, device) {
            (true, Device::Cpu) => {
                return Err(ctx.value(
                    "engine.cuda_graphs",
                    "CUDA graphs need a CUDA engine.device (this engine runs on the CPU)",
                ));
            }
            (on, _) => on,
        },
        kv_cache_mb: u32_incl_zero(ctx, "engine.kv_cache_mb", raw.kv_cache_mb)?,
        kv_block_tokens: non_zero_u32(ctx, "engine.kv_block_tokens", raw.kv_block_tokens)?,
        prefix_caching: raw.prefix_caching,
        prefix_cache_version_lag: u32_incl_zero(
            ctx,
            "engine.prefix_cache_version_lag",
            raw.prefix_cache_version_lag,
        )?,
        remote_urls: raw.remote_urls,
        request_timeout: Duration::from_secs_f64(timeout),
        remote_keep_versions: non_zero_u32(
            ctx,
            "engine.remote_keep_versions",
            raw.remote_keep_versions,
        )?,
        simulated: validate_sim_engine(raw.simulated, run_seed, ctx)?,
    })
}

/// `engine.compute_dtype` as a value for replicas on `device` (also `sluice serve
/// --compute-dtype`): `f32` or `bf16` on the CPU (bf16: products on AMX tiles; whether the
/// machine has them is checked when a replica starts). On a GPU the products run in the weights'
/// dtype, so the key is refused there in favour of `model.dtype`. `Err` holds the reason.
pub fn compute_dtype(value: &str, device: Device) -> Result<DType, String> {
    match (value.parse::<DType>(), device) {
        (Err(_), _) => Err(format!("expected `f32` or `bf16`, got `{value}`")),
        (Ok(DType::F16), _) => Err(
            "`f16` is not supported: use `bf16` or `f32` (or `model.dtype = \"f16\"` for f16 weights)"
                .into(),
        ),
        (Ok(d), Device::Cuda(_)) => Err(format!(
            "`{value}` on `{device}`: a GPU engine computes in its weights' dtype; set `model.dtype = \"{d}\"` instead"
        )),
        (Ok(d), Device::Cpu) => Ok(d),
    }
}

/// `--compute-dtype` of `sluice serve` and `sluice bench engine`: [`compute_dtype`] of the
/// flag's value, if given, with the flag named in the refusal.
pub fn compute_dtype_flag(value: Option<&str>, device: Device) -> Result<Option<DType>, String> {
    value
        .map(|v| compute_dtype(v, device).map_err(|reason| format!("--compute-dtype: {reason}")))
        .transpose()
}

fn validate_sim_engine(
    raw: RawSimEngine,
    run_seed: u64,
    ctx: &Ctx<'_>,
) -> Result<SimEngineConfig, ConfigError> {
    let k = |name: &str| format!("engine.simulated.{name}");
    let seconds =
        |name: &str, v: f64| number(ctx, &k(name), v, "a number of seconds ≥ 0", |v| v >= 0.0);
    let mut lengths = std::collections::BTreeMap::new();
    for (domain, d) in raw.lengths {
        let key = k(&format!("lengths.{domain}"));
        let dist = match d.distribution.as_str() {
            "fixed" => LengthDistribution::Fixed {
                tokens: non_zero_u32(ctx, &format!("{key}.tokens"), d.tokens)?.get(),
            },
            "uniform" => {
                let min = non_zero_u32(ctx, &format!("{key}.min"), d.min)?.get();
                let max = non_zero_u32(ctx, &format!("{key}.max"), d.max)?.get();
                if max < min {
                    return Err(ctx.value(
                        &format!("{key}.max"),
                        format!("expected an integer ≥ min ({min}), got {max}"),
                    ));
                }
                LengthDistribution::Uniform { min, max }
            }
            "lognormal" => LengthDistribution::Lognormal {
                median: number(
                    ctx,
                    &format!("{key}.median"),
                    d.median,
                    "a number ≥ 1",
                    |v| v >= 1.0,
                )?,
                sigma: non_negative(ctx, &format!("{key}.sigma"), d.sigma)?,
            },
            other => {
                return Err(ctx.value(
                    &format!("{key}.distribution"),
                    format!("expected one of fixed, uniform, lognormal, got `{other}`"),
                ));
            }
        };
        lengths.insert(domain, dist);
    }
    lengths
        .entry("default".to_owned())
        .or_insert(LengthDistribution::Lognormal {
            median: 128.0,
            sigma: 1.0,
        });
    Ok(SimEngineConfig {
        time_scale: seconds("time_scale", raw.time_scale)?,
        prefill_seconds_per_token: seconds(
            "prefill_seconds_per_token",
            raw.prefill_seconds_per_token,
        )?,
        decode_step_base_seconds: seconds(
            "decode_step_base_seconds",
            raw.decode_step_base_seconds,
        )?,
        decode_step_per_sequence_seconds: seconds(
            "decode_step_per_sequence_seconds",
            raw.decode_step_per_sequence_seconds,
        )?,
        prompt_tokens: non_zero_u32(ctx, &k("prompt_tokens"), raw.prompt_tokens)?,
        env_reply_tokens: u32_incl_zero(ctx, &k("env_reply_tokens"), raw.env_reply_tokens)?,
        lengths,
        seed: match raw.seed {
            Some(s) => u64_incl_zero(ctx, &k("seed"), s)?,
            None => run_seed,
        },
    })
}
