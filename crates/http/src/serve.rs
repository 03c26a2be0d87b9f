//! The one HTTP/1.1 server loop of Sluice's servers (admin API, env server, inference server):
//! axum routes served with deadlines on receiving a request, a cap on open connections and a
//! bounded graceful stop.
//!
//! What one client can hold, and for how long:
//! - the request line and headers must arrive within [`ServeOptions::header_read_timeout`]
//!   (hyper's timer; it also closes a keep-alive connection left idle that long);
//! - the body must arrive within [`ServeOptions::body_read_timeout`] of the head: a request
//!   whose body is late answers 408 and its connection is closed. Together the two are the
//!   whole request's deadline. The *answer* has none: a long SSE token stream is legitimate;
//! - but an answer's bytes must keep leaving: a client that takes none of them for
//!   [`ServeOptions::write_stall_timeout`] (it stopped reading) has its connection closed;
//! - at most [`ServeOptions::max_connections`] connections are open at once (by default half
//!   the process's open-file limit): at the cap the server stops accepting, so further clients
//!   wait in the kernel's listen queue (their connect completes, their request is answered
//!   once a connection closes) instead of taking a file descriptor each;
//! - on stop, connections still busy after the grace period are dropped, so a stuck handler
//!   never keeps a stopping process alive.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::task::{Context, Poll};
use std::time::Duration;

use axum::response::IntoResponse;
use hyper::body::{Body, Frame, Incoming, SizeHint};
use hyper::service::Service as _;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::service::TowerToHyperService;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use tokio::task::JoinSet;
use tokio::time::{Instant, Sleep};

use crate::ApiError;

mod stall;

/// Default of [`ServeOptions::header_read_timeout`].
pub const DEFAULT_HEADER_READ_TIMEOUT: Duration = Duration::from_secs(10);

/// Default of [`ServeOptions::shutdown_grace`].
pub const DEFAULT_SHUTDOWN_GRACE: Duration = Duration::from_secs(10);

/// Default of [`ServeOptions::body_read_timeout`]: the largest bodies our servers take (a few
/// MB of prompts or env calls) arrive in well under a second on the networks they serve; 30 s
/// leaves room for a slow link while a client that stalls lets go of its connection soon.
pub const DEFAULT_BODY_READ_TIMEOUT: Duration = Duration::from_secs(30);

/// Default of [`ServeOptions::write_stall_timeout`]: a client that reads nothing for a minute
/// has gone or stopped; one that keeps reading is not cut (see [`ServeOptions::write_stall_timeout`]).
pub const DEFAULT_WRITE_STALL_TIMEOUT: Duration = Duration::from_secs(60);

/// Most connections [`ServeOptions::default`] allows, whatever the open-file limit: each one
/// costs a task and hyper's buffers, and 8192 is twice the inference server's default sequence
/// budget (one streamed call per sequence at most).
pub const MAX_DEFAULT_CONNECTIONS: usize = 8192;

/// [`ServeOptions::max_connections`] when the open-file limit cannot be read: half of the usual
/// soft limit of 1024.
const FALLBACK_MAX_CONNECTIONS: usize = 512;

/// How a server treats slow clients and its own stop.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ServeOptions {
    /// Longest a client may take to send a request's line and headers; the connection is
    /// closed after it.
    pub header_read_timeout: Duration,
    /// Longest a request's body may take to arrive, counted from when its head was read; the
    /// request then answers 408 (`request_timeout`) and its connection is closed. Answers,
    /// streamed ones included, have no deadline.
    pub body_read_timeout: Duration,
    /// Longest an answer may wait for the client to take its next bytes (the client's socket
    /// buffer full, the client reading nothing); the connection is then closed. A stream the
    /// client keeps reading is not cut; one behind by a full socket buffer must take about half
    /// of it (a few MB at most) within this time, when the kernel lets the server write again.
    pub write_stall_timeout: Duration,
    /// Most connections open at once; at the cap the server accepts no more until one closes
    /// (clients over it wait in the listen queue, holding no descriptor of this process).
    pub max_connections: usize,
    /// Longest the stop waits for requests in flight once the shutdown future resolved; the
    /// connections still open then are dropped (their handlers cancelled).
    pub shutdown_grace: Duration,
}

