//! The HTTPS API speaks the HTTP/2 its TLS offers: on a real `berth agent`
//! with mutual TLS and ACLs, a client that negotiates `h2` gets the same
//! answers and refusals as one that speaks HTTP/1.1, many blocking
//! queries share one HTTP/2 connection, and a connection that never sends
//! a request is closed after the header timeout. Reaching it wrongly (plain
//! HTTP, another CA, no token) says what to set.

use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use berth_tests::pki::{https_request_on, tls_connect, Pki, CLI_CERT, SERVER_CERT};
use berth_tests::{binary, exit_ok, free_port, sleeping_service_job, wait_for, Agent};
use hyper::client::conn::http2::SendRequest;
use hyper_util::rt::{TokioExecutor, TokioIo};
use rustls_pki_types::ServerName;
use serde_json::Value;
use tokio::io::AsyncReadExt;

const BLOCKING: usize = 200;

struct Secured {
    pki: Pki,
    agent: Agent,
    port: u16,
}

impl Secured {
    /// A server with ACLs and mutual TLS on both ports.
    fn start() -> Result<Secured> {
        let pki = Pki::new()?;
        let tls = pki.tls_block(SERVER_CERT, true);
        Secured::start_with(pki, &format!("acl {{\n  enabled = true\n}}\n{tls}"))
    }

    /// A server whose config adds `security` (its `acl` and `tls`
    /// blocks) to the short header timeout and the many streams.
    fn start_with(pki: Pki, security: &str) -> Result<Secured> {
        let config = pki.config(
            "server.hcl",
            &format!(
                "server {{\n  enabled = true\n}}\n\
                 limits {{\n  http_header_read_timeout = \"2s\"\n  \
                 http_max_concurrent_streams = 256\n}}\n{security}"
            ),
        )?;
        let port = free_port();
        let agent = Agent::start(&[
            "-config",
            config.to_str().context("UTF-8")?,
            "-http-addr",
            &format!("127.0.0.1:{port}"),
            "-rpc-addr",
            &format!("127.0.0.1:{}", free_port()),
        ])?;
        Ok(Secured { pki, agent, port })
    }

    fn cli(&self, token: Option<&str>, args: &[&str]) -> Result<String> {
        let mut cmd = std::process::Command::new(binary("berth"));
        cmd.args(self.pki.cli_flags(self.port))
            .args(args)
            .env_remove("BERTH_TOKEN")
            .stdin(std::process::Stdio::null());
        if let Some(t) = token {
            cmd.env("BERTH_TOKEN", t);
        }
        let out = exit_ok(cmd.output()?, args)?;
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    }

    /// A TLS connection with the CLI's certificate offering only `h2`.
    async fn h2_tls(&self) -> Result<tokio_rustls::client::TlsStream<tokio::net::TcpStream>> {
        let mut config = (*self.pki.client_config(Some(CLI_CERT))?).clone();
        config.alpn_protocols = vec![b"h2".to_vec()];
        let connector = tokio_rustls::TlsConnector::from(Arc::new(config));
        let tcp = tokio::net::TcpStream::connect(("127.0.0.1", self.port)).await?;
        let name = ServerName::IpAddress(std::net::Ipv4Addr::LOCALHOST.into());
        let tls = connector.connect(name, tcp).await?;
        anyhow::ensure!(
            tls.get_ref().1.alpn_protocol() == Some(b"h2"),
            "the agent did not take h2"
        );
        Ok(tls)
    }

    /// An HTTP/2 connection to the agent.
    async fn h2(&self) -> Result<SendRequest<String>> {
        let tls = self.h2_tls().await?;
        let (send, conn) =
            hyper::client::conn::http2::handshake(TokioExecutor::new(), TokioIo::new(tls)).await?;
        tokio::spawn(conn);
        Ok(send)
    }
}

