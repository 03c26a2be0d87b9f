//! Command-line interface: every subcommand and flag Sluice accepts, in one place.
//!
//! Flags are public interface: add freely, rename never.

use std::path::PathBuf;

use clap::{Parser, Subcommand};
use sluice_config::Override;

/// Asynchronous reinforcement learning for language models.
#[derive(Debug, Parser)]
#[command(name = "sluice", version, about, propagate_version = true)]
pub struct Cli {
    /// What to do.
    #[command(subcommand)]
    pub command: Command,
}

/// The subcommands.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Validate a config file and print the resolved config as TOML.
    Check(ConfigArgs),
    /// Load a config's datasets as a run would and print their first rows as its tasks open
    /// them (JSON lines).
    Data(DataArgs),
    /// Run a pipeline from a config until `run.max_steps` training steps are done.
    Run(ConfigArgs),
    /// Read or change the runtime knobs of a running node (through its admin API).
    Knobs(KnobsArgs),
    /// Show a running node's status: version, step, buckets, rates, knobs, actor health.
    Status(StatusArgs),
    /// Stop admitting new groups on a running node (in-flight work continues).
    Pause(AdminArgs),
    /// Start admitting new groups again on a paused node.
    Resume(AdminArgs),
    /// Act on a running node's replay store (through its admin API).
    #[command(subcommand)]
    Replay(ReplayCommand),
    /// Create and inspect Hugging Face model directories.
    #[command(subcommand)]
    Model(ModelCommand),
    /// Measure throughput of the parts of Sluice on this machine.
    #[command(subcommand)]
    Bench(BenchCommand),
    /// Serve the built-in tasks' environments over the remote env protocol (JSON over HTTP).
    EnvServer(EnvServerArgs),
    /// Serve a model directory with the native engine behind an OpenAI-compatible API.
    Serve(ServeArgs),
    /// Draw a run's progress plot (reward and eval accuracy by step and wall time) as PNG.
    Plot(PlotArgs),
}

/// `sluice data`
#[derive(Debug, clap::Args)]
pub struct DataArgs {
    /// The config and its overrides.
    #[command(flatten)]
    pub config: ConfigArgs,
    /// Rows of each dataset to print (0: only the counts).
    #[arg(long, default_value_t = 3)]
    pub rows: usize,
}

/// `sluice plot`
#[derive(Debug, clap::Args)]
pub struct PlotArgs {
    /// A run's output dir (its metrics.jsonl is read) or a metrics.jsonl file.
    pub input: PathBuf,
    /// Where to write the PNG [default: progress.png beside the log]. An existing file that
    /// is not a PNG is refused unless `--force`; the log being read is always refused.
    #[arg(short = 'o', long = "out", value_name = "PNG")]
    pub out: Option<PathBuf>,
    /// Replace an existing `--out` file even when it is not a PNG.
    #[arg(long)]
    pub force: bool,
}

