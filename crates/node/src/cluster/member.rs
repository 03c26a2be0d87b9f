//! The engine or env node's side of membership: join the head, heartbeat (with the version
//! loaded and the load), join again when the head no longer knows this node (the head
//! restarted), and leave on a clean stop. Every call carries the node token (`admin.token`);
//! a head that refuses it (401) stops the node with the head's message.
//!
//! Two 409s (another live node holds this name) mean different things. At the first join it is
//! a restart of this node racing the head's heartbeat timeout: [`join`] waits for the old
//! registration to go. After a heartbeat's 404, it means this node was *superseded*: the head
//! declared it lost and a replacement took its name, so no work will be routed here again; the
//! heartbeat task ends and [`Membership::superseded`] reports it, which stops the node.

use std::sync::Arc;
use std::time::Duration;

use serde_json::json;
use sluice_config::Secret;
use sluice_http::{HttpClient, Method, StatusCode};

use super::registry::{Heartbeat, JoinReply, JoinRequest};

/// Deadline of one membership call.
const CALL_TIMEOUT: Duration = Duration::from_secs(5);
/// Pause between join attempts while the head is unreachable.
const RETRY: Duration = Duration::from_secs(1);

/// Why a node could not join.
#[derive(Debug, Clone, thiserror::Error)]
pub enum MemberError {
    /// The head refused the node token.
    #[error(
        "the head at {head} refused this node's token (401): {message}; set the head's admin.token (or $SLUICE_ADMIN_TOKEN) on this node"
    )]
    Unauthorized {
        /// The head.
        head: String,
        /// What the head said.
        message: String,
    },
    /// The head refused the join for another reason (a bad name, too many nodes).
    #[error("the head at {head} refused this node ({status}): {message}")]
    Refused {
        /// The head.
        head: String,
        /// Its status.
        status: StatusCode,
        /// What it said.
        message: String,
    },
    /// The head URL is malformed.
    #[error("{0}")]
    BadUrl(String),
    /// The head lost this node and another live node took its name: nothing is routed here
    /// any more.
    #[error(
        "the head at {head} no longer knows this node `{name}` (404 to its heartbeat) and another live node holds the name now (409 to its join again: {message}): this node was declared lost and replaced; stopping. Give each node its own node.name, or stop the replacement before restarting this one"
    )]
    Superseded {
        /// The head.
        head: String,
        /// This node's name.
        name: String,
        /// What the head said to the join.
        message: String,
    },
}

/// What the heartbeat reports: the policy version loaded and the load, read when sent.
pub type Report = Arc<dyn Fn() -> (Option<u64>, Option<u64>) + Send + Sync>;

/// How a node joins.
pub struct MemberParams {
    /// The head's admin API.
    pub head: String,
    /// The node token.
    pub token: Option<Secret>,
    /// The join request (name, role, URL).
    pub request: JoinRequest,
    /// What each heartbeat reports.
    pub report: Report,
}

/// A joined node's heartbeat task; [`Membership::leave`] stops it and leaves the head;
/// [`Membership::superseded`] says when the head gave this node's name to another.
pub struct Membership {
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    task: Option<tokio::task::JoinHandle<()>>,
    /// Where the heartbeat task reports the end of this membership (superseded).
    lost: Option<tokio::sync::oneshot::Receiver<MemberError>>,
    /// The first join's answer.
    pub joined: JoinReply,
}

fn message_of(body: &[u8]) -> String {
    serde_json::from_slice::<serde_json::Value>(body)
        .ok()
        .and_then(|v| v["error"]["message"].as_str().map(str::to_owned))
        .unwrap_or_else(|| String::from_utf8_lossy(body).into_owned())
}

/// What one join call came to, short of a fatal refusal.
enum Joined {
    /// The head took the node.
    Yes(JoinReply),
    /// Another live node holds the name (409): the head's message.
    NameTaken(String),
    /// The head is unreachable or not ready: try again.
    Retry,
}

