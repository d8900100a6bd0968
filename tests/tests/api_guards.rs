//! What an agent's HTTP API refuses before any route answers: requests
//! whose `Host` does not name the agent (DNS rebinding), and waiting
//! requests (blocking queries, log follows) past `limits`.

use std::time::Duration;

use anyhow::{ensure, Context, Result};
use berth_tests::{
    api_get_at, cli_ok_at, free_port, http_at, http_send_at, run_job_at, sleeping_service_job,
    wait_for, Agent, DevAgent, HttpAnswer,
};
use serde_json::Value;

/// `GET path` on `port` with `host` as its `Host`.
fn get_with_host(port: u16, path: &str, host: &str) -> Result<HttpAnswer> {
    http_at(
        port,
        &format!("GET {path} HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n"),
    )
}

/// The `error` of an answer in the API's error shape.
fn error_of(answer: &HttpAnswer) -> Result<String> {
    let v: Value = serde_json::from_slice(&answer.body).with_context(|| {
        format!(
            "an error body in JSON: {:?}",
            String::from_utf8_lossy(&answer.body)
        )
    })?;
    v["error"]
        .as_str()
        .map(str::to_string)
        .with_context(|| format!("no error in {v}"))
}

fn port_of(addr: &str) -> Result<u16> {
    addr.rsplit(':')
        .next()
        .and_then(|p| p.parse().ok())
        .with_context(|| format!("no port in {addr:?}"))
}

/// A dev agent listens on loopback: a request naming another host (a web
/// page whose name was rebound to 127.0.0.1) is refused with a 403 in the
/// error shape, while its own names, and the CLI, are answered.
#[test]
fn a_request_naming_another_host_is_refused() -> Result<()> {
    let agent = DevAgent::start()?;
    let port = port_of(&agent.http_addr)?;
    for host in [
        format!("evil.example:{port}"),
        "evil.example".to_string(),
        format!("localhost.evil.example:{port}"),
        // The agent's name on another port is not the agent.
        format!("127.0.0.1:{}", port.wrapping_add(1)),
    ] {
        let answer = get_with_host(port, "/v1/agent/self", &host)?;
        ensure!(
            answer.status == 403,
            "Host {host}: {} {:?}",
            answer.head,
            String::from_utf8_lossy(&answer.body)
        );
        let error = error_of(&answer)?;
        ensure!(
            error.contains("does not name this agent"),
            "Host {host}: {error}"
        );
    }
    // A route that writes is refused alike, before it runs.
    let body = r#"{"job":{}}"#;
    let answer = http_at(
        port,
        &format!(
            "PUT /v1/jobs HTTP/1.1\r\nHost: evil.example:{port}\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
            body.len()
        ),
    )?;
    ensure!(answer.status == 403, "a write: {}", answer.head);

    for host in [
        format!("127.0.0.1:{port}"),
        format!("localhost:{port}"),
        format!("[::1]:{port}"),
        "127.0.0.1".to_string(),
    ] {
        let answer = get_with_host(port, "/v1/agent/self", &host)?;
        ensure!(answer.status == 200, "Host {host}: {}", answer.head);
    }
    // The CLI names the address it dials, by IP or as localhost.
    let nodes: Value = serde_json::from_str(&agent.cli_ok(&["node", "status", "-json"])?)?;
    ensure!(nodes.as_array().is_some_and(|n| n.len() == 1), "{nodes}");
    cli_ok_at(&format!("http://localhost:{port}"), &["node", "status"])?;
    Ok(())
}

/// `http_allowed_hosts` lets a name through to a loopback listener (a
/// proxy in front of it, on any port), and nothing else.
#[test]
fn a_configured_host_name_is_answered() -> Result<()> {
    let config = tempfile::tempdir()?;
    let file = config.path().join("server.hcl");
    std::fs::write(
        &file,
        "http_allowed_hosts = [\"berth.test\"]\nserver {\n  enabled = true\n}\n",
    )?;
    let http_port = free_port();
    let mut agent = Agent::start(&[
        "-config",
        file.to_str().context("a UTF-8 path")?,
        "-server",
        "-http-addr",
        &format!("127.0.0.1:{http_port}"),
        "-rpc-addr",
        &format!("127.0.0.1:{}", free_port()),
    ])?;
    wait_for("the server's HTTP API", Duration::from_secs(30), || {
        agent.check_running()?;
        Ok(api_get_at(http_port, "/v1/nodes").ok().map(|_| ()))
    })?;
    for host in ["berth.test", "berth.test:443", "BERTH.test"] {
        let answer = get_with_host(http_port, "/v1/nodes", host)?;
        ensure!(answer.status == 200, "Host {host}: {}", answer.head);
    }
    let answer = get_with_host(http_port, "/v1/nodes", "other.test")?;
    ensure!(answer.status == 403, "Host other.test: {}", answer.head);
    Ok(())
}

