//! Library use of `sluice-core`: load a config with overrides, then change a knob the way the admin
//! API does, and watch the change arrive.
//!
//! ```text
//! cargo run --example validate_config -- configs/quickstart.toml rollout.group_size=4
//! ```

use sluice_config::{self as config, Override};
use sluice_core::{KnobPatch, KnobsHandle};

fn main() -> anyhow::Result<()> {
    let mut args = std::env::args().skip(1);
    let path = args
        .next()
        .unwrap_or_else(|| "configs/quickstart.toml".into());
    let overrides = args
        .map(|a| a.parse::<Override>().map_err(anyhow::Error::msg))
        .collect::<anyhow::Result<Vec<_>>>()?;
    let config = config::load(path.as_ref(), &overrides)?;
    println!(
        "run {} ({} groups of {} per step)",
        config.run.name, config.rollout.groups_per_step, config.rollout.group_size
    );

    let knobs = KnobsHandle::new(
        config.rollout.knobs.clone(),
        config.rollout.groups_per_step.get(),
        config.data.domains(),
    )?;
    let mut watcher = knobs.subscribe();
    let changes = knobs.update(&KnobPatch::from_assignments(&["staleness_threshold=0.2"])?)?;
    for c in &changes {
        println!("{}: {} -> {}", c.knob, c.old, c.new);
    }
    assert!(watcher.has_changed()?);
    println!(
        "a watcher sees staleness_threshold = {}",
        watcher.borrow_and_update().staleness_threshold
    );

    // A bad value is refused with the knob's name, and nothing changes.
    let refused = knobs.update(&KnobPatch::from_assignments(&[
        "max_concurrent_rollouts=2000000",
    ])?);
    println!("refused: {}", refused.unwrap_err());
    Ok(())
}
