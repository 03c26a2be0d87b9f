//! Checks between keys of different sections, once each section is valid on its own.

use sluice_core::config::ConfigError;
use sluice_core::config::check::Ctx;
use sluice_engine::config::EngineBackend;

use crate::sections::NodeRole;
use crate::typed::Config;

/// Refuses combinations that each key alone allows but that cannot do what they say.
pub(crate) fn check(config: &Config, ctx: &Ctx<'_>) -> Result<(), ConfigError> {
    // The simulated trainer publishes weights no real engine can load, and a real trainer has
    // no simulated engine to feed it tokens of a real tokenizer: the two go together.
    let simulated_engine = config.engine.backend == EngineBackend::Simulated;
    if simulated_engine != config.trainer.simulated.enabled {
        let backend = match config.engine.backend {
            EngineBackend::Native => "native",
            EngineBackend::Remote => "remote",
            EngineBackend::Simulated => "simulated",
        };
        return Err(ctx.value(
            "trainer.simulated.enabled",
            format!(
                "expected {simulated_engine} with engine.backend = \"{backend}\" (the simulated engine and the simulated trainer go together), got {}",
                config.trainer.simulated.enabled
            ),
        ));
    }
    // Minibatches hold whole groups: more minibatches than groups per step would silently take
    // fewer optimizer updates than asked (one per group).
    let minibatches = config.trainer.minibatches.get();
    let groups = config.rollout.groups_per_step.get();
    if minibatches > groups {
        return Err(ctx.value(
            "trainer.minibatches",
            format!(
                "expected at most rollout.groups_per_step ({groups}): each minibatch holds whole groups; got {minibatches}"
            ),
        ));
    }
    // The store must hold a whole batch, or the trainer's batch could never fill.
    if let Some(capacity) = config.replay.capacity
        && capacity.get() < u64::from(groups)
    {
        return Err(ctx.value(
            "replay.capacity",
            format!(
                "expected at least rollout.groups_per_step ({groups}): the store must hold a whole batch; got {capacity}"
            ),
        ));
    }
    // Engine nodes fetch weights from the head's admin API: it must be an address they reach.
    if let Some(node) = &config.node
        && node.role == NodeRole::Head
        && node.advertise.is_none()
        && (config.admin.listen.ip().is_unspecified() || config.admin.listen.port() == 0)
    {
        return Err(ctx.value(
            "node.advertise",
            format!(
                "admin.listen = {} is not an address engine nodes can reach: set node.advertise to the head's URL",
                config.admin.listen
            ),
        ));
    }
    // Only a head has env nodes joined to it.
    let head = config
        .node
        .as_ref()
        .is_some_and(|n| n.role == NodeRole::Head);
    if let Some((domain, _)) = config
        .data
        .domain_options
        .iter()
        .find(|(_, d)| d.env_nodes && !head)
    {
        return Err(ctx.value(
            &format!("data.domains.{domain}.env_nodes"),
            "only a head (node.role = \"head\") has env nodes joined to it; use env_url for an env server of your own",
        ));
    }
    // The overlong buffer lies inside every turn budget: a larger one would charge replies for
    // tokens no budget lets them write.
    let buffer = config.rollout.overlong_buffer_tokens;
    let budgets = std::iter::once((
        "rollout.max_new_tokens".to_owned(),
        config.rollout.max_new_tokens.get(),
    ))
    .chain(
        config
            .data
            .turn_token_overrides()
            .into_iter()
            .map(|(d, n)| (format!("data.domains.{d}.max_new_tokens"), n)),
    );
    for (key, budget) in budgets {
        if buffer > budget {
            return Err(ctx.value(
                "rollout.overlong_buffer_tokens",
                format!("expected at most {key} ({budget}): the buffer is the last tokens of each turn budget; got {buffer}"),
            ));
        }
    }
    // A head's engines are the engine nodes that join it: remote servers of the engine actor.
    if let Some(node) = &config.node
        && node.role == NodeRole::Head
        && config.engine.backend != EngineBackend::Remote
    {
        return Err(ctx.value(
            "engine.backend",
            "a head (node.role = \"head\") routes to the engine nodes that join it: expected \"remote\"",
        ));
    }
    Ok(())
}
