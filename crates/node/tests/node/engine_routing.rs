//! The engine actor routes a resumed request back to the replica that served it, and balances
//! fresh requests across replicas.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use sluice_actors::engine::{BackendFactory, EngineHandle};
use sluice_core::{
    GroupId, NodeId, PolicyVersion, RequestId, RunId, WeightSnapshot, WeightUpdateMode,
};
use sluice_engine::{EngineError, EngineStats, GenerateRequest, InferenceBackend, SamplingParams};

type Log = Arc<Mutex<Vec<(u32, RequestId)>>>;

struct Recorder(u32, Log);

impl InferenceBackend for Recorder {
    fn submit(&self, request: GenerateRequest) -> Result<(), EngineError> {
        self.1.lock().unwrap().push((self.0, request.id));
        Ok(())
    }
    fn abort(&self, _id: RequestId) -> Result<(), EngineError> {
        Ok(())
    }
    fn abort_all(&self) -> Result<(), EngineError> {
        Ok(())
    }
    fn update_weights(
        &self,
        _w: WeightSnapshot,
        _mode: WeightUpdateMode,
    ) -> Result<(), EngineError> {
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

fn request(counter: u64) -> GenerateRequest {
    GenerateRequest {
        id: GroupId {
            run: RunId::from_name("r"),
            node: NodeId(0),
            counter,
        }
        .rollout(0)
        .request(0, 0),
        prompt_token_ids: vec![1],
        resume: None,
        params: SamplingParams {
            temperature: 1.0,
            top_p: 1.0,
            top_k: 0,
            max_tokens: 8,
            seed: None,
            stop_token_ids: vec![],
        },
        domain: None,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn resumed_requests_go_back_to_their_replica() {
    let log: Log = Arc::default();
    let factory_log = Arc::clone(&log);
    let factory: BackendFactory = Arc::new(move |replica, _v, _sink| {
        Box::new(Recorder(replica, Arc::clone(&factory_log))) as Box<dyn InferenceBackend>
    });
    let (engine, join) = EngineHandle::spawn(3, PolicyVersion(0), factory, Arc::new(|_| {}))
        .await
        .unwrap();
    for c in 0..6 {
        engine.generate(request(c), None);
    }
    engine.generate(request(100), Some(2));
    engine.generate(request(101), Some(2));
    engine.generate(request(102), Some(7)); // no such replica: falls back to the least loaded
    let _ = engine.stats().await.unwrap(); // the mailbox is FIFO: everything above is handled
    let log = log.lock().unwrap().clone();
    let per_replica = |r: u32| {
        log.iter()
            .filter(|(x, id)| *x == r && id.rollout.group.counter < 100)
            .count()
    };
    assert_eq!(
        (per_replica(0), per_replica(1), per_replica(2)),
        (2, 2, 2),
        "fresh requests are balanced"
    );
    for c in [100, 101] {
        assert!(
            log.iter()
                .any(|(r, id)| *r == 2 && id.rollout.group.counter == c),
            "resume {c} left replica 2"
        );
    }
    assert!(log.iter().any(|(_, id)| id.rollout.group.counter == 102));
    engine.stop().await;
    tokio::time::timeout(Duration::from_secs(5), join)
        .await
        .unwrap()
        .unwrap();
}
