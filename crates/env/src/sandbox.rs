//! Runs an untrusted program (a model's answer) in a child process that can hurt neither the
//! env server nor the machine: limits set in the child between `fork` and `exec` (`pre_exec`),
//! a wall-clock deadline, and no network.
//!
//! | threat | defence |
//! |---|---|
//! | busy loop | `RLIMIT_CPU` (the kernel kills the child at `cpu_seconds`) and the wall-clock kill |
//! | sleep forever | the wall-clock kill (`wall`): the whole process group gets `SIGKILL` |
//! | huge allocation | `RLIMIT_AS` (`memory_bytes`): the allocation fails inside the child |
//! | fork bomb | `RLIMIT_NPROC` (`max_processes`) and the process-group kill at the end |
//! | network access | a fresh user + network namespace (`unshare(CLONE_NEWUSER \| CLONE_NEWNET)`): only a downed loopback |
//! | huge output | stdout and stderr are read up to `max_output_bytes` each |
//! | filling the disk | a fresh mount namespace with a tmpfs of [`SCRATCH_BYTES`] over each world-writable directory (`/tmp`, the working directory, `/var/tmp`, `/dev/shm`), gone with the run; `RLIMIT_FSIZE` ([`SCRATCH_BYTES`]) on every file |
//!
//! `RLIMIT_NPROC` counts every process of the child's user, and the kernel does not apply it to
//! root: when the server runs as root, each run drops to a uid of its own (from
//! [`SANDBOX_UID_BASE`], no passwd entry needed), so concurrent runs have separate budgets. The
//! calling process becomes a child subreaper: a fork bomb's orphans are reparented to it and
//! reaped after the group kill (an init that does not reap, as in many containers, would
//! otherwise keep them as zombies counting against the budget). When the kernel refuses a namespace
//! (user namespaces disabled), the program is not run: [`SandboxError::Spawn`] says why, and
//! the rollout fails. A program that calls `setsid()` and sleeps leaves the process group and
//! outlives the group kill (it holds no CPU, no network and at most `memory_bytes`); a PID
//! namespace would close that gap.
//!
//! `unsafe` here is the `pre_exec` hook and the raw syscalls it makes (the only way to confine
//! the child before it runs anything); each block says what it touches.

#![allow(unsafe_code)]

use std::process::Stdio;
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWriteExt};
use tokio::process::Command;

/// Limits of one sandboxed run.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SandboxLimits {
    /// CPU seconds (`RLIMIT_CPU`).
    pub cpu_seconds: u64,
    /// Address space, bytes (`RLIMIT_AS`).
    pub memory_bytes: u64,
    /// Processes of the child's user (`RLIMIT_NPROC`).
    pub max_processes: u64,
    /// Wall-clock deadline of the whole run.
    pub wall: Duration,
    /// Bytes kept of stdout and of stderr each.
    pub max_output_bytes: usize,
}

impl Default for SandboxLimits {
    fn default() -> Self {
        Self {
            cpu_seconds: 2,
            memory_bytes: 256 << 20,
            max_processes: 32,
            wall: Duration::from_secs(5),
            max_output_bytes: 64 << 10,
        }
    }
}

/// How the program ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Ending {
    /// It exited with this code.
    Exited(i32),
    /// A signal killed it (`SIGXCPU`/`SIGKILL` at the CPU limit, `SIGSEGV`, …).
    Signaled(i32),
    /// It ran past the wall-clock deadline and was killed.
    WallTimeout,
}

/// What a run produced.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SandboxRun {
    /// How it ended.
    pub ending: Ending,
    /// Standard output (lossy UTF-8, at most `max_output_bytes`).
    pub stdout: String,
    /// Standard error (lossy UTF-8, at most `max_output_bytes`).
    pub stderr: String,
}

impl SandboxRun {
    /// Exited with code 0.
    pub fn succeeded(&self) -> bool {
        self.ending == Ending::Exited(0)
    }

    /// A one-line account of a run that did not succeed (for the rollout's error).
    pub fn failure(&self) -> String {
        let last_error_line = self.stderr.lines().rev().find(|l| !l.trim().is_empty());
        let how = match self.ending {
            Ending::Exited(code) => format!("exited with code {code}"),
            Ending::Signaled(sig) => format!("killed by signal {sig}"),
            Ending::WallTimeout => "ran past its wall-clock limit and was killed".to_owned(),
        };
        match last_error_line {
            Some(line) => format!("program {how}: {line}"),
            None => format!("program {how}"),
        }
    }
}

