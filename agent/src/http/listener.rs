//! The HTTP API's listener: an accept loop on hyper that holds each client
//! to its limits. Plain connections speak HTTP/1.1; TLS connections speak
//! HTTP/2 when the client negotiates `h2` by ALPN (as curl, browsers and
//! most HTTP libraries do), else HTTP/1.1.
//!
//! - A connection must send a request's headers within
//!   `limits.http_header_read_timeout` (also the first request, and the
//!   next one on a kept-alive connection), and finish its TLS handshake
//!   within the same time; else it is closed.
//! - A client address holds at most `limits.http_max_conns_per_client`
//!   connections: the next one is answered 429 in the API's error shape
//!   and closed.
//! - With TLS (`tls.http`) every connection is TLS; with
//!   `verify_https_client` its client presents a certificate of the CA.
//! - An HTTP/2 connection carries at most
//!   `limits.http_max_concurrent_streams` requests at once, a header list
//!   of at most [`MAX_HEADER_LIST_BYTES`], is pinged every
//!   [`H2_KEEPALIVE_INTERVAL`] and dropped when a ping goes unanswered,
//!   and is closed when it sends no request within
//!   `limits.http_header_read_timeout`; a client that resets streams
//!   faster than they are served is sent GOAWAY (h2's bound on reset
//!   streams, [`MAX_PENDING_RESET_STREAMS`]). Body limits and the ACL
//!   check are the router's, the same for both protocols.
//! - When `shutdown` flips the loop stops accepting and waits for the
//!   connections to finish the requests they are serving.

use berth_sync::Shutdown;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use axum::http::{header, HeaderValue, StatusCode};
use axum::response::IntoResponse;
use axum::Router;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use tokio::net::{TcpListener, TcpStream};

use super::ApiError;
use crate::config::security::Limits;
use crate::listener::PerClientLimit;
use crate::tls::AgentTls;

/// The largest header list a request may send over HTTP/2 (HTTP/1.1's
/// is hyper's own limit of 100 headers and about 400 KiB).
pub const MAX_HEADER_LIST_BYTES: u32 = 64 * 1024;
/// How often an idle HTTP/2 connection is pinged.
pub const H2_KEEPALIVE_INTERVAL: Duration = Duration::from_secs(30);
/// How long a ping may go unanswered before the connection is dropped.
pub const H2_KEEPALIVE_TIMEOUT: Duration = Duration::from_secs(20);
/// Streams a client may reset before the agent accepted them; past this
/// the connection is sent GOAWAY (the rapid-reset bound).
pub const MAX_PENDING_RESET_STREAMS: usize = 20;

/// How the HTTP API is served.
#[derive(Clone)]
pub struct HttpServing {
    /// TLS, when `tls.http` is on.
    pub tls: Option<Arc<AgentTls>>,
    pub limits: Limits,
}

impl HttpServing {
    /// Plain HTTP with the default limits.
    #[cfg(test)]
    pub fn plain() -> HttpServing {
        HttpServing {
            tls: None,
            limits: Limits::default(),
        }
    }
}

/// A connection as hyper reads it: TCP, or TLS over TCP.
enum Conn {
    Plain(TcpStream),
    Tls(Box<tokio_rustls::server::TlsStream<TcpStream>>),
}

impl tokio::io::AsyncRead for Conn {
    fn poll_read(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &mut tokio::io::ReadBuf<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        match self.get_mut() {
            Conn::Plain(s) => std::pin::Pin::new(s).poll_read(cx, buf),
            Conn::Tls(s) => std::pin::Pin::new(s.as_mut()).poll_read(cx, buf),
        }
    }
}

impl tokio::io::AsyncWrite for Conn {
    fn poll_write(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &[u8],
    ) -> std::task::Poll<std::io::Result<usize>> {
        match self.get_mut() {
            Conn::Plain(s) => std::pin::Pin::new(s).poll_write(cx, buf),
            Conn::Tls(s) => std::pin::Pin::new(s.as_mut()).poll_write(cx, buf),
        }
    }

    fn poll_flush(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        match self.get_mut() {
            Conn::Plain(s) => std::pin::Pin::new(s).poll_flush(cx),
            Conn::Tls(s) => std::pin::Pin::new(s.as_mut()).poll_flush(cx),
        }
    }

    fn poll_shutdown(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        match self.get_mut() {
            Conn::Plain(s) => std::pin::Pin::new(s).poll_shutdown(cx),
            Conn::Tls(s) => std::pin::Pin::new(s.as_mut()).poll_shutdown(cx),
        }
    }
}

/// The answer to a connection over its client's limit.
fn too_many_connections(limit: u32) -> axum::response::Response {
    let mut resp = ApiError::new(
        StatusCode::TOO_MANY_REQUESTS,
        format!(
            "too many connections from this address (http_max_conns_per_client = {limit}); \
             close some or raise limits.http_max_conns_per_client"
        ),
    )
    .into_response();
    resp.headers_mut()
        .insert(header::CONNECTION, HeaderValue::from_static("close"));
    resp
}