/// `sluice serve`
#[derive(Debug, clap::Args)]
pub struct ServeArgs {
    /// The Hugging Face model directory.
    #[arg(long)]
    pub model: PathBuf,
    /// Address to bind. Beyond loopback, `$SLUICE_SERVE_TOKEN` must hold a token: the mutating
    /// routes (weights, pause, abort, continue) then need `Authorization: Bearer <token>`.
    #[arg(long, default_value = "127.0.0.1")]
    pub host: std::net::IpAddr,
    /// Port; 0 picks a free one (the bound address is printed).
    #[arg(long, default_value_t = 8000)]
    pub port: u16,
    /// `cpu`, `cuda` or `cuda:N`.
    #[arg(long, default_value = "cpu", value_parser = parse_device)]
    pub device: sluice_config::Device,
    /// Seed of sampling for requests without their own.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Sequences decoded together at most.
    #[arg(long, default_value_t = 64)]
    pub max_running_sequences: usize,
    /// Tokens (prefill + decode) per engine step at most.
    #[arg(long, default_value_t = 2048)]
    pub max_step_tokens: usize,
    /// KV cache pool, MiB (0 = every running sequence at full context, capped at 2048 MiB;
    /// as `engine.kv_cache_mb`).
    #[arg(long, default_value_t = 0)]
    pub kv_cache_mb: u32,
    /// Tokens per KV cache block (as `engine.kv_block_tokens`; 1 to 1024).
    #[arg(long, default_value_t = 16)]
    pub kv_block_tokens: usize,
    /// The matrix products: `f32` or `bf16` (on the CPU, Intel AMX tiles; as
    /// `engine.compute_dtype`) [default: the weights' dtype].
    #[arg(long, value_name = "DTYPE")]
    pub compute_dtype: Option<String>,
    /// Compute every request's prompt, sharing no KV blocks between requests (as
    /// `engine.prefix_caching = false`).
    #[arg(long)]
    pub no_prefix_caching: bool,
    /// Model name reported by the API (default: the directory's name).
    #[arg(long)]
    pub served_model_name: Option<String>,
    /// A Jinja file that replaces the model's chat template for `/v1/chat/completions` (as
    /// `model.chat_template` does for runs).
    #[arg(long)]
    pub chat_template: Option<PathBuf>,
    /// Sequences (prompts × n) accepted at once across all requests; a request beyond answers
    /// 503 with `Retry-After`.
    #[arg(long, default_value_t = sluice_engine::server::DEFAULT_MAX_QUEUED_SEQUENCES)]
    pub max_queued_sequences: usize,
    /// Client deadlines, the connection cap and the shutdown grace.
    #[command(flatten)]
    pub http: HttpServerArgs,
}

/// How a server treats slow clients and its own stop (`sluice serve`, `sluice env-server`).
#[derive(Debug, Clone, clap::Args)]
pub struct HttpServerArgs {
    /// Seconds a client may take to send a request's line and headers; the connection is
    /// closed after them.
    #[arg(long, default_value_t = 10.0)]
    pub header_read_timeout_s: f64,
    /// Seconds a client may take to send a request's body once its headers are in; the request
    /// then answers 408 and its connection is closed.
    #[arg(long, default_value_t = 30.0)]
    pub body_read_timeout_s: f64,
    /// Seconds an answer may wait for the client to take its next bytes (a client that stops
    /// reading); its connection is then closed. A stream the client keeps reading is not cut.
    #[arg(long, default_value_t = 60.0)]
    pub write_stall_timeout_s: f64,
    /// Most connections open at once (0: half the open-file limit, at most 8192); clients over
    /// it wait in the listen queue until one closes.
    #[arg(long, default_value_t = 0)]
    pub max_connections: usize,
    /// Seconds a stop (SIGINT, SIGTERM) waits for requests in flight before dropping them.
    #[arg(long, default_value_t = 10.0)]
    pub shutdown_grace_s: f64,
}

/// A config file plus `--set` overrides.
#[derive(Debug, clap::Args)]
pub struct ConfigArgs {
    /// Path to the TOML config.
    pub config: PathBuf,
    /// Override a key before validation, e.g. `--set rollout.group_size=4` (repeatable).
    #[arg(long = "set", value_name = "KEY=VALUE", value_parser = parse_override)]
    pub overrides: Vec<Override>,
}

fn parse_override(s: &str) -> Result<Override, String> {
    s.parse()
}

fn parse_device(s: &str) -> Result<sluice_config::Device, String> {
    s.parse()
        .map_err(|()| format!("expected cpu, cuda or cuda:N, got `{s}`"))
}

/// `sluice env-server`
#[derive(Debug, clap::Args)]
pub struct EnvServerArgs {
    /// Address to bind. Beyond loopback, `$SLUICE_ENV_TOKEN` must hold a token that every env
    /// call then carries as `Authorization: Bearer <token>`.
    #[arg(long, default_value = "127.0.0.1")]
    pub host: std::net::IpAddr,
    /// Port; 0 picks a free one (the bound address is printed).
    #[arg(long, default_value_t = 8071)]
    pub port: u16,
    /// Envs open at once; more are refused with 503 until some close.
    #[arg(long, default_value_t = 1024)]
    pub max_envs: usize,
    /// Deadline of each env call, in seconds.
    #[arg(long, default_value_t = 30.0)]
    pub call_timeout_s: f64,
    /// Envs unused for this many seconds are dropped when a new env is created (clients that
    /// died without closing); must exceed the call timeout.
    #[arg(long, default_value_t = 600.0)]
    pub idle_timeout_s: f64,
    /// Client deadlines, the connection cap and the shutdown grace.
    #[command(flatten)]
    pub http: HttpServerArgs,
}

