//! Mutual TLS between real agents, and the HTTP listener's limits: one
//! server and client agents as separate processes, their certificates
//! made by `berth tls` itself in a temp dir, real handshakes.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context, Result};
use berth_tests::pki::{berth_in, https_request_on, tls_connect, Pki, TlsConn};
use berth_tests::{free_port, wait_for, Agent};
use serde_json::Value;

fn s(p: &Path) -> &str {
    p.to_str().expect("temp paths are UTF-8")
}

/// A server agent with TLS on both ports (`extra` added to its config).
fn start_server(pki: &Pki, cert: &str, extra: &str) -> Result<(Agent, u16, String)> {
    let file = pki.config(
        &format!("server-{cert}.hcl"),
        &format!(
            "server {{\n  enabled = true\n}}\n{}{extra}",
            pki.tls_block(cert, true)
        ),
    )?;
    let http_port = free_port();
    let rpc = format!("127.0.0.1:{}", free_port());
    let http = format!("127.0.0.1:{http_port}");
    let agent = Agent::start(&["-config", s(&file), "-http-addr", &http, "-rpc-addr", &rpc])?;
    Ok((agent, http_port, rpc))
}

/// The DNS names of the certificate the server presented on `tls`.
fn peer_names(tls: &TlsConn) -> Vec<String> {
    let Some(cert) = tls.conn.peer_certificates().and_then(|c| c.first()) else {
        return Vec::new();
    };
    // The names are the printable runs of the DER that end in ".berth"
    // or ".example": enough to tell two certificates apart.
    let text: String = cert
        .iter()
        .map(|&b| if b.is_ascii_graphic() { b as char } else { ' ' })
        .collect();
    text.split_whitespace()
        .filter(|w| w.ends_with(".berth") || w.ends_with(".example"))
        .map(str::to_string)
        .collect()
}

/// A GET of `path` on `tls`, no token: its status, head and body.
fn https_get_on(tls: TlsConn, path: &str) -> Result<(u16, String, Vec<u8>)> {
    let a = https_request_on(tls, "GET", path, None, "")?;
    Ok((a.status, a.head, a.body))
}

/// The names of the nodes the server at `port` knows, over HTTPS with
/// the CLI's certificate.
fn node_names(pki: &Pki, port: u16) -> Result<Vec<String>> {
    let cli = pki.client_config(Some("global-cli-berth"))?;
    let (status, _, body) = https_get_on(tls_connect(&cli, port)?, "/v1/nodes")?;
    if status != 200 {
        bail!("GET /v1/nodes: {status} {}", String::from_utf8_lossy(&body));
    }
    let nodes: Value = serde_json::from_slice(&body)?;
    let mut names: Vec<String> = nodes
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|n| n["name"].as_str().map(str::to_string))
        .collect();
    names.sort();
    Ok(names)
}

/// How many times `needle` is in the agent's log.
fn logged(agent: &Agent, needle: &str) -> usize {
    agent.log().matches(needle).count()
}

#[test]
fn a_client_refuses_a_server_whose_certificate_names_another_region() -> Result<()> {
    let pki = Pki::new()?;
    let (mut server, port, rpc) = start_server(&pki, "eu-server-berth", "")?;
    wait_for("the server's HTTPS API", Duration::from_secs(30), || {
        server.check_running()?;
        Ok(node_names(&pki, port).ok())
    })?;
    let (mut client, _) =
        pki.start_client("c1", &rpc, &pki.tls_block("global-client-berth", true))?;
    wait_for(
        "the client to refuse the server",
        Duration::from_secs(60),
        || {
            client.check_running()?;
            Ok((logged(&client, "TLS handshake with the server failed") >= 1).then_some(()))
        },
    )?;
    let log = client.log();
    assert!(
        log.contains("server.global.berth") && log.contains("not valid for name"),
        "{log}"
    );
    assert_eq!(node_names(&pki, port)?, Vec::<String>::new());
    Ok(())
}

/// A plaintext connection to the HTTP API on `port`.
fn tcp(port: u16) -> Result<TcpStream> {
    let c = TcpStream::connect(("127.0.0.1", port))?;
    c.set_read_timeout(Some(Duration::from_secs(60)))?;
    Ok(c)
}

/// Reads `c` to its end (or a reset): what came.
fn read_all(c: &mut TcpStream) -> Vec<u8> {
    let mut raw = Vec::new();
    let mut buf = [0u8; 4096];
    loop {
        match c.read(&mut buf) {
            Ok(0) => return raw,
            Ok(n) => raw.extend_from_slice(&buf[..n]),
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                panic!("the connection is still open after its read timeout")
            }
            Err(e) if e.kind() == std::io::ErrorKind::TimedOut => {
                panic!("the connection is still open after its read timeout")
            }
            Err(_) => return raw,
        }
    }
}