/// Why a program could not be run at all.
#[derive(Debug, thiserror::Error)]
pub enum SandboxError {
    /// The child could not be started inside its limits (a refused namespace, no such program).
    #[error("cannot start `{program}` in the sandbox: {source}")]
    Spawn {
        /// The program.
        program: String,
        /// The OS error (from `fork`, a `pre_exec` step or `exec`).
        #[source]
        source: std::io::Error,
    },
    /// Talking to the child failed.
    #[error("sandboxed `{program}`: {source}")]
    Io {
        /// The program.
        program: String,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
}

/// Bytes a program may write: the size of each private tmpfs, and the largest file
/// (`RLIMIT_FSIZE`; a write past it fails, `SIGXFSZ` ends the program).
pub const SCRATCH_BYTES: u64 = 16 << 20;

/// The world-writable directories each run gets a private tmpfs over (absent ones are skipped).
const SCRATCH_DIRS: [&std::ffi::CStr; 3] = [c"/tmp", c"/var/tmp", c"/dev/shm"];

/// The tmpfs options of a scratch directory (sticky and writable by all, as `/tmp` is).
const SCRATCH_OPTIONS: &std::ffi::CStr = c"size=16m,mode=1777";
const _: () = assert!(SCRATCH_BYTES == 16 << 20, "SCRATCH_OPTIONS names the size");

/// First uid (and gid) of the runs of a root server; run `n` gets `SANDBOX_UID_BASE + n mod 2¹⁶`.
pub const SANDBOX_UID_BASE: libc::uid_t = 1_500_000_000;

/// Runs started, for their uids.
static RUNS: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);

fn check(ret: libc::c_int) -> std::io::Result<()> {
    if ret == -1 {
        Err(std::io::Error::last_os_error())
    } else {
        Ok(())
    }
}

fn set_limit(resource: libc::__rlimit_resource_t, value: u64) -> std::io::Result<()> {
    let limit = libc::rlimit {
        rlim_cur: value,
        rlim_max: value,
    };
    // SAFETY: setrlimit reads the struct we pass and touches nothing else.
    check(unsafe { libc::setrlimit(resource, &limit) })
}

/// What the child writes into `/proc/self/{setgroups,uid_map,gid_map}` once in its own user
/// namespace: its uid and gid mapped to themselves, so files it creates on its scratch tmpfs
/// have an owner there (an unmapped one cannot create any). Formatted before the fork.
struct IdMaps {
    uid_map: Vec<u8>,
    gid_map: Vec<u8>,
}

impl IdMaps {
    /// The maps of a child that runs as `uid`/`gid` after [`confine`]'s drop (when root), or
    /// as this process's own ids.
    fn new(sandbox_id: libc::uid_t) -> Self {
        // SAFETY: reads the calling process's ids.
        let (euid, egid) = unsafe { (libc::geteuid(), libc::getegid()) };
        let (uid, gid) = if euid == 0 {
            (sandbox_id, sandbox_id)
        } else {
            (euid, egid)
        };
        Self {
            uid_map: format!("{uid} {uid} 1").into_bytes(),
            gid_map: format!("{gid} {gid} 1").into_bytes(),
        }
    }
}

/// Writes `data` to the file `path` (async-signal-safe: raw syscalls, no allocation).
fn write_proc(path: &std::ffi::CStr, data: &[u8]) -> std::io::Result<()> {
    // SAFETY: opens, writes and closes a file of the calling process's own /proc entry.
    unsafe {
        let fd = libc::open(path.as_ptr(), libc::O_WRONLY | libc::O_CLOEXEC);
        check(fd)?;
        let written = libc::write(fd, data.as_ptr().cast(), data.len());
        let error = std::io::Error::last_os_error();
        libc::close(fd);
        if written != data.len() as isize {
            return Err(error);
        }
    }
    Ok(())
}

/// The child's confinement, between fork and exec. Only async-signal-safe calls (raw
/// syscalls, no allocation).
fn confine(limits: &SandboxLimits, uid: libc::uid_t, ids: &IdMaps) -> std::io::Result<()> {
    // SAFETY: plain syscalls on the calling (child) process.
    unsafe {
        check(libc::setpgid(0, 0))?;
        set_limit(libc::RLIMIT_CPU, limits.cpu_seconds)?;
        set_limit(libc::RLIMIT_AS, limits.memory_bytes)?;
        set_limit(libc::RLIMIT_NPROC, limits.max_processes)?;
        set_limit(libc::RLIMIT_CORE, 0)?;
        set_limit(libc::RLIMIT_FSIZE, SCRATCH_BYTES)?;
        if libc::geteuid() == 0 {
            check(libc::setgroups(0, std::ptr::null()))?;
            check(libc::setgid(uid))?;
            check(libc::setuid(uid))?;
            // Changing ids made the process undumpable, which gives its /proc files to root:
            // the id maps below could not be written (exec resets the flag anyway).
            check(libc::prctl(libc::PR_SET_DUMPABLE, 1, 0, 0, 0))?;
        }
        check(libc::unshare(
            libc::CLONE_NEWUSER | libc::CLONE_NEWNET | libc::CLONE_NEWNS,
        ))?;
    }
    write_proc(c"/proc/self/setgroups", b"deny")?;
    write_proc(c"/proc/self/uid_map", &ids.uid_map)?;
    write_proc(c"/proc/self/gid_map", &ids.gid_map)?;
    for dir in SCRATCH_DIRS {
        // SAFETY: mounts a fresh tmpfs in the child's own mount namespace; the strings are
        // static and NUL-terminated.
        let mounted = unsafe {
            libc::mount(
                c"sluice-sandbox".as_ptr(),
                dir.as_ptr(),
                c"tmpfs".as_ptr(),
                libc::MS_NOSUID | libc::MS_NODEV,
                SCRATCH_OPTIONS.as_ptr().cast(),
            )
        };
        if mounted == -1 {
            let error = std::io::Error::last_os_error();
            if error.raw_os_error() != Some(libc::ENOENT) {
                return Err(error);
            }
        }
    }
    // The working directory was entered before the mounts: enter the private one.
    // SAFETY: changes the calling process's working directory.
    check(unsafe { libc::chdir(c"/tmp".as_ptr()) })?;
    Ok(())
}

