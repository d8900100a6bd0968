//! `berth alloc stop | restart | signal` against a dev agent: a stopped
//! alloc frees its volume claim and is replaced; a restart starts the task
//! again in place without counting against the restart policy; a signal to
//! a task that does not run is an error that says so.

use std::time::Duration;

use anyhow::{Context, Result};
use berth_tests::snapshot::settings;
use berth_tests::{
    csi_volume_service_job, recorded_task_pid, sleeping_service_job, strs, task_events, wait_for,
    DevAgent,
};
use serde_json::Value;

/// Waits for the one running alloc of `job` whose ID is not `other`.
fn wait_running(agent: &DevAgent, job: &str, other: Option<&str>) -> Result<Value> {
    wait_for(
        &format!("a running alloc of {job}"),
        Duration::from_secs(60),
        || {
            Ok(agent.job_allocs(job)?.into_iter().find(|a| {
                a["client_status"] == "running" && Some(a["id"].as_str().unwrap_or("")) != other
            }))
        },
    )
    .with_context(|| agent.log())
}

fn id(alloc: &Value) -> String {
    alloc["id"].as_str().unwrap_or_default().to_string()
}

#[test]
fn alloc_stop_of_a_service_alloc_frees_its_volume_claim_and_a_replacement_runs() -> Result<()> {
    let agent = DevAgent::start()?;
    agent.run_plugin_and_create_volume()?;
    agent.run_job(
        "writer",
        &csi_volume_service_job("writer", "w", &["-c", "sleep 300"]),
    )?;
    let old = id(&wait_running(&agent, "writer", None)?);
    let vol = agent.cli_json(&["volume", "status", "data"])?;
    assert_eq!(strs(&vol["write_allocs"]), vec![old.clone()], "{vol}");

    // Waits until the client has stopped the alloc, then says how it ended
    // and what replaced it.
    let out = agent.cli_ok(&["alloc", "stop", &old[..8]])?;
    let stopped = agent.api_get(&format!("/v1/allocation/{old}"))?;
    assert_eq!(stopped["desired_status"], "stop", "{stopped}");
    assert!(
        matches!(
            stopped["client_status"].as_str(),
            Some("complete" | "failed")
        ),
        "the CLI returned before the client stopped the alloc: {stopped}\n{out}"
    );
    assert!(out.contains(&old), "{out}");
    assert!(out.contains("Replacement"), "{out}");

    // The claim goes from the old alloc to its replacement, which runs.
    let new = id(&wait_running(&agent, "writer", Some(&old))?);
    assert!(
        out.contains(&new[..8]),
        "the replacement {new} is not named:\n{out}"
    );
    settings().bind(|| insta::assert_snapshot!("alloc_stop_done", out));
    wait_for(
        "the volume claimed by the replacement alone",
        Duration::from_secs(60),
        || {
            let vol = agent.cli_json(&["volume", "status", "data"])?;
            Ok((strs(&vol["write_allocs"]) == vec![new.clone()]).then_some(()))
        },
    )
    .with_context(|| agent.log())?;

    // The stopped alloc's tasks no longer run: a signal is refused.
    let out = agent.cli(&["alloc", "signal", &old])?;
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.starts_with(&format!(
            "Error: the alloc is {}",
            stopped["client_status"].as_str().unwrap_or_default()
        )),
        "{stderr}"
    );
    // An alloc nobody knows.
    let out = agent.cli(&["alloc", "stop", "ffffffff-0000"])?;
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(stderr.contains("\"ffffffff-0000\" not found"), "{stderr}");
    Ok(())
}

#[test]
fn alloc_restart_starts_the_task_again_without_counting_a_restart() -> Result<()> {
    let agent = DevAgent::start()?;
    agent.run_job("sleepy", &sleeping_service_job("sleepy", 1, 1))?;
    let alloc = id(&wait_running(&agent, "sleepy", None)?);
    let data = agent.data_dir.path();
    let pid = recorded_task_pid(data, &alloc, "sleep")?;

    let out = agent.cli_ok(&["alloc", "restart", &alloc[..8], "sleep"])?;
    settings().bind(|| insta::assert_snapshot!("alloc_restart_done", out));
    let view = wait_for(
        "the task running again with a new process",
        Duration::from_secs(30),
        || {
            let v = agent.api_get(&format!("/v1/client/allocation/{alloc}"))?;
            let now = recorded_task_pid(data, &alloc, "sleep").ok();
            let running = v["task_states"]["sleep"]["state"] == "running";
            Ok((running && now.is_some_and(|p| p != pid)).then_some(v))
        },
    )
    .with_context(|| agent.log())?;
    assert_eq!(view["task_states"]["sleep"]["restarts"], 0, "{view}");
    let events = task_events(&view, "sleep");
    assert!(
        events
            .iter()
            .any(|(kind, msg, _)| kind == "Restart Signaled" && msg == "user requested restart"),
        "{events:?}"
    );
    // In place: the same alloc, not a replacement.
    assert_eq!(agent.job_allocs("sleepy")?.len(), 1);
    Ok(())
}

/// A batch job whose task `done` exits at once while `sleep` runs on.
const HALF_DONE_JOB: &str = r#"
job "half" {
  type = "batch"
  group "g" {
    task "done" {
      driver = "raw_exec"
      config {
        command = "/bin/true"
      }
      resources {
        cpu    = 10
        memory = 8
      }
    }
    task "sleep" {
      driver = "raw_exec"
      config {
        command = "/bin/sleep"
        args    = ["300"]
      }
      resources {
        cpu    = 10
        memory = 8
      }
    }
  }
}
"#;

#[test]
fn alloc_signal_to_a_dead_task_fails_with_a_message_that_says_so() -> Result<()> {
    let agent = DevAgent::start()?;
    agent.run_job("half", HALF_DONE_JOB)?;
    let alloc = id(&wait_running(&agent, "half", None)?);
    wait_for("task done to be dead", Duration::from_secs(30), || {
        let v = agent.api_get(&format!("/v1/client/allocation/{alloc}"))?;
        Ok((v["task_states"]["done"]["state"] == "dead").then_some(()))
    })?;

    let out = agent.cli(&["alloc", "signal", "-s", "SIGHUP", &alloc, "done"])?;
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert_eq!(stderr.lines().count(), 1, "{stderr}");
    assert!(
        stderr.starts_with("Error: task \"done\" is not running (it is dead)"),
        "{stderr}"
    );

    // An unknown signal is named.
    let out = agent.cli(&["alloc", "signal", "-s", "SIGNOPE", &alloc, "sleep"])?;
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(stderr.contains("\"SIGNOPE\""), "{stderr}");

    // The running task takes one; Nomad's default is SIGKILL.
    let out = agent.cli_ok(&["alloc", "signal", "-s", "HUP", &alloc, "sleep"])?;
    assert!(out.contains("SIGHUP"), "{out}");
    settings().bind(|| insta::assert_snapshot!("alloc_signal_sent", out));
    let v = agent.api_get(&format!("/v1/client/allocation/{alloc}"))?;
    assert!(
        task_events(&v, "sleep")
            .iter()
            .any(|(kind, msg, _)| kind == "Signaling" && msg.contains("SIGHUP")),
        "{v}"
    );
    Ok(())
}
