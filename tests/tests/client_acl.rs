//! A client agent follows its servers' ACLs: in a cluster whose servers
//! enforce tokens, a client agent whose files have no `acl` block refuses
//! its node-local routes (task logs, signals) to a caller without a token,
//! as the servers do; one whose files say `acl { enabled = false }` refuses
//! to start once it knows, and `berth config validate` says both.

use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use berth_tests::{
    bootstrap_token, cli_ok_at, free_port, http_at, sleeping_service_job, token_request as request,
    wait_for, Agent,
};
use serde_json::Value;

fn path_str(p: &Path) -> Result<&str> {
    p.to_str().context("a path that is not UTF-8")
}

/// `method path` on the agent at `port` with `token`; the status, and the
/// JSON of a 200 (`null` for any other answer).
fn call(
    port: u16,
    method: &str,
    path: &str,
    token: Option<&str>,
    body: &str,
) -> Result<(u16, Value)> {
    let a = http_at(port, &request(method, path, token, body))?;
    // A log read answers bytes, not JSON.
    let json = if a.status == 200 {
        a.json().unwrap_or(Value::Null)
    } else {
        Value::Null
    };
    Ok((a.status, json))
}

/// An ACL server and a client agent enrolled with an introduction token
/// whose files have no `acl` block, running one alloc of a sleeping job.
struct AclCluster {
    dir: tempfile::TempDir,
    server: Agent,
    client: Agent,
    client_file: std::path::PathBuf,
    http_port: u16,
    client_port: u16,
    /// `127.0.0.1:PORT` of the server's agent protocol.
    rpc: String,
    /// The bootstrap (management) token.
    boot: String,
    alloc_id: String,
}

impl AclCluster {
    fn start() -> Result<AclCluster> {
        let dir = tempfile::tempdir()?;
        let server_file = dir.path().join("server.hcl");
        std::fs::write(
            &server_file,
            "server {\n  enabled = true\n  min_heartbeat_ttl = \"2s\"\n}\nacl {\n  enabled = true\n}\n",
        )?;
        let http_port = free_port();
        let rpc = format!("127.0.0.1:{}", free_port());
        let mut server = Agent::start(&[
            "-config",
            path_str(&server_file)?,
            "-http-addr",
            &format!("127.0.0.1:{http_port}"),
            "-rpc-addr",
            &rpc,
        ])?;
        let boot = bootstrap_token(&mut server, http_port)?;
        let (status, intro) = call(
            http_port,
            "PUT",
            "/v1/node/intro",
            Some(&boot),
            r#"{"ttl": "10m", "uses": 1}"#,
        )?;
        assert_eq!(status, 200, "{intro}");
        let intro = intro["secret_id"].as_str().context("intro secret")?;

        // The client's files: no acl block, as the README's example had it
        // (the agent's -data-dir overrides data_dir).
        let client_file = dir.path().join("client.hcl");
        let data_dir = dir.path().join("unused");
        std::fs::write(
            &client_file,
            format!(
                "data_dir = \"{}\"\nclient {{\n  enabled = true\n  servers = [\"{rpc}\"]\n  intro_token = \"{intro}\"\n}}\n",
                data_dir.display()
            ),
        )?;
        let validated = cli_ok_at("", &["config", "validate", path_str(&client_file)?])?;
        assert!(
            validated
                .contains("checks ACL tokens on its own routes whenever its servers enforce them"),
            "{validated}"
        );
        let client_port = free_port();
        let mut client = Agent::start(&[
            "-config",
            path_str(&client_file)?,
            "-node",
            "c1",
            "-http-addr",
            &format!("127.0.0.1:{client_port}"),
        ])?;

        // A job on the client, running.
        let job_file = dir.path().join("sleeper.hcl");
        std::fs::write(&job_file, sleeping_service_job("sleeper", 1, 0))?;
        let server_addr = format!("http://127.0.0.1:{http_port}");
        let body = cli_ok_at(
            &server_addr,
            &["job", "run", "-output", path_str(&job_file)?],
        )?;
        let alloc_id = wait_for("the alloc running", Duration::from_secs(60), || {
            server.check_running()?;
            client.check_running()?;
            let (status, _) = call(http_port, "PUT", "/v1/jobs", Some(&boot), body.trim())?;
            anyhow::ensure!(status == 200, "job submit: {status}");
            let (_, allocs) = call(
                http_port,
                "GET",
                "/v1/job/sleeper/allocations",
                Some(&boot),
                "",
            )?;
            Ok(allocs.as_array().into_iter().flatten().find_map(|a| {
                (a["client_status"] == "running")
                    .then(|| a["id"].as_str().map(str::to_string))
                    .flatten()
            }))
        })?;

        Ok(AclCluster {
            dir,
            server,
            client,
            client_file,
            http_port,
            client_port,
            rpc,
            boot,
            alloc_id,
        })
    }

