//! The agent's TLS (rustls with ring): the certificate, key and CA of
//! `tls { ... }` read into the server and client configurations of its
//! listeners and of its dials to the servers, reloadable on SIGHUP.
//!
//! - The agent protocol listener asks every peer for a certificate that
//!   chains to the CA and refuses a peer without one at the handshake.
//! - The HTTP listener asks for one too with `verify_https_client`
//!   (the CLI presents its `cli` certificate).
//! - A client dials its servers by address and, with
//!   `verify_server_hostname`, accepts only a server certificate that
//!   names `server.<region>.berth`; it presents its own certificate.
//!
//! A reload reads the three files again; new connections use what it
//! read, connections already open keep theirs. A reload that fails keeps
//! the configuration in force.

use berth_sync::RwLockExt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, RwLock};

use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::client::WebPkiServerVerifier;
use rustls::crypto::CryptoProvider;
use rustls::server::WebPkiClientVerifier;
use rustls::{CertificateError, ClientConfig, DigitallySignedStruct, RootCertStore, ServerConfig};
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, PrivateKeyDer, ServerName, UnixTime};

/// ALPN of the agent protocol (gRPC speaks HTTP/2 only).
const ALPN_H2: &[u8] = b"h2";
/// ALPN of the HTTP API: the CLI speaks HTTP/1.1, other clients may
/// speak HTTP/2.
const ALPN_HTTP1: &[u8] = b"http/1.1";

/// Why the TLS files do not make a configuration. Never holds key bytes.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    #[error("tls: reading {what} {}: {source}", path.display())]
    Read {
        what: &'static str,
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("tls: {what} {} holds no PEM {expected}", path.display())]
    NoPem {
        what: &'static str,
        path: PathBuf,
        expected: &'static str,
    },
    #[error("tls: {what} {} is not valid PEM: {message}", path.display())]
    BadPem {
        what: &'static str,
        path: PathBuf,
        message: String,
    },
    #[error("tls: the CA file {}: {message}", path.display())]
    BadCa { path: PathBuf, message: String },
    #[error("tls: the certificate and key do not make a configuration: {0}")]
    Config(#[from] rustls::Error),
    #[error("tls: {0}")]
    Incomplete(String),
    #[error("tls: {0:?} does not make a server name to verify")]
    BadServerName(String),
    #[error("tls: the key file {} is not the key of the certificate file {}", key.display(), cert.display())]
    KeyMismatch { cert: PathBuf, key: PathBuf },
    #[error("tls: the certificate file {} is not signed by the CA in {}", cert.display(), ca.display())]
    NotSignedByCa { cert: PathBuf, ca: PathBuf },
    #[error("tls: the certificate file {} has expired{}; make a new one (berth tls cert create)", cert.display(), describe_time(*not_after))]
    Expired {
        cert: PathBuf,
        not_after: Option<UnixTime>,
    },
    #[error("tls: the certificate file {} is not valid yet (is this machine's clock right?)", cert.display())]
    NotValidYet { cert: PathBuf },
    #[error("tls: the certificate file {} is refused: {message}", cert.display())]
    BadCert { cert: PathBuf, message: String },
}

/// `" on <date>"` for a certificate's end of validity, when known.
fn describe_time(t: Option<UnixTime>) -> String {
    t.map(|t| {
        let at = std::time::UNIX_EPOCH + std::time::Duration::from_secs(t.as_secs());
        format!(" on {}", humantime::format_rfc3339_seconds(at))
    })
    .unwrap_or_default()
}

/// The certificate, key and CA of a `tls` block.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TlsFiles {
    pub ca_file: PathBuf,
    pub cert_file: PathBuf,
    pub key_file: PathBuf,
}

/// What the three files hold.
struct Material {
    roots: Arc<RootCertStore>,
    chain: Vec<CertificateDer<'static>>,
    key: PrivateKeyDer<'static>,
}

fn read(what: &'static str, path: &Path) -> Result<Vec<u8>, TlsError> {
    std::fs::read(path).map_err(|source| TlsError::Read {
        what,
        path: path.to_path_buf(),
        source,
    })
}

/// The certificates of the PEM file `path`, at least one.
pub fn read_certs(
    what: &'static str,
    path: &Path,
) -> Result<Vec<CertificateDer<'static>>, TlsError> {
    let bytes = read(what, path)?;
    let certs = CertificateDer::pem_slice_iter(&bytes)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| TlsError::BadPem {
            what,
            path: path.to_path_buf(),
            message: e.to_string(),
        })?;
    if certs.is_empty() {
        return Err(TlsError::NoPem {
            what,
            path: path.to_path_buf(),
            expected: "CERTIFICATE",
        });
    }
    Ok(certs)
}

