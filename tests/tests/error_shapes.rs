//! Errors as a user meets them, against a real dev agent: the API answers
//! every error in one shape on the wire, the CLI prints one line, and a
//! second agent on a data dir that one already uses stops at once.

use std::process::{Command, Stdio};
use std::time::Duration;

use anyhow::{bail, Context, Result};
use berth_tests::{binary, free_port, wait_for, DevAgent, HttpAnswer};
use serde_json::Value;

/// The message of an error answer in the one shape.
fn error_of(answer: &HttpAnswer) -> Result<String> {
    let (status, body) = (answer.status, &answer.body);
    let ct = answer.header("content-type").unwrap_or_default();
    let text = String::from_utf8_lossy(body);
    if !ct.starts_with("application/json") {
        bail!("{status}: content-type {ct:?}, body {text:?}");
    }
    let v: Value = serde_json::from_slice(body).with_context(|| format!("{status}: {text:?}"))?;
    match v.as_object().map(|o| (o.len(), o.get("error"))) {
        Some((1, Some(Value::String(m)))) => Ok(m.clone()),
        _ => bail!("{status}: {v} is not {{\"error\": \"...\"}}"),
    }
}

fn request(method: &str, path: &str, content_type: Option<&str>, body: &str) -> String {
    let ct = content_type
        .map(|c| format!("Content-Type: {c}\r\n"))
        .unwrap_or_default();
    format!(
        "{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n{ct}Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )
}

#[test]
fn every_api_error_has_one_shape_on_the_wire() -> Result<()> {
    let agent = DevAgent::start()?;
    let cases = [
        (
            request("GET", "/v1/foo", None, ""),
            404,
            "unknown API path /v1/foo".to_string(),
        ),
        (
            request("POST", "/v1/jobs", None, ""),
            405,
            "method POST is not allowed on /v1/jobs (allowed: GET, HEAD, PUT)".to_string(),
        ),
        (
            request("PUT", "/v1/jobs", Some("text/plain"), "{}"),
            415,
            "request body must be JSON: content-type is \"text/plain\", expected application/json"
                .to_string(),
        ),
        (
            request("PUT", "/v1/jobs", Some("application/json"), r#"{"job": }"#),
            400,
            "invalid JSON at line 1 column 9: expected value".to_string(),
        ),
        (
            request("PUT", "/v1/jobs", Some("application/json"), "{}"),
            422,
            "missing field \"job\"".to_string(),
        ),
        (
            request("DELETE", "/v1/volume/csi/v?force=maybe", None, ""),
            400,
            "invalid query string \"force=maybe\": force: provided string was not \"true\" or \"false\""
                .to_string(),
        ),
        (
            // Announced larger than the limit: answered before it is sent.
            "PUT /v1/jobs HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n\
             Content-Length: 3145728\r\nConnection: close\r\n\r\n"
                .to_string(),
            413,
            "request body is larger than the 2 MiB limit".to_string(),
        ),
        (
            request("GET", "/v1/job/nosuchjob", None, ""),
            404,
            String::new(),
        ),
    ];
    for (req, want_status, want_message) in cases {
        let first_line = req.lines().next().unwrap_or_default().to_string();
        let answer = agent.http(&req).with_context(|| first_line.clone())?;
        assert_eq!(answer.status, want_status, "{first_line}");
        let message = error_of(&answer).with_context(|| first_line.clone())?;
        if want_message.is_empty() {
            assert!(message.contains("nosuchjob"), "{first_line}: {message}");
        } else {
            assert_eq!(message, want_message, "{first_line}");
        }
    }

    // The CLI shows the API's message on one line, exit 1.
    let out = agent.cli(&["job", "status", "nosuchjob"])?;
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    let lines: Vec<&str> = err.lines().collect();
    assert_eq!(lines.len(), 1, "{err}");
    assert!(lines[0].starts_with("Error: "), "{err}");
    assert!(lines[0].contains("nosuchjob"), "{err}");
    assert!(lines[0].ends_with("(HTTP 404)"), "{err}");
    Ok(())
}

#[test]
fn a_second_agent_on_the_same_data_dir_fails_at_once_with_one_line() -> Result<()> {
    let agent = DevAgent::start()?;
    let first_pid = agent.pid().context("the first agent runs")?;
    let data_dir = std::fs::canonicalize(agent.data_dir.path())?;
    let mut second = Command::new(binary("berth"))
        .args(["agent", "-dev", "-data-dir"])
        .arg(agent.data_dir.path())
        .args(["-http-addr", &format!("127.0.0.1:{}", free_port())])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()?;
    let exited = wait_for("the second agent to exit", Duration::from_secs(15), || {
        Ok(second.try_wait()?)
    });
    if exited.is_err() {
        let _ = second.kill();
        let _ = second.wait();
        bail!("the second agent did not stop on a data dir in use");
    }
    let out = second.wait_with_output()?;
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert_eq!(
        err.trim_end(),
        format!(
            "Error: data dir {} is in use by another berth agent (pid {first_pid}); \
             stop it or use another -data-dir",
            data_dir.display()
        )
    );
    assert!(
        out.stdout.is_empty(),
        "{}",
        String::from_utf8_lossy(&out.stdout)
    );

    // The first one is untouched.
    let nodes = agent.cli_json(&["node", "status"])?;
    assert!(
        nodes
            .as_array()
            .is_some_and(|a| a.iter().any(|n| n["status"] == "ready")),
        "{nodes}"
    );
    assert_eq!(
        std::fs::read_to_string(data_dir.join("agent.lock"))?.trim(),
        first_pid.to_string()
    );
    Ok(())
}

#[test]
fn an_agent_restarted_on_its_data_dir_takes_it_over_while_tasks_run() -> Result<()> {
    // Tasks and executors outlive the agent; they must not hold its lock.
    let mut agent = DevAgent::start()?;
    let job = agent.data_dir.path().join("sleeper.hcl");
    std::fs::write(
        &job,
        r#"
job "sleeper" {
  group "g" {
    task "t" {
      driver = "raw_exec"
      config {
        command = "/bin/sleep"
        args    = ["300"]
      }
    }
  }
}
"#,
    )?;
    agent.cli_ok(&["job", "run", job.to_str().context("path")?])?;
    agent.stop_agent()?;
    // The next agent on the data dir starts and is ready.
    agent.start_again()?;
    let status = agent.cli_json(&["job", "status", "sleeper"])?;
    assert_eq!(
        status["allocations"][0]["client_status"], "running",
        "{status}"
    );
    Ok(())
}
