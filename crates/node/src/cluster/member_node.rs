//! An engine or env node (`[node] role = "engine" | "env"`, `docs/cluster.md`): the inference
//! server of `sluice serve` or the env server of `sluice env-server`, started from the config
//! ([`MemberNode::start_engine`], [`MemberNode::start_env`]), joined to the head with the node
//! token ([`MemberNode::join`]: an env node advertises the tasks it serves), heartbeating with
//! its load until [`MemberNode::stop`], which leaves the head first (so no new work is routed
//! to it), then aborts what is in flight (each request answers with its partial) and stops the
//! server. A node the head replaced (declared lost, its name given to another live node) learns
//! it from [`MemberNode::superseded`], and its owner stops it.
//!
//! An engine node shares no disk with the head: it starts on its own copy of the model
//! (`model.path`, created from `model.init_preset` when absent) for the architecture and the
//! tokenizer, and gets every policy version it serves from the head over HTTP before it gets
//! any work.

use std::net::SocketAddr;
use std::sync::Arc;

use futures::future::BoxFuture;
use sluice_config::{Config, NodeConfig, NodeRole, Secret};
use sluice_engine::server::fetch::WeightFetch;
use sluice_engine::server::{ServerOptions, ServerState, WeightEvents};
use sluice_engine::{InferenceBackend, NativeEngine, NativeEngineParams};
use sluice_env::remote::{ServerConfig, ServerStats, serve_with_stats};
use sluice_model::{LoadOptions, Tokenizer, load_checkpoint};

use super::member::{self, MemberError, MemberParams, Membership, Report};
use super::registry::JoinRequest;