/// The private key of the PEM file `path`.
pub fn read_key(path: &Path) -> Result<PrivateKeyDer<'static>, TlsError> {
    let what = "the key file";
    let bytes = read(what, path)?;
    PrivateKeyDer::from_pem_slice(&bytes).map_err(|e| match e {
        rustls_pki_types::pem::Error::NoItemsFound => TlsError::NoPem {
            what,
            path: path.to_path_buf(),
            expected: "PRIVATE KEY",
        },
        e => TlsError::BadPem {
            what,
            path: path.to_path_buf(),
            message: e.to_string(),
        },
    })
}

/// What an agent would refuse of `files` at start: a file that does not
/// read, a key that is not the certificate's, a certificate that the CA
/// did not sign, or that has expired or is not valid yet. Each refusal
/// names the file.
pub fn check_files(files: &TlsFiles) -> Result<(), TlsError> {
    Material::load(files)?.check(files)
}

impl Material {
    /// Whether the key is the certificate's, and the certificate chains
    /// to the CA and is valid now.
    fn check(&self, files: &TlsFiles) -> Result<(), TlsError> {
        let p = provider();
        check_key_pair(&self.chain, &self.key, &files.cert_file, &files.key_file)?;
        let verifier = WebPkiClientVerifier::builder_with_provider(self.roots.clone(), p)
            .build()
            .map_err(|e| TlsError::Config(rustls::Error::General(e.to_string())))?;
        let Some((end, intermediates)) = self.chain.split_first() else {
            return Err(TlsError::NoPem {
                what: "the certificate file",
                path: files.cert_file.clone(),
                expected: "CERTIFICATE",
            });
        };
        let cert = || files.cert_file.clone();
        match verifier.verify_client_cert(end, intermediates, UnixTime::now()) {
            Ok(_) => Ok(()),
            Err(rustls::Error::InvalidCertificate(e)) => match e {
                // A certificate for another use (a server's only): its
                // chain and dates were checked before its purpose.
                CertificateError::InvalidPurpose
                | CertificateError::InvalidPurposeContext { .. } => Ok(()),
                CertificateError::UnknownIssuer | CertificateError::BadSignature => {
                    Err(TlsError::NotSignedByCa {
                        cert: cert(),
                        ca: files.ca_file.clone(),
                    })
                }
                CertificateError::Expired => Err(TlsError::Expired {
                    cert: cert(),
                    not_after: None,
                }),
                CertificateError::ExpiredContext { not_after, .. } => Err(TlsError::Expired {
                    cert: cert(),
                    not_after: Some(not_after),
                }),
                CertificateError::NotValidYet | CertificateError::NotValidYetContext { .. } => {
                    Err(TlsError::NotValidYet { cert: cert() })
                }
                other => Err(TlsError::BadCert {
                    cert: cert(),
                    message: format!("{other:?}"),
                }),
            },
            Err(e) => Err(TlsError::BadCert {
                cert: cert(),
                message: e.to_string(),
            }),
        }
    }

    fn load(files: &TlsFiles) -> Result<Material, TlsError> {
        Ok(Material {
            roots: read_roots(&files.ca_file)?,
            chain: read_certs("the certificate file", &files.cert_file)?,
            key: read_key(&files.key_file)?,
        })
    }
}

/// The CAs of the PEM file `ca_file`.
fn read_roots(ca_file: &Path) -> Result<Arc<RootCertStore>, TlsError> {
    let mut roots = RootCertStore::empty();
    for ca in read_certs("the CA file", ca_file)? {
        roots.add(ca).map_err(|e| TlsError::BadCa {
            path: ca_file.to_path_buf(),
            message: e.to_string(),
        })?;
    }
    Ok(Arc::new(roots))
}

