//! Checks between keys of different sections, once each section is valid on its own.

use super::Ctx;
use crate::config::error::ConfigError;
use crate::config::typed::Config;

/// Refuses combinations that each key alone allows but that cannot do what they say.
pub(crate) fn check(config: &Config, ctx: &Ctx<'_>) -> Result<(), ConfigError> {
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
