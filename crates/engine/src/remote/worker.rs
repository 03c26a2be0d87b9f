//! The remote backend's loop: dispatch to the least-loaded live server, relay completions,
//! mark servers down on transport failures, poll `/health`, publish weights.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Instant;

use hyper::{Method, StatusCode};
use serde_json::{Value, json};
use sluice_core::{PolicyVersion, RequestId, WeightUpdateMode};
use sluice_model::WeightSnapshot as ModelWeights;
use tokio::sync::mpsc;
use tokio::task::JoinSet;

use super::http::HttpClient;
use super::{Command, RemoteParams, Shared, wire};
use crate::backend::{
    Completion, EngineEvent, EventSink, FinishReason, GenerateRequest, TokenOutput,
};

pub(super) struct Server {
    pub(super) client: HttpClient,
    pub(super) up: bool,
    pub(super) inflight: usize,
}

/// What a spawned call reports back to the worker loop.
enum Done {
    Generate {
        id: RequestId,
        server: usize,
        /// What goes to the sink (on a failure: an abort with the partial).
        completion: Completion,
        /// The transport failure that marks the server down, if any.
        failure: Option<String>,
    },
    Update {
        version: PolicyVersion,
        mode: WeightUpdateMode,
        asked: Instant,
        failed: Vec<(usize, String)>,
    },
    Control {
        server: usize,
        ok: bool,
    },
}

pub(super) struct Worker {
    pub(super) params: RemoteParams,
    pub(super) servers: Vec<Server>,
    pub(super) sink: EventSink,
    pub(super) shared: Arc<Shared>,
    pub(super) version: PolicyVersion,
    /// Request → (server, resumed tokens it came with).
    pub(super) inflight: HashMap<RequestId, (usize, usize)>,
}

