//! TLS to the etcd members (`etcd { tls { ... } }`): each `https://`
//! endpoint is dialled over TCP, then a TLS handshake that checks the
//! member's certificate against the configured CA and the endpoint's host,
//! and presents the servers' certificate when one is configured (etcd's
//! `--client-cert-auth`).

use std::sync::Arc;
use std::task::{Context, Poll};

use tonic::codegen::http::Uri;

/// The TLS configuration the servers dial etcd with: the CA that signed
/// the members' certificates and, when set, the certificate the servers
/// present. The agent builds it from the files it names.
#[derive(Clone)]
pub struct EtcdTls {
    config: Arc<rustls::ClientConfig>,
    /// What the configuration was made of, for messages (file names).
    described: String,
}

impl EtcdTls {
    /// TLS with `config`; `described` names where it came from (the CA
    /// file) in errors.
    pub fn new(config: Arc<rustls::ClientConfig>, described: impl Into<String>) -> EtcdTls {
        EtcdTls {
            config,
            described: described.into(),
        }
    }

    /// The dialer of the `https://` endpoint `uri`, checking the member's
    /// certificate names the endpoint's host.
    pub(crate) fn dialer(&self, uri: &Uri) -> Result<EtcdTlsDialer, String> {
        let host = uri
            .host()
            .map(|h| h.trim_start_matches('[').trim_end_matches(']').to_string())
            .ok_or("the endpoint has no host")?;
        let name = rustls_pki_types::ServerName::try_from(host)
            .map_err(|e| format!("the endpoint's host is no name a certificate holds: {e}"))?;
        Ok(EtcdTlsDialer {
            connector: tokio_rustls::TlsConnector::from(self.config.clone()),
            name,
            described: Arc::from(self.described.as_str()),
        })
    }
}

impl PartialEq for EtcdTls {
    fn eq(&self, other: &EtcdTls) -> bool {
        Arc::ptr_eq(&self.config, &other.config)
    }
}

impl Eq for EtcdTls {}

impl std::fmt::Debug for EtcdTls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "EtcdTls({})", self.described)
    }
}

/// Dials one etcd member over TLS (see the module's doc).
#[derive(Clone)]
pub(crate) struct EtcdTlsDialer {
    connector: tokio_rustls::TlsConnector,
    name: rustls_pki_types::ServerName<'static>,
    described: Arc<str>,
}

impl tower::Service<Uri> for EtcdTlsDialer {
    type Response = hyper_util::rt::TokioIo<tokio_rustls::client::TlsStream<tokio::net::TcpStream>>;
    type Error = std::io::Error;
    type Future = std::pin::Pin<
        Box<dyn std::future::Future<Output = Result<Self::Response, Self::Error>> + Send>,
    >;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, uri: Uri) -> Self::Future {
        let (connector, name, described) = (
            self.connector.clone(),
            self.name.clone(),
            self.described.clone(),
        );
        Box::pin(async move {
            let host = uri.host().unwrap_or_default();
            let host = host.trim_start_matches('[').trim_end_matches(']');
            let port = uri.port_u16().unwrap_or(2379);
            let tcp = tokio::net::TcpStream::connect((host, port)).await?;
            let _ = tcp.set_nodelay(true);
            match connector.connect(name, tcp).await {
                Ok(s) => Ok(hyper_util::rt::TokioIo::new(s)),
                Err(e) => {
                    tracing::warn!(member = %uri, error = %e, "TLS handshake with etcd failed");
                    Err(std::io::Error::other(format!(
                        "TLS handshake with the etcd member {uri} ({described}): {e}"
                    )))
                }
            }
        })
    }
}