/// `method path` over `send` with `token` and `body`: the status, the
/// index header and the JSON body (`null` when it is not JSON).
async fn call(
    mut send: SendRequest<String>,
    method: &'static str,
    path: String,
    token: Option<String>,
    body: String,
) -> Result<(u16, u64, Value)> {
    let mut req = hyper::Request::builder()
        .method(method)
        .uri(format!("https://127.0.0.1{path}"))
        .header("content-type", "application/json");
    if let Some(t) = token {
        req = req.header("x-berth-token", t);
    }
    send.ready().await?;
    let resp = send.send_request(req.body(body)?).await?;
    let status = resp.status().as_u16();
    let index = resp
        .headers()
        .get("x-berth-index")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse().ok())
        .unwrap_or(0);
    let mut body = resp.into_body();
    let mut bytes = Vec::new();
    while let Some(frame) = next_frame(&mut body).await {
        if let Ok(data) = frame?.into_data() {
            bytes.extend_from_slice(&data);
        }
    }
    let json = serde_json::from_slice(&bytes).unwrap_or(Value::Null);
    Ok((status, index, json))
}

async fn get(
    send: &SendRequest<String>,
    path: &str,
    token: Option<&str>,
) -> Result<(u16, u64, Value)> {
    call(
        send.clone(),
        "GET",
        path.to_string(),
        token.map(str::to_string),
        String::new(),
    )
    .await
}

async fn next_frame(
    body: &mut hyper::body::Incoming,
) -> Option<Result<hyper::body::Frame<hyper::body::Bytes>, hyper::Error>> {
    use http_body::Body;
    std::future::poll_fn(|cx| std::pin::Pin::new(&mut *body).poll_frame(cx)).await
}

