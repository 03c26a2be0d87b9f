//! Compute threads: how many cores a role (engine replica, trainer) uses, and the pool its
//! matrix products run on.
//!
//! candle parallelises two ways on the CPU. Matrix products go through `gemm`, which splits its
//! work over the *current* rayon pool; element-wise ops of 64 Ki elements or more go through
//! candle's own barrier pool, a single process-wide pool whose worker spins (and whose caller
//! spins) until every slice is done. Two facts make the defaults costly on a small node
//! (measured with `perf` on the quickstart, docs/trainer.md):
//!
//! * candle asks for the thread count on every matrix product, and without `RAYON_NUM_THREADS`
//!   in the environment the answer is `num_cpus::get_physical()`, which reads and parses
//!   `/proc/cpuinfo` each time;
//! * the barrier pool is shared by every role and spins while it waits: when the engine and the
//!   trainer both run, each spins on a core the other needs.
//!
//! So the binary fixes `RAYON_NUM_THREADS` and `CANDLE_NUM_THREADS=1` once at start
//! ([`process_thread_env`]), and each role runs its model work inside its own [`ComputePool`] of
//! `engine.threads` / `trainer.threads` threads, where `gemm` finds it. Element-wise ops then
//! run on the role's own thread.

use std::num::NonZeroUsize;
use std::sync::{Arc, OnceLock};

use crate::error::{ModelError, Result};

/// The cores this process may use (its CPU affinity and cgroup quota), computed once.
pub fn available_cores() -> usize {
    static CORES: OnceLock<usize> = OnceLock::new();
    *CORES.get_or_init(|| {
        std::thread::available_parallelism()
            .map(NonZeroUsize::get)
            .unwrap_or(1)
    })
}

/// The environment the binary sets at start, before any thread exists, for each variable the
/// user has not set: `RAYON_NUM_THREADS` (the core count, so candle stops re-reading
/// `/proc/cpuinfo` per matrix product) and `CANDLE_NUM_THREADS=1` (element-wise ops on the
/// calling thread, no process-wide spinning pool). Returns `(name, value)` pairs to set.
pub fn process_thread_env(is_set: impl Fn(&str) -> bool) -> Vec<(&'static str, String)> {
    let mut out = Vec::new();
    if !is_set("RAYON_NUM_THREADS") {
        out.push(("RAYON_NUM_THREADS", available_cores().to_string()));
    }
    if !is_set("CANDLE_NUM_THREADS") {
        out.push(("CANDLE_NUM_THREADS", "1".to_owned()));
    }
    out
}

/// The threads a role gets: `configured` when it is not 0, else its `share` of the cores
/// (`1` = all of them, `2` = half, rounded up), at least 1.
pub fn role_threads(configured: u32, share: usize) -> usize {
    if configured > 0 {
        configured as usize
    } else {
        available_cores().div_ceil(share.max(1)).max(1)
    }
}

/// A role's own rayon pool: model work run through [`ComputePool::install`] splits its matrix
/// products over these threads only. Cheap to clone (shared).
#[derive(Clone)]
pub struct ComputePool {
    pool: Arc<rayon::ThreadPool>,
}

impl std::fmt::Debug for ComputePool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ComputePool")
            .field("threads", &self.threads())
            .finish()
    }
}

impl ComputePool {
    /// A pool of `threads` (≥ 1) threads named `{name}-{i}`.
    pub fn new(name: &str, threads: usize) -> Result<Self> {
        let prefix = name.to_owned();
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads.max(1))
            .thread_name(move |i| format!("{prefix}-{i}"))
            .build()
            .map_err(|e| ModelError::input(format!("starting the {name} threads: {e}")))?;
        Ok(Self {
            pool: Arc::new(pool),
        })
    }

    /// Its thread count.
    pub fn threads(&self) -> usize {
        self.pool.current_num_threads()
    }

    /// Runs `f` on one of the pool's threads (the caller waits); rayon and `gemm` work started
    /// inside stays in the pool.
    pub fn install<R: Send>(&self, f: impl FnOnce() -> R + Send) -> R {
        self.pool.install(f)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn roles_get_their_configured_threads_or_a_share_of_the_cores() {
        assert_eq!(role_threads(3, 2), 3);
        let cores = available_cores();
        assert_eq!(role_threads(0, 1), cores);
        assert_eq!(role_threads(0, 2), cores.div_ceil(2));
        assert!(role_threads(0, 1000) >= 1);
    }

    #[test]
    fn process_env_leaves_what_the_user_set() {
        let all = process_thread_env(|_| false);
        assert_eq!(
            all,
            vec![
                ("RAYON_NUM_THREADS", available_cores().to_string()),
                ("CANDLE_NUM_THREADS", "1".to_owned())
            ]
        );
        assert!(process_thread_env(|_| true).is_empty());
    }

    #[test]
    fn work_runs_inside_the_pool() {
        let pool = ComputePool::new("test-pool", 2).unwrap();
        assert_eq!(pool.threads(), 2);
        let (threads, name) = pool.install(|| {
            (
                rayon::current_num_threads(),
                std::thread::current().name().map(str::to_owned),
            )
        });
        assert_eq!(threads, 2);
        assert!(name.unwrap().starts_with("test-pool-"));
    }
}
