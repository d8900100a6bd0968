//! The client's channels to its servers: one lazily connected gRPC channel
//! per address of `servers`, each with a connect timeout and HTTP/2
//! keepalive (so that a connection whose packets silently vanish is
//! noticed and dropped), and which of them is in use. A request that fails
//! in transport or runs past its deadline moves the client on to the next
//! server, round robin; the callers' own backoff paces the retries.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use berth_proto::berth::v1::CLUSTER_ID_HEADER;
use tonic::body::Body;
use tonic::codegen::http;
use tonic::transport::{Channel, Endpoint};
use tower::{Service, ServiceExt};

/// How long dialling one server may take.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
/// An HTTP/2 ping goes out after this much silence on a connection, also
/// while no call is open on it...
pub const KEEPALIVE_INTERVAL: Duration = Duration::from_secs(5);
/// ...and the connection, with every stream on it, is dropped when the
/// ping is not answered within this.
pub const KEEPALIVE_TIMEOUT: Duration = Duration::from_secs(5);

/// How long to wait before trying the servers again after the
/// `failures`th failure in a row: 100ms doubling up to 6.4s, each wait
/// drawn at random from its upper half, so that clients cut off together
/// do not come back in step.
pub fn retry_delay(failures: u32) -> Duration {
    let full = Duration::from_millis(100).saturating_mul(1u32 << failures.min(6));
    let half = full / 2;
    half.saturating_add(half.mul_f64(random_fraction()))
}

/// A number in `[0, 1)`, random enough for jitter.
fn random_fraction() -> f64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u64(berth_structs::now_ms() as u64);
    (h.finish() >> 11) as f64 / (1u64 << 53) as f64
}

/// A server address the client cannot dial.
#[derive(Debug, thiserror::Error)]
pub enum ServersError {
    #[error("the client has no servers to dial")]
    Empty,
    #[error("server address {addr:?} is not a URI: {source}")]
    BadAddress {
        addr: String,
        source: tonic::transport::Error,
    },
}

/// The channels to the servers. Cheap to clone: clones share which server
/// is in use.
#[derive(Clone)]
pub struct ServerChannels {
    inner: Arc<Inner>,
}

struct Inner {
    /// `http://HOST:PORT` of each server, in the configured order.
    addrs: Vec<String>,
    channels: Vec<Channel>,
    current: AtomicUsize,
    /// The cluster the node registered with (see [`ClusterPin`]).
    cluster: ClusterPin,
}

/// Called with the cluster ID the first time a server names one, to keep
/// it (the client state).
pub type RecordCluster = Box<dyn Fn(&str) + Send + Sync>;

/// The cluster the node belongs to: the ID its client state recorded, or
/// the first a server named (then recorded). A server that names another
/// is not this node's: its answers are refused, and the client moves on to
/// the next server. Every request names the cluster, so that a server of
/// another cluster refuses it before acting on it.
#[derive(Default)]
struct ClusterPin {
    id: std::sync::RwLock<Option<http::HeaderValue>>,
    record: std::sync::Mutex<Option<RecordCluster>>,
}

impl ClusterPin {
    fn get(&self) -> Option<http::HeaderValue> {
        berth_sync::RwLockExt::read_locked(&self.id).clone()
    }

    /// Whether `named` (the header of an answer) is this node's cluster;
    /// the first ID named is taken (and recorded) when none is known.
    fn accepts(&self, named: &http::HeaderValue) -> bool {
        let mut id = berth_sync::RwLockExt::write_locked(&self.id);
        match &*id {
            Some(own) => own == named,
            None => {
                *id = Some(named.clone());
                let text = named.to_str().unwrap_or_default();
                tracing::info!(cluster_id = %text, "the servers are of cluster {text}; this node stays in it");
                if let Some(record) = &*berth_sync::MutexExt::locked(&self.record) {
                    record(text);
                }
                true
            }
        }
    }
}

/// The endpoint of `addr` as the client dials it.
pub fn endpoint(addr: &str) -> Result<Endpoint, ServersError> {
    Ok(Endpoint::from_shared(addr.to_string())
        .map_err(|source| ServersError::BadAddress {
            addr: addr.to_string(),
            source,
        })?
        .connect_timeout(CONNECT_TIMEOUT)
        .tcp_nodelay(true)
        .http2_keep_alive_interval(KEEPALIVE_INTERVAL)
        .keep_alive_timeout(KEEPALIVE_TIMEOUT)
        .keep_alive_while_idle(true))
}