/// Reads at most `max` bytes of `pipe`, then drains (and drops) the rest so the child never
/// blocks on a full pipe.
async fn read_capped(mut pipe: impl AsyncRead + Unpin, max: usize) -> std::io::Result<String> {
    let mut kept = Vec::new();
    let mut buf = [0u8; 8192];
    loop {
        let n = pipe.read(&mut buf).await?;
        if n == 0 {
            break;
        }
        let room = max.saturating_sub(kept.len());
        kept.extend_from_slice(&buf[..n.min(room)]);
    }
    Ok(String::from_utf8_lossy(&kept).into_owned())
}

/// Runs `program args…` with `stdin` under `limits`, in its own process group with no network.
pub async fn run(
    program: &str,
    args: &[&str],
    stdin: &[u8],
    limits: &SandboxLimits,
) -> Result<SandboxRun, SandboxError> {
    let io = |source| SandboxError::Io {
        program: program.to_owned(),
        source,
    };
    let mut command = Command::new(program);
    command
        .args(args)
        .env_clear()
        .env("PATH", "/usr/local/bin:/usr/bin:/bin")
        .current_dir("/tmp")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true);
    let child_limits = limits.clone();
    let uid =
        SANDBOX_UID_BASE + RUNS.fetch_add(1, std::sync::atomic::Ordering::Relaxed) % (1 << 16);
    let ids = IdMaps::new(uid);
    become_subreaper();
    // SAFETY: `confine` makes only async-signal-safe syscalls and allocates nothing.
    unsafe {
        command.pre_exec(move || confine(&child_limits, uid, &ids));
    }
    let mut child = command.spawn().map_err(|source| SandboxError::Spawn {
        program: program.to_owned(),
        source,
    })?;
    let pgid = child.id().map(|id| id as libc::pid_t);
    let mut input = child.stdin.take().expect("stdin is piped");
    let stdout = child.stdout.take().expect("stdout is piped");
    let stderr = child.stderr.take().expect("stderr is piped");
    let max = limits.max_output_bytes;
    let work = async {
        // A program that never reads its input must not block us: write errors are ignored.
        let _ = input.write_all(stdin).await;
        drop(input);
        let (out, err, status) = tokio::join!(
            read_capped(stdout, max),
            read_capped(stderr, max),
            child.wait()
        );
        Ok::<_, std::io::Error>((out?, err?, status?))
    };
    let result = tokio::time::timeout(limits.wall, work).await;
    // Whatever happened, nothing of the group survives the run (a fork bomb's children
    // outlive their parent otherwise).
    if let Some(pgid) = pgid {
        // SAFETY: signals the process group we created; harmless if it is gone.
        unsafe {
            libc::kill(-pgid, libc::SIGKILL);
        }
    }
    if result.is_err() {
        let _ = child.wait().await;
    }
    if let Some(pgid) = pgid {
        reap_group(pgid).await;
    }
    match result {
        Err(_) => Ok(SandboxRun {
            ending: Ending::WallTimeout,
            stdout: String::new(),
            stderr: String::new(),
        }),
        Ok(Err(e)) => Err(io(e)),
        Ok(Ok((stdout, stderr, status))) => {
            use std::os::unix::process::ExitStatusExt;
            let ending = match (status.code(), status.signal()) {
                (Some(code), _) => Ending::Exited(code),
                (None, Some(sig)) => Ending::Signaled(sig),
                (None, None) => Ending::Exited(-1),
            };
            Ok(SandboxRun {
                ending,
                stdout,
                stderr,
            })
        }
    }
}

/// Makes this process the reaper of its orphaned descendants (once).
fn become_subreaper() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        // SAFETY: sets a flag on the calling process.
        if unsafe { libc::prctl(libc::PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) } == -1 {
            tracing::warn!(
                error = %std::io::Error::last_os_error(),
                "cannot become a child subreaper: a fork bomb's orphans stay zombies until init reaps them"
            );
        }
    });
}

/// Reaps what is left of process group `pgid` after its `SIGKILL` (the orphans reparented to
/// us), for at most about two seconds.
async fn reap_group(pgid: libc::pid_t) {
    for _ in 0..200 {
        // SAFETY: waits only for our children in the group we created (not tokio's others).
        let pid = unsafe { libc::waitpid(-pgid, std::ptr::null_mut(), libc::WNOHANG) };
        match pid {
            // Some are still dying.
            0 => tokio::time::sleep(Duration::from_millis(10)).await,
            // None left (ECHILD).
            -1 => return,
            _ => {}
        }
    }
}
