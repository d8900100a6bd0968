//! The connections a server that does not lead keeps to the leader's
//! agent protocol. A follower sends on the streams of every node that
//! reached it (each node's call stream stays open as long as the node
//! does, and so does its alloc watch while the follower's tables are not
//! current), and the leader takes at most
//! `MAX_RPC_STREAMS_PER_CONNECTION` streams on one connection: past that,
//! HTTP/2 would hold every further stream back until one ends, which a
//! node's stream does not. So a stream goes over the first connection
//! with room, a new connection is dialled when none has any, and past
//! [`MAX_CONNS`] connections a request is refused with a reason (the node
//! goes on to its next server) rather than held.

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};

use berth_client::servers::{ServerChannels, ServerTls};
use berth_server::leader_link::MAX_RPC_STREAMS_PER_CONNECTION;
use berth_sync::MutexExt;
use http_body::Frame;
use tonic::body::Body;
use tonic::codegen::Bytes;

/// The streams a follower opens on one connection to the leader: the
/// leader's limit, less room for the pings and resets in flight.
pub const STREAMS_PER_CONN: usize = MAX_RPC_STREAMS_PER_CONNECTION as usize * 3 / 4;

/// The connections a follower opens to the leader at most: well under the
/// leader's default connections per address (`rpc_max_conns_per_client`).
pub const MAX_CONNS: usize = 64;

/// A connection to the leader and the streams open on it.
#[derive(Clone)]
struct Conn {
    channel: ServerChannels,
    open: Arc<AtomicUsize>,
}

/// The connections to the leader's agent protocol (see the module).
pub struct LeaderConns {
    /// How the agent dials servers over TLS (`tls.rpc`), if it does.
    tls: Option<Arc<dyn ServerTls>>,
    per_conn: usize,
    max_conns: usize,
    /// The leader's agent protocol address and the connections to it.
    conns: Mutex<Option<(String, Vec<Conn>)>>,
}

/// One stream's place on a connection, given back when dropped.
pub struct StreamSlot(Arc<AtomicUsize>);

impl Drop for StreamSlot {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

impl LeaderConns {
    pub fn new(tls: Option<Arc<dyn ServerTls>>) -> LeaderConns {
        LeaderConns::with_limits(tls, STREAMS_PER_CONN, MAX_CONNS)
    }

    fn with_limits(
        tls: Option<Arc<dyn ServerTls>>,
        per_conn: usize,
        max_conns: usize,
    ) -> LeaderConns {
        LeaderConns {
            tls,
            per_conn: per_conn.max(1),
            max_conns: max_conns.max(1),
            conns: Mutex::new(None),
        }
    }

    /// A channel to the leader at `addr` with room for one more stream,
    /// and that stream's slot; or why there is none.
    pub fn slot(&self, addr: &str) -> Result<(ServerChannels, StreamSlot), String> {
        let mut held = self.conns.locked();
        let conns = match &mut *held {
            Some((at, conns)) if at == addr => conns,
            other => {
                // A new leader: the connections to the old one close as
                // their last streams end.
                &mut other.insert((addr.to_string(), Vec::new())).1
            }
        };
        // Connections past the first that carry nothing are closed.
        let mut i = 0;
        conns.retain(|c| {
            i += 1;
            i == 1 || c.open.load(Ordering::Acquire) > 0
        });
        let with_room = conns
            .iter()
            .find(|c| c.open.load(Ordering::Acquire) < self.per_conn)
            .cloned();
        let conn = match with_room {
            Some(c) => c,
            None if conns.len() >= self.max_conns => {
                return Err(format!(
                    "this server carries {} streams to the leader already, as many as it sends \
                     on ({} connections of {})",
                    conns.len() * self.per_conn,
                    self.max_conns,
                    self.per_conn
                ))
            }
            None => {
                let channel =
                    ServerChannels::with_tls(&[format!("http://{addr}")], self.tls.clone())
                        .map_err(|e| e.to_string())?;
                let c = Conn {
                    channel,
                    open: Arc::new(AtomicUsize::new(0)),
                };
                conns.push(c.clone());
                c
            }
        };
        conn.open.fetch_add(1, Ordering::AcqRel);
        Ok((conn.channel, StreamSlot(conn.open)))
    }

    /// Sends `req` to the leader at `addr`; the answer's body holds the
    /// stream's slot until it ends or is dropped.
    pub fn send(
        &self,
        addr: &str,
        req: axum::http::Request<Body>,
    ) -> impl Future<Output = Result<axum::http::Response<Body>, String>> + Send + 'static {
        let slot = self.slot(addr);
        async move {
            let (channel, slot) = slot?;
            let resp = tower::ServiceExt::oneshot(channel, req)
                .await
                .map_err(|e| with_sources(&e))?;
            Ok(resp.map(|inner| Body::new(Held { inner, _slot: slot })))
        }
    }

    /// The connections to the leader and the streams open on each.
    #[cfg(test)]
    fn open(&self) -> Vec<usize> {
        self.conns
            .locked()
            .as_ref()
            .map_or(Vec::new(), |(_, conns)| {
                conns
                    .iter()
                    .map(|c| c.open.load(Ordering::Acquire))
                    .collect()
            })
    }
}

/// `e` and what caused it, `: `-separated (a transport error alone says
/// little).
pub fn with_sources(e: &dyn std::error::Error) -> String {
    let mut text = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        text.push_str(": ");
        text.push_str(&s.to_string());
        source = s.source();
    }
    text
}

/// An answer's body and the slot of its stream.
struct Held {
    inner: Body,
    _slot: StreamSlot,
}

impl http_body::Body for Held {
    type Data = Bytes;
    type Error = tonic::Status;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, tonic::Status>>> {
        Pin::new(&mut self.inner).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.inner.size_hint()
    }
}

#[cfg(test)]
mod tests;
