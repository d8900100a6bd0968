//! What the agent's listeners share: how many connections one client
//! address holds ([`PerClientLimit`]), and the agent protocol's accept
//! loop ([`rpc_incoming`]), which refuses a client over its limit, and
//! with TLS a peer whose certificate does not chain to the CA or is not
//! an agent's, before tonic sees the connection.

use berth_sync::MutexExt;
use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr};
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use berth_server::PeerIdentity;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tonic::transport::server::{Connected, TcpConnectInfo};

/// How long a peer of the agent protocol may take over its TLS handshake.
pub const RPC_HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// How many connections each client address holds on one listener, at
/// most `max`. Cheap to clone: clones count together.
#[derive(Clone)]
pub struct PerClientLimit {
    max: u32,
    held: Arc<Mutex<HashMap<IpAddr, u32>>>,
}

impl PerClientLimit {
    pub fn new(max: u32) -> PerClientLimit {
        PerClientLimit {
            max,
            held: Arc::new(Mutex::new(HashMap::new())),
        }
    }

    pub fn max(&self) -> u32 {
        self.max
    }

    fn held(&self) -> std::sync::MutexGuard<'_, HashMap<IpAddr, u32>> {
        self.held.locked()
    }

    /// A slot for one more connection of `ip`, held until dropped, or
    /// `None` when `ip` holds its `max` already.
    pub fn try_acquire(&self, ip: IpAddr) -> Option<ConnSlot> {
        let mut held = self.held();
        let n = held.entry(ip).or_insert(0);
        if *n >= self.max {
            return None;
        }
        *n += 1;
        Some(ConnSlot {
            limit: self.clone(),
            ip,
        })
    }
}

/// One connection counted against its client address.
pub struct ConnSlot {
    limit: PerClientLimit,
    ip: IpAddr,
}

impl Drop for ConnSlot {
    fn drop(&mut self) {
        let mut held = self.limit.held();
        if let Some(n) = held.get_mut(&self.ip) {
            *n = n.saturating_sub(1);
            if *n == 0 {
                held.remove(&self.ip);
            }
        }
    }
}

/// An accepted connection that holds its slot while it lives, and tells
/// tonic `info` about its peer (put into every request's extensions).
pub struct Counted<IO, I> {
    io: IO,
    info: I,
    _slot: ConnSlot,
}

impl<IO, I: Clone + Send + Sync + 'static> Connected for Counted<IO, I> {
    type ConnectInfo = I;

    fn connect_info(&self) -> I {
        self.info.clone()
    }
}

impl<IO: AsyncRead + Unpin, I: Unpin> AsyncRead for Counted<IO, I> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.get_mut().io).poll_read(cx, buf)
    }
}

impl<IO: AsyncWrite + Unpin, I: Unpin> AsyncWrite for Counted<IO, I> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.get_mut().io).poll_write(cx, buf)
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.get_mut().io).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.get_mut().io).poll_shutdown(cx)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.get_mut().io).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }
}

/// A connection of the agent protocol over TLS: its peer proved the
/// [`PeerIdentity`] tonic puts into each of its requests.
pub type TlsRpcConn = Counted<tokio_rustls::server::TlsStream<TcpStream>, PeerIdentity>;
/// A connection of the agent protocol without TLS (`-dev`, or `tls.rpc`
/// off): its requests carry tonic's [`TcpConnectInfo`], no identity.
pub type PlainRpcConn = Counted<TcpStream, TcpConnectInfo>;

/// The connections of the agent protocol's `listener`, as tonic's
/// incoming stream: `accept` turns each TCP connection within its
/// client's limit into one (a TLS handshake), or refuses it (`None`).
/// Runs until the stream is dropped (tonic stops serving).
pub fn incoming<T, F, Fut>(
    listener: TcpListener,
    limit: PerClientLimit,
    accept: F,
) -> tokio_stream::wrappers::ReceiverStream<std::io::Result<T>>
where
    T: Send + 'static,
    F: Fn(TcpStream, SocketAddr, ConnSlot) -> Fut + Send + 'static,
    Fut: std::future::Future<Output = Option<T>> + Send + 'static,
{
    let (tx, rx) = tokio::sync::mpsc::channel(64);
    tokio::spawn(async move {
        loop {
            let (stream, addr) = tokio::select! {
                _ = tx.closed() => return,
                r = listener.accept() => match r {
                    Ok(c) => c,
                    Err(e) => {
                        // Out of descriptors, say: the next accept may work.
                        tracing::warn!(error = %e, "agent protocol: accepting a connection failed");
                        tokio::time::sleep(Duration::from_millis(100)).await;
                        continue;
                    }
                },
            };
            let Some(slot) = limit.try_acquire(addr.ip()) else {
                tracing::warn!(
                    peer = %addr,
                    limit = limit.max(),
                    "agent protocol: connection refused; the client address holds rpc_max_conns_per_client connections"
                );
                continue;
            };
            let _ = stream.set_nodelay(true);
            let tx = tx.clone();
            let conn = accept(stream, addr, slot);
            tokio::spawn(async move {
                if let Some(c) = conn.await {
                    let _ = tx.send(Ok(c)).await;
                }
            });
        }
    });
    tokio_stream::wrappers::ReceiverStream::new(rx)
}

