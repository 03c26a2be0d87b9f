//! Checks between keys of different sections, once each section is valid on its own.

use super::Ctx;
use crate::config::error::ConfigError;
use crate::config::typed::{Config, EngineBackend};

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
    Ok(())
}
