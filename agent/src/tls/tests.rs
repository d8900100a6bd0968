//! Real handshakes over in-memory pipes between configurations made of
//! certificates `berth tls` makes.

use std::path::Path;

use super::*;
use crate::config::security::TlsSection;
use crate::config::SecuritySections;
use berth_cli::tls::{create_ca, create_cert, write_pair, Extra, Pems, Role};

/// A CA in `dir` (`<name>-ca.pem`) and certificates signed by it.
struct Ca {
    pems: Pems,
}

impl Ca {
    fn new(dir: &Path, name: &str) -> Ca {
        let pems = create_ca("berth", 10).unwrap();
        write_pair(dir, &format!("{name}-ca"), &pems).unwrap();
        Ca { pems }
    }

    /// Writes `<base>.pem` and `<base>-key.pem` for `role` in `dir`.
    fn cert(&self, dir: &Path, base: &str, role: Role, region: &str) {
        let p = create_cert(
            role,
            region,
            &Extra::default(),
            &self.pems.cert,
            &self.pems.key,
            5,
        )
        .unwrap();
        write_pair(dir, base, &p).unwrap();
    }
}

fn security(dir: &Path, ca: &str, base: &str, verify_server_hostname: bool) -> SecuritySections {
    SecuritySections {
        tls: TlsSection {
            rpc: Some(true),
            http: Some(true),
            ca_file: Some(dir.join(format!("{ca}-ca.pem"))),
            cert_file: Some(dir.join(format!("{base}.pem"))),
            key_file: Some(dir.join(format!("{base}-key.pem"))),
            verify_server_hostname: Some(verify_server_hostname),
            verify_https_client: None,
        },
        ..SecuritySections::default()
    }
}

fn from_config(s: &SecuritySections) -> Result<Arc<AgentTls>, TlsError> {
    AgentTls::new(s.tls_settings()?.expect("tls is on"))
}

fn agent_tls(s: &SecuritySections) -> Arc<AgentTls> {
    from_config(s).unwrap()
}

/// A handshake of `client` (dialling) with `server` (accepting on the
/// agent protocol): the names the server saw, or the first error.
async fn handshake(client: &AgentTls, server: &AgentTls) -> Result<Vec<String>, String> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let (a, b) = tokio::io::duplex(64 * 1024);
    let acceptor = server.rpc_acceptor();
    let (connector, name) = client.connector();
    let server_side = tokio::spawn(async move {
        let mut s = acceptor.accept(b).await.map_err(|e| e.to_string())?;
        let names = peer_dns_names(s.get_ref().1);
        let mut byte = [0u8; 1];
        s.read_exact(&mut byte).await.map_err(|e| e.to_string())?;
        Ok::<_, String>(names)
    });
    let client_side = async move {
        let mut c = connector
            .connect(name, a)
            .await
            .map_err(|e| e.to_string())?;
        c.write_all(b"x").await.map_err(|e| e.to_string())?;
        c.flush().await.map_err(|e| e.to_string())?;
        Ok::<_, String>(c)
    };
    let (c, s) = tokio::join!(client_side, server_side);
    let names = s.map_err(|e| e.to_string())?;
    c?;
    names
}

#[tokio::test]
async fn a_client_accepts_only_a_server_certificate_that_names_the_region_server() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let ca = Ca::new(d, "agents");
    ca.cert(d, "server", Role::Server, "global");
    ca.cert(d, "other-server", Role::Client, "global");
    ca.cert(d, "eu-server", Role::Server, "eu");
    ca.cert(d, "client", Role::Client, "global");
    let client = agent_tls(&security(d, "agents", "client", true));

    let names = handshake(&client, &agent_tls(&security(d, "agents", "server", true)))
        .await
        .expect("a server certificate naming server.global.berth");
    assert_eq!(names, vec!["client.global.berth", "localhost"]);

    // A certificate of the CA that names a client, or another region's
    // server, does not make a server.
    for base in ["other-server", "eu-server"] {
        let e = handshake(&client, &agent_tls(&security(d, "agents", base, true)))
            .await
            .expect_err(base);
        assert!(e.contains("not valid for name"), "{base}: {e}");
    }

    // Without verify_server_hostname the chain alone counts.
    let lax = agent_tls(&security(d, "agents", "client", false));
    handshake(
        &lax,
        &agent_tls(&security(d, "agents", "other-server", true)),
    )
    .await
    .expect("the chain is enough without verify_server_hostname");
}

