//! The process's peak resident memory, from the kernel (Linux; `None` elsewhere).

/// Restarts the kernel's peak-resident count of this process (Linux ≥ 4.0; a no-op elsewhere).
pub fn reset_peak() {
    let _ = std::fs::write("/proc/self/clear_refs", "5");
}

/// Peak resident memory of this process (`VmHWM`) since the start or the last [`reset_peak`],
/// MiB.
pub fn peak_mib() -> Option<f64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
    let kib: f64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib / 1024.0)
}