/// One join call: the reply, a fatal refusal, a taken name, or a reason to try again.
async fn join_once(client: &HttpClient, params: &MemberParams) -> Result<Joined, MemberError> {
    let body = serde_json::to_vec(&params.request).unwrap_or_default();
    match client
        .call(Method::POST, "/v1/nodes", Some(body), CALL_TIMEOUT)
        .await
    {
        Ok((status, body)) if status.is_success() => serde_json::from_slice(&body)
            .map(Joined::Yes)
            .map_err(|e| MemberError::Refused {
                head: params.head.clone(),
                status,
                message: format!("unreadable join reply: {e}"),
            }),
        Ok((StatusCode::UNAUTHORIZED, body)) => Err(MemberError::Unauthorized {
            head: params.head.clone(),
            message: message_of(&body),
        }),
        Ok((StatusCode::CONFLICT, body)) => Ok(Joined::NameTaken(message_of(&body))),
        Ok((status, body)) if status.is_client_error() => Err(MemberError::Refused {
            head: params.head.clone(),
            status,
            message: message_of(&body),
        }),
        Ok((status, body)) => {
            tracing::warn!(head = %params.head, %status, message = %message_of(&body), "the head could not take this node yet; retrying");
            Ok(Joined::Retry)
        }
        Err(e) => {
            tracing::warn!(head = %params.head, error = %e, "the head is unreachable; retrying");
            Ok(Joined::Retry)
        }
    }
}

/// Joins the head (retrying every second while it is unreachable; a 4xx is final) and starts
/// heartbeating.
pub async fn join(params: MemberParams) -> Result<Membership, MemberError> {
    let client = HttpClient::new(&params.head, "head")
        .map_err(|e| MemberError::BadUrl(e.to_string()))?
        .with_token(params.token.clone());
    let mut name_taken = false;
    let joined = loop {
        match join_once(&client, &params).await? {
            Joined::Yes(reply) => break reply,
            // Another live node holds this name: it may leave or be lost (a restart of this
            // node at a new address, before the head saw the old one go), so wait for it.
            Joined::NameTaken(message) => {
                if !std::mem::replace(&mut name_taken, true) {
                    tracing::warn!(head = %params.head, %message, "the head has another live node under this name; retrying until it is free");
                }
            }
            Joined::Retry => {}
        }
        tokio::time::sleep(RETRY).await;
    };
    tracing::info!(head = %params.head, name = %joined.name, incarnation = joined.incarnation, "joined the head");
    let (stop, stopped) = tokio::sync::oneshot::channel();
    let (lost_tx, lost) = tokio::sync::oneshot::channel();
    let beats = Beats {
        client,
        params,
        joined: joined.clone(),
        stopped,
        lost: lost_tx,
    };
    let task = tokio::spawn(heartbeats(beats));
    Ok(Membership {
        stop: Some(stop),
        task: Some(task),
        lost: Some(lost),
        joined,
    })
}

impl Membership {
    /// Resolves when the head has given this node's name to another live node (the heartbeat
    /// task has ended, and nothing will be routed here again); pending for as long as the
    /// membership holds, and for ever once it was reported or left.
    pub async fn superseded(&mut self) -> MemberError {
        match self.lost.as_mut() {
            Some(lost) => match lost.await {
                Ok(e) => {
                    self.lost = None;
                    e
                }
                // The task ended without a loss (a leave): nothing more will come.
                Err(_) => {
                    self.lost = None;
                    std::future::pending().await
                }
            },
            None => std::future::pending().await,
        }
    }

    /// Stops heartbeating and leaves the head (best effort: a head that is gone loses the
    /// node by its heartbeat timeout instead).
    pub async fn leave(mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(task) = self.task.take() {
            let _ = task.await;
        }
    }
}

impl Drop for Membership {
    fn drop(&mut self) {
        if let Some(task) = self.task.take() {
            task.abort();
        }
    }
}