    /// The alloc's task log, read through the client agent.
    fn logs_path(&self) -> String {
        format!(
            "/v1/client/fs/logs/{}?task=sleep&type=stdout",
            self.alloc_id
        )
    }
}

#[test]
fn a_client_without_an_acl_block_checks_tokens_when_its_servers_do() -> Result<()> {
    let AclCluster {
        dir: _dir,
        server,
        mut client,
        client_file,
        http_port,
        client_port,
        boot,
        alloc_id,
        ..
    } = AclCluster::start()?;
    // Without a token the client agent refuses its own routes, as the
    // server does; with one it answers.
    let logs = format!("/v1/client/fs/logs/{alloc_id}?task=sleep&type=stdout");
    let signal = format!("/v1/client/allocation/{alloc_id}/signal");
    assert_eq!(call(client_port, "GET", &logs, None, "")?.0, 403);
    assert_eq!(call(client_port, "HEAD", &logs, None, "")?.0, 403);
    assert_eq!(
        call(
            client_port,
            "POST",
            &signal,
            None,
            r#"{"signal": "SIGTERM"}"#
        )?
        .0,
        403
    );
    assert_eq!(call(http_port, "GET", &logs, None, "")?.0, 403);
    assert_eq!(call(client_port, "GET", &logs, Some(&boot), "")?.0, 200);
    let (_, alloc) = call(
        http_port,
        "GET",
        &format!("/v1/allocation/{alloc_id}"),
        Some(&boot),
        "",
    )?;
    assert_eq!(
        alloc["task_states"]["sleep"]["restarts"]
            .as_u64()
            .unwrap_or(0),
        0,
        "a refused signal restarted the task: {alloc}"
    );

    // The client remembers what its servers said: with acl { enabled =
    // false } in its files it refuses to start, saying why.
    client.stop()?;
    let mut text = std::fs::read_to_string(&client_file)?;
    text.push_str("acl {\n  enabled = false\n}\n");
    std::fs::write(&client_file, text)?;
    let validated = cli_ok_at("", &["config", "validate", path_str(&client_file)?])?;
    assert!(
        validated.contains("refuses to start with this file"),
        "{validated}"
    );
    client.start_again()?;
    wait_for(
        "the client to refuse to start",
        Duration::from_secs(30),
        || Ok(client.check_running().err().map(|_| ())),
    )?;
    let log = client.log();
    assert!(
        log.contains("this client's servers enforce ACL tokens"),
        "the refusal does not say why:\n{log}"
    );
    assert!(!log.contains(&boot), "the token reached the client's log");
    // A server on a host of its own does not warn of tasks beside it.
    assert!(!server
        .log()
        .contains("runs the server and the client role on one host"));
    Ok(())
}