#[tokio::test]
async fn the_agent_protocol_refuses_a_certificate_of_another_ca() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let ca = Ca::new(d, "agents");
    let rogue = Ca::new(d, "rogue");
    ca.cert(d, "server", Role::Server, "global");
    rogue.cert(d, "rogue-client", Role::Client, "global");
    let server = agent_tls(&security(d, "agents", "server", true));
    // The rogue client trusts the agents' CA (and its own, so that its
    // certificate checks out), so only the server's check of its
    // certificate can fail.
    let both = [
        std::fs::read_to_string(d.join("agents-ca.pem")).unwrap(),
        std::fs::read_to_string(d.join("rogue-ca.pem")).unwrap(),
    ]
    .concat();
    std::fs::write(d.join("both-ca.pem"), both).unwrap();
    let client = agent_tls(&security(d, "both", "rogue-client", false));
    let e = handshake(&client, &server).await.expect_err("another CA");
    assert!(
        e.contains("UnknownIssuer") || e.contains("unknown issuer") || e.contains("certificate"),
        "{e}"
    );
}

#[test]
fn a_reload_that_fails_keeps_the_configuration_in_force() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let ca = Ca::new(d, "agents");
    ca.cert(d, "server", Role::Server, "global");
    let tls = agent_tls(&security(d, "agents", "server", true));
    let before = Arc::as_ptr(&tls.configs());
    std::fs::write(d.join("server-key.pem"), "not a key").unwrap();
    let e = tls.reload().expect_err("a bad key file");
    assert!(e.to_string().contains("server-key.pem"), "{e}");
    assert!(!e.to_string().contains("not a key"), "{e}");
    assert_eq!(Arc::as_ptr(&tls.configs()), before);
}

#[test]
fn missing_files_are_named() {
    let dir = tempfile::tempdir().unwrap();
    let e = from_config(&security(dir.path(), "agents", "server", true)).expect_err("no files");
    assert!(e.to_string().contains("agents-ca.pem"), "{e}");
}

/// Writes `<base>.pem` and `<base>-key.pem`: a client certificate of `ca`
/// valid from 10 days ago until yesterday.
fn expired_cert(ca: &Ca, dir: &Path, base: &str) {
    let ca_key = rcgen::KeyPair::from_pem(&ca.pems.key).unwrap();
    let issuer = rcgen::Issuer::from_ca_cert_pem(&ca.pems.cert, ca_key).unwrap();
    let mut p = rcgen::CertificateParams::new(vec!["client.global.berth".to_string()]).unwrap();
    let now = time::OffsetDateTime::now_utc();
    p.not_before = now - time::Duration::days(10);
    p.not_after = now - time::Duration::days(1);
    p.extended_key_usages = vec![rcgen::ExtendedKeyUsagePurpose::ClientAuth];
    let key = rcgen::KeyPair::generate().unwrap();
    let cert = p.signed_by(&key, &issuer).unwrap();
    let pems = Pems {
        cert: cert.pem(),
        key: key.serialize_pem(),
    };
    write_pair(dir, base, &pems).unwrap();
}

/// What `config validate` and the agent's start refuse, each naming the
/// file: a key that is not the certificate's, a certificate of another
/// CA, an expired one.
#[test]
fn files_that_do_not_make_an_identity_are_refused_naming_the_file() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let ca = Ca::new(d, "agents");
    let other = Ca::new(d, "other");
    ca.cert(d, "server", Role::Server, "global");
    ca.cert(d, "client", Role::Client, "global");
    other.cert(d, "stranger", Role::Server, "global");
    expired_cert(&ca, d, "old");
    let files = |cert: &str, key: &str| TlsFiles {
        ca_file: d.join("agents-ca.pem"),
        cert_file: d.join(format!("{cert}.pem")),
        key_file: d.join(format!("{key}-key.pem")),
    };
    check_files(&files("server", "server")).expect("a good pair");
    check_files(&files("client", "client")).expect("a good client pair");

    let e = check_files(&files("server", "client")).expect_err("another key");
    assert!(matches!(e, TlsError::KeyMismatch { .. }), "{e}");
    assert!(e.to_string().contains("client-key.pem"), "{e}");
    assert!(e.to_string().contains("server.pem"), "{e}");

    let e = check_files(&files("stranger", "stranger")).expect_err("another CA");
    assert!(matches!(e, TlsError::NotSignedByCa { .. }), "{e}");
    assert!(e.to_string().contains("stranger.pem"), "{e}");
    assert!(e.to_string().contains("agents-ca.pem"), "{e}");

    let e = check_files(&files("old", "old")).expect_err("expired");
    assert!(matches!(e, TlsError::Expired { .. }), "{e}");
    assert!(e.to_string().contains("old.pem"), "{e}");
    assert!(e.to_string().contains("expired on 20"), "{e}");

    let e = check_files(&files("missing", "missing")).expect_err("no such file");
    assert!(e.to_string().contains("missing.pem"), "{e}");
    // The agent refuses them at start too.
    let mut s = security(d, "agents", "stranger", true);
    s.tls.ca_file = Some(d.join("agents-ca.pem"));
    let e = from_config(&s).expect_err("another CA at start");
    assert!(e.to_string().contains("not signed by the CA"), "{e}");
}