impl Worker {
    pub(super) async fn run(mut self, mut rx: mpsc::Receiver<Command>) {
        let mut tasks: JoinSet<Done> = JoinSet::new();
        let mut health = tokio::time::interval(self.params.health_interval);
        health.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                command = rx.recv() => match command {
                    None | Some(Command::Shutdown) => return,
                    Some(c) => self.apply(c, &mut tasks),
                },
                Some(done) = tasks.join_next(), if !tasks.is_empty() => match done {
                    Ok(d) => self.on_done(d),
                    Err(e) => tracing::error!(error = %e, "remote engine call panicked"),
                },
                _ = health.tick() => self.check_health(&mut tasks),
            }
        }
    }

    fn apply(&mut self, command: Command, tasks: &mut JoinSet<Done>) {
        match command {
            Command::Submit(request) => self.dispatch(request, tasks),
            Command::Abort(id) => {
                if let Some(&(s, _)) = self.inflight.get(&id) {
                    let body = json!({"rid": id.to_string()});
                    self.control(s, "/abort_request", body, tasks);
                }
            }
            Command::AbortAll => {
                for s in 0..self.servers.len() {
                    if self.servers[s].up {
                        self.control(s, "/abort_request", json!({"abort_all": true}), tasks);
                    }
                }
            }
            Command::Update(weights, mode, asked) => self.update(weights, mode, asked, tasks),
            Command::Shutdown => {}
        }
    }

    fn dispatch(&mut self, request: GenerateRequest, tasks: &mut JoinSet<Done>) {
        let partial = request.resume.clone().unwrap_or_default();
        let pick = (0..self.servers.len())
            .filter(|&i| self.servers[i].up)
            .min_by_key(|&i| self.servers[i].inflight);
        let Some(server) = pick else {
            (self.sink)(EngineEvent::Finished(Completion {
                id: request.id,
                output: partial,
                finish: FinishReason::Error("remote_unavailable".into()),
            }));
            return;
        };
        self.servers[server].inflight += 1;
        self.inflight.insert(request.id, (server, partial.len()));
        self.publish();
        let client = self.servers[server].client.clone();
        let timeout = self.params.request_timeout;
        let version = self.version;
        let body = wire::completion_body(&request, self.params.model_name.as_deref());
        tasks.spawn(async move {
            let id = request.id;
            let fail = |message: String| {
                let aborted = Completion {
                    id,
                    output: partial.clone(),
                    finish: FinishReason::Abort,
                };
                (aborted, Some(message))
            };
            let (completion, failure) = match client
                .call(
                    Method::POST,
                    "/v1/completions",
                    Some(body.to_string().into_bytes()),
                    timeout,
                )
                .await
            {
                Err(e) => fail(e.to_string()),
                Ok((status, _)) if status.is_server_error() => {
                    fail(format!("{}: status {status}", client.url))
                }
                Ok((status, bytes)) => (
                    finish_from_reply(id, &partial, status, &bytes, version),
                    None,
                ),
            };
            Done::Generate {
                id,
                server,
                completion,
                failure,
            }
        });
    }

    fn control(
        &mut self,
        server: usize,
        path: &'static str,
        body: Value,
        tasks: &mut JoinSet<Done>,
    ) {
        let client = self.servers[server].client.clone();
        let timeout = self.params.control_timeout;
        tasks.spawn(async move {
            let r = client
                .call(
                    Method::POST,
                    path,
                    Some(body.to_string().into_bytes()),
                    timeout,
                )
                .await;
            Done::Control {
                server,
                ok: r.is_ok(),
            }
        });
    }

    fn check_health(&mut self, tasks: &mut JoinSet<Done>) {
        for (server, s) in self.servers.iter().enumerate() {
            if s.up {
                continue;
            }
            let client = s.client.clone();
            let timeout = self.params.control_timeout;
            tasks.spawn(async move {
                let r = client.call(Method::GET, "/health", None, timeout).await;
                Done::Control {
                    server,
                    ok: matches!(r, Ok((st, _)) if st.is_success()),
                }
            });
        }
    }

    fn update(
        &mut self,
        weights: Arc<ModelWeights>,
        mode: WeightUpdateMode,
        asked: Instant,
        tasks: &mut JoinSet<Done>,
    ) {
        let version = weights.version;
        let dir = self.params.weights_dir.join(format!("v{:06}", version.0));
        let aux = self.params.aux_files_from.clone();
        let live: Vec<(usize, HttpClient)> = self
            .servers
            .iter()
            .enumerate()
            .filter(|(_, s)| s.up)
            .map(|(i, s)| (i, s.client.clone()))
            .collect();
        let timeout = self.params.request_timeout;
        tasks.spawn(async move {
            let write_dir = dir.clone();
            let written = tokio::task::spawn_blocking(move || -> Result<(), String> {
                sluice_model::save_checkpoint(
                    &weights,
                    &write_dir,
                    &sluice_model::SaveOptions::default(),
                )
                .map_err(|e| e.to_string())?;
                if let Some(src) = aux {
                    sluice_model::copy_aux_files(&src, &write_dir).map_err(|e| e.to_string())?;
                }
                Ok(())
            })
            .await
            .unwrap_or_else(|e| Err(format!("writer thread: {e}")));
            if let Err(e) = written {
                let failed = live
                    .iter()
                    .map(|(i, _)| (*i, format!("writing {}: {e}", dir.display())))
                    .collect();
                return Done::Update {
                    version,
                    mode,
                    asked,
                    failed,
                };
            }
            let body = json!({
                "model_path": dir,
                "weight_version": version.0,
                "mode": mode.as_str(),
                "abort_all_requests": mode == WeightUpdateMode::AbortResume,
            })
            .to_string();
            let calls = live.iter().map(|(i, c)| {
                let body = body.clone().into_bytes();
                async move {
                    match c
                        .call(
                            Method::POST,
                            "/update_weights_from_disk",
                            Some(body),
                            timeout,
                        )
                        .await
                    {
                        Ok((st, _)) if st.is_success() => None,
                        Ok((st, b)) => {
                            Some((*i, format!("status {st}: {}", String::from_utf8_lossy(&b))))
                        }
                        Err(e) => Some((*i, e.to_string())),
                    }
                }
            });
            let failed = futures::future::join_all(calls)
                .await
                .into_iter()
                .flatten()
                .collect();
            Done::Update {
                version,
                mode,
                asked,
                failed,
            }
        });
    }

    fn on_done(&mut self, done: Done) {
        match done {
            Done::Generate {
                id,
                server,
                completion,
                failure,
            } => {
                let resumed = self.inflight.remove(&id).map_or(0, |(_, r)| r);
                self.servers[server].inflight = self.servers[server].inflight.saturating_sub(1);
                if let Some(message) = failure {
                    self.mark_down(server, &message);
                }
                let new_tokens = completion.output.len().saturating_sub(resumed);
                self.shared
                    .generated_tokens
                    .fetch_add(new_tokens as u64, Ordering::Relaxed);
                self.publish();
                (self.sink)(EngineEvent::Finished(completion));
            }
            Done::Update {
                version,
                mode,
                asked,
                failed,
            } => {
                for (server, message) in &failed {
                    self.mark_down(*server, message);
                }
                if failed.len() < self.servers.len() && version >= self.version {
                    self.version = version;
                    self.shared.version.store(version.0, Ordering::Relaxed);
                }
                (self.sink)(EngineEvent::WeightsUpdated {
                    version: self.version,
                    pause: asked.elapsed(),
                    mode,
                });
            }
            Done::Control { server, ok } => {
                if ok && !self.servers[server].up {
                    tracing::info!(url = %self.servers[server].client.url, "remote engine server is back");
                    self.servers[server].up = true;
                    self.publish();
                }
            }
        }
    }

    fn mark_down(&mut self, server: usize, message: &str) {
        if self.servers[server].up {
            tracing::warn!(url = %self.servers[server].client.url, %message, "remote engine server marked down");
            self.servers[server].up = false;
            self.publish();
        }
    }

    fn publish(&self) {
        self.shared
            .running
            .store(self.inflight.len() as u64, Ordering::Relaxed);
        let up = self.servers.iter().filter(|s| s.up).count();
        self.shared.servers_up.store(up as u64, Ordering::Relaxed);
    }
}

/// The completion of a request from a server's reply (2xx or 4xx): the resumed tokens first.
fn finish_from_reply(
    id: RequestId,
    partial: &TokenOutput,
    status: StatusCode,
    bytes: &[u8],
    version: PolicyVersion,
) -> Completion {
    let mut output = partial.clone();
    let finish = if !status.is_success() {
        tracing::warn!(%id, %status, body = %String::from_utf8_lossy(bytes), "remote engine refused a request");
        FinishReason::Error("remote_bad_request".into())
    } else {
        match serde_json::from_slice::<Value>(bytes)
            .map_err(|e| wire::BadReply(e.to_string()))
            .and_then(|v| wire::parse_completion(&v, version))
        {
            Ok((new, finish)) => {
                output.token_ids.extend(new.token_ids);
                output.logprobs.extend(new.logprobs);
                output.versions.extend(new.versions);
                finish
            }
            Err(wire::BadReply(reason)) => {
                tracing::warn!(%id, %reason, "remote engine reply is malformed");
                FinishReason::Error("remote_bad_reply".into())
            }
        }
    };
    Completion { id, output, finish }
}
