//! No claim is stuck and no placement failure floods the output, on a dev
//! agent with the real binary, the example hostpath plugin and real mounts.

use std::time::Duration;

use anyhow::{bail, Context, Result};
use berth_tests::{example, example_with, only_alloc, strs, wait_for, DevAgent};
use serde_json::Value;

/// Runs the CLI; its exit code, stdout and stderr.
fn run(agent: &DevAgent, args: &[&str]) -> Result<(Option<i32>, String, String)> {
    let out = agent.cli(args)?;
    Ok((
        out.status.code(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    ))
}

/// The node's events with `message` about `alloc_id`.
fn events_about(node: &Value, message: &str, alloc_id: &str) -> Vec<Value> {
    node["events"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|e| e["message"] == message && e["details"]["alloc_id"] == alloc_id)
        .cloned()
        .collect()
}

#[test]
fn volume_detach_ends_a_claim_whose_node_cannot_unmount_and_its_retries_leave_one_event(
) -> Result<()> {
    let agent = DevAgent::start()?;

    // The plugin cannot unpublish: every NodeUnpublishVolume fails.
    let failing = example_with(
        "jobs/hostpath-plugin.hcl",
        "args = [",
        "args = [\"--fail=NodeUnpublishVolume=internal\", ",
    )?;
    let plugin_file = agent.write_file("plugin.hcl", &failing)?;
    agent.cli_ok(&["job", "run", "-detach", &plugin_file])?;
    agent.wait_plugin_healthy("hostpath")?;

    // A volume of a plugin nobody runs is refused, saying how to fix it.
    let volume = std::fs::read_to_string(example("volumes/hostpath.hcl"))?;
    let unknown = agent.write_file(
        "unknown-plugin.hcl",
        &format!(
            "{}\nexternal_id = \"ext-other\"\n",
            volume
                .replace("\"hostpath\"", "\"nosuchplugin\"")
                .replace("\"data\"", "\"other\"")
        ),
    )?;
    let (code, _, stderr) = run(&agent, &["volume", "register", &unknown])?;
    assert_eq!(code, Some(1), "{stderr}");
    assert!(
        stderr.contains("no CSI plugin named \"nosuchplugin\"")
            && stderr.contains("run the plugin's job first"),
        "{stderr}"
    );

    agent.cli_ok(&["volume", "create", &example("volumes/hostpath.hcl")])?;

    // The writer runs; its volume cannot be unmounted, so its claim stays
    // while the client (and then the servers) retry the unmount.
    agent.cli_ok(&["job", "run", "-detach", &example("jobs/writer.hcl")])?;
    let writer_id = wait_for("the writer's claim", Duration::from_secs(60), || {
        let vol = agent.cli_json(&["volume", "status", "data"])?;
        Ok(strs(&vol["write_allocs"]).pop())
    })?;
    let writer = agent.cli_json(&["alloc", "status", &writer_id])?;
    let node_id = writer["node_id"].as_str().unwrap_or_default().to_string();

    // However many times the unmount is retried, the node keeps one event
    // per distinct error, with a count.
    let failed_unmounts = |min_count: u64| -> Result<Option<Vec<Value>>> {
        let node = agent.cli_json(&["node", "status", &node_id])?;
        let failed: Vec<Value> = events_about(&node, "Unmount volume", &writer_id)
            .into_iter()
            .filter(|e| e["details"]["success"] == "false")
            .collect();
        let retried = failed
            .iter()
            .any(|e| e["count"].as_u64() >= Some(min_count));
        Ok(retried.then_some(failed))
    };
    wait_for(
        "failed unmounts folded into one event",
        Duration::from_secs(60),
        || failed_unmounts(3),
    )
    .with_context(|| agent.log())?;

    // While the alloc has not stopped on its node, the claim is refused.
    let alloc = agent.cli_json(&["alloc", "status", &writer_id])?;
    if !matches!(alloc["client_status"].as_str(), Some("complete" | "failed")) {
        let (code, stdout, stderr) = run(&agent, &["volume", "detach", "data", &node_id])?;
        assert_eq!(code, Some(1), "{stdout}{stderr}");
        assert!(stderr.contains("has not stopped on its node"), "{stderr}");
    }

    // The client gives up on the unmount (after its retry budget) and the
    // alloc ends; the claim stays.
    wait_for("the writer to end", Duration::from_secs(240), || {
        let a = only_alloc(&agent, "writer")?;
        Ok(matches!(a["client_status"].as_str(), Some("complete" | "failed")).then_some(()))
    })?;
    let failed = failed_unmounts(1)?.unwrap_or_default();
    let mut errors: Vec<&str> = failed
        .iter()
        .map(|e| e["details"]["error"].as_str().unwrap_or_default())
        .collect();
    let all = errors.len();
    errors.sort_unstable();
    errors.dedup();
    assert_eq!(
        errors.len(),
        all,
        "one event per distinct error: {failed:#?}"
    );
    assert!(
        errors.iter().any(|e| e.contains("NodeUnpublishVolume")),
        "{errors:?}"
    );
    let retries: u64 = failed.iter().filter_map(|e| e["count"].as_u64()).sum();
    assert!(retries >= 3, "{failed:#?}");
    let vol = agent.cli_json(&["volume", "status", "data"])?;
    assert_eq!(strs(&vol["write_allocs"]), vec![writer_id.clone()], "{vol}");

    // An unknown node is named, not answered with success.
    let (code, stdout, stderr) = run(&agent, &["volume", "detach", "data", "nosuchnode"])?;
    assert_eq!(code, Some(1), "{stdout}{stderr}");
    assert!(stderr.contains("node \"nosuchnode\" not found"), "{stderr}");

    // The operator ends the claim, by node name: it is freed although the
    // node cannot unmount, and the CLI says what failed.
    let node = agent.cli_json(&["node", "status", &node_id])?;
    let node_name = node["name"].as_str().unwrap_or_default().to_string();
    let (code, stdout, stderr) = run(&agent, &["volume", "detach", "data", &node_name])?;
    assert_eq!(code, Some(0), "{stdout}{stderr}");
    assert!(
        stdout.contains(&format!(
            "Warning: node {node_name} could not unmount volume \"data\" for alloc {writer_id}"
        )),
        "{stdout}"
    );
    assert!(
        stdout.contains(&format!("released the claims of 1 alloc ({writer_id})")),
        "{stdout}"
    );
    let vol = agent.cli_json(&["volume", "status", "data"])?;
    assert!(
        strs(&vol["write_allocs"]).is_empty() && strs(&vol["read_allocs"]).is_empty(),
        "{vol}"
    );
    let node = agent.cli_json(&["node", "status", &node_id])?;
    let forced = events_about(
        &node,
        "Volume claim freed despite a failed detach",
        &writer_id,
    );
    assert_eq!(forced.len(), 1, "{forced:#?}");
    assert_eq!(forced[0]["subsystem"], "Storage");

    // Nothing is left to detach there now.
    let (code, stdout, _) = run(&agent, &["volume", "detach", "data", &node_id])?;
    assert_eq!(code, Some(0), "{stdout}");
    assert!(
        stdout.contains(&format!(
            "volume \"data\" has no claims on node \"{node_id}\"; nothing to detach"
        )),
        "{stdout}"
    );
    // The publish the plugin could not undo stays mounted until the agent
    // and its harness go (the harness unmounts everything on drop).
    Ok(())
}

#[test]
fn job_run_summarizes_placement_failures_and_says_how_many_allocs_were_placed() -> Result<()> {
    let agent = DevAgent::start()?;
    let nodes = agent.cli_json(&["node", "status"])?;
    let memory = nodes[0]["resources"]["memory_mb"].as_u64().unwrap_or(0);
    if memory < 2 {
        bail!("the dev node reports {memory} MiB of memory: {nodes}");
    }
    // Two allocs fit in memory; the other 9998 of the largest count a job
    // may have do not, all for the same reason.
    let job = format!(
        r#"
job "many" {{
  group "g" {{
    count = 10000
    task "t" {{
      driver = "raw_exec"
      config {{
        command = "/bin/sleep"
        args    = ["300"]
      }}
      resources {{
        cpu    = 1
        memory = {}
      }}
    }}
  }}
}}
"#,
        memory / 2
    );
    let file = agent.write_file("many.hcl", &job)?;
    let (code, stdout, stderr) = run(&agent, &["job", "run", &file])?;
    assert_eq!(code, Some(2), "{stdout}{stderr}");
    let lines: Vec<&str> = stdout
        .lines()
        .filter(|l| l.contains("not placed"))
        .collect();
    assert_eq!(lines.len(), 1, "one line per distinct reason:\n{stdout}");
    assert!(
        lines[0].contains("group \"g\": 9998 of 10000 allocs not placed: ")
            && lines[0].contains("memory exhausted")
            && lines[0].contains("(9998 allocs: index 2-9999)"),
        "{stdout}"
    );
    assert!(
        stdout.contains(
            "2 of 10000 allocs placed; the job runs with them and waits for capacity for the rest"
        ),
        "{stdout}"
    );
    assert!(stdout.len() < 4096, "a summary, not a flood:\n{stdout}");

    // The job's status carries the same summary.
    let status = agent.cli_json(&["job", "status", "many"])?;
    assert_eq!(strs(&status["placement_failures"]).len(), 1, "{status}");
    Ok(())
}
