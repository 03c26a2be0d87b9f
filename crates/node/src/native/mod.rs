//! The native pipeline: what a node needs beyond the simulated defaults to train a real model —
//! the checkpoint's renderer, env sessions over registered tasks, dataset-backed samples, the
//! candle trainer and native (or remote) engine replicas — plus the supervised warm-start and
//! the held-out evaluator the quickstart uses.

pub mod eval;
pub mod renderer;
pub mod setup;
pub mod task_env;
pub mod warmup;

pub use eval::{Evaluation, Evaluator};
pub use renderer::ModelRenderer;
pub use setup::{NativeSetup, ensure_model_dir};
pub use task_env::TaskEnv;
pub use warmup::{
    DemoStream, Demonstration, WarmupProbe, WarmupProgress, WarmupReport, WarmupSettings,
    demonstrations, warm_start,
};