/// Whether `key` (of `key_file`) is the key of `chain`'s certificate (of
/// `cert_file`).
fn check_key_pair(
    chain: &[CertificateDer<'static>],
    key: &PrivateKeyDer<'static>,
    cert_file: &Path,
    key_file: &Path,
) -> Result<(), TlsError> {
    match rustls::sign::CertifiedKey::from_der(chain.to_vec(), key.clone_key(), &provider()) {
        Ok(_) => Ok(()),
        Err(rustls::Error::InconsistentKeys(_)) => Err(TlsError::KeyMismatch {
            cert: cert_file.to_path_buf(),
            key: key_file.to_path_buf(),
        }),
        Err(e) => Err(TlsError::BadCert {
            cert: key_file.to_path_buf(),
            message: e.to_string(),
        }),
    }
}

/// The TLS the servers dial etcd with (`etcd { tls { ... } }`): it trusts
/// only the CA of `ca_file`, checks that each member's certificate names
/// the host of its endpoint, and presents the certificate and key of
/// `client` (`(cert_file, key_file)`) when given, for members that check
/// their clients (`--client-cert-auth`).
pub fn etcd_client_config(
    ca_file: &Path,
    client: Option<(&Path, &Path)>,
) -> Result<Arc<ClientConfig>, TlsError> {
    let p = provider();
    let verifier = WebPkiServerVerifier::builder_with_provider(read_roots(ca_file)?, p.clone())
        .build()
        .map_err(|e| TlsError::Config(rustls::Error::General(e.to_string())))?;
    let builder = ClientConfig::builder_with_provider(p)
        .with_safe_default_protocol_versions()?
        .with_webpki_verifier(verifier);
    let mut c = match client {
        None => builder.with_no_client_auth(),
        Some((cert_file, key_file)) => {
            let chain = read_certs("the certificate file", cert_file)?;
            let key = read_key(key_file)?;
            check_key_pair(&chain, &key, cert_file, key_file)?;
            builder.with_client_auth_cert(chain, key)?
        }
    };
    c.alpn_protocols = vec![ALPN_H2.to_vec()];
    Ok(Arc::new(c))
}

fn provider() -> Arc<CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

/// A server configuration presenting `m`'s certificate; with
/// `require_client_cert` a peer must present one that chains to the CA,
/// else it may present none (one it presents must still chain).
fn server_config(
    m: &Material,
    require_client_cert: bool,
    alpn: &[&[u8]],
) -> Result<Arc<ServerConfig>, TlsError> {
    let p = provider();
    let verifier = WebPkiClientVerifier::builder_with_provider(m.roots.clone(), p.clone());
    let verifier = if require_client_cert {
        verifier
    } else {
        verifier.allow_unauthenticated()
    };
    let verifier = verifier
        .build()
        .map_err(|e| TlsError::Config(rustls::Error::General(e.to_string())))?;
    let mut c = ServerConfig::builder_with_provider(p)
        .with_safe_default_protocol_versions()?
        .with_client_cert_verifier(verifier)
        .with_single_cert(m.chain.clone(), m.key.clone_key())?;
    c.alpn_protocols = alpn.iter().map(|a| a.to_vec()).collect();
    Ok(Arc::new(c))
}

/// A client configuration that trusts only the CA and presents `m`'s
/// certificate; without `verify_hostname` any server certificate of the
/// CA is accepted whatever it names.
fn client_config(m: &Material, verify_hostname: bool) -> Result<Arc<ClientConfig>, TlsError> {
    let p = provider();
    let webpki = WebPkiServerVerifier::builder_with_provider(m.roots.clone(), p.clone())
        .build()
        .map_err(|e| TlsError::Config(rustls::Error::General(e.to_string())))?;
    let verifier: Arc<dyn ServerCertVerifier> = if verify_hostname {
        webpki
    } else {
        Arc::new(ChainOnly(webpki))
    };
    let mut c = ClientConfig::builder_with_provider(p)
        .with_safe_default_protocol_versions()?
        .dangerous()
        .with_custom_certificate_verifier(verifier)
        .with_client_auth_cert(m.chain.clone(), m.key.clone_key())?;
    c.alpn_protocols = vec![ALPN_H2.to_vec()];
    Ok(Arc::new(c))
}

/// Checks that a server certificate chains to the CA, not the name it
/// was dialled by (`verify_server_hostname = false`).
#[derive(Debug)]
struct ChainOnly(Arc<WebPkiServerVerifier>);

impl ServerCertVerifier for ChainOnly {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        server_name: &ServerName<'_>,
        ocsp_response: &[u8],
        now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        // The name is checked last, once the chain verified.
        match self
            .0
            .verify_server_cert(end_entity, intermediates, server_name, ocsp_response, now)
        {
            Err(rustls::Error::InvalidCertificate(
                CertificateError::NotValidForName | CertificateError::NotValidForNameContext { .. },
            )) => Ok(ServerCertVerified::assertion()),
            r => r,
        }
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.0.verify_tls12_signature(message, cert, dss)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.0.verify_tls13_signature(message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<rustls::SignatureScheme> {
        self.0.supported_verify_schemes()
    }
}

/// The configurations made of one reading of the files.
struct Configs {
    rpc_server: Arc<ServerConfig>,
    http_server: Arc<ServerConfig>,
    client: Arc<ClientConfig>,
}

/// The agent's TLS: which listeners speak it, and the configurations in
/// force, replaced by [`AgentTls::reload`].
pub struct AgentTls {
    files: TlsFiles,
    /// `tls.rpc`: the agent protocol (listener and dials) speaks TLS.
    pub rpc: bool,
    /// `tls.http`: the HTTP API is served over TLS.
    pub http: bool,
    verify_server_hostname: bool,
    verify_https_client: bool,
    /// `server.<region>.berth`: what a server certificate must name.
    server_name: ServerName<'static>,
    /// The region whose agents' certificates the agent protocol takes.
    region: String,
    current: RwLock<Arc<Configs>>,
}

impl std::fmt::Debug for AgentTls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AgentTls")
            .field("files", &self.files)
            .field("rpc", &self.rpc)
            .field("http", &self.http)
            .field("server_name", &self.server_name)
            .finish_non_exhaustive()
    }
}

