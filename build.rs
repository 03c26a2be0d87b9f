//! Link settings of a `cuda` build on a machine without CUDA's libraries (docs/gpu.md).
//!
//! With `SLUICE_CUDA_LINK_DIR` set (by `scripts/cuda-toolchain`), the names candle links by
//! resolve to archives there: `libcuda.a` holds a stub for each CUDA function, which finds the
//! real one (dlsym) at its first call, and the others are empty. So the binary records no
//! dependency on CUDA's libraries and starts, and runs CPU configs, where none is installed;
//! sluice-model loads them when a `cuda:N` device is asked for, before any CUDA call.

fn main() {
    println!("cargo::rerun-if-env-changed=SLUICE_CUDA_LINK_DIR");
    if std::env::var_os("CARGO_FEATURE_CUDA").is_none() {
        return;
    }
    // Without it: linked against the toolkit's libraries the usual way (needed at start-up).
    if let Some(dir) = std::env::var_os("SLUICE_CUDA_LINK_DIR") {
        let dir = std::path::PathBuf::from(dir);
        println!(
            "cargo::rerun-if-changed={}",
            dir.join("libcuda.a").display()
        );
        println!("cargo::rustc-link-search=native={}", dir.display());
    }
}
