//! The deadline on a client that stops reading: an answer's bytes must keep leaving.
//!
//! A write that cannot go on (the client's socket buffer is full because it reads nothing)
//! arms a timer; any progress disarms it; if it fires first, the write fails with
//! [`std::io::ErrorKind::TimedOut`] and hyper closes the connection. A client that keeps
//! reading is not cut, however long the stream. "Progress" is the kernel's: it wakes a blocked
//! writer once about half the socket's send buffer is free, so a client behind by a full
//! buffer must take that much (a few MB at most) within the timeout.

use std::future::Future;
use std::io;
use std::pin::Pin;
use std::task::{Context, Poll, ready};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::time::Sleep;

/// A connection whose writes fail once one has made no progress for `after`.
pub(super) struct StallGuard<S> {
    inner: S,
    after: Duration,
    /// Armed by the first write that cannot go on, dropped by the next that makes progress.
    stall: Option<Pin<Box<Sleep>>>,
}

impl<S> StallGuard<S> {
    pub(super) fn new(inner: S, after: Duration) -> Self {
        Self {
            inner,
            after,
            stall: None,
        }
    }

    /// What a write that made progress (or failed) returns, the stall timer disarmed.
    fn progressed<T>(&mut self, result: io::Result<T>) -> Poll<io::Result<T>> {
        self.stall = None;
        Poll::Ready(result)
    }

    /// A write that cannot go on: pending until the timer fires, then the timeout error.
    fn stalled<T>(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<T>> {
        let after = self.after;
        let stall = self
            .stall
            .get_or_insert_with(|| Box::pin(tokio::time::sleep(after)));
        ready!(stall.as_mut().poll(cx));
        Poll::Ready(Err(io::Error::new(
            io::ErrorKind::TimedOut,
            format!(
                "the client took none of the answer for {} s",
                after.as_secs_f64()
            ),
        )))
    }
}

impl<S: AsyncRead + Unpin> AsyncRead for StallGuard<S> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_read(cx, buf)
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for StallGuard<S> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let this = &mut *self;
        match Pin::new(&mut this.inner).poll_write(cx, buf) {
            Poll::Ready(r) => this.progressed(r),
            Poll::Pending => this.stalled(cx),
        }
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let this = &mut *self;
        match Pin::new(&mut this.inner).poll_write_vectored(cx, bufs) {
            Poll::Ready(r) => this.progressed(r),
            Poll::Pending => this.stalled(cx),
        }
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = &mut *self;
        match Pin::new(&mut this.inner).poll_flush(cx) {
            Poll::Ready(r) => this.progressed(r),
            Poll::Pending => this.stalled(cx),
        }
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = &mut *self;
        match Pin::new(&mut this.inner).poll_shutdown(cx) {
            Poll::Ready(r) => this.progressed(r),
            Poll::Pending => this.stalled(cx),
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::TcpStream;

    use super::super::ServeOptions;
    use super::super::tests::{start, until_closed};

    /// An answer far larger than the sockets' buffers: its writer waits on the client.
    const BIG: usize = 8 << 20;

    /// An answer the slow reader below takes several stall timeouts over.
    const HUGE: usize = 32 << 20;

    fn big_router() -> axum::Router {
        axum::Router::new()
            .route("/big", axum::routing::get(|| async { vec![b'x'; BIG] }))
            .route("/huge", axum::routing::get(|| async { vec![b'x'; HUGE] }))
            .route("/", axum::routing::get(|| async { "ok" }))
    }

    #[tokio::test]
    async fn a_client_that_stops_reading_lets_go_of_its_connection() {
        let options = ServeOptions {
            max_connections: 1,
            write_stall_timeout: Duration::from_millis(300),
            ..ServeOptions::default()
        };
        let (addr, stop, task) = start(big_router(), options).await;
        // Asks for the big answer and never reads it: it holds the only connection...
        let mut stuck = TcpStream::connect(addr).await.unwrap();
        stuck
            .write_all(b"GET /big HTTP/1.1\r\nHost: x\r\n\r\n")
            .await
            .unwrap();
        tokio::time::sleep(Duration::from_millis(100)).await;
        // ...until its stalled write times out: the next client is then served.
        let mut next = TcpStream::connect(addr).await.unwrap();
        next.write_all(b"GET / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            .await
            .unwrap();
        let answer = until_closed(&mut next).await.expect("never served");
        assert!(
            answer.starts_with("HTTP/1.1 200") && answer.ends_with("ok"),
            "{answer}"
        );
        // The stalled client got part of its answer, not all of it.
        let got = until_closed(&mut stuck).await.expect("still open");
        assert!(got.len() < BIG, "the whole answer arrived: {}", got.len());
        stop.send(()).unwrap();
        task.await.unwrap().unwrap();
    }

    #[tokio::test]
    async fn a_client_that_reads_slowly_gets_the_whole_answer() {
        // The reader takes several stall timeouts over the answer but frees the server's
        // socket buffer well within one (the kernel wakes a blocked writer once about half the
        // send buffer is free: a reader slower than that per timeout is cut).
        let options = ServeOptions {
            write_stall_timeout: Duration::from_millis(300),
            ..ServeOptions::default()
        };
        let (addr, stop, task) = start(big_router(), options).await;
        let mut slow = TcpStream::connect(addr).await.unwrap();
        slow.write_all(b"GET /huge HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            .await
            .unwrap();
        let mut got = 0;
        let mut chunk = vec![0u8; 1 << 20];
        let started = std::time::Instant::now();
        loop {
            // Slower than the server writes, but never idle for the stall timeout.
            tokio::time::sleep(Duration::from_millis(20)).await;
            match slow.read(&mut chunk).await.unwrap() {
                0 => break,
                n => got += n,
            }
        }
        assert!(got > HUGE, "cut after {got} bytes");
        assert!(
            started.elapsed() > Duration::from_millis(450),
            "read too fast to outlast the timeout"
        );
        stop.send(()).unwrap();
        task.await.unwrap().unwrap();
    }
}
