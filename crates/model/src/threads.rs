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
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

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

/// While it lives, the other threads of the current pool poll for work instead of sleeping
/// ([`keep_awake`]); dropping it lets them sleep again.
#[derive(Debug)]
#[must_use = "the pool's threads sleep again as soon as this is dropped"]
pub struct KeepAwake {
    stop: Arc<AtomicBool>,
}

impl Drop for KeepAwake {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
    }
}

/// How long a polling thread goes without finding work before it sleeps anyway: a step's serial
/// stretches are far shorter, and a caller that forgets the guard loses at most this much of a
/// core.
const POLL_IDLE_LIMIT: Duration = Duration::from_millis(2);

/// Keeps the current pool's other threads polling for work (rayon's `yield_now`) while the
/// returned guard lives, so each parallel section of a step starts on every thread at once.
///
/// Why: an idle rayon thread sleeps after a few microseconds, and waking it costs a system call
/// and, on a virtual machine, a wake-up of the virtual CPU: a short parallel section is then
/// over before the other thread joins it. A decode step has hundreds of them; with the replica's
/// threads polling, SmolLM2's decode at 64 in flight ran about 1.24× as fast on the 2-core
/// development machine (`sluice bench engine --warm-up`, alternated with the build before). The polling thread's core is
/// busy meanwhile, so this is for a role that owns its cores (an engine replica's
/// `engine.threads`), for one step at a time. `None` outside a pool or in a pool of one thread.
pub fn keep_awake() -> Option<KeepAwake> {
    let caller = rayon::current_thread_index()?;
    if rayon::current_num_threads() < 2 {
        return None;
    }
    let stop = Arc::new(AtomicBool::new(false));
    let flag = Arc::clone(&stop);
    rayon::spawn_broadcast(move |ctx| {
        if ctx.index() != caller {
            poll_for_work(&flag);
        }
    });
    Some(KeepAwake { stop })
}

/// Runs the pool's pending jobs as they come until `stop`, or until none came for
/// [`POLL_IDLE_LIMIT`].
fn poll_for_work(stop: &AtomicBool) {
    let mut idle_since: Option<Instant> = None;
    while !stop.load(Ordering::Acquire) {
        match rayon::yield_now() {
            Some(rayon::Yield::Executed) => idle_since = None,
            Some(rayon::Yield::Idle) => {
                if idle_since.get_or_insert_with(Instant::now).elapsed() > POLL_IDLE_LIMIT {
                    return;
                }
                std::hint::spin_loop();
            }
            None => return,
        }
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

    /// Work started while the guard lives completes on both threads (no job is lost to the
    /// polling loop), and there is no guard outside a pool or in a pool of one.
    #[test]
    fn a_kept_awake_pool_runs_every_job() {
        let pool = ComputePool::new("awake-pool", 2).unwrap();
        let sums = pool.install(|| {
            let _awake = keep_awake().expect("a pool of two");
            (0..20)
                .map(|i| {
                    std::thread::sleep(Duration::from_millis(1));
                    let (a, b) = rayon::join(|| i, || 2 * i);
                    a + b
                })
                .sum::<i32>()
        });
        assert_eq!(sums, 3 * (0..20).sum::<i32>());
        let single = ComputePool::new("one-thread", 1).unwrap();
        assert!(single.install(keep_awake).is_none());
        assert!(keep_awake().is_none(), "outside any pool");
    }

    /// A polling thread with its stop set returns, and one never stopped returns on its own
    /// after [`POLL_IDLE_LIMIT`] without work (not before): a forgotten guard does not hold a
    /// core for ever.
    #[test]
    fn polling_ends_on_stop_and_when_idle() {
        let pool = ComputePool::new("poll-pool", 1).unwrap();
        let stop = AtomicBool::new(true);
        pool.install(|| poll_for_work(&stop));
        stop.store(false, Ordering::Release);
        let start = Instant::now();
        pool.install(|| poll_for_work(&stop));
        assert!(
            start.elapsed() >= POLL_IDLE_LIMIT,
            "idle polling lasts the limit, then ends"
        );
        // Outside a pool there is nothing to poll.
        poll_for_work(&stop);
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
