//! `sluice serve`: the native engine behind the OpenAI-compatible server (`docs/engine.md`).
//! Loads the model directory, starts the engine thread, binds, and serves until SIGINT or
//! SIGTERM; then stops accepting, aborts the generations in flight, waits for the calls at most
//! `--shutdown-grace-s` (dropping those still running, a stuck chat-template render say),
//! joins the engine thread and exits 0.
//!
//! As `sluice env-server`: a bind beyond loopback needs a token (`$SLUICE_SERVE_TOKEN`), which
//! the routes that change the server (weights, pause, abort, continue) then require.

use std::process::ExitCode;
use std::sync::Arc;

use anyhow::{Context, bail};
use sluice_engine::config::EngineLimits;
use sluice_engine::remote::SERVE_TOKEN_VAR;
use sluice_engine::server::{ServerOptions, ServerState, WeightEvents, serve};
use sluice_engine::{InferenceBackend, NativeEngine, NativeEngineParams};
use sluice_model::{LoadOptions, Tokenizer, load_checkpoint};

use crate::cli::ServeArgs;

/// Runs the server.
pub fn run(args: &ServeArgs) -> anyhow::Result<ExitCode> {
    if args.max_queued_sequences == 0 {
        bail!("--max-queued-sequences: expected an integer ≥ 1, got 0");
    }
    // The rules of the config's engine keys: each running sequence owns KV memory, so an extra
    // zero must not reach the allocator.
    let limits = EngineLimits {
        max_running_sequences: args.max_running_sequences as u64,
        max_step_tokens: args.max_step_tokens as u64,
        kv_cache_mb: u64::from(args.kv_cache_mb),
        kv_block_tokens: args.kv_block_tokens as u64,
    };
    if let Err(e) = limits.validate() {
        bail!("{}: {}", e.flag(), e.reason);
    }
    let compute_dtype =
        sluice_engine::config::compute_dtype_flag(args.compute_dtype.as_deref(), args.device)
            .map_err(anyhow::Error::msg)?;
    if args
        .served_model_name
        .as_ref()
        .is_some_and(|n| n.trim().is_empty())
    {
        bail!("--served-model-name: expected a non-empty name (clients send it as `model`)");
    }
    let http = super::serve_options(&args.http)?;
    let token = sluice_http::auth::token_from_env(SERVE_TOKEN_VAR).map_err(anyhow::Error::msg)?;
    if !args.host.is_loopback() && token.is_none() {
        bail!(
            "--host {}: not a loopback address; set ${SERVE_TOKEN_VAR} to serve beyond this machine (the weight, pause, abort and continue routes then need it as a bearer token)",
            args.host
        );
    }
    let device = sluice_model::device(args.device).context("--device")?;
    let options = LoadOptions {
        dtype: None,
        device,
    };
    let weights = Arc::new(
        load_checkpoint(&args.model, &options)
            .with_context(|| format!("--model {}", args.model.display()))?,
    );
    let mut tokenizer = Tokenizer::from_dir(&args.model)
        .with_context(|| format!("--model {}: tokenizer", args.model.display()))?;
    if let Some(path) = &args.chat_template {
        tokenizer
            .override_chat_template(path)
            .with_context(|| format!("--chat-template {}", path.display()))?;
    }
    let tokenizer = Arc::new(tokenizer);
    let mut eos = tokenizer.eos_token_ids().to_vec();
    eos.extend(&weights.config().eos_token_ids);
    let events = Arc::new(WeightEvents::default());
    let params = NativeEngineParams {
        replica: 0,
        max_running_sequences: args.max_running_sequences,
        max_step_tokens: args.max_step_tokens,
        seed: args.seed,
        eos_token_ids: eos,
        // The server is the only role in its process: every core.
        threads: sluice_model::threads::role_threads(0, 1),
        kv_cache_bytes: u64::from(args.kv_cache_mb) * 1024 * 1024,
        kv_block_tokens: args.kv_block_tokens,
        compute_dtype,
        prefix_caching: !args.no_prefix_caching,
        device: args.device,
        // A client cannot resume a partial reply: a preempted request is computed again.
        recompute_preempted: true,
        ..NativeEngineParams::default()
    };
    let mut engine = NativeEngine::start(
        params,
        Arc::clone(&weights),
        Some(Arc::clone(&tokenizer)),
        events.sink(),
    )?;
    let model_name = args.served_model_name.clone().unwrap_or_else(|| {
        args.model
            .file_name()
            .map_or_else(|| "model".to_owned(), |n| n.to_string_lossy().into_owned())
    });
    let state = ServerState::new(
        engine.control(),
        tokenizer,
        ServerOptions {
            model_name: model_name.clone(),
            dtype: weights.dtype(),
            device: weights.device().clone(),
            max_n: 64,
            max_queued_sequences: args.max_queued_sequences,
            token,
            http,
        },
        events,
    );
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .context("cannot start the async runtime")?;
    let served = runtime.block_on(async {
        let listener = tokio::net::TcpListener::bind((args.host, args.port))
            .await
            .with_context(|| format!("cannot bind {}:{}", args.host, args.port))?;
        println!(
            "sluice serve: model `{model_name}` on http://{}",
            listener.local_addr()?
        );
        // On SIGINT/SIGTERM, in-flight generations are aborted: each call answers at once with
        // what it has (`finish_reason: "abort"`), so the graceful stop does not wait for long
        // generations to run to their end (23 s under load before).
        let control = engine.control();
        let shutdown = async move {
            super::shutdown_signal().await;
            tracing::info!("stopping: aborting in-flight requests");
            let _ = control.abort_all();
        };
        serve(listener, state, shutdown)
            .await
            .context("server failed")
    });
    engine.shutdown();
    // A call the grace period dropped may leave its render running on the blocking pool: it is
    // not waited for (a template that never ends would keep the process alive).
    runtime.shutdown_timeout(std::time::Duration::from_millis(100));
    served?;
    tracing::info!("server stopped");
    Ok(ExitCode::SUCCESS)
}