/// The name a server certificate of `region` carries.
/// What the agent's TLS is made of: the `tls` block's switches and
/// files, and the region whose names the certificates carry.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TlsSettings {
    pub rpc: bool,
    pub http: bool,
    pub verify_server_hostname: bool,
    pub verify_https_client: bool,
    pub region: String,
    pub files: TlsFiles,
}

pub fn server_name_of(region: &str) -> String {
    format!("server.{region}.berth")
}

impl AgentTls {
    /// The agent's TLS as `settings` make it.
    pub fn new(settings: TlsSettings) -> Result<Arc<AgentTls>, TlsError> {
        let name = server_name_of(&settings.region);
        let server_name =
            ServerName::try_from(name.clone()).map_err(|_| TlsError::BadServerName(name))?;
        let current = Configs::build(
            &settings.files,
            settings.verify_server_hostname,
            settings.verify_https_client,
        )?;
        Ok(Arc::new(AgentTls {
            rpc: settings.rpc,
            http: settings.http,
            verify_server_hostname: settings.verify_server_hostname,
            verify_https_client: settings.verify_https_client,
            server_name,
            region: settings.region,
            current: RwLock::new(Arc::new(current)),
            files: settings.files,
        }))
    }

    /// Reads the files again; on success new connections use them, on
    /// failure the configuration in force stays.
    pub fn reload(&self) -> Result<(), TlsError> {
        let c = Configs::build(
            &self.files,
            self.verify_server_hostname,
            self.verify_https_client,
        )?;
        *self.current.write_locked() = Arc::new(c);
        Ok(())
    }

    fn configs(&self) -> Arc<Configs> {
        self.current.read_locked().clone()
    }

    /// The region whose agents' certificates (`client.<region>.berth`,
    /// `server.<region>.berth`) the agent protocol takes.
    pub fn region(&self) -> &str {
        &self.region
    }

    /// The configuration a new agent protocol connection is accepted with.
    pub fn rpc_acceptor(&self) -> tokio_rustls::TlsAcceptor {
        tokio_rustls::TlsAcceptor::from(self.configs().rpc_server.clone())
    }

    /// The configuration a new HTTP API connection is accepted with.
    pub fn http_acceptor(&self) -> tokio_rustls::TlsAcceptor {
        tokio_rustls::TlsAcceptor::from(self.configs().http_server.clone())
    }

    /// The configuration a new dial to a server uses, and the name its
    /// certificate must carry.
    pub fn connector(&self) -> (tokio_rustls::TlsConnector, ServerName<'static>) {
        (
            tokio_rustls::TlsConnector::from(self.configs().client.clone()),
            self.server_name.clone(),
        )
    }
}

impl berth_client::servers::ServerTls for AgentTls {
    fn connector(&self) -> (tokio_rustls::TlsConnector, ServerName<'static>) {
        AgentTls::connector(self)
    }
}

impl Configs {
    fn build(
        files: &TlsFiles,
        verify_server_hostname: bool,
        verify_https_client: bool,
    ) -> Result<Configs, TlsError> {
        let m = Material::load(files)?;
        m.check(files)?;
        Ok(Configs {
            rpc_server: server_config(&m, true, &[ALPN_H2])?,
            http_server: server_config(&m, verify_https_client, &[ALPN_H2, ALPN_HTTP1])?,
            client: client_config(&m, verify_server_hostname)?,
        })
    }
}

pub use berth_api::tls::dns_names;

/// The DNS names of the certificate the peer of `conn` presented.
pub fn peer_dns_names(conn: &rustls::CommonState) -> Vec<String> {
    conn.peer_certificates()
        .and_then(|c| c.first())
        .map(dns_names)
        .unwrap_or_default()
}

#[cfg(test)]
mod tests;
