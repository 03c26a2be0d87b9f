//! The head's engine replicas: slot `i` runs on `engine.remote_urls[i]` when the config lists
//! one (static servers), else on a live engine node claimed from the [`Registry`]. A slot with
//! no node free answers [`EngineError::NoServer`]: the engine actor keeps it vacant and tries
//! again at the registry's next change (a join, a return), so a node that joins (or rejoins)
//! gets a replica as soon as it is in the registry.
//!
//! A replica on a joined node is a [`RemoteEngine`] whose weights come from the head over HTTP
//! (the node shares no disk with the head), wrapped in [`MemberBackend`]: it reports itself dead
//! as soon as the registry loses the node (no heartbeat for `node.lost_after_s`) or the node
//! joins again as a new incarnation, so the engine actor fails it (its requests come back
//! aborted with their partials and resume elsewhere) even when no call is pending to notice.
//!
//! Such a replica's death is its node's, not its own ([`InferenceBackend::server_gone`]): when
//! a call to the node got no answer, the node is marked unreachable in the registry at once (no
//! slot claims it again until a probe answers or it joins again), and the engine actor moves the
//! slot to another live node, or keeps it vacant, counting nothing towards
//! `supervision.engine_max_restarts`. A node that answers with errors (a refused weight install)
//! fails its replica as any replica fails: that counts.

use std::sync::Arc;

use sluice_config::Config;
use sluice_core::WeightSnapshot;
use sluice_engine::remote::{RemoteEngine, RemoteParams, WeightDirs};
use sluice_engine::{EngineError, EventSink, InferenceBackend};
use sluice_model::ModelWeights;

use super::registry::{Claim, Registry};
use sluice_actors::engine::ReplicaFactory;

/// What the head's replica factory needs.
pub struct HeadEngines {
    /// The membership registry.
    pub registry: Arc<Registry>,
    /// Versions served to joined nodes over HTTP.
    pub served: Arc<WeightDirs>,
    /// Versions written for static servers (`engine.remote_urls`), which read them from disk.
    pub on_disk: Arc<WeightDirs>,
    /// The weights until the first published snapshot carries a model.
    pub initial: Arc<ModelWeights>,
}

/// The head's replica factory (see the module docs).
pub fn head_factory(config: &Config, engines: HeadEngines) -> ReplicaFactory {
    let engine = config.engine.clone();
    let node_token = config.admin.token.clone();
    let HeadEngines {
        registry,
        served,
        on_disk,
        initial,
    } = engines;
    let wake = registry.subscribe();
    ReplicaFactory::new(move |replica, weights: &WeightSnapshot, sink: EventSink| {
        let model = ModelWeights::from_envelope(weights).unwrap_or_else(|| Arc::clone(&initial));
        let start = |params: RemoteParams| {
            RemoteEngine::start(params, weights.version, sink.clone())
                .map_err(|reason| EngineError::Start { replica, reason })
        };
        if (replica as usize) < engine.remote_urls.len() {
            let params =
                RemoteParams::from_config(&engine, replica, Arc::clone(&on_disk), Some(model));
            return Ok(Box::new(start(params)?) as Box<dyn InferenceBackend>);
        }
        let claim = registry
            .claim(replica)
            .map_err(|reason| EngineError::NoServer { replica, reason })?;
        tracing::info!(replica, node = %claim.name, url = %claim.url, "engine replica runs on a joined node");
        let mut params =
            RemoteParams::from_config(&engine, replica, Arc::clone(&served), Some(model));
        params.url = claim.url.clone();
        // A joined node guards its weight and control routes with the node token.
        params.token = node_token.clone();
        Ok(Box::new(MemberBackend {
            inner: start(params)?,
            registry: Arc::clone(&registry),
            claim,
        }) as Box<dyn InferenceBackend>)
    })
    .with_wake(wake)
}

/// A replica on a joined engine node: alive only while the node is (see the module docs).
pub struct MemberBackend {
    inner: RemoteEngine,
    registry: Arc<Registry>,
    claim: Claim,
}

impl InferenceBackend for MemberBackend {
    sluice_engine::forward_backend!(
        inner => submit, abort, abort_all, update_weights, stats, shutdown
    );

    fn is_alive(&self) -> bool {
        self.inner.is_alive()
            && self
                .registry
                .is_live(&self.claim.name, self.claim.incarnation)
    }

    fn server_gone(&self) -> Option<String> {
        let Claim {
            name,
            incarnation,
            url,
        } = &self.claim;
        if let Some(why) = self.inner.unreachable() {
            self.registry.mark_unreachable(name, *incarnation, &why);
            return Some(format!(
                "engine node `{name}` at {url} is unreachable: {why}"
            ));
        }
        (!self.registry.is_live(name, *incarnation)).then(|| {
            format!("engine node `{name}` at {url} left, was lost, is unreachable or joined again")
        })
    }
}