impl Default for ServeOptions {
    /// The `DEFAULT_*` deadlines and [`default_max_connections`].
    fn default() -> Self {
        Self {
            header_read_timeout: DEFAULT_HEADER_READ_TIMEOUT,
            body_read_timeout: DEFAULT_BODY_READ_TIMEOUT,
            write_stall_timeout: DEFAULT_WRITE_STALL_TIMEOUT,
            max_connections: default_max_connections(),
            shutdown_grace: DEFAULT_SHUTDOWN_GRACE,
        }
    }
}

/// Half the process's soft open-file limit (`RLIMIT_NOFILE`), the other half left to model
/// files, stores, sandboxes and outgoing calls; at least 1, at most [`MAX_DEFAULT_CONNECTIONS`]
/// (512 when the limit cannot be read).
pub fn default_max_connections() -> usize {
    open_files_limit().map_or(FALLBACK_MAX_CONNECTIONS, |n| {
        usize::try_from(n / 2)
            .unwrap_or(usize::MAX)
            .clamp(1, MAX_DEFAULT_CONNECTIONS)
    })
}

/// The soft `RLIMIT_NOFILE`, when it can be read.
#[cfg(unix)]
#[allow(unsafe_code)]
#[allow(clippy::unnecessary_cast)] // `rlim_t` is not `u64` on every Unix target.
fn open_files_limit() -> Option<u64> {
    let mut limit = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit writes one `rlimit` through a pointer to a live, owned value.
    let rc = unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) };
    (rc == 0).then_some(limit.rlim_cur as u64)
}

/// The soft `RLIMIT_NOFILE`, when it can be read.
#[cfg(not(unix))]
fn open_files_limit() -> Option<u64> {
    None
}

/// Serves `router` on `listener` until `shutdown` resolves, then stops accepting, lets the
/// requests in flight finish for at most [`ServeOptions::shutdown_grace`] and drops the rest.
/// Every connection task is owned here and ended before this returns.
pub async fn serve(
    listener: TcpListener,
    router: axum::Router,
    options: ServeOptions,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let max_connections = options.max_connections.max(1);
    let (stop, stopping) = watch::channel(false);
    let mut connections = JoinSet::new();
    let mut shutdown = std::pin::pin!(shutdown);
    let mut at_cap = false;
    loop {
        let room = connections.len() < max_connections;
        if !room && !at_cap {
            tracing::warn!(
                max_connections,
                "open connections at the cap; new clients wait until one closes"
            );
        }
        at_cap = !room;
        tokio::select! {
            () = &mut shutdown => break,
            // At the cap nothing is accepted: the next clients wait in the listen queue until
            // a connection ends (reaped below), holding no descriptor of ours.
            accepted = listener.accept(), if room => match accepted {
                Ok((stream, _)) => {
                    connections.spawn(connection(
                        stream,
                        router.clone(),
                        options,
                        stopping.clone(),
                    ));
                }
                Err(e) if is_connection_error(&e) => {}
                Err(e) => {
                    // Out of file descriptors, say: wait instead of spinning on the error.
                    tracing::error!(error = %e, "accepting a connection failed");
                    tokio::time::sleep(Duration::from_secs(1)).await;
                }
            },
            Some(_) = connections.join_next(), if !connections.is_empty() => {}
        }
    }
    drop(listener);
    let _ = stop.send(true);
    let drained = async { while connections.join_next().await.is_some() {} };
    if tokio::time::timeout(options.shutdown_grace, drained)
        .await
        .is_err()
    {
        tracing::warn!(
            open = connections.len(),
            grace_s = options.shutdown_grace.as_secs_f64(),
            "requests still running after the shutdown grace period; dropping them"
        );
        connections.abort_all();
        while connections.join_next().await.is_some() {}
    }
    Ok(())
}

