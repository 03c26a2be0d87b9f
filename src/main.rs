//! The `sluice` binary: parse arguments, set up logging, hand over to a command.

mod cli;
mod commands;

use std::process::ExitCode;

use clap::Parser;

/// candle allocates every op's result: with glibc, blocks past its mmap threshold go back to the
/// kernel on free and come back as fresh zeroed pages, a page fault per 4 KiB (a quarter of the
/// quickstart's CPU time before). mimalloc keeps freed memory for reuse once its purge delay is
/// raised ([`keep_freed_pages`]). (jemalloc, also tried, re-faults its large zeroed blocks.)
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// `mi_option_purge_delay` in mimalloc 3's `mi_option_e` (the Rust bindings name no constant
/// for it).
const MI_OPTION_PURGE_DELAY_V3: std::ffi::c_int = 15;

/// Freed memory is never given back to the kernel (purge delay -1; mimalloc's default is 1 s):
/// a training step frees and reallocates the same sizes many times a step, and each purged huge
/// page comes back as a fault and a 2 MiB clear (`sluice bench trainer`, tiny 32×128: 14,754
/// page faults at 1 s, 628 at 10 s). A 10 s delay was not enough for SmolLM2-135M at [8×128],
/// whose step takes longer than that on 2 busy cores: 19 s of its 50 CPU seconds were the
/// kernel clearing pages, 8 s with no purging, for a peak RSS 3 % higher (the process reaches
/// that peak every step anyway). `MIMALLOC_PURGE_DELAY` in the environment still wins.
#[allow(unsafe_code)]
fn keep_freed_pages() {
    if std::env::var_os("MIMALLOC_PURGE_DELAY").is_some() {
        return;
    }
    // SAFETY: plain getters/setters of mimalloc's option table, callable at any time; the
    // option index is checked against the major version it belongs to.
    unsafe {
        // `mi_version()` is major·10000 + minor·100 + patch.
        if libmimalloc_sys::mi_version() / 10_000 == 3 {
            libmimalloc_sys::mi_option_set(MI_OPTION_PURGE_DELAY_V3, -1);
        }
    }
}

fn main() -> ExitCode {
    set_thread_env();
    keep_freed_pages();
    let cli = cli::Cli::parse();
    init_logging();
    match commands::run(cli.command) {
        Ok(code) => code,
        Err(e) => {
            // One line, the whole cause chain: scripts grep it, humans read it.
            eprintln!("error: {}", one_line(&e));
            ExitCode::FAILURE
        }
    }
}

/// `e` and its causes on one line, each said once: many errors already end with their cause's
/// text (`{path}: {source}`), which `{e:#}` would print a second time.
fn one_line(e: &anyhow::Error) -> String {
    let mut line = String::new();
    for cause in e.chain() {
        let text = cause.to_string();
        if line.ends_with(&text) {
            continue;
        }
        if !line.is_empty() {
            line.push_str(": ");
        }
        line.push_str(&text);
    }
    line
}

/// Fixes candle's thread environment before anything reads it (see `sluice_model::threads`):
/// without it, every matrix product re-reads `/proc/cpuinfo`, and element-wise ops of every
/// role share one spinning pool. Values the user exported are kept.
#[allow(unsafe_code)]
fn set_thread_env() {
    let is_set = |name: &str| std::env::var_os(name).is_some();
    for (name, value) in sluice_model::threads::process_thread_env(is_set) {
        // SAFETY: called first thing in `main`, before any thread exists, so nothing can read
        // the environment concurrently.
        unsafe { std::env::set_var(name, value) };
    }
}

fn init_logging() {
    use tracing_subscriber::EnvFilter;
    let filter = EnvFilter::try_from_env("SLUICE_LOG").unwrap_or_else(|_| EnvFilter::new("info"));
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_target(false)
        .init();
}
