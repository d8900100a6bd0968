//! The connections a server that does not lead keeps to the leader's
//! agent protocol. A follower sends on the streams of every node that
//! reached it (each node's call stream stays open as long as the node
//! does, and so does its alloc watch while the follower's tables are not
//! current), and the leader takes at most
//! `MAX_RPC_STREAMS_PER_CONNECTION` streams on one connection: past that,
//! HTTP/2 would hold every further stream back until one ends, which a
//! node's stream does not. So a long-lived stream goes over the first
//! connection with fewer than [`LONG_LIVED_PER_CONN`] of them, a new
//! connection is dialled when none has room, and past [`MAX_CONNS`]
//! connections one is refused with a reason (the node goes on to its next
//! server) rather than held. A short call (a heartbeat, an alloc update, a
//! write) goes over the connection with the fewest streams: the room kept
//! free of long-lived streams on each is what a burst of them (every node
//! reporting its new allocs at once) uses, and one that finds none waits
//! only for other short calls to end.

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

/// The long-lived streams a follower opens on one connection to the
/// leader: three quarters of the leader's limit, the rest kept for short
/// calls.
pub const LONG_LIVED_PER_CONN: usize = MAX_RPC_STREAMS_PER_CONNECTION as usize * 3 / 4;

/// The connections a follower opens to the leader at most: well under the
/// leader's default connections per address (`rpc_max_conns_per_client`).
pub const MAX_CONNS: usize = 64;

/// The calls of the agent protocol that stay open as long as the node
/// does.
const LONG_LIVED: [&str; 2] = [
    "/berth.v1.Node/OpenCallStream",
    "/berth.v1.Node/WatchAllocations",
];

/// A connection to the leader and the streams open on it: all of them,
/// and the long-lived ones.
#[derive(Clone)]
struct Conn {
    channel: ServerChannels,
    open: Arc<AtomicUsize>,
    long_lived: Arc<AtomicUsize>,
}

impl Conn {
    fn open(&self) -> usize {
        self.open.load(Ordering::Acquire)
    }

    fn long_lived(&self) -> usize {
        self.long_lived.load(Ordering::Acquire)
    }
}

/// The connections to the leader's agent protocol (see the module).
pub struct LeaderConns {
    /// How the agent dials servers over TLS (`tls.rpc`), if it does.
    tls: Option<Arc<dyn ServerTls>>,
    /// The cluster the leader must be of.
    cluster_id: String,
    long_lived_per_conn: usize,
    max_conns: usize,
    /// The leader's agent protocol address and the connections to it.
    conns: Mutex<Option<(String, Vec<Conn>)>>,
}

/// One stream's place on a connection (and among its long-lived ones,
/// for a long-lived stream), given back when dropped.
pub struct StreamSlot {
    open: Arc<AtomicUsize>,
    long_lived: Option<Arc<AtomicUsize>>,
}

impl Drop for StreamSlot {
    fn drop(&mut self) {
        self.open.fetch_sub(1, Ordering::AcqRel);
        if let Some(l) = &self.long_lived {
            l.fetch_sub(1, Ordering::AcqRel);
        }
    }
}

impl LeaderConns {
    pub fn new(tls: Option<Arc<dyn ServerTls>>, cluster_id: &str) -> LeaderConns {
        LeaderConns::with_limits(tls, cluster_id, LONG_LIVED_PER_CONN, MAX_CONNS)
    }

    fn with_limits(
        tls: Option<Arc<dyn ServerTls>>,
        cluster_id: &str,
        long_lived_per_conn: usize,
        max_conns: usize,
    ) -> LeaderConns {
        LeaderConns {
            tls,
            cluster_id: cluster_id.to_string(),
            long_lived_per_conn: long_lived_per_conn.max(1),
            max_conns: max_conns.max(1),
            conns: Mutex::new(None),
        }
    }

    /// A new connection to the leader at `addr`.
    fn dial(&self, addr: &str) -> Result<Conn, String> {
        let channel = ServerChannels::with_tls(&[format!("http://{addr}")], self.tls.clone())
            .map_err(|e| e.to_string())?;
        // A leader of another cluster is refused, as a client refuses it.
        channel.pin_cluster(Some(&self.cluster_id), Box::new(|_| {}));
        Ok(Conn {
            channel,
            open: Arc::new(AtomicUsize::new(0)),
            long_lived: Arc::new(AtomicUsize::new(0)),
        })
    }

    /// A channel to the leader at `addr` with room for one more stream
    /// (`long_lived` or not), and that stream's slot; or why there is
    /// none.
    pub fn slot(
        &self,
        addr: &str,
        long_lived: bool,
    ) -> Result<(ServerChannels, StreamSlot), String> {
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
            i == 1 || c.open() > 0
        });
        let room = if long_lived {
            conns
                .iter()
                .find(|c| c.long_lived() < self.long_lived_per_conn)
                .cloned()
        } else {
            conns
                .iter()
                .min_by_key(|c| c.open())
                .filter(|c| {
                    c.open() < MAX_RPC_STREAMS_PER_CONNECTION as usize
                        || conns.len() >= self.max_conns
                })
                .cloned()
        };
        let conn = match room {
            Some(c) => c,
            None if conns.len() >= self.max_conns => {
                return Err(format!(
                    "this server carries {} long-lived streams to the leader already, as many \
                     as it sends on ({} connections of {})",
                    conns.len() * self.long_lived_per_conn,
                    self.max_conns,
                    self.long_lived_per_conn
                ))
            }
            None => {
                let c = self.dial(addr)?;
                conns.push(c.clone());
                c
            }
        };
        conn.open.fetch_add(1, Ordering::AcqRel);
        if long_lived {
            conn.long_lived.fetch_add(1, Ordering::AcqRel);
        }
        Ok((
            conn.channel,
            StreamSlot {
                open: conn.open,
                long_lived: long_lived.then_some(conn.long_lived),
            },
        ))
    }

    /// Sends `req` to the leader at `addr`; the answer's body holds the
    /// stream's slot until it ends or is dropped.
    pub fn send(
        &self,
        addr: &str,
        req: axum::http::Request<Body>,
    ) -> impl Future<Output = Result<axum::http::Response<Body>, String>> + Send + 'static {
        let long_lived = LONG_LIVED.contains(&req.uri().path());
        let slot = self.slot(addr, long_lived);
        async move {
            let (channel, slot) = slot?;
            let resp = tower::ServiceExt::oneshot(channel, req)
                .await
                .map_err(|e| with_sources(&e))?;
            Ok(resp.map(|inner| Body::new(Held { inner, _slot: slot })))
        }
    }

    /// The connections to the leader and the streams open on each (all
    /// of them, the long-lived ones).
    #[cfg(test)]
    fn open(&self) -> Vec<(usize, usize)> {
        self.conns
            .locked()
            .as_ref()
            .map_or(Vec::new(), |(_, conns)| {
                conns.iter().map(|c| (c.open(), c.long_lived())).collect()
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
