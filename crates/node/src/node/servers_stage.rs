//! [`Stage::Servers`](super::Stage::Servers): what serves and watches a running pipeline — the
//! periodic checkpoints, the admin API, `/metrics` and the telemetry task.

use std::sync::Arc;
use std::time::Duration;

use metrics_exporter_prometheus::PrometheusHandle;
use sluice_config::Config;

use crate::admin::{self, AdminState, Server};
use crate::cluster::ClusterState;
use crate::handles::NodeHandles;
use crate::{checkpoints, telemetry};
use sluice_actors::ActorError;

/// What the servers stage starts from.
pub(super) struct ServersInputs {
    /// Serve the admin API on `admin.listen`.
    pub serve_admin: bool,
    /// The Prometheus recorder, when installed.
    pub prom: Option<PrometheusHandle>,
    /// A head's members and served weights, for its admin API.
    pub cluster: Option<Arc<ClusterState>>,
    /// The domains the sample source serves (gauges are seeded for each).
    pub domains: Vec<String>,
}

/// The servers stage's guard.
#[derive(Default)]
pub(crate) struct Servers {
    pub admin: Option<Server>,
    pub metrics: Option<Server>,
    telemetry: Option<tokio::task::JoinHandle<()>>,
    /// Periodic checkpoints (`supervision.checkpoint_every_steps`).
    checkpointer: Option<tokio::task::JoinHandle<()>>,
}

impl Servers {
    /// Starts the servers stage; on a failure half-way, what it started is stopped first.
    pub(super) async fn start(
        config: &Config,
        handles: &NodeHandles,
        inputs: ServersInputs,
    ) -> Result<Self, ActorError> {
        let mut servers = Self::default();
        match servers.fill(config, handles, inputs).await {
            Ok(()) => Ok(servers),
            Err(e) => {
                servers.stop().await;
                Err(e)
            }
        }
    }

    async fn fill(
        &mut self,
        config: &Config,
        handles: &NodeHandles,
        inputs: ServersInputs,
    ) -> Result<(), ActorError> {
        let ServersInputs {
            serve_admin,
            prom,
            cluster,
            domains,
        } = inputs;
        let members = cluster.as_ref().map(|c| Arc::clone(&c.registry));
        if prom.is_some() {
            let datasets: Vec<String> =
                config.data.datasets.iter().map(|d| d.to_string()).collect();
            telemetry::seed_node(config.engine.replicas.get() as usize, &domains, &datasets);
        }
        self.checkpointer =
            checkpoints::spawn_periodic(handles, config.supervision.checkpoint_every_steps);
        if serve_admin {
            let state = AdminState {
                node: handles.clone(),
                token: config.admin.token.clone(),
                cluster,
            };
            self.admin = Some(Server::start(config.admin.listen, admin::router(state)).await?);
        }
        if let (Some(h), true) = (&prom, config.metrics.enabled) {
            let router = admin::metrics_router(h.clone(), members);
            self.metrics = Some(Server::start(config.metrics.listen, router).await?);
        }
        self.telemetry = Some(tokio::spawn(telemetry::run(
            handles.engine.clone(),
            handles.knobs.clone(),
            prom,
            Duration::from_millis(250),
        )));
        Ok(())
    }

    /// Stops the telemetry and checkpoint tasks, then the admin API and `/metrics`.
    pub(super) async fn stop(mut self) {
        for t in [self.telemetry.take(), self.checkpointer.take()]
            .into_iter()
            .flatten()
        {
            t.abort();
            let _ = t.await;
        }
        for server in [self.admin.take(), self.metrics.take()]
            .into_iter()
            .flatten()
        {
            server.shutdown().await;
        }
    }
}

impl Drop for Servers {
    /// Not stopped: aborts the tasks; the servers stop as they are dropped.
    fn drop(&mut self) {
        for t in [self.telemetry.take(), self.checkpointer.take()]
            .into_iter()
            .flatten()
        {
            t.abort();
        }
    }
}
