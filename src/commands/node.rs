//! `sluice run` of an engine or env node (`[node] role = "engine" | "env"`, `docs/operations.md`):
//! the inference server of `sluice serve` or the env server of `sluice env-server`, started from
//! the config, joined to the head (`node.head`) with the node token (`admin.token`) — an env
//! node advertising the tasks it serves —, heartbeating (with its load) until SIGINT or SIGTERM; then it leaves the head first (so no new work is routed to it),
//! aborts what is in flight (each request answers with its partial) and exits 0.
//!
//! An engine node shares no disk with the head: it starts on its own copy of the model
//! (`model.path`, created from `model.init_preset` when absent) for the architecture and the
//! tokenizer, and gets every policy version it serves from the head over HTTP before it gets
//! any work.

use std::net::SocketAddr;
use std::process::ExitCode;
use std::sync::Arc;

use anyhow::{Context, bail};
use sluice_config::{Config, NodeConfig, NodeRole};
use sluice_engine::server::fetch::WeightFetch;
use sluice_engine::server::{ServerOptions, ServerState, WeightEvents};
use sluice_engine::{InferenceBackend, NativeEngine, NativeEngineParams};
use sluice_model::{LoadOptions, Tokenizer, load_checkpoint};
use sluice_node::cluster::member::{self, MemberParams, Membership, Report};
use sluice_node::cluster::registry::JoinRequest;

use super::shutdown_signal;

/// Runs an engine or env node until it is stopped.
pub fn run(config: &Config, node: &NodeConfig) -> anyhow::Result<ExitCode> {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .context("cannot start the async runtime")?;
    match node.role {
        NodeRole::Engine => runtime.block_on(engine_node(config, node)),
        NodeRole::Env => runtime.block_on(env_node(config, node)),
        NodeRole::Head => bail!("a head runs the pipeline (sluice run), not a member node"),
    }
}

/// Where the head reaches this node, and its name there.
fn identity(node: &NodeConfig, bound: SocketAddr) -> (String, String) {
    let url = node
        .advertise
        .clone()
        .unwrap_or_else(|| format!("http://{bound}"));
    let name = node.name.clone().unwrap_or_else(|| {
        let host_port: String = url
            .trim_start_matches("http://")
            .chars()
            .map(|c| {
                if c.is_ascii_alphanumeric() || c == '.' {
                    c
                } else {
                    '-'
                }
            })
            .collect();
        format!("{}-{host_port}", node.role.as_str())
    });
    (url, name)
}

/// Joins the head, or stops at a signal first (`None`).
async fn join_or_stop(params: MemberParams) -> anyhow::Result<Option<Membership>> {
    tokio::select! {
        joined = member::join(params) => Ok(Some(joined?)),
        () = shutdown_signal() => Ok(None),
    }
}