/// A token the client agent resolved is kept no longer than it lives, and
/// a deleted one is refused within a heartbeat, not after the client's
/// `token_ttl` (30 s).
#[test]
fn a_client_refuses_expired_and_deleted_tokens_before_its_cache_would_let_go() -> Result<()> {
    let c = AclCluster::start()?;
    let logs = c.logs_path();
    let token = |body: &str| -> Result<(String, String)> {
        let (status, t) = call(c.http_port, "PUT", "/v1/acl/token", Some(&c.boot), body)?;
        anyhow::ensure!(status == 200, "token create: {status}");
        let secret = t["secret_id"].as_str().context("secret")?.to_string();
        let accessor = t["accessor_id"].as_str().context("accessor")?.to_string();
        Ok((secret, accessor))
    };

    // A token of 3 s: read (and kept) at once, refused once it expires.
    let made = Instant::now();
    let (short, _) = token(r#"{"name": "short", "type": "management", "ttl": "3s"}"#)?;
    assert_eq!(call(c.client_port, "GET", &logs, Some(&short), "")?.0, 200);
    wait_for("the expired token refused", Duration::from_secs(10), || {
        Ok((call(c.client_port, "GET", &logs, Some(&short), "")?.0 == 403).then_some(()))
    })?;
    let refused_after = made.elapsed();
    assert!(
        refused_after >= Duration::from_secs(3),
        "refused before it expired: {refused_after:?}"
    );

    // A token deleted on the servers: refused within a heartbeat (the
    // servers' TTL here is 2 s).
    let (kept, accessor) = token(r#"{"name": "kept", "type": "management"}"#)?;
    assert_eq!(call(c.client_port, "GET", &logs, Some(&kept), "")?.0, 200);
    let (status, _) = call(
        c.http_port,
        "DELETE",
        &format!("/v1/acl/token/{accessor}"),
        Some(&c.boot),
        "",
    )?;
    assert_eq!(status, 200);
    let deleted = Instant::now();
    wait_for("the deleted token refused", Duration::from_secs(15), || {
        Ok((call(c.client_port, "GET", &logs, Some(&kept), "")?.0 == 403).then_some(()))
    })?;
    eprintln!(
        "refused {:?} after expiry was due, {:?} after deletion",
        refused_after.saturating_sub(Duration::from_secs(3)),
        deleted.elapsed()
    );
    Ok(())
}

/// `berth node intro list` and `revoke`, over the API and the CLI: they
/// need a token that may write nodes, never show a secret, and a revoked
/// token enrolls no node.
#[test]
fn introduction_tokens_are_listed_and_revoked_and_a_revoked_one_enrolls_nothing() -> Result<()> {
    let c = AclCluster::start()?;
    let server_addr = format!("http://127.0.0.1:{}", c.http_port);
    let cli = |token: Option<&str>, args: &[&str]| -> Result<std::process::Output> {
        let mut cmd = std::process::Command::new(berth_tests::binary("berth"));
        cmd.args(args)
            .env("BERTH_ADDR", &server_addr)
            .env_remove("BERTH_TOKEN")
            .stdin(std::process::Stdio::null());
        if let Some(t) = token {
            cmd.env("BERTH_TOKEN", t);
        }
        Ok(cmd.output()?)
    };
    let made = cli(
        Some(&c.boot),
        &["node", "intro", "create", "-json", "-uses", "3"],
    )?;
    anyhow::ensure!(
        made.status.success(),
        "{}",
        String::from_utf8_lossy(&made.stderr)
    );
    let made: Value = serde_json::from_slice(&made.stdout)?;
    let secret = made["secret_id"].as_str().context("secret")?.to_string();
    let accessor = made["accessor_id"]
        .as_str()
        .context("accessor")?
        .to_string();

    // Listed (the spent one of c1 too), without secrets; refused without a
    // token.
    let list = cli(Some(&c.boot), &["node", "intro", "list"])?;
    let shown = String::from_utf8_lossy(&list.stdout).into_owned();
    assert!(list.status.success(), "{shown}");
    assert!(
        shown.contains(&accessor) && !shown.contains(&secret),
        "{shown}"
    );
    let (status, listed) = call(c.http_port, "GET", "/v1/node/intros", Some(&c.boot), "")?;
    assert_eq!(status, 200);
    assert!(!listed.to_string().contains(&secret), "{listed}");
    assert!(!listed.to_string().contains("secret_hash"), "{listed}");
    assert_eq!(
        call(c.http_port, "GET", "/v1/node/intros", None, "")?.0,
        403
    );
    let denied = cli(None, &["node", "intro", "revoke", &accessor])?;
    assert!(!denied.status.success());
    assert!(
        String::from_utf8_lossy(&denied.stderr).contains("permission denied"),
        "{}",
        String::from_utf8_lossy(&denied.stderr)
    );

    // Revoked by a prefix of its accessor.
    let revoked = cli(Some(&c.boot), &["node", "intro", "revoke", &accessor[..8]])?;
    let said = String::from_utf8_lossy(&revoked.stdout).into_owned();
    assert!(
        revoked.status.success(),
        "{}",
        String::from_utf8_lossy(&revoked.stderr)
    );
    assert!(
        said.contains(&accessor) && said.contains("revoked"),
        "{said}"
    );
    let (_, listed) = call(c.http_port, "GET", "/v1/node/intros", Some(&c.boot), "")?;
    assert!(!listed.to_string().contains(&accessor), "{listed}");
    assert!(
        c.server.log().contains("node introduction token revoked"),
        "the revocation is not in the audit log"
    );

    // A client that brings the revoked token is not let in.
    let file = c.dir.path().join("late.hcl");
    std::fs::write(
        &file,
        format!(
            "client {{\n  enabled = true\n  servers = [\"{}\"]\n  intro_token = \"{secret}\"\n}}\n",
            c.rpc
        ),
    )?;
    let mut late = Agent::start(&[
        "-config",
        path_str(&file)?,
        "-node",
        "late",
        "-http-addr",
        &format!("127.0.0.1:{}", free_port()),
    ])?;
    wait_for("the late client refused", Duration::from_secs(30), || {
        late.check_running()?;
        Ok(late
            .log()
            .contains("the introduction token is not known to the servers")
            .then_some(()))
    })?;
    let (_, nodes) = call(c.http_port, "GET", "/v1/nodes", Some(&c.boot), "")?;
    assert!(
        !nodes.to_string().contains("\"late\""),
        "a revoked token enrolled a node: {nodes}"
    );
    Ok(())
}
