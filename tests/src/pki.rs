//! The agents' certificates for tests and benches that run berth with TLS:
//! a CA and server, client and CLI certificates made by `berth tls`
//! itself in a temp dir (and a rogue CA that the agents do not trust),
//! and clients that speak TLS to the agents: a blocking HTTPS request, a
//! raw handshake, a gRPC channel to the agent protocol.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result};
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, PrivateKeyDer, ServerName};

use crate::{binary, exit_ok, free_port, Agent, HttpAnswer};

/// Runs `berth ARGS...` in `dir`; an error with its output unless it
/// exits 0.
pub fn berth_in(dir: &Path, args: &[&str]) -> Result<Output> {
    let out = Command::new(binary("berth"))
        .args(args)
        .current_dir(dir)
        .stdin(Stdio::null())
        .output()
        .with_context(|| format!("running berth {}", args.join(" ")))?;
    exit_ok(out, args)
}

/// The CLI's certificate: `global-cli-berth`.
pub const CLI_CERT: &str = "global-cli-berth";
/// The server agents' certificate of region `global`.
pub const SERVER_CERT: &str = "global-server-berth";
/// The client agents' certificate of region `global`.
pub const CLIENT_CERT: &str = "global-client-berth";

/// The agents' CA and certificates, made by `berth tls` in a temp dir
/// (removed on drop), and a rogue CA with a client certificate in
/// `rogue/`.
pub struct Pki {
    dir: tempfile::TempDir,
}

impl Pki {
    pub fn new() -> Result<Pki> {
        let dir = tempfile::Builder::new().prefix("berth-tls-").tempdir()?;
        let d = dir.path();
        berth_in(d, &["tls", "ca", "create"])?;
        berth_in(d, &["tls", "cert", "create", "-server"])?;
        berth_in(d, &["tls", "cert", "create", "-client"])?;
        berth_in(d, &["tls", "cert", "create", "-cli"])?;
        berth_in(d, &["tls", "cert", "create", "-server", "-region", "eu"])?;
        let rogue = d.join("rogue");
        std::fs::create_dir(&rogue)?;
        berth_in(&rogue, &["tls", "ca", "create"])?;
        berth_in(&rogue, &["tls", "cert", "create", "-client"])?;
        Ok(Pki { dir })
    }

    pub fn path(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }

    pub fn ca(&self) -> PathBuf {
        self.path("berth-agent-ca.pem")
    }

    /// The certificate file of `base` and its key file.
    pub fn cert_and_key(&self, base: &str) -> (PathBuf, PathBuf) {
        (
            self.path(&format!("{base}.pem")),
            self.path(&format!("{base}-key.pem")),
        )
    }

    /// A `tls` block with the agents' CA and the certificate `base`
    /// (`global-server-berth`, `rogue/global-client-berth`...), on the
    /// agent protocol and, when `http`, on the HTTP API.
    pub fn tls_block(&self, base: &str, http: bool) -> String {
        let (cert, key) = self.cert_and_key(base);
        format!(
            "tls {{\n  rpc = true\n  http = {http}\n  ca_file = {:?}\n  cert_file = {cert:?}\n  key_file = {key:?}\n}}\n",
            self.ca(),
        )
    }

    /// Writes `body` as the config file `name` in the PKI dir.
    pub fn config(&self, name: &str, body: &str) -> Result<PathBuf> {
        let p = self.path(name);
        std::fs::write(&p, body)?;
        Ok(p)
    }

    /// Starts a client-only agent `node` of the servers at `rpc` with
    /// `body` as its config file (written in the PKI dir); the agent and
    /// its HTTP port.
    pub fn start_client(&self, node: &str, rpc: &str, body: &str) -> Result<(Agent, u16)> {
        let file = self.config(&format!("client-{node}.hcl"), body)?;
        let file = file.to_str().context("temp paths are UTF-8")?;
        let port = free_port();
        let http = format!("127.0.0.1:{port}");
        let agent = Agent::start_client(&["-config", file], rpc, node, &http)?;
        Ok((agent, port))
    }

    /// The CLI's global flags to reach an HTTPS agent at `port` with its
    /// certificate.
    pub fn cli_flags(&self, port: u16) -> Vec<String> {
        let (cert, key) = self.cert_and_key(CLI_CERT);
        vec![
            "-address".into(),
            format!("https://127.0.0.1:{port}"),
            "-ca-cert".into(),
            self.ca().display().to_string(),
            "-client-cert".into(),
            cert.display().to_string(),
            "-client-key".into(),
            key.display().to_string(),
        ]
    }

