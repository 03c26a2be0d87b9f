//! `sluice bench weights`: how long a head takes to deliver one policy version to an engine node
//! over HTTP (`docs/cluster.md`), next to a raw loopback copy of the same bytes.
//!
//! Per preset: the head's side writes the version as the run does (`WeightDirs::served_at`:
//! safetensors + CRC-32) and serves it with the head's own streaming code
//! ([`sluice_node::cluster::routes::stream_file`]) on 127.0.0.1; the node's side fetches it
//! with [`HttpClient::download`] (streamed to disk, CRC computed on the way) and checks the CRC.
//! The raw copy sends the same file over a plain loopback TCP socket into a file, nothing else.
//! Each is timed `--repeats` times; the medians and their ratio are reported (the target:
//! delivery ≤ 2 × the raw copy). Writing the version and loading it on the node are printed
//! apart, as they are not transfer.

use std::io::{Read, Write};
use std::net::TcpListener;
use std::path::Path;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};

use crate::median;
use sluice_config::ModelPreset;
use sluice_core::PolicyVersion;
use sluice_engine::remote::WeightDirs;
use sluice_http::{Download, HttpClient};
use sluice_model::candle::{DType, Device};
use sluice_model::presets::{preset_config, random_snapshot};

/// `sluice bench weights`
#[derive(Debug, Clone, clap::Args)]
pub struct BenchWeightsArgs {
    /// Presets to measure (repeatable; default: small).
    #[arg(long = "preset", value_parser = ModelPreset::parse_name)]
    pub presets: Vec<ModelPreset>,
    /// Timed transfers of each kind per preset (the median is reported).
    #[arg(long, default_value_t = 5)]
    pub repeats: usize,
}

/// One plain loopback TCP copy of `file` into `dest`; seconds.
fn raw_copy(file: &Path, dest: &Path) -> anyhow::Result<f64> {
    let listener = TcpListener::bind("127.0.0.1:0")?;
    let addr = listener.local_addr()?;
    let src = file.to_path_buf();
    let started = Instant::now();
    let sender = std::thread::spawn(move || -> std::io::Result<()> {
        let (mut socket, _) = listener.accept()?;
        let mut f = std::fs::File::open(src)?;
        let mut buf = vec![0u8; 1 << 20];
        loop {
            let n = f.read(&mut buf)?;
            if n == 0 {
                return Ok(());
            }
            socket.write_all(&buf[..n])?;
        }
    });
    let mut socket = std::net::TcpStream::connect(addr)?;
    let mut out = std::fs::File::create(dest)?;
    // The same 1 MiB chunks as the HTTP path: a fair floor, not `io::copy`'s 8 KiB writes.
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = socket.read(&mut buf)?;
        if n == 0 {
            break;
        }
        out.write_all(&buf[..n])?;
    }
    out.flush()?;
    let seconds = started.elapsed().as_secs_f64();
    sender
        .join()
        .map_err(|_| anyhow::anyhow!("sender thread panicked"))??;
    Ok(seconds)
}

/// One preset's delivery, medians of the timed repeats.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Delivery {
    /// Size of the version's safetensors, MiB.
    pub mib: f64,
    /// Writing the version on the head (safetensors + CRC), seconds.
    pub write_s: f64,
    /// The raw loopback copy, seconds.
    pub raw_s: f64,
    /// The HTTP delivery (streamed to disk, CRC checked), seconds.
    pub delivery_s: f64,
    /// Loading the fetched version on the node, seconds.
    pub load_s: f64,
}

impl Delivery {
    /// Delivery time ÷ raw copy time (the target: ≤ 2).
    pub fn ratio(&self) -> f64 {
        self.delivery_s / self.raw_s
    }
}

