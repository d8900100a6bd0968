//! A client-only agent serves the HTTP API: its node-local routes itself,
//! the rest forwarded to a server over its agent protocol connection. The
//! CLI works pointed at it; with the server gone, the node-local routes
//! still answer and forwarded ones fail fast with a 503.

use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use berth_tests::{
    api_get_at, cli_at, cli_json_at, free_port, http_at, quick_batch_job, run_job_at, wait_for,
    Agent,
};
use serde_json::Value;

#[test]
fn the_cli_works_through_a_client_agent_which_answers_its_own_routes_without_the_server(
) -> Result<()> {
    let server_http = format!("127.0.0.1:{}", free_port());
    let (mut server, rpc) = Agent::start_server(&server_http)?;
    let port = free_port();
    let client_http = format!("127.0.0.1:{port}");
    let addr = format!("http://{client_http}");
    let mut client = Agent::start_client(&[], &rpc, "c1", &client_http)?;
    let logs = |s: &Agent, c: &Agent| format!("server log:\n{}\nclient log:\n{}", s.log(), c.log());

    // The node registers; node status through the client agent shows it.
    wait_for("the node ready", Duration::from_secs(30), || {
        server.check_running()?;
        client.check_running()?;
        let Ok(nodes) = cli_json_at(&addr, &["node", "status", "-json"]) else {
            return Ok(None);
        };
        let ready = nodes
            .as_array()
            .into_iter()
            .flatten()
            .any(|n| n["name"] == "c1" && n["status"] == "ready");
        Ok(ready.then_some(()))
    })
    .with_context(|| logs(&server, &client))?;
    let me = api_get_at(port, "/v1/agent/self")?;
    assert_eq!(me["roles"], serde_json::json!(["client"]), "{me}");
    assert_eq!(me["client"]["node_name"], "c1", "{me}");
    assert_eq!(me["client"]["registered"], true, "{me}");
    assert_eq!(me["servers"], serde_json::json!([rpc]), "{me}");
    // A server agent answers it too, as a server.
    let server_port: u16 = server_http
        .rsplit_once(':')
        .and_then(|(_, p)| p.parse().ok())
        .context("the server's HTTP port")?;
    let server_me = api_get_at(server_port, "/v1/agent/self")?;
    assert_eq!(
        server_me["roles"],
        serde_json::json!(["server"]),
        "{server_me}"
    );
    assert_eq!(server_me["rpc_addr"], rpc.as_str(), "{server_me}");
    assert!(server_me.get("client").is_none(), "{server_me}");

    // job run and job status through the client agent.
    run_job_at(
        &addr,
        client.data_dir.path(),
        "hello",
        &quick_batch_job("hello", 1),
    )
    .with_context(|| logs(&server, &client))?;
    let alloc_id = wait_for("the alloc complete", Duration::from_secs(60), || {
        let status = cli_json_at(&addr, &["job", "status", "-json", "hello"])?;
        let allocs = status["allocations"]
            .as_array()
            .cloned()
            .unwrap_or_default();
        Ok(allocs
            .iter()
            .find(|a| a["client_status"] == "complete")
            .and_then(|a| a["id"].as_str().map(str::to_string)))
    })
    .with_context(|| logs(&server, &client))?;
    // The client lists the alloc as it sees it.
    let mine = api_get_at(port, "/v1/client/allocations")?;
    let listed = mine
        .as_array()
        .into_iter()
        .flatten()
        .find(|a| a["id"] == alloc_id.as_str())
        .cloned()
        .with_context(|| format!("alloc {alloc_id} in {mine}"))?;
    assert_eq!(listed["job_id"], "hello", "{listed}");
    assert_eq!(listed["client_status"], "complete", "{listed}");
    let one = api_get_at(port, &format!("/v1/client/allocation/{alloc_id}"))?;
    assert_eq!(one["id"], alloc_id.as_str(), "{one}");

    // Through the client agent, a list's index and next-page headers come
    // back from the server as they were sent, a blocking query waits its
    // wait there, and the API's description is the agent's own.
    run_job_at(
        &addr,
        client.data_dir.path(),
        "hello2",
        &quick_batch_job("hello2", 1),
    )
    .with_context(|| logs(&server, &client))?;
    let get = |path: &str| {
        http_at(
            port,
            &format!("GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n"),
        )
    };
    let page = get("/v1/jobs?per_page=1")?;
    assert_eq!(page.status, 200, "{}", page.head);
    assert_eq!(
        page.header("x-berth-nexttoken"),
        Some("hello2"),
        "{}",
        page.head
    );
    let index: u64 = page
        .header("x-berth-index")
        .and_then(|v| v.parse().ok())
        .with_context(|| format!("an index in {}", page.head))?;
    let ids: Value = serde_json::from_slice(&page.body)?;
    assert_eq!(ids.as_array().map(Vec::len), Some(1), "{ids}");
    assert_eq!(ids[0]["id"], "hello", "{ids}");
    // It answers after its wait, or earlier for a write to the jobs (the
    // batch job finishing).
    let started = Instant::now();
    let blocked = get(&format!("/v1/job/hello2?index={index}&wait=1s"))?;
    assert_eq!(blocked.status, 200, "{}", blocked.head);
    let after: u64 = blocked
        .header("x-berth-index")
        .and_then(|v| v.parse().ok())
        .with_context(|| format!("an index in {}", blocked.head))?;
    assert!(
        started.elapsed() >= Duration::from_secs(1) || after > index,
        "a blocking query at index {index} answered early at {after}"
    );
    let doc = api_get_at(port, "/v1/openapi.json")?;
    assert_eq!(doc["openapi"], "3.1.0");
    assert!(doc["paths"]["/v1/jobs"]["get"].is_object());

    // The server goes away. The node-local routes still answer; a
    // forwarded route answers 503 in the one error shape, quickly.
    server.kill()?;
    let after = api_get_at(port, "/v1/agent/self")?;
    assert_eq!(
        after["client"]["node_id"], me["client"]["node_id"],
        "{after}"
    );
    let mine = api_get_at(port, "/v1/client/allocations")?;
    assert!(mine.to_string().contains(&alloc_id), "{mine}");
    let started = Instant::now();
    let answer = http_at(
        port,
        "GET /v1/jobs HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n",
    )?;
    let took = started.elapsed();
    assert_eq!(answer.status, 503, "{}", answer.head);
    let body: Value = serde_json::from_slice(&answer.body)?;
    assert!(
        body["error"]
            .as_str()
            .unwrap_or_default()
            .starts_with("servers unreachable: "),
        "{body}"
    );
    assert!(took < Duration::from_secs(15), "the 503 took {took:?}");
    // The CLI says so too, and the client agent keeps running.
    let out = cli_at(&addr, &["job", "status", "hello"])?;
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("servers unreachable"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    client.check_running()?;
    Ok(())
}