async fn engine_node(config: &Config, node: &NodeConfig) -> anyhow::Result<ExitCode> {
    let head = node.head.clone().context("node.head")?;
    let listen = node.listen.context("node.listen")?;
    // Its weight and control routes are guarded by the node token: beyond loopback, one is
    // required (as for the admin API and env servers).
    if !listen.ip().is_loopback() && config.admin.token.is_none() {
        bail!(
            "node.listen = {listen}: not a loopback address; set admin.token or ${} (the node token) so the engine's weight and control routes are guarded",
            sluice_config::ADMIN_TOKEN_ENV
        );
    }
    let model_dir = config.model.path.clone();
    sluice_node::native::ensure_model_dir(config)?;
    let options = LoadOptions {
        dtype: Some(sluice_node::native::setup::native_trainer_config(config).publish_dtype),
        device: sluice_model::device(config.engine.device).context("engine.device")?,
    };
    let weights = Arc::new(
        load_checkpoint(&model_dir, &options)
            .with_context(|| format!("model.path {}", model_dir.display()))?,
    );
    let tokenizer = Arc::new(
        Tokenizer::from_dir(&model_dir)
            .with_context(|| format!("model.path {}: tokenizer", model_dir.display()))?,
    );
    let mut eos = tokenizer.eos_token_ids().to_vec();
    eos.extend(&weights.config().eos_token_ids);
    let events = Arc::new(WeightEvents::default());
    let params = NativeEngineParams::from_config(&config.engine, 0, config.run.seed, eos);
    let mut engine = NativeEngine::start(
        params,
        Arc::clone(&weights),
        Some(Arc::clone(&tokenizer)),
        events.sink(),
    )?;
    let model_name = model_dir
        .file_name()
        .map_or_else(|| "model".to_owned(), |n| n.to_string_lossy().into_owned());
    let state = ServerState::with_fetch(
        engine.control(),
        tokenizer,
        ServerOptions {
            model_name,
            dtype: weights.dtype(),
            device: weights.device().clone(),
            max_n: 64,
            max_queued_sequences: sluice_engine::server::DEFAULT_MAX_QUEUED_SEQUENCES,
            // The head calls this node's weight and control routes with the node token.
            token: config.admin.token.clone(),
            http: sluice_http::ServeOptions::default(),
        },
        events,
        Some(WeightFetch {
            source: head.clone(),
            token: config.admin.token.clone(),
            dir: config.run.output_dir.join("weights"),
            model_dir: model_dir.clone(),
            timeout: config.engine.request_timeout,
        }),
    );
    let listener = tokio::net::TcpListener::bind(listen)
        .await
        .with_context(|| format!("node.listen: cannot bind {listen}"))?;
    let bound = listener.local_addr()?;
    let (url, name) = identity(node, bound);
    println!("sluice engine node `{name}` on http://{bound}, joining {head}");
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let served = Arc::clone(&state);
    let server = tokio::spawn(sluice_engine::server::serve(listener, served, async move {
        let _ = stopped.await;
    }));
    let reported = Arc::clone(&state);
    let report: Report = Arc::new(move || {
        let s = reported.stats();
        (Some(s.version.0), Some(s.running + s.waiting))
    });
    let joined = join_or_stop(MemberParams {
        head,
        token: config.admin.token.clone(),
        request: JoinRequest {
            name,
            role: NodeRole::Engine,
            url,
            tasks: Vec::new(),
        },
        report,
    })
    .await;
    let result = match joined {
        Ok(Some(membership)) => {
            shutdown_signal().await;
            tracing::info!("stopping: leaving the head, then aborting in-flight requests");
            membership.leave().await;
            Ok(())
        }
        Ok(None) => Ok(()),
        Err(e) => Err(e),
    };
    let _ = engine.control().abort_all();
    let _ = stop.send(());
    let _ = server.await;
    engine.shutdown();
    result?;
    tracing::info!("engine node stopped");
    Ok(ExitCode::SUCCESS)
}

async fn env_node(config: &Config, node: &NodeConfig) -> anyhow::Result<ExitCode> {
    use sluice_env::remote::{ServerConfig, ServerStats, serve_with_stats};
    let head = node.head.clone().context("node.head")?;
    let listen = node.listen.context("node.listen")?;
    let token = super::env_server::token_from_env()?;
    if !listen.ip().is_loopback() && token.is_none() {
        bail!(
            "node.listen = {listen}: not a loopback address; set ${} to serve envs beyond this machine",
            super::env_server::ENV_TOKEN_VAR
        );
    }
    let server_config = ServerConfig {
        max_envs: 1024,
        call_timeout: config.supervision.env_step_timeout,
        idle_timeout: (config.supervision.env_step_timeout * 20)
            .max(std::time::Duration::from_secs(600)),
        token,
        http: sluice_http::ServeOptions::default(),
    };
    let listener = tokio::net::TcpListener::bind(listen)
        .await
        .with_context(|| format!("node.listen: cannot bind {listen}"))?;
    let bound = listener.local_addr()?;
    let (url, name) = identity(node, bound);
    let registry = Arc::new(sluice_env::TaskRegistry::builtin());
    // The head sends this node episodes of the tasks it advertises.
    let tasks = registry.names();
    println!("sluice env node `{name}` on http://{bound}, joining {head}");
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let stats = Arc::new(ServerStats::default());
    let server = tokio::spawn(serve_with_stats(
        listener,
        registry,
        server_config,
        Arc::clone(&stats),
        async move {
            let _ = stopped.await;
        },
    ));
    // Its load is the envs open on it, whoever opened them.
    let report: Report = Arc::new(move || (None, Some(stats.open())));
    let joined = join_or_stop(MemberParams {
        head,
        token: config.admin.token.clone(),
        request: JoinRequest {
            name,
            role: NodeRole::Env,
            url,
            tasks,
        },
        report,
    })
    .await;
    let result = match joined {
        Ok(Some(membership)) => {
            shutdown_signal().await;
            membership.leave().await;
            Ok(())
        }
        Ok(None) => Ok(()),
        Err(e) => Err(e),
    };
    let _ = stop.send(());
    let _ = server.await;
    result?;
    tracing::info!("env node stopped");
    Ok(ExitCode::SUCCESS)
}