    /// A rustls client config that trusts the agents' CA and presents
    /// `identity` (a certificate base name) or nothing.
    pub fn client_config(&self, identity: Option<&str>) -> Result<Arc<rustls::ClientConfig>> {
        let mut roots = rustls::RootCertStore::empty();
        for c in certs(&self.ca())? {
            roots.add(c)?;
        }
        let b = rustls::ClientConfig::builder_with_provider(Arc::new(
            rustls::crypto::ring::default_provider(),
        ))
        .with_safe_default_protocol_versions()?
        .with_root_certificates(roots);
        Ok(Arc::new(match identity {
            Some(base) => {
                let (cert, key) = self.cert_and_key(base);
                b.with_client_auth_cert(certs(&cert)?, PrivateKeyDer::from_pem_file(key)?)?
            }
            None => b.with_no_client_auth(),
        }))
    }
}

fn certs(path: &Path) -> Result<Vec<CertificateDer<'static>>> {
    CertificateDer::pem_file_iter(path)
        .with_context(|| format!("reading {}", path.display()))?
        .collect::<Result<Vec<_>, _>>()
        .with_context(|| format!("parsing {}", path.display()))
}

pub type TlsConn = rustls::StreamOwned<rustls::ClientConnection, TcpStream>;

/// A TLS connection to `127.0.0.1:port`, the handshake done.
pub fn tls_connect(config: &Arc<rustls::ClientConfig>, port: u16) -> Result<TlsConn> {
    let tcp = TcpStream::connect(("127.0.0.1", port))?;
    tcp.set_read_timeout(Some(Duration::from_secs(30)))?;
    let name = ServerName::IpAddress(std::net::Ipv4Addr::LOCALHOST.into());
    let conn = rustls::ClientConnection::new(config.clone(), name)?;
    let mut tls = rustls::StreamOwned::new(conn, tcp);
    while tls.conn.is_handshaking() {
        tls.conn.complete_io(&mut tls.sock)?;
    }
    Ok(tls)
}

/// Sends `method path` on `tls` (with `token` as `X-Berth-Token` when
/// given, and `body`) and reads the whole answer (`Connection: close`).
pub fn https_request_on(
    mut tls: TlsConn,
    method: &str,
    path: &str,
    token: Option<&str>,
    body: &str,
) -> Result<HttpAnswer> {
    let auth = token.map_or(String::new(), |t| format!("X-Berth-Token: {t}\r\n"));
    write!(
        tls,
        "{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n{auth}Content-Type: application/json\r\n\
         Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )?;
    tls.flush()?;
    let mut raw = Vec::new();
    match tls.read_to_end(&mut raw) {
        Ok(_) => {}
        // A server that closes without close_notify still sent it all.
        Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => {}
        Err(e) => return Err(e.into()),
    }
    crate::parse_http_answer(raw)
}

/// A gRPC channel to the agent protocol at `rpc` (`127.0.0.1:PORT`) over
/// TLS with `config`, the server's certificate checked for `server_name`
/// (`server.global.berth`), connected.
pub async fn grpc_channel(
    config: Arc<rustls::ClientConfig>,
    rpc: &str,
    server_name: &str,
) -> Result<tonic::transport::Channel> {
    let endpoint = tonic::transport::Endpoint::from_shared(format!("http://{rpc}"))?
        .connect_timeout(Duration::from_secs(10));
    grpc_channel_on(endpoint, config, rpc, server_name).await
}

/// [`grpc_channel`] with the settings of `endpoint` (keepalive, ...),
/// whose URI is `http://` + `rpc`: TLS is the connector's, not tonic's.
pub async fn grpc_channel_on(
    endpoint: tonic::transport::Endpoint,
    config: Arc<rustls::ClientConfig>,
    rpc: &str,
    server_name: &str,
) -> Result<tonic::transport::Channel> {
    let name = ServerName::try_from(server_name.to_string())
        .with_context(|| format!("{server_name:?} is not a DNS name"))?;
    let addr: std::net::SocketAddr = rpc
        .parse()
        .with_context(|| format!("{rpc:?} is not HOST:PORT"))?;
    let connector = tower::service_fn(move |_: tonic::codegen::http::Uri| {
        let connector = tokio_rustls::TlsConnector::from(config.clone());
        let name = name.clone();
        async move {
            let tcp = tokio::net::TcpStream::connect(addr).await?;
            let _ = tcp.set_nodelay(true);
            let tls = connector.connect(name, tcp).await?;
            Ok::<_, std::io::Error>(hyper_util::rt::TokioIo::new(tls))
        }
    });
    endpoint
        .connect_with_connector(connector)
        .await
        .with_context(|| format!("connecting over TLS to {rpc}"))
}