/// Dials a server over mutual TLS: TCP to the address of the URI, then a
/// handshake that presents the agent's certificate and accepts only a
/// server certificate of the CA naming `server.<region>.berth` (see
/// [`ServerTls`]). Each dial takes the certificates in force then.
#[derive(Clone)]
struct TlsDialer {
    tls: Arc<dyn ServerTls>,
}

/// The TLS a client dials its servers with: the agent's certificates,
/// which it may reload at any time.
pub trait ServerTls: std::fmt::Debug + Send + Sync + 'static {
    /// The configuration a new dial to a server uses, and the name its
    /// certificate must carry.
    fn connector(
        &self,
    ) -> (
        tokio_rustls::TlsConnector,
        rustls_pki_types::ServerName<'static>,
    );
}

impl Service<http::Uri> for TlsDialer {
    type Response = hyper_util::rt::TokioIo<tokio_rustls::client::TlsStream<tokio::net::TcpStream>>;
    type Error = std::io::Error;
    type Future = std::pin::Pin<
        Box<dyn std::future::Future<Output = Result<Self::Response, Self::Error>> + Send>,
    >;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, uri: http::Uri) -> Self::Future {
        let (connector, name) = self.tls.connector();
        Box::pin(async move {
            let host = uri
                .host()
                .map(|h| h.trim_start_matches('[').trim_end_matches(']').to_string())
                .ok_or_else(|| {
                    std::io::Error::other(format!("server address {uri} has no host"))
                })?;
            let port = uri.port_u16().ok_or_else(|| {
                std::io::Error::other(format!("server address {uri} has no port"))
            })?;
            let tcp = tokio::net::TcpStream::connect((host.as_str(), port)).await?;
            let _ = tcp.set_nodelay(true);
            match connector.connect(name, tcp).await {
                Ok(s) => Ok(hyper_util::rt::TokioIo::new(s)),
                Err(e) => {
                    tracing::warn!(server = %uri, error = %e, "TLS handshake with the server failed");
                    Err(std::io::Error::other(format!(
                        "TLS handshake with the server {uri}: {e}"
                    )))
                }
            }
        })
    }
}

impl ServerChannels {
    /// Channels to `addrs` (`http://HOST:PORT` each) in plaintext, none
    /// dialled yet.
    #[cfg(test)]
    pub fn new(addrs: &[String]) -> Result<ServerChannels, ServersError> {
        ServerChannels::with_tls(addrs, None)
    }

    /// Channels to `addrs` (`http://HOST:PORT` each), over mutual TLS
    /// when `tls` is given, none dialled yet.
    /// An address listed twice gets one channel (the first place it is
    /// listed): a dead server listed twice would otherwise cost every
    /// failover from it a second failure before the client reaches the
    /// next server.
    pub fn with_tls(
        addrs: &[String],
        tls: Option<Arc<dyn ServerTls>>,
    ) -> Result<ServerChannels, ServersError> {
        if addrs.is_empty() {
            return Err(ServersError::Empty);
        }
        let mut seen = std::collections::HashSet::new();
        let addrs: Vec<String> = addrs
            .iter()
            .filter(|a| {
                let first = seen.insert(a.as_str());
                if !first {
                    tracing::warn!(server = %a, "server listed more than once; dialling it once");
                }
                first
            })
            .cloned()
            .collect();
        let channels = addrs
            .iter()
            .map(|a| {
                endpoint(a).map(|e| match &tls {
                    Some(tls) => e.connect_with_connector_lazy(TlsDialer { tls: tls.clone() }),
                    None => e.connect_lazy(),
                })
            })
            .collect::<Result<Vec<_>, _>>()?;
        Ok(ServerChannels {
            inner: Arc::new(Inner {
                addrs,
                channels,
                current: AtomicUsize::new(0),
                cluster: ClusterPin::default(),
            }),
        })
    }

