//! Compiles Sluice's CUDA kernels (`kernels/*.cu`) to PTX in a `cuda` build, as candle compiles
//! its own: the driver turns the PTX into machine code for the GPU it finds when a kernel is
//! first loaded. `NVCC` names the compiler (default `nvcc` on `PATH`) and `CUDA_COMPUTE_CAP`
//! the virtual architecture (`90` for H100/H200; docs/gpu.md). A CPU build compiles nothing.

use std::path::{Path, PathBuf};
use std::process::Command;

fn main() {
    println!("cargo::rerun-if-changed=kernels");
    println!("cargo::rerun-if-env-changed=NVCC");
    println!("cargo::rerun-if-env-changed=CUDA_COMPUTE_CAP");
    if std::env::var_os("CARGO_FEATURE_CUDA").is_none() {
        return;
    }
    let out = PathBuf::from(std::env::var_os("OUT_DIR").expect("cargo sets OUT_DIR"));
    let nvcc = std::env::var_os("NVCC").unwrap_or_else(|| "nvcc".into());
    let cap = compute_cap();
    let mut sources: Vec<PathBuf> = std::fs::read_dir("kernels")
        .expect("crates/model/kernels")
        .map(|e| e.expect("kernels/ entry").path())
        .filter(|p| p.extension().is_some_and(|e| e == "cu"))
        .collect();
    sources.sort();
    for src in &sources {
        let ptx = out.join(Path::new(src.file_stem().expect("a .cu name")).with_extension("ptx"));
        let status = Command::new(&nvcc)
            .args(["--ptx", "-O3", "-std=c++17"])
            .arg(format!("-arch=compute_{cap}"))
            .arg("-o")
            .arg(&ptx)
            .arg(src)
            .status()
            .unwrap_or_else(|e| panic!("cannot run {nvcc:?} (set NVCC; docs/gpu.md): {e}"));
        assert!(status.success(), "{nvcc:?} failed on {}", src.display());
    }
}

/// `CUDA_COMPUTE_CAP`, else the first GPU's as `nvidia-smi` reports it.
fn compute_cap() -> String {
    if let Ok(cap) = std::env::var("CUDA_COMPUTE_CAP") {
        return cap.replace('.', "");
    }
    let smi = Command::new("nvidia-smi")
        .args(["--query-gpu=compute_cap", "--format=csv,noheader"])
        .output();
    match smi {
        Ok(o) if o.status.success() => String::from_utf8_lossy(&o.stdout)
            .lines()
            .next()
            .unwrap_or_default()
            .trim()
            .replace('.', ""),
        _ => panic!("set CUDA_COMPUTE_CAP (e.g. 90 for H100/H200): no GPU to ask (docs/gpu.md)"),
    }
}
