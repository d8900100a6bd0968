//! ACLs end to end on a real `berth agent -dev -acl-enabled`: without a
//! token nothing but the public routes answers, the bootstrap token may do
//! everything, a read-only token reads and is refused every write, and the
//! same refusals hold for a request sent straight to the agent protocol
//! port through `Agent.ForwardHttp`. A new node needs an introduction
//! token there too.

use anyhow::{Context, Result};
use berth_tests::{
    forward_http, free_port, sleeping_service_job, token_request as request,
    writes_refused_to_readers, DevAgent, READONLY_POLICY,
};
use serde_json::Value;

fn json_of(agent: &DevAgent, args: &[&str]) -> Result<Value> {
    let out = agent.cli_ok(args)?;
    serde_json::from_str(&out).with_context(|| out.clone())
}

async fn forward(
    rpc: &str,
    method: &str,
    path: &str,
    token: Option<&str>,
    body: &str,
) -> Result<u32> {
    let channel = tonic::transport::Channel::from_shared(format!("http://{rpc}"))?
        .connect()
        .await?;
    forward_http(channel, method, path, token, body).await
}

#[test]
fn every_route_checks_its_token_over_http_and_the_agent_protocol() -> Result<()> {
    let rpc_port = free_port();
    let rpc = format!("127.0.0.1:{rpc_port}");
    let agent = DevAgent::start_with_args(&["-acl-enabled", "-rpc-addr", &rpc])?;
    let boot = agent.token.clone().context("the bootstrap token")?;

    // A second bootstrap is refused, naming the way back for an operator
    // who lost the token: the reset file on the server.
    let again = agent.http(&request("POST", "/v1/acl/bootstrap", None, "{}"))?;
    assert_eq!(again.status, 409, "{}", again.text());
    let said = again.json()?["error"]
        .as_str()
        .unwrap_or_default()
        .to_string();
    let (id, path) = said
        .split_once("write ")
        .and_then(|(_, rest)| rest.split_once(" into "))
        .and_then(|(id, rest)| rest.split_once(" and bootstrap").map(|(p, _)| (id, p)))
        .with_context(|| format!("no reset path in {said:?}"))?;
    // A file that does not name the bootstrap in force changes nothing.
    std::fs::write(path, "not-the-accessor\n")?;
    let stale = agent.http(&request("POST", "/v1/acl/bootstrap", None, "{}"))?;
    assert_eq!(stale.status, 409, "{}", stale.text());
    // With the accessor in it: one more bootstrap, whose token works.
    std::fs::write(path, format!("{id}\n"))?;
    let reset = agent.http(&request("POST", "/v1/acl/bootstrap", None, "{}"))?;
    assert_eq!(reset.status, 200, "{}", reset.text());
    let new_boot = reset.json()?["secret_id"]
        .as_str()
        .context("the new secret")?
        .to_string();
    assert_eq!(
        agent
            .http(&request("GET", "/v1/acl/tokens", Some(&new_boot), ""))?
            .status,
        200
    );
    assert!(!std::path::Path::new(path).exists(), "the reset file stays");
    let once = agent.http(&request("POST", "/v1/acl/bootstrap", None, "{}"))?;
    assert_eq!(
        once.status,
        409,
        "a reset file is good once: {}",
        once.text()
    );
    assert!(
        agent
            .log()
            .contains("ACL bootstrap reset from the reset file"),
        "the reset is not in the audit log"
    );

    let job = agent.write_file("sleeper.hcl", &sleeping_service_job("sleeper", 1, 0))?;
    let job_json = agent.cli_ok(&["job", "run", "-output", &job])?;
    let job_body = job_json.trim().to_string();

    // No token: 403 and no job.
    let anon = agent.http(&request("PUT", "/v1/jobs", None, &job_body))?;
    assert_eq!(anon.status, 403, "{}", anon.text());
    assert!(anon.text().contains("permission denied"), "{}", anon.text());
    let list = agent.http(&request("GET", "/v1/jobs", Some(&boot), ""))?;
    assert_eq!(list.status, 200);
    assert_eq!(
        list.json()?,
        Value::Array(vec![]),
        "a refused submit wrote a job"
    );
    // A made-up token: 403.
    let bad = agent.http(&request("GET", "/v1/jobs", Some("made-up"), ""))?;
    assert_eq!(bad.status, 403, "{}", bad.text());
    // HEAD runs the GET handler, so it needs what GET needs: no header
    // of the answer leaks, and a HEAD blocking query is refused before it
    // waits.
    for path in [
        "/v1/acl/tokens",
        "/v1/jobs?index=1&wait=3s",
        "/v1/client/fs/logs/0?task=t&type=stdout",
    ] {
        let head = agent.http(&request("HEAD", path, None, ""))?;
        assert_eq!(head.status, 403, "HEAD {path}: {}", head.text());
        assert_eq!(head.header("x-berth-index"), None, "HEAD {path}");
    }
    // A method no route lists is refused, not let through.
    let options = agent.http(&request("OPTIONS", "/v1/jobs", None, ""))?;
    assert_eq!(options.status, 403, "{}", options.text());
    // Public routes answer anyone.
    assert_eq!(
        agent
            .http(&request("GET", "/v1/agent/health", None, ""))?
            .status,
        200
    );

    // The bootstrap token submits.
    let ok = agent.http(&request("PUT", "/v1/jobs", Some(&boot), &job_body))?;
    assert_eq!(ok.status, 200, "{}", ok.text());

    // A read-only token.
    let policy = agent.write_file("readonly.hcl", READONLY_POLICY)?;
    agent.cli_ok(&["acl", "policy", "apply", "readonly", &policy])?;
    let created = json_of(
        &agent,
        &[
            "acl", "token", "create", "-json", "-name", "ro", "-policy", "readonly",
        ],
    )?;
    let ro = created["secret_id"].as_str().context("secret")?.to_string();
    let accessor = created["accessor_id"]
        .as_str()
        .context("accessor")?
        .to_string();
    assert_eq!(
        agent
            .http(&request("GET", "/v1/jobs", Some(&ro), ""))?
            .status,
        200
    );
    // Nothing the servers answer or list carries a secret.
    let tokens = json_of(&agent, &["acl", "token", "list", "-json"])?.to_string();
    assert!(!tokens.contains(&ro) && !tokens.contains(&boot), "{tokens}");
    assert!(tokens.contains(&accessor));
    for (method, path, body) in writes_refused_to_readers(&job_body) {
        let a = agent.http(&request(method, path, Some(&ro), &body))?;
        assert_eq!(a.status, 403, "{method} {path}: {}", a.text());
    }

    // The same through Agent.ForwardHttp on the agent protocol port.
    let rt = tokio::runtime::Runtime::new()?;
    rt.block_on(async {
        assert_eq!(
            forward(&rpc, "PUT", "/v1/jobs", None, &job_body).await?,
            403
        );
        assert_eq!(forward(&rpc, "GET", "/v1/jobs", None, "").await?, 403);
        assert_eq!(
            forward(&rpc, "HEAD", "/v1/acl/tokens", None, "").await?,
            403
        );
        assert_eq!(
            forward(&rpc, "HEAD", "/v1/acl/tokens", Some(&ro), "").await?,
            403
        );
        assert_eq!(forward(&rpc, "GET", "/v1/jobs", Some(&ro), "").await?, 200);
        for (method, path, body) in writes_refused_to_readers(&job_body) {
            let status = forward(&rpc, method, path, Some(&ro), &body).await?;
            assert_eq!(status, 403, "forwarded {method} {path}");
        }
        assert_eq!(
            forward(&rpc, "PUT", "/v1/system/gc", Some(&boot), "{}").await?,
            200
        );
        anyhow::Ok(())
    })?;

    // The CLI without a token says why.
    let out = berth_tests::cli_at(&agent.http_addr, &["job", "status"])?;
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("permission denied"), "{stderr}");

    // Every write is in the audit log with the accessor that made it.
    let me = json_of(&agent, &["acl", "token", "self", "-json"])?;
    let boot_accessor = me["accessor_id"].as_str().context("accessor")?.to_string();
    let log = agent.log();
    assert!(
        log.lines().any(|l| l.contains("API write")
            && l.contains("acl_accessor")
            && l.contains(&boot_accessor)),
        "no audit line in:\n{log}"
    );
    // A server with a client on its host says what tasks can read there.
    assert!(
        log.contains("runs the server and the client role on one host"),
        "no warning that tasks can read the server's keyring:\n{log}"
    );
    // The token secrets never reach the log.
    assert!(
        !log.contains(&ro) && !log.contains(&boot),
        "a token secret is in the log"
    );

    // A deleted token is refused at once.
    agent.cli_ok(&["acl", "token", "delete", &accessor])?;
    assert_eq!(
        agent
            .http(&request("GET", "/v1/jobs", Some(&ro), ""))?
            .status,
        403
    );
    Ok(())
}