    /// The cluster the node registered with: `known` (its client state's
    /// record), else the first a server names, which `record` then keeps.
    /// From then on the client takes no answer from a server of another
    /// cluster and moves on from it.
    pub fn pin_cluster(&self, known: Option<&str>, record: RecordCluster) {
        let known = known.and_then(|k| http::HeaderValue::from_str(k).ok());
        *berth_sync::RwLockExt::write_locked(&self.inner.cluster.id) = known;
        *berth_sync::MutexExt::locked(&self.inner.cluster.record) = Some(record);
    }

    /// [`ServerChannels::pin_cluster`] to the cluster `state` recorded,
    /// recording there the first one a server names.
    pub fn pin_cluster_of(
        &self,
        state: &crate::state::ClientState,
    ) -> Result<(), crate::state::StateError> {
        let recorder = state.clone();
        self.pin_cluster(
            state.cluster_id()?.as_deref(),
            Box::new(move |id| {
                if let Err(e) = recorder.set_cluster_id(id) {
                    tracing::error!(error = %e, cluster_id = %id, "recording the node's cluster failed; it is taken again at the next start");
                }
            }),
        );
        Ok(())
    }

    /// The cluster the node belongs to, once known.
    pub fn cluster_id(&self) -> Option<String> {
        self.inner
            .cluster
            .get()
            .and_then(|v| v.to_str().ok().map(str::to_string))
    }

    /// The address of the server in use.
    pub fn current_addr(&self) -> &str {
        let i = self.inner.current.load(Ordering::Relaxed);
        &self.inner.addrs[i % self.inner.addrs.len()]
    }

    /// How many servers there are (at least one).
    pub fn count(&self) -> usize {
        self.inner.addrs.len()
    }

    /// Which server is in use (an index into the configured list). A
    /// caller whose stream breaks moves on with
    /// [`ServerChannels::failover_from`] the server it opened the stream on.
    pub fn current(&self) -> usize {
        self.inner.current.load(Ordering::Relaxed)
    }

    /// Moves on from server `from` to the next one, unless the client
    /// already moved on from it: one failure of a server moves the client
    /// on once, however many callers saw it (a request that failed in
    /// transport has moved it already, and so has every other stream that
    /// broke with the same connection), so that it never lands back on
    /// the dead server it just left.
    pub fn failover_from(&self, from: usize) {
        let n = self.inner.addrs.len();
        if n < 2 {
            return;
        }
        let next = (from % n).saturating_add(1) % n;
        if self
            .inner
            .current
            .compare_exchange(from, next, Ordering::Relaxed, Ordering::Relaxed)
            .is_ok()
        {
            tracing::warn!(
                from = %self.inner.addrs[from % n],
                to = %self.inner.addrs[next],
                "server unreachable; moving on to the next"
            );
        }
    }
}

impl Service<http::Request<Body>> for ServerChannels {
    type Response = http::Response<Body>;
    type Error = tonic::transport::Error;
    type Future = std::pin::Pin<
        Box<dyn std::future::Future<Output = Result<Self::Response, Self::Error>> + Send>,
    >;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        // Readiness is awaited on the chosen channel in `call`.
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, mut req: http::Request<Body>) -> Self::Future {
        let this = self.clone();
        let i = this.inner.current.load(Ordering::Relaxed) % this.inner.channels.len();
        let channel = this.inner.channels[i].clone();
        if let Some(own) = this.inner.cluster.get() {
            req.headers_mut().insert(CLUSTER_ID_HEADER, own);
        }
        Box::pin(async move {
            let result = channel.oneshot(req).await;
            match &result {
                Err(e) => {
                    tracing::debug!(server = %this.inner.addrs[i], error = %e, "request to the server failed");
                    this.failover_from(i);
                }
                Ok(resp) if !speaks_agent_protocol(resp) => {
                    tracing::warn!(
                        server = %this.inner.addrs[i],
                        http_status = resp.status().as_u16(),
                        "the server address answers, but not in the agent protocol \
                         (is it the HTTP API's port rather than the RPC port?)"
                    );
                    this.failover_from(i);
                }
                Ok(resp) if refused_as_unavailable(resp) => {
                    // A server that does not lead (or cannot reach the
                    // store) sends the node on to the next.
                    tracing::debug!(server = %this.inner.addrs[i], "the server answered UNAVAILABLE at once; trying the next");
                    this.failover_from(i);
                }
                Ok(resp) => {
                    if let Some(named) = resp.headers().get(CLUSTER_ID_HEADER) {
                        if !this.inner.cluster.accepts(named) {
                            let own = this.inner.cluster.get();
                            let message = format!(
                                "server {} is of cluster {}, not of cluster {} that this node \
                                 registered with; the node stays with its own cluster's servers \
                                 (to move a node to another cluster, drain it and start its \
                                 client on a fresh data dir)",
                                this.inner.addrs[i],
                                named.to_str().unwrap_or("(not text)"),
                                own.as_ref().and_then(|v| v.to_str().ok()).unwrap_or("?"),
                            );
                            tracing::error!("{message}");
                            this.failover_from(i);
                            return Ok(other_cluster(&message));
                        }
                    }
                }
            }
            result
        })
    }
}

