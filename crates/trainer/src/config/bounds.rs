//! Upper bounds of the numeric keys of `[trainer]` and `[trainer.simulated]`
//! (`sluice_core::config::bounds`): generous for real use, far below what breaks arithmetic or
//! memory. Resource keys are bounded by what one node holds.

use sluice_core::config::bounds::{
    Bound, MAX_COUNT, MAX_SIM_SECONDS, MAX_TOKENS, SIM, STEPS, TOKENS, bound,
};

/// The most `trainer.minibatches` (optimizer updates per step) a config may ask for; a
/// checkpoint whose optimizer took more updates than this per step is corrupt.
pub const MAX_MINIBATCHES: u32 = 1024;

/// Every bound of `[trainer]` and `[trainer.simulated]`.
pub const BOUNDS: &[Bound] = &[
    bound("trainer.learning_rate", 1.0, "the learning rate"),
    bound("trainer.threads", 1024.0, "compute threads of the trainer"),
    bound(
        "trainer.kept_logits_mib",
        1_048_576.0,
        "MiB of logits kept for the backward",
    ),
    bound("trainer.warmup_steps", MAX_COUNT, STEPS),
    bound("trainer.weight_decay", 1.0, "the decoupled weight decay"),
    bound("trainer.max_grad_norm", 1e6, "the gradient norm clip"),
    bound("trainer.clip_high", 100.0, "the upper ratio clip"),
    bound("trainer.kl_coef", 1000.0, "the KL penalty coefficient"),
    bound("trainer.dual_clip", 1e6, "the dual-clip bound"),
    bound(
        "trainer.entropy_coeff",
        100.0,
        "the entropy bonus coefficient",
    ),
    bound("trainer.micro_batch_size", 65_536.0, "rows per micro-batch"),
    bound("trainer.max_seq_len", MAX_TOKENS, TOKENS),
    bound(
        "trainer.minibatches",
        MAX_MINIBATCHES as f64,
        "optimizer updates per step",
    ),
    bound("trainer.is_cap", 1e6, "the importance-weight cap"),
    bound("trainer.lora_rank", 65_536.0, "the LoRA rank"),
    bound("trainer.lora_alpha", 1e6, "LoRA's alpha"),
    bound(
        "trainer.critic_learning_rate",
        1.0,
        "the critic's learning rate",
    ),
    bound("trainer.value_clip", 1e6, "the value clip"),
    bound("trainer.critic_warmup", MAX_COUNT, STEPS),
    bound(
        "trainer.kl_in_reward",
        1000.0,
        "the KL coefficient in the reward",
    ),
    bound("trainer.kl_in_reward_target", 1000.0, "the target KL"),
    bound(
        "trainer.kl_in_reward_horizon",
        1e9,
        "the KL controller's horizon",
    ),
    bound("trainer.simulated.step_base_seconds", MAX_SIM_SECONDS, SIM),
    bound(
        "trainer.simulated.step_seconds_per_token",
        MAX_SIM_SECONDS,
        SIM,
    ),
];