/// `sluice model ...`
#[derive(Debug, Subcommand)]
pub enum ModelCommand {
    /// Write a built-in preset (config, seeded random weights, tokenizer, chat template).
    Init(ModelInitArgs),
    /// Print a model directory's architecture, parameter count and tokenizer facts.
    Info(ModelInfoArgs),
    /// One prompt through the engine's path (last-position logits) and the trainer's (the
    /// gradients of −mean log p), on a device and dtype, as one JSON line: compare devices.
    Probe(ModelProbeArgs),
    /// Convert a llama.cpp GGUF file (llama, qwen2, qwen3) into a Hugging Face directory:
    /// config, dequantised safetensors weights, tokenizer and chat template.
    Import(ModelImportArgs),
}

/// `sluice model import`
#[derive(Debug, clap::Args)]
pub struct ModelImportArgs {
    /// The GGUF file to convert.
    #[arg(long)]
    pub gguf: PathBuf,
    /// Directory to write (created if needed). A directory that already holds a model
    /// (`config.json` or weights) is refused unless `--force`.
    #[arg(long)]
    pub out: PathBuf,
    /// Dtype of the written weights: `f32` (every dequantised value exact), `bf16` or `f16`.
    #[arg(long, default_value = "f32", value_parser = sluice_bench::parse_dtype)]
    pub dtype: sluice_config::DType,
    /// Replace the model already in `--out`.
    #[arg(long)]
    pub force: bool,
}

/// `sluice model probe`
#[derive(Debug, clap::Args)]
pub struct ModelProbeArgs {
    /// The model directory.
    pub dir: PathBuf,
    /// `cpu`, `cuda` or `cuda:N`.
    #[arg(long, default_value = "cpu", value_parser = parse_device)]
    pub device: sluice_config::Device,
    /// Weights of the engine's path: `f32`, `bf16` or `f16` (the trainer's path is f32).
    #[arg(long, default_value = "f32", value_parser = sluice_bench::parse_dtype)]
    pub dtype: sluice_config::DType,
    /// The prompt's token ids, comma-separated (at least 2).
    #[arg(long, value_delimiter = ',', required = true)]
    pub tokens: Vec<u32>,
    /// The trainer's path computes in `f32` or `bf16` (`trainer.compute_dtype`) over f32
    /// master weights.
    #[arg(long, default_value = "f32", value_parser = sluice_bench::parse_dtype)]
    pub compute_dtype: sluice_config::DType,
}

/// `sluice model init`
#[derive(Debug, clap::Args)]
pub struct ModelInitArgs {
    /// Which preset: `tiny` (tests, quickstart), `small` (~76M parameters, benchmarks) or
    /// `medium` (Qwen2.5-0.5B's shapes, GPU benchmarks).
    #[arg(long, value_parser = sluice_config::ModelPreset::parse_name)]
    pub preset: sluice_config::ModelPreset,
    /// Directory to write (created if needed). A directory that already holds a model
    /// (`config.json` or weights) is refused unless `--force`.
    #[arg(long)]
    pub out: PathBuf,
    /// Seed of the random weights.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Replace the model already in `--out`.
    #[arg(long)]
    pub force: bool,
}

/// `sluice model info`
#[derive(Debug, clap::Args)]
pub struct ModelInfoArgs {
    /// The model directory.
    pub dir: PathBuf,
}