/// Why a member node could not start or join.
#[derive(Debug, thiserror::Error)]
pub enum MemberNodeError {
    /// The config lacks what the role needs, or asks for an unguarded server.
    #[error("{0}")]
    Config(String),
    /// `node.listen` could not be bound.
    #[error("node.listen: cannot bind {listen}: {source}")]
    Bind {
        /// The address.
        listen: SocketAddr,
        /// Why.
        source: std::io::Error,
    },
    /// The model, its tokenizer or the engine could not be loaded.
    #[error("{0}")]
    Setup(String),
    /// The head refused the join.
    #[error(transparent)]
    Join(#[from] MemberError),
}

/// A running engine or env node; see the module docs.
pub struct MemberNode {
    role: NodeRole,
    name: String,
    bound: SocketAddr,
    head: String,
    token: Option<Secret>,
    request: Option<JoinRequest>,
    report: Report,
    membership: Option<Membership>,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    server: Option<tokio::task::JoinHandle<std::io::Result<()>>>,
    /// The engine node's engine (an env node has none).
    engine: Option<NativeEngine>,
}

/// `node.head` and `node.listen`, which every member node needs.
fn head_and_listen(node: &NodeConfig) -> Result<(String, SocketAddr), MemberNodeError> {
    let missing = |key: &str| MemberNodeError::Config(format!("{key}: required for a member node"));
    let head = node.head.clone().ok_or_else(|| missing("node.head"))?;
    let listen = node.listen.ok_or_else(|| missing("node.listen"))?;
    Ok((head, listen))
}

async fn bind(listen: SocketAddr) -> Result<tokio::net::TcpListener, MemberNodeError> {
    tokio::net::TcpListener::bind(listen)
        .await
        .map_err(|source| MemberNodeError::Bind { listen, source })
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

/// The node section of `config`, which must say `role`.
fn node_section(config: &Config, role: NodeRole) -> Result<&NodeConfig, MemberNodeError> {
    match &config.node {
        Some(n) if n.role == role => Ok(n),
        _ => Err(MemberNodeError::Config(format!(
            "node.role: expected \"{}\" for this node",
            role.as_str()
        ))),
    }
}

impl MemberNode {
    /// Loads the model and starts the engine node's inference server on `node.listen`; its
    /// weight and control routes are guarded by the node token (`admin.token`), required
    /// beyond loopback. Boxed, like the node's entry points ([`crate::node`]).
    pub fn start_engine(config: &Config) -> BoxFuture<'_, Result<Self, MemberNodeError>> {
        Box::pin(async move {
            let node = node_section(config, NodeRole::Engine)?;
            let (head, listen) = head_and_listen(node)?;
            if !listen.ip().is_loopback() && config.admin.token.is_none() {
                return Err(MemberNodeError::Config(format!(
                    "node.listen = {listen}: not a loopback address; set admin.token or ${} (the node token) so the engine's weight and control routes are guarded",
                    sluice_config::ADMIN_TOKEN_ENV
                )));
            }
            let (engine, state) = engine_server(config, &head)?;
            let listener = bind(listen).await?;
            let bound = local_addr(&listener, listen)?;
            let (url, name) = identity(node, bound);
            let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
            let server = tokio::spawn(sluice_engine::server::serve(
                listener,
                Arc::clone(&state),
                async move {
                    let _ = stopped.await;
                },
            ));
            let report: Report = Arc::new(move || {
                let s = state.stats();
                (Some(s.version.0), Some(s.running + s.waiting))
            });
            let request = JoinRequest {
                name: name.clone(),
                role: NodeRole::Engine,
                url,
                tasks: Vec::new(),
            };
            Ok(Self {
                role: NodeRole::Engine,
                name,
                bound,
                head,
                token: config.admin.token.clone(),
                request: Some(request),
                report,
                membership: None,
                stop: Some(stop),
                server: Some(server),
                engine: Some(engine),
            })
        })
    }

    /// Starts the env node's env server on `node.listen`, serving the built-in tasks; `token`
    /// (`$SLUICE_ENV_TOKEN`) guards it, required beyond loopback. Boxed (see [`crate::node`]).
    pub fn start_env(
        config: &Config,
        token: Option<Secret>,
    ) -> BoxFuture<'_, Result<Self, MemberNodeError>> {
        Box::pin(async move {
            let node = node_section(config, NodeRole::Env)?;
            let (head, listen) = head_and_listen(node)?;
            if !listen.ip().is_loopback() && token.is_none() {
                return Err(MemberNodeError::Config(format!(
                    "node.listen = {listen}: not a loopback address; set ${} to serve envs beyond this machine",
                    sluice_env::configured::ENV_TOKEN_VAR
                )));
            }
            let server_config = ServerConfig {
                max_envs: 1024,
                call_timeout: config.supervision.env_step_timeout,
                idle_timeout: (config.supervision.env_step_timeout * 20)
                    .max(std::time::Duration::from_secs(600)),
                token,
                http: sluice_http::ServeOptions::default(),
            };
            let listener = bind(listen).await?;
            let bound = local_addr(&listener, listen)?;
            let (url, name) = identity(node, bound);
            let registry = Arc::new(sluice_env::TaskRegistry::builtin());
            // The head sends this node episodes of the tasks it advertises.
            let tasks = registry.names();
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
            let request = JoinRequest {
                name: name.clone(),
                role: NodeRole::Env,
                url,
                tasks,
            };
            Ok(Self {
                role: NodeRole::Env,
                name,
                bound,
                head,
                token: config.admin.token.clone(),
                request: Some(request),
                report,
                membership: None,
                stop: Some(stop),
                server: Some(server),
                engine: None,
            })
        })
    }

    /// The node's name at the head.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The server's bound address.
    pub fn addr(&self) -> SocketAddr {
        self.bound
    }

    /// The head it joins.
    pub fn head(&self) -> &str {
        &self.head
    }

    /// The node's role.
    pub fn role(&self) -> NodeRole {
        self.role
    }