/// One connection, closed gracefully (after its request in flight) once `stopping` turns true.
/// Each request's body must arrive within [`ServeOptions::body_read_timeout`] of its head, and
/// no write may wait longer than [`ServeOptions::write_stall_timeout`] for the client.
async fn connection(
    stream: TcpStream,
    router: axum::Router,
    options: ServeOptions,
    mut stopping: watch::Receiver<bool>,
) {
    let body_read_timeout = options.body_read_timeout;
    let _ = stream.set_nodelay(true);
    let mut builder = hyper::server::conn::http1::Builder::new();
    builder
        .timer(TokioTimer::new())
        .header_read_timeout(options.header_read_timeout);
    let routes = TowerToHyperService::new(router);
    let service = hyper::service::service_fn(move |request: hyper::Request<Incoming>| {
        let late = Arc::new(AtomicBool::new(false));
        let request = request.map(|body| DeadlineBody {
            inner: body,
            deadline: Instant::now() + body_read_timeout,
            sleep: None,
            after: body_read_timeout,
            late: Arc::clone(&late),
        });
        let answer = routes.call(request);
        async move {
            let answer: axum::response::Response = answer.await?;
            if late.load(Ordering::Acquire) {
                // Whatever the route made of the failed body (axum's plain 400, say), the
                // client is told the truth, in the API's shape; the unread rest of the body
                // makes hyper close the connection after this answer.
                let mut refusal = ApiError::new(
                    hyper::StatusCode::REQUEST_TIMEOUT,
                    "request_timeout",
                    format!(
                        "the request body did not arrive within {} s of its headers",
                        body_read_timeout.as_secs_f64()
                    ),
                )
                .into_response();
                refusal.headers_mut().insert(
                    hyper::header::CONNECTION,
                    hyper::header::HeaderValue::from_static("close"),
                );
                return Ok::<_, std::convert::Infallible>(refusal);
            }
            Ok(answer)
        }
    });
    let stream = stall::StallGuard::new(stream, options.write_stall_timeout);
    let conn = builder.serve_connection(TokioIo::new(stream), service);
    let mut conn = std::pin::pin!(conn);
    let mut asked = false;
    loop {
        tokio::select! {
            ended = conn.as_mut() => {
                if let Err(e) = ended {
                    tracing::debug!(error = %e, "connection ended with an error");
                }
                return;
            }
            _ = stopping.wait_for(|s| *s), if !asked => {
                asked = true;
                conn.as_mut().graceful_shutdown();
            }
        }
    }
}

/// A request body that fails with [`BodyReadTimeout`] once its deadline passes while a frame
/// is still awaited (a body already read is never cut), and then marks the request `late`.
struct DeadlineBody {
    inner: Incoming,
    deadline: Instant,
    /// Created at the first wait, so a body that is already buffered costs no timer.
    sleep: Option<Pin<Box<Sleep>>>,
    after: Duration,
    late: Arc<AtomicBool>,
}

