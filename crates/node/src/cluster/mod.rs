//! A run across machines (`DESIGN.md` §10, `docs/operations.md`): the head keeps a registry of
//! the engine and env nodes that join it ([`registry`]), serves them the membership and weight
//! routes of its admin API ([`routes`]), and runs its engine replicas on the joined engine
//! nodes ([`factory`]); an engine or env node ([`member_node`]) joins and heartbeats with
//! [`member`].
//!
//! Versions stay the head's: an engine node loads exactly the version the head's engine actor
//! tells it to, fetched from the head (`GET /v1/weights/<version>`, CRC-checked), so the
//! staleness bound holds across machines as in one process. The training episodes of domains
//! with `env_nodes = true` run on the joined env nodes ([`env_nodes`]).

pub mod env_nodes;
pub mod factory;
pub mod member;
pub mod member_node;
pub mod registry;
pub mod routes;

use std::sync::Arc;

use sluice_config::{Config, NodeRole};
use sluice_engine::remote::WeightDirs;

use crate::native::{NativeSetup, TaskEnv};
pub use factory::{HeadEngines, MemberBackend, head_factory};
pub use registry::{NodeView, Registry};
pub use routes::ClusterState;
use sluice_actors::ActorError;
use sluice_actors::engine::ReplicaFactory;

/// The head's side of the cluster: the registry, the served weights, the task that marks
/// silent members lost and the one that probes unreachable ones. Stop it with [`Head::stop`] after the node.
pub struct Head {
    state: Arc<ClusterState>,
    sweeper: Option<tokio::task::JoinHandle<()>>,
    /// Probes the unreachable engine members ([`Registry::probe_unreachable`]).
    prober: Option<tokio::task::JoinHandle<()>>,
}

impl Head {
    /// The head of `config` (`node.role = "head"`) over the run's model: its registry, its
    /// weight directories, and the engine replica factory to start the node with.
    pub fn start(
        config: &Config,
        setup: &NativeSetup,
    ) -> Result<(Self, ReplicaFactory), ActorError> {
        let node = config
            .node
            .as_ref()
            .filter(|n| n.role == NodeRole::Head)
            .ok_or_else(|| ActorError::Setup("not a head: node.role is not \"head\"".into()))?;
        let url = node
            .advertise
            .clone()
            .unwrap_or_else(|| format!("http://{}", config.admin.listen));
        let keep = config.engine.remote_keep_versions.get() as usize;
        let out = &config.run.output_dir;
        let served = WeightDirs::served_at(out.join("weights_served"), keep, url);
        let on_disk = WeightDirs::new(out.join("weights"), Some(setup.model_dir.clone()), keep);
        let registry = Arc::new(Registry::new(node));
        let factory = head_factory(
            config,
            HeadEngines {
                registry: Arc::clone(&registry),
                served: Arc::clone(&served),
                on_disk,
                initial: Arc::clone(&setup.weights),
            },
        );
        let period = node.heartbeat;
        let swept = Arc::clone(&registry);
        let sweeper = tokio::spawn(async move {
            let mut ticker = tokio::time::interval(period);
            loop {
                ticker.tick().await;
                swept.sweep(tokio::time::Instant::now());
            }
        });
        let prober = tokio::spawn(Arc::clone(&registry).probe_unreachable());
        Ok((
            Self {
                state: Arc::new(ClusterState { registry, served }),
                sweeper: Some(sweeper),
                prober: Some(prober),
            },
            factory,
        ))
    }

    /// What the admin API serves.
    pub fn state(&self) -> Arc<ClusterState> {
        Arc::clone(&self.state)
    }

    /// The training episodes' environment when a domain of `config` sets `env_nodes`: the
    /// setup's tasks with those domains' envs on the joined env nodes. `None` when no domain
    /// does (the node builds the setup's own).
    pub fn rollout_env(
        &self,
        config: &Config,
        setup: &NativeSetup,
    ) -> Result<Option<TaskEnv>, ActorError> {
        if !config.data.domain_options.values().any(|d| d.env_nodes) {
            return Ok(None);
        }
        let servers = Arc::clone(&self.state.registry) as Arc<dyn sluice_env::remote::EnvServers>;
        let routed = sluice_env::configured::route_to_env_nodes(
            &setup.registry,
            &config.data,
            config.supervision.env_step_timeout,
            servers,
        )
        .map_err(|e| ActorError::Setup(e.to_string()))?;
        Ok(Some(setup.env_over(config, Arc::new(routed))))
    }

    /// Stops the sweeper and the prober.
    pub async fn stop(mut self) {
        for t in [self.sweeper.take(), self.prober.take()]
            .into_iter()
            .flatten()
        {
            t.abort();
            let _ = t.await;
        }
    }
}

impl Drop for Head {
    fn drop(&mut self) {
        for t in [self.sweeper.take(), self.prober.take()]
            .into_iter()
            .flatten()
        {
            t.abort();
        }
    }
}