/// A plaintext connection, as it came.
pub async fn accept_plain(
    stream: TcpStream,
    _addr: SocketAddr,
    slot: ConnSlot,
) -> Option<PlainRpcConn> {
    let info = stream.connect_info();
    Some(Counted {
        io: stream,
        info,
        _slot: slot,
    })
}

/// What a refused TLS handshake's error says of the peer, for the log: a
/// peer that spoke plaintext to a TLS port, or presented a certificate of
/// another CA, is told apart from other failures.
pub fn handshake_hint(e: &std::io::Error) -> &'static str {
    match e.get_ref().and_then(|i| i.downcast_ref::<rustls::Error>()) {
        Some(rustls::Error::InvalidMessage(rustls::InvalidMessage::InvalidContentType)) => {
            "the peer spoke plaintext to a TLS port: it needs TLS on (an https:// address \
             and -ca-cert for the CLI, tls { rpc = true } for an agent)"
        }
        Some(rustls::Error::InvalidCertificate(
            rustls::CertificateError::UnknownIssuer | rustls::CertificateError::BadSignature,
        )) => "the peer's certificate is not signed by this agent's CA (tls { ca_file })",
        Some(rustls::Error::NoCertificatesPresented) => {
            "the peer presented no certificate; this port asks for one of the agents' CA"
        }
        _ => "",
    }
}

/// A TLS connection whose peer presented a certificate of the CA that
/// names an agent of the region (a client or a server), or `None`
/// (logged) when the handshake fails or takes too long, or the
/// certificate is another role's: the CLI's certificate is for the HTTPS
/// API only.
pub async fn accept_tls(
    tls: Arc<crate::tls::AgentTls>,
    stream: TcpStream,
    addr: SocketAddr,
    slot: ConnSlot,
) -> Option<TlsRpcConn> {
    let acceptor = tls.rpc_acceptor();
    match tokio::time::timeout(RPC_HANDSHAKE_TIMEOUT, acceptor.accept(stream)).await {
        Ok(Ok(s)) => {
            let identity = PeerIdentity {
                remote_addr: Some(addr),
                cert_names: crate::tls::peer_dns_names(s.get_ref().1),
            };
            if !identity.is_agent_of(tls.region()) {
                tracing::warn!(
                    peer = %addr,
                    names = ?identity.cert_names,
                    region = tls.region(),
                    "agent protocol: connection refused; the certificate names no client or server \
                     agent of the region (the CLI certificate is for the HTTPS API only)"
                );
                return None;
            }
            tracing::debug!(peer = %addr, names = ?identity.cert_names, "agent protocol: TLS peer");
            Some(Counted {
                io: s,
                info: identity,
                _slot: slot,
            })
        }
        Ok(Err(e)) => {
            tracing::warn!(peer = %addr, error = %e, hint = handshake_hint(&e), "agent protocol: TLS handshake refused");
            None
        }
        Err(_) => {
            tracing::warn!(
                peer = %addr,
                timeout = ?RPC_HANDSHAKE_TIMEOUT,
                "agent protocol: TLS handshake timed out"
            );
            None
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_client_address_holds_at_most_its_limit_until_one_closes() {
        let limit = PerClientLimit::new(2);
        let a: IpAddr = "10.0.0.1".parse().unwrap();
        let b: IpAddr = "10.0.0.2".parse().unwrap();
        let one = limit.try_acquire(a).expect("first");
        let _two = limit.try_acquire(a).expect("second");
        assert!(limit.try_acquire(a).is_none(), "third of the same address");
        let _other = limit.try_acquire(b).expect("another address has its own");
        drop(one);
        assert!(limit.try_acquire(a).is_some(), "a slot comes back on close");
    }
}
