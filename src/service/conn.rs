//! The server's connections, driven by hand over hyper so that no client can hold one forever
//! (`axum::serve` has no timeouts): a connection must send its first request head within the
//! header timeout, a kept-alive one is closed after the idle timeout without a request, a
//! request head once begun must be complete within the header timeout, and a client that stops
//! reading its answer is dropped after the idle timeout without progress. (The body's own
//! deadline is the routes': `http::read_body`.)
//!
//! The deadlines live in the socket wrapper `Guarded`: it knows what hyper is waiting for
//! from `ConnState`, which the service side updates as requests come in and answers finish.

use std::future::Future;
use std::io;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll, Waker};
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::response::Response;
use hyper::body::{Frame, Incoming, SizeHint};
use hyper_util::rt::TokioIo;
use hyper_util::service::TowerToHyperService;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;
use tokio::time::{Instant, Sleep};

/// The connection deadlines (`serve --header-timeout`, `--idle-timeout`, `--body-timeout`).
#[derive(Clone, Copy, Debug)]
pub struct Timeouts {
    /// A request head, from its first byte (or from the connection's opening) to its end.
    pub header: Duration,
    /// A kept-alive connection without a request, and a pending write without progress.
    pub idle: Duration,
    /// A request body, whole.
    pub body: Duration,
}

/// The client's address, in every request's extensions.
#[derive(Clone, Copy, Debug)]
pub struct Peer(pub SocketAddr);

/// What the service side tells the socket wrapper.
struct ConnState {
    /// Requests handed to the routes whose answers are not yet sent whole.
    in_flight: AtomicUsize,
    /// Answers finished: the wrapper restarts its idle clock when it changes.
    finished: AtomicU64,
    /// When the last answer finished.
    idle_since: Mutex<Instant>,
    /// The connection's task, parked on a read while a request was in flight: woken when the
    /// answer finishes, so the idle deadline starts then (hyper may not read again by itself).
    reader: Mutex<Option<Waker>>,
}

/// Counts a request in flight until its answer's body is dropped (sent whole or abandoned).
struct InFlight(Arc<ConnState>);

impl InFlight {
    fn new(state: Arc<ConnState>) -> Self {
        state.in_flight.fetch_add(1, Ordering::SeqCst);
        InFlight(state)
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        *self.0.idle_since.lock().unwrap_or_else(|e| e.into_inner()) = Instant::now();
        self.0.finished.fetch_add(1, Ordering::SeqCst);
        self.0.in_flight.fetch_sub(1, Ordering::SeqCst);
        let reader = self
            .0
            .reader
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take();
        if let Some(w) = reader {
            w.wake();
        }
    }
}

/// An answer's body that keeps its request counted in flight.
struct CountedBody {
    inner: Body,
    _in_flight: InFlight,
}