#[test]
fn https_answers_http2_and_http1_alike() -> Result<()> {
    let s = Secured::start()?;
    let boot = wait_for("the ACL bootstrap", Duration::from_secs(30), || {
        let Ok(out) = s.cli(None, &["acl", "bootstrap", "-json"]) else {
            return Ok(None);
        };
        let v: Value = serde_json::from_str(&out).with_context(|| out.clone())?;
        Ok(v["secret_id"].as_str().map(str::to_string))
    })?;
    let job_file = s
        .pki
        .config("sleeper.hcl", &sleeping_service_job("sleeper", 1, 0))?;
    let job_body = s.cli(
        None,
        &["job", "run", "-output", job_file.to_str().context("UTF-8")?],
    )?;
    let rt = tokio::runtime::Runtime::new()?;
    rt.block_on(async {
        let send = s.h2().await?;
        // h2: 200 with the token, 403 without; HTTP/1.1: the same.
        let (status, index, jobs) = get(&send, "/v1/jobs", Some(&boot)).await?;
        assert_eq!(status, 200, "{jobs}");
        let (status, _, refused) = get(&send, "/v1/jobs", None).await?;
        assert_eq!(status, 403, "{refused}");
        let cli = s.pki.client_config(Some(CLI_CERT))?;
        let h1 = https_request_on(
            tls_connect(&cli, s.port)?,
            "GET",
            "/v1/jobs",
            Some(&boot),
            "",
        )?;
        assert_eq!(h1.status, 200);
        assert_eq!(h1.json()?, jobs, "HTTP/1.1 and HTTP/2 answer alike");
        let h1 = https_request_on(tls_connect(&cli, s.port)?, "GET", "/v1/jobs", None, "")?;
        assert_eq!(h1.status, 403);

        // Many blocking queries on the one connection, all answered when
        // the jobs table moves.
        let path = format!("/v1/jobs?index={index}&wait=60s");
        let waiting: Vec<_> = (0..BLOCKING)
            .map(|_| {
                tokio::spawn(call(
                    send.clone(),
                    "GET",
                    path.clone(),
                    Some(boot.clone()),
                    String::new(),
                ))
            })
            .collect();
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let (_, _, me) = get(&send, "/v1/agent/self", Some(&boot)).await?;
            if me["limits"]["blocking_queries"].as_u64() == Some(BLOCKING as u64) {
                break;
            }
            if Instant::now() > deadline {
                bail!("the agent never held the {BLOCKING} blocking queries: {me}");
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        let (status, _, written) = call(
            send.clone(),
            "PUT",
            "/v1/jobs".into(),
            Some(boot.clone()),
            job_body.trim().to_string(),
        )
        .await?;
        assert_eq!(status, 200, "{written}");
        for w in waiting {
            let (status, moved_to, _) =
                tokio::time::timeout(Duration::from_secs(30), w).await???;
            assert_eq!(status, 200);
            assert!(moved_to > index, "{moved_to} after {index}");
        }

        // A connection that negotiates h2 and then sends nothing is closed
        // after the header timeout (2 s here).
        let mut idle = s.h2_tls().await?;
        let opened = Instant::now();
        let mut buf = [0u8; 256];
        loop {
            match tokio::time::timeout(Duration::from_secs(15), idle.read(&mut buf)).await {
                Ok(Ok(0)) | Ok(Err(_)) => break,
                // The agent's SETTINGS frame.
                Ok(Ok(_)) => continue,
                Err(_) => bail!("a silent connection stayed open for 15 s"),
            }
        }
        let closed_after = opened.elapsed();
        assert!(
            closed_after >= Duration::from_millis(1500) && closed_after < Duration::from_secs(10),
            "closed after {closed_after:?}"
        );
        eprintln!("a silent HTTP/2 connection was closed after {closed_after:?}");
        anyhow::Ok(())
    })?;
    let log = s.agent.log();
    assert!(!log.contains(&boot), "the token reached the log");
    Ok(())
}

/// The rapid-reset pattern: a client that opens streams and resets them
/// at once, in a loop, is disconnected long before 10,000, and costs the
/// agent bounded CPU time and memory.
#[test]
fn a_client_that_opens_and_resets_streams_in_a_loop_is_disconnected() -> Result<()> {
    let s = Secured::start()?;
    let cli = s.pki.client_config(Some(CLI_CERT))?;
    wait_for("the HTTPS API", Duration::from_secs(30), || {
        Ok(tls_connect(&cli, s.port).ok().map(|_| ()))
    })?;
    let pid = s.agent.pid().context("the agent runs")?;
    let cpu_before = berth_tests::cpu_time(pid).context("CPU time")?;
    let rss_before = berth_tests::rss_kib(pid).context("VmRSS")?;
    let rt = tokio::runtime::Runtime::new()?;
    let (opened, reason) = rt.block_on(async {
        let tls = s.h2_tls().await?;
        let (mut client, conn) = h2::client::handshake(tls).await?;
        let driving = tokio::spawn(conn);
        let mut opened = 0u32;
        let reason = loop {
            if opened == 10_000 {
                break "all 10,000 were taken".to_string();
            }
            client = match client.ready().await {
                Ok(c) => c,
                Err(e) => break e.to_string(),
            };
            let req = hyper::Request::get("https://127.0.0.1/v1/jobs?index=1&wait=60s").body(())?;
            match client.send_request(req, false) {
                Ok((_, mut stream)) => {
                    stream.send_reset(h2::Reason::CANCEL);
                    opened += 1;
                }
                Err(e) => break e.to_string(),
            }
        };
        let ended = tokio::time::timeout(Duration::from_secs(10), driving).await;
        anyhow::ensure!(ended.is_ok(), "the connection still runs: {reason}");
        anyhow::Ok((opened, reason))
    })?;
    let cpu = berth_tests::cpu_time(pid)
        .context("CPU time")?
        .saturating_sub(cpu_before);
    let rss = berth_tests::rss_kib(pid).context("VmRSS")?;
    eprintln!(
        "disconnected after {opened} streams ({reason}); agent CPU {cpu:?}, RSS {rss_before} -> {rss} KiB"
    );
    assert!(opened < 10_000, "a client reset 10,000 streams: {reason}");
    assert!(
        cpu < Duration::from_secs(5),
        "the resets cost {cpu:?} of CPU"
    );
    assert!(
        rss < rss_before + 50 * 1024,
        "RSS {rss_before} -> {rss} KiB"
    );
    Ok(())
}

/// A browser gets the JSON: headless Chromium (Debian's `chromium`), with
/// the agents' CA in its trust store (`certutil`, Debian's
/// `libnss3-tools`), loads an API URL of an agent whose HTTPS API asks no
/// client certificate, over the HTTP/2 it negotiates.
#[test]
fn headless_chromium_trusting_the_ca_loads_an_api_url() -> Result<()> {
    for (tool, package) in [("chromium", "chromium"), ("certutil", "libnss3-tools")] {
        let found = std::process::Command::new("sh")
            .args(["-c", &format!("command -v {tool}")])
            .output()?
            .status
            .success();
        anyhow::ensure!(
            found,
            "{tool} is not installed: apt-get install {package} (.ci/run does)"
        );
    }
    let pki = Pki::new()?;
    let (cert, key) = pki.cert_and_key(SERVER_CERT);
    let tls = format!(
        "tls {{\n  rpc = true\n  http = true\n  ca_file = {:?}\n  cert_file = {cert:?}\n  \
         key_file = {key:?}\n  verify_https_client = false\n}}\n",
        pki.ca()
    );
    let s = Secured::start_with(pki, &tls)?;
    // The browser's own home, with an NSS store that trusts the CA.
    let home = tempfile::tempdir()?;
    let nssdb = home.path().join(".pki/nssdb");
    std::fs::create_dir_all(&nssdb)?;
    let db = format!("sql:{}", nssdb.display());
    let certutil = |args: &[&str]| -> Result<()> {
        let out = std::process::Command::new("certutil").args(args).output()?;
        anyhow::ensure!(
            out.status.success(),
            "certutil {}: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr)
        );
        Ok(())
    };
    certutil(&["-d", &db, "-N", "--empty-password"])?;
    let ca = s.pki.ca();
    certutil(&[
        "-d",
        &db,
        "-A",
        "-t",
        "C,,",
        "-n",
        "berth-ca",
        "-i",
        ca.to_str().context("UTF-8")?,
    ])?;
    let url = format!("https://127.0.0.1:{}/v1/agent/health", s.port);
    let page = wait_for("Chromium to load the API", Duration::from_secs(60), || {
        let out = std::process::Command::new("timeout")
            .args([
                "60",
                "chromium",
                "--headless",
                "--no-sandbox",
                "--disable-gpu",
                "--dump-dom",
                &url,
            ])
            .env("HOME", home.path())
            .stdin(std::process::Stdio::null())
            .output()?;
        let dom = String::from_utf8_lossy(&out.stdout).into_owned();
        Ok(dom.contains(r#"{"ok":true}"#).then_some(dom))
    })?;
    assert!(page.contains("<pre>"), "{page}");
    Ok(())
}

/// Each way of reaching a secured agent wrongly says what to set: plain
/// HTTP to HTTPS (the CLI and the agent's log), a CA that did not sign the
/// agent's certificate, a request without a token.
#[test]
fn protocol_mismatches_say_what_to_set() -> Result<()> {
    let s = Secured::start()?;
    let cli = s.pki.client_config(Some(CLI_CERT))?;
    wait_for("the HTTPS API", Duration::from_secs(30), || {
        Ok(tls_connect(&cli, s.port).ok().map(|_| ()))
    })?;
    let run = |args: &[String]| -> Result<String> {
        let out = std::process::Command::new(binary("berth"))
            .args(args)
            .env_remove("BERTH_TOKEN")
            .env_remove("BERTH_ADDR")
            .stdin(std::process::Stdio::null())
            .output()?;
        anyhow::ensure!(!out.status.success(), "{args:?} succeeded");
        Ok(String::from_utf8_lossy(&out.stderr).into_owned())
    };
    let flags = s.pki.cli_flags(s.port);
    let with = |address: Option<String>, ca: Option<String>| -> Vec<String> {
        let mut f = flags.clone();
        if let Some(a) = address {
            f[1] = a;
        }
        if let Some(c) = ca {
            f[3] = c;
        }
        f.extend(["job".to_string(), "status".to_string()]);
        f
    };

    // http:// to HTTPS.
    let said = run(&with(Some(format!("http://127.0.0.1:{}", s.port)), None))?;
    assert!(said.contains("use an https:// address"), "{said}");
    // The agent says what the peer did.
    wait_for("the agent's hint", Duration::from_secs(10), || {
        Ok(s.agent
            .log()
            .contains("the peer spoke plaintext to a TLS port")
            .then_some(()))
    })?;
    // A CA that did not sign the agent's certificate.
    let rogue_ca = s.pki.path("rogue/berth-agent-ca.pem").display().to_string();
    let said = run(&with(None, Some(rogue_ca)))?;
    assert!(
        said.contains("not signed by the CA given in -ca-cert"),
        "{said}"
    );
    // No token.
    let said = run(&with(None, None))?;
    assert!(
        said.contains("pass one with -token or BERTH_TOKEN"),
        "{said}"
    );
    Ok(())
}