/// A connection's service that says when its first request comes.
#[derive(Clone)]
struct FirstRequest<S> {
    inner: S,
    seen: Arc<tokio::sync::Notify>,
}

impl<S, B> hyper::service::Service<hyper::Request<B>> for FirstRequest<S>
where
    S: hyper::service::Service<hyper::Request<B>>,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = S::Future;

    fn call(&self, req: hyper::Request<B>) -> Self::Future {
        self.seen.notify_one();
        self.inner.call(req)
    }
}

/// Ends after `timeout` unless a request came first (then never).
async fn silent_for(requested: Arc<tokio::sync::Notify>, timeout: Duration) {
    if tokio::time::timeout(timeout, requested.notified())
        .await
        .is_ok()
    {
        std::future::pending::<()>().await;
    }
}

/// Serves `router` on `listener` as `how` says until `shutdown` flips.
pub async fn serve(
    listener: TcpListener,
    router: Router,
    mut shutdown: Shutdown,
    how: HttpServing,
) -> std::io::Result<()> {
    let addr: Option<SocketAddr> = listener.local_addr().ok();
    tracing::info!(addr = ?addr, tls = how.tls.is_some(), "HTTP API listening");
    let limit = PerClientLimit::new(how.limits.http_max_conns_per_client);
    let header_timeout = how.limits.http_header_read_timeout;
    let mut http = hyper::server::conn::http1::Builder::new();
    http.timer(TokioTimer::new())
        .header_read_timeout(Some(header_timeout));
    let mut h2 = hyper::server::conn::http2::Builder::new(TokioExecutor::new());
    h2.timer(TokioTimer::new())
        .max_concurrent_streams(how.limits.http_max_concurrent_streams)
        .max_header_list_size(MAX_HEADER_LIST_BYTES)
        .keep_alive_interval(H2_KEEPALIVE_INTERVAL)
        .keep_alive_timeout(H2_KEEPALIVE_TIMEOUT)
        .max_pending_accept_reset_streams(MAX_PENDING_RESET_STREAMS);
    let graceful = hyper_util::server::graceful::GracefulShutdown::new();
    let stop = async move {
        let _ = shutdown.wait().await;
    };
    tokio::pin!(stop);
    loop {
        let (stream, peer) = tokio::select! {
            () = &mut stop => break,
            r = listener.accept() => match r {
                Ok(c) => c,
                Err(e) => {
                    // Out of descriptors, say: the next accept may work.
                    tracing::warn!(error = %e, "HTTP API: accepting a connection failed");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                }
            },
        };
        let _ = stream.set_nodelay(true);
        let slot = limit.try_acquire(peer.ip());
        let tls = how.tls.clone();
        let http = http.clone();
        let router = router.clone();
        let watcher = graceful.watcher();
        let max = limit.max();
        let h2 = h2.clone();
        tokio::spawn(async move {
            let conn = match tls {
                None => Conn::Plain(stream),
                Some(t) => {
                    let accept = t.http_acceptor().accept(stream);
                    match tokio::time::timeout(header_timeout, accept).await {
                        Ok(Ok(s)) => Conn::Tls(Box::new(s)),
                        Ok(Err(e)) => {
                            tracing::info!(peer = %peer, error = %e,
                                hint = crate::listener::handshake_hint(&e),
                                "HTTP API: TLS handshake refused");
                            return;
                        }
                        Err(_) => {
                            tracing::info!(peer = %peer, "HTTP API: TLS handshake timed out");
                            return;
                        }
                    }
                }
            };
            let speaks_h2 =
                matches!(&conn, Conn::Tls(s) if s.get_ref().1.alpn_protocol() == Some(b"h2"));
            let io = TokioIo::new(conn);
            let router = match slot {
                Some(_) => router,
                None => {
                    tracing::warn!(
                        peer = %peer,
                        limit = max,
                        "HTTP API: connection answered 429; the client address holds http_max_conns_per_client connections"
                    );
                    Router::new().fallback(move || async move { too_many_connections(max) })
                }
            };
            let result = if speaks_h2 {
                let requested = Arc::new(tokio::sync::Notify::new());
                let service = FirstRequest {
                    inner: hyper_util::service::TowerToHyperService::new(router),
                    seen: requested.clone(),
                };
                let served = watcher.watch(h2.serve_connection(io, service));
                tokio::select! {
                    r = served => r,
                    () = silent_for(requested, header_timeout) => {
                        tracing::info!(peer = %peer, timeout = ?header_timeout,
                            "HTTP API: HTTP/2 connection closed; it sent no request");
                        Ok(())
                    }
                }
            } else {
                let service = hyper_util::service::TowerToHyperService::new(router);
                watcher.watch(http.serve_connection(io, service)).await
            };
            drop(slot);
            if let Err(e) = result {
                tracing::debug!(peer = %peer, error = %e, "HTTP API: connection closed");
            }
        });
    }
    graceful.shutdown().await;
    Ok(())
}