impl http_body::Body for CountedBody {
    type Data = axum::body::Bytes;
    type Error = axum::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Self::Data>, Self::Error>>> {
        Pin::new(&mut self.inner).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

/// The socket with the deadlines of [`Timeouts`] (see the module's documentation).
struct Guarded {
    inner: TcpStream,
    state: Arc<ConnState>,
    timeouts: Timeouts,
    opened: Instant,
    /// `state.finished` when last looked at.
    seen_finished: u64,
    /// When the first byte of the request head now being read came (none in flight).
    head_started: Option<Instant>,
    read_timer: Option<Pin<Box<Sleep>>>,
    write_timer: Option<Pin<Box<Sleep>>>,
}

fn timed_out(what: &str) -> io::Error {
    io::Error::new(io::ErrorKind::TimedOut, what.to_string())
}

/// Ready once `deadline` passed (the timer armed or moved there, so the task wakes then).
fn expired(timer: &mut Option<Pin<Box<Sleep>>>, deadline: Instant, cx: &mut Context<'_>) -> bool {
    match timer {
        Some(t) => {
            if t.deadline() != deadline {
                t.as_mut().reset(deadline);
            }
        }
        None => *timer = Some(Box::pin(tokio::time::sleep_until(deadline))),
    }
    timer
        .as_mut()
        .is_some_and(|t| t.as_mut().poll(cx).is_ready())
}

impl Guarded {
    /// The 408 a client gets whose request head did not arrive in time (best effort: the socket
    /// is closed right after).
    fn answer_head_timeout(&self) {
        let body = super::api::ApiError::timeout(format!(
            "the request head did not arrive within {} s (--header-timeout)",
            self.timeouts.header.as_secs_f64()
        ))
        .body()
        .to_string();
        let msg = format!(
            "HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\nconnection: close\r\ncontent-length: {}\r\n\r\n{body}",
            body.len()
        );
        self.inner.try_write(msg.as_bytes()).ok();
    }

    /// When a pending read gives up: None while a request is in flight (its body has the
    /// routes' deadline, and hyper only watches for the client hanging up).
    fn read_deadline(&mut self) -> Option<Instant> {
        if self.state.in_flight.load(Ordering::SeqCst) > 0 {
            return None;
        }
        Some(match self.head_started {
            Some(t) => t + self.timeouts.header,
            None if self.seen_finished == 0 => self.opened + self.timeouts.header,
            None => {
                *self
                    .state
                    .idle_since
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    + self.timeouts.idle
            }
        })
    }

    /// A write's poll through the stall deadline: pending past it is an error; progress
    /// clears the timer.
    fn written(
        &mut self,
        cx: &mut Context<'_>,
        polled: Poll<io::Result<usize>>,
    ) -> Poll<io::Result<usize>> {
        match polled {
            Poll::Pending if self.write_stalled(cx) => {
                Poll::Ready(Err(timed_out("the client stopped reading")))
            }
            Poll::Pending => Poll::Pending,
            ready => {
                self.write_timer = None;
                ready
            }
        }
    }

    fn write_stalled(&mut self, cx: &mut Context<'_>) -> bool {
        if self.write_timer.is_none() {
            self.write_timer = Some(Box::pin(tokio::time::sleep(self.timeouts.idle)));
        }
        self.write_timer
            .as_mut()
            .is_some_and(|t| t.as_mut().poll(cx).is_ready())
    }
}

impl AsyncRead for Guarded {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = &mut *self;
        let finished = this.state.finished.load(Ordering::SeqCst);
        if finished != this.seen_finished {
            // An answer finished since: a new wait for a request begins.
            this.seen_finished = finished;
            this.head_started = None;
        }
        let before = buf.filled().len();
        match Pin::new(&mut this.inner).poll_read(cx, buf) {
            Poll::Ready(Ok(())) => {
                this.read_timer = None;
                if buf.filled().len() > before
                    && this.head_started.is_none()
                    && this.state.in_flight.load(Ordering::SeqCst) == 0
                {
                    this.head_started = Some(Instant::now());
                }
                Poll::Ready(Ok(()))
            }
            Poll::Ready(Err(e)) => Poll::Ready(Err(e)),
            Poll::Pending => {
                // Registered before looking at `in_flight`, so an answer finishing in between
                // still wakes this task.
                *this.state.reader.lock().unwrap_or_else(|e| e.into_inner()) =
                    Some(cx.waker().clone());
                let Some(deadline) = this.read_deadline() else {
                    this.read_timer = None;
                    return Poll::Pending;
                };
                if expired(&mut this.read_timer, deadline, cx) {
                    if this.head_started.is_some() {
                        this.answer_head_timeout();
                        return Poll::Ready(Err(timed_out("request head timeout")));
                    }
                    return Poll::Ready(Err(timed_out("idle connection timeout")));
                }
                Poll::Pending
            }
        }
    }
}

impl AsyncWrite for Guarded {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let this = &mut *self;
        let polled = Pin::new(&mut this.inner).poll_write(cx, buf);
        this.written(cx, polled)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let this = &mut *self;
        let polled = Pin::new(&mut this.inner).poll_write_vectored(cx, bufs);
        this.written(cx, polled)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

/// Serve `app` on `listener`'s connections with `timeouts` until `shutdown` completes, then let
/// the open connections finish their requests.
pub async fn serve(
    listener: tokio::net::TcpListener,
    app: Router,
    timeouts: Timeouts,
    shutdown: impl Future<Output = ()>,
) -> io::Result<()> {
    let graceful = hyper_util::server::graceful::GracefulShutdown::new();
    let mut shutdown = std::pin::pin!(shutdown);
    loop {
        let (stream, peer) = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok(a) => a,
                Err(e) => {
                    // Out of descriptors and the like: the connections that hold them close in
                    // time (the deadlines above), so wait rather than spin or stop.
                    tracing::warn!("accept: {e}");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
            () = &mut shutdown => break,
        };
        stream.set_nodelay(true).ok();
        let state = Arc::new(ConnState {
            in_flight: AtomicUsize::new(0),
            finished: AtomicU64::new(0),
            idle_since: Mutex::new(Instant::now()),
            reader: Mutex::new(None),
        });
        let io = TokioIo::new(Guarded {
            inner: stream,
            state: state.clone(),
            timeouts,
            opened: Instant::now(),
            seen_finished: 0,
            head_started: None,
            read_timer: None,
            write_timer: None,
        });
        let app = TowerToHyperService::new(app.clone());
        let service = hyper::service::service_fn(move |mut req: hyper::Request<Incoming>| {
            req.extensions_mut().insert(Peer(peer));
            let in_flight = InFlight::new(state.clone());
            let answer = hyper::service::Service::call(&app, req);
            async move {
                let resp: Response = match answer.await {
                    Ok(r) => r,
                    Err(never) => match never {},
                };
                Ok::<_, std::convert::Infallible>(resp.map(|inner| {
                    Body::new(CountedBody {
                        inner,
                        _in_flight: in_flight,
                    })
                }))
            }
        });
        let conn = hyper::server::conn::http1::Builder::new().serve_connection(io, service);
        let conn = graceful.watch(conn);
        tokio::spawn(async move {
            if let Err(e) = conn.await {
                tracing::debug!("connection from {peer}: {e}");
            }
        });
    }
    drop(listener);
    graceful.shutdown().await;
    Ok(())
}