/// What the heartbeat task owns.
struct Beats {
    client: HttpClient,
    params: MemberParams,
    joined: JoinReply,
    /// Fires on [`Membership::leave`].
    stopped: tokio::sync::oneshot::Receiver<()>,
    /// Where a supersession is reported.
    lost: tokio::sync::oneshot::Sender<MemberError>,
}

async fn heartbeats(beats: Beats) {
    let Beats {
        client,
        params,
        joined,
        mut stopped,
        lost,
    } = beats;
    let period = Duration::try_from_secs_f64(joined.heartbeat_s)
        .unwrap_or(Duration::from_secs(1))
        .max(Duration::from_millis(10));
    let name = joined.name.clone();
    let mut incarnation = joined.incarnation;
    let mut ticker = tokio::time::interval(period);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut reachable = true;
    loop {
        tokio::select! {
            _ = &mut stopped => break,
            _ = ticker.tick() => {}
        }
        let (weight_version, load) = (params.report)();
        let beat = Heartbeat {
            incarnation,
            weight_version,
            load,
        };
        let path = format!("/v1/nodes/{name}/heartbeat");
        let body = serde_json::to_vec(&beat).unwrap_or_default();
        match client
            .call(Method::POST, &path, Some(body), CALL_TIMEOUT)
            .await
        {
            Ok((status, _)) if status.is_success() => {
                if !reachable {
                    tracing::info!(head = %params.head, "the head answers heartbeats again");
                }
                reachable = true;
            }
            Ok((StatusCode::NOT_FOUND, _)) => {
                // The head does not know this incarnation: it restarted (join again), or it
                // lost this node and gave its name to another (the join says 409).
                match join_once(&client, &params).await {
                    Ok(Joined::Yes(reply)) => {
                        incarnation = reply.incarnation;
                        tracing::info!(head = %params.head, incarnation, "joined the head again");
                    }
                    Ok(Joined::NameTaken(message)) => {
                        let e = MemberError::Superseded {
                            head: params.head.clone(),
                            name: name.clone(),
                            message,
                        };
                        tracing::error!(error = %e, "superseded at the head");
                        // The name is the replacement's: no leave (it would be refused), and
                        // the owner of the membership stops the node.
                        let _ = lost.send(e);
                        return;
                    }
                    Ok(Joined::Retry) => {}
                    Err(e) => tracing::error!(error = %e, "the head refused this node's join"),
                }
            }
            Ok((StatusCode::UNAUTHORIZED, body)) => {
                tracing::error!(head = %params.head, message = %message_of(&body), "the head refused this node's token (401)");
            }
            Ok((status, body)) => {
                tracing::warn!(head = %params.head, %status, message = %message_of(&body), "heartbeat refused");
            }
            Err(e) => {
                if reachable {
                    tracing::warn!(head = %params.head, error = %e, "the head does not answer heartbeats");
                }
                reachable = false;
            }
        }
    }
    let body = json!({ "incarnation": incarnation })
        .to_string()
        .into_bytes();
    match client
        .call(
            Method::POST,
            &format!("/v1/nodes/{name}/leave"),
            Some(body),
            CALL_TIMEOUT,
        )
        .await
    {
        Ok((status, _)) if status.is_success() => {
            tracing::info!(head = %params.head, "left the head")
        }
        Ok((status, body)) => {
            tracing::warn!(%status, message = %message_of(&body), "the head refused the leave")
        }
        Err(e) => tracing::warn!(error = %e, "could not tell the head this node leaves"),
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicU32, Ordering};

    use axum::http::StatusCode as Status;
    use sluice_config::NodeRole;

    use super::*;

    /// `head` served on a port of its own, and the join parameters of an engine node `e1` that
    /// reports nothing.
    async fn serve_head(
        head: axum::Router,
    ) -> (tokio::task::JoinHandle<std::io::Result<()>>, MemberParams) {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let server = tokio::spawn(async move { axum::serve(listener, head).await });
        let params = MemberParams {
            head: format!("http://{addr}"),
            token: None,
            request: JoinRequest {
                name: "e1".into(),
                role: NodeRole::Engine,
                url: "http://127.0.0.1:1".into(),
                tasks: Vec::new(),
            },
            report: Arc::new(|| (None, None)),
        };
        (server, params)
    }

    /// A node whose name another live node holds (the head answers 409) waits and joins once
    /// the name is free, where a 409 used to stop it like any refusal.
    #[tokio::test]
    async fn a_join_refused_for_a_taken_name_waits_for_the_name() {
        let calls = Arc::new(AtomicU32::new(0));
        let seen = Arc::clone(&calls);
        let head = axum::Router::new().route(
            "/v1/nodes",
            axum::routing::post(move || {
                let seen = Arc::clone(&seen);
                async move {
                    if seen.fetch_add(1, Ordering::SeqCst) == 0 {
                        let body = json!({"error": {"message": "a live node named `e1` is a member at http://127.0.0.1:2"}});
                        return (Status::CONFLICT, axum::Json(body));
                    }
                    let reply = json!({"name": "e1", "incarnation": 7, "heartbeat_s": 60.0});
                    (Status::OK, axum::Json(reply))
                }
            }),
        );
        let (server, params) = serve_head(head).await;
        let membership = join(params).await.expect("joined after the name came free");
        assert_eq!(membership.joined.incarnation, 7);
        assert_eq!(calls.load(Ordering::SeqCst), 2);
        drop(membership);
        server.abort();
    }

    /// A node the head lost and replaced (its heartbeat gets 404, its join again 409) ends its
    /// membership, naming the head and the name, instead of retrying at every heartbeat for
    /// ever; it joins no more after.
    #[tokio::test]
    async fn a_node_whose_name_was_given_to_another_is_superseded() {
        let joins = Arc::new(AtomicU32::new(0));
        let beats = Arc::new(AtomicU32::new(0));
        let (seen_joins, seen_beats) = (Arc::clone(&joins), Arc::clone(&beats));
        let head = axum::Router::new()
            .route(
                "/v1/nodes",
                axum::routing::post(move || {
                    let seen = Arc::clone(&seen_joins);
                    async move {
                        if seen.fetch_add(1, Ordering::SeqCst) == 0 {
                            let reply = json!({"name": "e1", "incarnation": 1, "heartbeat_s": 0.02});
                            return (Status::OK, axum::Json(reply));
                        }
                        let body = json!({"error": {"message": "a live node named `e1` is a member at http://127.0.0.1:3"}});
                        (Status::CONFLICT, axum::Json(body))
                    }
                }),
            )
            .route(
                "/v1/nodes/{name}/heartbeat",
                axum::routing::post(move || {
                    let seen = Arc::clone(&seen_beats);
                    async move {
                        seen.fetch_add(1, Ordering::SeqCst);
                        (Status::NOT_FOUND, axum::Json(json!({"error": {"message": "not a member"}})))
                    }
                }),
            );
        let (server, params) = serve_head(head).await;
        let head_url = params.head.clone();
        let mut membership = join(params).await.expect("the first join is taken");
        let e = tokio::time::timeout(Duration::from_secs(10), membership.superseded())
            .await
            .expect("superseded, not retrying for ever");
        let text = e.to_string();
        assert!(matches!(e, MemberError::Superseded { .. }), "{text}");
        for expected in [
            head_url,
            "`e1`".into(),
            "409".into(),
            "http://127.0.0.1:3".into(),
        ] {
            assert!(text.contains(&expected), "`{expected}` in {text}");
        }
        // The heartbeat task has ended: no more heartbeats, no more joins.
        let (j, b) = (joins.load(Ordering::SeqCst), beats.load(Ordering::SeqCst));
        tokio::time::sleep(Duration::from_millis(200)).await;
        assert_eq!(
            (joins.load(Ordering::SeqCst), beats.load(Ordering::SeqCst)),
            (j, b)
        );
        assert_eq!(j, 2);
        membership.leave().await;
        server.abort();
    }
}
