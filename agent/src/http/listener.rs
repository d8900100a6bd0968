//! The HTTP API's listener: an accept loop on hyper (HTTP/1.1) that
//! holds each client to its limits.
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
//! - When `shutdown` flips the loop stops accepting and waits for the
//!   connections to finish the requests they are serving.

use berth_sync::Shutdown;
use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use axum::http::{header, HeaderValue, StatusCode};
use axum::response::IntoResponse;
use axum::Router;
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::net::{TcpListener, TcpStream};

use super::ApiError;
use crate::config::security::Limits;
use crate::listener::PerClientLimit;
use crate::tls::AgentTls;

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
        tokio::spawn(async move {
            let conn = match tls {
                None => Conn::Plain(stream),
                Some(t) => {
                    let accept = t.http_acceptor().accept(stream);
                    match tokio::time::timeout(header_timeout, accept).await {
                        Ok(Ok(s)) => Conn::Tls(Box::new(s)),
                        Ok(Err(e)) => {
                            tracing::info!(peer = %peer, error = %e, "HTTP API: TLS handshake refused");
                            return;
                        }
                        Err(_) => {
                            tracing::info!(peer = %peer, "HTTP API: TLS handshake timed out");
                            return;
                        }
                    }
                }
            };
            let io = TokioIo::new(conn);
            let result = match slot {
                Some(slot) => {
                    let service = hyper_util::service::TowerToHyperService::new(router);
                    let r = watcher.watch(http.serve_connection(io, service)).await;
                    drop(slot);
                    r
                }
                None => {
                    tracing::warn!(
                        peer = %peer,
                        limit = max,
                        "HTTP API: connection answered 429; the client address holds http_max_conns_per_client connections"
                    );
                    let service = hyper::service::service_fn(move |_req| async move {
                        Ok::<_, Infallible>(too_many_connections(max))
                    });
                    http.serve_connection(io, service).await
                }
            };
            if let Err(e) = result {
                tracing::debug!(peer = %peer, error = %e, "HTTP API: connection closed");
            }
        });
    }
    graceful.shutdown().await;
    Ok(())
}
