//! A vacant engine replica slot (a head with no engine node free) takes a node as soon as it
//! joins the registry: the registry's change wakes it, no timer does. Time is paused, so the
//! delay measured is the engine's own (virtual) time from the join to the replica being alive:
//! woken by the join it is 0; a slot that looked again every 0.5 s would wait for its next look
//! (250 ms here, the join falling halfway between two looks). The test wakes on the factory's
//! build on the claimed node, not on a poll of the engine's health.

use crate::common;

use std::sync::Arc;
use std::time::Duration;

use sluice_actors::engine::{EngineHandle, EngineSupervision, ReplicaFactory};
use sluice_config::NodeRole;
use sluice_core::{PolicyVersion, RequestId, WeightSnapshot, WeightUpdateMode};
use sluice_engine::{EngineError, EngineStats, GenerateRequest, InferenceBackend};
use sluice_node::cluster::registry::{JoinRequest, Registry};
use tokio::time::Instant;

use common::Recorded;

/// A replica that accepts everything and never answers.
struct Idle;

impl InferenceBackend for Idle {
    fn submit(&self, _r: GenerateRequest) -> Result<(), EngineError> {
        Ok(())
    }
    fn abort(&self, _id: RequestId) -> Result<(), EngineError> {
        Ok(())
    }
    fn abort_all(&self) -> Result<(), EngineError> {
        Ok(())
    }
    fn update_weights(&self, _w: WeightSnapshot, _m: WeightUpdateMode) -> Result<(), EngineError> {
        Ok(())
    }
    fn stats(&self) -> EngineStats {
        EngineStats::default()
    }
    fn shutdown(&mut self) {}
    fn is_alive(&self) -> bool {
        true
    }
    fn server_gone(&self) -> Option<String> {
        None
    }
}

#[tokio::test(start_paused = true)]
async fn a_vacant_slot_takes_a_node_when_it_joins_not_at_a_timer() {
    let registry = Arc::new(Registry::with_timings(
        Duration::from_secs(1),
        Duration::from_secs(3600),
        8,
    ));
    let claims = Arc::clone(&registry);
    // The replicas built on a claimed node.
    let built: Arc<Recorded<u32>> = Arc::default();
    let on_build = Arc::clone(&built);
    let factory = ReplicaFactory::new(move |replica, _w, _sink| {
        claims
            .claim(replica)
            .map_err(|reason| EngineError::NoServer { replica, reason })?;
        on_build.push(replica);
        Ok(Box::new(Idle) as Box<dyn InferenceBackend>)
    })
    .with_wake(registry.subscribe());
    let (engine, join) = EngineHandle::spawn_supervised(
        1,
        PolicyVersion(0),
        factory,
        Arc::new(|_| {}),
        EngineSupervision::default(),
    )
    .await
    .unwrap();
    // Vacant for a while; the join falls between two half-second marks.
    tokio::time::sleep(Duration::from_millis(2250)).await;
    assert!(!engine.health().await.unwrap()[0].alive, "no node yet");
    let joined = Instant::now();
    registry
        .join(JoinRequest {
            name: "e1".into(),
            role: NodeRole::Engine,
            url: "http://127.0.0.1:9".into(),
            tasks: Vec::new(),
        })
        .unwrap();
    built
        .until("the replica built on the node", |b| !b.is_empty())
        .await;
    let waited = joined.elapsed();
    assert!(engine.health().await.unwrap()[0].alive);
    println!(
        "join → replica alive: {} ms (engine time)",
        waited.as_millis()
    );
    assert!(
        waited < Duration::from_millis(100),
        "the slot waited {waited:?} after the join: it was not woken by it"
    );
    let health = &engine.health().await.unwrap()[0];
    assert_eq!(health.restarts, 1, "{health:?}");
    assert!(
        health.failures.is_empty(),
        "vacancy is no failure: {health:?}"
    );
    engine.stop().await;
    join.await.unwrap();
}