/// A server and client agent from a config file with small `limits`.
struct LimitedAgent {
    agent: Agent,
    http: u16,
    _config: tempfile::TempDir,
}

impl LimitedAgent {
    fn start(limits: &str) -> Result<LimitedAgent> {
        let config = tempfile::tempdir()?;
        let file = config.path().join("agent.hcl");
        let http = free_port();
        let rpc = free_port();
        std::fs::write(
            &file,
            format!(
                "ports {{\n  http = {http}\n  rpc  = {rpc}\n}}\n\
                 server {{\n  enabled = true\n}}\n\
                 client {{\n  enabled = true\n  servers = [\"127.0.0.1:{rpc}\"]\n}}\n\
                 limits {{\n{limits}\n}}\n"
            ),
        )?;
        let mut agent = Agent::start(&["-config", file.to_str().context("a UTF-8 path")?])?;
        wait_for("the node to be ready", Duration::from_secs(60), || {
            agent.check_running()?;
            let Ok(nodes) = api_get_at(http, "/v1/nodes") else {
                return Ok(None);
            };
            let ready = nodes
                .as_array()
                .is_some_and(|a| a.iter().any(|n| n["status"] == "ready"));
            Ok(ready.then_some(()))
        })?;
        Ok(LimitedAgent {
            agent,
            http,
            _config: config,
        })
    }

    fn addr(&self) -> String {
        format!("http://127.0.0.1:{}", self.http)
    }

    /// Waits until `/v1/agent/self` counts `n` in flight as `key`.
    fn wait_in_flight(&mut self, key: &str, n: u64) -> Result<()> {
        let http = self.http;
        let agent = &mut self.agent;
        wait_for(
            &format!("{n} {key} in flight"),
            Duration::from_secs(30),
            || {
                agent.check_running()?;
                let me = api_get_at(http, "/v1/agent/self")?;
                Ok((me["limits"][key] == n).then_some(()))
            },
        )
    }

    /// Sends `GET path` on its own connection, without reading the answer.
    fn send(&self, path: &str) -> Result<berth_tests::HttpSent> {
        http_send_at(
            self.http,
            &format!("GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n"),
            Duration::from_secs(90),
        )
    }

    fn get(&self, path: &str) -> Result<HttpAnswer> {
        get_with_host(self.http, path, "127.0.0.1")
    }
}

/// Asserts that `answer` is the 429 of the limit `key`.
fn assert_refused(answer: &HttpAnswer, key: &str) -> Result<()> {
    ensure!(
        answer.status == 429,
        "{} {:?}",
        answer.head,
        String::from_utf8_lossy(&answer.body)
    );
    ensure!(
        answer.header("retry-after") == Some("1"),
        "no Retry-After: {}",
        answer.head
    );
    let error = error_of(answer)?;
    ensure!(error.contains(key), "{error}");
    Ok(())
}

/// With `max_blocking_queries = 2`, a third blocking query is answered 429
/// at once while two wait; a query that is answered, and one whose client
/// goes away, give their slot back.
#[test]
fn blocking_queries_past_the_limit_are_refused() -> Result<()> {
    let mut agent = LimitedAgent::start("  max_blocking_queries = 2")?;
    // One waits for the next job write, the other for an index far
    // ahead: its whole wait.
    let jobs = agent.get("/v1/jobs")?;
    let index = jobs
        .header("x-berth-index")
        .context("the job list's index")?
        .to_string();
    let on_next_job = agent.send(&format!("/v1/jobs?index={index}&wait=60s"))?;
    let long = agent.send("/v1/nodes?index=999999999&wait=60s")?;
    agent.wait_in_flight("blocking_queries", 2)?;

    let refused = agent.get("/v1/allocations?index=999999999&wait=60s")?;
    assert_refused(&refused, "limits.max_blocking_queries = 2")?;
    // Reads that do not block are not counted.
    let plain = agent.get("/v1/jobs")?;
    ensure!(plain.status == 200, "a plain read: {}", plain.head);

    // A job write answers the first, which frees its slot.
    let dir = agent.agent.data_dir.path().to_path_buf();
    run_job_at(
        &agent.addr(),
        &dir,
        "wake",
        &sleeping_service_job("wake", 1, 1),
    )?;
    let answered = on_next_job.answer()?;
    ensure!(answered.status == 200, "{}", answered.head);
    agent.wait_in_flight("blocking_queries", 1)?;
    let admitted = agent.get("/v1/jobs?index=999999999&wait=1s")?;
    ensure!(admitted.status == 200, "{}", admitted.head);

    // The client of the long one goes away: its slot is freed too.
    drop(long);
    agent.wait_in_flight("blocking_queries", 0)?;
    Ok(())
}

