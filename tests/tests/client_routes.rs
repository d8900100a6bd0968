//! The node-local client routes of an alloc (its status as the client sees
//! it, restart, signal) reached through any agent: one server and two
//! clients, the alloc on client A, asked through the server's address and
//! through client B's. The server sends them to A over A's call stream; B
//! forwards them to the server first.

use std::path::PathBuf;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use berth_tests::cluster::{Client, Server};
use berth_tests::{
    cli_json_at, cli_ok_at, http_at, recorded_task_pid, task_events, wait_for, HttpAnswer,
};
use serde_json::{json, Value};

/// A service job whose task says `started` on stdout and traps SIGUSR1,
/// writing a line to `local/usr1` in its task dir each time it gets one.
fn trapping_job(id: &str) -> String {
    format!(
        r#"
job "{id}" {{
  type = "service"
  group "g" {{
    task "t" {{
      driver = "raw_exec"
      config {{
        command = "/bin/sh"
        args    = ["-c", "echo started; trap 'echo usr1 >> \"$BERTH_TASK_DIR/local/usr1\"' USR1; while true; do sleep 0.1; done"]
      }}
      resources {{
        cpu    = 10
        memory = 8
      }}
    }}
  }}
}}
"#
    )
}

/// Sends `method path` with a JSON `body` (none when `None`) to the HTTP
/// API on `port`.
fn request(port: u16, method: &str, path: &str, body: Option<&Value>) -> Result<HttpAnswer> {
    let body = body.map(Value::to_string).unwrap_or_default();
    let content_type = if body.is_empty() {
        String::new()
    } else {
        "Content-Type: application/json\r\n".to_string()
    };
    http_at(
        port,
        &format!(
            "{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n{content_type}Content-Length: {}\r\n\r\n{body}",
            body.len()
        ),
    )
    .with_context(|| format!("{method} {path}"))
}

/// The JSON of an answer that must have `status`.
fn expect(answer: &HttpAnswer, status: u16, what: &str) -> Result<Value> {
    let body = String::from_utf8_lossy(&answer.body);
    if answer.status != status {
        bail!("{what}: expected {status}, got {}\n{body}", answer.head);
    }
    serde_json::from_slice(&answer.body).with_context(|| format!("{what}: decoding {body:?}"))
}

/// How many SIGUSR1 the task has trapped so far.
fn trapped(marker: &PathBuf) -> usize {
    std::fs::read_to_string(marker)
        .map(|s| s.lines().count())
        .unwrap_or(0)
}

/// Starts a server and client "a" (behind a relay when `relayed`), runs
/// the trapping job on "a", then starts client "b"; the cluster and the
/// alloc's ID.
fn cluster_with_alloc_on_a(job: &str, relayed: bool) -> Result<(Server, Client, Client, String)> {
    let mut server = Server::start("")?;
    let a = Client::start(&server, "a", relayed, "")?;
    let a_id = server.wait_nodes_ready(&["a"])?.remove(0);
    server.run_job(job, &trapping_job(job))?;
    let alloc_id = wait_for("the alloc running on a", Duration::from_secs(60), || {
        let allocs = server.allocs(job)?;
        Ok(allocs
            .iter()
            .find(|al| al["client_status"] == "running" && al["node_id"] == a_id.as_str())
            .and_then(|al| al["id"].as_str())
            .map(str::to_string))
    })?;
    let b = Client::start(&server, "b", false, "")?;
    server.wait_nodes_ready(&["a", "b"])?;
    Ok((server, a, b, alloc_id))
}