/// `sluice bench ...`
#[derive(Debug, Subcommand)]
pub enum BenchCommand {
    /// The async pipeline on a long-tail workload: sync vs the XTuner presets vs in_flight.
    Pipeline(sluice_bench::BenchPipelineArgs),
    /// Actor overhead: samples/s through the pipeline with an instant engine and trainer.
    Overhead(sluice_bench::BenchPipelineArgs),
    /// Model: training forward+backward and decode tokens/s next to this machine's bounds.
    Model(sluice_bench::BenchModelArgs),
    /// Trainer: whole RL steps in tokens/s at several [B, L], and packing efficiency.
    Trainer(sluice_bench::BenchTrainerArgs),
    /// Native engine: continuous-batching speed-up, inter-token latency, weight-swap pauses.
    Engine(sluice_bench::BenchEngineArgs),
    /// Sluice's own kernels (AdamW and, on a GPU, the optimizer's many-parameter launches, the
    /// token choice, the fused training and engine ops, the attention's key split, decode steps
    /// as CUDA graphs) against the compositions they replace: agreement and time, on one device.
    Kernels(sluice_bench::BenchKernelsArgs),
    /// A reward model scoring conversations one forward each (as the rubric's `reward_model`
    /// function does) against all of them packed into one forward.
    RewardModel(sluice_bench::BenchRewardModelArgs),
    /// Weights over the network: a head delivering one version to an engine node over HTTP vs
    /// a raw loopback copy of the same bytes.
    Weights(sluice_bench::BenchWeightsArgs),
    /// A split run: RL steps/s of a head with 2 engine nodes on loopback vs the same job in
    /// one process, and the weight delivery ratio.
    Cluster(sluice_bench::BenchClusterArgs),
}

/// `sluice replay ...`
#[derive(Debug, Subcommand)]
pub enum ReplayCommand {
    /// Throw away the groups at rest (completed, aborted, expired) untrained. Refused while the
    /// run trains (admission open, or groups pending or in flight) unless `--force`.
    Clear(ReplayClearArgs),
}

/// `sluice replay clear`
#[derive(Debug, clap::Args)]
pub struct ReplayClearArgs {
    /// Where the node's admin API is.
    #[command(flatten)]
    pub target: AdminArgs,
    /// Clear even while the run trains (pending and in-flight groups keep running).
    #[arg(long)]
    pub force: bool,
    /// Only this bucket (`completed`, `aborted` or `expired`); repeat for several
    /// [default: all three].
    #[arg(long = "bucket", value_name = "BUCKET")]
    pub buckets: Vec<String>,
    /// Clear a stopped run's store in this directory (`replay.path`, by default
    /// `<run.output_dir>/replay`) instead of calling a running node; refused while a node holds
    /// it.
    #[arg(long, value_name = "DIR", conflicts_with_all = ["force", "url"])]
    pub store: Option<PathBuf>,
}

/// `sluice knobs ...`
#[derive(Debug, clap::Args)]
pub struct KnobsArgs {
    /// Where the node's admin API is.
    #[command(flatten)]
    pub target: AdminArgs,
    /// What to do.
    #[command(subcommand)]
    pub action: KnobsAction,
}

/// `sluice knobs get|set`
#[derive(Debug, Subcommand)]
pub enum KnobsAction {
    /// Print the live knobs as JSON.
    Get,
    /// Change knobs: `key=value` pairs (`domain_mix.math=0.4` for one domain); all or nothing.
    Set {
        /// `knob=value` assignments.
        #[arg(required = true)]
        assignments: Vec<String>,
    },
}

/// Where a running node's admin API is, and its token. Flags win over `$SLUICE_ADMIN_TOKEN`,
/// which wins over `--config`.
#[derive(Debug, Clone, clap::Args)]
pub struct AdminArgs {
    /// Base URL of the admin API [default: `admin.listen` of --config, else
    /// http://127.0.0.1:9401].
    #[arg(
        long = "url",
        visible_alias = "admin",
        global = true,
        value_name = "URL"
    )]
    pub url: Option<String>,
    /// Bearer token for mutating calls [default: $SLUICE_ADMIN_TOKEN, else `admin.token` of
    /// --config]. Prefer the variable: a flag shows in the process list.
    #[arg(long, global = true, value_name = "TOKEN")]
    pub token: Option<String>,
    /// The node's config file, to take `admin.listen` and `admin.token` from.
    #[arg(long, global = true, value_name = "FILE")]
    pub config: Option<PathBuf>,
}

/// `sluice status`
#[derive(Debug, clap::Args)]
pub struct StatusArgs {
    /// Where the node's admin API is.
    #[command(flatten)]
    pub target: AdminArgs,
    /// Print the raw JSON of `GET /v1/status` instead of the summary.
    #[arg(long)]
    pub json: bool,
}