/// Whether `resp` is a gRPC answer of only headers with the status
/// `UNAVAILABLE`: a server refusing at the door, before any service ran.
fn refused_as_unavailable(resp: &http::Response<Body>) -> bool {
    resp.headers()
        .get("grpc-status")
        .is_some_and(|s| s.as_bytes() == b"14")
}

/// The answer the client makes of a server of another cluster's: gRPC
/// `UNAVAILABLE` (the client retries, on its next server), without the
/// server's body.
fn other_cluster(message: &str) -> http::Response<Body> {
    let status = tonic::Status::unavailable(message.to_string());
    status.into_http()
}

/// Whether `resp` is a gRPC answer (HTTP 200, `application/grpc`), as
/// every answer of a berth server's agent protocol is, errors included:
/// anything else comes from something else listening at that address.
fn speaks_agent_protocol(resp: &http::Response<Body>) -> bool {
    resp.status() == http::StatusCode::OK
        && resp
            .headers()
            .get(http::header::CONTENT_TYPE)
            .and_then(|v| v.to_str().ok())
            .is_some_and(|v| v.starts_with("application/grpc"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn no_servers_or_a_bad_address_is_a_clear_error() {
        assert!(matches!(ServerChannels::new(&[]), Err(ServersError::Empty)));
        let e = ServerChannels::new(&["http://a:1".into(), "not a uri".into()])
            .err()
            .expect("refused");
        assert!(e.to_string().contains("\"not a uri\""), "{e}");
    }

    /// A dead server listed twice costs one failure, not two: the first
    /// failover from it reaches the next server.
    #[tokio::test]
    async fn a_server_listed_twice_is_dialled_once() {
        let s = ServerChannels::new(&[
            "http://127.0.0.1:1".into(),
            "http://127.0.0.1:1".into(),
            "http://127.0.0.1:2".into(),
            "http://127.0.0.1:1".into(),
        ])
        .unwrap();
        assert_eq!(s.count(), 2);
        s.failover_from(s.current());
        assert_eq!(s.current_addr(), "http://127.0.0.1:2");
    }

    #[test]
    fn retry_delays_grow_stay_bounded_and_spread() {
        for failures in [0, 1, 3, 6, 7, u32::MAX] {
            let full = Duration::from_millis(100 << failures.min(6));
            let mut seen = std::collections::BTreeSet::new();
            for _ in 0..50 {
                let d = retry_delay(failures);
                assert!(d >= full / 2 && d <= full, "{failures}: {d:?}");
                seen.insert(d);
            }
            assert!(seen.len() > 1, "{failures}: no jitter");
        }
    }

    #[tokio::test]
    async fn failover_goes_round_robin_once_per_failure() {
        let s = ServerChannels::new(&[
            "http://127.0.0.1:1".into(),
            "http://127.0.0.1:2".into(),
            "http://127.0.0.1:3".into(),
        ])
        .unwrap();
        assert_eq!(s.current_addr(), "http://127.0.0.1:1");
        s.failover_from(s.current());
        assert_eq!(s.current_addr(), "http://127.0.0.1:2");
        // A late failure of a server already left does not skip one.
        s.failover_from(0);
        assert_eq!(s.current_addr(), "http://127.0.0.1:2");
        s.failover_from(s.current());
        s.failover_from(s.current());
        assert_eq!(s.current_addr(), "http://127.0.0.1:1");
    }
}
