//! The one HTTP/1.1 server loop of Sluice's servers (admin API, env server, inference server):
//! axum routes served with a deadline on reading a request's head (a client that opens a
//! connection and sends half a request is cut off instead of holding it open), and a bounded
//! graceful stop (connections still busy after the grace period are dropped, so a stuck handler
//! never keeps a stopping process alive).

use std::future::Future;
use std::time::Duration;

use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::service::TowerToHyperService;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use tokio::task::JoinSet;

/// Default of [`ServeOptions::header_read_timeout`].
pub const DEFAULT_HEADER_READ_TIMEOUT: Duration = Duration::from_secs(10);

/// Default of [`ServeOptions::shutdown_grace`].
pub const DEFAULT_SHUTDOWN_GRACE: Duration = Duration::from_secs(10);

/// How a server treats slow clients and its own stop.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ServeOptions {
    /// Longest a client may take to send a request's line and headers; the connection is
    /// closed after it.
    pub header_read_timeout: Duration,
    /// Longest the stop waits for requests in flight once the shutdown future resolved; the
    /// connections still open then are dropped (their handlers cancelled).
    pub shutdown_grace: Duration,
}

impl Default for ServeOptions {
    fn default() -> Self {
        Self {
            header_read_timeout: DEFAULT_HEADER_READ_TIMEOUT,
            shutdown_grace: DEFAULT_SHUTDOWN_GRACE,
        }
    }
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
    let (stop, stopping) = watch::channel(false);
    let mut connections = JoinSet::new();
    let mut shutdown = std::pin::pin!(shutdown);
    loop {
        tokio::select! {
            () = &mut shutdown => break,
            accepted = listener.accept() => match accepted {
                Ok((stream, _)) => {
                    connections.spawn(connection(stream, router.clone(), options, stopping.clone()));
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
async fn connection(
    stream: TcpStream,
    router: axum::Router,
    options: ServeOptions,
    mut stopping: watch::Receiver<bool>,
) {
    let _ = stream.set_nodelay(true);
    let mut builder = hyper::server::conn::http1::Builder::new();
    builder
        .timer(TokioTimer::new())
        .header_read_timeout(options.header_read_timeout);
    let conn = builder.serve_connection(TokioIo::new(stream), TowerToHyperService::new(router));
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

    async fn start(
        router: axum::Router,
        options: ServeOptions,
    ) -> (
        std::net::SocketAddr,
        tokio::sync::oneshot::Sender<()>,
        tokio::task::JoinHandle<std::io::Result<()>>,
    ) {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let task = tokio::spawn(serve(listener, router, options, async move {
            let _ = stopped.await;
        }));
        (addr, stop, task)
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