/// With `max_log_follows = 1`, a second log follow (a logs read that waits
/// for new bytes, as `berth alloc logs -f` sends) is answered 429 while
/// the first waits; once its client goes away a follow is admitted again.
/// Plain log reads are not counted.
#[test]
fn log_follows_past_the_limit_are_refused() -> Result<()> {
    let mut agent = LimitedAgent::start("  max_log_follows = 1")?;
    let dir = agent.agent.data_dir.path().to_path_buf();
    run_job_at(
        &agent.addr(),
        &dir,
        "quiet",
        &sleeping_service_job("quiet", 1, 1),
    )?;
    let http = agent.http;
    let alloc = wait_for("the alloc to run", Duration::from_secs(60), || {
        agent.agent.check_running()?;
        let allocs = api_get_at(http, "/v1/job/quiet/allocations")?;
        Ok(allocs.as_array().and_then(|a| {
            a.iter()
                .find(|a| a["client_status"] == "running")
                .and_then(|a| a["id"].as_str().map(str::to_string))
        }))
    })?;
    // The task writes nothing: a read from the end waits its whole wait.
    let follow = format!("/v1/client/fs/logs/{alloc}?origin=end&offset=0&wait=60s");
    let first = agent.send(&follow)?;
    agent.wait_in_flight("log_follows", 1)?;

    let refused = agent.get(&follow)?;
    assert_refused(&refused, "limits.max_log_follows = 1")?;
    let read = agent.get(&format!("/v1/client/fs/logs/{alloc}?origin=end&offset=0"))?;
    ensure!(read.status == 200, "a plain read: {}", read.head);

    drop(first);
    agent.wait_in_flight("log_follows", 0)?;
    let admitted = agent.get(&format!(
        "/v1/client/fs/logs/{alloc}?origin=end&offset=0&wait=1s"
    ))?;
    ensure!(admitted.status == 200, "{}", admitted.head);
    Ok(())
}

/// A blocking query that a client-only agent forwards to its server
/// counts against the server's limit too: with the server's one slot
/// taken, the forwarded query is refused with the server's 429.
#[test]
fn a_forwarded_blocking_query_counts_against_the_servers_limit() -> Result<()> {
    let config = tempfile::tempdir()?;
    let file = config.path().join("server.hcl");
    std::fs::write(
        &file,
        "server {\n  enabled = true\n}\nlimits {\n  max_blocking_queries = 1\n}\n",
    )?;
    let server_http = free_port();
    let rpc = format!("127.0.0.1:{}", free_port());
    let mut server = Agent::start(&[
        "-config",
        file.to_str().context("a UTF-8 path")?,
        "-server",
        "-http-addr",
        &format!("127.0.0.1:{server_http}"),
        "-rpc-addr",
        &rpc,
    ])?;
    let client_http = free_port();
    let mut client = Agent::start(&[
        "-client",
        "-servers",
        &rpc,
        "-node",
        "c1",
        "-http-addr",
        &format!("127.0.0.1:{client_http}"),
    ])?;
    wait_for(
        "the client agent to forward to its server",
        Duration::from_secs(60),
        || {
            server.check_running()?;
            client.check_running()?;
            let nodes = api_get_at(client_http, "/v1/nodes")?;
            Ok(nodes
                .as_array()
                .is_some_and(|n| !n.is_empty())
                .then_some(()))
        },
    )?;
    let _held = http_send_at(
        server_http,
        "GET /v1/jobs?index=999999999&wait=60s HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n",
        Duration::from_secs(90),
    )?;
    wait_for(
        "the server's slot to be taken",
        Duration::from_secs(30),
        || {
            let me = api_get_at(server_http, "/v1/agent/self")?;
            Ok((me["limits"]["blocking_queries"] == 1).then_some(()))
        },
    )?;
    let refused = get_with_host(
        client_http,
        "/v1/nodes?index=999999999&wait=60s",
        "127.0.0.1",
    )?;
    assert_refused(&refused, "limits.max_blocking_queries = 1")?;
    // The client agent's own slot was given back with the answer.
    let me = api_get_at(client_http, "/v1/agent/self")?;
    ensure!(me["limits"]["blocking_queries"] == 0, "{me}");
    Ok(())
}