#[test]
fn an_allocs_client_routes_answer_through_the_server_and_through_another_client() -> Result<()> {
    let (server, a, b, alloc_id) = cluster_with_alloc_on_a("trap", false)?;
    let marker = a
        .agent
        .data_path()
        .join("alloc")
        .join(&alloc_id)
        .join("t/local/usr1");
    let prefix = &alloc_id[..8];

    for (via, port) in [("the server", server.http_port), ("client b", b.http_port)] {
        // The alloc as its client sees it, by unique prefix.
        let view = expect(
            &request(
                port,
                "GET",
                &format!("/v1/client/allocation/{prefix}"),
                None,
            )?,
            200,
            &format!("alloc status through {via}"),
        )?;
        assert_eq!(view["id"], alloc_id.as_str(), "through {via}: {view}");
        assert_eq!(view["task_states"]["t"]["state"], "running", "{view}");

        let addr = format!("http://127.0.0.1:{port}");
        let status = cli_json_at(&addr, &["alloc", "status", "-json", prefix])?;
        assert_eq!(status["id"], alloc_id.as_str(), "through {via}: {status}");

        // The task's log, raw, with the cursor's headers.
        let logs = request(
            port,
            "GET",
            &format!("/v1/client/fs/logs/{prefix}?task=t&type=stdout"),
            None,
        )?;
        assert_eq!(logs.status, 200, "logs through {via}: {}", logs.head);
        assert!(
            String::from_utf8_lossy(&logs.body).starts_with("started\n"),
            "logs through {via}: {:?}",
            String::from_utf8_lossy(&logs.body)
        );
        assert!(logs.header("x-berth-log-offset").is_some(), "{}", logs.head);
        assert!(logs.header("x-berth-log-file").is_some(), "{}", logs.head);
        let out = cli_ok_at(&addr, &["alloc", "logs", prefix, "t"])?;
        assert!(
            out.starts_with("started\n"),
            "alloc logs through {via}: {out:?}"
        );

        // A signal reaches the task: it traps it.
        let before = trapped(&marker);
        let answer = cli_json_at(
            &addr,
            &["alloc", "signal", "-json", "-s", "SIGUSR1", prefix, "t"],
        )?;
        assert_eq!(answer["signal"], "SIGUSR1", "{answer}");
        assert_eq!(answer["tasks"], json!(["t"]), "{answer}");
        wait_for(
            &format!("the task to trap the SIGUSR1 sent through {via}"),
            Duration::from_secs(10),
            || Ok((trapped(&marker) > before).then_some(())),
        )?;

        // A restart starts the task again in place: a new process, the
        // restart policy's count unchanged.
        let pid = recorded_task_pid(&a.agent.data_path(), &alloc_id, "t")?;
        let restarts = view["task_states"]["t"]["restarts"].as_u64();
        let out = cli_ok_at(&addr, &["alloc", "restart", prefix, "t"])?;
        assert!(out.contains(&alloc_id), "{out}");
        let view = wait_for(
            &format!("the task running again after the restart through {via}"),
            Duration::from_secs(30),
            || {
                let now = recorded_task_pid(&a.agent.data_path(), &alloc_id, "t").ok();
                let v = a.get(&format!("/v1/client/allocation/{alloc_id}"))?;
                let running = v["task_states"]["t"]["state"] == "running";
                Ok((running && now.is_some_and(|p| p != pid)).then_some(v))
            },
        )?;
        assert_eq!(
            view["task_states"]["t"]["restarts"].as_u64(),
            restarts,
            "{view}"
        );
        let events: Vec<String> = task_events(&view, "t")
            .into_iter()
            .map(|(kind, message, _)| format!("{kind}: {message}"))
            .collect();
        assert!(
            events
                .iter()
                .any(|e| e == "Restart Signaled: user requested restart"),
            "{events:?}"
        );
        assert!(
            events.iter().any(|e| e.starts_with("Signaling: ")),
            "{events:?}"
        );

        // Errors come back as the node answered them.
        let e = expect(
            &request(
                port,
                "POST",
                &format!("/v1/client/allocation/{prefix}/signal"),
                Some(&json!({"signal": "SIGNOPE"})),
            )?,
            400,
            &format!("an unknown signal through {via}"),
        )?;
        assert!(
            e["error"]
                .as_str()
                .unwrap_or_default()
                .contains("\"SIGNOPE\""),
            "{e}"
        );
        let e = expect(
            &request(
                port,
                "POST",
                &format!("/v1/client/allocation/{prefix}/restart"),
                Some(&json!({"task": "nope"})),
            )?,
            404,
            &format!("an unknown task through {via}"),
        )?;
        assert!(
            e["error"].as_str().unwrap_or_default().contains("\"nope\""),
            "{e}"
        );
    }
    Ok(())
}

#[test]
fn an_unknown_alloc_is_404_and_a_stopped_node_503_through_any_agent() -> Result<()> {
    let (server, mut a, b, alloc_id) = cluster_with_alloc_on_a("gone", false)?;
    for (via, port) in [("the server", server.http_port), ("client b", b.http_port)] {
        let e = expect(
            &request(port, "GET", "/v1/client/allocation/ffffffff-0000", None)?,
            404,
            &format!("an unknown alloc through {via}"),
        )?;
        assert!(
            e["error"]
                .as_str()
                .unwrap_or_default()
                .contains("ffffffff-0000"),
            "{e}"
        );
    }

    let node_id = server.node("a")?["id"]
        .as_str()
        .context("node a's ID")?
        .to_string();
    a.agent.stop()?;
    let not_connected = format!("node {node_id} is not connected");
    for (via, port) in [("the server", server.http_port), ("client b", b.http_port)] {
        let e = wait_for(
            &format!("a 503 through {via} for the alloc of the stopped node"),
            Duration::from_secs(30),
            || {
                let answer = request(
                    port,
                    "POST",
                    &format!("/v1/client/allocation/{alloc_id}/signal"),
                    Some(&json!({"signal": "SIGUSR1"})),
                )?;
                if answer.status != 503 {
                    return Ok(None);
                }
                Ok(Some(expect(&answer, 503, "the stopped node")?))
            },
        )?;
        assert_eq!(e["error"], not_connected.as_str(), "through {via}: {e}");
    }
    Ok(())
}

#[test]
fn a_partitioned_node_answers_503_naming_it_through_any_agent() -> Result<()> {
    let (server, a, b, alloc_id) = cluster_with_alloc_on_a("cut", true)?;
    let node_id = server.node("a")?["id"]
        .as_str()
        .context("node a's ID")?
        .to_string();
    // Packets dropped silently, no connection closed: the server finds
    // out from its keepalive, and a call in flight ends then.
    a.relay()?.partition();
    for (via, port) in [("the server", server.http_port), ("client b", b.http_port)] {
        let e = wait_for(
            &format!("a 503 through {via} for the alloc of the partitioned node"),
            Duration::from_secs(60),
            || {
                let answer = request(
                    port,
                    "GET",
                    &format!("/v1/client/allocation/{alloc_id}"),
                    None,
                )?;
                if answer.status != 503 {
                    return Ok(None);
                }
                Ok(Some(expect(&answer, 503, "the partitioned node")?))
            },
        )?;
        let message = e["error"].as_str().unwrap_or_default();
        assert!(
            message.contains(&format!("node {node_id} ")),
            "through {via}: {e}"
        );
    }
    Ok(())
}