/// Measures one version of `preset` delivered `repeats` times (≥ 1) on `runtime`.
pub fn measure(
    runtime: &tokio::runtime::Runtime,
    preset: ModelPreset,
    repeats: usize,
) -> anyhow::Result<Delivery> {
    if repeats == 0 {
        bail!("--repeats: expected an integer ≥ 1, got 0");
    }
    let name = preset.name();
    let dir = tempfile::tempdir()?;
    let config = Arc::new(preset_config(preset));
    let weights =
        random_snapshot(config, 0, DType::F32, &Device::Cpu)?.with_version(PolicyVersion(1));
    let listener = runtime.block_on(tokio::net::TcpListener::bind("127.0.0.1:0"))?;
    let url = format!("http://{}", listener.local_addr()?);
    let dirs = WeightDirs::served_at(dir.path().join("served"), 2, url.clone());
    let written = Instant::now();
    let pinned = dirs.publish(&weights).map_err(anyhow::Error::msg)?;
    let write_s = written.elapsed().as_secs_f64();
    let (file, crc) = dirs
        .file(PolicyVersion(1))
        .context("the published version is not on disk")?;
    let bytes = std::fs::metadata(&file)?.len();
    let served = file.clone();
    let server = runtime.spawn(async move {
        let app = axum::Router::new().route(
            "/v1/weights/1",
            axum::routing::get(move || {
                let path = served.clone();
                async move {
                    match tokio::fs::File::open(&path).await {
                        Ok(f) => sluice_node::cluster::routes::stream_file(f, crc).await,
                        Err(e) => axum::response::IntoResponse::into_response((
                            axum::http::StatusCode::NOT_FOUND,
                            e.to_string(),
                        )),
                    }
                }
            }),
        );
        let _ = axum::serve(listener, app).await;
    });
    let fetched = dir.path().join("fetched");
    std::fs::create_dir_all(&fetched)?;
    std::fs::copy(
        file.with_file_name("config.json"),
        fetched.join("config.json"),
    )?;
    let client = HttpClient::new(&format!("{url}/v1/weights/1"), "bench head")?;
    let mut raw = Vec::new();
    let mut delivery = Vec::new();
    for _ in 0..repeats {
        raw.push(raw_copy(&file, &dir.path().join("raw.bin"))?);
        let dest = fetched.join("model.safetensors");
        let started = Instant::now();
        let got = runtime.block_on(client.download("", &dest, Duration::from_secs(600)))?;
        let seconds = started.elapsed().as_secs_f64();
        match got {
            Download::Saved { crc32, bytes: n } if crc32 == crc && n == bytes => {}
            other => bail!("{name}: the fetched file does not match: {other:?}"),
        }
        delivery.push(seconds);
    }
    let loaded = Instant::now();
    let options = sluice_model::LoadOptions {
        dtype: Some(DType::F32),
        device: Device::Cpu,
    };
    sluice_model::load_checkpoint(&fetched, &options)?;
    let load_s = loaded.elapsed().as_secs_f64();
    server.abort();
    drop(pinned);
    Ok(Delivery {
        mib: bytes as f64 / (1024.0 * 1024.0),
        write_s,
        raw_s: median(raw),
        delivery_s: median(delivery),
        load_s,
    })
}

/// The table's header.
pub(crate) fn print_header() {
    println!(
        "{:<8} {:>10} {:>10} {:>12} {:>12} {:>9} {:>10}",
        "preset", "MiB", "write s", "raw copy s", "delivery s", "ratio", "load s"
    );
}

/// One preset's row of the table, and its fields of a `RESULT` line.
pub(crate) fn print_row(preset: ModelPreset, d: &Delivery) -> String {
    let name = preset.name();
    println!(
        "{name:<8} {:>10.1} {:>10.3} {:>12.4} {:>12.4} {:>9.2} {:>10.3}",
        d.mib,
        d.write_s,
        d.raw_s,
        d.delivery_s,
        d.ratio(),
        d.load_s
    );
    format!(
        "{name}_mib={:.1} {name}_raw_s={:.4} {name}_delivery_s={:.4} {name}_ratio={:.2}",
        d.mib,
        d.raw_s,
        d.delivery_s,
        d.ratio()
    )
}

/// Runs the benchmark and prints a table and the `RESULT weights` line.
pub fn run(args: &BenchWeightsArgs) -> anyhow::Result<ExitCode> {
    if args.repeats == 0 {
        bail!("--repeats: expected an integer ≥ 1, got 0");
    }
    let presets = if args.presets.is_empty() {
        vec![ModelPreset::Small]
    } else {
        args.presets.clone()
    };
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let mut result = Vec::new();
    print_header();
    for preset in presets {
        let d = measure(&runtime, preset, args.repeats)?;
        result.push(print_row(preset, &d));
    }
    println!("RESULT weights {}", result.join(" "));
    Ok(ExitCode::SUCCESS)
}