impl Body for DeadlineBody {
    type Data = hyper::body::Bytes;
    type Error = Box<dyn std::error::Error + Send + Sync>;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Self::Data>, Self::Error>>> {
        let this = &mut *self;
        if let Poll::Ready(frame) = Pin::new(&mut this.inner).poll_frame(cx) {
            return Poll::Ready(frame.map(|f| f.map_err(Into::into)));
        }
        let deadline = this.deadline;
        let sleep = this
            .sleep
            .get_or_insert_with(|| Box::pin(tokio::time::sleep_until(deadline)));
        match sleep.as_mut().poll(cx) {
            Poll::Ready(()) => {
                this.late.store(true, Ordering::Release);
                Poll::Ready(Some(Err(Box::new(BodyReadTimeout { after: this.after }))))
            }
            Poll::Pending => Poll::Pending,
        }
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

/// A request body still incomplete at its deadline.
#[derive(Debug, thiserror::Error)]
#[error("the request body did not arrive within {after:?}")]
struct BodyReadTimeout {
    after: Duration,
}

/// Errors of one connection (the peer gave up during the handshake), not of the listener.
fn is_connection_error(e: &std::io::Error) -> bool {
    use std::io::ErrorKind::{ConnectionAborted, ConnectionRefused, ConnectionReset};
    matches!(
        e.kind(),
        ConnectionRefused | ConnectionAborted | ConnectionReset
    )
}

#[cfg(test)]
mod tests {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    use super::*;

    pub(super) type Started = (
        std::net::SocketAddr,
        tokio::sync::oneshot::Sender<()>,
        tokio::task::JoinHandle<std::io::Result<()>>,
    );

    pub(super) async fn start(router: axum::Router, options: ServeOptions) -> Started {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let task = tokio::spawn(serve(listener, router, options, async move {
            let _ = stopped.await;
        }));
        (addr, stop, task)
    }

    /// Everything the server sends until it closes, or `None` if it is still open after 20 s.
    pub(super) async fn until_closed(stream: &mut TcpStream) -> Option<String> {
        let mut rest = Vec::new();
        match tokio::time::timeout(Duration::from_secs(20), stream.read_to_end(&mut rest)).await {
            Ok(_) => Some(String::from_utf8_lossy(&rest).into_owned()),
            Err(_) => None,
        }
    }

    /// A head announcing a 100000-byte body, and one byte of it.
    const SLOW_POST: &[u8] =
        b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 100000\r\n\r\n{";

    fn echo_router() -> axum::Router {
        axum::Router::new()
            .route(
                "/echo",
                axum::routing::post(|body: axum::body::Bytes| async move { body }),
            )
            .route("/", axum::routing::get(|| async { "ok" }))
    }

    #[tokio::test]
    async fn a_body_that_stalls_is_answered_408_and_its_connection_closed() {
        let options = ServeOptions {
            body_read_timeout: Duration::from_millis(200),
            ..ServeOptions::default()
        };
        let (addr, stop, task) = start(echo_router(), options).await;
        let mut slow = TcpStream::connect(addr).await.unwrap();
        slow.write_all(SLOW_POST).await.unwrap();
        let reply = until_closed(&mut slow).await;
        let reply = reply.expect("a stalled body holds its connection open");
        assert!(reply.starts_with("HTTP/1.1 408"), "{reply}");
        assert!(reply.contains("\"type\":\"request_timeout\""), "{reply}");
        assert!(reply.contains("did not arrive within 0.2 s"), "{reply}");
        // A route that never reads the body lets go of the connection too.
        let mut ignored = TcpStream::connect(addr).await.unwrap();
        ignored
            .write_all(b"GET / HTTP/1.1\r\nHost: x\r\nContent-Length: 100000\r\n\r\n{")
            .await
            .unwrap();
        let reply = until_closed(&mut ignored).await;
        let reply = reply.expect("an unread body holds its connection open");
        assert!(reply.starts_with("HTTP/1.1 200"), "{reply}");
        // A whole body within the deadline is answered as usual.
        let mut whole = TcpStream::connect(addr).await.unwrap();
        whole
            .write_all(
                b"POST /echo HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Length: 2\r\n\r\n{}",
            )
            .await
            .unwrap();
        let reply = until_closed(&mut whole).await.unwrap();
        assert!(
            reply.starts_with("HTTP/1.1 200") && reply.ends_with("{}"),
            "{reply}"
        );
        stop.send(()).unwrap();
        task.await.unwrap().unwrap();
    }

    #[tokio::test]
    async fn a_streamed_answer_outlives_the_body_deadline() {
        // Five chunks 100 ms apart: the answer takes longer than the 50 ms body deadline.
        let router = axum::Router::new().route(
            "/stream",
            axum::routing::post(|| async {
                axum::body::Body::new(Ticking {
                    sent: 0,
                    sleep: Box::pin(tokio::time::sleep(Duration::from_millis(100))),
                })
            }),
        );
        let options = ServeOptions {
            body_read_timeout: Duration::from_millis(50),
            ..ServeOptions::default()
        };
        let (addr, stop, task) = start(router, options).await;
        let mut client = TcpStream::connect(addr).await.unwrap();
        client
            .write_all(
                b"POST /stream HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Length: 2\r\n\r\n{}",
            )
            .await
            .unwrap();
        let reply = until_closed(&mut client).await.unwrap();
        assert!(reply.starts_with("HTTP/1.1 200"), "{reply}");
        for i in 0..5 {
            assert!(reply.contains(&format!("chunk{i}")), "{reply}");
        }
        stop.send(()).unwrap();
        task.await.unwrap().unwrap();
    }

    /// A body of `chunk0` … `chunk4`, one each 100 ms.
    struct Ticking {
        sent: u32,
        sleep: Pin<Box<Sleep>>,
    }

    impl Body for Ticking {
        type Data = axum::body::Bytes;
        type Error = std::io::Error;

        fn poll_frame(
            mut self: Pin<&mut Self>,
            cx: &mut Context<'_>,
        ) -> Poll<Option<Result<Frame<Self::Data>, Self::Error>>> {
            if self.sent == 5 {
                return Poll::Ready(None);
            }
            std::task::ready!(self.sleep.as_mut().poll(cx));
            let chunk = format!("chunk{}", self.sent);
            self.sent += 1;
            self.sleep = Box::pin(tokio::time::sleep(Duration::from_millis(100)));
            Poll::Ready(Some(Ok(Frame::data(chunk.into()))))
        }
    }

    #[tokio::test]
    async fn over_the_connection_cap_a_client_waits_until_one_closes() {
        let options = ServeOptions {
            max_connections: 2,
            ..ServeOptions::default()
        };
        let (addr, stop, task) = start(echo_router(), options).await;
        let mut held = Vec::new();
        for _ in 0..2 {
            let mut slow = TcpStream::connect(addr).await.unwrap();
            slow.write_all(SLOW_POST).await.unwrap();
            held.push(slow);
        }
        // The third connects (the listen queue) but is not served while two are held.
        let mut third = TcpStream::connect(addr).await.unwrap();
        third
            .write_all(b"GET / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            .await
            .unwrap();
        let mut first = [0u8; 1];
        let early = tokio::time::timeout(Duration::from_millis(500), third.read(&mut first)).await;
        assert!(early.is_err(), "served over the cap: {early:?}");
        drop(held.pop());
        let rest = until_closed(&mut third).await.expect("never served");
        assert!(
            rest.starts_with("HTTP/1.1 200") && rest.ends_with("ok"),
            "{rest}"
        );
        drop(held);
        stop.send(()).unwrap();
        task.await.unwrap().unwrap();
    }

    #[test]
    fn the_default_cap_is_half_the_open_file_limit() {
        let cap = default_max_connections();
        assert!((1..=MAX_DEFAULT_CONNECTIONS).contains(&cap), "{cap}");
        if let Some(limit) = open_files_limit() {
            assert!((cap as u64) <= limit / 2 || cap == 1, "{cap} of {limit}");
        }
    }

    #[tokio::test]
    async fn a_half_sent_head_is_cut_off_and_a_whole_one_answered() {
        let router = axum::Router::new().route("/", axum::routing::get(|| async { "ok" }));
        let options = ServeOptions {
            header_read_timeout: Duration::from_millis(200),
            ..ServeOptions::default()
        };
        let (addr, stop, task) = start(router, options).await;
        let mut half = TcpStream::connect(addr).await.unwrap();
        half.write_all(b"GET / HTTP/1.1\r\nHost: x\r\nX-Slow")
            .await
            .unwrap();
        let mut rest = Vec::new();
        let closed =
            tokio::time::timeout(Duration::from_secs(20), half.read_to_end(&mut rest)).await;
        assert!(
            matches!(closed, Ok(Ok(_))),
            "the connection stays open: {closed:?}"
        );
        let mut whole = TcpStream::connect(addr).await.unwrap();
        whole
            .write_all(b"GET / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            .await
            .unwrap();
        let mut reply = String::new();
        whole.read_to_string(&mut reply).await.unwrap();
        assert!(
            reply.starts_with("HTTP/1.1 200") && reply.ends_with("ok"),
            "{reply}"
        );
        stop.send(()).unwrap();
        task.await.unwrap().unwrap();
    }

    #[tokio::test]
    async fn a_stop_drops_a_stuck_call_after_the_grace_period() {
        let router = axum::Router::new().route(
            "/stuck",
            axum::routing::get(std::future::pending::<&'static str>),
        );
        let options = ServeOptions {
            shutdown_grace: Duration::from_millis(100),
            ..ServeOptions::default()
        };
        let (addr, stop, task) = start(router, options).await;
        let mut stuck = TcpStream::connect(addr).await.unwrap();
        stuck
            .write_all(b"GET /stuck HTTP/1.1\r\nHost: x\r\n\r\n")
            .await
            .unwrap();
        tokio::time::sleep(Duration::from_millis(50)).await;
        stop.send(()).unwrap();
        let ended = tokio::time::timeout(Duration::from_secs(20), task).await;
        assert!(
            matches!(ended, Ok(Ok(Ok(())))),
            "the server did not stop: {ended:?}"
        );
        let mut rest = Vec::new();
        let _ = stuck.read_to_end(&mut rest).await;
        assert!(rest.is_empty(), "{}", String::from_utf8_lossy(&rest));
    }
}