    /// Joins the head (retrying until it answers) and starts heartbeating. Joining twice is
    /// refused. Boxed (see [`crate::node`]).
    pub fn join(&mut self) -> BoxFuture<'_, Result<(), MemberNodeError>> {
        Box::pin(async move {
            let request = self
                .request
                .take()
                .ok_or_else(|| MemberNodeError::Config("this node has already joined".into()))?;
            let params = MemberParams {
                head: self.head.clone(),
                token: self.token.clone(),
                request,
                report: Arc::clone(&self.report),
            };
            self.membership = Some(member::join(params).await?);
            Ok(())
        })
    }

    /// Resolves when the head has given this node's name to another live node (see
    /// [`Membership::superseded`]): the node serves no one any more and should be stopped.
    /// Pending before [`MemberNode::join`] and for as long as the membership holds.
    pub fn superseded(&mut self) -> BoxFuture<'_, MemberNodeError> {
        Box::pin(async move {
            match self.membership.as_mut() {
                Some(m) => MemberNodeError::Join(m.superseded().await),
                None => std::future::pending().await,
            }
        })
    }

    /// Leaves the head (when joined), aborts what is in flight, stops the server and the
    /// engine. Boxed (see [`crate::node`]).
    pub fn stop(mut self) -> BoxFuture<'static, ()> {
        Box::pin(async move {
            if let Some(m) = self.membership.take() {
                tracing::info!("stopping: leaving the head, then aborting in-flight requests");
                m.leave().await;
            }
            if let Some(engine) = &self.engine {
                let _ = engine.control().abort_all();
            }
            if let Some(stop) = self.stop.take() {
                let _ = stop.send(());
            }
            if let Some(server) = self.server.take() {
                match server.await {
                    Ok(Ok(())) => {}
                    Ok(Err(e)) => tracing::error!(error = %e, "the node's server failed"),
                    Err(e) => tracing::error!(error = %e, "the node's server task failed"),
                }
            }
            if let Some(mut engine) = self.engine.take() {
                engine.shutdown();
            }
            tracing::info!("{} node stopped", self.role.as_str());
        })
    }
}

fn local_addr(
    listener: &tokio::net::TcpListener,
    listen: SocketAddr,
) -> Result<SocketAddr, MemberNodeError> {
    listener
        .local_addr()
        .map_err(|source| MemberNodeError::Bind { listen, source })
}

/// The engine node's engine on its copy of the model, and its server's state (the weights it
/// serves fetched from `head`).
fn engine_server(
    config: &Config,
    head: &str,
) -> Result<(NativeEngine, Arc<ServerState>), MemberNodeError> {
    let setup = |e: String| MemberNodeError::Setup(e);
    let model_dir = config.model.path.clone();
    crate::native::ensure_model_dir(config).map_err(|e| setup(e.to_string()))?;
    let options = LoadOptions {
        dtype: Some(crate::native::setup::native_trainer_config(config).publish_dtype),
        device: sluice_model::device(config.engine.device)
            .map_err(|e| setup(format!("engine.device: {e}")))?,
    };
    let weights = Arc::new(
        load_checkpoint(&model_dir, &options)
            .map_err(|e| setup(format!("model.path {}: {e}", model_dir.display())))?,
    );
    let tokenizer = Arc::new(Tokenizer::from_dir(&model_dir).map_err(|e| {
        setup(format!(
            "model.path {}: tokenizer: {e}",
            model_dir.display()
        ))
    })?);
    let mut eos = tokenizer.eos_token_ids().to_vec();
    eos.extend(&weights.config().eos_token_ids);
    let events = Arc::new(WeightEvents::default());
    let params = NativeEngineParams::from_config(&config.engine, 0, config.run.seed, eos);
    let engine = NativeEngine::start(
        params,
        Arc::clone(&weights),
        Some(Arc::clone(&tokenizer)),
        events.sink(),
    )
    .map_err(|e| setup(format!("starting the engine: {e}")))?;
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
            source: head.to_owned(),
            token: config.admin.token.clone(),
            dir: config.run.output_dir.join("weights"),
            model_dir,
            timeout: config.engine.request_timeout,
        }),
    );
    Ok((engine, state))
}