#[test]
fn the_http_listener_closes_half_sent_requests_and_answers_429_past_the_limit() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let file = dir.path().join("server.hcl");
    std::fs::write(
        &file,
        "server {\n  enabled = true\n}\nlimits {\n  http_max_conns_per_client = 3\n}\n",
    )?;
    let port = free_port();
    let http = format!("127.0.0.1:{port}");
    let mut server = Agent::start(&[
        "-config",
        s(&file),
        "-http-addr",
        &http,
        "-rpc-addr",
        "127.0.0.1:0",
    ])?;
    wait_for("the server's HTTP API", Duration::from_secs(30), || {
        server.check_running()?;
        Ok(berth_tests::api_get_at(port, "/v1/nodes").ok())
    })?;

    // Half a request: the headers never end.
    let mut half = tcp(port)?;
    let sent = Instant::now();
    half.write_all(b"GET /v1/nodes HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: ")?;

    // Two more connections hold the address's other slots...
    let _held: Vec<TcpStream> = (0..2).map(|_| tcp(port)).collect::<Result<_>>()?;
    // ...so the next one is answered 429, in the API's error shape, and
    // closed.
    let mut extra = tcp(port)?;
    extra.write_all(b"GET /v1/nodes HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")?;
    let answer = String::from_utf8_lossy(&read_all(&mut extra)).into_owned();
    assert!(answer.starts_with("HTTP/1.1 429"), "{answer}");
    let body = answer.split("\r\n\r\n").nth(1).unwrap_or_default();
    let v: Value = serde_json::from_str(body).with_context(|| answer.clone())?;
    assert!(
        v["error"]
            .as_str()
            .is_some_and(|e| e.contains("http_max_conns_per_client = 3")),
        "{v}"
    );

    // The half-sent request is closed once the header timeout (15s by
    // default) is up, not before it.
    let got = read_all(&mut half);
    let took = sent.elapsed();
    assert!(
        took >= Duration::from_secs(14) && took <= Duration::from_secs(17),
        "closed after {took:?}"
    );
    assert!(
        got.is_empty() || String::from_utf8_lossy(&got).starts_with("HTTP/1.1 408"),
        "{:?}",
        String::from_utf8_lossy(&got)
    );
    // The idle connections were closed by the same timeout; the address
    // has its slots back.
    drop(_held);
    wait_for("a slot to come back", Duration::from_secs(10), || {
        Ok(berth_tests::api_get_at(port, "/v1/nodes").ok())
    })?;
    Ok(())
}

#[test]
fn sighup_reloads_the_server_certificate_for_new_connections_only() -> Result<()> {
    let pki = Pki::new()?;
    let (mut server, port, _rpc) = start_server(&pki, "global-server-berth", "")?;
    let cli = pki.client_config(Some("global-cli-berth"))?;
    wait_for("the server's HTTPS API", Duration::from_secs(30), || {
        server.check_running()?;
        Ok(node_names(&pki, port).ok())
    })?;
    let before = tls_connect(&cli, port)?;
    assert!(!peer_names(&before).iter().any(|n| n == "reloaded.example"));
    drop(before);

    // A blocking query open on a connection made with the old
    // certificate: nothing changes the nodes, so it waits out its 8s.
    let index = {
        let (status, head, _) = https_get_on(tls_connect(&cli, port)?, "/v1/nodes")?;
        assert_eq!(status, 200);
        head.lines()
            .find_map(|l| {
                let (k, v) = l.split_once(':')?;
                k.eq_ignore_ascii_case("x-berth-index")
                    .then(|| v.trim().parse::<u64>().ok())?
            })
            .context("an X-Berth-Index header")?
    };
    let old = tls_connect(&cli, port)?;
    let opened = Instant::now();
    let blocking =
        std::thread::spawn(move || https_get_on(old, &format!("/v1/nodes?index={index}&wait=8s")));

    // A new server certificate, from the same CA, under the same names.
    let fresh = pki.path("fresh");
    std::fs::create_dir(&fresh)?;
    for f in ["berth-agent-ca.pem", "berth-agent-ca-key.pem"] {
        std::fs::copy(pki.path(f), fresh.join(f))?;
    }
    berth_in(
        &fresh,
        &[
            "tls",
            "cert",
            "create",
            "-server",
            "-additional-dnsname",
            "reloaded.example",
        ],
    )?;
    for f in ["global-server-berth.pem", "global-server-berth-key.pem"] {
        std::fs::rename(fresh.join(f), pki.path(f))?;
    }
    server.signal(nix::sys::signal::Signal::SIGHUP)?;
    wait_for("the reload", Duration::from_secs(20), || {
        Ok((logged(&server, "TLS certificates reloaded") >= 1).then_some(()))
    })?;

    let after = tls_connect(&cli, port)?;
    let names = peer_names(&after);
    assert!(names.iter().any(|n| n == "reloaded.example"), "{names:?}");
    let (status, _, _) = https_get_on(after, "/v1/nodes")?;
    assert_eq!(status, 200);

    assert!(
        !blocking.is_finished(),
        "the blocking query ended before its wait, {:?} after it opened",
        opened.elapsed()
    );
    let (status, _, body) = blocking
        .join()
        .map_err(|_| anyhow!("the blocking query panicked"))??;
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&body));
    assert!(
        opened.elapsed() >= Duration::from_secs(7),
        "{:?}",
        opened.elapsed()
    );

    // A bad file on the next reload keeps the new certificate.
    std::fs::write(pki.path("global-server-berth-key.pem"), "junk")?;
    server.signal(nix::sys::signal::Signal::SIGHUP)?;
    wait_for("the failed reload", Duration::from_secs(20), || {
        Ok((logged(&server, "the TLS files do not load") >= 1).then_some(()))
    })?;
    let still = tls_connect(&cli, port)?;
    assert!(peer_names(&still).iter().any(|n| n == "reloaded.example"));
    server.check_running()?;
    Ok(())
}
